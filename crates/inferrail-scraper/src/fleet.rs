//! Follows the router's fleet: `inferrail.admin.v1.Admin/WatchReplicas` on
//! its admin gRPC listener names every replica the router has, listed or
//! discovered (DNS groups, a Kubernetes pool), and the sidecar scrapes
//! those beside the ones it was given itself. The watch sends the fleet
//! again whenever membership, health or drain changes; a lost stream is
//! reopened after a second, and the last set stays scraped meanwhile.

use std::net::SocketAddr;
use std::time::Duration;

use inferrail_load::Scraper;
use inferrail_proto::admin::v1::ReplicasRequest;
use inferrail_proto::admin::v1::admin_client::AdminClient;
use tonic::transport::Endpoint;

/// Keeps `scraper`'s targets at `listed` plus the router's replicas, forever.
pub async fn follow(router: Endpoint, scraper: &Scraper, listed: &[(String, SocketAddr)]) {
    loop {
        let why = watch_once(&router, scraper, listed).await;
        tracing::warn!(router = %router.uri(), %why, "not following the router's fleet; retrying in 1 s");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// One stream's worth of fleets; why it ended.
async fn watch_once(router: &Endpoint, scraper: &Scraper, listed: &[(String, SocketAddr)]) -> String {
    let channel = match router.connect().await {
        Ok(c) => c,
        Err(e) => return format!("connect: {e}"),
    };
    let mut stream = match AdminClient::new(channel).watch_replicas(ReplicasRequest {}).await {
        Ok(r) => r.into_inner(),
        Err(status) => return format!("watch: {status}"),
    };
    loop {
        let fleet = match stream.message().await {
            Ok(Some(f)) => f,
            Ok(None) => return "closed by the router".into(),
            Err(status) => return format!("stream: {status}"),
        };
        let mut targets = listed.to_vec();
        for r in fleet.replicas {
            match r.address.parse() {
                Ok(addr) if !targets.iter().any(|(id, _)| *id == r.id) => targets.push((r.id, addr)),
                Ok(_) => {}
                Err(_) => tracing::warn!(replica = %r.id, address = %r.address, "not an ip:port; not scraped"),
            }
        }
        tracing::info!(replicas = targets.len(), "scraping the router's fleet");
        scraper.set_targets(targets);
    }
}

#[cfg(test)]
mod tests;
