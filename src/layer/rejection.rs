//! The answers the layer gives instead of calling the inner service: the rejection of a refused
//! request (429 by default, with `Retry-After`, `RateLimit-Policy` and `RateLimit`), and the
//! plain-text errors when a rule cannot key a request or the store cannot decide. A gRPC call
//! gets each in gRPC's terms ([`grpc`](super::grpc)).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderValue, Method, Response, StatusCode, Version};

use super::grpc::{self, Code};
use super::headers::{Fields, ceil_secs, decimal};
use crate::{RateLimited, StoreError};

type BodyFn = Arc<dyn Fn(&RateLimited) -> String + Send + Sync>;

/// How the request being answered speaks: a gRPC call must be answered in gRPC's terms, in the
/// content type it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Protocol {
    Http,
    Grpc(HeaderValue),
}

impl Protocol {
    pub(crate) fn of(method: &Method, version: Version, headers: &HeaderMap) -> Self {
        match grpc::content_type(method, version, headers) {
            Some(content_type) => Self::Grpc(content_type),
            None => Self::Http,
        }
    }
}

/// The body of an HTTP rejection.
#[derive(Clone, Default)]
pub(crate) enum RejectionBody {
    /// A line of text with the seconds to wait.
    #[default]
    Text,
    /// The draft's `quota-exceeded` problem details (RFC 9457), as `application/problem+json`.
    Problem,
    /// The application's own text.
    Custom(BodyFn),
}

/// How a rejection is answered; the defaults are 429, the standard headers and a short text.
#[derive(Clone)]
pub(crate) struct Rejection {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: RejectionBody,
}

impl Default for Rejection {
    fn default() -> Self {
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            headers: HeaderMap::new(),
            body: RejectionBody::Text,
        }
    }
}

/// The content types of the layer's answers, checked when the crate is compiled: a
/// `HeaderValue::from_static` of a value chosen at run time checks its bytes on every call.
const TEXT_PLAIN: HeaderValue = HeaderValue::from_static("text/plain; charset=utf-8");
const PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

/// The problem type draft-ietf-httpapi-ratelimit-headers registers for a refused request.
const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

impl Rejection {
    /// The rejection for a request that could go in `retry_after`, refused by the rule named
    /// `rule`. `limited` describes it to a custom body, and is only built for one.
    pub(crate) fn respond(
        &self,
        protocol: Protocol,
        retry_after: Duration,
        rule: &str,
        limited: impl FnOnce() -> RateLimited,
        fields: Option<Fields>,
    ) -> Response<Bytes> {
        // Never 0: a client told "retry after 0" would come straight back and be refused again.
        let secs = ceil_secs(retry_after).max(1);
        let text = |end: &str| {
            const START: &str = "rate limited: retry after ";
            let mut digits = [0; 20];
            let digits = decimal(secs, &mut digits);
            // Sized exactly: `Bytes` takes a full vector as it is, and one with room to spare
            // only with an allocation more.
            let mut body = Vec::with_capacity(START.len() + digits.len() + 2 + end.len());
            body.extend_from_slice(START.as_bytes());
            body.extend_from_slice(digits);
            body.extend_from_slice(b" s");
            body.extend_from_slice(end.as_bytes());
            body
        };
        // The status must stay 200 for a gRPC client to read the gRPC status; a custom body
        // becomes the status message.
        if let Protocol::Grpc(content_type) = protocol {
            let message = match &self.body {
                RejectionBody::Custom(f) => f(&limited()).into_bytes(),
                RejectionBody::Text | RejectionBody::Problem => text(""),
            };
            let mut res = grpc::answer(
                content_type,
                Code::ResourceExhausted,
                &message,
                Some(retry_after),
            );
            self.add_headers(res.headers_mut(), fields);
            return res;
        }
        let (body, content_type) = match &self.body {
            RejectionBody::Text => (text("\n"), TEXT_PLAIN),
            RejectionBody::Problem => (problem(self.status, secs, rule).into_bytes(), PROBLEM_JSON),
            RejectionBody::Custom(f) => (f(&limited()).into_bytes(), TEXT_PLAIN),
        };
        // Built in place, once: a response moved out of a match is a copy of its whole head.
        let mut res = Response::new(Bytes::from(body));
        *res.status_mut() = self.status;
        let headers = res.headers_mut();
        headers.reserve(4 + self.headers.len());
        headers.insert(CONTENT_TYPE, content_type);
        headers.insert(RETRY_AFTER, HeaderValue::from(secs));
        self.add_headers(headers, fields);
        res
    }

    /// The rate-limit fields and the application's own headers, on a rejection.
    fn add_headers(&self, headers: &mut HeaderMap, fields: Option<Fields>) {
        if let Some(fields) = fields {
            fields.insert_into(headers);
        }
        for (name, value) in &self.headers {
            headers.insert(name.clone(), value.clone());
        }
    }
}

/// The draft's `quota-exceeded` problem details for a refusal by `rule`.
fn problem(status: StatusCode, secs: u64, rule: &str) -> String {
    // A rule's name is a bucket name, letters, digits, `_`, `.` and `-` only: nothing in it
    // needs escaping in a JSON string.
    debug_assert!(
        rule.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    );
    format!(
        "{{\"type\":\"{QUOTA_EXCEEDED}\",\"title\":\"Quota Exceeded\",\"status\":{},\
         \"detail\":\"retry after {secs} s\",\"violated-policies\":[\"{rule}\"]}}",
        status.as_u16()
    )
}

/// A plain-text answer (or its gRPC equivalent): for a request no rule could key, or when the
/// store cannot decide (Redis down, a misconfigured cost).
pub(crate) fn failure(
    protocol: Protocol,
    status: StatusCode,
    message: &str,
    retry: Option<Duration>,
) -> Response<Bytes> {
    if let Protocol::Grpc(content_type) = protocol {
        let code = match status {
            StatusCode::SERVICE_UNAVAILABLE => Code::Unavailable,
            s if s.is_client_error() => Code::InvalidArgument,
            _ => Code::Internal,
        };
        return grpc::answer(content_type, code, message.as_bytes(), retry);
    }
    let mut res = Response::new(Bytes::from(format!("{message}\n")));
    *res.status_mut() = status;
    let headers = res.headers_mut();
    headers.insert(CONTENT_TYPE, TEXT_PLAIN);
    if let Some(retry) = retry {
        headers.insert(RETRY_AFTER, HeaderValue::from(ceil_secs(retry).max(1)));
    }
    res
}

/// The answer to a request a rule could not key: the request's fault or the server's.
pub(crate) fn missing_key(protocol: Protocol, status: StatusCode) -> Response<Bytes> {
    let message = if status.is_client_error() {
        "request has no rate limit key"
    } else {
        "rate limit rule found no client address"
    };
    failure(protocol, status, message, None)
}

/// The answer when the store could not decide: a 500 for a misconfigured rule, else a 503 (with
/// `Retry-After` while the store's circuit breaker is open). The rule loop logged it.
pub(crate) fn store_failure(protocol: Protocol, e: &StoreError) -> Response<Bytes> {
    match e {
        StoreError::ZeroCost | StoreError::CostAboveBurst { .. } => failure(
            protocol,
            StatusCode::INTERNAL_SERVER_ERROR,
            "rate limit rule misconfigured",
            None,
        ),
        StoreError::Unavailable { retry_in } => failure(
            protocol,
            StatusCode::SERVICE_UNAVAILABLE,
            "rate limiter unavailable, try again shortly",
            Some(*retry_in),
        ),
        _ => failure(
            protocol,
            StatusCode::SERVICE_UNAVAILABLE,
            "rate limiter unavailable, try again shortly",
            None,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grpc_call() -> Protocol {
        Protocol::Grpc(HeaderValue::from_static("application/grpc"))
    }

    #[test]
    fn the_problem_details_are_the_drafts_quota_exceeded() {
        let rejection = Rejection {
            body: RejectionBody::Problem,
            ..Rejection::default()
        };
        let res = rejection.respond(
            Protocol::Http,
            Duration::from_millis(1200),
            "per-key",
            || unreachable!("only a custom body asks for it"),
            None,
        );
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(res.headers()["content-type"], "application/problem+json");
        assert_eq!(res.headers()["retry-after"], "2");
        let json: serde_json::Value = serde_json::from_slice(res.body()).expect("JSON");
        assert_eq!(
            json,
            serde_json::json!({
                "type": QUOTA_EXCEEDED,
                "title": "Quota Exceeded",
                "status": 429,
                "detail": "retry after 2 s",
                "violated-policies": ["per-key"],
            })
        );
    }

    #[test]
    fn a_grpc_rejection_ignores_the_http_status_and_keeps_custom_headers() {
        let mut rejection = Rejection {
            status: StatusCode::SERVICE_UNAVAILABLE,
            ..Rejection::default()
        };
        rejection
            .headers
            .insert("x-why", HeaderValue::from_static("quota"));
        let res = rejection.respond(
            grpc_call(),
            Duration::from_secs(3),
            "per-key",
            || unreachable!(),
            None,
        );
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.headers()["grpc-status"], "8");
        assert_eq!(
            res.headers()["grpc-message"],
            "rate limited: retry after 3 s"
        );
        assert_eq!(res.headers()["grpc-retry-pushback-ms"], "3000");
        assert_eq!(res.headers()["x-why"], "quota");
        assert!(res.body().is_empty());
    }

    #[test]
    fn failures_map_to_grpc_codes() {
        let code = |res: Response<Bytes>| res.headers()["grpc-status"].clone();
        assert_eq!(code(missing_key(grpc_call(), StatusCode::BAD_REQUEST)), "3");
        assert_eq!(
            code(missing_key(grpc_call(), StatusCode::INTERNAL_SERVER_ERROR)),
            "13"
        );
        assert_eq!(
            code(store_failure(grpc_call(), &StoreError::ZeroCost)),
            "13"
        );
        let open = StoreError::Unavailable {
            retry_in: Duration::from_millis(250),
        };
        let res = store_failure(grpc_call(), &open);
        assert_eq!(res.headers()["grpc-status"], "14");
        assert_eq!(res.headers()["grpc-retry-pushback-ms"], "250");
        let res = store_failure(Protocol::Http, &open);
        assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(res.headers()["retry-after"], "1");
    }
}
