//! What the simulator's integration tests share: starting one in-process and
//! reading what it says.
#![allow(dead_code, missing_docs)]

use inferrail_sim::Sim;
use inferrail_sim::args::Args;
use serde_json::Value;

/// Flags that make the simulator look like the recorded vLLM server.
pub const LIKE_RECORDING: [&str; 8] = [
    "--served-model-name",
    "tiny-qwen3",
    "--max-model-len",
    "2048",
    "--block-size",
    "32",
    "--enable-prompt-tokens-details",
    "--zero-latency",
];

pub async fn start(extra: &[&str]) -> Sim {
    match Sim::start(Args::for_test(extra)).await {
        Ok(sim) => sim,
        Err(e) => panic!("simulator did not start: {e:#}"),
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().pool_max_idle_per_host(64).build().unwrap_or_default()
}

pub async fn post(sim: &Sim, path: &str, body: &Value) -> (u16, String) {
    let r = client().post(format!("{}{path}", sim.url())).json(body).send().await;
    let r = match r {
        Ok(r) => r,
        Err(e) => panic!("POST {path}: {e}"),
    };
    let status = r.status().as_u16();
    (status, r.text().await.unwrap_or_default())
}

pub async fn get(sim: &Sim, path: &str) -> (u16, String) {
    match client().get(format!("{}{path}", sim.url())).send().await {
        Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
        Err(e) => panic!("GET {path}: {e}"),
    }
}

pub fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// The `data:` payloads of a server-sent event stream, in order.
pub fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).map(str::to_string).collect()
}

/// A sample's value on a metrics page; `labels` as written between the braces.
pub fn metric(page: &str, name: &str, labels: &str) -> f64 {
    let prefix = format!("{name}{{{labels}}} ");
    page.lines().find_map(|l| l.strip_prefix(&prefix)).and_then(|v| v.parse().ok()).unwrap_or(f64::NAN)
}

/// Polls the metrics page until `ok` holds for it; panics after `tries` reads.
pub async fn wait_for_metrics(sim: &Sim, tries: usize, ok: impl Fn(&str) -> bool) -> String {
    let mut page = String::new();
    for _ in 0..tries {
        page = get(sim, "/metrics").await.1;
        if ok(&page) {
            return page;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("metrics never reached the expected state:\n{page}");
}
