//! The response phase, one path for the route and the picker stream: each
//! response message Envoy sends becomes the lifecycle events it tells
//! ([`crate::response::Phase`]) and the answer Envoy waits for. The two
//! streams differ only in what they answer and in what their closing means
//! ([`Mode`]).

use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use inferrail_route::lifecycle::Event;
use tokio::sync::mpsc;
use tonic::Streaming;

use super::envoy::{attribute, served};
use super::front::Out;
use crate::response::Phase;
use crate::router::Router;
use crate::{reply, request};

/// Which stream follows the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The route filter's stream: response bodies come only where asked
    /// for (a tenant with token limits, `wants_usage`) and are let through
    /// as they are; the stream closes when the HTTP request is over,
    /// however it ended.
    Route {
        /// Ask for the body after the headers, to read the usage.
        wants_usage: bool,
    },
    /// The picker's full-duplex stream: every chunk is echoed back (Envoy
    /// has let go of it), and a stream that closes before the response's
    /// end means the client went away.
    Picker,
}

/// What the response phase has shown so far.
pub struct ResponsePhase {
    mode: Mode,
    phase: Phase,
}

impl ResponsePhase {
    /// Nothing shown yet.
    pub fn new(mode: Mode) -> Self {
        Self { mode, phase: Phase::default() }
    }

    /// The answer to one response-phase message, adding what it says of the
    /// request to `events`; `None` for a message that needs none.
    pub fn answer(&mut self, router: &Router, m: ProcessingRequest, events: &mut Vec<Event>) -> Option<ProcessingResponse> {
        Some(match m.request {
            Some(Request::ResponseHeaders(h)) => {
                let served = served(&m.metadata_context).or_else(|| attribute(&m.attributes, "upstream.address"));
                let status = request::header(h.headers.as_ref(), ":status");
                self.phase.headers(router, status.as_deref(), served.as_deref(), h.end_of_stream, events);
                if !h.end_of_stream && self.mode == (Mode::Route { wants_usage: true }) {
                    // A limited tenant's output tokens are in the body's last bytes.
                    reply::continue_response_headers_then_body()
                } else {
                    reply::continue_response_headers()
                }
            }
            Some(Request::ResponseBody(b)) => {
                self.phase.body(&b.body, b.end_of_stream, events);
                match self.mode {
                    // Each chunk is let through at once, so Envoy never waits out its timeout.
                    Mode::Route { .. } => reply::continue_response_body(),
                    Mode::Picker => reply::streamed(true, b.body, b.end_of_stream),
                }
            }
            Some(Request::ResponseTrailers(_)) => {
                self.phase.trailers(events);
                reply::continue_trailers(true)
            }
            _ => return None,
        })
    }

    /// What the stream's closing tells: the end (the route stream closes
    /// when the request is over) or, for the picker, the client gone (after
    /// the response's end that changes nothing).
    pub fn closed(&self) -> Event {
        match self.mode {
            Mode::Route { .. } => Event::End,
            Mode::Picker => Event::Gone,
        }
    }
}

/// Follows request `id`'s response on its stream until the stream closes:
/// each message's events are heard before its answer goes, so what Envoy
/// does next finds them done.
pub async fn follow(router: &Router, id: &str, mode: Mode, inbound: &mut Streaming<ProcessingRequest>, tx: &mpsc::Sender<Out>) {
    let (mut phase, mut events) = (ResponsePhase::new(mode), Vec::new());
    while let Ok(Some(m)) = inbound.message().await {
        let answer = phase.answer(router, m, &mut events);
        for event in events.drain(..) {
            router.hear(id, event);
        }
        if let Some(answer) = answer
            && tx.send(Ok(answer)).await.is_err()
        {
            break;
        }
    }
    router.hear(id, phase.closed());
}
