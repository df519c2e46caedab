//! What is answered when a store cannot decide: the policy, shared by the store that meets the
//! outage (`RedisStore::on_outage`) and the tower layer in front of any store
//! (`RateLimitLayer::on_outage`).

use std::num::NonZeroU32;

use crate::{Limit, StoreError};

/// What is answered when the store cannot decide: the call failed, it timed out, or a circuit
/// breaker is open. Two places take one:
///
/// - **A [`RedisStore`](crate::RedisStore)** ([`on_outage`](crate::RedisStore::on_outage)),
///   where the default is [`FailClosed`](Self::FailClosed): the store returns the error, and
///   the front end in front of it decides what that means. The reqwest middleware sends nothing
///   (it spends someone else's budget, and only failing closed keeps it whatever happens).
/// - **A tower [`RateLimitLayer`](crate::layer::RateLimitLayer)**
///   ([`on_outage`](crate::layer::RateLimitLayer::on_outage)), for the errors its store
///   returns, where the default is [`Local`](Self::Local) with one process: a server protecting
///   itself keeps answering, from a bucket in its own memory, rather than answer 503 to every
///   request while its Redis is away.
///
/// The policy applies only to the store being unreachable or failing. A bad cost is always an
/// error, and so is a key that holds something other than a bucket
/// ([`StoreError::WrongType`]): those are mistakes to fix, not outages to ride out.
///
/// [`StoreError::WrongType`]: crate::StoreError::WrongType
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OutagePolicy {
    /// The error: a `RedisStore` returns [`StoreError::Backend`](crate::StoreError::Backend), or
    /// [`StoreError::Unavailable`](crate::StoreError::Unavailable) while its breaker is open; a
    /// layer answers `503 Service Unavailable` (with `Retry-After` while the breaker is open).
    #[default]
    FailClosed,
    /// Admitted at once, unlimited (a `RedisStore` logs a warning for each such admission; a layer
    /// logs the store's failure, at most once per 10 s per rule). A `RedisStore`'s
    /// [`acquire`](crate::BucketStore::acquire) reports zero tokens remaining, and its
    /// [`peek`](crate::BucketStore::peek), [`refund`](crate::BucketStore::refund) and
    /// [`drain_until`](crate::BucketStore::drain_until) still return the error, since there is
    /// nothing true they could answer or change.
    FailOpen,
    /// Decided on a bucket in this process's memory with the same rate and burst divided by
    /// `processes` (rounded down): with that many processes sharing the budget, together they
    /// never admit more than it, even while none of them can reach the store. A request whose
    /// cost is above the local share is refused as under `FailClosed`.
    ///
    /// In a `RedisStore`, one budget across the switches: while Redis decides on a key, its
    /// local bucket is kept empty, so an outage starts from nothing refilled since the last
    /// one; and before Redis decides again on a key this process admitted locally, Redis's
    /// bucket for it is emptied, as its refill during the outage was spent here. A key first
    /// used during an outage starts with its full share of the burst. So across any number of
    /// outages and recoveries a bucket admits at most one budget plus one share of the burst
    /// (`docs/PERFORMANCE.md`, "When Redis fails", has a measured run). The cost is on the safe
    /// side: emptying Redis's bucket after one process's outage takes from the others what
    /// Redis refilled meanwhile, and a refund goes only to the bucket that gave the tokens.
    ///
    /// In a layer, the fallback buckets start full and never make a request wait; a
    /// request they refuse is answered 429 as any other. They know nothing of the store's: while
    /// the store is away each process admits at most its share, and when the store is back it
    /// decides from what it held, so a switch back can let through up to one more burst.
    Local {
        /// How many processes share the budget.
        processes: NonZeroU32,
    },
}

impl OutagePolicy {
    /// [`Local`](Self::Local) for one process: each process that cannot reach the store keeps
    /// the whole limit for itself. The layer's default.
    pub const LOCAL: Self = Self::Local {
        processes: NonZeroU32::MIN,
    };
}

/// Whether `e` is the store being unreachable or failing, which an [`OutagePolicy`] answers, as
/// opposed to a mistake in the call or in what the store holds.
#[cfg_attr(not(feature = "tower"), allow(dead_code))]
pub(crate) fn is_outage(e: &StoreError) -> bool {
    matches!(
        e,
        StoreError::Backend(_) | StoreError::Timeout { .. } | StoreError::Unavailable { .. }
    )
}

/// A limit's share for one of `processes`: the same tokens over `processes` times the interval,
/// and the burst divided (rounded down). `None` when the share holds no whole token, or its
/// interval is out of range.
#[cfg_attr(not(any(feature = "tower", feature = "redis")), allow(dead_code))]
pub(crate) fn share(limit: Limit, processes: NonZeroU32) -> Option<Limit> {
    let n = processes.get();
    if n == 1 {
        return Some(limit);
    }
    let interval = limit.interval().checked_mul(n)?;
    Limit::new(limit.tokens(), interval)
        .and_then(|l| l.with_burst(limit.burst() / n))
        .ok()
}
