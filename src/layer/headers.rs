//! The rate-limit header fields: `RateLimit-Policy` and `RateLimit` of
//! draft-ietf-httpapi-ratelimit-headers-10 by default, or the separate `RateLimit-Limit`,
//! `RateLimit-Remaining` and `RateLimit-Reset` of its drafts up to 06, and the whole seconds
//! they and `Retry-After` are written in. They go on every response, so they are written by hand
//! without `format!`; the tests parse every shape written with an RFC 9651 parser.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};

use crate::{Decision, Limit};

/// `RateLimit-Policy`: named quota policies (draft 10), or the integer policy of the limit
/// closest to exhaustion (drafts 05 and 06).
pub(crate) static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (draft 10).
pub(crate) static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
/// `RateLimit-Limit` (drafts up to 06).
pub(crate) static RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("ratelimit-limit");
/// `RateLimit-Remaining` (drafts up to 06).
pub(crate) static RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("ratelimit-remaining");
/// `RateLimit-Reset` (drafts up to 06).
pub(crate) static RATELIMIT_RESET: HeaderName = HeaderName::from_static("ratelimit-reset");

/// Which rate-limit header fields a [`RateLimitLayer`](super::RateLimitLayer) writes, chosen
/// with [`RateLimitLayer::fields`](super::RateLimitLayer::fields). The numbers are the same in
/// both; the [module docs](super#the-rate-limit-fields) say what they mean for a token bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum FieldVersion {
    /// The fields of draft-ietf-httpapi-ratelimit-headers-10, the current draft (the default):
    /// `RateLimit-Policy: "<rule>";q=<quota>;w=<window>` and
    /// `RateLimit: "<rule>";r=<remaining>;t=<seconds>`, one item for each rule that applied,
    /// named by its bucket.
    #[default]
    Draft10,
    /// The separate fields of drafts 00 to 06, which many clients still read:
    /// `RateLimit-Limit: <quota>`, `RateLimit-Remaining: <remaining>` and
    /// `RateLimit-Reset: <seconds>`, with `RateLimit-Policy: <quota>;w=<window>` (drafts 05 and
    /// 06). They describe one limit, so when several rules applied they are those of the rule
    /// with the fewest tokens left (on a rejection, the rule that refused), as draft 06 asks.
    Draft06,
}

/// The largest Integer a structured field may hold (RFC 9651, section 3.3.1). No limit reaches
/// it; every number written is clamped to it all the same, so that no field can be malformed.
const MAX_INTEGER: u64 = 999_999_999_999_999;

/// Whole seconds, rounded up: a client that waits this long is never early.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    u64::try_from(d.as_nanos().div_ceil(1_000_000_000)).unwrap_or(u64::MAX)
}

/// Whole seconds in `ms` milliseconds, rounded up.
fn ms_to_secs(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A policy's quota and window (`q` and `w`) for a token bucket, both honest:
///
/// - `w` is the time an empty bucket takes to refill, in whole seconds rounded up, at least 1
///   (the draft has no sub-second windows).
/// - `q` is how many requests the limit lets through, sustained, over `w`: the tokens refilled
///   in `w`, rounded down. As `w` is at least the refill time, that is never below the burst, so
///   a full bucket also takes the first `burst` of them at once.
///
/// "10/s burst 3" is `q=10;w=1` (not `q=3;w=1`, which would be 3 per second), "1/min burst 10"
/// is `q=10;w=600`, "10/s burst 20" is `q=20;w=2`.
pub(crate) fn quota(limit: Limit) -> (u64, u64) {
    let window = ms_to_secs(millis(limit.refill_time())).max(1);
    let refilled =
        u128::from(limit.tokens()) * u128::from(window) * 1000 / u128::from(limit.interval_ms());
    let quota = u64::try_from(refilled)
        .unwrap_or(u64::MAX)
        .max(u64::from(limit.burst()));
    (quota.min(MAX_INTEGER), window.min(MAX_INTEGER))
}

/// Milliseconds until a bucket under `limit` holds one more whole token, from what a decision
/// carries: `remaining` whole tokens and `resets_in_ms` until full. Zero only for a full bucket,
/// otherwise at least 1.
///
/// The bucket holds `remaining` tokens and a fraction; its next whole token is the
/// `remaining + 1`th, and `burst - remaining - 1` tokens are still missing after it. The time to
/// full less their refill time is the time to that token. `resets_in_ms` is rounded up to the
/// millisecond and the time taken off it rounded down, so the result is not early by the exact
/// arithmetic (the stores' floating-point bucket may reach the token a millisecond later), and at
/// most a millisecond late.
fn next_token_ms(limit: Limit, remaining: u32, resets_in_ms: u64) -> u64 {
    let missing = limit.burst().saturating_sub(remaining);
    if missing == 0 || resets_in_ms == 0 {
        return 0;
    }
    let others = u64::from(missing - 1);
    let tokens = u64::from(limit.tokens());
    // A 64-bit division when the product fits, as it does for every common limit; the quotient
    // fits in any case, being below the refill time from empty.
    let others_ms = match others.checked_mul(limit.interval_ms()) {
        Some(product) => product / tokens,
        None => {
            let ms = u128::from(others) * u128::from(limit.interval_ms()) / u128::from(tokens);
            u64::try_from(ms).unwrap_or(u64::MAX)
        }
    };
    resets_in_ms.saturating_sub(others_ms).max(1)
}

/// Header text written on the stack, so that building a header value costs one allocation (the
/// value's own copy) and none of `format!`'s machinery: these are written on every request.
pub(crate) struct Text {
    inline: [u8; INLINE],
    len: usize,
    /// Everything written, once it no longer fits `inline` (several long rule names).
    spilled: Vec<u8>,
}

/// Room for two items of the longest rule names, more than one request usually needs.
const INLINE: usize = 256;

impl Text {
    pub(crate) fn new() -> Self {
        Self {
            inline: [0; INLINE],
            len: 0,
            spilled: Vec::new(),
        }
    }

    #[inline]
    pub(crate) fn push(&mut self, bytes: &[u8]) {
        let end = self.len + bytes.len();
        match self.inline.get_mut(self.len..end) {
            Some(room) if self.spilled.is_empty() => {
                room.copy_from_slice(bytes);
                self.len = end;
            }
            _ => self.spill(bytes),
        }
    }

    #[cold]
    fn spill(&mut self, bytes: &[u8]) {
        if self.spilled.is_empty() {
            self.spilled.reserve(2 * (self.len + bytes.len()));
            self.spilled.extend_from_slice(&self.inline[..self.len]);
        }
        self.spilled.extend_from_slice(bytes);
    }

    /// `n` in decimal.
    pub(crate) fn push_u64(&mut self, n: u64) {
        self.push(decimal(n, &mut [0; 20]));
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        if self.spilled.is_empty() {
            &self.inline[..self.len]
        } else {
            &self.spilled
        }
    }

    /// The text as a header value; `None` when nothing was written.
    pub(crate) fn header_value(&self) -> Option<HeaderValue> {
        let bytes = self.as_bytes();
        if bytes.is_empty() {
            return None;
        }
        HeaderValue::from_bytes(bytes).ok()
    }
}

/// The decimal digits of `n`, written at the end of `buf`, two at a time: token counts near
/// `u32::MAX` are ten digits, and this runs for every response.
pub(crate) fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
        2021222324252627282930313233343536373839\
        4041424344454647484950515253545556575859\
        6061626364656667686970717273747576777879\
        8081828384858687888990919293949596979899";
    let mut at = buf.len();
    while n >= 100 {
        let pair = (n % 100) as usize * 2;
        n /= 100;
        at -= 2;
        buf[at..at + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
    }
    if n >= 10 {
        let pair = n as usize * 2;
        at -= 2;
        buf[at..at + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
    } else {
        at -= 1;
        buf[at] = b'0' + n as u8;
    }
    &buf[at..]
}

/// One rule's item of the draft-10 `RateLimit-Policy`, `"<name>";q=<quota>;w=<window>` (see
/// [`quota`]). It depends only on the rule, so each rule builds it once.
pub(crate) fn policy_item(name: &str, limit: Limit) -> Option<HeaderValue> {
    let (q, w) = quota(limit);
    let mut out = Text::new();
    out.push(b"\"");
    out.push(name.as_bytes());
    out.push(b"\";q=");
    out.push_u64(q);
    out.push(b";w=");
    out.push_u64(w);
    out.header_value()
}

/// The draft-10 `RateLimit-Policy` for the rules that applied, from their prebuilt items: one
/// rule's item is shared as it is, several are joined.
pub(crate) fn policy<'a>(items: impl Iterator<Item = &'a HeaderValue>) -> Option<HeaderValue> {
    let mut items = items.peekable();
    let first = items.next()?;
    if items.peek().is_none() {
        return Some(first.clone());
    }
    let mut out = Text::new();
    out.push(first.as_bytes());
    for item in items {
        out.push(b", ");
        out.push(item.as_bytes());
    }
    out.header_value()
}

/// One rule that applied, as the draft-10 `RateLimit-Policy` names it: its item, built once, and
/// what builds another when the limit it applied is not its own (a dynamic limit).
#[derive(Clone, Copy)]
pub(crate) struct Applied<'a> {
    /// The rule's prebuilt item, for its own limit.
    pub(crate) item: &'a HeaderValue,
    pub(crate) name: &'a str,
    /// The rule's own limit.
    pub(crate) own: Limit,
    /// The limit the rule applied to the request.
    pub(crate) limit: Limit,
}

/// The draft-10 `RateLimit-Policy` of a request, the one place a layer builds it: `applied` are
/// the rules that applied, in order, each once, of the layer's `rules`; `all` is the value
/// prebuilt for every rule, and `any_dynamic` whether any rule has a dynamic limit. The prebuilt
/// values while every limit is its rule's own, built afresh for a dynamic one.
#[inline]
pub(crate) fn policy_for<'a>(
    all: Option<&HeaderValue>,
    rules: usize,
    any_dynamic: bool,
    applied: impl Iterator<Item = Applied<'a>> + Clone,
) -> Option<HeaderValue> {
    // Every rule applied, none with a dynamic limit, the usual case: the value prebuilt for them
    // all, taken here rather than after the general case's checks.
    if !any_dynamic && applied.clone().count() == rules {
        return all.cloned();
    }
    if !any_dynamic || applied.clone().all(|a| a.limit == a.own) {
        if applied.clone().count() == rules {
            return all.cloned();
        }
        return policy(applied.map(|a| a.item));
    }
    let items: Vec<HeaderValue> = applied
        .filter_map(|a| policy_item(a.name, a.limit))
        .collect();
    policy(items.iter())
}

/// One rule's state after a request: an item of the draft-10 `RateLimit` field, or what the
/// draft-06 fields are made of.
#[derive(Clone, Copy)]
pub(crate) struct Item<'a> {
    pub(crate) name: &'a str,
    pub(crate) limit: Limit,
    pub(crate) remaining: u32,
    /// Until the bucket holds one more whole token; zero only when it is full.
    pub(crate) next_ms: u64,
    /// Until the rule could admit the request it refused; zero when it admitted it.
    pub(crate) retry_ms: u64,
}

impl<'a> Item<'a> {
    /// A rule that admitted the request (now, or after a wait).
    pub(crate) fn admitted(name: &'a str, decision: &Decision) -> Self {
        let limit = decision.limit();
        Self {
            name,
            limit,
            remaining: decision.remaining(),
            next_ms: next_token_ms(limit, decision.remaining(), millis(decision.resets_in())),
            retry_ms: 0,
        }
    }

    /// The rule that refused the request. Its next token may come before the request's cost
    /// could be served (a cost above one), never after. When the next token is what the request
    /// waits for (within the millisecond either way that the two are computed to), it is the
    /// store's own time for it, so that `t` and `Retry-After` agree.
    pub(crate) fn denied(name: &'a str, decision: &Decision) -> Self {
        let retry_ms = millis(decision.wait());
        let admitted = Self::admitted(name, decision);
        let next_ms = if admitted.next_ms.saturating_add(1) >= retry_ms {
            retry_ms
        } else {
            admitted.next_ms
        };
        Self {
            next_ms,
            retry_ms,
            ..admitted
        }
    }

    /// An earlier rule's item after its `cost` tokens were given back. Exact for tokens taken
    /// at once: the bucket holds `cost` more and the same fraction, so its next whole token is
    /// as far off as it was (the tokens given back only bring its time to full closer), unless
    /// it is full again. A reservation's item stays as the store reported it, since that bucket
    /// held fewer whole tokens than the cost anyway.
    pub(crate) fn refunded(name: &'a str, decision: &Decision, cost: u32) -> Self {
        let admitted = Self::admitted(name, decision);
        if !decision.wait().is_zero() {
            return admitted;
        }
        let burst = admitted.limit.burst();
        let remaining = admitted.remaining.saturating_add(cost).min(burst);
        let next_ms = if remaining >= burst {
            0
        } else {
            admitted.next_ms
        };
        Self {
            remaining,
            next_ms,
            ..admitted
        }
    }

    /// `t`: whole seconds until the next token.
    fn next_secs(&self) -> u64 {
        ms_to_secs(self.next_ms).min(MAX_INTEGER)
    }

    /// `RateLimit-Reset` of the drafts up to 06: the time to the next token, or on a refusal
    /// the time the request could be served, the point in time `Retry-After` names.
    fn reset_secs(&self) -> u64 {
        ms_to_secs(self.next_ms.max(self.retry_ms)).min(MAX_INTEGER)
    }
}

/// The draft-10 `RateLimit` field: `"<name>";r=<remaining>;t=<seconds until the next token>`
/// for each rule that applied.
pub(crate) fn ratelimit<'a>(items: impl Iterator<Item = Item<'a>>) -> Option<HeaderValue> {
    let mut items = items.peekable();
    let first = items.next()?;
    if items.peek().is_none() {
        return ratelimit_one(&first);
    }
    let mut out = Text::new();
    for item in [first].into_iter().chain(items) {
        if !out.as_bytes().is_empty() {
            out.push(b", ");
        }
        out.push(b"\"");
        out.push(item.name.as_bytes());
        out.push(b"\";r=");
        out.push_u64(u64::from(item.remaining));
        out.push(b";t=");
        out.push_u64(item.next_secs());
    }
    out.header_value()
}

/// The `RateLimit` field of one rule, the usual case, written straight into a buffer of its
/// exact length that becomes the value's own: no room on the stack to clear first, and no copy.
fn ratelimit_one(item: &Item<'_>) -> Option<HeaderValue> {
    let (mut r, mut t) = ([0; 20], [0; 20]);
    let r = decimal(u64::from(item.remaining), &mut r);
    let t = decimal(item.next_secs(), &mut t);
    let name = item.name.as_bytes();
    // The two quotes, `;r=` and `;t=` are the 8 bytes besides the name and the numbers.
    let mut out = Vec::with_capacity(name.len() + r.len() + t.len() + 8);
    out.push(b'"');
    out.extend_from_slice(name);
    out.extend_from_slice(b"\";r=");
    out.extend_from_slice(r);
    out.extend_from_slice(b";t=");
    out.extend_from_slice(t);
    // A vector as long as its capacity becomes `Bytes` without another allocation.
    HeaderValue::from_maybe_shared(Bytes::from(out)).ok()
}

/// The rate-limit fields of one response, ready to go into its headers.
#[derive(Debug)]
pub(crate) enum Fields {
    /// `RateLimit-Policy` and `RateLimit`.
    Draft10 {
        policy: HeaderValue,
        ratelimit: HeaderValue,
    },
    /// The numbers of the draft-06 fields, written out when they are inserted: kept as numbers,
    /// they leave the response future no larger than the default format does.
    Draft06 {
        limit: Limit,
        remaining: u32,
        reset_secs: u64,
    },
}

/// The fields, in the format `version` names, for the rules that applied, described by
/// `items`. `policy` gives the draft-10 `RateLimit-Policy` from the rules' prebuilt items, and is
/// called for that format only.
pub(crate) fn fields<'a>(
    version: FieldVersion,
    policy: impl FnOnce() -> Option<HeaderValue>,
    items: impl Iterator<Item = Item<'a>>,
) -> Option<Fields> {
    match version {
        FieldVersion::Draft10 => {
            let (policy, ratelimit) = policy().zip(ratelimit(items))?;
            Some(Fields::Draft10 { policy, ratelimit })
        }
        FieldVersion::Draft06 => {
            // The limit closest to exhaustion: the fewest tokens left, and of those the one
            // whose reset is furthest off.
            let item = items.min_by_key(|i| (i.remaining, std::cmp::Reverse(i.reset_secs())))?;
            Some(Fields::Draft06 {
                limit: item.limit,
                remaining: item.remaining,
                reset_secs: item.reset_secs(),
            })
        }
    }
}

impl Fields {
    /// Inserts the fields into `headers`, replacing any of the same names.
    #[inline]
    pub(crate) fn insert_into(self, headers: &mut HeaderMap) {
        match self {
            Self::Draft10 { policy, ratelimit } => {
                headers.insert(RATELIMIT_POLICY.clone(), policy);
                headers.insert(RATELIMIT.clone(), ratelimit);
            }
            Self::Draft06 {
                limit,
                remaining,
                reset_secs,
            } => insert_draft06(headers, limit, remaining, reset_secs),
        }
    }
}

/// The draft-06 fields, written out. Apart from the default's two inserts, so that writing
/// those, on every admitted response, does not set up the room this text needs.
fn insert_draft06(headers: &mut HeaderMap, limit: Limit, remaining: u32, reset_secs: u64) {
    let (q, w) = quota(limit);
    let mut policy = Text::new();
    policy.push_u64(q);
    policy.push(b";w=");
    policy.push_u64(w);
    if let Some(policy) = policy.header_value() {
        headers.insert(RATELIMIT_POLICY.clone(), policy);
    }
    headers.insert(RATELIMIT_LIMIT.clone(), HeaderValue::from(q));
    headers.insert(RATELIMIT_REMAINING.clone(), HeaderValue::from(remaining));
    headers.insert(RATELIMIT_RESET.clone(), HeaderValue::from(reset_secs));
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use sfv::{BareItem, ListEntry, Parser};

    use super::*;
    use crate::bucket::{self, Params, State};

    fn limit(tokens: u32, interval_ms: u64, burst: u32) -> Limit {
        Limit::new(tokens, Duration::from_millis(interval_ms))
            .and_then(|l| l.with_burst(burst))
            .expect("a valid limit")
    }

    /// A request of `cost` at `now` (ms) on a bucket stored as `state`, as every store decides
    /// it, with the state it leaves.
    fn decide(
        limit: Limit,
        state: Option<State>,
        now: u64,
        cost: u32,
        max_wait: u64,
    ) -> (Decision, Option<State>) {
        let p = Params::of(&limit);
        let (outcome, write) = bucket::evaluate(&p, state, now, f64::from(cost), max_wait);
        let state = write.map(|w| w.state).or(state);
        (Decision::new(outcome, limit, cost), state)
    }

    /// `n` requests of cost 1 at 0 ms on a full bucket, then the decision on one more at `at`.
    fn after(limit: Limit, n: u32, at: u64) -> (Decision, Option<State>) {
        let mut state = None;
        for _ in 0..n {
            state = decide(limit, state, 0, 1, 0).1;
        }
        decide(limit, state, at, 1, 0)
    }

    fn text(v: Option<HeaderValue>) -> Option<String> {
        v.and_then(|v| v.to_str().ok().map(str::to_owned))
    }

    #[test]
    fn seconds_round_up() {
        assert_eq!(ceil_secs(Duration::ZERO), 0);
        assert_eq!(ceil_secs(Duration::from_millis(1)), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1000)), 1);
        assert_eq!(ceil_secs(Duration::from_millis(1001)), 2);
        assert_eq!(ceil_secs(Duration::MAX), u64::MAX);
    }

    #[test]
    fn text_writes_numbers_and_spills_past_its_inline_room() {
        let mut text = Text::new();
        for n in [0, 7, 10, 99, 1_000_000, u64::from(u32::MAX), u64::MAX] {
            text.push_u64(n);
            text.push(b" ");
        }
        let written = "0 7 10 99 1000000 4294967295 18446744073709551615 ";
        assert_eq!(text.as_bytes(), written.as_bytes());
        let long = "x".repeat(INLINE);
        text.push(long.as_bytes());
        text.push(b"!");
        assert_eq!(text.as_bytes(), format!("{written}{long}!").as_bytes());
        assert!(Text::new().header_value().is_none());
        for n in (0..=100_000).chain([u64::from(u32::MAX) - 1, u64::MAX - 1]) {
            assert_eq!(decimal(n, &mut [0; 20]), n.to_string().as_bytes());
        }
    }

    #[test]
    fn quota_and_window_are_what_the_limit_sustains() {
        for (l, q, w) in [
            // A refill from empty under a second: the window is one second, and the quota what
            // refills in it, not the burst.
            (limit(10, 1000, 3), 10, 1),
            (limit(10, 1000, 10), 10, 1),
            (limit(10, 1000, 20), 20, 2),
            (limit(1, 60_000, 10), 10, 600),
            (limit(1, 60_000, 1), 1, 60),
            (limit(100, 3_600_000, 100), 100, 3600),
            // 1.5 s to refill from empty: two seconds, in which 4 tokens refill.
            (limit(3, 1500, 3), 4, 2),
            // 3/7 s from empty, 2.33 tokens a second: 2, rounded down, sustained.
            (limit(7, 3000, 1), 2, 1),
            (limit(5, 2000, 5), 5, 2),
            // Extremes: every token a millisecond, and the slowest limits.
            (limit(u32::MAX, 1, u32::MAX), u64::from(u32::MAX) * 1000, 1),
            (limit(u32::MAX, 1, 1), u64::from(u32::MAX) * 1000, 1),
            (limit(1, 1 << 42, 1), 1, (1u64 << 42).div_ceil(1000)),
            (
                limit(u32::MAX, 1 << 42, u32::MAX),
                u64::from(u32::MAX),
                (1u64 << 42).div_ceil(1000),
            ),
            (limit(u32::MAX, 1000, u32::MAX), u64::from(u32::MAX), 1),
            (
                limit(u32::MAX - 1, 1000, u32::MAX),
                u64::from(u32::MAX - 1) * 2,
                2,
            ),
        ] {
            assert_eq!(quota(l), (q, w), "{l}");
        }
        let item = policy_item("per-key", limit(10, 1000, 3));
        assert_eq!(text(item).as_deref(), Some("\"per-key\";q=10;w=1"));
    }

    proptest! {
        #[test]
        fn quota_is_honest(
            tokens in 1..=u32::MAX,
            interval_ms in prop_oneof![1..=100_000u64, 1..=(1u64 << 42)],
            burst in 1..=u32::MAX,
        ) {
            let Ok(l) = Limit::new(tokens, Duration::from_millis(interval_ms))
                .and_then(|l| l.with_burst(burst))
            else {
                return Ok(());
            };
            let (q, w) = quota(l);
            prop_assert!(w >= 1 && w * 1000 >= millis(l.refill_time()));
            // Not a second more than needed.
            prop_assert!((w - 1) * 1000 < millis(l.refill_time()).max(1));
            prop_assert!(q >= u64::from(l.burst()));
            // `q` per `w` is at most the rate, and less than one token under it.
            let rate_times_w = u128::from(tokens) * u128::from(w) * 1000;
            prop_assert!(u128::from(q) * u128::from(interval_ms) <= rate_times_w);
            prop_assert!(rate_times_w < (u128::from(q) + 1) * u128::from(interval_ms));
            prop_assert!(q <= MAX_INTEGER);
        }
    }

    #[test]
    fn t_is_zero_only_for_a_full_bucket() {
        let l = limit(10, 1000, 3);
        // Full: nothing to wait for.
        assert_eq!(next_token_ms(l, 3, 0), 0);
        assert_eq!(next_token_ms(l, 3, 100), 0);
        // Not full, however little is missing: at least a millisecond, so t is at least 1.
        assert_eq!(next_token_ms(l, 2, 1), 1);
        assert_eq!(next_token_ms(l, 0, 1), 1);
        // The first request leaves 2 and a bucket refilling: the next token in 100 ms, t=1.
        let (d, _) = after(l, 0, 0);
        let item = Item::admitted("per-key", &d);
        assert_eq!(
            (item.remaining, item.next_ms, item.next_secs()),
            (2, 100, 1)
        );
        // Empty: the next token 100 ms after the third request.
        let (d, _) = after(l, 2, 0);
        let item = Item::admitted("per-key", &d);
        assert_eq!((item.remaining, item.next_ms), (0, 100));
        // 30 ms later, 70 ms to go, and a fraction of a token in the bucket.
        let (d, _) = after(l, 2, 30);
        assert_eq!(d.remaining(), 0);
        assert_eq!(Item::admitted("per-key", &d).next_ms, 70);
        // "1/min burst 10", two taken at once: 8 left, and the next token in a minute.
        let l = limit(1, 60_000, 10);
        let (d, _) = after(l, 1, 0);
        let item = Item::admitted("orders", &d);
        assert_eq!((item.remaining, item.next_secs()), (8, 60));
        // Twenty seconds on, the fraction refilled counts: 40 s to the next token.
        let (d, _) = after(l, 1, 20_000);
        let item = Item::admitted("orders", &d);
        assert_eq!((item.remaining, item.next_secs()), (8, 40));
        // Emptied: every request refused until the next token, which the item names.
        let (d, _) = after(l, 10, 15_000);
        assert!(!d.is_admitted());
        let item = Item::denied("orders", &d);
        assert_eq!(
            (item.remaining, item.next_ms, item.retry_ms),
            (0, 45_000, 45_000)
        );
        let r = ratelimit([item].into_iter());
        assert_eq!(text(r).as_deref(), Some("\"orders\";r=0;t=45"));
    }

    #[test]
    fn a_denied_items_t_is_the_next_token_and_its_reset_the_retry() {
        // Cost 3 with 1 token left: the next token in 100 ms, the cost served in 200 ms.
        let l = limit(10, 1000, 3);
        let (_, state) = decide(l, None, 0, 2, 0);
        let (d, _) = decide(l, state, 0, 3, 0);
        assert!(!d.is_admitted());
        let item = Item::denied("per-key", &d);
        assert_eq!((item.remaining, item.next_ms, item.retry_ms), (1, 100, 200));
        // A reservation in debt: the next whole token after the debt is paid.
        let (_, state) = decide(l, None, 0, 3, 0);
        let (d, _) = decide(l, state, 0, 2, 1000);
        assert_eq!(
            (d.is_admitted(), d.wait()),
            (true, Duration::from_millis(200))
        );
        let item = Item::admitted("per-key", &d);
        assert_eq!((item.remaining, item.next_ms), (0, 300));
    }

    #[test]
    fn a_refund_gives_back_tokens_and_keeps_the_next_token_where_it_was() {
        let l = limit(10, 1000, 3);
        let (d, _) = after(l, 1, 30);
        let admitted = Item::admitted("per-key", &d);
        assert_eq!((admitted.remaining, admitted.next_ms), (1, 70));
        let refunded = Item::refunded("per-key", &d, 1);
        assert_eq!((refunded.remaining, refunded.next_ms), (2, 70));
        // Back to full: t=0.
        let (d, _) = after(l, 0, 0);
        let refunded = Item::refunded("per-key", &d, 1);
        assert_eq!((refunded.remaining, refunded.next_ms), (3, 0));
        // A reservation's item is the store's.
        let (_, state) = decide(l, None, 0, 3, 0);
        let (d, _) = decide(l, state, 0, 1, 1000);
        let refunded = Item::refunded("per-key", &d, 1);
        assert_eq!((refunded.remaining, refunded.next_ms), (0, 200));
    }

    #[test]
    fn a_requests_policy_is_prebuilt_unless_a_dynamic_limit_is_not_its_rules_own() {
        let rules = [
            ("per-key", limit(10, 1000, 10)),
            ("orders", limit(1, 60_000, 10)),
        ];
        let items: Vec<HeaderValue> = rules
            .iter()
            .filter_map(|&(name, own)| policy_item(name, own))
            .collect();
        let all = policy(items.iter());
        let of = |any_dynamic, applied: &[(usize, Limit)]| {
            let applied = applied.iter().map(|&(i, limit)| Applied {
                item: &items[i],
                name: rules[i].0,
                own: rules[i].1,
                limit,
            });
            text(policy_for(all.as_ref(), rules.len(), any_dynamic, applied))
        };
        let both = "\"per-key\";q=10;w=1, \"orders\";q=10;w=600";
        for any_dynamic in [false, true] {
            assert_eq!(
                of(any_dynamic, &[(0, rules[0].1), (1, rules[1].1)]).as_deref(),
                Some(both)
            );
            assert_eq!(
                of(any_dynamic, &[(1, rules[1].1)]).as_deref(),
                Some("\"orders\";q=10;w=600")
            );
            assert!(of(any_dynamic, &[]).is_none());
        }
        // A dynamic limit other than its rule's own: that item is built afresh.
        let other = limit(1, 60_000, 1);
        assert_eq!(
            of(true, &[(0, rules[0].1), (1, other)]).as_deref(),
            Some("\"per-key\";q=10;w=1, \"orders\";q=1;w=60")
        );
    }

    #[test]
    fn draft10_fields_follow_the_draft() {
        let a = limit(10, 1000, 10);
        let b = limit(1, 60_000, 10);
        let items = [policy_item("per-key", a), policy_item("orders", b)];
        let items: Vec<HeaderValue> = items.into_iter().flatten().collect();
        let p = policy(items.iter());
        assert_eq!(
            text(p).as_deref(),
            Some("\"per-key\";q=10;w=1, \"orders\";q=10;w=600")
        );
        assert_eq!(policy(items[1..].iter()).as_ref(), Some(&items[1]));
        assert!(policy(std::iter::empty()).is_none());
        let (da, _) = after(a, 6, 0);
        let (db, _) = after(b, 0, 0);
        let out = fields(
            FieldVersion::Draft10,
            || policy(items.iter()),
            [
                Item::admitted("per-key", &da),
                Item::admitted("orders", &db),
            ]
            .into_iter(),
        );
        let mut headers = HeaderMap::new();
        out.expect("fields").insert_into(&mut headers);
        assert_eq!(
            headers.get(&RATELIMIT).and_then(|v| v.to_str().ok()),
            Some("\"per-key\";r=3;t=1, \"orders\";r=9;t=60")
        );
        assert_eq!(
            headers.get(&RATELIMIT_POLICY),
            policy(items.iter()).as_ref()
        );
        assert_eq!(headers.len(), 2);
        // One rule's field is written by a path of its own: the same text.
        let one = ratelimit([Item::admitted("orders", &db)].into_iter());
        assert_eq!(text(one).as_deref(), Some("\"orders\";r=9;t=60"));
        let (first, _) = after(a, 0, 0);
        let one = ratelimit([Item::admitted("per-key", &first)].into_iter());
        assert_eq!(text(one).as_deref(), Some("\"per-key\";r=9;t=1"));
    }

    #[test]
    fn draft06_fields_describe_the_limit_closest_to_exhaustion() {
        let a = limit(10, 1000, 3);
        let b = limit(1, 60_000, 10);
        let (da, _) = after(a, 1, 0);
        let (db, _) = after(b, 7, 0);
        let items = || {
            [
                Item::admitted("per-key", &da),
                Item::admitted("orders", &db),
            ]
        };
        let called = std::cell::Cell::new(false);
        let policy = || {
            called.set(true);
            None
        };
        let out = fields(FieldVersion::Draft06, policy, items().into_iter());
        assert!(
            !called.get(),
            "the draft-10 policy is not built for draft 06"
        );
        let mut headers = HeaderMap::new();
        out.expect("fields").insert_into(&mut headers);
        let get = |name: &HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
        // "per-key" has 1 left, "orders" 2: "per-key" is closest.
        assert_eq!(get(&RATELIMIT_LIMIT), Some("10"));
        assert_eq!(get(&RATELIMIT_REMAINING), Some("1"));
        assert_eq!(get(&RATELIMIT_RESET), Some("1"));
        assert_eq!(get(&RATELIMIT_POLICY), Some("10;w=1"));
        assert_eq!(get(&RATELIMIT), None);
        assert_eq!(headers.len(), 4);
        // On a refusal, the refusing rule, with the reset at its retry.
        let (_, state) = decide(a, None, 0, 2, 0);
        let (denied, _) = decide(a, state, 0, 3, 0);
        let (db, _) = after(b, 0, 0);
        let out = fields(
            FieldVersion::Draft06,
            || None,
            [
                Item::refunded("orders", &db, 1),
                Item::denied("per-key", &denied),
            ]
            .into_iter(),
        );
        let mut headers = HeaderMap::new();
        out.expect("fields").insert_into(&mut headers);
        let get = |name: &HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
        assert_eq!(get(&RATELIMIT_REMAINING), Some("1"));
        assert_eq!(get(&RATELIMIT_RESET), Some("1"));
        assert_eq!(get(&RATELIMIT_LIMIT), Some("10"));
        // Ties go to the later reset.
        let (d1, _) = after(a, 2, 0);
        let (d2, _) = after(b, 9, 0);
        let picked = fields(
            FieldVersion::Draft06,
            || None,
            [
                Item::admitted("per-key", &d1),
                Item::admitted("orders", &d2),
            ]
            .into_iter(),
        );
        assert!(
            matches!(picked, Some(Fields::Draft06 { reset_secs: 60, .. })),
            "{picked:?}"
        );
        assert!(fields(FieldVersion::Draft06, || None, std::iter::empty()).is_none());
    }

    /// An item's bare value and its parameters, each an Integer.
    type Parsed = (BareItem, Vec<(String, i64)>);

    /// A list of items with Integer parameters, as `sfv` parses it.
    fn parse_list(v: &HeaderValue) -> Result<Vec<Parsed>, String> {
        let list: sfv::List = Parser::new(v.as_bytes())
            .parse()
            .map_err(|e| format!("{v:?} is not a list: {e}"))?;
        list.into_iter()
            .map(|entry| match entry {
                ListEntry::Item(item) => {
                    let params = item
                        .params
                        .iter()
                        .map(|(k, v)| match v.as_integer() {
                            Some(n) => Ok((k.as_str().to_owned(), i64::from(n))),
                            None => Err(format!("parameter {k:?} of {v:?} is no integer")),
                        })
                        .collect::<Result<_, _>>()?;
                    Ok((item.bare_item, params))
                }
                ListEntry::InnerList(_) => Err(format!("{v:?} has an inner list")),
            })
            .collect()
    }

    fn parse_integer(v: Option<&HeaderValue>) -> Option<i64> {
        let item: sfv::Item = Parser::new(v?.as_bytes()).parse().ok()?;
        if !item.params.is_empty() {
            return None;
        }
        item.bare_item.as_integer().map(i64::from)
    }

    fn string(name: &str) -> BareItem {
        BareItem::String(sfv::String::from_string(name.to_owned()).expect("a valid string"))
    }

    fn int(n: u64) -> i64 {
        i64::try_from(n).expect("within an sf-integer")
    }

    /// A limit's parts, from common to extreme.
    fn limits() -> impl Strategy<Value = Limit> {
        (
            prop_oneof![1..=100u32, 1..=u32::MAX],
            prop_oneof![
                1..=100_000u64,
                (1..=48u64).prop_map(|h| h * 3_600_000),
                1..=(1u64 << 42)
            ],
            prop_oneof![1..=100u32, 1..=u32::MAX],
        )
            .prop_filter_map("a valid limit", |(t, i, b)| {
                Limit::new(t, Duration::from_millis(i))
                    .and_then(|l| l.with_burst(b))
                    .ok()
            })
    }

    /// One rule: a bucket name by the naming rule, its limit, how many requests were taken at
    /// 0 ms, when the next came, and what it cost.
    fn rule() -> impl Strategy<Value = (String, Limit, u32, u64, u32)> {
        (
            "[A-Za-z0-9_.-]{1,64}",
            limits(),
            0..12u32,
            0..200_000u64,
            1..5u32,
        )
    }

    proptest! {
        /// Every shape either format writes is what RFC 9651 parses back to the items and
        /// parameters meant: names, quotas, windows, remaining tokens and seconds.
        #[test]
        fn fields_parse_back_as_structured_fields(
            rules in prop::collection::vec(rule(), 1..5),
            refused in any::<bool>(),
        ) {
            let mut items = Vec::new();
            let mut policies = Vec::new();
            let mut want_policy = Vec::new();
            let count = rules.len();
            for (n, (name, l, taken, at, cost)) in rules.iter().enumerate() {
                let cost = (*cost).min(l.burst());
                let mut state = None;
                for _ in 0..(*taken).min(l.burst()) {
                    state = decide(*l, state, 0, 1, 0).1;
                }
                let (d, _) = decide(*l, state, *at, cost, 0);
                let last = n + 1 == count;
                items.push(match (refused, last, d.is_admitted()) {
                    (true, true, false) => Item::denied(name, &d),
                    (true, false, true) => Item::refunded(name, &d, cost),
                    _ => Item::admitted(name, &d),
                });
                policies.push(policy_item(name, *l).expect("a policy item"));
                let (q, w) = quota(*l);
                want_policy.push((string(name), vec![("q".into(), int(q)), ("w".into(), int(w))]));
            }
            let want_items: Vec<_> = items
                .iter()
                .map(|i| {
                    let params = vec![
                        ("r".to_owned(), i64::from(i.remaining)),
                        ("t".to_owned(), int(i.next_ms.div_ceil(1000))),
                    ];
                    (string(i.name), params)
                })
                .collect();
            let closest = items
                .iter()
                .min_by_key(|i| (i.remaining, std::cmp::Reverse(i.reset_secs())))
                .map(|i| (quota(i.limit), i.remaining, i.reset_secs()));
            let views = || items.iter().copied();

            let mut headers = HeaderMap::new();
            fields(FieldVersion::Draft10, || policy(policies.iter()), views())
                .expect("fields")
                .insert_into(&mut headers);
            let p = headers.get(&RATELIMIT_POLICY).expect("a policy");
            prop_assert_eq!(parse_list(p).map_err(TestCaseError::fail)?, want_policy);
            let r = headers.get(&RATELIMIT).expect("a RateLimit field");
            prop_assert_eq!(parse_list(r).map_err(TestCaseError::fail)?, want_items);

            let mut headers = HeaderMap::new();
            fields(FieldVersion::Draft06, || None, views())
                .expect("fields")
                .insert_into(&mut headers);
            let ((q, w), remaining, reset) = closest.expect("an item");
            prop_assert_eq!(parse_integer(headers.get(&RATELIMIT_LIMIT)), Some(int(q)));
            prop_assert_eq!(
                parse_integer(headers.get(&RATELIMIT_REMAINING)),
                Some(i64::from(remaining))
            );
            prop_assert_eq!(parse_integer(headers.get(&RATELIMIT_RESET)), Some(int(reset)));
            let p = headers.get(&RATELIMIT_POLICY).expect("a policy");
            let want = vec![(BareItem::Integer(sfv::Integer::constant(int(q))), vec![("w".to_owned(), int(w))])];
            prop_assert_eq!(parse_list(p).map_err(TestCaseError::fail)?, want);
        }

        /// A request of cost 1 refused waits for the next token: its item's `t` is the
        /// `Retry-After` the rejection sends, and a larger cost's `t` is no later than it.
        #[test]
        fn a_refusals_t_never_names_a_time_after_its_retry(
            l in limits(),
            later in 0.0..1.0f64,
            cost in 1..5u32,
        ) {
            // Emptied at 0 ms, then asked again at some time before the cost has refilled.
            let cost = cost.min(l.burst());
            let (_, state) = decide(l, None, 0, l.burst(), 0);
            let (first, _) = decide(l, state, 0, cost, 0);
            let at = (millis(first.wait()) as f64 * later) as u64;
            let (d, _) = decide(l, state, at, cost, 0);
            prop_assert!(!d.is_admitted());
            let item = Item::denied("x", &d);
            let retry_after = ceil_secs(d.wait()).max(1);
            prop_assert!(item.next_secs() >= 1 && item.next_secs() <= retry_after);
            prop_assert_eq!(item.reset_secs(), retry_after);
            if cost == 1 {
                prop_assert_eq!(item.next_secs(), retry_after);
            }
        }

        /// `t` comes from the millisecond the next whole token is in the bucket, give or take
        /// one, and is zero only when the bucket is full.
        #[test]
        fn the_next_token_is_where_t_says(
            l in limits(),
            taken in 0..12u32,
            at in 0..200_000u64,
        ) {
            let p = Params::of(&l);
            let mut state = None;
            for _ in 0..taken.min(l.burst()) {
                state = decide(l, state, 0, 1, 0).1;
            }
            let (d, state) = decide(l, state, at, 1, 0);
            let item = Item::admitted("x", &d);
            let held = |ms: u64| bucket::peek(&p, state, at + ms).remaining;
            if item.next_ms == 0 {
                prop_assert_eq!(u64::from(d.remaining()), u64::from(l.burst()));
                prop_assert_eq!(held(0), u64::from(l.burst()));
            } else {
                prop_assert!(u64::from(d.remaining()) < u64::from(l.burst()));
                // The store's floating-point bucket may reach the token a millisecond after the
                // exact time.
                prop_assert!(held(item.next_ms + 1) > u64::from(d.remaining()), "{} early", item.next_ms);
                if item.next_ms >= 2 {
                    prop_assert_eq!(held(item.next_ms - 2), u64::from(d.remaining()));
                }
            }
        }
    }
}
