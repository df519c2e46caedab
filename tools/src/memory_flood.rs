//! A flood of made-up keys against a bounded `MemoryStore`: how many buckets it holds, how much
//! memory that takes, and how long a decision on a real key waits behind the table rebuilds the
//! flood causes.
//!
//! One thread fills the store to its bound with made-up keys, hashed as a header-keyed rule
//! stores them (`KeyExtractor::header`: 64 hex digits, too long to sit inline in a bucket), then keeps sending new ones, which makes the store evict; meanwhile a second
//! thread decides on a thousand real keys and records how long each decision took. Run it
//! optimized, with the bound in buckets as the argument (default 2,000,000):
//!
//! ```text
//! cargo run --release -p burstgate-tools --bin memory_flood -- 2000000
//! ```

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use burstgate::{BucketKey, BucketStore, Limit, MemoryStore};
use clap::Parser;

/// A flood of made-up keys against a bounded MemoryStore.
#[derive(Parser)]
#[command(name = "memory_flood")]
struct Args {
    /// The store's bound, in buckets.
    #[arg(default_value_t = NonZeroUsize::new(2_000_000).expect("not zero"))]
    bound: NonZeroUsize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let bound = Args::parse().bound;
    let store = MemoryStore::bounded(bound);
    let limit = Limit::per_hour(5)?.with_burst(5)?;
    let rss_before = rss_kib();
    println!(
        "bound {} buckets (store's own: {})",
        bound,
        store.max_buckets()
    );

    // Fill to the bound, timing each decision on a new key.
    let started = Instant::now();
    let mut fill = Latencies::default();
    for i in 0..bound.get() {
        let key = BucketKey::hashed("flood", format!("made-up-{i}"))?;
        let t = Instant::now();
        let _ = block_on(store.acquire(&key, limit, 1, Duration::ZERO))?;
        fill.push(t.elapsed());
    }
    let held = store.len();
    let rss = rss_kib().zip(rss_before).map(|(a, b)| a.saturating_sub(b));
    println!(
        "filled in {:.1} s: {held} buckets held, {} per bucket; new-key decisions: {}",
        started.elapsed().as_secs_f64(),
        rss.map_or("RSS unknown".into(), |kib| format!(
            "{:.0} B RSS",
            kib as f64 * 1024.0 / held as f64
        )),
        fill.summary()
    );

    // Real keys, known to the store before the flood goes on.
    let real: Vec<BucketKey> = (0..1_000)
        .map(|i| BucketKey::new("real", format!("user-{i}")))
        .collect::<Result<_, _>>()?;
    for key in &real {
        let _ = block_on(store.acquire(key, limit, 1, Duration::ZERO))?;
    }

    // A control: the same decisions with no flood beside them, for what the machine alone adds
    // to the worst case (preemption, page faults), with no rebuild to wait behind.
    let mut quiet = Latencies::default();
    let quiet_started = Instant::now();
    while quiet_started.elapsed() < Duration::from_secs(3) {
        for key in &real {
            let t = Instant::now();
            let _ = block_on(store.peek(key, limit));
            quiet.push(t.elapsed());
        }
    }
    println!("real-key decisions, no flood: {}", quiet.summary());

    let stop = Arc::new(AtomicBool::new(false));
    let decider = {
        let store = store.clone();
        let stop = Arc::clone(&stop);
        thread::spawn(move || {
            let mut seen = Latencies::default();
            let mut errors = 0_u64;
            while !stop.load(Ordering::Relaxed) {
                for key in &real {
                    let t = Instant::now();
                    if block_on(store.peek(key, limit)).is_err() {
                        errors += 1;
                    }
                    seen.push(t.elapsed());
                }
            }
            (seen, errors)
        })
    };
    let flood_started = Instant::now();
    let mut flood = Latencies::default();
    let mut most_held = 0;
    let mut refused = 0_u64;
    for i in 0..bound.get() {
        let key = BucketKey::hashed("flood", format!("more-{i}"))?;
        let t = Instant::now();
        if block_on(store.acquire(&key, limit, 1, Duration::ZERO)).is_err() {
            refused += 1;
        }
        flood.push(t.elapsed());
        if i % 10_000 == 0 {
            most_held = most_held.max(store.len());
        }
    }
    stop.store(true, Ordering::Relaxed);
    let (mut seen, errors) = decider.join().map_err(|_| "the deciding thread panicked")?;
    most_held = most_held.max(store.len());
    println!(
        "flood of {} more keys in {:.1} s: at most {most_held} buckets held (bound {}), {refused} refused",
        bound.get(),
        flood_started.elapsed().as_secs_f64(),
        store.max_buckets()
    );
    println!("  new-key decisions:  {}", flood.summary());
    println!("  real-key decisions: {} ({errors} errors)", seen.summary());

    // A trickle of new keys into the full store: what the rebuilds cost when little changes.
    let cpu_before = cpu_seconds();
    let trickle_started = Instant::now();
    for i in 0..5_000 {
        let key = BucketKey::hashed("flood", format!("trickle-{i}"))?;
        let _ = block_on(store.acquire(&key, limit, 1, Duration::ZERO));
        thread::sleep(Duration::from_millis(1));
    }
    let wall = trickle_started.elapsed().as_secs_f64();
    if let (Some(after), Some(before)) = (cpu_seconds(), cpu_before) {
        println!(
            "trickle of 5,000 new keys over {wall:.1} s: {:.3} s of CPU per second",
            (after - before) / wall
        );
    }
    Ok(())
}

/// The CPU time this process has used, user and system, from Linux's `/proc`.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    // Linux reports both in clock ticks, 100 a second on every common configuration.
    Some((utime + stime) / 100.0)
}

/// Every `MemoryStore` future is ready at once.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    use std::task::{Context, Poll, Waker};
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(out) = f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            return out;
        }
    }
}

#[derive(Default)]
struct Latencies(Vec<Duration>);

impl Latencies {
    fn push(&mut self, d: Duration) {
        self.0.push(d);
    }

    fn summary(&mut self) -> String {
        self.0.sort_unstable();
        let at = |q: f64| {
            let i = ((self.0.len() as f64 * q) as usize).min(self.0.len().saturating_sub(1));
            self.0.get(i).copied().unwrap_or_default()
        };
        format!(
            "{} calls, median {:?}, p99.9 {:?}, p99.99 {:?}, worst {:?}",
            self.0.len(),
            at(0.5),
            at(0.999),
            at(0.9999),
            self.0.last().copied().unwrap_or_default()
        )
    }
}

/// The process's resident memory, from Linux's `/proc`.
fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
