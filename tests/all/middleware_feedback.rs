//! The reqwest middleware reading the upstream's answers, on tokio's paused clock in front of the
//! in-process upstream (`support::upstream`): a 429 (or a 503 with a time) backing off requests
//! already waiting, and the caller that goes away after it; a report of the tokens left lowering
//! the shared bucket, never raising it; a report of nothing left from an upstream with a margin
//! moving the next slot back; and reqwest-retry retrying the local 429.
#![cfg(feature = "reqwest")]

use std::time::Duration;

use burstgate::middleware::{Account, RateLimitMiddleware};
use burstgate::{BucketKey, BucketStore, Limit, ManualClock, MemoryStore, RateLimited, TokioClock};
use reqwest::StatusCode;

use crate::support::HeldDrains;
use crate::support::exact_route;
use crate::support::upstream::{
    Answer, BASE, OnTokioTime, SELLER, Upstream, ok_with, one_a_second_burst_5, sends,
};

/// A client limited to one request per 400 ms (burst 1) on a `MemoryStore`, in front of an
/// upstream that answers the first request with a 429 "retry in 2 s" after 200 ms and every other
/// at once with a 200; the first request is sent, then `waiting` more, 10 ms later, which reserve
/// the slots at 400, 800, ... ms. Returns each waiting request's result, and the upstream's log in
/// ms from the start.
async fn waiting_requests_meet_a_429(
    waiting: usize,
    max_wait: Duration,
) -> (
    Vec<Result<StatusCode, reqwest_middleware::Error>>,
    Vec<(u128, StatusCode)>,
) {
    let clock = TokioClock::new();
    let store = MemoryStore::new().with_clock(clock);
    let api = Limit::new(1, Duration::from_millis(400)).expect("a valid limit");
    let upstream = Upstream::by_turn(|n| match n {
        0 => Answer::new(StatusCode::TOO_MANY_REQUESTS)
            .header("x-ratelimit-retry", "2")
            .after(Duration::from_millis(200)),
        _ => Answer::ok(),
    });
    let client = upstream.client(
        RateLimitMiddleware::new(store)
            .with_clock(clock)
            .route(exact_route("api", api, "/orders").expect("a route"))
            .max_wait(max_wait),
    );
    let start = tokio::time::Instant::now();
    let send = |client: reqwest_middleware::ClientWithMiddleware| async move {
        client
            .get(format!("{BASE}/orders"))
            .with_extension(Account::new(SELLER))
            .send()
            .await
            .map(|r| r.status())
    };
    let first = tokio::spawn(send(client.clone()));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let calls: Vec<_> = (0..waiting)
        .map(|_| tokio::spawn(send(client.clone())))
        .collect();
    let first = first.await.expect("the first request finishes");
    assert_eq!(first.ok(), Some(StatusCode::TOO_MANY_REQUESTS));
    let mut results = Vec::new();
    for call in calls {
        results.push(call.await.expect("a waiting request finishes"));
    }
    (results, upstream.answered_ms_since(start))
}

#[tokio::test(start_paused = true)]
async fn an_upstream_429_stops_reservations_granted_before_it_on_a_memory_store() {
    let (results, log) = waiting_requests_meet_a_429(4, Duration::from_secs(10)).await;
    for result in &results {
        assert_eq!(result.as_ref().ok(), Some(&StatusCode::OK), "{result:?}");
    }
    // The 429 reached the upstream at 0 ms and came back at 200 ms, saying 2 s: nothing is
    // sent before 2200 ms, and the four that were waiting go in their order from there, one
    // token period apart. Before, they went at their first slots, 400 to 1600 ms.
    let sent: Vec<u128> = log.iter().map(|(at, _)| *at).collect();
    assert_eq!(sent, [0, 2_200, 2_600, 3_000, 3_400], "{log:?}");
    assert_eq!(log[0].1, StatusCode::TOO_MANY_REQUESTS);
}

#[tokio::test(start_paused = true)]
async fn a_reservation_an_upstream_429_stops_past_its_ceiling_is_a_local_429() {
    // A ceiling of 2 s: each first slot fits, none behind the back-off does.
    let (results, log) = waiting_requests_meet_a_429(4, Duration::from_secs(2)).await;
    assert_eq!(log.len(), 1, "only the first request was sent: {log:?}");
    for result in results {
        let Err(reqwest_middleware::Error::Middleware(e)) = result else {
            panic!("expected the local 429, got {result:?}");
        };
        let limited = e.downcast_ref::<RateLimited>().expect("a RateLimited");
        assert_eq!(limited.bucket(), "api");
        assert!(limited.retry_after() > Duration::ZERO, "{limited:?}");
    }
}

/// A caller that gives up once the upstream's 429 is in (a timeout around the request, a
/// cancelled job) must not take the back-off with it: the drain still reaches the shared bucket,
/// and every other worker waits.
#[test]
fn a_429s_back_off_survives_the_caller_going_away() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let clock = ManualClock::new(1_000_000);
        let store = HeldDrains::new(MemoryStore::new().with_clock(clock.clone()));
        let limit = Limit::per_second(1)
            .and_then(|l| l.with_burst(5))
            .expect("a valid limit");
        let route = exact_route("api", limit, "/").expect("a valid route");
        // Every request answered with a 429 asking for 30 s, without a network.
        let upstream = Upstream::by_turn(|_| {
            Answer::new(StatusCode::TOO_MANY_REQUESTS).header("retry-after", "30")
        });
        let client = upstream.client(
            RateLimitMiddleware::new(store.clone())
                .with_clock(clock.clone())
                .route(route),
        );

        let request = tokio::spawn(async move { client.get(format!("{BASE}/")).send().await });
        store.started.notified().await;
        // The answer is in and the drain under way: the caller goes away.
        request.abort();
        let _ = request.await;
        store.release.add_permits(1);

        let key = BucketKey::new("api", "-").expect("a valid key");
        let mut drained = false;
        for _ in 0..100 {
            let state = store.inner.peek(&key, limit).await.expect("peek");
            if state.remaining() == 0 && state.halted_until().is_some() {
                drained = true;
                break;
            }
            tokio::task::yield_now().await;
        }
        assert!(drained, "the drain was lost with the caller");
    });
}

#[tokio::test(start_paused = true)]
async fn a_report_of_fewer_tokens_left_lowers_the_shared_bucket() {
    // Someone else spent the account's budget: after the first request, one token is left.
    let upstream =
        Upstream::by_turn(|n| ok_with("x-ratelimit-remaining", if n == 0 { "1" } else { "0" }));
    let sent = sends(one_a_second_burst_5(), &upstream, 3).await;
    // One goes at once on the token the upstream still has, then one a second: not four at once.
    assert_eq!(sent, [0, 0, 1_000, 2_000]);
}

#[tokio::test(start_paused = true)]
async fn without_following_the_bucket_spends_its_own_count() {
    let upstream = Upstream::by_turn(|_| ok_with("x-ratelimit-remaining", "0"));
    let sent = sends(one_a_second_burst_5().follow_upstream(false), &upstream, 3).await;
    assert_eq!(sent, [0, 0, 0, 0]);
}

#[tokio::test(start_paused = true)]
async fn a_report_of_more_tokens_left_never_raises_the_bucket() {
    // The upstream's burst is larger, or it refilled: 50 left. The bucket keeps its own count.
    let upstream = Upstream::by_turn(|_| ok_with("x-ratelimit-remaining", "50"));
    let sent = sends(one_a_second_burst_5(), &upstream, 6).await;
    assert_eq!(sent, [0, 0, 0, 0, 0, 1_000, 2_000]);
}

#[tokio::test(start_paused = true)]
async fn the_ietf_field_and_a_vendors_own_are_followed() {
    let ietf =
        Upstream::by_turn(|_| ok_with("ratelimit", "\"second\";r=3;t=1, \"hour\";r=1;t=900"));
    assert_eq!(sends(one_a_second_burst_5(), &ietf, 2).await, [0, 0, 1_000]);
    let vendor = Upstream::by_turn(|_| ok_with("x-seller-quota-left", "0"));
    let limiter = one_a_second_burst_5()
        .remaining_header(http::HeaderName::from_static("x-seller-quota-left"));
    assert_eq!(sends(limiter, &vendor, 2).await, [0, 1_000, 2_000]);
}

#[tokio::test(start_paused = true)]
async fn a_503_with_retry_after_backs_off_like_a_429_and_one_without_does_not() {
    let told = Upstream::by_turn(|n| match n {
        0 => Answer::new(StatusCode::SERVICE_UNAVAILABLE).header("retry-after", "3"),
        _ => Answer::ok(),
    });
    // The next request waits out the 3 s, and the one after it a token period more.
    assert_eq!(
        sends(one_a_second_burst_5(), &told, 2).await,
        [0, 3_000, 4_000]
    );
    let failing = Upstream::by_turn(|n| match n {
        0 => Answer::new(StatusCode::SERVICE_UNAVAILABLE),
        _ => Answer::ok(),
    });
    assert_eq!(sends(one_a_second_burst_5(), &failing, 2).await, [0, 0, 0]);
}

/// "1 a second, burst 2", against an upstream that answers after 100 ms and reports `left[n]`
/// left to the `n`th request (the last one to the rest). One request goes first, then three at
/// once when its answer is in: the first of them at once, the other two queued for 1 s and 2 s.
/// When each reached the upstream, in order.
async fn after_nothing_left(left: &'static [&'static str]) -> Vec<u128> {
    let clock = TokioClock::new();
    let limit = Limit::per_second(1)
        .and_then(|l| l.with_burst(2))
        .expect("a valid limit");
    let limiter: OnTokioTime = RateLimitMiddleware::new(MemoryStore::new().with_clock(clock))
        .with_clock(clock)
        .route(exact_route("api", limit, "/orders").expect("a route"))
        .max_wait(Duration::from_secs(60));
    let upstream = Upstream::by_turn(move |n| {
        ok_with("x-ratelimit-remaining", left[n.min(left.len() - 1)])
            .after(Duration::from_millis(100))
    });
    let mut sent = sends(limiter, &upstream, 3).await;
    sent.sort_unstable();
    sent
}

#[tokio::test(start_paused = true)]
async fn nothing_left_from_an_upstream_with_a_margin_moves_the_next_slot_back() {
    // The first answer reports 2 left, as many as the bucket can hold: the upstream holds more
    // than the bucket. The request queued for 1 s hears at 1.1 s that nothing is left: someone
    // else took the margin, and the request queued for 2 s would earn a 429. It queues again,
    // behind the back-off.
    assert_eq!(
        after_nothing_left(&["2", "1", "0", "1"]).await,
        [0, 100, 1_000, 3_000]
    );
}

#[tokio::test(start_paused = true)]
async fn nothing_left_from_an_upstream_without_a_margin_is_its_usual_state() {
    // The upstream reports no more than the bucket holds: nothing left to a queued request is
    // then what spending the bucket at its pace looks like, and the queue stands.
    assert_eq!(
        after_nothing_left(&["1", "0"]).await,
        [0, 100, 1_000, 2_000]
    );
}

#[tokio::test(start_paused = true)]
async fn the_last_of_a_burst_hearing_a_token_left_proves_no_margin() {
    // Requests sent together reach the upstream in any order: the one that spent the bucket
    // may hear a token left. That is no margin, and a later nothing left changes nothing.
    assert_eq!(
        after_nothing_left(&["1", "1", "0"]).await,
        [0, 100, 1_000, 2_000]
    );
}

/// The tests of reqwest-retry in front of the limiter.
#[cfg(feature = "retry")]
mod retried {
    use super::*;

    use burstgate::middleware::{Local429, RetryStrategy, rate_limited};
    use reqwest_retry::RetryTransientMiddleware;
    use reqwest_retry::policies::ExponentialBackoff;

    /// Two requests through reqwest-retry and the limiter ("1 a second, burst 1", never
    /// waiting): the second meets the local 429. Returns the second's result and when each
    /// request reached the upstream, in ms.
    async fn retried(
        strategy: RetryStrategy,
    ) -> (reqwest_middleware::Result<StatusCode>, Vec<u128>) {
        let clock = TokioClock::new();
        let limiter = RateLimitMiddleware::new(MemoryStore::new().with_clock(clock))
            .with_clock(clock)
            .route(
                exact_route("api", Limit::per_second(1).expect("a limit"), "/orders")
                    .expect("a route"),
            )
            .max_wait(Duration::ZERO);
        let policy = ExponentialBackoff::builder()
            .retry_bounds(Duration::from_millis(1_500), Duration::from_millis(1_500))
            .jitter(reqwest_retry::Jitter::None)
            .build_with_max_retries(2);
        let upstream = Upstream::answering(StatusCode::OK);
        let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
            .with(RetryTransientMiddleware::new_with_policy_and_strategy(
                policy, strategy,
            ))
            .with(limiter)
            .with(upstream.clone())
            .build();
        let start = tokio::time::Instant::now();
        let send = || client.get(format!("{BASE}/orders")).send();
        assert_eq!(send().await.map(|r| r.status()).ok(), Some(StatusCode::OK));
        let second = send().await.map(|r| r.status());
        (second, upstream.sent_ms_since(start))
    }

    #[tokio::test(start_paused = true)]
    async fn reqwest_retry_retries_the_local_429_through_the_limiter() {
        let (second, sent) = retried(RetryStrategy::new()).await;
        assert_eq!(second.ok(), Some(StatusCode::OK));
        // Refused locally at 0, retried after the policy's 1.5 s (reqwest-retry counts it on the
        // system clock, so a few real milliseconds less on paused time), when the bucket has its
        // token again.
        assert_eq!(sent.len(), 2, "{sent:?}");
        assert!((1_000..=1_500).contains(&sent[1]), "{sent:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn the_local_429_can_be_returned_at_once_instead() {
        let (second, sent) = retried(RetryStrategy::new().local_429(Local429::Fail)).await;
        let err = second.expect_err("the local 429");
        let limited = rate_limited(&err).expect("a RateLimited");
        assert_eq!(limited.retry_after(), Duration::from_secs(1));
        assert_eq!(sent, [0]);
    }
}
