//! A server whose Redis goes away, on real sockets and a real `redis-server` of the test's own,
//! killed and started again on the same port: by default the layer answers from buckets in its
//! own memory, each request within the store's timeout, never a 503, and decides on Redis
//! again once Redis is back. Twice: the README's server (its rule, on a `RedisStore`), and
//! `examples/axum_server.rs` run as its own process with `REDIS_URL`.
#![cfg(all(feature = "tower", feature = "redis"))]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use axum::Router;
use axum::http::HeaderName;
use axum::routing::get;
use burstgate::layer::{KeyExtractor, Rule};
use burstgate::{KeySecret, Limit, RateLimitLayer, RedisStore};
use burstgate_testkit::redis_server::{self, Spawned};
use tokio::time::Instant;

/// The longest one request may take while Redis is away: the store's timeout (250 ms) for the
/// calls before its breaker opens, with room for a loaded machine.
const BOUND: Duration = Duration::from_secs(1);

/// One request for `key`: its status and how long it took.
async fn get_for(http: &reqwest::Client, addr: SocketAddr, key: &str) -> (u16, Duration) {
    let started = Instant::now();
    let res = http
        .get(format!("http://{addr}/"))
        .header("x-api-key", key)
        .send()
        .await
        .expect("the server answers");
    (res.status().as_u16(), started.elapsed())
}

/// How many keys Redis holds on `port`.
async fn keys_in(port: u16) -> usize {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).expect("a URL");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("a connection to the test's Redis");
    redis::cmd("DBSIZE")
        .query_async(&mut conn)
        .await
        .expect("DBSIZE")
}

/// Kills the server's Redis, checks that `burst` requests of a new key are admitted and the next
/// refused with 429, each within [`BOUND`] and none answered 503; starts Redis again on the same
/// port, and checks that a new key's request is decided there within ten seconds.
async fn rides_out_an_outage(addr: SocketAddr, redis: Spawned, burst: usize) {
    let http = reqwest::Client::new();
    assert_eq!(get_for(&http, addr, "before").await.0, 200);
    assert!(keys_in(redis.port).await >= 1, "decided on Redis");

    redis_server::kill(redis);
    let mut statuses = Vec::new();
    let mut slowest = Duration::ZERO;
    for _ in 0..burst + 2 {
        let (status, took) = get_for(&http, addr, "during").await;
        assert!(took < BOUND, "a request took {took:?} while Redis was away");
        slowest = slowest.max(took);
        statuses.push(status);
    }
    let mut expected = vec![200; burst];
    expected.extend([429, 429]);
    assert_eq!(statuses, expected, "the fallback's burst, then its 429s");

    let back = redis_server::spawn_on(redis.port, "").expect("Redis again on the same port");
    let restarted = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut n = 0;
    loop {
        n += 1;
        let (status, _) = get_for(&http, addr, &format!("after-{n}")).await;
        assert_ne!(status, 503, "no 503 while Redis comes back");
        if keys_in(back.port).await >= 1 {
            eprintln!(
                "Redis away: {statuses:?}, slowest {slowest:?}; back on Redis {:?} after it \
                 returned ({n} requests)",
                restarted.elapsed()
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still not deciding on Redis ten seconds after it came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    redis_server::kill(back);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_server_answers_from_memory_while_redis_is_away() {
    let redis = redis_server::spawn("").expect("a redis-server of the test's own");
    let store = RedisStore::connect(&format!("redis://127.0.0.1:{}/", redis.port))
        .await
        .expect("a store on the test's Redis")
        .prefix("readme")
        .expect("a prefix");
    // The README's rule, on Redis.
    let per_key = KeyExtractor::keyed_header(
        HeaderName::from_static("x-api-key"),
        KeySecret::new("at least 16 bytes, from your configuration").expect("a secret"),
    );
    let limit = Limit::per_second(1)
        .and_then(|l| l.with_burst(3))
        .expect("a limit");
    let layer =
        RateLimitLayer::new(store).rule(Rule::new("per-key", limit, per_key).expect("a rule"));
    let app = Router::new()
        .route("/", get(|| async { "hello" }))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a free port");
    let addr = listener.local_addr().expect("an address");
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    rides_out_an_outage(addr, redis, 3).await;
    server.abort();
}

/// The example's binary, which `cargo test` builds beside the test binaries.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    // target/<profile>/deps/<test binary> -> target/<profile>/examples/<name>
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test binary in target/<profile>/deps");
    let path = dir.join("examples").join(name);
    assert!(
        path.exists(),
        "{} is missing: build it with `cargo test --all-features` (which builds the examples) \
         or `cargo build --example {name} --all-features`",
        path.display()
    );
    path
}

/// The example server, stopped when dropped.
struct Example(Child);

impl Drop for Example {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_axum_example_answers_from_memory_while_redis_is_away() {
    let redis = redis_server::spawn("").expect("a redis-server of the test's own");
    let mut child = Command::new(example("axum_server"))
        .env("BIND", "127.0.0.1:0")
        .env("RATE", "1")
        .env("BURST", "3")
        .env("REDIS_URL", format!("redis://127.0.0.1:{}/", redis.port))
        .env_remove("METRICS_BIND")
        .env_remove("SHADOW")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the example starts");
    let stdout = child.stdout.take().expect("its output");
    let example = Example(child);
    // "listening on http://127.0.0.1:PORT, store: ..."
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).map(|_| line)
    })
    .await
    .expect("the reader")
    .expect("a line from the example");
    let addr: SocketAddr = line
        .strip_prefix("listening on http://")
        .and_then(|rest| rest.split(',').next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no address in the example's first line: {line:?}"));

    rides_out_an_outage(addr, redis, 3).await;
    drop(example);
}
