//! Following a router's WatchReplicas, served here by a stand-in admin service.

use std::pin::Pin;
use std::time::Duration;

use inferrail_load::{LoadTable, ScrapeConfig};
use inferrail_proto::admin::v1::admin_server::{Admin, AdminServer};
use inferrail_proto::admin::v1::{DrainRequest, ExplainRequest, ExplainResponse, Replica, ReplicasResponse};
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

use super::*;

/// A router's admin service whose fleet the test sends.
struct Router {
    fleets: std::sync::Mutex<Option<mpsc::Receiver<Result<ReplicasResponse, Status>>>>,
}

type Fleets = Pin<Box<dyn tokio_stream::Stream<Item = Result<ReplicasResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Admin for Router {
    async fn explain(&self, _: Request<ExplainRequest>) -> Result<Response<ExplainResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }

    async fn replicas(&self, _: Request<ReplicasRequest>) -> Result<Response<ReplicasResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }

    type WatchReplicasStream = Fleets;

    async fn watch_replicas(&self, _: Request<ReplicasRequest>) -> Result<Response<Fleets>, Status> {
        let rx = self.fleets.lock().unwrap().take().ok_or_else(|| Status::unavailable("watched once"))?;
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn drain(&self, _: Request<DrainRequest>) -> Result<Response<Replica>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
}

fn fleet(replicas: &[(&str, &str)]) -> ReplicasResponse {
    let replicas = replicas.iter().map(|(id, address)| Replica { id: id.to_string(), address: address.to_string(), ..Default::default() });
    ReplicasResponse { replicas: replicas.collect() }
}

/// The next scrape of a replica other than `but`.
async fn next_scraped(events: &mut tokio::sync::broadcast::Receiver<inferrail_load::Scrape>, but: &[&str]) -> String {
    loop {
        let s = events.recv().await.unwrap();
        if !but.contains(&&*s.id) {
            return s.id.to_string();
        }
    }
}

#[tokio::test]
async fn the_routers_replicas_are_scraped_beside_the_listed_ones_as_its_fleet_changes() {
    let (tx, rx) = mpsc::channel(4);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = AdminServer::new(Router { fleets: std::sync::Mutex::new(Some(rx)) });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let config = ScrapeConfig { interval: Duration::from_millis(20), timeout: Duration::from_millis(20), max_bytes: 1 << 20 };
    let scraper = std::sync::Arc::new(Scraper::new(config, LoadTable::new()).unwrap());
    let mut events = scraper.subscribe();
    let listed = vec![("listed".to_string(), "127.0.0.1:1".parse().unwrap())];
    let endpoint = Endpoint::from_shared(format!("http://{addr}")).unwrap();
    let following = {
        let scraper = scraper.clone();
        tokio::spawn(async move { follow(endpoint, &scraper, &listed).await })
    };
    // Nothing there answers: each scrape fails, and says which replica it was for.
    tx.send(Ok(fleet(&[("pod-a", "127.0.0.1:2"), ("listed", "127.0.0.1:3")]))).await.unwrap();
    let mut seen = std::collections::HashSet::new();
    while seen.len() < 2 {
        seen.insert(next_scraped(&mut events, &[]).await);
    }
    assert_eq!(seen, ["listed", "pod-a"].map(String::from).into(), "the listed one keeps its own address; the router's joins");
    // The router's fleet changes: pod-b joins.
    tx.send(Ok(fleet(&[("pod-b", "127.0.0.1:4")]))).await.unwrap();
    assert_eq!(next_scraped(&mut events, &["listed", "pod-a"]).await, "pod-b");
    following.abort();
}
