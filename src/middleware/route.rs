//! [`Route`]: which requests draw from which bucket, and how a request's method, host and path
//! are matched against it.

use http::Method;
use std::fmt;

use super::path;
use crate::{BucketName, InvalidName, Limit};

/// Which requests draw from which bucket: a bucket name, a [`Limit`], and a pattern of method,
/// host and path.
///
/// The path pattern is matched segment by segment: `*` matches any one segment, and a final
/// `**` matches any rest (including nothing). `/api/v1/supplier/orders` matches only that path;
/// `/api/v2/nm-report/*/detail` matches any card; `/api/v1/**` matches everything under it.
/// Query strings are ignored.
///
/// # Spellings of one path
///
/// A route matches the request's path once normalized, so that a path spelled another way
/// draws from the same bucket instead of escaping it. The pattern is normalized the same way.
///
/// - Percent-encoded unreserved characters (letters, digits, `-`, `.`, `_`, `~`) are decoded,
///   whatever the case of their hex digits: `/api/v1/supplier/%6Frders` is
///   `/api/v1/supplier/orders`.
/// - Dot segments are removed (RFC 3986 §5.2.4), encoded dots (`%2E`) included: `/a/./b` and
///   `/a/x/../b` are `/a/b`.
/// - Empty segments are skipped: `//` counts as one `/`, and a trailing slash makes no
///   difference. Most servers route both spellings to one handler, and for a limiter matching
///   one path too many is the safe side.
///
/// What is not normalized, because it can name another resource: an encoded slash (`%2F`, or
/// `%2f`) stays part of its segment and never splits it, and any other escape of a reserved
/// character stays an escape (only the case of its hex digits is ignored); case in the path is
/// significant.
///
/// ```
/// use burstgate::Limit;
/// use burstgate::middleware::Route;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let orders = Route::new("orders", Limit::per_minute(1)?, "/api/v1/supplier/orders")?;
/// for spelled in [
///     "https://api.example/api/v1/supplier/%6Frders",
///     "https://api.example/api/v1/supplier/x/%2E%2E/orders",
///     "https://api.example//api/v1/supplier/orders/",
/// ] {
///     assert!(orders.matches_url(&http::Method::GET, &reqwest::Url::parse(spelled)?));
/// }
/// let elsewhere = reqwest::Url::parse("https://api.example/api/v1/supplier%2Forders")?;
/// assert!(!orders.matches_url(&http::Method::GET, &elsewhere));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub(super) bucket: BucketName,
    pub(super) limit: Limit,
    /// Tokens a request costs unless it carries a [`Cost`](super::Cost).
    pub(super) cost: u32,
    method: Option<Method>,
    host: Option<String>,
    path: Vec<Segment>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Exact(String),
    Any,
    Rest,
}

impl Route {
    /// Requests whose path matches `path` draw from bucket `bucket` (1 to 64 ASCII letters,
    /// digits, `_`, `.` or `-`), under `limit`. The path must start with `/`.
    pub fn new(bucket: &str, limit: Limit, path: &str) -> Result<Self, InvalidRoute> {
        let bucket = BucketName::checked(bucket).map_err(InvalidRoute::BucketName)?;
        if !path.starts_with('/') {
            return Err(InvalidRoute::Path);
        }
        let normalized = path::normalize(path);
        let segments: Vec<&str> = normalized.split('/').filter(|s| !s.is_empty()).collect();
        let last = segments.len().saturating_sub(1);
        let path = segments
            .iter()
            .enumerate()
            .map(|(i, s)| match *s {
                "**" if i == last => Segment::Rest,
                "*" => Segment::Any,
                s => Segment::Exact(s.to_owned()),
            })
            .collect();
        Ok(Self {
            bucket,
            limit,
            cost: 1,
            method: None,
            host: None,
            path,
        })
    }

    /// The same route run slightly under its limit's rate: every token's period lengthened by
    /// `per_token` ([`Limit::with_margin`]), for an API whose own bucket gives no tolerance.
    ///
    /// # Errors
    ///
    /// As [`Limit::with_margin`].
    pub fn margin(self, per_token: std::time::Duration) -> Result<Self, crate::InvalidLimit> {
        let limit = self.limit.with_margin(per_token)?;
        Ok(Self { limit, ..self })
    }

    /// What each request of the route costs, in tokens, unless it carries a
    /// [`Cost`](super::Cost) of its own (default 1): a batch endpoint that the API counts as
    /// several requests. A cost above the limit's burst can never be served, and is the
    /// middleware's error [`StoreError::CostAboveBurst`](crate::StoreError::CostAboveBurst).
    #[must_use]
    pub fn cost(self, tokens: std::num::NonZeroU32) -> Self {
        Self {
            cost: tokens.get(),
            ..self
        }
    }

    /// Matches only requests with this method.
    #[must_use]
    pub fn method(self, method: Method) -> Self {
        Self {
            method: Some(method),
            ..self
        }
    }

    /// Matches only requests to this host: compared without case, and without a trailing dot
    /// on either side (`api.example.` is the fully qualified spelling of `api.example`, and
    /// names the same host). No port.
    #[must_use]
    pub fn host(self, host: &str) -> Self {
        let host = host.strip_suffix('.').unwrap_or(host);
        Self {
            host: Some(host.to_ascii_lowercase()),
            ..self
        }
    }

    /// The same route drawing from bucket `bucket`, refused as [`Route::new`] refuses a name.
    #[cfg(feature = "seller")]
    pub(crate) fn renamed(self, bucket: &str) -> Result<Self, InvalidRoute> {
        Ok(Self {
            bucket: BucketName::checked(bucket).map_err(InvalidRoute::BucketName)?,
            ..self
        })
    }

    /// The same route under `limit`: the seller preset adjusts a group's limit in place, so a
    /// caller need not restate the pattern.
    #[cfg(feature = "seller")]
    pub(crate) fn relimited(self, limit: Limit) -> Self {
        Self { limit, ..self }
    }

    /// The bucket name.
    pub fn bucket(&self) -> &str {
        self.bucket.as_str()
    }

    /// The limit.
    pub fn limit(&self) -> Limit {
        self.limit
    }

    /// Whether a request with this method and URL draws from this route: the test the
    /// middleware makes, in order, for each route.
    pub fn matches_url(&self, method: &Method, url: &reqwest::Url) -> bool {
        if self.method.as_ref().is_some_and(|m| m != method) {
            return false;
        }
        if let Some(host) = &self.host
            && !url
                .host_str()
                .is_some_and(|h| h.strip_suffix('.').unwrap_or(h).eq_ignore_ascii_case(host))
        {
            return false;
        }
        self.matches_path(url.path())
    }

    pub(super) fn matches_path(&self, path: &str) -> bool {
        let path = path::normalize(path);
        let mut parts = path.split('/').filter(|s| !s.is_empty());
        for segment in &self.path {
            match segment {
                Segment::Rest => return true,
                Segment::Any => {
                    if parts.next().is_none() {
                        return false;
                    }
                }
                Segment::Exact(s) => {
                    if parts.next() != Some(s.as_str()) {
                        return false;
                    }
                }
            }
        }
        parts.next().is_none()
    }
}

/// Why a [`Route`] was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidRoute {
    /// The route's bucket name broke the naming rule.
    BucketName(InvalidName),
    /// The path pattern did not start with `/`.
    Path,
}

impl fmt::Display for InvalidRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BucketName(why) => write!(f, "invalid bucket name: {why}"),
            Self::Path => f.write_str("a route's path pattern must start with '/'"),
        }
    }
}

impl std::error::Error for InvalidRoute {}
