//! The decision core: from a request view, a fleet snapshot and the time,
//! [`Core::plan`] says what the model's policy would do and why;
//! [`Core::commit`] makes it so.
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
//! index. No I/O happens here: the service feeds it Envoy's requests and the
//! scraper's reports, `Explain` plans without committing, and the fleet
//! simulation drives it on a virtual clock.
#![forbid(unsafe_code)]

pub mod fleet;
pub mod kv;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use inferrail_config::Config;
use inferrail_policy::{Candidate, EngineReport, NoReplica, Params, Request, RoutingPolicy, Score, SetAside, TextKind, eligibility, order};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::fleet::{Fleet, Lease, Replica};
use crate::kv::{Kv, Place, Prediction, Prompt};

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
    /// Its policy's parameters (the prefill cost among them).
    pub params: Params,
    policy: Box<dyn RoutingPolicy>,
    rng: Mutex<StdRng>,
}

/// What the core needs to know of one request.
#[derive(Debug, Clone)]
pub struct View<'a> {
    /// The model's index.
    pub model: usize,
    /// The prompt cut into blocks ([`Core::prepare`]), when it was tokenized.
    pub prediction: Option<Arc<Prediction>>,
    /// The conversation it names.
    pub session: Option<&'a str>,
    /// The prompt as text, when the model's policy reads it ([`Core::wants_text`]).
    pub text: Option<&'a str>,
}

/// One replica in a plan.
#[derive(Debug, Clone)]
pub struct Planned {
    /// The replica.
    pub replica: Arc<Replica>,
    /// What the policy saw of it.
    pub candidate: Candidate,
    /// Its engine's last report and that report's age, fresh or not.
    pub report: Option<(Report, Duration)>,
    /// Why it was not offered, or set aside by a guard.
    pub set_aside: Option<SetAside>,
    /// Its score, when it was offered.
    pub score: Option<Score>,
}

/// What the model's policy would do now, and why.
pub struct Plan {
    /// The model's index.
    pub model: usize,
    /// The policy.
    pub policy: &'static str,
    /// The names of the score's terms.
    pub terms: &'static [&'static str],
    /// When it was planned.
    pub now: Duration,
    /// Every replica serving the model.
    pub candidates: Vec<Planned>,
    /// Offered candidates, best first: indices into `candidates`.
    pub order: Vec<usize>,
    /// What steered the decision besides the scores' order.
    pub steer: Option<&'static str>,
    /// A guard waived because it would have refused every replica.
    pub waived: Option<&'static str>,
    /// The prompt's blocks, when it was tokenized.
    pub prediction: Option<Arc<Prediction>>,
    session: Option<String>,
    text: Option<String>,
    block_size: usize,
    rng: StdRng,
}

impl Plan {
    /// The winner.
    pub fn winner(&self) -> &Planned {
        &self.candidates[self.order[0]]
    }

    /// Prompt tokens, when the prompt was tokenized.
    pub fn prompt_tokens(&self) -> Option<usize> {
        self.prediction.as_ref().map(|p| p.prompt_tokens)
    }

    fn request(&self) -> Request<'_> {
        let blocks = self.prediction.as_ref().and_then(|p| p.blocks(self.block_size)).unwrap_or_default();
        Request {
            now: self.now,
            prompt_tokens: self.prompt_tokens(),
            blocks,
            block_size: self.block_size,
            session: self.session.as_deref(),
            text: self.text.as_deref(),
        }
    }
}

/// A committed decision.
#[derive(Debug)]
pub struct Committed {
    /// The winner's lease.
    pub lease: Arc<Lease>,
    /// Winner first, then the fallbacks.
    pub targets: Vec<Arc<Replica>>,
    /// Predicted cached prompt tokens on each target, when the prompt was tokenized.
    pub cached_tokens: Vec<usize>,
    /// The prefill queued on the winner for it.
    pub prefill: Duration,
}

/// Models, their policies and the KV index.
pub struct Core {
    /// Models in configuration order.
    pub models: Vec<ModelRoute>,
    /// The KV index.
    pub kv: Kv,
    fallbacks: usize,
}

impl Core {
    /// From a validated configuration.
    pub fn new(config: &Config) -> Self {
        let seed = config.routing.seed;
        let models = config
            .models
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let params = config.params(i);
                ModelRoute {
                    name: m.name.clone(),
                    aliases: m.aliases.clone(),
                    policy: inferrail_policy::build(m.policy, &params),
                    params,
                    rng: Mutex::new(StdRng::seed_from_u64(seed.wrapping_add(i as u64))),
                }
            })
            .collect();
        Self { models, kv: Kv::new(config.kv.clone()), fallbacks: config.retry.fallbacks }
    }

    /// The model's policy name.
    pub fn policy(&self, model: usize) -> &'static str {
        self.models[model].policy.name()
    }

    /// Which text of a request the model's policy reads.
    pub fn wants_text(&self, model: usize) -> TextKind {
        self.models[model].policy.wants_text()
    }

    fn place(&self, r: &Replica) -> Place {
        Place { slot: r.slot, block_size: r.block_size(self.kv.defaults.block_size) }
    }

    /// Starts tracking a replica that just joined, empty.
    pub fn join(&self, r: &Replica) {
        self.kv.reset(r.slot, r.blocks(self.kv.defaults.blocks));
    }

    /// Forgets a replica that left.
    pub fn leave(&self, r: &Replica) {
        self.kv.leave(&r.id, r.slot);
    }

    /// The engine reported its cache shape; a shape that changes what is
    /// used (a new block size or capacity) restarts the shadow.
    pub fn learned(&self, r: &Replica, block_size: usize, blocks: usize) {
        let shape = |r: &Replica| (r.block_size(self.kv.defaults.block_size), r.blocks(self.kv.defaults.blocks));
        let before = shape(r);
        if r.learn_cache(block_size, blocks) {
            let (block_size, blocks) = shape(r);
            tracing::info!(replica = %r.id, block_size, blocks, "KV cache shape learned");
        }
        if shape(r) != before {
            self.join(r);
        }
    }

    /// The engine's prefix-cache query counter; one that went backwards means
    /// the engine restarted with an empty cache. Returns whether it did.
    pub fn prefix_cache_queries(&self, r: &Replica, queries: u64) -> bool {
        let before = r.prefix_queries.swap(queries, std::sync::atomic::Ordering::Relaxed);
        let restarted = queries < before;
        if restarted {
            tracing::info!(replica = %r.id, "engine counters went backwards: restarted, cache empty");
            self.kv.clear(r.slot);
        }
        restarted
    }

    /// Cuts a prompt of `model` into blocks of every block size its replicas in `fleet` use.
    pub fn prepare(&self, model: usize, prompt: &Prompt, fleet: &Fleet) -> Arc<Prediction> {
        let sizes = fleet.serving(model).iter().map(|r| r.block_size(self.kv.defaults.block_size));
        Arc::new(self.kv.prepare(&self.models[model].name, prompt, sizes))
    }

    /// Plans a request over `fleet` at `now`; `reports` gives each replica's
    /// engine report, if any (stale ones are shown but never used).
    pub fn plan(&self, view: &View, fleet: &Fleet, reports: &dyn Fn(&Replica) -> Option<Report>, now: Duration) -> Result<Plan, NoReplica> {
        let model = &self.models[view.model];
        let replicas = fleet.serving(view.model);
        let places: Vec<Place> = replicas.iter().map(|r| self.place(r)).collect();
        let prediction = view.prediction.clone();
        let cached = match &prediction {
            Some(p) => self.kv.cached(p, &places),
            None => vec![0; replicas.len()],
        };
        let mut candidates: Vec<Planned> = replicas
            .iter()
            .zip(cached)
            .map(|(r, cached)| {
                let report = reports(r).map(|rep| (rep, now.saturating_sub(rep.at)));
                let fresh = report.filter(|(_, age)| *age <= FRESH).map(|(rep, _)| rep.load);
                Planned { candidate: r.candidate(now, cached, fresh), replica: r.clone(), report, set_aside: None, score: None }
            })
            .collect();
        let inputs: Vec<Candidate> = candidates.iter().map(|p| p.candidate.clone()).collect();
        let mut aside = vec![None; inputs.len()];
        eligibility(&inputs, &mut aside)?;
        let mut plan = Plan {
            model: view.model,
            policy: model.policy.name(),
            terms: model.policy.terms(),
            now,
            candidates: Vec::new(),
            order: Vec::new(),
            steer: None,
            waived: None,
            prediction,
            session: view.session.map(str::to_owned),
            text: view.text.map(str::to_owned),
            block_size: places.first().map_or(self.kv.defaults.block_size, |p| p.block_size),
            rng: model.rng.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        };
        let req = plan.request();
        let waived = model.policy.guard(&req, &inputs, &mut aside);
        let offered: Vec<usize> = (0..inputs.len()).filter(|&i| aside[i].is_none()).collect();
        let mut scores = vec![Score::default(); offered.len()];
        let mut rng = plan.rng.clone();
        let steer = model.policy.score(&req, &inputs, &offered, &mut rng, &mut scores);
        let ranked = order(&inputs, &offered, &scores, &mut rng);
        for (c, a) in candidates.iter_mut().zip(aside) {
            c.set_aside = a;
        }
        for (&i, s) in offered.iter().zip(scores) {
            candidates[i].score = Some(s);
        }
        plan.rng = rng;
        plan.candidates = candidates;
        plan.order = ranked;
        plan.steer = steer;
        plan.waived = waived;
        Ok(plan)
    }

    /// Commits a plan: leases the winner and names the fallbacks.
    pub fn commit(&self, plan: Plan) -> Committed {
        let model = &self.models[plan.model];
        let winner = plan.order[0];
        {
            let req = plan.request();
            let inputs: Vec<Candidate> = plan.candidates.iter().map(|p| p.candidate.clone()).collect();
            model.policy.picked(&req, &inputs, winner);
        }
        *model.rng.lock().unwrap_or_else(|p| p.into_inner()) = plan.rng.clone();
        let won = &plan.candidates[winner];
        let prompt_tokens = plan.prompt_tokens();
        let cached = won.candidate.cached_tokens;
        let prefill =
            prompt_tokens.map_or(model.params.prefill.secs(0, 0), |n| model.params.prefill.secs(n.saturating_sub(cached), cached));
        let prefill = Duration::from_secs_f64(prefill);
        let lease = Arc::new(Lease::new(won.replica.clone(), plan.model, prompt_tokens.unwrap_or(0) as u64));
        won.replica.queue_prefill(plan.now, prefill);
        let picked: Vec<&Planned> = plan.order.iter().take(1 + self.fallbacks).map(|&i| &plan.candidates[i]).collect();
        let targets: Vec<Arc<Replica>> = picked.iter().map(|p| p.replica.clone()).collect();
        let cached_tokens = match &plan.prediction {
            Some(prediction) => {
                let record = self.kv.record(prediction, self.place(&won.replica));
                *lease.kv.lock().unwrap_or_else(|p| p.into_inner()) = Some((prediction.clone(), record));
                picked.iter().map(|p| p.candidate.cached_tokens).collect()
            }
            None => Vec::new(),
        };
        Committed { lease, targets, cached_tokens, prefill }
    }

    /// Moves a request's lease to the replica that really served it (Envoy
    /// retried on a fallback), and its prompt's record with it. Returns the new lease.
    pub fn move_lease(&self, old: &Lease, to: &Arc<Replica>) -> Arc<Lease> {
        let moved = Arc::new(Lease::since(to.clone(), old.model, old.start, old.prompt_tokens));
        if let Some((prediction, record)) = old.kv.lock().unwrap_or_else(|p| p.into_inner()).take() {
            self.kv.take_back(&record);
            let again = self.kv.record(&prediction, self.place(to));
            *moved.kv.lock().unwrap_or_else(|p| p.into_inner()) = Some((prediction, again));
        }
        old.release();
        moved
    }

    /// The request is over and the engine answered it (status below 400):
    /// it freed its blocks. Only the first call for a lease does anything.
    pub fn complete(&self, lease: &Lease) {
        if let Some((_, record)) = lease.kv.lock().unwrap_or_else(|p| p.into_inner()).take() {
            self.kv.complete(&record);
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
