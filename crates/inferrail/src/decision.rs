//! What a routing decision comes to, as plain data: the decision, why a
//! request was refused ([`RouteError`], with its HTTP status and OpenAI error
//! type), an answer the router gives itself ([`Answer`]), what an
//! explanation shows and what a reload did. Everything that names a result
//! imports it from here, not from the router; each transport turns it into
//! its own messages.

use std::sync::Arc;
use std::time::Duration;

use inferrail_policy::NoReplica;
use inferrail_route::Plan;
use inferrail_route::fleet::Replica;

use inferrail_tokenize::chat::Endpoint as Generation;

use crate::admission::{Placed, Shed};
use crate::request::{self, Endpoint, Head};

/// A routing decision.
#[derive(Debug)]
pub struct Decision {
    /// The id the request is known by from here on: the client's
    /// `x-request-id`, unless another request in flight already uses it.
    pub request_id: String,
    /// The model's engine-side name.
    pub model: String,
    /// Winner first, then the fallbacks.
    pub targets: Vec<Arc<Replica>>,
    /// The policy that ranked them.
    pub policy: &'static str,
    /// The body with the model rewritten, when it had to be.
    pub body: Option<Vec<u8>>,
    /// Prompt tokens, when the prompt was tokenized.
    pub prompt_tokens: Option<usize>,
    /// Predicted cached prompt tokens on each target, when the prompt was tokenized.
    pub cached_tokens: Vec<usize>,
    /// What steered the decision besides the scores, if anything.
    pub steer: Option<&'static str>,
    /// Replicas the policy weighed.
    pub candidates: usize,
    /// The winner's estimated time to first token (the prefill queued there
    /// and its own, from the model's prefill cost, whatever the policy).
    pub estimate: Option<Duration>,
    /// The router that decided it ([`Peers::id`]), for what is heard elsewhere to find it.
    pub decider: u64,
    /// Its tenant has token limits: its output tokens count once its usage is heard.
    pub wants_usage: bool,
    /// How long it waited its turn in its model's queue.
    pub waited: Duration,
    /// A split request's prefill leg; `targets` then decode it.
    pub prefill: Option<PrefillLeg>,
}

/// The header (and `envoy.lb` key) naming the chosen replicas.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";

/// The header naming a split request's prefill replica to the sidecar in
/// front of its decoder (llm-d's).
pub const PREFILLER: &str = "x-prefiller-host-port";

impl Decision {
    /// The headers it sets on the request: the destination (winner first,
    /// then the fallbacks), the prefill replica for a decoder's sidecar, the
    /// new request id when it was `renamed`, the `traceparent` the engine's
    /// work continues.
    pub fn headers(&self, renamed: bool, traceparent: Option<&str>) -> Vec<(&'static str, String)> {
        let mut set = vec![(DESTINATION, self.destination())];
        if let Some(leg) = self.prefill.as_ref().filter(|leg| leg.sidecar) {
            set.push((PREFILLER, leg.targets[0].addr.to_string()));
        }
        if renamed {
            set.push(("x-request-id", self.request_id.clone()));
        }
        if let Some(tp) = traceparent {
            set.push(("traceparent", tp.to_string()));
        }
        set
    }

    /// The targets as Envoy's override-host balancer reads them: `ip:port`, comma-separated.
    pub fn destination(&self) -> String {
        let targets: Vec<String> = self.targets.iter().map(|r| r.addr.to_string()).collect();
        targets.join(",")
    }

    /// Its dynamic metadata, namespace by namespace: `envoy.lb` for the
    /// override-host balancer (the destination header's value), `inferrail`
    /// for the route's response headers and for what is heard of it
    /// elsewhere (the replica, policy, model, request id, the router that
    /// decided, the predicted tokens, a split request's prefill replica).
    pub fn metadata(&self) -> Vec<(&'static str, Vec<(&'static str, String)>)> {
        let mut ours = vec![
            ("replica", self.targets[0].id.clone()),
            ("policy", self.policy.to_string()),
            ("model", self.model.clone()),
            ("request_id", self.request_id.clone()),
            ("router", router_text(self.decider)),
        ];
        // A split request's engine reports the prefill replica's cached tokens.
        let cached = match &self.prefill {
            Some(leg) => leg.cached_tokens.first(),
            None => self.cached_tokens.first(),
        };
        if let (Some(n), Some(cached)) = (self.prompt_tokens, cached) {
            ours.push(("prompt_tokens", n.to_string()));
            ours.push(("cached_tokens", cached.to_string()));
        }
        if let Some(leg) = &self.prefill {
            ours.push(("prefill_replica", leg.targets[0].id.clone()));
        }
        vec![("envoy.lb", vec![(DESTINATION, self.destination())]), ("inferrail", ours)]
    }
}

/// How the `router` metadata names the router that decided.
fn router_text(id: u64) -> String {
    format!("{id:016x}")
}

/// The router the `router` metadata names.
pub fn decider_id(text: &str) -> Option<u64> {
    u64::from_str_radix(text, 16).ok()
}

/// A split request's prefill leg.
#[derive(Debug)]
pub struct PrefillLeg {
    /// The id it is heard under ([`inferrail_route::ledger::prefill_id`]).
    pub request_id: String,
    /// The prefill replica first, then the fallbacks.
    pub targets: Vec<Arc<Replica>>,
    /// Predicted cached prompt tokens on each, when the prompt was tokenized.
    pub cached_tokens: Vec<usize>,
    /// A sidecar in front of the decoder runs it, told the prefill
    /// replica in `x-prefiller-host-port`; else the router does.
    pub sidecar: bool,
}

/// What the model's policy would do with a request, and why.
#[derive(Debug)]
pub struct Explained {
    /// The name the client asked for, when it was an alias.
    pub requested: Option<String>,
    /// Why the prompt has no tokens, when it has none.
    pub no_prediction: Option<&'static str>,
    /// The plan, every offered replica in its order (or, when none can take
    /// the request, why not and what each lacks).
    pub plan: Plan,
    /// Its tenant and band.
    pub placed: Placed,
    /// Requests waiting ahead of it in its model's queue.
    pub waiting_ahead: usize,
    /// Whether it would wait now.
    pub would_wait: bool,
}

/// Why the router answered a request itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// Bad JSON or a bad `model` field.
    #[error(transparent)]
    Body(#[from] BodyError),
    /// No model named while several are served.
    #[error("`model` is required: this gateway serves several models")]
    MissingModel,
    /// A model nobody serves.
    #[error("The model `{0}` does not exist.")]
    UnknownModel(String),
    /// Larger than `server.max_body_bytes`.
    #[error("The request body is larger than {0} bytes.")]
    TooLarge(usize),
    /// Nobody can take it.
    #[error("{0}")]
    NoReplica(#[from] NoReplica),
    /// No valid API key, where one is required or one was presented.
    #[error("Incorrect or missing API key. Send a valid key as `Authorization: Bearer <key>`.")]
    Unauthorized,
    /// A band that is not configured.
    #[error("There is no band `{0}`.")]
    UnknownBand(String),
    /// A band the request's key does not allow.
    #[error("This API key may not use the band `{0}`.")]
    BandNotAllowed(String),
    /// The tenant's token limit is reached.
    #[error("The token limit of tenant `{tenant}` is reached; try again in {} s.", retry_after.as_secs_f64().ceil())]
    RateLimited {
        /// The tenant.
        tenant: String,
        /// When its windows free.
        retry_after: Duration,
    },
    /// Shed under load.
    #[error("{0}")]
    Shed(Shed),
}

impl RouteError {
    /// HTTP status, OpenAI error type and the parameter at fault.
    pub fn http(&self) -> (u16, &'static str, Option<&'static str>) {
        match self {
            Self::Body(_) => (400, "BadRequestError", None),
            Self::MissingModel => (400, "BadRequestError", Some("model")),
            Self::UnknownModel(_) => (404, "NotFoundError", Some("model")),
            Self::TooLarge(_) => (413, "BadRequestError", None),
            // Shed: every replica that could serve it is at its limits (the picker protocol's 429).
            Self::NoReplica(NoReplica::AllFull) => (429, "RateLimitError", None),
            // No endpoint is ready for it.
            Self::NoReplica(_) => (503, "ServiceUnavailableError", None),
            Self::Unauthorized => (401, "AuthenticationError", None),
            Self::UnknownBand(_) => (400, "BadRequestError", None),
            Self::BandNotAllowed(_) => (403, "PermissionDeniedError", None),
            Self::RateLimited { .. } => (429, "RateLimitError", None),
            Self::Shed(_) => (503, "ServiceUnavailableError", None),
        }
    }

    /// How long the client should wait before trying again, when it should.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::RateLimited { retry_after, .. } => Some(*retry_after),
            Self::Shed(shed) => Some(shed.retry_after()),
            _ => None,
        }
    }

    /// A short label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Body(_) => "bad_body",
            Self::MissingModel => "missing_model",
            Self::UnknownModel(_) => "unknown_model",
            Self::TooLarge(_) => "too_large",
            Self::NoReplica(e) => e.label(),
            Self::Unauthorized => "unauthorized",
            Self::UnknownBand(_) => "unknown_band",
            Self::BandNotAllowed(_) => "band_not_allowed",
            Self::RateLimited { .. } => "rate_limited",
            Self::Shed(shed) => shed.label(),
        }
    }
}

/// An answer the router gives a request itself, in place of a replica's:
/// its models, its health, or an error in the OpenAI shape vLLM uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The HTTP status.
    pub status: u16,
    /// The JSON body.
    pub body: String,
    /// Headers besides `content-type` (`application/json`).
    pub headers: Vec<(&'static str, String)>,
    /// Why, as Envoy's response code details name it (`inferrail_...`).
    pub details: String,
}

impl Answer {
    /// An error in the OpenAI shape vLLM uses.
    pub fn error(status: u16, kind: &str, message: &str, param: Option<&str>, details: &str) -> Self {
        Self { status, body: error_body(status, kind, message, param), headers: Vec::new(), details: details.into() }
    }

    /// The answer to a refused request, with `Retry-After` (whole seconds,
    /// at least one) when the client should try again later.
    pub fn refused(e: &RouteError) -> Self {
        let (status, kind, param) = e.http();
        let mut answer = Self::error(status, kind, &e.to_string(), param, &format!("inferrail_{}", e.reason()));
        if let Some(d) = e.retry_after() {
            answer.headers.push(("retry-after", d.as_secs_f64().ceil().max(1.0).to_string()));
        }
        answer
    }

    /// What the router answers itself for the request `head` names (models,
    /// health, a wrong method or path; `models` gives the `/v1/models`
    /// answer), or the generation endpoint the request goes on to.
    pub fn own(head: &Head, models: impl FnOnce() -> String) -> Result<Generation, Self> {
        let ok = |body, details: &str| Self { status: 200, body, headers: Vec::new(), details: details.into() };
        Err(match request::endpoint(&head.method, &head.path) {
            Endpoint::Generate(generation) => return Ok(generation),
            Endpoint::Models => ok(models(), "inferrail_models"),
            Endpoint::Health => ok(String::new(), "inferrail_health"),
            Endpoint::WrongMethod(allow) => {
                let message = format!("Method {} is not allowed for {}.", head.method, head.path);
                let mut answer = Self::error(405, "MethodNotAllowed", &message, None, "inferrail_wrong_method");
                answer.headers.push(("allow", allow.to_string()));
                answer
            }
            Endpoint::NotFound => {
                let message = format!("No route for {} {}.", head.method, head.path);
                Self::error(404, "NotFoundError", &message, None, "inferrail_not_found")
            }
        })
    }
}

/// An error body in the OpenAI shape vLLM uses.
pub fn error_body(status: u16, kind: &str, message: &str, param: Option<&str>) -> String {
    serde_json::json!({"error": {"message": message, "type": kind, "param": param, "code": status}}).to_string()
}

/// What a reload did to the models and the listed replicas.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reloaded {
    /// Models whose aliases, policy or parameters changed (their policy state starts fresh).
    pub models: usize,
    /// Kept, with what was learned of them.
    pub kept: usize,
    /// New, or changed enough to start cold.
    pub joined: usize,
    /// Gone.
    pub left: usize,
}

/// Why a body was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    /// Not a JSON object.
    #[error("the request body is not a JSON object: {0}")]
    NotJson(String),
    /// `model` is present but not a string.
    #[error("`model` must be a string")]
    ModelNotString,
}
