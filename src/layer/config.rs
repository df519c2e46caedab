//! What a layer and its services share: the store, the rules and how refusals look.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use http::HeaderValue;

use http::request::Parts;

use super::Rule;
use super::headers::FieldVersion;
use super::observe::DecisionHook;
use super::rejection::Rejection;
use crate::cancel::Abandoned;
use crate::{MemoryStore, OutagePolicy};

pub(crate) type SkipFn = std::sync::Arc<dyn Fn(&Parts) -> bool + Send + Sync>;

/// Behind an `Arc`, shared by a [`RateLimitLayer`](super::RateLimitLayer) and every service it
/// makes; the layer's builder copies it on write.
pub(crate) struct Config<St> {
    pub(crate) store: St,
    pub(crate) rules: Vec<Rule>,
    /// `RateLimit-Policy` when every rule applies, the usual case, built once.
    pub(crate) policy_all: Option<HeaderValue>,
    /// Whether any rule has a dynamic limit: until one does, every request meets its rules'
    /// own limits and their prebuilt `RateLimit-Policy` items.
    pub(crate) any_dynamic: bool,
    pub(crate) max_wait: Duration,
    pub(crate) headers_on_success: bool,
    pub(crate) fields: FieldVersion,
    pub(crate) rejection: Rejection,
    /// Every rule in shadow mode.
    pub(crate) shadow: bool,
    /// Requests no rule applies to.
    pub(crate) skip: Option<SkipFn>,
    pub(crate) on_decision: Option<DecisionHook>,
    /// Set once the store refused the rules of one request at once because their keys sit in
    /// different Redis Cluster slots: from then on, a request whose rules key on different
    /// callers takes them in turn without trying first. Shared by the layer's copies.
    pub(crate) apart: Arc<AtomicBool>,
    /// Reservations of requests dropped while they waited, on their way back.
    pub(crate) abandoned: Abandoned,
    /// Whether `RateLimit` items name their partition (`pk`).
    pub(crate) partition_keys: bool,
    /// What a request gets when the store fails.
    pub(crate) outage: OutagePolicy,
    /// The buckets of [`OutagePolicy::Local`], in this process; shared by the layer's copies.
    pub(crate) fallback: MemoryStore,
}

impl<St: Clone> Clone for Config<St> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            rules: self.rules.clone(),
            policy_all: self.policy_all.clone(),
            any_dynamic: self.any_dynamic,
            max_wait: self.max_wait,
            headers_on_success: self.headers_on_success,
            fields: self.fields,
            rejection: self.rejection.clone(),
            shadow: self.shadow,
            skip: self.skip.clone(),
            on_decision: self.on_decision.clone(),
            apart: Arc::clone(&self.apart),
            abandoned: self.abandoned.clone(),
            partition_keys: self.partition_keys,
            outage: self.outage,
            fallback: self.fallback.clone(),
        }
    }
}

impl<St: fmt::Debug> fmt::Debug for Config<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RateLimitLayer")
            .field("store", &self.store)
            .field("rules", &self.rules)
            .field("max_wait", &self.max_wait)
            .field("headers_on_success", &self.headers_on_success)
            .field("fields", &self.fields)
            .field("rejection_status", &self.rejection.status)
            .field("shadow", &self.shadow)
            .field("skip", &self.skip.as_ref().map(|_| "Fn(&Parts) -> bool"))
            .field(
                "on_decision",
                &self.on_decision.as_ref().map(|_| "Fn(&DecisionEvent)"),
            )
            .finish_non_exhaustive()
    }
}
