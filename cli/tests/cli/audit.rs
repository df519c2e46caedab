//! `audit`, against streams written here in the library's audit format with `XADD`: one stream
//! per bucket key, `<prefix>:audit:v1:<bucket>:{<key>}`, fields `t o c w r k p`.

use std::time::{SystemTime, UNIX_EPOCH};

use burstgate::BucketKey;
use burstgate::redis;

use crate::support::{conn, prefix, run};

fn now_ms() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("after 1970")
            .as_millis(),
    )
    .expect("in range")
}

/// The stream of `key`, spelled out from the format rather than through the command's code:
/// the hash tag of the bucket's own key, `{<escaped key>}`.
fn stream(prefix: &str, key: &BucketKey) -> String {
    let caller = &key.as_str()[key.bucket().len() + 1..];
    format!("{prefix}:audit:v1:{}:{{{caller}}}", key.bucket())
}

/// One decision, as the library appends it.
async fn xadd(
    c: &mut redis::aio::MultiplexedConnection,
    stream: &str,
    t: u64,
    (o, cost, wait, left): (&str, u32, u64, i64),
    k: &str,
    p: &str,
) {
    let _: String = redis::cmd("XADD")
        .arg(stream)
        .arg("*")
        .arg("t")
        .arg(t)
        .arg("o")
        .arg(o)
        .arg("c")
        .arg(cost)
        .arg("w")
        .arg(wait)
        .arg("r")
        .arg(left)
        .arg("k")
        .arg(k)
        .arg("p")
        .arg(p)
        .query_async(c)
        .await
        .expect("XADD");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_trail_of_one_key_or_of_every_key_in_time_order() {
    let prefix = prefix();
    let mut c = conn().await;
    let a = BucketKey::new("orders", "seller:42").expect("a key");
    let b = BucketKey::new("orders", "seller-7").expect("a key");
    let other = BucketKey::new("search", "seller:42").expect("a key");
    let (sa, sb) = (stream(&prefix, &a), stream(&prefix, &b));
    assert_eq!(sa, format!("{prefix}:audit:v1:orders:{{seller%3A42}}"));
    let now = now_ms();
    // Out of order across streams, as processes append them.
    xadd(
        &mut c,
        &sa,
        now - 3_000,
        ("admitted", 1, 0, 9),
        "aaaaaaaaaaaa",
        "worker-1",
    )
    .await;
    xadd(
        &mut c,
        &sb,
        now - 4_000,
        ("admitted", 2, 0, 8),
        "bbbbbbbbbbbb",
        "worker-2",
    )
    .await;
    xadd(
        &mut c,
        &sa,
        now - 2_000,
        ("waited", 1, 1_500, -1),
        "aaaaaaaaaaaa",
        "worker-1",
    )
    .await;
    xadd(
        &mut c,
        &sb,
        now - 1_000,
        ("refused", 1, 0, 0),
        "bbbbbbbbbbbb",
        "worker 3\u{1b}[2J",
    )
    .await;
    // Decided two hours ago by the store's clock, appended now: outside --since 1h.
    xadd(
        &mut c,
        &sa,
        now - 7_200_000,
        ("admitted", 1, 0, 9),
        "aaaaaaaaaaaa",
        "late",
    )
    .await;
    // Another bucket, and an entry no library wrote.
    xadd(
        &mut c,
        &stream(&prefix, &other),
        now - 500,
        ("admitted", 1, 0, 1),
        "cccccccccccc",
        "x",
    )
    .await;
    let _: String = redis::cmd("XADD")
        .arg(&sa)
        .arg("*")
        .arg("note")
        .arg("by hand")
        .query_async(&mut c)
        .await
        .expect("XADD");

    let base = ["--prefix", prefix.as_str(), "audit", "orders"];
    let all: Vec<&str> = base.iter().copied().chain(["--json"]).collect();
    let doc = run(&all, &[]).ok().json();
    assert_eq!(doc["command"], "audit");
    assert_eq!(doc["streams"], 2);
    assert_eq!(doc["malformed"], 1);
    assert_eq!(doc["truncated"], false);
    let entries = doc["entries"].as_array().expect("entries");
    let seen: Vec<(u64, &str, &str)> = entries
        .iter()
        .map(|e| {
            (
                e["t_ms"].as_u64().expect("t"),
                e["outcome"].as_str().expect("o"),
                e["fingerprint"].as_str().expect("k"),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            (now - 4_000, "admitted", "bbbbbbbbbbbb"),
            (now - 3_000, "admitted", "aaaaaaaaaaaa"),
            (now - 2_000, "waited", "aaaaaaaaaaaa"),
            (now - 1_000, "refused", "bbbbbbbbbbbb"),
        ]
    );
    let waited = &entries[2];
    assert_eq!(
        (
            waited["cost"].as_u64(),
            waited["wait_ms"].as_u64(),
            waited["remaining"].as_i64()
        ),
        (Some(1), Some(1_500), Some(-1))
    );
    assert_eq!(waited["process"], "worker-1");
    assert!(waited["id"].as_str().expect("an id").contains('-'));
    assert!(waited["time"].as_str().expect("a time").ends_with('Z'));

    // One key, as text: its stream alone, the label's control characters escaped.
    let one: Vec<&str> = base.iter().copied().chain(["--key", "seller-7"]).collect();
    let text = run(&one, &[]).ok();
    let words: Vec<Vec<&str>> = text
        .stdout
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        words[1][..5],
        ["keys", "the", "key", "with", "fingerprint"],
        "{text:?}"
    );
    assert_eq!(words[3], ["entries", "2"]);
    assert_eq!(
        words[4],
        [
            "time",
            "outcome",
            "cost",
            "wait",
            "left",
            "fingerprint",
            "process"
        ]
    );
    assert_eq!(
        words[5][1..],
        ["admitted", "2", "0s", "8", "bbbbbbbbbbbb", "worker-2"]
    );
    assert_eq!(
        words[6][1..],
        [
            "refused",
            "1",
            "0s",
            "0",
            "bbbbbbbbbbbb",
            "worker",
            "3\\u{1b}[2J"
        ]
    );
    assert!(!text.stdout.contains('\u{1b}'));
    assert!(!text.all().contains("seller"), "{text:?}");

    // Two hours back finds the late entry; -n keeps the latest.
    let back: Vec<&str> = base
        .iter()
        .copied()
        .chain(["--since", "2h1m", "--json"])
        .collect();
    assert_eq!(
        run(&back, &[]).ok().json()["entries"]
            .as_array()
            .map(Vec::len),
        Some(5)
    );
    let latest: Vec<&str> = base.iter().copied().chain(["-n", "2", "--json"]).collect();
    let doc = run(&latest, &[]).ok().json();
    assert_eq!(doc["truncated"], true);
    let ts: Vec<u64> = doc["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| e["t_ms"].as_u64().expect("t"))
        .collect();
    assert_eq!(ts, [now - 2_000, now - 1_000]);

    // A bucket with no trail.
    let none = run(&["--prefix", prefix.as_str(), "audit", "reports"], &[]).ok();
    assert!(none.stdout.contains("entries     0\n"), "{none:?}");
    assert!(
        none.stderr.contains("no audit stream for bucket reports"),
        "{none:?}"
    );
}

/// A stream whose cap dropped entries within the span says so.
#[tokio::test(flavor = "multi_thread")]
async fn a_trail_cut_by_the_streams_cap_says_so() {
    let prefix = prefix();
    let mut c = conn().await;
    let key = BucketKey::new("orders", "seller-9").expect("a key");
    let s = stream(&prefix, &key);
    for i in 0..4 {
        xadd(
            &mut c,
            &s,
            now_ms(),
            ("admitted", 1, 0, 9 - i),
            "aaaaaaaaaaaa",
            "w",
        )
        .await;
    }
    let _: u64 = redis::cmd("XTRIM")
        .arg(&s)
        .arg("MAXLEN")
        .arg(2)
        .query_async(&mut c)
        .await
        .expect("XTRIM");
    let doc = run(
        &[
            "--prefix",
            prefix.as_str(),
            "audit",
            "orders",
            "--key",
            "seller-9",
            "--json",
        ],
        &[],
    )
    .ok()
    .json();
    assert_eq!(doc["trimmed"], true);
    assert_eq!(doc["entries"].as_array().map(Vec::len), Some(2));
}

/// The trail as the library writes it, read back: an application's audited decisions on a
/// bucket, shown in order with their outcomes, the key's fingerprint and the process's label.
#[tokio::test(flavor = "multi_thread")]
async fn the_trail_the_library_writes_is_the_one_it_reads() {
    use std::num::NonZeroU32;

    use burstgate::{Audit, BucketStore, Take};

    crate::support::app_fingerprints();
    let prefix = prefix();
    let store = crate::support::app(&prefix).await;
    let key = BucketKey::new("orders", "seller-42").expect("a key");
    let audit = Audit::new(NonZeroU32::new(100).expect("not zero")).process("worker-1@host-a");
    let limit = "1/min burst 2".parse().expect("a limit");
    for _ in 0..3 {
        let take = Take::new(&key, limit, 1).audited(&audit);
        let _ = store
            .acquire_all(&[take], std::time::Duration::ZERO)
            .await
            .expect("decides");
    }
    let out = run(
        &[
            "--prefix",
            &prefix,
            "--json",
            "audit",
            "orders",
            "--key",
            "seller-42",
            "--since",
            "10m",
        ],
        &[],
    )
    .ok()
    .json();
    let entries = out["entries"].as_array().expect("entries");
    let outcomes: Vec<&str> = entries
        .iter()
        .map(|e| e["outcome"].as_str().expect("an outcome"))
        .collect();
    assert_eq!(outcomes, ["admitted", "admitted", "refused"], "{out}");
    for e in entries {
        assert_eq!(e["fingerprint"], key.fingerprint(), "{out}");
        assert_eq!(e["process"], "worker-1@host-a", "{out}");
    }
}
