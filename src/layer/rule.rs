//! Rules: which requests a limit applies to, whose bucket they draw from, and what they cost.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http::request::Parts;
use http::{HeaderValue, StatusCode};

use super::headers;
use super::key_extractor::KeyExtractor;
use super::observe::RuleObserver;
use crate::pattern::{InvalidPath, Pattern};
use crate::{Audit, BucketKey, BucketName, InvalidKey, InvalidName, Limit};

/// One limit of a [`RateLimitLayer`](super::RateLimitLayer): a bucket name, the [`Limit`], a
/// [`KeyExtractor`] that says whose bucket a request draws from, and the request's cost.
///
/// A request passes a layer only if it passes every rule that applies to it; a rule applies when
/// its extractor finds a key. What a rule does with a request it finds no key for is
/// [`on_missing_key`](Self::on_missing_key)'s choice.
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
/// let per_key = per_key.cost(|req| if req.uri.path().starts_with("/export") { 5 } else { 1 });
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Rule {
    pub(crate) bucket: BucketName,
    pub(crate) limit: Limit,
    pub(crate) key: KeyExtractor,
    cost: Option<CostFn>,
    /// The request's limit, when it is not always `limit`.
    dynamic: Option<LimitFn>,
    /// Decides and counts, never refuses.
    pub(crate) shadow: bool,
    /// This rule's item of `RateLimit-Policy` for `limit`, which never changes.
    pub(crate) policy: HeaderValue,
    /// `None` until the user chooses: pass, and say so once.
    missing: Option<MissingKey>,
    /// Whether the first request without a key was logged. Shared by the rule's clones (one
    /// per service in axum), so a rule warns once, not once per connection.
    warned: Arc<AtomicBool>,
    /// The rule's log gates and metrics, shared by its clones for the same reason.
    pub(crate) observer: Arc<RuleObserver>,
    /// The requests it applies to, when not all: a method and a path pattern.
    pattern: Option<Pattern>,
    /// The trail of its decisions, when it keeps one.
    pub(crate) audit: Option<Audit>,
}

/// What a [`Rule`] does with a request its extractor finds no key for, chosen with
/// [`Rule::on_missing_key`].
///
/// Until one is chosen, a rule keyed on a header ([`KeyExtractor::header`],
/// [`KeyExtractor::keyed_header`]) refuses such a request (`400`, as [`Reject`](Self::Reject)):
/// the header is the client's to send, and leaving it out must not be a way around the limit.
/// Under any other extractor it passes, and the first one logs a `tracing` warning naming the
/// rule: a rule that finds no key limits nothing, which for [`KeyExtractor::peer_ip`] on a
/// server that does not provide the peer's address is a misconfiguration nobody would
/// otherwise notice, and a [`from_fn`](KeyExtractor::from_fn) that returns no key is how a
/// rule applies to some requests only.
///
/// ```
/// use burstgate::Limit;
/// use burstgate::layer::{KeyExtractor, MissingKey, Rule};
///
/// // Anonymous requests are limited by another rule: let them through, and do not warn.
/// let per_key = Rule::new(
///     "per-key",
///     Limit::per_second(10)?,
///     KeyExtractor::header(http::HeaderName::from_static("x-api-key")),
/// )?
/// .on_missing_key(MissingKey::Pass);
/// assert_eq!(per_key.missing_key(), Some(MissingKey::Pass));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MissingKey {
    /// The rule does not apply: the request goes on, unlimited by it, and nothing is logged.
    /// For a rule meant for some requests only (a header some clients send, a
    /// [`from_fn`](KeyExtractor::from_fn) that picks some paths).
    Pass,
    /// The request is answered at once, without reaching the service and without taking any
    /// rule's tokens, and the first one logs a warning. The status says whose fault it is:
    /// `500 Internal Server Error` for [`peer_ip`](KeyExtractor::peer_ip) and
    /// [`client_ip`](KeyExtractor::client_ip), whose address the server provides, and
    /// `400 Bad Request` for [`header`](KeyExtractor::header) and
    /// [`from_fn`](KeyExtractor::from_fn), whose key the request lacks.
    Reject,
}

type CostFn = Arc<dyn Fn(&Parts) -> u32 + Send + Sync>;
type LimitFn = Arc<dyn Fn(&Parts) -> Limit + Send + Sync>;

impl Rule {
    /// A rule named `bucket` (1 to 64 ASCII letters, digits, `_`, `.` or `-`; it names the
    /// bucket in the store and the policy in the `RateLimit` headers). Each request costs one
    /// token unless [`cost`](Self::cost) says otherwise.
    pub fn new(bucket: &str, limit: Limit, key: KeyExtractor) -> Result<Self, InvalidKey> {
        let bucket = BucketName::new(bucket)?;
        // A checked name is printable ASCII, so its item is always a valid header value; the
        // error is the one a name the header could not carry would deserve.
        let policy = headers::policy_item(bucket.as_str(), limit)
            .ok_or(InvalidKey::BucketName(InvalidName::Empty))?;
        Ok(Self {
            bucket,
            limit,
            key,
            cost: None,
            dynamic: None,
            shadow: false,
            policy,
            missing: None,
            warned: Arc::new(AtomicBool::new(false)),
            observer: Arc::new(RuleObserver::new()),
            pattern: None,
            audit: None,
        })
    }

    /// Appends every decision of the rule to its buckets' [`Audit`] trail, in Redis beside each
    /// bucket, in the same call as the decision (a `RedisStore`'s; other stores keep none): when
    /// an account's budget ran out, which requests, from which process, took it, and which were
    /// refused. Read it with `burstgate audit <bucket> [<key>]`. A request the rule decides
    /// alone then goes through the several-bucket script, which writes the trail.
    #[must_use]
    pub fn audit(self, audit: Audit) -> Self {
        Self {
            audit: Some(audit),
            ..self
        }
    }

    /// Applies the rule only to requests with this method (by default, every method); a rule for
    /// `GET` also takes `HEAD` requests, which servers answer with the `GET` handler.
    ///
    /// ```
    /// use burstgate::Limit;
    /// use burstgate::layer::{KeyExtractor, RateLimitLayer, Rule};
    /// use burstgate::MemoryStore;
    /// use http::Method;
    ///
    /// // Per client address: 5 logins a minute, 50 searches a second, 1,000 requests a second in
    /// // all. A login takes from its rule and the overall one at once, or from neither.
    /// let ip = KeyExtractor::peer_ip;
    /// let layer = RateLimitLayer::new(MemoryStore::new())
    ///     .rule(Rule::new("login", Limit::per_minute(5)?, ip())?.method(Method::POST).path("/login")?)
    ///     .rule(Rule::new("search", Limit::per_second(50)?, ip())?.path("/search/**")?)
    ///     .rule(Rule::new("all", Limit::per_second(1_000)?, ip())?);
    /// # let _ = layer;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn method(self, method: http::Method) -> Self {
        let pattern = self.pattern.unwrap_or_else(Pattern::any).method(method);
        Self {
            pattern: Some(pattern),
            ..self
        }
    }

    /// Applies the rule only to requests whose path matches `pattern` (by default, every
    /// path), matched as the reqwest middleware's routes match theirs: segment by segment,
    /// `*` any one segment, a final `**` any rest, on the path normalized so that another
    /// spelling of it (`%6Frders`, `/a/./b`, `//`, a trailing slash) is the same path, while an
    /// encoded slash (`%2F`) never splits a segment; case is significant, the query ignored.
    /// A request the pattern does not match is not the rule's: no tokens, no field, no key
    /// asked for.
    ///
    /// # Errors
    ///
    /// [`InvalidPath`] unless `pattern` starts with `/`.
    pub fn path(self, pattern: &str) -> Result<Self, InvalidPath> {
        let mut path = Pattern::path(pattern).ok_or_else(|| InvalidPath::new(pattern))?;
        if let Some(method) = self.pattern.as_ref().and_then(Pattern::method_of) {
            path = path.method(method.clone());
        }
        Ok(Self {
            pattern: Some(path),
            ..self
        })
    }

    /// What the rule does with a request its extractor finds no key for (see [`MissingKey`]).
    /// Until this is called, a rule keyed on a header refuses such a request with `400`, and
    /// any other passes it; either way the first one logs a warning.
    #[must_use]
    pub fn on_missing_key(self, missing: MissingKey) -> Self {
        Self {
            missing: Some(missing),
            ..self
        }
    }

    /// What [`on_missing_key`](Self::on_missing_key) chose, if it was called.
    pub fn missing_key(&self) -> Option<MissingKey> {
        self.missing
    }

    /// Prices each request: `cost` sees the request's head and returns the tokens it takes. A
    /// cost of zero or above the limit's burst is a misconfiguration, answered with 500.
    #[must_use]
    pub fn cost(self, cost: impl Fn(&Parts) -> u32 + Send + Sync + 'static) -> Self {
        Self {
            cost: Some(Arc::new(cost)),
            ..self
        }
    }

    /// Takes each request's limit from `limit`, which sees the request's head: a plan or tier
    /// that an authentication layer put in the extensions, or a limit read from configuration
    /// that may change while the service runs. The limit given to [`new`](Self::new) is the
    /// one [`limit`](Self::limit) reports; return it as the fallback.
    ///
    /// The store keeps only each bucket's tokens, so a new limit applies from the next request
    /// on: a bucket holding more tokens than a lower burst allows is capped to it, and a higher
    /// burst fills at the new rate. The function runs on every request the rule applies to;
    /// keep it to a lookup.
    ///
    /// ```
    /// use std::sync::{Arc, RwLock};
    /// use burstgate::Limit;
    /// use burstgate::layer::{KeyExtractor, Rule};
    ///
    /// /// What an authentication layer puts in the request's extensions.
    /// #[derive(Clone, Copy)]
    /// enum Plan { Free, Pro }
    ///
    /// let free = Limit::per_minute(60)?;
    /// // Reloaded from configuration while the service runs.
    /// let pro = Arc::new(RwLock::new(Limit::per_second(50)?.with_burst(100)?));
    /// let reloaded = Arc::clone(&pro);
    /// let per_key = Rule::new(
    ///     "per-key",
    ///     free,
    ///     KeyExtractor::header(http::HeaderName::from_static("x-api-key")),
    /// )?
    /// .dynamic_limit(move |req| match req.extensions.get::<Plan>() {
    ///     Some(Plan::Pro) => reloaded.read().map_or(free, |l| *l),
    ///     Some(Plan::Free) | None => free,
    /// });
    /// // Later, on a configuration reload:
    /// *pro.write().map_err(|_| "lock poisoned")? = Limit::per_second(80)?.with_burst(160)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn dynamic_limit(self, limit: impl Fn(&Parts) -> Limit + Send + Sync + 'static) -> Self {
        Self {
            dynamic: Some(Arc::new(limit)),
            ..self
        }
    }

    /// Shadow (dry-run) mode for this rule: it decides and takes tokens as usual, and its
    /// decisions are counted and reported (as `shadow_limited` when it would have refused), but
    /// it never refuses a request nor makes one wait. The way to roll a new limit out: watch
    /// what it would do, then turn shadow mode off. [`RateLimitLayer::shadow`] puts every rule
    /// in shadow mode.
    ///
    /// [`RateLimitLayer::shadow`]: super::RateLimitLayer::shadow
    #[must_use]
    pub fn shadow(self, on: bool) -> Self {
        Self { shadow: on, ..self }
    }

    /// Whether the rule is in [`shadow`](Self::shadow) mode.
    pub fn is_shadow(&self) -> bool {
        self.shadow
    }

    /// The bucket name.
    pub fn bucket(&self) -> &str {
        self.bucket.as_str()
    }

    /// The limit given to [`new`](Self::new); a [`dynamic_limit`](Self::dynamic_limit) may
    /// choose another per request.
    pub fn limit(&self) -> Limit {
        self.limit
    }

    /// Whether [`dynamic_limit`](Self::dynamic_limit) chose the limit per request.
    pub(crate) fn is_dynamic(&self) -> bool {
        self.dynamic.is_some()
    }

    /// The bucket name, shared.
    pub(crate) fn bucket_name(&self) -> &BucketName {
        &self.bucket
    }

    /// What the rule makes of a request: its bucket, cost and limit, or why it has none.
    pub(crate) fn plan(&self, parts: &Parts) -> Plan {
        if let Some(pattern) = &self.pattern
            && !pattern.matches(&parts.method, None, parts.uri.path())
        {
            return Plan::Skip;
        }
        if let Some(key) = self.key.extract(&self.bucket, parts) {
            let cost = self.cost.as_ref().map_or(1, |f| f(parts));
            let limit = self.dynamic.as_ref().map_or(self.limit, |f| f(parts));
            return Plan::Apply(key, cost, limit);
        }
        match self.missing {
            Some(MissingKey::Pass) => Plan::Skip,
            // A header's key is the client's to send: leaving it out must not be the way
            // around the limit.
            None if self.key.is_header() => {
                self.warn_once("requests without one are refused (the default for a header)");
                tracing::debug!(bucket = self.bucket(), "no rate limit key; refused");
                Plan::Refuse(self.key.missing_status())
            }
            None => {
                self.warn_once("requests without one are not limited by this rule");
                Plan::Skip
            }
            Some(MissingKey::Reject) => {
                self.warn_once("requests without one are refused");
                tracing::debug!(bucket = self.bucket(), "no rate limit key; refused");
                Plan::Refuse(self.key.missing_status())
            }
        }
    }

    /// Logs the first request without a key: the rule and the kind of extractor, never anything
    /// of the request.
    fn warn_once(&self, outcome: &'static str) {
        // A load first: after the first request this is read on every keyless one, and a read
        // leaves the cache line shared.
        if self.warned.load(Ordering::Relaxed) || self.warned.swap(true, Ordering::Relaxed) {
            return;
        }
        tracing::warn!(
            bucket = self.bucket(),
            extractor = self.key.name(),
            hint = self.key.hint(),
            outcome,
            "rate limit rule found no key in a request"
        );
    }
}

/// What a rule makes of one request.
pub(crate) enum Plan {
    /// The rule applies: the bucket, the request's cost there and its limit.
    Apply(BucketKey, u32, Limit),
    /// The rule does not apply.
    Skip,
    /// The request has no key and the rule refuses it with this status.
    Refuse(StatusCode),
}

impl fmt::Debug for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rule")
            .field("bucket", &self.bucket)
            .field("limit", &self.limit)
            .field("key", &self.key)
            .field("cost", &self.cost.as_ref().map(|_| "Fn(&Parts) -> u32"))
            .field(
                "dynamic_limit",
                &self.dynamic.as_ref().map(|_| "Fn(&Parts) -> Limit"),
            )
            .field("shadow", &self.shadow)
            .field("missing_key", &self.missing)
            .field("pattern", &self.pattern)
            .field("audit", &self.audit)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use http::HeaderName;

    use super::*;

    fn parts(req: http::Request<()>) -> Parts {
        req.into_parts().0
    }

    impl Plan {
        fn applied(self) -> Option<(BucketKey, u32)> {
            match self {
                Plan::Apply(key, cost, _) => Some((key, cost)),
                Plan::Skip | Plan::Refuse(_) => None,
            }
        }
    }

    /// The cases every matcher built on the shared pattern agrees on, through a rule: a request
    /// the pattern matches is the rule's, any other is skipped.
    #[test]
    fn a_rule_matches_the_shared_pattern_cases() {
        let limit = Limit::per_second(1).expect("a valid limit");
        for &(pattern, method, asked, path, expected) in crate::pattern::CASES {
            let mut rule = Rule::new("r", limit, KeyExtractor::global()).expect("a rule");
            if let Some(m) = method {
                rule = rule.method(http::Method::from_bytes(m.as_bytes()).expect("a method"));
            }
            let rule = rule.path(pattern).expect("a pattern");
            let req = http::Request::builder()
                .method(asked)
                .uri(format!("http://h{path}?q=1"))
                .body(())
                .expect("a request");
            let applied = rule.plan(&parts(req)).applied().is_some();
            assert_eq!(
                applied, expected,
                "{pattern} {method:?} against {asked} {path}"
            );
        }
    }

    #[test]
    fn a_path_pattern_must_start_with_a_slash_and_keeps_the_method() {
        let limit = Limit::per_second(1).expect("a valid limit");
        let rule = Rule::new("r", limit, KeyExtractor::global()).expect("a rule");
        let err = rule.clone().path("login").expect_err("no slash");
        assert_eq!(
            err.to_string(),
            "a path pattern must start with '/', got \"login\""
        );
        // The method first, then the path: the path keeps it.
        let post_login = rule
            .method(http::Method::POST)
            .path("/login")
            .expect("a pattern");
        let ask = |method: http::Method| {
            let req = http::Request::builder()
                .method(method)
                .uri("/login")
                .body(())
                .expect("a request");
            post_login.plan(&parts(req)).applied().is_some()
        };
        assert!(ask(http::Method::POST));
        assert!(!ask(http::Method::GET));
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
        let (key, cost) = header.plan(&with).applied().expect("applies");
        assert!(key.as_str().starts_with("k:#") && !key.as_str().contains("sekrit"));
        assert_eq!(cost, 1);
        let empty = parts(
            http::Request::builder()
                .header("x-api-key", "")
                .body(())
                .expect("a request"),
        );
        assert!(header.plan(&empty).applied().is_none());
        assert!(
            header
                .plan(&parts(http::Request::new(())))
                .applied()
                .is_none()
        );

        let ip = Rule::new("ip", limit, KeyExtractor::peer_ip()).expect("a valid rule");
        let mut req = http::Request::new(());
        req.extensions_mut()
            .insert(SocketAddr::from(([10, 0, 0, 7], 4242)));
        assert_eq!(
            ip.plan(&parts(req))
                .applied()
                .map(|(k, _)| k.to_string())
                .as_deref(),
            Some("ip:10.0.0.7")
        );
        assert!(ip.plan(&parts(http::Request::new(()))).applied().is_none());

        let global = Rule::new("all", limit, KeyExtractor::global()).expect("a valid rule");
        assert!(
            global
                .plan(&parts(http::Request::new(())))
                .applied()
                .is_some()
        );

        let custom = Rule::new(
            "path",
            limit,
            KeyExtractor::from_fn(|p| Some(p.uri.path().to_owned())),
        )
        .expect("a valid rule")
        .cost(|_| 3);
        let (key, cost) = custom
            .plan(&parts(http::Request::new(())))
            .applied()
            .expect("applies");
        assert_eq!((key.as_str(), cost), ("path:/", 3));
    }

    #[test]
    fn a_missing_key_is_refused_with_the_status_of_whose_fault_it_is() {
        let limit = Limit::per_second(1).expect("a valid limit");
        let refuse = |key| {
            let rule = Rule::new("r", limit, key)
                .expect("a valid rule")
                .on_missing_key(MissingKey::Reject);
            match rule.plan(&parts(http::Request::new(()))) {
                Plan::Refuse(status) => Some(status),
                Plan::Apply(..) | Plan::Skip => None,
            }
        };
        assert_eq!(
            refuse(KeyExtractor::peer_ip()),
            Some(StatusCode::INTERNAL_SERVER_ERROR)
        );
        let header = KeyExtractor::header(HeaderName::from_static("x-api-key"));
        assert_eq!(refuse(header), Some(StatusCode::BAD_REQUEST));
        assert_eq!(
            refuse(KeyExtractor::from_fn(|_| None)),
            Some(StatusCode::BAD_REQUEST)
        );
        assert_eq!(refuse(KeyExtractor::global()), None);
    }

    #[test]
    fn rule_names_are_checked() {
        let limit = Limit::per_second(1).expect("a valid limit");
        assert_eq!(
            Rule::new("no spaces", limit, KeyExtractor::global()).map(drop),
            Err(InvalidKey::BucketName(InvalidName::Character {
                index: 2,
                byte: b' '
            }))
        );
    }
}
