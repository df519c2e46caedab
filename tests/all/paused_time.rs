//! Buckets driven by tokio's paused clock through `TokioClock`: no real sleeps, exact times.

use std::time::Duration;

use burstgate::{BucketKey, BucketStore, Limit, MemoryStore, TokioClock};
use tokio::time::Instant;

fn orders() -> Limit {
    Limit::per_minute(1)
        .and_then(|l| l.with_burst(2))
        .expect("a valid limit")
}

#[tokio::test(start_paused = true)]
async fn sleeping_retry_after_is_admitted_on_the_first_retry() {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let key = BucketKey::new("orders", "seller").expect("a valid key");
    for _ in 0..2 {
        assert!(
            store
                .acquire(&key, orders(), 1, Duration::ZERO)
                .await
                .expect("decides")
                .is_admitted()
        );
    }
    let started = Instant::now();
    let d = store
        .acquire(&key, orders(), 1, Duration::ZERO)
        .await
        .expect("decides");
    let retry = d.retry_after().expect("denied");
    assert_eq!(retry, Duration::from_secs(60));
    tokio::time::sleep(retry).await;
    let d = store
        .acquire(&key, orders(), 1, Duration::ZERO)
        .await
        .expect("decides");
    assert!(d.is_admitted(), "{d:?}");
    assert_eq!(started.elapsed(), Duration::from_secs(60));
}

#[tokio::test(start_paused = true)]
async fn reserved_callers_go_out_one_interval_apart() {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let key = BucketKey::new("orders", "seller").expect("a valid key");
    let ceiling = orders().default_max_wait(1);
    assert_eq!(ceiling, Duration::from_secs(120));
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..4 {
        let (store, key) = (store.clone(), key.clone());
        workers.push(tokio::spawn(async move {
            let d = store
                .acquire(&key, orders(), 1, ceiling)
                .await
                .expect("decides");
            assert!(d.is_admitted(), "{d:?}");
            tokio::time::sleep(d.wait()).await;
            started.elapsed()
        }));
    }
    let mut sent = Vec::new();
    for w in workers {
        sent.push(w.await.expect("the worker finishes"));
    }
    sent.sort();
    let secs: Vec<u64> = sent.iter().map(Duration::as_secs).collect();
    assert_eq!(secs, [0, 0, 60, 120]);
    // Two minutes on, the queue has drained to one reservation's worth.
    let d = store
        .acquire(&key, orders(), 1, ceiling)
        .await
        .expect("decides");
    assert!(d.is_admitted());
    assert_eq!(d.wait(), Duration::from_secs(60));
}

#[tokio::test(start_paused = true)]
async fn a_wait_past_the_ceiling_is_denied_without_taking_anything() {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    let key = BucketKey::new("orders", "seller").expect("a valid key");
    let ceiling = orders().default_max_wait(1);
    let mut waits = Vec::new();
    for _ in 0..4 {
        let d = store
            .acquire(&key, orders(), 1, ceiling)
            .await
            .expect("decides");
        waits.push(d.wait().as_secs());
    }
    assert_eq!(waits, [0, 0, 60, 120]);
    let d = store
        .acquire(&key, orders(), 1, ceiling)
        .await
        .expect("decides");
    assert_eq!(d.retry_after(), Some(Duration::from_secs(180)));
    let d = store
        .acquire(&key, orders(), 1, ceiling)
        .await
        .expect("decides");
    assert_eq!(d.retry_after(), Some(Duration::from_secs(180)));
}
