//! `p2c`: the power of two choices.
//!
//! Two distinct candidates are drawn at random; the one with fewer requests
//! in flight wins (the first drawn on a tie) and the other is the first
//! fallback. The remaining candidates follow, fewest in flight first.

use rand::seq::index::sample;

use crate::least_request::by_load;
use crate::{ReplicaLoad, RoutingPolicy, SeededRng};

/// See the module doc.
#[derive(Debug)]
pub struct P2c {
    rng: SeededRng,
}

impl P2c {
    /// A policy drawing from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { rng: SeededRng::new(seed) }
    }
}

impl RoutingPolicy for P2c {
    fn name(&self) -> &'static str {
        "p2c"
    }

    fn rank(&self, replicas: &[ReplicaLoad], candidates: Vec<usize>) -> Vec<usize> {
        if candidates.len() < 2 {
            return candidates;
        }
        let picked = self.rng.with(|rng| sample(rng, candidates.len(), 2));
        let (a, b) = (candidates[picked.index(0)], candidates[picked.index(1)]);
        let (first, second) = if replicas[b].in_flight < replicas[a].in_flight { (b, a) } else { (a, b) };
        let rest = candidates.into_iter().filter(|&i| i != first && i != second).collect();
        [first, second].into_iter().chain(by_load(replicas, rest)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::load;

    #[test]
    fn the_busiest_never_wins_and_two_candidates_order_by_load() {
        let p = P2c::new(9);
        let r = [load(1), load(7), load(4)];
        for _ in 0..100 {
            assert_ne!(p.rank(&r, vec![0, 1, 2])[0], 1);
        }
        assert_eq!(p.rank(&r, vec![1, 2]), [2, 1]);
    }
}
