//! [`Route`]: which requests draw from which bucket, and how a request's method, host and path
//! are matched against it.

use http::Method;
use std::fmt;

use crate::pattern::Pattern;
use crate::{Audit, BucketName, InvalidName, Limit};

/// Which requests draw from which bucket: a bucket name, a [`Limit`], and a pattern of method,
/// host and path.
///
/// The path pattern is matched segment by segment: `*` matches any one segment, and a final
/// `**` matches any rest (including nothing). `/api/v1/supplier/orders` matches only that path;
/// `/api/v2/nm-report/*/detail` matches any card; `/api/v1/**` matches everything under it.
/// Query strings are ignored.
///
/// # Spellings of one path
///
/// A route matches the request's path once normalized, so that a path spelled another way
/// draws from the same bucket instead of escaping it. The pattern is normalized the same way.
///
/// - Percent-encoded unreserved characters (letters, digits, `-`, `.`, `_`, `~`) are decoded,
///   whatever the case of their hex digits: `/api/v1/supplier/%6Frders` is
///   `/api/v1/supplier/orders`.
/// - Dot segments are removed (RFC 3986 §5.2.4), encoded dots (`%2E`) included: `/a/./b` and
///   `/a/x/../b` are `/a/b`.
/// - Empty segments are skipped: `//` counts as one `/`, and a trailing slash makes no
///   difference. Most servers route both spellings to one handler, and for a limiter matching
///   one path too many is the safe side.
///
/// What is not normalized, because it can name another resource: an encoded slash (`%2F`, or
/// `%2f`) stays part of its segment and never splits it, and any other escape of a reserved
/// character stays an escape (only the case of its hex digits is ignored); case in the path is
/// significant.
///
/// ```
/// use burstgate::Limit;
/// use burstgate::middleware::Route;
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let orders = Route::new("orders", Limit::per_minute(1)?, "/api/v1/supplier/orders")?;
/// for spelled in [
///     "https://api.example/api/v1/supplier/%6Frders",
///     "https://api.example/api/v1/supplier/x/%2E%2E/orders",
///     "https://api.example//api/v1/supplier/orders/",
/// ] {
///     assert!(orders.matches_url(&http::Method::GET, &reqwest::Url::parse(spelled)?));
/// }
/// let elsewhere = reqwest::Url::parse("https://api.example/api/v1/supplier%2Forders")?;
/// assert!(!orders.matches_url(&http::Method::GET, &elsewhere));
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub(super) bucket: BucketName,
    /// The limit as given, before any margin.
    limit: Limit,
    /// What the bucket runs at: the limit with the route's margin.
    pub(super) bucket_limit: Limit,
    /// Tokens a request costs unless it carries a [`Cost`](super::Cost).
    pub(super) cost: u32,
    /// Which requests: method, host and path, matched as the layer's rules match theirs.
    pattern: Pattern,
    /// The trail of its decisions, when it keeps one.
    pub(super) audit: Option<Audit>,
}

/// `limit` with the default margin per token ([`Route::margin`] says why): 1% of the token
/// period, at least 10 ms, at most a tenth of the period; the interval it adds is rounded up to
/// whole milliseconds, as a limit counts them, short of a tenth of the interval.
fn with_default_margin(limit: Limit) -> Limit {
    const FLOOR_US: u128 = 10_000;
    let tokens = u128::from(limit.tokens());
    let period_us = limit.interval().as_micros() / tokens;
    let per_token_us = (period_us / 100).max(FLOOR_US).min(period_us / 10);
    // Rounded up to whole milliseconds, but never past a tenth of the interval: a limit of a
    // few milliseconds has no room for a margin and runs as given.
    let extra_ms = (per_token_us * tokens)
        .div_ceil(1_000)
        .min(limit.interval().as_millis() / 10);
    let lengthened = u64::try_from(extra_ms)
        .ok()
        .and_then(|ms| {
            limit
                .interval()
                .checked_add(std::time::Duration::from_millis(ms))
        })
        .and_then(|interval| Limit::new(limit.tokens(), interval).ok())
        .and_then(|l| l.with_burst(limit.burst()).ok());
    // Only a limit whose refill is within 1% of the longest span a limit holds (2^42 ms, about
    // 139 years) has no room for the margin; at such lengths no request's trip can be early,
    // and the limit runs as given.
    lengthened.unwrap_or(limit)
}

impl Route {
    /// Requests whose path matches `path` draw from bucket `bucket` (1 to 64 ASCII letters,
    /// digits, `_`, `.` or `-`), under `limit`, an API's published limit. The path must start
    /// with `/`.
    ///
    /// The bucket runs a little under `limit`'s rate, so that a client given the published
    /// limit and nothing else earns no 429 from an upstream that gives no tolerance: every
    /// token's period is lengthened by the default margin, 1% of the token period, at least
    /// 10 ms unless that is more than a tenth of the period (see [`margin`](Self::margin) for why,
    /// and for another margin or none). "1 per second" runs at one per 1.01 s, "5 per second"
    /// at one per 210 ms, "1 per minute" at one per 60.6 s; the burst is the limit's.
    /// [`limit`](Self::limit) is `limit` as given, and [`bucket_limit`](Self::bucket_limit)
    /// what the bucket runs at.
    pub fn new(bucket: &str, limit: Limit, path: &str) -> Result<Self, InvalidRoute> {
        let bucket = BucketName::checked(bucket).map_err(InvalidRoute::BucketName)?;
        let pattern = Pattern::path(path).ok_or(InvalidRoute::Path)?;
        Ok(Self {
            bucket,
            limit,
            bucket_limit: with_default_margin(limit),
            cost: 1,
            pattern,
            audit: None,
        })
    }

    /// The same route run under its published limit's rate by `per_token` instead of the
    /// default margin: every token's period lengthened by `per_token` ([`Limit::with_margin`]).
    /// `Duration::ZERO` runs exactly at the published rate.
    ///
    /// Why a margin at all: an API's own bucket usually starts at the first request it
    /// *receives* and gives no tolerance, while the client's bucket starts when its first
    /// request is taken. The first requests of a burst open new connections; a token period
    /// later the next one goes on a warm connection and arrives sooner after it is taken, and
    /// only the margin of that one token stands between it and a 429. A timer that fires late
    /// for one request and on time for the next, the store's whole milliseconds, and hosts that
    /// count the shared time a little apart add to it. So the margin of a single token must
    /// cover the whole difference: at least 10 ms (a new connection's extra time on a local
    /// network, with room), 1% of the period where that is more (a slow limit, such as "1 per
    /// minute", then covers a handshake of a few hundred milliseconds at 1% of its budget), and
    /// never more than a tenth of the period, so that a limit faster than 10 a second keeps 90%
    /// of its rate. An upstream whose first request costs more than that (a TLS handshake far
    /// away, against a limit of a few a second) may want a larger margin; one that tolerates
    /// early requests, none.
    ///
    /// Called more than once, the last margin applies; it always applies to the published
    /// limit, never on top of another margin.
    ///
    /// # Errors
    ///
    /// As [`Limit::with_margin`].
    pub fn margin(self, per_token: std::time::Duration) -> Result<Self, crate::InvalidLimit> {
        let bucket_limit = self.limit.with_margin(per_token)?;
        Ok(Self {
            bucket_limit,
            ..self
        })
    }

    /// What each request of the route costs, in tokens, unless it carries a
    /// [`Cost`](super::Cost) of its own (default 1): a batch endpoint that the API counts as
    /// several requests. A cost above the limit's burst can never be served, and is the
    /// middleware's error [`StoreError::CostAboveBurst`](crate::StoreError::CostAboveBurst).
    #[must_use]
    pub fn cost(self, tokens: std::num::NonZeroU32) -> Self {
        Self {
            cost: tokens.get(),
            ..self
        }
    }

    /// Appends every decision on the route's buckets to their [`Audit`] trail, in Redis beside
    /// each bucket, in the same call as the decision (a `RedisStore`'s; other stores keep none):
    /// which requests, from which process, spent a shared budget, and which were refused. Read it
    /// with `burstgate audit <bucket> [<key>]`.
    #[must_use]
    pub fn audit(self, audit: Audit) -> Self {
        Self {
            audit: Some(audit),
            ..self
        }
    }

    /// Matches only requests with this method; a route for `GET` also matches `HEAD`, which
    /// servers answer as a `GET` and an API may count as one.
    #[must_use]
    pub fn method(self, method: Method) -> Self {
        Self {
            pattern: self.pattern.method(method),
            ..self
        }
    }

    /// Matches only requests to this host: compared without case, and without a trailing dot
    /// on either side (`api.example.` is the fully qualified spelling of `api.example`, and
    /// names the same host). No port.
    #[must_use]
    pub fn host(self, host: &str) -> Self {
        Self {
            pattern: self.pattern.host(host),
            ..self
        }
    }

    /// The same route drawing from bucket `bucket`, refused as [`Route::new`] refuses a name.
    #[cfg(feature = "seller")]
    pub(crate) fn renamed(self, bucket: &str) -> Result<Self, InvalidRoute> {
        Ok(Self {
            bucket: BucketName::checked(bucket).map_err(InvalidRoute::BucketName)?,
            ..self
        })
    }

    /// The same route under `limit`: the seller preset adjusts a group's limit in place, so a
    /// caller need not restate the pattern.
    #[cfg(feature = "seller")]
    pub(crate) fn relimited(self, limit: Limit) -> Self {
        Self {
            limit,
            bucket_limit: with_default_margin(limit),
            ..self
        }
    }

    /// The bucket name.
    pub fn bucket(&self) -> &str {
        self.bucket.as_str()
    }

    /// The limit as given: the API's published limit, before any margin.
    pub fn limit(&self) -> Limit {
        self.limit
    }

    /// The limit the route's bucket runs at: [`limit`](Self::limit) with the route's
    /// [`margin`](Self::margin), by default the one [`Route::new`] describes.
    pub fn bucket_limit(&self) -> Limit {
        self.bucket_limit
    }

    /// Whether a request with this method and URL draws from this route: the test the
    /// middleware makes, in order, for each route.
    pub fn matches_url(&self, method: &Method, url: &reqwest::Url) -> bool {
        self.pattern.matches(method, url.host_str(), url.path())
    }

    #[cfg(test)]
    pub(super) fn matches_path(&self, path: &str) -> bool {
        self.pattern.matches_path(path)
    }
}

/// Why a [`Route`] was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidRoute {
    /// The route's bucket name broke the naming rule.
    BucketName(InvalidName),
    /// The path pattern did not start with `/`.
    Path,
}

impl fmt::Display for InvalidRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BucketName(why) => write!(f, "invalid bucket name: {why}"),
            Self::Path => f.write_str("a route's path pattern must start with '/'"),
        }
    }
}

impl std::error::Error for InvalidRoute {}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::Method;
    use proptest::prelude::*;

    use super::*;
    use crate::middleware::fuzz::fuzz_config;

    /// The cases every matcher built on the shared pattern agrees on, through a route.
    #[test]
    fn a_route_matches_the_shared_pattern_cases() {
        let limit = Limit::per_second(1).expect("a limit");
        for &(pattern, method, asked, path, expected) in crate::pattern::CASES {
            let mut route = Route::new("r", limit, pattern).expect("a route");
            if let Some(m) = method {
                route = route.method(Method::from_bytes(m.as_bytes()).expect("a method"));
            }
            let asked_method = Method::from_bytes(asked.as_bytes()).expect("a method");
            let url = reqwest::Url::parse(&format!("https://h{path}?q=1")).expect("a URL");
            assert_eq!(
                route.matches_url(&asked_method, &url),
                expected,
                "{pattern} {method:?} against {asked} {path}"
            );
        }
    }

    /// The default margin: 1% of the token period, at least 10 ms, at most a tenth of the
    /// period; `margin` replaces it, and a margin of zero runs at the published rate.
    #[test]
    fn a_route_runs_under_its_published_limit_by_the_default_margin() {
        let runs = |published: Limit| {
            let route = Route::new("r", published, "/").expect("a route");
            assert_eq!(route.limit(), published);
            let run = route.bucket_limit();
            assert_eq!(
                (run.tokens(), run.burst()),
                (published.tokens(), published.burst())
            );
            run.interval().as_millis()
        };
        let limit = |tokens, ms| Limit::new(tokens, Duration::from_millis(ms)).expect("a limit");
        // At least 10 ms.
        assert_eq!(runs(limit(5, 1_000)), 1_050);
        assert_eq!(
            runs(limit(1, 1_000).with_burst(10).expect("a burst")),
            1_010
        );
        assert_eq!(runs(limit(1, 500)), 510);
        assert_eq!(runs(limit(3, 1_000)), 1_030);
        // 1% of a longer period.
        assert_eq!(runs(limit(1, 60_000)), 60_600);
        assert_eq!(runs(limit(10, 60_000)), 60_600);
        assert_eq!(runs(limit(1, 3_600_000)), 3_636_000);
        // At most a tenth of the period, rounded up over the interval.
        assert_eq!(runs(limit(10, 1_000)), 1_100);
        assert_eq!(runs(limit(50, 1_000)), 1_100);
        assert_eq!(runs(limit(1_000, 1_000)), 1_100);
        // The period in whole microseconds: 333 µs, a tenth of it 33 µs.
        assert_eq!(runs(limit(3_000, 1_000)), 1_099);
        // Whole milliseconds, never more than a tenth of the interval: none below 10 ms.
        assert_eq!(runs(limit(1, 15)), 16);
        assert_eq!(runs(limit(1, 20)), 22);
        assert_eq!(runs(limit(1, 9)), 9);
        assert_eq!(runs(limit(1, 1)), 1);
        // Room for 1% only within the longest span a limit holds: past it, the limit as given.
        assert_eq!(runs(limit(1, 1 << 41)), (1 << 41) + 21_990_232_556);
        let longest = limit(1, 1 << 42);
        assert_eq!(runs(longest), 1 << 42);

        let route = Route::new("r", limit(5, 1_000), "/").expect("a route");
        let exact = route.clone().margin(Duration::ZERO).expect("no margin");
        assert_eq!(exact.bucket_limit(), exact.limit());
        let wide = route.margin(Duration::from_millis(20)).expect("a margin");
        assert_eq!(wide.bucket_limit(), limit(5, 1_100));
        let replaced = wide.margin(Duration::from_millis(20)).expect("a margin");
        assert_eq!(replaced.bucket_limit(), limit(5, 1_100));
    }

    #[test]
    fn routes_match_method_host_and_path_patterns() {
        let limit = Limit::per_minute(1).expect("a valid limit");
        let exact = Route::new("orders", limit, "/api/v1/supplier/orders").expect("a route");
        assert!(exact.matches_url(&Method::GET, &url("https://h/api/v1/supplier/orders?x=1")));
        assert!(!exact.matches_url(&Method::GET, &url("https://h/api/v1/supplier/orders/7")));
        assert!(!exact.matches_url(&Method::GET, &url("https://h/api/v1/supplier")));
        let any = Route::new("card", limit, "/cards/*/detail").expect("a route");
        assert!(any.matches_url(&Method::GET, &url("https://h/cards/42/detail")));
        assert!(!any.matches_url(&Method::GET, &url("https://h/cards/detail")));
        let rest = Route::new("all", limit, "/api/**")
            .expect("a route")
            .method(Method::POST)
            .host("API.example");
        assert!(rest.matches_url(&Method::POST, &url("https://api.example/api")));
        assert!(rest.matches_url(&Method::POST, &url("https://api.example/api/a/b/c")));
        assert!(!rest.matches_url(&Method::GET, &url("https://api.example/api/a")));
        assert!(!rest.matches_url(&Method::POST, &url("https://other.example/api/a")));
        assert_eq!(
            Route::new("bad name", limit, "/").map(drop),
            Err(crate::middleware::InvalidRoute::BucketName(
                crate::InvalidName::Character {
                    index: 3,
                    byte: b' '
                }
            ))
        );
        assert_eq!(
            Route::new("x", limit, "no-slash").map(drop),
            Err(crate::middleware::InvalidRoute::Path)
        );
    }

    fn orders_route() -> Route {
        let limit = Limit::per_minute(1).expect("a valid limit");
        Route::new("orders", limit, "/api/v1/supplier/orders").expect("a route")
    }

    fn url(s: &str) -> reqwest::Url {
        reqwest::Url::parse(s).expect("a valid url")
    }

    #[test]
    fn a_percent_encoded_unreserved_char_as_in_6frders_does_not_escape_its_route() {
        let orders = orders_route();
        for path in [
            "/api/v1/supplier/%6Frders",
            "/api/v1/supplier/%6frders",
            "/%61pi/v%31/supplier/ord%65rs",
            "/api/v1/supplier/%6F%72%64%65%72%73",
        ] {
            let at = url(&format!("https://h{path}"));
            assert!(orders.matches_url(&Method::GET, &at), "{path} escaped");
        }
        // Unreserved punctuation decodes too, in patterns as in paths.
        let limit = orders.limit();
        let punct = Route::new("p", limit, "/a-b.c_d~e").expect("a route");
        assert!(punct.matches_url(&Method::GET, &url("https://h/a%2Db%2Ec%5Fd%7ee")));
        let encoded_pattern = Route::new("p", limit, "/%61-b.c_d~e").expect("a route");
        assert!(encoded_pattern.matches_url(&Method::GET, &url("https://h/a-b.c_d~e")));
        // What stays: case in the path, an escape of an upper-case letter, an encoded slash.
        for path in [
            "/api/v1/supplier/Orders",
            "/api/v1/supplier/%4Frders",
            "/api/v1/supplier%2Forders",
            "/api/v1/supplier%2forders",
            "/api/v1/supplier/orders%2Ejson",
        ] {
            let at = url(&format!("https://h{path}"));
            assert!(!orders.matches_url(&Method::GET, &at), "{path} matched");
        }
        // Any other escape keeps its meaning, and the case of its hex digits does not matter.
        let slash = Route::new("s", limit, "/files/a%2fb").expect("a route");
        assert!(slash.matches_url(&Method::GET, &url("https://h/files/a%2Fb")));
        assert!(!slash.matches_url(&Method::GET, &url("https://h/files/a/b")));
    }

    #[test]
    fn dot_segments_as_in_dot_slash_and_x_dot_dot_do_not_escape_their_route() {
        let orders = orders_route();
        let paths = [
            "/api/v1/./supplier/orders",
            "/api/v1/supplier/x/../orders",
            "/api/v1/supplier/%2E/orders",
            "/api/v1/supplier/x/%2e%2E/orders",
            "/api/v1/supplier/x/.%2E/orders",
            "/../api/v1/supplier/orders",
            "/api/v1/supplier/orders/x/..",
            "/api/v1/supplier//x/../orders",
        ];
        for path in paths {
            // A parsed URL has its dot segments removed already; a path handed over as text has
            // not, and is normalized here.
            let at = url(&format!("https://h{path}"));
            assert!(orders.matches_url(&Method::GET, &at), "{path} escaped");
            assert!(orders.matches_path(path), "{path} escaped");
        }
        for path in [
            "/api/v1/supplier/orders/..",
            "/api/v1/supplier/x%2E%2E/orders",
            "/api/v1/supplier/../orders",
        ] {
            assert!(!orders.matches_path(path), "{path} matched");
        }
        // A pattern is normalized the same way.
        let limit = orders.limit();
        let dotted = Route::new("d", limit, "/api/./v1/x/../orders").expect("a route");
        assert!(dotted.matches_url(&Method::GET, &url("https://h/api/v1/orders")));
    }

    #[test]
    fn an_uppercase_host_or_one_with_a_trailing_dot_does_not_escape_its_route() {
        let orders = orders_route().host("api.example");
        for at in [
            "https://API.EXAMPLE/api/v1/supplier/orders",
            "https://Api.Example./api/v1/supplier/orders",
            "https://api.example.:8443/api/v1/supplier/orders",
        ] {
            assert!(orders.matches_url(&Method::GET, &url(at)), "{at} escaped");
        }
        let dotted = orders_route().host("API.Example.");
        assert!(dotted.matches_url(
            &Method::GET,
            &url("https://api.example/api/v1/supplier/orders")
        ));
        assert!(!orders.matches_url(
            &Method::GET,
            &url("https://api.example.com/api/v1/supplier/orders")
        ));
        assert!(!orders.matches_url(
            &Method::GET,
            &url("https://xapi.example/api/v1/supplier/orders")
        ));
    }

    #[test]
    fn empty_segments_and_a_trailing_slash_are_skipped_in_paths_and_patterns() {
        let limit = Limit::per_minute(1).expect("a valid limit");
        let trailing = Route::new("t", limit, "/api/v1/").expect("a route");
        for path in ["/api/v1", "/api/v1/", "//api//v1//"] {
            assert!(trailing.matches_path(path), "{path}");
        }
        assert!(!trailing.matches_path("/api/v1/x"));
    }

    /// Path segments of unreserved characters, each character with how to spell it (0 as it is, 1
    /// an escape in upper-case hex, 2 in lower case), and what to put before the segment (0
    /// nothing, 1 `./`, 2 `x/../`, 3 `%2E/`, 4 `x/%2e%2E/`, 5 an empty segment).
    fn spelled_segments() -> impl Strategy<Value = Vec<(Vec<(char, u8)>, u8)>> {
        let unreserved: Vec<char> = ('a'..='z')
            .chain('A'..='Z')
            .chain('0'..='9')
            .chain(['-', '.', '_', '~'])
            .collect();
        let segment =
            proptest::collection::vec((proptest::sample::select(unreserved), 0..3u8), 1..8)
                .prop_filter("not a dot segment", |s| {
                    !(s.len() <= 2 && s.iter().all(|(c, _)| *c == '.'))
                });
        proptest::collection::vec((segment, 0..6u8), 1..5)
    }

    proptest! {
        #![proptest_config(fuzz_config())]

        /// Any spelling of a path with escaped unreserved characters and dot segments matches the
        /// route of its plain spelling, and one segment more does not.
        #[test]
        fn any_percent_encoding_of_a_matching_path_still_matches(segments in spelled_segments()) {
            let plain: String = segments
                .iter()
                .map(|(s, _)| format!("/{}", s.iter().map(|(c, _)| *c).collect::<String>()))
                .collect();
            let mut spelled = String::new();
            for (segment, before) in &segments {
                let prefix = ["", "/.", "/x/..", "/%2E", "/x/%2e%2E", "/"][usize::from(*before)];
                spelled.push_str(prefix);
                spelled.push('/');
                for (c, how) in segment {
                    match how {
                        0 => spelled.push(*c),
                        1 => spelled.push_str(&format!("%{:02X}", u32::from(*c))),
                        _ => spelled.push_str(&format!("%{:02x}", u32::from(*c))),
                    }
                }
            }
            let limit = Limit::per_minute(1).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let route = Route::new("p", limit, &plain)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let at = reqwest::Url::parse(&format!("https://h{spelled}"))
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert!(route.matches_url(&Method::GET, &at), "{} escaped {}", spelled, plain);
            prop_assert!(route.matches_path(&spelled), "{} escaped {}", spelled, plain);
            let longer = format!("{spelled}/more");
            prop_assert!(!route.matches_path(&longer), "{} matched {}", longer, plain);
        }
    }
}
