// Over 600 lines: one idea, the reference arithmetic that the Lua scripts mirror step by step.
//! The reference token-bucket arithmetic (docs/DESIGN.md, "One arithmetic, two mirrors").
//!
//! Every store decides through these functions, and `store/redis/bucket.lua` mirrors them
//! operation for operation. The two must agree to the last bit, so the rules here are stricter
//! than plain Rust would need:
//!
//! - All arithmetic is in `f64`, in the same order as the Lua. Times are whole milliseconds since
//!   the Unix epoch, clamped to [`MAX_TIME`] so that every time is an exact `f64`.
//! - `min`/`max` are written out as comparisons with Lua's tie rule (on a tie the first argument
//!   wins), because `f64::min` may pick either zero when comparing `0.0` with `-0.0`.
//! - The refill over `e` milliseconds is always `e * tokens / interval`, multiplied first, so a
//!   whole number of intervals refills a whole number of tokens exactly.
//! - Waits are not a bare `ceil(deficit / rate)`: the estimate is corrected until it is the least
//!   whole millisecond at which [`evaluate`] itself would admit. That is what makes "admitted at
//!   `now + wait`, denied one millisecond earlier" hold exactly, whatever the rounding. Because
//!   the correction alone fixes the answer, the estimate is the one step free to differ from the
//!   Lua: here it multiplies by a rate computed with the [`Params`], where the Lua divides.
//! - Divisions are the slowest steps, so where the result is known without one it is taken
//!   without one, and it is the same value to the bit: a refill over 0 or 1 ms ([`refill`]), and
//!   a refill long enough to fill the bucket, however it rounds ([`refills_to_full`]). The Lua
//!   always divides.

use smallvec::SmallVec;

use crate::Limit;

/// One item per bucket of a request on several at once: on the stack for up to four.
pub(crate) type PerBucket<T> = SmallVec<[T; 4]>;

/// The largest time, in milliseconds since the Unix epoch, the arithmetic works with (2^53 − 1,
/// about 285,000 years), the clocks' own bound. Later times are clamped to it; every smaller time
/// is an exact `f64`.
pub(crate) const MAX_TIME: u64 = crate::clock::LATEST_MS;

/// The longest reservation, in milliseconds (2^44, about 557 years); longer `max_wait`s are
/// clamped to it. It bounds the debt a bucket can carry, which keeps every wait far below 2^53
/// and so every step of [`ready_at`] exact.
pub(crate) const MAX_WAIT: u64 = 1 << 44;

/// The most tokens a stored state can hold, under any limit (a burst is a `u32`).
const MAX_TOKENS: f64 = 4_294_967_296.0;

/// The most steps either walk of [`ready_at`] takes. From a sound state the first estimate is
/// off by at most one, so the bound is never reached; it is there so that no stored value, sound
/// or not, can make a walk run on (above 2^53, `e + 1 == e`).
const WALK: u32 = 8;

/// The stored state of one bucket: `t` tokens available at `ts` (milliseconds since the epoch).
///
/// `t` may be negative: a reservation debits tokens that have not refilled yet.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct State {
    pub(crate) t: f64,
    pub(crate) ts: f64,
}

/// A limit in the arithmetic's own terms: `tokens` refill every `interval` milliseconds, up to
/// `capacity`. All three are whole numbers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Params {
    pub(crate) tokens: f64,
    pub(crate) interval: f64,
    pub(crate) capacity: f64,
    /// `interval / tokens`, for [`ready_at`]'s first estimate only. Dividing here, before a
    /// decision reads its clock or locks its bucket, takes one division off the chain of
    /// dependent ones that each decision waits for.
    ms_per_token: f64,
    /// `refill(1)`, exactly: `1 * tokens` is `tokens`, so this is the same division.
    per_ms: f64,
}

// The two bounds are worked out when asked for, from the quotients above with products only:
// a decision asks for them only when the stored time is ahead of its clock or the bucket in
// debt, and the script takes them as they are (packed into its argument), so no Lua expression
// has to match them.
impl Params {
    /// The parameters of `limit`, as the arithmetic computes with them.
    pub(crate) fn of(limit: &Limit) -> Self {
        Self::new(
            f64::from(limit.tokens()),
            limit.interval_ms() as f64,
            f64::from(limit.burst()),
        )
    }

    /// How far a stored time may lead the caller's clock, in milliseconds: the time to refill an
    /// empty bucket, rounded up, plus one interval. No write leads the writer's own clock, so a
    /// lead beyond this is a clock that stepped back, or a writer whose clock runs far ahead.
    #[inline]
    pub(crate) fn lead(&self) -> f64 {
        estimate_ceil(self.capacity * self.ms_per_token) + self.interval
    }

    /// The most debt a sound state carries, in tokens: reservations and drains each reach at
    /// most [`MAX_WAIT`] ahead, and one cost on top.
    #[inline]
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn most_debt(&self) -> f64 {
        2.0 * MAX_WAIT as f64 * self.per_ms + self.capacity
    }

    pub(crate) fn new(tokens: f64, interval: f64, capacity: f64) -> Self {
        Self {
            tokens,
            interval,
            capacity,
            ms_per_token: interval / tokens,
            per_ms: tokens / interval,
        }
    }
}

/// What one call decided, in whole milliseconds and whole tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// Admitted now (`wait == 0`) or after `wait` (a reservation).
    pub(crate) allowed: bool,
    /// Until admission when allowed, until it could be admitted when denied.
    pub(crate) wait: u64,
    /// Whole tokens left after the decision.
    pub(crate) remaining: u64,
    /// Until the bucket is full again.
    pub(crate) reset: u64,
    /// The time the waits count from: the later of the caller's clock and the stored time (after
    /// a stored time far ahead was moved back). An admission's slot is `at + wait`, on the
    /// timeline of the stored times, which is what a refund names its reservation by.
    pub(crate) at: u64,
}

/// The state to store after a call that writes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Write {
    pub(crate) state: State,
    /// The time the write was made at: the later of the caller's clock and the stored time.
    /// Waits and the key's expiry count from it.
    pub(crate) at: f64,
    /// When the bucket is full again, in milliseconds since the epoch; from then on the state
    /// says nothing a missing one would not, and can be dropped.
    pub(crate) full: f64,
}

impl Write {
    /// How long in milliseconds a key written must live: until the bucket is full again, plus
    /// one interval of margin, counted from the time of the write. The script keeps it at least
    /// that long (see `bucket.lua`); `MemoryStore` drops buckets by [`full`](Self::full) instead.
    #[cfg(test)]
    pub(crate) fn ttl(&self, p: &Params) -> u64 {
        whole(self.full - self.at + p.interval)
    }

    /// What the script answers for a refund or a drain that wrote `self`, and what an
    /// admission with no wait answers: the script sends only the state it stored then, and
    /// the caller works this out from it.
    pub(crate) fn outcome(&self) -> Verdict {
        Verdict {
            allowed: true,
            wait: 0,
            remaining: whole_tokens(self.state.t),
            reset: whole(self.full - self.at),
            at: whole(self.at),
        }
    }
}

/// Lua's `math.min(a, b)`: `b` only when strictly smaller.
fn min(a: f64, b: f64) -> f64 {
    if b < a { b } else { a }
}

/// Lua's `math.max(a, b)`: `b` only when strictly larger.
fn max(a: f64, b: f64) -> f64 {
    if b > a { b } else { a }
}

/// Clamps a time to [`MAX_TIME`] and makes it an `f64`, exactly.
pub(crate) fn time(ms: u64) -> f64 {
    if ms > MAX_TIME {
        MAX_TIME as f64
    } else {
        ms as f64
    }
}

/// Converts a whole, non-negative `f64` millisecond count back to `u64` (saturating, and zero
/// for anything not above zero).
fn whole(ms: f64) -> u64 {
    // Through `i64`, a conversion is one instruction and a check; straight to `u64` it also
    // splits at 2^63, which no count here reaches (they stay below 2^54).
    if ms > 0.0 { ms as i64 as u64 } else { 0 }
}

/// Tokens refilled over `elapsed` milliseconds, before the cap.
///
/// The division is the slowest step of a decision, so the two most common spans skip it with
/// the very value it would give: none (a second decision within the same millisecond) and one
/// (the first step of [`ready_at`]'s walk under a fast limit).
fn refill(p: &Params, elapsed: f64) -> f64 {
    if elapsed == 0.0 {
        0.0
    } else if elapsed == 1.0 {
        p.per_ms
    } else {
        elapsed * p.tokens / p.interval
    }
}

/// The earliest time at which a bucket stored as `(t, ts)` holds at least `target` tokens: `ts`
/// plus the least whole `e >= 0` with `t + refill(e) >= target`.
// Always inlined: every admission walks to its refill time, and as a call of its own (which the
// compiler chooses once the walks carry their bound) it slows every MemoryStore decision
// (docs/PERFORMANCE.md, "What a decision costs", has the figure).
#[inline(always)]
fn ready_at(p: &Params, t: f64, ts: f64, target: f64) -> f64 {
    if t >= target {
        return ts;
    }
    let mut e = estimate_ceil((target - t) * p.ms_per_token);
    // The estimate is off by at most one either way; walk it to the exact answer. `t +
    // refill(e)` never falls as `e` grows (every rounding step is monotonic), so the walk ends
    // on the least `e` from any start, and the answer is the Lua's whatever the estimate. The
    // two walks share a bound of [`WALK`] steps, as in the Lua.
    let mut n = 0;
    while n < WALK && t + refill(p, e) < target {
        e += 1.0;
        n += 1;
    }
    while n < WALK && e > 0.0 && t + refill(p, e - 1.0) >= target {
        e -= 1.0;
        n += 1;
    }
    ts + e
}

/// `x.ceil()` for the positive estimate in [`ready_at`], inlined: `f64::ceil` is a library call
/// here (no SSE4.1 at the crate's baseline target). Beyond 2^52 every `f64` is whole already.
fn estimate_ceil(x: f64) -> f64 {
    if x < 4_503_599_627_370_496.0 {
        let whole = x as i64 as f64;
        if whole < x { whole + 1.0 } else { whole }
    } else {
        x
    }
}

/// Whether `elapsed` milliseconds refill a bucket holding `t` to capacity with room to spare,
/// found with a product instead of [`refill`]'s division: what the division would give then
/// does not matter, since the cap takes it.
///
/// The test asks for the refill, before any rounding, to be at least twice the gap to capacity
/// (four times, computed, which covers the relative error of a few roundings, each at most
/// 2^-53). The rounded refill is then still above the gap, the rounded sum of `t` and the refill
/// at least the capacity, and `min(capacity, t + refill(elapsed))` the capacity. A gap of zero or
/// less (a bucket full already) passes whenever the refill is positive, and also gives the
/// capacity.
fn refills_to_full(p: &Params, t: f64, elapsed: f64) -> bool {
    elapsed * p.tokens > 4.0 * ((p.capacity - t) * p.interval)
}

/// Whether `s` is a state the arithmetic can have stored under the limit `p`: finite, at most
/// the largest burst, with no more debt than reservations and drains leave, at a whole time
/// within range. The walks to a refill time end, exactly, only from such a state, so both
/// mirrors refuse any other before deciding (someone else wrote the key).
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn sound(p: &Params, s: State) -> bool {
    // NaN fails every comparison.
    (s.t >= 0.0 || s.t >= -p.most_debt())
        && s.t <= MAX_TOKENS
        && s.ts >= 0.0
        && s.ts <= MAX_TIME as f64
        && s.ts as i64 as f64 == s.ts
}

/// Tokens available at `now` and the time to store with them. A missing state is a full bucket.
///
/// A stored time that leads `now` by more than the limit's lead bound is moved back to `now`
/// (the last value returned says so): a host whose clock ran years ahead, or an NTP step back
/// here, would otherwise freeze the bucket for that long. Within the bound, a lead is another
/// writer's clock, and a caller behind it is taken to stand at the stored time. Every operation but a
/// peek stores the moved time, even a denial, so that the refill runs from it; a bound that
/// moved with each caller's clock would never let it start.
fn available(p: &Params, state: Option<State>, now: f64) -> (State, f64, f64, bool) {
    let mut s = state.unwrap_or(State {
        t: p.capacity,
        ts: now,
    });
    // A sound stored time is at most MAX_TIME, so a bound beyond it moves nothing. Asked for
    // only when the stored time is ahead at all, which is rare.
    let clamped = s.ts > now && s.ts > now + p.lead();
    if clamped {
        s.ts = now;
    }
    // A clock behind the stored time refills nothing, and the stored time never moves back.
    let elapsed = max(0.0, now - s.ts);
    let avail = if refills_to_full(p, s.t, elapsed) {
        p.capacity
    } else {
        min(p.capacity, s.t + refill(p, elapsed))
    };
    (s, avail, max(s.ts, now), clamped)
}

/// The write for a new state.
#[inline]
pub(crate) fn write(p: &Params, t: f64, ts: f64) -> Write {
    Write {
        state: State { t, ts },
        at: ts,
        full: ready_at(p, t, ts, p.capacity),
    }
}

/// The Lua's `math.floor(math.max(0, t))`: `whole` truncates, which for a non-negative number is
/// the floor.
fn whole_tokens(t: f64) -> u64 {
    whole(max(0.0, t))
}

/// Takes `cost` tokens at `now`, or reserves them when they refill within `max_wait`
/// milliseconds, or denies, writing nothing unless the stored time had to be moved back to the
/// lead bound. `cost` must be in `1..=capacity`.
// Always inlined: as a call of its own (which the compiler chose in some callers) this took a
// share of every `MemoryStore` decision, its result going back through memory
// (docs/PERFORMANCE.md, "What a decision costs", has the figure).
#[inline(always)]
pub(crate) fn evaluate(
    p: &Params,
    state: Option<State>,
    now: u64,
    cost: f64,
    max_wait: u64,
) -> (Verdict, Option<Write>) {
    let now = time(now);
    let max_wait = if max_wait > MAX_WAIT {
        MAX_WAIT as f64
    } else {
        max_wait as f64
    };
    let (s, avail, ts, clamped) = available(p, state, now);
    let (wait, over) = if avail >= cost {
        (0.0, 0.0)
    } else {
        // Measured from the stored state, as a later call would measure it.
        let ready = ready_at(p, s.t, s.ts, cost);
        // A reservation is served at `ready`, a whole millisecond at or after the exact refill
        // time. Whatever the bucket would hold above capacity by then is lost, as it would be
        // for a request arriving at `ready`; without this, the rounding slack of one reservation
        // would be credited to the next and two could go out less than cost/rate apart.
        let over = max(0.0, s.t + refill(p, ready - s.ts) - p.capacity);
        // Counted from the later of now and the stored time: a caller whose clock is behind
        // stands where the stored time's writer stood, so clock skew does not decide who waits.
        (ready - ts, over)
    };
    if wait <= max_wait {
        let w = write(p, avail - cost - over, ts);
        let outcome = Verdict {
            allowed: true,
            wait: whole(wait),
            remaining: whole_tokens(w.state.t),
            reset: whole(w.full - ts),
            at: whole(ts),
        };
        (outcome, Some(w))
    } else {
        let outcome = Verdict {
            allowed: false,
            wait: whole(wait),
            remaining: whole_tokens(avail),
            reset: whole(ready_at(p, s.t, s.ts, p.capacity) - ts),
            at: whole(ts),
        };
        (outcome, clamped.then(|| write(p, s.t, s.ts)))
    }
}

/// One bucket of [`evaluate_all`]: its limit, its stored state and what the request costs there
/// (in `1..=capacity`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Part {
    pub(crate) p: Params,
    pub(crate) state: Option<State>,
    pub(crate) cost: f64,
}

/// Takes `cost` tokens from every bucket of `parts` at once, or from none: the request goes when
/// the last of its buckets has its tokens, `W` after the call (the largest of the buckets' own
/// waits, counted as each counts its own from the later of now and its stored time), and is
/// denied when `W` exceeds `max_wait`.
///
/// Admitted, every bucket is debited as if the request were served at its slot, the later of
/// now and its stored time plus `W`:
///
/// - A bucket whose own wait is `W` is debited exactly as [`evaluate`] debits it: the slot is
///   its own refill time.
/// - Any other is debited its cost, and whatever it would hold above capacity by its slot is
///   lost, as for a request arriving at the slot (and as [`evaluate`] loses the rounding slack of
///   a reservation): otherwise the tokens that refill while a request waits on another bucket
///   would be credited to this one's next caller, and two requests could go out less than
///   cost/rate apart on it.
///
/// Every outcome of an admission has the wait `W`, and its own remaining tokens, reset and time
/// `at`: the slot its reservation names is `at + W`. A denial writes nothing, unless a stored
/// time far ahead was moved back, and each outcome carries its bucket's own wait (the request's
/// is the largest). With one bucket, this is [`evaluate`], to the bit.
///
/// Each bucket's outcome and write go to `each`, in the order of `parts`, so that a store
/// writes them where it holds the buckets with no list in between; the request's admission is
/// returned.
pub(crate) fn evaluate_all(
    parts: &[Part],
    now: u64,
    max_wait: u64,
    mut each: impl FnMut(Verdict, Option<Write>),
) -> bool {
    let now = time(now);
    let max_wait = if max_wait > MAX_WAIT {
        MAX_WAIT as f64
    } else {
        max_wait as f64
    };
    // Each bucket's own wait; the rest of what `available` says is worked out again below,
    // which costs less than keeping it.
    let waits: PerBucket<f64> = parts
        .iter()
        .map(|part| {
            let (s, avail, ts, _) = available(&part.p, part.state, now);
            if avail >= part.cost {
                0.0
            } else {
                ready_at(&part.p, s.t, s.ts, part.cost) - ts
            }
        })
        .collect();
    // Lua's tie rule: the first of equal waits stands.
    let request_wait = waits.iter().fold(0.0, |w, &wait| max(w, wait));
    let admitted = request_wait <= max_wait;
    for (part, &wait) in parts.iter().zip(&waits) {
        let p = &part.p;
        let (s, avail, ts, clamped) = available(p, part.state, now);
        if admitted {
            let over = if request_wait == 0.0 {
                0.0
            } else if wait == request_wait {
                max(0.0, s.t + refill(p, ts + wait - s.ts) - p.capacity)
            } else {
                max(0.0, avail + refill(p, request_wait) - p.capacity)
            };
            let w = write(p, avail - part.cost - over, ts);
            let outcome = Verdict {
                allowed: true,
                wait: whole(request_wait),
                remaining: whole_tokens(w.state.t),
                reset: whole(w.full - ts),
                at: whole(ts),
            };
            each(outcome, Some(w));
        } else {
            let outcome = Verdict {
                allowed: false,
                wait: whole(wait),
                remaining: whole_tokens(avail),
                reset: whole(ready_at(p, s.t, s.ts, p.capacity) - ts),
                at: whole(ts),
            };
            each(outcome, clamped.then(|| write(p, s.t, s.ts)));
        }
    }
    admitted
}

/// [`evaluate_all`] with its outcomes and writes collected, for the tests.
#[cfg(test)]
pub(crate) fn evaluate_all_collected(
    parts: &[Part],
    now: u64,
    max_wait: u64,
) -> (bool, Vec<(Verdict, Option<Write>)>) {
    let mut decided = Vec::with_capacity(parts.len());
    let admitted = evaluate_all(parts, now, max_wait, |o, w| decided.push((o, w)));
    (admitted, decided)
}

/// What a bucket holds at `now`, without taking or writing anything.
pub(crate) fn peek(p: &Params, state: Option<State>, now: u64) -> Verdict {
    let now = time(now);
    let (s, avail, ts, _) = available(p, state, now);
    // A token available now is available now. Otherwise the token is due after the later of
    // now and the stored time, from which every wait counts.
    let next = if avail >= 1.0 {
        0.0
    } else {
        ready_at(p, s.t, s.ts, 1.0) - ts
    };
    Verdict {
        allowed: avail >= 1.0,
        wait: whole(next),
        remaining: whole_tokens(avail),
        reset: whole(max(0.0, ready_at(p, s.t, s.ts, p.capacity) - ts)),
        at: whole(ts),
    }
}

/// The answer of an operation that changed nothing (a refund that gave nothing back, a block
/// whose deadline is not ahead, a lowering to more than the bucket holds): what the bucket holds,
/// and no write, unless a stored time far ahead was moved back (`clamped`).
fn unchanged(p: &Params, s: State, avail: f64, ts: f64, clamped: bool) -> (Verdict, Option<Write>) {
    let outcome = Verdict {
        allowed: false,
        wait: 0,
        remaining: whole_tokens(avail),
        reset: whole(max(0.0, ready_at(p, s.t, s.ts, p.capacity) - ts)),
        at: whole(ts),
    };
    (outcome, clamped.then(|| write(p, s.t, s.ts)))
}

/// Gives back the `cost` tokens of a reservation whose slot was `ready` (milliseconds on the
/// stored times' timeline), never above capacity, but only where no other reservation could
/// lose its slot by it: the outcome is allowed when the tokens went back.
///
/// - A slot still ahead (`ready` after the later of now and the stored time) goes back only
///   while it is the last one queued: the bucket then holds, at `ready`, about nothing (it
///   reached zero at most a millisecond's refill before its whole-millisecond slot, give or take
///   a rounding). A later reservation, of a token at least, leaves it a token in debt there; a
///   refund already made leaves it `cost` up. So the test is "more than half a token in debt
///   and less than `cost` less half a token". That is exact while a millisecond refills at most
///   a quarter of a token (the slot is up to two milliseconds' refill past the zero); under a
///   faster limit a waiting reservation's refund is refused, and its tokens stay spent.
/// - A slot already due goes back only while the bucket is in no debt: debt now means later
///   reservations, whose slots the tokens would move.
///
/// Otherwise the tokens stay spent, the safe direction. Nothing is written then, unless a stored
/// time far ahead was moved back.
pub(crate) fn refund(
    p: &Params,
    state: Option<State>,
    now: u64,
    cost: f64,
    ready: u64,
) -> (Verdict, Option<Write>) {
    let now = time(now);
    let ready = time(ready);
    let (s, avail, ts, clamped) = available(p, state, now);
    let applies = if ready > ts {
        let held = s.t + refill(p, ready - s.ts);
        p.per_ms <= 0.25 && held > -0.5 && held < cost - 0.5
    } else {
        avail >= 0.0
    };
    if applies {
        let w = write(p, min(p.capacity, avail + cost), ts);
        return (w.outcome(), Some(w));
    }
    unchanged(p, s, avail, ts, clamped)
}

/// Empties the bucket until `until`: nothing is available before it, and the first token is due
/// one token period after it. Reservations already queued keep their places, and a drain that
/// ends before the last of them changes nothing, so a drain repeated is the drain once.
///
/// Written as debt at the time of the call, not as a stored time ahead of it: stored times never
/// lead the writer's clock, which is what lets a far lead be taken for a clock that moved. A
/// deadline more than [`MAX_WAIT`] ahead is taken as that.
pub(crate) fn drain_until(p: &Params, state: Option<State>, now: u64, until: u64) -> Write {
    let now = time(now);
    let (_, avail, ts, _) = available(p, state, now);
    write(p, min(avail, drain_floor(p, ts, until)), ts)
}

/// The debt a drain at `ts` until `until` leaves: what refills to zero at the deadline, taken as
/// at most [`MAX_WAIT`] ahead; none for a deadline already past.
fn drain_floor(p: &Params, ts: f64, until: u64) -> f64 {
    let mut until = time(until);
    if until > ts + MAX_WAIT as f64 {
        until = ts + MAX_WAIT as f64;
    }
    if until > ts {
        -((until - ts) * p.tokens / p.interval)
    } else {
        0.0
    }
}

/// Sets the bucket to hold exactly `tokens` (the caller keeps them within the burst) at the
/// later of `now` and the stored time, refilling from there. Whatever the bucket held or owed
/// is forgotten: the debt of queued reservations, and the halt of a drain (a store writes no
/// halt with this state), whose rule that every later reservation is slotted at the halt or
/// later would no longer hold.
pub(crate) fn set(p: &Params, state: Option<State>, now: u64, tokens: f64) -> Write {
    let now = time(now);
    let (_, _, ts, _) = available(p, state, now);
    write(p, tokens, ts)
}

/// Lowers the bucket to `tokens` whole tokens at the later of `now` and the stored time, when
/// it holds more whole tokens then, keeping its fraction of the next one, and refills from
/// there; a bucket holding `tokens` whole tokens or fewer (one in debt, say) is left as it is:
/// never raised. For a client told by the upstream how many requests it has left, when someone
/// else spends the same budget: the count is of whole requests, and says nothing of how far the
/// upstream is into its next token, so the bucket keeps its own progress rather than lose up
/// to a token's refill to every report. The outcome is allowed when the bucket was lowered.
/// Nothing is written otherwise, unless a stored time far ahead was moved back. The halt is
/// kept (the caller's): lowering only moves later reservations later, so every reservation
/// granted after a drain is still slotted at its halt or later.
pub(crate) fn lower(
    p: &Params,
    state: Option<State>,
    now: u64,
    tokens: f64,
) -> (Verdict, Option<Write>) {
    let now = time(now);
    let (s, avail, ts, clamped) = available(p, state, now);
    // The Lua's `avail - avail % 1`, its whole tokens: above `tokens`, it is at least 1, and
    // truncation is the floor.
    if tokens + 1.0 <= avail {
        let whole = avail as i64 as f64;
        let w = write(p, tokens + (avail - whole), ts);
        return (w.outcome(), Some(w));
    }
    unchanged(p, s, avail, ts, clamped)
}

/// Blocks the bucket until `until`: no token is available before it, and the first one is
/// available at it, to the millisecond. Reservations already queued past `until` keep their
/// places (the bucket keeps the deeper debt), so the first token is then later. A deadline not
/// after the later of `now` and the stored time changes nothing, and writes nothing unless a
/// stored time far ahead was moved back; one more than [`MAX_WAIT`] ahead is taken as that.
///
/// Not a drain until one token period before `until`: a drain leaves the debt that refills to
/// exactly zero at its deadline, so when the token period is a whole number of milliseconds the
/// first token falls exactly on a millisecond, and the rounding of the two refills decides
/// whether it is admitted there or a millisecond later. The debt here is the midpoint of the
/// two refills, to `until` and to one millisecond before it: the bucket holds half a
/// millisecond's refill more than a token at `until` and half a millisecond's refill less one
/// millisecond earlier, which no rounding of refills below 2^44 ms reaches.
pub(crate) fn block_until(
    p: &Params,
    state: Option<State>,
    now: u64,
    until: u64,
) -> (Verdict, Option<Write>) {
    let now = time(now);
    let (s, avail, ts, clamped) = available(p, state, now);
    if let Some(until) = block_deadline(ts, until) {
        let w = write(p, min(avail, block_floor(p, ts, until)), ts);
        return (w.outcome(), Some(w));
    }
    unchanged(p, s, avail, ts, clamped)
}

/// The deadline of a block at `ts`, taken as at most [`MAX_WAIT`] ahead; `None` when it is not
/// after `ts`.
fn block_deadline(ts: f64, until: u64) -> Option<f64> {
    let mut until = time(until);
    if until > ts + MAX_WAIT as f64 {
        until = ts + MAX_WAIT as f64;
    }
    (until > ts).then_some(until)
}

/// What a block at `ts` until `until` (from [`block_deadline`]) leaves the bucket holding:
/// `1 - (refill(e) + refill(e - 1)) / 2` for the `e` milliseconds to the deadline, written out
/// as the Lua writes it.
fn block_floor(p: &Params, ts: f64, until: f64) -> f64 {
    let e = until - ts;
    1.0 - (e * p.tokens / p.interval + (e - 1.0) * p.tokens / p.interval) / 2.0
}

/// The halt a [`block_until`] at `now` stores: its deadline (within [`MAX_WAIT`]), which is the
/// first token after the block on an empty queue, unless a later halt is kept already; the halt
/// kept, as [`halt`] keeps it, when the deadline is not ahead.
pub(crate) fn block_halt(p: &Params, state: Option<State>, halt: f64, now: u64, until: u64) -> f64 {
    let kept = self::halt(p, state, halt, now, None);
    let (_, _, ts, _) = available(p, state, time(now));
    match block_deadline(ts, until) {
        Some(until) => max(kept, until),
        None => kept,
    }
}

/// The write that forgets a bucket, for a store that cannot remove it at once: a state every
/// operation, under any limit, reads as a missing one (more tokens than any burst holds, so the
/// bucket is full; stored at time 0, so no clock is behind it and the waits count from the
/// caller's clock), full since time 0, so that the store drops it with its full buckets.
pub(crate) const FORGOTTEN: Write = Write {
    state: State {
        t: MAX_TOKENS,
        ts: 0.0,
    },
    at: 0.0,
    full: 0.0,
};

/// The bucket's halt as a call at `now` sees it, and as the call stores it if it writes: the
/// time of the first token after the latest drain, before which no reservation may go. A
/// reservation granted before a drain whose slot is earlier than the halt was drained past, and
/// must be made again; every reservation granted after the drain has its slot at the halt or
/// later, since the drain's debt is refilled by then and not before. `halt` is the stored one,
/// 0 for none (and for a missing bucket); `drain` is the deadline of a drain made by this call.
///
/// - A drain sets the halt to its first token, `ready_at(floor, ts, 1)` from the debt it would
///   leave on an empty queue, unless a later halt is stored already; a deadline already past
///   still halts for one token period, as the drain still empties the bucket.
/// - A halt is kept while it is less than the limit's lead bound behind the call's time: after
///   that no waiting reservation can still be checking against it, and the stored value goes
///   back to its short form.
/// - A stored time moved back from a far lead takes its halt with it: the halt was set on the
///   clock that ran ahead.
pub(crate) fn halt(
    p: &Params,
    state: Option<State>,
    halt: f64,
    now: u64,
    drain: Option<u64>,
) -> f64 {
    let now = time(now);
    let (_, _, ts, clamped) = available(p, state, now);
    let kept = if !clamped && halt + p.lead() > ts {
        halt
    } else {
        0.0
    };
    match drain {
        Some(until) => {
            // The deadline is at most the latest time, its first token may be just past it.
            let first = min(
                MAX_TIME as f64,
                ready_at(p, drain_floor(p, ts, until), ts, 1.0),
            );
            max(kept, first)
        }
        None => kept,
    }
}

/// Whether a reservation slotted at `slot` was drained past by the halt `halt` (both in ms on the
/// stored timeline, 0 for no halt). A slot within a millisecond of the halt stands: a reservation
/// granted after the drain, from a state rewritten since at a later time, can be slotted a
/// millisecond before the halt by rounding, and must not be sent to the back of the queue for
/// it. A reservation granted before the drain that is let through this way goes at most a
/// millisecond early.
pub(crate) fn halts(halt: u64, slot: u64) -> bool {
    slot.saturating_add(1) < halt
}

/// Whether `halt` is a halt the arithmetic can have stored: 0 (none), or a whole time within
/// range. Both mirrors refuse a stored value with any other.
#[cfg_attr(not(feature = "redis"), allow(dead_code))]
pub(crate) fn sound_halt(halt: f64) -> bool {
    // NaN fails every comparison.
    halt >= 0.0 && halt <= MAX_TIME as f64 && halt as i64 as f64 == halt
}

#[cfg(feature = "redis")]
pub(crate) mod lease;

#[cfg(test)]
mod tests;
