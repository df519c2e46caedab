//! What a [`RedisStore`](super::RedisStore) does when Redis does not answer: the policy, what
//! each policy answers, and the circuit breaker that lets it answer at once while Redis is down.

use std::num::NonZeroU32;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::ConnectionLike;

use super::RedisStore;
use super::wire::{Args, Op};
use crate::bucket::{self, Outcome};
use crate::clock::{Clock, whole_ms};
use crate::store::{BucketStore, Decision, Reservation, Source, StoreError, Take};
use crate::{BucketKey, Limit};

/// What a [`RedisStore`](super::RedisStore) answers when Redis cannot decide: the call failed, it
/// timed out, or the circuit breaker is open.
///
/// The policy applies only to Redis being unreachable or failing. A bad cost is always an error,
/// and so is a key that holds something other than a bucket ([`StoreError::WrongType`]): those
/// are mistakes to fix, not outages to ride out.
///
/// The default is [`FailClosed`](Self::FailClosed). A limiter exists to keep a budget, and only
/// failing closed keeps it whatever happens: the tower layer answers 503 and the middleware
/// returns an error, so nothing goes out that the shared budget did not admit. Choose
/// [`FailOpen`](Self::FailOpen) when the limiter protects something that would rather take
/// unlimited traffic than none, and [`Local`](Self::Local) when each process can be trusted with a
/// fixed share of the budget while it cannot reach the others.
///
/// [`StoreError::WrongType`]: crate::StoreError::WrongType
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OutagePolicy {
    /// Every call returns the error: [`StoreError::Backend`](crate::StoreError::Backend), or
    /// [`StoreError::Unavailable`](crate::StoreError::Unavailable) while the breaker is open.
    #[default]
    FailClosed,
    /// [`acquire`](crate::BucketStore::acquire) admits at once, reporting zero tokens remaining,
    /// and logs a warning; [`peek`](crate::BucketStore::peek), [`refund`](crate::BucketStore::refund)
    /// and [`drain_until`](crate::BucketStore::drain_until) still return the error, since there is
    /// nothing true they could answer or change.
    FailOpen,
    /// Every call goes to a bucket in this process's memory with the same rate and burst divided
    /// by `processes` (rounded down): with that many processes sharing the Redis budget, together
    /// they never admit more than the budget, even while none of them can reach Redis. A request
    /// whose cost is above the local share is refused as under `FailClosed`.
    ///
    /// One budget across the switches: while Redis decides on a key, its local bucket is kept
    /// empty, so an outage starts from nothing refilled since the last one; and before Redis
    /// decides again on a key this process admitted locally, Redis's bucket for it is emptied, as
    /// its refill during the outage was spent here. A key first used during an outage starts
    /// with its full share of the burst. So across any number of outages and recoveries a bucket
    /// admits at most one budget plus one share of the burst (`docs/PERFORMANCE.md`, "When Redis
    /// fails", has a measured run). The cost is on the safe side: emptying Redis's bucket after one
    /// process's outage takes from the others what Redis refilled meanwhile, and a refund goes
    /// only to the bucket that gave the tokens.
    Local {
        /// How many processes share the budget.
        processes: NonZeroU32,
    },
}

impl<C, K> RedisStore<C, K>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
    K: Clock,
{
    /// The limit of this process's local bucket under [`OutagePolicy::Local`], or `None` when
    /// the policy is another, or the share would hold no token.
    pub(super) fn local_limit(&self, limit: Limit) -> Option<Limit> {
        let OutagePolicy::Local { processes } = self.policy else {
            return None;
        };
        share(limit, processes)
    }

    /// Under [`OutagePolicy::Local`], one budget across the switches between Redis and the local
    /// bucket, with the local bucket kept empty while Redis decides (in `acquire`): Redis's
    /// bucket is emptied before its first decision on a key this process admitted locally since,
    /// as its refill meanwhile was this process's to spend, and was spent here. In the safe
    /// direction: what Redis could still have admitted is lost, never given twice.
    pub(super) async fn charge_for_local_admissions(
        &self,
        key: &BucketKey,
        limit: Limit,
        now: u64,
    ) {
        let touched = self
            .touched
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(key.as_str());
        if touched {
            let drain = Args {
                op: Op::Drain,
                limit,
                x: now,
                max_wait: 0,
            };
            if self.run(key, now, drain).await.is_err() {
                // Still out of reach: the next call tries again.
                self.touched
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(key.as_str().into());
            }
        }
    }

    /// What [`OutagePolicy::FailOpen`] answers: admitted now, nothing known to remain.
    fn open_outcome(&self) -> Outcome {
        Outcome {
            allowed: true,
            wait: 0,
            remaining: 0,
            reset: 0,
            at: self.clock.now_ms().min(bucket::MAX_TIME),
        }
    }

    /// The answer under the policy when Redis could not give one.
    pub(super) async fn acquire_in_outage(
        &self,
        error: StoreError,
        key: &BucketKey,
        limit: Limit,
        cost: u32,
        max_wait: Duration,
    ) -> Result<Decision, StoreError> {
        match self.policy {
            OutagePolicy::FailClosed => Err(error),
            OutagePolicy::FailOpen => {
                if !matches!(error, StoreError::Unavailable { .. }) {
                    tracing::warn!(
                        target: "burstgate::redis",
                        key = %key.fingerprint(),
                        %error,
                        "redis failed: admitting (fail open)"
                    );
                }
                // No bucket gave these tokens, so a refund of them gives nothing back.
                Ok(Decision::from(
                    self.open_outcome(),
                    limit,
                    cost,
                    Source::Nothing,
                ))
            }
            OutagePolicy::Local { .. } => match self.local_limit(limit) {
                Some(local) if cost <= local.burst() => {
                    // A key with no local bucket starts empty as of Redis's last answer.
                    let last = self.last_answer.load(Ordering::Relaxed);
                    self.local.seed_empty(key, local, last)?;
                    // Every key admitted here must be remembered, for Redis to be charged when
                    // it is back: past the bound, a new key gets the outage's error, the
                    // fail-closed answer, rather than tokens nobody would charge. (Calls racing
                    // past the check can pass the bound by as many as run at once.)
                    let full = {
                        let touched = self.touched.lock().unwrap_or_else(PoisonError::into_inner);
                        touched.len() >= self.local.max_buckets() && !touched.contains(key.as_str())
                    };
                    if full {
                        return Err(error);
                    }
                    let d = self.local.acquire(key, local, cost, max_wait).await?;
                    if d.is_admitted() {
                        self.touched
                            .lock()
                            .unwrap_or_else(PoisonError::into_inner)
                            .insert(key.as_str().into());
                    }
                    // Reported under the limit the caller gave, for headers and the like, and
                    // refunded to the local bucket that gave the tokens.
                    let reservation = Reservation {
                        source: Source::Local,
                        ..d.reservation
                    };
                    Ok(Decision {
                        limit,
                        reservation,
                        ..d
                    })
                }
                _ => Err(error),
            },
        }
    }
}

impl<C, K> RedisStore<C, K>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
    K: Clock,
{
    /// The answer under the policy when Redis could not decide on several buckets at once: as
    /// [`acquire_in_outage`](Self::acquire_in_outage) answers for one, all or none. Under
    /// [`OutagePolicy::Local`], the local buckets decide together, atomically, and a bucket whose
    /// limit has no local share refuses the request with the outage's error.
    pub(super) async fn acquire_all_in_outage(
        &self,
        error: StoreError,
        takes: &[Take<'_>],
        max_wait: Duration,
    ) -> Result<Vec<Decision>, StoreError> {
        match self.policy {
            OutagePolicy::FailClosed => Err(error),
            OutagePolicy::FailOpen => {
                if !matches!(error, StoreError::Unavailable { .. }) {
                    tracing::warn!(
                        target: "burstgate::redis",
                        buckets = takes.len(),
                        %error,
                        "redis failed: admitting (fail open)"
                    );
                }
                let outcome = self.open_outcome();
                Ok(takes
                    .iter()
                    .map(|t| Decision::from(outcome, t.limit(), t.cost(), Source::Nothing))
                    .collect())
            }
            OutagePolicy::Local { .. } => {
                let mut local = Vec::with_capacity(takes.len());
                for t in takes {
                    match self.local_limit(t.limit()) {
                        Some(share) if t.cost() <= share.burst() => {
                            local.push(Take::new(t.key(), share, t.cost()));
                        }
                        _ => return Err(error),
                    }
                }
                let last = self.last_answer.load(Ordering::Relaxed);
                for t in &local {
                    self.local.seed_empty(t.key(), t.limit(), last)?;
                }
                let full = {
                    let touched = self.touched.lock().unwrap_or_else(PoisonError::into_inner);
                    let new = local
                        .iter()
                        .filter(|t| !touched.contains(t.key().as_str()))
                        .count();
                    new > 0 && touched.len() + new > self.local.max_buckets()
                };
                if full {
                    return Err(error);
                }
                let decided = self.local.acquire_all(&local, max_wait).await?;
                if decided.first().is_some_and(Decision::is_admitted) {
                    let mut touched = self.touched.lock().unwrap_or_else(PoisonError::into_inner);
                    for t in &local {
                        touched.insert(t.key().as_str().into());
                    }
                }
                Ok(decided
                    .into_iter()
                    .zip(takes)
                    .map(|(d, t)| Decision {
                        limit: t.limit(),
                        reservation: Reservation {
                            source: Source::Local,
                            ..d.reservation
                        },
                        ..d
                    })
                    .collect())
            }
        }
    }
}

/// A limit's share for one of `processes`: the same tokens over `processes` times the interval,
/// and the burst divided (rounded down). `None` when the share holds no whole token, or its
/// interval is out of range.
fn share(limit: Limit, processes: NonZeroU32) -> Option<Limit> {
    let n = processes.get();
    if n == 1 {
        return Some(limit);
    }
    let interval = limit.interval().checked_mul(n)?;
    Limit::new(limit.tokens(), interval)
        .and_then(|l| l.with_burst(limit.burst() / n))
        .ok()
}

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
/// A ticket that is dropped unreported (its caller was dropped mid-call: a client that went
/// away, a timeout around the store, a `select!`) reports itself: a dropped probe counts as a
/// failed one, so the probe slot is never held by a call that no longer exists. A dropped call
/// through the closed circuit counts as a failure once it had waited as long as
/// [`stalls_after`](Self::stalls_after) says (a timeout around the store shorter than the
/// store's own must not hide a stalled Redis from the breaker), and for nothing before: a
/// client that goes away says nothing about Redis.
#[derive(Debug)]
pub(super) struct Ticket<'a> {
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

    /// A ticket for one call, or how long the circuit stays open yet.
    pub(super) fn pass(&self) -> Result<Ticket<'_>, Duration> {
        let until = self.open_until.load(Ordering::Acquire);
        if until == 0 {
            return Ok(self.ticket(None));
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
            return Ok(self.ticket(Some(now)));
        }
        // Another call is probing; it is superseded at the latest `open_for` after it began.
        let started = self.probe.load(Ordering::Acquire);
        let left = started
            .saturating_add(self.open_for_ms())
            .saturating_sub(now);
        Err(Duration::from_millis(left.max(1)))
    }

    fn ticket(&self, probe: Option<u64>) -> Ticket<'_> {
        Ticket {
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

impl Ticket<'_> {
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

impl Drop for Ticket<'_> {
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

    fn is_probe(pass: &Result<Ticket<'_>, Duration>) -> bool {
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

#[cfg(test)]
mod local_bucket_tests {
    //! What `OutagePolicy::Local` keeps in memory while Redis answers.

    use std::num::NonZeroU32;

    use super::*;
    use crate::ManualClock;

    use burstgate_testkit::redis_server;

    #[tokio::test]
    async fn the_local_policy_holds_a_local_bucket_for_every_key_redis_decides_on() {
        let conn = redis::Client::open(redis_server::url())
            .expect("a valid Redis URL")
            .get_multiplexed_async_connection()
            .await
            .expect("a connection to the test Redis");
        let clock = ManualClock::new(1_767_225_600_000);
        let processes = NonZeroU32::new(2).expect("non-zero");
        let store = RedisStore::new(conn)
            .prefix(&redis_server::unique_prefix())
            .expect("a valid prefix")
            .with_clock(clock.clone())
            .on_outage(OutagePolicy::Local { processes });
        let limit = Limit::per_minute(10).expect("a valid limit");
        for i in 0..2_000 {
            let key = BucketKey::new("many", format!("made-up-{i}")).expect("a valid key");
            let d = store.acquire(&key, limit, 1, Duration::ZERO).await;
            assert!(d.is_ok_and(|d| d.is_admitted()));
        }
        // Redis decided on every one: no local bucket is needed for any of them.
        assert_eq!(store.local.len(), 0, "local buckets held");
        assert_eq!(
            store.last_answer.load(Ordering::Relaxed),
            clock.now_ms(),
            "what a key new to an outage starts empty from"
        );
    }
}
