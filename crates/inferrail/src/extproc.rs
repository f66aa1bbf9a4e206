//! The ext_proc gRPC service: one stream per HTTP request and filter.
//!
//! Envoy's route filter sends headers, then the buffered body, and gets the
//! decision (traced as a span continuing the client's `traceparent`, when
//! traces are on); then the response's headers (status, the replica that
//! really served after retries). Envoy keeps that stream open until the
//! HTTP request ends, however it ends, so its closing is the request's end.
//! The first body byte comes from the access log ([`crate::access_log`]) or,
//! where none is added, from an observe filter (observability mode,
//! asynchronous, no added latency). A stream's first message says which
//! filter it comes from. A stream whose `protocol_config` says
//! `FULL_DUPLEX_STREAMED` is an Inference Extension gateway's, carrying
//! request and response alike ([`picker`]). What each stream hears becomes
//! an event of the request's life ([`Router::hear`]); this module decides
//! nothing about the lease itself.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpHeaders, ProcessingRequest, ProcessingResponse};
use envoy_types::pb::google::protobuf::value::Kind;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use crate::reply;
use crate::request::{self, Endpoint, Head};
use crate::router::{Caller, Decision, Router};
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use inferrail_route::lifecycle::Event;
use inferrail_tokenize::chat::Endpoint as Generation;

/// The service Envoy's ext_proc filters call.
#[derive(Clone)]
pub struct ExtProc {
    router: Arc<Router>,
    models_json: Arc<arc_swap::ArcSwap<String>>,
}

impl ExtProc {
    /// Serves decisions from `router`; `models_json` is the `/v1/models` answer, kept fresh elsewhere.
    pub fn new(router: Arc<Router>, models_json: Arc<arc_swap::ArcSwap<String>>) -> Self {
        Self { router, models_json }
    }
}

type Out = Result<ProcessingResponse, Status>;

/// Added to a queued request's longest wait when Envoy is asked to wait for its answer.
const WAIT_MARGIN: Duration = Duration::from_secs(1);

#[tonic::async_trait]
impl ExternalProcessor for ExtProc {
    type ProcessStream = Pin<Box<dyn Stream<Item = Out> + Send + 'static>>;

    async fn process(&self, request: tonic::Request<Streaming<ProcessingRequest>>) -> Result<tonic::Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let this = self.clone();
        tokio::spawn(async move {
            let Ok(Some(first)) = inbound.message().await else { return };
            let full_duplex = |mode: i32| mode == BodySendMode::FullDuplexStreamed as i32;
            if first.observability_mode {
                observe(&this.router, first, inbound).await;
            } else if first.protocol_config.as_ref().is_some_and(|c| full_duplex(c.request_body_mode)) {
                picker::serve(&this, first, inbound, tx).await;
            } else {
                this.route(first, inbound, tx).await;
            }
        });
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

fn new_request_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    format!("inferrail-{nanos:x}-{:x}", NEXT.fetch_add(1, Ordering::Relaxed))
}

impl ExtProc {
    /// The answer to a request the router serves itself (models, health, a
    /// wrong method or path), or the generation endpoint it goes to.
    fn own_answer(&self, head: &Head) -> Result<Generation, Box<ProcessingResponse>> {
        Err(Box::new(match request::endpoint(&head.method, &head.path) {
            Endpoint::Generate(generation) => return Ok(generation),
            Endpoint::Models => reply::immediate(200, self.models_json.load().as_ref().clone(), &[], "inferrail_models"),
            Endpoint::Health => reply::immediate(200, String::new(), &[], "inferrail_health"),
            Endpoint::WrongMethod(allow) => {
                let body =
                    reply::error_body(405, "MethodNotAllowed", &format!("Method {} is not allowed for {}.", head.method, head.path), None);
                reply::immediate(405, body, &[("allow", allow)], "inferrail_wrong_method")
            }
            Endpoint::NotFound => {
                let body = reply::error_body(404, "NotFoundError", &format!("No route for {} {}.", head.method, head.path), None);
                reply::immediate(404, body, &[], "inferrail_not_found")
            }
        }))
    }

    /// Decides where the request goes, with the decision's span continuing
    /// the client's trace: the decision and the traceparent the engine's work
    /// continues, or the router's own answer when it refuses.
    ///
    /// A request that waits in the router's queue asks Envoy, on the
    /// stream's sender, to wait for it past the filter's `message_timeout`;
    /// if Envoy gives up on the request meanwhile (the stream's inbound side
    /// ends: the client left), it leaves the queue at once and `None` is
    /// returned.
    async fn decide(
        &self,
        head: &Head,
        body: &[u8],
        generation: Generation,
        request_id: &str,
        subset: Option<&[SocketAddr]>,
        (inbound, tx): (&mut Streaming<ProcessingRequest>, &mpsc::Sender<Out>),
    ) -> Option<Result<(Decision, Option<String>), Box<ProcessingResponse>>> {
        let started = std::time::SystemTime::now();
        let traces = self.router.traces.as_ref();
        // The margin covers the answer's way back to Envoy once the wait ends.
        let on_wait = |wait: Duration| drop(tx.try_send(Ok(reply::wait(wait + WAIT_MARGIN))));
        let caller = Caller { asked: &head.asked, on_wait: &on_wait };
        let deciding = self.router.decide_as(body, generation, request_id, head.session.as_deref(), subset, &caller);
        let gone = async {
            // Nothing more comes before the answer unless Envoy is giving up on the request.
            while let Ok(Some(_)) = inbound.message().await {}
        };
        let decided = tokio::select! {
            decided = deciding => decided,
            () = gone => return None,
        };
        Some(match decided {
            Ok(d) => {
                let traceparent = traces.map(|t| t.decision(head.traceparent.as_deref(), started, &d));
                Ok((d, traceparent))
            }
            Err(e) => {
                if let Some(t) = traces {
                    t.refused(head.traceparent.as_deref(), started, &e);
                }
                Err(Box::new(reply::route_error(&e)))
            }
        })
    }

    async fn route(&self, first: ProcessingRequest, mut inbound: Streaming<ProcessingRequest>, tx: mpsc::Sender<Out>) {
        let Some(Request::RequestHeaders(HttpHeaders { headers, end_of_stream: mut body_done, .. })) = first.request else { return };
        let head = request::head(headers.as_ref());
        let subset = subset(&first.metadata_context);
        let mut body = Vec::new();
        let answer = match self.own_answer(&head) {
            Err(answer) => *answer,
            Ok(generation) => {
                let (request_id, generated) = match head.request_id.clone() {
                    Some(id) => (id, false),
                    None => (new_request_id(), true),
                };
                if !body_done {
                    let set: Vec<(&str, &str)> = if generated { vec![("x-request-id", request_id.as_str())] } else { Vec::new() };
                    if tx.send(Ok(reply::continue_headers(&set))).await.is_err() {
                        return;
                    }
                }
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
                let Some(decided) = self.decide(&head, &body, generation, &request_id, subset.as_deref(), (&mut inbound, &tx)).await else {
                    return;
                };
                match decided {
                    Ok((d, traceparent)) => {
                        let answer = reply::decision(&d, d.request_id != request_id, traceparent.as_deref());
                        // If Envoy is gone it no longer needs the answer.
                        let _ = tx.send(Ok(answer)).await;
                        let mut tail = picker::Tail::default();
                        while let Ok(Some(m)) = inbound.message().await {
                            let answer = match &m.request {
                                // The response's headers: its status and who served, before the end.
                                Some(Request::ResponseHeaders(h)) => {
                                    self.router.hear(&d.request_id, status(&self.router, h, attribute(&m.attributes, "upstream.address")));
                                    if h.end_of_stream {
                                        self.router.hear(&d.request_id, Event::FirstByte);
                                        reply::continue_response_headers()
                                    } else if d.wants_usage {
                                        // A limited tenant's output tokens are in the body's last bytes.
                                        reply::continue_response_headers_then_body()
                                    } else {
                                        reply::continue_response_headers()
                                    }
                                }
                                // A limited tenant's response (or every one, where the filter is set to
                                // send them): each chunk is let through at once, so Envoy never waits
                                // out its timeout; the last carries the usage.
                                Some(Request::ResponseBody(b)) => {
                                    self.router.hear(&d.request_id, Event::FirstByte);
                                    tail.keep(&b.body);
                                    if b.end_of_stream
                                        && let Some(usage) = tail.usage()
                                    {
                                        self.router.hear(&d.request_id, Event::Usage(usage));
                                    }
                                    reply::continue_response_body()
                                }
                                Some(Request::ResponseTrailers(_)) => reply::continue_trailers(true),
                                _ => continue,
                            };
                            let _ = tx.send(Ok(answer)).await;
                        }
                        // Envoy closes the stream when the HTTP request is over, however it ended.
                        self.router.hear(&d.request_id, Event::End);
                        return;
                    }
                    Err(answer) => *answer,
                }
            }
        };
        // If Envoy is gone it no longer needs the answer.
        let _ = tx.send(Ok(answer)).await;
        while let Ok(Some(_)) = inbound.message().await {}
    }
}

type Attributes = std::collections::HashMap<String, envoy_types::pb::google::protobuf::Struct>;

/// A string attribute Envoy sent (`request.id`, `upstream.address`, ...),
/// keyed by the filter's name; the value is looked up under any key.
fn attribute(attributes: &Attributes, name: &str) -> Option<String> {
    attributes.values().flat_map(|s| s.fields.iter()).find_map(|(k, v)| match (k == name, &v.kind) {
        (true, Some(Kind::StringValue(a))) => Some(a.clone()),
        _ => None,
    })
}

/// The endpoints an Inference Extension gateway offers for a request:
/// `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset` in the
/// request's metadata, a list of `ip:port` (or one comma-separated string).
/// Entries that are not addresses are left out, so a hint naming none
/// leaves nothing to pick from.
fn subset(metadata: &Option<Metadata>) -> Option<Vec<SocketAddr>> {
    let hint = metadata.as_ref()?.filter_metadata.get("envoy.lb.subset_hint")?.fields.get("x-gateway-destination-endpoint-subset")?;
    let parse = |s: &str| s.split(',').filter_map(|a| a.trim().parse().ok()).collect::<Vec<SocketAddr>>();
    Some(match &hint.kind {
        Some(Kind::ListValue(list)) => list
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(parse(s)),
                _ => None,
            })
            .flatten()
            .collect(),
        Some(Kind::StringValue(s)) => parse(s),
        _ => Vec::new(),
    })
}

/// The status response headers carry, from the replica at `served` (`ip:port`) when known.
fn status(router: &Router, h: &HttpHeaders, served: Option<String>) -> Event {
    let code = request::header(h.headers.as_ref(), ":status").and_then(|s| s.parse().ok()).unwrap_or(0u16);
    Event::Status { code, served_by: served.and_then(|a| served_by(router, &a)) }
}

/// The replica at `addr` (`ip:port`, as Envoy names an upstream host), by its key.
fn served_by(router: &Router, addr: &str) -> Option<u64> {
    let addr: SocketAddr = addr.parse().ok()?;
    router.fleet().replicas.iter().find(|r| r.addr == addr).map(|r| r.key)
}

/// The router that decided a request and the id it knows it by, from the
/// `inferrail` metadata its decision set (the observe filter forwards that
/// namespace).
fn decided_by(metadata: &Option<Metadata>) -> Option<(u64, String)> {
    let ours = &metadata.as_ref()?.filter_metadata.get("inferrail")?.fields;
    let text = |key: &str| match ours.get(key).and_then(|v| v.kind.as_ref()) {
        Some(Kind::StringValue(s)) => Some(s.clone()),
        _ => None,
    };
    Some((reply::decider_id(&text("router")?)?, text("request_id")?))
}

/// Follows one request's upstream response: status, who served, first byte;
/// each goes to the router that decided the request.
async fn observe(router: &Router, first: ProcessingRequest, mut inbound: Streaming<ProcessingRequest>) {
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
                if !router.hear_for(decider, &id, status(router, &h, found("upstream.address")), Duration::ZERO) {
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

mod picker;

#[cfg(test)]
mod tests;
