//! What a [`RedisStore`](super::RedisStore) does when Redis does not answer: the policy, and the
//! circuit breaker that lets it answer at once while Redis is down.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::clock::whole_ms;

/// What a [`RedisStore`](super::RedisStore) answers when Redis cannot decide: the call failed, it
/// timed out, or the circuit breaker is open.
///
/// The policy applies only to Redis being unreachable or failing. A bad cost is always an error,
/// and so is a key that holds something other than a bucket ([`StoreError::WrongType`]): those
/// are mistakes to fix, not outages to ride out.
///
/// The default is [`FailClosed`](Self::FailClosed). A limiter exists to keep a budget, and only
/// failing closed keeps it whatever happens: the tower layer answers 503 and the middleware
/// returns an error, so nothing goes out that the shared budget did not admit. Choose
/// [`FailOpen`](Self::FailOpen) when the limiter protects something that would rather take
/// unlimited traffic than none, and [`Local`](Self::Local) when each process can be trusted with a
/// fixed share of the budget while it cannot reach the others.
///
/// [`StoreError::WrongType`]: crate::StoreError::WrongType
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OutagePolicy {
    /// Every call returns the error: [`StoreError::Backend`](crate::StoreError::Backend), or
    /// [`StoreError::Unavailable`](crate::StoreError::Unavailable) while the breaker is open.
    #[default]
    FailClosed,
    /// [`acquire`](crate::BucketStore::acquire) admits at once, reporting zero tokens remaining,
    /// and logs a warning; [`peek`](crate::BucketStore::peek), [`refund`](crate::BucketStore::refund)
    /// and [`drain_until`](crate::BucketStore::drain_until) still return the error, since there is
    /// nothing true they could answer or change.
    FailOpen,
    /// Every call goes to a bucket in this process's memory with the same rate and burst divided
    /// by `processes` (rounded down): with that many processes sharing the Redis budget, together
    /// they never admit more than the budget, even while none of them can reach Redis. A request
    /// whose cost is above the local share is refused as under `FailClosed`.
    ///
    /// The local buckets start full when first used and are not synchronised with Redis: when
    /// Redis answers again, its buckets are used as they stand (what the process admitted locally
    /// is not charged to them), so across the outage and the recovery a bucket may admit up to its
    /// share of the burst once more than it would have without the outage.
    Local {
        /// How many processes share the budget.
        processes: NonZeroU32,
    },
}

/// How many failures open the circuit, and for how long.
///
/// After `failures` calls in a row fail (an error from Redis, or no answer within the store's
/// timeout), the circuit opens: for `open_for`, calls are answered at once by the
/// [`OutagePolicy`] without trying Redis. Then one call goes through as a probe. If Redis
/// answers, the circuit closes and calls go to Redis again; if not, it stays open for another
/// `open_for`. So decisions resume at most `open_for` plus one round trip after Redis is back.
///
/// The default is 3 failures and 500 ms. Each change is a `tracing` event on the target
/// `burstgate::redis`: a warning when the circuit opens, an info event when it closes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Breaker {
    failures: u32,
    open_for: Duration,
}

impl Breaker {
    /// Opens after `failures` failed calls in a row (at least 1), for `open_for` (at least 1 ms).
    pub fn new(failures: u32, open_for: Duration) -> Self {
        Self {
            failures: failures.max(1),
            open_for: open_for.max(Duration::from_millis(1)),
        }
    }

    /// Failed calls in a row that open the circuit.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// How long the circuit stays open before a probe.
    pub fn open_for(&self) -> Duration {
        self.open_for
    }
}

impl Default for Breaker {
    fn default() -> Self {
        Self::new(3, Duration::from_millis(500))
    }
}

/// The breaker's shared state. Lock-free: it is read on every call.
#[derive(Debug)]
pub(super) struct Circuit {
    config: Breaker,
    /// Failed calls in a row.
    failures: AtomicU32,
    /// While open, until when (ms since the epoch, the store's clock); 0 when closed.
    open_until: AtomicU64,
    /// A probe is on its way through a half-open circuit.
    probing: AtomicBool,
}

/// Whether a call may go to Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pass {
    /// The circuit is closed.
    Closed,
    /// The circuit is half-open and this call is its probe.
    Probe,
    /// The circuit is open: answer by the policy, for about this long yet.
    Open(Duration),
}

impl Circuit {
    pub(super) fn new(config: Breaker) -> Self {
        Self {
            config,
            failures: AtomicU32::new(0),
            open_until: AtomicU64::new(0),
            probing: AtomicBool::new(false),
        }
    }

    pub(super) fn config(&self) -> Breaker {
        self.config
    }

    pub(super) fn is_open(&self) -> bool {
        self.open_until.load(Ordering::Acquire) != 0
    }

    pub(super) fn pass(&self, now: u64) -> Pass {
        let until = self.open_until.load(Ordering::Acquire);
        if until == 0 {
            return Pass::Closed;
        }
        if now < until {
            return Pass::Open(Duration::from_millis(until - now));
        }
        if self
            .probing
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            Pass::Probe
        } else {
            Pass::Open(self.config.open_for)
        }
    }

    /// Redis answered.
    pub(super) fn success(&self, pass: Pass) {
        self.failures.store(0, Ordering::Release);
        if pass == Pass::Probe || self.is_open() {
            if self.open_until.swap(0, Ordering::AcqRel) != 0 {
                tracing::info!(target: "burstgate::redis", "redis answered again: circuit closed");
            }
            if pass == Pass::Probe {
                self.probing.store(false, Ordering::Release);
            }
        }
    }

    /// Redis failed or did not answer in time.
    pub(super) fn failure(&self, pass: Pass, now: u64, error: &dyn std::fmt::Display) {
        let open_for = whole_ms(self.config.open_for);
        let until = now.saturating_add(open_for).max(1);
        if pass == Pass::Probe {
            self.open_until.store(until, Ordering::Release);
            self.probing.store(false, Ordering::Release);
            tracing::warn!(
                target: "burstgate::redis",
                open_for_ms = open_for,
                %error,
                "redis still failing: circuit stays open"
            );
            return;
        }
        let failed = self
            .failures
            .fetch_add(1, Ordering::AcqRel)
            .saturating_add(1);
        if failed >= self.config.failures
            && self
                .open_until
                .compare_exchange(0, until, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            tracing::warn!(
                target: "burstgate::redis",
                failures = failed,
                open_for_ms = open_for,
                %error,
                "redis failing: circuit opened"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_the_threshold_and_probes_after_open_for() {
        let c = Circuit::new(Breaker::new(3, Duration::from_millis(500)));
        for _ in 0..2 {
            assert_eq!(c.pass(1_000), Pass::Closed);
            c.failure(Pass::Closed, 1_000, &"down");
        }
        assert!(!c.is_open());
        c.failure(Pass::Closed, 1_000, &"down");
        assert!(c.is_open());
        assert_eq!(c.pass(1_200), Pass::Open(Duration::from_millis(300)));
        // Once open_for has passed, exactly one call probes.
        assert_eq!(c.pass(1_500), Pass::Probe);
        assert!(matches!(c.pass(1_500), Pass::Open(_)));
        // A failed probe keeps it open for another open_for.
        c.failure(Pass::Probe, 1_510, &"down");
        assert_eq!(c.pass(1_600), Pass::Open(Duration::from_millis(410)));
        assert_eq!(c.pass(2_010), Pass::Probe);
        c.success(Pass::Probe);
        assert!(!c.is_open());
        assert_eq!(c.pass(2_011), Pass::Closed);
    }

    #[test]
    fn a_success_resets_the_count() {
        let c = Circuit::new(Breaker::new(2, Duration::from_millis(10)));
        c.failure(Pass::Closed, 0, &"down");
        c.success(Pass::Closed);
        c.failure(Pass::Closed, 0, &"down");
        assert!(!c.is_open(), "the failures were not in a row");
        c.failure(Pass::Closed, 0, &"down");
        assert!(c.is_open());
    }

    #[test]
    fn degenerate_settings_are_clamped() {
        let b = Breaker::new(0, Duration::ZERO);
        assert_eq!(b.failures(), 1);
        assert_eq!(b.open_for(), Duration::from_millis(1));
    }
}
