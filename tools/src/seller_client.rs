//! One client process of the end-to-end check `scripts/e2e_seller.sh`: many tasks calling one
//! rate-limited endpoint for one account, through [`RateLimitMiddleware`] on a [`RedisStore`]
//! that every process of the check shares.
//!
//! Each task sends requests, one after the other, for `--seconds`; the middleware makes it wait
//! its turn in the shared bucket (a `max_wait` longer than the run, so nobody gives up), and a
//! task still waiting when the time is up is dropped, which gives its reserved token back. The
//! route is the orders group of `burstgate::seller` with the limit given on the command line and
//! a margin of `--margin-ms` per token ([`Group::margin`]), and the account is the
//! `Authorization` header, so every process sending the same token spends the same bucket.
//!
//! ```sh
//! REDIS_URL=redis://127.0.0.1:6380/ cargo run -p burstgate-tools --bin seller_client -- \
//!     --url http://127.0.0.1:8080/api/v1/supplier/orders --token 'Bearer e2e' --seconds 10 \
//!     --interval-ms 500 --burst 10 --margin-ms 10 --prefix e2e-1
//! ```
//!
//! Options: `--url` (required), `--token` (required, sent as the `Authorization` header),
//! `--seconds 10`, `--tasks 16`, `--interval-ms 500` and `--burst 10` (the server's limit: one
//! token per interval), `--margin-ms 10`, `--prefix burstgate-e2e` (the Redis key prefix; give
//! every process of one run the same one), `--no-follow` (ignore the tokens the server reports
//! left). `REDIS_URL` names the Redis.
//!
//! Its last line is `sent: N, ok: A, upstream 429: M`: requests that left this process, and the
//! server's `200` and `429` answers. Before it, `stopped_ms: T` is the wall-clock time (ms since
//! the Unix epoch) when it stopped sending.

use std::error::Error;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use burstgate::middleware::{RateLimitMiddleware, Route};
use burstgate::seller::{self, Group};
use burstgate::{Limit, RateLimited, RedisStore, redis};
use clap::Parser;
use clap::builder::NonEmptyStringValueParser;
use http::Extensions;
use reqwest::StatusCode;
use reqwest::header::AUTHORIZATION;
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};
use tokio::time::Instant;

/// One client process of scripts/e2e_seller.sh: tasks calling one rate-limited endpoint for
/// one account through RateLimitMiddleware on a shared RedisStore. REDIS_URL names the Redis.
#[derive(Parser)]
#[command(name = "seller_client")]
struct Args {
    /// The endpoint to call.
    #[arg(long, value_parser = NonEmptyStringValueParser::new())]
    url: String,
    /// Sent as the Authorization header: the account.
    #[arg(long, value_parser = NonEmptyStringValueParser::new())]
    token: String,
    /// Length of the run.
    #[arg(long, default_value_t = 10.0, value_parser = positive_seconds)]
    seconds: f64,
    /// Concurrent tasks.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
    tasks: u64,
    /// The server's limit: one token per this many milliseconds.
    #[arg(long, default_value_t = 500)]
    interval_ms: u64,
    /// The server's burst.
    #[arg(long, default_value_t = 10)]
    burst: u32,
    /// The margin kept per token, in milliseconds.
    #[arg(long, default_value_t = 10)]
    margin_ms: u64,
    /// The Redis key prefix; the same for every process of one run.
    #[arg(long, default_value = "burstgate-e2e")]
    prefix: String,
    /// Leave the shared bucket alone whatever the server reports it has left (the middleware's
    /// `follow_upstream(false)`).
    #[arg(long)]
    no_follow: bool,
}

fn positive_seconds(value: &str) -> Result<f64, String> {
    let s: f64 = value.parse().map_err(|e| format!("{e}"))?;
    if s.is_finite() && s > 0.0 {
        Ok(s)
    } else {
        Err("must be above zero".into())
    }
}

/// What this process saw.
#[derive(Default)]
struct Counts {
    sent: AtomicU64,
    ok: AtomicU64,
    upstream_429: AtomicU64,
    local_429: AtomicU64,
    errors: AtomicU64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let args = Args::parse();
    let redis_url = std::env::var("REDIS_URL").map_err(|_| "REDIS_URL must name the Redis")?;
    let path = reqwest::Url::parse(&args.url)?.path().to_owned();

    let server = Limit::new(1, Duration::from_millis(args.interval_ms))?.with_burst(args.burst)?;
    let orders = Route::new(seller::orders().name(), server, &path)?;
    let group = Group::new(orders).margin(Duration::from_millis(args.margin_ms))?;
    let conn = redis::Client::open(redis_url)?
        .get_connection_manager()
        .await?;
    let store = RedisStore::new(conn).prefix(&args.prefix)?;
    let limiter = RateLimitMiddleware::new(store)
        .routes(seller::routes("personal", std::slice::from_ref(&group))?)
        .account_header(AUTHORIZATION)
        .follow_upstream(!args.no_follow)
        // Longer than the run: every task queues for its turn instead of failing.
        .max_wait(Duration::from_secs_f64(args.seconds) + Duration::from_secs(60));
    let counts = Arc::new(Counts::default());
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(limiter)
        .with(CountSent(Arc::clone(&counts)))
        .build();

    println!(
        "limit: {} (the server's {server} with a margin of {} ms per token); {} tasks for {} s",
        group.template().limit(),
        args.margin_ms,
        args.tasks,
        args.seconds
    );
    let deadline = Instant::now() + Duration::from_secs_f64(args.seconds);
    let url = Arc::new(args.url);
    let token = Arc::new(args.token);
    let tasks: Vec<_> = (0..args.tasks)
        .map(|_| {
            let task = Task {
                client: client.clone(),
                url: Arc::clone(&url),
                token: Arc::clone(&token),
                counts: Arc::clone(&counts),
            };
            tokio::spawn(task.run(deadline))
        })
        .collect();
    for task in tasks {
        task.await?;
    }
    let stopped_ms = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis();
    // Let the refunds of the reservations the deadline cut short reach Redis before exiting.
    tokio::time::sleep(Duration::from_millis(100)).await;

    let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
    println!("stopped_ms: {stopped_ms}");
    println!(
        "local 429: {}, errors: {}",
        read(&counts.local_429),
        read(&counts.errors)
    );
    println!(
        "sent: {}, ok: {}, upstream 429: {}",
        read(&counts.sent),
        read(&counts.ok),
        read(&counts.upstream_429)
    );
    Ok(())
}

struct Task {
    client: ClientWithMiddleware,
    url: Arc<String>,
    token: Arc<String>,
    counts: Arc<Counts>,
}

impl Task {
    async fn run(self, deadline: Instant) {
        while Instant::now() < deadline {
            let request = self
                .client
                .get(self.url.as_str())
                .header(AUTHORIZATION, self.token.as_str());
            // Dropping a request that still waits for its turn gives its token back.
            let result = tokio::select! {
                result = request.send() => result,
                () = tokio::time::sleep_until(deadline) => break,
            };
            match result {
                Ok(res) if res.status() == StatusCode::OK => bump(&self.counts.ok),
                Ok(res) if res.status() == StatusCode::TOO_MANY_REQUESTS => {
                    bump(&self.counts.upstream_429)
                }
                Ok(res) => {
                    bump(&self.counts.errors);
                    eprintln!("unexpected answer: {}", res.status());
                }
                Err(reqwest_middleware::Error::Middleware(e)) if e.is::<RateLimited>() => {
                    bump(&self.counts.local_429);
                    let retry = e
                        .downcast_ref::<RateLimited>()
                        .map_or(Duration::ZERO, RateLimited::retry_after);
                    tokio::time::sleep(retry).await;
                }
                Err(e) => {
                    bump(&self.counts.errors);
                    eprintln!("request failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Sits after the limiter: it sees only the requests that are about to go out.
struct CountSent(Arc<Counts>);

#[async_trait::async_trait]
impl Middleware for CountSent {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        bump(&self.0.sent);
        next.run(req, extensions).await
    }
}
