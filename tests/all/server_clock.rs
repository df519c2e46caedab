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

/// Redis's clock less `clock`'s, in microseconds: `clock` read on both sides of a `TIME`, the
/// fastest of five tries kept, as the store's own measurement does.
async fn ahead_of_redis<K: Clock>(conn: &mut MultiplexedConnection, clock: &K) -> i64 {
    let mut best: Option<(u64, i64)> = None;
    for _ in 0..5 {
        let before = clock.now_us();
        let (secs, micros): (u64, u64) = redis::cmd("TIME")
            .query_async(conn)
            .await
            .expect("TIME answers");
        let after = clock.now_us();
        let mid = i128::from(before / 2 + after / 2);
        let redis_us = i128::from(secs * 1_000_000 + micros);
        let ahead = i64::try_from(mid - redis_us).expect("a small difference");
        let spread = after.saturating_sub(before);
        if best.is_none_or(|(s, _)| spread < s) {
            best = Some((spread, ahead));
        }
    }
    best.expect("five tries").1
}

/// Run alone, this host's stores count the time Redis counts; the test after it runs it again in
/// a process whose system clock is 50 ms ahead, where only the shared time makes it pass.
#[tokio::test]
async fn a_store_built_with_defaults_counts_redis_time() {
    let url = redis_server::url();
    let mut conn = connection(&url).await;
    let store = RedisStore::connect(&url).await.expect("connects");
    assert!(
        store.clock().is_measured(),
        "connect measures before it returns"
    );
    let system = ahead_of_redis(&mut conn, &SystemClock).await;
    let connected = ahead_of_redis(&mut conn, store.clock()).await;
    let made = RedisStore::new(conn.clone())
        .prefix(&redis_server::unique_prefix())
        .expect("a valid prefix");
    // Its measurements start with its first call, once its builders set the key.
    let key = BucketKey::new("defaults", "k").expect("a valid key");
    let limit = Limit::per_second(10).expect("a valid limit");
    let first = made.acquire(&key, limit, 1, Duration::ZERO).await;
    assert!(first.expect("decides").is_admitted());
    for _ in 0..200 {
        if made.clock().is_measured() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(made.clock().is_measured(), "new measures in the background");
    let made_ahead = ahead_of_redis(&mut conn, made.clock()).await;
    println!("system clock ahead of redis by {system} us");
    println!("connect's store ahead by {connected} us, new's by {made_ahead} us");
    assert!(connected.abs() < 3_000, "{connected} us off Redis's time");
    assert!(made_ahead.abs() < 3_000, "{made_ahead} us off Redis's time");
}

/// libfaketime, which shifts one process's system clock: `LIBFAKETIME`, or Debian's path.
fn libfaketime() -> String {
    if let Ok(path) = std::env::var("LIBFAKETIME")
        && !path.is_empty()
    {
        return path;
    }
    let candidates = [
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
        "/usr/lib/faketime/libfaketime.so.1",
        "/usr/local/lib/faketime/libfaketime.so.1",
    ];
    candidates
        .iter()
        .find(|p| std::path::Path::new(p).exists())
        .map(|p| (*p).to_owned())
        .unwrap_or_else(|| {
            panic!(
                "this test shifts a process's clock with libfaketime, which is not installed: \
                 install it (`apt-get install libfaketime` on Debian) or set LIBFAKETIME to its \
                 libfaketime.so.1"
            )
        })
}

/// Before the shared time was the default, a host whose clock ran ahead took nearly every token
/// of a contended bucket: its stores counted its own clock.
#[tokio::test]
async fn a_host_fifty_ms_ahead_counts_redis_time_by_default() {
    let url = redis_server::url();
    let out = std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args([
            "server_clock::a_store_built_with_defaults_counts_redis_time",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("LD_PRELOAD", libfaketime())
        .env("FAKETIME", "+0.050")
        .env("REDIS_URL", &url)
        .output()
        .expect("the test binary runs again");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let system: i64 = stdout
        .lines()
        // The harness may print the test's name on the same line.
        .find_map(|l| l.split("system clock ahead of redis by ").nth(1))
        .and_then(|l| l.strip_suffix(" us"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no reading from the shifted process:\n{stdout}\n{stderr}"));
    assert!(
        (40_000..60_000).contains(&system),
        "libfaketime shifted the process's clock by {system} us, not 50 ms"
    );
    assert!(
        out.status.success(),
        "a store with every default, on a host 50 ms ahead, does not count Redis's time:\n\
         {stdout}\n{stderr}"
    );
}

/// Sends `args` to the Redis on `port` as its default user, blocking.
fn admin(port: u16, args: &[&str]) {
    let mut conn = redis::Client::open(format!("redis://127.0.0.1:{port}/"))
        .expect("a valid Redis URL")
        .get_connection()
        .expect("a connection to our own Redis");
    let mut cmd = redis::cmd(args[0]);
    for arg in &args[1..] {
        cmd.arg(*arg);
    }
    cmd.query::<()>(&mut conn).expect("the command succeeds");
}

/// The warnings the clock logged, as `message error` lines.
fn clock_warnings(logs: &crate::support::logs::Captured) -> Vec<String> {
    logs.messages("burstgate::redis")
        .into_iter()
        .filter(|(level, message)| {
            *level == tracing::Level::WARN && message.contains("clock's offset")
        })
        .map(|(_, message)| message)
        .collect()
}

/// A task that keeps the runtime's thread busy `ms` at a time between yields, as a handler
/// that does some CPU work does: a reply from Redis waits that long to be read.
fn keep_busy(ms: u64) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            std::thread::sleep(Duration::from_millis(ms));
            tokio::task::yield_now().await;
        }
    })
}

/// A reply read late (the runtime was busy when it arrived) made the round trip long and put
/// its midpoint late, so the offset came out about the delay too low: with every sample read
/// late, the fastest of five is as late, and the store counted time tens of milliseconds behind
/// Redis's while the host's own clock was right. What a measurement proves is only that the
/// offset lies within half a round trip of the midpoint's; a correction beyond what it proves
/// makes a right clock wrong.
#[tokio::test]
async fn a_busy_runtime_does_not_put_the_shared_time_off_by_its_delay() {
    let url = redis_server::url();
    let mut conn = connection(&url).await;
    // Measured while nothing else runs: how far this host's clock really is from Redis's.
    let truth = -ahead_of_redis(&mut conn, &SystemClock).await;
    let busy = keep_busy(20);
    let store = RedisStore::new(conn)
        .prefix(&redis_server::unique_prefix())
        .expect("a valid prefix");
    let key = BucketKey::new("busy", "k").expect("a valid key");
    let limit = Limit::per_second(10).expect("a valid limit");
    let first = store.acquire(&key, limit, 1, Duration::ZERO).await;
    assert!(first.expect("decides").is_admitted());
    for _ in 0..300 {
        if store.clock().is_measured() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    busy.abort();
    assert!(store.clock().is_measured(), "measures in the background");
    let offset = store.clock().offset_us();
    assert!(
        (offset - truth).abs() < 2_000,
        "the store counts {} us off Redis's time (offset {offset} us, round trip {:?}), where \
         this host's own clock is {} us off",
        offset - truth,
        store.clock().round_trip(),
        truth.abs()
    );
}

/// A store whose clock started measuring on a runtime that has since shut down (built and
/// first used in one runtime, then used in another, as a store kept in a static across
/// `#[tokio::test]`s, or made in a runtime of its own at start-up, is): its task ended with that
/// runtime, and it never measured again, silently, while the store's decisions went on.
#[test]
fn a_store_first_used_on_a_runtime_that_ended_measures_on_the_next() {
    let url = redis_server::url();
    let runtime = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
    };
    let first = runtime();
    let conn = first.block_on(async {
        redis::Client::open(url.as_str())
            .expect("a valid Redis URL")
            .get_connection_manager()
            .await
            .expect("a connection to the test Redis")
    });
    let store = RedisStore::new(conn)
        .prefix(&redis_server::unique_prefix())
        .expect("a valid prefix");
    first.block_on(async {
        let _ = store.clock().now_ms();
    });
    drop(first);
    let key = BucketKey::new("runtimes", "k").expect("a valid key");
    let limit = Limit::per_second(100).expect("a valid limit");
    runtime().block_on(async {
        for _ in 0..300 {
            // The connection reconnects on this runtime: decisions go on.
            let _ = store.acquire(&key, limit, 1, Duration::ZERO).await;
            if store.clock().is_measured() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let answered = store.acquire(&key, limit, 1, Duration::ZERO).await;
        panic!(
            "no measurement within 3 s on the runtime the store is used on (its decisions: {:?})",
            answered.map(|d| d.is_admitted())
        );
    });
}

/// `connect`'s first measurement failed and was logged, then the background task's first
/// attempt failed the same way and logged it again: two warnings for one failure.
#[tokio::test]
async fn a_measurement_that_keeps_failing_is_logged_once() {
    let (logs, _guard) = crate::support::logs::capture();
    let server = redis_server::spawn("").expect("a redis-server of our own");
    let port = server.port;
    // A user who may run the bucket script by its SHA, loaded by another user, but not `EVAL`.
    admin(
        port,
        &[
            "ACL", "SETUSER", "noeval", "on", ">pw", "~*", "+@all", "-eval",
        ],
    );
    let key = BucketKey::new("acl", "k").expect("a valid key");
    let limit = Limit::per_second(100).expect("a valid limit");
    let loaded = RedisStore::new(connection(&format!("redis://127.0.0.1:{port}/")).await)
        .with_clock(SystemClock)
        .acquire(&key, limit, 1, Duration::ZERO)
        .await;
    assert!(loaded.expect("decides, loading the script").is_admitted());
    let store = RedisStore::connect(&format!("redis://noeval:pw@127.0.0.1:{port}/"))
        .await
        .expect("connects");
    assert!(!store.clock().is_measured(), "the user may not EVAL");
    // Long enough for the background task to try twice more.
    for _ in 0..25 {
        let decided = store.acquire(&key, limit, 1, Duration::ZERO).await;
        assert!(decided.expect("decides by EVALSHA").is_admitted());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    redis_server::kill(server);
    let warned = clock_warnings(&logs);
    assert_eq!(warned.len(), 1, "{warned:#?}");
}

/// `connect` made its first measurement naming `burstgate:clock`, since it cannot know the
/// prefix the store is given next: a user confined to `~<prefix>:*`, as the docs advise, got a
/// warning at every start, and the store's first decisions counted local time.
#[tokio::test]
async fn connect_with_a_user_confined_to_its_prefix_measures_before_it_returns() {
    let (logs, _guard) = crate::support::logs::capture();
    let server = redis_server::spawn("").expect("a redis-server of our own");
    let port = server.port;
    admin(
        port,
        &[
            "ACL", "SETUSER", "confined", "on", ">pw", "~myapp:*", "+@all",
        ],
    );
    let store = RedisStore::connect(&format!("redis://confined:pw@127.0.0.1:{port}/"))
        .await
        .expect("connects")
        .prefix("myapp")
        .expect("a valid prefix");
    let measured = store.clock().is_measured();
    redis_server::kill(server);
    assert_eq!(clock_warnings(&logs), Vec::<String>::new());
    assert!(measured, "connect measures before it returns");
}
