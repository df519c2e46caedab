// The module docs are a file of their own, docs/layer.md: long prose reads better there, and
// rustdoc still renders and doctests it here.
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
pub use self::info::RateLimitInfo;
pub use self::ip::Ipv6Prefix;
pub use self::key_extractor::KeyExtractor;
pub use self::layer::RateLimitLayer;
pub use self::observe::{DecisionEvent, Outcome};
pub use self::proxies::{ForwardedHeader, InvalidProxy, TrustedProxies};
pub use self::rule::{MissingKey, Rule};
pub use self::service::RateLimit;
