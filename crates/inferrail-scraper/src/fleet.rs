//! Follows the router's fleet: `inferrail.admin.v1.Admin/WatchReplicas` on
//! its admin gRPC listener names every replica the router has, listed or
//! discovered (DNS groups, a Kubernetes pool), and the sidecar scrapes
//! those beside the ones it was given itself. The watch sends the fleet
//! again whenever membership, health or drain changes; a lost stream is
//! reopened with the sidecar stream's backoff (100 ms doubling to 2 s), and
//! the last set stays scraped meanwhile.

use std::net::SocketAddr;

use inferrail_load::Scraper;
use inferrail_proto::admin::v1::ReplicasRequest;
use inferrail_proto::admin::v1::admin_client::AdminClient;
use tonic::transport::Endpoint;

/// Keeps `scraper`'s targets at `listed` plus the router's replicas, forever.
pub async fn follow(router: Endpoint, scraper: &Scraper, listed: &[(String, SocketAddr)]) {
    let ended =
        |_, why: &str, retry_in| tracing::warn!(router = %router.uri(), %why, ?retry_in, "not following the router's fleet; retrying");
    inferrail_proto::follow::reopening(|| watch_once(&router, scraper, listed), ended).await
}

/// One stream's worth of fleets; how many arrived and why it ended.
async fn watch_once(router: &Endpoint, scraper: &Scraper, listed: &[(String, SocketAddr)]) -> (u64, String) {
    let channel = match router.connect().await {
        Ok(c) => c,
        Err(e) => return (0, format!("connect: {e}")),
    };
    let mut stream = match AdminClient::new(channel).watch_replicas(ReplicasRequest {}).await {
        Ok(r) => r.into_inner(),
        Err(status) => return (0, format!("watch: {status}")),
    };
    let mut received = 0;
    loop {
        let fleet = match stream.message().await {
            Ok(Some(f)) => f,
            Ok(None) => return (received, "closed by the router".into()),
            Err(status) => return (received, format!("stream: {status}")),
        };
        received += 1;
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
