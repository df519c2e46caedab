//! One time for every host: the local clock, corrected by its measured offset from Redis's.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use redis::aio::ConnectionLike;

use super::{Clock, SystemClock};
use crate::StoreError;
use crate::error::BackendError;

/// How many `TIME` round trips one measurement takes; the fastest gives the offset, since its
/// midpoint is the closest to the moment Redis read its clock.
const SAMPLES: usize = 5;

/// The longest a single `TIME` may take before the measurement gives up on it.
const SAMPLE_TIMEOUT: Duration = Duration::from_secs(1);

/// How often [`ServerClock::sync`] measures the offset again.
const DEFAULT_EVERY: Duration = Duration::from_secs(10);

/// A clock that reads a local clock and adds its offset from the Redis server's clock, measured
/// with `TIME` when made and again every few seconds on a background task: every process that
/// uses one against the same Redis counts time the same way, to within half a round trip.
///
/// Why: a contended bucket goes to whoever asks first once a token is due, and a host whose
/// clock runs ahead sees every token due before the others do. Measuring waits from the stored
/// time stops a host that runs behind from being starved, but nothing in the bucket can tell a
/// host ahead from time that has passed: only a shared time makes hosts whose clocks disagree
/// by milliseconds share a saturated bucket fairly. The script still takes `now` from the
/// application, as an argument, so decisions stay exact in tests and safe to replicate; only the
/// clock that produces `now` is corrected.
///
/// - Against Redis Cluster, `TIME` goes to one node: the shared time is that node's.
/// - A measurement that fails (Redis down, a timeout) keeps the last offset and is tried again
///   at the next period; the failure is logged once per streak, at `warn`.
/// - After a failover the new primary's clock may differ: the next measurement moves every
///   host to it, and a step back is handled as any clock behind the stored time is (it refills
///   nothing until it catches up).
/// - The background task stops when the last clone of the clock is dropped. It needs a tokio
///   runtime, as the store does.
///
/// ```no_run
/// use burstgate::{RedisStore, ServerClock};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let client = redis::Client::open("redis://127.0.0.1/")?;
/// let conn = client.get_connection_manager().await?;
/// let clock = ServerClock::sync(conn.clone()).await?;
/// let store = RedisStore::new(conn).with_clock(clock);
/// # let _ = store;
/// # Ok(())
/// # }
/// ```
pub struct ServerClock<K = SystemClock> {
    base: K,
    shared: Arc<Shared>,
}

struct Shared {
    /// Microseconds to add to the local clock.
    offset_us: AtomicI64,
    /// The round trip of the measurement the offset came from, in microseconds: the offset's
    /// error is at most half of it.
    rtt_us: AtomicI64,
    task: tokio::task::AbortHandle,
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ServerClock<SystemClock> {
    /// The system clock, corrected by its offset from the Redis behind `conn`, measured now and
    /// every 10 seconds.
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
        let every = every.max(Duration::from_secs(1));
        let mut conn = conn;
        let (offset_us, rtt_us) = measure(&mut conn, &base).await?;
        let (tx, rx) = tokio::sync::oneshot::channel::<std::sync::Weak<Shared>>();
        let task_base = base.clone();
        let task = tokio::spawn(async move {
            let Ok(shared) = rx.await else { return };
            let mut failing = false;
            loop {
                tokio::time::sleep(every).await;
                let measured = measure(&mut conn, &task_base).await;
                let Some(shared) = shared.upgrade() else {
                    return;
                };
                match measured {
                    Ok((offset_us, rtt_us)) => {
                        shared.offset_us.store(offset_us, Ordering::Relaxed);
                        shared.rtt_us.store(rtt_us, Ordering::Relaxed);
                        failing = false;
                    }
                    Err(e) if !failing => {
                        failing = true;
                        tracing::warn!(
                            error = %e,
                            "could not measure the clock's offset from Redis; keeping the last one"
                        );
                    }
                    Err(_) => {}
                }
            }
        });
        let shared = Arc::new(Shared {
            offset_us: AtomicI64::new(offset_us),
            rtt_us: AtomicI64::new(rtt_us),
            task: task.abort_handle(),
        });
        // The task only holds a weak reference, so that dropping the clock ends it.
        let _ = tx.send(Arc::downgrade(&shared));
        Ok(Self { base, shared })
    }

    /// The offset last measured, in microseconds: how far Redis's clock is ahead of the local
    /// one (negative when behind).
    pub fn offset_us(&self) -> i64 {
        self.shared.offset_us.load(Ordering::Relaxed)
    }

    /// The round trip of the measurement the offset came from; the offset is off by at most
    /// half of it.
    pub fn round_trip(&self) -> Duration {
        let us = self.shared.rtt_us.load(Ordering::Relaxed);
        Duration::from_micros(u64::try_from(us).unwrap_or(0))
    }
}

/// Measures the offset (server minus local, in microseconds) and the round trip it came with.
async fn measure<C: ConnectionLike, K: Clock>(
    conn: &mut C,
    base: &K,
) -> Result<(i64, i64), StoreError> {
    let mut best: Option<(i64, i64)> = None;
    for _ in 0..SAMPLES {
        let sent = Instant::now();
        let local = base.now_us();
        let reply = tokio::time::timeout(
            SAMPLE_TIMEOUT,
            redis::cmd("TIME").query_async::<(u64, u64)>(conn),
        )
        .await;
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
    best.ok_or_else(|| StoreError::Backend(BackendError::new("no TIME sample was taken", None)))
}

impl<K: Clock> Clock for ServerClock<K> {
    fn now_ms(&self) -> u64 {
        self.now_us() / 1_000
    }

    fn now_us(&self) -> u64 {
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
            .finish()
    }
}
