//! The `burstgate` binary, run as an operator runs it, against a private `redis-server` and a
//! real Redis Cluster, on buckets an application spent through the library: one module per
//! command family, the errors, and the commands `docs/OPERATIONS.md` shows.
//!
//! Every test keeps to a key prefix of its own, and the test process keys its fingerprints
//! with [`support::SECRET`] as the application would, so that what the binary prints can be
//! compared with what the library computes here, in another process.

mod audit;
mod bucket;
mod cluster;
mod docs;
mod errors;
mod fingerprint;
mod support;
mod top;
