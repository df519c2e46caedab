//! The decision on an admitted request, handed to the handler through the request's extensions.

#[cfg(feature = "axum")]
use std::fmt;
use std::time::Duration;

use crate::{BucketName, Limit};

/// What the layer decided for an admitted request, put in the request's extensions before the
/// inner service is called, so a handler can show a client its quota or price by it. With the
/// `axum` feature it is an extractor (`RateLimitInfo` or `Option<RateLimitInfo>`).
///
/// When several rules applied, it describes the tightest: the one with the fewest whole tokens
/// left (the first of them on a tie), which is the one that will refuse this client first.
///
/// ```
/// use std::convert::Infallible;
/// use burstgate::{Limit, MemoryStore};
/// use burstgate::layer::{KeyExtractor, RateLimitInfo, RateLimitLayer, Rule};
/// use http::{Request, Response};
/// use tower::{Layer, Service, ServiceExt};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let mut svc = RateLimitLayer::new(MemoryStore::new())
///     .rule(Rule::new("global", Limit::per_minute(10)?, KeyExtractor::global())?)
///     .layer(tower::service_fn(|req: Request<String>| async move {
///         let left = req.extensions().get::<RateLimitInfo>().map_or(0, |i| i.remaining());
///         Ok::<_, Infallible>(Response::new(format!("{left} requests left")))
///     }));
/// let res = svc.ready().await?.call(Request::new(String::new())).await?;
/// // The inner service's own body, which the layer passed on.
/// assert_eq!(res.into_body().into_inner().ok().as_deref(), Some("9 requests left"));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimitInfo {
    pub(crate) rule: BucketName,
    pub(crate) limit: Limit,
    pub(crate) remaining: u32,
    pub(crate) resets_in: Duration,
    pub(crate) shadow_limited: bool,
}

impl RateLimitInfo {
    /// The rule's bucket name.
    pub fn rule(&self) -> &str {
        self.rule.as_str()
    }

    /// The limit that rule applied to the request.
    pub fn limit(&self) -> Limit {
        self.limit
    }

    /// Whole tokens left in the bucket after this request.
    pub fn remaining(&self) -> u32 {
        self.remaining
    }

    /// How long until the bucket is full again.
    pub fn resets_in(&self) -> Duration {
        self.resets_in
    }

    /// Whether a rule in [shadow mode](super::Rule::shadow) would have refused the request.
    pub fn shadow_limited(&self) -> bool {
        self.shadow_limited
    }
}

#[cfg(feature = "axum")]
mod extract {
    use axum::extract::{FromRequestParts, OptionalFromRequestParts};
    use http::request::Parts;

    use super::{MissingRateLimitInfo, RateLimitInfo};

    impl<S: Send + Sync> FromRequestParts<S> for RateLimitInfo {
        type Rejection = MissingRateLimitInfo;

        async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
            parts
                .extensions
                .get::<RateLimitInfo>()
                .cloned()
                .ok_or(MissingRateLimitInfo)
        }
    }

    impl<S: Send + Sync> OptionalFromRequestParts<S> for RateLimitInfo {
        type Rejection = std::convert::Infallible;

        async fn from_request_parts(
            parts: &mut Parts,
            _: &S,
        ) -> Result<Option<Self>, Self::Rejection> {
            Ok(parts.extensions.get::<RateLimitInfo>().cloned())
        }
    }
}

/// The rejection of the [`RateLimitInfo`](crate::layer::RateLimitInfo) extractor when the
/// request carries no decision: no [`RateLimitLayer`](crate::RateLimitLayer) is in front of the
/// handler, or no rule applied to the request. Answered `500 Internal Server Error`; extract
/// `Option<RateLimitInfo>` where no rule applying is expected.
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct MissingRateLimitInfo;

#[cfg(feature = "axum")]
impl fmt::Display for MissingRateLimitInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(
            "no rate limit decision in the request: no RateLimitLayer in front of this handler, \
             or no rule applied",
        )
    }
}

#[cfg(feature = "axum")]
impl std::error::Error for MissingRateLimitInfo {}

#[cfg(feature = "axum")]
impl axum::response::IntoResponse for MissingRateLimitInfo {
    fn into_response(self) -> axum::response::Response {
        (http::StatusCode::INTERNAL_SERVER_ERROR, self.to_string()).into_response()
    }
}
