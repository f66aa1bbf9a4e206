//! `least_request`: fewest requests in flight first, ties broken at random.
//!
//! Candidates are shuffled with the policy's seeded generator, then stably
//! sorted by in-flight count, so equal loads share traffic evenly.

use rand::seq::SliceRandom;

use crate::{ReplicaLoad, RoutingPolicy, SeededRng};

/// See the module doc.
#[derive(Debug)]
pub struct LeastRequest {
    rng: SeededRng,
}

impl LeastRequest {
    /// A policy breaking ties from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { rng: SeededRng::new(seed) }
    }
}

/// `candidates` by in-flight count, ties in the order given.
pub fn by_load(replicas: &[ReplicaLoad], mut candidates: Vec<usize>) -> Vec<usize> {
    candidates.sort_by_key(|&i| replicas[i].in_flight);
    candidates
}

impl RoutingPolicy for LeastRequest {
    fn name(&self) -> &'static str {
        "least_request"
    }

    fn rank(&self, replicas: &[ReplicaLoad], mut candidates: Vec<usize>) -> Vec<usize> {
        self.rng.with(|rng| candidates.shuffle(rng));
        by_load(replicas, candidates)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::load;

    #[test]
    fn least_loaded_first_and_ties_shared() {
        let p = LeastRequest::new(1);
        assert_eq!(p.rank(&[load(5), load(1), load(3)], vec![0, 1, 2]), [1, 2, 0]);
        let even = [load(2), load(2), load(9)];
        let mut wins = [0; 3];
        for _ in 0..200 {
            wins[p.rank(&even, vec![0, 1, 2])[0]] += 1;
        }
        assert!(wins[0] > 50 && wins[1] > 50 && wins[2] == 0, "{wins:?}");
    }
}
