//! The HTTP face of a decision: `Retry-After`, `RateLimit-Policy`, `RateLimit`, 429 and 503.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

use crate::{Decision, Limit, RateLimited};

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

/// `"<name>";q=<capacity>;w=<seconds to refill from empty>` for each rule that applied.
pub(crate) fn policy<'a>(rules: impl Iterator<Item = (&'a str, Limit)>) -> Option<HeaderValue> {
    let mut out = String::new();
    for (name, limit) in rules {
        if !out.is_empty() {
            out.push_str(", ");
        }
        let w = ceil_secs(limit.refill_time()).max(1);
        let _ = write!(out, "\"{name}\";q={};w={w}", limit.burst());
    }
    HeaderValue::from_str(&out).ok().filter(|_| !out.is_empty())
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
    let mut out = String::new();
    for item in items {
        if !out.is_empty() {
            out.push_str(", ");
        }
        let _ = write!(
            out,
            "\"{}\";r={};t={}",
            item.name,
            item.remaining,
            ceil_secs(item.next)
        );
    }
    HeaderValue::from_str(&out).ok().filter(|_| !out.is_empty())
}

type BodyFn = Arc<dyn Fn(&RateLimited) -> String + Send + Sync>;

/// How a rejection is answered; the defaults are 429, the standard headers and a short text.
#[derive(Clone)]
pub(crate) struct Rejection {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Option<BodyFn>,
}

impl Default for Rejection {
    fn default() -> Self {
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            headers: HeaderMap::new(),
            body: None,
        }
    }
}

impl Rejection {
    pub(crate) fn respond<B: From<String>>(
        &self,
        limited: &RateLimited,
        policy: Option<HeaderValue>,
        ratelimit: Option<HeaderValue>,
    ) -> Response<B> {
        let body = match &self.body {
            Some(f) => f(limited),
            None => format!(
                "rate limited: retry after {} s\n",
                ceil_secs(limited.retry_after()).max(1)
            ),
        };
        let mut res = Response::new(B::from(body));
        *res.status_mut() = self.status;
        let headers = res.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        // Never 0: a client told "retry after 0" would come straight back and be refused again.
        headers.insert(
            RETRY_AFTER,
            HeaderValue::from(ceil_secs(limited.retry_after()).max(1)),
        );
        if let Some(v) = policy {
            headers.insert(RATELIMIT_POLICY.clone(), v);
        }
        if let Some(v) = ratelimit {
            headers.insert(RATELIMIT.clone(), v);
        }
        for (name, value) in &self.headers {
            headers.insert(name.clone(), value.clone());
        }
        res
    }
}

/// The answer when the store cannot decide (Redis down, a misconfigured cost).
pub(crate) fn failure<B: From<String>>(status: StatusCode, message: &str) -> Response<B> {
    let mut res = Response::new(B::from(format!("{message}\n")));
    *res.status_mut() = status;
    res.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    res
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
    fn fields_follow_the_draft() {
        let a = Limit::per_second(10).expect("a valid limit");
        let b = Limit::per_minute(1)
            .and_then(|l| l.with_burst(10))
            .expect("a valid limit");
        let p = policy([("per-key", a), ("orders", b)].into_iter());
        assert_eq!(
            p.as_ref().and_then(|v| v.to_str().ok()),
            Some("\"per-key\";q=10;w=1, \"orders\";q=10;w=600")
        );
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
