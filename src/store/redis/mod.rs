//! The shared store, on Redis: `RedisStore`, its builders and its constructors here; the pieces
//! it is made of beside it:
//!
//! - `bucket_store.rs`: its `BucketStore` impl, each method one call of a script on the
//!   bucket's key, with the deny cache in front and the outage policy behind;
//! - `bucket.lua`: the bucket script, the Lua mirror of `bucket.rs`;
//! - `lease.lua` and `lease.rs`: lease mode, the script (the Lua mirror of `bucket/lease.rs`)
//!   and the leases this process holds;
//! - `acquire_all.lua`: the several-bucket script, the Lua mirror of `bucket::evaluate_all`;
//! - `script.rs`: the scripts' sources and SHA-1s, and one call of a script through the breaker,
//!   the bound on calls in flight and the timeout, with what each error from Redis means;
//! - `wire.rs`: the key, the command and its packed argument, the replies, the stored value; a
//!   leaf, which uses nothing of the store's but value types (its tests in `wire/tests.rs`);
//! - `raw.rs`: the store's acquire without the store, for the workspace's load generator;
//! - `outage.rs`: the outage policy, and what each policy answers;
//! - `breaker.rs`: the circuit breaker, which lets the policy answer at once while Redis is down;
//! - `deny_cache.rs`: the local cache of denials;
//! - `reconnect.rs`: the connection `connect` opens, replaced after a failover or a dead peer;
//! - `tests/` (tests): the scripts against `bucket.rs` on a real Redis, and their mutants:
//!   `differential.rs` for the bucket script, `differential_all.rs` for the several-bucket one,
//!   and in `mod.rs` the harness and the mutant runner they share.
use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hashbrown::HashSet;
use redis::RedisError;
use redis::aio::ConnectionLike;

use crate::clock::server;
use crate::clock::{Clock, ServerClock};
use crate::store::{BackendError, MemoryStore, StoreError};
#[cfg(doc)]
use crate::store::{BucketState, BucketStore};
use crate::{BucketKey, InvalidKey};

mod breaker;
mod bucket_store;
mod deny_cache;
mod lease;
mod outage;
pub mod raw;
mod reconnect;
mod script;
mod wire;

use crate::store::OutagePolicy;
pub use breaker::Breaker;
use breaker::Circuit;
use deny_cache::DenyCache;
pub use lease::Leases;
use reconnect::Reconnect;
use wire::{FORMAT, RedisKey};

const DEFAULT_PREFIX: &str = "burstgate";

/// How long a call may take by default before it counts as failed.
const DEFAULT_TIMEOUT: Duration = Duration::from_millis(250);

/// Buckets in Redis, shared by every process that reaches it.
///
/// Each bucket is one Redis string of 24 bytes: `t` (tokens available at `ts`), `ts`
/// (milliseconds since the Unix epoch) and `keep` (until when the key is kept, on the same
/// clock), each an IEEE 754 `f64`, little-endian, as Lua's `struct.pack('<ddd', t, ts, keep)`
/// writes them. After a drain the value is 32 bytes for a while, a fourth `f64` holding the
/// drain's halt (see [`BucketState::halts`]); it goes back to 24 bytes with the first write once the
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
/// `<prefix>:v4:<bucket>:{<key>}`, with the prefix `burstgate` unless set with
/// [`prefix`](Self::prefix), and the key escaped or hashed as [`BucketKey`] describes. The
/// caller's key in braces is the key's Redis Cluster hash tag, its only one (no prefix, bucket
/// name or escaped key holds a brace): every bucket of one caller (an account's endpoint buckets
/// and its own) lives in one slot, so that [`acquire_all`](BucketStore::acquire_all) on them is
/// one script call, on a Cluster too; buckets of different callers generally are not, and a
/// Cluster refuses them together ([`StoreError::CrossSlot`]). The `v4` is the version of the
/// key scheme and stored format, so a bucket written by an earlier build (`v1`, a hash; `v2`, 16
/// bytes; `v3`, the same value as now under a key with no hash tag) is never read as this one:
/// it is simply left alone and expires by its own TTL. Every write keeps the key at least until the bucket is full again plus one
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
/// many calls share one multiplexed connection concurrently. A decision touches one key; one
/// on several buckets touches theirs, which on a cluster must share a slot (see "Keys").
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
/// Every call has a timeout, 250 ms unless set with [`timeout`](Self::timeout): a
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
/// draws one call to Redis, not one from every waiting request. A request on several buckets
/// ([`acquire_all`](BucketStore::acquire_all)) goes the same way: Redis's denial carries every
/// bucket's state, the ones that refused and the others, and while the cache holds each
/// bucket's state and they refuse the request together, it is refused here with each bucket's
/// outcome as Redis would give it on them; a bucket with no state kept sends it to Redis.
/// Under a flood on one bucket, or on several together, this takes nearly all requests off
/// Redis: about one call per admitted request. It denies only
/// what Redis would deny, but in three cases: if another process refunds tokens to the bucket,
/// Redis loses it (a restart without persistence, `FLUSHALL`), or a host whose clock runs ahead
/// of this one writes it, a request here may be denied that Redis would now admit, at most
/// until the `retry_after` of the denial that filled the cache. Refunds and drains made
/// through this store (or its clones) drop the cached state first. Turn it off with
/// [`deny_cache(false)`](Self::deny_cache). It holds at most 16,384 buckets.
///
/// # Admin operations
///
/// [`reset`](BucketStore::reset) deletes the bucket's key (a `DEL`, with no script), and
/// [`set`](BucketStore::set) and [`block_until`](BucketStore::block_until) are operations of the
/// script, deciding as `MemoryStore` does. Each goes through the same timeout, circuit breaker
/// and bound on calls in flight as a decision: while the breaker is open it is refused with
/// [`StoreError::Unavailable`] and changes nothing, and whatever the [`OutagePolicy`], a call
/// that Redis did not answer is an error (a timed-out one may still have run). The deny cache
/// of the store (and its clones) forgets the bucket before the call and again after Redis
/// answers, so this process stops denying at once; another process's deny cache may keep
/// denying the bucket until the `retry_after` of the denial it cached, and no longer. Under
/// [`OutagePolicy::Local`], a process that admitted the key from its local bucket during an
/// outage empties Redis's bucket before its next decision on it, which can undo a reset made
/// meanwhile; the store that makes the admin call drops that charge for the key.
/// `docs/OPERATIONS.md`, "Unblocking a customer", has the command-line tool.
///
/// ```no_run
/// use std::time::Duration;
/// use burstgate::{BucketKey, BucketStore, Limit, RedisStore};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let client = redis::Client::open("redis://127.0.0.1/")?;
/// let conn = client.get_multiplexed_async_connection().await?;
/// let store = RedisStore::new(conn).prefix("myapp")?;
///
/// let limit = Limit::per_minute(1)?.with_burst(10)?;
/// let key = BucketKey::hashed("orders", "seller-api-token")?;
/// let decision = store.acquire(&key, limit, 1, Duration::ZERO).await?;
/// println!("admitted: {}, {} left", decision.is_admitted(), decision.remaining());
/// # Ok(())
/// # }
/// ```
pub struct RedisStore<C, K = ServerClock> {
    conn: C,
    /// For a store that opened its own connection ([`RedisStore::connect`]): the connection in
    /// use, which replaces `conn` and is itself replaced after a failover or a dead peer.
    reconnect: Option<Arc<Reconnect<C>>>,
    clock: Arc<K>,
    /// The store's own [`ServerClock`], the default clock, while it is the clock: a new prefix
    /// routes its measurements by a key under that prefix.
    timeline: Option<ServerClock>,
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
    /// The leases of lease mode ([`RedisStore::leases`]), when it is on.
    leases: Option<Arc<lease::Table>>,
}

/// The pipeline buffer of [`RedisStore::connect`]'s connection: two groups at 16 tasks, which is
/// where one group costs most (`docs/PERFORMANCE.md`, "Redis speed").
const CONNECT_PIPELINE_BUFFER: usize = 8;

/// Calls in flight to Redis at once, by default: see [`RedisStore::max_in_flight`].
const DEFAULT_MAX_IN_FLIGHT: usize = 128;

impl RedisStore<redis::aio::ConnectionManager, ServerClock> {
    /// Connects to the Redis at `url` (`redis://`, or `rediss://` with TLS) through a
    /// reconnecting [`ConnectionManager`](redis::aio::ConnectionManager): reconnection attempts
    /// at most 200 ms apart, a 1 s limit on each connection attempt, no response timeout of
    /// its own, since the store's [`timeout`](Self::timeout) bounds every call, and a
    /// pipeline buffer of 8 calls (redis-rs's default is 50), and redis-rs's own limit of calls
    /// awaiting an answer set to the store's default bound on calls in flight (128; see
    /// [`max_in_flight`](Self::max_in_flight)).
    ///
    /// The buffer is how many calls the connection takes in before it writes them to Redis in
    /// one go. Many tasks on one connection otherwise move as one group: Redis serves all their
    /// calls while the client waits, then the client turns all the answers into new calls while
    /// Redis waits. A buffer of about half the number of calls in flight splits them into two
    /// groups that Redis and the client serve in turn (`docs/PERFORMANCE.md`, "Redis speed", has
    /// the figures). For a known number of tasks, build the connection yourself with
    /// `set_pipeline_buffer_size(tasks / 2)` and hand it to [`new`](RedisStore::new).
    ///
    /// The store's clock is a [`ServerClock`] on this connection, as [`new`](RedisStore::new)
    /// gives, except that `connect` makes its first measurement before it returns, so that the
    /// store's first decision is already on the shared time; that first measurement names no
    /// key (one node answers it), so an ACL user confined to the store's prefix is enough. A
    /// first measurement that fails or takes over a second (Redis answers the connection but not
    /// the measurement: a stall, a proxy that passes no scripts) is logged at `warn`, and the
    /// store starts on the system clock and measures again from its first call, every second
    /// until one succeeds. The measurements follow the connection the store replaces after a
    /// failover.
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
        let mut conn = open()
            .await
            .map_err(backend("could not connect to Redis"))?;
        let reconnect = Arc::new(Reconnect::new(conn.clone(), Box::new(open)));
        let key = clock_key(DEFAULT_PREFIX);
        // One node behind a ConnectionManager: no key to route by, and none an ACL must allow.
        let first = server::first_measurement(&mut conn, "", FIRST_MEASUREMENT_WITHIN).await;
        let current = Arc::clone(&reconnect);
        let clock = ServerClock::start(
            Arc::new(move || current.current()),
            &key,
            crate::SystemClock,
            server::DEFAULT_EVERY,
            first,
            first.is_none(),
        );
        reconnect.on_replaced(clock.remeasure_hook());
        Ok(Self::assemble(conn, Some(reconnect), clock))
    }
}

/// How long [`RedisStore::connect`] waits for its first measurement of the shared time.
const FIRST_MEASUREMENT_WITHIN: Duration = Duration::from_secs(1);

/// The key a store's clock names in its measurements: under the prefix, so that an ACL that
/// gives the store its prefix covers it, and never a bucket's (whose keys go on `:v<format>:`).
fn clock_key(prefix: &str) -> String {
    format!("{prefix}:clock")
}

impl<C> RedisStore<C, ServerClock>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
{
    /// A store on `conn`, with the default prefix, a 250 ms timeout, the default [`Breaker`],
    /// [`OutagePolicy::FailClosed`], the deny cache on, and the shared time: a [`ServerClock`]
    /// that measures its offset from Redis's clock on `conn`, in the background from the store's
    /// first call on (the store counts the system clock's time until that first measurement
    /// answers, and tries again every second while it fails), and every 10 seconds after.
    ///
    /// # Why the shared time is the default
    ///
    /// Hosts whose clocks differ by a few milliseconds (NTP on virtual machines, containers on
    /// different nodes) otherwise do not share a contended bucket: the host ahead sees each
    /// token due first and takes nearly all of them. On the shared time they share it evenly
    /// (`docs/OPERATIONS.md`, "Clocks that disagree", has the figures' source). The decisions
    /// are unchanged: the script still takes the time from the store, never from Redis.
    ///
    /// To count your own clock instead (a [`ManualClock`](crate::ManualClock) in tests, the plain
    /// [`SystemClock`](crate::SystemClock) where one process alone uses the store), give it
    /// with [`with_clock`](Self::with_clock): the store's own clock is dropped, and its
    /// measurements stop.
    pub fn new(conn: C) -> Self {
        let measured = conn.clone();
        let clock = ServerClock::start(
            Arc::new(move || measured.clone()),
            &clock_key(DEFAULT_PREFIX),
            crate::SystemClock,
            server::DEFAULT_EVERY,
            None,
            false,
        );
        Self::assemble(conn, None, clock)
    }

    /// A store with the defaults on `conn`, counting time on `clock`, its own.
    fn assemble(conn: C, reconnect: Option<Arc<Reconnect<C>>>, clock: ServerClock) -> Self {
        let timeline = Some(clock.clone());
        let clock = Arc::new(clock);
        Self {
            conn,
            reconnect,
            timeline,
            local: MemoryStore::new().with_clock(Arc::clone(&clock)),
            touched: Arc::default(),
            last_answer: Arc::default(),
            leases: None,
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
    pub fn prefix(self, prefix: &str) -> Result<Self, InvalidKey> {
        crate::key::check_name(prefix).map_err(InvalidKey::Prefix)?;
        if let Some(timeline) = &self.timeline {
            timeline.route_by(&clock_key(prefix));
        }
        // Caches of their own: they are keyed by bucket key, and another prefix's buckets are
        // other buckets.
        Ok(Self {
            prefix: Arc::from(prefix),
            deny: self.deny.as_ref().map(|_| Arc::new(DenyCache::new())),
            local: MemoryStore::new().with_clock(Arc::clone(&self.clock)),
            touched: Arc::default(),
            last_answer: Arc::default(),
            // Leases of its own, for the same reason, in the same mode.
            leases: self.leases.as_ref().map(|t| Arc::new(t.renewed())),
            ..self
        })
    }

    /// Reads the time from `clock` instead of the store's own [`ServerClock`], whose
    /// measurements then stop (once no clone of the store holds it). For tests
    /// ([`ManualClock`](crate::ManualClock); under tokio's paused time,
    /// [`TokioClock`](crate::TokioClock), since the store's own clock would measure on virtual
    /// time), and for users who bring their own shared time;
    /// `with_clock(SystemClock)` counts this host's clock alone, as stores did before the shared
    /// time was the default.
    #[must_use]
    pub fn with_clock<K2: Clock>(self, clock: K2) -> RedisStore<C, K2> {
        let clock = Arc::new(clock);
        RedisStore {
            conn: self.conn,
            reconnect: self.reconnect,
            timeline: None,
            local: MemoryStore::new().with_clock(Arc::clone(&clock)),
            touched: Arc::default(),
            last_answer: Arc::default(),
            leases: self.leases.as_ref().map(|t| Arc::new(t.renewed())),
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
    pub fn timeout(self, timeout: Duration) -> Self {
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
    pub fn breaker(self, breaker: Breaker) -> Self {
        Self {
            circuit: Arc::new(Circuit::new(breaker)),
            ..self
        }
    }

    /// At most `calls` calls to Redis in flight at once from this store and its clones (128 by
    /// default; at least 1). A call beyond waits for a slot within its
    /// [timeout](Self::timeout), and is answered [`StoreError::Unavailable`] without being
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
    pub fn max_in_flight(self, calls: usize) -> Self {
        let calls = calls.clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
        Self {
            in_flight: Arc::new(tokio::sync::Semaphore::new(calls)),
            ..self
        }
    }

    /// Turns the local deny cache on (the default) or off.
    #[must_use]
    pub fn deny_cache(self, on: bool) -> Self {
        Self {
            deny: on.then(|| Arc::new(DenyCache::new())),
            ..self
        }
    }

    /// The clock the store reads: by default its own [`ServerClock`], whose
    /// [`is_measured`](ServerClock::is_measured) and [`offset_us`](ServerClock::offset_us) tell
    /// whether the store counts the shared time yet, and how far this host's clock is from it.
    pub fn clock(&self) -> &K {
        &self.clock
    }

    /// Whether the circuit breaker is open: Redis failed and calls are answered by the
    /// [`OutagePolicy`] without trying it.
    pub fn is_circuit_open(&self) -> bool {
        self.circuit.is_open()
    }

    /// The Redis key of a bucket's [audit trail](crate::Audit): the stream beside
    /// [`redis_key`](Self::redis_key), with the same hash tag.
    pub fn audit_key(&self, key: &BucketKey) -> String {
        wire::audit_key(&self.prefix, key)
    }

    /// The full Redis key of a bucket.
    pub fn redis_key(&self, key: &BucketKey) -> String {
        RedisKey {
            prefix: &self.prefix,
            key,
        }
        .to_string()
    }
}

impl<C: Clone, K> Clone for RedisStore<C, K> {
    fn clone(&self) -> Self {
        Self {
            conn: self.conn.clone(),
            reconnect: self.reconnect.clone(),
            clock: Arc::clone(&self.clock),
            timeline: self.timeline.clone(),
            prefix: Arc::clone(&self.prefix),
            timeout: self.timeout,
            policy: self.policy,
            circuit: Arc::clone(&self.circuit),
            in_flight: Arc::clone(&self.in_flight),
            deny: self.deny.clone(),
            local: self.local.clone(),
            touched: Arc::clone(&self.touched),
            last_answer: Arc::clone(&self.last_answer),
            leases: self.leases.clone(),
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
mod tests;
