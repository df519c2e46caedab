//! The rule loop: takes (or reserves) the tokens of each rule that applies, in order, and gives
//! back what earlier rules took when one refuses. Its [`Verdict`] is what the response future
//! acts on.

use std::mem;
use std::sync::Arc;
use std::time::Duration;

use http::Response;

use super::config::Config;
use super::headers::{self, Item};
use super::rejection;
use crate::cancel::RefundGuard;
use crate::{BucketKey, BucketStore, Decision, RateLimited};

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
    pub(crate) fn push(&mut self, item: T) {
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

/// One rule that applies to a request: its bucket and the request's cost there.
pub(crate) struct Planned {
    pub(crate) rule: usize,
    pub(crate) key: BucketKey,
    pub(crate) cost: u32,
}

/// What the rules decided for one request.
pub(crate) enum Verdict<St: BucketStore + Clone, R> {
    /// Go, after `wait`. The guard gives the tokens back if the request is dropped before then.
    Admit {
        wait: Duration,
        /// `None` when no tokens need guarding: the request goes at once.
        guard: Option<RefundGuard<St>>,
        /// The rate-limit fields for the response.
        ratelimit: Option<headers::Fields>,
    },
    /// Answered without calling the inner service: a rule refused (the rejection), or the store
    /// could not decide (503, or 500 for a misconfigured rule). Either way everything taken by
    /// earlier rules has been given back, and the response future returns `R` as it is.
    Reject(R),
}

/// Checks every rule in order, taking (or reserving) tokens as it goes. When a rule refuses,
/// the tokens taken by the rules before it are given back before answering, so a refused request
/// spends nothing.
pub(crate) async fn decide<St: BucketStore + Clone, B: From<String>>(
    config: Arc<Config<St>>,
    plan: Few<Planned>,
) -> Verdict<St, Response<B>> {
    // Made on the first tokens it must hold, so that a request that goes at once on one rule
    // never clones the store for it.
    let mut guard: Option<RefundGuard<St>> = None;
    let mut decisions: Few<(usize, Decision, u32)> = Few::default();
    let mut wait = Duration::ZERO;
    let mut refused = None;
    let count = plan.len();
    for (n, p) in plan.into_iter().enumerate() {
        let rule = &config.rules[p.rule];
        let result = config
            .store
            .acquire(&p.key, rule.limit, p.cost, config.max_wait)
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
                        .push(p.key, rule.limit, reservation);
                }
                decisions.push((p.rule, d, p.cost));
            }
            Ok(d) => {
                tracing::debug!(
                    bucket = rule.bucket(),
                    key = %p.key.fingerprint(),
                    remaining = d.remaining(),
                    retry_ms = d.wait().as_millis() as u64,
                    "rate limited"
                );
                refused = Some((p.rule, Ok(d)));
                break;
            }
            Err(e) => {
                refused = Some((p.rule, Err(e)));
                break;
            }
        }
    }
    // One refund point after the loop, rather than one in each arm, keeps this future (boxed
    // once per request) small.
    if let Some((rule, outcome)) = refused {
        if let Some(guard) = &mut guard {
            guard.refund_all().await;
        }
        return Verdict::Reject(match outcome {
            Ok(d) => reject(&config, decisions.as_slice(), rule, &d),
            Err(e) => rejection::store_failure(config.rules[rule].bucket(), &e),
        });
    }
    let ratelimit = if config.headers_on_success {
        let applied = decisions.as_slice();
        headers::fields(
            config.fields,
            || config.policy(applied.iter().map(|(i, _, _)| *i), applied.len()),
            applied
                .iter()
                .map(|(i, d, _)| Item::admitted(config.rules[*i].bucket(), d)),
        )
    } else {
        None
    };
    Verdict::Admit {
        wait,
        guard,
        ratelimit,
    }
}

/// The rejection when rule number `rule` refused with `d`, after the rules in `applied` took
/// their tokens and gave them back.
fn reject<St, B: From<String>>(
    config: &Config<St>,
    applied: &[(usize, Decision, u32)],
    rule: usize,
    d: &Decision,
) -> Response<B> {
    let retry = d.retry_after().unwrap_or(Duration::ZERO);
    let refusing = &config.rules[rule];
    let policy = || {
        config.policy(
            applied.iter().map(|(i, _, _)| *i).chain([rule]),
            applied.len() + 1,
        )
    };
    let denied = Item::denied(refusing.bucket(), d);
    let items = applied
        .iter()
        .map(|(i, d, cost)| Item::refunded(config.rules[*i].bucket(), d, *cost))
        .chain([denied]);
    let fields = headers::fields(config.fields, policy, items);
    let limited = || RateLimited::new(retry, refusing.limit, refusing.bucket(), d.remaining());
    config.rejection.respond(retry, limited, fields)
}
