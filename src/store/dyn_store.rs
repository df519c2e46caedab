//! `Arc<dyn DynBucketStore>`: any store behind one type, each call boxing one future.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::{BucketState, BucketStore, Claim, Decision, Reservation, StoreError, Take};
use crate::{BucketKey, Limit};

/// A boxed future, as the object-safe [`DynBucketStore`] returns.
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The object-safe twin of [`BucketStore`], for `Arc<dyn DynBucketStore>`.
///
/// Implemented for every `BucketStore`; `Arc<dyn DynBucketStore>` implements `BucketStore` in turn,
/// so it fits anywhere a store is expected. Each call boxes one future.
pub trait DynBucketStore: Send + Sync + 'static {
    /// [`BucketStore::now`], through the object.
    fn now_dyn(&self) -> SystemTime;

    /// [`BucketStore::acquire`], boxed.
    fn acquire_boxed<'a>(
        &'a self,
        key: &'a BucketKey,
        limit: Limit,
        cost: u32,
        max_wait: Duration,
    ) -> Pin<Box<dyn Future<Output = Result<Decision, StoreError>> + Send + 'a>>;

    /// [`BucketStore::acquire_all`], boxed.
    fn acquire_all_boxed<'a>(
        &'a self,
        takes: &'a [Take<'a>],
        max_wait: Duration,
    ) -> Pin<Box<dyn Future<Output = Result<Vec<Decision>, StoreError>> + Send + 'a>>;

    /// [`BucketStore::peek`], boxed.
    fn peek_boxed<'a>(
        &'a self,
        key: &'a BucketKey,
        limit: Limit,
    ) -> Pin<Box<dyn Future<Output = Result<BucketState, StoreError>> + Send + 'a>>;

    /// [`BucketStore::refund`], boxed.
    fn refund_boxed<'a>(
        &'a self,
        key: &'a BucketKey,
        limit: Limit,
        reservation: Reservation,
    ) -> Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send + 'a>>;

    /// [`BucketStore::drain_until`], boxed.
    fn drain_until_boxed<'a>(
        &'a self,
        key: &'a BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send + 'a>>;

    /// [`BucketStore::lower_to`], boxed.
    fn lower_to_boxed<'a>(
        &'a self,
        key: &'a BucketKey,
        limit: Limit,
        tokens: u32,
    ) -> Pin<Box<dyn Future<Output = Result<bool, StoreError>> + Send + 'a>>;

    /// [`BucketStore::book`], boxed.
    fn book_boxed<'a>(
        &'a self,
        key: &'a BucketKey,
        id: &'a str,
        until: SystemTime,
    ) -> Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send + 'a>>;

    /// [`BucketStore::claim`], boxed.
    fn claim_boxed<'a>(
        &'a self,
        key: &'a BucketKey,
        id: &'a str,
    ) -> Pin<Box<dyn Future<Output = Result<Claim, StoreError>> + Send + 'a>>;

    /// [`BucketStore::reset`], boxed.
    fn reset_boxed<'a>(
        &'a self,
        key: &'a BucketKey,
    ) -> Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send + 'a>>;

    /// [`BucketStore::set`], boxed.
    fn set_boxed<'a>(
        &'a self,
        key: &'a BucketKey,
        limit: Limit,
        tokens: u32,
    ) -> Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send + 'a>>;

    /// [`BucketStore::block_until`], boxed.
    fn block_until_boxed<'a>(
        &'a self,
        key: &'a BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send + 'a>>;
}

impl<S: BucketStore> DynBucketStore for S {
    fn now_dyn(&self) -> SystemTime {
        self.now()
    }

    fn acquire_boxed<'a>(
        &'a self,
        key: &'a BucketKey,
        limit: Limit,
        cost: u32,
        max_wait: Duration,
    ) -> BoxFuture<'a, Result<Decision, StoreError>> {
        Box::pin(self.acquire(key, limit, cost, max_wait))
    }

    fn acquire_all_boxed<'a>(
        &'a self,
        takes: &'a [Take<'a>],
        max_wait: Duration,
    ) -> BoxFuture<'a, Result<Vec<Decision>, StoreError>> {
        Box::pin(self.acquire_all(takes, max_wait))
    }

    fn peek_boxed<'a>(
        &'a self,
        key: &'a BucketKey,
        limit: Limit,
    ) -> BoxFuture<'a, Result<BucketState, StoreError>> {
        Box::pin(self.peek(key, limit))
    }

    fn refund_boxed<'a>(
        &'a self,
        key: &'a BucketKey,
        limit: Limit,
        reservation: Reservation,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.refund(key, limit, reservation))
    }

    fn drain_until_boxed<'a>(
        &'a self,
        key: &'a BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.drain_until(key, limit, until))
    }

    fn lower_to_boxed<'a>(
        &'a self,
        key: &'a BucketKey,
        limit: Limit,
        tokens: u32,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(self.lower_to(key, limit, tokens))
    }

    fn book_boxed<'a>(
        &'a self,
        key: &'a BucketKey,
        id: &'a str,
        until: SystemTime,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.book(key, id, until))
    }

    fn claim_boxed<'a>(
        &'a self,
        key: &'a BucketKey,
        id: &'a str,
    ) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(self.claim(key, id))
    }

    fn reset_boxed<'a>(&'a self, key: &'a BucketKey) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.reset(key))
    }

    fn set_boxed<'a>(
        &'a self,
        key: &'a BucketKey,
        limit: Limit,
        tokens: u32,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.set(key, limit, tokens))
    }

    fn block_until_boxed<'a>(
        &'a self,
        key: &'a BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.block_until(key, limit, until))
    }
}

impl BucketStore for Arc<dyn DynBucketStore> {
    fn now(&self) -> SystemTime {
        (**self).now_dyn()
    }

    async fn acquire(
        &self,
        key: &BucketKey,
        limit: Limit,
        cost: u32,
        max_wait: Duration,
    ) -> Result<Decision, StoreError> {
        (**self).acquire_boxed(key, limit, cost, max_wait).await
    }

    async fn acquire_all(
        &self,
        takes: &[Take<'_>],
        max_wait: Duration,
    ) -> Result<Vec<Decision>, StoreError> {
        (**self).acquire_all_boxed(takes, max_wait).await
    }

    async fn peek(&self, key: &BucketKey, limit: Limit) -> Result<BucketState, StoreError> {
        (**self).peek_boxed(key, limit).await
    }

    async fn refund(
        &self,
        key: &BucketKey,
        limit: Limit,
        reservation: Reservation,
    ) -> Result<(), StoreError> {
        (**self).refund_boxed(key, limit, reservation).await
    }

    async fn drain_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> Result<(), StoreError> {
        (**self).drain_until_boxed(key, limit, until).await
    }

    async fn lower_to(
        &self,
        key: &BucketKey,
        limit: Limit,
        tokens: u32,
    ) -> Result<bool, StoreError> {
        (**self).lower_to_boxed(key, limit, tokens).await
    }

    async fn book(&self, key: &BucketKey, id: &str, until: SystemTime) -> Result<(), StoreError> {
        (**self).book_boxed(key, id, until).await
    }

    async fn claim(&self, key: &BucketKey, id: &str) -> Result<Claim, StoreError> {
        (**self).claim_boxed(key, id).await
    }

    async fn reset(&self, key: &BucketKey) -> Result<(), StoreError> {
        (**self).reset_boxed(key).await
    }

    async fn set(&self, key: &BucketKey, limit: Limit, tokens: u32) -> Result<(), StoreError> {
        (**self).set_boxed(key, limit, tokens).await
    }

    async fn block_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> Result<(), StoreError> {
        (**self).block_until_boxed(key, limit, until).await
    }
}
