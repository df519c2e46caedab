//! Bucket identities: a bucket name chosen by the program and a key from the caller.

use std::fmt;
use std::fmt::Write as _;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

pub(crate) use crate::error::{InvalidKey, InvalidName};

use id::{Id, Text};

use crate::store::sharding::{key_hash, key_hash_parts};

mod id;

pub(crate) type HmacSha256 = Hmac<Sha256>;

/// The shortest [`KeySecret`], in bytes: shorter secrets can be guessed.
const MIN_SECRET_LEN: usize = 16;

/// The longest bucket name, in bytes.
const MAX_BUCKET_LEN: usize = 64;

/// Escaped keys longer than this many bytes are stored as their hash instead.
const MAX_ESCAPED_KEY_LEN: usize = 128;

/// The name of a bucket, checked once: 1 to 64 bytes of ASCII letters, digits, `_`, `.` and
/// `-`, written into store keys as it is.
///
/// The program chooses bucket names, so a name that breaks the rule is a bug, reported by
/// [`InvalidKey::BucketName`] with what was wrong. A [`Rule`](crate::layer::Rule) or a
/// [`Route`](crate::middleware::Route) checks its name when it is made, not on every request;
/// hold a `BucketName` to do the same with keys of your own. Cheap to clone.
///
/// ```
/// use burstgate::{BucketName, InvalidKey, InvalidName};
///
/// let orders = BucketName::new("orders")?;
/// assert_eq!(orders.key("seller-42")?.as_str(), "orders:seller-42");
///
/// assert_eq!(
///     BucketName::new("new orders"),
///     Err(InvalidKey::BucketName(InvalidName::Character { index: 3, byte: b' ' }))
/// );
/// # Ok::<(), InvalidKey>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct BucketName(Arc<str>);

impl BucketName {
    /// `name`, if it is 1 to 64 bytes of ASCII letters, digits, `_`, `.` and `-`.
    pub fn new(name: &str) -> Result<Self, InvalidKey> {
        Self::checked(name).map_err(InvalidKey::BucketName)
    }

    /// `name`, or what is wrong with it, for the errors of other front ends.
    pub(crate) fn checked(name: &str) -> Result<Self, InvalidName> {
        check_name(name)?;
        Ok(Self(Arc::from(name)))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The bucket for the caller `key`, as [`BucketKey::new`] makes it, without checking the
    /// name again.
    pub fn key(&self, key: impl AsRef<[u8]>) -> Result<BucketKey, InvalidKey> {
        BucketKey::build(self.as_str(), key.as_ref(), Hashing::None)
    }

    /// The bucket for the caller `key`, stored as its plain SHA-256, as [`BucketKey::hashed`]
    /// makes it.
    pub fn hashed_key(&self, key: impl AsRef<[u8]>) -> Result<BucketKey, InvalidKey> {
        BucketKey::build(self.as_str(), key.as_ref(), Hashing::Plain)
    }

    /// The bucket for the caller `key`, stored as its HMAC-SHA256 under `secret`, as
    /// [`BucketKey::keyed`] makes it.
    pub fn keyed_key(
        &self,
        key: impl AsRef<[u8]>,
        secret: &KeySecret,
    ) -> Result<BucketKey, InvalidKey> {
        BucketKey::build(self.as_str(), key.as_ref(), Hashing::Keyed(secret))
    }
}

impl std::str::FromStr for BucketName {
    type Err = InvalidKey;

    fn from_str(name: &str) -> Result<Self, InvalidKey> {
        Self::new(name)
    }
}

impl AsRef<str> for BucketName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for BucketName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for BucketName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("BucketName").field(&&*self.0).finish()
    }
}

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
/// - [`BucketKey::keyed`] always stores an HMAC-SHA256 of the key under an application
///   [`KeySecret`]: use it for secrets such as API tokens and `Authorization` values, which must
///   never reach a store, or a log, in clear, nor in a form that can be guessed offline.
/// - [`BucketKey::hashed`] always stores a plain SHA-256. Anyone who reads the store can test
///   guesses against it (a password, a short token, an IP address), so prefer
///   [`keyed`](BucketKey::keyed) for anything secret.
///
/// [`as_str`](Self::as_str) and `Display` show only the escaped or hashed form. An `as_str` of up
/// to 45 bytes is kept inside the `BucketKey`, so the usual key costs no allocation to build or
/// to clone. A key is hashed once, when it is made, and remembers where a
/// [`MemoryStore`](crate::MemoryStore) last found its bucket: a key kept and used again (one
/// per account, say, or one for a whole API) spares the store both on each decision. That
/// place changes neither the key's equality nor its hash, so a `BucketKey` is a sound map key;
/// clippy's `mutable_key_type` lint, which sees the atomic that holds it, can be allowed there.
///
/// ```
/// use burstgate::{BucketKey, KeySecret};
///
/// let key = BucketKey::new("orders", "seller:42")?;
/// assert_eq!(key.as_str(), "orders:seller%3A42");
///
/// let raw = BucketKey::new("ip", [10u8, 0, 0, 255])?;
/// assert_eq!(raw.as_str(), "ip:%0A%00%00%FF");
///
/// let secret = KeySecret::new(b"an application secret, from config")?;
/// let token = BucketKey::keyed("orders", "Bearer s3cr3t", &secret)?;
/// assert!(!token.as_str().contains("s3cr3t"));
/// # Ok::<(), burstgate::InvalidKey>(())
/// ```
pub struct BucketKey {
    id: Id,
    /// The id's hash (`sharding::key_hash`), made with the key: a store finds a bucket by it
    /// on every decision, and a key built once is often decided on many times.
    hash: u64,
    /// Where a `MemoryStore` last found this key's bucket, for a key kept and decided on again
    /// (0 for nowhere yet): only a place to look first, which the store checks is the key's.
    hint: AtomicU64,
}

impl Clone for BucketKey {
    fn clone(&self) -> Self {
        Self {
            id: self.id.clone(),
            hash: self.hash,
            hint: AtomicU64::new(self.hint()),
        }
    }
}

impl BucketKey {
    /// The bucket `bucket` for the caller `key`: shorthand for
    /// [`BucketName::new`]`(bucket)?.`[`key`](BucketName::key)`(key)`.
    ///
    /// The bucket name must be 1 to 64 bytes of ASCII letters, digits, `_`, `.` and `-`: it is
    /// chosen by the program, so anything else is a bug worth hearing about. The key must not be
    /// empty. Where one name serves many keys, check it once with [`BucketName`].
    pub fn new(bucket: &str, key: impl AsRef<[u8]>) -> Result<Self, InvalidKey> {
        Self::build(checked_name(bucket)?, key.as_ref(), Hashing::None)
    }

    /// Like [`new`](Self::new), but the key is always stored as its plain SHA-256.
    ///
    /// The hash hides the key from a casual reader, not from one who guesses: whoever reads the
    /// store can hash candidate keys and compare. Use [`keyed`](Self::keyed) for passwords,
    /// tokens and anything else an attacker would like to learn.
    pub fn hashed(bucket: &str, key: impl AsRef<[u8]>) -> Result<Self, InvalidKey> {
        Self::build(checked_name(bucket)?, key.as_ref(), Hashing::Plain)
    }

    /// Like [`new`](Self::new), but the key is always stored as its HMAC-SHA256 under `secret`:
    /// for secrets. Without the secret, a reader of the store (or of a backup of it) cannot tell
    /// which key a bucket belongs to, nor test guesses.
    ///
    /// Every process that shares a bucket must use the same secret; a new secret names new
    /// buckets, which start full.
    pub fn keyed(
        bucket: &str,
        key: impl AsRef<[u8]>,
        secret: &KeySecret,
    ) -> Result<Self, InvalidKey> {
        Self::build(checked_name(bucket)?, key.as_ref(), Hashing::Keyed(secret))
    }

    /// The key of `bucket`, a checked name, for the caller `key`.
    #[inline]
    fn build(bucket: &str, key: &[u8], hashing: Hashing<'_>) -> Result<Self, InvalidKey> {
        if key.is_empty() {
            return Err(InvalidKey::EmptyKey);
        }
        if let Hashing::None = hashing
            && let Some(id) = Id::unescaped(bucket, key)
        {
            // The id's key is `key` as it is: hashed from the caller's bytes, not the id's.
            let hash = key_hash_parts(bucket.as_bytes(), key);
            return Ok(Self {
                id,
                hash,
                hint: AtomicU64::new(0),
            });
        }
        Ok(Self::written(bucket, key, hashing))
    }

    /// [`build`](Self::build) for an id that needs escapes, is too long to keep inline, or is
    /// hashed: written on the stack first, apart from the usual key's short path.
    #[inline(never)]
    fn written(bucket: &str, key: &[u8], hashing: Hashing<'_>) -> Self {
        let mut id = Text::new(bucket);
        let digest = match hashing {
            Hashing::Keyed(secret) => Some(secret.mac(key)),
            Hashing::Plain => Some(Sha256::digest(key).into()),
            Hashing::None if id.push_escaped(key) => None,
            Hashing::None => Some(Sha256::digest(key).into()),
        };
        if let Some(digest) = digest {
            id.set_digest(bucket.len(), &digest);
        }
        Self::of(id.finish(bucket.len()))
    }

    /// The key of `id`, with its hash.
    #[inline]
    fn of(id: Id) -> Self {
        let hash = key_hash(id.as_bytes());
        Self {
            id,
            hash,
            hint: AtomicU64::new(0),
        }
    }

    /// The key whose [`as_str`](Self::as_str) is `id`, read back from its escaped or hashed
    /// form: for a tool that finds keys in a store (the `<bucket>` and `{<key>}` of a Redis key
    /// `<prefix>:v4:<bucket>:{<key>}`, joined by `:`) and must name them by their
    /// [`fingerprint`](Self::fingerprint), as the `burstgate` command-line tool does.
    ///
    /// `None` unless `id` is one that [`new`](Self::new), [`hashed`](Self::hashed) or
    /// [`keyed`](Self::keyed) can make, so that the key read back is the one the application
    /// made and has its fingerprint: a valid bucket name, `:`, then `#` and 64 lowercase hex
    /// digits, or 1 to 128 bytes of an escaped key in which only the bytes `new` escapes are
    /// escaped, each as `%` and two uppercase hex digits.
    ///
    /// ```
    /// use burstgate::BucketKey;
    ///
    /// let key = BucketKey::new("orders", "seller:42")?;
    /// assert_eq!(BucketKey::from_escaped("orders:seller%3A42"), Some(key));
    /// // Not a form `new` writes: `-` is never escaped.
    /// assert_eq!(BucketKey::from_escaped("orders:seller%2D42"), None);
    /// # Ok::<(), burstgate::InvalidKey>(())
    /// ```
    pub fn from_escaped(id: &str) -> Option<Self> {
        Self::from_id(id)
    }

    /// [`from_escaped`](Self::from_escaped), also for a key kept as text (a [`Ticket`]) and read
    /// back.
    ///
    /// [`Ticket`]: crate::middleware::Ticket
    pub(crate) fn from_id(id: &str) -> Option<Self> {
        let (bucket, key) = id.split_once(':')?;
        check_name(bucket).ok()?;
        let canonical = if let Some(hex) = key.strip_prefix('#') {
            hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        } else {
            let bytes = key.as_bytes();
            let mut i = 0;
            let mut ok = !bytes.is_empty() && bytes.len() <= MAX_ESCAPED_KEY_LEN;
            while ok && i < bytes.len() {
                if plain(bytes[i]) {
                    i += 1;
                    continue;
                }
                let hex = |b: u8| match b {
                    b'0'..=b'9' => Some(b - b'0'),
                    b'A'..=b'F' => Some(b - b'A' + 10),
                    _ => None,
                };
                let decoded = match bytes.get(i..i + 3) {
                    Some([b'%', hi, lo]) => hex(*hi).zip(hex(*lo)).map(|(h, l)| h << 4 | l),
                    _ => None,
                };
                // Only a byte that is not plain is escaped: any other spelling is not the key's.
                ok = decoded.is_some_and(|b| !plain(b));
                i += 3;
            }
            ok
        };
        canonical.then(|| Self::of(Id::of(id, bucket.len())))
    }

    /// The bucket name.
    pub fn bucket(&self) -> &str {
        self.id.bucket()
    }

    /// The escaped or hashed caller's key, without the bucket: what a Redis key's hash tag holds.
    #[cfg_attr(not(any(feature = "redis", feature = "tower")), allow(dead_code))]
    pub(crate) fn caller(&self) -> &str {
        self.id.caller()
    }

    /// `<bucket>:<escaped or hashed key>`: the part of the store key this identity contributes.
    pub fn as_str(&self) -> &str {
        self.id.as_str()
    }

    /// [`as_str`](Self::as_str)'s bytes, without its check that they are text: what a store
    /// hashes and compares on each decision.
    #[inline]
    pub(crate) fn as_bytes(&self) -> &[u8] {
        self.id.as_bytes()
    }

    /// [`as_bytes`](Self::as_bytes)'s hash, `sharding::key_hash`, made when the key was.
    #[inline]
    pub(crate) fn id_hash(&self) -> u64 {
        self.hash
    }

    /// Where a `MemoryStore` last found this key's bucket (0 for nowhere yet).
    #[inline]
    pub(crate) fn hint(&self) -> u64 {
        self.hint.load(Ordering::Relaxed)
    }

    /// Records where a `MemoryStore` found this key's bucket. Written only when it changes, so
    /// that threads sharing one key (a global limit's) share its memory only to read it.
    #[inline]
    pub(crate) fn set_hint(&self, hint: u64) {
        if self.hint() != hint {
            self.hint.store(hint, Ordering::Relaxed);
        }
    }

    /// A short hash of the identity (12 hex digits), to tell keys apart in logs without
    /// showing them: an escaped key is still the caller's key, an IP address or an account.
    ///
    /// The hash is keyed, so a reader of the logs cannot recover a key by hashing every
    /// candidate (every IPv4 address, say). Its key is derived from the application's
    /// [`KeySecret`] once the process has one ([`KeySecret::key_fingerprints`], which
    /// `KeyExtractor::keyed_header` and `RateLimitMiddleware::key_secret` call for the first
    /// secret they are given): then the same key has the same fingerprint in every process that
    /// shares the secret, across restarts, and in the `burstgate` command-line tool given the
    /// secret. Without a secret the hash is keyed with a salt drawn once per process, and
    /// fingerprints match only within the process.
    pub fn fingerprint(&self) -> String {
        let mut out = String::with_capacity(12);
        push_hex(&mut out, &self.fingerprint_bytes());
        out
    }

    /// The six bytes [`fingerprint`](Self::fingerprint) writes in hex: what the layer's
    /// `RateLimit` field names a partition by, so that it and the logs agree.
    pub(crate) fn fingerprint_bytes(&self) -> [u8; 6] {
        let mut mac = fingerprint_key();
        mac.update(self.as_bytes());
        let digest = mac.finalize().into_bytes();
        let mut out = [0; 6];
        out.copy_from_slice(&digest[..6]);
        out
    }
}

/// `name` if it may name a bucket, as [`BucketName::new`] checks it, without the copy a
/// `BucketName` keeps: a server builds a key from each request.
fn checked_name(name: &str) -> Result<&str, InvalidKey> {
    check_name(name).map_err(InvalidKey::BucketName)?;
    Ok(name)
}

#[derive(Clone, Copy)]
enum Hashing<'a> {
    /// Escaped, unless too long.
    None,
    Plain,
    Keyed(&'a KeySecret),
}

pub(crate) fn push_hex(out: &mut String, bytes: &[u8]) {
    for b in bytes {
        // Writing to a String cannot fail.
        let _ = write!(out, "{b:02x}");
    }
}

/// 32 bytes from the operating system's random source.
pub(crate) fn random_bytes() -> [u8; 32] {
    let mut bytes = [0u8; 32];
    if getrandom::fill(&mut bytes).is_err() {
        // No OS randomness (a sandbox without getrandom): std's per-process hasher keys come
        // from the same source where it exists, and from the address space layout otherwise,
        // which still differs between processes.
        use std::hash::{BuildHasher, Hasher};
        for chunk in bytes.chunks_mut(8) {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_usize(chunk.as_ptr() as usize);
            chunk.copy_from_slice(&h.finish().to_le_bytes());
        }
    }
    bytes
}

/// The process's fingerprint key: derived from a [`KeySecret`] once one was given for it, or a
/// salt drawn from the operating system's random source the first time a fingerprint is asked
/// for before that.
fn fingerprint_key() -> HmacSha256 {
    {
        let held = FINGERPRINT_KEY
            .read()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some((mac, _)) = held.as_ref() {
            return mac.clone();
        }
    }
    let mut held = FINGERPRINT_KEY
        .write()
        .unwrap_or_else(PoisonError::into_inner);
    let (mac, _) = held.get_or_insert_with(|| {
        // An HMAC accepts a key of any length.
        let salt = HmacSha256::new_from_slice(&random_bytes())
            .unwrap_or_else(|_| HmacSha256::new(&Default::default()));
        (salt, FingerprintKey::Salt)
    });
    mac.clone()
}

/// Where the process's fingerprint key came from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum FingerprintKey {
    /// Drawn at random: no secret was given for fingerprints yet.
    Salt,
    /// The first secret a front end was given.
    FirstSecret,
    /// A secret given with [`KeySecret::key_fingerprints`].
    Chosen,
}

static FINGERPRINT_KEY: RwLock<Option<(HmacSha256, FingerprintKey)>> = RwLock::new(None);

/// The key of the HMAC under which a secret's fingerprint key is derived from it (as the
/// signing key is): never a MAC made with the secret itself, whose outputs for chosen inputs
/// are written into the store as keys.
const FINGERPRINT_KEY_LABEL: &[u8] = b"burstgate fingerprint key, version 1";

/// An application secret that keys the hashes of secret keys: see [`BucketKey::keyed`],
/// `KeyExtractor::keyed_header` (feature `tower`) and `RateLimitMiddleware::key_secret`
/// (feature `reqwest`).
///
/// Give it at least 16 random bytes from your secret store, the same in every process that shares
/// the buckets. `Debug` never shows it.
///
/// ```
/// use burstgate::{InvalidKey, KeySecret};
///
/// assert!(KeySecret::new(b"0123456789abcdef").is_ok());
/// assert_eq!(KeySecret::new(b"short").err(), Some(InvalidKey::ShortSecret));
/// ```
#[derive(Clone)]
pub struct KeySecret {
    /// The HMAC with the secret already absorbed, so each key costs two SHA-256 blocks and no
    /// copy of the secret.
    mac: Arc<HmacSha256>,
    /// An HMAC under a key of its own, derived from the secret (its HMAC under a fixed label),
    /// for signatures: never a MAC made with `mac`, whose outputs for account names are written
    /// into Redis in clear, and so can be had for any chosen input. The middleware signs its
    /// tickets with it.
    signing: Arc<HmacSha256>,
    /// The key fingerprints are made under once this secret keys them, derived as `signing`
    /// is, under a label of its own.
    fingerprint: Arc<[u8; 32]>,
}

/// The key of the HMAC under which a secret's signing key is derived from it. Its text names
/// tickets, the first thing signed with it; changing it would refuse every ticket outstanding.
pub(crate) const SIGNING_KEY_LABEL: &[u8] = b"burstgate ticket signing key, version 1";

impl KeySecret {
    /// A secret of at least 16 bytes.
    pub fn new(secret: impl AsRef<[u8]>) -> Result<Self, InvalidKey> {
        let secret = secret.as_ref();
        if secret.len() < MIN_SECRET_LEN {
            return Err(InvalidKey::ShortSecret);
        }
        let mac = HmacSha256::new_from_slice(secret).map_err(|_| InvalidKey::ShortSecret)?;
        let signing = {
            let mut derive = HmacSha256::new_from_slice(SIGNING_KEY_LABEL)
                .map_err(|_| InvalidKey::ShortSecret)?;
            derive.update(secret);
            HmacSha256::new_from_slice(&derive.finalize().into_bytes())
                .map_err(|_| InvalidKey::ShortSecret)?
        };
        let fingerprint = {
            let mut derive = HmacSha256::new_from_slice(FINGERPRINT_KEY_LABEL)
                .map_err(|_| InvalidKey::ShortSecret)?;
            derive.update(secret);
            derive.finalize().into_bytes().into()
        };
        Ok(Self {
            mac: Arc::new(mac),
            signing: Arc::new(signing),
            fingerprint: Arc::new(fingerprint),
        })
    }

    fn mac(&self, key: &[u8]) -> [u8; 32] {
        let mut mac = HmacSha256::clone(&self.mac);
        mac.update(key);
        mac.finalize().into_bytes().into()
    }

    /// Keys the fingerprints this process writes from now on ([`BucketKey::fingerprint`], in
    /// logs, errors and the decisions it reports) with a key derived from this secret, so that
    /// every process sharing the secret, and the `burstgate` command-line tool given it, shows
    /// the same client by the same fingerprint, across restarts; without the secret a
    /// fingerprint still reveals nothing. `KeyExtractor::keyed_header` and
    /// `RateLimitMiddleware::key_secret` do this for the first secret they are given, unless a
    /// secret was chosen here; call it for a process that has several secrets, or whose keys
    /// are not secret but whose fingerprints should still match across processes.
    pub fn key_fingerprints(&self) {
        self.set_fingerprint_key(FingerprintKey::Chosen);
    }

    /// Keys fingerprints with this secret unless a secret keys them already: what a front end
    /// does with the secret it is given.
    #[cfg_attr(not(any(feature = "tower", feature = "reqwest")), allow(dead_code))]
    pub(crate) fn offer_for_fingerprints(&self) {
        self.set_fingerprint_key(FingerprintKey::FirstSecret);
    }

    fn set_fingerprint_key(&self, how: FingerprintKey) {
        let mut held = FINGERPRINT_KEY
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        // A front end's secret replaces only the random salt; a chosen one replaces any.
        let settled = how == FingerprintKey::FirstSecret
            && held
                .as_ref()
                .is_some_and(|(_, from)| *from != FingerprintKey::Salt);
        if settled {
            return;
        }
        if let Ok(mac) = HmacSha256::new_from_slice(self.fingerprint.as_slice()) {
            *held = Some((mac, how));
        }
    }

    /// A fresh HMAC under the signing key derived from this secret, to sign or verify with.
    #[cfg_attr(not(feature = "reqwest"), allow(dead_code))]
    pub(crate) fn signer(&self) -> HmacSha256 {
        HmacSha256::clone(&self.signing)
    }
}

impl fmt::Debug for KeySecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("KeySecret(<secret>)")
    }
}

/// Whether `s` may name a bucket or a key prefix: it is written into store keys as it is, so it
/// must not hold the separators, hash tags or escapes of the key scheme.
pub(crate) fn check_name(s: &str) -> Result<(), InvalidName> {
    if s.is_empty() {
        return Err(InvalidName::Empty);
    }
    if s.len() > MAX_BUCKET_LEN {
        return Err(InvalidName::TooLong { len: s.len() });
    }
    // Every byte looked at, with no branch per byte, and the culprit sought only on failure.
    if s.bytes().fold(NAME, |all, b| all & BYTES[usize::from(b)]) & NAME != 0 {
        return Ok(());
    }
    match s.bytes().position(|b| BYTES[usize::from(b)] & NAME == 0) {
        Some(index) => Err(InvalidName::Character {
            index,
            byte: s.as_bytes()[index],
        }),
        None => Ok(()),
    }
}

/// Whether a key keeps byte `b` as it is (else it is escaped as `%XX`); only ASCII bytes are.
fn plain(b: u8) -> bool {
    BYTES[usize::from(b)] & PLAIN != 0
}

/// What each byte may be, as a table: a server builds a key from each request, and a lookup a
/// byte is cheaper than the comparisons.
const BYTES: [u8; 256] = {
    let mut table = [0; 256];
    let mut i = 0;
    while i < 256 {
        let b = i as u8;
        if b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-') {
            table[i] |= NAME | PLAIN;
        } else if matches!(b, b'@' | b'/') {
            table[i] |= PLAIN;
        }
        i += 1;
    }
    table
};
/// The byte may be in a bucket name.
const NAME: u8 = 1;
/// The byte stays as it is in a key.
const PLAIN: u8 = 2;

// By the id's bytes alone: the bucket name's length follows from them (a name holds no `:`).
impl PartialEq for BucketKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for BucketKey {}

impl Hash for BucketKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_bytes().hash(state);
    }
}

impl fmt::Display for BucketKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Debug for BucketKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("BucketKey").field(&self.as_str()).finish()
    }
}

#[cfg(test)]
mod tests;
