//! Active health checks: every replica's `/health`, probed on an interval
//! with a timeout. A replica that answers with an error is not offered
//! from then on; one whose probes time out or cannot connect, from the
//! `health.unhealthy_probes`-th in a row (as Envoy's `unhealthy_threshold`:
//! one slow probe on a busy host is not a dead engine). Its first
//! successful probe offers it again. A replica that joins the running
//! fleet is offered from its first successful probe, and one that Envoy has
//! not been told of yet (the EDS file) is not probed.

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
        for r in router.fleet().replicas.iter().filter(|r| r.announced()).cloned() {
            let http = http.clone();
            probes.spawn(async move {
                let answer = http.get(format!("http://{}/health", r.addr)).send().await.ok().map(|resp| resp.status().is_success());
                (r, answer)
            });
        }
        while let Some(Ok((r, answer))) = probes.join_next().await {
            let misses = r.probe_missed(answer.is_none());
            if answer.is_none() {
                metrics::counter!("inferrail_probe_misses_total", "replica" => r.id.clone()).increment(1);
            }
            if let Some(ok) = verdict(answer, misses, cfg.unhealthy_probes)
                && r.set_probe(ok)
            {
                tracing::info!(replica = %r.id, healthy = ok, misses, "probe state changed");
            }
        }
    }
}

/// A replica's probe state after a probe: its answer (whether it was a
/// success) sets it; without one (a timeout, a refused connection) it turns
/// unhealthy once `misses` in a row reach `unhealthy_probes`, and stays as
/// it was before that.
fn verdict(answer: Option<bool>, misses: u32, unhealthy_probes: u32) -> Option<bool> {
    match answer {
        Some(ok) => Some(ok),
        None if misses >= unhealthy_probes => Some(false),
        None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::verdict;

    #[test]
    fn an_answer_decides_at_once_and_silence_only_after_enough_probes_in_a_row() {
        assert_eq!(verdict(Some(true), 0, 2), Some(true));
        assert_eq!(verdict(Some(false), 0, 2), Some(false), "an error status marks it unhealthy at once");
        assert_eq!(verdict(None, 1, 2), None, "one probe without an answer changes nothing");
        assert_eq!(verdict(None, 2, 2), Some(false));
        assert_eq!(verdict(None, 5, 2), Some(false));
        assert_eq!(verdict(None, 1, 1), Some(false), "a threshold of one marks it at the first");
    }
}
