//! The answers the layer gives instead of calling the inner service: the rejection of a refused
//! request (429 by default, with `Retry-After`, `RateLimit-Policy` and `RateLimit`), and the
//! plain-text errors when a rule cannot key a request or the store cannot decide.

use std::sync::Arc;
use std::time::Duration;

use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderValue, Response, StatusCode};

use super::headers::{Fields, ceil_secs, decimal};
use crate::{RateLimited, StoreError};

type BodyFn = Arc<dyn Fn(&RateLimited) -> String + Send + Sync>;

/// How a rejection is answered; the defaults are 429, the standard headers and a short text.
#[derive(Clone)]
pub(crate) struct Rejection {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Option<BodyFn>,
}

impl Default for Rejection {
    fn default() -> Self {
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            headers: HeaderMap::new(),
            body: None,
        }
    }
}

impl Rejection {
    /// The rejection for a request that could go in `retry_after`. `limited` describes it to a
    /// custom body, and is only built for one.
    pub(crate) fn respond<B: From<String>>(
        &self,
        retry_after: Duration,
        limited: impl FnOnce() -> RateLimited,
        fields: Option<Fields>,
    ) -> Response<B> {
        // Never 0: a client told "retry after 0" would come straight back and be refused again.
        let secs = ceil_secs(retry_after).max(1);
        let body = match &self.body {
            Some(f) => f(&limited()),
            None => {
                let mut body = String::with_capacity(48);
                body.push_str("rate limited: retry after ");
                body.extend(decimal(secs, &mut [0; 20]).iter().map(|&d| char::from(d)));
                body.push_str(" s\n");
                body
            }
        };
        let mut res = Response::new(B::from(body));
        *res.status_mut() = self.status;
        let headers = res.headers_mut();
        headers.reserve(4 + self.headers.len());
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        headers.insert(RETRY_AFTER, HeaderValue::from(secs));
        if let Some(fields) = fields {
            fields.insert_into(headers);
        }
        for (name, value) in &self.headers {
            headers.insert(name.clone(), value.clone());
        }
        res
    }
}

/// A plain-text answer: for a request no rule could key, or when the store cannot decide (Redis
/// down, a misconfigured cost).
pub(crate) fn failure<B: From<String>>(status: StatusCode, message: &str) -> Response<B> {
    let mut res = Response::new(B::from(format!("{message}\n")));
    *res.status_mut() = status;
    res.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    res
}

/// The body of a refusal for a missing key: the request's fault or the server's.
pub(crate) fn missing_body(status: StatusCode) -> &'static str {
    if status.is_client_error() {
        "request has no rate limit key"
    } else {
        "rate limit rule found no client address"
    }
}

/// The answer when the store could not decide: a 500 for a misconfigured rule, else a 503 (with
/// `Retry-After` while the store's circuit breaker is open). The rule loop logged it.
pub(crate) fn store_failure<B: From<String>>(e: &StoreError) -> Response<B> {
    match e {
        StoreError::ZeroCost | StoreError::CostAboveBurst { .. } => failure(
            StatusCode::INTERNAL_SERVER_ERROR,
            "rate limit rule misconfigured",
        ),
        StoreError::Unavailable { retry_in } => {
            let mut res = failure(
                StatusCode::SERVICE_UNAVAILABLE,
                "rate limiter unavailable, try again shortly",
            );
            let secs = ceil_secs(*retry_in).max(1);
            res.headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(secs));
            res
        }
        _ => failure(
            StatusCode::SERVICE_UNAVAILABLE,
            "rate limiter unavailable, try again shortly",
        ),
    }
}
