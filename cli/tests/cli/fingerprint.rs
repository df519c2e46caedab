//! The fingerprints the binary prints are the application's: computed here, in another process,
//! by `BucketKey::fingerprint` under the same secret.

use burstgate::BucketKey;

use crate::support::{ENV, SECRET_VAR, app, app_fingerprints, orders, prefix, run, spend};

/// With the secret, the fingerprint printed is the library's in this process; without it, it
/// is this run's own, and the binary says so.
#[tokio::test(flavor = "multi_thread")]
async fn a_fingerprint_printed_by_the_cli_is_the_applications() {
    app_fingerprints();
    let prefix = prefix();
    let store = app(&prefix).await;
    let key = BucketKey::new("orders", "seller-11").expect("a key");
    spend(&store, &key, orders(), 2).await;
    let args = |secret: bool| {
        let mut a = vec!["--prefix", prefix.as_str()];
        if secret {
            a.extend(["--secret-env", SECRET_VAR]);
        }
        a.extend([
            "inspect",
            "orders",
            "--key",
            "seller-11",
            "--limit",
            "1/min burst 10",
            "--json",
        ]);
        a
    };
    let keyed = run(&args(true), &ENV).ok();
    let doc = keyed.json();
    assert_eq!(doc["fingerprint"], key.fingerprint());
    assert_eq!(doc["fingerprint_keyed"], true);
    assert!(keyed.stderr.is_empty(), "{keyed:?}");
    // The same in a second run: not salted per process.
    assert_eq!(
        run(&args(true), &ENV).ok().json()["fingerprint"],
        key.fingerprint()
    );

    // Another secret gives other fingerprints: the key of the fingerprint is the secret's.
    let other = run(
        &args(true),
        &[(SECRET_VAR, "another secret, sixteen bytes or more")],
    )
    .ok();
    let doc = other.json();
    assert_ne!(doc["fingerprint"], key.fingerprint());
    assert_eq!(doc["fingerprint_keyed"], true);

    let salted = run(&args(false), &ENV).ok();
    let doc = salted.json();
    assert_ne!(doc["fingerprint"], key.fingerprint());
    assert_eq!(doc["fingerprint_keyed"], false);
    assert!(
        salted
            .stderr
            .contains("note: no application secret given (--secret-env VAR): the fingerprints shown are this run's own"),
        "{salted:?}"
    );
}
