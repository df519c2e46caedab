//! What the integration suites share: the Redis harness of `burstgate-testkit`, re-exported so
//! the suites name one place, and the helpers of burstgate's own that more than one suite uses.

#[cfg(feature = "redis")]
pub(crate) use burstgate_testkit::{failing_connection, redis_cluster, redis_server, scan};

#[cfg(any(feature = "redis", feature = "tower"))]
pub(crate) mod logs;
