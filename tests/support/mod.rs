//! What the integration suites share: the Redis harness of `burstgate-testkit`, re-exported so
//! the suites name one place, and the helpers of burstgate's own that more than one suite uses.

use std::time::Duration;

use burstgate::{BucketKey, Limit};

#[cfg(feature = "redis")]
pub(crate) use burstgate_testkit::{failing_connection, redis_cluster, redis_server, scan};

#[cfg(feature = "tower")]
pub(crate) mod layer;
#[cfg(any(feature = "redis", feature = "tower", feature = "reqwest"))]
pub(crate) mod logs;
#[cfg(any(feature = "tower", feature = "reqwest"))]
mod stores;
#[cfg(any(feature = "tower", feature = "reqwest"))]
pub(crate) use stores::SlowReplies;
#[cfg(feature = "reqwest")]
pub(crate) use stores::{HeldDrains, RefusedBookings};
#[cfg(all(feature = "reqwest", feature = "redis"))]
pub(crate) mod strict;
#[cfg(feature = "reqwest")]
pub(crate) mod upstream;

/// The time a `ManualClock` starts at in the tests, in ms since the epoch (November 2023).
pub(crate) const START: u64 = 1_700_000_000_000;

pub(crate) const ZERO: Duration = Duration::ZERO;

/// The longest reservation: 2^44 ms. Longer `max_wait`s are clamped to it.
pub(crate) const MAX_WAIT_MS: u64 = 1 << 44;

/// The longest interval and refill time a `Limit` accepts: 2^42 ms.
pub(crate) const MAX_SPAN_MS: u64 = 1 << 42;

/// `tokens` every `interval_ms` ms, with a burst of `burst`.
pub(crate) fn limit(tokens: u32, interval_ms: u64, burst: u32) -> Limit {
    Limit::new(tokens, Duration::from_millis(interval_ms))
        .and_then(|l| l.with_burst(burst))
        .expect("a valid limit")
}

/// How many times Redis ran `command` (lowercase, `eval` or `evalsha`), from the text of its
/// `INFO commandstats`: zero when it never ran it.
#[cfg(feature = "redis")]
pub(crate) fn calls_of(commandstats: &str, command: &str) -> u64 {
    let prefix = format!("cmdstat_{command}:");
    commandstats
        .lines()
        .find_map(|l| l.trim().strip_prefix(prefix.as_str()))
        .map_or(0, |stats| {
            stats
                .split(',')
                .find_map(|field| field.strip_prefix("calls="))
                .and_then(|n| n.parse().ok())
                .expect("a count of calls")
        })
}

pub(crate) fn key(bucket: &str, key: impl AsRef<[u8]>) -> BucketKey {
    BucketKey::new(bucket, key).expect("a valid key")
}

/// A route run exactly at `limit`, with no margin: the middleware suites count the arithmetic
/// to the millisecond. The default margin is tested against a strict upstream in
/// `strict_upstream.rs`.
#[cfg(feature = "reqwest")]
pub(crate) fn exact_route(
    bucket: &str,
    limit: Limit,
    path: &str,
) -> Result<burstgate::middleware::Route, burstgate::middleware::InvalidRoute> {
    Ok(burstgate::middleware::Route::new(bucket, limit, path)?
        .margin(Duration::ZERO)
        .expect("no margin is always valid"))
}
