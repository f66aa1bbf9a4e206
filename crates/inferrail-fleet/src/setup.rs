//! The simulated fleet's shape (replicas, their caches and speeds, the
//! routers and how they hear of requests) and the router configuration a
//! simulation routes with.

use std::time::Duration;

use inferrail_config::{Config, Limits, Model, Role};
use inferrail_engine::cost::{KV_BYTES_PER_TOKEN, LatencyModel, OFFLOAD_GBS};
use inferrail_policy::PolicyKind;
use inferrail_route::lifecycle::Timing;

use crate::timescale;

/// The simulated fleet.
#[derive(Debug, Clone)]
pub struct Setup {
    /// Replicas.
    pub replicas: usize,
    /// A disaggregated fleet: the first this many replicas prefill (role
    /// `prefill`), the rest decode (`decode`); zero: every replica does both.
    pub prefill_replicas: usize,
    /// KV blocks per replica (the engine's pool, and the router's shadow of it).
    pub kv_blocks: usize,
    /// A mixed fleet: replica `i` has `mixed[i % len]`, its latency model
    /// as a multiple of the time scale's and its KV blocks, and the router
    /// prices it by that model, as `inferrail-calibrate` fits it (empty:
    /// every replica alike).
    pub mixed: Vec<(f64, usize)>,
    /// Tokens per block.
    pub block_size: usize,
    /// LoRA adapters one engine step runs (`--max-loras`); 0: no limit.
    pub max_loras: usize,
    /// Blocks each engine keeps in host memory (vLLM's offloading
    /// connector), which the router is told of (`host_kv_blocks`); 0: none.
    pub host_blocks: usize,
    /// The engines' latency model is the simulator's default times this
    /// ([`crate::timescale`]); the router's costs are set to match.
    pub time_scale: f64,
    /// The model's own policy parameters over the time scale's (`--policy-params`; null: none).
    pub policies: serde_yaml::Value,
    /// Each replica's limits as the router holds them.
    pub limits: Limits,
    /// The router's seed.
    pub seed: u64,
    /// The model the requests ask for.
    pub model: String,
    /// Routers deciding, in turn.
    pub routers: usize,
    /// Whether the routers are each other's peers.
    pub peers: bool,
    /// How long a router's word takes to reach its peers.
    pub peer_delay: Duration,
    /// How long the routers' ledgers wait for what is still on its way
    /// (`Timing::ROUTER`, as the service's).
    pub timing: Timing,
    /// When set, a request's status is heard only this long after its end
    /// (as an access log tells it), not with its first token.
    pub status_after_end: Option<Duration>,
    /// When set, a request's first byte is heard only this long after its
    /// end, as the shipped layout's access log tells it (ADR 0035); unset,
    /// as it comes (the observe filter's layout).
    pub first_byte_after_end: Option<Duration>,
}

impl Setup {
    /// Replica `i`'s latency model and KV blocks.
    pub fn engine(&self, i: usize) -> (LatencyModel, usize) {
        let (speed, blocks) = self.mixed.get(i % self.mixed.len().max(1)).copied().unwrap_or((1.0, self.kv_blocks));
        (timescale::latency(self.time_scale * speed), blocks)
    }

    /// Seconds to load one token's KV from host memory: an 8B model's KV
    /// bytes over the host link, as the simulator and `cost_model` take them.
    pub fn host_token_secs(&self) -> f64 {
        KV_BYTES_PER_TOKEN as f64 / (OFFLOAD_GBS * 1e9) * self.time_scale
    }

    /// Replica `i`'s role.
    pub fn role(&self, i: usize) -> Role {
        match self.prefill_replicas {
            0 => Role::Both,
            p if i < p => Role::Prefill,
            _ => Role::Decode,
        }
    }
}

/// The router's configuration for one model routed by `policy` over `setup`.
pub fn config(setup: &Setup, policy: PolicyKind) -> Config {
    let mut config = Config::default();
    config.routing.seed = setup.seed;
    config.routing.policies = timescale::params(setup.time_scale);
    config.kv.block_size = setup.block_size;
    config.kv.blocks = setup.kv_blocks;
    config.models = vec![Model {
        name: setup.model.clone(),
        policy,
        tokenizer: Some("builtin:sim".into()),
        policies: setup.policies.clone(),
        max_loras: (setup.max_loras > 0).then_some(setup.max_loras as u32),
        ..Model::default()
    }];
    config
}
