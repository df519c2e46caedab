//! Properties of the reference arithmetic, on a manual clock (explicit `now`s).
//!
//! Failures are persisted by proptest in `proptest-regressions/bucket/tests.txt`, which is
//! committed so every run replays them first.

use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::Limit;

/// Any valid limit, weighted towards the shapes APIs publish but reaching the extremes.
fn limit() -> impl Strategy<Value = Limit> {
    let tokens = prop_oneof![4 => 1u32..=10, 2 => 1u32..=10_000, 1 => any::<u32>()];
    let interval = prop_oneof![
        4 => prop::sample::select(vec![1u64, 7, 100, 1000, 60_000, 3_600_000]),
        2 => 1u64..=100_000,
        1 => 1u64..=(1 << 42),
    ];
    let burst = prop_oneof![4 => 1u32..=20, 2 => 1u32..=10_000, 1 => any::<u32>()];
    (tokens, interval, burst).prop_filter_map("a valid limit", |(t, i, b)| {
        Limit::new(t.max(1), Duration::from_millis(i))
            .and_then(|l| l.with_burst(b))
            .ok()
    })
}

/// A modest limit, so that traces stay readable and windows are many.
fn small_limit() -> impl Strategy<Value = Limit> {
    (
        1u32..=10,
        prop::sample::select(vec![1u64, 3, 10, 100, 1000, 60_000]),
        1u32..=12,
    )
        .prop_filter_map("a valid limit", |(t, i, b)| {
            Limit::new(t, Duration::from_millis(i))
                .and_then(|l| l.with_burst(b))
                .ok()
        })
}

const START: u64 = 1_700_000_000_000;

/// Two workers share a bucket: one on true time, one whose clock is `skew` ahead or behind.
/// Returns the true times admitted requests go out, and the skew between the workers × rate.
///
/// The skew is kept within the lead bound (the two clocks are at most the bound apart): beyond
/// it, a stored time is taken for a clock that moved and is clamped, which
/// `a_stored_time_far_ahead_is_clamped_to_the_lead_bound` covers.
fn skewed(
    limit: &Limit,
    skew: u64,
    steps: Vec<(u64, bool, bool)>,
) -> Result<(Vec<(u64, u64)>, f64), TestCaseError> {
    let lead = (u64::from(limit.burst()) * limit.interval_ms()).div_ceil(u64::from(limit.tokens()))
        + limit.interval_ms();
    let skew = skew.min(lead / 2);
    let p = Params::of(limit);
    let mut state: Option<State> = None;
    let mut true_now = START;
    let mut admissions = Vec::new();
    let mut last_ts = 0.0;
    for (dt, behind, reserve) in steps {
        true_now += dt;
        let now = if behind {
            true_now - skew
        } else {
            true_now + skew
        };
        let max_wait = if reserve { limit.interval_ms() } else { 0 };
        let (o, w) = evaluate(&p, state, now, 1.0, max_wait);
        if o.allowed {
            // A worker waits `wait` on its own clock; in true time that is the same span.
            admissions.push((true_now + o.wait, 1));
        }
        if let Some(w) = w {
            prop_assert!(w.state.ts >= last_ts, "stored time moved back");
            last_ts = w.state.ts;
            state = Some(w.state);
        }
    }
    let rate = f64::from(limit.tokens()) / limit.interval_ms() as f64;
    Ok((admissions, 2.0 * skew as f64 * rate))
}

/// Admissions as (time admitted, cost).
fn admitted_at_most_burst_plus_rate(limit: &Limit, admissions: &[(u64, u64)], extra: f64) {
    let mut sorted = admissions.to_vec();
    sorted.sort_unstable();
    let rate = f64::from(limit.tokens()) / limit.interval_ms() as f64;
    for (i, &(start, _)) in sorted.iter().enumerate() {
        let mut taken = 0u64;
        for &(at, cost) in &sorted[i..] {
            taken += cost;
            let window = (at - start) as f64;
            let allowed = f64::from(limit.burst()) + rate * window + extra;
            assert!(
                taken as f64 <= allowed + 1e-6,
                "{taken} tokens admitted within {window} ms under {limit}: more than {allowed}"
            );
        }
    }
}

proptest! {
    // 512 cases each by default; `PROPTEST_CASES` raises it for a longer run.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512),
        // One property keeps only the limits whose schedule the bucket does not cap.
        max_global_rejects: 1_000_000,
        ..ProptestConfig::default()
    })]

    #[test]
    fn a_full_bucket_admits_exactly_burst_at_once(limit in limit(), now in START..START * 2) {
        let p = Params::of(&limit);
        let mut state = None;
        // Bursts above a few thousand are covered by their first and last steps.
        let burst = u64::from(limit.burst());
        let (mut remaining, steps) = if burst > 5000 {
            let (o, w) = evaluate(&p, state, now, (burst - 1) as f64, 0);
            prop_assert!(o.allowed && o.wait == 0);
            state = w.map(|w| w.state);
            (1, 1)
        } else {
            (burst, burst)
        };
        for _ in 0..steps.min(remaining) {
            let (o, w) = evaluate(&p, state, now, 1.0, 0);
            prop_assert!(o.allowed && o.wait == 0, "{o:?}");
            remaining -= 1;
            prop_assert_eq!(o.remaining, remaining);
            state = w.map(|w| w.state);
        }
        let (o, w) = evaluate(&p, state, now, 1.0, 0);
        prop_assert!(!o.allowed && o.wait >= 1 && w.is_none(), "{o:?}");
    }

    #[test]
    fn no_window_admits_more_than_burst_plus_rate(
        limit in small_limit(),
        steps in prop::collection::vec((0u64..200, 1u32..=3, prop::bool::weighted(0.3)), 1..200),
    ) {
        let p = Params::of(&limit);
        let mut state = None;
        let mut now = START;
        let mut admissions = Vec::new();
        for (dt, cost, reserve) in steps {
            now += dt;
            let cost = cost.min(limit.burst());
            let max_wait = if reserve { 3 * limit.interval_ms() } else { 0 };
            let (o, w) = evaluate(&p, state, now, f64::from(cost), max_wait);
            if o.allowed {
                admissions.push((now + o.wait, u64::from(cost)));
            }
            if let Some(w) = w {
                state = Some(w.state);
            }
        }
        admitted_at_most_burst_plus_rate(&limit, &admissions, 0.0);
    }

    #[test]
    fn burst_one_never_admits_twice_within_a_refill_period(
        tokens in 1u32..=5,
        interval in prop::sample::select(vec![1u64, 7, 1000, 60_000]),
        steps in prop::collection::vec((0u64..120_000, prop::bool::weighted(0.3)), 2..100),
    ) {
        let limit = Limit::new(tokens, Duration::from_millis(interval))
            .and_then(|l| l.with_burst(1));
        let Ok(limit) = limit else { return Err(TestCaseError::fail("valid limit")) };
        let p = Params::of(&limit);
        let mut state = None;
        let mut now = START;
        let mut admissions = Vec::new();
        for (gap, reserve) in steps {
            now += gap % (3 * interval);
            let max_wait = if reserve { 2 * interval } else { 0 };
            let (o, w) = evaluate(&p, state, now, 1.0, max_wait);
            if o.allowed {
                admissions.push(now + o.wait);
            }
            if let Some(w) = w {
                state = Some(w.state);
            }
        }
        admissions.sort_unstable();
        for pair in admissions.windows(2) {
            // One token needs interval / tokens ms; in whole numbers, no rounding.
            prop_assert!(
                u128::from(pair[1] - pair[0]) * u128::from(tokens) >= u128::from(interval),
                "admitted at {} and again at {} under {limit}", pair[0], pair[1]
            );
        }
    }

    #[test]
    fn the_returned_wait_is_exact(
        limit in limit(),
        history in prop::collection::vec((0u64..5_000, 1u32..=4), 0..20),
        cost in 1u32..=4,
        now in START..START * 2,
    ) {
        let p = Params::of(&limit);
        let mut state = None;
        let mut t = now;
        for (dt, c) in history {
            t += dt;
            let (_, w) = evaluate(&p, state, t, f64::from(c.min(limit.burst())), 0);
            if let Some(w) = w {
                state = Some(w.state);
            }
        }
        let cost = f64::from(cost.min(limit.burst()));
        let (o, w) = evaluate(&p, state, t, cost, 0);
        if !o.allowed {
            prop_assert!(w.is_none() && o.wait >= 1);
            let (before, _) = evaluate(&p, state, t + o.wait - 1, cost, 0);
            let (at, _) = evaluate(&p, state, t + o.wait, cost, 0);
            prop_assert!(!before.allowed, "admitted one ms before the wait: {before:?}");
            prop_assert!(at.allowed && at.wait == 0, "not admitted after the wait: {at:?}");
        }
    }

    #[test]
    fn reservations_are_served_in_arrival_order_spaced_by_cost_over_rate(
        limit in small_limit(),
        callers in 1u64..30,
        cost in 1u32..=3,
    ) {
        let p = Params::of(&limit);
        let cost = cost.min(limit.burst());
        let (tokens, interval) = (u64::from(limit.tokens()), limit.interval_ms());
        // Where the schedule is not capped by the bucket: a reservation is served at a whole
        // millisecond, and when that holds more than the bucket can, the excess is lost.
        prop_assume!(
            (cost < limit.burst() && tokens <= interval) || (u64::from(cost) * interval) % tokens == 0
        );
        // Empty the bucket, then queue callers arriving in the same millisecond.
        let (_, w) = evaluate(&p, None, START, f64::from(limit.burst()), 0);
        let mut state = w.map(|w| w.state);
        let mut last_wait = 0;
        for k in 1..=callers {
            let (o, w) = evaluate(&p, state, START, f64::from(cost), u64::MAX);
            prop_assert!(o.allowed);
            state = w.map(|w| w.state);
            // The k-th caller is served once k × cost tokens have refilled:
            // ceil(k·cost·interval / tokens) ms, in whole numbers, with no rounding drift.
            let due = (u128::from(k) * u128::from(cost) * u128::from(limit.interval_ms()))
                .div_ceil(u128::from(limit.tokens()));
            prop_assert_eq!(u128::from(o.wait), due);
            prop_assert!(o.wait > last_wait, "served out of order");
            last_wait = o.wait;
        }
    }

    #[test]
    fn skew_over_admits_plain_decisions_at_most_once_by_capped_skew_times_rate(
        limit in small_limit(),
        skew in 0u64..5_000,
        steps in prop::collection::vec((0u64..300, prop::bool::ANY), 1..200),
    ) {
        let steps = steps.into_iter().map(|(dt, behind)| (dt, behind, false)).collect();
        let (admissions, extra) = skewed(&limit, skew, steps)?;
        let extra = extra.min(f64::from(limit.burst()));
        admitted_at_most_burst_plus_rate(&limit, &admissions, extra);
    }

    #[test]
    fn skew_over_admits_reservations_at_most_once_by_skew_times_rate(
        limit in small_limit(),
        skew in 0u64..5_000,
        steps in prop::collection::vec((0u64..300, prop::bool::ANY, prop::bool::ANY), 1..200),
    ) {
        let (admissions, extra) = skewed(&limit, skew, steps)?;
        admitted_at_most_burst_plus_rate(&limit, &admissions, extra);
    }

    #[test]
    fn refunds_never_let_two_sends_closer_than_the_limit_allows(
        limit in small_limit(),
        ops in prop::collection::vec((0u64..2_000, 0u8..5, any::<u32>()), 1..120),
    ) {
        let p = Params::of(&limit);
        let refill = u64::try_from(limit.refill_time().as_millis()).unwrap_or(u64::MAX);
        let mut state = None;
        let mut now = START;
        // Reservations waiting for their slot, as (slot, cost), and the sends made.
        let mut waiting: Vec<(u64, u64)> = Vec::new();
        let mut sends: Vec<(u64, u64)> = Vec::new();
        for (dt, op, pick) in ops {
            now += dt % (refill + 2);
            waiting.retain(|&(slot, cost)| {
                let due = slot <= now;
                if due {
                    sends.push((slot, cost));
                }
                !due
            });
            let cost = 1 + u64::from(pick) % u64::from(limit.burst().min(3));
            match op {
                0..=2 => {
                    let (o, w) = evaluate(&p, state, now, cost as f64, 3 * refill);
                    if o.allowed {
                        waiting.push((o.at + o.wait, cost));
                    }
                    if let Some(w) = w {
                        state = Some(w.state);
                    }
                }
                3 if !waiting.is_empty() => {
                    // Any waiting caller gives up: it never sends, and refunds its slot.
                    let (slot, cost) = waiting.remove(pick as usize % waiting.len());
                    let (_, w) = refund(&p, state, now, cost as f64, slot);
                    if let Some(w) = w {
                        state = Some(w.state);
                    }
                }
                _ => {
                    let until = now + u64::from(pick) % (refill + 1);
                    state = Some(drain_until(&p, state, now, until).state);
                }
            }
        }
        sends.extend(waiting);
        sends.sort_unstable();
        // A strict bucket upstream with the same limit, full at the start, in whole units of
        // a token times the interval: it must take every send.
        let (tokens, interval) = (u128::from(limit.tokens()), u128::from(limit.interval_ms()));
        let full = u128::from(limit.burst()) * interval;
        let (mut level, mut last) = (full, START);
        for &(at, cost) in &sends {
            level = full.min(level + u128::from(at - last) * tokens);
            last = at;
            let need = u128::from(cost) * interval;
            prop_assert!(level >= need, "a send of {} at {} found {}/{} upstream: {:?}",
                cost, at - START, level, interval, sends);
            level -= need;
        }
    }

    /// No reservation granted after a drain has its slot before the drain's halt (by more than
    /// the millisecond of rounding `halts` allows), so the halt stops only reservations the
    /// drain passed over. (Refunds are left out: one given back
    /// between the drain's deadline and its first token can admit a request there.)
    #[test]
    fn no_reservation_granted_after_a_drain_is_slotted_before_its_halt(
        limit in small_limit(),
        ops in prop::collection::vec((0u64..2_000, 0u8..4, any::<u32>()), 1..80),
    ) {
        let p = Params::of(&limit);
        let refill = u64::try_from(limit.refill_time().as_millis()).unwrap_or(u64::MAX);
        let (mut state, mut stored_halt, mut now) = (None, 0.0, START);
        for (dt, op, pick) in ops {
            now += dt % (refill + 2);
            let seen = halt(&p, state, stored_halt, now, None);
            if op == 0 {
                let until = now + u64::from(pick) % (3 * refill + 1);
                stored_halt = halt(&p, state, stored_halt, now, Some(until));
                let w = drain_until(&p, state, now, until);
                // The next token is due at the halt, or later behind a queue longer than the
                // drain.
                let next = peek(&p, Some(w.state), now);
                prop_assert!(!halts(stored_halt as u64, next.at + next.wait),
                    "halt {} after the next token {}", stored_halt, next.at + next.wait);
                state = Some(w.state);
                continue;
            }
            let cost = 1 + u64::from(pick) % u64::from(limit.burst().min(3));
            let (o, w) = evaluate(&p, state, now, cost as f64, 3 * refill);
            if o.allowed {
                prop_assert!(!halts(seen as u64, o.at + o.wait),
                    "slot {} before the halt {}", o.at + o.wait, seen);
            }
            if let Some(w) = w {
                stored_halt = halt(&p, state, stored_halt, now, None);
                state = Some(w.state);
            }
        }
    }

    #[test]
    fn nothing_overflows_for_any_limit_cost_and_time(
        limit in limit(),
        ops in prop::collection::vec((any::<u64>(), any::<u32>(), 0u8..7, any::<u64>()), 1..30),
    ) {
        let p = Params::of(&limit);
        let mut state = None;
        for (now, cost, op, arg) in ops {
            // Any report at all, far above the burst included.
            let cost_raw = cost;
            let tokens = f64::from(cost % (limit.burst().saturating_add(1)));
            let cost = f64::from(1 + cost % limit.burst());
            let write = match op {
                0 => {
                    let (o, w) = evaluate(&p, state, now, cost, arg);
                    prop_assert!(o.remaining <= u64::from(limit.burst()));
                    prop_assert!(!o.allowed || o.wait <= MAX_WAIT);
                    w
                }
                1 => {
                    let o = peek(&p, state, now);
                    prop_assert!(o.remaining <= u64::from(limit.burst()));
                    None
                }
                2 => refund(&p, state, now, cost, arg).1,
                3 => {
                    let h = halt(&p, state, 0.0, now, Some(arg));
                    prop_assert!(sound_halt(h), "{}", h);
                    Some(drain_until(&p, state, now, arg))
                }
                4 => Some(set(&p, state, now, tokens)),
                5 => lower(&p, state, now, f64::from(cost_raw)).1,
                _ => {
                    let h = block_halt(&p, state, 0.0, now, arg);
                    prop_assert!(sound_halt(h), "{}", h);
                    let w = block_until(&p, state, now, arg).1;
                    if let Some(w) = w {
                        prop_assert!(sound(&p, w.state), "{:?}", w);
                    }
                    w
                }
            };
            if let Some(w) = write {
                prop_assert!(w.state.t.is_finite() && w.state.ts.is_finite() && w.full.is_finite());
                prop_assert!(w.state.t <= p.capacity);
                prop_assert!(w.state.ts <= MAX_TIME as f64 && w.state.ts == w.state.ts.trunc());
                prop_assert!(w.ttl(&p) >= limit.interval_ms());
                state = Some(w.state);
            }
        }
    }
}

#[test]
fn a_stale_clock_refills_nothing_and_never_moves_time_back() {
    let limit = Limit::per_second(1).and_then(|l| l.with_burst(2));
    let p = limit
        .map(|l| Params::of(&l))
        .unwrap_or(Params::new(1.0, 1000.0, 2.0));
    let (_, w) = evaluate(&p, None, 10_000, 2.0, 0);
    let state = w.map(|w| w.state);
    // A worker 1 s behind sees an empty bucket, not one refilled by 1 s of negative time, and
    // is told the wait from the stored time, as the worker that wrote it would be.
    let (o, w) = evaluate(&p, state, 9_000, 1.0, 0);
    assert!(!o.allowed && w.is_none());
    assert_eq!(o.wait, 1_000);
    let (_, w) = refund(&p, state, 9_000, 1.0, 9_000);
    assert_eq!(w.map(|w| w.state.ts), Some(10_000.0));
}

#[test]
fn a_stored_time_far_ahead_is_clamped_to_the_lead_bound() {
    // 1 per minute, burst 10: ten minutes to refill, so a stored time may lead by 11 minutes.
    let p = Params::new(1.0, 60_000.0, 10.0);
    let year = 365 * 86_400_000;
    // A worker ten years ahead empties the bucket.
    let (_, w) = evaluate(&p, None, START + 10 * year, 10.0, 0);
    let state = w.map(|w| w.state);
    // For a healthy worker, that write's time is moved back to its own clock: the first token
    // is due a minute from now, not in ten years.
    let (o, w) = evaluate(&p, state, START, 1.0, 0);
    assert!(!o.allowed);
    assert_eq!(o.wait, 60_000);
    // The denial stores the moved time, so that the refill runs from it.
    let moved = w.map(|w| w.state.ts);
    assert_eq!(moved, Some(START as f64));
    let (o, _) = evaluate(&p, state, START, 1.0, u64::MAX);
    assert!(o.allowed);
    assert_eq!(o.wait, 60_000);
    let q = peek(&p, state, START);
    assert_eq!(q.wait, 60_000);
    // Its write keeps the moved time, and its expiry counts from it.
    let (_, w) = refund(&p, state, START, 1.0, START);
    let w = w.expect("a write");
    assert_eq!(w.state.ts, START as f64);
    assert!(w.ttl(&p) <= 10 * 60_000 + 2 * 60_000);
    // A lead within the bound (11 minutes here) is the other writer's clock, and counts as it
    // is: the caller behind it is told the wait from the stored time, and refills nothing.
    let (_, w) = evaluate(&p, None, START + 11 * 60_000, 10.0, 0);
    let (o, w) = evaluate(&p, w.map(|w| w.state), START, 1.0, 0);
    assert!(!o.allowed && w.is_none());
    assert_eq!(o.wait, 60_000);
}

#[test]
fn drain_blocks_until_the_deadline_then_refills() {
    let p = Params::new(1.0, 1000.0, 10.0);
    let w = drain_until(&p, None, 0, 2_000);
    let state = Some(w.state);
    let (o, _) = evaluate(&p, state, 1_999, 1.0, 0);
    assert!(!o.allowed);
    assert_eq!(o.wait, 1_001);
    let (o, _) = evaluate(&p, state, 3_000, 1.0, 0);
    assert!(o.allowed);
    // The key outlives the drain: until full (2 s + 10 s) plus an interval.
    assert_eq!(w.ttl(&p), 13_000);
}

#[test]
fn a_drain_halts_until_its_first_token_and_the_halt_ends_with_the_lead_bound() {
    // 1 per second, burst 10: ten seconds to refill, so a halt is kept for 11 s after it.
    let p = Params::new(1.0, 1000.0, 10.0);
    // Empty until 2 s: the first token at 3 s.
    let h = halt(&p, None, 0.0, 0, Some(2_000));
    assert_eq!(h, 3_000.0);
    let w = drain_until(&p, None, 0, 2_000);
    // A shorter drain later keeps the longer halt; a longer one moves it.
    assert_eq!(halt(&p, Some(w.state), h, 500, Some(1_000)), 3_000.0);
    assert_eq!(halt(&p, Some(w.state), h, 500, Some(4_000)), 5_000.0);
    // A deadline already past still halts for one token period.
    assert_eq!(halt(&p, Some(w.state), 0.0, 9_000, Some(1)), 10_000.0);
    // Kept while less than the lead bound behind the call's time, then gone.
    assert_eq!(halt(&p, Some(w.state), h, 13_999, None), 3_000.0);
    assert_eq!(halt(&p, Some(w.state), h, 14_000, None), 0.0);
    // A stored time far ahead of the caller, moved back, takes its halt with it.
    let year = 365 * 86_400_000;
    let ahead = drain_until(&p, None, 10 * year, 10 * year + 2_000);
    let far = halt(&p, None, 0.0, 10 * year, Some(10 * year + 2_000));
    assert_eq!(halt(&p, Some(ahead.state), far, 0, None), 0.0);
    assert!(sound_halt(far) && sound_halt(0.0));
    for bad in [-1.0, 0.5, f64::NAN, f64::INFINITY, 9_007_199_254_740_992.0] {
        assert!(!sound_halt(bad), "{bad}");
    }
}

#[test]
fn refund_never_exceeds_capacity() {
    let p = Params::new(1.0, 1000.0, 3.0);
    let (_, w) = evaluate(&p, None, 0, 1.0, 0);
    let (o, w) = refund(&p, w.map(|w| w.state), 0, 3.0, 0);
    assert!(o.allowed);
    let w = w.expect("a write");
    assert_eq!(w.state.t, 3.0);
    assert_eq!(w.full, 0.0);
}

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

/// What a bucket holds at `at` by the plain admission rule: whether a cost of one goes.
fn admits_one(p: &Params, state: State, at: u64) -> Verdict {
    evaluate(p, Some(state), at, 1.0, 0).0
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512),
        ..ProptestConfig::default()
    })]

    /// A block admits nothing before its deadline, and one token at it, to the millisecond,
    /// unless the bucket owed more already (queued reservations keep their places), in which
    /// case the first token is later; reservations made meanwhile are slotted at the deadline
    /// or later; and the halt is the deadline. For any limit, from states that acquires,
    /// reservations and drains leave, for deadlines from 1 ms to [`MAX_WAIT`] ahead.
    #[test]
    fn a_block_admits_nothing_before_its_deadline_and_one_token_at_it(
        limit in limit(),
        ops in prop::collection::vec((any::<u64>(), 0u8..3, any::<u64>()), 0..8),
        ahead in prop_oneof![1u64..=3, 1u64..=100_000, 1u64..=MAX_WAIT],
        probe in any::<u64>(),
    ) {
        let p = Params::of(&limit);
        let refill = u64::try_from(limit.refill_time().as_millis()).unwrap_or(u64::MAX);
        let (mut state, mut now) = (None, START);
        for (dt, op, arg) in ops {
            now += dt % (refill.saturating_add(2));
            let w = match op {
                0 => {
                    let cost = 1 + arg % u64::from(limit.burst());
                    evaluate(&p, state, now, cost as f64, arg % (2 * refill + 1)).1
                }
                1 => Some(drain_until(&p, state, now, now + arg % (2 * refill + 1))),
                _ => Some(set(&p, state, now, (arg % (u64::from(limit.burst()) + 1)) as f64)),
            };
            if let Some(w) = w {
                state = Some(w.state);
            }
        }
        let until = now + ahead;
        let (_, avail, ts, _) = available(&p, state, time(now));
        prop_assert_eq!(ts, time(now));
        let deadline = block_deadline(ts, until)
            .ok_or_else(|| TestCaseError::fail("a deadline ahead is no deadline"))?;
        let floor = block_floor(&p, ts, deadline);
        let owed_more = avail < floor;
        // The halt is the first token after the block on an empty queue.
        prop_assert_eq!(ready_at(&p, floor, ts, 1.0), until as f64);
        let (_, w) = block_until(&p, state, now, until);
        let blocked = w.ok_or_else(|| TestCaseError::fail("a deadline ahead wrote nothing"))?.state;
        prop_assert_eq!(block_halt(&p, state, 0.0, now, until), until as f64);
        let before = now + probe % ahead;
        for at in [now, before, until - 1] {
            let o = admits_one(&p, blocked, at);
            prop_assert!(!o.allowed, "admitted at {} before {}", at, until);
            if owed_more {
                prop_assert!(o.wait >= until - at);
            } else {
                prop_assert_eq!(o.wait, until - at, "at {}", at);
            }
        }
        let r = evaluate(&p, Some(blocked), before, 1.0, MAX_WAIT).0;
        prop_assert!(r.allowed && r.at + r.wait >= until, "{:?}", r);
        if !owed_more {
            prop_assert_eq!(r.at + r.wait, until);
            prop_assert!(admits_one(&p, blocked, until).allowed);
        }
    }

    /// The state a store writes to forget a bucket is read by every operation, under any limit
    /// and at any time, exactly as a missing bucket: the same outcome, the same write, to the
    /// bit, and the same halt.
    #[test]
    fn a_forgotten_bucket_reads_as_a_missing_one(
        limit in limit(),
        now in prop_oneof![Just(0u64), any::<u64>(), START..START * 2],
        cost in any::<u32>(),
        arg in any::<u64>(),
    ) {
        let p = Params::of(&limit);
        let tokens = f64::from(cost % (limit.burst().saturating_add(1)));
        let cost = f64::from(1 + cost % limit.burst());
        let (gone, none) = (Some(FORGOTTEN.state), None);
        let same = |a: String, b: String| -> Result<(), TestCaseError> {
            prop_assert_eq!(a, b);
            Ok(())
        };
        same(format!("{:?}", evaluate(&p, gone, now, cost, arg)),
            format!("{:?}", evaluate(&p, none, now, cost, arg)))?;
        same(format!("{:?}", peek(&p, gone, now)), format!("{:?}", peek(&p, none, now)))?;
        same(format!("{:?}", refund(&p, gone, now, cost, arg)),
            format!("{:?}", refund(&p, none, now, cost, arg)))?;
        same(format!("{:?}", drain_until(&p, gone, now, arg)),
            format!("{:?}", drain_until(&p, none, now, arg)))?;
        same(format!("{:?}", set(&p, gone, now, tokens)),
            format!("{:?}", set(&p, none, now, tokens)))?;
        same(format!("{:?}", block_until(&p, gone, now, arg)),
            format!("{:?}", block_until(&p, none, now, arg)))?;
        prop_assert_eq!(halt(&p, gone, 0.0, now, Some(arg)).to_bits(),
            halt(&p, none, 0.0, now, Some(arg)).to_bits());
        prop_assert_eq!(block_halt(&p, gone, 0.0, now, arg).to_bits(),
            block_halt(&p, none, 0.0, now, arg).to_bits());
    }
}

#[test]
fn a_drain_one_token_period_short_of_a_deadline_can_miss_it_by_a_millisecond() {
    // 1 per second. Drained until 1 ms from now, the bucket owes 0.001 tokens, and a token
    // would be due exactly 1,001 ms from now; the two refills round to 0.9999999999999999
    // there, so the first token goes a millisecond late. A block until then is exact.
    let p = Params::new(1.0, 1000.0, 10.0);
    let now = START;
    let drained = drain_until(&p, None, now, now + 1).state;
    assert!(!admits_one(&p, drained, now + 1_001).allowed);
    assert!(admits_one(&p, drained, now + 1_002).allowed);
    let blocked = block_until(&p, None, now, now + 1_001)
        .1
        .expect("a write")
        .state;
    assert_eq!(admits_one(&p, blocked, now + 1_000).wait, 1);
    assert!(admits_one(&p, blocked, now + 1_001).allowed);
}

#[test]
fn a_block_whose_deadline_is_not_ahead_changes_nothing() {
    let p = Params::new(1.0, 1000.0, 10.0);
    let (_, w) = evaluate(&p, None, START, 4.0, 0);
    let state = w.map(|w| w.state);
    for until in [0, START - 1, START] {
        let (o, w) = block_until(&p, state, START, until);
        assert!(w.is_none() && !o.allowed, "{until}");
        assert_eq!((o.remaining, o.reset, o.at), (6, 4_000, START));
        assert_eq!(block_halt(&p, state, 0.0, START, until), 0.0);
    }
    // A stored time far ahead is still moved back, as by every operation but peek.
    let year = 365 * 86_400_000;
    let ahead = Some(State {
        t: 3.0,
        ts: (START + 10 * year) as f64,
    });
    let (_, w) = block_until(&p, ahead, START, START);
    assert_eq!(
        w.map(|w| w.state),
        Some(State {
            t: 3.0,
            ts: START as f64
        })
    );
    // A deadline beyond the longest wait is taken as that.
    let (_, w) = block_until(&p, None, START, u64::MAX);
    let far = w.expect("a write").state;
    assert_eq!(admits_one(&p, far, START + MAX_WAIT - 1).wait, 1);
    assert_eq!(
        block_halt(&p, None, 0.0, START, u64::MAX),
        (START + MAX_WAIT) as f64
    );
}

#[test]
fn a_block_keeps_a_later_halt_and_deeper_debt() {
    let p = Params::new(1.0, 1000.0, 2.0);
    // Reservations queued until 5 s: a block until 3 s leaves them in place.
    let mut state = None;
    for _ in 0..7 {
        state = evaluate(&p, state, 0, 1.0, 10_000).1.map(|w| w.state);
    }
    let (_, w) = block_until(&p, state, 0, 3_000);
    assert_eq!(w.map(|w| w.state), state);
    // A drain's later halt is kept; an earlier one is moved to the deadline.
    assert_eq!(block_halt(&p, None, 9_000.0, 0, 3_000), 9_000.0);
    assert_eq!(block_halt(&p, None, 2_000.0, 0, 3_000), 3_000.0);
}

#[test]
fn a_set_holds_exactly_its_tokens_from_now_and_forgets_the_debt() {
    let p = Params::new(1.0, 1000.0, 10.0);
    // Ten taken and five reserved: 5 tokens owed at 0.
    let mut state = None;
    for _ in 0..15 {
        state = evaluate(&p, state, 0, 1.0, 10_000).1.map(|w| w.state);
    }
    assert_eq!(state.map(|s| s.t), Some(-5.0));
    let w = set(&p, state, 500, 3.0);
    assert_eq!(w.state, State { t: 3.0, ts: 500.0 });
    assert_eq!((w.at, w.full), (500.0, 7_500.0));
    let mut held = Some(w.state);
    for _ in 0..3 {
        let (o, w) = evaluate(&p, held, 500, 1.0, 0);
        assert!(o.allowed && o.wait == 0);
        held = w.map(|w| w.state);
    }
    assert_eq!(evaluate(&p, held, 500, 1.0, 0).0.wait, 1_000);
    // Set to 0: the first token one token period later; to the burst: full.
    let empty = set(&p, None, 500, 0.0).state;
    assert_eq!(admits_one(&p, empty, 1_499).wait, 1);
    assert!(admits_one(&p, empty, 1_500).allowed);
    assert_eq!(set(&p, state, 500, 10.0).outcome().reset, 0);
    // The stored time never moves back: a writer ahead stays ahead, within the lead bound;
    // beyond it, the stored time is moved back as by every write.
    let ahead = Some(State { t: -2.0, ts: 900.0 });
    assert_eq!(set(&p, ahead, 500, 4.0).state, State { t: 4.0, ts: 900.0 });
    let far = Some(State { t: -2.0, ts: 1e12 });
    assert_eq!(set(&p, far, 500, 4.0).state, State { t: 4.0, ts: 500.0 });
}

proptest! {
    #[test]
    fn lowering_leaves_the_least_of_what_the_bucket_held_and_the_report(
        limit in small_limit(),
        taken in 0u32..30,
        reported in 0u32..40,
        later in 0u64..200_000,
    ) {
        let p = Params::of(&limit);
        // Spent and reserved: from full to some way into debt.
        let mut state = None;
        for _ in 0..taken {
            state = evaluate(&p, state, START, 1.0, u64::MAX).1.map(|w| w.state).or(state);
        }
        let now = START + later;
        let before = peek(&p, state, now);
        let (o, w) = lower(&p, state, now, f64::from(reported));
        let after = peek(&p, w.map(|w| w.state).or(state), now);
        prop_assert_eq!(after.remaining, before.remaining.min(u64::from(reported)));
        prop_assert_eq!(o.allowed, w.is_some());
        if let Some(w) = w {
            // Lowered to the report's whole tokens, never raised, with the bucket's fraction
            // of its next token kept.
            prop_assert!(u64::from(reported) < before.remaining);
            prop_assert_eq!(after.remaining, u64::from(reported));
            prop_assert!(w.state.t >= f64::from(reported) && w.state.t < f64::from(reported) + 1.0);
        } else {
            prop_assert_eq!(after, before);
        }
    }
}

#[test]
fn lowering_an_emptied_bucket_to_zero_makes_its_next_token_one_period_away() {
    // 20 a second, burst 9: full, told nothing is left.
    let p = Params::new(20.0, 1000.0, 9.0);
    let (o, w) = lower(&p, None, START, 0.0);
    assert!(o.allowed);
    let lowered = w.map(|w| w.state);
    assert_eq!(evaluate(&p, lowered, START, 1.0, 0).0.wait, 50);
    assert!(evaluate(&p, lowered, START + 50, 1.0, 0).0.allowed);
    // 2.6 tokens, told 1 is left: 1.6, the next token as near as it was; told 2, nothing.
    let mut state = None;
    for _ in 0..7 {
        state = evaluate(&p, state, START, 1.0, 0).1.map(|w| w.state);
    }
    let held = Some(State {
        t: state.unwrap().t + 0.6,
        ..state.unwrap()
    });
    let (o, w) = lower(&p, held, START, 1.0);
    assert!(o.allowed);
    assert!((w.unwrap().state.t - 1.6).abs() < 1e-9, "{w:?}");
    assert_eq!(lower(&p, held, START, 2.0).1, None);
    // A bucket in debt holds less than any report: nothing is written, its queue stands.
    let mut queued = None;
    for _ in 0..12 {
        queued = evaluate(&p, queued, START, 1.0, u64::MAX)
            .1
            .map(|w| w.state);
    }
    assert_eq!(lower(&p, queued, START, 0.0).1, None);
}

/// A state the arithmetic can have left under `p`: what `ops` acquires (cost, ms after
/// `START`, max wait) made of a full bucket.
fn worked(p: &Params, ops: &[(u32, u64, u64)]) -> Option<State> {
    let mut state = None;
    for &(cost, at, max_wait) in ops {
        let cost = f64::from(cost).min(p.capacity).max(1.0);
        if let (_, Some(w)) = evaluate(p, state, START + at, cost, max_wait) {
            state = Some(w.state);
        }
    }
    state
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Acquiring one bucket through `evaluate_all` is `evaluate`, to the bit.
    #[test]
    fn one_bucket_at_once_is_a_plain_acquire(
        limit in limit(),
        ops in prop::collection::vec((1u32..=20, 0u64..5_000, 0u64..100_000), 0..6),
        cost in 1u32..=20,
        later in 0u64..10_000,
        max_wait in prop_oneof![Just(0u64), 0u64..200_000, Just(u64::MAX)],
    ) {
        let p = Params::of(&limit);
        let state = worked(&p, &ops);
        let cost = f64::from(cost).min(p.capacity);
        let now = START + later;
        let single = evaluate(&p, state, now, cost, max_wait);
        let (allowed, all) = evaluate_all_collected(&[Part { p, state, cost }], now, max_wait);
        prop_assert_eq!(allowed, single.0.allowed);
        prop_assert_eq!(all.len(), 1);
        prop_assert_eq!(all[0].0, single.0);
        let bits = |w: Option<Write>| w.map(|w| (w.state.t.to_bits(), w.state.ts.to_bits(), w.full.to_bits()));
        prop_assert_eq!(bits(all[0].1), bits(single.1));
    }

    /// Requests drawn from two or three buckets at once, at random times and with random
    /// ceilings: each is admitted on every bucket or on none, and on every bucket the requests
    /// it admitted go out (at their call's time plus its wait) no faster than the bucket's
    /// limit allows, whatever the other buckets made them wait for. A denial writes nothing,
    /// and its wait is the request's: admitted then with no wait, denied a millisecond before.
    #[test]
    fn requests_on_several_buckets_go_on_all_or_none_and_keep_every_limit(
        limits in prop::collection::vec(small_limit(), 2..=3),
        steps in prop::collection::vec(
            (0u64..400, prop::collection::vec(1u32..=3, 3), prop_oneof![Just(0u64), 0u64..3_000]),
            1..40,
        ),
    ) {
        let params: Vec<Params> = limits.iter().map(Params::of).collect();
        let mut states: Vec<Option<State>> = vec![None; params.len()];
        // Per bucket: (send time, cost) of every admission.
        let mut sent: Vec<Vec<(u64, f64)>> = vec![Vec::new(); params.len()];
        let mut now = START;
        for (gap, costs, max_wait) in steps {
            now += gap;
            let parts: Vec<Part> = params
                .iter()
                .zip(&states)
                .zip(&costs)
                .map(|((&p, &state), &cost)| Part { p, state, cost: f64::from(cost).min(p.capacity) })
                .collect();
            let (allowed, outcomes) = evaluate_all_collected(&parts, now, max_wait);
            prop_assert!(outcomes.iter().all(|(o, _)| o.allowed == allowed));
            if allowed {
                let wait = outcomes[0].0.wait;
                prop_assert!(wait <= max_wait);
                for (i, (o, w)) in outcomes.iter().enumerate() {
                    prop_assert_eq!(o.wait, wait);
                    let w = w.expect("an admission writes every bucket");
                    states[i] = Some(w.state);
                    sent[i].push((now + wait, parts[i].cost));
                }
            } else {
                let retry = outcomes.iter().map(|(o, _)| o.wait).max().unwrap_or(0);
                prop_assert!(retry > max_wait);
                prop_assert!(outcomes.iter().all(|(_, w)| w.is_none()), "a denial wrote");
                // Nothing else happens meanwhile: the same request goes at `now + retry`.
                let (at_retry, _) = evaluate_all_collected(&parts, now + retry, 0);
                prop_assert!(at_retry, "denied at its retry time");
                let (before, _) = evaluate_all_collected(&parts, now + retry - 1, 0);
                prop_assert!(!before, "admitted before its retry time");
            }
        }
        for (i, sends) in sent.iter_mut().enumerate() {
            let p = params[i];
            sends.sort_by_key(|&(at, _)| at);
            // Between any two sends, the tokens sent are at most a full bucket and what
            // refills from the first to the last.
            for a in 0..sends.len() {
                let mut spent = 0.0;
                for b in a..sends.len() {
                    spent += sends[b].1;
                    let span = (sends[b].0 - sends[a].0) as f64;
                    let allowed = p.capacity + span * p.tokens / p.interval;
                    prop_assert!(
                        spent <= allowed + 1e-9,
                        "bucket {} sent {} tokens in {} ms under {:?}",
                        i, spent, span, limits[i]
                    );
                }
            }
        }
    }
}

#[test]
fn a_request_on_two_buckets_waits_for_the_later_and_takes_both_at_that_slot() {
    // An endpoint at 1 a second, burst 1, and its account at 10 a second, burst 2.
    let endpoint = Params::new(1.0, 1000.0, 1.0);
    let account = Params::new(10.0, 1000.0, 2.0);
    let parts = |e: Option<State>, a: Option<State>| {
        [
            Part {
                p: endpoint,
                state: e,
                cost: 1.0,
            },
            Part {
                p: account,
                state: a,
                cost: 1.0,
            },
        ]
    };
    let (ok, first) = evaluate_all_collected(&parts(None, None), START, 0);
    assert!(ok);
    let (e, a) = (first[0].1.map(|w| w.state), first[1].1.map(|w| w.state));
    assert_eq!((first[0].0.remaining, first[1].0.remaining), (0, 1));
    // The endpoint's next token is a second away: with no wait allowed, refused on it alone,
    // and the account keeps its token.
    let (ok, denied) = evaluate_all_collected(&parts(e, a), START, 0);
    assert!(!ok);
    assert_eq!((denied[0].0.wait, denied[1].0.wait), (1000, 0));
    assert!(denied.iter().all(|(_, w)| w.is_none()));
    // Allowed to wait, it goes in a second, on both. The account would be full again by then:
    // it is debited as at that slot, where it holds its burst less this request's token.
    let (ok, queued) = evaluate_all_collected(&parts(e, a), START, 1000);
    assert!(ok);
    assert_eq!((queued[0].0.wait, queued[1].0.wait), (1000, 1000));
    let account_after = queued[1].1.unwrap().state;
    assert_eq!(account_after.ts, START as f64);
    // 9 in debt now (1 held, less this request's token, less the 9 of the 10 that refill by the
    // slot that would spill over the top), so that at the slot it holds 1: the burst less one.
    let at_slot = account_after.t + 1000.0 * 10.0 / 1000.0;
    assert!((at_slot - 1.0).abs() < 1e-9, "{account_after:?}");
}
