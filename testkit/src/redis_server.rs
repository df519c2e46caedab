//! A Redis for tests: the one `REDIS_URL` names, or a `redis-server` of our own on a free
//! loopback port, started once per test binary and stopped when the binary exits.
//!
//! Shared by the integration tests, the crate's unit tests and the benches.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

static SERVER: OnceLock<Result<String, String>> = OnceLock::new();

/// The URL of a Redis the tests may use. Panics, saying how to get one, when there is none.
pub fn url() -> String {
    match SERVER.get_or_init(start) {
        Ok(url) => url.clone(),
        Err(why) => panic!("{why}"),
    }
}

/// A key prefix no other test, binary or run uses, so tests can share one Redis.
pub fn unique_prefix() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "bgtest-{}-{}-{}",
        std::process::id(),
        nanos,
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// The port of our own server, if we started one (`None` under `REDIS_URL`).
pub fn own_port() -> Option<u16> {
    url();
    OWN_PORT.get().copied()
}

static OWN_PORT: OnceLock<u16> = OnceLock::new();

fn start() -> Result<String, String> {
    if let Ok(url) = std::env::var("REDIS_URL")
        && !url.is_empty()
    {
        return Ok(url);
    }
    let found = Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if found.is_err() {
        return Err(
            "these tests need Redis, and `redis-server` is not on PATH: install it \
                    (`apt-get install redis-server` on Debian) or set REDIS_URL to a running \
                    server"
                .into(),
        );
    }
    let mut last = String::new();
    for _ in 0..5 {
        match spawn("")
            .and_then(|server| wait_for_pong(server.port, Duration::from_secs(10)).map(|()| server))
        {
            Ok(server) => {
                let _ = OWN_PORT.set(server.port);
                return Ok(format!("redis://127.0.0.1:{}/", server.port));
            }
            Err(e) => last = e,
        }
    }
    Err(format!(
        "redis-server did not come up on a free port: {last}"
    ))
}

/// A redis-server this test binary started.
#[derive(Debug, Clone, Copy)]
pub struct Spawned {
    /// The loopback port it listens on.
    pub port: u16,
    /// The process id of the `redis-server`, for [`kill`] and signals.
    pub pid: u32,
}

/// Starts a redis-server on a free loopback port with `extra` arguments (shell words), and
/// waits until the port accepts connections. The server stops when this test binary exits.
pub fn spawn(extra: &str) -> Result<Spawned, String> {
    let port = free_port().map_err(|e| format!("no free loopback port: {e}"))?;
    spawn_on(port, extra)
}

/// [`spawn`] on a given port: to restart a server that a test stopped, on the same port.
pub fn spawn_on(port: u16, extra: &str) -> Result<Spawned, String> {
    use std::io::BufRead;
    // The shell stays beside redis-server and stops it once this test binary has exited,
    // however it exits: a static is never dropped, so no destructor could do it.
    let watchdog = format!(
        "redis-server --port {port} --bind 127.0.0.1 --save '' --appendonly no \
         --dir /tmp --loglevel warning --daemonize no {extra} >/dev/null 2>&1 & rp=$!; \
         echo $rp; trap 'kill $rp 2>/dev/null' EXIT INT TERM; \
         while kill -0 {parent} 2>/dev/null && kill -0 $rp 2>/dev/null; do sleep 0.2; done",
        parent = std::process::id()
    );
    let mut shell = Command::new("sh")
        .arg("-c")
        .arg(&watchdog)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("could not start redis-server: {e}"))?;
    let mut line = String::new();
    if let Some(out) = shell.stdout.take() {
        std::io::BufReader::new(out)
            .read_line(&mut line)
            .map_err(|e| format!("no pid from the redis-server watchdog: {e}"))?;
    }
    let pid: u32 = line
        .trim()
        .parse()
        .map_err(|_| format!("no pid from the redis-server watchdog: {line:?}"))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            return Err(format!(
                "redis-server on port {port} never accepted connections"
            ));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(Spawned { port, pid })
}

/// Stops a server this binary started, by its pid, and waits until its port is free.
pub fn kill(server: Spawned) {
    let _ = Command::new("kill")
        .arg("-9")
        .arg(server.pid.to_string())
        .status();
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", server.port)).is_ok() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> std::io::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// Waits until a server on `port` answers PING.
pub fn wait_for_pong(port: u16, limit: Duration) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    let mut last = String::from("no answer");
    while Instant::now() < deadline {
        match ping(port) {
            Ok(()) => return Ok(()),
            Err(e) => last = e.to_string(),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(format!(
        "no PONG from 127.0.0.1:{port} within {limit:?}: {last}"
    ))
}

fn ping(port: u16) -> std::io::Result<()> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_millis(500)))?;
    s.write_all(b"PING\r\n")?;
    let mut buf = [0u8; 7];
    s.read_exact(&mut buf)?;
    if &buf == b"+PONG\r\n" {
        Ok(())
    } else {
        Err(std::io::Error::other("unexpected reply to PING"))
    }
}
