//! Which requests a client's [`Route`](crate::middleware::Route) or a server's
//! [`Rule`](crate::layer::Rule) applies to: a method, a host and a path pattern. One matcher and
//! one normalization for both, so that a pattern means the same thing on either side, and a path
//! spelled another way (`%6Frders`, `/a/./b`, `//`) is the path it names.
//!
//! The path pattern is matched segment by segment, on the path normalized (`path.rs`): `*`
//! matches any one segment, a final `**` any rest (including nothing), and any other segment
//! itself. Empty segments are skipped in both, so a trailing slash makes no difference.

mod path;

#[cfg(feature = "tower")]
use std::fmt;

use http::Method;

/// A method, a host and a path pattern; each `None` (or `/**`) matches anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pattern {
    method: Option<Method>,
    /// Lower case, without a trailing dot.
    host: Option<String>,
    path: Vec<Segment>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Exact(String),
    Any,
    Rest,
}

impl Pattern {
    /// Requests whose path matches `path`, whatever their method and host. `None` unless `path`
    /// starts with `/`.
    pub(crate) fn path(path: &str) -> Option<Self> {
        if !path.starts_with('/') {
            return None;
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
        Some(Self {
            method: None,
            host: None,
            path,
        })
    }

    /// Every request: any method, any host, any path.
    #[cfg_attr(not(feature = "tower"), allow(dead_code))]
    pub(crate) fn any() -> Self {
        Self {
            method: None,
            host: None,
            path: vec![Segment::Rest],
        }
    }

    /// The same pattern, for requests with `method` only.
    #[must_use]
    pub(crate) fn method(self, method: Method) -> Self {
        Self {
            method: Some(method),
            ..self
        }
    }

    /// The method it asks for, if any.
    #[cfg_attr(not(feature = "tower"), allow(dead_code))]
    pub(crate) fn method_of(&self) -> Option<&Method> {
        self.method.as_ref()
    }

    /// The same pattern, for requests to `host` only: compared without case, and without a
    /// trailing dot on either side (`api.example.` is the fully qualified spelling of
    /// `api.example`). No port.
    #[cfg_attr(not(feature = "reqwest"), allow(dead_code))]
    #[must_use]
    pub(crate) fn host(self, host: &str) -> Self {
        let host = host.strip_suffix('.').unwrap_or(host);
        Self {
            host: Some(host.to_ascii_lowercase()),
            ..self
        }
    }

    /// Whether a request with this method, host (`None` when it names none) and path matches.
    /// A `HEAD` matches a `GET` pattern: servers answer it with the `GET` handler (axum's `get`
    /// routes both), so a rule for `GET` alone would let it through unlimited.
    pub(crate) fn matches(&self, method: &Method, host: Option<&str>, path: &str) -> bool {
        if let Some(want) = &self.method
            && want != method
            && !(want == Method::GET && method == Method::HEAD)
        {
            return false;
        }
        if let Some(want) = &self.host
            && !host.is_some_and(|h| h.strip_suffix('.').unwrap_or(h).eq_ignore_ascii_case(want))
        {
            return false;
        }
        self.matches_path(path)
    }

    /// Whether `path`, normalized, matches the path pattern.
    pub(crate) fn matches_path(&self, path: &str) -> bool {
        if let [Segment::Rest] = self.path.as_slice() {
            return true;
        }
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

/// A path pattern that does not start with `/`.
#[cfg(feature = "tower")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidPath {
    pattern: String,
}

#[cfg(feature = "tower")]
impl InvalidPath {
    pub(crate) fn new(pattern: &str) -> Self {
        Self {
            pattern: pattern.chars().take(64).collect(),
        }
    }
}

#[cfg(feature = "tower")]
impl fmt::Display for InvalidPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "a path pattern must start with '/', got {:?}",
            self.pattern
        )
    }
}

#[cfg(feature = "tower")]
impl std::error::Error for InvalidPath {}

/// Cases every matcher built on [`Pattern`] must agree on: a pattern, a method and a path, and
/// whether they match. The route's tests and the rule's run them through their own front end.
#[cfg(test)]
pub(crate) const CASES: &[(&str, Option<&str>, &str, &str, bool)] = &[
    // (pattern, pattern's method, request method, request path, matches)
    (
        "/api/v1/supplier/orders",
        None,
        "GET",
        "/api/v1/supplier/orders",
        true,
    ),
    (
        "/api/v1/supplier/orders",
        None,
        "GET",
        "/api/v1/supplier/orders/7",
        false,
    ),
    (
        "/api/v1/supplier/orders",
        None,
        "GET",
        "/api/v1/supplier",
        false,
    ),
    (
        "/api/v1/supplier/orders",
        None,
        "GET",
        "/api/v1/supplier/%6Frders",
        true,
    ),
    (
        "/api/v1/supplier/orders",
        None,
        "GET",
        "/api/v1/supplier/x/%2E%2E/orders",
        true,
    ),
    (
        "/api/v1/supplier/orders",
        None,
        "GET",
        "//api/v1/supplier/orders/",
        true,
    ),
    (
        "/api/v1/supplier/orders",
        None,
        "GET",
        "/api/v1/supplier%2Forders",
        false,
    ),
    (
        "/api/v1/supplier/orders",
        None,
        "GET",
        "/api/v1/Supplier/orders",
        false,
    ),
    ("/cards/*/detail", None, "GET", "/cards/42/detail", true),
    ("/cards/*/detail", None, "GET", "/cards/detail", false),
    ("/api/**", Some("POST"), "POST", "/api", true),
    ("/api/**", Some("POST"), "POST", "/api/a/b/c", true),
    ("/api/**", Some("POST"), "GET", "/api/a", false),
    ("/search", Some("GET"), "HEAD", "/search", true),
    ("/search", Some("HEAD"), "GET", "/search", false),
    ("/search", Some("GET"), "POST", "/search", false),
    ("/api/**", None, "GET", "/apis", false),
    ("/login", Some("POST"), "POST", "/login/", true),
    ("/files/*", None, "GET", "/files/a%2Fb", true),
    ("/files/*", None, "GET", "/files/a/b", false),
    ("/**", None, "DELETE", "/anything/at/all", true),
    ("/", None, "GET", "/", true),
    ("/", None, "GET", "/x", false),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shared_cases_hold_for_the_pattern_itself() {
        for &(pattern, method, asked, path, expected) in CASES {
            let mut p = Pattern::path(pattern).expect("a pattern");
            if let Some(m) = method {
                p = p.method(Method::from_bytes(m.as_bytes()).expect("a method"));
            }
            let asked = Method::from_bytes(asked.as_bytes()).expect("a method");
            assert_eq!(
                p.matches(&asked, None, path),
                expected,
                "{pattern} {method:?} against {asked} {path}"
            );
        }
    }

    #[test]
    fn a_pattern_must_start_with_a_slash() {
        assert_eq!(Pattern::path("orders"), None);
        assert_eq!(Pattern::path(""), None);
        assert!(Pattern::path("/").is_some());
    }

    #[test]
    fn a_host_matches_without_case_or_trailing_dot() {
        let p = Pattern::any().host("API.example.");
        for host in ["api.example", "API.EXAMPLE.", "Api.Example"] {
            assert!(p.matches(&Method::GET, Some(host), "/"), "{host}");
        }
        assert!(!p.matches(&Method::GET, Some("other.example"), "/"));
        assert!(!p.matches(&Method::GET, None, "/"));
    }
}
