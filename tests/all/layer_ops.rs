//! What the tower layer offers operators: shadow mode, skipping, limits chosen per request and
//! changed at runtime, the decision hook, the decision in the handler's extensions, metrics
//! and refusal logs a flood cannot multiply. Time is tokio's, paused.
#![cfg(feature = "tower")]

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use burstgate::layer::{KeyExtractor, Outcome, RateLimitInfo, RateLimitLayer, Rule};
use burstgate::{Limit, MemoryStore, TokioClock};
use http::{Request, Response, StatusCode};
use tower::{Layer, Service};

use crate::support::layer::{API_KEY, LayerRes, Req, Res, call, counting};

fn limit(tokens: u32, burst: u32) -> Limit {
    Limit::per_minute(tokens)
        .and_then(|l| l.with_burst(burst))
        .expect("a valid limit")
}

fn per_key(limit: Limit) -> Rule {
    Rule::new("per-key", limit, KeyExtractor::header(API_KEY)).expect("a valid rule")
}

fn store() -> MemoryStore<TokioClock> {
    MemoryStore::new().with_clock(TokioClock::new())
}

fn from(key: &str) -> Req {
    Request::builder()
        .header(&API_KEY, key)
        .body(String::new())
        .expect("a valid request")
}

/// Every event the hook saw, as (rule, outcome, remaining).
type Events = Arc<Mutex<Vec<(String, Outcome, u32)>>>;

fn recording(
    layer: RateLimitLayer<MemoryStore<TokioClock>>,
) -> (RateLimitLayer<MemoryStore<TokioClock>>, Events) {
    let events: Events = Arc::default();
    let seen = Arc::clone(&events);
    let layer = layer.on_decision(move |e| {
        seen.lock()
            .expect("not poisoned")
            .push((e.rule().to_owned(), e.outcome(), e.remaining()));
    });
    (layer, events)
}

fn outcomes(events: &Events) -> Vec<Outcome> {
    events
        .lock()
        .expect("not poisoned")
        .iter()
        .map(|(_, o, _)| *o)
        .collect()
}

#[tokio::test(start_paused = true)]
async fn shadow_mode_refuses_nothing_and_reports_what_it_would_have_refused() {
    let calls = Arc::new(AtomicUsize::new(0));
    let shared = store();
    let (layer, events) = recording(
        RateLimitLayer::new(shared.clone())
            .rule(per_key(limit(1, 2)))
            .shadow(true),
    );
    let mut svc = layer.layer(counting(&calls));
    for _ in 0..5 {
        let res = call(&mut svc, from("k1")).await;
        assert_eq!(res.status(), StatusCode::OK);
        // The fields still tell the client where it stands.
        assert!(res.headers().contains_key("ratelimit"));
    }
    assert_eq!(calls.load(Ordering::SeqCst), 5);
    use Outcome::{Admitted, ShadowLimited};
    assert_eq!(
        outcomes(&events),
        [
            Admitted,
            Admitted,
            ShadowLimited,
            ShadowLimited,
            ShadowLimited
        ]
    );
    // Turned off, the same bucket refuses at once: shadow mode took the tokens it admitted.
    let mut svc = RateLimitLayer::new(shared)
        .rule(per_key(limit(1, 2)))
        .layer(counting(&calls));
    let res = call(&mut svc, from("k1")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(call(&mut svc, from("k2")).await.status(), StatusCode::OK);
}

#[tokio::test(start_paused = true)]
async fn a_shadow_rule_beside_an_enforced_one_never_decides_the_answer() {
    let calls = Arc::new(AtomicUsize::new(0));
    let trial = Rule::new("trial", limit(1, 1), KeyExtractor::global())
        .expect("a valid rule")
        .shadow(true);
    assert!(trial.is_shadow());
    let (layer, events) = recording(
        RateLimitLayer::new(store())
            .rule(trial)
            .rule(per_key(limit(1, 3))),
    );
    let mut svc = layer.layer(counting(&calls));
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(call(&mut svc, from("k1")).await.status());
    }
    use StatusCode as S;
    assert_eq!(statuses, [S::OK, S::OK, S::OK, S::TOO_MANY_REQUESTS]);
    let seen = events.lock().expect("not poisoned").clone();
    let named = |rule: &str| -> Vec<Outcome> {
        seen.iter()
            .filter(|(r, _, _)| r == rule)
            .map(|(_, o, _)| *o)
            .collect()
    };
    use Outcome::{Admitted, Limited, ShadowLimited};
    // The refused request reports its refusal only: what the shadow rule did for it was undone.
    assert_eq!(named("trial"), [Admitted, ShadowLimited, ShadowLimited]);
    assert_eq!(named("per-key"), [Admitted, Admitted, Admitted, Limited]);
}

#[tokio::test(start_paused = true)]
async fn a_shadow_rules_store_failure_lets_the_request_through_and_is_reported() {
    let calls = Arc::new(AtomicUsize::new(0));
    // A cost above the burst: the store refuses to decide.
    let broken = per_key(limit(1, 2)).cost(|_| 5).shadow(true);
    let (layer, events) = recording(RateLimitLayer::new(store()).rule(broken));
    let mut svc = layer.layer(counting(&calls));
    let res = call(&mut svc, from("k1")).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(outcomes(&events), [Outcome::Error]);

    // Enforced, the same rule answers 500 and reports the error.
    let (layer, events) =
        recording(RateLimitLayer::new(store()).rule(per_key(limit(1, 2)).cost(|_| 5)));
    let mut svc = layer.layer(counting(&calls));
    let res = call(&mut svc, from("k1")).await;
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(outcomes(&events), [Outcome::Error]);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn skipped_requests_take_no_tokens_and_carry_no_fields() {
    let calls = Arc::new(AtomicUsize::new(0));
    let (layer, events) = recording(
        RateLimitLayer::new(store())
            .rule(Rule::new("global", limit(1, 1), KeyExtractor::global()).expect("a valid rule"))
            .skip(|req| req.uri.path() == "/healthz"),
    );
    let mut svc = layer.layer(counting(&calls));
    let health = || Request::get("/healthz").body(String::new()).expect("valid");
    for _ in 0..3 {
        let res = call(&mut svc, health()).await;
        assert_eq!(res.status(), StatusCode::OK);
        assert!(!res.headers().contains_key("ratelimit"));
    }
    assert!(events.lock().expect("not poisoned").is_empty());
    // The one token is still there for the first real request.
    let other = || Request::get("/").body(String::new()).expect("valid");
    assert_eq!(call(&mut svc, other()).await.status(), StatusCode::OK);
    assert_eq!(
        call(&mut svc, other()).await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(call(&mut svc, health()).await.status(), StatusCode::OK);
}

/// Calls until a request is refused: how many were admitted, and the refusal.
async fn admitted<S>(svc: &mut S, make: &dyn Fn() -> Req) -> (usize, Res)
where
    S: Service<Req, Response = LayerRes>,
    S::Error: std::fmt::Debug,
{
    let mut n = 0;
    loop {
        let res = call(svc, make()).await;
        if res.status() != StatusCode::OK {
            return (n, res);
        }
        n += 1;
    }
}

/// What an authentication layer in front puts in the extensions.
#[derive(Clone, Copy)]
enum Plan {
    Pro,
}

#[tokio::test(start_paused = true)]
async fn a_limit_can_come_from_the_request_and_change_while_the_service_runs() {
    let free = limit(1, 2);
    let pro = Arc::new(RwLock::new(limit(1, 4)));
    let reloaded = Arc::clone(&pro);
    let rule = per_key(free).dynamic_limit(move |req| match req.extensions.get::<Plan>() {
        Some(Plan::Pro) => *reloaded.read().expect("not poisoned"),
        None => free,
    });
    assert_eq!(rule.limit(), free);
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = RateLimitLayer::new(store())
        .rule(rule)
        .layer(counting(&calls));
    let pro_req = |key: &str| {
        let mut req = from(key);
        req.extensions_mut().insert(Plan::Pro);
        req
    };
    let (n, res) = admitted(&mut svc, &|| from("free")).await;
    assert_eq!(n, 2);
    assert_eq!(res.headers()["ratelimit-policy"], "\"per-key\";q=2;w=120");
    let (n, res) = admitted(&mut svc, &|| pro_req("pro")).await;
    assert_eq!(n, 4);
    assert_eq!(res.headers()["ratelimit-policy"], "\"per-key\";q=4;w=240");

    // A reload raises the pro burst: the next request already sees it, no rebuild.
    *pro.write().expect("not poisoned") = limit(1, 6);
    let (n, res) = admitted(&mut svc, &|| pro_req("pro")).await;
    // The bucket kept what it held (empty) and refills to the new burst; a fresh key gets it all.
    assert_eq!(n, 0);
    assert_eq!(res.headers()["ratelimit-policy"], "\"per-key\";q=6;w=360");
    let (n, _) = admitted(&mut svc, &|| pro_req("pro-2")).await;
    assert_eq!(n, 6);
}

#[tokio::test(start_paused = true)]
async fn the_handler_sees_the_tightest_rules_decision() {
    let seen: Arc<Mutex<Vec<Option<RateLimitInfo>>>> = Arc::default();
    let record = Arc::clone(&seen);
    let inner = tower::service_fn(move |req: Req| {
        record
            .lock()
            .expect("not poisoned")
            .push(req.extensions().get::<RateLimitInfo>().cloned());
        async { Ok::<_, Infallible>(Response::new(String::new())) }
    });
    let mut svc = RateLimitLayer::new(store())
        .rule(per_key(limit(1, 5)))
        .rule(Rule::new("global", limit(1, 3), KeyExtractor::global()).expect("a valid rule"))
        .layer(inner);
    for _ in 0..2 {
        assert_eq!(call(&mut svc, from("k1")).await.status(), StatusCode::OK);
    }
    let seen = seen.lock().expect("not poisoned").clone();
    let last = seen[1].clone().expect("the decision is in the extensions");
    assert_eq!(last.rule(), "global");
    assert_eq!(last.remaining(), 1);
    assert_eq!(last.limit(), limit(1, 3));
    // Two tokens short of full at one a minute.
    assert_eq!(last.resets_in(), Duration::from_secs(120));
    assert!(!last.shadow_limited());
    assert_eq!(seen[0].as_ref().map(RateLimitInfo::remaining), Some(2));
}

#[tokio::test(start_paused = true)]
async fn refusals_are_logged_at_info_once_per_period_with_what_was_held_back() {
    let (captured, _guard) = crate::support::logs::capture();
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = RateLimitLayer::new(store())
        .rule(per_key(limit(1, 1)))
        .layer(counting(&calls));
    assert_eq!(call(&mut svc, from("k1")).await.status(), StatusCode::OK);
    for _ in 0..50 {
        let res = call(&mut svc, from("k1")).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    }
    let infos = || captured.infos();
    assert_eq!(infos().len(), 1, "one event for the flood: {:?}", infos());
    assert!(infos()[0].contains("suppressed=0"), "{:?}", infos());
    assert!(!infos()[0].contains("k1"), "the key never reaches the log");
    tokio::time::advance(Duration::from_secs(10)).await;
    // A minute's token came back at 60 s only: still refused, now logged with the 49 held back.
    let res = call(&mut svc, from("k1")).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(infos().len(), 2);
    assert!(infos()[1].contains("suppressed=49"), "{:?}", infos());
}

#[cfg(feature = "axum")]
#[tokio::test(start_paused = true)]
async fn axum_handlers_extract_the_decision() {
    use axum::Router;
    use axum::routing::get;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    async fn quota(info: RateLimitInfo) -> String {
        format!("{} left on {}", info.remaining(), info.rule())
    }
    async fn maybe(info: Option<RateLimitInfo>) -> String {
        format!("{:?}", info.map(|i| i.remaining()))
    }
    let per_key = per_key(limit(1, 3)).on_missing_key(burstgate::layer::MissingKey::Pass);
    let layer = RateLimitLayer::new(store()).rule(per_key);
    let app = Router::new()
        .route("/quota", get(quota))
        .route("/maybe", get(maybe))
        .layer(layer);
    let get = |path: &str, key: Option<&str>| {
        let mut req = Request::get(path);
        if let Some(key) = key {
            req = req.header(&API_KEY, key);
        }
        req.body(axum::body::Body::empty()).expect("valid")
    };
    let body = async |res: http::Response<axum::body::Body>| {
        let bytes = res.into_body().collect().await.expect("a body").to_bytes();
        String::from_utf8(bytes.to_vec()).expect("utf-8")
    };
    let res = app
        .clone()
        .oneshot(get("/quota", Some("k1")))
        .await
        .expect("infallible");
    assert_eq!(body(res).await, "2 left on per-key");
    let res = app
        .clone()
        .oneshot(get("/maybe", Some("k1")))
        .await
        .expect("infallible");
    assert_eq!(body(res).await, "Some(1)");
    // No key, so no rule applied: the optional extractor sees none, the plain one refuses.
    let res = app
        .clone()
        .oneshot(get("/maybe", None))
        .await
        .expect("infallible");
    assert_eq!(body(res).await, "None");
    let res = app.oneshot(get("/quota", None)).await.expect("infallible");
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(body(res).await.contains("no RateLimitLayer"));
}

#[cfg(feature = "metrics")]
#[test]
fn decisions_are_counted_by_rule_and_outcome() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a runtime");
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let calls = Arc::new(AtomicUsize::new(0));
            let mut svc = RateLimitLayer::new(store())
                .rule(per_key(limit(1, 3)))
                .rule(
                    Rule::new("trial", limit(1, 1), KeyExtractor::global())
                        .expect("a valid rule")
                        .shadow(true),
                )
                .layer(counting(&calls));
            for _ in 0..5 {
                call(&mut svc, from("k1")).await;
            }
        });
    });
    let mut counts: Vec<(String, String, u64)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| key.key().name() == burstgate::metrics::DECISIONS)
        .filter_map(|(key, _, _, value)| {
            let label = |name: &str| {
                key.key()
                    .labels()
                    .find(|l| l.key() == name)
                    .map(|l| l.value().to_owned())
                    .unwrap_or_default()
            };
            match value {
                DebugValue::Counter(n) if n > 0 => Some((label("rule"), label("outcome"), n)),
                _ => None,
            }
        })
        .collect();
    counts.sort();
    let expect = |r: &str, o: &str, n: u64| (r.to_owned(), o.to_owned(), n);
    assert_eq!(
        counts,
        [
            expect("per-key", "admitted", 3),
            expect("per-key", "limited", 2),
            expect("trial", "admitted", 1),
            expect("trial", "shadow_limited", 2),
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn layer_wide_shadow_mode_never_waits() {
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = RateLimitLayer::new(store())
        .rule(per_key(limit(1, 1)))
        .max_wait(Duration::from_secs(600))
        .shadow(true)
        .layer(counting(&calls));
    let started = tokio::time::Instant::now();
    for _ in 0..3 {
        assert_eq!(call(&mut svc, from("k1")).await.status(), StatusCode::OK);
    }
    assert_eq!(
        started.elapsed(),
        Duration::ZERO,
        "shadow mode made a request wait"
    );
}
