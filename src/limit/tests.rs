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
    assert_eq!(
        Limit::per_day(5).map(|l| (l.interval(), l.burst())),
        Ok((Duration::from_secs(86_400), 5))
    );
    assert_eq!(Limit::per_day(0), Err(InvalidLimit::ZeroTokens));
    // The refill time of a daily limit reaches the ceiling with a burst of about 50,900 days.
    assert_eq!(
        Limit::per_day(1)
            .and_then(|l| l.with_burst(50_903))
            .map(|l| l.burst()),
        Ok(50_903)
    );
    assert_eq!(
        Limit::per_day(1).and_then(|l| l.with_burst(50_904)),
        Err(InvalidLimit::TooSlow)
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
const DAILY: Result<Limit, InvalidLimit> = Limit::per_day(1000);
const REFILL: Duration = match ORDERS {
    Ok(l) => l.refill_time(),
    Err(_) => Duration::ZERO,
};

#[test]
fn constructors_are_const() {
    assert_eq!(SEARCH.map(|l| (l.tokens(), l.burst())), Ok((10, 10)));
    assert_eq!(ORDERS, Limit::published(Duration::from_secs(60), 1, 10));
    assert_eq!(NEVER, Err(InvalidLimit::ZeroTokens));
    assert_eq!(DAILY.map(|l| l.to_string()), Ok("1000/24h".to_owned()));
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
        // Days, written back in hours.
        ("1/d", "1/24h"),
        ("5/2d burst 1", "5/48h burst 1"),
        ("1/50903d", "1/1221672h"),
        // Words for units, singular or plural whatever the count.
        ("100/hour", "100/h"),
        ("10/2 seconds", "10/2s"),
        ("10/2seconds", "10/2s"),
        ("1/minutes", "1/min"),
        ("3/1500 milliseconds", "3/1500ms"),
        ("7/1 day", "7/24h"),
        // `per` for `/`.
        ("10 per minute", "10/min"),
        ("1 per day burst 5", "1/24h burst 5"),
        ("10 per second burst 20", "10/s burst 20"),
        ("10 per 2 s", "10/2s"),
        ("\t10\tper\t90 minutes  burst\t1 ", "10/90min burst 1"),
        ("10 per 60 seconds burst 10", "10/min"),
        ("10 per s", "10/s"),
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
        ("10 a minute", E::NoSlash),
        // `per` only between blanks, and in lower case.
        ("10per minute", E::NoSlash),
        ("10 persecond", E::NoSlash),
        ("10 Per minute", E::NoSlash),
        ("10 PER minute", E::NoSlash),
        ("/s", E::Tokens { text: text("") }),
        ("per minute", E::Tokens { text: text("") }),
        ("ten per minute", E::Tokens { text: text("ten") }),
        (
            "10 requests per minute",
            E::Tokens {
                text: text("10 requests"),
            },
        ),
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
        ("10 per", E::Interval { text: text("") }),
        ("10 per 2", E::Interval { text: text("2") }),
        ("10 per 2.5 minutes", E::Interval { text: text("2.5") }),
        // The first separator splits: what follows a `per` is the interval, slash and all.
        ("10 per s/2", E::Interval { text: text("s/2") }),
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
        ("10/Hour", E::Unit { unit: text("Hour") }),
        ("10/D", E::Unit { unit: text("D") }),
        (
            "10 per Minute",
            E::Unit {
                unit: text("Minute"),
            },
        ),
        ("10/hr", E::Unit { unit: text("hr") }),
        ("10/dayz", E::Unit { unit: text("dayz") }),
        ("10 per per minute", E::Unit { unit: text("per") }),
        ("10/week", E::Unit { unit: text("week") }),
        ("10/s 20", E::Burst { text: text("20") }),
        (
            "10 per minute per key",
            E::Burst {
                text: text("per key"),
            },
        ),
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
        ("1/50904d", E::Limit(InvalidLimit::TooSlow)),
        (
            "1 per 213503982334601 days",
            E::Limit(InvalidLimit::TooSlow),
        ),
        ("1 per day burst 50904", E::Limit(InvalidLimit::TooSlow)),
        ("0 per day", E::Limit(InvalidLimit::ZeroTokens)),
    ] {
        assert_eq!(input.parse::<Limit>(), Err(want), "{input:?}");
    }
    let unit = "10/m".parse::<Limit>().err().map(|e| e.to_string());
    assert_eq!(
        unit.as_deref(),
        Some(
            "a limit's interval unit must be ms, s, min, h or d, or millisecond, second, minute, \
             hour or day (or their plurals), got \"m\""
        )
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
    let words: Config =
        serde_json::from_str(r#"{"limit":"1 per minute burst 10"}"#).expect("reads");
    assert_eq!(words, config);
    // Written back in the canonical form, days in hours.
    let daily = Config::from([("limit".to_owned(), limit(1, 86_400_000, 5))]);
    let json = serde_json::to_string(&daily).expect("serializes");
    assert_eq!(json, r#"{"limit":"1/24h burst 5"}"#);
    let back: Config = serde_json::from_str(r#"{"limit":"1 per day burst 5"}"#).expect("reads");
    assert_eq!(back, daily);
    let value = serde_json::Value::String("3/1500ms".to_owned());
    let owned: Limit = serde_json::from_value(value).expect("reads");
    assert_eq!(owned, limit(3, 1500, 3));
    // A text the parser refuses fails with its message, and so does a value of another type.
    let bad = serde_json::from_str::<Config>(r#"{"limit":"10/m"}"#).map_err(|e| e.to_string());
    assert_eq!(
        bad,
        Err(
            "a limit's interval unit must be ms, s, min, h or d, or millisecond, second, minute, \
             hour or day (or their plurals), got \"m\" at line 1 column 15"
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

/// Every way the text form can spell `interval_ms`: a unit that divides it exactly, short or a
/// word, singular or plural, and a count of 1 written or left out.
fn spellings(interval_ms: u64) -> Vec<String> {
    const UNITS: [(u64, [&str; 3]); 5] = [
        (1, ["ms", "millisecond", "milliseconds"]),
        (1000, ["s", "second", "seconds"]),
        (60_000, ["min", "minute", "minutes"]),
        (3_600_000, ["h", "hour", "hours"]),
        (86_400_000, ["d", "day", "days"]),
    ];
    let mut out = Vec::new();
    for (ms, names) in UNITS {
        if !interval_ms.is_multiple_of(ms) {
            continue;
        }
        let count = interval_ms / ms;
        for name in names {
            out.push(format!("{count}{name}"));
            out.push(format!("{count} {name}"));
            if count == 1 {
                out.push(name.to_owned());
            }
        }
    }
    out
}

proptest! {
    /// Any spelling of a limit, `/` or `per`, any unit that fits, the burst written or left to
    /// its default, reads as that limit, and is written back in the one canonical form.
    #[test]
    fn every_spelling_of_a_limit_reads_as_it(
        tokens in prop_oneof![1..=100u32, 1..=u32::MAX],
        interval_ms in prop_oneof![
            (1..=1000u64).prop_map(|n| n * 86_400_000),
            (1..=1000u64).prop_map(|n| n * 3_600_000),
            (1..=1000u64).prop_map(|n| n * 60_000),
            1..=100_000u64,
        ],
        burst in prop_oneof![Just(None), (1..=u32::MAX).prop_map(Some)],
        per in any::<bool>(),
        pick in any::<prop::sample::Index>(),
    ) {
        let Ok(l) = Limit::new(tokens, Duration::from_millis(interval_ms))
            .and_then(|l| l.with_burst(burst.unwrap_or(tokens)))
        else {
            return Ok(());
        };
        let spellings = spellings(interval_ms);
        let interval = pick.get(&spellings);
        let separator = if per { " per " } else { "/" };
        let text = match burst {
            Some(b) => format!("{tokens}{separator}{interval} burst {b}"),
            None => format!("{tokens}{separator}{interval}"),
        };
        prop_assert_eq!(text.parse::<Limit>(), Ok(l), "{}", text);
        prop_assert_eq!(l.to_string().parse::<Limit>(), Ok(l));
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
