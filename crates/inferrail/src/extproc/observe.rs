//! The observe filter's stream (observability mode, asynchronous, no added
//! latency): the upstream response's status, who served and the first
//! byte, each sent to the router that decided the request.

use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingRequest;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use inferrail_route::lifecycle::Event;
use tonic::Streaming;

use super::envoy::{attribute, decided_by};
use crate::request;
use crate::response::status_event;
use crate::router::Router;

/// Follows one request's upstream response until its first byte.
pub async fn follow(router: &Router, first: ProcessingRequest, mut inbound: Streaming<ProcessingRequest>) {
    let mut request = None;
    let mut message = Some(first);
    while let Some(m) = message {
        match m.request {
            Some(Request::ResponseHeaders(h)) => {
                let found = |name| attribute(&m.attributes, name).or_else(|| attribute(&h.attributes, name));
                let (decider, id) = match decided_by(&m.metadata_context) {
                    Some((decider, id)) => (Some(decider), id),
                    None => match found("request.id") {
                        Some(id) => (None, id),
                        None => return,
                    },
                };
                // A status that is not one tells nothing; the first byte still counts.
                let heard = match status_event(
                    router,
                    request::header(h.headers.as_ref(), ":status").as_deref(),
                    found("upstream.address").as_deref(),
                ) {
                    Some(status) => router.hear_for(decider, &id, status, Duration::ZERO),
                    None => router.lease(&id).is_some() || decider.is_some(),
                };
                if !heard {
                    // Not a request any router tracks (or already over): nothing to learn.
                    return;
                }
                if h.end_of_stream {
                    router.hear_for(decider, &id, Event::FirstByte, Duration::ZERO);
                    return;
                }
                request = Some((decider, id));
            }
            Some(Request::ResponseBody(_)) => {
                if let Some((decider, id)) = &request {
                    router.hear_for(*decider, id, Event::FirstByte, Duration::ZERO);
                }
                // The first byte is all this stream is for.
                return;
            }
            _ => {}
        }
        message = inbound.message().await.ok().flatten();
    }
}
