//! Decisions per second of every `BucketStore`, measured by the same code.
//!
//! [`acquire_round_robin`] is the one loop that takes decisions; it is generic over the store,
//! like governor's `bench_keyed<M: KeyedStateStore>`, and every case below runs it:
//!
//! - `memory/{1_key,10k_keys}/threads/{1,2}`: a `MemoryStore`, its futures polled once with a
//!   no-op waker (they are always ready, so no runtime is involved); with two threads both run
//!   the loop at once on clones of the store.
//! - `redis/tasks/{1,16,64}`: a `RedisStore` over one `MultiplexedConnection` to a private
//!   `redis-server` (see `testkit/src/redis_server.rs`), with 1, 16 or 64 tokio tasks sharing
//!   it. Needs the `redis` feature.
//! - `two_buckets/{memory,redis}/{acquire_all,in_turn}`: requests that each draw from two
//!   buckets of one account (an endpoint's and the account's), over 10,000 accounts: one
//!   `acquire_all`, against the two `acquire`s it replaces, one after the other; one thread, or
//!   one tokio task. Throughput is in requests per second.
//!
//! `cargo bench --bench store`; throughput is reported in decisions per second.

use std::future::Future;
use std::hint::black_box;
use std::pin::pin;
use std::sync::{Arc, Barrier};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use burstgate::{BucketKey, BucketStore, Limit, MemoryStore, Take};
use criterion::{Criterion, Throughput};

#[cfg(feature = "redis")]
use burstgate_testkit::redis_server;

/// The number of distinct keys in the many-keys cases.
const MANY_KEYS: usize = 10_000;

/// A limit no run can exhaust: 2^32 − 1 tokens per second, and as many in the bucket. Every
/// decision is an admission, so each case measures the same path (read, refill, debit, write)
/// and the figures do not depend on how long criterion chooses to run.
fn limit() -> Limit {
    Limit::per_second(u32::MAX).expect("a valid limit")
}

/// Keys `0..count` of the bucket "bench", built once, before anything is measured.
fn keys(count: usize) -> Arc<[BucketKey]> {
    (0..count)
        .map(|i| BucketKey::new("bench", format!("client-{i}")).expect("a valid key"))
        .collect()
}

/// Where a worker starts in the key ring, so that parallel workers do not walk it in lockstep.
fn offset(worker: usize, workers: usize, keys: &[BucketKey]) -> usize {
    worker * keys.len() / workers
}

/// The measured loop, shared by every store: `n` acquires of cost 1, round-robin over `keys`
/// from `start`. Returns how many were admitted.
async fn acquire_round_robin<S: BucketStore>(
    store: &S,
    keys: &[BucketKey],
    start: usize,
    n: u64,
) -> u64 {
    let limit = limit();
    let mut admitted = 0;
    let mut i = start % keys.len();
    for _ in 0..n {
        let decision = store
            .acquire(&keys[i], limit, 1, Duration::ZERO)
            .await
            .expect("the store decides");
        admitted += u64::from(black_box(decision).is_admitted());
        i += 1;
        if i == keys.len() {
            i = 0;
        }
    }
    admitted
}

/// The smallest executor: polls `future` once with a waker that does nothing, and insists it was
/// ready. Enough for stores whose futures never wait, such as `MemoryStore`.
fn ready<F: Future>(future: F) -> F::Output {
    let mut cx = Context::from_waker(Waker::noop());
    match pin!(future).poll(&mut cx) {
        Poll::Ready(out) => out,
        Poll::Pending => panic!("the store's future was not ready on its first poll"),
    }
}

/// `threads` threads, each taking `iters` decisions on its own clone of a store whose futures are
/// always ready. The time runs from the moment all threads are released to the last one's end.
fn on_threads<S: BucketStore + Clone>(
    store: &S,
    keys: &Arc<[BucketKey]>,
    threads: usize,
    iters: u64,
) -> Duration {
    if threads == 1 {
        let start = Instant::now();
        let admitted = ready(acquire_round_robin(store, keys, 0, iters));
        let elapsed = start.elapsed();
        assert_eq!(admitted, iters, "the limit admits every request");
        return elapsed;
    }
    let go = Barrier::new(threads + 1);
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let store = store.clone();
                let go = &go;
                scope.spawn(move || {
                    go.wait();
                    ready(acquire_round_robin(
                        &store,
                        keys,
                        offset(t, threads, keys),
                        iters,
                    ))
                })
            })
            .collect();
        go.wait();
        let start = Instant::now();
        let admitted: u64 = workers
            .into_iter()
            .map(|w| w.join().expect("a bench thread panicked"))
            .sum();
        let elapsed = start.elapsed();
        assert_eq!(
            admitted,
            iters * threads as u64,
            "the limit admits every request"
        );
        elapsed
    })
}

/// `tasks` tokio tasks sharing `iters` decisions (as evenly as they divide), each on its own clone
/// of the store. The time includes spawning the tasks, a few microseconds per sample.
#[cfg(feature = "redis")]
fn on_tasks<S: BucketStore + Clone>(
    runtime: &tokio::runtime::Runtime,
    store: &S,
    keys: &Arc<[BucketKey]>,
    tasks: u64,
    iters: u64,
) -> Duration {
    runtime.block_on(async {
        let start = Instant::now();
        let handles: Vec<_> = (0..tasks)
            .map(|t| {
                let n = iters / tasks + u64::from(t < iters % tasks);
                let store = store.clone();
                let keys = Arc::clone(keys);
                let from = offset(t as usize, tasks as usize, &keys);
                tokio::spawn(async move { acquire_round_robin(&store, &keys, from, n).await })
            })
            .collect();
        let mut admitted = 0;
        for handle in handles {
            admitted += handle.await.expect("a bench task panicked");
        }
        let elapsed = start.elapsed();
        assert_eq!(admitted, iters, "the limit admits every request");
        elapsed
    })
}

// Both stores read the `SystemClock`, the clock they use in production: reading it (a vDSO
// `clock_gettime`) is part of what a real decision costs, and `ManualClock`'s atomic load would
// flatter the figures. The limit above is large enough that real time passing changes nothing.

fn memory(c: &mut Criterion) {
    let mut group = c.benchmark_group("memory");
    for (label, key_count) in [("1_key", 1), ("10k_keys", MANY_KEYS)] {
        let keys = keys(key_count);
        for threads in [1_usize, 2] {
            // A fresh store per case, so one case's buckets do not weigh on the next.
            let store = MemoryStore::new();
            group.throughput(Throughput::Elements(threads as u64));
            group.bench_function(format!("{label}/threads/{threads}"), |b| {
                b.iter_custom(|iters| on_threads(&store, &keys, threads, iters));
            });
        }
    }
    group.finish();
}

/// A `RedisStore` under a prefix of its own, over one connection to the bench's Redis, opened
/// on `runtime`.
#[cfg(feature = "redis")]
fn redis_store(
    runtime: &tokio::runtime::Runtime,
) -> burstgate::RedisStore<redis::aio::MultiplexedConnection> {
    let url = redis_server::url();
    let conn = runtime.block_on(async {
        redis::Client::open(url.as_str())
            .expect("a valid Redis URL")
            .get_multiplexed_async_connection()
            .await
            .expect("a connection to the bench's Redis")
    });
    burstgate::RedisStore::new(conn)
        .prefix(&redis_server::unique_prefix())
        .expect("a valid prefix")
}

#[cfg(feature = "redis")]
fn redis(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let store = redis_store(&runtime);
    let keys = keys(MANY_KEYS);

    let mut group = c.benchmark_group("redis");
    group.throughput(Throughput::Elements(1));
    for tasks in [1_u64, 16, 64] {
        group.bench_function(format!("tasks/{tasks}"), |b| {
            b.iter_custom(|iters| on_tasks(&runtime, &store, &keys, tasks, iters));
        });
    }
    group.finish();
}

/// `n` requests on two buckets each, round-robin over `accounts` from `start`: one
/// `acquire_all` per request, or (`together` false) the two `acquire`s it replaces.
async fn two_buckets<S: BucketStore>(
    store: &S,
    accounts: &[(BucketKey, BucketKey)],
    start: usize,
    n: u64,
    together: bool,
) -> u64 {
    let limit = limit();
    let mut admitted = 0;
    let mut i = start % accounts.len();
    for _ in 0..n {
        let (endpoint, account) = &accounts[i];
        let ok = if together {
            let takes = [Take::new(endpoint, limit, 1), Take::new(account, limit, 1)];
            let decisions = store
                .acquire_all(&takes, Duration::ZERO)
                .await
                .expect("the store decides");
            black_box(decisions).iter().all(|d| d.is_admitted())
        } else {
            let first = store.acquire(endpoint, limit, 1, Duration::ZERO).await;
            let second = store.acquire(account, limit, 1, Duration::ZERO).await;
            black_box(first).expect("the store decides").is_admitted()
                && black_box(second).expect("the store decides").is_admitted()
        };
        admitted += u64::from(ok);
        i += 1;
        if i == accounts.len() {
            i = 0;
        }
    }
    admitted
}

/// The endpoint's and the account's bucket of `MANY_KEYS` accounts.
fn account_pairs() -> Vec<(BucketKey, BucketKey)> {
    (0..MANY_KEYS)
        .map(|i| {
            let account = format!("client-{i}");
            (
                BucketKey::new("orders", &account).expect("a valid key"),
                BucketKey::new("account", &account).expect("a valid key"),
            )
        })
        .collect()
}

fn several(c: &mut Criterion) {
    let pairs = account_pairs();
    let mut group = c.benchmark_group("two_buckets");
    group.throughput(Throughput::Elements(1));
    for (label, together) in [("acquire_all", true), ("in_turn", false)] {
        let store = MemoryStore::new();
        group.bench_function(format!("memory/{label}"), |b| {
            b.iter_custom(|iters| {
                let started = Instant::now();
                let admitted = ready(two_buckets(&store, &pairs, 0, iters, together));
                assert_eq!(admitted, iters);
                started.elapsed()
            });
        });
    }
    #[cfg(feature = "redis")]
    {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let store = redis_store(&runtime);
        for (label, together) in [("acquire_all", true), ("in_turn", false)] {
            group.bench_function(format!("redis/{label}"), |b| {
                b.iter_custom(|iters| {
                    let started = Instant::now();
                    let admitted =
                        runtime.block_on(two_buckets(&store, &pairs, 0, iters, together));
                    assert_eq!(admitted, iters);
                    started.elapsed()
                });
            });
        }
    }
    group.finish();
}

// `main` by hand instead of `criterion_group!`/`criterion_main!`: the group macro makes a `pub fn`
// that the crate's `missing_docs` lint would flag, and the Redis cases come and go with a feature.
fn main() {
    let mut criterion = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    memory(&mut criterion);
    #[cfg(feature = "redis")]
    redis(&mut criterion);
    several(&mut criterion);
    criterion.final_summary();
}
