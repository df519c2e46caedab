//! A shard of `MemoryStore`: its lock, its new keys and the decisions on them, when it rebuilds
//! its table, and what it forgets at its bound.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use hashbrown::HashTable;
use spinning_top::Spinlock;
use spinning_top::guard::SpinlockGuard;

use super::key::Key;
use super::table::{FREE, GONE, Held, MAX_TABLE_LEN, Slot, Table, Tried, tag_of, wait};
use super::view::{VIEWS, refresh_view};
use super::{MemoryStore, key_hash};
use crate::bucket::{self, PerBucket, State, Write};
use crate::clock::Clock;

/// How often, at most, a shard that new keys reach rebuilds its table, dropping buckets that have
/// been full for [`GRACE_MS`] and taking in its new keys: once a second, and a millisecond less
/// often per bucket it holds ([`SWEEP_MS_PER_BUCKET`]), so that a large store that sees a
/// trickle of new keys does not copy all its buckets every second.
const SWEEP_EVERY_MS: f64 = 1_000.0;

/// See [`SWEEP_EVERY_MS`]: a shard of 4,096 buckets sweeps every four seconds or so.
const SWEEP_MS_PER_BUCKET: f64 = 1.0;

/// How long a bucket stays after it is full again before a shard's own rebuild drops it. A key
/// decided every few milliseconds at a rate far below its limit is full after each decision;
/// without the grace, each rebuild would drop it and its next decision would create it again,
/// under the shard's lock.
const GRACE_MS: f64 = 1_000.0;

/// A shard rebuilds its table early once this many new keys wait for it, or half as many as the
/// table holds, whichever is more, so a flood of new keys costs each key a constant share of
/// the rebuilds.
const MIN_REBUILD_NEW: usize = 16;

/// A shard with new keys rebuilds its table once this many decisions have been taken under its
/// lock since it was made, or twice as many as it holds buckets, whichever is more.
pub(super) const MIN_REBUILD_LOCKED: usize = 64;

/// A shard at its bound evicts down to this share of it (in eighths), so that each eviction,
/// which rebuilds the shard, makes room for many new keys.
const EVICT_TO_EIGHTHS: usize = 7;

/// A shard on cache lines of its own, so that work on neighbouring shards does not make threads
/// write to the same line (false sharing).
#[repr(align(128))]
pub(super) struct Padded(pub(super) Spinlock<Shard>);

pub(super) struct Shard {
    /// The buckets the shard has taken in: never changed once made, but through each bucket's
    /// lock.
    pub(super) table: Table,
    /// Buckets created since the table was made, decided under the shard's lock.
    pub(super) new: HashTable<Entry>,
    /// When the shard next rebuilds its table for time's sake, in milliseconds since the epoch.
    pub(super) rebuild_at: f64,
    /// Decisions taken under the shard's lock since the table was made.
    pub(super) locked_decisions: usize,
    /// How many of the new keys the table had no room for when it was made.
    pub(super) overflow: usize,
    /// Until when a new key finds no room without looking: the last eviction found every
    /// bucket in debt.
    pub(super) no_room_until: f64,
    /// Keys the shard has taken in, counted so that a rebuild lays new keys out in the order
    /// they came.
    pub(super) arrivals: u64,
}

/// A key new to a shard found the shard at its bound, with every bucket in debt: none can be
/// forgotten without freeing tokens that reservations hold.
#[derive(Debug)]
pub(super) struct Full;

/// A bucket not yet in its shard's table.
pub(super) struct Entry {
    key: Key,
    state: State,
    full: f64,
    /// The shard's count of arrivals when the key came.
    arrived: u64,
}

impl<C: Clock> MemoryStore<C> {
    /// Decides under the shard's lock: a key new to the shard, or one this thread's view of the
    /// table does not show as it is.
    #[cold]
    pub(super) fn with_bucket_locked<T>(
        &self,
        index: usize,
        hash: u64,
        id: &[u8],
        now_ms: u64,
        f: impl FnOnce(Option<State>, u64) -> (T, Option<Write>),
    ) -> Result<T, Full> {
        let now = bucket::time(now_ms);
        let mut shard = lock(&self.inner.shards[index].0);
        shard.locked_decisions += 1;
        if shard.wants_rebuild(now) {
            shard.rebuild(now - GRACE_MS, now);
        }
        // Bring this thread's view of the shard up to date, so that its next decision here takes
        // the lock-free path.
        let _ = VIEWS.try_with(|views| {
            if let Ok(mut views) = views.try_borrow_mut()
                && let Some(table) = self.inner.view(&mut views).get_mut(index)
                && !Arc::ptr_eq(&table.buckets, &shard.table.buckets)
            {
                *table = shard.table.clone();
            }
        });
        // Under the shard's lock no rebuild runs, so a bucket of the current table is never gone.
        if let Some(held) = shard.table.hold(hash, id) {
            return Ok(held.decide(now_ms, f));
        }
        let found = shard.new.find_entry(hash, |e| e.key.is(id));
        let state = found.as_ref().ok().map(|e| e.get().state);
        let (out, write) = f(state, now_ms);
        match (found, write) {
            (Ok(mut found), Some(w)) if w.full > now => {
                let entry = found.get_mut();
                entry.state = w.state;
                entry.full = w.full;
            }
            // Full again: a missing bucket says the same, in less memory.
            (Ok(found), Some(_)) => {
                found.remove();
            }
            (Err(_), Some(w)) if w.full > now => {
                let cap = self.inner.shard_cap;
                if shard.held() >= cap {
                    // A shard that found nothing to forget a moment ago is refused at once:
                    // rebuilding it for every new key would cost each a copy of the shard.
                    if now < shard.no_room_until {
                        return Err(Full);
                    }
                    shard.rebuild_evicting(now, cap);
                    self::refresh_view(&self.inner, index, &shard.table);
                    if shard.held() >= cap {
                        shard.no_room_until = now + SWEEP_EVERY_MS;
                        return Err(Full);
                    }
                }
                shard.take_in(hash, id, &w);
            }
            (_, _) => {}
        }
        Ok(out)
    }
}

impl<C: Clock> MemoryStore<C> {
    /// Decides on several buckets at once (`BucketStore::acquire_all`), with every one of them
    /// held for the whole decision.
    ///
    /// First without any shard lock, through this thread's view of the tables, as a decision
    /// on one bucket goes: each bucket is tried once, and the first that is locked by another
    /// decision, missing from its table or gone to a newer one releases every bucket held so
    /// far, and the decision goes to [`with_buckets_locked`](Self::with_buckets_locked). A
    /// decision here never waits while it holds a bucket, so it cannot be part of a deadlock.
    #[inline]
    pub(super) fn with_buckets<T>(
        &self,
        ids: &[&[u8]],
        f: impl FnOnce(&[Option<State>], u64, &mut [Option<Write>]) -> T,
    ) -> Result<T, Full> {
        let keys: PerBucket<(u64, usize)> = ids
            .iter()
            .map(|id| {
                let hash = key_hash(id);
                (hash, self.inner.shard_of(hash))
            })
            .collect();
        let now_ms = self.clock.now_ms();
        let mut f = Some(f);
        let fast = VIEWS.try_with(|views| {
            let mut views = views.try_borrow_mut().ok()?;
            let tables: &[Table] = self.inner.view(&mut views);
            let mut held: PerBucket<Held<'_>> = PerBucket::new();
            for (id, &(hash, index)) in ids.iter().zip(&keys) {
                // Returning drops what is held so far, which releases it.
                match tables.get(index)?.try_hold(hash, id) {
                    Tried::Held(h) => held.push(h),
                    Tried::Missing | Tried::Busy => return None,
                }
            }
            let states: PerBucket<Option<State>> = held.iter().map(|h| Some(h.state())).collect();
            let mut writes: PerBucket<Option<Write>> = ids.iter().map(|_| None).collect();
            let out = f.take()?(&states, now_ms, &mut writes);
            for (h, w) in held.iter().zip(&writes) {
                if let Some(w) = w {
                    h.store(w);
                }
            }
            Some(out)
        });
        match (fast, f) {
            (Ok(Some(out)), _) => Ok(out),
            (_, Some(f)) => self.with_buckets_locked(ids, &keys, now_ms, f),
            // `f` is only taken once every bucket is held, and then decides.
            (_, None) => unreachable!("a decision's function was used and its result lost"),
        }
    }

    /// [`with_buckets`](Self::with_buckets) under the shards' locks: for keys new to their
    /// shards, and for buckets another decision held when the lock-free try came.
    ///
    /// The lock order that keeps this free of deadlock (docs/DESIGN.md#several-buckets-at-once):
    /// the shards of the keys first, each once, in ascending order of index, and then the
    /// buckets. Every other path holds at most one shard and then a bucket of it (a decision
    /// under the shard's lock, a rebuild), or a bucket alone (the lock-free path), and waits for
    /// nothing while it holds a bucket; so the buckets taken here are only ever waited for
    /// while their holders finish. With its shards held, no rebuild can move a bucket to a newer
    /// table, and no other thread can add or remove a new key, so room for the keys the shards
    /// do not hold yet is made (or refused) before any bucket is held.
    #[cold]
    fn with_buckets_locked<T>(
        &self,
        ids: &[&[u8]],
        keys: &[(u64, usize)],
        now_ms: u64,
        f: impl FnOnce(&[Option<State>], u64, &mut [Option<Write>]) -> T,
    ) -> Result<T, Full> {
        let mut order: PerBucket<usize> = keys.iter().map(|&(_, shard)| shard).collect();
        order.sort_unstable();
        order.dedup();
        let now = bucket::time(now_ms);
        let mut guards: PerBucket<SpinlockGuard<'_, Shard>> = order
            .iter()
            .map(|&index| lock(&self.inner.shards[index].0))
            .collect();
        let guard_of = |shard: usize| order.binary_search(&shard).unwrap_or(0);
        let cap = self.inner.shard_cap;
        for (n, shard) in guards.iter_mut().enumerate() {
            shard.locked_decisions += 1;
            if shard.wants_rebuild(now) {
                shard.rebuild(now - GRACE_MS, now);
            }
            // Room for every key of the request is the usual case, and needs no look.
            if shard.held() + ids.len() <= cap {
                continue;
            }
            let absent = ids
                .iter()
                .zip(keys)
                .filter(|&(id, &(hash, s))| {
                    guard_of(s) == n
                        && shard.table.find(hash, id).is_none()
                        && shard.new.find(hash, |e| e.key.is(id)).is_none()
                })
                .count();
            if absent > 0 && shard.held() + absent > cap {
                // More new keys than the shard holds at all, or a shard found full of debt a
                // moment ago: refused without forgetting anything.
                if absent > cap || now < shard.no_room_until {
                    return Err(Full);
                }
                // No view is refreshed here: making a thread's first view locks every shard,
                // some of which this call holds. The thread's next decision refreshes it.
                shard.rebuild_evicting(now, cap.saturating_sub(absent));
                if shard.held() + absent > cap {
                    shard.no_room_until = now + SWEEP_EVERY_MS;
                    return Err(Full);
                }
            }
        }
        let (out, writes) = {
            // Each bucket looked up besides those held already: a key whose tag another of
            // the request's buckets shares must not wait for that bucket's lock, its own.
            let mut held: PerBucket<Option<Held<'_>>> = PerBucket::new();
            for (id, &(hash, s)) in ids.iter().zip(keys) {
                let h = guards[guard_of(s)].table.hold_besides(hash, id, &held);
                held.push(h);
            }
            let states: PerBucket<Option<State>> = ids
                .iter()
                .zip(keys)
                .zip(&held)
                .map(|((id, &(hash, s)), held)| match held {
                    Some(held) => Some(held.state()),
                    None => guards[guard_of(s)]
                        .new
                        .find(hash, |e| e.key.is(id))
                        .map(|e| e.state),
                })
                .collect();
            let mut writes: PerBucket<Option<Write>> = ids.iter().map(|_| None).collect();
            let out = f(&states, now_ms, &mut writes);
            for (held, write) in held.iter().zip(writes.iter_mut()) {
                if let (Some(held), Some(w)) = (held, write.as_ref()) {
                    held.store(w);
                    // Written: what is left is for the buckets among the new keys.
                    *write = None;
                } else if held.is_some() {
                    *write = None;
                }
            }
            (out, writes)
        };
        // The buckets among the shards' new keys, under the shards' locks still.
        for ((id, &(hash, s)), write) in ids.iter().zip(keys).zip(writes) {
            let Some(w) = write else { continue };
            let shard = &mut guards[guard_of(s)];
            match shard.new.find_entry(hash, |e| e.key.is(id)) {
                Ok(mut found) if w.full > now => {
                    let entry = found.get_mut();
                    entry.state = w.state;
                    entry.full = w.full;
                }
                Ok(found) => {
                    found.remove();
                }
                Err(_) if w.full > now => {
                    shard.take_in(hash, id, &w);
                }
                Err(_) => {}
            }
        }
        Ok(out)
    }
}

impl Shard {
    /// The buckets the shard holds, in its table and among its new keys.
    fn held(&self) -> usize {
        self.table.buckets.len() + self.new.len()
    }

    /// Takes in the key `id`, new to the shard, with the bucket `w` wrote, among the new keys
    /// (the caller has made room for it).
    fn take_in(&mut self, hash: u64, id: &[u8], w: &Write) {
        self.arrivals += 1;
        let entry = Entry {
            key: Key::new(id),
            state: w.state,
            full: w.full,
            arrived: self.arrivals,
        };
        self.new
            .insert_unique(hash, entry, |e| key_hash(e.key.as_bytes()));
    }

    /// Makes room under the bound `cap`: a rebuild that drops every full bucket and, if the
    /// shard is still above seven eighths of its bound, forgets the buckets that will be full
    /// soonest, those whose keys lose least by being forgotten. A bucket in debt is never
    /// forgotten: its debt is the slots reservations hold, and forgetting it would give them out
    /// again.
    #[cold]
    fn rebuild_evicting(&mut self, now: f64, cap: usize) {
        let keep = if cap >= 8 {
            cap / 8 * EVICT_TO_EIGHTHS
        } else {
            cap.saturating_sub(1)
        };
        self.rebuild_keeping(now, now, keep);
    }

    /// Whether to rebuild the table before a decision under the lock: once its sweep is due
    /// ([`SWEEP_EVERY_MS`]); once the new keys number half the table (and at least [`MIN_REBUILD_NEW`]); or
    /// once the decisions under the lock since the last rebuild outnumber twice the buckets (and
    /// [`MIN_REBUILD_LOCKED`]), so that a key decided often while new moves to the lock-free
    /// path soon, and each such decision pays a constant share of the rebuild.
    fn wants_rebuild(&self, now: f64) -> bool {
        let live = self.table.buckets.len();
        let held = live + self.new.len();
        // Buckets a full table left with the new keys do not count as new: counted, they would
        // make every decision under the lock rebuild.
        let new = self.new.len().saturating_sub(self.overflow);
        now >= self.rebuild_at
            || new >= MIN_REBUILD_NEW.max(live / 2)
            || (new > 0 && self.locked_decisions >= MIN_REBUILD_LOCKED.max(2 * held))
    }

    /// Replaces the table with one that holds its buckets still not full at `keep_after`, and the
    /// new keys; each bucket of the old table is marked gone once copied, under its lock, so no
    /// decision through the old table is lost.
    pub(super) fn rebuild(&mut self, keep_after: f64, now: f64) {
        self.rebuild_keeping(keep_after, now, usize::MAX);
    }

    /// [`rebuild`](Self::rebuild), keeping at most `most` buckets not in debt.
    fn rebuild_keeping(&mut self, keep_after: f64, now: f64, most: usize) {
        let held = self.table.buckets.len() + self.new.len();
        self.rebuild_at = now + SWEEP_EVERY_MS.max(held as f64 * SWEEP_MS_PER_BUCKET);
        self.locked_decisions = 0;
        let new = std::mem::take(&mut self.new);
        let mut kept: Vec<(u64, Entry)> = Vec::with_capacity(self.table.buckets.len() + new.len());
        for slot in self.table.buckets.iter() {
            // Never unlocked: the bucket lives on in the new table.
            if !slot.lock(GONE) {
                continue;
            }
            let full = f64::from_bits(slot.full.load(Ordering::Relaxed));
            if full > keep_after {
                let entry = Entry {
                    key: slot.key.clone(),
                    state: slot.state(),
                    full,
                    arrived: 0,
                };
                kept.push((key_hash(entry.key.as_bytes()), entry));
            }
        }
        // New keys after the table's own, in the order they came: keys that arrive together
        // often come back together, and then find their buckets side by side.
        let mut arrived: Vec<Entry> = new.into_iter().filter(|e| e.full > keep_after).collect();
        arrived.sort_unstable_by_key(|e| e.arrived);
        kept.extend(arrived.into_iter().map(|e| (key_hash(e.key.as_bytes()), e)));
        evict(&mut kept, most);
        let in_table = kept.len().min(MAX_TABLE_LEN);
        // At most three eighths full (the table's docs say why).
        let len = (2 * in_table + 2 * in_table / 3 + 1).next_power_of_two();
        let mut index = vec![0_u32; len];
        let mask = len - 1;
        let mut buckets = Vec::with_capacity(in_table);
        for (hash, entry) in kept {
            if buckets.len() >= MAX_TABLE_LEN {
                self.new
                    .insert_unique(hash, entry, |e| key_hash(e.key.as_bytes()));
                continue;
            }
            // Below 2^24, as the check above keeps it.
            let position = buckets.len() as u32 + 1;
            let mut at = hash as usize & mask;
            // Never full, so an empty entry comes within `len` steps.
            while index.get(at).is_some_and(|&e| e != 0) {
                at = (at + 1) & mask;
            }
            if let Some(e) = index.get_mut(at) {
                *e = tag_of(hash) << 24 | position;
            }
            buckets.push(Slot {
                lock: AtomicU8::new(FREE),
                key: entry.key,
                t: AtomicU64::new(entry.state.t.to_bits()),
                ts: AtomicU64::new(entry.state.ts.to_bits()),
                full: AtomicU64::new(entry.full.to_bits()),
            });
        }
        self.overflow = self.new.len();
        self.table = Table {
            index: index.into(),
            buckets: buckets.into(),
        };
    }
}

/// Forgets buckets until at most `most` remain, those that will be full soonest first, and never
/// one in debt (a stored `t` below zero: it may have paid the debt off since, and is then kept a
/// little longer than need be, the safe side).
fn evict(kept: &mut Vec<(u64, Entry)>, most: usize) {
    let excess = kept.len().saturating_sub(most);
    if excess == 0 {
        return;
    }
    let order = |e: &Entry| {
        if e.state.t < 0.0 {
            f64::INFINITY
        } else {
            e.full
        }
    };
    // The `most` buckets full latest (or in debt) to the front, in linear time; the rest are the
    // candidates, and of them only those not in debt go.
    kept.select_nth_unstable_by(most, |a, b| order(&b.1).total_cmp(&order(&a.1)));
    let mut at = most;
    while let Some((_, e)) = kept.get(at) {
        if e.state.t >= 0.0 {
            // Brings the last candidate here, to be looked at next.
            kept.swap_remove(at);
        } else {
            at += 1;
        }
    }
}

/// Locks a shard.
///
/// A spin lock, because a shard is held for the arithmetic alone (longer only while it rebuilds
/// its table): taking it is one compare-and-swap and releasing it one plain store.
#[inline]
pub(super) fn lock(shard: &Spinlock<Shard>) -> SpinlockGuard<'_, Shard> {
    loop {
        if let Some(guard) = shard.try_lock() {
            return guard;
        }
        let mut spins = 0;
        while shard.is_locked() {
            wait(&mut spins);
        }
    }
}
