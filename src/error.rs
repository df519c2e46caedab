//! The rejection both front ends report.

use std::fmt;
use std::time::Duration;

use crate::Limit;

/// A request refused by a rate limit: it could not be admitted within the waiting ceiling.
///
/// Like governor's `NotUntil`, it is information for the caller: when to come back
/// ([`retry_after`](Self::retry_after)), under which limit, and for which bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimited {
    retry_after: Duration,
    limit: Limit,
    bucket: String,
    remaining: u32,
}

impl RateLimited {
    #[cfg_attr(not(any(feature = "tower", feature = "reqwest")), allow(dead_code))]
    pub(crate) fn new(retry_after: Duration, limit: Limit, bucket: &str, remaining: u32) -> Self {
        Self {
            retry_after,
            limit,
            bucket: bucket.to_owned(),
            remaining,
        }
    }

    /// How long until the request could be admitted, if nobody else takes tokens meanwhile.
    pub fn retry_after(&self) -> Duration {
        self.retry_after
    }

    /// The limit that refused the request.
    pub fn limit(&self) -> Limit {
        self.limit
    }

    /// The name of the bucket that refused the request.
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// Whole tokens left in that bucket (fewer than the request costs).
    pub fn remaining(&self) -> u32 {
        self.remaining
    }
}

impl fmt::Display for RateLimited {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rate limited by bucket {:?} ({}): retry after {} ms",
            self.bucket,
            self.limit,
            self.retry_after.as_millis()
        )
    }
}

impl std::error::Error for RateLimited {}
