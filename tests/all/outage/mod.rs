//! What the Redis store does when Redis fails: the outage policies, the timeout, the circuit
//! breaker, retrying what Redis did not run, and the local deny cache. Failures are made by a
//! connection wrapper that a test switches between up, refusing, hanging and `TRYAGAIN`, over a
//! real Redis; the fault suite with real processes being killed is `faults.rs`.
#![cfg(feature = "redis")]

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::time::Duration;

use burstgate::{
    Breaker, BucketKey, BucketStore, Limit, ManualClock, OutagePolicy, RedisStore, Reservation,
    StoreError, Take,
};
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{Cmd, Pipeline, RedisFuture, Value};

use crate::support::{START, ZERO, logs, redis_server};

const UP: u8 = 0;
const REFUSING: u8 = 1;
const HANGING: u8 = 2;
const TRY_AGAIN_ONCE: u8 = 3;
/// Redis answers that the script failed, as it does when the value at one key makes its `SET`
/// fail.
const SCRIPT_ERROR: u8 = 4;

/// A real connection that a test can take down. Counts the commands that reach it.
#[derive(Clone)]
struct Switch {
    inner: Option<MultiplexedConnection>,
    mode: Arc<AtomicU8>,
    calls: Arc<AtomicUsize>,
}

impl Switch {
    async fn new() -> Self {
        Self::to(&redis_server::url()).await
    }

    async fn to(url: &str) -> Self {
        let inner = redis::Client::open(url)
            .expect("a valid Redis URL")
            .get_multiplexed_async_connection()
            .await
            .expect("a connection to the test Redis");
        Self::over(Some(inner))
    }

    /// With no Redis behind it: only for modes that never reach one.
    fn detached() -> Self {
        Self::over(None)
    }

    fn over(inner: Option<MultiplexedConnection>) -> Self {
        Self {
            inner,
            mode: Arc::new(AtomicU8::new(UP)),
            calls: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn set(&self, mode: u8) {
        self.mode.store(mode, Ordering::SeqCst);
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

fn error(kind: redis::ErrorKind, what: &'static str) -> redis::RedisError {
    redis::RedisError::from((kind, what))
}

impl ConnectionLike for Switch {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let mode = self.mode.load(Ordering::SeqCst);
        Box::pin(async move {
            match mode {
                REFUSING => Err(redis::RedisError::from(std::io::Error::from(
                    std::io::ErrorKind::ConnectionRefused,
                ))),
                HANGING => std::future::pending().await,
                // A real error from a script, as Redis words it.
                SCRIPT_ERROR => match self.inner.as_mut() {
                    Some(inner) => {
                        let failing = redis::cmd("EVAL")
                            .arg("redis.call('SET', KEYS[1], 'x', 'PX', '-5') return 1")
                            .arg(1)
                            .arg("bgtest-script-error")
                            .clone();
                        inner.req_packed_command(&failing).await
                    }
                    None => Err(error(redis::ErrorKind::Io, "no connection")),
                },
                TRY_AGAIN_ONCE => {
                    self.mode.store(UP, Ordering::SeqCst);
                    Err(error(
                        redis::ErrorKind::Server(redis::ServerErrorKind::TryAgain),
                        "multiple keys request during rehashing of slot",
                    ))
                }
                _ => match self.inner.as_mut() {
                    Some(inner) => inner.req_packed_command(cmd).await,
                    None => Err(error(redis::ErrorKind::Io, "no connection")),
                },
            }
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            match self.inner.as_mut() {
                Some(inner) => inner.req_packed_commands(pipeline, offset, count).await,
                None => Err(error(redis::ErrorKind::Io, "no connection")),
            }
        })
    }

    fn get_db(&self) -> i64 {
        0
    }
}

/// Lets `d` pass on tokio's clock, which the circuit breaker keeps time on, at once: tokio's
/// time is paused only for the jump, since calls to a real Redis need it running.
async fn skip(d: Duration) {
    tokio::time::pause();
    tokio::time::advance(d).await;
    tokio::time::resume();
}

fn limit(per_second: u32, burst: u32) -> Limit {
    Limit::per_second(per_second)
        .and_then(|l| l.with_burst(burst))
        .expect("a valid limit")
}

/// A reservation of `cost` tokens whose slot was START: due, so it goes back while the bucket is
/// in no debt.
fn at_start(cost: u32) -> Reservation {
    Reservation::new(cost, std::time::UNIX_EPOCH + Duration::from_millis(START))
}

fn key(name: &str) -> BucketKey {
    BucketKey::new("outage", name).expect("a valid key")
}

fn store(conn: Switch, clock: &ManualClock) -> RedisStore<Switch, ManualClock> {
    RedisStore::new(conn)
        .prefix(&redis_server::unique_prefix())
        .expect("a valid prefix")
        .with_clock(clock.clone())
}

mod breaker;
mod deny_cache;
mod policy;
