//! An acquire made as the store makes it, for a program that calls the bucket script itself:
//! the workspace's load generator, which measures the script with no store in between. The
//! tools reach it, and the script, through `burstgate::__private::raw`, outside the stable API,
//! rather than keep a copy of the wire format of their own.

use std::time::Duration;

use redis::{Cmd, Value};

use super::RedisStore;
pub use super::script::script;
use super::wire::{Args, Op, RedisKey, command, parse_reply};
use crate::clock::whole_ms;
use crate::store::{StoreError, check_cost};
use crate::{BucketKey, Limit};

/// An acquire made as the store makes it, for a program that calls the script itself: the
/// workspace's load generator, which measures the script with no store in between. Not part
/// of the stable API.
#[derive(Debug, Clone, Copy)]
pub struct Acquire(Args);

impl Acquire {
    /// An acquire of `cost` tokens that may wait up to `max_wait`, refused as the store refuses
    /// it: [`StoreError::ZeroCost`] and [`StoreError::CostAboveBurst`].
    pub fn new(limit: Limit, cost: u32, max_wait: Duration) -> Result<Self, StoreError> {
        check_cost(&limit, cost)?;
        Ok(Self(Args {
            op: Op::Acquire,
            limit,
            x: u64::from(cost),
            max_wait: whole_ms(max_wait),
        }))
    }

    /// The `EVALSHA` of this acquire on `key`, under `store`'s prefix, at `now` (milliseconds
    /// since the Unix epoch): the command the store sends. Redis must hold the [`script`]
    /// already, since nothing falls back to `EVAL` here.
    pub fn command<C, K>(&self, store: &RedisStore<C, K>, key: &BucketKey, now: u64) -> Cmd {
        let redis_key = RedisKey {
            prefix: &store.prefix,
            key,
        };
        self.command_for(redis_key, now)
    }

    fn command_for(&self, redis_key: RedisKey<'_>, now: u64) -> Cmd {
        command("EVALSHA", script().get_hash(), redis_key, &self.0.pack(now))
    }

    /// Whether the script's `reply` to this acquire, sent at `now`, admitted it; a reply the
    /// store would refuse is the error the store gives for it.
    pub fn admitted(&self, reply: &Value, now: u64) -> Result<bool, StoreError> {
        parse_reply(reply, &self.0, now).map(|reply| reply.outcome.allowed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::redis::wire::tests::{NOW, acquire, denial_of, state};

    #[test]
    fn an_acquire_made_outside_the_store_is_the_stores_own() {
        let limit = Limit::per_second(10).expect("a limit");
        assert!(matches!(
            Acquire::new(limit, 0, Duration::ZERO),
            Err(StoreError::ZeroCost)
        ));
        assert!(matches!(
            Acquire::new(limit, 11, Duration::ZERO),
            Err(StoreError::CostAboveBurst {
                cost: 11,
                burst: 10
            })
        ));
        let made = Acquire::new(limit, 1, Duration::ZERO).expect("a cost of 1");
        assert_eq!(made.0.pack(NOW), acquire().pack(NOW));
        let waits = Acquire::new(limit, 2, Duration::from_millis(1500)).expect("a cost of 2");
        assert_eq!((waits.0.x, waits.0.max_wait), (2, 1500));

        let key = BucketKey::new("orders", "seller-7").expect("a key");
        let redis_key = RedisKey {
            prefix: "app",
            key: &key,
        };
        let sent = made.command_for(redis_key, NOW);
        let store_sends = command(
            "EVALSHA",
            script().get_hash(),
            redis_key,
            &acquire().pack(NOW),
        );
        assert_eq!(sent.get_packed_command(), store_sends.get_packed_command());

        assert_eq!(made.admitted(&state(9.0, NOW as f64), NOW).ok(), Some(true));
        assert_eq!(
            made.admitted(&denial_of(0.0, NOW as f64), NOW).ok(),
            Some(false)
        );
        assert!(matches!(
            made.admitted(&Value::Int(1), NOW),
            Err(StoreError::Backend(_))
        ));
    }
}
