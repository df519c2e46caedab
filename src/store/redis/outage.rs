//! What a [`RedisStore`](super::RedisStore) does when Redis does not answer: the policy, and what
//! each policy answers. The circuit breaker that lets it answer at once while Redis is down is in
//! `breaker.rs`.

use std::sync::PoisonError;
use std::sync::atomic::Ordering;
use std::time::Duration;

use redis::aio::ConnectionLike;

use super::RedisStore;
use super::wire::{Args, Op};
use crate::bucket::{self, Verdict};
use crate::clock::Clock;
use crate::store::{BucketStore, Decision, Reservation, Source, StoreError, Take};
use crate::store::{OutagePolicy, share};
use crate::{BucketKey, Limit};

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
    fn open_outcome(&self) -> Verdict {
        Verdict {
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
