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
mod tests;
