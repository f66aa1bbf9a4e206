//! The `Peer` gRPC service: a peer's stream of what it decided and heard,
//! applied here (its decisions mirrored, its events heard), and its
//! mirrors forgotten when the stream ends.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use inferrail_kv::hash::BlockHash;
use inferrail_proto::peer::v1::peer_message::Kind;
use inferrail_proto::peer::v1::peer_server::Peer;
use inferrail_proto::peer::v1::{Decided, Heard, Hello, PeerMessage};
use inferrail_route::Hold;
use inferrail_route::kv::Prediction;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use super::wire;
use crate::router::Router;

/// Applies what peer `from` said.
fn apply(router: &Router, from: u64, m: Kind) {
    metrics::counter!("inferrail_peer_messages_total", "direction" => "received").increment(1);
    match m {
        Kind::Decided(d) => mirror(router, from, d),
        Kind::Heard(Heard { request, to_decider, event: Some(e), ago_us }) => {
            let Some(event) = wire::event(e) else { return };
            let ago = Duration::from_micros(ago_us);
            if to_decider {
                router.hear_for(None, &request, event, ago);
            } else {
                router.hear_mirror(from, &request, event, ago);
            }
        }
        Kind::Heard(_) | Kind::Hello(_) => {}
    }
}

/// Holds a peer's decision here as it holds it there. A model or replica
/// this router does not know (its discovery has not caught up) is left out.
fn mirror(router: &Router, from: u64, d: Decided) {
    if let Err(why) = sane(&d) {
        metrics::counter!("inferrail_bad_events_total", "source" => "peer", "reason" => why).increment(1);
        tracing::debug!(request = d.request, why, "a peer's decision that cannot be held");
        return;
    }
    let prediction = d.tokenized.then(|| {
        let hashes = d.blocks.chunks_exact(16).map(|c| BlockHash::from_le_bytes(c.try_into().unwrap_or_default())).collect();
        Arc::new(Prediction::of_blocks(d.prompt_tokens as usize, d.output_tokens as usize, d.block_size as usize, hashes))
    });
    let hold = Hold {
        prompt_tokens: Some(d.prompt_tokens as usize),
        prefill: Duration::from_micros(d.prefill_us),
        estimate: Duration::ZERO,
        kv_tokens: d.kv_tokens,
        prediction,
    };
    router.hold_mirror(from, &d.request, &d.model, &d.replica, &hold, d.session.as_deref());
}

/// The most prompt or output tokens, and KV tokens, a peer's decision may
/// name; the largest block size; the longest prefill. Far past any engine's:
/// only a damaged or hostile message goes beyond them.
const MAX_TOKENS: u64 = 1 << 24;
const MAX_BLOCK_SIZE: u32 = 1 << 12;
const MAX_PREFILL_US: u64 = 3_600_000_000;

/// Whether a peer's decision is one this router can hold, or why not.
fn sane(d: &Decided) -> Result<(), &'static str> {
    if d.prompt_tokens > MAX_TOKENS || d.output_tokens > MAX_TOKENS || d.kv_tokens > MAX_TOKENS {
        return Err("bad_tokens");
    }
    if d.prefill_us > MAX_PREFILL_US {
        return Err("bad_prefill");
    }
    if d.tokenized {
        let full = d.prompt_tokens / u64::from(d.block_size.max(1));
        if d.block_size == 0 || d.block_size > MAX_BLOCK_SIZE || !d.blocks.len().is_multiple_of(16) || d.blocks.len() as u64 / 16 > full {
            return Err("bad_blocks");
        }
    }
    Ok(())
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
            let mut closing = router.peers.closing();
            tokio::spawn(async move {
                loop {
                    // This router closing ends the stream: the peer sees it go, and its shutdown waits for nothing.
                    let m = tokio::select! {
                        m = inbound.message() => m,
                        _ = closing.wait_for(|&closed| closed) => break,
                    };
                    let Ok(Some(m)) = m else { break };
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

#[cfg(test)]
mod tests;
