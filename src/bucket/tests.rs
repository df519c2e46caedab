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

mod admin;
mod rounding;
mod several;
