//! What one fleet simulation measured, and how its figures are drawn
//! from the simulated engines: hit rates, shares, the prefixes each
//! replica serves, and where the slowest first tokens spent their time.

use std::cmp::Reverse;
use std::collections::HashMap;

use serde::Serialize;

use crate::latency::Latency;

/// What one simulation measured.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    /// The policy.
    pub policy: String,
    /// Replicas.
    pub replicas: usize,
    /// Routers, and whether they were peers.
    pub routers: (usize, bool),
    /// The most requests one engine had at once (queued, prefilling or decoding).
    pub peak_in_flight: usize,
    /// Requests that arrived.
    pub requests: usize,
    /// Requests the router refused (every replica full).
    pub rejected: usize,
    /// Requests that generated their last token.
    pub completed: usize,
    /// On a disaggregated fleet, the replicas that prefill.
    pub prefill_replicas: usize,
    /// Requests split: prefilled on a prefill replica and read by a
    /// decoder (the rest ran whole, on a decoder when the fleet is split).
    pub split: usize,
    /// Requests an engine passed over at least once for want of a LoRA
    /// adapter slot.
    pub deferred: usize,
    /// Times an engine loaded an adapter into a slot.
    pub adapter_loads: u64,
    /// Prompt tokens the engines loaded from host memory (in `hit_rate`).
    #[serde(default)]
    pub host_tokens: u64,
    /// Leases the routers still held once every request had ended (each
    /// leg's, for a split request): zero unless a life was left unfinished.
    pub leases_at_end: u32,
    /// Cached prompt tokens over prompt tokens, every replica.
    pub hit_rate: f64,
    /// Lowest and highest hit rate of one replica (of those that served any).
    pub replica_hit_rate: (f64, f64),
    /// The busiest replica's share of requests.
    pub busiest_share: f64,
    /// The idlest replica's share of requests.
    pub idlest_share: f64,
    /// How many shared prefixes a replica serves: the mean over the replicas
    /// that served any, and the most on one (see `prefixes_served`).
    pub prefixes_per_replica: (f64, f64),
    /// Time to first token from arrival.
    pub ttft: Latency,
    /// Where the slowest 1% of first tokens spent their time.
    pub slowest: Phases,
    /// Share of requests whose predicted cached tokens were the engine's.
    pub prediction_exact: f64,
    /// Requests whose prediction was above the engine's cached tokens, and below.
    pub predicted_over_under: (usize, usize),
    /// Mean of |predicted - cached| tokens over the requests mispredicted.
    pub misprediction_tokens: f64,
    /// Times an engine preempted a decoding request for room (each to recompute).
    pub preemptions: u64,
    /// Virtual seconds from the first arrival to the last completion.
    pub virtual_s: f64,
    /// Wall seconds the simulation took.
    pub wall_s: f64,
}

/// Mean milliseconds a set of requests spent in each phase before their
/// first token: queued behind other requests (their prefills, or a head of
/// the queue waiting for room), at the head of the queue waiting for KV room
/// (a split request: on either replica), and in their own prefill (a split
/// request: its prefill leg, its queue on the decoder, its read and first
/// step). They add up to the mean time to first token.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Phases {
    /// Requests averaged.
    pub requests: usize,
    /// Queued behind other requests.
    pub queued_ms: f64,
    /// At the head of the queue until completions freed room for its blocks.
    pub kv_wait_ms: f64,
    /// Its own prefill.
    pub prefill_ms: f64,
}

/// The phases of the slowest `share` of requests (at least one), each given
/// as (queued, KV wait, prefill) nanoseconds.
pub fn slowest(mut phases: Vec<[u64; 3]>, share: f64) -> Phases {
    phases.sort_by_key(|p| Reverse(p.iter().sum::<u64>()));
    let n = ((phases.len() as f64 * share).ceil() as usize).min(phases.len());
    let mean = |k: usize| phases[..n].iter().map(|p| p[k] as f64).sum::<f64>() / n.max(1) as f64 * 1e-6;
    Phases { requests: n, queued_ms: mean(0), kv_wait_ms: mean(1), prefill_ms: mean(2) }
}

/// How many shared prefixes each replica serves, as (mean over the replicas
/// that served any, highest): a replica's count is the effective number of
/// root prefixes among its requests (the exponential of their entropy), 1
/// for a replica that serves one prefix, 2 for one that serves two equally
/// often, a little over 1 for one that served another prefix now and then.
/// Only roots asked for more than once in the fleet count. On a fleet whose
/// caches hold about one shared prompt each, a replica that serves two holds
/// both and has room for fewer requests.
pub fn prefixes_served<'a>(engines: impl Iterator<Item = &'a HashMap<u128, u64>> + Clone) -> (f64, f64) {
    let mut total: HashMap<u128, u64> = HashMap::new();
    for roots in engines.clone() {
        for (&root, &n) in roots {
            *total.entry(root).or_default() += n;
        }
    }
    let counts: Vec<f64> = engines
        .map(|roots| roots.iter().filter(|(r, _)| total.get(*r).is_some_and(|&t| t > 1)).map(|(_, &n)| n as f64).collect::<Vec<_>>())
        .filter(|n| !n.is_empty())
        .map(|mut n| {
            // In one order: a map's varies from run to run, and sums of floats with it.
            n.sort_by(f64::total_cmp);
            let sum: f64 = n.iter().sum();
            (-n.iter().map(|&x| x / sum * (x / sum).ln()).sum::<f64>()).exp()
        })
        .collect();
    if counts.is_empty() {
        return (0.0, 0.0);
    }
    (counts.iter().sum::<f64>() / counts.len() as f64, counts.iter().copied().fold(0.0, f64::max))
}

/// One line per simulation, for the terminal.
pub fn line(o: &Outcome) -> String {
    format!(
        "{:<20} {:>4} replicas{}, {} router(s){}: hit {:.1}% (replicas {:.1}-{:.1}%), busiest {:.1}%, shared prefixes per replica {:.2} (most {:.2}), TTFT p50 {:.0} p90 {:.0} p99 {:.0} ms (slowest 1%: queued {:.0}, KV wait {:.0}, prefill {:.0} ms), {} refused, predicted exactly {:.1}% ({} over, {} under, off by {:.0} tokens on average), {} preemptions, {} deferred, {} adapter loads, {} tokens from host memory, {:.1} virtual s in {:.2} s",
        o.policy,
        o.replicas,
        if o.prefill_replicas > 0 {
            format!(" ({} prefill, {} of {} split)", o.prefill_replicas, o.split, o.requests)
        } else {
            String::new()
        },
        o.routers.0,
        if o.routers.0 > 1 && !o.routers.1 { " without peers" } else { "" },
        o.hit_rate * 100.0,
        o.replica_hit_rate.0 * 100.0,
        o.replica_hit_rate.1 * 100.0,
        o.busiest_share * 100.0,
        o.prefixes_per_replica.0,
        o.prefixes_per_replica.1,
        o.ttft.p50_ms,
        o.ttft.p90_ms,
        o.ttft.p99_ms,
        o.slowest.queued_ms,
        o.slowest.kv_wait_ms,
        o.slowest.prefill_ms,
        o.rejected,
        o.prediction_exact * 100.0,
        o.predicted_over_under.0,
        o.predicted_over_under.1,
        o.misprediction_tokens,
        o.preemptions,
        o.deferred,
        o.adapter_loads,
        o.host_tokens,
        o.virtual_s,
        o.wall_s
    )
}
