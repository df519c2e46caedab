//! Capturing a test's log events with a subscriber of the test's own, in a binary whose other
//! tests run beside it.
//!
//! A scoped subscriber (`set_default`) sees only its own thread's events, but tracing caches
//! whether each call site is of interest once, for the whole process. While a single subscriber
//! is registered, the first thread to reach a call site decides that alone, by its own default:
//! a sibling test with no subscriber would cache "never", and the capturing test would then miss
//! the event it asserts on. A global subscriber that is never interested in anything itself but
//! answers "sometimes" keeps every call site asking each event's own thread instead.

use std::sync::Once;

use tracing::subscriber::{DefaultGuard, Interest};
use tracing::{Metadata, Subscriber};

/// Makes `subscriber` this thread's default until the guard drops, as
/// `tracing::subscriber::set_default` does, once the process has its global [`Silent`]
/// subscriber.
pub(crate) fn capture<S>(subscriber: S) -> DefaultGuard
where
    S: Subscriber + Send + Sync + 'static,
{
    static GLOBAL: Once = Once::new();
    GLOBAL.call_once(|| {
        // Nothing else in the test binary sets one; if something did, it already registers
        // call sites as a subscriber, which is all this one is for.
        let _ = tracing::subscriber::set_global_default(Silent);
    });
    tracing::subscriber::set_default(subscriber)
}

/// The global subscriber: records nothing, and never lets a call site be cached as of no
/// interest.
struct Silent;

impl Subscriber for Silent {
    fn register_callsite(&self, _: &'static Metadata<'static>) -> Interest {
        Interest::sometimes()
    }
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        false
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, _: &tracing::Event<'_>) {}
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}
