//! The metrics page: the per-replica and per-router gauges, set from the
//! live state each time the page is scraped, and every series recorded,
//! less those of replicas that have left the fleet.

use std::collections::HashSet;

use metrics_exporter_prometheus::PrometheusHandle;

use crate::router::Router;

/// The page as scraped. The recorder keeps a series once it was written, so
/// a replica that left (through discovery or a reload) would stay on the
/// page with its last values: its series are left out instead.
pub fn page(router: &Router, metrics: &PrometheusHandle) -> String {
    publish_gauges(router);
    let fleet = router.fleet();
    let live: HashSet<&str> = fleet.replicas.iter().map(|r| r.id.as_str()).collect();
    let text = metrics.render();
    let mut page = String::with_capacity(text.len());
    for line in text.lines().filter(|l| replica_label(l).is_none_or(|id| live.contains(id))) {
        page.push_str(line);
        page.push('\n');
    }
    page
}

/// The value of a sample line's `replica` label, if it has one.
pub(crate) fn replica_label(line: &str) -> Option<&str> {
    if line.starts_with('#') {
        return None;
    }
    let labels = &line[line.find('{')? + 1..];
    let mut rest = labels;
    loop {
        let (key, after) = rest.split_once("=\"")?;
        let end = after.find('"')?;
        if key == "replica" {
            return Some(&after[..end]);
        }
        rest = after[end + 1..].strip_prefix(',')?;
    }
}

/// Sets the per-replica gauges from the live state; called on each scrape.
fn publish_gauges(router: &Router) {
    let now = router.now_ms();
    for r in &router.fleet().replicas {
        metrics::gauge!("inferrail_replica_healthy", "replica" => r.id.clone()).set(if r.healthy(now) { 1.0 } else { 0.0 });
        metrics::gauge!("inferrail_replica_ejected", "replica" => r.id.clone()).set(if r.ejected(now) { 1.0 } else { 0.0 });
        metrics::gauge!("inferrail_replica_draining", "replica" => r.id.clone()).set(if r.draining() { 1.0 } else { 0.0 });
        metrics::gauge!("inferrail_replica_in_flight", "replica" => r.id.clone()).set(f64::from(r.in_flight()));
        metrics::gauge!("inferrail_replica_pending", "replica" => r.id.clone()).set(f64::from(r.pending()));
        metrics::gauge!("inferrail_replica_prompt_tokens_in_flight", "replica" => r.id.clone()).set(r.prompt_tokens() as f64);
        metrics::gauge!("inferrail_replica_queued_prefill_seconds", "replica" => r.id.clone()).set(r.queued_prefill().as_secs_f64());
        metrics::gauge!("inferrail_kv_index_blocks", "replica" => r.id.clone()).set(router.core.kv.entries_of(r.slot) as f64);
    }
    metrics::gauge!("inferrail_leases").set(router.leases_held() as f64);
    metrics::gauge!("inferrail_kv_index_entries").set(router.core.kv.entries() as f64);
    metrics::gauge!("inferrail_kv_index_bytes").set(router.core.kv.bytes() as f64);
}
