//! What the suites share: a private Redis, the binary, and the application's side.

use std::process::Command;
use std::sync::{Once, OnceLock};
use std::time::Duration;

use burstgate::redis::aio::MultiplexedConnection;
use burstgate::{BucketKey, BucketStore, KeySecret, Limit, RedisStore};
use burstgate_testkit::redis_server;

/// The application's `KeySecret`, given to the binary in [`SECRET_VAR`].
pub(crate) const SECRET: &str = "an application secret of 32 bytes";
pub(crate) const SECRET_VAR: &str = "APP_KEY_SECRET";
/// A customer's API token, given to the binary in [`TOKEN_VAR`].
pub(crate) const TOKEN: &str = "Bearer sk-live-0123456789";
pub(crate) const TOKEN_VAR: &str = "CUSTOMER_TOKEN";

/// The URL of this binary's own `redis-server`, started on first use and stopped when the
/// binary exits; never a shared one, whatever `REDIS_URL` says.
pub(crate) fn url() -> String {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        let server = redis_server::spawn("").expect("a private redis-server");
        redis_server::wait_for_pong(server.port, Duration::from_secs(10)).expect("PONG");
        format!("redis://127.0.0.1:{}/", server.port)
    })
    .clone()
}

/// A prefix no other test uses.
pub(crate) fn prefix() -> String {
    redis_server::unique_prefix()
}

/// Keys this process's fingerprints as an application given [`SECRET`] does.
pub(crate) fn app_fingerprints() {
    static KEYED: Once = Once::new();
    KEYED.call_once(|| secret().key_fingerprints());
}

pub(crate) fn secret() -> KeySecret {
    KeySecret::new(SECRET).expect("a valid secret")
}

/// "1 per minute, burst 10", the orders endpoint's limit.
pub(crate) fn orders() -> Limit {
    "1/min burst 10".parse().expect("a valid limit")
}

pub(crate) async fn conn() -> MultiplexedConnection {
    burstgate::redis::Client::open(url())
        .expect("a valid URL")
        .get_multiplexed_async_connection()
        .await
        .expect("a connection to the private Redis")
}

/// The application's store under `prefix`.
pub(crate) async fn app(prefix: &str) -> RedisStore<MultiplexedConnection> {
    RedisStore::new(conn().await)
        .prefix(prefix)
        .expect("a valid prefix")
}

/// Spends `n` tokens of `key` at once, as the application would.
pub(crate) async fn spend<S: BucketStore>(store: &S, key: &BucketKey, limit: Limit, n: u32) {
    for _ in 0..n {
        let d = store
            .acquire(key, limit, 1, Duration::ZERO)
            .await
            .expect("decides");
        assert!(d.is_admitted(), "{d:?}");
    }
}

/// What a run of the binary gave.
#[derive(Debug)]
pub(crate) struct Run {
    pub(crate) code: i32,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

impl Run {
    /// The JSON document it printed.
    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {self:?}"))
    }

    /// Succeeded, or panics with what it printed.
    pub(crate) fn ok(self) -> Self {
        assert_eq!(self.code, 0, "{self:?}");
        self
    }

    /// Everything it printed.
    pub(crate) fn all(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }
}

/// Runs `burstgate --redis-url <url> <args>` with `env` added to an environment that holds no
/// `REDIS_URL`.
pub(crate) fn run_at(url: &str, args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut all = vec!["--redis-url", url];
    all.extend_from_slice(args);
    run_bare(&all, env)
}

/// [`run_at`] on the private Redis.
pub(crate) fn run(args: &[&str], env: &[(&str, &str)]) -> Run {
    run_at(&url(), args, env)
}

/// Runs `burstgate <args>` as they are.
pub(crate) fn run_bare(args: &[&str], env: &[(&str, &str)]) -> Run {
    let out = Command::new(env!("CARGO_BIN_EXE_burstgate"))
        .env_remove("REDIS_URL")
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("the binary runs");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The environment an operator gives the binary: the customer's token and the secret.
pub(crate) const ENV: [(&str, &str); 2] = [(TOKEN_VAR, TOKEN), (SECRET_VAR, SECRET)];

/// Asserts that nothing of the key, the token or the secret is in `text`.
pub(crate) fn assert_no_secret(text: &str, key: &str) {
    for part in [
        key,
        "sk-live",
        "0123456789",
        "application secret",
        "32 bytes",
    ] {
        assert!(!text.contains(part), "{part:?} printed: {text}");
    }
}
