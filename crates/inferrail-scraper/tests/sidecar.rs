//! The sidecar binary against a real simulator, followed by the router's
//! client; killed and restarted, the follower reconnects by itself.
#![allow(missing_docs)]
#![allow(clippy::unwrap_used, reason = "a test: a failed step is the failure report")]

use std::io::BufRead;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use inferrail_load::{Engine, LoadTable};
use tonic::transport::Endpoint;

/// A process killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        self.0.kill().ok();
        self.0.wait().ok();
    }
}

/// Spawns `bin` and reads the `<prefix>ip:port` line it prints once listening.
fn spawn(bin: &PathBuf, args: &[&str], prefix: &str) -> (Proc, SocketAddr) {
    let child = Command::new(bin).args(args).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap();
    let mut proc = Proc(child);
    let stdout = proc.0.stdout.take().unwrap();
    let line = std::io::BufReader::new(stdout).lines().next().unwrap().unwrap();
    let addr = line.strip_prefix(prefix).unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    (proc, addr.trim_end_matches('/').parse().unwrap())
}

/// `$INFERRAIL_SIM`, or the workspace's debug build of the simulator (built if absent).
fn sim_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("INFERRAIL_SIM") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().unwrap();
    let sim = exe.parent().and_then(|d| d.parent()).unwrap().join("inferrail-sim");
    if !sim.exists() {
        let status = Command::new(env!("CARGO")).args(["build", "--quiet", "-p", "inferrail-sim"]).status().unwrap();
        assert!(status.success(), "cargo build -p inferrail-sim failed");
    }
    sim
}

fn start_sidecar(listen: &str, replica: &str) -> Proc {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_inferrail-scraper"));
    spawn(&bin, &["--listen", listen, "--replica", replica], "inferrail-scraper listening on ").0
}

async fn eventually(limit: Duration, mut ok: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if ok() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_follower_sees_fresh_snapshots_across_a_sidecar_restart() {
    let (_sim, sim_addr) =
        spawn(&sim_binary(), &["--port", "0", "--block-size", "32", "--zero-latency"], "inferrail-sim listening on http://");
    // A port that is free now, so that the restarted sidecar listens where the first did.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let listen = format!("127.0.0.1:{port}");
    let replica = format!("sim-1={sim_addr}");
    let sidecar = start_sidecar(&listen, &replica);

    let table = LoadTable::new();
    let endpoint = Endpoint::from_shared(format!("http://{listen}")).unwrap();
    let follower = tokio::spawn(inferrail_proto::follow(endpoint, table.clone()));
    let fresh = || table.get("sim-1").is_some_and(|s| s.age(Instant::now()) < Duration::from_millis(250));
    assert!(eventually(Duration::from_secs(5), fresh).await, "no fresh snapshot through the sidecar");
    let load = table.get("sim-1").unwrap().load;
    assert_eq!((load.engine, load.running), (Engine::Vllm, 0));
    assert_eq!(load.cache.map(|c| c.block_size), Some(32));

    drop(sidecar);
    let stale = || table.get("sim-1").is_some_and(|s| s.age(Instant::now()) > Duration::from_millis(300));
    assert!(eventually(Duration::from_secs(3), stale).await, "snapshots kept coming with the sidecar dead");

    let _sidecar = start_sidecar(&listen, &replica);
    assert!(eventually(Duration::from_secs(5), fresh).await, "the follower did not reconnect");
    follower.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn its_own_metrics_page_counts_scrapes_and_failures_per_replica() {
    let (_sim, sim_addr) = spawn(&sim_binary(), &["--port", "0", "--zero-latency"], "inferrail-sim listening on http://");
    // Nothing listens on a port just freed: every scrape of `gone` fails.
    let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let metrics = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_inferrail-scraper"));
    let args = ["--listen", "127.0.0.1:0", "--metrics-listen", &metrics.to_string()];
    let (sim_arg, gone_arg) = (format!("sim-1={sim_addr}"), format!("gone={gone}"));
    let _sidecar = spawn(&bin, &[&args[..], &["--replica", &sim_arg, "--replica", &gone_arg]].concat(), "inferrail-scraper listening on ");
    let page = || async { reqwest::get(format!("http://{metrics}/metrics")).await.ok()?.text().await.ok() };
    let mut text = String::new();
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        text = page().await.unwrap_or_default();
        if text.contains(r#"inferrail_scrape_errors_total{replica="gone""#) && text.contains(r#"inferrail_scrapes_total{replica="sim-1"}"#)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(text.contains(r#"inferrail_scrapes_total{replica="sim-1"}"#), "{text}");
    assert!(text.contains(r#"inferrail_scrape_seconds{replica="sim-1",quantile="0.5"}"#), "{text}");
    assert!(text.contains(r#"inferrail_scrape_errors_total{replica="gone",reason="http"}"#), "{text}");
    assert!(!text.contains(r#"inferrail_scrape_errors_total{replica="sim-1""#), "the live engine never failed: {text}");
}
