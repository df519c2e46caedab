//! The integration suites, one module each, in one test binary: one link instead of one per
//! suite, and one shared Redis for all of them (each test keeps to a key prefix of its own).
//!
//! Beside this binary are only the suites that cannot share a process: `faults.rs` and
//! `memory.rs` count every allocation of theirs with a global allocator. A test here must not
//! assume it is alone in its process: no global allocator, no environment variable set, no
//! tracing subscriber made global by the test (capture logs through `support::logs`), and
//! nothing that changes the shared Redis for the others (`SCRIPT FLUSH`, `FLUSHALL`, `CONFIG
//! SET`): a test that needs that starts a `redis-server` of its own.
//!
//! `cargo test --all-features --test all -- <module>::` runs one suite.

// Shared with any binary beside this one, so it sits in `tests/support/`, not in `tests/all/`.
#[path = "../support/mod.rs"]
mod support;

mod admin;
mod audit;
mod bad_input;
mod clock_skew;
mod cluster;
mod conformance;
mod failover;
mod flood;
mod fuzz;
mod layer;
mod layer_fields;
mod layer_http;
mod layer_keys;
mod layer_ops;
mod layer_outage;
mod leases;
mod middleware;
mod middleware_batch;
mod middleware_feedback;
mod middleware_metrics;
mod middleware_routes;
mod middleware_tickets;
mod outage;
mod paused_time;
mod redis_security;
mod redis_store;
mod secrets;
mod server_clock;
mod strict_upstream;
