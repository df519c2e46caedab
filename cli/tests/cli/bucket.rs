//! `inspect`, `reset`, `set`, `block` and `unblock` on buckets the application spent, under each
//! way the application stores its keys, and by fingerprint.

use std::time::{Duration, SystemTime};

use burstgate::redis::AsyncCommands;
use burstgate::{BucketKey, BucketName, BucketStore};

use crate::support::{
    ENV, SECRET_VAR, TOKEN, TOKEN_VAR, app, app_fingerprints, assert_no_secret, conn, orders,
    prefix, run, secret, spend,
};

const LIMIT: [&str; 2] = ["--limit", "1/min burst 10"];

/// A bucket spent and drained by the application, under each way it stores its key, is found
/// by the command, inspected, reset, and then admits a full burst again; neither the key, nor
/// the token, nor the secret is printed, and the fingerprint is the application's.
#[tokio::test(flavor = "multi_thread")]
async fn a_spent_bucket_is_inspected_reset_and_admits_a_full_burst() {
    app_fingerprints();
    let prefix = prefix();
    let store = app(&prefix).await;
    let name = BucketName::new("orders").expect("a name");
    let secret = secret();
    let cases: [(BucketKey, &str, Vec<&str>); 3] = [
        (
            name.key("seller:42").expect("a key"),
            "plain",
            vec!["--key", "seller:42", "--secret-env", SECRET_VAR],
        ),
        (
            name.hashed_key(TOKEN).expect("a key"),
            "hashed",
            vec![
                "--key-env",
                TOKEN_VAR,
                "--hashed",
                "--secret-env",
                SECRET_VAR,
            ],
        ),
        (
            name.keyed_key(TOKEN, &secret).expect("a key"),
            "keyed",
            vec!["--key-env", TOKEN_VAR, "--keyed-secret-env", SECRET_VAR],
        ),
    ];
    for (key, form, key_args) in cases {
        spend(&store, &key, orders(), 10).await;
        let until = SystemTime::now() + Duration::from_secs(30);
        store
            .drain_until(&key, orders(), until)
            .await
            .expect("drains");

        let args = |cmd: &'static str, json: bool| {
            let mut a = vec!["--prefix", prefix.as_str(), cmd, "orders"];
            a.extend(key_args.iter().copied());
            if cmd != "reset" {
                a.extend(LIMIT);
            }
            if json {
                a.push("--json");
            }
            a
        };
        let text = run(&args("inspect", false), &ENV).ok();
        for expected in [
            "bucket      orders\n".to_owned(),
            format!("key         {form}, fingerprint {}\n", key.fingerprint()),
            "limit       1/min burst 10\n".to_owned(),
            "remaining   0 of 10\n".to_owned(),
            "blocked     until ".to_owned(),
            "ttl         ".to_owned(),
        ] {
            assert!(text.stdout.contains(&expected), "{expected:?} in {text:?}");
        }
        assert!(text.stderr.is_empty(), "{text:?}");
        assert_no_secret(&text.all(), "seller");

        let doc = run(&args("inspect", true), &ENV).ok().json();
        assert_eq!(doc["command"], "inspect");
        assert_eq!(doc["bucket"], "orders");
        assert_eq!(doc["key_form"], form);
        assert_eq!(doc["fingerprint"], key.fingerprint());
        assert_eq!(doc["fingerprint_keyed"], true);
        let state = &doc["state"];
        assert_eq!(state["limit"], "1/min burst 10");
        assert_eq!(
            (state["remaining"].as_u64(), state["burst"].as_u64()),
            (Some(0), Some(10))
        );
        assert_eq!(state["exists"], true);
        assert_eq!(state["blocked"], true);
        let halt = state["halted_until_ms"].as_u64().expect("a halt");
        let store_halt = store
            .peek(&key, orders())
            .await
            .expect("peeks")
            .halted_until()
            .map(|t| {
                t.duration_since(SystemTime::UNIX_EPOCH)
                    .expect("after")
                    .as_millis()
            });
        assert_eq!(Some(u128::from(halt)), store_halt);
        // Drained until 30 s, the first token one period later, full nine after that.
        let next = state["next_token_in_ms"].as_u64().expect("a wait");
        assert!((85_000..=90_000).contains(&next), "{next}");
        let ttl = state["ttl_ms"].as_u64().expect("a TTL");
        assert!(ttl > state["full_in_ms"].as_u64().expect("full"), "{doc}");

        let reset = run(&args("reset", true), &ENV).ok();
        assert_no_secret(&reset.all(), "seller");
        let doc = reset.json();
        assert_eq!(
            (doc["command"].clone(), doc["existed"].clone()),
            ("reset".into(), true.into())
        );
        assert_eq!(doc["fingerprint"], key.fingerprint());
        let after = run(&args("inspect", false), &ENV).ok();
        assert!(after.stdout.contains("remaining   10 of 10\n"), "{after:?}");
        assert!(after.stdout.contains("blocked     no\n"), "{after:?}");

        // Another process of the application, with no denial cached: a full burst.
        let fresh = app(&prefix).await;
        spend(&fresh, &key, orders(), 10).await;
        let d = fresh
            .acquire(&key, orders(), 1, Duration::ZERO)
            .await
            .expect("decides");
        assert!(!d.is_admitted());
    }
}

/// `set` and `block` reach the application's bucket; a count above the burst is the store's
/// error, with a non-zero exit.
#[tokio::test(flavor = "multi_thread")]
async fn set_and_block_change_the_applications_bucket() {
    let prefix = prefix();
    let store = app(&prefix).await;
    let key = BucketKey::new("orders", "seller-7").expect("a key");
    let base = ["--prefix", prefix.as_str()];
    let on = ["orders", "--key", "seller-7", "--limit", "1/min burst 10"];
    let cmd = |sub: &[&'static str]| -> Vec<&str> {
        base.iter().chain(sub).chain(on.iter()).copied().collect()
    };

    let set = run(&cmd(&["set", "--remaining", "3"]), &[]).ok();
    assert!(
        set.stdout.contains("done        set to 3 tokens\n"),
        "{set:?}"
    );
    assert!(set.stdout.contains("remaining   3 of 10\n"), "{set:?}");
    spend(&store, &key, orders(), 3).await;
    let d = store
        .acquire(&key, orders(), 1, Duration::ZERO)
        .await
        .expect("decides");
    assert!(!d.is_admitted());

    let too_many = run(&cmd(&["set", "--remaining", "11"]), &[]);
    assert_eq!(too_many.code, 1, "{too_many:?}");
    assert_eq!(
        too_many.stderr.trim_end(),
        "error: a bucket of burst 10 cannot be set to hold 11 tokens"
    );
    assert!(too_many.stdout.is_empty());

    run(
        &[
            "--prefix",
            prefix.as_str(),
            "reset",
            "orders",
            "--key",
            "seller-7",
        ],
        &[],
    )
    .ok();
    let block = run(
        &[cmd(&["block", "--for", "1h"]), vec!["--json"]].concat(),
        &[],
    )
    .ok();
    let doc = block.json();
    assert_eq!(doc["command"], "block");
    assert_eq!(doc["state"]["remaining"], 0);
    assert_eq!(doc["state"]["blocked"], true);
    assert_eq!(doc["blocked_until_ms"], doc["state"]["halted_until_ms"]);
    let fresh = app(&prefix).await;
    let d = fresh
        .acquire(&key, orders(), 1, Duration::ZERO)
        .await
        .expect("decides");
    // An hour from when the command read the clock.
    let retry = d.retry_after().expect("denied");
    assert!(
        retry > Duration::from_secs(3_590) && retry <= Duration::from_millis(3_600_001),
        "{retry:?}"
    );
}

/// `unblock` ends a block at once and gives no tokens: the first request goes one token period
/// later, not an hour later, and not at once; on a bucket that is not blocked it changes
/// nothing.
#[tokio::test(flavor = "multi_thread")]
async fn unblock_ends_a_block_without_giving_tokens() {
    let prefix = prefix();
    let store = app(&prefix).await;
    let key = BucketKey::new("orders", "seller-8").expect("a key");
    let base = ["--prefix", prefix.as_str()];
    let on = ["orders", "--key", "seller-8", "--limit", "1/min burst 10"];
    let cmd = |sub: &[&'static str]| -> Vec<&str> {
        base.iter().chain(sub).chain(on.iter()).copied().collect()
    };
    spend(&store, &key, orders(), 4).await;
    let not_blocked = run(&[cmd(&["unblock"]), vec!["--json"]].concat(), &[])
        .ok()
        .json();
    assert_eq!(not_blocked["changed"], false);
    assert_eq!(not_blocked["state"]["remaining"], 6);

    run(&cmd(&["block", "--for", "1h"]), &[]).ok();
    let unblocked = run(&cmd(&["unblock"]), &[]).ok();
    assert!(
        unblocked.stdout.contains(
            "done        unblocked: no halt, 0 tokens now, refilling at the limit's rate\n"
        ),
        "{unblocked:?}"
    );
    assert!(
        unblocked.stdout.contains("blocked     no\n"),
        "{unblocked:?}"
    );
    let fresh = app(&prefix).await;
    let d = fresh
        .acquire(&key, orders(), 1, Duration::ZERO)
        .await
        .expect("decides");
    let retry = d.retry_after().expect("no token given");
    assert!(
        retry > Duration::from_secs(55) && retry <= Duration::from_secs(60),
        "{retry:?}"
    );
    let q = fresh.peek(&key, orders()).await.expect("peeks");
    assert_eq!(q.halted_until(), None);
}

/// A key named by the fingerprint the application logged is found among the bucket's keys
/// and changed; an unknown fingerprint, or one without the secret, is a clear error.
#[tokio::test(flavor = "multi_thread")]
async fn a_key_is_found_by_its_fingerprint() {
    app_fingerprints();
    let prefix = prefix();
    let store = app(&prefix).await;
    let keys: Vec<BucketKey> = (0..20)
        .map(|i| BucketKey::keyed("orders", format!("token-{i}"), &secret()).expect("a key"))
        .collect();
    for (i, key) in keys.iter().enumerate() {
        spend(&store, key, orders(), 1 + (i % 5) as u32).await;
    }
    // A stranger's key under the bucket's pattern, and a ticket's mark beside a bucket, are
    // passed over.
    let mut c = conn().await;
    let _: () = c
        .set(format!("{prefix}:v4:orders:{{a b}}"), "x")
        .await
        .expect("SET");
    let _: () = c
        .set(format!("{}:t:0123", store.redis_key(&keys[13])), "b")
        .await
        .expect("SET");
    let wanted = &keys[13];
    let fp = wanted.fingerprint();
    let base = ["--prefix", prefix.as_str(), "--secret-env", SECRET_VAR];
    let inspect: Vec<&str> = base
        .iter()
        .copied()
        .chain([
            "inspect",
            "orders",
            "--fingerprint",
            fp.as_str(),
            "--limit",
            "1/min burst 10",
            "--json",
        ])
        .collect();
    let doc = run(&inspect, &ENV).ok().json();
    assert_eq!(doc["key_form"], "fingerprint");
    assert_eq!(doc["fingerprint"], fp);
    assert_eq!(doc["state"]["remaining"], 6);

    let reset: Vec<&str> = base
        .iter()
        .copied()
        .chain(["reset", "orders", "--fingerprint", fp.as_str()])
        .collect();
    let text = run(&reset, &ENV).ok();
    assert!(
        text.stdout.contains(&format!(
            "key         found by its fingerprint, fingerprint {fp}\n"
        )),
        "{text:?}"
    );
    assert_eq!(
        store
            .peek(wanted, orders())
            .await
            .expect("peeks")
            .remaining(),
        10
    );
    assert_eq!(
        store
            .peek(&keys[12], orders())
            .await
            .expect("peeks")
            .remaining(),
        7
    );

    let unknown: Vec<&str> = base
        .iter()
        .copied()
        .chain(["reset", "orders", "--fingerprint", "000000000000", "--json"])
        .collect();
    let e = run(&unknown, &ENV);
    assert_eq!(e.code, 1);
    assert_eq!(e.json()["error"]["kind"], "no_such_fingerprint");
    assert!(
        e.stderr
            .contains("no key of bucket orders has fingerprint 000000000000 (20 keys scanned"),
        "{e:?}"
    );

    let no_secret = run(
        &[
            "--prefix",
            prefix.as_str(),
            "reset",
            "orders",
            "--fingerprint",
            fp.as_str(),
        ],
        &[],
    );
    assert_eq!(no_secret.code, 1);
    assert!(
        no_secret
            .stderr
            .contains("--fingerprint needs the application's secret"),
        "{no_secret:?}"
    );
}
