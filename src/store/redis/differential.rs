//! The Lua script against the reference arithmetic, on a real Redis, bit for bit.
//!
//! Random traces (limits, times with skew, costs, reservations, refunds, drains, sets and
//! blocks) run through `bucket.rs` and through the script. After every step the two must give
//! the same answer, the same stored state to the last bit of each `f64`, the same `keep` (until
//! when the key is kept),
//! the same halt (and so the same length of the stored value, 24 bytes without one, 32 with),
//! and the same TTL, or none where the script must keep the expiry; a step that must not write
//! must leave the key untouched. The mutation test then edits single lines of the script's
//! arithmetic and stored encoding, and checks that the same traces catch every edit.

use std::fmt::Write as _;

use redis::aio::MultiplexedConnection;

use super::script::script;
use super::wire::{Args, Op, decode, decode_halt};
use crate::Limit;
use crate::bucket::{self, MAX_TIME, Params, State};

use burstgate_testkit::redis_server;

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

/// Which operations a trace draws from. The traces of the decisions are those the mutants of
/// the decisions' lines were chosen against, kept as they were; the admin traces add sets,
/// blocks and lowerings to them, from the same seeds.
#[derive(Debug, Clone, Copy)]
enum Family {
    /// Acquires, reservations, peeks, refunds and drains.
    Decisions,
    /// The same, and sets, blocks and lowerings to what an upstream reports.
    Admin,
}

/// One trace: runs `steps` random operations of `family` through the reference and through
/// `lua` (the script's source) on key `key`, and describes the first disagreement.
async fn trace(
    conn: &mut MultiplexedConnection,
    lua: &redis::Script,
    key: &str,
    family: Family,
    seed: u64,
) -> Result<(), String> {
    let mut rng = Rng(seed);
    let limit = random_limit(&mut rng);
    let p = Params::of(&limit);
    let per_token = (limit.interval_ms() / u64::from(limit.tokens())).max(1);
    // At most 2^42 + 1 by construction.
    let refill_ms = limit.refill_time().as_millis() as u64;
    let mut stored = Stored::default();
    let mut now: u64 = match rng.below(8) {
        0 => rng.below(10_000),
        1 => MAX_TIME - rng.below(1_000_000),
        2 => u64::MAX - rng.below(1000),
        _ => 1_700_000_000_000 + rng.below(10_000_000_000),
    };
    let _: () = redis::cmd("DEL")
        .arg(key)
        .query_async(conn)
        .await
        .map_err(|e| e.to_string())?;
    let steps = 1 + rng.below(40);
    let mut log = format!("{family:?} seed {seed}, limit {limit:?}\n");
    let ops = match family {
        Family::Decisions => 10,
        Family::Admin => 13,
    };
    // The slots and costs of the admissions so far, for refunds that name one.
    let mut slots: Vec<(u64, u64)> = Vec::new();
    for step in 0..steps {
        // The reference's own answers steer the trace to the edges: exact waits, one before.
        let plain = |now: u64, cost: f64| bucket::evaluate(&p, stored.state, now, cost, 0).0.wait;
        now = match rng.below(12) {
            0 => now,
            1 => now.saturating_add(1),
            2 => now.saturating_add(rng.below(limit.interval_ms() + 1)),
            3 => now.saturating_add(plain(now, 1.0)),
            4 => now.saturating_add(plain(now, 1.0).saturating_sub(1)),
            5 => now.saturating_sub(rng.below(2 * limit.interval_ms() + 2)),
            6 => now.saturating_add(rng.below(3 * refill_ms + 1)),
            7 => rng.below(u64::MAX),
            _ => now.saturating_add(rng.below(2 * per_token + 1)),
        };
        let burst = u64::from(limit.burst());
        let cost = match rng.below(4) {
            0 => burst,
            1 => 1 + rng.below(burst),
            _ => 1 + rng.below(burst.min(3)),
        };
        let cost_f = cost as f64;
        let (op, x, max_wait) = match rng.below(ops) {
            0..=3 => (Op::Acquire, cost, 0),
            4 => (Op::Peek, 0, 0),
            5 => {
                // A refund names its reservation by its slot: the last one, an earlier one (now
                // in the middle of the queue, or already due), or any time at all.
                let (slot, cost) = match rng.below(4) {
                    0 => slots.last().copied().unwrap_or((now, cost)),
                    1 => slots
                        .get(rng.below(slots.len() as u64) as usize)
                        .copied()
                        .unwrap_or((0, cost)),
                    2 => (now.saturating_add(rng.below(3 * refill_ms + 1)), cost),
                    _ => (rng.below(u64::MAX), cost),
                };
                (Op::Refund, cost, slot)
            }
            6 => {
                let until = match rng.below(3) {
                    0 => now.saturating_sub(rng.below(1000)),
                    1 => now.saturating_add(rng.below(10 * limit.interval_ms() + 1)),
                    _ => rng.below(u64::MAX),
                };
                (Op::Drain, until, 0)
            }
            10 => {
                // Empty, full, one short of either, or anything in between.
                let tokens = match rng.below(4) {
                    0 => 0,
                    1 => burst,
                    2 => rng.pick(&[1, burst.saturating_sub(1)]),
                    _ => rng.below(burst + 1),
                };
                (Op::Set, tokens, 0)
            }
            11 => {
                let until = match rng.below(5) {
                    0 => now.saturating_sub(rng.below(1000)),
                    1 => now.saturating_add(1 + rng.below(3)),
                    2 => now.saturating_add(rng.below(10 * limit.interval_ms() + 1)),
                    3 => now.saturating_add(bucket::MAX_WAIT - 1 + rng.below(3)),
                    _ => rng.below(u64::MAX),
                };
                (Op::Block, until, 0)
            }
            12 => {
                // What an upstream reports: nothing left, a report just under or over what the
                // bucket holds (the edge of lowering), above the burst, or anything.
                let held = bucket::peek(&p, stored.state, now).remaining;
                let tokens = match rng.below(5) {
                    0 => 0,
                    1 => held.saturating_sub(1),
                    2 => held + rng.below(2),
                    3 => burst + rng.below(3),
                    _ => rng.below(burst + 1),
                };
                (Op::Lower, tokens, 0)
            }
            _ => {
                let w = plain(now, cost_f);
                let max_wait = match rng.below(6) {
                    0 => w.saturating_sub(1),
                    1 => w,
                    2 => w.saturating_add(1),
                    3 => u64::MAX,
                    4 => bucket::MAX_WAIT + rng.below(3),
                    _ => rng.below(w.saturating_mul(2) + 1),
                };
                (Op::Acquire, cost, max_wait)
            }
        };
        let _ = writeln!(
            log,
            "  step {step}: {op:?} now={now} x={x} max_wait={max_wait}"
        );
        let step = Step {
            now,
            op,
            x,
            max_wait,
        };
        let outcome = check_step(conn, lua, key, limit, &mut stored, step, &log).await?;
        if matches!(op, Op::Acquire) && outcome.allowed {
            slots.push((outcome.at.saturating_add(outcome.wait), x));
        }
    }
    Ok(())
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
) -> Result<bucket::Outcome, String> {
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

/// Fixed traces at rounding corners of the refill time after a plain admission, which random
/// traces reach only now and then: an acquire of 1 from a full bucket, then one more after
/// `elapsed` ms. In the first two the first estimate of the refill time is one too low, in the
/// third one too high: the script keeps the key by the estimate, while the reset the store
/// reports walks to the exact millisecond.
const CORNERS: &[(u32, u64, u32, u64)] = &[
    // (tokens, interval in ms, burst, elapsed)
    (1, 15, 2, 8),
    (2, 792, 2, 122),
    (1, 15, 3, 10),
];

/// Runs the [`CORNERS`] through the reference and through `lua`, and describes the first
/// disagreement.
async fn corners(
    conn: &mut MultiplexedConnection,
    lua: &redis::Script,
    key: &str,
) -> Result<(), String> {
    for &(tokens, interval, burst, elapsed) in CORNERS {
        let limit = Limit::new(tokens, std::time::Duration::from_millis(interval))
            .and_then(|l| l.with_burst(burst))
            .map_err(|e| e.to_string())?;
        let _: () = redis::cmd("DEL")
            .arg(key)
            .query_async(conn)
            .await
            .map_err(|e| e.to_string())?;
        let mut stored = Stored::default();
        let mut log = format!("corner, limit {limit:?}\n");
        let start = 1_700_000_000_000;
        for now in [start, start + elapsed] {
            let _ = writeln!(log, "  acquire 1 at {now}");
            let step = Step {
                now,
                op: Op::Acquire,
                x: 1,
                max_wait: 0,
            };
            check_step(conn, lua, key, limit, &mut stored, step, &log).await?;
        }
    }
    Ok(())
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

/// Runs every operation on every [`planted_values`] through the reference and through `lua`,
/// and describes the first disagreement.
async fn planted(
    conn: &mut MultiplexedConnection,
    lua: &redis::Script,
    key: &str,
) -> Result<(), String> {
    let limit = Limit::per_second(10).map_err(|e| e.to_string())?;
    let p = Params::of(&limit);
    let now = PLANTED_NOW;
    let steps = [
        (Op::Acquire, 1, 0),
        (Op::Acquire, 2, 60_000),
        (Op::Peek, 0, 0),
        (Op::Refund, 1, 0),
        (Op::Drain, now + 5_000, 0),
        (Op::Set, 4, 0),
        (Op::Block, now + 5_000, 0),
        (Op::Block, now, 0),
        (Op::Lower, 0, 0),
        (Op::Lower, 3, 0),
    ];
    for (t, ts, keep, halt) in planted_values() {
        let mut value = [t.to_le_bytes(), ts.to_le_bytes(), keep.to_le_bytes()].concat();
        if let Some(halt) = halt {
            value.extend_from_slice(&halt.to_le_bytes());
        }
        // Any keep is safe: a write trusts it only within an interval of what it needs.
        let sound = bucket::sound(&p, State { t, ts }) && bucket::sound_halt(halt.unwrap_or(0.0));
        for (op, x, max_wait) in steps {
            let log = format!(
                "planted t={t} ts={ts} keep={keep} halt={halt:?}\n  {op:?} x={x} max_wait={max_wait}\n"
            );
            let _: () = redis::cmd("SET")
                .arg(key)
                .arg(&value[..])
                .query_async(conn)
                .await
                .map_err(|e| e.to_string())?;
            if sound {
                let mut stored = Stored {
                    state: Some(State { t, ts }),
                    keep,
                    halt: halt.unwrap_or(0.0),
                    len: value.len(),
                };
                let step = Step {
                    now,
                    op,
                    x,
                    max_wait,
                };
                check_step(conn, lua, key, limit, &mut stored, step, &log).await?;
                continue;
            }
            let args = Args {
                op,
                limit,
                x,
                max_wait,
            };
            let reply: Result<redis::Value, _> = redis::cmd("EVALSHA")
                .arg(lua.get_hash())
                .arg(1)
                .arg(key)
                .arg(&args.pack(now)[..])
                .query_async(conn)
                .await;
            match reply {
                Err(e) if e.code() == Some(super::script::CORRUPT_CODE) => {}
                other => return Err(format!("{log}  lua decided on it: {other:?}")),
            }
            let after: Option<Vec<u8>> = redis::cmd("GET")
                .arg(key)
                .query_async(conn)
                .await
                .map_err(|e| e.to_string())?;
            if after.as_deref() != Some(&value[..]) {
                return Err(format!("{log}  lua changed the refused value: {after:?}"));
            }
        }
    }
    Ok(())
}

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

#[tokio::test]
async fn lua_and_reference_agree_bit_for_bit() {
    let mut conn = connect().await;
    let lua = load(&mut conn, include_str!("bucket.lua")).await;
    assert_eq!(
        lua.get_hash(),
        script().get_hash(),
        "the store runs this same script"
    );
    let key = format!("{}:v4:diff:{{k}}", redis_server::unique_prefix());
    if let Err(e) = corners(&mut conn, &lua, &key).await {
        panic!("the Lua script and bucket.rs disagree:\n{e}");
    }
    if let Err(e) = planted(&mut conn, &lua, &key).await {
        panic!("the Lua script and bucket.rs disagree on a planted value:\n{e}");
    }
    for family in [Family::Decisions, Family::Admin] {
        for seed in 0..traces() {
            if let Err(e) = trace(&mut conn, &lua, &key, family, seed).await {
                panic!("the Lua script and bucket.rs disagree:\n{e}");
            }
        }
    }
}

/// Single-line edits of the script's arithmetic and encoding, each of which the traces must catch.
/// A few carry the line before or after, only to pick one of two identical lines.
const MUTANTS: &[(&str, &str)] = &[
    // the denial with no wait allowed
    (
        "if op == 1 and max_wait == 0 then return {stored} end",
        "if op == 1 and max_wait >= 0 then return {stored} end",
    ),
    // ready_at
    (
        "if t >= target then return ts end",
        "if t >= target then return now end",
    ),
    (
        "while n < 8 and t + e * tokens / interval < target do e = e + 1; n = n + 1 end",
        "",
    ),
    (
        "while n < 8 and t + e * tokens / interval < target do e = e + 1; n = n + 1 end",
        "while n < 8 and t + e * (tokens / interval) < target do e = e + 1; n = n + 1 end",
    ),
    (
        "while n < 8 and e > 0 and t + (e - 1) * tokens / interval >= target do e = e - 1; n = n + 1 end",
        "",
    ),
    // The arguments, the clock, the stored state and what is available now.
    (
        "local op, now, tokens, interval, capacity, x, max_wait, lead, most_debt =",
        "local op, now, interval, tokens, capacity, x, max_wait, lead, most_debt =",
    ),
    ("if now > MAX_TIME then now = MAX_TIME end", ""),
    ("if #stored == 24 then", "if #stored == 25 then"),
    (
        "t, ts, keep = struct.unpack('<ddd', stored)",
        "t, ts, keep = struct.unpack('>ddd', stored)",
    ),
    // the halt: read, kept, dropped, set by a drain, written and peeked
    ("elseif #stored == 32 then", "elseif #stored == 33 then"),
    (
        "t, ts, keep, halt = struct.unpack('<dddd', stored)",
        "t, ts, keep = struct.unpack('<ddd', stored)",
    ),
    ("    halt = 0\n    if op ~= 2 then", "    if op ~= 2 then"),
    (
        "    if not (halt + lead > (now > ts and now or ts)) then halt = 0 end",
        "",
    ),
    (
        "    if not (halt + lead > (now > ts and now or ts)) then halt = 0 end",
        "    if not (halt + lead >= (now > ts and now or ts)) then halt = 0 end",
    ),
    (
        "    if not (halt + lead > (now > ts and now or ts)) then halt = 0 end",
        "    if not (halt + lead > ts) then halt = 0 end",
    ),
    (
        "local first = ready_at(floor, ts2, 1)",
        "local first = ready_at(t2, ts2, 1)",
    ),
    (
        "local first = ready_at(floor, ts2, 1)",
        "local first = ready_at(floor, ts2, 1) + 1",
    ),
    ("if first > MAX_TIME then first = MAX_TIME end", ""),
    ("if first > halt then halt = first end", "halt = first"),
    (
        "    local stored2 = halt == 0 and struct.pack('<ddd', t2, ts2, keep)\n      or",
        "    local stored2 = halt ~= 0 and struct.pack('<ddd', t2, ts2, keep)\n      or",
    ),
    (
        "    or struct.pack('<dddd', t2, ts2, need + interval, halt)",
        "    or struct.pack('<dddd', t2, ts2, need + interval, 0)",
    ),
    (
        "  local stored2 = halt == 0 and struct.pack('<ddd', t2, ts2, keep)\n    or struct.pack('<dddd', t2, ts2, keep, halt)\n  redis.call('SET', key, stored2, 'KEEPTTL')",
        "  local stored2 = struct.pack('<ddd', t2, ts2, keep)\n  redis.call('SET', key, stored2, 'KEEPTTL')",
    ),
    (
        "  local stored2 = halt == 0 and struct.pack('<ddd', t2, ts2, keep)\n    or struct.pack('<dddd', t2, ts2, keep, halt)\n  redis.call('SET', key, stored2, 'PX'",
        "  local stored2 = struct.pack('<dddd', t2, ts2, keep, halt)\n  redis.call('SET', key, stored2, 'PX'",
    ),
    (
        "avail >= 1 and 1 or 0, next_in, left, reset, ts2, halt)",
        "avail >= 1 and 1 or 0, next_in, left, reset, ts2, 0)",
    ),
    ("if not (elapsed > 0) then elapsed = 0 end", ""),
    (
        "local avail = t + elapsed * tokens / interval",
        "local avail = t + elapsed * (tokens / interval)",
    ),
    ("if not (avail < capacity) then avail = capacity end", ""),
    ("if now > ts then ts2 = now end", "ts2 = now"),
    // acquire: the plain admission
    (
        "if op == 1 and avail >= x then",
        "if op == 1 and avail >= x - 1 then",
    ),
    ("local t2 = avail - x", "local t2 = avail"),
    (
        "local e = (capacity - t2) * interval / tokens",
        "local e = capacity * interval / tokens",
    ),
    ("local need = ts2 + e + interval", "local need = ts2 + e"),
    (
        "  if need <= keep and keep <= need + interval then\n    local",
        "  if need <= keep + interval then\n    local",
    ),
    (
        "    local stored2 = halt == 0 and struct.pack('<ddd', t2, ts2, keep)\n      or",
        "    local stored2 = halt == 0 and struct.pack('<ddd', t2, ts2, keep + 1)\n      or",
    ),
    (
        "    return stored2\n  end",
        "    return struct.pack('<ddd', t2 + 1, ts2, keep)\n  end",
    ),
    (
        "local stored2 = halt == 0 and struct.pack('<ddd', t2, ts2, need + interval)",
        "local stored2 = halt == 0 and struct.pack('<ddd', ts2, t2, need + interval)",
    ),
    (
        "string.format('%d', need + interval - ts2))",
        "string.format('%d', need + interval - now))",
    ),
    // acquire: a wait, or a denial
    ("if max_wait > MAX_WAIT then max_wait = MAX_WAIT end", ""),
    (
        "  local ready = ready_at(t, ts, x)",
        "  local ready = ready_at(t, ts2, x)",
    ),
    (
        "local over = t + (ready - ts) * tokens / interval - capacity",
        "local over = 0",
    ),
    ("if not (over > 0) then over = 0 end", ""),
    (
        "if not (wait <= max_wait) then",
        "if not (wait < max_wait) then",
    ),
    ("t2 = avail - x - over", "t2 = avail - x"),
    (
        "if avail > 0 then left = avail - avail % 1 end\n    return struct.pack('<ddddd', 0, wait,",
        "if t > 0 then left = t - t % 1 end\n    return struct.pack('<ddddd', 0, wait,",
    ),
    (
        "return struct.pack('<ddddd', 0, wait, left, ready_at(t, ts, capacity) - ts2, ts2) .. stored",
        "return struct.pack('<ddddd', 0, wait, left, ready_at(t, ts2, capacity) - ts2, ts2) .. stored",
    ),
    // peek
    (
        "if not (avail >= 1) then next_in = ready_at(t, ts, 1) - ts2 end",
        "if not (avail >= 1) then next_in = ready_at(t, ts, 1) - ts2 - 1 end",
    ),
    (
        "if not (avail >= 1) then next_in = ready_at(t, ts, 1) - ts2 end",
        "next_in = ready_at(t, ts, 1) - ts2",
    ),
    ("\n  if not (reset > 0) then reset = 0 end", ""),
    ("\n    if not (reset > 0) then reset = 0 end", ""),
    (
        "return struct.pack('<dddddd', avail >= 1 and 1 or 0, next_in, left, reset, ts2, halt)",
        "return struct.pack('<dddddd', avail > 1 and 1 or 0, next_in, left, reset, ts2, halt)",
    ),
    (
        "ready_at(t, ts, capacity) - ts2, ts2) .. stored",
        "ready_at(t, ts, capacity) - ts2, ts2)",
    ),
    // refund and drain, and the write they share with an admission after a wait
    ("if not (t2 < capacity) then t2 = capacity end", ""),
    (
        "  if not (t2 < capacity) then t2 = capacity end\n  wait = 0",
        "  if not (t2 < capacity) then t2 = capacity end\n  wait = 1",
    ),
    ("if x > MAX_TIME then x = MAX_TIME end", ""),
    ("if floor < avail then t2 = floor end", "t2 = floor"),
    ("if x > ts2 + MAX_WAIT then x = ts2 + MAX_WAIT end", ""),
    (
        "if x > ts2 then floor = -((x - ts2) * tokens / interval) end",
        "if x > ts2 then floor = -((x - now) * tokens / interval) end",
    ),
    ("local need = full + interval", "local need = full"),
    (
        "\nif need <= keep and keep <= need + interval then",
        "\nif need <= keep then",
    ),
    ("  keep = need + interval", "  keep = need"),
    (
        "  keep = need + interval\n  local stored2 = halt == 0 and struct.pack('<ddd', t2, ts2, keep)",
        "  keep = need + interval\n  local stored2 = halt == 0 and struct.pack('>ddd', t2, ts2, keep)",
    ),
    (
        "string.format('%d', keep - ts2))",
        "string.format('%d', keep - now))",
    ),
    (
        "if t2 > 0 then left = t2 - t2 % 1 end",
        "if t2 > 0 then left = t2 - t2 % 1 + 1 end",
    ),
    (
        "return struct.pack('<ddddd', 1, wait, left, full - ts2, ts2)",
        "return struct.pack('<ddddd', 1, wait, left, full - now, ts2)",
    ),
    // the time the waits count from, which names a slot
    (
        "return struct.pack('<ddddd', 1, wait, left, full - ts2, ts2)",
        "return struct.pack('<ddddd', 1, wait, left, full - ts2, now)",
    ),
    // a refund gives back only the last slot queued, or a slot due while in no debt
    (
        "    applies = tokens / interval <= 0.25 and held > -0.5 and held < x - 0.5",
        "    applies = held > -0.5 and held < x - 0.5",
    ),
    (
        "    applies = tokens / interval <= 0.25 and held > -0.5 and held < x - 0.5",
        "    applies = tokens / interval <= 0.25 and held > -0.5",
    ),
    (
        "    applies = tokens / interval <= 0.25 and held > -0.5 and held < x - 0.5",
        "    applies = tokens / interval <= 0.25 and held < x - 0.5",
    ),
    ("  if max_wait > ts2 then", "  if max_wait >= ts2 then"),
    (
        "    applies = tokens / interval <= 0.25 and held > -0.5 and held < x - 0.5",
        "    applies = tokens / interval <= 0.25 and held >= 0 and held < x - 0.5",
    ),
    ("    applies = avail >= 0", "    applies = true"),
    (
        "    local held = t + (max_wait - ts) * tokens / interval",
        "    local held = t + (max_wait - ts2) * tokens / interval",
    ),
    ("  if max_wait > MAX_TIME then max_wait = MAX_TIME end", ""),
    (
        "    return struct.pack('<ddddd', 0, 0, left, reset, ts2)",
        "    return struct.pack('<ddddd', 1, 0, left, reset, ts2)",
    ),
    // waits from the later of now and the stored time
    ("  wait = ready - ts2", "  wait = ready - now"),
    (
        "  if need <= keep and keep <= need + interval then\n    local",
        "  if need <= keep then\n    local",
    ),
    // the lead bound on a stored time
    (
        "  if ts > lead_max then\n    ts = now\n",
        "  if ts > lead_max then\n    ts = lead_max\n",
    ),
    ("    if op ~= 2 then", "    if op ~= 0 then"),
    (
        "      keep = ts + e + interval + interval",
        "      keep = ts + e + interval",
    ),
    ("      if e < 0 then e = 0 end", ""),
    (
        "  local lead_max = now + lead",
        "  local lead_max = now + lead + 1000",
    ),
    ("  if ts > lead_max then", "  if ts >= lead_max then"),
    // set: exactly x tokens from ts2, with no halt
    ("elseif op == 5 then", "elseif op == 7 then"),
    ("  t2 = x\n  halt = 0", "  t2 = avail\n  halt = 0"),
    ("  t2 = x\n  halt = 0", "  t2 = x - 1\n  halt = 0"),
    ("  t2 = x\n  halt = 0\n", "  t2 = x\n"),
    (
        "  halt = 0\n  wait = 0\nelseif op == 6 then",
        "  halt = 0\n  wait = 1\nelseif op == 6 then",
    ),
    // block: no token before the deadline, the first at it, a halt there
    ("elseif op == 6 then", "elseif op == 8 then"),
    ("  local deadline = x\n", "  local deadline = x + 1\n"),
    ("if deadline > MAX_TIME then deadline = MAX_TIME end", ""),
    (
        "if deadline > ts2 + MAX_WAIT then deadline = ts2 + MAX_WAIT end",
        "",
    ),
    (
        "if not (deadline > ts2) then",
        "if not (deadline >= ts2) then",
    ),
    ("if avail > 0 then whole_left = avail - avail % 1 end", ""),
    (
        "local to_full = ready_at(t, ts, capacity) - ts2",
        "local to_full = ready_at(t, ts2, capacity) - ts2",
    ),
    ("if not (to_full > 0) then to_full = 0 end", ""),
    (
        "return struct.pack('<ddddd', 0, 0, whole_left, to_full, ts2)",
        "return struct.pack('<ddddd', 1, 0, whole_left, to_full, ts2)",
    ),
    ("local span = deadline - ts2", "local span = deadline - now"),
    (
        "local level = 1 - (span * tokens / interval + (span - 1) * tokens / interval) / 2",
        "local level = -((span - 1) * tokens / interval)",
    ),
    (
        "local level = 1 - (span * tokens / interval + (span - 1) * tokens / interval) / 2",
        "local level = 1 - span * tokens / interval",
    ),
    (
        "local level = 1 - (span * tokens / interval + (span - 1) * tokens / interval) / 2",
        "local level = 1 - (span * tokens / interval + (span - 1) * (tokens / interval)) / 2",
    ),
    ("if level < avail then t2 = level end", "t2 = level"),
    (
        "if deadline > halt then halt = deadline end",
        "halt = deadline",
    ),
    ("if deadline > halt then halt = deadline end", ""),
    (
        "  if deadline > halt then halt = deadline end\n  wait = 0",
        "  if deadline > halt then halt = deadline end\n  wait = 1",
    ),
    // lower: down to the report when the bucket holds more, never up, the halt kept
    ("elseif op == 7 then", "elseif op == 9 then"),
    (
        "if not (x + 1 <= avail) then",
        "if not (x + 1 < avail) then",
    ),
    ("if not (x + 1 <= avail) then", "if not (x < avail) then"),
    ("if avail > 0 then held = avail - avail % 1 end", ""),
    (
        "local until_full = ready_at(t, ts, capacity) - ts2",
        "local until_full = ready_at(t, ts2, capacity) - ts2",
    ),
    ("if not (until_full > 0) then until_full = 0 end", ""),
    (
        "return struct.pack('<ddddd', 0, 0, held, until_full, ts2)",
        "return struct.pack('<ddddd', 1, 0, held, until_full, ts2)",
    ),
    (
        "  t2 = x + avail % 1\n",
        "  t2 = x + avail % 1\n  halt = 0\n",
    ),
    ("  t2 = x + avail % 1\n", "  t2 = x\n"),
    ("  t2 = x + avail % 1\n", "  t2 = x + 0.5\n"),
    (
        "  t2 = x + avail % 1\n  wait = 0",
        "  t2 = x + avail % 1\n  wait = 1",
    ),
    // the stored value's validation, caught by the planted values
    ("and ts % 1 == 0", ""),
    ("and halt % 1 == 0", ""),
    (
        "if not (halt >= 0 and halt <= MAX_TIME",
        "if not (halt <= MAX_TIME",
    ),
    ("halt >= 0 and halt <= MAX_TIME and", "halt >= 0 and"),
    ("t >= -most_debt", "t >= -2 * most_debt"),
    ("and t <= MAX_TOKENS", ""),
    ("      and ts >= 0 and ts <= MAX_TIME", "      and ts >= 0"),
];

#[tokio::test]
#[ignore = "slow tier: run by .ci/run with --ignored"]
async fn every_single_line_mutant_of_the_script_is_caught() {
    let mut conn = connect().await;
    let source = include_str!("bucket.lua");
    let key = format!("{}:v4:mutant:{{k}}", redis_server::unique_prefix());
    let mut report = String::new();
    for (from, to) in MUTANTS {
        assert_eq!(
            source.matches(from).count(),
            1,
            "mutant no longer applies: {from}"
        );
        let lua = load(&mut conn, &source.replacen(from, to, 1)).await;
        let original = load(&mut conn, source).await;
        if planted(&mut conn, &lua, &key).await.is_err() {
            let clean = planted(&mut conn, &original, &key).await;
            assert!(
                clean.is_ok(),
                "the unmutated script fails the planted values: {clean:?}"
            );
            let _ = writeln!(report, "caught by a planted value: {from:?} -> {to:?}");
            continue;
        }
        if corners(&mut conn, &lua, &key).await.is_err() {
            let clean = corners(&mut conn, &original, &key).await;
            assert!(
                clean.is_ok(),
                "the unmutated script fails the corners: {clean:?}"
            );
            let _ = writeln!(report, "caught at the corners: {from:?} -> {to:?}");
            continue;
        }
        // Both families in turn, seed by seed: a mutant of a line only one family reaches costs
        // at most twice the traces that family needs.
        let mut caught = None;
        'seeds: for seed in 0..traces() {
            for family in [Family::Decisions, Family::Admin] {
                if trace(&mut conn, &lua, &key, family, seed).await.is_err() {
                    caught = Some((family, seed));
                    break 'seeds;
                }
            }
        }
        match caught {
            Some((family, seed)) => {
                let clean = trace(&mut conn, &original, &key, family, seed).await;
                assert!(
                    clean.is_ok(),
                    "the unmutated script fails {family:?} trace {seed}: {clean:?}"
                );
                let _ = writeln!(
                    report,
                    "caught at {family:?} trace {seed:>4}: {from:?} -> {to:?}"
                );
            }
            None => panic!("no trace told the mutant apart: {from:?} -> {to:?}"),
        }
    }
    println!("{report}");
}
