//! Requests through a client in front of an in-process upstream, on tokio's paused clock.

use super::*;

use std::num::NonZeroU32;
use std::time::SystemTime;

use http::StatusCode;

use crate::{BucketKey, BucketStore, Claim, Decision, Limit, ManualClock, MemoryStore, StoreError};

/// A canned answer: a status and headers.
type Answer = (StatusCode, Vec<(&'static str, String)>);

/// An upstream that answers the `n`th request (from 0) with the status and headers `answer`
/// gives, and logs when each request arrived; no network.
#[derive(Clone)]
struct Reporting {
    answer: Arc<dyn Fn(usize) -> Answer + Send + Sync>,
    arrivals: Arc<std::sync::Mutex<Vec<tokio::time::Instant>>>,
    /// How long each answer takes to come back.
    delay: Duration,
}

impl Reporting {
    fn new(answer: impl Fn(usize) -> Answer + Send + Sync + 'static) -> Self {
        Self {
            answer: Arc::new(answer),
            arrivals: Arc::default(),
            delay: Duration::ZERO,
        }
    }

    fn sent_ms(&self, start: tokio::time::Instant) -> Vec<u64> {
        self.arrivals
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .map(|at| (*at - start).as_millis() as u64)
            .collect()
    }
}

#[async_trait::async_trait]
impl reqwest_middleware::Middleware for Reporting {
    async fn handle(
        &self,
        _req: Request,
        _extensions: &mut Extensions,
        _next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let n = {
            let mut arrivals = self
                .arrivals
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            arrivals.push(tokio::time::Instant::now());
            arrivals.len() - 1
        };
        let (status, headers) = (self.answer)(n);
        tokio::time::sleep(self.delay).await;
        let mut answer = http::Response::new(Vec::<u8>::new());
        *answer.status_mut() = status;
        for (name, value) in headers {
            answer.headers_mut().append(
                name,
                http::HeaderValue::from_str(&value).expect("a header value"),
            );
        }
        Ok(Response::from(answer))
    }
}

fn two(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("not zero")
}

/// "1 a second, burst 1" for the account `seller-1`, on paused time, in front of `upstream`.
fn booked_client(
    upstream: &Reporting,
) -> (
    RateLimitMiddleware<MemoryStore<crate::TokioClock>, crate::TokioClock>,
    reqwest_middleware::ClientWithMiddleware,
) {
    let clock = crate::TokioClock::new();
    let limiter = RateLimitMiddleware::new(MemoryStore::with_clock(clock))
        .with_clock(clock)
        .route(
            Route::new("api", Limit::per_second(1).expect("a limit"), "/orders").expect("a route"),
        )
        .key_secret(ticket_secret())
        .max_wait(Duration::from_secs(60));
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(limiter.clone())
        .with(upstream.clone())
        .build();
    (limiter, client)
}

fn ticket_secret() -> crate::KeySecret {
    crate::KeySecret::new(b"the tests' application secret").expect("a secret")
}

fn account(name: &str) -> Extensions {
    let mut e = Extensions::new();
    e.insert(Account::new(name));
    e
}

fn orders_request() -> Request {
    reqwest::Client::new()
        .get("http://upstream.test/orders")
        .build()
        .expect("a request")
}

async fn send_booked(
    client: &reqwest_middleware::ClientWithMiddleware,
    who: &str,
    ticket: Option<Ticket>,
) -> reqwest_middleware::Result<StatusCode> {
    let mut request = client
        .get("http://upstream.test/orders")
        .with_extension(Account::new(who));
    if let Some(ticket) = ticket {
        request = request.with_extension(ticket);
    }
    request.send().await.map(|r| r.status())
}

#[tokio::test(start_paused = true)]
async fn a_booked_request_goes_at_its_time_without_another_token() {
    let upstream = Reporting::new(|_| (StatusCode::OK, Vec::new()));
    let (limiter, client) = booked_client(&upstream);
    let start = tokio::time::Instant::now();
    let now = limiter
        .reserve(&orders_request(), &account("seller-1"))
        .await;
    let later = limiter
        .reserve(&orders_request(), &account("seller-1"))
        .await;
    let (now, later) = (
        now.expect("booked").expect("a route"),
        later.expect("booked").expect("a route"),
    );
    assert_eq!(later.ready_at(), now.ready_at() + Duration::from_secs(1));
    // The job kept it as text, and read it back.
    let later: Ticket = later.to_string().parse().expect("a ticket");

    send_booked(&client, "seller-1", Some(now))
        .await
        .expect("sent at once");
    // Half a second early: refused here, told how long is left.
    tokio::time::advance(Duration::from_millis(500)).await;
    let early = send_booked(&client, "seller-1", Some(later.clone()))
        .await
        .expect_err("early");
    let limited = rate_limited(&early).expect("the local 429");
    assert_eq!(limited.retry_after(), Duration::from_millis(500));
    tokio::time::advance(Duration::from_millis(500)).await;
    send_booked(&client, "seller-1", Some(later))
        .await
        .expect("sent at its time");
    // Two tokens taken in all: the next request, unbooked, waits its second.
    send_booked(&client, "seller-1", None).await.expect("sent");
    assert_eq!(upstream.sent_ms(start), [0, 1_000, 2_000]);
}

#[tokio::test(start_paused = true)]
async fn a_ticket_stands_only_for_its_own_bucket_and_account() {
    let upstream = Reporting::new(|_| (StatusCode::OK, Vec::new()));
    let (limiter, client) = booked_client(&upstream);
    let ticket = limiter
        .reserve(&orders_request(), &account("seller-1"))
        .await
        .expect("booked")
        .expect("a route");
    let err = send_booked(&client, "seller-2", Some(ticket))
        .await
        .expect_err("another account's ticket");
    let reqwest_middleware::Error::Middleware(e) = err else {
        panic!("a middleware error: {err:?}");
    };
    assert_eq!(
        e.downcast_ref::<TicketError>(),
        Some(&TicketError::OtherBucket)
    );
    assert!(upstream.sent_ms(tokio::time::Instant::now()).is_empty());
    // A request no route draws from needs no ticket.
    let elsewhere = reqwest::Client::new()
        .get("http://upstream.test/health")
        .build()
        .expect("a request");
    assert!(matches!(
        limiter.reserve(&elsewhere, &account("seller-1")).await,
        Ok(None)
    ));
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_ticket_gives_its_turn_back_once() {
    let upstream = Reporting::new(|_| (StatusCode::OK, Vec::new()));
    let (limiter, client) = booked_client(&upstream);
    let (request, seller) = (orders_request(), account("seller-1"));
    let book = || limiter.reserve(&request, &seller);
    let first = book().await.expect("booked").expect("a route");
    let second = book().await.expect("booked").expect("a route");
    assert!(limiter.cancel(&second).await.expect("cancelled"));
    let again = book().await.expect("booked").expect("a route");
    assert_eq!(again.ready_at(), second.ready_at());
    assert_eq!(again.ready_at(), first.ready_at() + Duration::from_secs(1));
    // Cancelled twice, or sent and then cancelled: given back once, or not at all.
    assert!(!limiter.cancel(&second).await.expect("answered"));
    send_booked(&client, "seller-1", Some(first.clone()))
        .await
        .expect("sent");
    assert!(!limiter.cancel(&first).await.expect("answered"));
    // A middleware with the same secret but no route for the ticket's bucket has no limit to
    // give it back under.
    let elsewhere = RateLimitMiddleware::new(MemoryStore::new())
        .route(Route::new("other", Limit::per_second(1).expect("a limit"), "/o").expect("a route"))
        .key_secret(ticket_secret());
    let err = elsewhere.cancel(&again).await.expect_err("no route");
    assert_eq!(ticket_error(&err), Some(TicketError::NoRoute));
}

fn ticket_error(err: &reqwest_middleware::Error) -> Option<TicketError> {
    match err {
        reqwest_middleware::Error::Middleware(e) => e.downcast_ref::<TicketError>().copied(),
        reqwest_middleware::Error::Reqwest(_) => None,
    }
}

/// A `MemoryStore` loses its marks when its process ends, as a Redis without persistence does
/// on a restart: a ticket held across it was refused as expired neither by the store (the mark
/// was written only when it went) nor by its time, and went on top of a full burst, a second
/// time if it had gone already. Its booking is its mark now, and a ticket without one is
/// refused, sent or cancelled.
#[tokio::test(start_paused = true)]
async fn a_ticket_held_across_a_restart_of_its_memory_store_is_refused_as_expired() {
    let upstream = Reporting::new(|_| (StatusCode::OK, Vec::new()));
    let start = tokio::time::Instant::now();
    let (before, client) = booked_client(&upstream);
    let (request, seller) = (orders_request(), account("seller-1"));
    let sent = before.reserve(&request, &seller).await;
    let held = before.reserve(&request, &seller).await;
    let (sent, held) = (
        sent.expect("booked").expect("a route"),
        held.expect("booked").expect("a route"),
    );
    send_booked(&client, "seller-1", Some(sent.clone()))
        .await
        .expect("sent");

    // The process starts again, with the same secret and a store of its own.
    let (after, client) = booked_client(&upstream);
    let err = send_booked(&client, "seller-1", Some(sent))
        .await
        .expect_err("its mark is gone");
    assert_eq!(ticket_error(&err), Some(TicketError::Expired));
    tokio::time::advance(Duration::from_secs(1)).await;
    let err = send_booked(&client, "seller-1", Some(held.clone()))
        .await
        .expect_err("its mark is gone");
    assert_eq!(ticket_error(&err), Some(TicketError::Expired));
    let err = after.cancel(&held).await.expect_err("its mark is gone");
    assert_eq!(ticket_error(&err), Some(TicketError::Expired));
    assert_eq!(upstream.sent_ms(start), [0]);
}

/// A store that takes tokens but refuses bookings while told to, as a Redis that fails between
/// the two calls.
#[derive(Clone)]
struct RefusedBookings(
    MemoryStore<crate::TokioClock>,
    Arc<std::sync::atomic::AtomicBool>,
);

impl BucketStore for RefusedBookings {
    async fn acquire(
        &self,
        key: &BucketKey,
        limit: Limit,
        cost: u32,
        max_wait: Duration,
    ) -> Result<Decision, StoreError> {
        self.0.acquire(key, limit, cost, max_wait).await
    }

    async fn acquire_all(
        &self,
        takes: &[crate::Take<'_>],
        max_wait: Duration,
    ) -> Result<Vec<Decision>, StoreError> {
        self.0.acquire_all(takes, max_wait).await
    }

    async fn peek(&self, key: &BucketKey, limit: Limit) -> Result<crate::BucketState, StoreError> {
        self.0.peek(key, limit).await
    }

    async fn refund(
        &self,
        key: &BucketKey,
        limit: Limit,
        reservation: crate::Reservation,
    ) -> Result<(), StoreError> {
        self.0.refund(key, limit, reservation).await
    }

    async fn drain_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> Result<(), StoreError> {
        self.0.drain_until(key, limit, until).await
    }

    async fn lower_to(
        &self,
        key: &BucketKey,
        limit: Limit,
        tokens: u32,
    ) -> Result<bool, StoreError> {
        self.0.lower_to(key, limit, tokens).await
    }

    async fn book(&self, key: &BucketKey, id: &str, until: SystemTime) -> Result<(), StoreError> {
        if self.1.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(StoreError::Unavailable {
                retry_in: Duration::from_secs(1),
            });
        }
        self.0.book(key, id, until).await
    }

    async fn claim(&self, key: &BucketKey, id: &str) -> Result<Claim, StoreError> {
        self.0.claim(key, id).await
    }

    async fn reset(&self, key: &BucketKey) -> Result<(), StoreError> {
        self.0.reset(key).await
    }

    async fn set(&self, key: &BucketKey, limit: Limit, tokens: u32) -> Result<(), StoreError> {
        self.0.set(key, limit, tokens).await
    }

    async fn block_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> Result<(), StoreError> {
        self.0.block_until(key, limit, until).await
    }
}

/// No ticket exists without its booking: when the store refuses it, `reserve` returns the
/// store's error and gives back the tokens it had just taken, in every bucket.
#[tokio::test(start_paused = true)]
async fn a_ticket_whose_booking_the_store_refuses_is_not_made_and_its_tokens_go_back() {
    let clock = crate::TokioClock::new();
    let refusing = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let store = RefusedBookings(MemoryStore::with_clock(clock), Arc::clone(&refusing));
    let (orders, account_limit) = (
        Limit::per_second(1).expect("a limit"),
        Limit::per_minute(1)
            .and_then(|l| l.with_burst(2))
            .expect("a limit"),
    );
    let limiter = RateLimitMiddleware::new(store.clone())
        .with_clock(clock)
        .route(Route::new("orders", orders, "/orders").expect("a route"))
        .route(Route::new("account", account_limit, "/**").expect("a route"))
        .key_secret(ticket_secret());
    let err = limiter
        .reserve(&orders_request(), &account("seller-1"))
        .await
        .expect_err("no booking, no ticket");
    let reqwest_middleware::Error::Middleware(e) = err else {
        panic!("a middleware error: {err:?}");
    };
    assert!(
        matches!(
            e.downcast_ref::<StoreError>(),
            Some(StoreError::Unavailable { .. })
        ),
        "{e:?}"
    );
    let left = || async {
        let mut left = Vec::new();
        for (bucket, limit) in [("orders", orders), ("account", account_limit)] {
            let key = BucketKey::new(bucket, "seller-1").expect("a key");
            left.push(store.peek(&key, limit).await.expect("peeks").remaining());
        }
        left
    };
    assert_eq!(left().await, [1, 2]);
    // Booked once the store takes it, from the same buckets.
    refusing.store(false, std::sync::atomic::Ordering::Relaxed);
    limiter
        .reserve(&orders_request(), &account("seller-1"))
        .await
        .expect("booked")
        .expect("a route");
    assert_eq!(left().await, [0, 1]);
}

#[tokio::test(start_paused = true)]
async fn a_ticket_goes_once_unchanged_in_its_time_for_its_cost() {
    let upstream = Reporting::new(|_| (StatusCode::OK, Vec::new()));
    let (limiter, client) = booked_client(&upstream);
    let start = tokio::time::Instant::now();
    let (request, seller) = (orders_request(), account("seller-1"));
    let book = || limiter.reserve(&request, &seller);
    let ticket = book().await.expect("booked").expect("a route");
    // The job delivered twice: the second copy is refused, here or in another process with the
    // same store and secret.
    let copy: Ticket = ticket.to_string().parse().expect("a ticket");
    send_booked(&client, "seller-1", Some(ticket))
        .await
        .expect("sent");
    let err = send_booked(&client, "seller-1", Some(copy))
        .await
        .expect_err("spent");
    assert_eq!(ticket_error(&err), Some(TicketError::Spent));
    // Edited (an earlier slot), or written by a middleware with another secret: forged.
    let later = book().await.expect("booked").expect("a route");
    let slot = later
        .ready_at()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis();
    let edited: Ticket = later
        .to_string()
        .replacen(&slot.to_string(), &(slot - 1_000).to_string(), 1)
        .parse()
        .expect("still reads");
    let err = send_booked(&client, "seller-1", Some(edited))
        .await
        .expect_err("forged");
    assert_eq!(ticket_error(&err), Some(TicketError::Forged));
    let stranger = RateLimitMiddleware::new(MemoryStore::new()).route(
        Route::new("api", Limit::per_second(1).expect("a limit"), "/orders").expect("a route"),
    );
    let theirs = stranger
        .reserve(&orders_request(), &account("seller-1"))
        .await
        .expect("booked")
        .expect("a route");
    let err = send_booked(&client, "seller-1", Some(theirs))
        .await
        .expect_err("forged");
    assert_eq!(ticket_error(&err), Some(TicketError::Forged));
    // A request costing more than the ticket booked.
    tokio::time::advance(Duration::from_secs(1)).await;
    let err = client
        .get("http://upstream.test/orders")
        .with_extension(Account::new("seller-1"))
        .with_extension(Cost::new(two(2)))
        .with_extension(later.clone())
        .send()
        .await
        .expect_err("too costly");
    assert_eq!(ticket_error(&err), Some(TicketError::TooCostly));
    // Past its grace (one token period), it would go with the turns booked after it.
    tokio::time::advance(Duration::from_millis(1_001)).await;
    let err = send_booked(&client, "seller-1", Some(later))
        .await
        .expect_err("expired");
    assert_eq!(ticket_error(&err), Some(TicketError::Expired));
    assert_eq!(upstream.sent_ms(start), [0]);
}

/// A ticket booked on one host and sent from another whose clock is off: a clock behind sees
/// it early (the local 429, for as long as the clocks differ), one ahead past the grace sees it
/// expired; neither sends it or spends it, and the host it was booked on still can.
#[tokio::test(start_paused = true)]
async fn a_ticket_sent_from_a_host_whose_clock_is_off_is_never_sent_out_of_its_time() {
    let upstream = Reporting::new(|_| (StatusCode::OK, Vec::new()));
    let start = tokio::time::Instant::now();
    let booking_clock = ManualClock::new(1_000_000);
    let store = MemoryStore::with_clock(booking_clock.clone());
    let host = |clock: ManualClock| {
        let limiter = RateLimitMiddleware::new(store.clone())
            .with_clock(clock)
            .route(
                Route::new("api", Limit::per_second(1).expect("a limit"), "/orders")
                    .expect("a route"),
            )
            .key_secret(ticket_secret());
        let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
            .with(limiter.clone())
            .with(upstream.clone())
            .build();
        (limiter, client)
    };
    let (booking, booking_client) = host(booking_clock.clone());
    let (_, behind) = host(ManualClock::new(1_000_000 - 10_000));
    let (_, ahead) = host(ManualClock::new(1_000_000 + 10_000));
    let ticket = booking
        .reserve(&orders_request(), &account("seller-1"))
        .await
        .expect("booked")
        .expect("a route");

    let early = send_booked(&behind, "seller-1", Some(ticket.clone()))
        .await
        .expect_err("early on a clock 10 s behind");
    let limited = rate_limited(&early).expect("the local 429");
    assert_eq!(limited.retry_after(), Duration::from_secs(10));
    let late = send_booked(&ahead, "seller-1", Some(ticket.clone()))
        .await
        .expect_err("past its grace on a clock 10 s ahead");
    assert_eq!(ticket_error(&late), Some(TicketError::Expired));
    assert!(upstream.sent_ms(start).is_empty(), "nothing sent");

    send_booked(&booking_client, "seller-1", Some(ticket))
        .await
        .expect("sent in its time on the host that booked it");
    assert_eq!(upstream.sent_ms(start), [0]);
}

#[tokio::test(start_paused = true)]
async fn an_upstream_back_off_past_a_booked_slot_refuses_it() {
    // The first request earns a 429 asking for 5 s; the one booked for 1 s must not go then.
    let upstream = Reporting::new(|n| match n {
        0 => (
            StatusCode::TOO_MANY_REQUESTS,
            vec![("retry-after", "5".to_owned())],
        ),
        _ => (StatusCode::OK, Vec::new()),
    });
    let (limiter, client) = booked_client(&upstream);
    let first = limiter
        .reserve(&orders_request(), &account("seller-1"))
        .await
        .expect("booked")
        .expect("a route");
    let second = limiter
        .reserve(&orders_request(), &account("seller-1"))
        .await
        .expect("booked")
        .expect("a route");
    let answer = send_booked(&client, "seller-1", Some(first))
        .await
        .expect("sent");
    assert_eq!(answer, StatusCode::TOO_MANY_REQUESTS);
    tokio::time::advance(Duration::from_secs(1)).await;
    let err = send_booked(&client, "seller-1", Some(second))
        .await
        .expect_err("drained past");
    let limited = rate_limited(&err).expect("the local 429");
    assert_eq!(limited.retry_after(), Duration::from_secs(4));
}

/// An endpoint's own limit (1 a second, burst 5) and the account's, over every path (one every
/// 2 s, burst 2): a request to the endpoint matches both.
fn endpoint_and_account() -> RateLimitMiddleware<MemoryStore<crate::TokioClock>, crate::TokioClock>
{
    let clock = crate::TokioClock::new();
    let endpoint = Limit::per_second(1)
        .and_then(|l| l.with_burst(5))
        .expect("a valid limit");
    let account = Limit::new(1, Duration::from_secs(2))
        .and_then(|l| l.with_burst(2))
        .expect("a valid limit");
    RateLimitMiddleware::new(MemoryStore::with_clock(clock))
        .with_clock(clock)
        .route(Route::new("orders", endpoint, "/orders").expect("a route"))
        .route(Route::new("account", account, "/**").expect("a route"))
        .key_secret(ticket_secret())
        .max_wait(Duration::from_secs(60))
}

/// Sends a request to `path` for seller-1 through `client`.
async fn to(client: &reqwest_middleware::ClientWithMiddleware, path: &str) -> StatusCode {
    client
        .get(format!("http://upstream.test{path}"))
        .with_extension(Account::new("seller-1"))
        .send()
        .await
        .map(|r| r.status())
        .expect("sent")
}

fn through(
    limiter: RateLimitMiddleware<MemoryStore<crate::TokioClock>, crate::TokioClock>,
    upstream: &Reporting,
) -> reqwest_middleware::ClientWithMiddleware {
    reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(limiter)
        .with(upstream.clone())
        .build()
}

#[tokio::test(start_paused = true)]
async fn a_ticket_books_every_route_at_once_and_gives_every_turn_back() {
    let upstream = Reporting::new(|_| (StatusCode::OK, Vec::new()));
    let limiter = endpoint_and_account();
    let client = through(limiter.clone(), &upstream);
    let request = || {
        reqwest::Client::new()
            .get("http://upstream.test/orders")
            .build()
            .expect("a request")
    };
    let start = tokio::time::Instant::now();
    let mut tickets = Vec::new();
    for _ in 0..3 {
        let ticket = limiter
            .reserve(&request(), &account("seller-1"))
            .await
            .expect("booked")
            .expect("routes match");
        tickets.push(ticket);
    }
    // The account's times: now, now, in two seconds.
    let first = tickets[0].ready_at();
    assert_eq!(tickets[1].ready_at(), first);
    assert_eq!(tickets[2].ready_at(), first + Duration::from_secs(2));
    let text = tickets[2].to_string();
    assert_eq!(text.matches(';').count(), 1, "{text}");
    let third: Ticket = text.parse().expect("a ticket");
    assert_eq!(third, tickets[2]);

    // A ticket of one bucket is refused where two routes apply, and the other way round.
    let stocks = reqwest::Client::new()
        .get("http://upstream.test/stocks")
        .build()
        .expect("a request");
    let one = limiter
        .reserve(&stocks, &account("seller-2"))
        .await
        .expect("booked")
        .expect("a route");
    let mismatch = client
        .get("http://upstream.test/orders")
        .with_extension(Account::new("seller-2"))
        .with_extension(one)
        .send()
        .await
        .expect_err("refused");
    assert_eq!(ticket_error(&mismatch), Some(TicketError::OtherBucket));

    // The first two go now. The third, the last queued, is cancelled once: its turn in the
    // account's queue comes back, and an unbooked request takes it, at two seconds. (Its turn
    // in the endpoint's bucket, which held tokens to spare, stays spent: a refund never frees
    // a turn a later one could be booked on.)
    send_booked(&client, "seller-1", Some(tickets[0].clone()))
        .await
        .expect("sent");
    send_booked(&client, "seller-1", Some(tickets[1].clone()))
        .await
        .expect("sent");
    assert!(limiter.cancel(&third).await.expect("cancelled"));
    assert!(!limiter.cancel(&third).await.expect("spent"));
    to(&client, "/stocks").await;
    assert_eq!(upstream.sent_ms(start), [0, 0, 2_000]);
}

#[tokio::test(start_paused = true)]
async fn a_ticket_of_two_buckets_is_refused_where_one_route_matches() {
    let upstream = Reporting::new(|_| (StatusCode::OK, Vec::new()));
    let limiter = endpoint_and_account();
    let orders = reqwest::Client::new()
        .get("http://upstream.test/orders")
        .build()
        .expect("a request");
    let ticket = limiter
        .reserve(&orders, &account("seller-1"))
        .await
        .expect("booked")
        .expect("routes match");
    let client = through(limiter, &upstream);
    let refused = client
        .get("http://upstream.test/stocks")
        .with_extension(Account::new("seller-1"))
        .with_extension(ticket)
        .send()
        .await
        .expect_err("refused");
    assert_eq!(ticket_error(&refused), Some(TicketError::OtherBucket));
    assert!(upstream.sent_ms(tokio::time::Instant::now()).is_empty());
}
