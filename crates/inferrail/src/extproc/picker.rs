//! The full-duplex stream an Inference Extension gateway configures for its
//! endpoint picker (`FULL_DUPLEX_STREAMED` request and response bodies,
//! headers and trailers sent): one stream carries the whole exchange.
//!
//! The request headers are held unanswered until the body has ended: Envoy
//! forwards the headers as soon as they are answered, so the destination
//! must be in that answer. Then the decision answers them (destination
//! header and `envoy.lb` metadata, winner first, then the fallbacks), and
//! the body goes back unchanged, or with the model renamed, in chunks.
//! Envoy has let go of every byte it sent, so each response chunk is echoed
//! back as it comes. On the way, the stream's messages become the request's
//! life's events: the status and the endpoint that served (`envoy.lb`
//! `x-gateway-destination-endpoint-served`, or the `upstream.address`
//! attribute), the first byte, the usage in the response's last bytes, and
//! the end, or the client gone when the stream closes first.

use serde::Deserialize;

use super::*;
use inferrail_route::lifecycle::Usage;

/// How much of the response's end is kept to read its usage from.
const TAIL: usize = 8 << 10;

/// Where the gateway reports the endpoint that served.
const SERVED: &str = "x-gateway-destination-endpoint-served";

pub(super) async fn serve(ext: &ExtProc, first: ProcessingRequest, mut inbound: Streaming<ProcessingRequest>, tx: mpsc::Sender<Out>) {
    let Some(Request::RequestHeaders(h)) = first.request else { return };
    let head = request::head(h.headers.as_ref());
    let subset = subset(&first.metadata_context);
    let generation = match ext.own_answer(&head) {
        Ok(generation) => generation,
        Err(answer) => return answer_and_drain(*answer, inbound, tx).await,
    };
    let request_id = head.request_id.clone().unwrap_or_else(new_request_id);
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
    let router = &ext.router;
    for answer in answers {
        if tx.send(Ok(answer)).await.is_err() {
            router.hear(&d.request_id, Event::Gone);
            return;
        }
    }
    let (mut response, mut events) = (Response::default(), Vec::new());
    while let Ok(Some(m)) = inbound.message().await {
        let answer = response.answer(router, m, &mut events);
        // Heard before the answer goes: what Envoy does next finds it done.
        for event in events.drain(..) {
            router.hear(&d.request_id, event);
        }
        if let Some(answer) = answer
            && tx.send(Ok(answer)).await.is_err()
        {
            break;
        }
    }
    // The stream closed: after the response's end this changes nothing.
    router.hear(&d.request_id, Event::Gone);
}

/// Answers the request itself and reads the stream to its end.
async fn answer_and_drain(answer: ProcessingResponse, mut inbound: Streaming<ProcessingRequest>, tx: mpsc::Sender<Out>) {
    // If Envoy is gone it no longer needs the answer.
    let _ = tx.send(Ok(answer)).await;
    while let Ok(Some(_)) = inbound.message().await {}
}

/// What the response phase has shown so far.
#[derive(Default)]
struct Response {
    first_byte: bool,
    tail: Tail,
}

/// A response's last bytes, kept to read its usage from.
#[derive(Default)]
pub(super) struct Tail(Vec<u8>);

impl Tail {
    /// Keeps the last [`TAIL`] bytes (or up to twice that) of what came so far, with `chunk`.
    pub(super) fn keep(&mut self, chunk: &[u8]) {
        self.0.extend_from_slice(&chunk[chunk.len().saturating_sub(TAIL)..]);
        if self.0.len() > 2 * TAIL {
            self.0.drain(..self.0.len() - TAIL);
        }
    }

    /// The usage the response ended with, if it reported one.
    pub(super) fn usage(&self) -> Option<Usage> {
        usage(&self.0)
    }
}

impl Response {
    /// The answer to one response-phase message, adding what it says of the
    /// request to `events`.
    fn answer(&mut self, router: &Router, m: ProcessingRequest, events: &mut Vec<Event>) -> Option<ProcessingResponse> {
        Some(match m.request {
            Some(Request::ResponseHeaders(h)) => {
                events.push(status(router, &h, served(&m.metadata_context).or_else(|| attribute(&m.attributes, "upstream.address"))));
                if h.end_of_stream {
                    events.extend([Event::FirstByte, Event::End]);
                }
                reply::continue_response_headers()
            }
            Some(Request::ResponseBody(b)) => {
                if !std::mem::replace(&mut self.first_byte, true) {
                    events.push(Event::FirstByte);
                }
                self.tail.keep(&b.body);
                if b.end_of_stream {
                    events.extend(self.tail.usage().map(Event::Usage));
                    events.push(Event::End);
                }
                reply::streamed(true, b.body, b.end_of_stream)
            }
            Some(Request::ResponseTrailers(_)) => {
                events.extend(self.tail.usage().map(Event::Usage));
                events.push(Event::End);
                reply::continue_trailers(true)
            }
            _ => return None,
        })
    }
}

/// The endpoint that served, as the gateway reports it in `envoy.lb`.
fn served(metadata: &Option<Metadata>) -> Option<String> {
    let lb = metadata.as_ref()?.filter_metadata.get("envoy.lb")?;
    match &lb.fields.get(SERVED)?.kind {
        Some(Kind::StringValue(s)) => Some(s.clone()),
        _ => None,
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
pub(super) fn usage(tail: &[u8]) -> Option<Usage> {
    const KEY: &[u8] = b"\"usage\"";
    let at = tail.windows(KEY.len()).rposition(|w| w == KEY)? + KEY.len();
    let rest = &tail[at..];
    let colon = rest.iter().position(|&b| !b.is_ascii_whitespace()).filter(|&i| rest[i] == b':')?;
    let mut values = serde_json::Deserializer::from_slice(&rest[colon + 1..]).into_iter::<Option<UsageJson>>();
    let u = values.next()?.ok()??;
    let cached_tokens = u.prompt_tokens_details.map_or(0, |d| d.cached_tokens);
    Some(Usage { prompt_tokens: u.prompt_tokens, cached_tokens, completion_tokens: u.completion_tokens })
}
