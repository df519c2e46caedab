//! `RedisStore`'s `BucketStore` impl: each method one call of a script (or of a plain command)
//! on the bucket's key, with the deny cache in front of it and the outage policy behind it.

use std::future::Future;
use std::sync::PoisonError;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use redis::aio::ConnectionLike;

use super::deny_cache::{Check, CheckAll};
use super::script::Failure;
use super::wire::{Args, Op};
use super::{OutagePolicy, RedisStore};
use crate::clock::{Clock, deadline_ms, whole_ms};
use crate::store::{
    BucketState, BucketStore, Decision, Reservation, Source, StoreError, Take, check_cost,
    check_takes, check_tokens,
};
use crate::{BucketKey, Limit};

impl<C, K> BucketStore for RedisStore<C, K>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
    K: Clock,
{
    fn now(&self) -> SystemTime {
        self.clock.now()
    }

    async fn acquire(
        &self,
        key: &BucketKey,
        limit: Limit,
        cost: u32,
        max_wait: Duration,
    ) -> Result<Decision, StoreError> {
        let cost_f = check_cost(&limit, cost)?;
        if let Some(leases) = self.leases.as_ref().filter(|t| t.covers(key)) {
            if !max_wait.is_zero() {
                return Err(StoreError::NotLeasable);
            }
            // Past the most keys leased at once (a flood of made-up keys), a key is decided by
            // a plain call, refused if other processes lease it.
            if let Some(slot) = leases.slot(key) {
                return self.acquire_leased(leases, slot, key, limit, cost).await;
            }
        }
        let max_wait_ms = whole_ms(max_wait);
        let now = self.clock.now_ms();
        let mut predicted = None;
        // Drops the entry if this call goes away before Redis answers: it took the cost ahead of
        // Redis, which may never see the call.
        let mut charged = None;
        if let Some(cache) = &self.deny {
            match cache.check(key, limit, now, cost_f, max_wait_ms) {
                Check::Deny(outcome) => {
                    #[cfg(feature = "metrics")]
                    metrics::counter!(crate::metrics::DENY_CACHE_HITS, "store" => "redis")
                        .increment(1);
                    tokio::task::coop::consume_budget().await;
                    return Ok(Decision::new(outcome, limit, cost));
                }
                Check::Pass(prediction) => {
                    predicted = prediction;
                    charged = prediction.map(|_| cache.forget_on_drop(key));
                }
            }
        }
        let local = self.local_limit(limit);
        if local.is_some() {
            self.charge_for_local_admissions(key, limit, now).await;
        }
        let args = Args {
            op: Op::Acquire,
            limit,
            x: u64::from(cost),
            max_wait: max_wait_ms,
        };
        match self.run(key, now, args).await {
            Ok(reply) => {
                if let Some(local) = local {
                    // Redis decides: the local bucket is kept empty meanwhile, so that the next
                    // outage starts from nothing rather than from what refilled since the last.
                    // Only a bucket the local store holds is drained; one it does not hold
                    // starts the outage empty as of this answer (`last_answer`).
                    self.last_answer.fetch_max(now, Ordering::Relaxed);
                    self.local.drain_held(key, local, now);
                }
                if let Some(cache) = &self.deny {
                    match (reply.outcome.allowed, reply.state) {
                        (false, Some(state)) => cache.remember(key, limit, Some(state), now),
                        // What Redis holds, for an entry that charged this call: the cache then
                        // follows Redis from the first call it lets through, even when something
                        // raised the bucket there meanwhile (another process's refund, a flush).
                        (true, Some(state)) if predicted.is_some() => cache.refresh(key, state),
                        (true, None) if predicted.is_some_and(|p| p != reply.outcome) => {
                            cache.forget(key);
                        }
                        _ => {}
                    }
                }
                if let Some(charged) = charged {
                    charged.disarm();
                }
                Ok(Decision::new(reply.outcome, limit, cost))
            }
            Err(failure) => {
                // The cache may hold this call's cost taken; Redis may not have taken it.
                if let Some(cache) = &self.deny {
                    cache.forget(key);
                }
                match failure {
                    Failure::Fatal(e) => Err(e),
                    Failure::Outage(e) => {
                        self.acquire_in_outage(e, key, limit, cost, max_wait).await
                    }
                }
            }
        }
    }

    /// One script call on every bucket (`acquire_all.lua`), unless the deny cache refuses the
    /// request first: it answers when it holds every bucket's state and they refuse together,
    /// with the outcomes Redis would give on them (see [Deny cache](Self#deny-cache)).
    async fn acquire_all(
        &self,
        takes: &[Take<'_>],
        max_wait: Duration,
    ) -> Result<Vec<Decision>, StoreError> {
        check_takes(takes)?;
        if takes.is_empty() {
            return Ok(Vec::new());
        }
        if let Some(leases) = &self.leases
            && takes.iter().any(|t| leases.covers(t.key()))
        {
            return Err(StoreError::NotLeasable);
        }
        let now = self.clock.now_ms();
        let max_wait_ms = whole_ms(max_wait);
        // Drops the entries if this call goes away before Redis answers: they took the
        // request's parts ahead of Redis, which may never see the call.
        let mut charged = None;
        // An audited request asks Redis every time, so that its refusals are in the trail too.
        let audited = takes.iter().any(|t| t.audit().is_some());
        if let Some(cache) = self.deny.as_ref().filter(|_| !audited) {
            match cache.check_all(takes, now, max_wait_ms) {
                CheckAll::Deny(outcomes) => {
                    #[cfg(feature = "metrics")]
                    metrics::counter!(crate::metrics::DENY_CACHE_HITS, "store" => "redis")
                        .increment(1);
                    tokio::task::coop::consume_budget().await;
                    return Ok(outcomes
                        .into_iter()
                        .zip(takes)
                        .map(|(outcome, t)| Decision::new(outcome, t.limit(), t.cost()))
                        .collect());
                }
                CheckAll::Pass(true) => charged = Some(cache.forget_all_on_drop(takes)),
                CheckAll::Pass(false) => {}
            }
        }
        let local = matches!(self.policy, OutagePolicy::Local { .. });
        if local {
            for t in takes {
                self.charge_for_local_admissions(t.key(), t.limit(), now)
                    .await;
            }
        }
        match self.run_all(takes, now, max_wait_ms).await {
            Ok(each) => {
                if local {
                    self.last_answer.fetch_max(now, Ordering::Relaxed);
                    for t in takes {
                        if let Some(share) = self.local_limit(t.limit()) {
                            self.local.drain_held(t.key(), share, now);
                        }
                    }
                }
                if let Some(cache) = &self.deny {
                    for (e, t) in each.iter().zip(takes) {
                        match (e.outcome.allowed, e.state) {
                            // Every bucket's state, the ones that refused and the others: the
                            // next refusal of the same request is answered here in full.
                            (false, state) => cache.remember(t.key(), t.limit(), state, now),
                            // What Redis stored, for an entry this call charged or one it found
                            // (a bucket of another request's denial): it follows Redis.
                            (true, Some(state)) => cache.refresh(t.key(), state),
                            (true, None) => cache.forget(t.key()),
                        }
                    }
                }
                if let Some(charged) = charged {
                    charged.disarm();
                }
                Ok(each
                    .into_iter()
                    .zip(takes)
                    .map(|(e, t)| Decision::new(e.outcome, t.limit(), t.cost()))
                    .collect())
            }
            Err(failure) => {
                // The cache may hold the request's parts taken; Redis may not have taken them.
                if let Some(cache) = &self.deny {
                    for t in takes {
                        cache.forget(t.key());
                    }
                }
                if let Some(charged) = charged {
                    charged.disarm();
                }
                match failure {
                    Failure::Fatal(e) => Err(e),
                    Failure::Outage(e) => self.acquire_all_in_outage(e, takes, max_wait).await,
                }
            }
        }
    }

    async fn peek(&self, key: &BucketKey, limit: Limit) -> Result<BucketState, StoreError> {
        let args = Args {
            op: Op::Peek,
            limit,
            x: 0,
            max_wait: 0,
        };
        let now = self.clock.now_ms();
        match self.run(key, now, args).await {
            Ok(reply) => Ok(BucketState::new(reply.outcome, limit).with_halt(reply.halt)),
            // Tokens of it are out on lease: the lease script says what the bucket holds
            // beside them.
            Err(Failure::Fatal(StoreError::Leased { .. })) => {
                match self.run_lease_peek(key, now, limit).await {
                    Ok((outcome, _)) => Ok(BucketState::new(outcome, limit)),
                    Err(Failure::Fatal(e) | Failure::Outage(e)) => Err(e),
                }
            }
            Err(Failure::Fatal(e)) => Err(e),
            Err(Failure::Outage(e)) => match self.local_limit(limit) {
                Some(local) => {
                    let q = self.local.peek(key, local).await?;
                    Ok(BucketState {
                        burst: limit.burst(),
                        ..q
                    })
                }
                None => Err(e),
            },
        }
    }

    async fn refund(
        &self,
        key: &BucketKey,
        limit: Limit,
        reservation: Reservation,
    ) -> Result<(), StoreError> {
        let cost = reservation.cost();
        check_cost(&limit, cost)?;
        // Back to the bucket that gave the tokens, whichever answers now.
        match reservation.source() {
            Source::Nothing => return Ok(()),
            Source::Lease => {
                self.refund_leased(key, cost);
                return Ok(());
            }
            Source::Local => {
                return match self.local_limit(limit) {
                    Some(local) if cost <= local.burst() => {
                        self.local.refund(key, local, reservation).await
                    }
                    _ => Ok(()),
                };
            }
            Source::Store => {}
        }
        if let Some(cache) = &self.deny {
            cache.forget(key);
        }
        let args = Args {
            op: Op::Refund,
            limit,
            x: u64::from(cost),
            max_wait: reservation.ready_at_ms(),
        };
        match self.run(key, self.clock.now_ms(), args).await {
            Ok(_) => Ok(()),
            // Redis gave the tokens; a local bucket did not, and gets nothing.
            Err(Failure::Fatal(e) | Failure::Outage(e)) => Err(e),
        }
    }

    async fn drain_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> Result<(), StoreError> {
        if let Some(cache) = &self.deny {
            cache.forget(key);
        }
        let args = Args {
            op: Op::Drain,
            limit,
            x: deadline_ms(until),
            max_wait: 0,
        };
        match self.run(key, self.clock.now_ms(), args).await {
            Ok(_) => Ok(()),
            Err(Failure::Fatal(e)) => Err(e),
            Err(Failure::Outage(e)) => match self.local_limit(limit) {
                Some(local) => self.local.drain_until(key, local, until).await,
                None => Err(e),
            },
        }
    }

    async fn lower_to(
        &self,
        key: &BucketKey,
        limit: Limit,
        tokens: u32,
    ) -> Result<bool, StoreError> {
        // A bucket holds at most its burst: a report at or above it lowers nothing, and costs
        // no round trip.
        if tokens >= limit.burst() {
            return Ok(false);
        }
        let args = Args {
            op: Op::Lower,
            limit,
            x: u64::from(tokens),
            max_wait: 0,
        };
        // A denial cached here stays sound: lowering only makes the bucket's next token later.
        match self.run(key, self.clock.now_ms(), args).await {
            Ok(reply) => Ok(reply.outcome.allowed),
            Err(Failure::Fatal(e)) => Err(e),
            Err(Failure::Outage(e)) => match self.local_limit(limit) {
                Some(local) => self.local.lower_to(key, local, tokens).await,
                None => Err(e),
            },
        }
    }

    /// A `SET NX PX` of the mark's own key; whatever the outage policy, a call Redis did not
    /// answer is an error, since a mark kept anywhere else would be missing to other processes.
    async fn book(&self, key: &BucketKey, id: &str, until: SystemTime) -> Result<(), StoreError> {
        let now = self.clock.now_ms();
        let ttl = deadline_ms(until)
            .saturating_sub(now)
            .min(crate::bucket::MAX_WAIT);
        if ttl == 0 {
            return Ok(());
        }
        match self.book_mark(key, id, ttl).await {
            Ok(()) => Ok(()),
            Err(Failure::Fatal(e) | Failure::Outage(e)) => Err(e),
        }
    }

    /// The claim script on the mark's own key; whatever the outage policy, a call Redis did not
    /// answer is an error, since no local table can say whether another process spent it.
    async fn claim(&self, key: &BucketKey, id: &str) -> Result<crate::Claim, StoreError> {
        match self.claim_mark(key, id).await {
            Ok(found) => Ok(found),
            Err(Failure::Fatal(e) | Failure::Outage(e)) => Err(e),
        }
    }

    /// A `DEL` of the bucket's key, whatever it holds, through the same timeout, breaker and
    /// bound on calls in flight as every call; see [Admin operations](Self#admin-operations).
    async fn reset(&self, key: &BucketKey) -> Result<(), StoreError> {
        self.admin(key, self.delete(key)).await
    }

    async fn set(&self, key: &BucketKey, limit: Limit, tokens: u32) -> Result<(), StoreError> {
        check_tokens(&limit, tokens)?;
        let args = Args {
            op: Op::Set,
            limit,
            x: u64::from(tokens),
            max_wait: 0,
        };
        let now = self.clock.now_ms();
        self.admin(key, async { self.run(key, now, args).await.map(|_| ()) })
            .await
    }

    async fn block_until(
        &self,
        key: &BucketKey,
        limit: Limit,
        until: SystemTime,
    ) -> Result<(), StoreError> {
        let args = Args {
            op: Op::Block,
            limit,
            x: deadline_ms(until),
            max_wait: 0,
        };
        let now = self.clock.now_ms();
        self.admin(key, async { self.run(key, now, args).await.map(|_| ()) })
            .await
    }
}

impl<C, K> RedisStore<C, K>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
    K: Clock,
{
    /// Runs an admin operation on `key`'s bucket: what this process knows of the bucket is
    /// dropped before the call and again once Redis has answered, so that no denial cached here
    /// outlives the change. Whatever the outage policy, a call Redis did not answer is an error:
    /// the change is to the shared bucket, and a local bucket cannot stand in for it.
    async fn admin(
        &self,
        key: &BucketKey,
        call: impl Future<Output = Result<(), Failure>>,
    ) -> Result<(), StoreError> {
        if let Some(cache) = &self.deny {
            cache.forget(key);
        }
        let done = call.await;
        if let Some(cache) = &self.deny {
            cache.forget(key);
        }
        match done {
            Ok(()) => {
                // What this process admitted locally in an outage is charged to Redis before its
                // next decision there: the change replaces what that charge would take.
                self.touched
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(key.as_str());
                Ok(())
            }
            Err(Failure::Fatal(e) | Failure::Outage(e)) => Err(e),
        }
    }
}
