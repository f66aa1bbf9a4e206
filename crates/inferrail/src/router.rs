//! The router's state: the configuration and fleet in force (one
//! [`Routing`] snapshot, swapped whole), the replicas each discovery source
//! wants, the decision core, the ledger of requests in flight, the engines'
//! reports, the injected [`Clock`], and the handles the decision reaches
//! (tokenizers, admission, peers, the decision log and traces).
//!
//! What the router does with that state lives beside it, one job a file:
//! [`decide`] is the decision pipeline, from a request body to a leased
//! winner; [`hear`] handles what the transports hear of a request after its
//! decision; [`reconcile`] applies a reload or a discovery change.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use inferrail_config::Config;
use inferrail_load::table::LoadTable;
use inferrail_policy::EngineReport;
use inferrail_route::fleet::{Fleet, Lease, Replica};
use inferrail_route::ledger::Ledger;
use inferrail_route::lifecycle::Timing;
use inferrail_route::{Core, Report};

use crate::admission::{Admission, Asked};
use crate::clock::Clock;
use crate::peers::link::Peers;
use crate::prompt::Prompts;
use crate::telemetry::decision_log::DecisionLog;
use crate::telemetry::traces::Traces;

pub mod decide;
pub mod hear;
pub mod reconcile;

/// The discovery source of the replicas the routing YAML lists.
pub const STATIC: &str = "static";

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
    sources: Mutex<Vec<(String, Vec<Arc<Replica>>)>>,
    /// The decision core: models by slot (added to before a reload names
    /// them, never taken from), policies, the KV index.
    pub core: Core,
    /// The requests in flight and their lives.
    pub ledger: Ledger,
    /// The engines' latest load reports, by replica id.
    pub loads: LoadTable,
    /// The clock decisions, reports, health and the ledger read.
    pub clock: Clock,
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
    /// Whether replicas that join from now on wait for their first probe,
    /// and for the EDS file to list them (both set as the service starts
    /// its probes and its EDS writer).
    pub hold_joiners: HoldJoiners,
}

/// What a replica joining the running fleet waits for before it is offered.
#[derive(Debug, Default)]
pub struct HoldJoiners {
    /// Its first successful probe.
    pub probe: std::sync::atomic::AtomicBool,
    /// The EDS file listing it.
    pub eds: std::sync::atomic::AtomicBool,
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
    /// Builds the router with the configuration's listed replicas, loading
    /// every model's tokenizer, on a clock started now.
    pub fn new(config: Config) -> anyhow::Result<Self> {
        Self::with_clock(config, Clock::start())
    }

    /// [`Router::new`] on `clock`.
    pub fn with_clock(config: Config, clock: Clock) -> anyhow::Result<Self> {
        let core = Core::new(&config)?;
        let names = Arc::new(reconcile::names_of(&config, &core.slots(&config)));
        let fleet = Arc::new(Fleet::new(Vec::new(), core.models().len()));
        let prompts = Prompts::new(&config)?;
        let decision_log = DecisionLog::start(&config.observability.decision_log)?;
        let traces = Traces::start(&config.observability)?;
        let (ledger, loads) = (Ledger::new(Timing::ROUTER), LoadTable::new());
        let config = Arc::new(config);
        let routing = ArcSwap::from_pointee(Routing { config: config.clone(), names: names.clone(), fleet });
        let sources = Mutex::new(Vec::new());
        let peers = Peers::new(&config.server.listen);
        let admission = Admission::new(&config);
        let hold_joiners = HoldJoiners::default();
        let router = Self { routing, sources, core, ledger, loads, clock, prompts, decision_log, traces, peers, admission, hold_joiners };
        let replicas = router.listed(&config.replicas, &names, &[])?.apply(&router);
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

    /// Time since the router started, on its clock.
    pub fn now(&self) -> Duration {
        self.clock.now()
    }

    /// Milliseconds since the router started.
    pub fn now_ms(&self) -> u64 {
        self.now().as_millis() as u64
    }

    /// The current fleet.
    pub fn fleet(&self) -> Arc<Fleet> {
        self.routing.load().fleet.clone()
    }

    /// The slot of the model a name clients may use stands for.
    pub fn model_index(&self, name: &str) -> Option<usize> {
        self.routing.load().names.get(name).copied()
    }

    /// The slots of the models named now (unknown names left out).
    pub fn model_slots(&self, models: &[String]) -> Vec<usize> {
        reconcile::slots_of(&self.routing.load().names, models)
    }

    /// Replica `id`'s latest engine report, however old, on the router's clock.
    pub fn report(&self, id: &str) -> Option<Report> {
        let s = self.loads.get(id)?;
        let load = EngineReport { running: s.load.running, waiting: s.load.waiting, deferred: s.load.deferred, kv_usage: s.load.kv_usage };
        Some(Report { at: self.clock.since_start(s.at), load })
    }

    /// The lease a request holds.
    pub fn lease(&self, request_id: &str) -> Option<Arc<Lease>> {
        self.ledger.lease(request_id)
    }

    /// Stops tracking a request (releasing its lease) and returns its lease.
    pub fn forget(&self, request_id: &str) -> Option<Arc<Lease>> {
        self.ledger.forget(request_id)
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

#[cfg(test)]
mod tests;
