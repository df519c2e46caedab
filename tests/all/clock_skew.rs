//! Clocks that disagree: a host whose clock runs years ahead, one that reads 1970, and an NTP step
//! back, on a real Redis and on `MemoryStore`. A stored time may lead a caller's clock by at most
//! the limit's refill time plus one interval; beyond that it is moved back to the bound, and no
//! key's expiry reaches past the refill time plus two intervals from the time of its write.
#![cfg(feature = "redis")]

use std::time::Duration;

use burstgate::{BucketKey, BucketStore, Limit, ManualClock, MemoryStore, RedisStore};
use redis::aio::MultiplexedConnection;

use crate::support::{START, ZERO, redis_server};

const MINUTE: u64 = 60_000;
const YEAR: u64 = 365 * 86_400_000;

/// 1 per minute, burst 10: ten minutes to refill.
fn limit() -> Limit {
    Limit::per_minute(1)
        .and_then(|l| l.with_burst(10))
        .expect("a valid limit")
}

async fn connection() -> MultiplexedConnection {
    redis::Client::open(redis_server::url())
        .expect("a valid Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("a connection to the test Redis")
}

/// Two "hosts" on the same Redis buckets, each with its own clock.
async fn hosts(
    prefix: &str,
    a: &ManualClock,
    b: &ManualClock,
) -> [RedisStore<MultiplexedConnection, ManualClock>; 2] {
    let open = |conn, clock: &ManualClock| {
        RedisStore::new(conn)
            .prefix(prefix)
            .expect("a valid prefix")
            .deny_cache(false)
            .with_clock(clock.clone())
    };
    [open(connection().await, a), open(connection().await, b)]
}

async fn pttl(store: &RedisStore<MultiplexedConnection, ManualClock>, key: &BucketKey) -> i64 {
    redis::cmd("PTTL")
        .arg(store.redis_key(key))
        .query_async(&mut connection().await)
        .await
        .expect("PTTL")
}

#[tokio::test]
async fn a_write_from_a_clock_ten_years_ahead_freezes_every_healthy_worker() {
    let (healthy, ahead) = (ManualClock::new(START), ManualClock::new(START + 10 * YEAR));
    let [good, bad] = hosts(&redis_server::unique_prefix(), &healthy, &ahead).await;
    let key = BucketKey::new("orders", "seller").expect("a valid key");
    let d = bad.acquire(&key, limit(), 10, ZERO).await.expect("decides");
    assert!(d.is_admitted());
    // The healthy worker's clock is taken as the bucket's time (the lead is past the bound of
    // 11 minutes): the first token is a minute away, not ten years.
    let d = good.acquire(&key, limit(), 1, ZERO).await.expect("decides");
    assert!(!d.is_admitted());
    assert_eq!(d.retry_after(), Some(Duration::from_millis(MINUTE)));
    let ttl = pttl(&good, &key).await;
    assert!(
        (0..=(12 * MINUTE) as i64).contains(&ttl),
        "the key's TTL is {ttl} ms after the healthy worker's write"
    );
    // It refills from there: admitted after that minute of its own clock, and not before.
    healthy.advance(Duration::from_millis(MINUTE - 1));
    let early = good.acquire(&key, limit(), 1, ZERO).await.expect("decides");
    assert!(!early.is_admitted());
    healthy.advance(Duration::from_millis(1));
    let d = good.acquire(&key, limit(), 1, ZERO).await.expect("decides");
    assert!(d.is_admitted(), "{d:?}");
    let ttl = pttl(&good, &key).await;
    assert!((0..=(12 * MINUTE) as i64).contains(&ttl), "TTL {ttl} ms");
}

#[tokio::test]
async fn a_worker_whose_clock_reads_1970_sets_a_ttl_of_54_years() {
    let (healthy, epoch) = (ManualClock::new(START), ManualClock::new(0));
    let [good, old] = hosts(&redis_server::unique_prefix(), &healthy, &epoch).await;
    let key = BucketKey::new("orders", "seller").expect("a valid key");
    assert!(
        good.acquire(&key, limit(), 5, ZERO)
            .await
            .expect("decides")
            .is_admitted()
    );
    // Takes enough that the key must be kept longer: its write sets the expiry.
    let _ = old.acquire(&key, limit(), 3, ZERO).await.expect("decides");
    let ttl = pttl(&old, &key).await;
    assert!(
        (0..=(12 * MINUTE) as i64).contains(&ttl),
        "the 1970 worker's write left a TTL of {ttl} ms"
    );
    let _ = good.acquire(&key, limit(), 1, ZERO).await.expect("decides");
    let ttl = pttl(&good, &key).await;
    assert!((0..=(12 * MINUTE) as i64).contains(&ttl), "TTL {ttl} ms");
}

/// Empties the bucket at START, steps the clock back an hour, then tries once a minute of the
/// clock's time: the minutes until the first admission.
async fn minutes_to_admit_after_a_step_back<S: BucketStore>(store: &S, clock: &ManualClock) -> u64 {
    let key = BucketKey::new("orders", "seller").expect("a valid key");
    assert!(
        store
            .acquire(&key, limit(), 10, ZERO)
            .await
            .expect("decides")
            .is_admitted()
    );
    clock.set(START - 60 * MINUTE);
    for minute in 0..=60 {
        if store
            .acquire(&key, limit(), 1, ZERO)
            .await
            .expect("decides")
            .is_admitted()
        {
            return minute;
        }
        clock.advance(Duration::from_millis(MINUTE));
    }
    u64::MAX
}

#[tokio::test]
async fn an_ntp_step_back_of_an_hour_freezes_a_bucket_for_an_hour() {
    let clock = ManualClock::new(START);
    let memory = MemoryStore::new().with_clock(clock.clone());
    let minutes = minutes_to_admit_after_a_step_back(&memory, &clock).await;
    assert!(
        minutes <= 15,
        "MemoryStore admitted again after {minutes} minutes"
    );

    let clock = ManualClock::new(START);
    let [redis, _] = hosts(&redis_server::unique_prefix(), &clock, &clock).await;
    let minutes = minutes_to_admit_after_a_step_back(&redis, &clock).await;
    assert!(
        minutes <= 15,
        "RedisStore admitted again after {minutes} minutes"
    );
}
