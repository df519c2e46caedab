//! `ServerClock` against a real Redis: hosts whose clocks disagree read one time.
//!
//! These tests time a real server, so they compare clocks to within a few milliseconds and wait
//! on real time only where the background measurement must run (a second or two).
#![cfg(feature = "redis")]

use std::time::Duration;

use burstgate::{
    BucketKey, BucketStore, Clock, Limit, RedisStore, ServerClock, StoreError, SystemClock,
};
use redis::aio::MultiplexedConnection;

use crate::support::redis_server;

/// The system clock, `.0` milliseconds off: another host's clock.
#[derive(Debug, Clone)]
struct Skewed(i64);

impl Clock for Skewed {
    fn now_ms(&self) -> u64 {
        SystemClock.now_ms().saturating_add_signed(self.0)
    }

    fn now_us(&self) -> u64 {
        SystemClock.now_us().saturating_add_signed(self.0 * 1_000)
    }
}

async fn connection(url: &str) -> MultiplexedConnection {
    redis::Client::open(url)
        .expect("a valid Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("a connection to the test Redis")
}

fn far(a: u64, b: u64) -> u64 {
    a.abs_diff(b)
}

#[tokio::test]
async fn a_host_ten_ms_ahead_reads_the_time_of_the_others_with_a_server_clock() {
    let url = redis_server::url();
    let conn = connection(&url).await;
    let every = Duration::from_secs(1);
    let ahead = ServerClock::sync_with(conn.clone(), Skewed(10), every)
        .await
        .expect("measures");
    let behind = ServerClock::sync_with(conn.clone(), Skewed(-1), every)
        .await
        .expect("measures");
    let local = ServerClock::sync_with(conn, SystemClock, every)
        .await
        .expect("measures");
    // Redis runs on this machine, so its clock is the system clock: each offset undoes the skew.
    assert!(
        (ahead.offset_us() + 10_000).abs() < 2_000,
        "{}",
        ahead.offset_us()
    );
    assert!(
        (behind.offset_us() - 1_000).abs() < 2_000,
        "{}",
        behind.offset_us()
    );
    assert!(local.offset_us().abs() < 2_000, "{}", local.offset_us());
    assert!(ahead.round_trip() < Duration::from_millis(100));
    let (a, b, c) = (ahead.now_ms(), behind.now_ms(), local.now_ms());
    assert!(far(a, b) <= 3 && far(a, c) <= 3, "{a} {b} {c}");
    // Uncorrected, the two hosts are eleven milliseconds apart.
    assert!(far(Skewed(10).now_ms(), Skewed(-1).now_ms()) >= 10);
}

#[tokio::test]
async fn stores_on_skewed_hosts_share_one_timeline_through_a_server_clock() {
    let url = redis_server::url();
    let prefix = redis_server::unique_prefix();
    let limit = Limit::per_second(1).expect("a valid limit");
    let key = BucketKey::new("shared", "seller").expect("a valid key");
    let every = Duration::from_secs(1);
    let store = |skew: i64| {
        let url = url.clone();
        let prefix = prefix.clone();
        async move {
            let conn = connection(&url).await;
            let clock = ServerClock::sync_with(conn.clone(), Skewed(skew), every)
                .await
                .expect("measures");
            RedisStore::new(conn)
                .prefix(&prefix)
                .expect("a valid prefix")
                .with_clock(clock)
        }
    };
    let ahead = store(10).await;
    let behind = store(-10).await;
    // The host behind takes the only token; the host ahead, asking right after, is told the
    // wait from the same time, one token period. Uncorrected, its clock would have credited the
    // bucket with the twenty milliseconds between the two clocks, and told it 980 ms.
    let first = behind
        .acquire(&key, limit, 1, Duration::ZERO)
        .await
        .expect("decides");
    assert!(first.is_admitted());
    let second = ahead
        .acquire(&key, limit, 1, Duration::ZERO)
        .await
        .expect("decides");
    let retry = second.retry_after().expect("refused");
    assert!(
        retry > Duration::from_millis(990) && retry <= Duration::from_secs(1),
        "{retry:?}"
    );
}

#[tokio::test]
async fn a_server_clock_keeps_its_offset_while_redis_is_down() {
    let server = redis_server::spawn("").expect("a redis-server of our own");
    let url = format!("redis://127.0.0.1:{}/", server.port);
    let conn = connection(&url).await;
    let clock = ServerClock::sync_with(conn.clone(), Skewed(50), Duration::from_secs(1))
        .await
        .expect("measures");
    let offset = clock.offset_us();
    assert!((offset + 50_000).abs() < 2_000, "{offset}");
    redis_server::kill(server);
    // At least one measurement fails meanwhile; the clock goes on with the offset it had.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(clock.offset_us(), offset);
    assert!(far(clock.now_ms(), SystemClock.now_ms()) <= 3);
    // And a clock cannot be made without Redis: a typed error, not a panic.
    match ServerClock::sync_with(conn, Skewed(0), Duration::from_secs(1)).await {
        Err(StoreError::Backend(_) | StoreError::Timeout { .. }) => {}
        other => panic!("expected a backend error, got {other:?}"),
    }
}

#[tokio::test]
async fn dropping_the_last_server_clock_ends_its_measurements() {
    let conn = connection(&redis_server::url()).await;
    let metrics = tokio::runtime::Handle::current().metrics();
    let before = metrics.num_alive_tasks();
    let clock = ServerClock::sync_with(conn, SystemClock, Duration::from_secs(1))
        .await
        .expect("measures");
    let clone = clock.clone();
    assert_eq!(metrics.num_alive_tasks(), before + 1);
    drop(clock);
    assert_eq!(
        metrics.num_alive_tasks(),
        before + 1,
        "a clone still uses it"
    );
    drop(clone);
    // Aborting takes effect at the task's next poll. (The connection's own task may end too,
    // once the clock's clone of it was the last.)
    for _ in 0..100 {
        if metrics.num_alive_tasks() <= before {
            return;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    panic!(
        "the measuring task outlived its clock: {} tasks, {before} before",
        metrics.num_alive_tasks()
    );
}
