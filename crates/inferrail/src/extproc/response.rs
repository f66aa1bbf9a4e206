//! The response phase, one path for the route and the picker stream: each
//! response message Envoy sends becomes the lifecycle events it tells (the
//! status and who served, the first byte once, the usage in the response's
//! last bytes, the end) and the answer Envoy waits for. The two streams
//! differ only in what they answer and in what their closing means
//! ([`Mode`]).

use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use inferrail_route::lifecycle::{Event, Usage};
use serde::Deserialize;
use tokio::sync::mpsc;
use tonic::Streaming;

use super::envoy::{attribute, served, status};
use super::front::Out;
use crate::reply;
use crate::router::Router;

/// How much of the response's end is kept to read its usage from.
const TAIL: usize = 8 << 10;

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
    first_byte: bool,
    tail: Tail,
}

impl ResponsePhase {
    /// Nothing shown yet.
    pub fn new(mode: Mode) -> Self {
        Self { mode, first_byte: false, tail: Tail::default() }
    }

    /// The answer to one response-phase message, adding what it says of the
    /// request to `events`; `None` for a message that needs none.
    pub fn answer(&mut self, router: &Router, m: ProcessingRequest, events: &mut Vec<Event>) -> Option<ProcessingResponse> {
        Some(match m.request {
            Some(Request::ResponseHeaders(h)) => {
                let served = served(&m.metadata_context).or_else(|| attribute(&m.attributes, "upstream.address"));
                events.extend(status(router, &h, served));
                if h.end_of_stream {
                    self.first_byte(events);
                    events.push(Event::End);
                    reply::continue_response_headers()
                } else if self.mode == (Mode::Route { wants_usage: true }) {
                    // A limited tenant's output tokens are in the body's last bytes.
                    reply::continue_response_headers_then_body()
                } else {
                    reply::continue_response_headers()
                }
            }
            Some(Request::ResponseBody(b)) => {
                self.first_byte(events);
                self.tail.keep(&b.body);
                if b.end_of_stream {
                    events.extend(self.tail.usage().map(Event::Usage));
                    events.push(Event::End);
                }
                match self.mode {
                    // Each chunk is let through at once, so Envoy never waits out its timeout.
                    Mode::Route { .. } => reply::continue_response_body(),
                    Mode::Picker => reply::streamed(true, b.body, b.end_of_stream),
                }
            }
            Some(Request::ResponseTrailers(_)) => {
                events.extend(self.tail.usage().map(Event::Usage));
                events.push(Event::End);
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

    /// The first byte, told once.
    fn first_byte(&mut self, events: &mut Vec<Event>) {
        if !std::mem::replace(&mut self.first_byte, true) {
            events.push(Event::FirstByte);
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

/// A response's last bytes, kept to read its usage from.
#[derive(Default)]
pub struct Tail(Vec<u8>);

impl Tail {
    /// Keeps the last [`TAIL`] bytes (or up to twice that) of what came so far, with `chunk`.
    pub fn keep(&mut self, chunk: &[u8]) {
        self.0.extend_from_slice(&chunk[chunk.len().saturating_sub(TAIL)..]);
        if self.0.len() > 2 * TAIL {
            self.0.drain(..self.0.len() - TAIL);
        }
    }

    /// The usage the response ended with, if it reported one.
    pub fn usage(&self) -> Option<Usage> {
        usage(&self.0)
    }
}

#[derive(Deserialize)]
struct UsageJson {
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    prompt_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: u64,
}

/// The last `usage` object in a response's final bytes: an SSE stream's
/// last chunk with usage, or a whole JSON answer's.
pub fn usage(tail: &[u8]) -> Option<Usage> {
    const KEY: &[u8] = b"\"usage\"";
    let at = tail.windows(KEY.len()).rposition(|w| w == KEY)? + KEY.len();
    let rest = &tail[at..];
    let colon = rest.iter().position(|&b| !b.is_ascii_whitespace()).filter(|&i| rest[i] == b':')?;
    let mut values = serde_json::Deserializer::from_slice(&rest[colon + 1..]).into_iter::<Option<UsageJson>>();
    let u = values.next()?.ok()??;
    let cached_tokens = u.prompt_tokens_details.map_or(0, |d| d.cached_tokens);
    Some(Usage { prompt_tokens: u.prompt_tokens, cached_tokens, completion_tokens: u.completion_tokens })
}
