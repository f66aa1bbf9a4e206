//! The full-duplex stream an Inference Extension gateway configures for its
//! endpoint picker (`FULL_DUPLEX_STREAMED` request and response bodies,
//! headers and trailers sent): one stream carries the whole exchange.
//!
//! The request headers are held unanswered until the body has ended: Envoy
//! forwards the headers as soon as they are answered, so the destination
//! must be in that answer. Then the decision answers them (destination
//! header and `envoy.lb` metadata, winner first, then the fallbacks), and
//! the body goes back unchanged, or with the model renamed, in chunks.
//! Then the response phase ([`super::response`]): the status and the
//! endpoint that served (`envoy.lb` `x-gateway-destination-endpoint-served`,
//! or the `upstream.address` attribute), the first byte, the usage in the
//! response's last bytes, and the end, or the client gone when the stream
//! closes first.

use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use inferrail_route::lifecycle::Event;
use tokio::sync::mpsc;
use tonic::Streaming;

use super::envoy::subset;
use super::front::{ExtProc, Out, answer_and_drain};
use super::response::{self, Mode};
use crate::{reply, request};

/// Serves one picker stream.
pub async fn serve(ext: &ExtProc, first: ProcessingRequest, mut inbound: Streaming<ProcessingRequest>, tx: mpsc::Sender<Out>) {
    let Some(Request::RequestHeaders(h)) = first.request else { return };
    let head = request::head(h.headers.as_ref());
    let subset = subset(&first.metadata_context);
    let generation = match ext.own_answer(&head) {
        Ok(generation) => generation,
        Err(answer) => return answer_and_drain(*answer, inbound, tx).await,
    };
    let request_id = head.request_id.clone().unwrap_or_else(request::new_request_id);
    let mut body = Vec::new();
    let mut trailers = false;
    let mut ended = h.end_of_stream;
    while !ended {
        match inbound.message().await {
            Ok(Some(m)) => match m.request {
                Some(Request::RequestBody(b)) => {
                    body.extend_from_slice(&b.body);
                    ended = b.end_of_stream;
                }
                Some(Request::RequestTrailers(_)) => (trailers, ended) = (true, true),
                _ => {}
            },
            // Envoy gave up on the request (client gone, timeout).
            Ok(None) | Err(_) => return,
        }
    }
    let (d, traceparent) = match ext.decide(&head, &body, generation, &request_id, subset.as_deref(), (&mut inbound, &tx)).await {
        Some(Ok(decided)) => decided,
        Some(Err(answer)) => return answer_and_drain(*answer, inbound, tx).await,
        // The client left while the request waited.
        None => return,
    };
    let renamed = head.request_id.as_deref() != Some(d.request_id.as_str());
    let answers = reply::held_decision(&d, renamed, traceparent.as_deref(), d.body.as_deref().unwrap_or(&body), trailers);
    drop(body);
    for answer in answers {
        if tx.send(Ok(answer)).await.is_err() {
            ext.front.router.hear(&d.request_id, Event::Gone);
            return;
        }
    }
    response::follow(&ext.front.router, &d.request_id, Mode::Picker, &mut inbound, &tx).await;
}
