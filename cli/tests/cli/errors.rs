//! Bad input and failures: each a clear message, a non-zero exit, no panic, and nothing secret.

use burstgate::BucketKey;
use burstgate::redis::{self, AsyncCommands};
use burstgate_testkit::redis_server;

use crate::support::{ENV, SECRET_VAR, TOKEN_VAR, app, conn, prefix, run, run_at, run_bare};

const INSPECT: [&str; 5] = ["inspect", "orders", "--key", "seller-1", "--limit"];

fn inspect(limit: &str) -> Vec<&str> {
    INSPECT.iter().copied().chain([limit]).collect()
}

fn no_panic(run: &crate::support::Run) {
    assert!(!run.stderr.contains("panicked"), "{run:?}");
}

/// Arguments clap refuses exit with 2 and say which argument; the rest exit with 1.
#[test]
fn bad_arguments_say_what_is_wrong() {
    for (args, says) in [
        (
            inspect("1/mn"),
            "invalid value '1/mn' for '--limit <LIMIT>'",
        ),
        (inspect("0/min"), "--limit <LIMIT>"),
        (
            [
                "block", "orders", "--key", "a", "--limit", "1/min", "--for", "10",
            ]
            .to_vec(),
            "has a number without a unit",
        ),
        (
            ["inspect", "new orders", "--key", "a", "--limit", "1/min"].to_vec(),
            "invalid bucket name",
        ),
        (
            [
                "inspect",
                "orders",
                "--key",
                "a",
                "--key-env",
                "B",
                "--limit",
                "1/min",
            ]
            .to_vec(),
            "cannot be used with",
        ),
        (
            [
                "reset",
                "orders",
                "--key",
                "a",
                "--hashed",
                "--keyed-secret-env",
                "S",
            ]
            .to_vec(),
            "cannot be used with",
        ),
        (["top"].to_vec(), "--limit"),
    ] {
        let r = run(&args, &[]);
        assert_eq!(r.code, 2, "{args:?}: {r:?}");
        assert!(r.stderr.contains(says), "{args:?}: {says:?} in {r:?}");
        no_panic(&r);
    }
}

#[test]
fn a_missing_key_or_variable_is_named() {
    for (args, env, says, kind) in [
        (
            ["inspect", "orders", "--limit", "1/min"].to_vec(),
            vec![],
            "error: which key? give --key VALUE, --key-env VAR or --fingerprint FP",
            "bad_key",
        ),
        (
            ["reset", "orders", "--key-env", "NOPE"].to_vec(),
            vec![],
            "error: the environment variable NOPE is not set",
            "env",
        ),
        (
            [
                "reset",
                "orders",
                "--key-env",
                TOKEN_VAR,
                "--keyed-secret-env",
                SECRET_VAR,
            ]
            .to_vec(),
            vec![(TOKEN_VAR, "t"), (SECRET_VAR, "short")],
            "error: the secret in APP_KEY_SECRET: a key secret must be at least 16 bytes",
            "bad_secret",
        ),
        (
            ["reset", "orders", "--fingerprint", "xyz"].to_vec(),
            vec![],
            "error: a fingerprint is 12 hex digits",
            "bad_fingerprint",
        ),
        (
            ["--prefix", "my app", "reset", "orders", "--key", "a"].to_vec(),
            vec![],
            "error: invalid key prefix",
            "bad_key",
        ),
    ] {
        let r = run(&args, &env);
        assert_eq!(r.code, 1, "{args:?}: {r:?}");
        assert!(r.stderr.starts_with(says), "{says:?} in {r:?}");
        assert!(r.stdout.is_empty(), "{r:?}");
        let with_json: Vec<&str> = args.iter().copied().chain(["--json"]).collect();
        let j = run(&with_json, &env);
        assert_eq!(j.code, 1, "{j:?}");
        assert_eq!(j.json()["error"]["kind"], kind, "{j:?}");
        no_panic(&r);
        assert!(!r.all().contains("short"), "{r:?}");
    }
}

/// An unreachable Redis is named by host and port, never by its URL's password; no URL at all,
/// or several without `--cluster`, are errors too.
#[test]
fn an_unreachable_redis_is_named_without_its_password() {
    let port = redis_server::free_port().expect("a free port");
    let url = format!("redis://:hunter2-password@127.0.0.1:{port}/");
    let r = run_at(&url, &inspect("1/min"), &[]);
    assert_eq!(r.code, 1, "{r:?}");
    assert!(
        r.stderr.starts_with(&format!(
            "error: could not connect to Redis at 127.0.0.1:{port}: "
        )),
        "{r:?}"
    );
    assert!(!r.all().contains("hunter2"), "{r:?}");
    no_panic(&r);

    let r = run_bare(&inspect("1/min"), &[]);
    assert_eq!(r.code, 1);
    assert_eq!(
        r.stderr.trim_end(),
        "error: no Redis: give --redis-url URL or set REDIS_URL"
    );
    let r = run_bare(&inspect("1/min"), &[("REDIS_URL", url.as_str())]);
    assert!(r.stderr.contains("could not connect"), "{r:?}");
    // The URL of the environment is not shown by --help either.
    let help = run_bare(&["--help"], &[("REDIS_URL", url.as_str())]);
    assert_eq!(help.code, 0);
    assert!(!help.all().contains("hunter2"), "{help:?}");

    let two: Vec<&str> = [
        "--redis-url",
        "redis://127.0.0.1:1/",
        "--redis-url",
        "redis://127.0.0.1:2/",
    ]
    .into_iter()
    .chain(inspect("1/min"))
    .collect();
    let r = run_bare(&two, &[]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains(
            "2 Redis URLs given: several URLs name the nodes of a Redis Cluster, add --cluster"
        ),
        "{r:?}"
    );

    let r = run_at("http://:hunter2@example/", &inspect("1/min"), &[]);
    assert_eq!(r.code, 1);
    assert!(
        r.stderr
            .starts_with("error: Redis URL 1 is not one redis-rs takes"),
        "{r:?}"
    );
    assert!(!r.all().contains("hunter2"), "{r:?}");
}

/// A key of the wrong type is named by bucket and fingerprint, never by the key, under every
/// command that reads it.
#[tokio::test(flavor = "multi_thread")]
async fn a_key_of_the_wrong_type_is_a_clear_error() {
    let prefix = prefix();
    let store = app(&prefix).await;
    let key = BucketKey::new("orders", "seller-1").expect("a key");
    let mut c = conn().await;
    let _: () = c.hset(store.redis_key(&key), "t", "1").await.expect("HSET");
    let stream = format!("{prefix}:audit:v1:orders:{{seller-1}}");
    let _: () = c.set(&stream, "not a stream").await.expect("SET");

    let base = ["--prefix", prefix.as_str()];
    for (sub, says) in [
        (
            inspect("1/min burst 10"),
            "holds a value that is not a bucket",
        ),
        (
            [
                "block", "orders", "--key", "seller-1", "--limit", "1/min", "--for", "1m",
            ]
            .to_vec(),
            "holds a value that is not a bucket",
        ),
        (
            ["audit", "orders", "--key", "seller-1"].to_vec(),
            "the audit stream of bucket orders, key fingerprint ",
        ),
    ] {
        let args: Vec<&str> = base
            .iter()
            .copied()
            .chain(sub.iter().copied())
            .chain(["--json"])
            .collect();
        let r = run(&args, &[]);
        assert_eq!(r.code, 1, "{r:?}");
        assert!(r.stderr.contains(says), "{says:?} in {r:?}");
        assert_eq!(r.json()["error"]["kind"], "wrong_type", "{r:?}");
        assert!(!r.all().contains("seller"), "{r:?}");
        no_panic(&r);
    }
    // A reset forgets whatever the key holds.
    let args: Vec<&str> = base
        .iter()
        .copied()
        .chain(["reset", "orders", "--key", "seller-1"])
        .collect();
    run(&args, &ENV).ok();
    let exists: bool = redis::cmd("EXISTS")
        .arg(store.redis_key(&key))
        .query_async(&mut c)
        .await
        .expect("EXISTS");
    assert!(!exists);
}
