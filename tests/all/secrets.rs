//! What a reader of the store, or of the logs, can learn about the keys: secret keys are keyed
//! hashes when the application gives a secret, fingerprints are salted per process, and errors
//! name keys by fingerprint.

use burstgate::{BucketKey, BucketStore, KeySecret, Limit, MemoryStore};
use sha2::{Digest, Sha256};

#[cfg(all(feature = "redis", feature = "reqwest"))]
use crate::support::redis_server;

/// `Authorization: Basic` of `user:hunter2`: a password an attacker would guess first.
const BASIC: &str = "Basic dXNlcjpodW50ZXIy";

fn secret() -> KeySecret {
    KeySecret::new(b"application secret from config").expect("a valid secret")
}

fn per_minute() -> Limit {
    Limit::per_minute(1)
        .and_then(|l| l.with_burst(5))
        .expect("a valid limit")
}

fn plain_sha256(value: &str) -> String {
    Sha256::digest(value)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn a_hashed_basic_auth_key_is_a_crackable_password_hash() {
    // What `hashed` stores is what anyone can compute from a guess...
    let plain = BucketKey::hashed("login", BASIC).expect("a valid key");
    assert!(plain.as_str().ends_with(&plain_sha256(BASIC)));
    // ...and what `keyed` stores is not.
    let keyed = BucketKey::keyed("login", BASIC, &secret()).expect("a valid key");
    assert!(!keyed.as_str().contains(&plain_sha256(BASIC)));
    assert!(!keyed.as_str().contains("dXNl"));
}

#[tokio::test]
async fn fingerprints_of_ipv4_keys_are_salted() {
    // Enumerating all of IPv4 against the unsalted 48-bit hash took minutes; with the salt the
    // attacker has nothing to compare with.
    let key = BucketKey::new("ip", "198.51.100.23").expect("a valid key");
    let unsalted = &plain_sha256(key.as_str())[..12];
    assert_ne!(key.fingerprint(), unsalted);
    // The store still works with the key, and the fingerprint is stable in the process.
    let store = MemoryStore::new();
    let d = store
        .acquire(&key, per_minute(), 1, std::time::Duration::ZERO)
        .await
        .expect("decides");
    assert!(d.is_admitted());
    assert_eq!(key.fingerprint(), key.fingerprint());
}

#[cfg(feature = "reqwest")]
mod middleware {
    use super::*;

    #[cfg(feature = "redis")]
    use super::redis_server;

    use burstgate::middleware::{Account, RateLimitMiddleware, Route};
    use http::header::AUTHORIZATION;
    use reqwest_middleware::ClientBuilder;
    use wiremock::matchers::method;
    use wiremock::{Mock, MockServer, ResponseTemplate};

    async fn server() -> MockServer {
        let server = MockServer::start().await;
        Mock::given(method("GET"))
            .respond_with(ResponseTemplate::new(200))
            .mount(&server)
            .await;
        server
    }

    async fn remaining(store: &MemoryStore, key: &BucketKey) -> u32 {
        store
            .peek(key, per_minute())
            .await
            .expect("peeks")
            .remaining()
    }

    #[tokio::test]
    async fn an_account_header_is_stored_as_a_keyed_hash_with_a_key_secret() {
        let server = server().await;
        let store = MemoryStore::new();
        let route = Route::new("orders", per_minute(), "/orders").expect("a valid route");
        let client = ClientBuilder::new(reqwest::Client::new())
            .with(
                RateLimitMiddleware::new(store.clone())
                    .route(route)
                    .account_header(AUTHORIZATION)
                    .key_secret(secret()),
            )
            .build();
        let url = format!("{}/orders", server.uri());
        let status = client
            .get(&url)
            .header(AUTHORIZATION, BASIC)
            .send()
            .await
            .expect("sent")
            .status();
        assert_eq!(status, 200);
        let token = client
            .get(&url)
            .with_extension(Account::secret("token-a"))
            .send()
            .await
            .expect("sent")
            .status();
        assert_eq!(token, 200);

        let keyed = BucketKey::keyed("orders", BASIC, &secret()).expect("a valid key");
        let plain = BucketKey::hashed("orders", BASIC).expect("a valid key");
        assert_eq!(
            remaining(&store, &keyed).await,
            4,
            "spent from the keyed bucket"
        );
        assert_eq!(
            remaining(&store, &plain).await,
            5,
            "the plain hash is never written"
        );
        let account = BucketKey::keyed("orders", "token-a", &secret()).expect("a valid key");
        assert_eq!(
            remaining(&store, &account).await,
            4,
            "secret accounts are keyed too"
        );
    }

    #[cfg(feature = "redis")]
    #[tokio::test]
    async fn no_redis_key_holds_the_plain_hash_of_an_authorization_header() {
        let prefix = redis_server::unique_prefix();
        let conn = redis::Client::open(redis_server::url())
            .expect("a valid Redis URL")
            .get_multiplexed_async_connection()
            .await
            .expect("a connection to the test Redis");
        let store = burstgate::RedisStore::new(conn.clone())
            .prefix(&prefix)
            .expect("a valid prefix");
        let server = server().await;
        let route = Route::new("login", per_minute(), "/login").expect("a valid route");
        let client = ClientBuilder::new(reqwest::Client::new())
            .with(
                RateLimitMiddleware::new(store)
                    .route(route)
                    .account_header(AUTHORIZATION)
                    .key_secret(secret()),
            )
            .build();
        let status = client
            .get(format!("{}/login", server.uri()))
            .header(AUTHORIZATION, BASIC)
            .send()
            .await
            .expect("sent")
            .status();
        assert_eq!(status, 200);

        let mut c = conn;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}:*"))
            .query_async(&mut c)
            .await
            .expect("KEYS");
        assert_eq!(keys.len(), 1, "{keys:?}");
        assert!(!keys[0].contains(&plain_sha256(BASIC)), "{keys:?}");
        assert!(!keys[0].contains("dXNl"), "{keys:?}");
    }
}

#[cfg(feature = "tower")]
mod layer {
    use super::*;

    use std::convert::Infallible;

    use burstgate::RateLimitLayer;
    use burstgate::layer::{KeyExtractor, Rule};
    use http::header::AUTHORIZATION;
    use http::{Request, Response};
    use tower::{Layer, Service, ServiceExt};

    #[tokio::test]
    async fn a_keyed_header_rule_stores_an_hmac_not_a_password_hash() {
        let store = MemoryStore::new();
        let rule = Rule::new(
            "login",
            per_minute(),
            KeyExtractor::keyed_header(AUTHORIZATION, secret()),
        )
        .expect("a valid rule");
        let mut svc = RateLimitLayer::new(store.clone())
            .rule(rule)
            .layer(tower::service_fn(|_req: Request<String>| async {
                Ok::<_, Infallible>(Response::new(String::new()))
            }));
        let req = Request::builder()
            .header(AUTHORIZATION, BASIC)
            .body(String::new())
            .expect("a valid request");
        let res = svc
            .ready()
            .await
            .expect("ready")
            .call(req)
            .await
            .expect("answers");
        assert_eq!(res.status(), 200);
        let remaining = |key: BucketKey| {
            let store = store.clone();
            async move {
                store
                    .peek(&key, per_minute())
                    .await
                    .expect("peeks")
                    .remaining()
            }
        };
        let keyed = BucketKey::keyed("login", BASIC, &secret()).expect("a valid key");
        let plain = BucketKey::hashed("login", BASIC).expect("a valid key");
        assert_eq!(remaining(keyed).await, 4);
        assert_eq!(remaining(plain).await, 5, "the plain hash is never written");
        let shown = format!("{:?}", KeyExtractor::keyed_header(AUTHORIZATION, secret()));
        assert_eq!(shown, "KeyExtractor::KeyedHeader(authorization)");
    }
}
