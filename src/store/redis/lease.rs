//! Token leases: a process that decides often on one key takes tokens from the shared bucket
//! in one call and spends them here, with no round trip per decision (`lease.lua`, and the
//! reference arithmetic in `bucket/lease.rs`).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use hashbrown::HashMap;
use redis::aio::ConnectionLike;

use super::RedisStore;
use super::script::Failure;
use super::wire::{LeaseArgs, LeaseOp};
use crate::bucket::lease::{Ask, MAX_LEASE_MS};
use crate::bucket::{MAX_TIME, Verdict};
use crate::clock::Clock;
use crate::error::InvalidLeases;
use crate::store::{Decision, Source, StoreError};
use crate::{BucketKey, BucketName, Limit};

/// The default time of a lease.
const DEFAULT_TIME: Duration = Duration::from_secs(1);

/// The shortest lease: its last quarter, which covers the difference between the clocks of
/// two processes, 25 ms.
const MIN_TIME: Duration = Duration::from_millis(100);

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
///   time of its demand, and is at most an eighth of the limit's burst, or the cost of the
///   request that asks if that is more, so that a few processes never hold the whole burst. It
///   is renewed in the background when half of it is spent, and at half its time; a request
///   waits for a renewal only when the lease holds fewer tokens than it costs.
/// - **No over-admission.** Tokens on lease count against the bucket's capacity in Redis: the
///   bucket refills up to its burst less what is out on lease, so what every process admits
///   over any window of `w` stays within `burst + rate × w`, as for a plain bucket. A token
///   this process spent counts as out until its next renewal says so: the bucket refills less
///   meanwhile, never more.
/// - **The clocks.** This process spends a lease only during the first three quarters of its
///   time, on the store's clock; the bound holds while the clocks of the processes that share
///   the bucket differ by less than the last quarter (250 ms for the default lease of one
///   second). The store's default clock, the time Redis counts, measured by each process,
///   keeps them a few milliseconds apart; with `with_clock(SystemClock)`, the hosts' own clocks
///   must stay that close.
/// - **What it costs in fairness.** A token leased to a process is not available to the others
///   until that process spends it, gives it back, or its lease ends. A process gives back what
///   it holds once a half of the lease's time passes with no request, so an idle process (or a
///   dropped store) holds its lease for at most one and a half times the lease's time after its
///   last request. A lease not given back (a process killed) ends after its time, and its
///   tokens are lost, not counted twice: at most one lease per process. A refused request is
///   told when the tokens it needs could be had: when the bucket refills them, or, when the
///   others' leases leave no room for them, when the last of those ends.
/// - A bucket keeps at most 64 leases; a 65th process gets none until one of them ends, and is
///   told when that is. A store leases at most 1,024 keys at once: past that (a flood of
///   made-up keys), a key is decided by one plain call, which a key leased elsewhere refuses
///   with [`StoreError::Leased`].
///
/// What a lease cannot serve is refused with [`StoreError::NotLeasable`], never changed in
/// silence: a reservation (a `max_wait` above zero) and a request on several buckets, one of
/// them leased. Lease only the buckets that need it ([`bucket`](Self::bucket)), and the others
/// keep every feature.
///
/// While tokens of a bucket are out on lease, a store not in lease mode refuses to decide on
/// it with [`StoreError::Leased`], as it refuses refunds, drains and the admin operations
/// `set` and `block_until`; a [`peek`](crate::BucketStore::peek) answers what the bucket holds
/// beside the leases. A `reset` (a `DEL`) forgets the leases with the bucket, as does a Redis
/// that loses the key (an eviction, a failover to a replica that had not received the last
/// renewals): until the leases end, up to one lease per process more than the burst may go.
/// A refund of an admission from a lease gives its tokens back to the lease while it lasts.
///
/// When a renewal fails (Redis down, the circuit open, or an answer that comes after the
/// lease's spending time), the tokens already leased are spent until their time is up, and
/// then the store's [`OutagePolicy`](crate::OutagePolicy) answers, as for any call. Leases work
/// per key on a Redis Cluster, as every call does.
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

    /// How long a lease lasts, from the call that grants or renews it: from 100 ms to 60 s. A
    /// longer lease renews less often, and keeps tokens of an idle process from the others
    /// longer. This process spends one only during the first three quarters of its time, and
    /// a renewal answered later than that is taken as an outage: keep the lease's time well
    /// above the store's [`timeout`](RedisStore::timeout).
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

/// The most keys a store leases at once: a flood of made-up keys on a leased bucket is decided
/// by plain calls once this many are leased.
const MAX_SLOTS: usize = 1024;

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

    /// `key`'s lease, made if there is room for one.
    pub(super) fn slot(&self, key: &BucketKey) -> Option<Arc<Slot>> {
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = slots.get(key.as_str()) {
            return Some(Arc::clone(slot));
        }
        if slots.len() >= MAX_SLOTS {
            return None;
        }
        let slot = Arc::new(Slot {
            held: Mutex::new(Held {
                holder: holder_id(),
                ..Held::default()
            }),
            renewed: tokio::sync::Notify::new(),
        });
        slots.insert(key.as_str().into(), Arc::clone(&slot));
        Some(slot)
    }

    /// `key`'s lease, if it has one.
    fn find(&self, key: &BucketKey) -> Option<Arc<Slot>> {
        let slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        slots.get(key.as_str()).map(Arc::clone)
    }

    /// Forgets `key`'s slot if it is still `slot` and holds nothing.
    fn forget(&self, key: &BucketKey, slot: &Arc<Slot>) {
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        if slots
            .get(key.as_str())
            .is_some_and(|s| Arc::ptr_eq(s, slot))
        {
            let h = slot.lock();
            // Tokens of a retired holder are given up with the slot: the safe direction.
            if h.held == 0 && !h.renewing && !h.watching {
                drop(h);
                slots.remove(key.as_str());
            }
        }
    }
}

/// A random whole number below 2^53, an exact `f64`: a holder's id among a bucket's leases.
fn holder_id() -> f64 {
    let [a, b, c, d, e, f, g, h, ..] = crate::key::random_bytes();
    (u64::from_le_bytes([a, b, c, d, e, f, g, h]) >> 11) as f64
}

/// One key's lease in this process.
pub(super) struct Slot {
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
    /// `f64`. A new one after a renewal whose outcome is unknown (see `older`), and one per
    /// slot, so that a slot forgotten while a request still uses it and the slot made after it
    /// are two holders.
    holder: f64,
    /// Tokens of the holder's record this process may spend, until `until`: on the store's
    /// clock, three quarters of the lease's time after the call that granted or renewed it was
    /// sent.
    held: u64,
    until: u64,
    /// Tokens of an earlier holder of this slot, spent first, until `older_until`. A renewal
    /// that timed out or was dropped may still run, later than the next one: under the same
    /// holder, it would set the record to what was held when it was sent, below what the next
    /// one granted. So the slot takes a new holder id, and what it held stays spendable under
    /// the old one, whose record covers it whatever that call did.
    older: u64,
    older_until: u64,
    /// When the last renewal was sent, and what has been spent since from `held`.
    sent: u64,
    spent: u64,
    /// What the last renewal left the record holding: the lease's size.
    size: u64,
    /// No renewal before this time: the last one found the bucket short of what it wanted,
    /// and one sooner would find only the little that refilled since. Renewals that each take
    /// a token or two would cost a call per admission under a limit that binds.
    quiet_until: u64,
    /// A renewal is in flight: at most one at a time, so that what it says it keeps is what
    /// this process holds.
    renewing: bool,
    /// No renewal before `denied_until` for `denied_for` tokens or more: the last one found
    /// fewer, and said when they come.
    denied_until: u64,
    denied_for: u64,
    /// The task that gives the lease back when demand stops is running.
    watching: bool,
}

impl Held {
    /// Drops what is past its time at `now`.
    fn expire(&mut self, now: u64) {
        if now >= self.older_until {
            self.older = 0;
        }
        if now >= self.until {
            self.held = 0;
        }
    }

    /// Spends `cost` tokens if this process holds them: the older holder's first.
    fn spend(&mut self, cost: u64) -> bool {
        if self.older + self.held < cost {
            return false;
        }
        let from_older = self.older.min(cost);
        self.older -= from_older;
        self.held -= cost - from_older;
        self.spent += cost - from_older;
        true
    }

    /// Takes back `cost` tokens spent since the last renewal was sent, under this holder, while
    /// the lease lasts: its record still counts them. Whether they went back.
    fn give_back(&mut self, cost: u64, now: u64) -> bool {
        self.expire(now);
        if self.until > now && self.spent >= cost {
            self.held += cost;
            self.spent -= cost;
            return true;
        }
        false
    }

    /// After a renewal whose outcome is unknown: a new holder, and what the old one held kept
    /// until the earlier of the two deadlines.
    fn fence(&mut self) {
        if self.held > 0 {
            self.older_until = if self.older > 0 {
                self.older_until.min(self.until)
            } else {
                self.until
            };
            self.older += self.held;
        }
        self.held = 0;
        self.until = 0;
        // What was spent is the old holder's: nothing of it goes back to the new one.
        self.spent = 0;
        self.holder = holder_id();
    }
}

/// A renewal in flight, made before it is sent (before a task that sends it is spawned, too):
/// however the call ends, even dropped before it starts, the slot stops renewing, and unless
/// the answer was applied, the slot takes a new holder.
struct Renewing {
    slot: Arc<Slot>,
    applied: bool,
}

impl Drop for Renewing {
    fn drop(&mut self) {
        let mut h = self.slot.lock();
        if !self.applied {
            h.fence();
        }
        h.renewing = false;
        drop(h);
        self.slot.renewed.notify_waiters();
    }
}

/// The watch of a slot: unless it ended by giving the lease back (which clears the slot's
/// `watching` itself, in the same step), the slot stops counting it as running when it goes.
struct Watching {
    slot: Arc<Slot>,
    armed: bool,
}

impl Drop for Watching {
    fn drop(&mut self) {
        if self.armed {
            self.slot.lock().watching = false;
        }
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
        slot: Arc<Slot>,
        key: &BucketKey,
        limit: Limit,
        cost: u32,
    ) -> Result<Decision, StoreError> {
        let cost_u = u64::from(cost);
        let time = table.config.time_ms();
        loop {
            // Decided under the lock, acted on after it: no lock is held across an await. The
            // clock is read under it, so that no request spends on a time read before another
            // found the lease over.
            let next = {
                let mut h = slot.lock();
                let now = self.now_ms();
                h.expire(now);
                if h.spend(cost_u) {
                    let low =
                        (h.held < h.size / 2 || now >= h.sent + time / 2) && now >= h.quiet_until;
                    let renew = (low && !h.renewing).then(|| {
                        h.renewing = true;
                        self.ask(table, &mut h, limit, 0, now)
                    });
                    let watch = renew.is_some() && !std::mem::replace(&mut h.watching, true);
                    Next::Spent {
                        remaining: h.held + h.older,
                        now,
                        renew,
                        watch,
                    }
                } else if now < h.denied_until
                    && cost_u.saturating_sub(h.held + h.older) >= h.denied_for
                {
                    Next::Denied {
                        held: h.held + h.older,
                        now,
                        wait: h.denied_until - now,
                    }
                } else if now < h.quiet_until && !h.renewing {
                    // The bucket was short a moment ago: what refills meanwhile waits there
                    // for the next renewal, lost to nobody.
                    Next::Denied {
                        held: h.held + h.older,
                        now,
                        wait: h.quiet_until - now,
                    }
                } else if h.renewing {
                    Next::Wait
                } else {
                    h.renewing = true;
                    let least = cost_u.saturating_sub(h.held + h.older);
                    let ask = self.ask(table, &mut h, limit, least, now);
                    let watch = !std::mem::replace(&mut h.watching, true);
                    Next::Renew { ask, now, watch }
                }
            };
            match next {
                Next::Spent {
                    remaining,
                    now,
                    renew,
                    watch,
                } => {
                    if let Some(ask) = renew {
                        let renewing = Renewing {
                            slot: Arc::clone(&slot),
                            applied: false,
                        };
                        self.renew_in_background(table, key, renewing, limit, ask, now);
                    }
                    if watch {
                        self.watch(table, key, &slot, limit);
                    }
                    // Answered without waiting on anything: spend tokio's budget, so that a
                    // loop of such calls still lets other tasks run.
                    tokio::task::coop::consume_budget().await;
                    return Ok(leased(limit, cost, remaining, now, 0, true));
                }
                Next::Denied { held, now, wait } => {
                    tokio::task::coop::consume_budget().await;
                    return Ok(leased(limit, cost, held, now, wait, false));
                }
                Next::Wait => {
                    // Registered, then checked again, so that a renewal that ended meanwhile is
                    // not waited for; and waited for no longer than a call may take.
                    let renewed = slot.renewed.notified();
                    tokio::pin!(renewed);
                    renewed.as_mut().enable();
                    if slot.lock().renewing {
                        let _ = tokio::time::timeout(self.timeout, renewed).await;
                    }
                }
                Next::Renew { ask, now, watch } => {
                    let renewing = Renewing {
                        slot: Arc::clone(&slot),
                        applied: false,
                    };
                    if watch {
                        self.watch(table, key, &slot, limit);
                    }
                    match self.renew(table, key, renewing, limit, ask, now).await {
                        Ok(true) => {}
                        // Granted, but answered after the lease's spending time: Redis is too
                        // slow for the lease, which asking again would only drain.
                        Ok(false) => {
                            let e = StoreError::Timeout {
                                after: Duration::from_millis(time - time / 4),
                            };
                            return self
                                .acquire_in_outage(e, key, limit, cost, Duration::ZERO)
                                .await;
                        }
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

    /// The store's clock, at most the latest time the arithmetic takes, so that no sum of a
    /// time and a lease's time overflows.
    fn now_ms(&self) -> u64 {
        self.clock.now_ms().min(MAX_TIME)
    }

    /// What to ask for at `now`: keep what is held, and a lease sized to the recent rate, at
    /// most an eighth of the burst or `least`, whichever is more. The renewal counts as sent
    /// from here: what was spent before it is what it reports, in the same step, so that no
    /// refund gives one of those tokens back.
    fn ask(&self, table: &Table, h: &mut Held, limit: Limit, least: u64, now: u64) -> Ask {
        let time = table.config.time_ms();
        let keep = h.held;
        // A quarter of the lease's time at the rate since the last renewal, or twice what was
        // spent since, whichever is more: a lease that runs dry fast doubles.
        let elapsed = now.saturating_sub(h.sent).max(1);
        let by_rate = h.spent.saturating_mul(time / 4) / elapsed;
        let most = (u64::from(limit.burst()) / SHARE).max(least).max(1);
        let size = by_rate
            .max(h.spent.saturating_mul(2))
            .clamp(least.max(1), most);
        let want = size.saturating_sub(keep).max(least);
        h.spent = 0;
        h.sent = now;
        Ask {
            holder: h.holder,
            ret: 0.0,
            keep: keep as f64,
            want: want as f64,
            least: if least > 0 {
                least as f64
            } else {
                want.min(1) as f64
            },
            time: time as f64,
        }
    }

    /// Sends a renewal made at `now` and applies its answer: whether the tokens it leaves this
    /// process holding can still be spent.
    async fn renew(
        &self,
        table: &Table,
        key: &BucketKey,
        mut renewing: Renewing,
        limit: Limit,
        mut ask: Ask,
        now: u64,
    ) -> Result<bool, Failure> {
        // Under `OutagePolicy::Local`, what this process admitted locally during an outage is
        // charged first: everything the bucket holds is taken, and counted spent. Not by a
        // lease given back, whose record ends with it: the charge waits for the next lease.
        let charge = self.local_limit(limit).is_some()
            && ask.keep + ask.want > 0.0
            && self
                .touched
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(key.as_str());
        if charge {
            ask.want = f64::from(limit.burst());
            ask.least = 0.0;
        }
        let answer = self
            .run_lease(
                key,
                now,
                LeaseArgs {
                    op: LeaseOp::Renew,
                    limit,
                    ask,
                },
            )
            .await;
        let renewal = match answer {
            Ok(renewal) => renewal,
            Err(e) => {
                if charge {
                    self.touched
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .insert(key.as_str().into());
                }
                // Redis answered with an error: the call did not run, and the holder stands.
                if matches!(e, Failure::Fatal(_)) {
                    renewing.applied = true;
                }
                return Err(e);
            }
        };
        if let Some(local) = self.local_limit(limit) {
            // Redis decides: the next outage starts from an empty local bucket, as after a
            // plain call.
            self.last_answer.fetch_max(now, Ordering::Relaxed);
            self.local.drain_held(key, local, now);
        }
        let time = table.config.time_ms();
        let mut h = renewing.slot.lock();
        // Spent meanwhile from the tokens it kept; the record kept `kept` of them (fewer only
        // when it had ended), and added `granted`, which a charge counts spent.
        let lost = (ask.keep - renewal.kept) as u64;
        let granted = if charge { 0 } else { renewal.granted as u64 };
        let rest = h.held.saturating_sub(lost);
        // Of what was spent since the call was sent, only what the record kept still counts
        // there, and only that may be given back by a refund.
        h.spent = h.spent.min((renewal.kept as u64).saturating_sub(rest));
        h.held = rest + granted;
        if charge && renewal.granted == 0.0 && renewal.remaining > 0 {
            // Kept out by the most leases: charged by the next renewal instead.
            self.touched
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(key.as_str().into());
        }
        h.size = (renewal.kept + renewal.granted) as u64;
        if renewal.kept > 0.0 || renewal.granted > 0.0 {
            h.until = now + time - time / 4;
        }
        // Short of what it wanted: the next renewal waits for half of that to refill, at the
        // limit's rate, or an eighth of the lease's time, whichever is sooner.
        h.quiet_until = if renewal.granted < ask.want {
            let half = (ask.want / 2.0).max(1.0);
            let ms = (half * limit.interval_ms() as f64 / f64::from(limit.tokens())).ceil() as u64;
            now + ms.min(time / 8)
        } else {
            0
        };
        if renewal.granted == 0.0 && ask.least > 0.0 {
            h.denied_until = now + renewal.wait.max(1);
            h.denied_for = ask.least as u64;
        } else {
            h.denied_until = 0;
        }
        let alive = h.held == 0 || self.now_ms() < h.until;
        renewing.applied = true;
        drop(h);
        Ok(alive)
    }

    fn renew_in_background(
        &self,
        table: &Arc<Table>,
        key: &BucketKey,
        renewing: Renewing,
        limit: Limit,
        ask: Ask,
        now: u64,
    ) {
        let (store, table, key) = (self.clone(), Arc::clone(table), key.clone());
        tokio::spawn(async move {
            // A failure leaves what is held spendable until its time is up, under a new holder
            // for the next renewal; the next request that finds nothing meets the outage policy
            // if Redis is still down.
            let _ = store.renew(&table, &key, renewing, limit, ask, now).await;
        });
    }

    /// Gives the lease back once demand stops: wakes every half of the lease's time, renews
    /// when tokens were spent since the last renewal, and otherwise gives back what is held
    /// and ends. A process that stops deciding holds its lease for at most one and a half of
    /// the lease's time after its last request.
    fn watch(&self, table: &Arc<Table>, key: &BucketKey, slot: &Arc<Slot>, limit: Limit) {
        let (store, table, key, slot) = (
            self.clone(),
            Arc::clone(table),
            key.clone(),
            Arc::clone(slot),
        );
        tokio::spawn(async move {
            // A watch dropped with its runtime leaves the slot free to start another.
            let mut watching = Watching {
                slot: Arc::clone(&slot),
                armed: true,
            };
            let time = table.config.time_ms();
            loop {
                tokio::time::sleep(Duration::from_millis(time / 2)).await;
                let (renewing, ask, now, last) = {
                    let mut h = slot.lock();
                    let now = store.now_ms();
                    if h.renewing || now < h.sent + time / 2 {
                        continue;
                    }
                    h.expire(now);
                    h.renewing = true;
                    // Idle since the last renewal, or nothing held: everything goes back, and
                    // the record with it, so that the bucket is plain again once no other
                    // process leases it. Taken from this process in the same step, so that no
                    // request spends a token given back. The next request starts a watch of
                    // its own.
                    let last = h.spent == 0 || h.held == 0;
                    let mut ask = store.ask(&table, &mut h, limit, 0, now);
                    if last {
                        ask.ret = h.held as f64;
                        ask.keep = 0.0;
                        ask.want = 0.0;
                        ask.least = 0.0;
                        h.held = 0;
                        h.watching = false;
                        watching.armed = false;
                    }
                    let renewing = Renewing {
                        slot: Arc::clone(&slot),
                        applied: false,
                    };
                    (renewing, ask, now, last)
                };
                let _ = store.renew(&table, &key, renewing, limit, ask, now).await;
                if last {
                    table.forget(&key, &slot);
                    return;
                }
            }
        });
    }

    /// Gives the tokens of an admission from a lease back to the lease, while its record still
    /// counts them: they were spent since the last renewal was sent (which reports everything
    /// spent before it), under the same holder, and the lease is not over. Otherwise they stay
    /// spent, the safe direction.
    pub(super) fn refund_leased(&self, key: &BucketKey, cost: u32) {
        let Some(slot) = self.leases.as_ref().and_then(|t| t.find(key)) else {
            return;
        };
        let mut h = slot.lock();
        let now = self.now_ms();
        h.give_back(u64::from(cost), now);
    }
}

/// What a request does once it let go of its lease's lock.
enum Next {
    /// It spent from the lease, and may start a renewal and the watch.
    Spent {
        remaining: u64,
        now: u64,
        renew: Option<Ask>,
        watch: bool,
    },
    /// It is refused until the tokens the last renewal did not find come.
    Denied { held: u64, now: u64, wait: u64 },
    /// It waits for the renewal in flight.
    Wait,
    /// It renews, and waits for the answer.
    Renew { ask: Ask, now: u64, watch: bool },
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
    Decision::from(outcome, limit, cost, Source::Lease)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_spends_the_older_holders_tokens_first_and_never_past_their_time() {
        let mut h = Held {
            holder: 1.0,
            held: 5,
            until: 100,
            ..Held::default()
        };
        h.fence();
        assert_eq!((h.held, h.older, h.older_until), (0, 5, 100));
        assert_ne!(
            h.holder, 1.0,
            "a new holder after a renewal of unknown outcome"
        );
        h.held = 3;
        h.until = 200;
        assert!(h.spend(6));
        assert_eq!((h.older, h.held, h.spent), (0, 2, 1), "the older first");
        // Fenced again: the two older holders' tokens go by the earlier deadline.
        h.older = 4;
        h.older_until = 150;
        h.fence();
        assert_eq!((h.older, h.older_until), (6, 150));
        h.expire(150);
        assert!(!h.spend(1), "nothing past its time");
    }

    #[test]
    fn a_refund_goes_back_only_while_the_record_still_counts_it() {
        let mut h = Held {
            holder: 1.0,
            held: 4,
            until: 100,
            ..Held::default()
        };
        assert!(h.spend(2));
        assert!(h.give_back(1, 10), "spent since the last renewal was sent");
        assert_eq!((h.held, h.spent), (3, 1));
        // A renewal sent now reports what was spent before it: none of it goes back after.
        h.spent = 0;
        assert!(!h.give_back(1, 10));
        // Nor after a fence, to the new holder, nor past the lease's time.
        assert!(h.spend(1));
        h.fence();
        assert!(!h.give_back(1, 10));
        h.held = 1;
        h.until = 100;
        assert!(h.spend(1));
        assert!(!h.give_back(1, 100));
    }
}
