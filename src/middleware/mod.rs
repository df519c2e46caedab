//! The client side: [`RateLimitMiddleware`] for `reqwest_middleware`.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{Extensions, HeaderMap, HeaderName, Method, StatusCode};
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};

use crate::cancel::{RefundGuard, acquire_detached};
use crate::clock::{Clock, SystemClock};
use crate::key::is_name;
use crate::{
    BucketKey, BucketStore, Decision, InvalidKey, KeySecret, Limit, RateLimited, Reservation,
    StoreError,
};

/// The longest an upstream 429 may make every worker back off, unless set otherwise.
const DEFAULT_MAX_BACKOFF: Duration = Duration::from_secs(600);

/// A `reqwest_middleware` middleware that spends a shared budget before each request, waits its
/// turn, and never sends a request the budget does not allow.
///
/// ```
/// use std::time::Duration;
/// use burstgate::{Limit, MemoryStore};
/// use burstgate::middleware::{Account, RateLimitMiddleware, Route};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let orders = Limit::per_minute(1)?.with_burst(10)?;
/// let middleware = RateLimitMiddleware::new(MemoryStore::new())
///     .route(Route::new("orders", orders, "/api/v1/supplier/orders")?)
///     .account_header(http::header::AUTHORIZATION);
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(middleware)
///     .build();
/// # let _ = client;
/// # Ok(())
/// # }
/// ```
///
/// # What it does per request
///
/// 1. Finds the first [`Route`] that matches the request (method, host, path pattern). A request
///    no route matches passes through, or draws from the [`default_route`](Self::default_route)
///    when one is set.
/// 2. Finds the account that owns the budget: an [`Account`] extension on the request
///    (`RequestBuilder::with_extension`), else the [`account_header`](Self::account_header)'s
///    value, hashed. With neither (or with an empty one), the route's single shared bucket
///    (key `-`) is used.
/// 3. Reserves one token (see [`BucketStore::acquire`]) with a ceiling of
///    [`max_wait`](Self::max_wait), by default two token periods
///    ([`Limit::default_max_wait`]): two minutes for "1 per minute". Within the ceiling it sleeps
///    (a tokio timer) until its turn, in arrival order with every other worker sharing the
///    bucket, and sends. Beyond it, the request is not sent: the middleware returns a
///    [`RateLimited`] error, the "local 429". Dropping the request future while it waits gives
///    the reservation back, and so does dropping it while the store answers: the store call
///    runs on a task of its own, which refunds an admission nobody is left to receive (the tower
///    layer leaves those tokens spent instead; both follow the rule in
///    `docs/DESIGN.md#cancellation`).
///
///    A request that waited asks the store once more, at its turn, whether an upstream 429
///    drained the bucket past its slot meanwhile ([`Quota::halts`](crate::Quota::halts), from
///    [`BucketStore::peek`]), in this process or any other. If so it does not send: it
///    reserves again, behind the back-off, with what is left of its ceiling, or fails with the
///    local 429 past it. That costs one more store call per request that waited, and none for
///    a request sent at once. If that call fails, the request is sent, with a warning.
/// 4. Reads the answer. A `429` from the upstream drains the shared bucket until the time the
///    upstream gave (`X-Ratelimit-Retry`, else `Retry-After`, in seconds or as an HTTP date), so
///    that every worker in every process backs off, not only the one that was told, and requests
///    already waiting for their turns wait past it (step 3); without such
///    a header, for one token period. The bucket is drained so that its next token is ready at
///    the time the upstream gave; it never holds less than one token period, so a shorter
///    `Retry-After` still waits one period. A malformed value is ignored and an absurd one clamped to
///    [`max_backoff`](Self::max_backoff), each with a warning. Other `4xx` answers can be made to
///    cost more ([`error_cost`](Self::error_cost)). The response itself is returned unchanged.
///
/// # Getting the local 429 back
///
/// It is a `reqwest_middleware::Error::Middleware` holding a [`RateLimited`]:
///
/// ```
/// # use burstgate::RateLimited;
/// fn retry_after(err: &reqwest_middleware::Error) -> Option<std::time::Duration> {
///     match err {
///         reqwest_middleware::Error::Middleware(e) => {
///             e.downcast_ref::<RateLimited>().map(RateLimited::retry_after)
///         }
///         _ => None,
///     }
/// }
/// ```
///
/// A store failure is a `Middleware` error holding the [`StoreError`].
///
/// # With retries
///
/// Put a retry middleware (reqwest-retry's `RetryTransientMiddleware`) *before* this one in the
/// `ClientBuilder`, so that each retry passes through the limiter again and spends its own
/// token; the upstream 429 this middleware has already fed back to the bucket then makes the
/// retry wait its turn instead of hammering the API.
pub struct RateLimitMiddleware<St, K = SystemClock> {
    store: St,
    clock: K,
    config: Arc<Config>,
}

#[derive(Debug, Clone)]
struct Config {
    routes: Vec<Route>,
    default: Option<Route>,
    account_header: Option<HeaderName>,
    key_secret: Option<KeySecret>,
    max_wait: Option<Duration>,
    error_cost: u32,
    max_backoff: Duration,
}

impl<St: BucketStore + Clone> RateLimitMiddleware<St, SystemClock> {
    /// A middleware deciding on `store`, with no routes yet, on the system clock.
    pub fn new(store: St) -> Self {
        Self {
            store,
            clock: SystemClock,
            config: Arc::new(Config {
                routes: Vec::new(),
                default: None,
                account_header: None,
                key_secret: None,
                max_wait: None,
                error_cost: 1,
                max_backoff: DEFAULT_MAX_BACKOFF,
            }),
        }
    }
}

impl<St: BucketStore + Clone, K: Clock + Clone> RateLimitMiddleware<St, K> {
    /// Adds a route. Routes are tried in the order they were added; the first match wins.
    #[must_use]
    pub fn route(mut self, route: Route) -> Self {
        Arc::make_mut(&mut self.config).routes.push(route);
        self
    }

    /// Adds several routes at once.
    #[must_use]
    pub fn routes(mut self, routes: impl IntoIterator<Item = Route>) -> Self {
        Arc::make_mut(&mut self.config).routes.extend(routes);
        self
    }

    /// The route for requests no other route matches (its path pattern is not used). Without
    /// one, such requests pass through unlimited.
    #[must_use]
    pub fn default_route(mut self, route: Route) -> Self {
        Arc::make_mut(&mut self.config).default = Some(route);
        self
    }

    /// Takes the account from this header (such as `Authorization`) when the request has no
    /// [`Account`] extension. The value is hashed before it becomes part of a key, and never
    /// stored or logged in clear; set a [`key_secret`](Self::key_secret) too, or a reader of the
    /// store can test guessed tokens against the hash.
    #[must_use]
    pub fn account_header(mut self, name: HeaderName) -> Self {
        Arc::make_mut(&mut self.config).account_header = Some(name);
        self
    }

    /// Keys the hashes of secret accounts (the [`account_header`](Self::account_header)'s value
    /// and [`Account::secret`]) with `secret`: an HMAC-SHA256 (see [`BucketKey::keyed`]) instead
    /// of a plain SHA-256, which anyone who reads the store could check guesses against. Every
    /// process sharing the buckets must use the same secret.
    #[must_use]
    pub fn key_secret(mut self, secret: KeySecret) -> Self {
        Arc::make_mut(&mut self.config).key_secret = Some(secret);
        self
    }

    /// The longest a request may wait for its turn before it fails with the local 429. By
    /// default two token periods of the route's limit.
    #[must_use]
    pub fn max_wait(mut self, max_wait: Duration) -> Self {
        Arc::make_mut(&mut self.config).max_wait = Some(max_wait);
        self
    }

    /// What a `4xx` answer (other than 429) costs in all, in tokens, when the upstream counts
    /// errors against the budget (a seller API may count one as 10 requests). The extra tokens
    /// are taken after the answer arrives, as debt that later requests wait off. Default 1.
    #[must_use]
    pub fn error_cost(mut self, tokens: u32) -> Self {
        Arc::make_mut(&mut self.config).error_cost = tokens.max(1);
        self
    }

    /// The longest an upstream 429 may drain the bucket for (default ten minutes): a larger
    /// `Retry-After` is clamped to it, with a warning. Any value is accepted; a drain never
    /// reaches past the latest time the arithmetic works with (2^53 − 1 ms after 1970).
    #[must_use]
    pub fn max_backoff(mut self, max_backoff: Duration) -> Self {
        Arc::make_mut(&mut self.config).max_backoff = max_backoff;
        self
    }

    /// Reads the time for upstream back-offs from `clock`; use the store's clock.
    #[must_use]
    pub fn with_clock<K2: Clock + Clone>(self, clock: K2) -> RateLimitMiddleware<St, K2> {
        RateLimitMiddleware {
            store: self.store,
            clock,
            config: self.config,
        }
    }

    fn route_for(&self, req: &Request) -> Option<&Route> {
        let config = &self.config;
        config
            .routes
            .iter()
            .find(|r| r.matches_url(req.method(), req.url()))
            .or(config.default.as_ref())
    }

    fn key(&self, route: &Route, req: &Request, extensions: &Extensions) -> BucketKey {
        let bucket = &route.bucket;
        // An empty account or header value names nobody: it falls through to the next source.
        let key = extensions
            .get::<Account>()
            .and_then(|account| account.key(bucket, self.config.key_secret.as_ref()))
            .or_else(|| {
                self.config
                    .account_header
                    .as_ref()
                    .and_then(|name| req.headers().get(name))
                    .and_then(|v| secret_key(bucket, v.as_bytes(), self.config.key_secret.as_ref()))
            });
        // The bucket name was checked when the route was made, and "-" is a valid key.
        key.or_else(|| BucketKey::new(bucket, "-").ok())
            .unwrap_or_else(|| unreachable!("a checked bucket name with key \"-\" is valid"))
    }

    /// Takes the request's token on a task of its own (the cancellation rule, `crate::cancel`).
    async fn reserve(
        &self,
        key: &BucketKey,
        limit: Limit,
        max_wait: Duration,
    ) -> Result<Decision, StoreError> {
        acquire_detached(&self.store, key, limit, 1, max_wait).await
    }

    /// Whether a drain made while `reservation` waited ends past its slot (see
    /// [`Quota::halts`](crate::Quota::halts)): one more store call, made only by requests that
    /// waited. A store that cannot answer lets the request go, as it would have before the
    /// check: the reservation was granted.
    async fn halted(&self, key: &BucketKey, limit: Limit, reservation: &Reservation) -> bool {
        match self.store.peek(key, limit).await {
            Ok(quota) => quota.halts(reservation),
            Err(e) => {
                tracing::warn!(
                    bucket = key.bucket(),
                    key = %key.fingerprint(),
                    error = %e,
                    "could not check for an upstream back-off before sending; sending"
                );
                false
            }
        }
    }

    /// Feeds the upstream's answer back into the shared bucket.
    async fn feedback(&self, key: &BucketKey, limit: Limit, res: &Response) {
        let status = res.status();
        if status == StatusCode::TOO_MANY_REQUESTS {
            let told = upstream_retry(res.headers(), self.clock.now());
            let retry = match told {
                Some(retry) if retry > self.config.max_backoff => {
                    tracing::warn!(
                        bucket = key.bucket(),
                        retry_s = retry.as_secs(),
                        max_s = self.config.max_backoff.as_secs(),
                        "upstream asked for a longer back-off than allowed; clamped"
                    );
                    self.config.max_backoff
                }
                Some(retry) => retry,
                None => token_period(limit),
            };
            // The bucket is empty at the deadline and refills from there, so drain until one
            // token period before the time the upstream gave: the first token is then ready at
            // that time, not a period later.
            // Past what `SystemTime` holds (a `max_backoff` of `Duration::MAX` and a huge
            // header), the latest time the arithmetic knows: the store clamps to it anyway.
            let until = self
                .clock
                .now()
                .checked_add(retry)
                .unwrap_or(UNIX_EPOCH + Duration::from_millis(crate::bucket::MAX_TIME));
            let until = until.checked_sub(token_period(limit)).unwrap_or(until);
            tracing::debug!(
                bucket = key.bucket(),
                key = %key.fingerprint(),
                retry_ms = retry.as_millis() as u64,
                "upstream 429: draining the shared bucket"
            );
            if let Err(e) = self.store.drain_until(key, limit, until).await {
                tracing::warn!(bucket = key.bucket(), error = %e, "could not drain after a 429");
            }
        } else if status.is_client_error() && self.config.error_cost > 1 {
            let mut extra = self.config.error_cost - 1;
            while extra > 0 {
                let take = extra.min(limit.burst());
                // A reservation with no ceiling: the tokens are owed, and later requests wait
                // them off.
                let owed = self.store.acquire(key, limit, take, Duration::MAX).await;
                if let Err(e) = owed {
                    tracing::warn!(bucket = key.bucket(), error = %e, "could not charge a 4xx");
                    break;
                }
                extra -= take;
            }
        }
    }
}

/// The time of one token: `interval / tokens`, rounded down to whole milliseconds.
fn token_period(limit: Limit) -> Duration {
    Duration::from_millis(limit.interval_ms() / u64::from(limit.tokens()))
}

/// Reads how long the upstream asked to wait: `X-Ratelimit-Retry` first, then `Retry-After`.
/// A value that does not parse is ignored, with a warning.
fn upstream_retry(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    for name in ["x-ratelimit-retry", "retry-after"] {
        let Some(value) = headers.get(name) else {
            continue;
        };
        match value
            .to_str()
            .map_err(|_| RetryValue::NotText)
            .and_then(|v| parse_retry(v, now))
        {
            Ok(retry) => return Some(retry),
            Err(why) => tracing::warn!(header = name, %why, "ignoring an unusable back-off header"),
        }
    }
    None
}

/// Why a back-off header was ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RetryValue {
    NotText,
    Negative,
    Garbage,
}

impl fmt::Display for RetryValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NotText => "the value is not text",
            Self::Negative => "a negative delay",
            Self::Garbage => "neither seconds nor an http date",
        })
    }
}

/// Parses delay-seconds (whole, or decimal as some APIs send, rounded up) or an HTTP date. A
/// date in the past is a zero delay; a huge number saturates (the caller clamps it).
pub(crate) fn parse_retry(value: &str, now: SystemTime) -> Result<Duration, RetryValue> {
    let value = value.trim();
    if value.starts_with('-') {
        return Err(RetryValue::Negative);
    }
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        return Ok(Duration::from_secs(
            value.parse::<u64>().unwrap_or(u64::MAX),
        ));
    }
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return match value.parse::<f64>() {
            Ok(secs) if secs.is_finite() => {
                Ok(Duration::try_from_secs_f64(secs.ceil()).unwrap_or(Duration::MAX))
            }
            _ => Err(RetryValue::Garbage),
        };
    }
    match httpdate::parse_http_date(value) {
        Ok(at) => Ok(at.duration_since(now).unwrap_or(Duration::ZERO)),
        Err(_) => Err(RetryValue::Garbage),
    }
}

#[async_trait::async_trait]
impl<St, K> Middleware for RateLimitMiddleware<St, K>
where
    St: BucketStore + Clone,
    K: Clock + Clone,
{
    async fn handle(
        &self,
        req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let Some(route) = self.route_for(&req) else {
            return next.run(req, extensions).await;
        };
        let (limit, bucket) = (route.limit, Arc::clone(&route.bucket));
        let key = self.key(route, &req, extensions);
        let max_wait = self
            .config
            .max_wait
            .unwrap_or_else(|| limit.default_max_wait(1));
        let started = tokio::time::Instant::now();
        let mut ceiling = max_wait;
        loop {
            let decision = self
                .reserve(&key, limit, ceiling)
                .await
                .map_err(reqwest_middleware::Error::middleware)?;
            if !decision.is_admitted() {
                let retry = decision.retry_after().unwrap_or(Duration::ZERO);
                tracing::debug!(
                    bucket = &*bucket,
                    key = %key.fingerprint(),
                    retry_ms = retry.as_millis() as u64,
                    "local 429: the wait would pass the ceiling"
                );
                let limited = RateLimited::new(retry, limit, &bucket, decision.remaining());
                return Err(reqwest_middleware::Error::middleware(limited));
            }
            // Admitted now: any drain is already in the bucket it was admitted from.
            let Some(reservation) = decision
                .reservation()
                .filter(|_| !decision.wait().is_zero())
            else {
                break;
            };
            let mut guard = RefundGuard::new(self.store.clone());
            guard.push(key.clone(), limit, reservation);
            tracing::debug!(
                bucket = &*bucket,
                key = %key.fingerprint(),
                wait_ms = decision.wait().as_millis() as u64,
                "waiting for a reserved token"
            );
            tokio::time::sleep(decision.wait()).await;
            guard.disarm();
            if !self.halted(&key, limit, &reservation).await {
                break;
            }
            // Queued again behind the back-off, within what is left of the ceiling; the first
            // reservation's tokens stay spent.
            ceiling = max_wait.saturating_sub(started.elapsed());
            tracing::debug!(
                bucket = &*bucket,
                key = %key.fingerprint(),
                ceiling_ms = ceiling.as_millis() as u64,
                "an upstream back-off passed the reserved slot: queuing again"
            );
        }
        let res = next.run(req, extensions).await?;
        self.feedback(&key, limit, &res).await;
        Ok(res)
    }
}

impl<St: Clone, K: Clone> Clone for RateLimitMiddleware<St, K> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            clock: self.clock.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<St: fmt::Debug, K: fmt::Debug> fmt::Debug for RateLimitMiddleware<St, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitMiddleware")
            .field("store", &self.store)
            .field("clock", &self.clock)
            .field("routes", &self.config.routes)
            .field("default_route", &self.config.default)
            .field("account_header", &self.config.account_header)
            .field("key_secret", &self.config.key_secret)
            .field("max_wait", &self.config.max_wait)
            .field("error_cost", &self.config.error_cost)
            .field("max_backoff", &self.config.max_backoff)
            .finish()
    }
}

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
#[derive(Debug, Clone)]
pub struct Route {
    bucket: Arc<str>,
    limit: Limit,
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
    pub fn new(bucket: &str, limit: Limit, path: &str) -> Result<Self, InvalidKey> {
        if !is_name(bucket) {
            return Err(InvalidKey::BucketName);
        }
        if !path.starts_with('/') {
            return Err(InvalidKey::EmptyKey);
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
            bucket: Arc::from(bucket),
            limit,
            method: None,
            host: None,
            path,
        })
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

    /// The bucket name.
    pub fn bucket(&self) -> &str {
        &self.bucket
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

    fn matches_path(&self, path: &str) -> bool {
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

/// The account that owns a request's budget, as a request extension:
/// `client.get(url).with_extension(Account::new("seller-42"))`.
#[derive(Clone, PartialEq, Eq)]
pub struct Account {
    id: Arc<str>,
    secret: bool,
}

impl Account {
    /// An account named by an identifier that may appear in store keys (it is escaped).
    pub fn new(id: &str) -> Self {
        Self {
            id: Arc::from(id),
            secret: false,
        }
    }

    /// An account named by a secret, such as its API token: hashed before it becomes part of a
    /// key (keyed with the middleware's [`key_secret`](RateLimitMiddleware::key_secret) when it
    /// has one), never stored or logged in clear.
    pub fn secret(token: &str) -> Self {
        Self {
            id: Arc::from(token),
            secret: true,
        }
    }

    fn key(&self, bucket: &str, key_secret: Option<&KeySecret>) -> Option<BucketKey> {
        if self.secret {
            secret_key(bucket, self.id.as_bytes(), key_secret)
        } else {
            BucketKey::new(bucket, self.id.as_bytes()).ok()
        }
    }
}

/// The key of a secret account: keyed when the application gave a secret.
fn secret_key(bucket: &str, value: &[u8], secret: Option<&KeySecret>) -> Option<BucketKey> {
    match secret {
        Some(secret) => BucketKey::keyed(bucket, value, secret).ok(),
        None => BucketKey::hashed(bucket, value).ok(),
    }
}

impl fmt::Debug for Account {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.secret {
            f.write_str("Account(<secret>)")
        } else {
            f.debug_tuple("Account").field(&self.id).finish()
        }
    }
}

mod path;

#[cfg(test)]
mod tests;
