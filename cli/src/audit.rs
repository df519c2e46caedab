//! The reader of the audit trail the library writes: one Redis Stream per bucket key, under
//! `<prefix>:audit:v1:<bucket>:{<key>}` ([`Scheme::audit`]), each entry one decision with the
//! fields
//!
//! - `t`: when it was decided, in milliseconds since the Unix epoch, on the store's clock;
//! - `o`: `admitted`, `waited` or `refused`;
//! - `c`: its cost, in tokens;
//! - `w`: the wait it was given, in milliseconds;
//! - `r`: the whole tokens left after it;
//! - `k`: the key's fingerprint, 12 hex digits;
//! - `p`: the label of the process that decided, free text.
//!
//! The entry IDs are Redis's own (`XADD ... *`), so they order one stream; entries of several
//! streams are merged by `t`. This is the only place the command reads that format.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use burstgate::redis::{self, Value};
use serde::Serialize;

use crate::connect::Conn;
use crate::error::{self, CliError};

/// How far before `--since` the streams are read by entry ID: an ID is Redis's time when the
/// entry was added, `t` the deciding store's, and a store whose clock runs ahead of Redis's by
/// less than this still has its entries found by `t`.
pub(crate) const ID_SLACK_MS: u64 = 5 * 60 * 1_000;

/// Entries read from a stream per call.
const PAGE: usize = 500;

/// One decision of the trail.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Entry {
    /// The entry's ID in its stream.
    pub(crate) id: String,
    /// `t`.
    pub(crate) t_ms: u64,
    /// `o`.
    pub(crate) outcome: String,
    /// `c`.
    pub(crate) cost: u64,
    /// `w`.
    pub(crate) wait_ms: u64,
    /// `r`.
    pub(crate) remaining: i64,
    /// `k`.
    pub(crate) fingerprint: String,
    /// `p`.
    pub(crate) process: String,
}

/// What [`read`] found in the streams.
#[derive(Debug, Default)]
pub(crate) struct Trail {
    /// The latest entries at or after the start, oldest first.
    pub(crate) entries: Vec<Entry>,
    /// Whether more entries than were kept are at or after the start.
    pub(crate) truncated: bool,
    /// Whether a stream's cap dropped entries at or after the start.
    pub(crate) trimmed: bool,
    /// Entries without the fields above, skipped.
    pub(crate) malformed: usize,
}

/// The latest `count` entries of `streams` decided at or after `since_ms`, oldest first, with
/// `what` naming the streams in errors (never by key). A stream that does not exist has no
/// entries; a key that holds something else is an error.
pub(crate) async fn read(
    conn: &Conn,
    streams: &[String],
    since_ms: u64,
    count: usize,
    what: impl Fn(&str) -> String,
) -> Result<Trail, CliError> {
    let mut trail = Trail::default();
    // The latest `count` of all: a heap of the earliest kept, to drop as later ones come.
    let mut kept: BinaryHeap<Reverse<(u64, String, usize)>> = BinaryHeap::new();
    let mut all: Vec<Entry> = Vec::new();
    let start = since_ms.saturating_sub(ID_SLACK_MS);
    for stream in streams {
        let mut end = "+".to_owned();
        let mut taken = 0;
        'pages: loop {
            let reply: Value = redis::cmd("XREVRANGE")
                .arg(stream)
                .arg(&end)
                .arg(start)
                .arg("COUNT")
                .arg(PAGE)
                .query_async(&mut conn.clone())
                .await
                .map_err(error::redis("reading an audit stream", || what(stream)))?;
            let page = entries(reply)?;
            let full = page.len() == PAGE;
            for (id, fields) in page {
                end = format!("({id}");
                let Some(entry) = entry(id, &fields) else {
                    trail.malformed += 1;
                    continue;
                };
                if entry.t_ms < since_ms {
                    continue;
                }
                if taken == count {
                    // This stream alone has more than can be shown.
                    trail.truncated = true;
                    break 'pages;
                }
                taken += 1;
                kept.push(Reverse((entry.t_ms, entry.id.clone(), all.len())));
                all.push(entry);
                if kept.len() > count {
                    kept.pop();
                    trail.truncated = true;
                }
            }
            if !full {
                break;
            }
        }
        if trimmed_since(conn, stream, since_ms).await? {
            trail.trimmed = true;
        }
    }
    let mut chosen: Vec<(u64, String, usize)> = kept.into_iter().map(|Reverse(k)| k).collect();
    chosen.sort();
    trail.entries = chosen.into_iter().map(|(.., i)| all[i].clone()).collect();
    Ok(trail)
}

/// Whether the stream's cap may have dropped entries added at or after `since_ms`: it dropped
/// some (Redis 7 counts every entry added), and the oldest it kept came after `since_ms`, since
/// a cap drops the oldest first. An older server, which does not count, is taken as no.
async fn trimmed_since(conn: &Conn, stream: &str, since_ms: u64) -> Result<bool, CliError> {
    let info: Result<Value, _> = redis::cmd("XINFO")
        .arg("STREAM")
        .arg(stream)
        .query_async(&mut conn.clone())
        .await;
    let Ok(info) = info else {
        // No such stream (nothing to trim), or a server without XINFO.
        return Ok(false);
    };
    let pairs: Vec<(String, Value)> = match info {
        Value::Map(pairs) => pairs
            .into_iter()
            .filter_map(|(k, v)| redis::from_redis_value::<String>(k).ok().map(|k| (k, v)))
            .collect(),
        Value::Array(items) => items
            .chunks(2)
            .filter_map(|kv| match kv {
                [k, v] => redis::from_redis_value_ref::<String>(k)
                    .ok()
                    .map(|k| (k, v.clone())),
                _ => None,
            })
            .collect(),
        _ => return Ok(false),
    };
    let field = |name: &str| pairs.iter().find(|(k, _)| k == name).map(|(_, v)| v);
    let count = |name: &str| field(name).and_then(|v| redis::from_redis_value_ref::<u64>(v).ok());
    let (Some(added), Some(length)) = (count("entries-added"), count("length")) else {
        return Ok(false);
    };
    let first_ms = field("recorded-first-entry-id")
        .and_then(|v| redis::from_redis_value_ref::<String>(v).ok())
        .and_then(|id| {
            id.split_once('-')
                .and_then(|(ms, _)| ms.parse::<u64>().ok())
        })
        .unwrap_or(0);
    Ok(added > length && first_ms > since_ms)
}

/// An entry's ID and its fields, as a range reply holds them.
type RawEntry = (String, Vec<(String, String)>);

/// A range reply: `[[id, [field, value, ...]], ...]`.
fn entries(reply: Value) -> Result<Vec<RawEntry>, CliError> {
    let bad = |what: String| CliError::Reply {
        doing: "reading an audit stream",
        what,
    };
    let Value::Array(items) = reply else {
        return Err(bad(format!("{reply:?}")));
    };
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let Value::Array(parts) = item else {
            return Err(bad(format!("{item:?}")));
        };
        let [id, fields] = <[Value; 2]>::try_from(parts).map_err(|p| bad(format!("{p:?}")))?;
        let id: String = redis::from_redis_value(id).map_err(|e| bad(e.to_string()))?;
        let fields: Vec<Value> = match fields {
            Value::Array(fields) => fields,
            Value::Map(pairs) => pairs.into_iter().flat_map(|(k, v)| [k, v]).collect(),
            other => return Err(bad(format!("{other:?}"))),
        };
        let pairs = fields
            .chunks(2)
            .filter_map(|kv| match kv {
                [k, v] => Some((
                    redis::from_redis_value_ref::<String>(k).ok()?,
                    redis::from_redis_value_ref::<String>(v).ok()?,
                )),
                _ => None,
            })
            .collect();
        out.push((id, pairs));
    }
    Ok(out)
}

/// The entry of `fields`, when it has every field, each of its type.
fn entry(id: String, fields: &[(String, String)]) -> Option<Entry> {
    let field = |name: &str| {
        fields
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let outcome = field("o")?;
    if !matches!(outcome, "admitted" | "waited" | "refused") {
        return None;
    }
    let fingerprint = field("k")?;
    if fingerprint.len() != 12 || !fingerprint.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    Some(Entry {
        id,
        t_ms: field("t")?.parse().ok()?,
        outcome: outcome.to_owned(),
        cost: field("c")?.parse().ok()?,
        wait_ms: field("w")?.parse().ok()?,
        remaining: field("r")?.parse().ok()?,
        fingerprint: fingerprint.to_owned(),
        process: field("p")?.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    const GOOD: [(&str, &str); 7] = [
        ("t", "1796467337001"),
        ("o", "waited"),
        ("c", "2"),
        ("w", "1500"),
        ("r", "-1"),
        ("k", "3f2a9c1b7d4e"),
        ("p", "worker-1 on host a"),
    ];

    #[test]
    fn an_entry_has_every_field_of_its_type() {
        let e = entry("1796467337001-0".into(), &fields(&GOOD)).expect("an entry");
        assert_eq!(
            e,
            Entry {
                id: "1796467337001-0".into(),
                t_ms: 1_796_467_337_001,
                outcome: "waited".into(),
                cost: 2,
                wait_ms: 1_500,
                remaining: -1,
                fingerprint: "3f2a9c1b7d4e".into(),
                process: "worker-1 on host a".into(),
            }
        );
        for (field, bad) in [
            ("t", "soon"),
            ("o", "maybe"),
            ("c", "-1"),
            ("w", "1.5"),
            ("r", "x"),
            ("k", "3f2a"),
        ] {
            let mut f = fields(&GOOD);
            for (k, v) in &mut f {
                if k == field {
                    *v = bad.to_owned();
                }
            }
            assert_eq!(entry("1-0".into(), &f), None, "{field}={bad}");
        }
        let missing: Vec<_> = fields(&GOOD)
            .into_iter()
            .filter(|(k, _)| k != "p")
            .collect();
        assert_eq!(entry("1-0".into(), &missing), None);
    }
}
