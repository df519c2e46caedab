//! The halts of `MemoryStore`'s buckets: when the latest drain of each lets the first token go.
//!
//! Kept beside the buckets rather than in them: a bucket's slot fills one cache line, and only a
//! drain writes a halt and only a peek reads one, so the decisions never touch this table. A
//! store with no halt recorded answers a peek without taking its lock.

use std::sync::Mutex;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicBool, Ordering};

use hashbrown::HashMap;

/// The most halts kept at once. Past it, a drain first forgets the halts that have ended, then
/// the one that ends soonest: the drain itself still empties its bucket, and only reservations
/// that were waiting on the forgotten bucket would go at their slots.
const MAX_HALTS: usize = 16_384;

/// A bucket's halt (ms on the stored timeline), and when it may be forgotten.
#[derive(Clone, Copy)]
struct Halt {
    at: f64,
    forget_at: f64,
}

pub(super) struct Halts {
    any: AtomicBool,
    map: Mutex<HashMap<Box<str>, Halt>>,
}

impl Halts {
    pub(super) fn new() -> Self {
        Self {
            any: AtomicBool::new(false),
            map: Mutex::new(HashMap::new()),
        }
    }

    /// The halt recorded for `key`, 0 for none.
    pub(super) fn get(&self, key: &str) -> f64 {
        if !self.any.load(Ordering::Acquire) {
            return 0.0;
        }
        let map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        map.get(key).map_or(0.0, |h| h.at)
    }

    /// Records `at` as the halt of `key` (0 forgets it), to be forgotten from `forget_at` on.
    pub(super) fn set(&self, key: &str, at: f64, forget_at: f64, now: f64) {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        if at <= 0.0 {
            map.remove(key);
        } else {
            if map.len() >= MAX_HALTS && !map.contains_key(key) {
                map.retain(|_, h| h.forget_at > now);
                if map.len() >= MAX_HALTS {
                    let soonest = map
                        .iter()
                        .min_by(|a, b| a.1.forget_at.total_cmp(&b.1.forget_at))
                        .map(|(k, _)| k.clone());
                    if let Some(k) = soonest {
                        map.remove(&k);
                    }
                }
            }
            map.insert(key.into(), Halt { at, forget_at });
        }
        self.any.store(!map.is_empty(), Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn len(halts: &Halts) -> usize {
        halts
            .map
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    #[test]
    fn a_full_table_forgets_ended_halts_first_then_the_one_ending_soonest() {
        let halts = Halts::new();
        assert_eq!(halts.get("a"), 0.0);
        // Forgotten from 1,000 + i on: at 1,009, the first ten have ended.
        for i in 0..MAX_HALTS {
            let at = 500.0 + i as f64;
            halts.set(&format!("k{i}"), at, at + 500.0, 0.0);
        }
        halts.set("new", 5_000.0, 9_000.0, 1_009.0);
        assert_eq!(len(&halts), MAX_HALTS - 9);
        assert_eq!(halts.get("k9"), 0.0);
        assert_eq!(halts.get("k10"), 510.0);
        assert_eq!(halts.get("new"), 5_000.0);
        // Full again with none ended: the one that ends soonest makes room.
        for j in 0..9 {
            halts.set(&format!("f{j}"), 6_000.0, 9_000.0, 1_009.0);
        }
        assert_eq!(len(&halts), MAX_HALTS);
        halts.set("newer", 6_000.0, 9_000.0, 1_009.0);
        assert_eq!(len(&halts), MAX_HALTS);
        assert_eq!(halts.get("k10"), 0.0);
        assert_eq!(halts.get("k11"), 511.0);
        assert_eq!(halts.get("newer"), 6_000.0);
        // A halt of 0 forgets the key; with none left, a peek takes no lock.
        let one = Halts::new();
        one.set("a", 10.0, 20.0, 0.0);
        assert!(one.any.load(Ordering::Acquire));
        one.set("a", 0.0, 0.0, 0.0);
        assert!(!one.any.load(Ordering::Acquire));
        assert_eq!(one.get("a"), 0.0);
    }
}
