//! The commands `docs/OPERATIONS.md` shows are real: every `$ burstgate` line of its text blocks
//! runs, in a shell, against a Redis prepared as the text says, and prints what the block shows,
//! but for the words that vary from run to run (times, spans, counts, fingerprints).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use burstgate::redis;
use burstgate::{BucketKey, BucketStore, Limit};

use crate::support::{SECRET, SECRET_VAR, app, app_fingerprints, conn, orders, spend, url};

/// One command of a transcript, and what the text shows it printing.
#[derive(Debug)]
struct Step {
    command: String,
    shown: Vec<String>,
}

/// The transcripts of `text`: each text block whose first line is a `$ burstgate` command.
fn transcripts(text: &str) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut in_block = false;
    let mut transcript = false;
    for line in text.lines() {
        if line.starts_with("```") {
            in_block = !in_block && line == "```text";
            transcript = false;
            continue;
        }
        if !in_block {
            continue;
        }
        if let Some(command) = line.strip_prefix("$ ") {
            transcript = command.starts_with("burstgate ");
            if transcript {
                steps.push(Step {
                    command: command.to_owned(),
                    shown: Vec::new(),
                });
            }
        } else if transcript && let Some(step) = steps.last_mut() {
            step.shown.push(line.to_owned());
        }
    }
    steps
}

/// The words of `line` that do not vary: every word holding a digit, and every 12-hex-digit
/// fingerprint, becomes `#`, and a run of such words one `#`.
fn shape(line: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for word in line.split_whitespace() {
        let fingerprint = word.len() == 12 && word.bytes().all(|b| b.is_ascii_hexdigit());
        if word.bytes().any(|b| b.is_ascii_digit()) || fingerprint {
            if out.last().map(String::as_str) != Some("#") {
                out.push("#".to_owned());
            }
        } else {
            out.push(word.to_owned());
        }
    }
    out
}

/// The state the text describes, under the prefix `myapp` of the private Redis: seller-42 has
/// just spent its burst; seller-7 has spent its own and holds two reservations; an account has
/// spent 40 of its searches; and the orders bucket's trail holds four decisions.
async fn prepare() {
    app_fingerprints();
    let mut c = conn().await;
    let old: Vec<String> = redis::cmd("KEYS")
        .arg("myapp:*")
        .query_async(&mut c)
        .await
        .expect("KEYS");
    if !old.is_empty() {
        let _: u64 = redis::cmd("DEL")
            .arg(&old)
            .query_async(&mut c)
            .await
            .expect("DEL");
    }
    let store = app("myapp").await;
    let key = |bucket: &str, who: &str| BucketKey::new(bucket, who).expect("a key");
    spend(&store, &key("orders", "seller-42"), orders(), 10).await;
    spend(&store, &key("orders", "seller-7"), orders(), 10).await;
    for _ in 0..2 {
        let d = store
            .acquire(
                &key("orders", "seller-7"),
                orders(),
                1,
                Duration::from_secs(600),
            )
            .await
            .expect("decides");
        assert!(d.is_admitted());
    }
    let search: Limit = "100/h".parse().expect("a limit");
    spend(&store, &key("search", "seller-42"), search, 40).await;

    let now = u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("after")
            .as_millis(),
    )
    .expect("in range");
    for (who, ago, o, cost, wait, left, p) in [
        ("seller-42", 250_000, "admitted", 1, 0, 9, "worker-1@host-a"),
        ("seller-7", 150_000, "admitted", 2, 0, 0, "worker-2@host-b"),
        (
            "seller-7",
            120_000,
            "waited",
            1,
            48_750,
            -1,
            "worker-2@host-b",
        ),
        ("seller-7", 60_000, "refused", 1, 0, 0, "worker-1@host-a"),
    ] {
        let k = key("orders", who);
        let _: String = redis::cmd("XADD")
            .arg(format!("myapp:audit:v1:orders:{{{who}}}"))
            .arg("*")
            .arg(&[
                "t",
                &(now - ago).to_string(),
                "o",
                o,
                "c",
                &cost.to_string(),
            ])
            .arg(&["w", &wait.to_string(), "r", &left.to_string()])
            .arg(&["k", &k.fingerprint(), "p", p])
            .query_async(&mut c)
            .await
            .expect("XADD");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_operations_guide_shows_what_the_command_prints() {
    let guide = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/OPERATIONS.md");
    let text = std::fs::read_to_string(&guide).expect("docs/OPERATIONS.md");
    let steps = transcripts(&text);
    let commands: Vec<&str> = steps
        .iter()
        .map(|s| s.command.split_whitespace().nth(3).unwrap_or_default())
        .collect();
    for shown in [
        "inspect", "block", "unblock", "reset", "set", "top", "audit",
    ] {
        assert!(
            steps
                .iter()
                .any(|s| s.command.split_whitespace().any(|w| w == shown)),
            "the guide shows no {shown}: {commands:?}"
        );
    }
    prepare().await;

    let binary = Path::new(env!("CARGO_BIN_EXE_burstgate"));
    let dir = binary.parent().expect("the binary's directory");
    let path = format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    for step in &steps {
        let out = Command::new("sh")
            .arg("-c")
            .arg(&step.command)
            .env("PATH", &path)
            .env("REDIS_URL", url())
            .env(SECRET_VAR, SECRET)
            .output()
            .expect("sh runs");
        let printed = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let fails = step.shown.first().is_some_and(|l| l.starts_with("error: "));
        assert_eq!(
            out.status.code(),
            Some(if fails { 1 } else { 0 }),
            "{}\n{printed}",
            step.command
        );
        let got: Vec<Vec<String>> = printed.lines().map(shape).collect();
        let want: Vec<Vec<String>> = step.shown.iter().map(|l| shape(l)).collect();
        assert_eq!(got, want, "{}\nprinted:\n{printed}", step.command);
    }
}

#[test]
fn shapes_leave_out_what_varies() {
    assert_eq!(
        shape("next token  in 9m 58.212s"),
        ["next", "token", "in", "#"]
    );
    assert_eq!(shape("remaining   0 of 10"), ["remaining", "#", "of", "#"]);
    assert_eq!(
        shape("key         plain, fingerprint abcdefabcdef"),
        ["key", "plain,", "fingerprint", "#"]
    );
}
