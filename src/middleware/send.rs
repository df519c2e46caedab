//! Sending a request: the buckets of the routes that match it, its turn waited for on all of
//! them, the request sent, and the answer settled on each. Every route that matches applies, and
//! their buckets are taken at once, all or none ([`BucketStore::acquire_all`]), the request going
//! at the latest of their times; one route's bucket is one plain decision, and more buckets than
//! one call takes ([`MAX_TAKES`]) are taken in turn, each at the time the request goes. A request
//! that holds a [`Ticket`](super::Ticket) goes on its booked turn instead.

use std::time::Duration;

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::Next;

use super::backoff::Feedback;
use super::observe::{DecisionEvent, RequestOutcome};
use super::{Cost, RateLimitMiddleware, Route, Time, account, follow};
use crate::cancel::{RefundGuard, acquire_all_detached, acquire_detached};
use crate::error::BackendError;
use crate::{
    BucketKey, BucketStore, Decision, Limit, MAX_TAKES, RateLimited, Reservation, StoreError,
};

/// One route's take: as the store's [`Take`](crate::Take), the bucket a request draws from, its
/// limit and the request's cost there, with the route that matched.
pub(super) struct RouteTake<'r> {
    pub(super) route: &'r Route,
    pub(super) key: BucketKey,
    pub(super) limit: Limit,
    pub(super) cost: u32,
}

impl<St, K> RateLimitMiddleware<St, K>
where
    St: BucketStore + Clone,
    K: Time<St>,
{
    /// Every route that matches the request, in the order they were added, but for a route of a
    /// bucket an earlier match draws from already (the first route of a bucket that matches
    /// sets the request's cost there); the default route when none matches; none without a
    /// default.
    pub(super) fn routes_for(&self, req: &Request) -> Vec<&Route> {
        let config = &self.config;
        let mut matching: Vec<&Route> = Vec::new();
        for route in &config.routes {
            if route.matches_url(req.method(), req.url())
                && !matching.iter().any(|m| m.bucket == route.bucket)
            {
                matching.push(route);
            }
        }
        if matching.is_empty() {
            return config.default.iter().collect();
        }
        matching
    }

    fn key(&self, route: &Route, req: &Request, extensions: &Extensions) -> BucketKey {
        account::request_key(
            &route.bucket,
            extensions,
            req.headers(),
            self.config.account_header.as_ref(),
            self.config.key_secret.as_ref(),
        )
    }

    /// Takes the request's tokens of one route's bucket on a task of its own (the cancellation
    /// rule, `crate::cancel`): an audited route's through the several-bucket call, which writes
    /// its trail.
    async fn acquire(&self, t: &RouteTake<'_>, max_wait: Duration) -> Result<Decision, StoreError> {
        let Some(audit) = &t.route.audit else {
            return acquire_detached(
                &self.store,
                &self.abandoned,
                &t.key,
                t.limit,
                t.cost,
                max_wait,
            )
            .await;
        };
        let bucket = vec![(t.key.clone(), t.limit, t.cost, Some(audit.clone()))];
        let mut decisions =
            acquire_all_detached(&self.store, &self.abandoned, bucket, max_wait).await?;
        decisions.pop().ok_or_else(|| {
            StoreError::Backend(BackendError::new(
                "the store answered a request on one bucket with no decision",
                None,
            ))
        })
    }

    /// The takes of the routes that match a request: a [`Cost`] on the request applies to each,
    /// and each route's own cost otherwise.
    pub(super) fn takes<'r>(
        &self,
        routes: &[&'r Route],
        req: &Request,
        extensions: &Extensions,
    ) -> Vec<RouteTake<'r>> {
        let cost = extensions.get::<Cost>().map(Cost::tokens);
        routes
            .iter()
            .map(|&route| RouteTake {
                route,
                key: self.key(route, req, extensions),
                limit: route.bucket_limit,
                cost: cost.unwrap_or(route.cost),
            })
            .collect()
    }

    /// The ceiling on a request's wait: the middleware's, or the shortest of the default ones
    /// of its routes (two token periods per token of its cost, each). A waiting request holds
    /// every one of its buckets' tokens for its slot, so that each bucket's other requests queue
    /// behind it; the shortest default keeps that within two token periods of every route.
    pub(super) fn ceiling(&self, takes: &[RouteTake<'_>]) -> Duration {
        self.config.max_wait.unwrap_or_else(|| {
            takes
                .iter()
                .map(|t| t.limit.default_max_wait(t.cost))
                .min()
                .unwrap_or(Duration::ZERO)
        })
    }

    /// Takes the tokens of every bucket at once, on a task of its own (the cancellation rule,
    /// `crate::cancel`): one decision per bucket, in order, all admitted or none. One bucket is
    /// one plain `acquire`; more than [`MAX_TAKES`] are taken in turn
    /// ([`acquire_in_turn`](Self::acquire_in_turn)).
    pub(super) async fn acquire_all(
        &self,
        takes: &[RouteTake<'_>],
        max_wait: Duration,
    ) -> reqwest_middleware::Result<Vec<Decision>> {
        if let [one] = takes {
            let decision = self
                .acquire(one, max_wait)
                .await
                .map_err(reqwest_middleware::Error::middleware)?;
            return Ok(vec![decision]);
        }
        if takes.len() > MAX_TAKES {
            return self.acquire_in_turn(takes, max_wait).await;
        }
        let buckets = takes
            .iter()
            .map(|t| (t.key.clone(), t.limit, t.cost, t.route.audit.clone()))
            .collect();
        let decisions = acquire_all_detached(&self.store, &self.abandoned, buckets, max_wait)
            .await
            .map_err(reqwest_middleware::Error::middleware)?;
        if decisions.len() != takes.len() {
            return Err(reqwest_middleware::Error::middleware(StoreError::Backend(
                BackendError::new(
                    "the store answered a request on several buckets with another number of decisions",
                    None,
                ),
            )));
        }
        Ok(decisions)
    }

    /// Takes more buckets than one store call can, one call each, now or not at all: a bucket
    /// that cannot serve the request now refuses it, what the buckets before it took goes back
    /// (as every refund, only while nothing was booked behind it; else it stays spent, the safe
    /// side), and the request comes back when that bucket could serve it, while that is within
    /// `max_wait` of the first try. The decisions, in order, up to the last, which refused when
    /// it did not admit; all admitted and none waiting otherwise.
    ///
    /// Never a reservation for later: calls in turn cannot debit every bucket at one time, and a
    /// bucket debited for a slot earlier than the request goes would let its next request reach
    /// the upstream sooner than its limit allows. The price is the queue: such a request holds
    /// no place in one while it waits, so requests that reserve go first (docs/middleware.md,
    /// "Several limits on one request").
    async fn acquire_in_turn(
        &self,
        takes: &[RouteTake<'_>],
        max_wait: Duration,
    ) -> reqwest_middleware::Result<Vec<Decision>> {
        let started = tokio::time::Instant::now();
        loop {
            // Gives back on drop too: a caller gone in the middle of the takes.
            let mut guard = RefundGuard::new(self.store.clone(), &self.abandoned);
            let mut decisions = Vec::with_capacity(takes.len());
            for t in takes {
                let decision = match self.acquire(t, Duration::ZERO).await {
                    Ok(decision) => decision,
                    Err(e) => {
                        guard.refund_all().await;
                        return Err(reqwest_middleware::Error::middleware(e));
                    }
                };
                if let Some(reservation) = decision.reservation() {
                    guard.push(t.key.clone(), t.limit, reservation);
                }
                let retry = decision.retry_after();
                decisions.push(decision);
                let Some(retry) = retry else { continue };
                guard.refund_all().await;
                if retry > max_wait.saturating_sub(started.elapsed()) {
                    return Ok(decisions);
                }
                tracing::debug!(
                    bucket = t.route.bucket(),
                    key = %t.key.fingerprint(),
                    buckets = takes.len(),
                    retry_ms = retry.as_millis() as u64,
                    "more buckets than one call takes: trying again when the refusing one allows"
                );
                // At least a millisecond, the store's unit, so that a refusal never spins.
                tokio::time::sleep(retry.max(Duration::from_millis(1))).await;
                break;
            }
            if decisions.len() == takes.len() && decisions.iter().all(Decision::is_admitted) {
                guard.disarm();
                return Ok(decisions);
            }
        }
    }

    /// The local 429 of a request on several buckets that was refused: the route whose time
    /// is furthest off (the first of equal ones) refused it.
    pub(super) fn refusal(takes: &[RouteTake<'_>], decisions: &[Decision]) -> RateLimited {
        let refusing = Self::refusing(decisions);
        let (take, decision) = (&takes[refusing], &decisions[refusing]);
        let retry = decision.retry_after().unwrap_or(Duration::ZERO);
        tracing::debug!(
            bucket = take.route.bucket(),
            key = %take.key.fingerprint(),
            retry_ms = retry.as_millis() as u64,
            "local 429: the wait would pass the ceiling"
        );
        RateLimited::new(retry, take.limit, take.route.bucket(), decision.remaining())
    }

    /// Which of the decisions on a refused request refused it: the one whose time is furthest
    /// off (the first of equal ones).
    pub(super) fn refusing(decisions: &[Decision]) -> usize {
        (0..decisions.len())
            .rev()
            .max_by_key(|&k| decisions[k].retry_after())
            .unwrap_or(0)
    }

    /// Reports a local 429 on the route of `take`, which refused the request.
    pub(super) fn observe_refusal(&self, take: &RouteTake<'_>, retry: Duration) {
        self.config.observe.decided(&DecisionEvent {
            route: take.route.bucket(),
            key: &take.key,
            outcome: RequestOutcome::Local429,
            wait: Duration::ZERO,
            status: None,
            retry_after: Some(retry),
            error: None,
        });
    }

    /// Reports a store's failure to decide on each of the request's routes.
    pub(super) fn observe_failure(&self, takes: &[RouteTake<'_>], e: &reqwest_middleware::Error) {
        let error = match e {
            reqwest_middleware::Error::Middleware(e) => e.downcast_ref::<StoreError>(),
            reqwest_middleware::Error::Reqwest(_) => None,
        };
        for t in takes {
            self.config.observe.decided(&DecisionEvent {
                route: t.route.bucket(),
                key: &t.key,
                outcome: RequestOutcome::StoreError,
                wait: Duration::ZERO,
                status: None,
                retry_after: None,
                error,
            });
        }
    }

    /// Reports a request that went, after `wait`, on each of its routes.
    pub(super) fn observe_sent(
        &self,
        takes: &[RouteTake<'_>],
        wait: Duration,
        answer: &reqwest_middleware::Result<Response>,
    ) {
        let status = answer.as_ref().ok().map(Response::status);
        let outcome = RequestOutcome::of(status);
        for t in takes {
            self.config.observe.decided(&DecisionEvent {
                route: t.route.bucket(),
                key: &t.key,
                outcome,
                wait,
                status,
                retry_after: None,
                error: None,
            });
        }
    }

    /// Whether an upstream back-off passed the slot of any of the request's reservations.
    async fn any_halted(&self, takes: &[RouteTake<'_>], reservations: &[Reservation]) -> bool {
        for (t, r) in takes.iter().zip(reservations) {
            if self.halted(&t.key, t.limit, r).await {
                return true;
            }
        }
        false
    }

    /// Sends a request that `routes` (at least one) match: waits its turn on every bucket at
    /// once, queues again when an upstream back-off passed its slot on any, and after the answer
    /// settles its cost on each, backs every bucket off on a 429 (or a 503 with a time), and
    /// lowers the first route's bucket to what the upstream reports left. A request holding a
    /// [`Ticket`](super::Ticket) goes on its booked turn instead.
    pub(super) async fn send(
        &self,
        routes: &[&Route],
        req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let takes = self.takes(routes, &req, extensions);
        if let Some(ticket) = extensions.get::<super::Ticket>().cloned() {
            return self
                .send_booked(&takes, ticket, req, extensions, next)
                .await;
        }
        let max_wait = self.ceiling(&takes);
        let started = tokio::time::Instant::now();
        let mut ceiling = max_wait;
        let mut expected = 0;
        let mut queued = false;
        let taken = loop {
            let decisions = match self.acquire_all(&takes, ceiling).await {
                Ok(decisions) => decisions,
                Err(e) => {
                    self.observe_failure(&takes, &e);
                    return Err(e);
                }
            };
            if !decisions.iter().all(Decision::is_admitted) {
                let limited = Self::refusal(&takes, &decisions);
                self.observe_refusal(&takes[Self::refusing(&decisions)], limited.retry_after());
                return Err(reqwest_middleware::Error::middleware(limited));
            }
            let reservations: Vec<Reservation> =
                decisions.iter().filter_map(Decision::reservation).collect();
            let wait = decisions.first().map_or(Duration::ZERO, Decision::wait);
            if wait.is_zero() {
                expected = decisions.first().map_or(0, Decision::remaining);
                break reservations;
            }
            queued = true;
            let mut guard = RefundGuard::new(self.store.clone(), &self.abandoned);
            for (t, r) in takes.iter().zip(&reservations) {
                guard.push(t.key.clone(), t.limit, *r);
            }
            tracing::debug!(
                buckets = takes.len(),
                wait_ms = wait.as_millis() as u64,
                "waiting for reserved tokens"
            );
            tokio::time::sleep(wait).await;
            guard.disarm();
            if !self.any_halted(&takes, &reservations).await {
                break reservations;
            }
            ceiling = max_wait.saturating_sub(started.elapsed());
            tracing::debug!(
                buckets = takes.len(),
                ceiling_ms = ceiling.as_millis() as u64,
                "an upstream back-off passed a reserved slot: queuing again"
            );
        };
        let sent_at = tokio::time::Instant::now();
        let res = next.run(req, extensions).await;
        let rtt = sent_at.elapsed();
        self.observe_sent(&takes, sent_at.duration_since(started), &res);
        let res = res?;
        self.after_answer(&takes, &taken, &res, expected, queued, rtt)
            .await;
        Ok(res)
    }

    /// What the answer asks of each of the request's buckets: its cost settled on every bucket,
    /// a back-off or an error's cost applied to every bucket, and the upstream's report of what
    /// is left followed on the first route's bucket alone.
    pub(super) async fn after_answer(
        &self,
        takes: &[RouteTake<'_>],
        taken: &[Reservation],
        res: &Response,
        expected: u32,
        queued: bool,
        rtt: Duration,
    ) {
        for (n, (t, r)) in takes.iter().zip(taken).enumerate() {
            let settle = self.settlement(&t.key, t.limit, res, *r);
            let sent = follow::Sent {
                expected: if n == 0 { expected } else { 0 },
                queued,
                cost: r.cost(),
                settled: settle.is_some(),
                rtt,
            };
            if let Some(settle) = settle {
                settle.apply(&self.store, &t.key, t.limit).await;
            }
            let Some(feedback) = self.feedback(&t.key, t.limit, res, &sent, n == 0) else {
                continue;
            };
            let observe = &self.config.observe;
            match feedback {
                // A drain without a 429 or 503 is the upstream's report of nothing left.
                Feedback::Drain { retry, .. } if upstream_refused(res.status()) => {
                    observe.backed_off(t.route.bucket(), retry);
                }
                Feedback::Drain { .. } => observe.lowered(t.route.bucket()),
                _ => {}
            }
            let lowering = matches!(feedback, Feedback::Lower { .. });
            if feedback.apply(&self.store, &t.key, t.limit).await && lowering {
                observe.lowered(t.route.bucket());
            }
        }
    }
}

/// Whether `status` is the upstream refusing the request: a 429, or a 503.
fn upstream_refused(status: http::StatusCode) -> bool {
    matches!(
        status,
        http::StatusCode::TOO_MANY_REQUESTS | http::StatusCode::SERVICE_UNAVAILABLE
    )
}
