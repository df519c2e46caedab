//! An upstream inside the process, for the reqwest middleware's tests of order and spacing.
//!
//! It is the last middleware of a client's chain: it records each request and answers it with a
//! canned response, never calling `next`, so nothing touches a socket and a test can run on
//! tokio's paused clock, where every send time is exact. The tests of the real HTTP path use
//! wiremock instead.

use std::sync::{Arc, Mutex, PoisonError};

use http::{Extensions, StatusCode};
use reqwest::{Request, Response};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};
use tokio::time::Instant;

/// Where requests to the in-process upstream go; no name is ever resolved.
pub(crate) const BASE: &str = "http://upstream.test";

/// One request that reached the upstream.
#[derive(Debug, Clone)]
struct Arrival {
    path: String,
    at: Instant,
}

/// The in-process upstream. Clones share one log.
#[derive(Clone)]
pub(crate) struct Upstream {
    status_for: Arc<dyn Fn(&str) -> StatusCode + Send + Sync>,
    arrivals: Arc<Mutex<Vec<Arrival>>>,
}

impl Upstream {
    /// Answers every request with `status`.
    pub(crate) fn answering(status: StatusCode) -> Self {
        Self::by_path(move |_| status)
    }

    /// Answers each request with the status `status_for` gives its path.
    pub(crate) fn by_path(status_for: impl Fn(&str) -> StatusCode + Send + Sync + 'static) -> Self {
        Self {
            status_for: Arc::new(status_for),
            arrivals: Arc::default(),
        }
    }

    /// A client that sends through `middleware` to this upstream.
    pub(crate) fn client(&self, middleware: impl Middleware) -> ClientWithMiddleware {
        ClientBuilder::new(reqwest::Client::new())
            .with(middleware)
            .with(self.clone())
            .build()
    }

    /// When each request arrived, in whole ms since `start`, in the order they arrived.
    pub(crate) fn sent_ms_since(&self, start: Instant) -> Vec<u128> {
        self.log()
            .iter()
            .map(|a| (a.at - start).as_millis())
            .collect()
    }

    /// How many requests for `path` arrived.
    pub(crate) fn count(&self, path: &str) -> usize {
        self.log().iter().filter(|a| a.path == path).count()
    }

    fn log(&self) -> std::sync::MutexGuard<'_, Vec<Arrival>> {
        self.arrivals.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[async_trait::async_trait]
impl Middleware for Upstream {
    async fn handle(
        &self,
        req: Request,
        _: &mut Extensions,
        _: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let path = req.url().path().to_owned();
        let status = (self.status_for)(&path);
        self.log().push(Arrival {
            path,
            at: Instant::now(),
        });
        let mut answer = http::Response::new(Vec::<u8>::new());
        *answer.status_mut() = status;
        Ok(Response::from(answer))
    }
}
