//! The decision, as the service makes it: from a request body to an ordered
//! list of replicas.
//!
//! The model named in the body (or its alias, or the only model when none is
//! named) is found, the prompt tokenized (`prompt`) and cut into blocks, and
//! the decision core (`inferrail-route`) plans over the current fleet with
//! the engines' latest reports, then commits: the winner is leased and the
//! prompt recorded in the KV index. The ledger (`inferrail-route`) tracks the
//! request's life from there: the transports tell the router what they hear
//! of it ([`Router::hear`]), and the router acts on what follows.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use inferrail_config::{Config, ReplicaKvEvents};
use inferrail_load::table::LoadTable;
use inferrail_policy::{EngineReport, NoReplica};
use inferrail_route::fleet::{Fleet, Lease, Replica};
use inferrail_route::kv::Prediction;
use inferrail_route::ledger::{Heard, Ledger, mirror_id};
use inferrail_route::lifecycle::{Event, Timing};
use inferrail_route::{Core, Decided, Plan, Report, Share, View};
use inferrail_tokenize::chat::Endpoint;

use crate::admission::{Admission, Asked, Placed, Shed};
use crate::decision_log::DecisionLog;
use crate::peers::{self, Peers};
use crate::prompt::Prompts;
use crate::request::{self, BodyError};
use crate::traces::Traces;

/// Every name clients may use for `config`'s models (theirs and their aliases), to the model's slot.
fn names_of(config: &Config, slots: &[usize]) -> HashMap<String, usize> {
    let mut names = HashMap::new();
    for (m, &slot) in config.models.iter().zip(slots) {
        for n in std::iter::once(&m.name).chain(&m.aliases) {
            names.insert(n.clone(), slot);
        }
    }
    names
}

/// The slots `names` gives the models named (unknown names left out).
fn slots_of(names: &HashMap<String, usize>, models: &[String]) -> Vec<usize> {
    models.iter().filter_map(|m| names.get(m).copied()).collect()
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

/// The discovery source of the replicas the routing YAML lists.
pub const STATIC: &str = "static";

/// How long a request waits, once over, for its status or first byte still
/// on its way; and how long one whose end is never heard counts at most.
const TIMING: Timing = Timing { grace: Duration::from_millis(500), max_life: Duration::from_secs(3_600) };

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
}

/// A request read up to the decision.
struct Prepared {
    model: usize,
    fleet: Arc<Fleet>,
    prediction: Option<Arc<Prediction>>,
    session: Option<String>,
    text: Option<String>,
    /// Why the prompt has no tokens, when it has none.
    no_prediction: Option<&'static str>,
    /// The name the client asked for, when it was not the engines' own.
    requested: Option<String>,
    /// The body to forward, when the model had to be rewritten.
    body: Option<Vec<u8>>,
}

impl Prepared {
    fn view<'a>(&'a self, subset: Option<&'a [SocketAddr]>, share: Share, placed: &Placed) -> View<'a> {
        let (session, text) = (self.session.as_deref(), self.text.as_deref());
        let replica_share = placed.replica_share();
        View { model: self.model, prediction: self.prediction.clone(), session, text, subset, share, replica_share }
    }
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

/// What requests are routed by, swapped whole: a reload replaces all of it
/// at once, a discovery change its fleet. A request reads one and keeps it
/// to its decision.
#[derive(Clone)]
pub struct Routing {
    /// The configuration in force.
    pub config: Arc<Config>,
    /// Every name clients may use (models' and their aliases), to its model's slot.
    pub names: Arc<HashMap<String, usize>>,
    /// The replicas: the union of every discovery source's.
    pub fleet: Arc<Fleet>,
}

/// The router: models, the fleet, the engines' reports and the requests in flight.
pub struct Router {
    /// The configuration, the names and the fleet in force ([`Router::reload`], [`Router::publish`]).
    routing: ArcSwap<Routing>,
    /// The replicas each discovery source wants, by source: the fleet is their union.
    sources: std::sync::Mutex<Vec<(String, Vec<Arc<Replica>>)>>,
    /// The decision core: models by slot (added to before a reload names
    /// them, never taken from), policies, the KV index.
    pub core: Core,
    /// The requests in flight and their lives.
    pub ledger: Ledger,
    /// The engines' latest load reports, by replica id.
    pub loads: LoadTable,
    clock: Instant,
    /// Tokenizers and their workers.
    pub prompts: Prompts,
    /// The decision log, when one is configured.
    pub decision_log: Option<DecisionLog>,
    /// OpenTelemetry traces, when a collector is configured.
    pub traces: Option<Traces>,
    /// The other routers, told what this one decides and hears.
    pub peers: Peers,
    /// Keys, bands, token limits and the wait queues.
    pub admission: Admission,
}

/// What a request's caller adds to it: what its headers ask of admission,
/// and what to do when it starts waiting (told how long it may wait).
pub struct Caller<'a> {
    /// Its key, band and tenant as asked.
    pub asked: &'a Asked,
    /// Called once, if it waits.
    pub on_wait: &'a (dyn Fn(Duration) + Sync),
}

impl Caller<'_> {
    /// A caller that asks nothing and is told nothing.
    pub const PLAIN: Caller<'static> = Caller { asked: &Asked::NONE, on_wait: &|_| {} };
}

impl Router {
    /// Builds the router with the configuration's listed replicas, loading every model's tokenizer.
    pub fn new(config: Config) -> anyhow::Result<Self> {
        let core = Core::new(&config)?;
        let names = Arc::new(names_of(&config, &core.slots(&config)));
        let fleet = Arc::new(Fleet::new(Vec::new(), core.models().len()));
        let prompts = Prompts::new(&config)?;
        let decision_log = DecisionLog::start(&config.observability.decision_log)?;
        let traces = Traces::start(&config.observability)?;
        let (ledger, loads) = (Ledger::new(TIMING), LoadTable::new());
        let config = Arc::new(config);
        let routing = ArcSwap::from_pointee(Routing { config: config.clone(), names: names.clone(), fleet });
        let sources = std::sync::Mutex::new(Vec::new());
        let peers = Peers::new(&config.server.listen);
        let admission = Admission::new(&config);
        let router = Self { routing, sources, core, ledger, loads, clock: Instant::now(), prompts, decision_log, traces, peers, admission };
        let replicas = router.listed(&config.replicas, &names, &[], &mut Reloaded::default());
        router.publish(STATIC, replicas);
        Ok(router)
    }

    /// What requests are routed by now.
    pub fn routing(&self) -> Arc<Routing> {
        self.routing.load_full()
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<Config> {
        self.routing.load().config.clone()
    }

    /// Time since the router started: the clock decisions, reports and health use.
    pub fn now(&self) -> Duration {
        self.clock.elapsed()
    }

    /// Milliseconds since the router started.
    pub fn now_ms(&self) -> u64 {
        self.now().as_millis() as u64
    }

    /// The current fleet.
    pub fn fleet(&self) -> Arc<Fleet> {
        self.routing.load().fleet.clone()
    }

    /// The replicas discovery source `source` wants now (the routing YAML's
    /// list is [`STATIC`], a DNS group `dns:<group>`): the fleet becomes the
    /// union of every source's, in the order sources first published,
    /// swapped whole.
    pub fn publish(&self, source: &str, replicas: Vec<Arc<Replica>>) {
        let mut sources = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        let fleet = self.wanted(&mut sources, source, replicas);
        self.routing.rcu(|r| Routing { fleet: fleet.clone(), ..Routing::clone(r) });
    }

    /// Puts `replicas` as what `source` wants into `sources`; returns the fleet that makes.
    fn wanted(&self, sources: &mut Vec<(String, Vec<Arc<Replica>>)>, source: &str, replicas: Vec<Arc<Replica>>) -> Arc<Fleet> {
        match sources.iter_mut().find(|(s, _)| s == source) {
            Some((_, wanted)) => *wanted = replicas,
            None => sources.push((source.to_string(), replicas)),
        }
        let all = sources.iter().flat_map(|(_, r)| r).cloned().collect();
        Arc::new(Fleet::new(all, self.core.models().len()))
    }

    /// The slot of the model a name clients may use stands for.
    pub fn model_index(&self, name: &str) -> Option<usize> {
        self.routing.load().names.get(name).copied()
    }

    /// Decides where a generation request goes, among `subset` when the
    /// gateway offered one, and leases the winner under `request_id`.
    pub async fn decide(
        &self,
        body: &[u8],
        endpoint: Endpoint,
        request_id: &str,
        session: Option<&str>,
        subset: Option<&[SocketAddr]>,
    ) -> Result<Decision, RouteError> {
        self.decide_as(body, endpoint, request_id, session, subset, &Caller::PLAIN).await
    }

    /// [`Router::decide`] for a caller whose headers ask admission for a key,
    /// band or tenant: checked, limited and, while the fleet is busy, held in
    /// the model's queue until its turn comes and a replica can take it
    /// within its band's objective (ADR 0042).
    pub async fn decide_as(
        &self,
        body: &[u8],
        endpoint: Endpoint,
        request_id: &str,
        session: Option<&str>,
        subset: Option<&[SocketAddr]>,
        caller: &Caller<'_>,
    ) -> Result<Decision, RouteError> {
        let started = Instant::now();
        let result = self.decide_inner(body, endpoint, request_id, session, subset, caller).await;
        let (policy, waited) = match &result {
            Ok(d) => (d.policy, d.waited),
            Err(RouteError::Shed(Shed::Waited(waited))) => ("none", *waited),
            Err(_) => ("none", Duration::ZERO),
        };
        // The router's work, not the time a request waited its turn (inferrail_admission_wait_seconds).
        metrics::histogram!("inferrail_decision_seconds", "policy" => policy)
            .record(started.elapsed().saturating_sub(waited).as_secs_f64());
        match &result {
            Ok(d) => metrics::counter!("inferrail_decisions_total", "policy" => d.policy, "model" => d.model.clone()).increment(1),
            Err(e) => metrics::counter!("inferrail_router_errors_total", "reason" => e.reason()).increment(1),
        }
        result
    }

    /// Replica `id`'s latest engine report, however old, on the router's clock.
    pub fn report(&self, id: &str) -> Option<Report> {
        let s = self.loads.get(id)?;
        let load = EngineReport { running: s.load.running, waiting: s.load.waiting, kv_usage: s.load.kv_usage };
        Some(Report { at: s.at.saturating_duration_since(self.clock), load })
    }

    async fn decide_inner(
        &self,
        body: &[u8],
        endpoint: Endpoint,
        request_id: &str,
        session: Option<&str>,
        subset: Option<&[SocketAddr]>,
        caller: &Caller<'_>,
    ) -> Result<Decision, RouteError> {
        // The key is checked before the prompt is read.
        let who = self.admission.identify(caller.asked)?;
        let read = self.prepare(body, endpoint, session).await?;
        let model = self.core.model(read.model);
        let placed = self.admission.place(who, caller.asked, &model.name)?;
        let prompt_tokens = read.prediction.as_ref().map_or(0, |p| p.prompt_tokens) as u64;
        self.admission.limit(&placed, prompt_tokens, self.now())?;
        let (plan, committed, waited) = self.admitted(&read, subset, &placed, prompt_tokens, caller).await?;
        record_plan(&plan);
        let (policy, steer, prompt_tokens) = (plan.policy, plan.steer, plan.prompt_tokens());
        if let Some(&cached) = committed.cached_tokens.first() {
            metrics::histogram!("inferrail_predicted_cached_tokens").record(cached as f64);
        }
        let key = self.ledger.insert(request_id, committed.lease.clone(), self.now());
        let wants_usage = self.admission.decided(&placed, &key);
        if self.peers.any() {
            self.peers.tell_all(peers::decided(self, &key, &committed.lease, read.session.as_deref()));
        }
        if let Some(log) = &self.decision_log {
            log.decision(&key, &model.name, &plan, self.config().retry.fallbacks);
        }
        Ok(Decision {
            request_id: key,
            model: model.name.clone(),
            targets: committed.targets,
            policy,
            body: read.body,
            prompt_tokens,
            cached_tokens: committed.cached_tokens,
            steer,
            candidates: plan.set_aside.iter().filter(|a| a.is_none()).count(),
            estimate: committed.lease.estimate(),
            decider: self.peers.id,
            wants_usage,
            waited,
        })
    }

    /// Plans and commits the request as soon as it may go: at once when
    /// nothing of its band or a more urgent one waits and some replica can
    /// take it within its band's objective; otherwise it waits its turn in
    /// its model's queue and plans again each time it is woken, or is shed.
    /// Without bands every plan is committed at once. Returns how long it waited.
    async fn admitted(
        &self,
        read: &Prepared,
        subset: Option<&[SocketAddr]>,
        placed: &Placed,
        tokens: u64,
        caller: &Caller<'_>,
    ) -> Result<(Plan, inferrail_route::Committed, Duration), RouteError> {
        let view = read.view(subset, self.peers.share(), placed);
        let reports = |r: &Replica| self.report(&r.id);
        let model_prefill = self.core.model(read.model).params.prefill;
        let mut ticket: Option<crate::admission::Ticket> = None;
        loop {
            let turn = match &ticket {
                None => self.admission.clear_for(read.model, placed),
                Some(t) => t.is_next(),
            };
            let within = |plan: &Plan| !placed.misses(plan.estimate(plan.order[0], model_prefill));
            let now = self.now();
            let estimate = match self.core.decide_if(&view, &read.fleet, &reports, now, &|plan| turn && within(plan)) {
                Ok(Decided::Committed(plan, committed)) => {
                    let waited = ticket.map_or(Duration::ZERO, |t| t.admitted(now));
                    return Ok((plan, committed, waited));
                }
                Ok(Decided::Held(plan)) => Some(plan.estimate(plan.order[0], model_prefill)),
                Err(NoReplica::AllFull) if placed.band.is_some() => None,
                Err(e) => return Err(e.into()),
            };
            if turn && let Some(shed) = estimate.and_then(|e| placed.shed_on_miss(e)) {
                return Err(RouteError::Shed(shed));
            }
            let t = match ticket.take() {
                Some(t) => t,
                None => {
                    let t = self.admission.enter(read.model, placed, tokens, now)?;
                    (caller.on_wait)(t.max_wait());
                    t
                }
            };
            // An error drops the ticket: it leaves the queue.
            t.wait(self.now()).await?;
            ticket = Some(t);
        }
    }

    /// What the model's policy would do with a request now, and why,
    /// changing nothing: every offered replica is in the plan's order.
    pub async fn explain(&self, body: &[u8], endpoint: Endpoint, session: Option<&str>, asked: &Asked) -> Result<Explained, RouteError> {
        let who = self.admission.identify(asked)?;
        let read = self.prepare(body, endpoint, session).await?;
        let model = self.core.model(read.model);
        let placed = self.admission.place(who, asked, &model.name)?;
        let plan =
            self.core.plan_all(&read.view(None, self.peers.share(), &placed), &read.fleet, &|r: &Replica| self.report(&r.id), self.now());
        let waiting_ahead = self.admission.ahead(read.model, &placed);
        let busy = plan.unavailable == Some(NoReplica::AllFull)
            || plan.order.first().is_some_and(|&w| placed.misses(plan.estimate(w, model.params.prefill)));
        let would_wait = placed.band.is_some() && (waiting_ahead > 0 || busy);
        Ok(Explained { requested: read.requested, no_prediction: read.no_prediction, plan, placed, waiting_ahead, would_wait })
    }

    /// Reads a request up to the decision: its model, its prompt's blocks and text, the body to forward.
    async fn prepare(&self, body: &[u8], endpoint: Endpoint, session: Option<&str>) -> Result<Prepared, RouteError> {
        // One snapshot from the name to the fleet: a reload meanwhile is seen whole or not at all.
        let routing = self.routing();
        let max = routing.config.server.max_body_bytes;
        if body.len() > max {
            return Err(RouteError::TooLarge(max));
        }
        let fields = request::fields(body)?;
        let slot = |name: &String| routing.names.get(name).copied().ok_or_else(|| RouteError::UnknownModel(name.clone()));
        let index = match (&fields.model, routing.config.models.as_slice()) {
            (Some(name), _) => slot(name)?,
            (None, [only]) => slot(&only.name)?,
            (None, _) => return Err(RouteError::MissingModel),
        };
        let model = self.core.model(index);
        // The model's name does not change the prompt: tokenize the body as sent.
        let read = self.prompts.read(index, endpoint, body, self.core.wants_text(index)).await;
        let fleet = routing.fleet.clone();
        let (prediction, no_prediction) = match &read.prompt {
            Ok(p) => (Some(self.core.prepare(index, p, &fleet)), None),
            Err(reason) => (None, Some(*reason)),
        };
        let requested = fields.model.clone().filter(|name| *name != model.name);
        let forward = match fields.model {
            Some(name) if name == model.name => None,
            _ => Some(request::with_model(body, fields.model_at, &model.name)),
        };
        let session = session.map(str::to_owned).or(fields.user);
        Ok(Prepared { model: index, fleet, prediction, session, text: read.text, no_prediction, requested, body: forward })
    }

    /// Applies a new, validated configuration: its models and replicas,
    /// each swapped whole. Models are known by name: one whose entry and
    /// parameters are unchanged keeps its policy's state and tokenizer,
    /// wherever it now stands in the file; one that changed, or is new,
    /// starts fresh (a new or changed tokenizer is loaded first, and a load
    /// that fails refuses the whole file); one removed is no longer
    /// offered. A replica that keeps its id, address, models, cache shape
    /// and KV events keeps everything learned of it (requests in flight,
    /// health, its KV index entry) and takes the new limits and drain; one
    /// that changed starts cold, like a new one; one gone is forgotten once
    /// its requests are over (their leases hold it). Anything else
    /// differing from the configuration in force (the listeners,
    /// `routing.seed`, ...) is refused with the sections that differ, and
    /// nothing changes.
    pub fn reload(&self, new: Config) -> Result<Reloaded, String> {
        let old = self.config();
        let fixed = |c: &Config| {
            let mut c = Config { replicas: Vec::new(), ..c.clone() };
            c.routing.policies = Default::default();
            c.models = Vec::new();
            c.admission = Default::default();
            c
        };
        let (n, o) = (fixed(&new), fixed(&old));
        if n != o {
            let differ: Vec<&str> = [
                ("server", n.server != o.server),
                ("admin", n.admin != o.admin),
                ("routing", n.routing != o.routing),
                ("retry", n.retry != o.retry),
                ("health", n.health != o.health),
                ("tokenizer", n.tokenizer != o.tokenizer),
                ("kv", n.kv != o.kv),
                ("kv_events", n.kv_events != o.kv_events),
                ("load", n.load != o.load),
                ("observability", n.observability != o.observability),
                ("discovery", n.discovery != o.discovery),
                ("kubernetes", n.kubernetes != o.kubernetes),
                ("eds", n.eds != o.eds),
            ]
            .into_iter()
            .filter_map(|(name, changed)| changed.then_some(name))
            .collect();
            return Err(format!(
                "only models, replicas and policy parameters reload; {} changed otherwise and need a restart",
                differ.join(", ")
            ));
        }
        // Slots never move nor go: a request that read a name before the swap finds its model after it.
        let slots = self.core.slots(&new);
        let tokenizers = self.prompts.load_for(&old, &new, &slots).map_err(|e| e.to_string())?;
        let models = self.core.reload_models(&old, &new, &slots).map_err(|e| e.to_string())?;
        self.prompts.swap(tokenizers);
        // The new models are in their slots, unnamed; one swap names them, with their replicas.
        let names = Arc::new(names_of(&new, &slots));
        let mut done = Reloaded { models, ..Reloaded::default() };
        let mut sources = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        let current = sources.iter().find(|(s, _)| s == STATIC).map(|(_, r)| r.clone()).unwrap_or_default();
        let next = self.listed(&new.replicas, &names, &current, &mut done);
        let fleet = self.wanted(&mut sources, STATIC, next);
        self.admission.reload(&new);
        self.routing.store(Arc::new(Routing { config: Arc::new(new), names, fleet }));
        Ok(done)
    }

    /// The replicas `listed` names: each of `current` whose identity holds
    /// (the same id, address, models, cache shape and KV events) is kept
    /// with everything learned of it and takes the new limits; the others
    /// are new and cold; `current`'s others leave. All take their drain.
    fn listed(
        &self,
        listed: &[inferrail_config::Replica],
        names: &HashMap<String, usize>,
        current: &[Arc<Replica>],
        done: &mut Reloaded,
    ) -> Vec<Arc<Replica>> {
        let mut next = Vec::new();
        for r in listed {
            let Ok(addr) = r.address.parse::<SocketAddr>() else { continue };
            let s = &r.serving;
            let models = slots_of(names, &s.models);
            let same = |c: &&Arc<Replica>| {
                c.id == r.id && c.addr == addr && c.models == models && c.cache == s.cache() && c.kv_events == r.kv_events
            };
            let replica = match current.iter().find(same) {
                Some(kept) => {
                    kept.set_limits(s.limits());
                    kept.set_prefill(s.prefill);
                    done.kept += 1;
                    kept.clone()
                }
                None => {
                    if let Some(before) = current.iter().find(|c| c.id == r.id) {
                        self.core.leave(before);
                    }
                    done.joined += 1;
                    self.cold_replica(r.id.clone(), addr, models, s, r.kv_events.clone())
                }
            };
            replica.set_draining(r.drain);
            next.push(replica);
        }
        for gone in current.iter().filter(|c| !next.iter().any(|n| n.id == c.id)) {
            self.core.leave(gone);
            done.left += 1;
        }
        next
    }

    /// A new replica serving `models` (slots) with `serving`'s limits and cache shape, with a cold KV slot.
    pub fn cold_replica(
        &self,
        id: String,
        addr: SocketAddr,
        models: Vec<usize>,
        serving: &inferrail_config::Serving,
        kv_events: Option<ReplicaKvEvents>,
    ) -> Arc<Replica> {
        let slot = self.core.kv.slot(&id);
        let r = Arc::new(Replica::new(id, addr, models, serving.limits(), serving.cache(), slot).with_kv_events(kv_events));
        r.set_prefill(serving.prefill);
        self.core.join(&r);
        r
    }

    /// The slots of the models named now (unknown names left out).
    pub fn model_slots(&self, models: &[String]) -> Vec<usize> {
        slots_of(&self.routing.load().names, models)
    }

    /// The lease a request holds.
    pub fn lease(&self, request_id: &str) -> Option<Arc<Lease>> {
        self.ledger.lease(request_id)
    }

    /// Stops tracking a request (releasing its lease) and returns its lease.
    pub fn forget(&self, request_id: &str) -> Option<Arc<Lease>> {
        self.ledger.forget(request_id)
    }

    /// Hears something of a request this router decided, from whichever
    /// stream, log or peer said it, and does what its life calls for besides
    /// the lease and the index: health, metrics, the decision log; the peers
    /// are told. Returns whether the request was one it tracks (not yet over).
    pub fn hear(&self, request_id: &str, event: Event) -> bool {
        self.hear_ago(request_id, event, Duration::ZERO)
    }

    /// [`Router::hear`] for something that happened `ago` (an access log
    /// tells of a first byte after the response ended).
    fn hear_ago(&self, request_id: &str, event: Event, ago: Duration) -> bool {
        let fleet = self.fleet();
        let heard = self.ledger.hear(request_id, self.now().saturating_sub(ago), event, &self.core, &fleet);
        if let Some(heard) = &heard {
            self.act(heard);
            if heard.decider.is_none()
                && self.peers.any()
                && let Some(told) = peers::heard(request_id, event, false, ago)
            {
                self.peers.tell_all(told);
            }
        }
        heard.is_some()
    }

    /// Hears something that happened `ago` of request `request_id` that
    /// router `decider` decided (`None`: not said, taken as this router's):
    /// it goes to that router, or, when it is not linked (gone), to this
    /// router's mirror of the request. Returns whether anyone took it.
    pub fn hear_for(&self, decider: Option<u64>, request_id: &str, event: Event, ago: Duration) -> bool {
        match decider {
            Some(d) if d != self.peers.id => {
                let told = peers::heard(request_id, event, true, ago).is_some_and(|told| self.peers.tell(d, told));
                told || self.hear_mirror(d, request_id, event, ago)
            }
            _ => self.hear_ago(request_id, event, ago),
        }
    }

    /// Hears something that happened `ago` of this router's mirror of a
    /// request peer `decider` decided; the decider counts its outcome.
    pub fn hear_mirror(&self, decider: u64, request_id: &str, event: Event, ago: Duration) -> bool {
        let fleet = self.fleet();
        let heard = self.ledger.hear(&mirror_id(decider, request_id), self.now().saturating_sub(ago), event, &self.core, &fleet);
        if let Some(heard) = &heard {
            self.act(heard);
        }
        heard.is_some()
    }

    /// Delivers the requests' deadlines due now (an end's grace, a lifetime).
    pub fn sweep(&self) {
        self.sweep_at(self.now());
    }

    /// Delivers the requests' deadlines due by `at` on the router's clock.
    pub fn sweep_at(&self, at: Duration) {
        let fleet = self.fleet();
        for heard in self.ledger.tick(at, &self.core, &fleet) {
            self.act(&heard);
        }
    }

    fn act(&self, heard: &Heard) {
        // Envoy retried elsewhere: the winner failed this request.
        if let Some(from) = &heard.retried_from {
            crate::health::request_failed(self, from);
            if heard.decider.is_none() {
                metrics::counter!("inferrail_retries_total", "replica" => from.id.clone()).increment(1);
            }
        }
        match heard.answered() {
            Some((replica, true)) => replica.record_success(),
            Some((replica, false)) => crate::health::request_failed(self, replica),
            None => {}
        }
        if heard.effects.release || heard.effects.first_byte.is_some() {
            // A slot came back, or a prefill finished: the head of a queue may fit now.
            self.admission.kick();
        }
        if heard.decider.is_some() {
            // A peer's request: it counts the outcome, here only health learns.
            return;
        }
        if let Some(usage) = heard.effects.usage {
            self.admission.usage(&heard.id, usage.completion_tokens, self.now());
        }
        if heard.took_back {
            metrics::counter!("inferrail_kv_take_backs_total").increment(1);
        }
        if let Some(usage) = heard.effects.usage {
            // Beside inferrail_predicted_cached_tokens: what the engine says it served from cache.
            metrics::histogram!("inferrail_reported_cached_tokens").record(usage.cached_tokens as f64);
        }
        let lease = &heard.lease;
        if let Some(ttft) = heard.effects.first_byte {
            let replica = lease.replica.id.clone();
            let policy = self.core.policy(lease.model);
            metrics::histogram!("inferrail_ttft_seconds", "replica" => replica.clone(), "policy" => policy).record(ttft.as_secs_f64());
            if let Some(estimate) = lease.estimate() {
                // Above 1: slower than the router expected; far from 1, the cost model needs calibrating.
                metrics::histogram!("inferrail_ttft_over_estimate", "replica" => replica.clone())
                    .record(ttft.as_secs_f64() / estimate.as_secs_f64());
                metrics::histogram!("inferrail_estimated_ttft_seconds", "replica" => replica).record(estimate.as_secs_f64());
            }
        }
        let Some(outcome) = heard.effects.outcome else { return };
        self.admission.over(&heard.id);
        let label = outcome.verdict.label();
        if let Some(log) = &self.decision_log {
            log.outcome(&heard.id, &lease.replica.id, outcome.ttft.map(|d| d.as_secs_f64() * 1e3), outcome.status, label);
        }
        let model = self.core.model(lease.model).name.clone();
        metrics::counter!("inferrail_requests_total", "model" => model, "replica" => lease.replica.id.clone(), "outcome" => label)
            .increment(1);
        metrics::histogram!("inferrail_request_duration_seconds").record(outcome.duration.as_secs_f64());
    }

    /// Whether it can route: some replica is healthy (`/readyz`, and the
    /// picker protocol's `readiness`).
    pub fn ready(&self) -> bool {
        let now = self.now_ms();
        self.fleet().replicas.iter().any(|r| r.healthy(now))
    }

    /// Requests tracked now.
    pub fn leases_held(&self) -> usize {
        self.ledger.len()
    }
}

/// Counts what set replicas aside and what steered a plan.
fn record_plan(plan: &Plan) {
    for why in plan.set_aside.iter().flatten() {
        {
            metrics::counter!("inferrail_set_aside_total", "policy" => plan.policy, "reason" => why.label()).increment(1);
        }
    }
    if let Some(steer) = plan.steer {
        metrics::counter!("inferrail_steered_total", "policy" => plan.policy, "reason" => steer).increment(1);
    }
    if let Some(waived) = plan.waived {
        metrics::counter!("inferrail_guards_waived_total", "policy" => plan.policy, "guard" => waived).increment(1);
    }
    if plan.prediction.is_none() {
        metrics::counter!("inferrail_decisions_without_prediction_total", "policy" => plan.policy).increment(1);
    }
    if let Some(shadow) = &plan.shadow {
        let agreed = if shadow.agreed { "true" } else { "false" };
        metrics::counter!("inferrail_shadow_decisions_total", "policy" => plan.policy, "shadow" => shadow.policy, "agreed" => agreed)
            .increment(1);
    }
    let engine_reports = plan.candidates.iter().filter(|c| c.engine.is_some()).count();
    if engine_reports < plan.candidates.len() {
        // Some replica's engine report is missing or stale: its load is the router's own counters.
        metrics::counter!("inferrail_stale_reports_total", "policy" => plan.policy)
            .increment((plan.candidates.len() - engine_reports) as u64);
    }
}

#[cfg(test)]
mod tests;
