//! Replacing the connection of a store that opened it itself ([`RedisStore::connect`]): after a
//! failover demoted the node it is connected to (`READONLY` on every write, and redis-rs's
//! `ConnectionManager` does not reconnect for it), and after calls time out in a row on a peer
//! that stopped answering without closing the connection (no RST, so nothing tells the
//! connection it is dead).
//!
//! [`RedisStore::connect`]: super::RedisStore::connect

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, OnceLock, PoisonError, RwLock};

use redis::RedisError;

use crate::store::BoxFuture;

/// Calls timed out in a row after which the connection is replaced.
pub(super) const AFTER_TIMEOUTS: u32 = 3;

type Open<C> = Box<dyn Fn() -> BoxFuture<'static, Result<C, RedisError>> + Send + Sync>;

/// The connection in use, and how to open another.
pub(super) struct Reconnect<C> {
    current: RwLock<C>,
    open: Open<C>,
    /// A replacement is being opened: one at a time.
    replacing: AtomicBool,
    /// Calls that timed out in a row.
    timeouts: AtomicU32,
    /// Called once a new connection is in place: the store's clock measures on it at once.
    replaced: OnceLock<Box<dyn Fn() + Send + Sync>>,
}

impl<C: Clone + Send + Sync + 'static> Reconnect<C> {
    pub(super) fn new(current: C, open: Open<C>) -> Self {
        Self {
            current: RwLock::new(current),
            open,
            replacing: AtomicBool::new(false),
            timeouts: AtomicU32::new(0),
            replaced: OnceLock::new(),
        }
    }

    /// Calls `hook` after each replacement.
    pub(super) fn on_replaced(&self, hook: impl Fn() + Send + Sync + 'static) {
        let _ = self.replaced.set(Box::new(hook));
    }

    /// The connection to make the next call on.
    pub(super) fn current(&self) -> C {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Redis answered a call.
    pub(super) fn answered(&self) {
        if self.timeouts.load(Ordering::Relaxed) != 0 {
            self.timeouts.store(0, Ordering::Relaxed);
        }
    }

    /// A call timed out; after [`AFTER_TIMEOUTS`] in a row the connection is replaced.
    pub(super) fn timed_out(self: &Arc<Self>) {
        if self.timeouts.fetch_add(1, Ordering::Relaxed) + 1 >= AFTER_TIMEOUTS {
            self.timeouts.store(0, Ordering::Relaxed);
            self.replace("calls timed out in a row: the peer may have stopped answering");
        }
    }

    /// Opens a new connection on a task of its own and puts it in place once it is open; calls
    /// go on using the current one meanwhile. Does nothing while a replacement is on its way.
    pub(super) fn replace(self: &Arc<Self>, why: &'static str) {
        if self.replacing.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.replacing.store(false, Ordering::Release);
            return;
        };
        tracing::warn!(target: "burstgate::redis", why, "replacing the connection to redis");
        let this = Arc::clone(self);
        runtime.spawn(async move {
            match (this.open)().await {
                Ok(conn) => {
                    *this.current.write().unwrap_or_else(PoisonError::into_inner) = conn;
                    tracing::info!(target: "burstgate::redis", "connection to redis replaced");
                    if let Some(hook) = this.replaced.get() {
                        hook();
                    }
                }
                Err(error) => tracing::warn!(
                    target: "burstgate::redis",
                    %error,
                    "could not open a new connection to redis; the current one stays"
                ),
            }
            this.replacing.store(false, Ordering::Release);
        });
    }
}

impl<C> fmt::Debug for Reconnect<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reconnect")
            .field("replacing", &self.replacing.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}
