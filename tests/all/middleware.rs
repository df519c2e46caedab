//! The reqwest middleware, three ways:
//!
//! - when requests are sent, in what order and how far apart, on tokio's paused clock in front of
//!   an in-process upstream (`support::upstream`), so every send time is exact;
//! - the real HTTP path, against a real server (wiremock, with exact `.expect(n)` counts);
//! - buckets shared between clients through a real Redis. A socket forces real time (paused time
//!   would jump past every wait for a reply), so these tests use short intervals, measure with
//!   `std::time::Instant`, and keep generous upper bounds. Arrival times are the mock server's
//!   own: a responder records `Instant::now()` when each request reaches it.
#![cfg(feature = "reqwest")]

use std::time::{Duration, Instant};

use burstgate::middleware::{Account, RateLimitMiddleware, Route};
use burstgate::{BucketKey, BucketState, BucketStore, Limit, MemoryStore, RateLimited, TokioClock};
use reqwest::StatusCode;
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, Respond, ResponseTemplate};

#[cfg(feature = "redis")]
use crate::support::redis_server;
use crate::support::upstream::{BASE, Upstream};
use crate::support::{SlowReplies, exact_route, key, limit};

fn route(bucket: &str, limit: Limit, pattern: &str) -> Route {
    exact_route(bucket, limit, pattern).expect("a valid route")
}

/// A middleware on a `MemoryStore`, both on tokio's clock, for the tests on paused time.
fn on_tokio_time() -> (
    MemoryStore<TokioClock>,
    RateLimitMiddleware<MemoryStore<TokioClock>, TokioClock>,
) {
    let clock = TokioClock::new();
    let store = MemoryStore::new().with_clock(clock);
    (
        store.clone(),
        RateLimitMiddleware::new(store).with_clock(clock),
    )
}

fn client(middleware: impl reqwest_middleware::Middleware) -> ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .build()
}

/// Sends a GET, as `account` when given, and returns the upstream's status.
async fn get(
    client: &ClientWithMiddleware,
    url: &str,
    account: Option<&str>,
) -> Result<StatusCode, reqwest_middleware::Error> {
    let mut request = client.get(url);
    if let Some(account) = account {
        request = request.with_extension(Account::new(account));
    }
    request.send().await.map(|res| res.status())
}

/// The local 429 inside a middleware error; panics on anything else.
fn local_429(result: Result<StatusCode, reqwest_middleware::Error>) -> RateLimited {
    match result {
        Err(reqwest_middleware::Error::Middleware(e)) => match e.downcast_ref::<RateLimited>() {
            Some(limited) => limited.clone(),
            None => panic!("a middleware error other than RateLimited: {e:?}"),
        },
        other => panic!("expected the local 429, got {other:?}"),
    }
}

/// Peeks `key` until `done` holds, for at most five seconds (for effects the middleware applies
/// on a spawned task, such as refunds).
async fn peek_until(
    store: &impl BucketStore,
    key: &BucketKey,
    limit: Limit,
    done: impl Fn(&BucketState) -> bool,
) -> BucketState {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let quota = store.peek(key, limit).await.expect("peeks");
        if done(&quota) {
            return quota;
        }
        assert!(Instant::now() < deadline, "never reached: last {quota:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn mock(server: &MockServer, at: &str, answer: impl Respond + 'static, times: u64) {
    Mock::given(method("GET"))
        .and(path(at))
        .respond_with(answer)
        .expect(times)
        .named(at)
        .mount(server)
        .await;
}

#[tokio::test(start_paused = true)]
async fn a_full_burst_goes_out_at_once_and_the_eleventh_waits_one_interval() {
    let upstream = Upstream::answering(StatusCode::OK);
    let orders = limit(1, 300, 10);
    let (_, middleware) = on_tokio_time();
    let client = upstream.client(middleware.route(route("orders", orders, "/orders")));
    let url = format!("{BASE}/orders");

    let start = tokio::time::Instant::now();
    let mut calls = Vec::new();
    for _ in 0..11 {
        let (client, url) = (client.clone(), url.clone());
        calls.push(tokio::spawn(async move {
            let status = get(&client, &url, Some("seller-1")).await;
            (
                status.map_err(|e| e.to_string()),
                start.elapsed().as_millis(),
            )
        }));
    }
    let mut done = Vec::new();
    for call in calls {
        let (status, elapsed) = call.await.expect("the request task finishes");
        assert_eq!(status, Ok(StatusCode::OK));
        done.push(elapsed);
    }
    done.sort();
    // Ten at once, the eleventh one interval later, to the millisecond.
    let burst_then_one = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 300];
    assert_eq!(done, burst_then_one, "answered");
    assert_eq!(upstream.sent_ms_since(start), burst_then_one, "sent");
    assert_eq!(upstream.count("/orders"), 11);
}

#[tokio::test]
async fn the_local_429_is_a_rate_limited_error_and_the_request_is_never_sent() {
    let server = MockServer::start().await;
    mock(&server, "/orders", ResponseTemplate::new(200), 1).await;
    // 1 per minute, burst 1: the default ceiling is two minutes, so the second and third requests
    // are reserved (waiting one and two minutes) and the fourth would wait three.
    let orders = Limit::per_minute(1).expect("a valid limit");
    let store = MemoryStore::new();
    let client =
        client(RateLimitMiddleware::new(store.clone()).route(route("orders", orders, "/orders")));
    let url = format!("{}/orders", server.uri());
    let bucket = key("orders", "seller-1");

    assert_eq!(
        get(&client, &url, Some("seller-1")).await.ok(),
        Some(StatusCode::OK)
    );
    let mut waiting = Vec::new();
    for _ in 0..2 {
        let (client, url) = (client.clone(), url.clone());
        waiting.push(tokio::spawn(async move {
            get(&client, &url, Some("seller-1"))
                .await
                .map_err(|e| e.to_string())
        }));
    }
    // Both reservations are made: the bucket is two tokens in debt.
    peek_until(&store, &bucket, orders, |q| {
        q.next_token_in() > Duration::from_secs(170)
    })
    .await;

    let limited = local_429(get(&client, &url, Some("seller-1")).await);
    assert!(
        limited.retry_after() > Duration::from_secs(170)
            && limited.retry_after() <= Duration::from_secs(180),
        "{limited:?}"
    );
    assert_eq!(limited.bucket(), "orders");
    assert_eq!(limited.limit(), orders);
    assert_eq!(limited.remaining(), 0);

    // The two reserved requests are still waiting their turn, not failed; abandoning them gives
    // their tokens back as far as no other reservation's slot moves: the last one's always, and
    // the first one's if its refund comes once it is the last (the refunds run on tasks of their
    // own, in no set order).
    for call in &waiting {
        assert!(!call.is_finished());
        call.abort();
    }
    let quota = peek_until(&store, &bucket, orders, |q| {
        q.next_token_in() <= Duration::from_secs(120)
    })
    .await;
    assert!(quota.next_token_in() > Duration::from_secs(50), "{quota:?}");
    server.verify().await;
}

#[tokio::test(start_paused = true)]
async fn a_request_dropped_while_it_waits_gives_its_turn_back() {
    let upstream = Upstream::answering(StatusCode::OK);
    let orders = limit(1, 1_000, 1);
    let (store, middleware) = on_tokio_time();
    let client = upstream.client(middleware.route(route("orders", orders, "/orders")));
    let url = format!("{BASE}/orders");

    let start = tokio::time::Instant::now();
    assert_eq!(
        get(&client, &url, Some("a")).await.ok(),
        Some(StatusCode::OK)
    );
    // Reserved for 1 s from now, abandoned after 100 ms.
    let abandoned =
        tokio::time::timeout(Duration::from_millis(100), get(&client, &url, Some("a"))).await;
    assert!(
        abandoned.is_err(),
        "it should still be waiting: {abandoned:?}"
    );
    // The refund runs on a spawned task; wait until the store shows it: the next token is due
    // one interval after the first request again, not two.
    peek_until(&store, &key("orders", "a"), orders, |q| {
        start.elapsed() + q.next_token_in() < Duration::from_millis(1_500)
    })
    .await;

    // The next request takes the abandoned turn: sent one interval after the first, not two.
    assert_eq!(
        get(&client, &url, Some("a")).await.ok(),
        Some(StatusCode::OK)
    );
    assert_eq!(upstream.sent_ms_since(start), [0, 1_000]);
}

#[tokio::test(start_paused = true)]
async fn a_request_dropped_while_the_store_answers_leaves_nothing_behind() {
    let upstream = Upstream::answering(StatusCode::OK);
    let orders = limit(1, 10_000, 1);
    let clock = TokioClock::new();
    let memory = MemoryStore::new().with_clock(clock);
    let store = SlowReplies {
        inner: memory.clone(),
        delay: Duration::from_millis(200),
    };
    let client = upstream.client(
        RateLimitMiddleware::new(store)
            .with_clock(clock)
            .route(route("orders", orders, "/orders")),
    );
    let url = format!("{BASE}/orders");
    let bucket = key("orders", "a");

    assert_eq!(
        get(&client, &url, Some("a")).await.ok(),
        Some(StatusCode::OK)
    );
    // The store reserves the next turn (10 s away), but the caller gives up before the answer.
    let abandoned =
        tokio::time::timeout(Duration::from_millis(50), get(&client, &url, Some("a"))).await;
    assert!(abandoned.is_err(), "{abandoned:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let quota = memory.peek(&bucket, orders).await.expect("peeks");
    assert!(
        quota.next_token_in() <= Duration::from_secs(10),
        "the abandoned reservation is still owed: {quota:?}"
    );
    assert_eq!(upstream.count("/orders"), 1, "only the first was sent");
}

/// The same with two routes: the store takes both buckets at once and answers late; the caller
/// has gone, and the turn it booked on the endpoint, the last in its queue, goes back.
#[tokio::test(start_paused = true)]
async fn a_request_on_two_routes_dropped_while_the_store_answers_gives_its_turn_back() {
    let upstream = Upstream::answering(StatusCode::OK);
    let orders = limit(1, 10_000, 1);
    let account = limit(1, 10_000, 5);
    let clock = TokioClock::new();
    let memory = MemoryStore::new().with_clock(clock);
    let store = SlowReplies {
        inner: memory.clone(),
        delay: Duration::from_millis(200),
    };
    let client = upstream.client(
        RateLimitMiddleware::new(store)
            .with_clock(clock)
            .route(route("orders", orders, "/orders"))
            .route(route("account", account, "/**")),
    );
    let url = format!("{BASE}/orders");
    assert_eq!(
        get(&client, &url, Some("a")).await.ok(),
        Some(StatusCode::OK)
    );
    let abandoned =
        tokio::time::timeout(Duration::from_millis(50), get(&client, &url, Some("a"))).await;
    assert!(abandoned.is_err(), "{abandoned:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let quota = memory
        .peek(&key("orders", "a"), orders)
        .await
        .expect("peeks");
    assert!(
        quota.next_token_in() <= Duration::from_secs(10),
        "the abandoned reservation is still owed: {quota:?}"
    );
    assert_eq!(upstream.count("/orders"), 1, "only the first was sent");
}

#[tokio::test]
async fn accounts_in_the_extension_have_separate_buckets() {
    let server = MockServer::start().await;
    mock(&server, "/orders", ResponseTemplate::new(200), 4).await;
    let orders = Limit::per_hour(1).expect("a valid limit");
    let store = MemoryStore::new();
    let client = client(
        RateLimitMiddleware::new(store.clone())
            .route(route("orders", orders, "/orders"))
            .account_header(http::header::AUTHORIZATION)
            .max_wait(Duration::ZERO),
    );
    let url = format!("{}/orders", server.uri());

    assert_eq!(
        get(&client, &url, Some("a")).await.ok(),
        Some(StatusCode::OK)
    );
    let limited = local_429(get(&client, &url, Some("a")).await);
    assert!(
        limited.retry_after() > Duration::from_secs(3_590),
        "{limited:?}"
    );
    assert_eq!(
        get(&client, &url, Some("b")).await.ok(),
        Some(StatusCode::OK)
    );
    local_429(get(&client, &url, Some("b")).await);

    // With neither an extension nor the header, the route's one shared bucket, `-`.
    assert_eq!(get(&client, &url, None).await.ok(), Some(StatusCode::OK));
    local_429(get(&client, &url, None).await);

    // The extension wins over the header: this is account "c", whatever the token.
    let with_both = client
        .get(&url)
        .with_extension(Account::new("c"))
        .header(http::header::AUTHORIZATION, "Bearer token-of-a")
        .send()
        .await
        .map(|r| r.status());
    assert_eq!(with_both.ok(), Some(StatusCode::OK));

    for account in ["a", "b", "-", "c"] {
        let quota = store
            .peek(&key("orders", account), orders)
            .await
            .expect("peeks");
        assert_eq!(quota.remaining(), 0, "account {account}: {quota:?}");
    }
    let untouched = store
        .peek(&key("orders", "d"), orders)
        .await
        .expect("peeks");
    assert_eq!(untouched.remaining(), 1);
    let token_bucket = BucketKey::hashed("orders", "Bearer token-of-a").expect("a valid key");
    let untouched = store.peek(&token_bucket, orders).await.expect("peeks");
    assert_eq!(untouched.remaining(), 1);
    server.verify().await;
}

#[tokio::test]
async fn unmatched_requests_pass_through_unlimited_without_a_default_route() {
    let server = MockServer::start().await;
    mock(&server, "/free", ResponseTemplate::new(200), 5).await;
    mock(&server, "/orders", ResponseTemplate::new(200), 1).await;
    let orders = Limit::per_hour(1).expect("a valid limit");
    let client = client(
        RateLimitMiddleware::new(MemoryStore::new())
            .route(route("orders", orders, "/orders"))
            .max_wait(Duration::ZERO),
    );

    let free = format!("{}/free", server.uri());
    for _ in 0..5 {
        assert_eq!(
            get(&client, &free, Some("a")).await.ok(),
            Some(StatusCode::OK)
        );
    }
    let orders_url = format!("{}/orders", server.uri());
    assert_eq!(
        get(&client, &orders_url, Some("a")).await.ok(),
        Some(StatusCode::OK)
    );
    assert_eq!(
        local_429(get(&client, &orders_url, Some("a")).await).bucket(),
        "orders"
    );
    server.verify().await;
}

#[tokio::test]
async fn unmatched_requests_draw_from_the_default_route_when_set() {
    let server = MockServer::start().await;
    mock(&server, "/free", ResponseTemplate::new(200), 1).await;
    mock(&server, "/elsewhere", ResponseTemplate::new(200), 0).await;
    mock(&server, "/orders", ResponseTemplate::new(200), 1).await;
    let hourly = Limit::per_hour(1).expect("a valid limit");
    let store = MemoryStore::new();
    let client = client(
        RateLimitMiddleware::new(store.clone())
            .route(route("orders", hourly, "/orders"))
            // Its path pattern is not used: it takes everything no route matches.
            .default_route(route("fallback", hourly, "/unused"))
            .max_wait(Duration::ZERO),
    );

    let free = format!("{}/free", server.uri());
    assert_eq!(
        get(&client, &free, Some("a")).await.ok(),
        Some(StatusCode::OK)
    );
    let limited = local_429(get(&client, &free, Some("a")).await);
    assert_eq!(limited.bucket(), "fallback");
    // Every unmatched path shares the default bucket.
    let elsewhere = format!("{}/elsewhere", server.uri());
    assert_eq!(
        local_429(get(&client, &elsewhere, Some("a")).await).bucket(),
        "fallback"
    );
    // A matched route keeps its own bucket.
    let orders_url = format!("{}/orders", server.uri());
    assert_eq!(
        get(&client, &orders_url, Some("a")).await.ok(),
        Some(StatusCode::OK)
    );
    let quota = store
        .peek(&key("fallback", "a"), hourly)
        .await
        .expect("peeks");
    assert_eq!(quota.remaining(), 0);
    server.verify().await;
}

#[tokio::test(start_paused = true)]
async fn error_cost_makes_a_4xx_answer_cost_that_many_tokens() {
    let upstream = Upstream::by_path(|path| match path {
        "/ok" => StatusCode::OK,
        "/bad" => StatusCode::BAD_REQUEST,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    });
    let api = limit(1, 100, 10);
    let (store, middleware) = on_tokio_time();
    let client = upstream.client(
        middleware
            .route(route("api", api, "/**"))
            .error_cost(std::num::NonZeroU32::new(10).expect("non-zero"))
            .max_wait(Duration::from_secs(5)),
    );
    let url = |p: &str| format!("{BASE}{p}");

    assert_eq!(
        get(&client, &url("/ok"), Some("ok")).await.ok(),
        Some(StatusCode::OK)
    );
    assert_eq!(
        get(&client, &url("/broken"), Some("broken")).await.ok(),
        Some(StatusCode::INTERNAL_SERVER_ERROR)
    );
    assert_eq!(
        get(&client, &url("/bad"), Some("bad")).await.ok(),
        Some(StatusCode::BAD_REQUEST)
    );
    // A 200 and a 5xx cost one token; the 400 cost all ten.
    for (account, left) in [("ok", 9), ("broken", 9), ("bad", 0)] {
        let quota = store.peek(&key("api", account), api).await.expect("peeks");
        assert_eq!(quota.remaining(), left, "{account}: {quota:?}");
    }

    // On an empty bucket a second 400 leaves nine tokens of debt, which the next request waits
    // off: about ten token periods, where one would be 100 ms.
    assert_eq!(
        get(&client, &url("/bad"), Some("bad")).await.ok(),
        Some(StatusCode::BAD_REQUEST)
    );
    let quota = store.peek(&key("api", "bad"), api).await.expect("peeks");
    assert!(
        quota.next_token_in() > Duration::from_millis(900)
            && quota.next_token_in() <= Duration::from_millis(1_000),
        "{quota:?}"
    );
    let start = tokio::time::Instant::now();
    assert_eq!(
        get(&client, &url("/ok"), Some("bad")).await.ok(),
        Some(StatusCode::OK)
    );
    // Sent when the debt is paid, to the millisecond.
    assert_eq!(
        start.elapsed().as_millis(),
        quota.next_token_in().as_millis()
    );
    let sent = ["/ok", "/bad", "/broken"].map(|p| upstream.count(p));
    assert_eq!(sent, [2, 2, 1], "requests per path");
}

#[tokio::test]
async fn malformed_back_off_headers_are_ignored_and_huge_ones_clamped() {
    let server = MockServer::start().await;
    let too_many = || ResponseTemplate::new(429);
    mock(
        &server,
        "/api/soon",
        too_many().insert_header("Retry-After", "soon"),
        1,
    )
    .await;
    mock(
        &server,
        "/api/negative",
        too_many().insert_header("X-Ratelimit-Retry", "-3"),
        1,
    )
    .await;
    mock(
        &server,
        "/api/fallback",
        too_many()
            .insert_header("X-Ratelimit-Retry", "-3")
            .insert_header("Retry-After", "4"),
        1,
    )
    .await;
    mock(
        &server,
        "/api/huge",
        too_many().insert_header("Retry-After", "99999999"),
        2,
    )
    .await;
    // One token a second, burst 5: without the 429, four tokens would be left.
    let api = limit(1, 1_000, 5);
    let store = MemoryStore::new();
    let middleware = RateLimitMiddleware::new(store.clone()).route(route("api", api, "/api/*"));
    let clamped = client(middleware.clone().max_backoff(Duration::from_secs(30)));
    let default = client(middleware);
    let url = |p: &str| format!("{}/api/{p}", server.uri());

    let cases = [
        // The value is ignored: drained for one token period only.
        (&clamped, "soon", Duration::from_secs(1)),
        (&clamped, "negative", Duration::from_secs(1)),
        // The unusable `X-Ratelimit-Retry` is skipped for a usable `Retry-After`.
        (&clamped, "fallback", Duration::from_secs(4)),
        // 99999999 s, clamped to the middleware's maximum back-off.
        (&clamped, "huge", Duration::from_secs(30)),
        (&default, "huge", Duration::from_secs(600)),
    ];
    for (i, (client, case, drained_for)) in cases.into_iter().enumerate() {
        let account = format!("{case}-{i}");
        let status = get(client, &url(case), Some(&account)).await;
        assert_eq!(status.ok(), Some(StatusCode::TOO_MANY_REQUESTS), "{case}");
        let quota = store.peek(&key("api", &account), api).await.expect("peeks");
        assert_eq!(quota.remaining(), 0, "{case}: {quota:?}");
        assert!(
            quota.next_token_in() <= drained_for
                && quota.next_token_in() > drained_for - Duration::from_millis(200),
            "{case}: drained for {drained_for:?}, got {quota:?}"
        );
    }
    server.verify().await;
}

/// The tests that share buckets between clients through a real Redis.
#[cfg(feature = "redis")]
mod shared {
    use super::*;

    use std::future::Future;
    use std::sync::{Arc, Mutex, PoisonError};

    use burstgate::middleware::{Ticket, TicketError};
    use burstgate::{KeySecret, RedisStore};
    use redis::aio::MultiplexedConnection;
    use wiremock::{Request as MockRequest, Respond};

    /// The stores count whole milliseconds of wall time, so a wait computed from two truncated
    /// readings can end up to a millisecond before the instant it aims at; allow two.
    const CLOCK_SLACK: Duration = Duration::from_millis(2);

    /// The mock server's own request log: when each request reached it, by the test's clock.
    #[derive(Debug, Clone, Default)]
    struct Arrivals(Arc<Mutex<Vec<Instant>>>);

    impl Arrivals {
        /// A responder that records each arrival, then answers with `template`.
        fn answer(&self, template: ResponseTemplate) -> Recorded {
            Recorded {
                arrivals: self.clone(),
                template,
            }
        }

        fn sorted(&self) -> Vec<Instant> {
            let mut times = self
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone();
            times.sort();
            times
        }
    }

    struct Recorded {
        arrivals: Arrivals,
        template: ResponseTemplate,
    }

    impl Respond for Recorded {
        fn respond(&self, _: &MockRequest) -> ResponseTemplate {
            self.arrivals
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(Instant::now());
            self.template.clone()
        }
    }

    async fn connection() -> MultiplexedConnection {
        redis::Client::open(redis_server::url())
            .expect("a valid Redis URL")
            .get_multiplexed_async_connection()
            .await
            .expect("a connection to the test Redis")
    }

    /// A store on a connection of its own, as another process would have.
    async fn store(prefix: &str) -> RedisStore<MultiplexedConnection> {
        RedisStore::new(connection().await)
            .prefix(prefix)
            .expect("a valid prefix")
    }

    /// Runs `n` calls of `f` at once and waits for all of them.
    async fn all_at_once<F, T>(n: usize, f: impl Fn() -> F) -> Vec<T>
    where
        F: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        let tasks: Vec<_> = (0..n).map(|_| tokio::spawn(f())).collect();
        let mut out = Vec::with_capacity(n);
        for task in tasks {
            out.push(task.await.expect("the task finishes"));
        }
        out
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn two_clients_with_their_own_redis_connections_share_one_bucket() {
        let server = MockServer::start().await;
        let arrivals = Arrivals::default();
        let per_client = 20;
        mock(
            &server,
            "/orders",
            arrivals.answer(ResponseTemplate::new(200)),
            2 * per_client,
        )
        .await;
        let orders = limit(1, 50, 3);
        let prefix = redis_server::unique_prefix();
        let make = |store| {
            client(
                RateLimitMiddleware::new(store)
                    .route(route("orders", orders, "/orders"))
                    .max_wait(Duration::from_secs(10)),
            )
        };
        let clients = [make(store(&prefix).await), make(store(&prefix).await)];
        let url = format!("{}/orders", server.uri());

        let mut tasks = Vec::new();
        for client in &clients {
            let (client, url) = (client.clone(), url.clone());
            tasks.push(tokio::spawn(async move {
                all_at_once(per_client as usize, || {
                    let (client, url) = (client.clone(), url.clone());
                    async move { get(&client, &url, Some("seller-1")).await.ok() }
                })
                .await
            }));
        }
        for task in tasks {
            let statuses = task.await.expect("the client's task finishes");
            assert!(
                statuses.iter().all(|s| *s == Some(StatusCode::OK)),
                "every request is sent: {statuses:?}"
            );
        }

        let sent = arrivals.sorted();
        assert_eq!(sent.len(), 2 * per_client as usize);
        within(&sent, orders, "the bucket");
        server.verify().await;
    }

    /// `times`, sorted, never hold more requests in a window than `limit`'s burst and what
    /// refills over the window, and one more for the timer's rounding.
    fn within(times: &[Instant], limit: Limit, what: &str) {
        let period = limit.interval().as_secs_f64() / f64::from(limit.tokens());
        for i in 0..times.len() {
            for j in i..times.len() {
                let window = (times[j] - times[i]).as_secs_f64();
                let count = (j - i + 1) as f64;
                let allowed = f64::from(limit.burst()) + window / period + 1.0;
                assert!(
                    count <= allowed,
                    "{what}: {count} requests within {window:.3} s, at most {allowed:.2} allowed"
                );
            }
        }
    }

    /// Two clients, each with its own Redis connection, send to an endpoint with a limit of its
    /// own and to another path, both under the account's limit: every request is sent, the
    /// endpoint's arrivals keep the endpoint's limit, and all arrivals together the account's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn two_routes_on_one_request_keep_both_limits_across_clients() {
        let server = MockServer::start().await;
        let (orders_at, stocks_at) = (Arrivals::default(), Arrivals::default());
        let per_client = 10;
        mock(
            &server,
            "/orders",
            orders_at.answer(ResponseTemplate::new(200)),
            2 * per_client,
        )
        .await;
        mock(
            &server,
            "/stocks",
            stocks_at.answer(ResponseTemplate::new(200)),
            2 * per_client,
        )
        .await;
        let endpoint = limit(1, 100, 3);
        let account = limit(1, 50, 2);
        let prefix = redis_server::unique_prefix();
        let make = |store| {
            client(
                RateLimitMiddleware::new(store)
                    .route(route("orders", endpoint, "/orders"))
                    .route(route("account", account, "/**"))
                    .max_wait(Duration::from_secs(10)),
            )
        };
        let clients = [make(store(&prefix).await), make(store(&prefix).await)];
        let mut tasks = Vec::new();
        for client in &clients {
            for at in ["/orders", "/stocks"] {
                let (client, url) = (client.clone(), format!("{}{at}", server.uri()));
                tasks.push(tokio::spawn(async move {
                    all_at_once(per_client as usize, || {
                        let (client, url) = (client.clone(), url.clone());
                        async move { get(&client, &url, Some("seller-1")).await.ok() }
                    })
                    .await
                }));
            }
        }
        for task in tasks {
            let statuses = task.await.expect("the client's task finishes");
            assert!(
                statuses.iter().all(|s| *s == Some(StatusCode::OK)),
                "every request is sent: {statuses:?}"
            );
        }
        let orders = orders_at.sorted();
        let mut all = orders.clone();
        all.extend(stocks_at.sorted());
        all.sort();
        assert_eq!(all.len(), 4 * per_client as usize);
        within(&orders, endpoint, "the endpoint");
        within(&all, account, "the account");
        server.verify().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn an_upstream_429_makes_every_client_back_off_for_the_time_it_names() {
        let server = MockServer::start().await;
        let told = Arrivals::default();
        let after = Arrivals::default();
        Mock::given(method("GET"))
            .and(path("/orders"))
            .respond_with(
                told.answer(ResponseTemplate::new(429).insert_header("X-Ratelimit-Retry", "2")),
            )
            .up_to_n_times(1)
            .with_priority(1)
            .expect(1)
            .mount(&server)
            .await;
        mock(
            &server,
            "/orders",
            after.answer(ResponseTemplate::new(200)),
            2,
        )
        .await;
        // Three tokens in the bucket: without the feedback, both next requests would go at once.
        let orders = limit(1, 100, 3);
        let prefix = redis_server::unique_prefix();
        let make = |store| {
            client(
                RateLimitMiddleware::new(store)
                    .route(route("orders", orders, "/orders"))
                    .max_wait(Duration::from_secs(10)),
            )
        };
        let told_one = make(store(&prefix).await);
        let other = make(store(&prefix).await);
        let url = format!("{}/orders", server.uri());

        let status = get(&told_one, &url, Some("seller-1")).await;
        assert_eq!(status.ok(), Some(StatusCode::TOO_MANY_REQUESTS));
        let next = [told_one, other].map(|client| {
            let url = url.clone();
            tokio::spawn(async move { get(&client, &url, Some("seller-1")).await.ok() })
        });
        for call in next {
            assert_eq!(
                call.await.expect("the request task finishes"),
                Some(StatusCode::OK)
            );
        }

        let told_at = told.sorted()[0];
        let sent: Vec<Duration> = after.sorted().iter().map(|t| *t - told_at).collect();
        assert_eq!(sent.len(), 2);
        for waited in &sent {
            assert!(
                *waited >= Duration::from_secs(2) - CLOCK_SLACK
                    && *waited < Duration::from_millis(3_500),
                "sent after the 429: {sent:?}"
            );
        }
        server.verify().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn an_upstream_429_stops_reservations_already_waiting_in_two_stores() {
        let server = MockServer::start().await;
        let told = Arrivals::default();
        let after = Arrivals::default();
        // The 429 comes back 200 ms after it arrives, while four requests wait their turns.
        Mock::given(method("GET"))
            .and(path("/orders"))
            .respond_with(
                told.answer(
                    ResponseTemplate::new(429)
                        .insert_header("X-Ratelimit-Retry", "2")
                        .set_delay(Duration::from_millis(200)),
                ),
            )
            .up_to_n_times(1)
            .with_priority(1)
            .expect(1)
            .mount(&server)
            .await;
        let waiting = 4;
        mock(
            &server,
            "/orders",
            after.answer(ResponseTemplate::new(200)),
            waiting,
        )
        .await;
        // One request per 400 ms, no burst: the waiting ones are slotted at 400, 800, 1200 and
        // 1600 ms, all inside the 2 s the upstream asks for.
        let orders = limit(1, 400, 1);
        let prefix = redis_server::unique_prefix();
        let connect = || async {
            RedisStore::connect(&redis_server::url())
                .await
                .expect("connects")
                .prefix(&prefix)
                .expect("a valid prefix")
        };
        let (one, two) = (connect().await, connect().await);
        let make = |store| {
            client(
                RateLimitMiddleware::new(store)
                    .route(route("orders", orders, "/orders"))
                    .max_wait(Duration::from_secs(10)),
            )
        };
        let clients = [make(one.clone()), make(two)];
        let url = format!("{}/orders", server.uri());
        let bucket = key("orders", "seller-1");

        let first = {
            let (client, url) = (clients[0].clone(), url.clone());
            tokio::spawn(async move { get(&client, &url, Some("seller-1")).await.ok() })
        };
        peek_until(&one, &bucket, orders, |q| q.remaining() == 0).await;
        let mut calls = Vec::new();
        for i in 0..waiting {
            let (client, url) = (clients[i as usize % 2].clone(), url.clone());
            calls.push(tokio::spawn(async move {
                get(&client, &url, Some("seller-1")).await.ok()
            }));
        }
        // All four are queued, and the 429 has not been fed back yet.
        let queued = peek_until(&one, &bucket, orders, |q| {
            q.next_token_in() > Duration::from_millis(1_500)
        })
        .await;
        assert_eq!(
            queued.halted_until(),
            None,
            "the drain came first: {queued:?}"
        );

        assert_eq!(
            first.await.expect("the first request finishes"),
            Some(StatusCode::TOO_MANY_REQUESTS)
        );
        for call in calls {
            assert_eq!(
                call.await.expect("a waiting request finishes"),
                Some(StatusCode::OK)
            );
        }
        // Nothing reached the upstream within 2 s of the 429 (counted from when the 429's
        // request arrived, 200 ms before the client read the answer), and what came after went
        // one token period apart from there, in their order, none before its turn.
        let told_at = told.sorted()[0];
        let sent: Vec<Duration> = after.sorted().iter().map(|t| *t - told_at).collect();
        assert_eq!(sent.len(), waiting as usize);
        for (i, at) in (0..).zip(&sent) {
            let turn = Duration::from_secs(2) + orders.interval() * i;
            assert!(*at >= turn - CLOCK_SLACK, "sent before its turn: {sent:?}");
        }
        assert!(sent[3] < Duration::from_secs(5), "{sent:?}");
        server.verify().await;
    }

    #[tokio::test]
    async fn an_account_header_keys_by_the_token_and_never_stores_it_in_clear() {
        let server = MockServer::start().await;
        mock(&server, "/orders", ResponseTemplate::new(200), 2).await;
        let orders = Limit::per_hour(1).expect("a valid limit");
        let prefix = redis_server::unique_prefix();
        let store = store(&prefix).await;
        let client = client(
            RateLimitMiddleware::new(store.clone())
                .route(route("orders", orders, "/orders"))
                .account_header(http::header::AUTHORIZATION)
                .max_wait(Duration::ZERO),
        );
        let url = format!("{}/orders", server.uri());
        let tokens = ["Bearer tok-one-S3CRET", "Bearer tok-two-S3CRET"];
        let send = |token: &'static str| {
            client
                .get(&url)
                .header(http::header::AUTHORIZATION, token)
                .send()
        };

        for token in tokens {
            let first = send(token).await.map(|r| r.status());
            assert_eq!(first.ok(), Some(StatusCode::OK), "{token}");
            let again = send(token).await.map(|r| r.status());
            assert_eq!(local_429(again).bucket(), "orders");
        }

        let mut conn = connection().await;
        let mut keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}:*"))
            .query_async(&mut conn)
            .await
            .expect("KEYS");
        keys.sort();
        for k in &keys {
            assert!(
                !k.contains("tok-") && !k.contains("S3CRET") && !k.contains("Bearer"),
                "a token in clear: {k}"
            );
        }
        let mut expected: Vec<String> = tokens
            .iter()
            .map(|t| store.redis_key(&BucketKey::hashed("orders", t).expect("a valid key")))
            .collect();
        expected.sort();
        assert_eq!(keys, expected);
        server.verify().await;
    }

    /// A middleware on a Redis of the test's own (it is flushed), with "1 per minute, burst 2"
    /// on `/orders` and the tickets' secret fixed, and its store.
    async fn ticketing(
        redis: &redis_server::Spawned,
    ) -> (
        RateLimitMiddleware<RedisStore<MultiplexedConnection>>,
        RedisStore<MultiplexedConnection>,
        MultiplexedConnection,
    ) {
        let conn = redis::Client::open(format!("redis://127.0.0.1:{}/", redis.port))
            .expect("a valid Redis URL")
            .get_multiplexed_async_connection()
            .await
            .expect("a connection to the test's Redis");
        let store = RedisStore::new(conn.clone())
            .prefix(&redis_server::unique_prefix())
            .expect("a valid prefix");
        let limiter = RateLimitMiddleware::new(store.clone())
            .route(route("orders", limit(1, 60_000, 2), "/orders"))
            .key_secret(KeySecret::new(b"the tests' application secret").expect("a secret"));
        (limiter, store, conn)
    }

    /// Books a turn of `seller-1` on `url`.
    async fn book(
        limiter: &RateLimitMiddleware<RedisStore<MultiplexedConnection>>,
        url: &str,
    ) -> Ticket {
        let request = reqwest::Client::new().get(url).build().expect("a request");
        let mut account = http::Extensions::new();
        account.insert(Account::new("seller-1"));
        limiter
            .reserve(&request, &account)
            .await
            .expect("booked")
            .expect("a route draws from it")
    }

    fn ticket_error<T: std::fmt::Debug>(
        result: Result<T, reqwest_middleware::Error>,
    ) -> TicketError {
        match result {
            Err(reqwest_middleware::Error::Middleware(e)) => {
                match e.downcast_ref::<TicketError>() {
                    Some(why) => *why,
                    None => panic!("a middleware error other than a TicketError: {e:?}"),
                }
            }
            other => panic!("expected a refused ticket, got {other:?}"),
        }
    }

    async fn flushall(conn: &mut MultiplexedConnection) {
        let _: () = redis::cmd("FLUSHALL")
            .query_async(conn)
            .await
            .expect("FLUSHALL");
    }

    /// The bug: a ticket's only record of having gone was the mark its sending wrote, so once
    /// Redis lost it (here `FLUSHALL`; a restart without persistence, a failover to a replica
    /// that lacked it) a job delivered again sent the same ticket a second time. The booking
    /// writes the mark now, and a ticket whose mark is gone is refused as expired.
    #[tokio::test]
    async fn a_ticket_already_sent_does_not_go_again_after_redis_loses_its_mark() {
        let redis = redis_server::spawn("").expect("a redis-server of our own");
        let server = MockServer::start().await;
        mock(&server, "/orders", ResponseTemplate::new(200), 1).await;
        let (limiter, _, mut conn) = ticketing(&redis).await;
        let client = client(limiter.clone());
        let url = format!("{}/orders", server.uri());
        let send = |ticket: &Ticket| {
            client
                .get(&url)
                .with_extension(Account::new("seller-1"))
                .with_extension(ticket.clone())
                .send()
        };

        let ticket = book(&limiter, &url).await;
        let sent = send(&ticket).await.map(|r| r.status());
        assert_eq!(sent.ok(), Some(StatusCode::OK));
        assert_eq!(ticket_error(send(&ticket).await), TicketError::Spent);
        flushall(&mut conn).await;
        let again = send(&ticket).await;
        assert_eq!(
            server.received_requests().await.map(|r| r.len()),
            Some(1),
            "sent again after FLUSHALL: {again:?}"
        );
        assert_eq!(ticket_error(again), TicketError::Expired);
        server.verify().await;
        redis_server::kill(redis);
    }

    /// A ticket whose mark Redis lost cannot be given back either: the store cannot tell
    /// whether it went already, nor whether its tokens are still taken. Refused as expired, and
    /// nothing goes back to the bucket.
    #[tokio::test]
    async fn a_ticket_cancelled_after_redis_lost_its_mark_gives_nothing_back() {
        let redis = redis_server::spawn("").expect("a redis-server of our own");
        let server = MockServer::start().await;
        mock(&server, "/orders", ResponseTemplate::new(200), 1).await;
        let (limiter, store, mut conn) = ticketing(&redis).await;
        let client = client(limiter.clone());
        let url = format!("{}/orders", server.uri());
        let orders = limit(1, 60_000, 2);
        let bucket = key("orders", "seller-1");

        let ticket = book(&limiter, &url).await;
        flushall(&mut conn).await;
        // The bucket is full again; one request takes a token of it.
        assert_eq!(
            get(&client, &url, Some("seller-1")).await.ok(),
            Some(StatusCode::OK)
        );
        assert_eq!(
            store
                .peek(&bucket, orders)
                .await
                .expect("peeks")
                .remaining(),
            1
        );
        assert_eq!(
            ticket_error(limiter.cancel(&ticket).await),
            TicketError::Expired
        );
        assert_eq!(
            store
                .peek(&bucket, orders)
                .await
                .expect("peeks")
                .remaining(),
            1
        );
        // Refused again, the same way, however many times the job is dropped.
        assert_eq!(
            ticket_error(limiter.cancel(&ticket).await),
            TicketError::Expired
        );
        assert_eq!(
            store
                .peek(&bucket, orders)
                .await
                .expect("peeks")
                .remaining(),
            1
        );
        server.verify().await;
        redis_server::kill(redis);
    }
}
