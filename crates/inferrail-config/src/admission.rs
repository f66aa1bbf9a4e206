//! `admission`: priority bands, tenants, API keys and token limits (ADR
//! 0042). Without bands every request is forwarded at once, as before;
//! with them, requests wait at the router while the fleet is busy, by band
//! and fairly across tenants, and are shed when they cannot be served in
//! time. Keys and limits apply whether or not bands are set.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

/// The longest a band may let a request wait: a second under the
/// `max_message_timeout` (300 s) of the shipped Envoy filters, which a
/// queued request asks Envoy to wait for its answer.
pub const MAX_WAIT_MS: u64 = 299_000;

/// Admission control. A request names its band in `x-inferrail-band` (or
/// an `InferenceObjective` in `x-gateway-inference-objective`), its tenant
/// in `x-inferrail-tenant` when it presents no key, and its key in
/// `Authorization: Bearer`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Admission {
    /// Priority bands, most urgent first. None: nothing waits.
    pub bands: Vec<Band>,
    /// The band of a request that names none and whose model and key name
    /// none; the last band when unset.
    pub default_band: Option<String>,
    /// Most requests waiting per model; an arrival beyond it pushes out
    /// the request that would go last, or is shed itself (503).
    pub max_queued_requests: usize,
    /// Most prompt tokens waiting per model.
    pub max_queued_tokens: u64,
    /// Refuse requests without a valid key (401).
    pub require_keys: bool,
    /// API keys, by their SHA-256 digests.
    pub keys: Vec<ApiKey>,
    /// Tenants' weights and token limits; a tenant not listed has weight 1 and no limit.
    pub tenants: Vec<Tenant>,
}

impl Default for Admission {
    fn default() -> Self {
        Self {
            bands: Vec::new(),
            default_band: None,
            max_queued_requests: 1024,
            max_queued_tokens: 8 << 20,
            require_keys: false,
            keys: Vec::new(),
            tenants: Vec::new(),
        }
    }
}

/// A priority band.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Band {
    /// Its name, as clients and keys give it.
    pub name: String,
    /// Its objective for the time to first token: a request is held while
    /// the best replica's estimate is above it. None: held only while
    /// every replica is at its limits.
    pub ttft_objective_ms: Option<u64>,
    /// What a request whose best estimate misses the objective does: wait
    /// for it, or be shed at once (503).
    pub on_miss: OnMiss,
    /// How long a request may wait before it is shed (503).
    pub max_wait_ms: u64,
    /// Inference Extension `InferenceObjective` names that mean this band
    /// (the `x-gateway-inference-objective` header).
    pub objectives: Vec<String>,
    /// Inference Extension `InferenceObjective`s of the pool whose
    /// `priority` (unset: 0) is at least this mean this band, the first
    /// such band in order, unless a band's `objectives` names them
    /// (watched when `kubernetes` names the pool).
    pub min_priority: Option<i64>,
    /// The part of each model's replicas its requests may go to: the first
    /// `replica_share` of them by id (at least one), among those healthy,
    /// not draining and offered. Below 1 the rest are kept for more urgent
    /// bands, whose requests then never share an engine step with this
    /// band's (ADR 0042).
    pub replica_share: f64,
}

impl Default for Band {
    fn default() -> Self {
        Self {
            name: String::new(),
            ttft_objective_ms: None,
            on_miss: OnMiss::Wait,
            max_wait_ms: 30_000,
            objectives: Vec::new(),
            min_priority: None,
            replica_share: 1.0,
        }
    }
}

/// What a request whose best estimate misses its band's objective does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnMiss {
    /// Wait until it can meet it (or its wait runs out).
    #[default]
    Wait,
    /// Be shed at once.
    Shed,
}

/// An API key.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct ApiKey {
    /// The key's SHA-256 digest, 64 hex digits (`printf %s "$KEY" | sha256sum`).
    pub sha256: String,
    /// The tenant it stands for.
    pub tenant: String,
    /// The bands it may use; all when empty. The first is its default.
    pub bands: Vec<String>,
}

/// A tenant's share and limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Tenant {
    /// Its name.
    pub name: String,
    /// Its share of a band while several tenants wait (relative).
    pub weight: f64,
    /// Token limits over sliding windows: prompt tokens at admission, output tokens as the usage reports them.
    pub limits: Vec<TokenLimit>,
}

impl Default for Tenant {
    fn default() -> Self {
        Self { name: String::new(), weight: 1.0, limits: Vec::new() }
    }
}

/// At most `tokens` tokens in any `window_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct TokenLimit {
    /// Tokens.
    pub tokens: u64,
    /// The window, in milliseconds.
    pub window_ms: u64,
}

impl Admission {
    /// The index of band `name`.
    pub fn band(&self, name: &str) -> Option<usize> {
        self.bands.iter().position(|b| b.name == name)
    }

    /// Problems with the section, each with its path; `models` are the
    /// models' default bands, by model name.
    pub fn validate<'a>(&self, models: impl Iterator<Item = (&'a str, Option<&'a str>)>) -> Vec<String> {
        let mut p = Vec::new();
        let mut names = HashSet::new();
        for (i, b) in self.bands.iter().enumerate() {
            if b.name.is_empty() || !names.insert(b.name.as_str()) {
                p.push(format!("admission.bands[{i}].name: missing or used twice"));
            }
            if b.max_wait_ms == 0 || b.ttft_objective_ms == Some(0) {
                p.push(format!("admission.bands[{i}]: max_wait_ms and ttft_objective_ms must be at least 1"));
            }
            if b.max_wait_ms > MAX_WAIT_MS {
                p.push(format!(
                    "admission.bands[{i}].max_wait_ms: {} is past {MAX_WAIT_MS}: the shipped Envoy filters let a decision take at most 300 s (max_message_timeout)",
                    b.max_wait_ms
                ));
            }
            if !(b.replica_share > 0.0 && b.replica_share <= 1.0) {
                p.push(format!("admission.bands[{i}].replica_share: {} is not in (0, 1]", b.replica_share));
            }
        }
        let known = |name: &str| self.bands.is_empty() || names.contains(name);
        if let Some(d) = &self.default_band
            && !known(d)
        {
            p.push(format!("admission.default_band: no band {d:?}"));
        }
        for (model, band) in models {
            if let Some(b) = band.filter(|b| !known(b)) {
                p.push(format!("models[{model}].band: no band {b:?}"));
            }
        }
        if self.max_queued_requests == 0 || self.max_queued_tokens == 0 {
            p.push("admission: max_queued_requests and max_queued_tokens must be at least 1".into());
        }
        let mut digests = HashSet::new();
        for (i, k) in self.keys.iter().enumerate() {
            let hex = k.sha256.len() == 64 && k.sha256.chars().all(|c| c.is_ascii_hexdigit());
            if !hex {
                p.push(format!("admission.keys[{i}].sha256: not 64 hex digits (the key's SHA-256 digest, never the key)"));
            } else if !digests.insert(k.sha256.to_ascii_lowercase()) {
                p.push(format!("admission.keys[{i}].sha256: listed twice"));
            }
            if k.tenant.is_empty() {
                p.push(format!("admission.keys[{i}].tenant: missing"));
            }
            for b in k.bands.iter().filter(|b| !known(b)) {
                p.push(format!("admission.keys[{i}].bands: no band {b:?}"));
            }
        }
        if self.require_keys && self.keys.is_empty() {
            p.push("admission.require_keys: no keys are listed".into());
        }
        let mut tenants = HashSet::new();
        for (i, t) in self.tenants.iter().enumerate() {
            if t.name.is_empty() || !tenants.insert(t.name.as_str()) {
                p.push(format!("admission.tenants[{i}].name: missing or used twice"));
            }
            if !(t.weight.is_finite() && t.weight > 0.0) {
                p.push(format!("admission.tenants[{i}].weight: {} is not a positive number", t.weight));
            }
            if t.limits.iter().any(|l| l.tokens == 0 || l.window_ms == 0) {
                p.push(format!("admission.tenants[{i}].limits: tokens and window_ms must be at least 1"));
            }
        }
        p
    }
}
