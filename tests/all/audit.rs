//! The audit trail on a real Redis: every decision of an audited take appended to the stream
//! beside its bucket, by the script that makes it, with what was decided; the cap and the
//! expiry; a stream key someone else wrote; and what a decision with its trail costs Redis beside
//! the decision alone.
#![cfg(feature = "redis")]

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::time::Duration;

use burstgate::redis::aio::MultiplexedConnection;
use burstgate::{Audit, BucketKey, BucketStore, ManualClock, RedisStore, StoreError, Take};

use crate::support::{START, ZERO, calls_of, key, limit, redis_server};

type Entry = HashMap<String, String>;

async fn conn() -> MultiplexedConnection {
    burstgate::redis::Client::open(redis_server::url())
        .expect("a URL")
        .get_multiplexed_async_connection()
        .await
        .expect("a connection to the test Redis")
}

/// A store on the test Redis under a prefix of its own, on a manual clock.
async fn store(clock: &ManualClock) -> RedisStore<MultiplexedConnection, ManualClock> {
    RedisStore::new(conn().await)
        .with_clock(clock.clone())
        .prefix(&redis_server::unique_prefix())
        .expect("a prefix")
}

/// Every entry of `stream`, oldest first.
async fn entries(stream: &str) -> Vec<Entry> {
    let raw: Vec<(String, Vec<(String, String)>)> = burstgate::redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query_async(&mut conn().await)
        .await
        .expect("XRANGE");
    raw.into_iter()
        .map(|(_, fields)| fields.into_iter().collect())
        .collect()
}

fn cap(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("not zero")
}

fn summary(e: &Entry) -> (&str, &str, &str, &str) {
    (&e["o"], &e["c"], &e["w"], &e["r"])
}

#[tokio::test]
async fn every_decision_of_an_audited_take_is_in_its_buckets_stream() {
    let clock = ManualClock::new(START);
    let store = store(&clock).await;
    let orders = limit(1, 1_000, 2);
    let k = key("orders", "seller-42");
    let other = key("global", "all");
    let audit = Audit::new(cap(100)).process("api-3");
    let take = |max_wait| {
        let takes = [
            Take::new(&k, orders, 1).audited(&audit),
            Take::new(&other, limit(100, 1_000, 100), 1),
        ];
        let store = store.clone();
        async move { store.acquire_all(&takes, max_wait).await }
    };
    for _ in 0..2 {
        assert!(take(ZERO).await.expect("decided")[0].is_admitted());
    }
    // Refused now, then admitted after a wait of one token period.
    assert!(!take(ZERO).await.expect("decided")[0].is_admitted());
    let waited = take(Duration::from_secs(5)).await.expect("decided");
    assert_eq!(waited[0].wait(), Duration::from_secs(1));

    let trail = entries(&store.audit_key(&k)).await;
    let got: Vec<_> = trail.iter().map(summary).collect();
    assert_eq!(
        got,
        [
            ("admitted", "1", "0", "1"),
            ("admitted", "1", "0", "0"),
            ("refused", "1", "1000", "0"),
            ("waited", "1", "1000", "0"),
        ]
    );
    for e in &trail {
        assert_eq!(e["t"], START.to_string());
        assert_eq!(e["k"], k.fingerprint());
        assert_eq!(e["p"], "api-3");
        assert!(!e.values().any(|v| v.contains("seller-42")), "{e:?}");
    }
    // The bucket that was not audited has no stream.
    assert!(entries(&store.audit_key(&other)).await.is_empty());
}

#[tokio::test]
async fn a_stream_keeps_its_cap_and_expires_after_its_last_entry() {
    let clock = ManualClock::new(START);
    let store = store(&clock).await;
    let k = key("orders", "capped");
    let audit = Audit::new(cap(5)).retain(Duration::from_secs(30));
    for _ in 0..12 {
        let takes = [Take::new(&k, limit(1, 60_000, 3), 1).audited(&audit)];
        let _ = store.acquire_all(&takes, ZERO).await.expect("decided");
    }
    let trail = entries(&store.audit_key(&k)).await;
    assert_eq!(trail.len(), 5, "exactly the cap");
    assert!(trail.iter().all(|e| e["o"] == "refused"), "the latest five");
    let ttl: i64 = burstgate::redis::cmd("PTTL")
        .arg(store.audit_key(&k))
        .query_async(&mut conn().await)
        .await
        .expect("PTTL");
    assert!((29_000..=30_000).contains(&ttl), "{ttl}");
}

#[tokio::test]
async fn an_audit_stream_someone_else_wrote_refuses_the_request_and_changes_nothing() {
    let clock = ManualClock::new(START);
    let store = store(&clock).await;
    let k = key("orders", "squatted");
    let _: () = burstgate::redis::cmd("SET")
        .arg(store.audit_key(&k))
        .arg("not a stream")
        .query_async(&mut conn().await)
        .await
        .expect("SET");
    let audit = Audit::new(cap(10));
    let orders = limit(1, 1_000, 2);
    let takes = [Take::new(&k, orders, 1).audited(&audit)];
    let err = store.acquire_all(&takes, ZERO).await.expect_err("refused");
    assert!(matches!(err, StoreError::AuditNotAStream { .. }), "{err:?}");
    assert!(err.to_string().contains("audit stream"), "{err}");
    let state = store.peek(&k, orders).await.expect("peeks");
    assert_eq!(state.remaining(), 2, "nothing taken");
}

/// What an audited decision costs Redis beside the decision alone: calls, and the script's CPU
/// time per call from `INFO commandstats`, on a redis-server of the test's own so that nothing
/// else runs scripts there. Printed, not asserted beyond one call per decision: timings on a
/// shared machine are figures, not checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_audited_decision_is_one_call_and_its_cost_is_measured() {
    let server = redis_server::spawn("").expect("a redis-server of the test's own");
    let url = format!("redis://127.0.0.1:{}/", server.port);
    let client = burstgate::redis::Client::open(url.as_str()).expect("a URL");
    let mut admin = client
        .get_multiplexed_async_connection()
        .await
        .expect("a connection");
    // The system clock: a measured clock would add its own calls to the count.
    let store = RedisStore::new(admin.clone())
        .with_clock(burstgate::SystemClock)
        .deny_cache(false)
        .prefix("cost")
        .expect("a prefix");
    const N: usize = 2_000;
    let audit = Audit::new(cap(1_000));
    let lim = limit(1_000_000, 1_000, 1_000_000);
    let mut per_call: Vec<f64> = Vec::new();
    // Loads both scripts, so that every counted call finds its own.
    let warm = key("orders", "warm");
    let _ = store.acquire(&warm, lim, 1, ZERO).await.expect("decided");
    let _ = store
        .acquire_all(&[Take::new(&warm, lim, 1)], ZERO)
        .await
        .expect("decided");
    // The plain decision (one bucket's script), the several-bucket script on one bucket (what an
    // audited take runs), and that with the trail.
    for way in ["acquire", "acquire_all", "acquire_all audited"] {
        let _: () = burstgate::redis::cmd("CONFIG")
            .arg("RESETSTAT")
            .query_async(&mut admin)
            .await
            .expect("RESETSTAT");
        for n in 0..N {
            let k = key("orders", format!("k{}", n % 100));
            let take = Take::new(&k, lim, 1);
            match way {
                "acquire" => drop(store.acquire(&k, lim, 1, ZERO).await.expect("decided")),
                "acquire_all" => drop(store.acquire_all(&[take], ZERO).await.expect("decided")),
                _ => drop(
                    store
                        .acquire_all(&[take.audited(&audit)], ZERO)
                        .await
                        .expect("decided"),
                ),
            }
        }
        let stats: String = burstgate::redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut admin)
            .await
            .expect("INFO");
        let calls = calls_of(&stats, "evalsha") + calls_of(&stats, "eval");
        assert_eq!(calls, N as u64, "one script call per decision");
        let usec = stats
            .lines()
            .find_map(|l| l.trim().strip_prefix("cmdstat_evalsha:"))
            .and_then(|s| s.split(',').find_map(|f| f.strip_prefix("usec_per_call=")))
            .and_then(|v| v.parse::<f64>().ok())
            .expect("usec_per_call");
        per_call.push(usec);
    }
    eprintln!(
        "{N} decisions, one script call each; Redis CPU per call: {:.2} us plain, {:.2} us on the \
         several-bucket script, {:.2} us with the audit trail ({:.2}x the plain decision)",
        per_call[0],
        per_call[1],
        per_call[2],
        per_call[2] / per_call[0]
    );
    redis_server::kill(server);
}

/// A rule that keeps a trail: each request's decision is in it, admitted or refused, named by
/// the key's fingerprint and the process's label.
#[cfg(feature = "tower")]
#[tokio::test]
async fn a_layer_rule_with_an_audit_trail_records_each_request() {
    use burstgate::RateLimitLayer;
    use burstgate::layer::{KeyExtractor, Rule};
    use tower::{Layer, Service, ServiceExt};

    let clock = ManualClock::new(START);
    let store = store(&clock).await;
    let audit = Audit::new(cap(100)).process("web-1");
    let rule = Rule::new(
        "per-key",
        limit(1, 60_000, 2),
        KeyExtractor::header(http::HeaderName::from_static("x-api-key")),
    )
    .expect("a rule")
    .audit(audit);
    let mut svc = RateLimitLayer::new(store.clone())
        .rule(rule)
        .layer(tower::service_fn(|_: http::Request<String>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
        }));
    let mut statuses = Vec::new();
    for _ in 0..3 {
        let req = http::Request::builder()
            .header("x-api-key", "k1")
            .body(String::new())
            .expect("a request");
        let res = svc
            .ready()
            .await
            .expect("ready")
            .call(req)
            .await
            .expect("an answer");
        statuses.push(res.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 429]);
    let k = BucketKey::hashed("per-key", "k1").expect("a key");
    let trail = entries(&store.audit_key(&k)).await;
    let got: Vec<_> = trail
        .iter()
        .map(|e| (e["o"].as_str(), e["p"].as_str()))
        .collect();
    assert_eq!(
        got,
        [
            ("admitted", "web-1"),
            ("admitted", "web-1"),
            ("refused", "web-1")
        ]
    );
    assert!(trail.iter().all(|e| e["k"] == k.fingerprint()));
}

/// A route that keeps a trail: each request the middleware decides on is in it.
#[cfg(feature = "reqwest")]
#[tokio::test]
async fn a_middleware_route_with_an_audit_trail_records_each_request() {
    use burstgate::middleware::{Account, RateLimitMiddleware, Route};

    use crate::support::upstream::{BASE, Upstream};

    let clock = ManualClock::new(START);
    let store = store(&clock).await;
    let route = Route::new("orders", limit(1, 60_000, 2), "/orders")
        .expect("a route")
        .audit(Audit::new(cap(100)).process("worker-7"));
    // No waiting: the third request is refused at once, not sent a minute on.
    let limiter = RateLimitMiddleware::new(store.clone())
        .with_clock(clock.clone())
        .route(route)
        .max_wait(ZERO);
    let upstream = Upstream::answering(http::StatusCode::OK);
    let client = upstream.client(limiter);
    let mut local_429 = 0;
    for _ in 0..3 {
        let sent = client
            .get(format!("{BASE}/orders"))
            .with_extension(Account::new("seller-9"))
            .send()
            .await;
        if sent.is_err() {
            local_429 += 1;
        }
    }
    assert_eq!(local_429, 1);
    let k = key("orders", "seller-9");
    let trail = entries(&store.audit_key(&k)).await;
    let got: Vec<_> = trail
        .iter()
        .map(|e| (e["o"].as_str(), e["p"].as_str()))
        .collect();
    assert_eq!(
        got,
        [
            ("admitted", "worker-7"),
            ("admitted", "worker-7"),
            ("refused", "worker-7")
        ]
    );
}
