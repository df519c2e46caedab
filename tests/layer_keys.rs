//! Whose bucket a request draws from when clients try not to be counted: many IPv6 addresses
//! from one network, requests without a key, and forwarded-for headers a client wrote itself.
#![cfg(feature = "tower")]

use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use burstgate::layer::{Ipv6Prefix, KeyExtractor, RateLimitLayer, Rule};
use burstgate::{BucketKey, BucketStore, Limit, MemoryStore, TokioClock};
use http::{Request, Response, StatusCode};
use tower::{Layer, Service, ServiceExt};

type Req = Request<String>;
type Res = Response<String>;

/// "5 per hour": nothing refills while a test runs.
fn five_per_hour() -> Limit {
    Limit::per_hour(5).expect("a valid limit")
}

fn per_ip(key: KeyExtractor) -> Rule {
    Rule::new("per-ip", five_per_hour(), key).expect("a valid rule")
}

/// A request from `peer`, as a server puts the peer's address in the extensions.
fn from(peer: IpAddr) -> Req {
    let mut req = Request::new(String::new());
    req.extensions_mut().insert(SocketAddr::new(peer, 40_000));
    req
}

async fn call<S>(svc: &mut S, req: Req) -> Res
where
    S: Service<Req, Response = Res>,
    S::Error: std::fmt::Debug,
{
    svc.ready()
        .await
        .expect("the service is ready")
        .call(req)
        .await
        .expect("the layer answers with a response")
}

/// An inner service that answers "ok" and counts its calls.
fn counting(
    calls: &Arc<AtomicUsize>,
) -> impl Service<
    Req,
    Response = Res,
    Error = Infallible,
    Future = impl Future<Output = Result<Res, Infallible>> + Send + use<>,
> + Clone
+ Send
+ use<> {
    let calls = Arc::clone(calls);
    tower::service_fn(move |_req: Req| {
        calls.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, Infallible>(Response::new(String::from("ok"))) }
    })
}

/// Address number `n` of the /64 `net` (its first four groups), spread over the interface id.
fn in_slash64(net: [u16; 4], n: u64) -> IpAddr {
    let id = n.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let high = net.iter().fold(0u128, |acc, &g| acc << 16 | u128::from(g));
    IpAddr::V6(Ipv6Addr::from(high << 64 | u128::from(id)))
}

const NET: [u16; 4] = [0x2001, 0xdb8, 1, 2];

#[tokio::test(start_paused = true)]
async fn ten_thousand_addresses_of_one_ipv6_slash64_are_one_client_not_ten_thousand() {
    let store = MemoryStore::with_clock(TokioClock::new());
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = RateLimitLayer::new(store.clone())
        .rule(per_ip(KeyExtractor::peer_ip()))
        .layer(counting(&calls));

    let mut admitted = 0;
    for n in 0..10_000 {
        if call(&mut svc, from(in_slash64(NET, n))).await.status() == StatusCode::OK {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 5, "one /64 gets one burst");
    assert_eq!(calls.load(Ordering::SeqCst), 5);

    // The bucket an operator finds in the store is the network's.
    let bucket = BucketKey::new("per-ip", "2001:db8:1:2::/64").expect("a valid key");
    let quota = store.peek(&bucket, five_per_hour()).await.expect("peeks");
    assert_eq!(quota.remaining(), 0);
}

#[tokio::test(start_paused = true)]
async fn another_slash64_has_its_own_bucket_and_slash128_keys_each_address() {
    let store = MemoryStore::with_clock(TokioClock::new());
    let calls = Arc::new(AtomicUsize::new(0));
    let mut by_64 = RateLimitLayer::new(store.clone())
        .rule(per_ip(KeyExtractor::peer_ip()))
        .layer(counting(&calls));
    let mut statuses = Vec::new();
    for n in 0..6 {
        statuses.push(call(&mut by_64, from(in_slash64(NET, n))).await.status());
    }
    // The neighbouring /64 (2001:db8:1:3::/64) is another client.
    for n in 0..6 {
        let ip = in_slash64([0x2001, 0xdb8, 1, 3], n);
        statuses.push(call(&mut by_64, from(ip)).await.status());
    }
    let admitted = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    assert_eq!(admitted, 10, "{statuses:?}");
    assert_eq!(statuses[5], StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(statuses[11], StatusCode::TOO_MANY_REQUESTS);

    // By /128, twenty addresses of one /64 have twenty buckets of five.
    let mut by_128 = RateLimitLayer::new(MemoryStore::with_clock(TokioClock::new()))
        .rule(per_ip(
            KeyExtractor::peer_ip().with_ipv6_prefix(Ipv6Prefix::Slash128),
        ))
        .layer(counting(&calls));
    let mut admitted = 0;
    for n in 0..20 {
        for _ in 0..6 {
            if call(&mut by_128, from(in_slash64(NET, n))).await.status() == StatusCode::OK {
                admitted += 1;
            }
        }
    }
    assert_eq!(admitted, 100);

    // By /48, the two /64s above are one site.
    let mut by_48 = RateLimitLayer::new(MemoryStore::with_clock(TokioClock::new()))
        .rule(per_ip(
            KeyExtractor::peer_ip().with_ipv6_prefix(Ipv6Prefix::Slash48),
        ))
        .layer(counting(&calls));
    let mut admitted = 0;
    for n in 0..6 {
        for net in [NET, [0x2001, 0xdb8, 1, 3]] {
            if call(&mut by_48, from(in_slash64(net, n))).await.status() == StatusCode::OK {
                admitted += 1;
            }
        }
    }
    assert_eq!(admitted, 5);
}

#[tokio::test(start_paused = true)]
async fn an_ipv4_mapped_peer_shares_the_bucket_of_its_ipv4_address() {
    let store = MemoryStore::with_clock(TokioClock::new());
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = RateLimitLayer::new(store.clone())
        .rule(per_ip(KeyExtractor::peer_ip()))
        .layer(counting(&calls));
    let v4: IpAddr = "192.0.2.7".parse().expect("an address");
    let mapped: IpAddr = "::ffff:192.0.2.7".parse().expect("an address");
    for ip in [v4, mapped, v4, mapped, v4, mapped] {
        call(&mut svc, from(ip)).await;
    }
    assert_eq!(calls.load(Ordering::SeqCst), 5);
    let bucket = BucketKey::new("per-ip", "192.0.2.7").expect("a valid key");
    let quota = store.peek(&bucket, five_per_hour()).await.expect("peeks");
    assert_eq!(quota.remaining(), 0);
}
