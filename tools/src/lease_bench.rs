// Over 600 lines: one program, whose modes share their workers, their start and their tally.
//! Token leases measured across processes: the speed they buy on one hot key, whether the
//! processes together keep to the limit, what a killed process costs, and an outside check
//! against nginx's `limit_req`.
//!
//! The tool runs `--processes` worker processes (itself again, with a hidden `--worker`), each
//! with `--tasks` tokio tasks that take decisions of cost 1 on one key back to back, with a
//! [`RedisStore`] from [`RedisStore::connect`]. Every worker connects, says it is ready, and
//! is then told one start time on the system clock, which all of them share on one machine; no
//! worker calls the store before it. Workers write what they counted to their stdout, a line
//! at a time with no buffering, and the coordinator adds it up. Without `--url` the tool starts
//! a `redis-server` of its own on a free loopback port (`--save '' --appendonly no`) and stops
//! it at the end; every run uses a key prefix no earlier run used, so every bucket starts full.
//!
//! ```sh
//! cargo run --release -p burstgate-tools --bin lease_bench -- speed
//! cargo run --release -p burstgate-tools --bin lease_bench -- exact
//! cargo run --release -p burstgate-tools --bin lease_bench -- crash
//! cargo run --release -p burstgate-tools --bin lease_bench -- nginx
//! ```
//!
//! Modes:
//!
//! - `speed`: one key on a limit that admits everything (2^32 − 1 per second, the same burst),
//!   first without leases and then with them, each for `--warmup-seconds` (not measured) and
//!   `--seconds` (5 by default). One line per half: decisions per second of every process
//!   together, the latency of one decision inside its process (from before the call to
//!   `acquire` to its answer, in a log-linear histogram with 32 steps per power of two; the
//!   upper edge of a quantile's step is printed, so figures are at most 3 % high), and the
//!   script calls Redis counted per decision (`evalsha` and `eval` in `INFO commandstats`,
//!   read when the measured part starts and after every worker has finished it; the store's
//!   clock measurements count too). A last line compares the two halves.
//! - `exact`: one key on `--rate` per second with `--burst` (20,000 and 2,000), leased, for
//!   `--seconds` (10), with demand far above the limit. Every admission is counted by its
//!   process. The window is from the common start (no call is made before it) to the latest
//!   answer of an admitted call, on the one system clock; the budget is
//!   `burst + rate × window`, and the run passes when the processes admitted at most the
//!   budget and at least 95 % of it.
//! - `crash`: as `exact`, but worker 0 is killed with SIGKILL `--kill-after` seconds (5) from
//!   the start. Each worker writes its running count every `--report-ms` (1) with the time it
//!   read it and what its lease held at its last admission, so what the killed worker admitted
//!   after its last report, and which nobody counts, is about its mean rate times the time from
//!   that report to the kill: the line prints that estimate (`unseen_at_most`, rounded up) and
//!   what the killed worker's lease held (`killed_held`). `lost` is the budget less what the
//!   survivors admitted and the killed worker last reported. The survivors also report what
//!   their leases held at their last admission: tokens held when the run stops are lost in
//!   `exact` too. The run passes when `lost` is at most one lease (`burst / 8`, what the killed
//!   process can have taken and never spent) plus the survivors' held tokens plus the unseen
//!   estimate.
//! - `nginx`: an nginx (`--nginx`, on the `PATH` by default) on a free loopback port, with a
//!   configuration of its own in a new directory: `limit_req_zone $server_name zone=one:1m
//!   rate=500r/s; limit_req zone=one burst=50 nodelay; limit_req_status 429;`, serving a small
//!   static file. The workers decide with a leased store at the same limit, 500 per second with
//!   a burst of 50, for `--seconds` (10), and every admission sends one GET. A refused task
//!   waits for its `retry_after` (at least 1 ms), as a client of a limited server does: demand
//!   stays hundreds of times the limit, and the workers leave nginx the CPU it needs to answer
//!   at once (`--spin` calls again at once instead). The run passes with no 429 and at least
//!   95 % of `500 × seconds + 50` answered 200. Before the run, 100 requests pipelined on one
//!   connection to a location with a zone of its own show that this nginx limits (51 pass:
//!   nginx's first request in a zone is free), and to one that answers with `return 200`, which
//!   runs before `limit_req` and so is never limited: why the measured location serves a file.
//!   nginx counts a request when it arrives, the store when it decides: the line also gives
//!   when the first admission and the first answer came, the admission time of the first
//!   request refused, and the longest GET, since GETs that take longer than others bunch up on
//!   arrival (nginx's one request beyond the burst covers 2 ms of that at 500 per second).
//!
//! Options: `--url` (or `REDIS_URL`) instead of a Redis of the tool's own (other clients of
//! it count in `speed`'s Redis calls); `--processes 4`; `--tasks 64`; `--lease-ms 1000`;
//! `--threads N`, tokio worker threads per process (0, the default, for one per core; 1 for a
//! current-thread runtime); `--plain`, for `exact`, `crash` and `nginx`: the same run with the
//! store out of lease mode (`lease=off`), to compare their Redis calls.
//!
//! It prints one line per run (wrapped here; `<...>` are figures):
//!
//! ```text
//! lease_bench speed leases=on P=4 T=64 secs=5.0 decisions=<n> rate=<n>/s p50=<us>us
//!   p99=<us>us p999=<us>us redis_calls=<n> calls_per_decision=<x> denied=0 errors=0
//! lease_bench exact P=4 T=64 limit=20000/s burst=2000 lease=1000ms window=<s>s
//!   admitted=<n> budget=<x> ratio=<x> per_worker=<n>,<n>,<n>,<n> held_at_end=<n>,...
//!   denied=<n> redis_calls=<n> calls_per_admission=<x> errors=0 PASS
//! ```

use std::error::Error;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use burstgate::redis;
use burstgate::{BucketKey, BucketStore, Leases, Limit, RedisStore};
use clap::{Parser, ValueEnum};

type BoxError = Box<dyn Error + Send + Sync>;

/// nginx's limit, as published to its clients, and so the one handed to the store.
const NGINX_RATE: u32 = 500;
const NGINX_BURST: u32 = 50;

/// How long workers have to connect before the coordinator gives up on them.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// From the last "ready" to the common start: time to hand every worker the start.
const START_LEAD: Duration = Duration::from_millis(200);

/// Token leases measured across processes: speed, exactness, a crash, and nginx.
#[derive(Parser, Clone)]
#[command(name = "lease_bench")]
struct Args {
    /// What to measure.
    #[arg(value_enum)]
    mode: Mode,
    /// A Redis to run on, instead of one the tool starts.
    #[arg(long, env = "REDIS_URL")]
    url: Option<String>,
    /// Worker processes.
    #[arg(long, default_value_t = 4, value_parser = at_least_one)]
    processes: usize,
    /// Tasks per process, each taking decisions back to back.
    #[arg(long, default_value_t = 64, value_parser = at_least_one)]
    tasks: usize,
    /// Length of the measured run (5 s for speed, 10 s for the other modes).
    #[arg(long, value_parser = positive_seconds)]
    seconds: Option<f64>,
    /// speed: the unmeasured run before each measured one.
    #[arg(long, default_value_t = 1.0, value_parser = seconds_or_zero)]
    warmup_seconds: f64,
    /// exact and crash: the limit's tokens per second.
    #[arg(long, default_value_t = 20_000)]
    rate: u32,
    /// exact and crash: the limit's burst.
    #[arg(long, default_value_t = 2_000)]
    burst: u32,
    /// The time of a lease, in milliseconds.
    #[arg(long, default_value_t = 1_000)]
    lease_ms: u64,
    /// crash: when worker 0 is killed, in seconds from the start.
    #[arg(long, default_value_t = 5.0, value_parser = seconds_or_zero)]
    kill_after: f64,
    /// How often a worker writes its running count, in milliseconds.
    #[arg(long, default_value_t = 1)]
    report_ms: u64,
    /// Tokio worker threads per process; 0 for one per core, 1 for a current-thread runtime.
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// exact, crash and nginx: the store without leases, for comparison.
    #[arg(long)]
    plain: bool,
    /// nginx: a refused task calls again at once, as in exact and crash, instead of waiting
    /// for its retry_after.
    #[arg(long)]
    spin: bool,
    /// nginx: the binary.
    #[arg(long, default_value = "nginx")]
    nginx: String,
    /// Set by the coordinator: this process is worker N.
    #[arg(long, hide = true)]
    worker: Option<usize>,
    /// Set by the coordinator: the run's key prefix.
    #[arg(long, hide = true)]
    prefix: Option<String>,
    /// Set by the coordinator: the store runs in lease mode.
    #[arg(long, hide = true)]
    leased: bool,
    /// Set by the coordinator: the URL each admission GETs.
    #[arg(long, hide = true)]
    target: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    Speed,
    Exact,
    Crash,
    Nginx,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Speed => "speed",
            Mode::Exact => "exact",
            Mode::Crash => "crash",
            Mode::Nginx => "nginx",
        }
    }
}

impl Args {
    fn seconds(&self) -> f64 {
        self.seconds
            .unwrap_or(if self.mode == Mode::Speed { 5.0 } else { 10.0 })
    }

    /// The lease time as printed, or "off" for `--plain`.
    fn lease(&self) -> String {
        if self.plain {
            "off".into()
        } else {
            format!("{}ms", self.lease_ms)
        }
    }

    /// The limit the workers decide on.
    fn limit(&self) -> Result<Limit, BoxError> {
        Ok(match self.mode {
            Mode::Speed => Limit::per_second(u32::MAX)?.with_burst(u32::MAX)?,
            Mode::Exact | Mode::Crash => Limit::per_second(self.rate)?.with_burst(self.burst)?,
            Mode::Nginx => Limit::per_second(NGINX_RATE)?.with_burst(NGINX_BURST)?,
        })
    }
}

fn positive_seconds(value: &str) -> Result<f64, String> {
    let s: f64 = value.parse().map_err(|e| format!("{e}"))?;
    if s > 0.0 && s.is_finite() {
        Ok(s)
    } else {
        Err("must be a positive number".into())
    }
}

fn seconds_or_zero(value: &str) -> Result<f64, String> {
    let s: f64 = value.parse().map_err(|e| format!("{e}"))?;
    if s >= 0.0 && s.is_finite() {
        Ok(s)
    } else {
        Err("must be zero or more".into())
    }
}

fn at_least_one(value: &str) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// The system clock in nanoseconds since the Unix epoch: the one clock every process here
/// reads, and the one Redis on the same machine reads.
fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn main() -> Result<(), BoxError> {
    let args = Args::parse();
    match args.worker {
        Some(id) => worker_main(&args, id),
        None => coordinate(&args),
    }
}

// ---------------------------------------------------------------------------------------------
// Workers

/// What a worker's tasks count, shared with the thread that reports it.
#[derive(Default)]
struct Counts {
    admitted: AtomicU64,
    denied: AtomicU64,
    errors: AtomicU64,
    /// When the latest admitted call answered.
    last_admit_ns: AtomicU64,
    /// What the lease held after the latest admission.
    held: AtomicU64,
    http_ok: AtomicU64,
    http_limited: AtomicU64,
    http_other: AtomicU64,
    /// nginx: when the first admitted call answered, when the first GET was answered, when
    /// the first admission that nginx refused answered (u64::MAX for none), and the longest
    /// GET.
    first_admit_ns: AtomicU64,
    first_answer_ns: AtomicU64,
    first_limited_ns: AtomicU64,
    longest_get_ns: AtomicU64,
    first_error: Mutex<Option<String>>,
}

impl Counts {
    fn new() -> Self {
        Self {
            first_admit_ns: AtomicU64::new(u64::MAX),
            first_answer_ns: AtomicU64::new(u64::MAX),
            first_limited_ns: AtomicU64::new(u64::MAX),
            ..Self::default()
        }
    }

    fn error(&self, e: impl std::fmt::Display) {
        self.errors.fetch_add(1, Relaxed);
        let mut first = self.first_error.lock().unwrap_or_else(|p| p.into_inner());
        if first.is_none() {
            *first = Some(e.to_string().replace('\n', " "));
        }
    }
}

/// One line to the coordinator, written at once: the pipe keeps what a killed worker wrote.
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(line.as_bytes());
    let _ = out.write_all(b"\n");
    let _ = out.flush();
}

fn worker_main(args: &Args, id: usize) -> Result<(), BoxError> {
    let runtime = match args.threads {
        1 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
        0 => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?,
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n)
            .enable_all()
            .build()?,
    };
    let url = args.url.as_deref().ok_or("a worker needs --url")?;
    let prefix = args.prefix.as_deref().ok_or("a worker needs --prefix")?;
    let mut store = runtime.block_on(RedisStore::connect(url))?.prefix(prefix)?;
    if args.leased {
        store = store.leases(Leases::new().time(Duration::from_millis(args.lease_ms))?);
    }
    say("ready");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    let start_ns: u64 = line
        .strip_prefix("start ")
        .ok_or_else(|| format!("worker {id}: expected a start, got {line:?}"))?
        .trim()
        .parse()?;
    runtime.block_on(async {
        if args.mode == Mode::Speed {
            speed_worker(args, store, start_ns).await
        } else {
            limit_worker(args, store, start_ns).await
        }
    })
}

/// Waits for the common start, without calling anything before it; the `Instant` it is.
fn wait_for(start_ns: u64) -> Instant {
    let ahead = start_ns.saturating_sub(unix_ns());
    if ahead > 2_000_000 {
        std::thread::sleep(Duration::from_nanos(ahead - 2_000_000));
    }
    while unix_ns() < start_ns {
        std::hint::spin_loop();
    }
    Instant::now()
}

async fn speed_worker(
    args: &Args,
    store: RedisStore<redis::aio::ConnectionManager, burstgate::ServerClock>,
    start_ns: u64,
) -> Result<(), BoxError> {
    let key = BucketKey::new("speed", "one-key")?;
    let limit = args.limit()?;
    let start = wait_for(start_ns);
    let measured = start + Duration::from_secs_f64(args.warmup_seconds);
    let end = measured + Duration::from_secs_f64(args.seconds());
    let tasks: Vec<_> = (0..args.tasks)
        .map(|_| {
            let (store, key) = (store.clone(), key.clone());
            tokio::spawn(async move {
                let mut tally = (Histogram::new(), 0_u64, 0_u64, None::<String>);
                loop {
                    let before = Instant::now();
                    if before >= end {
                        return tally;
                    }
                    let answer = store.acquire(&key, limit, 1, Duration::ZERO).await;
                    let after = Instant::now();
                    if before < measured {
                        continue;
                    }
                    tally.0.record(after - before);
                    match answer {
                        Ok(d) if d.is_admitted() => {}
                        Ok(_) => tally.1 += 1,
                        Err(e) => {
                            tally.2 += 1;
                            tally.3.get_or_insert_with(|| e.to_string());
                        }
                    }
                }
            })
        })
        .collect();
    let mut all = Histogram::new();
    let (mut denied, mut errors, mut first_error) = (0, 0, None);
    for task in tasks {
        let (h, d, e, first) = task.await?;
        all.merge(&h);
        denied += d;
        errors += e;
        first_error = first_error.or(first);
    }
    if let Some(e) = first_error {
        say(&format!("error {}", e.replace('\n', " ")));
    }
    say(&format!("hist {}", all.encode()));
    let decisions = all.total();
    say(&format!(
        "done {} {denied} {errors} 0 0 0 0 0 {none} {none} {none} 0",
        decisions - denied - errors,
        none = u64::MAX,
    ));
    Ok(())
}

/// exact, crash and nginx: demand far over the limit, every admission counted, and reported
/// every `--report-ms` by a thread of its own, so that a busy runtime does not delay it.
async fn limit_worker(
    args: &Args,
    store: RedisStore<redis::aio::ConnectionManager, burstgate::ServerClock>,
    start_ns: u64,
) -> Result<(), BoxError> {
    let key = BucketKey::new("exact", "one-key")?;
    let limit = args.limit()?;
    let http = match &args.target {
        Some(url) => Some((
            reqwest::Client::builder()
                // Never send loopback traffic through a proxy named in the environment.
                .no_proxy()
                .timeout(Duration::from_secs(5))
                .pool_max_idle_per_host(args.tasks)
                .build()?,
            url.clone(),
        )),
        None => None,
    };
    let counts = Arc::new(Counts::new());
    let wait_when_refused = args.mode == Mode::Nginx && !args.spin;
    let stop = Arc::new(AtomicBool::new(false));
    let reporter = {
        let (counts, stop) = (Arc::clone(&counts), Arc::clone(&stop));
        let every = Duration::from_millis(args.report_ms.max(1));
        std::thread::spawn(move || {
            while !stop.load(Relaxed) {
                std::thread::sleep(every);
                // The time is read after the count: no admission counted is later than it.
                let admitted = counts.admitted.load(Relaxed);
                let held = counts.held.load(Relaxed);
                say(&format!("n {admitted} {} {held}", unix_ns()));
            }
        })
    };
    let start = wait_for(start_ns);
    let end = start + Duration::from_secs_f64(args.seconds());
    let tasks: Vec<_> = (0..args.tasks)
        .map(|_| {
            let (store, key, counts, http) = (
                store.clone(),
                key.clone(),
                Arc::clone(&counts),
                http.clone(),
            );
            tokio::spawn(async move {
                while Instant::now() < end {
                    match store.acquire(&key, limit, 1, Duration::ZERO).await {
                        Ok(d) if d.is_admitted() => {
                            let admitted_at = unix_ns();
                            counts.admitted.fetch_add(1, Relaxed);
                            counts.last_admit_ns.fetch_max(admitted_at, Relaxed);
                            counts.first_admit_ns.fetch_min(admitted_at, Relaxed);
                            counts.held.store(u64::from(d.remaining()), Relaxed);
                            if let Some((client, url)) = &http {
                                let answer = client.get(url).send().await;
                                let answered_at = unix_ns();
                                counts.first_answer_ns.fetch_min(answered_at, Relaxed);
                                counts
                                    .longest_get_ns
                                    .fetch_max(answered_at - admitted_at, Relaxed);
                                let tally = match answer {
                                    Ok(r) if r.status() == 200 => &counts.http_ok,
                                    Ok(r) if r.status() == 429 => {
                                        counts.first_limited_ns.fetch_min(admitted_at, Relaxed);
                                        &counts.http_limited
                                    }
                                    _ => &counts.http_other,
                                };
                                tally.fetch_add(1, Relaxed);
                            }
                        }
                        Ok(d) => {
                            counts.denied.fetch_add(1, Relaxed);
                            if wait_when_refused {
                                let wait = d.retry_after().unwrap_or_default();
                                tokio::time::sleep(wait.max(Duration::from_millis(1))).await;
                            }
                        }
                        Err(e) => counts.error(e),
                    }
                }
            })
        })
        .collect();
    for task in tasks {
        task.await?;
    }
    stop.store(true, Relaxed);
    let _ = reporter.join();
    if let Some(e) = counts
        .first_error
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take()
    {
        say(&format!("error {e}"));
    }
    let c = &counts;
    say(&format!(
        "done {} {} {} {} {} {} {} {} {} {} {} {}",
        c.admitted.load(Relaxed),
        c.denied.load(Relaxed),
        c.errors.load(Relaxed),
        c.last_admit_ns.load(Relaxed),
        c.held.load(Relaxed),
        c.http_ok.load(Relaxed),
        c.http_limited.load(Relaxed),
        c.http_other.load(Relaxed),
        c.first_admit_ns.load(Relaxed),
        c.first_answer_ns.load(Relaxed),
        c.first_limited_ns.load(Relaxed),
        c.longest_get_ns.load(Relaxed),
    ));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The coordinator

/// A worker's final line.
#[derive(Default, Clone, Copy)]
struct Done {
    admitted: u64,
    denied: u64,
    errors: u64,
    last_admit_ns: u64,
    held: u64,
    http_ok: u64,
    http_limited: u64,
    http_other: u64,
    first_admit_ns: u64,
    first_answer_ns: u64,
    first_limited_ns: u64,
    longest_get_ns: u64,
}

impl Done {
    fn parse(rest: &str) -> Result<Self, BoxError> {
        let f: Vec<u64> = rest
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()?;
        let [
            admitted,
            denied,
            errors,
            last_admit_ns,
            held,
            http_ok,
            http_limited,
            http_other,
            first_admit_ns,
            first_answer_ns,
            first_limited_ns,
            longest_get_ns,
        ] = f[..]
        else {
            return Err(format!("a malformed done line: {rest:?}").into());
        };
        Ok(Self {
            admitted,
            denied,
            errors,
            last_admit_ns,
            held,
            http_ok,
            http_limited,
            http_other,
            first_admit_ns,
            first_answer_ns,
            first_limited_ns,
            longest_get_ns,
        })
    }
}

/// What one worker told the coordinator.
#[derive(Default)]
struct Heard {
    done: Option<Done>,
    hist: Option<Histogram>,
    /// The latest running count, with the worker's time of it and what its lease held.
    last_count: Option<(u64, u64, u64)>,
    ended: bool,
}

/// The worker processes of one run and the lines they write.
struct Workers {
    children: Vec<Child>,
    stdins: Vec<ChildStdin>,
    lines: Receiver<(usize, Option<String>)>,
    heard: Vec<Heard>,
}

impl Workers {
    fn spawn(
        args: &Args,
        url: &str,
        prefix: &str,
        leased: bool,
        target: Option<&str>,
    ) -> Result<Self, BoxError> {
        let exe = std::env::current_exe()?;
        let (send, lines) = mpsc::channel();
        let mut children = Vec::new();
        let mut stdins = Vec::new();
        for id in 0..args.processes {
            let mut cmd = Command::new(&exe);
            cmd.arg(args.mode.name())
                .args([
                    "--worker",
                    &id.to_string(),
                    "--url",
                    url,
                    "--prefix",
                    prefix,
                ])
                .args(["--tasks", &args.tasks.to_string()])
                .args(["--seconds", &args.seconds().to_string()])
                .args(["--warmup-seconds", &args.warmup_seconds.to_string()])
                .args(["--rate", &args.rate.to_string()])
                .args(["--burst", &args.burst.to_string()])
                .args(["--lease-ms", &args.lease_ms.to_string()])
                .args(["--report-ms", &args.report_ms.to_string()])
                .args(["--threads", &args.threads.to_string()])
                .args(args.spin.then_some("--spin"))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit());
            if leased {
                cmd.arg("--leased");
            }
            if let Some(t) = target {
                cmd.args(["--target", t]);
            }
            let mut child = cmd.spawn()?;
            let stdout = child.stdout.take().ok_or("no stdout")?;
            stdins.push(child.stdin.take().ok_or("no stdin")?);
            children.push(child);
            let send = send.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    match line {
                        Ok(line) => {
                            if send.send((id, Some(line))).is_err() {
                                return;
                            }
                        }
                        Err(_) => break,
                    }
                }
                let _ = send.send((id, None));
            });
        }
        let heard = (0..args.processes).map(|_| Heard::default()).collect();
        Ok(Self {
            children,
            stdins,
            lines,
            heard,
        })
    }

    /// Takes one line in, waiting at most `within`; false when none came.
    fn hear(&mut self, within: Duration) -> Result<bool, BoxError> {
        let (id, line) = match self.lines.recv_timeout(within) {
            Ok(got) => got,
            Err(RecvTimeoutError::Timeout) => return Ok(false),
            Err(RecvTimeoutError::Disconnected) => return Err("every worker is gone".into()),
        };
        let heard = &mut self.heard[id];
        let Some(line) = line else {
            heard.ended = true;
            return Ok(true);
        };
        let (word, rest) = line.split_once(' ').unwrap_or((line.as_str(), ""));
        match word {
            "ready" => {}
            "n" => {
                let mut f = rest.split_whitespace().map(str::parse::<u64>);
                if let (Some(Ok(n)), Some(Ok(at)), Some(Ok(held))) = (f.next(), f.next(), f.next())
                {
                    heard.last_count = Some((n, at, held));
                }
            }
            "hist" => heard.hist = Some(Histogram::decode(rest)?),
            "done" => heard.done = Some(Done::parse(rest)?),
            "error" => eprintln!("worker {id}: first error: {rest}"),
            _ => return Err(format!("worker {id} said {line:?}").into()),
        }
        Ok(true)
    }

    /// Waits until every worker is connected, then hands them a start shortly after; the start,
    /// in ns on the system clock.
    fn start(&mut self) -> Result<u64, BoxError> {
        let deadline = Instant::now() + READY_WITHIN;
        let mut ready = 0;
        while ready < self.children.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok((_, Some(line))) if line == "ready" => ready += 1,
                Ok((id, line)) => return Err(format!("worker {id} said {line:?} first").into()),
                Err(_) => return Err("the workers did not get ready in time".into()),
            }
        }
        let start = unix_ns() + START_LEAD.as_nanos() as u64;
        for stdin in &mut self.stdins {
            writeln!(stdin, "start {start}")?;
            stdin.flush()?;
        }
        Ok(start)
    }

    /// Listens until every worker has ended, then reaps them.
    fn finish(&mut self) -> Result<(), BoxError> {
        while !self.heard.iter().all(|h| h.ended) {
            self.hear(Duration::from_secs(60))?;
        }
        for child in &mut self.children {
            child.wait()?;
        }
        Ok(())
    }

    fn done(&self, id: usize) -> Result<Done, BoxError> {
        self.heard[id]
            .done
            .ok_or_else(|| format!("worker {id} ended without its counts").into())
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for child in &mut self.children {
            if matches!(child.try_wait(), Ok(None)) {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// A server this tool started, stopped when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> Result<u16, BoxError> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn start_redis() -> Result<(Server, String), BoxError> {
    let port = free_port()?;
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("could not start redis-server: {e}"))?;
    let server = Server(child);
    let url = format!("redis://127.0.0.1:{port}/");
    let client = redis::Client::open(url.as_str())?;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let answered = client
            .get_connection()
            .is_ok_and(|mut conn| redis::cmd("PING").query::<String>(&mut conn).is_ok());
        if answered {
            break;
        }
        if Instant::now() > deadline {
            return Err("redis-server did not answer".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((server, url))
}

/// Calls of `evalsha` and `eval` together, from `INFO commandstats`.
fn script_calls(url: &str) -> Result<u64, BoxError> {
    let mut conn = redis::Client::open(url)?.get_connection()?;
    let info: String = redis::cmd("INFO").arg("commandstats").query(&mut conn)?;
    let mut calls = 0;
    for line in info.lines().filter_map(|l| {
        l.strip_prefix("cmdstat_evalsha:")
            .or_else(|| l.strip_prefix("cmdstat_eval:"))
    }) {
        let value = line
            .split(',')
            .find_map(|kv| kv.strip_prefix("calls="))
            .ok_or_else(|| format!("no calls in {line:?}"))?;
        calls += value.parse::<u64>()?;
    }
    Ok(calls)
}

/// A prefix no earlier run used.
fn new_prefix(what: &str) -> String {
    format!("lease-bench-{}-{}-{what}", std::process::id(), unix_ns())
}

fn coordinate(args: &Args) -> Result<(), BoxError> {
    let (_redis, url) = match &args.url {
        Some(url) => (None, url.clone()),
        None => {
            let (server, url) = start_redis()?;
            (Some(server), url)
        }
    };
    match args.mode {
        Mode::Speed => speed(args, &url),
        Mode::Exact => exact(args, &url),
        Mode::Crash => crash(args, &url),
        Mode::Nginx => nginx(args, &url),
    }
}

/// One half of `speed`: decisions, histogram, script calls.
struct SpeedRun {
    decisions: u64,
    denied: u64,
    errors: u64,
    hist: Histogram,
    calls: u64,
}

fn speed_run(args: &Args, url: &str, leased: bool) -> Result<SpeedRun, BoxError> {
    let prefix = new_prefix(if leased { "speed-on" } else { "speed-off" });
    let mut workers = Workers::spawn(args, url, &prefix, leased, None)?;
    let start = workers.start()?;
    let measured = start + Duration::from_secs_f64(args.warmup_seconds).as_nanos() as u64;
    while unix_ns() < measured {
        workers.hear(Duration::from_nanos(measured.saturating_sub(unix_ns())))?;
    }
    let before = script_calls(url)?;
    while !workers.heard.iter().all(|h| h.done.is_some() || h.ended) {
        workers.hear(Duration::from_secs(60))?;
    }
    let after = script_calls(url)?;
    workers.finish()?;
    let mut run = SpeedRun {
        decisions: 0,
        denied: 0,
        errors: 0,
        hist: Histogram::new(),
        calls: after - before,
    };
    for id in 0..args.processes {
        let done = workers.done(id)?;
        let hist = workers.heard[id]
            .hist
            .as_ref()
            .ok_or("a worker sent no histogram")?;
        run.hist.merge(hist);
        run.denied += done.denied;
        run.errors += done.errors;
    }
    run.decisions = run.hist.total();
    let secs = args.seconds();
    println!(
        "lease_bench speed leases={} P={} T={} secs={secs:.1} decisions={} rate={:.0}/s \
         p50={:.2}us p99={:.2}us p999={:.2}us redis_calls={} calls_per_decision={:.6} \
         denied={} errors={}",
        if leased { "on" } else { "off" },
        args.processes,
        args.tasks,
        run.decisions,
        run.decisions as f64 / secs,
        run.hist.quantile_us(0.50),
        run.hist.quantile_us(0.99),
        run.hist.quantile_us(0.999),
        run.calls,
        run.calls as f64 / run.decisions.max(1) as f64,
        run.denied,
        run.errors,
    );
    Ok(run)
}

fn speed(args: &Args, url: &str) -> Result<(), BoxError> {
    let off = speed_run(args, url, false)?;
    let on = speed_run(args, url, true)?;
    let ratio = on.decisions as f64 / off.decisions.max(1) as f64;
    let per = on.calls as f64 / on.decisions.max(1) as f64;
    let p99 = on.hist.quantile_us(0.99);
    let met = |ok: bool| if ok { "met" } else { "MISSED" };
    println!(
        "lease_bench speed ratio={ratio:.1}x (target >= 10: {}) calls_per_decision={per:.6} \
         (target <= 0.01: {}) p99_leased={p99:.2}us (target <= 10: {})",
        met(ratio >= 10.0),
        met(per <= 0.01),
        met(p99 <= 10.0),
    );
    Ok(())
}

/// One run of `exact` or `crash`.
struct Limited {
    workers: Workers,
    /// The common start, ns on the system clock.
    start: u64,
    killed_at: Option<u64>,
    /// Script calls Redis counted from before the workers started to after they ended.
    calls: u64,
}

/// Runs `exact` or `crash` (killing worker 0 at `kill_after`).
fn limited_run(args: &Args, url: &str, kill_after: Option<f64>) -> Result<Limited, BoxError> {
    let prefix = new_prefix(args.mode.name());
    let before = script_calls(url)?;
    let mut workers = Workers::spawn(args, url, &prefix, !args.plain, None)?;
    let start = workers.start()?;
    let mut killed_at = None;
    if let Some(after) = kill_after {
        let at = start + (after * 1e9) as u64;
        while unix_ns() < at {
            workers.hear(Duration::from_nanos(at.saturating_sub(unix_ns())))?;
        }
        workers.children[0].kill()?;
        killed_at = Some(unix_ns());
    }
    workers.finish()?;
    Ok(Limited {
        workers,
        start,
        killed_at,
        calls: script_calls(url)? - before,
    })
}

fn exact(args: &Args, url: &str) -> Result<(), BoxError> {
    let Limited {
        workers,
        start,
        calls,
        ..
    } = limited_run(args, url, None)?;
    let dones: Vec<Done> = (0..args.processes)
        .map(|id| workers.done(id))
        .collect::<Result<_, _>>()?;
    let admitted: u64 = dones.iter().map(|d| d.admitted).sum();
    let last = dones.iter().map(|d| d.last_admit_ns).max().unwrap_or(start);
    let window = last.saturating_sub(start) as f64 / 1e9;
    let budget = f64::from(args.burst) + f64::from(args.rate) * window;
    let ratio = admitted as f64 / budget;
    let pass = admitted as f64 <= budget && ratio >= 0.95;
    println!(
        "lease_bench exact P={} T={} limit={}/s burst={} lease={} window={window:.6}s \
         admitted={admitted} budget={budget:.1} ratio={ratio:.4} per_worker={} held_at_end={} \
         denied={} redis_calls={calls} calls_per_admission={:.4} errors={} {}",
        args.processes,
        args.tasks,
        args.rate,
        args.burst,
        args.lease(),
        join(dones.iter().map(|d| d.admitted)),
        join(dones.iter().map(|d| d.held)),
        dones.iter().map(|d| d.denied).sum::<u64>(),
        calls as f64 / admitted.max(1) as f64,
        dones.iter().map(|d| d.errors).sum::<u64>(),
        if pass { "PASS" } else { "FAIL" },
    );
    Ok(())
}

fn crash(args: &Args, url: &str) -> Result<(), BoxError> {
    if args.processes < 2 {
        return Err("crash needs at least 2 processes".into());
    }
    if args.kill_after >= args.seconds() {
        return Err("--kill-after must come before the end of the run".into());
    }
    let Limited {
        workers,
        start,
        killed_at,
        calls,
    } = limited_run(args, url, Some(args.kill_after))?;
    let killed_at = killed_at.ok_or("no kill")?;
    let (seen, seen_at, killed_held) = workers.heard[0].last_count.unwrap_or((0, start, 0));
    // The killed worker's rate over what it reported, for what it may have admitted unseen.
    let alive = seen_at.saturating_sub(start).max(1) as f64 / 1e9;
    let gap = killed_at.saturating_sub(seen_at) as f64 / 1e9;
    let unseen = (seen as f64 / alive * gap).ceil();
    let survivors: Vec<Done> = (1..args.processes)
        .map(|id| workers.done(id))
        .collect::<Result<_, _>>()?;
    let admitted: u64 = survivors.iter().map(|d| d.admitted).sum();
    let held: u64 = survivors.iter().map(|d| d.held).sum();
    let last = survivors
        .iter()
        .map(|d| d.last_admit_ns)
        .max()
        .unwrap_or(start)
        .max(seen_at);
    let window = last.saturating_sub(start) as f64 / 1e9;
    let budget = f64::from(args.burst) + f64::from(args.rate) * window;
    let total = admitted + seen;
    let lost = budget - total as f64;
    let lease = u64::from(args.burst / 8);
    let bound = (lease + held) as f64 + unseen;
    let pass = total as f64 <= budget && lost <= bound;
    println!(
        "lease_bench crash P={} T={} limit={}/s burst={} lease={} killed=worker0 \
         at={:.3}s last_report_before_kill={:.3}ms killed_seen={seen} killed_held={killed_held} \
         unseen_at_most={unseen} \
         survivors={admitted} per_survivor={} total={total} window={window:.6}s \
         budget={budget:.1} lost={lost:.1} survivors_held_at_end={held} \
         bound=lease({lease})+held({held})+unseen({unseen})={bound:.1} redis_calls={calls} \
         errors={} {}",
        args.processes,
        args.tasks,
        args.rate,
        args.burst,
        args.lease(),
        killed_at.saturating_sub(start) as f64 / 1e9,
        gap * 1e3,
        join(survivors.iter().map(|d| d.admitted)),
        survivors.iter().map(|d| d.errors).sum::<u64>(),
        if pass { "PASS" } else { "FAIL" },
    );
    Ok(())
}

fn join(values: impl Iterator<Item = u64>) -> String {
    values.map(|v| v.to_string()).collect::<Vec<_>>().join(",")
}

// ---------------------------------------------------------------------------------------------
// nginx

/// `limit_req` runs in nginx's preaccess phase, after the rewrite phase where `return`
/// answers: a location that only returns is never limited, so the measured one serves a file.
fn nginx_conf(dir: &std::path::Path, port: u16) -> String {
    let d = dir.display();
    format!(
        "daemon off;
master_process off;
worker_processes 1;
error_log {d}/error.log warn;
pid {d}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {d}/body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    limit_req_zone $server_name zone=one:1m rate={NGINX_RATE}r/s;
    limit_req_zone $server_name zone=probe:1m rate={NGINX_RATE}r/s;
    limit_req_zone $server_name zone=returns:1m rate={NGINX_RATE}r/s;
    limit_req_status 429;
    keepalive_requests 1000000;
    server {{
        listen 127.0.0.1:{port};
        server_name lease_bench;
        root {d}/html;
        location = /ok {{ limit_req zone=one burst={NGINX_BURST} nodelay; }}
        location = /probe {{ limit_req zone=probe burst={NGINX_BURST} nodelay; try_files /ok =404; }}
        location = /returns {{ limit_req zone=returns burst={NGINX_BURST} nodelay; return 200; }}
    }}
}}
"
    )
}

/// 100 requests to `path` pipelined on one connection: how many were answered 200 and 429.
fn probe(port: u16, path: &str) -> Result<(usize, usize), BoxError> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    let mut requests = String::new();
    for i in 0..100 {
        let close = if i == 99 { "Connection: close\r\n" } else { "" };
        requests.push_str(&format!(
            "GET {path} HTTP/1.1\r\nHost: lease_bench\r\n{close}\r\n"
        ));
    }
    stream.write_all(requests.as_bytes())?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    Ok((
        answer.matches("HTTP/1.1 200").count(),
        answer.matches("HTTP/1.1 429").count(),
    ))
}

fn nginx(args: &Args, url: &str) -> Result<(), BoxError> {
    let dir = PathBuf::from(format!("/tmp/{}", new_prefix("nginx")));
    std::fs::create_dir_all(dir.join("html"))?;
    std::fs::write(dir.join("html/ok"), "ok\n")?;
    let port = free_port()?;
    std::fs::write(dir.join("nginx.conf"), nginx_conf(&dir, port))?;
    let child = Command::new(&args.nginx)
        .arg("-p")
        .arg(&dir)
        .arg("-c")
        .arg(dir.join("nginx.conf"))
        .arg("-e")
        .arg(dir.join("error.log"))
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("could not start {}: {e}", args.nginx))?;
    let _nginx = Server(child);
    let deadline = Instant::now() + Duration::from_secs(5);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            return Err("nginx did not listen".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let (file_ok, file_limited) = probe(port, "/probe")?;
    let (ret_ok, ret_limited) = probe(port, "/returns")?;
    println!(
        "lease_bench nginx probe: 100 pipelined requests: file location {file_ok}x200 \
         {file_limited}x429; return-200 location {ret_ok}x200 {ret_limited}x429"
    );

    let target = format!("http://127.0.0.1:{port}/ok");
    let prefix = new_prefix("nginx");
    let before = script_calls(url)?;
    let mut workers = Workers::spawn(args, url, &prefix, !args.plain, Some(&target))?;
    let start = workers.start()?;
    workers.finish()?;
    let calls = script_calls(url)? - before;
    let dones: Vec<Done> = (0..args.processes)
        .map(|id| workers.done(id))
        .collect::<Result<_, _>>()?;
    let sum = |f: fn(&Done) -> u64| dones.iter().map(f).sum::<u64>();
    let admitted = sum(|d| d.admitted);
    let (ok, limited, other) = (
        sum(|d| d.http_ok),
        sum(|d| d.http_limited),
        sum(|d| d.http_other),
    );
    let last = dones.iter().map(|d| d.last_admit_ns).max().unwrap_or(start);
    let window = last.saturating_sub(start) as f64 / 1e9;
    let budget = f64::from(NGINX_BURST) + f64::from(NGINX_RATE) * args.seconds();
    let ratio = ok as f64 / budget;
    let pass = limited == 0 && other == 0 && ratio >= 0.95;
    // When things first happened, in ms from the start: nginx's window opens with the first
    // request it sees, which is after the first admission by the time a GET takes.
    let first = |f: fn(&Done) -> u64| match dones.iter().map(f).min() {
        Some(at) if at != u64::MAX => format!("+{:.3}ms", at.saturating_sub(start) as f64 / 1e6),
        _ => "none".to_owned(),
    };
    let longest = dones.iter().map(|d| d.longest_get_ns).max().unwrap_or(0);
    println!(
        "lease_bench nginx P={} T={} limit={NGINX_RATE}/s burst={NGINX_BURST} lease={} \
         secs={:.1} window={window:.6}s admitted={admitted} http_200={ok} http_429={limited} \
         http_other={other} budget={budget:.0} ratio={ratio:.4} per_worker={} redis_calls={calls} \
         first_admission={} first_answer={} first_429={} longest_get={:.3}ms errors={} {}",
        args.processes,
        args.tasks,
        args.lease(),
        args.seconds(),
        join(dones.iter().map(|d| d.admitted)),
        first(|d| d.first_admit_ns),
        first(|d| d.first_answer_ns),
        first(|d| d.first_limited_ns),
        longest as f64 / 1e6,
        sum(|d| d.errors),
        if pass { "PASS" } else { "FAIL" },
    );
    drop(_nginx);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The histogram

/// Latencies in nanoseconds: exact below 32 ns, then 32 steps per power of two up to 2^40 ns.
struct Histogram {
    counts: Vec<u64>,
}

impl Histogram {
    const SUB_BITS: u32 = 5;
    const SUB: u64 = 1 << Self::SUB_BITS;
    const MAX_VALUE: u64 = (1 << 40) - 1;
    const BUCKETS: usize = (40 - Self::SUB_BITS as usize + 1) * Self::SUB as usize;

    fn new() -> Self {
        Self {
            counts: vec![0; Self::BUCKETS],
        }
    }

    fn index(value: u64) -> usize {
        let v = value.min(Self::MAX_VALUE);
        if v < Self::SUB {
            return v as usize;
        }
        let shift = v.ilog2() - Self::SUB_BITS;
        let sub = (v >> shift) & (Self::SUB - 1);
        ((u64::from(shift) + 1) * Self::SUB + sub) as usize
    }

    /// The largest value bucket `i` holds.
    fn upper(i: usize) -> u64 {
        let i = i as u64;
        if i < Self::SUB {
            return i;
        }
        let shift = i / Self::SUB - 1;
        ((Self::SUB + i % Self::SUB) << shift) + (1 << shift) - 1
    }

    fn record(&mut self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.counts[Self::index(ns)] += 1;
    }

    fn merge(&mut self, other: &Self) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
    }

    fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The `q` quantile in microseconds, as the upper edge of its bucket.
    fn quantile_us(&self, q: f64) -> f64 {
        let total = self.total();
        if total == 0 {
            return 0.0;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Self::upper(i) as f64 / 1e3;
            }
        }
        Self::upper(Self::BUCKETS - 1) as f64 / 1e3
    }

    /// The buckets that hold anything, as `index:count` pairs.
    fn encode(&self) -> String {
        let pairs: Vec<String> = self
            .counts
            .iter()
            .enumerate()
            .filter(|(_, c)| **c > 0)
            .map(|(i, c)| format!("{i}:{c}"))
            .collect();
        pairs.join(" ")
    }

    fn decode(text: &str) -> Result<Self, BoxError> {
        let mut h = Self::new();
        for pair in text.split_whitespace() {
            let (i, c) = pair.split_once(':').ok_or("a malformed histogram")?;
            let i: usize = i.parse()?;
            *h.counts.get_mut(i).ok_or("a bucket out of range")? += c.parse::<u64>()?;
        }
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_lands_in_a_bucket_whose_upper_edge_covers_it() {
        for v in (0..5_000).chain([1 << 20, (1 << 20) + 12_345, Histogram::MAX_VALUE]) {
            let i = Histogram::index(v);
            assert!(Histogram::upper(i) >= v, "{v}");
            assert!(i == 0 || Histogram::upper(i - 1) < v, "{v}");
        }
    }

    #[test]
    fn a_histogram_survives_its_line() {
        let mut h = Histogram::new();
        for ns in [5, 900, 900, 1_000_000] {
            h.record(Duration::from_nanos(ns));
        }
        let back = Histogram::decode(&h.encode()).expect("decodes");
        assert_eq!(back.counts, h.counts);
        assert_eq!(back.quantile_us(0.5), h.quantile_us(0.5));
    }
}
