//! Giving back tokens a front end took for a request that never went out.

use std::mem;

use crate::{BucketKey, BucketStore, Limit, Reservation};

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
