//! An axum server that limits each API key with burstgate's tower layer.
//!
//! Every request to `/` must carry an `x-api-key` header (the layer answers `400` without one).
//! Each key gets its own token bucket: by default 10 requests per second with a burst of 10. A request over the limit is answered
//! `429 Too Many Requests` with `Retry-After`, `RateLimit-Policy` and `RateLimit`; admitted ones
//! carry `RateLimit`.
//!
//! Settings, all from the environment:
//!
//! - `BIND`: the address to listen on (default `127.0.0.1:3000`; port 0 picks a free one);
//! - `RATE`: tokens per second (default 10);
//! - `BURST`: the bucket's capacity (default 10);
//! - `REDIS_URL`: when set, the buckets live in that Redis (keys under `burstgate-example:`),
//!   shared by every copy of the server that reaches it; otherwise they live in this process.
//!   While that Redis is away, the server decides in its own memory, each key with the whole
//!   limit, and goes back to Redis when it returns (the layer's default `OutagePolicy`);
//! - `SHADOW`: `1` puts the limit in shadow mode: requests over it are counted as
//!   `shadow_limited` and let through (`0` or unset: enforced);
//! - `METRICS_BIND`: with the `metrics` feature, serves the metrics in Prometheus's text format
//!   at `/metrics` on this address (e.g. `127.0.0.1:9100`).
//!
//! ```sh
//! BIND=127.0.0.1:3000 cargo run --example axum_server --features tower
//! curl -i -H 'x-api-key: k1' http://127.0.0.1:3000/
//!
//! METRICS_BIND=127.0.0.1:9100 cargo run --example axum_server --features tower,metrics
//! curl http://127.0.0.1:9100/metrics
//! ```
//!
//! The `flood` tool (`tools/src/flood.rs`, `cargo run -p burstgate-tools --bin flood`) checks
//! the promise from outside: `burst + rate × elapsed` admissions under load, and well-formed
//! 429s.

use std::env;
use std::error::Error;
use std::fmt;
use std::net::SocketAddr;

use axum::Router;
use axum::http::HeaderName;
use axum::routing::get;
use burstgate::layer::{KeyExtractor, Rule};
use burstgate::{BucketStore, Limit, MemoryStore, RateLimitLayer};

/// The header that names the client, and so its bucket.
static API_KEY: HeaderName = HeaderName::from_static("x-api-key");

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let bind: SocketAddr = match var("BIND")? {
        Some(v) => v.parse().map_err(|e| {
            Startup(format!(
                "BIND must be an address such as 127.0.0.1:3000, got {v:?}: {e}"
            ))
        })?,
        None => SocketAddr::from(([127, 0, 0, 1], 3000)),
    };
    let rate = positive_env("RATE", 10)?;
    let burst = positive_env("BURST", 10)?;
    let limit = Limit::per_second(rate)
        .and_then(|l| l.with_burst(burst))
        .map_err(|e| Startup(format!("RATE={rate} BURST={burst}: {e}")))?;

    let shadow = match var("SHADOW")?.as_deref().map(str::trim) {
        None | Some("0") => false,
        Some("1") => true,
        Some(v) => return Err(Startup(format!("SHADOW must be 0 or 1, got {v:?}")).into()),
    };
    // Before the first request: each rule registers its counters with the recorder installed
    // when it first decides.
    if let Some(addr) = var("METRICS_BIND")? {
        serve_metrics(&addr).await?;
    }

    let (app, store) = match var("REDIS_URL")? {
        Some(url) => redis_app(&url, limit, shadow).await?,
        None => (app(MemoryStore::new(), limit, shadow)?, "memory".to_owned()),
    };

    let listener = tokio::net::TcpListener::bind(bind)
        .await
        .map_err(|e| Startup(format!("cannot listen on {bind}: {e}")))?;
    println!(
        "listening on http://{}, store: {store}, limit per x-api-key: {rate} per second, burst {burst}{}",
        listener.local_addr()?,
        if shadow { " (shadow mode)" } else { "" }
    );
    axum::serve(listener, app).await?;
    Ok(())
}

/// Installs the Prometheus recorder and serves what it renders at `/metrics` on `addr`.
#[cfg(feature = "metrics")]
async fn serve_metrics(addr: &str) -> Result<(), Box<dyn Error>> {
    let addr: SocketAddr = addr.parse().map_err(|e| {
        Startup(format!(
            "METRICS_BIND must be an address such as 127.0.0.1:9100, got {addr:?}: {e}"
        ))
    })?;
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| Startup(format!("cannot install the metrics recorder: {e}")))?;
    burstgate::metrics::describe();
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Startup(format!("cannot listen on {addr}: {e}")))?;
    println!("metrics at http://{}/metrics", listener.local_addr()?);
    let metrics = Router::new().route("/metrics", get(move || std::future::ready(handle.render())));
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, metrics).await {
            eprintln!("the metrics server stopped: {e}");
        }
    });
    Ok(())
}

#[cfg(not(feature = "metrics"))]
async fn serve_metrics(_addr: &str) -> Result<(), Box<dyn Error>> {
    Err(
        Startup("METRICS_BIND is set, but this build lacks the `metrics` feature".to_owned())
            .into(),
    )
}

/// The router: one route, limited per API key on `store`.
fn app<St>(store: St, limit: Limit, shadow: bool) -> Result<Router, Box<dyn Error>>
where
    St: BucketStore + Clone + Send + Sync + 'static,
{
    let layer = RateLimitLayer::new(store)
        .rule(Rule::new(
            "per-key",
            limit,
            KeyExtractor::header(API_KEY.clone()),
        )?)
        .shadow(shadow);
    Ok(Router::new().route("/", get(hello)).layer(layer))
}

/// The router on the Redis named by `url`, and how to describe the store without the URL (it may
/// hold a password).
#[cfg(feature = "redis")]
async fn redis_app(
    url: &str,
    limit: Limit,
    shadow: bool,
) -> Result<(Router, String), Box<dyn Error>> {
    let client =
        redis::Client::open(url).map_err(|e| Startup(format!("REDIS_URL is not valid: {e}")))?;
    let addr = client.get_connection_info().addr().to_string();
    let conn = client
        .get_connection_manager()
        .await
        .map_err(|e| Startup(format!("cannot connect to Redis at {addr}: {e}")))?;
    let store = burstgate::RedisStore::new(conn).prefix("burstgate-example")?;
    let app = app(store, limit, shadow)?;
    Ok((app, format!("redis at {addr}, prefix burstgate-example")))
}

#[cfg(not(feature = "redis"))]
async fn redis_app(
    _url: &str,
    _limit: Limit,
    _shadow: bool,
) -> Result<(Router, String), Box<dyn Error>> {
    Err(Startup("REDIS_URL is set, but this build lacks the `redis` feature".to_owned()).into())
}

/// The handler. A request without an API key never reaches it: a rule keyed on a header answers
/// those `400` itself, so leaving the header out is no way around the limit.
async fn hello() -> &'static str {
    "hello\n"
}

/// A whole number of at least 1 from the environment variable `name`, or `default` when unset.
fn positive_env(name: &str, default: u32) -> Result<u32, Startup> {
    let Some(v) = var(name)? else {
        return Ok(default);
    };
    match v.trim().parse::<u32>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(Startup(format!(
            "{name} must be a whole number from 1 to {}, got {v:?}",
            u32::MAX
        ))),
    }
}

/// The environment variable `name`, `None` when unset.
fn var(name: &str) -> Result<Option<String>, Startup> {
    match env::var(name) {
        Ok(v) => Ok(Some(v)),
        Err(env::VarError::NotPresent) => Ok(None),
        Err(env::VarError::NotUnicode(v)) => {
            Err(Startup(format!("{name} is not valid UTF-8: {v:?}")))
        }
    }
}

/// A setting or start-up failure, in words. Its `Debug` is its message, because that is what
/// `main` prints when it returns an error.
struct Startup(String);

impl fmt::Debug for Startup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Display for Startup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Error for Startup {}
