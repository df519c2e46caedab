//! Where buckets live: the [`BucketStore`] trait and its backends.
//!
//! Both front ends hand every decision to a store; neither has arithmetic of its own. Two stores
//! ship with the crate and decide identically, to the last bit of the stored state:
//!
//! - [`MemoryStore`]: in this process. The embedded default, and the one to use in unit tests.
//! - [`RedisStore`] (feature `redis`): shared by every process that reaches the same Redis, so
//!   many workers on many hosts spend one budget.
//!
//! # Generic or boxed
//!
//! [`BucketStore`] returns `impl Future` from each method, so code generic over `S: BucketStore`
//! calls a store with no boxing and no dynamic dispatch on the hot path. Such a trait cannot be a
//! trait object itself; where one type must hold any store, use `Arc<dyn DynBucketStore>`:
//! [`DynBucketStore`] is implemented for every `BucketStore`, and `Arc<dyn DynBucketStore>` is
//! itself a `BucketStore` (each call then boxes one future).
//!
//! ```
//! use std::sync::Arc;
//! use burstgate::{BucketStore, DynBucketStore, MemoryStore};
//!
//! fn takes_any<S: BucketStore>(_: S) {}
//!
//! let store: Arc<dyn DynBucketStore> = Arc::new(MemoryStore::new());
//! takes_any(store);
//! ```
//!
//! # Files
//!
//! The trait is here, and beside it:
//!
//! - `decision.rs`: what a store answers: [`Decision`], [`Reservation`] (and which bucket gave
//!   its tokens), [`BucketState`], [`Claim`];
//! - `take.rs`: what [`acquire_all`](BucketStore::acquire_all) is asked, [`Take`] and
//!   [`MAX_TAKES`], and the checks every store makes on its arguments before any is asked;
//! - `dyn_store.rs`: [`DynBucketStore`], and `Arc<dyn DynBucketStore>` as a store;
//! - `sharding.rs`: how the sharded tables hash a key and pick its shard;
//! - `memory/`: [`MemoryStore`]; `redis/` (feature `redis`): [`RedisStore`].

use std::future::Future;
use std::time::{Duration, SystemTime};

#[cfg(feature = "redis")]
pub(crate) use crate::error::BackendError;
pub(crate) use crate::error::StoreError;
use crate::{BucketKey, Limit};

mod audit;
mod decision;
mod dyn_store;
mod memory;
mod outage;
pub(crate) mod sharding;
mod take;
pub use audit::Audit;
#[cfg(feature = "redis")]
pub(crate) use decision::Source;
pub use decision::{BucketState, Claim, Decision, Reservation};
#[cfg(any(feature = "redis", feature = "tower"))]
pub(crate) use dyn_store::BoxFuture;
pub use dyn_store::DynBucketStore;
pub use memory::MemoryStore;
pub use outage::OutagePolicy;
#[cfg(feature = "tower")]
pub(crate) use outage::is_outage;
#[cfg(any(feature = "tower", feature = "redis"))]
pub(crate) use outage::share;
pub use take::{MAX_TAKES, Take};
pub(crate) use take::{check_cost, check_takes, check_tokens};

#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "redis")]
pub use self::redis::raw;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use self::redis::{Breaker, Leases, RedisStore};

/// A place that keeps token buckets and decides on them atomically.
///
/// Every method names the bucket by a [`BucketKey`] and passes the [`Limit`] that governs it; the
/// store keeps only the bucket's state (tokens available at a time), so a limit can change between
/// deploys and the next call simply uses the new one. Time comes from the store's
/// [`Clock`](crate::Clock).
pub trait BucketStore: Send + Sync + 'static {
    /// The time the store decides at: its clock's, so a caller that works out deadlines for it
    /// (a back-off's end, a ticket's expiry) counts on the same time as its buckets. By default
    /// the system clock; the stores of this crate read their own [`Clock`](crate::Clock) (on
    /// a `RedisStore`, by default the time Redis counts, shared by every host).
    fn now(&self) -> SystemTime {
        SystemTime::now()
    }

    /// Takes `cost` tokens from the bucket.
    ///
    /// - Enough tokens now: admitted, [`Decision::wait`] is zero.
    /// - Not enough, but they refill within `max_wait`: the tokens are taken now (the bucket goes
    ///   into debt) and the caller is admitted after [`Decision::wait`]. Later callers queue
    ///   behind it, so waiting callers are served in arrival order, each with one call and no
    ///   retries. A caller that gives up [`refund`](Self::refund)s its
    ///   [`Decision::reservation`].
    /// - Otherwise: denied, nothing is taken, and [`Decision::retry_after`] says when the cost
    ///   could be served.
    ///
    /// `max_wait` of zero is the plain decision. A `cost` of zero or above the limit's burst is
    /// an error, never a wait: such a request could never be served.
    fn acquire(
        &self,
        key: &BucketKey,
        limit: Limit,
        cost: u32,
        max_wait: Duration,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send;

    /// Takes tokens from several buckets for one request, all or none, in one atomic step: an
    /// API's per-endpoint limit and its per-account one, or two windows ("20/s and 1000/h").
    ///
    /// - Every bucket admits, or none is touched: a request refused on one bucket takes nothing
    ///   from the others, and nobody ever sees their tokens gone meanwhile.
    /// - The request goes when the last of its buckets has its tokens: every decision's
    ///   [`wait`](Decision::wait) is that one wait, and each bucket's slot is taken at that
    ///   time. A bucket that had the tokens sooner is debited as if the request arrived at the
    ///   slot: what it would refill above its burst meanwhile is lost, so one bucket's wait never
    ///   lets requests through another faster than its limit.
    /// - Denied when that wait exceeds `max_wait`; each decision then says its own bucket's
    ///   [`retry_after`](Decision::retry_after) (zero for a bucket that had the tokens), and
    ///   the request's is the largest.
    ///
    /// The decisions come in the order of `takes`, each with its own
    /// [`reservation`](Decision::reservation): a request abandoned before it goes gives each
    /// bucket's tokens back with [`refund`](Self::refund), under that bucket's rules. With one
    /// bucket this is [`acquire`](Self::acquire), to the last bit of the stored state; with none,
    /// an empty list.
    ///
    /// # Errors
    ///
    /// As [`acquire`](Self::acquire) for any of the buckets, and before any store is asked:
    /// [`StoreError::SameBucketTwice`] for a bucket named twice, and
    /// [`StoreError::TooManyAtOnce`] for more than [`MAX_TAKES`] buckets. On a Redis Cluster
    /// the buckets must share a hash slot: see [`RedisStore`]'s "Keys".
    fn acquire_all(
        &self,
        takes: &[Take<'_>],
        max_wait: Duration,
    ) -> impl Future<Output = Result<Vec<Decision>, StoreError>> + Send;

    /// What the bucket holds now, and the halt of its latest drain
    /// ([`BucketState::halted_until`]), without taking or writing anything.
    fn peek(
        &self,
        key: &BucketKey,
        limit: Limit,
    ) -> impl Future<Output = Result<BucketState, StoreError>> + Send;

    /// Gives back the tokens of an admission whose request never went out, named by its
    /// [`Reservation`] (from [`Decision::reservation`]). The bucket never goes above its
    /// the burst, and a refund does not give away a slot another reservation holds:
    ///
    /// - A reservation still waiting for its slot gives its tokens back only while it is the
    ///   last one queued. Refunding one from the middle of the queue would free the slot at the
    ///   tail, where the next caller would be booked onto the same millisecond as the caller
    ///   already waiting there.
    /// - An admission whose slot has come gives its tokens back only while the bucket is in no
    ///   debt (no reservation is queued behind it).
    ///
    /// Otherwise the tokens stay spent: budget lost, the safe direction. A refund made twice
    /// in a row (a retry) gives a reservation's tokens back once; for an admission with no wait,
    /// a second refund can give them back again, never above the burst.
    ///
    /// A reservation is named by its cost and slot, nothing more. A refund repeated after the
    /// slot it freed was booked again, by a reservation of the same cost, frees that booking;
    /// and under a limit that refills more than a quarter of a token per millisecond (one token
    /// every 4 ms or faster), a reservation still waiting is never refunded: slots there are too
    /// close together to tell one from the next, and its tokens stay spent.
    fn refund(
        &self,
        key: &BucketKey,
        limit: Limit,
        reservation: Reservation,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Empties the bucket until `until`: no tokens before it, refill from it. Used when the
    /// upstream answers 429 with a time to wait, so that every worker sharing the bucket backs
    /// off, not only the one that was told.
    ///
    /// - The bucket is empty *at* `until`, so the first token arrives one token period
    ///   (`interval / tokens`) after it. To let one request go at exactly `T`, drain until `T`
    ///   minus one token period.
    /// - Reservations already queued keep their places; a drain that ends before the last of them
    ///   changes nothing, so a drain repeated (a retry) is the drain once.
    /// - A deadline already past still empties the bucket now; one more than 2^44 ms (about 557
    ///   years) ahead is taken as that.
    /// - The drain records a halt, the time of its first token (kept if a later one is recorded
    ///   already), which [`peek`](Self::peek) reports: a reservation granted before the drain
    ///   whose slot is earlier must not go at its slot ([`BucketState::halts`]). Reservations keep
    ///   their places in the queue all the same; the halt only tells their holders.
    fn drain_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Lowers the bucket to hold at most `tokens` whole tokens now, when it holds more; never
    /// raises it. For a client whose upstream reports on each answer how much of the budget is
    /// left (`X-Ratelimit-Remaining`, the `RateLimit` field): when someone else spends the same
    /// budget (the account's other integrations), or Redis forgot what was spent, the shared
    /// bucket comes down to what the upstream has, and every worker slows down with it.
    ///
    /// - Returns whether the bucket was lowered: `false` when it held `tokens` whole tokens or
    ///   fewer (a bucket in debt, with reservations queued, holds fewer than any report), and
    ///   then nothing is written.
    /// - A lowered bucket keeps its fraction of the next token (a count of requests left says
    ///   nothing of the upstream's), and refills from there at the limit's rate, from the
    ///   later of the store's clock and the bucket's stored time. Reservations already queued
    ///   keep their slots; the halt of a drain is kept.
    /// - A `tokens` at or above the burst never lowers anything, and is not an error: upstreams
    ///   with a larger burst report more than the bucket can hold.
    fn lower_to(
        &self,
        key: &BucketKey,
        limit: Limit,
        tokens: u32,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Books the one-time mark `id` beside `key`'s bucket, to be kept until `until`: the trace
    /// a booked turn (a middleware [`Ticket`](crate::middleware::Ticket)) leaves in the store,
    /// without which it is never sent. [`claim`](Self::claim) spends it once. The bucket itself
    /// is not touched.
    ///
    /// `id` is the caller's (a ticket's random nonce). A mark is kept at least until `until`,
    /// and at most 2^44 ms (about 557 years) ahead; one whose `until` is not after now is not
    /// written, and a claim finds it missing. A mark of that id already there is left as it is: a mark
    /// goes from booked to spent, never back. Redis keeps it as its own key beside the bucket's,
    /// `<bucket key>:t:<id>` (in the bucket's Cluster slot), set with `SET NX PX`.
    ///
    /// # Errors
    ///
    /// A [`StoreError`] when the store does not answer. On Redis, whatever the outage policy:
    /// a mark kept anywhere but in Redis would be missing to every other process.
    fn book(
        &self,
        key: &BucketKey,
        id: &str,
        until: SystemTime,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Spends the one-time mark `id` of `key`'s bucket, [`book`](Self::book)ed before: a booked
    /// turn that must be sent, or given back, once, however many copies of it a job queue
    /// delivers, in whichever process shares the store. The bucket itself is not touched.
    ///
    /// - [`Claim::First`]: the mark was booked, and is spent now (it keeps its time).
    /// - [`Claim::Spent`]: it was spent already.
    /// - [`Claim::Missing`]: the store holds no mark of that id. It was never booked, its time
    ///   has passed, or the store lost it (a `FLUSHALL`, a restart of a Redis without
    ///   persistence, a failover to a replica that had not received it). The store cannot tell
    ///   whether it was spent: a caller that must not act twice refuses it.
    ///
    /// On Redis, one small script reads the mark and, when it says booked, rewrites it as spent
    /// keeping its expiry (`KEEPTTL`), in one atomic step. A mark's key that holds anything else
    /// (a value someone else wrote, or a mark spent by a build that wrote no bookings) is spent.
    ///
    /// # Errors
    ///
    /// A [`StoreError`] when the store does not answer, whatever the outage policy: no local
    /// table can say whether another process spent the mark. A claim that timed out may have
    /// spent it.
    fn claim(
        &self,
        key: &BucketKey,
        id: &str,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// Forgets the bucket (an admin operation): the next call finds it full, with no halt, as a
    /// bucket never used. The limit is not needed, since a missing bucket is full under any.
    ///
    /// Reservations already granted are not called back. Their holders still send at their
    /// slots, and the bucket no longer counts the tokens they took, so until the last of those
    /// slots more than the burst may go: the burst at once, and the reserved requests at their
    /// slots. That is at most about what refills within the longest `max_wait` callers reserve
    /// with (under the front ends' default ceiling of two token periods per cost, two tokens
    /// per cost). The reset also drops any halt, so a holder that checks
    /// [`BucketState::halts`] is not told either.
    fn reset(&self, key: &BucketKey) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Sets the bucket to hold exactly `tokens` whole tokens now (an admin operation), refilling
    /// from now at the limit's rate: 0 empties it, with the first token one token period from
    /// now; the burst fills it. A `tokens` above the limit's burst is
    /// [`StoreError::TokensAboveBurst`], never capped in silence. "Now" is the later of the
    /// store's clock and the bucket's stored time, as for every write.
    ///
    /// What the bucket held or owed is replaced, so:
    ///
    /// - The debt of queued reservations is forgotten, as with [`reset`](Self::reset): their
    ///   holders still send at their slots, so until the last of them up to `tokens` plus the
    ///   tokens they took may go.
    /// - The halt of an earlier drain or block is dropped, and [`peek`](Self::peek) reports
    ///   none: a halt means that every reservation granted after it is slotted at it or later,
    ///   which a bucket set to hold tokens now no longer keeps, so a halt left in place would send
    ///   reservations granted after the set back to the queue for nothing.
    fn set(
        &self,
        key: &BucketKey,
        limit: Limit,
        tokens: u32,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Admits nothing before `until`, and a request of one token at `until`, to the millisecond
    /// (an admin operation): a customer blocked until a time. A request of more tokens goes once
    /// they have refilled after it.
    ///
    /// - Unlike [`drain_until`](Self::drain_until), which empties the bucket *at* its deadline,
    ///   so that the first token comes one token period later.
    /// - Reservations granted while the bucket is blocked are slotted at `until` or later.
    ///   Those queued past `until` already keep their places, and the first admission then
    ///   comes after them.
    /// - The block records a halt at `until`, kept if a later one is recorded already, as a
    ///   drain does: a reservation granted before the block whose slot is earlier must not go at
    ///   its slot ([`BucketState::halts`]).
    /// - A `until` not after now changes nothing; one more than 2^44 ms (about 557 years) ahead
    ///   is taken as that.
    fn block_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}
