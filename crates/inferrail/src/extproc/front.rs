//! What every request stream shares before the decision, as ext_proc
//! messages: the router's own answers as ImmediateResponses, and the
//! decision ([`crate::front::Front`]) raced against Envoy giving up on the
//! request, with Envoy asked to wait past its `message_timeout` while the
//! request waits in the router's queue or its prefill leg runs.

use std::net::SocketAddr;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use inferrail_tokenize::chat::Endpoint as Generation;
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

use crate::decision::Decision;
use crate::front::Front;
use crate::reply;
use crate::request::Head;

/// What a stream sends back to Envoy.
pub type Out = Result<ProcessingResponse, Status>;

/// Added to a queued request's longest wait when Envoy is asked to wait for its answer.
const WAIT_MARGIN: Duration = Duration::from_secs(1);

/// The service Envoy's ext_proc filters call.
#[derive(Clone)]
pub struct ExtProc {
    /// The router and what deciding needs beside it.
    pub front: Front,
}

impl ExtProc {
    /// Serves `front`'s decisions.
    pub fn new(front: Front) -> Self {
        Self { front }
    }

    /// The answer to a request the router serves itself (models, health, a
    /// wrong method or path), or the generation endpoint it goes to.
    pub fn own_answer(&self, head: &Head) -> Result<Generation, Box<ProcessingResponse>> {
        self.front.own_answer(head).map_err(|a| Box::new(reply::immediate(&a)))
    }

    /// Decides where the request goes ([`Front::decide`]).
    ///
    /// A request that waits in the router's queue asks Envoy, on the
    /// stream's sender, to wait for it past the filter's `message_timeout`;
    /// if Envoy gives up on the request meanwhile (the stream's inbound side
    /// ends: the client left), it leaves the queue at once and `None` is
    /// returned.
    pub async fn decide(
        &self,
        head: &Head,
        body: &[u8],
        generation: Generation,
        request_id: &str,
        subset: Option<&[SocketAddr]>,
        (inbound, tx): (&mut Streaming<ProcessingRequest>, &mpsc::Sender<Out>),
    ) -> Option<Result<(Decision, Option<String>), Box<ProcessingResponse>>> {
        // The margin covers the answer's way back to Envoy once the wait ends.
        let on_wait = |wait: Duration| drop(tx.try_send(Ok(reply::wait(wait + WAIT_MARGIN))));
        let deciding = self.front.decide(head, body, generation, request_id, subset, &on_wait);
        let gone = async {
            // Nothing more comes before the answer unless Envoy is giving up on the request.
            while let Ok(Some(_)) = inbound.message().await {}
        };
        tokio::select! {
            decided = deciding => Some(decided.map_err(|a| Box::new(reply::immediate(&a)))),
            () = gone => None,
        }
    }
}

/// Answers the request itself and reads the stream to its end.
pub async fn answer_and_drain(answer: ProcessingResponse, mut inbound: Streaming<ProcessingRequest>, tx: mpsc::Sender<Out>) {
    // If Envoy is gone it no longer needs the answer.
    let _ = tx.send(Ok(answer)).await;
    while let Ok(Some(_)) = inbound.message().await {}
}
