// The module docs are a file of their own, docs/middleware.md: long prose reads better there,
// and rustdoc still renders and doctests it here.
#![doc = include_str!("../../docs/middleware.md")]

mod account;
mod backoff;
mod cost;
mod follow;
mod path;
#[cfg(feature = "retry")]
mod retry;
mod route;
mod send;
mod ticket;

pub use self::account::Account;
pub use self::cost::Cost;
#[cfg(feature = "retry")]
#[cfg_attr(docsrs, doc(cfg(feature = "retry")))]
pub use self::retry::{Local429, RetryStrategy};
pub use self::route::{InvalidRoute, Route};
pub use self::ticket::{Ticket, TicketError};

use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use http::{Extensions, HeaderName};
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};

use self::send::Draw;
use crate::cancel::RefundGuard;
use crate::clock::{Clock, SystemClock};
use crate::{
    BucketKey, BucketStore, Claim, Decision, KeySecret, Limit, RateLimited, Reservation, StoreError,
};

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
pub struct RateLimitMiddleware<St, K = SystemClock> {
    store: St,
    clock: K,
    config: Arc<Config>,
    /// What the upstream has reported, shared by clones.
    seen: Arc<follow::Seen>,
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
}

impl<St: BucketStore + Clone> RateLimitMiddleware<St, SystemClock> {
    /// A middleware deciding on `store`, with no routes yet, on the system clock.
    pub fn new(store: St) -> Self {
        Self {
            store,
            clock: SystemClock,
            seen: Arc::default(),
            config: Arc::new(Config {
                routes: Vec::new(),
                default: None,
                account_header: None,
                key_secret: None,
                ticket_secret: KeySecret::random(),
                max_wait: None,
                error_cost: 1,
                max_backoff: DEFAULT_MAX_BACKOFF,
                follow: follow::Follow::default(),
                cost_header: None,
            }),
        }
    }
}

impl<St: BucketStore + Clone, K: Clock + Clone> RateLimitMiddleware<St, K> {
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
    /// and [`Account::secret`]) with `secret`: an HMAC-SHA256 (see [`BucketKey::keyed`]) instead
    /// of a plain SHA-256, which anyone who reads the store could check guesses against. Every
    /// process sharing the buckets must use the same secret.
    #[must_use]
    pub fn key_secret(mut self, secret: KeySecret) -> Self {
        let config = Arc::make_mut(&mut self.config);
        config.ticket_secret = secret.clone();
        config.key_secret = Some(secret);
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

    /// Reads the time for upstream back-offs from `clock`; use the store's clock.
    #[must_use]
    pub fn with_clock<K2: Clock + Clone>(self, clock: K2) -> RateLimitMiddleware<St, K2> {
        RateLimitMiddleware {
            store: self.store,
            clock,
            config: self.config,
            seen: self.seen,
        }
    }

    /// Books the turn of a request that a job queue sends later, instead of waiting for it here
    /// (see [`Ticket`]): the request is matched, keyed and priced as [`handle`](Middleware::handle)
    /// would, its tokens are reserved up to the ceiling, and the ticket says when it may go.
    /// `Ok(None)` when no route draws from the request: it may go at any time.
    ///
    /// ```
    /// # use std::time::{Duration, SystemTime};
    /// # use burstgate::middleware::{Account, RateLimitMiddleware, Route};
    /// # use burstgate::{Limit, MemoryStore};
    /// # use http::Extensions;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let orders = Route::new("orders", Limit::per_minute(1)?, "/orders")?;
    /// let limiter = RateLimitMiddleware::new(MemoryStore::new()).route(orders);
    /// let request = reqwest::Client::new().get("https://api.example/orders").build()?;
    /// let mut account = Extensions::new();
    /// account.insert(Account::new("seller-42"));
    ///
    /// let now = limiter.reserve(&request, &account).await?.expect("a route matches");
    /// assert_eq!(now.ready_in(SystemTime::now()), Duration::ZERO);
    /// let later = limiter.reserve(&request, &account).await?.expect("a route matches");
    /// assert!(later.ready_in(SystemTime::now()) > Duration::from_secs(59));
    /// // Kept as text in the job's payload; sent at its time with `.with_extension(ticket)`.
    /// let payload = later.to_string();
    /// # let _ = payload;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// As a request sent through the middleware: the local 429 ([`RateLimited`]) when the turn
    /// is further off than the ceiling, a [`StoreError`] when the store fails or the cost is
    /// above the burst. No ticket exists without its booking in the store
    /// ([`BucketStore::book`]): when the store does not take it, the tokens just taken are given
    /// back (as every refund: only while no turn is booked after them) and the store's error is
    /// returned. On a [`RedisStore`](crate::RedisStore) that means no ticket is booked while
    /// Redis is unreachable, whatever the outage policy.
    /// A request that more than [`MAX_TAKES`](crate::MAX_TAKES) routes match
    /// is not booked, [`StoreError::TooManyAtOnce`], before any store call: a ticket's turns
    /// are booked at one time, by one store call (send such a request instead, which takes its
    /// buckets in turn).
    pub async fn reserve(
        &self,
        req: &Request,
        extensions: &Extensions,
    ) -> reqwest_middleware::Result<Option<Ticket>> {
        let routes = self.routes_for(req);
        if routes.is_empty() {
            return Ok(None);
        }
        if routes.len() > crate::MAX_TAKES {
            // A ticket books every bucket at one time, which one store call does and calls in
            // turn cannot (see `take_in_turn`); and its text names at most that many.
            return Err(reqwest_middleware::Error::middleware(
                StoreError::TooManyAtOnce {
                    count: routes.len(),
                    max: crate::MAX_TAKES,
                },
            ));
        }
        let draws = self.draws(&routes, req, extensions);
        let max_wait = self.ceiling(&draws);
        let decisions = self.take_all(&draws, max_wait).await?;
        if !decisions.iter().all(Decision::is_admitted) {
            let limited = Self::refusal(&draws, &decisions);
            return Err(reqwest_middleware::Error::middleware(limited));
        }
        // A turn goes within the grace of every bucket it holds: the shortest.
        let grace = draws
            .iter()
            .map(|d| Self::grace(d.limit, d.cost))
            .min()
            .unwrap_or(Duration::ZERO);
        // Given back if the booking fails, or if the caller goes away before it is written.
        let mut taken = RefundGuard::new(self.store.clone());
        let mut turns = Vec::with_capacity(draws.len());
        for (d, decision) in draws.into_iter().zip(&decisions) {
            if let Some(reservation) = decision.reservation() {
                taken.push(d.key.clone(), d.limit, reservation);
                turns.push((d.key, reservation));
            }
        }
        let mut turns = turns.into_iter();
        let Some((key, reservation)) = turns.next() else {
            return Ok(None);
        };
        let ticket = Ticket::signed(
            key,
            reservation,
            turns.collect(),
            grace,
            &self.config.ticket_secret,
        );
        if let Err(e) = self.book(&ticket).await {
            taken.refund_all().await;
            return Err(reqwest_middleware::Error::middleware(e));
        }
        taken.disarm();
        Ok(Some(ticket))
    }

    /// Gives back the tokens of a [`Ticket`] whose request will never be sent (the job was
    /// dropped), through its reservations, as every refund: never above the burst, and only
    /// while no turn booked after it would move. Under the limits of the routes that draw from
    /// the ticket's buckets. A ticket is given back, or sent, once: `Ok(false)` when it was
    /// spent already, here or in another process.
    ///
    /// # Errors
    ///
    /// [`TicketError::Forged`] when the ticket is not this middleware's,
    /// [`TicketError::NoRoute`] when no route draws from one of its buckets,
    /// [`TicketError::Expired`] when the store holds no booking for it (a second past its
    /// grace, or lost by the store: see [`Ticket`]), and then nothing is given back, since the
    /// store cannot tell whether it went or gave its tokens back already; or a [`StoreError`].
    pub async fn cancel(&self, ticket: &Ticket) -> reqwest_middleware::Result<bool> {
        let config = &self.config;
        if !ticket.verify(&config.ticket_secret) {
            return Err(reqwest_middleware::Error::middleware(TicketError::Forged));
        }
        let limits = ticket
            .buckets()
            .map(|(key, _)| {
                config
                    .routes
                    .iter()
                    .chain(config.default.as_ref())
                    .find(|r| r.bucket() == key.bucket())
                    .map(|r| r.limit)
            })
            .collect::<Option<Vec<Limit>>>()
            .ok_or_else(|| reqwest_middleware::Error::middleware(TicketError::NoRoute))?;
        match self.spend(ticket).await? {
            Claim::First => {}
            Claim::Spent => return Ok(false),
            Claim::Missing => {
                return Err(reqwest_middleware::Error::middleware(TicketError::Expired));
            }
        }
        // Every bucket is asked, whatever the others answer: the ticket is spent, and a refund
        // left out now could never be made.
        let mut failed = None;
        for ((key, reservation), limit) in ticket.buckets().zip(limits) {
            if let Err(e) = self.store.refund(key, limit, *reservation).await {
                failed.get_or_insert(e);
            }
        }
        match failed {
            Some(e) => Err(reqwest_middleware::Error::middleware(e)),
            None => Ok(true),
        }
    }

    /// A ticket's grace under `limit`: one token period per token of its cost after its turn.
    fn grace(limit: Limit, cost: u32) -> Duration {
        let grace_ms =
            u128::from(limit.interval_ms()) * u128::from(cost) / u128::from(limit.tokens());
        Duration::from_millis(u64::try_from(grace_ms).unwrap_or(u64::MAX))
    }

    /// Books the ticket's one-time mark in the store, beside its first bucket. The mark is kept
    /// a second past the end of the ticket's grace, signed into it, after which the ticket is
    /// refused as expired anyway: a ticket checked just inside its grace must not meet a mark
    /// already gone, in a store that counts whole milliseconds on a clock of its own.
    async fn book(&self, ticket: &Ticket) -> Result<(), StoreError> {
        let until = crate::clock::add_or_latest(ticket.expires_at(), Duration::from_secs(1));
        self.store
            .book(&ticket.key, &ticket.nonce_hex(), until)
            .await
    }

    /// Spends the ticket's one-time mark.
    async fn spend(&self, ticket: &Ticket) -> reqwest_middleware::Result<Claim> {
        self.store
            .claim(&ticket.key, &ticket.nonce_hex())
            .await
            .map_err(reqwest_middleware::Error::middleware)
    }

    /// Sends a request that holds a [`Ticket`]: at or after its time, for the buckets and
    /// account the request draws from, and unless an upstream back-off passed one of its slots
    /// while it waited in the queue; without taking another token.
    async fn send_booked(
        &self,
        draws: &[Draw<'_>],
        ticket: Ticket,
        req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let refused = |e: TicketError| Err(reqwest_middleware::Error::middleware(e));
        if !ticket.verify(&self.config.ticket_secret) {
            return refused(TicketError::Forged);
        }
        let booked: Vec<(&BucketKey, &Reservation)> = ticket.buckets().collect();
        if booked.len() != draws.len() || draws.iter().zip(&booked).any(|(d, (k, _))| d.key != **k)
        {
            return refused(TicketError::OtherBucket);
        }
        if draws
            .iter()
            .zip(&booked)
            .any(|(d, (_, r))| r.cost() < d.cost)
        {
            return refused(TicketError::TooCostly);
        }
        let first = &draws[0];
        let now = self.clock.now();
        let early = ticket.ready_in(now);
        if !early.is_zero() {
            tracing::debug!(
                bucket = first.route.bucket(),
                key = %first.key.fingerprint(),
                early_ms = early.as_millis() as u64,
                "local 429: a booked request sent before its time"
            );
            let limited = RateLimited::new(early, first.limit, first.route.bucket(), 0);
            return Err(reqwest_middleware::Error::middleware(limited));
        }
        if now > ticket.expires_at() {
            return refused(TicketError::Expired);
        }
        for (d, (_, reservation)) in draws.iter().zip(&booked) {
            if let Some(retry) = self.halted_for(&d.key, d.limit, reservation).await {
                tracing::debug!(
                    bucket = d.route.bucket(),
                    key = %d.key.fingerprint(),
                    "local 429: an upstream back-off passed a booked slot"
                );
                let limited = RateLimited::new(retry, d.limit, d.route.bucket(), 0);
                return Err(reqwest_middleware::Error::middleware(limited));
            }
        }
        match self.spend(&ticket).await? {
            Claim::First => {}
            Claim::Spent => return refused(TicketError::Spent),
            // The store lost the booking (or kept it a second past the grace, on a clock ahead
            // of this one): whether it went is unknown, and it must not go twice.
            Claim::Missing => return refused(TicketError::Expired),
        }
        let taken: Vec<Reservation> = booked.iter().map(|(_, r)| **r).collect();
        let sent_at = tokio::time::Instant::now();
        let res = next.run(req, extensions).await?;
        // When the turn was booked, and so whether the bucket was spent, is not known here: the
        // answer proves no margin, and lowers nothing.
        self.after_several(draws, &taken, &res, 0, false, sent_at.elapsed())
            .await;
        Ok(res)
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
        let routes = self.routes_for(&req);
        if routes.is_empty() {
            return next.run(req, extensions).await;
        }
        self.send_drawing(&routes, req, extensions, next).await
    }
}

impl<St: Clone, K: Clone> Clone for RateLimitMiddleware<St, K> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            clock: self.clock.clone(),
            config: Arc::clone(&self.config),
            seen: Arc::clone(&self.seen),
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

#[cfg(test)]
mod tests;
