//! Token-bucket rate limiting with burst, shared across processes through Redis or kept in
//! memory.
//!
//! A [`Limit`] says how fast requests may go ("1 per minute, burst 10"), a [`BucketKey`] says
//! whose budget a request spends, and a [`BucketStore`] decides, atomically, whether it may go
//! now, after a wait, or not yet:
//!
//! ```
//! use std::time::Duration;
//! use burstgate::{BucketKey, BucketStore, Limit, ManualClock, MemoryStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // A clock that moves only when told to, so the outcome is exact.
//! let clock = ManualClock::new(0);
//! let store = MemoryStore::new().with_clock(clock.clone());
//!
//! // "1 request per minute, burst 10", per seller account.
//! let orders = Limit::per_minute(1)?.with_burst(10)?;
//! let seller = BucketKey::new("orders", "seller-42")?;
//!
//! // A full bucket lets ten requests go at once...
//! for _ in 0..10 {
//!     let decision = store.acquire(&seller, orders, 1, Duration::ZERO).await?;
//!     assert!(decision.is_admitted());
//! }
//!
//! // ...the eleventh is told to come back when the next token has refilled...
//! let eleventh = store.acquire(&seller, orders, 1, Duration::ZERO).await?;
//! assert!(!eleventh.is_admitted());
//! assert_eq!(eleventh.retry_after(), Some(Duration::from_secs(60)));
//!
//! // ...and a minute later it goes.
//! clock.advance(Duration::from_secs(60));
//! let retried = store.acquire(&seller, orders, 1, Duration::ZERO).await?;
//! assert!(retried.is_admitted());
//! assert_eq!(retried.remaining(), 0);
//! # Ok(())
//! # }
//! ```
//!
//! # What it is for
//!
//! Calling a third-party API that limits each account per endpoint, with a burst allowance, from
//! many workers in many processes at once; and protecting a service's own endpoints. A
//! fixed-window counter (`INCR` + `PEXPIRE`) gets both wrong: it ignores the burst, so the first
//! ten pages of a "1 per minute, burst 10" endpoint go out one per window instead of at once, and
//! it lets twice the limit through across a window boundary, which earns real 429s on endpoints
//! without a burst. A token bucket has neither defect, and a bucket kept in Redis is one budget
//! for every worker that reaches that Redis.
//!
//! # Limits
//!
//! A [`Limit`] is `tokens` per `interval` with a bucket of `burst` tokens (by default `burst ==
//! tokens`). The bucket starts full, admits `burst` requests at once, and refills continuously
//! at `tokens / interval`. Build one with [`Limit::per_second`], [`Limit::per_minute`],
//! [`Limit::per_hour`], [`Limit::per_day`] or [`Limit::new`], and set the burst with
//! [`Limit::with_burst`]; [`Limit::published`] takes the three columns an API's documentation
//! usually prints (period, limit, burst). A limit also reads from text, as a configuration file
//! writes it: `"10/s burst 20"`, `"1 per minute burst 10"`, `"100/hour"` (the
//! [grammar](Limit#text)). Every constructor validates its input and returns [`InvalidLimit`]
//! for zero tokens, a zero burst, an interval that is zero or not a whole number of
//! milliseconds, or a limit so slow its arithmetic would lose precision, so nothing can go wrong
//! at request time.
//!
//! A request may cost more than one token. A cost of zero, or above the burst, could never be
//! served, so the store answers it at once with [`StoreError::ZeroCost`] or
//! [`StoreError::CostAboveBurst`] instead of a wait.
//!
//! # Stores
//!
//! Every decision is made by a [`BucketStore`]. Two ship with the crate, and they decide
//! identically:
//!
//! - [`MemoryStore`] keeps the buckets in this process. It is the store for a single process and
//!   for unit tests. It forgets buckets that have refilled to full, since a missing bucket is a
//!   full one.
//! - [`RedisStore`] (feature `redis`) keeps them in Redis, so every process that reaches the same
//!   Redis spends the same budget. It works on a `MultiplexedConnection`, a reconnecting
//!   `ConnectionManager` or a Redis Cluster connection. Each bucket is one 24-byte string, `t`,
//!   `ts` and `keep` as three little-endian `f64`s (32 bytes for a while after a drain, with the
//!   drain's halt as a fourth), under the key `<prefix>:v4:<bucket>:{<key>}`
//!   (prefix `burstgate` by default, `v4` the version of the key scheme and stored format, the
//!   caller's key the Redis Cluster hash tag; keys from earlier builds are never read and expire
//!   by their own TTL), read and written by one Lua script: one `GET`, and one `SET` when the state changes. Every write keeps the key at
//!   least until the bucket is full again plus one interval, mostly by leaving its expiry as it
//!   is (`KEEPTTL`); an idle bucket simply expires, and the next request sees a full bucket,
//!   which is what it would have computed anyway.
//!
//! The key part of a [`BucketKey`] is percent-escaped, so it cannot break out of the namespace or
//! collide with another, and hashed when long. [`BucketKey::keyed`] always stores an HMAC-SHA256
//! under an application [`KeySecret`], for secrets such as API tokens and `Authorization` values:
//! they never reach Redis or a log in clear, and a reader of either cannot test guesses against
//! them. See [Security](#security) for what each reader can learn.
//!
//! Code generic over `S: BucketStore` calls the store without boxing. Where one type must hold
//! any store, use `Arc<dyn DynBucketStore>`: [`DynBucketStore`] is implemented for every store,
//! and `Arc<dyn DynBucketStore>` is itself a `BucketStore`.
//!
//! # Reservations
//!
//! [`BucketStore::acquire`] takes a `max_wait`. With `Duration::ZERO` it is the plain decision:
//! admitted now, or denied with [`Decision::retry_after`]. With a longer `max_wait`, a request
//! whose tokens refill within it is admitted *after a wait*: the store takes the tokens now,
//! letting the bucket go into debt, and answers with [`Decision::wait`]. The caller sleeps that
//! long and sends. Callers that wait are served in the order they asked, each with one store
//! call and no retry loop. A request that would have to wait longer than `max_wait` is denied and
//! takes nothing. [`Limit::default_max_wait`] is two token periods per unit of cost: two minutes
//! for a "1 per minute" endpoint.
//!
//! A caller that gives up on its reservation hands the tokens back with
//! [`BucketStore::refund`], naming it by its [`Reservation`]: the tokens go back only while no
//! other caller is queued behind it, so a refund never frees a slot someone else holds. When the
//! upstream answers 429 anyway, [`BucketStore::drain_until`] empties the shared bucket until the
//! time it names, so every worker backs off, not only the one that was told. The first new token
//! arrives one token period after it.
//!
//! ```
//! use std::time::Duration;
//! use burstgate::{BucketKey, BucketStore, Clock, Limit, ManualClock, MemoryStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let clock = ManualClock::new(0);
//! let store = MemoryStore::new().with_clock(clock.clone());
//! let sales = Limit::per_minute(1)?; // no burst
//! let key = BucketKey::new("sales", "seller-42")?;
//! let max_wait = sales.default_max_wait(1);
//! assert_eq!(max_wait, Duration::from_secs(120));
//!
//! // The first goes now, the next two are admitted after one and two minutes.
//! let mut last = None;
//! for expected in [0, 60, 120] {
//!     let decision = store.acquire(&key, sales, 1, max_wait).await?;
//!     assert!(decision.is_admitted());
//!     assert_eq!(decision.wait(), Duration::from_secs(expected));
//!     last = decision.reservation();
//! }
//!
//! // A fourth would wait three minutes, more than it may: denied, nothing taken.
//! let fourth = store.acquire(&key, sales, 1, max_wait).await?;
//! assert_eq!(fourth.retry_after(), Some(Duration::from_secs(180)));
//!
//! // The third caller, last in the queue, gives up, and its slot goes back.
//! store.refund(&key, sales, last.expect("admitted")).await?;
//! let fourth = store.acquire(&key, sales, 1, max_wait).await?;
//! assert_eq!(fourth.wait(), Duration::from_secs(120));
//!
//! // Another account's bucket is hit by an upstream 429 with `Retry-After: 30`.
//! let other = BucketKey::new("sales", "seller-7")?;
//! store.drain_until(&other, sales, clock.now() + Duration::from_secs(30)).await?;
//! let quota = store.peek(&other, sales).await?;
//! assert_eq!(quota.remaining(), 0);
//! assert_eq!(quota.next_token_in(), Duration::from_secs(30 + 60));
//! # Ok(())
//! # }
//! ```
//!
//! # Clocks
//!
//! Stores take the time from a [`Clock`], never from Redis, so tests can be exact and the script
//! stays safe to replicate. Buckets shared across hosts compare times written by different
//! processes, so every clock counts wall time from the Unix epoch.
//!
//! - [`SystemClock`], [`MemoryStore`]'s default: the machine's wall clock.
//! - [`ManualClock`]: moves only when told to; clones share one time. For unit tests.
//! - [`TokioClock`]: wall time that advances with tokio's clock, so tests that wait can run
//!   under `#[tokio::test(start_paused = true)]` and take no real time. Create it inside the
//!   runtime.
//! - [`QuantaClock`] (feature `quanta`): the CPU's time-stamp counter, counted from the wall
//!   time at its creation. Cheaper to read than [`SystemClock`], which shows on a
//!   [`MemoryStore`]; it does not follow later steps of the wall clock, so it is for buckets kept
//!   in one process only.
//! - `ServerClock` (feature `redis`), `RedisStore`'s default: the system clock corrected by its
//!   offset from Redis's, measured with `TIME` apart from any decision, so that every host counts
//!   the same time. Without it the host whose clock runs ahead finds each freed token of a
//!   contended bucket first.
//!
//! ```
//! use std::time::Duration;
//! use burstgate::{BucketKey, BucketStore, Limit, MemoryStore, TokioClock};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // In a `#[tokio::test(start_paused = true)]`:
//! let store = MemoryStore::new().with_clock(TokioClock::starting_at(0));
//! let limit = Limit::per_minute(1)?;
//! let key = BucketKey::new("sales", "seller-42")?;
//!
//! store.acquire(&key, limit, 1, Duration::ZERO).await?;
//! let reserved = store.acquire(&key, limit, 1, Duration::from_secs(60)).await?;
//! tokio::time::sleep(reserved.wait()).await; // returns at once: time is paused
//! assert_eq!(store.peek(&key, limit).await?.next_token_in(), Duration::from_secs(60));
//! # Ok(())
//! # }
//! ```
//!
//! # Feature flags
//!
#![doc = document_features::document_features!()]
//!
//! Without any feature, the crate is [`MemoryStore`] and the types around it.
//!
//! # Calling a rate-limited API
//!
//! With the `reqwest` feature, [`RateLimitMiddleware`] spends a shared budget before each
//! request of a `reqwest_middleware` client: it waits its turn through a reservation, never sends
//! a request the budget does not allow (the "local 429", a [`RateLimited`] error), and drains the
//! shared bucket when the upstream still answers 429. See the [`middleware`] module.
//!
//! # Protecting a service
//!
//! With the `tower` feature, [`RateLimitLayer`] puts [`layer::Rule`]s on any tower HTTP service:
//! a request over its limit is answered `429 Too Many Requests` with `Retry-After` and the IETF
//! `RateLimit-Policy` / `RateLimit` fields, and never reaches the service. The [`layer`] module
//! explains how it decides (per request, in `call`), how several rules combine, and its waiting
//! mode.
//!
//! # Security
//!
//! A reader of Redis sees bucket names, what each bucket has spent and when, and each key as it
//! was stored: escaped in clear ([`BucketKey::new`], IP addresses, accounts), as a plain SHA-256
//! that guesses can be tested against ([`BucketKey::hashed`], `KeyExtractor::header`, the
//! middleware's `account_header` without a secret), or as an HMAC-SHA256 under your
//! [`KeySecret`] that tells nothing without it ([`BucketKey::keyed`],
//! `KeyExtractor::keyed_header`, `RateLimitMiddleware::key_secret`): use the keyed forms for
//! anything secret. A reader of the logs sees bucket names, counts, waits and
//! [`fingerprint`](BucketKey::fingerprint)s, keyed with your [`KeySecret`] once a front end has
//! one (or [`KeySecret::key_fingerprints`] chose it), else with a salt drawn once per process,
//! so that they cannot be reversed by trying keys; errors name keys the same way. A [`MemoryStore`]
//! holds a bounded number of buckets, so a flood of made-up keys costs bounded memory.
//!
//! # When the store fails
//!
//! [`RedisStore`] bounds every call with a timeout, retries once what Redis refused before
//! running it, and puts a circuit breaker ([`Breaker`]) in front of Redis, so that while Redis is
//! down calls are answered at once. What they answer is its [`OutagePolicy`]: fail closed (the
//! default: an error, which the reqwest middleware returns without sending the request), fail
//! open, or a local bucket with this process's share of the limit. The tower layer has a
//! policy of its own for the errors its store returns, by default a decision in this process
//! with each rule's whole limit, so that a server's limiter is not its outage
//! (`RateLimitLayer::on_outage`). A key of the wrong type under the prefix is
//! [`StoreError::WrongType`], naming the key by its bucket and fingerprint, under every policy.
//! Nothing panics.
//!
//! # Arithmetic and units
//!
//! Time is whole milliseconds since the Unix epoch; tokens are `f64`. One pure Rust function is
//! the reference, and the Redis script mirrors it operation for operation, so both stores reach
//! the same decisions, the same waits and the same stored state to the last bit. To keep every
//! time exact in an `f64`, times are clamped to 2^53 − 1 ms (about 285,000 years after 1970),
//! `max_wait` is clamped to 2^44 ms (about 557 years), and a [`Limit`]'s interval and refill time
//! are each at most 2^42 ms. A clock behind the stored time refills nothing, and the stored time
//! never moves backwards, so clock skew between workers costs throughput and cannot pile up extra
//! admissions: the excess is bounded by the largest skew times the rate, once.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod bucket;
#[cfg(any(feature = "tower", feature = "reqwest"))]
mod cancel;
mod clock;
mod error;
mod key;
#[cfg(feature = "tower")]
#[cfg_attr(docsrs, doc(cfg(feature = "tower")))]
pub mod layer;
mod limit;
#[cfg(any(feature = "tower", feature = "reqwest"))]
mod log_gate;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
#[cfg(feature = "reqwest")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest")))]
pub mod middleware;
#[cfg(any(feature = "tower", feature = "reqwest"))]
mod pattern;
#[cfg(feature = "seller")]
#[cfg_attr(docsrs, doc(cfg(feature = "seller")))]
pub mod seller;
mod store;
mod text;

#[cfg(feature = "quanta")]
#[cfg_attr(docsrs, doc(cfg(feature = "quanta")))]
pub use clock::QuantaClock;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use clock::ServerClock;
pub use clock::{Clock, ManualClock, SystemClock, TokioClock};
pub use error::{
    BackendError, InvalidKey, InvalidLeases, InvalidLimit, InvalidName, ParseLimitError,
    RateLimited, StoreError,
};
pub use key::{BucketKey, BucketName, KeySecret};
#[cfg(feature = "tower")]
#[cfg_attr(docsrs, doc(cfg(feature = "tower")))]
pub use layer::RateLimitLayer;
pub use limit::Limit;
#[cfg(feature = "reqwest")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest")))]
pub use middleware::RateLimitMiddleware;
/// The redis-rs crate this one is built on, whose connection types [`RedisStore`] takes: use it
/// to open connections of the version the store expects.
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use redis;
pub use store::{
    Audit, BucketState, BucketStore, Claim, Decision, DynBucketStore, MAX_TAKES, MemoryStore,
    OutagePolicy, Reservation, Take,
};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use store::{Breaker, Leases, RedisStore};

/// Not part of the stable API: anything here may change or go in any release, patch releases
/// included. It exists for the tools of this crate's workspace (`tools/`), which speak the
/// bucket script's wire format through the store's own code (`raw`: the store's acquire, and the
/// script) instead of keeping a copy.
#[cfg(feature = "redis")]
#[doc(hidden)]
pub mod __private {
    pub use crate::store::raw;
}

// The README's examples need the `redis`, `tower`, `reqwest` and `metrics` features to compile.
#[doc = include_str!("../README.md")]
#[cfg(all(
    doctest,
    feature = "redis",
    feature = "tower",
    feature = "reqwest",
    feature = "metrics"
))]
pub struct ReadmeDoctests;

// The Rust examples of docs/OPERATIONS.md, compiled as doctests like the README's.
#[doc = include_str!("../docs/OPERATIONS.md")]
#[cfg(all(doctest, feature = "redis", feature = "tower"))]
pub struct OperationsDoctests;
