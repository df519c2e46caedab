//! What can go wrong after the arguments parsed, each with a message that says what to fix and
//! names no secret: keys and secrets never, URLs by host and port only.

use std::fmt;

use burstgate::redis::RedisError;
use burstgate::{InvalidKey, StoreError};

/// A command that could not be carried out. Every one exits with status 1 (clap's own usage
/// errors exit with 2).
#[derive(Debug)]
pub(crate) enum CliError {
    /// Neither `--redis-url` nor `REDIS_URL`.
    NoRedisUrl,
    /// Several URLs, which only a Cluster takes.
    SeveralUrls { count: usize },
    /// A URL redis-rs does not take; the URL itself is not repeated, as it may hold a password.
    BadUrl { index: usize },
    /// A `rediss://` URL in a build without TLS.
    TlsNotBuilt,
    /// Redis could not be reached, or refused the connection.
    Connect { addr: String, source: RedisError },
    /// An environment variable named by an option is not set.
    EnvNotSet { var: String },
    /// An environment variable named by an option is empty.
    EnvEmpty { var: String },
    /// A secret the application's `KeySecret` would refuse.
    Secret { var: String, source: InvalidKey },
    /// No key named, for a command on one bucket.
    NoKey,
    /// A bucket name, key or prefix the library refuses.
    Key(InvalidKey),
    /// `--fingerprint` that is not 12 hex digits.
    BadFingerprint,
    /// `--fingerprint` without the application's secret: this run's fingerprints are its own.
    FingerprintNeedsSecret,
    /// No key of the bucket has the fingerprint.
    NoSuchFingerprint {
        bucket: String,
        fingerprint: String,
        scanned: usize,
    },
    /// Several keys of the bucket share the fingerprint (48 bits: rare, not impossible).
    AmbiguousFingerprint {
        bucket: String,
        fingerprint: String,
        matches: usize,
    },
    /// What the store answered.
    Store(StoreError),
    /// A key under the prefix holds something the command cannot read.
    WrongType { what: String },
    /// Redis answered a command with an error, or not at all.
    Redis {
        doing: &'static str,
        source: RedisError,
    },
    /// Redis answered with something the command did not expect.
    Reply { doing: &'static str, what: String },
}

impl CliError {
    /// A stable name for the error, for `--json`.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Self::NoRedisUrl | Self::SeveralUrls { .. } | Self::BadUrl { .. } => "bad_url",
            Self::TlsNotBuilt => "tls_not_built",
            Self::Connect { .. } => "connect",
            Self::EnvNotSet { .. } | Self::EnvEmpty { .. } => "env",
            Self::Secret { .. } => "bad_secret",
            Self::NoKey | Self::Key(_) => "bad_key",
            Self::BadFingerprint => "bad_fingerprint",
            Self::FingerprintNeedsSecret => "fingerprint_needs_secret",
            Self::NoSuchFingerprint { .. } => "no_such_fingerprint",
            Self::AmbiguousFingerprint { .. } => "ambiguous_fingerprint",
            Self::Store(StoreError::WrongType { .. }) | Self::WrongType { .. } => "wrong_type",
            Self::Store(_) => "store",
            Self::Redis { .. } | Self::Reply { .. } => "redis",
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoRedisUrl => f.write_str("no Redis: give --redis-url URL or set REDIS_URL"),
            Self::SeveralUrls { count } => write!(
                f,
                "{count} Redis URLs given: several URLs name the nodes of a Redis Cluster, add --cluster"
            ),
            Self::BadUrl { index } => write!(
                f,
                "Redis URL {} is not one redis-rs takes (redis://[user:password@]host[:port][/db], or rediss:// for TLS)",
                index + 1
            ),
            Self::TlsNotBuilt => f.write_str(
                "a rediss:// URL needs TLS, which this build left out: install with the `tls` feature",
            ),
            Self::Connect { addr, source } => {
                write!(f, "could not connect to Redis at {addr}: {source}")
            }
            Self::EnvNotSet { var } => write!(f, "the environment variable {var} is not set"),
            Self::EnvEmpty { var } => write!(f, "the environment variable {var} is empty"),
            Self::Secret { var, source } => write!(f, "the secret in {var}: {source}"),
            Self::NoKey => f.write_str(
                "which key? give --key VALUE, --key-env VAR or --fingerprint FP",
            ),
            Self::Key(e) => write!(f, "{e}"),
            Self::BadFingerprint => {
                f.write_str("a fingerprint is 12 hex digits, as the application's logs show them")
            }
            Self::FingerprintNeedsSecret => f.write_str(
                "--fingerprint needs the application's secret (--secret-env or --keyed-secret-env): \
                 without it this run's fingerprints are its own and match nothing the application logged",
            ),
            Self::NoSuchFingerprint {
                bucket,
                fingerprint,
                scanned,
            } => write!(
                f,
                "no key of bucket {bucket} has fingerprint {fingerprint} ({scanned} keys scanned; a \
                 bucket unused for a while is full and has no key, and a secret other than the \
                 application's gives other fingerprints)"
            ),
            Self::AmbiguousFingerprint {
                bucket,
                fingerprint,
                matches,
            } => write!(
                f,
                "{matches} keys of bucket {bucket} have fingerprint {fingerprint}: name the key instead"
            ),
            Self::Store(e) => write!(f, "{e}"),
            Self::WrongType { what } => write!(f, "{what}"),
            Self::Redis { doing, source } => write!(f, "Redis failed {doing}: {source}"),
            Self::Reply { doing, what } => write!(f, "unexpected reply from Redis {doing}: {what}"),
        }
    }
}

impl std::error::Error for CliError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Connect { source, .. } | Self::Redis { source, .. } => Some(source),
            Self::Secret { source, .. } => Some(source),
            Self::Key(e) => Some(e),
            Self::Store(e) => Some(e),
            _ => None,
        }
    }
}

impl From<StoreError> for CliError {
    fn from(e: StoreError) -> Self {
        Self::Store(e)
    }
}

impl From<InvalidKey> for CliError {
    fn from(e: InvalidKey) -> Self {
        Self::Key(e)
    }
}

/// A Redis error while `doing` something: a key of the wrong type is named by what it is for,
/// never by the key.
pub(crate) fn redis(
    doing: &'static str,
    what: impl FnOnce() -> String,
) -> impl FnOnce(RedisError) -> CliError {
    move |source| {
        if source.code() == Some("WRONGTYPE") {
            CliError::WrongType {
                what: format!("{} holds something else (WRONGTYPE)", what()),
            }
        } else {
            CliError::Redis { doing, source }
        }
    }
}
