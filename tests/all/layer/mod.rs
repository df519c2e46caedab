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
mod answers;
mod rules;
mod service;

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

/// Waits until the refunds of the requests just dropped are made: the front end gives them back
/// on a task of its own, a millisecond on, so that requests dropped together go back together.
async fn refunds_made() {
    tokio::time::sleep(Duration::from_millis(1)).await;
    yield_a_few_times().await;
}

async fn yield_a_few_times() {
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
}
