//! Starting and stopping the whole service: the ext_proc gRPC server (with
//! the gRPC health service), the admin listener and the background loops.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use arc_swap::ArcSwap;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use inferrail_config::Config;
use inferrail_proto::peer::v1::peer_server::PeerServer;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use opentelemetry_proto::tonic::collector::logs::v1::logs_service_server::LogsServiceServer;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

use crate::access_log::AccessLog;
use crate::discovery::{dns, eds, kubernetes};
use crate::extproc::ExtProc;
use crate::front::Front;
use crate::health::{cards, grpc, probe};
use crate::peers::dial::{self, Dns};
use crate::peers::service::PeerService;
use crate::router::Router;
use crate::{admin, explain, kv_events, load};

/// A started service.
pub struct Running {
    /// Where the ext_proc server listens.
    pub grpc: SocketAddr,
    /// Where the admin listener listens.
    pub admin: SocketAddr,
    /// Where the admin gRPC listener (Explain, Replicas) listens.
    pub admin_grpc: SocketAddr,
    /// The router, for tests that look inside.
    pub router: Arc<Router>,
    /// The router with what a transport needs beside it, for a transport in
    /// the same process (the dynamic module).
    pub front: Front,
    server: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    stopping: tokio::sync::oneshot::Receiver<()>,
    grace: Duration,
    background: Vec<tokio::task::JoinHandle<()>>,
}

/// Accepted connections with Nagle's algorithm off: every ext_proc message
/// is latency, and Nagle with delayed ACKs would hold some for 40 ms.
fn nodelay(listener: TcpListener) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt;
    TcpListenerStream::new(listener).map(|accepted| {
        let stream = accepted?;
        stream.set_nodelay(true)?;
        Ok(stream)
    })
}

/// Installs the process-wide Prometheus recorder once; later calls reuse it.
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: std::sync::OnceLock<PrometheusHandle> = std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            // Another recorder installed first (a test harness) keeps working; ours then renders nothing.
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}

/// Delivers the requests' deadlines every 100 ms: an ended request's outcome
/// is counted at most 100 ms after its grace.
async fn sweep_loop(router: Arc<Router>) {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        router.sweep();
    }
}

/// Binds both listeners and starts serving; stops accepting streams when
/// `shutdown` completes, letting open ones finish for the configured grace.
pub async fn start(config: Config, shutdown: impl Future<Output = ()> + Send + 'static) -> anyhow::Result<Running> {
    let grpc_listener = TcpListener::bind(&config.server.listen).await.with_context(|| format!("binding {}", config.server.listen))?;
    let admin_listener = TcpListener::bind(&config.admin.listen).await.with_context(|| format!("binding {}", config.admin.listen))?;
    let admin_grpc_listener =
        TcpListener::bind(&config.admin.grpc_listen).await.with_context(|| format!("binding {}", config.admin.grpc_listen))?;
    let (grpc, admin, admin_grpc) = (grpc_listener.local_addr()?, admin_listener.local_addr()?, admin_grpc_listener.local_addr()?);
    let grace = Duration::from_millis(config.server.shutdown_grace_ms);
    let (stop_tx, stopping) = tokio::sync::oneshot::channel();
    let peer_dns = Dns::new(&config)?;
    let (probe_client, cards_client) = (probe::client(&config)?, cards::client()?);
    let router = Arc::new(Router::new(config)?);
    let models = Arc::new(ArcSwap::from_pointee(cards::models_json(&router, &[])));
    let front = Front::new(router.clone(), models.clone());

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    let ready = router.ready();
    grpc::publish_grpc_health(&health_reporter, ready).await;
    let ext_proc = ExternalProcessorServer::new(ExtProc::new(front.clone())).max_decoding_message_size(64 << 20);
    // Envoy sends every request's whole body on one HTTP/2 connection: with
    // hyper's 1 MiB connection window, twenty 220 KB bodies in flight would
    // wait for window updates, and 16 KB frames cut each into fourteen.
    let closing = router.clone();
    let server = tonic::transport::Server::builder()
        .initial_connection_window_size(64 << 20)
        .initial_stream_window_size(16 << 20)
        .max_frame_size(1 << 20)
        // Envoy resets every stream it stops waiting for (message_timeout).
        // Past h2's default of 20 such resets not yet accepted (its rapid
        // reset guard), the server ended the whole connection, and every
        // stream on it failed: 60 of a cold burst of 2,000 (`bench/stress.py
        // --only streams`), none with this. This port serves Envoy and peers.
        .http2_max_pending_accept_reset_streams(Some(4096))
        .add_service(health_service)
        .add_service(ext_proc)
        .add_service(PeerServer::new(PeerService::new(router.clone())).max_decoding_message_size(64 << 20))
        .add_service(LogsServiceServer::new(AccessLog::new(router.clone())).max_decoding_message_size(64 << 20))
        .serve_with_incoming_shutdown(nodelay(grpc_listener), async move {
            shutdown.await;
            // The peers' streams are not requests in flight: they end now, so the grace waits only for requests.
            closing.peers.close();
            tracing::info!(grace_ms = grace.as_millis() as u64, "shutting down: no new streams, open ones may finish");
            // Nobody waiting for the signal is not an error.
            let _ = stop_tx.send(());
        });
    let server = tokio::spawn(server);
    let admin_grpc_server = tonic::transport::Server::builder()
        .add_routes(explain::services(router.clone())?)
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(admin_grpc_listener));
    // From now on a replica that joins is offered once probed, and, with an EDS file, once that lists it.
    router.hold_joiners.probe.store(true, std::sync::atomic::Ordering::Relaxed);
    router.hold_joiners.eds.store(router.config().eds.path.is_some(), std::sync::atomic::Ordering::Relaxed);
    let background = vec![
        tokio::spawn(async move {
            if let Err(e) = admin_grpc_server.await {
                tracing::error!(error = %e, "the admin gRPC listener stopped");
            }
        }),
        tokio::spawn(admin::serve(admin_listener, router.clone(), metrics_handle())),
        tokio::spawn(probe::probe_loop(router.clone(), probe_client)),
        tokio::spawn(load::run(router.clone())),
        tokio::spawn(load::learn_loop(router.clone())),
        tokio::spawn(kv_events::run(router.clone())),
        tokio::spawn(cards::cards_loop(router.clone(), models, cards_client)),
        tokio::spawn(dns::run(router.clone())),
        tokio::spawn(eds::run(router.clone())),
        tokio::spawn(kubernetes::run(router.clone())),
        tokio::spawn(sweep_loop(router.clone())),
        tokio::spawn(dial::run(router.clone(), peer_dns)),
        tokio::spawn(grpc::grpc_health_loop(router.clone(), health_reporter, ready)),
    ];
    Ok(Running { grpc, admin, admin_grpc, router, front, server, stopping, grace, background })
}

/// How a service stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopped {
    /// Every open stream finished within the grace period (or the server ended on its own).
    Drained,
    /// The grace period ended with streams still open.
    GraceOver,
}

impl Running {
    /// Serves until shutdown, then lets open streams finish for the grace
    /// period, then ends the background work.
    pub async fn wait(mut self) -> anyhow::Result<Stopped> {
        tokio::select! {
            joined = &mut self.server => {
                joined??;
                return Ok(Stopped::Drained);
            }
            _ = &mut self.stopping => {}
        }
        let outcome = tokio::time::timeout(self.grace, self.server).await;
        for task in self.background {
            task.abort();
        }
        let router = self.router.clone();
        // Decision-log lines and spans still queued go out now (spans bounded by the exporter's timeout).
        let flushed = tokio::task::spawn_blocking(move || {
            if let Some(log) = &router.decision_log {
                log.close();
            }
            router.traces.as_ref().map(|t| t.shutdown())
        })
        .await;
        if let Ok(Some(Err(e))) = flushed {
            tracing::warn!(error = %e, "the last traces were not exported");
        }
        match outcome {
            Ok(joined) => {
                joined??;
                Ok(Stopped::Drained)
            }
            Err(_) => {
                tracing::warn!("grace period over with streams still open");
                Ok(Stopped::GraceOver)
            }
        }
    }
}

#[cfg(test)]
mod tests;
