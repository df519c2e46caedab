//! The core's errors: a refused input (a key, a name, a limit), a store that could not decide,
//! and the rejection both front ends report. Each front end keeps its own errors beside it
//! (`layer::InvalidProxy`, `layer::MissingRateLimitInfo`, `middleware::TicketError`,
//! `middleware::InvalidRoute`, `seller::TableError`).

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use crate::Limit;

/// A request refused by a rate limit: it could not be admitted within the waiting ceiling.
///
/// Like governor's `NotUntil`, it is information for the caller: when to come back
/// ([`retry_after`](Self::retry_after)), under which limit, and for which bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimited {
    retry_after: Duration,
    limit: Limit,
    bucket: String,
    remaining: u32,
}

impl RateLimited {
    #[cfg_attr(not(any(feature = "tower", feature = "reqwest")), allow(dead_code))]
    pub(crate) fn new(retry_after: Duration, limit: Limit, bucket: &str, remaining: u32) -> Self {
        Self {
            retry_after,
            limit,
            bucket: bucket.to_owned(),
            remaining,
        }
    }

    /// How long until the request could be admitted, if nobody else takes tokens meanwhile.
    pub fn retry_after(&self) -> Duration {
        self.retry_after
    }

    /// The limit that refused the request.
    pub fn limit(&self) -> Limit {
        self.limit
    }

    /// The name of the bucket that refused the request.
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// Whole tokens left in that bucket (fewer than the request costs).
    pub fn remaining(&self) -> u32 {
        self.remaining
    }
}

impl fmt::Display for RateLimited {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rate limited by bucket {:?} ({}): retry after {} ms",
            self.bucket,
            self.limit,
            self.retry_after.as_millis()
        )
    }
}

impl StdError for RateLimited {}

/// Why a bucket name, a key, a key prefix or a key secret was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidKey {
    /// A bucket name (of a [`BucketKey`](crate::BucketKey), a [`BucketName`](crate::BucketName)
    /// or a layer rule) broke the naming rule.
    BucketName(InvalidName),
    /// The key was empty.
    EmptyKey,
    /// A store's key prefix broke the naming rule.
    Prefix(InvalidName),
    /// A [`KeySecret`](crate::KeySecret) was shorter than 16 bytes.
    ShortSecret,
}

impl fmt::Display for InvalidKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BucketName(why) => write!(f, "invalid bucket name: {why}"),
            Self::EmptyKey => f.write_str("a bucket key must not be empty"),
            Self::Prefix(why) => write!(f, "invalid key prefix: {why}"),
            Self::ShortSecret => f.write_str("a key secret must be at least 16 bytes"),
        }
    }
}

impl StdError for InvalidKey {}

/// What was wrong with a bucket name or a key prefix, which must each be 1 to 64 bytes of ASCII
/// letters, digits, `_`, `.` and `-`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidName {
    /// It was empty.
    Empty,
    /// It was longer than 64 bytes.
    TooLong {
        /// Its length, in bytes.
        len: usize,
    },
    /// It held a byte other than an ASCII letter, a digit, `_`, `.` or `-`.
    Character {
        /// Where, in bytes from the start.
        index: usize,
        /// The byte.
        byte: u8,
    },
}

impl fmt::Display for InvalidName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => f.write_str("it is empty (it must be 1 to 64 bytes)"),
            Self::TooLong { len } => write!(f, "it is {len} bytes long (at most 64)"),
            Self::Character { index, byte } if byte.is_ascii_graphic() || *byte == b' ' => write!(
                f,
                "byte {index} is '{}', not an ascii letter, digit, '_', '.' or '-'",
                char::from(*byte)
            ),
            Self::Character { index, byte } => write!(
                f,
                "byte {index} is 0x{byte:02X}, not an ascii letter, digit, '_', '.' or '-'"
            ),
        }
    }
}

/// Why a lease setting was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidLeases {
    /// A lease's time was under 100 ms or over 60 s.
    Time {
        /// The time given.
        time: Duration,
    },
}

impl fmt::Display for InvalidLeases {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Time { time } => write!(
                f,
                "a lease of {time:?} is refused: a lease lasts from 100 ms to 60 s"
            ),
        }
    }
}

impl StdError for InvalidLeases {}

/// Why a [`Limit`] was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidLimit {
    /// `tokens` was zero: the bucket would never refill.
    ZeroTokens,
    /// `burst` was zero: the bucket could never hold a token.
    ZeroBurst,
    /// The interval was zero.
    ZeroInterval,
    /// The interval was not a whole number of milliseconds.
    SubMillisecondInterval {
        /// The interval given.
        interval: Duration,
    },
    /// The interval, or the time to refill an empty bucket, was longer than about 139 years.
    TooSlow,
}

impl fmt::Display for InvalidLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ZeroTokens => f.write_str("a limit needs at least one token per interval"),
            Self::ZeroBurst => f.write_str("a limit needs a burst of at least one token"),
            Self::ZeroInterval => f.write_str("a limit needs an interval above zero"),
            Self::SubMillisecondInterval { interval } => write!(
                f,
                "a limit's interval must be a whole number of milliseconds, got {interval:?}"
            ),
            Self::TooSlow => f.write_str(
                "a limit's interval and refill time must each be at most 2^42 ms (about 139 years)",
            ),
        }
    }
}

impl StdError for InvalidLimit {}

/// Why the text of a [`Limit`] was refused by its [`FromStr`](std::str::FromStr) (the grammar is
/// on [`Limit`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ParseLimitError {
    /// The text was empty, or blank.
    Empty,
    /// The text had neither `/` nor `per` between its tokens and its interval.
    NoSlash,
    /// The tokens, before the `/` or `per`, were not a whole number from 0 to `u32::MAX`.
    Tokens {
        /// The tokens as written.
        text: String,
    },
    /// The interval, after the `/` or `per`, was not an optional whole number followed by a
    /// unit.
    Interval {
        /// The interval as written.
        text: String,
    },
    /// The interval's unit was none of `ms`, `s`, `min`, `h` and `d`, nor of the words
    /// `millisecond`, `second`, `minute`, `hour` and `day` (singular or plural).
    Unit {
        /// The unit as written.
        unit: String,
    },
    /// What followed the interval was not `burst <n>`, `n` a whole number from 0 to `u32::MAX`.
    Burst {
        /// The text after the interval.
        text: String,
    },
    /// The text was read, but its values do not make a valid limit.
    Limit(InvalidLimit),
}

impl fmt::Display for ParseLimitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => f.write_str("a limit's text must not be empty"),
            Self::NoSlash => f.write_str(
                "a limit's text must be <tokens>/<interval> or <tokens> per <interval>, as in \"10/s burst 20\" or \"1 per minute\", and has neither",
            ),
            Self::Tokens { text } => write!(
                f,
                "a limit's tokens must be a whole number up to {}, got {text:?}",
                u32::MAX
            ),
            Self::Interval { text } => write!(
                f,
                "a limit's interval must be a whole number and a unit (ms, s, min, h or d), as in \"2s\" or \"2 hours\", got {text:?}"
            ),
            Self::Unit { unit } => write!(
                f,
                "a limit's interval unit must be ms, s, min, h or d, or millisecond, second, minute, hour or day (or their plurals), got {unit:?}"
            ),
            Self::Burst { text } => write!(
                f,
                "a limit's interval may only be followed by \"burst <n>\", n a whole number up to {}, got {text:?}",
                u32::MAX
            ),
            Self::Limit(e) => fmt::Display::fmt(e, f),
        }
    }
}

impl StdError for ParseLimitError {}

impl From<InvalidLimit> for ParseLimitError {
    fn from(e: InvalidLimit) -> Self {
        Self::Limit(e)
    }
}

/// Why a store could not decide.
#[derive(Debug)]
#[non_exhaustive]
pub enum StoreError {
    /// A cost of zero was asked for.
    ZeroCost,
    /// The cost is above the limit's burst, so it could never be served.
    CostAboveBurst {
        /// The cost asked for.
        cost: u32,
        /// The limit's burst.
        burst: u32,
    },
    /// A bucket was [`set`](crate::BucketStore::set) to more tokens than the limit's burst,
    /// which no bucket of that limit holds. Nothing was changed.
    TokensAboveBurst {
        /// The tokens asked for.
        tokens: u32,
        /// The limit's burst.
        burst: u32,
    },
    /// The store key holds a value that is not a bucket (Redis `WRONGTYPE`): someone else wrote
    /// the key. The call was refused without changing it.
    ///
    /// The key is named by its bucket and fingerprint, never in clear (it may be an IP address
    /// or an account). To find it, list the bucket's keys (`SCAN 0 MATCH <prefix>:*:<bucket>:*`)
    /// and look for the one whose `TYPE` is not `string`, or compute it from a suspect key with
    /// `RedisStore::redis_key`.
    WrongType {
        /// The bucket name, as the program chose it.
        bucket: String,
        /// The bucket key's [`fingerprint`](crate::BucketKey::fingerprint), not the key itself.
        fingerprint: String,
    },
    /// The bucket's stored value is one no store could have written (not finite, a time out of
    /// range, more debt than any reservation leaves): someone else wrote the key. The call was
    /// refused without changing it; delete the key to start the bucket afresh.
    CorruptBucket {
        /// The bucket name, as the program chose it.
        bucket: String,
        /// The bucket key's [`fingerprint`](crate::BucketKey::fingerprint), not the key itself.
        fingerprint: String,
    },
    /// The [audit trail](crate::Audit) of an audited bucket is a key that holds something other
    /// than a stream: someone else wrote it. The call was refused without changing anything;
    /// delete that key (`RedisStore::audit_key` names it) and the trail starts afresh.
    AuditNotAStream {
        /// The bucket name, as the program chose it.
        bucket: String,
        /// The bucket key's [`fingerprint`](crate::BucketKey::fingerprint), not the key itself.
        fingerprint: String,
    },
    /// Tokens of the bucket are out on lease ([`Leases`](crate::Leases)): while they are, only a
    /// store in lease mode decides on it. The call was refused without changing anything; it
    /// succeeds again once every lease has ended (given back, or past its time).
    Leased {
        /// The bucket name, as the program chose it.
        bucket: String,
        /// The bucket key's [`fingerprint`](crate::BucketKey::fingerprint), not the key itself.
        fingerprint: String,
    },
    /// A store in lease mode ([`Leases`](crate::Leases)) was asked for what a lease cannot
    /// serve: a reservation (a `max_wait` above zero) or several buckets at once. Nothing was
    /// taken; such requests go to a store that does not lease.
    NotLeasable,
    /// A [`MemoryStore`](crate::MemoryStore) at its bound of buckets met a new key, and every
    /// bucket it could have forgotten to make room was in debt (reservations wait on it). The
    /// call changed nothing.
    TooManyBuckets {
        /// The store's bound.
        max: usize,
    },
    /// An [`acquire_all`](crate::BucketStore::acquire_all) named the same bucket twice. Nothing
    /// was taken.
    SameBucketTwice {
        /// The bucket name, as the program chose it.
        bucket: String,
        /// The bucket key's [`fingerprint`](crate::BucketKey::fingerprint), not the key itself.
        fingerprint: String,
    },
    /// An [`acquire_all`](crate::BucketStore::acquire_all) named more buckets than one call
    /// takes from. Nothing was taken.
    TooManyAtOnce {
        /// The buckets named.
        count: usize,
        /// The most one call takes from ([`MAX_TAKES`](crate::MAX_TAKES)).
        max: usize,
    },
    /// The buckets of one [`acquire_all`](crate::BucketStore::acquire_all) live in different
    /// hash slots of a Redis Cluster, which runs a script only on keys of one slot (`CROSSSLOT`).
    /// Keys of one account share a slot (see `RedisStore`'s "Keys"); nothing was taken.
    CrossSlot,
    /// The backend failed: connection lost or refused, or it answered something unexpected. The
    /// backend's own error is the [`source`](StdError::source).
    Backend(BackendError),
    /// The backend did not answer within the store's timeout. The call may still have run: its
    /// tokens count as spent.
    Timeout {
        /// The timeout that passed.
        after: Duration,
    },
    /// The backend was not asked: its circuit breaker is open after repeated failures, or every
    /// slot for calls in flight stayed taken for the whole timeout. Nothing was spent.
    Unavailable {
        /// About how long until the breaker lets a call try the backend again; when every slot
        /// for calls in flight stayed taken, the store's timeout.
        retry_in: Duration,
    },
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ZeroCost => f.write_str("a request must cost at least one token"),
            Self::CostAboveBurst { cost, burst } => write!(
                f,
                "a cost of {cost} tokens can never be served by a burst of {burst}"
            ),
            Self::TokensAboveBurst { tokens, burst } => write!(
                f,
                "a bucket of burst {burst} cannot be set to hold {tokens} tokens"
            ),
            Self::WrongType {
                bucket,
                fingerprint,
            } => write!(
                f,
                "the store key of bucket {bucket:?}, key fingerprint {fingerprint}, holds a value that is not a bucket"
            ),
            Self::CorruptBucket {
                bucket,
                fingerprint,
            } => write!(
                f,
                "the store key of bucket {bucket:?}, key fingerprint {fingerprint}, holds a value no store could have written"
            ),
            Self::AuditNotAStream {
                bucket,
                fingerprint,
            } => write!(
                f,
                "the audit stream of bucket {bucket:?}, key fingerprint {fingerprint}, is a key that holds something other than a stream"
            ),
            Self::Leased {
                bucket,
                fingerprint,
            } => write!(
                f,
                "tokens of bucket {bucket:?}, key fingerprint {fingerprint}, are out on lease; only a store in lease mode decides on it until they are back"
            ),
            Self::NotLeasable => f.write_str(
                "a store in lease mode takes no reservation (max_wait above zero) and no request on several buckets",
            ),
            Self::TooManyBuckets { max } => write!(
                f,
                "the store holds its most buckets ({max}), all in debt, and cannot take a new key"
            ),
            Self::SameBucketTwice {
                bucket,
                fingerprint,
            } => write!(
                f,
                "bucket {bucket:?}, key fingerprint {fingerprint}, is named twice in one request"
            ),
            Self::TooManyAtOnce { count, max } => write!(
                f,
                "one request draws from {count} buckets; at most {max} are taken at once"
            ),
            Self::CrossSlot => f.write_str(
                "the buckets of one request live in different Redis Cluster hash slots; key them by the same account to keep them in one",
            ),
            Self::Backend(e) => fmt::Display::fmt(e, f),
            Self::Timeout { after } => write!(f, "the store did not answer within {after:?}"),
            Self::Unavailable { retry_in } => write!(
                f,
                "the store is unavailable after repeated failures (next try in {retry_in:?})"
            ),
        }
    }
}

impl StdError for StoreError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match self {
            Self::Backend(e) => e.source(),
            _ => None,
        }
    }
}

/// A failure of the store's backend. Opaque: its cause is the [`source`](StdError::source).
pub struct BackendError {
    context: &'static str,
    source: Option<Box<dyn StdError + Send + Sync>>,
}

impl BackendError {
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn new(
        context: &'static str,
        source: Option<Box<dyn StdError + Send + Sync>>,
    ) -> Self {
        Self { context, source }
    }
}

impl fmt::Debug for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendError")
            .field("context", &self.context)
            .field("source", &self.source)
            .finish()
    }
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.context)
    }
}

impl StdError for BackendError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn StdError + 'static))
    }
}
