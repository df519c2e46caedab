//! A batch: 24 requests sent at once on "1 per second, burst 3", against a strict upstream (its
//! bucket full at the first request, no tolerance). Asked to queue ([`max_wait`] long enough
//! for the whole batch), every request goes, at the route's pace, and none earns a 429; through
//! reqwest-retry with the crate's `RetryStrategy` too. Not asked to, the default ceiling (two
//! token periods) still refuses what lies beyond it. A queued batch dropped at once gives back
//! every queued token. On tokio's paused clock with the in-process upstream; the same batch on a
//! real Redis and a real socket is at the end, at "10 per second" to keep it short, and at the
//! issue's "1 per second" in the slow tier.
//!
//! [`max_wait`]: burstgate::middleware::RateLimitMiddleware::max_wait
#![cfg(feature = "reqwest")]

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use std::time::Duration;

use burstgate::middleware::{RateLimitMiddleware, Route, rate_limited};
use burstgate::{Limit, MemoryStore, TokioClock};
use http::StatusCode;
use reqwest_middleware::ClientWithMiddleware;
use tokio::time::Instant;

use crate::support::upstream::{Answer, BASE, OnTokioTime, Upstream};

/// Requests in the batch.
const BATCH: usize = 24;

/// Long enough for the whole batch: 21 token periods, with room.
const QUEUE: Duration = Duration::from_secs(60);

fn one_a_second_burst_3() -> Limit {
    Limit::per_second(1)
        .and_then(|l| l.with_burst(3))
        .expect("a limit")
}

/// A strict upstream's answers, on tokio's clock: `burst` tokens, full at the first request, one
/// more every `per_token`; 200 for a whole token, else 429 and nothing taken.
fn strict(per_token: Duration, burst: u32) -> Upstream {
    let bucket: Mutex<Option<(f64, Instant)>> = Mutex::new(None);
    Upstream::by_turn(move |_| {
        let now = Instant::now();
        let mut bucket = bucket.lock().unwrap_or_else(PoisonError::into_inner);
        let (tokens, at) = bucket.unwrap_or((f64::from(burst), now));
        let refilled = (now - at).as_secs_f64() / per_token.as_secs_f64();
        let tokens = (tokens + refilled).min(f64::from(burst));
        if tokens >= 1.0 {
            *bucket = Some((tokens - 1.0, now));
            Answer::ok()
        } else {
            *bucket = Some((tokens, now));
            Answer::new(StatusCode::TOO_MANY_REQUESTS)
        }
    })
}

/// The batch's route, with the route's defaults: the published limit and nothing else.
fn route() -> Route {
    Route::new("orders", one_a_second_burst_3(), "/orders").expect("a route")
}

fn limiter() -> OnTokioTime {
    let clock = TokioClock::new();
    RateLimitMiddleware::new(MemoryStore::new().with_clock(clock))
        .with_clock(clock)
        .route(route())
}

/// What became of a batch: the upstream's answers, the local 429s, other errors, and when the
/// last request came back.
#[derive(Debug, Default)]
struct Outcome {
    ok: usize,
    upstream_429: usize,
    local_429: usize,
    other_errors: usize,
    took: Duration,
}

/// Sends the batch at once through `client`, each request on a task of its own.
async fn batch(client: &ClientWithMiddleware) -> Outcome {
    let start = Instant::now();
    let tasks: Vec<_> = (0..BATCH)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move { client.get(format!("{BASE}/orders")).send().await })
        })
        .collect();
    let mut outcome = Outcome::default();
    for task in tasks {
        match task.await.expect("a request task") {
            Ok(res) if res.status() == StatusCode::OK => outcome.ok += 1,
            Ok(res) if res.status() == StatusCode::TOO_MANY_REQUESTS => outcome.upstream_429 += 1,
            Ok(res) => panic!("the upstream answered {}", res.status()),
            Err(e) if rate_limited(&e).is_some() => outcome.local_429 += 1,
            Err(_) => outcome.other_errors += 1,
        }
    }
    outcome.took = start.elapsed();
    outcome
}

/// The batch went whole, at the route's pace: 3 at once, then one a token period (1.01 s with
/// the route's default margin), the last 21 of them after the start.
fn assert_whole(outcome: &Outcome) {
    assert_eq!(
        (
            outcome.ok,
            outcome.upstream_429,
            outcome.local_429,
            outcome.other_errors
        ),
        (BATCH, 0, 0, 0),
        "{outcome:?}"
    );
    assert!(
        outcome.took >= Duration::from_secs(21) && outcome.took <= Duration::from_millis(21_300),
        "{outcome:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_batch_asked_to_queue_goes_whole_at_the_routes_pace_with_no_429() {
    let upstream = strict(Duration::from_secs(1), 3);
    let client = upstream.client(limiter().max_wait(QUEUE));
    let outcome = batch(&client).await;
    assert_whole(&outcome);
    let start = Instant::now() - outcome.took;
    let sent = upstream.sent_ms_since(start);
    assert_eq!(sent.len(), BATCH, "each request reached the upstream once");
    // Each request after the burst goes one token period after the one before.
    for pair in sent[3..].windows(2) {
        assert!(pair[1] - pair[0] >= 1_000, "{sent:?}");
    }
}

#[cfg(feature = "retry")]
#[tokio::test(start_paused = true)]
async fn a_batch_asked_to_queue_goes_whole_through_reqwest_retry_too() {
    use burstgate::middleware::RetryStrategy;
    use reqwest_retry::RetryTransientMiddleware;
    use reqwest_retry::policies::ExponentialBackoff;

    let upstream = strict(Duration::from_secs(1), 3);
    let policy = ExponentialBackoff::builder().build_with_max_retries(3);
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(RetryTransientMiddleware::new_with_policy_and_strategy(
            policy,
            RetryStrategy::new(),
        ))
        .with(limiter().max_wait(QUEUE))
        .with(upstream.clone())
        .build();
    let outcome = batch(&client).await;
    assert_whole(&outcome);
    assert_eq!(
        upstream.sent_ms_since(Instant::now()).len(),
        BATCH,
        "nothing retried: each request reached the upstream once"
    );
}

#[tokio::test(start_paused = true)]
async fn a_batch_not_asked_to_queue_keeps_the_default_ceiling() {
    let upstream = strict(Duration::from_secs(1), 3);
    let client = upstream.client(limiter());
    let outcome = batch(&client).await;
    // The burst at once, and the two turns within two token periods of the start; the rest
    // would wait longer, and are refused at once.
    assert_eq!(
        (
            outcome.ok,
            outcome.upstream_429,
            outcome.local_429,
            outcome.other_errors
        ),
        (5, 0, BATCH - 5, 0),
        "{outcome:?}"
    );
    assert!(outcome.took <= Duration::from_millis(2_100), "{outcome:?}");
}

type Sending =
    Pin<Box<dyn Future<Output = reqwest_middleware::Result<reqwest::Response>> + 'static>>;

/// Starts the batch on `client` to `url` and polls it for `for_`, then drops every request still
/// waiting, first to last, as a batch cancelled by a timeout around it is. How many were sent.
async fn start_then_drop(client: &ClientWithMiddleware, url: &str, for_: Duration) -> usize {
    let mut sends: Vec<Option<Sending>> = (0..BATCH)
        .map(|_| {
            let request = client.get(url).send();
            Some(Box::pin(request) as Sending)
        })
        .collect();
    let done = Arc::new(Mutex::new(0_usize));
    let counted = Arc::clone(&done);
    let polled = std::future::poll_fn(move |cx| {
        for slot in &mut sends {
            if let Some(send) = slot
                && let Poll::Ready(res) = send.as_mut().poll(cx)
            {
                assert!(res.expect("sent").status().is_success());
                *counted.lock().unwrap_or_else(PoisonError::into_inner) += 1;
                *slot = None;
            }
        }
        Poll::<()>::Pending
    });
    assert!(tokio::time::timeout(for_, polled).await.is_err());
    *done.lock().unwrap_or_else(PoisonError::into_inner)
}

#[tokio::test(start_paused = true)]
async fn a_queued_batch_dropped_at_once_gives_back_every_queued_token() {
    let upstream = strict(Duration::from_secs(1), 3);
    let client = upstream.client(limiter().max_wait(QUEUE));
    let start = Instant::now();
    let url = format!("{BASE}/orders");
    let sent = start_then_drop(&client, &url, Duration::from_millis(500)).await;
    assert_eq!(sent, 3, "the burst went, the rest queued");
    // Time for the refunds, which go on a task of their own.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let res = client
        .get(format!("{BASE}/orders"))
        .send()
        .await
        .expect("sent");
    assert_eq!(res.status(), StatusCode::OK);
    let sent = upstream.sent_ms_since(start);
    // The next request takes the first slot after the burst, 1.01 s after the start, as if the
    // 21 dropped requests had never asked.
    assert_eq!(sent.len(), 4, "{sent:?}");
    assert!((1_000..=1_100).contains(&sent[3]), "{sent:?}");
}

mod on_redis {
    //! The batch on a real Redis, sent to a strict upstream on a real socket.
    #![cfg(feature = "redis")]

    use std::time::Duration;

    use burstgate::middleware::{RateLimitMiddleware, Route};
    use burstgate::{Limit, RedisStore};
    use reqwest_middleware::ClientBuilder;
    use tokio::time::Instant;

    use super::{BATCH, Outcome};
    use crate::support::redis_server;
    use crate::support::strict::StrictUpstream;

    /// The batch's route on a real socket, with the default margin (10 ms a token at these
    /// rates): the burst's three new connections, opened at once on a loaded machine, take
    /// longer than a reused one, and the strict upstream counts from the first that arrives.
    fn route(limit: Limit) -> Route {
        Route::new("orders", limit, "/orders").expect("a route")
    }

    /// A client on a store of its own on the test Redis, its route on `limit`, asked to queue.
    async fn queued_client(limit: Limit) -> reqwest_middleware::ClientWithMiddleware {
        let store = RedisStore::connect(&redis_server::url())
            .await
            .expect("a store on the test Redis")
            .prefix(&redis_server::unique_prefix())
            .expect("a valid prefix");
        let limiter = RateLimitMiddleware::new(store)
            .route(route(limit))
            .max_wait(super::QUEUE);
        ClientBuilder::new(reqwest::Client::new())
            .with(limiter)
            .build()
    }

    /// The batch on `limit` (burst 3) through a store on the test Redis, asked to queue: what
    /// came of it, and how many requests the upstream saw.
    async fn run(limit: Limit) -> (Outcome, usize) {
        let per_token = limit.interval() / limit.tokens();
        let upstream = StrictUpstream::start(per_token, limit.burst()).await;
        let client = queued_client(limit).await;
        let url = format!("{}/orders", upstream.url);
        let start = Instant::now();
        let tasks: Vec<_> = (0..BATCH)
            .map(|_| {
                let (client, url) = (client.clone(), url.clone());
                tokio::spawn(async move { client.get(&url).send().await })
            })
            .collect();
        let mut outcome = Outcome::default();
        for task in tasks {
            match task.await.expect("a request task") {
                Ok(res) if res.status().is_success() => outcome.ok += 1,
                Ok(_) => outcome.upstream_429 += 1,
                Err(e) if burstgate::middleware::rate_limited(&e).is_some() => {
                    outcome.local_429 += 1;
                }
                Err(_) => outcome.other_errors += 1,
            }
        }
        outcome.took = start.elapsed();
        let totals = upstream.totals();
        upstream.stop().await;
        eprintln!("{limit}, a batch of {BATCH}: {outcome:?}, upstream {totals:?}");
        (outcome, totals.admitted + totals.rejected)
    }

    fn burst_3(limit: Result<Limit, burstgate::InvalidLimit>) -> Limit {
        limit.and_then(|l| l.with_burst(3)).expect("a limit")
    }

    /// The batch on `limit` went whole, each request once, in `took` between `least` and `most`
    /// (real time, so a generous bound above).
    async fn goes_whole(limit: Limit, least: Duration, most: Duration) {
        let (outcome, seen) = run(limit).await;
        assert_eq!(
            (
                outcome.ok,
                outcome.upstream_429,
                outcome.local_429,
                outcome.other_errors
            ),
            (BATCH, 0, 0, 0),
            "{outcome:?}"
        );
        assert_eq!(seen, BATCH);
        assert!(outcome.took >= least && outcome.took < most, "{outcome:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_asked_to_queue_goes_whole_on_redis_at_10_a_second() {
        // 21 token periods of 110 ms.
        let limit = burst_3(Limit::per_second(10));
        goes_whole(limit, Duration::from_millis(2_310), Duration::from_secs(5)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_queued_batch_dropped_at_once_gives_back_every_queued_token_on_redis() {
        let limit = burst_3(Limit::per_second(10));
        let upstream = StrictUpstream::start(Duration::from_millis(100), 3).await;
        let client = queued_client(limit).await;
        let url = format!("{}/orders", upstream.url);
        let start = Instant::now();
        // Dropped before the first queued turn, 110 ms after the start.
        let sent = super::start_then_drop(&client, &url, Duration::from_millis(60)).await;
        assert_eq!(sent, 3, "the burst went, the rest queued");
        tokio::time::sleep(Duration::from_millis(20)).await;
        let res = client.get(&url).send().await.expect("sent");
        assert!(res.status().is_success());
        // Had the queued tokens stayed spent, this request would wait its turn behind 21
        // dropped ones, two seconds on.
        let after = start.elapsed();
        assert!(after < Duration::from_millis(600), "took {after:?}");
        let totals = upstream.totals();
        upstream.stop().await;
        assert_eq!((totals.admitted, totals.rejected), (4, 0));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "slow tier: 21 s of real time"]
    async fn a_batch_asked_to_queue_goes_whole_on_redis_at_1_a_second() {
        // 21 token periods of 1.01 s.
        let limit = burst_3(Limit::per_second(1));
        goes_whole(limit, Duration::from_secs(21), Duration::from_secs(23)).await;
    }
}
