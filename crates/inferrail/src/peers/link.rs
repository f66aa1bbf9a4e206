//! This router's id and its streams to its peers: who is linked, what each
//! is told, and this router's [`Share`] of the limits among them.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use inferrail_proto::peer::v1::PeerMessage;
use inferrail_proto::peer::v1::peer_message::Kind;
use inferrail_route::Share;
use tokio::sync::{mpsc, watch};

/// Messages waiting for one peer; past this they are dropped (and counted)
/// rather than hold up a request.
pub(super) const QUEUE: usize = 16_384;

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
    pub(super) tasks: Mutex<HashMap<String, tokio::task::JoinHandle<()>>>,
    /// Addresses that turned out to be this router's own.
    pub(super) selves: Mutex<Vec<String>>,
    pub(super) closed: AtomicBool,
    /// Turns true when the router closes: the peers' streams into it end.
    closing: watch::Sender<bool>,
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
            closing: watch::Sender::new(false),
        }
    }

    /// Ends every stream to and from the peers for good (the router is
    /// going): they forget the requests it decided, and no stream of theirs
    /// holds this router's shutdown open.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.closing.send_replace(true);
        for (_, task) in lock(&self.tasks).drain() {
            task.abort();
        }
        let mut links = lock(&self.links);
        links.clear();
        self.relinked(&links);
    }

    /// Turns true when the router closes ([`Peers::close`]).
    pub fn closing(&self) -> watch::Receiver<bool> {
        self.closing.subscribe()
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
    pub(super) fn link(&self, peer: u64, tx: &mpsc::Sender<PeerMessage>, in_flight: impl FnOnce() -> Vec<Kind>) {
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
    pub(super) fn unlink(&self, peer: u64, tx: &mpsc::Sender<PeerMessage>) {
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

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
