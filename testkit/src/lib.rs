//! The Redis side of burstgate's tests, benches and unit tests: what they need of Redis and
//! nothing of burstgate, so the crate's own code can use it without reaching into `tests/`.
//!
//! - [`redis_server`]: the one Redis a test binary shares, or a `redis-server` of a test's own.
//! - [`redis_cluster`]: a three-primary Redis Cluster, shared or a test's own.
//! - [`scan`]: the keys that reached Redis.
//! - [`failing_connection`]: a connection on which every call fails.
//!
//! Not published: `burstgate` takes it as a path dev-dependency without a version, which cargo
//! drops from the packaged manifest.

pub mod failing_connection;
pub mod redis_cluster;
pub mod redis_server;
pub mod scan;
