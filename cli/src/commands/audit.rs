//! `audit`: a bucket's audit trail, for one key (its stream) or for every key of the bucket
//! (every stream of the bucket, on every primary of a Cluster), merged in time order.

use std::time::Duration;

use burstgate::{BucketKey, BucketName, BucketStore};
use serde::Serialize;

use super::{Ctx, Report, columns, line, printable, report, target};
use crate::args::KeyArgs;
use crate::audit::{self, Entry};
use crate::error::CliError;
use crate::keys::Scheme;
use crate::span;

/// One entry as printed.
#[derive(Debug, Serialize)]
struct Row {
    time: String,
    #[serde(flatten)]
    entry: Entry,
}

/// The entries of the last `since` of `bucket`'s trail (of the key `args` name, if any), at most
/// the latest `count`.
pub(super) async fn audit(
    ctx: &Ctx,
    bucket: &BucketName,
    args: &KeyArgs,
    since: Duration,
    count: usize,
) -> Result<Report, CliError> {
    let scheme = Scheme::audit(&ctx.store);
    let now_ms = span::epoch_ms(ctx.store.now());
    let since_ms = now_ms.saturating_sub(super::ms(since));
    let (streams, key): (Vec<String>, Option<BucketKey>) = if args.is_given() {
        let (key, _) = target(ctx, &scheme, bucket, args).await?;
        (vec![scheme.key(&key)], Some(key))
    } else {
        let (found, _) = ctx.conn.scan(&scheme.pattern(Some(bucket))).await?;
        // Only what the library writes: a stranger's key under the pattern is left alone.
        let streams = found
            .into_iter()
            .filter(|k| scheme.parse(k).is_some())
            .collect();
        (streams, None)
    };
    let name = |stream: &str| {
        let fp = scheme
            .parse(stream)
            .map_or_else(|| "unknown".to_owned(), |k| k.fingerprint());
        format!("the audit stream of bucket {bucket}, key fingerprint {fp},")
    };
    let trail = audit::read(&ctx.conn, &streams, since_ms, count, name).await?;

    let mut text = String::new();
    line(&mut text, "bucket", bucket.as_str());
    let which = match &key {
        Some(key) => format!("the key with fingerprint {}", key.fingerprint()),
        None => format!("every key ({} streams)", streams.len()),
    };
    line(&mut text, "keys", &which);
    line(
        &mut text,
        "since",
        &format!("{} ({} ago)", span::rfc3339(since_ms), span::format(since)),
    );
    line(&mut text, "entries", &trail.entries.len().to_string());
    if !trail.entries.is_empty() {
        let header = [
            "time",
            "outcome",
            "cost",
            "wait",
            "left",
            "fingerprint",
            "process",
        ]
        .map(str::to_owned);
        let rows: Vec<[String; 7]> = trail
            .entries
            .iter()
            .map(|e| {
                [
                    span::rfc3339(e.t_ms),
                    e.outcome.clone(),
                    e.cost.to_string(),
                    span::format(Duration::from_millis(e.wait_ms)),
                    e.remaining.to_string(),
                    e.fingerprint.clone(),
                    printable(&e.process),
                ]
            })
            .collect();
        columns(&mut text, &header, &rows);
    }

    let mut notes = Vec::new();
    if streams.is_empty() {
        notes.push(format!(
            "no audit stream for bucket {bucket}: its rule or route does not audit, or it decided \
             nothing within the stream's retention"
        ));
    }
    if trail.truncated {
        notes.push(format!(
            "more entries than shown since then: these are the latest {count} (-n to see more)"
        ));
    }
    if trail.trimmed {
        notes.push(
            "a stream's cap dropped entries since then: the trail shown is not the whole of it"
                .to_owned(),
        );
    }
    if trail.malformed > 0 {
        notes.push(format!(
            "{} entries without the audit fields were skipped",
            trail.malformed
        ));
    }

    #[derive(Serialize)]
    struct Doc {
        bucket: String,
        fingerprint: Option<String>,
        streams: usize,
        since: String,
        since_ms: u64,
        truncated: bool,
        trimmed: bool,
        malformed: usize,
        entries: Vec<Row>,
    }
    let doc = Doc {
        bucket: bucket.to_string(),
        fingerprint: key.as_ref().map(BucketKey::fingerprint),
        streams: streams.len(),
        since: span::rfc3339(since_ms),
        since_ms,
        truncated: trail.truncated,
        trimmed: trail.trimmed,
        malformed: trail.malformed,
        entries: trail
            .entries
            .into_iter()
            .map(|entry| Row {
                time: span::rfc3339(entry.t_ms),
                entry,
            })
            .collect(),
    };
    Ok(report("audit", doc, text, notes))
}
