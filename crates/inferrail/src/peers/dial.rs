//! Dials the peers: keeps a `Peer/Share` stream open to every router the
//! configuration names (listed, or found through DNS), reopening each when
//! it ends, and links it once the peer has said who it is.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use inferrail_config::Config;
use inferrail_proto::peer::v1::peer_client::PeerClient;
use inferrail_proto::peer::v1::peer_message::Kind;
use inferrail_proto::peer::v1::{Hello, PeerMessage};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::link::{QUEUE, lock};
use super::wire;
use crate::router::Router;

/// Where the peers are found besides the listed addresses: `peers.dns`'s
/// host, resolved on every interval, and the port they listen on.
pub struct Dns {
    resolver: hickory_resolver::TokioResolver,
    host: String,
    port: u16,
}

impl Dns {
    /// `config`'s `peers.dns` (`host:port`), with a resolver from the
    /// system's configuration; `None` when it names none. A name without a
    /// port, a port that is not a number, or a resolver that cannot be
    /// built stops start-up: the router would otherwise run without the
    /// peers it was told to share with.
    pub fn new(config: &Config) -> anyhow::Result<Option<Self>> {
        let Some(name) = &config.peers.dns else { return Ok(None) };
        let (host, port) = name.rsplit_once(':').with_context(|| format!("peers.dns `{name}`: expected host:port"))?;
        let port = port.parse().with_context(|| format!("peers.dns `{name}`: the port is not a number"))?;
        let resolver = hickory_resolver::TokioResolver::builder_tokio()
            .and_then(|b| b.build())
            .with_context(|| format!("peers.dns `{name}`: cannot build a DNS resolver"))?;
        Ok(Some(Self { resolver, host: host.to_string(), port }))
    }

    /// The peers' addresses the name resolves to now (none when it does not answer).
    async fn lookup(&self) -> Vec<String> {
        match self.resolver.lookup_ip(self.host.as_str()).await {
            Ok(ips) => ips.iter().map(|ip| SocketAddr::new(ip, self.port).to_string()).collect(),
            Err(e) => {
                tracing::debug!(error = %e, host = self.host, "peers: no answer");
                Vec::new()
            }
        }
    }
}

/// Keeps a stream open to every peer the configuration names (listed, or
/// resolved from `dns` on its interval), as the configuration is now.
pub async fn run(router: Arc<Router>, dns: Option<Dns>) {
    while !router.peers.closed.load(Ordering::SeqCst) {
        let config = router.config();
        let mut wanted: Vec<String> = config.peers.addresses.clone();
        if let Some(dns) = &dns {
            wanted.extend(dns.lookup().await);
        }
        let selves = lock(&router.peers.selves).clone();
        wanted.retain(|a| !selves.contains(a));
        {
            let mut tasks = lock(&router.peers.tasks);
            tasks.retain(|addr, task| {
                let keep = wanted.contains(addr);
                if !keep {
                    task.abort();
                }
                keep
            });
            for addr in wanted {
                if !tasks.contains_key(&addr) && !router.peers.closed.load(Ordering::SeqCst) {
                    tasks.insert(addr.clone(), tokio::spawn(link(router.clone(), addr)));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(config.peers.resolve_interval_ms)).await;
    }
}

/// One peer's stream, opened again whenever it ends.
async fn link(router: Arc<Router>, addr: String) {
    let ended = |told: u64, why: &str, retry_in: Duration| {
        tracing::debug!(peer = addr.as_str(), told, why, ?retry_in, "peer stream ended");
    };
    inferrail_proto::follow::reopening(|| link_once(&router, &addr), ended).await
}

/// One connection to the peer at `addr`: 1 and why it ended once linked, else 0.
async fn link_once(router: &Router, addr: &str) -> (u64, String) {
    let endpoint = match tonic::transport::Endpoint::from_shared(format!("http://{addr}")) {
        Ok(e) => e.connect_timeout(Duration::from_millis(500)).tcp_nodelay(true),
        Err(e) => return (0, format!("address: {e}")),
    };
    let channel = match endpoint.connect().await {
        Ok(c) => c,
        Err(e) => return (0, format!("connect: {e}")),
    };
    let me = router.peers.id;
    let (tx, rx) = mpsc::channel(QUEUE);
    let _ = tx.try_send(PeerMessage { kind: Some(Kind::Hello(Hello { router: me })) });
    let mut answers = match PeerClient::new(channel).share(ReceiverStream::new(rx)).await {
        Ok(r) => r.into_inner(),
        Err(e) => return (0, format!("share: {e}")),
    };
    let peer = match answers.message().await {
        Ok(Some(PeerMessage { kind: Some(Kind::Hello(Hello { router: peer })) })) => peer,
        other => return (0, format!("no hello: {other:?}")),
    };
    if peer == me {
        lock(&router.peers.selves).push(addr.to_string());
        return (0, "this router's own address".into());
    }
    router.peers.link(peer, &tx, || router.ledger.own().iter().map(|(id, lease)| wire::decided(&router.core, id, lease, None)).collect());
    tracing::info!(peer = format!("{peer:016x}"), addr, "linked to a peer router");
    let why = loop {
        match answers.message().await {
            Ok(Some(_)) => {}
            Ok(None) => break "closed".to_string(),
            Err(e) => break e.to_string(),
        }
    };
    // Only this link: the peer may have linked again meanwhile.
    router.peers.unlink(peer, &tx);
    (1, why)
}
