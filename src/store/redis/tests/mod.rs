//! The Lua scripts against the reference arithmetic, on a real Redis: what the differential
//! tests of both scripts share, and the runner of their mutation tests.
//!
//! - `differential.rs`: the single-bucket script, `bucket.lua`, and its mutants;
//! - `differential_all.rs`: the several-bucket script, `acquire_all.lua`, and its mutants.
//!
//! Here: a seedable generator and random limits, one single-bucket step checked against the
//! reference (the outcome, the stored state, `keep`, the halt and the TTL), the values planted
//! at a key, the connection to the test Redis, and the mutant runner: each single-line edit of
//! a script must be told apart from the script by the planted values, the corners or a trace.

use std::fmt::Write as _;

use redis::aio::MultiplexedConnection;

use super::wire::{Args, Op, decode, decode_halt};
use crate::Limit;
use crate::bucket::{self, MAX_TIME, Params, State};

use burstgate_testkit::redis_server;

mod differential;
mod differential_all;
mod differential_lease;

pub(super) async fn connect() -> MultiplexedConnection {
    let url = redis_server::url();
    let client = redis::Client::open(url.as_str()).expect("a valid Redis URL");
    client
        .get_multiplexed_async_connection()
        .await
        .expect("a connection to the test Redis")
}

pub(super) async fn load(conn: &mut MultiplexedConnection, source: &str) -> redis::Script {
    let lua = redis::Script::new(source);
    let _: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(source)
        .query_async(conn)
        .await
        .expect("the script loads");
    lua
}

pub(super) fn traces() -> u64 {
    std::env::var("BURSTGATE_DIFF_TRACES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000)
}

/// SplitMix64: tiny, seedable, and the same everywhere, so a failing seed replays exactly.
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub(super) fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }

    pub(super) fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }
}

pub(super) fn random_limit(rng: &mut Rng) -> Limit {
    loop {
        let tokens = match rng.below(4) {
            0 => rng.pick(&[1, 2, 3, 7, 10, 100, 1000]),
            1 => 1,
            2 => 1 + rng.below(50) as u32,
            _ => {
                let r = 1 + rng.below(1 << 20) as u32;
                rng.pick(&[u32::MAX, 999_983, r])
            }
        };
        let interval = match rng.below(4) {
            0 => rng.pick(&[1, 3, 7, 1000, 60_000, 3_600_000, 86_400_000]),
            1 => 1 + rng.below(10_000),
            2 => 1 + rng.below(10_000_000),
            _ => rng.pick(&[1 << 42, 1_000_003, 333]),
        };
        let burst = match rng.below(4) {
            0 => rng.pick(&[1, 2, 3, 5, 10, 100]),
            1 => tokens,
            2 => 1 + rng.below(1000) as u32,
            _ => {
                let r = 1 + rng.below(u64::from(u32::MAX)) as u32;
                rng.pick(&[u32::MAX, 1 << 20, r])
            }
        };
        let limit = Limit::new(tokens, std::time::Duration::from_millis(interval))
            .and_then(|l| l.with_burst(burst));
        if let Ok(limit) = limit {
            return limit;
        }
    }
}

/// What the reference says the key holds: the bucket's state, until when the script keeps the
/// key (0 while there is no key), the halt (0 for none), and the value's length (24 bytes, or
/// 32 with a halt; a value planted with a halt of 0 keeps its 32 until a write).
#[derive(Default)]
pub(super) struct Stored {
    pub(super) state: Option<State>,
    pub(super) keep: f64,
    pub(super) halt: f64,
    pub(super) len: usize,
}

impl Stored {
    pub(super) fn set_halt(&mut self, halt: f64) {
        self.halt = halt;
        self.len = if halt == 0.0 { 24 } else { 32 };
    }
}

/// One operation of a trace, at `now`: x is the cost for acquire and refund, the deadline for
/// drain and block, the tokens for set; `max_wait` is the reservation's slot for a refund.
#[derive(Clone, Copy)]
pub(super) struct Step {
    pub(super) now: u64,
    pub(super) op: Op,
    pub(super) x: u64,
    pub(super) max_wait: u64,
}

/// Runs one step through the reference, whose view of the key `stored` it updates, and through
/// `lua` on `key`: the outcome both gave, or the first difference after `log`, the trace so far.
pub(super) async fn check_step(
    conn: &mut MultiplexedConnection,
    lua: &redis::Script,
    key: &str,
    limit: Limit,
    stored: &mut Stored,
    Step {
        now,
        op,
        x,
        max_wait,
    }: Step,
    log: &str,
) -> Result<bucket::Verdict, String> {
    let p = Params::of(&limit);
    let state = stored.state;
    // The halt the call sees, and stores if it writes: a set stores none.
    let halt = match op {
        Op::Drain => bucket::halt(&p, state, stored.halt, now, Some(x)),
        Op::Block => bucket::block_halt(&p, state, stored.halt, now, x),
        Op::Set => 0.0,
        Op::Acquire | Op::Peek | Op::Refund | Op::Lower => {
            bucket::halt(&p, state, stored.halt, now, None)
        }
    };
    // A stored time beyond the lead bound is moved back and stored at once by every operation
    // but peek, kept by the first estimate of the refill time, with no halt.
    let mut ttl = None;
    let lead_max = bucket::time(now) + p.lead();
    if let Some(s) = state.filter(|s| s.ts > lead_max && !matches!(op, Op::Peek)) {
        let e = ((p.capacity - s.t) * p.interval / p.tokens).ceil();
        let e = if e < 0.0 { 0.0 } else { e };
        let now = bucket::time(now);
        stored.keep = now + e + p.interval + p.interval;
        stored.state = Some(State { t: s.t, ts: now });
        stored.set_halt(0.0);
        ttl = Some((stored.keep - now) as i64);
    }
    let (expected, write) = match op {
        Op::Acquire => bucket::evaluate(&p, state, now, x as f64, max_wait),
        Op::Peek => (bucket::peek(&p, state, now), None),
        Op::Refund => bucket::refund(&p, state, now, x as f64, max_wait),
        Op::Drain => {
            let w = bucket::drain_until(&p, state, now, x);
            (w.outcome(), Some(w))
        }
        Op::Set => {
            let w = bucket::set(&p, state, now, x as f64);
            (w.outcome(), Some(w))
        }
        Op::Block => bucket::block_until(&p, state, now, x),
        Op::Lower => bucket::lower(&p, state, now, x as f64),
    };
    // The TTL the script sets, if it sets one: it keeps the key until full plus one interval,
    // with the first estimate of the refill time after a plain admission, as the script
    // computes it; when the stored keep already covers that, and by no more than one interval
    // beyond, it leaves the expiry alone. The TTL counts from the time of the write.
    let plain = matches!(op, Op::Acquire) && expected.allowed && expected.wait == 0;
    // A denial, a refund that gives nothing back, a block whose deadline is not ahead and a lowering
    // that lowers nothing write only the moved stored time, modelled above.
    let denial =
        matches!(op, Op::Acquire | Op::Refund | Op::Block | Op::Lower) && !expected.allowed;
    if let Some(w) = write.filter(|_| !denial) {
        let need = if plain {
            let e = ((p.capacity - w.state.t) * p.interval / p.tokens).ceil();
            w.state.ts + e + p.interval
        } else {
            w.full + p.interval
        };
        if !(need <= stored.keep && stored.keep <= need + p.interval) {
            stored.keep = need + p.interval;
            ttl = Some((stored.keep - w.at) as i64);
        }
        stored.state = Some(w.state);
        stored.set_halt(halt);
    }
    let state = stored.state;
    let args = Args {
        op,
        limit,
        x,
        max_wait,
    };
    // One transaction, so the key cannot expire between the script and the reads, and the
    // TTL is read at the time the script set it.
    let mut pipe = redis::pipe();
    pipe.atomic()
        .cmd("EVALSHA")
        .arg(lua.get_hash())
        .arg(1)
        .arg(key)
        .arg(&args.pack(now)[..])
        .cmd("GET")
        .arg(key)
        .cmd("PTTL")
        .arg(key)
        .cmd("PERSIST")
        .arg(key);
    type Reply = (redis::Value, Option<Vec<u8>>, i64, i64);
    let sent = std::time::Instant::now();
    let (reply, value, pttl, _): Reply = pipe
        .query_async(conn)
        .await
        .map_err(|e| format!("{log}  redis: {e}"))?;
    // PEXPIRE and PTTL each read Redis's clock; no more time than the whole round trip can
    // pass between them.
    let slack = sent.elapsed().as_millis() as i64 + 1;
    let reply =
        super::wire::parse_reply(&reply, &args, now).map_err(|e| format!("{log}  reply: {e}"))?;
    let got = reply.outcome;
    if got != expected {
        return Err(format!(
            "{log}  outcome: reference {expected:?}, lua {got:?}"
        ));
    }
    let in_redis = match value.as_deref().map(decode) {
        None => None,
        Some(Some(state)) => Some(state),
        Some(None) => return Err(format!("{log}  unparsable state {value:?}")),
    };
    let keep = value
        .as_deref()
        .and_then(|v| v.get(16..24))
        .and_then(|b| b.try_into().ok())
        .map(f64::from_le_bytes);
    if in_redis.is_some() && keep.map(f64::to_bits) != Some(stored.keep.to_bits()) {
        return Err(format!(
            "{log}  keep: reference {}, lua {keep:?}",
            stored.keep
        ));
    }
    let same = |a: Option<State>, b: Option<State>| match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => a.t.to_bits() == b.t.to_bits() && a.ts.to_bits() == b.ts.to_bits(),
        _ => false,
    };
    if !same(state, in_redis) {
        return Err(format!(
            "{log}  state: reference {state:?}, lua {in_redis:?}"
        ));
    }
    let in_redis_halt = value.as_deref().and_then(decode_halt);
    let len = value.as_deref().map_or(0, <[u8]>::len);
    if in_redis.is_some()
        && (in_redis_halt.map(f64::to_bits) != Some(stored.halt.to_bits()) || len != stored.len)
    {
        return Err(format!(
            "{log}  halt: reference {} in {} bytes, lua {in_redis_halt:?} in {len} bytes",
            stored.halt, stored.len
        ));
    }
    let peeked = if matches!(op, Op::Peek) {
        halt as u64
    } else {
        0
    };
    if reply.halt != peeked {
        return Err(format!(
            "{log}  peeked halt: reference {peeked}, lua {}",
            reply.halt
        ));
    }
    // A denial carries the state it denied on (nothing was written, so it is the state now),
    // and an admission with no wait the state it stored; nothing else carries one.
    let denied = matches!(op, Op::Acquire) && !got.allowed;
    let carried = if denied || plain { state } else { None };
    if !same(carried, reply.state) {
        return Err(format!(
            "{log}  carried state: reference {carried:?}, lua {:?}",
            reply.state
        ));
    }
    match ttl {
        Some(ttl) if !(ttl - slack..=ttl).contains(&pttl) => {
            return Err(format!("{log}  ttl: reference {ttl}, lua {pttl}"));
        }
        // Every earlier write was made persistent: a TTL now means this step set one.
        None if pttl >= 0 => {
            return Err(format!(
                "{log}  a step that must keep the expiry set a ttl of {pttl}"
            ));
        }
        _ => {}
    }
    Ok(got)
}

/// Values someone else planted at a bucket's key, sound and not, for a limit of 10 per second
/// with a burst of 10 at [`PLANTED_NOW`]: each operation must be refused by both mirrors, with
/// the key left alone, or decided by both alike.
pub(super) const PLANTED_NOW: u64 = 1_700_000_000_000;

pub(super) fn planted_values() -> Vec<(f64, f64, f64, Option<f64>)> {
    let now = PLANTED_NOW as f64;
    let year = 365.0 * 86_400_000.0;
    // 2 * 2^44 * 10 / 1000 + 10: more debt than this no reservation or drain leaves.
    let most_debt = 2.0 * bucket::MAX_WAIT as f64 * 10.0 / 1000.0 + 10.0;
    // 10 per second, burst 10: one second to refill, so a halt is kept until 2 s behind.
    let lead = 2_000.0;
    let mut halted = vec![
        // sound: a halt ahead, one just inside the lead bound and one just out of it, none (a
        // zero, in 32 bytes), one on a clock ten years ahead, the latest time
        (-10.0, now, now + 10_000.0, Some(now + 1_000.0)),
        (5.0, now - 100.0, now + 5_000.0, Some(now - lead + 1.0)),
        (5.0, now - 100.0, now + 5_000.0, Some(now - lead)),
        (5.0, now - 100.0, now + 5_000.0, Some(0.0)),
        (
            9.0,
            now + 10.0 * year,
            now + 10.0 * year + 3_000.0,
            Some(now + 10.0 * year + 500.0),
        ),
        (-10.0, now, now + 10_000.0, Some(MAX_TIME as f64)),
        // not sound
        (5.0, now, now + 5_000.0, Some(-1.0)),
        (5.0, now, now + 5_000.0, Some(now + 0.5)),
        (5.0, now, now + 5_000.0, Some(f64::NAN)),
        (5.0, now, now + 5_000.0, Some(MAX_TIME as f64 + 1.0)),
    ];
    let mut values: Vec<_> = vec![
        // sound: part full, in debt, a writer ten years ahead, one in 1970, the largest debt
        (5.0, now - 100.0, now + 5_000.0),
        (-10.0, now, now + 10_000.0),
        (9.0, now + 10.0 * year, now + 10.0 * year + 3_000.0),
        (0.0, 0.0, 3_000.0),
        // far ahead, and fuller than this limit's burst (written under a larger one)
        (1e6, now + 10.0 * year, now + 10.0 * year + 3_000.0),
        (-most_debt, now, now + 1e12),
        // not sound
        (-1e13, now, now + 1_000.0),
        (-1.5 * most_debt, now, now + 1_000.0),
        (f64::NAN, now, now + 1_000.0),
        (f64::INFINITY, now, now + 1_000.0),
        (5e9, now, now + 1_000.0),
        (1.0, -1.0, now + 1_000.0),
        (1.0, now + 0.5, now + 1_000.0),
        (1.0, 9_007_199_254_740_992.0, now + 1_000.0),
        (1.0, f64::NAN, now + 1_000.0),
        (1.0, now, f64::NAN),
        (1.0, now, -1.0),
        (1.0, now, 36_028_797_018_963_968.0),
    ]
    .into_iter()
    .map(|(t, ts, keep)| (t, ts, keep, None))
    .collect();
    values.append(&mut halted);
    values
}

/// A check of a script loaded in Redis: the first disagreement with the reference.
type Check = Result<(), String>;

/// Edits `source` by each of `mutants` in turn, and asserts that the `planted` values, the
/// `corners` or a `trace` catch the edit, and that the unmutated script passes what caught it.
/// The traces go seed by seed, each of the `kinds` (named for the report) in turn: a mutant of a
/// line only one kind reaches costs at most as many traces of the others. Prints what caught
/// each mutant.
pub(super) async fn every_mutant_is_caught<K: Copy>(
    conn: &mut MultiplexedConnection,
    (source, mutants): (&str, &[(&str, &str)]),
    planted: impl AsyncFn(&mut MultiplexedConnection, &redis::Script) -> Check,
    corners: impl AsyncFn(&mut MultiplexedConnection, &redis::Script) -> Check,
    kinds: &[(&str, K)],
    trace: impl AsyncFn(&mut MultiplexedConnection, &redis::Script, K, u64) -> Check,
) {
    let original = load(conn, source).await;
    let mut report = String::new();
    for (from, to) in mutants {
        assert_eq!(
            source.matches(from).count(),
            1,
            "mutant no longer applies: {from}"
        );
        let lua = load(conn, &source.replacen(from, to, 1)).await;
        if planted(conn, &lua).await.is_err() {
            let clean = planted(conn, &original).await;
            assert!(
                clean.is_ok(),
                "the unmutated script fails the planted values: {clean:?}"
            );
            let _ = writeln!(report, "caught by a planted value: {from:?} -> {to:?}");
            continue;
        }
        if corners(conn, &lua).await.is_err() {
            let clean = corners(conn, &original).await;
            assert!(
                clean.is_ok(),
                "the unmutated script fails the corners: {clean:?}"
            );
            let _ = writeln!(report, "caught at the corners: {from:?} -> {to:?}");
            continue;
        }
        let mut caught = None;
        'seeds: for seed in 0..traces() {
            for &(name, kind) in kinds {
                if trace(conn, &lua, kind, seed).await.is_err() {
                    caught = Some((name, kind, seed));
                    break 'seeds;
                }
            }
        }
        match caught {
            Some((name, kind, seed)) => {
                let clean = trace(conn, &original, kind, seed).await;
                assert!(
                    clean.is_ok(),
                    "the unmutated script fails {name} {seed}: {clean:?}"
                );
                let _ = writeln!(report, "caught at {name} {seed:>4}: {from:?} -> {to:?}");
            }
            None => panic!("no trace told the mutant apart: {from:?} -> {to:?}"),
        }
    }
    println!("{report}");
}
