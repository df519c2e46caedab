//! The commands: what each asks of Redis and what it reports, as text and as JSON.
//!
//! - `bucket.rs`: the commands on one bucket, `inspect`, `reset`, `set`, `block`, `unblock`;
//! - `top.rs`: the busiest buckets under the prefix;
//! - `audit.rs`: a bucket's audit trail, through the reader in `crate::audit`.

use std::time::{Duration, SystemTime};

use burstgate::redis;
use burstgate::{BucketKey, BucketName, BucketState, BucketStore, Limit, RedisStore};
use serde::Serialize;

use crate::args::{Cli, Command, KeyArgs};
use crate::connect::Conn;
use crate::error::{self, CliError};
use crate::keys::{self, Form, Scheme};
use crate::span;

mod audit;
mod bucket;
mod top;

/// What a command reports: one JSON document, or lines of text for a person, and notes for
/// standard error.
#[derive(Debug)]
pub(crate) struct Report {
    pub(crate) json: String,
    pub(crate) text: String,
    pub(crate) notes: Vec<String>,
}

/// What every command works with.
struct Ctx {
    conn: Conn,
    store: RedisStore<Conn>,
    /// Where the buckets' keys are.
    buckets: Scheme,
    prefix: String,
    /// Whether fingerprints are keyed with the application's secret.
    keyed: bool,
}

/// The note for output that shows this run's fingerprints without the application's secret.
const SALTED: &str = "no application secret given (--secret-env VAR): the fingerprints shown are \
                      this run's own, and do not match the application's logs";

/// Runs the command line's command.
pub(crate) async fn run(cli: Cli) -> Result<Report, CliError> {
    let global = &cli.global;
    let key_args = match &cli.command {
        Command::Inspect { key, .. }
        | Command::Reset { key, .. }
        | Command::Set { key, .. }
        | Command::Block { key, .. }
        | Command::Unblock { key, .. }
        | Command::Audit { key, .. } => Some(key),
        Command::Top { .. } => None,
    };
    let keyed = keys::key_fingerprints(global.secret_env.as_deref(), key_args)?;
    let conn = Conn::open(&global.redis_url, global.cluster, global.timeout).await?;
    let store = RedisStore::new(conn.clone())
        .prefix(&global.prefix)?
        .timeout(global.timeout);
    let mut notes = Vec::new();
    if !shared_time(&store, global.timeout).await {
        notes.push(
            "could not read Redis's clock: times here are this machine's, which may differ from \
             the application's"
                .to_owned(),
        );
    }
    let ctx = Ctx {
        buckets: Scheme::buckets(&store),
        conn,
        store,
        prefix: global.prefix.clone(),
        keyed,
    };
    let mut report = match cli.command {
        Command::Inspect { bucket, key, limit } => {
            bucket::inspect(&ctx, &bucket, &key, limit.limit).await?
        }
        Command::Reset { bucket, key } => bucket::reset(&ctx, &bucket, &key).await?,
        Command::Set {
            bucket,
            key,
            limit,
            remaining,
        } => bucket::set(&ctx, &bucket, &key, limit.limit, remaining).await?,
        Command::Block {
            bucket,
            key,
            limit,
            span,
        } => bucket::block(&ctx, &bucket, &key, limit.limit, span).await?,
        Command::Unblock { bucket, key, limit } => {
            bucket::unblock(&ctx, &bucket, &key, limit.limit).await?
        }
        Command::Top {
            bucket,
            limits,
            count,
        } => top::top(&ctx, bucket.as_ref(), &limits, count).await?,
        Command::Audit {
            bucket,
            key,
            since,
            count,
        } => audit::audit(&ctx, &bucket, &key, since, count).await?,
    };
    notes.append(&mut report.notes);
    report.notes = notes;
    Ok(report)
}

/// Waits, up to `within` (and a second at most), for the store's clock to measure Redis's, so
/// that "now" is the time the application's stores count. False when it could not.
async fn shared_time(store: &RedisStore<Conn>, within: Duration) -> bool {
    // Reading the clock starts its measurements.
    let _ = store.now();
    let deadline = tokio::time::Instant::now() + within.min(Duration::from_secs(1));
    while !store.clock().is_measured() {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    true
}

/// The key `args` name in `bucket`, and how: made from the caller's key as the application makes
/// it, or found in Redis by its fingerprint.
async fn target(
    ctx: &Ctx,
    scheme: &Scheme,
    bucket: &BucketName,
    args: &KeyArgs,
) -> Result<(BucketKey, Form), CliError> {
    if let Some(fp) = &args.fingerprint {
        let fp = keys::fingerprint(fp)?;
        if !ctx.keyed {
            return Err(CliError::FingerprintNeedsSecret);
        }
        let key = keys::find(&ctx.conn, scheme, bucket, &fp).await?;
        return Ok((key, Form::Fingerprint));
    }
    keys::from_args(bucket, args)?.ok_or(CliError::NoKey)
}

/// Who a bucket belongs to, without the key: its name, how its key is stored, its fingerprint.
#[derive(Debug, Serialize)]
struct Identity {
    bucket: String,
    key_form: &'static str,
    fingerprint: String,
    fingerprint_keyed: bool,
}

impl Identity {
    fn new(ctx: &Ctx, key: &BucketKey, form: Form) -> Self {
        Self {
            bucket: key.bucket().to_owned(),
            key_form: form.name(),
            fingerprint: key.fingerprint(),
            fingerprint_keyed: ctx.keyed,
        }
    }

    fn text(&self, out: &mut String) {
        line(out, "bucket", &self.bucket);
        let form = match self.key_form {
            "fingerprint" => "found by its fingerprint".to_owned(),
            form => form.to_owned(),
        };
        line(
            out,
            "key",
            &format!("{form}, fingerprint {}", self.fingerprint),
        );
    }

    fn notes(&self) -> Vec<String> {
        if self.fingerprint_keyed {
            Vec::new()
        } else {
            vec![SALTED.to_owned()]
        }
    }
}

/// What a bucket holds, as `peek` and `PTTL` see it.
#[derive(Debug, Serialize)]
struct State {
    limit: String,
    /// Whether Redis holds a key for the bucket: a bucket without one is full.
    exists: bool,
    burst: u32,
    remaining: u32,
    next_token_in_ms: u64,
    full_in_ms: u64,
    /// Whether a block or an upstream's drain holds the bucket now.
    blocked: bool,
    /// The halt of the latest block or drain, when one is recorded, past or not.
    halted_until: Option<String>,
    halted_until_ms: Option<u64>,
    /// The key's time to live, `None` without a key.
    ttl_ms: Option<u64>,
}

impl State {
    async fn read(ctx: &Ctx, key: &BucketKey, limit: Limit) -> Result<Self, CliError> {
        let q = ctx.store.peek(key, limit).await?;
        let pttl: i64 = redis::cmd("PTTL")
            .arg(ctx.store.redis_key(key))
            .query_async(&mut ctx.conn.clone())
            .await
            .map_err(error::redis("reading the key's TTL", || {
                format!("the key of bucket {}", key.bucket())
            }))?;
        Ok(Self::of(ctx.store.now(), limit, &q, pttl))
    }

    fn of(now: SystemTime, limit: Limit, q: &BucketState, pttl: i64) -> Self {
        let halt = q.halted_until().map(span::epoch_ms);
        Self {
            limit: limit.to_string(),
            exists: pttl != -2,
            burst: q.burst(),
            remaining: q.remaining(),
            next_token_in_ms: ms(q.next_token_in()),
            full_in_ms: ms(q.resets_in()),
            blocked: halt.is_some_and(|h| h > span::epoch_ms(now)),
            halted_until: halt.map(span::rfc3339),
            halted_until_ms: halt,
            ttl_ms: u64::try_from(pttl).ok(),
        }
    }

    fn text(&self, now_ms: u64, out: &mut String) {
        line(out, "limit", &self.limit);
        line(
            out,
            "remaining",
            &format!("{} of {}", self.remaining, self.burst),
        );
        line(out, "next token", &within(self.next_token_in_ms));
        line(out, "full", &within(self.full_in_ms));
        let blocked = match self.halted_until_ms {
            Some(h) if h > now_ms => format!(
                "until {} (in {})",
                span::rfc3339(h),
                span::format(Duration::from_millis(h - now_ms))
            ),
            Some(h) => format!(
                "no (the last halt ended {} ago)",
                span::format(Duration::from_millis(now_ms - h))
            ),
            None => "no".to_owned(),
        };
        line(out, "blocked", &blocked);
        let ttl = match (self.exists, self.ttl_ms) {
            (false, _) => "no key in Redis: the bucket is full".to_owned(),
            (true, Some(ttl)) => span::format(Duration::from_millis(ttl)),
            (true, None) => "none (the key never expires)".to_owned(),
        };
        line(out, "ttl", &ttl);
    }
}

/// A report of `json`, as one JSON document with `"command"` first, and `text`.
fn report(command: &'static str, json: impl Serialize, text: String, notes: Vec<String>) -> Report {
    #[derive(Serialize)]
    struct Doc<T> {
        command: &'static str,
        #[serde(flatten)]
        fields: T,
    }
    let doc = Doc {
        command,
        fields: json,
    };
    Report {
        // Plain data of strings and numbers, which always serializes.
        json: serde_json::to_string(&doc).unwrap_or_default(),
        text,
        notes,
    }
}

/// One `label  value` line of text, the values aligned.
fn line(out: &mut String, label: &str, value: &str) {
    out.push_str(&format!("{label:<12}{value}\n"));
}

/// A table: `header` and `rows`, each column as wide as its widest cell, two spaces apart; the
/// last column is not padded, so it may hold free text.
fn columns<const N: usize>(out: &mut String, header: &[String; N], rows: &[[String; N]]) {
    let mut widths = header.clone().map(|h| h.chars().count());
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    for row in std::iter::once(header).chain(rows) {
        let mut cells = Vec::with_capacity(N);
        for (i, (cell, w)) in row.iter().zip(widths).enumerate() {
            if i + 1 == N {
                cells.push(cell.clone());
            } else {
                cells.push(format!("{cell:<w$}"));
            }
        }
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
}

/// "now", or "in 1m 2s".
fn within(ms: u64) -> String {
    if ms == 0 {
        "now".to_owned()
    } else {
        format!("in {}", span::format(Duration::from_millis(ms)))
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// `text` with its control characters escaped: a process label is free text written by the
/// application, and must not move a terminal's cursor.
fn printable(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(printable("worker 1"), "worker 1");
        assert_eq!(printable("a\u{1b}[2Jb\n"), "a\\u{1b}[2Jb\\n");
    }
}
