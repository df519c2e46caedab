//! A shard's table of buckets: never changed once made, read without the shard's lock, each
//! bucket behind a lock of its own with the FREE/HELD/GONE protocol (see
//! docs/DESIGN.md#table-protocol, and its invariants below it).

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use super::key::Key;
use crate::bucket::{State, Write};

/// A shard's buckets: the buckets themselves, one after the other, and an index to them.
///
/// The index is an open-addressed table, at most three eighths full, searched by linear probing
/// from the hash's low bits: at that load a search for a key held reads at most 1.3 entries in
/// expectation (½(1 + 1/(1 − load)) for linear probing), where three quarters full would read
/// up to 2.5, each a branch that goes either way. Each entry is 4 bytes: the hash's top 8 bits, and the position of
/// its bucket plus one in the other 24; 0 marks an empty entry, which ends a search. The index is
/// apart from the buckets so that a search reads only memory no decision writes (a search
/// through the buckets themselves would read other keys' buckets on the way, and wait for them
/// whenever another thread had just written them), and small, so that it stays in the caches:
/// 32 kB for 3,000 keys.
#[derive(Clone)]
pub(super) struct Table {
    pub(super) index: Arc<[u32]>,
    pub(super) buckets: Arc<[Slot]>,
}

/// The most buckets a shard's table holds; more stay with the shard's new keys, decided under
/// its lock. At 64 bytes each, that is a gigabyte in one shard. (A few dozen in unit tests, so
/// that the model test runs through full tables.)
pub(super) const MAX_TABLE_LEN: usize = if cfg!(test) { 40 } else { (1 << 24) - 1 };

impl Table {
    /// The table of a shard that holds nothing yet: one, shared by every such shard of every
    /// store, so that a store's many shards, and the threads' views of them, cost no allocation
    /// each until keys reach them.
    pub(super) fn empty() -> Self {
        static EMPTY: std::sync::OnceLock<Table> = std::sync::OnceLock::new();
        EMPTY
            .get_or_init(|| Table {
                index: Arc::new([0]),
                buckets: Arc::new([]),
            })
            .clone()
    }

    /// Reads the first index entry a search for `hash` reads, and nothing else: a load started
    /// early, whose wait overlaps whatever the caller does next. (Not the bucket: read before
    /// its lock is taken, a bucket another thread wrote last would cross between the cores
    /// twice, once to be read and once to be written.)
    #[inline]
    pub(super) fn touch(&self, hash: u64) {
        let mask = self.index.len().wrapping_sub(1);
        std::hint::black_box(self.index.get(hash as usize & mask).copied());
    }

    /// The bucket at `position` (from [`position_of`](Self::position_of)), locked, if it is
    /// `id`'s and has not gone to a newer table: for a key that remembers where its bucket was.
    /// A table holds at most one bucket per key, so a bucket found here is the one a search
    /// would find.
    #[inline]
    pub(super) fn hold_at(&self, position: usize, id: &[u8]) -> Option<Held<'_>> {
        let slot = self.buckets.get(position)?;
        match slot.lock(HELD) {
            true if slot.key.is(id) => Some(Held(slot)),
            true => {
                slot.unlock();
                None
            }
            false => None,
        }
    }

    /// Where in this table `held` is, for [`hold_at`](Self::hold_at).
    #[inline]
    pub(super) fn position_of(&self, held: &Held<'_>) -> usize {
        (std::ptr::from_ref(held.0).addr() - self.buckets.as_ptr().addr()) / size_of::<Slot>()
    }

    /// The bucket of `id`, locked, if the table has it and it has not gone to a newer table.
    ///
    /// A bucket whose tag matches is locked before its key is read: its line then comes from
    /// another core's cache once, ready to be written, where reading the key first would fetch
    /// it to read and again to write.
    #[inline]
    pub(super) fn hold(&self, hash: u64, id: &[u8]) -> Option<Held<'_>> {
        self.hold_besides(hash, id, &[])
    }

    /// [`hold`](Self::hold), for a decision that holds the buckets `held` already: a bucket of
    /// those is passed over, not waited for, when `id`'s tag matches its own (its key is
    /// another, since no request names a bucket twice), so that a decision on several buckets
    /// never waits for itself.
    #[inline]
    pub(super) fn hold_besides(
        &self,
        hash: u64,
        id: &[u8],
        held: &[Option<Held<'_>>],
    ) -> Option<Held<'_>> {
        let tag = tag_of(hash);
        let mask = self.index.len().wrapping_sub(1);
        let mut at = hash as usize & mask;
        // The index is never full, so a search meets an empty entry within its length.
        for _ in 0..self.index.len() {
            let entry = *self.index.get(at)?;
            if entry >> 24 == tag && entry != 0 {
                let position = (entry & 0xFF_FFFF) as usize;
                let slot = self.buckets.get(position.wrapping_sub(1))?;
                let mine = held.iter().flatten().any(|h| std::ptr::eq(h.0, slot));
                if mine {
                    at = (at + 1) & mask;
                    continue;
                }
                match slot.lock(HELD) {
                    true if slot.key.is(id) => return Some(Held(slot)),
                    true => slot.unlock(),
                    // Gone: the key's bucket, if this is it, is in a newer table.
                    false if slot.key.is(id) => return None,
                    false => {}
                }
            } else if entry == 0 {
                return None;
            }
            at = (at + 1) & mask;
        }
        None
    }
}

impl Table {
    /// Whether the table holds `id`'s bucket, without taking its lock: for a caller holding the
    /// shard's lock, under which no bucket of the current table is gone and no key changes.
    pub(super) fn find(&self, hash: u64, id: &[u8]) -> Option<()> {
        let tag = tag_of(hash);
        let mask = self.index.len().wrapping_sub(1);
        let mut at = hash as usize & mask;
        for _ in 0..self.index.len() {
            let entry = *self.index.get(at)?;
            if entry == 0 {
                return None;
            }
            if entry >> 24 == tag {
                let position = (entry & 0xFF_FFFF) as usize;
                if self
                    .buckets
                    .get(position.wrapping_sub(1))
                    .is_some_and(|slot| slot.key.is(id))
                {
                    return Some(());
                }
            }
            at = (at + 1) & mask;
        }
        None
    }
}

/// What [`Table::try_hold`] found.
pub(super) enum Tried<'t> {
    /// The bucket, locked.
    Held(Held<'t>),
    /// The table has no live bucket for the key (gone to a newer table, or never in this one).
    Missing,
    /// A slot on the way was locked by another decision.
    Busy,
}

impl Table {
    /// [`hold`](Self::hold) without waiting: every slot on the way is tried once, and a locked
    /// one ends the search as [`Tried::Busy`]. For a decision that holds other buckets already,
    /// which must never wait while it holds them.
    pub(super) fn try_hold(&self, hash: u64, id: &[u8]) -> Tried<'_> {
        let tag = tag_of(hash);
        let mask = self.index.len().wrapping_sub(1);
        let mut at = hash as usize & mask;
        for _ in 0..self.index.len() {
            let Some(&entry) = self.index.get(at) else {
                return Tried::Missing;
            };
            if entry == 0 {
                return Tried::Missing;
            }
            if entry >> 24 == tag {
                let position = (entry & 0xFF_FFFF) as usize;
                let Some(slot) = self.buckets.get(position.wrapping_sub(1)) else {
                    return Tried::Missing;
                };
                match slot
                    .lock
                    .compare_exchange(FREE, HELD, Ordering::Acquire, Ordering::Relaxed)
                {
                    Ok(_) if slot.key.is(id) => return Tried::Held(Held(slot)),
                    Ok(_) => slot.unlock(),
                    Err(GONE) if slot.key.is(id) => return Tried::Missing,
                    Err(GONE) => {}
                    Err(_) => return Tried::Busy,
                }
            }
            at = (at + 1) & mask;
        }
        Tried::Missing
    }
}

/// A bucket whose lock is held; dropping it releases the lock.
pub(super) struct Held<'t>(&'t Slot);

impl Held<'_> {
    /// Decides on the bucket.
    #[inline]
    pub(super) fn decide<T>(
        self,
        now_ms: u64,
        f: impl FnOnce(Option<State>, u64) -> (T, Option<Write>),
    ) -> T {
        let (out, write) = f(Some(self.0.state()), now_ms);
        if let Some(w) = write {
            self.0.write(&w);
        }
        out
    }
}

impl Held<'_> {
    /// The bucket's state, for a decision on several buckets held at once.
    pub(super) fn state(&self) -> State {
        self.0.state()
    }

    /// Writes the bucket's new state, for a decision on several buckets held at once.
    pub(super) fn store(&self, w: &Write) {
        self.0.write(w);
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.unlock();
    }
}

/// A bucket in a table, with its key, on one cache line: a decision on an existing key reads and
/// writes this line and nothing another thread writes.
#[repr(align(64))]
pub(super) struct Slot {
    /// [`FREE`], [`HELD`] or [`GONE`].
    pub(super) lock: AtomicU8,
    pub(super) key: Key,
    /// The state and the time it is full again, as `f64` bits, read and written under `lock`.
    pub(super) t: AtomicU64,
    pub(super) ts: AtomicU64,
    pub(super) full: AtomicU64,
}

/// A bucket no decision holds.
pub(super) const FREE: u8 = 0;
/// A bucket a decision (or a rebuild) is reading and writing.
const HELD: u8 = 1;
/// A bucket copied into a newer table: its state here is stale, and a decision must look in the
/// shard's current table.
pub(super) const GONE: u8 = 2;

/// The tag an index entry holds for a hash: its top 8 bits (the index uses the low ones).
#[inline]
pub(super) fn tag_of(hash: u64) -> u32 {
    (hash >> 56) as u32
}

impl Slot {
    /// Takes the bucket's lock, unless the bucket has gone to a newer table.
    #[inline]
    pub(super) fn lock(&self, to: u8) -> bool {
        let mut spins = 0;
        loop {
            match self
                .lock
                .compare_exchange_weak(FREE, to, Ordering::Acquire, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(GONE) => return false,
                Err(_) => wait(&mut spins),
            }
        }
    }

    #[inline]
    fn unlock(&self) {
        self.lock.store(FREE, Ordering::Release);
    }

    /// The state, read under the lock.
    #[inline]
    pub(super) fn state(&self) -> State {
        State {
            t: f64::from_bits(self.t.load(Ordering::Relaxed)),
            ts: f64::from_bits(self.ts.load(Ordering::Relaxed)),
        }
    }

    /// Writes a new state, under the lock.
    #[inline]
    fn write(&self, w: &Write) {
        self.t.store(w.state.t.to_bits(), Ordering::Relaxed);
        self.ts.store(w.state.ts.to_bits(), Ordering::Relaxed);
        self.full.store(w.full.to_bits(), Ordering::Relaxed);
    }
}

/// How many times a thread that finds a lock taken checks it again before it gives its core up
/// for a while.
const SPINS_BEFORE_YIELD: u32 = 64;

/// One more wait for a lock another thread holds: a spin, or after [`SPINS_BEFORE_YIELD`] of them
/// a yield to the scheduler, so that a holder that was preempted gets a core back instead of
/// waiting behind the spinner.
#[inline]
pub(super) fn wait(spins: &mut u32) {
    if *spins < SPINS_BEFORE_YIELD {
        *spins += 1;
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}
