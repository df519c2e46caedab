//! `MemoryStore` stays bounded, measured with a counting global allocator.
//!
//! - A million keys seen once cost memory only until their buckets have refilled: a `sweep`, or
//!   ordinary traffic on fresh keys reaching every shard, gives it back.
//! - A decision on a bucket that already exists allocates nothing.
//!
//! The allocator counts every thread of this test binary, and libtest runs the tests of one binary
//! in parallel threads, so all the measurements live in one `#[test]` that runs them one after the
//! other; nothing else in this binary allocates meanwhile. A million keys take a while in a debug
//! build, so it is in the slow tier: `cargo test --test memory -- --ignored --nocapture` runs it
//! and shows the figures.

use std::alloc::System;
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use burstgate::{BucketKey, BucketStore, Clock, Limit, ManualClock, MemoryStore};
use stats_alloc::{INSTRUMENTED_SYSTEM, StatsAlloc};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Keys acquired once each, then never again.
const ONE_OFF_KEYS: usize = 1_000_000;

/// Fresh keys of the "ordinary traffic" that follows the refill period. Each picks one of the
/// store's shards at random, so 16 per shard reach every shard except with a probability of
/// about `shards × e^-16` (2 × 10^-5 for 128 shards).
fn fresh_keys() -> usize {
    16 * shards()
}

/// The store's shard count, as `MemoryStore::bounded` says it sizes it for the default bound of
/// 2^20: 8 per thread the machine runs, or one per 4,096 buckets of the bound, whichever is
/// more, rounded up to a power of two, but no more than leave each 1,024 of the bound.
fn shards() -> usize {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    (threads * 8)
        .max((1 << 20) / 4_096)
        .next_power_of_two()
        .min((1 << 20) / 1_024)
}

/// How far above its starting point the heap may stay once the buckets are gone: 1 MiB, and
/// 256 bytes for each bucket kept on purpose (the fresh ones).
fn end_bound(kept_buckets: usize) -> i128 {
    (1 << 20) + 256 * kept_buckets as i128
}

/// A time well after the epoch, so that nothing is clamped.
const T0: u64 = 1_700_000_000_000;

/// Bytes requested and not yet freed, over the whole process.
fn net_bytes() -> i128 {
    let s = GLOBAL.stats();
    s.bytes_allocated as i128 - s.bytes_deallocated as i128
}

/// Runs a future that is ready on its first poll, as every `MemoryStore` future is.
fn now_or_never<F: Future>(f: F) -> F::Output {
    let mut cx = Context::from_waker(Waker::noop());
    match pin!(f).poll(&mut cx) {
        Poll::Ready(out) => out,
        Poll::Pending => panic!("a MemoryStore future was not ready on its first poll"),
    }
}

/// "1 per second, burst 5": one acquire leaves the bucket 1 token short, so it is full again
/// 1 s later, well within the limit's refill period of 5 s.
fn one_off_limit() -> Limit {
    Limit::per_second(1)
        .and_then(|l| l.with_burst(5))
        .expect("a valid limit")
}

fn key(prefix: &str, i: usize) -> BucketKey {
    BucketKey::new("oneoff", format!("{prefix}-{i}")).expect("a valid key")
}

/// Acquires each of `count` new keys once and checks they are all held.
fn acquire_one_off_keys(store: &MemoryStore<ManualClock>, prefix: &str, count: usize) {
    let limit = one_off_limit();
    for i in 0..count {
        let decision = now_or_never(store.acquire(&key(prefix, i), limit, 1, Duration::ZERO))
            .expect("the acquire succeeds");
        assert!(
            decision.is_admitted(),
            "a new key's first request is admitted"
        );
    }
}

struct Figures {
    start: i128,
    peak: i128,
    peak_len: usize,
    end: i128,
    end_len: usize,
}

impl Figures {
    fn print(&self, phase: &str) {
        let grown = self.peak - self.start;
        println!(
            "{phase}: start {} B, peak {} B (+{grown} B, {} buckets, {} B per bucket), \
             end {} B ({:+} B from start, {} buckets)",
            self.start,
            self.peak,
            self.peak_len,
            grown / self.peak_len as i128,
            self.end,
            self.end - self.start,
            self.end_len,
        );
    }

    fn assert_returned(&self, phase: &str) {
        let grown = self.peak - self.start;
        let kept = self.end - self.start;
        assert!(
            kept < end_bound(self.end_len) && kept * 100 < grown,
            "{phase}: {kept} B of the {grown} B the buckets took are still allocated"
        );
    }
}

/// A million one-off keys, the clock moved on by the limit's refill period, then `sweep`.
fn one_off_keys_are_freed_by_a_sweep() {
    let start = net_bytes();
    let clock = ManualClock::new(T0);
    let store = MemoryStore::new().with_clock(clock.clone());

    acquire_one_off_keys(&store, "swept", ONE_OFF_KEYS);
    let peak = net_bytes();
    let peak_len = store.len();
    assert_eq!(
        peak_len, ONE_OFF_KEYS,
        "every bucket is held until it refills"
    );

    clock.advance(one_off_limit().refill_time());
    store.sweep();
    let end_len = store.len();
    let end = net_bytes();

    let figures = Figures {
        start,
        peak,
        peak_len,
        end,
        end_len,
    };
    figures.print("sweep");
    assert_eq!(end_len, 0, "every refilled bucket is dropped by the sweep");
    figures.assert_returned("sweep");
}

/// The same million keys, the same wait, then only fresh traffic: no `sweep` call.
fn one_off_keys_are_freed_by_ordinary_traffic() {
    let start = net_bytes();
    let clock = ManualClock::new(T0);
    let store = MemoryStore::new().with_clock(clock.clone());

    acquire_one_off_keys(&store, "old", ONE_OFF_KEYS);
    let peak = net_bytes();
    let peak_len = store.len();
    assert_eq!(
        peak_len, ONE_OFF_KEYS,
        "every bucket is held until it refills"
    );

    clock.advance(one_off_limit().refill_time());
    acquire_one_off_keys(&store, "fresh", fresh_keys());
    let end_len = store.len();
    let end = net_bytes();

    let figures = Figures {
        start,
        peak,
        peak_len,
        end,
        end_len,
    };
    figures.print("traffic");
    // The fresh buckets are 1 token short and stay until they refill; every old one is gone.
    assert_eq!(
        end_len,
        fresh_keys(),
        "only the fresh buckets remain once traffic has reached every shard"
    );
    figures.assert_returned("traffic");
}

/// Decisions on one existing key allocate nothing: admitted on a clock that moves (so the
/// shard's once-a-second sweep runs inside the window too), and denied on a clock that stands.
fn existing_key_acquire_does_not_allocate() {
    const CALLS: u64 = 1_000;
    let clock = ManualClock::new(T0);
    let store = MemoryStore::new().with_clock(clock.clone());

    // Drains faster than it refills (1 token per ms taken, 0.1 per ms back), so the bucket is
    // never full: a full one would rightly be forgotten by the sweep and created again.
    let roomy = Limit::per_second(100)
        .and_then(|l| l.with_burst(1_000_000))
        .expect("a valid limit");
    let admitted = BucketKey::new("hot", "admitted").expect("a valid key");
    let tight = Limit::per_second(1).expect("a valid limit");
    let denied = BucketKey::new("hot", "denied").expect("a valid key");

    let acquire = |key: &BucketKey, limit: Limit| {
        now_or_never(store.acquire(key, limit, 1, Duration::ZERO)).expect("the acquire succeeds")
    };

    // Warm-up: creates the bucket, which waits with the shard's new keys until the shard
    // rebuilds its table; the sweep does that now (the table, and this thread's view of the
    // store's tables, are allocated here).
    assert!(acquire(&admitted, roomy).is_admitted());
    store.sweep();
    assert_eq!(store.len(), 1);
    let before = GLOBAL.stats();
    let mut admissions = 0_u64;
    for _ in 0..CALLS {
        clock.advance(Duration::from_millis(1));
        admissions += u64::from(acquire(&admitted, roomy).is_admitted());
    }
    let admitted_stats = GLOBAL.stats() - before;

    // Warm-up after the clock has moved, so the empty bucket stays empty through the window.
    assert!(acquire(&denied, tight).is_admitted());
    store.sweep();
    assert_eq!(store.len(), 2);
    let before = GLOBAL.stats();
    let mut denials = 0_u64;
    for _ in 0..CALLS {
        denials += u64::from(!acquire(&denied, tight).is_admitted());
    }
    let denied_stats = GLOBAL.stats() - before;
    let now = clock.now_ms();

    println!(
        "existing key, {CALLS} admitted acquires over {} ms: {} allocations, {} reallocations, \
         {} deallocations",
        now - T0,
        admitted_stats.allocations,
        admitted_stats.reallocations,
        admitted_stats.deallocations,
    );
    println!(
        "existing key, {CALLS} denied acquires: {} allocations, {} reallocations, {} deallocations",
        denied_stats.allocations, denied_stats.reallocations, denied_stats.deallocations,
    );
    assert_eq!(admissions, CALLS);
    assert_eq!(denials, CALLS);
    for stats in [admitted_stats, denied_stats] {
        assert_eq!(
            (stats.allocations, stats.reallocations, stats.deallocations),
            (0, 0, 0),
            "a decision on an existing key touched the heap: {stats:?}"
        );
    }
    assert_eq!(store.len(), 2);
}

#[test]
#[ignore = "slow tier: run by .ci/run with --ignored"]
fn memory_store_returns_its_memory_and_decides_without_allocating() {
    // The first print allocates stdout's buffer; do it before anything is measured.
    println!("memory figures (net bytes requested from the allocator, whole process):");
    // The allocation count is last: while the test binary starts, its main thread may still be
    // allocating (reporting, spawning this test), and the long phases first let it settle.
    one_off_keys_are_freed_by_a_sweep();
    one_off_keys_are_freed_by_ordinary_traffic();
    existing_key_acquire_does_not_allocate();
}
