//! What a store answers: the decision on an acquire, the reservation a refund names, the state
//! a peek sees, what a claim found.

use std::time::{Duration, SystemTime};

#[cfg(doc)]
use super::BucketStore;
use crate::Limit;
use crate::bucket::Verdict;

/// What [`BucketStore::claim`] found of a one-time mark.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use burstgate::{BucketKey, BucketStore, Claim, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MemoryStore::new();
/// let bucket = BucketKey::new("orders", "seller-42")?;
/// let until = SystemTime::now() + Duration::from_secs(60);
/// store.book(&bucket, "9f3c", until).await?;
/// assert_eq!(store.claim(&bucket, "9f3c").await?, Claim::First);
/// assert_eq!(store.claim(&bucket, "9f3c").await?, Claim::Spent);
/// // Never booked here (or lost, or past its time): nobody can tell whether it went.
/// assert_eq!(store.claim(&bucket, "77aa").await?, Claim::Missing);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a claim says whether the booked turn may go"]
pub enum Claim {
    /// The mark was booked, and this claim spent it: the turn goes (or is given back) now.
    First,
    /// The mark was spent already, by an earlier claim here or in another process.
    Spent,
    /// The store holds no such mark: never booked, past its time, or lost by the store. It
    /// cannot tell whether the turn went, so the safe answer is to refuse it.
    Missing,
}

/// The outcome of [`BucketStore::acquire`]: everything a caller needs, from one store call.
///
/// A decision to admit has taken tokens: dropping it unread sends a request the caller never
/// checked was allowed, hence `#[must_use]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a decision says whether the request may go, and when"]
pub struct Decision {
    pub(super) admitted: bool,
    /// Milliseconds, as the arithmetic gives them; a `Duration` is made when asked for, which
    /// spares a decision nobody reads the times of two conversions.
    pub(super) wait_ms: u64,
    pub(super) remaining: u32,
    pub(super) resets_in_ms: u64,
    pub(super) limit: Limit,
    /// What a refund of this admission names.
    pub(super) reservation: Reservation,
}

impl Decision {
    pub(crate) fn new(outcome: Verdict, limit: Limit, cost: u32) -> Self {
        Self::from(outcome, limit, cost, Source::Store)
    }

    pub(crate) fn from(outcome: Verdict, limit: Limit, cost: u32, source: Source) -> Self {
        Self {
            admitted: outcome.allowed,
            wait_ms: outcome.wait,
            // `remaining` never exceeds the burst, a `u32`.
            remaining: u32::try_from(outcome.remaining).unwrap_or(u32::MAX),
            resets_in_ms: outcome.reset,
            limit,
            reservation: Reservation {
                cost,
                // Both below 2^54: no overflow.
                ready_at_ms: outcome.at + outcome.wait,
                source,
            },
        }
    }

    /// For an admitted request, what names its tokens to [`BucketStore::refund`] if the request
    /// is abandoned before it goes out. `None` when denied.
    pub fn reservation(&self) -> Option<Reservation> {
        self.admitted.then_some(self.reservation)
    }

    /// Whether the request may go: now when [`wait`](Self::wait) is zero, otherwise after it.
    pub fn is_admitted(&self) -> bool {
        self.admitted
    }

    /// For an admitted request, how long to wait before sending it (zero unless it reserved
    /// tokens that have not refilled yet). For a denied one, the same as
    /// [`retry_after`](Self::retry_after).
    pub fn wait(&self) -> Duration {
        Duration::from_millis(self.wait_ms)
    }

    /// For a denied request, how long until the same cost could be admitted (at least one
    /// millisecond), if nobody else takes tokens meanwhile. `None` when admitted.
    pub fn retry_after(&self) -> Option<Duration> {
        (!self.admitted).then(|| self.wait())
    }

    /// Whole tokens left in the bucket after this decision.
    pub fn remaining(&self) -> u32 {
        self.remaining
    }

    /// How long until the bucket is full again if nobody takes tokens.
    pub fn resets_in(&self) -> Duration {
        Duration::from_millis(self.resets_in_ms)
    }

    /// The limit the decision was made under.
    pub fn limit(&self) -> Limit {
        self.limit
    }
}

/// The tokens one admission took, and the slot they were taken for: what
/// [`BucketStore::refund`] gives back.
///
/// Plain data: [`cost`](Self::cost) and [`ready_at`](Self::ready_at) rebuild it with
/// [`Reservation::new`], so a reservation can be kept outside the process and refunded later.
/// `ready_at` is on the timeline of the store's stored times, which for a caller whose clock is
/// behind another writer's is that writer's clock, not the caller's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    pub(super) cost: u32,
    pub(super) ready_at_ms: u64,
    pub(super) source: Source,
}

/// Which bucket gave an admission's tokens, so that a refund goes back to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Source {
    /// The store's own buckets.
    Store,
    /// The local buckets of [`OutagePolicy::Local`](crate::OutagePolicy::Local).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    Local,
    /// No bucket: admitted by [`OutagePolicy::FailOpen`](crate::OutagePolicy::FailOpen).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    Nothing,
    /// This process's lease of the store's bucket ([`Leases`](crate::Leases)).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    Lease,
}

impl Reservation {
    /// The same slot and source for `cost` of its tokens: what a refund of part of an admission
    /// names.
    #[cfg(feature = "reqwest")]
    pub(crate) fn with_cost(self, cost: u32) -> Self {
        Self { cost, ..self }
    }

    /// A reservation of `cost` tokens for the slot at `ready_at`, of the store's own buckets.
    pub fn new(cost: u32, ready_at: SystemTime) -> Self {
        Self {
            cost,
            // The arithmetic takes no later time.
            ready_at_ms: crate::clock::deadline_ms(ready_at).min(crate::bucket::MAX_TIME),
            source: Source::Store,
        }
    }

    /// The tokens taken.
    pub fn cost(&self) -> u32 {
        self.cost
    }

    /// The slot the tokens were taken for: when the request may go.
    pub fn ready_at(&self) -> SystemTime {
        // At most 2^53 + 2^44 ms, within any SystemTime this crate builds for.
        let since = Duration::from_millis(self.ready_at_ms);
        std::time::UNIX_EPOCH
            .checked_add(since)
            .unwrap_or(std::time::UNIX_EPOCH)
    }

    pub(crate) fn ready_at_ms(&self) -> u64 {
        self.ready_at_ms
    }

    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn source(&self) -> Source {
        self.source
    }
}

/// The state of a bucket as [`BucketStore::peek`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketState {
    pub(super) burst: u32,
    pub(super) remaining: u32,
    pub(super) next_token_in: Duration,
    pub(super) resets_in: Duration,
    /// The halt of the latest drain, on the stored times' timeline; 0 for none.
    pub(super) halted_until_ms: u64,
}

impl BucketState {
    pub(crate) fn new(outcome: Verdict, limit: Limit) -> Self {
        let burst = limit.burst();
        Self {
            burst,
            remaining: u32::try_from(outcome.remaining).unwrap_or(burst),
            next_token_in: Duration::from_millis(outcome.wait),
            resets_in: Duration::from_millis(outcome.reset),
            halted_until_ms: 0,
        }
    }

    /// With the halt the store keeps for the bucket (0 for none): see
    /// [`halted_until`](Self::halted_until).
    pub(crate) fn with_halt(self, halt_ms: u64) -> Self {
        Self {
            halted_until_ms: halt_ms,
            ..self
        }
    }

    /// When the latest [`drain_until`](BucketStore::drain_until) or
    /// [`block_until`](BucketStore::block_until) of the bucket lets the first token go: a
    /// drain's deadline plus one token period, a block's deadline. `None` when none is recorded,
    /// or since a [`reset`](BucketStore::reset) or [`set`](BucketStore::set). A store forgets a
    /// halt once it is further behind than the limit's refill time plus one interval.
    ///
    /// Like [`Reservation::ready_at`], on the timeline of the store's stored times.
    pub fn halted_until(&self) -> Option<SystemTime> {
        (self.halted_until_ms > 0).then(|| {
            std::time::UNIX_EPOCH
                .checked_add(Duration::from_millis(self.halted_until_ms))
                .unwrap_or(std::time::UNIX_EPOCH)
        })
    }

    /// Whether a drain ends past `reservation`'s slot: the reservation was granted before the
    /// drain (every one granted after it has its slot at the halt or later, give or take a
    /// millisecond of rounding, which this allows for), its request must not go at its slot,
    /// and it should be made again. Its tokens stay spent.
    ///
    /// ```
    /// use std::time::{Duration, UNIX_EPOCH};
    /// use burstgate::{BucketKey, BucketStore, Limit, ManualClock, MemoryStore};
    ///
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # tokio::runtime::Builder::new_current_thread().build()?.block_on(async {
    /// let clock = ManualClock::new(1_700_000_000_000);
    /// let store = MemoryStore::new().with_clock(clock.clone());
    /// let (limit, key) = (Limit::per_second(1)?, BucketKey::new("api", "a")?);
    /// store.acquire(&key, limit, 1, Duration::ZERO).await?;
    /// // Reserved for one second from now.
    /// let waiting = store.acquire(&key, limit, 1, Duration::from_secs(5)).await?;
    /// let reservation = waiting.reservation().ok_or("admitted")?;
    /// // The upstream answers 429 "retry in 3 s": drained until 2 s, first token at 3 s.
    /// store.drain_until(&key, limit, UNIX_EPOCH + Duration::from_millis(1_700_000_002_000)).await?;
    /// let quota = store.peek(&key, limit).await?;
    /// assert!(quota.halts(&reservation));
    /// // Made again, it waits past the halt, and stands.
    /// let again = store.acquire(&key, limit, 1, Duration::from_secs(5)).await?;
    /// assert!(!store.peek(&key, limit).await?.halts(&again.reservation().ok_or("admitted")?));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # })
    /// # }
    /// ```
    pub fn halts(&self, reservation: &Reservation) -> bool {
        crate::bucket::halts(self.halted_until_ms, reservation.ready_at_ms())
    }

    /// The limit's burst: the most tokens the bucket holds.
    pub fn burst(&self) -> u32 {
        self.burst
    }

    /// Whole tokens available now.
    pub fn remaining(&self) -> u32 {
        self.remaining
    }

    /// `burst - remaining`.
    pub fn used(&self) -> u32 {
        self.burst.saturating_sub(self.remaining)
    }

    /// How long until at least one whole token is available (zero when one is).
    pub fn next_token_in(&self) -> Duration {
        self.next_token_in
    }

    /// How long until the bucket is full (zero when it is).
    pub fn resets_in(&self) -> Duration {
        self.resets_in
    }
}

#[cfg(feature = "reqwest")]
impl Reservation {
    /// The reservation as text, `<slot>:<cost>:<source>`: the slot in ms since the Unix epoch,
    /// the tokens, and the bucket that gave them as one letter (`s` the store's, `l` the local
    /// ones of an outage, `n` none). A [`Ticket`](crate::middleware::Ticket) carries its
    /// reservations so, and the refund of one read back goes to the bucket that gave its tokens.
    pub(crate) fn to_text(self) -> String {
        let source = match self.source {
            Source::Store => 's',
            Source::Local => 'l',
            // A lease is this process's: read back elsewhere, its refund gives nothing back.
            Source::Nothing | Source::Lease => 'n',
        };
        format!("{}:{}:{source}", self.ready_at_ms, self.cost)
    }

    /// The reservation [`to_text`](Self::to_text) wrote; `None` for any other text. A slot past
    /// the latest time the arithmetic takes is that time.
    pub(crate) fn from_text(text: &str) -> Option<Self> {
        // ASCII digits only (no sign, no space), at most `u64::MAX`.
        let number = |s: &str| {
            (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .then(|| s.parse::<u64>().ok())
                .flatten()
        };
        let mut parts = text.split(':');
        let (slot, cost, source) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() {
            return None;
        }
        let source = match source {
            "s" => Source::Store,
            "l" => Source::Local,
            "n" => Source::Nothing,
            _ => return None,
        };
        Some(Self {
            cost: u32::try_from(number(cost)?).ok()?,
            ready_at_ms: number(slot)?.min(crate::bucket::MAX_TIME),
            source,
        })
    }
}

#[cfg(all(test, feature = "reqwest"))]
mod reservation_text {
    use super::{Reservation, Source};

    #[test]
    fn a_reservation_reads_back_from_its_text() {
        let at = |cost, ready_at_ms, source| Reservation {
            cost,
            ready_at_ms,
            source,
        };
        for (r, text) in [
            (at(2, 1_796_000_000_123, Source::Store), "1796000000123:2:s"),
            (at(1, 0, Source::Local), "0:1:l"),
            (at(u32::MAX, 5, Source::Nothing), "5:4294967295:n"),
        ] {
            assert_eq!(r.to_text(), text);
            assert_eq!(Reservation::from_text(text), Some(r), "{text}");
        }
        // A slot past the latest time the arithmetic takes reads as that time.
        let late = Reservation::from_text("18446744073709551615:1:s").expect("reads");
        assert_eq!(late.ready_at_ms(), crate::bucket::MAX_TIME);
        for bad in [
            "",
            "1:2",
            "1:2:s:k",
            "x:2:s",
            "+1:2:s",
            "1:-2:s",
            " 1:2:s",
            "1::s",
            "1:4294967296:s",
            "18446744073709551616:1:s",
            "1:2:x",
            "1:2:S",
        ] {
            assert_eq!(Reservation::from_text(bad), None, "{bad:?}");
        }
    }
}
