//! `random`: candidates in a uniformly random order, from a seeded generator.

use rand::seq::SliceRandom;

use crate::{ReplicaLoad, RoutingPolicy, SeededRng};

/// See the module doc.
#[derive(Debug)]
pub struct Random {
    rng: SeededRng,
}

impl Random {
    /// A policy drawing from `seed`.
    pub fn new(seed: u64) -> Self {
        Self { rng: SeededRng::new(seed) }
    }
}

impl RoutingPolicy for Random {
    fn name(&self) -> &'static str {
        "random"
    }

    fn rank(&self, _replicas: &[ReplicaLoad], mut candidates: Vec<usize>) -> Vec<usize> {
        self.rng.with(|rng| candidates.shuffle(rng));
        candidates
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::load;

    #[test]
    fn spreads_over_every_candidate() {
        let p = Random::new(3);
        let r = vec![load(0); 4];
        let mut wins = [0; 4];
        for _ in 0..400 {
            wins[p.rank(&r, vec![0, 1, 2, 3])[0]] += 1;
        }
        assert!(wins.iter().all(|&w| w > 50), "{wins:?}");
    }
}
