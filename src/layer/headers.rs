//! The `RateLimit-Policy` and `RateLimit` fields (draft-ietf-httpapi-ratelimit-headers-10) and
//! the whole seconds they and `Retry-After` are written in, formatted without `format!`: they go
//! on every response.

use std::time::Duration;

use http::{HeaderName, HeaderValue};

use crate::{Decision, Limit};

/// `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers-10).
pub(crate) static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` (draft-ietf-httpapi-ratelimit-headers-10).
pub(crate) static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// Whole seconds, rounded up: a client that waits this long is never early.
pub(crate) fn ceil_secs(d: Duration) -> u64 {
    u64::try_from(d.as_nanos().div_ceil(1_000_000_000)).unwrap_or(u64::MAX)
}

/// The time until the bucket holds one more whole token, from what a decision carries: zero
/// when a token is left, otherwise the time to full less the time for the other tokens.
fn next_token(decision: &Decision) -> Duration {
    if decision.remaining() > 0 {
        return Duration::ZERO;
    }
    let limit = decision.limit();
    let others = u128::from(limit.burst() - 1) * u128::from(limit.interval_ms())
        / u128::from(limit.tokens());
    let ms = decision.resets_in().as_millis().saturating_sub(others);
    Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX))
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

/// One rule's item of `RateLimit-Policy`, `"<name>";q=<capacity>;w=<seconds to refill from
/// empty>`. It depends only on the rule, so each rule builds it once.
pub(crate) fn policy_item(name: &str, limit: Limit) -> Option<HeaderValue> {
    let mut out = Text::new();
    out.push(b"\"");
    out.push(name.as_bytes());
    out.push(b"\";q=");
    out.push_u64(u64::from(limit.burst()));
    out.push(b";w=");
    out.push_u64(ceil_secs(limit.refill_time()).max(1));
    out.header_value()
}

/// `RateLimit-Policy` for the rules that applied, from their prebuilt items: one rule's item is
/// shared as it is, several are joined.
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

/// One item of a `RateLimit` field.
pub(crate) struct Item<'a> {
    pub(crate) name: &'a str,
    pub(crate) remaining: u32,
    pub(crate) next: Duration,
}

impl<'a> Item<'a> {
    pub(crate) fn admitted(name: &'a str, decision: &Decision) -> Self {
        Self {
            name,
            remaining: decision.remaining(),
            next: next_token(decision),
        }
    }

    /// An earlier rule's item after its `cost` tokens were given back. Exact for tokens taken
    /// at once; a reservation's item stays as the store reported it, since that bucket held
    /// fewer whole tokens than the cost anyway.
    pub(crate) fn refunded(name: &'a str, decision: &Decision, cost: u32) -> Self {
        if !decision.wait().is_zero() {
            return Self::admitted(name, decision);
        }
        let remaining = decision
            .remaining()
            .saturating_add(cost)
            .min(decision.limit().burst());
        Self {
            name,
            remaining,
            next: Duration::ZERO,
        }
    }
}

/// `"<name>";r=<remaining>;t=<seconds until the next token>` for each rule that applied.
pub(crate) fn ratelimit<'a>(items: impl Iterator<Item = Item<'a>>) -> Option<HeaderValue> {
    let mut out = Text::new();
    for item in items {
        if !out.as_bytes().is_empty() {
            out.push(b", ");
        }
        out.push(b"\"");
        out.push(item.name.as_bytes());
        out.push(b"\";r=");
        out.push_u64(u64::from(item.remaining));
        out.push(b";t=");
        out.push_u64(ceil_secs(item.next));
    }
    out.header_value()
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn fields_follow_the_draft() {
        let a = Limit::per_second(10).expect("a valid limit");
        let b = Limit::per_minute(1)
            .and_then(|l| l.with_burst(10))
            .expect("a valid limit");
        let items = [policy_item("per-key", a), policy_item("orders", b)];
        let items: Vec<HeaderValue> = items.into_iter().flatten().collect();
        let p = policy(items.iter());
        assert_eq!(
            p.as_ref().and_then(|v| v.to_str().ok()),
            Some("\"per-key\";q=10;w=1, \"orders\";q=10;w=600")
        );
        assert_eq!(policy(items[1..].iter()).as_ref(), Some(&items[1]));
        let r = ratelimit(
            [Item {
                name: "per-key",
                remaining: 3,
                next: Duration::from_millis(1500),
            }]
            .into_iter(),
        );
        assert_eq!(
            r.as_ref().and_then(|v| v.to_str().ok()),
            Some("\"per-key\";r=3;t=2")
        );
        assert!(policy(std::iter::empty()).is_none());
    }
}
