//! Fuzzing the store as a long-running property test: random sequences of every operation, with
//! random and extreme limits, costs and waits, and a clock that jumps forwards and backwards, on
//! a `MemoryStore` with a `ManualClock`.
//!
//! CI runs a bounded number of sequences (a few seconds); set `BURSTGATE_FUZZ_CASES` for a longer
//! run, e.g. `BURSTGATE_FUZZ_CASES=100000 cargo test --release --test all -- fuzz::`.
//!
//! Checked after every step: nothing panics; every error is the typed one the input calls for,
//! and valid input gets none; `remaining` never exceeds the burst; an admitted wait never exceeds
//! `max_wait` (clamped to 2^44 ms) and a denial's retry time does; and over any window of
//! send times the admitted tokens stay within `burst + rate × window`, plus the tokens refunded
//! (to within `f64` rounding, which matters only for bursts near `u32::MAX`).

use std::time::{Duration, UNIX_EPOCH};

use burstgate::{
    BucketKey, BucketStore, InvalidLimit, Limit, ManualClock, MemoryStore, Reservation, StoreError,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence};

use crate::support::{MAX_SPAN_MS, MAX_WAIT_MS, START};

fn cases() -> u32 {
    std::env::var("BURSTGATE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

#[derive(Debug, Clone)]
enum Op {
    Acquire {
        cost: u32,
        max_wait: Duration,
    },
    Peek,
    Refund {
        cost: u32,
    },
    /// Drains until now plus `ahead` ms (which may be negative: a deadline in the past).
    Drain {
        ahead: i64,
    },
    Forward {
        ms: u64,
    },
    Back {
        ms: u64,
    },
}

fn tokens() -> impl Strategy<Value = u32> {
    prop_oneof![Just(1), 1..=100u32, Just(u32::MAX)]
}

fn interval_ms() -> impl Strategy<Value = u64> {
    prop_oneof![Just(1), 1..=120_000u64, Just(MAX_SPAN_MS)]
}

/// A cost relative to the burst: mostly valid, sometimes zero or above it.
fn cost() -> impl Strategy<Value = CostPick> {
    prop_oneof![
        6 => (1..=u32::MAX).prop_map(CostPick::UpToBurst),
        2 => Just(CostPick::One),
        1 => Just(CostPick::Zero),
        1 => (1..=u32::MAX).prop_map(CostPick::AboveBurst),
    ]
}

#[derive(Debug, Clone, Copy)]
enum CostPick {
    One,
    Zero,
    /// Reduced modulo the burst into `1..=burst`.
    UpToBurst(u32),
    /// `burst` plus this, saturating: above the burst unless the burst is `u32::MAX`.
    AboveBurst(u32),
}

impl CostPick {
    fn resolve(self, burst: u32) -> u32 {
        match self {
            Self::One => 1,
            Self::Zero => 0,
            Self::UpToBurst(n) => 1 + (n - 1) % burst,
            Self::AboveBurst(n) => burst.saturating_add(n),
        }
    }
}

/// A step, with its cost still relative to the burst.
#[derive(Debug, Clone)]
enum Step {
    Acquire { cost: CostPick, max_wait: Duration },
    Peek,
    Refund { cost: CostPick },
    Drain { ahead: i64 },
    Forward { ms: u64 },
    Back { ms: u64 },
}

fn max_wait() -> impl Strategy<Value = Duration> {
    prop_oneof![
        3 => Just(Duration::ZERO),
        3 => (0..=600_000u64).prop_map(Duration::from_millis),
        1 => (0..=u64::MAX).prop_map(Duration::from_millis),
        1 => Just(Duration::MAX),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => (cost(), max_wait()).prop_map(|(cost, max_wait)| Step::Acquire { cost, max_wait }),
        2 => Just(Step::Peek),
        2 => cost().prop_map(|cost| Step::Refund { cost }),
        1 => (-600_000..=600_000i64).prop_map(|ahead| Step::Drain { ahead }),
        5 => prop_oneof![0..=2_000u64, 0..=600_000u64, 0..=(1u64 << 44)]
            .prop_map(|ms| Step::Forward { ms }),
        2 => prop_oneof![1..=2_000u64, 1..=600_000u64].prop_map(|ms| Step::Back { ms }),
    ]
}

fn resolve(steps: &[Step], burst: u32) -> Vec<Op> {
    steps
        .iter()
        .map(|s| match *s {
            Step::Acquire { cost, max_wait } => Op::Acquire {
                cost: cost.resolve(burst),
                max_wait,
            },
            Step::Peek => Op::Peek,
            Step::Refund { cost } => Op::Refund {
                cost: cost.resolve(burst),
            },
            Step::Drain { ahead } => Op::Drain { ahead },
            Step::Forward { ms } => Op::Forward { ms },
            Step::Back { ms } => Op::Back { ms },
        })
        .collect()
}

/// One admitted request: when it goes out, for how many tokens, and what had been refunded by
/// then.
#[derive(Debug, Clone, Copy)]
struct Sent {
    /// `now + wait` on the caller's clock.
    at: u64,
    /// `hwm + wait`, where `hwm` is the latest time the clock had shown: when it goes out in
    /// real time, if the clock's backward jumps were its errors.
    at_real: u64,
    cost: u64,
    refunded: u64,
    /// How many backward jumps came before it.
    epoch: usize,
}

/// The largest number of tokens sent within any window `[a, b]` beyond `burst + rate × (b − a)`
/// plus the tokens refunded; 0 when the bound holds. Counted exactly, in units of `1 / interval`
/// tokens, then converted. `time` picks the send time to measure, `same` which pairs of requests
/// may share a window.
fn worst_excess(
    sent: &[Sent],
    limit: Limit,
    slack_ms: u64,
    time: impl Fn(&Sent) -> u64,
    same: impl Fn(&Sent, &Sent) -> bool,
) -> f64 {
    let interval = limit.interval().as_millis();
    let rate = u128::from(limit.tokens());
    let burst = u128::from(limit.burst());
    let mut worst = 0;
    for a in sent {
        for b in sent {
            if time(b) < time(a) || !same(a, b) {
                continue;
            }
            let within = sent
                .iter()
                .filter(|s| time(s) >= time(a) && time(s) <= time(b) && same(a, s));
            let (mut tokens, mut refunded) = (0u128, 0u128);
            for s in within {
                tokens += u128::from(s.cost);
                refunded = refunded.max(u128::from(s.refunded));
            }
            let window = u128::from(time(b) - time(a) + slack_ms);
            let allowed = (burst + refunded) * interval + rate * window;
            worst = worst.max((tokens * interval).saturating_sub(allowed));
        }
    }
    worst as f64 / interval as f64
}

/// What `f64` rounding may add over `steps` steps, in tokens. The bucket keeps its tokens in an
/// `f64`, which holds a count up to the burst to within `burst × 2^-53`; a step rounds a few
/// times, so `2^-50` of the burst per step covers it. With a burst of 100 that is under 10^-13
/// tokens per step: exact for any count of whole tokens. With a burst of `u32::MAX` and one token
/// per 1024 ms, the bucket can see a token ready at 1024 ms that is exactly due 0.2 ns later.
fn rounding(limit: Limit, steps: usize) -> f64 {
    steps as f64 * f64::from(limit.burst()) * 2f64.powi(-50)
}

fn run(limit: Limit, ops: &[Op]) -> Result<(), TestCaseError> {
    let clock = ManualClock::new(START);
    let store = MemoryStore::new().with_clock(clock.clone());
    let key = BucketKey::new("fuzz", "k").map_err(|e| TestCaseError::fail(e.to_string()))?;
    let burst = limit.burst();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    let mut now = START;
    let mut hwm = START;
    // The latest time the bucket may have stored: the clock's or a drain's deadline.
    let mut latest = START;
    let mut max_behind = 0u64;
    let mut epoch = 0usize;
    let mut refunded = 0u64;
    let mut sent = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        match *op {
            Op::Acquire { cost, max_wait } => {
                let result = runtime.block_on(store.acquire(&key, limit, cost, max_wait));
                let ceiling = max_wait.min(Duration::from_millis(MAX_WAIT_MS));
                match result {
                    Err(StoreError::ZeroCost) => prop_assert_eq!(cost, 0, "step {}", i),
                    Err(StoreError::CostAboveBurst { cost: c, burst: b }) => {
                        prop_assert!(c == cost && b == burst && cost > burst);
                    }
                    Err(e) => prop_assert!(false, "step {}: unexpected error {:?}", i, e),
                    Ok(d) => {
                        prop_assert!(cost >= 1 && cost <= burst, "step {}: cost {}", i, cost);
                        prop_assert!(d.remaining() <= burst, "step {}: {:?}", i, d);
                        prop_assert_eq!(d.limit(), limit);
                        if d.is_admitted() {
                            prop_assert!(d.wait() <= ceiling, "step {}: {:?}", i, d);
                            prop_assert_eq!(d.retry_after(), None);
                            let wait = u64::try_from(d.wait().as_millis()).unwrap_or(u64::MAX);
                            sent.push(Sent {
                                at: now + wait,
                                at_real: hwm + wait,
                                cost: u64::from(cost),
                                refunded,
                                epoch,
                            });
                        } else {
                            let retry = d.retry_after().unwrap_or_default();
                            prop_assert!(retry >= Duration::from_millis(1), "step {}", i);
                            prop_assert!(retry > ceiling, "step {}: {:?} {:?}", i, d, ceiling);
                        }
                    }
                }
            }
            Op::Peek => {
                let q = runtime
                    .block_on(store.peek(&key, limit))
                    .map_err(|e| TestCaseError::fail(format!("step {i}: peek failed: {e}")))?;
                prop_assert_eq!(q.burst(), burst);
                prop_assert!(q.remaining() <= burst, "step {}: {:?}", i, q);
                prop_assert_eq!(q.used(), burst - q.remaining());
                if q.remaining() >= 1 {
                    // A token that is there is there now, even with the clock behind the
                    // bucket's stored time.
                    prop_assert_eq!(q.next_token_in(), Duration::ZERO, "step {}: {:?}", i, q);
                } else {
                    prop_assert!(q.next_token_in() >= Duration::from_millis(1));
                }
            }
            Op::Refund { cost } => {
                // A slot due now: it goes back while the bucket is in no debt.
                let reservation = Reservation::new(cost, UNIX_EPOCH + Duration::from_millis(now));
                match runtime.block_on(store.refund(&key, limit, reservation)) {
                    Ok(()) => {
                        prop_assert!(cost >= 1 && cost <= burst, "step {}: cost {}", i, cost);
                        refunded += u64::from(cost);
                    }
                    Err(StoreError::ZeroCost) => prop_assert_eq!(cost, 0),
                    Err(StoreError::CostAboveBurst { .. }) => prop_assert!(cost > burst),
                    Err(e) => prop_assert!(false, "step {}: unexpected error {:?}", i, e),
                }
            }
            Op::Drain { ahead } => {
                let until = now.saturating_add_signed(ahead);
                latest = latest.max(until);
                let until = UNIX_EPOCH + Duration::from_millis(until);
                runtime
                    .block_on(store.drain_until(&key, limit, until))
                    .map_err(|e| TestCaseError::fail(format!("step {i}: drain failed: {e}")))?;
            }
            Op::Forward { ms } => {
                now = now.saturating_add(ms);
                clock.set(now);
            }
            Op::Back { ms } => {
                now = now.saturating_sub(ms);
                clock.set(now);
                epoch += 1;
            }
        }
        hwm = hwm.max(now);
        latest = latest.max(now);
        max_behind = max_behind.max(hwm - now);
    }

    // Between backward jumps the clock is monotone, and the bound is exact.
    let tolerance = rounding(limit, ops.len());
    let excess = worst_excess(&sent, limit, 0, |s| s.at, |a, b| a.epoch == b.epoch);
    prop_assert!(
        excess <= tolerance,
        "{} tokens over within one stretch of steady clock: {:?}",
        excess,
        sent
    );
    // Across them, on the real time line, a clock that fell behind by up to `max_behind` may
    // send early by that much: the skew allowance of `skew × rate` (docs/OPERATIONS.md).
    let excess = worst_excess(&sent, limit, max_behind, |s| s.at_real, |_, _| true);
    prop_assert!(
        excess <= tolerance,
        "{} tokens over across clock jumps of up to {} ms: {:?}",
        excess,
        max_behind,
        sent
    );
    Ok(())
}

/// A limit from the three picks; a combination whose refill time is too long is refused with
/// `TooSlow` and replaced by the same rate with a burst of `tokens`, which is always accepted.
fn build_limit(tokens: u32, interval_ms: u64, burst: u32) -> Result<Limit, TestCaseError> {
    let rate = Limit::new(tokens, Duration::from_millis(interval_ms))
        .map_err(|e| TestCaseError::fail(format!("{tokens} per {interval_ms} ms: {e}")))?;
    match rate.with_burst(burst) {
        Ok(limit) => Ok(limit),
        Err(InvalidLimit::TooSlow) => {
            let refill = u128::from(burst) * u128::from(interval_ms) / u128::from(tokens);
            prop_assert!(refill > u128::from(MAX_SPAN_MS));
            Ok(rate)
        }
        Err(e) => Err(TestCaseError::fail(format!("unexpected {e:?}"))),
    }
}

proptest! {
    #![proptest_config(Config {
        cases: cases(),
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "proptest-regressions/fuzz.txt",
        ))),
        ..Config::default()
    })]

    #[test]
    fn random_operation_sequences_keep_every_promise(
        tokens in tokens(),
        interval_ms in interval_ms(),
        burst in prop_oneof![Just(1u32), 1..=100u32, Just(u32::MAX)],
        steps in proptest::collection::vec(step(), 1..64),
    ) {
        let limit = build_limit(tokens, interval_ms, burst)?;
        run(limit, &resolve(&steps, limit.burst()))?;
    }
}
