//! Lease mode on a real Redis: decisions from a lease with few calls, the exact bound across
//! holders, what it refuses, and a holder that dies with its lease.
#![cfg(feature = "redis")]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use burstgate::{BucketKey, BucketStore, Leases, Limit, ManualClock, RedisStore, StoreError, Take};
use redis::aio::{ConnectionLike, MultiplexedConnection};

use crate::support::{START, ZERO, redis_server};

/// A connection that counts the commands sent through it.
#[derive(Clone)]
struct Counting {
    inner: MultiplexedConnection,
    calls: Arc<AtomicU64>,
}

impl ConnectionLike for Counting {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.req_packed_command(cmd)
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.inner.req_packed_commands(cmd, offset, count)
    }

    fn get_db(&self) -> i64 {
        self.inner.get_db()
    }
}

async fn conn() -> MultiplexedConnection {
    redis::Client::open(redis_server::url())
        .expect("a valid Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("a connection to the test Redis")
}

async fn leasing(
    prefix: &str,
    clock: &ManualClock,
    leases: Leases,
) -> (RedisStore<Counting, ManualClock>, Arc<AtomicU64>) {
    let calls = Arc::new(AtomicU64::new(0));
    let store = RedisStore::new(Counting {
        inner: conn().await,
        calls: Arc::clone(&calls),
    })
    .prefix(prefix)
    .expect("a valid prefix")
    .with_clock(clock.clone())
    .leases(leases);
    (store, calls)
}

fn key() -> BucketKey {
    BucketKey::new("global", "all").expect("a valid key")
}

#[tokio::test]
async fn a_hot_key_is_decided_from_its_lease_with_one_call_per_hundred_decisions() {
    let prefix = redis_server::unique_prefix();
    let clock = ManualClock::new(START);
    let (store, calls) = leasing(&prefix, &clock, Leases::new()).await;
    let limit = Limit::per_second(1_000_000)
        .and_then(|l| l.with_burst(1_000_000))
        .expect("a valid limit");
    for i in 0..20_000u32 {
        if i % 100 == 0 {
            clock.advance(Duration::from_millis(1));
        }
        let d = store
            .acquire(&key(), limit, 1, ZERO)
            .await
            .expect("decides");
        assert!(d.is_admitted(), "decision {i} refused: {d:?}");
    }
    let calls = calls.load(Ordering::Relaxed);
    assert!(
        calls <= 200,
        "{calls} calls to Redis for 20,000 decisions on one key"
    );
}

#[tokio::test]
async fn holders_together_admit_no_more_than_the_burst_and_the_rate() {
    let prefix = redis_server::unique_prefix();
    let clock = ManualClock::new(START);
    let (a, _) = leasing(&prefix, &clock, Leases::new()).await;
    let (b, _) = leasing(&prefix, &clock, Leases::new()).await;
    let limit = Limit::per_second(200)
        .and_then(|l| l.with_burst(40))
        .expect("a valid limit");
    let mut admitted = 0u64;
    for ms in 0..3_000u64 {
        for store in [&a, &b] {
            for _ in 0..2 {
                if store
                    .acquire(&key(), limit, 1, ZERO)
                    .await
                    .expect("decides")
                    .is_admitted()
                {
                    admitted += 1;
                }
            }
        }
        // From the start to now: the burst, and 200 a second since.
        let bound = 40 + 200 * ms / 1_000;
        assert!(
            admitted <= bound,
            "{admitted} admitted by {ms} ms, bound {bound}"
        );
        clock.advance(Duration::from_millis(1));
    }
    // Demand was four a millisecond, twenty times the rate: most of the budget went.
    let budget = 40 + 200 * 3;
    assert!(
        admitted * 100 >= budget * 90,
        "{admitted} admitted of a budget of {budget}"
    );
}

#[tokio::test]
async fn what_a_lease_cannot_serve_is_refused_and_plain_stores_keep_off_a_leased_bucket() {
    let prefix = redis_server::unique_prefix();
    let clock = ManualClock::new(START);
    let (store, _) = leasing(&prefix, &clock, Leases::new()).await;
    let limit = Limit::per_second(10).expect("a valid limit");
    assert!(matches!(
        store
            .acquire(&key(), limit, 1, Duration::from_secs(1))
            .await,
        Err(StoreError::NotLeasable)
    ));
    let other = BucketKey::new("global", "other").expect("a valid key");
    assert!(matches!(
        store
            .acquire_all(
                &[Take::new(&key(), limit, 1), Take::new(&other, limit, 1)],
                ZERO
            )
            .await,
        Err(StoreError::NotLeasable)
    ));
    assert!(
        store
            .acquire(&key(), limit, 1, ZERO)
            .await
            .expect("decides")
            .is_admitted()
    );
    let plain = RedisStore::new(conn().await)
        .prefix(&prefix)
        .expect("a valid prefix")
        .with_clock(clock.clone());
    match plain.acquire(&key(), limit, 1, ZERO).await {
        Err(StoreError::Leased {
            bucket,
            fingerprint,
        }) => {
            assert_eq!(bucket, "global");
            assert_eq!(fingerprint, key().fingerprint());
        }
        other => panic!("a plain store decided on a leased bucket: {other:?}"),
    }
    // A peek says what the bucket holds beside the lease: the burst of 10, less the lease the
    // store took for its one request.
    let state = plain.peek(&key(), limit).await.expect("a peek");
    assert_eq!(state.remaining(), 9);
}

#[tokio::test]
async fn an_idle_lease_goes_back_and_the_bucket_is_plain_again() {
    let prefix = redis_server::unique_prefix();
    let clock = ManualClock::new(START);
    assert_eq!(
        Leases::new().time(Duration::from_millis(99)),
        Err(burstgate::InvalidLeases::Time {
            time: Duration::from_millis(99)
        })
    );
    let leases = Leases::new()
        .time(Duration::from_millis(100))
        .expect("a valid time");
    let (store, _) = leasing(&prefix, &clock, leases).await;
    let limit = Limit::per_second(10).expect("a valid limit");
    for _ in 0..3 {
        let d = store
            .acquire(&key(), limit, 1, ZERO)
            .await
            .expect("decides");
        assert!(d.is_admitted());
    }
    let plain = RedisStore::new(conn().await)
        .prefix(&prefix)
        .expect("a valid prefix")
        .with_clock(clock.clone());
    // No demand: at half the lease's time the watch gives everything back.
    let mut back = false;
    for _ in 0..100 {
        clock.advance(Duration::from_millis(5));
        tokio::time::sleep(Duration::from_millis(10)).await;
        // Refused while a lease is out; decided on once it is back.
        if let Ok(d) = plain.acquire(&key(), limit, 1, ZERO).await {
            back = true;
            // Three spent, nothing lost: the rest came back, and 10 a second refill since.
            assert!(d.is_admitted() && d.remaining() >= 6, "{d:?}");
            break;
        }
    }
    assert!(back, "the idle lease was never given back");
}

#[tokio::test]
async fn a_holder_killed_with_its_lease_loses_at_most_that_lease_until_it_ends() {
    let prefix = redis_server::unique_prefix();
    let clock = ManualClock::new(START);
    let limit = Limit::per_minute(1)
        .and_then(|l| l.with_burst(80))
        .expect("a valid limit");
    // A holder in a runtime of its own, which is then shut down with its tasks: nothing it
    // held is given back, as after a SIGKILL.
    let dead = {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a runtime");
        let (prefix, clock) = (prefix.clone(), clock.clone());
        let held = std::thread::spawn(move || {
            runtime.block_on(async {
                let (store, _) = leasing(&prefix, &clock, Leases::new()).await;
                for _ in 0..3 {
                    let d = store.acquire(&key(), limit, 1, ZERO).await;
                    assert!(d.expect("decides").is_admitted());
                }
                // What it holds when it dies: its lease, less what it spent of it.
                store
                    .acquire(&key(), limit, 1, ZERO)
                    .await
                    .expect("decides")
                    .remaining()
            })
        });
        held.join().expect("the holder ran")
    };
    let (alive, _) = leasing(&prefix, &clock, Leases::new()).await;
    let mut admitted = 0u32;
    while alive
        .acquire(&key(), limit, 1, ZERO)
        .await
        .expect("decides")
        .is_admitted()
    {
        admitted += 1;
    }
    // 4 spent by the dead holder, and what it held is out until its lease ends.
    assert_eq!(admitted, 80 - 4 - dead);
    assert!(dead <= 10, "one lease holds at most an eighth of the burst");
    // After the lease's time: its tokens are lost, not returned, and nothing else is.
    clock.advance(Duration::from_secs(1));
    assert!(
        !alive
            .acquire(&key(), limit, 1, ZERO)
            .await
            .expect("decides")
            .is_admitted()
    );
}

#[tokio::test]
async fn only_the_buckets_named_are_leased_and_the_others_keep_every_feature() {
    let prefix = redis_server::unique_prefix();
    let clock = ManualClock::new(START);
    let global = burstgate::BucketName::new("global").expect("a valid name");
    let (store, _) = leasing(&prefix, &clock, Leases::new().bucket(global)).await;
    let limit = Limit::per_second(10).expect("a valid limit");
    let account = BucketKey::new("account", "seller-1").expect("a valid key");
    let endpoint = BucketKey::new("endpoint", "seller-1").expect("a valid key");
    // Not leased: reservations and several buckets at once, as on any store.
    for _ in 0..10 {
        let d = store.acquire(&account, limit, 1, ZERO).await;
        assert!(d.expect("decides").is_admitted());
    }
    let reserved = store
        .acquire(&account, limit, 1, Duration::from_secs(1))
        .await
        .expect("decides");
    assert!(reserved.is_admitted() && reserved.wait() > ZERO);
    let both = [
        Take::new(&endpoint, limit, 1),
        Take::new(&account, limit, 1),
    ];
    assert!(store.acquire_all(&both, ZERO).await.is_ok());
    // Leased: from the lease, and refused what a lease cannot serve.
    assert!(
        store
            .acquire(&key(), limit, 1, ZERO)
            .await
            .expect("decides")
            .is_admitted()
    );
    let global_key = key();
    let with_global = [
        Take::new(&global_key, limit, 1),
        Take::new(&account, limit, 1),
    ];
    assert!(matches!(
        store.acquire_all(&with_global, ZERO).await,
        Err(StoreError::NotLeasable)
    ));
}

/// The tower layer over a store in lease mode: a global rule answers from the lease, exactly
/// to the burst, then 429 with the time the next token comes.
#[cfg(feature = "tower")]
#[tokio::test]
async fn a_layer_over_a_leased_store_admits_the_burst_and_then_refuses() {
    use burstgate::layer::{KeyExtractor, RateLimitLayer, Rule};
    use std::sync::atomic::AtomicUsize;
    use tower::Layer;

    use crate::support::layer::{call, counting};

    let prefix = redis_server::unique_prefix();
    let clock = ManualClock::new(START);
    let (store, _) = leasing(&prefix, &clock, Leases::new()).await;
    let limit = Limit::per_minute(1)
        .and_then(|l| l.with_burst(10))
        .expect("a valid limit");
    let rule = Rule::new("global", limit, KeyExtractor::global()).expect("a valid rule");
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = RateLimitLayer::new(store)
        .rule(rule)
        .layer(counting(&calls));
    let mut statuses = Vec::new();
    for _ in 0..15 {
        let req = http::Request::builder()
            .uri("/orders")
            .body(String::new())
            .expect("a valid request");
        let res = call(&mut svc, req).await;
        statuses.push(res.status().as_u16());
        if res.status() == http::StatusCode::TOO_MANY_REQUESTS {
            let retry: u64 = res
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
                .expect("a retry-after in seconds");
            assert!((1..=60).contains(&retry), "retry-after {retry}");
        }
    }
    assert_eq!(
        statuses.iter().filter(|&&s| s == 200).count(),
        10,
        "{statuses:?}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 10);
}

#[tokio::test]
async fn a_refund_goes_back_to_the_lease_and_a_dropped_renewal_leaves_no_one_waiting() {
    let prefix = redis_server::unique_prefix();
    let clock = ManualClock::new(START);
    let (store, _) = leasing(&prefix, &clock, Leases::new()).await;
    let limit = Limit::per_minute(1)
        .and_then(|l| l.with_burst(16))
        .expect("a valid limit");
    // A caller that goes away in the middle of its renewal: the next one is not stuck behind
    // it, and whatever the dropped call did, no more than the burst goes.
    {
        let k = key();
        let call = store.acquire(&k, limit, 1, ZERO);
        tokio::pin!(call);
        // Polled once, which sends the renewal, then dropped.
        tokio::select! {
            biased;
            _ = &mut call => panic!("the first call needs a round trip"),
            () = std::future::ready(()) => {}
        }
    }
    let first = store
        .acquire(&key(), limit, 1, ZERO)
        .await
        .expect("decides");
    assert!(first.is_admitted());
    store
        .refund(
            &key(),
            limit,
            first.reservation().expect("an admission's reservation"),
        )
        .await
        .expect("a refund");
    let mut admitted = 0;
    for _ in 0..40 {
        if store
            .acquire(&key(), limit, 1, ZERO)
            .await
            .expect("decides")
            .is_admitted()
        {
            admitted += 1;
        }
    }
    // The refunded token went again; the dropped call's grant, if it ran, is lost.
    assert!(
        (14..=16).contains(&admitted),
        "{admitted} admitted after the refund"
    );
}

#[tokio::test]
async fn keys_past_the_most_leased_at_once_are_decided_by_plain_calls() {
    let prefix = redis_server::unique_prefix();
    let clock = ManualClock::new(START);
    let (store, calls) = leasing(&prefix, &clock, Leases::new()).await;
    let limit = Limit::per_second(10).expect("a valid limit");
    for i in 0..1_100 {
        let k = BucketKey::new("global", format!("made-up-{i}")).expect("a valid key");
        let d = store.acquire(&k, limit, 1, ZERO).await.expect("decides");
        assert!(d.is_admitted(), "{i}");
    }
    assert_eq!(calls.load(Ordering::Relaxed), 1_100, "one call per new key");
}
