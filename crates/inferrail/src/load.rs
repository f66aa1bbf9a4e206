//! Engine load: keeps the router's table of the engines' reports filled, by
//! reading every replica's `/metrics` here (crate `inferrail-load`) or by
//! following the `inferrail-scraper` sidecar's stream (crate
//! `inferrail-proto`), and acts on what the reports say of each cache: its
//! shape (block size and blocks) and a restart (prefix-cache counters going
//! backwards empty the replica's shadow).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use inferrail_load::scrape::{ScrapeConfig, Scraper};

use crate::router::Router;

/// Fills the load table forever, from the sidecar when one is configured.
pub async fn run(router: Arc<Router>) {
    let cfg = router.config().load.clone();
    if let Some(sidecar) = cfg.sidecar {
        match tonic::transport::Endpoint::from_shared(sidecar.clone()) {
            Ok(endpoint) => {
                tracing::info!(%sidecar, "engine load from the scraper sidecar");
                inferrail_proto::follow::follow(endpoint, router.loads.clone()).await;
            }
            Err(e) => tracing::error!(%sidecar, error = %e, "bad sidecar address; engine load is off"),
        }
        return;
    }
    let scraper = match Scraper::new(ScrapeConfig::from(&cfg), router.loads.clone()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot build the scrape client; engine load is off");
            return;
        }
    };
    let mut fleet = router.fleet();
    scraper.set_targets(fleet.replicas.iter().map(|r| (r.id.clone(), r.addr)));
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let now = router.fleet();
        if !Arc::ptr_eq(&now, &fleet) {
            scraper.set_targets(now.replicas.iter().map(|r| (r.id.clone(), r.addr)));
            fleet = now;
        }
    }
}

/// Reads each replica's newest report as it comes and learns its cache
/// shape, restarts and adapters from it; publishes report ages.
pub async fn learn_loop(router: Arc<Router>) {
    let mut seen: HashMap<String, Instant> = HashMap::new();
    let mut tick = tokio::time::interval(Duration::from_millis(router.config().load.interval_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let fleet = router.fleet();
        seen.retain(|id, _| fleet.replicas.iter().any(|r| &r.id == id));
        for r in &fleet.replicas {
            let Some(s) = router.loads.get(&r.id) else { continue };
            metrics::gauge!("inferrail_engine_report_age_seconds", "replica" => r.id.clone()).set(s.age(Instant::now()).as_secs_f64());
            if seen.get(&r.id) == Some(&s.at) {
                continue;
            }
            seen.insert(r.id.clone(), s.at);
            if let Some(cache) = s.load.cache {
                router.core.learned(r, cache.block_size, cache.blocks);
            }
            if let Some(lora) = &s.load.lora {
                r.learn_adapters(router.clock.since_start(s.at), lora.max_loras, &lora.running, &lora.waiting);
            }
            if let Some(q) = s.load.prefix_queries
                && router.core.prefix_cache_queries(r, q)
            {
                metrics::counter!("inferrail_kv_resets_total", "replica" => r.id.clone()).increment(1);
            }
        }
    }
}
