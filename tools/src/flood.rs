//! A load client that checks the promise of `examples/axum_server.rs` from outside.
//!
//! Many concurrent clients send requests with one API key as fast as they can for a few seconds.
//! A token bucket that starts full admits `burst` at once and then `rate` per second, so over a
//! run whose responses span `elapsed` seconds the server should admit `burst + rate × elapsed`
//! requests, within a tolerance explained at [`tolerance`]. Every refusal must be a well-formed
//! 429: `Retry-After` in whole seconds, at least 1, `RateLimit-Policy` naming the limit, and a
//! `RateLimit` field whose `t=` agrees with `Retry-After`. Once the flood is over, a quiet check
//! asks until it is refused, sleeps exactly `Retry-After` seconds, and retries once: that retry
//! must be admitted.
//!
//! It uses nothing of burstgate on purpose. It is the independent side of the check: what it
//! expects (the count a token bucket admits, the headers a refusal carries) is worked out here
//! from the limit alone and read off the wire with its own parser, so that a mistake in the
//! crate's arithmetic or header formatting cannot also be in the check and pass it.
//!
//! ```sh
//! BIND=127.0.0.1:3000 cargo run --release --example axum_server --features tower &
//! cargo run --release -p burstgate-tools --bin flood -- --clients 64 --seconds 3
//! ```
//!
//! Options (each also read from the environment variable in capitals, the flag winning):
//! `--clients 64`, `--seconds 3`, `--url http://127.0.0.1:3000/`, `--key <a new key per run>`,
//! `--rate 10`, `--burst 10`. `--rate` and `--burst` must match the server's `RATE` and `BURST`.
//! The default key is new on every run, so the bucket starts full; a key reused within a refill
//! time of its last use starts partly empty, which the check reports.
//!
//! It exits with status 1 when the count is off, a header is wrong, the retry is refused, or any
//! request failed. Plain HTTP only; the requests go to `--url` and nowhere else.

use std::collections::BTreeMap;
use std::error::Error;
use std::fmt::Write as _;
use std::process;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use clap::builder::NonEmptyStringValueParser;
use reqwest::header::HeaderMap;
use reqwest::{Client, StatusCode};

/// No single request may take longer than this; it bounds every loop below.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// How many header violations are printed (all are counted).
const SHOWN_VIOLATIONS: usize = 5;

/// Floods a server limited per x-api-key with one key and checks what it admitted and how it
/// refused. Each option may also be set by the environment variable in capitals; the flag wins.
#[derive(Debug, Clone, Parser)]
#[command(name = "flood")]
struct Args {
    /// Concurrent clients, from 1 to 10000.
    #[arg(long, env = "CLIENTS", default_value_t = 64, value_parser = clients)]
    clients: usize,
    /// Length of the flood, above 0 and at most 3600.
    #[arg(long, env = "SECONDS", default_value_t = 3.0, value_parser = seconds)]
    seconds: f64,
    /// The server, plain http:// only.
    #[arg(long, env = "URL", default_value = "http://127.0.0.1:3000/", value_parser = plain_http)]
    url: String,
    /// The API key; by default a new one per run, so that the bucket starts full.
    #[arg(long, env = "KEY", default_value_t = new_key(), hide_default_value = true,
          value_parser = NonEmptyStringValueParser::new())]
    key: String,
    /// The server's rate per second (its RATE).
    #[arg(long, env = "RATE", default_value_t = 10, value_parser = at_least_one)]
    rate: u32,
    /// The server's burst (its BURST).
    #[arg(long, env = "BURST", default_value_t = 10, value_parser = at_least_one)]
    burst: u32,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let args = Args::parse();
    println!(
        "flood: {} clients for {} s on {} with key {:?}, expecting {} per second, burst {}",
        args.clients, args.seconds, args.url, args.key, args.rate, args.burst
    );

    let client = Client::builder()
        // Never send loopback traffic through a proxy named in the environment.
        .no_proxy()
        .timeout(REQUEST_TIMEOUT)
        .pool_max_idle_per_host(args.clients)
        .build()?;
    let args = Arc::new(args);

    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(args.seconds);
    let mut tasks = Vec::with_capacity(args.clients);
    for _ in 0..args.clients {
        let (client, args) = (client.clone(), Arc::clone(&args));
        tasks.push(tokio::spawn(hammer(client, args, deadline)));
    }
    let mut stats = Stats::default();
    for task in tasks {
        stats.merge(task.await?);
    }

    let retry = retry_check(&client, &args).await;
    let failed = report(&args, &stats, &retry);
    if failed {
        process::exit(1);
    }
    Ok(())
}

/// What one client saw; merged over all clients at the end.
#[derive(Debug, Default)]
struct Stats {
    admitted: u64,
    refused: u64,
    /// Responses other than 200 and 429, by status.
    other: BTreeMap<u16, u64>,
    /// Requests that got no response, and the first reason.
    errors: u64,
    first_error: Option<String>,
    violations: u64,
    shown: Vec<String>,
    /// First and last response received, over all requests.
    first: Option<Instant>,
    last: Option<Instant>,
    /// The longest time any request took, from sending to its response.
    max_latency: Duration,
    /// The highest `r=` an admitted response reported: `burst - 1` when the bucket started full.
    max_remaining: Option<u64>,
}

impl Stats {
    fn violation(&mut self, message: String) {
        self.violations += 1;
        if self.shown.len() < SHOWN_VIOLATIONS && !self.shown.contains(&message) {
            self.shown.push(message);
        }
    }

    fn merge(&mut self, other: Stats) {
        self.admitted += other.admitted;
        self.refused += other.refused;
        for (status, n) in other.other {
            *self.other.entry(status).or_default() += n;
        }
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
        self.violations += other.violations;
        for m in other.shown {
            if self.shown.len() < SHOWN_VIOLATIONS && !self.shown.contains(&m) {
                self.shown.push(m);
            }
        }
        self.first = min_opt(self.first, other.first);
        self.last = self.last.max(other.last);
        self.max_latency = self.max_latency.max(other.max_latency);
        self.max_remaining = self.max_remaining.max(other.max_remaining);
    }
}

fn min_opt(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// One client: requests back to back until the deadline. A request sent before the deadline is
/// counted whenever its response arrives. Stops at the first request that fails outright, so a
/// server that is down does not turn into a busy loop.
async fn hammer(client: Client, args: Arc<Args>, deadline: Instant) -> Stats {
    let mut stats = Stats::default();
    while Instant::now() < deadline {
        let sent = Instant::now();
        let result = client
            .get(&args.url)
            .header("x-api-key", &args.key)
            .send()
            .await;
        let response = match result {
            Ok(r) => r,
            Err(e) => {
                stats.errors += 1;
                stats.first_error.get_or_insert_with(|| error_chain(&e));
                break;
            }
        };
        let received = Instant::now();
        stats.first = min_opt(stats.first, Some(received));
        stats.last = Some(received);
        stats.max_latency = stats.max_latency.max(received - sent);

        let status = response.status();
        let headers = response.headers().clone();
        // Read the body so the connection goes back to the pool.
        if let Err(e) = response.bytes().await {
            stats.errors += 1;
            stats.first_error.get_or_insert_with(|| error_chain(&e));
            break;
        }
        match status {
            StatusCode::OK => {
                stats.admitted += 1;
                match check_admitted(&headers, &args) {
                    Ok(r) => stats.max_remaining = stats.max_remaining.max(Some(r)),
                    Err(v) => stats.violation(format!("200: {v}")),
                }
            }
            StatusCode::TOO_MANY_REQUESTS => {
                stats.refused += 1;
                if let Err(v) = check_refused(&headers, &args) {
                    stats.violation(format!("429: {v}"));
                }
            }
            other => *stats.other.entry(other.as_u16()).or_default() += 1,
        }
    }
    stats
}

/// An admitted response carries `RateLimit` with the tokens left, which is below the burst.
/// Returns its `r=`.
fn check_admitted(headers: &HeaderMap, args: &Args) -> Result<u64, String> {
    let (_, params) = single_item(headers, "ratelimit")?;
    let r = param(&params, "r", "ratelimit")?;
    param(&params, "t", "ratelimit")?;
    if r >= u64::from(args.burst) {
        return Err(format!(
            "ratelimit r={r} after taking a token from a bucket of {}",
            args.burst
        ));
    }
    Ok(r)
}

/// A refusal carries `Retry-After` (whole seconds, at least 1, at most one token period rounded
/// up, since a refused request of cost 1 waits for at most one token), `RateLimit-Policy` with the
/// expected quota and window, and `RateLimit` for the same policy with no whole token left
/// and `t=` equal to `Retry-After`.
fn check_refused(headers: &HeaderMap, args: &Args) -> Result<(), String> {
    let retry_after = retry_after(headers)?;
    if retry_after < 1 {
        return Err("retry-after is 0".into());
    }
    let token_period = 1000_u64.div_ceil(u64::from(args.rate)).div_ceil(1000);
    if retry_after > token_period {
        return Err(format!(
            "retry-after {retry_after} s is longer than one token period ({token_period} s)"
        ));
    }

    let (policy_name, policy) = single_item(headers, "ratelimit-policy")?;
    let q = param(&policy, "q", "ratelimit-policy")?;
    let w = param(&policy, "w", "ratelimit-policy")?;
    // The window is the refill time from empty in whole seconds, the quota what refills in it.
    let want_w = (u64::from(args.burst) * 1000)
        .div_ceil(u64::from(args.rate))
        .div_ceil(1000)
        .max(1);
    let want_q = (u64::from(args.rate) * want_w).max(u64::from(args.burst));
    if q != want_q || w != want_w {
        return Err(format!(
            "ratelimit-policy q={q};w={w}, expected q={want_q};w={want_w} (is the server's limit {} \
             per second, burst {}?)",
            args.rate, args.burst
        ));
    }

    let (name, params) = single_item(headers, "ratelimit")?;
    if name != policy_name {
        return Err(format!(
            "ratelimit names {name:?}, ratelimit-policy {policy_name:?}"
        ));
    }
    let r = param(&params, "r", "ratelimit")?;
    let t = param(&params, "t", "ratelimit")?;
    if r != 0 {
        return Err(format!("refused with ratelimit r={r} whole tokens left"));
    }
    if t != retry_after {
        return Err(format!("retry-after {retry_after} but ratelimit t={t}"));
    }
    Ok(())
}

/// `Retry-After` as whole seconds.
fn retry_after(headers: &HeaderMap) -> Result<u64, String> {
    let value = headers.get("retry-after").ok_or("no retry-after")?;
    let text = value.to_str().map_err(|_| "retry-after is not text")?;
    text.parse()
        .map_err(|_| format!("retry-after {text:?} is not whole seconds"))
}

/// The one item of a structured list field such as `"per-key";r=3;t=1`: its name and its
/// integer parameters.
fn single_item(
    headers: &HeaderMap,
    field: &str,
) -> Result<(String, Vec<(String, String)>), String> {
    let mut values = headers.get_all(field).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return Err(format!("expected one {field} field"));
    };
    let text = value.to_str().map_err(|_| format!("{field} is not text"))?;
    if text.contains(',') {
        return Err(format!(
            "{field} {text:?} has several items; the server has one rule"
        ));
    }
    let mut parts = text.split(';').map(str::trim);
    let name = parts
        .next()
        .and_then(|n| n.strip_prefix('"')?.strip_suffix('"'))
        .ok_or_else(|| format!("{field} {text:?} does not start with a quoted name"))?;
    let params = parts
        .map(|p| {
            p.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .ok_or_else(|| format!("{field} {text:?}: parameter {p:?} has no value"))
        })
        .collect::<Result<_, _>>()?;
    Ok((name.to_owned(), params))
}

/// The integer parameter `key` of an item.
fn param(params: &[(String, String)], key: &str, field: &str) -> Result<u64, String> {
    let (_, v) = params
        .iter()
        .find(|(k, _)| k == key)
        .ok_or_else(|| format!("{field} has no {key}="))?;
    v.parse()
        .map_err(|_| format!("{field} {key}={v} is not a whole number"))
}

/// The outcome of the quiet retry check.
#[derive(Debug)]
enum Retry {
    /// Refused after `admitted` admissions; after `slept` seconds the retry got `status`.
    Done {
        admitted: u32,
        slept: u64,
        status: StatusCode,
    },
    Failed(String),
}

/// After the flood, with nobody else spending the key's tokens: ask until refused, sleep exactly
/// `Retry-After` seconds, retry once. The layer promises that this retry is admitted.
async fn retry_check(client: &Client, args: &Args) -> Retry {
    // The bucket holds at most `burst` tokens and gains `rate` per second; this many requests
    // must meet a refusal unless the server is not limiting at all.
    let bound = u64::from(args.burst) + u64::from(args.rate) * REQUEST_TIMEOUT.as_secs() + 1;
    let give_up = Instant::now() + REQUEST_TIMEOUT;
    let mut admitted = 0;
    for _ in 0..bound {
        if Instant::now() > give_up {
            break;
        }
        let response = match send(client, args).await {
            Ok(r) => r,
            Err(e) => return Retry::Failed(e),
        };
        match response {
            (StatusCode::OK, _) => admitted += 1,
            (StatusCode::TOO_MANY_REQUESTS, headers) => {
                let slept = match retry_after(&headers) {
                    Ok(s) => s,
                    Err(e) => return Retry::Failed(e),
                };
                tokio::time::sleep(Duration::from_secs(slept)).await;
                return match send(client, args).await {
                    Ok((status, _)) => Retry::Done {
                        admitted,
                        slept,
                        status,
                    },
                    Err(e) => Retry::Failed(e),
                };
            }
            (status, _) => return Retry::Failed(format!("unexpected status {status}")),
        }
    }
    Retry::Failed(format!("never refused in {admitted} requests"))
}

/// One request with the key: its status and headers, the body read and dropped.
async fn send(client: &Client, args: &Args) -> Result<(StatusCode, HeaderMap), String> {
    let response = client
        .get(&args.url)
        .header("x-api-key", &args.key)
        .send()
        .await
        .map_err(|e| error_chain(&e))?;
    let status = response.status();
    let headers = response.headers().clone();
    response.bytes().await.map_err(|e| error_chain(&e))?;
    Ok((status, headers))
}

/// The tolerance on the admitted count, in tokens.
///
/// The server decides each request at its own clock, at some moment between the client sending
/// it and receiving the answer, so its admissions span the client's window from the first to
/// the last response give or take one request's latency at each end: at most
/// `rate × 2 × max_latency` tokens either way. On top of that, the bucket admits whole tokens
/// only, so at the end up to one token may be refilled but not yet taken: one more token.
/// `max_latency` is the longest any request took, measured, so a run on a loaded machine gets
/// the slack it needs and a quick one stays strict.
fn tolerance(rate: u32, max_latency: Duration) -> f64 {
    1.0 + f64::from(rate) * 2.0 * max_latency.as_secs_f64()
}

/// Prints the summary; returns whether the check failed.
fn report(args: &Args, stats: &Stats, retry: &Retry) -> bool {
    let mut failures = Vec::new();
    let elapsed = match (stats.first, stats.last) {
        (Some(first), Some(last)) => last - first,
        _ => Duration::ZERO,
    };
    let secs = elapsed.as_secs_f64();
    let expected = f64::from(args.burst) + f64::from(args.rate) * secs;
    let difference = stats.admitted as f64 - expected;
    let tolerance = tolerance(args.rate, stats.max_latency);

    println!("elapsed     {secs:.3} s (first to last response received)");
    println!("admitted    {}", stats.admitted);
    println!(
        "expected    {expected:.2} (burst {} + {} per second x {secs:.3} s)",
        args.burst, args.rate
    );
    println!(
        "difference  {difference:+.2} (allowed +/-{tolerance:.2}: one token + rate x 2 x max \
         latency {:.1} ms)",
        stats.max_latency.as_secs_f64() * 1000.0
    );
    println!("refused     {}", stats.refused);
    if stats.admitted == 0 {
        failures.push("nothing was admitted".to_owned());
    } else if difference.abs() > tolerance {
        failures.push(format!(
            "admitted {} but expected {expected:.2} +/- {tolerance:.2}",
            stats.admitted
        ));
    }
    if let Some(r) = stats.max_remaining
        && r + 1 < u64::from(args.burst)
    {
        failures.push(format!(
            "the bucket did not start full (highest r={r}, expected {}): reuse of --key?",
            args.burst - 1
        ));
    }

    let mut other = String::new();
    for (status, n) in &stats.other {
        let _ = write!(other, " {status}: {n}");
    }
    if !stats.other.is_empty() {
        println!("other       {}", other.trim_start());
        failures.push(format!("responses other than 200 and 429:{other}"));
    }
    if stats.errors > 0 {
        let first = stats.first_error.as_deref().unwrap_or("?");
        println!("errors      {} (first: {first})", stats.errors);
        failures.push(format!("{} requests failed", stats.errors));
    }

    println!(
        "headers     {} violations in {} responses",
        stats.violations,
        stats.admitted + stats.refused
    );
    for v in &stats.shown {
        println!("            {v}");
    }
    if stats.violations > 0 {
        failures.push(format!("{} header violations", stats.violations));
    }

    match retry {
        Retry::Done {
            admitted,
            slept,
            status,
        } => {
            println!(
                "retry       refused after {admitted} admitted, slept Retry-After {slept} s, \
                 retry answered {status}"
            );
            if *status != StatusCode::OK {
                failures.push(format!("the retry after Retry-After got {status}"));
            }
        }
        Retry::Failed(e) => {
            println!("retry       failed: {e}");
            failures.push(format!("retry check: {e}"));
        }
    }

    if failures.is_empty() {
        println!("result      PASS");
        false
    } else {
        println!("result      FAIL");
        for f in &failures {
            println!("            {f}");
        }
        true
    }
}

/// An error with its sources, which is where reqwest keeps the useful part.
fn error_chain(e: &dyn Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let _ = write!(out, ": {s}");
        source = s.source();
    }
    out
}

fn clients(value: &str) -> Result<usize, String> {
    value
        .parse()
        .ok()
        .filter(|n| (1..=10_000).contains(n))
        .ok_or_else(|| "must be a whole number from 1 to 10000".into())
}

fn seconds(value: &str) -> Result<f64, String> {
    value
        .parse::<f64>()
        .ok()
        .filter(|s| *s > 0.0 && *s <= 3600.0)
        .ok_or_else(|| "must be above 0 and at most 3600".into())
}

fn plain_http(value: &str) -> Result<String, String> {
    if value.starts_with("http://") {
        Ok(value.to_owned())
    } else {
        Err("must be plain http://".into())
    }
}

fn at_least_one(value: &str) -> Result<u32, String> {
    value
        .parse::<u32>()
        .ok()
        .filter(|n| *n >= 1)
        .ok_or_else(|| "must be a whole number of at least 1".into())
}

/// A key no earlier run used, so that the bucket starts full.
fn new_key() -> String {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    format!("flood-{}-{ms}", process::id())
}
