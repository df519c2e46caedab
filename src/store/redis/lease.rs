//! Token leases: a process that decides often on one key takes tokens from the shared bucket
//! in one call and spends them here, with no round trip per decision (`lease.lua`, and the
//! reference arithmetic in `bucket/lease.rs`).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use hashbrown::HashMap;
use redis::aio::ConnectionLike;

use super::RedisStore;
use super::script::Failure;
use super::wire::{LeaseArgs, LeaseOp};
use crate::bucket::Verdict;
use crate::bucket::lease::{Ask, MAX_LEASE_MS, Renewal};
use crate::clock::Clock;
use crate::error::InvalidLeases;
use crate::store::{Decision, Source, StoreError};
use crate::{BucketKey, BucketName, Limit};

/// The default time of a lease.
const DEFAULT_TIME: Duration = Duration::from_secs(1);

/// The shortest lease.
const MIN_TIME: Duration = Duration::from_millis(20);

/// The largest part of a bucket's burst one lease may hold: one in this many tokens.
const SHARE: u64 = 8;

/// Token leases for hot keys: off by default, turned on for a store with
/// [`RedisStore::leases`].
///
/// Every decision on a key normally costs one script call on the Redis node that holds the key,
/// so one key can go no faster than that node and every admission waits a round trip. A store
/// in lease mode instead takes a **lease** of tokens from the shared bucket in one call and
/// spends them in this process, one decision at a time, with no round trip:
///
/// - The lease follows this process's recent rate on the key, about a quarter of the lease's
///   time of its demand, and is at most an eighth of the limit's burst (at least the cost of the
///   request that asks), so that no process holds the burst. It is renewed in the background
///   when half of it is spent, and at half its time; a request waits for a renewal only when the
///   lease has run dry.
/// - **No over-admission.** Tokens on lease count against the bucket's capacity in Redis: the
///   bucket refills up to its burst less what is out on lease, so what every process admits
///   over any window of `w` stays within `burst + rate × w`, exactly as for a plain bucket.
///   A token this process spent counts as out until its next renewal says so: the bucket
///   refills less meanwhile, never more.
/// - **What it costs in fairness.** A token leased to a process is not available to the others
///   until that process spends it, gives it back (at the next renewal after its demand drops,
///   at the latest at half the lease's time of idleness) or its lease ends. A lease not given
///   back (a process killed) ends after its time, and its tokens are lost, not counted twice:
///   at most one lease of tokens per process. A refused request is told when the tokens it
///   needs could be had: when the bucket refills them, or, when the others' leases leave no
///   room for them, when the last of those ends.
/// - This process spends a lease only until three quarters of its time have passed on its
///   own clock: the rest covers the difference between its clock and that of the process that
///   next finds the lease ended. The store's default clock, the time Redis counts, keeps that
///   difference to a few milliseconds.
///
/// What a lease cannot serve is refused with [`StoreError::NotLeasable`], never changed in
/// silence: a reservation (a `max_wait` above zero) and a request on several buckets, one of
/// them leased. Lease only the buckets that need it ([`bucket`](Self::bucket)), and the others
/// keep every feature.
///
/// While tokens of a bucket are out on lease, a store not in lease mode refuses to decide on
/// it with [`StoreError::Leased`], as it refuses refunds, drains and the admin operations
/// `set` and `block_until`; a [`peek`](crate::BucketStore::peek) answers what the bucket holds
/// beside the leases. A `reset` (a `DEL`) forgets the leases with the bucket, so until they
/// end, up to one lease per process more than the burst may go. Refunding a leased admission
/// gives nothing back.
///
/// When a renewal fails (Redis down, the circuit open), the tokens already leased are spent
/// until the lease's time is up, and then the store's [`OutagePolicy`](crate::OutagePolicy)
/// answers, as for any call. Leases work per key on a Redis Cluster, as every call does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leases {
    time: Duration,
    /// The buckets leased; every bucket when empty.
    buckets: Vec<BucketName>,
}

impl Default for Leases {
    fn default() -> Self {
        Self {
            time: DEFAULT_TIME,
            buckets: Vec::new(),
        }
    }
}

impl Leases {
    /// Leases of one second, on every bucket of the store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Leases on `bucket`'s keys only, and on those of every other bucket named this way: a
    /// hot global limit leased, while the store decides on the other buckets (per account,
    /// say, with reservations or several buckets at once) with one call each, as without
    /// leases. By default every bucket is leased.
    #[must_use]
    pub fn bucket(mut self, bucket: BucketName) -> Self {
        if !self.buckets.contains(&bucket) {
            self.buckets.push(bucket);
        }
        self
    }

    /// Whether keys of the bucket `name` are leased.
    fn covers(&self, name: &str) -> bool {
        self.buckets.is_empty() || self.buckets.iter().any(|b| b.as_str() == name)
    }

    /// How long a lease lasts, from the call that grants or renews it: from 20 ms to 60 s. A
    /// longer lease renews less often and keeps tokens of an idle process from the others
    /// longer; this process spends one only during the first three quarters of its time.
    pub fn time(self, time: Duration) -> Result<Self, InvalidLeases> {
        if time < MIN_TIME || time > Duration::from_millis(MAX_LEASE_MS) {
            return Err(InvalidLeases::Time { time });
        }
        Ok(Self { time, ..self })
    }

    /// The time of a lease, in milliseconds.
    fn time_ms(&self) -> u64 {
        self.time.as_millis() as u64
    }
}

/// The leases this process holds, one per key, shared by every clone of the store.
pub(super) struct Table {
    config: Leases,
    slots: Mutex<HashMap<Box<str>, Arc<Slot>>>,
}

impl Table {
    pub(super) fn new(config: Leases) -> Self {
        Self {
            config,
            slots: Mutex::new(HashMap::new()),
        }
    }

    /// A table of no leases, in the same mode.
    pub(super) fn renewed(&self) -> Self {
        Self::new(self.config.clone())
    }

    /// Whether `key` is leased.
    pub(super) fn covers(&self, key: &BucketKey) -> bool {
        self.config.covers(key.bucket())
    }

    fn slot(&self, key: &BucketKey) -> Arc<Slot> {
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = slots.get(key.as_str()) {
            return Arc::clone(slot);
        }
        let slot = Arc::new(Slot {
            held: Mutex::new(Held {
                holder: holder_id(),
                ..Held::default()
            }),
            renewed: tokio::sync::Notify::new(),
        });
        slots.insert(key.as_str().into(), Arc::clone(&slot));
        slot
    }

    /// Forgets `key`'s slot if it is still `slot` and holds nothing.
    fn forget(&self, key: &BucketKey, slot: &Arc<Slot>) {
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        if slots
            .get(key.as_str())
            .is_some_and(|s| Arc::ptr_eq(s, slot))
        {
            let h = slot.lock();
            if h.held == 0 && !h.renewing {
                drop(h);
                slots.remove(key.as_str());
            }
        }
    }
}

/// A random whole number below 2^53, an exact `f64`: this process's id among the holders of a
/// bucket's leases.
fn holder_id() -> f64 {
    let [a, b, c, d, e, f, g, h, ..] = crate::key::random_bytes();
    (u64::from_le_bytes([a, b, c, d, e, f, g, h]) >> 11) as f64
}

/// One key's lease in this process.
struct Slot {
    held: Mutex<Held>,
    renewed: tokio::sync::Notify,
}

impl Slot {
    fn lock(&self) -> MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Default)]
struct Held {
    /// The lease's holder in the stored leases: random, below 2^53 so that it is an exact
    /// `f64`, and one per slot, not per process, so that a slot forgotten while a request still
    /// uses it and the slot made after it are two holders, each with its own record.
    holder: f64,
    /// Tokens this process may spend, until `until`.
    held: u64,
    /// On the store's clock, ms: three quarters of the lease's time after the call that
    /// granted or renewed it was sent.
    until: u64,
    /// When the last renewal was sent, and what has been spent since.
    sent: u64,
    spent: u64,
    /// The size the last renewal asked for.
    size: u64,
    /// A renewal is in flight: at most one at a time, so that what it says it keeps is what
    /// this process holds.
    renewing: bool,
    /// No renewal before this time: the last one found no tokens, and said when they come.
    denied_until: u64,
    /// The task that gives the lease back when demand stops is running.
    watching: bool,
}

/// Ends a renewal, however its call ends: a caller that gave up mid-call must not leave the
/// slot renewing forever.
struct Renewing<'a>(&'a Slot);

impl Drop for Renewing<'_> {
    fn drop(&mut self) {
        self.0.lock().renewing = false;
        self.0.renewed.notify_waiters();
    }
}

impl<C, K> RedisStore<C, K>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
    K: Clock,
{
    /// Turns lease mode on for the keys of this store that `leases` names, every key by
    /// default (see [`Leases`]). Clones share the leases; a store made by
    /// [`prefix`](Self::prefix) or [`with_clock`](Self::with_clock) keeps the setting, with
    /// leases of its own.
    #[must_use]
    pub fn leases(self, leases: Leases) -> Self {
        Self {
            leases: Some(Arc::new(Table::new(leases))),
            ..self
        }
    }

    /// An acquire in lease mode: from this process's lease, renewed when it runs dry.
    pub(super) async fn acquire_leased(
        &self,
        table: &Arc<Table>,
        key: &BucketKey,
        limit: Limit,
        cost: u32,
    ) -> Result<Decision, StoreError> {
        let slot = table.slot(key);
        let cost_u = u64::from(cost);
        let time = table.config.time_ms();
        loop {
            let now = self.clock.now_ms();
            // Decided under the lock, acted on after it: no lock is held across an await.
            let next = {
                let mut h = slot.lock();
                if now >= h.until {
                    // Past the part of the lease this process spends: what is left is lost.
                    h.held = 0;
                }
                if h.held >= cost_u {
                    h.held -= cost_u;
                    h.spent += cost_u;
                    let low = h.held < h.size / 2 || now >= h.sent + time / 2;
                    let renew = (low && !h.renewing).then(|| {
                        h.renewing = true;
                        self.ask(table, &h, limit, 1, now)
                    });
                    let watch = renew.is_some() && !std::mem::replace(&mut h.watching, true);
                    Next::Spent {
                        remaining: h.held,
                        renew,
                        watch,
                    }
                } else if now < h.denied_until {
                    Next::Denied {
                        held: h.held,
                        wait: h.denied_until - now,
                    }
                } else if h.renewing {
                    Next::Wait
                } else {
                    h.renewing = true;
                    let least = cost_u.saturating_sub(h.held);
                    let ask = self.ask(table, &h, limit, least, now);
                    let watch = !std::mem::replace(&mut h.watching, true);
                    Next::Renew { ask, watch }
                }
            };
            match next {
                Next::Spent {
                    remaining,
                    renew,
                    watch,
                } => {
                    if let Some(ask) = renew {
                        self.renew_in_background(table, key, &slot, limit, ask, now);
                    }
                    if watch {
                        self.watch(table, key, &slot, limit);
                    }
                    // Answered without waiting on anything: spend tokio's budget, so that a
                    // loop of such calls still lets other tasks run.
                    tokio::task::coop::consume_budget().await;
                    return Ok(leased(limit, cost, remaining, now, 0, true));
                }
                Next::Denied { held, wait } => {
                    tokio::task::coop::consume_budget().await;
                    return Ok(leased(limit, cost, held, now, wait, false));
                }
                Next::Wait => {
                    // Registered, then checked again, so that a renewal that ended meanwhile is
                    // not waited for.
                    let renewed = slot.renewed.notified();
                    tokio::pin!(renewed);
                    renewed.as_mut().enable();
                    if slot.lock().renewing {
                        renewed.await;
                    }
                }
                Next::Renew { ask, watch } => {
                    if watch {
                        self.watch(table, key, &slot, limit);
                    }
                    match self.renew(table, key, &slot, limit, ask, now).await {
                        Ok(()) => {}
                        Err(Failure::Fatal(e)) => return Err(e),
                        Err(Failure::Outage(e)) => {
                            return self
                                .acquire_in_outage(e, key, limit, cost, Duration::ZERO)
                                .await;
                        }
                    }
                }
            }
        }
    }

    /// What to ask for at `now`: keep what is held, and a lease sized to the recent rate.
    fn ask(&self, table: &Table, h: &Held, limit: Limit, least: u64, now: u64) -> Ask {
        let time = table.config.time_ms();
        let keep = if now < h.until { h.held } else { 0 };
        // A quarter of the lease's time at the rate since the last renewal, or twice what was
        // spent since, whichever is more: a lease that runs dry fast doubles.
        let elapsed = now.saturating_sub(h.sent).max(1);
        let by_rate = h.spent.saturating_mul(time / 4) / elapsed;
        let most = (u64::from(limit.burst()) / SHARE).max(least).max(1);
        let size = by_rate
            .max(h.spent.saturating_mul(2))
            .clamp(least.max(1), most);
        let want = size.saturating_sub(keep).max(least);
        Ask {
            holder: h.holder,
            ret: 0.0,
            keep: keep as f64,
            want: want as f64,
            least: least as f64,
            time: time as f64,
        }
    }

    /// Sends a renewal made at `now` and applies its answer; the slot must be marked renewing.
    async fn renew(
        &self,
        table: &Table,
        key: &BucketKey,
        slot: &Slot,
        limit: Limit,
        ask: Ask,
        now: u64,
    ) -> Result<(), Failure> {
        let _renewing = Renewing(slot);
        {
            let mut h = slot.lock();
            h.size = (ask.keep + ask.want) as u64;
            h.spent = 0;
            h.sent = now;
            // Given back: no longer this process's to spend, whatever the call's fate.
            h.held = h.held.saturating_sub(ask.ret as u64);
        }
        let renewal = self
            .run_lease(
                key,
                now,
                LeaseArgs {
                    op: LeaseOp::Renew,
                    limit,
                    ask,
                },
            )
            .await?;
        apply(
            &mut slot.lock(),
            &ask,
            &renewal,
            now,
            table.config.time_ms(),
        );
        Ok(())
    }

    fn renew_in_background(
        &self,
        table: &Arc<Table>,
        key: &BucketKey,
        slot: &Arc<Slot>,
        limit: Limit,
        ask: Ask,
        now: u64,
    ) {
        let (store, table, key, slot) = (
            self.clone(),
            Arc::clone(table),
            key.clone(),
            Arc::clone(slot),
        );
        tokio::spawn(async move {
            // A failure leaves the lease as it was: spent until its time is up, then renewed
            // by the next request, which meets the outage policy if Redis is still down.
            let _ = store.renew(&table, &key, &slot, limit, ask, now).await;
        });
    }

    /// Gives the lease back once demand stops: wakes at half the lease's time after each
    /// renewal, renews when tokens were spent since, and gives back what is held, and ends,
    /// when none were or nothing is held.
    fn watch(&self, table: &Arc<Table>, key: &BucketKey, slot: &Arc<Slot>, limit: Limit) {
        let (store, table, key, slot) = (
            self.clone(),
            Arc::clone(table),
            key.clone(),
            Arc::clone(slot),
        );
        tokio::spawn(async move {
            let time = table.config.time_ms();
            loop {
                tokio::time::sleep(Duration::from_millis(time / 2)).await;
                let now = store.clock.now_ms();
                let (ask, last) = {
                    let mut h = slot.lock();
                    if h.renewing || now < h.sent + time / 2 {
                        continue;
                    }
                    if now >= h.until {
                        h.held = 0;
                    }
                    h.renewing = true;
                    let mut ask = store.ask(&table, &h, limit, 0, now);
                    // Idle since the last renewal, or past the lease: everything goes back,
                    // and the record with it, so that the bucket is plain again once no other
                    // process leases it. The next request starts a watch of its own.
                    let last = h.spent == 0 || h.held == 0;
                    if last {
                        ask.ret = h.held as f64;
                        ask.keep = 0.0;
                        ask.want = 0.0;
                        h.watching = false;
                    }
                    (ask, last)
                };
                let _ = store.renew(&table, &key, &slot, limit, ask, now).await;
                if last {
                    table.forget(&key, &slot);
                    return;
                }
            }
        });
    }
}

/// What a request does once it let go of its lease's lock.
enum Next {
    /// It spent from the lease, and may start a renewal and the watch.
    Spent {
        remaining: u64,
        renew: Option<Ask>,
        watch: bool,
    },
    /// It is refused until the tokens the last renewal did not find come.
    Denied { held: u64, wait: u64 },
    /// It waits for the renewal in flight.
    Wait,
    /// It renews, and waits for the answer.
    Renew { ask: Ask, watch: bool },
}

/// Applies a renewal sent at `sent` to what this process holds.
fn apply(h: &mut Held, ask: &Ask, r: &Renewal, sent: u64, time: u64) {
    // Spent meanwhile from the tokens it kept; the record kept `r.kept` of them (fewer only
    // when it had ended), and added `r.granted`.
    let lost = (ask.keep - r.kept) as u64;
    h.held = h.held.saturating_sub(lost) + r.granted as u64;
    if r.granted > 0.0 || r.kept > 0.0 {
        h.until = sent + time - time / 4;
    }
    if r.granted == 0.0 && ask.least > 0.0 {
        h.denied_until = sent + r.wait.max(1);
    }
}

/// A decision made from the lease: `remaining` is what this process holds, and the reset the
/// time the limit's rate takes to refill the rest of the burst.
fn leased(limit: Limit, cost: u32, remaining: u64, now: u64, wait: u64, allowed: bool) -> Decision {
    let burst = u64::from(limit.burst());
    let missing = burst.saturating_sub(remaining) as u128;
    let reset = (missing * u128::from(limit.interval_ms())).div_ceil(u128::from(limit.tokens()));
    let outcome = Verdict {
        allowed,
        wait,
        remaining: remaining.min(burst),
        reset: u64::try_from(reset).unwrap_or(u64::MAX),
        at: now,
    };
    Decision::from(outcome, limit, cost, Source::Nothing)
}
