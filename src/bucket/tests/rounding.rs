//! The shortcuts the arithmetic takes (the inlined ceiling, the refill, the fill of an idle
//! bucket, the refund of the last reservation) against the plain formulas, to the bit.
//!
//! Failures are persisted by proptest in `proptest-regressions/bucket/tests/rounding.txt`.

use super::*;

proptest! {
    /// The inlined ceiling agrees with `f64::ceil` on every positive estimate `ready_at` can
    /// meet, whole or not, small or past 2^52.
    #[test]
    fn estimate_ceil_is_ceil(x in prop_oneof![
        0.0f64..1.0,
        1.0f64..1e6,
        (1u64..1 << 53).prop_map(|n| n as f64),
        1e15f64..1e300,
    ]) {
        prop_assert_eq!(estimate_ceil(x).to_bits(), x.ceil().to_bits());
    }
}

/// The refill as the reference formula and the Lua write it, with no shortcut: what [`refill`] and
/// [`available`] must give, to the bit.
fn plain_available(p: &Params, t: f64, elapsed: f64) -> f64 {
    min(p.capacity, t + elapsed * p.tokens / p.interval)
}

/// A stored token count anywhere a bucket can be: deep in reservation debt, fractional, at or
/// near capacity.
fn stored_tokens(p: &Params) -> impl Strategy<Value = f64> + use<> {
    let cap = p.capacity;
    let debt = 2.0 * MAX_WAIT as f64 * p.tokens / p.interval + cap;
    prop_oneof![
        Just(cap),
        Just(cap - 1.0),
        Just(0.0),
        0.0..=cap,
        -debt..=cap,
        (0u32..=1000).prop_map(move |k| cap - f64::from(k) / 7.0),
    ]
}

proptest! {
    /// The shortcuts of `refill` (spans of 0 and 1 ms) and of `available` (a span long enough
    /// to fill the bucket, judged without dividing) give what the plain formula gives, to the
    /// bit, including spans on either side of where the shortcut starts to apply.
    #[test]
    fn refill_shortcuts_agree_with_the_plain_formula(
        (p, t, elapsed) in limit().prop_flat_map(|l| {
            let p = Params::of(&l);
            (Just(p), stored_tokens(&p))
        }).prop_flat_map(|(p, t)| {
            // The span at which `refills_to_full` starts to hold, and spans around it.
            let edge = (4.0 * ((p.capacity - t) * p.interval) / p.tokens).max(0.0);
            let edge = if edge < MAX_TIME as f64 { edge as u64 } else { MAX_TIME };
            let span = prop_oneof![
                Just(0u64),
                Just(1),
                Just(2),
                0u64..10_000,
                (0u64..=8).prop_map(move |d| (edge + d).saturating_sub(4).min(MAX_TIME)),
                0u64..=MAX_TIME,
            ];
            (Just(p), Just(t), span)
        })
    ) {
        let elapsed = elapsed as f64;
        prop_assert_eq!(
            refill(&p, elapsed).to_bits(),
            (elapsed * p.tokens / p.interval).to_bits()
        );
        let ts = 1_000.0;
        let state = Some(State { t, ts });
        let (_, avail, _, _) = available(&p, state, ts + elapsed);
        prop_assert_eq!(avail.to_bits(), plain_available(&p, t, elapsed).to_bits());
        if refills_to_full(&p, t, elapsed) {
            prop_assert_eq!(plain_available(&p, t, elapsed), p.capacity);
        }
    }
}

#[test]
fn the_fill_shortcut_applies_to_an_idle_bucket_and_not_to_a_busy_one() {
    // "1 per minute, burst 10", one token short.
    let p = Params::new(1.0, 60_000.0, 10.0);
    // Four minutes refill four tokens' worth of room and more: the shortcut applies.
    assert!(refills_to_full(&p, 9.0, 240_001.0));
    // A minute refills the one token exactly; that is for the division to judge.
    assert!(!refills_to_full(&p, 9.0, 60_000.0));
    assert_eq!(plain_available(&p, 9.0, 60_000.0), 10.0);
    assert!(!refills_to_full(&p, 9.0, 0.0));
    // A full bucket fills with any refill at all, and not with none.
    assert!(refills_to_full(&p, 10.0, 1.0));
    assert!(!refills_to_full(&p, 10.0, 0.0));
}

#[test]
fn the_last_reservation_is_refunded_whatever_the_rounding() {
    // 1 per minute, no burst: taken at START, then a reservation at every offset into the
    // minute; its refund, made at once, always goes back, and only once.
    let p = Params::new(1.0, 60_000.0, 1.0);
    let (_, w) = evaluate(&p, None, START, 1.0, 0);
    let empty = w.map(|w| w.state);
    for offset in 1..60_000 {
        let now = START + offset;
        let (o, w) = evaluate(&p, empty, now, 1.0, 120_000);
        assert!(o.allowed && o.wait > 0, "{offset}: {o:?}");
        let slot = o.at + o.wait;
        let (r, w) = refund(&p, w.map(|w| w.state), now, 1.0, slot);
        assert!(
            r.allowed,
            "{offset}: the last reservation's refund was refused"
        );
        let (again, _) = refund(&p, w.map(|w| w.state), now, 1.0, slot);
        assert!(!again.allowed, "{offset}: refunded twice");
    }
}
