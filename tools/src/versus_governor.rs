//! `MemoryStore` and governor's keyed limiter, taking turns, for ratios that hold on a noisy
//! machine.
//!
//! ```text
//! cargo run --release -p burstgate-tools --bin versus_governor -- [--rounds 7] [--decisions 2000000]
//! ```
//!
//! The criterion bench (`cargo bench --all-features --bench governor`) measures each side for
//! seconds on end, one after the other, so a shared machine that changes speed between them
//! skews their ratio. Here the two sides alternate every 50,000 decisions, and each round
//! reports the ratio of their summed times, so both see the same machine. Per round:
//!
//! - one `String` key, one thread;
//! - 10,000 `String` keys round robin, one thread;
//! - the same 10,000 keys on two threads at once, one starting halfway round, each side against
//!   its own one-thread figure of the same round (two threads' throughput over one thread's);
//! - the 10,000 keys built per call from their text, as a server builds them from each request:
//!   `BucketKey::new` for burstgate, the `String` governor's keyed limiter takes for governor.
//!
//! Each round also times a cache line passed back and forth between the two threads: what one
//! core waits for a line the other has just written. Two threads on shared buckets pay it for
//! every bucket the other thread touched last, so it sets what a second thread can add. On a
//! virtual machine it moves with where the host runs the two virtual CPUs at the time.
//!
//! Both sides admit every request (a rate no run exhausts) and read the CPU's time-stamp counter
//! through quanta: governor's default clock, and burstgate's `QuantaClock`. Medians of the
//! per-round figures come last.

use std::hint::black_box;
use std::num::NonZeroU32;
use std::pin::pin;
use std::sync::Barrier;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use burstgate::{BucketKey, BucketStore, Limit, MemoryStore, QuantaClock};
use clap::Parser;
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};

type BoxError = Box<dyn std::error::Error>;

const CHUNK: usize = 50_000;

/// `n` decisions round robin over `keys` from `start`; a `MemoryStore` future is ready on its
/// first poll.
fn burstgate(store: &MemoryStore<QuantaClock>, keys: &[BucketKey], start: usize, n: usize) {
    let limit = Limit::per_second(u32::MAX).expect("a valid limit");
    let mut cx = Context::from_waker(Waker::noop());
    for i in 0..n {
        let key = &keys[(start + i) % keys.len()];
        match pin!(store.acquire(key, limit, 1, Duration::ZERO)).poll(&mut cx) {
            Poll::Ready(Ok(d)) => assert!(black_box(d).is_admitted()),
            other => panic!("a MemoryStore decision was {other:?}"),
        }
    }
}

/// [`burstgate`] with each decision's key built from its text, as a server builds it from each
/// request (a header's value): `BucketKey::new` per call.
fn burstgate_built(store: &MemoryStore<QuantaClock>, names: &[String], start: usize, n: usize) {
    let limit = Limit::per_second(u32::MAX).expect("a valid limit");
    let mut cx = Context::from_waker(Waker::noop());
    for i in 0..n {
        let name = &names[(start + i) % names.len()];
        let key = BucketKey::new("bench", name).expect("a valid key");
        match pin!(store.acquire(&key, limit, 1, Duration::ZERO)).poll(&mut cx) {
            Poll::Ready(Ok(d)) => assert!(black_box(d).is_admitted()),
            other => panic!("a MemoryStore decision was {other:?}"),
        }
    }
}

/// [`governor`] with each decision's key built from its text: the `String` its keyed limiter
/// takes, from the request's `&str`.
fn governor_built(
    limiter: &DefaultKeyedRateLimiter<String>,
    names: &[String],
    start: usize,
    n: usize,
) {
    for i in 0..n {
        let key = names[(start + i) % names.len()].as_str().to_owned();
        assert!(black_box(limiter.check_key(&key).is_ok()));
    }
}

fn governor(limiter: &DefaultKeyedRateLimiter<String>, keys: &[String], start: usize, n: usize) {
    for i in 0..n {
        let key = &keys[(start + i) % keys.len()];
        assert!(black_box(limiter.check_key(key).is_ok()));
    }
}

/// Nanoseconds `work` takes.
fn timed(work: impl FnOnce()) -> f64 {
    let start = Instant::now();
    work();
    start.elapsed().as_nanos() as f64
}

/// Nanoseconds until both of two threads have run `work(thread)`.
fn timed_on_two(work: impl Fn(usize) + Sync) -> f64 {
    let barrier = Barrier::new(2);
    timed(|| {
        std::thread::scope(|s| {
            for thread in 0..2 {
                let (barrier, work) = (&barrier, &work);
                s.spawn(move || {
                    barrier.wait();
                    work(thread);
                });
            }
        })
    })
}

/// Nanoseconds one thread waits to see a write by the other, passing a counter back and forth.
fn line_transfer_ns() -> f64 {
    const PASSES: u64 = 200_000;
    let turn = AtomicU64::new(0);
    let total = timed_on_two(|thread| {
        for pass in 0..PASSES {
            let mine = 2 * pass + thread as u64;
            while turn.load(Ordering::Acquire) != mine {
                std::hint::spin_loop();
            }
            turn.store(mine + 1, Ordering::Release);
        }
    });
    total / (2 * PASSES) as f64
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// MemoryStore and governor's keyed limiter in turns of 50,000 decisions.
#[derive(Parser)]
#[command(name = "versus_governor")]
struct Args {
    /// Rounds, each reporting its own ratios.
    #[arg(long, default_value_t = 7, value_parser = at_least_one)]
    rounds: usize,
    /// Decisions per side and case in a round, rounded up to whole turns.
    #[arg(long, default_value_t = 2_000_000, value_parser = at_least_one)]
    decisions: usize,
    /// Runs one side of one case alone, `--decisions` of them, and prints nothing else: for
    /// `perf stat` or callgrind, which count a whole process.
    #[arg(long, value_enum)]
    only: Option<Only>,
    /// Keys in the many-keys cases (10,000 in the figures docs/PERFORMANCE.md quotes).
    #[arg(long, default_value_t = 10_000, value_parser = at_least_one)]
    keys: usize,
}

/// One side of one case.
#[derive(Clone, Copy, clap::ValueEnum)]
enum Only {
    /// burstgate on the 10,000 prebuilt keys.
    Keys,
    /// burstgate on the 10,000 keys built per call.
    Built,
    /// governor on the 10,000 keys.
    GovernorKeys,
    /// governor on the 10,000 keys built per call.
    GovernorBuilt,
}

fn at_least_one(value: &str) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    let rounds = args.rounds;
    let decisions = args.decisions.div_ceil(CHUNK) * CHUNK;

    let names: Vec<String> = (0..args.keys).map(|i| format!("client-{i}")).collect();
    let keys = names
        .iter()
        .map(|n| BucketKey::new("bench", n))
        .collect::<Result<Vec<_>, _>>()?;
    let store = MemoryStore::new().with_clock(QuantaClock::new());
    let limiter: DefaultKeyedRateLimiter<String> =
        RateLimiter::keyed(Quota::per_second(NonZeroU32::MAX));

    if let Some(only) = args.only {
        match only {
            Only::Keys => burstgate(&store, &keys, 0, decisions),
            Only::Built => burstgate_built(&store, &names, 0, decisions),
            Only::GovernorKeys => governor(&limiter, &names, 0, decisions),
            Only::GovernorBuilt => governor_built(&limiter, &names, 0, decisions),
        }
        return Ok(());
    }
    println!("{rounds} rounds of {decisions} decisions per side and case, in turns of {CHUNK}");
    let mut figures: [Vec<f64>; 8] = Default::default();
    for round in 0..rounds {
        // ns per decision: [burstgate, governor] × [1 key, 10k keys, 10k keys on two threads,
        // 10k keys built per call].
        let mut ns = [0.0; 8];
        for turn in 0..decisions / CHUNK {
            let at = (round * decisions + turn * CHUNK) % args.keys;
            ns[0] += timed(|| burstgate(&store, &keys[..1], 0, CHUNK));
            ns[1] += timed(|| governor(&limiter, &names[..1], 0, CHUNK));
            ns[2] += timed(|| burstgate(&store, &keys, at, CHUNK));
            ns[3] += timed(|| governor(&limiter, &names, at, CHUNK));
            ns[6] += timed(|| burstgate_built(&store, &names, at, CHUNK));
            ns[7] += timed(|| governor_built(&limiter, &names, at, CHUNK));
        }
        // Two threads, in longer turns (each starts its threads anew).
        let turns = (decisions / CHUNK).div_ceil(4);
        let per_turn = decisions / turns;
        for turn in 0..turns {
            let at = (round * decisions + turn * per_turn) % args.keys;
            ns[4] += timed_on_two(|t| burstgate(&store, &keys, at + t * args.keys / 2, per_turn));
            ns[5] += timed_on_two(|t| governor(&limiter, &names, at + t * args.keys / 2, per_turn));
        }
        let transfer = line_transfer_ns();
        let per = |total: f64, n: usize| total / n as f64;
        let (b1, g1) = (per(ns[0], decisions), per(ns[1], decisions));
        let (b10, g10) = (per(ns[2], decisions), per(ns[3], decisions));
        // Two threads made `turns * per_turn` decisions each in the time measured, so twice as
        // many as one thread in that time, at equal time per decision.
        let (b2, g2) = (per(ns[4], turns * per_turn), per(ns[5], turns * per_turn));
        let (bb, gb) = (per(ns[6], decisions), per(ns[7], decisions));
        let row = [
            b1 / g1,
            b10 / g10,
            2.0 * b10 / b2,
            2.0 * g10 / g2,
            b1,
            g1,
            transfer,
            bb / gb,
        ];
        println!(
            "round {round}: 1 key {b1:.1} vs {g1:.1} ns ({:.3}), 10k keys {b10:.1} vs {g10:.1} ns \
             ({:.3}), keys built per call {bb:.1} vs {gb:.1} ns ({:.3}), two threads' throughput \
             over one: burstgate {:.2}, governor {:.2}; cache line between the cores \
             {transfer:.0} ns",
            row[0], row[1], row[7], row[2], row[3],
        );
        for (list, value) in figures.iter_mut().zip(row) {
            list.push(value);
        }
    }
    let [one, many, two_b, two_g, b1, g1, transfer, built] = figures.map(median);
    println!(
        "medians: burstgate's time over governor's: 1 key {one:.3} ({b1:.1} vs {g1:.1} ns), \
         10k keys {many:.3}, 10k keys built per call {built:.3}; two threads' throughput over \
         one: burstgate {two_b:.2}, governor {two_g:.2}; cache line between the cores \
         {transfer:.0} ns"
    );
    Ok(())
}
