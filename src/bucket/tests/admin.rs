//! Drains, blocks, sets and lowering: what the upstream's feedback and the admin operations
//! leave in a bucket, and when it admits again.
//!
//! Failures are persisted by proptest in `proptest-regressions/bucket/tests/admin.txt`.

use super::*;

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
