//! One decision over the candidates a policy was offered: [`order`] ranks
//! them by score with the shared tie-breaks, [`rank`] runs a policy's
//! guards, scores and order, and [`decide`] adds eligibility in front.

use rand::RngCore;
use rand::rngs::StdRng;

use super::{BlockHash, Candidate, NoReplica, Request, RoutingPolicy, Score, SetAside, eligibility, weight};

/// The best `k` of `offered` (all of them when fewer), best first: by score,
/// then fewer requests in flight, then the lowest weight of the prompt's
/// `last` full block on each replica (rendezvous hashing), or at random for
/// a prompt without a full block. Ties that follow the prompt rather than a
/// draw make every router with the same view pick the same replica. The
/// last full block's hash chains over every block before it, so prompts
/// that differ before it spread as they would at random, shared prefix or
/// not: a cache-blind policy stays blind. Selecting the top `k`
/// before sorting them keeps a decision over hundreds of replicas linear.
pub fn order(
    candidates: &[Candidate],
    offered: &[usize],
    scores: &[Score],
    k: usize,
    last: Option<BlockHash>,
    rng: &mut StdRng,
) -> Vec<usize> {
    let mut tie = |c: &Candidate| match last {
        Some(last) => weight(last, c.key),
        None => rng.next_u64(),
    };
    let mut keyed: Vec<(f64, u32, u64, usize)> =
        offered.iter().zip(scores).map(|(&i, s)| (s.total, candidates[i].in_flight, tie(&candidates[i]), i)).collect();
    let cmp = |a: &(f64, u32, u64, usize), b: &(f64, u32, u64, usize)| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2));
    if k < keyed.len() {
        keyed.select_nth_unstable_by(k, cmp);
        keyed.truncate(k);
    }
    keyed.sort_unstable_by(cmp);
    keyed.into_iter().map(|k| k.3).collect()
}

/// What a policy made of the eligible candidates: its guards, scores and order.
#[derive(Debug, Clone)]
pub struct Ranked {
    /// Why each was not offered: not eligible, or set aside by a guard.
    pub set_aside: Vec<Option<SetAside>>,
    /// Each one's score, when it was offered.
    pub scores: Vec<Option<Score>>,
    /// The best `k` offered, best first: indices into the candidates.
    pub order: Vec<usize>,
    /// What steered the decision besides the scores' order.
    pub steer: Option<&'static str>,
    /// A guard waived because it would have refused every replica.
    pub waived: Option<&'static str>,
}

/// The policy's guards, scores and order over `candidates`, the ones
/// `aside` names not eligible left out; the best `k`.
pub fn rank(
    policy: &dyn RoutingPolicy,
    req: &Request,
    candidates: &[Candidate],
    mut aside: Vec<Option<SetAside>>,
    k: usize,
    rng: &mut StdRng,
) -> Ranked {
    let waived = policy.guard(req, candidates, &mut aside);
    let offered: Vec<usize> = (0..aside.len()).filter(|&i| aside[i].is_none()).collect();
    let mut scores = vec![Score::default(); offered.len()];
    let steer = policy.score(req, candidates, &offered, rng, &mut scores);
    let order = order(candidates, &offered, &scores, k, req.blocks.last().copied(), rng);
    let mut all = vec![None; aside.len()];
    for (&i, s) in offered.iter().zip(scores) {
        all[i] = Some(s);
    }
    Ranked { set_aside: aside, scores: all, order, steer, waived }
}

/// Runs one whole decision over plain candidates: eligibility, the policy's
/// guards, scores and order. Returns the order (winner first) or why nobody
/// qualifies. The route crate does the same with its own bookkeeping; this
/// is for tests, benchmarks and simulations that need only the order.
pub fn decide(policy: &dyn RoutingPolicy, req: &Request, candidates: &[Candidate], rng: &mut StdRng) -> Result<Vec<usize>, NoReplica> {
    let mut aside = vec![None; candidates.len()];
    eligibility(candidates, &mut aside)?;
    Ok(rank(policy, req, candidates, aside, usize::MAX, rng).order)
}
