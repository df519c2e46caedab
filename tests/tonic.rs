//! The layer in front of a real tonic server, called by a real tonic client over loopback: a
//! refused call reaches the client as `RESOURCE_EXHAUSTED` with its retry time, not as the
//! `UNAVAILABLE` a gRPC client makes of an HTTP 429.
//!
//! The service is tonic-health's, which needs no code generation; what the layer does is the same
//! for any service.

use std::net::SocketAddr;

use burstgate::layer::{KeyExtractor, MissingKey, RateLimitLayer, Rule};
use burstgate::{Limit, MemoryStore};
use http::HeaderName;
use tokio::net::TcpListener;
use tonic::transport::server::{TcpConnectInfo, TcpIncoming};
use tonic::transport::{Channel, Server};
use tonic::{Code, Request};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

const API_KEY: HeaderName = HeaderName::from_static("x-api-key");

/// Serves tonic's health service behind `layer` on a free loopback port, until the test ends.
async fn serve(layer: RateLimitLayer<MemoryStore>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a free loopback port");
    let addr = listener.local_addr().expect("the listener's address");
    let (_reporter, health) = tonic_health::server::health_reporter();
    tokio::spawn(async move {
        Server::builder()
            .layer(layer)
            .add_service(health)
            .serve_with_incoming(TcpIncoming::from(listener))
            .await
            .expect("the server runs");
    });
    addr
}

async fn client(addr: SocketAddr) -> HealthClient<Channel> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("a valid URI")
        .connect()
        .await
        .expect("the client connects");
    HealthClient::new(channel)
}

fn check(key: Option<&'static str>) -> Request<HealthCheckRequest> {
    let mut req = Request::new(HealthCheckRequest {
        service: String::new(),
    });
    if let Some(key) = key {
        req.metadata_mut()
            .insert("x-api-key", key.parse().expect("ASCII metadata"));
    }
    req
}

fn per_key() -> Rule {
    // 1 a minute, burst 2: nothing refills while the test runs.
    Rule::new(
        "per-key",
        Limit::per_minute(1)
            .and_then(|l| l.with_burst(2))
            .expect("a valid limit"),
        KeyExtractor::header(API_KEY),
    )
    .expect("a valid rule")
}

#[tokio::test]
async fn a_refused_call_is_resource_exhausted_with_its_retry_time() {
    let addr = serve(RateLimitLayer::new(MemoryStore::new()).rule(per_key())).await;
    let mut client = client(addr).await;

    for left in [1, 0] {
        let res = client
            .check(check(Some("k1")))
            .await
            .expect("within the burst");
        let ratelimit = res
            .metadata()
            .get("ratelimit")
            .expect("an admitted call carries the RateLimit field")
            .to_str()
            .expect("ASCII");
        assert!(
            ratelimit.starts_with(&format!("\"per-key\";r={left};t=")),
            "{ratelimit}"
        );
    }

    let status = client
        .check(check(Some("k1")))
        .await
        .expect_err("the third call is over the burst");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(status.message(), "rate limited: retry after 60 s");
    let meta = status.metadata();
    assert_eq!(meta.get("retry-after").expect("Retry-After"), "60");
    let pushback: u64 = meta
        .get("grpc-retry-pushback-ms")
        .expect("the retry pushback")
        .to_str()
        .expect("ASCII")
        .parse()
        .expect("milliseconds");
    // The bucket's next token, to the millisecond: a minute less the time the test took since
    // the first call.
    assert!((50_000..=60_000).contains(&pushback), "{pushback}");
    assert!(
        meta.get("ratelimit-policy").is_some(),
        "a refusal carries the policy"
    );

    // Another key has its own bucket.
    client
        .check(check(Some("k2")))
        .await
        .expect("another key is admitted");
}

#[tokio::test]
async fn a_call_without_its_key_is_invalid_argument() {
    let rule = per_key().on_missing_key(MissingKey::Reject);
    let addr = serve(RateLimitLayer::new(MemoryStore::new()).rule(rule)).await;
    let status = client(addr)
        .await
        .check(check(None))
        .await
        .expect_err("no key, refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(status.message(), "request has no rate limit key");
}

#[tokio::test]
async fn a_tonic_peer_is_keyed_by_its_address() {
    // tonic puts the peer's address in `TcpConnectInfo`, which `peer_ip` does not read; a
    // `from_fn` extractor does.
    let per_peer = Rule::new(
        "per-peer",
        Limit::per_minute(1).expect("a valid limit"),
        KeyExtractor::from_fn(|req| {
            let info = req.extensions.get::<TcpConnectInfo>()?;
            Some(info.remote_addr()?.ip().to_string())
        }),
    )
    .expect("a valid rule")
    .on_missing_key(MissingKey::Reject);
    let addr = serve(RateLimitLayer::new(MemoryStore::new()).rule(per_peer)).await;
    let mut client = client(addr).await;
    client
        .check(check(None))
        .await
        .expect("the peer's one call");
    let status = client
        .check(check(None))
        .await
        .expect_err("the same peer, over its limit");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    let pushback: u64 = status
        .metadata()
        .get("grpc-retry-pushback-ms")
        .expect("the retry pushback")
        .to_str()
        .expect("ASCII")
        .parse()
        .expect("milliseconds");
    // The peer's next token: a minute less the time since its first call.
    assert!((50_000..=60_000).contains(&pushback), "{pushback}");
}

#[tokio::test]
async fn a_grpc_call_is_never_told_a_http_status() {
    // A custom rejection status is for HTTP clients; a gRPC client still reads its refusal.
    let layer = RateLimitLayer::new(MemoryStore::new())
        .rule(per_key())
        .rejection_status(http::StatusCode::SERVICE_UNAVAILABLE)
        .rejection_body(|limited| format!("slow down, {}", limited.bucket()));
    let mut client = client(serve(layer).await).await;
    for _ in 0..2 {
        client
            .check(check(Some("k1")))
            .await
            .expect("within the burst");
    }
    let status = client
        .check(check(Some("k1")))
        .await
        .expect_err("over the burst");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(status.message(), "slow down, per-key");
}
