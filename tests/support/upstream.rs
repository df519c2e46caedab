//! An upstream inside the process, for the reqwest middleware's tests of order and spacing, and
//! the ways those tests send through it.
//!
//! It is the last middleware of a client's chain: it records each request and answers it as the
//! test set it up to (a status, headers, a delay), never calling `next`, so nothing touches a
//! socket and a test can run on tokio's paused clock, where every send time is exact. The tests
//! of the real HTTP path use wiremock instead.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::support::exact_route;
use burstgate::middleware::{Account, RateLimitMiddleware};
use burstgate::{KeySecret, Limit, MemoryStore, TokioClock};
use http::{Extensions, HeaderValue, StatusCode};
use reqwest::{Request, Response};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};
use tokio::time::Instant;

/// Where requests to the in-process upstream go; no name is ever resolved.
pub(crate) const BASE: &str = "http://upstream.test";

/// What the upstream answers one request: a status, headers, and how long the answer takes to
/// come back once the request has arrived.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    status: StatusCode,
    headers: Vec<(&'static str, String)>,
    delay: Duration,
}

impl Answer {
    /// `status`, with no header, at once.
    pub(crate) fn new(status: StatusCode) -> Self {
        Self {
            status,
            headers: Vec::new(),
            delay: Duration::ZERO,
        }
    }

    /// A 200, with no header, at once.
    pub(crate) fn ok() -> Self {
        Self::new(StatusCode::OK)
    }

    /// The same answer with the header `name: value` too (added, so a name may repeat).
    pub(crate) fn header(mut self, name: &'static str, value: &str) -> Self {
        self.headers.push((name, value.to_owned()));
        self
    }

    /// The same answer, coming back `delay` after the request arrived.
    pub(crate) fn after(self, delay: Duration) -> Self {
        Self { delay, ..self }
    }
}

/// A 200 with the header `name: value`.
pub(crate) fn ok_with(name: &'static str, value: &str) -> Answer {
    Answer::ok().header(name, value)
}

/// One request that reached the upstream.
#[derive(Debug, Clone)]
struct Arrival {
    path: String,
    at: Instant,
    status: StatusCode,
}

/// What the upstream answers the request that arrived `n`th (from 0), to `path`.
type Answers = dyn Fn(usize, &str) -> Answer + Send + Sync;

/// The in-process upstream. Clones share one log.
#[derive(Clone)]
pub(crate) struct Upstream {
    answer: Arc<Answers>,
    arrivals: Arc<Mutex<Vec<Arrival>>>,
}

impl Upstream {
    /// Answers the request that arrived `n`th (from 0), to `path`, with `answer(n, path)`.
    pub(crate) fn new(answer: impl Fn(usize, &str) -> Answer + Send + Sync + 'static) -> Self {
        Self {
            answer: Arc::new(answer),
            arrivals: Arc::default(),
        }
    }

    /// Answers every request with `status`.
    pub(crate) fn answering(status: StatusCode) -> Self {
        Self::new(move |_, _| Answer::new(status))
    }

    /// Answers each request with the status `status_for` gives its path.
    pub(crate) fn by_path(status_for: impl Fn(&str) -> StatusCode + Send + Sync + 'static) -> Self {
        Self::new(move |_, path| Answer::new(status_for(path)))
    }

    /// Answers the request that arrived `n`th (from 0) with `answer(n)`, whatever its path.
    pub(crate) fn by_turn(answer: impl Fn(usize) -> Answer + Send + Sync + 'static) -> Self {
        Self::new(move |n, _| answer(n))
    }

    /// A client that sends through `middleware` to this upstream.
    pub(crate) fn client(&self, middleware: impl Middleware) -> ClientWithMiddleware {
        ClientBuilder::new(reqwest::Client::new())
            .with(middleware)
            .with(self.clone())
            .build()
    }

    /// When each request arrived, in whole ms since `start`, in the order they arrived.
    pub(crate) fn sent_ms_since(&self, start: Instant) -> Vec<u128> {
        self.log()
            .iter()
            .map(|a| (a.at - start).as_millis())
            .collect()
    }

    /// When each request arrived, in whole ms since `start`, and the status it was answered
    /// with, in the order they arrived.
    pub(crate) fn answered_ms_since(&self, start: Instant) -> Vec<(u128, StatusCode)> {
        self.log()
            .iter()
            .map(|a| ((a.at - start).as_millis(), a.status))
            .collect()
    }

    /// How many requests for `path` arrived.
    pub(crate) fn count(&self, path: &str) -> usize {
        self.log().iter().filter(|a| a.path == path).count()
    }

    fn log(&self) -> std::sync::MutexGuard<'_, Vec<Arrival>> {
        self.arrivals.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[async_trait::async_trait]
impl Middleware for Upstream {
    async fn handle(
        &self,
        req: Request,
        _: &mut Extensions,
        _: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let path = req.url().path().to_owned();
        let answer = {
            let mut log = self.log();
            let answer = (self.answer)(log.len(), &path);
            log.push(Arrival {
                path,
                at: Instant::now(),
                status: answer.status,
            });
            answer
        };
        tokio::time::sleep(answer.delay).await;
        let mut response = http::Response::new(Vec::<u8>::new());
        *response.status_mut() = answer.status;
        for (name, value) in answer.headers {
            let value = HeaderValue::from_str(&value).expect("a header value");
            response.headers_mut().append(name, value);
        }
        Ok(Response::from(response))
    }
}

/// A middleware on a `MemoryStore`, both on tokio's clock, for the tests on paused time.
pub(crate) type OnTokioTime = RateLimitMiddleware<MemoryStore<TokioClock>, TokioClock>;

/// The account every request of the helpers below is sent for.
pub(crate) const SELLER: &str = "seller-1";

/// Sends a GET to `path` for [`SELLER`] through `client`: the upstream's status.
pub(crate) async fn to(client: &ClientWithMiddleware, path: &str) -> StatusCode {
    client
        .get(format!("{BASE}{path}"))
        .with_extension(Account::new(SELLER))
        .send()
        .await
        .map(|r| r.status())
        .expect("sent")
}

/// One request to `/orders` for [`SELLER`] through `limiter` to `upstream`, then `more` at once:
/// when each reached the upstream, in ms from the start.
pub(crate) async fn sends(limiter: OnTokioTime, upstream: &Upstream, more: usize) -> Vec<u128> {
    let client = upstream.client(limiter);
    let start = Instant::now();
    to(&client, "/orders").await;
    let calls: Vec<_> = (0..more)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move { to(&client, "/orders").await })
        })
        .collect();
    for call in calls {
        call.await.expect("a request finishes");
    }
    upstream.sent_ms_since(start)
}

/// "1 a second, burst 5" on `/orders`, waiting up to a minute.
pub(crate) fn one_a_second_burst_5() -> OnTokioTime {
    let clock = TokioClock::new();
    let limit = Limit::per_second(1)
        .and_then(|l| l.with_burst(5))
        .expect("a valid limit");
    RateLimitMiddleware::new(MemoryStore::new().with_clock(clock))
        .with_clock(clock)
        .route(exact_route("api", limit, "/orders").expect("a route"))
        .max_wait(Duration::from_secs(60))
}

/// An endpoint's own limit (1 a second, burst 5) and the account's, over every path (one every
/// 2 s, burst 2): a request to the endpoint matches both. Its tickets are signed with
/// [`ticket_secret`].
pub(crate) fn endpoint_and_account() -> OnTokioTime {
    let clock = TokioClock::new();
    let endpoint = Limit::per_second(1)
        .and_then(|l| l.with_burst(5))
        .expect("a valid limit");
    let account = Limit::new(1, Duration::from_secs(2))
        .and_then(|l| l.with_burst(2))
        .expect("a valid limit");
    RateLimitMiddleware::new(MemoryStore::new().with_clock(clock))
        .with_clock(clock)
        .route(exact_route("orders", endpoint, "/orders").expect("a route"))
        .route(exact_route("account", account, "/**").expect("a route"))
        .key_secret(ticket_secret())
        .max_wait(Duration::from_secs(60))
}

/// The secret the tests' tickets are signed with.
pub(crate) fn ticket_secret() -> KeySecret {
    KeySecret::new(b"the tests' application secret").expect("a secret")
}

/// The extensions of a request for `name`, as `reserve` takes them.
pub(crate) fn account(name: &str) -> Extensions {
    let mut e = Extensions::new();
    e.insert(Account::new(name));
    e
}
