//! What the middleware's property tests share: how many cases they run (a few hundred, more with
//! `BURSTGATE_FUZZ_CASES`), where a failing case is kept, and the back-off header values they
//! try.

use std::time::{Duration, SystemTime};

use proptest::prelude::*;

/// The time the fuzz runs at: whole seconds, so dates and delays compare exactly.
pub(super) const NOW_MS: u64 = 1_700_000_000_000;

/// `secs` after the Unix epoch.
pub(super) fn at(secs: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
}

/// A few hundred cases unless `BURSTGATE_FUZZ_CASES` says otherwise, and one file of failing
/// cases for every property test of the middleware, each replaying them all.
pub(super) fn fuzz_config() -> ProptestConfig {
    let cases = std::env::var("BURSTGATE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512);
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::Direct(
                "proptest-regressions/middleware/fuzz.txt",
            ),
        )),
        ..ProptestConfig::default()
    }
}

/// Back-off header values: the shapes servers send, their near misses, and anything at all.
pub(super) fn header_text() -> impl Strategy<Value = String> {
    let date = (0..=253_402_300_799u64).prop_map(|s| httpdate::fmt_http_date(at(s)));
    prop_oneof![
        "[0-9]{1,25}",
        "[0-9]{0,25}\\.[0-9]{0,25}",
        "[ \t]{0,2}[-+]?[0-9]{1,6}(\\.[0-9]{1,3})?[ \t]{0,2}",
        date,
        (1_699_999_000..=1_700_001_000u64).prop_map(|s| httpdate::fmt_http_date(at(s))),
        "[A-Za-z]{3}, [0-9]{2} [A-Za-z]{3} [0-9]{4} [0-9:]{8} GMT",
        ".*",
    ]
}
