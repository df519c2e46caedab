// Over 600 lines: one idea, the several-bucket script against the reference, and its mutants.
//! The several-bucket script against the reference arithmetic, on a real Redis, bit for bit.
//!
//! Random traces run over one to four buckets, each under its own limit (or all under one, so
//! that their waits tie), at times that skew, move back and jump past the lead bound. They mix
//! single-bucket operations through `bucket.lua`, which bring each bucket to the states the
//! several-bucket script must read (in debt, full, under a halt, stored ahead of the clock), with
//! calls of `acquire_all.lua` on all the buckets or some, in any order. After every call both
//! must give the same outcome for each bucket, and leave each key with the same state to the
//! last bit of each `f64`, the same `keep`, the same halt (and so the same length), and the same
//! TTL, or the expiry it had where the script must keep it; the state the reply carries for each
//! key, which the deny cache keeps, must be that same state, or none where the key holds nothing. Fixed traces add the corners random
//! ones reach only now and then (full buckets beside one in debt, equal waits, a wait of exactly
//! the most allowed), and values planted at one key of two check that a sound value is decided
//! alike and that any other, or a key of another type, refuses the whole call, naming the key,
//! with neither key changed. The mutation test then edits single lines of the script and checks
//! that the planted values, the corners or the traces catch every edit.

use std::fmt::Write as _;
use std::time::Instant;

use redis::Value;
use redis::aio::MultiplexedConnection;

use super::{
    PLANTED_NOW, Rng, Step, Stored, check_step, connect, every_mutant_is_caught, load,
    planted_values, random_limit, traces,
};
use crate::bucket::{self, MAX_TIME, MAX_WAIT, Params, Part, State, Verdict};
use crate::store::Take;
use crate::store::redis::script::{CORRUPT_CODE, script_all};
use crate::store::redis::wire::{Op, decode, decode_halt, pack_all, parse_all};
use crate::{BucketKey, Limit};

use burstgate_testkit::redis_server;

/// The most buckets a trace runs over.
const MOST_KEYS: usize = 4;

/// The TTL each key is given just before a call, in the same transaction: a key the call must
/// leave alone, or write with `KEEPTTL`, still has it after, and no TTL the script sets comes
/// near it (a sound bucket is full again, plus two intervals, within 2^46 ms).
const SENTINEL: i64 = 1 << 50;

/// One bucket of a trace: its key, its limit, what the reference says the key holds, and the
/// slots and costs of its admissions so far, for refunds that name one.
struct Bucket {
    key: String,
    limit: Limit,
    stored: Stored,
    slots: Vec<(u64, u64)>,
}

impl Bucket {
    fn new(key: &str, limit: Limit) -> Self {
        Self {
            key: key.to_owned(),
            limit,
            stored: Stored::default(),
            slots: Vec::new(),
        }
    }
}

/// The keys of a trace, `MOST_KEYS` of them under one prefix.
fn key_names(tag: &str) -> Vec<String> {
    let prefix = redis_server::unique_prefix();
    (0..MOST_KEYS)
        .map(|i| format!("{prefix}:v4:{tag}:{{k}}:{i}"))
        .collect()
}

async fn delete(conn: &mut MultiplexedConnection, names: &[String]) -> Result<(), String> {
    let _: () = redis::cmd("DEL")
        .arg(names)
        .query_async(conn)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// The reference's parts for `takes` (each a bucket, by its place in `buckets`, and its cost).
fn parts(buckets: &[Bucket], takes: &[(usize, u64)]) -> Vec<Part> {
    takes
        .iter()
        .map(|&(i, cost)| Part {
            p: Params::of(&buckets[i].limit),
            state: buckets[i].stored.state,
            cost: cost as f64,
        })
        .collect()
}

/// The request's wait for `takes` at `now`: the largest of the buckets' own.
fn request_wait(buckets: &[Bucket], takes: &[(usize, u64)], now: u64) -> u64 {
    let (_, results) = bucket::evaluate_all_collected(&parts(buckets, takes), now, 0);
    results.iter().map(|(o, _)| o.wait).max().unwrap_or(0)
}

/// Runs one call of `lua` (the several-bucket script) on the buckets of `takes`, at `now` with
/// `max_wait`, through the reference, whose view of each key it updates, and through Redis: the
/// outcomes both gave, or the first difference after `log`, the trace so far.
async fn check_all(
    conn: &mut MultiplexedConnection,
    lua: &redis::Script,
    buckets: &mut [Bucket],
    (now, takes, max_wait): (u64, &[(usize, u64)], u64),
    log: &str,
) -> Result<Vec<Verdict>, String> {
    let parts = parts(buckets, takes);
    let (allowed, results) = bucket::evaluate_all_collected(&parts, now, max_wait);
    // For each key: the TTL the call sets, if it sets one, and whether the key was there.
    let mut ttls = Vec::with_capacity(takes.len());
    for (&(i, _), (part, &(_, write))) in takes.iter().zip(parts.iter().zip(&results)) {
        let p = &part.p;
        let stored = &mut buckets[i].stored;
        let existed = stored.state.is_some();
        // The halt as the call sees it, and stores if it admits.
        let halt = bucket::halt(p, part.state, stored.halt, now, None);
        // A stored time beyond the lead bound is moved back and stored at once, even on a
        // denial, kept by the first estimate of the refill time, with no halt, as bucket.lua
        // moves it.
        let mut ttl = None;
        let now = bucket::time(now);
        let mut moved = None;
        if let Some(s) = part.state.filter(|s| s.ts > now + p.lead()) {
            let e = ((p.capacity - s.t) * p.interval / p.tokens).ceil();
            let e = if e < 0.0 { 0.0 } else { e };
            stored.keep = now + e + p.interval + p.interval;
            stored.state = Some(State { t: s.t, ts: now });
            stored.set_halt(0.0);
            ttl = Some((stored.keep - now) as i64);
            moved = stored.state;
        }
        if allowed {
            // Every key is written by bucket.lua's common tail: kept until full plus one
            // interval, its expiry kept when the stored keep covers that by no more than one
            // interval beyond, and otherwise one interval further, counted from the write.
            let w = write.ok_or_else(|| format!("{log}  the reference admitted with no write"))?;
            let need = w.full + p.interval;
            if !(need <= stored.keep && stored.keep <= need + p.interval) {
                stored.keep = need + p.interval;
                ttl = Some((stored.keep - w.at) as i64);
            }
            stored.state = Some(w.state);
            stored.set_halt(halt);
        } else if write.map(|w| w.state) != moved {
            return Err(format!(
                "{log}  the model moves {moved:?} where the reference writes {write:?}"
            ));
        }
        ttls.push((ttl, existed));
    }
    let expected: Vec<Verdict> = results.iter().map(|&(o, _)| o).collect();

    let bucket_key = BucketKey::new("b", "k").map_err(|e| e.to_string())?;
    let all: Vec<Take<'_>> = takes
        .iter()
        .map(|&(i, cost)| Take::new(&bucket_key, buckets[i].limit, cost as u32))
        .collect();
    let names: Vec<&str> = takes
        .iter()
        .map(|&(i, _)| buckets[i].key.as_str())
        .collect();
    // One transaction, so no key can expire between the script and the reads, and each TTL is
    // read at the time the script set it. The keys are made persistent after, so that the
    // single-bucket steps, which expect that, can tell a TTL they set.
    let mut pipe = redis::pipe();
    pipe.atomic();
    for name in &names {
        pipe.cmd("PEXPIRE").arg(name).arg(SENTINEL).ignore();
    }
    pipe.cmd("EVALSHA")
        .arg(lua.get_hash())
        .arg(names.len())
        .arg(&names[..])
        .arg(pack_all(&all, now, max_wait));
    for name in &names {
        pipe.cmd("GET")
            .arg(name)
            .cmd("PTTL")
            .arg(name)
            .cmd("PERSIST")
            .arg(name)
            .ignore();
    }
    let sent = Instant::now();
    let replies: Vec<Value> = pipe
        .query_async(conn)
        .await
        .map_err(|e| format!("{log}  redis: {e}"))?;
    // PEXPIRE and PTTL each read Redis's clock; no more time than the whole round trip can
    // pass between them.
    let slack = sent.elapsed().as_millis() as i64 + 1;
    let (reply, reads) = replies
        .split_first()
        .filter(|(_, reads)| reads.len() == 2 * names.len())
        .ok_or_else(|| format!("{log}  redis answered {replies:?}"))?;
    let each = parse_all(reply, &all).map_err(|e| format!("{log}  reply: {e}: {reply:?}"))?;
    let got: Vec<Verdict> = each.iter().map(|e| e.outcome).collect();
    if got != expected {
        return Err(format!(
            "{log}  outcomes: reference {expected:?}, lua {got:?}"
        ));
    }
    // The state each key holds after the call, as the reply carries it for the deny cache: the
    // reference's view of the key, to the bit, or none where it holds nothing.
    for (&(i, _), e) in takes.iter().zip(&each) {
        let held = buckets[i].stored.state;
        let same = match (held, e.state) {
            (None, None) => true,
            (Some(a), Some(b)) => {
                a.t.to_bits() == b.t.to_bits() && a.ts.to_bits() == b.ts.to_bits()
            }
            _ => false,
        };
        if !same {
            return Err(format!(
                "{log}  key {i}: state in the reply: reference {held:?}, lua {:?}",
                e.state
            ));
        }
    }
    for ((&(i, _), read), &(ttl, existed)) in takes.iter().zip(reads.chunks_exact(2)).zip(&ttls) {
        let value = match &read[0] {
            Value::BulkString(bytes) => Some(&bytes[..]),
            Value::Nil => None,
            other => return Err(format!("{log}  GET of key {i} answered {other:?}")),
        };
        let Value::Int(pttl) = read[1] else {
            return Err(format!("{log}  PTTL of key {i} answered {:?}", read[1]));
        };
        let stored = &buckets[i].stored;
        let at = format!("{log}  key {i}");
        same_value(stored, value, &at)?;
        match ttl {
            Some(ttl) if !(ttl - slack..=ttl).contains(&pttl) => {
                return Err(format!("{at}: ttl: reference {ttl}, lua {pttl}"));
            }
            None if existed && !(SENTINEL - slack..=SENTINEL).contains(&pttl) => {
                return Err(format!(
                    "{at}: the expiry must be kept, and the ttl is {pttl}"
                ));
            }
            None if !existed && pttl != -2 => {
                return Err(format!("{at}: a key that must stay missing has ttl {pttl}"));
            }
            _ => {}
        }
    }
    Ok(got)
}

/// Whether the value at a key is what the reference says it holds: the state to the bit, the
/// keep, the halt and the length; or no value when it says there is none.
fn same_value(stored: &Stored, value: Option<&[u8]>, at: &str) -> Result<(), String> {
    let Some(value) = value else {
        return match stored.state {
            None => Ok(()),
            Some(state) => Err(format!("{at}: state: reference {state:?}, lua none")),
        };
    };
    let in_redis = decode(value).ok_or_else(|| format!("{at}: unparsable state {value:?}"))?;
    let same = stored.state.is_some_and(|s| {
        s.t.to_bits() == in_redis.t.to_bits() && s.ts.to_bits() == in_redis.ts.to_bits()
    });
    if !same {
        return Err(format!(
            "{at}: state: reference {:?}, lua {in_redis:?}",
            stored.state
        ));
    }
    let keep = value
        .get(16..24)
        .and_then(|b| b.try_into().ok())
        .map(f64::from_le_bytes);
    if keep.map(f64::to_bits) != Some(stored.keep.to_bits()) {
        return Err(format!(
            "{at}: keep: reference {}, lua {keep:?}",
            stored.keep
        ));
    }
    let halt = decode_halt(value);
    if halt.map(f64::to_bits) != Some(stored.halt.to_bits()) || value.len() != stored.len {
        return Err(format!(
            "{at}: halt: reference {} in {} bytes, lua {halt:?} in {} bytes",
            stored.halt,
            stored.len,
            value.len()
        ));
    }
    Ok(())
}

/// A cost of a bucket with this burst: all of it, any, or a few tokens.
fn random_cost(rng: &mut Rng, burst: u64) -> u64 {
    match rng.below(4) {
        0 => burst,
        1 => 1 + rng.below(burst),
        _ => 1 + rng.below(burst.min(3)),
    }
}

/// One trace: random single-bucket operations through `one` (bucket.lua) and calls of `all`
/// (acquire_all.lua) over up to [`MOST_KEYS`] of `names`, through the reference and through
/// Redis; describes the first disagreement.
async fn trace(
    conn: &mut MultiplexedConnection,
    one: &redis::Script,
    all: &redis::Script,
    names: &[String],
    seed: u64,
) -> Result<(), String> {
    let mut rng = Rng(seed);
    let n = 1 + rng.below(MOST_KEYS as u64) as usize;
    // Now and then every bucket under one limit, so that waits tie.
    let shared = rng.below(4) == 0;
    let first = random_limit(&mut rng);
    let mut buckets = Vec::with_capacity(n);
    for name in &names[..n] {
        let limit = if shared || buckets.is_empty() {
            first
        } else {
            random_limit(&mut rng)
        };
        buckets.push(Bucket::new(name, limit));
    }
    let mut now: u64 = match rng.below(8) {
        0 => rng.below(10_000),
        1 => MAX_TIME - rng.below(1_000_000),
        2 => u64::MAX - rng.below(1000),
        _ => 1_700_000_000_000 + rng.below(10_000_000_000),
    };
    delete(conn, names).await?;
    let steps = 1 + rng.below(40);
    let mut log = format!("seed {seed}, limits:\n");
    for (i, b) in buckets.iter().enumerate() {
        let _ = writeln!(log, "  key {i}: {:?}", b.limit);
    }
    let everyone: Vec<(usize, u64)> = (0..n).map(|i| (i, 1)).collect();
    for step in 0..steps {
        // The reference's own answers steer the trace to the edges: exact waits, one before, the
        // lead bound of a bucket's stored time, and past it both ways.
        let k = rng.below(n as u64) as usize;
        let limit = buckets[k].limit;
        let p = Params::of(&limit);
        let state = buckets[k].stored.state;
        let interval = limit.interval_ms();
        let per_token = (interval / u64::from(limit.tokens())).max(1);
        // At most 2^42 + 1 by construction, and the lead bound one interval more.
        let refill_ms = limit.refill_time().as_millis() as u64;
        let lead = p.lead() as u64;
        let plain = |now: u64| bucket::evaluate(&p, state, now, 1.0, 0).0.wait;
        now = match rng.below(16) {
            0 => now,
            1 => now.saturating_add(1),
            2 => now.saturating_add(rng.below(interval + 1)),
            3 => now.saturating_add(plain(now)),
            4 => now.saturating_add(plain(now).saturating_sub(1)),
            5 => now.saturating_add(request_wait(&buckets, &everyone, now)),
            6 => now.saturating_add(request_wait(&buckets, &everyone, now).saturating_sub(1)),
            7 => now.saturating_sub(rng.below(2 * interval + 2)),
            8 => now.saturating_add(rng.below(3 * refill_ms + 1)),
            9 => rng.below(u64::MAX),
            10 => now.saturating_add(lead + 1 + rng.below(lead + 1)),
            11 => now.saturating_sub(lead + 1 + rng.below(lead + 1)),
            12 => match state {
                // A clock exactly the lead bound behind the stored time, or a millisecond either
                // side of it.
                Some(s) => (s.ts as u64).saturating_sub(lead + 1) + rng.below(3),
                None => now,
            },
            _ => now.saturating_add(rng.below(2 * per_token + 1)),
        };
        if rng.below(2) == 0 {
            let mut order: Vec<usize> = (0..n).collect();
            for i in (1..n).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
            if rng.below(2) == 0 {
                order.truncate(1 + rng.below(n as u64) as usize);
            }
            let takes: Vec<(usize, u64)> = order
                .into_iter()
                .map(|i| {
                    (
                        i,
                        random_cost(&mut rng, u64::from(buckets[i].limit.burst())),
                    )
                })
                .collect();
            let w = request_wait(&buckets, &takes, now);
            let max_wait = match rng.below(8) {
                0 | 1 => 0,
                2 => w.saturating_sub(1),
                3 => w,
                4 => w.saturating_add(1),
                5 => u64::MAX,
                6 => MAX_WAIT + rng.below(3),
                _ => rng.below(w.saturating_mul(2) + 1),
            };
            let _ = writeln!(
                log,
                "  step {step}: all now={now} takes={takes:?} max_wait={max_wait}"
            );
            let outcomes =
                check_all(conn, all, &mut buckets, (now, &takes, max_wait), &log).await?;
            for (&(i, cost), o) in takes.iter().zip(&outcomes) {
                if o.allowed {
                    buckets[i].slots.push((o.at.saturating_add(o.wait), cost));
                }
            }
            continue;
        }
        let i = rng.below(n as u64) as usize;
        let b = &mut buckets[i];
        let p = Params::of(&b.limit);
        let burst = u64::from(b.limit.burst());
        let cost = random_cost(&mut rng, burst);
        let (op, x, max_wait) = match rng.below(14) {
            0..=2 => (Op::Acquire, cost, 0),
            3 => (Op::Peek, 0, 0),
            4 => {
                let (slot, cost) = match rng.below(3) {
                    0 => b.slots.last().copied().unwrap_or((now, cost)),
                    1 => b
                        .slots
                        .get(rng.below(b.slots.len() as u64) as usize)
                        .copied()
                        .unwrap_or((0, cost)),
                    _ => (now.saturating_add(rng.below(3 * refill_ms + 1)), cost),
                };
                (Op::Refund, cost, slot)
            }
            // Drains, the halts' source, twice as often as the other admin steps.
            5 | 6 => {
                let until = match rng.below(3) {
                    0 => now.saturating_sub(rng.below(1000)),
                    1 => now.saturating_add(rng.below(10 * b.limit.interval_ms() + 1)),
                    _ => rng.below(u64::MAX),
                };
                (Op::Drain, until, 0)
            }
            7 => (Op::Set, rng.below(burst + 1), 0),
            8 => {
                let until = match rng.below(3) {
                    0 => now.saturating_add(1 + rng.below(3)),
                    1 => now.saturating_add(rng.below(10 * b.limit.interval_ms() + 1)),
                    _ => rng.below(u64::MAX),
                };
                (Op::Block, until, 0)
            }
            9 => {
                let held = bucket::peek(&p, b.stored.state, now).remaining;
                (Op::Lower, held.saturating_sub(rng.below(3)), 0)
            }
            _ => {
                let w = bucket::evaluate(&p, b.stored.state, now, cost as f64, 0)
                    .0
                    .wait;
                let max_wait = match rng.below(5) {
                    0 => w.saturating_sub(1),
                    1 => w,
                    2 => u64::MAX,
                    _ => rng.below(w.saturating_mul(2) + 1),
                };
                (Op::Acquire, cost, max_wait)
            }
        };
        let _ = writeln!(
            log,
            "  step {step}: key {i} {op:?} now={now} x={x} max_wait={max_wait}"
        );
        let step = Step {
            now,
            op,
            x,
            max_wait,
        };
        let outcome = check_step(conn, one, &b.key, b.limit, &mut b.stored, step, &log).await?;
        if matches!(op, Op::Acquire) && outcome.allowed {
            b.slots.push((outcome.at.saturating_add(outcome.wait), x));
        }
    }
    Ok(())
}

/// The request's greatest wait allowed in a [`Corner`] step.
#[derive(Debug, Clone, Copy)]
enum Wait {
    Ms(u64),
    /// The request's own wait then, plus this.
    Exact(i64),
}

/// One step of a [`Corner`], at this many ms after its start.
#[derive(Debug, Clone, Copy)]
enum Act {
    /// A single-bucket operation on a bucket, by its place: op, x, max_wait. The deadline x of
    /// a drain or a block is in ms after the start too.
    One(usize, Op, u64, u64),
    /// A call on these buckets with these costs.
    All(&'static [(usize, u64)], Wait),
}

/// A fixed trace at a corner random traces reach only now and then: its limits (tokens,
/// interval in ms, burst) and its steps.
type Corner = (&'static [(u32, u64, u32)], &'static [(u64, Act)]);

const LONG: u64 = 10_000_000;

const CORNERS: &[Corner] = &[
    // A bucket full for a long time (one written long ago, one never) next to one in debt: the
    // full ones lose what they would hold above capacity by the request's slot.
    (
        &[(10, 1000, 10), (1, 1000, 5), (7, 60_000, 3)],
        &[
            (0, Act::One(0, Op::Acquire, 1, 0)),
            (LONG, Act::One(1, Op::Acquire, 5, 0)),
            (LONG, Act::One(1, Op::Acquire, 3, u64::MAX)),
            (
                LONG + 1,
                Act::All(&[(0, 4), (1, 1), (2, 1)], Wait::Exact(-1)),
            ),
            (
                LONG + 1,
                Act::All(&[(0, 4), (1, 1), (2, 1)], Wait::Exact(0)),
            ),
            (LONG + 2, Act::All(&[(2, 3), (1, 2)], Wait::Exact(0))),
            (LONG + 2, Act::All(&[(1, 1), (0, 10)], Wait::Ms(u64::MAX))),
        ],
    ),
    // Equal waits on several buckets, under one limit and under the same rate.
    (
        &[(10, 1000, 10), (10, 1000, 10), (20, 2000, 10)],
        &[
            (0, Act::All(&[(0, 10), (1, 10), (2, 10)], Wait::Ms(0))),
            (1, Act::All(&[(0, 3), (1, 3), (2, 3)], Wait::Exact(-1))),
            (1, Act::All(&[(0, 3), (1, 3), (2, 3)], Wait::Exact(0))),
            (2, Act::All(&[(1, 2), (0, 2)], Wait::Exact(0))),
            (3, Act::All(&[(0, 10), (1, 10), (2, 10)], Wait::Exact(0))),
            (3, Act::All(&[(2, 1), (0, 1), (1, 1)], Wait::Exact(0))),
        ],
    ),
    // A whole burst on fresh buckets, and then a reservation of one on each: a wait of exactly
    // one token, allowed exactly.
    (
        &[(1, 15, 2), (2, 792, 2), (1, 15, 3)],
        &[
            (0, Act::All(&[(0, 2), (1, 2), (2, 3)], Wait::Ms(0))),
            (0, Act::All(&[(0, 1), (1, 1), (2, 1)], Wait::Exact(0))),
            (8, Act::All(&[(0, 1), (1, 1)], Wait::Exact(0))),
        ],
    ),
    // The rounding corners of the refill time after a plain admission (see differential.rs):
    // bucket.lua keeps the key by its first estimate, one off, and a call on several buckets
    // after it must keep or move that keep as bucket.lua would.
    (
        &[(1, 15, 2), (2, 792, 2), (1, 15, 3)],
        &[
            (0, Act::One(0, Op::Acquire, 1, 0)),
            (0, Act::One(1, Op::Acquire, 1, 0)),
            (0, Act::One(2, Op::Acquire, 1, 0)),
            (8, Act::All(&[(0, 1)], Wait::Ms(0))),
            (10, Act::All(&[(2, 1)], Wait::Ms(0))),
            (122, Act::All(&[(1, 1)], Wait::Ms(0))),
        ],
    ),
    (
        &[(1, 15, 2), (2, 792, 2), (1, 15, 3)],
        &[
            (0, Act::All(&[(0, 1), (1, 1), (2, 1)], Wait::Ms(0))),
            (8, Act::One(0, Op::Acquire, 1, 0)),
            (10, Act::One(2, Op::Acquire, 1, 0)),
            (122, Act::One(1, Op::Acquire, 1, 0)),
        ],
    ),
    // A drain's halt read, kept through calls, the last a millisecond before it is the lead
    // bound behind, and dropped at the lead bound.
    (
        &[(10, 1000, 10), (1, 100, 1)],
        &[
            (0, Act::One(0, Op::Drain, 5_000, 0)),
            (0, Act::All(&[(0, 1), (1, 1)], Wait::Exact(0))),
            (7_099, Act::All(&[(0, 1)], Wait::Ms(0))),
            (7_100, Act::All(&[(1, 1), (0, 1)], Wait::Ms(0))),
            (7_101, Act::All(&[(0, 1)], Wait::Ms(u64::MAX))),
        ],
    ),
];

/// Runs the [`CORNERS`] through the reference and through `all` (and `one` for their
/// single-bucket steps), and describes the first disagreement.
async fn corners(
    conn: &mut MultiplexedConnection,
    one: &redis::Script,
    all: &redis::Script,
    names: &[String],
) -> Result<(), String> {
    let start = 1_700_000_000_000;
    for &(limits, acts) in CORNERS {
        delete(conn, names).await?;
        let mut buckets = Vec::new();
        for (name, &(tokens, interval, burst)) in names.iter().zip(limits) {
            let limit = Limit::new(tokens, std::time::Duration::from_millis(interval))
                .and_then(|l| l.with_burst(burst))
                .map_err(|e| e.to_string())?;
            buckets.push(Bucket::new(name, limit));
        }
        let mut log = format!("corner, limits {limits:?}\n");
        for &(after, act) in acts {
            let now = start + after;
            let _ = writeln!(log, "  {act:?} at {now}");
            match act {
                Act::One(i, op, x, max_wait) => {
                    let x = match op {
                        Op::Drain | Op::Block => start + x,
                        _ => x,
                    };
                    let b = &mut buckets[i];
                    let step = Step {
                        now,
                        op,
                        x,
                        max_wait,
                    };
                    check_step(conn, one, &b.key, b.limit, &mut b.stored, step, &log).await?;
                }
                Act::All(takes, wait) => {
                    let max_wait = match wait {
                        Wait::Ms(ms) => ms,
                        Wait::Exact(by) => {
                            request_wait(&buckets, takes, now).saturating_add_signed(by)
                        }
                    };
                    check_all(conn, all, &mut buckets, (now, takes, max_wait), &log).await?;
                }
            }
        }
    }
    Ok(())
}

/// A value as a bucket script stores it: `t`, `ts`, `keep` and perhaps a halt.
fn pack((t, ts, keep, halt): (f64, f64, f64, Option<f64>)) -> Vec<u8> {
    let mut value = [t.to_le_bytes(), ts.to_le_bytes(), keep.to_le_bytes()].concat();
    if let Some(halt) = halt {
        value.extend_from_slice(&halt.to_le_bytes());
    }
    value
}

/// Runs calls on two buckets of 10 per second with a burst of 10, one of them holding one of the
/// values [`planted_values`] plants (or one of a length no script writes), the other nothing or
/// a sound value stored far ahead, which the call moves back unless it refuses: sound values
/// must be decided by both mirrors alike, the others refused, naming the key, with neither key
/// changed.
async fn planted(
    conn: &mut MultiplexedConnection,
    all: &redis::Script,
    names: &[String],
) -> Result<(), String> {
    let limit = Limit::per_second(10).map_err(|e| e.to_string())?;
    let p = Params::of(&limit);
    let now = PLANTED_NOW;
    let year = 365.0 * 86_400_000.0;
    let ahead = pack((
        5.0,
        now as f64 + 10.0 * year,
        now as f64 + 10.0 * year + 5_000.0,
        None,
    ));
    let calls: [(&[(usize, u64)], u64); 4] = [
        (&[(0, 1), (1, 1)], 0),
        (&[(1, 2), (0, 2)], 60_000),
        (&[(0, 10), (1, 1)], 0),
        (&[(1, 10), (0, 10)], u64::MAX),
    ];
    let mut values: Vec<Vec<u8>> = planted_values().into_iter().map(pack).collect();
    let mut wrong_lengths = vec![vec![0; 16], vec![0; 40]];
    values.append(&mut wrong_lengths);
    for value in values {
        // A value of the wrong length is no bucket; of the right length, it is sound or not.
        let sound = match (decode(&value), decode_halt(&value)) {
            (Some(state), Some(halt)) => Some(bucket::sound(&p, state) && bucket::sound_halt(halt)),
            _ => None,
        };
        for place in 0..2 {
            for other in [None, Some(&ahead)] {
                for &(takes, max_wait) in &calls {
                    let log = format!(
                        "planted {value:?} at key {place}, the other {other:?}\n  all \
                         takes={takes:?} max_wait={max_wait}\n"
                    );
                    let mut before = [None, None];
                    before[place] = Some(&value);
                    before[1 - place] = other;
                    let mut buckets = Vec::new();
                    for (name, v) in names.iter().zip(before) {
                        let mut b = Bucket::new(name, limit);
                        match v {
                            Some(v) => {
                                let _: () = redis::cmd("SET")
                                    .arg(name)
                                    .arg(&v[..])
                                    .query_async(conn)
                                    .await
                                    .map_err(|e| e.to_string())?;
                                let keep = v.get(16..24).and_then(|b| b.try_into().ok());
                                b.stored = Stored {
                                    state: decode(v),
                                    keep: keep.map_or(0.0, f64::from_le_bytes),
                                    halt: decode_halt(v).unwrap_or(0.0),
                                    len: v.len(),
                                };
                            }
                            None => delete(conn, std::slice::from_ref(name)).await?,
                        }
                        buckets.push(b);
                    }
                    if sound == Some(true) {
                        check_all(conn, all, &mut buckets, (now, takes, max_wait), &log).await?;
                        continue;
                    }
                    let bucket_key = BucketKey::new("b", "k").map_err(|e| e.to_string())?;
                    let all_takes: Vec<Take<'_>> = takes
                        .iter()
                        .map(|&(_, cost)| Take::new(&bucket_key, limit, cost as u32))
                        .collect();
                    let keys: Vec<&str> = takes.iter().map(|&(i, _)| names[i].as_str()).collect();
                    let reply: Result<Value, _> = redis::cmd("EVALSHA")
                        .arg(all.get_hash())
                        .arg(keys.len())
                        .arg(&keys[..])
                        .arg(pack_all(&all_takes, now, max_wait))
                        .query_async(conn)
                        .await;
                    // The error names the key by its place in the call, from 1.
                    let named = takes
                        .iter()
                        .position(|&(i, _)| i == place)
                        .map_or(0, |i| i + 1);
                    let code = if sound.is_none() {
                        "WRONGTYPE"
                    } else {
                        CORRUPT_CODE
                    };
                    match reply {
                        Err(e)
                            if e.code() == Some(code)
                                && e.to_string().contains(&format!("at key {named} ")) => {}
                        other => return Err(format!("{log}  lua decided on it: {other:?}")),
                    }
                    for (name, v) in names.iter().zip(before) {
                        let after: Option<Vec<u8>> = redis::cmd("GET")
                            .arg(name)
                            .query_async(conn)
                            .await
                            .map_err(|e| e.to_string())?;
                        if after.as_ref() != v {
                            return Err(format!(
                                "{log}  lua changed {name}: {v:?} became {after:?}"
                            ));
                        }
                    }
                }
            }
        }
    }
    another_type(conn, all, names, &ahead).await
}

/// A call on two buckets, one of whose keys holds a hash: refused as no bucket, naming the key,
/// with neither key changed.
async fn another_type(
    conn: &mut MultiplexedConnection,
    all: &redis::Script,
    names: &[String],
    ahead: &[u8],
) -> Result<(), String> {
    let limit = Limit::per_second(10).map_err(|e| e.to_string())?;
    let bucket_key = BucketKey::new("b", "k").map_err(|e| e.to_string())?;
    let takes = [
        Take::new(&bucket_key, limit, 1),
        Take::new(&bucket_key, limit, 1),
    ];
    for place in 0..2 {
        for other in [None, Some(ahead)] {
            let log = format!("a hash at key {place}, the other {other:?}\n");
            delete(conn, &names[..2]).await?;
            let _: () = redis::cmd("HSET")
                .arg(&names[place])
                .arg("f")
                .arg("v")
                .query_async(conn)
                .await
                .map_err(|e| e.to_string())?;
            if let Some(v) = other {
                let _: () = redis::cmd("SET")
                    .arg(&names[1 - place])
                    .arg(v)
                    .query_async(conn)
                    .await
                    .map_err(|e| e.to_string())?;
            }
            let reply: Result<Value, _> = redis::cmd("EVALSHA")
                .arg(all.get_hash())
                .arg(2)
                .arg(&names[..2])
                .arg(pack_all(&takes, PLANTED_NOW, 0))
                .query_async(conn)
                .await;
            match reply {
                Err(e)
                    if e.code() == Some("WRONGTYPE")
                        && e.to_string().contains(&format!("at key {} ", place + 1)) => {}
                other => return Err(format!("{log}  lua decided on it: {other:?}")),
            }
            let kind: String = redis::cmd("TYPE")
                .arg(&names[place])
                .query_async(conn)
                .await
                .map_err(|e| e.to_string())?;
            let after: Option<Vec<u8>> = redis::cmd("GET")
                .arg(&names[1 - place])
                .query_async(conn)
                .await
                .map_err(|e| e.to_string())?;
            if kind != "hash" || after.as_deref() != other {
                return Err(format!(
                    "{log}  lua changed the keys: a {kind}, and {after:?}"
                ));
            }
        }
    }
    delete(conn, &names[..2]).await
}

#[tokio::test]
async fn several_buckets_lua_and_reference_agree_bit_for_bit() {
    let mut conn = connect().await;
    let one = load(&mut conn, include_str!("../bucket.lua")).await;
    let all = load(&mut conn, include_str!("../acquire_all.lua")).await;
    assert_eq!(
        all.get_hash(),
        script_all().get_hash(),
        "the store runs this same script"
    );
    let names = key_names("diffall");
    if let Err(e) = corners(&mut conn, &one, &all, &names).await {
        panic!("acquire_all.lua and bucket.rs disagree:\n{e}");
    }
    if let Err(e) = planted(&mut conn, &all, &names).await {
        panic!("acquire_all.lua and bucket.rs disagree on a planted value:\n{e}");
    }
    for seed in 0..traces() {
        if let Err(e) = trace(&mut conn, &one, &all, &names, seed).await {
            panic!("acquire_all.lua and bucket.rs disagree:\n{e}");
        }
    }
}

/// Single-line edits of the several-bucket script, each of which the planted values, the
/// corners or the traces must catch. A few carry the line before or after, only to pick one of
/// two identical lines.
const MUTANTS_ALL: &[(&str, &str)] = &[
    // the arguments and the clock
    (
        "local n = (#ARGV[1] - 16) / 48",
        "local n = (#ARGV[1] - 16) / 48 - 1",
    ),
    ("local audits = #KEYS - n", "local audits = #KEYS"),
    (
        "local now, max_wait = struct.unpack('<dd', ARGV[1])",
        "local max_wait, now = struct.unpack('<dd', ARGV[1])",
    ),
    ("if now > MAX_TIME then now = MAX_TIME end", ""),
    ("if max_wait > MAX_WAIT then max_wait = MAX_WAIT end", ""),
    // ready_at
    (
        "  if t >= target then return ts end",
        "  if t >= target then return ts + 1 end",
    ),
    (
        "while n < 8 and t + e * tokens / interval < target do e = e + 1; n = n + 1 end",
        "",
    ),
    (
        "while n < 8 and e > 0 and t + (e - 1) * tokens / interval >= target do e = e - 1; n = n + 1 end",
        "",
    ),
    // each key's limit and cost, and what it holds
    (
        "struct.unpack('<dddddd', ARGV[1], 17 + 48 * (i - 1))",
        "struct.unpack('<dddddd', ARGV[1], 17 + 48 * (n - i))",
    ),
    (
        "  local tokens, interval, capacity, cost, lead, most_debt =",
        "  local tokens, interval, capacity, cost, most_debt, lead =",
    ),
    (
        "local t, ts, keep, halt = capacity, now, 0, 0",
        "local t, ts, keep, halt = capacity - 1, now, 0, 0",
    ),
    (
        "local stored = redis.pcall('GET', KEYS[i])",
        "local stored = redis.call('GET', KEYS[i])",
    ),
    ("if #stored == 24 then", "if #stored == 25 then"),
    (
        "t, ts, keep = struct.unpack('<ddd', stored)",
        "t, ts, keep = struct.unpack('>ddd', stored)",
    ),
    ("elseif #stored == 32 then", "elseif #stored == 33 then"),
    (
        "t, ts, keep, halt = struct.unpack('<dddd', stored)",
        "t, ts, keep = struct.unpack('<ddd', stored)",
    ),
    (
        "    else\n      return redis.error_reply('WRONGTYPE burstgate: the value at key ' .. i",
        "    else\n      return redis.error_reply('WRONGTYPE burstgate: the value at key ' .. 1",
    ),
    // the halt: checked, kept while less than the lead bound behind, written
    (
        "if not (halt >= 0 and halt <= MAX_TIME and halt % 1 == 0) then",
        "if not (halt <= MAX_TIME and halt % 1 == 0) then",
    ),
    ("halt <= MAX_TIME and halt % 1 == 0", "halt % 1 == 0"),
    (" and halt % 1 == 0) then", ") then"),
    (
        "      if not (halt + lead > (now > ts and now or ts)) then halt = 0 end",
        "",
    ),
    (
        "      if not (halt + lead > (now > ts and now or ts)) then halt = 0 end",
        "      if not (halt + lead >= (now > ts and now or ts)) then halt = 0 end",
    ),
    (
        "      if not (halt + lead > (now > ts and now or ts)) then halt = 0 end",
        "      if not (halt + lead > ts) then halt = 0 end",
    ),
    // the stored value's validation, caught by the planted values
    (
        "if not (t >= -most_debt and t <= MAX_TOKENS",
        "if not (t >= -2 * most_debt and t <= MAX_TOKENS",
    ),
    (" and t <= MAX_TOKENS", ""),
    ("ts >= 0 and ts <= MAX_TIME", "ts <= MAX_TIME"),
    ("and ts <= MAX_TIME and ts % 1 == 0", "and ts % 1 == 0"),
    (" and ts % 1 == 0) then", ") then"),
    (
        "ts % 1 == 0) then\n      return redis.error_reply('BURSTGATE_CORRUPT burstgate: the value at key ' .. i",
        "ts % 1 == 0) then\n      return redis.error_reply('BURSTGATE_CORRUPT burstgate: the value at key ' .. 1",
    ),
    // the lead bound on a stored time
    (
        "    if ts > now + lead then",
        "    if ts >= now + lead then",
    ),
    ("      ts = now\n", "      ts = now - 1\n"),
    ("      halt = 0\n      moved = true", "      moved = true"),
    ("      moved = true", "      moved = false"),
    // what is available now, and each key's own wait
    ("if not (elapsed > 0) then elapsed = 0 end", ""),
    (
        "local avail = t + elapsed * tokens / interval",
        "local avail = t + elapsed * (tokens / interval)",
    ),
    ("if not (avail < capacity) then avail = capacity end", ""),
    ("if now > ts then ts2 = now end", "ts2 = now"),
    (
        "if not (avail >= cost) then wait = ready_at(t, ts, cost, tokens, interval) - ts2 end",
        "if not (avail > cost) then wait = ready_at(t, ts, cost, tokens, interval) - ts2 end",
    ),
    (
        "if not (avail >= cost) then wait = ready_at(t, ts, cost, tokens, interval) - ts2 end",
        "if not (avail >= cost) then wait = ready_at(t, ts2, cost, tokens, interval) - ts2 end",
    ),
    ("cost = cost, t = t,", "cost = 1, t = t,"),
    // the moved time, stored at once
    ("  if k.moved then", "  if not k.moved then"),
    ("    if whole < e then e = whole + 1 end", ""),
    ("    if e < 0 then e = 0 end", ""),
    (
        "k.keep = k.ts + e + k.interval + k.interval",
        "k.keep = k.ts + e + k.interval",
    ),
    (
        "redis.call('SET', KEYS[i], struct.pack('<ddd', k.t, k.ts, k.keep), 'PX',",
        "redis.call('SET', KEYS[1], struct.pack('<ddd', k.t, k.ts, k.keep), 'PX',",
    ),
    (
        "struct.pack('<ddd', k.t, k.ts, k.keep)",
        "struct.pack('<dddd', k.t, k.ts, k.keep, k.halt)",
    ),
    (
        "string.format('%d', k.keep - k.ts))",
        "string.format('%d', k.keep - k.ts - k.interval))",
    ),
    // the request's wait, and the denial; `>=` for `>` in the fold is left out, as it changes
    // nothing: equal waits are the same number (a wait is 0 or positive, never -0), and no
    // line asks which key's stood
    (
        "  if b[i].wait > request_wait then request_wait = b[i].wait end",
        "  if b[i].wait > request_wait then request_wait = b[1].wait end",
    ),
    (
        "  if b[i].wait > request_wait then request_wait = b[i].wait end",
        "  if b[i].wait < request_wait then request_wait = b[i].wait end",
    ),
    (
        "local request_wait = 0\nfor i = 1, n do",
        "local request_wait = 0\nfor i = 1, n - 1 do",
    ),
    (
        "if not (request_wait <= max_wait) then",
        "if not (request_wait < max_wait) then",
    ),
    (
        "    local left = 0\n    if k.avail > 0",
        "    local left = 1\n    if k.avail > 0",
    ),
    (
        "if k.avail > 0 then left = k.avail - k.avail % 1 end",
        "left = k.avail - k.avail % 1",
    ),
    (
        "if k.avail > 0 then left = k.avail - k.avail % 1 end",
        "if k.t > 0 then left = k.t - k.t % 1 end",
    ),
    (
        "local reset = ready_at(k.t, k.ts, k.capacity, k.tokens, k.interval) - k.ts2",
        "local reset = ready_at(k.t, k.ts2, k.capacity, k.tokens, k.interval) - k.ts2",
    ),
    ("    if not (reset > 0) then reset = 0 end", ""),
    (
        "reply[i] = struct.pack('<ddddddd', 0, k.wait, left, reset, k.ts2, k.t, k.held)",
        "reply[i] = struct.pack('<ddddddd', 0, request_wait, left, reset, k.ts2, k.t, k.held)",
    ),
    (
        "reply[i] = struct.pack('<ddddddd', 0, k.wait, left, reset, k.ts2, k.t, k.held)",
        "reply[i] = struct.pack('<ddddddd', 0, k.wait, left, reset, now, k.t, k.held)",
    ),
    // the state a denial carries for the deny cache: what each key holds, none for no value
    (
        "reply[i] = struct.pack('<ddddddd', 0, k.wait, left, reset, k.ts2, k.t, k.held)",
        "reply[i] = struct.pack('<ddddddd', 0, k.wait, left, reset, k.ts2, k.avail, k.held)",
    ),
    (
        "reply[i] = struct.pack('<ddddddd', 0, k.wait, left, reset, k.ts2, k.t, k.held)",
        "reply[i] = struct.pack('<ddddddd', 0, k.wait, left, reset, k.ts2, k.t, k.ts2)",
    ),
    (
        "reply[i] = struct.pack('<ddddddd', 0, k.wait, left, reset, k.ts2, k.t, k.held)",
        "reply[i] = struct.pack('<ddddddd', 0, k.wait, left, reset, k.ts2, k.t, k.ts)",
    ),
    ("    held = stored and ts or -1}", "    held = ts}"),
    (
        "    held = stored and ts or -1}",
        "    held = stored and now or -1}",
    ),
    ("  return table.concat(reply)\nend", "end"),
    // the admission: each key debited as at the request's slot
    (
        "local tokens, interval, capacity = k.tokens, k.interval, k.capacity",
        "local tokens, interval, capacity = k.interval, k.tokens, k.capacity",
    ),
    ("  if request_wait == 0 then", "  if request_wait >= 0 then"),
    (
        "  elseif k.wait == request_wait then",
        "  elseif false then",
    ),
    (
        "over = k.t + (k.ts2 + k.wait - k.ts) * tokens / interval - capacity",
        "over = 0",
    ),
    (
        "over = k.avail + request_wait * tokens / interval - capacity",
        "over = 0",
    ),
    (
        "over = k.avail + request_wait * tokens / interval - capacity",
        "over = k.t + (k.ts2 + request_wait - k.ts) * tokens / interval - capacity",
    ),
    ("  if not (over > 0) then over = 0 end", ""),
    (
        "local t2 = k.avail - k.cost - over",
        "local t2 = k.avail - k.cost",
    ),
    ("local ts2 = k.ts2", "local ts2 = now"),
    // the admission's write, by bucket.lua's common tail
    (
        "local full = ready_at(t2, ts2, capacity, tokens, interval)",
        "local full = ready_at(t2, ts2, capacity, tokens, interval) + 1",
    ),
    ("local need = full + interval", "local need = full"),
    ("local keep = k.keep", "local keep = 0"),
    (
        "local kept = need <= keep and keep <= need + interval",
        "local kept = need <= keep",
    ),
    (
        "local kept = need <= keep and keep <= need + interval",
        "local kept = keep <= need + interval",
    ),
    (
        "if not kept then keep = need + interval end",
        "keep = need + interval",
    ),
    (
        "local stored2 = k.halt == 0 and struct.pack('<ddd', t2, ts2, keep)",
        "local stored2 = k.halt ~= 0 and struct.pack('<ddd', t2, ts2, keep)",
    ),
    (
        "or struct.pack('<dddd', t2, ts2, keep, k.halt)",
        "or struct.pack('<dddd', t2, ts2, keep, 0)",
    ),
    ("  if kept then", "  if not kept then"),
    (
        "redis.call('SET', KEYS[i], stored2, 'KEEPTTL')",
        "redis.call('SET', KEYS[i], stored2)",
    ),
    (
        "string.format('%d', keep - ts2))",
        "string.format('%d', keep - now))",
    ),
    // the admission's reply
    (
        "if t2 > 0 then left = t2 - t2 % 1 end",
        "left = t2 - t2 % 1",
    ),
    (
        "reply[i] = struct.pack('<ddddddd', 1, request_wait, left, full - ts2, ts2, t2, ts2)",
        "reply[i] = struct.pack('<ddddddd', 1, k.wait, left, full - ts2, ts2, t2, ts2)",
    ),
    (
        "reply[i] = struct.pack('<ddddddd', 1, request_wait, left, full - ts2, ts2, t2, ts2)",
        "reply[i] = struct.pack('<ddddddd', 1, request_wait, left, full - now, ts2, t2, ts2)",
    ),
    (
        "reply[i] = struct.pack('<ddddddd', 1, request_wait, left, full - ts2, ts2, t2, ts2)",
        "reply[i] = struct.pack('<ddddddd', 1, request_wait, left, full - ts2, now, t2, ts2)",
    ),
    // the state an admission carries: what each key was left holding
    (
        "reply[i] = struct.pack('<ddddddd', 1, request_wait, left, full - ts2, ts2, t2, ts2)",
        "reply[i] = struct.pack('<ddddddd', 1, request_wait, left, full - ts2, ts2, k.avail, ts2)",
    ),
    (
        "reply[i] = struct.pack('<ddddddd', 1, request_wait, left, full - ts2, ts2, t2, ts2)",
        "reply[i] = struct.pack('<ddddddd', 1, request_wait, left, full - ts2, ts2, t2, now)",
    ),
    ("\nreturn table.concat(reply)", "\nreturn reply[1]"),
];

#[tokio::test]
#[ignore = "slow tier: run by .ci/run with --ignored"]
async fn every_single_line_mutant_of_the_several_bucket_script_is_caught() {
    let mut conn = connect().await;
    let one = load(&mut conn, include_str!("../bucket.lua")).await;
    let names = key_names("mutantall");
    every_mutant_is_caught(
        &mut conn,
        (include_str!("../acquire_all.lua"), MUTANTS_ALL),
        async |conn, lua| planted(conn, lua, &names).await,
        async |conn, lua| corners(conn, &one, lua, &names).await,
        &[("trace", ())],
        async |conn, lua, (), seed| trace(conn, &one, lua, &names, seed).await,
    )
    .await;
}
