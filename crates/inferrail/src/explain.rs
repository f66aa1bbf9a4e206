//! The admin gRPC API (`inferrail.admin.v1`, on `admin.grpc_listen`, with
//! server reflection): `Explain` plans a request as a client would send it
//! with the same code that routes it and commits nothing; `Replicas` and
//! `WatchReplicas` show the fleet as the router sees it. This module is the
//! boundary: router types in, protobuf messages out.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use inferrail_proto::admin::v1 as pb;
use inferrail_proto::admin::v1::admin_server::{Admin, AdminServer};
use inferrail_route::fleet::Replica;
use inferrail_route::{FRESH, Plan, Report};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::decision::{Explained, RouteError};
use crate::request::{self, Endpoint};
use crate::router::Router;

/// How often `WatchReplicas` looks for changes.
const WATCH_EVERY: Duration = Duration::from_millis(200);

/// The service, over the router.
pub struct AdminApi {
    router: Arc<Router>,
}

/// The admin service and the reflection service that describes it.
pub fn services(router: Arc<Router>) -> anyhow::Result<tonic::service::Routes> {
    let builder =
        || tonic_reflection::server::Builder::configure().register_encoded_file_descriptor_set(inferrail_proto::ADMIN_DESCRIPTORS);
    // Both versions of the reflection API: grpcurl before 1.9 speaks only v1alpha.
    Ok(tonic::service::Routes::new(AdminServer::new(AdminApi { router }))
        .add_service(builder().build_v1()?)
        .add_service(builder().build_v1alpha()?))
}

/// A router error as a gRPC status a person can act on.
fn status(e: &RouteError) -> Status {
    match e {
        RouteError::UnknownModel(_) => Status::not_found(e.to_string()),
        RouteError::NoReplica(_) => Status::unavailable(e.to_string()),
        RouteError::Body(_) | RouteError::MissingModel | RouteError::TooLarge(_) | RouteError::UnknownBand(_) => {
            Status::invalid_argument(e.to_string())
        }
        RouteError::Unauthorized => Status::unauthenticated(e.to_string()),
        RouteError::BandNotAllowed(_) => Status::permission_denied(e.to_string()),
        // Explain neither charges limits nor queues.
        RouteError::RateLimited { .. } | RouteError::Shed(_) => Status::resource_exhausted(e.to_string()),
    }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::ReplicasResponse, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl Admin for AdminApi {
    async fn explain(&self, request: Request<pb::ExplainRequest>) -> Result<Response<pb::ExplainResponse>, Status> {
        let r = request.into_inner();
        let Endpoint::Generate(endpoint) = request::endpoint("POST", &r.path) else {
            return Err(Status::invalid_argument(format!("path {:?}: explain /v1/chat/completions or /v1/completions", r.path)));
        };
        let session = r.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case("x-session-id")).map(|(_, v)| v.as_str());
        let asked = request::asked(r.headers.iter().map(|(k, v)| (k.to_ascii_lowercase(), v.clone())));
        let explained = self.router.explain(r.body.as_bytes(), endpoint, session, &asked).await.map_err(|e| status(&e))?;
        Ok(Response::new(explanation(&self.router, &explained)))
    }

    async fn replicas(&self, _request: Request<pb::ReplicasRequest>) -> Result<Response<pb::ReplicasResponse>, Status> {
        Ok(Response::new(fleet(&self.router)))
    }

    async fn drain(&self, request: Request<pb::DrainRequest>) -> Result<Response<pb::Replica>, Status> {
        let pb::DrainRequest { id, draining } = request.into_inner();
        let found = self.router.fleet().replicas.iter().find(|r| r.id == id).cloned();
        let Some(replica) = found else { return Err(Status::not_found(format!("no replica `{id}`"))) };
        if replica.set_draining(draining) {
            tracing::info!(replica = %id, draining, "drain changed by an admin call");
        }
        let shown = fleet(&self.router).replicas.into_iter().find(|r| r.id == id);
        shown.map(Response::new).ok_or_else(|| Status::not_found(format!("replica `{id}` left")))
    }

    type WatchReplicasStream = WatchStream;

    async fn watch_replicas(&self, _request: Request<pb::ReplicasRequest>) -> Result<Response<WatchStream>, Status> {
        let router = self.router.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            let mut last: Option<Vec<(String, bool, bool, bool, bool)>> = None;
            let mut tick = tokio::time::interval(WATCH_EVERY);
            loop {
                // A client gone ends the watch, even while nothing changes.
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = tx.closed() => return,
                }
                let now = fleet(&router);
                // Membership, health, ejection, drain and report freshness; counters change too often to stream.
                let shape: Vec<(String, bool, bool, bool, bool)> = now
                    .replicas
                    .iter()
                    .map(|r| (r.id.clone(), r.healthy, r.ejected, r.draining, r.engine.as_ref().is_some_and(|e| e.fresh)))
                    .collect();
                if last.as_ref() != Some(&shape) {
                    last = Some(shape);
                    if tx.send(Ok(now)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }
}

fn engine(report: Option<(Report, Duration)>) -> Option<pb::EngineReport> {
    report.map(|(r, age)| pb::EngineReport {
        running: r.load.running,
        waiting: r.load.waiting,
        kv_usage: r.load.kv_usage,
        age_ms: age.as_secs_f64() * 1e3,
        fresh: age <= FRESH,
    })
}

/// The explanation of a plan.
fn explanation(router: &Router, e: &Explained) -> pb::ExplainResponse {
    let plan = &e.plan;
    let mut out = pb::ExplainResponse {
        model: router.core.model(plan.model).name.clone(),
        requested_model: e.requested.clone().unwrap_or_default(),
        policy: plan.policy.to_string(),
        no_prediction: e.no_prediction.unwrap_or_default().to_string(),
        no_replica: plan.unavailable.map(|why| why.label().to_string()).unwrap_or_default(),
        admission: Some(pb::Admission {
            tenant: e.placed.tenant.clone(),
            band: e.placed.band.as_ref().map(|(_, b)| b.name.clone()).unwrap_or_default(),
            ttft_objective_ms: e.placed.objective().map_or(0, |o| o.as_millis() as u64),
            waiting_ahead: e.waiting_ahead as u64,
            would_wait: e.would_wait,
        }),
        ..pb::ExplainResponse::default()
    };
    out.prompt_tokens = plan.prompt_tokens().unwrap_or(0) as u64;
    out.block_size = plan.block_size() as u64;
    out.prompt_blocks = plan.blocks().len() as u64;
    out.steer = plan.steer.unwrap_or_default().to_string();
    out.waived = plan.waived.unwrap_or_default().to_string();
    out.winner = plan.order.first().map(|&w| plan.replica(w).id.clone()).unwrap_or_default();
    out.fallbacks = plan.order.iter().skip(1).take(router.config().retry.fallbacks).map(|&i| plan.replica(i).id.clone()).collect();
    out.deciding_term = deciding_term(plan).to_string();
    out.candidates = candidates(plan);
    out.disaggregation = plan.pd.as_deref().map(|pd| {
        let leg = &pd.prefill;
        let ms = |s: f64| s * 1e3;
        pb::Disaggregation {
            split: pd.split(),
            why: pd.why.label().to_string(),
            prefill_winner: leg.order.first().map(|&w| leg.replica(w).id.clone()).unwrap_or_default(),
            prefill_fallbacks: leg.order.iter().skip(1).take(router.config().retry.fallbacks).map(|&i| leg.replica(i).id.clone()).collect(),
            prefill_candidates: candidates(leg),
            whole_ttft_ms: ms(pd.price.whole_ttft),
            whole_stall_ms: ms(pd.price.whole_stall),
            prefill_ttft_ms: ms(pd.price.prefill_ttft),
            prefill_stall_ms: ms(pd.price.prefill_stall),
            transfer_ms: ms(pd.price.transfer),
            transfer_blocks: pd.price.transfer_blocks as u64,
            decode_wait_ms: ms(pd.price.decode_wait),
        }
    });
    out
}

/// Every replica serving the model as `plan` saw it.
fn candidates(plan: &Plan) -> Vec<pb::Candidate> {
    (0..plan.candidates.len())
        .map(|i| {
            let (c, r) = (&plan.candidates[i], plan.replica(i));
            let score = plan.scores[i];
            pb::Candidate {
                id: r.id.clone(),
                address: r.addr.to_string(),
                healthy: c.healthy,
                ejected: r.ejected(plan.now.as_millis() as u64),
                has_room: c.has_room(),
                in_flight: c.in_flight,
                pending: c.pending,
                max_concurrency: c.max_concurrency,
                max_pending: c.max_pending,
                prompt_tokens_in_flight: c.prompt_tokens_in_flight,
                queued_prefill_ms: c.queued_prefill_secs * 1e3,
                engine: engine(plan.reports[i]),
                predicted_cached_tokens: c.engine_cached_tokens() as u64,
                gpu_cached_tokens: c.cached_tokens as u64,
                host_cached_tokens: c.offloaded.host as u64,
                disk_cached_tokens: c.offloaded.disk as u64,
                set_aside: plan.set_aside[i].map(|a| a.label().to_string()).unwrap_or_default(),
                score: score.map(|s| s.total),
                terms: score.map_or_else(Vec::new, |s| {
                    plan.terms.iter().zip(s.terms).map(|(name, value)| pb::Term { name: name.to_string(), value }).collect()
                }),
                rank: plan.order.iter().position(|&o| o == i).map_or(0, |p| p as u32 + 1),
                kv_mode: r.kv_mode().as_str().to_string(),
                held_cached_tokens: c.held_cached_tokens as u64,
                free_kv_tokens: c.free_kv_tokens(),
                adapter: c.adapter.map(|fit| pb::AdapterFit {
                    name: plan.prediction.as_ref().and_then(|p| p.adapter.as_deref()).unwrap_or_default().to_string(),
                    resident: fit.resident,
                    others: fit.others,
                    max_loras: fit.max_loras.unwrap_or(0),
                    must_wait: fit.must_wait(),
                }),
            }
        })
        .collect()
}

/// The term that put the winner furthest ahead of the runner-up: what a
/// steer decided, `only_candidate` alone, else the term whose difference is largest.
fn deciding_term(plan: &Plan) -> &'static str {
    if let Some(steer) = plan.steer {
        return steer;
    }
    let (w, r) = match (plan.order.first(), plan.order.get(1)) {
        (None, _) => return "",
        (Some(_), None) => return "only_candidate",
        (Some(&w), Some(&r)) => (w, r),
    };
    let (Some(w), Some(r)) = (plan.scores[w], plan.scores[r]) else { return "" };
    let ahead = plan.terms.iter().zip(w.terms.iter().zip(r.terms)).map(|(name, (w, r))| (name, r - w));
    match ahead.max_by(|a, b| a.1.total_cmp(&b.1)) {
        Some((name, d)) if d > 0.0 => name,
        // No term ahead: the tie-break (fewer in flight, then the prompt's last full block, else a draw) decided.
        _ => "tie_break",
    }
}

/// A replica's adapters, with its models' `max_loras` (the largest, where
/// they differ); none when it knows of no adapter and no slot count.
fn adapters(router: &Router, r: &Replica, now: Duration) -> Option<pb::Adapters> {
    let configured = r.models.iter().filter_map(|&m| router.core.model(m).max_loras).max();
    let view = r.adapters(configured, now);
    let names = |v: &[Arc<str>]| v.iter().map(|a| a.to_string()).collect();
    let known = view.max_loras.is_some() || !(view.running.is_empty() && view.idle.is_empty() && view.waiting.is_empty());
    known.then(|| pb::Adapters {
        running: names(&view.running),
        idle: names(&view.idle),
        waiting: names(&view.waiting),
        max_loras: view.max_loras.unwrap_or(0),
    })
}

/// The fleet as the router sees it now.
fn fleet(router: &Router) -> pb::ReplicasResponse {
    let now = router.now();
    let replicas = router
        .fleet()
        .replicas
        .iter()
        .map(|r: &Arc<Replica>| {
            let c = r.candidate(now, (0, 0), None, router.peers.share());
            let defaults = &router.config().kv;
            pb::Replica {
                id: r.id.clone(),
                address: r.addr.to_string(),
                models: r.models.iter().map(|&m| router.core.model(m).name.clone()).collect(),
                healthy: c.healthy,
                ejected: r.ejected(now.as_millis() as u64),
                in_flight: c.in_flight,
                pending: c.pending,
                max_concurrency: c.max_concurrency,
                max_pending: c.max_pending,
                prompt_tokens_in_flight: c.prompt_tokens_in_flight,
                queued_prefill_ms: c.queued_prefill_secs * 1e3,
                engine: engine(router.report(&r.id).map(|rep| (rep, now.saturating_sub(rep.at)))),
                block_size: r.block_size(defaults.block_size) as u64,
                kv_blocks: r.blocks(defaults.blocks) as u64,
                kv_mode: r.kv_mode().as_str().to_string(),
                draining: r.draining(),
                adapters: adapters(router, r, now),
            }
        })
        .collect();
    pb::ReplicasResponse { replicas }
}

#[cfg(test)]
mod tests;
