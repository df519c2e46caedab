// Over 600 lines: one program, whose modes share its workload, its tally and its printout.
//! Decisions per second and latency of a [`RedisStore`] shared by many tasks over one
//! multiplexed connection, and of the same script driven as `redis-benchmark` drives a
//! command, for comparing the two in one run.
//!
//! `--concurrency` tokio tasks share one [`MultiplexedConnection`] and take decisions of cost 1
//! back to back, each on a key drawn uniformly at random, first for `--warmup-seconds` (not
//! measured) and then for `--seconds`. A fraction `--deny` of the decisions are denials: the keys
//! are split into an "allow" set on a limit that always admits (2^32 − 1 per second) and a "deny"
//! set on 1 per hour, burst 1, whose buckets are emptied before the run; each decision picks the
//! deny set with probability `--deny`. A plain denial and an admission are the two paths a
//! decision can take through the script, so the mix decides how much Redis work a decision costs.
//!
//! ```sh
//! redis-server --port 6390 --save '' --appendonly no --daemonize no &
//! cargo run --release -p burstgate-tools --bin loadgen -- --url redis://127.0.0.1:6390/ \
//!     --concurrency 64 --keys 10000 --seconds 5 --deny 0.0
//! ```
//!
//! Options:
//!
//! - `--url` (or `REDIS_URL`; required, so a shared Redis is never written to by accident);
//!   `--concurrency 64`; `--keys 10000` (allow and deny sets together); `--seconds 5`;
//!   `--warmup-seconds 1`; `--deny 0.0` (0.0 to 1.0); `--prefix loadgen-<pid>-<ms>` (the key
//!   prefix; new on every run, so the deny set starts from buckets this run emptied).
//! - `--threads N`: tokio worker threads. The default is one per core; 1 runs everything on a
//!   current-thread runtime, which leaves the other cores to a Redis on the same machine.
//! - `--buffer N`: redis-rs's pipeline buffer (`set_pipeline_buffer_size`): how many calls the
//!   connection takes before it writes them, and so how many go to Redis in one write. The
//!   default here is half of `--concurrency` (at least 1), which splits the tasks into two groups
//!   that Redis and the client serve in turn; `--buffer 50` is redis-rs's own default, under
//!   which all the tasks move as one group. See "Redis speed" in docs/PERFORMANCE.md.
//! - `--raw`: the same script and keys through redis-rs alone, with no store in between: what
//!   the store adds on the client. The command and the reading of its reply are the store's
//!   own (`burstgate::__private::raw`), so that this mode can never drift from the format the
//!   script speaks.
//! - `--pipeline P`: the same script and keys the way `redis-benchmark -c C -P P` drives a
//!   command: each of the C tasks has a TCP connection of its own and keeps P calls in flight,
//!   the store's own commands written by the batch and the replies framed by hand.
//!   `--pipeline 1` is the figure to compare with `redis-benchmark -P 1`, and `--pipeline 16` is
//!   the ceiling of this Redis for the script. (`redis-benchmark` itself cannot send the
//!   script's argument: it is 72 bytes of packed doubles, and `redis-benchmark` cuts every
//!   argument at its first zero byte.) It needs database 0 of a Redis with no password.
//! - `--deny-cache`: turns the store's local deny cache on. It is off by default here, so that
//!   every decision measures the script.
//! - `--flood N`: every decision on one key limited to N per second with a burst of N, instead
//!   of the allow and deny sets. With the deny cache on, a flood far over its limit is answered
//!   mostly in this process:
//!
//! ```sh
//! cargo run --release -p burstgate-tools --bin loadgen -- --url redis://127.0.0.1:6390/ \
//!     --concurrency 64 --flood 1000 --deny-cache
//! ```
//!
//! It prints one line:
//!
//! ```text
//! loadgen C=64 keys=10000 deny=0.00 secs=5.0 decisions=912345 denied=0.000 errors=0
//!   rate=182469/s p50=342.1us p99=601.3us p999=812.0us redis_calls=912345
//!   redis_usec_per_call=4.51 redis_calls_per_decision=1.0000 deny_cache=false raw=false
//!   buffer=32
//! ```
//!
//! (on one line; with `--pipeline`, `pipeline=P` takes the place of `buffer=N`). Latency is per
//! decision, from the call to `acquire` to its answer (with `--pipeline`, from writing a batch
//! to reading its last reply), recorded in a log-linear histogram (64 steps per power of two, so
//! quantiles are within 1.6 %). `redis_calls` and `redis_usec_per_call` are the server's `INFO commandstats`
//! for `evalsha` and `eval` together, taken as the difference between before and after the
//! measured run: the Redis CPU time per script call, which sets the ceiling of one Redis. Other
//! clients of the same server count too, so measure on a Redis of your own.
//!
//! One comparison, in one run on one Redis:
//!
//! ```sh
//! for c in 1 16 64 256; do
//!   for mode in "--pipeline 1" "--pipeline 16" "--threads 1" "--threads 1 --buffer 50" \
//!       "--threads 1 --raw"; do
//!     cargo run -q --release -p burstgate-tools --bin loadgen -- --url redis://127.0.0.1:6390/ \
//!         --concurrency $c --seconds 3 $mode
//!   done
//! done
//! ```

use std::error::Error;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use burstgate::__private::raw::{self, Acquire};
use burstgate::redis::aio::MultiplexedConnection;
use burstgate::redis::{self, AsyncConnectionConfig, Value};
use burstgate::{BucketKey, BucketStore, Limit, RedisStore};
use clap::builder::NonEmptyStringValueParser;
use clap::{CommandFactory, Parser};

/// Generous, so that a loaded Redis shows up as latency rather than as errors.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);

type BoxError = Box<dyn Error + Send + Sync>;

/// Decisions per second, latency and Redis CPU time per call of a RedisStore shared by many
/// tasks, or of its script driven other ways.
#[derive(Parser)]
#[command(name = "loadgen")]
struct Args {
    /// The Redis to run on; required, so that a shared Redis is never written to by accident.
    #[arg(long, env = "REDIS_URL", value_parser = NonEmptyStringValueParser::new())]
    url: String,
    /// Tasks taking decisions at once.
    #[arg(long, default_value_t = 64, value_parser = at_least_one)]
    concurrency: usize,
    /// Keys, the allow and deny sets together.
    #[arg(long, default_value_t = 10_000)]
    keys: usize,
    /// Length of the measured run.
    #[arg(long, default_value_t = 5.0, value_parser = positive_seconds)]
    seconds: f64,
    /// Length of the run before it, not measured.
    #[arg(long, default_value_t = 1.0, value_parser = seconds_or_zero)]
    warmup_seconds: f64,
    /// Fraction of the decisions that go to the deny set, from 0.0 to 1.0.
    #[arg(long, default_value_t = 0.0, value_parser = fraction)]
    deny: f64,
    /// Key prefix; by default loadgen-<pid>-<ms>, new on every run, so the deny set starts from
    /// buckets this run emptied.
    #[arg(long)]
    prefix: Option<String>,
    /// Turns the store's deny cache on (off here, so that every decision measures the script).
    #[arg(long)]
    deny_cache: bool,
    /// Every decision on one key limited to PER_SECOND per second with a burst of as many.
    #[arg(long, value_name = "PER_SECOND")]
    flood: Option<u32>,
    /// The same script and keys through redis-rs alone, with no store in between.
    #[arg(long)]
    raw: bool,
    /// The script as `redis-benchmark -P P` drives a command: a connection per task, P calls in
    /// flight on each.
    #[arg(long, value_name = "P", value_parser = at_least_one)]
    pipeline: Option<usize>,
    /// Tokio worker threads; 0 for one per core, 1 for a current-thread runtime.
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// redis-rs's pipeline buffer; half of --concurrency (at least 1) by default.
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    buffer: Option<usize>,
}

impl Args {
    /// `--buffer`, or half the tasks: two groups, each written while Redis serves the other.
    fn buffer(&self) -> usize {
        self.buffer.unwrap_or((self.concurrency / 2).max(1))
    }

    /// `--prefix`, or one no earlier run used.
    fn prefix(&self) -> String {
        self.prefix.clone().unwrap_or_else(|| {
            let millis = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis());
            format!("loadgen-{}-{millis}", std::process::id())
        })
    }
}

fn at_least_one(value: &str) -> Result<usize, String> {
    match value.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
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

fn fraction(value: &str) -> Result<f64, String> {
    let f: f64 = value.parse().map_err(|e| format!("{e}"))?;
    if (0.0..=1.0).contains(&f) {
        Ok(f)
    } else {
        Err("must be between 0.0 and 1.0".into())
    }
}

fn parse_args() -> Args {
    let args = Args::parse();
    // Each set in use needs a key of its own.
    let sets_needed = 1 + usize::from(args.deny > 0.0 && args.deny < 1.0);
    if args.keys < sets_needed {
        Args::command()
            .error(
                clap::error::ErrorKind::ValueValidation,
                format!("--keys must be at least {sets_needed} for this --deny"),
            )
            .exit();
    }
    args
}

/// The keys and limits a run spends.
struct Workload {
    allow: Vec<BucketKey>,
    allow_limit: Limit,
    deny: Vec<BucketKey>,
    deny_limit: Limit,
    /// The probability of a decision going to the deny set, scaled to `u64`.
    deny_threshold: u64,
    /// `--flood`: the one key and its limit, instead of the two sets.
    flood: Option<(BucketKey, Limit)>,
}

impl Workload {
    fn new(keys: usize, deny: f64, flood: Option<u32>) -> Result<Self, BoxError> {
        let flood = match flood {
            Some(n) => Some((
                BucketKey::new("flood", "one-key")?,
                Limit::per_second(n)?.with_burst(n)?,
            )),
            None => None,
        };
        // The deny set gets its share of the keys, and at least one key when it is used at all.
        let mut deny_keys = (keys as f64 * deny).round() as usize;
        if deny > 0.0 {
            deny_keys = deny_keys.max(1);
        }
        if deny < 1.0 {
            deny_keys = deny_keys.min(keys - 1);
        }
        let allow = (0..keys - deny_keys)
            .map(|i| BucketKey::new("allow", format!("client-{i}")))
            .collect::<Result<_, _>>()?;
        let deny_set = (0..deny_keys)
            .map(|i| BucketKey::new("deny", format!("client-{i}")))
            .collect::<Result<_, _>>()?;
        let deny_threshold = if deny >= 1.0 {
            u64::MAX
        } else {
            (deny * u64::MAX as f64) as u64
        };
        Ok(Self {
            allow,
            allow_limit: Limit::per_second(u32::MAX)?,
            deny: deny_set,
            deny_limit: Limit::per_hour(1)?.with_burst(1)?,
            deny_threshold,
            flood,
        })
    }

    /// The next decision's key and limit, and whether it should be a denial (`None` for a
    /// flood, where the rate decides).
    fn pick(&self, rng: &mut Rng) -> (&BucketKey, Limit, Option<bool>) {
        if let Some((key, limit)) = &self.flood {
            return (key, *limit, None);
        }
        let r = rng.next();
        if r < self.deny_threshold || self.allow.is_empty() {
            (
                &self.deny[rng.below(self.deny.len())],
                self.deny_limit,
                Some(true),
            )
        } else {
            (
                &self.allow[rng.below(self.allow.len())],
                self.allow_limit,
                Some(false),
            )
        }
    }
}

/// xorshift64*: enough randomness to spread keys, with no dependency and no allocation.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        // SplitMix64 of the seed, so that nearby seeds give unrelated streams; never zero.
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Self((z ^ (z >> 31)) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (Lemire's multiply-shift; the bias is below 2^-40 for our `n`).
    fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next()) * n as u128) >> 64) as usize
    }
}

/// Latencies in nanoseconds: exact below 64 ns, then 64 buckets per power of two up to 2^37 ns
/// (about 137 s; anything longer lands in the last bucket).
struct Histogram {
    counts: Box<[u64; Self::BUCKETS]>,
}

impl Histogram {
    const SUB_BITS: u32 = 6;
    const SUB: u64 = 1 << Self::SUB_BITS;
    const MAX_VALUE: u64 = (1 << 37) - 1;
    const BUCKETS: usize = ((37 - Self::SUB_BITS as usize) + 1) * Self::SUB as usize;

    fn new() -> Self {
        Self {
            counts: Box::new([0; Self::BUCKETS]),
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

    /// The middle of bucket `i`'s range.
    fn value(i: usize) -> f64 {
        let i = i as u64;
        if i < Self::SUB {
            return i as f64;
        }
        let shift = i / Self::SUB - 1;
        let low = (Self::SUB + i % Self::SUB) << shift;
        low as f64 + ((1_u64 << shift) as f64 - 1.0) / 2.0
    }

    fn record(&mut self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.counts[Self::index(ns)] += 1;
    }

    fn merge(&mut self, other: &Self) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += b;
        }
    }

    fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The `q` quantile in microseconds (the least value with at least `q` of the calls at or
    /// below it); zero for an empty histogram.
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
                return Self::value(i) / 1000.0;
            }
        }
        Self::value(Self::BUCKETS - 1) / 1000.0
    }
}

/// What one task saw.
struct Tally {
    latencies: Histogram,
    denied: u64,
    /// Decisions that went the other way than their set promises (an allow-set denial or a
    /// deny-set admission): zero unless the workload is broken.
    surprises: u64,
    errors: u64,
    first_error: Option<String>,
}

impl Tally {
    fn new() -> Self {
        Self {
            latencies: Histogram::new(),
            denied: 0,
            surprises: 0,
            errors: 0,
            first_error: None,
        }
    }

    /// Counts one answer: admitted or not, or the error's text; `should_deny` is what the
    /// decision's key set promises.
    fn count(&mut self, answer: Result<bool, String>, should_deny: Option<bool>) {
        match answer {
            Ok(admitted) => {
                let denied = !admitted;
                self.denied += u64::from(denied);
                self.surprises += u64::from(should_deny.is_some_and(|d| d != denied));
            }
            Err(message) => {
                self.errors += 1;
                if self.first_error.is_none() {
                    self.first_error = Some(message);
                }
            }
        }
    }
}

/// What takes the decisions: the store, or (`--raw`) the same script through redis-rs alone.
#[derive(Clone)]
enum Driver {
    Store(RedisStore<MultiplexedConnection>),
    Raw {
        store: RedisStore<MultiplexedConnection>,
        conn: MultiplexedConnection,
    },
    /// `--pipeline`: connections of its own, see [`pipelined_worker`].
    Pipelined {
        store: RedisStore<MultiplexedConnection>,
        addr: (String, u16),
        depth: usize,
    },
}

impl Driver {
    /// One decision of cost 1: whether it was admitted.
    async fn decide(&mut self, key: &BucketKey, limit: Limit) -> Result<bool, BoxError> {
        match self {
            Self::Store(store) => Ok(store
                .acquire(key, limit, 1, Duration::ZERO)
                .await?
                .is_admitted()),
            Self::Pipelined { .. } => Err("a pipelined driver runs its own loop".into()),
            Self::Raw { store, conn } => {
                // What a client of the script does with no store around it: the store's own
                // command, sent as it is, and its reply read as the store reads it.
                let acquire = Acquire::new(limit, 1, Duration::ZERO)?;
                let now = now_ms()?;
                let reply: Value = acquire.command(store, key, now).query_async(conn).await?;
                Ok(acquire.admitted(&reply, now)?)
            }
        }
    }
}

/// The wall clock in milliseconds since the Unix epoch, as the store's clock reads it.
fn now_ms() -> Result<u64, BoxError> {
    Ok(SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() as u64)
}

/// `--pipeline P`: what `redis-benchmark -P P` measures, for this script's own command: each of
/// the `concurrency` tasks has a TCP connection of its own, writes P calls at once and reads
/// the P replies, with the RESP framing done by hand so the client costs as little as it can.
/// The rate it reaches is the ceiling of this Redis for the script.
async fn pipelined_worker(
    addr: (String, u16),
    store: RedisStore<MultiplexedConnection>,
    work: Arc<Workload>,
    depth: usize,
    seed: u64,
    deadline: Instant,
) -> Result<Tally, BoxError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let mut rng = Rng::new(seed);
    let mut tally = Tally::new();
    let mut out = Vec::with_capacity(depth * 256);
    let mut expected = Vec::with_capacity(depth);
    let mut input = Vec::with_capacity(depth * 64);
    let mut start = Instant::now();
    while start < deadline {
        out.clear();
        expected.clear();
        let now = now_ms()?;
        for _ in 0..depth {
            let (key, limit, should_deny) = work.pick(&mut rng);
            let acquire = Acquire::new(limit, 1, Duration::ZERO)?;
            acquire
                .command(&store, key, now)
                .write_packed_command(&mut out);
            expected.push((acquire, should_deny));
        }
        stream.write_all(&out).await?;
        let mut read = 0;
        let mut parsed = 0;
        input.clear();
        while parsed < depth {
            match next_reply(&input[read..])? {
                Some((reply, used)) => {
                    read += used;
                    let (acquire, should_deny) = expected[parsed];
                    let answer = reply
                        .and_then(|reply| acquire.admitted(&reply, now).map_err(|e| e.to_string()));
                    tally.count(answer, should_deny);
                    parsed += 1;
                }
                None => {
                    let mut chunk = [0; 16 * 1024];
                    let n = stream.read(&mut chunk).await?;
                    if n == 0 {
                        return Err("the server closed the connection".into());
                    }
                    input.extend_from_slice(&chunk[..n]);
                }
            }
        }
        let end = Instant::now();
        for _ in 0..depth {
            tally.latencies.record(end - start);
        }
        start = end;
    }
    Ok(tally)
}

/// One reply (the value, or an error's text) and the bytes it took.
type Parsed = (Result<Value, String>, usize);

/// The first RESP reply in `buf`, if it is all there, and how many bytes it took. Only the
/// shapes the script answers with are read: a bulk string, an array of them, and an error.
fn next_reply(buf: &[u8]) -> Result<Option<Parsed>, BoxError> {
    let Some(eol) = buf.windows(2).position(|w| w == b"\r\n") else {
        return Ok(None);
    };
    let line = &buf[1..eol];
    match buf.first() {
        Some(b'$') => {
            let len: usize = std::str::from_utf8(line)?.parse()?;
            let end = eol + 2 + len + 2;
            if buf.len() < end {
                return Ok(None);
            }
            let bytes = buf[eol + 2..eol + 2 + len].to_vec();
            Ok(Some((Ok(Value::BulkString(bytes)), end)))
        }
        Some(b'*') => {
            let n: usize = std::str::from_utf8(line)?.parse()?;
            let mut used = eol + 2;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                match next_reply(&buf[used..])? {
                    Some((Ok(item), len)) => {
                        items.push(item);
                        used += len;
                    }
                    Some((Err(_), _)) => return Err("an error inside an array".into()),
                    None => return Ok(None),
                }
            }
            Ok(Some((Ok(Value::Array(items)), used)))
        }
        Some(b'-') => Ok(Some((
            Err(String::from_utf8_lossy(line).into_owned()),
            eol + 2,
        ))),
        _ => Err(format!(
            "unexpected reply {:?}",
            String::from_utf8_lossy(&buf[..eol])
        )
        .into()),
    }
}

/// One task: decisions back to back until `deadline`.
async fn worker(mut driver: Driver, work: Arc<Workload>, seed: u64, deadline: Instant) -> Tally {
    let mut rng = Rng::new(seed);
    let mut tally = Tally::new();
    let mut start = Instant::now();
    while start < deadline {
        let (key, limit, should_deny) = work.pick(&mut rng);
        let result = driver.decide(key, limit).await;
        let end = Instant::now();
        tally.latencies.record(end - start);
        tally.count(result.map_err(|e| e.to_string()), should_deny);
        start = end;
    }
    tally
}

/// `concurrency` tasks until `seconds` from now; the merged tally and the wall time taken.
async fn round(
    driver: &Driver,
    work: &Arc<Workload>,
    concurrency: usize,
    seconds: f64,
    seed: u64,
) -> Result<(Tally, Duration), BoxError> {
    let started = Instant::now();
    let deadline = started + Duration::from_secs_f64(seconds);
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let seed = seed.wrapping_add(t as u64);
            let work = Arc::clone(work);
            match driver.clone() {
                Driver::Pipelined { store, addr, depth } => {
                    tokio::spawn(pipelined_worker(addr, store, work, depth, seed, deadline))
                }
                driver => tokio::spawn(async move {
                    Ok::<_, BoxError>(worker(driver, work, seed, deadline).await)
                }),
            }
        })
        .collect();
    let mut all = Tally::new();
    for task in tasks {
        let tally = task.await??;
        all.latencies.merge(&tally.latencies);
        all.denied += tally.denied;
        all.surprises += tally.surprises;
        all.errors += tally.errors;
        if all.first_error.is_none() {
            all.first_error = tally.first_error;
        }
    }
    Ok((all, started.elapsed()))
}

/// Empties every bucket of the deny set (1 per hour, burst 1: one admission empties it), with
/// `concurrency` tasks.
async fn drain_deny_set(
    store: &RedisStore<MultiplexedConnection>,
    work: &Arc<Workload>,
    concurrency: usize,
) -> Result<(), BoxError> {
    let tasks: Vec<_> = (0..concurrency)
        .map(|t| {
            let store = store.clone();
            let work = Arc::clone(work);
            tokio::spawn(async move {
                for key in work.deny.iter().skip(t).step_by(concurrency) {
                    let _emptied = store
                        .acquire(key, work.deny_limit, 1, Duration::ZERO)
                        .await?;
                    let after = store
                        .acquire(key, work.deny_limit, 1, Duration::ZERO)
                        .await?;
                    if after.is_admitted() {
                        return Err(format!("deny-set key {key:?} still admits").into());
                    }
                }
                Ok::<(), BoxError>(())
            })
        })
        .collect();
    for task in tasks {
        task.await??;
    }
    Ok(())
}

/// `(calls, usec)` of `evalsha` and `eval` together from `INFO commandstats`; zeros for a
/// command that has not run yet.
async fn evalsha_stats(conn: &mut MultiplexedConnection) -> Result<(u64, u64), BoxError> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await?;
    let (mut calls, mut usec) = (0, 0);
    for line in info.lines().filter_map(|l| {
        l.strip_prefix("cmdstat_evalsha:")
            .or_else(|| l.strip_prefix("cmdstat_eval:"))
    }) {
        let field = |name: &str| -> Result<u64, BoxError> {
            let value = line
                .split(',')
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                .ok_or_else(|| format!("no {name} in INFO commandstats line {line:?}"))?;
            Ok(value.parse()?)
        };
        calls += field("calls")?;
        usec += field("usec")?;
    }
    Ok((calls, usec))
}

fn main() -> Result<(), BoxError> {
    let args = parse_args();
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
    runtime.block_on(run(args))
}

async fn run(args: Args) -> Result<(), BoxError> {
    let client = redis::Client::open(args.url.as_str())?;
    let mut config = AsyncConnectionConfig::new().set_response_timeout(Some(RESPONSE_TIMEOUT));
    config = config.set_pipeline_buffer_size(args.buffer());
    let mut conn = client
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    let store = RedisStore::new(conn.clone())
        .prefix(&args.prefix())?
        .timeout(RESPONSE_TIMEOUT)
        .deny_cache(args.deny_cache);
    let work = Arc::new(Workload::new(args.keys, args.deny, args.flood)?);

    drain_deny_set(&store, &work, args.concurrency).await?;
    let driver = if args.raw || args.pipeline.is_some() {
        // The store's command runs the script by its SHA-1 alone.
        raw::script().load_async(&mut conn).await?;
        match args.pipeline {
            Some(depth) => {
                let info = client.get_connection_info();
                let redis::ConnectionAddr::Tcp(host, port) = info.addr() else {
                    return Err("--pipeline needs a plain redis://host:port/ URL".into());
                };
                if info.redis_settings().password().is_some() || info.redis_settings().db() != 0 {
                    return Err(
                        "--pipeline sends neither AUTH nor SELECT: use database 0 of a \
                                Redis with no password"
                            .into(),
                    );
                }
                Driver::Pipelined {
                    store: store.clone(),
                    addr: (host.clone(), *port),
                    depth,
                }
            }
            None => Driver::Raw {
                store: store.clone(),
                conn: conn.clone(),
            },
        }
    } else {
        Driver::Store(store.clone())
    };
    let seed = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    if args.warmup_seconds > 0.0 {
        let (warm, _) = round(&driver, &work, args.concurrency, args.warmup_seconds, seed).await?;
        if let Some(e) = warm.first_error {
            return Err(format!("{} errors during the warmup, the first: {e}", warm.errors).into());
        }
    }

    let (calls_before, usec_before) = evalsha_stats(&mut conn).await?;
    let (tally, elapsed) = round(
        &driver,
        &work,
        args.concurrency,
        args.seconds,
        seed ^ 0x5555_5555_5555_5555,
    )
    .await?;
    let (calls_after, usec_after) = evalsha_stats(&mut conn).await?;

    let decisions = tally.latencies.total();
    let calls = calls_after.saturating_sub(calls_before);
    let usec_per_call = if calls == 0 {
        "na".to_owned()
    } else {
        format!(
            "{:.2}",
            usec_after.saturating_sub(usec_before) as f64 / calls as f64
        )
    };
    println!(
        "loadgen C={} keys={} deny={:.2} secs={:.1} decisions={} denied={:.3} errors={} \
         rate={:.0}/s p50={:.1}us p99={:.1}us p999={:.1}us redis_calls={} redis_usec_per_call={} \
         redis_calls_per_decision={:.4}{}{}",
        args.concurrency,
        args.keys,
        args.deny,
        elapsed.as_secs_f64(),
        decisions,
        tally.denied as f64 / decisions.max(1) as f64,
        tally.errors,
        decisions as f64 / elapsed.as_secs_f64(),
        tally.latencies.quantile_us(0.50),
        tally.latencies.quantile_us(0.99),
        tally.latencies.quantile_us(0.999),
        calls,
        usec_per_call,
        calls as f64 / decisions.max(1) as f64,
        match args.flood {
            Some(n) => format!(
                " flood={n}/s deny_cache={} raw={}",
                args.deny_cache, args.raw
            ),
            None => format!(" deny_cache={} raw={}", args.deny_cache, args.raw),
        },
        match args.pipeline {
            Some(p) => format!(" pipeline={p}"),
            None => format!(" buffer={}", args.buffer()),
        },
    );

    if let Some(e) = tally.first_error {
        return Err(format!("{} decisions failed, the first: {e}", tally.errors).into());
    }
    if tally.surprises > 0 {
        return Err(format!(
            "{} decisions went against their key set (an allow-set denial or a deny-set \
             admission)",
            tally.surprises
        )
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every reply `next_reply` finds in `buf`, read as the pipelined worker reads them.
    fn replies(buf: &[u8]) -> Vec<Result<Value, String>> {
        let mut found = Vec::new();
        let mut read = 0;
        while let Some((reply, used)) = next_reply(&buf[read..]).expect("well-formed") {
            found.push(reply);
            read += used;
        }
        assert_eq!(read, buf.len(), "every byte belongs to a reply");
        found
    }

    #[test]
    fn the_shapes_the_script_answers_with_are_framed_whole() {
        let stored = [7_u8, 0, 13, 10, 13, 10, 1, 2];
        let mut buf = b"$8\r\n".to_vec();
        buf.extend_from_slice(&stored);
        buf.extend_from_slice(b"\r\n*1\r\n$8\r\n");
        buf.extend_from_slice(&stored);
        buf.extend_from_slice(b"\r\n-NOSCRIPT No matching script\r\n");
        assert_eq!(
            replies(&buf),
            [
                Ok(Value::BulkString(stored.to_vec())),
                Ok(Value::Array(vec![Value::BulkString(stored.to_vec())])),
                Err("NOSCRIPT No matching script".to_owned()),
            ]
        );
    }

    #[test]
    fn a_reply_cut_short_waits_for_the_rest() {
        let whole = b"*1\r\n$3\r\nabc\r\n";
        for cut in 0..whole.len() {
            assert!(
                next_reply(&whole[..cut]).expect("a prefix").is_none(),
                "{cut}"
            );
        }
        assert!(
            next_reply(b":1\r\n").is_err(),
            "not a shape the script answers with"
        );
    }
}
