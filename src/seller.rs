//! The seller-API preset: the marketplace seller API's published limits as ready values, and
//! the [`Route`]s that put them on the [`RateLimitMiddleware`](crate::RateLimitMiddleware).
//!
//! ```
//! use burstgate::MemoryStore;
//! use burstgate::middleware::RateLimitMiddleware;
//! use burstgate::seller;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // One set of routes per token type; the account comes from each request's token.
//! let routes = seller::routes("personal", &seller::groups())?;
//! assert_eq!(routes[0].bucket(), "personal-orders");
//! assert_eq!(routes[0].limit().to_string(), "1/min burst 10");
//!
//! let middleware = RateLimitMiddleware::new(MemoryStore::new())
//!     .routes(routes)
//!     .account_header(http::header::AUTHORIZATION);
//! let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
//!     .with(middleware)
//!     .build();
//! # let _ = client;
//! # Ok(())
//! # }
//! ```
//!
//! # The numbers, and where they come from
//!
//! Source: the seller API's published limits table, per seller account, as of November 2026:
//!
//! | Group | Function | Default path pattern | Method | Limit |
//! |---|---|---|---|---|
//! | orders | [`orders`] | `/api/v1/supplier/orders` | any | 1 per minute, burst 10 |
//! | warehouse-remains report creation | [`warehouse_remains_report`] | `/api/v1/warehouse_remains` | `GET` | 1 per minute (assumed), burst 5 |
//! | sales funnel v3 | [`sales_funnel_v3`] | `/api/analytics/v3/sales-funnel/**` | `POST` | 1 per minute (assumed), burst 3 |
//! | sales | [`sales`] | `/api/v1/supplier/sales` | any | 1 per minute (assumed), burst 1 (no burst) |
//!
//! The table records only the burst for the last three groups; this module assumes the same rate
//! as orders, **1 request per minute**, for them. Check the API's current table before relying on
//! it: every number and every path here can be overridden. A [`Group`] is a [`Route`] template
//! named after the group, so a group is adjusted through `Route`'s own API ([`Route::new`] for
//! another path, [`Route::method`], [`Route::host`]), or with [`Group::limit`] for its limit
//! alone; a published row converts with [`limit_from_table`]. A group runs slightly under the
//! published rate, as every [`Route`] does by default, which a client needs against an API that
//! enforces its own token bucket with no tolerance ([`Route::margin`] says why); [`Group::margin`]
//! sets another margin, or none. A group the preset does not name is one
//! [`Group::new`] away.
//!
//! # Keyed by token type and account
//!
//! [`routes`] builds one [`Route`] per group for one token type, with the bucket name
//! `<token type>-<group name>` (`personal-orders`, `service-orders`, ...), so budgets of
//! different token types never mix. The *account* is not part of the route: the middleware takes
//! it from each request, from an [`Account`](crate::middleware::Account) extension or, with
//! [`account_header(AUTHORIZATION)`](crate::RateLimitMiddleware::account_header), from the API
//! token itself (hashed, never stored or logged in clear). That is how the budget is kept per
//! account and per endpoint: every worker, in every process, that sends the same token to the
//! same group spends from the same bucket, and with a `RedisStore` (feature `redis`) that
//! bucket is shared by every process that reaches the Redis.
//!
//! # When the API still answers 429
//!
//! The API answers a request over its limit with `429 Too Many Requests` and says how long to wait
//! in `X-Ratelimit-Retry` (seconds) and `Retry-After`. The middleware reads `X-Ratelimit-Retry`
//! first, then `Retry-After`, and drains the shared bucket for that account and group until then,
//! so every worker backs off, not only the one that was told. Requests already admitted after a
//! wait keep their turn; new ones queue behind the back-off, which lasts the longer of the time
//! the API gave (whole seconds, so at least one) and one token period (a minute for this table):
//! a 429 is expensive, the reason a group runs with a small [margin](Group::margin) rather
//! than exactly at the published rate.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use http::Method;

use crate::key::check_name;
use crate::middleware::{InvalidRoute, Route};
use crate::{InvalidLimit, Limit};

/// A [`Limit`] from the four columns the API's limits table publishes: `limit` requests per
/// `period`, one every `interval`, with `burst`.
///
/// The `interval` column is redundant, so it is checked: it must equal `period / limit` exactly
/// (`interval × limit == period`), or the row is refused with [`TableError::Inconsistent`], since
/// a misread column would otherwise set the wrong rate silently. The other columns are validated
/// as [`Limit::published`] validates them.
///
/// ```
/// use std::time::Duration;
/// use burstgate::Limit;
/// use burstgate::seller::{TableError, limit_from_table};
///
/// let minute = Duration::from_secs(60);
/// let orders = limit_from_table(minute, 1, minute, 10)?;
/// assert_eq!(orders, Limit::per_minute(1)?.with_burst(10)?);
///
/// // 300 per minute is one every 200 ms.
/// assert!(limit_from_table(minute, 300, Duration::from_millis(200), 20).is_ok());
/// assert!(matches!(
///     limit_from_table(minute, 300, Duration::from_secs(1), 20),
///     Err(TableError::Inconsistent { .. })
/// ));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn limit_from_table(
    period: Duration,
    limit: u32,
    interval: Duration,
    burst: u32,
) -> Result<Limit, TableError> {
    let parsed = Limit::published(period, limit, burst).map_err(TableError::Limit)?;
    if interval.as_nanos() * u128::from(limit) != period.as_nanos() {
        return Err(TableError::Inconsistent {
            period,
            limit,
            interval,
        });
    }
    Ok(parsed)
}

/// A named group of the seller API: a [`Route`] template, named after the group, for the
/// requests the group covers (a path pattern, optionally a method and a host) and the limit they
/// share per account.
///
/// The four groups of the published table are [`orders`], [`warehouse_remains_report`],
/// [`sales_funnel_v3`] and [`sales`]; [`groups`] returns all of them. Everything a group matches
/// is its template's, set through [`Route`]'s own API: a group of your own, or a preset on
/// another path, is [`Group::new`] over a [`Route::new`], and [`Group::into_template`] hands a
/// preset's route back to build on ([`Route::method`], [`Route::host`]). [`Group::limit`]
/// replaces the limit alone, and [`Group::margin`] lengthens it, keeping the pattern.
///
/// ```
/// use burstgate::Limit;
/// use burstgate::middleware::Route;
/// use burstgate::seller::{self, Group};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// // The API raised the orders burst.
/// let orders = seller::orders().limit(Limit::per_minute(1)?.with_burst(20)?);
/// assert_eq!(orders.template().limit().burst(), 20);
///
/// // Then the group moved to a v2 path, served from one host.
/// let v2 = Route::new("orders", orders.template().limit(), "/api/v2/supplier/orders")?
///     .host("statistics-api.example");
/// let orders = Group::new(v2);
/// assert_eq!(orders.route("personal")?.bucket(), "personal-orders");
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// Its bucket name is the group's name, which [`Group::route`] prefixes with a token type.
    template: Route,
}

impl Group {
    /// The group named after `template`'s bucket name, for the requests `template` matches,
    /// under its limit. [`Route::new`] has validated the name (1 to 64 ASCII letters, digits,
    /// `_`, `.` or `-`) and the path.
    pub fn new(template: Route) -> Self {
        Self { template }
    }

    /// The same group under another limit, on the same path, method and host, with the
    /// default margin ([`Route::new`]); a [`margin`](Self::margin) set before is dropped.
    #[must_use]
    pub fn limit(self, limit: Limit) -> Self {
        Self {
            template: self.template.relimited(limit),
        }
    }

    /// The same group with every token's period lengthened by `per_token` instead of the default
    /// margin ([`Route::margin`], which says why): "1 per minute" with a margin of 20 ms is "1
    /// per 60.02 s"; the burst is kept, and `Duration::ZERO` runs at the published rate. For a group without burst the API's bucket loses any
    /// lateness to its cap of one token, so its first request's delay is never made up.
    ///
    /// # Errors
    ///
    /// As [`Limit::with_margin`].
    pub fn margin(self, per_token: Duration) -> Result<Self, InvalidLimit> {
        Ok(Self {
            template: self.template.margin(per_token)?,
        })
    }

    /// The group's name, the second half of its bucket names.
    pub fn name(&self) -> &str {
        self.template.bucket()
    }

    /// The route template: the group's path, method, host and limit, under the group's name.
    pub fn template(&self) -> &Route {
        &self.template
    }

    /// The route template, to build another group on.
    pub fn into_template(self) -> Route {
        self.template
    }

    /// The middleware route for this group and `token_type`: the template, drawing from bucket
    /// `<token_type>-<name>`.
    ///
    /// Fails when `token_type` is not a valid name (1 to 64 ASCII letters, digits, `_`, `.` or
    /// `-`), or when the bucket name is longer than 64 bytes.
    pub fn route(&self, token_type: &str) -> Result<Route, InvalidRoute> {
        check_name(token_type).map_err(InvalidRoute::BucketName)?;
        let bucket = format!("{token_type}-{}", self.name());
        self.template.clone().renamed(&bucket)
    }
}

/// "1 per minute" with `burst`, the shape of every row in the table.
fn per_minute_with_burst(burst: u32) -> Limit {
    match Limit::per_minute(1).and_then(|l| l.with_burst(burst)) {
        Ok(limit) => limit,
        // One token per minute with a burst of at most ten is far inside every bound `Limit`
        // checks; the unit tests build every group.
        Err(_) => unreachable!("1 per minute with a small burst is a valid limit"),
    }
}

/// Builds a preset group from literals.
fn preset(name: &'static str, path: &'static str, method: Option<Method>, burst: u32) -> Group {
    let route = match Route::new(name, per_minute_with_burst(burst), path) {
        Ok(route) => route,
        // Every preset's name is a valid bucket name and its path starts with `/`; the unit
        // tests build every group.
        Err(_) => unreachable!("a preset's name and path are valid"),
    };
    Group::new(match method {
        Some(method) => route.method(method),
        None => route,
    })
}

/// Orders: `/api/v1/supplier/orders`, any method, **1 request per minute, burst 10** per account.
pub fn orders() -> Group {
    preset("orders", "/api/v1/supplier/orders", None, 10)
}

/// Warehouse-remains report creation: `GET /api/v1/warehouse_remains`, **burst 5** per account.
/// The table gives only the burst; the rate is assumed to be 1 request per minute.
pub fn warehouse_remains_report() -> Group {
    preset(
        "warehouse-remains",
        "/api/v1/warehouse_remains",
        Some(Method::GET),
        5,
    )
}

/// Sales funnel v3: `POST /api/analytics/v3/sales-funnel/**`, **burst 3** per account. The
/// table gives only the burst; the rate is assumed to be 1 request per minute.
pub fn sales_funnel_v3() -> Group {
    preset(
        "sales-funnel-v3",
        "/api/analytics/v3/sales-funnel/**",
        Some(Method::POST),
        3,
    )
}

/// Sales: `/api/v1/supplier/sales`, any method, **burst 1** (no burst) per account. The table
/// gives only the burst; the rate is assumed to be 1 request per minute.
pub fn sales() -> Group {
    preset("sales", "/api/v1/supplier/sales", None, 1)
}

/// The four groups of the published table, in its order: orders, warehouse-remains report
/// creation, sales funnel v3, sales.
pub fn groups() -> Vec<Group> {
    vec![
        orders(),
        warehouse_remains_report(),
        sales_funnel_v3(),
        sales(),
    ]
}

/// The middleware routes for `groups` under one token type, in the same order: bucket
/// `<token_type>-<group name>` for each. No two groups' patterns overlap, so each request
/// matches one of them.
///
/// Build one set per token type the program uses; the account is taken per request by the
/// middleware (see the [module docs](self#keyed-by-token-type-and-account)). Fails as
/// [`Group::route`] does.
pub fn routes(token_type: &str, groups: &[Group]) -> Result<Vec<Route>, InvalidRoute> {
    groups.iter().map(|g| g.route(token_type)).collect()
}

/// Why [`limit_from_table`] refused a row of the limits table.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TableError {
    /// The period, limit or burst do not make a valid [`Limit`].
    Limit(InvalidLimit),
    /// The interval column is not `period / limit`.
    Inconsistent {
        /// The period column.
        period: Duration,
        /// The limit column (requests per period).
        limit: u32,
        /// The interval column.
        interval: Duration,
    },
}

impl fmt::Display for TableError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Limit(e) => fmt::Display::fmt(e, f),
            Self::Inconsistent {
                period,
                limit,
                interval,
            } => write!(
                f,
                "an interval of {interval:?} does not match {limit} requests per {period:?}"
            ),
        }
    }
}

impl StdError for TableError {}

impl From<InvalidLimit> for TableError {
    fn from(e: InvalidLimit) -> Self {
        Self::Limit(e)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http::Extensions;
    use http::header::AUTHORIZATION;
    use reqwest::{Request, Response};
    use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};

    use super::*;
    use crate::middleware::{Account, RateLimitMiddleware};
    use crate::{BucketKey, BucketStore, InvalidName, ManualClock, MemoryStore};

    const MINUTE: Duration = Duration::from_secs(60);

    fn limit(tokens: u32, interval: Duration, burst: u32) -> Limit {
        Limit::new(tokens, interval)
            .and_then(|l| l.with_burst(burst))
            .expect("a valid limit")
    }

    #[test]
    fn a_consistent_table_row_is_a_limit() {
        assert_eq!(
            limit_from_table(MINUTE, 1, MINUTE, 10),
            Ok(limit(1, MINUTE, 10))
        );
        assert_eq!(
            limit_from_table(MINUTE, 300, Duration::from_millis(200), 20),
            Ok(limit(300, MINUTE, 20))
        );
    }

    #[test]
    fn an_inconsistent_interval_is_refused() {
        let err = limit_from_table(MINUTE, 1, Duration::from_secs(30), 10);
        assert_eq!(
            err,
            Err(TableError::Inconsistent {
                period: MINUTE,
                limit: 1,
                interval: Duration::from_secs(30),
            })
        );
        // A third of a second, rounded, is not a third of a second.
        assert_eq!(
            limit_from_table(
                Duration::from_secs(1),
                3,
                Duration::from_nanos(333_333_333),
                3
            )
            .map(drop),
            Err(TableError::Inconsistent {
                period: Duration::from_secs(1),
                limit: 3,
                interval: Duration::from_nanos(333_333_333),
            })
        );
        // The interval column alone is wrong: zero.
        assert!(matches!(
            limit_from_table(MINUTE, 1, Duration::ZERO, 10),
            Err(TableError::Inconsistent { .. })
        ));
    }

    #[test]
    fn zero_columns_are_refused_as_invalid_limits() {
        assert_eq!(
            limit_from_table(MINUTE, 0, MINUTE, 10),
            Err(TableError::Limit(InvalidLimit::ZeroTokens))
        );
        assert_eq!(
            limit_from_table(MINUTE, 1, MINUTE, 0),
            Err(TableError::Limit(InvalidLimit::ZeroBurst))
        );
        assert_eq!(
            limit_from_table(Duration::ZERO, 1, Duration::ZERO, 1),
            Err(TableError::Limit(InvalidLimit::ZeroInterval))
        );
    }

    #[test]
    fn table_messages_are_lowercase_without_trailing_dot() {
        let errors = [
            TableError::Limit(InvalidLimit::ZeroTokens),
            TableError::Inconsistent {
                period: MINUTE,
                limit: 1,
                interval: Duration::from_secs(30),
            },
        ];
        for e in errors {
            let m = e.to_string();
            assert!(
                m.starts_with(char::is_lowercase) && !m.ends_with('.'),
                "{m}"
            );
        }
        assert_eq!(
            TableError::Inconsistent {
                period: MINUTE,
                limit: 1,
                interval: Duration::from_secs(30),
            }
            .to_string(),
            "an interval of 30s does not match 1 requests per 60s"
        );
    }

    #[test]
    fn the_groups_carry_the_published_numbers() {
        let expected = [
            ("orders", "/api/v1/supplier/orders", None, 10),
            (
                "warehouse-remains",
                "/api/v1/warehouse_remains",
                Some(Method::GET),
                5,
            ),
            (
                "sales-funnel-v3",
                "/api/analytics/v3/sales-funnel/**",
                Some(Method::POST),
                3,
            ),
            ("sales", "/api/v1/supplier/sales", None, 1),
        ];
        let groups = groups();
        assert_eq!(groups.len(), expected.len());
        for (group, (name, path, method, burst)) in groups.iter().zip(expected) {
            assert_eq!(group.name(), name);
            // The path, the method, no host, and the limit, all at once.
            let route = Route::new(name, limit(1, MINUTE, burst), path).expect("a valid route");
            let route = match method {
                Some(method) => route.method(method),
                None => route,
            };
            assert_eq!(group.template(), &route, "{name}");
            assert_eq!(group.template().limit(), limit(1, MINUTE, burst), "{name}");
        }
        assert_eq!(orders().template().limit().to_string(), "1/min burst 10");
        assert_eq!(sales().template().limit().burst(), 1);
    }

    fn url(s: &str) -> reqwest::Url {
        reqwest::Url::parse(s).expect("a valid URL")
    }

    #[test]
    fn every_part_of_a_group_can_be_overridden() {
        let faster = limit(2, MINUTE, 20);
        let template = Route::new(orders().name(), faster, "/api/v2/orders")
            .expect("a valid route")
            .method(Method::GET)
            .host("statistics-api.example");
        let g = Group::new(template);
        assert_eq!(g.template().limit(), faster);
        assert_eq!(g.name(), "orders");
        let r = g.route("personal").expect("a valid route");
        assert_eq!(r.limit(), faster);
        let v2 = url("https://statistics-api.example/api/v2/orders");
        assert!(r.matches_url(&Method::GET, &v2));
        let v1 = url("https://statistics-api.example/api/v1/supplier/orders");
        assert!(!r.matches_url(&Method::GET, &v1), "the path");
        assert!(!r.matches_url(&Method::POST, &v2), "the method");
        let elsewhere = url("https://content-api.example/api/v2/orders");
        assert!(!r.matches_url(&Method::GET, &elsewhere), "the host");

        // The limit alone: the preset's pattern, of any method to any host, is kept.
        let g = orders().limit(faster);
        assert_eq!(g.template().limit(), faster);
        assert_eq!(g.name(), "orders");
        let r = g.route("personal").expect("a valid route");
        let v1_elsewhere = url("https://content-api.example/api/v1/supplier/orders");
        assert!(r.matches_url(&Method::POST, &v1_elsewhere));

        // A preset's template, built on: a host added, its path and limit kept.
        let hosted = Group::new(orders().into_template().host("statistics-api.example"));
        assert_eq!(hosted.template().limit(), orders().template().limit());
        let r = hosted.route("personal").expect("a valid route");
        assert!(r.matches_url(&Method::GET, &v1));
        assert!(!r.matches_url(&Method::GET, &v1_elsewhere));
    }

    #[test]
    fn a_margin_lengthens_each_token_period_and_keeps_the_burst() {
        let published = limit(1, MINUTE, 10);
        let g = orders()
            .margin(Duration::from_millis(20))
            .expect("a valid margin");
        assert_eq!(g.template().limit(), published);
        assert_eq!(
            g.template().bucket_limit(),
            limit(1, Duration::from_millis(60_020), 10)
        );
        // A margin replaces the default one, never adds to it, and `limit` puts the default back.
        assert_eq!(
            orders().template().bucket_limit(),
            limit(1, Duration::from_millis(60_010), 10)
        );
        assert_eq!(g.clone().margin(Duration::from_millis(20)), Ok(g.clone()));
        assert_eq!(g.limit(published), orders());
        let fast = orders()
            .limit(limit(300, MINUTE, 20))
            .margin(Duration::from_millis(1))
            .expect("a valid margin");
        assert_eq!(
            fast.template().bucket_limit(),
            limit(300, Duration::from_millis(60_300), 20)
        );
        assert_eq!(
            orders().margin(Duration::from_micros(1500)).map(drop),
            Err(InvalidLimit::SubMillisecondInterval {
                interval: Duration::from_micros(60_001_500)
            })
        );
        assert_eq!(
            orders().margin(Duration::MAX).map(drop),
            Err(InvalidLimit::TooSlow)
        );
        let exact = sales().margin(Duration::ZERO).expect("no margin");
        assert_eq!(exact.template().bucket_limit(), sales().template().limit());
    }

    #[test]
    fn bad_names_token_types_and_paths_are_refused() {
        let l = limit(1, MINUTE, 1);
        let bad = |index, byte| {
            Err(InvalidRoute::BucketName(InvalidName::Character {
                index,
                byte,
            }))
        };
        // A group's name is its template's bucket name.
        let group = |name: &str, path: &str| Route::new(name, l, path).map(Group::new);
        assert_eq!(group("a b", "/x").map(drop), bad(1, b' '));
        let empty = Err(InvalidRoute::BucketName(InvalidName::Empty));
        assert_eq!(group("", "/x").map(drop), empty);
        assert_eq!(routes("", &groups()).map(drop), empty);
        assert_eq!(routes("per:sonal", &groups()).map(drop), bad(3, b':'));
        // Each half is a valid name, but together they pass 64 bytes.
        let long = group(&"g".repeat(40), "/x").expect("a valid group");
        assert_eq!(
            long.route(&"t".repeat(40)).map(drop),
            Err(InvalidRoute::BucketName(InvalidName::TooLong { len: 81 }))
        );
        assert_eq!(
            group("orders", "api/v1/supplier/orders"),
            Err(InvalidRoute::Path)
        );
    }

    #[test]
    fn routes_are_named_per_token_type_and_keep_the_order() {
        let personal = routes("personal", &groups()).expect("valid routes");
        let names: Vec<&str> = personal.iter().map(Route::bucket).collect();
        assert_eq!(
            names,
            [
                "personal-orders",
                "personal-warehouse-remains",
                "personal-sales-funnel-v3",
                "personal-sales"
            ]
        );
        let limits: Vec<u32> = personal.iter().map(|r| r.limit().burst()).collect();
        assert_eq!(limits, [10, 5, 3, 1]);
        let service = routes("service", &[sales()]).expect("valid routes");
        assert_eq!(service[0].bucket(), "service-sales");
        assert!(routes("personal", &[]).expect("no routes").is_empty());
    }

    /// Answers every request `200 OK` without a network, in place of the HTTP client.
    struct Answer;

    #[async_trait::async_trait]
    impl Middleware for Answer {
        async fn handle(
            &self,
            _req: Request,
            _extensions: &mut Extensions,
            _next: Next<'_>,
        ) -> reqwest_middleware::Result<Response> {
            Ok(Response::from(http::Response::new("")))
        }
    }

    fn client(store: MemoryStore<ManualClock>, token_type: &str) -> ClientWithMiddleware {
        let routes = routes(token_type, &groups()).expect("valid routes");
        let middleware = RateLimitMiddleware::new(store)
            .routes(routes)
            .account_header(AUTHORIZATION)
            .max_wait(Duration::ZERO);
        ClientBuilder::new(reqwest::Client::new())
            .with(middleware)
            .with(Answer)
            .build()
    }

    /// Whole tokens left in the bucket of `group` for `token` under `token_type`.
    async fn remaining(
        store: &MemoryStore<ManualClock>,
        token_type: &str,
        group: &Group,
        token: &str,
    ) -> u32 {
        let key = BucketKey::hashed(&format!("{token_type}-{}", group.name()), token)
            .expect("a valid key");
        store
            .peek(&key, group.template().limit())
            .await
            .expect("a peek")
            .remaining()
    }

    #[tokio::test]
    async fn requests_draw_from_their_group_token_type_and_account() {
        let store = MemoryStore::new().with_clock(ManualClock::new(1_767_225_600_000));
        let personal = client(store.clone(), "personal");
        let base = "http://seller.example";
        let send = |req: reqwest_middleware::RequestBuilder| async move {
            req.send().await.map(|r| r.status().as_u16())
        };
        let a = "Bearer token-a";

        let orders_url = format!("{base}/api/v1/supplier/orders?dateFrom=2026-11-01");
        let status = send(personal.get(&orders_url).header(AUTHORIZATION, a)).await;
        assert_eq!(status.ok(), Some(200));
        assert_eq!(remaining(&store, "personal", &orders(), a).await, 9);

        // The funnel group matches POST under its prefix, not GET.
        let funnel_url = format!("{base}/api/analytics/v3/sales-funnel/products");
        for _ in 0..2 {
            let status = send(personal.post(&funnel_url).header(AUTHORIZATION, a)).await;
            assert_eq!(status.ok(), Some(200));
        }
        let status = send(personal.get(&funnel_url).header(AUTHORIZATION, a)).await;
        assert_eq!(status.ok(), Some(200));
        assert_eq!(
            remaining(&store, "personal", &sales_funnel_v3(), a).await,
            1
        );

        // Warehouse remains: GET only.
        let remains_url = format!("{base}/api/v1/warehouse_remains?groupByBrand=true");
        let status = send(personal.get(&remains_url).header(AUTHORIZATION, a)).await;
        assert_eq!(status.ok(), Some(200));
        let status = send(personal.post(&remains_url).header(AUTHORIZATION, a)).await;
        assert_eq!(status.ok(), Some(200));
        let remains = warehouse_remains_report();
        assert_eq!(remaining(&store, "personal", &remains, a).await, 4);

        // Sales has no burst: the second request within the minute is the local 429.
        let sales_url = format!("{base}/api/v1/supplier/sales");
        let first = send(personal.get(&sales_url).header(AUTHORIZATION, a)).await;
        assert_eq!(first.ok(), Some(200));
        let second = send(personal.get(&sales_url).header(AUTHORIZATION, a)).await;
        match second {
            Err(reqwest_middleware::Error::Middleware(e)) => {
                let limited = e.downcast_ref::<crate::RateLimited>();
                assert_eq!(
                    limited.map(crate::RateLimited::bucket),
                    Some("personal-sales")
                );
            }
            other => panic!("expected the local 429, got {other:?}"),
        }

        // Another account, and the same account under another token type, start full.
        let b = "Bearer token-b";
        let status = send(personal.get(&sales_url).header(AUTHORIZATION, b)).await;
        assert_eq!(status.ok(), Some(200));
        let service = client(store.clone(), "service");
        let status = send(service.get(&sales_url).header(AUTHORIZATION, a)).await;
        assert_eq!(status.ok(), Some(200));
        assert_eq!(remaining(&store, "service", &orders(), a).await, 10);

        // An `Account` extension names the account in clear (escaped) instead of the header.
        let status = send(
            personal
                .get(&orders_url)
                .header(AUTHORIZATION, a)
                .with_extension(Account::new("seller-42")),
        )
        .await;
        assert_eq!(status.ok(), Some(200));
        let key = BucketKey::new("personal-orders", "seller-42").expect("a valid key");
        let quota = store
            .peek(&key, orders().template().limit())
            .await
            .expect("a peek");
        assert_eq!(quota.remaining(), 9);
        assert_eq!(remaining(&store, "personal", &orders(), a).await, 9);
    }
}
