//! What replicas serve and where they come from: replicas listed by
//! address, DNS groups and InferencePools, each with its models, limits,
//! cache shape and role in disaggregated serving.

use inferrail_policy::Prefill;
use serde::{Deserialize, Serialize};

use super::ReplicaKvEvents;

/// A replica's limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most requests in flight.
    pub max_concurrency: u32,
    /// Most requests waiting for their first byte.
    pub max_pending: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Self { max_concurrency: 256, max_pending: 256 }
    }
}

/// A replica's part in disaggregated prefill and decode (its engine's
/// NixlConnector `kv_role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Whole requests, and either leg of a disaggregated one.
    #[default]
    Both,
    /// Only prefill legs: it computes prompts for decoders to read.
    Prefill,
    /// Whole requests and decode legs, never a prefill leg.
    Decode,
}

impl Role {
    /// It may compute a prefill leg.
    pub fn prefills(self) -> bool {
        self != Role::Decode
    }

    /// It may serve a whole request or a decode leg.
    pub fn decodes(self) -> bool {
        self != Role::Prefill
    }

    /// Its name in the YAML and in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// What a replica serves and takes (for a DNS group or a pool, each of
/// its members): its models, limits and cache shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Serving {
    /// Models it serves.
    pub models: Vec<String>,
    /// Most requests in flight.
    pub max_concurrency: u32,
    /// Most requests waiting for their first byte.
    pub max_pending: u32,
    /// Tokens per KV block; learned from the engine's metrics when unset.
    pub block_size: Option<usize>,
    /// KV blocks it holds; learned from the engine's metrics when unset.
    pub kv_blocks: Option<usize>,
    /// KV blocks its engine offloads to host memory (vLLM's
    /// `--kv-offloading-size` over the KV bytes of a block, ADR 0059): its
    /// view of that tier in approximate mode, and the tier's size in exact
    /// mode. Unset: no tier in approximate mode; in exact mode its events
    /// show it and its size is the most it held.
    pub host_kv_blocks: Option<usize>,
    /// Its engine's prefill cost, as `inferrail-calibrate` fits it, for a
    /// fleet whose engines differ; unset, its model's `policies.prefill`.
    pub prefill: Option<Prefill>,
    /// Its role in disaggregated serving.
    pub role: Role,
}

impl Default for Serving {
    fn default() -> Self {
        let l = Limits::default();
        Self {
            models: Vec::new(),
            max_concurrency: l.max_concurrency,
            max_pending: l.max_pending,
            block_size: None,
            kv_blocks: None,
            host_kv_blocks: None,
            prefill: None,
            role: Role::Both,
        }
    }
}

impl Serving {
    /// Its limits.
    pub fn limits(&self) -> Limits {
        Limits { max_concurrency: self.max_concurrency, max_pending: self.max_pending }
    }

    /// Its cache shape as configured.
    pub fn cache(&self) -> CacheShape {
        CacheShape { block_size: self.block_size, blocks: self.kv_blocks, host_blocks: self.host_kv_blocks }
    }
}

/// A replica listed by address.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Replica {
    /// Unique name, used in metrics and response headers.
    pub id: String,
    /// `ip:port`, exactly as Envoy's cluster lists it.
    pub address: String,
    /// Its models, limits and cache shape.
    #[serde(flatten)]
    pub serving: Serving,
    /// Its KV events, when not from the `kv_events` template.
    pub kv_events: Option<ReplicaKvEvents>,
    /// Draining: it finishes its requests and is offered no new one.
    pub drain: bool,
}

/// A replica's KV cache shape as configured; what is unset is learned from its engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheShape {
    /// Tokens per block.
    pub block_size: Option<usize>,
    /// Blocks.
    pub blocks: Option<usize>,
    /// Blocks in host memory (never learned).
    pub host_blocks: Option<usize>,
}

/// Replicas found by resolving a DNS name; members are named `<group>-<ip>-<port>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DnsGroup {
    /// Group name, the prefix of member ids.
    pub group: String,
    /// Name to resolve (A and AAAA).
    pub host: String,
    /// Port of every member.
    pub port: u16,
    /// Time between lookups, milliseconds.
    pub interval_ms: u64,
    /// The DNS server to ask (`ip:port`, over UDP, then TCP for a
    /// truncated answer) instead of the system's (`/etc/resolv.conf`).
    pub nameserver: Option<std::net::SocketAddr>,
    /// Every member's models, limits and cache shape.
    #[serde(flatten)]
    pub serving: Serving,
}

impl Default for DnsGroup {
    fn default() -> Self {
        Self { group: String::new(), host: String::new(), port: 8000, interval_ms: 5_000, nameserver: None, serving: Serving::default() }
    }
}

/// The ready pods an InferencePool (`inference.networking.k8s.io/v1`)
/// selects, read and watched from the API server; each pod is a replica
/// named after it, on the pool's first target port. A pod annotated
/// `inferrail.io/kv-events` (and `inferrail.io/kv-events-replay`) has its
/// KV events there, `{host}` standing for its IP; the others follow the
/// `kv_events` template.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct KubernetesPool {
    /// The InferencePool's name.
    pub pool: String,
    /// Its namespace; unset: the one the router runs in (or the kubeconfig's).
    pub namespace: Option<String>,
    /// Every pod's models, limits and cache shape.
    #[serde(flatten)]
    pub serving: Serving,
}
