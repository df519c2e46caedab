//! Key extractors: whose bucket a request draws from.

use std::fmt;
use std::sync::Arc;

use http::request::Parts;
use http::{HeaderName, StatusCode};

use super::ip::{IpText, Ipv6Prefix, peer_ip};
use super::proxies::TrustedProxies;
#[cfg(doc)]
use super::rule::{MissingKey, Rule};
use crate::{BucketKey, BucketName, KeySecret};

/// Finds whose bucket a request draws from. A request it finds no key for is left to the rule's
/// [`MissingKey`] choice.
#[derive(Clone)]
pub struct KeyExtractor {
    kind: Kind,
}

type KeyFn = Arc<dyn Fn(&Parts) -> Option<String> + Send + Sync>;

#[derive(Clone)]
enum Kind {
    PeerIp(Ipv6Prefix),
    ClientIp(TrustedProxies, Ipv6Prefix),
    Header(HeaderName, Option<KeySecret>),
    Global,
    Custom(KeyFn),
}

impl KeyExtractor {
    /// The client's IP address, from the connection. It looks in the request's extensions for,
    /// in order: axum's `ConnectInfo<SocketAddr>` (with the `axum` feature; serve the router with
    /// `into_make_service_with_connect_info::<SocketAddr>()`), a `SocketAddr`, and an `IpAddr`
    /// (insert either in a hyper `service_fn` from the accepted connection). A request without
    /// any is not limited by the rule, and the first one logs a warning; make the rule refuse
    /// such requests with `500` by [`Rule::on_missing_key`]`(`[`MissingKey::Reject`]`)`.
    ///
    /// The key is the IPv4 address (`192.0.2.7`), or the IPv6 network the address is in, written
    /// as the network and its length: all of `2001:db8:1:2::/64` shares one bucket by default,
    /// since an IPv6 client can use any address of its `/64`. Choose another grouping with
    /// [`ipv6_prefix`](Self::ipv6_prefix). An IPv4-mapped IPv6 address
    /// (`::ffff:192.0.2.7`, as a dual-stack socket reports an IPv4 peer) is keyed as the IPv4
    /// address. A store key percent-escapes the colons: in Redis the bucket of that network is
    /// `<prefix>:v4:<bucket>:{2001%3Adb8%3A1%3A2%3A%3A/64}`.
    ///
    /// Behind a proxy the peer is the proxy, and every client would share its bucket: use
    /// [`client_ip`](Self::client_ip).
    ///
    /// ```
    /// use std::convert::Infallible;
    /// use std::net::SocketAddr;
    /// use burstgate::{Limit, MemoryStore};
    /// use burstgate::layer::{Ipv6Prefix, KeyExtractor, RateLimitLayer, Rule};
    /// use http::{Request, Response, StatusCode};
    /// use tower::{Layer, Service, ServiceExt};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let per_ip = Rule::new("per-ip", Limit::per_hour(1)?, KeyExtractor::peer_ip())?;
    /// let mut svc = RateLimitLayer::new(MemoryStore::new())
    ///     .rule(per_ip)
    ///     .layer(tower::service_fn(|_req: Request<String>| async {
    ///         Ok::<_, Infallible>(Response::new(String::new()))
    ///     }));
    /// let from = |peer: &str| -> Result<Request<String>, Box<dyn std::error::Error>> {
    ///     let mut req = Request::new(String::new());
    ///     req.extensions_mut().insert(SocketAddr::new(peer.parse()?, 443));
    ///     Ok(req)
    /// };
    /// let res = svc.ready().await?.call(from("2001:db8:1:2::a")?).await?;
    /// assert_eq!(res.status(), StatusCode::OK);
    /// // Another address of the same /64 is the same client.
    /// let res = svc.ready().await?.call(from("2001:db8:1:2::b")?).await?;
    /// assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    ///
    /// // One bucket per /56 instead.
    /// let per_site = KeyExtractor::peer_ip().ipv6_prefix(Ipv6Prefix::Slash56);
    /// assert_eq!(format!("{per_site:?}"), "KeyExtractor::PeerIp(/56)");
    /// # Ok(())
    /// # }
    /// ```
    pub fn peer_ip() -> Self {
        Self {
            kind: Kind::PeerIp(Ipv6Prefix::default()),
        }
    }

    /// The client's IP address behind your proxies: the peer's address (found as
    /// [`peer_ip`](Self::peer_ip) finds it) if it is not one of `proxies`, otherwise the nearest
    /// untrusted address in the header they write (see [`TrustedProxies`] for the walk and what
    /// an unreadable entry does). A client cannot choose its bucket by sending the header
    /// itself. The key is formed and grouped as `peer_ip`'s (IPv6 by its `/64`, see
    /// [`ipv6_prefix`](Self::ipv6_prefix)); a request without a peer address is a
    /// missing key, refused with `500` under [`MissingKey::Reject`].
    ///
    /// ```
    /// use burstgate::Limit;
    /// use burstgate::layer::{KeyExtractor, MissingKey, Rule, TrustedProxies};
    ///
    /// // The load balancers' subnet; they append the client to X-Forwarded-For.
    /// let proxies = TrustedProxies::new(["10.0.0.0/24"])?;
    /// let client_ip = KeyExtractor::client_ip(proxies);
    /// let per_client = Rule::new("per-ip", Limit::per_hour(100)?, client_ip)?
    ///     .on_missing_key(MissingKey::Reject);
    /// assert_eq!(per_client.missing_key(), Some(MissingKey::Reject));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn client_ip(proxies: TrustedProxies) -> Self {
        Self {
            kind: Kind::ClientIp(proxies, Ipv6Prefix::default()),
        }
    }

    /// The value of header `name`, such as `x-api-key` or `authorization`. The value is hashed
    /// (a plain SHA-256) before it becomes part of a store key, and never logged. Requests
    /// without the header, or with an empty one, are answered `400` by default (the first one
    /// logs a warning); [`Rule::on_missing_key`]`(`[`MissingKey::Pass`]`)` lets them through
    /// unlimited by the rule, for a rule beside another that limits anonymous requests.
    ///
    /// A plain hash is what anyone who reads the store can compute from a guess: for a secret
    /// (an API key, `Authorization: Basic`, whose value is a password), use
    /// [`keyed_header`](Self::keyed_header).
    pub fn header(name: HeaderName) -> Self {
        Self {
            kind: Kind::Header(name, None),
        }
    }

    /// Like [`header`](Self::header), but the value is stored as its HMAC-SHA256 under `secret`
    /// ([`BucketKey::keyed`]): a reader of the store, or of a backup of it, can neither read
    /// the value nor test guesses against it. Every process sharing the buckets must use the
    /// same secret. Unless another secret keys them already, it also keys the process's key
    /// fingerprints ([`KeySecret::key_fingerprints`]), so that they match across processes.
    ///
    /// ```
    /// use burstgate::{KeySecret, Limit};
    /// use burstgate::layer::{KeyExtractor, Rule};
    /// use http::header::AUTHORIZATION;
    ///
    /// // From your secret store, never from the code.
    /// let secret = KeySecret::new(b"32 random bytes from the vault..")?;
    /// let per_login = Rule::new(
    ///     "login",
    ///     Limit::per_minute(5)?,
    ///     KeyExtractor::keyed_header(AUTHORIZATION, secret),
    /// )?;
    /// # let _ = per_login;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn keyed_header(name: HeaderName, secret: KeySecret) -> Self {
        secret.offer_for_fingerprints();
        Self {
            kind: Kind::Header(name, Some(secret)),
        }
    }

    /// One bucket for every request: a global limit.
    pub fn global() -> Self {
        Self { kind: Kind::Global }
    }

    /// Any function of the request's head. The key it returns is escaped, not hashed: hash
    /// secrets yourself, or use [`header`](Self::header). `None` or an empty key is a missing
    /// key: the rule does not apply, and logs a warning the first time unless
    /// [`Rule::on_missing_key`] chose [`MissingKey::Pass`], as a rule meant for some requests
    /// only should.
    pub fn from_fn(f: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        Self {
            kind: Kind::Custom(Arc::new(f)),
        }
    }

    /// Groups IPv6 clients by `prefix` instead of the default `/64` (see [`Ipv6Prefix`]). Only
    /// the address extractors have addresses to group; the others are returned as they are.
    #[must_use]
    pub fn ipv6_prefix(self, prefix: Ipv6Prefix) -> Self {
        let kind = match self.kind {
            Kind::PeerIp(_) => Kind::PeerIp(prefix),
            Kind::ClientIp(proxies, _) => Kind::ClientIp(proxies, prefix),
            other => other,
        };
        Self { kind }
    }

    /// The status of a request refused for lacking a key: the server's fault when the server
    /// provides the key, the request's otherwise.
    pub(super) fn missing_status(&self) -> StatusCode {
        match self.kind {
            Kind::PeerIp(_) | Kind::ClientIp(..) | Kind::Global => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            Kind::Header(..) | Kind::Custom(_) => StatusCode::BAD_REQUEST,
        }
    }

    /// Whether the key is a header's, which the client sends: such a rule refuses a request
    /// without it unless told otherwise.
    pub(super) fn is_header(&self) -> bool {
        matches!(self.kind, Kind::Header(..))
    }

    pub(super) fn name(&self) -> &'static str {
        match self.kind {
            Kind::PeerIp(_) => "peer_ip",
            Kind::ClientIp(..) => "client_ip",
            Kind::Header(..) => "header",
            Kind::Global => "global",
            Kind::Custom(_) => "from_fn",
        }
    }

    /// What to check when the rule finds no key.
    pub(super) fn hint(&self) -> &'static str {
        match self.kind {
            Kind::PeerIp(_) | Kind::ClientIp(..) => {
                "no peer address in the request's extensions: serve axum with \
                 into_make_service_with_connect_info::<SocketAddr>() and the axum feature, or \
                 insert a SocketAddr from the accepted connection"
            }
            Kind::Header(..) => "the request has no such header, or an empty one",
            Kind::Global => "the rule's bucket name makes no key",
            Kind::Custom(_) => "the function returned no key, or an empty one",
        }
    }

    pub(super) fn extract(&self, bucket: &BucketName, parts: &Parts) -> Option<BucketKey> {
        match &self.kind {
            Kind::PeerIp(prefix) => {
                let text = IpText::key(peer_ip(parts)?, *prefix);
                bucket.key(text.as_bytes()).ok()
            }
            Kind::ClientIp(proxies, prefix) => {
                let client = proxies.client(peer_ip(parts)?, &parts.headers);
                let text = IpText::key(client, *prefix);
                bucket.key(text.as_bytes()).ok()
            }
            Kind::Header(name, secret) => {
                let value = parts.headers.get(name)?;
                match secret {
                    Some(secret) => bucket.keyed_key(value.as_bytes(), secret).ok(),
                    None => bucket.hashed_key(value.as_bytes()).ok(),
                }
            }
            Kind::Global => bucket.key("global").ok(),
            Kind::Custom(f) => bucket.key(f(parts)?).ok(),
        }
    }
}

impl fmt::Debug for KeyExtractor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::PeerIp(prefix) => write!(f, "KeyExtractor::PeerIp(/{})", prefix.bits()),
            Kind::ClientIp(proxies, prefix) => {
                write!(f, "KeyExtractor::ClientIp({proxies:?}, /{})", prefix.bits())
            }
            Kind::Header(name, None) => write!(f, "KeyExtractor::Header({name})"),
            Kind::Header(name, Some(_)) => write!(f, "KeyExtractor::KeyedHeader({name})"),
            Kind::Global => f.write_str("KeyExtractor::Global"),
            Kind::Custom(_) => f.write_str("KeyExtractor::Custom(Fn(&Parts) -> Option<String>)"),
        }
    }
}
