// Over 600 lines: one idea, the in-memory store: its table protocol and its BucketStore impl.
//! The in-process store: `MemoryStore`, its constructors and its `BucketStore` impl, and the
//! decision's hot path (`with_bucket`). The pieces it is made of live beside it:
//!
//! - `layout.rs`: how many shards a store has, and how many buckets each holds, from its bound
//!   and the machine's thread count;
//! - `shard.rs`: a shard, its lock, its new keys and the decisions on them, its rebuilds and
//!   what it forgets at its bound;
//! - `table.rs`: a shard's table, never changed once made, and each bucket's own lock
//!   (FREE, HELD, GONE);
//! - `view.rs`: each thread's references to the tables, so that finding one writes no shared
//!   memory;
//! - `key.rs`: a key as a table holds it, inline when short;
//! - `halts.rs`: the halts of drained buckets, kept beside the buckets;
//! - `marks.rs`: the one-time marks of booked turns, kept beside the buckets.
//!
//! How decisions and rebuilds share a table, and the invariants the code relies on:
//! docs/DESIGN.md#memorystore.

use std::fmt;
use std::future::{Future, ready};
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use hashbrown::HashTable;
use spinning_top::Spinlock;

use crate::bucket::{self, Params, PerBucket, State, Write};
use crate::clock::{Clock, SystemClock, deadline_ms, whole_ms};
use crate::store::sharding::{self, key_hash};
use crate::store::{
    BucketState, BucketStore, Claim, Decision, Reservation, StoreError, Take, check_cost,
    check_takes, check_tokens,
};
use crate::{BucketKey, Limit};

mod halts;
mod key;
mod layout;
mod marks;
mod shard;
mod table;
mod view;

#[cfg(test)]
mod tests;

use layout::Layout;
use shard::{Full, Padded, Shard, lock};
use table::Table;
use view::{NEXT_STORE, VIEWS};

/// The most buckets a store holds unless built with [`MemoryStore::bounded`] (what a bucket costs:
/// the type's docs; what the default bound takes in all: docs/PERFORMANCE.md).
const DEFAULT_MAX_BUCKETS: usize = 1 << 20;

/// Buckets in this process's memory: the embedded default, and the store for unit tests.
///
/// Decisions are exact under any contention: each bucket is read and written under a lock of its
/// own, on the bucket's own cache line. A decision on a bucket that exists finds it through a
/// table that is never changed once made, without taking any lock but the bucket's, so threads
/// deciding for different keys write to no memory in common and do not wait for each other.
/// Cloning is cheap and clones share the buckets.
///
/// Buckets are spread over shards (a power of two: 8 per thread the machine runs, at least 16,
/// for a large bound; one for a bound below 2,048; see [`bounded`](Self::bounded)). A key new to
/// its shard waits in the shard's list of new keys, decided under the shard's
/// lock, until the shard next rebuilds its table: at most a second later in a small store (a
/// few seconds in a large one), or sooner when many new keys arrive or the key is decided often.
///
/// # Memory
///
/// A bucket that has refilled to full says nothing a missing one would not (a missing bucket is a
/// full one), so it is dropped. A shard that new keys reach rebuilds its table at most once a
/// second, and a millisecond less often per bucket it holds (every four seconds or so at 4,096
/// buckets; sooner while its new keys pile up), and leaves out buckets that have been full
/// for a second or more; [`sweep`](Self::sweep) rebuilds every shard at once and leaves out
/// every full bucket. A million keys seen once therefore do not stay in memory longer than their
/// refill time and a few seconds, once traffic on new keys or a sweep reaches their shard.
///
/// The store holds a bounded number of buckets: a bound of 1,048,576 (2^20) unless built with
/// [`bounded`](Self::bounded), shared out over the shards with some headroom each (1,179,648 at
/// most on a machine of up to 32 threads, [`max_buckets`](Self::max_buckets)); below its bound
/// the store forgets nothing and refuses nothing (`bounded` says how exactly). A key new to a
/// shard that holds its most buckets first makes the shard drop its full buckets; if that is not
/// room enough, the shard forgets buckets down to seven eighths of its most, those that will be
/// full soonest first.
/// A forgotten bucket starts full when its key comes back, so its key gains the tokens it had
/// spent and not yet refilled: at most its burst. The choice is by time, since a bucket does not
/// know its limit: a bucket of a fast limit that spent its whole burst can be full sooner, and
/// so be forgotten before, one of a slow limit that spent a single token. A bucket in debt
/// (reservations wait on it, or a drain holds it empty) is never forgotten; a new key that finds
/// its shard full of such buckets is refused with [`StoreError::TooManyBuckets`], and nothing
/// is forgotten; for a second after that, new keys of that shard are refused without looking
/// again. A flood of made-up keys (a
/// header-keyed rule under attack) therefore costs a bounded amount of memory, and over-admits
/// only the keys it pushes out, each by less than its burst. A bucket costs its 64-byte slot,
/// about 11 to 21 bytes of index (a 4-byte entry, the index between three sixteenths and three
/// eighths full), and, for a
/// key longer than 30 bytes (a hashed key is the bucket name and 65 more), the key on the heap; `tools/src/memory_flood.rs` prints what a
/// flood costs. The bound counts the buckets of the current tables; a thread that decided on the
/// store and then went idle keeps the tables it last saw (see below), so in the worst case,
/// right after a flood, memory reaches the bound's worth once more for each such thread.
///
/// Each thread that decides on a store keeps its own reference to each shard's table (for its
/// last four stores), so that finding a table costs it no write to memory another thread uses.
/// A table that has been replaced is freed once every such thread has come back to its shard,
/// used four other stores, or ended.
///
/// ```
/// use std::time::Duration;
/// use burstgate::{BucketKey, BucketStore, Limit, ManualClock, MemoryStore};
///
/// # tokio_test();
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn tokio_test() -> Result<(), Box<dyn std::error::Error>> {
/// let clock = ManualClock::new(0);
/// let store = MemoryStore::new().with_clock(clock.clone());
/// let limit = Limit::per_second(1)?.with_burst(2)?;
/// let key = BucketKey::new("api", "client-7")?;
///
/// assert!(store.acquire(&key, limit, 1, Duration::ZERO).await?.is_admitted());
/// assert!(store.acquire(&key, limit, 1, Duration::ZERO).await?.is_admitted());
/// let third = store.acquire(&key, limit, 1, Duration::ZERO).await?;
/// assert_eq!(third.retry_after(), Some(Duration::from_secs(1)));
///
/// clock.advance(Duration::from_secs(2));
/// store.sweep();
/// assert_eq!(store.len(), 0); // full again, so forgotten
/// # Ok(())
/// # }
/// ```
pub struct MemoryStore<C = SystemClock> {
    inner: Arc<Inner>,
    clock: C,
}

struct Inner {
    id: u64,
    shards: Box<[Padded]>,
    /// The most buckets each shard holds.
    shard_cap: usize,
    halts: halts::Halts,
    /// One-time marks ([`BucketStore::book`]), by bucket key and id.
    marks: marks::Marks,
}

impl Inner {
    /// The shard of a key's hash.
    fn shard_of(&self, hash: u64) -> usize {
        sharding::index(hash, self.shards.len())
    }
}

impl MemoryStore<SystemClock> {
    /// An empty store on the system clock, with a bound of 1,048,576 (2^20) buckets (see
    /// [`bounded`](Self::bounded)); [`with_clock`](Self::with_clock) gives it another clock.
    pub fn new() -> Self {
        Self::bounded(NonZeroUsize::MIN.saturating_add(DEFAULT_MAX_BUCKETS - 1))
    }

    /// An empty store on the system clock that holds `max_buckets` buckets, with a headroom
    /// stated exactly below. See [Memory](Self#memory) for what happens at the bound.
    ///
    /// The bound is honoured as a bound: while the store holds fewer buckets than `max_buckets`
    /// ([`len`](Self::len), which counts full buckets not yet dropped), no bucket is forgotten
    /// and no key is refused ([`StoreError::TooManyBuckets`]) to make room, on any machine.
    /// How exactly depends on how the store is sharded, which the bound decides:
    ///
    /// - **Below 2,048**, the store is one shard, which
    ///   holds the bound itself: it makes room only for a key that would take it past the
    ///   bound, always. A bound below 16 is raised to 16 ([`MAX_TAKES`](crate::MAX_TAKES)), so
    ///   that one request on several new buckets always fits.
    /// - **From 2,048**, the store has 8 shards per thread the machine runs (at least 16), or
    ///   one per 4,096 buckets of the bound if that is more, rounded up to a power of two, but
    ///   no more than leave each shard at least 1,024 of the bound (the largest power of two at
    ///   most `max_buckets / 1,024`), and at most 2^16. Each shard holds its share,
    ///   `share = ⌈max_buckets / shards⌉`, and a headroom of `8 × ⌈√share⌉` more: eight
    ///   standard deviations of the count of keys a shard receives when the store holds its
    ///   bound, since keys spread over the shards at random (the hasher is seeded at random per
    ///   process). A new key finds its shard full below the bound with a chance below 10^-12;
    ///   only then is a bucket forgotten, or the key refused, early. The headroom is at most a
    ///   quarter of the bound (at a share of 1,024), an eighth at 4,096 and less above, and
    ///   [`max_buckets`](Self::max_buckets) says what it comes to.
    ///
    /// Any bound is accepted: the counts saturate, and the shards are at most 2^16 (8 MB),
    /// whatever the bound, since they are made up front.
    pub fn bounded(max_buckets: NonZeroUsize) -> Self {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self::laid_out(Layout::of(max_buckets.get(), threads), SystemClock)
    }
}

impl Default for MemoryStore<SystemClock> {
    fn default() -> Self {
        Self::new()
    }
}

impl<C: Clock> MemoryStore<C> {
    /// The same store reading the time from `clock` instead: a [`ManualClock`](crate::ManualClock)
    /// or [`TokioClock`](crate::TokioClock) in tests. Give it while building the store, before
    /// the first call: the buckets already held keep the times the old clock wrote, and clones
    /// made before keep the old clock.
    #[must_use]
    pub fn with_clock<C2: Clock>(self, clock: C2) -> MemoryStore<C2> {
        MemoryStore {
            inner: self.inner,
            clock,
        }
    }

    /// The clock the store reads.
    pub fn clock(&self) -> &C {
        &self.clock
    }

    /// An empty store of `layout`'s shards.
    fn laid_out(layout: Layout, clock: C) -> Self {
        let shards = (0..layout.shards)
            .map(|_| {
                Padded(Spinlock::new(Shard {
                    table: Table::empty(),
                    new: HashTable::new(),
                    rebuild_at: 0.0,
                    locked_decisions: 0,
                    overflow: 0,
                    no_room_until: 0.0,
                    arrivals: 0,
                }))
            })
            .collect();
        Self {
            inner: Arc::new(Inner {
                id: NEXT_STORE.fetch_add(1, Ordering::Relaxed),
                shards,
                shard_cap: layout.shard_cap,
                halts: halts::Halts::new(),
                marks: marks::Marks::default(),
            }),
            clock,
        }
    }

    /// The most buckets the store holds: each shard's most, times the shards (see
    /// [`bounded`](Self::bounded)); `usize::MAX` if that is more.
    pub fn max_buckets(&self) -> usize {
        Layout {
            shards: self.inner.shards.len(),
            shard_cap: self.inner.shard_cap,
        }
        .max_buckets()
    }

    /// The error of a new key that found its shard full of buckets in debt; out of line, so that
    /// the hot path carries only the marker.
    #[cold]
    #[inline(never)]
    fn too_many(&self) -> StoreError {
        StoreError::TooManyBuckets {
            max: self.max_buckets(),
        }
    }

    /// The number of buckets held (full buckets not yet swept included).
    pub fn len(&self) -> usize {
        self.inner
            .shards
            .iter()
            .map(|s| {
                let shard = lock(&s.0);
                shard.table.buckets.len() + shard.new.len()
            })
            .sum()
    }

    /// Whether no bucket is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every bucket that has refilled to full, in every shard, and gives their memory back
    /// (but for tables other threads still refer to; see [Memory](Self#memory)).
    pub fn sweep(&self) {
        let now = bucket::time(self.clock.now_ms());
        for shard in self.inner.shards.iter() {
            lock(&shard.0).rebuild(now, now);
        }
        // This thread's view moves to the new tables, so that it holds none of the old ones.
        let _ = VIEWS.try_with(|views| {
            let Ok(mut views) = views.try_borrow_mut() else {
                return;
            };
            let Some(view) = views.iter_mut().find(|v| v.store == self.inner.id) else {
                return;
            };
            for (table, shard) in view.tables.iter_mut().zip(self.inner.shards.iter()) {
                *table = lock(&shard.0).table.clone();
            }
        });
    }

    /// Reads and writes one bucket under its lock.
    // Inlined into `acquire` and so into the caller, where the limit's parameters and the checks
    // on the arguments often fold away.
    #[inline]
    fn with_bucket<T>(
        &self,
        key: &BucketKey,
        f: impl FnOnce(Option<State>, u64) -> (T, Option<Write>),
    ) -> Result<T, Full> {
        let id = key.as_bytes();
        // The key's own hash, made with it: one serves both the shard and the lookups inside it.
        let hash = key.id_hash();
        let index = self.inner.shard_of(hash);
        // The time is read before any lock, so that locks are held for the arithmetic alone. A
        // caller that read its time just before another's but locks after it finds a stored
        // time ahead of its own, and, as for any clock behind the stored time, refills nothing
        // for the gap.
        let mut read_at = None;
        // The hot path: an existing key, through this thread's view of its shard's table.
        let mut f = Some(f);
        let fast = VIEWS.try_with(|views| {
            let mut views = views.try_borrow_mut().ok()?;
            let table = self.inner.view(&mut views).get(index)?;
            // A key kept and decided on again says where this store last found its bucket,
            // sparing the search. A hint from a table since rebuilt costs one look that finds
            // another key's bucket, a gone one or none, and then the search; one from another
            // store is not used.
            let hint = key.hint();
            let mine = self.inner.id << 32;
            let hinted = (hint >> 32 == mine >> 32).then_some((hint & 0xFFFF_FFFF) as usize);
            if hinted.is_none() {
                // The index is read first, so that its wait for memory (among many keys, it
                // is rarely in the nearest caches) overlaps the clock's read.
                table.touch(hash);
            }
            let now_ms = *read_at.insert(self.clock.now_ms());
            let held = match hinted.and_then(|at| table.hold_at(at, id)) {
                Some(held) => held,
                None => {
                    let held = table.hold(hash, id)?;
                    key.set_hint(mine | table.position_of(&held) as u64);
                    held
                }
            };
            Some(held.decide(now_ms, f.take()?))
        });
        match (fast, f) {
            (Ok(Some(out)), _) => Ok(out),
            (_, Some(f)) => {
                let now_ms = read_at.unwrap_or_else(|| self.clock.now_ms());
                self.with_bucket_locked(index, hash, id, now_ms, f)
            }
            // `f` is only taken once the bucket is held, and then decides.
            (_, None) => unreachable!("a decision's function was used and its result lost"),
        }
    }
}

impl<C: Clock> BucketStore for MemoryStore<C> {
    fn now(&self) -> SystemTime {
        self.clock.now()
    }

    // The decision is short and its future a large value returned by copy; inlined into the
    // caller, the copy and the call go away.
    #[inline]
    fn acquire(
        &self,
        key: &BucketKey,
        limit: Limit,
        cost: u32,
        max_wait: Duration,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send {
        // No check that the stored state is sound (`bucket::sound`), as the script makes: this
        // store holds only states its own arithmetic wrote, and both walks are bounded whatever
        // the state. Kept off the hot path (what it would cost: docs/PERFORMANCE.md, "What a
        // decision costs").
        let result = check_cost(&limit, cost).map(|cost_f| {
            let max_wait = whole_ms(max_wait);
            let p = Params::of(&limit);
            let outcome = self.with_bucket(key, |state, now| {
                bucket::evaluate(&p, state, now, cost_f, max_wait)
            });
            outcome.map(|outcome| Decision::new(outcome, limit, cost))
        });
        // Two steps, the marker of a full shard turned into its error last: as one `and_then`,
        // the decision stopped being inlined into the caller.
        ready(match result {
            Ok(Ok(decision)) => Ok(decision),
            Ok(Err(Full)) => Err(self.too_many()),
            Err(e) => Err(e),
        })
    }

    fn acquire_all(
        &self,
        takes: &[Take<'_>],
        max_wait: Duration,
    ) -> impl Future<Output = Result<Vec<Decision>, StoreError>> + Send {
        let decided = check_takes(takes).and_then(|costs| {
            let max_wait = whole_ms(max_wait);
            let ids: PerBucket<&[u8]> = takes.iter().map(|t| t.key().as_bytes()).collect();
            self.with_buckets(&ids, |states, now, writes| {
                let parts: PerBucket<bucket::Part> = takes
                    .iter()
                    .zip(states)
                    .zip(&costs)
                    .map(|((t, &state), &cost)| bucket::Part {
                        p: Params::of(&t.limit()),
                        state,
                        cost,
                    })
                    .collect();
                let mut decisions = Vec::with_capacity(takes.len());
                let mut at = 0;
                bucket::evaluate_all(&parts, now, max_wait, |outcome, write| {
                    if let (Some(t), Some(slot)) = (takes.get(at), writes.get_mut(at)) {
                        decisions.push(Decision::new(outcome, t.limit(), t.cost()));
                        *slot = write;
                    }
                    at += 1;
                });
                decisions
            })
            .map_err(|Full| self.too_many())
        });
        ready(decided)
    }

    fn peek(
        &self,
        key: &BucketKey,
        limit: Limit,
    ) -> impl Future<Output = Result<BucketState, StoreError>> + Send {
        let p = Params::of(&limit);
        let outcome = self.with_bucket(key, |state, now| {
            let halt = self.inner.halts.get(key.as_str());
            let halt = bucket::halt(&p, state, halt, now, None);
            ((bucket::peek(&p, state, now), halt), None)
        });
        ready(match outcome {
            Ok((outcome, halt)) => Ok(BucketState::new(outcome, limit).with_halt(halt as u64)),
            Err(Full) => Err(self.too_many()),
        })
    }

    fn refund(
        &self,
        key: &BucketKey,
        limit: Limit,
        reservation: Reservation,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let result = check_cost(&limit, reservation.cost()).and_then(|cost| {
            let p = Params::of(&limit);
            let ready = reservation.ready_at_ms();
            self.with_bucket(key, |state, now| {
                ((), bucket::refund(&p, state, now, cost, ready).1)
            })
            .map_err(|Full| self.too_many())
        });
        ready(result)
    }

    fn drain_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let p = Params::of(&limit);
        let until = deadline_ms(until);
        ready(
            self.with_bucket(key, |state, now| {
                let halts = &self.inner.halts;
                let halt = halts.get(key.as_str());
                let halt = bucket::halt(&p, state, halt, now, Some(until));
                halts.set(key.as_str(), halt, halt + p.lead(), bucket::time(now));
                ((), Some(bucket::drain_until(&p, state, now, until)))
            })
            .map_err(|Full| self.too_many()),
        )
    }

    fn lower_to(
        &self,
        key: &BucketKey,
        limit: Limit,
        tokens: u32,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        let p = Params::of(&limit);
        ready(
            self.with_bucket(key, |state, now| {
                let (outcome, write) = bucket::lower(&p, state, now, f64::from(tokens));
                (outcome.allowed, write)
            })
            .map_err(|Full| self.too_many()),
        )
    }

    /// The marks are kept apart from the buckets, in a table the store prunes of marks past
    /// their time before it would grow (once it holds a thousand or so). They live as long as
    /// the store: a process that starts again finds every mark missing.
    fn book(
        &self,
        key: &BucketKey,
        id: &str,
        until: SystemTime,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let now = self.clock.now_ms();
        let until = deadline_ms(until).min(now.saturating_add(bucket::MAX_WAIT));
        self.inner.marks.book(mark_name(key, id), until, now);
        ready(Ok(()))
    }

    fn claim(
        &self,
        key: &BucketKey,
        id: &str,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send {
        let now = self.clock.now_ms();
        ready(Ok(self.inner.marks.claim(&mark_name(key, id), now)))
    }

    /// A table never changes once made, so a bucket in one cannot be removed at once: its slot
    /// is given a state every operation reads as a missing bucket's, full since time 0, which
    /// the shard's next rebuild drops with the other full buckets (a key among the shard's new
    /// ones is removed at once). So [`len`](Self::len) may count the bucket until then. A key
    /// the store does not hold gets no bucket.
    fn reset(&self, key: &BucketKey) -> impl Future<Output = Result<(), StoreError>> + Send {
        ready(
            self.with_bucket(key, |_, now| {
                self.inner
                    .halts
                    .set(key.as_str(), 0.0, 0.0, bucket::time(now));
                ((), Some(bucket::FORGOTTEN))
            })
            .map_err(|Full| self.too_many()),
        )
    }

    fn set(
        &self,
        key: &BucketKey,
        limit: Limit,
        tokens: u32,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let result = check_tokens(&limit, tokens).and_then(|tokens| {
            let p = Params::of(&limit);
            self.with_bucket(key, |state, now| {
                self.inner
                    .halts
                    .set(key.as_str(), 0.0, 0.0, bucket::time(now));
                ((), Some(bucket::set(&p, state, now, tokens)))
            })
            .map_err(|Full| self.too_many())
        });
        ready(result)
    }

    fn block_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let p = Params::of(&limit);
        let until = deadline_ms(until);
        ready(
            self.with_bucket(key, |state, now| {
                let halts = &self.inner.halts;
                let halt = bucket::block_halt(&p, state, halts.get(key.as_str()), now, until);
                halts.set(key.as_str(), halt, halt + p.lead(), bucket::time(now));
                ((), bucket::block_until(&p, state, now, until).1)
            })
            .map_err(|Full| self.too_many()),
        )
    }
}

impl<C: Clock> MemoryStore<C> {
    /// Drains `key`'s bucket until `until` (milliseconds since the epoch) if the store holds one,
    /// and creates none otherwise: for the local buckets of `OutagePolicy::Local`, which must
    /// not hold a bucket for every key Redis decides on.
    #[cfg(feature = "redis")]
    pub(crate) fn drain_held(&self, key: &BucketKey, limit: Limit, until: u64) {
        let p = Params::of(&limit);
        // A held bucket needs no room, so this cannot fail.
        let _ = self.with_bucket(key, |state, now| match state {
            Some(_) => ((), Some(bucket::drain_until(&p, state, now, until))),
            None => ((), None),
        });
    }

    /// Gives `key`, if the store holds no bucket for it, one that was empty at `since`
    /// (milliseconds since the epoch) and has refilled from there: what it would hold had it
    /// been drained with every decision made elsewhere until then. Nothing for `since` zero.
    #[cfg(feature = "redis")]
    pub(crate) fn seed_empty(
        &self,
        key: &BucketKey,
        limit: Limit,
        since: u64,
    ) -> Result<(), StoreError> {
        if since == 0 {
            return Ok(());
        }
        let p = Params::of(&limit);
        self.with_bucket(key, |state, now| match state {
            // A bucket full by now says nothing a missing one does not.
            None => (
                (),
                Some(bucket::write(&p, 0.0, bucket::time(since.min(now)))),
            ),
            Some(_) => ((), None),
        })
        .map_err(|Full| self.too_many())
    }
}

impl<C: Clone> Clone for MemoryStore<C> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            clock: self.clock.clone(),
        }
    }
}

impl<C: fmt::Debug> fmt::Debug for MemoryStore<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.inner.shards.len())
            .field("clock", &self.clock)
            .finish_non_exhaustive()
    }
}

/// A mark's name, as Redis names its key after the bucket's: `<bucket key>:t:<id>`.
fn mark_name(key: &BucketKey, id: &str) -> String {
    format!("{}:t:{id}", key.as_str())
}
