//! The reqwest middleware's tickets, on tokio's paused clock in front of the in-process upstream
//! (`support::upstream`): a turn booked with `reserve` goes at its time without another token,
//! once, unchanged, for its own buckets, account and cost, and within its grace; `cancel` gives
//! it back once; a ticket whose booking the store refused, or lost, never goes. Tickets on a real
//! Redis are in `middleware.rs`.
#![cfg(feature = "reqwest")]

use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use burstgate::middleware::{
    Account, Cost, RateLimitMiddleware, Ticket, TicketError, rate_limited,
};
use burstgate::{BucketKey, BucketStore, Limit, ManualClock, MemoryStore, StoreError, TokioClock};
use reqwest::{Request, StatusCode};
use reqwest_middleware::ClientWithMiddleware;

use crate::support::RefusedBookings;
use crate::support::exact_route;
use crate::support::upstream::{
    Answer, BASE, OnTokioTime, SELLER, Upstream, account, endpoint_and_account, ticket_secret, to,
};

/// "1 a second, burst 1" on `/orders`, on paused time, in front of `upstream`: the limiter, to
/// book with, and a client through it.
fn booked_client(upstream: &Upstream) -> (OnTokioTime, ClientWithMiddleware) {
    let clock = TokioClock::new();
    let limiter = RateLimitMiddleware::new(MemoryStore::new().with_clock(clock))
        .with_clock(clock)
        .route(
            exact_route("api", Limit::per_second(1).expect("a limit"), "/orders").expect("a route"),
        )
        .key_secret(ticket_secret())
        .max_wait(Duration::from_secs(60));
    (limiter.clone(), upstream.client(limiter))
}

fn orders_request() -> Request {
    reqwest::Client::new()
        .get(format!("{BASE}/orders"))
        .build()
        .expect("a request")
}

/// Sends a GET to `/orders` for `who` through `client`, with `ticket` when given.
async fn send_booked(
    client: &ClientWithMiddleware,
    who: &str,
    ticket: Option<Ticket>,
) -> reqwest_middleware::Result<StatusCode> {
    let mut request = client
        .get(format!("{BASE}/orders"))
        .with_extension(Account::new(who));
    if let Some(ticket) = ticket {
        request = request.with_extension(ticket);
    }
    request.send().await.map(|r| r.status())
}

fn ticket_error(err: &reqwest_middleware::Error) -> Option<TicketError> {
    match err {
        reqwest_middleware::Error::Middleware(e) => e.downcast_ref::<TicketError>().copied(),
        reqwest_middleware::Error::Reqwest(_) => None,
    }
}

#[tokio::test(start_paused = true)]
async fn a_booked_request_goes_at_its_time_without_another_token() {
    let upstream = Upstream::answering(StatusCode::OK);
    let (limiter, client) = booked_client(&upstream);
    let start = tokio::time::Instant::now();
    let now = limiter.reserve(&orders_request(), &account(SELLER)).await;
    let later = limiter.reserve(&orders_request(), &account(SELLER)).await;
    let (now, later) = (
        now.expect("booked").expect("a route"),
        later.expect("booked").expect("a route"),
    );
    assert_eq!(later.ready_at(), now.ready_at() + Duration::from_secs(1));
    // The job kept it as text, and read it back.
    let later: Ticket = later.to_string().parse().expect("a ticket");

    send_booked(&client, SELLER, Some(now))
        .await
        .expect("sent at once");
    // Half a second early: refused here, told how long is left.
    tokio::time::advance(Duration::from_millis(500)).await;
    let early = send_booked(&client, SELLER, Some(later.clone()))
        .await
        .expect_err("early");
    let limited = rate_limited(&early).expect("the local 429");
    assert_eq!(limited.retry_after(), Duration::from_millis(500));
    tokio::time::advance(Duration::from_millis(500)).await;
    send_booked(&client, SELLER, Some(later))
        .await
        .expect("sent at its time");
    // Two tokens taken in all: the next request, unbooked, waits its second.
    send_booked(&client, SELLER, None).await.expect("sent");
    assert_eq!(upstream.sent_ms_since(start), [0, 1_000, 2_000]);
}

#[tokio::test(start_paused = true)]
async fn a_ticket_stands_only_for_its_own_bucket_and_account() {
    let upstream = Upstream::answering(StatusCode::OK);
    let (limiter, client) = booked_client(&upstream);
    let ticket = limiter
        .reserve(&orders_request(), &account(SELLER))
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
    assert!(
        upstream
            .sent_ms_since(tokio::time::Instant::now())
            .is_empty()
    );
    // A request no route draws from needs no ticket.
    let elsewhere = reqwest::Client::new()
        .get(format!("{BASE}/health"))
        .build()
        .expect("a request");
    assert!(matches!(
        limiter.reserve(&elsewhere, &account(SELLER)).await,
        Ok(None)
    ));
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_ticket_gives_its_turn_back_once() {
    let upstream = Upstream::answering(StatusCode::OK);
    let (limiter, client) = booked_client(&upstream);
    let (request, seller) = (orders_request(), account(SELLER));
    let book = || limiter.reserve(&request, &seller);
    let first = book().await.expect("booked").expect("a route");
    let second = book().await.expect("booked").expect("a route");
    assert!(limiter.cancel(&second).await.expect("cancelled"));
    let again = book().await.expect("booked").expect("a route");
    assert_eq!(again.ready_at(), second.ready_at());
    assert_eq!(again.ready_at(), first.ready_at() + Duration::from_secs(1));
    // Cancelled twice, or sent and then cancelled: given back once, or not at all.
    assert!(!limiter.cancel(&second).await.expect("answered"));
    send_booked(&client, SELLER, Some(first.clone()))
        .await
        .expect("sent");
    assert!(!limiter.cancel(&first).await.expect("answered"));
    // A middleware with the same secret but no route for the ticket's bucket has no limit to
    // give it back under.
    let elsewhere = RateLimitMiddleware::new(MemoryStore::new())
        .route(exact_route("other", Limit::per_second(1).expect("a limit"), "/o").expect("a route"))
        .key_secret(ticket_secret());
    let err = elsewhere.cancel(&again).await.expect_err("no route");
    assert_eq!(ticket_error(&err), Some(TicketError::NoRoute));
}

/// A `MemoryStore` loses its marks when its process ends, as a Redis without persistence does
/// on a restart: a ticket held across it was refused as expired neither by the store (the mark
/// was written only when it went) nor by its time, and went on top of a full burst, a second
/// time if it had gone already. Its booking is its mark now, and a ticket without one is
/// refused, sent or cancelled.
#[tokio::test(start_paused = true)]
async fn a_ticket_held_across_a_restart_of_its_memory_store_is_refused_as_expired() {
    let upstream = Upstream::answering(StatusCode::OK);
    let start = tokio::time::Instant::now();
    let (before, client) = booked_client(&upstream);
    let (request, seller) = (orders_request(), account(SELLER));
    let sent = before.reserve(&request, &seller).await;
    let held = before.reserve(&request, &seller).await;
    let (sent, held) = (
        sent.expect("booked").expect("a route"),
        held.expect("booked").expect("a route"),
    );
    send_booked(&client, SELLER, Some(sent.clone()))
        .await
        .expect("sent");

    // The process starts again, with the same secret and a store of its own.
    let (after, client) = booked_client(&upstream);
    let err = send_booked(&client, SELLER, Some(sent))
        .await
        .expect_err("its mark is gone");
    assert_eq!(ticket_error(&err), Some(TicketError::Expired));
    tokio::time::advance(Duration::from_secs(1)).await;
    let err = send_booked(&client, SELLER, Some(held.clone()))
        .await
        .expect_err("its mark is gone");
    assert_eq!(ticket_error(&err), Some(TicketError::Expired));
    let err = after.cancel(&held).await.expect_err("its mark is gone");
    assert_eq!(ticket_error(&err), Some(TicketError::Expired));
    assert_eq!(upstream.sent_ms_since(start), [0]);
}

/// No ticket exists without its booking: when the store refuses it, `reserve` returns the
/// store's error and gives back the tokens it had just taken, in every bucket.
#[tokio::test(start_paused = true)]
async fn a_ticket_whose_booking_the_store_refuses_is_not_made_and_its_tokens_go_back() {
    let clock = TokioClock::new();
    let refusing = Arc::new(AtomicBool::new(true));
    let store = RefusedBookings {
        inner: MemoryStore::new().with_clock(clock),
        refusing: Arc::clone(&refusing),
    };
    let (orders, account_limit) = (
        Limit::per_second(1).expect("a limit"),
        Limit::per_minute(1)
            .and_then(|l| l.with_burst(2))
            .expect("a limit"),
    );
    let limiter = RateLimitMiddleware::new(store.clone())
        .with_clock(clock)
        .route(exact_route("orders", orders, "/orders").expect("a route"))
        .route(exact_route("account", account_limit, "/**").expect("a route"))
        .key_secret(ticket_secret());
    let err = limiter
        .reserve(&orders_request(), &account(SELLER))
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
            let key = BucketKey::new(bucket, SELLER).expect("a key");
            left.push(store.peek(&key, limit).await.expect("peeks").remaining());
        }
        left
    };
    assert_eq!(left().await, [1, 2]);
    // Booked once the store takes it, from the same buckets.
    refusing.store(false, Ordering::Relaxed);
    limiter
        .reserve(&orders_request(), &account(SELLER))
        .await
        .expect("booked")
        .expect("a route");
    assert_eq!(left().await, [0, 1]);
}

#[tokio::test(start_paused = true)]
async fn a_ticket_goes_once_unchanged_in_its_time_for_its_cost() {
    let upstream = Upstream::answering(StatusCode::OK);
    let (limiter, client) = booked_client(&upstream);
    let start = tokio::time::Instant::now();
    let (request, seller) = (orders_request(), account(SELLER));
    let book = || limiter.reserve(&request, &seller);
    let ticket = book().await.expect("booked").expect("a route");
    // The job delivered twice: the second copy is refused, here or in another process with the
    // same store and secret.
    let copy: Ticket = ticket.to_string().parse().expect("a ticket");
    send_booked(&client, SELLER, Some(ticket))
        .await
        .expect("sent");
    let err = send_booked(&client, SELLER, Some(copy))
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
    let err = send_booked(&client, SELLER, Some(edited))
        .await
        .expect_err("forged");
    assert_eq!(ticket_error(&err), Some(TicketError::Forged));
    let stranger = RateLimitMiddleware::new(MemoryStore::new()).route(
        exact_route("api", Limit::per_second(1).expect("a limit"), "/orders").expect("a route"),
    );
    let theirs = stranger
        .reserve(&orders_request(), &account(SELLER))
        .await
        .expect("booked")
        .expect("a route");
    let err = send_booked(&client, SELLER, Some(theirs))
        .await
        .expect_err("forged");
    assert_eq!(ticket_error(&err), Some(TicketError::Forged));
    // A request costing more than the ticket booked.
    tokio::time::advance(Duration::from_secs(1)).await;
    let err = client
        .get(format!("{BASE}/orders"))
        .with_extension(Account::new(SELLER))
        .with_extension(Cost::new(NonZeroU32::new(2).expect("not zero")))
        .with_extension(later.clone())
        .send()
        .await
        .expect_err("too costly");
    assert_eq!(ticket_error(&err), Some(TicketError::TooCostly));
    // Past its grace (one token period), it would go with the turns booked after it.
    tokio::time::advance(Duration::from_millis(1_001)).await;
    let err = send_booked(&client, SELLER, Some(later))
        .await
        .expect_err("expired");
    assert_eq!(ticket_error(&err), Some(TicketError::Expired));
    assert_eq!(upstream.sent_ms_since(start), [0]);
}

/// A ticket booked on one host and sent from another whose clock is off: a clock behind sees
/// it early (the local 429, for as long as the clocks differ), one ahead past the grace sees it
/// expired; neither sends it or spends it, and the host it was booked on still can.
#[tokio::test(start_paused = true)]
async fn a_ticket_sent_from_a_host_whose_clock_is_off_is_never_sent_out_of_its_time() {
    let upstream = Upstream::answering(StatusCode::OK);
    let start = tokio::time::Instant::now();
    let booking_clock = ManualClock::new(1_000_000);
    let store = MemoryStore::new().with_clock(booking_clock.clone());
    let host = |clock: ManualClock| {
        let limiter = RateLimitMiddleware::new(store.clone())
            .with_clock(clock)
            .route(
                exact_route("api", Limit::per_second(1).expect("a limit"), "/orders")
                    .expect("a route"),
            )
            .key_secret(ticket_secret());
        (limiter.clone(), upstream.client(limiter))
    };
    let (booking, booking_client) = host(booking_clock.clone());
    let (_, behind) = host(ManualClock::new(1_000_000 - 10_000));
    let (_, ahead) = host(ManualClock::new(1_000_000 + 10_000));
    let ticket = booking
        .reserve(&orders_request(), &account(SELLER))
        .await
        .expect("booked")
        .expect("a route");

    let early = send_booked(&behind, SELLER, Some(ticket.clone()))
        .await
        .expect_err("early on a clock 10 s behind");
    let limited = rate_limited(&early).expect("the local 429");
    assert_eq!(limited.retry_after(), Duration::from_secs(10));
    let late = send_booked(&ahead, SELLER, Some(ticket.clone()))
        .await
        .expect_err("past its grace on a clock 10 s ahead");
    assert_eq!(ticket_error(&late), Some(TicketError::Expired));
    assert!(upstream.sent_ms_since(start).is_empty(), "nothing sent");

    send_booked(&booking_client, SELLER, Some(ticket))
        .await
        .expect("sent in its time on the host that booked it");
    assert_eq!(upstream.sent_ms_since(start), [0]);
}

#[tokio::test(start_paused = true)]
async fn an_upstream_back_off_past_a_booked_slot_refuses_it() {
    // The first request earns a 429 asking for 5 s; the one booked for 1 s must not go then.
    let upstream = Upstream::by_turn(|n| match n {
        0 => Answer::new(StatusCode::TOO_MANY_REQUESTS).header("retry-after", "5"),
        _ => Answer::ok(),
    });
    let (limiter, client) = booked_client(&upstream);
    let first = limiter
        .reserve(&orders_request(), &account(SELLER))
        .await
        .expect("booked")
        .expect("a route");
    let second = limiter
        .reserve(&orders_request(), &account(SELLER))
        .await
        .expect("booked")
        .expect("a route");
    let answer = send_booked(&client, SELLER, Some(first))
        .await
        .expect("sent");
    assert_eq!(answer, StatusCode::TOO_MANY_REQUESTS);
    tokio::time::advance(Duration::from_secs(1)).await;
    let err = send_booked(&client, SELLER, Some(second))
        .await
        .expect_err("drained past");
    let limited = rate_limited(&err).expect("the local 429");
    assert_eq!(limited.retry_after(), Duration::from_secs(4));
}

#[tokio::test(start_paused = true)]
async fn a_ticket_books_every_route_at_once_and_gives_every_turn_back() {
    let upstream = Upstream::answering(StatusCode::OK);
    let limiter = endpoint_and_account();
    let client = upstream.client(limiter.clone());
    let start = tokio::time::Instant::now();
    let mut tickets = Vec::new();
    for _ in 0..3 {
        let ticket = limiter
            .reserve(&orders_request(), &account(SELLER))
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
        .get(format!("{BASE}/stocks"))
        .build()
        .expect("a request");
    let one = limiter
        .reserve(&stocks, &account("seller-2"))
        .await
        .expect("booked")
        .expect("a route");
    let mismatch = client
        .get(format!("{BASE}/orders"))
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
    send_booked(&client, SELLER, Some(tickets[0].clone()))
        .await
        .expect("sent");
    send_booked(&client, SELLER, Some(tickets[1].clone()))
        .await
        .expect("sent");
    assert!(limiter.cancel(&third).await.expect("cancelled"));
    assert!(!limiter.cancel(&third).await.expect("spent"));
    to(&client, "/stocks").await;
    assert_eq!(upstream.sent_ms_since(start), [0, 0, 2_000]);
}

#[tokio::test(start_paused = true)]
async fn a_ticket_of_two_buckets_is_refused_where_one_route_matches() {
    let upstream = Upstream::answering(StatusCode::OK);
    let limiter = endpoint_and_account();
    let ticket = limiter
        .reserve(&orders_request(), &account(SELLER))
        .await
        .expect("booked")
        .expect("routes match");
    let client = upstream.client(limiter);
    let refused = client
        .get(format!("{BASE}/stocks"))
        .with_extension(Account::new(SELLER))
        .with_extension(ticket)
        .send()
        .await
        .expect_err("refused");
    assert_eq!(ticket_error(&refused), Some(TicketError::OtherBucket));
    assert!(
        upstream
            .sent_ms_since(tokio::time::Instant::now())
            .is_empty()
    );
}

/// A middleware given no clock of its own counts its store's time: a ticket booked on a store
/// whose clock is far from this host's goes at its turn, and an upstream 429 drains the bucket
/// for the time it asked, from the store's now. On the host's clock instead, the ticket would be
/// judged decades past its grace, and the drain would end decades after the store's now.
#[tokio::test(start_paused = true)]
async fn a_middleware_without_a_clock_counts_its_stores_time() {
    let upstream = Upstream::by_turn(|turn| match turn {
        0 => Answer::ok(),
        _ => Answer::new(StatusCode::TOO_MANY_REQUESTS).header("retry-after", "10"),
    });
    let start = tokio::time::Instant::now();
    let store_now_ms = 1_000_000;
    let store = MemoryStore::new().with_clock(ManualClock::new(store_now_ms));
    let limit = Limit::per_second(1).expect("a limit");
    let limiter = RateLimitMiddleware::new(store.clone())
        .route(exact_route("api", limit, "/orders").expect("a route"))
        .key_secret(ticket_secret());
    let client = upstream.client(limiter.clone());
    let ticket = limiter
        .reserve(&orders_request(), &account(SELLER))
        .await
        .expect("booked")
        .expect("a route");

    send_booked(&client, SELLER, Some(ticket))
        .await
        .expect("sent at its turn on the store's time");
    assert_eq!(upstream.sent_ms_since(start), [0]);

    store.clock().advance(Duration::from_secs(1));
    let status = send_booked(&client, SELLER, None).await.expect("sent");
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let key = BucketKey::new("api", SELLER).expect("a key");
    let halted_until = store
        .peek(&key, limit)
        .await
        .expect("a state")
        .halted_until()
        .expect("drained by the 429");
    let store_now = std::time::UNIX_EPOCH + Duration::from_millis(store_now_ms + 1_000);
    assert_eq!(
        halted_until.duration_since(store_now).expect("after now"),
        Duration::from_secs(10),
        "the first token comes when the upstream asked, counted from the store's now"
    );
}
