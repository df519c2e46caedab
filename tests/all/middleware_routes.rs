//! What a request takes through the reqwest middleware, on tokio's paused clock in front of the
//! in-process upstream (`support::upstream`): its cost (a route's, a request's own, and what the
//! upstream says a call cost), and every route that matches it, all taken at once or none, more
//! than one store call takes included.
#![cfg(feature = "reqwest")]

use std::num::NonZeroU32;
use std::time::Duration;

use burstgate::middleware::{Account, Cost, RateLimitMiddleware, rate_limited};
use burstgate::{BucketKey, BucketStore, Limit, MemoryStore, StoreError, TokioClock};
use reqwest::StatusCode;

use crate::support::exact_route;
use crate::support::upstream::{
    Answer, BASE, OnTokioTime, SELLER, Upstream, account, endpoint_and_account, ok_with,
    one_a_second_burst_5, sends, to,
};

/// Sends `costs.len()` requests one after the other through `limiter` to `upstream`, each with
/// its [`Cost`] when given: when each reached the upstream, in ms from the start.
async fn one_by_one(limiter: OnTokioTime, upstream: &Upstream, costs: &[Option<u32>]) -> Vec<u128> {
    let client = upstream.client(limiter);
    let start = tokio::time::Instant::now();
    for cost in costs {
        let mut request = client.get(format!("{BASE}/orders"));
        if let Some(cost) = cost.and_then(NonZeroU32::new) {
            request = request.with_extension(Cost::new(cost));
        }
        request.send().await.expect("sent");
    }
    upstream.sent_ms_since(start)
}

fn two(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("not zero")
}

#[tokio::test(start_paused = true)]
async fn a_route_cost_takes_that_many_tokens_and_a_request_may_say_its_own() {
    let ok = Upstream::answering(StatusCode::OK);
    let clock = TokioClock::new();
    let limit = Limit::per_second(1)
        .and_then(|l| l.with_burst(5))
        .expect("a valid limit");
    let limiter = RateLimitMiddleware::new(MemoryStore::new().with_clock(clock))
        .with_clock(clock)
        .route(
            exact_route("api", limit, "/orders")
                .expect("a route")
                .cost(two(2)),
        )
        .max_wait(Duration::from_secs(60));
    // 2, 2, then 2 more with 1 left: a second; then a request of 5, the whole burst, once the
    // bucket is full again, 5 s after it was emptied; then one of 1, a second later.
    let sent = one_by_one(limiter, &ok, &[None, None, None, Some(5), Some(1)]).await;
    assert_eq!(sent, [0, 0, 1_000, 6_000, 7_000]);
}

#[tokio::test(start_paused = true)]
async fn a_cost_above_the_burst_is_an_error_and_nothing_is_sent() {
    let ok = Upstream::answering(StatusCode::OK);
    let client = ok.client(one_a_second_burst_5());
    let err = client
        .get(format!("{BASE}/orders"))
        .with_extension(Cost::new(two(6)))
        .send()
        .await
        .expect_err("a cost no bucket of burst 5 can serve");
    let reqwest_middleware::Error::Middleware(e) = err else {
        panic!("a middleware error: {err:?}");
    };
    assert!(
        matches!(
            e.downcast_ref::<StoreError>(),
            Some(StoreError::CostAboveBurst { cost: 6, burst: 5 })
        ),
        "{e}"
    );
    assert!(ok.sent_ms_since(tokio::time::Instant::now()).is_empty());
}

/// Three requests one after the other, "1 a second, burst 5", against an upstream that reports
/// each call cost `cost` in `X-Request-Cost`, read with `cost_header`: when each was sent, in ms.
async fn three_reporting_cost(cost: &'static str) -> Vec<u128> {
    let upstream = Upstream::by_turn(move |_| ok_with("x-request-cost", cost));
    let limiter =
        one_a_second_burst_5().cost_header(http::HeaderName::from_static("x-request-cost"));
    one_by_one(limiter, &upstream, &[None, None, None]).await
}

#[tokio::test(start_paused = true)]
async fn what_an_answer_says_a_call_cost_is_settled() {
    let cost_header = || http::HeaderName::from_static("x-request-cost");
    // Each call cost 3, and took 1: 2 more each, as debt. 5 less 3 leaves 2, less 3 more
    // leaves 1 owed, and the third waits 2 s for a token.
    assert_eq!(three_reporting_cost("3").await, [0, 0, 2_000]);
    // Each call cost nothing (a cached answer): its token goes back, and seven go at once
    // where five would.
    let free = Upstream::by_turn(|_| ok_with("x-request-cost", "0"));
    let limiter = one_a_second_burst_5().cost_header(cost_header());
    assert_eq!(one_by_one(limiter, &free, &[None; 7]).await, [0; 7]);
    // Without the header read, the sixth waits its second.
    let free = Upstream::by_turn(|_| ok_with("x-request-cost", "0"));
    let limiter = one_a_second_burst_5();
    assert_eq!(
        one_by_one(limiter, &free, &[None; 7]).await[5..],
        [1_000, 2_000]
    );
}

#[tokio::test(start_paused = true)]
async fn a_reported_cost_is_rounded_up_and_clamped_to_max_backoff() {
    let cost_header = || http::HeaderName::from_static("x-request-cost");
    // 2.5 tokens is 3, as for "3".
    assert_eq!(three_reporting_cost("2.5").await, [0, 0, 2_000]);
    // Four billion tokens would block the bucket for a century: owed at most what refills in
    // max_backoff (60 s here), so the next request is refused for about a minute.
    let hostile = Upstream::by_turn(|_| ok_with("x-request-cost", "4294967295"));
    let limiter = one_a_second_burst_5()
        .cost_header(cost_header())
        .max_backoff(Duration::from_secs(60))
        .max_wait(Duration::from_secs(10));
    let client = hostile.client(limiter);
    client
        .get(format!("{BASE}/orders"))
        .send()
        .await
        .expect("sent");
    let err = client
        .get(format!("{BASE}/orders"))
        .send()
        .await
        .expect_err("owed");
    let retry = rate_limited(&err).expect("the local 429").retry_after();
    assert!(
        (Duration::from_secs(56)..=Duration::from_secs(57)).contains(&retry),
        "{retry:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn every_route_that_matches_applies() {
    // The endpoint alone would let four go at once; the account spaces them two seconds apart
    // after its burst of two.
    let upstream = Upstream::answering(StatusCode::OK);
    let sent = sends(endpoint_and_account(), &upstream, 3).await;
    assert_eq!(sent, [0, 0, 2_000, 4_000]);
    // Another path draws from the account alone, and waits its turn behind them.
    let upstream = Upstream::answering(StatusCode::OK);
    let client = upstream.client(endpoint_and_account());
    let start = tokio::time::Instant::now();
    to(&client, "/orders").await;
    to(&client, "/stocks").await;
    to(&client, "/stocks").await;
    assert_eq!(upstream.sent_ms_since(start), [0, 0, 2_000]);
}

#[tokio::test(start_paused = true)]
async fn a_request_refused_on_one_route_takes_nothing_from_the_other() {
    // The endpoint: one every 10 s, burst 3. The account: one every 2 s, burst 2.
    let clock = TokioClock::new();
    let endpoint = Limit::new(1, Duration::from_secs(10))
        .and_then(|l| l.with_burst(3))
        .expect("a valid limit");
    let account = Limit::new(1, Duration::from_secs(2))
        .and_then(|l| l.with_burst(2))
        .expect("a valid limit");
    let limiter = RateLimitMiddleware::new(MemoryStore::new().with_clock(clock))
        .with_clock(clock)
        .route(exact_route("orders", endpoint, "/orders").expect("a route"))
        .route(exact_route("account", account, "/**").expect("a route"))
        .max_wait(Duration::ZERO);
    let upstream = Upstream::answering(StatusCode::OK);
    let client = upstream.client(limiter);
    let start = tokio::time::Instant::now();
    let send = || {
        client
            .get(format!("{BASE}/orders"))
            .with_extension(Account::new(SELLER))
            .send()
    };
    send().await.expect("sent");
    send().await.expect("sent");
    // The account's burst is spent: refused on it, told when its next token comes.
    let refused = send().await.expect_err("a local 429");
    let limited = rate_limited(&refused).expect("the local 429");
    assert_eq!(limited.bucket(), "account");
    assert_eq!(limited.retry_after(), Duration::from_secs(2));
    // The endpoint kept its third token: it goes with the account's next one.
    tokio::time::advance(Duration::from_secs(2)).await;
    send().await.expect("sent on the endpoint's last token");
    // And now the endpoint refuses, its next token 8 s away.
    tokio::time::advance(Duration::from_secs(2)).await;
    let refused = send().await.expect_err("a local 429");
    let limited = rate_limited(&refused).expect("the local 429");
    assert_eq!(limited.bucket(), "orders");
    assert_eq!(upstream.sent_ms_since(start), [0, 0, 2_000]);
}

#[tokio::test(start_paused = true)]
async fn an_upstream_429_backs_off_every_route_and_a_report_lowers_the_first() {
    // A 429 with five seconds to wait: the account's bucket is drained too, so a request to
    // another path waits as well.
    let upstream = Upstream::by_turn(|n| match n {
        0 => Answer::new(StatusCode::TOO_MANY_REQUESTS).header("retry-after", "5"),
        _ => Answer::ok(),
    });
    let client = upstream.client(endpoint_and_account());
    let start = tokio::time::Instant::now();
    to(&client, "/orders").await;
    to(&client, "/stocks").await;
    assert_eq!(upstream.sent_ms_since(start), [0, 5_000]);

    // "Nothing left" is the first route's, the endpoint's: the account keeps its count.
    let upstream = Upstream::by_turn(|_| ok_with("x-ratelimit-remaining", "0"));
    let client = upstream.client(endpoint_and_account());
    let start = tokio::time::Instant::now();
    to(&client, "/orders").await;
    to(&client, "/stocks").await;
    to(&client, "/orders").await;
    // The second goes at once on the account's second token; the third waits for the
    // endpoint's next (a second after the first) and the account's (two seconds after).
    assert_eq!(upstream.sent_ms_since(start), [0, 0, 2_000]);
}

#[tokio::test(start_paused = true)]
async fn of_two_routes_of_one_bucket_the_first_that_matches_applies() {
    // A batch counts as ten requests of the account's budget: its route of the account's
    // bucket comes before the one of every path.
    let clock = TokioClock::new();
    let account = Limit::per_second(1)
        .and_then(|l| l.with_burst(20))
        .expect("a valid limit");
    let limiter = RateLimitMiddleware::new(MemoryStore::new().with_clock(clock))
        .with_clock(clock)
        .route(
            exact_route("account", account, "/batch")
                .expect("a route")
                .cost(NonZeroU32::new(10).expect("non-zero")),
        )
        .route(exact_route("account", account, "/**").expect("a route"))
        .max_wait(Duration::ZERO);
    let upstream = Upstream::answering(StatusCode::OK);
    let client = upstream.client(limiter);
    let start = tokio::time::Instant::now();
    to(&client, "/batch").await;
    to(&client, "/batch").await;
    // The twenty tokens are spent: a plain request is refused, with a second to wait.
    let refused = client
        .get(format!("{BASE}/stocks"))
        .with_extension(Account::new(SELLER))
        .send()
        .await
        .expect_err("a local 429");
    let limited = rate_limited(&refused).expect("the local 429");
    assert_eq!(limited.retry_after(), Duration::from_secs(1));
    assert_eq!(upstream.sent_ms_since(start), [0, 0]);
}

#[tokio::test(start_paused = true)]
async fn several_routes_wait_by_default_no_longer_than_the_fastest_allows() {
    // The endpoint: one a minute, burst 1. The account: ten a second. Its default ceiling, two
    // of the account's token periods, is what a request on both may wait: the endpoint's next
    // token, a minute away, is the local 429 at once, not a minute of the account's tokens held.
    let clock = TokioClock::new();
    let endpoint = Limit::per_minute(1).expect("a valid limit");
    let account = Limit::per_second(10).expect("a valid limit");
    let limiter = RateLimitMiddleware::new(MemoryStore::new().with_clock(clock))
        .with_clock(clock)
        .route(exact_route("orders", endpoint, "/orders").expect("a route"))
        .route(exact_route("account", account, "/**").expect("a route"));
    let upstream = Upstream::answering(StatusCode::OK);
    let client = upstream.client(limiter);
    let start = tokio::time::Instant::now();
    to(&client, "/orders").await;
    let refused = client
        .get(format!("{BASE}/orders"))
        .with_extension(Account::new(SELLER))
        .send()
        .await
        .expect_err("a local 429");
    let limited = rate_limited(&refused).expect("the local 429");
    assert_eq!(limited.bucket(), "orders");
    assert_eq!(limited.retry_after(), Duration::from_secs(60));
    assert_eq!(start.elapsed(), Duration::ZERO, "nothing waited");
    // The account's tokens were not held: another path goes at once.
    to(&client, "/stocks").await;
    assert_eq!(upstream.sent_ms_since(start), [0, 0]);
}

/// Seventeen routes over every path, each of its own bucket: sixteen of an endpoint's kind (ten
/// a second, burst 10) and the account's last (one every 2 s, burst 1), more than one store
/// call takes ([`MAX_TAKES`](burstgate::MAX_TAKES)); and the store it decides on.
fn seventeen_routes(max_wait: Duration) -> (OnTokioTime, MemoryStore<TokioClock>) {
    let clock = TokioClock::new();
    let fast = Limit::per_second(10).expect("a valid limit");
    let account = Limit::new(1, Duration::from_secs(2)).expect("a valid limit");
    let routes = (0..16)
        .map(|i| exact_route(&format!("r{i}"), fast, "/**").expect("a route"))
        .chain([exact_route("account", account, "/**").expect("a route")]);
    let store = MemoryStore::new().with_clock(clock);
    let limiter = RateLimitMiddleware::new(store.clone())
        .with_clock(clock)
        .routes(routes)
        .max_wait(max_wait);
    (limiter, store)
}

/// A request that more than sixteen routes matched failed on every call: its buckets went to one
/// store call, which takes at most sixteen. It is served: every bucket is taken, in turn, at the
/// time the request goes, the slowest route spacing the requests.
#[tokio::test(start_paused = true)]
async fn more_than_sixteen_routes_on_one_request_failed_every_call() {
    let upstream = Upstream::answering(StatusCode::OK);
    let (limiter, store) = seventeen_routes(Duration::from_secs(60));
    let sent = sends(limiter, &upstream, 3).await;
    assert_eq!(sent, [0, 2_000, 4_000, 6_000]);
    // Each request took one token of every bucket, no more: the last, at 6 s, one of ten.
    let fast = Limit::per_second(10).expect("a valid limit");
    for i in 0..16 {
        let key = BucketKey::new(&format!("r{i}"), SELLER).expect("a valid key");
        let left = store.peek(&key, fast).await.expect("peeks");
        assert_eq!(left.remaining(), 9, "bucket r{i}");
    }
}

/// Refused on its last bucket, a request on more than sixteen gives back what the others took,
/// and the local 429 names the bucket that refused, with its time.
#[tokio::test(start_paused = true)]
async fn more_than_sixteen_routes_refused_on_one_give_the_others_back() {
    let upstream = Upstream::answering(StatusCode::OK);
    let (limiter, store) = seventeen_routes(Duration::ZERO);
    let client = upstream.client(limiter);
    let start = tokio::time::Instant::now();
    to(&client, "/orders").await;
    let refused = client
        .get(format!("{BASE}/orders"))
        .with_extension(Account::new(SELLER))
        .send()
        .await
        .expect_err("a local 429");
    let limited = rate_limited(&refused).expect("the local 429");
    assert_eq!(limited.bucket(), "account");
    assert_eq!(limited.retry_after(), Duration::from_secs(2));
    let fast = Limit::per_second(10).expect("a valid limit");
    for i in 0..16 {
        let key = BucketKey::new(&format!("r{i}"), SELLER).expect("a valid key");
        let left = store.peek(&key, fast).await.expect("peeks");
        assert_eq!(
            left.remaining(),
            9,
            "bucket r{i}: the refused request's token came back"
        );
    }
    assert_eq!(upstream.sent_ms_since(start), [0]);
    // Booking such a request is refused, clearly: a ticket names at most sixteen buckets.
    let request = reqwest::Client::new()
        .get(format!("{BASE}/orders"))
        .build()
        .expect("a request");
    let (limiter, _) = seventeen_routes(Duration::ZERO);
    let booked = limiter
        .reserve(&request, &account(SELLER))
        .await
        .expect_err("refused");
    let reqwest_middleware::Error::Middleware(e) = &booked else {
        panic!("{booked:?}");
    };
    assert!(
        matches!(
            e.downcast_ref::<StoreError>(),
            Some(StoreError::TooManyAtOnce { count: 17, max: 16 })
        ),
        "{booked:?}"
    );
}
