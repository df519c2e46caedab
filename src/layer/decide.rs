// Over 600 lines: one idea, the rule loop, with the verdict and the reports it makes.
//! The rule loop: takes (or reserves) the tokens of the rules that apply, and reports the shadow
//! rules' decisions. One enforcing rule decides alone; two or more decide at once, in one store
//! call that takes from all of them or from none ([`BucketStore::acquire_all`]). Its
//! [`Verdict`] is what the response future acts on.

use std::mem;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use tracing::Level;

use super::config::Config;
use super::headers::{self, Item};
use super::info::RateLimitInfo;
use super::observe::{DecisionEvent, Outcome};
use super::rejection::{self, Protocol};
use crate::cancel::RefundGuard;
use crate::store::{is_outage, share};
use crate::{BucketKey, BucketStore, Decision, Limit, OutagePolicy, RateLimited, StoreError, Take};

/// A list kept inline while it holds one item. Most requests meet one rule or two, and a `Vec`
/// for the single one would be an allocation per request.
#[derive(Default)]
pub(crate) enum Few<T> {
    #[default]
    Empty,
    One(T),
    Many(Vec<T>),
}

impl<T> Few<T> {
    #[inline]
    pub(crate) fn push(&mut self, item: T) {
        // The usual case written in place: going through `mem::take` would move the list (a
        // decision is large) twice.
        if let Self::Empty = self {
            *self = Self::One(item);
            return;
        }
        self.push_more(item);
    }

    /// A second item or more, into a `Vec`: apart, so that the usual case stays small enough
    /// to inline.
    fn push_more(&mut self, item: T) {
        *self = match mem::take(self) {
            Self::Empty => Self::One(item),
            Self::One(first) => Self::Many(vec![first, item]),
            Self::Many(mut all) => {
                all.push(item);
                Self::Many(all)
            }
        };
    }

    fn as_slice(&self) -> &[T] {
        match self {
            Self::Empty => &[],
            Self::One(item) => std::slice::from_ref(item),
            Self::Many(all) => all,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }
}

/// One rule that applies to a request: its bucket, and the request's cost and limit there.
pub(crate) struct RuleTake {
    pub(crate) rule: usize,
    pub(crate) key: BucketKey,
    pub(crate) cost: u32,
    pub(crate) limit: Limit,
}

/// A rule's decision on a request that is going on: admitted, or refused by a rule in shadow
/// mode, whose refusal lets the request through. The request's plan keeps the key, cost and
/// limit, so that the rule loop's future, boxed for every request, holds no copy of them.
struct Taken {
    /// The rule's place in the plan.
    planned: usize,
    decision: Decision,
}

/// What the rules decided for one request.
pub(crate) enum Verdict<St: BucketStore + Clone> {
    /// Go, after `wait`. The guard gives the tokens back if the request is dropped before then.
    Admit {
        wait: Duration,
        /// `None` when no tokens need guarding: the request goes at once.
        guard: Option<RefundGuard<St>>,
        /// The rate-limit fields for the response.
        ratelimit: Option<headers::Fields>,
        /// For the request's extensions; `None` when no rule decided.
        info: Option<RateLimitInfo>,
    },
    /// Answered without calling the inner service: a rule refused (the rejection), or the store
    /// could not decide (503, or 500 for a misconfigured rule). Either way everything taken by
    /// earlier rules has been given back, and the response future returns the refusal's answer.
    Reject(Refusal<St>),
}

/// A refused request, to be answered in the terms of its protocol ([`answer`](Self::answer)):
/// the response future looks the protocol up in the request's headers, which an admitted
/// request is spared.
pub(crate) struct Refusal<St> {
    config: Arc<Config<St>>,
    why: Why,
}

enum Why {
    /// Rule number `rule` refused, with `limit`; `remaining` tokens are left, and the request
    /// could go in `retry`.
    Limited {
        rule: usize,
        limit: Limit,
        remaining: u32,
        retry: Duration,
        fields: Option<headers::Fields>,
    },
    /// The store could not decide.
    Failed(StoreError),
}

impl<St> Refusal<St> {
    /// The answer, for a request that speaks `protocol`.
    pub(crate) fn answer(self, protocol: Protocol) -> Response<Bytes> {
        match self.why {
            Why::Limited {
                rule,
                limit,
                remaining,
                retry,
                fields,
            } => {
                let name = self.config.rules[rule].bucket();
                let limited = || RateLimited::new(retry, limit, name, remaining);
                self.config
                    .rejection
                    .respond(protocol, retry, name, limited, fields)
            }
            Why::Failed(e) => rejection::store_failure(protocol, &e),
        }
    }
}

/// Checks every rule in order, taking (or reserving) tokens as it goes. When a rule refuses,
/// the tokens taken by the rules before it are given back before answering, so a refused request
/// spends nothing. A rule in shadow mode decides without waiting, and its refusal (or its store's
/// failure) is reported, never acted on.
///
/// An `async` block rather than an `async fn`, whose future would hold a second copy of its
/// arguments: this future is built and boxed for every request.
#[allow(clippy::manual_async_fn)] // see above
pub(crate) fn decide<St: BucketStore + Clone>(
    config: Arc<Config<St>>,
    plan: Few<RuleTake>,
) -> impl Future<Output = Verdict<St>> + Send {
    async move {
        // Asked only of a plan of several rules, so that one rule's request pays nothing for it.
        if let Few::Many(all) = &plan
            && all
                .iter()
                .filter(|p| !(config.shadow || config.rules[p.rule].shadow))
                .count()
                > 1
        {
            // Boxed: the common request meets one rule, and its future stays this small.
            if let Some(verdict) = Box::pin(together(&config, all)).await {
                return match verdict {
                    Verdict::Reject(Refusal {
                        config,
                        why: Why::Failed(e),
                    }) => Box::pin(on_outage(config, all, e)).await,
                    verdict => verdict,
                };
            }
        }
        // Made on the first tokens it must hold, so that a request that goes at once on one
        // rule never clones the store for it.
        let mut guard: Option<RefundGuard<St>> = None;
        let mut taken: Few<Taken> = Few::default();
        let mut wait = Duration::ZERO;
        let plan = plan.as_slice();
        // A block, so that the refusal is not held across the store calls.
        let refused = 'rules: {
            for (n, p) in plan.iter().enumerate() {
                let rule = &config.rules[p.rule];
                let shadow = config.shadow || rule.shadow;
                // A shadow rule only reports: making a request wait would be acting on it.
                let max_wait = if shadow {
                    Duration::ZERO
                } else {
                    config.max_wait
                };
                let result = match &rule.audit {
                    None => {
                        config
                            .store
                            .acquire(&p.key, p.limit, p.cost, max_wait)
                            .await
                    }
                    // Boxed: an audited rule is the rare one.
                    Some(audit) => Box::pin(audited(&config.store, p, audit, max_wait)).await,
                };
                match result {
                    Ok(d) if d.is_admitted() => {
                        tracing::debug!(
                            bucket = rule.bucket(),
                            key = %p.key.fingerprint(),
                            remaining = d.remaining(),
                            wait_ms = d.wait().as_millis() as u64,
                            "admitted"
                        );
                        wait = wait.max(d.wait());
                        // The guard must hold these tokens across every later await: the next
                        // rule's store call, or the wait. Tokens of the last rule taken for a
                        // request that goes at once are spent before anything else runs, so they
                        // need no guard (and the guard no allocation).
                        if let Some(reservation) = d.reservation()
                            && (n + 1 < plan.len() || !wait.is_zero())
                        {
                            guard
                                .get_or_insert_with(|| {
                                    RefundGuard::new(config.store.clone(), &config.abandoned)
                                })
                                .push(p.key.clone(), p.limit, reservation);
                        }
                        taken.push(Taken {
                            planned: n,
                            decision: d,
                        });
                    }
                    Ok(d) if shadow => taken.push(Taken {
                        planned: n,
                        decision: d,
                    }),
                    Err(e) if shadow => observe_failure(&config, p, &e),
                    outcome => break 'rules Some((p, outcome)),
                }
            }
            None
        };
        let Some((p, outcome)) = refused else {
            return admit(&config, plan, taken.as_slice(), wait, guard);
        };
        if let Some(guard) = &mut guard {
            // Boxed: only a refusal after earlier rules took tokens gets here, and the store's
            // refund future held inline would make every request's future larger.
            Box::pin(guard.refund_all()).await;
        }
        match refuse(&config, plan, taken.as_slice(), p, outcome) {
            // Boxed, as the refund above: only a store's failure gets here.
            Why::Failed(e) => Box::pin(on_outage(config, plan, e)).await,
            why => Verdict::Reject(Refusal { config, why }),
        }
    }
}

/// The verdict when the store failed with `e`, after everything taken was given back: the
/// layer's [`OutagePolicy`]'s answer when `e` is an outage, else the failure (a 503, or a 500 for
/// a misconfigured rule).
///
/// Under [`OutagePolicy::Local`], every enforcing rule decides on the layer's fallback buckets,
/// in this process, all at once (or none), with its share of its limit and without waiting; a
/// shadow rule is not asked. A rule whose share holds no token, or fallback buckets that cannot
/// decide, leave the failure as it was.
async fn on_outage<St: BucketStore + Clone>(
    config: Arc<Config<St>>,
    plan: &[RuleTake],
    e: StoreError,
) -> Verdict<St> {
    let failed = |config, e| {
        Verdict::Reject(Refusal {
            config,
            why: Why::Failed(e),
        })
    };
    if !is_outage(&e) {
        return failed(config, e);
    }
    let processes = match config.outage {
        OutagePolicy::Local { processes } => processes,
        OutagePolicy::FailOpen => {
            tracing::debug!("rate limit store failed: admitted under FailOpen");
            return Verdict::Admit {
                wait: Duration::ZERO,
                guard: None,
                ratelimit: None,
                info: None,
            };
        }
        _ => return failed(config, e),
    };
    let enforcing: Vec<usize> = (0..plan.len())
        .filter(|&n| !(config.shadow || config.rules[plan[n].rule].shadow))
        .collect();
    let mut takes = Vec::with_capacity(enforcing.len());
    for &n in &enforcing {
        let Some(limit) = share(plan[n].limit, processes) else {
            return failed(config, e);
        };
        takes.push(Take::new(&plan[n].key, limit, plan[n].cost));
    }
    let decisions = match config.fallback.acquire_all(&takes, Duration::ZERO).await {
        Ok(decisions) if decisions.len() == enforcing.len() => decisions,
        _ => return failed(config, e),
    };
    drop(takes);
    tracing::debug!(
        rules = enforcing.len(),
        "rate limit store failed: decided in this process"
    );
    let taken: Vec<Taken> = enforcing
        .into_iter()
        .zip(decisions)
        .map(|(planned, decision)| Taken { planned, decision })
        .collect();
    if taken.iter().all(|t| t.decision.is_admitted()) {
        return admit(&config, plan, &taken, Duration::ZERO, None);
    }
    let why = refused_together(&config, plan, taken);
    Verdict::Reject(Refusal { config, why })
}

/// Two enforcing rules or more: their tokens taken by one store call, from every rule's bucket
/// or from none, the request going at the latest of their times, each bucket's slot taken at
/// that time ([`BucketStore::acquire_all`]); then each shadow rule decides on its own, without
/// waiting, as in the loop. A refusal takes nothing, so nothing is given back, and nobody else
/// sees the other rules' tokens gone meanwhile; nor can a rule's wait release requests that
/// another spaced out, together, faster than its limit. `None` when one call cannot take them
/// (a Redis Cluster holds their keys in different slots, two rules share a bucket, or there are
/// more than one call takes): the caller then takes them in turn. A request waits at most two
/// token periods of its fastest rule: longer, it would hold that rule's tokens from everyone.
async fn together<St: BucketStore + Clone>(
    config: &Arc<Config<St>>,
    plan: &[RuleTake],
) -> Option<Verdict<St>> {
    let shadow = |p: &RuleTake| config.shadow || config.rules[p.rule].shadow;
    let enforcing: Vec<usize> = (0..plan.len()).filter(|&n| !shadow(&plan[n])).collect();
    // Keys of different callers sit in different slots of a Cluster that has said so once.
    let first = plan[enforcing[0]].key.caller();
    if config.apart.load(Ordering::Relaxed)
        && enforcing.iter().any(|&n| plan[n].key.caller() != first)
    {
        return None;
    }
    let takes: Vec<Take<'_>> = enforcing
        .iter()
        .map(|&n| {
            let take = Take::new(&plan[n].key, plan[n].limit, plan[n].cost);
            match &config.rules[plan[n].rule].audit {
                Some(audit) => take.audited(audit),
                None => take,
            }
        })
        .collect();
    // A request that waits holds every one of its buckets' tokens for its slot, so that each
    // bucket's other requests queue behind it: one client deep in its own rule's queue would
    // hold a global rule's tokens for everyone. The wait is kept within two token periods of
    // every rule that applies.
    let max_wait = enforcing
        .iter()
        .map(|&n| plan[n].limit.default_max_wait(plan[n].cost))
        .fold(config.max_wait, Duration::min);
    let decided = config.store.acquire_all(&takes, max_wait).await;
    let failed = |e: StoreError| {
        // One request, one failure: counted once, on the first rule that enforces.
        observe_failure(config, &plan[enforcing[0]], &e);
        Some(Verdict::Reject(Refusal {
            config: Arc::clone(config),
            why: Why::Failed(e),
        }))
    };
    let decisions = match decided {
        Ok(decisions) if decisions.len() == enforcing.len() => decisions,
        Ok(_) => {
            return failed(StoreError::Backend(crate::error::BackendError::new(
                "the store answered a request on several buckets with another number of decisions",
                None,
            )));
        }
        Err(StoreError::CrossSlot) => {
            // A Redis Cluster holds these rules' keys in different slots, where no one call
            // takes them all: the rules go in turn, as one rule each, with a refund on refusal.
            if !config.apart.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "rate limit rules that apply together live in different Redis Cluster \
                     slots: taking them in turn, not at once (docs: the layer, \"Several rules\")"
                );
            }
            return None;
        }
        // Two rules of one bucket, or more rules than one call takes: in turn, as before.
        Err(StoreError::SameBucketTwice { .. } | StoreError::TooManyAtOnce { .. }) => return None,
        Err(e) => return failed(e),
    };
    let mut taken: Vec<Taken> = enforcing
        .iter()
        .zip(decisions)
        .map(|(&planned, decision)| Taken { planned, decision })
        .collect();
    if !taken[0].decision.is_admitted() {
        let why = refused_together(config, plan, taken);
        return Some(Verdict::Reject(Refusal {
            config: Arc::clone(config),
            why,
        }));
    }
    let wait = taken[0].decision.wait();
    let shadows = plan.len() - enforcing.len();
    let mut guard: Option<RefundGuard<St>> = None;
    for t in &taken {
        let p = &plan[t.planned];
        tracing::debug!(
            bucket = config.rules[p.rule].bucket(),
            key = %p.key.fingerprint(),
            remaining = t.decision.remaining(),
            wait_ms = wait.as_millis() as u64,
            "admitted"
        );
        // Held across the wait and the shadow rules' store calls, as in the loop.
        if let Some(reservation) = t.decision.reservation()
            && (shadows > 0 || !wait.is_zero())
        {
            guard
                .get_or_insert_with(|| RefundGuard::new(config.store.clone(), &config.abandoned))
                .push(p.key.clone(), p.limit, reservation);
        }
    }
    for (n, p) in plan.iter().enumerate().filter(|(_, p)| shadow(p)) {
        let decided = match &config.rules[p.rule].audit {
            None => {
                config
                    .store
                    .acquire(&p.key, p.limit, p.cost, Duration::ZERO)
                    .await
            }
            Some(audit) => audited(&config.store, p, audit, Duration::ZERO).await,
        };
        match decided {
            Ok(decision) => {
                if let Some(reservation) = decision.reservation()
                    && (n + 1 < plan.len() || !wait.is_zero())
                {
                    guard
                        .get_or_insert_with(|| {
                            RefundGuard::new(config.store.clone(), &config.abandoned)
                        })
                        .push(p.key.clone(), p.limit, reservation);
                }
                taken.push(Taken {
                    planned: n,
                    decision,
                });
            }
            Err(e) => observe_failure(config, p, &e),
        }
    }
    taken.sort_by_key(|t| t.planned);
    Some(admit(config, plan, &taken, wait, guard))
}

/// Why rules decided at once refused a request: the rule whose time is furthest off refused
/// (the first of equal ones), reported; the others are reported with what they hold, untouched.
fn refused_together<St>(config: &Config<St>, plan: &[RuleTake], mut taken: Vec<Taken>) -> Why {
    let refusing = (0..taken.len())
        .rev()
        .max_by_key(|&k| taken[k].decision.retry_after())
        .unwrap_or(0);
    let refused = taken.remove(refusing);
    let p = &plan[refused.planned];
    observe(config, p, Outcome::Limited, &refused.decision);
    reject(config, plan, &taken, p, &refused.decision)
}

/// One rule's decision through the several-bucket call, which appends it to the rule's trail.
async fn audited<St: BucketStore>(
    store: &St,
    p: &RuleTake,
    audit: &crate::Audit,
    max_wait: Duration,
) -> Result<Decision, StoreError> {
    let take = Take::new(&p.key, p.limit, p.cost).audited(audit);
    store
        .acquire_all(&[take], max_wait)
        .await?
        .pop()
        .ok_or_else(|| {
            StoreError::Backend(crate::error::BackendError::new(
                "the store answered a request on one bucket with no decision",
                None,
            ))
        })
}

/// The verdict on a request every rule admitted (or a shadow rule would have refused): each
/// decision reported, and the fields and the info made.
fn admit<St: BucketStore + Clone>(
    config: &Config<St>,
    plan: &[RuleTake],
    applied: &[Taken],
    wait: Duration,
    guard: Option<RefundGuard<St>>,
) -> Verdict<St> {
    let planned = |t: &Taken| &plan[t.planned];
    for t in applied {
        let outcome = if t.decision.is_admitted() {
            Outcome::Admitted
        } else {
            Outcome::ShadowLimited
        };
        observe(config, planned(t), outcome, &t.decision);
    }
    let ratelimit = if config.headers_on_success {
        headers::fields(
            config.fields,
            || {
                policy(
                    config,
                    applied.iter().map(|t| (planned(t).rule, planned(t).limit)),
                )
            },
            applied.iter().map(|t| {
                let item = Item::admitted(config.rules[planned(t).rule].bucket(), &t.decision);
                partitioned(config, item, &planned(t).key)
            }),
        )
    } else {
        None
    };
    Verdict::Admit {
        wait,
        guard,
        ratelimit,
        info: info(config, plan, applied),
    }
}

/// Why rule `p` refused (or its store failed), after the rules in `applied` took their tokens
/// and gave them back; the refusal reported. Inline in the rule loop, its one caller, as the
/// compiler left it before `observe` was inlined into it: a call would copy the outcome.
#[inline]
fn refuse<St>(
    config: &Config<St>,
    plan: &[RuleTake],
    applied: &[Taken],
    p: &RuleTake,
    outcome: Result<Decision, StoreError>,
) -> Why {
    match outcome {
        Ok(d) => {
            observe(config, p, Outcome::Limited, &d);
            reject(config, plan, applied, p, &d)
        }
        Err(e) => {
            observe_failure(config, p, &e);
            Why::Failed(e)
        }
    }
}

/// The tightest rule's decision, for the handler; `None` when no rule decided (a shadow rule
/// whose store failed).
fn info<St>(config: &Config<St>, plan: &[RuleTake], applied: &[Taken]) -> Option<RateLimitInfo> {
    let t = applied.iter().min_by_key(|t| t.decision.remaining())?;
    let p = &plan[t.planned];
    Some(RateLimitInfo {
        rule: config.rules[p.rule].bucket_name().clone(),
        limit: p.limit,
        remaining: t.decision.remaining(),
        resets_in: t.decision.resets_in(),
        shadow_limited: applied.iter().any(|t| !t.decision.is_admitted()),
    })
}

/// `RateLimit-Policy` for the rules numbered in `applied`, each with the limit it applied.
#[inline]
fn policy<St>(
    config: &Config<St>,
    applied: impl Iterator<Item = (usize, Limit)> + Clone,
) -> Option<http::HeaderValue> {
    headers::policy_for(
        config.policy_all.as_ref(),
        config.rules.len(),
        config.any_dynamic,
        applied.map(|(i, limit)| {
            let rule = &config.rules[i];
            headers::Applied {
                item: &rule.policy,
                name: rule.bucket(),
                own: rule.limit,
                limit,
            }
        }),
    )
}

/// Counts, reports and (at most once per rule and period) logs one rule's decision.
#[inline]
fn observe<St>(config: &Config<St>, p: &RuleTake, outcome: Outcome, d: &Decision) {
    let r = &config.rules[p.rule];
    r.observer.count(r.bucket(), outcome);
    // An admission with no hook to tell, the usual case, has nothing more to do, and no call.
    if config.on_decision.is_some() || outcome != Outcome::Admitted {
        report(config, p, outcome, d);
    }
}

/// Reports one rule's decision to the hook and, unless it admitted the request, logs it (at most
/// once per rule and period).
fn report<St>(config: &Config<St>, p: &RuleTake, outcome: Outcome, d: &Decision) {
    let r = &config.rules[p.rule];
    let key = &p.key;
    if let Some(hook) = &config.on_decision {
        hook(&DecisionEvent {
            rule: r.bucket(),
            outcome,
            key,
            limit: p.limit,
            remaining: d.remaining(),
            wait: d.wait(),
            retry_after: d.retry_after(),
            error: None,
        });
    }
    if outcome == Outcome::Admitted {
        return;
    }
    tracing::debug!(
        bucket = r.bucket(),
        key = %key.fingerprint(),
        remaining = d.remaining(),
        retry_ms = d.wait().as_millis() as u64,
        outcome = outcome.as_str(),
        "rate limited"
    );
    // The gate is asked only when a subscriber wants the event: it reads the clock and writes
    // atomics shared by every request of the rule, and a refused request is a hot path too.
    if tracing::enabled!(Level::INFO)
        && let Some(suppressed) = r.observer.limited.admit()
    {
        let retry_ms = d.retry_after().unwrap_or_default().as_millis() as u64;
        if outcome == Outcome::ShadowLimited {
            tracing::info!(
                bucket = r.bucket(),
                key = %key.fingerprint(),
                retry_ms,
                suppressed,
                "request would be rate limited (shadow mode; let through)"
            );
        } else {
            tracing::info!(
                bucket = r.bucket(),
                key = %key.fingerprint(),
                retry_ms,
                suppressed,
                "request rate limited"
            );
        }
    }
}

/// Counts, reports and (at most once per rule and period) logs a store's failure to decide.
fn observe_failure<St>(config: &Config<St>, p: &RuleTake, e: &StoreError) {
    let r = &config.rules[p.rule];
    r.observer.count(r.bucket(), Outcome::Error);
    if let Some(hook) = &config.on_decision {
        hook(&DecisionEvent {
            rule: r.bucket(),
            outcome: Outcome::Error,
            key: &p.key,
            limit: p.limit,
            remaining: 0,
            wait: Duration::ZERO,
            retry_after: None,
            error: Some(e),
        });
    }
    match e {
        // The store's circuit breaker logged the outage when it opened.
        StoreError::Unavailable { .. } => {
            tracing::debug!(bucket = r.bucket(), error = %e, "rate limit store unavailable");
        }
        // The gate asked only when a subscriber wants the event, as for a refusal.
        StoreError::ZeroCost | StoreError::CostAboveBurst { .. } => {
            if tracing::enabled!(Level::ERROR)
                && let Some(suppressed) = r.observer.failed.admit()
            {
                tracing::error!(
                    bucket = r.bucket(),
                    error = %e,
                    suppressed,
                    "rate limit rule misconfigured"
                );
            }
        }
        _ => {
            if tracing::enabled!(Level::ERROR)
                && let Some(suppressed) = r.observer.failed.admit()
            {
                tracing::error!(
                    bucket = r.bucket(),
                    error = %e,
                    suppressed,
                    "rate limit store failed"
                );
            }
        }
    }
}

/// `item`, naming its partition (`pk`, the key's fingerprint) when the layer writes them.
#[inline]
fn partitioned<'a, St>(config: &Config<St>, item: Item<'a>, key: &BucketKey) -> Item<'a> {
    if config.partition_keys {
        item.partition(key)
    } else {
        item
    }
}

/// The rejection when rule `p` refused with `d`, after the rules in `applied` took their
/// tokens and gave them back.
fn reject<St>(
    config: &Config<St>,
    plan: &[RuleTake],
    applied: &[Taken],
    p: &RuleTake,
    d: &Decision,
) -> Why {
    let refusing = &config.rules[p.rule];
    let policy = || {
        policy(
            config,
            applied
                .iter()
                .map(|t| (plan[t.planned].rule, plan[t.planned].limit))
                .chain([(p.rule, p.limit)]),
        )
    };
    let denied = partitioned(config, Item::denied(refusing.bucket(), d), &p.key);
    let items = applied
        .iter()
        .map(|t| {
            let planned = &plan[t.planned];
            let name = config.rules[planned.rule].bucket();
            let item = if t.decision.is_admitted() {
                Item::refunded(name, &t.decision, planned.cost)
            } else {
                Item::admitted(name, &t.decision)
            };
            partitioned(config, item, &planned.key)
        })
        .chain([denied]);
    Why::Limited {
        rule: p.rule,
        limit: p.limit,
        remaining: d.remaining(),
        retry: d.retry_after().unwrap_or(Duration::ZERO),
        fields: headers::fields(config.fields, policy, items),
    }
}
