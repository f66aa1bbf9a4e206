//! What every request stream shares before the decision: the router's own
//! answers (models, health, a wrong method or path) and the decision itself,
//! asked of the router with the decision's span continuing the client's
//! trace, waiting in the router's queue when admission says so; a split
//! request's prefill leg is run before the decision goes back ([`legs`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use inferrail_tokenize::chat::Endpoint as Generation;
use tokio::sync::mpsc;
use tonic::{Status, Streaming};

use crate::decision::Decision;
use crate::legs;
use crate::reply;
use crate::request::{self, Endpoint, Head};
use crate::router::{Caller, Router};

/// What a stream sends back to Envoy.
pub type Out = Result<ProcessingResponse, Status>;

/// Added to a queued request's longest wait when Envoy is asked to wait for its answer.
const WAIT_MARGIN: Duration = Duration::from_secs(1);

/// The service Envoy's ext_proc filters call.
#[derive(Clone)]
pub struct ExtProc {
    /// The router deciding.
    pub router: Arc<Router>,
    models_json: Arc<ArcSwap<String>>,
    /// Sends split requests' prefill legs.
    http: reqwest::Client,
}

impl ExtProc {
    /// Serves decisions from `router`; `models_json` is the `/v1/models` answer, kept fresh elsewhere.
    pub fn new(router: Arc<Router>, models_json: Arc<ArcSwap<String>>) -> Self {
        // Without TLS the builder cannot fail; a default client would do the same.
        let http = reqwest::Client::builder().pool_max_idle_per_host(64).build().unwrap_or_default();
        Self { router, models_json, http }
    }

    /// The answer to a request the router serves itself (models, health, a
    /// wrong method or path), or the generation endpoint it goes to.
    pub fn own_answer(&self, head: &Head) -> Result<Generation, Box<ProcessingResponse>> {
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
    pub async fn decide(
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
            Ok(mut d) => {
                if let Some(leg) = d.prefill.as_ref().filter(|leg| !leg.sidecar) {
                    // The prefill runs before the answer: Envoy waits for it past its message_timeout.
                    let each = Duration::from_millis(self.router.config().retry.prefill_timeout_ms);
                    on_wait(each * u32::try_from(leg.targets.len()).unwrap_or(u32::MAX));
                }
                legs::run(&self.router, &self.http, &mut d, body, head).await;
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
}

/// Answers the request itself and reads the stream to its end.
pub async fn answer_and_drain(answer: ProcessingResponse, mut inbound: Streaming<ProcessingRequest>, tx: mpsc::Sender<Out>) {
    // If Envoy is gone it no longer needs the answer.
    let _ = tx.send(Ok(answer)).await;
    while let Ok(Some(_)) = inbound.message().await {}
}
