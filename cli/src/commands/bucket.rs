//! The commands on one bucket: `inspect`, `reset`, `set`, `block` and `unblock`. Each names the
//! bucket by its identity and fingerprint, never its key, and after a change shows what the
//! bucket holds.

use std::time::Duration;

use burstgate::redis;
use burstgate::{BucketName, BucketStore, Limit};
use serde::Serialize;

use super::{Ctx, Identity, Report, State, line, report, target};
use crate::args::KeyArgs;
use crate::error::{self, CliError};
use crate::keys::Form;
use crate::span;

/// What the bucket holds.
pub(super) async fn inspect(
    ctx: &Ctx,
    bucket: &BucketName,
    args: &KeyArgs,
    limit: Limit,
) -> Result<Report, CliError> {
    let (key, form) = target(ctx, &ctx.buckets, bucket, args).await?;
    let id = Identity::new(ctx, &key, form);
    let state = State::read(ctx, &key, limit).await?;
    let mut text = String::new();
    id.text(&mut text);
    state.text(span::epoch_ms(ctx.store.now()), &mut text);
    let mut notes = id.notes();
    if !state.exists && form != Form::Fingerprint {
        notes.push(not_found_hint());
    }
    #[derive(Serialize)]
    struct Doc {
        #[serde(flatten)]
        id: Identity,
        state: State,
    }
    Ok(report("inspect", Doc { id, state }, text, notes))
}

/// Forgets the bucket: a `DEL` of its key, whatever the key holds.
pub(super) async fn reset(
    ctx: &Ctx,
    bucket: &BucketName,
    args: &KeyArgs,
) -> Result<Report, CliError> {
    let (key, form) = target(ctx, &ctx.buckets, bucket, args).await?;
    let id = Identity::new(ctx, &key, form);
    // Only to say so: a reset of a key that is not there is a reset all the same.
    let existed: bool = redis::cmd("EXISTS")
        .arg(ctx.store.redis_key(&key))
        .query_async(&mut ctx.conn.clone())
        .await
        .map_err(error::redis("looking for the key", || {
            format!("the key of bucket {}", key.bucket())
        }))?;
    ctx.store.reset(&key).await?;
    let mut text = String::new();
    id.text(&mut text);
    let done = if existed {
        "reset: full again, with no halt"
    } else {
        "reset: it had no key in Redis, so it was full already"
    };
    line(&mut text, "done", done);
    let mut notes = id.notes();
    if !existed && form != Form::Fingerprint {
        notes.push(not_found_hint());
    }
    #[derive(Serialize)]
    struct Doc {
        #[serde(flatten)]
        id: Identity,
        existed: bool,
    }
    Ok(report("reset", Doc { id, existed }, text, notes))
}

/// Makes the bucket hold exactly `tokens` now.
pub(super) async fn set(
    ctx: &Ctx,
    bucket: &BucketName,
    args: &KeyArgs,
    limit: Limit,
    tokens: u32,
) -> Result<Report, CliError> {
    let (key, form) = target(ctx, &ctx.buckets, bucket, args).await?;
    let id = Identity::new(ctx, &key, form);
    ctx.store.set(&key, limit, tokens).await?;
    let state = State::read(ctx, &key, limit).await?;
    let mut text = String::new();
    id.text(&mut text);
    line(&mut text, "done", &format!("set to {tokens} tokens"));
    state.text(span::epoch_ms(ctx.store.now()), &mut text);
    #[derive(Serialize)]
    struct Doc {
        #[serde(flatten)]
        id: Identity,
        remaining_set: u32,
        state: State,
    }
    let notes = id.notes();
    let doc = Doc {
        id,
        remaining_set: tokens,
        state,
    };
    Ok(report("set", doc, text, notes))
}

/// Admits nothing for `length`, and a request of one token at its end.
pub(super) async fn block(
    ctx: &Ctx,
    bucket: &BucketName,
    args: &KeyArgs,
    limit: Limit,
    length: Duration,
) -> Result<Report, CliError> {
    let (key, form) = target(ctx, &ctx.buckets, bucket, args).await?;
    let id = Identity::new(ctx, &key, form);
    let until = ctx.store.now() + length;
    ctx.store.block_until(&key, limit, until).await?;
    let state = State::read(ctx, &key, limit).await?;
    let until_ms = span::epoch_ms(until);
    let mut text = String::new();
    id.text(&mut text);
    line(
        &mut text,
        "done",
        &format!(
            "blocked until {} (for {})",
            span::rfc3339(until_ms),
            span::format(length)
        ),
    );
    state.text(span::epoch_ms(ctx.store.now()), &mut text);
    #[derive(Serialize)]
    struct Doc {
        #[serde(flatten)]
        id: Identity,
        blocked_until: String,
        blocked_until_ms: u64,
        state: State,
    }
    let notes = id.notes();
    let doc = Doc {
        id,
        blocked_until: span::rfc3339(until_ms),
        blocked_until_ms: until_ms,
        state,
    };
    Ok(report("block", doc, text, notes))
}

/// Ends the halt of a block or drain now, giving no tokens: the bucket keeps the whole tokens it
/// holds (none while it is blocked) and refills at the limit's rate from now. A bucket that is
/// not blocked is left as it is.
pub(super) async fn unblock(
    ctx: &Ctx,
    bucket: &BucketName,
    args: &KeyArgs,
    limit: Limit,
) -> Result<Report, CliError> {
    let (key, form) = target(ctx, &ctx.buckets, bucket, args).await?;
    let id = Identity::new(ctx, &key, form);
    let before = ctx.store.peek(&key, limit).await?;
    let now = ctx.store.now();
    let blocked = before.halted_until().is_some_and(|h| h > now);
    if blocked {
        // `set` drops the halt and the debt of reservations queued behind it, and refills
        // from now; the tokens are the ones the bucket holds, so none are given.
        ctx.store.set(&key, limit, before.remaining()).await?;
    }
    let state = State::read(ctx, &key, limit).await?;
    let mut text = String::new();
    id.text(&mut text);
    let done = if blocked {
        format!(
            "unblocked: no halt, {} tokens now, refilling at the limit's rate",
            before.remaining()
        )
    } else {
        "nothing: the bucket was not blocked".to_owned()
    };
    line(&mut text, "done", &done);
    state.text(span::epoch_ms(ctx.store.now()), &mut text);
    #[derive(Serialize)]
    struct Doc {
        #[serde(flatten)]
        id: Identity,
        changed: bool,
        state: State,
    }
    let notes = id.notes();
    let doc = Doc {
        id,
        changed: blocked,
        state,
    };
    Ok(report("unblock", doc, text, notes))
}

/// For a key named by value that Redis does not hold.
fn not_found_hint() -> String {
    "Redis holds no key for this bucket: it is full, or unused for a while (an idle bucket's key \
     expires), or the application stores the key another way (--hashed, --keyed-secret-env) or \
     under another --prefix"
        .to_owned()
}
