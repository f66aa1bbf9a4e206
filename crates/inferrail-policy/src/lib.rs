//! Routing policies: given the replicas that may serve a request, score them.
//!
//! A policy sees plain data: each [`Candidate`] (the router's own counters,
//! the engine's last fresh report, the prompt's predicted cached tokens) and
//! the [`Request`]. It may set candidates aside with a typed [`SetAside`]
//! reason ([`RoutingPolicy::guard`]), then gives every remaining candidate a
//! [`Score`] split into named terms, lower is better. Ordering the scores,
//! with ties to fewer requests in flight and then to the prompt (else to
//! chance), is [`order`]'s job, the same for every policy. A policy that
//! keeps state across decisions (round robin's counter, sessions, the
//! hot-prefix sketch) updates it only in [`RoutingPolicy::picked`], after a
//! decision is committed, so that scoring can be replayed to explain a
//! decision without changing the next one. Randomness comes from a generator the caller passes in (seeded,
//! so a seed replays the same choices). No I/O happens here.
#![forbid(unsafe_code)]

pub mod cost_model;
pub mod dynamo_kv;
pub mod gie_default;
pub mod kv_aware;
pub mod least_request;
pub mod p2c;
pub mod prefix_hash;
pub mod random;
pub mod round_robin;
pub mod sglang_cache_aware;
pub mod sketch;

mod decision;

use std::time::Duration;

use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

pub use decision::{Ranked, decide, order, rank};

/// A block's chained hash, as the KV index names it.
pub type BlockHash = u128;

/// What a policy knows of one replica at decision time.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// A stable number for the replica (a hash of its id), for rendezvous hashing and sessions.
    pub key: u64,
    /// Requests routed to it and not yet finished.
    pub in_flight: u32,
    /// Of those, the ones still waiting for their first byte.
    pub pending: u32,
    /// Most requests in flight it takes.
    pub max_concurrency: u32,
    /// Most requests waiting for a first byte it takes.
    pub max_pending: u32,
    /// Passes health checks and is not ejected.
    pub healthy: bool,
    /// Prompt tokens the KV index predicts it holds (0 without a prediction).
    pub cached_tokens: usize,
    /// Of those, the ones in blocks a request in flight there holds: the
    /// engine reuses them without taking room from its free pool.
    pub held_cached_tokens: usize,
    /// Prefill the router has sent it and that is not done yet, seconds.
    pub queued_prefill_secs: f64,
    /// Its engine's own prefill cost, when configured for the replica (a
    /// mixed fleet); else the model's `prefill` applies.
    pub prefill: Option<Prefill>,
    /// Prompt tokens of the requests in flight there.
    pub prompt_tokens_in_flight: u64,
    /// Tokens its KV cache holds, configured or from the engine (0 when unknown).
    pub kv_capacity_tokens: u64,
    /// KV tokens the requests sent to it after the engine's report was read
    /// will take (their prompts less the cached tokens requests in flight
    /// hold): room that the report still counts as free.
    pub unreported_kv_tokens: u64,
    /// The engine's own last report, only while it is fresh.
    pub engine: Option<EngineReport>,
    /// With several routers: this router's own requests there and its part
    /// of the limits, which it must stay within as well (ADR 0034).
    pub own: Option<Own>,
    /// Where the request's LoRA adapter stands there, for a request that names one.
    pub adapter: Option<AdapterFit>,
    /// Prompt tokens past `cached_tokens` its engine holds offloaded, which
    /// it loads rather than computes (known in exact mode only).
    pub offloaded: Offloaded,
}

/// Prompt tokens a replica's engine holds right after its GPU prefix in
/// offload tiers, consecutive; vLLM loads every such hit before computing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Offloaded {
    /// In host memory (the `CPU` medium).
    pub host: usize,
    /// In other tiers (disk, remote storage), after the host's.
    pub disk: usize,
}

impl Offloaded {
    /// All of them.
    pub fn tokens(&self) -> usize {
        self.host + self.disk
    }
}

/// Where a request's LoRA adapter stands on a replica, by the requests in
/// flight there (this router's and its peers') and the engine's fresh
/// report of the adapters it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdapterFit {
    /// It runs there, or still holds a slot its requests left: no load.
    pub resident: bool,
    /// Other adapters running there (requests in flight, or the engine's report).
    pub others: u32,
    /// Adapters one engine step runs (the model's `max_loras`, else the
    /// engine's `max_lora`), when known.
    pub max_loras: Option<u32>,
}

impl AdapterFit {
    /// Whether a request of this adapter would wait for a slot: every one
    /// is taken by other adapters' running requests.
    pub fn must_wait(&self) -> bool {
        !self.resident && self.max_loras.is_some_and(|m| self.others >= m)
    }

    /// Where it must wait: the other adapters waiting there too (more
    /// running than slots), which are served first.
    pub fn ahead(self) -> Option<usize> {
        let m = self.max_loras.filter(|_| self.must_wait())?;
        Some(self.others.saturating_sub(m) as usize)
    }
}

/// One router's requests on a replica and its part of the replica's limits,
/// when several routers share it. The parts add up to the limits, so the
/// routers together never exceed them, even when two decide at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Own {
    /// This router's requests in flight there.
    pub in_flight: u32,
    /// Of those, the ones waiting for their first byte.
    pub pending: u32,
    /// Its part of `max_concurrency`.
    pub max_concurrency: u32,
    /// Its part of `max_pending`.
    pub max_pending: u32,
}

/// Where a router stands among the routers sharing the fleet: its place in
/// their order by id, and how many there are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Share {
    /// Its place, from 0.
    pub rank: u32,
    /// How many routers, itself included.
    pub of: u32,
}

impl Share {
    /// A router on its own.
    pub const ALONE: Share = Share { rank: 0, of: 1 };

    /// Its part of `limit`: an even split, the remainder to the first ranks,
    /// so the parts add up to `limit`.
    pub fn part(self, limit: u32) -> u32 {
        let of = self.of.max(1);
        limit / of + u32::from(self.rank < limit % of)
    }
}

impl Candidate {
    /// Has room for one more request: below the limits, and below this
    /// router's part of them when it shares the replica.
    pub fn has_room(&self) -> bool {
        self.in_flight < self.max_concurrency
            && self.pending < self.max_pending
            && self.own.is_none_or(|o| o.in_flight < o.max_concurrency && o.pending < o.max_pending)
    }

    /// Seconds to prefill a `prompt`-token prompt here past the `cached`
    /// tokens it holds, at its engine's prefill cost (else the model's).
    pub fn prefill_secs(&self, model: Prefill, prompt: usize, cached: usize) -> f64 {
        self.prefill.unwrap_or(model).secs(prompt.saturating_sub(cached), cached.min(prompt))
    }

    /// Prompt tokens its engine will report cached: its GPU prefix, then
    /// what it loads from offload tiers.
    pub fn engine_cached_tokens(&self) -> usize {
        self.cached_tokens + self.offloaded.tokens()
    }

    /// Seconds to prefill a prompt of `prompt` tokens here past the `cached`
    /// ones it holds (an untokenized prompt's: its fixed cost alone).
    pub fn prompt_prefill_secs(&self, model: Prefill, prompt: Option<usize>, cached: usize) -> f64 {
        self.prefill_secs(model, prompt.unwrap_or(0), cached)
    }

    /// Its estimated time to first token, seconds: the prefill queued there
    /// and this prompt's own ([`Candidate::prompt_prefill_secs`]). The one
    /// estimate the router, the policies and the ledger's leases share.
    pub fn ttft_secs(&self, model: Prefill, prompt: Option<usize>, cached: usize) -> f64 {
        self.queued_prefill_secs + self.prompt_prefill_secs(model, prompt, cached)
    }

    /// Requests decoding now: the engine's count while its report is fresh,
    /// else the router's requests past their first byte.
    pub fn running(&self) -> u32 {
        self.engine.as_ref().map_or(self.in_flight.saturating_sub(self.pending), |e| e.running)
    }

    /// KV tokens no running request holds, by the engine's fresh report and
    /// the cache's known size, less what the requests sent since that report
    /// will take; `None` when the report or the size is unknown.
    pub fn free_kv_tokens(&self) -> Option<u64> {
        let e = self.engine.as_ref().filter(|_| self.kv_capacity_tokens > 0)?;
        let reported = ((1.0 - e.kv_usage).clamp(0.0, 1.0) * self.kv_capacity_tokens as f64) as u64;
        Some(reported.saturating_sub(self.unreported_kv_tokens))
    }
}

/// What an engine last said of its load, from its `/metrics` page.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineReport {
    /// Requests running.
    pub running: u32,
    /// Requests waiting.
    pub waiting: u32,
    /// Of those, the ones passed over until a LoRA adapter slot frees
    /// (deferred): they hold no place in the queue the others wait in.
    pub deferred: u32,
    /// Share of its KV cache in use, 0 to 1.
    pub kv_usage: f64,
}

/// What a policy knows of the request.
#[derive(Debug, Clone, Copy, Default)]
pub struct Request<'a> {
    /// The decision's time on the router's clock.
    pub now: Duration,
    /// Prompt tokens, when the prompt was tokenized.
    pub prompt_tokens: Option<usize>,
    /// The prompt's full blocks' hashes at `block_size` (empty without a prediction).
    pub blocks: &'a [BlockHash],
    /// Tokens per block of `blocks`.
    pub block_size: usize,
    /// The conversation it names (`x-session-id`, or the body's `user`).
    pub session: Option<&'a str>,
    /// The prompt as text, for policies that match characters rather than
    /// tokens (given only to those whose [`RoutingPolicy::wants_text`] says so).
    pub text: Option<&'a str>,
}

/// A candidate's score: lower is better; `terms` are named by the policy's [`RoutingPolicy::terms`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Score {
    /// What ranks it.
    pub total: f64,
    /// Its parts, for explanations and logs.
    pub terms: [f64; 8],
}

impl Score {
    /// A score that is its only term.
    pub fn single(total: f64) -> Self {
        Self { total, terms: [total, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0] }
    }
}

/// Why a replica was not offered to the policy, or was set aside by its guards.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SetAside {
    /// Failing probes or ejected.
    Unhealthy,
    /// At its concurrency or pending limit.
    Full,
    /// One more request would put it above the bounded-load cap.
    BoundedLoad {
        /// The cap.
        cap: u32,
    },
    /// Its engine reports its KV cache fuller than `kappa` and the prompt is long and uncached there.
    KvPressure {
        /// The reported usage.
        usage: f64,
    },
    /// Its engine has fewer free KV tokens than the prompt, long and uncached
    /// there, needs: the prompt less the cached tokens a request in flight holds.
    KvRoom {
        /// Free tokens as [`Candidate::free_kv_tokens`] counts them.
        free_tokens: u64,
    },
    /// Not among the endpoints the gateway offered for this request (its subset hint).
    OutsideSubset,
    /// Draining: it finishes what it has and takes nothing new.
    Draining,
    /// Kept for more urgent bands: the request's band may use only part of the replicas.
    KeptForUrgent,
    /// Its role does not take this leg: a prefill-only replica for a whole
    /// request or a decode leg, a decode-only one (or the decode leg's own
    /// replica) for a prefill leg.
    Role,
}

impl SetAside {
    /// A short label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Unhealthy => "unhealthy",
            Self::Full => "full",
            Self::BoundedLoad { .. } => "bounded_load",
            Self::KvPressure { .. } => "kv_pressure",
            Self::KvRoom { .. } => "kv_room",
            Self::OutsideSubset => "outside_subset",
            Self::Draining => "draining",
            Self::KeptForUrgent => "kept_for_urgent",
            Self::Role => "role",
        }
    }
}

/// Why no replica can take a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NoReplica {
    /// The model has no replicas at all.
    #[error("no replica serves this model")]
    NoneServe,
    /// Every healthy replica is at its concurrency or pending limit.
    #[error("every healthy replica of this model is at capacity")]
    AllFull,
    /// Every healthy replica is draining.
    #[error("every healthy replica of this model is draining")]
    AllDraining,
    /// None of the endpoints the gateway offered can take it.
    #[error("no replica among the endpoints the gateway offered can take this request")]
    NoneInSubset,
}

impl NoReplica {
    /// A short label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            Self::NoneServe => "no_replica",
            Self::AllFull => "all_full",
            Self::NoneInSubset => "none_in_subset",
            Self::AllDraining => "all_draining",
        }
    }
}

/// Marks the candidates that may not take a request in `aside`: full ones,
/// and unhealthy ones while another is healthy; fails with the reason when
/// none may. When every candidate fails its health checks, all are offered
/// ([`panicking`]), as Envoy's balancer does below its panic threshold: a
/// probe can be wrong, and a refusal surely fails the request. The pool
/// never empties for want of health.
pub fn eligibility(candidates: &[Candidate], aside: &mut [Option<SetAside>]) -> Result<(), NoReplica> {
    if candidates.is_empty() {
        return Err(NoReplica::NoneServe);
    }
    let panic = panicking(candidates);
    for (c, a) in candidates.iter().zip(aside.iter_mut()) {
        *a = if !c.healthy && !panic {
            Some(SetAside::Unhealthy)
        } else if !c.has_room() {
            Some(SetAside::Full)
        } else {
            None
        };
    }
    if aside.iter().all(Option::is_some) { Err(NoReplica::AllFull) } else { Ok(()) }
}

/// Whether every candidate fails its health checks (then [`eligibility`] offers them all).
pub fn panicking(candidates: &[Candidate]) -> bool {
    !candidates.is_empty() && candidates.iter().all(|c| !c.healthy)
}

/// A routing policy: guards, then scores; see the module doc.
pub trait RoutingPolicy: Send + Sync {
    /// The policy's name, as configured and as metrics label it.
    fn name(&self) -> &'static str;

    /// Names of the score's terms, in order (at most four).
    fn terms(&self) -> &'static [&'static str];

    /// Whether it reads [`Request::text`].
    fn wants_text(&self) -> TextKind {
        TextKind::None
    }

    /// Sets aside candidates its guards refuse (`aside[i]` is `None` for the
    /// ones still offered, at least one). Must leave at least one offered.
    /// Returns a note when a guard was waived because it would refuse all.
    fn guard(&self, _req: &Request, _candidates: &[Candidate], _aside: &mut [Option<SetAside>]) -> Option<&'static str> {
        None
    }

    /// Scores each of `offered` (indices into `candidates`, never empty) into
    /// the same position of `out`. Returns what steered the decision, when
    /// something other than the scores' order did (a session, a fallback).
    fn score(
        &self,
        req: &Request,
        candidates: &[Candidate],
        offered: &[usize],
        rng: &mut StdRng,
        out: &mut [Score],
    ) -> Option<&'static str>;

    /// The decision was committed to `winner` (an index into `candidates`).
    fn picked(&self, _req: &Request, _candidates: &[Candidate], _winner: usize) {}
}

/// Which text of a request a policy reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextKind {
    /// None.
    None,
    /// The messages' contents (or the prompt) joined by single spaces, as SGLang's router reads them.
    Contents,
    /// The messages serialized as JSON (or the prompt), as the Inference Extension's picker reads them.
    Serialized,
}

impl TextKind {
    /// This kind of text of an OpenAI request body: a completion's prompt as
    /// it is; a chat's messages' contents (text parts included) joined by
    /// single spaces, or its messages serialized as JSON. `None` for
    /// [`TextKind::None`] or a body with neither.
    pub fn read(self, body: &serde_json::Map<String, serde_json::Value>) -> Option<String> {
        use serde_json::Value;
        if self == Self::None {
            return None;
        }
        if let Some(prompt) = body.get("prompt").and_then(Value::as_str) {
            return Some(prompt.to_owned());
        }
        let messages = body.get("messages")?.as_array()?;
        if self == Self::Serialized {
            return serde_json::to_string(messages).ok();
        }
        let content = |m: &Value| match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect::<Vec<_>>().join(" "),
            _ => String::new(),
        };
        Some(messages.iter().map(content).collect::<Vec<_>>().join(" "))
    }
}

/// A well-mixed 64-bit weight of a prefix on a replica (splitmix64's finalizer), for rendezvous hashing.
fn weight(prefix: BlockHash, key: u64) -> u64 {
    let mut z = (prefix as u64) ^ ((prefix >> 64) as u64).rotate_left(29) ^ key;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The engine's prefill cost: `a*u + b*u*(c + u/2) + d` seconds for `u`
/// uncached tokens after `c` cached ones. `inferrail-calibrate` fits it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Prefill {
    /// `a`: microseconds per uncached token.
    pub prefill_token_us: f64,
    /// `b`: nanoseconds per attended token pair.
    pub prefill_pair_ns: f64,
    /// `d`: milliseconds per prefill.
    pub prefill_fixed_ms: f64,
}

impl Default for Prefill {
    /// The simulator's defaults, close to an 8B model on one 24 GB GPU.
    fn default() -> Self {
        Self { prefill_token_us: 100.0, prefill_pair_ns: 3.3, prefill_fixed_ms: 5.0 }
    }
}

impl Prefill {
    /// Every range problem, each with its path under `at`, into `p`.
    pub fn validate(&self, at: &str, p: &mut Vec<String>) {
        for (name, v) in [
            ("prefill_token_us", self.prefill_token_us),
            ("prefill_pair_ns", self.prefill_pair_ns),
            ("prefill_fixed_ms", self.prefill_fixed_ms),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                p.push(format!("{at}.{name}: {v} is not a non-negative number"));
            }
        }
    }

    /// Seconds to prefill `uncached` tokens after `cached` ones.
    pub fn secs(&self, uncached: usize, cached: usize) -> f64 {
        let (u, c) = (uncached as f64, cached as f64);
        self.prefill_token_us * 1e-6 * u + self.prefill_pair_ns * 1e-9 * u * (c + u / 2.0) + self.prefill_fixed_ms * 1e-3
    }
}

/// A policy as configured for a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Each replica in turn.
    #[default]
    RoundRobin,
    /// Uniformly at random.
    Random,
    /// Fewest requests in flight, ties by [`order`]'s tie-break.
    LeastRequest,
    /// The better of two chosen at random.
    P2c,
    /// Rendezvous hash on the prompt's first blocks.
    PrefixHash,
    /// Predicted cached share against relative load.
    KvAware,
    /// Lowest estimated time to first token, inside load guards.
    CostModel,
    /// SGLang router's `cache_aware`, as a stand-in for comparisons.
    SglangCacheAware,
    /// NVIDIA Dynamo's KV router cost, as a stand-in for comparisons.
    DynamoKv,
    /// The Gateway API Inference Extension's default endpoint picker, as a stand-in for comparisons.
    GieDefault,
}

/// Every policy's parameters; a model uses the ones of its policy, and
/// `prefill` also sizes the prefill the router counts as queued.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Params {
    /// The engine's prefill cost.
    pub prefill: Prefill,
    /// `cost_model`.
    pub cost_model: cost_model::Config,
    /// `kv_aware`.
    pub kv_aware: kv_aware::Config,
    /// `prefix_hash`.
    pub prefix_hash: prefix_hash::Config,
    /// `sglang_cache_aware`.
    pub sglang_cache_aware: sglang_cache_aware::Config,
    /// `dynamo_kv`.
    pub dynamo_kv: dynamo_kv::Config,
    /// `gie_default`.
    pub gie_default: gie_default::Config,
    /// Moving KV between a prefill and a decode replica.
    pub kv_transfer: KvTransfer,
}

/// What moving a prompt's KV from a prefill replica to a decode replica costs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct KvTransfer {
    /// Microseconds per KV block moved (the decode replica reads the blocks it lacks).
    pub block_us: f64,
}

impl Default for KvTransfer {
    fn default() -> Self {
        // A 16-token block of an 8B model's KV, 2 MiB in 16 bits, over a 20 GB/s link.
        Self { block_us: 100.0 }
    }
}

impl KvTransfer {
    /// Seconds to move `blocks` blocks.
    pub fn secs(&self, blocks: usize) -> f64 {
        self.block_us * 1e-6 * blocks as f64
    }
}

impl Params {
    /// Every range problem, each with its path under `at`.
    pub fn validate(&self, at: &str) -> Vec<String> {
        let mut p = Vec::new();
        self.prefill.validate(&format!("{at}.prefill"), &mut p);
        if !(self.kv_transfer.block_us.is_finite() && self.kv_transfer.block_us >= 0.0) {
            p.push(format!("{at}.kv_transfer.block_us: {} is not a non-negative number", self.kv_transfer.block_us));
        }
        self.cost_model.validate(&format!("{at}.cost_model"), &mut p);
        self.kv_aware.validate(&format!("{at}.kv_aware"), &mut p);
        self.prefix_hash.validate(&format!("{at}.prefix_hash"), &mut p);
        self.sglang_cache_aware.validate(&format!("{at}.sglang_cache_aware"), &mut p);
        self.dynamo_kv.validate(&format!("{at}.dynamo_kv"), &mut p);
        self.gie_default.validate(&format!("{at}.gie_default"), &mut p);
        p
    }
}

/// Builds a policy with its parameters.
pub fn build(kind: PolicyKind, params: &Params) -> Box<dyn RoutingPolicy> {
    match kind {
        PolicyKind::RoundRobin => Box::new(round_robin::RoundRobin::default()),
        PolicyKind::Random => Box::new(random::Random),
        PolicyKind::LeastRequest => Box::new(least_request::LeastRequest),
        PolicyKind::P2c => Box::new(p2c::P2c),
        PolicyKind::PrefixHash => Box::new(prefix_hash::PrefixHash::new(params.prefix_hash.clone())),
        PolicyKind::KvAware => Box::new(kv_aware::KvAware::new(params.kv_aware.clone())),
        PolicyKind::CostModel => Box::new(cost_model::CostModel::new(params.cost_model.clone(), params.prefill)),
        PolicyKind::SglangCacheAware => Box::new(sglang_cache_aware::SglangCacheAware::new(params.sglang_cache_aware.clone())),
        PolicyKind::DynamoKv => Box::new(dynamo_kv::DynamoKv::new(params.dynamo_kv.clone())),
        PolicyKind::GieDefault => Box::new(gie_default::GieDefault::new(params.gie_default.clone())),
    }
}

/// Every policy kind, for tests and benchmarks.
pub const ALL: [PolicyKind; 10] = [
    PolicyKind::RoundRobin,
    PolicyKind::Random,
    PolicyKind::LeastRequest,
    PolicyKind::P2c,
    PolicyKind::PrefixHash,
    PolicyKind::KvAware,
    PolicyKind::CostModel,
    PolicyKind::SglangCacheAware,
    PolicyKind::DynamoKv,
    PolicyKind::GieDefault,
];

#[cfg(test)]
pub(crate) mod testing;

#[cfg(test)]
mod tests;
