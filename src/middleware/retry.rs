//! [`RetryStrategy`]: how reqwest-retry's `RetryTransientMiddleware` should treat what this
//! middleware returns (feature `retry`).

use reqwest::Response;
use reqwest_middleware::Error;
use reqwest_retry::{
    Retryable, RetryableStrategy, default_on_request_failure, default_on_request_success,
};

use crate::{RateLimited, StoreError};

/// A [`RetryableStrategy`] for reqwest-retry's `RetryTransientMiddleware` in front of a
/// [`RateLimitMiddleware`](super::RateLimitMiddleware). reqwest-retry's default strategy takes
/// every middleware error for fatal; this one tells them apart:
///
/// - The local 429 ([`RateLimited`]): transient by default, so the retry, on reqwest-retry's
///   own schedule (which does not read the local 429's `retry_after`), passes through the
///   limiter again and waits its turn there if that is within the middleware's `max_wait`, or
///   meets the local 429 again; or fatal, with [`local_429`](Self::local_429), for a caller that
///   would rather reschedule the work itself, at the `retry_after` the error gives (a
///   [`Ticket`](super::Ticket) books it). On a slow route ("1 per minute") whose ceiling the
///   retries' backoff does not reach, prefer `Fail`, or let the requests queue with the
///   middleware's [`max_wait`](super::RateLimitMiddleware::max_wait): a batch that waits its
///   turns meets no local 429 to retry.
/// - A store that failed, timed out, is unavailable behind its circuit breaker, or is a
///   `MemoryStore` full of buckets in debt: transient.
/// - A misconfigured cost or a bucket key someone else wrote: fatal, since no retry can change
///   it.
/// - Anything else, and every answer and network error: as reqwest-retry's default strategy
///   (5xx, 408 and 429 answers and timeouts are transient).
///
/// Put the retry middleware *before* the limiter, so each attempt spends its own token:
///
/// ```
/// use burstgate::middleware::{RateLimitMiddleware, RetryStrategy, Route};
/// use burstgate::{Limit, MemoryStore};
/// use reqwest_retry::{RetryTransientMiddleware, policies::ExponentialBackoff};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let orders = Route::new("orders", Limit::per_minute(1)?.with_burst(10)?, "/orders")?;
/// let policy = ExponentialBackoff::builder().build_with_max_retries(3);
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(RetryTransientMiddleware::new_with_policy_and_strategy(policy, RetryStrategy::new()))
///     .with(RateLimitMiddleware::new(MemoryStore::new()).route(orders))
///     .build();
/// # let _ = client;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RetryStrategy {
    local_429: Local429,
}

/// What [`RetryStrategy`] makes of the local 429.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Local429 {
    /// Retried: the next attempt waits its turn in the limiter (the default).
    #[default]
    Retry,
    /// Returned to the caller at once.
    Fail,
}

impl RetryStrategy {
    /// The strategy above, retrying the local 429.
    pub fn new() -> Self {
        Self::default()
    }

    /// What to make of the local 429.
    #[must_use]
    pub fn local_429(self, local_429: Local429) -> Self {
        Self { local_429 }
    }
}

impl RetryableStrategy for RetryStrategy {
    fn handle(&self, res: &Result<Response, Error>) -> Option<Retryable> {
        match res {
            Ok(res) => default_on_request_success(res),
            Err(Error::Middleware(e)) => {
                if e.is::<RateLimited>() {
                    return Some(match self.local_429 {
                        Local429::Retry => Retryable::Transient,
                        Local429::Fail => Retryable::Fatal,
                    });
                }
                match e.downcast_ref::<StoreError>() {
                    Some(e) => Some(store_error(e)),
                    None => default_on_request_failure(res.as_ref().err()?),
                }
            }
            Err(e) => default_on_request_failure(e),
        }
    }
}

fn store_error(e: &StoreError) -> Retryable {
    match e {
        StoreError::Backend(_)
        | StoreError::Timeout { .. }
        | StoreError::Unavailable { .. }
        | StoreError::TooManyBuckets { .. } => Retryable::Transient,
        _ => Retryable::Fatal,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::Limit;

    /// What `strategy` makes of the middleware error `e`, as text (`Retryable` is not `Debug`).
    fn verdict(
        strategy: RetryStrategy,
        e: impl std::error::Error + Send + Sync + 'static,
    ) -> &'static str {
        match strategy.handle(&Err(Error::middleware(e))) {
            Some(Retryable::Transient) => "transient",
            Some(Retryable::Fatal) => "fatal",
            None => "none",
        }
    }

    #[test]
    fn store_failures_are_transient_and_misconfigurations_fatal() {
        let s = RetryStrategy::new();
        let transient = [
            StoreError::Timeout {
                after: Duration::from_millis(250),
            },
            StoreError::Unavailable {
                retry_in: Duration::from_secs(1),
            },
            StoreError::TooManyBuckets { max: 10 },
        ];
        for e in transient {
            assert_eq!(verdict(s, e), "transient");
        }
        let fatal = [
            StoreError::ZeroCost,
            StoreError::CostAboveBurst { cost: 3, burst: 2 },
            StoreError::WrongType {
                bucket: "orders".into(),
                fingerprint: "ab12".into(),
            },
        ];
        for e in fatal {
            assert_eq!(verdict(s, e), "fatal");
        }
    }

    #[test]
    fn the_local_429_is_retried_or_returned_as_chosen() {
        let limit = Limit::per_minute(1).expect("a valid limit");
        let limited = || RateLimited::new(Duration::from_secs(60), limit, "orders", 0);
        assert_eq!(verdict(RetryStrategy::new(), limited()), "transient");
        let fail = RetryStrategy::new().local_429(Local429::Fail);
        assert_eq!(verdict(fail, limited()), "fatal");
    }

    #[test]
    fn other_middleware_errors_are_fatal_as_by_default() {
        let other = std::io::Error::other("a middleware of someone else's");
        assert_eq!(verdict(RetryStrategy::new(), other), "fatal");
    }
}
