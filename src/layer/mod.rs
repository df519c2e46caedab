// The module docs are a file of their own, docs/layer.md: long prose reads better there, and
// rustdoc still renders and doctests it here.
//
// The files: the layer, its service and its response future in `layer.rs`, `service.rs` and
// `future.rs`, and what they share in `config.rs`; rules in `rule.rs` and key extractors in
// `key_extractor.rs`; the rules loop in `decide.rs`; the `RateLimit-Policy` and `RateLimit`
// values in `headers.rs` (a request's `RateLimit-Policy` built by `headers::policy_for` alone);
// a 429 in `rejection.rs`, a gRPC call's refusal in `grpc.rs`, the body that wraps the inner
// service's in `body.rs`; client addresses in `ip.rs` and `proxies.rs`; the decision hook,
// metrics and logs in `observe.rs`; the decision handed to the handler in `info.rs`.
#![doc = include_str!("../../docs/layer.md")]

mod body;
mod config;
mod decide;
mod future;
mod grpc;
mod headers;
mod info;
mod ip;
mod key_extractor;
#[allow(clippy::module_inception)] // the tower-http layout: layer.rs, service.rs, future.rs
mod layer;
mod observe;
mod proxies;
mod rejection;
mod rule;
mod service;

pub use self::body::ResponseBody;
pub use self::future::ResponseFuture;
pub use self::headers::FieldVersion;
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use self::info::MissingRateLimitInfo;
pub use self::info::RateLimitInfo;
pub use self::ip::Ipv6Prefix;
pub use self::key_extractor::KeyExtractor;
pub use self::layer::RateLimitLayer;
pub use self::observe::{DecisionEvent, Outcome};
pub use self::proxies::{ForwardedHeader, InvalidProxy, TrustedProxies};
pub use self::rule::{MissingKey, Rule};
pub use self::service::RateLimit;
pub use crate::pattern::InvalidPath;
