//! The router's own gRPC health services, as the Endpoint Picker Protocol
//! names them: whether it can route, kept current.

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::router::Router;

/// The gRPC health services the Endpoint Picker Protocol names besides the
/// overall one (""): `readiness` and the ext_proc service itself say whether
/// the router can route (some replica is healthy), so a gateway stops
/// sending to a picker that could only refuse; `liveness` says it is up.
/// With several routers every one is ready: they route side by side, with
/// no leader to wait for.
pub async fn publish_grpc_health(reporter: &HealthReporter, ready: bool) {
    const READY: [&str; 3] = ["", "readiness", external_processor_server::SERVICE_NAME];
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
