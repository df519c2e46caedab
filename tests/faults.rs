// Over 600 lines: one idea, each outage policy through real Redis faults, under load.
//! The fault suite: real redis-server processes killed, restarted, paused, flushed and fed a key
//! of the wrong type while two stores (two "processes" sharing one budget) decide under load,
//! once per outage policy. Each run prints its figures, and asserts what the policy promises:
//!
//! - no over-admission with fail closed and with a local share of 1/2 for each of 2 processes,
//!   counted per phase (before the fault, during it, after recovery), because a Redis restart
//!   without persistence resets every bucket to full, as documented;
//! - decisions resume within one second of Redis coming back;
//! - no task is left behind and memory does not grow without bound; while the circuit is open,
//!   calls are answered at once instead of queueing.
//!
//! Part of the slow tier (it runs for half a minute and asserts wall-clock bounds), so
//! `cargo test` skips it: run `cargo test --all-features --test faults -- --ignored --nocapture`
//! to see the figures. One test takes a fraction of a second and runs in every `cargo test`: a
//! middleware ticket already sent is not sent again once a restart has lost its mark.
#![cfg(feature = "redis")]

use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burstgate::{BucketKey, BucketStore, Limit, OutagePolicy, RedisStore, StoreError};
use redis::aio::ConnectionManager;
use stats_alloc::{INSTRUMENTED_SYSTEM, StatsAlloc};
use std::alloc::System;

use burstgate_testkit::redis_server;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Bytes allocated and not yet freed, in the whole process.
fn live_heap() -> i64 {
    let s = GLOBAL.stats();
    // Growth by realloc is already in bytes_allocated, shrinking in bytes_deallocated.
    s.bytes_allocated as i64 - s.bytes_deallocated as i64
}

const STORES: usize = 2;
const WORKERS: usize = 4;
const KEYS: usize = 2;
const RATE: u32 = 20;
const BURST: u32 = 10;

fn limit() -> Limit {
    Limit::per_second(RATE)
        .and_then(|l| l.with_burst(BURST))
        .expect("a valid limit")
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Admitted,
    Denied,
    WrongType,
    Error,
}

#[derive(Debug, Clone, Copy)]
struct Event {
    /// When the call started, since the run started.
    at: Duration,
    took: Duration,
    key: usize,
    kind: Kind,
}

/// What one run measured.
#[derive(Debug)]
struct Figures {
    handled: usize,
    admitted: usize,
    errors: usize,
    /// Admissions above what the policy allows, summed over keys and phases.
    over: u64,
    /// Admissions of calls made while Redis was down.
    admitted_while_down: usize,
    /// From Redis being back to every store's circuit closed.
    recovered_in: Duration,
    /// The 99th percentile of decision times while the circuit was open.
    p99_while_open: Duration,
    /// Calls that waited out most of the timeout while the circuit was open: the probes.
    slow_while_open: usize,
    /// Heap bytes the run left allocated once its stores were dropped.
    kept_bytes: i64,
}

enum Fault {
    /// SIGKILL, then a new server on the same port after `down`.
    Kill,
    /// SIGSTOP, then SIGCONT after `down`.
    Pause,
}

fn policy_name(p: OutagePolicy) -> &'static str {
    match p {
        OutagePolicy::FailClosed => "fail closed",
        OutagePolicy::FailOpen => "fail open",
        _ => "local 1/2",
    }
}

fn policies() -> [OutagePolicy; 3] {
    [
        OutagePolicy::FailClosed,
        OutagePolicy::FailOpen,
        OutagePolicy::Local {
            processes: NonZeroU32::new(STORES as u32).expect("non-zero"),
        },
    ]
}

fn signal(pid: u32, sig: &str) {
    let status = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill -{sig} {pid}");
}

/// Admissions above `burst + rate x span` (plus `slack`) for each key, in the calls started in
/// `[from, to)`.
fn over_in(events: &[Event], from: Duration, to: Duration, slack: u64) -> u64 {
    let span = to.saturating_sub(from).as_secs_f64();
    let bound = u64::from(BURST) + (f64::from(RATE) * span).ceil() as u64 + slack;
    (0..KEYS)
        .map(|k| {
            let admitted = events
                .iter()
                .filter(|e| e.key == k && e.at >= from && e.at < to)
                .filter(|e| matches!(e.kind, Kind::Admitted))
                .count() as u64;
            admitted.saturating_sub(bound)
        })
        .sum()
}

type Workers = Vec<tokio::task::JoinHandle<()>>;

/// Keeps `WORKERS` tasks per store deciding on `KEYS` keys, one call every 2 ms each, until
/// `stop`; every call is recorded.
fn load(
    stores: &[RedisStore<ConnectionManager>],
    start: Instant,
    stop: Instant,
) -> (Workers, Arc<Mutex<Vec<Event>>>) {
    let keys: Arc<Vec<BucketKey>> = Arc::new(
        (0..KEYS)
            .map(|k| BucketKey::new("faults", format!("k{k}")).expect("a valid key"))
            .collect(),
    );
    let events = Arc::new(Mutex::new(Vec::<Event>::new()));
    let mut workers = Vec::new();
    for store in stores {
        for w in 0..WORKERS {
            let (store, keys, events) = (store.clone(), Arc::clone(&keys), Arc::clone(&events));
            workers.push(tokio::spawn(async move {
                let mut i = w;
                while Instant::now() < stop {
                    i += 1;
                    let key = i % KEYS;
                    let began = Instant::now();
                    let kind = match store.acquire(&keys[key], limit(), 1, Duration::ZERO).await {
                        Ok(d) if d.is_admitted() => Kind::Admitted,
                        Ok(_) => Kind::Denied,
                        Err(StoreError::WrongType { .. }) => Kind::WrongType,
                        Err(_) => Kind::Error,
                    };
                    let event = Event {
                        at: began - start,
                        took: began.elapsed(),
                        key,
                        kind,
                    };
                    events.lock().expect("not poisoned").push(event);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }));
        }
    }
    (workers, events)
}

async fn connect(
    url: &str,
    prefix: &str,
    policy: OutagePolicy,
) -> Vec<RedisStore<ConnectionManager>> {
    let mut stores = Vec::new();
    for _ in 0..STORES {
        let store = RedisStore::connect(url)
            .await
            .expect("connects")
            .prefix(prefix)
            .expect("a valid prefix")
            .on_outage(policy);
        stores.push(store);
    }
    stores
}

async fn run(fault: Fault, policy: OutagePolicy) -> Figures {
    let server = redis_server::spawn("").expect("a redis-server of our own");
    let url = format!("redis://127.0.0.1:{}/", server.port);
    let prefix = redis_server::unique_prefix();
    let tasks_before = tokio::runtime::Handle::current()
        .metrics()
        .num_alive_tasks();
    let heap_before = live_heap();
    let stores = connect(&url, &prefix, policy).await;
    let start = Instant::now();
    let (workers, events) = load(&stores, start, start + Duration::from_millis(3_000));

    // 600 ms of normal traffic, then the fault for a second.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let fault_at = start.elapsed();
    match fault {
        Fault::Kill => redis_server::kill(server),
        Fault::Pause => signal(server.pid, "STOP"),
    }
    // From here on Redis cannot answer: killed and its port closed, or stopped.
    let down_at = start.elapsed();
    let mut opened_at = None;
    let down_until = Instant::now() + Duration::from_secs(1);
    while Instant::now() < down_until {
        if opened_at.is_none() && stores.iter().all(|s| s.is_circuit_open()) {
            opened_at = Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let opened_at = opened_at.expect("the circuit opened while Redis was down");
    // Taken before Redis is back, so no answer from it can precede it.
    let back = Instant::now();
    match fault {
        Fault::Kill => {
            redis_server::spawn_on(server.port, "").expect("restarts on the same port");
        }
        Fault::Pause => signal(server.pid, "CONT"),
    }
    let back_at = back - start;
    let recovered_at = loop {
        if stores.iter().all(|s| !s.is_circuit_open()) {
            break start.elapsed();
        }
        assert!(back.elapsed() < Duration::from_secs(5), "never recovered");
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    for w in workers {
        w.await.expect("a worker finished without panicking");
    }
    let end = start.elapsed();
    let events = std::mem::take(&mut *events.lock().expect("not poisoned"));

    // Over-admission by what each policy promises, before the fault and from it on. From the
    // fault on, Redis's own budget counts in full: after a restart its buckets are full again
    // (documented), and after a pause it answers calls that were queued. The local shares add
    // their own budget while the circuit is open, which together is one budget, and a probe per
    // store may reach Redis early.
    let before = over_in(&events, Duration::ZERO, fault_at, 1);
    let local_budget = u64::from(BURST)
        + (f64::from(RATE) * (recovered_at - fault_at).as_secs_f64()).ceil() as u64
        + STORES as u64;
    let from_fault = match policy {
        OutagePolicy::FailClosed => over_in(&events, fault_at, end, 1),
        OutagePolicy::Local { .. } => over_in(&events, fault_at, end, 1 + local_budget),
        _ => 0,
    };
    // Calls that began once the fault had taken hold and ended before Redis was back.
    let admitted_while_down = events
        .iter()
        .filter(|e| e.at >= down_at && e.at + e.took < back_at)
        .filter(|e| matches!(e.kind, Kind::Admitted))
        .count();
    let mut while_open: Vec<Duration> = events
        .iter()
        .filter(|e| e.at >= opened_at && e.at < back_at)
        .map(|e| e.took)
        .collect();
    while_open.sort();
    let p99_while_open = while_open
        .get(while_open.len().saturating_sub(1) * 99 / 100)
        .copied()
        .unwrap_or_default();
    let slow_while_open = while_open
        .iter()
        .filter(|t| **t >= Duration::from_millis(200))
        .count();

    let figures = Figures {
        handled: events.len(),
        admitted: events
            .iter()
            .filter(|e| matches!(e.kind, Kind::Admitted))
            .count(),
        errors: events
            .iter()
            .filter(|e| matches!(e.kind, Kind::Error))
            .count(),
        over: before + from_fault,
        admitted_while_down,
        recovered_in: recovered_at.saturating_sub(back_at),
        p99_while_open,
        slow_while_open,
        kept_bytes: 0,
    };
    drop((stores, events, while_open));
    if matches!(fault, Fault::Pause) {
        redis_server::kill(server);
    }
    // Nothing is left running once the stores are gone.
    let settle = Instant::now();
    let mut tasks_after = usize::MAX;
    while settle.elapsed() < Duration::from_secs(2) {
        tasks_after = tokio::runtime::Handle::current()
            .metrics()
            .num_alive_tasks();
        if tasks_after <= tasks_before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        tasks_after <= tasks_before,
        "{tasks_after} tasks alive after the run, {tasks_before} before"
    );
    Figures {
        kept_bytes: live_heap() - heap_before,
        ..figures
    }
}

fn check(fault: &str, policy: OutagePolicy, f: &Figures) {
    println!(
        "{fault:<8} {:<12} handled {:>5}  admitted {:>4} ({:>3} while down)  errors {:>5}  \
         over-admitted {:>3}  recovered in {:>4} ms  while open: p99 {:>3} ms, {} probes  \
         heap kept {} B",
        policy_name(policy),
        f.handled,
        f.admitted,
        f.admitted_while_down,
        f.errors,
        f.over,
        f.recovered_in.as_millis(),
        f.p99_while_open.as_millis(),
        f.slow_while_open,
        f.kept_bytes,
    );
    // Everything the run allocated is given back: no queue of calls, buffers or buckets is left
    // behind by the outage. (A little may stay in statics filled on first use.)
    assert!(
        f.kept_bytes < 64 * 1024,
        "{fault}, {}: {} bytes still allocated after the run",
        policy_name(policy),
        f.kept_bytes
    );
    assert!(
        f.recovered_in <= Duration::from_secs(1),
        "{fault}, {}: decisions resumed {:?} after Redis was back",
        policy_name(policy),
        f.recovered_in
    );
    // While the circuit is open, calls are answered at once, not after the 250 ms timeout;
    // only the probes, at most one per store every 500 ms, may wait for Redis.
    assert!(
        f.p99_while_open < Duration::from_millis(50),
        "{fault}, {}: p99 {:?} while the circuit was open",
        policy_name(policy),
        f.p99_while_open
    );
    assert!(
        f.slow_while_open <= STORES * 3,
        "{fault}, {}: {} slow calls while the circuit was open",
        policy_name(policy),
        f.slow_while_open
    );
    match policy {
        OutagePolicy::FailClosed => {
            assert_eq!(f.over, 0, "fail closed never over-admits");
            assert_eq!(
                f.admitted_while_down, 0,
                "nothing is admitted without Redis"
            );
            assert!(f.errors > 0, "the outage was seen");
        }
        OutagePolicy::FailOpen => assert_eq!(f.errors, 0, "fail open never errs"),
        _ => {
            assert_eq!(f.over, 0, "the local shares never over-admit");
            assert_eq!(f.errors, 0, "every share here holds a token");
        }
    }
}

/// One test, so that the runs follow each other: each measures the whole process's tasks and
/// heap, and its timings are not disturbed by the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: run by .ci/run with --ignored"]
async fn fault_suite() {
    for policy in policies() {
        let f = run(Fault::Kill, policy).await;
        check("killed", policy, &f);
    }
    for policy in policies() {
        let f = run(Fault::Pause, policy).await;
        check("paused", policy, &f);
    }
    for policy in policies() {
        flushes_and_a_wrong_type_key(policy).await;
    }
    a_stalled_redis_spends_the_budget_of_calls_that_were_all_refused().await;
}

/// 2,000 acquires at once on a bucket of 2,000 while Redis is stopped for 600 ms: every call times
/// out, and only those in flight when it stopped may have spent their tokens. The rest were never
/// sent, so the bucket keeps their tokens.
async fn a_stalled_redis_spends_the_budget_of_calls_that_were_all_refused() {
    for connect in [false, true] {
        stall(connect).await;
    }
}

/// The stall, through [`RedisStore::connect`]'s connection or a plain multiplexed one.
async fn stall(connect: bool) {
    const CALLS: u32 = 2_000;
    let server = redis_server::spawn("").expect("a redis-server of our own");
    let url = format!("redis://127.0.0.1:{}/", server.port);
    let prefix = redis_server::unique_prefix();
    let store: Arc<dyn burstgate::DynBucketStore> = if connect {
        let store = RedisStore::connect(&url).await.expect("connects");
        Arc::new(store.prefix(&prefix).expect("a valid prefix"))
    } else {
        let conn = redis::Client::open(url.as_str())
            .expect("a valid Redis URL")
            .get_multiplexed_async_connection()
            .await
            .expect("a connection");
        Arc::new(
            RedisStore::new(conn)
                .prefix(&prefix)
                .expect("a valid prefix"),
        )
    };
    let l = Limit::per_minute(1)
        .and_then(|l| l.with_burst(CALLS))
        .expect("a valid limit");
    let key = BucketKey::new("faults", "stall").expect("a valid key");
    // The script is loaded, as on a server that has been serving for a while: a first call after
    // the stall then runs it, rather than meeting NOSCRIPT.
    let warm = BucketKey::new("faults", "warm").expect("a valid key");
    assert!(
        store
            .acquire(&warm, l, 1, Duration::ZERO)
            .await
            .expect("Redis is up")
            .is_admitted()
    );
    signal(server.pid, "STOP");
    let calls: Vec<_> = (0..CALLS)
        .map(|_| {
            let (store, key) = (store.clone(), key.clone());
            tokio::spawn(async move { store.acquire(&key, l, 1, Duration::ZERO).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(600)).await;
    signal(server.pid, "CONT");
    let mut admitted = 0;
    for call in calls {
        let result = call.await.expect("no panic");
        admitted += u32::from(matches!(result, Ok(d) if d.is_admitted()));
    }
    // Once the circuit lets calls through again, what the bucket holds.
    let started = Instant::now();
    let remaining = loop {
        match store.peek(&key, l).await {
            Ok(q) => break q.remaining(),
            Err(_) if started.elapsed() < Duration::from_secs(5) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("Redis never answered again: {e}"),
        }
    };
    println!(
        "stalled  fail closed  {CALLS} acquires while stopped 600 ms, {}: admitted {admitted}, \
         {remaining} tokens left, {} spent by calls that were refused",
        if connect { "connect()" } else { "multiplexed" },
        CALLS - admitted - remaining
    );
    assert!(
        admitted + remaining >= 1_800,
        "admitted {admitted} + remaining {remaining}: the stall spent refused calls' budget"
    );
    redis_server::kill(server);
}

async fn flushes_and_a_wrong_type_key(policy: OutagePolicy) {
    {
        let server = redis_server::spawn("").expect("a redis-server of our own");
        let url = format!("redis://127.0.0.1:{}/", server.port);
        let prefix = redis_server::unique_prefix();
        let stores = connect(&url, &prefix, policy).await;
        let mut admin = redis::Client::open(url.as_str())
            .expect("a valid Redis URL")
            .get_multiplexed_async_connection()
            .await
            .expect("a connection");
        let start = Instant::now();
        let (workers, events) = load(&stores, start, start + Duration::from_millis(1_500));
        let at = |ms| start + Duration::from_millis(ms);

        tokio::time::sleep_until(at(400).into()).await;
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut admin)
            .await
            .expect("SCRIPT FLUSH");
        tokio::time::sleep_until(at(800).into()).await;
        let flushall_at = start.elapsed();
        let _: () = redis::cmd("FLUSHALL")
            .query_async(&mut admin)
            .await
            .expect("FLUSHALL");
        let flushall_done = start.elapsed();
        tokio::time::sleep_until(at(1_100).into()).await;
        let wrong = BucketKey::new("faults", "k1").expect("a valid key");
        let wrong_at = start.elapsed();
        let _: () = redis::cmd("SET")
            .arg(stores[0].redis_key(&wrong))
            .arg("not a bucket")
            .query_async(&mut admin)
            .await
            .expect("SET");
        let wrong_done = start.elapsed();
        for w in workers {
            w.await.expect("a worker finished without panicking");
        }
        let end = start.elapsed();
        let events = std::mem::take(&mut *events.lock().expect("not poisoned"));
        let count = |f: &dyn Fn(&Event) -> bool| events.iter().filter(|e| f(e)).count();
        let admitted = count(&|e| matches!(e.kind, Kind::Admitted));
        let errors = count(&|e| matches!(e.kind, Kind::Error));
        let wrong_type = count(&|e| matches!(e.kind, Kind::WrongType));
        // A call that began before the SET may run after it; one that ended before it cannot,
        // and one that began once it was done runs after it.
        let wrong_type_elsewhere = count(&|e| {
            matches!(e.kind, Kind::WrongType) && (e.key != 1 || e.at + e.took < wrong_at)
        });
        let k1_admitted_after =
            count(&|e| matches!(e.kind, Kind::Admitted) && e.key == 1 && e.at >= wrong_done);
        // FLUSHALL empties every bucket: a full budget again from then on (documented).
        // Each bucket's budget before FLUSHALL, counting calls that ended before it was sent,
        // and its new budget after, counting calls that began once it was done; the few in
        // flight across it could meet either bucket.
        let ended_before: Vec<Event> = events
            .iter()
            .filter(|e| e.at + e.took < flushall_at)
            .copied()
            .collect();
        let over = over_in(&ended_before, Duration::ZERO, flushall_at, 1)
            + over_in(&events, flushall_done, end, 1);
        println!(
            "flushes  {:<12} handled {:>5}  admitted {:>4}  errors {:>3}  wrong type {:>4}  \
             over-admitted {}  circuit opened: {}",
            policy_name(policy),
            events.len(),
            admitted,
            errors,
            wrong_type,
            over,
            stores.iter().any(|s| s.is_circuit_open()),
        );
        assert_eq!(errors, 0, "SCRIPT FLUSH and FLUSHALL cause no error");
        assert_eq!(over, 0);
        assert!(wrong_type > 0, "the wrong-type key is reported");
        assert_eq!(
            wrong_type_elsewhere, 0,
            "only that key, only after it was set"
        );
        assert_eq!(
            k1_admitted_after, 0,
            "whatever the policy: it is not an outage"
        );
        assert!(
            stores.iter().all(|s| !s.is_circuit_open()),
            "a wrong-type key does not open the circuit"
        );
        redis_server::kill(server);
    }
}

/// The bug: a ticket's only record of having gone was the mark its sending wrote, so after a
/// restart of a Redis without persistence a job delivered again sent the same ticket a second
/// time. Its booking writes the mark now, and a ticket whose mark the restart lost is refused as
/// expired.
#[cfg(feature = "reqwest")]
#[tokio::test]
async fn a_ticket_already_sent_does_not_go_again_after_a_redis_restart() {
    use burstgate::KeySecret;
    use burstgate::middleware::{Account, RateLimitMiddleware, Route, Ticket, TicketError};
    use wiremock::matchers::{method, path};
    use wiremock::{Mock, MockServer, ResponseTemplate};

    let server = redis_server::spawn("").expect("a redis-server of our own");
    let upstream = MockServer::start().await;
    Mock::given(method("GET"))
        .and(path("/orders"))
        .respond_with(ResponseTemplate::new(200))
        .expect(1)
        .mount(&upstream)
        .await;
    let store = RedisStore::connect(&format!("redis://127.0.0.1:{}/", server.port))
        .await
        .expect("connects")
        .prefix(&redis_server::unique_prefix())
        .expect("a valid prefix");
    let orders =
        Route::new("orders", Limit::per_minute(1).expect("a limit"), "/orders").expect("a route");
    let limiter = RateLimitMiddleware::new(store)
        .route(orders)
        .key_secret(KeySecret::new(b"the tests' application secret").expect("a secret"));
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(limiter.clone())
        .build();
    let url = format!("{}/orders", upstream.uri());
    let send = |ticket: &Ticket| {
        client
            .get(&url)
            .with_extension(Account::new("seller-1"))
            .with_extension(ticket.clone())
            .send()
    };
    let refusal = |result: Result<reqwest::Response, reqwest_middleware::Error>| match result {
        Err(reqwest_middleware::Error::Middleware(e)) => e.downcast_ref::<TicketError>().copied(),
        _ => None,
    };

    let mut account = http::Extensions::new();
    account.insert(Account::new("seller-1"));
    let request = reqwest::Client::new().get(&url).build().expect("a request");
    let ticket = limiter
        .reserve(&request, &account)
        .await
        .expect("booked")
        .expect("a route draws from it");
    let sent = send(&ticket).await.map(|r| r.status());
    assert_eq!(sent.ok(), Some(reqwest::StatusCode::OK));
    assert_eq!(refusal(send(&ticket).await), Some(TicketError::Spent));

    redis_server::kill(server);
    let server = redis_server::spawn_on(server.port, "").expect("restarts on the same port, empty");
    // The first calls after the restart may meet the connection it broke: store errors, until
    // the connection is made again.
    let deadline = Instant::now() + Duration::from_secs(5);
    let again = loop {
        let result = send(&ticket).await;
        let store_failed = matches!(
            &result,
            Err(reqwest_middleware::Error::Middleware(e)) if e.downcast_ref::<StoreError>().is_some()
        );
        if !store_failed || Instant::now() > deadline {
            break result;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        upstream.received_requests().await.map(|r| r.len()),
        Some(1),
        "sent again after the restart: {again:?}"
    );
    assert_eq!(refusal(again), Some(TicketError::Expired));
    upstream.verify().await;
    redis_server::kill(server);
}
