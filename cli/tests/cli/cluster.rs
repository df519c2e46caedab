//! The commands on a real Redis Cluster of three primaries: keys on every primary are listed,
//! found by fingerprint and changed, and audit streams on several primaries are merged.

use std::collections::BTreeSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use burstgate::redis;
use burstgate::{BucketKey, BucketStore, RedisStore};
use burstgate_testkit::redis_cluster;

use crate::support::{ENV, SECRET_VAR, app_fingerprints, orders, prefix, run_bare, spend};

#[tokio::test(flavor = "multi_thread")]
async fn every_command_reaches_keys_on_every_primary() {
    app_fingerprints();
    let cluster = redis_cluster::shared();
    let prefix = prefix();
    let store = RedisStore::new(cluster.connection().await)
        .prefix(&prefix)
        .expect("a valid prefix");
    let keys: Vec<BucketKey> = (0..24)
        .map(|i| BucketKey::new("orders", format!("seller-{i}")).expect("a key"))
        .collect();
    for (i, key) in keys.iter().enumerate() {
        spend(&store, key, orders(), 1 + (i % 9) as u32).await;
    }
    let owners: BTreeSet<usize> = keys
        .iter()
        .map(|k| {
            let slot = cluster.slot_of(&store.redis_key(k)).expect("a slot");
            cluster.owner_of(slot).expect("an owner")
        })
        .collect();
    assert_eq!(
        owners.len(),
        redis_cluster::PRIMARIES,
        "keys on every primary"
    );

    // One node's URL is enough; the others are found from it.
    let node = cluster.nodes[0].url();
    let args = |sub: &[&str]| -> Vec<String> {
        [
            "--cluster",
            "--redis-url",
            node.as_str(),
            "--prefix",
            prefix.as_str(),
            "--secret-env",
            SECRET_VAR,
        ]
        .iter()
        .chain(sub)
        .map(|s| (*s).to_owned())
        .collect()
    };
    let go = |sub: &[&str]| {
        let a = args(sub);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        run_bare(&a, &ENV).ok()
    };

    let doc = go(&["top", "--limit", "1/min burst 10", "-n", "100", "--json"]).json();
    assert_eq!(doc["buckets"], 24);
    let listed: BTreeSet<String> = doc["top"]
        .as_array()
        .expect("a list")
        .iter()
        .map(|r| r["fingerprint"].as_str().expect("a fp").to_owned())
        .collect();
    let expected: BTreeSet<String> = keys.iter().map(BucketKey::fingerprint).collect();
    assert_eq!(listed, expected);

    // A key on a primary other than the one named, found by fingerprint, blocked and unblocked.
    let far = keys
        .iter()
        .find(|k| {
            let slot = cluster.slot_of(&store.redis_key(k)).expect("a slot");
            cluster.owner_of(slot).expect("an owner") != 0
        })
        .expect("a key elsewhere");
    let fp = far.fingerprint();
    let limit = ["--limit", "1/min burst 10"];
    let on: Vec<&str> = ["orders", "--fingerprint", fp.as_str()]
        .into_iter()
        .chain(limit)
        .collect();
    let with = |cmd: &'static str, more: &[&'static str]| -> Vec<&str> {
        std::iter::once(cmd)
            .chain(on.iter().copied())
            .chain(more.iter().copied())
            .collect()
    };
    let doc = go(&with("block", &["--for", "10m", "--json"])).json();
    assert_eq!(doc["state"]["blocked"], true);
    let d = store
        .acquire(far, orders(), 1, Duration::ZERO)
        .await
        .expect("decides");
    assert!(d.retry_after().expect("blocked") > Duration::from_secs(590));
    let doc = go(&with("unblock", &["--json"])).json();
    assert_eq!(doc["changed"], true);
    let doc = go(&with("inspect", &["--json"])).json();
    assert_eq!(doc["state"]["blocked"], false);
    assert!(doc["state"]["ttl_ms"].as_u64().is_some());
    go(&["reset", "orders", "--fingerprint", fp.as_str()]);
    assert_eq!(
        store.peek(far, orders()).await.expect("peeks").remaining(),
        10
    );

    // Audit streams of keys on different primaries, merged by time.
    let now = u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("after")
            .as_millis(),
    )
    .expect("in range");
    let mut conn = cluster.connection().await;
    for (i, key) in keys.iter().take(6).enumerate() {
        let caller = &key.as_str()["orders:".len()..];
        let stream = format!("{prefix}:audit:v1:orders:{{{caller}}}");
        let t = now - 10_000 + 1_000 * ((i as u64 * 5) % 6);
        let _: String = redis::cmd("XADD")
            .arg(&stream)
            .arg("*")
            .arg(&[
                "t",
                &t.to_string(),
                "o",
                "admitted",
                "c",
                "1",
                "w",
                "0",
                "r",
                "3",
            ])
            .arg(&["k", &key.fingerprint(), "p", "w"])
            .query_async(&mut conn)
            .await
            .expect("XADD");
    }
    let doc = go(&["audit", "orders", "--json"]).json();
    assert_eq!(doc["streams"], 6);
    let ts: Vec<u64> = doc["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| e["t_ms"].as_u64().expect("t"))
        .collect();
    let mut sorted = ts.clone();
    sorted.sort_unstable();
    assert_eq!((ts.len(), &ts), (6, &sorted));

    // A node of the cluster without --cluster is refused, not half-served with MOVED.
    let plain = [
        "--redis-url",
        node.as_str(),
        "--prefix",
        prefix.as_str(),
        "top",
        "--limit",
        "1/min",
    ];
    let r = run_bare(&plain, &[]);
    assert_eq!(r.code, 1, "{r:?}");
    assert!(
        r.stderr
            .contains("is a node of a Redis Cluster: add --cluster"),
        "{r:?}"
    );
}
