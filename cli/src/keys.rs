//! Keys as the application makes them: from the caller's key and how the application stores it,
//! or found in Redis by the fingerprint the application logged; the secrets that key them and
//! their fingerprints; and the layout of the store's Redis keys, learned from the store itself.

use burstgate::redis::aio::ConnectionLike;
use burstgate::{BucketKey, BucketName, KeySecret, RedisStore};

use crate::args::KeyArgs;
use crate::connect::Conn;
use crate::error::CliError;

/// How the application stores the caller's key, in words for the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Form {
    /// Escaped, as `BucketKey::new` stores it.
    Plain,
    /// Its SHA-256.
    Hashed,
    /// Its HMAC-SHA256 under the application's secret.
    Keyed,
    /// Found in Redis by its fingerprint.
    Fingerprint,
}

impl Form {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Plain => "plain",
            Self::Hashed => "hashed",
            Self::Keyed => "keyed",
            Self::Fingerprint => "fingerprint",
        }
    }
}

/// The bytes of the environment variable `var`: a key or a secret, which stays off the command
/// line. Neither empty nor unset.
pub(crate) fn env_bytes(var: &str) -> Result<Vec<u8>, CliError> {
    let value = std::env::var_os(var).ok_or_else(|| CliError::EnvNotSet {
        var: var.to_owned(),
    })?;
    if value.is_empty() {
        return Err(CliError::EnvEmpty {
            var: var.to_owned(),
        });
    }
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStringExt;
        Ok(value.into_vec())
    }
    #[cfg(not(unix))]
    {
        Ok(value.to_string_lossy().into_owned().into_bytes())
    }
}

/// The secret in `var`, as the application's `KeySecret`.
fn secret(var: &str) -> Result<KeySecret, CliError> {
    KeySecret::new(env_bytes(var)?).map_err(|source| CliError::Secret {
        var: var.to_owned(),
        source,
    })
}

/// Keys this process's fingerprints with the application's secret, `--secret-env`'s or else
/// `--keyed-secret-env`'s, as `KeyExtractor::keyed_header` keys the application's with the
/// secret it is given. Returns whether it did: without a secret, fingerprints are salted for
/// this run and match nothing the application logged.
pub(crate) fn key_fingerprints(
    secret_env: Option<&str>,
    key: Option<&KeyArgs>,
) -> Result<bool, CliError> {
    let var = secret_env.or_else(|| key.and_then(|k| k.keyed_secret_env.as_deref()));
    match var {
        Some(var) => {
            secret(var)?.key_fingerprints();
            Ok(true)
        }
        None => Ok(false),
    }
}

/// The bucket key the application makes for `args` in `bucket`, and how it is stored; `None`
/// when `args` name no key, or name it by a fingerprint (see [`find`]).
pub(crate) fn from_args(
    bucket: &BucketName,
    args: &KeyArgs,
) -> Result<Option<(BucketKey, Form)>, CliError> {
    let value = match (&args.key, &args.key_env) {
        (Some(value), _) => value.as_bytes().to_vec(),
        (None, Some(var)) => env_bytes(var)?,
        (None, None) => return Ok(None),
    };
    Ok(Some(match (&args.keyed_secret_env, args.hashed) {
        (Some(var), _) => (bucket.keyed_key(&value, &secret(var)?)?, Form::Keyed),
        (None, true) => (bucket.hashed_key(&value)?, Form::Hashed),
        (None, false) => (bucket.key(&value)?, Form::Plain),
    }))
}

/// `text` as a fingerprint: 12 hex digits, in lowercase as the library writes them.
pub(crate) fn fingerprint(text: &str) -> Result<String, CliError> {
    let fp = text.trim().to_ascii_lowercase();
    if fp.len() == 12 && fp.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(fp)
    } else {
        Err(CliError::BadFingerprint)
    }
}

/// The key of `bucket` whose fingerprint is `fp`, among the keys `scheme` finds in Redis.
pub(crate) async fn find(
    conn: &Conn,
    scheme: &Scheme,
    bucket: &BucketName,
    fp: &str,
) -> Result<BucketKey, CliError> {
    let (keys, _) = conn.scan(&scheme.pattern(Some(bucket))).await?;
    let scanned = keys.len();
    let mut found: Vec<BucketKey> = keys
        .iter()
        .filter_map(|k| scheme.parse(k))
        .filter(|k| k.fingerprint() == fp)
        .collect();
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => Err(CliError::NoSuchFingerprint {
            bucket: bucket.to_string(),
            fingerprint: fp.to_owned(),
            scanned,
        }),
        matches => Err(CliError::AmbiguousFingerprint {
            bucket: bucket.to_string(),
            fingerprint: fp.to_owned(),
            matches,
        }),
    }
}

/// How the Redis keys of one family are laid out: `<head><bucket><mid><caller><tail>`, the
/// caller's key as `BucketKey::as_str` holds it after the bucket and its `:`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Scheme {
    head: String,
    mid: String,
    tail: String,
}

/// Names the application never gives a bucket or key, to find where the store writes each.
const PROBE_BUCKET: &str = "bucket-probe";
const PROBE_CALLER: &str = "caller-probe";

impl Scheme {
    /// The buckets' keys, as `store` writes them (`<prefix>:v4:<bucket>:{<key>}` today): read
    /// from the store's own `redis_key`, so that the layout and its version are the library's.
    pub(crate) fn buckets<C, K>(store: &RedisStore<C, K>) -> Self
    where
        C: ConnectionLike + Clone + Send + Sync + 'static,
        K: burstgate::Clock,
    {
        Self::probed(store.redis_key(&Self::probe()))
    }

    /// The audit streams' keys, as `store` names them (`<prefix>:audit:v1:<bucket>:{<key>}`
    /// today), the part in braces exactly the hash tag of the bucket's own key, so that a bucket
    /// and its stream share a Cluster slot.
    pub(crate) fn audit<C, K>(store: &RedisStore<C, K>) -> Self
    where
        C: ConnectionLike + Clone + Send + Sync + 'static,
        K: burstgate::Clock,
    {
        Self::probed(store.audit_key(&Self::probe()))
    }

    fn probe() -> BucketKey {
        BucketKey::new(PROBE_BUCKET, PROBE_CALLER)
            .unwrap_or_else(|_| unreachable!("a valid bucket name and key"))
    }

    /// The layout of `full`, the key of the probe.
    fn probed(full: String) -> Self {
        // From the right: the prefix may spell the probe's name too, the caller comes last.
        let caller_at = full.rfind(PROBE_CALLER).unwrap_or(full.len());
        let bucket_at = full[..caller_at].rfind(PROBE_BUCKET).unwrap_or(0);
        Self {
            head: full[..bucket_at].to_owned(),
            mid: full[bucket_at + PROBE_BUCKET.len()..caller_at].to_owned(),
            tail: full[caller_at + PROBE_CALLER.len()..].to_owned(),
        }
    }

    /// The Redis key of `key` in this family.
    pub(crate) fn key(&self, key: &BucketKey) -> String {
        let caller = &key.as_str()[key.bucket().len() + 1..];
        [&self.head, key.bucket(), &self.mid, caller, &self.tail].concat()
    }

    /// A `SCAN` pattern for the keys of `bucket`, or of every bucket.
    pub(crate) fn pattern(&self, bucket: Option<&BucketName>) -> String {
        let bucket = bucket.map_or_else(|| "*".to_owned(), |b| glob_escape(b.as_str()));
        [
            glob_escape(&self.head),
            bucket,
            glob_escape(&self.mid),
            "*".to_owned(),
            glob_escape(&self.tail),
        ]
        .concat()
    }

    /// The bucket key whose Redis key in this family is `redis_key`, when it is one the
    /// library makes; anything else under the pattern (a ticket's mark, a stranger's key) is
    /// `None`.
    pub(crate) fn parse(&self, redis_key: &str) -> Option<BucketKey> {
        let rest = redis_key
            .strip_prefix(self.head.as_str())?
            .strip_suffix(self.tail.as_str())?;
        // A bucket name holds neither `:` nor a brace, so the first `mid` ends it.
        let (bucket, caller) = rest.split_once(self.mid.as_str())?;
        BucketKey::from_escaped(&format!("{bucket}:{caller}"))
    }
}

/// `text` matched literally by a Redis glob.
fn glob_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bucket_scheme(prefix: &str) -> Scheme {
        Scheme {
            head: format!("{prefix}:v4:"),
            mid: ":{".to_owned(),
            tail: "}".to_owned(),
        }
    }

    #[test]
    fn keys_are_read_back_from_their_redis_keys() {
        let scheme = bucket_scheme("app");
        let secret = KeySecret::new(b"an application secret, sixteen+").expect("a secret");
        for key in [
            BucketKey::new("orders", "seller:42").expect("a key"),
            BucketKey::hashed("orders", "token").expect("a key"),
            BucketKey::keyed("per-token", "token", &secret).expect("a key"),
        ] {
            let redis_key = scheme.key(&key);
            assert_eq!(scheme.parse(&redis_key), Some(key));
        }
        assert_eq!(
            scheme.key(&BucketKey::new("orders", "seller:42").expect("a key")),
            "app:v4:orders:{seller%3A42}"
        );
        for stranger in [
            "app:v4:orders:{seller-42}:t:0123456789abcdef",
            "app:v4:orders:{a b}",
            "app:v3:orders:seller-42",
            "other:v4:orders:{seller-42}",
            "app:v4:{seller-42}",
        ] {
            assert_eq!(scheme.parse(stranger), None, "{stranger}");
        }
    }

    #[test]
    fn patterns_match_one_bucket_or_all_and_nothing_else() {
        let scheme = bucket_scheme("a*b");
        let orders = BucketName::new("orders").expect("a name");
        assert_eq!(scheme.pattern(Some(&orders)), "a\\*b:v4:orders:{*}");
        assert_eq!(scheme.pattern(None), "a\\*b:v4:*:{*}");
        assert_eq!(
            Scheme::probed("app:audit:v1:bucket-probe:{caller-probe}".to_owned())
                .pattern(Some(&orders)),
            "app:audit:v1:orders:{*}"
        );
    }

    #[test]
    fn fingerprints_are_twelve_hex_digits() {
        assert_eq!(
            fingerprint("3F2A9C1B7D4E").as_deref().ok(),
            Some("3f2a9c1b7d4e")
        );
        for bad in ["", "3f2a9c1b7d4", "3f2a9c1b7d4e0", "3f2a9c1b7d4g"] {
            assert!(fingerprint(bad).is_err(), "{bad}");
        }
    }
}
