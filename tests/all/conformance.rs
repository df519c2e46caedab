// Over 600 lines: one idea, one conformance suite written once for every store.
//! One conformance suite, written once, run against every `BucketStore`: `MemoryStore`,
//! `RedisStore` on a real Redis and on a real three-primary Redis Cluster, and both behind
//! `Arc<dyn DynBucketStore>`.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use burstgate::{
    BucketKey, BucketStore, Claim, DynBucketStore, Limit, ManualClock, MemoryStore, Reservation,
    StoreError, Take,
};

use crate::support::{START, ZERO, key, limit};
#[cfg(feature = "redis")]
use crate::support::{redis_cluster, redis_server};

/// The cases. Each takes a function that builds a fresh, empty store on the given clock.
mod cases {
    use super::*;

    pub(crate) async fn a_full_bucket_admits_burst_then_one_per_interval<S, F>(
        make: impl FnOnce(ManualClock) -> F,
    ) where
        S: BucketStore,
        F: Future<Output = S>,
    {
        let clock = ManualClock::new(START);
        let store = make(clock.clone()).await;
        let orders = limit(1, 60_000, 10);
        let k = key("orders", "seller-1");
        for left in (0..10).rev() {
            let d = store.acquire(&k, orders, 1, ZERO).await.expect("decides");
            assert!(d.is_admitted() && d.wait() == ZERO, "{d:?}");
            assert_eq!(d.remaining(), left);
        }
        let d = store.acquire(&k, orders, 1, ZERO).await.expect("decides");
        assert!(!d.is_admitted());
        assert_eq!(d.retry_after(), Some(Duration::from_secs(60)));
        assert_eq!(d.resets_in(), Duration::from_secs(600));
        assert_eq!(d.limit(), orders);
        clock.advance(Duration::from_millis(59_999));
        let d = store.acquire(&k, orders, 1, ZERO).await.expect("decides");
        assert_eq!(d.retry_after(), Some(Duration::from_millis(1)));
        clock.advance(Duration::from_millis(1));
        let d = store.acquire(&k, orders, 1, ZERO).await.expect("decides");
        assert!(d.is_admitted() && d.wait() == ZERO);
    }

    pub(crate) async fn reservations_queue_in_arrival_order<S, F>(
        make: impl FnOnce(ManualClock) -> F,
    ) where
        S: BucketStore,
        F: Future<Output = S>,
    {
        let clock = ManualClock::new(START);
        let store = make(clock.clone()).await;
        let l = limit(1, 1_000, 2);
        let k = key("queue", "a");
        let max_wait = Duration::from_secs(3);
        let mut waits = Vec::new();
        for _ in 0..5 {
            let d = store.acquire(&k, l, 1, max_wait).await.expect("decides");
            assert!(d.is_admitted(), "{d:?}");
            waits.push(d.wait().as_millis());
        }
        assert_eq!(waits, [0, 0, 1_000, 2_000, 3_000]);
        // The sixth would wait 4 s, over the ceiling: denied, and nothing taken.
        let before = store.peek(&k, l).await.expect("peeks");
        let d = store.acquire(&k, l, 1, max_wait).await.expect("decides");
        assert!(!d.is_admitted());
        assert_eq!(d.retry_after(), Some(Duration::from_secs(4)));
        assert_eq!(store.peek(&k, l).await.expect("peeks"), before);
        assert_eq!(before.remaining(), 0);
        assert_eq!(before.resets_in(), Duration::from_secs(5));
        assert_eq!(before.next_token_in(), Duration::from_secs(4));
    }

    pub(crate) async fn refunds_return_tokens_up_to_capacity<S, F>(
        make: impl FnOnce(ManualClock) -> F,
    ) where
        S: BucketStore,
        F: Future<Output = S>,
    {
        let clock = ManualClock::new(START);
        let store = make(clock.clone()).await;
        let l = limit(1, 1_000, 3);
        let k = key("refund", "a");
        assert!(
            store
                .acquire(&k, l, 3, ZERO)
                .await
                .expect("decides")
                .is_admitted()
        );
        let d = store
            .acquire(&k, l, 2, Duration::from_secs(10))
            .await
            .expect("decides");
        assert_eq!(d.wait(), Duration::from_secs(2));
        // The caller gives up: its reservation goes back.
        let reservation = d.reservation().expect("admitted");
        store.refund(&k, l, reservation).await.expect("refunds");
        let q = store.peek(&k, l).await.expect("peeks");
        assert_eq!((q.remaining(), q.used()), (0, 3));
        assert_eq!(q.next_token_in(), Duration::from_secs(1));
        // More refunds than were taken never raise the bucket above capacity.
        let now = Reservation::new(3, UNIX_EPOCH + Duration::from_millis(START));
        store.refund(&k, l, now).await.expect("refunds");
        store.refund(&k, l, now).await.expect("refunds");
        let q = store.peek(&k, l).await.expect("peeks");
        assert_eq!((q.burst(), q.remaining(), q.used()), (3, 3, 0));
        assert_eq!(q.resets_in(), ZERO);
    }

    /// The slot of each admission, in ms from START.
    async fn slot<S: BucketStore>(store: &S, k: &BucketKey, l: Limit) -> (u64, Reservation) {
        let d = store
            .acquire(k, l, 1, Duration::from_secs(3_600))
            .await
            .expect("decides");
        let r = d.reservation().expect("admitted");
        let at = r.ready_at().duration_since(UNIX_EPOCH).expect("after 1970");
        (at.as_millis() as u64 - START, r)
    }

    pub(crate) async fn a_refund_from_the_middle_of_the_queue_double_books_a_slot<S, F>(
        make: impl FnOnce(ManualClock) -> F,
    ) where
        S: BucketStore,
        F: Future<Output = S>,
    {
        let store = make(ManualClock::new(START)).await;
        // 1 per minute, no burst.
        let l = limit(1, 60_000, 1);
        let k = key("queue", "seller");
        let (a, _) = slot(&store, &k, l).await;
        let (b, middle) = slot(&store, &k, l).await;
        let (c, tail) = slot(&store, &k, l).await;
        assert_eq!((a, b, c), (0, 60_000, 120_000));
        // The middle one gives up: its slot is not the tail's to hand out again.
        store.refund(&k, l, middle).await.expect("refunds");
        let (d, last) = slot(&store, &k, l).await;
        assert_eq!(d, 180_000, "booked after every reservation still waiting");
        // Every send that goes out (a, c, d) is at least one token period from the others.
        for pair in [(a, c), (c, d)] {
            assert!(pair.1 - pair.0 >= 60_000, "{pair:?}");
        }
        // The tail's refund gives its slot back, once however often it is made.
        store.refund(&k, l, last).await.expect("refunds");
        store.refund(&k, l, last).await.expect("refunds");
        let (e, _) = slot(&store, &k, l).await;
        assert_eq!(e, 180_000);
        // And a reservation no longer last in the queue gives nothing back.
        store.refund(&k, l, tail).await.expect("refunds");
        let (f, _) = slot(&store, &k, l).await;
        assert_eq!(f, 240_000);
    }

    pub(crate) async fn a_drain_blocks_every_caller_until_its_deadline<S, F>(
        make: impl FnOnce(ManualClock) -> F,
    ) where
        S: BucketStore,
        F: Future<Output = S>,
    {
        let clock = ManualClock::new(START);
        let store = make(clock.clone()).await;
        let l = limit(10, 1_000, 10);
        let k = key("drain", "acct");
        let until = UNIX_EPOCH + Duration::from_millis(START + 2_000);
        store.drain_until(&k, l, until).await.expect("drains");
        let d = store.acquire(&k, l, 1, ZERO).await.expect("decides");
        assert_eq!(d.retry_after(), Some(Duration::from_millis(2_100)));
        clock.advance(Duration::from_millis(2_099));
        assert!(
            !store
                .acquire(&k, l, 1, ZERO)
                .await
                .expect("decides")
                .is_admitted()
        );
        clock.advance(Duration::from_millis(1));
        assert!(
            store
                .acquire(&k, l, 1, ZERO)
                .await
                .expect("decides")
                .is_admitted()
        );
        // A deadline already past still empties the bucket now.
        store.drain_until(&k, l, UNIX_EPOCH).await.expect("drains");
        let q = store.peek(&k, l).await.expect("peeks");
        assert_eq!(q.remaining(), 0);
        assert_eq!(q.next_token_in(), Duration::from_millis(100));
    }

    pub(crate) async fn a_drain_halts_the_reservations_queued_before_it<S, F>(
        make: impl FnOnce(ManualClock) -> F,
    ) where
        S: BucketStore,
        F: Future<Output = S>,
    {
        let clock = ManualClock::new(START);
        let store = make(clock.clone()).await;
        // One token a second, no burst: the refill takes a second, so a halt is kept until 2 s
        // behind the bucket's time.
        let l = limit(1, 1_000, 1);
        let k = key("halt", "acct");
        let at = |ms: u64| UNIX_EPOCH + Duration::from_millis(START + ms);
        let reserve = |max_wait: u64| {
            let (store, k) = (&store, &k);
            async move {
                let d = store
                    .acquire(k, l, 1, Duration::from_millis(max_wait))
                    .await
                    .expect("decides");
                d.reservation().expect("admitted")
            }
        };
        reserve(0).await;
        let (r1, r2) = (reserve(5_000).await, reserve(5_000).await);
        assert_eq!((r1.ready_at(), r2.ready_at()), (at(1_000), at(2_000)));
        let q = store.peek(&k, l).await.expect("peeks");
        assert_eq!(q.halted_until(), None);
        assert!(!q.halts(&r1) && !q.halts(&r2));

        // Empty until 2.5 s: the first token at 3.5 s, past both slots.
        store.drain_until(&k, l, at(2_500)).await.expect("drains");
        let q = store.peek(&k, l).await.expect("peeks");
        assert_eq!(q.halted_until(), Some(at(3_500)));
        assert!(q.halts(&r1) && q.halts(&r2));
        // Reserved again, they queue behind the back-off, where the halt stops nothing.
        let (r3, r4) = (reserve(10_000).await, reserve(10_000).await);
        assert_eq!((r3.ready_at(), r4.ready_at()), (at(3_500), at(4_500)));
        // A shorter drain after a longer one keeps the longer halt.
        store.drain_until(&k, l, at(500)).await.expect("drains");
        let q = store.peek(&k, l).await.expect("peeks");
        assert_eq!(q.halted_until(), Some(at(3_500)));
        assert!(q.halts(&r1) && !q.halts(&r3) && !q.halts(&r4));

        // Forgotten once it is the refill time plus an interval behind.
        clock.advance(Duration::from_millis(5_499));
        let q = store.peek(&k, l).await.expect("peeks");
        assert_eq!(q.halted_until(), Some(at(3_500)));
        clock.advance(Duration::from_millis(1));
        assert_eq!(store.peek(&k, l).await.expect("peeks").halted_until(), None);
    }

    pub(crate) async fn peek_takes_nothing<S, F>(make: impl FnOnce(ManualClock) -> F)
    where
        S: BucketStore,
        F: Future<Output = S>,
    {
        let clock = ManualClock::new(START);
        let store = make(clock.clone()).await;
        let l = limit(2, 1_000, 4);
        let k = key("peek", "a");
        for _ in 0..3 {
            let q = store.peek(&k, l).await.expect("peeks");
            assert_eq!((q.burst(), q.remaining(), q.used()), (4, 4, 0));
            assert_eq!((q.resets_in(), q.next_token_in()), (ZERO, ZERO));
        }
        assert!(
            store
                .acquire(&k, l, 3, ZERO)
                .await
                .expect("decides")
                .is_admitted()
        );
        let q = store.peek(&k, l).await.expect("peeks");
        assert_eq!((q.remaining(), q.used()), (1, 3));
        assert_eq!(q.resets_in(), Duration::from_millis(1_500));
    }

    pub(crate) async fn lowering_follows_a_report_down_and_never_up<S, F>(
        make: impl FnOnce(ManualClock) -> F,
    ) where
        S: BucketStore,
        F: Future<Output = S>,
    {
        let clock = ManualClock::new(START);
        let store = make(clock.clone()).await;
        // 20 a second, burst 9.
        let l = limit(20, 1_000, 9);
        let k = key("synced", "a");
        // A report at or above the burst changes nothing; one below lowers the full bucket.
        assert!(!store.lower_to(&k, l, 9).await.expect("lowers"));
        assert!(!store.lower_to(&k, l, 25).await.expect("lowers"));
        assert!(store.lower_to(&k, l, 3).await.expect("lowers"));
        let q = store.peek(&k, l).await.expect("peeks");
        assert_eq!(q.remaining(), 3);
        // Never raised: a later report of more is ignored.
        assert!(!store.lower_to(&k, l, 5).await.expect("lowers"));
        for _ in 0..3 {
            let d = store.acquire(&k, l, 1, ZERO).await.expect("decides");
            assert!(d.is_admitted() && d.wait() == ZERO);
        }
        let d = store.acquire(&k, l, 1, ZERO).await.expect("decides");
        assert_eq!(d.retry_after(), Some(Duration::from_millis(50)));
        // Reservations queued keep their slots: a bucket in debt holds less than any report.
        let queued = store
            .acquire(&k, l, 1, Duration::from_secs(1))
            .await
            .expect("decides");
        assert_eq!(queued.wait(), Duration::from_millis(50));
        assert!(!store.lower_to(&k, l, 0).await.expect("lowers"));
        let next = store
            .acquire(&k, l, 1, Duration::from_secs(1))
            .await
            .expect("decides");
        assert_eq!(next.wait(), Duration::from_millis(100));
        // Refilled, then told nothing is left: the next token one token period from then.
        clock.advance(Duration::from_millis(1_000));
        assert!(store.lower_to(&k, l, 0).await.expect("lowers"));
        let d = store.acquire(&k, l, 1, ZERO).await.expect("decides");
        assert_eq!(d.retry_after(), Some(Duration::from_millis(50)));
    }

    /// A booked turn's mark: booked, spent once, never booked again, and missing (what a store
    /// that lost it answers too) when it was never booked or its time had passed.
    pub(crate) async fn a_mark_is_booked_then_spent_once<S, F>(make: impl FnOnce(ManualClock) -> F)
    where
        S: BucketStore,
        F: Future<Output = S>,
    {
        let clock = ManualClock::new(START);
        let store = make(clock.clone()).await;
        let k = key("tickets", "a");
        let until = UNIX_EPOCH + Duration::from_millis(START + 60_000);
        let claim = |k: BucketKey, id: &'static str| {
            let store = &store;
            async move { store.claim(&k, id).await.expect("claims") }
        };
        // Never booked: missing, and a claim books nothing.
        assert_eq!(claim(k.clone(), "0f1e2d").await, Claim::Missing);
        assert_eq!(claim(k.clone(), "0f1e2d").await, Claim::Missing);
        store.book(&k, "0f1e2d", until).await.expect("books");
        assert_eq!(claim(k.clone(), "0f1e2d").await, Claim::First);
        assert_eq!(claim(k.clone(), "0f1e2d").await, Claim::Spent);
        assert_eq!(claim(k.clone(), "0f1e2d").await, Claim::Spent);
        // Booked again once spent: it stays spent.
        store.book(&k, "0f1e2d", until).await.expect("books");
        assert_eq!(claim(k.clone(), "0f1e2d").await, Claim::Spent);
        // Booked twice before its claim: spent once.
        store.book(&k, "0f1e2e", until).await.expect("books");
        store.book(&k, "0f1e2e", until).await.expect("books");
        assert_eq!(claim(k.clone(), "0f1e2e").await, Claim::First);
        assert_eq!(claim(k.clone(), "0f1e2e").await, Claim::Spent);
        // The same id beside another bucket, or for another key: a mark of its own.
        let other = key("tickets", "b");
        assert_eq!(claim(other.clone(), "0f1e2d").await, Claim::Missing);
        store.book(&other, "0f1e2d", until).await.expect("books");
        assert_eq!(claim(other.clone(), "0f1e2d").await, Claim::First);
        let elsewhere = key("receipts", "a");
        store
            .book(&elsewhere, "0f1e2d", until)
            .await
            .expect("books");
        assert_eq!(claim(elsewhere, "0f1e2d").await, Claim::First);
        // Booked with its time passed, or at it: nothing to keep, so missing.
        let past = UNIX_EPOCH + Duration::from_millis(START - 1);
        store.book(&k, "0f1e2f", past).await.expect("books");
        assert_eq!(claim(k.clone(), "0f1e2f").await, Claim::Missing);
        let now = UNIX_EPOCH + Duration::from_millis(START);
        store.book(&k, "0f1e30", now).await.expect("books");
        assert_eq!(claim(k.clone(), "0f1e30").await, Claim::Missing);
        // The buckets are untouched.
        let q = store.peek(&k, limit(1, 1_000, 3)).await.expect("peeks");
        assert_eq!(q.remaining(), 3);
    }

    pub(crate) async fn impossible_costs_are_errors_not_waits<S, F>(
        make: impl FnOnce(ManualClock) -> F,
    ) where
        S: BucketStore,
        F: Future<Output = S>,
    {
        let store = make(ManualClock::new(START)).await;
        let l = limit(1, 1_000, 5);
        let k = key("cost", "a");
        let e = store.acquire(&k, l, 0, ZERO).await;
        assert!(matches!(e, Err(StoreError::ZeroCost)), "{e:?}");
        let e = store.acquire(&k, l, 6, Duration::MAX).await;
        assert!(
            matches!(e, Err(StoreError::CostAboveBurst { cost: 6, burst: 5 })),
            "{e:?}"
        );
        let e = store
            .refund(
                &k,
                l,
                Reservation::new(0, UNIX_EPOCH + Duration::from_millis(START)),
            )
            .await;
        assert!(matches!(e, Err(StoreError::ZeroCost)), "{e:?}");
        // Nothing was taken by the refused calls.
        assert_eq!(store.peek(&k, l).await.expect("peeks").remaining(), 5);
    }

    pub(crate) async fn keys_and_buckets_are_independent<S, F>(make: impl FnOnce(ManualClock) -> F)
    where
        S: BucketStore,
        F: Future<Output = S>,
    {
        let store = make(ManualClock::new(START)).await;
        let l = limit(1, 60_000, 1);
        let keys = [
            key("a", "x"),
            key("a", "y"),
            key("b", "x"),
            key("a", "x:y"),
            key("a", "x%3Ay"),
            BucketKey::hashed("a", "x").expect("a valid key"),
        ];
        for k in &keys {
            let d = store.acquire(k, l, 1, ZERO).await.expect("decides");
            assert!(d.is_admitted(), "{k} shared a bucket with an earlier key");
        }
        for k in &keys {
            assert!(
                !store
                    .acquire(k, l, 1, ZERO)
                    .await
                    .expect("decides")
                    .is_admitted()
            );
        }
    }

    pub(crate) async fn a_stale_clock_gets_no_credit<S, F>(make: impl FnOnce(ManualClock) -> F)
    where
        S: BucketStore,
        F: Future<Output = S>,
    {
        let clock = ManualClock::new(START);
        let store = make(clock.clone()).await;
        let l = limit(1, 1_000, 1);
        let k = key("skew", "a");
        assert!(
            store
                .acquire(&k, l, 1, ZERO)
                .await
                .expect("decides")
                .is_admitted()
        );
        // A worker whose clock is 1.5 s behind (within the lead bound of 2 s) sees no refill for
        // negative time, and is told the wait from the stored time, as its writer would be...
        clock.set(START - 1_500);
        let d = store.acquire(&k, l, 1, ZERO).await.expect("decides");
        assert_eq!(d.retry_after(), Some(Duration::from_secs(1)));
        // ...and one 1 s ahead is admitted once, the most skew can cost.
        clock.set(START + 1_000);
        assert!(
            store
                .acquire(&k, l, 1, ZERO)
                .await
                .expect("decides")
                .is_admitted()
        );
        clock.set(START + 500);
        let d = store.acquire(&k, l, 1, ZERO).await.expect("decides");
        assert_eq!(d.retry_after(), Some(Duration::from_millis(1_000)));
    }

    pub(crate) async fn concurrent_callers_get_exactly_the_burst<S, F>(
        make: impl FnOnce(ManualClock) -> F,
    ) where
        S: BucketStore + Clone,
        F: Future<Output = S>,
    {
        let store = make(ManualClock::new(START)).await;
        let l = limit(1, 60_000, 50);
        let k = Arc::new(key("flood", "one"));
        let mut tasks = Vec::new();
        for _ in 0..400 {
            let (store, k) = (store.clone(), Arc::clone(&k));
            tasks.push(tokio::spawn(async move {
                store.acquire(&k, l, 1, ZERO).await.map(|d| d.is_admitted())
            }));
        }
        let mut admitted = 0;
        for t in tasks {
            if t.await.expect("the task finishes").expect("decides") {
                admitted += 1;
            }
        }
        assert_eq!(admitted, 50);
    }

    /// An endpoint's limit and its account's, taken at once: all or none, at the later one's
    /// time, and each bucket debited as at that slot.
    pub(crate) async fn several_buckets_go_all_or_none<S, F>(make: impl FnOnce(ManualClock) -> F)
    where
        S: BucketStore,
        F: Future<Output = S>,
    {
        let clock = ManualClock::new(START);
        let store = make(clock.clone()).await;
        let (endpoint, account) = (limit(1, 1_000, 1), limit(10, 1_000, 2));
        let (e, a) = (key("orders", "seller-1"), key("account", "seller-1"));
        let both = [Take::new(&e, endpoint, 1), Take::new(&a, account, 1)];
        let first = store.acquire_all(&both, ZERO).await.expect("decides");
        assert_eq!(first.len(), 2);
        assert!(first.iter().all(|d| d.is_admitted() && d.wait() == ZERO));
        assert_eq!((first[0].remaining(), first[1].remaining()), (0, 1));
        assert_eq!((first[0].limit(), first[1].limit()), (endpoint, account));

        // Refused on the endpoint alone; the account keeps its token.
        let denied = store.acquire_all(&both, ZERO).await.expect("decides");
        assert!(denied.iter().all(|d| !d.is_admitted()));
        assert_eq!(denied[0].retry_after(), Some(Duration::from_secs(1)));
        assert_eq!(denied[1].retry_after(), Some(ZERO));
        assert_eq!(store.peek(&a, account).await.expect("peeks").remaining(), 1);

        // Allowed to wait, both go in a second. The account refills to full by then, and
        // is debited as at that slot: it then holds one token less than its burst.
        let queued = store
            .acquire_all(&both, Duration::from_secs(1))
            .await
            .expect("decides");
        assert!(queued.iter().all(|d| d.is_admitted()));
        assert!(queued.iter().all(|d| d.wait() == Duration::from_secs(1)));
        let slot = UNIX_EPOCH + Duration::from_millis(START + 1_000);
        for d in &queued {
            assert_eq!(d.reservation().map(|r| r.ready_at()), Some(slot));
        }
        clock.advance(Duration::from_secs(1));
        assert_eq!(store.peek(&a, account).await.expect("peeks").remaining(), 1);
        assert_eq!(
            store.peek(&e, endpoint).await.expect("peeks").remaining(),
            0
        );

        // One bucket: the plain acquire. None: nothing.
        let one = store
            .acquire_all(&[Take::new(&a, account, 1)], ZERO)
            .await
            .expect("decides");
        assert!(one[0].is_admitted() && one[0].remaining() == 0);
        assert!(
            store
                .acquire_all(&[], ZERO)
                .await
                .expect("decides")
                .is_empty()
        );
    }

    pub(crate) async fn several_buckets_refuse_bad_requests_whole<S, F>(
        make: impl FnOnce(ManualClock) -> F,
    ) where
        S: BucketStore,
        F: Future<Output = S>,
    {
        let store = make(ManualClock::new(START)).await;
        let l = limit(1, 1_000, 2);
        let (e, a) = (key("orders", "seller-2"), key("account", "seller-2"));
        let twice = [
            Take::new(&a, l, 1),
            Take::new(&e, l, 1),
            Take::new(&a, l, 1),
        ];
        assert!(matches!(
            store.acquire_all(&twice, ZERO).await,
            Err(StoreError::SameBucketTwice { bucket, .. }) if bucket == "account"
        ));
        let costly = [Take::new(&a, l, 1), Take::new(&e, l, 3)];
        assert!(matches!(
            store.acquire_all(&costly, ZERO).await,
            Err(StoreError::CostAboveBurst { cost: 3, burst: 2 })
        ));
        let keys: Vec<BucketKey> = (0..=burstgate::MAX_TAKES)
            .map(|i| key(&format!("b{i}"), "seller-2"))
            .collect();
        let many: Vec<Take<'_>> = keys.iter().map(|k| Take::new(k, l, 1)).collect();
        assert!(matches!(
            store.acquire_all(&many, ZERO).await,
            Err(StoreError::TooManyAtOnce { count: 17, max: 16 })
        ));
        // Nothing was taken by any of them.
        for k in [&a, &e] {
            assert_eq!(store.peek(k, l).await.expect("peeks").remaining(), 2);
        }
        let most = store
            .acquire_all(&many[..burstgate::MAX_TAKES], ZERO)
            .await
            .expect("decides");
        assert!(most.iter().all(|d| d.is_admitted() && d.remaining() == 1));
    }

    /// Requests on two buckets and requests on one of them, all at once: every request on
    /// both took from both or from neither.
    pub(crate) async fn concurrent_requests_on_two_buckets_never_take_one_alone<S, F>(
        make: impl FnOnce(ManualClock) -> F,
    ) where
        S: BucketStore + Clone,
        F: Future<Output = S>,
    {
        let store = make(ManualClock::new(START)).await;
        let (narrow, wide) = (limit(1, 60_000, 10), limit(1, 60_000, 20));
        let n = Arc::new(key("narrow", "acct"));
        let w = Arc::new(key("wide", "acct"));
        let mut tasks = Vec::new();
        for i in 0..120 {
            let (store, n, w) = (store.clone(), Arc::clone(&n), Arc::clone(&w));
            tasks.push(tokio::spawn(async move {
                let admitted = if i % 2 == 0 {
                    let both = [Take::new(&n, narrow, 1), Take::new(&w, wide, 1)];
                    let d = store.acquire_all(&both, ZERO).await.expect("decides");
                    d[0].is_admitted()
                } else {
                    let d = store.acquire(&w, wide, 1, ZERO).await.expect("decides");
                    d.is_admitted()
                };
                (i % 2 == 0, admitted)
            }));
        }
        let (mut both, mut alone) = (0, 0);
        for t in tasks {
            match t.await.expect("the task finishes") {
                (true, true) => both += 1,
                (false, true) => alone += 1,
                _ => {}
            }
        }
        assert_eq!(both + alone, 20, "the wide bucket's burst, exactly");
        let left = store.peek(&n, narrow).await.expect("peeks").remaining();
        assert_eq!(left, 10 - both, "{both} requests on both buckets");
    }
}

async fn memory(clock: ManualClock) -> MemoryStore<ManualClock> {
    MemoryStore::new().with_clock(clock)
}

#[cfg(feature = "redis")]
async fn redis(
    clock: ManualClock,
) -> burstgate::RedisStore<redis::aio::MultiplexedConnection, ManualClock> {
    let client = redis::Client::open(redis_server::url()).expect("a valid Redis URL");
    let conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("a connection to the test Redis");
    burstgate::RedisStore::new(conn)
        .prefix(&redis_server::unique_prefix())
        .expect("a valid prefix")
        .with_clock(clock)
}

/// A store on the cluster of this test binary, through redis-rs's cluster connection, so every
/// key goes to the primary that owns its slot.
#[cfg(feature = "redis")]
async fn cluster(
    clock: ManualClock,
) -> burstgate::RedisStore<redis::cluster_async::ClusterConnection, ManualClock> {
    let conn = redis_cluster::shared().connection().await;
    burstgate::RedisStore::new(conn)
        .prefix(&redis_server::unique_prefix())
        .expect("a valid prefix")
        .with_clock(clock)
}

async fn dyn_memory(clock: ManualClock) -> Arc<dyn DynBucketStore> {
    Arc::new(memory(clock).await)
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
            async fn a_full_bucket_admits_burst_then_one_per_interval() {
                cases::a_full_bucket_admits_burst_then_one_per_interval($make).await;
            }

            #[tokio::test]
            async fn reservations_queue_in_arrival_order() {
                cases::reservations_queue_in_arrival_order($make).await;
            }

            #[tokio::test]
            async fn a_refund_from_the_middle_of_the_queue_double_books_a_slot() {
                cases::a_refund_from_the_middle_of_the_queue_double_books_a_slot($make).await;
            }

            #[tokio::test]
            async fn refunds_return_tokens_up_to_capacity() {
                cases::refunds_return_tokens_up_to_capacity($make).await;
            }

            #[tokio::test]
            async fn a_drain_blocks_every_caller_until_its_deadline() {
                cases::a_drain_blocks_every_caller_until_its_deadline($make).await;
            }

            #[tokio::test]
            async fn a_drain_halts_the_reservations_queued_before_it() {
                cases::a_drain_halts_the_reservations_queued_before_it($make).await;
            }

            #[tokio::test]
            async fn peek_takes_nothing() {
                cases::peek_takes_nothing($make).await;
            }

            #[tokio::test]
            async fn impossible_costs_are_errors_not_waits() {
                cases::impossible_costs_are_errors_not_waits($make).await;
            }

            #[tokio::test]
            async fn keys_and_buckets_are_independent() {
                cases::keys_and_buckets_are_independent($make).await;
            }

            #[tokio::test]
            async fn a_stale_clock_gets_no_credit() {
                cases::a_stale_clock_gets_no_credit($make).await;
            }

            #[tokio::test]
            async fn a_mark_is_booked_then_spent_once() {
                cases::a_mark_is_booked_then_spent_once($make).await;
            }

            #[tokio::test]
            async fn lowering_follows_a_report_down_and_never_up() {
                cases::lowering_follows_a_report_down_and_never_up($make).await;
            }

            #[tokio::test]
            async fn several_buckets_go_all_or_none() {
                cases::several_buckets_go_all_or_none($make).await;
            }

            #[tokio::test]
            async fn several_buckets_refuse_bad_requests_whole() {
                cases::several_buckets_refuse_bad_requests_whole($make).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_requests_on_two_buckets_never_take_one_alone() {
                cases::concurrent_requests_on_two_buckets_never_take_one_alone($make).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn concurrent_callers_get_exactly_the_burst() {
                cases::concurrent_callers_get_exactly_the_burst($make).await;
            }
        }
    };
}

suite!(memory_store, memory);
#[cfg(feature = "redis")]
suite!(redis_store, redis);
#[cfg(feature = "redis")]
suite!(redis_cluster_store, cluster);
suite!(dyn_memory_store, dyn_memory);
#[cfg(feature = "redis")]
suite!(dyn_redis_store, dyn_redis);
