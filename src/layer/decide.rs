//! The rule loop: takes (or reserves) the tokens of each rule that applies, in order, and gives
//! back what earlier rules took when one refuses. Its [`Verdict`] is what the response future
//! acts on.

use std::mem;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Response;

use super::config::Config;
use super::headers::{self, Item};
use super::info::RateLimitInfo;
use super::observe::{DecisionEvent, Outcome};
use super::rejection::{self, Protocol};
use crate::cancel::RefundGuard;
use crate::{BucketKey, BucketStore, Decision, Limit, RateLimited, StoreError};

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

    fn len(&self) -> usize {
        self.as_slice().len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }
}

impl<T> IntoIterator for Few<T> {
    type Item = T;
    type IntoIter = std::iter::Chain<std::option::IntoIter<T>, std::vec::IntoIter<T>>;

    fn into_iter(self) -> Self::IntoIter {
        let (one, many) = match self {
            Self::Empty => (None, Vec::new()),
            Self::One(item) => (Some(item), Vec::new()),
            Self::Many(all) => (None, all),
        };
        one.into_iter().chain(many)
    }
}

/// One rule that applies to a request: its bucket, and the request's cost and limit there.
pub(crate) struct Planned {
    pub(crate) rule: usize,
    pub(crate) key: BucketKey,
    pub(crate) cost: u32,
    pub(crate) limit: Limit,
}

/// A rule's decision on a request that is going on: admitted, or refused by a rule in shadow
/// mode, whose refusal lets the request through.
struct Taken {
    rule: usize,
    key: BucketKey,
    decision: Decision,
    cost: u32,
    limit: Limit,
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
    /// earlier rules has been given back, and the response future returns this answer.
    Reject(Response<Bytes>),
}

/// Checks every rule in order, taking (or reserving) tokens as it goes. When a rule refuses,
/// the tokens taken by the rules before it are given back before answering, so a refused request
/// spends nothing. A rule in shadow mode decides without waiting, and its refusal (or its store's
/// failure) is reported, never acted on.
pub(crate) async fn decide<St: BucketStore + Clone>(
    config: Arc<Config<St>>,
    plan: Few<Planned>,
    protocol: Protocol,
) -> Verdict<St> {
    // Made on the first tokens it must hold, so that a request that goes at once on one rule
    // never clones the store for it.
    let mut guard: Option<RefundGuard<St>> = None;
    let mut taken: Few<Taken> = Few::default();
    let mut wait = Duration::ZERO;
    let mut refused = None;
    let count = plan.len();
    for (n, p) in plan.into_iter().enumerate() {
        let rule = &config.rules[p.rule];
        let shadow = config.shadow || rule.shadow;
        // A shadow rule only reports: making a request wait would be acting on it.
        let max_wait = if shadow {
            Duration::ZERO
        } else {
            config.max_wait
        };
        let result = config
            .store
            .acquire(&p.key, p.limit, p.cost, max_wait)
            .await;
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
                // The guard must hold these tokens across every later await: the next rule's
                // store call, or the wait. Tokens of the last rule taken for a request that goes
                // at once are spent before anything else runs, so they need no guard (and the
                // guard no allocation).
                if let Some(reservation) = d.reservation()
                    && (n + 1 < count || !wait.is_zero())
                {
                    guard
                        .get_or_insert_with(|| RefundGuard::new(config.store.clone()))
                        .push(p.key.clone(), p.limit, reservation);
                }
                taken.push(Taken {
                    rule: p.rule,
                    key: p.key,
                    decision: d,
                    cost: p.cost,
                    limit: p.limit,
                });
            }
            Ok(d) if shadow => taken.push(Taken {
                rule: p.rule,
                key: p.key,
                decision: d,
                cost: p.cost,
                limit: p.limit,
            }),
            Err(e) if shadow => observe_failure(&config, &p, &e),
            outcome => {
                refused = Some((p, outcome));
                break;
            }
        }
    }
    // One refund point after the loop, rather than one in each arm, keeps this future (boxed
    // once per request) small.
    if let Some((p, outcome)) = refused {
        if let Some(guard) = &mut guard {
            guard.refund_all().await;
        }
        return Verdict::Reject(match outcome {
            Ok(d) => {
                observe(&config, &p.key, p.rule, p.limit, Outcome::Limited, &d);
                reject(&config, protocol, taken.as_slice(), &p, &d)
            }
            Err(e) => {
                observe_failure(&config, &p, &e);
                rejection::store_failure(protocol, &e)
            }
        });
    }
    let applied = taken.as_slice();
    for t in applied {
        let outcome = if t.decision.is_admitted() {
            Outcome::Admitted
        } else {
            Outcome::ShadowLimited
        };
        observe(&config, &t.key, t.rule, t.limit, outcome, &t.decision);
    }
    let ratelimit = if config.headers_on_success {
        headers::fields(
            config.fields,
            || policy(&config, applied.iter().map(|t| (t.rule, t.limit))),
            applied
                .iter()
                .map(|t| Item::admitted(config.rules[t.rule].bucket(), &t.decision)),
        )
    } else {
        None
    };
    Verdict::Admit {
        wait,
        guard,
        ratelimit,
        info: info(&config, applied),
    }
}

/// The tightest rule's decision, for the handler; `None` when no rule decided (a shadow rule
/// whose store failed).
fn info<St>(config: &Config<St>, applied: &[Taken]) -> Option<RateLimitInfo> {
    let t = applied.iter().min_by_key(|t| t.decision.remaining())?;
    Some(RateLimitInfo {
        rule: config.rules[t.rule].bucket_name().clone(),
        limit: t.limit,
        remaining: t.decision.remaining(),
        resets_in: t.decision.resets_in(),
        shadow_limited: applied.iter().any(|t| !t.decision.is_admitted()),
    })
}

/// `RateLimit-Policy` for the rules numbered in `applied`, each with the limit it applied: the
/// prebuilt items while every limit is its rule's own, built afresh for a dynamic one.
fn policy<St>(
    config: &Config<St>,
    applied: impl Iterator<Item = (usize, Limit)> + Clone,
) -> Option<http::HeaderValue> {
    if !config.any_dynamic || applied.clone().all(|(i, l)| config.rules[i].limit == l) {
        let count = applied.clone().count();
        return config.policy(applied.map(|(i, _)| i), count);
    }
    let items: Vec<http::HeaderValue> = applied
        .filter_map(|(i, l)| headers::policy_item(config.rules[i].bucket(), l))
        .collect();
    headers::policy(items.iter())
}

/// Counts, reports and (at most once per rule and period) logs one rule's decision.
fn observe<St>(
    config: &Config<St>,
    key: &BucketKey,
    rule: usize,
    limit: Limit,
    outcome: Outcome,
    d: &Decision,
) {
    let r = &config.rules[rule];
    r.observer.count(r.bucket(), outcome);
    if let Some(hook) = &config.on_decision {
        hook(&DecisionEvent {
            rule: r.bucket(),
            outcome,
            key,
            limit,
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
    if let Some(suppressed) = r.observer.limited.admit() {
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
fn observe_failure<St>(config: &Config<St>, p: &Planned, e: &StoreError) {
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
        StoreError::ZeroCost | StoreError::CostAboveBurst { .. } => {
            if let Some(suppressed) = r.observer.failed.admit() {
                tracing::error!(
                    bucket = r.bucket(),
                    error = %e,
                    suppressed,
                    "rate limit rule misconfigured"
                );
            }
        }
        _ => {
            if let Some(suppressed) = r.observer.failed.admit() {
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

/// The rejection when rule `p` refused with `d`, after the rules in `applied` took their
/// tokens and gave them back.
fn reject<St>(
    config: &Config<St>,
    protocol: Protocol,
    applied: &[Taken],
    p: &Planned,
    d: &Decision,
) -> Response<Bytes> {
    let retry = d.retry_after().unwrap_or(Duration::ZERO);
    let refusing = &config.rules[p.rule];
    let policy = || {
        policy(
            config,
            applied
                .iter()
                .map(|t| (t.rule, t.limit))
                .chain([(p.rule, p.limit)]),
        )
    };
    let denied = Item::denied(refusing.bucket(), d);
    let items = applied
        .iter()
        .map(|t| {
            let name = config.rules[t.rule].bucket();
            if t.decision.is_admitted() {
                Item::refunded(name, &t.decision, t.cost)
            } else {
                Item::admitted(name, &t.decision)
            }
        })
        .chain([denied]);
    let fields = headers::fields(config.fields, policy, items);
    let limited = || RateLimited::new(retry, p.limit, refusing.bucket(), d.remaining());
    config
        .rejection
        .respond(protocol, retry, refusing.bucket(), limited, fields)
}
