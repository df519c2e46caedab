//! The store against a model that keeps every bucket forever in a `HashMap` and decides
//! through the same functions of `bucket`: dropping full buckets, the inline and heap keys
//! and the shards must change no decision, to the last field.
//!
//! The model's clock never moves back. A bucket is dropped only once full at the time of the
//! drop, and from then on a clock that does not move back sees it full whether it is kept or
//! not; a clock set back after a drop would see a full bucket where the model still has a
//! partly refilled one, which is the skew `Clock` documents.

use std::collections::HashMap;
use std::mem::{align_of, size_of};
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, Waker};
use std::time::UNIX_EPOCH;

use proptest::prelude::*;

use super::shard::MIN_REBUILD_LOCKED;
use super::table::Slot;
use super::view::STORES_PER_THREAD;
use super::*;
use crate::ManualClock;
use crate::clock::deadline_ms;
use crate::store::BucketState;

const START: u64 = 1_700_000_000_000;

fn now_or_never<F: Future>(f: F) -> F::Output {
    match std::pin::pin!(f).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(out) => out,
        Poll::Pending => panic!("a MemoryStore future was not ready on its first poll"),
    }
}

#[derive(Debug, Clone)]
enum Op {
    Acquire {
        key: usize,
        cost: u32,
        max_wait_ms: u64,
    },
    Peek {
        key: usize,
    },
    Refund {
        key: usize,
        cost: u32,
    },
    Drain {
        key: usize,
        ahead_ms: u64,
    },
    Reset {
        key: usize,
    },
    Set {
        key: usize,
        tokens: u32,
    },
    Block {
        key: usize,
        ahead_ms: u64,
    },
    /// Keys `first`, `first + 1`, ... (`count` of them, wrapping), each at `cost`.
    AcquireAll {
        first: usize,
        count: usize,
        cost: u32,
        max_wait_ms: u64,
    },
    Advance(u64),
    Sweep,
}

/// Every bucket ever written, never dropped, and every halt ever set.
#[derive(Default)]
struct Model {
    states: HashMap<String, State>,
    halts: HashMap<String, f64>,
    /// Keys reset: the store may count a reset bucket until its shard next rebuilds.
    reset: std::collections::HashSet<String>,
}

impl Model {
    fn update(&mut self, key: &BucketKey, write: Option<Write>) {
        if let Some(w) = write {
            self.states.insert(key.as_str().to_owned(), w.state);
        }
    }

    fn state(&self, key: &BucketKey) -> Option<State> {
        self.states.get(key.as_str()).copied()
    }

    fn halt(&self, key: &BucketKey) -> f64 {
        self.halts.get(key.as_str()).copied().unwrap_or(0.0)
    }
}

/// Keys whose stored form (`b:` and the escaped key) is 3, 37, 38 (the longest inline), 39
/// (the shortest on the heap), 102 and 67 (hashed) bytes long.
fn keys() -> Vec<BucketKey> {
    let mut keys: Vec<BucketKey> = [1, 35, 36, 37, 100]
        .into_iter()
        .map(|n| BucketKey::new("b", "k".repeat(n)).expect("a valid key"))
        .collect();
    keys.push(BucketKey::hashed("b", "secret").expect("a valid key"));
    // Same length and same first bytes as another key, so only the last byte tells them
    // apart, inline and on the heap.
    keys.push(BucketKey::new("b", format!("{}j", "k".repeat(35))).expect("a valid key"));
    keys.push(BucketKey::new("b", format!("{}j", "k".repeat(99))).expect("a valid key"));
    keys
}

fn limits() -> Vec<Limit> {
    [
        (1, 1_000, 3),
        (5, 100, 5),
        (3, 7, 10),
        (u32::MAX, 1_000, u32::MAX),
    ]
    .into_iter()
    .map(|(tokens, ms, burst)| {
        Limit::new(tokens, Duration::from_millis(ms))
            .and_then(|l| l.with_burst(burst))
            .expect("a valid limit")
    })
    .collect()
}

fn op(keys: usize) -> impl Strategy<Value = Op> {
    let key = 0..keys;
    prop_oneof![
        6 => (key.clone(), 0u32..=11, prop_oneof![Just(0u64), 0u64..3_000])
            .prop_map(|(key, cost, max_wait_ms)| Op::Acquire { key, cost, max_wait_ms }),
        2 => key.clone().prop_map(|key| Op::Peek { key }),
        1 => (key.clone(), 0u32..=4).prop_map(|(key, cost)| Op::Refund { key, cost }),
        1 => (key.clone(), 0u64..5_000).prop_map(|(key, ahead_ms)| Op::Drain { key, ahead_ms }),
        1 => key.clone().prop_map(|key| Op::Reset { key }),
        1 => (key.clone(), 0u32..=11).prop_map(|(key, tokens)| Op::Set { key, tokens }),
        1 => (key.clone(), 0u64..5_000).prop_map(|(key, ahead_ms)| Op::Block { key, ahead_ms }),
        3 => (key, 1usize..=4, 1u32..=4, prop_oneof![Just(0u64), 0u64..3_000])
            .prop_map(|(first, count, cost, max_wait_ms)| Op::AcquireAll { first, count, cost, max_wait_ms }),
        3 => prop_oneof![Just(0u64), 0u64..50, 0u64..5_000].prop_map(Op::Advance),
        1 => Just(Op::Sweep),
    ]
}

/// Runs `ops` on a fresh store and on the model, and fails on the first answer that differs.
/// Key `i` is always used with limit `i % limits.len()`: a bucket is full, and dropped, by
/// the limit that wrote it, so a key that changed limits could rightly differ from the model.
fn run(ops: &[Op], keys: &[BucketKey], limits: &[Limit]) -> Result<(), TestCaseError> {
    let clock = ManualClock::new(START);
    let store = MemoryStore::new().with_clock(clock.clone());
    let mut model = Model::default();
    for op in ops {
        let now = clock.now_ms();
        match *op {
            Op::Acquire {
                key,
                cost,
                max_wait_ms,
            } => {
                let (key, limit) = (&keys[key], limits[key % limits.len()]);
                let got = now_or_never(store.acquire(
                    key,
                    limit,
                    cost,
                    Duration::from_millis(max_wait_ms),
                ));
                match check_cost(&limit, cost) {
                    Ok(c) => {
                        let (o, w) = bucket::evaluate(
                            &Params::of(&limit),
                            model.state(key),
                            now,
                            c,
                            max_wait_ms,
                        );
                        model.update(key, w);
                        prop_assert_eq!(got.ok(), Some(Decision::new(o, limit, cost)), "{:?}", op);
                    }
                    Err(e) => {
                        let got = got.err().map(|g| g.to_string());
                        prop_assert_eq!(got, Some(e.to_string()), "{:?}", op);
                    }
                }
            }
            Op::AcquireAll {
                first,
                count,
                cost,
                max_wait_ms,
            } => {
                let picked: Vec<usize> = (0..count.min(keys.len()))
                    .map(|i| (first + i) % keys.len())
                    .collect();
                let takes: Vec<Take<'_>> = picked
                    .iter()
                    .map(|&k| Take::new(&keys[k], limits[k % limits.len()], cost))
                    .collect();
                let got =
                    now_or_never(store.acquire_all(&takes, Duration::from_millis(max_wait_ms)));
                match check_takes(&takes) {
                    Ok(costs) => {
                        let parts: Vec<bucket::Part> = takes
                            .iter()
                            .zip(costs)
                            .map(|(t, cost)| bucket::Part {
                                p: Params::of(&t.limit()),
                                state: model.state(t.key()),
                                cost,
                            })
                            .collect();
                        let (_, decided) = bucket::evaluate_all_collected(&parts, now, max_wait_ms);
                        let expected: Vec<Decision> = decided
                            .iter()
                            .zip(&takes)
                            .map(|((o, _), t)| Decision::new(*o, t.limit(), t.cost()))
                            .collect();
                        for ((_, w), t) in decided.into_iter().zip(&takes) {
                            model.update(t.key(), w);
                        }
                        prop_assert_eq!(got.ok(), Some(expected), "{:?}", op);
                    }
                    Err(e) => {
                        let got = got.err().map(|g| g.to_string());
                        prop_assert_eq!(got, Some(e.to_string()), "{:?}", op);
                    }
                }
            }
            Op::Peek { key } => {
                let (key, limit) = (&keys[key], limits[key % limits.len()]);
                let got = now_or_never(store.peek(key, limit)).ok();
                let (p, state) = (Params::of(&limit), model.state(key));
                let o = bucket::peek(&p, state, now);
                let halt = bucket::halt(&p, state, model.halt(key), now, None);
                let expected = BucketState::new(o, limit).with_halt(halt as u64);
                prop_assert_eq!(got, Some(expected), "{:?}", op);
            }
            Op::Refund { key, cost } => {
                let (key, limit) = (&keys[key], limits[key % limits.len()]);
                // Named by a slot that is due: it goes back while the bucket is in no debt.
                let reservation =
                    Reservation::new(cost, std::time::UNIX_EPOCH + Duration::from_millis(now));
                let got = now_or_never(store.refund(key, limit, reservation));
                match check_cost(&limit, cost) {
                    Ok(c) => {
                        prop_assert!(got.is_ok(), "{:?}", op);
                        let (_, w) =
                            bucket::refund(&Params::of(&limit), model.state(key), now, c, now);
                        model.update(key, w);
                    }
                    Err(e) => {
                        let got = got.err().map(|g| g.to_string());
                        prop_assert_eq!(got, Some(e.to_string()), "{:?}", op);
                    }
                }
            }
            Op::Drain { key, ahead_ms } => {
                let (key, limit) = (&keys[key], limits[key % limits.len()]);
                let until = UNIX_EPOCH + Duration::from_millis(now + ahead_ms);
                prop_assert!(now_or_never(store.drain_until(key, limit, until)).is_ok());
                let (p, deadline) = (Params::of(&limit), deadline_ms(until));
                let halt = bucket::halt(&p, model.state(key), model.halt(key), now, Some(deadline));
                model.halts.insert(key.as_str().to_owned(), halt);
                let w = bucket::drain_until(
                    &Params::of(&limit),
                    model.state(key),
                    now,
                    deadline_ms(until),
                );
                model.update(key, Some(w));
            }
            Op::Reset { key } => {
                let key = &keys[key];
                prop_assert!(now_or_never(store.reset(key)).is_ok());
                model.states.remove(key.as_str());
                model.halts.remove(key.as_str());
                model.reset.insert(key.as_str().to_owned());
            }
            Op::Set { key, tokens } => {
                let (key, limit) = (&keys[key], limits[key % limits.len()]);
                let got = now_or_never(store.set(key, limit, tokens));
                if tokens > limit.burst() {
                    prop_assert!(
                        matches!(got, Err(StoreError::TokensAboveBurst { .. })),
                        "{:?}",
                        op
                    );
                } else {
                    prop_assert!(got.is_ok(), "{:?}", op);
                    let p = Params::of(&limit);
                    let w = bucket::set(&p, model.state(key), now, f64::from(tokens));
                    model.update(key, Some(w));
                    model.halts.remove(key.as_str());
                }
            }
            Op::Block { key, ahead_ms } => {
                let (key, limit) = (&keys[key], limits[key % limits.len()]);
                let until = UNIX_EPOCH + Duration::from_millis(now + ahead_ms);
                prop_assert!(now_or_never(store.block_until(key, limit, until)).is_ok());
                let (p, deadline) = (Params::of(&limit), deadline_ms(until));
                let halt = bucket::block_halt(&p, model.state(key), model.halt(key), now, deadline);
                model.halts.insert(key.as_str().to_owned(), halt);
                let (_, w) = bucket::block_until(&p, model.state(key), now, deadline);
                model.update(key, w);
            }
            Op::Advance(ms) => clock.advance(Duration::from_millis(ms)),
            Op::Sweep => store.sweep(),
        }
    }
    let lingering = model
        .reset
        .iter()
        .filter(|k| !model.states.contains_key(*k))
        .count();
    prop_assert!(store.len() <= model.states.len() + lingering);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256),
        ..ProptestConfig::default()
    })]

    #[test]
    fn decides_exactly_as_the_arithmetic_on_kept_buckets(
        ops in prop::collection::vec(op(8), 1..200)
    ) {
        run(&ops, &keys(), &limits())?;
    }
}

/// Thousands of keys, so that shards grow, sweep on size and on time, and shrink, with every
/// decision checked against the model.
#[test]
fn many_keys_through_growth_and_sweeps_decide_as_the_model() {
    let keys: Vec<BucketKey> = (0..3_000)
        .map(|i| BucketKey::new("many", format!("{i}-{}", "x".repeat(i % 60))))
        .collect::<Result<_, _>>()
        .expect("valid keys");
    let mut ops = Vec::new();
    for round in 0..4_u64 {
        for i in 0..keys.len() {
            ops.push(Op::Acquire {
                key: i,
                cost: 1 + (i as u32 % 3),
                max_wait_ms: (i as u64 % 4) * 500,
            });
            if i % 97 == 0 {
                ops.push(Op::Peek { key: i });
                ops.push(Op::Advance(round * 3));
            }
        }
        ops.push(Op::Advance(700 * round + 1));
    }
    if let Err(e) = run(&ops, &keys, &limits()) {
        panic!("{e}");
    }
}

/// A store of at most `max` buckets on a manual clock, and the clock.
fn bounded(max: usize) -> (MemoryStore<ManualClock>, ManualClock) {
    let clock = ManualClock::new(START);
    let max = NonZeroUsize::new(max).expect("a bound above zero");
    (MemoryStore::bounded(max).with_clock(clock.clone()), clock)
}

fn five_per_hour() -> Limit {
    Limit::per_hour(5)
        .and_then(|l| l.with_burst(5))
        .expect("a valid limit")
}

mod bound;
mod races;

/// A key compares equal to its own bytes and to no others that differ in one byte, at every
/// length on both sides of the inline bound.
#[test]
fn keys_differing_in_one_byte_are_told_apart_at_every_length() {
    for len in 1..=40 {
        let id: Vec<u8> = (0..len).map(|i| b'a' + (i % 26) as u8).collect();
        let key = key::Key::new(&id);
        assert!(key.is(&id), "{len}");
        assert!(!key.is(&id[..len - 1]), "{len}");
        for at in 0..len {
            let mut other = id.clone();
            other[at] ^= 1;
            assert!(!key.is(&other), "{len} bytes, byte {at}");
        }
    }
}

/// A kept key remembers where its bucket was found, and a hint that is wrong changes no
/// decision: one from another store (the same key objects on two stores, in turns), one from a
/// table since rebuilt (a sweep between rounds), and one planted to point at another key's
/// bucket or past the table's end. Each store admits each key exactly its burst. One shard
/// per store, so that the planted positions are other keys' buckets.
#[test]
fn a_key_s_hint_from_elsewhere_changes_no_decision() {
    let clock = ManualClock::new(START);
    let one_shard = NonZeroUsize::new(1_000).expect("not zero");
    let a = MemoryStore::bounded(one_shard).with_clock(clock.clone());
    let b = MemoryStore::bounded(one_shard).with_clock(clock.clone());
    let limit = Limit::per_minute(1)
        .and_then(|l| l.with_burst(3))
        .expect("a valid limit");
    // Fewer than a table holds in unit tests, so that every key reaches the table.
    let keys: Vec<BucketKey> = (0..30)
        .map(|i| BucketKey::new("h", format!("k{i}")).expect("a valid key"))
        .collect();
    let mut admitted = [vec![0_u32; keys.len()], vec![0_u32; keys.len()]];
    for round in 0..5_u64 {
        for (i, key) in keys.iter().enumerate() {
            match (round, i % 3) {
                // Another key's bucket in store a's table, or no bucket at all.
                (2, 0 | 1) => key.set_hint((a.inner.id << 32) | ((i as u64 * 7 + 1) % 30)),
                (2, _) => key.set_hint((a.inner.id << 32) | 0xFFFF_FFFF),
                _ => {}
            }
            for (n, store) in [&a, &b].into_iter().enumerate() {
                let d =
                    now_or_never(store.acquire(key, limit, 1, Duration::ZERO)).expect("a decision");
                admitted[n][i] += u32::from(d.is_admitted());
            }
        }
        if round == 1 {
            // Store b decided last, so every key, all in b's table by now, names b.
            assert!(
                keys.iter()
                    .all(|k| k.hint() >> 32 == b.inner.id & 0xFFFF_FFFF),
                "a key kept no hint"
            );
        }
        // New tables, and every kept key's hint now names a table since replaced.
        a.sweep();
        b.sweep();
    }
    assert_eq!(admitted, [vec![3; keys.len()], vec![3; keys.len()]]);
}
