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
#[cfg(feature = "redis")]
mod shared;
