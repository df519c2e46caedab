//! The one-time marks of `MemoryStore` (`BucketStore::book` and `claim`), by bucket key and id.
//!
//! Kept apart from the buckets, as Redis keeps them under keys of their own: a mark is booked
//! once, spent once, never booked again, and forgotten once its time has passed, which a claim
//! then reads as missing, as it reads a mark Redis lost. The table is pruned of marks past
//! their time before it would grow (once it holds a thousand or so).

use std::sync::{Mutex, PoisonError};

use hashbrown::HashMap;

use crate::store::Claim;

/// How many marks the table holds before it starts pruning them.
const PRUNED_AT: usize = 1024;

/// A mark: until when it is kept (ms on the store's clock), and whether it was spent.
#[derive(Clone, Copy)]
struct Mark {
    until: u64,
    spent: bool,
}

#[derive(Default)]
pub(super) struct Marks {
    map: Mutex<HashMap<Box<str>, Mark>>,
}

impl Marks {
    /// Books `mark` until `until`, unless a mark of that name is kept already (left as it is) or
    /// `until` is not after `now` (nothing to keep).
    pub(super) fn book(&self, mark: String, until: u64, now: u64) {
        if until <= now {
            return;
        }
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        if map.get(mark.as_str()).is_some_and(|m| m.until > now) {
            return;
        }
        if map.len() >= PRUNED_AT && map.len() == map.capacity() {
            map.retain(|_, m| m.until > now);
        }
        let mark_state = Mark {
            until,
            spent: false,
        };
        map.insert(mark.into_boxed_str(), mark_state);
    }

    /// Spends `mark` if it is booked and kept at `now`.
    pub(super) fn claim(&self, mark: &str, now: u64) -> Claim {
        let mut map = self.map.lock().unwrap_or_else(PoisonError::into_inner);
        match map.get_mut(mark) {
            Some(m) if m.until > now && !m.spent => {
                m.spent = true;
                Claim::First
            }
            Some(m) if m.until > now => Claim::Spent,
            _ => Claim::Missing,
        }
    }
}
