//! The ext_proc gRPC service: one stream per HTTP request and filter.
//!
//! Envoy's route filter (headers then buffered body) gets a decision; the
//! observe filter (observability mode: request headers, response headers
//! and body, asynchronously) tells the router what happened upstream, and
//! its stream ending is the signal that the request is over. A stream's
//! first message says which filter it comes from.

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

use crate::fleet::Lease;
use crate::reply;
use crate::request::{self, Endpoint};
use crate::router::Router;

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

/// How long after its route stream ends a request may wait to be found by
/// the observe stream before it counts as abandoned.
const CLAIM_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

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
        let Some(Request::RequestHeaders(HttpHeaders { headers, end_of_stream, .. })) = first.request else { return };
        let head = request::head(headers.as_ref());
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
            Endpoint::Generate => {
                let (request_id, generated) = match head.request_id {
                    Some(id) => (id, false),
                    None => (new_request_id(), true),
                };
                let mut body = Vec::new();
                if !end_of_stream {
                    let set: Vec<(&str, &str)> = if generated { vec![("x-request-id", request_id.as_str())] } else { Vec::new() };
                    if tx.send(Ok(reply::continue_headers(&set))).await.is_err() {
                        return;
                    }
                    loop {
                        match inbound.message().await {
                            Ok(Some(ProcessingRequest { request: Some(Request::RequestBody(b)), .. })) => {
                                body.extend_from_slice(&b.body);
                                if b.end_of_stream {
                                    break;
                                }
                            }
                            Ok(Some(_)) => {}
                            // Envoy gave up on the request (client gone, timeout).
                            Ok(None) | Err(_) => return,
                        }
                    }
                }
                match self.router.decide(&body, &request_id) {
                    Ok(d) => {
                        let answer = reply::decision(&d, &request_id);
                        // If Envoy is gone it no longer needs the answer.
                        let _ = tx.send(Ok(answer)).await;
                        while let Ok(Some(_)) = inbound.message().await {}
                        self.release_unclaimed(&request_id).await;
                        return;
                    }
                    Err(e) => reply::route_error(&e),
                }
            }
        };
        // If Envoy is gone it no longer needs the answer.
        let _ = tx.send(Ok(answer)).await;
        while let Ok(Some(_)) = inbound.message().await {}
    }

    /// After the route stream ends, a request the observe stream never
    /// found (the client left before it reached the upstream) is over.
    async fn release_unclaimed(&self, request_id: &str) {
        tokio::time::sleep(CLAIM_GRACE).await;
        if let Some(lease) = self.router.lease(request_id)
            && !lease.claimed()
            && let Some(held) = self.router.finish(request_id)
        {
            let model = self.router.models[held.model].name.clone();
            metrics::counter!("inferrail_requests_total", "model" => model, "replica" => held.replica.id.clone(), "outcome" => "abandoned")
                .increment(1);
        }
    }
}

/// The upstream address Envoy reports in a message's attributes, if asked to.
fn upstream_address(h: &HttpHeaders) -> Option<String> {
    h.attributes.values().flat_map(|s| s.fields.iter()).find_map(|(k, v)| match (&**k, &v.kind) {
        ("upstream.address", Some(Kind::StringValue(a))) => Some(a.clone()),
        _ => None,
    })
}

fn status(h: &HttpHeaders) -> Option<u16> {
    let headers = h.headers.as_ref()?;
    let v = headers.headers.iter().find(|v| v.key == ":status")?;
    let text = if v.raw_value.is_empty() { v.value.clone() } else { String::from_utf8_lossy(&v.raw_value).into_owned() };
    text.parse().ok()
}

/// Follows one request's upstream side to its end.
async fn observe(router: &Router, first: ProcessingRequest, mut inbound: Streaming<ProcessingRequest>) {
    let mut request_id: Option<String> = None;
    let mut lease: Option<Arc<Lease>> = None;
    let mut upstream_status: Option<u16> = None;
    let mut complete = false;
    let mut message = Some(first);
    while let Some(m) = message {
        match m.request {
            Some(Request::RequestHeaders(h)) => {
                request_id = request::head(h.headers.as_ref()).request_id;
                lease = request_id.as_deref().and_then(|id| router.lease(id));
                if let Some(l) = &lease {
                    l.claim();
                }
            }
            Some(Request::ResponseHeaders(h)) => {
                upstream_status = status(&h);
                if let (Some(id), Some(held), Some(addr)) = (&request_id, &lease, upstream_address(&h))
                    && addr != held.replica.addr.to_string()
                {
                    // Envoy retried elsewhere: the winner failed this request.
                    crate::health::request_failed(router, &held.replica);
                    let fleet = router.fleet();
                    if let Some(actual) = fleet.replicas.iter().find(|r| r.addr.to_string() == addr) {
                        lease = router.move_lease(id, actual);
                    }
                }
                if let Some(l) = &lease
                    && h.end_of_stream
                {
                    first_byte(l);
                }
                complete = h.end_of_stream;
            }
            Some(Request::ResponseBody(b)) => {
                if let Some(l) = &lease {
                    first_byte(l);
                }
                complete = b.end_of_stream;
            }
            _ => {}
        }
        if complete {
            // The whole response is through: the request is over now, not
            // when Envoy gets round to closing this stream.
            break;
        }
        message = inbound.message().await.ok().flatten();
    }
    let Some(id) = request_id else { return };
    let Some(held) = router.finish(&id) else { return };
    let outcome = match upstream_status {
        _ if !complete => "disconnected",
        None => "disconnected",
        Some(s) if s >= 500 => "5xx",
        Some(s) if s >= 400 => "4xx",
        Some(_) => "ok",
    };
    match upstream_status {
        Some(s) if s >= 500 => crate::health::request_failed(router, &held.replica),
        Some(_) => held.replica.record_success(),
        None => {}
    }
    let model = router.models[held.model].name.clone();
    metrics::counter!("inferrail_requests_total", "model" => model, "replica" => held.replica.id.clone(), "outcome" => outcome)
        .increment(1);
    metrics::histogram!("inferrail_request_duration_seconds").record(held.start.elapsed().as_secs_f64());
    // Envoy closes the stream in its own time; read it to the end.
    while let Ok(Some(_)) = inbound.message().await {}
}

fn first_byte(lease: &Lease) {
    if lease.first_byte() {
        metrics::histogram!("inferrail_ttft_seconds", "replica" => lease.replica.id.clone()).record(lease.start.elapsed().as_secs_f64());
    }
}
