//! The rate-limit fields the layer writes, in each format (draft-ietf-httpapi-ratelimit-headers-11
//! by default, 10 and 06 on request), on a sub-second refill: what `q`, `w`, `r` and `t` say
//! after a few requests, with time paused so every value is exact, each field also read back
//! with an RFC 9651 parser.
#![cfg(feature = "tower")]

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use burstgate::layer::{FieldVersion, KeyExtractor, RateLimitLayer, Rule};
use burstgate::{Limit, MemoryStore, TokioClock};
use http::{Request, StatusCode};
use tower::Layer;

use crate::support::layer::{API_KEY, Req, Res, call, counting};

/// "10/s burst 3": a token every 100 ms, an empty bucket full again in 300 ms.
fn fast() -> Limit {
    "10/s burst 3".parse().expect("a valid limit")
}

fn request(key: Option<&str>) -> Req {
    let mut builder = Request::builder().uri("/search");
    if let Some(key) = key {
        builder = builder.header(API_KEY, key);
    }
    builder.body(String::new()).expect("a valid request")
}

fn header<'a>(res: &'a Res, name: &str) -> Option<&'a str> {
    res.headers()
        .get(name)
        .map(|v| v.to_str().expect("an ASCII header value"))
}

fn layer(
    version: FieldVersion,
    rules: impl IntoIterator<Item = Rule>,
) -> RateLimitLayer<MemoryStore<TokioClock>> {
    let store = MemoryStore::new().with_clock(TokioClock::new());
    rules.into_iter().fold(
        RateLimitLayer::new(store).fields(version),
        RateLimitLayer::rule,
    )
}

/// A request without the key draws from the other rules alone.
fn per_key() -> Rule {
    Rule::new("per-key", fast(), KeyExtractor::header(API_KEY))
        .expect("a valid rule")
        .on_missing_key(burstgate::layer::MissingKey::Pass)
}

/// `(name, [(key, value)])` of each item of a `RateLimit` or `RateLimit-Policy` field, as an
/// RFC 9651 parser reads it.
fn items(res: &Res, name: &str) -> Vec<(String, Vec<(String, i64)>)> {
    let value = res.headers().get(name).expect("the field");
    let list: sfv::List = sfv::Parser::new(value.as_bytes())
        .parse()
        .expect("a structured list");
    list.into_iter()
        .map(|entry| match entry {
            sfv::ListEntry::Item(item) => {
                let name = item
                    .bare_item
                    .as_string()
                    .expect("a string")
                    .as_str()
                    .to_owned();
                let params = item
                    .params
                    .iter()
                    .map(|(k, v)| {
                        let n = v.as_integer().expect("an integer parameter");
                        (k.as_str().to_owned(), i64::from(n))
                    })
                    .collect();
                (name, params)
            }
            sfv::ListEntry::InnerList(_) => panic!("an inner list in {value:?}"),
        })
        .collect()
}

fn item(name: &str, params: &[(&str, i64)]) -> (String, Vec<(String, i64)>) {
    let params = params.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect();
    (name.to_owned(), params)
}

fn integer(res: &Res, name: &str) -> Option<i64> {
    let value = res.headers().get(name)?;
    let item: sfv::Item = sfv::Parser::new(value.as_bytes()).parse().ok()?;
    assert!(item.params.is_empty(), "{value:?}");
    item.bare_item.as_integer().map(i64::from)
}

#[tokio::test(start_paused = true)]
async fn draft11_fields_on_a_sub_second_refill() {
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = layer(FieldVersion::default(), [per_key()]).layer(counting(&calls));
    // Ten a second, sustained over the one-second window: not the burst of 3.
    let policy = [item("per-key", &[("q", 10), ("w", 1)])];

    // Tokens left, but the bucket is refilling: the next token in 100 ms, t=1, not 0.
    let res = call(&mut svc, request(Some("k1"))).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(header(&res, "ratelimit"), Some("\"per-key\";r=2;t=1"));
    assert_eq!(
        header(&res, "ratelimit-policy"),
        Some("\"per-key\";q=10;w=1")
    );
    assert_eq!(items(&res, "ratelimit-policy"), policy);
    let res = call(&mut svc, request(Some("k1"))).await;
    assert_eq!(
        items(&res, "ratelimit"),
        [item("per-key", &[("r", 1), ("t", 1)])]
    );

    // 30 ms on, the third takes the last whole token; the next is 70 ms away.
    tokio::time::advance(Duration::from_millis(30)).await;
    let res = call(&mut svc, request(Some("k1"))).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(header(&res, "ratelimit"), Some("\"per-key\";r=0;t=1"));
    let res = call(&mut svc, request(Some("k1"))).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&res, "retry-after"), Some("1"));
    assert_eq!(
        items(&res, "ratelimit"),
        [item("per-key", &[("r", 0), ("t", 1)])]
    );
    assert_eq!(items(&res, "ratelimit-policy"), policy);
    assert_eq!(header(&res, "ratelimit-limit"), None);

    // A second on the bucket is full again, and the next request leaves it refilling.
    tokio::time::advance(Duration::from_secs(1)).await;
    let res = call(&mut svc, request(Some("k1"))).await;
    assert_eq!(header(&res, "ratelimit"), Some("\"per-key\";r=2;t=1"));
}

/// A bucket full again after a refund: draft 11's effective window is one token period (100 ms,
/// so 1 s), the time the first of its 3 tokens takes to come back; draft 10 says 0, no more
/// quota coming while it is full.
#[tokio::test(start_paused = true)]
async fn a_bucket_full_again_after_a_refund_says_t_as_its_draft_does() {
    for (version, full_t) in [(FieldVersion::default(), 1), (FieldVersion::Draft10, 0)] {
        let calls = Arc::new(AtomicUsize::new(0));
        let once = Limit::per_minute(1).expect("a valid limit");
        let global = Rule::new("global", once, KeyExtractor::global()).expect("a valid rule");
        let mut svc = layer(version, [per_key(), global]).layer(counting(&calls));
        // Without a key only the global rule applies, and spends its one token.
        let res = call(&mut svc, request(None)).await;
        assert_eq!(header(&res, "ratelimit"), Some("\"global\";r=0;t=60"));
        // With one, per-key takes a token from its full bucket, the global rule refuses, and
        // the token goes back: per-key is full.
        let res = call(&mut svc, request(Some("k1"))).await;
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(header(&res, "retry-after"), Some("60"));
        assert_eq!(
            items(&res, "ratelimit"),
            [
                item("per-key", &[("r", 3), ("t", full_t)]),
                item("global", &[("r", 0), ("t", 60)]),
            ],
            "{version:?}"
        );
        assert_eq!(
            items(&res, "ratelimit-policy"),
            [
                item("per-key", &[("q", 10), ("w", 1)]),
                item("global", &[("q", 1), ("w", 60)]),
            ]
        );
    }
}

#[tokio::test(start_paused = true)]
async fn draft06_fields_describe_the_limit_closest_to_exhaustion() {
    let calls = Arc::new(AtomicUsize::new(0));
    let hourly = "5/h burst 10".parse().expect("a valid limit");
    let global = Rule::new("global", hourly, KeyExtractor::global()).expect("a valid rule");
    let mut svc = layer(FieldVersion::Draft06, [per_key(), global]).layer(counting(&calls));

    // per-key has 2 left, global 9: per-key's numbers.
    let res = call(&mut svc, request(Some("k1"))).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(integer(&res, "ratelimit-limit"), Some(10));
    assert_eq!(integer(&res, "ratelimit-remaining"), Some(2));
    assert_eq!(integer(&res, "ratelimit-reset"), Some(1));
    assert_eq!(header(&res, "ratelimit-policy"), Some("10;w=1"));
    assert_eq!(header(&res, "ratelimit"), None);

    for _ in 0..2 {
        call(&mut svc, request(Some("k1"))).await;
    }
    // Refused by per-key: its numbers, with the reset where Retry-After points.
    let res = call(&mut svc, request(Some("k1"))).await;
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(header(&res, "retry-after"), Some("1"));
    assert_eq!(integer(&res, "ratelimit-remaining"), Some(0));
    assert_eq!(integer(&res, "ratelimit-reset"), Some(1));
    assert_eq!(integer(&res, "ratelimit-limit"), Some(10));

    // Without a key only the hourly rule applies: 5 an hour, burst 10, is 10 in two hours.
    let res = call(&mut svc, request(None)).await;
    assert_eq!(res.status(), StatusCode::OK);
    assert_eq!(integer(&res, "ratelimit-limit"), Some(10));
    assert_eq!(integer(&res, "ratelimit-remaining"), Some(6));
    // All four were taken at once, so the next token is a whole token period away: 12 min.
    assert_eq!(integer(&res, "ratelimit-reset"), Some(720));
    let policy: sfv::List = sfv::Parser::new(header(&res, "ratelimit-policy").unwrap_or_default())
        .parse()
        .expect("a structured list");
    assert_eq!(policy.len(), 1);
    assert_eq!(header(&res, "ratelimit-policy"), Some("10;w=7200"));
}

/// With partition keys on, each item of the `RateLimit` field names its bucket by the key's
/// fingerprint as an RFC 9651 Byte Sequence (`pk`), never the key; off, the default, none.
#[tokio::test(start_paused = true)]
async fn partition_keys_name_each_bucket_by_its_fingerprint_and_never_the_key() {
    for on in [false, true] {
        let calls = Arc::new(AtomicUsize::new(0));
        let layer = RateLimitLayer::new(MemoryStore::new().with_clock(TokioClock::new()))
            .rule(per_key())
            .partition_keys(on);
        let mut svc = layer.layer(counting(&calls));
        let res = call(&mut svc, request(Some("sekrit-k1"))).await;
        let field = res.headers()["ratelimit"].to_str().expect("ASCII");
        assert!(!field.contains("sekrit"), "{field}");
        let list = sfv::Parser::new(field)
            .parse::<sfv::List>()
            .expect("an RFC 9651 list");
        let Some(sfv::ListEntry::Item(item)) = list.first() else {
            panic!("an item: {field}");
        };
        let pk = item.params.get("pk");
        if !on {
            assert_eq!(pk, None, "{field}");
            continue;
        }
        let key = burstgate::BucketKey::hashed("per-key", "sekrit-k1").expect("a key");
        let Some(sfv::BareItem::ByteSequence(bytes)) = pk else {
            panic!("a Byte Sequence pk: {field}");
        };
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, key.fingerprint(), "{field}");
    }
}
