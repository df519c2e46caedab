//! One time for every host: the local clock, corrected by its measured offset from Redis's.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, Weak};
use std::time::{Duration, Instant};

use redis::aio::ConnectionLike;

use super::{Clock, SystemClock};
use crate::StoreError;
use crate::error::BackendError;

/// How many round trips one measurement takes; the fastest gives the offset, since its midpoint
/// is the closest to the moment Redis read its clock.
const SAMPLES: usize = 5;

/// The longest a single sample may take before the measurement gives up on it.
const SAMPLE_TIMEOUT: Duration = Duration::from_secs(1);

/// How often a clock measures the offset again, by default.
pub(crate) const DEFAULT_EVERY: Duration = Duration::from_secs(10);

/// How often a clock that has no measurement yet tries again: it counts local time until then.
const UNTIL_MEASURED: Duration = Duration::from_secs(1);

/// The key a measurement names when none is given: a measurement is one script call naming a
/// key, so that Redis Cluster routes every sample of every process to the primary that serves
/// the key's slot (a `TIME` names no key, and goes to any node). The key is never read or
/// written.
pub(crate) const DEFAULT_KEY: &str = "burstgate:clock";

/// The measurement: Redis's clock, read by a script so that the call can name a key. Sent with
/// `EVAL`, which needs nothing loaded first, once every few seconds.
const SOURCE: &str = "return redis.call('TIME')";

/// The connection a measurement is made on, asked anew for each: a store that replaces its
/// connection (after a failover, or a peer that stopped answering) is measured on the new one.
pub(crate) type Connect<C> = Arc<dyn Fn() -> C + Send + Sync>;

/// A clock that reads a local clock and adds its offset from the Redis server's clock, measured
/// when made and again every few seconds on a background task: every process that uses one
/// against the same Redis counts time the same way, to within half a round trip.
///
/// [`RedisStore::connect`](crate::RedisStore::connect) and [`RedisStore::new`](crate::RedisStore::new)
/// give their store one by default, on the store's own connection; make one yourself only to
/// correct a clock other than the system clock ([`sync_with`](Self::sync_with)), or to share one
/// time with something other than a store.
///
/// Why: a contended bucket goes to whoever asks first once a token is due, and a host whose
/// clock runs ahead sees every token due before the others do. Measuring waits from the stored
/// time stops a host that runs behind from being starved, but nothing in the bucket can tell a
/// host ahead from time that has passed: only a shared time makes hosts whose clocks disagree
/// by milliseconds share a saturated bucket fairly. The script still takes `now` from the
/// application, as an argument, so decisions stay exact in tests and safe to replicate; only the
/// clock that produces `now` is corrected.
///
/// - A measurement is five round trips of one script call, `return redis.call('TIME')`, naming
///   one key that is never read or written (`burstgate:clock`, or the store's `<prefix>:clock`):
///   against Redis Cluster every sample of every process goes to the primary that serves that
///   key's slot, and after a failover or a resharding, to its new primary. A Redis ACL user needs
///   `+eval` and that key (a `~<prefix>:*` pattern covers it).
/// - A measurement that fails (Redis down, a timeout) keeps the last offset and is tried again
///   at the next period; the failure is logged once per streak, at `warn`. A clock that has never
///   measured counts local time, and tries again every second until a measurement succeeds.
/// - After a failover the new primary's clock may differ: the next measurement moves every
///   host to it, and a step back is handled as any clock behind the stored time is (it refills
///   nothing until it catches up).
/// - The background task stops when the last clone of the clock is dropped. It needs a tokio
///   runtime, as the store does; a clock made outside one starts measuring when it is first read
///   inside one.
///
/// ```no_run
/// use burstgate::{RedisStore, ServerClock};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let client = redis::Client::open("redis://127.0.0.1/")?;
/// let conn = client.get_connection_manager().await?;
/// // What `RedisStore::new(conn)` does by default, here with a clock one can read elsewhere.
/// let clock = ServerClock::sync(conn.clone()).await?;
/// let store = RedisStore::new(conn).with_clock(clock.clone());
/// println!("Redis is {} µs ahead of this host", clock.offset_us());
/// # let _ = store;
/// # Ok(())
/// # }
/// ```
pub struct ServerClock<K = SystemClock> {
    base: K,
    shared: Arc<Shared>,
}

/// Starts the measuring task on a runtime, given the clock's shared state to update.
type Spawn =
    Box<dyn Fn(&tokio::runtime::Handle, Weak<Shared>) -> tokio::task::AbortHandle + Send + Sync>;

struct Task {
    spawn: Spawn,
    running: Option<tokio::task::AbortHandle>,
}

/// Lives in the measuring task: when the task ends (its runtime shut down), the next read
/// starts another on the reader's runtime.
struct Stopped(Weak<Shared>);

impl Drop for Stopped {
    fn drop(&mut self) {
        if let Some(shared) = self.0.upgrade() {
            shared.running.store(false, Ordering::Release);
        }
    }
}

struct Shared {
    /// Microseconds to add to the local clock.
    offset_us: AtomicI64,
    /// The round trip of the measurement the offset came from, in microseconds: the offset's
    /// error is at most half of it.
    rtt_us: AtomicI64,
    /// Whether a measurement has succeeded: until then the offset is zero.
    measured: AtomicBool,
    /// Whether the task runs: read on every clock read, so that a clock made outside a runtime
    /// starts measuring once read inside one.
    running: AtomicBool,
    /// The key the measurement's script call names, which picks the node on a cluster.
    key: RwLock<Arc<str>>,
    /// Wakes the task to measure at once: the store replaced its connection, and the node
    /// behind the new one may keep another time.
    /// Shared with the task, which waits on it without holding the clock.
    soon: Arc<tokio::sync::Notify>,
    task: Mutex<Task>,
}

impl Shared {
    fn start(self: &Arc<Self>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut task = self.task.lock().unwrap_or_else(PoisonError::into_inner);
        if self.running.swap(true, Ordering::AcqRel) {
            return;
        }
        task.running = Some((task.spawn)(&runtime, Arc::downgrade(self)));
    }

    fn key(&self) -> Arc<str> {
        Arc::clone(&self.key.read().unwrap_or_else(PoisonError::into_inner))
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        if let Some(task) = &self
            .task
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .running
        {
            task.abort();
        }
    }
}

impl ServerClock<SystemClock> {
    /// The system clock, corrected by its offset from the Redis behind `conn`, measured now and
    /// every 10 seconds. Fails as the first measurement fails.
    pub async fn sync<C>(conn: C) -> Result<Self, StoreError>
    where
        C: ConnectionLike + Clone + Send + Sync + 'static,
    {
        Self::sync_with(conn, SystemClock, DEFAULT_EVERY).await
    }
}

impl<K: Clock + Clone> ServerClock<K> {
    /// `base`, corrected by its offset from the Redis behind `conn`, measured now and every
    /// `every` (at least a second). Fails as the first measurement fails.
    pub async fn sync_with<C>(conn: C, base: K, every: Duration) -> Result<Self, StoreError>
    where
        C: ConnectionLike + Clone + Send + Sync + 'static,
    {
        let mut first = conn.clone();
        let measured = measure(&mut first, DEFAULT_KEY, &base).await?;
        Ok(Self::start(
            Arc::new(move || conn.clone()),
            DEFAULT_KEY,
            base,
            every,
            Some(measured),
            false,
        ))
    }

    /// A clock measured on whatever `connect` returns at each measurement, naming `key`, every
    /// `every` (at least a second), from `first` when a measurement was made already, else from
    /// local time until the first succeeds: tried when the clock is first read (once the store's
    /// builders have set the key), then every second.
    pub(crate) fn start<C>(
        connect: Connect<C>,
        key: &str,
        base: K,
        every: Duration,
        first: Option<(i64, i64)>,
        warned: bool,
    ) -> Self
    where
        C: ConnectionLike + Send + 'static,
    {
        let every = every.max(Duration::from_secs(1));
        let task_base = base.clone();
        let soon = Arc::new(tokio::sync::Notify::new());
        let task_soon = Arc::clone(&soon);
        let spawn: Spawn = Box::new(move |runtime, weak| {
            runtime
                .spawn(measure_forever(
                    Arc::clone(&connect),
                    task_base.clone(),
                    every,
                    Arc::clone(&task_soon),
                    weak.clone(),
                    warned,
                    Stopped(weak),
                ))
                .abort_handle()
        });
        let (offset_us, rtt_us) = first.unwrap_or((0, 0));
        let shared = Arc::new(Shared {
            offset_us: AtomicI64::new(offset_us),
            rtt_us: AtomicI64::new(rtt_us),
            measured: AtomicBool::new(first.is_some()),
            running: AtomicBool::new(false),
            key: RwLock::new(Arc::from(key)),
            soon: Arc::clone(&soon),
            task: Mutex::new(Task {
                spawn,
                running: None,
            }),
        });
        if first.is_some() {
            shared.start();
        }
        Self { base, shared }
    }
}

impl<K> ServerClock<K> {
    /// The offset last measured, in microseconds: how far Redis's clock is ahead of the local
    /// one (negative when behind). Zero until a measurement has succeeded.
    pub fn offset_us(&self) -> i64 {
        self.shared.offset_us.load(Ordering::Relaxed)
    }

    /// The round trip of the measurement the offset came from; the offset is off by at most
    /// half of it.
    pub fn round_trip(&self) -> Duration {
        let us = self.shared.rtt_us.load(Ordering::Relaxed);
        Duration::from_micros(u64::try_from(us).unwrap_or(0))
    }

    /// Whether a measurement has succeeded: until one has, the clock reads local time.
    pub fn is_measured(&self) -> bool {
        self.shared.measured.load(Ordering::Acquire)
    }

    /// Names `key` in the measurements from now on (the store's `<prefix>:clock`).
    pub(crate) fn route_by(&self, key: &str) {
        *self
            .shared
            .key
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Arc::from(key);
    }

    /// What to call when the connection measured on was replaced: the next measurement is made
    /// at once. Holds the clock weakly, so that it does not keep the clock's task alive.
    pub(crate) fn remeasure_hook(&self) -> impl Fn() + Send + Sync + 'static {
        let weak = Arc::downgrade(&self.shared);
        move || {
            if let Some(shared) = weak.upgrade() {
                shared.soon.notify_one();
            }
        }
    }
}

/// Measures on `connect()`'s connection every `every` (every second until one succeeds), for as
/// long as the clock's shared state lives. Holds it only between measurements' awaits, so that
/// dropping the last clock ends the task.
async fn measure_forever<C, K>(
    connect: Connect<C>,
    base: K,
    every: Duration,
    soon: Arc<tokio::sync::Notify>,
    weak: Weak<Shared>,
    warned: bool,
    _stopped: Stopped,
) where
    C: ConnectionLike + Send + 'static,
    K: Clock,
{
    let mut failing = warned;
    let mut first = true;
    loop {
        let wait = {
            let Some(shared) = weak.upgrade() else { return };
            match (shared.measured.load(Ordering::Acquire), first) {
                (true, _) => every,
                (false, true) => Duration::ZERO,
                (false, false) => UNTIL_MEASURED,
            }
        };
        first = false;
        if !wait.is_zero() {
            // Woken early by a replacement (one made since the last wait left a permit, so it is
            // not missed), or at the end of the wait: either way, measure.
            let _ = tokio::time::timeout(wait, soon.notified()).await;
        }
        let key = {
            let Some(shared) = weak.upgrade() else { return };
            shared.key()
        };
        let mut conn = connect();
        let measured = measure(&mut conn, &key, &base).await;
        let Some(shared) = weak.upgrade() else { return };
        match measured {
            Ok((offset_us, rtt_us)) => {
                shared.offset_us.store(offset_us, Ordering::Relaxed);
                shared.rtt_us.store(rtt_us, Ordering::Relaxed);
                shared.measured.store(true, Ordering::Release);
                failing = false;
            }
            Err(e) if !failing => {
                failing = true;
                if shared.measured.load(Ordering::Acquire) {
                    tracing::warn!(
                        target: "burstgate::redis",
                        error = %e,
                        cause = cause(&e),
                        "could not measure the clock's offset from Redis; keeping the last one"
                    );
                } else {
                    tracing::warn!(
                        target: "burstgate::redis",
                        error = %e,
                        cause = cause(&e),
                        "could not measure the clock's offset from Redis; counting local time \
                         until a measurement succeeds"
                    );
                }
            }
            Err(_) => {}
        }
    }
}

/// A first measurement for a store that opens its own connection: given up after `within`
/// (logged at `warn`), when the store starts on local time and measures in the background.
pub(crate) async fn first_measurement<C: ConnectionLike>(
    conn: &mut C,
    key: &str,
    within: Duration,
) -> Option<(i64, i64)> {
    let failed = match tokio::time::timeout(within, measure(conn, key, &SystemClock)).await {
        Ok(Ok(measured)) => return Some(measured),
        Ok(Err(e)) => e,
        Err(_) => StoreError::Timeout { after: within },
    };
    tracing::warn!(
        target: "burstgate::redis",
        error = %failed,
        cause = cause(&failed),
        "could not measure the clock's offset from Redis; counting local time until a \
         measurement succeeds"
    );
    None
}

/// What Redis answered, for the log: its error code (`NOPERM`, `NOSCRIPT`, ...) or the kind of
/// failure, never a message that could carry an address or a name.
fn cause(e: &StoreError) -> String {
    use std::error::Error as _;
    match e
        .source()
        .and_then(|s| s.downcast_ref::<redis::RedisError>())
    {
        Some(redis) => redis
            .code()
            .map_or_else(|| format!("{:?}", redis.kind()), str::to_owned),
        None => e.to_string(),
    }
}

/// Measures the offset (server minus local, in microseconds) and the round trip it came with.
///
/// A sample proves only that Redis read its clock somewhere within the round trip, so the offset
/// lies within half a round trip of the midpoint's. Of that interval the value nearest zero is
/// kept: a round trip stretched by a busy runtime (the reply read late, on every sample alike)
/// then widens the interval instead of moving the offset by the delay, and a correction is never
/// further from the truth than no correction. Where the round trip is short, as it is on a
/// quiet host, that is the midpoint's offset to within half of it. An empty key names none, for
/// a single node where nothing needs routing.
async fn measure<C: ConnectionLike, K: Clock>(
    conn: &mut C,
    key: &str,
    base: &K,
) -> Result<(i64, i64), StoreError> {
    let mut cmd = redis::cmd("EVAL");
    if key.is_empty() {
        cmd.arg(SOURCE).arg(0);
    } else {
        cmd.arg(SOURCE).arg(1).arg(key);
    }
    let mut best: Option<(i64, i64)> = None;
    for _ in 0..SAMPLES {
        let sent = Instant::now();
        let local = base.now_us();
        let reply = tokio::time::timeout(SAMPLE_TIMEOUT, cmd.query_async::<(u64, u64)>(conn)).await;
        let rtt = sent.elapsed();
        let (secs, micros) = match reply {
            Ok(Ok(time)) => time,
            Ok(Err(e)) => {
                return Err(StoreError::Backend(BackendError::new(
                    "could not read Redis's TIME",
                    Some(Box::new(e)),
                )));
            }
            Err(_) => {
                return Err(StoreError::Timeout {
                    after: SAMPLE_TIMEOUT,
                });
            }
        };
        let rtt_us = i64::try_from(rtt.as_micros()).unwrap_or(i64::MAX);
        let server_us = secs.saturating_mul(1_000_000).saturating_add(micros);
        // Redis read its clock about halfway through the round trip.
        let local_mid = i128::from(local) + i128::from(rtt_us / 2);
        let offset = i128::from(server_us) - local_mid;
        let offset = i64::try_from(offset).unwrap_or(if offset < 0 { i64::MIN } else { i64::MAX });
        if best.is_none_or(|(_, best_rtt)| rtt_us < best_rtt) {
            best = Some((offset, rtt_us));
        }
    }
    best.map(|(offset, rtt)| {
        let half = rtt / 2;
        let proven = if offset > half {
            offset - half
        } else if offset < -half {
            offset + half
        } else {
            0
        };
        (proven, rtt)
    })
    .ok_or_else(|| StoreError::Backend(BackendError::new("no TIME sample was taken", None)))
}

impl<K: Clock> Clock for ServerClock<K> {
    fn now_ms(&self) -> u64 {
        self.now_us() / 1_000
    }

    fn now_us(&self) -> u64 {
        if !self.shared.running.load(Ordering::Relaxed) {
            self.shared.start();
        }
        let offset = self.shared.offset_us.load(Ordering::Relaxed);
        self.base.now_us().saturating_add_signed(offset)
    }
}

impl<K: Clone> Clone for ServerClock<K> {
    fn clone(&self) -> Self {
        Self {
            base: self.base.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<K: fmt::Debug> fmt::Debug for ServerClock<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerClock")
            .field("base", &self.base)
            .field("offset_us", &self.shared.offset_us.load(Ordering::Relaxed))
            .field("round_trip_us", &self.shared.rtt_us.load(Ordering::Relaxed))
            .field("measured", &self.shared.measured.load(Ordering::Relaxed))
            .finish()
    }
}
