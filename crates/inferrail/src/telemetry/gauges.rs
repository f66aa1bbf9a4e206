//! The per-replica and per-router gauges, set from the live state each
//! time the metrics page is scraped.

use crate::router::Router;

/// Sets the per-replica gauges from the live state; called on each scrape.
pub fn publish_gauges(router: &Router) {
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
