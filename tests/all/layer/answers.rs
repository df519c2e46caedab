//! What the layer answers: the 429 and its fields, `Retry-After`, the fields on admitted
//! responses, the policy and ratelimit fields, and the 503, 500, custom and problem-details
//! rejections.

use super::*;
#[cfg(feature = "redis")]
use burstgate::OutagePolicy;
use burstgate::layer::MissingKey;

#[tokio::test(start_paused = true)]
async fn a_burst_of_ten_admits_ten_then_answers_429_with_the_draft_fields() {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let (inner, handle) = mock::pair::<Req, Res>();
    let mut reached = answer(handle);
    let mut svc = RateLimitLayer::new(store.clone())
        .rule(per_key(orders()))
        .layer(inner);

    for n in 0..10u32 {
        let res = call(&mut svc, request(Some("k1"), &n.to_string())).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(res.body(), &format!("ok {n}"));
        // Each request takes a whole token from a bucket that was whole, so the next one is a
        // minute away, however many are left.
        let expected = format!("\"per-key\";r={};t=60", 9 - n);
        assert_eq!(header(&res, "ratelimit"), Some(expected.as_str()));
        assert_eq!(
            header(&res, "ratelimit-policy"),
            Some("\"per-key\";q=10;w=600")
        );
        assert_eq!(header(&res, "retry-after"), None);
    }

    let res = call(&mut svc, request(Some("k1"), "10")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&res, "retry-after"), Some("60"));
    assert_eq!(
        header(&res, "ratelimit-policy"),
        Some("\"per-key\";q=10;w=600")
    );
    assert_eq!(header(&res, "ratelimit"), Some("\"per-key\";r=0;t=60"));
    assert_eq!(
        header(&res, "content-type"),
        Some("text/plain; charset=utf-8")
    );
    assert_eq!(res.body(), "rate limited: retry after 60 s\n");

    // The ten admitted reached the inner service in order; the refused one did not.
    yield_a_few_times().await;
    let ids: Vec<String> = seen(&mut reached).into_iter().map(|s| s.id).collect();
    assert_eq!(ids, (0..10).map(|n| n.to_string()).collect::<Vec<_>>());
    // It took nothing either.
    let quota = store
        .peek(&header_bucket("per-key", "k1"), orders())
        .await
        .expect("peeks");
    assert_eq!(quota.remaining(), 0);
    assert_eq!(quota.next_token_in(), Duration::from_secs(60));

    // Another key has its own bucket.
    let res = call(&mut svc, request(Some("k2"), "11")).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(header(&res, "ratelimit"), Some("\"per-key\";r=9;t=60"));
}

#[tokio::test]
async fn retry_after_is_whole_seconds_rounded_up_and_never_zero() {
    let clock = ManualClock::new(1_700_000_000_000);
    let store = MemoryStore::new().with_clock(clock.clone());
    let per_minute = Limit::per_minute(1).expect("a valid limit");
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = RateLimitLayer::new(store.clone())
        .rule(per_key(per_minute))
        .layer(counting(&calls));

    assert_eq!(
        call(&mut svc, request(Some("k"), "0")).await.status(),
        StatusCode::OK
    );
    for (advance_ms, retry_after) in [(0, "60"), (500, "60"), (59_000, "1"), (499, "1")] {
        clock.advance(Duration::from_millis(advance_ms));
        let res = call(&mut svc, request(Some("k"), "again")).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(header(&res, "retry-after"), Some(retry_after));
        let ratelimit = format!("\"per-key\";r=0;t={retry_after}");
        assert_eq!(header(&res, "ratelimit"), Some(ratelimit.as_str()));
        assert_eq!(
            header(&res, "ratelimit-policy"),
            Some("\"per-key\";q=1;w=60")
        );
    }
    // 1 ms short of the token: still "1", never "0".
    clock.advance(Duration::from_millis(1));
    assert_eq!(
        call(&mut svc, request(Some("k"), "on time")).await.status(),
        StatusCode::OK
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    // A sub-second refill (one token every 250 ms) still says 1, and so does the policy's window,
    // in which 4 requests go through.
    let fast = Limit::per_second(4)
        .and_then(|l| l.with_burst(1))
        .expect("a valid limit");
    let mut svc = RateLimitLayer::new(store)
        .rule(Rule::new("fast", fast, KeyExtractor::global()).expect("a valid rule"))
        .layer(counting(&calls));
    assert_eq!(
        call(&mut svc, request(None, "0")).await.status(),
        StatusCode::OK
    );
    let res = call(&mut svc, request(None, "1")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&res, "retry-after"), Some("1"));
    assert_eq!(header(&res, "ratelimit"), Some("\"fast\";r=0;t=1"));
    assert_eq!(header(&res, "ratelimit-policy"), Some("\"fast\";q=4;w=1"));
}

#[tokio::test(start_paused = true)]
async fn headers_on_success_false_leaves_admitted_responses_alone() {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = RateLimitLayer::new(store)
        .rule(per_key(orders()))
        .headers_on_success(false)
        .layer(counting(&calls));
    for n in 0..10 {
        let res = call(&mut svc, request(Some("k1"), &n.to_string())).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert!(res.headers().is_empty(), "{:?}", res.headers());
    }
    // Rejections still carry every field.
    let res = call(&mut svc, request(Some("k1"), "10")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&res, "retry-after"), Some("60"));
    assert_eq!(
        header(&res, "ratelimit-policy"),
        Some("\"per-key\";q=10;w=600")
    );
    assert_eq!(header(&res, "ratelimit"), Some("\"per-key\";r=0;t=60"));
    assert_eq!(calls.load(Ordering::SeqCst), 10);
}

#[tokio::test(start_paused = true)]
async fn a_client_that_sleeps_retry_after_is_admitted_on_its_first_retry() {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = RateLimitLayer::new(store)
        .rule(per_key(orders()))
        .layer(counting(&calls));
    for n in 0..10 {
        let res = call(&mut svc, request(Some("k1"), &n.to_string())).await;
        assert_eq!(res.status(), StatusCode::OK);
    }
    let started = Instant::now();
    let res = call(&mut svc, request(Some("k1"), "10")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let secs: u64 = header(&res, "retry-after")
        .expect("a Retry-After")
        .parse()
        .expect("whole seconds");
    assert_eq!(secs, 60);

    tokio::time::sleep(Duration::from_secs(secs)).await;
    let res = call(&mut svc, request(Some("k1"), "11")).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(header(&res, "ratelimit"), Some("\"per-key\";r=0;t=60"));
    assert_eq!(started.elapsed(), Duration::from_secs(60));
    assert_eq!(calls.load(Ordering::SeqCst), 11);
}

/// `RateLimit-Policy` is built once for all the rules; a request that only some of them apply
/// to must still name just those.
#[tokio::test(start_paused = true)]
async fn the_policy_field_names_only_the_rules_that_applied() {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let small = Limit::per_minute(1)
        .and_then(|l| l.with_burst(3))
        .expect("a valid limit");
    let mut svc = RateLimitLayer::new(store)
        .rule(global(small))
        .rule(per_key(orders()).on_missing_key(MissingKey::Pass))
        .rule(Rule::new("all", orders(), KeyExtractor::global()).expect("a valid rule"))
        .layer(counting(&Arc::new(AtomicUsize::new(0))));

    let res = call(&mut svc, request(Some("k1"), "0")).await;
    assert_eq!(
        header(&res, "ratelimit-policy"),
        Some("\"global\";q=3;w=180, \"per-key\";q=10;w=600, \"all\";q=10;w=600")
    );
    let res = call(&mut svc, request(None, "1")).await;
    assert_eq!(
        header(&res, "ratelimit-policy"),
        Some("\"global\";q=3;w=180, \"all\";q=10;w=600")
    );
    assert_eq!(
        header(&res, "ratelimit"),
        Some("\"global\";r=1;t=60, \"all\";r=8;t=60")
    );
}

/// The RateLimit field of a 429 should describe the quota the client is left with. A refused
/// request spends nothing (its earlier rules' tokens are refunded), so per-key still holds 7,
/// not the 6 it held between the take and the refund.
#[tokio::test(start_paused = true)]
async fn a_refused_requests_ratelimit_field_counts_refunded_tokens_as_unspent() {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let small = Limit::per_minute(1)
        .and_then(|l| l.with_burst(3))
        .expect("a valid limit");
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = RateLimitLayer::new(store.clone())
        .rule(per_key(orders()))
        .rule(global(small))
        .layer(counting(&calls));
    for n in 0..3 {
        let res = call(&mut svc, request(Some("k1"), &n.to_string())).await;
        assert_eq!(res.status(), StatusCode::OK);
    }
    let res = call(&mut svc, request(Some("k1"), "3")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let k1 = store
        .peek(&header_bucket("per-key", "k1"), orders())
        .await
        .expect("peeks");
    assert_eq!(k1.remaining(), 7);
    assert_eq!(
        header(&res, "ratelimit"),
        Some("\"per-key\";r=7;t=60, \"global\";r=0;t=60")
    );
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn a_failing_store_answers_503_without_calling_the_inner_service_when_failing_closed() {
    let store = burstgate::RedisStore::new(FailingConnection);
    let (inner, mut handle) = mock::pair::<Req, Res>();
    let mut svc = RateLimitLayer::new(store)
        .rule(per_key(orders()).on_missing_key(MissingKey::Pass))
        .on_outage(OutagePolicy::FailClosed)
        .layer(inner);
    let res = call(&mut svc, request(Some("k1"), "0")).await;
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(!res.body().trim().is_empty());
    assert_eq!(
        header(&res, "content-type"),
        Some("text/plain; charset=utf-8")
    );
    assert_eq!(header(&res, "retry-after"), None);
    assert!(handle.poll_request().is_pending(), "the mock saw a request");

    // Two more failures open the store's circuit (3 in a row by default); from then on the 503
    // says when to come back: when the breaker lets a call through again, 500 ms, so 1 s.
    for id in ["0b", "0c"] {
        let res = call(&mut svc, request(Some("k1"), id)).await;
        assert_eq!(header(&res, "retry-after"), None);
    }
    let res = call(&mut svc, request(Some("k1"), "0d")).await;
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(header(&res, "retry-after"), Some("1"));
    assert!(handle.poll_request().is_pending(), "the mock saw a request");

    // A request no rule applies to never asks the store, so it goes through.
    let res = svc
        .ready()
        .await
        .expect("the service is ready")
        .call(request(None, "1"));
    let (res, ()) = tokio::join!(res, async {
        let (req, send) = handle.next_request().await.expect("a request");
        assert_eq!(req.headers()["x-id"], "1");
        send.send_response(Response::new(String::from("ok")));
    });
    assert_eq!(res.expect("a response").status(), StatusCode::OK);
}

#[cfg(feature = "redis")]
use crate::support::failing_connection::FailingConnection;

/// What the mock behind a layer on a store that always fails answered: the statuses of
/// `requests` requests for key `k1`, and how many reached the inner service.
#[cfg(feature = "redis")]
async fn while_the_store_fails(
    layer: RateLimitLayer<FailingStore>,
    requests: usize,
) -> (Vec<u16>, usize) {
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = layer.layer(counting(&calls));
    let mut statuses = Vec::new();
    for n in 0..requests {
        let res = call(&mut svc, request(Some("k1"), &n.to_string())).await;
        statuses.push(res.status().as_u16());
    }
    (statuses, calls.load(Ordering::SeqCst))
}

#[cfg(feature = "redis")]
type FailingStore = burstgate::RedisStore<FailingConnection>;

#[cfg(feature = "redis")]
#[tokio::test]
async fn a_failing_store_is_answered_from_the_layers_own_buckets_by_default() {
    let layer =
        RateLimitLayer::new(burstgate::RedisStore::new(FailingConnection)).rule(per_key(orders()));
    let (statuses, calls) = while_the_store_fails(layer, 12).await;
    let mut expected = vec![200; 10];
    expected.extend([429, 429]);
    assert_eq!(
        statuses, expected,
        "the rule's whole burst in this process, then 429"
    );
    assert_eq!(calls, 10);
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn a_failing_store_is_answered_from_a_share_of_the_limit_for_several_processes() {
    let processes = std::num::NonZeroU32::new(4).expect("non-zero");
    let layer = RateLimitLayer::new(burstgate::RedisStore::new(FailingConnection))
        .rule(per_key(orders()))
        .on_outage(OutagePolicy::Local { processes });
    let (statuses, calls) = while_the_store_fails(layer, 4).await;
    // A burst of 10 over 4 processes: 2 each.
    assert_eq!(statuses, [200, 200, 429, 429]);
    assert_eq!(calls, 2);
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn a_failing_store_under_fail_open_lets_every_request_through() {
    let layer = RateLimitLayer::new(burstgate::RedisStore::new(FailingConnection))
        .rule(per_key(orders()))
        .on_outage(OutagePolicy::FailOpen);
    let (statuses, calls) = while_the_store_fails(layer, 12).await;
    assert_eq!(statuses, [200; 12]);
    assert_eq!(calls, 12);
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn the_fallback_takes_several_rules_all_or_none_and_asks_no_shadow_rule() {
    let burst = |n| {
        Limit::per_minute(1)
            .and_then(|l| l.with_burst(n))
            .expect("a limit")
    };
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = RateLimitLayer::new(burstgate::RedisStore::new(FailingConnection))
        .rule(per_key(burst(3)))
        .rule(global(burst(4)))
        .rule(
            Rule::new("watch", burst(1), KeyExtractor::global())
                .expect("a rule")
                .shadow(true),
        )
        .layer(counting(&calls));
    let mut statuses = Vec::new();
    for (n, key) in ["k1", "k1", "k1", "k1", "k2", "k2"].into_iter().enumerate() {
        let res = call(&mut svc, request(Some(key), &n.to_string())).await;
        statuses.push(res.status().as_u16());
    }
    // k1's three take the per-key burst and three of the global four; k1's fourth is refused by
    // the per-key rule and takes nothing from the global one, so k2 gets its last token, and
    // only then is the global rule spent. The shadow rule, asked, would have refused from the
    // second request on; it is not asked, and refuses nothing anyway.
    assert_eq!(statuses, [200, 200, 200, 429, 200, 429]);
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}

#[tokio::test(start_paused = true)]
async fn a_cost_of_zero_or_above_the_burst_answers_500() {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let priced = per_key(orders()).cost(|parts| {
        parts
            .headers
            .get("x-cost")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or(1)
    });
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = RateLimitLayer::new(store.clone())
        .rule(priced)
        .layer(counting(&calls));
    let costing = |cost: &'static str| {
        let mut req = request(Some("k1"), cost);
        req.headers_mut()
            .insert("x-cost", HeaderValue::from_static(cost));
        req
    };

    for cost in ["0", "11"] {
        let res = call(&mut svc, costing(cost)).await;
        assert_eq!(
            res.status(),
            StatusCode::INTERNAL_SERVER_ERROR,
            "cost {cost}"
        );
        assert!(!res.body().trim().is_empty());
        assert_eq!(header(&res, "retry-after"), None);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    let quota = store
        .peek(&header_bucket("per-key", "k1"), orders())
        .await
        .expect("peeks");
    assert_eq!(quota.remaining(), 10, "nothing was taken");

    // The whole burst at once is a valid price.
    let res = call(&mut svc, costing("10")).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(header(&res, "ratelimit"), Some("\"per-key\";r=0;t=60"));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_custom_rejection_sets_status_headers_and_body() {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let one = Limit::per_minute(1).expect("a valid limit");
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = RateLimitLayer::new(store)
        .rule(per_key(one))
        .rejection_status(StatusCode::SERVICE_UNAVAILABLE)
        .rejection_header(
            HeaderName::from_static("x-limited-by"),
            HeaderValue::from_static("burstgate"),
        )
        .rejection_header(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )
        .rejection_body(|limited| {
            format!(
                "{{\"bucket\":\"{}\",\"retry_after_ms\":{},\"remaining\":{}}}",
                limited.bucket(),
                limited.retry_after().as_millis(),
                limited.remaining()
            )
        })
        .layer(counting(&calls));

    assert_eq!(
        call(&mut svc, request(Some("k1"), "0")).await.status(),
        StatusCode::OK
    );
    let res = call(&mut svc, request(Some("k1"), "1")).await;
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(header(&res, "x-limited-by"), Some("burstgate"));
    assert_eq!(header(&res, "content-type"), Some("application/json"));
    assert_eq!(
        res.body(),
        "{\"bucket\":\"per-key\",\"retry_after_ms\":60000,\"remaining\":0}"
    );
    // The standard fields are still there.
    assert_eq!(header(&res, "retry-after"), Some("60"));
    assert_eq!(
        header(&res, "ratelimit-policy"),
        Some("\"per-key\";q=1;w=60")
    );
    assert_eq!(header(&res, "ratelimit"), Some("\"per-key\";r=0;t=60"));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn problem_details_name_the_rule_that_refused() {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let one = Limit::per_minute(1).expect("a valid limit");
    let many = Limit::per_second(100).expect("a valid limit");
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = RateLimitLayer::new(store)
        .rule(global(many))
        .rule(per_key(one))
        .problem_details(true)
        .layer(counting(&calls));

    assert_eq!(
        call(&mut svc, request(Some("k1"), "0")).await.status(),
        StatusCode::OK
    );
    let res = call(&mut svc, request(Some("k1"), "1")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        header(&res, "content-type"),
        Some("application/problem+json")
    );
    let problem: serde_json::Value = serde_json::from_str(res.body()).expect("JSON");
    assert_eq!(
        problem,
        serde_json::json!({
            "type": "https://iana.org/assignments/http-problem-types#quota-exceeded",
            "title": "Quota Exceeded",
            "status": 429,
            "detail": "retry after 60 s",
            "violated-policies": ["per-key"],
        })
    );
    // The violated policy is the item of the RateLimit field that says it is spent.
    assert_eq!(
        header(&res, "ratelimit"),
        Some("\"global\";r=99;t=1, \"per-key\";r=0;t=60")
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // Back to text.
    let mut svc = RateLimitLayer::new(MemoryStore::new().with_clock(TokioClock::new()))
        .rule(per_key(one))
        .problem_details(true)
        .problem_details(false)
        .layer(counting(&calls));
    call(&mut svc, request(Some("k1"), "0")).await;
    let res = call(&mut svc, request(Some("k1"), "1")).await;
    assert_eq!(res.body(), "rate limited: retry after 60 s\n");
}
