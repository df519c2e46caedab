//! The admin operations, `reset`, `set` and `block_until`, on every store (`MemoryStore` on a
//! manual clock, `RedisStore` on a real Redis, both behind `Arc<dyn DynBucketStore>`), then what
//! only the Redis store does with them: a `DEL`, the deny caches of this process and of others,
//! the breaker, the outage policies.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use burstgate::{BucketStore, Clock, DynBucketStore, ManualClock, MemoryStore, StoreError};

#[cfg(feature = "redis")]
use crate::support::redis_server;
use crate::support::{START, ZERO, key, limit};

/// `ms` milliseconds since the epoch, as a deadline.
fn at(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

/// The cases, each on a fresh store built on the given clock.
mod cases {
    use super::*;

    /// A reset bucket is full with no halt, and spends its whole burst again, while a
    /// reservation granted before the reset still holds its slot: more than the burst goes.
    pub(crate) async fn a_reset_bucket_is_full_again_with_no_halt<S, F>(
        make: impl FnOnce(ManualClock) -> F,
    ) where
        S: BucketStore,
        F: Future<Output = S>,
    {
        let clock = ManualClock::new(START);
        let store = make(clock.clone()).await;
        let orders = limit(1, 60_000, 10);
        let k = key("orders", "seller-1");
        for _ in 0..10 {
            assert!(
                store
                    .acquire(&k, orders, 1, ZERO)
                    .await
                    .expect("decides")
                    .is_admitted()
            );
        }
        let waiting = store
            .acquire(&k, orders, 1, Duration::from_secs(120))
            .await
            .expect("decides");
        assert_eq!(waiting.wait(), Duration::from_secs(60));
        store
            .drain_until(&k, orders, at(START + 600_000))
            .await
            .expect("drains");
        let spent = store.peek(&k, orders).await.expect("peeks");
        assert!(spent.remaining() == 0 && spent.halted_until().is_some());

        clock.advance(Duration::from_secs(1));
        store.reset(&k).await.expect("resets");
        let q = store.peek(&k, orders).await.expect("peeks");
        assert_eq!((q.remaining(), q.used(), q.burst()), (10, 0, 10));
        assert_eq!((q.resets_in(), q.next_token_in()), (ZERO, ZERO));
        assert_eq!(q.halted_until(), None);
        // The reservation is not called back: its holder sees no halt, and goes at its slot.
        let reservation = waiting.reservation().expect("admitted");
        assert!(!q.halts(&reservation));
        for left in (0..10).rev() {
            let d = store.acquire(&k, orders, 1, ZERO).await.expect("decides");
            assert!(d.is_admitted() && d.wait() == ZERO, "{d:?}");
            assert_eq!(d.remaining(), left);
        }
        let d = store.acquire(&k, orders, 1, ZERO).await.expect("decides");
        assert_eq!(d.retry_after(), Some(Duration::from_secs(60)));
        // A key the store never saw resets to what it was: full.
        let never = key("orders", "never-seen");
        store.reset(&never).await.expect("resets");
        assert_eq!(
            store.peek(&never, orders).await.expect("peeks").remaining(),
            10
        );
    }

    /// A set bucket holds exactly its tokens, refilling from now, with its debt and halt gone;
    /// above the burst is an error that changes nothing.
    pub(crate) async fn a_set_bucket_holds_exactly_its_tokens<S, F>(
        make: impl FnOnce(ManualClock) -> F,
    ) where
        S: BucketStore,
        F: Future<Output = S>,
    {
        let clock = ManualClock::new(START);
        let store = make(clock.clone()).await;
        let orders = limit(1, 60_000, 10);
        let k = key("orders", "seller-2");
        for _ in 0..13 {
            let d = store
                .acquire(&k, orders, 1, Duration::from_secs(600))
                .await
                .expect("decides");
            assert!(d.is_admitted());
        }
        store
            .drain_until(&k, orders, at(START + 900_000))
            .await
            .expect("drains");
        let before = store.peek(&k, orders).await.expect("peeks");
        let refused = store.set(&k, orders, 11).await;
        assert!(
            matches!(
                refused,
                Err(StoreError::TokensAboveBurst {
                    tokens: 11,
                    burst: 10
                })
            ),
            "{refused:?}"
        );
        assert_eq!(
            refused.map_err(|e| e.to_string()).err().as_deref(),
            Some("a bucket of burst 10 cannot be set to hold 11 tokens")
        );
        assert_eq!(store.peek(&k, orders).await.expect("peeks"), before);

        clock.advance(Duration::from_secs(5));
        store.set(&k, orders, 3).await.expect("sets");
        let q = store.peek(&k, orders).await.expect("peeks");
        assert_eq!((q.remaining(), q.halted_until()), (3, None));
        assert_eq!(q.resets_in(), Duration::from_secs(7 * 60));
        for left in (0..3).rev() {
            let d = store.acquire(&k, orders, 1, ZERO).await.expect("decides");
            assert!(d.is_admitted() && d.wait() == ZERO, "{d:?}");
            assert_eq!(d.remaining(), left);
        }
        let d = store.acquire(&k, orders, 1, ZERO).await.expect("decides");
        assert_eq!(d.retry_after(), Some(Duration::from_secs(60)));

        // Empty: the first token one token period from now. Full: the burst.
        store.set(&k, orders, 0).await.expect("sets");
        let q = store.peek(&k, orders).await.expect("peeks");
        assert_eq!(
            (q.remaining(), q.next_token_in()),
            (0, Duration::from_secs(60))
        );
        store.set(&k, orders, 10).await.expect("sets");
        let q = store.peek(&k, orders).await.expect("peeks");
        assert_eq!((q.remaining(), q.resets_in()), (10, ZERO));
    }

    /// A block admits nothing before its deadline and the first request at it, to the
    /// millisecond, for token periods whole and not, including deadlines where a drain one token
    /// period short would let the first request go a millisecond late (1,001 ms under 1 per
    /// second, 60,032 ms under 1 per minute).
    pub(crate) async fn a_block_admits_the_first_request_exactly_at_its_deadline<S, F>(
        make: impl FnOnce(ManualClock) -> F,
    ) where
        S: BucketStore,
        F: Future<Output = S>,
    {
        let clock = ManualClock::new(START);
        let store = make(clock.clone()).await;
        let cases = [
            (limit(1, 1_000, 10), 1_001),
            (limit(1, 1_000, 10), 1),
            (limit(1, 60_000, 10), 60_032),
            (limit(1, 60_000, 10), 90_000),
            (limit(3, 1_000, 5), 2_500),
            (limit(100, 1_000, 100), 7),
        ];
        for (i, (l, ahead)) in cases.into_iter().enumerate() {
            let k = key("blocked", format!("case-{i}"));
            // Part spent, so that the block has tokens to take away.
            assert!(
                store
                    .acquire(&k, l, 1, ZERO)
                    .await
                    .expect("decides")
                    .is_admitted()
            );
            let until = clock.now_ms() + ahead;
            store.block_until(&k, l, at(until)).await.expect("blocks");
            let q = store.peek(&k, l).await.expect("peeks");
            assert_eq!(q.halted_until(), Some(at(until)), "case {i}");
            assert_eq!(q.remaining(), 0);
            assert_eq!(q.next_token_in(), Duration::from_millis(ahead));
            clock.advance(Duration::from_millis(ahead - 1));
            let d = store.acquire(&k, l, 1, ZERO).await.expect("decides");
            assert_eq!(d.retry_after(), Some(Duration::from_millis(1)), "case {i}");
            clock.advance(Duration::from_millis(1));
            let d = store.acquire(&k, l, 1, ZERO).await.expect("decides");
            assert!(d.is_admitted() && d.wait() == ZERO, "case {i}: {d:?}");
        }

        // A reservation made during the block is slotted at its deadline; one granted before
        // it, slotted earlier, is halted.
        let l = limit(1, 1_000, 1);
        let k = key("blocked", "queue");
        assert!(
            store
                .acquire(&k, l, 1, ZERO)
                .await
                .expect("decides")
                .is_admitted()
        );
        let early = store
            .acquire(&k, l, 1, Duration::from_secs(5))
            .await
            .expect("decides");
        assert_eq!(early.wait(), Duration::from_secs(1));
        let until = clock.now_ms() + 10_000;
        store.block_until(&k, l, at(until)).await.expect("blocks");
        let q = store.peek(&k, l).await.expect("peeks");
        assert!(q.halts(&early.reservation().expect("admitted")));
        clock.advance(Duration::from_secs(3));
        let during = store
            .acquire(&k, l, 1, Duration::from_secs(60))
            .await
            .expect("decides");
        let slot = during.reservation().expect("admitted").ready_at();
        assert_eq!(slot, at(until));
        assert!(
            !store
                .peek(&k, l)
                .await
                .expect("peeks")
                .halts(&during.reservation().expect("admitted"))
        );

        // A deadline not ahead changes nothing.
        let k = key("blocked", "past");
        assert!(
            store
                .acquire(&k, l, 1, ZERO)
                .await
                .expect("decides")
                .is_admitted()
        );
        clock.advance(Duration::from_secs(1));
        let before = store.peek(&k, l).await.expect("peeks");
        store
            .block_until(&k, l, at(clock.now_ms()))
            .await
            .expect("blocks");
        store.block_until(&k, l, at(START)).await.expect("blocks");
        assert_eq!(store.peek(&k, l).await.expect("peeks"), before);
        assert!(
            store
                .acquire(&k, l, 1, ZERO)
                .await
                .expect("decides")
                .is_admitted()
        );
    }
}

async fn memory(clock: ManualClock) -> MemoryStore<ManualClock> {
    MemoryStore::new().with_clock(clock)
}

async fn dyn_memory(clock: ManualClock) -> Arc<dyn DynBucketStore> {
    Arc::new(memory(clock).await)
}

#[cfg(feature = "redis")]
async fn conn() -> redis::aio::MultiplexedConnection {
    redis::Client::open(redis_server::url())
        .expect("a valid Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("a connection to the test Redis")
}

#[cfg(feature = "redis")]
async fn redis(
    clock: ManualClock,
) -> burstgate::RedisStore<redis::aio::MultiplexedConnection, ManualClock> {
    burstgate::RedisStore::new(conn().await)
        .prefix(&redis_server::unique_prefix())
        .expect("a valid prefix")
        .with_clock(clock)
}

#[cfg(feature = "redis")]
async fn dyn_redis(clock: ManualClock) -> Arc<dyn DynBucketStore> {
    Arc::new(redis(clock).await)
}

macro_rules! suite {
    ($name:ident, $make:expr) => {
        mod $name {
            use super::*;

            #[tokio::test]
            async fn a_reset_bucket_is_full_again_with_no_halt() {
                cases::a_reset_bucket_is_full_again_with_no_halt($make).await;
            }

            #[tokio::test]
            async fn a_set_bucket_holds_exactly_its_tokens() {
                cases::a_set_bucket_holds_exactly_its_tokens($make).await;
            }

            #[tokio::test]
            async fn a_block_admits_the_first_request_exactly_at_its_deadline() {
                cases::a_block_admits_the_first_request_exactly_at_its_deadline($make).await;
            }
        }
    };
}

suite!(memory_store, memory);
suite!(dyn_memory_store, dyn_memory);
#[cfg(feature = "redis")]
suite!(redis_store, redis);
#[cfg(feature = "redis")]
suite!(dyn_redis_store, dyn_redis);

/// What only the Redis store does with the admin operations.
#[cfg(feature = "redis")]
mod redis_only {
    use std::num::NonZeroU32;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use burstgate::{Breaker, OutagePolicy, RedisStore};
    use redis::aio::{ConnectionLike, MultiplexedConnection};
    use redis::{AsyncCommands, Cmd, Pipeline, RedisFuture, Value};

    use super::*;

    /// A real connection that refuses every call while `down`, and counts the calls it gets.
    #[derive(Clone)]
    struct Switch {
        inner: MultiplexedConnection,
        down: Arc<AtomicBool>,
        calls: Arc<AtomicUsize>,
    }

    impl Switch {
        async fn new() -> Self {
            Self {
                inner: conn().await,
                down: Arc::default(),
                calls: Arc::default(),
            }
        }

        fn refused() -> redis::RedisError {
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
        }
    }

    impl ConnectionLike for Switch {
        fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.down.load(Ordering::SeqCst) {
                return Box::pin(async { Err(Self::refused()) });
            }
            self.inner.req_packed_command(cmd)
        }

        fn req_packed_commands<'a>(
            &'a mut self,
            cmd: &'a Pipeline,
            offset: usize,
            count: usize,
        ) -> RedisFuture<'a, Vec<Value>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            if self.down.load(Ordering::SeqCst) {
                return Box::pin(async { Err(Self::refused()) });
            }
            self.inner.req_packed_commands(cmd, offset, count)
        }

        fn get_db(&self) -> i64 {
            0
        }
    }

    /// A reset is a `DEL` of the key, whatever the key holds: a value someone else wrote there
    /// is refused by the other operations and cleared by a reset.
    #[tokio::test]
    async fn a_reset_deletes_the_key_even_one_that_holds_no_bucket() {
        let clock = ManualClock::new(START);
        let store = redis(clock.clone()).await;
        let (orders, k) = (limit(1, 60_000, 10), key("orders", "seller-3"));
        let redis_key = store.redis_key(&k);
        let mut c = conn().await;
        assert!(
            store
                .acquire(&k, orders, 1, ZERO)
                .await
                .expect("decides")
                .is_admitted()
        );
        assert!(c.exists::<_, bool>(&redis_key).await.expect("EXISTS"));
        store.reset(&k).await.expect("resets");
        assert!(!c.exists::<_, bool>(&redis_key).await.expect("EXISTS"));

        let _: () = c.hset(&redis_key, "t", "1").await.expect("HSET");
        assert!(matches!(
            store.set(&k, orders, 5).await,
            Err(StoreError::WrongType { .. })
        ));
        assert!(matches!(
            store.block_until(&k, orders, at(START + 1_000)).await,
            Err(StoreError::WrongType { .. })
        ));
        store.reset(&k).await.expect("resets");
        assert!(!c.exists::<_, bool>(&redis_key).await.expect("EXISTS"));
        assert_eq!(store.peek(&k, orders).await.expect("peeks").remaining(), 10);
    }

    /// A set or a block writes the key with the expiry every write gets: kept until the bucket
    /// is full again, plus one interval (and up to one more).
    #[tokio::test]
    async fn a_set_and_a_block_keep_the_key_until_full_plus_an_interval() {
        let clock = ManualClock::new(START);
        let store = redis(clock.clone()).await;
        let (orders, k) = (limit(1, 60_000, 10), key("orders", "seller-4"));
        let mut c = conn().await;
        store.set(&k, orders, 4).await.expect("sets");
        // Six tokens to refill: six minutes, plus the interval, plus the interval of margin.
        let pttl: i64 = c.pttl(store.redis_key(&k)).await.expect("PTTL");
        assert!((479_000..=480_000).contains(&pttl), "{pttl}");
        store
            .block_until(&k, orders, at(START + 120_000))
            .await
            .expect("blocks");
        // One token at 2 min, full 9 minutes later: 11 min, plus two intervals.
        let pttl: i64 = c.pttl(store.redis_key(&k)).await.expect("PTTL");
        assert!((779_000..=780_000).contains(&pttl), "{pttl}");
    }

    /// The store that resets, sets or blocks a bucket forgets it in its deny cache at once;
    /// another process's cache keeps denying until the retry time of the denial it cached, and
    /// no longer. Each store here is a process of its own, with its own cache.
    #[tokio::test]
    async fn an_admin_call_clears_this_processs_deny_cache_and_others_deny_until_their_retry() {
        let clock = ManualClock::new(START);
        let prefix = redis_server::unique_prefix();
        let here = RedisStore::new(conn().await)
            .prefix(&prefix)
            .expect("a valid prefix")
            .with_clock(clock.clone());
        let elsewhere_conn = Switch::new().await;
        let elsewhere = RedisStore::new(elsewhere_conn.clone())
            .prefix(&prefix)
            .expect("a valid prefix")
            .with_clock(clock.clone());
        let (orders, k) = (limit(1, 60_000, 2), key("orders", "seller-5"));
        for _ in 0..2 {
            assert!(
                here.acquire(&k, orders, 1, ZERO)
                    .await
                    .expect("decides")
                    .is_admitted()
            );
        }
        let d = here.acquire(&k, orders, 1, ZERO).await.expect("decides");
        assert_eq!(d.retry_after(), Some(Duration::from_secs(60)));
        let d = elsewhere
            .acquire(&k, orders, 1, ZERO)
            .await
            .expect("decides");
        assert_eq!(d.retry_after(), Some(Duration::from_secs(60)));
        // Both caches hold the denial now: a second one goes nowhere near Redis.
        let calls = elsewhere_conn.calls.load(Ordering::SeqCst);
        assert!(
            !elsewhere
                .acquire(&k, orders, 1, ZERO)
                .await
                .expect("decides")
                .is_admitted()
        );
        assert_eq!(elsewhere_conn.calls.load(Ordering::SeqCst), calls);

        clock.advance(Duration::from_secs(10));
        here.reset(&k).await.expect("resets");
        let d = here.acquire(&k, orders, 1, ZERO).await.expect("decides");
        assert!(d.is_admitted() && d.remaining() == 1, "{d:?}");
        // The other process still denies from its cache, until the retry time it was given.
        clock.advance(Duration::from_secs(49));
        let d = elsewhere
            .acquire(&k, orders, 1, ZERO)
            .await
            .expect("decides");
        assert_eq!(d.retry_after(), Some(Duration::from_secs(1)));
        clock.advance(Duration::from_secs(1));
        let d = elsewhere
            .acquire(&k, orders, 1, ZERO)
            .await
            .expect("decides");
        assert!(d.is_admitted(), "{d:?}");

        // The same for a set made here, after a denial cached here: 0.83 tokens, the next in
        // 10 s, and then 2 at once.
        let d = here.acquire(&k, orders, 1, ZERO).await.expect("decides");
        assert_eq!(d.retry_after(), Some(Duration::from_secs(10)));
        here.set(&k, orders, 2).await.expect("sets");
        let d = here.acquire(&k, orders, 1, ZERO).await.expect("decides");
        assert!(d.is_admitted() && d.remaining() == 1, "{d:?}");
    }

    /// Admin calls go through the breaker: while it is open they are refused with
    /// `Unavailable` without reaching Redis, and whatever the outage policy, a call Redis did
    /// not answer is an error, never a local stand-in.
    #[tokio::test]
    async fn admin_calls_are_refused_while_the_breaker_is_open_under_every_policy() {
        let clock = ManualClock::new(START);
        let (orders, k) = (limit(1, 60_000, 10), key("orders", "seller-6"));
        let local = OutagePolicy::Local {
            processes: NonZeroU32::MIN,
        };
        for policy in [OutagePolicy::FailClosed, OutagePolicy::FailOpen, local] {
            let switch = Switch::new().await;
            let store = RedisStore::new(switch.clone())
                .prefix(&redis_server::unique_prefix())
                .expect("a valid prefix")
                .with_clock(clock.clone())
                .on_outage(policy)
                .breaker(Breaker::new(
                    NonZeroU32::MIN.saturating_add(1),
                    Duration::from_secs(60),
                ));
            switch.down.store(true, Ordering::SeqCst);
            let e = store.reset(&k).await.expect_err("redis is down");
            assert!(matches!(e, StoreError::Backend(_)), "{policy:?}: {e:?}");
            let e = store.set(&k, orders, 1).await.expect_err("redis is down");
            assert!(matches!(e, StoreError::Backend(_)), "{policy:?}: {e:?}");
            assert!(store.is_circuit_open(), "{policy:?}");
            let calls = switch.calls.load(Ordering::SeqCst);
            for result in [
                store.reset(&k).await,
                store.set(&k, orders, 1).await,
                store.block_until(&k, orders, at(START + 1_000)).await,
            ] {
                assert!(
                    matches!(result, Err(StoreError::Unavailable { .. })),
                    "{policy:?}: {result:?}"
                );
            }
            assert_eq!(switch.calls.load(Ordering::SeqCst), calls, "{policy:?}");
        }
    }

    /// Under the local policy, a process that admitted a key from its local bucket during an
    /// outage empties Redis's bucket before its next decision on the key. An admin call made by
    /// that same process replaces the charge: the reset bucket is not emptied after it.
    #[tokio::test]
    async fn an_admin_call_drops_this_processs_charge_for_local_admissions() {
        let clock = ManualClock::new(START);
        let (orders, k) = (limit(1, 60_000, 10), key("orders", "seller-7"));
        let switch = Switch::new().await;
        let store = RedisStore::new(switch.clone())
            .prefix(&redis_server::unique_prefix())
            .expect("a valid prefix")
            .with_clock(clock.clone())
            .on_outage(OutagePolicy::Local {
                processes: NonZeroU32::MIN,
            });
        switch.down.store(true, Ordering::SeqCst);
        assert!(
            store
                .acquire(&k, orders, 1, ZERO)
                .await
                .expect("decides locally")
                .is_admitted()
        );
        switch.down.store(false, Ordering::SeqCst);
        // One failure: the breaker, which opens after three, is still closed.
        assert!(!store.is_circuit_open());
        store.reset(&k).await.expect("resets");
        let d = store.acquire(&k, orders, 1, ZERO).await.expect("decides");
        assert!(d.is_admitted() && d.remaining() == 9, "{d:?}");
    }
}
