//! The router's configuration: one YAML file of models, replicas, discovery
//! groups and routing, health, retry and listener settings.
//!
//! Every field has a default except what only the operator knows (models and
//! replicas). [`Config::load`] parses, rejects unknown keys, and runs
//! [`Config::validate`], which checks ranges and cross references and reports
//! every problem at once, each with its path. `example.yaml` documents every
//! option with its default.
#![forbid(unsafe_code)]

use inferrail_policy::{Params, PolicyKind};
use serde::{Deserialize, Serialize};

mod admission;
mod replicas;
mod validate;
pub use admission::{Admission, ApiKey, Band, OnMiss, Tenant, TokenLimit};
pub use replicas::{CacheShape, DnsGroup, KubernetesPool, Limits, Replica, Role, Serving};

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
    /// Who runs a split request's prefill leg.
    pub prefill_legs: PrefillLegs,
}

impl Default for Routing {
    fn default() -> Self {
        Self { seed: 0x1fe4_7a11, policies: Params::default(), prefill_legs: PrefillLegs::Router }
    }
}

/// Who runs a split request's prefill leg (ADR 0056).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillLegs {
    /// The router, before it answers Envoy: plain Envoy and any gateway.
    #[default]
    Router,
    /// A sidecar in front of each decode engine (llm-d's, or
    /// `inferrail-sidecar`), told the prefill replica in `x-prefiller-host-port`.
    Sidecar,
}

/// Fallbacks named after the winner, for Envoy's retries, and for the
/// prefill legs the router runs itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Retry {
    /// Distinct replicas named after the winner (0 to 8).
    pub fallbacks: usize,
    /// How long a split request's prefill leg waits for one prefill replica
    /// before it tries the next, milliseconds.
    pub prefill_timeout_ms: u64,
}

impl Default for Retry {
    fn default() -> Self {
        Self { fallbacks: 2, prefill_timeout_ms: 30_000 }
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
    /// Probes in a row that time out or cannot connect before a replica is
    /// marked unhealthy (an answer other than a success marks it at once);
    /// it is healthy again at its first successful probe.
    pub unhealthy_probes: u32,
    /// Consecutive failed requests that eject a replica.
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
            unhealthy_probes: 2,
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
    /// LoRA adapters its replicas serve on it, by the names clients ask
    /// for in `model` (the body keeps the name: the engine needs it). An
    /// adapter's blocks are its own, as the engine hashes them.
    pub adapters: Vec<String>,
    /// Adapters one engine step runs on its replicas (vLLM's `--max-loras`):
    /// a request whose adapter would be one too many waits for a slot.
    /// Unset: not known, and never waited for.
    pub max_loras: Option<u32>,
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
            adapters: Vec::new(),
            max_loras: None,
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
