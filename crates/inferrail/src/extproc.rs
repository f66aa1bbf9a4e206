//! The ext_proc gRPC service: one stream per HTTP request and filter.
//!
//! Envoy's route filter sends headers, then the buffered body, and gets the
//! decision (traced as a span continuing the client's `traceparent`, when
//! traces are on); Envoy keeps that stream open until the HTTP request ends,
//! however it ends, so its closing releases the request's lease. The observe filter
//! (observability mode, asynchronous, no added latency) reports the upstream
//! response: status, the replica that really served after retries, and the
//! first body byte. A stream's first message says which filter it comes from.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpHeaders, ProcessingRequest, ProcessingResponse};
use envoy_types::pb::google::protobuf::value::Kind;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use crate::reply;
use crate::request::{self, Endpoint};
use crate::router::Router;
use inferrail_route::fleet::Lease;

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

/// How long a finished request's record waits for late observe messages.
const OBSERVE_GRACE: std::time::Duration = std::time::Duration::from_millis(500);

#[tonic::async_trait]
impl ExternalProcessor for ExtProc {
    type ProcessStream = Pin<Box<dyn Stream<Item = Out> + Send + 'static>>;

    async fn process(&self, request: tonic::Request<Streaming<ProcessingRequest>>) -> Result<tonic::Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let this = self.clone();
        tokio::spawn(async move {
            let Ok(Some(first)) = inbound.message().await else { return };
            if first.observability_mode {
                observe(&this.router, first, inbound).await;
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
    async fn route(&self, first: ProcessingRequest, mut inbound: Streaming<ProcessingRequest>, tx: mpsc::Sender<Out>) {
        let Some(Request::RequestHeaders(HttpHeaders { headers, end_of_stream: mut body_done, .. })) = first.request else { return };
        let head = request::head(headers.as_ref());
        let mut body = Vec::new();
        let answer = match request::endpoint(&head.method, &head.path) {
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
            Endpoint::Generate(generation) => {
                let (request_id, generated) = match head.request_id {
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
                let started = std::time::SystemTime::now();
                let traces = self.router.traces.as_ref();
                match self.router.decide(&body, generation, &request_id, head.session.as_deref()).await {
                    Ok(d) => {
                        // The engine's work continues the decision's trace.
                        let traceparent = traces.map(|t| t.decision(head.traceparent.as_deref(), started, &d));
                        let answer = reply::decision(&d, d.request_id != request_id, traceparent.as_deref());
                        // If Envoy is gone it no longer needs the answer.
                        let _ = tx.send(Ok(answer)).await;
                        while let Ok(Some(_)) = inbound.message().await {}
                        self.request_over(&d.request_id).await;
                        return;
                    }
                    Err(e) => {
                        if let Some(t) = traces {
                            t.refused(head.traceparent.as_deref(), started, &e);
                        }
                        reply::route_error(&e)
                    }
                }
            }
        };
        // If Envoy is gone it no longer needs the answer.
        let _ = tx.send(Ok(answer)).await;
        while let Ok(Some(_)) = inbound.message().await {}
    }

    /// The route stream closed: the request is over. Its slot is given back
    /// at once; the record stays a moment for observe messages still in
    /// flight, then its outcome is counted.
    async fn request_over(&self, request_id: &str) {
        let Some(lease) = self.router.lease(request_id) else { return };
        // The engine finished it (or dropped it with the client): its blocks
        // are free now. A status still on its way completes it when it comes
        // (`end` and `set_status` hand over in one word, so the record is
        // never left to the grace below). Before the slot is given back, so
        // that a replica with nothing in flight has no claim left either.
        match lease.end() {
            Some(s) if s < 400 => self.router.complete(&lease),
            // With several routers the observe stream may go to another one
            // and no status ever comes here: a claim on an exact replica must
            // not outlive the request (ADR 0012), the engine's events say the rest.
            None => self.router.end_claim(&lease),
            Some(_) => {}
        }
        lease.release();
        let duration = lease.start.elapsed();
        tokio::time::sleep(OBSERVE_GRACE).await;
        let Some(held) = self.router.forget(request_id) else { return };
        let outcome = match held.status() {
            None => "no_response",
            Some(s) if s >= 500 => "5xx",
            Some(s) if s >= 400 => "4xx",
            Some(_) => "ok",
        };
        match held.status() {
            // The engine never answered (a refusal or failure was taken back when its status came).
            None => self.router.take_back(&held),
            // Again, for a lease moved to another replica after the request ended.
            Some(s) if s < 400 => self.router.complete(&held),
            Some(_) => {}
        }
        if let Some(log) = &self.router.decision_log {
            log.outcome(request_id, &held.replica.id, held.ttft().map(|d| d.as_secs_f64() * 1e3), held.status(), outcome);
        }
        let model = self.router.core.models[held.model].name.clone();
        metrics::counter!("inferrail_requests_total", "model" => model, "replica" => held.replica.id.clone(), "outcome" => outcome)
            .increment(1);
        metrics::histogram!("inferrail_request_duration_seconds").record(duration.as_secs_f64());
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

/// Follows one request's upstream response: status, who served, first byte.
async fn observe(router: &Router, first: ProcessingRequest, mut inbound: Streaming<ProcessingRequest>) {
    let mut lease: Option<Arc<Lease>> = None;
    let mut message = Some(first);
    while let Some(m) = message {
        let attributes = m.attributes;
        match m.request {
            Some(Request::ResponseHeaders(h)) => {
                let found = |name| attribute(&attributes, name).or_else(|| attribute(&h.attributes, name));
                let id = found("request.id");
                lease = id.as_deref().and_then(|id| router.lease(id));
                let (Some(id), Some(held)) = (id, &lease) else { return };
                let code = request::header(h.headers.as_ref(), ":status").and_then(|s| s.parse().ok()).unwrap_or(0u16);
                let mut ended = held.set_status(code);
                if let Some(addr) = found("upstream.address")
                    && addr != held.replica.addr.to_string()
                {
                    // Envoy retried elsewhere: the winner failed this request,
                    // and the replica that served holds it from here on.
                    crate::health::request_failed(router, &held.replica);
                    let fleet = router.fleet();
                    let actual = fleet.replicas.iter().find(|r| r.addr.to_string() == addr);
                    lease = actual.and_then(|a| router.move_lease(&id, a));
                    match &lease {
                        // A moved lease is not ended: its record completes at the grace's end.
                        Some(moved) => ended = moved.set_status(code),
                        // Not a replica we know, or already over: nothing more to credit.
                        None => return,
                    }
                }
                if let Some(held) = &lease {
                    if code >= 400 {
                        // The engine refused or failed it: what the decision recorded is not in its cache.
                        router.take_back(held);
                    } else if ended {
                        // The request ended before its status came: complete it now.
                        router.complete(held);
                    }
                    if code >= 500 {
                        crate::health::request_failed(router, &held.replica);
                    } else {
                        held.replica.record_success();
                    }
                    if h.end_of_stream {
                        first_byte(held);
                    }
                }
            }
            Some(Request::ResponseBody(_)) => {
                if let Some(l) = &lease {
                    first_byte(l);
                }
                // The first byte is all this stream is for.
                return;
            }
            _ => {}
        }
        message = inbound.message().await.ok().flatten();
    }
}

fn first_byte(lease: &Lease) {
    if lease.first_byte() {
        let ttft = lease.ttft().unwrap_or_default().as_secs_f64();
        metrics::histogram!("inferrail_ttft_seconds", "replica" => lease.replica.id.clone()).record(ttft);
        if let Some(estimate) = lease.estimate() {
            // Above 1: slower than the router expected; far from 1, the cost model needs calibrating.
            metrics::histogram!("inferrail_ttft_over_estimate", "replica" => lease.replica.id.clone())
                .record(ttft / estimate.as_secs_f64());
            metrics::histogram!("inferrail_estimated_ttft_seconds", "replica" => lease.replica.id.clone()).record(estimate.as_secs_f64());
        }
    }
}
