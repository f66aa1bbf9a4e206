//! The decision: from a request body to an ordered list of replicas.
//!
//! The model named in the body (or its alias, or the only model when none is
//! named) selects a policy and the replicas serving it; the prompt is
//! tokenized (`prompt`) and each candidate's cached prefix predicted (`kv`);
//! eligibility keeps the healthy replicas with room; the policy ranks them;
//! the winner and up to `retry.fallbacks` more are returned, the prompt is
//! recorded on the winner, and a lease on it counts the request in flight
//! until the request ends.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use inferrail_config::Config;
use inferrail_policy::{NoReplica, RoutingPolicy, eligible};

use inferrail_tokenize::chat::Endpoint;

use crate::fleet::{Lease, Replica};
use crate::kv::Kv;
use crate::prompt::Prompts;
use crate::request::{self, BodyError};

/// A model and how its replicas are chosen.
pub struct ModelRoute {
    /// Name the engines serve.
    pub name: String,
    /// Other names clients may use.
    pub aliases: Vec<String>,
    policy: Box<dyn RoutingPolicy>,
}

/// The current replicas, grouped by model; replaced whole when membership changes.
#[derive(Debug, Default)]
pub struct Fleet {
    /// Every replica.
    pub replicas: Vec<Arc<Replica>>,
    per_model: Vec<Vec<Arc<Replica>>>,
}

impl Fleet {
    /// Groups `replicas` by the models they serve.
    pub fn new(replicas: Vec<Arc<Replica>>, models: usize) -> Self {
        let mut per_model = vec![Vec::new(); models];
        for r in &replicas {
            for &m in &r.models {
                per_model[m].push(r.clone());
            }
        }
        Self { replicas, per_model }
    }
}

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
}

impl RouteError {
    /// HTTP status, OpenAI error type and the parameter at fault.
    pub fn http(&self) -> (u16, &'static str, Option<&'static str>) {
        match self {
            Self::Body(_) => (400, "BadRequestError", None),
            Self::MissingModel => (400, "BadRequestError", Some("model")),
            Self::UnknownModel(_) => (404, "NotFoundError", Some("model")),
            Self::TooLarge(_) => (413, "BadRequestError", None),
            Self::NoReplica(_) => (503, "ServiceUnavailableError", None),
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
        }
    }
}

/// The router: models, policies, the fleet and the leases in force.
pub struct Router {
    /// The configuration it was built from.
    pub config: Config,
    /// Models in configuration order.
    pub models: Vec<ModelRoute>,
    names: HashMap<String, usize>,
    fleet: ArcSwap<Fleet>,
    leases: papaya::HashMap<String, Arc<Lease>>,
    clock: Instant,
    /// Tokenizers and their workers.
    pub prompts: Prompts,
    /// The KV index.
    pub kv: Kv,
}

impl Router {
    /// Builds the router with the configuration's listed replicas, loading every model's tokenizer.
    pub fn new(config: Config) -> anyhow::Result<Self> {
        let seed = config.routing.seed;
        let models: Vec<ModelRoute> = config
            .models
            .iter()
            .enumerate()
            .map(|(i, m)| ModelRoute {
                name: m.name.clone(),
                aliases: m.aliases.clone(),
                policy: inferrail_policy::build(m.policy, seed.wrapping_add(i as u64)),
            })
            .collect();
        let mut names = HashMap::new();
        for (i, m) in models.iter().enumerate() {
            for n in std::iter::once(&m.name).chain(&m.aliases) {
                names.insert(n.clone(), i);
            }
        }
        let kv = Kv::new(config.kv.clone());
        let replicas: Vec<Arc<Replica>> = config
            .replicas
            .iter()
            .filter_map(|r| {
                let addr = r.address.parse().ok()?;
                let served = r.models.iter().filter_map(|m| names.get(m).copied()).collect();
                Some(Arc::new(Replica::new(r.id.clone(), addr, served, r.limits(), r.cache(), kv.slot(&r.id))))
            })
            .collect();
        for r in &replicas {
            kv.join(r);
        }
        let fleet = ArcSwap::from_pointee(Fleet::new(replicas, models.len()));
        let prompts = Prompts::new(&config)?;
        Ok(Self { config, models, names, fleet, leases: papaya::HashMap::new(), clock: Instant::now(), prompts, kv })
    }

    /// Milliseconds since the router started: the clock health state uses.
    pub fn now_ms(&self) -> u64 {
        self.clock.elapsed().as_millis() as u64
    }

    /// The current fleet.
    pub fn fleet(&self) -> Arc<Fleet> {
        self.fleet.load_full()
    }

    /// Replaces the fleet (discovery found a new membership).
    pub fn set_fleet(&self, fleet: Fleet) {
        self.fleet.store(Arc::new(fleet));
    }

    /// Model index of a name the engines serve.
    pub fn model_index(&self, name: &str) -> Option<usize> {
        self.names.get(name).copied()
    }

    /// Decides where a generation request goes, and leases the winner under `request_id`.
    pub async fn decide(&self, body: &[u8], endpoint: Endpoint, request_id: &str) -> Result<Decision, RouteError> {
        let started = Instant::now();
        let result = self.decide_inner(body, endpoint, request_id).await;
        let policy = match &result {
            Ok(d) => d.policy,
            Err(_) => "none",
        };
        metrics::histogram!("inferrail_decision_seconds", "policy" => policy).record(started.elapsed().as_secs_f64());
        match &result {
            Ok(d) => metrics::counter!("inferrail_decisions_total", "policy" => d.policy, "model" => d.model.clone()).increment(1),
            Err(e) => metrics::counter!("inferrail_router_errors_total", "reason" => e.reason()).increment(1),
        }
        result
    }

    async fn decide_inner(&self, body: &[u8], endpoint: Endpoint, request_id: &str) -> Result<Decision, RouteError> {
        let max = self.config.server.max_body_bytes;
        if body.len() > max {
            return Err(RouteError::TooLarge(max));
        }
        let fields = request::fields(body)?;
        let index = match &fields.model {
            Some(name) => self.names.get(name).copied().ok_or_else(|| RouteError::UnknownModel(name.clone()))?,
            None if self.models.len() == 1 => 0,
            None => return Err(RouteError::MissingModel),
        };
        let model = &self.models[index];
        // The model's name does not change the prompt: tokenize the body as sent.
        let prompt = self.prompts.prompt(index, endpoint, body).await;
        let body = match fields.model {
            Some(name) if name == model.name => None,
            _ => Some(request::with_model(body, fields.model_at, &model.name)),
        };
        let fleet = self.fleet.load();
        let replicas = &fleet.per_model[index];
        let now = self.now_ms();
        let loads: Vec<_> = replicas.iter().map(|r| r.load(now)).collect();
        let ranked = model.policy.rank(&loads, eligible(&loads)?);
        let targets: Vec<Arc<Replica>> = ranked.iter().take(1 + self.config.retry.fallbacks).map(|&i| replicas[i].clone()).collect();
        let lease = Arc::new(Lease::new(targets[0].clone(), index));
        let (prompt_tokens, cached_tokens) = match prompt {
            Some(p) => {
                let prediction = Arc::new(self.kv.prepare(&model.name, &p, &targets));
                let cached = self.kv.cached(&prediction, &targets);
                metrics::histogram!("inferrail_predicted_cached_tokens").record(cached[0] as f64);
                let record = self.kv.record(&prediction, &targets[0]);
                *lease.kv.lock().unwrap_or_else(|p| p.into_inner()) = Some((prediction, record));
                (Some(p.ids.len()), cached)
            }
            None => (None, Vec::new()),
        };
        let leases = self.leases.pin();
        let mut key = request_id.to_string();
        let mut n = 0u32;
        // Ids come from clients: a second request in flight with the same one gets its own.
        while leases.try_insert(key.clone(), lease.clone()).is_err() {
            n += 1;
            key = format!("{request_id}.{n}");
        }
        Ok(Decision {
            request_id: key,
            model: model.name.clone(),
            targets,
            policy: model.policy.name(),
            body,
            prompt_tokens,
            cached_tokens,
        })
    }

    /// The lease a request holds.
    pub fn lease(&self, request_id: &str) -> Option<Arc<Lease>> {
        self.leases.pin().get(request_id).cloned()
    }

    /// Forgets a request's lease (releasing it if still held) and returns it.
    pub fn forget(&self, request_id: &str) -> Option<Arc<Lease>> {
        let lease = self.leases.pin().remove(request_id).cloned()?;
        lease.release();
        Some(lease)
    }

    /// Moves a request's lease to the replica that really served it (Envoy
    /// retried on a fallback), and its prompt's record with it. Returns the new lease.
    pub fn move_lease(&self, request_id: &str, to: &Arc<Replica>) -> Option<Arc<Lease>> {
        let leases = self.leases.pin();
        let old = leases.get(request_id).filter(|l| !l.released())?;
        let moved = Arc::new(Lease::since(to.clone(), old.model, old.start));
        if let Some((prediction, record)) = old.kv.lock().unwrap_or_else(|p| p.into_inner()).take() {
            self.kv.take_back(&record);
            let again = self.kv.record(&prediction, to);
            *moved.kv.lock().unwrap_or_else(|p| p.into_inner()) = Some((prediction, again));
        }
        old.release();
        leases.insert(request_id.to_string(), moved.clone());
        Some(moved)
    }

    /// The request is over and the engine answered it (status below 400):
    /// it freed its blocks. Only the first call for a lease does anything.
    pub fn complete(&self, lease: &Lease) {
        if let Some((_, record)) = lease.kv.lock().unwrap_or_else(|p| p.into_inner()).take() {
            self.kv.complete(&record);
        }
    }

    /// The engine refused or failed a request: its prompt is not in that cache.
    pub fn take_back(&self, lease: &Lease) {
        if let Some((_, record)) = lease.kv.lock().unwrap_or_else(|p| p.into_inner()).take() {
            self.kv.take_back(&record);
            metrics::counter!("inferrail_kv_take_backs_total").increment(1);
        }
    }

    /// Leases held now.
    pub fn leases_held(&self) -> usize {
        self.leases.len()
    }
}

#[cfg(test)]
mod tests;
