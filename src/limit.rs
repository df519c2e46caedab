//! Limits: tokens per interval, with a burst.

use std::fmt;
use std::time::Duration;

pub(crate) use crate::error::InvalidLimit;

/// The longest interval, and the longest time to refill an empty bucket, a [`Limit`] accepts:
/// 2^42 milliseconds, about 139 years. Longer ones could not be told apart from "never" and would
/// push the arithmetic past what an `f64` holds exactly.
const MAX_SPAN_MS: u128 = 1 << 42;

/// A rate limit: `tokens` per `interval`, with a bucket of `burst` tokens.
///
/// The bucket holds at most `burst` tokens (by default `burst == tokens`) and refills continuously
/// at `tokens / interval`. A full bucket admits `burst` requests at once; after that, one request
/// every `interval / tokens`.
///
/// Every constructor validates its input, so a `Limit` that exists can never overflow, divide by
/// zero or lose precision at request time.
///
/// ```
/// use std::time::Duration;
/// use burstgate::Limit;
///
/// // "1 request per minute, burst 10"
/// let orders = Limit::per_minute(1)?.with_burst(10)?;
/// assert_eq!(orders.tokens(), 1);
/// assert_eq!(orders.interval(), Duration::from_secs(60));
/// assert_eq!(orders.burst(), 10);
/// assert_eq!(orders.to_string(), "1 per 60s, burst 10");
///
/// // A limit that could never admit anything is refused up front.
/// assert!(Limit::per_second(0).is_err());
/// # Ok::<(), burstgate::InvalidLimit>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limit {
    tokens: u32,
    interval_ms: u64,
    burst: u32,
}

impl Limit {
    /// `tokens` per `interval`, with a burst of `tokens`.
    ///
    /// The interval must be a whole number of milliseconds (the store's unit of time), at least
    /// one, and at most about 139 years; the time to refill an empty bucket has the same ceiling.
    ///
    /// # Errors
    ///
    /// In the order they are checked: [`InvalidLimit::ZeroTokens`],
    /// [`InvalidLimit::ZeroInterval`], [`InvalidLimit::SubMillisecondInterval`] (so
    /// `Duration::MAX` is reported as that), and [`InvalidLimit::TooSlow`] for an interval above
    /// 2^42 ms. Any `tokens` from 1 to `u32::MAX` is accepted.
    pub fn new(tokens: u32, interval: Duration) -> Result<Self, InvalidLimit> {
        if tokens == 0 {
            return Err(InvalidLimit::ZeroTokens);
        }
        if interval.is_zero() {
            return Err(InvalidLimit::ZeroInterval);
        }
        if !interval.subsec_nanos().is_multiple_of(1_000_000) {
            return Err(InvalidLimit::SubMillisecondInterval { interval });
        }
        let ms = interval.as_millis();
        if ms > MAX_SPAN_MS {
            return Err(InvalidLimit::TooSlow);
        }
        // `ms <= 2^42` was just checked.
        let interval_ms = ms as u64;
        Self {
            tokens,
            interval_ms,
            burst: tokens,
        }
        .checked()
    }

    /// `tokens` per second, with a burst of `tokens`.
    pub fn per_second(tokens: u32) -> Result<Self, InvalidLimit> {
        Self::new(tokens, Duration::from_secs(1))
    }

    /// `tokens` per minute, with a burst of `tokens`.
    pub fn per_minute(tokens: u32) -> Result<Self, InvalidLimit> {
        Self::new(tokens, Duration::from_secs(60))
    }

    /// `tokens` per hour, with a burst of `tokens`.
    pub fn per_hour(tokens: u32) -> Result<Self, InvalidLimit> {
        Self::new(tokens, Duration::from_secs(3600))
    }

    /// A limit in the columns APIs publish: `limit` requests per `period`, with `burst`.
    ///
    /// "Period 1 minute, limit 1 request, burst 10" is `Limit::published(Duration::from_secs(60),
    /// 1, 10)`, the same as `Limit::per_minute(1)?.with_burst(10)?`.
    pub fn published(period: Duration, limit: u32, burst: u32) -> Result<Self, InvalidLimit> {
        Self::new(limit, period)?.with_burst(burst)
    }

    /// The same rate with a bucket of `burst` tokens: how many requests a full bucket admits at
    /// once. A burst below `tokens` is allowed (it smooths a rate out); zero is not.
    ///
    /// # Errors
    ///
    /// [`InvalidLimit::ZeroBurst`], or [`InvalidLimit::TooSlow`] when an empty bucket would take
    /// more than 2^42 ms to refill (`burst × interval / tokens`).
    pub fn with_burst(self, burst: u32) -> Result<Self, InvalidLimit> {
        if burst == 0 {
            return Err(InvalidLimit::ZeroBurst);
        }
        Self { burst, ..self }.checked()
    }

    fn checked(self) -> Result<Self, InvalidLimit> {
        let refill_ms =
            u128::from(self.burst) * u128::from(self.interval_ms) / u128::from(self.tokens);
        if refill_ms > MAX_SPAN_MS {
            return Err(InvalidLimit::TooSlow);
        }
        Ok(self)
    }

    /// Tokens added per [`interval`](Self::interval).
    pub fn tokens(&self) -> u32 {
        self.tokens
    }

    /// The refill interval.
    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms)
    }

    /// The bucket's capacity: the most requests admitted at once.
    pub fn burst(&self) -> u32 {
        self.burst
    }

    /// The refill interval in milliseconds.
    pub(crate) fn interval_ms(&self) -> u64 {
        self.interval_ms
    }

    /// Time for an empty bucket to refill completely.
    pub fn refill_time(&self) -> Duration {
        let ms = (u128::from(self.burst) * u128::from(self.interval_ms))
            .div_ceil(u128::from(self.tokens));
        // At most 2^42 + 1 by construction.
        Duration::from_millis(ms as u64)
    }

    /// The default waiting ceiling for a request of `cost`: two refill periods of one
    /// token per unit of cost, `2 × interval / tokens × cost`. For "1 per minute" and cost 1 that
    /// is two minutes.
    pub fn default_max_wait(&self, cost: u32) -> Duration {
        let ms =
            (2 * u128::from(self.interval_ms) * u128::from(cost)).div_ceil(u128::from(self.tokens));
        Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX))
    }
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} per {:?}, burst {}",
            self.tokens,
            self.interval(),
            self.burst
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constructors_agree() {
        let a = Limit::per_minute(1).and_then(|l| l.with_burst(10));
        let b = Limit::published(Duration::from_secs(60), 1, 10);
        assert_eq!(a, b);
        assert_eq!(Limit::per_second(100).map(|l| l.burst()), Ok(100));
        assert_eq!(
            Limit::per_hour(5).map(|l| l.interval()),
            Ok(Duration::from_secs(3600))
        );
    }

    #[test]
    fn bad_values_are_refused_with_their_reason() {
        let s = Duration::from_secs(1);
        assert_eq!(Limit::new(0, s), Err(InvalidLimit::ZeroTokens));
        assert_eq!(
            Limit::new(1, Duration::ZERO),
            Err(InvalidLimit::ZeroInterval)
        );
        assert_eq!(
            Limit::new(1, Duration::from_micros(1500)),
            Err(InvalidLimit::SubMillisecondInterval {
                interval: Duration::from_micros(1500)
            })
        );
        assert!(Limit::new(1, Duration::from_nanos(1)).is_err());
        assert_eq!(
            Limit::new(1, s).and_then(|l| l.with_burst(0)),
            Err(InvalidLimit::ZeroBurst)
        );
        assert_eq!(
            Limit::new(1, Duration::from_secs(u64::MAX)),
            Err(InvalidLimit::TooSlow)
        );
        // A fine interval with a burst that would take millennia to refill.
        assert_eq!(
            Limit::per_hour(1).and_then(|l| l.with_burst(u32::MAX)),
            Err(InvalidLimit::TooSlow)
        );
        // The extremes that are accepted.
        assert!(Limit::new(u32::MAX, Duration::from_millis(1)).is_ok());
        assert!(Limit::new(1, Duration::from_millis(1 << 42)).is_ok());
    }

    #[test]
    fn messages_are_lowercase_without_trailing_dot() {
        for e in [
            InvalidLimit::ZeroTokens,
            InvalidLimit::ZeroBurst,
            InvalidLimit::ZeroInterval,
            InvalidLimit::TooSlow,
        ] {
            let m = e.to_string();
            assert!(
                m.starts_with(char::is_lowercase) && !m.ends_with('.'),
                "{m}"
            );
        }
    }

    #[test]
    fn default_max_wait_is_two_token_periods_times_cost() {
        let l = Limit::per_minute(1).and_then(|l| l.with_burst(10));
        assert_eq!(
            l.map(|l| l.default_max_wait(1)),
            Ok(Duration::from_secs(120))
        );
        let l = Limit::per_second(3);
        assert_eq!(
            l.map(|l| l.default_max_wait(2)),
            Ok(Duration::from_millis(1334))
        );
    }
}
