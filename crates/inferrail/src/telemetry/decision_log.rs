//! The decision log: one JSON line per sampled decision (every candidate's
//! state and score terms, the guards, the winner and fallbacks, the
//! predicted cached tokens), then one per finished request joining the
//! measured time to first byte and the outcome by request id. Never the
//! prompt or the body.
//!
//! Requests are sampled by a hash of their id, so a decision and its
//! outcome are kept or dropped together. Lines go through a bounded queue to
//! a writer thread; when the queue is full (the disk fell behind) a line is
//! dropped and counted (`inferrail_decision_log_dropped_total`), never
//! waited for, so logging cannot slow a decision.

use std::io::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;

use inferrail_config::DecisionLog as Config;
use inferrail_route::Plan;
use serde_json::{Value, json};

/// Where sampled decisions go.
pub struct DecisionLog {
    lines: SyncSender<Line>,
    /// Requests whose id hashes below this are logged.
    threshold: u64,
    dropped: AtomicU64,
    writer: Mutex<Option<JoinHandle<()>>>,
}

/// What the writer thread is sent.
enum Line {
    /// A line to append.
    Text(String),
    /// Write what came before, then stop.
    Close,
}

impl DecisionLog {
    /// Opens the log's file for appending (a file that cannot be opened
    /// stops the router from starting) and starts its writer thread; `None`
    /// when logging is off.
    pub fn start(config: &Config) -> anyhow::Result<Option<Self>> {
        let Some(path) = config.path.clone().filter(|_| config.sample_rate > 0.0) else { return Ok(None) };
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| anyhow::anyhow!("opening the decision log {path}: {e}"))?;
        let (lines, queue) = sync_channel(config.queue);
        let writer = std::thread::Builder::new().name("decision-log".into()).spawn(move || write(&path, file, queue))?;
        let threshold = (config.sample_rate.clamp(0.0, 1.0) * u64::MAX as f64) as u64;
        Ok(Some(Self { lines, threshold, dropped: AtomicU64::new(0), writer: Mutex::new(Some(writer)) }))
    }

    /// Writes every line still queued and stops the writer (at shutdown; the
    /// only call that waits for the disk). Lines sent afterwards are dropped.
    pub fn close(&self) {
        let Some(writer) = self.writer.lock().unwrap_or_else(|p| p.into_inner()).take() else { return };
        if self.lines.send(Line::Close).is_ok() && writer.join().is_err() {
            tracing::warn!("the decision log's writer panicked");
        }
    }

    /// Whether the request with this id is sampled.
    pub fn sampled(&self, request_id: &str) -> bool {
        xxhash_rust::xxh3::xxh3_64(request_id.as_bytes()) <= self.threshold
    }

    fn send(&self, line: Value) {
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = self.lines.try_send(Line::Text(line.to_string())) {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            metrics::counter!("inferrail_decision_log_dropped_total").increment(1);
        }
    }

    /// Lines dropped so far (the queue was full, or the writer gone).
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Logs a decision, if its request is sampled.
    pub fn decision(&self, request_id: &str, model: &str, plan: &Plan, fallbacks: usize) {
        if !self.sampled(request_id) {
            return;
        }
        self.send(decision_line(request_id, model, plan, fallbacks));
    }

    /// Logs how a sampled request ended.
    pub fn outcome(&self, request_id: &str, replica: &str, ttft_ms: Option<f64>, status: Option<u16>, outcome: &str) {
        if !self.sampled(request_id) {
            return;
        }
        self.send(json!({
            "time": now_unix_ms(),
            "kind": "outcome",
            "request_id": request_id,
            "replica": replica,
            "ttft_ms": ttft_ms,
            "status": status,
            "outcome": outcome,
        }));
    }
}

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// One decision as a JSON line.
pub fn decision_line(request_id: &str, model: &str, plan: &Plan, fallbacks: usize) -> Value {
    let candidates: Vec<Value> = (0..plan.candidates.len())
        .map(|i| {
            let (c, r) = (&plan.candidates[i], plan.replica(i));
            let terms: Option<serde_json::Map<String, Value>> =
                plan.scores[i].map(|s| plan.terms.iter().zip(s.terms).map(|(name, v)| (name.to_string(), json!(v))).collect());
            json!({
                "replica": r.id,
                "healthy": c.healthy,
                "in_flight": c.in_flight,
                "pending": c.pending,
                "prompt_tokens_in_flight": c.prompt_tokens_in_flight,
                "queued_prefill_ms": c.queued_prefill_secs * 1e3,
                "engine": plan.reports[i].map(|(rep, age)| json!({
                    "running": rep.load.running,
                    "waiting": rep.load.waiting,
                    "kv_usage": rep.load.kv_usage,
                    "age_ms": age.as_secs_f64() * 1e3,
                })),
                "predicted_cached_tokens": c.engine_cached_tokens(),
                "host_cached_tokens": c.offloaded.host,
                "disk_cached_tokens": c.offloaded.disk,
                "held_cached_tokens": c.held_cached_tokens,
                "free_kv_tokens": c.free_kv_tokens(),
                "set_aside": plan.set_aside[i].map(|a| a.label()),
                "score": plan.scores[i].map(|s| s.total),
                "terms": terms,
            })
        })
        .collect();
    json!({
        "time": now_unix_ms(),
        "kind": "decision",
        "request_id": request_id,
        "model": model,
        "policy": plan.policy,
        "prompt_tokens": plan.prompt_tokens(),
        "winner": plan.winner().id,
        "fallbacks": plan.order.iter().skip(1).take(fallbacks).map(|&i| plan.replica(i).id.clone()).collect::<Vec<_>>(),
        "predicted_cached_tokens": plan.candidates[plan.order[0]].engine_cached_tokens(),
        "steer": plan.steer,
        "waived": plan.waived,
        "shadow": plan.shadow.as_ref().map(|sh| json!({
            "policy": sh.policy,
            "winner": sh.winner.id,
            "score": sh.estimate,
            "agreed": sh.agreed,
        })),
        "candidates": candidates,
        "pd": plan.pd.as_deref().map(|pd| {
            let ms = |s: f64| s * 1e3;
            let leg = &pd.prefill;
            json!({
                "split": pd.split(),
                "why": pd.why.label(),
                "prefill_winner": leg.order.first().map(|&w| leg.replica(w).id.clone()),
                "prefill_predicted_cached_tokens": leg.order.first().map(|&w| leg.candidates[w].cached_tokens),
                "whole_ttft_ms": ms(pd.price.whole_ttft),
                "whole_stall_ms": ms(pd.price.whole_stall),
                "prefill_ttft_ms": ms(pd.price.prefill_ttft),
                "prefill_stall_ms": ms(pd.price.prefill_stall),
                "transfer_ms": ms(pd.price.transfer),
                "transfer_blocks": pd.price.transfer_blocks,
                "decode_wait_ms": ms(pd.price.decode_wait),
            })
        }),
    })
}

/// The writer thread: appends every line, flushing when the queue runs dry.
fn write(path: &str, file: std::fs::File, queue: Receiver<Line>) {
    let mut out = std::io::BufWriter::new(file);
    let mut failing = false;
    let mut open = true;
    while open && let Ok(first) = queue.recv() {
        let mut result = Ok(());
        for line in std::iter::once(first).chain(std::iter::from_fn(|| queue.try_recv().ok())) {
            match line {
                Line::Text(text) => result = result.and_then(|()| writeln!(out, "{text}")),
                Line::Close => {
                    open = false;
                    break;
                }
            }
        }
        match result.and_then(|()| out.flush()) {
            Ok(()) if failing => {
                tracing::info!(path, "writing the decision log works again");
                failing = false;
            }
            Ok(()) => {}
            Err(e) => {
                metrics::counter!("inferrail_decision_log_errors_total").increment(1);
                if !failing {
                    tracing::warn!(path, error = %e, "writing the decision log failed; lines are lost until it works again");
                    failing = true;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
