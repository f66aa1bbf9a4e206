//! The router's configuration: one YAML file of models, replicas, discovery
//! groups and routing, health, retry and listener settings.
//!
//! Every field has a default except what only the operator knows (models and
//! replicas). [`Config::load`] parses, rejects unknown keys, and runs
//! [`Config::validate`], which checks ranges and cross references and reports
//! every problem at once, each with its path. `example.yaml` documents every
//! option with its default.
#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::net::SocketAddr;

use inferrail_policy::{Params, PolicyKind, Prefill};
use serde::{Deserialize, Serialize};

mod admission;
pub use admission::{Admission, ApiKey, Band, OnMiss, Tenant, TokenLimit};

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Config {
    /// The ext_proc gRPC listener.
    pub server: Server,
    /// The admin HTTP listener.
    pub admin: Admin,
    /// Decision settings.
    pub routing: Routing,
    /// How many fallbacks each decision names.
    pub retry: Retry,
    /// Active probes and passive ejection.
    pub health: Health,
    /// How prompts are tokenized on the routing path.
    pub tokenizer: Tokenization,
    /// The KV index: what each replica's cache is predicted to hold.
    pub kv: Kv,
    /// The engines' KV events, which make the index exact (ADR 0012).
    pub kv_events: KvEvents,
    /// Engine load: the replicas' `/metrics` pages, read here or by the sidecar.
    pub load: Load,
    /// The decision log.
    pub observability: Observability,
    /// Models clients may ask for.
    pub models: Vec<Model>,
    /// Replicas listed by address.
    pub replicas: Vec<Replica>,
    /// Replicas found by DNS.
    pub discovery: Vec<DnsGroup>,
    /// Replicas found in Kubernetes: the ready pods of an InferencePool.
    pub kubernetes: Option<KubernetesPool>,
    /// The fleet written for Envoy as EDS.
    pub eds: Eds,
    /// Other routers behind the same Envoys, sharing the requests in flight (ADR 0034).
    pub peers: Peers,
    /// Priority bands, tenants, API keys and token limits (ADR 0042).
    pub admission: Admission,
}

/// The other router replicas behind the same Envoys. Each router tells
/// every peer what it decided and what it heard of its requests, so that
/// all of them count every request in flight, hold its KV record and learn
/// its outcome, whichever router Envoy sent each stream to. The router's
/// own address may be among them (one list for all, or a headless Service
/// that resolves to every router); it recognises itself and skips it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Peers {
    /// Their ext_proc listeners, `host:port`.
    pub addresses: Vec<String>,
    /// A name that resolves to every router, with their port (`name:port`),
    /// read again every `resolve_interval_ms`: a Kubernetes headless Service.
    pub dns: Option<String>,
    /// How often `dns` is resolved, milliseconds.
    pub resolve_interval_ms: u64,
}

impl Default for Peers {
    fn default() -> Self {
        Self { addresses: Vec::new(), dns: None, resolve_interval_ms: 1000 }
    }
}

/// `host:port` with a host and a port number.
fn host_port(s: &str) -> bool {
    s.rsplit_once(':').is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
}

/// The fleet written as Envoy EDS for the replica cluster: every replica
/// (discovered ones too) with its health, `DRAINING` while it drains, so
/// that Envoy's own balancing, the path a request takes when the router
/// cannot decide, honours what the router knows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Eds {
    /// The file the cluster's `eds_config.path_config_source` names; it is
    /// replaced by a rename, as Envoy's watch expects. Unset: none written.
    pub path: Option<String>,
    /// The replica cluster's name in Envoy's bootstrap.
    pub cluster: String,
}

impl Default for Eds {
    fn default() -> Self {
        Self { path: None, cluster: "replicas".into() }
    }
}

/// The ext_proc gRPC listener.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Server {
    /// Address Envoy's ext_proc filters connect to.
    pub listen: String,
    /// Largest request body the router reads; larger ones get 413.
    pub max_body_bytes: usize,
    /// On SIGTERM, how long open streams may finish, milliseconds.
    pub shutdown_grace_ms: u64,
    /// Threads serving gRPC and the routing path: 1 runs everything on one
    /// thread (least waking between threads, the cheapest per request on a
    /// few cores), more runs a work-stealing pool of that many. Long bodies
    /// are tokenized on `tokenizer.workers` either way. Fixed at start.
    pub threads: usize,
}

impl Default for Server {
    fn default() -> Self {
        Self { listen: "127.0.0.1:9002".into(), max_body_bytes: 16 << 20, shutdown_grace_ms: 30_000, threads: 1 }
    }
}

/// The admin listeners: HTTP (`/metrics`, `/healthz`, `/readyz`) and gRPC
/// (`inferrail.admin.v1`: Explain, Replicas, with server reflection).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Admin {
    /// Address of the admin HTTP listener.
    pub listen: String,
    /// Address of the admin gRPC listener; keep it off public interfaces.
    pub grpc_listen: String,
}

impl Default for Admin {
    fn default() -> Self {
        Self { listen: "127.0.0.1:9090".into(), grpc_listen: "127.0.0.1:9091".into() }
    }
}

/// Decision settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Routing {
    /// Seed of the randomized policies; the same seed replays the same choices.
    pub seed: u64,
    /// Every policy's parameters, for every model; a model's `policies` overrides them field by field.
    pub policies: Params,
}

impl Default for Routing {
    fn default() -> Self {
        Self { seed: 0x1fe4_7a11, policies: Params::default() }
    }
}

/// Fallbacks named after the winner, for Envoy's retries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Retry {
    /// Distinct replicas named after the winner (0 to 8).
    pub fallbacks: usize,
}

impl Default for Retry {
    fn default() -> Self {
        Self { fallbacks: 2 }
    }
}

/// Active probes of each replica's `/health` and passive ejection on failures.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Health {
    /// Time between probes of one replica, milliseconds.
    pub probe_interval_ms: u64,
    /// A probe that takes longer fails, milliseconds.
    pub probe_timeout_ms: u64,
    /// Consecutive failed requests that eject a replica (a failed probe
    /// marks it unhealthy at once, until a probe succeeds).
    pub consecutive_failures: u32,
    /// First ejection length; each further one doubles it, milliseconds.
    pub base_ejection_ms: u64,
    /// Longest ejection, milliseconds.
    pub max_ejection_ms: u64,
    /// Most of a model's replicas ejected at once (0.0 to 1.0).
    pub max_ejected_fraction: f64,
}

impl Default for Health {
    fn default() -> Self {
        Self {
            probe_interval_ms: 1_000,
            probe_timeout_ms: 500,
            consecutive_failures: 3,
            base_ejection_ms: 1_000,
            max_ejection_ms: 30_000,
            max_ejected_fraction: 0.5,
        }
    }
}

/// How prompts are tokenized on the routing path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Tokenization {
    /// Tokens of repeated prompt pieces (system prompts, earlier turns) kept encoded, per model.
    pub cache_tokens: usize,
    /// Threads that tokenize large bodies.
    pub workers: usize,
    /// Large bodies waiting for a worker; a body that finds the queue full is routed without a prediction.
    pub queue: usize,
    /// Longest a body waits for its tokens before it is routed without a prediction, milliseconds.
    pub max_wait_ms: u64,
    /// Bodies smaller than this are tokenized inline, without a worker, bytes.
    pub inline_below_bytes: usize,
}

impl Default for Tokenization {
    fn default() -> Self {
        Self { cache_tokens: 1 << 20, workers: 2, queue: 256, max_wait_ms: 50, inline_below_bytes: 32 << 10 }
    }
}

/// The KV index's defaults, used where neither the replica's config nor its engine says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Kv {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks one replica holds.
    pub blocks: usize,
    /// Output tokens expected of a chat request without `max_tokens` (they take cache room).
    pub expected_output_tokens: usize,
    /// Clients resend the replies they got, as they came, in their next
    /// turn (agent loops, chat apps): a replica that generated a reply is
    /// predicted to hold its blocks when the next turn resends it
    /// (approximate mode). Off for clients that replay recorded
    /// conversations or edit replies.
    pub resent_replies: bool,
}

impl Default for Kv {
    fn default() -> Self {
        Self { block_size: 16, blocks: 8192, expected_output_tokens: 256, resent_replies: true }
    }
}

/// The engines' KV events: where the router subscribes for each replica,
/// and how it follows them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct KvEvents {
    /// Where to subscribe for every replica without `kv_events` of its own;
    /// `{host}` stands for the replica's IP (`tcp://{host}:5557` for
    /// engines started with `"endpoint": "tcp://*:5557"`). None: only
    /// replicas with their own subscribe.
    pub endpoint: Option<String>,
    /// The engines' replay endpoint, `{host}` as in `endpoint`.
    pub replay_endpoint: Option<String>,
    /// The engines' topic; empty takes every message.
    pub topic: String,
    /// Bind the endpoint and let the engine connect (vLLM's way with an IP
    /// endpoint; then one router per engine endpoint), instead of connecting
    /// to an engine that binds.
    pub bind: bool,
    /// Messages waiting to be applied, per replica; more are dropped (and the
    /// replica falls back unless the replay fills in).
    pub queue: usize,
    /// No message for this long while requests run on an exact replica makes it suspect.
    pub silent_after_ms: u64,
    /// How long a replay may take.
    pub replay_timeout_ms: u64,
}

impl Default for KvEvents {
    fn default() -> Self {
        Self {
            endpoint: None,
            replay_endpoint: None,
            topic: String::new(),
            bind: false,
            queue: 1024,
            silent_after_ms: 10_000,
            replay_timeout_ms: 1_000,
        }
    }
}

/// One replica's KV events, overriding the `kv_events` template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaKvEvents {
    /// Where to subscribe.
    pub endpoint: String,
    /// The engine's replay endpoint.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// The engine's topic (default: `kv_events.topic`).
    #[serde(default)]
    pub topic: Option<String>,
    /// Bind instead of connect (default: `kv_events.bind`).
    #[serde(default)]
    pub bind: Option<bool>,
}

/// Where one replica's events come from, resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventSource {
    /// Where to subscribe.
    pub endpoint: String,
    /// The replay endpoint.
    pub replay_endpoint: Option<String>,
    /// The topic.
    pub topic: String,
    /// Bind instead of connect.
    pub bind: bool,
}

/// What the router records of its decisions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Observability {
    /// One JSON line per sampled decision, then one per its outcome.
    pub decision_log: DecisionLog,
    /// The OpenTelemetry collector's OTLP/HTTP address (`http://host:4318`,
    /// to which `/v1/traces` is added, or a full URL); unset: no traces.
    pub otlp_endpoint: Option<String>,
    /// Share of new traces kept, 0 to 1; a client's `traceparent` that says
    /// sampled (or not) decides for its own trace.
    pub trace_sample_ratio: f64,
}

impl Default for Observability {
    fn default() -> Self {
        Self { decision_log: DecisionLog::default(), otlp_endpoint: None, trace_sample_ratio: 1.0 }
    }
}

/// The decision log: off unless a path and a sample rate are set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DecisionLog {
    /// The file lines are appended to.
    pub path: Option<String>,
    /// Share of requests logged, 0 to 1 (sampled by request id, so a decision and its outcome go together).
    pub sample_rate: f64,
    /// Lines waiting for the writer; when full, lines are dropped and counted, never waited for.
    pub queue: usize,
}

impl Default for DecisionLog {
    fn default() -> Self {
        Self { path: None, sample_rate: 0.0, queue: 4096 }
    }
}

/// Where the engines' load comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Load {
    /// The `inferrail-scraper` sidecar's gRPC address (`http://127.0.0.1:9095`);
    /// unset: the router reads every replica's `/metrics` itself.
    pub sidecar: Option<String>,
    /// Time between reads of one replica's page, milliseconds.
    pub interval_ms: u64,
    /// A read that takes longer fails, milliseconds.
    pub timeout_ms: u64,
    /// A page larger than this fails, bytes.
    pub max_bytes: usize,
}

impl Default for Load {
    fn default() -> Self {
        Self { sidecar: None, interval_ms: 100, timeout_ms: 100, max_bytes: 4 << 20 }
    }
}

/// A model clients may ask for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Model {
    /// The name the engines serve.
    pub name: String,
    /// Other names clients may use; the body is rewritten to `name`.
    pub aliases: Vec<String>,
    /// How its replicas are chosen.
    pub policy: PolicyKind,
    /// A policy that plans every request alongside `policy`, with the same
    /// parameters, and sends nothing: its choice and whether it agreed go
    /// to metrics and the decision log.
    pub shadow_policy: Option<PolicyKind>,
    /// Its tokenizer: `builtin:sim`, a directory with `tokenizer.json` and
    /// `tokenizer_config.json`, or `hf:<org>/<name>` from the local Hugging
    /// Face cache. Without one, its requests are routed without predictions.
    pub tokenizer: Option<String>,
    /// The admission band of its requests that name none (`admission.bands`).
    pub band: Option<String>,
    /// Policy parameters of this model that differ from `routing.policies`
    /// (same shape; only the fields given are overridden).
    pub policies: serde_yaml::Value,
}

impl Default for Model {
    fn default() -> Self {
        Self {
            name: String::new(),
            aliases: Vec::new(),
            policy: PolicyKind::RoundRobin,
            shadow_policy: None,
            tokenizer: None,
            band: None,
            policies: serde_yaml::Value::Null,
        }
    }
}

/// `over` laid on `base`: mappings merge key by key, anything else replaces.
fn merged(base: serde_yaml::Value, over: &serde_yaml::Value) -> serde_yaml::Value {
    use serde_yaml::Value;
    match (base, over) {
        (Value::Mapping(mut b), Value::Mapping(o)) => {
            for (k, v) in o {
                let inner = b.remove(k).unwrap_or(Value::Null);
                b.insert(k.clone(), merged(inner, v));
            }
            Value::Mapping(b)
        }
        (base, Value::Null) => base,
        (_, o) => o.clone(),
    }
}

/// A replica's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most requests in flight.
    pub max_concurrency: u32,
    /// Most requests waiting for their first byte.
    pub max_pending: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self { max_concurrency: 256, max_pending: 256 }
    }
}

/// What a replica serves and takes (for a DNS group or a pool, each of
/// its members): its models, limits and cache shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Serving {
    /// Models it serves.
    pub models: Vec<String>,
    /// Most requests in flight.
    pub max_concurrency: u32,
    /// Most requests waiting for their first byte.
    pub max_pending: u32,
    /// Tokens per KV block; learned from the engine's metrics when unset.
    pub block_size: Option<usize>,
    /// KV blocks it holds; learned from the engine's metrics when unset.
    pub kv_blocks: Option<usize>,
    /// Its engine's prefill cost, as `inferrail-calibrate` fits it, for a
    /// fleet whose engines differ; unset, its model's `policies.prefill`.
    pub prefill: Option<Prefill>,
}

impl Default for Serving {
    fn default() -> Self {
        let l = Limits::default();
        Self {
            models: Vec::new(),
            max_concurrency: l.max_concurrency,
            max_pending: l.max_pending,
            block_size: None,
            kv_blocks: None,
            prefill: None,
        }
    }
}

impl Serving {
    /// Its limits.
    pub fn limits(&self) -> Limits {
        Limits { max_concurrency: self.max_concurrency, max_pending: self.max_pending }
    }

    /// Its cache shape as configured.
    pub fn cache(&self) -> CacheShape {
        CacheShape { block_size: self.block_size, blocks: self.kv_blocks }
    }
}

/// A replica listed by address.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Replica {
    /// Unique name, used in metrics and response headers.
    pub id: String,
    /// `ip:port`, exactly as Envoy's cluster lists it.
    pub address: String,
    /// Its models, limits and cache shape.
    #[serde(flatten)]
    pub serving: Serving,
    /// Its KV events, when not from the `kv_events` template.
    pub kv_events: Option<ReplicaKvEvents>,
    /// Draining: it finishes its requests and is offered no new one.
    pub drain: bool,
}

/// A replica's KV cache shape as configured; what is unset is learned from its engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheShape {
    /// Tokens per block.
    pub block_size: Option<usize>,
    /// Blocks.
    pub blocks: Option<usize>,
}

/// Replicas found by resolving a DNS name; members are named `<group>-<ip>-<port>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DnsGroup {
    /// Group name, the prefix of member ids.
    pub group: String,
    /// Name to resolve (A and AAAA).
    pub host: String,
    /// Port of every member.
    pub port: u16,
    /// Time between lookups, milliseconds.
    pub interval_ms: u64,
    /// Every member's models, limits and cache shape.
    #[serde(flatten)]
    pub serving: Serving,
}

impl Default for DnsGroup {
    fn default() -> Self {
        Self { group: String::new(), host: String::new(), port: 8000, interval_ms: 5_000, serving: Serving::default() }
    }
}

/// The ready pods an InferencePool (`inference.networking.k8s.io/v1`)
/// selects, read and watched from the API server; each pod is a replica
/// named after it, on the pool's first target port. A pod annotated
/// `inferrail.io/kv-events` (and `inferrail.io/kv-events-replay`) has its
/// KV events there, `{host}` standing for its IP; the others follow the
/// `kv_events` template.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct KubernetesPool {
    /// The InferencePool's name.
    pub pool: String,
    /// Its namespace; unset: the one the router runs in (or the kubeconfig's).
    pub namespace: Option<String>,
    /// Every pod's models, limits and cache shape.
    #[serde(flatten)]
    pub serving: Serving,
}

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// What went wrong.
        source: std::io::Error,
    },
    /// Not YAML of the right shape.
    #[error("{0}")]
    Parse(serde_yaml::Error),
    /// Parsed, but wrong; every problem with its path.
    #[error("{} problem(s):\n  {}", .0.len(), .0.join("\n  "))]
    Invalid(Vec<String>),
}

impl Config {
    /// Model `m`'s policy parameters: `routing.policies` with the model's
    /// own laid over them, or every problem with its path.
    pub fn params(&self, m: usize) -> Result<Params, Vec<String>> {
        let over = &self.models[m].policies;
        if over.is_null() {
            return Ok(self.routing.policies.clone());
        }
        let at = format!("models[{m}].policies");
        let base = serde_yaml::to_value(&self.routing.policies).map_err(|e| vec![format!("{at}: {e}")])?;
        let given = merged(base, over);
        let params: Params = serde_yaml::from_value(given.clone()).map_err(|e| vec![format!("{at}: {e}")])?;
        let mut unknown = Vec::new();
        unknown_keys(&given, &serde_yaml::to_value(&params).map_err(|e| vec![format!("{at}: {e}")])?, &at, &mut unknown);
        if unknown.is_empty() { Ok(params) } else { Err(unknown) }
    }

    /// Reads, parses and validates a file.
    pub fn load(path: &str) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.into(), source })?;
        Self::parse(&text)
    }

    /// Parses and validates YAML text.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let config: Config = serde_yaml::from_str(text).map_err(ConfigError::Parse)?;
        // What was given and what was read of it, side by side: a key read into no field is unknown.
        let given: serde_yaml::Value = serde_yaml::from_str(text).map_err(ConfigError::Parse)?;
        let mut problems = Vec::new();
        unknown_keys(&given, &serde_yaml::to_value(&config).map_err(ConfigError::Parse)?, "", &mut problems);
        problems.extend(config.validate());
        if problems.is_empty() { Ok(config) } else { Err(ConfigError::Invalid(problems)) }
    }

    /// Where the KV events of a replica at `ip` come from: its own (`own`,
    /// from its entry or its pod's annotations), else the template; none
    /// when neither says.
    pub fn event_source(&self, own: Option<&ReplicaKvEvents>, ip: std::net::IpAddr) -> Option<EventSource> {
        let t = &self.kv_events;
        let host = |s: &str| s.replace("{host}", &ip.to_string());
        match own {
            Some(own) => Some(EventSource {
                endpoint: host(&own.endpoint),
                replay_endpoint: own.replay_endpoint.as_deref().map(host),
                topic: own.topic.clone().unwrap_or_else(|| t.topic.clone()),
                bind: own.bind.unwrap_or(t.bind),
            }),
            None => t.endpoint.as_deref().map(|e| EventSource {
                endpoint: host(e),
                replay_endpoint: t.replay_endpoint.as_deref().map(host),
                topic: t.topic.clone(),
                bind: t.bind,
            }),
        }
    }

    /// Every range and cross-reference problem, each with its path.
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        let e = &self.kv_events;
        if e.queue == 0 || e.silent_after_ms == 0 || e.replay_timeout_ms == 0 {
            p.push("kv_events: queue, silent_after_ms and replay_timeout_ms must be at least 1".into());
        }
        let own = self.replicas.iter().filter_map(|r| r.kv_events.as_ref().map(|k| (format!("replicas[{}].kv_events", r.id), k)));
        let endpoints = [("kv_events".to_owned(), e.endpoint.as_deref(), e.replay_endpoint.as_deref())]
            .into_iter()
            .chain(own.map(|(path, k)| (path, Some(k.endpoint.as_str()), k.replay_endpoint.as_deref())));
        for (path, endpoint, replay) in endpoints {
            for (field, value) in [("endpoint", endpoint), ("replay_endpoint", replay)] {
                if let Some(v) = value
                    && !["tcp://", "ipc://", "inproc://"].iter().any(|s| v.starts_with(s))
                {
                    p.push(format!("{path}.{field}: {v:?} is not a tcp://, ipc:// or inproc:// endpoint"));
                }
            }
        }
        for (path, addr) in
            [("server.listen", &self.server.listen), ("admin.listen", &self.admin.listen), ("admin.grpc_listen", &self.admin.grpc_listen)]
        {
            if addr.parse::<SocketAddr>().is_err() {
                p.push(format!("{path}: {addr:?} is not ip:port"));
            }
        }
        if self.server.max_body_bytes == 0 {
            p.push("server.max_body_bytes: must be at least 1".into());
        }
        if self.server.threads == 0 {
            p.push("server.threads: must be at least 1".into());
        }
        if self.retry.fallbacks > 8 {
            p.push(format!("retry.fallbacks: {} is more than 8", self.retry.fallbacks));
        }
        let h = &self.health;
        if h.probe_interval_ms == 0 || h.probe_timeout_ms == 0 || h.base_ejection_ms == 0 {
            p.push("health: probe_interval_ms, probe_timeout_ms and base_ejection_ms must be at least 1".into());
        }
        if h.max_ejection_ms < h.base_ejection_ms {
            p.push("health.max_ejection_ms: shorter than base_ejection_ms".into());
        }
        if h.consecutive_failures == 0 {
            p.push("health.consecutive_failures: must be at least 1".into());
        }
        if !(0.0..=1.0).contains(&h.max_ejected_fraction) {
            p.push(format!("health.max_ejected_fraction: {} is not between 0 and 1", h.max_ejected_fraction));
        }
        if self.models.is_empty() {
            p.push("models: at least one model is needed".into());
        }
        let t = &self.tokenizer;
        if t.workers == 0 || t.queue == 0 || t.max_wait_ms == 0 {
            p.push("tokenizer: workers, queue and max_wait_ms must be at least 1".into());
        }
        let l = &self.load;
        if l.interval_ms == 0 || l.timeout_ms == 0 || l.max_bytes == 0 {
            p.push("load: interval_ms, timeout_ms and max_bytes must be at least 1".into());
        }
        if l.interval_ms >= 250 {
            p.push(format!("load.interval_ms: {} would leave most reports older than the 250 ms after which none is used", l.interval_ms));
        }
        let d = &self.observability.decision_log;
        if !(0.0..=1.0).contains(&d.sample_rate) {
            p.push(format!("observability.decision_log.sample_rate: {} is not between 0 and 1", d.sample_rate));
        }
        if d.queue == 0 {
            p.push("observability.decision_log.queue: must be at least 1".into());
        }
        if d.sample_rate > 0.0 && d.path.is_none() {
            p.push("observability.decision_log.path: needed when sample_rate is above 0".into());
        }
        let o = &self.observability;
        if !(0.0..=1.0).contains(&o.trace_sample_ratio) {
            p.push(format!("observability.trace_sample_ratio: {} is not between 0 and 1", o.trace_sample_ratio));
        }
        if let Some(e) = &o.otlp_endpoint
            && !e.starts_with("http://")
        {
            p.push(format!(
                "observability.otlp_endpoint: {e:?} is not an http:// address (traces are sent without TLS: use a local collector)"
            ));
        }
        if let Some(s) = &l.sidecar
            && !(s.starts_with("http://") || s.starts_with("https://"))
        {
            p.push(format!("load.sidecar: {s:?} is not an http:// or https:// address"));
        }
        for (i, a) in self.peers.addresses.iter().enumerate() {
            if !host_port(a) {
                p.push(format!("peers.addresses[{i}]: {a:?} is not host:port"));
            }
        }
        if let Some(d) = &self.peers.dns
            && !host_port(d)
        {
            p.push(format!("peers.dns: {d:?} is not name:port"));
        }
        if self.peers.resolve_interval_ms == 0 {
            p.push("peers.resolve_interval_ms: must be at least 1".into());
        }
        if self.eds.cluster.is_empty() {
            p.push("eds.cluster: the replica cluster's name is required".into());
        }
        if self.kv.block_size == 0 || self.kv.blocks == 0 {
            p.push("kv: block_size and blocks must be at least 1".into());
        }
        p.extend(self.routing.policies.validate("routing.policies"));
        p.extend(self.admission.validate(self.models.iter().map(|m| (m.name.as_str(), m.band.as_deref()))));
        let mut names = HashSet::new();
        for (i, m) in self.models.iter().enumerate() {
            if m.name.is_empty() {
                p.push(format!("models[{i}].name: missing"));
            }
            if !m.policies.is_null() {
                match self.params(i) {
                    Ok(params) => p.extend(params.validate(&format!("models[{i}].policies"))),
                    Err(e) => p.extend(e),
                }
            }
            for n in std::iter::once(&m.name).chain(&m.aliases) {
                if !n.is_empty() && !names.insert(n.as_str()) {
                    p.push(format!("models[{i}]: the name {n:?} is used twice"));
                }
            }
        }
        let known: HashSet<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
        let mut ids = HashSet::new();
        let mut served: HashSet<&str> = HashSet::new();
        for (i, r) in self.replicas.iter().enumerate() {
            let at = format!("replicas[{i}]");
            if r.id.is_empty() {
                p.push(format!("{at}.id: missing"));
            } else if !ids.insert(r.id.as_str()) {
                p.push(format!("{at}.id: {:?} is used twice", r.id));
            }
            if r.address.parse::<SocketAddr>().is_err() {
                p.push(format!("{at}.address: {:?} is not ip:port (Envoy's override_host matches ip:port exactly)", r.address));
            }
            r.serving.check(&mut p, &at, &known, &mut served);
        }
        for (i, g) in self.discovery.iter().enumerate() {
            let at = format!("discovery[{i}]");
            if g.group.is_empty() || g.host.is_empty() {
                p.push(format!("{at}: group and host are required"));
            }
            if g.port == 0 || g.interval_ms == 0 {
                p.push(format!("{at}: port and interval_ms must be at least 1"));
            }
            g.serving.check(&mut p, &at, &known, &mut served);
        }
        if let Some(k) = &self.kubernetes {
            if k.pool.is_empty() {
                p.push("kubernetes.pool: the InferencePool's name is required".into());
            }
            k.serving.check(&mut p, "kubernetes", &known, &mut served);
        }
        for (i, m) in self.models.iter().enumerate() {
            if !m.name.is_empty() && !served.contains(m.name.as_str()) {
                p.push(format!("models[{i}]: no replica or discovery group serves {:?}", m.name));
            }
        }
        p
    }
}

impl Serving {
    /// Its problems, at path `at`; the models it names go into `served`.
    fn check<'a>(&'a self, p: &mut Vec<String>, at: &str, known: &HashSet<&str>, served: &mut HashSet<&'a str>) {
        if self.models.is_empty() {
            p.push(format!("{at}.models: serves no model"));
        }
        for (j, m) in self.models.iter().enumerate() {
            if known.contains(m.as_str()) {
                served.insert(m);
            } else {
                p.push(format!("{at}.models[{j}]: {m:?} is not a configured model name"));
            }
        }
        if self.max_concurrency == 0 || self.max_pending == 0 {
            p.push(format!("{at}: max_concurrency and max_pending must be at least 1"));
        }
        if self.block_size == Some(0) || self.kv_blocks == Some(0) {
            p.push(format!("{at}: block_size and kv_blocks must be at least 1 when set"));
        }
        if let Some(prefill) = &self.prefill {
            prefill.validate(&format!("{at}.prefill"), p);
        }
    }
}

/// The keys of `given` that `read` (what was read of it, written back) lacks,
/// each as `<path>: unknown key`, with paths as validation writes them
/// (`replicas[1].spare`).
fn unknown_keys(given: &serde_yaml::Value, read: &serde_yaml::Value, at: &str, out: &mut Vec<String>) {
    use serde_yaml::Value;
    let join = |key: &str| if at.is_empty() { key.to_owned() } else { format!("{at}.{key}") };
    match (given, read) {
        (Value::Mapping(g), Value::Mapping(r)) => {
            for (k, v) in g {
                let key = match k {
                    Value::String(s) => s.clone(),
                    other => serde_yaml::to_string(other).unwrap_or_default().trim().to_owned(),
                };
                match r.get(k) {
                    Some(inner) => unknown_keys(v, inner, &join(&key), out),
                    None => out.push(format!("{}: unknown key", join(&key))),
                }
            }
        }
        (Value::Sequence(g), Value::Sequence(r)) => {
            for (i, (g, r)) in g.iter().zip(r).enumerate() {
                unknown_keys(g, r, &format!("{at}[{i}]"), out);
            }
        }
        (Value::Tagged(g), Value::Tagged(r)) => unknown_keys(&g.value, &r.value, at, out),
        _ => {}
    }
}

#[cfg(test)]
mod tests;
