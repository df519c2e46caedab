//! What `RateLimitLayer` adds to a request, over the same service without it.
//!
//! One trivial inner service (a `tower::service_fn` answering an empty 200) is driven the way a
//! server drives it: `ready().await`, then `call(req).await` on a fresh request, on a
//! current-thread tokio runtime. Every request carries its client's address as a `SocketAddr`
//! extension, one of a few clients in turn, in all three cases, so building it costs the same
//! everywhere.
//!
//! - `layer/bare`: the inner service alone.
//! - `layer/admitted`: behind a layer with one peer-IP rule on a `MemoryStore` and a limit no run
//!   can exhaust, so every request is admitted and its response gets the `RateLimit-Policy` and
//!   `RateLimit` fields.
//! - `layer/denied`: the same rule with "1 per hour", so after each client's first request every
//!   request is refused and a 429 is built.
//!
//! The overhead is `admitted - bare` (or `denied - bare`). `cargo bench --bench layer --features tower`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use burstgate::layer::{KeyExtractor, RateLimitLayer, Rule};
use burstgate::{Limit, MemoryStore};
use criterion::Criterion;
use http::{Request, Response, StatusCode};
use tower::{Layer, Service, ServiceExt};

/// The distinct clients the requests come from, in turn.
const CLIENTS: usize = 4;

fn clients() -> [SocketAddr; CLIENTS] {
    std::array::from_fn(|i| SocketAddr::from(([10, 0, 0, 1 + i as u8], 40_000 + i as u16)))
}

fn request(from: SocketAddr) -> Request<String> {
    let mut req = Request::new(String::new());
    req.extensions_mut().insert(from);
    req
}

/// The inner service: an empty 200, at once.
fn bare()
-> impl Service<Request<String>, Response = Response<String>, Error = Infallible, Future = impl Send>
+ Clone {
    tower::service_fn(|_req: Request<String>| async { Ok(Response::new(String::new())) })
}

fn limited(limit: Limit) -> RateLimitLayer<MemoryStore> {
    let rule = Rule::new("per-ip", limit, KeyExtractor::peer_ip()).expect("a valid rule");
    RateLimitLayer::new(MemoryStore::new()).rule(rule)
}

/// `iters` requests through `svc`, round robin over the clients; every answer must have `status`.
async fn drive<S, B>(mut svc: S, iters: u64, status: StatusCode) -> Duration
where
    S: Service<Request<String>, Response = Response<B>, Error = Infallible>,
{
    let clients = clients();
    let mut next = 0;
    let start = Instant::now();
    for _ in 0..iters {
        let req = request(clients[next]);
        next = (next + 1) % CLIENTS;
        let Ok(ready) = svc.ready().await;
        let Ok(res) = ready.call(req).await;
        assert_eq!(res.status(), status);
        std::hint::black_box(res);
    }
    start.elapsed()
}

fn layer(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let mut group = c.benchmark_group("layer");

    group.bench_function("bare", |b| {
        b.to_async(&runtime)
            .iter_custom(|iters| drive(bare(), iters, StatusCode::OK));
    });

    let admits = limited(Limit::per_second(u32::MAX).expect("a valid limit"));
    group.bench_function("admitted", |b| {
        b.to_async(&runtime)
            .iter_custom(|iters| drive(admits.layer(bare()), iters, StatusCode::OK));
    });

    let denies = limited(Limit::per_hour(1).expect("a valid limit"));
    // Each client's one token, spent before anything is measured.
    runtime.block_on(async {
        for from in clients() {
            let mut svc = denies.layer(bare());
            let Ok(ready) = svc.ready().await;
            let Ok(res) = ready.call(request(from)).await;
            assert_eq!(res.status(), StatusCode::OK);
        }
    });
    group.bench_function("denied", |b| {
        b.to_async(&runtime)
            .iter_custom(|iters| drive(denies.layer(bare()), iters, StatusCode::TOO_MANY_REQUESTS));
    });

    group.finish();
}

// `main` by hand: `criterion_group!` makes a `pub fn` that the crate's `missing_docs` lint flags.
fn main() {
    let mut criterion = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    layer(&mut criterion);
    criterion.final_summary();
}
