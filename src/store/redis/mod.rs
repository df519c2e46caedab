//! The shared store, on Redis.

use std::fmt;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use hashbrown::HashSet;
use redis::aio::ConnectionLike;
use redis::{Cmd, ErrorKind, RedisError, ServerErrorKind, Value};

use crate::bucket::{self, Outcome, Params, State};
use crate::clock::{Clock, SystemClock, deadline_ms, whole_ms};
use crate::store::{
    BackendError, BucketStore, Decision, MemoryStore, Quota, Reservation, Source, StoreError,
    check_cost,
};
use crate::{BucketKey, InvalidKey, Limit};

mod deny_cache;
mod outage;
mod reconnect;

use deny_cache::{Check, DenyCache};
use outage::Circuit;
pub use outage::{Breaker, OutagePolicy};
use reconnect::Reconnect;

/// The version of the stored format, part of every key: a change of the stored type moves to new
/// keys instead of meeting old values. 1 was a hash `{t, ts}` with decimal fields; 2 one 16-byte
/// string, `t` and `ts` as little-endian `f64`s; 3 is one 24-byte string, the same two numbers
/// and then the time until which the key is kept, or 32 bytes with a drain's halt after them.
/// The halt came later, in the same format: a 24-byte value reads as a bucket with no halt, as
/// it always did.
const FORMAT: u32 = 3;
/// What goes between the prefix and the bucket in every key: the format version.
const FORMAT_PART: &str = ":v3:";

/// The length of a stored value: three `f64`s, or four with a halt.
const STATE_LEN: usize = 24;
const HALTED_LEN: usize = 32;

const DEFAULT_PREFIX: &str = "burstgate";

/// How long a call may take by default before it counts as failed.
const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);

const SOURCE: &str = include_str!("bucket.lua");

/// The error code the script answers a stored value with that no script could have written.
const CORRUPT_CODE: &str = "BURSTGATE_CORRUPT";

/// The script, shared by every store in the process: its SHA-1 is computed once.
fn script() -> &'static redis::Script {
    static SCRIPT: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| redis::Script::new(SOURCE))
}

/// Buckets in Redis, shared by every process that reaches it.
///
/// Each bucket is one Redis string of 24 bytes: `t` (tokens available at `ts`), `ts`
/// (milliseconds since the Unix epoch) and `keep` (until when the key is kept, on the same
/// clock), each an IEEE 754 `f64`, little-endian, as Lua's `struct.pack('<ddd', t, ts, keep)`
/// writes them. After a drain the value is 32 bytes for a while, a fourth `f64` holding the
/// drain's halt (see [`Quota::halts`]); it goes back to 24 bytes with the first write once the
/// halt is further behind than the limit's refill time plus one interval. Builds from before the
/// halt refuse a 32-byte value as [`StoreError::WrongType`]: while old and new builds share a
/// Redis, the old ones fail (and send nothing) on buckets under a halt. One Lua script reads and
/// writes it, mirroring the
/// crate's reference arithmetic to the last bit. The script runs with `EVALSHA`; after a
/// `NOSCRIPT` (a restart, a failover, `SCRIPT FLUSH`) the call is repeated once as `EVAL` with
/// the script's source, which also loads it into that server's script cache. Both are routed by
/// the bucket's key like any other command; there is no `SCRIPT LOAD` sent to every node, so on
/// a cluster a node that is down cannot keep the script from loading on the others. The time is
/// the store's [`Clock`], passed to the script, never Redis's `TIME`.
///
/// A decision costs Redis one `GET`, and, when it admits (or refunds, or drains), one `SET` that
/// writes the state with its expiry; a plain denial writes nothing. The
/// raw bytes round-trip every `f64` exactly with no decimal formatting or parsing on either side,
/// which also spares Redis the conversions a hash of `%.17g` text (format 1) costs it; the
/// figures are in `docs/PERFORMANCE.md`, "Redis speed".
///
/// # Keys
///
/// `<prefix>:v3:<bucket>:<key>`, with the prefix `burstgate` unless set with
/// [`with_prefix`](Self::with_prefix), and the key escaped or hashed as [`BucketKey`] describes.
/// The `v3` is the stored format's version, so a bucket written by an earlier build (`v1`, a
/// hash, or `v2`, 16 bytes) is never read as this one: it is simply left alone and expires by
/// its own TTL. Every write keeps the key at least until the bucket is full again plus one
/// interval: when the stored `keep` already covers that, the write keeps the key's expiry
/// (`KEEPTTL`); otherwise it sets `keep` one interval further and the expiry to match (`PX`), so
/// that most writes leave Redis's expiry alone. An idle bucket expires, and the next call sees a
/// full bucket, which is what it would have computed anyway. A key under the prefix that holds
/// anything else (another type, or a string that is neither 24 nor 32 bytes) is reported as
/// [`StoreError::WrongType`], naming the key by its bucket and fingerprint.
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
/// [`RedisStore::connect`] opens a [`ConnectionManager`](redis::aio::ConnectionManager) set up
/// for this store: it reconnects in the background after a failure, retrying at least every
/// 200 ms, so decisions resume soon after Redis is back. The store also replaces that connection
/// with a new one to the same URL when Redis answers `READONLY` (a failover demoted the node,
/// and the connection would stay on it) and after 3 calls in a row time out (a peer that stopped
/// answering without closing the connection), so that behind an address that moves to the new
/// primary (a virtual IP, a DNS name) calls reach it. A connection handed to
/// [`new`](RedisStore::new) is used as it is. Its pipeline buffer of 8 calls, and how
/// to size your own, are in [`connect`](Self::connect)'s documentation.
///
/// # When Redis fails
///
/// Every call has a timeout, 250 ms unless set with [`with_timeout`](Self::with_timeout): a
/// decision that takes longer is not a decision a request should wait for. A call that fails
/// with an error Redis sends only for commands it did not run (`TRYAGAIN`, `MOVED`, `ASK`,
/// `CLUSTERDOWN`, `MASTERDOWN`, `LOADING`, `READONLY`, `BUSY`), or with a refused connection, is
/// retried once
/// within the same timeout. A call that times out or loses its connection may still have run, so
/// its tokens may be spent in Redis: the store does not refund them, since a refund of a call that
/// never ran would give away tokens nobody took. Counting them spent is the safe direction.
///
/// A [`Breaker`] watches the calls: after 3 failures in a row it opens for 500 ms, and calls are
/// answered at once instead of each waiting out the timeout; then one call probes, and the first
/// answer from Redis closes it. What a failed call, or a call while the circuit is open, answers
/// is the [`OutagePolicy`]: [`FailClosed`](OutagePolicy::FailClosed) by default (an error, so the
/// tower layer answers 503), [`FailOpen`](OutagePolicy::FailOpen), or
/// [`Local`](OutagePolicy::Local) buckets in this process with a share of the limit.
///
/// # Deny cache
///
/// When Redis denies, its answer carries the bucket's state, and the store keeps it: until that
/// state would admit, further requests for the bucket in this process are denied here with no
/// round trip, with the same `retry_after` Redis would give. When it would admit, the request
/// goes to Redis and the kept state is charged as Redis will charge it, so that the next token
/// draws one call to Redis, not one from every waiting request. Under a flood on one bucket
/// this takes nearly all requests off Redis: about one call per admitted request. It denies only what Redis would deny, with one exception,
/// the worst case: if another process refunds tokens to the bucket, or Redis loses it (a restart
/// without persistence, `FLUSHALL`), a request here may be denied that Redis would now admit, at
/// most until the `retry_after` of the denial that filled the cache. Refunds and drains made
/// through this store (or its clones) drop the cached state first. Turn it off with
/// [`with_deny_cache(false)`](Self::with_deny_cache). It holds at most 16,384 buckets.
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
    /// For a store that opened its own connection ([`RedisStore::connect`]): the connection in
    /// use, which replaces `conn` and is itself replaced after a failover or a dead peer.
    reconnect: Option<Arc<Reconnect<C>>>,
    clock: Arc<K>,
    prefix: Arc<str>,
    timeout: Duration,
    policy: OutagePolicy,
    circuit: Arc<Circuit>,
    /// Slots for calls in flight to Redis, shared by every clone and prefix.
    in_flight: Arc<tokio::sync::Semaphore>,
    deny: Option<Arc<DenyCache>>,
    /// The buckets of [`OutagePolicy::Local`], made whatever the policy: they cost nothing
    /// until used.
    local: MemoryStore<Arc<K>>,
    /// Keys this process admitted from its local buckets since Redis last decided on them: Redis
    /// refilled their buckets meanwhile, uncharged, and is drained before it decides on them
    /// again. At most as many as the local store holds buckets.
    touched: Arc<Mutex<HashSet<Box<str>>>>,
    /// When Redis last answered a decision, in milliseconds since the epoch: a key with no local
    /// bucket starts an outage empty as of then, as if its local bucket had been drained with
    /// every decision Redis made, without holding a local bucket for every key.
    last_answer: Arc<AtomicU64>,
}

/// The pipeline buffer of [`RedisStore::connect`]'s connection: two groups at 16 tasks, which is
/// where one group costs most (`docs/PERFORMANCE.md`, "Redis speed").
const CONNECT_PIPELINE_BUFFER: usize = 8;

/// Calls in flight to Redis at once, by default: see [`RedisStore::with_max_in_flight`].
const DEFAULT_MAX_IN_FLIGHT: usize = 128;

impl RedisStore<redis::aio::ConnectionManager, SystemClock> {
    /// Connects to the Redis at `url` (`redis://`, or `rediss://` with TLS) through a
    /// reconnecting [`ConnectionManager`](redis::aio::ConnectionManager): reconnection attempts
    /// at most 200 ms apart, a 1 s limit on each connection attempt, no response timeout of
    /// its own, since the store's [`with_timeout`](Self::with_timeout) bounds every call, and a
    /// pipeline buffer of 8 calls (redis-rs's default is 50), and redis-rs's own limit of calls
    /// awaiting an answer set to the store's default bound on calls in flight (128; see
    /// [`with_max_in_flight`](Self::with_max_in_flight)).
    ///
    /// The buffer is how many calls the connection takes in before it writes them to Redis in
    /// one go. Many tasks on one connection otherwise move as one group: Redis serves all their
    /// calls while the client waits, then the client turns all the answers into new calls while
    /// Redis waits. A buffer of about half the number of calls in flight splits them into two
    /// groups that Redis and the client serve in turn (`docs/PERFORMANCE.md`, "Redis speed", has
    /// the figures). For a known number of tasks, build the connection yourself with
    /// `set_pipeline_buffer_size(tasks / 2)` and hand it to [`new`](RedisStore::new).
    ///
    /// Fails when the URL is invalid or the first connection cannot be made.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let backend = |context| {
            move |e: RedisError| StoreError::Backend(BackendError::new(context, Some(Box::new(e))))
        };
        let client = redis::Client::open(url).map_err(backend("invalid Redis URL"))?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_min_delay(Duration::from_millis(20))
            .set_max_delay(Duration::from_millis(200))
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(None)
            .set_pipeline_buffer_size(CONNECT_PIPELINE_BUFFER)
            .set_concurrency_limit(DEFAULT_MAX_IN_FLIGHT);
        let open = move || {
            let (client, config) = (client.clone(), config.clone());
            Box::pin(redis::aio::ConnectionManager::new_with_config(
                client, config,
            ))
                as crate::store::BoxFuture<
                    'static,
                    Result<redis::aio::ConnectionManager, RedisError>,
                >
        };
        let conn = open()
            .await
            .map_err(backend("could not connect to Redis"))?;
        let reconnect = Reconnect::new(conn.clone(), Box::new(open));
        Ok(Self {
            reconnect: Some(Arc::new(reconnect)),
            ..Self::new(conn)
        })
    }
}

impl<C> RedisStore<C, SystemClock>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A store on `conn`, with the default prefix, the system clock, a 250 ms timeout, the
    /// default [`Breaker`], [`OutagePolicy::FailClosed`] and the deny cache on.
    pub fn new(conn: C) -> Self {
        let clock = Arc::new(SystemClock);
        Self {
            conn,
            reconnect: None,
            local: MemoryStore::with_clock(Arc::clone(&clock)),
            touched: Arc::default(),
            last_answer: Arc::default(),
            clock,
            prefix: Arc::from(DEFAULT_PREFIX),
            timeout: DEFAULT_TIMEOUT,
            policy: OutagePolicy::default(),
            circuit: Arc::new(Circuit::new(Breaker::default())),
            in_flight: Arc::new(tokio::sync::Semaphore::new(DEFAULT_MAX_IN_FLIGHT)),
            deny: Some(Arc::new(DenyCache::new())),
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
    ///
    /// The store that returns has a deny cache and [`OutagePolicy::Local`] buckets of its own
    /// (and its clones share them): the same [`BucketKey`] under two prefixes names two
    /// buckets. The connection, the circuit breaker and the bound on calls in flight stay
    /// shared, since they concern the one Redis behind both.
    pub fn with_prefix(self, prefix: &str) -> Result<Self, InvalidKey> {
        if !crate::key::is_name(prefix) {
            return Err(InvalidKey::Prefix);
        }
        // Caches of their own: they are keyed by bucket key, and another prefix's buckets are
        // other buckets.
        Ok(Self {
            prefix: Arc::from(prefix),
            deny: self.deny.as_ref().map(|_| Arc::new(DenyCache::new())),
            local: MemoryStore::with_clock(Arc::clone(&self.clock)),
            touched: Arc::default(),
            last_answer: Arc::default(),
            ..self
        })
    }

    /// Reads the time from `clock` instead of the system clock.
    #[must_use]
    pub fn with_clock<K2: Clock>(self, clock: K2) -> RedisStore<C, K2> {
        let clock = Arc::new(clock);
        RedisStore {
            conn: self.conn,
            reconnect: self.reconnect,
            local: MemoryStore::with_clock(Arc::clone(&clock)),
            touched: Arc::default(),
            last_answer: Arc::default(),
            clock,
            prefix: self.prefix,
            timeout: self.timeout,
            policy: self.policy,
            circuit: self.circuit,
            in_flight: self.in_flight,
            deny: self.deny,
        }
    }

    /// How long a call may take before it counts as failed (250 ms by default). The outcome of
    /// a call that timed out is unknown; its tokens may be spent.
    ///
    /// The timeout runs on tokio's timer, not on the store's [`Clock`]. Under tokio's paused
    /// time (`start_paused`), which jumps ahead whenever every task waits, a call waiting on a
    /// real Redis times out at once, as redis-rs's own timeouts do: test with paused time on
    /// [`MemoryStore`], and with real time on Redis.
    #[must_use]
    pub fn with_timeout(self, timeout: Duration) -> Self {
        Self { timeout, ..self }
    }

    /// What to answer when Redis fails or the circuit is open.
    #[must_use]
    pub fn on_outage(self, policy: OutagePolicy) -> Self {
        Self { policy, ..self }
    }

    /// When the circuit opens, and for how long. Starts closed. Its time is tokio's monotonic
    /// clock, not the store's [`Clock`]: a wall clock that steps back cannot hold it open, and
    /// under tokio's paused time it follows `tokio::time::advance`.
    #[must_use]
    pub fn with_breaker(self, breaker: Breaker) -> Self {
        Self {
            circuit: Arc::new(Circuit::new(breaker)),
            ..self
        }
    }

    /// At most `calls` calls to Redis in flight at once from this store and its clones (128 by
    /// default; at least 1). A call beyond waits for a slot within its
    /// [timeout](Self::with_timeout), and is answered [`StoreError::Unavailable`] without being
    /// sent if none frees up in time, with at least half its timeout left, or if the circuit
    /// opened while it waited. So a stalled Redis holds the calls in flight when it stalled, and
    /// the few that take their slots as they time out before the breaker opens (at most its
    /// `failures` more), whose tokens may be spent when it resumes; every other caller's tokens
    /// are left alone.
    ///
    /// [`connect`](RedisStore::connect)'s connection has redis-rs's own limit at 128: above
    /// that, calls queue inside redis-rs and may time out there, counting toward the breaker.
    ///
    /// Size it to the concurrency at which the connection gives most of its throughput: one
    /// multiplexed connection is limited by Redis itself well before 128 calls in flight, and
    /// more only lengthen the queue, and what a stall can spend.
    #[must_use]
    pub fn with_max_in_flight(self, calls: usize) -> Self {
        let calls = calls.clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
        Self {
            in_flight: Arc::new(tokio::sync::Semaphore::new(calls)),
            ..self
        }
    }

    /// Turns the local deny cache on (the default) or off.
    #[must_use]
    pub fn with_deny_cache(self, on: bool) -> Self {
        Self {
            deny: on.then(|| Arc::new(DenyCache::new())),
            ..self
        }
    }

    /// Whether the circuit breaker is open: Redis failed and calls are answered by the
    /// [`OutagePolicy`] without trying it.
    pub fn is_circuit_open(&self) -> bool {
        self.circuit.is_open()
    }

    /// The full Redis key of a bucket.
    pub fn redis_key(&self, key: &BucketKey) -> String {
        RedisKey {
            prefix: &self.prefix,
            key,
        }
        .to_string()
    }

    /// Runs the script for one bucket, through the circuit breaker and within the timeout.
    async fn run(&self, key: &BucketKey, now: u64, args: Args) -> Result<Reply, Failure> {
        let mut ticket = match self.circuit.pass() {
            Ok(ticket) => ticket,
            Err(retry_in) => {
                // Answered without waiting on anything: spend tokio's budget, so that a loop of
                // such calls still lets other tasks run.
                tokio::task::coop::consume_budget().await;
                return Err(Failure::Outage(StoreError::Unavailable { retry_in }));
            }
        };
        ticket.stalls_after(self.timeout / 2);
        // A slot among the calls in flight. Taken before anything is sent, so that a caller who
        // gives up while waiting for one leaves nothing queued to run later.
        let mut timeout = self.timeout;
        let _slot = match self.in_flight.try_acquire() {
            Ok(slot) => slot,
            Err(_) => {
                let waited = tokio::time::Instant::now();
                let slot = tokio::time::timeout(timeout, self.in_flight.acquire()).await;
                timeout = timeout.saturating_sub(waited.elapsed());
                match slot {
                    // Sent only with at least half its timeout left, so that a call Redis runs
                    // is one its caller still waits for; and, but for the probe, only while the
                    // circuit is closed: calls ahead of this one failed meanwhile (a stalled
                    // Redis), and what was queued behind them is not sent into the same stall.
                    Ok(Ok(slot))
                        if timeout >= self.timeout / 2
                            && (ticket.is_probe() || !self.circuit.is_open()) =>
                    {
                        slot
                    }
                    _ => {
                        return Err(Failure::Outage(StoreError::Unavailable {
                            retry_in: self.timeout,
                        }));
                    }
                }
            }
        };
        let redis_key = RedisKey {
            prefix: &self.prefix,
            key,
        };
        let call = async {
            let mut conn = match &self.reconnect {
                Some(reconnect) => reconnect.current(),
                None => self.conn.clone(),
            };
            match invoke(&mut conn, redis_key, now, &args).await {
                Err(e) if not_executed(&e) => invoke(&mut conn, redis_key, now, &args).await,
                done => done,
            }
        };
        // Dropped here with the rest of this future if the caller goes away: a probe's ticket
        // then counts as a failure, and the circuit is never left waiting for it.
        let result = tokio::time::timeout(timeout, call).await;
        if let Some(reconnect) = &self.reconnect {
            match &result {
                // Retried once already: the node was demoted to a replica (a failover), and the
                // connection stays on it unless replaced.
                Ok(Err(e)) if e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly) => {
                    reconnect.replace("redis answered READONLY: the node is a replica now");
                }
                Ok(_) => reconnect.answered(),
                Err(_) => reconnect.timed_out(),
            }
        }
        match result {
            Ok(Ok(value)) => {
                ticket.success();
                parse_reply(&value, &args, now).map_err(Failure::Fatal)
            }
            Ok(Err(e)) if e.code() == Some("WRONGTYPE") => {
                // Redis answered: it is up, the data is wrong.
                ticket.success();
                Err(Failure::Fatal(StoreError::WrongType {
                    bucket: key.bucket().to_owned(),
                    fingerprint: key.fingerprint(),
                }))
            }
            Ok(Err(e)) if e.code() == Some(CORRUPT_CODE) => {
                ticket.success();
                Err(Failure::Fatal(StoreError::CorruptBucket {
                    bucket: key.bucket().to_owned(),
                    fingerprint: key.fingerprint(),
                }))
            }
            Ok(Err(e)) if is_redirect(&e) => {
                // A slot on the move: the nodes are up and answering. The call failed, but this
                // is no outage, and must not open the circuit for every key.
                ticket.success();
                Err(Failure::Outage(StoreError::Backend(BackendError::new(
                    "redis call redirected while a cluster slot moved",
                    Some(Box::new(e)),
                ))))
            }
            Ok(Err(e)) if about_the_call(&e) => {
                // Redis answered about this call (the script failed on this key's value): the
                // server is up and other keys are unaffected.
                ticket.success();
                Err(Failure::Fatal(StoreError::Backend(BackendError::new(
                    "redis refused the bucket script's call",
                    Some(Box::new(e)),
                ))))
            }
            Ok(Err(e)) => {
                ticket.failure(&e);
                Err(Failure::Outage(StoreError::Backend(BackendError::new(
                    "redis call failed",
                    Some(Box::new(e)),
                ))))
            }
            Err(_) => {
                let error = StoreError::Timeout {
                    after: self.timeout,
                };
                ticket.failure(&error);
                Err(Failure::Outage(error))
            }
        }
    }

    /// The limit of this process's local bucket under [`OutagePolicy::Local`], or `None` when
    /// the policy is another, or the share would hold no token.
    fn local_limit(&self, limit: Limit) -> Option<Limit> {
        let OutagePolicy::Local { processes } = self.policy else {
            return None;
        };
        share(limit, processes)
    }
}

/// A limit's share for one of `processes`: the same tokens over `processes` times the interval,
/// and the burst divided (rounded down). `None` when the share holds no whole token, or its
/// interval is out of range.
fn share(limit: Limit, processes: NonZeroU32) -> Option<Limit> {
    let n = processes.get();
    if n == 1 {
        return Some(limit);
    }
    let interval = limit.interval().checked_mul(n)?;
    Limit::new(limit.tokens(), interval)
        .and_then(|l| l.with_burst(limit.burst() / n))
        .ok()
}

/// Why [`RedisStore::run`] has no answer.
enum Failure {
    /// Redis failed, did not answer in time, or the circuit is open: the policy decides.
    Outage(StoreError),
    /// Redis answered, and the answer is an error: returned as it is.
    Fatal(StoreError),
}

/// A bucket's Redis key, written straight into the command with no string of its own.
#[derive(Clone, Copy)]
struct RedisKey<'a> {
    prefix: &'a str,
    key: &'a BucketKey,
}

impl RedisKey<'_> {
    fn parts(&self) -> [&str; 3] {
        [self.prefix, FORMAT_PART, self.key.as_str()]
    }
}

impl fmt::Display for RedisKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.parts().iter().try_for_each(|part| f.write_str(part))
    }
}

/// Errors Redis returns only for commands it did not run, and a connection that was refused:
/// a retry cannot spend tokens twice. A cluster connection follows `MOVED` and `ASK` itself, but
/// can still return one when a slot moves again while it follows the first.
fn not_executed(e: &RedisError) -> bool {
    e.is_connection_refusal()
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::TryAgain
                    | ServerErrorKind::Moved
                    | ServerErrorKind::Ask
                    | ServerErrorKind::ClusterDown
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::BusyLoading
                    | ServerErrorKind::ReadOnly
            )
        )
        || e.code() == Some("BUSY")
}

/// An error the bucket script raised while it ran on one key (such as a `SET` the value at this
/// key made fail): it concerns that key's data, so it must not count toward the circuit breaker,
/// which would then refuse every key. Any other `ERR` (scripting disabled, a proxy that refuses
/// the command) concerns every key and counts.
fn about_the_call(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
        // Redis names the script's own line in the error: "... script: <sha>, on
        // @user_script:84." (7.0), "Error running script (...): @user_script:84: ..." (6.x).
        && e.detail().is_some_and(|d| d.contains("@user_script"))
}

/// Cluster redirections that a cluster connection gave up following: the slot is moving.
fn is_redirect(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Server(
            ServerErrorKind::Moved | ServerErrorKind::Ask | ServerErrorKind::TryAgain
        )
    )
}

/// Runs the script for one bucket: `EVALSHA`, and after `NOSCRIPT` the same call as `EVAL`. The
/// store and the differential test share this, so the test encodes arguments exactly as the store
/// does.
async fn invoke(
    conn: &mut impl ConnectionLike,
    redis_key: RedisKey<'_>,
    now: u64,
    args: &Args,
) -> Result<Value, RedisError> {
    let packed = args.pack(now);
    let sha = script().get_hash();
    match command("EVALSHA", sha, redis_key, &packed)
        .query_async(conn)
        .await
    {
        Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            command("EVAL", SOURCE, redis_key, &packed)
                .query_async(conn)
                .await
        }
        done => done,
    }
}

/// One script call, built in one buffer sized for it.
fn command(name: &str, script: &str, redis_key: RedisKey<'_>, packed: &[u8; PACKED_ARGS]) -> Cmd {
    // The key is at most 64 + 4 + 64 + 1 + 128 bytes.
    let mut cmd = Cmd::with_capacity(5, name.len() + script.len() + 1 + 270 + PACKED_ARGS);
    cmd.arg(name)
        .arg(script)
        .arg(1)
        .arg(redis_key_arg(redis_key))
        .arg(&packed[..]);
    cmd
}

/// The key as a command argument, formatted into the command's buffer.
fn redis_key_arg(key: RedisKey<'_>) -> impl redis::ToRedisArgs + '_ {
    struct Arg<'a>(RedisKey<'a>);
    impl redis::ToRedisArgs for Arg<'_> {
        fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
            let mut arg = out.writer_for_next_arg();
            for part in self.0.parts() {
                // Writing to the command's own buffer cannot fail.
                let _ = std::io::Write::write_all(&mut arg, part.as_bytes());
            }
        }
    }
    Arg(key)
}

/// One call's arguments, in the script's terms.
#[derive(Clone, Copy)]
struct Args {
    op: Op,
    limit: Limit,
    /// The cost for acquire and refund, the deadline for drain.
    x: u64,
    max_wait: u64,
}

/// The script's operations, by the first number packed into `ARGV[1]`.
#[derive(Debug, Clone, Copy)]
enum Op {
    Acquire = 1,
    Peek = 2,
    Refund = 3,
    Drain = 4,
}

/// The script's one argument: nine little-endian `f64`s.
const PACKED_ARGS: usize = 9 * 8;

impl Args {
    /// `ARGV[1]` as the script unpacks it: op, now, tokens, interval, capacity, x, max_wait, and
    /// the limit's lead bound and most debt, which the arithmetic derives from the limit and the
    /// script takes as they are rather than work out on every call. Every whole value below 2^53
    /// is exact; a larger one rounds to the nearest double, the one Lua's own parsing of the
    /// decimal number would give, and the script clamps it.
    fn pack(&self, now: u64) -> [u8; PACKED_ARGS] {
        let p = self.limit.params();
        let values = [
            self.op as u64 as f64,
            now as f64,
            p.tokens,
            p.interval,
            p.capacity,
            self.x as f64,
            self.max_wait as f64,
            p.lead(),
            p.most_debt(),
        ];
        let mut packed = [0; PACKED_ARGS];
        for (chunk, v) in packed.chunks_exact_mut(8).zip(values) {
            chunk.copy_from_slice(&v.to_le_bytes());
        }
        packed
    }
}

/// What the script answered.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Reply {
    outcome: Outcome,
    /// The bucket's state as the script left it, where the reply carries it: with a denial, the
    /// state it denied on (and left alone); with an admission with no wait, the state it stored.
    state: Option<State>,
    /// For a peek, the bucket's halt (0 for none).
    halt: u64,
}

/// The script's reply to a call made with `args` at `now`. After an acquire admitted with no
/// wait, the 24- or 32-byte value the script stored, from which the outcome follows by the same
/// arithmetic. Otherwise `allowed, wait, remaining, reset, at` as five little-endian `f64`s holding
/// whole numbers, then after a denial the stored value, after a peek the halt.
fn parse_reply(value: &Value, args: &Args, now: u64) -> Result<Reply, StoreError> {
    let bad = || {
        StoreError::Backend(BackendError::new(
            "the bucket script answered something other than a bucket's decision",
            None,
        ))
    };
    let bytes = match value {
        Value::BulkString(bytes) => bytes,
        Value::Array(items) => return parse_denial(items, args, now).ok_or_else(bad),
        _ => return Err(bad()),
    };
    if bytes.len() == STATE_LEN || bytes.len() == HALTED_LEN {
        let p = args.limit.params();
        let state = decode(bytes).ok_or_else(bad)?;
        // What a plain admission can store: no debt, and the later of the stored time and now.
        // Checked, since the walk to the refill time assumes it.
        let sound = matches!(args.op, Op::Acquire)
            && state.t >= 0.0
            && state.ts >= bucket::time(now)
            && storable(&p, state);
        if !sound {
            return Err(bad());
        }
        return Ok(Reply {
            outcome: bucket::write(&p, state.t, state.ts).outcome(),
            state: Some(state),
            halt: 0,
        });
    }
    let (numbers, rest) = bytes.split_first_chunk::<40>().ok_or_else(bad)?;
    let mut whole = [0u64; 5];
    for (w, chunk) in whole.iter_mut().zip(numbers.chunks_exact(8)) {
        let mut b = [0; 8];
        b.copy_from_slice(chunk);
        *w = to_whole(f64::from_le_bytes(b)).ok_or_else(bad)?;
    }
    let [allowed, wait, remaining, reset, at] = whole;
    if allowed > 1 {
        return Err(bad());
    }
    let peek = matches!(args.op, Op::Peek);
    let (state, halt) = match rest.len() {
        0 if !peek => (None, 0),
        8 if peek => {
            let mut b = [0; 8];
            b.copy_from_slice(rest);
            let halt = f64::from_le_bytes(b);
            if !bucket::sound_halt(halt) {
                return Err(bad());
            }
            (None, to_whole(halt).ok_or_else(bad)?)
        }
        STATE_LEN | HALTED_LEN if !peek => match decode(rest) {
            Some(state) if storable(&args.limit.params(), state) => (Some(state), 0),
            _ => return Err(bad()),
        },
        _ => return Err(bad()),
    };
    Ok(Reply {
        outcome: Outcome {
            allowed: allowed == 1,
            wait,
            remaining,
            reset,
            at,
        },
        state,
        halt,
    })
}

/// The reply to an acquire the script denied with no wait allowed: the stored value it read,
/// alone in an array. The denial is worked out here from that value, by the arithmetic the
/// script mirrors; `None` for anything else, including a value on which the arithmetic would
/// not deny.
fn parse_denial(items: &[Value], args: &Args, now: u64) -> Option<Reply> {
    let [Value::BulkString(bytes)] = items else {
        return None;
    };
    if !matches!(args.op, Op::Acquire) || args.max_wait != 0 {
        return None;
    }
    let p = args.limit.params();
    let state = decode(bytes).filter(|&s| storable(&p, s))?;
    // A denial never writes, so the outcome alone says whether the arithmetic agrees.
    let (outcome, _) = bucket::evaluate(&p, Some(state), now, args.x as f64, 0);
    (!outcome.allowed).then_some(Reply {
        outcome,
        state: Some(state),
        halt: 0,
    })
}

/// Whether the script can have stored `state` for a limit of `p`, and at most full: the script
/// refuses any other value it reads, and the deny cache takes no other from a reply.
fn storable(p: &Params, state: State) -> bool {
    bucket::sound(p, state) && state.t <= p.capacity
}

/// `v` as a `u64`, when it is a whole number the script can answer: at least 0 and below 2^63.
fn to_whole(v: f64) -> Option<u64> {
    // The range check also turns away NaN and the infinities.
    const TWO_TO_63: f64 = 9_223_372_036_854_775_808.0;
    if (0.0..TWO_TO_63).contains(&v) && v.fract() == 0.0 {
        Some(v as u64)
    } else {
        None
    }
}

/// A stored value, as the script writes it: `t`, `ts` and `keep`, each an `f64`,
/// little-endian, and perhaps a halt. `keep` concerns the key's expiry only, and the halt only
/// a peek (which the script answers itself), so the state leaves them out.
fn decode(value: &[u8]) -> Option<State> {
    let (t, ts) = match value.as_chunks::<8>() {
        ([t, ts, _keep], []) | ([t, ts, _keep, _], []) => (t, ts),
        _ => return None,
    };
    Some(State {
        t: f64::from_le_bytes(*t),
        ts: f64::from_le_bytes(*ts),
    })
}

/// The halt of a stored value: its fourth `f64`, or 0 for a value of three.
#[cfg(test)]
fn decode_halt(value: &[u8]) -> Option<f64> {
    match value.as_chunks::<8>() {
        ([_, _, _], []) => Some(0.0),
        ([_, _, _, halt], []) => Some(f64::from_le_bytes(*halt)),
        _ => None,
    }
}

impl<C, K> RedisStore<C, K>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
    K: Clock,
{
    /// Under [`OutagePolicy::Local`], one budget across the switches between Redis and the local
    /// bucket, with the local bucket kept empty while Redis decides (in `acquire`): Redis's
    /// bucket is emptied before its first decision on a key this process admitted locally since,
    /// as its refill meanwhile was this process's to spend, and was spent here. In the safe
    /// direction: what Redis could still have admitted is lost, never given twice.
    async fn charge_for_local_admissions(&self, key: &BucketKey, limit: Limit, now: u64) {
        let touched = self
            .touched
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(key.as_str());
        if touched {
            let drain = Args {
                op: Op::Drain,
                limit,
                x: now,
                max_wait: 0,
            };
            if self.run(key, now, drain).await.is_err() {
                // Still out of reach: the next call tries again.
                self.touched
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(key.as_str().into());
            }
        }
    }

    /// The answer under the policy when Redis could not give one.
    async fn acquire_in_outage(
        &self,
        error: StoreError,
        key: &BucketKey,
        limit: Limit,
        cost: u32,
        max_wait: Duration,
    ) -> Result<Decision, StoreError> {
        match self.policy {
            OutagePolicy::FailClosed => Err(error),
            OutagePolicy::FailOpen => {
                if !matches!(error, StoreError::Unavailable { .. }) {
                    tracing::warn!(
                        target: "burstgate::redis",
                        key = %key.fingerprint(),
                        %error,
                        "redis failed: admitting (fail open)"
                    );
                }
                let outcome = Outcome {
                    allowed: true,
                    wait: 0,
                    remaining: 0,
                    reset: 0,
                    at: self.clock.now_ms().min(bucket::MAX_TIME),
                };
                // No bucket gave these tokens, so a refund of them gives nothing back.
                Ok(Decision::from(outcome, limit, cost, Source::Nothing))
            }
            OutagePolicy::Local { .. } => match self.local_limit(limit) {
                Some(local) if cost <= local.burst() => {
                    // A key with no local bucket starts empty as of Redis's last answer.
                    let last = self.last_answer.load(Ordering::Relaxed);
                    self.local.seed_empty(key, local, last)?;
                    // Every key admitted here must be remembered, for Redis to be charged when
                    // it is back: past the bound, a new key gets the outage's error, the
                    // fail-closed answer, rather than tokens nobody would charge. (Calls racing
                    // past the check can pass the bound by as many as run at once.)
                    let full = {
                        let touched = self.touched.lock().unwrap_or_else(PoisonError::into_inner);
                        touched.len() >= self.local.max_buckets() && !touched.contains(key.as_str())
                    };
                    if full {
                        return Err(error);
                    }
                    let d = self.local.acquire(key, local, cost, max_wait).await?;
                    if d.is_admitted() {
                        self.touched
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .insert(key.as_str().into());
                    }
                    // Reported under the limit the caller gave, for headers and the like, and
                    // refunded to the local bucket that gave the tokens.
                    let reservation = Reservation {
                        source: Source::Local,
                        ..d.reservation
                    };
                    Ok(Decision {
                        limit,
                        reservation,
                        ..d
                    })
                }
                _ => Err(error),
            },
        }
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
        let cost_f = check_cost(&limit, cost)?;
        let max_wait_ms = whole_ms(max_wait);
        let now = self.clock.now_ms();
        let mut predicted = None;
        // Drops the entry if this call goes away before Redis answers: it took the cost ahead of
        // Redis, which may never see the call.
        let mut charged = None;
        if let Some(cache) = &self.deny {
            match cache.check(key, limit, now, cost_f, max_wait_ms) {
                Check::Deny(outcome) => {
                    tokio::task::coop::consume_budget().await;
                    return Ok(Decision::new(outcome, limit, cost));
                }
                Check::Pass(prediction) => {
                    predicted = prediction;
                    charged = prediction.map(|_| cache.forget_on_drop(key));
                }
            }
        }
        let local = self.local_limit(limit);
        if local.is_some() {
            self.charge_for_local_admissions(key, limit, now).await;
        }
        let args = Args {
            op: Op::Acquire,
            limit,
            x: u64::from(cost),
            max_wait: max_wait_ms,
        };
        match self.run(key, now, args).await {
            Ok(reply) => {
                if let Some(local) = local {
                    // Redis decides: the local bucket is kept empty meanwhile, so that the next
                    // outage starts from nothing rather than from what refilled since the last.
                    // Only a bucket the local store holds is drained; one it does not hold
                    // starts the outage empty as of this answer (`last_answer`).
                    self.last_answer.fetch_max(now, Ordering::Relaxed);
                    self.local.drain_held(key, local, now);
                }
                if let Some(cache) = &self.deny {
                    match (reply.outcome.allowed, reply.state) {
                        (false, Some(state)) => cache.remember(key, limit, state, now),
                        // What Redis holds, for an entry that charged this call: the cache then
                        // follows Redis from the first call it lets through, even when something
                        // raised the bucket there meanwhile (another process's refund, a flush).
                        (true, Some(state)) if predicted.is_some() => cache.refresh(key, state),
                        (true, None) if predicted.is_some_and(|p| p != reply.outcome) => {
                            cache.forget(key);
                        }
                        _ => {}
                    }
                }
                if let Some(charged) = charged {
                    charged.disarm();
                }
                Ok(Decision::new(reply.outcome, limit, cost))
            }
            Err(failure) => {
                // The cache may hold this call's cost taken; Redis may not have taken it.
                if let Some(cache) = &self.deny {
                    cache.forget(key);
                }
                match failure {
                    Failure::Fatal(e) => Err(e),
                    Failure::Outage(e) => {
                        self.acquire_in_outage(e, key, limit, cost, max_wait).await
                    }
                }
            }
        }
    }

    async fn peek(&self, key: &BucketKey, limit: Limit) -> Result<Quota, StoreError> {
        let args = Args {
            op: Op::Peek,
            limit,
            x: 0,
            max_wait: 0,
        };
        match self.run(key, self.clock.now_ms(), args).await {
            Ok(reply) => Ok(Quota::new(reply.outcome, limit).with_halt(reply.halt)),
            Err(Failure::Fatal(e)) => Err(e),
            Err(Failure::Outage(e)) => match self.local_limit(limit) {
                Some(local) => {
                    let q = self.local.peek(key, local).await?;
                    Ok(Quota {
                        capacity: limit.burst(),
                        ..q
                    })
                }
                None => Err(e),
            },
        }
    }

    async fn refund(
        &self,
        key: &BucketKey,
        limit: Limit,
        reservation: Reservation,
    ) -> Result<(), StoreError> {
        let cost = reservation.cost();
        check_cost(&limit, cost)?;
        // Back to the bucket that gave the tokens, whichever answers now.
        match reservation.source() {
            Source::Nothing => return Ok(()),
            Source::Local => {
                return match self.local_limit(limit) {
                    Some(local) if cost <= local.burst() => {
                        self.local.refund(key, local, reservation).await
                    }
                    _ => Ok(()),
                };
            }
            Source::Store => {}
        }
        if let Some(cache) = &self.deny {
            cache.forget(key);
        }
        let args = Args {
            op: Op::Refund,
            limit,
            x: u64::from(cost),
            max_wait: reservation.ready_at_ms(),
        };
        match self.run(key, self.clock.now_ms(), args).await {
            Ok(_) => Ok(()),
            // Redis gave the tokens; a local bucket did not, and gets nothing.
            Err(Failure::Fatal(e) | Failure::Outage(e)) => Err(e),
        }
    }

    async fn drain_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> Result<(), StoreError> {
        if let Some(cache) = &self.deny {
            cache.forget(key);
        }
        let args = Args {
            op: Op::Drain,
            limit,
            x: deadline_ms(until),
            max_wait: 0,
        };
        match self.run(key, self.clock.now_ms(), args).await {
            Ok(_) => Ok(()),
            Err(Failure::Fatal(e)) => Err(e),
            Err(Failure::Outage(e)) => match self.local_limit(limit) {
                Some(local) => self.local.drain_until(key, local, until).await,
                None => Err(e),
            },
        }
    }
}

impl<C: Clone, K> Clone for RedisStore<C, K> {
    fn clone(&self) -> Self {
        Self {
            conn: self.conn.clone(),
            reconnect: self.reconnect.clone(),
            clock: Arc::clone(&self.clock),
            prefix: Arc::clone(&self.prefix),
            timeout: self.timeout,
            policy: self.policy,
            circuit: Arc::clone(&self.circuit),
            in_flight: Arc::clone(&self.in_flight),
            deny: self.deny.clone(),
            local: self.local.clone(),
            touched: Arc::clone(&self.touched),
            last_answer: Arc::clone(&self.last_answer),
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
            .field("timeout", &self.timeout)
            .field("policy", &self.policy)
            .field("breaker", &self.circuit.config())
            .field("circuit_open", &self.circuit.is_open())
            .field("deny_cache", &self.deny.is_some())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod differential;

#[cfg(test)]
mod reply_tests {
    use super::*;

    fn packed(numbers: [f64; 5], tail: &[u8]) -> Value {
        let mut bytes: Vec<u8> = numbers.iter().flat_map(|v| v.to_le_bytes()).collect();
        bytes.extend_from_slice(tail);
        Value::BulkString(bytes)
    }

    const NOW: u64 = 1_700_000_000_000;

    /// An acquire of 1 on 10 per second, burst 10.
    fn acquire() -> Args {
        Args {
            op: Op::Acquire,
            limit: Limit::per_second(10).expect("a limit"),
            x: 1,
            max_wait: 0,
        }
    }

    /// Whether the reply to a call made with `args` at `NOW` is refused as a backend error.
    fn refused(value: &Value, args: &Args) -> bool {
        matches!(parse_reply(value, args, NOW), Err(StoreError::Backend(_)))
    }

    fn state(t: f64, ts: f64) -> Value {
        let keep = ts + 60_000.0;
        Value::BulkString([t.to_le_bytes(), ts.to_le_bytes(), keep.to_le_bytes()].concat())
    }

    #[test]
    fn an_admission_with_no_wait_is_worked_out_from_the_state_it_stored() {
        // 9.5 tokens stored at now: 9 whole left, and the half token missing refills in 50 ms.
        let admit = parse_reply(&state(9.5, NOW as f64), &acquire(), NOW).expect("parses");
        let expected = Outcome {
            allowed: true,
            wait: 0,
            remaining: 9,
            reset: 50,
            at: NOW,
        };
        assert_eq!(
            admit,
            Reply {
                outcome: expected,
                state: Some(State {
                    t: 9.5,
                    ts: NOW as f64
                }),
                halt: 0,
            }
        );
        // Stored ahead of this process's clock (another's ran ahead): reset counts from the
        // stored time, where this caller is taken to stand.
        let ahead = parse_reply(&state(10.0, (NOW + 30) as f64), &acquire(), NOW).expect("parses");
        assert_eq!(ahead.outcome.reset, 0);
        assert_eq!(ahead.outcome.remaining, 10);
    }

    #[test]
    fn a_stored_state_no_plain_admission_could_leave_is_a_backend_error() {
        let bad = [
            state(-0.5, NOW as f64),
            state(10.5, NOW as f64),
            state(f64::NAN, NOW as f64),
            state(-f64::INFINITY, NOW as f64),
            state(1.0, (NOW - 1) as f64),
            state(1.0, NOW as f64 + 0.5),
            state(1.0, f64::INFINITY),
            state(1.0, 9_007_199_254_740_992.0),
        ];
        for value in bad {
            assert!(refused(&value, &acquire()), "{value:?}");
        }
        // A denial's stored value must be one the script could have written.
        for (t, ts) in [
            (-1e300, NOW as f64),
            (f64::NAN, NOW as f64),
            (11.0, NOW as f64),
            (1.0, -1.0),
            (1.0, 0.5),
        ] {
            let Value::BulkString(carried) = state(t, ts) else {
                unreachable!("state() makes a bulk string")
            };
            let denial = packed([0.0, 100.0, 0.0, 100.0, NOW as f64], &carried);
            assert!(refused(&denial, &acquire()), "{t} {ts}");
        }
        // Only an acquire answers with the state alone.
        let peek = Args {
            op: Op::Peek,
            ..acquire()
        };
        assert!(refused(&state(1.0, NOW as f64), &peek));
    }

    #[test]
    fn an_admission_and_a_denial_with_its_state_parse() {
        let admit = parse_reply(
            &packed([1.0, 0.0, 9.0, 1500.0, NOW as f64], b""),
            &acquire(),
            NOW,
        )
        .expect("parses");
        assert_eq!(
            admit,
            Reply {
                outcome: Outcome {
                    allowed: true,
                    wait: 0,
                    remaining: 9,
                    reset: 1500,
                    at: NOW
                },
                state: None,
                halt: 0,
            }
        );
        let mut state = 0.25f64.to_le_bytes().to_vec();
        state.extend_from_slice(&1_700_000_000_123f64.to_le_bytes());
        state.extend_from_slice(&1_700_003_600_123f64.to_le_bytes());
        let deny = parse_reply(
            &packed(
                [0.0, 250.0, 0.0, 9_007_199_254_740_991.0, NOW as f64],
                &state,
            ),
            &acquire(),
            NOW,
        )
        .expect("parses");
        assert!(!deny.outcome.allowed);
        assert_eq!(deny.outcome.wait, 250);
        assert_eq!(deny.outcome.reset, 9_007_199_254_740_991);
        assert_eq!(
            deny.state,
            Some(State {
                t: 0.25,
                ts: 1_700_000_000_123.0
            })
        );
    }

    /// The stored value alone, in an array: a denial with no wait allowed.
    fn denial_of(t: f64, ts: f64) -> Value {
        Value::Array(vec![state(t, ts)])
    }

    #[test]
    fn a_denial_with_no_wait_is_worked_out_from_the_value_it_read() {
        // 0.25 tokens at now, 10 per second: the missing 0.75 refill in 75 ms, the rest of the
        // bucket (9.75) in 975 ms.
        let deny = parse_reply(&denial_of(0.25, NOW as f64), &acquire(), NOW).expect("parses");
        assert_eq!(
            deny,
            Reply {
                outcome: Outcome {
                    allowed: false,
                    wait: 75,
                    remaining: 0,
                    reset: 975,
                    at: NOW
                },
                state: Some(State {
                    t: 0.25,
                    ts: NOW as f64
                }),
                halt: 0,
            }
        );
        // In debt from a reservation, stored ahead of this process's clock: counted from the
        // stored time.
        let deny =
            parse_reply(&denial_of(-2.0, (NOW + 40) as f64), &acquire(), NOW).expect("parses");
        assert_eq!((deny.outcome.wait, deny.outcome.reset), (300, 1200));
    }

    #[test]
    fn a_value_the_arithmetic_would_not_deny_on_is_a_backend_error() {
        // A whole token stored: an acquire of 1 goes now, so no script denies on it.
        assert!(refused(&denial_of(1.0, NOW as f64), &acquire()));
        // Nor after a stored time long enough ago to refill one.
        assert!(refused(&denial_of(0.0, (NOW - 100) as f64), &acquire()));
        // Only an acquire that may not wait is denied this way.
        let waits = Args {
            max_wait: 1,
            ..acquire()
        };
        assert!(refused(&denial_of(0.0, NOW as f64), &waits));
        let peek = Args {
            op: Op::Peek,
            ..acquire()
        };
        assert!(refused(&denial_of(0.0, NOW as f64), &peek));
        // A value no script could have stored, or not a value at all.
        for bad in [
            denial_of(-1e300, NOW as f64),
            denial_of(0.0, NOW as f64 + 0.5),
            Value::Array(vec![]),
            Value::Array(vec![state(0.0, NOW as f64), state(0.0, NOW as f64)]),
            Value::Array(vec![Value::BulkString(vec![0; 16])]),
            Value::Array(vec![Value::Nil]),
        ] {
            assert!(refused(&bad, &acquire()), "{bad:?}");
        }
    }

    #[test]
    fn a_halted_value_and_a_peek_with_its_halt_parse() {
        // An admission's stored value with a halt after it: the state is the same.
        let Value::BulkString(mut bytes) = state(9.5, NOW as f64) else {
            unreachable!("state() makes a bulk string")
        };
        bytes.extend_from_slice(&((NOW + 2_000) as f64).to_le_bytes());
        assert_eq!(decode_halt(&bytes), Some((NOW + 2_000) as f64));
        let admit =
            parse_reply(&Value::BulkString(bytes.clone()), &acquire(), NOW).expect("parses");
        assert_eq!(admit.state.map(|s| s.t), Some(9.5));
        // A denial carrying it.
        let denial = Value::Array(vec![Value::BulkString(bytes)]);
        assert!(
            parse_reply(&denial, &acquire(), NOW).is_err(),
            "9.5 tokens admit"
        );
        let peek = Args {
            op: Op::Peek,
            ..acquire()
        };
        let halt = ((NOW + 2_000) as f64).to_le_bytes();
        let reply = parse_reply(
            &packed([0.0, 100.0, 0.0, 1000.0, NOW as f64], &halt),
            &peek,
            NOW,
        )
        .expect("parses");
        assert_eq!(reply.halt, NOW + 2_000);
        // A peek always carries a halt, whole and in range; nothing else carries one.
        for bad in [
            packed([0.0, 100.0, 0.0, 1000.0, NOW as f64], b""),
            packed([0.0, 100.0, 0.0, 1000.0, NOW as f64], &0.5f64.to_le_bytes()),
            packed(
                [0.0, 100.0, 0.0, 1000.0, NOW as f64],
                &(-1.0f64).to_le_bytes(),
            ),
            packed(
                [0.0, 100.0, 0.0, 1000.0, NOW as f64],
                &f64::NAN.to_le_bytes(),
            ),
        ] {
            assert!(refused(&bad, &peek), "{bad:?}");
        }
        assert!(refused(
            &packed([1.0, 0.0, 9.0, 1500.0, NOW as f64], &halt),
            &acquire()
        ));
    }

    #[test]
    fn the_key_written_into_a_command_is_the_key_named() {
        assert_eq!(FORMAT_PART, format!(":v{FORMAT}:"));
        let key = BucketKey::new("orders", "seller:{7}").expect("a key");
        let redis_key = RedisKey {
            prefix: "app",
            key: &key,
        };
        let cmd = command("EVALSHA", "sha", redis_key, &[7; PACKED_ARGS]);
        let args: Vec<&[u8]> = cmd
            .args_iter()
            .map(|arg| match arg {
                redis::Arg::Simple(bytes) => bytes,
                _ => b"<not a plain argument>",
            })
            .collect();
        let named = redis_key.to_string();
        assert_eq!(
            args,
            [
                b"EVALSHA".as_slice(),
                b"sha",
                b"1",
                named.as_bytes(),
                &[7; PACKED_ARGS]
            ]
        );
        assert!(named.starts_with("app:v3:orders:"), "{named}");
    }

    #[test]
    fn anything_else_is_a_backend_error() {
        let bad = [
            Value::Array(vec![
                Value::Int(1),
                Value::Int(0),
                Value::Int(1),
                Value::Int(1),
            ]),
            Value::Int(1),
            Value::Nil,
            Value::BulkString(vec![0; 16]),
            Value::BulkString(vec![0; 23]),
            Value::BulkString(vec![0; 25]),
            Value::BulkString(vec![0; 31]),
            Value::BulkString(vec![0; 33]),
            Value::BulkString(vec![0; 48]),
            Value::BulkString(vec![0; 55]),
            Value::BulkString(vec![0; 57]),
            packed([2.0, 0.0, 0.0, 0.0, NOW as f64], b""),
            packed([1.0, -1.0, 0.0, 0.0, NOW as f64], b""),
            packed([1.0, 0.5, 0.0, 0.0, NOW as f64], b""),
            packed([1.0, 0.0, f64::NAN, 0.0, NOW as f64], b""),
            packed([1.0, 0.0, 0.0, f64::INFINITY, NOW as f64], b""),
            packed(
                [1.0, 0.0, 0.0, 9_223_372_036_854_775_808.0, NOW as f64],
                b"",
            ),
        ];
        for value in bad {
            assert!(refused(&value, &acquire()), "{value:?}");
        }
    }
}

#[cfg(test)]
mod local_bucket_tests {
    //! What `OutagePolicy::Local` keeps in memory while Redis answers.

    use std::num::NonZeroU32;

    use super::*;
    use crate::ManualClock;

    use super::differential::redis_server;

    #[tokio::test]
    async fn the_local_policy_holds_a_local_bucket_for_every_key_redis_decides_on() {
        let conn = redis::Client::open(redis_server::url())
            .expect("a valid Redis URL")
            .get_multiplexed_async_connection()
            .await
            .expect("a connection to the test Redis");
        let clock = ManualClock::new(1_767_225_600_000);
        let processes = NonZeroU32::new(2).expect("non-zero");
        let store = RedisStore::new(conn)
            .with_prefix(&redis_server::unique_prefix())
            .expect("a valid prefix")
            .with_clock(clock.clone())
            .on_outage(OutagePolicy::Local { processes });
        let limit = Limit::per_minute(10).expect("a valid limit");
        for i in 0..2_000 {
            let key = BucketKey::new("many", format!("made-up-{i}")).expect("a valid key");
            let d = store.acquire(&key, limit, 1, Duration::ZERO).await;
            assert!(d.is_ok_and(|d| d.is_admitted()));
        }
        // Redis decided on every one: no local bucket is needed for any of them.
        assert_eq!(store.local.len(), 0, "local buckets held");
        assert_eq!(
            store.last_answer.load(Ordering::Relaxed),
            clock.now_ms(),
            "what a key new to an outage starts empty from"
        );
    }
}
