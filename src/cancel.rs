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

use std::mem;

use crate::{BucketKey, BucketStore, Limit, Reservation};
#[cfg(feature = "reqwest")]
use {
    crate::error::BackendError,
    crate::{Decision, StoreError, Take},
    std::time::Duration,
};

/// Tokens taken for a request that has not been sent (or passed to the inner service) yet.
/// Dropped while armed (the caller went away while the request waited), it gives them back on a
/// spawned tokio task, so an abandoned reservation is not lost to the bucket.
pub(crate) struct RefundGuard<St: BucketStore + Clone> {
    store: St,
    taken: Vec<(BucketKey, Limit, Reservation)>,
}

impl<St: BucketStore + Clone> RefundGuard<St> {
    pub(crate) fn new(store: St) -> Self {
        Self {
            store,
            taken: Vec::new(),
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
        let store = self.store.clone();
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    let mut guard = RefundGuard { store, taken };
                    guard.refund_all().await;
                });
            }
            Err(_) => tracing::warn!(
                requests = taken.len(),
                "no tokio runtime to refund an abandoned reservation on"
            ),
        }
    }
}

/// `store.acquire(key, limit, cost, max_wait)` on a task of its own: a caller that goes away
/// while the store answers (a slow Redis) cannot lose the tokens, since the task gives back an
/// admission nobody is left to receive (rule 2).
#[cfg(feature = "reqwest")]
pub(crate) async fn acquire_detached<St: BucketStore + Clone>(
    store: &St,
    key: &BucketKey,
    limit: Limit,
    cost: u32,
    max_wait: Duration,
) -> Result<Decision, StoreError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (store, key) = (store.clone(), key.clone());
    tokio::spawn(async move {
        let result = store.acquire(&key, limit, cost, max_wait).await;
        if let Err(Ok(unreceived)) = tx.send(result)
            && let Some(reservation) = unreceived.reservation()
            && let Err(e) = store.refund(&key, limit, reservation).await
        {
            tracing::warn!(bucket = key.bucket(), error = %e, "refund failed");
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
    buckets: Vec<(BucketKey, Limit, u32)>,
    max_wait: Duration,
) -> Result<Vec<Decision>, StoreError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let store = store.clone();
    tokio::spawn(async move {
        let takes: Vec<Take<'_>> = buckets
            .iter()
            .map(|(key, limit, cost)| Take::new(key, *limit, *cost))
            .collect();
        let result = store.acquire_all(&takes, max_wait).await;
        if let Err(Ok(unreceived)) = tx.send(result) {
            for (decision, (key, limit, _)) in unreceived.iter().zip(&buckets) {
                if let Some(reservation) = decision.reservation()
                    && let Err(e) = store.refund(key, *limit, reservation).await
                {
                    tracing::warn!(bucket = key.bucket(), error = %e, "refund failed");
                }
            }
        }
    });
    rx.await.unwrap_or_else(|_| {
        Err(StoreError::Backend(BackendError::new(
            "the store call ended without an answer",
            None,
        )))
    })
}
