//! Limits: tokens per interval, with a burst, and their text form.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

pub(crate) use crate::error::{InvalidLimit, ParseLimitError};

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
/// zero or lose precision at request time. The constructors are `const fn`s, so a limit can be a
/// constant, checked when the program is built:
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
///
/// // A limit that could never admit anything is refused up front.
/// assert!(Limit::per_second(0).is_err());
///
/// const SEARCH: Limit = match Limit::per_second(10) {
///     Ok(limit) => limit,
///     Err(_) => panic!("10 per second is a valid limit"),
/// };
/// assert_eq!(SEARCH.burst(), 10);
/// # Ok::<(), burstgate::InvalidLimit>(())
/// ```
///
/// # Text
///
/// A limit reads and writes as text, for configuration files and logs:
///
/// ```text
/// <tokens>/<count><unit>[ burst <burst>]
/// <tokens> per <count> <unit>[ burst <burst>]
/// ```
///
/// - `tokens`, `count` and `burst` are whole decimal numbers (ASCII digits only, no sign).
/// - `/` and `per` are the same: `10/minute` is `10 per minute`. `per` stands between blanks.
/// - `count` may be left out, and then is 1: `10/s` is `10/1s`, `1 per day` is `1 per 1 day`.
/// - `unit` is one of `ms`, `s`, `min`, `h` and `d`, or one of the words `millisecond`,
///   `second`, `minute`, `hour` and `day`, each also in the plural (`2 hours`), in lower case.
///   No other spelling is accepted: `m` in particular could be read as minutes or as
///   milliseconds, so it is refused. A day is 24 hours.
/// - `burst <burst>` may be left out, and then the burst is `tokens`, as with [`Limit::new`].
/// - Spaces and tabs may stand around each part (`10 / 2 s  burst 20`); `burst` must be
///   separated from the unit and from its number by at least one.
///
/// [`FromStr`] parses it, and refuses what it cannot read with a [`ParseLimitError`] that says
/// what was wrong, or the [`InvalidLimit`] the values themselves broke. [`Display`](fmt::Display)
/// writes the canonical form, which parses back to the same limit: `/`, the largest of `h`,
/// `min`, `s` and `ms` that divides the interval exactly, the count only when it is not 1, and
/// the burst only when it differs from `tokens`. Days are read but not written (`1 per day` is
/// written `1/24h`), which keeps the canonical text of every limit, and what serde stores, as it
/// was before days were read.
///
/// ```
/// use std::time::Duration;
/// use burstgate::{Limit, ParseLimitError};
///
/// let orders: Limit = "1/min burst 10".parse()?;
/// assert_eq!(orders, Limit::per_minute(1)?.with_burst(10)?);
/// assert_eq!(orders.to_string(), "1/min burst 10");
///
/// // As people write them, in their canonical form once written back.
/// assert_eq!("1 per minute burst 10".parse::<Limit>()?, orders);
/// assert_eq!("100/hour".parse::<Limit>()?.to_string(), "100/h");
/// let daily: Limit = "1 per day burst 5".parse()?;
/// assert_eq!(daily, Limit::per_day(1)?.with_burst(5)?);
/// assert_eq!(daily.to_string(), "1/24h burst 5");
///
/// // Written in its canonical form: 60 s is a minute, and a burst of `tokens` is the default.
/// let search: Limit = " 3 / 60s burst 3 ".parse()?;
/// assert_eq!(search.to_string(), "3/min");
/// assert_eq!("3/1500ms".parse::<Limit>()?.interval(), Duration::from_millis(1500));
///
/// assert!(matches!("10/m".parse::<Limit>(), Err(ParseLimitError::Unit { .. })));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// With the `serde` feature, a limit serializes as this text and deserializes from it, so a
/// configuration file says `limit = "10/s burst 20"`.
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
    pub const fn new(tokens: u32, interval: Duration) -> Result<Self, InvalidLimit> {
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
    pub const fn per_second(tokens: u32) -> Result<Self, InvalidLimit> {
        Self::new(tokens, Duration::from_secs(1))
    }

    /// `tokens` per minute, with a burst of `tokens`.
    pub const fn per_minute(tokens: u32) -> Result<Self, InvalidLimit> {
        Self::new(tokens, Duration::from_secs(60))
    }

    /// `tokens` per hour, with a burst of `tokens`.
    pub const fn per_hour(tokens: u32) -> Result<Self, InvalidLimit> {
        Self::new(tokens, Duration::from_secs(3600))
    }

    /// `tokens` per day (24 hours), with a burst of `tokens`.
    pub const fn per_day(tokens: u32) -> Result<Self, InvalidLimit> {
        Self::new(tokens, Duration::from_secs(DAY_MS / 1000))
    }

    /// A limit in the columns APIs publish: `limit` requests per `period`, with `burst`.
    ///
    /// "Period 1 minute, limit 1 request, burst 10" is `Limit::published(Duration::from_secs(60),
    /// 1, 10)`, the same as `Limit::per_minute(1)?.with_burst(10)?`.
    pub const fn published(period: Duration, limit: u32, burst: u32) -> Result<Self, InvalidLimit> {
        match Self::new(limit, period) {
            Ok(l) => l.with_burst(burst),
            Err(e) => Err(e),
        }
    }

    /// The same rate with a bucket of `burst` tokens: how many requests a full bucket admits at
    /// once. A burst below `tokens` is allowed (it smooths a rate out); zero is not.
    ///
    /// # Errors
    ///
    /// [`InvalidLimit::ZeroBurst`], or [`InvalidLimit::TooSlow`] when an empty bucket would take
    /// more than 2^42 ms to refill (`burst × interval / tokens`).
    pub const fn with_burst(self, burst: u32) -> Result<Self, InvalidLimit> {
        if burst == 0 {
            return Err(InvalidLimit::ZeroBurst);
        }
        Self { burst, ..self }.checked()
    }

    /// The same limit run slightly under its rate: every token's period lengthened by
    /// `per_token`, the burst kept. "1 per minute" with a margin of 10 ms is "1 per 60.01 s".
    ///
    /// For a client spending an API's published limit: the API's own bucket starts counting
    /// at the first request it *receives* and gives no tolerance, so a client at exactly the
    /// published rate is now and then early (the first request, on a new connection, took
    /// longer to arrive than the later ones; a timer fired late and the next one on time) and
    /// earns a real 429. A margin per token absorbs that, at a cost of `per_token` over the
    /// token period of the budget: against "1 per minute", 10 ms is 0.017%. A margin of zero is
    /// the limit itself. A middleware `Route` runs its limit under a default margin (1% of the
    /// token period, at least 10 ms, at most a tenth of it), which its own `margin` replaces.
    ///
    /// ```
    /// use std::time::Duration;
    /// use burstgate::Limit;
    ///
    /// let orders = Limit::per_minute(1)?.with_burst(10)?;
    /// let spent = orders.with_margin(Duration::from_millis(10))?;
    /// assert_eq!(spent.to_string(), "1/60010ms burst 10");
    /// # Ok::<(), burstgate::InvalidLimit>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`Limit::new`]: [`InvalidLimit::TooSlow`] when the lengthened interval overflows or
    /// is too long, [`InvalidLimit::SubMillisecondInterval`] when it is not a whole number of
    /// milliseconds (a margin of 1.5 ms on one token a second).
    pub const fn with_margin(self, per_token: Duration) -> Result<Self, InvalidLimit> {
        let Some(extra) = per_token.checked_mul(self.tokens) else {
            return Err(InvalidLimit::TooSlow);
        };
        let Some(interval) = self.interval().checked_add(extra) else {
            return Err(InvalidLimit::TooSlow);
        };
        match Self::new(self.tokens, interval) {
            Ok(l) => l.with_burst(self.burst),
            Err(e) => Err(e),
        }
    }

    const fn checked(self) -> Result<Self, InvalidLimit> {
        let refill_ms = self.burst as u128 * self.interval_ms as u128 / self.tokens as u128;
        if refill_ms > MAX_SPAN_MS {
            return Err(InvalidLimit::TooSlow);
        }
        Ok(self)
    }

    /// Tokens added per [`interval`](Self::interval).
    pub const fn tokens(&self) -> u32 {
        self.tokens
    }

    /// The refill interval.
    pub const fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms)
    }

    /// The bucket's capacity: the most requests admitted at once.
    pub const fn burst(&self) -> u32 {
        self.burst
    }

    /// The refill interval in milliseconds.
    pub(crate) const fn interval_ms(&self) -> u64 {
        self.interval_ms
    }

    /// Time for an empty bucket to refill completely.
    pub const fn refill_time(&self) -> Duration {
        let ms = (self.burst as u128 * self.interval_ms as u128).div_ceil(self.tokens as u128);
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

/// A day in milliseconds: the longest unit the text form reads.
const DAY_MS: u64 = 86_400_000;

/// The units `Display` writes, largest first: the order it tries them in. No day: see the text
/// form on [`Limit`].
const UNITS: [(&str, u64); 4] = [("h", 3_600_000), ("min", 60_000), ("s", 1000), ("ms", 1)];

/// Every spelling of a unit the text form reads, with its milliseconds.
const SPELLINGS: [(&str, u64); 15] = [
    ("ms", 1),
    ("millisecond", 1),
    ("milliseconds", 1),
    ("s", 1000),
    ("second", 1000),
    ("seconds", 1000),
    ("min", 60_000),
    ("minute", 60_000),
    ("minutes", 60_000),
    ("h", 3_600_000),
    ("hour", 3_600_000),
    ("hours", 3_600_000),
    ("d", DAY_MS),
    ("day", DAY_MS),
    ("days", DAY_MS),
];

impl fmt::Display for Limit {
    /// The canonical text form (see [`Limit`]): `10/s burst 20`, `1/min burst 10`, `100/h`,
    /// `3/1500ms`, `5/2s`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The last unit is 1 ms, which divides every interval.
        let (unit, ms) = UNITS
            .iter()
            .copied()
            .find(|(_, ms)| self.interval_ms.is_multiple_of(*ms))
            .unwrap_or(("ms", 1));
        write!(f, "{}/", self.tokens)?;
        let count = self.interval_ms / ms;
        if count != 1 {
            write!(f, "{count}")?;
        }
        f.write_str(unit)?;
        if self.burst != self.tokens {
            write!(f, " burst {}", self.burst)?;
        }
        Ok(())
    }
}

impl FromStr for Limit {
    type Err = ParseLimitError;

    /// Reads the text form described on [`Limit`].
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let text = s.trim_matches(BLANK);
        if text.is_empty() {
            return Err(ParseLimitError::Empty);
        }
        let Some((tokens, rest)) = split_rate(text) else {
            return Err(ParseLimitError::NoSlash);
        };
        let tokens = tokens.trim_matches(BLANK);
        let tokens = number::<u32>(tokens).ok_or_else(|| ParseLimitError::Tokens {
            text: tokens.to_owned(),
        })?;
        let after = rest.trim_start_matches(BLANK);
        // The interval runs to the first blank after its unit; the burst, if any, follows.
        let digits = after.len() - after.trim_start_matches(|c: char| c.is_ascii_digit()).len();
        let (count, rest) = after.split_at(digits);
        let rest = rest.trim_start_matches(BLANK);
        let unit_len = rest.find(BLANK).unwrap_or(rest.len());
        let (unit, burst) = rest.split_at(unit_len);
        let bad_interval = || ParseLimitError::Interval {
            text: after[..after.len() - burst.len()].to_owned(),
        };
        let count = if count.is_empty() {
            1
        } else {
            number::<u64>(count).ok_or_else(bad_interval)?
        };
        let Some(&(_, unit_ms)) = SPELLINGS.iter().find(|(name, _)| *name == unit) else {
            // A word that is no unit is named as such; anything else (`2.5s`, `s/2`, nothing)
            // is an interval that cannot be read.
            return Err(
                if !unit.is_empty() && unit.bytes().all(|b| b.is_ascii_alphabetic()) {
                    ParseLimitError::Unit {
                        unit: unit.to_owned(),
                    }
                } else {
                    bad_interval()
                },
            );
        };
        let burst = burst.trim_matches(BLANK);
        let burst = if burst.is_empty() {
            None
        } else {
            let bad = || ParseLimitError::Burst {
                text: burst.to_owned(),
            };
            let n = burst
                .strip_prefix("burst")
                .filter(|n| n.starts_with(BLANK))
                .ok_or_else(bad)?;
            Some(number::<u32>(n.trim_start_matches(BLANK)).ok_or_else(bad)?)
        };
        // An interval whose milliseconds overflow is far above the longest one accepted.
        let interval = count
            .checked_mul(unit_ms)
            .map(Duration::from_millis)
            .ok_or(ParseLimitError::Limit(InvalidLimit::TooSlow))?;
        let limit = Self::new(tokens, interval)?;
        Ok(match burst {
            Some(burst) => limit.with_burst(burst)?,
            None => limit,
        })
    }
}

/// The blanks the text form allows around its parts.
const BLANK: [char; 2] = [' ', '\t'];

/// The text before and after the separator of tokens and interval: the first `/`, or the first
/// `per` that stands between blanks (or first, for a text with no tokens), whichever comes
/// first. `None` when there is neither.
fn split_rate(text: &str) -> Option<(&str, &str)> {
    let word = text.match_indices("per").map(|(at, _)| at).find(|&at| {
        let before = &text[..at];
        let after = &text[at + 3..];
        (before.is_empty() || before.ends_with(BLANK))
            && (after.is_empty() || after.starts_with(BLANK))
    });
    match (text.find('/'), word) {
        (Some(slash), Some(at)) if at < slash => Some((&text[..at], &text[at + 3..])),
        (Some(slash), _) => Some((&text[..slash], &text[slash + 1..])),
        (None, Some(at)) => Some((&text[..at], &text[at + 3..])),
        (None, None) => None,
    }
}

/// A whole decimal number of ASCII digits, without a sign; `None` when empty, not digits, or out
/// of range.
fn number<T: FromStr>(text: &str) -> Option<T> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

crate::text::serde_as_text!(Limit, "a limit such as \"10/s burst 20\"");

#[cfg(test)]
mod tests;
