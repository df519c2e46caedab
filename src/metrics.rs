//! The metrics burstgate records through the [`metrics`](https://docs.rs/metrics) facade (feature
//! `metrics`). The application installs the recorder (for example
//! `metrics-exporter-prometheus`) before the first request: a rule registers its counters on
//! its first decision, with whatever recorder is installed then.
//!
//! Labels name rules, routes (their bucket names), stores and operations, never keys, so the number of series stays that of
//! your configuration however many clients there are.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `burstgate_decisions_total` | counter | `rule`, `outcome` | the layer's decisions; `outcome` is `admitted`, `limited`, `shadow_limited` or `error` (see [`Outcome`](crate::layer::Outcome)) |
//! | `burstgate_store_call_seconds` | histogram | `store`, `op` | how long each `RedisStore` call took, answered or failed; `store` is `redis`, `op` is `acquire`, `acquire_all`, `peek`, `refund`, `drain`, `lower`, `set`, `block`, `reset`, `book` or `claim` |
//! | `burstgate_circuit_open` | gauge | `store` | 1 while the Redis store's circuit breaker is open, 0 otherwise |
//! | `burstgate_deny_cache_hits_total` | counter | `store` | denials the Redis store's deny cache answered without a Redis call |
//! | `burstgate_client_requests_total` | counter | `route`, `outcome` | the middleware's requests, once per route they draw from (a local 429 only on the route that refused); `outcome` is `sent`, `local_429`, `upstream_429`, `upstream_503` or `store_error` (see [`RequestOutcome`](crate::middleware::RequestOutcome)) |
//! | `burstgate_client_wait_seconds` | histogram | `route` | how long each request the middleware sent waited for its turn (a ticket's request: zero) |
//! | `burstgate_client_backoffs_total` | counter | `route` | back-offs an upstream 429 (or 503 with a time) started on the route's bucket |
//! | `burstgate_client_backoff_seconds` | histogram | `route` | how long each of those back-offs asked for, after `max_backoff` |
//! | `burstgate_client_lowerings_total` | counter | `route` | times the route's bucket came down to what the upstream reported left |
//! | `burstgate_client_tickets_total` | counter | `route`, `event` | the middleware's tickets; `event` is `booked`, `sent`, `expired` or `cancelled` |
//!
//! [`describe`] registers a description of each with the recorder, for exporters that print
//! them (Prometheus's `# HELP`).

/// The layer's decisions, by `rule` and `outcome`.
pub const DECISIONS: &str = "burstgate_decisions_total";
/// The Redis store's call latency in seconds, by `store` and `op`.
pub const STORE_CALL_SECONDS: &str = "burstgate_store_call_seconds";
/// 1 while the Redis store's circuit breaker is open, by `store`.
pub const CIRCUIT_OPEN: &str = "burstgate_circuit_open";
/// Denials answered by the Redis store's deny cache, by `store`.
pub const DENY_CACHE_HITS: &str = "burstgate_deny_cache_hits_total";

/// The middleware's requests, by `route` and `outcome`.
pub const CLIENT_REQUESTS: &str = "burstgate_client_requests_total";
/// How long the middleware's sent requests waited for their turn, in seconds, by `route`.
pub const CLIENT_WAIT_SECONDS: &str = "burstgate_client_wait_seconds";
/// Back-offs the upstream started, by `route`.
pub const CLIENT_BACKOFFS: &str = "burstgate_client_backoffs_total";
/// The length of the back-offs the upstream started, in seconds, by `route`.
pub const CLIENT_BACKOFF_SECONDS: &str = "burstgate_client_backoff_seconds";
/// Lowerings of a bucket to what the upstream reported left, by `route`.
pub const CLIENT_LOWERINGS: &str = "burstgate_client_lowerings_total";
/// The middleware's tickets, by `route` and `event`.
pub const CLIENT_TICKETS: &str = "burstgate_client_tickets_total";

/// Describes every burstgate metric to the installed recorder. Call it once, after installing
/// the recorder.
pub fn describe() {
    metrics::describe_counter!(
        DECISIONS,
        metrics::Unit::Count,
        "Rate limit decisions by rule and outcome"
    );
    metrics::describe_histogram!(
        STORE_CALL_SECONDS,
        metrics::Unit::Seconds,
        "Rate limit store call latency by store and operation"
    );
    metrics::describe_gauge!(
        CIRCUIT_OPEN,
        "1 while the rate limit store's circuit breaker is open"
    );
    metrics::describe_counter!(
        DENY_CACHE_HITS,
        metrics::Unit::Count,
        "Denials answered by the local deny cache without a store call"
    );
    metrics::describe_counter!(
        CLIENT_REQUESTS,
        metrics::Unit::Count,
        "Rate limited client requests by route and outcome"
    );
    metrics::describe_histogram!(
        CLIENT_WAIT_SECONDS,
        metrics::Unit::Seconds,
        "Time a client request waited for its turn, by route"
    );
    metrics::describe_counter!(
        CLIENT_BACKOFFS,
        metrics::Unit::Count,
        "Back-offs an upstream 429 or 503 started, by route"
    );
    metrics::describe_histogram!(
        CLIENT_BACKOFF_SECONDS,
        metrics::Unit::Seconds,
        "Length of the back-offs the upstream started, by route"
    );
    metrics::describe_counter!(
        CLIENT_LOWERINGS,
        metrics::Unit::Count,
        "Lowerings of a bucket to the upstream's reported remaining, by route"
    );
    metrics::describe_counter!(
        CLIENT_TICKETS,
        metrics::Unit::Count,
        "Client tickets booked, sent, expired and cancelled, by route"
    );
}
