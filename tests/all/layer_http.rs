//! The tower layer end to end: an axum server on a real socket, a real reqwest client, and the
//! same cases run over `MemoryStore` and over `RedisStore` on a real Redis.
#![cfg(feature = "tower")]

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use burstgate::layer::{KeyExtractor, RateLimitLayer, Rule};
use burstgate::{BucketStore, Limit, MemoryStore};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

#[cfg(feature = "redis")]
use crate::support::redis_server;

/// "1 per minute, burst 10": nothing refills while a test runs.
fn orders() -> Limit {
    Limit::per_minute(1)
        .and_then(|l| l.with_burst(10))
        .expect("a valid limit")
}

fn per_key(limit: Limit) -> Rule {
    Rule::new(
        "per-key",
        limit,
        KeyExtractor::header(http::HeaderName::from_static("x-api-key")),
    )
    .expect("a valid rule")
}

/// A handler answering "ok", behind the layer.
fn app<S: BucketStore + Clone>(store: S, rule: Rule) -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .layer(RateLimitLayer::new(store).rule(rule))
}

/// A server on a free loopback port, stopped by [`Server::stop`].
struct Server {
    url: String,
    stop: oneshot::Sender<()>,
    task: JoinHandle<std::io::Result<()>>,
}

impl Server {
    async fn start(app: Router) -> Self {
        let (listener, url) = listen().await;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await
        });
        Self { url, stop, task }
    }

    /// Serves `app` with the peer's address in each request's extensions.
    #[cfg(feature = "axum")]
    async fn start_with_connect_info(app: Router) -> Self {
        let (listener, url) = listen().await;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .with_graceful_shutdown(async {
                let _ = stopped.await;
            })
            .await
        });
        Self { url, stop, task }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(5), self.task)
            .await
            .expect("the server stops within 5 s")
            .expect("the server task does not panic")
            .expect("the server ran without an I/O error");
    }
}

async fn listen() -> (TcpListener, String) {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a free loopback port");
    let addr: SocketAddr = listener.local_addr().expect("a bound address");
    (listener, format!("http://{addr}/"))
}

/// What the client saw of one response.
#[derive(Debug)]
struct Answer {
    status: u16,
    retry_after: Option<String>,
    policy: Option<String>,
    ratelimit: Option<String>,
    body: String,
}

async fn get_with(client: &reqwest::Client, url: &str, key: Option<&str>) -> Answer {
    let mut req = client.get(url);
    if let Some(key) = key {
        req = req.header("x-api-key", key);
    }
    let res = req.send().await.expect("the server answers");
    let field = |name: &str| {
        res.headers()
            .get(name)
            .map(|v| v.to_str().expect("an ASCII header value").to_owned())
    };
    let (retry_after, policy, ratelimit) = (
        field("retry-after"),
        field("ratelimit-policy"),
        field("ratelimit"),
    );
    let status = res.status().as_u16();
    let body = res.text().await.expect("a body");
    Answer {
        status,
        retry_after,
        policy,
        ratelimit,
        body,
    }
}

/// The cases, each generic over the store, run for every store below.
mod cases {
    use super::*;

    pub(crate) async fn a_thousand_concurrent_requests_for_one_key_admit_exactly_ten<S>(store: S)
    where
        S: BucketStore + Clone,
    {
        let server = Server::start(app(store, per_key(orders()))).await;
        let client = reqwest::Client::new();
        let started = std::time::Instant::now();
        let mut requests = tokio::task::JoinSet::new();
        for _ in 0..1000 {
            let (client, url) = (client.clone(), server.url.clone());
            requests.spawn(async move { get_with(&client, &url, Some("k1")).await });
        }
        let answers = requests.join_all().await;
        let span = started.elapsed();
        assert_eq!(answers.len(), 1000);

        // The next token is one interval, 60 s, after the tenth was taken, measured from each
        // request's own reading of the clock. Every reading and every take fall within `span`,
        // so the seconds announced lie within [60 s - 2 span, 60 s + span], rounded up. (A
        // Redis store reads the clock before its round trip, so a request can be decided after
        // a later reading was stored: its wait is a few ms above 60 s, rightly 61 when rounded.)
        let ceil_secs = |d: Duration| d.as_millis().div_ceil(1000);
        let next_token = ceil_secs(Duration::from_secs(60).saturating_sub(2 * span)).max(1)
            ..=ceil_secs(Duration::from_secs(60) + span);

        let (admitted, refused): (Vec<Answer>, Vec<Answer>) =
            answers.into_iter().partition(|a| a.status == 200);
        assert_eq!(admitted.len(), 10);
        assert_eq!(refused.len(), 990);
        // Each admitted request saw a different number of tokens left, 9 down to 0, and the
        // next token a minute after the first take, whatever is left.
        let mut left: Vec<u32> = admitted
            .iter()
            .map(|a| {
                assert_eq!(a.body, "ok");
                let field = a.ratelimit.as_deref().expect("a RateLimit field");
                let (r, t) = field
                    .strip_prefix("\"per-key\";r=")
                    .and_then(|rest| rest.split_once(";t="))
                    .and_then(|(r, t)| Some((r.parse().ok()?, t.parse().ok()?)))
                    .expect("remaining tokens and the seconds to the next one");
                assert!(next_token.contains(&t), "{field} outside {next_token:?}");
                r
            })
            .collect();
        left.sort_unstable();
        assert_eq!(left, (0..10).collect::<Vec<u32>>());

        for a in &refused {
            assert_eq!(a.status, 429, "{a:?}");
            let secs: u128 = a
                .retry_after
                .as_deref()
                .expect("a Retry-After")
                .parse()
                .expect("whole seconds");
            assert!(next_token.contains(&secs), "{a:?} outside {next_token:?}");
            let ratelimit = format!("\"per-key\";r=0;t={secs}");
            assert_eq!(a.ratelimit.as_deref(), Some(ratelimit.as_str()));
            assert_eq!(a.policy.as_deref(), Some("\"per-key\";q=10;w=600"));
            assert!(a.body.contains(&format!("{secs}")), "{a:?}");
        }
        drop(client);
        server.stop().await;
    }

    pub(crate) async fn another_key_is_unaffected<S>(store: S)
    where
        S: BucketStore + Clone,
    {
        let server = Server::start(app(store, per_key(orders()))).await;
        let client = reqwest::Client::new();
        for _ in 0..10 {
            assert_eq!(get_with(&client, &server.url, Some("k1")).await.status, 200);
        }
        assert_eq!(get_with(&client, &server.url, Some("k1")).await.status, 429);

        for r in (0..10).rev() {
            let a = get_with(&client, &server.url, Some("k2")).await;
            assert_eq!(a.status, 200, "{a:?}");
            let ratelimit = a.ratelimit.expect("a RateLimit field");
            assert!(
                ratelimit.starts_with(&format!("\"per-key\";r={r};t=")),
                "{ratelimit}"
            );
        }
        assert_eq!(get_with(&client, &server.url, Some("k2")).await.status, 429);
        // No key: refused, since the header is the client's to send, and the key's budget is
        // untouched.
        assert_eq!(get_with(&client, &server.url, None).await.status, 400);
        drop(client);
        server.stop().await;
    }

    /// Real time: a real server cannot be paused. Two tokens a second, burst one, so
    /// `Retry-After` is 1 and the test sleeps one second.
    pub(crate) async fn a_client_that_sleeps_retry_after_is_admitted_on_its_first_retry<S>(store: S)
    where
        S: BucketStore + Clone,
    {
        let fast = Limit::per_second(2)
            .and_then(|l| l.with_burst(1))
            .expect("a valid limit");
        let server = Server::start(app(store, per_key(fast))).await;
        let client = reqwest::Client::new();
        assert_eq!(get_with(&client, &server.url, Some("k1")).await.status, 200);
        let refused = get_with(&client, &server.url, Some("k1")).await;
        assert_eq!(refused.status, 429);
        assert_eq!(refused.retry_after.as_deref(), Some("1"));
        // Two requests a second, sustained.
        assert_eq!(refused.policy.as_deref(), Some("\"per-key\";q=2;w=1"));

        tokio::time::sleep(Duration::from_secs(1)).await;
        let retried = get_with(&client, &server.url, Some("k1")).await;
        assert_eq!(retried.status, 200, "{retried:?}");
        drop(client);
        server.stop().await;
    }

    /// Keyed by the peer's IP from axum's `ConnectInfo`: every connection from 127.0.0.1
    /// draws from one bucket, whatever its port.
    #[cfg(feature = "axum")]
    pub(crate) async fn requests_from_one_ip_share_its_bucket<S>(store: S)
    where
        S: BucketStore + Clone,
    {
        let three = Limit::per_minute(1)
            .and_then(|l| l.with_burst(3))
            .expect("a valid limit");
        let rule = Rule::new("per-ip", three, KeyExtractor::peer_ip()).expect("a valid rule");
        let server = Server::start_with_connect_info(app(store.clone(), rule)).await;
        let first = reqwest::Client::new();
        let mut statuses = Vec::new();
        for _ in 0..5 {
            statuses.push(get_with(&first, &server.url, None).await.status);
        }
        assert_eq!(statuses, [200, 200, 200, 429, 429]);

        // Another client opens another connection from another port: the same bucket.
        let second = reqwest::Client::new();
        let a = get_with(&second, &server.url, None).await;
        assert_eq!(a.status, 429, "{a:?}");
        assert_eq!(a.policy.as_deref(), Some("\"per-ip\";q=3;w=180"));

        let bucket = burstgate::BucketKey::new("per-ip", "127.0.0.1").expect("a valid key");
        let quota = store.peek(&bucket, three).await.expect("peeks");
        assert_eq!((quota.burst(), quota.remaining()), (3, 0));
        drop((first, second));
        server.stop().await;
    }
}

fn memory_store() -> MemoryStore {
    MemoryStore::new()
}

#[cfg(feature = "redis")]
async fn redis_store() -> burstgate::RedisStore<redis::aio::MultiplexedConnection> {
    // redis-rs 1.x gives up on a reply after 500 ms by default, and the store after 250 ms. A
    // thousand requests at once, on the two worker threads that also run the server and the
    // client, can queue longer than that in a debug build; a timeout is answered 503, which is
    // not what these cases are about.
    let config =
        redis::AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(10)));
    let conn = redis::Client::open(redis_server::url())
        .expect("a valid Redis URL")
        .get_multiplexed_async_connection_with_config(&config)
        .await
        .expect("a connection to the test Redis");
    burstgate::RedisStore::new(conn)
        .prefix(&redis_server::unique_prefix())
        .expect("a valid prefix")
        .timeout(Duration::from_secs(10))
}

/// One module per case, with a test for each store: `<case>::memory` and `<case>::redis`.
macro_rules! on_every_store {
    ($($(#[$attr:meta])* $case:ident),* $(,)?) => {$(
        $(#[$attr])*
        mod $case {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn memory() {
                super::cases::$case(super::memory_store()).await;
            }

            #[cfg(feature = "redis")]
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn redis() {
                super::cases::$case(super::redis_store().await).await;
            }
        }
    )*};
}

on_every_store!(
    a_thousand_concurrent_requests_for_one_key_admit_exactly_ten,
    another_key_is_unaffected,
    a_client_that_sleeps_retry_after_is_admitted_on_its_first_retry,
    #[cfg(feature = "axum")]
    requests_from_one_ip_share_its_bucket,
);
