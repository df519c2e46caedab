//! The inner service: waiting requests reach it in arrival order at exact times, a dropped wait
//! gives its reservation back, clones share one bucket, and readiness and the service itself are
//! the inner one's.

use super::*;

#[tokio::test(start_paused = true)]
async fn waiting_requests_reach_the_inner_service_in_arrival_order_at_exact_times() {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let one_per_second = Limit::per_second(1)
        .and_then(|l| l.with_burst(2))
        .expect("a valid limit");
    let (inner, handle) = mock::pair::<Req, Res>();
    let mut reached = answer(handle);
    let mut svc = RateLimitLayer::new(store)
        .rule(global(one_per_second))
        .max_wait(Duration::from_secs(2))
        .layer(inner);

    let mut pending = Vec::new();
    for n in 0..5 {
        let fut = svc
            .ready()
            .await
            .expect("the service is ready")
            .call(request(None, &n.to_string()));
        pending.push(decide_now(fut).await);
    }
    let mut answers = Vec::new();
    for p in pending {
        answers.push(text(
            p.await
                .expect("the request finishes")
                .expect("the layer answers with a response"),
        ));
    }

    let statuses: Vec<StatusCode> = answers.iter().map(Response::status).collect();
    assert_eq!(
        statuses,
        [200, 200, 200, 200, 429].map(|s| StatusCode::from_u16(s).expect("a status"))
    );
    // Two at once, then one a second; the fifth would have waited 3 s, past the ceiling.
    assert_eq!(
        seen(&mut reached),
        [at(0, "0"), at(0, "1"), at(1, "2"), at(2, "3")]
    );
    for (n, res) in answers[..4].iter().enumerate() {
        assert_eq!(res.body(), &format!("ok {n}"));
        let ratelimit = header(res, "ratelimit").expect("a RateLimit field");
        assert!(ratelimit.starts_with("\"global\";r="), "{ratelimit}");
    }
    let refused = &answers[4];
    assert_eq!(header(refused, "retry-after"), Some("3"));
    assert_eq!(
        header(refused, "ratelimit-policy"),
        Some("\"global\";q=2;w=2")
    );
}

#[tokio::test(start_paused = true)]
async fn dropping_a_waiting_request_refunds_its_reservation() {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let one_per_second = Limit::per_second(1)
        .and_then(|l| l.with_burst(1))
        .expect("a valid limit");
    let bucket = global_bucket("global");
    let (inner, handle) = mock::pair::<Req, Res>();
    let mut reached = answer(handle);
    let mut svc = RateLimitLayer::new(store.clone())
        .rule(global(one_per_second))
        .max_wait(Duration::from_secs(1))
        .layer(inner);

    assert_eq!(
        call(&mut svc, request(None, "0")).await.status(),
        StatusCode::OK
    );
    let mut waiting = Box::pin(
        svc.ready()
            .await
            .expect("the service is ready")
            .call(request(None, "1")),
    );
    assert!(poll_once(&mut waiting).await.is_pending(), "it waits");
    let quota = store.peek(&bucket, one_per_second).await.expect("peeks");
    assert_eq!(
        (quota.remaining(), quota.next_token_in()),
        (0, Duration::from_secs(2)),
        "the reservation put the bucket one token into debt"
    );

    // The client goes away while its request waits.
    drop(waiting);
    refunds_made().await;
    let quota = store.peek(&bucket, one_per_second).await.expect("peeks");
    // A millisecond on, the time the refund waits for others dropped with it.
    assert_eq!(
        (quota.remaining(), quota.next_token_in(), quota.resets_in()),
        (0, Duration::from_millis(999), Duration::from_millis(999)),
        "the reserved token is back"
    );

    // So the next request waits 1 s, within the ceiling, where it would have needed 2 s.
    let next = svc
        .ready()
        .await
        .expect("the service is ready")
        .call(request(None, "2"));
    let res = decide_now(next)
        .await
        .await
        .expect("the request finishes")
        .expect("the layer answers with a response");
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(seen(&mut reached), [at(0, "0"), at(1, "2")]);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        seen(&mut reached).is_empty(),
        "the dropped request never goes out"
    );
}

fn assert_clone<T: Clone>(_: &T) {}

#[tokio::test(start_paused = true)]
async fn cloned_services_share_one_bucket_without_a_buffer() {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let two = Limit::per_minute(2).expect("a valid limit");
    let calls = Arc::new(AtomicUsize::new(0));
    let layer = RateLimitLayer::new(store).rule(per_key(two));
    let mut a = layer.layer(counting(&calls));
    assert_clone(&a);
    let mut b = a.clone();
    // A service built from the same layer shares it too.
    let mut c = layer.layer(counting(&calls));

    assert_eq!(
        call(&mut a, request(Some("k1"), "0")).await.status(),
        StatusCode::OK
    );
    let res = call(&mut b, request(Some("k1"), "1")).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(header(&res, "ratelimit"), Some("\"per-key\";r=0;t=30"));
    for svc in [&mut a, &mut b, &mut c] {
        let res = call(svc, request(Some("k1"), "2")).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(header(&res, "retry-after"), Some("30"));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn poll_ready_is_the_inner_services() {
    let layer = RateLimitLayer::new(MemoryStore::new()).rule(per_key(orders()));
    let (mut svc, mut handle) = mock::spawn_layer::<Req, Res, _>(layer);

    handle.allow(0);
    assert!(svc.poll_ready().is_pending());
    handle.allow(1);
    assert!(
        svc.is_woken(),
        "the inner service's wake-up reaches the caller"
    );
    assert!(matches!(svc.poll_ready(), Poll::Ready(Ok(()))));

    // The inner service's errors come through unchanged.
    handle.send_error("inner failed");
    match svc.poll_ready() {
        Poll::Ready(Err(e)) => assert_eq!(e.to_string(), "inner failed"),
        other => panic!("expected the inner error, got {other:?}"),
    }
}

/// The accessors tower-http's middleware give: the inner service can be reached and taken back,
/// and the layer made from the service's own name.
#[tokio::test(start_paused = true)]
async fn the_inner_service_can_be_reached_and_taken_back() {
    #[derive(Clone, Debug, PartialEq)]
    struct Inner(u32);

    let store = MemoryStore::new().with_clock(TokioClock::new());
    let mut svc = burstgate::layer::RateLimit::layer(store)
        .rule(per_key(orders()))
        .layer(Inner(7));
    assert_eq!(svc.get_ref(), &Inner(7));
    svc.get_mut().0 = 8;
    assert_eq!(svc.into_inner(), Inner(8));
}
