//! What a decision is made of: the request as the core sees it ([`View`]),
//! the plan over the fleet ([`Plan`]: every candidate, what set each aside,
//! each score and the order), and what committing it holds ([`Committed`],
//! [`Hold`]); with the filters that set replicas aside before any policy
//! scores them.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use inferrail_policy::{Candidate, NoReplica, Prefill, Request, Score, SetAside, Share};
use rand::rngs::StdRng;

use crate::Report;
use crate::fleet::{Fleet, Lease, Replica};
use crate::kv::{Place, Prediction};
use crate::pair::Pd;

/// What a model's shadow policy would have done with one request.
#[derive(Debug, Clone)]
pub struct Shadow {
    /// Its name.
    pub policy: &'static str,
    /// The replica it would have picked.
    pub winner: Arc<Replica>,
    /// Its score of that replica (`cost_model`: the estimated time to first token, seconds).
    pub estimate: Option<f64>,
    /// Whether it picked the live policy's winner.
    pub agreed: bool,
}

/// What a plan picks for: its leg, how many replicas it orders, and the
/// draws its policy may use.
pub(crate) struct Pick<'a> {
    pub(crate) side: Side<'a>,
    pub(crate) k: usize,
    pub(crate) rng: StdRng,
}

/// What the core needs to know of one request.
#[derive(Debug, Clone)]
pub struct View<'a> {
    /// The model's index.
    pub model: usize,
    /// The prompt cut into blocks ([`Core::prepare`]), when it was tokenized.
    pub prediction: Option<Arc<Prediction>>,
    /// The conversation it names.
    pub session: Option<&'a str>,
    /// The prompt as text, when the model's policy reads it ([`Core::wants_text`]).
    pub text: Option<&'a str>,
    /// The only replicas it may go to (an Inference Extension gateway's subset hint), by address.
    pub subset: Option<&'a [SocketAddr]>,
    /// Where this router stands among the routers sharing the fleet (its part of the limits).
    pub share: Share,
    /// The part of the replicas its band may use (1: all; see [`keep_for_urgent`]).
    pub replica_share: f64,
}

/// What the model's policy would do now, and why. Each replica serving the
/// model has the same position in `candidates`, `reports`, `set_aside` and
/// `scores` as in [`Plan::replica`].
#[derive(Debug)]
pub struct Plan {
    /// The model's index.
    pub model: usize,
    /// The policy.
    pub policy: &'static str,
    /// The names of the score's terms.
    pub terms: &'static [&'static str],
    /// When it was planned.
    pub now: Duration,
    /// The fleet it was planned over.
    pub fleet: Arc<Fleet>,
    /// What the policy saw of each replica serving the model.
    pub candidates: Vec<Candidate>,
    /// Each one's engine report and that report's age, fresh or not.
    pub reports: Vec<Option<(Report, Duration)>>,
    /// Why each was not offered, or set aside by a guard.
    pub set_aside: Vec<Option<SetAside>>,
    /// Each one's score, when it was offered.
    pub scores: Vec<Option<Score>>,
    /// The best offered candidates, best first (the winner and the
    /// fallbacks, or every offered one when asked for all): indices into `candidates`.
    pub order: Vec<usize>,
    /// What steered the decision besides the scores' order.
    pub steer: Option<&'static str>,
    /// A guard waived because it would have refused every replica.
    pub waived: Option<&'static str>,
    /// Why no replica can take the request (then the order is empty and
    /// nothing was scored; `set_aside` says what each replica lacks).
    pub unavailable: Option<NoReplica>,
    /// The prompt's blocks, when it was tokenized.
    pub prediction: Option<Arc<Prediction>>,
    /// Its shadow policy's choice, when the model has one (decisions only).
    pub shadow: Option<Shadow>,
    /// On a disaggregated model: the prefill leg's plan and whether the
    /// request is split (this plan's winner then decodes).
    pub pd: Option<Box<Pd>>,
    /// Which candidates any policy could be offered (the rest not eligible).
    pub(crate) eligible: Vec<Option<SetAside>>,
    pub(crate) session: Option<String>,
    pub(crate) text: Option<String>,
    pub(crate) block_size: usize,
    pub(crate) rng: StdRng,
}

impl Plan {
    /// The `i`th replica serving the model.
    pub fn replica(&self, i: usize) -> &Arc<Replica> {
        &self.fleet.serving(self.model)[i]
    }

    /// The winner.
    pub fn winner(&self) -> &Arc<Replica> {
        self.replica(self.order[0])
    }

    /// The block size policies read the prompt's blocks at.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The prompt's full blocks at [`Plan::block_size`] (empty without a prediction).
    pub fn blocks(&self) -> &[inferrail_kv::hash::BlockHash] {
        self.prediction.as_ref().and_then(|p| p.blocks(self.block_size)).unwrap_or_default()
    }

    /// Prompt tokens, when the prompt was tokenized.
    pub fn prompt_tokens(&self) -> Option<usize> {
        self.prediction.as_ref().map(|p| p.prompt_tokens)
    }

    /// Candidate `i`'s estimated time to first token: the prefill queued
    /// there and this prompt's own, at its engine's prefill cost (or the
    /// model's), whatever the policy.
    pub fn estimate(&self, i: usize, model_prefill: Prefill) -> Duration {
        let c = &self.candidates[i];
        Duration::from_secs_f64(c.ttft_secs(model_prefill, self.prompt_tokens(), c.engine_cached_tokens()))
    }

    /// The request's estimated time to first token as decided: split, the
    /// pair's (prefill, transfer, the decode replica's queue); else the winner's.
    pub fn ttft(&self, model_prefill: Prefill) -> Duration {
        match self.pd.as_deref().filter(|pd| pd.split()) {
            Some(pd) => Duration::from_secs_f64(pd.price.split_ttft()),
            None => self.estimate(self.order[0], model_prefill),
        }
    }

    /// Whether the request is split into a prefill and a decode leg.
    pub fn split(&self) -> bool {
        self.pd.as_deref().is_some_and(Pd::split)
    }

    pub(crate) fn request(&self) -> Request<'_> {
        Request {
            now: self.now,
            prompt_tokens: self.prompt_tokens(),
            blocks: self.blocks(),
            block_size: self.block_size,
            session: self.session.as_deref(),
            text: self.text.as_deref(),
        }
    }
}

/// What [`Core::decide`] did with a plan.
#[derive(Debug)]
pub enum Decided {
    /// Admitted and committed: the winner is leased.
    Committed(Plan, Committed),
    /// Not admitted: nothing is held and no policy state moved.
    Held(Plan),
}

/// A committed decision.
#[derive(Debug)]
pub struct Committed {
    /// The winner's lease.
    pub lease: Arc<Lease>,
    /// Winner first, then the fallbacks.
    pub targets: Vec<Arc<Replica>>,
    /// Predicted cached prompt tokens on each target, when the prompt was tokenized.
    pub cached_tokens: Vec<usize>,
    /// A split request's prefill leg.
    pub prefill: Option<Leg>,
}

/// A split request's prefill leg, committed.
#[derive(Debug)]
pub struct Leg {
    /// Its lease on the prefill replica.
    pub lease: Arc<Lease>,
    /// The prefill replica first, then the fallbacks.
    pub targets: Vec<Arc<Replica>>,
    /// Predicted cached prompt tokens on each, when the prompt was tokenized.
    pub cached_tokens: Vec<usize>,
}

/// Which leg a plan is made for.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Side<'a> {
    /// The whole request, or a split one's decode leg: replicas that decode.
    Whole,
    /// A split request's prefill leg: replicas that prefill, but this one (its decode replica).
    Prefill(&'a Replica),
}

/// What a decision holds on its replica besides the slot ([`Core::hold`], [`Lease::hold`]).
#[derive(Debug, Clone)]
pub struct Hold {
    /// Prompt tokens, when the prompt was tokenized.
    pub prompt_tokens: Option<usize>,
    /// The prefill it queues there.
    pub prefill: Duration,
    /// Its estimated time to first token there ([`Plan::estimate`]); zero
    /// for a peer's decision (its decider measures it).
    pub estimate: Duration,
    /// The free KV room it takes there, tokens.
    pub kv_tokens: u64,
    /// The prompt's blocks, recorded there.
    pub prediction: Option<Arc<Prediction>>,
}

/// Sets aside, for `why`, each replica still offered that is `out`; fails
/// with `none` when that leaves none offered.
pub(crate) fn restrict(
    replicas: &[Arc<Replica>],
    aside: &mut [Option<SetAside>],
    out: impl Fn(&Replica) -> bool,
    why: SetAside,
    none: NoReplica,
) -> Result<(), NoReplica> {
    for (r, a) in replicas.iter().zip(aside.iter_mut()) {
        if a.is_none() && out(r) {
            *a = Some(why);
        }
    }
    if aside.iter().all(Option::is_some) { Err(none) } else { Ok(()) }
}

/// Sets aside all but the first `share` of the replicas still in the
/// running or only busy now (full, loaded), ordered by id, at least one:
/// a band below 1 leaves the rest to more urgent bands. The same replicas
/// on every router, and the same while they stay healthy. When the ones
/// left are all busy, they are all full for this band.
pub(crate) fn keep_for_urgent(replicas: &[Arc<Replica>], aside: &mut [Option<SetAside>], share: f64) -> Result<(), NoReplica> {
    if share >= 1.0 {
        return Ok(());
    }
    let lasting = |a: &Option<SetAside>| matches!(a, Some(SetAside::Unhealthy | SetAside::Draining | SetAside::OutsideSubset));
    let mut pool: Vec<&str> = replicas.iter().zip(aside.iter()).filter(|(_, a)| !lasting(a)).map(|(r, _)| r.id.as_str()).collect();
    pool.sort_unstable();
    pool.truncate(((share * pool.len() as f64 + 1e-9).floor() as usize).max(1));
    restrict(replicas, aside, |r| !pool.contains(&r.id.as_str()), SetAside::KeptForUrgent, NoReplica::AllFull)
}

/// A plan that some replica can take, or why none can.
pub(crate) fn available(plan: Plan) -> Result<Plan, NoReplica> {
    match plan.unavailable {
        Some(why) => Err(why),
        None => Ok(plan),
    }
}

/// The block size most of `places` use (the smallest of the most common):
/// the one policies that hash the prompt's blocks read.
pub(crate) fn most_common_block_size(places: &[Place]) -> Option<usize> {
    let mut sizes: Vec<usize> = places.iter().map(|p| p.block_size).collect();
    sizes.sort_unstable();
    sizes.chunk_by(|a, b| a == b).max_by(|a, b| a.len().cmp(&b.len()).then(b[0].cmp(&a[0]))).map(|run| run[0])
}
