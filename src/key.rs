//! Bucket identities: a bucket name chosen by the program and a key from the caller.

use std::fmt;
use std::fmt::Write as _;

use sha2::{Digest, Sha256};

/// The longest bucket name, in bytes.
const MAX_BUCKET_LEN: usize = 64;

/// Escaped keys longer than this many bytes are stored as their hash instead.
const MAX_ESCAPED_KEY_LEN: usize = 128;

/// Which bucket a request draws from: a bucket name (`"orders"`, `"per-ip"`) and the caller's key
/// within it (an account, an IP address, an API key).
///
/// The key may be any bytes, UTF-8 or not: pass a `&str`, a `String`, a `&[u8]`, a `Vec<u8>` or
/// a byte array. Only an empty key is refused ([`InvalidKey::EmptyKey`]). It is made safe for a
/// store key once, here:
///
/// - Bytes other than ASCII letters, digits and `.`, `_`, `-`, `@`, `/` are percent-escaped, so
///   `:`, `{`, `}`, spaces and newlines cannot break out of the namespace, pick a Redis Cluster
///   hash slot, or make two keys collide.
/// - A key whose escaped form is longer than 128 bytes is replaced by `#` and its SHA-256 in hex,
///   so a huge key costs a fixed 65 bytes. `#` never appears in an escaped key, so the two forms
///   cannot collide.
/// - [`BucketKey::hashed`] always stores the hash: use it for secrets such as API tokens, which
///   must never reach a store, or a log, in clear.
///
/// [`as_str`](Self::as_str) and `Display` show only the escaped or hashed form.
///
/// ```
/// use burstgate::BucketKey;
///
/// let key = BucketKey::new("orders", "seller:42")?;
/// assert_eq!(key.as_str(), "orders:seller%3A42");
///
/// let raw = BucketKey::new("ip", [10u8, 0, 0, 255])?;
/// assert_eq!(raw.as_str(), "ip:%0A%00%00%FF");
///
/// let token = BucketKey::hashed("orders", "Bearer s3cr3t")?;
/// assert!(!token.as_str().contains("s3cr3t"));
/// # Ok::<(), burstgate::InvalidKey>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct BucketKey {
    id: Box<str>,
    bucket_len: usize,
}

impl BucketKey {
    /// The bucket `bucket` for the caller `key`.
    ///
    /// The bucket name must be 1 to 64 bytes of ASCII letters, digits, `_`, `.` and `-`: it is
    /// chosen by the program, so anything else is a bug worth hearing about. The key must not be
    /// empty.
    pub fn new(bucket: &str, key: impl AsRef<[u8]>) -> Result<Self, InvalidKey> {
        Self::build(bucket, key.as_ref(), false)
    }

    /// Like [`new`](Self::new), but the key is always stored as its SHA-256: for secrets.
    pub fn hashed(bucket: &str, secret: impl AsRef<[u8]>) -> Result<Self, InvalidKey> {
        Self::build(bucket, secret.as_ref(), true)
    }

    fn build(bucket: &str, key: &[u8], hash: bool) -> Result<Self, InvalidKey> {
        if !is_name(bucket) {
            return Err(InvalidKey::BucketName);
        }
        if key.is_empty() {
            return Err(InvalidKey::EmptyKey);
        }
        let mut id = String::with_capacity(bucket.len() + 1 + key.len().min(MAX_ESCAPED_KEY_LEN));
        id.push_str(bucket);
        id.push(':');
        let escaped_len: usize = key.iter().map(|&b| if plain(b) { 1 } else { 3 }).sum();
        if hash || escaped_len > MAX_ESCAPED_KEY_LEN {
            id.push('#');
            for b in Sha256::digest(key) {
                // Writing to a String cannot fail.
                let _ = write!(id, "{b:02x}");
            }
        } else {
            for &b in key {
                if plain(b) {
                    id.push(char::from(b));
                } else {
                    let _ = write!(id, "%{b:02X}");
                }
            }
        }
        Ok(Self {
            id: id.into_boxed_str(),
            bucket_len: bucket.len(),
        })
    }

    /// The bucket name.
    pub fn bucket(&self) -> &str {
        &self.id[..self.bucket_len]
    }

    /// `<bucket>:<escaped or hashed key>`: the part of the store key this identity contributes.
    pub fn as_str(&self) -> &str {
        &self.id
    }

    /// A short hash of the identity (12 hex digits), to tell keys apart in logs without
    /// showing them: an escaped key is still the caller's key, an IP address or an account.
    pub fn fingerprint(&self) -> String {
        let digest = Sha256::digest(self.id.as_bytes());
        let mut out = String::with_capacity(12);
        for b in &digest[..6] {
            let _ = write!(out, "{b:02x}");
        }
        out
    }
}

/// Whether `s` may name a bucket or a key prefix: it is written into store keys as it is.
pub(crate) fn is_name(s: &str) -> bool {
    (1..=MAX_BUCKET_LEN).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

fn plain(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'@' | b'/')
}

impl fmt::Display for BucketKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.id)
    }
}

impl fmt::Debug for BucketKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("BucketKey").field(&self.id).finish()
    }
}

/// Why a [`BucketKey`] was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidKey {
    /// The bucket name was empty, longer than 64 bytes, or had characters other than ASCII
    /// letters, digits, `_`, `.` and `-`.
    BucketName,
    /// The key was empty.
    EmptyKey,
    /// A store's key prefix was empty, longer than 64 bytes, or had characters other than ASCII
    /// letters, digits, `_`, `.` and `-`.
    Prefix,
}

impl fmt::Display for InvalidKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BucketName => {
                f.write_str("a bucket name must be 1 to 64 ascii letters, digits, '_', '.' or '-'")
            }
            Self::EmptyKey => f.write_str("a bucket key must not be empty"),
            Self::Prefix => {
                f.write_str("a key prefix must be 1 to 64 ascii letters, digits, '_', '.' or '-'")
            }
        }
    }
}

impl std::error::Error for InvalidKey {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn separators_and_hash_tags_are_escaped() {
        let k = BucketKey::new("b", "a:{x}\n %#").map(|k| k.as_str().to_owned());
        assert_eq!(k.as_deref(), Ok("b:a%3A%7Bx%7D%0A%20%25%23"));
    }

    #[test]
    fn binary_keys_are_escaped_and_distinct() {
        let a = BucketKey::new("b", [0u8, 255]);
        let b = BucketKey::new("b", "%00%FF");
        assert_eq!(a.as_ref().map(|k| k.as_str()), Ok("b:%00%FF"));
        assert_eq!(b.as_ref().map(|k| k.as_str()), Ok("b:%2500%25FF"));
    }

    #[test]
    fn huge_keys_are_hashed_to_a_fixed_size() {
        let huge = vec![b'x'; 1 << 20];
        let k = BucketKey::new("b", &huge).map(|k| k.as_str().len());
        assert_eq!(k, Ok(2 + 1 + 64));
        // Just under the threshold stays readable.
        let k = BucketKey::new("b", [b'y'; 128]).map(|k| k.as_str().len());
        assert_eq!(k, Ok(2 + 128));
    }

    #[test]
    fn secrets_never_appear_in_clear() {
        let k = BucketKey::hashed("orders", "token-abc").map(|k| k.to_string());
        let k = k.unwrap_or_default();
        assert!(k.starts_with("orders:#") && !k.contains("token"), "{k}");
        assert!(!format!("{:?}", BucketKey::hashed("o", "token-abc")).contains("token"));
    }

    #[test]
    fn bad_names_and_empty_keys_are_refused() {
        assert_eq!(BucketKey::new("", "k"), Err(InvalidKey::BucketName));
        assert_eq!(BucketKey::new("a:b", "k"), Err(InvalidKey::BucketName));
        assert_eq!(
            BucketKey::new(&"n".repeat(65), "k"),
            Err(InvalidKey::BucketName)
        );
        assert_eq!(BucketKey::new("orders", ""), Err(InvalidKey::EmptyKey));
        assert_eq!(BucketKey::hashed("orders", ""), Err(InvalidKey::EmptyKey));
        assert_eq!(
            BucketKey::new("orders", "k").map(|k| k.bucket().to_owned()),
            Ok("orders".into())
        );
    }
}
