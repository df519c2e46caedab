//! The log events of one test, in a binary whose other tests run beside it.
//!
//! [`capture`] makes a recording subscriber the default of the test's thread, as
//! `tracing::subscriber::set_default` does: it sees that thread's events only. But tracing
//! caches whether each call site is of interest once, for the whole process, and while a single
//! subscriber is registered the first thread to reach a call site decides that alone, by its
//! own default: a sibling test with no subscriber would cache "never", and the capturing test
//! would miss the event it asserts on. So the first capture also installs a global subscriber
//! that records nothing but answers "sometimes", which keeps every call site asking the thread
//! of each event.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex, Once, PoisonError};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::{DefaultGuard, Interest};
use tracing::{Event, Level, Metadata, Subscriber};

/// Records every event of this thread until the guard drops.
pub(crate) fn capture() -> (Captured, DefaultGuard) {
    static GLOBAL: Once = Once::new();
    GLOBAL.call_once(|| {
        // Nothing else in a test binary sets one; were one set, it would already register call
        // sites as a subscriber, which is all this one is for.
        let _ = tracing::subscriber::set_global_default(Silent);
    });
    let captured = Captured::default();
    let guard = tracing::subscriber::set_default(captured.clone());
    (captured, guard)
}

/// The events recorded so far, in order.
#[derive(Clone, Default)]
pub(crate) struct Captured(Arc<Mutex<Vec<Logged>>>);

// The layer's suites read the fields and the outage suite the messages, so each goes unread
// when its suite is left out by the features.
struct Logged {
    level: Level,
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    target: &'static str,
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    message: String,
    /// Every field, message included, as `name=value ` with values in `Debug` form.
    #[cfg_attr(not(any(feature = "tower", feature = "reqwest")), allow(dead_code))]
    fields: String,
}

impl Captured {
    /// The fields of each `WARN` event.
    #[cfg(any(feature = "tower", feature = "reqwest"))]
    pub(crate) fn warnings(&self) -> Vec<String> {
        self.events()
            .iter()
            .filter(|e| e.level == Level::WARN)
            .map(|e| e.fields.clone())
            .collect()
    }

    /// The fields of each `INFO` event.
    #[cfg(feature = "tower")]
    pub(crate) fn infos(&self) -> Vec<String> {
        self.events()
            .iter()
            .filter(|e| e.level == Level::INFO)
            .map(|e| e.fields.clone())
            .collect()
    }

    /// The level and message of each event whose target is `target`.
    #[cfg(feature = "redis")]
    pub(crate) fn messages(&self, target: &str) -> Vec<(Level, String)> {
        self.events()
            .iter()
            .filter(|e| e.target == target)
            .map(|e| (e.level, e.message.clone()))
            .collect()
    }

    fn events(&self) -> std::sync::MutexGuard<'_, Vec<Logged>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Default)]
struct Fields {
    message: String,
    all: String,
}

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        }
        let _ = write!(self.all, "{}={:?} ", field.name(), value);
    }
}

impl Subscriber for Captured {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, event: &Event<'_>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        self.events().push(Logged {
            level: *event.metadata().level(),
            target: event.metadata().target(),
            message: fields.message,
            fields: fields.all,
        });
    }
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
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
    fn new_span(&self, _: &Attributes<'_>) -> Id {
        Id::from_u64(1)
    }
    fn record(&self, _: &Id, _: &Record<'_>) {}
    fn record_follows_from(&self, _: &Id, _: &Id) {}
    fn event(&self, _: &Event<'_>) {}
    fn enter(&self, _: &Id) {}
    fn exit(&self, _: &Id) {}
}
