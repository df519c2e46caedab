//! `MemoryStore` against governor's keyed limiter, on the same key distributions.
//!
//! - `keyed/<side>/1_key`: one `String` key, one thread.
//! - `keyed/<side>/10k_keys`: 10,000 `String` keys, round robin, one thread.
//! - `keyed/<side>/10k_keys_2_threads`: the same on two threads at once, each making the
//!   measured number of decisions from its own starting point, so both go through every key
//!   (throughput counts both threads). Each decision finds its bucket last written by the other
//!   thread, so this is the most sharing two threads can do: every decision moves a cache line
//!   from the other core (see `cache_line_between_threads` below).
//! - `keyed/<side>/10k_keys_2_threads_own_halves`: two threads again, each going round its own
//!   5,000 of the 10,000 keys in one store, as when each client's requests come in on one
//!   connection and so on one worker thread: the threads share the store, but no bucket.
//!
//! - `control/...`: what this machine allows two threads, for work that shares nothing: the
//!   same 10,000-key decisions, each thread on a `MemoryStore` of its own (`own_store`), and a
//!   loop of integer arithmetic that touches no memory (`arith`), each on one thread and on two;
//!   and `cache_line_between_threads`, the time one thread waits to see a write by the other
//!   (a counter passed back and forth). Two threads on shared buckets wait about that long for
//!   each cache line the other thread wrote last; on a virtual machine it moves with where the
//!   host runs the two virtual CPUs, and the two-thread figures move with it.
//!
//! Every side admits every request (a rate no run can exhaust), so each measures its admit path,
//! with the same keys (`client-<i>`) and the same rate. What each side pays per decision:
//!
//! - `burstgate`: `MemoryStore` on `SystemClock` (the wall clock, which shared buckets need:
//!   `SystemTime::now`, a vDSO `clock_gettime`); a foldhash of the key's id
//!   (`bench:client-<i>`); a probe of its shard's index; the bucket's own spin lock, taken and
//!   released on the bucket's cache line; the exact `f64` bucket arithmetic that Redis mirrors;
//!   a full `Decision` (wait, remaining tokens, reset). At this rate a bucket is full again right
//!   after its decision, but every key comes back within a few milliseconds, well inside the
//!   second a table keeps a full bucket, so after the warm-up every decision takes the lock-free
//!   path to a bucket already in its shard's table.
//! - `burstgate_quanta`: the same store on `QuantaClock`, the CPU's time-stamp counter read
//!   through quanta (feature `quanta`): the clock governor uses by default.
//! - `governor`: governor's default keyed limiter: a `DashMap` hashed with SipHash, an integer
//!   GCRA on one atomic per key, and quanta's clock, which reads the CPU's time-stamp counter
//!   directly (cheaper than `clock_gettime`). The answer is admitted or not, with the earliest
//!   time to retry when not.
//! - `governor_std`: the same limiter on governor's `SystemClock` (`SystemTime::now`).
//!
//! Like is compared with like: `burstgate_quanta` with `governor`, `burstgate` with
//! `governor_std`.
//!
//! `cargo bench --all-features --bench governor`.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant, SystemTime};

use burstgate::{BucketKey, BucketStore, Clock, Limit, MemoryStore, QuantaClock};
use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput};
use governor::clock::SystemClock;
use governor::middleware::NoOpMiddleware;
use governor::state::keyed::DashMapStateStore;
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};

const MANY_KEYS: usize = 10_000;

fn limit() -> Limit {
    Limit::per_second(u32::MAX).expect("a valid limit")
}

type StdClockLimiter =
    RateLimiter<String, DashMapStateStore<String>, SystemClock, NoOpMiddleware<SystemTime>>;

fn governor_limiter() -> DefaultKeyedRateLimiter<String> {
    RateLimiter::keyed(Quota::per_second(NonZeroU32::MAX))
}

fn governor_std_limiter() -> StdClockLimiter {
    RateLimiter::new(
        Quota::per_second(NonZeroU32::MAX),
        DashMapStateStore::default(),
        SystemClock,
    )
}

fn names(count: usize) -> Vec<String> {
    (0..count).map(|i| format!("client-{i}")).collect()
}

fn bucket_keys(names: &[String]) -> Vec<BucketKey> {
    names
        .iter()
        .map(|n| BucketKey::new("bench", n).expect("a valid key"))
        .collect()
}

/// `n` decisions on `store`, round robin over `keys` from `start`; a `MemoryStore` future is
/// ready on its first poll, so no runtime is involved.
fn burstgate_loop<C: Clock>(store: &MemoryStore<C>, keys: &[BucketKey], start: usize, n: u64) {
    let limit = limit();
    let mut cx = Context::from_waker(Waker::noop());
    for i in 0..n as usize {
        let key = &keys[(start + i) % keys.len()];
        let decided = match pin!(store.acquire(key, limit, 1, Duration::ZERO)).poll(&mut cx) {
            Poll::Ready(d) => d.expect("the acquire succeeds"),
            Poll::Pending => panic!("a MemoryStore future was pending"),
        };
        assert!(black_box(decided).is_admitted());
    }
}

/// `n` checks through `check` (one of governor's limiters), round robin over `keys` from
/// `start`.
fn governor_loop(check: impl Fn(&String) -> bool, keys: &[String], start: usize, n: u64) {
    for i in 0..n as usize {
        let key = &keys[(start + i) % keys.len()];
        assert!(black_box(check(key)));
    }
}

/// Benchmarks `run(at, iters)` as `id`: each sample starts where the one before stopped in a
/// rotation over `len` keys, so every key is decided as often as every other.
fn rotating(
    group: &mut BenchmarkGroup<'_, WallTime>,
    id: &str,
    len: usize,
    run: impl Fn(usize, u64),
) {
    let mut next = 0;
    group.bench_function(id, |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            run(next, iters);
            next = (next + iters as usize) % len;
            start.elapsed()
        })
    });
}

/// Benchmarks `run(at, iters)` as `id` on two threads at once, one starting at the first of the
/// [`MANY_KEYS`] keys and one halfway, so both go through every key.
fn from_two_halves(
    group: &mut BenchmarkGroup<'_, WallTime>,
    id: &str,
    run: impl Fn(usize, u64) + Sync,
) {
    group.bench_function(id, |b| {
        b.iter_custom(|iters| two_threads(iters, |w, n| run(w * MANY_KEYS / 2, n)))
    });
}

/// Benchmarks `run(half, at, iters)` as `id` on two threads at once, each going round its own
/// half of the [`MANY_KEYS`] keys, every sample starting where its last stopped.
fn on_own_halves(
    group: &mut BenchmarkGroup<'_, WallTime>,
    id: &str,
    run: impl Fn(usize, usize, u64) + Sync,
) {
    let mut next = 0;
    group.bench_function(id, |b| {
        b.iter_custom(|iters| {
            let at = next;
            next = (next + iters as usize) % (MANY_KEYS / 2);
            two_threads(iters, |w, n| run(w, at, n))
        })
    });
}

/// Runs `work(worker, iters)` on two threads at once and returns the wall time.
fn two_threads(iters: u64, work: impl Fn(usize, u64) + Sync) -> Duration {
    let barrier = Barrier::new(2);
    let elapsed = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|w| {
                let (barrier, work) = (&barrier, &work);
                s.spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    work(w, iters);
                    start.elapsed()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("the worker finishes"))
            .max()
            .unwrap_or_default()
    });
    black_box(elapsed)
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("keyed");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));

    for (name, count) in [("1_key", 1), ("10k_keys", MANY_KEYS)] {
        let strings = names(count);
        let keys = bucket_keys(&strings);
        group.throughput(Throughput::Elements(1));

        let store = MemoryStore::new();
        rotating(&mut group, &format!("burstgate/{name}"), count, |at, n| {
            burstgate_loop(&store, &keys, at, n)
        });
        let store = MemoryStore::new().with_clock(QuantaClock::new());
        rotating(
            &mut group,
            &format!("burstgate_quanta/{name}"),
            count,
            |at, n| burstgate_loop(&store, &keys, at, n),
        );
        let limiter = governor_limiter();
        rotating(&mut group, &format!("governor/{name}"), count, |at, n| {
            governor_loop(|k| limiter.check_key(k).is_ok(), &strings, at, n)
        });
        let limiter = governor_std_limiter();
        rotating(
            &mut group,
            &format!("governor_std/{name}"),
            count,
            |at, n| governor_loop(|k| limiter.check_key(k).is_ok(), &strings, at, n),
        );
    }

    let strings: Arc<[String]> = names(MANY_KEYS).into();
    let keys: Arc<[BucketKey]> = bucket_keys(&strings).into();
    group.throughput(Throughput::Elements(2));
    let store = MemoryStore::new();
    from_two_halves(&mut group, "burstgate/10k_keys_2_threads", |at, n| {
        burstgate_loop(&store, &keys, at, n)
    });
    let store = MemoryStore::new().with_clock(QuantaClock::new());
    from_two_halves(
        &mut group,
        "burstgate_quanta/10k_keys_2_threads",
        |at, n| burstgate_loop(&store, &keys, at, n),
    );
    let limiter = governor_limiter();
    from_two_halves(&mut group, "governor/10k_keys_2_threads", |at, n| {
        governor_loop(|k| limiter.check_key(k).is_ok(), &strings, at, n)
    });
    let limiter = governor_std_limiter();
    from_two_halves(&mut group, "governor_std/10k_keys_2_threads", |at, n| {
        governor_loop(|k| limiter.check_key(k).is_ok(), &strings, at, n)
    });

    let halves = |w: usize| w * MANY_KEYS / 2..(w + 1) * MANY_KEYS / 2;
    let store = MemoryStore::new();
    on_own_halves(
        &mut group,
        "burstgate/10k_keys_2_threads_own_halves",
        |w, at, n| burstgate_loop(&store, &keys[halves(w)], at, n),
    );
    let store = MemoryStore::new().with_clock(QuantaClock::new());
    on_own_halves(
        &mut group,
        "burstgate_quanta/10k_keys_2_threads_own_halves",
        |w, at, n| burstgate_loop(&store, &keys[halves(w)], at, n),
    );
    let limiter = governor_limiter();
    on_own_halves(
        &mut group,
        "governor/10k_keys_2_threads_own_halves",
        |w, at, n| governor_loop(|k| limiter.check_key(k).is_ok(), &strings[halves(w)], at, n),
    );
    let limiter = governor_std_limiter();
    on_own_halves(
        &mut group,
        "governor_std/10k_keys_2_threads_own_halves",
        |w, at, n| governor_loop(|k| limiter.check_key(k).is_ok(), &strings[halves(w)], at, n),
    );
    group.finish();
    controls(c, &keys);
}

/// The same work on one thread and on two, with nothing shared between the threads: how much a
/// second thread can add on this machine at all.
fn controls(c: &mut Criterion, keys: &[BucketKey]) {
    let mut group = c.benchmark_group("control");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    let stores = [
        MemoryStore::new().with_clock(QuantaClock::new()),
        MemoryStore::new().with_clock(QuantaClock::new()),
    ];

    group.throughput(Throughput::Elements(1));
    rotating(&mut group, "own_store/10k_keys", keys.len(), |at, n| {
        burstgate_loop(&stores[0], keys, at, n)
    });
    group.bench_function("arith", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            arith_loop(iters);
            start.elapsed()
        })
    });

    group.throughput(Throughput::Elements(2));
    group.bench_function("own_store/10k_keys_2_threads", |b| {
        b.iter_custom(|iters| two_threads(iters, |w, n| burstgate_loop(&stores[w], keys, 0, n)))
    });
    group.bench_function("arith_2_threads", |b| {
        b.iter_custom(|iters| two_threads(iters, |_, n| arith_loop(n)))
    });

    group.throughput(Throughput::Elements(1));
    group.bench_function("cache_line_between_threads", |b| {
        b.iter_custom(|iters| {
            // Each thread sees the other's write `iters / 2` times: `iters` passes in all.
            let passes = iters.div_ceil(2);
            let turn = AtomicU64::new(0);
            let elapsed = two_threads(passes, |w, n| {
                for pass in 0..n {
                    let mine = 2 * pass + w as u64;
                    while turn.load(Ordering::Acquire) != mine {
                        std::hint::spin_loop();
                    }
                    turn.store(mine + 1, Ordering::Release);
                }
            });
            elapsed.mul_f64(iters as f64 / (2 * passes) as f64)
        })
    });
    group.finish();
}

/// About as many dependent integer operations per iteration as a decision takes nanoseconds,
/// and no memory traffic at all.
fn arith_loop(n: u64) {
    let mut x = black_box(0x9e37_79b9_7f4a_7c15_u64);
    for _ in 0..n {
        for _ in 0..16 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
        }
        black_box(x);
    }
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
}
