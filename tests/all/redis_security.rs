//! Redis security: a password-protected server, secrets kept out of keys, and TLS (`rediss://`,
//! feature `tls`). Each test starts the server it needs, so the settings under test are its own.
#![cfg(feature = "redis")]

use std::hash::{BuildHasher, Hasher};
#[cfg(feature = "tls")]
use std::time::Duration;

use burstgate::{BucketKey, BucketStore, Limit, ManualClock, RedisStore, StoreError};
use redis::aio::MultiplexedConnection;
use sha2::{Digest, Sha256};

use crate::support::{START, ZERO, redis_server, scan};

fn limit() -> Limit {
    Limit::per_minute(1)
        .and_then(|l| l.with_burst(3))
        .expect("a valid limit")
}

/// 32 hex digits no other run will use: the std hasher's per-process random keys.
fn random_hex() -> String {
    let half = || std::hash::RandomState::new().build_hasher().finish();
    format!("{:016x}{:016x}", half(), half())
}

/// Every key on the server.
async fn all_keys(conn: &mut MultiplexedConnection) -> Vec<String> {
    scan::keys_matching(conn, "*").await
}

async fn connect(url: &str) -> redis::RedisResult<MultiplexedConnection> {
    redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await
}

mod auth {
    use super::*;

    #[tokio::test]
    async fn a_password_protected_server_works_and_a_wrong_password_fails_at_connect() {
        let password = random_hex();
        let server = redis_server::spawn(&format!("--requirepass {password}"))
            .expect("a password-protected redis-server");
        let url = format!("redis://:{password}@127.0.0.1:{}/", server.port);

        let conn = connect(&url).await.expect("connects with the password");
        let store = RedisStore::new(conn.clone())
            .prefix("auth")
            .expect("a valid prefix")
            .with_clock(ManualClock::new(START));
        let key = BucketKey::new("orders", "seller-1").expect("a valid key");
        for remaining in [2, 1, 0] {
            let decision = store
                .acquire(&key, limit(), 1, ZERO)
                .await
                .expect("decides over an authenticated connection");
            assert!(decision.is_admitted());
            assert_eq!(decision.remaining(), remaining);
        }
        let fourth = store
            .acquire(&key, limit(), 1, ZERO)
            .await
            .expect("decides");
        assert!(!fourth.is_admitted());
        let mut check = conn.clone();
        assert_eq!(all_keys(&mut check).await, ["auth:v4:orders:{seller-1}"]);

        // The store's Debug output names its prefix and clock, never the connection or its URL.
        let printed = format!("{store:?}");
        assert!(printed.contains("auth"), "{printed}");
        assert!(!printed.contains(&password), "{printed}");

        // A wrong password is refused when connecting, as a redis error.
        let wrong = format!("redis://:not-{password}@127.0.0.1:{}/", server.port);
        let err = connect(&wrong)
            .await
            .expect_err("a wrong password must not connect");
        assert_eq!(err.kind(), redis::ErrorKind::AuthenticationFailed, "{err}");
        assert!(!err.to_string().contains(&password), "{err}");

        // Without a password the connection opens (nothing is sent that could fail), and the
        // first decision is a backend error from the server: NOAUTH.
        let anonymous = connect(&format!("redis://127.0.0.1:{}/", server.port))
            .await
            .expect("an anonymous connection opens");
        let err = RedisStore::new(anonymous)
            .acquire(&key, limit(), 1, ZERO)
            .await
            .expect_err("an anonymous connection cannot decide");
        let StoreError::Backend(backend) = &err else {
            panic!("expected a backend error, got {err:?}");
        };
        let cause = std::error::Error::source(backend)
            .and_then(|e| e.downcast_ref::<redis::RedisError>())
            .expect("the redis error as the source");
        assert_eq!(cause.code(), Some("NOAUTH"), "{cause}");

        redis_server::kill(server);
    }
}

mod keys {
    use super::*;

    #[tokio::test]
    async fn hashed_secrets_never_reach_redis_in_clear() {
        // A server of its own, so SCAN sees only this test's keys.
        let server = redis_server::spawn("").expect("a redis-server");
        let url = format!("redis://127.0.0.1:{}/", server.port);
        let conn = connect(&url).await.expect("connects");
        let store = RedisStore::new(conn.clone()).with_clock(ManualClock::new(START));

        let secrets = [
            "Bearer eyJhbGciOiJIUzI1NiJ9.c2VsbGVyLTQy.c2lnbmF0dXJl".to_owned(),
            "sk_live_0123456789".to_owned(),
            // Long enough that escaping alone would have hashed it anyway.
            format!("token-{}", "x".repeat(300)),
            // Bytes that would be escaped, not hidden, by `BucketKey::new`.
            "tok:{en}\n".to_owned(),
        ];
        let mut expected = Vec::new();
        for secret in &secrets {
            let key = BucketKey::hashed("orders", secret).expect("a valid key");
            let hex: String = Sha256::digest(secret.as_bytes())
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            let redis_key = format!("burstgate:v4:orders:{{#{hex}}}");
            assert_eq!(store.redis_key(&key), redis_key);
            assert!(!format!("{key:?} {key}").contains("tok"), "{key:?}");
            assert!(
                store
                    .acquire(&key, limit(), 1, ZERO)
                    .await
                    .expect("decides")
                    .is_admitted()
            );
            store
                .drain_until(&key, limit(), std::time::SystemTime::now())
                .await
                .expect("drains");
            expected.push(redis_key);
        }
        expected.sort();

        let mut c = conn.clone();
        let keys = all_keys(&mut c).await;
        assert_eq!(keys, expected);
        for key in &keys {
            let value: Vec<u8> = redis::cmd("GET")
                .arg(key)
                .query_async(&mut c)
                .await
                .expect("GET");
            // Four f64s (the state, its expiry and the drain's halt) and nothing else: no room
            // for the caller's bytes.
            assert_eq!(value.len(), 32, "{key}");
            for secret in &secrets {
                assert!(!key.contains(secret.as_str()), "{key}");
                for fragment in ["eyJhbGci", "sk_live", "token-", "tok"] {
                    assert!(!key.contains(fragment), "{key} holds {fragment:?}");
                }
            }
        }
        redis_server::kill(server);
    }
}

#[cfg(feature = "tls")]
mod tls {
    use super::*;

    use std::path::{Path, PathBuf};
    use std::process::Command;

    /// A throw-away directory for one test's certificates, removed when dropped.
    struct TempDir(PathBuf);

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn openssl(dir: &Path, args: &[&str]) {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("the openssl command line tool on PATH");
        assert!(
            out.status.success(),
            "openssl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A CA, and a server certificate it signed for 127.0.0.1 and localhost, as PEM files in a
    /// new temporary directory: `ca.crt`, `server.crt`, `server.key`.
    fn certificates() -> TempDir {
        let dir = std::env::temp_dir().join(format!("burstgate-tls-{}", random_hex()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let dir = TempDir(dir);
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
        let mut ca = vec!["req", "-x509", "-nodes", "-days", "2"];
        ca.extend(ec);
        ca.extend([
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-subj",
            "/CN=burstgate test CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ]);
        openssl(&dir.0, &ca);
        let mut csr = vec!["req", "-nodes"];
        csr.extend(ec);
        csr.extend([
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=localhost",
        ]);
        openssl(&dir.0, &csr);
        std::fs::write(
            dir.0.join("server.ext"),
            "basicConstraints=CA:FALSE\n\
             keyUsage=critical,digitalSignature\n\
             extendedKeyUsage=serverAuth\n\
             subjectAltName=IP:127.0.0.1,DNS:localhost\n",
        )
        .expect("writes the extensions file");
        openssl(
            &dir.0,
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                "server.ext",
                "-out",
                "server.crt",
            ],
        );
        dir
    }

    #[tokio::test]
    async fn rediss_with_the_servers_ca_decides_and_plain_text_is_refused() {
        let certs = certificates();
        let path = |name: &str| certs.0.join(name).display().to_string();
        let port = redis_server::free_port().expect("a free port");
        // `spawn_on` passes `--port <port>` first; `--port 0` overrides it, so the server listens
        // on `port` for TLS only.
        let server = redis_server::spawn_on(
            port,
            &format!(
                "--port 0 --tls-port {port} --tls-cert-file {} --tls-key-file {} \
                 --tls-ca-cert-file {} --tls-auth-clients no",
                path("server.crt"),
                path("server.key"),
                path("ca.crt"),
            ),
        )
        .expect("a TLS redis-server");
        let url = format!("rediss://127.0.0.1:{port}/");
        let ca = std::fs::read(certs.0.join("ca.crt")).expect("reads the CA");

        let client = redis::Client::build_with_tls(
            url.as_str(),
            redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(ca),
            },
        )
        .expect("a TLS client");
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("a TLS connection verified against the test CA");
        let store = RedisStore::new(conn.clone()).with_clock(ManualClock::new(START));
        let key = BucketKey::new("orders", "seller-tls").expect("a valid key");
        for remaining in [2, 1, 0] {
            let decision = store
                .acquire(&key, limit(), 1, ZERO)
                .await
                .expect("decides over TLS");
            assert!(decision.is_admitted());
            assert_eq!(decision.remaining(), remaining);
        }
        let denied = store
            .acquire(&key, limit(), 1, ZERO)
            .await
            .expect("decides");
        assert_eq!(denied.retry_after(), Some(Duration::from_secs(60)));
        let mut check = conn.clone();
        assert_eq!(
            all_keys(&mut check).await,
            ["burstgate:v4:orders:{seller-tls}"]
        );

        // The same server without the CA: the system roots do not know it, so the handshake
        // fails instead of trusting an unknown certificate.
        let unverified = tokio::time::timeout(Duration::from_secs(10), connect(&url))
            .await
            .expect("fails within 10 s");
        let err = unverified.expect_err("an unknown CA must not be trusted");
        assert!(
            err.to_string().to_lowercase().contains("certificate"),
            "{err}"
        );

        // Plain text on the TLS port: redis-rs sends its client name when it connects, the
        // server reads that as a broken handshake and drops the connection, so connecting fails
        // with an I/O error and nothing is ever decided.
        let plain = tokio::time::timeout(
            Duration::from_secs(10),
            connect(&format!("redis://127.0.0.1:{port}/")),
        )
        .await
        .expect("refused within 10 s");
        let err = plain.expect_err("a plain-text client must be refused");
        assert!(err.is_io_error() || err.is_connection_dropped(), "{err:?}");

        // The bucket saw only the four TLS decisions.
        let quota = store.peek(&key, limit()).await.expect("peeks over TLS");
        assert_eq!(quota.remaining(), 0);
        redis_server::kill(server);
    }
}
