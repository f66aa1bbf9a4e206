//! What every transport does before the response, in the router's terms:
//! answer what the router serves itself (models, health, a wrong method or
//! path), and decide where a generation request goes, with the decision's
//! span continuing the client's trace, waiting in the router's queue when
//! admission says so, and running a split request's prefill leg
//! ([`legs`]) before the decision goes back. The ext_proc streams and the
//! dynamic module both come through here.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use inferrail_route::lifecycle::Event;
use inferrail_tokenize::chat::Endpoint as Generation;

use crate::decision::{Answer, Decision};
use crate::legs;
use crate::request::Head;
use crate::router::{Caller, Router};

/// The router, with what a transport needs beside it.
#[derive(Clone)]
pub struct Front {
    /// The router deciding.
    pub router: Arc<Router>,
    models_json: Arc<ArcSwap<String>>,
    /// Sends split requests' prefill legs.
    http: reqwest::Client,
}

impl Front {
    /// Serves decisions from `router`; `models_json` is the `/v1/models` answer, kept fresh elsewhere.
    pub fn new(router: Arc<Router>, models_json: Arc<ArcSwap<String>>) -> Self {
        // Without TLS the builder cannot fail; a default client would do the same.
        let http = reqwest::Client::builder().pool_max_idle_per_host(64).build().unwrap_or_default();
        Self { router, models_json, http }
    }

    /// The answer to a request the router serves itself, or the generation endpoint it goes to.
    pub fn own_answer(&self, head: &Head) -> Result<Generation, Answer> {
        Answer::own(head, || self.models_json.load().as_ref().clone())
    }

    /// Decides where the request goes: the decision and the traceparent
    /// the engine's work continues, or the router's own answer when it
    /// refuses. `on_wait` is told, once, how long the transport must wait
    /// for the answer when the request waits in the router's queue or its
    /// prefill leg runs first.
    pub async fn decide(
        &self,
        head: &Head,
        body: &[u8],
        generation: Generation,
        request_id: &str,
        subset: Option<&[SocketAddr]>,
        on_wait: &(dyn Fn(Duration) + Sync),
    ) -> Result<(Decision, Option<String>), Answer> {
        let started = std::time::SystemTime::now();
        let traces = self.router.traces.as_ref();
        let caller = Caller { asked: &head.asked, on_wait };
        match self.router.decide_as(body, generation, request_id, head.session.as_deref(), subset, &caller).await {
            Ok(mut d) => {
                let mut leased = vec![d.request_id.clone()];
                if let Some(leg) = d.prefill.as_ref().filter(|leg| !leg.sidecar) {
                    let each = Duration::from_millis(self.router.config().retry.prefill_timeout_ms);
                    on_wait(each * u32::try_from(leg.targets.len()).unwrap_or(u32::MAX));
                    leased.push(leg.request_id.clone());
                }
                let undelivered = Undelivered { router: &self.router, leased };
                legs::run(&self.router, &self.http, &mut d, body, head).await;
                undelivered.delivered();
                let traceparent = traces.map(|t| t.decision(head.traceparent.as_deref(), started, &d));
                Ok((d, traceparent))
            }
            Err(e) => {
                if let Some(t) = traces {
                    t.refused(head.traceparent.as_deref(), started, &e);
                }
                Err(Answer::refused(&e))
            }
        }
    }
}

/// A decision not yet gone back: if the transport drops it (the client
/// left while its prefill leg ran), its leases end as the client's leaving.
struct Undelivered<'a> {
    router: &'a Router,
    leased: Vec<String>,
}

impl Undelivered<'_> {
    /// It went back: the transport hears the rest.
    fn delivered(mut self) {
        self.leased.clear();
    }
}

impl Drop for Undelivered<'_> {
    fn drop(&mut self) {
        for id in self.leased.drain(..) {
            self.router.hear(&id, Event::Gone);
        }
    }
}
