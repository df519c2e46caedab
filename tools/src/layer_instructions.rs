//! A fixed number of requests through `RateLimitLayer`, for an instruction count of what one
//! request costs: the same service as the layer bench (`benches/layer.rs`), one peer-IP rule on
//! `MemoryStore` in front of an inner service that answers an empty 200, requests from four
//! clients in turn, on a current-thread tokio runtime.
//!
//! - `admitted`: a limit no run exhausts, so every request goes through and gets its
//!   `RateLimitInfo` and rate-limit fields.
//! - `denied`: "1 per hour", each client's one token spent first, so every request is refused.
//! - `bare`: the inner service alone.
//!
//! A run of none costs the same set-up as a run of many, so the difference between two runs
//! under callgrind, divided by the requests, is what one request costs, to the instruction and
//! the same on every machine, where wall-clock time on a shared one moves by several percent:
//!
//! ```text
//! cargo build --release -p burstgate-tools --bin layer_instructions
//! for n in 0 20000; do
//!     valgrind --tool=callgrind --callgrind-out-file=/tmp/layer-$n.out \
//!         target/release/layer_instructions admitted $n 2>&1 | grep Collected
//! done
//! ```
//!
//! `callgrind_annotate /tmp/layer-20000.out` then shows where the instructions go.

use std::convert::Infallible;
use std::net::SocketAddr;

use burstgate::layer::{KeyExtractor, RateLimitLayer, Rule};
use burstgate::{Limit, MemoryStore};
use clap::{Parser, ValueEnum};
use http::{Request, Response, StatusCode};
use tower::{Layer, Service, ServiceExt};

/// Requests through the layer, for callgrind.
#[derive(Parser)]
#[command(name = "layer_instructions")]
struct Args {
    /// Which path the requests take.
    path: Path,
    /// How many requests.
    requests: u64,
}

#[derive(Clone, Copy, ValueEnum)]
enum Path {
    Admitted,
    Denied,
    Bare,
}

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

/// `requests` requests through `svc`, round robin over the clients; every answer must have
/// `status`.
async fn drive<S, B>(mut svc: S, requests: u64, status: StatusCode)
where
    S: Service<Request<String>, Response = Response<B>, Error = Infallible>,
{
    let clients = clients();
    let mut next = 0;
    for _ in 0..requests {
        let req = request(clients[next]);
        next = (next + 1) % CLIENTS;
        let Ok(ready) = svc.ready().await;
        let Ok(res) = ready.call(req).await;
        assert_eq!(res.status(), status);
        std::hint::black_box(res);
    }
}

fn main() {
    let Args { path, requests } = Args::parse();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async {
        match path {
            Path::Bare => drive(bare(), requests, StatusCode::OK).await,
            Path::Admitted => {
                let layer = limited(Limit::per_second(u32::MAX).expect("a valid limit"));
                // Each client's bucket made before the count, as in a run of none.
                drive(layer.layer(bare()), CLIENTS as u64, StatusCode::OK).await;
                drive(layer.layer(bare()), requests, StatusCode::OK).await;
            }
            Path::Denied => {
                let layer = limited(Limit::per_hour(1).expect("a valid limit"));
                // Each client's one token, spent before the count.
                drive(layer.layer(bare()), CLIENTS as u64, StatusCode::OK).await;
                let denied = StatusCode::TOO_MANY_REQUESTS;
                drive(layer.layer(bare()), requests, denied).await;
            }
        }
    });
}
