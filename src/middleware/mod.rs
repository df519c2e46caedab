// The module docs are a file of their own, docs/middleware.md: long prose reads better there,
// and rustdoc still renders and doctests it here.
#![doc = include_str!("../../docs/middleware.md")]

// Here: the middleware's type, its settings and builders, and the `Middleware` impl. A request
// goes through `send.rs` (its routes, their takes at once, the wait, the send) and the answer
// through `backoff.rs` (back-offs, lowering, costs owed or refunded), which reads `follow.rs`
// (the tokens the upstream reports left), `retry_after.rs` (how long it asks to wait) and
// `cost.rs` (what it says a call cost). Tickets: the type, its text and its signature in
// `ticket.rs`, booking, cancelling and sending one in `booking.rs`. Which request matches which
// route: `route.rs` and `path.rs`; whose budget it spends: `account.rs`.

mod account;
mod backoff;
mod booking;
mod cost;
mod follow;
#[cfg(test)]
mod fuzz;
mod observe;
#[cfg(feature = "retry")]
mod retry;
mod retry_after;
mod route;
mod send;
mod ticket;

pub use self::account::Account;
pub use self::cost::Cost;
pub use self::observe::{DecisionEvent, RequestOutcome};
#[cfg(feature = "retry")]
#[cfg_attr(docsrs, doc(cfg(feature = "retry")))]
pub use self::retry::{Local429, RetryStrategy};
pub use self::route::{InvalidRoute, Route};
pub use self::ticket::{Ticket, TicketError};

use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::{Extensions, HeaderName};
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};

use crate::cancel::Abandoned;
use crate::clock::Clock;
use crate::{BucketStore, KeySecret, RateLimited};

/// The local 429 in an error the client returned: the [`RateLimited`] this middleware returns
/// instead of sending a request its budget does not allow, if that is what `err` is.
///
/// ```
/// # async fn send(client: reqwest_middleware::ClientWithMiddleware) {
/// match client.get("https://api.example/orders").send().await {
///     Ok(res) => println!("{}", res.status()),
///     Err(e) => match burstgate::middleware::rate_limited(&e) {
///         Some(limited) => println!("not sent; try again in {:?}", limited.retry_after()),
///         None => println!("failed: {e}"),
///     },
/// }
/// # }
/// ```
///
/// With the `retry` feature it also looks inside the `RetryError` that reqwest-retry wraps the
/// last attempt's error in.
pub fn rate_limited(err: &reqwest_middleware::Error) -> Option<&RateLimited> {
    let reqwest_middleware::Error::Middleware(e) = err else {
        return None;
    };
    #[cfg(feature = "retry")]
    if let Some(retried) = e.downcast_ref::<reqwest_retry::RetryError>() {
        return match retried {
            reqwest_retry::RetryError::WithRetries { err, .. }
            | reqwest_retry::RetryError::Error(err) => rate_limited(err),
        };
    }
    e.downcast_ref::<RateLimited>()
}

/// The longest an upstream 429 may make every worker back off, unless set otherwise.
const DEFAULT_MAX_BACKOFF: Duration = Duration::from_secs(600);

/// A `reqwest_middleware` middleware that spends a shared budget before each request, waits its
/// turn, and never sends a request the budget does not allow.
///
/// How to set it up, what it does with each request, and how to get the local 429 back: the
/// [module docs](crate::middleware).
pub struct RateLimitMiddleware<St, K = StoreTime> {
    store: St,
    clock: K,
    config: Arc<Config>,
    /// What the upstream has reported, shared by clones.
    seen: Arc<follow::Seen>,
    /// Reservations of requests dropped while they waited, on their way back; shared by clones.
    abandoned: Abandoned,
}

#[derive(Debug, Clone)]
struct Config {
    routes: Vec<Route>,
    default: Option<Route>,
    account_header: Option<HeaderName>,
    key_secret: Option<KeySecret>,
    /// Signs and checks tickets, under a key derived from it: the key secret, or one drawn at
    /// random without it.
    ticket_secret: KeySecret,
    max_wait: Option<Duration>,
    error_cost: u32,
    max_backoff: Duration,
    follow: follow::Follow,
    cost_header: Option<HeaderName>,
    /// The `on_decision` hook, and each route's log gate and metric handles.
    observe: observe::Observe,
}

impl<St: BucketStore + Clone> RateLimitMiddleware<St, StoreTime> {
    /// A middleware deciding on `store`, with no routes yet, counting its store's time
    /// ([`BucketStore::now`]): the back-offs it writes and the tickets it judges are on the same
    /// time as the buckets, which on a `RedisStore` is by default Redis's, not this
    /// host's.
    pub fn new(store: St) -> Self {
        Self {
            store,
            clock: StoreTime,
            seen: Arc::default(),
            abandoned: Abandoned::default(),
            config: Arc::new(Config {
                routes: Vec::new(),
                default: None,
                account_header: None,
                key_secret: None,
                ticket_secret: ticket::random_secret(),
                max_wait: None,
                error_cost: 1,
                max_backoff: DEFAULT_MAX_BACKOFF,
                follow: follow::Follow::default(),
                cost_header: None,
                observe: observe::Observe::default(),
            }),
        }
    }
}

impl<St: BucketStore + Clone, K: Time<St>> RateLimitMiddleware<St, K> {
    /// Adds a route. Every route that matches a request applies, all taken at once, but for two
    /// of one bucket: the first of those that matches applies (so a `/batch` route that costs
    /// 10, added before a `/**` route of the same bucket, makes a batch cost 10 there). The
    /// order also says which route follows what the upstream reports (the first): see the
    /// module docs' "Several limits on one request".
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
    /// and [`Account::secret`]) with `secret`: an HMAC-SHA256 (see
    /// [`BucketKey::keyed`](crate::BucketKey::keyed)) instead of a plain SHA-256, which anyone
    /// who reads the store could check guesses against. Every process sharing the buckets must
    /// use the same secret. Unless another secret keys them already, it also keys the process's
    /// key fingerprints ([`KeySecret::key_fingerprints`]), so that they match across processes.
    #[must_use]
    pub fn key_secret(mut self, secret: KeySecret) -> Self {
        secret.offer_for_fingerprints();
        let config = Arc::make_mut(&mut self.config);
        config.ticket_secret = secret.clone();
        config.key_secret = Some(secret);
        self
    }

    /// The longest a request may wait for its turn before it fails with the local 429. By
    /// default two token periods per token of cost of the route's limit, for requests someone
    /// waits for. A batch job sets how long its requests may wait, and then every one of them
    /// goes, in the order they asked, at the limit: see the module docs' "Batches". Dropped
    /// while it waits, a request gives its tokens back.
    #[must_use]
    pub fn max_wait(mut self, max_wait: Duration) -> Self {
        Arc::make_mut(&mut self.config).max_wait = Some(max_wait);
        self
    }

    /// What a `4xx` answer (other than 429) costs in all, in tokens, when the upstream counts
    /// errors against the budget (a seller API may count one as 10 requests). What it costs
    /// above the request's own cost is taken after the answer arrives, as debt that later
    /// requests wait off. Default 1. An answer whose [`cost_header`](Self::cost_header) says
    /// what it cost is settled by that instead.
    #[must_use]
    pub fn error_cost(mut self, tokens: NonZeroU32) -> Self {
        Arc::make_mut(&mut self.config).error_cost = tokens.get();
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

    /// Reads what a call cost from this field of the upstream's answer (a count of tokens, such
    /// as `X-Request-Cost`), and settles the difference with what the request took: more is
    /// taken after the answer as debt that later requests wait off, less is given back through
    /// the request's reservation (never above the burst, and only while nothing is queued
    /// behind it, as every refund). A value that is not a count is ignored.
    #[must_use]
    pub fn cost_header(mut self, name: HeaderName) -> Self {
        Arc::make_mut(&mut self.config).cost_header = Some(name);
        self
    }

    /// Whether the shared bucket follows what the upstream reports it has left (default: yes).
    ///
    /// On an answer that reports fewer tokens left than the bucket held once the request took
    /// its own, the bucket is lowered to that, in one store call ([`BucketStore::lower_to`]),
    /// so every worker in every process slows down when someone else spends the same budget
    /// (the account's other integrations, a second service with the same token) or Redis forgot
    /// what was spent. It is never raised. Requests that went at a reserved slot hold a bucket
    /// spent to its pace, which no count can lower; for them, a report of nothing left from an
    /// upstream that has shown a margin over the bucket drains it for one token period (the
    /// module docs, "Following the upstream", say when and why).
    ///
    /// The fields read are `X-Ratelimit-Remaining`, `RateLimit-Remaining` and the `r` of the
    /// IETF `RateLimit` field, with any set with [`remaining_header`](Self::remaining_header)
    /// first; the fewest any of them reports counts. A report at or above what the bucket held
    /// needs no store call.
    #[must_use]
    pub fn follow_upstream(mut self, on: bool) -> Self {
        Arc::make_mut(&mut self.config).follow.on = on;
        self
    }

    /// Also reads the tokens left from `name`, a vendor's own field holding a count (such as
    /// `X-Seller-Quota-Left`), before the standard ones. See
    /// [`follow_upstream`](Self::follow_upstream).
    #[must_use]
    pub fn remaining_header(mut self, name: HeaderName) -> Self {
        let names = &mut Arc::make_mut(&mut self.config).follow.names;
        if !names.contains(&name) {
            names.insert(0, name);
        }
        self
    }

    /// Calls `hook` with each route's decision on each request (see [`DecisionEvent`] for which
    /// are reported), on the request's task: for OpenTelemetry, audit logs or metrics of your
    /// own. Keep it short; it runs on every request a route applies to.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use burstgate::{Limit, MemoryStore};
    /// use burstgate::middleware::{RateLimitMiddleware, RequestOutcome, Route};
    ///
    /// let refused = Arc::new(AtomicU64::new(0));
    /// let counter = Arc::clone(&refused);
    /// let middleware = RateLimitMiddleware::new(MemoryStore::new())
    ///     .route(Route::new("orders", Limit::per_second(10)?, "/orders")?)
    ///     .on_decision(move |event| {
    ///         if event.outcome() == RequestOutcome::Upstream429 {
    ///             counter.fetch_add(1, Ordering::Relaxed);
    ///         }
    ///     });
    /// # let _ = middleware;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use]
    pub fn on_decision(
        mut self,
        hook: impl Fn(&DecisionEvent<'_>) + Send + Sync + 'static,
    ) -> Self {
        Arc::make_mut(&mut self.config).observe.hook = Some(Arc::new(hook));
        self
    }

    /// Reads the time for upstream back-offs and tickets from `clock` instead of the store's
    /// ([`BucketStore::now`], the default). A clock other than the one the store counts makes
    /// back-offs end early or late and tickets expire early or late by the difference: use it
    /// for a store whose own [`now`](BucketStore::now) is not its time (one that keeps the
    /// trait's default, the system clock, while it decides on another).
    #[must_use]
    pub fn with_clock<K2: Clock + Clone>(self, clock: K2) -> RateLimitMiddleware<St, K2> {
        RateLimitMiddleware {
            store: self.store,
            clock,
            config: self.config,
            seen: self.seen,
            abandoned: self.abandoned,
        }
    }
}

/// The middleware's time by default: its store's, [`BucketStore::now`]. Another clock replaces
/// it with [`RateLimitMiddleware::with_clock`].
#[derive(Debug, Clone, Copy, Default)]
pub struct StoreTime;

mod time {
    use std::time::SystemTime;

    use super::StoreTime;
    use crate::BucketStore;
    use crate::clock::Clock;

    /// Where a middleware reads the time: its store's ([`StoreTime`]) or a clock of its own.
    /// Sealed: the two are all there is.
    pub trait Time<St>: Clone + Send + Sync + 'static {
        fn now(&self, store: &St) -> SystemTime;
    }

    impl<St: BucketStore> Time<St> for StoreTime {
        fn now(&self, store: &St) -> SystemTime {
            store.now()
        }
    }

    impl<St, K: Clock + Clone> Time<St> for K {
        fn now(&self, _: &St) -> SystemTime {
            Clock::now(self)
        }
    }
}
use time::Time;

impl<St: BucketStore + Clone, K: Time<St>> RateLimitMiddleware<St, K> {
    /// The time back-offs and tickets are judged on.
    fn now(&self) -> SystemTime {
        self.clock.now(&self.store)
    }
}

#[async_trait::async_trait]
impl<St, K> Middleware for RateLimitMiddleware<St, K>
where
    St: BucketStore + Clone,
    K: Time<St>,
{
    async fn handle(
        &self,
        req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let routes = self.routes_for(&req);
        if routes.is_empty() {
            return next.run(req, extensions).await;
        }
        self.send(&routes, req, extensions, next).await
    }
}

impl<St: Clone, K: Clone> Clone for RateLimitMiddleware<St, K> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            clock: self.clock.clone(),
            config: Arc::clone(&self.config),
            seen: Arc::clone(&self.seen),
            abandoned: self.abandoned.clone(),
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
            .field("follow_upstream", &self.config.follow)
            .field("cost_header", &self.config.cost_header)
            .finish()
    }
}
