//! The circuit breaker of a [`RedisStore`](super::RedisStore): after failures in a row it opens,
//! and the outage policy answers at once, without trying Redis, until a probe finds Redis back.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

#[cfg(doc)]
use super::OutagePolicy;
use crate::clock::whole_ms;

/// How many failures open the circuit, and for how long.
///
/// After `failures` calls in a row fail (an error from Redis, or no answer within the store's
/// timeout), the circuit opens: for `open_for`, calls are answered at once by the
/// [`OutagePolicy`] without trying Redis. Then one call goes through as a probe. If Redis
/// answers, the circuit closes and calls go to Redis again; if not, it stays open for another
/// `open_for`. So decisions resume at most `open_for` plus one round trip after Redis is back.
///
/// A probe whose caller is dropped before Redis answers (a client that went away, a timeout
/// around the store call, a `select!`) counts as a failed probe, and a probe that never answers
/// (a peer that stopped without closing the connection) is superseded by the next call once
/// `open_for` has passed since it began: no caller, gone or stuck, can keep the circuit open.
/// A call through the closed circuit whose caller gives up after waiting half the store's
/// timeout or more (a timeout around the store shorter than its own) counts as a failure, so
/// such timeouts cannot hide a stalled Redis from the breaker; one given up sooner counts for
/// nothing.
/// The breaker keeps time on tokio's monotonic clock, never on the store's
/// [`Clock`](crate::Clock), so a wall clock that steps back does not hold the circuit open.
///
/// The default is 3 failures and 500 ms. Each change is a `tracing` event on the target
/// `burstgate::redis`: a warning when the circuit opens, an info event when it closes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Breaker {
    failures: u32,
    open_for: Duration,
}

impl Breaker {
    /// Opens after `failures` failed calls in a row, for `open_for`. An `open_for` below a
    /// millisecond is taken as one: a circuit open for no time would let every call through as
    /// a probe.
    pub fn new(failures: NonZeroU32, open_for: Duration) -> Self {
        Self {
            failures: failures.get(),
            open_for: open_for.max(Duration::from_millis(1)),
        }
    }

    /// Failed calls in a row that open the circuit.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// How long the circuit stays open before a probe.
    pub fn open_for(&self) -> Duration {
        self.open_for
    }
}

impl Default for Breaker {
    fn default() -> Self {
        Self::new(
            NonZeroU32::MIN.saturating_add(2),
            Duration::from_millis(500),
        )
    }
}

/// The breaker's shared state. Lock-free: it is read on every call.
///
/// Time is tokio's monotonic [`Instant`](tokio::time::Instant), never the store's clock: a wall
/// clock that steps back (NTP, a restored VM) must not keep the circuit open, and a
/// [`ManualClock`](crate::ManualClock) left alone in a test must not either.
#[derive(Debug)]
pub(super) struct Circuit {
    config: Breaker,
    /// The origin of the times below.
    base: tokio::time::Instant,
    /// Failed calls in a row.
    failures: AtomicU32,
    /// While open, until when (ms since `base`, plus one); 0 when closed.
    open_until: AtomicU64,
    /// When the probe on its way through the half-open circuit started (ms since `base`, plus
    /// one); 0 when there is none. A probe older than `open_for` is superseded: its caller may be
    /// stuck behind a peer that never answers.
    probe: AtomicU64,
}

/// The probe slot's value while a failed probe reopens the circuit: taken, and never superseded.
const CLOSING: u64 = u64::MAX;

/// Whether a call may go to Redis, and the obligation to report how it went.
///
/// A permit that is dropped unreported (its caller was dropped mid-call: a client that went
/// away, a timeout around the store, a `select!`) reports itself: a dropped probe counts as a
/// failed one, so the probe slot is never held by a call that no longer exists. A dropped call
/// through the closed circuit counts as a failure once it had waited as long as
/// [`stalls_after`](Self::stalls_after) says (a timeout around the store shorter than the
/// store's own must not hide a stalled Redis from the breaker), and for nothing before: a
/// client that goes away says nothing about Redis.
#[derive(Debug)]
pub(super) struct Permit<'a> {
    circuit: &'a Circuit,
    /// `Some(started)` when this call is the probe.
    probe: Option<u64>,
    /// Since when, and after how long a wait a drop counts as a failure.
    stall: Option<(tokio::time::Instant, Duration)>,
    reported: bool,
}

impl Circuit {
    pub(super) fn new(config: Breaker) -> Self {
        Self {
            config,
            base: tokio::time::Instant::now(),
            failures: AtomicU32::new(0),
            open_until: AtomicU64::new(0),
            probe: AtomicU64::new(0),
        }
    }

    pub(super) fn config(&self) -> Breaker {
        self.config
    }

    pub(super) fn is_open(&self) -> bool {
        self.open_until.load(Ordering::Acquire) != 0
    }

    /// Milliseconds since `base`, plus one, so that no reading is 0.
    fn now(&self) -> u64 {
        let since = tokio::time::Instant::now().saturating_duration_since(self.base);
        whole_ms(since).saturating_add(1)
    }

    fn open_for_ms(&self) -> u64 {
        whole_ms(self.config.open_for)
    }

    /// A permit for one call, or how long the circuit stays open yet.
    pub(super) fn pass(&self) -> Result<Permit<'_>, Duration> {
        let until = self.open_until.load(Ordering::Acquire);
        if until == 0 {
            return Ok(self.permit(None));
        }
        let now = self.now();
        if now < until {
            return Err(Duration::from_millis(until - now));
        }
        let probe = self.probe.load(Ordering::Acquire);
        let superseded = probe != 0 && now >= probe.saturating_add(self.open_for_ms());
        if (probe == 0 || superseded)
            && self
                .probe
                .compare_exchange(probe, now, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            if superseded {
                tracing::warn!(
                    target: "burstgate::redis",
                    "the probe of the open circuit never answered: a new one goes"
                );
            }
            return Ok(self.permit(Some(now)));
        }
        // Another call is probing; it is superseded at the latest `open_for` after it began.
        let started = self.probe.load(Ordering::Acquire);
        let left = started
            .saturating_add(self.open_for_ms())
            .saturating_sub(now);
        Err(Duration::from_millis(left.max(1)))
    }

    fn permit(&self, probe: Option<u64>) -> Permit<'_> {
        Permit {
            circuit: self,
            probe,
            stall: None,
            reported: false,
        }
    }

    fn succeeded(&self, probe: Option<u64>) {
        self.failures.store(0, Ordering::Release);
        // Closed first, then the probe slot freed: a call that finds the slot free must find the
        // circuit closed, or it would probe a closed circuit.
        if (probe.is_some() || self.is_open()) && self.open_until.swap(0, Ordering::AcqRel) != 0 {
            tracing::info!(target: "burstgate::redis", "redis answered again: circuit closed");
            #[cfg(feature = "metrics")]
            metrics::gauge!(crate::metrics::CIRCUIT_OPEN, "store" => "redis").set(0.0);
            // Whichever call closed it, a probe still on its way no longer speaks for the
            // circuit: its failure must not reopen a closed one.
            self.probe.store(0, Ordering::Release);
        } else if let Some(started) = probe {
            let _ = self
                .probe
                .compare_exchange(started, 0, Ordering::AcqRel, Ordering::Acquire);
        }
    }

    fn failed(&self, probe: Option<u64>, error: &dyn std::fmt::Display) {
        let open_for = self.open_for_ms();
        let until = self.now().saturating_add(open_for);
        if let Some(started) = probe {
            // A probe that a newer one superseded, or one that a success closed the circuit
            // under, leaves the slot alone. The slot stays taken (`CLOSING`) until the circuit
            // is open for another period, so no second probe goes out in between.
            if self
                .probe
                .compare_exchange(started, CLOSING, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                self.open_until.store(until, Ordering::Release);
                self.probe.store(0, Ordering::Release);
                tracing::warn!(
                    target: "burstgate::redis",
                    open_for_ms = open_for,
                    %error,
                    "redis still failing: circuit stays open"
                );
            }
            return;
        }
        let failed = self
            .failures
            .fetch_add(1, Ordering::AcqRel)
            .saturating_add(1);
        if failed >= self.config.failures
            && self
                .open_until
                .compare_exchange(0, until, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            #[cfg(feature = "metrics")]
            metrics::gauge!(crate::metrics::CIRCUIT_OPEN, "store" => "redis").set(1.0);
            tracing::warn!(
                target: "burstgate::redis",
                failures = failed,
                open_for_ms = open_for,
                %error,
                "redis failing: circuit opened"
            );
        }
    }
}

impl Permit<'_> {
    /// Counts a drop of this call after `wait` as a failure.
    pub(super) fn stalls_after(&mut self, wait: Duration) {
        self.stall = Some((tokio::time::Instant::now(), wait));
    }

    /// Whether this call is the probe of a half-open circuit.
    pub(super) fn is_probe(&self) -> bool {
        self.probe.is_some()
    }

    /// Redis answered.
    pub(super) fn success(mut self) {
        self.reported = true;
        self.circuit.succeeded(self.probe);
    }

    /// Redis failed or did not answer in time.
    pub(super) fn failure(mut self, error: &dyn std::fmt::Display) {
        self.reported = true;
        self.circuit.failed(self.probe, error);
    }
}

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        if self.reported {
            return;
        }
        if self.probe.is_some() {
            self.circuit.failed(
                self.probe,
                &"the probe's caller went away before redis answered",
            );
        } else if let Some((since, wait)) = self.stall
            && since.elapsed() >= wait
        {
            self.circuit.failed(
                None,
                &"a caller gave up after waiting half the store's timeout for redis",
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nz(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).expect("non-zero")
    }

    fn advance(ms: u64) -> impl std::future::Future<Output = ()> {
        tokio::time::advance(Duration::from_millis(ms))
    }

    fn is_probe(pass: &Result<Permit<'_>, Duration>) -> bool {
        matches!(pass, Ok(t) if t.probe.is_some())
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_the_threshold_and_probes_after_open_for() {
        let c = Circuit::new(Breaker::new(nz(3), Duration::from_millis(500)));
        for _ in 0..2 {
            c.pass().expect("closed").failure(&"down");
        }
        assert!(!c.is_open());
        c.pass().expect("closed").failure(&"down");
        assert!(c.is_open());
        advance(200).await;
        assert_eq!(c.pass().err(), Some(Duration::from_millis(300)));
        // Once open_for has passed, exactly one call probes.
        advance(300).await;
        let probe = c.pass();
        assert!(is_probe(&probe));
        assert!(c.pass().is_err());
        // A failed probe keeps it open for another open_for.
        advance(10).await;
        probe.expect("the probe").failure(&"down");
        advance(90).await;
        assert_eq!(c.pass().err(), Some(Duration::from_millis(410)));
        advance(410).await;
        c.pass().expect("a probe").success();
        assert!(!c.is_open());
        assert!(matches!(c.pass(), Ok(t) if t.probe.is_none()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_success_resets_the_count() {
        let c = Circuit::new(Breaker::new(nz(2), Duration::from_millis(10)));
        c.pass().expect("closed").failure(&"down");
        c.pass().expect("closed").success();
        c.pass().expect("closed").failure(&"down");
        assert!(!c.is_open(), "the failures were not in a row");
        c.pass().expect("closed").failure(&"down");
        assert!(c.is_open());
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_probe_releases_its_slot_and_counts_as_a_failure() {
        let c = Circuit::new(Breaker::new(nz(1), Duration::from_millis(500)));
        c.pass().expect("closed").failure(&"down");
        advance(500).await;
        let probe = c.pass();
        assert!(is_probe(&probe));
        // The probe's caller is dropped mid-call.
        drop(probe);
        assert!(c.is_open(), "a cancelled probe is a failed one");
        assert_eq!(c.pass().err(), Some(Duration::from_millis(500)));
        advance(500).await;
        let probe = c.pass();
        assert!(is_probe(&probe), "the slot was released");
        probe.expect("the probe").success();
        assert!(!c.is_open());
    }

    #[tokio::test(start_paused = true)]
    async fn a_probe_that_never_answers_is_superseded_after_open_for() {
        let c = Circuit::new(Breaker::new(nz(1), Duration::from_millis(500)));
        c.pass().expect("closed").failure(&"down");
        advance(500).await;
        let stuck = c.pass();
        assert!(is_probe(&stuck));
        advance(499).await;
        assert_eq!(c.pass().err(), Some(Duration::from_millis(1)));
        advance(1).await;
        let second = c.pass();
        assert!(is_probe(&second), "superseded");
        // The stuck probe failing at last leaves the new probe's slot alone.
        stuck.expect("the stuck probe").failure(&"down");
        second.expect("the second probe").success();
        assert!(!c.is_open());
    }

    #[tokio::test(start_paused = true)]
    async fn a_late_probe_failure_reopens_a_circuit_another_call_closed() {
        let c = Circuit::new(Breaker::new(nz(1), Duration::from_millis(500)));
        let slow = c.pass().expect("closed");
        c.pass().expect("closed").failure(&"down");
        advance(500).await;
        let probe = c.pass();
        assert!(is_probe(&probe));
        // The call from before the outage answers: Redis is back, the circuit closes.
        slow.success();
        assert!(!c.is_open());
        // The probe's own failure (a timeout it had already run into) no longer speaks for it.
        probe.expect("the probe").failure(&"down");
        assert!(!c.is_open(), "one stale failure reopened a closed circuit");
        // And the next outage needs its threshold again, with a probe slot that is free.
        c.pass().expect("closed").failure(&"down");
        advance(500).await;
        assert!(is_probe(&c.pass()));
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_call_through_the_closed_circuit_counts_for_nothing() {
        let c = Circuit::new(Breaker::new(nz(1), Duration::from_millis(500)));
        drop(c.pass());
        let mut quick = c.pass().expect("closed");
        quick.stalls_after(Duration::from_millis(125));
        advance(124).await;
        drop(quick);
        assert!(!c.is_open());
    }

    #[tokio::test(start_paused = true)]
    async fn an_outer_timeout_shorter_than_the_stores_hides_a_stall_from_the_breaker() {
        let c = Circuit::new(Breaker::new(nz(2), Duration::from_millis(500)));
        for _ in 0..2 {
            let mut call = c.pass().expect("closed");
            call.stalls_after(Duration::from_millis(125));
            advance(150).await;
            // A tower timeout of 150 ms around a store whose own is 250 ms.
            drop(call);
        }
        assert!(c.is_open(), "two callers gave up on a stalled Redis");
    }

    #[test]
    fn an_open_period_below_a_millisecond_is_one() {
        let b = Breaker::new(NonZeroU32::MIN, Duration::ZERO);
        assert_eq!(b.failures(), 1);
        assert_eq!(b.open_for(), Duration::from_millis(1));
    }
}
