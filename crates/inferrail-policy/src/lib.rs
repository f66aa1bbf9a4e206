//! Routing policies: given the replicas that may serve a request, rank them.
//!
//! A policy sees plain data ([`ReplicaLoad`]) and returns every eligible
//! replica, best first: the first serves, the next ones are the fallbacks
//! Envoy's retries walk. Eligibility (health, room) is decided apart, by
//! [`eligible`], so each policy only scores. Policies hold their own seeded
//! randomness, so a seed replays the same choices. No I/O happens here.
#![forbid(unsafe_code)]

pub mod least_request;
pub mod p2c;
pub mod random;
pub mod round_robin;

use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

/// What a policy knows of one replica at decision time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaLoad {
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
}

impl ReplicaLoad {
    /// Has room for one more request.
    pub fn has_room(&self) -> bool {
        self.in_flight < self.max_concurrency && self.pending < self.max_pending
    }
}

/// Why no replica can take a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NoReplica {
    /// The model has no replicas at all.
    #[error("no replica serves this model")]
    NoneServe,
    /// Every replica is unhealthy or ejected.
    #[error("every replica of this model is unhealthy")]
    AllUnhealthy,
    /// Every healthy replica is at its concurrency or pending limit.
    #[error("every healthy replica of this model is at capacity")]
    AllFull,
}

impl NoReplica {
    /// A short label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            Self::NoneServe => "no_replica",
            Self::AllUnhealthy => "all_unhealthy",
            Self::AllFull => "all_full",
        }
    }
}

/// Indices of the replicas that may take a request: healthy, with room.
pub fn eligible(replicas: &[ReplicaLoad]) -> Result<Vec<usize>, NoReplica> {
    if replicas.is_empty() {
        return Err(NoReplica::NoneServe);
    }
    let healthy: Vec<usize> = (0..replicas.len()).filter(|&i| replicas[i].healthy).collect();
    if healthy.is_empty() {
        return Err(NoReplica::AllUnhealthy);
    }
    let open: Vec<usize> = healthy.into_iter().filter(|&i| replicas[i].has_room()).collect();
    if open.is_empty() { Err(NoReplica::AllFull) } else { Ok(open) }
}

/// A routing policy: ranks eligible replicas, best first.
pub trait RoutingPolicy: Send + Sync {
    /// The policy's name, as configured and as metrics label it.
    fn name(&self) -> &'static str;

    /// Orders `candidates` (indices into `replicas`, all eligible, never
    /// empty) best first. The result holds each candidate exactly once.
    fn rank(&self, replicas: &[ReplicaLoad], candidates: Vec<usize>) -> Vec<usize>;
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
    /// Fewest requests in flight, ties at random.
    LeastRequest,
    /// The better of two chosen at random.
    P2c,
}

/// Builds a policy; randomized ones draw from `seed`.
pub fn build(kind: PolicyKind, seed: u64) -> Box<dyn RoutingPolicy> {
    match kind {
        PolicyKind::RoundRobin => Box::new(round_robin::RoundRobin::default()),
        PolicyKind::Random => Box::new(random::Random::new(seed)),
        PolicyKind::LeastRequest => Box::new(least_request::LeastRequest::new(seed)),
        PolicyKind::P2c => Box::new(p2c::P2c::new(seed)),
    }
}

/// Seeded randomness a policy owns; locked only for the few draws of one decision.
#[derive(Debug)]
pub struct SeededRng(std::sync::Mutex<StdRng>);

impl SeededRng {
    /// From a seed.
    pub fn new(seed: u64) -> Self {
        Self(std::sync::Mutex::new(StdRng::seed_from_u64(seed)))
    }

    /// Runs `f` with the generator.
    pub fn with<T>(&self, f: impl FnOnce(&mut StdRng) -> T) -> T {
        let mut rng = self.0.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut rng)
    }
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    pub fn load(in_flight: u32) -> ReplicaLoad {
        ReplicaLoad { in_flight, pending: 0, max_concurrency: 100, max_pending: 100, healthy: true }
    }

    /// Checks a ranking is a permutation of the candidates.
    pub fn assert_permutation(ranked: &[usize], candidates: &[usize]) {
        let mut a = ranked.to_vec();
        let mut b = candidates.to_vec();
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(a, b, "ranking {ranked:?} is not a permutation of {candidates:?}");
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn eligibility_names_why_nobody_can_serve() {
        assert_eq!(eligible(&[]), Err(NoReplica::NoneServe));
        let sick = ReplicaLoad { healthy: false, ..load(0) };
        assert_eq!(eligible(&[sick.clone(), sick.clone()]), Err(NoReplica::AllUnhealthy));
        let full = ReplicaLoad { in_flight: 100, ..load(0) };
        assert_eq!(eligible(&[sick.clone(), full.clone()]), Err(NoReplica::AllFull));
        let waiting = ReplicaLoad { pending: 100, ..load(0) };
        assert_eq!(eligible(&[sick, full, waiting, load(3)]), Ok(vec![3]));
    }

    proptest! {
        #[test]
        fn every_policy_ranks_each_candidate_exactly_once(
            loads in proptest::collection::vec(0u32..20, 1..12),
            seed in any::<u64>(),
            calls in 1usize..5,
        ) {
            let replicas: Vec<ReplicaLoad> = loads.iter().map(|&l| load(l)).collect();
            for kind in [PolicyKind::RoundRobin, PolicyKind::Random, PolicyKind::LeastRequest, PolicyKind::P2c] {
                let policy = build(kind, seed);
                for _ in 0..calls {
                    let candidates = eligible(&replicas).unwrap_or_default();
                    let ranked = policy.rank(&replicas, candidates.clone());
                    assert_permutation(&ranked, &candidates);
                }
            }
        }

        #[test]
        fn a_seed_replays_the_same_choices(loads in proptest::collection::vec(0u32..5, 2..8), seed in any::<u64>()) {
            let replicas: Vec<ReplicaLoad> = loads.iter().map(|&l| load(l)).collect();
            for kind in [PolicyKind::Random, PolicyKind::LeastRequest, PolicyKind::P2c] {
                let (a, b) = (build(kind, seed), build(kind, seed));
                for _ in 0..10 {
                    let c: Vec<usize> = (0..replicas.len()).collect();
                    prop_assert_eq!(a.rank(&replicas, c.clone()), b.rank(&replicas, c));
                }
            }
        }
    }
}
