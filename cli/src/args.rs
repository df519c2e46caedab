//! The command line: global options, the key options every bucket command shares, and the
//! subcommands.

use std::time::Duration;

use burstgate::{BucketName, Limit};
use clap::{Args, Parser, Subcommand};

use crate::span;

/// Looks at and changes the token buckets a burstgate application keeps in Redis, lists the
/// busiest, and reads their audit trail. Names buckets as the application does: a bucket name
/// and the caller's key, stored as the application stores it. Never prints a key or a secret:
/// a key is shown by its fingerprint, which matches the application's logs when given the
/// application's secret.
#[derive(Debug, Parser)]
#[command(name = "burstgate", version, max_term_width = 100)]
pub(crate) struct Cli {
    #[command(flatten)]
    pub(crate) global: Global,
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// Where the buckets are, and how to print them.
#[derive(Debug, Args)]
pub(crate) struct Global {
    /// The application's Redis: redis://[user:password@]host[:port][/db], or rediss:// for TLS.
    /// With --cluster, a node of the Cluster; repeat it to name more than one.
    #[arg(
        long = "redis-url",
        value_name = "URL",
        env = "REDIS_URL",
        hide_env_values = true,
        global = true
    )]
    pub(crate) redis_url: Vec<String>,
    /// The URLs are nodes of a Redis Cluster: the others, and which owns which key, are found
    /// from them.
    #[arg(long, global = true)]
    pub(crate) cluster: bool,
    /// The store's key prefix, as the application sets it (`RedisStore::prefix`).
    #[arg(long, default_value = "burstgate", global = true)]
    pub(crate) prefix: String,
    /// The environment variable holding the application's KeySecret (its bytes, as given to
    /// `KeySecret::new`), so that fingerprints match the application's logs. Defaults to
    /// --keyed-secret-env's.
    #[arg(long, value_name = "VAR", global = true)]
    pub(crate) secret_env: Option<String>,
    /// Print one JSON document instead of text (fields in the README).
    #[arg(long, global = true)]
    pub(crate) json: bool,
    /// How long to wait for Redis: connecting, and each call.
    #[arg(long, value_name = "SPAN", default_value = "5s", value_parser = span::parse, global = true)]
    pub(crate) timeout: Duration,
}

/// The caller's key, as the application stores it, or the fingerprint it logs.
#[derive(Debug, Args, Clone, Default)]
#[command(next_help_heading = "The key")]
pub(crate) struct KeyArgs {
    /// The caller's key, as the application is given it (an account, an IP address, an API
    /// key).
    #[arg(long, value_name = "VALUE", conflicts_with_all = ["key_env", "fingerprint"])]
    pub(crate) key: Option<String>,
    /// The environment variable holding the caller's key: keeps a secret key out of the
    /// process list and the shell's history.
    #[arg(long, value_name = "VAR", conflicts_with = "fingerprint")]
    pub(crate) key_env: Option<String>,
    /// The key whose fingerprint the application logged (12 hex digits), found among the
    /// bucket's keys in Redis. Needs the application's secret.
    #[arg(long, value_name = "FP")]
    pub(crate) fingerprint: Option<String>,
    /// The application stores the key as its SHA-256 (`KeyExtractor::header`,
    /// `BucketKey::hashed`).
    #[arg(long, conflicts_with_all = ["keyed_secret_env", "fingerprint"])]
    pub(crate) hashed: bool,
    /// The application stores the key as its HMAC-SHA256 under the KeySecret held in this
    /// environment variable (`KeyExtractor::keyed_header`, `BucketKey::keyed`); it keys the
    /// fingerprints too.
    #[arg(long, value_name = "VAR")]
    pub(crate) keyed_secret_env: Option<String>,
}

impl KeyArgs {
    /// Whether any way to name the key was given.
    pub(crate) fn is_given(&self) -> bool {
        self.key.is_some() || self.key_env.is_some() || self.fingerprint.is_some()
    }
}

/// The limit the application gives the bucket.
#[derive(Debug, Args)]
pub(crate) struct LimitArg {
    /// The bucket's limit, as the application's limit text: "1/min burst 10", "50/s".
    #[arg(long, value_name = "LIMIT", value_parser = parse_limit)]
    pub(crate) limit: Limit,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// What a bucket holds: remaining tokens, the next token, full again, blocked until, the
    /// key's TTL and its fingerprint.
    Inspect {
        /// The bucket name, as the application's rule or route names it.
        #[arg(value_parser = parse_bucket)]
        bucket: BucketName,
        #[command(flatten)]
        key: KeyArgs,
        #[command(flatten)]
        limit: LimitArg,
    },
    /// Forgets a bucket: full again, with no halt (a DEL of its key).
    Reset {
        /// The bucket name.
        #[arg(value_parser = parse_bucket)]
        bucket: BucketName,
        #[command(flatten)]
        key: KeyArgs,
    },
    /// Makes a bucket hold exactly N tokens now, refilling from now, with no halt.
    Set {
        /// The bucket name.
        #[arg(value_parser = parse_bucket)]
        bucket: BucketName,
        #[command(flatten)]
        key: KeyArgs,
        #[command(flatten)]
        limit: LimitArg,
        /// The tokens the bucket holds now, at most the burst.
        #[arg(long, value_name = "N")]
        remaining: u32,
    },
    /// Admits nothing for a span, and a request of one token when it ends.
    Block {
        /// The bucket name.
        #[arg(value_parser = parse_bucket)]
        bucket: BucketName,
        #[command(flatten)]
        key: KeyArgs,
        #[command(flatten)]
        limit: LimitArg,
        /// How long from now: 30s, 10m, 1h, 2d.
        #[arg(long = "for", value_name = "SPAN", value_parser = span::parse)]
        span: Duration,
    },
    /// Ends a block, or an upstream's drain, now, giving no tokens: the bucket refills at its
    /// rate from now.
    Unblock {
        /// The bucket name.
        #[arg(value_parser = parse_bucket)]
        bucket: BucketName,
        #[command(flatten)]
        key: KeyArgs,
        #[command(flatten)]
        limit: LimitArg,
    },
    /// The busiest buckets under the prefix, fewest tokens (or most debt) first, by bucket and
    /// fingerprint.
    Top {
        /// Only this bucket's keys.
        #[arg(long, value_parser = parse_bucket)]
        bucket: Option<BucketName>,
        /// The limit of the buckets listed: LIMIT for all of them, or BUCKET=LIMIT for one
        /// bucket (repeat it for several); buckets with none are counted, not listed.
        #[arg(long = "limit", value_name = "[BUCKET=]LIMIT", required = true, value_parser = parse_bucket_limit)]
        limits: Vec<(Option<BucketName>, Limit)>,
        /// How many to list.
        #[arg(short = 'n', long = "count", value_name = "N", default_value_t = 20)]
        count: usize,
    },
    /// A bucket's audit trail: the decisions the application recorded, oldest first, for one
    /// key or for every key of the bucket.
    Audit {
        /// The bucket name.
        #[arg(value_parser = parse_bucket)]
        bucket: BucketName,
        #[command(flatten)]
        key: KeyArgs,
        /// How far back: 30s, 10m, 1h, 2d.
        #[arg(long, value_name = "SPAN", default_value = "1h", value_parser = span::parse)]
        since: Duration,
        /// At most this many entries, the latest.
        #[arg(short = 'n', long = "count", value_name = "N", default_value_t = 1000)]
        count: usize,
    },
}

fn parse_bucket(text: &str) -> Result<BucketName, String> {
    BucketName::new(text).map_err(|e| e.to_string())
}

fn parse_limit(text: &str) -> Result<Limit, String> {
    text.parse::<Limit>().map_err(|e| e.to_string())
}

/// `LIMIT` or `BUCKET=LIMIT`: no limit text holds a `=`.
fn parse_bucket_limit(text: &str) -> Result<(Option<BucketName>, Limit), String> {
    match text.split_once('=') {
        Some((bucket, limit)) => Ok((Some(parse_bucket(bucket.trim())?), parse_limit(limit)?)),
        None => Ok((None, parse_limit(text)?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn top_takes_one_limit_or_one_per_bucket() {
        let (bucket, limit) = parse_bucket_limit("orders=1/min burst 10").expect("parses");
        assert_eq!(bucket.as_ref().map(BucketName::as_str), Some("orders"));
        assert_eq!(limit.to_string(), "1/min burst 10");
        let (bucket, limit) = parse_bucket_limit("50/s").expect("parses");
        assert!(bucket.is_none());
        assert_eq!(limit.to_string(), "50/s");
        assert!(parse_bucket_limit("new orders=1/min").is_err());
        assert!(parse_bucket_limit("orders=1/mn").is_err());
    }
}
