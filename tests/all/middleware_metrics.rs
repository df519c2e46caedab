//! What the reqwest middleware tells operators, on tokio's paused clock in front of the
//! in-process upstream (`support::upstream`): its `on_decision` hook sees every decision, its
//! metrics count each outcome, wait, back-off, lowering and ticket by route, and an upstream 429
//! or 503 is a warning at most once per route and period.
#![cfg(feature = "reqwest")]

use std::num::NonZeroU32;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use burstgate::middleware::{Account, Cost, RateLimitMiddleware, RequestOutcome};
use burstgate::{Limit, MemoryStore, TokioClock};
use reqwest::StatusCode;
use reqwest_middleware::ClientWithMiddleware;

use crate::support::logs;
use crate::support::upstream::{Answer, BASE, OnTokioTime, SELLER, Upstream};

/// "10 a second, burst 2" on `/orders` (a token period of 100 ms, so a ceiling of 200 ms on
/// the wait), on paused time.
fn ten_a_second_burst_2() -> OnTokioTime {
    let clock = TokioClock::new();
    let limit = Limit::per_second(10)
        .and_then(|l| l.with_burst(2))
        .expect("a valid limit");
    RateLimitMiddleware::new(MemoryStore::new().with_clock(clock))
        .with_clock(clock)
        .route(crate::support::exact_route("api", limit, "/orders").expect("a route"))
}

/// Sends a GET to `/orders` for [`SELLER`], with `cost` when given: the upstream's status, or
/// `None` when the middleware did not send it.
async fn send(client: &ClientWithMiddleware, cost: Option<u32>) -> Option<StatusCode> {
    let mut request = client
        .get(format!("{BASE}/orders"))
        .with_extension(Account::new(SELLER));
    if let Some(cost) = cost {
        request = request.with_extension(Cost::new(NonZeroU32::new(cost).expect("not zero")));
    }
    request.send().await.ok().map(|r| r.status())
}

/// One request of each outcome, in this order, through `limiter`:
///
/// - two sent at once (the burst), answered 200;
/// - one that waits a token period and meets a 429 asking for a second: a back-off of 1 s;
/// - one refused locally, the bucket drained for that second;
/// - two seconds on, one answered 503 with no time (no back-off);
/// - one costing more than the burst: the store's error;
/// - two seconds on, one answered 200 reporting nothing left, where the bucket held one: a
///   lowering.
async fn one_of_each(limiter: OnTokioTime) {
    let upstream = Upstream::by_turn(|n| match n {
        2 => Answer::new(StatusCode::TOO_MANY_REQUESTS).header("retry-after", "1"),
        3 => Answer::new(StatusCode::SERVICE_UNAVAILABLE),
        4 => Answer::ok().header("x-ratelimit-remaining", "0"),
        _ => Answer::ok(),
    });
    let client = upstream.client(limiter);
    assert_eq!(send(&client, None).await, Some(StatusCode::OK));
    assert_eq!(send(&client, None).await, Some(StatusCode::OK));
    assert_eq!(
        send(&client, None).await,
        Some(StatusCode::TOO_MANY_REQUESTS)
    );
    assert_eq!(send(&client, None).await, None, "a local 429");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        send(&client, None).await,
        Some(StatusCode::SERVICE_UNAVAILABLE)
    );
    assert_eq!(send(&client, Some(5)).await, None, "the store's error");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(send(&client, None).await, Some(StatusCode::OK));
}

/// What the hook saw of one decision.
#[derive(Debug, PartialEq)]
struct Seen {
    route: String,
    outcome: RequestOutcome,
    wait_ms: u128,
    status: Option<u16>,
    store_error: bool,
}

#[tokio::test(start_paused = true)]
async fn on_decision_sees_every_decision() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    let limiter = ten_a_second_burst_2().on_decision(move |event| {
        log.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Seen {
                route: event.route().to_owned(),
                outcome: event.outcome(),
                wait_ms: event.wait().as_millis(),
                status: event.status().map(|s| s.as_u16()),
                store_error: event.error().is_some(),
            });
        if event.outcome() == RequestOutcome::Local429 {
            assert!(event.retry_after().is_some(), "a local 429 says when");
        }
    });
    one_of_each(limiter).await;
    let seen = seen.lock().unwrap_or_else(PoisonError::into_inner);
    let event = |outcome, wait_ms, status, store_error| Seen {
        route: "api".to_owned(),
        outcome,
        wait_ms,
        status,
        store_error,
    };
    assert_eq!(
        *seen,
        [
            event(RequestOutcome::Sent, 0, Some(200), false),
            event(RequestOutcome::Sent, 0, Some(200), false),
            event(RequestOutcome::Upstream429, 100, Some(429), false),
            event(RequestOutcome::Local429, 0, None, false),
            event(RequestOutcome::Upstream503, 0, Some(503), false),
            event(RequestOutcome::StoreError, 0, None, true),
            event(RequestOutcome::Sent, 0, Some(200), false),
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn an_upstream_429_or_503_is_a_warning_once_per_period_with_route_and_fingerprint() {
    let fingerprints = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&fingerprints);
    let limiter = ten_a_second_burst_2()
        .max_wait(Duration::from_secs(60))
        .on_decision(move |event| {
            log.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(event.key().fingerprint());
        });
    let upstream = Upstream::by_turn(|n| {
        if n % 2 == 0 {
            Answer::new(StatusCode::TOO_MANY_REQUESTS)
        } else {
            Answer::new(StatusCode::SERVICE_UNAVAILABLE)
        }
    });
    let client = upstream.client(limiter);
    let (captured, _guard) = logs::capture();
    for _ in 0..4 {
        assert!(send(&client, None).await.is_some());
    }
    let warnings = captured.warnings();
    assert_eq!(warnings.len(), 1, "one warning per period: {warnings:?}");
    let fingerprint = fingerprints.lock().unwrap_or_else(PoisonError::into_inner)[0].clone();
    let first = &warnings[0];
    assert!(first.contains("bucket=\"api\""), "{first}");
    assert!(first.contains(&format!("key={fingerprint}")), "{first}");
    assert!(first.contains("status=429"), "{first}");
    assert!(first.contains("suppressed=0"), "{first}");
    assert!(
        !first.contains(SELLER),
        "the account is never logged: {first}"
    );

    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(send(&client, None).await.is_some());
    let warnings = captured.warnings();
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(warnings[1].contains("status=429"), "{}", warnings[1]);
    assert!(
        warnings[1].contains("suppressed=3"),
        "the warning counts the three held back: {}",
        warnings[1]
    );
}

#[cfg(feature = "metrics")]
mod recorded {
    use std::collections::BTreeMap;

    use burstgate::middleware::TicketError;
    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

    use super::*;
    use crate::support::upstream::{account, ticket_secret};

    /// Runs `test` on a paused current-thread runtime with a recorder of its own: the metric
    /// values it recorded, by name and labels (`name{label=value,...}`).
    fn recording<F: std::future::Future<Output = ()>>(
        test: impl FnOnce() -> F,
    ) -> BTreeMap<String, DebugValue> {
        let recorder = DebuggingRecorder::new();
        let snapshotter: Snapshotter = recorder.snapshotter();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("a runtime");
        metrics::with_local_recorder(&recorder, || runtime.block_on(test()));
        snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, _, _, value)| {
                let labels: Vec<String> = key
                    .key()
                    .labels()
                    .map(|l| format!("{}={}", l.key(), l.value()))
                    .collect();
                (
                    format!("{}{{{}}}", key.key().name(), labels.join(",")),
                    value,
                )
            })
            .collect()
    }

    fn counter(values: &BTreeMap<String, DebugValue>, name: &str) -> u64 {
        match values.get(name) {
            Some(DebugValue::Counter(n)) => *n,
            other => panic!("{name}: {other:?} in {values:?}"),
        }
    }

    fn histogram(values: &BTreeMap<String, DebugValue>, name: &str) -> Vec<f64> {
        match values.get(name) {
            Some(DebugValue::Histogram(h)) => h.iter().map(|v| v.into_inner()).collect(),
            other => panic!("{name}: {other:?} in {values:?}"),
        }
    }

    #[test]
    fn requests_are_counted_by_route_and_outcome_with_waits_back_offs_and_lowerings() {
        let values = recording(|| one_of_each(ten_a_second_burst_2()));
        let requests = |outcome: &str| {
            counter(
                &values,
                &format!("burstgate_client_requests_total{{route=api,outcome={outcome}}}"),
            )
        };
        assert_eq!(requests("sent"), 3);
        assert_eq!(requests("local_429"), 1);
        assert_eq!(requests("upstream_429"), 1);
        assert_eq!(requests("upstream_503"), 1);
        assert_eq!(requests("store_error"), 1);
        let mut waits = histogram(&values, "burstgate_client_wait_seconds{route=api}");
        waits.sort_by(f64::total_cmp);
        assert_eq!(
            waits,
            [0.0, 0.0, 0.0, 0.0, 0.1],
            "one wait per request sent"
        );
        assert_eq!(
            counter(&values, "burstgate_client_backoffs_total{route=api}"),
            1
        );
        assert_eq!(
            histogram(&values, "burstgate_client_backoff_seconds{route=api}"),
            [1.0]
        );
        assert_eq!(
            counter(&values, "burstgate_client_lowerings_total{route=api}"),
            1
        );
        assert!(
            values.keys().all(|k| !k.contains(SELLER)),
            "no account in a label: {values:?}"
        );
    }

    #[test]
    fn tickets_are_counted_as_booked_sent_expired_and_cancelled() {
        let values = recording(|| async {
            let clock = TokioClock::new();
            let limiter = RateLimitMiddleware::new(MemoryStore::new().with_clock(clock))
                .with_clock(clock)
                .route(
                    crate::support::exact_route(
                        "api",
                        Limit::per_second(1).expect("a limit"),
                        "/orders",
                    )
                    .expect("a route"),
                )
                .key_secret(ticket_secret())
                .max_wait(Duration::from_secs(60));
            let request = reqwest::Client::new()
                .get(format!("{BASE}/orders"))
                .build()
                .expect("a request");
            let seller = account(SELLER);
            let mut tickets = Vec::new();
            for _ in 0..3 {
                let ticket = limiter.reserve(&request, &seller).await.expect("booked");
                tickets.push(ticket.expect("a route matched"));
            }
            let client = Upstream::answering(StatusCode::OK).client(limiter.clone());
            let booked = |ticket| {
                client
                    .get(format!("{BASE}/orders"))
                    .with_extension(Account::new(SELLER))
                    .with_extension(ticket)
                    .send()
            };
            let status = booked(tickets[0].clone()).await.expect("sent").status();
            assert_eq!(status, StatusCode::OK);
            assert!(limiter.cancel(&tickets[1]).await.expect("cancelled"));
            // Long past the third one's grace.
            tokio::time::sleep(Duration::from_secs(10)).await;
            let err = booked(tickets[2].clone()).await.expect_err("expired");
            let expired = match &err {
                reqwest_middleware::Error::Middleware(e) => e.downcast_ref::<TicketError>(),
                reqwest_middleware::Error::Reqwest(_) => None,
            };
            assert_eq!(expired, Some(&TicketError::Expired), "{err}");
        });
        let tickets = |event: &str| {
            counter(
                &values,
                &format!("burstgate_client_tickets_total{{route=api,event={event}}}"),
            )
        };
        assert_eq!(tickets("booked"), 3);
        assert_eq!(tickets("sent"), 1);
        assert_eq!(tickets("cancelled"), 1);
        assert_eq!(tickets("expired"), 1);
        assert_eq!(
            counter(
                &values,
                "burstgate_client_requests_total{route=api,outcome=sent}"
            ),
            1
        );
    }
}
