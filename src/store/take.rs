//! What [`acquire_all`](BucketStore::acquire_all) is asked, and the checks every store makes on
//! its arguments before any store is asked.

#[cfg(doc)]
use super::BucketStore;
use super::{Audit, StoreError};
use crate::bucket::PerBucket;
use crate::{BucketKey, Limit};

/// The most buckets one [`BucketStore::acquire_all`] takes from.
pub const MAX_TAKES: usize = 16;

/// One bucket of a [`BucketStore::acquire_all`]: the bucket, the limit that governs it, and what
/// the request costs there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Take<'a> {
    key: &'a BucketKey,
    limit: Limit,
    cost: u32,
    audit: Option<&'a Audit>,
}

impl<'a> Take<'a> {
    /// `cost` tokens of `key`'s bucket, under `limit`.
    pub fn new(key: &'a BucketKey, limit: Limit, cost: u32) -> Self {
        Self {
            key,
            limit,
            cost,
            audit: None,
        }
    }

    /// The same take, its decision appended to the bucket's [`Audit`] trail (a `RedisStore`'s;
    /// other stores keep none).
    #[must_use]
    pub fn audited(self, audit: &'a Audit) -> Self {
        Self {
            audit: Some(audit),
            ..self
        }
    }

    /// The bucket.
    pub fn key(&self) -> &'a BucketKey {
        self.key
    }

    /// The limit that governs it.
    pub fn limit(&self) -> Limit {
        self.limit
    }

    /// The tokens the request takes from it.
    pub fn cost(&self) -> u32 {
        self.cost
    }

    /// The trail its decision goes to, if any.
    pub fn audit(&self) -> Option<&'a Audit> {
        self.audit
    }
}

/// Checks the buckets of an [`acquire_all`](BucketStore::acquire_all) before any store is
/// asked: their number, each cost against its limit, and that no bucket is named twice (a
/// store holds a bucket's lock once). The costs, as the arithmetic takes them.
pub(crate) fn check_takes(takes: &[Take<'_>]) -> Result<PerBucket<f64>, StoreError> {
    if takes.len() > MAX_TAKES {
        return Err(StoreError::TooManyAtOnce {
            count: takes.len(),
            max: MAX_TAKES,
        });
    }
    for (i, take) in takes.iter().enumerate() {
        if takes[..i].iter().any(|t| t.key == take.key) {
            return Err(StoreError::SameBucketTwice {
                bucket: take.key.bucket().to_owned(),
                fingerprint: take.key.fingerprint(),
            });
        }
    }
    takes.iter().map(|t| check_cost(&t.limit, t.cost)).collect()
}

/// Checks a cost against a limit before any store is asked.
pub(crate) fn check_cost(limit: &Limit, cost: u32) -> Result<f64, StoreError> {
    if cost == 0 {
        return Err(StoreError::ZeroCost);
    }
    if cost > limit.burst() {
        return Err(StoreError::CostAboveBurst {
            cost,
            burst: limit.burst(),
        });
    }
    Ok(f64::from(cost))
}

/// Checks the tokens a bucket is [`set`](BucketStore::set) to against a limit before any store is
/// asked.
pub(crate) fn check_tokens(limit: &Limit, tokens: u32) -> Result<f64, StoreError> {
    if tokens > limit.burst() {
        return Err(StoreError::TokensAboveBurst {
            tokens,
            burst: limit.burst(),
        });
    }
    Ok(f64::from(tokens))
}
