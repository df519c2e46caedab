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
