//! A Redis Cluster for tests: three primaries in cluster mode on free loopback ports, joined
//! with `redis-cli --cluster create`, or the existing cluster `REDIS_CLUSTER_NODES` names
//! (comma-separated `host:port`).
//!
//! [`shared`] starts one cluster per test binary; [`start`] gives a test its own, for tests that
//! break it (killing a node). The nodes are started through `redis_server::spawn`, so they stop
//! when the test binary exits even if it panics; an owned [`Cluster`] also stops its nodes when
//! dropped.

use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::redis_server::{self, Spawned};

/// How many primaries [`start`] runs. Three is the least `redis-cli --cluster create` accepts.
pub const PRIMARIES: usize = 3;

/// Settings every node of a cluster of ours gets. The node timeout is short so a killed node is
/// noticed within a test's run; the default (15 s) would outlast it.
const NODE_ARGS: &str = "--cluster-enabled yes --cluster-node-timeout 2000";

/// One node: its address, and the server when this binary started it.
#[derive(Debug, Clone)]
pub struct Node {
    /// Its host, as clients reach it.
    pub host: String,
    /// Its client port.
    pub port: u16,
    /// The process, when this binary started it (`None` under `REDIS_CLUSTER_NODES`).
    pub server: Option<Spawned>,
    /// False once a test has killed or frozen it: the harness asks it nothing more.
    pub up: bool,
    config_file: Option<String>,
}

impl Node {
    /// `host:port`.
    pub fn addr(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// `redis://host:port/`.
    pub fn url(&self) -> String {
        format!("redis://{}:{}/", self.host, self.port)
    }

    /// A plain (not cluster-aware) connection to this node alone, for the harness and for
    /// tests that look at one node's keys.
    pub fn connection(&self) -> Result<redis::Connection, String> {
        let client =
            redis::Client::open(self.url()).map_err(|e| format!("{}: {e}", self.addr()))?;
        let conn = client
            .get_connection_with_timeout(Duration::from_secs(2))
            .map_err(|e| format!("{}: {e}", self.addr()))?;
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| format!("{}: {e}", self.addr()))?;
        Ok(conn)
    }

    /// Runs one command on this node.
    pub fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, String> {
        let mut conn = self.connection()?;
        cmd.query(&mut conn)
            .map_err(|e| format!("{}: {e}", self.addr()))
    }

    /// This node's cluster id (`CLUSTER MYID`).
    pub fn id(&self) -> Result<String, String> {
        self.query(redis::cmd("CLUSTER").arg("MYID"))
    }
}

/// A running cluster.
#[derive(Debug)]
pub struct Cluster {
    /// Its primaries, in the order they were started (or listed).
    pub nodes: Vec<Node>,
    /// How long the cluster took from the first spawn to `cluster_state:ok` everywhere (zero
    /// for an existing cluster).
    pub started_in: Duration,
}

static SHARED: OnceLock<Result<Cluster, String>> = OnceLock::new();

/// The cluster of this test binary: `REDIS_CLUSTER_NODES` if set, else three primaries of our
/// own, started on first use. Panics, saying how to get one, when there is none.
pub fn shared() -> &'static Cluster {
    let started = SHARED.get_or_init(|| match std::env::var("REDIS_CLUSTER_NODES") {
        Ok(list) if !list.trim().is_empty() => existing(&list),
        _ => launch(""),
    });
    match started {
        Ok(cluster) => cluster,
        Err(why) => panic!("{why}"),
    }
}

/// A cluster of this test's own, with `extra` arguments (shell words) for every node. Always
/// local, whatever `REDIS_CLUSTER_NODES` says: a test that kills a node must own it.
pub fn start(extra: &str) -> Cluster {
    launch(extra).unwrap_or_else(|why| panic!("{why}"))
}

fn existing(list: &str) -> Result<Cluster, String> {
    let mut nodes = Vec::new();
    for addr in list.split(',').map(str::trim).filter(|a| !a.is_empty()) {
        let (host, port) = addr
            .rsplit_once(':')
            .and_then(|(h, p)| Some((h.to_owned(), p.parse::<u16>().ok()?)))
            .ok_or_else(|| format!("REDIS_CLUSTER_NODES: {addr:?} is not host:port"))?;
        nodes.push(Node {
            host,
            port,
            server: None,
            up: true,
            config_file: None,
        });
    }
    if nodes.is_empty() {
        return Err("REDIS_CLUSTER_NODES names no node".into());
    }
    let cluster = Cluster {
        nodes,
        started_in: Duration::ZERO,
    };
    // Replicas the list leaves out are known to the nodes too: no count of known nodes here.
    cluster.wait_until_ok(None, Duration::from_secs(10))?;
    Ok(cluster)
}

fn require(program: &str) -> Result<(), String> {
    let found = Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if found.is_err() {
        return Err(format!(
            "the Redis Cluster tests need `{program}` on PATH: install Redis \
             (`apt-get install redis-server` on Debian brings redis-server and redis-cli), or set \
             REDIS_CLUSTER_NODES to an existing cluster's nodes (host:port,host:port,...)"
        ));
    }
    Ok(())
}

fn launch(extra: &str) -> Result<Cluster, String> {
    require("redis-server")?;
    require("redis-cli")?;
    sweep_stale_config_files();
    let began = Instant::now();
    let mut cluster = Cluster {
        nodes: Vec::new(),
        started_in: Duration::ZERO,
    };
    for _ in 0..PRIMARIES {
        cluster.nodes.push(spawn_node(extra)?);
    }
    let mut create = Command::new("redis-cli");
    create.arg("--cluster").arg("create");
    for node in &cluster.nodes {
        create.arg(node.addr());
    }
    let out = create
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("could not run redis-cli --cluster create: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "redis-cli --cluster create failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    cluster.wait_until_ok(Some(PRIMARIES), Duration::from_secs(20))?;
    cluster.started_in = began.elapsed();
    Ok(cluster)
}

/// Cluster nodes write their view of the cluster to a file (`/tmp/<this><pid>-...conf`). The
/// files of a per-test cluster go when it is dropped; those of the shared cluster outlive the
/// binary, so each run removes the ones whose process is gone.
const CONFIG_PREFIX: &str = "burstgate-cluster-";

fn sweep_stale_config_files() {
    let Ok(dir) = std::fs::read_dir("/tmp") else {
        return;
    };
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(CONFIG_PREFIX))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// One empty cluster-mode node. The cluster bus gets a port of its own: the default, port +
/// 10000, may be taken or above 65535.
fn spawn_node(extra: &str) -> Result<Node, String> {
    let mut last = String::new();
    for _ in 0..5 {
        let bus = redis_server::free_port().map_err(|e| format!("no free loopback port: {e}"))?;
        let config_file = format!(
            "/tmp/{CONFIG_PREFIX}{}-{}.conf",
            std::process::id(),
            redis_server::unique_prefix()
        );
        let args =
            format!("{NODE_ARGS} --cluster-port {bus} --cluster-config-file {config_file} {extra}");
        match redis_server::spawn(&args)
            .and_then(|s| redis_server::wait_for_pong(s.port, Duration::from_secs(10)).map(|()| s))
        {
            Ok(server) => {
                return Ok(Node {
                    host: "127.0.0.1".into(),
                    port: server.port,
                    server: Some(server),
                    up: true,
                    config_file: Some(config_file),
                });
            }
            Err(e) => {
                let _ = std::fs::remove_file(&config_file);
                last = e;
            }
        }
    }
    Err(format!(
        "a cluster-mode redis-server did not come up on a free port: {last}"
    ))
}

impl Cluster {
    /// Every node's URL, for `ClusterClient::new`.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(Node::url).collect()
    }

    /// A cluster-aware async connection (redis-rs's own slot routing, MOVED and ASK handling).
    pub async fn connection(&self) -> redis::cluster_async::ClusterConnection {
        redis::cluster::ClusterClient::new(self.urls())
            .expect("valid cluster node URLs")
            .get_async_connection()
            .await
            .expect("a connection to the test cluster")
    }

    /// The slot of `key` (`CLUSTER KEYSLOT`, asked of the first live node).
    pub fn slot_of(&self, key: &str) -> Result<u16, String> {
        self.ask_any(redis::cmd("CLUSTER").arg("KEYSLOT").arg(key))
    }

    /// The slots of many keys, in order, in one pipeline.
    pub fn slots_of(&self, keys: &[String]) -> Result<Vec<u16>, String> {
        let node = self.live().next().ok_or("no live node")?;
        let mut pipe = redis::pipe();
        for key in keys {
            pipe.cmd("CLUSTER").arg("KEYSLOT").arg(key);
        }
        let mut conn = node.connection()?;
        pipe.query(&mut conn)
            .map_err(|e| format!("{}: {e}", node.addr()))
    }

    /// How many error replies starting with `kind` (say `ASK` or `MOVED`) node `index` has
    /// sent since it started, from `INFO errorstats`.
    pub fn errors_sent_by(&self, index: usize, kind: &str) -> Result<u64, String> {
        let node = &self.nodes[index];
        let info: String = node.query(redis::cmd("INFO").arg("errorstats"))?;
        let prefix = format!("errorstat_{kind}:count=");
        let Some(line) = info.lines().find_map(|l| l.trim().strip_prefix(&prefix)) else {
            return Ok(0);
        };
        let count = line.split(',').next().unwrap_or(line);
        count
            .parse()
            .map_err(|_| format!("{}: unexpected errorstats line {line:?}", node.addr()))
    }

    /// Which of our nodes owns `slot`, as the first live node sees the slot map.
    pub fn owner_of(&self, slot: u16) -> Result<usize, String> {
        let map = self.slot_map()?;
        map.iter()
            .find(|(start, end, _)| (*start..=*end).contains(&slot))
            .map(|&(_, _, node)| node)
            .ok_or_else(|| format!("slot {slot} has no owner"))
    }

    /// `(first slot, last slot, index of the owning node)` per range, from `CLUSTER SLOTS`.
    pub fn slot_map(&self) -> Result<Vec<(u16, u16, usize)>, String> {
        let ranges: Vec<redis::Value> = self.ask_any(redis::cmd("CLUSTER").arg("SLOTS"))?;
        let mut map = Vec::new();
        for range in ranges {
            let bad = || format!("unexpected CLUSTER SLOTS entry: {range:?}");
            let redis::Value::Array(fields) = &range else {
                return Err(bad());
            };
            let (Some(start), Some(end), Some(redis::Value::Array(primary))) =
                (fields.first(), fields.get(1), fields.get(2))
            else {
                return Err(bad());
            };
            let start: u16 = redis::from_redis_value_ref(start).map_err(|_| bad())?;
            let end: u16 = redis::from_redis_value_ref(end).map_err(|_| bad())?;
            let port: u16 = primary
                .get(1)
                .and_then(|p| redis::from_redis_value_ref(p).ok())
                .ok_or_else(bad)?;
            let node = self
                .nodes
                .iter()
                .position(|n| n.port == port)
                .ok_or_else(|| format!("slots {start}-{end} belong to port {port}, not ours"))?;
            map.push((start, end, node));
        }
        Ok(map)
    }

    /// Stops node `index`, which this binary must have started, and waits until its port is
    /// closed.
    pub fn kill(&mut self, index: usize) {
        let node = &mut self.nodes[index];
        let server = node
            .server
            .take()
            .expect("only a node this test binary started can be killed");
        node.up = false;
        redis_server::kill(server);
    }

    /// Stops node `index` (SIGSTOP) without closing anything: its connections stay open and
    /// nothing it is sent is ever answered, as with a host that vanished from the network.
    /// [`Drop`] still ends it (SIGKILL works on a stopped process).
    pub fn freeze(&mut self, index: usize) {
        let node = &mut self.nodes[index];
        let server = node
            .server
            .expect("only a node this test binary started can be frozen");
        node.up = false;
        let stopped = Command::new("kill")
            .arg("-STOP")
            .arg(server.pid.to_string())
            .status()
            .map(|s| s.success());
        assert!(
            matches!(stopped, Ok(true)),
            "could not stop redis-server {}",
            server.pid
        );
    }

    /// Waits until every live node reports `cluster_state:ok`, sees all 16384 slots assigned
    /// and, when `known` is given, knows that many nodes.
    pub fn wait_until_ok(&self, known: Option<usize>, limit: Duration) -> Result<(), String> {
        let deadline = Instant::now() + limit;
        let expected_nodes = known.map(|n| format!("cluster_known_nodes:{n}"));
        loop {
            let mut pending = None;
            for node in self.live() {
                let info: String = match node.query(redis::cmd("CLUSTER").arg("INFO")) {
                    Ok(info) => info,
                    Err(e) => {
                        pending = Some(e);
                        break;
                    }
                };
                let has = |line: &str| info.lines().any(|l| l.trim() == line);
                if !(has("cluster_state:ok")
                    && has("cluster_slots_assigned:16384")
                    && expected_nodes.as_deref().is_none_or(has))
                {
                    pending = Some(format!("{}: {info}", node.addr()));
                    break;
                }
            }
            match pending {
                None => return Ok(()),
                Some(why) if Instant::now() > deadline => {
                    return Err(format!(
                        "the cluster did not settle within {limit:?}: {why}"
                    ));
                }
                Some(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    fn live(&self) -> impl Iterator<Item = &Node> {
        self.nodes.iter().filter(|n| n.up)
    }

    fn ask_any<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T, String> {
        let mut last = String::from("no live node");
        for node in self.live() {
            match node.query(cmd) {
                Ok(v) => return Ok(v),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Moves `slot` from node `from` to node `to` by hand, keys included, as `redis-cli
    /// --cluster reshard` does: IMPORTING on the target, MIGRATING on the source, `MIGRATE`
    /// of the keys in batches of `batch`, then the new owner announced to every node. `pause`
    /// is slept after the slot is marked and after each batch, so clients keep running while
    /// the slot is half moved (their calls get ASK redirections).
    pub fn move_slot(
        &self,
        slot: u16,
        from: usize,
        to: usize,
        batch: usize,
        pause: Duration,
    ) -> Result<MoveReport, String> {
        let (source, target) = (&self.nodes[from], &self.nodes[to]);
        let (source_id, target_id) = (source.id()?, target.id()?);
        let setslot = |node: &Node, state: &str, id: &str| {
            node.query::<()>(
                redis::cmd("CLUSTER")
                    .arg("SETSLOT")
                    .arg(slot)
                    .arg(state)
                    .arg(id),
            )
        };
        setslot(target, "IMPORTING", &source_id)?;
        setslot(source, "MIGRATING", &target_id)?;
        std::thread::sleep(pause);
        let mut report = MoveReport::default();
        loop {
            let keys: Vec<String> = source.query(
                redis::cmd("CLUSTER")
                    .arg("GETKEYSINSLOT")
                    .arg(slot)
                    .arg(batch),
            )?;
            if keys.is_empty() {
                break;
            }
            let mut migrate = redis::cmd("MIGRATE");
            migrate
                .arg(&target.host)
                .arg(target.port)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("KEYS")
                .arg(&keys);
            source.query::<()>(&migrate)?;
            report.keys += keys.len();
            report.batches += 1;
            std::thread::sleep(pause);
        }
        // The target first, so it serves the slot before the source starts sending MOVED
        // there; then the source; then everyone else.
        setslot(target, "NODE", &target_id)?;
        setslot(source, "NODE", &target_id)?;
        for (i, node) in self.nodes.iter().enumerate() {
            if i != from && i != to && node.up {
                setslot(node, "NODE", &target_id)?;
            }
        }
        Ok(report)
    }
}

/// What [`Cluster::move_slot`] did.
#[derive(Debug, Default, Clone, Copy)]
pub struct MoveReport {
    /// How many keys were migrated.
    pub keys: usize,
    /// In how many `MIGRATE` calls.
    pub batches: usize,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(server) = node.server.take() {
                redis_server::kill(server);
            }
            if let Some(file) = node.config_file.take() {
                let _ = std::fs::remove_file(file);
            }
        }
    }
}
