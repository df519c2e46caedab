//! The local deny cache: the last state Redis showed for a bucket that denied, so that requests
//! which that state already denies are answered here, without a round trip.
//!
//! Why it denies only what Redis would deny, and for how long it may deny more: see
//! docs/DESIGN.md#the-deny-cache.

use std::sync::{Mutex, MutexGuard, PoisonError};

use hashbrown::{DefaultHashBuilder, HashTable};

use crate::bucket::{self, Outcome, Params, State};
use crate::store::sharding;
use crate::{BucketKey, Limit};

/// Entries per shard; a full shard first drops entries whose buckets would admit by now, and
/// when it is still full, the newest denial is simply not cached.
const SHARD_CAPACITY: usize = 1024;
const SHARDS: usize = 16;

struct Entry {
    key: Box<str>,
    limit: Limit,
    state: State,
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

/// What [`DenyCache::check`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Check {
    /// The cached state denies: the answer, with no round trip.
    Deny(Outcome),
    /// Redis must decide. With the outcome the cached state predicts when an entry took the
    /// cost, as it expects Redis to.
    Pass(Option<Outcome>),
}

pub(super) struct DenyCache {
    shards: Box<[Mutex<HashTable<Entry>>]>,
    hasher: DefaultHashBuilder,
}

impl DenyCache {
    pub(super) fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(HashTable::new())).collect(),
            hasher: DefaultHashBuilder::default(),
        }
    }

    fn shard(&self, key: &str) -> (u64, MutexGuard<'_, HashTable<Entry>>) {
        let hash = sharding::hash(&self.hasher, key.as_bytes());
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
        let (hash, mut shard) = self.shard(id);
        let Ok(mut found) = shard.find_entry(hash, |e| &*e.key == id) else {
            return Check::Pass(None);
        };
        let entry = found.get_mut();
        if entry.limit == limit {
            let (outcome, write) =
                bucket::evaluate(&Params::of(&limit), Some(entry.state), now, cost, max_wait);
            // A denial writes only a stored time moved back to the lead bound, which the entry
            // keeps as Redis will.
            if let Some(w) = write {
                entry.state = w.state;
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

    /// A guard that drops `key`'s entry when it is dropped, unless disarmed first.
    pub(super) fn forget_on_drop<'a>(&'a self, key: &'a BucketKey) -> ForgetOnDrop<'a> {
        ForgetOnDrop { cache: self, key }
    }

    /// Replaces the state of an entry, if there is one, with what Redis stored.
    pub(super) fn refresh(&self, key: &BucketKey, state: State) {
        let id = key.as_str();
        let (hash, mut shard) = self.shard(id);
        if let Some(entry) = shard.find_mut(hash, |e| &*e.key == id) {
            entry.state = state;
        }
    }

    /// Keeps the state Redis showed with a denial.
    pub(super) fn remember(&self, key: &BucketKey, limit: Limit, state: State, now: u64) {
        let id = key.as_str();
        let (hash, mut shard) = self.shard(id);
        if let Some(entry) = shard.find_mut(hash, |e| &*e.key == id) {
            entry.limit = limit;
            entry.state = state;
            return;
        }
        if shard.len() >= SHARD_CAPACITY {
            // What would admit a single token now can no longer deny anything.
            shard.retain(|e| {
                !bucket::evaluate(&Params::of(&e.limit), Some(e.state), now, 1.0, 0)
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
        shard.insert_unique(hash, entry, |e| {
            sharding::hash(&self.hasher, e.key.as_bytes())
        });
    }

    /// Drops what is known of a bucket, after this process changed it other than by spending.
    pub(super) fn forget(&self, key: &BucketKey) {
        let id = key.as_str();
        let (hash, mut shard) = self.shard(id);
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
            State {
                t: 0.0,
                ts: 10_000.0,
            },
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
        let state = State { t: 0.0, ts: 0.0 };
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
                State {
                    t: 0.0,
                    ts: i as f64,
                },
                i as u64,
            );
        }
        assert!(cache.len() <= SHARD_CAPACITY * SHARDS);
    }
}
