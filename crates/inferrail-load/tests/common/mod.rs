//! What the scraper's integration tests share: hand-written HTTP servers that
//! misbehave on purpose, a real `inferrail-sim` process, and the error counter.
#![allow(dead_code, missing_docs)]
#![allow(clippy::unwrap_used, reason = "test helpers: a failed step is the failure report")]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock, PoisonError};

use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub const VLLM_PAGE: &str = include_str!("../../../../sim/tests/fixtures/vllm-0.32.0/metrics-under-load.txt");

/// How a test server answers every request.
#[derive(Debug, Clone, Copy)]
pub enum Behaviour {
    /// The recorded vLLM page, promptly.
    Healthy,
    /// Reads the request and never answers.
    Hang,
    /// A page of `n` bytes with its length announced.
    Huge(usize),
    /// A chunked page of `n` bytes with no length announced.
    ChunkedHuge(usize),
    /// A chunked page that never ends.
    Endless,
    /// An HTML error page with status 200.
    Html,
}

/// Starts a server on a free port; it lives as long as the runtime.
pub async fn serve(behaviour: Behaviour) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((conn, _)) = listener.accept().await else { return };
            tokio::spawn(answer(conn, behaviour));
        }
    });
    addr
}

/// Answers requests on one connection until it closes.
async fn answer(mut conn: TcpStream, behaviour: Behaviour) {
    let mut buf = vec![0u8; 4096];
    loop {
        // Good enough for GETs without bodies: one read holds the request head.
        match conn.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let ok = match behaviour {
            Behaviour::Healthy => page(&mut conn, VLLM_PAGE.as_bytes()).await,
            Behaviour::Html => page(&mut conn, b"<html><body>Service Unavailable</body></html>").await,
            Behaviour::Hang => {
                std::future::pending::<()>().await;
                false
            }
            Behaviour::Huge(n) => {
                let head = format!("HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {n}\r\n\r\n");
                write_all(&mut conn, head.as_bytes()).await && filler(&mut conn, Some(n)).await
            }
            Behaviour::ChunkedHuge(n) => chunked(&mut conn, Some(n)).await,
            Behaviour::Endless => chunked(&mut conn, None).await,
        };
        if !ok {
            return;
        }
    }
}

async fn write_all(conn: &mut TcpStream, bytes: &[u8]) -> bool {
    conn.write_all(bytes).await.is_ok()
}

async fn page(conn: &mut TcpStream, body: &[u8]) -> bool {
    let head = format!("HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\n\r\n", body.len());
    write_all(conn, head.as_bytes()).await && write_all(conn, body).await
}

/// Writes `n` bytes of metric-looking lines (forever if `None`).
async fn filler(conn: &mut TcpStream, n: Option<usize>) -> bool {
    let line = b"vllm:filler_total{engine=\"0\"} 1.0\n".repeat(2000);
    let mut left = n.unwrap_or(usize::MAX);
    while left > 0 {
        let k = left.min(line.len());
        if !write_all(conn, &line[..k]).await {
            return false;
        }
        left -= k;
    }
    true
}

async fn chunked(conn: &mut TcpStream, n: Option<usize>) -> bool {
    let head = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ntransfer-encoding: chunked\r\n\r\n";
    if !write_all(conn, head).await {
        return false;
    }
    let chunk = b"vllm:filler_total{engine=\"0\"} 1.0\n".repeat(2000);
    let mut left = n.unwrap_or(usize::MAX);
    while left > 0 {
        let k = left.min(chunk.len());
        let frame = [format!("{k:x}\r\n").as_bytes(), &chunk[..k], b"\r\n"].concat();
        if !write_all(conn, &frame).await {
            return false;
        }
        left -= k;
    }
    write_all(conn, b"0\r\n\r\n").await
}

/// The process-wide metrics recorder, installed once per test binary.
fn snapshotter() -> &'static Snapshotter {
    static SNAPSHOTTER: OnceLock<Snapshotter> = OnceLock::new();
    SNAPSHOTTER.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        recorder.install().unwrap();
        snapshotter
    })
}

/// Call before scraping so that the counters are recorded.
pub fn record_metrics() {
    snapshotter();
}

/// `inferrail_scrape_errors_total` for `replica`, by reason, since the binary started.
pub fn scrape_errors(replica: &str) -> Vec<(String, u64)> {
    // The debugging recorder hands out counters' increments since its last snapshot.
    static TOTALS: Mutex<BTreeMap<(String, String), u64>> = Mutex::new(BTreeMap::new());
    let mut totals = TOTALS.lock().unwrap_or_else(PoisonError::into_inner);
    for (key, _, _, value) in snapshotter().snapshot().into_vec() {
        let key = key.key();
        if key.name() != inferrail_load::ERRORS_METRIC {
            continue;
        }
        let label = |k: &str| key.labels().find(|l| l.key() == k).map(|l| l.value().to_string());
        if let (Some(id), Some(reason), DebugValue::Counter(n)) = (label("replica"), label("reason"), value) {
            *totals.entry((id, reason)).or_default() += n;
        }
    }
    totals.iter().filter(|((id, _), n)| id == replica && **n > 0).map(|((_, r), n)| (r.clone(), *n)).collect()
}

/// A process killed when dropped.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        self.0.kill().ok();
        self.0.wait().ok();
    }
}

/// The `inferrail-sim` binary: `$INFERRAIL_SIM`, or the workspace's debug build (built if absent).
pub fn sim_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("INFERRAIL_SIM") {
        return PathBuf::from(p);
    }
    // The test binary is target/debug/deps/<name>; the simulator sits in target/debug.
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap().to_path_buf();
    let sim = dir.join("inferrail-sim");
    if !sim.exists() {
        let status = Command::new(env!("CARGO")).args(["build", "--quiet", "-p", "inferrail-sim"]).status().unwrap();
        assert!(status.success(), "cargo build -p inferrail-sim failed");
    }
    sim
}

/// Starts a real simulator that takes no time on a free port; returns it and its address.
pub fn start_sim() -> (Proc, SocketAddr) {
    start_sim_with(&["--zero-latency"])
}

/// Starts a real simulator with `flags` on a free port; returns it and its address.
pub fn start_sim_with(flags: &[&str]) -> (Proc, SocketAddr) {
    let child = Command::new(sim_binary())
        .args(["--port", "0", "--served-model-name", "tiny-qwen3", "--block-size", "32"])
        .args(flags)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut proc = Proc(child);
    let addr = read_addr(&mut proc, "inferrail-sim listening on http://");
    (proc, addr)
}

/// Reads the `<prefix>ip:port` line a binary prints when it listens.
pub fn read_addr(proc: &mut Proc, prefix: &str) -> SocketAddr {
    use std::io::BufRead;
    let stdout = proc.0.stdout.take().unwrap();
    let mut lines = std::io::BufReader::new(stdout).lines();
    let line = lines.next().unwrap().unwrap();
    let addr = line.strip_prefix(prefix).unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    addr.trim_end_matches('/').parse().unwrap()
}
