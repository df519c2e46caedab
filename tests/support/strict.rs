//! A strict upstream on a real socket: one token bucket, full at the first request it
//! receives, refilled on the monotonic clock in floating point with no tolerance, as an API that
//! publishes a limit and enforces exactly that. A request finds a whole token and is answered
//! 200, or is answered 429 and takes nothing.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::extract::{ConnectInfo, State};
use axum::http::StatusCode;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

#[derive(Default)]
struct Bucket {
    /// The tokens held at `at`; `None` before the first request.
    state: Option<(f64, Instant)>,
    first_at: Option<Instant>,
    last_at: Option<Instant>,
    admitted: usize,
    rejected: usize,
    /// Each 429: how long after the first request it came, and the tokens the bucket held.
    rejections: Vec<(Duration, f64)>,
}

struct Shared {
    per_token: Duration,
    burst: f64,
    /// How much later than the others the first request of a connection reaches the bucket.
    handshake: Duration,
    /// The connections whose first request has been received.
    connections: Mutex<HashSet<SocketAddr>>,
    bucket: Mutex<Bucket>,
}

/// What the upstream answered so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Totals {
    pub(crate) admitted: usize,
    pub(crate) rejected: usize,
}

/// A 429 the upstream answered: when, after its first request, and how far short of a whole
/// token its bucket was, as time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rejection {
    pub(crate) after_first: Duration,
    pub(crate) early_by: Duration,
}

/// The upstream: `burst` tokens, one more every `per_token`, from its first request on.
pub(crate) struct StrictUpstream {
    pub(crate) url: String,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl StrictUpstream {
    pub(crate) async fn start(per_token: Duration, burst: u32) -> Self {
        Self::with_handshake(per_token, burst, Duration::ZERO).await
    }

    /// As [`start`](Self::start), with the first request of each connection reaching the bucket
    /// `handshake` after the others would.
    pub(crate) async fn with_handshake(
        per_token: Duration,
        burst: u32,
        handshake: Duration,
    ) -> Self {
        let shared = Arc::new(Shared {
            per_token,
            burst: f64::from(burst),
            handshake,
            connections: Mutex::default(),
            bucket: Mutex::default(),
        });
        let app = Router::new()
            .route("/{*path}", get(take))
            .with_state(Arc::clone(&shared));
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a free loopback port");
        let url = format!("http://{}", listener.local_addr().expect("an address"));
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await
        });
        Self {
            url,
            shared,
            stop: Some(stop),
            task: Some(task),
        }
    }

    pub(crate) fn totals(&self) -> Totals {
        let bucket = self
            .shared
            .bucket
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Totals {
            admitted: bucket.admitted,
            rejected: bucket.rejected,
        }
    }

    /// Every 429 answered so far, in order.
    pub(crate) fn rejections(&self) -> Vec<Rejection> {
        let bucket = self
            .shared
            .bucket
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        bucket
            .rejections
            .iter()
            .map(|&(after_first, tokens)| Rejection {
                after_first,
                early_by: self.shared.per_token.mul_f64(1.0 - tokens),
            })
            .collect()
    }

    /// The most the upstream could have admitted between its first request and its last: its
    /// burst, and a token for every period between.
    pub(crate) fn budget(&self) -> usize {
        let bucket = self
            .shared
            .bucket
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let (Some(first), Some(last)) = (bucket.first_at, bucket.last_at) else {
            return 0;
        };
        let periods = (last - first).as_secs_f64() / self.shared.per_token.as_secs_f64();
        // Whole tokens only: a fraction of one admits nothing.
        self.shared.burst as usize + periods.floor() as usize
    }

    pub(crate) async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await
                .expect("the server task")
                .expect("the server ran");
        }
    }
}

async fn take(
    State(shared): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
) -> StatusCode {
    let first_on_connection = shared
        .connections
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(peer);
    if first_on_connection && !shared.handshake.is_zero() {
        tokio::time::sleep(shared.handshake).await;
    }
    let mut bucket = shared.bucket.lock().unwrap_or_else(PoisonError::into_inner);
    // Read under the lock, so that requests are counted in the order of their times.
    let now = Instant::now();
    if bucket.first_at.is_none() {
        bucket.first_at = Some(now);
    }
    bucket.last_at = Some(now);
    let (tokens, at) = bucket.state.unwrap_or((shared.burst, now));
    let refilled = now.saturating_duration_since(at).as_secs_f64() / shared.per_token.as_secs_f64();
    let tokens = (tokens + refilled).min(shared.burst);
    if tokens >= 1.0 {
        bucket.state = Some((tokens - 1.0, now));
        bucket.admitted += 1;
        StatusCode::OK
    } else {
        bucket.state = Some((tokens, now));
        bucket.rejected += 1;
        let after_first = now - bucket.first_at.unwrap_or(now);
        bucket.rejections.push((after_first, tokens));
        StatusCode::TOO_MANY_REQUESTS
    }
}
