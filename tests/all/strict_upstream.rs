//! A client given an API's published limit and nothing else, against a strict upstream on a
//! real socket (`support::strict`: its bucket full at the first request it receives, no
//! tolerance): one process, and four processes sharing one real Redis (four stores, each on a
//! connection and a measured clock of its own), each with several workers asking as fast as
//! they are let. The default margin of `Route::new` keeps every request inside the upstream's
//! bucket, and leaves at least 90% of its budget used. The runs here last a few seconds; the
//! 20-second runs are in the slow tier.
#![cfg(all(feature = "reqwest", feature = "redis"))]

use std::time::Duration;

use burstgate::middleware::{RateLimitMiddleware, Route, rate_limited};
use burstgate::{Limit, RedisStore};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use tokio::time::Instant;

use crate::support::redis_server;
use crate::support::strict::StrictUpstream;

/// Workers per process, each sending one request after another.
const WORKERS: usize = 4;

struct Run {
    admitted: usize,
    rejected: usize,
    budget: usize,
}

/// `processes` clients, each on its own store on one Redis, spend `limit` (the published one,
/// with the route's defaults) against a strict upstream of that rate and burst for `secs`.
async fn run(limit: Limit, processes: usize, secs: u64) -> Run {
    let per_token = limit.interval() / limit.tokens();
    let upstream = StrictUpstream::start(per_token, limit.burst()).await;
    let prefix = redis_server::unique_prefix();
    let mut clients: Vec<ClientWithMiddleware> = Vec::new();
    for _ in 0..processes {
        let store = RedisStore::connect(&redis_server::url())
            .await
            .expect("a store on the test Redis")
            .prefix(&prefix)
            .expect("a valid prefix");
        let limiter = RateLimitMiddleware::new(store)
            .route(Route::new("api", limit, "/**").expect("a route"));
        clients.push(
            ClientBuilder::new(reqwest::Client::new())
                .with(limiter)
                .build(),
        );
    }
    let until = Instant::now() + Duration::from_secs(secs);
    let mut workers = Vec::new();
    for client in &clients {
        for _ in 0..WORKERS {
            let client = client.clone();
            let url = format!("{}/orders", upstream.url);
            workers.push(tokio::spawn(async move {
                while Instant::now() < until {
                    match client.get(&url).send().await {
                        Ok(_) => {}
                        // Its turn lay beyond the longest wait: not sent, and asked again when
                        // the budget allows.
                        Err(e) => {
                            let limited = rate_limited(&e).expect("only the local 429");
                            let left = until.saturating_duration_since(Instant::now());
                            tokio::time::sleep(limited.retry_after().min(left)).await;
                        }
                    }
                }
            }));
        }
    }
    for worker in workers {
        worker.await.expect("a worker");
    }
    let totals = upstream.totals();
    let budget = upstream.budget();
    upstream.stop().await;
    Run {
        admitted: totals.admitted,
        rejected: totals.rejected,
        budget,
    }
}

async fn check(limit: Limit, processes: usize, secs: u64) {
    let run = run(limit, processes, secs).await;
    let used = run.admitted as f64 / run.budget as f64;
    eprintln!(
        "{limit}, {processes} process(es), {secs} s: {} admitted, {} x 429, budget {}, {:.1}% used",
        run.admitted,
        run.rejected,
        run.budget,
        used * 100.0
    );
    assert_eq!(run.rejected, 0, "no 429 from the strict upstream");
    assert!(
        used >= 0.9,
        "{} of a budget of {} is under 90%",
        run.admitted,
        run.budget
    );
}

fn five_a_second() -> Limit {
    Limit::per_second(5).expect("a limit")
}

fn one_a_second_burst_10() -> Limit {
    Limit::per_second(1)
        .and_then(|l| l.with_burst(10))
        .expect("a limit")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_published_rate_earns_no_429_from_a_strict_upstream_at_5_a_second() {
    check(five_a_second(), 1, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_published_rate_earns_no_429_from_a_strict_upstream_at_5_a_second_in_four_processes() {
    check(five_a_second(), 4, 5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_published_rate_earns_no_429_from_a_strict_upstream_at_1_a_second_burst_10() {
    check(one_a_second_burst_10(), 1, 6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_published_rate_earns_no_429_from_a_strict_upstream_at_1_a_second_burst_10_in_four_processes()
 {
    check(one_a_second_burst_10(), 4, 6).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: 20 s of real time"]
async fn for_20_s_the_published_rate_earns_no_429_from_a_strict_upstream_at_5_a_second() {
    check(five_a_second(), 1, 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: 20 s of real time"]
async fn for_20_s_the_published_rate_earns_no_429_from_a_strict_upstream_at_5_a_second_in_four_processes()
 {
    check(five_a_second(), 4, 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: 20 s of real time"]
async fn for_20_s_the_published_rate_earns_no_429_from_a_strict_upstream_at_1_a_second_burst_10() {
    check(one_a_second_burst_10(), 1, 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: 20 s of real time"]
async fn for_20_s_the_published_rate_earns_no_429_from_a_strict_upstream_at_1_a_second_burst_10_in_four_processes()
 {
    check(one_a_second_burst_10(), 4, 20).await;
}
