// Over 600 lines: one idea, every bad input on every store, each refused or ignored as documented.
//! Bad input: each is either refused with a typed error or clamped as documented, and
//! each test asserts which. The store cases run on `MemoryStore` and, with the `redis` feature, on
//! `RedisStore` against a real Redis, since the Lua script must refuse and clamp exactly as the
//! reference does.

use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use burstgate::{
    BucketKey, BucketStore, DynBucketStore, InvalidKey, InvalidLimit, Limit, ManualClock,
    MemoryStore, Reservation, StoreError,
};

use crate::support::{MAX_SPAN_MS, MAX_WAIT_MS, START, ZERO, key, limit};
#[cfg(feature = "redis")]
use crate::support::{redis_server, scan};

/// The latest time the arithmetic works with: 2^53 − 1 ms. Later times are clamped to it.
const MAX_TIME: u64 = (1 << 53) - 1;

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Every store under test, all on one manual clock.
struct Stores {
    clock: ManualClock,
    all: Vec<(&'static str, Arc<dyn DynBucketStore>)>,
    #[cfg(feature = "redis")]
    redis: Option<RedisSide>,
}

#[cfg(feature = "redis")]
struct RedisSide {
    conn: redis::aio::MultiplexedConnection,
    prefix: String,
    store: burstgate::RedisStore<redis::aio::MultiplexedConnection, ManualClock>,
}

#[cfg(feature = "redis")]
impl RedisSide {
    /// The keys under this test's prefix.
    async fn keys(&self) -> Vec<String> {
        let mut conn = self.conn.clone();
        scan::keys_matching(&mut conn, &format!("{}:*", self.prefix)).await
    }
}

impl Stores {
    /// Keeps `key`'s bucket in the store named `name` for an hour of real time, and says
    /// whether it was still there. Redis expires a key on its own clock, the real one, a refill
    /// time and an interval after the write: for a limit that refills in a millisecond, a few
    /// milliseconds, which a busy machine can spend between two calls while the manual clock
    /// stands still. `false`: Redis had expired the bucket already (it is full again there,
    /// whatever the manual clock says). A `MemoryStore` forgets nothing on its own.
    async fn pin(&self, name: &str, key: &BucketKey) -> bool {
        #[cfg(feature = "redis")]
        if let (Some(redis), "redis") = (&self.redis, name) {
            let mut conn = redis.conn.clone();
            let pinned: i64 = redis::cmd("PEXPIRE")
                .arg(redis.store.redis_key(key))
                .arg(3_600_000)
                .query_async(&mut conn)
                .await
                .expect("PEXPIRE answers");
            return pinned == 1;
        }
        let _ = (name, key);
        true
    }
}

#[cfg(feature = "redis")]
async fn stores(start: u64) -> Stores {
    let clock = ManualClock::new(start);
    let conn = redis::Client::open(redis_server::url())
        .expect("a valid Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("a connection to the test Redis");
    let prefix = redis_server::unique_prefix();
    let redis = burstgate::RedisStore::new(conn.clone())
        .prefix(&prefix)
        .expect("a valid prefix")
        .with_clock(clock.clone());
    let memory = MemoryStore::new().with_clock(clock.clone());
    Stores {
        clock,
        all: vec![
            ("memory", Arc::new(memory)),
            ("redis", Arc::new(redis.clone())),
        ],
        redis: Some(RedisSide {
            conn,
            prefix,
            store: redis.clone(),
        }),
    }
}

#[cfg(not(feature = "redis"))]
async fn stores(start: u64) -> Stores {
    let clock = ManualClock::new(start);
    let memory = MemoryStore::new().with_clock(clock.clone());
    Stores {
        clock,
        all: vec![("memory", Arc::new(memory))],
    }
}

mod limits {
    use super::*;

    #[test]
    fn zero_tokens_burst_or_interval_are_errors() {
        let s = Duration::from_secs(1);
        assert_eq!(Limit::new(0, s), Err(InvalidLimit::ZeroTokens));
        assert_eq!(Limit::per_second(0), Err(InvalidLimit::ZeroTokens));
        assert_eq!(Limit::per_minute(0), Err(InvalidLimit::ZeroTokens));
        assert_eq!(Limit::per_hour(0), Err(InvalidLimit::ZeroTokens));
        assert_eq!(Limit::published(s, 0, 5), Err(InvalidLimit::ZeroTokens));
        assert_eq!(
            Limit::per_second(5).and_then(|l| l.with_burst(0)),
            Err(InvalidLimit::ZeroBurst)
        );
        assert_eq!(Limit::published(s, 5, 0), Err(InvalidLimit::ZeroBurst));
        assert_eq!(Limit::new(1, ZERO), Err(InvalidLimit::ZeroInterval));
        assert_eq!(
            Limit::published(ZERO, 1, 1),
            Err(InvalidLimit::ZeroInterval)
        );
    }

    #[test]
    fn an_interval_that_is_not_whole_milliseconds_is_an_error() {
        for interval in [
            Duration::from_nanos(1),
            Duration::from_micros(999),
            Duration::from_micros(1_500),
            Duration::from_millis(1) + Duration::from_nanos(1),
            Duration::from_secs(60) + Duration::from_nanos(999_999),
        ] {
            assert_eq!(
                Limit::new(1, interval),
                Err(InvalidLimit::SubMillisecondInterval { interval }),
                "{interval:?}"
            );
        }
        // Whole milliseconds, however written, are fine.
        assert_eq!(
            Limit::new(1, Duration::from_micros(2_000)).map(|l| l.interval()),
            Ok(Duration::from_millis(2))
        );
    }

    #[test]
    fn intervals_and_refill_times_above_2_pow_42_ms_are_errors() {
        let ms = Duration::from_millis;
        assert!(Limit::new(1, ms(MAX_SPAN_MS)).is_ok());
        assert_eq!(
            Limit::new(1, ms(MAX_SPAN_MS + 1)),
            Err(InvalidLimit::TooSlow)
        );
        // `Duration::MAX` is not whole milliseconds either, and that is checked first.
        assert!(matches!(
            Limit::new(1, Duration::MAX),
            Err(InvalidLimit::SubMillisecondInterval { .. })
        ));
        assert_eq!(
            Limit::new(u32::MAX, Duration::from_secs(u64::MAX)),
            Err(InvalidLimit::TooSlow)
        );
        // The refill time of a full burst has the same ceiling: 2 tokens at one per 2^41 ms
        // take exactly 2^42 ms, 3 take more.
        let half = Limit::new(1, ms(MAX_SPAN_MS / 2)).expect("a valid limit");
        assert_eq!(
            half.with_burst(2).map(|l| l.refill_time()),
            Ok(ms(MAX_SPAN_MS))
        );
        assert_eq!(half.with_burst(3), Err(InvalidLimit::TooSlow));
        assert_eq!(
            Limit::per_hour(1).and_then(|l| l.with_burst(u32::MAX)),
            Err(InvalidLimit::TooSlow)
        );
    }

    #[test]
    fn u32_max_tokens_and_burst_are_accepted_when_they_refill_in_time() {
        let fast = Limit::per_second(u32::MAX).and_then(|l| l.with_burst(u32::MAX));
        assert_eq!(
            fast.map(|l| (l.tokens(), l.burst())),
            Ok((u32::MAX, u32::MAX))
        );
        let fastest = Limit::new(u32::MAX, Duration::from_millis(1));
        assert_eq!(
            fastest.map(|l| l.refill_time()),
            Ok(Duration::from_millis(1))
        );
        // A tiny burst for a huge rate is accepted too: it smooths the rate out.
        assert_eq!(
            Limit::per_second(u32::MAX)
                .and_then(|l| l.with_burst(1))
                .map(|l| l.burst()),
            Ok(1)
        );
    }

    #[test]
    fn every_refusal_explains_itself_in_lowercase_without_a_trailing_dot() {
        let errors = [
            Limit::per_second(0),
            Limit::per_second(1).and_then(|l| l.with_burst(0)),
            Limit::new(1, ZERO),
            Limit::new(1, Duration::from_micros(1_500)),
            Limit::new(1, Duration::MAX),
        ];
        for e in errors {
            let m = e.expect_err("refused").to_string();
            assert!(m.starts_with("a limit"), "{m}");
            assert!(!m.ends_with('.'), "{m}");
        }
    }

    /// The extremes that are accepted also decide correctly, on every store.
    ///
    /// The fastest limit's bucket lives about 3 ms of real time in Redis, while the manual
    /// clock stands still: on a busy machine the second call found it expired, a full bucket,
    /// and was admitted. The bucket is pinned between the calls ([`Stores::pin`]); a bucket
    /// Redis expired before the pin is started again under a new key.
    #[tokio::test]
    async fn the_fastest_and_slowest_limits_decide_exactly() {
        let s = stores(START).await;
        let fastest = limit(u32::MAX, 1, u32::MAX);
        let slowest = limit(1, MAX_SPAN_MS, 1);
        for (name, store) in &s.all {
            let mut tries = 0;
            let k = loop {
                tries += 1;
                let k = key("extreme", format!("fastest-{tries}"));
                let d = store
                    .acquire(&k, fastest, u32::MAX, ZERO)
                    .await
                    .expect("decides");
                assert!(d.is_admitted(), "{name}: {d:?}");
                assert_eq!(d.remaining(), 0, "{name}");
                assert_eq!(d.resets_in(), Duration::from_millis(1), "{name}");
                if s.pin(name, &k).await {
                    break k;
                }
                assert!(
                    tries < 1_000,
                    "{name}: every bucket expired before it was pinned"
                );
            };
            let d = store.acquire(&k, fastest, 1, ZERO).await.expect("decides");
            assert_eq!(d.retry_after(), Some(Duration::from_millis(1)), "{name}");

            let k = key("extreme", "slowest");
            let d = store.acquire(&k, slowest, 1, ZERO).await.expect("decides");
            assert!(d.is_admitted(), "{name}: {d:?}");
            let d = store.acquire(&k, slowest, 1, ZERO).await.expect("decides");
            assert_eq!(
                d.retry_after(),
                Some(Duration::from_millis(MAX_SPAN_MS)),
                "{name}"
            );
        }
    }
}

mod costs {
    use super::*;

    #[tokio::test]
    async fn cost_zero_and_cost_above_capacity_are_errors_that_take_nothing() {
        let s = stores(START).await;
        let l = limit(1, 60_000, 10);
        let k = key("costs", "seller-1");
        for (name, store) in &s.all {
            let zero = store.acquire(&k, l, 0, ZERO).await;
            assert!(
                matches!(zero, Err(StoreError::ZeroCost)),
                "{name}: {zero:?}"
            );
            for cost in [11, 1_000, u32::MAX] {
                // A wait would never help, however long the caller is willing to wait.
                for max_wait in [ZERO, Duration::from_secs(3600), Duration::MAX] {
                    let above = store.acquire(&k, l, cost, max_wait).await;
                    assert!(
                        matches!(
                            above,
                            Err(StoreError::CostAboveBurst { cost: c, burst: 10 }) if c == cost
                        ),
                        "{name}: cost {cost}: {above:?}"
                    );
                }
                let refund = store
                    .refund(&k, l, Reservation::new(cost, UNIX_EPOCH))
                    .await;
                assert!(
                    matches!(refund, Err(StoreError::CostAboveBurst { .. })),
                    "{name}: {refund:?}"
                );
            }
            let refund = store.refund(&k, l, Reservation::new(0, UNIX_EPOCH)).await;
            assert!(
                matches!(refund, Err(StoreError::ZeroCost)),
                "{name}: {refund:?}"
            );
            // Exactly the capacity is served.
            let whole = store.acquire(&k, l, 10, ZERO).await.expect("decides");
            assert!(
                whole.is_admitted() && whole.remaining() == 0,
                "{name}: {whole:?}"
            );
        }
        let message = StoreError::CostAboveBurst {
            cost: 11,
            burst: 10,
        }
        .to_string();
        assert_eq!(
            message,
            "a cost of 11 tokens can never be served by a burst of 10"
        );
        assert_eq!(
            StoreError::ZeroCost.to_string(),
            "a request must cost at least one token"
        );
    }

    #[cfg(feature = "redis")]
    #[tokio::test]
    async fn refused_costs_never_reach_redis() {
        let s = stores(START).await;
        let l = limit(1, 60_000, 10);
        let k = key("costs", "untouched");
        let (_, redis) = &s.all[1];
        assert!(redis.acquire(&k, l, 0, ZERO).await.is_err());
        assert!(redis.acquire(&k, l, 11, ZERO).await.is_err());
        assert!(
            redis
                .refund(&k, l, Reservation::new(11, UNIX_EPOCH))
                .await
                .is_err()
        );
        let side = s.redis.as_ref().expect("the redis side");
        assert_eq!(side.keys().await, Vec::<String>::new());
    }
}

mod keys {
    use super::*;

    #[test]
    fn empty_keys_and_bad_bucket_names_are_errors() {
        assert_eq!(BucketKey::new("orders", ""), Err(InvalidKey::EmptyKey));
        assert_eq!(BucketKey::new("orders", []), Err(InvalidKey::EmptyKey));
        assert_eq!(BucketKey::hashed("orders", ""), Err(InvalidKey::EmptyKey));
        for bucket in [
            "",
            "a:b",
            "{tag}",
            "a b",
            "line\nbreak",
            "é",
            &"n".repeat(65),
        ] {
            assert!(
                matches!(BucketKey::new(bucket, "k"), Err(InvalidKey::BucketName(_))),
                "{bucket:?}"
            );
        }
        assert!(BucketKey::new(&"n".repeat(64), "k").is_ok());
    }

    #[test]
    fn a_1_mib_key_is_stored_as_its_sha256() {
        let mut huge = vec![b'k'; 1 << 20];
        let k = key("big", &huge);
        assert_eq!(k.as_str(), format!("big:#{}", sha256_hex(&huge)));
        // Keys that differ only in their last byte stay apart: nothing is truncated.
        if let Some(last) = huge.last_mut() {
            *last = b'j';
        }
        let other = key("big", &huge);
        assert_ne!(k, other);
        assert_eq!(other.as_str().len(), "big:#".len() + 64);
    }

    #[test]
    fn binary_keys_are_escaped_or_hashed_never_refused() {
        // Not UTF-8, with NUL and high bytes: escaped byte for byte.
        let k = key("bin", [0x00, 0xFF, b'a', 0x80, b'%', 0xC3]);
        assert_eq!(k.as_str(), "bin:%00%FFa%80%25%C3");
        // All 256 byte values: 67 of them pass as they are, 189 take three bytes each, 634 in
        // all, past the 128-byte threshold, so the key is hashed.
        let every: Vec<u8> = (0..=255).collect();
        assert_eq!(
            key("bin", &every).as_str(),
            format!("bin:#{}", sha256_hex(&every))
        );
        // The longest key that stays readable, and one byte more.
        let readable = [0x01u8; 42];
        assert_eq!(key("bin", readable).as_str().len(), "bin:".len() + 126);
        let hashed = [0x01u8; 43];
        assert!(key("bin", hashed).as_str().starts_with("bin:#"));
    }

    #[test]
    fn separators_and_hash_tags_cannot_leave_the_namespace() {
        let cases: [(&str, &str); 6] = [
            ("a}{b:c\nd", "ns:a%7D%7Bb%3Ac%0Ad"),
            ("{slot}", "ns:%7Bslot%7D"),
            ("x:v1:other:bucket", "ns:x%3Av1%3Aother%3Abucket"),
            ("\r\n*3\r\n$3\r\nDEL", "ns:%0D%0A%2A3%0D%0A%243%0D%0ADEL"),
            ("../..", "ns:../.."),
            ("a%3Ab", "ns:a%253Ab"),
        ];
        for (raw, escaped) in cases {
            let k = key("ns", raw);
            assert_eq!(k.as_str(), escaped, "{raw:?}");
            assert_eq!(k.as_str().matches(':').count(), 1, "{raw:?}");
            assert!(!k.as_str().contains(['{', '}', '\n', '\r', ' ']), "{raw:?}");
        }
        // An escaped key never collides with the key that spells its escape.
        assert_ne!(key("ns", "a:b"), key("ns", "a%3Ab"));
    }

    #[cfg(feature = "redis")]
    #[tokio::test]
    async fn a_real_redis_store_writes_exactly_the_escaped_or_hashed_key() {
        let s = stores(START).await;
        let side = s.redis.as_ref().expect("the redis side");
        let prefix = &side.prefix;
        let (_, store) = &s.all[1];
        let l = limit(1, 60_000, 2);
        let huge = vec![b'z'; 1 << 20];
        let binary = [0x00u8, 0xFF, b'{', b'}'];
        let keys = [
            (
                key("ns", "a}{b:c\nd"),
                format!("{prefix}:v4:ns:{{a%7D%7Bb%3Ac%0Ad}}"),
            ),
            (
                key("ns", "{slot}"),
                format!("{prefix}:v4:ns:{{%7Bslot%7D}}"),
            ),
            (
                key("ns", binary),
                format!("{prefix}:v4:ns:{{%00%FF%7B%7D}}"),
            ),
            (
                key("ns", &huge),
                format!("{prefix}:v4:ns:{{#{}}}", sha256_hex(&huge)),
            ),
        ];
        let mut expected = Vec::new();
        for (k, redis_key) in &keys {
            let d = store.acquire(k, l, 1, ZERO).await.expect("decides");
            assert!(d.is_admitted());
            expected.push(redis_key.clone());
        }
        expected.sort();
        let written = side.keys().await;
        assert_eq!(written, expected);
        for k in &written {
            // One hash tag, the caller's key in braces at the end: the caller's own braces
            // stay escaped, so no caller picks its slot by writing a tag of its own.
            assert_eq!(k.matches('{').count(), 1, "{k}");
            assert_eq!(k.matches('}').count(), 1, "{k}");
            assert!(k.ends_with('}') && k.contains(":{"), "{k}");
            // The prefix, the format and the bucket, then the key with no separator of its own.
            assert_eq!(k.matches(':').count(), 3, "{k}");
        }
        // The same keys through the store's own formatter.
        let concrete = burstgate::RedisStore::new(side.conn.clone())
            .prefix(prefix)
            .expect("a valid prefix");
        for (k, redis_key) in &keys {
            assert_eq!(&concrete.redis_key(k), redis_key);
        }
        // A prefix is chosen by the program, so a bad one is refused rather than escaped.
        for bad in ["", "a:b", "{p}", "new\nline"] {
            assert!(
                matches!(
                    burstgate::RedisStore::new(side.conn.clone()).prefix(bad),
                    Err(InvalidKey::Prefix(_))
                ),
                "{bad:?}"
            );
        }
    }
}

mod clamps {
    use super::*;

    /// `max_wait` is clamped to 2^44 ms: reservations queue up to that far ahead and no
    /// further, however long the caller says it would wait.
    #[tokio::test]
    async fn a_huge_max_wait_is_clamped_to_2_pow_44_ms() {
        let s = stores(START).await;
        // One token per 2^42 ms, no burst: each reservation waits 2^42 ms longer than the last.
        let slow = limit(1, MAX_SPAN_MS, 1);
        for (name, store) in &s.all {
            let k = key("clamp", "max-wait");
            for queued in 0..=4u64 {
                let d = store
                    .acquire(&k, slow, 1, Duration::MAX)
                    .await
                    .expect("decides");
                assert!(d.is_admitted(), "{name}: reservation {queued}: {d:?}");
                assert_eq!(
                    d.wait(),
                    Duration::from_millis(queued * MAX_SPAN_MS),
                    "{name}"
                );
            }
            // The next would wait 5 × 2^42 ms, past the 2^44 ms ceiling: denied, nothing taken.
            let d = store
                .acquire(&k, slow, 1, Duration::MAX)
                .await
                .expect("decides");
            assert!(!d.is_admitted(), "{name}: {d:?}");
            assert_eq!(
                d.retry_after(),
                Some(Duration::from_millis(5 * MAX_SPAN_MS)),
                "{name}"
            );
            // `Duration::MAX` and exactly the ceiling behave the same.
            let d = store
                .acquire(&k, slow, 1, Duration::from_millis(MAX_WAIT_MS))
                .await
                .expect("decides");
            assert_eq!(
                d.retry_after(),
                Some(Duration::from_millis(5 * MAX_SPAN_MS)),
                "{name}"
            );
        }
    }

    /// Times past 2^53 − 1 ms (about the year 287,000) are clamped to it, on the clock and on
    /// `drain_until`: the clock moving further refills nothing.
    ///
    /// Times computed from there lie above 2^53, where an `f64` holds only even numbers:
    /// `(2^53 − 1) + 1000` rounds (to even) to `2^53 + 1000`, so a one-second wait reads
    /// 1001 ms. Both stores compute the same doubles, so they agree on that too.
    #[tokio::test]
    async fn times_past_2_pow_53_ms_are_clamped() {
        let s = stores(MAX_TIME).await;
        let l = limit(1, 1_000, 2);
        for (name, store) in &s.all {
            s.clock.set(MAX_TIME);
            let k = key("clamp", "late");
            for _ in 0..2 {
                let d = store.acquire(&k, l, 1, ZERO).await.expect("decides");
                assert!(d.is_admitted(), "{name}: {d:?}");
            }
            for later in [MAX_TIME, MAX_TIME + 1, MAX_TIME + 5_000, u64::MAX] {
                s.clock.set(later);
                let d = store.acquire(&k, l, 1, ZERO).await.expect("decides");
                // Unclamped, 5 s later the bucket would be full again.
                assert_eq!(
                    d.retry_after(),
                    Some(Duration::from_millis(1_001)),
                    "{name}: at {later}"
                );
                let q = store.peek(&k, l).await.expect("peeks");
                assert_eq!(q.remaining(), 0, "{name}");
                // 2^53 + 1999 rounds to 2^53 + 2000.
                assert_eq!(q.resets_in(), Duration::from_millis(2_001), "{name}");
            }
        }
    }

    #[tokio::test]
    async fn a_drain_deadline_past_2_pow_44_ms_ahead_is_clamped() {
        let s = stores(START).await;
        let l = limit(1, 1_000, 2);
        // As far as `SystemTime` goes on this platform, and past 2^64 ms where it can.
        let far = [
            UNIX_EPOCH + Duration::from_millis(MAX_TIME + 1),
            UNIX_EPOCH + Duration::from_secs(u64::MAX / 1_000),
            UNIX_EPOCH + Duration::from_secs(1 << 62),
        ];
        for (name, store) in &s.all {
            for (i, until) in far.iter().enumerate() {
                let k = key("clamp", format!("drain-{i}"));
                store.drain_until(&k, l, *until).await.expect("drains");
                let d = store.acquire(&k, l, 1, ZERO).await.expect("decides");
                // Drained for the longest the arithmetic takes, 2^44 ms (about 557 years)
                // from now, and the first token one period after that.
                assert_eq!(
                    d.retry_after(),
                    Some(Duration::from_millis((1 << 44) + 1_000)),
                    "{name}: {until:?}"
                );
            }
        }
        // A deadline before the epoch is "now": the bucket is empty now, refilling from now.
        for (name, store) in &s.all {
            let k = key("clamp", "drain-past");
            let before_epoch = UNIX_EPOCH.checked_sub(Duration::from_secs(1));
            store
                .drain_until(&k, l, before_epoch.unwrap_or(UNIX_EPOCH))
                .await
                .expect("drains");
            let d = store.acquire(&k, l, 1, ZERO).await.expect("decides");
            assert_eq!(d.retry_after(), Some(Duration::from_secs(1)), "{name}");
        }
    }
}
