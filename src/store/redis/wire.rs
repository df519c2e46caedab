//! What goes over the wire to the script and back: the key, the command and its packed
//! argument, the script's replies, and the stored value.
//!
//! This module is the one place that writes and reads that format, and a leaf: it uses nothing of
//! the store's but value types (the arithmetic's, the keys', the limits' and the errors'), so
//! the store, the scripts' calls and the tests all build on it and it on none of them. The
//! workspace's tools reach it through `raw.rs`.

use std::fmt;

use redis::{Cmd, Value};

#[cfg(test)]
use crate::bucket::lease::Lease;
use crate::bucket::lease::{Ask, Renewal};
use crate::bucket::{self, Params, State, Verdict};
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

/// One call of the lease script: a renewal, or a peek (whose `ask` is not read).
#[derive(Debug, Clone, Copy)]
pub(super) struct LeaseArgs {
    pub(super) op: LeaseOp,
    pub(super) limit: Limit,
    pub(super) ask: Ask,
}

impl LeaseArgs {
    /// A peek at a leased bucket under `limit`: no holder, nothing asked.
    pub(super) fn peek(limit: Limit) -> Self {
        Self {
            op: LeaseOp::Peek,
            limit,
            ask: Ask {
                holder: 0.0,
                ret: 0.0,
                keep: 0.0,
                want: 0.0,
                least: 0.0,
                time: 0.0,
            },
        }
    }
}

/// The lease script's operations, by the first number packed into `ARGV[1]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LeaseOp {
    Renew = 1,
    Peek = 2,
}

/// The lease script's one argument: thirteen little-endian `f64`s.
pub(super) const LEASE_ARGS: usize = 13 * 8;

impl LeaseArgs {
    /// `ARGV[1]` as `lease.lua` unpacks it: the operation, now, the limit as the bucket script takes it
    /// (tokens, interval, capacity, lead bound, most debt), then the holder and what it gives
    /// back, keeps, wants and needs at least, and the lease's time.
    pub(super) fn pack(&self, now: u64) -> [u8; LEASE_ARGS] {
        let p = Params::of(&self.limit);
        let a = self.ask;
        let values = [
            self.op as u64 as f64,
            now as f64,
            p.tokens,
            p.interval,
            p.capacity,
            p.lead(),
            p.most_debt(),
            a.holder,
            a.ret,
            a.keep,
            a.want,
            a.least,
            a.time,
        ];
        let mut packed = [0; LEASE_ARGS];
        for (chunk, v) in packed.chunks_exact_mut(8).zip(values) {
            chunk.copy_from_slice(&v.to_le_bytes());
        }
        packed
    }
}

/// One call of the lease script.
pub(super) fn lease_command(
    name: &str,
    script: &str,
    redis_key: RedisKey<'_>,
    packed: &[u8; LEASE_ARGS],
) -> Cmd {
    let mut cmd = Cmd::with_capacity(5, name.len() + script.len() + 1 + 270 + LEASE_ARGS);
    cmd.arg(name)
        .arg(script)
        .arg(1)
        .arg(redis_key_arg(redis_key))
        .arg(&packed[..]);
    cmd
}

/// The lease script's reply: `granted, kept, wait, remaining, at`, five whole `f64`s, of which
/// the grant is at most what was wanted and the tokens kept at most what the holder asked to
/// keep.
pub(super) fn parse_renewal(value: &Value, ask: &Ask) -> Result<Renewal, StoreError> {
    let what = "the lease script answered something other than a renewal";
    let [granted, kept, wait, remaining, at] = whole_numbers(value, what)?;
    let (granted, kept) = (granted as f64, kept as f64);
    let granted_ok = granted == 0.0 || (granted >= ask.least && granted <= ask.want);
    if !granted_ok || kept > ask.keep {
        return Err(StoreError::Backend(BackendError::new(what, None)));
    }
    Ok(Renewal {
        granted,
        kept,
        wait,
        remaining,
        at,
    })
}

/// A reply of `N` little-endian `f64`s, each a whole number the script can answer; `what` says
/// what else it was.
fn whole_numbers<const N: usize>(
    value: &Value,
    what: &'static str,
) -> Result<[u64; N], StoreError> {
    let bad = || StoreError::Backend(BackendError::new(what, None));
    let Value::BulkString(bytes) = value else {
        return Err(bad());
    };
    let (numbers, []) = bytes.as_chunks::<8>() else {
        return Err(bad());
    };
    if numbers.len() != N {
        return Err(bad());
    }
    let mut whole = [0u64; N];
    for (w, b) in whole.iter_mut().zip(numbers) {
        *w = to_whole(f64::from_le_bytes(*b)).ok_or_else(bad)?;
    }
    Ok(whole)
}

/// The lease script's reply to a peek: `allowed, next, remaining, reset, at, out`, six whole
/// `f64`s; the outcome, and the tokens out on lease.
pub(super) fn parse_lease_peek(value: &Value) -> Result<(Verdict, u64), StoreError> {
    let what = "the lease script answered something other than a peek";
    let whole = whole_numbers::<6>(value, what)?;
    let [allowed, wait, remaining, reset, at, out] = whole;
    if allowed > 1 {
        return Err(StoreError::Backend(BackendError::new(what, None)));
    }
    let outcome = Verdict {
        allowed: allowed == 1,
        wait,
        remaining,
        reset,
        at,
    };
    Ok((outcome, out))
}

/// A value the lease script stored: the state, the leases, and `keep`; `None` for any other
/// length.
#[cfg(test)]
pub(super) fn decode_leased(value: &[u8]) -> Option<(State, Vec<Lease>, f64)> {
    let (head, rest) = value.split_first_chunk::<24>()?;
    let (numbers, []) = head.as_chunks::<8>() else {
        return None;
    };
    let [t, ts, keep] = numbers else { return None };
    let (records, []) = rest.as_chunks::<24>() else {
        return None;
    };
    let leases = records
        .iter()
        .map(|r| {
            let (f, _) = r.as_chunks::<8>();
            Lease {
                holder: f64::from_le_bytes(f[0]),
                amount: f64::from_le_bytes(f[1]),
                expiry: f64::from_le_bytes(f[2]),
            }
        })
        .collect();
    Some((
        State {
            t: f64::from_le_bytes(*t),
            ts: f64::from_le_bytes(*ts),
        },
        leases,
        f64::from_le_bytes(*keep),
    ))
}

/// What the script answered.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Reply {
    pub(super) outcome: Verdict,
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
        outcome: Verdict {
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
    let audited = takes.iter().filter(|t| t.audit().is_some()).count();
    cmd.arg(name).arg(script).arg(takes.len() + audited);
    for take in takes {
        cmd.arg(redis_key_arg(RedisKey {
            prefix,
            key: take.key(),
        }));
    }
    for take in takes.iter().filter(|t| t.audit().is_some()) {
        cmd.arg(audit_key(prefix, take.key()));
    }
    cmd.arg(packed);
    if audited > 0 {
        let mut records = Vec::with_capacity(36 * audited);
        for (place, take) in takes.iter().enumerate() {
            let Some(audit) = take.audit() else { continue };
            for v in [
                (place + 1) as f64,
                f64::from(audit.cap().get()),
                // Whole milliseconds within 2^53, exact in a double.
                audit.retain_ms().min(crate::bucket::MAX_TIME) as f64,
            ] {
                records.extend_from_slice(&v.to_le_bytes());
            }
            records.extend_from_slice(take.key().fingerprint().as_bytes());
        }
        cmd.arg(records);
        for take in takes {
            if let Some(audit) = take.audit() {
                cmd.arg(audit.process_label());
            }
        }
    }
    cmd
}

/// The audit stream beside a bucket's key: `<prefix>:audit:v1:<bucket>:{<key>}`, with the same
/// hash tag, so in the same Redis Cluster slot.
pub(super) fn audit_key(prefix: &str, key: &crate::BucketKey) -> String {
    [prefix, AUDIT_PART, key.bucket(), ":{", key.caller(), "}"].concat()
}

/// The part of an audit stream's key after the prefix and before the bucket name.
const AUDIT_PART: &str = ":audit:v1:";

/// What the several-bucket script answered for one bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Each {
    pub(super) outcome: Verdict,
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
            let outcome = Verdict {
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
pub(super) mod tests;
