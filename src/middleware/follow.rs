//! Reading how much of the budget the upstream says is left: `X-Ratelimit-Remaining` and the
//! other integer fields APIs use, and the `r` of the IETF `RateLimit` field.

use http::{HeaderMap, HeaderName};

/// Which fields of the upstream's answers to read the budget left from.
#[derive(Debug, Clone)]
pub(super) struct Follow {
    /// Off: the shared bucket follows nothing the upstream reports.
    pub(super) on: bool,
    /// Integer fields, the application's own first, then the common ones.
    pub(super) names: Vec<HeaderName>,
}

impl Default for Follow {
    fn default() -> Self {
        Self {
            on: true,
            names: vec![
                HeaderName::from_static("x-ratelimit-remaining"),
                // drafts 00 to 06 of the IETF fields
                HeaderName::from_static("ratelimit-remaining"),
            ],
        }
    }
}

/// The buckets whose upstream has shown a margin over the bucket lately, in this process: it
/// reported at least as many tokens left as the bucket can hold, or a token left (beyond what
/// refilled while the answer travelled) to a request that went at a reserved slot, when the
/// bucket was spent to its pace. Such an upstream holds more than the bucket (a larger burst,
/// or a faster rate), and a report of nothing left when the bucket is spent then says that
/// someone else took the margin. Counts heard by requests sent while the bucket held tokens
/// prove nothing: requests sent together reach the upstream in any order.
///
/// A margin shown is believed for two refill times of the bucket: an upstream that stops
/// showing one (its limit was lowered) stops being drained for. Per bucket key, since accounts
/// on one route may have different plans, and at most [`SEEN_KEYS`] of them: forgotten entries
/// are dropped once there are that many, and past it a new key's margin goes unlearned.
#[derive(Debug, Default)]
pub(super) struct Seen {
    shown: std::sync::Mutex<std::collections::HashMap<Box<str>, tokio::time::Instant>>,
}

/// Entries kept before the forgotten ones are dropped.
const SEEN_KEYS: usize = 1024;

/// How a request went out, for reading its answer.
#[derive(Debug, Clone, Copy)]
pub(super) struct Sent {
    /// The whole tokens the bucket held once the request took its own: what the upstream
    /// should report left if nobody else spends it; 0 for a request that went at a reserved
    /// slot.
    pub(super) expected: u32,
    /// Whether the request went at a reserved slot, when the bucket was spent to its pace.
    pub(super) queued: bool,
    /// The tokens it took.
    pub(super) cost: u32,
    /// Whether what the call cost was settled already, from the answer.
    pub(super) settled: bool,
    /// From sending the request to its answer.
    pub(super) rtt: std::time::Duration,
}

impl Seen {
    /// Records that `key`'s upstream, under `limit`, reported `left` to a request that went
    /// out as `sent` says, and says whether it has shown a margin lately: `false` without
    /// asking when that cannot matter (something left, or a request that did not queue) and
    /// this answer proves nothing.
    pub(super) fn margin(
        &self,
        key: &crate::BucketKey,
        limit: crate::Limit,
        left: u32,
        sent: &Sent,
    ) -> bool {
        let now = tokio::time::Instant::now();
        // What refilled while the answer travelled, and in the millisecond a slot is rounded
        // to: a bucket with no margin hears a token left when that reaches one.
        let transit = (sent.rtt.as_secs_f64() * 1000.0 + 1.0) * f64::from(limit.tokens())
            / limit.interval_ms() as f64;
        let proof = left >= limit.burst() || (sent.queued && f64::from(left) > transit);
        // The answer matters only for nothing left at a reserved slot: every other answer
        // without a proof leaves the table, shared by every worker, unlocked.
        if !(proof || (left == 0 && sent.queued)) {
            return false;
        }
        let believed = (limit.refill_time() * 2).max(std::time::Duration::from_secs(1));
        let mut shown = self
            .shown
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if proof {
            match shown.get_mut(key.as_str()) {
                Some(at) => *at = now,
                None => {
                    if shown.len() >= SEEN_KEYS {
                        shown.retain(|_, at| now.duration_since(*at) <= believed);
                    }
                    // Bounded: past the cap, a new key's margin goes unlearned (its bucket
                    // lowers and backs off as without one) until older ones are forgotten.
                    if shown.len() < SEEN_KEYS {
                        shown.insert(key.as_str().into(), now);
                    }
                }
            }
        }
        shown
            .get(key.as_str())
            .is_some_and(|at| now.duration_since(*at) <= believed)
    }
}

/// The IETF `RateLimit` field (draft 07 onwards): a list of `"policy";r=<remaining>;t=<secs>`.
static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

impl Follow {
    /// The fewest tokens any field of `headers` reports left, when one does. Fields that do
    /// not parse are skipped (logged at debug level: a vendor's odd field on every answer must
    /// not flood the logs); several policies, or several fields, report the tightest.
    pub(super) fn remaining(&self, headers: &HeaderMap) -> Option<u32> {
        if !self.on {
            return None;
        }
        let mut least: Option<u64> = None;
        let mut take = |n: u64| least = Some(least.map_or(n, |l| l.min(n)));
        for name in &self.names {
            for value in headers.get_all(name) {
                match value.to_str().ok().and_then(integers) {
                    Some(n) => take(n),
                    None => tracing::debug!(header = %name, "ignoring an unusable remaining count"),
                }
            }
        }
        for value in headers.get_all(&RATELIMIT) {
            match ietf_remaining(value.as_bytes()) {
                Some(Some(n)) => take(n),
                Some(None) => {}
                None => tracing::debug!("ignoring a RateLimit field that does not parse"),
            }
        }
        least.map(|n| u32::try_from(n).unwrap_or(u32::MAX))
    }
}

/// The least of a comma-separated list of counts: whole, or with a fraction, rounded down (the
/// safe direction). `None` when any part is not a count.
fn integers(value: &str) -> Option<u64> {
    value
        .split(',')
        .map(|part| count(part.trim()))
        .try_fold(None, |least: Option<u64>, n| {
            let n = n?;
            Some(Some(least.map_or(n, |l| l.min(n))))
        })
        .flatten()
}

pub(super) fn count(part: &str) -> Option<u64> {
    let (whole, fraction) = part.split_once('.').unwrap_or((part, ""));
    if whole.is_empty() || !whole.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if !fraction.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    // More than fits is more than any bucket holds.
    Some(whole.parse().unwrap_or(u64::MAX))
}

/// The least `r` of the items of a `RateLimit` field: `Some(None)` when it parses and no item
/// has a usable `r`, `None` when it does not parse as a structured-field list.
fn ietf_remaining(value: &[u8]) -> Option<Option<u64>> {
    let list: sfv::List = sfv::Parser::new(value).parse().ok()?;
    let least = list
        .iter()
        .filter_map(|entry| match entry {
            sfv::ListEntry::Item(item) => item.params.get("r"),
            sfv::ListEntry::InnerList(_) => None,
        })
        .filter_map(|r| match r {
            sfv::BareItem::Integer(n) => u64::try_from(i64::from(*n)).ok(),
            _ => None,
        })
        .min();
    Some(least)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (name, value) in pairs {
            h.append(*name, HeaderValue::from_static(value));
        }
        h
    }

    #[test]
    fn the_common_fields_report_what_is_left() {
        let f = Follow::default();
        assert_eq!(
            f.remaining(&headers(&[("x-ratelimit-remaining", "7")])),
            Some(7)
        );
        assert_eq!(
            f.remaining(&headers(&[("ratelimit-remaining", " 3 ")])),
            Some(3)
        );
        assert_eq!(
            f.remaining(&headers(&[("x-ratelimit-remaining", "4.9")])),
            Some(4)
        );
        assert_eq!(
            f.remaining(&headers(&[("ratelimit", "\"default\";r=5;t=1")])),
            Some(5)
        );
        assert_eq!(f.remaining(&headers(&[])), None);
    }

    #[test]
    fn the_tightest_report_wins() {
        let f = Follow::default();
        let both = headers(&[
            ("x-ratelimit-remaining", "9"),
            ("ratelimit", "\"second\";r=6;t=1, \"hour\";r=2;t=900"),
        ]);
        assert_eq!(f.remaining(&both), Some(2));
        let repeated = headers(&[
            ("x-ratelimit-remaining", "5"),
            ("x-ratelimit-remaining", "3"),
        ]);
        assert_eq!(f.remaining(&repeated), Some(3));
        assert_eq!(
            f.remaining(&headers(&[("x-ratelimit-remaining", "8, 1")])),
            Some(1)
        );
    }

    #[test]
    fn what_does_not_parse_is_ignored() {
        let f = Follow::default();
        for bad in ["-1", "", "soon", "1e3", "0x10", "+3", "3 4"] {
            let h = headers(&[("x-ratelimit-remaining", bad)]);
            assert_eq!(f.remaining(&h), None, "{bad:?}");
        }
        for bad in [
            "r=5",
            "\"a\";r=-1",
            "\"a\";r=2.5",
            "\"a\";r=\"5\"",
            "\"a\";t=3",
            "(\"a\");r=1",
        ] {
            let h = headers(&[("ratelimit", bad)]);
            assert_eq!(f.remaining(&h), None, "{bad:?}");
        }
        // A good field beside a bad one still counts.
        let mixed = headers(&[
            ("x-ratelimit-remaining", "soon"),
            ("ratelimit", "\"a\";r=4"),
        ]);
        assert_eq!(f.remaining(&mixed), Some(4));
        // A count beyond any bucket is the most a u32 holds.
        let huge = headers(&[("x-ratelimit-remaining", "99999999999999999999999")]);
        assert_eq!(f.remaining(&huge), Some(u32::MAX));
    }

    #[tokio::test(start_paused = true)]
    async fn a_margin_shows_only_where_order_cannot_fake_it() {
        use std::time::Duration;

        let seen = Seen::default();
        let limit = crate::Limit::per_second(20)
            .and_then(|l| l.with_burst(10))
            .unwrap();
        let key = |account| crate::BucketKey::new("orders", account).unwrap();
        let sent = |expected, queued, rtt_ms| Sent {
            expected,
            queued,
            cost: 1,
            settled: false,
            rtt: Duration::from_millis(rtt_ms),
        };
        // Requests sent together while the bucket held tokens reach the upstream in any order:
        // the last of a burst may hear 1. No proof, nor nothing left to the first of a queue.
        assert!(!seen.margin(&key("a"), limit, 1, &sent(0, false, 1)));
        assert!(!seen.margin(&key("a"), limit, 4, &sent(3, false, 1)));
        assert!(!seen.margin(&key("a"), limit, 0, &sent(0, true, 1)));
        // A queued request that hears a token left, more than refilled in transit: a margin;
        // one whose answer took 200 ms (4 tokens' refill) proves nothing with 4 left.
        assert!(!seen.margin(&key("a"), limit, 4, &sent(0, true, 200)));
        assert!(seen.margin(&key("a"), limit, 1, &sent(0, true, 1)));
        // As many as the bucket can hold: a margin, whatever the order.
        assert!(seen.margin(&key("b"), limit, 10, &sent(9, false, 1)));
        // Per account: another on the same route has shown nothing.
        assert!(!seen.margin(&key("c"), limit, 0, &sent(0, true, 1)));
        // Believed for two refill times (1 s here), then forgotten until shown again.
        tokio::time::advance(Duration::from_millis(1_000)).await;
        assert!(seen.margin(&key("a"), limit, 0, &sent(0, true, 1)));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(!seen.margin(&key("a"), limit, 0, &sent(0, true, 1)));
    }

    /// A flood of made-up accounts, each answered with a full bucket, must not grow the table
    /// without bound; the margins learned stay, and room comes back once they are forgotten.
    #[tokio::test(start_paused = true)]
    async fn a_flood_of_accounts_leaves_the_margins_bounded() {
        use std::time::Duration;

        let seen = Seen::default();
        let limit = crate::Limit::per_second(20)
            .and_then(|l| l.with_burst(10))
            .unwrap();
        let key = |account: &str| crate::BucketKey::new("orders", account).unwrap();
        let full = Sent {
            expected: 9,
            queued: false,
            cost: 1,
            settled: false,
            rtt: Duration::from_millis(1),
        };
        for n in 0..SEEN_KEYS {
            assert!(seen.margin(&key(&format!("made-up-{n}")), limit, 10, &full));
        }
        // Past the cap, a new account's margin goes unlearned, and the table does not grow,
        // while every margin already learned is still believed.
        assert!(!seen.margin(&key("one-more"), limit, 10, &full));
        assert_eq!(seen.shown.lock().unwrap().len(), SEEN_KEYS);
        tokio::time::advance(Duration::from_millis(500)).await;
        assert!(seen.margin(&key("made-up-0"), limit, 10, &full));
        // Once the other margins are past belief, they make room for new ones; the one shown
        // again stays.
        tokio::time::advance(Duration::from_millis(501)).await;
        assert!(seen.margin(&key("one-more"), limit, 10, &full));
        assert_eq!(seen.shown.lock().unwrap().len(), 2);
    }

    #[test]
    fn a_vendors_field_is_read_and_following_can_be_off() {
        let mut f = Follow::default();
        f.names
            .insert(0, HeaderName::from_static("x-seller-quota-left"));
        assert_eq!(
            f.remaining(&headers(&[("x-seller-quota-left", "2")])),
            Some(2)
        );
        f.on = false;
        assert_eq!(f.remaining(&headers(&[("x-seller-quota-left", "2")])), None);
        assert_eq!(
            f.remaining(&headers(&[("x-ratelimit-remaining", "2")])),
            None
        );
    }
}
