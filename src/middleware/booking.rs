//! Booking a turn for a request that a job queue sends later, and keeping to it: `reserve`
//! takes the request's tokens and books the signed [`Ticket`] in the store, `cancel` gives a
//! ticket's tokens back, and a request that holds one is sent on its turn, once, without taking
//! another token (`send_booked`). The ticket itself, its text and its signature, is in
//! `ticket.rs`.

use std::time::Duration;

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::Next;

use super::observe::TicketEvent;
use super::send::RouteTake;
use super::{RateLimitMiddleware, Ticket, TicketError, Time};
use crate::cancel::RefundGuard;
use crate::{BucketKey, BucketStore, Claim, Decision, Limit, RateLimited, Reservation, StoreError};

impl<St: BucketStore + Clone, K: Time<St>> RateLimitMiddleware<St, K> {
    /// Books the turn of a request that a job queue sends later, instead of waiting for it here
    /// (see [`Ticket`]): the request is matched, keyed and priced as
    /// [`handle`](reqwest_middleware::Middleware::handle) would, its tokens are reserved up to the
    /// ceiling, and the ticket says when it may go.
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
            // turn cannot (see `acquire_in_turn`); and its text names at most that many.
            return Err(reqwest_middleware::Error::middleware(
                StoreError::TooManyAtOnce {
                    count: routes.len(),
                    max: crate::MAX_TAKES,
                },
            ));
        }
        let takes = self.takes(&routes, req, extensions);
        let max_wait = self.ceiling(&takes);
        let decisions = self.acquire_all(&takes, max_wait).await?;
        if !decisions.iter().all(Decision::is_admitted) {
            let limited = Self::refusal(&takes, &decisions);
            return Err(reqwest_middleware::Error::middleware(limited));
        }
        // A turn goes within the grace of every bucket it holds: the shortest.
        let grace = takes
            .iter()
            .map(|t| Self::grace(t.limit, t.cost))
            .min()
            .unwrap_or(Duration::ZERO);
        // Given back if the booking fails, or if the caller goes away before it is written.
        let mut taken = RefundGuard::new(self.store.clone(), &self.abandoned);
        let mut turns = Vec::with_capacity(takes.len());
        for (t, decision) in takes.into_iter().zip(&decisions) {
            if let Some(reservation) = decision.reservation() {
                taken.push(t.key.clone(), t.limit, reservation);
                turns.push((t.key, reservation));
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
        self.observe_ticket(&ticket, TicketEvent::Booked);
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
                    .map(|r| r.bucket_limit)
            })
            .collect::<Option<Vec<Limit>>>()
            .ok_or_else(|| reqwest_middleware::Error::middleware(TicketError::NoRoute))?;
        match self.claim(ticket).await? {
            Claim::First => {}
            Claim::Spent => return Ok(false),
            Claim::Missing => {
                self.observe_ticket(ticket, TicketEvent::Expired);
                return Err(reqwest_middleware::Error::middleware(TicketError::Expired));
            }
        }
        self.observe_ticket(ticket, TicketEvent::Cancelled);
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

    /// Counts what happened to `ticket` on each of its routes.
    fn observe_ticket(&self, ticket: &Ticket, event: TicketEvent) {
        for (key, _) in ticket.buckets() {
            self.config.observe.ticket(key.bucket(), event);
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

    /// Claims the ticket's one-time mark ([`BucketStore::claim`]).
    async fn claim(&self, ticket: &Ticket) -> reqwest_middleware::Result<Claim> {
        self.store
            .claim(&ticket.key, &ticket.nonce_hex())
            .await
            .map_err(reqwest_middleware::Error::middleware)
    }

    /// Sends a request that holds a [`Ticket`]: at or after its time, for the buckets and
    /// account the request draws from, and unless an upstream back-off passed one of its slots
    /// while it waited in the queue; without taking another token.
    pub(super) async fn send_booked(
        &self,
        takes: &[RouteTake<'_>],
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
        if booked.len() != takes.len() || takes.iter().zip(&booked).any(|(t, (k, _))| t.key != **k)
        {
            return refused(TicketError::OtherBucket);
        }
        if takes
            .iter()
            .zip(&booked)
            .any(|(t, (_, r))| r.cost() < t.cost)
        {
            return refused(TicketError::TooCostly);
        }
        let first = &takes[0];
        let now = self.now();
        let early = ticket.ready_in(now);
        if !early.is_zero() {
            tracing::debug!(
                bucket = first.route.bucket(),
                key = %first.key.fingerprint(),
                early_ms = early.as_millis() as u64,
                "local 429: a booked request sent before its time"
            );
            self.observe_refusal(first, early);
            let limited = RateLimited::new(early, first.limit, first.route.bucket(), 0);
            return Err(reqwest_middleware::Error::middleware(limited));
        }
        if now > ticket.expires_at() {
            self.observe_ticket(&ticket, TicketEvent::Expired);
            return refused(TicketError::Expired);
        }
        for (t, (_, reservation)) in takes.iter().zip(&booked) {
            if let Some(retry) = self.halted_for(&t.key, t.limit, reservation).await {
                tracing::debug!(
                    bucket = t.route.bucket(),
                    key = %t.key.fingerprint(),
                    "local 429: an upstream back-off passed a booked slot"
                );
                self.observe_refusal(t, retry);
                let limited = RateLimited::new(retry, t.limit, t.route.bucket(), 0);
                return Err(reqwest_middleware::Error::middleware(limited));
            }
        }
        let claim = match self.claim(&ticket).await {
            Ok(claim) => claim,
            Err(e) => {
                self.observe_failure(takes, &e);
                return Err(e);
            }
        };
        match claim {
            Claim::First => {}
            Claim::Spent => return refused(TicketError::Spent),
            // The store lost the booking (or kept it a second past the grace, on a clock ahead
            // of this one): whether it went is unknown, and it must not go twice.
            Claim::Missing => {
                self.observe_ticket(&ticket, TicketEvent::Expired);
                return refused(TicketError::Expired);
            }
        }
        self.observe_ticket(&ticket, TicketEvent::Sent);
        let taken: Vec<Reservation> = booked.iter().map(|(_, r)| **r).collect();
        let sent_at = tokio::time::Instant::now();
        let res = next.run(req, extensions).await;
        self.observe_sent(takes, Duration::ZERO, &res);
        let res = res?;
        // When the turn was booked, and so whether the bucket was spent, is not known here: the
        // answer proves no margin, and lowers nothing.
        self.after_answer(takes, &taken, &res, 0, false, sent_at.elapsed())
            .await;
        Ok(res)
    }
}
