//! A gate that lets one log event of a kind through per period and counts the others, so that a
//! flood of refusals or failures cannot multiply the logs: the layer's and the middleware's.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The least time between two log events of one kind for one rule (or route).
pub(crate) const LOG_EVERY: Duration = Duration::from_secs(10);

/// Lets one event through per [`LOG_EVERY`] and counts the others, so that the event that does
/// go out says how many it stands for. Shared by the clones of what owns it.
#[derive(Debug)]
pub(crate) struct LogGate {
    start: tokio::time::Instant,
    /// Milliseconds since `start` before which nothing is logged.
    next: AtomicU64,
    suppressed: AtomicU64,
}

impl LogGate {
    pub(crate) fn new() -> Self {
        Self {
            start: tokio::time::Instant::now(),
            next: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(events suppressed since the last one)` when this event may be logged.
    pub(crate) fn admit(&self) -> Option<u64> {
        let now = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        let next = self.next.load(Ordering::Relaxed);
        let every = LOG_EVERY.as_millis() as u64;
        if now >= next
            && self
                .next
                .compare_exchange(
                    next,
                    now.saturating_add(every),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_gate_lets_one_event_through_per_period_and_counts_the_rest() {
        let gate = LogGate::new();
        assert_eq!(gate.admit(), Some(0));
        for _ in 0..5 {
            assert_eq!(gate.admit(), None);
        }
        tokio::time::advance(LOG_EVERY - Duration::from_millis(1)).await;
        assert_eq!(gate.admit(), None);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(gate.admit(), Some(6), "the six held back are counted");
        assert_eq!(gate.admit(), None);
        tokio::time::advance(LOG_EVERY * 3).await;
        assert_eq!(gate.admit(), Some(1));
    }
}
