//! Several routers, one ledger (ADR 0034): each router opens a `Peer/Share`
//! stream to every other router behind the same Envoys and tells it, in
//! order, every request it decided and everything it heard of them; the
//! peer mirrors those requests in its own ledger (their slots, queued
//! prefill and KV records), so each router counts the whole fleet's
//! requests in flight and predicts the caches from every router's
//! decisions. What a router hears of a request another decided (Envoy
//! balances each ext_proc stream on its own) goes to the decider, whose id
//! travels in the request's `inferrail` metadata; the decider applies it
//! and tells the rest. A request's outcome is counted once, where it was
//! decided. When a peer goes, its mirrors are forgotten: nobody is left to
//! tell their end.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inferrail_kv::hash::BlockHash;
use inferrail_proto::peer::v1::heard::Event as WireEvent;
use inferrail_proto::peer::v1::peer_client::PeerClient;
use inferrail_proto::peer::v1::peer_message::Kind;
use inferrail_proto::peer::v1::peer_server::Peer;
use inferrail_proto::peer::v1::{Decided, Heard, Hello, PeerMessage, Status as WireStatus, Usage as WireUsage};
use inferrail_route::fleet::Lease;
use inferrail_route::kv::Prediction;
use inferrail_route::lifecycle::{Event, Usage};
use inferrail_route::{Hold, Share};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use crate::router::Router;

/// Messages waiting for one peer; past this they are dropped (and counted)
/// rather than hold up a request.
const QUEUE: usize = 16_384;

/// This router's id and its streams to its peers.
pub struct Peers {
    /// Drawn at start: a restarted router is a new peer.
    pub id: u64,
    /// The stream to each linked peer. A plain map under a lock, not a
    /// papaya one: a sender taken out must drop at once, since that is what
    /// ends the stream (papaya would keep it until its epoch is reclaimed).
    links: Mutex<HashMap<u64, mpsc::Sender<PeerMessage>>>,
    /// This router's [`Share`] (how many routers are linked, and its rank
    /// among them), read without the lock on every decision: packed, rank
    /// in the high half, count in the low.
    share: AtomicU64,
    /// The task keeping each peer address's stream open.
    tasks: Mutex<HashMap<String, tokio::task::JoinHandle<()>>>,
    /// Addresses that turned out to be this router's own.
    selves: Mutex<Vec<String>>,
    closed: AtomicBool,
}

impl Peers {
    /// No peers yet; the id is drawn from the time, the process and `salt` (the listen address).
    pub fn new(salt: &str) -> Self {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let id = xxhash_rust::xxh3::xxh3_64(format!("{nanos}/{}/{salt}", std::process::id()).as_bytes());
        metrics::gauge!("inferrail_peers").set(0.0);
        Self {
            id,
            links: Mutex::new(HashMap::new()),
            share: AtomicU64::new(1),
            tasks: Mutex::new(HashMap::new()),
            selves: Mutex::new(Vec::new()),
            closed: AtomicBool::new(false),
        }
    }

    /// Ends every stream to the peers for good (the router is going): they
    /// forget the requests it decided.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        for (_, task) in lock(&self.tasks).drain() {
            task.abort();
        }
        let mut links = lock(&self.links);
        links.clear();
        self.relinked(&links);
    }

    /// Whether some peer is linked.
    pub fn any(&self) -> bool {
        self.linked() > 0
    }

    /// Peers linked now.
    pub fn linked(&self) -> usize {
        self.share().of as usize - 1
    }

    /// Tells every linked peer.
    pub fn tell_all(&self, kind: Kind) {
        let m = PeerMessage { kind: Some(kind) };
        for link in lock(&self.links).values() {
            send(link, m.clone());
        }
    }

    /// Tells peer `peer`; false when it is not linked.
    pub fn tell(&self, peer: u64, kind: Kind) -> bool {
        match lock(&self.links).get(&peer) {
            Some(link) => {
                send(link, PeerMessage { kind: Some(kind) });
                true
            }
            None => false,
        }
    }

    /// Links `peer` through `tx`, unless this router is closing, first
    /// telling it the requests in flight that this router decided
    /// (`in_flight`). Under the links' lock, so that every decision after
    /// them reaches the peer too (one told twice is mirrored once).
    fn link(&self, peer: u64, tx: &mpsc::Sender<PeerMessage>, in_flight: impl FnOnce() -> Vec<Kind>) {
        let mut links = lock(&self.links);
        if !self.closed.load(Ordering::SeqCst) {
            for kind in in_flight() {
                send(tx, PeerMessage { kind: Some(kind) });
            }
            links.insert(peer, tx.clone());
        }
        self.relinked(&links);
    }

    /// Keeps this router's share (and the gauge of peers linked) current after the links changed.
    fn relinked(&self, links: &HashMap<u64, mpsc::Sender<PeerMessage>>) {
        let rank = links.keys().filter(|&&p| p < self.id).count() as u64;
        self.share.store(rank << 32 | (links.len() as u64 + 1), Ordering::SeqCst);
        metrics::gauge!("inferrail_peers").set(links.len() as f64);
    }

    /// Where this router stands among the routers linked now (itself and
    /// its peers, in the order of their ids): its part of every limit.
    pub fn share(&self) -> Share {
        let packed = self.share.load(Ordering::Relaxed);
        Share { rank: (packed >> 32) as u32, of: packed as u32 }
    }

    /// Unlinks `peer` if `tx` is still its link (it may have linked again meanwhile).
    fn unlink(&self, peer: u64, tx: &mpsc::Sender<PeerMessage>) {
        let mut links = lock(&self.links);
        if links.get(&peer).is_some_and(|l| l.same_channel(tx)) {
            links.remove(&peer);
        }
        self.relinked(&links);
    }
}

fn send(link: &mpsc::Sender<PeerMessage>, m: PeerMessage) {
    match link.try_send(m) {
        Ok(()) => metrics::counter!("inferrail_peer_messages_total", "direction" => "sent").increment(1),
        Err(_) => metrics::counter!("inferrail_peer_messages_dropped_total").increment(1),
    }
}

/// A request this router decided, as its peers are told it: what its lease
/// holds now (a request past its first byte has no prefill queued), and the
/// conversation it names.
pub fn decided(router: &Router, request: &str, lease: &Lease, session: Option<&str>) -> Kind {
    let block_size = router.core.block_size(&lease.replica);
    let hold = lease.hold();
    let (output, blocks) = match &hold.prediction {
        Some(p) => (p.output_tokens(), p.blocks(block_size).unwrap_or_default().iter().flat_map(|h| h.to_le_bytes()).collect()),
        None => (0, Vec::new()),
    };
    Kind::Decided(Decided {
        request: request.to_string(),
        model: router.core.model(lease.model).name.clone(),
        replica: lease.replica.id.clone(),
        prompt_tokens: lease.prompt_tokens,
        tokenized: hold.prediction.is_some(),
        output_tokens: output as u64,
        block_size: block_size as u32,
        blocks,
        prefill_us: hold.prefill.as_micros() as u64,
        kv_tokens: hold.kv_tokens,
        session: session.map(str::to_owned),
    })
}

/// An event of request `request` that happened `ago`, as a peer is told it.
pub fn heard(request: &str, event: Event, to_decider: bool, ago: Duration) -> Option<Kind> {
    let event = match event {
        Event::Status { code, served_by } => WireEvent::Status(WireStatus { code: u32::from(code), served_by }),
        Event::FirstByte => WireEvent::FirstByte(true),
        Event::Usage(u) => WireEvent::Usage(WireUsage {
            prompt_tokens: u.prompt_tokens,
            cached_tokens: u.cached_tokens,
            completion_tokens: u.completion_tokens,
        }),
        Event::End => WireEvent::End(true),
        Event::Gone => WireEvent::Gone(true),
        // Each router keeps its own time.
        Event::Tick => return None,
    };
    Some(Kind::Heard(Heard { request: request.to_string(), to_decider, event: Some(event), ago_us: ago.as_micros() as u64 }))
}

fn event(e: WireEvent) -> Event {
    match e {
        WireEvent::Status(s) => Event::Status { code: u16::try_from(s.code).unwrap_or(0), served_by: s.served_by },
        WireEvent::FirstByte(_) => Event::FirstByte,
        WireEvent::Usage(u) => {
            Event::Usage(Usage { prompt_tokens: u.prompt_tokens, cached_tokens: u.cached_tokens, completion_tokens: u.completion_tokens })
        }
        WireEvent::End(_) => Event::End,
        WireEvent::Gone(_) => Event::Gone,
    }
}

/// Applies what peer `from` said.
fn apply(router: &Router, from: u64, m: Kind) {
    metrics::counter!("inferrail_peer_messages_total", "direction" => "received").increment(1);
    match m {
        Kind::Decided(d) => mirror(router, from, d),
        Kind::Heard(Heard { request, to_decider, event: Some(e), ago_us }) => {
            let ago = Duration::from_micros(ago_us);
            if to_decider {
                router.hear_for(None, &request, event(e), ago);
            } else {
                router.hear_mirror(from, &request, event(e), ago);
            }
        }
        Kind::Heard(_) | Kind::Hello(_) => {}
    }
}

/// Holds a peer's decision here as it holds it there. A model or replica
/// this router does not know (its discovery has not caught up) is left out.
fn mirror(router: &Router, from: u64, d: Decided) {
    let Some(model) = router.model_index(&d.model) else { return };
    let fleet = router.fleet();
    let Some(replica) = fleet.replicas.iter().find(|r| r.id == d.replica) else { return };
    let prediction = d.tokenized.then(|| {
        let hashes = d.blocks.chunks_exact(16).map(|c| BlockHash::from_le_bytes(c.try_into().unwrap_or_default())).collect();
        Arc::new(Prediction::of_blocks(d.prompt_tokens as usize, d.output_tokens as usize, d.block_size as usize, hashes))
    });
    let hold = Hold {
        prompt_tokens: Some(d.prompt_tokens as usize),
        prefill: Duration::from_micros(d.prefill_us),
        kv_tokens: d.kv_tokens,
        prediction,
    };
    let now = router.now();
    let lease = router.core.mirror(model, replica, &hold, d.session.as_deref(), now);
    router.ledger.mirror(from, &d.request, lease, now);
}

/// The `Peer` service: a peer's stream of what it decided and heard.
#[derive(Clone)]
pub struct PeerService {
    router: Arc<Router>,
}

impl PeerService {
    /// Serves `router`'s side of its peers' streams.
    pub fn new(router: Arc<Router>) -> Self {
        Self { router }
    }
}

type Out = Result<PeerMessage, Status>;

#[tonic::async_trait]
impl Peer for PeerService {
    type ShareStream = Pin<Box<dyn Stream<Item = Out> + Send + 'static>>;

    async fn share(&self, request: tonic::Request<Streaming<PeerMessage>>) -> Result<tonic::Response<Self::ShareStream>, Status> {
        let mut inbound = request.into_inner();
        let me = self.router.peers.id;
        let Ok(Some(PeerMessage { kind: Some(Kind::Hello(Hello { router: from })) })) = inbound.message().await else {
            return Err(Status::invalid_argument("a Share stream opens with Hello"));
        };
        let (tx, rx) = mpsc::channel(1);
        // Ours first; then the stream stays open while this side reads, so the caller sees this router go.
        let _ = tx.try_send(Ok(PeerMessage { kind: Some(Kind::Hello(Hello { router: me })) }));
        if from != me {
            let router = self.router.clone();
            tokio::spawn(async move {
                while let Ok(Some(m)) = inbound.message().await {
                    if let Some(kind) = m.kind {
                        apply(&router, from, kind);
                    }
                }
                let forgotten = router.ledger.forget_decider(from);
                metrics::counter!("inferrail_peer_mirrors_forgotten_total").increment(forgotten as u64);
                tracing::info!(peer = format!("{from:016x}"), forgotten, "a peer's stream ended: its requests are forgotten here");
                drop(tx);
            });
        }
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Keeps a stream open to every peer the configuration names (listed, or
/// resolved from `peers.dns` on its interval), as the configuration is now.
pub async fn run(router: Arc<Router>) {
    let resolver = hickory_resolver::TokioResolver::builder_tokio().and_then(|b| b.build()).ok();
    while !router.peers.closed.load(Ordering::SeqCst) {
        let config = router.config();
        let mut wanted: Vec<String> = config.peers.addresses.clone();
        if let (Some(name), Some(resolver)) = (&config.peers.dns, &resolver)
            && let Some((host, port)) = name.rsplit_once(':')
        {
            match resolver.lookup_ip(host).await {
                Ok(ips) => wanted.extend(ips.iter().map(|ip| SocketAddr::new(ip, port.parse().unwrap_or(0)).to_string())),
                Err(e) => tracing::debug!(error = %e, name, "peers: no answer"),
            }
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
    router.peers.link(peer, &tx, || router.ledger.own().iter().map(|(id, lease)| decided(router, id, lease, None)).collect());
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
