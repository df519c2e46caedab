//! Reading how long the upstream asks every worker to wait: `X-Ratelimit-Retry`, then
//! `Retry-After`, as delay-seconds or an HTTP date. What the wait does to the shared bucket is in
//! `backoff.rs`.

use std::fmt;
use std::time::{Duration, SystemTime};

use http::HeaderMap;

/// Reads how long the upstream asked to wait: `X-Ratelimit-Retry` first, then `Retry-After`.
/// A value that does not parse is ignored, with a warning.
pub(super) fn upstream_retry(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    for name in ["x-ratelimit-retry", "retry-after"] {
        let Some(value) = headers.get(name) else {
            continue;
        };
        match value
            .to_str()
            .map_err(|_| RetryValue::NotText)
            .and_then(|v| parse_retry(v, now))
        {
            Ok(retry) => return Some(retry),
            Err(why) => tracing::warn!(header = name, %why, "ignoring an unusable back-off header"),
        }
    }
    None
}

/// Why a back-off header was ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RetryValue {
    NotText,
    Negative,
    Garbage,
}

impl fmt::Display for RetryValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NotText => "the value is not text",
            Self::Negative => "a negative delay",
            Self::Garbage => "neither seconds nor an http date",
        })
    }
}

/// Parses delay-seconds (whole, or decimal as some APIs send, rounded up) or an HTTP date. A
/// date in the past is a zero delay; a huge number saturates (the caller clamps it).
pub(crate) fn parse_retry(value: &str, now: SystemTime) -> Result<Duration, RetryValue> {
    let value = value.trim();
    if value.starts_with('-') {
        return Err(RetryValue::Negative);
    }
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        return Ok(Duration::from_secs(
            value.parse::<u64>().unwrap_or(u64::MAX),
        ));
    }
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return match value.parse::<f64>() {
            Ok(secs) if secs.is_finite() => {
                Ok(Duration::try_from_secs_f64(secs.ceil()).unwrap_or(Duration::MAX))
            }
            _ => Err(RetryValue::Garbage),
        };
    }
    match httpdate::parse_http_date(value) {
        Ok(at) => Ok(at.duration_since(now).unwrap_or(Duration::ZERO)),
        Err(_) => Err(RetryValue::Garbage),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::HeaderMap;
    use proptest::prelude::*;

    use super::*;
    use crate::middleware::fuzz::{NOW_MS, at, fuzz_config, header_text};

    #[test]
    fn back_off_headers_parse_or_say_why_not() {
        let now = at(1_700_000_000);
        assert_eq!(parse_retry("2", now), Ok(Duration::from_secs(2)));
        assert_eq!(parse_retry(" 120 ", now), Ok(Duration::from_secs(120)));
        assert_eq!(parse_retry("0", now), Ok(Duration::ZERO));
        assert_eq!(parse_retry("1.2", now), Ok(Duration::from_secs(2)));
        // Huge: saturates here; the middleware clamps it to its maximum back-off.
        assert_eq!(
            parse_retry("99999999999999999999999", now),
            Ok(Duration::from_secs(u64::MAX))
        );
        assert_eq!(parse_retry("-5", now), Err(RetryValue::Negative));
        assert_eq!(parse_retry("soon", now), Err(RetryValue::Garbage));
        assert_eq!(parse_retry("", now), Err(RetryValue::Garbage));
        assert_eq!(parse_retry("1.2.3", now), Err(RetryValue::Garbage));
        // An HTTP date, in the future and in the past.
        let date = httpdate::fmt_http_date(at(1_700_000_030));
        assert_eq!(parse_retry(&date, now), Ok(Duration::from_secs(30)));
        let past = httpdate::fmt_http_date(at(1_600_000_000));
        assert_eq!(parse_retry(&past, now), Ok(Duration::ZERO));
    }

    #[test]
    fn x_ratelimit_retry_wins_over_retry_after_and_garbage_is_skipped() {
        let now = at(1_700_000_000);
        let mut h = HeaderMap::new();
        h.insert("retry-after", http::HeaderValue::from_static("7"));
        h.insert("x-ratelimit-retry", http::HeaderValue::from_static("2"));
        assert_eq!(upstream_retry(&h, now), Some(Duration::from_secs(2)));
        h.insert("x-ratelimit-retry", http::HeaderValue::from_static("later"));
        assert_eq!(upstream_retry(&h, now), Some(Duration::from_secs(7)));
        h.insert("retry-after", http::HeaderValue::from_static("-1"));
        assert_eq!(upstream_retry(&h, now), None);
    }

    #[test]
    fn edge_values_of_back_off_headers() {
        let now = at(1_700_000_000);
        let secs = Duration::from_secs;
        // Whitespace around a number is tolerated; inside it, or a sign, is not.
        assert_eq!(parse_retry("\t7\t", now), Ok(secs(7)));
        assert_eq!(parse_retry("1 0", now), Err(RetryValue::Garbage));
        assert_eq!(parse_retry("+5", now), Err(RetryValue::Garbage));
        assert_eq!(parse_retry("-0", now), Err(RetryValue::Negative));
        assert_eq!(parse_retry("  -12.5", now), Err(RetryValue::Negative));
        // Decimals round up, to a whole second at least once above zero.
        assert_eq!(parse_retry("0.001", now), Ok(secs(1)));
        assert_eq!(parse_retry("0.0", now), Ok(Duration::ZERO));
        assert_eq!(parse_retry("5.", now), Ok(secs(5)));
        assert_eq!(parse_retry(".5", now), Ok(secs(1)));
        assert_eq!(parse_retry(".", now), Err(RetryValue::Garbage));
        // A decimal too large for a `Duration` saturates like a huge integer; the caller clamps it.
        let huge = format!("{}.5", "9".repeat(30));
        assert_eq!(parse_retry(&huge, now), Ok(Duration::MAX));
        assert_eq!(parse_retry("18446744073709551616", now), Ok(secs(u64::MAX)));
        // What `f64` would accept but a delay-seconds value never is.
        for garbage in ["1e3", "inf", "NaN", "0x10", "\u{663}", "5s", "1_000"] {
            assert_eq!(
                parse_retry(garbage, now),
                Err(RetryValue::Garbage),
                "{garbage}"
            );
        }
        // The three date formats of HTTP/1.1: IMF-fixdate, RFC 850 and asctime, in the future.
        for date in [
            "Tue, 14 Nov 2023 22:14:20 GMT",
            "Tuesday, 14-Nov-23 22:14:20 GMT",
            "Tue Nov 14 22:14:20 2023",
        ] {
            assert_eq!(
                parse_retry(date, now),
                Ok(secs(1_000_000_000 - 999_999_940)),
                "{date}"
            );
        }
        // A date in the past, even long past, is no wait at all; a far one is taken as given.
        assert_eq!(
            parse_retry("Thu, 01 Jan 1970 00:00:00 GMT", now),
            Ok(Duration::ZERO)
        );
        assert_eq!(
            parse_retry("Fri, 31 Dec 9999 23:59:59 GMT", now),
            Ok(secs(253_402_300_799 - 1_700_000_000))
        );
        // Almost a date.
        assert_eq!(
            parse_retry("Tue, 14 Nov 2023 25:14:20 GMT", now),
            Err(RetryValue::Garbage)
        );
    }

    #[test]
    fn a_header_that_is_not_text_is_skipped_for_the_next() {
        let now = at(1_700_000_000);
        let mut h = HeaderMap::new();
        let not_text = http::HeaderValue::from_bytes(b"\xff\xfe5").expect("obs-text is allowed");
        h.insert("x-ratelimit-retry", not_text.clone());
        assert_eq!(upstream_retry(&h, now), None);
        h.insert("retry-after", http::HeaderValue::from_static("3"));
        assert_eq!(upstream_retry(&h, now), Some(Duration::from_secs(3)));
        h.insert("retry-after", not_text);
        assert_eq!(upstream_retry(&h, now), None);
    }

    proptest! {
        #![proptest_config(fuzz_config())]

        /// Any text: never a panic; a delay only for what the rules accept, and then the right one.
        #[test]
        fn parse_retry_accepts_only_what_its_rules_say(value in header_text()) {
            let now = at(NOW_MS / 1_000);
            let parsed = parse_retry(&value, now);
            let trimmed = value.trim();
            let digits = !trimmed.is_empty() && trimmed.bytes().all(|b| b.is_ascii_digit());
            if trimmed.starts_with('-') {
                prop_assert_eq!(parsed, Err(RetryValue::Negative));
            } else if digits {
                // Past `u64::MAX` seconds it saturates; the middleware clamps it to `max_backoff`.
                let expected = Duration::from_secs(trimmed.parse::<u64>().unwrap_or(u64::MAX));
                prop_assert_eq!(parsed, Ok(expected));
            } else if let Ok(date) = httpdate::parse_http_date(trimmed) {
                let expected = date.duration_since(now).unwrap_or(Duration::ZERO);
                prop_assert_eq!(parsed, Ok(expected));
            } else if parsed.is_err() {
                prop_assert_eq!(parsed, Err(RetryValue::Garbage));
            } else if let Ok(d) = &parsed {
                // Only a decimal is left: rounded up to whole seconds, or `Duration::MAX` when too
                // large for one.
                prop_assert!(
                    trimmed.bytes().all(|b| b.is_ascii_digit() || b == b'.'),
                    "{:?} parsed as {:?}", value, d
                );
                let secs = trimmed.parse::<f64>().map_err(|e| TestCaseError::fail(e.to_string()))?;
                let expected = Duration::try_from_secs_f64(secs.ceil()).unwrap_or(Duration::MAX);
                prop_assert_eq!(*d, expected);
                prop_assert!(d.subsec_nanos() == 0 || *d == Duration::MAX);
            }
        }
    }
}
