//! Disaggregated prefill and decode: whether a request runs whole on its
//! decode replica or split across a prefill replica and it.
//!
//! A model some replica of which only prefills (`role: prefill`) is served
//! disaggregated. Its request is planned twice: once whole, over the
//! replicas that decode, whose winner `W` would run it whole; then for its
//! prefill leg, over the replicas that prefill, the decode replica set
//! aside, whose winner is `P`. A split request's decode replica `D` is the
//! replica the whole plan offered (past its guards) that takes a decode leg
//! soonest ([`decoder`]): the prefill queued there, its running requests'
//! decode interference, and the transfer of the blocks it lacks. It computes
//! no prefill, so the whole plan's reasons to spread prompts (their prefill
//! time, shares, hot prefixes) do not apply to it, and a replica holding the
//! prompt's prefix reads less and keeps more room. The two ways are priced
//! in the seconds of latency the request adds, its own and the others'
//! ([`price`]):
//! - whole on `W`: its time to first token there (the prefill queued there
//!   and its own), plus the stall its prefill puts on every request on that
//!   engine, decoding or reported waiting (each waits out the prefill's
//!   steps);
//! - split: its time to first token on `P`, the same stall on `P`, the
//!   transfer of the blocks `D` lacks
//!   (`kv_transfer.block_us` each), and `D`'s first step, slowed by the
//!   requests decoding there. The prefill queued on `D` is not counted: a
//!   decode leg computes nothing, and a continuously batching engine admits
//!   it beside the prefills ahead of it, not after them.
//!
//! `cost_model` splits only when that is cheaper: no token threshold, an
//! idle decode replica keeps a short prompt, a busy one hands a long one
//! off. A policy whose scores are not seconds splits whenever a prefill
//! replica can take the leg, as the peer routers' disaggregated modes do.

use inferrail_policy::{Candidate, Params, Prefill};

use crate::plan::Plan;

/// Why a request runs whole or split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// Split: cheaper than whole.
    Cheaper,
    /// Whole: split would cost more.
    Dearer,
    /// Split: the policy's scores are not times, and it always splits.
    Always,
    /// Whole: no prefill replica can take the leg now.
    NoPrefillReplica,
    /// Whole: the prompt was not tokenized, so nothing can be priced.
    Untokenized,
}

impl Why {
    /// A short label for metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            Why::Cheaper => "cheaper",
            Why::Dearer => "dearer",
            Why::Always => "always",
            Why::NoPrefillReplica => "no_prefill_replica",
            Why::Untokenized => "untokenized",
        }
    }

    /// Whether the request is split.
    pub fn split(self) -> bool {
        matches!(self, Why::Cheaper | Why::Always)
    }
}

/// The two ways priced, seconds.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Price {
    /// Whole on `D`: its time to first token there.
    pub whole_ttft: f64,
    /// Whole on `D`: the stall its prefill puts on `D`'s decoding requests.
    pub whole_stall: f64,
    /// Split: its time to first token on `P`.
    pub prefill_ttft: f64,
    /// Split: the stall on `P`'s decoding requests.
    pub prefill_stall: f64,
    /// Split: moving what `D` lacks.
    pub transfer: f64,
    /// Split: the blocks moved.
    pub transfer_blocks: usize,
    /// Split: `D`'s first step, slowed by the requests decoding there.
    pub decode_wait: f64,
}

impl Price {
    /// Whole, all told.
    pub fn whole(&self) -> f64 {
        self.whole_ttft + self.whole_stall
    }

    /// Split, all told.
    pub fn split(&self) -> f64 {
        self.prefill_ttft + self.prefill_stall + self.transfer + self.decode_wait
    }

    /// The split request's time to first token.
    pub fn split_ttft(&self) -> f64 {
        self.prefill_ttft + self.transfer + self.decode_wait
    }
}

/// A disaggregated model's second plan and the choice between the two.
/// Split, the whole plan's order starts with the decode replica.
#[derive(Debug)]
pub struct Pd {
    /// The prefill leg's plan (its order empty when no replica can take it).
    pub prefill: Plan,
    /// The two ways priced (zero when not priced).
    pub price: Price,
    /// The choice, and why.
    pub why: Why,
}

impl Pd {
    /// Whether the request is split.
    pub fn split(&self) -> bool {
        self.why.split()
    }
}

/// The blocks of the prompt candidate `i` of `plan` lacks, and its block size.
fn lacking(plan: &Plan, i: usize) -> (usize, usize) {
    let block_size = plan.replica(i).block_size(plan.block_size()).max(1);
    (plan.prompt_tokens().unwrap_or(0).div_ceil(block_size).saturating_sub(plan.candidates[i].cached_tokens / block_size), block_size)
}

/// A split request's decode replica: of the candidates `whole` offered
/// (past its guards), one with room for the blocks it would read (by its
/// engine's fresh report; a decoder without it waits, and the prefill
/// replica keeps the blocks meanwhile), and of those the one whose prefill
/// queued, decode interference and transfer are least, fewer requests in
/// flight on a tie. A policy whose scores are not times keeps its own winner.
pub fn decoder(whole: &Plan, params: &Params) -> usize {
    if whole.policy != "cost_model" {
        return whole.order[0];
    }
    let cost = |i: usize| {
        let c = &whole.candidates[i];
        let interference = params.cost_model.decode_interference_ms * 1e-3 * f64::from(c.running());
        c.queued_prefill_secs + interference + params.kv_transfer.secs(lacking(whole, i).0)
    };
    let cramped = |i: usize| {
        let (blocks, block_size) = lacking(whole, i);
        whole.candidates[i].free_kv_tokens().is_some_and(|free| free < (blocks * block_size) as u64)
    };
    let offered = (0..whole.candidates.len()).filter(|&i| whole.set_aside[i].is_none() && whole.scores[i].is_some());
    offered
        .min_by(|&a, &b| {
            cramped(a)
                .cmp(&cramped(b))
                .then(cost(a).total_cmp(&cost(b)))
                .then(whole.candidates[a].in_flight.cmp(&whole.candidates[b].in_flight))
        })
        .unwrap_or(whole.order[0])
}

/// Prices the request of `whole` (planned whole, its winner `W`) against
/// its prefill on `prefill`'s winner `P` and its decode on `whole`'s
/// candidate `decoder`.
pub fn price(whole: &Plan, decoder: usize, prefill: &Plan, params: &Params, model_prefill: Prefill) -> Price {
    let (w, d, p) = (&whole.candidates[whole.order[0]], &whole.candidates[decoder], &prefill.candidates[prefill.order[0]]);
    let prompt = whole.prompt_tokens();
    let (lacking, _) = lacking(whole, decoder);
    // Every request on the engine waits a prefill out: those decoding, and
    // those its engine reports waiting (for room, or behind it).
    let stalled = |c: &Candidate| f64::from(c.running() + c.engine.map_or(0, |e| e.waiting));
    Price {
        whole_ttft: w.ttft_secs(model_prefill, prompt, w.cached_tokens),
        whole_stall: w.prompt_prefill_secs(model_prefill, prompt, w.cached_tokens) * stalled(w),
        prefill_ttft: p.ttft_secs(model_prefill, prompt, p.cached_tokens),
        prefill_stall: p.prompt_prefill_secs(model_prefill, prompt, p.cached_tokens) * stalled(p),
        transfer: params.kv_transfer.secs(lacking),
        transfer_blocks: lacking,
        decode_wait: params.cost_model.decode_interference_ms * 1e-3 * f64::from(d.running()),
    }
}

/// The choice for a priced request under `policy`.
pub fn choose(policy: &str, price: &Price) -> Why {
    if policy != "cost_model" {
        Why::Always
    } else if price.split() < price.whole() {
        Why::Cheaper
    } else {
        Why::Dearer
    }
}
