use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;
use http::{HeaderName, HeaderValue, StatusCode};
use tower_layer::Layer;

use super::config::Config;
use super::headers::{self, FieldVersion};
use super::observe::DecisionEvent;
use super::rejection::{Rejection, RejectionBody};
use super::{RateLimit, Rule};
use crate::{BucketStore, MemoryStore, OutagePolicy, RateLimited};

/// Applies [`Rule`]s to every request of the wrapped service. See the [module docs](super).
///
/// Cheap to clone: the configuration is shared behind an `Arc`.
pub struct RateLimitLayer<St> {
    pub(crate) config: Arc<Config<St>>,
}

impl<St: BucketStore + Clone> RateLimitLayer<St> {
    /// A layer deciding on `store`, with no rules yet: add them with [`rule`](Self::rule).
    ///
    /// By default it never waits (a request over the limit is answered 429 at once, the usual
    /// server-side choice) and adds a `RateLimit` field to admitted responses.
    pub fn new(store: St) -> Self {
        Self {
            config: Arc::new(Config {
                store,
                rules: Vec::new(),
                policy_all: None,
                any_dynamic: false,
                max_wait: Duration::ZERO,
                headers_on_success: true,
                fields: FieldVersion::default(),
                rejection: Rejection::default(),
                shadow: false,
                skip: None,
                on_decision: None,
                apart: Arc::default(),
                abandoned: Default::default(),
                partition_keys: false,
                outage: OutagePolicy::LOCAL,
                fallback: MemoryStore::new(),
            }),
        }
    }

    /// Adds a rule. A request must pass every rule that applies to it, checked in the order
    /// they were added.
    #[must_use]
    pub fn rule(mut self, rule: Rule) -> Self {
        let config = Arc::make_mut(&mut self.config);
        config.rules.push(rule);
        config.policy_all = headers::policy(config.rules.iter().map(|r| &r.policy));
        config.any_dynamic = config.rules.iter().any(Rule::is_dynamic);
        self
    }

    /// Waits instead of rejecting: a request that its buckets can serve within `max_wait`
    /// reserves its tokens and is passed on once they have refilled, in arrival order; only
    /// one beyond the ceiling is rejected. Zero (the default) never waits.
    #[must_use]
    pub fn max_wait(mut self, max_wait: Duration) -> Self {
        Arc::make_mut(&mut self.config).max_wait = max_wait;
        self
    }

    /// What a request gets when the store fails (unreachable, timed out, or behind an open
    /// circuit breaker): by default [`OutagePolicy::LOCAL`], a decision on buckets in this
    /// process with each rule's whole limit, so that the limiter is not the outage; with `N`
    /// processes behind one Redis, at most `N` times the limit gets through while it is away.
    /// [`OutagePolicy::Local`] with the number of processes shares the limit out instead,
    /// [`OutagePolicy::FailClosed`] answers `503` and [`OutagePolicy::FailOpen`] lets every
    /// request through. A `RedisStore` whose own policy is not `FailClosed` answers the outage
    /// itself, and the layer never sees it. See the [module docs](crate::layer), "When the
    /// store fails".
    #[must_use]
    pub fn on_outage(mut self, policy: OutagePolicy) -> Self {
        Arc::make_mut(&mut self.config).outage = policy;
        self
    }

    /// Whether each item of the `RateLimit` field names its partition with the draft's `pk`
    /// parameter (default: no): the bucket key's fingerprint as a Byte Sequence, never the key,
    /// the same on every replica once the process has a [`KeySecret`](crate::KeySecret) (see
    /// [`BucketKey::fingerprint`](crate::BucketKey::fingerprint)), a salt of the process's own
    /// otherwise. Off by default: a client usually knows whose quota it spends, and the
    /// fingerprint is a keyed hash on every response.
    #[must_use]
    pub fn partition_keys(mut self, on: bool) -> Self {
        Arc::make_mut(&mut self.config).partition_keys = on;
        self
    }

    /// Whether admitted responses carry the `RateLimit-Policy` and `RateLimit` fields (default:
    /// yes). Rejections always carry `Retry-After`, `RateLimit-Policy` and `RateLimit`.
    #[must_use]
    pub fn headers_on_success(mut self, on: bool) -> Self {
        Arc::make_mut(&mut self.config).headers_on_success = on;
        self
    }

    /// Which rate-limit header fields responses carry (default: [`FieldVersion::Draft11`], the
    /// newest draft's `RateLimit-Policy` and `RateLimit`). [`FieldVersion::Draft06`] writes the
    /// older `RateLimit-Limit`, `RateLimit-Remaining` and `RateLimit-Reset` instead, for clients
    /// that read those.
    #[must_use]
    pub fn fields(mut self, version: FieldVersion) -> Self {
        Arc::make_mut(&mut self.config).fields = version;
        self
    }

    /// The status of a rejection (default: 429 Too Many Requests). A gRPC call is always
    /// answered HTTP 200 with `grpc-status: 8` (RESOURCE_EXHAUSTED), which its client needs to
    /// read the refusal as one.
    #[must_use]
    pub fn rejection_status(mut self, status: StatusCode) -> Self {
        Arc::make_mut(&mut self.config).rejection.status = status;
        self
    }

    /// Adds a header to every rejection (it replaces one of the same name set by the layer).
    #[must_use]
    pub fn rejection_header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        Arc::make_mut(&mut self.config)
            .rejection
            .headers
            .insert(name, value);
        self
    }

    /// The body of a rejection, made from the [`RateLimited`] it reports (default: a line of
    /// text with the seconds to wait), sent as `text/plain`. For a gRPC call it becomes the
    /// `grpc-message`. Replaces [`problem_details`](Self::problem_details).
    #[must_use]
    pub fn rejection_body(
        mut self,
        body: impl Fn(&RateLimited) -> String + Send + Sync + 'static,
    ) -> Self {
        Arc::make_mut(&mut self.config).rejection.body = RejectionBody::Custom(Arc::new(body));
        self
    }

    /// Answers a refused HTTP request with the `quota-exceeded` problem details that
    /// draft-ietf-httpapi-ratelimit-headers registers (RFC 9457, `application/problem+json`)
    /// instead of a line of text; `false` goes back to the text, unless a
    /// [`rejection_body`](Self::rejection_body) was set since. It names the rule that refused
    /// as the violated policy, by its bucket name, the name its `RateLimit` item carries with
    /// the default fields:
    ///
    /// ```json
    /// {"type":"https://iana.org/assignments/http-problem-types#quota-exceeded",
    ///  "title":"Quota Exceeded","status":429,"detail":"retry after 2 s",
    ///  "violated-policies":["per-key"]}
    /// ```
    ///
    /// Replaces a [`rejection_body`](Self::rejection_body). gRPC calls are answered in gRPC's
    /// terms either way.
    #[must_use]
    pub fn problem_details(mut self, on: bool) -> Self {
        let body = &mut Arc::make_mut(&mut self.config).rejection.body;
        match (on, &body) {
            (true, _) => *body = RejectionBody::Problem,
            (false, RejectionBody::Problem) => *body = RejectionBody::Text,
            (false, _) => {}
        }
        self
    }
}

impl<St: Clone> RateLimitLayer<St> {
    /// Shadow (dry-run) mode for every rule (see [`Rule::shadow`]): requests are decided,
    /// counted and reported, and none is refused or made to wait. Admitted responses carry the
    /// `RateLimit` fields as usual (unless [`headers_on_success`](Self::headers_on_success) is
    /// off), so clients can see the limit coming.
    #[must_use]
    pub fn shadow(mut self, on: bool) -> Self {
        Arc::make_mut(&mut self.config).shadow = on;
        self
    }

    /// Requests for which `skip` returns `true` bypass every rule: no tokens, no fields, no
    /// decision reported. For health checks, metrics scrapes and trusted internal callers; it
    /// sees the request's head, so an allow-list of addresses or keys is a lookup here.
    ///
    /// ```
    /// use burstgate::{Limit, MemoryStore, RateLimitLayer};
    /// use burstgate::layer::{KeyExtractor, Rule};
    ///
    /// let layer = RateLimitLayer::new(MemoryStore::new())
    ///     .rule(Rule::new("per-ip", Limit::per_second(10)?, KeyExtractor::peer_ip())?)
    ///     .skip(|req| req.uri.path() == "/healthz");
    /// # let _ = layer;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn skip(mut self, skip: impl Fn(&Parts) -> bool + Send + Sync + 'static) -> Self {
        Arc::make_mut(&mut self.config).skip = Some(Arc::new(skip));
        self
    }

    /// Calls `hook` with each rule's decision (see [`DecisionEvent`] for which decisions are
    /// reported), on the request's task, before the response is sent: for OpenTelemetry,
    /// audit logs or metrics of your own. Keep it short; it runs on every request a rule
    /// applies to.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use burstgate::{Limit, MemoryStore, RateLimitLayer};
    /// use burstgate::layer::{KeyExtractor, Outcome, Rule};
    ///
    /// let refused = Arc::new(AtomicU64::new(0));
    /// let counter = Arc::clone(&refused);
    /// let layer = RateLimitLayer::new(MemoryStore::new())
    ///     .rule(Rule::new("global", Limit::per_second(100)?, KeyExtractor::global())?)
    ///     .on_decision(move |event| {
    ///         if event.outcome() == Outcome::Limited {
    ///             counter.fetch_add(1, Ordering::Relaxed);
    ///         }
    ///     });
    /// # let _ = layer;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn on_decision(
        mut self,
        hook: impl Fn(&DecisionEvent<'_>) + Send + Sync + 'static,
    ) -> Self {
        Arc::make_mut(&mut self.config).on_decision = Some(Arc::new(hook));
        self
    }
}

impl<S, St> Layer<S> for RateLimitLayer<St> {
    type Service = RateLimit<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit {
            inner,
            config: Arc::clone(&self.config),
        }
    }
}

impl<St> Clone for RateLimitLayer<St> {
    fn clone(&self) -> Self {
        Self {
            config: Arc::clone(&self.config),
        }
    }
}

impl<St: fmt::Debug> fmt::Debug for RateLimitLayer<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.config.fmt(f)
    }
}
