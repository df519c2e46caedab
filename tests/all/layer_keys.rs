//! Whose bucket a request draws from when clients try not to be counted: many IPv6 addresses
//! from one network, requests without a key, and forwarded-for headers a client wrote itself.
#![cfg(feature = "tower")]

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use burstgate::layer::{
    ForwardedHeader, Ipv6Prefix, KeyExtractor, MissingKey, RateLimitLayer, Rule, TrustedProxies,
};
use burstgate::{BucketKey, BucketStore, Limit, MemoryStore, TokioClock};
use http::{HeaderName, Request, StatusCode};
use tower::Layer;

use crate::support::layer::{API_KEY, Req, call, counting};
use crate::support::logs;

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

/// Address number `n` of the /64 `net` (its first four groups), spread over the interface id.
fn in_slash64(net: [u16; 4], n: u64) -> IpAddr {
    let id = n.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let high = net.iter().fold(0u128, |acc, &g| acc << 16 | u128::from(g));
    IpAddr::V6(Ipv6Addr::from(high << 64 | u128::from(id)))
}

const NET: [u16; 4] = [0x2001, 0xdb8, 1, 2];

#[tokio::test(start_paused = true)]
async fn ten_thousand_addresses_of_one_ipv6_slash64_are_one_client_not_ten_thousand() {
    let store = MemoryStore::new().with_clock(TokioClock::new());
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
    let store = MemoryStore::new().with_clock(TokioClock::new());
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
    let mut by_128 = RateLimitLayer::new(MemoryStore::new().with_clock(TokioClock::new()))
        .rule(per_ip(
            KeyExtractor::peer_ip().ipv6_prefix(Ipv6Prefix::Slash128),
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
    let mut by_48 = RateLimitLayer::new(MemoryStore::new().with_clock(TokioClock::new()))
        .rule(per_ip(
            KeyExtractor::peer_ip().ipv6_prefix(Ipv6Prefix::Slash48),
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
    let store = MemoryStore::new().with_clock(TokioClock::new());
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

/// A request with no peer address, no API key, and a secret the logs must not show.
fn anonymous() -> Req {
    Request::builder()
        .uri("/orders?token=s3cret")
        .header("authorization", "Bearer s3cret")
        .body(String::new())
        .expect("a valid request")
}

#[tokio::test(start_paused = true)]
async fn a_rule_that_finds_no_key_warns_once_instead_of_limiting_nothing_in_silence() {
    let (log, _guard) = logs::capture();
    let calls = Arc::new(AtomicUsize::new(0));
    let one_per_minute = Limit::per_minute(1).expect("a valid limit");
    let layer = RateLimitLayer::new(MemoryStore::new().with_clock(TokioClock::new()))
        .rule(Rule::new("per-ip", one_per_minute, KeyExtractor::peer_ip()).expect("a valid rule"));
    let mut svc = layer.layer(counting(&calls));
    // Clones, as axum makes one per connection, share the rule and its warning.
    let mut clone = svc.clone();
    let mut another = layer.layer(counting(&calls));
    for n in 0..100 {
        let svc = match n % 3 {
            0 => &mut svc,
            1 => &mut clone,
            _ => &mut another,
        };
        assert_eq!(call(svc, anonymous()).await.status(), StatusCode::OK);
    }
    // Passing is the default for an address the server provides, but it is said.
    assert_eq!(calls.load(Ordering::SeqCst), 100);
    let logged = log.warnings();
    assert_eq!(logged.len(), 1, "{logged:?}");
    assert!(logged[0].contains("bucket=\"per-ip\""), "{logged:?}");
    assert!(logged[0].contains("extractor=\"peer_ip\""), "{logged:?}");
    assert!(!logged[0].contains("s3cret"), "{logged:?}");

    // A header rule refuses by default, and says so once, never showing what the request
    // carried.
    let mut by_key = RateLimitLayer::new(MemoryStore::new().with_clock(TokioClock::new()))
        .rule(Rule::new("per-key", one_per_minute, KeyExtractor::header(API_KEY)).expect("a rule"))
        .layer(counting(&calls));
    for _ in 0..10 {
        let mut req = anonymous();
        req.headers_mut()
            .insert(API_KEY, http::HeaderValue::from_static(""));
        assert_eq!(
            call(&mut by_key, req).await.status(),
            StatusCode::BAD_REQUEST
        );
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        100,
        "none reached the service"
    );
    let logged = log.warnings();
    assert_eq!(logged.len(), 2, "{logged:?}");
    assert!(logged[1].contains("bucket=\"per-key\""), "{logged:?}");
    assert!(logged[1].contains("refused"), "{logged:?}");
    assert!(!logged[1].contains("s3cret"), "{logged:?}");
}

#[tokio::test(start_paused = true)]
async fn missing_key_pass_is_silent() {
    let (log, _guard) = logs::capture();
    let calls = Arc::new(AtomicUsize::new(0));
    let rule = Rule::new("per-key", five_per_hour(), KeyExtractor::header(API_KEY))
        .expect("a valid rule")
        .on_missing_key(MissingKey::Pass);
    let mut svc = RateLimitLayer::new(MemoryStore::new().with_clock(TokioClock::new()))
        .rule(rule)
        .layer(counting(&calls));
    for _ in 0..10 {
        assert_eq!(call(&mut svc, anonymous()).await.status(), StatusCode::OK);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 10);
    assert_eq!(log.warnings(), Vec::<String>::new());
}

#[tokio::test(start_paused = true)]
async fn missing_key_reject_answers_500_without_a_peer_address_and_400_without_the_header() {
    let (log, _guard) = logs::capture();
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let calls = Arc::new(AtomicUsize::new(0));
    let global = Rule::new("global", five_per_hour(), KeyExtractor::global()).expect("a rule");
    let per_ip = Rule::new("per-ip", five_per_hour(), KeyExtractor::peer_ip())
        .expect("a valid rule")
        .on_missing_key(MissingKey::Reject);
    let mut svc = RateLimitLayer::new(store.clone())
        .rule(global.clone())
        .rule(per_ip)
        .layer(counting(&calls));
    for _ in 0..100 {
        let res = call(&mut svc, anonymous()).await;
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(res.body(), "rate limit rule found no client address\n");
        assert!(!res.headers().contains_key("ratelimit"));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    // A refused request took nothing, not even from the rule before.
    let global_bucket = BucketKey::new("global", "global").expect("a valid key");
    let quota = store
        .peek(&global_bucket, five_per_hour())
        .await
        .expect("peeks");
    assert_eq!(quota.remaining(), 5);
    // With an address the rule limits as usual.
    let peer: IpAddr = "192.0.2.7".parse().expect("an address");
    let mut statuses = Vec::new();
    for _ in 0..6 {
        statuses.push(call(&mut svc, from(peer)).await.status().as_u16());
    }
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429]);

    let per_key = Rule::new("per-key", five_per_hour(), KeyExtractor::header(API_KEY))
        .expect("a valid rule")
        .on_missing_key(MissingKey::Reject);
    let mut svc = RateLimitLayer::new(store)
        .rule(per_key)
        .layer(counting(&calls));
    for _ in 0..10 {
        let res = call(&mut svc, anonymous()).await;
        assert_eq!(res.status(), StatusCode::BAD_REQUEST);
        assert_eq!(res.body(), "request has no rate limit key\n");
    }
    let mut keyed = anonymous();
    keyed
        .headers_mut()
        .insert(API_KEY, http::HeaderValue::from_static("k1"));
    assert_eq!(call(&mut svc, keyed).await.status(), StatusCode::OK);
    // Once per rule.
    let logged = log.warnings();
    assert_eq!(logged.len(), 2, "{logged:?}");
    assert!(logged[0].contains("bucket=\"per-ip\"") && logged[1].contains("bucket=\"per-key\""));
}

/// The load balancer's address, in the trusted 10.0.0.0/8; the client's proxy is 10.0.0.3.
const LB: [u8; 4] = [10, 0, 0, 2];
/// The client's real address, which its proxy appends.
const CLIENT: &str = "198.51.100.20";

fn behind_proxies(header: ForwardedHeader) -> KeyExtractor {
    let proxies = TrustedProxies::new(["10.0.0.0/8", "fd00::/8"]).expect("valid networks");
    KeyExtractor::client_ip(proxies.header(header))
}

/// A request from `peer` with `lines` of header `name`, each a separate field line.
fn via(peer: IpAddr, name: &str, lines: &[&str]) -> Req {
    let mut req = from(peer);
    for line in lines {
        let value = http::HeaderValue::from_str(line).expect("a valid header value");
        req.headers_mut().append(
            HeaderName::from_bytes(name.as_bytes()).expect("a name"),
            value,
        );
    }
    req
}

/// Sends `requests` through a layer with one "5 per hour" `client_ip` rule reading `header`;
/// the number admitted and the store.
async fn send_all(
    header: ForwardedHeader,
    requests: impl IntoIterator<Item = Req>,
) -> (usize, MemoryStore<TokioClock>) {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = RateLimitLayer::new(store.clone())
        .rule(per_ip(behind_proxies(header)))
        .layer(counting(&calls));
    for req in requests {
        call(&mut svc, req).await;
    }
    (calls.load(Ordering::SeqCst), store)
}

async fn remaining(store: &MemoryStore<TokioClock>, key: &str) -> u32 {
    let bucket = BucketKey::new("per-ip", key).expect("a valid key");
    store
        .peek(&bucket, five_per_hour())
        .await
        .expect("peeks")
        .remaining()
}

#[tokio::test(start_paused = true)]
async fn clients_behind_a_trusted_load_balancer_get_their_own_buckets_not_its_one() {
    let lb = IpAddr::from(LB);
    let clients = (0..20u8).map(|n| format!("198.51.100.{n}, 10.0.0.3"));
    let requests: Vec<Req> = clients
        .flat_map(|xff| (0..6).map(move |_| xff.clone()))
        .map(|xff| via(lb, "x-forwarded-for", &[&xff]))
        .collect();
    let (admitted, store) = send_all(ForwardedHeader::XForwardedFor, requests).await;
    assert_eq!(admitted, 100, "20 clients, 5 each");
    assert_eq!(
        remaining(&store, "10.0.0.2").await,
        5,
        "the balancer's own bucket is untouched"
    );
}

#[tokio::test(start_paused = true)]
async fn a_client_that_prepends_fake_addresses_to_x_forwarded_for_is_keyed_by_its_real_address() {
    let lb = IpAddr::from(LB);
    let mut requests = Vec::new();
    for n in 0..100u32 {
        let fake = format!("203.0.113.{}, 10.9.{}.1", n % 256, n % 7);
        // The client's own header, and its proxy appending to it, in one line or in two.
        if n % 2 == 0 {
            requests.push(via(
                lb,
                "x-forwarded-for",
                &[&format!("{fake}, {CLIENT}, 10.0.0.3")],
            ));
        } else {
            requests.push(via(
                lb,
                "x-forwarded-for",
                &[&fake, &format!("{CLIENT}, 10.0.0.3")],
            ));
        }
    }
    let (admitted, store) = send_all(ForwardedHeader::XForwardedFor, requests).await;
    assert_eq!(admitted, 5);
    assert_eq!(remaining(&store, CLIENT).await, 0);
}

#[tokio::test(start_paused = true)]
async fn a_client_that_sends_x_forwarded_for_directly_is_keyed_by_its_peer() {
    let direct: IpAddr = CLIENT.parse().expect("an address");
    let requests = (0..100u32).map(|n| {
        // Spoofing a trusted hop too: the header is not read at all.
        let xff = format!("203.0.113.{}, 10.0.0.3", n % 256);
        via(direct, "x-forwarded-for", &[&xff])
    });
    let (admitted, store) = send_all(ForwardedHeader::XForwardedFor, requests).await;
    assert_eq!(admitted, 5);
    assert_eq!(remaining(&store, CLIENT).await, 0);
}

#[tokio::test(start_paused = true)]
async fn an_unreadable_entry_keys_the_request_by_the_trusted_hop_that_wrote_it() {
    let lb = IpAddr::from(LB);
    // The client's garbage is left of its real address and never read.
    let spoofed = (0..50u32).map(|n| {
        let xff = format!("garbage-{n}, {CLIENT}, 10.0.0.3");
        via(lb, "x-forwarded-for", &[&xff])
    });
    let (admitted, store) = send_all(ForwardedHeader::XForwardedFor, spoofed).await;
    assert_eq!(admitted, 5);
    assert_eq!(remaining(&store, CLIENT).await, 0);

    // A proxy that could not name its peer: its requests share its bucket, whatever it wrote.
    let unreadable = ["unknown", "", "not-an-ip", "10.0.0.3:", "[2001:db8::1"];
    let requests = (0..50usize).map(|n| {
        let xff = format!("{CLIENT}, {}, 10.0.0.3", unreadable[n % unreadable.len()]);
        via(lb, "x-forwarded-for", &[&xff])
    });
    let (admitted, store) = send_all(ForwardedHeader::XForwardedFor, requests).await;
    assert_eq!(admitted, 5);
    assert_eq!(remaining(&store, "10.0.0.3").await, 0);
    assert_eq!(remaining(&store, CLIENT).await, 5);
}

#[tokio::test(start_paused = true)]
async fn a_request_from_inside_the_trusted_networks_is_keyed_by_its_farthest_hop() {
    let lb = IpAddr::from(LB);
    let requests = [
        via(lb, "x-forwarded-for", &["10.1.1.1, 10.0.0.3"]),
        via(lb, "x-forwarded-for", &["10.1.1.1", "10.0.0.3"]),
        // No header: the balancer itself (a health check).
        from(lb),
        // A dual-stack socket's IPv4-mapped peer is trusted as its IPv4 address.
        via(
            "::ffff:10.0.0.2".parse().expect("an address"),
            "x-forwarded-for",
            &["10.1.1.1"],
        ),
    ];
    let (admitted, store) = send_all(ForwardedHeader::XForwardedFor, requests).await;
    assert_eq!(admitted, 4);
    assert_eq!(remaining(&store, "10.1.1.1").await, 2);
    assert_eq!(remaining(&store, "10.0.0.2").await, 4);
}

#[tokio::test(start_paused = true)]
async fn forwarded_with_quoted_ipv6_clients_is_read_and_grouped_by_slash64() {
    let lb = IpAddr::from(LB);
    let requests = (0..1_000u64).map(|n| {
        let client = in_slash64(NET, n);
        // The client prepends an element of its own and an X-Forwarded-For, both ignored.
        let line = format!(
            r#"for="[2001:db8:9::{n:x}]", for="[{client}]:4711";proto=https;by=_lb, for=10.0.0.3"#
        );
        let mut req = via(lb, "forwarded", &[&line]);
        req.headers_mut().insert(
            "x-forwarded-for",
            http::HeaderValue::from_static("203.0.113.1"),
        );
        req
    });
    let (admitted, store) = send_all(ForwardedHeader::Forwarded, requests).await;
    assert_eq!(admitted, 5);
    assert_eq!(remaining(&store, "2001:db8:1:2::/64").await, 0);

    // An obfuscated identifier names no address: the proxy that wrote it is the key.
    let requests = (0..10).map(|_| via(lb, "forwarded", &["for=_hidden, for=\"10.0.0.3:80\""]));
    let (admitted, store) = send_all(ForwardedHeader::Forwarded, requests).await;
    assert_eq!(admitted, 5);
    assert_eq!(remaining(&store, "10.0.0.3").await, 0);
}
