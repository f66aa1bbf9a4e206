//! The router, once per Envoy process: the first filter configuration
//! loads the routing YAML and starts the whole service on a runtime of its
//! own (background threads, not Envoy's): load reports or the scraper
//! sidecar's stream, KV events, discovery, reloads of the file, peers, the
//! admin listeners with Explain and reflection, metrics, and the ext_proc
//! listener for gateways that speak the picker protocol. Every worker's
//! filters share its one KV index and ledger. Later configurations naming
//! the same file share it too; another file is refused, since one process
//! has one router.

use std::sync::{Arc, Mutex, PoisonError};

use inferrail::front::Front;
use inferrail::router::Router;
use inferrail_config::Config;
use tokio::runtime::Runtime;

use crate::wait::Watchdog;

/// What every filter of the process shares.
#[derive(Clone)]
pub struct Shared {
    /// The router and what deciding needs beside it.
    pub front: Front,
    /// The router's runtime: decisions that must wait go on here.
    pub runtime: Arc<Runtime>,
    /// The routing YAML's path.
    path: Arc<str>,
    /// Keeps the deadlines of paused streams.
    pub watchdog: Arc<Watchdog>,
    /// Where a test asks for a fault (`INFERRAIL_MODULE_FAILPOINT`).
    failpoint: Option<Arc<str>>,
}

/// The routing file a filter configuration names: its text, or the same
/// as a JSON string, as Envoy Gateway writes an `EnvoyExtensionPolicy`'s
/// `config` into the filter's `StringValue`.
pub fn routing_file(config: &str) -> String {
    let config = config.trim();
    serde_json::from_str::<String>(config).unwrap_or_else(|_| config.to_string())
}

/// Whether Envoy runs with `--mode validate`, as its command line says.
fn validating() -> bool {
    let cmdline = std::fs::read("/proc/self/cmdline").unwrap_or_default();
    let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
    args.windows(2).any(|w| w == [b"--mode".as_slice(), b"validate".as_slice()]) || args.contains(&b"--mode=validate".as_slice())
}

/// The process's router, once started.
static STARTED: Mutex<Option<Shared>> = Mutex::new(None);

impl Shared {
    /// The process's router, started from the routing YAML at `path` if it
    /// is not yet running.
    pub fn start(path: &str) -> Result<Self, String> {
        let mut started = STARTED.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(shared) = started.as_ref() {
            if *shared.path != *path {
                return Err(format!("{path}: this Envoy's router already runs from {}; one process has one router", shared.path));
            }
            return Ok(shared.clone());
        }
        let config = Config::load(path).map_err(|e| format!("{path}: {e}"))?;
        if validating() {
            // `envoy --mode validate`: the router is built (its tokenizers
            // loaded) but nothing starts, no listener and no thread.
            let router = Router::new(config).map_err(|e| format!("{path}: {e:#}"))?;
            let runtime = tokio::runtime::Builder::new_current_thread().build().map_err(|e| format!("a runtime: {e}"))?;
            let front = Front::new(Arc::new(router), Arc::default());
            let watchdog = Arc::default();
            let shared = Self { front, runtime: Arc::new(runtime), path: Arc::from(path), watchdog, failpoint: None };
            *started = Some(shared.clone());
            return Ok(shared);
        }
        let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
        // Envoy's stderr gets the router's log; another subscriber set first keeps working.
        let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.server.threads.max(1))
            .thread_name("inferrail")
            .enable_all()
            .build()
            .map_err(|e| format!("the router's runtime: {e}"))?;
        let running = runtime
            .block_on(inferrail::service::start(config, std::future::pending()))
            .map_err(|e| format!("{path}: the router did not start: {e:#}"))?;
        tracing::info!(grpc = %running.grpc, admin = %running.admin, "inferrail serving inside Envoy");
        let (front, router) = (running.front.clone(), running.router.clone());
        runtime.spawn(async move {
            if let Err(e) = running.wait().await {
                tracing::error!(error = %e, "the router's listeners stopped");
            }
        });
        runtime.spawn(inferrail::reload::run(router, path.to_string()));
        let failpoint = std::env::var("INFERRAIL_MODULE_FAILPOINT").ok().map(Arc::from);
        let watchdog = Watchdog::start().map_err(|e| format!("the watchdog thread: {e}"))?;
        let shared = Self { front, runtime: Arc::new(runtime), path: Arc::from(path), watchdog, failpoint };
        *started = Some(shared.clone());
        Ok(shared)
    }

    /// Panics when the failpoint names `hook`: how the tests prove a panic
    /// in a callback leaves Envoy serving.
    pub fn failpoint(&self, hook: &str) {
        if self.failpoint.as_deref() == Some(hook) {
            panic!("failpoint {hook}");
        }
    }

    /// With the failpoint `stall_runtime`, the first decision that needs
    /// the router's runtime finds it stuck: a task holds its one thread
    /// for good. How the tests prove a stream falls open when the runtime
    /// cannot answer.
    pub fn failpoint_stall(&self) {
        static STALLED: std::sync::Once = std::sync::Once::new();
        if self.failpoint.as_deref() == Some("stall_runtime") {
            STALLED.call_once(|| drop(self.runtime.spawn(async { std::thread::sleep(std::time::Duration::MAX) })));
        }
    }
}
