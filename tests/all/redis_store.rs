//! What only the Redis store has: its key layout and TTL, script reloading, wrong-type keys and
//! marks, connection kinds and failures. The shared behaviour is in `conformance.rs`.
#![cfg(feature = "redis")]

use std::time::Duration;

use burstgate::{BucketKey, BucketStore, Claim, Limit, ManualClock, RedisStore, StoreError};
use redis::AsyncCommands;
use redis::aio::{ConnectionManager, MultiplexedConnection};

use crate::support::{START, ZERO, redis_server};

async fn conn() -> MultiplexedConnection {
    redis::Client::open(redis_server::url())
        .expect("a valid Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("a connection to the test Redis")
}

fn orders() -> Limit {
    Limit::per_minute(1)
        .and_then(|l| l.with_burst(10))
        .expect("a valid limit")
}

#[tokio::test]
async fn a_bucket_is_one_string_under_a_versioned_prefix_with_a_refill_ttl() {
    let prefix = redis_server::unique_prefix();
    let clock = ManualClock::new(START);
    let store = RedisStore::new(conn().await)
        .prefix(&prefix)
        .expect("a valid prefix")
        .with_clock(clock.clone());
    let key = BucketKey::new("orders", "seller:1").expect("a valid key");
    let redis_key = format!("{prefix}:v4:orders:{{seller%3A1}}");
    assert_eq!(store.redis_key(&key), redis_key);

    assert!(
        store
            .acquire(&key, orders(), 3, ZERO)
            .await
            .expect("decides")
            .is_admitted()
    );
    let mut c = conn().await;
    let kind: String = redis::cmd("TYPE")
        .arg(&redis_key)
        .query_async(&mut c)
        .await
        .expect("TYPE");
    assert_eq!(kind, "string");
    // `t`, `ts` and `keep`, each an f64, little-endian. Three tokens refill in three minutes;
    // the key is needed until then plus one interval, and kept one interval longer, so that
    // the writes of that interval can leave its expiry alone.
    let value: Vec<u8> = c.get(&redis_key).await.expect("GET");
    let expected: Vec<u8> = [7.0, 1_700_000_000_000.0, 1_700_000_300_000.0_f64]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(value, expected);
    let pttl: i64 = c.pttl(&redis_key).await.expect("PTTL");
    assert!((299_000..=300_000).contains(&pttl), "{pttl}");

    // A write whose bucket is full again within the kept time keeps the expiry (KEEPTTL): the
    // key, made persistent here, stays so.
    let _: bool = c.persist(&redis_key).await.expect("PERSIST");
    let d = store
        .acquire(&key, orders(), 1, ZERO)
        .await
        .expect("decides");
    assert!(d.is_admitted());
    let pttl: i64 = c.pttl(&redis_key).await.expect("PTTL");
    assert_eq!(
        pttl, -1,
        "a write within the kept time must keep the expiry"
    );
    // One that needs longer sets a new one: six more tokens take six minutes to refill.
    let d = store
        .acquire(&key, orders(), 6, ZERO)
        .await
        .expect("decides");
    assert!(d.is_admitted());
    let pttl: i64 = c.pttl(&redis_key).await.expect("PTTL");
    assert!((719_000..=720_000).contains(&pttl), "{pttl}");

    // A plain denial writes nothing.
    let _: bool = c.persist(&redis_key).await.expect("PERSIST");
    let d = store
        .acquire(&key, orders(), 1, ZERO)
        .await
        .expect("decides");
    assert!(!d.is_admitted());
    let pttl: i64 = c.pttl(&redis_key).await.expect("PTTL");
    assert_eq!(pttl, -1, "a denial must not write");
    let value: Vec<u8> = c.get(&redis_key).await.expect("GET");
    assert_eq!(value.len(), 24);

    // An expired bucket is a full one.
    let _: () = c.del(&redis_key).await.expect("DEL");
    let q = store.peek(&key, orders()).await.expect("peeks");
    assert_eq!(q.remaining(), 10);
}

#[tokio::test]
async fn the_script_is_loaded_again_after_script_flush() {
    // SCRIPT FLUSH empties the script cache of the whole server: on a server of its own, so the
    // tests that count the commands reaching the shared one never see it reload.
    let server = redis_server::spawn("").expect("a redis-server of our own");
    let url = format!("redis://127.0.0.1:{}/", server.port);
    let conn = || async {
        redis::Client::open(url.as_str())
            .expect("a valid Redis URL")
            .get_multiplexed_async_connection()
            .await
            .expect("a connection to our redis-server")
    };
    let store = RedisStore::new(conn().await)
        .prefix(&redis_server::unique_prefix())
        .expect("a valid prefix");
    let key = BucketKey::new("flush", "a").expect("a valid key");
    assert!(
        store
            .acquire(&key, orders(), 1, ZERO)
            .await
            .expect("decides")
            .is_admitted()
    );
    let mut c = conn().await;
    let _: () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut c)
        .await
        .expect("FLUSH");
    let d = store
        .acquire(&key, orders(), 1, ZERO)
        .await
        .expect("decides after NOSCRIPT");
    assert_eq!(d.remaining(), 8);
    redis_server::kill(server);
}

#[tokio::test]
async fn a_wrong_type_error_names_the_key_by_fingerprint_never_in_clear() {
    let store = RedisStore::new(conn().await)
        .prefix(&redis_server::unique_prefix())
        .expect("a valid prefix");
    let mut c = conn().await;
    // A hash (what format 1 stored), a list, and a string that is not a bucket.
    let hash = BucketKey::new("typed", "hash").expect("a valid key");
    let _: () = c
        .hset_multiple(store.redis_key(&hash), &[("t", "7"), ("ts", "1")])
        .await
        .expect("HSET");
    let list = BucketKey::new("typed", "list").expect("a valid key");
    let _: () = c
        .rpush(store.redis_key(&list), "not a bucket")
        .await
        .expect("RPUSH");
    let string = BucketKey::new("typed", "string").expect("a valid key");
    let _: () = c
        .set(store.redis_key(&string), "not a bucket")
        .await
        .expect("SET");
    for key in [&hash, &list, &string] {
        let redis_key = store.redis_key(key);
        let dump: Vec<u8> = redis::cmd("DUMP")
            .arg(&redis_key)
            .query_async(&mut c)
            .await
            .expect("DUMP");
        match store.acquire(key, orders(), 1, ZERO).await {
            Err(StoreError::WrongType {
                bucket,
                fingerprint,
            }) => {
                assert_eq!(bucket, key.bucket());
                assert_eq!(fingerprint, key.fingerprint());
                // The message names the key without showing it, nor the Redis key holding it.
                let shown = StoreError::WrongType {
                    bucket,
                    fingerprint: fingerprint.clone(),
                }
                .to_string();
                assert!(shown.contains(fingerprint.as_str()), "{shown}");
                assert!(!shown.contains(key.as_str()), "{shown}");
                assert!(!shown.contains(&redis_key), "{shown}");
            }
            other => panic!("expected WrongType for {redis_key}, got {other:?}"),
        }
        assert!(matches!(
            store.peek(key, orders()).await,
            Err(StoreError::WrongType { .. })
        ));
        assert!(matches!(
            store
                .refund(
                    key,
                    orders(),
                    burstgate::Reservation::new(1, std::time::SystemTime::now())
                )
                .await,
            Err(StoreError::WrongType { .. })
        ));
        assert!(matches!(
            store.lower_to(key, orders(), 0).await,
            Err(StoreError::WrongType { .. })
        ));
        // The value is untouched.
        let after: Vec<u8> = redis::cmd("DUMP")
            .arg(&redis_key)
            .query_async(&mut c)
            .await
            .expect("DUMP");
        assert_eq!(after, dump, "{redis_key} changed");
    }
}

/// A one-time mark's key that holds a value someone else wrote, of any type, or a mark spent by
/// a build that wrote no bookings (`1`), counts as spent: the claim is refused, not an error,
/// and the value is left as it was.
#[tokio::test]
async fn a_mark_someone_else_wrote_counts_as_spent_and_is_left_alone() {
    let store = RedisStore::new(conn().await)
        .prefix(&redis_server::unique_prefix())
        .expect("a valid prefix");
    let mut c = conn().await;
    let key = BucketKey::new("marks", "seller-1").expect("a valid key");
    let mark = format!("{}:t:nonce-1", store.redis_key(&key));
    let _: () = c.rpush(&mark, "not a mark").await.expect("RPUSH");
    let until = std::time::SystemTime::now() + Duration::from_secs(60);
    assert_eq!(store.claim(&key, "nonce-1").await.ok(), Some(Claim::Spent));
    store.book(&key, "nonce-1", until).await.expect("books");
    assert_eq!(store.claim(&key, "nonce-1").await.ok(), Some(Claim::Spent));
    let kept: Vec<String> = c.lrange(&mark, 0, -1).await.expect("LRANGE");
    assert_eq!(kept, ["not a mark"]);
    let old = format!("{}:t:nonce-0", store.redis_key(&key));
    let _: () = c.set(&old, "1").await.expect("SET");
    assert_eq!(store.claim(&key, "nonce-0").await.ok(), Some(Claim::Spent));
    let kept: String = c.get(&old).await.expect("GET");
    assert_eq!(kept, "1");
    // A mark of its own, beside it, is spent once.
    store.book(&key, "nonce-2", until).await.expect("books");
    assert_eq!(store.claim(&key, "nonce-2").await.ok(), Some(Claim::First));
    assert_eq!(store.claim(&key, "nonce-2").await.ok(), Some(Claim::Spent));
}

/// A mark is one string beside its bucket, `b` when booked and `s` once spent, kept until the
/// time it was booked for: spending it leaves its expiry alone. Lost (deleted here, as a flush
/// or a restart without persistence would), or expired on Redis's clock, it is missing.
#[tokio::test]
async fn a_mark_keeps_its_expiry_when_spent_and_is_missing_once_lost_or_expired() {
    let store = RedisStore::new(conn().await)
        .prefix(&redis_server::unique_prefix())
        .expect("a valid prefix");
    let mut c = conn().await;
    let key = BucketKey::new("marks", "seller-1").expect("a valid key");
    let mark = |id: &str| format!("{}:t:{id}", store.redis_key(&key));
    let until = std::time::SystemTime::now() + Duration::from_secs(60);

    store.book(&key, "a", until).await.expect("books");
    let booked: String = c.get(mark("a")).await.expect("GET");
    assert_eq!(booked, "b");
    let ttl: i64 = c.pttl(mark("a")).await.expect("PTTL");
    // The deadline is rounded up to the next whole millisecond.
    assert!(ttl > 58_000 && ttl <= 60_001, "{ttl}");
    assert_eq!(store.claim(&key, "a").await.ok(), Some(Claim::First));
    let spent: String = c.get(mark("a")).await.expect("GET");
    assert_eq!(spent, "s");
    let kept: i64 = c.pttl(mark("a")).await.expect("PTTL");
    assert!(kept > 58_000 && kept <= ttl, "{kept} after {ttl}");

    store.book(&key, "b", until).await.expect("books");
    let _: () = c.del(mark("b")).await.expect("DEL");
    assert_eq!(store.claim(&key, "b").await.ok(), Some(Claim::Missing));

    let soon = std::time::SystemTime::now() + Duration::from_millis(50);
    store.book(&key, "c", soon).await.expect("books");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(store.claim(&key, "c").await.ok(), Some(Claim::Missing));
    // A claim writes nothing where it finds nothing.
    let exists: bool = c.exists(mark("b")).await.expect("EXISTS");
    assert!(!exists);
}

#[tokio::test]
async fn a_lost_connection_is_a_backend_error_with_its_cause() {
    let mut store_conn = conn().await;
    let id: i64 = redis::cmd("CLIENT")
        .arg("ID")
        .query_async(&mut store_conn)
        .await
        .expect("ID");
    let store = RedisStore::new(store_conn)
        .prefix(&redis_server::unique_prefix())
        .expect("a valid prefix");
    let mut c = conn().await;
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(id)
        .query_async(&mut c)
        .await
        .expect("KILL");
    let key = BucketKey::new("lost", "a").expect("a valid key");
    let e = store.acquire(&key, orders(), 1, ZERO).await;
    match e {
        Err(StoreError::Backend(b)) => {
            let source = std::error::Error::source(&b);
            assert!(source.is_some(), "the redis error is the source");
        }
        other => panic!("expected a backend error, got {other:?}"),
    }
}

#[tokio::test]
async fn a_connection_manager_reconnects_by_itself() {
    let client = redis::Client::open(redis_server::url()).expect("a valid Redis URL");
    let manager = ConnectionManager::new(client)
        .await
        .expect("a connection manager");
    let store = RedisStore::new(manager.clone())
        .prefix(&redis_server::unique_prefix())
        .expect("a valid prefix");
    let key = BucketKey::new("managed", "a").expect("a valid key");
    assert!(
        store
            .acquire(&key, orders(), 1, ZERO)
            .await
            .expect("decides")
            .is_admitted()
    );
    let mut m = manager.clone();
    let id: i64 = redis::cmd("CLIENT")
        .arg("ID")
        .query_async(&mut m)
        .await
        .expect("ID");
    let mut c = conn().await;
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(id)
        .query_async(&mut c)
        .await
        .expect("KILL");
    // The call that meets the dead socket may fail; within a few tries the manager is back.
    let mut decided = None;
    for _ in 0..50 {
        if let Ok(d) = store.acquire(&key, orders(), 1, ZERO).await {
            decided = Some(d);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let d = decided.expect("the manager reconnected");
    assert!(d.remaining() <= 8);
}

#[test]
fn a_cluster_connection_fits_the_store() {
    // Compile-time: the store takes a cluster connection as it is.
    fn build(conn: redis::cluster_async::ClusterConnection) -> impl BucketStore {
        RedisStore::new(conn)
    }
    let _ = build;
}

#[test]
fn debug_output_shows_no_connection() {
    let shown = format!(
        "{:?}",
        RedisStore::new(NoConnection)
            .prefix("app")
            .expect("a valid prefix")
    );
    assert!(
        shown.contains("\"app\"") && !shown.contains("Connection"),
        "{shown}"
    );
}

#[test]
fn bad_prefixes_are_refused() {
    use burstgate::{InvalidKey, InvalidName};
    let at = |index, byte| InvalidName::Character { index, byte };
    for (bad, why) in [
        ("", InvalidName::Empty),
        ("a:b", at(1, b':')),
        ("a{b}", at(1, b'{')),
        (&"p".repeat(65), InvalidName::TooLong { len: 65 }),
    ] {
        let e = RedisStore::new(NoConnection).prefix(bad).map(drop);
        assert_eq!(e, Err(InvalidKey::Prefix(why)), "{bad:?}");
    }
}

use crate::support::failing_connection::FailingConnection as NoConnection;

/// A request on several buckets where one key holds something else, or a value no script
/// wrote: refused whole, the error naming that bucket, and no other bucket touched.
#[tokio::test]
async fn a_foreign_value_at_one_of_several_keys_refuses_the_request_and_names_its_bucket() {
    let prefix = redis_server::unique_prefix();
    let store = RedisStore::new(conn().await)
        .prefix(&prefix)
        .expect("a valid prefix")
        .with_clock(ManualClock::new(START));
    let (e, a) = (
        BucketKey::new("orders", "seller-9").expect("a valid key"),
        BucketKey::new("account", "seller-9").expect("a valid key"),
    );
    let both = [
        burstgate::Take::new(&e, orders(), 1),
        burstgate::Take::new(&a, orders(), 1),
    ];
    let mut c = conn().await;
    let _: () = c.hset(store.redis_key(&a), "t", "1").await.expect("HSET");
    let refused = store.acquire_all(&both, ZERO).await;
    assert!(
        matches!(&refused, Err(StoreError::WrongType { bucket, .. }) if bucket == "account"),
        "{refused:?}"
    );
    let _: () = c.del(store.redis_key(&a)).await.expect("DEL");
    let nan = [f64::NAN, START as f64, START as f64]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect::<Vec<u8>>();
    let _: () = c.set(store.redis_key(&a), nan).await.expect("SET");
    let refused = store.acquire_all(&both, ZERO).await;
    assert!(
        matches!(&refused, Err(StoreError::CorruptBucket { bucket, .. }) if bucket == "account"),
        "{refused:?}"
    );
    let untouched: Option<Vec<u8>> = c.get(store.redis_key(&e)).await.expect("GET");
    assert_eq!(untouched, None, "the other bucket was never written");
}
