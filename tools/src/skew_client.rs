//! One client process of the end-to-end check `scripts/e2e_skew.sh`: tasks calling one
//! rate-limited endpoint through [`RateLimitMiddleware`] on a [`RedisStore`] that every process
//! of the check shares, with every setting of the crate at its default.
//!
//! The check runs several of these at once, each under libfaketime with its own clock offset,
//! to show how processes whose system clocks disagree share one contended bucket. So nothing
//! here picks a clock: the store is `RedisStore::connect(url)` with a prefix, the middleware
//! `RateLimitMiddleware::new(store)` with one route, no account (every request of every
//! process draws from the route's shared key), the default waiting ceiling and margin. A
//! task sends requests one after the other for `--seconds`; a local 429 ([`RateLimited`])
//! makes it sleep the `retry_after` it names and try again; a request still waiting for its
//! turn when the time is up is dropped, which gives its reserved token back.
//!
//! ```sh
//! REDIS_URL=redis://127.0.0.1:6380/ cargo run --release -p burstgate-tools --bin skew_client -- \
//!     --url http://127.0.0.1:8080/limited --seconds 20 --rate 20 --burst 9 --prefix e2e-skew
//! ```
//!
//! Options: `--url` (required), `--seconds 20`, `--tasks 16`, `--rate 20` (tokens per second)
//! and `--burst 9`, `--prefix burstgate-e2e-skew` (the Redis key prefix; give every process of
//! one run the same one), `--start-at-ms` (the Unix time, in ms on this process's own clock,
//! to start sending at, so that the processes of a run start together). `REDIS_URL` names the
//! Redis.
//!
//! Before it sends, it prints how far its system clock is from Redis's (`clock_offset_us:`,
//! this process's time minus Redis's `TIME`, from the fastest of five round trips, read on a
//! connection of its own and not the store's): the check reads it to make sure the offset it
//! gave the process took hold. Its last lines are `first_send_ms:` and `last_send_ms:` (its own
//! clock's time, in ms since the Unix epoch, of its first and last request to leave), and
//! `sent: N, ok: A, upstream 429: M, local 429: L, errors: E`.

use std::error::Error;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use burstgate::middleware::{RateLimitMiddleware, Route};
use burstgate::{Limit, RateLimited, RedisStore, redis};
use clap::Parser;
use clap::builder::NonEmptyStringValueParser;
use http::Extensions;
use reqwest::StatusCode;
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};
use tokio::time::Instant;

/// One client process of scripts/e2e_skew.sh: tasks calling one rate-limited endpoint through
/// RateLimitMiddleware on a shared RedisStore, every setting at its default. REDIS_URL names
/// the Redis.
#[derive(Parser)]
#[command(name = "skew_client")]
struct Args {
    /// The endpoint to call.
    #[arg(long, value_parser = NonEmptyStringValueParser::new())]
    url: String,
    /// Length of the run.
    #[arg(long, default_value_t = 20.0, value_parser = positive_seconds)]
    seconds: f64,
    /// Concurrent tasks.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
    tasks: u64,
    /// Tokens per second.
    #[arg(long, default_value_t = 20)]
    rate: u32,
    /// The bucket's burst.
    #[arg(long, default_value_t = 9)]
    burst: u32,
    /// The Redis key prefix; the same for every process of one run.
    #[arg(long, default_value = "burstgate-e2e-skew")]
    prefix: String,
    /// When to start sending: Unix time in milliseconds, on this process's clock.
    #[arg(long)]
    start_at_ms: Option<u64>,
}

fn positive_seconds(value: &str) -> Result<f64, String> {
    let s: f64 = value.parse().map_err(|e| format!("{e}"))?;
    if s.is_finite() && s > 0.0 {
        Ok(s)
    } else {
        Err("must be above zero".into())
    }
}

/// What this process saw.
#[derive(Default)]
struct Counts {
    sent: AtomicU64,
    ok: AtomicU64,
    upstream_429: AtomicU64,
    local_429: AtomicU64,
    errors: AtomicU64,
    /// Unix ms on this process's clock; zero until the first send.
    first_send_ms: AtomicU64,
    last_send_ms: AtomicU64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let args = Args::parse();
    let redis_url = std::env::var("REDIS_URL").map_err(|_| "REDIS_URL must name the Redis")?;
    let path = reqwest::Url::parse(&args.url)?.path().to_owned();

    let (offset_us, rtt_us) = offset_from_redis(&redis_url).await?;
    println!(
        "clock: this process reads {} µs since the Unix epoch; minus Redis's TIME: \
         {offset_us:+} µs (round trip {rtt_us} µs)",
        unix_us()
    );
    println!("clock_offset_us: {offset_us}");

    let limit = Limit::per_second(args.rate)?.with_burst(args.burst)?;
    let store = RedisStore::connect(&redis_url)
        .await?
        .prefix(&args.prefix)?;
    let limiter = RateLimitMiddleware::new(store).route(Route::new("skew", limit, &path)?);
    let counts = Arc::new(Counts::default());
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(limiter)
        .with(CountSent(Arc::clone(&counts)))
        .build();

    if let Some(start_ms) = args.start_at_ms {
        let now_ms = unix_us() / 1_000;
        match start_ms.checked_sub(now_ms) {
            Some(ahead) => tokio::time::sleep(Duration::from_millis(ahead)).await,
            None => eprintln!(
                "skew_client: started {} ms after --start-at-ms",
                now_ms - start_ms
            ),
        }
    }
    println!(
        "limit: {limit}; {} tasks for {} s",
        args.tasks, args.seconds
    );
    let deadline = Instant::now() + Duration::from_secs_f64(args.seconds);
    let url = Arc::new(args.url);
    let tasks: Vec<_> = (0..args.tasks)
        .map(|_| {
            let task = Task {
                client: client.clone(),
                url: Arc::clone(&url),
                counts: Arc::clone(&counts),
            };
            tokio::spawn(task.run(deadline))
        })
        .collect();
    for task in tasks {
        task.await?;
    }
    // Let the refunds of the reservations the deadline cut short reach Redis before exiting.
    tokio::time::sleep(Duration::from_millis(100)).await;

    let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
    println!("first_send_ms: {}", read(&counts.first_send_ms));
    println!("last_send_ms: {}", read(&counts.last_send_ms));
    println!(
        "sent: {}, ok: {}, upstream 429: {}, local 429: {}, errors: {}",
        read(&counts.sent),
        read(&counts.ok),
        read(&counts.upstream_429),
        read(&counts.local_429),
        read(&counts.errors)
    );
    Ok(())
}

/// This process's clock minus Redis's `TIME`, in µs, from the fastest of five round trips (Redis
/// read its clock about halfway through), and that round trip.
async fn offset_from_redis(url: &str) -> Result<(i64, i64), Box<dyn Error>> {
    let mut conn = redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?;
    let mut best: Option<(i64, i64)> = None;
    for _ in 0..5 {
        let sent = std::time::Instant::now();
        let before = unix_us();
        let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await?;
        let rtt = i64::try_from(sent.elapsed().as_micros())?;
        let redis_us = i64::try_from(secs * 1_000_000 + micros)?;
        let offset = i64::try_from(before)? + rtt / 2 - redis_us;
        if best.is_none_or(|(_, best_rtt)| rtt < best_rtt) {
            best = Some((offset, rtt));
        }
    }
    best.ok_or_else(|| "no TIME sample".into())
}

/// This process's system clock (shifted by libfaketime, when the check preloads it).
fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

struct Task {
    client: ClientWithMiddleware,
    url: Arc<String>,
    counts: Arc<Counts>,
}

impl Task {
    async fn run(self, deadline: Instant) {
        while Instant::now() < deadline {
            let request = self.client.get(self.url.as_str());
            // Dropping a request that still waits for its turn gives its token back.
            let result = tokio::select! {
                result = request.send() => result,
                () = tokio::time::sleep_until(deadline) => break,
            };
            match result {
                Ok(res) if res.status() == StatusCode::OK => bump(&self.counts.ok),
                Ok(res) if res.status() == StatusCode::TOO_MANY_REQUESTS => {
                    bump(&self.counts.upstream_429)
                }
                Ok(res) => {
                    bump(&self.counts.errors);
                    eprintln!("unexpected answer: {}", res.status());
                }
                Err(reqwest_middleware::Error::Middleware(e)) if e.is::<RateLimited>() => {
                    bump(&self.counts.local_429);
                    let retry = e
                        .downcast_ref::<RateLimited>()
                        .map_or(Duration::ZERO, RateLimited::retry_after);
                    tokio::time::sleep(retry).await;
                }
                Err(e) => {
                    bump(&self.counts.errors);
                    eprintln!("request failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
}

fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// Sits after the limiter: it sees only the requests that are about to go out.
struct CountSent(Arc<Counts>);

#[async_trait::async_trait]
impl Middleware for CountSent {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let counts = &self.0;
        bump(&counts.sent);
        let now_ms = unix_us() / 1_000;
        // The first send sets it; the rest find it set.
        let _ =
            counts
                .first_send_ms
                .compare_exchange(0, now_ms, Ordering::Relaxed, Ordering::Relaxed);
        counts.last_send_ms.fetch_max(now_ms, Ordering::Relaxed);
        next.run(req, extensions).await
    }
}
