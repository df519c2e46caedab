//! Reading the upstream's answer: a 429 (or a 503 with a time to wait) with `X-Ratelimit-Retry`
//! or `Retry-After` drains the shared bucket, a report of fewer tokens left than the bucket
//! holds lowers it, other `4xx` answers may cost more, and a request that waited checks that no
//! drain passed its slot before it is sent.

use std::time::{Duration, SystemTime};

use http::StatusCode;
use reqwest::Response;

use super::cost::cost_count;
use super::follow::Sent;
use super::retry_after::upstream_retry;
use super::{RateLimitMiddleware, Time};
use crate::clock;
use crate::{BucketKey, BucketStore, Limit, Reservation};

impl<St: BucketStore + Clone, K: Time<St>> RateLimitMiddleware<St, K> {
    /// Whether a drain made while `reservation` waited ends past its slot (see
    /// [`BucketState::halts`](crate::BucketState::halts)): one more store call, made only by requests that
    /// waited. A store that cannot answer lets the request go, as it would have before the
    /// check: the reservation was granted.
    pub(super) async fn halted(
        &self,
        key: &BucketKey,
        limit: Limit,
        reservation: &Reservation,
    ) -> bool {
        match self.store.peek(key, limit).await {
            Ok(quota) => quota.halts(reservation),
            Err(e) => {
                tracing::warn!(
                    bucket = key.bucket(),
                    key = %key.fingerprint(),
                    error = %e,
                    "could not check for an upstream back-off before sending; sending"
                );
                false
            }
        }
    }

    /// How long until the halt of a drain made while `reservation` waited, when it ends past
    /// its slot; `None` when it does not, or when the store cannot answer (the turn was
    /// booked, and goes, as [`halted`](Self::halted) lets it).
    pub(super) async fn halted_for(
        &self,
        key: &BucketKey,
        limit: Limit,
        reservation: &Reservation,
    ) -> Option<Duration> {
        let quota = self.store.peek(key, limit).await.ok()?;
        if !quota.halts(reservation) {
            return None;
        }
        let until = quota.halted_until()?;
        Some(
            until
                .duration_since(self.now())
                .unwrap_or(Duration::ZERO)
                .max(Duration::from_millis(1)),
        )
    }

    /// What the upstream's answer asks of the shared bucket, if anything. `follow` says whether
    /// the upstream's report of what is left is this bucket's: of a request that draws from
    /// several, only the first route's bucket follows it (`docs/middleware.md`, "Several
    /// limits on one request"); a back-off and an error's cost apply to each.
    pub(super) fn feedback(
        &self,
        key: &BucketKey,
        limit: Limit,
        res: &Response,
        sent: &Sent,
        follow: bool,
    ) -> Option<Feedback> {
        let status = res.status();
        let told = match status {
            StatusCode::TOO_MANY_REQUESTS => Some(upstream_retry(res.headers(), self.now())),
            // A 503 is a back-off only when it says how long: without a time it is the
            // upstream failing, which a retry policy handles.
            StatusCode::SERVICE_UNAVAILABLE => upstream_retry(res.headers(), self.now()).map(Some),
            _ => None,
        };
        if let Some(told) = told {
            let retry = match told {
                Some(retry) if retry > self.config.max_backoff => {
                    tracing::warn!(
                        bucket = key.bucket(),
                        retry_s = retry.as_secs(),
                        max_s = self.config.max_backoff.as_secs(),
                        "upstream asked for a longer back-off than allowed; clamped"
                    );
                    self.config.max_backoff
                }
                Some(retry) => retry,
                None => token_period(limit),
            };
            // The bucket is empty at the deadline and refills from there, so drain until one
            // token period before the time the upstream gave: the first token is then ready at
            // that time, not a period later.
            // Past what `SystemTime` holds (a `max_backoff` of `Duration::MAX` and a huge
            // header), the latest time the arithmetic knows: the store clamps to it anyway.
            let until = clock::add_or_latest(self.now(), retry);
            let until = until.checked_sub(token_period(limit)).unwrap_or(until);
            return Some(Feedback::Drain { until, retry });
        }
        if let Some(left) = self
            .config
            .follow
            .remaining(res.headers())
            .filter(|_| follow)
        {
            // Nothing left at the bucket's pace (the request went at a reserved slot), from an
            // upstream that has shown a margin over the bucket lately: someone else took the
            // margin. A count cannot go below zero, and the bucket, in debt while requests
            // queue, holds less than any report, so lowering would change nothing, and the
            // other consumer's next spend would earn a 429. So the same drain as after a 429
            // that gives no time, for one token period from now: the reservation whose slot
            // falls within it queues again, and the margin is back. Where the upstream has
            // shown no margin, nothing left is the usual state of a bucket spent at its pace,
            // and says nothing.
            let margin = self.seen.margin(key, limit, left, sent);
            if left == 0 && sent.queued && margin {
                return Some(Feedback::Drain {
                    until: self.now(),
                    retry: Duration::ZERO,
                });
            }
            // Fewer than the bucket held once this request took its own: someone else spent
            // them, and the bucket comes down. The count already holds what an error cost the
            // upstream. Otherwise it says nothing the bucket did not know, and costs no call.
            if left < sent.expected {
                return Some(Feedback::Lower { tokens: left });
            }
        }
        let extra = self.config.error_cost.saturating_sub(sent.cost);
        if status.is_client_error() && extra > 0 && !sent.settled {
            return Some(Feedback::Charge {
                extra: self.owed(key, limit, extra),
            });
        }
        None
    }

    /// `extra` tokens owed, at most what refills within [`max_backoff`], and at most
    /// [`MOST_CHARGES`] bursts: a faulty or hostile upstream's cost of four billion would
    /// otherwise block the bucket for centuries, and take as many store calls to write, one per
    /// burst, while the caller waits for its answer.
    ///
    /// [`max_backoff`]: RateLimitMiddleware::max_backoff
    fn owed(&self, key: &BucketKey, limit: Limit, extra: u32) -> u32 {
        let refilled =
            u128::from(u64::try_from(self.config.max_backoff.as_millis()).unwrap_or(u64::MAX))
                * u128::from(limit.tokens())
                / u128::from(limit.interval_ms());
        let most = refilled
            .min(u128::from(limit.burst()) * u128::from(MOST_CHARGES))
            .max(1);
        let most = u32::try_from(most).unwrap_or(u32::MAX);
        if extra > most {
            tracing::warn!(
                bucket = key.bucket(),
                extra,
                most,
                "a call owes more tokens than refill within max_backoff, or than 64 bursts; clamped"
            );
        }
        extra.min(most)
    }

    /// What settles the call's cost with the `taken` tokens of its reservation, when the
    /// answer's [`cost_header`](RateLimitMiddleware::cost_header) says what it cost.
    pub(super) fn settlement(
        &self,
        key: &BucketKey,
        limit: Limit,
        res: &Response,
        taken: Reservation,
    ) -> Option<Feedback> {
        let name = self.config.cost_header.as_ref()?;
        let cost = res
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(cost_count);
        let Some(cost) = cost else {
            if res.headers().contains_key(name) {
                tracing::debug!(header = %name, "ignoring an unusable cost");
            }
            return None;
        };
        let cost = u32::try_from(cost).unwrap_or(u32::MAX);
        match cost.cmp(&taken.cost()) {
            std::cmp::Ordering::Greater => Some(Feedback::Charge {
                extra: self.owed(key, limit, cost - taken.cost()),
            }),
            std::cmp::Ordering::Less => Some(Feedback::Refund {
                reservation: taken.with_cost(taken.cost() - cost),
            }),
            std::cmp::Ordering::Equal => None,
        }
    }
}

/// The most store calls a charge makes, one per burst owed.
const MOST_CHARGES: u32 = 64;

/// A change the upstream's answer asks of the shared bucket.
pub(super) enum Feedback {
    /// A 429, a 503 with a time, or a report of nothing left: every worker backs off until
    /// `until`.
    Drain { until: SystemTime, retry: Duration },
    /// The upstream has `tokens` left, fewer than the bucket can hold.
    Lower { tokens: u32 },
    /// Another 4xx, under `error_cost`, or a call that cost more than it took: `extra` more
    /// tokens are owed.
    Charge { extra: u32 },
    /// A call that cost less than it took: part of its reservation goes back.
    Refund { reservation: Reservation },
}

impl Feedback {
    /// Writes the change to the store, on a task of its own: a caller that goes away once the
    /// answer is in (a timeout around the request, a cancelled job) must not take the other
    /// workers' back-off with it. Returns when the store has answered: whether it made the
    /// change (a lowering makes none when the bucket held no more).
    pub(super) async fn apply<St: BucketStore + Clone>(
        self,
        store: &St,
        key: &BucketKey,
        limit: Limit,
    ) -> bool {
        let (store, key) = (store.clone(), key.clone());
        let task = tokio::spawn(async move { self.write(&store, &key, limit).await });
        // The task only logs; an error here is a panic in the store, already reported by tokio.
        task.await.unwrap_or(false)
    }

    async fn write<St: BucketStore>(self, store: &St, key: &BucketKey, limit: Limit) -> bool {
        match self {
            Self::Drain { until, retry } => {
                tracing::debug!(
                    bucket = key.bucket(),
                    key = %key.fingerprint(),
                    retry_ms = retry.as_millis() as u64,
                    "upstream back-off: draining the shared bucket"
                );
                if let Err(e) = store.drain_until(key, limit, until).await {
                    tracing::warn!(bucket = key.bucket(), error = %e, "could not drain after a 429");
                    return false;
                }
                true
            }
            Self::Lower { tokens } => match store.lower_to(key, limit, tokens).await {
                Ok(true) => {
                    tracing::debug!(
                        bucket = key.bucket(),
                        key = %key.fingerprint(),
                        tokens,
                        "the upstream has fewer tokens left: lowered the shared bucket"
                    );
                    true
                }
                Ok(false) => false,
                Err(e) => {
                    tracing::warn!(bucket = key.bucket(), error = %e, "could not lower to the upstream's count");
                    false
                }
            },
            Self::Refund { reservation } => {
                if let Err(e) = store.refund(key, limit, reservation).await {
                    tracing::warn!(bucket = key.bucket(), error = %e, "could not give back what a call did not cost");
                    return false;
                }
                true
            }
            Self::Charge { mut extra } => {
                while extra > 0 {
                    let take = extra.min(limit.burst());
                    // A reservation with no ceiling: the tokens are owed, and later requests
                    // wait them off.
                    let owed = store.acquire(key, limit, take, Duration::MAX).await;
                    match owed {
                        Ok(d) if d.is_admitted() => {}
                        // Owed past the longest reservation: the bucket is blocked as far as
                        // the arithmetic goes already.
                        Ok(_) => break,
                        Err(e) => {
                            tracing::warn!(bucket = key.bucket(), error = %e, "could not charge what a call owes");
                            return false;
                        }
                    }
                    extra -= take;
                }
                true
            }
        }
    }
}

/// The time of one token: `interval / tokens`, rounded down to whole milliseconds.
fn token_period(limit: Limit) -> Duration {
    Duration::from_millis(limit.interval_ms() / u64::from(limit.tokens()))
}

#[cfg(test)]
mod tests {
    use http::{HeaderMap, StatusCode};
    use proptest::prelude::*;

    use super::*;
    use crate::middleware::follow;
    use crate::middleware::fuzz::{NOW_MS, at, fuzz_config, header_text};
    use crate::{ManualClock, MemoryStore};

    #[test]
    fn an_unbounded_max_backoff_and_a_huge_header_drain_without_overflow() {
        let clock = ManualClock::new(NOW_MS);
        let store = MemoryStore::new().with_clock(clock.clone());
        let middleware = RateLimitMiddleware::new(store.clone())
            .with_clock(clock)
            .max_backoff(Duration::MAX);
        let limit = Limit::per_second(1).expect("a valid limit");
        let key = BucketKey::new("api", "huge").expect("a valid key");
        let mut answer = http::Response::new(Vec::<u8>::new());
        *answer.status_mut() = StatusCode::TOO_MANY_REQUESTS;
        answer.headers_mut().insert(
            "retry-after",
            http::HeaderValue::from_static("99999999999999999999999"),
        );
        let answer = Response::from(answer);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        let quota = runtime
            .block_on(async {
                if let Some(feedback) = middleware.feedback(&key, limit, &answer, &unqueued(), true)
                {
                    feedback.apply(&store, &key, limit).await;
                }
                store.peek(&key, limit).await
            })
            .expect("peek");
        assert_eq!(quota.remaining(), 0);
        // Drained for the longest the arithmetic takes, 2^44 ms (about 557 years).
        let end = Duration::from_millis(crate::bucket::MAX_WAIT);
        assert!(quota.next_token_in() >= end - Duration::from_secs(1));
    }

    /// How a request that went at once, as the only one, went out.
    fn unqueued() -> follow::Sent {
        follow::Sent {
            expected: 0,
            queued: false,
            cost: 1,
            settled: false,
            rtt: Duration::ZERO,
        }
    }

    proptest! {
        #![proptest_config(fuzz_config())]

        /// Any header bytes, under either name, through what the middleware does with an upstream
        /// 429: never a panic, and the shared bucket is drained for the header's delay clamped to
        /// `max_backoff`, or for one token period when the header is unusable.
        #[test]
        fn a_429_drains_for_at_most_max_backoff_whatever_its_headers(
            x_ratelimit_retry in proptest::option::of(prop_oneof![
                header_text().prop_map(String::into_bytes),
                proptest::collection::vec(any::<u8>(), 0..40),
            ]),
            retry_after in proptest::option::of(prop_oneof![
                header_text().prop_map(String::into_bytes),
                proptest::collection::vec(any::<u8>(), 0..40),
            ]),
            max_backoff_s in prop_oneof![Just(0u64), 0..=86_400u64, Just(100 * 365 * 86_400)],
        ) {
            let mut headers = HeaderMap::new();
            let named = [("x-ratelimit-retry", &x_ratelimit_retry), ("retry-after", &retry_after)];
            for (name, value) in named {
                // A value http would not carry (a control byte) cannot reach the middleware.
                let value = value.as_deref().and_then(|v| http::HeaderValue::from_bytes(v).ok());
                if let Some(v) = value {
                    headers.insert(name, v);
                }
            }
            let clock = ManualClock::new(NOW_MS);
            let store = MemoryStore::new().with_clock(clock.clone());
            let max_backoff = Duration::from_secs(max_backoff_s);
            let middleware = RateLimitMiddleware::new(store.clone())
                .with_clock(clock)
                .max_backoff(max_backoff);
            // One token a second, so a token period is a whole second.
            let limit = Limit::per_second(1).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let key = BucketKey::new("api", "fuzz")
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let mut answer = http::Response::new(Vec::<u8>::new());
            *answer.status_mut() = StatusCode::TOO_MANY_REQUESTS;
            *answer.headers_mut() = headers.clone();
            let answer = Response::from(answer);

            let runtime = tokio::runtime::Builder::new_current_thread()
                .build()
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let quota = runtime.block_on(async {
                let feedback = middleware.feedback(&key, limit, &answer, &unqueued(), true);
                if let Some(feedback) = feedback {
                    feedback.apply(&store, &key, limit).await;
                }
                store.peek(&key, limit).await
            });
            let quota = quota.map_err(|e| TestCaseError::fail(e.to_string()))?;

            let period = Duration::from_secs(1);
            let told = upstream_retry(&headers, at(NOW_MS / 1_000));
            let expected = told.map_or(period, |d| d.min(max_backoff).max(period));
            prop_assert_eq!(quota.remaining(), 0);
            prop_assert_eq!(quota.next_token_in(), expected, "told {:?}", told);
            prop_assert!(quota.next_token_in() <= max_backoff.max(period));
        }
    }
}
