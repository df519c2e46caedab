//! The connection to the application's Redis, one server or a Cluster, and what the commands
//! need of it beside the store: `SCAN` on every primary, and single commands routed by key.

use std::collections::BTreeSet;
use std::time::Duration;

use burstgate::redis::aio::{ConnectionLike, MultiplexedConnection};
use burstgate::redis::cluster::ClusterClient;
use burstgate::redis::cluster_async::ClusterConnection;
use burstgate::redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use burstgate::redis::{self, Cmd, Pipeline, RedisFuture, Value};

use crate::error::CliError;

/// One Redis, or the primaries of a Cluster behind a cluster-aware connection.
#[derive(Clone)]
pub(crate) enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for Conn {
    // The connections' own Debug may show their address, and a URL may hold a password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Single(_) => "Conn::Single",
            Self::Cluster(_) => "Conn::Cluster",
        })
    }
}

impl Conn {
    /// Connects to the Redis at `urls[0]`, or with `cluster` to the Cluster those nodes belong
    /// to, each call bounded by `timeout`.
    pub(crate) async fn open(
        urls: &[String],
        cluster: bool,
        timeout: Duration,
    ) -> Result<Self, CliError> {
        let (first, rest) = urls.split_first().ok_or(CliError::NoRedisUrl)?;
        if !cluster && !rest.is_empty() {
            return Err(CliError::SeveralUrls { count: urls.len() });
        }
        let mut addrs = Vec::with_capacity(urls.len());
        for (index, url) in urls.iter().enumerate() {
            if url.trim().is_empty() {
                return Err(CliError::NoRedisUrl);
            }
            if url.starts_with("rediss://") && !cfg!(feature = "tls") {
                return Err(CliError::TlsNotBuilt);
            }
            let client =
                redis::Client::open(url.as_str()).map_err(|_| CliError::BadUrl { index })?;
            // Host and port only: the URL's password never reaches a message.
            addrs.push(client.get_connection_info().addr().to_string());
        }
        if cluster {
            let client = ClusterClient::builder(urls.to_vec())
                .connection_timeout(timeout)
                .response_timeout(timeout)
                .retries(1)
                .build()
                .map_err(|_| CliError::BadUrl { index: 0 })?;
            let conn = client
                .get_async_connection()
                .await
                .map_err(|source| CliError::Connect {
                    addr: addrs.join(", "),
                    source,
                })?;
            return Ok(Self::Cluster(conn));
        }
        let client =
            redis::Client::open(first.as_str()).map_err(|_| CliError::BadUrl { index: 0 })?;
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout));
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(|source| CliError::Connect {
                addr: addrs[0].clone(),
                source,
            })?;
        // Redis lets a client without the password connect, and refuses its first command.
        let _: Value = redis::cmd("PING")
            .query_async(&mut conn)
            .await
            .map_err(|source| CliError::Connect {
                addr: addrs[0].clone(),
                source,
            })?;
        // A server in cluster mode answers every key of other slots with MOVED: say so now. A
        // user whose ACL forbids INFO is let through, and meets MOVED if it comes to that.
        let info: Option<String> = redis::cmd("INFO")
            .arg("cluster")
            .query_async(&mut conn)
            .await
            .ok();
        if info.is_some_and(|info| info.lines().any(|l| l.trim() == "cluster_enabled:1")) {
            return Err(CliError::Reply {
                doing: "on connecting",
                what: format!("{} is a node of a Redis Cluster: add --cluster", addrs[0]),
            });
        }
        Ok(Self::Single(conn))
    }

    /// Every key matching the glob `pattern`, on the one server or on each primary of the
    /// Cluster (a key seen twice, on a slot being moved, is listed once), in no set order;
    /// keys that are not UTF-8 are counted in the second value, not listed (no key the
    /// library writes is one).
    pub(crate) async fn scan(&self, pattern: &str) -> Result<(Vec<String>, usize), CliError> {
        let mut keys = BTreeSet::new();
        let mut other = 0;
        let nodes = self.primaries().await?;
        for node in nodes {
            let mut cursor = 0u64;
            loop {
                let mut cmd = redis::cmd("SCAN");
                cmd.arg(cursor)
                    .arg("MATCH")
                    .arg(pattern)
                    .arg("COUNT")
                    .arg(1000);
                let reply = self.on(&node, cmd).await?;
                let (next, batch): (u64, Vec<Vec<u8>>) =
                    redis::from_redis_value(reply).map_err(|e| CliError::Reply {
                        doing: "to SCAN",
                        what: e.to_string(),
                    })?;
                for key in batch {
                    match String::from_utf8(key) {
                        Ok(key) => {
                            keys.insert(key);
                        }
                        Err(_) => other += 1,
                    }
                }
                if next == 0 {
                    break;
                }
                cursor = next;
            }
        }
        Ok((keys.into_iter().collect(), other))
    }

    /// The nodes to scan: the server itself, or each primary of the Cluster as `CLUSTER SLOTS`
    /// lists it (the addresses the cluster client routes by).
    async fn primaries(&self) -> Result<Vec<Option<(String, u16)>>, CliError> {
        let Self::Cluster(conn) = self else {
            return Ok(vec![None]);
        };
        let bad = |what: String| CliError::Reply {
            doing: "to CLUSTER SLOTS",
            what,
        };
        let ranges: Vec<Value> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut conn.clone())
            .await
            .map_err(|source| CliError::Redis {
                doing: "to list the Cluster's primaries",
                source,
            })?;
        let mut primaries = BTreeSet::new();
        for range in ranges {
            let Value::Array(fields) = &range else {
                return Err(bad(format!("{range:?}")));
            };
            let Some(Value::Array(primary)) = fields.get(2) else {
                return Err(bad(format!("{range:?}")));
            };
            let host: String = primary
                .first()
                .and_then(|h| redis::from_redis_value_ref(h).ok())
                .ok_or_else(|| bad(format!("{range:?}")))?;
            let port: u16 = primary
                .get(1)
                .and_then(|p| redis::from_redis_value_ref(p).ok())
                .ok_or_else(|| bad(format!("{range:?}")))?;
            primaries.insert((host, port));
        }
        Ok(primaries.into_iter().map(Some).collect())
    }

    /// `cmd` on `node` (from [`primaries`](Self::primaries)).
    async fn on(&self, node: &Option<(String, u16)>, cmd: Cmd) -> Result<Value, CliError> {
        let failed = |source| CliError::Redis {
            doing: "to SCAN",
            source,
        };
        match (self, node) {
            (Self::Cluster(conn), Some((host, port))) => {
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                });
                conn.clone()
                    .route_command(cmd, routing)
                    .await
                    .map_err(failed)
            }
            _ => cmd.query_async(&mut self.clone()).await.map_err(failed),
        }
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(cmd, offset, count),
            Self::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}
