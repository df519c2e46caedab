//! The in-process store.

use std::fmt;
use std::future::{Future, ready};
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use hashbrown::{DefaultHashBuilder, HashTable};
use spinning_top::Spinlock;
use spinning_top::guard::SpinlockGuard;

use crate::bucket::{self, State, Write};
use crate::clock::{Clock, SystemClock, deadline_ms, whole_ms};
use crate::store::{BucketStore, Decision, Quota, StoreError, check_cost};
use crate::{BucketKey, Limit};

/// Shards per thread the machine can run. A decision finds its shard locked about as often as
/// the other threads, each holding some lock about half of the time, pick the same shard: with
/// 32 per thread, about one decision in a hundred. Profiled on two threads sharing 10k keys (the
/// `governor` bench), waiting for a locked shard took 1% of the time with 64 shards against 4%
/// with 16. Each shard costs 128 bytes while empty.
const SHARDS_PER_THREAD: usize = 32;

/// The fewest shards a store has.
const MIN_SHARDS: usize = 64;

/// How often, at most, a shard that is in use drops its full buckets.
const SWEEP_EVERY_MS: f64 = 1_000.0;

/// A shard sweeps early when it grows past this many buckets (doubling after each sweep).
const MIN_SWEEP_LEN: usize = 64;

/// Buckets in this process's memory: the embedded default, and the store for unit tests.
///
/// Decisions are exact under any contention: each bucket is read and written under the lock of
/// its shard, and buckets are spread over many shards (a power of two, at least 64, sized to the
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

impl Inner {
    /// The shard of a key's hash: the top bits of the hash times 2^64 / φ (Fibonacci hashing),
    /// which depend on every bit of the hash. The table in the shard uses the hash's low bits
    /// and top seven; the shard cannot take those without leaving the keys of a shard alike
    /// there, and the bits in between, taken as they are, spread keys that differ in a digit
    /// or two (`client-17`, `client-18`) unevenly, some shards getting a quarter of the mean
    /// and others over twice it.
    fn shard_of(&self, hash: u64) -> usize {
        let mixed = hash.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        // The count is a power of two, at least two, so the shift (64 minus its log2) is
        // below 64 and leaves an index below the count.
        (mixed >> (64 - self.shards.len().trailing_zeros())) as usize
    }
}

/// A shard on cache lines of its own, so threads working on neighbouring shards do not slow
/// each other down by writing to the same line (false sharing).
#[repr(align(128))]
struct Padded(Spinlock<Shard>);

struct Shard {
    buckets: HashTable<Slot>,
    sweep_at_len: usize,
    /// When the shard next drops its full buckets, in milliseconds since the epoch.
    sweep_at: f64,
}

/// One bucket, with its key, on one cache line: a decision on an existing key reads and writes
/// this line and its shard's, nothing else.
#[repr(align(64))]
struct Slot {
    key: Key,
    state: State,
    /// When the bucket is full again; after that the slot can go.
    full: f64,
}

/// Longer keys than this live on the heap. 38 bytes fill the slot's line exactly (with the
/// length, the enum's tag and the 24 bytes of bucket), and cover most `bucket:key` forms:
/// account names, IPv4 addresses, short API key ids. Hashed keys (64 hex digits) do not fit.
const INLINE_LEN: usize = 38;

/// A key as the table holds it: inline when short, which spares a decision the pointer chase
/// (and a new key the allocation).
enum Key {
    Inline { len: u8, bytes: [u8; INLINE_LEN] },
    Heap(Box<str>),
}

impl Key {
    fn new(id: &str) -> Self {
        match u8::try_from(id.len()) {
            Ok(len) if id.len() <= INLINE_LEN => {
                let mut bytes = [0; INLINE_LEN];
                bytes[..id.len()].copy_from_slice(id.as_bytes());
                Key::Inline { len, bytes }
            }
            _ => Key::Heap(id.into()),
        }
    }

    #[inline]
    fn as_bytes(&self) -> &[u8] {
        match self {
            // `new` only makes inline keys that fit, so the range is in bounds.
            Key::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Key::Heap(id) => id.as_bytes(),
        }
    }

    #[inline]
    fn is(&self, id: &str) -> bool {
        self.as_bytes() == id.as_bytes()
    }
}

/// The hash that picks both a key's shard and its slot in the shard's table.
fn hash(hasher: &DefaultHashBuilder, key: &[u8]) -> u64 {
    let mut h = hasher.build_hasher();
    h.write(key);
    h.finish()
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
        let count = (parallelism * SHARDS_PER_THREAD)
            .next_power_of_two()
            .max(MIN_SHARDS);
        let shards = (0..count)
            .map(|_| {
                Padded(Spinlock::new(Shard {
                    buckets: HashTable::new(),
                    sweep_at_len: MIN_SWEEP_LEN,
                    sweep_at: 0.0,
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
    // Inlined into `acquire` and so into the caller, where the limit's parameters and the checks
    // on the arguments often fold away.
    #[inline]
    fn with_bucket<T>(
        &self,
        key: &BucketKey,
        f: impl FnOnce(Option<State>, u64) -> (T, Option<Write>),
    ) -> T {
        let id = key.as_str();
        let hasher = &self.inner.hasher;
        // One hash serves both the shard and the lookup inside it.
        let hash = hash(hasher, id.as_bytes());
        let index = self.inner.shard_of(hash);
        // Read before the lock, so the lock is held for the arithmetic alone. A caller that read
        // its time just before another's but locks after it finds a stored time ahead of its own,
        // and, as for any clock behind the stored time, refills nothing for the gap.
        let now_ms = self.clock.now_ms();
        let now = bucket::time(now_ms);
        let mut shard = lock(&self.inner.shards[index].0);
        if now >= shard.sweep_at {
            shard.sweep(now, hasher);
        }
        // An existing bucket is read and written (or removed) through one lookup: the hot path.
        // `f` is called from one place only, so that it is inlined here.
        let found = shard.buckets.find_entry(hash, |s| s.key.is(id));
        let (out, write) = f(found.as_ref().ok().map(|e| e.get().state), now_ms);
        match (found, write) {
            (Ok(mut found), Some(w)) if w.full > now => {
                let slot = found.get_mut();
                slot.state = w.state;
                slot.full = w.full;
            }
            // Full again: a missing bucket says the same, in less memory.
            (Ok(found), Some(_)) => {
                found.remove();
            }
            (Err(_), Some(w)) if w.full > now => {
                if shard.buckets.len() >= shard.sweep_at_len {
                    shard.sweep(now, hasher);
                }
                let slot = Slot {
                    key: Key::new(id),
                    state: w.state,
                    full: w.full,
                };
                shard
                    .buckets
                    .insert_unique(hash, slot, |s| self::hash(hasher, s.key.as_bytes()));
            }
            (_, _) => {}
        }
        out
    }
}

impl Shard {
    fn sweep(&mut self, now: f64, hasher: &DefaultHashBuilder) {
        self.buckets.retain(|s| s.full > now);
        let len = self.buckets.len();
        if self.buckets.capacity() > 4 * len.max(MIN_SWEEP_LEN) {
            self.buckets
                .shrink_to(2 * len, |s| hash(hasher, s.key.as_bytes()));
        }
        self.sweep_at_len = (2 * len).max(MIN_SWEEP_LEN);
        self.sweep_at = now + SWEEP_EVERY_MS;
    }
}

/// How many times a thread that finds a shard locked checks it again before it gives its core
/// up for a while.
const SPINS_BEFORE_YIELD: u32 = 64;

/// Locks a shard.
///
/// A spin lock, because a shard is held for a few dozen nanoseconds: taking it is one
/// compare-and-swap and releasing it one plain store, where a `std::sync::Mutex` also swaps on
/// release (to learn whether a sleeper needs waking), an atomic operation that costs about a
/// tenth of a decision. A thread that finds the lock taken spins a little, then yields to the
/// scheduler, so that a holder that was preempted gets a core back instead of waiting behind
/// the spinner.
#[inline]
fn lock(shard: &Spinlock<Shard>) -> SpinlockGuard<'_, Shard> {
    loop {
        if let Some(guard) = shard.try_lock() {
            return guard;
        }
        let mut spins = 0;
        while shard.is_locked() {
            if spins < SPINS_BEFORE_YIELD {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

impl<C: Clock> BucketStore for MemoryStore<C> {
    // The decision is a few dozen nanoseconds and its future a large value returned by copy;
    // inlined into the caller, the copy and the call go away.
    #[inline]
    fn acquire(
        &self,
        key: &BucketKey,
        limit: Limit,
        cost: u32,
        max_wait: Duration,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send {
        let result = check_cost(&limit, cost).map(|cost| {
            let max_wait = whole_ms(max_wait);
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

#[cfg(test)]
mod tests {
    //! The store against a model that keeps every bucket forever in a `HashMap` and decides
    //! through the same functions of `bucket`: dropping full buckets, the inline and heap keys
    //! and the shards must change no decision, to the last field.
    //!
    //! The model's clock never moves back. A bucket is dropped only once full at the time of the
    //! drop, and from then on a clock that does not move back sees it full whether it is kept or
    //! not; a clock set back after a drop would see a full bucket where the model still has a
    //! partly refilled one, which is the skew `Clock` documents.

    use std::collections::HashMap;
    use std::mem::{align_of, size_of};
    use std::task::{Context, Poll, Waker};
    use std::time::UNIX_EPOCH;

    use proptest::prelude::*;

    use super::*;
    use crate::ManualClock;
    use crate::clock::deadline_ms;
    use crate::store::Quota;

    const START: u64 = 1_700_000_000_000;

    fn now_or_never<F: Future>(f: F) -> F::Output {
        match std::pin::pin!(f).poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(out) => out,
            Poll::Pending => panic!("a MemoryStore future was not ready on its first poll"),
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Acquire {
            key: usize,
            cost: u32,
            max_wait_ms: u64,
        },
        Peek {
            key: usize,
        },
        Refund {
            key: usize,
            cost: u32,
        },
        Drain {
            key: usize,
            ahead_ms: u64,
        },
        Advance(u64),
        Sweep,
    }

    /// Every bucket ever written, never dropped.
    #[derive(Default)]
    struct Model {
        states: HashMap<String, State>,
    }

    impl Model {
        fn update(&mut self, key: &BucketKey, write: Option<Write>) {
            if let Some(w) = write {
                self.states.insert(key.as_str().to_owned(), w.state);
            }
        }

        fn state(&self, key: &BucketKey) -> Option<State> {
            self.states.get(key.as_str()).copied()
        }
    }

    /// Keys whose stored form (`b:` and the escaped key) is 3, 37, 38 (the longest inline), 39
    /// (the shortest on the heap), 102 and 67 (hashed) bytes long.
    fn keys() -> Vec<BucketKey> {
        let mut keys: Vec<BucketKey> = [1, 35, 36, 37, 100]
            .into_iter()
            .map(|n| BucketKey::new("b", "k".repeat(n)).expect("a valid key"))
            .collect();
        keys.push(BucketKey::hashed("b", "secret").expect("a valid key"));
        // Same length and same first bytes as another key, so only the last byte tells them
        // apart, inline and on the heap.
        keys.push(BucketKey::new("b", format!("{}j", "k".repeat(35))).expect("a valid key"));
        keys.push(BucketKey::new("b", format!("{}j", "k".repeat(99))).expect("a valid key"));
        keys
    }

    fn limits() -> Vec<Limit> {
        [
            (1, 1_000, 3),
            (5, 100, 5),
            (3, 7, 10),
            (u32::MAX, 1_000, u32::MAX),
        ]
        .into_iter()
        .map(|(tokens, ms, burst)| {
            Limit::new(tokens, Duration::from_millis(ms))
                .and_then(|l| l.with_burst(burst))
                .expect("a valid limit")
        })
        .collect()
    }

    fn op(keys: usize) -> impl Strategy<Value = Op> {
        let key = 0..keys;
        prop_oneof![
            6 => (key.clone(), 0u32..=11, prop_oneof![Just(0u64), 0u64..3_000])
                .prop_map(|(key, cost, max_wait_ms)| Op::Acquire { key, cost, max_wait_ms }),
            2 => key.clone().prop_map(|key| Op::Peek { key }),
            1 => (key.clone(), 0u32..=4).prop_map(|(key, cost)| Op::Refund { key, cost }),
            1 => (key, 0u64..5_000).prop_map(|(key, ahead_ms)| Op::Drain { key, ahead_ms }),
            3 => prop_oneof![Just(0u64), 0u64..50, 0u64..5_000].prop_map(Op::Advance),
            1 => Just(Op::Sweep),
        ]
    }

    /// Runs `ops` on a fresh store and on the model, and fails on the first answer that differs.
    /// Key `i` is always used with limit `i % limits.len()`: a bucket is full, and dropped, by
    /// the limit that wrote it, so a key that changed limits could rightly differ from the model.
    fn run(ops: &[Op], keys: &[BucketKey], limits: &[Limit]) -> Result<(), TestCaseError> {
        let clock = ManualClock::new(START);
        let store = MemoryStore::with_clock(clock.clone());
        let mut model = Model::default();
        for op in ops {
            let now = clock.now_ms();
            match *op {
                Op::Acquire {
                    key,
                    cost,
                    max_wait_ms,
                } => {
                    let (key, limit) = (&keys[key], limits[key % limits.len()]);
                    let got = now_or_never(store.acquire(
                        key,
                        limit,
                        cost,
                        Duration::from_millis(max_wait_ms),
                    ));
                    match check_cost(&limit, cost) {
                        Ok(c) => {
                            let (o, w) = bucket::evaluate(
                                &limit.params(),
                                model.state(key),
                                now,
                                c,
                                max_wait_ms,
                            );
                            model.update(key, w);
                            prop_assert_eq!(got.ok(), Some(Decision::new(o, limit)), "{:?}", op);
                        }
                        Err(e) => {
                            let got = got.err().map(|g| g.to_string());
                            prop_assert_eq!(got, Some(e.to_string()), "{:?}", op);
                        }
                    }
                }
                Op::Peek { key } => {
                    let (key, limit) = (&keys[key], limits[key % limits.len()]);
                    let got = now_or_never(store.peek(key, limit)).ok();
                    let o = bucket::peek(&limit.params(), model.state(key), now);
                    prop_assert_eq!(got, Some(Quota::new(o, limit)), "{:?}", op);
                }
                Op::Refund { key, cost } => {
                    let (key, limit) = (&keys[key], limits[key % limits.len()]);
                    let got = now_or_never(store.refund(key, limit, cost));
                    match check_cost(&limit, cost) {
                        Ok(c) => {
                            prop_assert!(got.is_ok(), "{:?}", op);
                            let w = bucket::refund(&limit.params(), model.state(key), now, c);
                            model.update(key, Some(w));
                        }
                        Err(e) => {
                            let got = got.err().map(|g| g.to_string());
                            prop_assert_eq!(got, Some(e.to_string()), "{:?}", op);
                        }
                    }
                }
                Op::Drain { key, ahead_ms } => {
                    let (key, limit) = (&keys[key], limits[key % limits.len()]);
                    let until = UNIX_EPOCH + Duration::from_millis(now + ahead_ms);
                    prop_assert!(now_or_never(store.drain_until(key, limit, until)).is_ok());
                    let w = bucket::drain_until(
                        &limit.params(),
                        model.state(key),
                        now,
                        deadline_ms(until),
                    );
                    model.update(key, Some(w));
                }
                Op::Advance(ms) => clock.advance(Duration::from_millis(ms)),
                Op::Sweep => store.sweep(),
            }
        }
        prop_assert!(store.len() <= model.states.len());
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256),
            ..ProptestConfig::default()
        })]

        #[test]
        fn decides_exactly_as_the_arithmetic_on_kept_buckets(
            ops in prop::collection::vec(op(8), 1..200)
        ) {
            run(&ops, &keys(), &limits())?;
        }
    }

    /// Thousands of keys, so that shards grow, sweep on size and on time, and shrink, with every
    /// decision checked against the model.
    #[test]
    fn many_keys_through_growth_and_sweeps_decide_as_the_model() {
        let keys: Vec<BucketKey> = (0..3_000)
            .map(|i| BucketKey::new("many", format!("{i}-{}", "x".repeat(i % 60))))
            .collect::<Result<_, _>>()
            .expect("valid keys");
        let mut ops = Vec::new();
        for round in 0..4_u64 {
            for i in 0..keys.len() {
                ops.push(Op::Acquire {
                    key: i,
                    cost: 1 + (i as u32 % 3),
                    max_wait_ms: (i as u64 % 4) * 500,
                });
                if i % 97 == 0 {
                    ops.push(Op::Peek { key: i });
                    ops.push(Op::Advance(round * 3));
                }
            }
            ops.push(Op::Advance(700 * round + 1));
        }
        if let Err(e) = run(&ops, &keys, &limits()) {
            panic!("{e}");
        }
    }

    /// Threads racing on a few keys (and on their shards' locks) admit exactly each bucket's
    /// burst, no more and no less: no decision reads a state another is writing.
    #[test]
    fn threads_racing_on_shared_buckets_admit_exactly_the_burst() {
        const THREADS: usize = 4;
        const KEYS: usize = 3;
        const BURST: u32 = 5_000;
        const TRIES: usize = 6_000;
        let store = MemoryStore::with_clock(ManualClock::new(START));
        let limit = Limit::per_hour(1)
            .and_then(|l| l.with_burst(BURST))
            .expect("a valid limit");
        let keys: Vec<BucketKey> = (0..KEYS)
            .map(|i| BucketKey::new("race", format!("k{i}")))
            .collect::<Result<_, _>>()
            .expect("valid keys");
        let admitted: Vec<[u32; KEYS]> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..THREADS)
                .map(|w| {
                    let (store, keys) = (&store, &keys);
                    s.spawn(move || {
                        let mut admitted = [0; KEYS];
                        for i in 0..TRIES {
                            let k = (i + w) % KEYS;
                            let d = now_or_never(store.acquire(&keys[k], limit, 1, Duration::ZERO))
                                .expect("decides");
                            admitted[k] += u32::from(d.is_admitted());
                        }
                        admitted
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().expect("the worker finishes"))
                .collect()
        });
        for k in 0..KEYS {
            let total: u32 = admitted.iter().map(|a| a[k]).sum();
            assert_eq!(total, BURST, "key {k}");
        }
    }

    /// Keys alike but for a few digits, as rate-limit keys often are, spread over the shards as
    /// random keys would, whatever the hasher's random seed. Per store, the chi-squared
    /// statistic of a thousand such keys over 64 shards follows a chi-squared distribution with
    /// 63 degrees of freedom, whose chance to pass 200 is below 10^-15. The hash's bits 32 to
    /// 37, taken as they are, fail it for some seeds: 522 seeds in 20,000 left a shard with
    /// none of these thousand keys.
    #[test]
    fn similar_keys_spread_over_the_shards_as_random_ones() {
        for _ in 0..200 {
            let store = MemoryStore::new();
            let shards = store.inner.shards.len();
            let keys = 1_000;
            let mut counts = vec![0_u32; shards];
            for i in 0..keys {
                let id = format!("api:client-{i}");
                counts[store
                    .inner
                    .shard_of(hash(&store.inner.hasher, id.as_bytes()))] += 1;
            }
            let expected = keys as f64 / shards as f64;
            let chi2: f64 = counts
                .iter()
                .map(|&c| (f64::from(c) - expected).powi(2) / expected)
                .sum();
            assert!(
                chi2 < 200.0,
                "{shards} shards, chi-squared {chi2}: {counts:?}"
            );
        }
    }

    #[test]
    fn a_slot_fills_one_cache_line() {
        assert_eq!((size_of::<Slot>(), align_of::<Slot>()), (64, 64));
    }
}
