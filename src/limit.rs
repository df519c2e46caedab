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
/// ```
///
/// - `tokens`, `count` and `burst` are whole decimal numbers (ASCII digits only, no sign).
/// - `count` may be left out, and then is 1: `10/s` is `10/1s`.
/// - `unit` is one of `ms`, `s`, `min` and `h`, in lower case. No other spelling is accepted:
///   `m` in particular could be read as minutes or as milliseconds, so it is refused.
/// - `burst <burst>` may be left out, and then the burst is `tokens`, as with [`Limit::new`].
/// - Spaces and tabs may stand around each part (`10 / 2 s  burst 20`); `burst` must be
///   separated from the unit and from its number by at least one.
///
/// [`FromStr`] parses it, and refuses what it cannot read with a [`ParseLimitError`] that says
/// what was wrong, or the [`InvalidLimit`] the values themselves broke. [`Display`](fmt::Display)
/// writes the canonical form, which parses back to the same limit: the largest unit that
/// divides the interval exactly, the count only when it is not 1, and the burst only when it
/// differs from `tokens`.
///
/// ```
/// use std::time::Duration;
/// use burstgate::{Limit, ParseLimitError};
///
/// let orders: Limit = "1/min burst 10".parse()?;
/// assert_eq!(orders, Limit::per_minute(1)?.with_burst(10)?);
/// assert_eq!(orders.to_string(), "1/min burst 10");
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
    /// published rate is now and then a millisecond early (the first request took longer to
    /// arrive than the later ones, a timer fired late and the next one on time) and earns a
    /// real 429. A margin of a few milliseconds per token absorbs that jitter, at a cost of
    /// `per_token` over the token period of the budget: against "1 per minute", 10 ms is
    /// 0.017%. A margin of zero is the limit itself. A middleware `Route` runs its limit under
    /// a default margin, which its own `margin` replaces.
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

/// The units of the text form, largest first: the order `Display` tries them in.
const UNITS: [(&str, u64); 4] = [("h", 3_600_000), ("min", 60_000), ("s", 1000), ("ms", 1)];

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
        let Some((tokens, rest)) = text.split_once('/') else {
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
        let Some(&(_, unit_ms)) = UNITS.iter().find(|(name, _)| *name == unit) else {
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
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_margin_lengthens_each_token_period_and_keeps_the_burst() {
        let ms = Duration::from_millis;
        let orders = Limit::per_minute(1).and_then(|l| l.with_burst(10)).unwrap();
        let spent = orders.with_margin(ms(10)).unwrap();
        assert_eq!(
            (spent.tokens(), spent.interval(), spent.burst()),
            (1, ms(60_010), 10)
        );
        // Per token: three tokens a second, 1 ms each, is three a 1.003 s.
        let three = Limit::per_second(3).unwrap().with_margin(ms(1)).unwrap();
        assert_eq!(three.interval(), ms(1_003));
        assert_eq!(orders.with_margin(Duration::ZERO), Ok(orders));
        assert_eq!(
            Limit::per_second(1)
                .unwrap()
                .with_margin(Duration::from_micros(1500)),
            Err(InvalidLimit::SubMillisecondInterval {
                interval: Duration::from_micros(1_001_500)
            })
        );
        assert_eq!(
            orders.with_margin(Duration::MAX),
            Err(InvalidLimit::TooSlow)
        );
        assert_eq!(
            Limit::per_second(u32::MAX)
                .unwrap()
                .with_margin(Duration::from_secs(u64::MAX / 2)),
            Err(InvalidLimit::TooSlow)
        );
    }

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
        let parse = |s: &str| s.parse::<Limit>().err().map(|e| e.to_string());
        let mut messages: Vec<String> = [
            InvalidLimit::ZeroTokens,
            InvalidLimit::ZeroBurst,
            InvalidLimit::ZeroInterval,
            InvalidLimit::TooSlow,
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        messages.extend(
            ["", "10", "x/s", "10/2.5s", "10/m", "10/s x", "0/s"]
                .into_iter()
                .filter_map(parse),
        );
        assert_eq!(messages.len(), 11);
        for m in messages {
            assert!(
                m.starts_with(char::is_lowercase) && !m.ends_with('.'),
                "{m}"
            );
        }
    }

    // A constant: the constructors and `with_burst` are `const fn`s.
    const SEARCH: Result<Limit, InvalidLimit> = Limit::per_second(10);
    const ORDERS: Result<Limit, InvalidLimit> = match Limit::per_minute(1) {
        Ok(l) => l.with_burst(10),
        Err(e) => Err(e),
    };
    const NEVER: Result<Limit, InvalidLimit> = Limit::per_hour(0);
    const REFILL: Duration = match ORDERS {
        Ok(l) => l.refill_time(),
        Err(_) => Duration::ZERO,
    };

    #[test]
    fn constructors_are_const() {
        assert_eq!(SEARCH.map(|l| (l.tokens(), l.burst())), Ok((10, 10)));
        assert_eq!(ORDERS, Limit::published(Duration::from_secs(60), 1, 10));
        assert_eq!(NEVER, Err(InvalidLimit::ZeroTokens));
        assert_eq!(REFILL, Duration::from_secs(600));
        const PUBLISHED: Result<Limit, InvalidLimit> =
            Limit::published(Duration::from_millis(1500), 3, 0);
        assert_eq!(PUBLISHED, Err(InvalidLimit::ZeroBurst));
    }

    fn limit(tokens: u32, interval_ms: u64, burst: u32) -> Limit {
        Limit::new(tokens, Duration::from_millis(interval_ms))
            .and_then(|l| l.with_burst(burst))
            .expect("a valid limit")
    }

    #[test]
    fn canonical_text_round_trips() {
        for (text, want) in [
            ("10/s burst 20", limit(10, 1000, 20)),
            ("1/min burst 10", limit(1, 60_000, 10)),
            ("100/h", limit(100, 3_600_000, 100)),
            ("3/1500ms", limit(3, 1500, 3)),
            ("5/2s", limit(5, 2000, 5)),
            ("7/90min burst 1", limit(7, 5_400_000, 1)),
            ("1/ms", limit(1, 1, 1)),
            ("4294967295/ms", limit(u32::MAX, 1, u32::MAX)),
            ("1/1221679h", limit(1, 1221679 * 3_600_000, 1)),
        ] {
            assert_eq!(text.parse::<Limit>(), Ok(want), "{text}");
            assert_eq!(want.to_string(), text);
        }
    }

    #[test]
    fn other_spellings_parse_to_the_canonical_limit() {
        for (text, canonical) in [
            ("3/1500ms burst 3", "3/1500ms"),
            ("10/1s burst 10", "10/s"),
            ("  10 /\t2 s   burst   20\t", "10/2s burst 20"),
            ("1/60s burst 10", "1/min burst 10"),
            ("1/60000ms", "1/min"),
            ("2/120min", "2/2h"),
            ("010/0002s", "10/2s"),
            ("1/3600s", "1/h"),
        ] {
            let parsed = text.parse::<Limit>().map(|l| l.to_string());
            assert_eq!(parsed.as_deref(), Ok(canonical), "{text:?}");
        }
    }

    #[test]
    fn bad_text_says_what_was_wrong() {
        use ParseLimitError as E;
        let text = |s: &str| s.to_owned();
        for (input, want) in [
            ("", E::Empty),
            (" \t ", E::Empty),
            ("10", E::NoSlash),
            ("10 per second", E::NoSlash),
            ("/s", E::Tokens { text: text("") }),
            ("ten/s", E::Tokens { text: text("ten") }),
            ("+10/s", E::Tokens { text: text("+10") }),
            ("-1/s", E::Tokens { text: text("-1") }),
            (
                "4294967296/s",
                E::Tokens {
                    text: text("4294967296"),
                },
            ),
            ("1 0/s", E::Tokens { text: text("1 0") }),
            ("10/", E::Interval { text: text("") }),
            ("10/2", E::Interval { text: text("2") }),
            ("10/2.5s", E::Interval { text: text("2.5s") }),
            ("10/s/2", E::Interval { text: text("s/2") }),
            (
                "10/99999999999999999999s",
                E::Interval {
                    text: text("99999999999999999999s"),
                },
            ),
            ("10/m", E::Unit { unit: text("m") }),
            ("10/2m", E::Unit { unit: text("m") }),
            ("10/sec", E::Unit { unit: text("sec") }),
            ("10/S", E::Unit { unit: text("S") }),
            ("10/hour", E::Unit { unit: text("hour") }),
            ("10/s 20", E::Burst { text: text("20") }),
            (
                "10/s burst",
                E::Burst {
                    text: text("burst"),
                },
            ),
            (
                "10/s burst20",
                E::Burst {
                    text: text("burst20"),
                },
            ),
            (
                "10/s burst x",
                E::Burst {
                    text: text("burst x"),
                },
            ),
            (
                "10/s burst 20 30",
                E::Burst {
                    text: text("burst 20 30"),
                },
            ),
            (
                "10/s burst -1",
                E::Burst {
                    text: text("burst -1"),
                },
            ),
            (
                "10/s Burst 2",
                E::Burst {
                    text: text("Burst 2"),
                },
            ),
            ("0/s", E::Limit(InvalidLimit::ZeroTokens)),
            ("1/0s", E::Limit(InvalidLimit::ZeroInterval)),
            ("1/s burst 0", E::Limit(InvalidLimit::ZeroBurst)),
            ("1/1221680h", E::Limit(InvalidLimit::TooSlow)),
            ("1/18446744073709551615h", E::Limit(InvalidLimit::TooSlow)),
            ("1/h burst 4294967295", E::Limit(InvalidLimit::TooSlow)),
        ] {
            assert_eq!(input.parse::<Limit>(), Err(want), "{input:?}");
        }
        let unit = "10/m".parse::<Limit>().err().map(|e| e.to_string());
        assert_eq!(
            unit.as_deref(),
            Some("a limit's interval unit must be ms, s, min or h, got \"m\"")
        );
        // The value errors read as `InvalidLimit`'s own.
        let zero = "0/s".parse::<Limit>().err().map(|e| e.to_string());
        assert_eq!(zero, Some(InvalidLimit::ZeroTokens.to_string()));
    }

    #[cfg(feature = "serde")]
    #[test]
    fn serde_reads_and_writes_the_text() {
        // A configuration: names and their limits.
        type Config = std::collections::BTreeMap<String, Limit>;
        let orders = limit(1, 60_000, 10);
        let config = Config::from([("limit".to_owned(), orders)]);
        let json = serde_json::to_string(&config).expect("serializes");
        assert_eq!(json, r#"{"limit":"1/min burst 10"}"#);
        let back: Config = serde_json::from_str(&json).expect("deserializes");
        assert_eq!(back, config);
        // Any spelling the parser reads, from a borrowed or an owned string.
        let spaced: Limit = serde_json::from_str(r#"" 1 / 60 s  burst 10""#).expect("reads");
        assert_eq!(spaced, orders);
        let value = serde_json::Value::String("3/1500ms".to_owned());
        let owned: Limit = serde_json::from_value(value).expect("reads");
        assert_eq!(owned, limit(3, 1500, 3));
        // A text the parser refuses fails with its message, and so does a value of another type.
        let bad = serde_json::from_str::<Config>(r#"{"limit":"10/m"}"#).map_err(|e| e.to_string());
        assert_eq!(
            bad,
            Err(
                "a limit's interval unit must be ms, s, min or h, got \"m\" at line 1 column 15"
                    .to_owned()
            )
        );
        let zero = serde_json::from_str::<Limit>(r#""0/s""#).map_err(|e| e.to_string());
        assert!(
            zero.as_ref()
                .is_err_and(|e| e.starts_with(&InvalidLimit::ZeroTokens.to_string())),
            "{zero:?}"
        );
        let number = serde_json::from_str::<Limit>("10").map_err(|e| e.to_string());
        assert!(
            number
                .as_ref()
                .is_err_and(|e| e.contains("a limit such as \"10/s burst 20\"")),
            "{number:?}"
        );
    }

    proptest! {
        #[test]
        fn every_limit_round_trips_through_its_text(
            tokens in 1..=u32::MAX,
            interval_ms in prop_oneof![
                1..=10_000u64,
                (1..=1000u64).prop_map(|n| n * 1000),
                (1..=1000u64).prop_map(|n| n * 60_000),
                (1..=1_221_679u64).prop_map(|n| n * 3_600_000),
                1..=(1u64 << 42),
            ],
            burst in 1..=u32::MAX,
        ) {
            let Ok(l) = Limit::new(tokens, Duration::from_millis(interval_ms))
                .and_then(|l| l.with_burst(burst))
            else {
                return Ok(());
            };
            let text = l.to_string();
            prop_assert_eq!(text.parse::<Limit>(), Ok(l), "{}", text);
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
