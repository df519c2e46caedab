//! Rules: which requests a limit applies to, whose bucket they draw from, and what they cost.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use http::request::Parts;
use http::{HeaderName, HeaderValue};

use super::response;
use crate::key::is_name;
use crate::{BucketKey, InvalidKey, Limit};

/// One limit of a [`RateLimitLayer`](super::RateLimitLayer): a bucket name, the [`Limit`], a
/// [`KeyExtractor`] that says whose bucket a request draws from, and the request's cost.
///
/// A request passes a layer only if it passes every rule that applies to it; a rule applies when
/// its extractor finds a key.
///
/// ```
/// use burstgate::Limit;
/// use burstgate::layer::{KeyExtractor, Rule};
///
/// let per_key = Rule::new(
///     "per-key",
///     Limit::per_second(10)?,
///     KeyExtractor::header(http::HeaderName::from_static("x-api-key")),
/// )?;
/// // Exports cost five tokens, everything else one.
/// let per_key = per_key.with_cost(|req| if req.uri.path().starts_with("/export") { 5 } else { 1 });
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Rule {
    pub(crate) bucket: Arc<str>,
    pub(crate) limit: Limit,
    pub(crate) key: KeyExtractor,
    cost: Option<CostFn>,
    /// This rule's item of `RateLimit-Policy`, which never changes.
    pub(crate) policy: HeaderValue,
}

type CostFn = Arc<dyn Fn(&Parts) -> u32 + Send + Sync>;

impl Rule {
    /// A rule named `bucket` (1 to 64 ASCII letters, digits, `_`, `.` or `-`; it names the
    /// bucket in the store and the policy in the `RateLimit` headers). Each request costs one
    /// token unless [`with_cost`](Self::with_cost) says otherwise.
    pub fn new(bucket: &str, limit: Limit, key: KeyExtractor) -> Result<Self, InvalidKey> {
        if !is_name(bucket) {
            return Err(InvalidKey::BucketName);
        }
        // A valid name is plain ASCII, so its item is always a valid header value.
        let policy = response::policy_item(bucket, limit).ok_or(InvalidKey::BucketName)?;
        Ok(Self {
            bucket: Arc::from(bucket),
            limit,
            key,
            cost: None,
            policy,
        })
    }

    /// Prices each request: `cost` sees the request's head and returns the tokens it takes. A
    /// cost of zero or above the limit's burst is a misconfiguration, answered with 500.
    #[must_use]
    pub fn with_cost(self, cost: impl Fn(&Parts) -> u32 + Send + Sync + 'static) -> Self {
        Self {
            cost: Some(Arc::new(cost)),
            ..self
        }
    }

    /// The bucket name.
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// The limit.
    pub fn limit(&self) -> Limit {
        self.limit
    }

    /// The bucket and cost for a request, or `None` when the rule does not apply to it.
    pub(crate) fn plan(&self, parts: &Parts) -> Option<(BucketKey, u32)> {
        let key = self.key.extract(&self.bucket, parts)?;
        let cost = self.cost.as_ref().map_or(1, |f| f(parts));
        Some((key, cost))
    }
}

impl fmt::Debug for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rule")
            .field("bucket", &self.bucket)
            .field("limit", &self.limit)
            .field("key", &self.key)
            .field("cost", &self.cost.as_ref().map(|_| "Fn(&Parts) -> u32"))
            .finish()
    }
}

/// Finds whose bucket a request draws from. `None` means the rule does not apply.
#[derive(Clone)]
pub struct KeyExtractor {
    kind: Kind,
}

type KeyFn = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;

#[derive(Clone)]
enum Kind {
    PeerIp,
    Header(HeaderName),
    Global,
    Custom(KeyFn),
}

impl KeyExtractor {
    /// The client's IP address, from the connection. It looks in the request's extensions for,
    /// in order: axum's `ConnectInfo<SocketAddr>` (with the `axum` feature; serve the router with
    /// `into_make_service_with_connect_info::<SocketAddr>()`), a `SocketAddr`, and an `IpAddr`
    /// (insert either in a hyper `service_fn` from the accepted connection). A request without
    /// any is not limited by the rule, so check that your server provides one.
    ///
    /// Behind a proxy the peer is the proxy; use [`from_fn`](Self::from_fn) to read the header
    /// your proxy sets, since only you know which one to trust.
    pub fn peer_ip() -> Self {
        Self { kind: Kind::PeerIp }
    }

    /// The value of header `name`, such as `x-api-key` or `authorization`. The value is hashed
    /// (SHA-256) before it becomes part of a store key, and never logged. Requests without the
    /// header, or with an empty one, are not limited by the rule.
    pub fn header(name: HeaderName) -> Self {
        Self {
            kind: Kind::Header(name),
        }
    }

    /// One bucket for every request: a global limit.
    pub fn global() -> Self {
        Self { kind: Kind::Global }
    }

    /// Any function of the request's head. The key it returns is escaped, not hashed: hash
    /// secrets yourself, or use [`header`](Self::header). `None` or an empty key means the rule
    /// does not apply.
    pub fn from_fn(f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        Self {
            kind: Kind::Custom(Arc::new(f)),
        }
    }

    fn extract(&self, bucket: &str, parts: &Parts) -> Option<BucketKey> {
        match &self.kind {
            Kind::PeerIp => {
                let mut text = IpText::default();
                text.write(peer_ip(parts)?);
                BucketKey::new(bucket, text.as_bytes()).ok()
            }
            Kind::Header(name) => {
                let value = parts.headers.get(name)?;
                BucketKey::hashed(bucket, value.as_bytes()).ok()
            }
            Kind::Global => BucketKey::new(bucket, "global").ok(),
            Kind::Custom(f) => BucketKey::new(bucket, f(parts)?).ok(),
        }
    }
}

fn peer_ip(parts: &Parts) -> Option<IpAddr> {
    #[cfg(feature = "axum")]
    if let Some(info) = parts
        .extensions
        .get::<axum::extract::ConnectInfo<SocketAddr>>()
    {
        return Some(info.0.ip());
    }
    if let Some(addr) = parts.extensions.get::<SocketAddr>() {
        return Some(addr.ip());
    }
    parts.extensions.get::<IpAddr>().copied()
}

/// An IP address as `Display` writes it, on the stack: `to_string` would allocate a `String` per
/// request only for the key to copy it.
struct IpText {
    buf: [u8; 48],
    len: usize,
}

impl Default for IpText {
    fn default() -> Self {
        Self {
            buf: [0; 48],
            len: 0,
        }
    }
}

impl IpText {
    fn write(&mut self, ip: IpAddr) {
        match ip {
            // The common case, by hand: four decimal octets joined by dots, as `Display` has it.
            IpAddr::V4(v4) => {
                for (i, octet) in v4.octets().into_iter().enumerate() {
                    if i > 0 {
                        self.push(b'.');
                    }
                    if octet >= 100 {
                        self.push(b'0' + octet / 100);
                    }
                    if octet >= 10 {
                        self.push(b'0' + octet / 10 % 10);
                    }
                    self.push(b'0' + octet % 10);
                }
            }
            // The longest form, with an embedded IPv4 address, is 45 bytes: it always fits.
            IpAddr::V6(v6) => {
                let _ = fmt::Write::write_fmt(self, format_args!("{v6}"));
            }
        }
    }

    fn push(&mut self, byte: u8) {
        if let Some(slot) = self.buf.get_mut(self.len) {
            *slot = byte;
            self.len += 1;
        }
    }

    fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl fmt::Write for IpText {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let end = self.len + s.len();
        let room = self.buf.get_mut(self.len..end).ok_or(fmt::Error)?;
        room.copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

impl fmt::Debug for KeyExtractor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::PeerIp => f.write_str("KeyExtractor::PeerIp"),
            Kind::Header(name) => write!(f, "KeyExtractor::Header({name})"),
            Kind::Global => f.write_str("KeyExtractor::Global"),
            Kind::Custom(_) => f.write_str("KeyExtractor::Custom(Fn(&Parts) -> Option<String>)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(req: http::Request<()>) -> Parts {
        req.into_parts().0
    }

    #[test]
    fn extractors_find_their_keys_or_leave_the_rule_out() {
        let limit = Limit::per_second(1).expect("a valid limit");
        let header = Rule::new(
            "k",
            limit,
            KeyExtractor::header(HeaderName::from_static("x-api-key")),
        )
        .expect("a valid rule");
        let with = parts(
            http::Request::builder()
                .header("x-api-key", "sekrit")
                .body(())
                .expect("a request"),
        );
        let (key, cost) = header.plan(&with).expect("applies");
        assert!(key.as_str().starts_with("k:#") && !key.as_str().contains("sekrit"));
        assert_eq!(cost, 1);
        let empty = parts(
            http::Request::builder()
                .header("x-api-key", "")
                .body(())
                .expect("a request"),
        );
        assert!(header.plan(&empty).is_none());
        assert!(header.plan(&parts(http::Request::new(()))).is_none());

        let ip = Rule::new("ip", limit, KeyExtractor::peer_ip()).expect("a valid rule");
        let mut req = http::Request::new(());
        req.extensions_mut()
            .insert(SocketAddr::from(([10, 0, 0, 7], 4242)));
        assert_eq!(
            ip.plan(&parts(req)).map(|(k, _)| k.to_string()).as_deref(),
            Some("ip:10.0.0.7")
        );
        assert!(ip.plan(&parts(http::Request::new(()))).is_none());

        let global = Rule::new("all", limit, KeyExtractor::global()).expect("a valid rule");
        assert!(global.plan(&parts(http::Request::new(()))).is_some());

        let custom = Rule::new(
            "path",
            limit,
            KeyExtractor::from_fn(|p| Some(p.uri.path().to_owned())),
        )
        .expect("a valid rule")
        .with_cost(|_| 3);
        let (key, cost) = custom
            .plan(&parts(http::Request::new(())))
            .expect("applies");
        assert_eq!((key.as_str(), cost), ("path:/", 3));
    }

    #[test]
    fn peer_ip_keys_spell_addresses_as_display_does() {
        let mut addrs: Vec<IpAddr> = (0..=255u8)
            .map(|b| IpAddr::from([b, 255 - b, b / 10, b % 100]))
            .collect();
        addrs.extend(
            [
                "::",
                "::1",
                "::ffff:10.0.0.7",
                "2001:db8::8a2e:370:7334",
                "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
                "::ffff:255.255.255.255",
            ]
            .map(|s| s.parse::<IpAddr>().expect("a valid address")),
        );
        for ip in addrs {
            let mut text = IpText::default();
            text.write(ip);
            assert_eq!(text.as_bytes(), ip.to_string().as_bytes());
        }
    }

    #[test]
    fn rule_names_are_checked() {
        let limit = Limit::per_second(1).expect("a valid limit");
        assert_eq!(
            Rule::new("no spaces", limit, KeyExtractor::global()).map(drop),
            Err(InvalidKey::BucketName)
        );
    }
}
