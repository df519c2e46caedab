//! Hosts whose clocks disagree, sharing one contended Redis bucket: who gets the budget.
//!
//! Each host is a `RedisStore` with its own connection and a clock `offset` milliseconds off the
//! system clock; 16 tasks per host take reservations (the default ceiling of two token periods)
//! on one bucket of 20 per second with a burst of 9, wait them out and send to an upstream that
//! enforces the same limit as nginx's `limit_req` does (`rate=20r/s burst=9`: room for the burst
//! and the request itself) on true time. It prints each host's share of what was sent, the
//! upstream's refusals and the share of the budget used.
//!
//! ```sh
//! REDIS_URL=redis://127.0.0.1:6390/ cargo run --release -p burstgate-tools --bin skew_fairness -- -1 0 0 10
//! ```
//!
//! The arguments are the hosts' offsets in milliseconds (default `-1 0 0 10`); `SECONDS` (or
//! `--seconds`) sets the length of the run (default 20). With `SERVER_TIME=1` (or
//! `--server-time`) each host's clock is a `ServerClock` over its skewed clock, corrected every
//! second by its offset from Redis's `TIME`.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burstgate::{
    BucketKey, BucketStore, Clock, Limit, RedisStore, ServerClock, SystemClock, redis,
};
use clap::Parser;
use clap::builder::BoolishValueParser;

/// The system clock, `.0` milliseconds off.
#[derive(Debug, Clone)]
struct Skewed(i64);

impl Clock for Skewed {
    fn now_ms(&self) -> u64 {
        SystemClock.now_ms().saturating_add_signed(self.0)
    }

    fn now_us(&self) -> u64 {
        SystemClock.now_us().saturating_add_signed(self.0 * 1_000)
    }
}

/// A token bucket on true time: `burst + 1` tokens, refilled at the rate.
struct Upstream {
    state: Mutex<(f64, Instant)>,
    refused: AtomicU32,
}

impl Upstream {
    fn send(&self) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let (tokens, last) = *state;
        let tokens = (tokens + (now - last).as_secs_f64() * 20.0).min(10.0);
        if tokens >= 1.0 {
            *state = (tokens - 1.0, now);
        } else {
            *state = (tokens, now);
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Hosts whose clocks disagree sharing one contended Redis bucket. REDIS_URL names the Redis.
#[derive(Parser)]
#[command(name = "skew_fairness")]
struct Args {
    /// Each host's clock offset from the system clock, in milliseconds.
    #[arg(allow_negative_numbers = true, default_values_t = [-1, 0, 0, 10])]
    offsets: Vec<i64>,
    /// Length of the run.
    #[arg(long, env = "SECONDS", default_value_t = 20)]
    seconds: u64,
    /// Gives each host a ServerClock over its skewed clock (SERVER_TIME=1).
    #[arg(long, env = "SERVER_TIME", value_parser = BoolishValueParser::new())]
    server_time: bool,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Args {
        offsets,
        seconds,
        server_time,
    } = Args::parse();
    let url = std::env::var("REDIS_URL").map_err(|_| "set REDIS_URL to a Redis to run on")?;
    let limit = Limit::per_second(20)?.with_burst(9)?;
    let prefix = format!("skew-fairness-{}", std::process::id());
    let key = Arc::new(BucketKey::new("fair", "seller")?);
    let upstream = Arc::new(Upstream {
        state: Mutex::new((10.0, Instant::now())),
        refused: AtomicU32::new(0),
    });
    let sent: Arc<Vec<AtomicU32>> = Arc::new(offsets.iter().map(|_| AtomicU32::new(0)).collect());
    let started = Instant::now();
    let deadline = started + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for (host, &offset) in offsets.iter().enumerate() {
        let conn = redis::Client::open(url.as_str())?
            .get_multiplexed_async_connection()
            .await?;
        let clock: Arc<dyn Clock> = if server_time {
            let clock =
                ServerClock::sync_with(conn.clone(), Skewed(offset), Duration::from_secs(1))
                    .await?;
            println!(
                "host {offset:>+4} ms: measured offset {} us, round trip {:?}",
                clock.offset_us(),
                clock.round_trip()
            );
            Arc::new(clock)
        } else {
            Arc::new(Skewed(offset))
        };
        let store = RedisStore::new(conn).prefix(&prefix)?.with_clock(clock);
        for _ in 0..16 {
            let (store, key, upstream, sent) = (
                store.clone(),
                Arc::clone(&key),
                Arc::clone(&upstream),
                Arc::clone(&sent),
            );
            tasks.push(tokio::spawn(async move {
                while Instant::now() < deadline {
                    match store
                        .acquire(&key, limit, 1, limit.default_max_wait(1))
                        .await
                    {
                        Ok(d) if d.is_admitted() => {
                            tokio::time::sleep(d.wait()).await;
                            if Instant::now() < deadline {
                                upstream.send();
                                sent[host].fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        Ok(d) => tokio::time::sleep(d.retry_after().unwrap_or_default()).await,
                        Err(e) => {
                            eprintln!("store error: {e}");
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                }
            }));
        }
    }
    for task in tasks {
        task.await?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let counts: Vec<u32> = sent.iter().map(|s| s.load(Ordering::Relaxed)).collect();
    let total: u32 = counts.iter().sum();
    let budget = 10.0 + 20.0 * elapsed;
    for (offset, count) in offsets.iter().zip(&counts) {
        let share = 100.0 * f64::from(*count) / f64::from(total.max(1));
        println!("host {offset:>+4} ms: sent {count:>4} ({share:.0}%)");
    }
    println!(
        "upstream 429s: {}, sent {total} of a budget of {budget:.0} ({:.1}%)",
        upstream.refused.load(Ordering::Relaxed),
        100.0 * f64::from(total) / budget
    );
    Ok(())
}
