//! `gie_default`: a stand-in for the Gateway API Inference Extension's
//! endpoint picker as it ships by default (kubernetes-sigs/
//! gateway-api-inference-extension: the default `EndpointPickerConfig`
//! with `queue-scorer` weight 2, `kv-cache-utilization-scorer` weight 2 and
//! `prefix-cache-scorer` weight 3, and a max-score picker), so that it runs
//! on the same traffic as the others.
//!
//! Each scorer gives every offered endpoint a value in 0..1, higher better;
//! the weighted sum ranks them, highest wins (negated into a cost here; the
//! picker breaks ties at random, here fewer requests in flight go first):
//! - queue: `(max - q) / (max - min)` over the offered endpoints' waiting
//!   requests `q` (the engine's `waiting` while its report is fresh, else the
//!   router's `pending`, a fallback the picker does not have), 1 for all
//!   when they are equal;
//! - KV cache: `1 - kv_usage` from the engine's report (usage 0 without a
//!   fresh one, where the picker would have no metrics for the endpoint);
//! - prefix: the share of the request's block hashes that the endpoint
//!   holds, counted as the picker's `matchLongestPrefix` does: hashes are
//!   taken in order until one no endpoint holds, and each endpoint counts the
//!   ones it holds among those.
//!
//! - LoRA affinity, for a request that names an adapter
//!   (`lora-affinity-scorer`): 1 where the adapter runs, 0.8 where a slot
//!   is free for it (`max_loras` unknown counts as free), else 0. The
//!   picker's 0.6 for an adapter only waiting there has no counterpart: the
//!   router counts adapters by their requests in flight.
//!
//! The prefix scorer hashes [`crate::Request::text`] as
//! [`TextKind::Serialized`] (the messages as JSON, or the prompt): blocks of
//! `block_size` bytes (a last partial block is ignored), at most
//! `max_prefix_blocks` of them, each hash chained on the previous one (the
//! first seeded with a constant where the picker uses the model name, one
//! instance here serving one model). Its index remembers, per endpoint, the
//! last `lru_capacity_per_server` block hashes sent there; the winner's are
//! added after a committed decision ([`RoutingPolicy::picked`]), as the
//! picker's `PreRequest` does.
//!
//! Defaults, the picker's (`prefix` plugin: `DefaultBlockSize` 64,
//! `DefaultMaxPrefixBlocks` 256, `DefaultLRUCapacityPerServer` 31250; the
//! default plugins config's weights 2/2/3). The hash is std's SipHash rather
//! than xxhash, which changes nothing but the values.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hasher};
use std::num::NonZeroUsize;
use std::sync::Mutex;

use lru::LruCache;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

use crate::{AdapterFit, Candidate, Request, RoutingPolicy, Score, TextKind};

/// `gie_default` parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Config {
    /// Weight of the queue scorer.
    pub queue_weight: f64,
    /// Weight of the KV cache utilization scorer.
    pub kv_weight: f64,
    /// Weight of the prefix cache scorer.
    pub prefix_weight: f64,
    /// Weight of the LoRA affinity scorer (GIE's own scheduler tests weight
    /// it 1; KServe's LLMInferenceService adds it at 4 for adapters).
    pub lora_weight: f64,
    /// Bytes of text per hashed block.
    pub block_size: usize,
    /// Most blocks hashed per request.
    pub max_prefix_blocks: usize,
    /// Block hashes remembered per endpoint.
    pub lru_capacity_per_server: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            queue_weight: 2.0,
            kv_weight: 2.0,
            prefix_weight: 3.0,
            lora_weight: 1.0,
            block_size: 64,
            max_prefix_blocks: 256,
            lru_capacity_per_server: 31250,
        }
    }
}

impl Config {
    pub(crate) fn validate(&self, at: &str, p: &mut Vec<String>) {
        let weights = [
            ("queue_weight", self.queue_weight),
            ("kv_weight", self.kv_weight),
            ("prefix_weight", self.prefix_weight),
            ("lora_weight", self.lora_weight),
        ];
        for (name, v) in weights {
            if !(v.is_finite() && v >= 0.0) {
                p.push(format!("{at}.{name}: {v} is not a non-negative number"));
            }
        }
        for (name, v) in [
            ("block_size", self.block_size),
            ("max_prefix_blocks", self.max_prefix_blocks),
            ("lru_capacity_per_server", self.lru_capacity_per_server),
        ] {
            if v == 0 {
                p.push(format!("{at}.{name}: must be at least 1"));
            }
        }
    }
}

/// See the module doc.
#[derive(Debug)]
pub struct GieDefault {
    config: Config,
    /// Per endpoint key, the block hashes last sent there.
    index: Mutex<HashMap<u64, LruCache<u64, ()>>>,
}

impl GieDefault {
    /// With its parameters.
    pub fn new(config: Config) -> Self {
        Self { config, index: Mutex::new(HashMap::new()) }
    }

    /// The text's chained block hashes.
    fn hashes(&self, text: Option<&str>) -> Vec<u64> {
        let Some(text) = text else { return Vec::new() };
        let bs = self.config.block_size.max(1);
        let bytes = text.as_bytes();
        let bytes = &bytes[..bytes.len().min(bs.saturating_mul(self.config.max_prefix_blocks))];
        let mut prev = 0x6769_655f_6465_6661_u64;
        bytes
            .chunks_exact(bs)
            .map(|block| {
                let mut h = DefaultHasher::new();
                h.write(block);
                h.write_u64(prev);
                prev = h.finish();
                prev
            })
            .collect()
    }
}

impl RoutingPolicy for GieDefault {
    fn name(&self) -> &'static str {
        "gie_default"
    }

    fn terms(&self) -> &'static [&'static str] {
        &["queue", "kv", "prefix"]
    }

    fn wants_text(&self) -> TextKind {
        TextKind::Serialized
    }

    fn score(&self, req: &Request, c: &[Candidate], offered: &[usize], _rng: &mut StdRng, out: &mut [Score]) -> Option<&'static str> {
        let hashes = self.hashes(req.text);
        let mut matched = vec![0usize; offered.len()];
        {
            let index = self.index.lock().unwrap_or_else(|e| e.into_inner());
            for h in &hashes {
                let mut any = false;
                for (m, &i) in matched.iter_mut().zip(offered) {
                    if index.get(&c[i].key).is_some_and(|l| l.contains(h)) {
                        *m += 1;
                        any = true;
                    }
                }
                // The picker stops at a block no endpoint it knows holds (any endpoint, offered or not).
                if !any && !index.values().any(|l| l.contains(h)) {
                    break;
                }
            }
        }
        let waiting = |x: &Candidate| f64::from(x.engine.map_or(x.pending, |e| e.waiting));
        let min = offered.iter().map(|&i| waiting(&c[i])).fold(f64::INFINITY, f64::min);
        let max = offered.iter().map(|&i| waiting(&c[i])).fold(f64::NEG_INFINITY, f64::max);
        let cfg = &self.config;
        for ((s, &i), m) in out.iter_mut().zip(offered).zip(matched) {
            let queue = if max > min { (max - waiting(&c[i])) / (max - min) } else { 1.0 };
            let kv = 1.0 - c[i].engine.map_or(0.0, |e| e.kv_usage.clamp(0.0, 1.0));
            let prefix = if hashes.is_empty() { 0.0 } else { m as f64 / hashes.len() as f64 };
            let lora = c[i].adapter.map_or(0.0, lora_affinity);
            let terms =
                [-cfg.queue_weight * queue, -cfg.kv_weight * kv, -cfg.prefix_weight * prefix, 0.0, 0.0, 0.0, -cfg.lora_weight * lora, 0.0];
            *s = Score { total: terms.iter().sum(), terms };
        }
        None
    }

    fn picked(&self, req: &Request, c: &[Candidate], winner: usize) {
        let hashes = self.hashes(req.text);
        if hashes.is_empty() {
            return;
        }
        let cap = NonZeroUsize::new(self.config.lru_capacity_per_server).unwrap_or(NonZeroUsize::MIN);
        let mut index = self.index.lock().unwrap_or_else(|e| e.into_inner());
        let lru = index.entry(c[winner].key).or_insert_with(|| LruCache::new(cap));
        for h in hashes {
            lru.put(h, ());
        }
    }
}

/// The LoRA affinity scorer's value for a replica where the adapter stands as `fit`.
fn lora_affinity(fit: AdapterFit) -> f64 {
    if fit.resident {
        1.0
    } else if fit.max_loras.is_none_or(|m| fit.others < m) {
        0.8
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{fleet, rng};
    use crate::{EngineReport, decide};

    fn scores(p: &GieDefault, req: &Request, c: &[Candidate]) -> Vec<Score> {
        let offered: Vec<usize> = (0..c.len()).collect();
        let mut out = vec![Score::default(); c.len()];
        p.score(req, c, &offered, &mut rng(0), &mut out);
        out
    }

    #[test]
    fn lora_affinity_scores_as_the_pickers_scorer() {
        let p = GieDefault::new(Config::default());
        let req = Request::default();
        let fit = |resident, others| Some(AdapterFit { resident, others, max_loras: Some(2) });
        let mut c = fleet(&[0, 0, 0]);
        (c[0].adapter, c[1].adapter, c[2].adapter) = (fit(false, 2), fit(false, 1), fit(true, 1));
        let lora: Vec<f64> = scores(&p, &req, &c).iter().map(|s| s.terms[6]).collect();
        assert_eq!(lora, [-0.0, -0.8, -1.0], "full, a free slot, running there");
        assert_eq!(decide(&p, &req, &c, &mut rng(1)).unwrap()[0], 2);
    }

    #[test]
    fn the_weighted_sum_of_queue_kv_and_prefix() {
        let p = GieDefault::new(Config::default());
        let mut c = fleet(&[0, 0, 0]);
        c[0].engine = Some(EngineReport { running: 3, waiting: 4, deferred: 0, kv_usage: 0.5 });
        c[1].pending = 2; // no report: pending counts, KV usage 0
        c[2].engine = Some(EngineReport { running: 1, waiting: 0, deferred: 0, kv_usage: 0.9 });
        let s = scores(&p, &Request::default(), &c);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        // queue: (4-4)/4 = 0, (4-2)/4 = 0.5, 1; kv: 0.5, 1, 0.1.
        assert!(close(s[0].total, -(2.0 * 0.0 + 2.0 * 0.5)), "{s:?}");
        assert!(close(s[1].total, -(2.0 * 0.5 + 2.0 * 1.0)), "{s:?}");
        assert!(close(s[2].total, -(2.0 * 1.0 + 2.0 * 0.1)), "{s:?}");
        assert_eq!(decide(&p, &Request::default(), &c, &mut rng(0)).unwrap(), [1, 2, 0]);
        // Equal queues all score 1.
        let s = scores(&p, &Request::default(), &fleet(&[3, 5]));
        assert!(s.iter().all(|x| close(x.terms[0], -2.0) && close(x.total, -4.0)), "{s:?}");
    }

    #[test]
    fn the_prefix_index_learns_from_picked() {
        let p = GieDefault::new(Config::default());
        let c = fleet(&[0, 0, 0]);
        let system = "x".repeat(64 * 3);
        let first = format!("{system}{}", "a".repeat(64));
        let req = Request { text: Some(&first), ..Request::default() };
        assert!(scores(&p, &req, &c).iter().all(|s| s.terms[2] == 0.0), "nothing learned yet");
        p.picked(&req, &c, 1);
        // 4 blocks sent to 1: the same text matches all 4 there; one sharing 3 of 5 blocks matches 3/5.
        assert_eq!(scores(&p, &req, &c)[1].terms[2], -3.0);
        let second = format!("{system}{}", "b".repeat(130));
        let next = Request { text: Some(&second), ..Request::default() };
        let s = scores(&p, &next, &c);
        assert!((s[1].terms[2] + 3.0 * 3.0 / 5.0).abs() < 1e-9 && s[0].terms[2] == 0.0, "{s:?}");
        assert_eq!(decide(&p, &next, &c, &mut rng(0)).unwrap()[0], 1);
        // Shorter than a block: no prefix score.
        assert!(p.hashes(Some("short")).is_empty());
        assert_eq!(p.hashes(Some(&"y".repeat(64 * 300))).len(), 256);
        // A capacity of 2 blocks forgets the oldest.
        let small = GieDefault::new(Config { lru_capacity_per_server: 2, ..Config::default() });
        small.picked(&req, &c, 0);
        assert_eq!(scores(&small, &req, &c)[0].terms[2], 0.0, "the first blocks were evicted, so the walk stops at once");
    }
}
