//! The lease script against the reference arithmetic (`bucket/lease.rs`), on a real Redis, bit
//! for bit.
//!
//! Random traces of several holders on one bucket: renewals that take, keep, give back and ask
//! for more, tokens spent by the holders between them, time that jumps past the leases' ends (so
//! that they expire) and back, and plain acquires of the bucket script while no lease is out.
//! After every step the two must give the same answer, the same stored state and leases to the
//! last bit, the same `keep` and TTL; and the stored value must keep the rule that makes leases
//! exact: what the bucket holds and what is out on lease are at most the burst. Values someone
//! else planted are refused by both, or decided by both alike. The mutation test then edits
//! single lines of the script, and checks that the same traces catch every edit.

use std::fmt::Write as _;

use redis::aio::MultiplexedConnection;

use super::{Rng, connect, every_mutant_is_caught, load, random_limit, traces};
use crate::Limit;
use crate::bucket::lease::{self, Ask, Lease, MAX_LEASES};
use crate::bucket::{self, MAX_TIME, Params, State};
use crate::store::redis::script::{CORRUPT_CODE, LEASE_SOURCE, script, script_lease};
use crate::store::redis::wire::{Args, LeaseArgs, LeaseOp, Op, decode, decode_leased};

use burstgate_testkit::redis_server;

/// What the reference says the key holds.
#[derive(Default, Clone)]
struct Model {
    state: Option<State>,
    leases: Vec<Lease>,
}

/// One renewal through the reference and through `lua`: the first difference, after `log`.
#[allow(clippy::too_many_arguments)]
async fn renew_step(
    conn: &mut MultiplexedConnection,
    lua: &redis::Script,
    key: &str,
    limit: Limit,
    model: &mut Model,
    now: u64,
    ask: Ask,
    log: &str,
) -> Result<lease::Renewal, String> {
    let p = Params::of(&limit);
    let (expected, stored) = lease::renew(&p, model.state, &model.leases, now, ask);
    let args = LeaseArgs {
        op: LeaseOp::Renew,
        limit,
        ask,
    };
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
    let sent = std::time::Instant::now();
    let (reply, value, pttl, _): (Vec<u8>, Option<Vec<u8>>, i64, i64) = pipe
        .query_async(conn)
        .await
        .map_err(|e| format!("{log}  redis: {e}"))?;
    let slack = sent.elapsed().as_millis() as i64 + 1;
    let got: Vec<u64> = reply
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap_or_default()).to_bits())
        .collect();
    let want: Vec<u64> = [
        expected.granted,
        expected.kept,
        expected.wait as f64,
        expected.remaining as f64,
        expected.at as f64,
    ]
    .iter()
    .map(|v| v.to_bits())
    .collect();
    if got != want || reply.len() != 40 {
        return Err(format!(
            "{log}  reply: reference {expected:?}, lua {:?}",
            reply
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap_or_default()))
                .collect::<Vec<_>>()
        ));
    }
    let value = value.ok_or_else(|| format!("{log}  lua stored nothing"))?;
    let (state, leases, keep) =
        decode_leased(&value).ok_or_else(|| format!("{log}  unparsable value {value:?}"))?;
    let bits = |l: &[Lease]| -> Vec<[u64; 3]> {
        l.iter()
            .map(|l| [l.holder.to_bits(), l.amount.to_bits(), l.expiry.to_bits()])
            .collect()
    };
    if state.t.to_bits() != stored.state.t.to_bits()
        || state.ts.to_bits() != stored.state.ts.to_bits()
        || keep.to_bits() != stored.keep.to_bits()
        || bits(&leases) != bits(&stored.leases)
    {
        return Err(format!(
            "{log}  stored: reference {stored:?}, lua {state:?} {leases:?} keep {keep}"
        ));
    }
    let ttl = (stored.keep - stored.state.ts) as i64;
    if !(ttl - slack..=ttl).contains(&pttl) {
        return Err(format!("{log}  ttl: reference {ttl}, lua {pttl}"));
    }
    // The rule itself: what the bucket holds and what is out are at most the burst together.
    // A stored state fuller than the burst (planted, or written under a larger limit) only
    // comes down.
    let out: f64 = stored.leases.iter().map(|l| l.amount).sum();
    let before = model.state.map_or(p.capacity, |s| s.t)
        + model
            .leases
            .iter()
            .filter(|l| l.expiry > stored.state.ts)
            .map(|l| l.amount)
            .sum::<f64>();
    if stored.state.t + out > p.capacity.max(before) {
        return Err(format!(
            "{log}  over the burst: {} held and {out} out, burst {}",
            stored.state.t, p.capacity
        ));
    }
    model.state = Some(stored.state);
    model.leases = stored.leases;
    Ok(expected)
}

/// A peek through the reference and through `lua`: the same answer, and the key left as it
/// was, expiry included.
async fn peek_step(
    conn: &mut MultiplexedConnection,
    lua: &redis::Script,
    key: &str,
    limit: Limit,
    model: &Model,
    now: u64,
    log: &str,
) -> Result<(), String> {
    let p = Params::of(&limit);
    let (expected, out) = lease::peek(&p, model.state, &model.leases, now);
    let args = LeaseArgs::peek(limit);
    let mut pipe = redis::pipe();
    pipe.atomic()
        .cmd("GET")
        .arg(key)
        .cmd("PTTL")
        .arg(key)
        .cmd("EVALSHA")
        .arg(lua.get_hash())
        .arg(1)
        .arg(key)
        .arg(&args.pack(now)[..])
        .cmd("GET")
        .arg(key)
        .cmd("PTTL")
        .arg(key);
    type Reply = (Option<Vec<u8>>, i64, Vec<u8>, Option<Vec<u8>>, i64);
    let (before, ttl_before, reply, after, ttl_after): Reply = pipe
        .query_async(conn)
        .await
        .map_err(|e| format!("{log}  redis: {e}"))?;
    let want: Vec<u64> = [
        f64::from(u8::from(expected.allowed)),
        expected.wait as f64,
        expected.remaining as f64,
        expected.reset as f64,
        expected.at as f64,
        out,
    ]
    .iter()
    .map(|v| v.to_bits())
    .collect();
    let got: Vec<u64> = reply
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap_or_default()).to_bits())
        .collect();
    if got != want || reply.len() != 48 {
        return Err(format!(
            "{log}  peek: reference {expected:?} out {out}, lua {:?}",
            reply
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap_or_default()))
                .collect::<Vec<_>>()
        ));
    }
    // A TTL counts down meanwhile, by at most a millisecond within one transaction.
    if before != after || !(ttl_before - 1..=ttl_before).contains(&ttl_after) {
        return Err(format!("{log}  a peek changed the key"));
    }
    Ok(())
}

/// A plain acquire of the bucket script: decided as `bucket.rs` decides while no lease is out,
/// refused with the key left alone while one is.
async fn take_step(
    conn: &mut MultiplexedConnection,
    key: &str,
    limit: Limit,
    model: &mut Model,
    now: u64,
    cost: u64,
    log: &str,
) -> Result<(), String> {
    let p = Params::of(&limit);
    let args = Args {
        op: Op::Acquire,
        limit,
        x: cost,
        max_wait: 0,
    };
    if !model.leases.is_empty() {
        let before: Option<Vec<u8>> = redis::cmd("GET")
            .arg(key)
            .query_async(conn)
            .await
            .map_err(|e| e.to_string())?;
        let reply: Result<redis::Value, redis::RedisError> = redis::cmd("EVALSHA")
            .arg(script().get_hash())
            .arg(1)
            .arg(key)
            .arg(&args.pack(now)[..])
            .query_async(conn)
            .await;
        let after: Option<Vec<u8>> = redis::cmd("GET")
            .arg(key)
            .query_async(conn)
            .await
            .map_err(|e| e.to_string())?;
        return match reply {
            Err(e) if e.code() == Some("BURSTGATE_LEASED") && after == before => Ok(()),
            other => Err(format!(
                "{log}  the bucket script decided on a leased bucket: {other:?}"
            )),
        };
    }
    // One transaction, and the key made persistent in it: a fast limit's key may expire
    // within milliseconds of the write.
    let mut pipe = redis::pipe();
    pipe.atomic()
        .cmd("EVALSHA")
        .arg(script().get_hash())
        .arg(1)
        .arg(key)
        .arg(&args.pack(now)[..])
        .cmd("GET")
        .arg(key)
        .cmd("PERSIST")
        .arg(key)
        .ignore();
    let (reply, after): (redis::Value, Option<Vec<u8>>) = pipe
        .query_async(conn)
        .await
        .map_err(|e| format!("{log}  redis: {e}"))?;
    let reply = crate::store::redis::wire::parse_reply(&reply, &args, now)
        .map_err(|e| format!("{log}  reply: {e}"))?;
    let (expected, write) = bucket::evaluate(&p, model.state, now, cost as f64, 0);
    if reply.outcome != expected {
        return Err(format!(
            "{log}  take: reference {expected:?}, lua {:?}",
            reply.outcome
        ));
    }
    if let Some(w) = write {
        let stored = after.as_deref().and_then(decode);
        let same = stored.is_some_and(|s| {
            s.t.to_bits() == w.state.t.to_bits() && s.ts.to_bits() == w.state.ts.to_bits()
        });
        if !same {
            return Err(format!(
                "{log}  take stored: reference {:?}, lua {stored:?}",
                w.state
            ));
        }
        model.state = Some(w.state);
    }
    Ok(())
}

/// One trace of up to four holders on one bucket.
async fn trace(
    conn: &mut MultiplexedConnection,
    lua: &redis::Script,
    key: &str,
    seed: u64,
) -> Result<(), String> {
    let mut rng = Rng(seed);
    let limit = random_limit(&mut rng);
    let burst = u64::from(limit.burst());
    let holders = 1 + rng.below(4);
    // What each holder believes it holds: what the last answers gave it, less what it spent.
    let mut held = vec![0u64; holders as usize];
    let mut model = Model::default();
    let mut now: u64 = match rng.below(6) {
        0 => rng.below(10_000),
        1 => MAX_TIME - rng.below(1_000_000),
        _ => 1_700_000_000_000 + rng.below(10_000_000_000),
    };
    let _: () = redis::cmd("DEL")
        .arg(key)
        .query_async(conn)
        .await
        .map_err(|e| e.to_string())?;
    let per_token = (limit.interval_ms() / u64::from(limit.tokens())).max(1);
    let mut log = format!("lease seed {seed}, limit {limit:?}, {holders} holders\n");
    for step in 0..1 + rng.below(40) {
        let time = match rng.below(4) {
            0 => 20 + rng.below(100),
            1 => 1_000,
            2 => lease::MAX_LEASE_MS,
            _ => 1 + rng.below(5_000),
        };
        now = match rng.below(10) {
            0 => now,
            1 => now.saturating_add(1),
            2 => now.saturating_add(rng.below(2 * per_token + 1)),
            3 => now.saturating_add(time),
            4 => now.saturating_add(time.saturating_sub(1)),
            5 => now.saturating_sub(rng.below(2_000)),
            6 => now.saturating_add(rng.below(lease::MAX_LEASE_MS + 1)),
            7 => now.saturating_add(rng.below(10 * limit.interval_ms() + 1)),
            8 if rng.below(8) == 0 => rng.below(u64::MAX),
            _ => now.saturating_add(rng.below(100)),
        };
        let h = rng.below(holders) as usize;
        match rng.below(8) {
            0 => {
                // The holder spends some of what it holds.
                let spent = rng.below(held[h] + 1);
                held[h] -= spent;
                let _ = writeln!(log, "  step {step}: holder {h} spends {spent}");
            }
            1 => {
                let cost = 1 + rng.below(burst.min(3));
                let _ = writeln!(log, "  step {step}: take {cost} at {now}");
                take_step(conn, key, limit, &mut model, now, cost, &log).await?;
            }
            2 if model.state.is_some() => {
                let _ = writeln!(log, "  step {step}: peek at {now}");
                peek_step(conn, lua, key, limit, &model, now, &log).await?;
            }
            _ => {
                let mine = held[h];
                let ret = match rng.below(4) {
                    0 => mine,
                    1 => rng.below(mine + 1),
                    2 => mine + rng.below(3),
                    _ => 0,
                };
                let rest = mine.saturating_sub(ret);
                let keep = match rng.below(4) {
                    0 => rest,
                    1 => rng.below(rest + 1),
                    2 => rest + rng.below(3),
                    _ => 0,
                };
                let want = match rng.below(4) {
                    0 => 0,
                    1 => 1 + rng.below(burst.min(3)),
                    2 => burst,
                    _ => rng.below(burst + 1),
                };
                let least = match rng.below(3) {
                    0 => 0,
                    1 => want.min(1),
                    _ => rng.below(want + 1),
                };
                let ask = Ask {
                    holder: (h as f64) + 7.0,
                    ret: ret as f64,
                    keep: keep as f64,
                    want: want as f64,
                    least: least as f64,
                    time: time as f64,
                };
                let _ = writeln!(log, "  step {step}: holder {h} at {now}: {ask:?}");
                let r = renew_step(conn, lua, key, limit, &mut model, now, ask, &log).await?;
                held[h] = r.kept as u64 + r.granted as u64;
            }
        }
    }
    Ok(())
}

/// Values someone else planted, leased and not, for 10 per second with a burst of 10: a renewal
/// on each is refused by both with the key left alone, or decided by both alike.
async fn planted(
    conn: &mut MultiplexedConnection,
    lua: &redis::Script,
    key: &str,
) -> Result<(), String> {
    let limit = Limit::per_second(10).map_err(|e| e.to_string())?;
    let p = Params::of(&limit);
    let now = super::PLANTED_NOW;
    let nowf = now as f64;
    let l = |holder: f64, amount: f64, expiry: f64| Lease {
        holder,
        amount,
        expiry,
    };
    let state_values: &[(f64, f64)] = &[
        (5.0, nowf - 100.0),
        (-10.0, nowf),
        (f64::NAN, nowf),
        (-1e13, nowf),
        (1.0, -1.0),
        (1.0, MAX_TIME as f64 + 1.0),
        (1.0, nowf + 0.5),
        (5e9, nowf),
    ];
    let lease_sets: Vec<Vec<Lease>> = vec![
        vec![],
        vec![l(7.0, 3.0, nowf + 500.0)],
        vec![l(8.0, 2.0, nowf + 500.0), l(7.0, 3.0, nowf - 1.0)],
        vec![l(7.0, 3.0, nowf + 500.0), l(7.0, 1.0, nowf + 900.0)],
        vec![l(7.5, 3.0, nowf + 500.0)],
        vec![l(-1.0, 3.0, nowf + 500.0)],
        vec![l(MAX_TIME as f64 + 1.0, 3.0, nowf + 500.0)],
        vec![l(7.0, 2.5, nowf + 500.0)],
        vec![l(7.0, -1.0, nowf + 500.0)],
        vec![l(7.0, 5e9, nowf + 500.0)],
        vec![l(7.0, 3.0, nowf + 0.5)],
        vec![l(7.0, 3.0, -1.0)],
        vec![l(7.0, 3.0, MAX_TIME as f64 + 1.0)],
        vec![l(7.0, f64::NAN, nowf + 500.0)],
        (0..MAX_LEASES as u32)
            .map(|i| l(f64::from(i), 0.0, nowf + 500.0))
            .collect(),
        (100..100 + MAX_LEASES as u32)
            .map(|i| l(f64::from(i), 0.0, nowf + 500.0))
            .collect(),
        // The most leases, the first of them not the first to end.
        (100..100 + MAX_LEASES as u32)
            .map(|i| l(f64::from(i), 0.0, nowf + 1_000.0 - f64::from(i)))
            .collect(),
        // More out than the burst (a limit lowered since).
        vec![l(8.0, 20.0, nowf + 500.0)],
        (0..=MAX_LEASES as u32)
            .map(|i| l(f64::from(i), 0.0, nowf + 500.0))
            .collect(),
    ];
    let asks = [
        (0.0, 0.0, 1.0, 1.0),
        (3.0, 0.0, 0.0, 0.0),
        (0.0, 3.0, 5.0, 5.0),
    ];
    // A plain bucket's value with a halt (32 bytes) too: the halt is dropped.
    let halted = Some(nowf + 100.0);
    let cases = state_values.iter().flat_map(|&st| {
        lease_sets
            .iter()
            .map(move |l| (st, l, None))
            .chain(std::iter::once((st, &lease_sets[0], halted)))
    });
    for ((t, ts), leases, halt) in cases {
        {
            let mut value = [t.to_le_bytes(), ts.to_le_bytes(), 1e13f64.to_le_bytes()].concat();
            if let Some(halt) = halt {
                value.extend_from_slice(&f64::to_le_bytes(halt));
            }
            for r in leases {
                for v in [r.holder, r.amount, r.expiry] {
                    value.extend_from_slice(&v.to_le_bytes());
                }
            }
            let sound = lease::sound_leased(&p, State { t, ts }, leases);
            for (ret, keep, want, least) in asks {
                let ask = Ask {
                    holder: 7.0,
                    ret,
                    keep,
                    want,
                    least,
                    time: 1_000.0,
                };
                let log = format!("planted t={t} ts={ts} leases={leases:?}\n  {ask:?}\n");
                let _: () = redis::cmd("SET")
                    .arg(key)
                    .arg(&value[..])
                    .query_async(conn)
                    .await
                    .map_err(|e| e.to_string())?;
                if sound {
                    let mut model = Model {
                        state: Some(State { t, ts }),
                        leases: leases.clone(),
                    };
                    peek_step(conn, lua, key, limit, &model, now, &log).await?;
                    renew_step(conn, lua, key, limit, &mut model, now, ask, &log).await?;
                    continue;
                }
                let reply: Result<redis::Value, _> = redis::cmd("EVALSHA")
                    .arg(lua.get_hash())
                    .arg(1)
                    .arg(key)
                    .arg(
                        &LeaseArgs {
                            op: LeaseOp::Renew,
                            limit,
                            ask,
                        }
                        .pack(now)[..],
                    )
                    .query_async(conn)
                    .await;
                match reply {
                    Err(e) if e.code() == Some(CORRUPT_CODE) || e.code() == Some("WRONGTYPE") => {}
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
    }
    // Lengths no script writes: refused as another type.
    for len in [8, 40, 47, 49] {
        let value = vec![0u8; len];
        let _: () = redis::cmd("SET")
            .arg(key)
            .arg(&value[..])
            .query_async(conn)
            .await
            .map_err(|e| e.to_string())?;
        let ask = Ask {
            holder: 7.0,
            ret: 0.0,
            keep: 0.0,
            want: 1.0,
            least: 1.0,
            time: 1_000.0,
        };
        let reply: Result<redis::Value, _> = redis::cmd("EVALSHA")
            .arg(lua.get_hash())
            .arg(1)
            .arg(key)
            .arg(
                &LeaseArgs {
                    op: LeaseOp::Renew,
                    limit,
                    ask,
                }
                .pack(now)[..],
            )
            .query_async(conn)
            .await;
        match reply {
            Err(e) if e.code() == Some("WRONGTYPE") => {}
            other => return Err(format!("a {len}-byte value: lua decided on it: {other:?}")),
        }
    }
    Ok(())
}

#[tokio::test]
async fn lease_script_and_reference_agree_bit_for_bit() {
    let mut conn = connect().await;
    let lua = load(&mut conn, LEASE_SOURCE).await;
    assert_eq!(lua.get_hash(), script_lease().get_hash());
    let _ = load(&mut conn, include_str!("../bucket.lua")).await;
    let key = format!("{}:v4:lease:{{k}}", redis_server::unique_prefix());
    if let Err(e) = planted(&mut conn, &lua, &key).await {
        panic!("lease.lua and bucket/lease.rs disagree on a planted value:\n{e}");
    }
    for seed in 0..traces() {
        if let Err(e) = trace(&mut conn, &lua, &key, seed).await {
            panic!("lease.lua and bucket/lease.rs disagree:\n{e}");
        }
    }
}

/// Both other scripts refuse a bucket with tokens out on lease, and leave it as it is.
#[tokio::test]
async fn the_other_scripts_refuse_a_leased_bucket() {
    let mut conn = connect().await;
    let _ = load(&mut conn, include_str!("../bucket.lua")).await;
    let key = format!("{}:v4:leased:{{k}}", redis_server::unique_prefix());
    let now = super::PLANTED_NOW as f64;
    let mut value = [5.0f64, now, now + 10_000.0, 7.0, 3.0, now + 500.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect::<Vec<u8>>();
    for leases in 1..=2 {
        if leases == 2 {
            for v in [8.0f64, 1.0, now + 700.0] {
                value.extend_from_slice(&v.to_le_bytes());
            }
        }
        let _: () = redis::cmd("SET")
            .arg(&key)
            .arg(&value[..])
            .query_async(&mut conn)
            .await
            .expect("a SET");
        let limit = Limit::per_second(10).expect("a limit");
        for op in [Op::Acquire, Op::Peek, Op::Refund, Op::Drain, Op::Set] {
            let args = Args {
                op,
                limit,
                x: 1,
                max_wait: 0,
            };
            let reply: Result<redis::Value, _> = redis::cmd("EVALSHA")
                .arg(script().get_hash())
                .arg(1)
                .arg(&key)
                .arg(&args.pack(super::PLANTED_NOW)[..])
                .query_async(&mut conn)
                .await;
            assert!(
                matches!(&reply, Err(e) if e.code() == Some("BURSTGATE_LEASED")),
                "{op:?} on {leases} leases: {reply:?}"
            );
        }
        let all: Result<redis::Value, _> = redis::Script::new(include_str!("../acquire_all.lua"))
            .key(&key)
            .arg(
                [
                    super::PLANTED_NOW as f64,
                    0.0,
                    10.0,
                    1000.0,
                    10.0,
                    1.0,
                    2000.0,
                    1e12,
                ]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>(),
            )
            .invoke_async(&mut conn)
            .await;
        assert!(
            matches!(&all, Err(e) if e.code() == Some("BURSTGATE_LEASED")),
            "acquire_all on {leases} leases: {all:?}"
        );
        let after: Vec<u8> = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("a GET");
        assert_eq!(after, value, "a refused call changed the value");
    }
}

/// Single-line edits of the lease script, each of which the traces or the planted values must
/// catch.
const MUTANTS: &[(&str, &str)] = &[
    (
        "local op, now, tokens, interval, capacity, lead, most_debt, holder, ret, keep_asked, want, least,",
        "local op, now, interval, tokens, capacity, lead, most_debt, holder, ret, keep_asked, want, least,",
    ),
    // the peek
    ("if op == 2 then", "if op == 3 then"),
    ("  if avail > 0 then left = avail - avail % 1 end", ""),
    ("  if not (avail >= 1) then", "  if not (avail > 1) then"),
    (
        "    next_in = ready_at(t, ts, 1) - ts2",
        "    next_in = ready_at(t, ts2, 1) - ts2",
    ),
    ("    if room < 1 then", "    if room < 0 then"),
    ("        if l[3] > others then others = l[3] end", ""),
    (
        "      if others - ts2 > next_in then next_in = others - ts2 end",
        "",
    ),
    (
        "  local reset = ready_at(t, ts, room) - ts2",
        "  local reset = ready_at(t, ts, capacity) - ts2",
    ),
    ("  if not (reset > 0) then reset = 0 end", ""),
    (
        "  return struct.pack('<dddddd', avail >= 1 and 1 or 0, next_in, left, reset, ts2, out)",
        "  return struct.pack('<dddddd', avail >= 1 and 1 or 0, next_in, left, reset, ts2, 0)",
    ),
    ("if now > MAX_TIME then now = MAX_TIME end", ""),
    ("if len == 24 or len == 32 then", "if len == 24 then"),
    (
        "elseif len > 32 and len <= 1560 and (len - 24) % 24 == 0 then",
        "elseif len > 32 and len <= 1584 and (len - 24) % 24 == 0 then",
    ),
    (
        "if not (h >= 0 and h <= MAX_TIME and h % 1 == 0",
        "if not (h >= 0 and h <= MAX_TIME",
    ),
    (
        "and a >= 0 and a <= MAX_TOKENS and a % 1 == 0",
        "and a >= 0 and a <= MAX_TOKENS",
    ),
    (
        "and e >= 0 and e <= MAX_TIME and e % 1 == 0) then",
        "and e >= 0) then",
    ),
    (
        "if not (t >= -most_debt and t <= MAX_TOKENS",
        "if not (t <= MAX_TOKENS",
    ),
    (
        "if ts > now and ts > now + lead then ts = now end",
        "if ts > now then ts = now end",
    ),
    ("if now > ts then ts2 = now end", ""),
    ("if l[3] > ts2 then", "if l[3] >= ts2 then"),
    (
        "if mine == nil and l[1] == holder then mine = #live end",
        "if l[1] == holder then mine = #live end",
    ),
    ("local room = capacity - out", "local room = capacity"),
    ("if not (elapsed > 0) then elapsed = 0 end", ""),
    (
        "local avail = t + elapsed * tokens / interval",
        "local avail = t + elapsed * (tokens / interval)",
    ),
    ("if not (avail < room) then avail = room end", ""),
    ("if ret < held then back = ret end", "back = ret"),
    (
        "if keep_asked < kept then kept = keep_asked end",
        "kept = keep_asked",
    ),
    ("local t1 = avail + back", "local t1 = avail"),
    ("if t1 > 0 then whole_t1 = t1 - t1 % 1 end", "whole_t1 = t1"),
    ("if whole_t1 < want then granted = whole_t1 end", ""),
    (
        "local capped = mine == nil and #live >= 64",
        "local capped = false",
    ),
    (
        "local capped = mine == nil and #live >= 64",
        "local capped = #live >= 64",
    ),
    (
        "if granted < least or capped then granted = 0 end",
        "if capped then granted = 0 end",
    ),
    ("if not (room > 0) then room = 0 end", ""),
    ("      if l[3] < first then first = l[3] end", ""),
    ("    if first - ts2 > wait then wait = first - ts2 end", ""),
    ("local t2 = t1 - granted", "local t2 = t1"),
    ("local amount = kept + granted", "local amount = granted"),
    ("local expiry = ts2 + span", "local expiry = now + span"),
    ("if expiry > MAX_TIME then expiry = MAX_TIME end", ""),
    ("    table.remove(live, mine)", ""),
    ("elseif amount > 0 then", "elseif amount >= 0 then"),
    ("  if l[3] > last then last = l[3] end", ""),
    ("  out2 = out2 + l[2]", ""),
    (
        "local keep = last + (ready_at(t2, ts2, capacity) - ts2) + interval",
        "local keep = last + interval",
    ),
    (
        "local keep = last + (ready_at(t2, ts2, capacity) - ts2) + interval",
        "local keep = ready_at(t2, ts2, capacity) + interval",
    ),
    ("if granted == 0 and least > 0 then", "if granted == 0 then"),
    (
        "  wait = ready_at(t2, ts2, least) - ts2",
        "  wait = ready_at(t2, ts2, least + 1) - ts2",
    ),
    (
        "  if capacity - out2 < least then",
        "  if capacity - out < least then",
    ),
    (
        "      if l[1] ~= holder and l[3] > others then others = l[3] end",
        "      if l[3] > others then others = l[3] end",
    ),
    (
        "while n < 8 and t + e * tokens / interval < target do e = e + 1; n = n + 1 end",
        "",
    ),
    (
        "while n < 8 and e > 0 and t + (e - 1) * tokens / interval >= target do e = e - 1; n = n + 1 end",
        "",
    ),
    ("if t2 > 0 then left = t2 - t2 % 1 end", ""),
    (
        "return struct.pack('<ddddd', granted, kept, wait, left, ts2)",
        "return struct.pack('<ddddd', granted, kept, wait, left, now)",
    ),
];

#[tokio::test]
#[ignore = "slow tier: run by .ci/run with --ignored"]
async fn every_single_line_mutant_of_the_lease_script_is_caught() {
    let mut conn = connect().await;
    let _ = load(&mut conn, include_str!("../bucket.lua")).await;
    let key = format!("{}:v4:lease-mutant:{{k}}", redis_server::unique_prefix());
    every_mutant_is_caught(
        &mut conn,
        (LEASE_SOURCE, MUTANTS),
        async |conn, lua| planted(conn, lua, &key).await,
        async |_, _| Ok(()),
        &[("lease trace", ())],
        async |conn, lua, (), seed| trace(conn, lua, &key, seed).await,
    )
    .await;
}
