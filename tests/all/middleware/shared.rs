//! Buckets shared between clients through a real Redis, on real time: send spacing across
//! clients, two routes on one request, an upstream 429 reaching every client, accounts keyed by
//! token, and tickets after Redis loses its marks.

use super::*;

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use burstgate::middleware::{Ticket, TicketError};
use burstgate::{KeySecret, RedisStore};
use redis::aio::MultiplexedConnection;
use wiremock::{Request as MockRequest, Respond};

/// The stores count whole milliseconds of wall time, so a wait computed from two truncated
/// readings can end up to a millisecond before the instant it aims at; allow two.
const CLOCK_SLACK: Duration = Duration::from_millis(2);

/// The mock server's own request log: when each request reached it, by the test's clock.
#[derive(Debug, Clone, Default)]
struct Arrivals(Arc<Mutex<Vec<Instant>>>);

impl Arrivals {
    /// A responder that records each arrival, then answers with `template`.
    fn answer(&self, template: ResponseTemplate) -> Recorded {
        Recorded {
            arrivals: self.clone(),
            template,
        }
    }

    fn sorted(&self) -> Vec<Instant> {
        let mut times = self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        times.sort();
        times
    }
}

struct Recorded {
    arrivals: Arrivals,
    template: ResponseTemplate,
}

impl Respond for Recorded {
    fn respond(&self, _: &MockRequest) -> ResponseTemplate {
        self.arrivals
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Instant::now());
        self.template.clone()
    }
}

async fn connection() -> MultiplexedConnection {
    redis::Client::open(redis_server::url())
        .expect("a valid Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("a connection to the test Redis")
}

/// A store on a connection of its own, as another process would have.
async fn store(prefix: &str) -> RedisStore<MultiplexedConnection> {
    RedisStore::new(connection().await)
        .prefix(prefix)
        .expect("a valid prefix")
}

/// Runs `n` calls of `f` at once and waits for all of them.
async fn all_at_once<F, T>(n: usize, f: impl Fn() -> F) -> Vec<T>
where
    F: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let tasks: Vec<_> = (0..n).map(|_| tokio::spawn(f())).collect();
    let mut out = Vec::with_capacity(n);
    for task in tasks {
        out.push(task.await.expect("the task finishes"));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_clients_with_their_own_redis_connections_share_one_bucket() {
    let server = MockServer::start().await;
    let arrivals = Arrivals::default();
    let per_client = 20;
    mock(
        &server,
        "/orders",
        arrivals.answer(ResponseTemplate::new(200)),
        2 * per_client,
    )
    .await;
    let orders = limit(1, 50, 3);
    let prefix = redis_server::unique_prefix();
    let make = |store| {
        client(
            RateLimitMiddleware::new(store)
                .route(route("orders", orders, "/orders"))
                .max_wait(Duration::from_secs(10)),
        )
    };
    let clients = [make(store(&prefix).await), make(store(&prefix).await)];
    let url = format!("{}/orders", server.uri());

    let mut tasks = Vec::new();
    for client in &clients {
        let (client, url) = (client.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            all_at_once(per_client as usize, || {
                let (client, url) = (client.clone(), url.clone());
                async move { get(&client, &url, Some("seller-1")).await.ok() }
            })
            .await
        }));
    }
    for task in tasks {
        let statuses = task.await.expect("the client's task finishes");
        assert!(
            statuses.iter().all(|s| *s == Some(StatusCode::OK)),
            "every request is sent: {statuses:?}"
        );
    }

    let sent = arrivals.sorted();
    assert_eq!(sent.len(), 2 * per_client as usize);
    within(&sent, orders, "the bucket");
    server.verify().await;
}

/// `times`, sorted, never hold more requests in a window than `limit`'s burst and what
/// refills over the window, and one more for the timer's rounding.
fn within(times: &[Instant], limit: Limit, what: &str) {
    let period = limit.interval().as_secs_f64() / f64::from(limit.tokens());
    for i in 0..times.len() {
        for j in i..times.len() {
            let window = (times[j] - times[i]).as_secs_f64();
            let count = (j - i + 1) as f64;
            let allowed = f64::from(limit.burst()) + window / period + 1.0;
            assert!(
                count <= allowed,
                "{what}: {count} requests within {window:.3} s, at most {allowed:.2} allowed"
            );
        }
    }
}

/// Two clients, each with its own Redis connection, send to an endpoint with a limit of its
/// own and to another path, both under the account's limit: every request is sent, the
/// endpoint's arrivals keep the endpoint's limit, and all arrivals together the account's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_routes_on_one_request_keep_both_limits_across_clients() {
    let server = MockServer::start().await;
    let (orders_at, stocks_at) = (Arrivals::default(), Arrivals::default());
    let per_client = 10;
    mock(
        &server,
        "/orders",
        orders_at.answer(ResponseTemplate::new(200)),
        2 * per_client,
    )
    .await;
    mock(
        &server,
        "/stocks",
        stocks_at.answer(ResponseTemplate::new(200)),
        2 * per_client,
    )
    .await;
    let endpoint = limit(1, 100, 3);
    let account = limit(1, 50, 2);
    let prefix = redis_server::unique_prefix();
    let make = |store| {
        client(
            RateLimitMiddleware::new(store)
                .route(route("orders", endpoint, "/orders"))
                .route(route("account", account, "/**"))
                .max_wait(Duration::from_secs(10)),
        )
    };
    let clients = [make(store(&prefix).await), make(store(&prefix).await)];
    let mut tasks = Vec::new();
    for client in &clients {
        for at in ["/orders", "/stocks"] {
            let (client, url) = (client.clone(), format!("{}{at}", server.uri()));
            tasks.push(tokio::spawn(async move {
                all_at_once(per_client as usize, || {
                    let (client, url) = (client.clone(), url.clone());
                    async move { get(&client, &url, Some("seller-1")).await.ok() }
                })
                .await
            }));
        }
    }
    for task in tasks {
        let statuses = task.await.expect("the client's task finishes");
        assert!(
            statuses.iter().all(|s| *s == Some(StatusCode::OK)),
            "every request is sent: {statuses:?}"
        );
    }
    let orders = orders_at.sorted();
    let mut all = orders.clone();
    all.extend(stocks_at.sorted());
    all.sort();
    assert_eq!(all.len(), 4 * per_client as usize);
    within(&orders, endpoint, "the endpoint");
    within(&all, account, "the account");
    server.verify().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upstream_429_makes_every_client_back_off_for_the_time_it_names() {
    let server = MockServer::start().await;
    let told = Arrivals::default();
    let after = Arrivals::default();
    Mock::given(method("GET"))
        .and(path("/orders"))
        .respond_with(
            told.answer(ResponseTemplate::new(429).insert_header("X-Ratelimit-Retry", "2")),
        )
        .up_to_n_times(1)
        .with_priority(1)
        .expect(1)
        .mount(&server)
        .await;
    mock(
        &server,
        "/orders",
        after.answer(ResponseTemplate::new(200)),
        2,
    )
    .await;
    // Three tokens in the bucket: without the feedback, both next requests would go at once.
    let orders = limit(1, 100, 3);
    let prefix = redis_server::unique_prefix();
    let make = |store| {
        client(
            RateLimitMiddleware::new(store)
                .route(route("orders", orders, "/orders"))
                .max_wait(Duration::from_secs(10)),
        )
    };
    let told_one = make(store(&prefix).await);
    let other = make(store(&prefix).await);
    let url = format!("{}/orders", server.uri());

    let status = get(&told_one, &url, Some("seller-1")).await;
    assert_eq!(status.ok(), Some(StatusCode::TOO_MANY_REQUESTS));
    let next = [told_one, other].map(|client| {
        let url = url.clone();
        tokio::spawn(async move { get(&client, &url, Some("seller-1")).await.ok() })
    });
    for call in next {
        assert_eq!(
            call.await.expect("the request task finishes"),
            Some(StatusCode::OK)
        );
    }

    let told_at = told.sorted()[0];
    let sent: Vec<Duration> = after.sorted().iter().map(|t| *t - told_at).collect();
    assert_eq!(sent.len(), 2);
    for waited in &sent {
        assert!(
            *waited >= Duration::from_secs(2) - CLOCK_SLACK
                && *waited < Duration::from_millis(3_500),
            "sent after the 429: {sent:?}"
        );
    }
    server.verify().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upstream_429_stops_reservations_already_waiting_in_two_stores() {
    let server = MockServer::start().await;
    let told = Arrivals::default();
    let after = Arrivals::default();
    // The 429 comes back 200 ms after it arrives, while four requests wait their turns.
    Mock::given(method("GET"))
        .and(path("/orders"))
        .respond_with(
            told.answer(
                ResponseTemplate::new(429)
                    .insert_header("X-Ratelimit-Retry", "2")
                    .set_delay(Duration::from_millis(200)),
            ),
        )
        .up_to_n_times(1)
        .with_priority(1)
        .expect(1)
        .mount(&server)
        .await;
    let waiting = 4;
    mock(
        &server,
        "/orders",
        after.answer(ResponseTemplate::new(200)),
        waiting,
    )
    .await;
    // One request per 400 ms, no burst: the waiting ones are slotted at 400, 800, 1200 and
    // 1600 ms, all inside the 2 s the upstream asks for.
    let orders = limit(1, 400, 1);
    let prefix = redis_server::unique_prefix();
    let connect = || async {
        RedisStore::connect(&redis_server::url())
            .await
            .expect("connects")
            .prefix(&prefix)
            .expect("a valid prefix")
    };
    let (one, two) = (connect().await, connect().await);
    let make = |store| {
        client(
            RateLimitMiddleware::new(store)
                .route(route("orders", orders, "/orders"))
                .max_wait(Duration::from_secs(10)),
        )
    };
    let clients = [make(one.clone()), make(two)];
    let url = format!("{}/orders", server.uri());
    let bucket = key("orders", "seller-1");

    let first = {
        let (client, url) = (clients[0].clone(), url.clone());
        tokio::spawn(async move { get(&client, &url, Some("seller-1")).await.ok() })
    };
    peek_until(&one, &bucket, orders, |q| q.remaining() == 0).await;
    let mut calls = Vec::new();
    for i in 0..waiting {
        let (client, url) = (clients[i as usize % 2].clone(), url.clone());
        calls.push(tokio::spawn(async move {
            get(&client, &url, Some("seller-1")).await.ok()
        }));
    }
    // All four are queued, and the 429 has not been fed back yet.
    let queued = peek_until(&one, &bucket, orders, |q| {
        q.next_token_in() > Duration::from_millis(1_500)
    })
    .await;
    assert_eq!(
        queued.halted_until(),
        None,
        "the drain came first: {queued:?}"
    );

    assert_eq!(
        first.await.expect("the first request finishes"),
        Some(StatusCode::TOO_MANY_REQUESTS)
    );
    for call in calls {
        assert_eq!(
            call.await.expect("a waiting request finishes"),
            Some(StatusCode::OK)
        );
    }
    // Nothing reached the upstream within 2 s of the 429 (counted from when the 429's
    // request arrived, 200 ms before the client read the answer), and what came after went
    // one token period apart from there, in their order, none before its turn.
    let told_at = told.sorted()[0];
    let sent: Vec<Duration> = after.sorted().iter().map(|t| *t - told_at).collect();
    assert_eq!(sent.len(), waiting as usize);
    for (i, at) in (0..).zip(&sent) {
        let turn = Duration::from_secs(2) + orders.interval() * i;
        assert!(*at >= turn - CLOCK_SLACK, "sent before its turn: {sent:?}");
    }
    assert!(sent[3] < Duration::from_secs(5), "{sent:?}");
    server.verify().await;
}

#[tokio::test]
async fn an_account_header_keys_by_the_token_and_never_stores_it_in_clear() {
    let server = MockServer::start().await;
    mock(&server, "/orders", ResponseTemplate::new(200), 2).await;
    let orders = Limit::per_hour(1).expect("a valid limit");
    let prefix = redis_server::unique_prefix();
    let store = store(&prefix).await;
    let client = client(
        RateLimitMiddleware::new(store.clone())
            .route(route("orders", orders, "/orders"))
            .account_header(http::header::AUTHORIZATION)
            .max_wait(Duration::ZERO),
    );
    let url = format!("{}/orders", server.uri());
    let tokens = ["Bearer tok-one-S3CRET", "Bearer tok-two-S3CRET"];
    let send = |token: &'static str| {
        client
            .get(&url)
            .header(http::header::AUTHORIZATION, token)
            .send()
    };

    for token in tokens {
        let first = send(token).await.map(|r| r.status());
        assert_eq!(first.ok(), Some(StatusCode::OK), "{token}");
        let again = send(token).await.map(|r| r.status());
        assert_eq!(local_429(again).bucket(), "orders");
    }

    let mut conn = connection().await;
    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query_async(&mut conn)
        .await
        .expect("KEYS");
    keys.sort();
    for k in &keys {
        assert!(
            !k.contains("tok-") && !k.contains("S3CRET") && !k.contains("Bearer"),
            "a token in clear: {k}"
        );
    }
    let mut expected: Vec<String> = tokens
        .iter()
        .map(|t| store.redis_key(&BucketKey::hashed("orders", t).expect("a valid key")))
        .collect();
    expected.sort();
    assert_eq!(keys, expected);
    server.verify().await;
}

/// A middleware on a Redis of the test's own (it is flushed), with "1 per minute, burst 2"
/// on `/orders` and the tickets' secret fixed, and its store.
async fn ticketing(
    redis: &redis_server::Spawned,
) -> (
    RateLimitMiddleware<RedisStore<MultiplexedConnection>>,
    RedisStore<MultiplexedConnection>,
    MultiplexedConnection,
) {
    let conn = redis::Client::open(format!("redis://127.0.0.1:{}/", redis.port))
        .expect("a valid Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("a connection to the test's Redis");
    let store = RedisStore::new(conn.clone())
        .prefix(&redis_server::unique_prefix())
        .expect("a valid prefix");
    let limiter = RateLimitMiddleware::new(store.clone())
        .route(route("orders", limit(1, 60_000, 2), "/orders"))
        .key_secret(KeySecret::new(b"the tests' application secret").expect("a secret"));
    (limiter, store, conn)
}

/// Books a turn of `seller-1` on `url`.
async fn book(
    limiter: &RateLimitMiddleware<RedisStore<MultiplexedConnection>>,
    url: &str,
) -> Ticket {
    let request = reqwest::Client::new().get(url).build().expect("a request");
    let mut account = http::Extensions::new();
    account.insert(Account::new("seller-1"));
    limiter
        .reserve(&request, &account)
        .await
        .expect("booked")
        .expect("a route draws from it")
}

fn ticket_error<T: std::fmt::Debug>(result: Result<T, reqwest_middleware::Error>) -> TicketError {
    match result {
        Err(reqwest_middleware::Error::Middleware(e)) => match e.downcast_ref::<TicketError>() {
            Some(why) => *why,
            None => panic!("a middleware error other than a TicketError: {e:?}"),
        },
        other => panic!("expected a refused ticket, got {other:?}"),
    }
}

async fn flushall(conn: &mut MultiplexedConnection) {
    let _: () = redis::cmd("FLUSHALL")
        .query_async(conn)
        .await
        .expect("FLUSHALL");
}

/// The bug: a ticket's only record of having gone was the mark its sending wrote, so once
/// Redis lost it (here `FLUSHALL`; a restart without persistence, a failover to a replica
/// that lacked it) a job delivered again sent the same ticket a second time. The booking
/// writes the mark now, and a ticket whose mark is gone is refused as expired.
#[tokio::test]
async fn a_ticket_already_sent_does_not_go_again_after_redis_loses_its_mark() {
    let redis = redis_server::spawn("").expect("a redis-server of our own");
    let server = MockServer::start().await;
    mock(&server, "/orders", ResponseTemplate::new(200), 1).await;
    let (limiter, _, mut conn) = ticketing(&redis).await;
    let client = client(limiter.clone());
    let url = format!("{}/orders", server.uri());
    let send = |ticket: &Ticket| {
        client
            .get(&url)
            .with_extension(Account::new("seller-1"))
            .with_extension(ticket.clone())
            .send()
    };

    let ticket = book(&limiter, &url).await;
    let sent = send(&ticket).await.map(|r| r.status());
    assert_eq!(sent.ok(), Some(StatusCode::OK));
    assert_eq!(ticket_error(send(&ticket).await), TicketError::Spent);
    flushall(&mut conn).await;
    let again = send(&ticket).await;
    assert_eq!(
        server.received_requests().await.map(|r| r.len()),
        Some(1),
        "sent again after FLUSHALL: {again:?}"
    );
    assert_eq!(ticket_error(again), TicketError::Expired);
    server.verify().await;
    redis_server::kill(redis);
}

/// A ticket whose mark Redis lost cannot be given back either: the store cannot tell
/// whether it went already, nor whether its tokens are still taken. Refused as expired, and
/// nothing goes back to the bucket.
#[tokio::test]
async fn a_ticket_cancelled_after_redis_lost_its_mark_gives_nothing_back() {
    let redis = redis_server::spawn("").expect("a redis-server of our own");
    let server = MockServer::start().await;
    mock(&server, "/orders", ResponseTemplate::new(200), 1).await;
    let (limiter, store, mut conn) = ticketing(&redis).await;
    let client = client(limiter.clone());
    let url = format!("{}/orders", server.uri());
    let orders = limit(1, 60_000, 2);
    let bucket = key("orders", "seller-1");

    let ticket = book(&limiter, &url).await;
    flushall(&mut conn).await;
    // The bucket is full again; one request takes a token of it.
    assert_eq!(
        get(&client, &url, Some("seller-1")).await.ok(),
        Some(StatusCode::OK)
    );
    assert_eq!(
        store
            .peek(&bucket, orders)
            .await
            .expect("peeks")
            .remaining(),
        1
    );
    assert_eq!(
        ticket_error(limiter.cancel(&ticket).await),
        TicketError::Expired
    );
    assert_eq!(
        store
            .peek(&bucket, orders)
            .await
            .expect("peeks")
            .remaining(),
        1
    );
    // Refused again, the same way, however many times the job is dropped.
    assert_eq!(
        ticket_error(limiter.cancel(&ticket).await),
        TicketError::Expired
    );
    assert_eq!(
        store
            .peek(&bucket, orders)
            .await
            .expect("peeks")
            .remaining(),
        1
    );
    server.verify().await;
    redis_server::kill(redis);
}
