//! Token leases: the reference arithmetic that `store/redis/lease.lua` mirrors, under the same
//! rules as the rest of `bucket.rs` (all in `f64`, in the Lua's order, Lua's tie rule for
//! `min` and `max`, whole parts by truncation of non-negative numbers).
//!
//! A lease is tokens debited from the shared bucket in one step and then spent by one holder
//! (a process) on its own. The bucket keeps, beside its state, a record of each holder's lease:
//! how many tokens it holds and until when. The records make the guarantee exact:
//!
//! - What is out on lease counts against the bucket's capacity: the bucket refills up to its
//!   capacity less the tokens on lease, never further. So at every instant what it holds plus
//!   what is out is at most the burst, and what every holder spends plus what is taken from the
//!   bucket over any window of `w` ms is at most `burst + rate * w`, as for a plain bucket.
//! - A holder tells, each time it renews, how many of its tokens it gives back and how many it
//!   keeps: the rest of its record it spent, and those are gone. The bucket never learns of a
//!   spend before that, so a spent token counts as out until the next renewal (the safe
//!   direction: the bucket refills less, never more).
//! - A record ends at its expiry: its tokens are then lost, not returned, since a holder that
//!   stopped answering (a crash) may have spent them. The holder stops spending before the
//!   expiry by its own clock, with a margin for the clocks' difference.
//!
//! A leased bucket has no waiting reservations and no halt: a key in lease mode is decided by
//! the lease script alone, and the bucket script refuses a value with leases in it.
// The store in this process calls the script, not these functions: they are the reference the
// script is tested against.
#![cfg_attr(not(test), allow(dead_code))]

use super::{MAX_TIME, MAX_TOKENS, Params, State, Verdict, max, min, ready_at, sound, time, whole};

/// The most leases one bucket keeps at once: one per holder.
pub(crate) const MAX_LEASES: usize = 64;

/// The longest lease, in milliseconds.
pub(crate) const MAX_LEASE_MS: u64 = 60_000;

/// One holder's lease: `amount` tokens until `expiry` (ms on the stored times' timeline). Every
/// field is a whole number: `holder` below 2^53, `amount` at most the largest burst.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Lease {
    pub(crate) holder: f64,
    pub(crate) amount: f64,
    pub(crate) expiry: f64,
}

/// What a renewal asks for, all whole numbers: `ret` tokens given back, `keep` kept (to be spent
/// on), `want` more wanted, but none unless at least `least` of them can be had, for a lease of
/// `time` ms from the call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Ask {
    pub(crate) holder: f64,
    pub(crate) ret: f64,
    pub(crate) keep: f64,
    pub(crate) want: f64,
    pub(crate) least: f64,
    pub(crate) time: f64,
}

/// What a renewal decided.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Renewal {
    /// New tokens granted: 0, or from `least` to `want`.
    pub(crate) granted: f64,
    /// The tokens the holder keeps: what it asked to keep, less whatever its record no longer
    /// covers (all of them once the record has expired).
    pub(crate) kept: f64,
    /// When nothing was granted and `least` is above zero: the least ms from `at` until `least`
    /// tokens could be had, if nobody renews meanwhile. 0 otherwise.
    pub(crate) wait: u64,
    /// Whole tokens left in the bucket after the call.
    pub(crate) remaining: u64,
    /// The time the call was made at (the later of the caller's clock and the stored time).
    pub(crate) at: u64,
}

/// What the key holds after a renewal: the state, the leases, and until when the key is kept.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Stored {
    pub(crate) state: State,
    pub(crate) leases: Vec<Lease>,
    pub(crate) keep: f64,
}

/// Whether `l` is a lease the script can have written.
pub(crate) fn sound_lease(l: &Lease) -> bool {
    // NaN fails every comparison.
    l.holder >= 0.0
        && l.holder <= MAX_TIME as f64
        && l.holder as i64 as f64 == l.holder
        && l.amount >= 0.0
        && l.amount <= MAX_TOKENS
        && l.amount as i64 as f64 == l.amount
        && l.expiry >= 0.0
        && l.expiry <= MAX_TIME as f64
        && l.expiry as i64 as f64 == l.expiry
}

/// Whether the stored bucket and leases are ones the scripts can have written under `p`.
pub(crate) fn sound_leased(p: &Params, state: State, leases: &[Lease]) -> bool {
    sound(p, state) && leases.len() <= MAX_LEASES && leases.iter().all(sound_lease)
}

/// A leased bucket as a call at `now` finds it, before it changes anything.
struct Seen {
    /// The stored state, its time moved back from a far lead.
    s: State,
    /// The later of now and the stored time: the call's time.
    ts: f64,
    /// The leases that have not ended by `ts`, in their stored order, and their tokens.
    live: Vec<Lease>,
    out: f64,
    /// The capacity less what is out, and what the bucket holds now, up to it.
    room: f64,
    avail: f64,
}

fn see(p: &Params, state: Option<State>, leases: &[Lease], now: u64) -> Seen {
    let now = time(now);
    let mut s = state.unwrap_or(State {
        t: p.capacity,
        ts: now,
    });
    // A stored time far ahead is moved back, as for a plain bucket (bucket.rs's `available`);
    // the leases keep their expiries, which only keeps their tokens out longer.
    if s.ts > now && s.ts > now + p.lead() {
        s.ts = now;
    }
    let ts = max(s.ts, now);
    let live: Vec<Lease> = leases.iter().copied().filter(|l| l.expiry > ts).collect();
    let mut out = 0.0;
    for l in &live {
        out += l.amount;
    }
    // What refills counts up to the capacity less what is out on lease, and never below
    // nothing: under a limit lowered below what is out, the bucket holds no more debt than it
    // did, which keeps its state one the scripts accept.
    let room = max(0.0, p.capacity - out);
    let elapsed = max(0.0, now - s.ts);
    let avail = min(room, s.t + elapsed * p.tokens / p.interval);
    Seen {
        s,
        ts,
        live,
        out,
        room,
        avail,
    }
}

/// What a leased bucket holds at `now`, as [`super::peek`] says it of a plain one, with the
/// room the leases leave as its capacity: no token comes before the last of them ends while
/// they leave room for none. And the tokens out on lease.
pub(crate) fn peek(p: &Params, state: Option<State>, leases: &[Lease], now: u64) -> (Verdict, f64) {
    let Seen {
        s,
        ts,
        live,
        out,
        room,
        avail,
    } = see(p, state, leases, now);
    let mut next = 0.0;
    if avail < 1.0 {
        next = ready_at(p, s.t, s.ts, 1.0) - ts;
        if room < 1.0 {
            let mut others = ts;
            for l in &live {
                others = max(others, l.expiry);
            }
            next = max(next, others - ts);
        }
    }
    let verdict = Verdict {
        allowed: avail >= 1.0,
        wait: whole(next),
        remaining: whole(max(0.0, avail)),
        reset: whole(max(0.0, ready_at(p, s.t, s.ts, room) - ts)),
        at: whole(ts),
    };
    (verdict, out)
}

/// Renews `ask.holder`'s lease on a bucket stored as `state` with `leases`, at `now`.
///
/// Leases whose expiry is not after the call's time are dropped first, their tokens lost. The
/// holder's own record (if still there) takes back `ret` tokens (at most its amount), keeps
/// `keep` of the rest (at most what remains), and the rest of it was spent. Then, from what the
/// bucket holds with the given-back tokens in it, `want` more are granted if that many whole
/// tokens are there, else as many as there are if at least `least`, else none. The record then
/// holds the kept and granted tokens, until `time` ms from the call; a record of nothing is
/// removed, and a new one goes last; a holder with no record gets nothing while the bucket
/// keeps [`MAX_LEASES`] of them.
pub(crate) fn renew(
    p: &Params,
    state: Option<State>,
    leases: &[Lease],
    now: u64,
    ask: Ask,
) -> (Renewal, Stored) {
    let Seen {
        ts,
        mut live,
        avail,
        ..
    } = see(p, state, leases, now);
    let mine = live.iter().position(|l| l.holder == ask.holder);
    let held = mine.map_or(0.0, |i| live[i].amount);
    let back = min(held, ask.ret);
    let kept = min(held - back, ask.keep);
    let t1 = avail + back;
    let whole_t1 = if t1 > 0.0 { t1 - t1 % 1.0 } else { 0.0 };
    let mut granted = min(ask.want, whole_t1);
    // A new holder gets nothing while the bucket keeps its most leases.
    let capped = mine.is_none() && live.len() >= MAX_LEASES;
    if granted < ask.least || capped {
        granted = 0.0;
    }
    let t2 = t1 - granted;
    let amount = kept + granted;
    // At most the latest time, which every stored time is.
    let expiry = min(MAX_TIME as f64, ts + ask.time);
    match (mine, amount > 0.0) {
        (Some(i), true) => {
            live[i].amount = amount;
            live[i].expiry = expiry;
        }
        (Some(i), false) => {
            live.remove(i);
        }
        (None, true) => live.push(Lease {
            holder: ask.holder,
            amount,
            expiry,
        }),
        (None, false) => {}
    }
    // The latest expiry, and what is out after the call.
    let mut last = ts;
    let mut out2 = 0.0;
    for l in &live {
        last = max(last, l.expiry);
        out2 += l.amount;
    }
    // Kept until the bucket could be full with every lease ended: until the last expiry, then
    // the time to refill from what it holds now (it never holds less meanwhile), and one
    // interval. A key that expired sooner would come back full with tokens still out.
    let full = ready_at(p, t2, ts, p.capacity);
    let keep = last + (full - ts) + p.interval;
    let mut wait = 0.0;
    if granted == 0.0 && ask.least > 0.0 {
        wait = ready_at(p, t2, ts, ask.least) - ts;
        // Fewer tokens than asked fit beside the leases: none come before the others' leases
        // end, the last of them at the latest.
        if p.capacity - out2 < ask.least {
            let mut others = ts;
            for l in &live {
                if l.holder != ask.holder {
                    others = max(others, l.expiry);
                }
            }
            wait = max(wait, others - ts);
        }
        // Kept out by the most leases: not before the first of them ends.
        if capped {
            let first = live.iter().fold(f64::INFINITY, |f, l| min(f, l.expiry));
            wait = max(wait, first - ts);
        }
    }
    let renewal = Renewal {
        granted,
        kept,
        wait: whole(wait),
        remaining: whole(max(0.0, t2)),
        at: whole(ts),
    };
    let stored = Stored {
        state: State { t: t2, ts },
        leases: live,
        keep,
    };
    (renewal, stored)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(tokens: f64, interval: f64, capacity: f64) -> Params {
        Params::new(tokens, interval, capacity)
    }

    fn ask(holder: f64, ret: f64, keep: f64, want: f64, least: f64) -> Ask {
        Ask {
            holder,
            ret,
            keep,
            want,
            least,
            time: 1_000.0,
        }
    }

    #[test]
    fn a_lease_counts_against_the_capacity_until_it_is_renewed() {
        // 10 per second, burst 10: a lease of 6 leaves 4, and however long the bucket waits
        // it refills to 4 only, while the lease is out.
        let p = params(10.0, 1_000.0, 10.0);
        let (r, s) = renew(&p, None, &[], 1_000, ask(1.0, 0.0, 0.0, 6.0, 1.0));
        assert_eq!(r.granted, 6.0);
        assert_eq!(s.state.t, 4.0);
        let (r, s2) = renew(
            &p,
            Some(s.state),
            &s.leases,
            1_900,
            ask(2.0, 0.0, 0.0, 10.0, 1.0),
        );
        assert_eq!(r.granted, 4.0, "the 6 on lease do not refill");
        assert_eq!(s2.state.t, 0.0);
        // The first holder says it spent all 6: they are gone, and the bucket refills from
        // here, up to the capacity less the second holder's 4.
        let (r, s3) = renew(
            &p,
            Some(s2.state),
            &s2.leases,
            1_900,
            ask(1.0, 0.0, 0.0, 0.0, 0.0),
        );
        assert_eq!((r.granted, r.kept), (0.0, 0.0));
        assert_eq!(s3.leases.len(), 1);
        let (r, _) = renew(
            &p,
            Some(s3.state),
            &s3.leases,
            2_800,
            ask(3.0, 0.0, 0.0, 10.0, 1.0),
        );
        assert_eq!(r.granted, 6.0);
    }

    #[test]
    fn given_back_tokens_return_and_an_expired_lease_is_lost() {
        let p = params(1.0, 1_000.0, 10.0);
        let (_, s) = renew(&p, None, &[], 0, ask(1.0, 0.0, 0.0, 5.0, 1.0));
        // 3 back, 1 kept: 1 was spent.
        let (r, s2) = renew(
            &p,
            Some(s.state),
            &s.leases,
            0,
            ask(1.0, 3.0, 1.0, 0.0, 0.0),
        );
        assert_eq!((r.granted, r.kept), (0.0, 1.0));
        assert_eq!(s2.state.t, 8.0);
        // The record of 1 expires at 1000: lost, and the holder keeps nothing.
        let (r, s3) = renew(
            &p,
            Some(s2.state),
            &s2.leases,
            1_000,
            ask(1.0, 0.0, 1.0, 0.0, 0.0),
        );
        assert_eq!(r.kept, 0.0);
        assert!(s3.leases.is_empty());
        // 8 + 1 refilled, and the lost token does not come back with it.
        assert_eq!(s3.state.t, 9.0);
    }

    /// Holders that spend their leases locally, renew, give back, and crash, on one bucket:
    /// over every window, what they admitted together is at most `burst + rate * w`, and when
    /// demand exceeds the limit, most of that budget is used.
    #[test]
    fn admissions_of_every_holder_stay_within_the_plain_bound() {
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut rnd = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n.max(1)
        };
        for (tokens, interval, capacity) in
            [(3.0, 100.0, 10.0), (1.0, 7.0, 40.0), (2.0, 1.0, 200.0)]
        {
            let p = params(tokens, interval, capacity);
            let lease_ms = 50 + rnd(200);
            let mut state = None;
            let mut leases: Vec<Lease> = Vec::new();
            // Per holder: held, spend-by deadline, alive.
            let mut holders = [(0u64, 0u64, true); 4];
            let mut admitted: Vec<u64> = Vec::new();
            for now in 0..20_000u64 {
                for (i, h) in holders.iter_mut().enumerate() {
                    if !h.2 {
                        continue;
                    }
                    if rnd(5_000) == 0 && i > 0 {
                        // Killed: whatever it holds is never given back.
                        h.2 = false;
                        continue;
                    }
                    for _ in 0..rnd(4) {
                        if now >= h.1 {
                            h.0 = 0;
                        }
                        if h.0 > 0 {
                            h.0 -= 1;
                            admitted.push(now);
                            continue;
                        }
                        let give_back = rnd(50) == 0;
                        let a = Ask {
                            holder: i as f64,
                            ret: 0.0,
                            keep: 0.0,
                            want: if give_back {
                                0.0
                            } else {
                                1.0 + rnd(capacity as u64 / 4) as f64
                            },
                            least: if give_back { 0.0 } else { 1.0 },
                            time: lease_ms as f64,
                        };
                        let (r, stored) = renew(&p, state, &leases, now, a);
                        let out: f64 = stored.leases.iter().map(|l| l.amount).sum();
                        assert!(stored.state.t + out <= capacity, "over the burst at {now}");
                        state = Some(stored.state);
                        leases = stored.leases;
                        h.0 = (r.kept + r.granted) as u64;
                        h.1 = now + lease_ms - lease_ms / 4;
                        break;
                    }
                }
            }
            // Every window [a, b] of admissions: at most burst + rate * (b - a). For the window
            // from the i-th to the j-th, j - i + 1 - rate * (t_j - t_i) <= burst: with the
            // largest rate * t_i - i over every i <= j kept, one pass checks every window.
            let rate = tokens / interval;
            let mut best = f64::MIN;
            for (j, &t) in admitted.iter().enumerate() {
                best = best.max(rate * t as f64 - j as f64);
                let most = (j + 1) as f64 - rate * t as f64 + best;
                assert!(
                    most <= capacity + 1e-9,
                    "{most} admitted in one window, burst {capacity}"
                );
            }
            // Demand is several times the limit: the holders used most of the budget.
            let budget = capacity + rate * 20_000.0;
            assert!(
                admitted.len() as f64 >= 0.5 * budget,
                "{} of a budget of {budget}",
                admitted.len()
            );
        }
    }

    #[test]
    fn a_refusal_names_the_time_the_tokens_could_be_had() {
        let p = params(1.0, 100.0, 4.0);
        let (_, s) = renew(&p, None, &[], 0, ask(1.0, 0.0, 0.0, 4.0, 4.0));
        // The other holder's lease of 4 is out until 1000: no token before.
        let (r, _) = renew(
            &p,
            Some(s.state),
            &s.leases,
            10,
            ask(2.0, 0.0, 0.0, 1.0, 1.0),
        );
        assert_eq!((r.granted, r.wait), (0.0, 990));
        // With it given back, the bucket holds what refilled: none is needed.
        let (_, s2) = renew(
            &p,
            Some(s.state),
            &s.leases,
            10,
            ask(1.0, 4.0, 0.0, 0.0, 0.0),
        );
        let (r, _) = renew(
            &p,
            Some(s2.state),
            &s2.leases,
            10,
            ask(2.0, 0.0, 0.0, 1.0, 1.0),
        );
        assert_eq!(r.granted, 1.0);
    }
}
