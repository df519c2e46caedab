//! The circuit breaker: it opens on failures and timeouts, answers at once while open, probes after
//! `open_for` and closes when Redis answers; a probe dropped, a probe that never answers and the
//! wall clock stepping back; its tracing events and metrics.

use super::*;

// On paused time, so that the circuit's own clock (tokio's) stands still and it says exactly
// how long it stays open; on a busy machine a millisecond passed between two calls.
#[tokio::test(start_paused = true)]
async fn fail_closed_errs_then_answers_at_once_while_the_circuit_is_open() {
    let clock = ManualClock::new(START);
    let conn = Switch::detached();
    conn.set(REFUSING);
    let store = store(conn.clone(), &clock);
    let k = key("closed");
    for _ in 0..3 {
        let e = store.acquire(&k, limit(1, 5), 1, ZERO).await.unwrap_err();
        assert!(matches!(e, StoreError::Backend(_)), "{e:?}");
    }
    assert!(store.is_circuit_open());
    // A refused connection is known not to have run the script, so each call was tried twice.
    assert_eq!(conn.calls(), 6);
    for _ in 0..100 {
        let e = store.acquire(&k, limit(1, 5), 1, ZERO).await.unwrap_err();
        assert!(
            matches!(e, StoreError::Unavailable { retry_in } if retry_in == Duration::from_millis(500)),
            "{e:?}"
        );
    }
    assert_eq!(conn.calls(), 6, "an open circuit does not try Redis");
    // So do the other operations.
    assert!(matches!(
        store.peek(&k, limit(1, 5)).await,
        Err(StoreError::Unavailable { .. })
    ));
    assert!(matches!(
        store.refund(&k, limit(1, 5), at_start(1)).await,
        Err(StoreError::Unavailable { .. })
    ));
}

#[tokio::test]
async fn the_circuit_probes_after_open_for_and_closes_when_redis_answers() {
    let clock = ManualClock::new(START);
    let conn = Switch::new().await;
    let store = store(conn.clone(), &clock).breaker(Breaker::new(
        std::num::NonZeroU32::new(2).expect("non-zero"),
        Duration::from_secs(1),
    ));
    let k = key("probe");
    let l = limit(1, 5);
    assert!(
        store
            .acquire(&k, l, 1, ZERO)
            .await
            .expect("up")
            .is_admitted()
    );

    conn.set(REFUSING);
    for _ in 0..2 {
        assert!(store.acquire(&k, l, 1, ZERO).await.is_err());
    }
    assert!(store.is_circuit_open());

    // Redis is back, but the circuit stays open for its second...
    conn.set(UP);
    clock.advance(Duration::from_millis(999));
    skip(Duration::from_millis(999)).await;
    let e = store.acquire(&k, l, 1, ZERO).await.unwrap_err();
    assert!(
        matches!(e, StoreError::Unavailable { retry_in } if retry_in == Duration::from_millis(1))
    );
    // ...then one call probes, Redis answers, and the circuit closes.
    clock.advance(Duration::from_millis(1));
    skip(Duration::from_millis(1)).await;
    let d = store
        .acquire(&k, l, 1, ZERO)
        .await
        .expect("the probe reaches Redis");
    assert!(d.is_admitted());
    assert!(!store.is_circuit_open());
    // The bucket in Redis kept what was spent before the outage: 5, minus 1, plus 1 refilled,
    // minus this one.
    assert_eq!(d.remaining(), 4);
}

#[tokio::test]
async fn a_failed_probe_keeps_the_circuit_open_for_another_period() {
    let clock = ManualClock::new(START);
    let conn = Switch::detached();
    conn.set(REFUSING);
    let store = store(conn.clone(), &clock).breaker(Breaker::new(
        std::num::NonZeroU32::new(1).expect("non-zero"),
        Duration::from_millis(100),
    ));
    let k = key("reopen");
    assert!(matches!(
        store.acquire(&k, limit(1, 5), 1, ZERO).await,
        Err(StoreError::Backend(_))
    ));
    skip(Duration::from_millis(100)).await;
    assert!(matches!(
        store.acquire(&k, limit(1, 5), 1, ZERO).await,
        Err(StoreError::Backend(_))
    ));
    let e = store.acquire(&k, limit(1, 5), 1, ZERO).await.unwrap_err();
    assert!(
        matches!(e, StoreError::Unavailable { retry_in } if retry_in == Duration::from_millis(100))
    );
}

#[tokio::test(start_paused = true)]
async fn a_call_that_hangs_times_out_and_counts_as_a_failure() {
    let clock = ManualClock::new(START);
    let conn = Switch::detached();
    conn.set(HANGING);
    let store = store(conn.clone(), &clock).timeout(Duration::from_millis(50));
    let k = key("hang");
    let started = tokio::time::Instant::now();
    for _ in 0..3 {
        let e = store.acquire(&k, limit(1, 5), 1, ZERO).await.unwrap_err();
        assert!(
            matches!(e, StoreError::Timeout { after } if after == Duration::from_millis(50)),
            "{e:?}"
        );
    }
    assert_eq!(started.elapsed(), Duration::from_millis(150));
    assert!(store.is_circuit_open());
    // A timeout may have run the script: it is not retried.
    assert_eq!(conn.calls(), 3);
    let e = store.acquire(&k, limit(1, 5), 1, ZERO).await.unwrap_err();
    assert!(matches!(e, StoreError::Unavailable { .. }));
    assert_eq!(
        started.elapsed(),
        Duration::from_millis(150),
        "answered at once"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn every_change_of_the_circuit_is_a_tracing_event() {
    let (log, _guard) = logs::capture();
    let clock = ManualClock::new(START);
    let conn = Switch::new().await;
    let store = store(conn.clone(), &clock).breaker(Breaker::new(
        std::num::NonZeroU32::new(1).expect("non-zero"),
        Duration::from_secs(1),
    ));
    let k = key("events");
    let l = limit(1, 5);
    conn.set(REFUSING);
    assert!(store.acquire(&k, l, 1, ZERO).await.is_err());
    skip(Duration::from_secs(1)).await;
    assert!(
        store.acquire(&k, l, 1, ZERO).await.is_err(),
        "the probe fails"
    );
    conn.set(UP);
    skip(Duration::from_secs(1)).await;
    assert!(
        store.acquire(&k, l, 1, ZERO).await.is_ok(),
        "the probe succeeds"
    );
    let seen = log.messages("burstgate::redis");
    let expected = [
        (tracing::Level::WARN, "redis failing: circuit opened"),
        (
            tracing::Level::WARN,
            "redis still failing: circuit stays open",
        ),
        (tracing::Level::INFO, "redis answered again: circuit closed"),
    ];
    let seen: Vec<(tracing::Level, &str)> = seen.iter().map(|(l, m)| (*l, m.as_str())).collect();
    assert_eq!(seen, expected);
}

/// Opens the circuit of `store` (on `conn`, hanging) with three timed-out calls, waits out its
/// `open_for`, and starts a probe that a 5 ms timeout cancels, as a client that went away or a
/// tower timeout shorter than the store's would.
async fn open_and_cancel_a_probe(store: &RedisStore<Switch, ManualClock>, conn: &Switch, l: Limit) {
    let k = key("cancelled-probe");
    conn.set(HANGING);
    for _ in 0..3 {
        // An error, or under fail open an admission: either way a timed-out call.
        let _ = store.acquire(&k, l, 1, ZERO).await;
    }
    assert!(store.is_circuit_open());
    skip(Duration::from_millis(500)).await;
    let probe = tokio::time::timeout(Duration::from_millis(5), store.acquire(&k, l, 1, ZERO));
    assert!(probe.await.is_err(), "the probe hangs and is cancelled");
}

/// Calls `store` until its circuit closes, on real time, and returns how long that took and how
/// many commands reached Redis meanwhile.
async fn until_closed(
    store: &RedisStore<Switch, ManualClock>,
    conn: &Switch,
    l: Limit,
) -> (Duration, usize) {
    let k = key("recovery");
    let (started, calls) = (std::time::Instant::now(), conn.calls());
    while store.is_circuit_open() && started.elapsed() < Duration::from_secs(10) {
        let _ = store.acquire(&k, l, 1, ZERO).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (started.elapsed(), conn.calls() - calls)
}

#[tokio::test]
async fn a_dropped_probe_wedges_the_circuit_forever() {
    for policy in [OutagePolicy::FailClosed, OutagePolicy::FailOpen] {
        let clock = ManualClock::new(START);
        let conn = Switch::new().await;
        let store = store(conn.clone(), &clock)
            .timeout(Duration::from_millis(50))
            .on_outage(policy);
        let l = Limit::per_minute(1).expect("a valid limit");
        open_and_cancel_a_probe(&store, &conn, l).await;
        conn.set(UP);
        let (took, reached) = until_closed(&store, &conn, l).await;
        assert!(
            !store.is_circuit_open(),
            "{policy:?}: still open after {took:?}"
        );
        assert!(
            took < Duration::from_secs(3),
            "{policy:?}: closed after {took:?}"
        );
        assert!(reached > 0, "{policy:?}: calls reach Redis again");
        // And the limit is kept again: 1 per minute, no burst.
        let k = key("after");
        assert!(
            store
                .acquire(&k, l, 1, ZERO)
                .await
                .expect("decides")
                .is_admitted()
        );
        let second = store.acquire(&k, l, 1, ZERO).await.expect("decides");
        assert!(!second.is_admitted(), "{policy:?}: the limit holds again");
    }
}

#[tokio::test]
async fn a_wall_clock_step_back_keeps_the_circuit_open() {
    let clock = ManualClock::new(START);
    let conn = Switch::new().await;
    let store = store(conn.clone(), &clock).timeout(Duration::from_millis(50));
    let l = limit(1, 5);
    let k = key("step");
    conn.set(HANGING);
    for _ in 0..3 {
        assert!(store.acquire(&k, l, 1, ZERO).await.is_err());
    }
    assert!(store.is_circuit_open());
    // The store's clock steps back an hour (NTP, a restored VM) while the circuit is open.
    clock.set(START - 3_600_000);
    conn.set(UP);
    let (took, reached) = until_closed(&store, &conn, l).await;
    assert!(!store.is_circuit_open(), "still open after {took:?}");
    assert!(took < Duration::from_secs(3), "closed after {took:?}");
    assert!(reached > 0);
}

#[tokio::test]
async fn a_probe_that_never_answers_is_superseded_after_open_for() {
    let clock = ManualClock::new(START);
    let conn = Switch::new().await;
    // A timeout far longer than the breaker's period: the probe is stuck, not timed out.
    let store = store(conn.clone(), &clock)
        .timeout(Duration::from_secs(60))
        .breaker(Breaker::new(
            std::num::NonZeroU32::new(1).expect("non-zero"),
            Duration::from_millis(100),
        ));
    let l = limit(1, 5);
    let k = key("stuck");
    conn.set(REFUSING);
    assert!(store.acquire(&k, l, 1, ZERO).await.is_err());
    assert!(store.is_circuit_open());
    conn.set(HANGING);
    skip(Duration::from_millis(100)).await;
    let stuck = {
        let store = store.clone();
        tokio::spawn(async move { store.acquire(&key("stuck"), l, 1, ZERO).await })
    };
    tokio::task::yield_now().await;
    conn.set(UP);
    let (took, _) = until_closed(&store, &conn, l).await;
    assert!(!store.is_circuit_open(), "still open after {took:?}");
    assert!(took < Duration::from_secs(3), "closed after {took:?}");
    stuck.abort();
}

/// A connection of its own to the test Redis, for planting values and asking it directly.
async fn admin() -> MultiplexedConnection {
    redis::Client::open(redis_server::url())
        .expect("a valid Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("a connection")
}

#[tokio::test]
async fn a_planted_value_hangs_redis_for_every_client() {
    let clock = ManualClock::new(START);
    let conn = Switch::new().await;
    let store = store(conn.clone(), &clock).timeout(Duration::from_secs(5));
    let k = key("planted");
    let l = limit(10, 10);
    let mut admin = admin().await;
    // t = -1e13: the walk to its refill time would never end (above 2^53, e + 1 == e).
    let value = [
        (-1e13f64).to_le_bytes(),
        (START as f64).to_le_bytes(),
        (START as f64 + 1e3).to_le_bytes(),
    ]
    .concat();
    let _: () = redis::cmd("SET")
        .arg(store.redis_key(&k))
        .arg(&value[..])
        .query_async(&mut admin)
        .await
        .expect("SET");
    for _ in 0..5 {
        let call = {
            let (store, k) = (store.clone(), k.clone());
            tokio::spawn(async move { store.acquire(&k, l, 1, Duration::from_secs(60)).await })
        };
        // Another client is answered while the call runs.
        let asked = std::time::Instant::now();
        let _: String = redis::cmd("PING")
            .query_async(&mut admin)
            .await
            .expect("PING");
        let took = asked.elapsed();
        assert!(took < Duration::from_millis(10), "PING took {took:?}");
        let e = call.await.expect("no panic").unwrap_err();
        match &e {
            StoreError::CorruptBucket {
                bucket,
                fingerprint,
            } => {
                assert_eq!(bucket, k.bucket());
                assert_eq!(*fingerprint, k.fingerprint());
            }
            other => panic!("expected CorruptBucket, got {other:?}"),
        }
        assert!(!e.to_string().contains(&store.redis_key(&k)), "{e}");
    }
    // The value is left as it was, and the circuit is closed for every other key.
    let kept: Vec<u8> = redis::cmd("GET")
        .arg(store.redis_key(&k))
        .query_async(&mut admin)
        .await
        .expect("GET");
    assert_eq!(kept, value);
    assert!(!store.is_circuit_open());
    assert!(
        store
            .acquire(&key("unrelated"), l, 1, ZERO)
            .await
            .expect("decides")
            .is_admitted()
    );
}

#[tokio::test]
async fn a_script_error_on_one_key_opens_the_circuit_for_every_key() {
    let clock = ManualClock::new(START);
    let conn = Switch::new().await;
    let store = store(conn.clone(), &clock);
    let l = limit(10, 10);
    conn.set(SCRIPT_ERROR);
    for _ in 0..5 {
        let e = store
            .acquire(&key("script-error"), l, 1, ZERO)
            .await
            .unwrap_err();
        assert!(matches!(e, StoreError::Backend(_)), "{e:?}");
    }
    assert!(
        !store.is_circuit_open(),
        "errors about one key's data are no outage"
    );
    conn.set(UP);
    assert!(
        store
            .acquire(&key("other"), l, 1, ZERO)
            .await
            .expect("decides")
            .is_admitted()
    );
}

/// With the `metrics` feature: every call Redis saw is timed by operation, a denial the deny
/// cache answered is counted, and the circuit's state is a gauge.
#[cfg(feature = "metrics")]
#[test]
fn the_store_reports_latency_deny_cache_hits_and_the_circuit() {
    use metrics_util::debugging::DebuggingRecorder;

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let mut seen = Seen::default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let clock = ManualClock::new(START);
            let conn = Switch::new().await;
            let store = store(conn.clone(), &clock).breaker(Breaker::new(
                NonZeroU32::new(2).expect("non-zero"),
                Duration::from_secs(1),
            ));
            let (k, l) = (key("metrics"), limit(1, 1));
            let admitted = store.acquire(&k, l, 1, ZERO).await.expect("up");
            assert!(admitted.is_admitted());
            // Past the script's first load.
            let before = conn.calls();
            // The first denial comes from Redis and fills the cache; the next two from the cache.
            for _ in 0..3 {
                let denied = store.acquire(&k, l, 1, ZERO).await.expect("up");
                assert!(!denied.is_admitted());
            }
            store.peek(&k, l).await.expect("up");
            assert_eq!(conn.calls() - before, 2);
            conn.set(REFUSING);
            for _ in 0..2 {
                assert!(store.peek(&k, l).await.is_err());
            }
            assert!(store.is_circuit_open());
            seen.read(&snapshotter);
            assert_eq!(seen.circuit, Some(1.0));
            conn.set(UP);
            skip(Duration::from_secs(1)).await;
            store.peek(&k, l).await.expect("the probe reaches Redis");
            assert!(!store.is_circuit_open());
            seen.read(&snapshotter);
            assert_eq!(seen.circuit, Some(0.0));
        });
    });
    seen.read(&snapshotter);
    let mut timed: Vec<(String, usize)> = seen.timed.into_iter().collect();
    timed.sort();
    // Two acquires and a peek answered, two peeks refused (each one call, retried inside it),
    // and the probe.
    assert_eq!(timed, [("acquire".to_owned(), 2), ("peek".to_owned(), 4)]);
    assert_eq!(seen.hits, Some(2));
}

/// What the store's metrics said, gathered over several snapshots (a snapshot takes the
/// histograms' samples and the counters' counts with it).
#[cfg(feature = "metrics")]
#[derive(Default)]
struct Seen {
    timed: std::collections::HashMap<String, usize>,
    hits: Option<u64>,
    circuit: Option<f64>,
}

#[cfg(feature = "metrics")]
impl Seen {
    fn read(&mut self, snapshotter: &metrics_util::debugging::Snapshotter) {
        use metrics_util::debugging::DebugValue;
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let name = key.key().name().to_owned();
            let op = key
                .key()
                .labels()
                .find(|l| l.key() == "op")
                .map(|l| l.value().to_owned());
            match value {
                DebugValue::Histogram(samples)
                    if name == burstgate::metrics::STORE_CALL_SECONDS =>
                {
                    *self.timed.entry(op.unwrap_or_default()).or_default() += samples.len();
                }
                DebugValue::Counter(n) if name == burstgate::metrics::DENY_CACHE_HITS => {
                    *self.hits.get_or_insert(0) += n;
                }
                DebugValue::Gauge(v) if name == burstgate::metrics::CIRCUIT_OPEN => {
                    self.circuit = Some(v.into_inner());
                }
                _ => {}
            }
        }
    }
}
