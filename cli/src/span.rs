//! Durations as operators write them (`30s`, `10m`, `1h30m`, `2d`) and as the command prints
//! them, and times as RFC 3339 in UTC.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The longest span taken: a block or a look back past 100 years is a mistake, and the
/// library's own clamp on deadlines (about 557 years) is far beyond it.
const MAX_MS: u64 = 100 * 365 * DAY_MS;

const SECOND_MS: u64 = 1_000;
const MINUTE_MS: u64 = 60 * SECOND_MS;
const HOUR_MS: u64 = 60 * MINUTE_MS;
const DAY_MS: u64 = 24 * HOUR_MS;

/// `text` as a duration: one or more whole numbers each followed by a unit, `ms`, `s`, `m` (or
/// `min`), `h` or `d`, as in `90s`, `10m`, `1h30m`, `2d`; more than zero, at most 100 years.
/// Written for clap, so the error is the message it prints after the option's name.
pub(crate) fn parse(text: &str) -> Result<Duration, String> {
    let hint = "a duration is a number and a unit, ms, s, m, h or d (30s, 10m, 1h30m, 2d)";
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(format!("empty: {hint}"));
    }
    let mut total: u64 = 0;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(format!("{text:?}: {hint}"));
        }
        let (number, after) = rest.split_at(digits);
        let letters = after.bytes().take_while(u8::is_ascii_alphabetic).count();
        let (unit, after) = after.split_at(letters);
        let per = match unit {
            "ms" => 1,
            "s" => SECOND_MS,
            "m" | "min" => MINUTE_MS,
            "h" => HOUR_MS,
            "d" => DAY_MS,
            "" => return Err(format!("{text:?} has a number without a unit: {hint}")),
            other => return Err(format!("{text:?}: unknown unit {other:?}: {hint}")),
        };
        let part = number
            .parse::<u64>()
            .ok()
            .and_then(|n| n.checked_mul(per))
            .and_then(|ms| total.checked_add(ms));
        total = match part {
            Some(ms) if ms <= MAX_MS => ms,
            _ => return Err(format!("{text:?} is longer than 100 years")),
        };
        rest = after;
    }
    if total == 0 {
        return Err(format!("{text:?} is zero: give a span of at least 1ms"));
    }
    Ok(Duration::from_millis(total))
}

/// `d` for a person: `1h 2m 3.456s`, `250ms`, `0s`; days above a day.
pub(crate) fn format(d: Duration) -> String {
    let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    if ms < SECOND_MS {
        return if ms == 0 {
            "0s".to_owned()
        } else {
            format!("{ms}ms")
        };
    }
    let mut parts = Vec::new();
    let (days, rest) = (ms / DAY_MS, ms % DAY_MS);
    let (hours, rest) = (rest / HOUR_MS, rest % HOUR_MS);
    let (minutes, rest) = (rest / MINUTE_MS, rest % MINUTE_MS);
    let (seconds, millis) = (rest / SECOND_MS, rest % SECOND_MS);
    for (n, unit) in [(days, "d"), (hours, "h"), (minutes, "m")] {
        if n > 0 {
            parts.push(format!("{n}{unit}"));
        }
    }
    if millis > 0 {
        parts.push(format!("{seconds}.{millis:03}s"));
    } else if seconds > 0 {
        parts.push(format!("{seconds}s"));
    }
    parts.join(" ")
}

/// Milliseconds since the Unix epoch.
pub(crate) fn epoch_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// `ms` since the Unix epoch as RFC 3339 in UTC, to the millisecond:
/// `2026-12-05T10:42:17.001Z`.
pub(crate) fn rfc3339(ms: u64) -> String {
    let days = ms / DAY_MS;
    let rest = ms % DAY_MS;
    let (year, month, day) = civil(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rest / HOUR_MS,
        rest % HOUR_MS / MINUTE_MS,
        rest % MINUTE_MS / SECOND_MS,
        rest % SECOND_MS
    )
}

/// The proleptic Gregorian date `days` after 1970-01-01, counted in 400-year eras of 146,097
/// days that start on a March 1st, so that the leap day ends each era's years.
fn civil(days: u64) -> (u64, u64, u64) {
    // Shift the epoch to 0000-03-01, 719,468 days before 1970-01-01.
    let z = days + 719_468;
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    // Months counted from March: 0 is March, 11 is February.
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_parse_in_every_unit_and_together() {
        let ms = |text| parse(text).map(|d| d.as_millis());
        assert_eq!(ms("30s"), Ok(30_000));
        assert_eq!(ms("10m"), Ok(600_000));
        assert_eq!(ms("10min"), Ok(600_000));
        assert_eq!(ms("1h"), Ok(3_600_000));
        assert_eq!(ms("2d"), Ok(172_800_000));
        assert_eq!(ms("250ms"), Ok(250));
        assert_eq!(ms("1h30m"), Ok(5_400_000));
        assert_eq!(ms(" 1d2h "), Ok(93_600_000));
    }

    #[test]
    fn bad_spans_say_what_is_wrong() {
        for (text, says) in [
            ("", "empty"),
            ("10", "without a unit"),
            ("10x", "unknown unit \"x\""),
            ("m", "a duration is"),
            ("-5s", "a duration is"),
            ("1.5h", "without a unit"),
            ("0s", "is zero"),
            ("36501d", "longer than 100 years"),
            ("99999999999999999999s", "longer than 100 years"),
        ] {
            let e = parse(text).expect_err(text);
            assert!(e.contains(says), "{text:?}: {e}");
        }
    }

    #[test]
    fn spans_print_as_people_read_them() {
        let f = |ms| format(Duration::from_millis(ms));
        assert_eq!(f(0), "0s");
        assert_eq!(f(250), "250ms");
        assert_eq!(f(1_000), "1s");
        assert_eq!(f(59_873), "59.873s");
        assert_eq!(f(3_600_001), "1h 0.001s");
        assert_eq!(f(5_400_000), "1h 30m");
        assert_eq!(f(93_600_000), "1d 2h");
    }

    /// Dates on both sides of leap days and centuries, against values worked out by hand.
    #[test]
    fn times_print_as_rfc3339_in_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(951_868_799_999), "2000-02-29T23:59:59.999Z");
        assert_eq!(rfc3339(1_709_251_199_000), "2024-02-29T23:59:59.000Z");
        assert_eq!(rfc3339(1_735_689_600_000), "2025-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(4_107_542_400_000), "2100-03-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_796_467_337_001), "2026-12-05T10:42:17.001Z");
    }
}
