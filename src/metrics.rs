//! The metrics burstgate records through the [`metrics`](https://docs.rs/metrics) facade (feature
//! `metrics`). The application installs the recorder (for example
//! `metrics-exporter-prometheus`) before the first request: a rule registers its counters on
//! its first decision, with whatever recorder is installed then.
//!
//! Labels name rules, stores and operations, never keys, so the number of series stays that of
//! your configuration however many clients there are.
//!
//! | name | kind | labels | what |
//! |---|---|---|---|
//! | `burstgate_decisions_total` | counter | `rule`, `outcome` | the layer's decisions; `outcome` is `admitted`, `limited`, `shadow_limited` or `error` (see [`Outcome`](crate::layer::Outcome)) |
//! | `burstgate_store_call_seconds` | histogram | `store`, `op` | how long each `RedisStore` call took, answered or failed; `store` is `redis`, `op` is `acquire`, `acquire_all`, `peek`, `refund`, `drain`, `lower`, `set`, `block`, `reset`, `book` or `claim` |
//! | `burstgate_circuit_open` | gauge | `store` | 1 while the Redis store's circuit breaker is open, 0 otherwise |
//! | `burstgate_deny_cache_hits_total` | counter | `store` | denials the Redis store's deny cache answered without a Redis call |
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
}
