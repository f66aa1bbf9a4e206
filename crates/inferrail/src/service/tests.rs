//! The whole service on loopback ports: the picker protocol's gRPC health services.

use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

use super::*;

/// A replica that answers its probes with 200 until the task is aborted.
async fn replica() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    use hyper::service::service_fn;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let serve = tokio::spawn(async move {
        let mut connections = tokio::task::JoinSet::new();
        while let Ok((stream, _)) = listener.accept().await {
            let ok = service_fn(|_| async {
                Ok::<_, std::convert::Infallible>(hyper::Response::new(http_body_util::Empty::<bytes::Bytes>::new()))
            });
            connections.spawn(hyper::server::conn::http1::Builder::new().serve_connection(hyper_util::rt::TokioIo::new(stream), ok));
        }
    });
    (addr, serve)
}

fn config(replica: SocketAddr) -> Config {
    Config::parse(&format!(
        "
server: {{listen: '127.0.0.1:0'}}
admin: {{listen: '127.0.0.1:0', grpc_listen: '127.0.0.1:0'}}
health: {{probe_interval_ms: 100, probe_timeout_ms: 100}}
models: [{{name: m}}]
replicas:
  - {{id: r1, address: '{replica}', models: [m]}}
"
    ))
    .unwrap()
}

fn status(r: HealthCheckResponse) -> ServingStatus {
    ServingStatus::try_from(r.status).unwrap()
}

#[tokio::test]
async fn readiness_follows_whether_any_replica_can_take_a_request_and_liveness_stays_up() {
    let (addr, replica) = replica().await;
    let running = start(config(addr), std::future::pending()).await.unwrap();
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", running.grpc)).unwrap().connect().await.unwrap();
    let mut client = HealthClient::new(channel);
    let check = |service: &str| HealthCheckRequest { service: service.into() };
    let mut readiness = client.watch(check("readiness")).await.unwrap().into_inner();
    assert_eq!(status(readiness.message().await.unwrap().unwrap()), ServingStatus::Serving, "its replica answers its probes");
    assert_eq!(
        status(client.check(check("envoy.service.ext_proc.v3.ExternalProcessor")).await.unwrap().into_inner()),
        ServingStatus::Serving
    );
    // The replica goes away (its connections with it): its next probe fails.
    replica.abort();
    assert_eq!(status(readiness.message().await.unwrap().unwrap()), ServingStatus::NotServing, "its only replica is down");
    for service in ["", "envoy.service.ext_proc.v3.ExternalProcessor"] {
        assert_eq!(status(client.check(check(service)).await.unwrap().into_inner()), ServingStatus::NotServing, "{service:?}");
    }
    assert_eq!(status(client.check(check("liveness")).await.unwrap().into_inner()), ServingStatus::Serving);
    assert!(!running.router.ready());
}

/// A router that a peer has linked to stops without waiting out its grace:
/// the peer's stream into it is not a request in flight. The grace is a
/// minute; before the fix the peer's stream held the shutdown open for all
/// of it and `wait` answered `GraceOver`.
#[tokio::test]
async fn a_router_with_a_linked_peer_stops_without_waiting_out_its_grace() {
    let (addr, _replica) = replica().await;
    let mut dialed = config(addr);
    dialed.server.shutdown_grace_ms = 60_000;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let dialed = start(dialed, async move { drop(stopped.await) }).await.unwrap();
    let mut dialing = config(addr);
    dialing.peers.addresses = vec![dialed.grpc.to_string()];
    let dialing = start(dialing, std::future::pending()).await.unwrap();
    // Only the dialing side links (the dialed one serves the stream).
    while dialing.router.peers.linked() < 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.send(()).unwrap();
    assert_eq!(dialed.wait().await.unwrap(), Stopped::Drained, "the peer's stream ended with the router");
    // The dialing router saw its peer go.
    while dialing.router.peers.linked() > 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
