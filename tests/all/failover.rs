//! A `RedisStore::connect` store behind a TCP proxy (a virtual IP, a DNS name that moves) when the
//! node behind it is demoted by a failover, or stops answering without closing the connection:
//! the store replaces its connection, and the new one reaches the node that took over.
#![cfg(feature = "redis")]

use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use burstgate::{BucketKey, BucketStore, Limit, RedisStore};
use tokio::net::{TcpListener, TcpStream};

use crate::support::redis_server;

/// Forwards every new connection to the port in `target`, as a virtual IP does: connections
/// already open stay with the node they reached.
async fn proxy(target: Arc<AtomicU16>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("a free port");
    let port = listener.local_addr().expect("an address").port();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let to = target.load(Ordering::SeqCst);
            tokio::spawn(async move {
                if let Ok(mut outbound) = TcpStream::connect(("127.0.0.1", to)).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    port
}

fn limit() -> Limit {
    Limit::per_second(100_000).expect("a valid limit")
}

/// Calls until one is admitted, and how long that took.
async fn until_admitted(store: &RedisStore<redis::aio::ConnectionManager>) -> Option<Duration> {
    let key = BucketKey::new("failover", "k").expect("a valid key");
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(10) {
        if let Ok(d) = store.acquire(&key, limit(), 1, Duration::ZERO).await
            && d.is_admitted()
        {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// Two private servers, a proxy leading to the first, and a `connect` store through the proxy
/// that has made a decision: the proxy's target moves to the second server with `target`.
async fn behind_a_proxy() -> (
    redis_server::Spawned,
    redis_server::Spawned,
    Arc<AtomicU16>,
    RedisStore<redis::aio::ConnectionManager>,
) {
    let old = redis_server::spawn("").expect("a redis-server of our own");
    let new = redis_server::spawn("").expect("a redis-server of our own");
    let target = Arc::new(AtomicU16::new(old.port));
    let port = proxy(Arc::clone(&target)).await;
    let store = RedisStore::connect(&format!("redis://127.0.0.1:{port}/"))
        .await
        .expect("connects")
        .prefix(&redis_server::unique_prefix())
        .expect("a valid prefix");
    assert!(
        until_admitted(&store).await.is_some(),
        "works before the fault"
    );
    (old, new, target, store)
}

async fn admin(port: u16) -> redis::aio::MultiplexedConnection {
    redis::Client::open(format!("redis://127.0.0.1:{port}/"))
        .expect("a valid Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("a connection")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failover_every_call_fails_with_readonly() {
    let (old, new, target, store) = behind_a_proxy().await;
    // The failover: the address now leads to the new primary, and the old one is demoted.
    target.store(new.port, Ordering::SeqCst);
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(new.port)
        .query_async(&mut admin(old.port).await)
        .await
        .expect("REPLICAOF");
    let key = BucketKey::new("failover", "k").expect("a valid key");
    let first = store.acquire(&key, limit(), 1, Duration::ZERO).await;
    assert!(
        first.is_err(),
        "the demoted node refuses the write: {first:?}"
    );
    let took = until_admitted(&store).await;
    println!("failover REPLICAOF behind a moved address: admitted again after {took:?}");
    assert!(
        took.is_some_and(|t| t < Duration::from_secs(3)),
        "calls reach the new primary after {took:?}"
    );
    redis_server::kill(old);
    redis_server::kill(new);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_stops_answering_holds_the_connection_forever() {
    let (old, new, target, store) = behind_a_proxy().await;
    // The old node stops (no RST: the connection looks alive), the address moves on.
    target.store(new.port, Ordering::SeqCst);
    let stopped = std::process::Command::new("kill")
        .arg("-STOP")
        .arg(old.pid.to_string())
        .status()
        .expect("kill runs");
    assert!(stopped.success());
    let took = until_admitted(&store).await;
    let _ = std::process::Command::new("kill")
        .arg("-CONT")
        .arg(old.pid.to_string())
        .status();
    println!("failover SIGSTOP behind a moved address: admitted again after {took:?}");
    assert!(
        took.is_some_and(|t| t < Duration::from_secs(3)),
        "calls reach the node that took over after {took:?}"
    );
    redis_server::kill(old);
    redis_server::kill(new);
}

/// Calls of the measuring script (`EVAL`) node `port` has served, from `INFO commandstats`.
async fn evals_served(port: u16) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut admin(port).await)
        .await
        .expect("INFO");
    crate::support::calls_of(&info, "eval")
}

/// The store's clock used to measure on the connection it was made with, whatever the store
/// replaced it by: after a failover it kept the old node's time, or none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failover_the_clock_measures_on_the_new_primary() {
    let (old, new, target, store) = behind_a_proxy().await;
    assert!(store.clock().is_measured());
    assert_eq!(evals_served(new.port).await, 0, "nothing reached it yet");
    target.store(new.port, Ordering::SeqCst);
    let _: () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(new.port)
        .query_async(&mut admin(old.port).await)
        .await
        .expect("REPLICAOF");
    assert!(until_admitted(&store).await.is_some(), "decides again");
    // The measurement (five calls) follows the replacement at once, not at its next period
    // (10 s). The bucket script's own `EVAL`, once, after `NOSCRIPT` on the new node, is the
    // sixth.
    let started = Instant::now();
    while evals_served(new.port).await < 6 && started.elapsed() < Duration::from_secs(3) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let served = evals_served(new.port).await;
    println!(
        "clock measured on the new primary after {:?}",
        started.elapsed()
    );
    assert!(
        served >= 6,
        "the new primary served {served} EVALs, the bucket script's and the clock's"
    );
    redis_server::kill(old);
    redis_server::kill(new);
}
