//! The bucket script and one call of it: its source and SHA-1, `EVALSHA` then `EVAL`, and the
//! call's way through the circuit breaker, the bound on calls in flight, the timeout and the
//! retry, with what each error from Redis means for the breaker and the caller. A reset's `DEL`,
//! and a one-time mark's booking (`SET NX PX`) and claim (`claim.lua`), go the same way.

use redis::aio::ConnectionLike;
use redis::{ErrorKind, RedisError, ServerErrorKind, Value};

use super::RedisStore;
use super::wire::{
    Args, Each, LeaseArgs, RedisKey, Reply, book, claim, command, command_all, delete,
    lease_command, pack_all, parse_all, parse_lease_peek, parse_renewal, parse_reply,
};
use crate::bucket::Verdict;
use crate::bucket::lease::Renewal;
use crate::clock::Clock;
use crate::store::{BackendError, Claim, StoreError, Take};
use crate::{BucketKey, Limit};

/// The bucket script, `bucket.lua` beside this file; Redis knows it by the SHA-1 of this text.
const SOURCE: &str = include_str!("bucket.lua");

/// The several-bucket script, `acquire_all.lua` beside this file.
const ALL_SOURCE: &str = include_str!("acquire_all.lua");

/// The claim script, `claim.lua` beside this file.
const CLAIM_SOURCE: &str = include_str!("claim.lua");

/// The lease script, `lease.lua` beside this file.
pub(super) const LEASE_SOURCE: &str = include_str!("lease.lua");

/// The error code the scripts answer a bucket with when tokens of it are out on lease.
const LEASED_CODE: &str = "BURSTGATE_LEASED";

/// The error code the script answers a stored value with that no script could have written.
pub(super) const CORRUPT_CODE: &str = "BURSTGATE_CORRUPT";

/// The error code the several-bucket script answers when an audited bucket's stream key holds
/// something other than a stream.
const AUDIT_CODE: &str = "BURSTGATE_AUDIT";

/// The bucket script, shared by every store in the process: its SHA-1 is computed once.
pub fn script() -> &'static redis::Script {
    static SCRIPT: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| redis::Script::new(SOURCE))
}

/// The several-bucket script, shared as [`script`] is.
pub(super) fn script_all() -> &'static redis::Script {
    static SCRIPT: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| redis::Script::new(ALL_SOURCE))
}

/// The lease script, shared as [`script`] is.
pub(super) fn script_lease() -> &'static redis::Script {
    static SCRIPT: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| redis::Script::new(LEASE_SOURCE))
}

/// The claim script, shared as [`script`] is.
fn script_claim() -> &'static redis::Script {
    static SCRIPT: std::sync::OnceLock<redis::Script> = std::sync::OnceLock::new();
    SCRIPT.get_or_init(|| redis::Script::new(CLAIM_SOURCE))
}

impl<C, K> RedisStore<C, K>
where
    C: ConnectionLike + Clone + Send + Sync + 'static,
    K: Clock,
{
    /// Runs the several-bucket script on the buckets of `takes` (at least one), through the
    /// circuit breaker and within the timeout, as one bucket's call goes.
    pub(super) async fn run_all(
        &self,
        takes: &[Take<'_>],
        now: u64,
        max_wait: u64,
    ) -> Result<Vec<Each>, Failure> {
        let packed = pack_all(takes, now, max_wait);
        let first = takes.first().map(Take::key).ok_or_else(|| {
            Failure::Fatal(StoreError::Backend(BackendError::new(
                "a call on several buckets named none",
                None,
            )))
        })?;
        let value = self
            .send(
                first,
                Call::All {
                    takes,
                    packed: &packed,
                },
            )
            .await?;
        parse_all(&value, takes).map_err(Failure::Fatal)
    }

    /// Runs the script for one bucket, through the circuit breaker and within the timeout.
    pub(super) async fn run(
        &self,
        key: &BucketKey,
        now: u64,
        args: Args,
    ) -> Result<Reply, Failure> {
        let value = self.send(key, Call::Script { now, args: &args }).await?;
        parse_reply(&value, &args, now).map_err(Failure::Fatal)
    }

    /// Runs the lease script for one bucket, through the circuit breaker and within the
    /// timeout.
    pub(super) async fn run_lease(
        &self,
        key: &BucketKey,
        now: u64,
        args: LeaseArgs,
    ) -> Result<Renewal, Failure> {
        let value = self.send(key, Call::Lease { now, args: &args }).await?;
        parse_renewal(&value, &args.ask).map_err(Failure::Fatal)
    }

    /// Peeks at one leased bucket with the lease script, through the circuit breaker and
    /// within the timeout: the outcome, and the tokens out on lease.
    pub(super) async fn run_lease_peek(
        &self,
        key: &BucketKey,
        now: u64,
        limit: Limit,
    ) -> Result<(Verdict, u64), Failure> {
        let args = LeaseArgs::peek(limit);
        let value = self.send(key, Call::Lease { now, args: &args }).await?;
        parse_lease_peek(&value).map_err(Failure::Fatal)
    }

    /// Deletes one bucket's key (a reset), through the circuit breaker and within the timeout,
    /// as a script call goes.
    pub(super) async fn delete(&self, key: &BucketKey) -> Result<(), Failure> {
        match self.send(key, Call::Delete).await? {
            Value::Int(_) => Ok(()),
            _ => Err(Failure::Fatal(StoreError::Backend(BackendError::new(
                "redis answered a DEL with something other than a count",
                None,
            )))),
        }
    }

    /// Books a one-time mark beside one bucket's key for `ttl_ms`, through the circuit breaker
    /// and within the timeout. A mark already there is left as it is.
    pub(super) async fn book_mark(
        &self,
        key: &BucketKey,
        id: &str,
        ttl_ms: u64,
    ) -> Result<(), Failure> {
        match self.send(key, Call::Book { id, ttl_ms }).await? {
            Value::Okay | Value::Nil => Ok(()),
            _ => Err(Failure::Fatal(StoreError::Backend(BackendError::new(
                "redis answered a SET NX with something other than OK or nil",
                None,
            )))),
        }
    }

    /// Spends a one-time mark beside one bucket's key, through the circuit breaker and within
    /// the timeout.
    pub(super) async fn claim_mark(&self, key: &BucketKey, id: &str) -> Result<Claim, Failure> {
        match self.send(key, Call::Claim { id }).await? {
            Value::Int(1) => Ok(Claim::First),
            Value::Int(0) => Ok(Claim::Spent),
            Value::Int(-1) => Ok(Claim::Missing),
            _ => Err(Failure::Fatal(StoreError::Backend(BackendError::new(
                "redis answered the claim script with something other than 1, 0 or -1",
                None,
            )))),
        }
    }

    /// Sends one call for one bucket, through the circuit breaker and within the timeout: Redis's
    /// answer, or what its absence or its error means.
    async fn send(&self, key: &BucketKey, what: Call<'_>) -> Result<Value, Failure> {
        let mut permit = match self.circuit.pass() {
            Ok(permit) => permit,
            Err(retry_in) => {
                // Answered without waiting on anything: spend tokio's budget, so that a loop of
                // such calls still lets other tasks run.
                tokio::task::coop::consume_budget().await;
                return Err(Failure::Outage(StoreError::Unavailable { retry_in }));
            }
        };
        permit.stalls_after(self.timeout / 2);
        // A slot among the calls in flight. Taken before anything is sent, so that a caller who
        // gives up while waiting for one leaves nothing queued to run later.
        let mut timeout = self.timeout;
        let _slot = match self.in_flight.try_acquire() {
            Ok(slot) => slot,
            Err(_) => {
                let waited = tokio::time::Instant::now();
                let slot = tokio::time::timeout(timeout, self.in_flight.acquire()).await;
                timeout = timeout.saturating_sub(waited.elapsed());
                match slot {
                    // Sent only with at least half its timeout left, so that a call Redis runs
                    // is one its caller still waits for; and, but for the probe, only while the
                    // circuit is closed: calls ahead of this one failed meanwhile (a stalled
                    // Redis), and what was queued behind them is not sent into the same stall.
                    Ok(Ok(slot))
                        if timeout >= self.timeout / 2
                            && (permit.is_probe() || !self.circuit.is_open()) =>
                    {
                        slot
                    }
                    _ => {
                        return Err(Failure::Outage(StoreError::Unavailable {
                            retry_in: self.timeout,
                        }));
                    }
                }
            }
        };
        let redis_key = RedisKey {
            prefix: &self.prefix,
            key,
        };
        let call = async {
            let mut conn = match &self.reconnect {
                Some(reconnect) => reconnect.current(),
                None => self.conn.clone(),
            };
            match invoke(&mut conn, redis_key, what).await {
                Err(e) if not_executed(&e) => invoke(&mut conn, redis_key, what).await,
                done => done,
            }
        };
        // Dropped here with the rest of this future if the caller goes away: a probe's permit
        // then counts as a failure, and the circuit is never left waiting for it.
        #[cfg(feature = "metrics")]
        let started = tokio::time::Instant::now();
        let result = tokio::time::timeout(timeout, call).await;
        #[cfg(feature = "metrics")]
        metrics::histogram!(
            crate::metrics::STORE_CALL_SECONDS,
            "store" => "redis",
            "op" => what.name(),
        )
        .record(started.elapsed());
        if let Some(reconnect) = &self.reconnect {
            match &result {
                // Retried once already: the node was demoted to a replica (a failover), and the
                // connection stays on it unless replaced.
                Ok(Err(e)) if e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly) => {
                    reconnect.replace("redis answered READONLY: the node is a replica now");
                }
                Ok(_) => reconnect.answered(),
                Err(_) => reconnect.timed_out(),
            }
        }
        match result {
            Ok(Ok(value)) => {
                permit.success();
                Ok(value)
            }
            Ok(Err(e)) if e.code() == Some("WRONGTYPE") => {
                // Redis answered: it is up, the data is wrong.
                permit.success();
                let key = what.named(&e).unwrap_or(key);
                Err(Failure::Fatal(StoreError::WrongType {
                    bucket: key.bucket().to_owned(),
                    fingerprint: key.fingerprint(),
                }))
            }
            Ok(Err(e)) if e.code() == Some(AUDIT_CODE) => {
                permit.success();
                let key = what.named(&e).unwrap_or(key);
                Err(Failure::Fatal(StoreError::AuditNotAStream {
                    bucket: key.bucket().to_owned(),
                    fingerprint: key.fingerprint(),
                }))
            }
            Ok(Err(e)) if e.code() == Some(LEASED_CODE) => {
                permit.success();
                let key = what.named(&e).unwrap_or(key);
                Err(Failure::Fatal(StoreError::Leased {
                    bucket: key.bucket().to_owned(),
                    fingerprint: key.fingerprint(),
                }))
            }
            Ok(Err(e)) if e.code() == Some(CORRUPT_CODE) => {
                permit.success();
                let key = what.named(&e).unwrap_or(key);
                Err(Failure::Fatal(StoreError::CorruptBucket {
                    bucket: key.bucket().to_owned(),
                    fingerprint: key.fingerprint(),
                }))
            }
            Ok(Err(e)) if e.code() == Some("CROSSSLOT") => {
                // A cluster node refused keys of several slots: it is up, the keys are apart.
                permit.success();
                Err(Failure::Fatal(StoreError::CrossSlot))
            }
            Ok(Err(e)) if is_redirect(&e) => {
                // A slot on the move: the nodes are up and answering. The call failed, but this
                // is no outage, and must not open the circuit for every key.
                permit.success();
                Err(Failure::Outage(StoreError::Backend(BackendError::new(
                    "redis call redirected while a cluster slot moved",
                    Some(Box::new(e)),
                ))))
            }
            Ok(Err(e)) if about_the_call(&e) => {
                // Redis answered about this call (the script failed on this key's value): the
                // server is up and other keys are unaffected.
                permit.success();
                Err(Failure::Fatal(StoreError::Backend(BackendError::new(
                    "redis refused the bucket script's call",
                    Some(Box::new(e)),
                ))))
            }
            Ok(Err(e)) => {
                permit.failure(&e);
                Err(Failure::Outage(StoreError::Backend(BackendError::new(
                    "redis call failed",
                    Some(Box::new(e)),
                ))))
            }
            Err(_) => {
                let error = StoreError::Timeout {
                    after: self.timeout,
                };
                permit.failure(&error);
                Err(Failure::Outage(error))
            }
        }
    }
}

/// Why [`RedisStore::run`] has no answer.
pub(super) enum Failure {
    /// Redis failed, did not answer in time, or the circuit is open: the policy decides.
    Outage(StoreError),
    /// Redis answered, and the answer is an error: returned as it is.
    Fatal(StoreError),
}

/// Errors Redis returns only for commands it did not run, and a connection that was refused:
/// a retry cannot spend tokens twice. A cluster connection follows `MOVED` and `ASK` itself, but
/// can still return one when a slot moves again while it follows the first.
fn not_executed(e: &RedisError) -> bool {
    e.is_connection_refusal()
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::TryAgain
                    | ServerErrorKind::Moved
                    | ServerErrorKind::Ask
                    | ServerErrorKind::ClusterDown
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::BusyLoading
                    | ServerErrorKind::ReadOnly
            )
        )
        || e.code() == Some("BUSY")
}

/// An error the bucket script raised while it ran on one key (such as a `SET` the value at this
/// key made fail): it concerns that key's data, so it must not count toward the circuit breaker,
/// which would then refuse every key. Any other `ERR` (scripting disabled, a proxy that refuses
/// the command) concerns every key and counts.
fn about_the_call(e: &RedisError) -> bool {
    e.kind() == ErrorKind::Server(ServerErrorKind::ResponseError)
        // Redis names the script's own line in the error: "... script: <sha>, on
        // @user_script:84." (7.0), "Error running script (...): @user_script:84: ..." (6.x).
        && e.detail().is_some_and(|d| d.contains("@user_script"))
}

/// Cluster redirections that a cluster connection gave up following: the slot is moving.
fn is_redirect(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Server(
            ServerErrorKind::Moved | ServerErrorKind::Ask | ServerErrorKind::TryAgain
        )
    )
}

/// What [`RedisStore::send`] sends for a bucket.
#[derive(Clone, Copy)]
enum Call<'a> {
    /// The script, with these arguments, at `now`.
    Script { now: u64, args: &'a Args },
    /// The lease script, with these arguments, at `now`.
    Lease { now: u64, args: &'a LeaseArgs },
    /// A `DEL` of the key.
    Delete,
    /// A `SET NX PX` booking a one-time mark beside the key.
    Book { id: &'a str, ttl_ms: u64 },
    /// The claim script on a one-time mark beside the key.
    Claim { id: &'a str },
    /// The several-bucket script on these buckets, with this argument.
    All {
        takes: &'a [Take<'a>],
        packed: &'a [u8],
    },
}

impl<'a> Call<'a> {
    /// The bucket a script's error names by its place among the keys (`... at key 2 ...`), for
    /// a call on several buckets.
    fn named(&self, e: &RedisError) -> Option<&'a BucketKey> {
        let Self::All { takes, .. } = *self else {
            return None;
        };
        let detail = e.detail()?;
        let at = detail.find("at key ")? + "at key ".len();
        let digits: &str = detail[at..].split(' ').next()?;
        let place: usize = digits.parse().ok()?;
        takes.get(place.checked_sub(1)?).map(Take::key)
    }

    /// The `op` label of the store's call-latency metric.
    #[cfg(feature = "metrics")]
    fn name(&self) -> &'static str {
        match self {
            Self::Script { args, .. } => args.op.name(),
            Self::Lease { .. } => "lease",
            Self::Delete => "reset",
            Self::Book { .. } => "book",
            Self::Claim { .. } => "claim",
            Self::All { .. } => "acquire_all",
        }
    }
}

/// Sends one call for one bucket. The script goes as `EVALSHA`, and after `NOSCRIPT` as the same
/// call with `EVAL`; its arguments are packed by `wire::Args::pack`, which the differential test
/// packs with too.
async fn invoke(
    conn: &mut impl ConnectionLike,
    redis_key: RedisKey<'_>,
    what: Call<'_>,
) -> Result<Value, RedisError> {
    let (now, args) = match what {
        Call::Script { now, args } => (now, args),
        Call::Lease { now, args } => {
            let packed = args.pack(now);
            let sha = script_lease().get_hash();
            return match lease_command("EVALSHA", sha, redis_key, &packed)
                .query_async(conn)
                .await
            {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    lease_command("EVAL", LEASE_SOURCE, redis_key, &packed)
                        .query_async(conn)
                        .await
                }
                done => done,
            };
        }
        Call::Delete => return delete(redis_key).query_async(conn).await,
        Call::Book { id, ttl_ms } => return book(redis_key, id, ttl_ms).query_async(conn).await,
        Call::Claim { id } => {
            let sha = script_claim().get_hash();
            return match claim("EVALSHA", sha, redis_key, id).query_async(conn).await {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    claim("EVAL", CLAIM_SOURCE, redis_key, id)
                        .query_async(conn)
                        .await
                }
                done => done,
            };
        }
        Call::All { takes, packed } => {
            let sha = script_all().get_hash();
            let prefix = redis_key.prefix;
            return match command_all("EVALSHA", sha, prefix, takes, packed)
                .query_async(conn)
                .await
            {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    command_all("EVAL", ALL_SOURCE, prefix, takes, packed)
                        .query_async(conn)
                        .await
                }
                done => done,
            };
        }
    };
    let packed = args.pack(now);
    let sha = script().get_hash();
    match command("EVALSHA", sha, redis_key, &packed)
        .query_async(conn)
        .await
    {
        Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            command("EVAL", SOURCE, redis_key, &packed)
                .query_async(conn)
                .await
        }
        done => done,
    }
}
