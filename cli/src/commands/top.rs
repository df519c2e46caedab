//! `top`: the buckets under the prefix with the fewest tokens, by bucket and fingerprint.

use std::collections::BTreeSet;

use burstgate::{BucketKey, BucketName, BucketStore, Limit, StoreError};
use serde::Serialize;

use super::{Ctx, Report, SALTED, ms, report, within};
use crate::error::CliError;
use crate::span;

/// Peeks in flight at once: enough to keep a remote Redis busy, and far under the store's bound
/// on calls in flight.
const IN_FLIGHT: usize = 32;

/// One bucket of the list.
#[derive(Debug, Serialize)]
struct Row {
    bucket: String,
    fingerprint: String,
    limit: String,
    burst: u32,
    remaining: u32,
    /// Tokens now, with the fraction, below zero for a bucket in debt to reservations or held by
    /// a block: the order of the list.
    tokens: f64,
    next_token_in_ms: u64,
    full_in_ms: u64,
    blocked: bool,
    halted_until: Option<String>,
    halted_until_ms: Option<u64>,
}

/// The `count` buckets under the prefix (of `bucket` alone, if given) with the fewest tokens
/// for their burst, each under its limit from `limits`.
pub(super) async fn top(
    ctx: &Ctx,
    bucket: Option<&BucketName>,
    limits: &[(Option<BucketName>, Limit)],
    count: usize,
) -> Result<Report, CliError> {
    let (found, _) = ctx.conn.scan(&ctx.buckets.pattern(bucket)).await?;
    let scanned = found.len();
    let mut other_keys = 0;
    let mut without_limit = BTreeSet::new();
    let mut todo: Vec<(BucketKey, Limit)> = Vec::new();
    for redis_key in &found {
        let Some(key) = ctx.buckets.parse(redis_key) else {
            other_keys += 1;
            continue;
        };
        let limit = limits
            .iter()
            .find(|(b, _)| b.as_ref().is_some_and(|b| b.as_str() == key.bucket()))
            .or_else(|| limits.iter().find(|(b, _)| b.is_none()))
            .map(|(_, l)| *l);
        match limit {
            Some(limit) => todo.push((key, limit)),
            None => {
                without_limit.insert(key.bucket().to_owned());
            }
        }
    }
    let mut rows = Vec::with_capacity(todo.len());
    let mut unreadable = 0;
    for chunk in todo.chunks(IN_FLIGHT) {
        let mut peeks = tokio::task::JoinSet::new();
        for (key, limit) in chunk.iter().cloned() {
            let store = ctx.store.clone();
            peeks.spawn(async move {
                let q = store.peek(&key, limit).await;
                (key, limit, q)
            });
        }
        while let Some(done) = peeks.join_next().await {
            let Ok((key, limit, q)) = done else {
                unreadable += 1;
                continue;
            };
            let q = match q {
                Ok(q) => q,
                // A stranger's value under the prefix is counted, not fatal to the list.
                Err(StoreError::WrongType { .. } | StoreError::CorruptBucket { .. }) => {
                    unreadable += 1;
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            let now = span::epoch_ms(ctx.store.now());
            let halt = q.halted_until().map(span::epoch_ms);
            let per_ms = f64::from(limit.tokens()) / limit.interval().as_millis() as f64;
            let tokens = f64::from(q.burst()) - ms(q.resets_in()) as f64 * per_ms;
            rows.push(Row {
                bucket: key.bucket().to_owned(),
                fingerprint: key.fingerprint(),
                limit: limit.to_string(),
                burst: q.burst(),
                remaining: q.remaining(),
                tokens: (tokens * 100.0).round() / 100.0,
                next_token_in_ms: ms(q.next_token_in()),
                full_in_ms: ms(q.resets_in()),
                blocked: halt.is_some_and(|h| h > now),
                halted_until: halt.map(span::rfc3339),
                halted_until_ms: halt,
            });
        }
    }
    let buckets = rows.len();
    // Fewest tokens for the burst first; then the longest to full; then a fixed order.
    rows.sort_by(|a, b| {
        let share = |r: &Row| r.tokens / f64::from(r.burst.max(1));
        share(a)
            .total_cmp(&share(b))
            .then(b.full_in_ms.cmp(&a.full_in_ms))
            .then_with(|| (&a.bucket, &a.fingerprint).cmp(&(&b.bucket, &b.fingerprint)))
    });
    rows.truncate(count);

    let mut text = format!(
        "buckets under prefix {}{}: {buckets}, the {} with the fewest tokens first\n",
        ctx.prefix,
        bucket.map_or_else(String::new, |b| format!(", bucket {b}")),
        rows.len()
    );
    let table: Vec<[String; 7]> = rows
        .iter()
        .enumerate()
        .map(|(i, r)| {
            [
                (i + 1).to_string(),
                r.bucket.clone(),
                r.fingerprint.clone(),
                format!("{}/{}", r.remaining, r.burst),
                format!("{:.2}", r.tokens),
                within(r.full_in_ms),
                match r.halted_until_ms {
                    Some(h) if r.blocked => span::rfc3339(h),
                    _ => "-".to_owned(),
                },
            ]
        })
        .collect();
    let header = [
        "#",
        "bucket",
        "fingerprint",
        "remaining",
        "tokens",
        "full",
        "blocked until",
    ]
    .map(str::to_owned);
    super::columns(&mut text, &header, &table);
    let mut notes = Vec::new();
    if !ctx.keyed && !rows.is_empty() {
        notes.push(SALTED.to_owned());
    }
    if !without_limit.is_empty() {
        notes.push(format!(
            "not listed, for want of a --limit: the keys of {}",
            without_limit.iter().cloned().collect::<Vec<_>>().join(", ")
        ));
    }
    if unreadable > 0 {
        notes.push(format!(
            "{unreadable} keys under the prefix hold something other than a bucket"
        ));
    }

    #[derive(Serialize)]
    struct Doc {
        prefix: String,
        bucket: Option<String>,
        fingerprint_keyed: bool,
        keys_scanned: usize,
        buckets: usize,
        without_limit: Vec<String>,
        unreadable: usize,
        other_keys: usize,
        top: Vec<Row>,
    }
    let doc = Doc {
        prefix: ctx.prefix.clone(),
        bucket: bucket.map(ToString::to_string),
        fingerprint_keyed: ctx.keyed,
        keys_scanned: scanned,
        buckets,
        without_limit: without_limit.into_iter().collect(),
        unreadable,
        other_keys,
        top: rows,
    };
    Ok(report("top", doc, text, notes))
}
