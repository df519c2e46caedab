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
        limit(1, Duration::from_millis(60_600), 10)
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
    let key =
        BucketKey::hashed(&format!("{token_type}-{}", group.name()), token).expect("a valid key");
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
