//! The shared store, on Redis.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use redis::aio::ConnectionLike;

use crate::bucket::Outcome;
use crate::clock::{Clock, SystemClock, deadline_ms};
use crate::store::{BackendError, BucketStore, Decision, Quota, StoreError, check_cost};
use crate::{BucketKey, InvalidKey, Limit};

/// The version of the stored format, part of every key: a change of the stored type moves to new
/// keys instead of meeting old values. 1 was a hash `{t, ts}` with decimal fields; 2 is one
/// 16-byte string, the two `f64`s little-endian.
const FORMAT: u32 = 2;

const DEFAULT_PREFIX: &str = "burstgate";

/// The script, shared by every store in the process: its SHA-1 is computed once.
fn script() -> &'static redis::Script {
    static SCRIPT: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| redis::Script::new(include_str!("bucket.lua")))
}

/// Buckets in Redis, shared by every process that reaches it.
///
/// Each bucket is one Redis string of 16 bytes: `t` (tokens available at `ts`) then `ts`
/// (milliseconds since the Unix epoch), each an IEEE 754 `f64`, little-endian, as Lua's
/// `struct.pack('<dd', t, ts)` writes them. One Lua script reads and writes it, mirroring the
/// crate's reference arithmetic to the last bit. The script runs with `EVALSHA`; after a
/// `NOSCRIPT` (a restart, a failover, `SCRIPT FLUSH`) it is loaded again and the call repeated,
/// once. The time is the store's [`Clock`], passed to the script, never Redis's `TIME`.
///
/// A decision costs Redis one `GET`, and, when it admits (or refunds, or drains), one
/// `SET ... PX` that writes the state and its expiry together; a plain denial writes nothing. The
/// raw bytes round-trip every `f64` exactly with no decimal formatting or parsing on either side.
/// Against format 1 (a hash written with `HSET` and `PEXPIRE`, its fields as `%.17g` text) this
/// cut the script's Redis CPU time (`INFO commandstats`, `usec_per_call` for `evalsha`) by about
/// 30%, on admits and on denials alike; the README has the figures.
///
/// # Keys
///
/// `<prefix>:v2:<bucket>:<key>`, with the prefix `burstgate` unless set with
/// [`with_prefix`](Self::with_prefix), and the key escaped or hashed as [`BucketKey`] describes.
/// The `v2` is the stored format's version, so a bucket written by an earlier build (`v1`, a
/// hash) is never read as this one: it is simply left alone and expires by its own TTL. Every
/// write sets an integer expiry (`PX`) of the time to refill the bucket to full plus one
/// interval: an idle bucket expires, and the next call sees a full bucket, which is what it would
/// have computed anyway. A key under the prefix that holds anything else (another type, or a
/// string that is not 16 bytes) is reported as [`StoreError::WrongType`], naming the key.
///
/// # Connections
///
/// Any redis-rs async connection that is `Clone`: a
/// [`MultiplexedConnection`](redis::aio::MultiplexedConnection), a reconnecting
/// [`ConnectionManager`](redis::aio::ConnectionManager), or a Redis Cluster connection
/// ([`ClusterConnection`](redis::cluster_async::ClusterConnection)). Each call runs on a clone, so
/// many calls share one multiplexed connection concurrently. The script touches one key, so it
/// needs no hash tags on a cluster.
///
/// The connection's own response timeout applies (redis-rs gives multiplexed connections 500 ms
/// by default; set it on the client's `AsyncConnectionConfig`). A call that times out is a
/// [`StoreError::Backend`]; the script may still have run, so its token counts as spent, the safe
/// direction.
///
/// ```no_run
/// use std::time::Duration;
/// use burstgate::{BucketKey, BucketStore, Limit, RedisStore};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let client = redis::Client::open("redis://127.0.0.1/")?;
/// let conn = client.get_multiplexed_async_connection().await?;
/// let store = RedisStore::new(conn).with_prefix("myapp")?;
///
/// let limit = Limit::per_minute(1)?.with_burst(10)?;
/// let key = BucketKey::hashed("orders", "seller-api-token")?;
/// let decision = store.acquire(&key, limit, 1, Duration::ZERO).await?;
/// println!("admitted: {}, {} left", decision.is_admitted(), decision.remaining());
/// # Ok(())
/// # }
/// ```
pub struct RedisStore<C, K = SystemClock> {
    conn: C,
    clock: K,
    prefix: Arc<str>,
}

impl<C> RedisStore<C, SystemClock>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A store on `conn`, with the default prefix and the system clock.
    pub fn new(conn: C) -> Self {
        Self {
            conn,
            clock: SystemClock,
            prefix: Arc::from(DEFAULT_PREFIX),
        }
    }
}

impl<C, K> RedisStore<C, K>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
    K: Clock,
{
    /// Puts every key under `prefix` instead of `burstgate`. The prefix follows the rule for
    /// bucket names: 1 to 64 ASCII letters, digits, `_`, `.` or `-`.
    pub fn with_prefix(self, prefix: &str) -> Result<Self, InvalidKey> {
        if !crate::key::is_name(prefix) {
            return Err(InvalidKey::Prefix);
        }
        Ok(Self {
            prefix: Arc::from(prefix),
            ..self
        })
    }

    /// Reads the time from `clock` instead of the system clock.
    #[must_use]
    pub fn with_clock<K2: Clock>(self, clock: K2) -> RedisStore<C, K2> {
        RedisStore {
            conn: self.conn,
            clock,
            prefix: self.prefix,
        }
    }

    /// The full Redis key of a bucket.
    pub fn redis_key(&self, key: &BucketKey) -> String {
        format!("{}:v{FORMAT}:{}", self.prefix, key.as_str())
    }

    async fn run(&self, key: &BucketKey, args: Args) -> Result<Outcome, StoreError> {
        let mut conn = self.conn.clone();
        invoke(
            script(),
            &mut conn,
            self.redis_key(key),
            self.clock.now_ms(),
            &args,
        )
        .await
    }
}

/// Runs `script` for one bucket. The store and the differential test share this, so the test
/// encodes arguments exactly as the store does.
async fn invoke(
    script: &redis::Script,
    conn: &mut impl ConnectionLike,
    redis_key: String,
    now: u64,
    args: &Args,
) -> Result<Outcome, StoreError> {
    let mut invocation = script.key(&redis_key);
    invocation.arg(&args.values(now)[..]);
    let reply: Vec<i64> = invocation
        .invoke_async(conn)
        .await
        .map_err(|e| map_error(e, redis_key))?;
    outcome(&reply)
}

/// One call's arguments, in the script's terms.
struct Args {
    op: Op,
    limit: Limit,
    /// The cost for acquire and refund, the deadline for drain.
    x: u64,
    max_wait: u64,
}

/// The script's operations, by the number it expects in `ARGV[1]`.
#[derive(Debug, Clone, Copy)]
enum Op {
    Acquire = 1,
    Peek = 2,
    Refund = 3,
    Drain = 4,
}

impl Args {
    /// `ARGV` as the script reads it.
    fn values(&self, now: u64) -> [u64; 7] {
        [
            self.op as u64,
            now,
            u64::from(self.limit.tokens()),
            self.limit.interval_ms(),
            u64::from(self.limit.burst()),
            self.x,
            self.max_wait,
        ]
    }
}

fn outcome(reply: &[i64]) -> Result<Outcome, StoreError> {
    let whole = |i: usize| reply.get(i).and_then(|&v| u64::try_from(v).ok());
    match (reply.len(), whole(0), whole(1), whole(2), whole(3)) {
        (4, Some(allowed), Some(wait), Some(remaining), Some(reset)) if allowed <= 1 => {
            Ok(Outcome {
                allowed: allowed == 1,
                wait,
                remaining,
                reset,
            })
        }
        _ => Err(StoreError::Backend(BackendError::new(
            "the bucket script answered something other than four whole numbers",
            None,
        ))),
    }
}

fn map_error(e: redis::RedisError, key: String) -> StoreError {
    if e.code() == Some("WRONGTYPE") {
        StoreError::WrongType { key }
    } else {
        StoreError::Backend(BackendError::new("redis call failed", Some(Box::new(e))))
    }
}

impl<C, K> BucketStore for RedisStore<C, K>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
    K: Clock,
{
    async fn acquire(
        &self,
        key: &BucketKey,
        limit: Limit,
        cost: u32,
        max_wait: Duration,
    ) -> Result<Decision, StoreError> {
        check_cost(&limit, cost)?;
        let max_wait = u64::try_from(max_wait.as_millis()).unwrap_or(u64::MAX);
        let args = Args {
            op: Op::Acquire,
            limit,
            x: u64::from(cost),
            max_wait,
        };
        Ok(Decision::new(self.run(key, args).await?, limit))
    }

    async fn peek(&self, key: &BucketKey, limit: Limit) -> Result<Quota, StoreError> {
        let args = Args {
            op: Op::Peek,
            limit,
            x: 0,
            max_wait: 0,
        };
        Ok(Quota::new(self.run(key, args).await?, limit))
    }

    async fn refund(&self, key: &BucketKey, limit: Limit, cost: u32) -> Result<(), StoreError> {
        check_cost(&limit, cost)?;
        let args = Args {
            op: Op::Refund,
            limit,
            x: u64::from(cost),
            max_wait: 0,
        };
        self.run(key, args).await.map(drop)
    }

    async fn drain_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> Result<(), StoreError> {
        let args = Args {
            op: Op::Drain,
            limit,
            x: deadline_ms(until),
            max_wait: 0,
        };
        self.run(key, args).await.map(drop)
    }
}

impl<C: Clone, K: Clone> Clone for RedisStore<C, K> {
    fn clone(&self) -> Self {
        Self {
            conn: self.conn.clone(),
            clock: self.clock.clone(),
            prefix: Arc::clone(&self.prefix),
        }
    }
}

impl<C, K: fmt::Debug> fmt::Debug for RedisStore<C, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The connection is left out: its type says nothing useful, and its address may carry a
        // password.
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("format", &FORMAT)
            .field("clock", &self.clock)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod differential;
