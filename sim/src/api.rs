//! The HTTP API: routes requests to handlers and turns engine events into
//! responses, streamed or whole. A disaggregated leg's handler also moves
//! its KV: a decode leg reads what it lacks from the prefill's side channel,
//! which this API serves too (`/_sim/nixl/read`).

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures_util::StreamExt;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{ALLOW, CONTENT_TYPE, HeaderValue};
use hyper::{HeaderMap, Method, Request, Response, StatusCode};
use inferrail_kv_events::publish::PublishStats;
use inferrail_tokenize::Tokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

use crate::engine::{self, Engine, Event, Submitted, Transfer, Unread};
use crate::errors::ApiError;
use crate::fault::{Action, FaultRequest, Faults};
use crate::lora::{Adapters, Module};
use crate::metrics::FinishReason;
use crate::nixl::{self, Connector, Leg, ReadRequest};
use crate::wire::{self, GenRequest, Kind, Reply, Served, Usage};

/// Response body type.
pub type Body = UnsyncBoxBody<Bytes, Infallible>;

/// The connection is to be dropped without an answer (a fault).
#[derive(Debug)]
pub struct Dropped;

impl std::fmt::Display for Dropped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection dropped by an injected fault")
    }
}

impl std::error::Error for Dropped {}

/// Largest request body read.
const MAX_BODY: usize = 64 << 20;

/// Routes and the methods each takes, for 405 `Allow`.
const ROUTES: [(&str, &str); 16] = [
    ("/v1/chat/completions", "POST"),
    ("/v1/completions", "POST"),
    ("/v1/models", "GET"),
    ("/health", "GET"),
    ("/ping", "GET, POST"),
    ("/version", "GET"),
    ("/load", "GET"),
    ("/metrics", "GET"),
    ("/tokenize", "POST"),
    (LOAD_LORA, "POST"),
    (UNLOAD_LORA, "POST"),
    ("/reset_prefix_cache", "POST"),
    ("/_sim/fault", "GET, POST"),
    ("/_sim/kv_events", "GET"),
    ("/_sim/requests", "GET"),
    (nixl::READ_PATH, "POST"),
];

/// Where adapters are loaded and unloaded at run time.
const LOAD_LORA: &str = "/v1/load_lora_adapter";
const UNLOAD_LORA: &str = "/v1/unload_lora_adapter";

/// Everything a request handler needs.
pub struct App {
    /// The engine.
    pub engine: Engine,
    /// Injected faults.
    pub faults: Faults,
    names: Vec<String>,
    tokenizer: Arc<Tokenizer>,
    root: String,
    max_model_len: usize,
    details: bool,
    default_output_tokens: usize,
    created: u64,
    perm_id: String,
    rng: Mutex<StdRng>,
    in_flight: Arc<AtomicUsize>,
    /// The most generation requests it has had at once (`/_sim/requests`, for tests of routers' limits).
    peak_in_flight: AtomicUsize,
    connector: Option<Arc<Connector>>,
    /// `Bearer <--api-key>`, when one is set.
    bearer: Option<String>,
    adapters: Adapters,
    runtime_lora: bool,
}

/// Settings of the API layer.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// Served names.
    pub names: Vec<String>,
    /// The model's tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// Model path.
    pub root: String,
    /// Context length.
    pub max_model_len: usize,
    /// Report cached tokens.
    pub details: bool,
    /// Output length of chat requests without `max_tokens`.
    pub default_output_tokens: usize,
    /// Seed for ids.
    pub seed: u64,
    /// The KV connector, for disaggregated legs.
    pub connector: Option<Connector>,
    /// The key `/v1` requests must carry (`--api-key`).
    pub api_key: Option<String>,
    /// Whether adapters are served (`--enable-lora`), and those loaded at start.
    pub lora: Option<Vec<Module>>,
    /// Adapters load and unload at run time (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`).
    pub runtime_lora: bool,
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn full(status: StatusCode, content_type: Option<&'static str>, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(Full::new(body.into()).boxed_unsync());
    *r.status_mut() = status;
    if let Some(ct) = content_type {
        r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(ct));
    }
    r
}

fn json(body: impl Into<Bytes>) -> Response<Body> {
    full(StatusCode::OK, Some("application/json"), body)
}

/// `GET /_sim/kv_events`: the publisher's counters, or `{"enabled":false}`.
fn kv_event_stats(stats: Option<PublishStats>) -> String {
    match stats {
        Some(s) => serde_json::json!({
            "enabled": true,
            "published": s.published,
            "sent": s.sent,
            "skipped": s.skipped,
            "dropped": s.dropped,
        })
        .to_string(),
        None => r#"{"enabled":false}"#.to_owned(),
    }
}

fn error(e: ApiError) -> Response<Body> {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut r = full(status, Some("application/json"), e.body);
    if let Some(allow) = e.allow {
        r.headers_mut().insert(ALLOW, HeaderValue::from_static(allow));
    }
    r
}

fn status_error(status: u16, message: &str) -> ApiError {
    let kind = match status {
        500 => "InternalServerError",
        503 => "ServiceUnavailableError",
        429 => "RateLimitError",
        _ => "Error",
    };
    ApiError::openai(status, kind, message, None)
}

fn sse(data: &str) -> Bytes {
    Bytes::from(format!("data: {data}\n\n"))
}

/// A disaggregated leg: what its handler needs beside the engine's events.
#[derive(Clone)]
struct Pair {
    connector: Arc<Connector>,
    engine: Engine,
    transfer: Transfer,
    leg: Leg,
}

impl Pair {
    /// The cached tokens a response reports: a decode leg reports the
    /// prefill's (`remote_prefill_cached_tokens`) when it was told them.
    fn cached(pair: Option<&Self>, engine: usize) -> usize {
        match pair.map(|p| &p.leg) {
            Some(Leg::Decode(remote)) => remote.cached_tokens.unwrap_or(engine),
            _ => engine,
        }
    }

    /// Reads a decode leg's missing blocks, records the transfer on this
    /// engine's metrics, and tells the engine how it went.
    async fn read(pair: Option<&Self>, sub: &Submitted, blocks: usize) {
        let Some((p, Leg::Decode(remote))) = pair.map(|p| (p, &p.leg)) else {
            sub.loaded(false);
            return;
        };
        let result = p.connector.read_tail(remote, blocks).await;
        let bytes = p.connector.bytes(blocks);
        p.engine.record(|st| match &result {
            Ok(t) => {
                st.nixl.xfer_time.observe(t.secs);
                st.nixl.post_time.observe(0.0);
                st.nixl.bytes.observe(bytes as f64);
                st.nixl.descriptors.observe(t.blocks as f64);
            }
            Err(_) => st.nixl.failed_transfers += 1,
        });
        if let Err(e) = &result {
            tracing::warn!(error = e, "KV transfer failed");
        }
        sub.loaded(result.is_ok());
    }

    /// The `kv_transfer_params` a finished prefill leg answers with.
    fn params(&self, block_ids: &[u32], usage: Usage) -> Value {
        let Transfer::Keep(key) = &self.transfer else { return Value::Null };
        nixl::prefill_params(&self.connector.cfg, &self.connector.side, key, block_ids, usage.prompt, usage.cached)
    }
}

/// Frees kept blocks when a read ends, however it ends.
struct Release<'a> {
    engine: &'a Engine,
    key: &'a str,
}

impl Drop for Release<'_> {
    fn drop(&mut self) {
        self.engine.release(self.key);
    }
}

/// Counts a request in flight for `/load` while it lives.
struct InFlight(Arc<AtomicUsize>);

impl InFlight {
    /// Counts one more request in `c`, and in `peak` the most there have been.
    fn new(c: &Arc<AtomicUsize>, peak: &AtomicUsize) -> Self {
        let now = c.fetch_add(1, Ordering::Relaxed) + 1;
        peak.fetch_max(now, Ordering::Relaxed);
        Self(c.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl App {
    /// An API over a started engine; an error names an adapter that cannot be loaded.
    pub fn new(cfg: ApiConfig, engine: Engine, faults: Faults) -> anyhow::Result<Self> {
        let mut rng = StdRng::seed_from_u64(cfg.seed);
        let perm_id = format!("modelperm-{:016x}", rng.random::<u64>());
        let adapters = Adapters::new(cfg.lora.as_deref().unwrap_or_default(), &cfg.names)?;
        // Adapters loaded at start are in host memory and a slot, as vLLM's are.
        for a in adapters.all() {
            engine.preload_lora(a.id);
        }
        Ok(Self {
            engine,
            faults,
            names: cfg.names,
            tokenizer: cfg.tokenizer,
            root: cfg.root,
            max_model_len: cfg.max_model_len,
            details: cfg.details,
            default_output_tokens: cfg.default_output_tokens,
            created: unix_now(),
            perm_id,
            rng: Mutex::new(rng),
            in_flight: Arc::new(AtomicUsize::new(0)),
            peak_in_flight: AtomicUsize::new(0),
            connector: cfg.connector.map(Arc::new),
            bearer: cfg.api_key.map(|k| format!("Bearer {k}")),
            adapters,
            runtime_lora: cfg.lora.is_some() && cfg.runtime_lora,
        })
    }

    fn served(&self) -> Served<'_> {
        Served { names: &self.names, max_model_len: self.max_model_len, tokenizer: &self.tokenizer, adapters: self.adapters.all() }
    }

    fn random_id(&self) -> String {
        let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
        format!("{:016x}", rng.random::<u64>())
    }

    /// Answers one request, honoring the fault in force.
    pub async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Result<Response<Body>, Dropped> {
        if req.uri().path() != "/_sim/fault" {
            match self.faults.action() {
                Action::Serve => {}
                Action::Refuse | Action::Close => return Err(Dropped),
                Action::Hang => self.faults.hang().await,
                Action::Delay(d) => tokio::time::sleep(d).await,
                Action::Error(status) => return Ok(error(status_error(status, "Injected fault: the engine is unavailable."))),
            }
        }
        if let Some(bearer) = &self.bearer
            && req.uri().path().starts_with("/v1")
            && req.method() != Method::OPTIONS
            && req.headers().get("authorization").is_none_or(|v| v.as_bytes() != bearer.as_bytes())
        {
            // vLLM's AuthenticationMiddleware answers exactly this.
            return Ok(full(StatusCode::UNAUTHORIZED, Some("application/json"), r#"{"error":"Unauthorized"}"#));
        }
        Ok(self.route(req).await)
    }

    async fn route(&self, req: Request<Incoming>) -> Response<Body> {
        let path = req.uri().path().to_string();
        let route = if path == "/metrics/" { "/metrics" } else { path.as_str() };
        let Some(&(_, allow)) = ROUTES.iter().find(|(p, _)| *p == route) else {
            return error(ApiError::no_route());
        };
        if [LOAD_LORA, UNLOAD_LORA].contains(&route) && !self.runtime_lora {
            return error(ApiError::no_route());
        }
        let method = req.method().clone();
        if !allow.split(", ").any(|m| m == method.as_str()) {
            return error(ApiError::wrong_method(allow));
        }
        let headers = req.headers().clone();
        let body = if method == Method::POST {
            match Limited::new(req.into_body(), MAX_BODY).collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
                    return error(ApiError::openai(413, "BadRequestError", "Request body too large.", None));
                }
                Err(_) => return error(ApiError::bad_request("Could not read the request body.", None)),
            }
        } else {
            Bytes::new()
        };
        match route {
            "/v1/chat/completions" => self.generate(Kind::Chat, &headers, &body).await,
            "/v1/completions" => self.generate(Kind::Completion, &headers, &body).await,
            "/v1/models" => {
                json(wire::models(&self.names, &self.adapters.all(), &self.root, self.max_model_len, self.created, &self.perm_id))
            }
            LOAD_LORA | UNLOAD_LORA => match self.update_lora(route == LOAD_LORA, &body) {
                Ok(done) => full(StatusCode::OK, None, done),
                Err(e) => error(e),
            },
            "/health" | "/ping" => full(StatusCode::OK, None, Bytes::new()),
            "/version" => json(r#"{"version":"0.32.0"}"#),
            "/load" => json(format!(r#"{{"server_load":{}}}"#, self.in_flight.load(Ordering::Relaxed))),
            "/metrics" => full(StatusCode::OK, Some("text/plain; version=0.0.4; charset=utf-8"), self.engine.metrics_page()),
            "/tokenize" => match wire::tokenize(&body, &self.served()) {
                Ok(b) => json(b),
                Err(e) => error(e),
            },
            "/reset_prefix_cache" => {
                if self.engine.reset_prefix_cache().await.is_none() {
                    // vLLM answers 200 too, and only logs it.
                    tracing::warn!("Failed to reset prefix cache because some blocks are not freed yet");
                }
                full(StatusCode::OK, None, Bytes::new())
            }
            "/_sim/kv_events" => json(kv_event_stats(self.engine.kv_events().map(|p| p.stats()))),
            nixl::READ_PATH => self.serve_read(&body).await,
            "/_sim/requests" => json(format!(
                r#"{{"in_flight":{},"peak_in_flight":{}}}"#,
                self.in_flight.load(Ordering::Relaxed),
                self.peak_in_flight.load(Ordering::Relaxed)
            )),
            _ => self.control(&method, &body),
        }
    }

    /// Loads or unloads an adapter; the answer on success is vLLM's plain text.
    fn update_lora(&self, load: bool, body: &[u8]) -> Result<String, ApiError> {
        let m = wire::parse_object(body)?;
        let field = |k: &str| match m.get(k) {
            Some(Value::String(v)) => Ok(v.clone()),
            Some(other) => Err(ApiError::validation("string_type", &format!("body.{k}"), "Input should be a valid string", other, None)),
            None => Err(ApiError::validation("missing", &format!("body.{k}"), "Field required", &Value::Object(m.clone()), None)),
        };
        let name = field("lora_name")?;
        if !load {
            self.adapters.unload(&name)?;
            return Ok(format!("Success: LoRA adapter '{name}' removed successfully."));
        }
        let path = field("lora_path")?;
        let inplace = m.get("load_inplace").and_then(Value::as_bool).unwrap_or(false);
        let adapter = self.adapters.load(&name, &path, None, inplace, &self.names)?;
        // Loading puts it in host memory and a slot, as vLLM's `add_lora` does.
        self.engine.preload_lora(adapter.id);
        Ok(format!("Success: LoRA adapter '{name}' added successfully."))
    }

    fn control(&self, method: &Method, body: &[u8]) -> Response<Body> {
        if method == Method::POST {
            match serde_json::from_slice::<FaultRequest>(body) {
                Ok(req) => self.faults.set(req),
                Err(e) => return error(ApiError::bad_request(&format!("Invalid fault: {e}"), Some("mode"))),
            }
        }
        json(serde_json::to_string(&self.faults.current()).unwrap_or_default())
    }

    async fn generate(&self, kind: Kind, headers: &HeaderMap, body: &[u8]) -> Response<Body> {
        let req = match wire::parse_generation(kind, body, &self.served()) {
            Ok(r) => r,
            Err(e) => return error(e),
        };
        let leg = match &self.connector {
            Some(_) => match nixl::leg(req.kv_transfer_params.as_ref()) {
                Ok(leg) => leg,
                Err(e) => return error(e),
            },
            None => Leg::Whole,
        };
        let request_id = headers
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty())
            .map_or_else(|| self.random_id(), str::to_string);
        let prefix = if kind == Kind::Chat { "chatcmpl" } else { "cmpl" };
        let reply = Reply {
            kind,
            id: format!("{prefix}-{request_id}"),
            created: unix_now(),
            model: req.model.clone(),
            details: self.details,
            return_token_ids: req.return_token_ids,
            continuous_usage: req.continuous_usage,
        };
        let transfer = match &leg {
            Leg::Whole => Transfer::None,
            Leg::Prefill => {
                let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
                Transfer::Keep(nixl::internal_id(&reply.id, kind == Kind::Completion, &mut *rng))
            }
            Leg::Decode(_) => Transfer::Read,
        };
        let pair = self.connector.clone().map(|connector| Pair { connector, engine: self.engine.clone(), transfer: transfer.clone(), leg });
        let (max_tokens, at_limit) = self.output_budget(&req);
        let sub = self.engine.submit(engine::Request {
            prompt: req.prompt.clone(),
            max_tokens,
            at_limit,
            salt: req.salt,
            cache_salt: req.cache_salt.clone(),
            transfer,
            lora: req.adapter.clone(),
            request_id: request_id.clone(),
        });
        let busy = InFlight::new(&self.in_flight, &self.peak_in_flight);
        let mut response = if req.stream { self.stream(sub, busy, reply, req, pair) } else { self.whole(sub, reply, req, pair).await };
        if let Ok(v) = HeaderValue::from_str(&request_id) {
            response.headers_mut().insert("x-request-id", v);
        }
        response
    }

    /// `POST /_sim/nixl/read`: a decoder reads kept blocks. They stay kept
    /// while the transfer lasts and are freed when it ends, or when the
    /// reader goes away.
    async fn serve_read(&self, body: &[u8]) -> Response<Body> {
        let read: ReadRequest = match serde_json::from_slice(body) {
            Ok(r) => r,
            Err(e) => return error(ApiError::bad_request(&format!("Invalid read: {e}"), None)),
        };
        let blocks = read.block_ids.len();
        match self.engine.pin(&read.remote_request_id, read.block_ids).await {
            Err(Unread::Unknown) => {
                let message = format!("No KV blocks are kept for request {}: read already, expired or never kept.", read.remote_request_id);
                error(ApiError::openai(404, "NotFoundError", &message, None))
            }
            Err(Unread::NotKept) => error(ApiError::bad_request("Blocks were named that the request does not keep.", Some("block_ids"))),
            Ok(()) => {
                let release = Release { engine: &self.engine, key: &read.remote_request_id };
                tokio::time::sleep(crate::cost::secs(read.transfer_s)).await;
                drop(release);
                json(format!(r#"{{"blocks":{blocks}}}"#))
            }
        }
    }

    /// Tokens to generate and the finish reason at that limit.
    fn output_budget(&self, req: &GenRequest) -> (usize, FinishReason) {
        let room = self.max_model_len - req.prompt.len();
        match req.max_tokens {
            Some(m) => (m, FinishReason::Length),
            None if self.default_output_tokens <= room => (self.default_output_tokens, FinishReason::Stop),
            None => (room, FinishReason::Length),
        }
    }

    async fn whole(&self, mut sub: Submitted, reply: Reply, req: GenRequest, pair: Option<Pair>) -> Response<Body> {
        let mut usage = Usage { prompt: req.prompt.len(), ..Usage::default() };
        let mut output = Vec::new();
        let mut text = String::new();
        let mut kept = Value::Null;
        loop {
            match sub.next().await {
                Some(Event::Scheduled { cached_tokens }) => usage.cached = Pair::cached(pair.as_ref(), cached_tokens),
                Some(Event::Read { blocks }) => Pair::read(pair.as_ref(), &sub, blocks).await,
                Some(Event::Kept { block_ids }) => {
                    if let Some(p) = &pair {
                        kept = p.params(&block_ids, usage);
                    }
                }
                Some(Event::Failed) => return error(status_error(500, "Internal server error")),
                Some(Event::Token { id, finish }) => {
                    output.push(id);
                    text.push_str(&self.tokenizer.decode(id).unwrap_or_default());
                    if let Some(reason) = finish {
                        usage.completion = output.len();
                        return json(reply.complete(&text, &req.prompt, &output, reason, usage, kept));
                    }
                }
                None => return error(status_error(500, "The engine stopped.")),
            }
        }
    }

    fn stream(&self, sub: Submitted, busy: InFlight, reply: Reply, req: GenRequest, pair: Option<Pair>) -> Response<Body> {
        let usage = Usage { prompt: req.prompt.len(), ..Usage::default() };
        let state = Some((sub, usage, req, busy));
        let tokenizer = self.tokenizer.clone();
        let events = futures_util::stream::unfold(state, move |state| {
            let reply = reply.clone();
            let tokenizer = tokenizer.clone();
            let pair = pair.clone();
            async move {
                let (mut sub, mut usage, req, busy) = state?;
                loop {
                    match sub.next().await {
                        Some(Event::Scheduled { cached_tokens }) => usage.cached = Pair::cached(pair.as_ref(), cached_tokens),
                        Some(Event::Read { blocks }) => Pair::read(pair.as_ref(), &sub, blocks).await,
                        // Streamed responses never carry kv_transfer_params.
                        Some(Event::Kept { .. }) => {}
                        Some(Event::Failed) => {
                            let mut out = Vec::with_capacity(512);
                            if reply.kind == Kind::Chat {
                                out.extend_from_slice(&sse(&reply.role_chunk(&req.prompt, usage)));
                            }
                            // Python's json.dumps, spaces after separators, as vLLM writes a stream's error.
                            out.extend_from_slice(&sse(
                                r#"{"error": {"message": "Internal server error", "type": "InternalServerError", "param": null, "code": 500}}"#,
                            ));
                            out.extend_from_slice(b"data: [DONE]\n\n");
                            return Some((Bytes::from(out), None));
                        }
                        Some(Event::Token { id, finish }) => {
                            let mut out = Vec::with_capacity(256);
                            if usage.completion == 0 && reply.kind == Kind::Chat {
                                out.extend_from_slice(&sse(&reply.role_chunk(&req.prompt, usage)));
                            }
                            usage.completion += 1;
                            out.extend_from_slice(&sse(&reply.token_chunk(&tokenizer.decode(id).unwrap_or_default(), id, finish, usage)));
                            if finish.is_none() {
                                return Some((Bytes::from(out), Some((sub, usage, req, busy))));
                            }
                            if req.include_usage {
                                out.extend_from_slice(&sse(&reply.usage_chunk(usage)));
                            }
                            out.extend_from_slice(b"data: [DONE]\n\n");
                            return Some((Bytes::from(out), None));
                        }
                        None => return None,
                    }
                }
            }
        });
        let body = StreamBody::new(events.map(|b| Ok::<_, Infallible>(Frame::data(b))));
        let mut r = Response::new(BodyExt::boxed_unsync(body));
        r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream; charset=utf-8"));
        r
    }
}
