//! Active health checks: every replica's `/health`, probed on an interval
//! with a timeout; a replica that fails its probe is not offered.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use inferrail_config::Config;

use crate::router::Router;

/// The probes' HTTP client, with `health.probe_timeout_ms`. One that cannot
/// be built stops start-up: probes without a timeout could hang forever.
pub fn client(config: &Config) -> anyhow::Result<reqwest::Client> {
    reqwest::Client::builder()
        .timeout(Duration::from_millis(config.health.probe_timeout_ms))
        .build()
        .context("cannot build the health probes' HTTP client")
}

/// Probes every replica's `/health` forever, and keeps the per-replica gauges.
pub async fn probe_loop(router: Arc<Router>, http: reqwest::Client) {
    let cfg = router.config().health.clone();
    let mut tick = tokio::time::interval(Duration::from_millis(cfg.probe_interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let mut probes = tokio::task::JoinSet::new();
        for r in router.fleet().replicas.iter().cloned() {
            let http = http.clone();
            probes.spawn(async move {
                let ok = http.get(format!("http://{}/health", r.addr)).send().await.is_ok_and(|resp| resp.status().is_success());
                (r, ok)
            });
        }
        while let Some(Ok((r, ok))) = probes.join_next().await {
            if r.set_probe(ok) {
                tracing::info!(replica = %r.id, healthy = ok, "probe state changed");
            }
        }
    }
}
