//! `top`: the buckets with the fewest tokens first, debt before emptiness, by bucket and
//! fingerprint, each under its own limit.

use std::time::Duration;

use burstgate::{BucketKey, BucketStore, Limit};

use crate::support::{ENV, SECRET_VAR, app, app_fingerprints, orders, prefix, run, spend};

#[tokio::test(flavor = "multi_thread")]
async fn the_busiest_buckets_come_first_by_fingerprint() {
    app_fingerprints();
    let prefix = prefix();
    let store = app(&prefix).await;
    let search: Limit = "5/s".parse().expect("a limit");
    let key = |bucket: &str, who: &str| BucketKey::new(bucket, who).expect("a key");
    // seller-1 spent its burst and holds two reservations: in debt. seller-2 is empty,
    // seller-3 spent five, seller-4 one; a search key spent four of five; a reports key has no
    // limit given.
    spend(&store, &key("orders", "seller-1"), orders(), 10).await;
    for _ in 0..2 {
        let d = store
            .acquire(
                &key("orders", "seller-1"),
                orders(),
                1,
                Duration::from_secs(600),
            )
            .await
            .expect("decides");
        assert!(d.is_admitted() && d.wait() > Duration::ZERO);
    }
    spend(&store, &key("orders", "seller-2"), orders(), 10).await;
    spend(&store, &key("orders", "seller-3"), orders(), 5).await;
    spend(&store, &key("orders", "seller-4"), orders(), 1).await;
    spend(&store, &key("search", "seller-1"), search, 4).await;
    spend(&store, &key("reports", "seller-1"), orders(), 1).await;

    let base = [
        "--prefix",
        prefix.as_str(),
        "--secret-env",
        SECRET_VAR,
        "top",
    ];
    let limits = ["--limit", "orders=1/min burst 10", "--limit", "search=5/s"];
    let args: Vec<&str> = base
        .iter()
        .chain(&limits)
        .chain(&["--json"])
        .copied()
        .collect();
    let doc = run(&args, &ENV).ok().json();
    assert_eq!(doc["command"], "top");
    assert_eq!(doc["buckets"], 5);
    assert_eq!(doc["without_limit"], serde_json::json!(["reports"]));
    let rows = doc["top"].as_array().expect("a list");
    let order: Vec<(String, String)> = rows
        .iter()
        .map(|r| {
            (
                r["bucket"].as_str().expect("a name").to_owned(),
                r["fingerprint"].as_str().expect("a fp").to_owned(),
            )
        })
        .collect();
    let fp = |bucket: &str, who: &str| (bucket.to_owned(), key(bucket, who).fingerprint());
    assert_eq!(
        order,
        [
            fp("orders", "seller-1"),
            fp("orders", "seller-2"),
            fp("search", "seller-1"),
            fp("orders", "seller-3"),
            fp("orders", "seller-4"),
        ]
    );
    let debt = rows[0]["tokens"].as_f64().expect("tokens");
    assert!((-2.01..=-1.9).contains(&debt), "{debt}");
    assert_eq!(rows[0]["remaining"], 0);
    assert_eq!(rows[2]["limit"], "5/s");

    // As text, the first two, and no key anywhere.
    let args: Vec<&str> = base
        .iter()
        .chain(&limits)
        .chain(&["-n", "2"])
        .copied()
        .collect();
    let text = run(&args, &ENV).ok();
    let lines: Vec<&str> = text.stdout.lines().collect();
    assert_eq!(lines.len(), 4, "{text:?}");
    assert!(
        lines[0].starts_with(&format!("buckets under prefix {prefix}: 5, the 2 with")),
        "{text:?}"
    );
    assert!(
        lines[1].starts_with("#  bucket  fingerprint   remaining  tokens"),
        "{text:?}"
    );
    assert!(
        lines[2].starts_with(&format!("1  orders  {}  0/10", fp("orders", "seller-1").1)),
        "{text:?}"
    );
    assert!(!text.all().contains("seller"), "{text:?}");
    assert!(
        text.stderr
            .contains("not listed, for want of a --limit: the keys of reports"),
        "{text:?}"
    );

    // One bucket, one limit for all.
    let args = [
        "--prefix",
        prefix.as_str(),
        "top",
        "--bucket",
        "search",
        "--limit",
        "5/s",
        "--json",
    ];
    let doc = run(&args, &[]).ok().json();
    assert_eq!(doc["buckets"], 1);
    assert_eq!(doc["fingerprint_keyed"], false);
}
