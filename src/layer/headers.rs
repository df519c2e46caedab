//! The rate-limit header fields: `RateLimit-Policy` and `RateLimit` of
//! draft-ietf-httpapi-ratelimit-headers-11 by default (or with draft 10's `t`), or the separate
//! `RateLimit-Limit`, `RateLimit-Remaining` and `RateLimit-Reset` of its drafts up to 06, and the
//! whole seconds they and `Retry-After` are written in. They go on every response, so they are
//! written by hand without `format!`; the tests parse every shape written with an RFC 9651
//! parser.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};

use crate::{BucketKey, Decision, Limit};

/// `RateLimit-Policy`: named quota policies (drafts 08 to 11), or the integer policy of the limit
/// closest to exhaustion (drafts 05 and 06).
pub(crate) static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (drafts 08 to 11).
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
    /// The fields of draft-ietf-httpapi-ratelimit-headers-11, the newest draft (the default):
    /// `RateLimit-Policy: "<rule>";q=<quota>;w=<window>` and
    /// `RateLimit: "<rule>";r=<available>;t=<effective window>`, one item for each rule that
    /// applied, named by its bucket. `t` is never 0: for a full bucket it is one token period.
    #[default]
    Draft11,
    /// The same fields with `t` as draft-ietf-httpapi-ratelimit-headers-10 defines it, the
    /// seconds until more quota is available: 0 for a full bucket, which gains nothing until a
    /// token is taken. Otherwise the same as [`Draft11`](Self::Draft11).
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

/// One rule's item of the `RateLimit-Policy` of drafts 08 to 11, `"<name>";q=<quota>;w=<window>` (see
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

/// The `RateLimit-Policy` for the rules that applied, from their prebuilt items: one
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

/// One rule that applied, as the `RateLimit-Policy` names it: its item, built once, and
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

/// The `RateLimit-Policy` of a request, the one place a layer builds it: `applied` are
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

/// One rule's state after a request: an item of the `RateLimit` field, or what the draft-06
/// fields are made of.
#[derive(Clone, Copy)]
pub(crate) struct Item<'a> {
    pub(crate) name: &'a str,
    pub(crate) limit: Limit,
    pub(crate) remaining: u32,
    /// Until the bucket holds one more whole token; zero only when it is full.
    pub(crate) next_ms: u64,
    /// Until the rule could admit the request it refused; zero when it admitted it.
    pub(crate) retry_ms: u64,
    /// The fingerprint of the bucket's key, when the item names its partition (`pk`).
    pub(crate) partition: Option<[u8; 6]>,
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
            partition: None,
        }
    }

    /// The same item naming the partition it counts in, the bucket of `key`, by the key's
    /// fingerprint (see [`partition_key`]): a `pk` parameter in the `RateLimit` field (drafts 08
    /// to 11).
    pub(crate) fn partition(self, key: &BucketKey) -> Self {
        Self {
            partition: Some(key.fingerprint_bytes()),
            ..self
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

    /// Draft 10's `t`: whole seconds until the next token, 0 for a full bucket.
    fn next_secs(&self) -> u64 {
        ms_to_secs(self.next_ms).min(MAX_INTEGER)
    }

    /// Draft 11's `t`, the effective window: whole seconds within which the client should use
    /// no more than the `r` tokens it has (see [`window_ms`](Self::window_ms)). At least 1.
    fn window_secs(&self) -> u64 {
        ms_to_secs(self.window_ms()).min(MAX_INTEGER)
    }

    /// Milliseconds until a client that spends the `r` whole tokens it has at once holds a
    /// token again: the next token, as for draft 10, or, for a full bucket (which refills
    /// nothing until a token is taken), one token period. At least 1.
    fn window_ms(&self) -> u64 {
        if self.next_ms == 0 {
            self.limit
                .interval_ms()
                .div_ceil(u64::from(self.limit.tokens()))
        } else {
            self.next_ms
        }
    }

    /// `t` as `version` defines it.
    fn t_secs(&self, version: FieldVersion) -> u64 {
        match version {
            FieldVersion::Draft10 => self.next_secs(),
            _ => self.window_secs(),
        }
    }

    /// `RateLimit-Reset` of the drafts up to 06: the time to the next token, or on a refusal
    /// the time the request could be served, the point in time `Retry-After` names.
    fn reset_secs(&self) -> u64 {
        ms_to_secs(self.next_ms.max(self.retry_ms)).min(MAX_INTEGER)
    }
}

/// The `RateLimit` field of drafts 08 to 11: `"<name>";r=<remaining>;t=<seconds>` for each
/// rule that applied, `t` as `version` defines it, and `;pk=:<partition>:` after an item that
/// names its key.
pub(crate) fn ratelimit<'a>(
    version: FieldVersion,
    items: impl Iterator<Item = Item<'a>>,
) -> Option<HeaderValue> {
    let mut items = items.peekable();
    let first = items.next()?;
    if items.peek().is_none() {
        return ratelimit_one(&first, version);
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
        out.push_u64(item.t_secs(version));
        if let Some(fingerprint) = item.partition {
            out.push(b";pk=:");
            out.push(&partition_key(fingerprint));
            out.push(b":");
        }
    }
    out.header_value()
}

/// The `RateLimit` field of one rule, the usual case, written straight into a buffer of its
/// exact length that becomes the value's own: no room on the stack to clear first, and no copy.
fn ratelimit_one(item: &Item<'_>, version: FieldVersion) -> Option<HeaderValue> {
    let (mut r, mut t) = ([0; 20], [0; 20]);
    let r = decimal(u64::from(item.remaining), &mut r);
    let t = decimal(item.t_secs(version), &mut t);
    let pk = item.partition.map(partition_key);
    let name = item.name.as_bytes();
    // The two quotes, `;r=` and `;t=` are the 8 bytes besides the name and the numbers;
    // `;pk=::` the 6 around a partition key.
    let pk_len = pk.map_or(0, |pk| pk.len() + 6);
    let mut out = Vec::with_capacity(name.len() + r.len() + t.len() + 8 + pk_len);
    out.push(b'"');
    out.extend_from_slice(name);
    out.extend_from_slice(b"\";r=");
    out.extend_from_slice(r);
    out.extend_from_slice(b";t=");
    out.extend_from_slice(t);
    if let Some(pk) = pk {
        out.extend_from_slice(b";pk=:");
        out.extend_from_slice(&pk);
        out.push(b':');
    }
    // A vector as long as its capacity becomes `Bytes` without another allocation.
    HeaderValue::from_maybe_shared(Bytes::from(out)).ok()
}

/// A partition key (`pk`), the content of an RFC 9651 Byte Sequence: the bucket key's
/// fingerprint, the one its log lines carry, in base64. Never the key: it may be an API key or
/// an address, and a response's fields pass through proxies and their logs. It is keyed as the
/// fingerprint is: with the application's `KeySecret` once the process has one, so that every
/// process sharing the secret names a bucket by one partition key, else with a salt of the
/// process's own.
fn partition_key(fingerprint: [u8; 6]) -> [u8; 8] {
    const BASE64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes = fingerprint;
    let mut out = [0; 8];
    // Six bytes are two groups of three, four characters each: no padding.
    for (group, chars) in bytes.chunks_exact(3).zip(out.chunks_exact_mut(4)) {
        let n = u32::from(group[0]) << 16 | u32::from(group[1]) << 8 | u32::from(group[2]);
        for (i, c) in chars.iter_mut().enumerate() {
            *c = BASE64[(n >> (18 - 6 * i) & 63) as usize];
        }
    }
    out
}

/// The rate-limit fields of one response, ready to go into its headers.
#[derive(Debug)]
pub(crate) enum Fields {
    /// `RateLimit-Policy` and `RateLimit` (drafts 08 to 11).
    Named {
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
/// `items`. `policy` gives the `RateLimit-Policy` of the named formats from the rules' prebuilt
/// items, and is called for those only.
pub(crate) fn fields<'a>(
    version: FieldVersion,
    policy: impl FnOnce() -> Option<HeaderValue>,
    items: impl Iterator<Item = Item<'a>>,
) -> Option<Fields> {
    match version {
        FieldVersion::Draft11 | FieldVersion::Draft10 => {
            let (policy, ratelimit) = policy().zip(ratelimit(version, items))?;
            Some(Fields::Named { policy, ratelimit })
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
            Self::Named { policy, ratelimit } => {
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
mod tests;
