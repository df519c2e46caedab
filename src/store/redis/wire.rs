//! What goes over the wire to the script and back: the key, the command and its packed
//! argument, the script's replies, and the stored value.
//!
//! This module is the one place that writes and reads that format, and a leaf: it uses nothing of
//! the store's but value types (the arithmetic's, the keys', the limits' and the errors'), so
//! the store, the scripts' calls and the tests all build on it and it on none of them. The
//! workspace's tools reach it through `raw.rs`.

use std::fmt;

use redis::{Cmd, Value};

use crate::bucket::{self, Outcome, Params, State};
use crate::store::{BackendError, StoreError, Take};
use crate::{BucketKey, Limit};

/// The version of the key scheme and stored format, part of every key: a change of either moves
/// to new keys instead of meeting old values. 1 was a hash `{t, ts}` with decimal fields; 2 one
/// 16-byte string, `t` and `ts` as little-endian `f64`s; 3 one 24-byte string, the same two
/// numbers and then the time until which the key is kept, or 32 bytes with a drain's halt after
/// them. 4 stores the same values as 3 under keys whose caller key is a Redis Cluster hash tag,
/// `<prefix>:v4:<bucket>:{<key>}`, so that every bucket of one caller (an account's endpoint
/// buckets and its own) lives in one slot, where one script can take from them all at once.
pub(super) const FORMAT: u32 = 4;
/// What goes between the prefix and the bucket in every key: the format version.
const FORMAT_PART: &str = ":v4:";

/// The length of a stored value: three `f64`s, or four with a halt.
const STATE_LEN: usize = 24;
const HALTED_LEN: usize = 32;

/// A bucket's Redis key, written straight into the command with no string of its own.
#[derive(Clone, Copy)]
pub(super) struct RedisKey<'a> {
    pub(super) prefix: &'a str,
    pub(super) key: &'a BucketKey,
}

impl RedisKey<'_> {
    /// `<prefix>:v4:<bucket>:{<key>}`: the caller's key, escaped or hashed, is the key's only
    /// hash tag, as neither a prefix, a bucket name nor an escaped key holds a brace.
    fn parts(&self) -> [&str; 6] {
        [
            self.prefix,
            FORMAT_PART,
            self.key.bucket(),
            ":{",
            self.key.caller(),
            "}",
        ]
    }
}

impl fmt::Display for RedisKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.parts().iter().try_for_each(|part| f.write_str(part))
    }
}

/// One script call, built in one buffer sized for it.
pub(super) fn command(
    name: &str,
    script: &str,
    redis_key: RedisKey<'_>,
    packed: &[u8; PACKED_ARGS],
) -> Cmd {
    // The key is at most 64 + 4 + 64 + 1 + 128 bytes.
    let mut cmd = Cmd::with_capacity(5, name.len() + script.len() + 1 + 270 + PACKED_ARGS);
    cmd.arg(name)
        .arg(script)
        .arg(1)
        .arg(redis_key_arg(redis_key))
        .arg(&packed[..]);
    cmd
}

/// The key as a command argument, formatted into the command's buffer.
fn redis_key_arg(key: RedisKey<'_>) -> impl redis::ToRedisArgs + '_ {
    struct Arg<'a>(RedisKey<'a>);
    impl redis::ToRedisArgs for Arg<'_> {
        fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
            let mut arg = out.writer_for_next_arg();
            for part in self.0.parts() {
                // Writing to the command's own buffer cannot fail.
                let _ = std::io::Write::write_all(&mut arg, part.as_bytes());
            }
        }
    }
    Arg(key)
}

/// The `DEL` of a bucket's key: a reset, which forgets the bucket whatever its key holds, with
/// no script.
pub(super) fn delete(redis_key: RedisKey<'_>) -> Cmd {
    let mut cmd = Cmd::with_capacity(2, 3 + 270);
    cmd.arg("DEL").arg(redis_key_arg(redis_key));
    cmd
}

/// The `SET NX PX` that books a one-time mark beside a bucket's key, `<bucket's key>:t:<id>`:
/// no escaped key holds a `:`, so the mark's key is no bucket's; it holds `b` until it is spent.
pub(super) fn book(redis_key: RedisKey<'_>, id: &str, ttl_ms: u64) -> Cmd {
    let mut cmd = Cmd::with_capacity(6, 3 + 270 + 3 + id.len() + 1 + 2 + 2 + 20);
    cmd.arg("SET")
        .arg(MarkKey(redis_key, id))
        .arg("b")
        .arg("NX")
        .arg("PX")
        .arg(ttl_ms);
    cmd
}

/// The call of the claim script (`claim.lua`) on a one-time mark beside a bucket's key.
pub(super) fn claim(name: &str, script: &str, redis_key: RedisKey<'_>, id: &str) -> Cmd {
    let mut cmd = Cmd::with_capacity(4, name.len() + script.len() + 1 + 270 + 3 + id.len());
    cmd.arg(name).arg(script).arg(1).arg(MarkKey(redis_key, id));
    cmd
}

/// A mark's key as a command argument, formatted into the command's buffer.
struct MarkKey<'a>(RedisKey<'a>, &'a str);

impl redis::ToRedisArgs for MarkKey<'_> {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        let mut arg = out.writer_for_next_arg();
        for part in self.0.parts().into_iter().chain([":t:", self.1]) {
            // Writing to the command's own buffer cannot fail.
            let _ = std::io::Write::write_all(&mut arg, part.as_bytes());
        }
    }
}

/// One call's arguments, in the script's terms.
#[derive(Debug, Clone, Copy)]
pub(super) struct Args {
    pub(super) op: Op,
    pub(super) limit: Limit,
    /// The cost for acquire and refund, the deadline for drain and block, the tokens for set
    /// and lower.
    pub(super) x: u64,
    pub(super) max_wait: u64,
}

/// The script's operations, by the first number packed into `ARGV[1]`.
#[derive(Debug, Clone, Copy)]
pub(super) enum Op {
    Acquire = 1,
    Peek = 2,
    Refund = 3,
    Drain = 4,
    Set = 5,
    Block = 6,
    Lower = 7,
}

/// The script's one argument: nine little-endian `f64`s.
const PACKED_ARGS: usize = 9 * 8;

impl Op {
    /// The `op` label of the store's call-latency metric.
    #[cfg(feature = "metrics")]
    pub(super) fn name(self) -> &'static str {
        match self {
            Self::Acquire => "acquire",
            Self::Peek => "peek",
            Self::Refund => "refund",
            Self::Drain => "drain",
            Self::Set => "set",
            Self::Block => "block",
            Self::Lower => "lower",
        }
    }
}

impl Args {
    /// `ARGV[1]` as the script unpacks it: op, now, tokens, interval, capacity, x, max_wait, and
    /// the limit's lead bound and most debt, which the arithmetic derives from the limit and the
    /// script takes as they are rather than work out on every call. Every whole value below 2^53
    /// is exact; a larger one rounds to the nearest double, the one Lua's own parsing of the
    /// decimal number would give, and the script clamps it.
    pub(super) fn pack(&self, now: u64) -> [u8; PACKED_ARGS] {
        let p = Params::of(&self.limit);
        let values = [
            self.op as u64 as f64,
            now as f64,
            p.tokens,
            p.interval,
            p.capacity,
            self.x as f64,
            self.max_wait as f64,
            p.lead(),
            p.most_debt(),
        ];
        let mut packed = [0; PACKED_ARGS];
        for (chunk, v) in packed.chunks_exact_mut(8).zip(values) {
            chunk.copy_from_slice(&v.to_le_bytes());
        }
        packed
    }
}

/// What the script answered.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Reply {
    pub(super) outcome: Outcome,
    /// The bucket's state as the script left it, where the reply carries it: with a denial, the
    /// state it denied on (and left alone); with an admission with no wait, the state it stored.
    pub(super) state: Option<State>,
    /// For a peek, the bucket's halt (0 for none).
    pub(super) halt: u64,
}

/// The script's reply to a call made with `args` at `now`. After an acquire admitted with no
/// wait, the 24- or 32-byte value the script stored, from which the outcome follows by the same
/// arithmetic. Otherwise `allowed, wait, remaining, reset, at` as five little-endian `f64`s holding
/// whole numbers, then after a denial the stored value, after a peek the halt.
pub(super) fn parse_reply(value: &Value, args: &Args, now: u64) -> Result<Reply, StoreError> {
    let bad = || {
        StoreError::Backend(BackendError::new(
            "the bucket script answered something other than a bucket's decision",
            None,
        ))
    };
    let bytes = match value {
        Value::BulkString(bytes) => bytes,
        Value::Array(items) => return parse_denial(items, args, now).ok_or_else(bad),
        _ => return Err(bad()),
    };
    if bytes.len() == STATE_LEN || bytes.len() == HALTED_LEN {
        let p = Params::of(&args.limit);
        let state = decode(bytes).ok_or_else(bad)?;
        // What a plain admission can store: no debt, and the later of the stored time and now.
        // Checked, since the walk to the refill time assumes it.
        let sound = matches!(args.op, Op::Acquire)
            && state.t >= 0.0
            && state.ts >= bucket::time(now)
            && storable(&p, state);
        if !sound {
            return Err(bad());
        }
        return Ok(Reply {
            outcome: bucket::write(&p, state.t, state.ts).outcome(),
            state: Some(state),
            halt: 0,
        });
    }
    let (numbers, rest) = bytes.split_first_chunk::<40>().ok_or_else(bad)?;
    let mut whole = [0u64; 5];
    for (w, chunk) in whole.iter_mut().zip(numbers.chunks_exact(8)) {
        let mut b = [0; 8];
        b.copy_from_slice(chunk);
        *w = to_whole(f64::from_le_bytes(b)).ok_or_else(bad)?;
    }
    let [allowed, wait, remaining, reset, at] = whole;
    if allowed > 1 {
        return Err(bad());
    }
    let peek = matches!(args.op, Op::Peek);
    let (state, halt) = match rest.len() {
        0 if !peek => (None, 0),
        8 if peek => {
            let mut b = [0; 8];
            b.copy_from_slice(rest);
            let halt = f64::from_le_bytes(b);
            if !bucket::sound_halt(halt) {
                return Err(bad());
            }
            (None, to_whole(halt).ok_or_else(bad)?)
        }
        STATE_LEN | HALTED_LEN if !peek => match decode(rest) {
            Some(state) if storable(&Params::of(&args.limit), state) => (Some(state), 0),
            _ => return Err(bad()),
        },
        _ => return Err(bad()),
    };
    Ok(Reply {
        outcome: Outcome {
            allowed: allowed == 1,
            wait,
            remaining,
            reset,
            at,
        },
        state,
        halt,
    })
}

/// The reply to an acquire the script denied with no wait allowed: the stored value it read,
/// alone in an array. The denial is worked out here from that value, by the arithmetic the
/// script mirrors; `None` for anything else, including a value on which the arithmetic would
/// not deny.
fn parse_denial(items: &[Value], args: &Args, now: u64) -> Option<Reply> {
    let [Value::BulkString(bytes)] = items else {
        return None;
    };
    if !matches!(args.op, Op::Acquire) || args.max_wait != 0 {
        return None;
    }
    let p = Params::of(&args.limit);
    let state = decode(bytes).filter(|&s| storable(&p, s))?;
    // A denial never writes, so the outcome alone says whether the arithmetic agrees.
    let (outcome, _) = bucket::evaluate(&p, Some(state), now, args.x as f64, 0);
    (!outcome.allowed).then_some(Reply {
        outcome,
        state: Some(state),
        halt: 0,
    })
}

/// Whether the script can have stored `state` for a limit of `p`, and at most full: the script
/// refuses any other value it reads, and the deny cache takes no other from a reply.
fn storable(p: &Params, state: State) -> bool {
    bucket::sound(p, state) && state.t <= p.capacity
}

/// `v` as a `u64`, when it is a whole number the script can answer: at least 0 and below 2^63.
fn to_whole(v: f64) -> Option<u64> {
    // The range check also turns away NaN and the infinities.
    const TWO_TO_63: f64 = 9_223_372_036_854_775_808.0;
    if (0.0..TWO_TO_63).contains(&v) && v.fract() == 0.0 {
        Some(v as u64)
    } else {
        None
    }
}

/// A stored value, as the script writes it: `t`, `ts` and `keep`, each an `f64`,
/// little-endian, and perhaps a halt. `keep` concerns the key's expiry only, and the halt only
/// a peek (which the script answers itself), so the state leaves them out.
pub(super) fn decode(value: &[u8]) -> Option<State> {
    let (t, ts) = match value.as_chunks::<8>() {
        ([t, ts, _keep], []) | ([t, ts, _keep, _], []) => (t, ts),
        _ => return None,
    };
    Some(State {
        t: f64::from_le_bytes(*t),
        ts: f64::from_le_bytes(*ts),
    })
}

/// The several-bucket script's one argument: `now` and `max_wait`, then for each bucket its
/// tokens, interval, capacity, the request's cost there, and its limit's lead bound and most
/// debt, each a little-endian `f64` (see `acquire_all.lua`).
pub(super) fn pack_all(takes: &[Take<'_>], now: u64, max_wait: u64) -> Vec<u8> {
    let mut packed = Vec::with_capacity(16 + 48 * takes.len());
    for v in [now as f64, max_wait as f64] {
        packed.extend_from_slice(&v.to_le_bytes());
    }
    for take in takes {
        let p = Params::of(&take.limit());
        for v in [
            p.tokens,
            p.interval,
            p.capacity,
            f64::from(take.cost()),
            p.lead(),
            p.most_debt(),
        ] {
            packed.extend_from_slice(&v.to_le_bytes());
        }
    }
    packed
}

/// One call of the several-bucket script on the buckets of `takes`, in their order.
pub(super) fn command_all(
    name: &str,
    script: &str,
    prefix: &str,
    takes: &[Take<'_>],
    packed: &[u8],
) -> Cmd {
    let mut cmd = Cmd::with_capacity(
        4 + takes.len(),
        name.len() + script.len() + 3 + 270 * takes.len() + packed.len(),
    );
    cmd.arg(name).arg(script).arg(takes.len());
    for take in takes {
        cmd.arg(redis_key_arg(RedisKey {
            prefix,
            key: take.key(),
        }));
    }
    cmd.arg(packed);
    cmd
}

/// What the several-bucket script answered for one bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Each {
    pub(super) outcome: Outcome,
    /// What the key holds after the call: the state the script stored when it admitted, the one
    /// it read (after a far lead moved back) when it denied; `None` for a key that holds nothing,
    /// which only a denial leaves.
    pub(super) state: Option<State>,
}

/// The bytes of one bucket's answer: seven `f64`s.
const EACH_LEN: usize = 7 * 8;

/// The several-bucket script's reply to a call on the buckets of `takes`: for each, in order,
/// `allowed, wait, remaining, reset, at` (whole numbers) and the state `t, ts` (a `ts` of -1 for
/// no state), every one allowed or none. A state no script can have read or stored under the
/// bucket's limit is refused, as is an admission without one, or one stored at another time
/// than the waits count from.
pub(super) fn parse_all(value: &Value, takes: &[Take<'_>]) -> Result<Vec<Each>, StoreError> {
    let bad = || {
        StoreError::Backend(BackendError::new(
            "the several-bucket script answered something other than a decision on each bucket",
            None,
        ))
    };
    let Value::BulkString(bytes) = value else {
        return Err(bad());
    };
    if bytes.len() != EACH_LEN * takes.len() {
        return Err(bad());
    }
    let each = bytes
        .chunks_exact(EACH_LEN)
        .zip(takes)
        .map(|(chunk, take)| {
            let mut numbers = [0.0; 7];
            for (v, number) in numbers.iter_mut().zip(chunk.chunks_exact(8)) {
                let mut b = [0; 8];
                b.copy_from_slice(number);
                *v = f64::from_le_bytes(b);
            }
            let [allowed, wait, remaining, reset, at, t, ts] = numbers;
            let [allowed, wait, remaining, reset, at] =
                [allowed, wait, remaining, reset, at].map(to_whole);
            let outcome = Outcome {
                allowed: match allowed? {
                    0 => false,
                    1 => true,
                    _ => return None,
                },
                wait: wait?,
                remaining: remaining?,
                reset: reset?,
                at: at?,
            };
            let state = if ts == -1.0 && !outcome.allowed {
                None
            } else {
                let state = State { t, ts };
                // Admitted, the state was stored at the time the waits count from; denied, that
                // time is the later of now and the state's.
                let when = if outcome.allowed {
                    ts == outcome.at as f64
                } else {
                    ts <= outcome.at as f64
                };
                if !(when && bucket::sound(&Params::of(&take.limit()), state)) {
                    return None;
                }
                Some(state)
            };
            Some(Each { outcome, state })
        })
        .collect::<Option<Vec<Each>>>()
        .ok_or_else(bad)?;
    if each
        .windows(2)
        .any(|w| w[0].outcome.allowed != w[1].outcome.allowed)
    {
        return Err(bad());
    }
    Ok(each)
}

/// The halt of a stored value: its fourth `f64`, or 0 for a value of three.
#[cfg(test)]
pub(super) fn decode_halt(value: &[u8]) -> Option<f64> {
    match value.as_chunks::<8>() {
        ([_, _, _], []) => Some(0.0),
        ([_, _, _, halt], []) => Some(f64::from_le_bytes(*halt)),
        _ => None,
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    fn packed(numbers: [f64; 5], tail: &[u8]) -> Value {
        let mut bytes: Vec<u8> = numbers.iter().flat_map(|v| v.to_le_bytes()).collect();
        bytes.extend_from_slice(tail);
        Value::BulkString(bytes)
    }

    pub(in crate::store::redis) const NOW: u64 = 1_700_000_000_000;

    /// An acquire of 1 on 10 per second, burst 10.
    pub(in crate::store::redis) fn acquire() -> Args {
        Args {
            op: Op::Acquire,
            limit: Limit::per_second(10).expect("a limit"),
            x: 1,
            max_wait: 0,
        }
    }

    /// Whether the reply to a call made with `args` at `NOW` is refused as a backend error.
    fn refused(value: &Value, args: &Args) -> bool {
        matches!(parse_reply(value, args, NOW), Err(StoreError::Backend(_)))
    }

    pub(in crate::store::redis) fn state(t: f64, ts: f64) -> Value {
        let keep = ts + 60_000.0;
        Value::BulkString([t.to_le_bytes(), ts.to_le_bytes(), keep.to_le_bytes()].concat())
    }

    #[test]
    fn an_admission_with_no_wait_is_worked_out_from_the_state_it_stored() {
        // 9.5 tokens stored at now: 9 whole left, and the half token missing refills in 50 ms.
        let admit = parse_reply(&state(9.5, NOW as f64), &acquire(), NOW).expect("parses");
        let expected = Outcome {
            allowed: true,
            wait: 0,
            remaining: 9,
            reset: 50,
            at: NOW,
        };
        assert_eq!(
            admit,
            Reply {
                outcome: expected,
                state: Some(State {
                    t: 9.5,
                    ts: NOW as f64
                }),
                halt: 0,
            }
        );
        // Stored ahead of this process's clock (another's ran ahead): reset counts from the
        // stored time, where this caller is taken to stand.
        let ahead = parse_reply(&state(10.0, (NOW + 30) as f64), &acquire(), NOW).expect("parses");
        assert_eq!(ahead.outcome.reset, 0);
        assert_eq!(ahead.outcome.remaining, 10);
    }

    #[test]
    fn a_stored_state_no_plain_admission_could_leave_is_a_backend_error() {
        let bad = [
            state(-0.5, NOW as f64),
            state(10.5, NOW as f64),
            state(f64::NAN, NOW as f64),
            state(-f64::INFINITY, NOW as f64),
            state(1.0, (NOW - 1) as f64),
            state(1.0, NOW as f64 + 0.5),
            state(1.0, f64::INFINITY),
            state(1.0, 9_007_199_254_740_992.0),
        ];
        for value in bad {
            assert!(refused(&value, &acquire()), "{value:?}");
        }
        // A denial's stored value must be one the script could have written.
        for (t, ts) in [
            (-1e300, NOW as f64),
            (f64::NAN, NOW as f64),
            (11.0, NOW as f64),
            (1.0, -1.0),
            (1.0, 0.5),
        ] {
            let Value::BulkString(carried) = state(t, ts) else {
                unreachable!("state() makes a bulk string")
            };
            let denial = packed([0.0, 100.0, 0.0, 100.0, NOW as f64], &carried);
            assert!(refused(&denial, &acquire()), "{t} {ts}");
        }
        // Only an acquire answers with the state alone.
        let peek = Args {
            op: Op::Peek,
            ..acquire()
        };
        assert!(refused(&state(1.0, NOW as f64), &peek));
    }

    #[test]
    fn an_admission_and_a_denial_with_its_state_parse() {
        let admit = parse_reply(
            &packed([1.0, 0.0, 9.0, 1500.0, NOW as f64], b""),
            &acquire(),
            NOW,
        )
        .expect("parses");
        assert_eq!(
            admit,
            Reply {
                outcome: Outcome {
                    allowed: true,
                    wait: 0,
                    remaining: 9,
                    reset: 1500,
                    at: NOW
                },
                state: None,
                halt: 0,
            }
        );
        let mut state = 0.25f64.to_le_bytes().to_vec();
        state.extend_from_slice(&1_700_000_000_123f64.to_le_bytes());
        state.extend_from_slice(&1_700_003_600_123f64.to_le_bytes());
        let deny = parse_reply(
            &packed(
                [0.0, 250.0, 0.0, 9_007_199_254_740_991.0, NOW as f64],
                &state,
            ),
            &acquire(),
            NOW,
        )
        .expect("parses");
        assert!(!deny.outcome.allowed);
        assert_eq!(deny.outcome.wait, 250);
        assert_eq!(deny.outcome.reset, 9_007_199_254_740_991);
        assert_eq!(
            deny.state,
            Some(State {
                t: 0.25,
                ts: 1_700_000_000_123.0
            })
        );
    }

    /// The stored value alone, in an array: a denial with no wait allowed.
    pub(in crate::store::redis) fn denial_of(t: f64, ts: f64) -> Value {
        Value::Array(vec![state(t, ts)])
    }

    #[test]
    fn a_denial_with_no_wait_is_worked_out_from_the_value_it_read() {
        // 0.25 tokens at now, 10 per second: the missing 0.75 refill in 75 ms, the rest of the
        // bucket (9.75) in 975 ms.
        let deny = parse_reply(&denial_of(0.25, NOW as f64), &acquire(), NOW).expect("parses");
        assert_eq!(
            deny,
            Reply {
                outcome: Outcome {
                    allowed: false,
                    wait: 75,
                    remaining: 0,
                    reset: 975,
                    at: NOW
                },
                state: Some(State {
                    t: 0.25,
                    ts: NOW as f64
                }),
                halt: 0,
            }
        );
        // In debt from a reservation, stored ahead of this process's clock: counted from the
        // stored time.
        let deny =
            parse_reply(&denial_of(-2.0, (NOW + 40) as f64), &acquire(), NOW).expect("parses");
        assert_eq!((deny.outcome.wait, deny.outcome.reset), (300, 1200));
    }

    #[test]
    fn a_value_the_arithmetic_would_not_deny_on_is_a_backend_error() {
        // A whole token stored: an acquire of 1 goes now, so no script denies on it.
        assert!(refused(&denial_of(1.0, NOW as f64), &acquire()));
        // Nor after a stored time long enough ago to refill one.
        assert!(refused(&denial_of(0.0, (NOW - 100) as f64), &acquire()));
        // Only an acquire that may not wait is denied this way.
        let waits = Args {
            max_wait: 1,
            ..acquire()
        };
        assert!(refused(&denial_of(0.0, NOW as f64), &waits));
        let peek = Args {
            op: Op::Peek,
            ..acquire()
        };
        assert!(refused(&denial_of(0.0, NOW as f64), &peek));
        // A value no script could have stored, or not a value at all.
        for bad in [
            denial_of(-1e300, NOW as f64),
            denial_of(0.0, NOW as f64 + 0.5),
            Value::Array(vec![]),
            Value::Array(vec![state(0.0, NOW as f64), state(0.0, NOW as f64)]),
            Value::Array(vec![Value::BulkString(vec![0; 16])]),
            Value::Array(vec![Value::Nil]),
        ] {
            assert!(refused(&bad, &acquire()), "{bad:?}");
        }
    }

    #[test]
    fn a_halted_value_and_a_peek_with_its_halt_parse() {
        // An admission's stored value with a halt after it: the state is the same.
        let Value::BulkString(mut bytes) = state(9.5, NOW as f64) else {
            unreachable!("state() makes a bulk string")
        };
        bytes.extend_from_slice(&((NOW + 2_000) as f64).to_le_bytes());
        assert_eq!(decode_halt(&bytes), Some((NOW + 2_000) as f64));
        let admit =
            parse_reply(&Value::BulkString(bytes.clone()), &acquire(), NOW).expect("parses");
        assert_eq!(admit.state.map(|s| s.t), Some(9.5));
        // A denial carrying it.
        let denial = Value::Array(vec![Value::BulkString(bytes)]);
        assert!(
            parse_reply(&denial, &acquire(), NOW).is_err(),
            "9.5 tokens admit"
        );
        let peek = Args {
            op: Op::Peek,
            ..acquire()
        };
        let halt = ((NOW + 2_000) as f64).to_le_bytes();
        let reply = parse_reply(
            &packed([0.0, 100.0, 0.0, 1000.0, NOW as f64], &halt),
            &peek,
            NOW,
        )
        .expect("parses");
        assert_eq!(reply.halt, NOW + 2_000);
        // A peek always carries a halt, whole and in range; nothing else carries one.
        for bad in [
            packed([0.0, 100.0, 0.0, 1000.0, NOW as f64], b""),
            packed([0.0, 100.0, 0.0, 1000.0, NOW as f64], &0.5f64.to_le_bytes()),
            packed(
                [0.0, 100.0, 0.0, 1000.0, NOW as f64],
                &(-1.0f64).to_le_bytes(),
            ),
            packed(
                [0.0, 100.0, 0.0, 1000.0, NOW as f64],
                &f64::NAN.to_le_bytes(),
            ),
        ] {
            assert!(refused(&bad, &peek), "{bad:?}");
        }
        assert!(refused(
            &packed([1.0, 0.0, 9.0, 1500.0, NOW as f64], &halt),
            &acquire()
        ));
    }

    #[test]
    fn the_key_written_into_a_command_is_the_key_named() {
        assert_eq!(FORMAT_PART, format!(":v{FORMAT}:"));
        let key = BucketKey::new("orders", "seller:{7}").expect("a key");
        let redis_key = RedisKey {
            prefix: "app",
            key: &key,
        };
        let cmd = command("EVALSHA", "sha", redis_key, &[7; PACKED_ARGS]);
        let args: Vec<&[u8]> = cmd
            .args_iter()
            .map(|arg| match arg {
                redis::Arg::Simple(bytes) => bytes,
                _ => b"<not a plain argument>",
            })
            .collect();
        let named = redis_key.to_string();
        assert_eq!(
            args,
            [
                b"EVALSHA".as_slice(),
                b"sha",
                b"1",
                named.as_bytes(),
                &[7; PACKED_ARGS]
            ]
        );
        assert_eq!(named, "app:v4:orders:{seller%3A%7B7%7D}");
    }

    /// One bucket's answer to a call on several: the five numbers and the state.
    fn each(numbers: [f64; 5], t: f64, ts: f64) -> Vec<u8> {
        numbers
            .iter()
            .chain([&t, &ts])
            .flat_map(|v| v.to_le_bytes())
            .collect()
    }

    #[test]
    fn a_reply_on_several_buckets_carries_each_state_or_none() {
        let limit = Limit::per_second(10).expect("a limit");
        let (a, b) = (
            BucketKey::new("a", "k").expect("a key"),
            BucketKey::new("b", "k").expect("a key"),
        );
        let takes = [Take::new(&a, limit, 1), Take::new(&b, limit, 1)];
        let now = NOW as f64;
        // Denied: the first bucket in debt since 40 ms ago, the second holding nothing.
        let denial = [
            each([0.0, 140.0, 0.0, 1140.0, now], -1.0, now - 40.0),
            each([0.0, 0.0, 10.0, 0.0, now], 10.0, -1.0),
        ]
        .concat();
        let parsed = parse_all(&Value::BulkString(denial), &takes).expect("parses");
        assert_eq!(
            parsed.iter().map(|e| e.state).collect::<Vec<_>>(),
            [
                Some(State {
                    t: -1.0,
                    ts: now - 40.0
                }),
                None
            ]
        );
        assert_eq!(parsed[0].outcome.wait, 140);
        // Admitted: both stored at the time the waits count from.
        let admission = [
            each([1.0, 0.0, 4.0, 550.0, now], 4.5, now),
            each([1.0, 0.0, 9.0, 100.0, now], 9.0, now),
        ]
        .concat();
        let parsed = parse_all(&Value::BulkString(admission), &takes).expect("parses");
        assert_eq!(parsed[0].state, Some(State { t: 4.5, ts: now }));
        for bad in [
            // An admission with no state, or stored at another time.
            [
                each([1.0, 0.0, 9.0, 100.0, now], 9.0, -1.0),
                each([1.0, 0.0, 9.0, 100.0, now], 9.0, now),
            ],
            [
                each([1.0, 0.0, 9.0, 100.0, now], 9.0, now - 1.0),
                each([1.0, 0.0, 9.0, 100.0, now], 9.0, now),
            ],
            // A denial on a state stored after the time its waits count from.
            [
                each([0.0, 100.0, 0.0, 1000.0, now], 0.0, now + 1.0),
                each([0.0, 0.0, 9.0, 100.0, now], 9.0, now),
            ],
            // A state no script reads or stores, and a marker of no state but -1.
            [
                each([0.0, 100.0, 0.0, 1000.0, now], f64::NAN, now),
                each([0.0, 0.0, 9.0, 100.0, now], 9.0, now),
            ],
            [
                each([0.0, 100.0, 0.0, 1000.0, now], -1e300, now),
                each([0.0, 0.0, 9.0, 100.0, now], 9.0, now),
            ],
            [
                each([0.0, 100.0, 0.0, 1000.0, now], 0.0, now - 0.5),
                each([0.0, 0.0, 9.0, 100.0, now], 9.0, now),
            ],
            [
                each([0.0, 100.0, 0.0, 1000.0, now], 10.0, -2.0),
                each([0.0, 0.0, 9.0, 100.0, now], 9.0, now),
            ],
            // One bucket admitted and the other not.
            [
                each([1.0, 0.0, 9.0, 100.0, now], 9.0, now),
                each([0.0, 100.0, 0.0, 1000.0, now], 0.0, now),
            ],
        ] {
            let value = Value::BulkString(bad.concat());
            assert!(
                matches!(parse_all(&value, &takes), Err(StoreError::Backend(_))),
                "{value:?}"
            );
        }
        // The five numbers alone, as before the states: no decision on each bucket.
        let short = Value::BulkString(vec![0; 80]);
        assert!(parse_all(&short, &takes).is_err());
    }

    #[test]
    fn anything_else_is_a_backend_error() {
        let bad = [
            Value::Array(vec![
                Value::Int(1),
                Value::Int(0),
                Value::Int(1),
                Value::Int(1),
            ]),
            Value::Int(1),
            Value::Nil,
            Value::BulkString(vec![0; 16]),
            Value::BulkString(vec![0; 23]),
            Value::BulkString(vec![0; 25]),
            Value::BulkString(vec![0; 31]),
            Value::BulkString(vec![0; 33]),
            Value::BulkString(vec![0; 48]),
            Value::BulkString(vec![0; 55]),
            Value::BulkString(vec![0; 57]),
            packed([2.0, 0.0, 0.0, 0.0, NOW as f64], b""),
            packed([1.0, -1.0, 0.0, 0.0, NOW as f64], b""),
            packed([1.0, 0.5, 0.0, 0.0, NOW as f64], b""),
            packed([1.0, 0.0, f64::NAN, 0.0, NOW as f64], b""),
            packed([1.0, 0.0, 0.0, f64::INFINITY, NOW as f64], b""),
            packed(
                [1.0, 0.0, 0.0, 9_223_372_036_854_775_808.0, NOW as f64],
                b"",
            ),
        ];
        for value in bad {
            assert!(refused(&value, &acquire()), "{value:?}");
        }
    }
}
