//! The decision core: from a request view, a fleet snapshot and the time,
//! [`Core::plan`] says what the model's policy would do and why;
//! [`Core::decide`] plans and commits it in one turn.
//!
//! A plan holds every replica serving the model: its predicted cached tokens
//! (the prompt cut once per block size, the index asked for all candidates
//! before any scoring), its load as the router counts it and as its engine
//! last reported it (a report older than [`FRESH`] is never read), the filter
//! or guard that set it aside, and its score split into named terms. Planning
//! changes nothing: the policy's randomness is drawn from a copy of its
//! generator, and its state moves only on commit. Committing takes the lease
//! on the winner, queues the prefill it will cost there, advances the
//! generator, tells the policy its pick and records the prompt in the KV
//! index; [`Core::decide`] plans and commits in one turn per model. On a
//! model served disaggregated, [`pair`] plans the prefill leg too and says
//! whether the request is split; committing a split one leases both. After
//! the decision, [`lifecycle`] is the request's life as a pure state machine
//! fed by whatever transport hears of it, and [`ledger`] keeps the requests
//! in flight and applies what their lives call for. In the path one
//! request takes (`docs/architecture.md`), this file, `ledger.rs` and
//! `lifecycle.rs` are the core's three steps. No I/O and no clock read
//! happen here, so that the service (Envoy's requests, the scraper's
//! reports), an explaining endpoint (plans only) and a fleet simulation on a
//! virtual clock can all run the same decision.
#![forbid(unsafe_code)]

pub mod fleet;
pub mod kv;
pub mod ledger;
pub mod lifecycle;
pub mod pair;
pub mod plan;

pub use plan::{Committed, Decided, Hold, Leg, Plan, Shadow, View};
use plan::{Pick, Side, available, keep_for_urgent, most_common_block_size, restrict};

use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use std::time::Duration;

use inferrail_config::Config;
use inferrail_kv::mode::{Mode, Reason};
pub use inferrail_policy::Share;
use inferrail_policy::panicking;
use inferrail_policy::{
    AdapterFit, Candidate, EngineReport, NoReplica, Offloaded, Params, Prefill, Request, RoutingPolicy, SetAside, TextKind, eligibility,
    rank,
};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::fleet::{Fleet, Lease, Replica};
use crate::kv::{Kv, Place, Prediction, Prompt};

/// A model's policy parameters could not be read (a configuration that did not pass validation).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad policy parameters: {}", .0.join("; "))]
pub struct BadParams(pub Vec<String>);

/// Engine reports older than this are never read: routing falls back to the router's own counters.
pub const FRESH: Duration = Duration::from_millis(250);

/// An engine's report as the core receives it: when it was read, on the router's clock, and what it said.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Report {
    /// When the engine's page was read.
    pub at: Duration,
    /// What it said.
    pub load: EngineReport,
}

/// A model and how its replicas are chosen.
pub struct ModelRoute {
    /// Name the engines serve.
    pub name: String,
    /// Other names clients may use.
    pub aliases: Vec<String>,
    /// Its LoRA adapters' names.
    pub adapters: Vec<String>,
    /// Adapters one engine step runs on its replicas, when known.
    pub max_loras: Option<u32>,
    /// Its policy's parameters (the prefill cost among them).
    pub params: Params,
    policy: Box<dyn RoutingPolicy>,
    /// The same policy with its own state, for split requests' prefill legs:
    /// the prefill replicas are a pool of their own (their turns, their shares).
    prefill_policy: Box<dyn RoutingPolicy>,
    /// A policy that plans every decision alongside and sends nothing.
    shadow: Option<Box<dyn RoutingPolicy>>,
    rng: Mutex<StdRng>,
}

/// Models, their policies and the KV index.
pub struct Core {
    /// Models by slot: a model keeps its slot (and replicas, leases and
    /// views name it by that) for the life of the process, whatever its
    /// place in the file; a new model takes the next slot, and a model
    /// removed keeps its slot, unnamed, for the requests still holding it.
    /// Swapped whole by a reload ([`Core::reload_models`]).
    models: ArcSwap<Vec<Arc<ModelRoute>>>,
    /// The KV index.
    pub kv: Kv,
    fallbacks: usize,
}

/// Model `i` of `config`, in slot `slot`, with its policy's state fresh.
fn model_route(config: &Config, i: usize, slot: usize) -> Result<ModelRoute, BadParams> {
    let m = &config.models[i];
    let params = config.params(i).map_err(BadParams)?;
    Ok(ModelRoute {
        name: m.name.clone(),
        aliases: m.aliases.clone(),
        adapters: m.adapters.clone(),
        max_loras: m.max_loras,
        policy: inferrail_policy::build(m.policy, &params),
        prefill_policy: inferrail_policy::build(m.policy, &params),
        shadow: m.shadow_policy.map(|kind| inferrail_policy::build(kind, &params)),
        params,
        rng: Mutex::new(StdRng::seed_from_u64(config.routing.seed.wrapping_add(slot as u64))),
    })
}

impl Core {
    /// From a validated configuration: its models take slots in file order.
    pub fn new(config: &Config) -> Result<Self, BadParams> {
        let models = (0..config.models.len()).map(|i| model_route(config, i, i).map(Arc::new)).collect::<Result<_, _>>()?;
        Ok(Self { models: ArcSwap::from_pointee(models), kv: Kv::new(config.kv.clone()), fallbacks: config.retry.fallbacks })
    }

    /// Every slot's model now, removed ones included.
    pub fn models(&self) -> Arc<Vec<Arc<ModelRoute>>> {
        self.models.load_full()
    }

    /// The model in slot `i` now.
    pub fn model(&self, i: usize) -> Arc<ModelRoute> {
        self.models.load()[i].clone()
    }

    /// The slot each of `config`'s models has, or would take: its name's
    /// slot, else the next free one.
    pub fn slots(&self, config: &Config) -> Vec<usize> {
        let models = self.models();
        let mut taken = models.len();
        let mut take = || {
            taken += 1;
            taken - 1
        };
        config.models.iter().map(|m| models.iter().position(|r| r.name == m.name).unwrap_or_else(&mut take)).collect()
    }

    /// Takes `new`'s models into their `slots` (from [`Core::slots`]): a
    /// model whose entry and resolved parameters are as in `old` keeps its
    /// policy's state (counters, sketches, sessions, its generator); a new
    /// one, or one whose aliases, policy or parameters changed, starts it
    /// fresh; a slot no model names any more keeps its model. Returns how
    /// many started fresh.
    pub fn reload_models(&self, old: &Config, new: &Config, slots: &[usize]) -> Result<usize, BadParams> {
        let mut next: Vec<Arc<ModelRoute>> = self.models().to_vec();
        let mut changed = 0;
        for (i, &slot) in slots.iter().enumerate() {
            let m = &new.models[i];
            let before = old.models.iter().position(|o| o.name == m.name);
            let same = before.is_some_and(|j| old.models[j] == *m && old.params(j).ok() == new.params(i).ok());
            if same {
                continue;
            }
            changed += 1;
            let route = Arc::new(model_route(new, i, slot)?);
            match next.get_mut(slot) {
                Some(at) => *at = route,
                None => next.push(route),
            }
        }
        self.models.store(Arc::new(next));
        Ok(changed)
    }

    /// The model's policy name.
    pub fn policy(&self, model: usize) -> &'static str {
        self.model(model).policy.name()
    }

    /// Which text of a request the model's policy reads.
    pub fn wants_text(&self, model: usize) -> TextKind {
        self.model(model).policy.wants_text()
    }

    fn place(&self, r: &Replica) -> Place {
        Place { slot: r.slot, block_size: r.block_size(self.kv.defaults.block_size), lookahead: r.lookahead(), adapter_ahead: None }
    }

    /// Starts tracking a replica that just joined, empty.
    pub fn join(&self, r: &Replica) {
        self.kv.reset(r.slot, r.blocks(self.kv.defaults.blocks));
        self.kv.index().set_host(r.slot, r.cache.host_blocks);
    }

    /// Forgets a replica that left.
    pub fn leave(&self, r: &Replica) {
        self.kv.leave(&r.id, r.slot);
    }

    /// The engine reported its cache shape. A new block size restarts the
    /// shadow (every hash changes); a new capacity alone resizes an
    /// approximate shadow, keeping what the requests sent so far put there
    /// (before the first report the router assumed the default size).
    pub fn learned(&self, r: &Replica, block_size: usize, blocks: usize) {
        let shape = |r: &Replica| (r.block_size(self.kv.defaults.block_size), r.blocks(self.kv.defaults.blocks));
        let before = shape(r);
        if r.learn_cache(block_size, blocks) {
            let (block_size, blocks) = shape(r);
            tracing::info!(replica = %r.id, block_size, blocks, "KV cache shape learned");
        }
        let after = shape(r);
        if after.0 == before.0 && after.1 != before.1 && self.kv.resize(r.slot, after.1) {
            return;
        }
        if after != before {
            self.join(r);
        }
    }

    /// The engine's prefix-cache query counter; one that went backwards means
    /// the engine restarted with an empty cache. Returns whether it did. A
    /// replica that follows KV events is left to its follower, which hears
    /// of the restart through `Replica::restarts` and knows whether the new
    /// engine's events came first (ADR 0012).
    pub fn prefix_cache_queries(&self, r: &Replica, queries: u64) -> bool {
        let before = r.prefix_queries.swap(queries, std::sync::atomic::Ordering::Relaxed);
        let restarted = queries < before;
        if restarted {
            tracing::info!(replica = %r.id, "engine counters went backwards: restarted, cache empty");
            r.restarts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if r.kv_mode() == Mode::Approximate(Reason::NoEventsConfigured) {
                self.kv.clear(r.slot);
            }
        }
        restarted
    }

    /// Cuts a prompt of `model` into blocks of every block size its replicas in `fleet` use.
    pub fn prepare(&self, model: usize, prompt: &Prompt, fleet: &Fleet) -> Arc<Prediction> {
        let sizes = fleet.serving(model).iter().map(|r| r.block_size(self.kv.defaults.block_size));
        Arc::new(self.kv.prepare(&self.model(model).name, prompt, sizes))
    }

    /// Plans a request over `fleet` at `now`; `reports` gives each replica's
    /// engine report, if any (stale ones are shown but never used). The
    /// plan's order holds the winner and the fallbacks; [`Core::plan_all`]
    /// orders every offered replica.
    pub fn plan(
        &self,
        view: &View,
        fleet: &Arc<Fleet>,
        reports: &dyn Fn(&Replica) -> Option<Report>,
        now: Duration,
    ) -> Result<Plan, NoReplica> {
        let model = self.model(view.model);
        let rng = model.rng.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let pick = Pick { side: Side::Whole, k: 1 + self.fallbacks, rng };
        available(self.plan_best(&model, view, fleet, reports, now, pick)).map(|p| self.pair(&model, view, reports, p))
    }

    /// [`Core::plan`], with every offered replica in the order, and a plan
    /// (saying why) even when no replica can take the request: what an
    /// explanation shows.
    pub fn plan_all(&self, view: &View, fleet: &Arc<Fleet>, reports: &dyn Fn(&Replica) -> Option<Report>, now: Duration) -> Plan {
        let model = self.model(view.model);
        let rng = model.rng.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let plan = self.plan_best(&model, view, fleet, reports, now, Pick { side: Side::Whole, k: usize::MAX, rng });
        if plan.unavailable.is_some() { plan } else { self.pair(&model, view, reports, plan) }
    }

    /// Plans and commits as one step. Decisions for one model take turns
    /// here, so each sees the leases, counters, policy state and random
    /// draws of the one before it (planning and committing apart, two
    /// decisions could both see a replica's last free slot, or the same
    /// round-robin turn).
    pub fn decide(
        &self,
        view: &View,
        fleet: &Arc<Fleet>,
        reports: &dyn Fn(&Replica) -> Option<Report>,
        now: Duration,
    ) -> Result<(Plan, Committed), NoReplica> {
        match self.decide_if(view, fleet, reports, now, &|_| true)? {
            Decided::Committed(plan, committed) => Ok((plan, committed)),
            Decided::Held(_) => unreachable!("every plan is admitted"),
        }
    }

    /// [`Core::decide`], committing only a plan `admit` lets through: one
    /// it refuses is held, with nothing committed and no policy state
    /// moved, for the caller to wait and plan again.
    pub fn decide_if(
        &self,
        view: &View,
        fleet: &Arc<Fleet>,
        reports: &dyn Fn(&Replica) -> Option<Report>,
        now: Duration,
        admit: &dyn Fn(&Plan) -> bool,
    ) -> Result<Decided, NoReplica> {
        // One model throughout, even if a reload swaps the models meanwhile.
        let model = self.model(view.model);
        let mut rng = model.rng.lock().unwrap_or_else(|p| p.into_inner());
        let pick = Pick { side: Side::Whole, k: 1 + self.fallbacks, rng: rng.clone() };
        let mut plan = self.pair(&model, view, reports, available(self.plan_best(&model, view, fleet, reports, now, pick))?);
        if !admit(&plan) {
            return Ok(Decided::Held(plan));
        }
        let committed = self.commit(&model, &plan, &mut rng);
        plan.shadow = self.shadow(&model, &plan);
        Ok(Decided::Committed(plan, committed))
    }

    fn plan_best(
        &self,
        model: &ModelRoute,
        view: &View,
        fleet: &Arc<Fleet>,
        reports: &dyn Fn(&Replica) -> Option<Report>,
        now: Duration,
        Pick { side, k, rng }: Pick,
    ) -> Plan {
        let replicas = fleet.serving(view.model);
        let adapter = view.prediction.as_ref().and_then(|p| p.adapter.as_deref());
        let max_loras = model.max_loras;
        let fits: Vec<Option<AdapterFit>> = replicas.iter().map(|r| adapter.map(|a| r.adapter_fit(a, max_loras, now))).collect();
        let places: Vec<Place> =
            replicas.iter().zip(&fits).map(|(r, fit)| Place { adapter_ahead: fit.and_then(AdapterFit::ahead), ..self.place(r) }).collect();
        self.kv.advance(&places, now);
        let cached = match &view.prediction {
            Some(p) => self.kv.cached(p, &places, now),
            None => vec![(0, 0); replicas.len()],
        };
        let offloaded = match &view.prediction {
            Some(p) => self.kv.offloaded(p, &places, &cached),
            None => vec![Offloaded::default(); replicas.len()],
        };
        let reports: Vec<Option<(Report, Duration)>> =
            replicas.iter().map(|r| reports(r).map(|rep| (rep, now.saturating_sub(rep.at)))).collect();
        let candidates: Vec<Candidate> = replicas
            .iter()
            .zip(cached)
            .zip(&reports)
            .zip(offloaded)
            .zip(fits)
            .map(|((((r, cached), report), offloaded), fit)| {
                let fresh = report.filter(|(_, age)| *age <= FRESH).map(|(rep, _)| rep);
                let mut c = r.candidate(now, cached, fresh, view.share);
                c.adapter = fit;
                c.offloaded = offloaded;
                c
            })
            .collect();
        let mut aside = vec![None; candidates.len()];
        let unavailable = eligibility(&candidates, &mut aside)
            .and_then(|()| restrict(replicas, &mut aside, Replica::draining, SetAside::Draining, NoReplica::AllDraining))
            .and_then(|()| match side {
                Side::Whole => restrict(replicas, &mut aside, |r| !r.role().decodes(), SetAside::Role, NoReplica::NoneServe),
                Side::Prefill(decoder) => {
                    restrict(replicas, &mut aside, |r| !r.role().prefills() || r.id == decoder.id, SetAside::Role, NoReplica::NoneServe)
                }
            })
            .and_then(|()| match view.subset {
                Some(subset) => {
                    restrict(replicas, &mut aside, |r| !subset.contains(&r.addr), SetAside::OutsideSubset, NoReplica::NoneInSubset)
                }
                None => Ok(()),
            })
            .and_then(|()| keep_for_urgent(replicas, &mut aside, view.replica_share))
            .err();
        let mut plan = Plan {
            model: view.model,
            policy: model.policy.name(),
            terms: model.policy.terms(),
            now,
            fleet: fleet.clone(),
            candidates,
            reports,
            set_aside: Vec::new(),
            scores: Vec::new(),
            order: Vec::new(),
            steer: None,
            waived: None,
            unavailable,
            prediction: view.prediction.clone(),
            shadow: None,
            pd: None,
            eligible: Vec::new(),
            session: view.session.map(str::to_owned),
            text: view.text.map(str::to_owned),
            block_size: most_common_block_size(&places).unwrap_or(self.kv.defaults.block_size),
            rng,
        };
        if plan.unavailable.is_some() {
            plan.scores = vec![None; aside.len()];
            plan.set_aside = aside;
            return plan;
        }
        let mut rng = plan.rng.clone();
        let policy = match side {
            Side::Whole => model.policy.as_ref(),
            Side::Prefill(_) => model.prefill_policy.as_ref(),
        };
        let ranked = rank(policy, &plan.request(), &plan.candidates, aside.clone(), k, &mut rng);
        plan.rng = rng;
        plan.eligible = aside;
        plan.set_aside = ranked.set_aside;
        plan.scores = ranked.scores;
        plan.order = ranked.order;
        // Every replica failing its probes: all were offered, and the decision says so.
        plan.steer = if panicking(&plan.candidates) { Some("panic") } else { ranked.steer };
        plan.waived = ranked.waived;
        plan
    }

    /// On a model served disaggregated, plans the prefill leg of the request
    /// `whole` plans and says whether it is split ([`pair`]); `whole` as it
    /// is otherwise. The prefill plan draws from `whole`'s generator after it.
    fn pair(&self, model: &ModelRoute, view: &View, reports: &dyn Fn(&Replica) -> Option<Report>, mut whole: Plan) -> Plan {
        if !whole.fleet.disaggregated(view.model) {
            return whole;
        }
        let d = pair::decoder(&whole, &model.params);
        let decoder = whole.replica(d).clone();
        let pick = Pick { side: Side::Prefill(&decoder), k: 1 + self.fallbacks, rng: whole.rng.clone() };
        let prefill = self.plan_best(model, view, &whole.fleet, reports, whole.now, pick);
        let (price, why) = if prefill.unavailable.is_some() {
            (pair::Price::default(), pair::Why::NoPrefillReplica)
        } else if whole.prediction.is_none() {
            (pair::Price::default(), pair::Why::Untokenized)
        } else {
            let price = pair::price(&whole, d, &prefill, &model.params, model.params.prefill);
            (price, pair::choose(model.policy.name(), &price))
        };
        if why.split() {
            whole.rng.clone_from(&prefill.rng);
            // The decode replica leads; the rest stay its fallbacks.
            whole.order.retain(|&i| i != d);
            whole.order.insert(0, d);
        }
        whole.pd = Some(Box::new(pair::Pd { prefill, price, why }));
        whole
    }

    /// What the model's shadow policy would have picked for a plan the live
    /// policy made, over the same candidates; it is told what the live one
    /// picked, so its state follows the traffic as it was routed. Nothing
    /// is held or sent.
    fn shadow(&self, model: &ModelRoute, plan: &Plan) -> Option<Shadow> {
        let shadow = model.shadow.as_deref()?;
        let req = plan.request();
        let mut rng = plan.rng.clone();
        let ranked = rank(shadow, &req, &plan.candidates, plan.eligible.clone(), 1, &mut rng);
        shadow.picked(&req, &plan.candidates, plan.order[0]);
        let winner = *ranked.order.first()?;
        Some(Shadow {
            policy: shadow.name(),
            winner: plan.replica(winner).clone(),
            estimate: ranked.scores[winner].map(|s| s.total),
            agreed: winner == plan.order[0],
        })
    }

    /// Commits a plan made under the model's generator lock (see [`Core::decide`]).
    fn commit(&self, model: &ModelRoute, plan: &Plan, rng: &mut StdRng) -> Committed {
        let winner = plan.order[0];
        model.policy.picked(&plan.request(), &plan.candidates, winner);
        rng.clone_from(&plan.rng);
        let won = plan.winner();
        let split = plan.split();
        // A split request's decode replica reads its prompt rather than computing it.
        let hold = self.hold_for(plan, winner, model.params.prefill, !split);
        let lease = self.hold(plan.model, won, &Hold { estimate: plan.ttft(model.params.prefill), ..hold }, plan.now, true);
        let (targets, cached_tokens) = self.targets(plan);
        let prefill = plan.pd.as_deref().filter(|_| split).map(|pd| {
            let leg = &pd.prefill;
            model.prefill_policy.picked(&leg.request(), &leg.candidates, leg.order[0]);
            let hold = self.hold_for(leg, leg.order[0], model.params.prefill, true);
            // The prefill replica generates one token, whatever the client asked.
            let prediction = hold.prediction.as_deref().map(|p| Arc::new(p.prefill_leg()));
            let lease = self.hold(leg.model, leg.winner(), &Hold { prediction, ..hold }, leg.now, true);
            let (targets, cached_tokens) = self.targets(leg);
            Leg { lease, targets, cached_tokens }
        });
        Committed { lease, targets, cached_tokens, prefill }
    }

    /// What a request holds on `plan`'s candidate `i`: its prefill there
    /// when it `computes` one, the free room its prompt takes but for the
    /// cached blocks requests in flight hold, its prompt's record.
    fn hold_for(&self, plan: &Plan, i: usize, model_prefill: Prefill, computes: bool) -> Hold {
        let prompt_tokens = plan.prompt_tokens();
        let c = &plan.candidates[i];
        let prefill = if computes { c.prompt_prefill_secs(model_prefill, prompt_tokens, c.engine_cached_tokens()) } else { 0.0 };
        Hold {
            prompt_tokens,
            prefill: Duration::from_secs_f64(prefill),
            estimate: plan.estimate(i, model_prefill),
            kv_tokens: prompt_tokens.map_or(0, |n| n.saturating_sub(c.held_cached_tokens)) as u64,
            prediction: plan.prediction.clone(),
        }
    }

    /// A plan's winner and fallbacks, with their predicted cached tokens.
    fn targets(&self, plan: &Plan) -> (Vec<Arc<Replica>>, Vec<usize>) {
        let picked = &plan.order[..plan.order.len().min(1 + self.fallbacks)];
        let targets = picked.iter().map(|&i| plan.replica(i).clone()).collect();
        let cached_tokens = match &plan.prediction {
            Some(_) => picked.iter().map(|&i| plan.candidates[i].engine_cached_tokens()).collect(),
            None => Vec::new(),
        };
        (targets, cached_tokens)
    }

    /// Takes what a decision holds on `replica` for model `model`, decided
    /// at `at`: a slot, its prefill queued, free KV room, and its prompt's
    /// record. The same for this router's decisions (`mine`) and a peer's.
    pub fn hold(&self, model: usize, replica: &Arc<Replica>, hold: &Hold, at: Duration, mine: bool) -> Arc<Lease> {
        let tokens = hold.prompt_tokens.unwrap_or(0) as u64;
        let lease = Arc::new(if mine { Lease::new(replica.clone(), model, tokens) } else { Lease::mirror(replica.clone(), model, tokens) });
        lease.queue_prefill(hold.prefill);
        lease.sent_kv(at, hold.kv_tokens);
        lease.set_estimate(hold.estimate);
        if let Some(prediction) = &hold.prediction {
            if let Some(a) = &prediction.adapter {
                lease.set_adapter(a.clone());
            }
            let record = self.kv.record(prediction, self.place(replica));
            *lease.kv.lock().unwrap_or_else(|p| p.into_inner()) = Some((prediction.clone(), record));
        }
        lease
    }

    /// Holds a request another router decided, for model `model` on
    /// `replica` at `at` ([`Core::hold`]), and lets the model's policy learn
    /// the pick as if it were its own (cost_model's demand and hot-prefix
    /// sketches, sessions, round-robin turns), so that every router's policy
    /// sees the whole fleet's traffic (ADR 0034). A policy that reads the
    /// prompt's text learns nothing: peers are not sent it.
    pub fn mirror(&self, model: usize, replica: &Arc<Replica>, hold: &Hold, session: Option<&str>, at: Duration) -> Arc<Lease> {
        let lease = self.hold(model, replica, hold, at, false);
        let block_size = self.block_size(replica);
        let blocks = hold.prediction.as_ref().and_then(|p| p.blocks(block_size)).unwrap_or_default();
        let req = Request { now: at, prompt_tokens: hold.prompt_tokens, blocks, block_size, session, text: None };
        let winner = replica.candidate(at, (0, 0), None, Share::ALONE);
        self.model(model).policy.picked(&req, &[winner], 0);
        lease
    }

    /// The block size a prompt going to `r` is recorded at.
    pub fn block_size(&self, r: &Replica) -> usize {
        self.place(r).block_size
    }

    /// Moves a request's lease to the replica that really served it (Envoy
    /// retried on a fallback), and its prompt's record with it. Returns the new lease.
    pub fn move_lease(&self, old: &Lease, to: &Arc<Replica>) -> Arc<Lease> {
        let moved = Arc::new(old.moved(to.clone()));
        if let Some((prediction, record)) = old.kv.lock().unwrap_or_else(|p| p.into_inner()).take() {
            self.kv.take_back(&record);
            let again = self.kv.record(&prediction, self.place(to));
            *moved.kv.lock().unwrap_or_else(|p| p.into_inner()) = Some((prediction, again));
        }
        old.release();
        moved
    }

    /// The request is over (at `at`) and the engine answered it (status
    /// below 400): it freed its blocks. Only the first call for a lease
    /// does anything.
    pub fn complete(&self, lease: &Lease, at: Duration) {
        if let Some((_, record)) = lease.kv.lock().unwrap_or_else(|p| p.into_inner()).take() {
            self.kv.complete(&record, at);
            let _ = lease.completed.set(record);
        }
    }

    /// The request's first token came at `at`: its output fills blocks in
    /// the engine's cache from then on; heard after its end, it teaches the
    /// index its replica's times.
    pub fn decoding(&self, lease: &Lease, at: Duration) {
        if let Some((_, record)) = lease.kv.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            self.kv.decoding(record, at);
        } else if let Some(record) = lease.completed.get() {
            self.kv.decoding(record, at);
        }
    }

    /// The request is over and its status has not come (it may never: with
    /// several routers Envoy may send the response to another): a claim on
    /// an exact replica ends now, anything else waits for `complete` or
    /// `take_back`.
    pub fn end_claim(&self, lease: &Lease) {
        let mut kv = lease.kv.lock().unwrap_or_else(|p| p.into_inner());
        if kv.as_ref().is_some_and(|(_, record)| self.kv.end_claim(record)) {
            *kv = None;
        }
    }

    /// The engine refused or failed a request: its prompt is not in that
    /// cache. Returns whether there was a record to take back.
    pub fn take_back(&self, lease: &Lease) -> bool {
        match lease.kv.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some((_, record)) => {
                self.kv.take_back(&record);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests;
