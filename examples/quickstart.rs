//! A token bucket next to the fixed-window counter it replaces, on the in-memory store.
//!
//! Two endpoints of a seller API, limited per account:
//!
//! - orders, "1 request per minute, burst 10": a worker has 12 pages to fetch;
//! - sales, "1 request per minute, no burst": two requests arrive 1 ms apart, either side of a
//!   minute boundary.
//!
//! The fixed window is the old way: `INCR` a counter for the current one-minute window, `PEXPIRE`
//! it, and send while the counter is at most 1 (the per-minute limit; a counter has no column for
//! the burst). Time is a `ManualClock` moved forward step by step, so the simulated minutes take
//! no real time.
//!
//! Run it with `cargo run --example quickstart`. No Redis needed.

use std::error::Error;
use std::time::Duration;

use burstgate::{BucketKey, BucketStore, Limit, ManualClock, MemoryStore};

/// One minute, in milliseconds.
const MINUTE_MS: u64 = 60_000;

/// Where the simulated clock starts: 2026-01-01 00:00:00 UTC, in milliseconds since the epoch.
const START_MS: u64 = 1_767_225_600_000;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn Error>> {
    orders().await?;
    println!();
    sales().await?;
    Ok(())
}

/// "1 per minute, burst 10": a worker has 12 pages to fetch. Every minute it asks for each page
/// still waiting; a page that is refused waits for the next minute.
async fn orders() -> Result<(), Box<dyn Error>> {
    const PAGES: u32 = 12;

    let clock = ManualClock::new(START_MS);
    let store = MemoryStore::new().with_clock(clock.clone());
    let limit = Limit::per_minute(1)?.with_burst(10)?;
    let key = BucketKey::new("orders", "seller-42")?;
    let mut window = FixedWindow::new(MINUTE_MS, 1);

    println!("orders: 1 request per minute, burst 10 ({limit})");
    println!(
        "A worker has {PAGES} pages to fetch; every minute it asks for each page still waiting."
    );
    println!();
    println!("            token bucket            fixed window (1 per minute)");
    println!("  time      sent  refused   done    sent  refused   done");

    let (mut bucket_done, mut window_done) = (0, 0);
    let (mut bucket_last, mut window_last) = (START_MS, START_MS);
    let mut minute = 0;
    while bucket_done < PAGES || window_done < PAGES {
        let now = START_MS + minute * MINUTE_MS;
        clock.set(now);

        let (mut sent, mut refused) = (0, 0);
        for _ in bucket_done..PAGES {
            // Cost 1, and a `max_wait` of zero: decide now, never reserve a later token.
            let decision = store.acquire(&key, limit, 1, Duration::ZERO).await?;
            if decision.is_admitted() {
                sent += 1;
            } else {
                refused += 1;
            }
        }
        bucket_done += sent;
        if sent > 0 {
            bucket_last = now;
        }
        let bucket = step(sent, refused, bucket_done, PAGES);

        let (mut sent, mut refused) = (0, 0);
        for _ in window_done..PAGES {
            if window.hit(now) {
                sent += 1;
            } else {
                refused += 1;
            }
        }
        window_done += sent;
        if sent > 0 {
            window_last = now;
        }
        let fixed = step(sent, refused, window_done, PAGES);

        println!("  {}  {bucket}    {fixed}", clock_time(now, false));
        minute += 1;
    }

    println!();
    println!(
        "  The bucket sends the burst of {} at once, then one page per minute: the last at {}.",
        limit.burst(),
        clock_time(bucket_last, false)
    );
    println!(
        "  The fixed window has no burst, so each page waits for a window: the last at {}.",
        clock_time(window_last, false)
    );
    Ok(())
}

/// "1 per minute, no burst": two requests 1 ms apart, either side of a minute boundary.
async fn sales() -> Result<(), Box<dyn Error>> {
    let clock = ManualClock::new(START_MS);
    let store = MemoryStore::new().with_clock(clock.clone());
    let limit = Limit::per_minute(1)?;
    let key = BucketKey::new("sales", "seller-42")?;
    let mut window = FixedWindow::new(MINUTE_MS, 1);

    println!("sales: 1 request per minute, no burst ({limit})");
    println!("Two requests arrive 1 ms apart, either side of a minute boundary.");
    println!();
    println!("  time          token bucket                 fixed window (1 per minute)");

    let (mut bucket_sent, mut window_sent) = (0, 0);
    for now in [START_MS + MINUTE_MS - 1, START_MS + MINUTE_MS] {
        clock.set(now);
        let decision = store.acquire(&key, limit, 1, Duration::ZERO).await?;
        let bucket = match decision.retry_after() {
            None => {
                bucket_sent += 1;
                "sent".to_owned()
            }
            Some(after) => format!("refused, retry in {after:?}"),
        };
        let fixed = if window.hit(now) {
            window_sent += 1;
            "sent"
        } else {
            "refused"
        };
        println!("  {}  {bucket:<27}  {fixed}", clock_time(now, true));
    }

    println!();
    println!(
        "  Within 1 ms the bucket sent {bucket_sent} request and the fixed window {window_sent}:"
    );
    println!("  the API answers the fixed window's second request with 429 Too Many Requests.");
    Ok(())
}

/// The counter burstgate replaces: `INCR <name>:<window number>` (with a `PEXPIRE` of one window
/// on the first hit), and the request goes while the counter is at most `limit`.
struct FixedWindow {
    window_ms: u64,
    limit: u64,
    /// The window the counter belongs to; an older window's key would have expired.
    window: u64,
    counter: u64,
}

impl FixedWindow {
    fn new(window_ms: u64, limit: u64) -> Self {
        Self {
            window_ms,
            limit,
            window: 0,
            counter: 0,
        }
    }

    fn hit(&mut self, now_ms: u64) -> bool {
        let window = now_ms / self.window_ms;
        if window != self.window {
            // A new window: the old key has expired and INCR starts a new counter.
            self.window = window;
            self.counter = 0;
        }
        self.counter += 1; // INCR
        self.counter <= self.limit
    }
}

/// One step's columns: sent, refused, and pages done so far; dashes once nothing is left.
fn step(sent: u32, refused: u32, done: u32, pages: u32) -> String {
    if sent + refused == 0 {
        format!("{:>4}  {:>7}  {done:>2}/{pages}", "-", "-")
    } else {
        format!("{sent:>4}  {refused:>7}  {done:>2}/{pages}")
    }
}

/// Simulated time since the start, `hh:mm:ss`, with milliseconds when `millis` is set.
fn clock_time(now_ms: u64, millis: bool) -> String {
    let ms = now_ms.saturating_sub(START_MS);
    let (s, ms) = (ms / 1000, ms % 1000);
    let hms = format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
    if millis {
        format!("{hms}.{ms:03}")
    } else {
        hms
    }
}
