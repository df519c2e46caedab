//! The bound on buckets: what a flood of made-up keys costs, what is forgotten or refused at the
//! bound, and that nothing is below it, on any machine.

use super::*;

#[test]
fn a_flood_of_made_up_keys_grows_memory_without_bound() {
    let (store, _) = bounded(1_000);
    assert_eq!(store.max_buckets(), 1_000, "one shard, holding the bound");
    let limit = five_per_hour();
    for i in 0..50_000 {
        let key = BucketKey::new("flood", format!("made-up-{i}")).expect("a valid key");
        let d = now_or_never(store.acquire(&key, limit, 1, Duration::ZERO));
        assert!(d.is_ok_and(|d| d.is_admitted()), "a new key is admitted");
        if i % 1_000 == 999 {
            assert!(store.len() <= store.max_buckets(), "{} held", store.len());
        }
    }
    assert!(store.len() <= store.max_buckets(), "{} held", store.len());
    assert!(
        store.len() >= store.max_buckets() / 2,
        "{} held",
        store.len()
    );
}

/// Keys that land in the same shard as `of`, other than it.
fn same_shard(store: &MemoryStore<ManualClock>, of: &BucketKey, n: usize) -> Vec<BucketKey> {
    let shard = |k: &BucketKey| {
        let hash = key_hash(k.as_str().as_bytes());
        store.inner.shard_of(hash)
    };
    (0..)
        .map(|i| BucketKey::new("flood", format!("k{i}")).expect("a valid key"))
        .filter(|k| k != of && shard(k) == shard(of))
        .take(n)
        .collect()
}

#[test]
fn eviction_forgets_the_buckets_closest_to_full_and_never_one_in_debt() {
    // One shard of 16 buckets.
    let (store, clock) = bounded(16);
    let limit = five_per_hour();
    let victim = BucketKey::new("login", "victim").expect("a valid key");
    let keys = same_shard(&store, &victim, 40);
    // The victim spends the whole burst, then books a sixth token 12 minutes out: in debt.
    for _ in 0..5 {
        let d = now_or_never(store.acquire(&victim, limit, 1, Duration::ZERO));
        assert!(d.is_ok_and(|d| d.is_admitted()));
    }
    let booked = now_or_never(store.acquire(&victim, limit, 1, Duration::from_secs(3_600)));
    assert!(booked.is_ok_and(|d| d.is_admitted() && d.wait() > Duration::ZERO));
    // A heavy key spends four tokens; light keys spend one each, a minute later, so that the
    // heavy key is far from full and the light ones close to it.
    let heavy = &keys[0];
    for _ in 0..4 {
        let d = now_or_never(store.acquire(heavy, limit, 1, Duration::ZERO));
        assert!(d.is_ok_and(|d| d.is_admitted()));
    }
    clock.advance(Duration::from_secs(60));
    for key in &keys[1..] {
        let d = now_or_never(store.acquire(key, limit, 1, Duration::ZERO));
        assert!(d.is_ok_and(|d| d.is_admitted()));
        assert!(store.len() <= store.max_buckets());
    }
    // The victim's debt and the heavy key's spending are remembered through every eviction.
    let victim_now = now_or_never(store.peek(&victim, limit)).expect("peeks");
    assert_eq!(victim_now.remaining(), 0);
    assert!(victim_now.next_token_in() > Duration::from_secs(600));
    let heavy_now = now_or_never(store.peek(heavy, limit)).expect("peeks");
    assert_eq!(heavy_now.remaining(), 1, "the heavy key was kept");
    // Forgotten light keys start full: they gained back the one token they had spent.
    let forgotten = keys[1..]
        .iter()
        .filter(|k| now_or_never(store.peek(k, limit)).is_ok_and(|q| q.remaining() == 5))
        .count();
    // The shard keeps the victim, the heavy key and at most 14 light ones.
    assert!(forgotten >= 25, "{forgotten} of 39 light keys forgotten");
}

#[test]
fn a_shard_full_of_debt_refuses_a_new_key_and_forgets_nothing() {
    let (store, _) = bounded(16);
    let limit = five_per_hour();
    let first = BucketKey::new("debt", "first").expect("a valid key");
    let others = same_shard(&store, &first, 17);
    let (filling, others) = others.split_at(15);
    // One shard of 16 buckets: the first key and 15 others, each in debt, fill it.
    let reserve = |key: &BucketKey| {
        assert!(
            now_or_never(store.acquire(key, limit, 5, Duration::ZERO))
                .expect("decides")
                .is_admitted()
        );
        now_or_never(store.acquire(key, limit, 1, Duration::from_secs(3_600)))
    };
    for key in std::iter::once(&first).chain(filling) {
        assert!(reserve(key).is_ok_and(|d| d.is_admitted()));
    }
    let refused = now_or_never(store.acquire(&others[0], limit, 1, Duration::ZERO));
    assert!(
        matches!(refused, Err(StoreError::TooManyBuckets { max: 16 })),
        "{refused:?}"
    );
    let drained = now_or_never(store.drain_until(&others[1], limit, SystemTime::now()));
    assert!(matches!(drained, Err(StoreError::TooManyBuckets { .. })));
    // A request on the bucket in debt and a new key is refused whole: the first bucket keeps
    // its queue, untouched.
    let both = [Take::new(&first, limit, 1), Take::new(&others[0], limit, 1)];
    let refused = now_or_never(store.acquire_all(&both, Duration::from_secs(7_200)));
    assert!(
        matches!(refused, Err(StoreError::TooManyBuckets { max: 16 })),
        "{refused:?}"
    );
    // Refused again without rebuilding the shard for each new key: its table stays the one
    // the first refusal made.
    let index = store.inner.shard_of(key_hash(first.as_str().as_bytes()));
    let table = |store: &MemoryStore<ManualClock>| {
        Arc::as_ptr(&lock(&store.inner.shards[index].0).table.buckets) as *const Slot
    };
    let before = table(&store);
    for _ in 0..10 {
        let refused = now_or_never(store.acquire(&others[0], limit, 1, Duration::ZERO));
        assert!(matches!(refused, Err(StoreError::TooManyBuckets { .. })));
    }
    assert_eq!(table(&store), before, "no rebuild per refused key");
    let kept = now_or_never(store.peek(&first, limit)).expect("peeks");
    assert_eq!(kept.remaining(), 0, "the bucket in debt is kept");
    assert!(kept.next_token_in() > Duration::from_secs(600));
}

/// A reset forgets a bucket wherever the store holds it: in a shard's table (decided on without
/// the shard's lock) or among its new keys. The next call finds it full with no halt, the
/// shard's next rebuild drops it, and a reset of a key the store does not hold makes no bucket.
#[test]
fn a_reset_forgets_a_bucket_in_the_table_and_among_the_new_keys() {
    let clock = ManualClock::new(START);
    let store = MemoryStore::new().with_clock(clock.clone());
    let limit = Limit::per_hour(1)
        .and_then(|l| l.with_burst(3))
        .expect("a valid limit");
    let (old, new) = (
        BucketKey::new("reset", "in-table").expect("a valid key"),
        BucketKey::new("reset", "new").expect("a valid key"),
    );
    let spend = |key: &BucketKey| {
        for _ in 0..3 {
            let d = now_or_never(store.acquire(key, limit, 1, Duration::ZERO)).expect("decides");
            assert!(d.is_admitted());
        }
        let until = UNIX_EPOCH + Duration::from_millis(START + 60_000);
        now_or_never(store.drain_until(key, limit, until)).expect("drains");
    };
    spend(&old);
    // A sweep moves the bucket into its shard's table; the next key is new to its shard.
    store.sweep();
    spend(&new);
    assert_eq!(store.len(), 2);
    for key in [&old, &new] {
        let before = now_or_never(store.peek(key, limit)).expect("peeks");
        assert!(before.remaining() == 0 && before.halted_until().is_some());
        now_or_never(store.reset(key)).expect("resets");
        let after = now_or_never(store.peek(key, limit)).expect("peeks");
        assert_eq!((after.remaining(), after.resets_in()), (3, Duration::ZERO));
        assert_eq!(after.halted_until(), None);
    }
    // The key among the new ones is gone at once; the one in the table keeps its slot until
    // the next rebuild, and spends its burst again through it.
    assert_eq!(store.len(), 1);
    for _ in 0..3 {
        let d = now_or_never(store.acquire(&old, limit, 1, Duration::ZERO)).expect("decides");
        assert!(d.is_admitted());
    }
    let d = now_or_never(store.acquire(&old, limit, 1, Duration::ZERO)).expect("decides");
    assert_eq!(d.retry_after(), Some(Duration::from_secs(3_600)));
    store.sweep();
    assert_eq!(store.len(), 1, "a spent bucket is kept");
    now_or_never(store.reset(&old)).expect("resets");
    store.sweep();
    assert!(store.is_empty());
    let unknown = BucketKey::new("reset", "never-seen").expect("a valid key");
    now_or_never(store.reset(&unknown)).expect("resets");
    assert!(store.is_empty());
}

/// Spends one token of `key` now and books a turn an hour out, leaving the bucket in debt;
/// or, with `debt` false, spends one token of five.
fn spend(store: &MemoryStore<ManualClock>, key: &BucketKey, debt: bool) -> Result<(), String> {
    let limit = five_per_hour();
    let mut calls = vec![(1, Duration::ZERO)];
    if debt {
        calls = vec![(5, Duration::ZERO), (1, Duration::from_secs(7_200))];
    }
    for (cost, max_wait) in calls {
        match now_or_never(store.acquire(key, limit, cost, max_wait)) {
            Ok(d) if d.is_admitted() => {}
            other => return Err(format!("{key:?}: {other:?}")),
        }
    }
    Ok(())
}

/// A small bound was shared out over 16 shards (8 per thread) or more, of a few buckets each:
/// on a store far below its bound, a request on two new buckets was refused with
/// `TooManyBuckets` whenever its keys met in one full shard, and again on every retry. Below
/// its bound, a store refuses no request, even with every bucket in debt (a turn booked an
/// hour out), which nothing may forget to make room.
#[test]
fn a_small_bound_refused_two_bucket_requests_far_below_it() {
    for bound in [16, 64, 200] {
        for trial in 0..20 {
            let (store, _) = bounded(bound);
            let limit = five_per_hour();
            for i in 0..bound / 2 {
                let key = |side| BucketKey::new("pair", format!("{side}{i}")).expect("a key");
                let (a, b) = (key("a"), key("b"));
                let both = [Take::new(&a, limit, 5), Take::new(&b, limit, 5)];
                let now = now_or_never(store.acquire_all(&both, Duration::ZERO));
                let at = format!("bound {bound}, store {trial}, request {i}");
                assert!(
                    now.as_ref()
                        .is_ok_and(|d| d.iter().all(Decision::is_admitted)),
                    "{at}: {now:?}"
                );
                let both = [Take::new(&a, limit, 1), Take::new(&b, limit, 1)];
                let booked = now_or_never(store.acquire_all(&both, Duration::from_secs(7_200)));
                assert!(
                    booked
                        .as_ref()
                        .is_ok_and(|d| d.iter().all(|d| d.is_admitted() && !d.wait().is_zero())),
                    "{at}: {booked:?}"
                );
            }
            assert_eq!(store.len(), bound, "bound {bound}, store {trial}");
        }
    }
}

/// At three quarters of a bound of 64, shared out over 16 shards of 4 buckets, the keys of a
/// crowded shard forgot their buckets, and their users got a second request through within
/// the minute. Below its bound, a store forgets no bucket.
#[test]
fn a_small_bound_forgot_buckets_at_three_quarters_of_it() {
    let limit = five_per_hour();
    for trial in 0..20 {
        let (store, _) = bounded(64);
        let keys: Vec<BucketKey> = (0..48)
            .map(|i| BucketKey::new("user", format!("u{i}")).expect("a valid key"))
            .collect();
        for key in &keys {
            spend(&store, key, false).expect("admitted");
        }
        for (i, key) in keys.iter().enumerate() {
            let left = now_or_never(store.peek(key, limit)).expect("peeks");
            assert_eq!(left.remaining(), 4, "store {trial}: user {i} was forgotten");
        }
        assert_eq!(store.len(), 48, "store {trial}");
    }
}

/// `bounded(NonZeroUsize::MAX)` multiplied each shard's most buckets by the shard count and
/// overflowed (a panic in a debug build). The product saturates, and the store decides.
#[test]
fn the_largest_bound_overflowed_max_buckets() {
    let store = MemoryStore::bounded(NonZeroUsize::MAX).with_clock(ManualClock::new(START));
    assert_eq!(store.max_buckets(), usize::MAX);
    let key = BucketKey::new("huge", "bound").expect("a valid key");
    spend(&store, &key, false).expect("admitted");
    assert_eq!(store.len(), 1);
}

/// On the layouts of machines of 1, 2, 64 and 512 threads, a store filled to exactly its bound,
/// half of it in debt, refuses no key and forgets no bucket: one shard for the small bounds,
/// several from 2,048, where the headroom of each shard covers keys that spread unevenly.
#[test]
fn every_machine_holds_its_bound_to_the_last_bucket() {
    let limit = five_per_hour();
    for threads in [1, 2, 64, 512] {
        for bound in [1, 16, 64, 1_000, 2_048, 20_000] {
            let layout = Layout::of(bound, threads);
            let store = MemoryStore::laid_out(layout, ManualClock::new(START));
            let keys: Vec<BucketKey> = (0..bound)
                .map(|i| BucketKey::new("fill", format!("k{i}")).expect("a valid key"))
                .collect();
            let at = format!("bound {bound}, {threads} threads, {layout:?}");
            for (i, key) in keys.iter().enumerate() {
                spend(&store, key, i % 2 == 0).unwrap_or_else(|e| panic!("{at}: {e}"));
            }
            assert_eq!(store.len(), bound, "{at}");
            for (i, key) in keys.iter().enumerate() {
                let left = now_or_never(store.peek(key, limit)).expect("peeks");
                let spent = if i % 2 == 0 { 0 } else { 4 };
                assert_eq!(left.remaining(), spent, "{at}: key {i} was forgotten");
            }
        }
    }
}
