//! Several rules on one request: a refusal by a later rule spends nothing from the earlier ones,
//! enforcing rules take in one call, shadow rules and drops refund, spacing stays per rule, and a
//! rule without a key does not apply.

use super::*;
use burstgate::layer::MissingKey;

#[tokio::test(start_paused = true)]
async fn a_request_refused_by_a_later_rule_spends_nothing_from_the_earlier_ones() {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let small = Limit::per_minute(1)
        .and_then(|l| l.with_burst(3))
        .expect("a valid limit");
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = RateLimitLayer::new(store.clone())
        .rule(per_key(orders()))
        .rule(global(small))
        .layer(counting(&calls));

    let res = call(&mut svc, request(Some("k1"), "0")).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        header(&res, "ratelimit"),
        Some("\"per-key\";r=9;t=60, \"global\";r=2;t=60")
    );
    for n in 1..3 {
        let res = call(&mut svc, request(Some("k1"), &n.to_string())).await;
        assert_eq!(res.status(), StatusCode::OK);
    }

    // The global bucket is empty: refused, and per-key gets its token back.
    let res = call(&mut svc, request(Some("k1"), "3")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&res, "retry-after"), Some("60"));
    assert_eq!(
        header(&res, "ratelimit-policy"),
        Some("\"per-key\";q=10;w=600, \"global\";q=3;w=180")
    );
    let ratelimit = header(&res, "ratelimit").expect("a RateLimit field");
    assert!(
        ratelimit.starts_with("\"per-key\";r=") && ratelimit.ends_with(", \"global\";r=0;t=60"),
        "{ratelimit}"
    );
    let k1 = store
        .peek(&header_bucket("per-key", "k1"), orders())
        .await
        .expect("peeks");
    assert_eq!(
        k1.remaining(),
        7,
        "three admitted, the refused one refunded"
    );
    let all = store
        .peek(&global_bucket("global"), small)
        .await
        .expect("peeks");
    assert_eq!(all.remaining(), 0);

    // A fresh key is refused by the global rule too, and keeps its whole bucket.
    let res = call(&mut svc, request(Some("k2"), "4")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    let k2 = store
        .peek(&header_bucket("per-key", "k2"), orders())
        .await
        .expect("peeks");
    assert_eq!(k2.remaining(), 10);
    assert_eq!(k2.resets_in(), ZERO);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}

/// A store whose answers for one bucket never come (a Redis that stopped answering), and
/// `MemoryStore` for every other bucket.
#[derive(Clone)]
struct StuckOn {
    bucket: &'static str,
    store: MemoryStore<TokioClock>,
}

impl BucketStore for StuckOn {
    async fn acquire(
        &self,
        key: &BucketKey,
        limit: Limit,
        cost: u32,
        max_wait: Duration,
    ) -> Result<Decision, StoreError> {
        if key.bucket() == self.bucket {
            return std::future::pending().await;
        }
        self.store.acquire(key, limit, cost, max_wait).await
    }

    async fn acquire_all(
        &self,
        takes: &[burstgate::Take<'_>],
        max_wait: Duration,
    ) -> Result<Vec<Decision>, StoreError> {
        if takes.iter().any(|t| t.key().bucket() == self.bucket) {
            return std::future::pending().await;
        }
        self.store.acquire_all(takes, max_wait).await
    }

    async fn peek(&self, key: &BucketKey, limit: Limit) -> Result<BucketState, StoreError> {
        self.store.peek(key, limit).await
    }

    async fn refund(
        &self,
        key: &BucketKey,
        limit: Limit,
        reservation: burstgate::Reservation,
    ) -> Result<(), StoreError> {
        self.store.refund(key, limit, reservation).await
    }

    async fn drain_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> Result<(), StoreError> {
        self.store.drain_until(key, limit, until).await
    }

    async fn lower_to(
        &self,
        key: &BucketKey,
        limit: Limit,
        tokens: u32,
    ) -> Result<bool, StoreError> {
        self.store.lower_to(key, limit, tokens).await
    }

    async fn book(&self, key: &BucketKey, id: &str, until: SystemTime) -> Result<(), StoreError> {
        self.store.book(key, id, until).await
    }

    async fn claim(&self, key: &BucketKey, id: &str) -> Result<Claim, StoreError> {
        self.store.claim(key, id).await
    }

    async fn reset(&self, key: &BucketKey) -> Result<(), StoreError> {
        self.store.reset(key).await
    }

    async fn set(&self, key: &BucketKey, limit: Limit, tokens: u32) -> Result<(), StoreError> {
        self.store.set(key, limit, tokens).await
    }

    async fn block_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> Result<(), StoreError> {
        self.store.block_until(key, limit, until).await
    }
}

/// The tokens the enforcing rules took stay guarded while a shadow rule's store call is in
/// flight: a client that goes away then gets them back, as it would while waiting.
#[tokio::test(start_paused = true)]
async fn dropping_a_request_while_a_shadow_rule_is_deciding_refunds_the_enforcing_rules() {
    let memory = MemoryStore::new().with_clock(TokioClock::new());
    let store = StuckOn {
        bucket: "global",
        store: memory.clone(),
    };
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = RateLimitLayer::new(store)
        .rule(per_key(orders()))
        .rule(global(orders()).shadow(true))
        .layer(counting(&calls));
    let k1 = header_bucket("per-key", "k1");

    let mut deciding = Box::pin(
        svc.ready()
            .await
            .expect("the service is ready")
            .call(request(Some("k1"), "0")),
    );
    assert!(poll_once(&mut deciding).await.is_pending());
    let quota = memory.peek(&k1, orders()).await.expect("peeks");
    assert_eq!(quota.remaining(), 9, "per-key took its token");

    drop(deciding);
    refunds_made().await;
    let quota = memory.peek(&k1, orders()).await.expect("peeks");
    assert_eq!(quota.remaining(), 10, "and gave it back");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

/// Two enforcing rules decide in one store call: while it is in flight neither bucket shows a
/// token gone, and a request dropped meanwhile takes nothing from either.
#[tokio::test(start_paused = true)]
async fn two_enforcing_rules_take_their_tokens_in_one_call() {
    let memory = MemoryStore::new().with_clock(TokioClock::new());
    let store = StuckOn {
        bucket: "global",
        store: memory.clone(),
    };
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = RateLimitLayer::new(store)
        .rule(per_key(orders()))
        .rule(global(orders()))
        .layer(counting(&calls));
    let k1 = header_bucket("per-key", "k1");

    let mut deciding = Box::pin(
        svc.ready()
            .await
            .expect("the service is ready")
            .call(request(Some("k1"), "0")),
    );
    assert!(poll_once(&mut deciding).await.is_pending());
    let quota = memory.peek(&k1, orders()).await.expect("peeks");
    assert_eq!(
        quota.remaining(),
        10,
        "nothing is taken before the one call decides"
    );
    drop(deciding);
    yield_a_few_times().await;
    let quota = memory.peek(&k1, orders()).await.expect("peeks");
    assert_eq!(quota.remaining(), 10);
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

/// Waiting on one rule never releases requests that another spaced out faster than its limit,
/// and a request on several rules waits at most two token periods of the fastest. A key's own
/// rule allows one a second; a global rule two a second, burst 1, which another key has just
/// spent. The key's first request waits half a second, on the global rule. Taken in turn, its
/// second would have its own rule's slot at 1 s and the global one's at 1 s, and go half a
/// second after the first. Taken together, its own rule's slot is a second after the first's,
/// 1.5 s from now: past the global rule's two periods (1 s), so it is refused, and goes when
/// asked again at 1.5 s.
#[tokio::test(start_paused = true)]
async fn a_wait_on_one_rule_never_compresses_anothers_spacing() {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let sent: Arc<std::sync::Mutex<Vec<(String, Instant)>>> = Arc::default();
    let seen = Arc::clone(&sent);
    let inner = tower::service_fn(move |req: Req| {
        let key = req
            .headers()
            .get(API_KEY)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        seen.lock()
            .expect("not poisoned")
            .push((key, Instant::now()));
        async { Ok::<_, std::convert::Infallible>(Response::new(String::from("ok"))) }
    });
    let per_second = Limit::per_second(1).expect("a valid limit");
    let global_limit = Limit::per_second(2)
        .and_then(|l| l.with_burst(1))
        .expect("a valid limit");
    let svc = RateLimitLayer::new(store)
        .rule(per_key(per_second))
        .rule(global(global_limit))
        .max_wait(Duration::from_secs(10))
        .layer(inner);
    let start = Instant::now();
    let mut other = svc.clone();
    assert_eq!(
        call(&mut other, request(Some("q"), "0")).await.status(),
        StatusCode::OK
    );
    let first = {
        let mut svc = svc.clone();
        tokio::spawn(async move { call(&mut svc, request(Some("k1"), "1")).await.status() })
    };
    yield_a_few_times().await;
    let mut second = svc.clone();
    let refused = call(&mut second, request(Some("k1"), "2")).await;
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(refused.headers()["retry-after"], "2");
    assert_eq!(first.await.expect("the task finishes"), StatusCode::OK);
    tokio::time::sleep_until(start + Duration::from_millis(1_500)).await;
    let mut third = svc.clone();
    assert_eq!(
        call(&mut third, request(Some("k1"), "3")).await.status(),
        StatusCode::OK
    );

    let sent = sent.lock().expect("not poisoned");
    let at: Vec<(String, Duration)> = sent
        .iter()
        .map(|(k, at)| (k.clone(), at.duration_since(start)))
        .collect();
    assert_eq!(
        at,
        [
            ("q".to_owned(), Duration::ZERO),
            ("k1".to_owned(), Duration::from_millis(500)),
            ("k1".to_owned(), Duration::from_millis(1_500)),
        ]
    );
}

/// Two rules of one bucket (the same name, keyed alike) cannot be taken in one call: they are
/// taken in turn, as each rule alone would be, not answered 503.
#[tokio::test(start_paused = true)]
async fn two_rules_of_one_bucket_are_taken_in_turn() {
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = RateLimitLayer::new(MemoryStore::new().with_clock(TokioClock::new()))
        .rule(per_key(orders()))
        .rule(per_key(orders()))
        .layer(counting(&calls));
    let statuses: Vec<StatusCode> = {
        let mut out = Vec::new();
        for _ in 0..6 {
            out.push(call(&mut svc, request(Some("k1"), "0")).await.status());
        }
        out
    };
    // Each request takes a token twice from the burst of ten.
    assert_eq!(statuses[..5], [StatusCode::OK; 5]);
    assert_eq!(statuses[5], StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(calls.load(Ordering::SeqCst), 5);
}

/// The layer's half of the cancellation rule (`docs/DESIGN.md#cancellation`): the decision runs
/// inside the request's future, so a request dropped while the store answers leaves the tokens
/// the store took spent, the safe direction. (The middleware refunds them instead.)
#[tokio::test(start_paused = true)]
async fn a_request_dropped_while_the_store_answers_leaves_its_tokens_spent() {
    let memory = MemoryStore::new().with_clock(TokioClock::new());
    let calls = Arc::new(AtomicUsize::new(0));
    // It decides, then takes a second to answer: a slow Redis that has already run the script.
    let slow = SlowReplies {
        inner: memory.clone(),
        delay: Duration::from_secs(1),
    };
    let mut svc = RateLimitLayer::new(slow)
        .rule(per_key(orders()))
        .layer(counting(&calls));
    let k1 = header_bucket("per-key", "k1");
    let mut deciding = Box::pin(
        svc.ready()
            .await
            .expect("the service is ready")
            .call(request(Some("k1"), "0")),
    );
    assert!(poll_once(&mut deciding).await.is_pending());
    drop(deciding);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let quota = memory.peek(&k1, orders()).await.expect("peeks");
    assert_eq!(quota.remaining(), 9, "the token the store took stays spent");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "the request never went out"
    );
}

#[tokio::test(start_paused = true)]
async fn a_header_rule_refuses_a_request_without_its_key_unless_told_to_pass_it() {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let one = Limit::per_minute(1).expect("a valid limit");
    let (inner, handle) = mock::pair::<Req, Res>();
    let mut reached = answer(handle);
    let mut svc = RateLimitLayer::new(store.clone())
        .rule(per_key(one))
        .layer(inner);
    // By default, no header or an empty one is a bad request: leaving the header out is no way
    // around the limit.
    let mut empty = request(None, "1");
    empty
        .headers_mut()
        .insert(API_KEY, HeaderValue::from_static(""));
    for req in [request(None, "0"), empty] {
        assert_eq!(call(&mut svc, req).await.status(), StatusCode::BAD_REQUEST);
    }
    assert!(seen(&mut reached).is_empty());

    let (inner, handle) = mock::pair::<Req, Res>();
    let mut reached = answer(handle);
    let mut svc = RateLimitLayer::new(store.clone())
        .rule(per_key(one).on_missing_key(MissingKey::Pass))
        .layer(inner);

    // Told to pass: no rule applies, nothing is limited, no field is added.
    for n in 0..5 {
        let res = call(&mut svc, request(None, &n.to_string())).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert_eq!(header(&res, "ratelimit"), None);
    }
    let mut empty = request(None, "5");
    empty
        .headers_mut()
        .insert(API_KEY, HeaderValue::from_static(""));
    let res = call(&mut svc, empty).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(header(&res, "ratelimit"), None);
    assert_eq!(seen(&mut reached).len(), 6);

    // With a key the rule applies.
    let res = call(&mut svc, request(Some("k1"), "6")).await;
    assert_eq!(header(&res, "ratelimit"), Some("\"per-key\";r=0;t=60"));
    let res = call(&mut svc, request(Some("k1"), "7")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);

    // Beside a global rule, a request without a key draws from the global bucket alone.
    let mut svc = RateLimitLayer::new(store)
        .rule(per_key(one).on_missing_key(MissingKey::Pass))
        .rule(global(orders()))
        .layer(counting(&Arc::new(AtomicUsize::new(0))));
    let res = call(&mut svc, request(None, "8")).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(header(&res, "ratelimit"), Some("\"global\";r=9;t=60"));
}

/// One layer with per-route rules beside an overall one: a request takes from every rule its
/// method and path match, at once or not at all, and from no other.
#[tokio::test(start_paused = true)]
async fn per_route_rules_and_an_overall_one_take_together_or_not_at_all() {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let limit = |burst| {
        Limit::per_minute(1)
            .and_then(|l| l.with_burst(burst))
            .expect("a limit")
    };
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = RateLimitLayer::new(store.clone())
        .rule(
            per_key(limit(2))
                .method(http::Method::POST)
                .path("/login")
                .expect("a pattern"),
        )
        .rule(
            Rule::new("search", limit(5), KeyExtractor::header(API_KEY))
                .expect("a rule")
                .path("/search/**")
                .expect("a pattern"),
        )
        .rule(Rule::new("all", limit(4), KeyExtractor::header(API_KEY)).expect("a rule"))
        .layer(counting(&calls));
    let to = |method: http::Method, path: &str| {
        Request::builder()
            .method(method)
            .uri(path)
            .header(API_KEY, "k1")
            .body(String::new())
            .expect("a request")
    };
    let remaining = async |bucket: &str, burst| {
        store
            .peek(&header_bucket(bucket, "k1"), limit(burst))
            .await
            .expect("peeks")
            .remaining()
    };

    // Two logins: the login rule's burst, and two of the overall one's.
    for _ in 0..2 {
        let res = call(&mut svc, to(http::Method::POST, "/login")).await;
        assert_eq!(res.status(), StatusCode::OK);
    }
    assert_eq!(remaining("all", 4).await, 2);
    // A third is refused by the login rule, and takes nothing from the overall one.
    let res = call(&mut svc, to(http::Method::POST, "/login")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(remaining("all", 4).await, 2);
    // A GET to /login is not the login rule's; a search takes from the search rule too.
    let res = call(&mut svc, to(http::Method::GET, "/login")).await;
    assert_eq!(res.status(), StatusCode::OK);
    let res = call(&mut svc, to(http::Method::GET, "/search/%6Frders")).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(
        header(&res, "ratelimit"),
        Some("\"search\";r=4;t=60, \"all\";r=0;t=60")
    );
    // The overall rule is spent: a search is refused, and the search rule keeps its tokens.
    let res = call(&mut svc, to(http::Method::GET, "/search/x")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(remaining("search", 5).await, 4);
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}
