//! Looks at and changes one customer's bucket in Redis: `peek`, `reset`, `set` and
//! `block-until`, the admin operations of `BucketStore` through a `RedisStore`.
//!
//! ```sh
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run -p burstgate-tools --bin admin -- \
//!     peek --bucket orders --key seller-42 --tokens 1 --interval-ms 60000 --burst 10
//! ```
//!
//! The bucket is named as the application names it: `--bucket` and the caller's key, with how
//! the application stores that key, exactly as `burstgate::BucketName` makes it:
//!
//! - by default as it is, escaped (`BucketName::key`, `BucketKey::new`);
//! - `--hashed`: its SHA-256 (`BucketName::hashed_key`, what `KeyExtractor::header` does);
//! - `--keyed-secret-env VAR`: its HMAC-SHA256 under the application's `KeySecret`, read from
//!   the environment variable `VAR` as bytes (`BucketName::keyed_key`, what
//!   `KeyExtractor::keyed_header` does).
//!
//! The key is `--key VALUE`, or `--key-env VAR` to read it from an environment variable, which
//! keeps a secret key (an API token) out of the process list and the shell's history. Neither
//! the key nor the secret is ever printed: the bucket is shown by its name and its key's
//! fingerprint, which is salted per process, so it tells keys apart within one run of this tool
//! but does not match the fingerprints in the application's logs.
//!
//! The limit is the one the application uses for the bucket, as numbers: `--tokens`,
//! `--interval-ms` and `--burst` (the burst defaults to the tokens). `peek`, `set` and
//! `block-until` need it, and show the bucket after them; `reset` needs none (a bucket forgotten
//! is full under any limit).
//!
//! - `peek`: remaining tokens of the burst, the next token, until full, the halt of a drain or
//!   block.
//! - `reset`: forgets the bucket (a `DEL`): it is full again, with no halt.
//! - `set --remaining N`: the bucket holds exactly `N` tokens now (at most the burst).
//! - `block-until --seconds S`: nothing admitted for `S` seconds, the first request at `S`.
//!
//! `--redis-url` (or `REDIS_URL`) is required; `--prefix` is the store's key prefix
//! (`burstgate` unless the application set another). What each operation does to reservations
//! already granted and to other processes' deny caches: `docs/OPERATIONS.md`, "Unblocking a
//! customer".

use std::error::Error;
use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use burstgate::{BucketKey, BucketName, BucketState, BucketStore, KeySecret, Limit, RedisStore};
use clap::builder::NonEmptyStringValueParser;
use clap::{Args, Parser, Subcommand};

/// Looks at and changes one bucket in Redis.
#[derive(Debug, Parser)]
#[command(name = "admin")]
struct Cli {
    /// The Redis the application uses.
    #[arg(long, env = "REDIS_URL", value_parser = NonEmptyStringValueParser::new())]
    redis_url: String,
    /// The store's key prefix, as the application sets it.
    #[arg(long, default_value = "burstgate")]
    prefix: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Shows what the bucket holds.
    Peek {
        #[command(flatten)]
        bucket: Bucket,
        #[command(flatten)]
        limit: LimitArgs,
    },
    /// Forgets the bucket: full again, with no halt.
    Reset {
        #[command(flatten)]
        bucket: Bucket,
    },
    /// Makes the bucket hold exactly `--remaining` tokens now.
    Set {
        #[command(flatten)]
        bucket: Bucket,
        #[command(flatten)]
        limit: LimitArgs,
        /// The tokens the bucket holds now, at most the burst.
        #[arg(long)]
        remaining: u32,
    },
    /// Admits nothing for `--seconds` seconds, and the first request then.
    BlockUntil {
        #[command(flatten)]
        bucket: Bucket,
        #[command(flatten)]
        limit: LimitArgs,
        /// How long from now.
        #[arg(long)]
        seconds: u64,
    },
}

/// The bucket, as the application names it.
#[derive(Debug, Args)]
struct Bucket {
    /// The bucket name.
    #[arg(long = "bucket")]
    name: String,
    /// The caller's key (an account, an IP address, an API key).
    #[arg(long, required_unless_present = "key_env", conflicts_with = "key_env")]
    key: Option<String>,
    /// The environment variable that holds the caller's key.
    #[arg(long, value_name = "VAR")]
    key_env: Option<String>,
    /// The application stores the key as its SHA-256 (KeyExtractor::header).
    #[arg(long, conflicts_with = "keyed_secret_env")]
    hashed: bool,
    /// The application stores the key as its HMAC under the secret in this environment
    /// variable (KeyExtractor::keyed_header).
    #[arg(long, value_name = "VAR")]
    keyed_secret_env: Option<String>,
}

/// The limit the application uses for the bucket.
#[derive(Debug, Args)]
struct LimitArgs {
    /// Tokens per interval.
    #[arg(long)]
    tokens: u32,
    /// The interval, in milliseconds.
    #[arg(long)]
    interval_ms: u64,
    /// The most tokens the bucket holds (the tokens per interval unless given).
    #[arg(long)]
    burst: Option<u32>,
}

impl LimitArgs {
    fn limit(&self) -> Result<Limit, Box<dyn Error>> {
        let limit = Limit::new(self.tokens, Duration::from_millis(self.interval_ms))?;
        Ok(match self.burst {
            Some(burst) => limit.with_burst(burst)?,
            None => limit,
        })
    }
}

/// How the application stores the key.
enum Hashing {
    Plain,
    Hashed,
    Keyed(KeySecret),
}

impl Bucket {
    /// The bucket key, as the application makes it, with what `env` returns for a variable.
    fn key(&self, env: impl Fn(&str) -> Option<String>) -> Result<BucketKey, Box<dyn Error>> {
        let value = match (&self.key, &self.key_env) {
            (Some(value), _) => value.clone(),
            (None, Some(var)) => env(var).ok_or_else(|| format!("{var} is not set"))?,
            (None, None) => return Err("a key is needed: --key or --key-env".into()),
        };
        let hashing = match &self.keyed_secret_env {
            Some(var) => {
                let secret = env(var).ok_or_else(|| format!("{var} is not set"))?;
                Hashing::Keyed(KeySecret::new(secret.as_bytes())?)
            }
            None if self.hashed => Hashing::Hashed,
            None => Hashing::Plain,
        };
        let name = BucketName::new(&self.name)?;
        Ok(match hashing {
            Hashing::Plain => name.key(value.as_bytes())?,
            Hashing::Hashed => name.hashed_key(value.as_bytes())?,
            Hashing::Keyed(secret) => name.keyed_key(value.as_bytes(), &secret)?,
        })
    }

    /// How the key is stored, in words, with nothing of the key or the secret.
    fn form(&self) -> &'static str {
        match (&self.keyed_secret_env, self.hashed) {
            (Some(_), _) => "keyed (HMAC-SHA256 under the application's secret)",
            (None, true) => "hashed (SHA-256)",
            (None, false) => "plain",
        }
    }
}

/// Runs one command on `store` and says what it did and what the bucket holds, reading
/// environment variables through `env`.
async fn run<S: BucketStore>(
    store: &S,
    command: &Command,
    env: impl Fn(&str) -> Option<String>,
) -> Result<String, Box<dyn Error>> {
    let mut out = String::new();
    let (bucket, limit) = match command {
        Command::Peek { bucket, limit } => (bucket, Some(limit)),
        Command::Reset { bucket } => (bucket, None),
        Command::Set { bucket, limit, .. } | Command::BlockUntil { bucket, limit, .. } => {
            (bucket, Some(limit))
        }
    };
    let key = bucket.key(env)?;
    let limit = limit.map(LimitArgs::limit).transpose()?;
    writeln!(out, "bucket      {}", key.bucket())?;
    writeln!(
        out,
        "key         {}, fingerprint {} (this run's: the application logs another)",
        bucket.form(),
        key.fingerprint()
    )?;
    match (command, limit) {
        (Command::Reset { .. }, _) => {
            store.reset(&key).await?;
            writeln!(out, "done        reset: full, with no halt")?;
        }
        (Command::Set { remaining, .. }, Some(limit)) => {
            store.set(&key, limit, *remaining).await?;
            writeln!(out, "done        set to {remaining} tokens")?;
        }
        (Command::BlockUntil { seconds, .. }, Some(limit)) => {
            let until = SystemTime::now() + Duration::from_secs(*seconds);
            store.block_until(&key, limit, until).await?;
            writeln!(out, "done        blocked for {seconds} s")?;
        }
        // A peek, which has its limit, and only reads.
        _ => {}
    }
    if let Some(limit) = limit {
        describe(&mut out, limit, &store.peek(&key, limit).await?)?;
    }
    Ok(out)
}

/// The bucket's state, a line each.
fn describe(out: &mut String, limit: Limit, q: &BucketState) -> std::fmt::Result {
    writeln!(
        out,
        "limit       {} per {} ms, burst {}",
        limit.tokens(),
        limit.interval().as_millis(),
        limit.burst()
    )?;
    writeln!(out, "remaining   {} of {}", q.remaining(), q.burst())?;
    writeln!(out, "next token  {}", span(q.next_token_in()))?;
    writeln!(out, "full        {}", span(q.resets_in()))?;
    let halt = match q.halted_until() {
        None => "none".to_owned(),
        Some(at) => match at.duration_since(SystemTime::now()) {
            Ok(ahead) => format!("for {}", seconds(ahead)),
            Err(behind) => format!("ended {} ago", seconds(behind.duration())),
        },
    };
    writeln!(out, "halt        {halt}")
}

fn span(d: Duration) -> String {
    if d.is_zero() {
        "now".to_owned()
    } else {
        format!("in {}", seconds(d))
    }
}

fn seconds(d: Duration) -> String {
    format!("{:.3} s", d.as_secs_f64())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let done = async {
        let store = RedisStore::connect(&cli.redis_url)
            .await?
            .prefix(&cli.prefix)?;
        run(&store, &cli.command, |var| std::env::var(var).ok()).await
    };
    match done.await {
        Ok(report) => {
            print!("{report}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use burstgate::redis::aio::MultiplexedConnection;
    use burstgate_testkit::redis_server;

    async fn store(prefix: &str) -> RedisStore<MultiplexedConnection> {
        let conn = burstgate::redis::Client::open(redis_server::url())
            .expect("a valid Redis URL")
            .get_multiplexed_async_connection()
            .await
            .expect("a connection to the test Redis");
        RedisStore::new(conn)
            .prefix(prefix)
            .expect("a valid prefix")
    }

    fn parse(args: &[&str]) -> Cli {
        let url = redis_server::url();
        let mut all = vec!["admin", "--redis-url", url.as_str()];
        all.extend_from_slice(args);
        Cli::try_parse_from(all).expect("valid arguments")
    }

    const SECRET: &str = "an application secret of 32 bytes";
    const TOKEN: &str = "Bearer sk-live-0123456789";

    fn env(var: &str) -> Option<String> {
        match var {
            "APP_KEY_SECRET" => Some(SECRET.to_owned()),
            "CUSTOMER_TOKEN" => Some(TOKEN.to_owned()),
            _ => None,
        }
    }

    const LIMIT: [&str; 6] = ["--tokens", "1", "--interval-ms", "60000", "--burst", "10"];

    /// A bucket spent by the library, under each way the application stores its key, is found
    /// by the tool, peeked, reset, and then admits a full burst; nothing of the key or the
    /// secret is printed.
    #[tokio::test]
    async fn a_spent_bucket_is_peeked_reset_and_admits_a_full_burst() {
        let prefix = redis_server::unique_prefix();
        let app = store(&prefix).await;
        let limit = Limit::per_minute(1)
            .and_then(|l| l.with_burst(10))
            .expect("a valid limit");
        let orders = BucketName::new("orders").expect("a valid name");
        let secret = KeySecret::new(SECRET).expect("a valid secret");
        let keys: [(BucketKey, Vec<&str>); 3] = [
            (
                orders.key("seller:42").expect("a key"),
                vec!["--key", "seller:42"],
            ),
            (
                orders.hashed_key(TOKEN).expect("a key"),
                vec!["--key-env", "CUSTOMER_TOKEN", "--hashed"],
            ),
            (
                orders.keyed_key(TOKEN, &secret).expect("a key"),
                vec![
                    "--key-env",
                    "CUSTOMER_TOKEN",
                    "--keyed-secret-env",
                    "APP_KEY_SECRET",
                ],
            ),
        ];
        for (key, key_args) in keys {
            for _ in 0..10 {
                let d = app
                    .acquire(&key, limit, 1, Duration::ZERO)
                    .await
                    .expect("decides");
                assert!(d.is_admitted());
            }
            let denied = app
                .acquire(&key, limit, 1, Duration::ZERO)
                .await
                .expect("decides");
            assert!(!denied.is_admitted());
            // An upstream 429 drained it too: a halt to show.
            let until = SystemTime::now() + Duration::from_secs(30);
            app.drain_until(&key, limit, until).await.expect("drains");

            let tool = store(&prefix).await;
            let peek: Vec<&str> = ["--prefix", prefix.as_str(), "peek", "--bucket", "orders"]
                .into_iter()
                .chain(key_args.clone())
                .chain(LIMIT)
                .collect();
            let cli = parse(&peek);
            let report = run(&tool, &cli.command, env).await.expect("peeks");
            assert!(report.contains("remaining   0 of 10"), "{report}");
            assert!(report.contains("halt        for "), "{report}");
            assert!(report.contains(&key.fingerprint()), "{report}");
            // Neither the key, escaped or not, nor the token, nor the secret.
            for secret_part in [
                "seller",
                "%3A42",
                "sk-live",
                "0123456789",
                "application secret",
            ] {
                assert!(!report.contains(secret_part), "{secret_part} in {report}");
            }

            let reset: Vec<&str> = ["--prefix", prefix.as_str(), "reset", "--bucket", "orders"]
                .into_iter()
                .chain(key_args.clone())
                .collect();
            let report = run(&tool, &parse(&reset).command, env)
                .await
                .expect("resets");
            assert!(report.contains("done        reset"), "{report}");
            assert!(report.contains(&key.fingerprint()), "{report}");
            let report = run(&tool, &cli.command, env).await.expect("peeks");
            assert!(report.contains("remaining   10 of 10"), "{report}");
            assert!(report.contains("halt        none"), "{report}");

            // Another process of the application, with no denial cached: a full burst.
            let fresh = store(&prefix).await;
            for left in (0..10).rev() {
                let d = fresh
                    .acquire(&key, limit, 1, Duration::ZERO)
                    .await
                    .expect("decides");
                assert!(d.is_admitted() && d.remaining() == left, "{d:?}");
            }
            assert!(
                !fresh
                    .acquire(&key, limit, 1, Duration::ZERO)
                    .await
                    .expect("decides")
                    .is_admitted()
            );
        }
    }

    /// `set` and `block-until` reach the bucket the application uses, and a bad count is the
    /// store's error.
    #[tokio::test]
    async fn set_and_block_until_change_the_applications_bucket() {
        let prefix = redis_server::unique_prefix();
        let app = store(&prefix).await;
        let limit = Limit::per_minute(1)
            .and_then(|l| l.with_burst(10))
            .expect("a valid limit");
        let key = BucketKey::new("orders", "seller-7").expect("a key");
        let tool = store(&prefix).await;
        let command = |sub: &[&str]| {
            let args: Vec<&str> = ["--prefix", prefix.as_str()]
                .into_iter()
                .chain(sub.iter().copied())
                .chain(["--bucket", "orders", "--key", "seller-7"])
                .chain(LIMIT)
                .collect();
            parse(&args).command
        };
        let report = run(&tool, &command(&["set", "--remaining", "3"]), env)
            .await
            .expect("sets");
        assert!(report.contains("remaining   3 of 10"), "{report}");
        for _ in 0..3 {
            assert!(
                app.acquire(&key, limit, 1, Duration::ZERO)
                    .await
                    .expect("decides")
                    .is_admitted()
            );
        }
        assert!(
            !app.acquire(&key, limit, 1, Duration::ZERO)
                .await
                .expect("decides")
                .is_admitted()
        );
        let too_many = run(&tool, &command(&["set", "--remaining", "11"]), env).await;
        let error = too_many.map(|_| ()).expect_err("above the burst");
        assert_eq!(
            error.to_string(),
            "a bucket of burst 10 cannot be set to hold 11 tokens"
        );

        let reset = [
            "--prefix",
            prefix.as_str(),
            "reset",
            "--bucket",
            "orders",
            "--key",
            "seller-7",
        ];
        run(&tool, &parse(&reset).command, env)
            .await
            .expect("resets");
        let report = run(&tool, &command(&["block-until", "--seconds", "3600"]), env)
            .await
            .expect("blocks");
        assert!(report.contains("remaining   0 of 10"), "{report}");
        assert!(report.contains("halt        for "), "{report}");
        let fresh = store(&prefix).await;
        let d = fresh
            .acquire(&key, limit, 1, Duration::ZERO)
            .await
            .expect("decides");
        // An hour from when the tool read the clock, to the millisecond it rounds up to.
        let retry = d.retry_after().expect("denied");
        assert!(
            retry > Duration::from_secs(3_590) && retry <= Duration::from_millis(3_600_001),
            "{retry:?}"
        );
    }

    #[test]
    fn the_arguments_say_what_is_missing() {
        let url = "redis://127.0.0.1:1/";
        let base = ["admin", "--redis-url", url, "peek", "--bucket", "orders"];
        // No key, or two.
        let no_key: Vec<&str> = base.into_iter().chain(LIMIT).collect();
        assert!(Cli::try_parse_from(no_key).is_err());
        let two: Vec<&str> = base
            .into_iter()
            .chain(["--key", "a", "--key-env", "B"])
            .chain(LIMIT)
            .collect();
        assert!(Cli::try_parse_from(two).is_err());
        // Hashed and keyed at once.
        let both: Vec<&str> = base
            .into_iter()
            .chain(["--key", "a", "--hashed", "--keyed-secret-env", "S"])
            .chain(LIMIT)
            .collect();
        assert!(Cli::try_parse_from(both).is_err());
        // Peek without a limit.
        let no_limit = [
            "admin",
            "--redis-url",
            url,
            "peek",
            "--bucket",
            "orders",
            "--key",
            "a",
        ];
        assert!(Cli::try_parse_from(no_limit).is_err());
        // Reset needs none.
        let reset = [
            "admin",
            "--redis-url",
            url,
            "reset",
            "--bucket",
            "orders",
            "--key",
            "a",
        ];
        assert!(Cli::try_parse_from(reset).is_ok());
        // A variable that is not set, or a short secret, is an error naming it, not the value.
        let cli = Cli::try_parse_from([
            "admin",
            "--redis-url",
            url,
            "reset",
            "--bucket",
            "orders",
            "--key-env",
            "NOPE",
        ])
        .expect("valid arguments");
        let Command::Reset { bucket, .. } = &cli.command else {
            unreachable!("a reset")
        };
        let e = bucket.key(env).map(|_| ()).expect_err("not set");
        assert_eq!(e.to_string(), "NOPE is not set");
    }
}
