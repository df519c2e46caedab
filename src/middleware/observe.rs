//! What the middleware tells operators about its requests: a hook called for each decision,
//! metrics through the `metrics` facade (feature `metrics`), and a warning for each upstream 429
//! or 503 that a flood of them cannot multiply.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use http::StatusCode;

use crate::log_gate::LogGate;
use crate::{BucketKey, StoreError};

/// What became of one request on one route, as [`DecisionEvent::outcome`] and the
/// `burstgate_client_requests_total` metric's `outcome` label report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RequestOutcome {
    /// The request went to the upstream, which answered neither 429 nor 503 (or did not
    /// answer: a transport error).
    Sent,
    /// The middleware did not send the request: its wait would pass the ceiling, it came
    /// before its booked turn, or an upstream back-off passed its booked slot.
    Local429,
    /// The request went, and the upstream answered 429.
    Upstream429,
    /// The request went, and the upstream answered 503.
    Upstream503,
    /// The store could not decide (Redis down, a timeout, a misconfigured cost); the request
    /// was not sent.
    StoreError,
}

impl RequestOutcome {
    /// The label: `sent`, `local_429`, `upstream_429`, `upstream_503` or `store_error`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Sent => "sent",
            Self::Local429 => "local_429",
            Self::Upstream429 => "upstream_429",
            Self::Upstream503 => "upstream_503",
            Self::StoreError => "store_error",
        }
    }

    /// The outcome of a request the upstream answered with `status`.
    pub(super) fn of(status: Option<StatusCode>) -> Self {
        match status {
            Some(StatusCode::TOO_MANY_REQUESTS) => Self::Upstream429,
            Some(StatusCode::SERVICE_UNAVAILABLE) => Self::Upstream503,
            _ => Self::Sent,
        }
    }

    #[cfg(any(test, feature = "metrics"))]
    const ALL: [Self; 5] = [
        Self::Sent,
        Self::Local429,
        Self::Upstream429,
        Self::Upstream503,
        Self::StoreError,
    ];
}

impl fmt::Display for RequestOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What happened to a [`Ticket`](super::Ticket), as the `burstgate_client_tickets_total`
/// metric's `event` label reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TicketEvent {
    Booked,
    Sent,
    Expired,
    Cancelled,
}

impl TicketEvent {
    #[cfg(feature = "metrics")]
    fn as_str(self) -> &'static str {
        match self {
            Self::Booked => "booked",
            Self::Sent => "sent",
            Self::Expired => "expired",
            Self::Cancelled => "cancelled",
        }
    }
}

/// One route's decision on one request, given to the
/// [`on_decision`](super::RateLimitMiddleware::on_decision) hook.
///
/// A request reports once for each route it draws from, but for a local 429, which the route
/// that refused reports alone.
#[derive(Debug)]
pub struct DecisionEvent<'a> {
    pub(super) route: &'a str,
    pub(super) key: &'a BucketKey,
    pub(super) outcome: RequestOutcome,
    pub(super) wait: Duration,
    pub(super) status: Option<StatusCode>,
    pub(super) retry_after: Option<Duration>,
    pub(super) error: Option<&'a StoreError>,
}

impl DecisionEvent<'_> {
    /// The route's bucket name.
    pub fn route(&self) -> &str {
        self.route
    }

    /// The bucket the request drew from. Log its [`fingerprint`](BucketKey::fingerprint), never
    /// anything that could be the key itself.
    pub fn key(&self) -> &BucketKey {
        self.key
    }

    /// What became of the request.
    pub fn outcome(&self) -> RequestOutcome {
        self.outcome
    }

    /// How long the request waited for its turn in the middleware (zero for a request that
    /// held a ticket: it waited for its turn before it was sent).
    pub fn wait(&self) -> Duration {
        self.wait
    }

    /// The upstream's status, when the request was sent and answered.
    pub fn status(&self) -> Option<StatusCode> {
        self.status
    }

    /// For a local 429, when the request could go.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// For a [`RequestOutcome::StoreError`], what went wrong.
    pub fn error(&self) -> Option<&StoreError> {
        self.error
    }
}

pub(super) type DecisionHook = Arc<dyn Fn(&DecisionEvent<'_>) + Send + Sync>;

/// The hook, and each route's log gate and metric handles, shared by the middleware's clones.
#[derive(Clone, Default)]
pub(super) struct Observe {
    pub(super) hook: Option<DecisionHook>,
    routes: Arc<Mutex<HashMap<String, Arc<RouteObserver>>>>,
}

impl fmt::Debug for Observe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Observe")
            .field(
                "on_decision",
                &self.hook.as_ref().map(|_| "Fn(&DecisionEvent)"),
            )
            .finish_non_exhaustive()
    }
}

/// One route's log gate and metric handles, registered on its first use.
struct RouteObserver {
    upstream_refused: LogGate,
    #[cfg(feature = "metrics")]
    metrics: RouteMetrics,
}

impl Observe {
    /// Route `route`'s observer, made on its first use: a label string per request would be an
    /// allocation per request.
    fn route(&self, route: &str) -> Arc<RouteObserver> {
        let mut routes = self.routes.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(observer) = routes.get(route) {
            return Arc::clone(observer);
        }
        let observer = Arc::new(RouteObserver {
            upstream_refused: LogGate::new(),
            #[cfg(feature = "metrics")]
            metrics: RouteMetrics::new(route),
        });
        routes.insert(route.to_owned(), Arc::clone(&observer));
        observer
    }

    /// Counts, reports and (for an upstream 429 or 503, at most once per route and period) logs
    /// one route's decision on a request.
    pub(super) fn decided(&self, event: &DecisionEvent<'_>) {
        #[cfg(feature = "metrics")]
        {
            let m = &self.route(event.route).metrics;
            m.requests[event.outcome as usize].increment(1);
            if !matches!(
                event.outcome,
                RequestOutcome::Local429 | RequestOutcome::StoreError
            ) {
                m.wait.record(event.wait.as_secs_f64());
            }
        }
        if let Some(hook) = &self.hook {
            hook(event);
        }
        if matches!(
            event.outcome,
            RequestOutcome::Upstream429 | RequestOutcome::Upstream503
        ) && tracing::enabled!(tracing::Level::WARN)
            && let Some(suppressed) = self.route(event.route).upstream_refused.admit()
        {
            tracing::warn!(
                bucket = event.route,
                key = %event.key.fingerprint(),
                status = event.status.map_or(0, |s| s.as_u16()),
                suppressed,
                "the upstream refused a request"
            );
        }
    }

    /// Counts a back-off the upstream asked for, of `retry`.
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(super) fn backed_off(&self, route: &str, retry: Duration) {
        #[cfg(feature = "metrics")]
        {
            let m = &self.route(route).metrics;
            m.backoffs.increment(1);
            m.backoff_seconds.record(retry.as_secs_f64());
        }
    }

    /// Counts a lowering of the route's bucket to what the upstream reported left.
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(super) fn lowered(&self, route: &str) {
        #[cfg(feature = "metrics")]
        self.route(route).metrics.lowerings.increment(1);
    }

    /// Counts what happened to a ticket on one of its routes.
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(super) fn ticket(&self, route: &str, event: TicketEvent) {
        #[cfg(feature = "metrics")]
        self.route(route).metrics.tickets[event as usize].increment(1);
    }
}

#[cfg(feature = "metrics")]
struct RouteMetrics {
    /// By [`RequestOutcome`], in its order.
    requests: [metrics::Counter; 5],
    wait: metrics::Histogram,
    backoffs: metrics::Counter,
    backoff_seconds: metrics::Histogram,
    lowerings: metrics::Counter,
    /// By [`TicketEvent`], in its order.
    tickets: [metrics::Counter; 4],
}

#[cfg(feature = "metrics")]
impl RouteMetrics {
    fn new(route: &str) -> Self {
        use crate::metrics as names;
        let label = || ("route", route.to_owned());
        Self {
            requests: RequestOutcome::ALL.map(|outcome| {
                metrics::counter!(
                    names::CLIENT_REQUESTS,
                    &[label(), ("outcome", outcome.as_str().to_owned())]
                )
            }),
            wait: metrics::histogram!(names::CLIENT_WAIT_SECONDS, &[label()]),
            backoffs: metrics::counter!(names::CLIENT_BACKOFFS, &[label()]),
            backoff_seconds: metrics::histogram!(names::CLIENT_BACKOFF_SECONDS, &[label()]),
            lowerings: metrics::counter!(names::CLIENT_LOWERINGS, &[label()]),
            tickets: [
                TicketEvent::Booked,
                TicketEvent::Sent,
                TicketEvent::Expired,
                TicketEvent::Cancelled,
            ]
            .map(|event| {
                metrics::counter!(
                    names::CLIENT_TICKETS,
                    &[label(), ("event", event.as_str().to_owned())]
                )
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_are_labelled_as_documented() {
        let labels: Vec<String> = RequestOutcome::ALL
            .iter()
            .map(RequestOutcome::to_string)
            .collect();
        assert_eq!(
            labels,
            [
                "sent",
                "local_429",
                "upstream_429",
                "upstream_503",
                "store_error"
            ]
        );
        for (i, outcome) in RequestOutcome::ALL.iter().enumerate() {
            assert_eq!(
                *outcome as usize, i,
                "the metric handles are indexed by outcome"
            );
        }
    }

    #[test]
    fn an_answer_is_an_upstream_refusal_only_on_429_and_503() {
        assert_eq!(
            RequestOutcome::of(Some(StatusCode::TOO_MANY_REQUESTS)),
            RequestOutcome::Upstream429
        );
        assert_eq!(
            RequestOutcome::of(Some(StatusCode::SERVICE_UNAVAILABLE)),
            RequestOutcome::Upstream503
        );
        assert_eq!(
            RequestOutcome::of(Some(StatusCode::OK)),
            RequestOutcome::Sent
        );
        assert_eq!(RequestOutcome::of(None), RequestOutcome::Sent);
    }
}
