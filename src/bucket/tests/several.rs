//! Several buckets at once (`evaluate_all`): one bucket is a plain acquire, to the bit, and
//! requests on several go all or none and keep every limit.
//!
//! Failures are persisted by proptest in `proptest-regressions/bucket/tests/several.txt`.

use super::*;

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
