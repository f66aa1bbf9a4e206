//! The route filter's stream (BUFFERED request body): the request's
//! headers, then its body, answered with the decision (or the router's own
//! answer); then the response phase until Envoy closes the stream, which
//! it does when the HTTP request is over.

use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpHeaders, ProcessingRequest};
use tokio::sync::mpsc;
use tonic::Streaming;

use super::envoy::subset;
use super::front::{ExtProc, Out, answer_and_drain};
use super::response::{self, Mode};
use crate::{reply, request};

/// Serves one route-filter stream.
pub async fn serve(ext: &ExtProc, first: ProcessingRequest, mut inbound: Streaming<ProcessingRequest>, tx: mpsc::Sender<Out>) {
    let Some(Request::RequestHeaders(HttpHeaders { headers, end_of_stream: mut body_done, .. })) = first.request else { return };
    let head = request::head(headers.as_ref());
    let subset = subset(&first.metadata_context);
    let generation = match ext.own_answer(&head) {
        Ok(generation) => generation,
        Err(answer) => return answer_and_drain(*answer, inbound, tx).await,
    };
    let (request_id, generated) = match head.request_id.clone() {
        Some(id) => (id, false),
        None => (request::new_request_id(), true),
    };
    if !body_done {
        let set: Vec<(&str, &str)> = if generated { vec![("x-request-id", request_id.as_str())] } else { Vec::new() };
        if tx.send(Ok(reply::continue_headers(&set))).await.is_err() {
            return;
        }
    }
    let mut body = Vec::new();
    while !body_done {
        match inbound.message().await {
            Ok(Some(ProcessingRequest { request: Some(Request::RequestBody(b)), .. })) => {
                // A buffered body comes in one message: kept as it came, not copied.
                if body.is_empty() {
                    body = b.body;
                } else {
                    body.extend_from_slice(&b.body);
                }
                body_done = b.end_of_stream;
            }
            Ok(Some(_)) => {}
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
    drop(body);
    let answer = reply::decision(&d, d.request_id != request_id, traceparent.as_deref());
    // If Envoy is gone it no longer needs the answer; the stream's closing still ends the request.
    let _ = tx.send(Ok(answer)).await;
    response::follow(&ext.front.router, &d.request_id, Mode::Route { wants_usage: d.wants_usage }, &mut inbound, &tx).await;
}
