//! The tower layer in-process: statuses, header fields and what reaches the inner service, with
//! time paused (`TokioClock` follows tokio's clock) or a `ManualClock`, so every time is exact.
#![cfg(feature = "tower")]

use std::future::{Future, poll_fn};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::Poll;
use std::time::{Duration, SystemTime};

use burstgate::layer::{KeyExtractor, RateLimitLayer, Rule};
use burstgate::{
    BucketKey, BucketState, BucketStore, Claim, Decision, Limit, ManualClock, MemoryStore,
    StoreError, TokioClock,
};
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt};
use tower_test::mock;

use crate::support::layer::{API_KEY, Req, Res, call, counting, text};
use crate::support::{SlowReplies, ZERO};

/// "1 per minute, burst 10": nothing refills while a test runs unless it sleeps.
fn orders() -> Limit {
    Limit::per_minute(1)
        .and_then(|l| l.with_burst(10))
        .expect("a valid limit")
}

fn per_key(limit: Limit) -> Rule {
    Rule::new("per-key", limit, KeyExtractor::header(API_KEY)).expect("a valid rule")
}

fn global(limit: Limit) -> Rule {
    Rule::new("global", limit, KeyExtractor::global()).expect("a valid rule")
}

/// The bucket a header rule named `bucket` draws from for `value`, built as the extractor does.
fn header_bucket(bucket: &str, value: &str) -> BucketKey {
    BucketKey::hashed(bucket, value).expect("a valid key")
}

fn global_bucket(bucket: &str) -> BucketKey {
    BucketKey::new(bucket, "global").expect("a valid key")
}

/// A request with an `x-id` to recognise it by, and an API key if `key` is given.
fn request(key: Option<&str>, id: &str) -> Req {
    let mut builder = Request::builder().uri("/orders").header("x-id", id);
    if let Some(key) = key {
        builder = builder.header(API_KEY, key);
    }
    builder.body(String::new()).expect("a valid request")
}

fn header<'a>(res: &'a Res, name: &str) -> Option<&'a str> {
    res.headers()
        .get(name)
        .map(|v| v.to_str().expect("an ASCII header value"))
}

/// A request that reached the mock inner service: when (since `answer` was called) and its id.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    at: Duration,
    id: String,
}

/// Answers every request that reaches the mock with `ok <id>`, reporting each one first.
fn answer(mut handle: mock::Handle<Req, Res>) -> mpsc::UnboundedReceiver<Seen> {
    let start = Instant::now();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some((req, send)) = handle.next_request().await {
            let id = req
                .headers()
                .get("x-id")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            let _ = tx.send(Seen {
                at: start.elapsed(),
                id: id.clone(),
            });
            send.send_response(Response::new(format!("ok {id}")));
        }
    });
    rx
}

/// Everything the mock has seen so far.
fn seen(rx: &mut mpsc::UnboundedReceiver<Seen>) -> Vec<Seen> {
    let mut out = Vec::new();
    while let Ok(s) = rx.try_recv() {
        out.push(s);
    }
    out
}

fn at(secs: u64, id: &str) -> Seen {
    Seen {
        at: Duration::from_secs(secs),
        id: id.to_owned(),
    }
}

/// Polls `fut` once.
async fn poll_once<F: Future>(fut: &mut std::pin::Pin<Box<F>>) -> Poll<F::Output> {
    poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await
}

/// Polls `fut` once, so the layer decides now (it decides on the first poll, so requests are
/// decided in the order they are given here), then finishes it on a task.
async fn decide_now<F>(fut: F) -> JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    let mut fut = Box::pin(fut);
    match poll_once(&mut fut).await {
        Poll::Ready(out) => tokio::spawn(async move { out }),
        Poll::Pending => tokio::spawn(fut),
    }
}

async fn yield_a_few_times() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}

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
    yield_a_few_times().await;
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
        .rule(per_key(orders()))
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

#[tokio::test(start_paused = true)]
async fn a_rule_whose_extractor_finds_no_key_does_not_apply() {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let one = Limit::per_minute(1).expect("a valid limit");
    let (inner, handle) = mock::pair::<Req, Res>();
    let mut reached = answer(handle);
    let mut svc = RateLimitLayer::new(store.clone())
        .rule(per_key(one))
        .layer(inner);

    // No header, or an empty one: no rule applies, nothing is limited, no field is added.
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
        .rule(per_key(one))
        .rule(global(orders()))
        .layer(counting(&Arc::new(AtomicUsize::new(0))));
    let res = call(&mut svc, request(None, "8")).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(header(&res, "ratelimit"), Some("\"global\";r=9;t=60"));
}

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
    yield_a_few_times().await;
    let quota = store.peek(&bucket, one_per_second).await.expect("peeks");
    assert_eq!(
        (quota.remaining(), quota.next_token_in(), quota.resets_in()),
        (0, Duration::from_secs(1), Duration::from_secs(1)),
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

#[cfg(feature = "redis")]
#[tokio::test]
async fn a_failing_store_answers_503_without_calling_the_inner_service() {
    let store = burstgate::RedisStore::new(FailingConnection);
    let (inner, mut handle) = mock::pair::<Req, Res>();
    let mut svc = RateLimitLayer::new(store)
        .rule(per_key(orders()))
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
