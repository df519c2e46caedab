//! The local deny cache: it answers a flood with the decisions Redis would give, forgets a
//! denial on a refund, a reset or another process's refund, shares across prefixes, and charges
//! cancelled and failed calls as Redis did, on one bucket and on several.

use super::*;

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
