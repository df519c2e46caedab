//! Stores that wrap another to misbehave the way a real backend does.

#[cfg(feature = "reqwest")]
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use burstgate::{
    BucketKey, BucketState, BucketStore, Claim, Decision, Limit, Reservation, StoreError,
};

/// A store whose replies arrive `delay` after it has decided, like a slow Redis that has already
/// run the script: what a caller that gives up meanwhile leaves behind.
#[derive(Debug, Clone)]
pub(crate) struct SlowReplies<S> {
    pub(crate) inner: S,
    pub(crate) delay: Duration,
}

impl<S: BucketStore + Clone> BucketStore for SlowReplies<S> {
    fn now(&self) -> SystemTime {
        self.inner.now()
    }

    async fn acquire(
        &self,
        key: &BucketKey,
        limit: Limit,
        cost: u32,
        max_wait: Duration,
    ) -> Result<Decision, StoreError> {
        let decision = self.inner.acquire(key, limit, cost, max_wait).await;
        tokio::time::sleep(self.delay).await;
        decision
    }

    async fn acquire_all(
        &self,
        takes: &[burstgate::Take<'_>],
        max_wait: Duration,
    ) -> Result<Vec<Decision>, StoreError> {
        let decisions = self.inner.acquire_all(takes, max_wait).await;
        tokio::time::sleep(self.delay).await;
        decisions
    }

    async fn peek(&self, key: &BucketKey, limit: Limit) -> Result<BucketState, StoreError> {
        self.inner.peek(key, limit).await
    }

    async fn refund(
        &self,
        key: &BucketKey,
        limit: Limit,
        reservation: Reservation,
    ) -> Result<(), StoreError> {
        self.inner.refund(key, limit, reservation).await
    }

    async fn drain_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> Result<(), StoreError> {
        self.inner.drain_until(key, limit, until).await
    }

    async fn lower_to(
        &self,
        key: &BucketKey,
        limit: Limit,
        tokens: u32,
    ) -> Result<bool, StoreError> {
        self.inner.lower_to(key, limit, tokens).await
    }

    async fn book(&self, key: &BucketKey, id: &str, until: SystemTime) -> Result<(), StoreError> {
        self.inner.book(key, id, until).await
    }

    async fn claim(&self, key: &BucketKey, id: &str) -> Result<Claim, StoreError> {
        self.inner.claim(key, id).await
    }

    async fn reset(&self, key: &BucketKey) -> Result<(), StoreError> {
        self.inner.reset(key).await
    }

    async fn set(&self, key: &BucketKey, limit: Limit, tokens: u32) -> Result<(), StoreError> {
        self.inner.set(key, limit, tokens).await
    }

    async fn block_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> Result<(), StoreError> {
        self.inner.block_until(key, limit, until).await
    }
}

/// A store whose drains wait until the test lets them through (`release`), and say when one
/// starts (`started`).
#[cfg(feature = "reqwest")]
#[derive(Debug, Clone)]
pub(crate) struct HeldDrains<S> {
    pub(crate) inner: S,
    pub(crate) started: Arc<tokio::sync::Notify>,
    pub(crate) release: Arc<tokio::sync::Semaphore>,
}

#[cfg(feature = "reqwest")]
impl<S> HeldDrains<S> {
    /// `inner`, with every drain held until a permit is added to `release`.
    pub(crate) fn new(inner: S) -> Self {
        Self {
            inner,
            started: Arc::new(tokio::sync::Notify::new()),
            release: Arc::new(tokio::sync::Semaphore::new(0)),
        }
    }
}

#[cfg(feature = "reqwest")]
impl<S: BucketStore + Clone> BucketStore for HeldDrains<S> {
    fn now(&self) -> SystemTime {
        self.inner.now()
    }

    async fn acquire(
        &self,
        key: &BucketKey,
        limit: Limit,
        cost: u32,
        max_wait: Duration,
    ) -> Result<Decision, StoreError> {
        self.inner.acquire(key, limit, cost, max_wait).await
    }

    async fn acquire_all(
        &self,
        takes: &[burstgate::Take<'_>],
        max_wait: Duration,
    ) -> Result<Vec<Decision>, StoreError> {
        self.inner.acquire_all(takes, max_wait).await
    }

    async fn peek(&self, key: &BucketKey, limit: Limit) -> Result<BucketState, StoreError> {
        self.inner.peek(key, limit).await
    }

    async fn refund(
        &self,
        key: &BucketKey,
        limit: Limit,
        reservation: Reservation,
    ) -> Result<(), StoreError> {
        self.inner.refund(key, limit, reservation).await
    }

    async fn drain_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> Result<(), StoreError> {
        self.started.notify_one();
        let _permit = self.release.acquire().await;
        self.inner.drain_until(key, limit, until).await
    }

    async fn lower_to(
        &self,
        key: &BucketKey,
        limit: Limit,
        tokens: u32,
    ) -> Result<bool, StoreError> {
        self.inner.lower_to(key, limit, tokens).await
    }

    async fn book(&self, key: &BucketKey, id: &str, until: SystemTime) -> Result<(), StoreError> {
        self.inner.book(key, id, until).await
    }

    async fn claim(&self, key: &BucketKey, id: &str) -> Result<Claim, StoreError> {
        self.inner.claim(key, id).await
    }

    async fn reset(&self, key: &BucketKey) -> Result<(), StoreError> {
        self.inner.reset(key).await
    }

    async fn set(&self, key: &BucketKey, limit: Limit, tokens: u32) -> Result<(), StoreError> {
        self.inner.set(key, limit, tokens).await
    }

    async fn block_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> Result<(), StoreError> {
        self.inner.block_until(key, limit, until).await
    }
}

/// A store that takes tokens but refuses bookings while `refusing` is set, as a Redis that fails
/// between the two calls.
#[cfg(feature = "reqwest")]
#[derive(Debug, Clone)]
pub(crate) struct RefusedBookings<S> {
    pub(crate) inner: S,
    pub(crate) refusing: Arc<std::sync::atomic::AtomicBool>,
}

#[cfg(feature = "reqwest")]
impl<S: BucketStore + Clone> BucketStore for RefusedBookings<S> {
    fn now(&self) -> SystemTime {
        self.inner.now()
    }

    async fn acquire(
        &self,
        key: &BucketKey,
        limit: Limit,
        cost: u32,
        max_wait: Duration,
    ) -> Result<Decision, StoreError> {
        self.inner.acquire(key, limit, cost, max_wait).await
    }

    async fn acquire_all(
        &self,
        takes: &[burstgate::Take<'_>],
        max_wait: Duration,
    ) -> Result<Vec<Decision>, StoreError> {
        self.inner.acquire_all(takes, max_wait).await
    }

    async fn peek(&self, key: &BucketKey, limit: Limit) -> Result<BucketState, StoreError> {
        self.inner.peek(key, limit).await
    }

    async fn refund(
        &self,
        key: &BucketKey,
        limit: Limit,
        reservation: Reservation,
    ) -> Result<(), StoreError> {
        self.inner.refund(key, limit, reservation).await
    }

    async fn drain_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> Result<(), StoreError> {
        self.inner.drain_until(key, limit, until).await
    }

    async fn lower_to(
        &self,
        key: &BucketKey,
        limit: Limit,
        tokens: u32,
    ) -> Result<bool, StoreError> {
        self.inner.lower_to(key, limit, tokens).await
    }

    async fn book(&self, key: &BucketKey, id: &str, until: SystemTime) -> Result<(), StoreError> {
        if self.refusing.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(StoreError::Unavailable {
                retry_in: Duration::from_secs(1),
            });
        }
        self.inner.book(key, id, until).await
    }

    async fn claim(&self, key: &BucketKey, id: &str) -> Result<Claim, StoreError> {
        self.inner.claim(key, id).await
    }

    async fn reset(&self, key: &BucketKey) -> Result<(), StoreError> {
        self.inner.reset(key).await
    }

    async fn set(&self, key: &BucketKey, limit: Limit, tokens: u32) -> Result<(), StoreError> {
        self.inner.set(key, limit, tokens).await
    }

    async fn block_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> Result<(), StoreError> {
        self.inner.block_until(key, limit, until).await
    }
}
