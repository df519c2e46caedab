// Over 600 lines: one idea, the bucket script against the reference; half of it the mutants.
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

use super::{
    PLANTED_NOW, Rng, Step, Stored, check_step, connect, every_mutant_is_caught, load,
    planted_values, random_limit, traces,
};
use crate::Limit;
use crate::bucket::{self, MAX_TIME, Params, State};
use crate::store::redis::script::{CORRUPT_CODE, script};
use crate::store::redis::wire::{Args, Op};

use burstgate_testkit::redis_server;

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
                Err(e) if e.code() == Some(CORRUPT_CODE) => {}
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

#[tokio::test]
async fn lua_and_reference_agree_bit_for_bit() {
    let mut conn = connect().await;
    let lua = load(&mut conn, include_str!("../bucket.lua")).await;
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
    let key = format!("{}:v4:mutant:{{k}}", redis_server::unique_prefix());
    every_mutant_is_caught(
        &mut conn,
        (include_str!("../bucket.lua"), MUTANTS),
        async |conn, lua| planted(conn, lua, &key).await,
        async |conn, lua| corners(conn, lua, &key).await,
        &[
            ("Decisions trace", Family::Decisions),
            ("Admin trace", Family::Admin),
        ],
        async |conn, lua, family, seed| trace(conn, lua, &key, family, seed).await,
    )
    .await;
}
