//! `dynamo_kv`: a stand-in for NVIDIA Dynamo's KV router and its default
//! cost function (ai-dynamo/dynamo, `DefaultWorkerSelector` in the KV
//! router's scheduler, `lib/llm/src/kv_router/scheduler.rs`, later
//! `lib/kv-router`), so that it runs on the same traffic as the others.
//!
//! Dynamo prices each worker as `logit = overlap_score_weight *
//! prefill_blocks + decode_blocks` (lower wins): `prefill_blocks` are the
//! prefill tokens the worker would have if the request went there (its
//! queued prefill plus the prompt's uncached tokens) over the block size,
//! and `decode_blocks` the KV blocks it would hold (its active blocks plus
//! this request's blocks it does not hold). With `router_temperature` 0 the
//! lowest wins (Dynamo breaks ties uniformly at random; here, as for every
//! policy, ties go to fewer requests in flight first); above 0 the winner is sampled from
//! `softmax(-normalized / T)`, costs normalized to 0..1 by min and max
//! (uniform when all are equal).
//!
//! The mapping from what the router knows of a replica ([`Candidate`]):
//! - uncached = prompt tokens - `cached_tokens` (the KV index's
//!   prediction), less `host_hit_weight` times the offloaded tokens in host
//!   memory and `disk_hit_weight` times those on disk: Dynamo's fixed
//!   weights for hits in lower tiers, against a GPU hit's 1;
//! - queued prefill tokens = `prompt_tokens_in_flight * pending /
//!   max(in_flight, 1)`, the pending share of its prompt tokens in flight;
//! - active blocks = `prompt_tokens_in_flight / block_size`;
//! - new blocks = uncached / block_size;
//!
//! so `cost = w * (queued + uncached) / bs + (prompt_tokens_in_flight +
//! uncached) / bs`, divisions in real numbers, `bs` the request's block size
//! (16, vLLM's, when it has none). Without a prompt the prompt terms are 0.
//! Where this differs from Dynamo: queued prefill counts the pending
//! requests' whole prompts (Dynamo counts only their uncached tokens, so a
//! replica whose queue is mostly cached looks busier here), active blocks
//! leave out generated tokens (Dynamo's grow with the output), and one block
//! size serves all replicas.
//! A sampled winner scores -1 (below every cost) and the others their cost,
//! so `order` keeps it first.
//!
//! Defaults, Dynamo's (`KvRouterConfig`, `--router-kv-overlap-score-weight`,
//! `--router-temperature`): `overlap_score_weight` 1.0,
//! `router_temperature` 0.0; and its tier weights, `host_hit_weight` 0.75,
//! `disk_hit_weight` 0.25.

use rand::Rng;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

use crate::{Candidate, Request, RoutingPolicy, Score};

/// Block size when the request names none (vLLM's default).
const DEFAULT_BLOCK_SIZE: usize = 16;

/// `dynamo_kv` parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Config {
    /// Weight of the prefill blocks against the decode blocks.
    pub overlap_score_weight: f64,
    /// Softmax temperature over normalized costs (0: the lowest wins).
    pub router_temperature: f64,
    /// What an offloaded token in host memory saves, in GPU hits.
    pub host_hit_weight: f64,
    /// What an offloaded token on disk saves, in GPU hits.
    pub disk_hit_weight: f64,
}

impl Default for Config {
    fn default() -> Self {
        Self { overlap_score_weight: 1.0, router_temperature: 0.0, host_hit_weight: 0.75, disk_hit_weight: 0.25 }
    }
}

impl Config {
    pub(crate) fn validate(&self, at: &str, p: &mut Vec<String>) {
        let values = [
            ("overlap_score_weight", self.overlap_score_weight),
            ("router_temperature", self.router_temperature),
            ("host_hit_weight", self.host_hit_weight),
            ("disk_hit_weight", self.disk_hit_weight),
        ];
        for (name, v) in values {
            if !(v.is_finite() && v >= 0.0) {
                p.push(format!("{at}.{name}: {v} is not a non-negative number"));
            }
        }
    }
}

/// See the module doc.
#[derive(Debug)]
pub struct DynamoKv {
    config: Config,
}

impl DynamoKv {
    /// With its parameters.
    pub fn new(config: Config) -> Self {
        Self { config }
    }

    /// (weighted prefill blocks, decode blocks) for one candidate.
    fn cost(&self, req: &Request, c: &Candidate) -> (f64, f64) {
        let bs = if req.block_size > 0 { req.block_size } else { DEFAULT_BLOCK_SIZE } as f64;
        let prompt = req.prompt_tokens.unwrap_or(0);
        let o = c.offloaded;
        let tiers = self.config.host_hit_weight * o.host as f64 + self.config.disk_hit_weight * o.disk as f64;
        let uncached = (prompt.saturating_sub(c.cached_tokens) as f64 - tiers).max(0.0);
        let in_flight_tokens = c.prompt_tokens_in_flight as f64;
        let queued = in_flight_tokens * f64::from(c.pending) / f64::from(c.in_flight.max(1));
        let prefill = (queued + uncached) / bs;
        let decode = (in_flight_tokens + uncached) / bs;
        (self.config.overlap_score_weight * prefill, decode)
    }
}

impl RoutingPolicy for DynamoKv {
    fn name(&self) -> &'static str {
        "dynamo_kv"
    }

    fn terms(&self) -> &'static [&'static str] {
        &["prefill", "decode"]
    }

    fn score(&self, req: &Request, c: &[Candidate], offered: &[usize], rng: &mut StdRng, out: &mut [Score]) -> Option<&'static str> {
        for (s, &i) in out.iter_mut().zip(offered) {
            let (prefill, decode) = self.cost(req, &c[i]);
            *s = Score { total: prefill + decode, terms: [prefill, decode, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0] };
        }
        let t = self.config.router_temperature;
        if t <= 0.0 {
            return None;
        }
        let min = out.iter().map(|s| s.total).fold(f64::INFINITY, f64::min);
        let max = out.iter().map(|s| s.total).fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = out.iter().map(|s| if max > min { (-(s.total - min) / (max - min) / t).exp() } else { 1.0 }).collect();
        let mut u = rng.random::<f64>() * weights.iter().sum::<f64>();
        let mut pick = weights.len() - 1;
        for (k, w) in weights.iter().enumerate() {
            if u < *w {
                pick = k;
                break;
            }
            u -= w;
        }
        out[pick].total = -1.0;
        Some("sampled")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide;
    use crate::testing::{fleet, rng};

    #[test]
    fn the_worked_cost_and_cache_lowers_it() {
        let p = DynamoKv::new(Config::default());
        let req = Request { prompt_tokens: Some(320), block_size: 16, ..Request::default() };
        let mut c = fleet(&[4, 0]);
        // 4 in flight, 2 pending, 640 prompt tokens: 320 queued, 40 active blocks.
        c[0].pending = 2;
        c[0].prompt_tokens_in_flight = 640;
        c[0].cached_tokens = 160;
        let (prefill, decode) = p.cost(&req, &c[0]);
        // prefill = (320 + 160) / 16 = 30; decode = 40 + 160 / 16 = 50.
        assert_eq!((prefill, decode), (30.0, 50.0));
        // Idle and uncached: 20 + 20 = 40 < 80.
        assert_eq!(p.cost(&req, &c[1]), (20.0, 20.0));
        assert_eq!(decide(&p, &req, &c, &mut rng(0)).unwrap(), [1, 0]);
        // Holding the whole prompt: 20 + 40 = 60, still above 40; with
        // nothing in flight, cache wins: 0 < 40.
        c[0].cached_tokens = 320;
        assert_eq!(p.cost(&req, &c[0]), (20.0, 40.0));
        c[0].prompt_tokens_in_flight = 0;
        assert_eq!(decide(&p, &req, &c, &mut rng(0)).unwrap()[0], 0);
        // The weight scales the prefill part only.
        let heavy = DynamoKv::new(Config { overlap_score_weight: 2.0, ..Config::default() });
        assert_eq!(heavy.cost(&req, &c[1]), (40.0, 20.0));
        // Without a prompt, only the replica's own load counts.
        c[1].prompt_tokens_in_flight = 16;
        assert_eq!(p.cost(&Request::default(), &c[1]), (0.0, 1.0));
        // Offloaded hits count at the fixed tier weights: 160 in host memory
        // save 120 tokens (0.75), 64 on disk 16 (0.25): (320 - 136) / 16 = 11.5.
        c[1].prompt_tokens_in_flight = 0;
        c[1].offloaded = crate::Offloaded { host: 160, disk: 64 };
        assert_eq!(p.cost(&req, &c[1]), (11.5, 11.5));
    }

    #[test]
    fn temperature_spreads_the_choices_and_zero_takes_the_lowest() {
        let req = Request { prompt_tokens: Some(160), block_size: 16, ..Request::default() };
        let mut c = fleet(&[1, 1, 1]);
        for (x, t) in c.iter_mut().zip([0, 32, 64]) {
            x.prompt_tokens_in_flight = t;
        }
        let mut r = rng(3);
        let cold = DynamoKv::new(Config::default());
        assert!((0..100).all(|_| decide(&cold, &req, &c, &mut r).unwrap()[0] == 0));
        let warm = DynamoKv::new(Config { router_temperature: 1.0, ..Config::default() });
        let mut wins = [0; 3];
        for _ in 0..600 {
            wins[decide(&warm, &req, &c, &mut r).unwrap()[0]] += 1;
        }
        assert!(wins[0] > wins[1] && wins[1] > wins[2] && wins[2] > 50, "{wins:?}");
    }
}
