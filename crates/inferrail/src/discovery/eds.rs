//! The fleet as Envoy's EDS, in a file Envoy watches
//! (`eds_config.path_config_source`): every replica the router has, listed
//! or discovered, with its health, `DRAINING` while it drains and
//! `UNHEALTHY` while probes fail or it is ejected.
//!
//! Envoy's own balancing is the path a request takes when the router cannot
//! decide (fail-open); with this file that path skips what the router would
//! skip, and reaches the replicas DNS or Kubernetes found. The file is
//! rewritten, by a rename as Envoy's watch expects, whenever what it says
//! changes, and it outlives the router: one that dies leaves its last word
//! in force.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use inferrail_route::fleet::Fleet;
use serde_json::{Value, json};

use crate::router::Router;

/// The cluster's load assignment as an xDS discovery response, `version` its `version_info`.
pub fn assignment(fleet: &Fleet, cluster: &str, now_ms: u64, version: u64) -> Value {
    let endpoints: Vec<Value> = fleet
        .replicas
        .iter()
        .map(|r| {
            let health = if r.draining() {
                "DRAINING"
            } else if r.healthy(now_ms) {
                "HEALTHY"
            } else {
                "UNHEALTHY"
            };
            let address = json!({"socket_address": {"address": r.addr.ip().to_string(), "port_value": r.addr.port()}});
            json!({"endpoint": {"address": address, "hostname": r.id}, "health_status": health})
        })
        .collect();
    let load_assignment = json!({
        "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
        "cluster_name": cluster,
        "endpoints": [{"lb_endpoints": endpoints}],
    });
    json!({"version_info": version.to_string(), "resources": [load_assignment]})
}

/// Writes `text` to `path` through a file beside it and a rename.
fn replace(path: &Path, text: &[u8]) -> std::io::Result<()> {
    let mut staged = path.as_os_str().to_owned();
    staged.push(".next");
    std::fs::write(&staged, text)?;
    std::fs::rename(&staged, path)
}

/// Envoy has been told of every replica of `fleet`: the file it reads lists them.
fn announce(fleet: &Fleet) {
    for r in &fleet.replicas {
        r.announce();
    }
}

/// Keeps the configured file saying what the fleet is, checking every 100 ms.
pub async fn run(router: Arc<Router>) {
    let eds = router.config().eds.clone();
    let Some(path) = eds.path else { return };
    let path = Path::new(&path);
    // Versions go on from the clock, so that a restarted router's never repeat its predecessor's.
    let mut version = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let mut said = None;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tick.tick().await;
        let fleet = router.fleet();
        let now = assignment(&fleet, &eds.cluster, router.now_ms(), 0);
        if said.as_ref() == Some(&now) {
            // The file already lists them (a replica that replaced one of the same address and status, say).
            announce(&fleet);
            continue;
        }
        version += 1;
        let mut text = now.clone();
        text["version_info"] = json!(version.to_string());
        let result = match replace(path, text.to_string().as_bytes()) {
            Ok(()) => {
                tracing::info!(path = %path.display(), version, "EDS written");
                announce(&fleet);
                said = Some(now);
                "ok"
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "writing EDS failed; retrying");
                "failed"
            }
        };
        metrics::counter!("inferrail_eds_writes_total", "result" => result).increment(1);
    }
}

#[cfg(test)]
mod tests;
