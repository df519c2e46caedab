//! Where buckets get the time from.
//!
//! Stores take `now` from a [`Clock`], never from Redis's `TIME` inside the script: tests can
//! then be exact, and a script that writes after reading `TIME` would not be safe to replicate.
//! A clock may still be corrected by its offset from Redis's, measured apart from any decision
//! (`ServerClock`), so that hosts share one time.

use std::cell::Cell;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[cfg(feature = "redis")]
pub(crate) mod server;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use server::ServerClock;

/// A source of wall time in whole milliseconds since the Unix epoch.
///
/// Buckets shared across hosts compare times written by different processes, so a clock must
/// count from the same origin everywhere: the Unix epoch. A clock behind the stored time refills
/// nothing, and the stored time never moves backwards, so workers whose clocks disagree by `skew`
/// cost throughput and exceed the limit at most once, by a bounded amount:
///
/// - plain decisions (`max_wait` zero): by at most `min(capacity, skew × rate)` tokens;
/// - reservations: by at most `skew × rate` tokens, which can exceed the capacity. A reserved
///   request goes out after its wait on its worker's own clock, so a worker that runs ahead sends
///   its reservations early by its skew, and one that runs behind sends them late; their requests
///   can bunch up by the skew between them. Keep clocks synchronised (NTP keeps them within
///   milliseconds) where reservations are used against strict upstream limits.
pub trait Clock: Send + Sync + 'static {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;

    /// The same time as a [`SystemTime`].
    fn now(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.now_ms())
    }

    /// Microseconds since the Unix epoch, for measuring against another clock (see
    /// `ServerClock`); by default the milliseconds, times a thousand.
    fn now_us(&self) -> u64 {
        self.now_ms().saturating_mul(1_000)
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now_ms(&self) -> u64 {
        (**self).now_ms()
    }

    fn now_us(&self) -> u64 {
        (**self).now_us()
    }
}

/// The machine's wall clock, [`SystemTime::now`]. The default: shared buckets need wall time.
///
/// A clock set before 1970 reads as the epoch itself.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    #[inline]
    fn now_ms(&self) -> u64 {
        let t = SystemTime::now();
        // Turning a `SystemTime` into milliseconds costs std about as much as reading it. Calls
        // come many to a millisecond under load, so each thread keeps the millisecond it last
        // converted, as the span of times it covers: a reading inside that span is the same
        // millisecond, by two comparisons. Any other reading (the next millisecond, or a clock
        // set back) is converted afresh.
        let (from, to, ms) = LAST_MILLISECOND.get();
        if from <= t && t < to {
            return ms;
        }
        let ms = millis_since_epoch(t);
        let from = UNIX_EPOCH.checked_add(Duration::from_millis(ms));
        if let Some((from, to)) = from.and_then(|f| Some((f, f.checked_add(ONE_MS)?))) {
            LAST_MILLISECOND.set((from, to, ms));
        }
        ms
    }

    fn now_us(&self) -> u64 {
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        u64::try_from(since.as_micros()).unwrap_or(u64::MAX)
    }
}

const ONE_MS: Duration = Duration::from_millis(1);

thread_local! {
    /// The last millisecond [`SystemClock`] converted on this thread: the times from the first
    /// (inclusive) to the second (exclusive) all read as the third. It starts empty.
    static LAST_MILLISECOND: Cell<(SystemTime, SystemTime, u64)> =
        const { Cell::new((UNIX_EPOCH, UNIX_EPOCH, 0)) };
}

/// A clock that only moves when told to. Clones share one time, so a test can hand a clone to a
/// store and advance it from outside.
///
/// ```
/// use std::time::Duration;
/// use burstgate::{Clock, ManualClock};
///
/// let clock = ManualClock::new(1_000);
/// let store_side = clock.clone();
/// clock.advance(Duration::from_millis(500));
/// assert_eq!(store_side.now_ms(), 1_500);
/// ```
#[derive(Clone, Default)]
pub struct ManualClock {
    ms: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock reading `ms` milliseconds since the Unix epoch.
    pub fn new(ms: u64) -> Self {
        Self {
            ms: Arc::new(AtomicU64::new(ms)),
        }
    }

    /// Moves the time forward by `by`, in whole milliseconds (rounded down), saturating.
    pub fn advance(&self, by: Duration) {
        let by = whole_ms(by);
        // `fetch_update` with a closure that always returns `Some` cannot fail.
        let _ = self
            .ms
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |ms| {
                Some(ms.saturating_add(by))
            });
    }

    /// Sets the time to `ms` milliseconds since the epoch, also backwards (to test skew).
    pub fn set(&self, ms: u64) {
        self.ms.store(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.ms.load(Ordering::SeqCst)
    }
}

impl fmt::Debug for ManualClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ManualClock")
            .field("now_ms", &self.now_ms())
            .finish()
    }
}

/// Wall time that advances with tokio's clock, so `#[tokio::test(start_paused = true)]` drives
/// the buckets.
///
/// It reads the wall clock once, when created, and from then on adds the time that
/// [`tokio::time::Instant`] reports as passed. In a running program that is ordinary wall time;
/// with tokio's time paused, it is the paused time (moved by sleeps and by `tokio::time::advance`). It must be created inside a tokio runtime
/// when time is paused, so that both readings come from the paused clock.
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    origin_ms: u64,
    start: tokio::time::Instant,
}

impl TokioClock {
    /// A clock that starts at the current wall time.
    pub fn new() -> Self {
        Self::starting_at(millis_since_epoch(SystemTime::now()))
    }

    /// A clock that reads `ms` milliseconds since the epoch now and advances with tokio's time.
    pub fn starting_at(ms: u64) -> Self {
        Self {
            origin_ms: ms,
            start: tokio::time::Instant::now(),
        }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for TokioClock {
    fn now_ms(&self) -> u64 {
        let passed = whole_ms(self.start.elapsed());
        self.origin_ms.saturating_add(passed)
    }
}

/// The CPU's time-stamp counter, read through [quanta], counted from the wall time at which the
/// clock was created. Feature `quanta`.
///
/// Reading it costs a fraction of a [`SystemClock`] reading (no `clock_gettime`, no conversion
/// of a `SystemTime`), which shows on [`MemoryStore`](crate::MemoryStore), where the clock is a
/// large share of a decision. The price is that it is wall time only at the start: it reads
/// [`SystemTime::now`] once, in [`new`](Self::new), and from then on adds the time the counter
/// says has passed. It does not follow the wall clock when that is stepped or slewed (NTP, an
/// operator), and the counter's rate is calibrated against the monotonic clock once per process,
/// so it may drift from the wall clock by the calibration error (typically a few milliseconds a
/// day, more on some virtual machines).
///
/// For a [`MemoryStore`](crate::MemoryStore) that is harmless: its buckets live in this process
/// and only compare times read from the same clock. Times that come from outside do meet it:
/// [`BucketStore::drain_until`](crate::BucketStore::drain_until) takes a wall-clock deadline,
/// which ends early or late by the drift. Do not use it for a shared store: buckets shared across
/// processes compare times from different clocks, which must all follow the wall clock
/// ([`Clock`] explains the bound on skew).
///
/// Where the CPU has no usable counter, quanta falls back to the OS's monotonic clock, and this
/// clock still counts from the wall time at creation. The first clock created in a process
/// calibrates the counter, which takes up to a few hundred milliseconds; later ones, and clones,
/// are cheap.
///
/// ```
/// use std::time::{Duration, SystemTime, UNIX_EPOCH};
/// use burstgate::{BucketKey, BucketStore, Clock, Limit, MemoryStore, QuantaClock};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let clock = QuantaClock::new();
/// let wall = SystemTime::now().duration_since(UNIX_EPOCH)?;
/// // Wall time when created (within a generous bound, for a busy machine).
/// assert!(clock.now_ms().abs_diff(wall.as_millis() as u64) <= 100);
///
/// let store = MemoryStore::new().with_clock(clock);
/// let limit = Limit::per_second(10)?;
/// let key = BucketKey::new("api", "client-7")?;
/// assert!(store.acquire(&key, limit, 1, Duration::ZERO).await?.is_admitted());
/// # Ok(())
/// # }
/// ```
///
/// [quanta]: https://docs.rs/quanta
#[cfg(feature = "quanta")]
#[cfg_attr(docsrs, doc(cfg(feature = "quanta")))]
#[derive(Debug, Clone)]
pub struct QuantaClock {
    counter: quanta::Clock,
    /// The counter's raw reading when the clock was created.
    start: u64,
    /// Nanoseconds since the epoch at `start`.
    origin_ns: u64,
}

#[cfg(feature = "quanta")]
impl QuantaClock {
    /// A clock that reads the wall time now and from then on advances with the CPU's counter.
    pub fn new() -> Self {
        let counter = quanta::Clock::new();
        let start = counter.raw();
        // Nanoseconds since the epoch fit a `u64` until the year 2554; a wall clock set before
        // 1970 reads as the epoch, as for `SystemClock`.
        let origin_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        Self {
            counter,
            start,
            origin_ns,
        }
    }
}

#[cfg(feature = "quanta")]
impl Default for QuantaClock {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(feature = "quanta")]
impl Clock for QuantaClock {
    #[inline]
    fn now_ms(&self) -> u64 {
        // `delta_as_nanos` answers zero for a reading at or before `start` (a counter that
        // differs between cores), so the clock never reads before its origin.
        let passed = self.counter.delta_as_nanos(self.start, self.counter.raw());
        self.origin_ns.saturating_add(passed) / 1_000_000
    }
}

fn millis_since_epoch(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map(whole_ms).unwrap_or(0)
}

/// Whole milliseconds in `d`, saturating at `u64::MAX`.
pub(crate) fn whole_ms(d: Duration) -> u64 {
    // Whole seconds and whole milliseconds separately, in `u64`: the same saturating result as
    // `as_millis` without its `u128` arithmetic, on every decision's path.
    d.as_secs()
        .saturating_mul(1_000)
        .saturating_add(u64::from(d.subsec_millis()))
}

/// The latest time the stores work with, in milliseconds since 1970: 2^53 − 1, the largest
/// count of milliseconds an `f64` holds exactly, so that the arithmetic and its Lua mirror
/// compute on exact times. Every later time is clamped to it.
pub(crate) const LATEST_MS: u64 = (1 << 53) - 1;

/// Milliseconds since the epoch for a deadline, rounded up so a drain never ends early.
pub(crate) fn deadline_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| {
            let ms = d.as_nanos().div_ceil(1_000_000);
            u64::try_from(ms).unwrap_or(u64::MAX)
        })
        .unwrap_or(0)
}

/// `t + d`, or, past what `SystemTime` holds, the latest time the stores work with (2^53 − 1 ms
/// after 1970): they clamp every later time to it anyway. For a deadline the reqwest middleware
/// computes from an upstream's back-off, which keeps the arithmetic's bound out of the front end.
#[cfg(feature = "reqwest")]
pub(crate) fn add_or_latest(t: SystemTime, d: Duration) -> SystemTime {
    t.checked_add(d)
        .unwrap_or(UNIX_EPOCH + Duration::from_millis(LATEST_MS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_clones_share_time_and_saturate() {
        let c = ManualClock::new(u64::MAX - 1);
        let d = c.clone();
        c.advance(Duration::from_secs(10));
        assert_eq!(d.now_ms(), u64::MAX);
        d.set(5);
        assert_eq!(c.now_ms(), 5);
        assert_eq!(c.now(), UNIX_EPOCH + Duration::from_millis(5));
    }

    #[test]
    fn deadlines_round_up() {
        assert_eq!(deadline_ms(UNIX_EPOCH + Duration::from_micros(1001)), 2);
        assert_eq!(deadline_ms(UNIX_EPOCH + Duration::from_millis(7)), 7);
        assert_eq!(deadline_ms(UNIX_EPOCH - Duration::from_secs(1)), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn tokio_clock_follows_paused_time() {
        let c = TokioClock::starting_at(1_000);
        tokio::time::advance(Duration::from_millis(250)).await;
        assert_eq!(c.now_ms(), 1_250);
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(c.now_ms(), 61_250);
    }

    /// Readings never go back on one thread, start at the wall time of creation, and keep up
    /// with the wall clock over a short span.
    #[cfg(feature = "quanta")]
    #[test]
    fn quanta_clock_is_anchored_to_the_wall_clock_and_monotonic() {
        let before = millis_since_epoch(SystemTime::now());
        let clock = QuantaClock::new();
        let first = clock.now_ms();
        let after = millis_since_epoch(SystemTime::now());
        // Reading the counter and the wall clock at creation may fall either side of a
        // millisecond, and the first reading comes a little after creation.
        assert!(
            before.saturating_sub(1) <= first && first <= after + 1,
            "{before} <= {first} <= {after}"
        );

        let mut last = first;
        let started = std::time::Instant::now();
        while started.elapsed() < Duration::from_millis(300) {
            let read = clock.now_ms();
            assert!(read >= last, "went back from {last} to {read}");
            last = read;
        }
        // The wall clock is read on both sides, so that a preempted thread cannot fail this.
        let wall_before = millis_since_epoch(SystemTime::now());
        let read = clock.now_ms();
        let wall_after = millis_since_epoch(SystemTime::now());
        assert!(last > first, "did not advance in 300 ms");
        assert!(
            wall_before.saturating_sub(5) <= read && read <= wall_after + 5,
            "{read} vs the wall clock's {wall_before}..={wall_after}"
        );

        // A clone reads the same clock, also from another thread (whose counter may sit a
        // little apart from this core's, hence the millisecond either way).
        let clone = clock.clone();
        let there = std::thread::spawn(move || clone.now_ms())
            .join()
            .expect("the reading succeeds");
        assert!(there + 1 >= read && there <= clock.now_ms() + 1);
    }

    #[test]
    fn system_clock_is_after_2020() {
        assert!(SystemClock.now_ms() > 1_577_836_800_000);
    }

    /// The per-thread millisecond never answers anything a fresh conversion would not: each
    /// reading lies between conversions made just before and just after it, across several
    /// millisecond boundaries, on a new thread (empty cache) and on this one.
    #[test]
    fn system_clock_agrees_with_a_fresh_conversion_across_milliseconds() {
        let check = || {
            let first = millis_since_epoch(SystemTime::now());
            let mut crossed = 0;
            let mut last = first;
            while crossed < 5 {
                let before = millis_since_epoch(SystemTime::now());
                let read = SystemClock.now_ms();
                let after = millis_since_epoch(SystemTime::now());
                assert!(
                    before <= read && read <= after,
                    "{before} <= {read} <= {after}"
                );
                if read != last {
                    crossed += 1;
                    last = read;
                }
            }
        };
        std::thread::spawn(check).join().expect("the check passes");
        check();
    }
}
