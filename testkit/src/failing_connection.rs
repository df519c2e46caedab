//! A redis-rs connection on which every call fails with an I/O error: a Redis that is down,
//! without waiting for a real connection to time out.

/// Every command and pipeline fails with "connection refused".
#[derive(Debug, Clone)]
pub struct FailingConnection;

fn refused() -> redis::RedisError {
    redis::RedisError::from((redis::ErrorKind::Io, "connection refused"))
}

impl redis::aio::ConnectionLike for FailingConnection {
    fn req_packed_command<'a>(
        &'a mut self,
        _: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        Box::pin(async { Err(refused()) })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        _: &'a redis::Pipeline,
        _: usize,
        _: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        Box::pin(async { Err(refused()) })
    }

    fn get_db(&self) -> i64 {
        0
    }
}
