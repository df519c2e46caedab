//! The outage policies while Redis fails: fail closed, fail open and the local share, on one
//! bucket and on several at once; what is retried and what is not an outage; the script reloaded
//! after `SCRIPT FLUSH`; a refund and a lowering while Redis fails.

use super::*;

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

/// The same flapping Redis under a store in lease mode: what a lease holds is spent through an
/// outage, the local bucket starts it empty as of Redis's last renewal, and Redis is charged on
/// its return for what was admitted locally, so the bound is the plain store's.
#[tokio::test]
async fn the_local_policy_keeps_its_bound_under_a_flapping_redis_in_lease_mode() {
    let clock = ManualClock::new(START);
    let conn = Switch::new().await;
    let processes = NonZeroU32::new(1).expect("non-zero");
    let store = store(conn.clone(), &clock)
        .on_outage(OutagePolicy::Local { processes })
        .leases(burstgate::Leases::new());
    let k = key("flapping-leased");
    let l = limit(40, 40);
    let step = Duration::from_millis(10);
    let mut admitted = 0u32;
    for i in 0..6_000u32 {
        conn.set(if (i / 100) % 2 == 0 { UP } else { REFUSING });
        for _ in 0..2 {
            if let Ok(d) = store.acquire(&k, l, 1, ZERO).await {
                admitted += u32::from(d.is_admitted());
            }
        }
        clock.advance(step);
        skip(step).await;
    }
    // One budget is 40 + 60 × 40 = 2,440; the local policy may add its share of each outage's
    // start, as the plain store's test allows.
    println!("leased, local 1/1 under Redis up 1 s / down 1 s for 60 s: {admitted} admitted");
    assert!(
        admitted <= 2_684,
        "{admitted} admitted against a budget of 2,440"
    );
    assert!(
        admitted >= 2_000,
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
