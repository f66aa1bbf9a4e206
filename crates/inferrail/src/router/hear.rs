//! What the router does with what it hears of a request after its
//! decision. The transports (the route, picker and observe streams, the
//! access log, the peers) turn what they see into lifecycle events
//! ([`Event`]); the ledger runs the request's life and applies its effects
//! to the lease and the KV index (`inferrail_route::ledger`); the router
//! then acts on what that life called for: passive health (ejection after
//! failures in a row), admission's queues and token meters, metrics, the
//! decision log, and the peers, who are told what this router heard.

use std::sync::Arc;
use std::time::Duration;

use inferrail_config::PrefillLegs;
use inferrail_route::Hold;
use inferrail_route::fleet::{Replica, may_eject};
use inferrail_route::ledger::{Heard, mirror_id, prefill_leg_event};
use inferrail_route::lifecycle::Event;

use super::Router;
use crate::peers::wire;

impl Router {
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
                && let Some(told) = wire::heard(request_id, event, false, ago)
            {
                self.peers.tell_all(told);
            }
            if let Some(leg) = &heard.prefill {
                self.hear_prefill_leg(leg, event, ago);
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
                let told = wire::heard(request_id, event, true, ago).is_some_and(|told| self.peers.tell(d, told));
                told || self.hear_mirror(d, request_id, event, ago)
            }
            _ => self.hear_ago(request_id, event, ago),
        }
    }

    /// What a split request's decode leg tells of its prefill leg
    /// ([`prefill_leg_event`]).
    fn hear_prefill_leg(&self, leg_id: &str, event: Event, ago: Duration) {
        let sidecar = self.config().routing.prefill_legs == PrefillLegs::Sidecar;
        if let Some(leg) = prefill_leg_event(event, sidecar) {
            self.hear_ago(leg_id, leg, ago);
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
            self.request_failed(from);
            if heard.decider.is_none() {
                metrics::counter!("inferrail_retries_total", "replica" => from.id.clone()).increment(1);
            }
        }
        match heard.answered() {
            Some((replica, true)) => replica.record_success(),
            Some((replica, false)) => self.request_failed(replica),
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

    /// A request to `replica` failed upstream: count it, and eject the
    /// replica after enough failures in a row, within the ejection budget.
    pub fn request_failed(&self, replica: &Arc<Replica>) {
        let config = self.config();
        let cfg = &config.health;
        if replica.record_failure() < cfg.consecutive_failures {
            return;
        }
        let now = self.now_ms();
        let fleet = self.fleet();
        if may_eject(replica, &fleet.replicas, now, cfg) {
            let ms = replica.eject(now, cfg);
            metrics::counter!("inferrail_ejections_total", "replica" => replica.id.clone()).increment(1);
            tracing::warn!(replica = %replica.id, ejected_ms = ms, "ejected after consecutive failures");
        }
    }
}

impl Router {
    /// Holds request `request` that peer `from` decided for `model` on
    /// `replica` (their names) as the peer holds it, and mirrors it in the
    /// ledger. Returns false, holding nothing, when this router does not
    /// know the model or the replica (its discovery has not caught up).
    pub fn hold_mirror(&self, from: u64, request: &str, model: &str, replica: &str, hold: &Hold, session: Option<&str>) -> bool {
        let Some(model) = self.model_index(model) else { return false };
        let fleet = self.fleet();
        let Some(replica) = fleet.replicas.iter().find(|r| r.id == replica) else { return false };
        let now = self.now();
        let lease = self.core.mirror(model, replica, hold, session, now);
        self.ledger.mirror(from, request, lease, now);
        true
    }
}
