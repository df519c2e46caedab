//! The in-process store.

use std::fmt;
use std::future::{Future, ready};
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use hashbrown::{DefaultHashBuilder, HashTable};

use crate::bucket::{self, State, Write};
use crate::clock::{Clock, SystemClock, deadline_ms};
use crate::store::{BucketStore, Decision, Quota, StoreError, check_cost};
use crate::{BucketKey, Limit};

/// How often, at most, a shard that is in use drops its full buckets.
const SWEEP_EVERY_MS: u64 = 1_000;

/// A shard sweeps early when it grows past this many buckets (doubling after each sweep).
const MIN_SWEEP_LEN: usize = 64;

/// Buckets in this process's memory: the embedded default, and the store for unit tests.
///
/// Decisions are exact under any contention: each bucket is read and written under the lock of
/// its shard, and buckets are spread over many shards (a power of two, at least 16, sized to the
/// machine's parallelism), so threads seldom wait on each other. Cloning is cheap and clones share
/// the buckets.
///
/// # Memory
///
/// A bucket that has refilled to full says nothing a missing one would not (a missing bucket is a
/// full one), so it is dropped. Each shard drops its full buckets when it is touched and a second
/// has passed since its last sweep, or when it has doubled in size since then; [`sweep`](Self::sweep)
/// drops them from every shard at once. A million keys seen once therefore do not
/// stay in memory longer than their refill time, once traffic or a sweep reaches their shard.
///
/// ```
/// use std::time::Duration;
/// use burstgate::{BucketKey, BucketStore, Limit, ManualClock, MemoryStore};
///
/// # tokio_test();
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn tokio_test() -> Result<(), Box<dyn std::error::Error>> {
/// let clock = ManualClock::new(0);
/// let store = MemoryStore::with_clock(clock.clone());
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
    shards: Box<[Padded]>,
    hasher: DefaultHashBuilder,
}

/// A shard on cache lines of its own, so threads working on neighbouring shards do not slow
/// each other down by writing to the same line (false sharing).
#[repr(align(128))]
struct Padded(Mutex<Shard>);

struct Shard {
    buckets: HashTable<(Box<str>, Entry)>,
    sweep_at_len: usize,
    sweep_at_ms: u64,
}

#[derive(Clone, Copy)]
struct Entry {
    state: State,
    /// When the bucket is full again; after that the entry can go.
    full: f64,
}

impl MemoryStore<SystemClock> {
    /// An empty store on the system clock.
    pub fn new() -> Self {
        Self::with_clock(SystemClock)
    }
}

impl Default for MemoryStore<SystemClock> {
    fn default() -> Self {
        Self::new()
    }
}

impl<C: Clock> MemoryStore<C> {
    /// An empty store that reads the time from `clock`.
    pub fn with_clock(clock: C) -> Self {
        let parallelism = std::thread::available_parallelism().map_or(1, |n| n.get());
        let count = (parallelism * 4).next_power_of_two().max(16);
        let shards = (0..count)
            .map(|_| {
                Padded(Mutex::new(Shard {
                    buckets: HashTable::new(),
                    sweep_at_len: MIN_SWEEP_LEN,
                    sweep_at_ms: 0,
                }))
            })
            .collect();
        Self {
            inner: Arc::new(Inner {
                shards,
                hasher: DefaultHashBuilder::default(),
            }),
            clock,
        }
    }

    /// The number of buckets held (full buckets not yet swept included).
    pub fn len(&self) -> usize {
        self.inner
            .shards
            .iter()
            .map(|s| lock(&s.0).buckets.len())
            .sum()
    }

    /// Whether no bucket is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every bucket that has refilled to full, in every shard, and gives their memory back.
    pub fn sweep(&self) {
        let now = bucket::time(self.clock.now_ms());
        for shard in self.inner.shards.iter() {
            lock(&shard.0).sweep(now, &self.inner.hasher);
        }
    }

    /// Reads and writes one bucket under its shard's lock.
    fn with_bucket<T>(
        &self,
        key: &BucketKey,
        f: impl FnOnce(Option<State>, u64) -> (T, Option<Write>),
    ) -> T {
        let id = key.as_str();
        let hasher = &self.inner.hasher;
        // One hash serves both the shard and the lookup inside it. The shard takes bits 32 and
        // up, which the table leaves alone (it uses the low bits for the slot and the top seven
        // for its tags), so keys within a shard stay spread.
        let hash = hasher.hash_one(id);
        let index = ((hash >> 32) as usize) & (self.inner.shards.len() - 1);
        let mut shard = lock(&self.inner.shards[index].0);
        let now_ms = self.clock.now_ms();
        let now = bucket::time(now_ms);
        if now >= shard.sweep_at_ms as f64 {
            shard.sweep(now, hasher);
        }
        let is_key = |(k, _): &(Box<str>, Entry)| &**k == id;
        // An existing bucket is read and written through one lookup: the hot path.
        if let Some((_, entry)) = shard.buckets.find_mut(hash, is_key) {
            let (out, write) = f(Some(entry.state), now_ms);
            match write {
                Some(w) if w.full > now => {
                    *entry = Entry {
                        state: w.state,
                        full: w.full,
                    }
                }
                // Full again: a missing bucket says the same, in less memory.
                Some(_) => {
                    if let Ok(found) = shard.buckets.find_entry(hash, is_key) {
                        found.remove();
                    }
                }
                None => {}
            }
            return out;
        }
        let (out, write) = f(None, now_ms);
        if let Some(w) = write
            && w.full > now
        {
            if shard.buckets.len() >= shard.sweep_at_len {
                shard.sweep(now, hasher);
            }
            let entry = Entry {
                state: w.state,
                full: w.full,
            };
            shard
                .buckets
                .insert_unique(hash, (id.into(), entry), |(k, _)| hasher.hash_one(&**k));
        }
        out
    }
}

impl Shard {
    fn sweep(&mut self, now: f64, hasher: &DefaultHashBuilder) {
        self.buckets.retain(|(_, e)| e.full > now);
        let len = self.buckets.len();
        if self.buckets.capacity() > 4 * len.max(MIN_SWEEP_LEN) {
            self.buckets
                .shrink_to(2 * len, |(k, _)| hasher.hash_one(&**k));
        }
        self.sweep_at_len = (2 * len).max(MIN_SWEEP_LEN);
        // `now` is a whole number of milliseconds no larger than 2^53.
        self.sweep_at_ms = (now as u64).saturating_add(SWEEP_EVERY_MS);
    }
}

fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    // Nothing panics while a shard is locked, and each update is one assignment, so a poisoned
    // shard still holds consistent buckets.
    shard.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<C: Clock> BucketStore for MemoryStore<C> {
    fn acquire(
        &self,
        key: &BucketKey,
        limit: Limit,
        cost: u32,
        max_wait: Duration,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send {
        let result = check_cost(&limit, cost).map(|cost| {
            let max_wait = u64::try_from(max_wait.as_millis()).unwrap_or(u64::MAX);
            let p = limit.params();
            let outcome = self.with_bucket(key, |state, now| {
                bucket::evaluate(&p, state, now, cost, max_wait)
            });
            Decision::new(outcome, limit)
        });
        ready(result)
    }

    fn peek(
        &self,
        key: &BucketKey,
        limit: Limit,
    ) -> impl Future<Output = Result<Quota, StoreError>> + Send {
        let p = limit.params();
        let outcome = self.with_bucket(key, |state, now| (bucket::peek(&p, state, now), None));
        ready(Ok(Quota::new(outcome, limit)))
    }

    fn refund(
        &self,
        key: &BucketKey,
        limit: Limit,
        cost: u32,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let result = check_cost(&limit, cost).map(|cost| {
            let p = limit.params();
            self.with_bucket(key, |state, now| {
                ((), Some(bucket::refund(&p, state, now, cost)))
            });
        });
        ready(result)
    }

    fn drain_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        let p = limit.params();
        let until = deadline_ms(until);
        self.with_bucket(key, |state, now| {
            ((), Some(bucket::drain_until(&p, state, now, until)))
        });
        ready(Ok(()))
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
