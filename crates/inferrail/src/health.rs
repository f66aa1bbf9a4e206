//! Background work on the fleet: active `/health` probes, passive ejection
//! when requests fail, per-replica gauges, the router's own gRPC health
//! services, and the engines' model cards for `/v1/models`.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use serde_json::{Value, json};

use crate::extproc::ExtProc;
use crate::router::Router;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use inferrail_route::fleet::{Replica, may_eject};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

/// A request to `replica` failed upstream: count it, and eject the replica
/// after enough failures in a row, within the ejection budget.
pub fn request_failed(router: &Router, replica: &Arc<Replica>) {
    let cfg = &router.config().health;
    if replica.record_failure() < cfg.consecutive_failures {
        return;
    }
    let now = router.now_ms();
    let fleet = router.fleet();
    if may_eject(replica, &fleet.replicas, now, cfg) {
        let ms = replica.eject(now, cfg);
        metrics::counter!("inferrail_ejections_total", "replica" => replica.id.clone()).increment(1);
        tracing::warn!(replica = %replica.id, ejected_ms = ms, "ejected after consecutive failures");
    }
}

/// The gRPC health services the Endpoint Picker Protocol names besides the
/// overall one (""): `readiness` and the ext_proc service itself say whether
/// the router can route (some replica is healthy), so a gateway stops
/// sending to a picker that could only refuse; `liveness` says it is up.
/// With several routers every one is ready: they route side by side, with
/// no leader to wait for.
pub async fn publish_grpc_health(reporter: &HealthReporter, ready: bool) {
    const READY: [&str; 3] = ["", "readiness", <ExternalProcessorServer<ExtProc> as tonic::server::NamedService>::NAME];
    reporter.set_service_status("liveness", ServingStatus::Serving).await;
    let status = if ready { ServingStatus::Serving } else { ServingStatus::NotServing };
    for name in READY {
        reporter.set_service_status(name, status).await;
    }
}

/// Keeps the gRPC health services current (every 100 ms) from what it first published, `ready`.
pub async fn grpc_health_loop(router: Arc<Router>, reporter: HealthReporter, mut ready: bool) {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if router.ready() != ready {
            ready = !ready;
            publish_grpc_health(&reporter, ready).await;
        }
    }
}

/// Probes every replica's `/health` forever, and keeps the per-replica gauges.
pub async fn probe_loop(router: Arc<Router>) {
    let cfg = router.config().health.clone();
    let http = match reqwest::Client::builder().timeout(Duration::from_millis(cfg.probe_timeout_ms)).build() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot build the probe client; active health checks are off");
            return;
        }
    };
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

/// The `/v1/models` answer: configured models in order, then their aliases,
/// with what the engines' own cards say (`max_model_len`, `root`).
pub fn models_json(router: &Router, cards: &[Value]) -> String {
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let card = |name: &str| cards.iter().find(|c| c["id"] == name);
    let mut data = Vec::new();
    let routing = router.routing();
    for m in routing.config.models.iter().filter_map(|m| routing.names.get(&m.name)).map(|&i| router.core.model(i)) {
        let engine = card(&m.name);
        let entry = |id: &str, parent: Option<&str>| {
            json!({
                "id": id, "object": "model", "created": created, "owned_by": "inferrail",
                "root": engine.map_or(json!(m.name), |c| c["root"].clone()),
                "parent": parent,
                "max_model_len": engine.map_or(Value::Null, |c| c["max_model_len"].clone()),
            })
        };
        data.push(entry(&m.name, None));
        data.extend(m.aliases.iter().map(|a| entry(a, Some(&m.name))));
    }
    json!({"object": "list", "data": data}).to_string()
}

/// Refreshes the `/v1/models` answer from the engines' own cards, in the
/// background, so that listing models never waits on an engine.
pub async fn cards_loop(router: Arc<Router>, out: Arc<ArcSwap<String>>) {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).build().unwrap_or_default();
    let mut tick = tokio::time::interval(Duration::from_secs(30));
    loop {
        tick.tick().await;
        let mut cards = Vec::new();
        for r in &router.fleet().replicas {
            let url = format!("http://{}/v1/models", r.addr);
            if let Ok(resp) = http.get(url).send().await
                && let Ok(v) = resp.json::<Value>().await
                && let Some(list) = v["data"].as_array()
            {
                cards.extend(list.iter().cloned());
            }
        }
        out.store(Arc::new(models_json(&router, &cards)));
    }
}
