//! [`Audit`]: the opt-in trail of every decision on a bucket, kept beside it in Redis.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

/// Keeps a trail of a rule's or a route's decisions: every decision on each of its buckets is
/// appended to a Redis Stream beside the bucket, by the script that makes it, in the same call,
/// so the trail holds exactly the decisions made and in their order. Opt in per rule
/// (`Rule::audit`) or route (`Route::audit`); read it with `burstgate audit <bucket> [<key>]`.
///
/// Each entry holds the decision's time (ms since the epoch, the store's clock, `t`), its
/// outcome (`o`: `admitted`, `waited` or `refused`), the cost (`c`), the wait (`w`, ms), the
/// tokens left after it (`r`), the key's [fingerprint](crate::BucketKey::fingerprint) (`k`,
/// never the key) and the deciding process's label (`p`). The stream of bucket key
/// `<prefix>:v4:<bucket>:{<caller>}` is `<prefix>:audit:v1:<bucket>:{<caller>}`, in the same
/// Redis Cluster slot.
///
/// Bounded: a stream keeps the [`cap`](Self::new) latest entries (trimmed exactly on every
/// append) and expires [`retain`](Self::retain) after its last one, so a flood of made-up keys
/// leaves at most `cap` entries per key it used, gone a day later by default.
///
/// Only a `RedisStore` keeps a trail: a `MemoryStore` decides as it would without one. A
/// decision the store does not make in Redis has no entry: a request decided by an outage
/// policy while Redis is away, or one the deny cache would have refused (an audited request
/// always asks Redis, so that its refusals are in the trail too).
///
/// ```
/// use std::num::NonZeroU32;
/// use std::time::Duration;
/// use burstgate::Audit;
///
/// let cap = NonZeroU32::new(1_000).ok_or("zero")?;
/// let audit = Audit::new(cap).retain(Duration::from_secs(6 * 3600)).process("api-3");
/// assert_eq!(audit.cap(), cap);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Audit {
    cap: NonZeroU32,
    retain: Duration,
    process: Arc<str>,
}

/// How long a stream is kept after its last entry, unless set otherwise.
const DEFAULT_RETAIN: Duration = Duration::from_secs(24 * 3600);

/// The longest process label written, in bytes.
const MAX_LABEL: usize = 64;

impl Audit {
    /// A trail keeping the latest `cap` decisions of each bucket, for a day after the last, each
    /// labelled with this process's id (`pid 4242`) until [`process`](Self::process) names it.
    pub fn new(cap: NonZeroU32) -> Self {
        Self {
            cap,
            retain: DEFAULT_RETAIN,
            process: format!("pid {}", std::process::id()).into(),
        }
    }

    /// How long a bucket's stream is kept after its last entry (default one day). Rounded up
    /// to whole milliseconds, at least one.
    #[must_use]
    pub fn retain(self, retain: Duration) -> Self {
        Self { retain, ..self }
    }

    /// Labels this process's entries with `label` (a host and a replica, say), cut to its first
    /// 64 bytes at a character boundary.
    #[must_use]
    pub fn process(self, label: &str) -> Self {
        let mut end = label.len().min(MAX_LABEL);
        while !label.is_char_boundary(end) {
            end -= 1;
        }
        Self {
            process: label[..end].into(),
            ..self
        }
    }

    /// The most entries a bucket's stream keeps.
    pub fn cap(&self) -> NonZeroU32 {
        self.cap
    }

    /// How long a bucket's stream is kept after its last entry.
    pub fn retention(&self) -> Duration {
        self.retain
    }

    /// The label of this process's entries.
    pub fn process_label(&self) -> &str {
        &self.process
    }

    /// The retention in whole milliseconds, at least one, as the script sets it.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn retain_ms(&self) -> u64 {
        let ms = self.retain.as_millis();
        let rounded = if self.retain > Duration::from_millis(ms as u64) {
            ms + 1
        } else {
            ms
        };
        u64::try_from(rounded.max(1)).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_label_is_cut_at_a_character_boundary_and_the_retention_rounded_up() {
        let cap = NonZeroU32::MIN;
        let long = "é".repeat(40);
        let audit = Audit::new(cap).process(&long);
        assert_eq!(audit.process_label().len(), 64);
        assert!(audit.process_label().chars().all(|c| c == 'é'));
        let odd = Audit::new(cap).process(&format!("a{long}"));
        assert_eq!(odd.process_label().len(), 63);
        assert_eq!(Audit::new(cap).retain_ms(), 86_400_000);
        assert_eq!(
            Audit::new(cap).retain(Duration::from_micros(1)).retain_ms(),
            1
        );
        assert_eq!(Audit::new(cap).retain(Duration::ZERO).retain_ms(), 1);
        assert_eq!(
            Audit::new(cap)
                .retain(Duration::from_micros(1_500))
                .retain_ms(),
            2
        );
        assert!(Audit::new(cap).process_label().starts_with("pid "));
    }
}
