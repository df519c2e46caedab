//! What the layer tells operators about its decisions: a hook called for each one, metrics
//! through the `metrics` facade (feature `metrics`), and logs of refusals and store failures
//! that a flood cannot multiply.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::log_gate::LogGate;
use crate::{BucketKey, Limit, StoreError};

/// How one rule decided on one request, as [`DecisionEvent::outcome`] and the
/// `burstgate_decisions_total` metric's `outcome` label report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The rule admitted the request (at once or after a wait).
    Admitted,
    /// The rule refused the request.
    Limited,
    /// A rule in [shadow mode](super::Rule::shadow) would have refused the request, and let it
    /// through.
    ShadowLimited,
    /// The store could not decide (Redis down, a timeout, a misconfigured cost).
    Error,
}

impl Outcome {
    /// The label: `admitted`, `limited`, `shadow_limited` or `error`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Admitted => "admitted",
            Self::Limited => "limited",
            Self::ShadowLimited => "shadow_limited",
            Self::Error => "error",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One rule's decision on one request, given to the
/// [`on_decision`](super::RateLimitLayer::on_decision) hook.
///
/// Each rule that decided on a request reports once. When a rule refuses, the rules after it
/// are not asked, and the rules before it, whose tokens were given back, do not report: a
/// refused request is one `Limited` event (or `Error`), an admitted one an `Admitted` event per
/// rule that applied.
#[derive(Debug)]
pub struct DecisionEvent<'a> {
    pub(crate) rule: &'a str,
    pub(crate) outcome: Outcome,
    pub(crate) key: &'a BucketKey,
    pub(crate) limit: Limit,
    pub(crate) remaining: u32,
    pub(crate) wait: Duration,
    pub(crate) retry_after: Option<Duration>,
    pub(crate) error: Option<&'a StoreError>,
}

impl DecisionEvent<'_> {
    /// The rule's bucket name.
    pub fn rule(&self) -> &str {
        self.rule
    }

    /// What the rule decided.
    pub fn outcome(&self) -> Outcome {
        self.outcome
    }

    /// The bucket the request drew from. Log its [`fingerprint`](BucketKey::fingerprint), never
    /// anything that could be the key itself.
    pub fn key(&self) -> &BucketKey {
        self.key
    }

    /// The limit the rule applied to this request (a [dynamic
    /// limit](super::Rule::dynamic_limit) may differ from the rule's).
    pub fn limit(&self) -> Limit {
        self.limit
    }

    /// Whole tokens left in the bucket after the decision (0 on an error).
    pub fn remaining(&self) -> u32 {
        self.remaining
    }

    /// How long an admitted request waits for its tokens (zero unless the layer waits).
    pub fn wait(&self) -> Duration {
        self.wait
    }

    /// For a refusal (or a shadow one), when the request could have gone.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// For an [`Outcome::Error`], what went wrong.
    pub fn error(&self) -> Option<&StoreError> {
        self.error
    }
}

pub(crate) type DecisionHook = Arc<dyn Fn(&DecisionEvent<'_>) + Send + Sync>;

/// A rule's log gates and metric handles, shared by its clones.
#[derive(Debug)]
pub(crate) struct RuleObserver {
    pub(crate) limited: LogGate,
    pub(crate) failed: LogGate,
    #[cfg(feature = "metrics")]
    metrics: std::sync::OnceLock<RuleMetrics>,
}

impl RuleObserver {
    pub(crate) fn new() -> Self {
        Self {
            limited: LogGate::new(),
            failed: LogGate::new(),
            #[cfg(feature = "metrics")]
            metrics: std::sync::OnceLock::new(),
        }
    }

    /// Counts one decision of rule `rule`.
    #[cfg(feature = "metrics")]
    pub(crate) fn count(&self, rule: &str, outcome: Outcome) {
        let m = self.metrics.get_or_init(|| RuleMetrics::new(rule));
        match outcome {
            Outcome::Admitted => m.admitted.increment(1),
            Outcome::Limited => m.limited.increment(1),
            Outcome::ShadowLimited => m.shadow_limited.increment(1),
            Outcome::Error => m.error.increment(1),
        }
    }

    #[cfg(not(feature = "metrics"))]
    #[inline(always)]
    pub(crate) fn count(&self, _rule: &str, _outcome: Outcome) {}
}

/// A rule's counters, registered with the recorder on the rule's first decision: a label
/// string per decision would be an allocation per request.
#[cfg(feature = "metrics")]
struct RuleMetrics {
    admitted: metrics::Counter,
    limited: metrics::Counter,
    shadow_limited: metrics::Counter,
    error: metrics::Counter,
}

#[cfg(feature = "metrics")]
impl RuleMetrics {
    fn new(rule: &str) -> Self {
        let counter = |outcome: Outcome| {
            metrics::counter!(
                crate::metrics::DECISIONS,
                "rule" => rule.to_owned(),
                "outcome" => outcome.as_str(),
            )
        };
        Self {
            admitted: counter(Outcome::Admitted),
            limited: counter(Outcome::Limited),
            shadow_limited: counter(Outcome::ShadowLimited),
            error: counter(Outcome::Error),
        }
    }
}

#[cfg(feature = "metrics")]
impl fmt::Debug for RuleMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RuleMetrics")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_are_labelled_as_documented() {
        let all = [
            Outcome::Admitted,
            Outcome::Limited,
            Outcome::ShadowLimited,
            Outcome::Error,
        ];
        let labels: Vec<String> = all.iter().map(Outcome::to_string).collect();
        assert_eq!(labels, ["admitted", "limited", "shadow_limited", "error"]);
    }
}
