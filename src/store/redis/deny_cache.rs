//! The local deny cache: the last state Redis showed for a bucket that denied, or for each
//! bucket of a request on several that it denied, so that requests which those states already
//! deny are answered here, without a round trip.
//!
//! Why it denies only what Redis would deny, and for how long it may deny more: see
//! docs/DESIGN.md#the-deny-cache.

use std::sync::{Mutex, MutexGuard, PoisonError};

use hashbrown::HashTable;

use crate::bucket::{self, Params, Part, PerBucket, State, Verdict};
use crate::store::{Take, sharding};
use crate::{BucketKey, Limit};

/// Entries per shard; a full shard first drops entries whose buckets would admit by now, and
/// when it is still full, the newest denial is simply not cached.
const SHARD_CAPACITY: usize = 1024;
const SHARDS: usize = 16;

struct Entry {
    key: Box<str>,
    limit: Limit,
    /// `None` for a key Redis held nothing at, as a denial of several buckets can show for the
    /// ones that did not refuse: a full bucket, as of each caller's own time.
    state: Option<State>,
}

/// Drops an entry that took a call's cost ahead of Redis, if the call goes away (its future is
/// dropped) before Redis answered: Redis may never see the call, and the entry would deny what
/// Redis admits.
pub(super) struct ForgetOnDrop<'a> {
    cache: &'a DenyCache,
    key: &'a BucketKey,
}

impl ForgetOnDrop<'_> {
    /// Redis answered, and the entry was brought in line with it.
    pub(super) fn disarm(self) {
        std::mem::forget(self);
    }
}

impl Drop for ForgetOnDrop<'_> {
    fn drop(&mut self) {
        self.cache.forget(self.key);
    }
}

/// [`ForgetOnDrop`] for every bucket of a request on several.
pub(super) struct ForgetAllOnDrop<'a, 'k> {
    cache: &'a DenyCache,
    takes: &'a [Take<'k>],
}

impl ForgetAllOnDrop<'_, '_> {
    /// Redis answered, and the entries were brought in line with it.
    pub(super) fn disarm(self) {
        std::mem::forget(self);
    }
}

impl Drop for ForgetAllOnDrop<'_, '_> {
    fn drop(&mut self) {
        for take in self.takes {
            self.cache.forget(take.key());
        }
    }
}

/// What [`DenyCache::check`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Check {
    /// The cached state denies: the answer, with no round trip.
    Deny(Verdict),
    /// Redis must decide. With the outcome the cached state predicts when an entry took the
    /// cost, as it expects Redis to.
    Pass(Option<Verdict>),
}

/// The shard of this index among those held.
fn held_shard<'h>(
    held: &'h mut [(usize, MutexGuard<'_, HashTable<Entry>>)],
    index: usize,
) -> Option<&'h mut HashTable<Entry>> {
    held.iter_mut()
        .find(|(i, _)| *i == index)
        .map(|(_, shard)| &mut **shard)
}

/// What [`DenyCache::check_all`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum CheckAll {
    /// The cached states refuse the request: each bucket's outcome, in the order of the takes,
    /// as Redis would give it on those states, with no round trip.
    Deny(PerBucket<Verdict>),
    /// Redis must decide. `true` when every bucket had an entry and each took its part of the
    /// request, as Redis is expected to.
    Pass(bool),
}

pub(super) struct DenyCache {
    shards: Box<[Mutex<HashTable<Entry>>]>,
}

impl DenyCache {
    pub(super) fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashTable::new())).collect(),
        }
    }

    /// `key`'s shard, locked, and the key's hash, which `key` carries.
    fn shard(&self, key: &BucketKey) -> (u64, MutexGuard<'_, HashTable<Entry>>) {
        let hash = key.id_hash();
        let shard = self.shards[sharding::index(hash, SHARDS)]
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        (hash, shard)
    }

    /// Whether the cached state denies an acquire, or Redis must decide.
    ///
    /// When the cached state would admit, the request goes to Redis and the entry keeps the
    /// state with the cost taken, as if Redis admits: the requests that follow it in this
    /// process are then denied here until the next token, instead of all racing to Redis for
    /// the one that just refilled. What the caller does with Redis's answer keeps the entry
    /// true: a failed call drops it (the debit may not have happened in Redis), a denial replaces
    /// it with the state Redis denied on, and an admission replaces it with the state Redis
    /// stored ([`refresh`](Self::refresh)), or drops it when the answer carries no state and is
    /// not the one the entry predicted.
    pub(super) fn check(
        &self,
        key: &BucketKey,
        limit: Limit,
        now: u64,
        cost: f64,
        max_wait: u64,
    ) -> Check {
        let id = key.as_str();
        let (hash, mut shard) = self.shard(key);
        let Ok(mut found) = shard.find_entry(hash, |e| &*e.key == id) else {
            return Check::Pass(None);
        };
        let entry = found.get_mut();
        if entry.limit == limit {
            let (outcome, write) =
                bucket::evaluate(&Params::of(&limit), entry.state, now, cost, max_wait);
            // A denial writes only a stored time moved back to the lead bound, which the entry
            // keeps as Redis will.
            if let Some(w) = write {
                entry.state = Some(w.state);
            }
            return if outcome.allowed {
                Check::Pass(Some(outcome))
            } else {
                Check::Deny(outcome)
            };
        }
        found.remove();
        Check::Pass(None)
    }

    /// Whether the cached states deny a request on the buckets of `takes` (checked by
    /// `check_takes`: at most `MAX_TAKES`, no bucket twice, each cost within its burst), or
    /// Redis must decide.
    ///
    /// The cache answers only when every bucket has an entry under its limit: the outcomes of a
    /// refusal are each bucket's own (its wait, what it holds, when it is full), so the buckets
    /// that do not refuse need their states too, which a denial of several buckets gives for
    /// all of them. The answer is then `bucket::evaluate_all` on the entries, the arithmetic
    /// Redis runs on its values: a refusal is exactly Redis's on those states, and takes
    /// nothing, so all or none still holds. An admission goes to Redis, each entry taking its
    /// part of the request as [`check`](Self::check) takes a single bucket's, so that the
    /// requests behind it in this process are refused here until the next token. A bucket
    /// without an entry sends the request to Redis with nothing taken.
    ///
    /// The shards of the request's buckets are held together, taken in ascending order of
    /// index: every other path holds one shard at a time, so no two can wait on each other, and
    /// no other call sees some of the entries charged and not the others.
    pub(super) fn check_all(&self, takes: &[Take<'_>], now: u64, max_wait: u64) -> CheckAll {
        let hashes: PerBucket<(u64, usize)> = takes
            .iter()
            .map(|t| {
                let hash = t.key().id_hash();
                (hash, sharding::index(hash, SHARDS))
            })
            .collect();
        let mut order: PerBucket<usize> = hashes.iter().map(|&(_, i)| i).collect();
        order.sort_unstable();
        order.dedup();
        let mut held: PerBucket<(usize, MutexGuard<'_, HashTable<Entry>>)> = order
            .iter()
            .map(|&i| {
                let shard = self.shards[i]
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                (i, shard)
            })
            .collect();
        let mut parts: PerBucket<Part> = PerBucket::with_capacity(takes.len());
        for (take, &(hash, index)) in takes.iter().zip(&hashes) {
            let Some(shard) = held_shard(&mut held, index) else {
                return CheckAll::Pass(false);
            };
            let id = take.key().as_str();
            match shard.find_entry(hash, |e| &*e.key == id) {
                Ok(found) if found.get().limit == take.limit() => parts.push(Part {
                    p: Params::of(&take.limit()),
                    state: found.get().state,
                    cost: f64::from(take.cost()),
                }),
                // Another limit's arithmetic on the state proves nothing.
                Ok(found) => {
                    found.remove();
                    return CheckAll::Pass(false);
                }
                Err(_) => return CheckAll::Pass(false),
            }
        }
        let mut outcomes = PerBucket::with_capacity(takes.len());
        let mut writes: PerBucket<Option<State>> = PerBucket::with_capacity(takes.len());
        let admitted = bucket::evaluate_all(&parts, now, max_wait, |outcome, write| {
            outcomes.push(outcome);
            writes.push(write.map(|w| w.state));
        });
        // An admission's writes are the request's part taken; a refusal's, stored times moved
        // back to the lead bound, which the entries keep as Redis will.
        for ((take, &(hash, index)), write) in takes.iter().zip(&hashes).zip(writes) {
            let id = take.key().as_str();
            if let (Some(state), Some(shard)) = (write, held_shard(&mut held, index))
                && let Some(entry) = shard.find_mut(hash, |e| &*e.key == id)
            {
                entry.state = Some(state);
            }
        }
        if admitted {
            CheckAll::Pass(true)
        } else {
            CheckAll::Deny(outcomes)
        }
    }

    /// A guard that drops the entry of every bucket of `takes` when it is dropped, unless
    /// disarmed first.
    pub(super) fn forget_all_on_drop<'a, 'k>(
        &'a self,
        takes: &'a [Take<'k>],
    ) -> ForgetAllOnDrop<'a, 'k> {
        ForgetAllOnDrop { cache: self, takes }
    }

    /// A guard that drops `key`'s entry when it is dropped, unless disarmed first.
    pub(super) fn forget_on_drop<'a>(&'a self, key: &'a BucketKey) -> ForgetOnDrop<'a> {
        ForgetOnDrop { cache: self, key }
    }

    /// Replaces the state of an entry, if there is one, with what Redis stored.
    pub(super) fn refresh(&self, key: &BucketKey, state: State) {
        let id = key.as_str();
        let (hash, mut shard) = self.shard(key);
        if let Some(entry) = shard.find_mut(hash, |e| &*e.key == id) {
            entry.state = Some(state);
        }
    }

    /// Keeps the state Redis showed with a denial (`None`: the key held nothing).
    pub(super) fn remember(&self, key: &BucketKey, limit: Limit, state: Option<State>, now: u64) {
        let id = key.as_str();
        let (hash, mut shard) = self.shard(key);
        if let Some(entry) = shard.find_mut(hash, |e| &*e.key == id) {
            entry.limit = limit;
            entry.state = state;
            return;
        }
        if shard.len() >= SHARD_CAPACITY {
            // What would admit a single token now can no longer deny anything.
            shard.retain(|e| {
                !bucket::evaluate(&Params::of(&e.limit), e.state, now, 1.0, 0)
                    .0
                    .allowed
            });
            if shard.len() >= SHARD_CAPACITY {
                return;
            }
        }
        let entry = Entry {
            key: id.into(),
            limit,
            state,
        };
        shard.insert_unique(hash, entry, |e| sharding::key_hash(e.key.as_bytes()));
    }

    /// Drops what is known of a bucket, after this process changed it other than by spending.
    pub(super) fn forget(&self, key: &BucketKey) {
        let id = key.as_str();
        let (hash, mut shard) = self.shard(key);
        if let Ok(found) = shard.find_entry(hash, |e| &*e.key == id) {
            found.remove();
        }
    }

    /// Entries held, for tests.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).len())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn limit() -> Limit {
        Limit::new(1, Duration::from_secs(1))
            .and_then(|l| l.with_burst(2))
            .expect("a valid limit")
    }

    #[test]
    fn denies_exactly_what_the_state_denies_then_lets_redis_decide() {
        let cache = DenyCache::new();
        let key = BucketKey::new("b", "k").expect("a valid key");
        // Empty at t = 10 000: the next token is due at 11 000.
        cache.remember(
            &key,
            limit(),
            Some(State {
                t: 0.0,
                ts: 10_000.0,
            }),
            10_000,
        );
        let Check::Deny(denied) = cache.check(&key, limit(), 10_500, 1.0, 0) else {
            panic!("a cached denial")
        };
        assert!(!denied.allowed);
        assert_eq!(denied.wait, 500);
        // A reservation that fits its wait is Redis's to make, and is taken from the entry as
        // Redis will take it: the next token is then promised, due at 12 000.
        assert!(matches!(
            cache.check(&key, limit(), 10_500, 1.0, 500),
            Check::Pass(Some(o)) if o.allowed && o.wait == 500
        ));
        assert_eq!(cache.len(), 1);
        let Check::Deny(denied) = cache.check(&key, limit(), 10_500, 1.0, 0) else {
            panic!("a cached denial")
        };
        assert_eq!(denied.wait, 1_500);
        assert!(matches!(
            cache.check(&key, limit(), 12_000, 1.0, 0),
            Check::Pass(Some(_))
        ));
        assert!(
            matches!(cache.check(&key, limit(), 12_000, 1.0, 0), Check::Deny(_)),
            "taken by the last one"
        );
        // What Redis stored replaces the entry's own guess: here a bucket flushed meanwhile.
        cache.refresh(
            &key,
            State {
                t: 1.0,
                ts: 12_000.0,
            },
        );
        assert!(matches!(
            cache.check(&key, limit(), 12_000, 1.0, 0),
            Check::Pass(Some(_))
        ));
    }

    #[test]
    fn another_limit_or_a_forget_drops_the_entry() {
        let cache = DenyCache::new();
        let key = BucketKey::new("b", "k").expect("a valid key");
        let state = Some(State { t: 0.0, ts: 0.0 });
        cache.remember(&key, limit(), state, 0);
        let other = Limit::per_minute(1).expect("a valid limit");
        assert_eq!(cache.check(&key, other, 1, 1.0, 0), Check::Pass(None));
        assert_eq!(cache.len(), 0);
        cache.remember(&key, limit(), state, 0);
        cache.forget(&key);
        assert_eq!(cache.check(&key, limit(), 1, 1.0, 0), Check::Pass(None));
    }

    #[test]
    fn a_full_shard_drops_what_would_admit_and_stays_bounded() {
        let cache = DenyCache::new();
        for i in 0..(SHARD_CAPACITY * SHARDS * 2) {
            let key = BucketKey::new("b", i.to_string()).expect("a valid key");
            cache.remember(
                &key,
                limit(),
                Some(State {
                    t: 0.0,
                    ts: i as f64,
                }),
                i as u64,
            );
        }
        assert!(cache.len() <= SHARD_CAPACITY * SHARDS);
    }

    /// Two buckets a layer puts together: a client's own, and a global one.
    fn own_and_global() -> (BucketKey, BucketKey, Limit, Limit) {
        let own = BucketKey::new("own", "client").expect("a valid key");
        let global = BucketKey::new("global", "client").expect("a valid key");
        let wide = Limit::new(3, Duration::from_millis(700))
            .and_then(|l| l.with_burst(5))
            .expect("a valid limit");
        (own, global, limit(), wide)
    }

    /// What the reference decides for the request on these states: admitted, and each bucket's
    /// outcome and state after.
    fn reference(
        takes: &[Take<'_>],
        states: &[Option<State>],
        now: u64,
        max_wait: u64,
    ) -> (bool, Vec<Verdict>, Vec<Option<State>>) {
        let parts: Vec<Part> = takes
            .iter()
            .zip(states)
            .map(|(t, &state)| Part {
                p: Params::of(&t.limit()),
                state,
                cost: f64::from(t.cost()),
            })
            .collect();
        let (admitted, decided) = bucket::evaluate_all_collected(&parts, now, max_wait);
        let after = decided
            .iter()
            .zip(states)
            .map(|((_, w), &s)| w.map(|w| w.state).or(s))
            .collect();
        (
            admitted,
            decided.into_iter().map(|(o, _)| o).collect(),
            after,
        )
    }

    #[test]
    fn several_buckets_are_refused_here_exactly_as_the_reference_refuses_them() {
        let cache = DenyCache::new();
        let (own, global, one, wide) = own_and_global();
        // The client's bucket empty at 10 000 (its next token at 11 000), the global one holding
        // nothing in Redis (a full bucket), or some tokens, or in debt, or stored a little ahead
        // of this clock (another host's write).
        for global_state in [
            None,
            Some(State {
                t: 2.5,
                ts: 9_000.0,
            }),
            Some(State {
                t: -1.0,
                ts: 10_000.0,
            }),
            Some(State {
                t: 0.5,
                ts: 10_300.0,
            }),
        ] {
            let own_state = Some(State {
                t: 0.0,
                ts: 10_000.0,
            });
            let mut states = vec![own_state, global_state];
            cache.remember(&own, one, own_state, 10_000);
            cache.remember(&global, wide, global_state, 10_000);
            let mut seen = [0; 2];
            for (now, cost, max_wait) in [
                (10_000, 1, 0),
                (10_400, 1, 0),
                (10_400, 2, 599),
                (10_999, 1, 0),
                (11_000, 1, 0),
                (11_000, 1, 0),
                (11_500, 1, 400),
                (11_500, 1, 600),
                (11_500, 1, 2_000),
                (12_000, 2, 0),
            ] {
                let takes = [Take::new(&own, one, cost), Take::new(&global, wide, 1)];
                let (admitted, outcomes, after) = reference(&takes, &states, now, max_wait);
                let got = cache.check_all(&takes, now, max_wait);
                seen[usize::from(admitted)] += 1;
                if admitted {
                    // Redis decides, each entry having taken its part as Redis will.
                    assert_eq!(got, CheckAll::Pass(true), "at {now}");
                } else {
                    assert_eq!(got, CheckAll::Deny(outcomes.into()), "at {now}");
                }
                states = after;
            }
            assert!(
                seen[0] >= 3 && seen[1] >= 2,
                "{seen:?} for {global_state:?}"
            );
            // The entries followed the reference through every admission.
            for (key, l, state) in [(&own, one, states[0]), (&global, wide, states[1])] {
                let id = key.as_str();
                let (hash, shard) = cache.shard(key);
                let entry = shard.find(hash, |e| &*e.key == id).expect("an entry");
                assert_eq!((entry.limit, entry.state), (l, state));
            }
        }
    }

    #[test]
    fn a_bucket_without_an_entry_or_under_another_limit_sends_the_request_to_redis_untaken() {
        let cache = DenyCache::new();
        let (own, global, one, wide) = own_and_global();
        let empty = Some(State {
            t: 0.0,
            ts: 10_000.0,
        });
        // The client's bucket alone refuses, but what the global one would report is unknown.
        cache.remember(&own, one, empty, 10_000);
        let takes = [Take::new(&own, one, 1), Take::new(&global, wide, 1)];
        assert_eq!(cache.check_all(&takes, 10_500, 0), CheckAll::Pass(false));
        // Nothing taken: at its next token the client's bucket admits as it would have.
        assert!(matches!(
            cache.check(&own, one, 11_000, 1.0, 0),
            Check::Pass(Some(o)) if o.allowed
        ));
        // An entry under another limit proves nothing, and goes.
        cache.remember(&own, one, empty, 10_000);
        cache.remember(&global, wide, None, 10_000);
        let other = Limit::per_minute(1).expect("a valid limit");
        let takes = [Take::new(&own, one, 1), Take::new(&global, other, 1)];
        assert_eq!(cache.check_all(&takes, 10_500, 0), CheckAll::Pass(false));
        assert_eq!(cache.len(), 1);
        assert_eq!(
            cache.check(&global, wide, 10_500, 1.0, 0),
            Check::Pass(None)
        );
    }

    #[test]
    fn a_guard_on_several_buckets_forgets_them_all_unless_disarmed() {
        let cache = DenyCache::new();
        let (own, global, one, wide) = own_and_global();
        let takes = [Take::new(&own, one, 1), Take::new(&global, wide, 1)];
        cache.remember(&own, one, None, 0);
        cache.remember(&global, wide, None, 0);
        cache.forget_all_on_drop(&takes).disarm();
        assert_eq!(cache.len(), 2);
        drop(cache.forget_all_on_drop(&takes));
        assert_eq!(cache.len(), 0);
    }

    #[test]
    fn requests_on_several_buckets_in_any_order_never_deadlock() {
        let cache = DenyCache::new();
        // Keys enough to span most shards, taken in opposite orders by two threads, a third
        // deciding on them one at a time.
        let keys: Vec<BucketKey> = (0..24)
            .map(|i| BucketKey::new("b", i.to_string()).expect("a valid key"))
            .collect();
        for k in &keys {
            cache.remember(k, limit(), Some(State { t: 0.0, ts: 0.0 }), 0);
        }
        std::thread::scope(|scope| {
            for turn in 0..3 {
                let (cache, keys) = (&cache, &keys);
                scope.spawn(move || {
                    for round in 0..2_000u64 {
                        let mut order: Vec<&BucketKey> = keys.iter().collect();
                        if turn == 1 {
                            order.reverse();
                        }
                        if turn == 2 {
                            let _ =
                                cache.check(order[(round % 24) as usize], limit(), round, 1.0, 0);
                            continue;
                        }
                        let at = (round % 4) as usize * 4;
                        let takes: Vec<Take<'_>> = order[at..at + 8]
                            .iter()
                            .map(|k| Take::new(k, limit(), 1))
                            .collect();
                        let _ = cache.check_all(&takes, round, 0);
                    }
                });
            }
        });
        assert_eq!(cache.len(), keys.len());
    }
}
