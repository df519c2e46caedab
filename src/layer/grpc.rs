//! The layer's answers to gRPC requests. A gRPC client reads an HTTP 429 or 503 as `UNAVAILABLE`
//! (the gRPC spec's mapping of HTTP statuses), losing both "you are over your limit" and when to
//! come back. A gRPC call is answered in gRPC's own terms instead: HTTP 200, an empty body, and
//! the status in the headers (a trailers-only response), with the retry time as `retry-after`
//! and as gRPC's retry pushback.

use std::time::Duration;

use bytes::Bytes;
use http::header::CACHE_CONTROL;
use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Response, Version};

use super::headers::ceil_secs;

static GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
static GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// The server's pushback of gRPC's retry design (gRFC A6): milliseconds before a retry.
static GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

/// The content type a gRPC call is answered in, when the request is one: a POST whose content
/// type is `application/grpc` (alone, with a subtype such as `+proto`, or with parameters) over
/// HTTP/2, answered `application/grpc`; or a gRPC-Web call (`application/grpc-web`,
/// `application/grpc-web-text`, with or without a subtype), over any HTTP version, answered in
/// its own content type, without parameters. Anything else, a GET with a gRPC content type or
/// "gRPC" over HTTP/1.1 included, is an HTTP request, refused with an HTTP status. A client can
/// still have its refusal answered as a gRPC-Web one, a 200, by its content type; the answer
/// carries `cache-control: no-store`, so no cache keeps it for anyone else.
pub(crate) fn content_type(
    method: &Method,
    version: Version,
    headers: &HeaderMap,
) -> Option<HeaderValue> {
    if method != Method::POST {
        return None;
    }
    let value = headers.get(CONTENT_TYPE)?;
    let bytes = value.as_bytes();
    let is = |prefix: &[u8]| {
        bytes.len() >= prefix.len()
            && bytes[..prefix.len()].eq_ignore_ascii_case(prefix)
            && matches!(bytes.get(prefix.len()), None | Some(b'+' | b';'))
    };
    // Answered in one of a few fixed content types, never in text the client wrote.
    for (base, with_proto) in [
        (
            "application/grpc-web-text",
            "application/grpc-web-text+proto",
        ),
        ("application/grpc-web", "application/grpc-web+proto"),
    ] {
        if is(base.as_bytes()) {
            let proto = bytes[base.len()..]
                .get(..6)
                .is_some_and(|s| s.eq_ignore_ascii_case(b"+proto"));
            return Some(HeaderValue::from_static(if proto {
                with_proto
            } else {
                base
            }));
        }
    }
    (is(b"application/grpc") && version == Version::HTTP_2)
        .then(|| HeaderValue::from_static("application/grpc"))
}

/// The gRPC status codes the layer answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Code {
    /// A request without the key a rule needs (a missing header).
    InvalidArgument = 3,
    /// Over the limit: the rejection.
    ResourceExhausted = 8,
    /// A misconfigured rule, or a server that gives no peer address.
    Internal = 13,
    /// The store could not decide.
    Unavailable = 14,
}

/// A trailers-only gRPC answer in `content_type`: `code` and `message`, and when the call may be
/// retried. Never stored by a cache: it is a refusal, whatever its HTTP status says.
pub(crate) fn answer(
    content_type: HeaderValue,
    code: Code,
    message: &[u8],
    retry: Option<Duration>,
) -> Response<Bytes> {
    let mut res = Response::new(Bytes::new());
    let headers = res.headers_mut();
    headers.insert(CONTENT_TYPE, content_type);
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(GRPC_STATUS.clone(), HeaderValue::from(code as u16));
    if let Ok(message) = HeaderValue::from_bytes(&percent_encode(message)) {
        headers.insert(GRPC_MESSAGE.clone(), message);
    }
    if let Some(retry) = retry {
        headers.insert(RETRY_AFTER, HeaderValue::from(ceil_secs(retry).max(1)));
        let ms = u64::try_from(retry.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX);
        headers.insert(GRPC_RETRY_PUSHBACK_MS.clone(), HeaderValue::from(ms.max(1)));
    }
    res
}

/// `grpc-message` is percent-encoded UTF-8: every byte outside the printable ASCII range, and
/// `%` itself, becomes `%XX` (the gRPC over HTTP/2 spec).
fn percent_encode(message: &[u8]) -> Vec<u8> {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = Vec::with_capacity(message.len());
    for &b in message {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b);
        } else {
            out.extend_from_slice(&[b'%', HEX[usize::from(b >> 4)], HEX[usize::from(b & 15)]]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_type(value: &'static str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static(value));
        headers
    }

    fn grpc() -> HeaderValue {
        HeaderValue::from_static("application/grpc")
    }

    #[test]
    fn grpc_calls_are_told_apart_by_method_version_and_content_type() {
        let h2 = |value| content_type(&Method::POST, Version::HTTP_2, &with_type(value));
        for native in [
            "application/grpc",
            "application/grpc+proto",
            "application/grpc+json",
            "Application/GRPC",
            "application/grpc;charset=utf-8",
        ] {
            assert_eq!(h2(native), Some(grpc()), "{native}");
        }
        // gRPC-Web, over any version, answered in its own content type.
        for web in [
            "application/grpc-web",
            "application/grpc-web+proto",
            "application/grpc-web-text",
            "application/grpc-web-text+proto",
        ] {
            let h1 = content_type(&Method::POST, Version::HTTP_11, &with_type(web));
            assert_eq!(h1, Some(HeaderValue::from_static(web)), "{web}");
        }
        // Nothing the client wrote beyond those is echoed.
        for (sent, answered) in [
            (
                "application/grpc-web+proto ; x=\"<script>\"",
                "application/grpc-web+proto",
            ),
            ("application/grpc-web+x, text/html", "application/grpc-web"),
            (
                "application/grpc-web-text+json",
                "application/grpc-web-text",
            ),
        ] {
            assert_eq!(
                content_type(&Method::POST, Version::HTTP_11, &with_type(sent)),
                Some(HeaderValue::from_static(answered)),
                "{sent}"
            );
        }
        for other in [
            "application/json",
            "application/grpcx",
            "application/grpc-",
            "application/grpc-foo",
            "application/grp",
            "text/plain",
            "",
        ] {
            assert_eq!(h2(other), None, "{other}");
        }
        assert_eq!(
            content_type(&Method::POST, Version::HTTP_2, &HeaderMap::new()),
            None
        );
        // A client cannot ask for a 200 with a header: not on a GET, not over HTTP/1.1.
        let native = with_type("application/grpc");
        assert_eq!(content_type(&Method::GET, Version::HTTP_2, &native), None);
        assert_eq!(content_type(&Method::POST, Version::HTTP_11, &native), None);
    }

    #[test]
    fn a_rejection_is_a_trailers_only_resource_exhausted() {
        let res = answer(
            grpc(),
            Code::ResourceExhausted,
            b"rate limited: retry after 2 s",
            Some(Duration::from_millis(1500)),
        );
        assert_eq!(res.status(), http::StatusCode::OK);
        assert!(res.body().is_empty());
        let h = res.headers();
        assert_eq!(h["content-type"], "application/grpc");
        assert_eq!(h["cache-control"], "no-store");
        assert_eq!(h["grpc-status"], "8");
        assert_eq!(h["grpc-message"], "rate limited: retry after 2 s");
        assert_eq!(h["retry-after"], "2");
        assert_eq!(h["grpc-retry-pushback-ms"], "1500");
    }

    #[test]
    fn a_failure_without_a_retry_time_has_no_pushback() {
        let res = answer(grpc(), Code::Unavailable, b"rate limiter unavailable", None);
        assert_eq!(res.headers()["grpc-status"], "14");
        assert!(!res.headers().contains_key("retry-after"));
        assert!(!res.headers().contains_key("grpc-retry-pushback-ms"));
    }

    #[test]
    fn the_pushback_is_rounded_up_and_never_zero() {
        let res = answer(
            grpc(),
            Code::ResourceExhausted,
            b"m",
            Some(Duration::from_micros(1)),
        );
        assert_eq!(res.headers()["grpc-retry-pushback-ms"], "1");
        assert_eq!(res.headers()["retry-after"], "1");
        let res = answer(
            grpc(),
            Code::ResourceExhausted,
            b"m",
            Some(Duration::from_micros(2_000_001)),
        );
        assert_eq!(res.headers()["grpc-retry-pushback-ms"], "2001");
        assert_eq!(res.headers()["retry-after"], "3");
    }

    #[test]
    fn messages_are_percent_encoded() {
        assert_eq!(percent_encode(b"100% of 5 s"), b"100%25 of 5 s");
        assert_eq!(percent_encode(b"a\nb"), b"a%0Ab");
        assert_eq!(percent_encode("é".as_bytes()), b"%C3%A9");
        let res = answer(grpc(), Code::Internal, b"quota\n100%", None);
        assert_eq!(res.headers()["grpc-message"], "quota%0A100%25");
    }
}
