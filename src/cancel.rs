//! What happens to tokens when the caller of a front end goes away: the rule, written once.
//!
//! Both front ends follow the same rule (`docs/DESIGN.md#cancellation` gives the reasons):
//!
//! 1. **Tokens received and not yet used go back.** A reservation a front end holds while it
//!    waits (for its slot, or for a later rule's store call) is in a [`RefundGuard`]; dropped
//!    while armed (the client disconnected, a timeout fired), the guard gives the tokens back on
//!    a spawned task, since `Drop` cannot wait for a store.
//! 2. **A store call in flight when the caller goes away** is where the two differ, on purpose:
//!    - the tower layer decides inside the request's future, so such a call is dropped with it
//!      and its tokens may stay spent: a server answers in milliseconds, at most one request's
//!      tokens are at stake, the error is the safe one, and the server path keeps no task per
//!      request;
//!    - the reqwest middleware runs the call on a task of its own ([`acquire_detached`]), which
//!      gives back an answer nobody is left to receive: a client may wait minutes for a
//!      1-per-minute bucket, where one lost token is a minute of budget, and a task is nothing
//!      next to the HTTP call it guards.
//! 3. **Every refund names its reservation** ([`Reservation`]), never a bare cost, so a refund
//!    that comes late cannot free a slot another caller now holds.
//! 4. **Reservations abandoned together go back latest slot first** ([`Abandoned`]). A store
//!    gives a waiting reservation's tokens back only while it is the last one queued; a batch
//!    of queued requests dropped at once (a job cancelled, a timeout around all of them) drops
//!    them first to last, and refunded in that order every one but the last would find another
//!    behind it and stay spent, up to the whole queue's worth of budget.

use std::cell::Cell;
use std::mem;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration as Wait;

use crate::{BucketKey, BucketStore, Limit, Reservation};
#[cfg(feature = "reqwest")]
use {
    crate::error::BackendError,
    crate::{Audit, Decision, StoreError, Take},
    std::time::Duration,
};

/// Tokens taken for a request that has not been sent (or passed to the inner service) yet.
/// Dropped while armed (the caller went away while the request waited), it gives them back on a
/// spawned tokio task, so an abandoned reservation is not lost to the bucket.
pub(crate) struct RefundGuard<St: BucketStore + Clone> {
    store: St,
    taken: Vec<Taken>,
    abandoned: Abandoned,
}

/// A reservation's tokens, and the bucket they came from.
type Taken = (BucketKey, Limit, Reservation);

impl<St: BucketStore + Clone> RefundGuard<St> {
    /// A guard on `store`'s tokens that, dropped while armed, gives them back through
    /// `abandoned`, the front end's.
    pub(crate) fn new(store: St, abandoned: &Abandoned) -> Self {
        Self {
            store,
            taken: Vec::new(),
            abandoned: abandoned.clone(),
        }
    }

    /// Records the tokens of `reservation`, taken from `key`'s bucket.
    pub(crate) fn push(&mut self, key: BucketKey, limit: Limit, reservation: Reservation) {
        self.taken.push((key, limit, reservation));
    }

    /// Gives back everything taken so far, now.
    pub(crate) async fn refund_all(&mut self) {
        for (key, limit, reservation) in self.taken.drain(..) {
            if let Err(e) = self.store.refund(&key, limit, reservation).await {
                tracing::warn!(bucket = key.bucket(), error = %e, "refund failed");
            }
        }
    }

    /// The request is going out: its tokens are spent.
    pub(crate) fn disarm(mut self) {
        self.taken.clear();
    }
}

impl<St: BucketStore + Clone> Drop for RefundGuard<St> {
    fn drop(&mut self) {
        if self.taken.is_empty() {
            return;
        }
        let taken = mem::take(&mut self.taken);
        self.abandoned.give_back(&self.store, taken);
    }
}

/// The reservations of callers that went away, on their way back to the store: one per front
/// end, shared by its copies (rule 4). Each is given back once, as before, but those abandoned
/// within a millisecond of each other go back together, latest slot first, so that each is the
/// last one queued when its turn comes, if every reservation behind it was abandoned too.
#[derive(Clone, Default)]
pub(crate) struct Abandoned(Arc<Mutex<Pending>>);

#[derive(Default)]
struct Pending {
    taken: Vec<Taken>,
    /// Whether a task is giving them back; it takes whatever arrives meanwhile too.
    draining: bool,
}

impl Abandoned {
    /// Gives `taken`, from `store`, back on a spawned task, since `Drop` cannot wait for a
    /// store.
    pub(crate) fn give_back<St: BucketStore + Clone>(&self, store: &St, taken: Vec<Taken>) {
        let start = {
            let mut pending = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            pending.taken.extend(taken);
            !mem::replace(&mut pending.draining, true)
        };
        if !start {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            let mut pending = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            tracing::warn!(
                requests = pending.taken.len(),
                "no tokio runtime to refund an abandoned reservation on"
            );
            pending.taken.clear();
            pending.draining = false;
            return;
        };
        let store = store.clone();
        let draining = Draining {
            abandoned: self.clone(),
            done: Cell::new(false),
        };
        rt.spawn(async move {
            // Callers dropped together (a batch cancelled) go within the store's unit of time:
            // waiting it out lets their refunds be ordered as one.
            tokio::time::sleep(Wait::from_millis(1)).await;
            loop {
                let mut batch = {
                    let mut pending = draining
                        .abandoned
                        .0
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner);
                    if pending.taken.is_empty() {
                        // Under the lock that found it empty: a reservation handed over after
                        // this starts a drainer of its own.
                        pending.draining = false;
                        draining.done.set(true);
                        return;
                    }
                    mem::take(&mut pending.taken)
                };
                // Each bucket's refunds in turn, latest slot first; the buckets side by side,
                // so that a slow refund on one holds up no other.
                batch.sort_by(|(a, _, ra), (b, _, rb)| {
                    a.as_str()
                        .cmp(b.as_str())
                        .then(rb.ready_at_ms().cmp(&ra.ready_at_ms()))
                });
                while !batch.is_empty() {
                    let same = batch
                        .iter()
                        .take_while(|(key, _, _)| key == &batch[0].0)
                        .count();
                    let rest = batch.split_off(same);
                    let bucket = mem::replace(&mut batch, rest);
                    let store = store.clone();
                    tokio::spawn(async move {
                        for (key, limit, reservation) in bucket {
                            if let Err(e) = store.refund(&key, limit, reservation).await {
                                tracing::warn!(bucket = key.bucket(), error = %e, "refund failed");
                            }
                        }
                    });
                }
            }
        });
    }
}

/// The drainer's hold on its front end's [`Abandoned`]: however its task ends before it is done
/// (never run by a runtime shutting down, dropped with one, a refund that panicked), the next
/// reservation handed over starts another, rather than wait for one that is gone.
struct Draining {
    abandoned: Abandoned,
    done: Cell<bool>,
}

impl Drop for Draining {
    fn drop(&mut self) {
        if !self.done.get() {
            self.abandoned
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .draining = false;
        }
    }
}

/// `store.acquire(key, limit, cost, max_wait)` on a task of its own: a caller that goes away
/// while the store answers (a slow Redis) cannot lose the tokens, since the task gives back an
/// admission nobody is left to receive (rule 2).
#[cfg(feature = "reqwest")]
pub(crate) async fn acquire_detached<St: BucketStore + Clone>(
    store: &St,
    abandoned: &Abandoned,
    key: &BucketKey,
    limit: Limit,
    cost: u32,
    max_wait: Duration,
) -> Result<Decision, StoreError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (store, key, abandoned) = (store.clone(), key.clone(), abandoned.clone());
    tokio::spawn(async move {
        let result = store.acquire(&key, limit, cost, max_wait).await;
        if let Err(Ok(unreceived)) = tx.send(result)
            && let Some(reservation) = unreceived.reservation()
        {
            abandoned.give_back(&store, vec![(key, limit, reservation)]);
        }
    });
    rx.await.unwrap_or_else(|_| {
        Err(StoreError::Backend(BackendError::new(
            "the store call ended without an answer",
            None,
        )))
    })
}

/// [`acquire_detached`] for several buckets at once (`store.acquire_all`): an admission nobody
/// is left to receive gives back every bucket's tokens.
#[cfg(feature = "reqwest")]
pub(crate) async fn acquire_all_detached<St: BucketStore + Clone>(
    store: &St,
    abandoned: &Abandoned,
    buckets: Vec<(BucketKey, Limit, u32, Option<Audit>)>,
    max_wait: Duration,
) -> Result<Vec<Decision>, StoreError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (store, abandoned) = (store.clone(), abandoned.clone());
    tokio::spawn(async move {
        let takes: Vec<Take<'_>> = buckets
            .iter()
            .map(|(key, limit, cost, audit)| match audit {
                Some(audit) => Take::new(key, *limit, *cost).audited(audit),
                None => Take::new(key, *limit, *cost),
            })
            .collect();
        let result = store.acquire_all(&takes, max_wait).await;
        drop(takes);
        if let Err(Ok(unreceived)) = tx.send(result) {
            let taken = unreceived
                .iter()
                .zip(buckets)
                .filter_map(|(decision, (key, limit, _, _))| {
                    Some((key, limit, decision.reservation()?))
                })
                .collect();
            abandoned.give_back(&store, taken);
        }
    });
    rx.await.unwrap_or_else(|_| {
        Err(StoreError::Backend(BackendError::new(
            "the store call ended without an answer",
            None,
        )))
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::MemoryStore;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("a runtime")
    }

    /// A drainer whose runtime went away before it ran leaves the next reservation handed over
    /// to a drainer of its own, which gives back both.
    #[test]
    fn a_drainer_that_never_ran_does_not_stop_the_next() {
        let store = MemoryStore::new();
        let abandoned = Abandoned::default();
        let limit = Limit::per_minute(1)
            .and_then(|l| l.with_burst(2))
            .expect("a limit");
        let key = BucketKey::new("b", "k").expect("a key");
        let take = |rt: &tokio::runtime::Runtime| {
            rt.block_on(store.acquire(&key, limit, 1, Duration::ZERO))
                .expect("decided")
                .reservation()
                .expect("admitted")
        };
        let first = runtime();
        let reservation = take(&first);
        first.block_on(async {
            abandoned.give_back(&store, vec![(key.clone(), limit, reservation)]);
        });
        drop(first);
        assert!(!abandoned.0.lock().expect("a lock").draining);

        let second = runtime();
        let reservation = take(&second);
        second.block_on(async {
            abandoned.give_back(&store, vec![(key.clone(), limit, reservation)]);
            tokio::time::sleep(Duration::from_millis(10)).await;
        });
        let state = second.block_on(store.peek(&key, limit)).expect("peeks");
        assert_eq!(state.remaining(), 2, "both given back");
    }
}
