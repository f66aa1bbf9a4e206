//! The decision pipeline, top to bottom: the API key checked
//! ([`crate::admission`]), the body read and the prompt tokenized
//! ([`crate::request`], [`crate::prompt`]), the request placed in its band
//! and charged its tenant's limits, then planned and committed by the
//! decision core (`inferrail_route::Core`) as soon as admission lets it go,
//! waiting its turn in its model's queue while the fleet is busy. The
//! committed request enters the ledger, the peers and the decision log are
//! told, and the [`Decision`] goes back to the transport.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use inferrail_config::PrefillLegs;
use inferrail_policy::NoReplica;
use inferrail_route::fleet::{Fleet, Replica};
use inferrail_route::kv::Prediction;
use inferrail_route::{Committed, Decided, Plan, Share, View};
use inferrail_tokenize::chat::Endpoint;

use super::{Caller, Router};
use crate::admission::{Asked, Placed, Shed, Ticket};
use crate::decision::{Decision, Explained, PrefillLeg, RouteError};
use crate::peers::wire;
use crate::request;

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

impl Router {
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
        let started = std::time::Instant::now();
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
        let prefill = committed.prefill.map(|leg| {
            let id = self.ledger.insert_prefill(&key, leg.lease.clone(), self.now());
            if self.peers.any() {
                self.peers.tell_all(wire::decided(&self.core, &id, &leg.lease, read.session.as_deref()));
            }
            let sidecar = self.config().routing.prefill_legs == PrefillLegs::Sidecar;
            PrefillLeg { request_id: id, targets: leg.targets, cached_tokens: leg.cached_tokens, sidecar }
        });
        if self.peers.any() {
            self.peers.tell_all(wire::decided(&self.core, &key, &committed.lease, read.session.as_deref()));
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
            prefill,
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
    ) -> Result<(Plan, Committed, Duration), RouteError> {
        let view = read.view(subset, self.peers.share(), placed);
        let reports = |r: &Replica| self.report(&r.id);
        let model_prefill = self.core.model(read.model).params.prefill;
        let mut ticket: Option<Ticket> = None;
        loop {
            let turn = match &ticket {
                None => self.admission.clear_for(read.model, placed),
                Some(t) => t.is_next(),
            };
            let within = |plan: &Plan| !placed.misses(plan.ttft(model_prefill));
            let now = self.now();
            let estimate = match self.core.decide_if(&view, &read.fleet, &reports, now, &|plan| turn && within(plan)) {
                Ok(Decided::Committed(plan, committed)) => {
                    let waited = ticket.map_or(Duration::ZERO, |t| t.admitted(now));
                    return Ok((plan, committed, waited));
                }
                Ok(Decided::Held(plan)) => Some(plan.ttft(model_prefill)),
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
        let busy =
            plan.unavailable == Some(NoReplica::AllFull) || (!plan.order.is_empty() && placed.misses(plan.ttft(model.params.prefill)));
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
        // An adapter is asked for by its own name, which the engine needs.
        let adapter = fields.model.clone().filter(|name| model.adapters.contains(name));
        // The model's name does not change the prompt: tokenize the body as sent.
        let mut read = self.prompts.read(index, endpoint, body, self.core.wants_text(index)).await;
        let fleet = routing.fleet.clone();
        let (prediction, no_prediction) = match &mut read.prompt {
            Ok(p) => {
                p.adapter = adapter.clone();
                (Some(self.core.prepare(index, p, &fleet)), None)
            }
            Err(reason) => (None, Some(*reason)),
        };
        let requested = fields.model.clone().filter(|name| *name != model.name);
        let forward = match fields.model {
            Some(name) if name == model.name || adapter.is_some() => None,
            _ => Some(request::with_model(body, fields.model_at, &model.name)),
        };
        let session = session.map(str::to_owned).or(fields.user);
        Ok(Prepared { model: index, fleet, prediction, session, text: read.text, no_prediction, requested, body: forward })
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
