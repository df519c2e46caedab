//! The seller-API preset against a local mock of the seller API.
//!
//! The mock (an axum server on 127.0.0.1, in this process) enforces the published limits itself,
//! with a token bucket of its own written below (not burstgate's), per account (the
//! `Authorization` header) and per endpoint, and answers `429 Too Many Requests` with
//! `X-Ratelimit-Retry` and `Retry-After` when a bucket is empty. Sixteen workers, two per account
//! and endpoint for two accounts, call it through [`RateLimitMiddleware`] with the routes of
//! `burstgate::seller`. Every worker has far more pages to fetch than the budget allows, so the
//! budget is the bottleneck; the middleware makes each worker wait its turn (a generous
//! `max_wait`), so there is always a reservation queued and the bucket is never idle.
//!
//! Time is scaled: one minute of the real API is 500 ms here, so "1 per minute, burst 10" becomes
//! "1 per 500 ms, burst 10", and the run takes 12 s. The client spends the same limits under the
//! routes' default margin ([`Route::new`](burstgate::middleware::Route::new)): the mock's
//! buckets, like the real API's, start at the first request they *receive* and give no
//! tolerance, so a client at exactly the published rate is now and then early and earns a real
//! 429. At this scale the margin is 10 ms a token, 2% of the budget; against the real "1 per
//! minute", 600 ms, 1%. It prints a per-second timeline and ends
//! with one line, `requests: N, upstream 429: M, budget used: P%`, where the budget used is the
//! requests the mock admitted over the most it could have admitted: for each account and endpoint,
//! `burst + rate × elapsed`, from that bucket's first request to the end of the run.
//!
//! The mock reports `X-Ratelimit-Remaining` on every answer, as the real API does, and the
//! middleware follows it down. With `FOREIGN` set to a fraction (`FOREIGN=0.3`), a consumer inside
//! the mock also spends every bucket at that fraction of its rate, as the seller's own tools
//! would with the same token; the budget used is then of what it left. `FOLLOW=0` makes the
//! middleware ignore the reports, to see the difference.
//!
//! ```sh
//! cargo run --features seller --example seller_api
//! # Another integration spends 30% of every limit:
//! FOREIGN=0.3 cargo run --features seller --example seller_api
//! # The same on a shared bucket in Redis, through a reconnecting ConnectionManager:
//! REDIS_URL=redis://127.0.0.1:6380/ cargo run --features seller --example seller_api
//! ```

use std::collections::HashMap;
use std::error::Error;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use burstgate::middleware::RateLimitMiddleware;
use burstgate::seller::{self, Group};
use burstgate::{BucketStore, Limit, MemoryStore, RateLimited};
use http::Extensions;
use reqwest::header::AUTHORIZATION;
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};
use tokio::time::Instant;

/// One minute of the real API lasts `60 s / SCALE` here: 500 ms.
const SCALE: u32 = 120;

/// How long the workers run.
const RUN: Duration = Duration::from_secs(12);

/// The accounts, by their API tokens. The middleware hashes them into the bucket keys; the mock
/// keys its own buckets by them.
const ACCOUNTS: [&str; 2] = ["Bearer seller-1-token", "Bearer seller-2-token"];

/// Workers per account and endpoint: one sends while the other waits its turn.
const WORKERS_PER_BUCKET: usize = 2;

/// Pages each worker has to fetch: far more than the budget allows in the run.
const PAGES: u32 = 1_000;

/// The token type the routes are named after.
const TOKEN_TYPE: &str = "personal";

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let groups = seller::groups()
        .into_iter()
        .map(|g| {
            let limit = scaled(g.template().limit())?;
            Ok(g.limit(limit))
        })
        .collect::<Result<Vec<Group>, Box<dyn Error>>>()?;

    match std::env::var("REDIS_URL") {
        Ok(url) if !url.is_empty() => redis_run(&url, groups).await,
        _ => run(MemoryStore::new(), "the in-memory store", groups).await,
    }
}

#[cfg(feature = "redis")]
async fn redis_run(url: &str, groups: Vec<Group>) -> Result<(), Box<dyn Error>> {
    let conn = redis::Client::open(url)?.get_connection_manager().await?;
    // A prefix of its own per run, so a bucket left drained by an earlier run cannot start this
    // one half empty.
    let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?;
    let prefix = format!("seller-api-example-{}", started.as_millis());
    let store = burstgate::RedisStore::new(conn).prefix(&prefix)?;
    let label = format!("RedisStore over a ConnectionManager (prefix {prefix})");
    run(store, &label, groups).await
}

#[cfg(not(feature = "redis"))]
async fn redis_run(_url: &str, groups: Vec<Group>) -> Result<(), Box<dyn Error>> {
    println!("REDIS_URL is set, but the `redis` feature is off: using the in-memory store");
    run(MemoryStore::new(), "the in-memory store", groups).await
}

/// The same limit with its interval divided by [`SCALE`].
fn scaled(limit: Limit) -> Result<Limit, Box<dyn Error>> {
    Ok(Limit::new(limit.tokens(), limit.interval() / SCALE)?.with_burst(limit.burst())?)
}

/// A fraction from the environment variable `name`, 0 when unset.
fn fraction(name: &str) -> Result<f64, Box<dyn Error>> {
    match std::env::var(name) {
        Ok(v) if !v.is_empty() => match v.parse::<f64>() {
            Ok(f) if (0.0..1.0).contains(&f) => Ok(f),
            _ => Err(format!("{name} must be a fraction from 0 to below 1, got {v:?}").into()),
        },
        _ => Ok(0.0),
    }
}

async fn run<St: BucketStore + Clone>(
    store: St,
    label: &str,
    groups: Vec<Group>,
) -> Result<(), Box<dyn Error>> {
    let foreign = fraction("FOREIGN")?;
    let follow = std::env::var("FOLLOW").map_or(true, |v| v != "0");
    let mock = Arc::new(Mock::new(&groups)?);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let app = axum::Router::new()
        .fallback(serve)
        .with_state(Arc::clone(&mock));
    tokio::spawn(async move { axum::serve(listener, app).await });

    println!("burstgate::seller against a mock seller API at {base}");
    println!(
        "Time is scaled: 1 minute of the real API is {:?} here ({SCALE}x faster).",
        Duration::from_secs(60) / SCALE
    );
    println!("Limits per account: the mock's (the API's, scaled), and the client's bucket, under");
    println!("the default margin:");
    for g in &groups {
        println!(
            "  {:<18} {:<22} client: {}",
            g.name(),
            g.template().limit().to_string(),
            g.template().bucket_limit()
        );
    }
    println!(
        "{} accounts x {} endpoints x {WORKERS_PER_BUCKET} workers = {} workers, {PAGES} pages \
         each, for {RUN:?}; store: {label}.",
        ACCOUNTS.len(),
        groups.len(),
        ACCOUNTS.len() * groups.len() * WORKERS_PER_BUCKET
    );
    if foreign > 0.0 {
        println!(
            "Another consumer spends {:.0}% of every limit of the mock's; the middleware {} the \
             X-Ratelimit-Remaining the mock reports.",
            foreign * 100.0,
            if follow { "follows" } else { "ignores" }
        );
    }
    println!();

    let routes = seller::routes(TOKEN_TYPE, &groups)?;
    let start = Instant::now();
    let deadline = start + RUN;
    let timeline = Arc::new(Timeline::new(start));
    let limiter = RateLimitMiddleware::new(store)
        .routes(routes)
        .account_header(AUTHORIZATION)
        .follow_upstream(follow)
        // Wait as long as it takes: every worker queues for its turn instead of failing.
        .max_wait(RUN * 2);
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(limiter)
        .with(CountSent(Arc::clone(&timeline)))
        .build();

    let mut workers = Vec::new();
    if foreign > 0.0 {
        for account in ACCOUNTS {
            for endpoint in 0..mock.endpoints.len() {
                let mock = Arc::clone(&mock);
                tokio::spawn(async move { mock.spend(account, endpoint, foreign, deadline).await });
            }
        }
    }
    for account in ACCOUNTS {
        for group in &groups {
            for _ in 0..WORKERS_PER_BUCKET {
                let job = Job {
                    client: client.clone(),
                    base: base.clone(),
                    account,
                    group: group.name().to_owned(),
                    timeline: Arc::clone(&timeline),
                };
                workers.push(tokio::spawn(job.run(deadline)));
            }
        }
    }
    let mut failures = 0;
    for worker in workers {
        failures += worker.await?;
    }
    // Let refunds of the reservations the deadline cut short land before the mock is read.
    tokio::time::sleep(Duration::from_millis(50)).await;

    timeline.print();
    let totals = mock.totals(deadline);
    println!();
    println!(
        "local 429 (the middleware refused to wait): {}; other errors: {failures}",
        timeline.local_429()
    );
    if foreign > 0.0 {
        println!(
            "the other consumer took {} tokens, and was refused {} times",
            totals.foreign_admitted, totals.foreign_rejected
        );
    }
    println!(
        "the mock admitted {} of at most {:.1} requests (burst + rate x elapsed, per account and \
         endpoint{})",
        totals.admitted,
        totals.possible,
        if foreign > 0.0 {
            ", less what the other consumer took"
        } else {
            ""
        }
    );
    println!(
        "requests: {}, upstream 429: {}, budget used: {:.1}%",
        totals.received,
        totals.rejected,
        100.0 * totals.admitted as f64 / totals.possible
    );
    Ok(())
}

/// One worker: fetches pages of one endpoint for one account until the run is over.
struct Job {
    client: ClientWithMiddleware,
    base: String,
    account: &'static str,
    group: String,
    timeline: Arc<Timeline>,
}

impl Job {
    /// Returns the number of requests that failed for another reason than a 429.
    async fn run(self, deadline: Instant) -> u32 {
        let mut failures = 0;
        for page in 1..=PAGES {
            let request = self.request(page).header(AUTHORIZATION, self.account);
            // The deadline cuts short a request still waiting for its turn; the middleware gives
            // its reserved token back.
            let result = tokio::select! {
                result = request.send() => result,
                () = tokio::time::sleep_until(deadline) => break,
            };
            match result {
                Ok(res) => self.timeline.answer(res.status()),
                Err(reqwest_middleware::Error::Middleware(e)) if e.is::<RateLimited>() => {
                    self.timeline.local();
                    let retry = e
                        .downcast_ref::<RateLimited>()
                        .map_or(Duration::ZERO, RateLimited::retry_after);
                    tokio::time::sleep(retry).await;
                }
                Err(e) => {
                    failures += 1;
                    eprintln!("{}: {e}", self.group);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            if Instant::now() >= deadline {
                break;
            }
        }
        failures
    }

    fn request(&self, page: u32) -> reqwest_middleware::RequestBuilder {
        let base = &self.base;
        match self.group.as_str() {
            "orders" => self.client.get(format!(
                "{base}/api/v1/supplier/orders?dateFrom=2026-11-01&page={page}"
            )),
            "sales" => self.client.get(format!(
                "{base}/api/v1/supplier/sales?dateFrom=2026-11-01&page={page}"
            )),
            "warehouse-remains" => self
                .client
                .get(format!("{base}/api/v1/warehouse_remains?groupByBrand=true")),
            _ => self
                .client
                .post(format!("{base}/api/analytics/v3/sales-funnel/products"))
                .header("content-type", "application/json")
                .body(format!(r#"{{"page":{page}}}"#)),
        }
    }
}

/// Requests sent and answers received, per second of the run.
struct Timeline {
    start: Instant,
    /// Per second: requests sent, 200 answers, 429 answers.
    seconds: Mutex<Vec<[u32; 3]>>,
    local_429: Mutex<u32>,
}

impl Timeline {
    fn new(start: Instant) -> Self {
        Self {
            start,
            seconds: Mutex::new(Vec::new()),
            local_429: Mutex::new(0),
        }
    }

    fn count(&self, column: usize) {
        let second = usize::try_from(self.start.elapsed().as_secs()).unwrap_or(usize::MAX);
        let mut seconds = self.seconds.lock().unwrap_or_else(PoisonError::into_inner);
        if seconds.len() <= second {
            seconds.resize(second + 1, [0; 3]);
        }
        seconds[second][column] += 1;
    }

    fn sent(&self) {
        self.count(0);
    }

    fn answer(&self, status: StatusCode) {
        match status {
            StatusCode::OK => self.count(1),
            StatusCode::TOO_MANY_REQUESTS => self.count(2),
            other => eprintln!("unexpected answer: {other}"),
        }
    }

    fn local(&self) {
        *self
            .local_429
            .lock()
            .unwrap_or_else(PoisonError::into_inner) += 1;
    }

    fn local_429(&self) -> u32 {
        *self
            .local_429
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn print(&self) {
        let seconds = self.seconds.lock().unwrap_or_else(PoisonError::into_inner);
        println!("  second   sent    200    429");
        for (i, [sent, ok, limited]) in seconds.iter().enumerate() {
            println!("  {:>2}-{:<2}  {sent:>6} {ok:>6} {limited:>6}", i, i + 1);
        }
        let total = seconds.iter().fold([0; 3], |acc, s| {
            [acc[0] + s[0], acc[1] + s[1], acc[2] + s[2]]
        });
        println!("  total   {:>6} {:>6} {:>6}", total[0], total[1], total[2]);
    }
}

/// Sits after the limiter: it sees only the requests that are about to go out.
struct CountSent(Arc<Timeline>);

#[async_trait::async_trait]
impl Middleware for CountSent {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        self.0.sent();
        next.run(req, extensions).await
    }
}

// ---------------------------------------------------------------------------------------------
// The mock seller API. Its token bucket is deliberately its own, simple code: continuous refill
// in floating-point seconds on the monotonic clock, a bucket per (account, endpoint) that starts
// full at its first request.
// ---------------------------------------------------------------------------------------------

/// One endpoint as the mock sees it.
struct Endpoint {
    name: String,
    method: Method,
    /// The path, or with `prefix` set, the start of every path it serves.
    path: &'static str,
    prefix: bool,
    /// Tokens per second, and the bucket's size.
    rate: f64,
    burst: f64,
}

/// The mock's bucket for one account and endpoint.
struct MockBucket {
    tokens: f64,
    at: Instant,
    first: Instant,
    admitted: u64,
    rejected: u64,
    /// The other consumer's takes.
    foreign_admitted: u64,
    foreign_rejected: u64,
}

struct Mock {
    endpoints: Vec<Endpoint>,
    buckets: Mutex<HashMap<(String, usize), MockBucket>>,
}

/// What the mock saw over the run.
struct Totals {
    received: u64,
    admitted: u64,
    rejected: u64,
    foreign_admitted: u64,
    foreign_rejected: u64,
    /// The most it could have admitted: per bucket, `burst + rate × elapsed`, less what the
    /// other consumer took.
    possible: f64,
}

impl Mock {
    /// The mock's endpoints, with the limits of the groups of the same names.
    fn new(groups: &[Group]) -> Result<Self, String> {
        let endpoint = |name: &str, method: Method, path: &'static str, prefix: bool| {
            let limit = groups
                .iter()
                .find(|g| g.name() == name)
                .map(|g| g.template().limit())
                .ok_or_else(|| format!("no group named {name}"))?;
            Ok::<_, String>(Endpoint {
                name: name.to_owned(),
                method,
                path,
                prefix,
                rate: f64::from(limit.tokens()) / limit.interval().as_secs_f64(),
                burst: f64::from(limit.burst()),
            })
        };
        Ok(Self {
            endpoints: vec![
                endpoint("orders", Method::GET, "/api/v1/supplier/orders", false)?,
                endpoint("sales", Method::GET, "/api/v1/supplier/sales", false)?,
                endpoint(
                    "warehouse-remains",
                    Method::GET,
                    "/api/v1/warehouse_remains",
                    false,
                )?,
                endpoint(
                    "sales-funnel-v3",
                    Method::POST,
                    "/api/analytics/v3/sales-funnel/",
                    true,
                )?,
            ],
            buckets: Mutex::new(HashMap::new()),
        })
    }

    /// Takes a token, and says how many whole tokens are left, or how long until one is there.
    /// `foreign` takes are the other consumer's, counted apart.
    fn take(&self, account: &str, endpoint: usize, foreign: bool) -> Result<u64, Duration> {
        let now = Instant::now();
        let e = &self.endpoints[endpoint];
        let mut buckets = self.buckets.lock().unwrap_or_else(PoisonError::into_inner);
        let b = buckets
            .entry((account.to_owned(), endpoint))
            .or_insert(MockBucket {
                tokens: e.burst,
                at: now,
                first: now,
                admitted: 0,
                rejected: 0,
                foreign_admitted: 0,
                foreign_rejected: 0,
            });
        let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
        b.tokens = (b.tokens + elapsed * e.rate).min(e.burst);
        b.at = now;
        let (admitted, rejected) = if foreign {
            (&mut b.foreign_admitted, &mut b.foreign_rejected)
        } else {
            (&mut b.admitted, &mut b.rejected)
        };
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            *admitted += 1;
            Ok(b.tokens as u64)
        } else {
            *rejected += 1;
            Err(Duration::from_secs_f64((1.0 - b.tokens) / e.rate))
        }
    }

    /// The other consumer: takes from one bucket at `fraction` of its rate, evenly, until
    /// `deadline`.
    async fn spend(&self, account: &str, endpoint: usize, fraction: f64, deadline: Instant) {
        let period = Duration::from_secs_f64(1.0 / (self.endpoints[endpoint].rate * fraction));
        let mut next = Instant::now();
        while next < deadline {
            // Refused or not, it comes back at its own pace, as a cron job would.
            let _ = self.take(account, endpoint, true);
            next += period;
            tokio::time::sleep_until(next).await;
        }
    }

    fn totals(&self, end: Instant) -> Totals {
        let buckets = self.buckets.lock().unwrap_or_else(PoisonError::into_inner);
        let mut t = Totals {
            received: 0,
            admitted: 0,
            rejected: 0,
            foreign_admitted: 0,
            foreign_rejected: 0,
            possible: 0.0,
        };
        for ((_, endpoint), b) in buckets.iter() {
            let e = &self.endpoints[*endpoint];
            let elapsed = end.saturating_duration_since(b.first).as_secs_f64();
            t.received += b.admitted + b.rejected;
            t.admitted += b.admitted;
            t.rejected += b.rejected;
            t.foreign_admitted += b.foreign_admitted;
            t.foreign_rejected += b.foreign_rejected;
            t.possible += e.burst + e.rate * elapsed - b.foreign_admitted as f64;
        }
        t
    }
}

async fn serve(
    State(mock): State<Arc<Mock>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let path = uri.path();
    let Some(endpoint) = mock.endpoints.iter().position(|e| {
        e.method == method
            && if e.prefix {
                path.starts_with(e.path)
            } else {
                path == e.path
            }
    }) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let Some(account) = headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty())
    else {
        return StatusCode::UNAUTHORIZED.into_response();
    };
    match mock.take(account, endpoint, false) {
        Ok(left) => (
            StatusCode::OK,
            [("x-ratelimit-remaining", left.to_string())],
            mock.endpoints[endpoint].name.clone(),
        )
            .into_response(),
        Err(wait) => {
            // Whole seconds, rounded up, as the real API sends them.
            let secs = wait.as_secs_f64().ceil().max(1.0).to_string();
            (
                StatusCode::TOO_MANY_REQUESTS,
                [
                    ("x-ratelimit-remaining", "0".to_owned()),
                    ("x-ratelimit-retry", secs.clone()),
                    ("retry-after", secs),
                ],
                "too many requests",
            )
                .into_response()
        }
    }
}
