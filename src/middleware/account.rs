//! Whose budget a request spends: [`Account`], and the bucket key derived from it or from the
//! account header.

use std::fmt;
use std::sync::Arc;

use http::{Extensions, HeaderMap, HeaderName};

use crate::{BucketKey, BucketName, KeySecret};

/// The key a request draws from in `bucket`: its [`Account`] extension, else the value of the
/// `account_header`, hashed; with neither (or with an empty one), the shared key `-`.
pub(super) fn request_key(
    bucket: &BucketName,
    extensions: &Extensions,
    headers: &HeaderMap,
    account_header: Option<&HeaderName>,
    key_secret: Option<&KeySecret>,
) -> BucketKey {
    // An empty account or header value names nobody: it falls through to the next source.
    let key = extensions
        .get::<Account>()
        .and_then(|account| account.key(bucket, key_secret))
        .or_else(|| {
            account_header
                .and_then(|name| headers.get(name))
                .and_then(|v| secret_key(bucket, v.as_bytes(), key_secret))
        });
    // The bucket name was checked when the route was made, and "-" is a valid key.
    key.or_else(|| bucket.key("-").ok())
        .unwrap_or_else(|| unreachable!("a checked bucket name with key \"-\" is valid"))
}

/// The account that owns a request's budget, as a request extension:
/// `client.get(url).with_extension(Account::new("seller-42"))`.
#[derive(Clone, PartialEq, Eq)]
pub struct Account {
    id: Arc<str>,
    secret: bool,
}

impl Account {
    /// An account named by an identifier that may appear in store keys (it is escaped).
    pub fn new(id: &str) -> Self {
        Self {
            id: Arc::from(id),
            secret: false,
        }
    }

    /// An account named by a secret, such as its API token: hashed before it becomes part of a
    /// key (keyed with the middleware's
    /// [`key_secret`](super::RateLimitMiddleware::key_secret) when it has one), never stored or
    /// logged in clear.
    pub fn secret(token: &str) -> Self {
        Self {
            id: Arc::from(token),
            secret: true,
        }
    }

    pub(super) fn key(
        &self,
        bucket: &BucketName,
        key_secret: Option<&KeySecret>,
    ) -> Option<BucketKey> {
        if self.secret {
            secret_key(bucket, self.id.as_bytes(), key_secret)
        } else {
            bucket.key(self.id.as_bytes()).ok()
        }
    }
}

/// The key of a secret account: keyed when the application gave a secret.
fn secret_key(bucket: &BucketName, value: &[u8], secret: Option<&KeySecret>) -> Option<BucketKey> {
    match secret {
        Some(secret) => bucket.keyed_key(value, secret).ok(),
        None => bucket.hashed_key(value).ok(),
    }
}

impl fmt::Debug for Account {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.secret {
            f.write_str("Account(<secret>)")
        } else {
            f.debug_tuple("Account").field(&self.id).finish()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(name: &str) -> BucketName {
        BucketName::new(name).expect("a valid bucket name")
    }

    #[test]
    fn secret_accounts_are_hashed_and_not_printed() {
        let a = Account::secret("tok-123");
        assert_eq!(format!("{a:?}"), "Account(<secret>)");
        let key = a
            .key(&name("orders"), None)
            .map(|k| k.to_string())
            .unwrap_or_default();
        assert!(key.starts_with("orders:#") && !key.contains("tok"), "{key}");
        assert_eq!(
            Account::new("seller:42")
                .key(&name("orders"), None)
                .map(|k| k.to_string())
                .as_deref(),
            Some("orders:seller%3A42")
        );
    }
}
