//! A strict upstream on a real socket: one token bucket, full at the first request it
//! receives, refilled on the monotonic clock in floating point with no tolerance, as an API that
//! publishes a limit and enforces exactly that. A request finds a whole token and is answered
//! 200, or is answered 429 and takes nothing.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
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
}

struct Shared {
    per_token: Duration,
    burst: f64,
    bucket: Mutex<Bucket>,
}

/// What the upstream answered so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Totals {
    pub(crate) admitted: usize,
    pub(crate) rejected: usize,
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
        let shared = Arc::new(Shared {
            per_token,
            burst: f64::from(burst),
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
            axum::serve(listener, app)
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

async fn take(State(shared): State<Arc<Shared>>) -> StatusCode {
    let now = Instant::now();
    let mut bucket = shared.bucket.lock().unwrap_or_else(PoisonError::into_inner);
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
        StatusCode::TOO_MANY_REQUESTS
    }
}
