//! What the Redis store does when Redis fails: the outage policies, the timeout, the circuit
//! breaker, retrying what Redis did not run, and the local deny cache. Failures are made by a
//! connection wrapper that a test switches between up, refusing, hanging and `TRYAGAIN`, over a
//! real Redis; the fault suite with real processes being killed is `faults.rs`.
#![cfg(feature = "redis")]

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::time::Duration;

use burstgate::{
    Breaker, BucketKey, BucketStore, Limit, ManualClock, OutagePolicy, RedisStore, Reservation,
    StoreError, Take,
};
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{Cmd, Pipeline, RedisFuture, Value};

use crate::support::{START, ZERO, logs, redis_server};

const UP: u8 = 0;
const REFUSING: u8 = 1;
const HANGING: u8 = 2;
const TRY_AGAIN_ONCE: u8 = 3;
/// Redis answers that the script failed, as it does when the value at one key makes its `SET`
/// fail.
const SCRIPT_ERROR: u8 = 4;

/// A real connection that a test can take down. Counts the commands that reach it.
#[derive(Clone)]
struct Switch {
    inner: Option<MultiplexedConnection>,
    mode: Arc<AtomicU8>,
    calls: Arc<AtomicUsize>,
}

impl Switch {
    async fn new() -> Self {
        Self::to(&redis_server::url()).await
    }

    async fn to(url: &str) -> Self {
        let inner = redis::Client::open(url)
            .expect("a valid Redis URL")
            .get_multiplexed_async_connection()
            .await
            .expect("a connection to the test Redis");
        Self::over(Some(inner))
    }

    /// With no Redis behind it: only for modes that never reach one.
    fn detached() -> Self {
        Self::over(None)
    }

    fn over(inner: Option<MultiplexedConnection>) -> Self {
        Self {
            inner,
            mode: Arc::new(AtomicU8::new(UP)),
            calls: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn set(&self, mode: u8) {
        self.mode.store(mode, Ordering::SeqCst);
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

fn error(kind: redis::ErrorKind, what: &'static str) -> redis::RedisError {
    redis::RedisError::from((kind, what))
}

impl ConnectionLike for Switch {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let mode = self.mode.load(Ordering::SeqCst);
        Box::pin(async move {
            match mode {
                REFUSING => Err(redis::RedisError::from(std::io::Error::from(
                    std::io::ErrorKind::ConnectionRefused,
                ))),
                HANGING => std::future::pending().await,
                // A real error from a script, as Redis words it.
                SCRIPT_ERROR => match self.inner.as_mut() {
                    Some(inner) => {
                        let failing = redis::cmd("EVAL")
                            .arg("redis.call('SET', KEYS[1], 'x', 'PX', '-5') return 1")
                            .arg(1)
                            .arg("bgtest-script-error")
                            .clone();
                        inner.req_packed_command(&failing).await
                    }
                    None => Err(error(redis::ErrorKind::Io, "no connection")),
                },
                TRY_AGAIN_ONCE => {
                    self.mode.store(UP, Ordering::SeqCst);
                    Err(error(
                        redis::ErrorKind::Server(redis::ServerErrorKind::TryAgain),
                        "multiple keys request during rehashing of slot",
                    ))
                }
                _ => match self.inner.as_mut() {
                    Some(inner) => inner.req_packed_command(cmd).await,
                    None => Err(error(redis::ErrorKind::Io, "no connection")),
                },
            }
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            match self.inner.as_mut() {
                Some(inner) => inner.req_packed_commands(pipeline, offset, count).await,
                None => Err(error(redis::ErrorKind::Io, "no connection")),
            }
        })
    }

    fn get_db(&self) -> i64 {
        0
    }
}

/// Lets `d` pass on tokio's clock, which the circuit breaker keeps time on, at once: tokio's
/// time is paused only for the jump, since calls to a real Redis need it running.
async fn skip(d: Duration) {
    tokio::time::pause();
    tokio::time::advance(d).await;
    tokio::time::resume();
}

fn limit(per_second: u32, burst: u32) -> Limit {
    Limit::per_second(per_second)
        .and_then(|l| l.with_burst(burst))
        .expect("a valid limit")
}

/// A reservation of `cost` tokens whose slot was START: due, so it goes back while the bucket is
/// in no debt.
fn at_start(cost: u32) -> Reservation {
    Reservation::new(cost, std::time::UNIX_EPOCH + Duration::from_millis(START))
}

fn key(name: &str) -> BucketKey {
    BucketKey::new("outage", name).expect("a valid key")
}

fn store(conn: Switch, clock: &ManualClock) -> RedisStore<Switch, ManualClock> {
    RedisStore::new(conn)
        .prefix(&redis_server::unique_prefix())
        .expect("a valid prefix")
        .with_clock(clock.clone())
}

#[tokio::test]
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

#[tokio::test]
async fn fail_open_admits_acquires_and_still_reports_the_rest() {
    let clock = ManualClock::new(START);
    let conn = Switch::detached();
    conn.set(REFUSING);
    let store = store(conn, &clock).on_outage(OutagePolicy::FailOpen);
    let k = key("open");
    let l = limit(1, 2);
    for _ in 0..50 {
        let d = store.acquire(&k, l, 1, ZERO).await.expect("fails open");
        assert!(d.is_admitted());
        assert_eq!(d.wait(), ZERO);
        assert_eq!(d.remaining(), 0, "nothing is known to remain");
        assert_eq!(d.limit(), l);
    }
    assert!(store.peek(&k, l).await.is_err());
    assert!(store.refund(&k, l, at_start(1)).await.is_err());
    let until = std::time::SystemTime::UNIX_EPOCH + Duration::from_millis(START + 1_000);
    assert!(store.drain_until(&k, l, until).await.is_err());
    // Bad costs are mistakes, not outages.
    assert!(matches!(
        store.acquire(&k, l, 3, ZERO).await,
        Err(StoreError::CostAboveBurst { .. })
    ));
}

#[tokio::test]
async fn local_fallback_gives_each_process_its_share_and_no_more() {
    let clock = ManualClock::new(START);
    let l = limit(10, 10);
    let processes = NonZeroU32::new(2).expect("non-zero");
    // Two processes that share one budget, both cut off from Redis.
    let stores: Vec<_> = (0..2)
        .map(|_| {
            let conn = Switch::detached();
            conn.set(REFUSING);
            store(conn, &clock).on_outage(OutagePolicy::Local { processes })
        })
        .collect();
    let k = key("local");
    let admitted = admitted_by(&stores, &k, l, 20).await;
    assert_eq!(admitted, 10, "each process holds half the burst");
    let d = stores[0].acquire(&k, l, 1, ZERO).await.expect("local");
    // Half the rate: a token every 200 ms instead of every 100 ms.
    assert_eq!(d.retry_after(), Some(Duration::from_millis(200)));
    assert_eq!(d.limit(), l, "reported under the caller's limit");
    clock.advance(Duration::from_secs(1));
    let admitted = admitted_by(&stores, &k, l, 20).await;
    assert_eq!(admitted, 10, "one second at half the rate each: 5 + 5");
    // A cost above the share is refused as under fail closed.
    assert!(matches!(
        stores[0].acquire(&k, l, 6, ZERO).await,
        Err(StoreError::Unavailable { .. } | StoreError::Backend(_))
    ));
    // Refunds go to the bucket that gave the tokens, and peeks to the local bucket too.
    clock.advance(Duration::from_millis(200));
    let d = stores[0].acquire(&k, l, 1, ZERO).await.expect("local");
    assert!(d.is_admitted());
    let reservation = d.reservation().expect("admitted");
    stores[0]
        .refund(&k, l, reservation)
        .await
        .expect("local refund");
    let q = stores[0].peek(&k, l).await.expect("local peek");
    assert_eq!((q.remaining(), q.burst()), (1, 10));
}

/// A request on two buckets while Redis is out: an error under fail closed, admitted on both
/// with nothing known to remain under fail open, and decided on both local buckets at once
/// (each the process's share) under the local policy, which Redis is charged for once back.
#[tokio::test]
async fn requests_on_several_buckets_follow_the_outage_policy_all_or_none() {
    let clock = ManualClock::new(START);
    let (narrow, wide) = (limit(1, 2), limit(10, 10));
    let (e, a) = (key("endpoint"), key("account"));
    let both = [Take::new(&e, narrow, 1), Take::new(&a, wide, 1)];
    let down = || {
        let conn = Switch::detached();
        conn.set(REFUSING);
        conn
    };

    let closed = store(down(), &clock);
    assert!(matches!(
        closed.acquire_all(&both, ZERO).await,
        Err(StoreError::Backend(_))
    ));

    let open = store(down(), &clock).on_outage(OutagePolicy::FailOpen);
    for _ in 0..10 {
        let d = open.acquire_all(&both, ZERO).await.expect("fails open");
        assert!(d.iter().all(|d| d.is_admitted() && d.remaining() == 0));
        assert_eq!((d[0].limit(), d[1].limit()), (narrow, wide));
    }

    // Alone in its outage: the whole limit, locally. The narrow bucket's two tokens go, then
    // the request is refused on it, and the wide bucket keeps the rest.
    let conn = Switch::new().await;
    let local = store(conn.clone(), &clock).on_outage(OutagePolicy::Local {
        processes: NonZeroU32::MIN,
    });
    conn.set(REFUSING);
    let mut admitted = 0;
    for _ in 0..4 {
        let d = local
            .acquire_all(&both, ZERO)
            .await
            .expect("decides locally");
        assert!(d[0].is_admitted() == d[1].is_admitted());
        admitted += usize::from(d[0].is_admitted());
    }
    assert_eq!(admitted, 2);
    assert_eq!(
        local.peek(&a, wide).await.expect("local peek").remaining(),
        8
    );
    // Redis is back: the buckets this process spent from locally are charged there first, so
    // nothing refilled during the outage is spent twice.
    conn.set(UP);
    clock.advance(Duration::from_secs(2));
    skip(Duration::from_secs(2)).await;
    while local.is_circuit_open() {
        clock.advance(Duration::from_millis(500));
        skip(Duration::from_millis(500)).await;
        let _ = local.peek(&a, wide).await;
    }
    // Emptied as of now, both: the narrow bucket's next token is a second away.
    let d = local.acquire_all(&both, ZERO).await.expect("redis decides");
    assert!(!d[0].is_admitted(), "{d:?}");
    assert_eq!(d[0].retry_after(), Some(Duration::from_secs(1)));
    assert_eq!(d[1].retry_after(), Some(Duration::from_millis(100)));
}

/// Admissions from `n` decisions through each store in turn.
async fn admitted_by(
    stores: &[RedisStore<Switch, ManualClock>],
    k: &BucketKey,
    l: Limit,
    n: usize,
) -> usize {
    let mut admitted = 0;
    for store in stores {
        for _ in 0..n {
            let d = store.acquire(k, l, 1, ZERO).await.expect("decides locally");
            admitted += usize::from(d.is_admitted());
        }
    }
    admitted
}

#[tokio::test]
async fn a_share_below_one_token_fails_closed() {
    let clock = ManualClock::new(START);
    let conn = Switch::detached();
    conn.set(REFUSING);
    let processes = NonZeroU32::new(20).expect("non-zero");
    let store = store(conn, &clock).on_outage(OutagePolicy::Local { processes });
    let e = store
        .acquire(&key("tiny"), limit(10, 10), 1, ZERO)
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::Backend(_)), "{e:?}");
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

#[tokio::test]
async fn an_error_for_a_command_redis_did_not_run_is_retried_once() {
    let clock = ManualClock::new(START);
    let conn = Switch::new().await;
    let store = store(conn.clone(), &clock);
    let k = key("tryagain");
    conn.set(TRY_AGAIN_ONCE);
    let d = store
        .acquire(&k, limit(1, 5), 1, ZERO)
        .await
        .expect("the retry succeeds");
    assert!(d.is_admitted());
    assert_eq!(d.remaining(), 4, "the token was spent once");
    assert_eq!(conn.calls(), 2);
    assert!(!store.is_circuit_open());
}

#[tokio::test]
async fn a_key_of_the_wrong_type_is_an_error_but_not_an_outage() {
    let clock = ManualClock::new(START);
    let conn = Switch::new().await;
    let store = store(conn.clone(), &clock).on_outage(OutagePolicy::FailOpen);
    let k = key("wrong");
    let mut c = redis::Client::open(redis_server::url())
        .expect("a valid Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("a connection");
    let _: () = redis::cmd("SET")
        .arg(store.redis_key(&k))
        .arg("not a bucket")
        .query_async(&mut c)
        .await
        .expect("SET");
    for _ in 0..10 {
        let e = store.acquire(&k, limit(1, 5), 1, ZERO).await.unwrap_err();
        assert!(
            matches!(&e, StoreError::WrongType { bucket, fingerprint }
                if bucket == k.bucket() && *fingerprint == k.fingerprint()),
            "{e:?}"
        );
    }
    assert!(!store.is_circuit_open(), "Redis answered every time");
}

/// `n` plain decisions on one key at one instant, with the commands that reached Redis.
async fn flood(
    store: &RedisStore<Switch, ManualClock>,
    conn: &Switch,
    k: &BucketKey,
    l: Limit,
    n: usize,
) -> (usize, usize, Vec<Option<Duration>>) {
    let before = conn.calls();
    let mut admitted = 0;
    let mut retry_afters = Vec::new();
    for _ in 0..n {
        let d = store.acquire(k, l, 1, ZERO).await.expect("decides");
        admitted += usize::from(d.is_admitted());
        retry_afters.push(d.retry_after());
    }
    (admitted, conn.calls() - before, retry_afters)
}

#[tokio::test]
async fn the_deny_cache_answers_a_flood_locally_with_the_same_decisions() {
    let clock = ManualClock::new(START);
    let l = limit(1, 5);
    let k = key("flood");
    let cached_conn = Switch::new().await;
    let plain_conn = Switch::new().await;
    let cached = store(cached_conn.clone(), &clock);
    let plain = store(plain_conn.clone(), &clock).deny_cache(false);
    // The script loaded first (a `NOSCRIPT` costs a second call), whichever test ran before.
    let warm = plain.peek(&key("warm"), l).await.expect("peeks");
    assert_eq!(warm.remaining(), 5);
    for step in 0..3 {
        let (a, calls_a, waits_a) = flood(&cached, &cached_conn, &k, l, 500).await;
        let (b, calls_b, waits_b) = flood(&plain, &plain_conn, &k, l, 500).await;
        assert_eq!(a, b, "step {step}: the same admissions");
        assert_eq!(
            waits_a, waits_b,
            "step {step}: the same retry_after on every denial"
        );
        assert_eq!(calls_b, 500);
        // The admissions, and, the first time, the one denial that filled the cache; after
        // that each admission's cost is taken from the cache too, and Redis sees only them.
        assert_eq!(calls_a, a + usize::from(step == 0), "step {step}");
        clock.advance(Duration::from_millis(1_500));
    }
}

#[tokio::test]
async fn a_refund_through_the_store_drops_the_cached_denial() {
    let clock = ManualClock::new(START);
    let conn = Switch::new().await;
    let s = store(conn.clone(), &clock);
    let k = key("refund");
    let l = limit(1, 2);
    for _ in 0..2 {
        assert!(
            s.acquire(&k, l, 1, ZERO)
                .await
                .expect("decides")
                .is_admitted()
        );
    }
    assert!(
        !s.acquire(&k, l, 1, ZERO)
            .await
            .expect("decides")
            .is_admitted()
    );
    s.refund(&k, l, at_start(1)).await.expect("refund");
    assert!(
        s.acquire(&k, l, 1, ZERO)
            .await
            .expect("decides")
            .is_admitted()
    );
}

#[tokio::test]
async fn another_processs_refund_is_seen_no_later_than_the_cached_retry_after() {
    let clock = ManualClock::new(START);
    let prefix = redis_server::unique_prefix();
    // Two stores on the same buckets: two processes.
    let open = |conn| {
        RedisStore::new(conn)
            .prefix(&prefix)
            .expect("a valid prefix")
            .with_clock(clock.clone())
    };
    let a = open(Switch::new().await);
    let b = open(Switch::new().await);
    let k = key("elsewhere");
    let l = limit(1, 2);
    for _ in 0..2 {
        assert!(
            a.acquire(&k, l, 1, ZERO)
                .await
                .expect("decides")
                .is_admitted()
        );
    }
    let denied = a.acquire(&k, l, 1, ZERO).await.expect("decides");
    assert_eq!(denied.retry_after(), Some(Duration::from_secs(1)));
    b.refund(&k, l, at_start(1))
        .await
        .expect("refund elsewhere");
    // The documented worst case: Redis would admit now, the cache still denies...
    assert!(b.peek(&k, l).await.expect("peek").remaining() == 1);
    let d = a.acquire(&k, l, 1, ZERO).await.expect("decides");
    assert!(!d.is_admitted());
    // ...but only until the retry_after it gave.
    clock.advance(Duration::from_secs(1));
    let d = a.acquire(&k, l, 1, ZERO).await.expect("decides");
    assert!(d.is_admitted());
    assert_eq!(
        d.remaining(),
        1,
        "the refunded token and the refilled one, minus this"
    );
}

#[tokio::test]
async fn after_script_flush_the_script_runs_as_eval_without_script_load() {
    let clock = ManualClock::new(START);
    // A server of its own: other tests running meanwhile would load the script again.
    let server = redis_server::spawn("").expect("a redis-server of our own");
    let url = format!("redis://127.0.0.1:{}/", server.port);
    let conn = Switch::to(&url).await;
    let s = store(conn.clone(), &clock);
    let k = key("flush");
    assert!(
        s.acquire(&k, limit(1, 5), 1, ZERO)
            .await
            .expect("decides")
            .is_admitted()
    );
    let mut c = redis::Client::open(url.as_str())
        .expect("a valid Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("a connection");
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut c)
        .await
        .expect("SCRIPT FLUSH");
    let before = conn.calls();
    let d = s
        .acquire(&k, limit(1, 5), 1, ZERO)
        .await
        .expect("decides after the flush");
    assert_eq!(d.remaining(), 3);
    // EVALSHA (NOSCRIPT), then EVAL.
    assert_eq!(conn.calls() - before, 2);
    let before = conn.calls();
    assert!(
        s.acquire(&k, limit(1, 5), 1, ZERO)
            .await
            .expect("decides")
            .is_admitted()
    );
    assert_eq!(
        conn.calls() - before,
        1,
        "EVAL loaded it: EVALSHA works again"
    );
    redis_server::kill(server);
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

/// Whether one plain acquire of `k` is admitted; panics on an error.
async fn admits(store: &RedisStore<Switch, ManualClock>, k: &BucketKey, l: Limit) -> bool {
    store
        .acquire(k, l, 1, ZERO)
        .await
        .expect("decides")
        .is_admitted()
}

#[tokio::test]
async fn caches_shared_across_prefixes_deny_another_tenants_first_request() {
    let clock = ManualClock::new(START);
    let k = key("tenant");
    let l = Limit::per_minute(1).expect("a valid limit");
    // The deny cache, on a Redis that answers; then the local buckets of the outage policy, on
    // one that does not.
    let refusing = Switch::detached();
    refusing.set(REFUSING);
    let processes = NonZeroU32::new(1).expect("non-zero");
    let bases = [
        RedisStore::new(Switch::new().await).with_clock(clock.clone()),
        store(refusing, &clock).on_outage(OutagePolicy::Local { processes }),
    ];
    for base in &bases {
        let tenant = || {
            base.clone()
                .prefix(&redis_server::unique_prefix())
                .expect("a valid prefix")
        };
        let (a, b) = (tenant(), tenant());
        assert!(admits(&a, &k, l).await);
        assert!(!admits(&a, &k, l).await);
        // Tenant A's denial is A's alone: B's same bucket key is another bucket.
        assert!(admits(&b, &k, l).await, "tenant B's first request ever");
    }
}

#[tokio::test]
async fn the_deny_cache_stays_stale_until_its_state_refills_to_full() {
    let clock = ManualClock::new(START);
    let conn = Switch::new().await;
    let s = store(conn.clone(), &clock);
    let k = key("stale");
    let l = limit(10, 5);
    for _ in 0..5 {
        assert!(
            s.acquire(&k, l, 1, ZERO)
                .await
                .expect("decides")
                .is_admitted()
        );
    }
    let denied = s.acquire(&k, l, 1, ZERO).await.expect("decides");
    assert_eq!(denied.retry_after(), Some(Duration::from_millis(100)));
    // Redis loses the bucket (a restart without persistence, FLUSHALL): it is full there now.
    let mut admin = redis::Client::open(redis_server::url())
        .expect("a valid Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("a connection");
    let _: () = redis::cmd("DEL")
        .arg(s.redis_key(&k))
        .query_async(&mut admin)
        .await
        .expect("DEL");
    // The documented bound: stale at most until the retry_after of the denial that filled it.
    clock.advance(Duration::from_millis(100));
    let mut admitted = 0;
    for _ in 0..5 {
        admitted += usize::from(
            s.acquire(&k, l, 1, ZERO)
                .await
                .expect("decides")
                .is_admitted(),
        );
    }
    assert_eq!(
        admitted, 5,
        "Redis holds a full bucket, and the cache follows it"
    );
    assert!(
        !s.acquire(&k, l, 1, ZERO)
            .await
            .expect("decides")
            .is_admitted()
    );
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

#[tokio::test]
async fn a_cancelled_call_leaves_its_cost_charged_in_the_deny_cache() {
    let clock = ManualClock::new(START);
    let conn = Switch::new().await;
    let s = store(conn.clone(), &clock);
    let k = key("cancelled-charge");
    let l = limit(10, 1);
    assert!(
        s.acquire(&k, l, 1, ZERO)
            .await
            .expect("decides")
            .is_admitted()
    );
    assert!(
        !s.acquire(&k, l, 1, ZERO)
            .await
            .expect("decides")
            .is_admitted()
    );
    // A token later the cache lets one call through, taking its cost ahead of Redis; the call
    // hangs and its caller gives up before Redis sees it.
    clock.advance(Duration::from_millis(100));
    conn.set(HANGING);
    let call = tokio::time::timeout(Duration::from_millis(5), s.acquire(&k, l, 1, ZERO));
    assert!(call.await.is_err(), "cancelled");
    conn.set(UP);
    // Redis still holds that token, and the next call gets it.
    let d = s.acquire(&k, l, 1, ZERO).await.expect("decides");
    assert!(
        d.is_admitted(),
        "denied by a charge Redis never took: {d:?}"
    );
}

/// A request on a client's bucket of 10 per second with a burst of one, and on a global one it
/// never empties.
fn own_and_global<'a>(own: &'a BucketKey, global: &'a BucketKey) -> [Take<'a>; 2] {
    [
        Take::new(own, limit(10, 1), 1),
        Take::new(global, limit(1000, 1000), 1),
    ]
}

/// Admits `both` once and refuses it once, so that the deny cache holds both buckets' states.
async fn admitted_then_refused(s: &RedisStore<Switch, ManualClock>, both: &[Take<'_>]) {
    let first = s.acquire_all(both, ZERO).await.expect("decides");
    assert!(first[0].is_admitted());
    let second = s.acquire_all(both, ZERO).await.expect("decides");
    assert!(!second[0].is_admitted());
}

#[tokio::test]
async fn a_cancelled_call_on_several_buckets_leaves_no_charge_in_the_deny_cache() {
    let clock = ManualClock::new(START);
    let conn = Switch::new().await;
    let s = store(conn.clone(), &clock);
    let (own, global) = (key("cancelled-own"), key("cancelled-global"));
    let both = own_and_global(&own, &global);
    admitted_then_refused(&s, &both).await;
    let before = conn.calls();
    assert!(!s.acquire_all(&both, ZERO).await.expect("decides")[0].is_admitted());
    assert_eq!(conn.calls(), before, "refused by the cache");
    // A token later the cache lets one call through, each entry taking its part ahead of
    // Redis; the call hangs and its caller gives up before Redis sees it.
    clock.advance(Duration::from_millis(100));
    conn.set(HANGING);
    let call = tokio::time::timeout(Duration::from_millis(5), s.acquire_all(&both, ZERO));
    assert!(call.await.is_err(), "cancelled");
    conn.set(UP);
    // Redis still holds that token, and the next call gets it.
    let d = s.acquire_all(&both, ZERO).await.expect("decides");
    assert!(
        d[0].is_admitted(),
        "refused by a charge Redis never took: {d:?}"
    );
}

#[tokio::test]
async fn a_failed_call_on_several_buckets_drops_their_charges_from_the_deny_cache() {
    let clock = ManualClock::new(START);
    let conn = Switch::new().await;
    let s = store(conn.clone(), &clock);
    let (own, global) = (key("failed-own"), key("failed-global"));
    let both = own_and_global(&own, &global);
    admitted_then_refused(&s, &both).await;
    clock.advance(Duration::from_millis(100));
    conn.set(REFUSING);
    assert!(s.acquire_all(&both, ZERO).await.is_err(), "fails closed");
    conn.set(UP);
    let d = s.acquire_all(&both, ZERO).await.expect("decides");
    assert!(d[0].is_admitted(), "{d:?}");
}

#[tokio::test]
async fn a_refund_or_a_reset_of_one_bucket_lets_the_next_request_on_several_reach_redis() {
    let clock = ManualClock::new(START);
    let conn = Switch::new().await;
    let s = store(conn.clone(), &clock);
    let (own, global) = (key("refund-own"), key("refund-global"));
    let both = own_and_global(&own, &global);
    admitted_then_refused(&s, &both).await;
    s.refund(&own, both[0].limit(), at_start(1))
        .await
        .expect("refund");
    let d = s.acquire_all(&both, ZERO).await.expect("decides");
    assert!(d[0].is_admitted(), "the refunded token: {d:?}");
    // Refused again, and then by the cache, until a reset.
    assert!(!s.acquire_all(&both, ZERO).await.expect("decides")[0].is_admitted());
    let before = conn.calls();
    assert!(!s.acquire_all(&both, ZERO).await.expect("decides")[0].is_admitted());
    assert_eq!(conn.calls(), before, "refused by the cache");
    s.reset(&own).await.expect("reset");
    let d = s.acquire_all(&both, ZERO).await.expect("decides");
    assert!(d[0].is_admitted(), "the reset bucket: {d:?}");
}

#[tokio::test]
async fn at_a_refilled_token_one_request_on_several_buckets_goes_to_redis_not_every_waiting_one() {
    let clock = ManualClock::new(START);
    let conn = Switch::new().await;
    let s = store(conn.clone(), &clock);
    let (own, global) = (key("racing-own"), key("racing-global"));
    admitted_then_refused(&s, &own_and_global(&own, &global)).await;
    clock.advance(Duration::from_millis(100));
    let before = conn.calls();
    let racing = (0..64).map(|_| {
        let (s, own, global) = (s.clone(), own.clone(), global.clone());
        tokio::spawn(async move {
            s.acquire_all(&own_and_global(&own, &global), ZERO)
                .await
                .expect("decides")[0]
                .is_admitted()
        })
    });
    let mut admitted = 0;
    for task in racing.collect::<Vec<_>>() {
        admitted += usize::from(task.await.expect("the task finishes"));
    }
    assert_eq!(admitted, 1, "one token");
    assert_eq!(
        conn.calls() - before,
        1,
        "the request that took the token from the cache's entries, and no other"
    );
}

#[tokio::test]
async fn the_local_policy_admits_twice_its_budget_under_a_flapping_redis() {
    // Redis up for a second, down for a second, for a minute, on 10 per second with a burst of
    // 10, one process: one budget is 10 + 60 × 10 = 610.
    let clock = ManualClock::new(START);
    let conn = Switch::new().await;
    let processes = NonZeroU32::new(1).expect("non-zero");
    let store = store(conn.clone(), &clock)
        .on_outage(OutagePolicy::Local { processes })
        .deny_cache(false);
    let k = key("flapping");
    let l = limit(10, 10);
    let step = Duration::from_millis(10);
    let mut admitted = 0u32;
    for i in 0..6_000u32 {
        conn.set(if (i / 100) % 2 == 0 { UP } else { REFUSING });
        if let Ok(d) = store.acquire(&k, l, 1, ZERO).await {
            admitted += u32::from(d.is_admitted());
        }
        clock.advance(step);
        skip(step).await;
    }
    println!("local 1/1 under Redis up 1 s / down 1 s for 60 s: {admitted} admitted, budget 610");
    assert!(
        admitted <= 671,
        "{admitted} admitted against a budget of 610"
    );
    assert!(
        admitted >= 500,
        "{admitted} admitted: the budget went unused"
    );
}

#[tokio::test]
async fn a_refund_goes_to_whichever_store_answers() {
    // 1 per minute, no burst.
    let l = Limit::per_minute(1).expect("a valid limit");
    let clock = ManualClock::new(START);
    let conn = Switch::new().await;
    let processes = NonZeroU32::new(1).expect("non-zero");
    let local = store(conn.clone(), &clock).on_outage(OutagePolicy::Local { processes });
    let k = key("refund-source");
    let d = local.acquire(&k, l, 1, ZERO).await.expect("Redis decides");
    assert!(d.is_admitted());
    // Redis goes away before the request is sent; the refund of Redis's token cannot reach it,
    // and must not land in the local bucket, which never gave it.
    conn.set(REFUSING);
    let refund = local
        .refund(&k, l, d.reservation().expect("admitted"))
        .await;
    assert!(refund.is_err(), "{refund:?}");
    let mut admitted = 0;
    for _ in 0..3 {
        admitted += usize::from(
            local
                .acquire(&k, l, 1, ZERO)
                .await
                .expect("local")
                .is_admitted(),
        );
    }
    assert_eq!(
        admitted, 0,
        "the local bucket is empty while Redis was deciding"
    );

    // A fail-open admission took nothing, and its refund gives nothing to Redis.
    let conn = Switch::new().await;
    let open = store(conn.clone(), &clock).on_outage(OutagePolicy::FailOpen);
    let k = key("refund-fail-open");
    assert!(
        open.acquire(&k, l, 1, ZERO)
            .await
            .expect("Redis decides")
            .is_admitted()
    );
    conn.set(REFUSING);
    let d = open.acquire(&k, l, 1, ZERO).await.expect("fail open");
    assert!(d.is_admitted());
    conn.set(UP);
    open.refund(&k, l, d.reservation().expect("admitted"))
        .await
        .expect("nothing to give");
    assert!(
        !open
            .acquire(&k, l, 1, ZERO)
            .await
            .expect("Redis decides")
            .is_admitted(),
        "Redis's bucket is still empty"
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

#[tokio::test]
async fn while_redis_fails_a_lowering_follows_the_policy_and_a_mark_fails_closed() {
    let clock = ManualClock::new(START);
    let l = limit(10, 10);
    let until = std::time::SystemTime::UNIX_EPOCH + Duration::from_millis(START + 60_000);
    // Fail closed (and fail open, which admits but cannot lower a bucket it does not have):
    // the lowering and the mark are errors, never a silent yes.
    for policy in [OutagePolicy::FailClosed, OutagePolicy::FailOpen] {
        let conn = Switch::detached();
        conn.set(REFUSING);
        let store = store(conn, &clock).on_outage(policy);
        let k = key("follow");
        assert!(store.lower_to(&k, l, 3).await.is_err(), "{policy:?}");
        assert!(store.book(&k, "00ff", until).await.is_err(), "{policy:?}");
        assert!(store.claim(&k, "00ff").await.is_err(), "{policy:?}");
        // A report at or above the burst needs no call, so it is no error.
        assert_eq!(store.lower_to(&k, l, 10).await.ok(), Some(false));
    }
    // Local: the lowering goes to this process's share (5 of 10), and its next decisions follow
    // it; a mark still fails closed, since no local table can say whether another process spent
    // it.
    let conn = Switch::detached();
    conn.set(REFUSING);
    let processes = NonZeroU32::new(2).expect("non-zero");
    let store = store(conn, &clock).on_outage(OutagePolicy::Local { processes });
    let k = key("follow-local");
    assert_eq!(store.lower_to(&k, l, 2).await.ok(), Some(true));
    let mut admitted = 0;
    for _ in 0..5 {
        let d = store
            .acquire(&k, l, 1, ZERO)
            .await
            .expect("decided locally");
        admitted += usize::from(d.is_admitted());
    }
    assert_eq!(admitted, 2, "the local share follows the report");
    assert!(store.book(&k, "00ff", until).await.is_err());
    assert!(store.claim(&k, "00ff").await.is_err());
}
