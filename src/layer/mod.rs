//! A tower layer that rate-limits HTTP requests: [`RateLimitLayer`].
//!
//! Put it on any tower HTTP service (axum, hyper, tonic, tower-http clients) to give each client,
//! API key or the whole service a token bucket with burst. Each [`Rule`] names a bucket, a
//! [`Limit`](crate::Limit) and a [`KeyExtractor`]; a request must pass every rule that applies.
//!
//! ```
//! use std::convert::Infallible;
//! use burstgate::{Limit, MemoryStore};
//! use burstgate::layer::{KeyExtractor, RateLimitLayer, Rule};
//! use http::{HeaderName, Request, Response, StatusCode};
//! use tower::{Layer, Service, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let layer = RateLimitLayer::new(MemoryStore::new()).rule(Rule::new(
//!     "per-key",
//!     Limit::per_second(10)?.with_burst(2)?,
//!     KeyExtractor::header(HeaderName::from_static("x-api-key")),
//! )?);
//! let mut svc = layer.layer(tower::service_fn(|_req: Request<String>| async {
//!     Ok::<_, Infallible>(Response::new(String::from("hello")))
//! }));
//!
//! let request = || Request::builder().header("x-api-key", "k1").body(String::new());
//! for _ in 0..2 {
//!     let res = svc.ready().await?.call(request()?).await?;
//!     assert_eq!(res.status(), StatusCode::OK);
//!     assert!(res.headers().contains_key("ratelimit"));
//! }
//! let res = svc.ready().await?.call(request()?).await?;
//! assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
//! assert_eq!(res.headers()["retry-after"], "1");
//! assert_eq!(res.headers()["ratelimit-policy"], "\"per-key\";q=2;w=1");
//! # Ok(())
//! # }
//! ```
//!
//! # Deciding in `call`, not in `poll_ready`
//!
//! tower's own `RateLimit` makes the whole service unready while its single budget is spent.
//! This layer decides per request, in `call`, because the budget is per key: one client over its
//! limit must not hold up the others. `poll_ready` is the inner service's alone, and the inner
//! service made ready moves into the response future (the clone stays behind), as tower-service's
//! docs advise. The service is `Clone` when the inner one is, so axum takes it without a
//! `Buffer`.
//!
//! # Answers
//!
//! - Admitted: the inner service's response, with the `RateLimit-Policy` and `RateLimit` fields
//!   (`"<rule>";r=<remaining>;t=<seconds until the next token>`, one item per rule that applied;
//!   `t=0` while a whole token is left; turn both off with
//!   [`RateLimitLayer::headers_on_success`]).
//! - Refused: `429 Too Many Requests` with `Retry-After` (whole seconds, rounded up, never 0),
//!   `RateLimit-Policy` (`"<rule>";q=<burst>;w=<seconds to refill from empty>`) and `RateLimit`,
//!   in the form of draft-ietf-httpapi-ratelimit-headers-10, and a short text body. Status, body
//!   and extra headers can be changed on the layer. A client that waits `Retry-After` seconds
//!   and retries is admitted, unless others spent the tokens first.
//! - Store failure (Redis down, a timeout): `503 Service Unavailable` with a short body, and a
//!   `tracing` error event. While the Redis store's circuit breaker is open the 503 also carries
//!   `Retry-After` (until the breaker lets a call through again, at least 1 s), and is logged at
//!   debug level only, since the breaker logged the outage itself. A store whose
//!   `OutagePolicy` admits or decides locally never reaches this. A cost
//!   of zero or above a rule's burst: `500`, also logged.
//! - No key: a rule whose extractor finds none does not apply, and its first such request logs
//!   a warning naming the rule ([`KeyExtractor::peer_ip`] on a server that does not provide the
//!   peer's address limits nothing). [`Rule::on_missing_key`] makes it pass silently, or refuse:
//!   `500` when the server should have provided the key (the peer's address), `400` when the
//!   request should have (a header, a [`KeyExtractor::from_fn`] key).
//!
//! Rejections are responses, not errors: the service's error type is the inner service's.
//! Response bodies are built with `From<String>`, which axum's `Body`, `String` and
//! `http_body_util::Full<Bytes>` implement.
//!
//! # Several rules
//!
//! Rules are checked in the order they were added, each taking its tokens. When one refuses,
//! the tokens already taken for that request by earlier rules are refunded before the 429 is
//! sent, so a refused request spends nothing (between the take and the refund, those tokens are
//! briefly unavailable to others: the safe direction).
//!
//! # Waiting
//!
//! With [`RateLimitLayer::max_wait`] above zero, a request that its buckets can serve within the
//! ceiling reserves its tokens (one store call per rule, no retries) and is passed to the inner
//! service once they have refilled, after an asynchronous tokio sleep; waiting requests go in
//! arrival order. The default is no waiting, the usual choice for a server; a client-side tower
//! stack can set a ceiling instead of failing.
//!
//! # Cancellation
//!
//! Dropping the response future while it waits (the client went away) gives the reservation
//! back, through its identity, on a spawned task. A request dropped while the store itself is
//! answering (a slow Redis) may leave its tokens spent: the decision runs inside the request's
//! future, which keeps the server path free of a task per request, and the error is in the safe
//! direction. The reqwest middleware chooses the other way for that case, for reasons that hold
//! on a client; both follow the one rule in `docs/DESIGN.md#cancellation`.
//!
//! # Logs
//!
//! `tracing` events at debug level for each admitted and refused request carry the rule, a short
//! fingerprint of the key (never the raw key or header value), the tokens remaining and the wait.

mod config;
mod decide;
mod future;
mod headers;
mod ip;
#[allow(clippy::module_inception)] // the tower-http layout: layer.rs, service.rs, future.rs
mod layer;
mod proxies;
mod rejection;
mod rule;
mod service;

pub use self::future::ResponseFuture;
pub use self::ip::Ipv6Prefix;
pub use self::layer::RateLimitLayer;
pub use self::proxies::{ForwardedHeader, InvalidProxy, TrustedProxies};
pub use self::rule::{KeyExtractor, MissingKey, Rule};
pub use self::service::RateLimit;
