//! `round_robin`: each candidate in turn.
//!
//! A counter advances once per decision; the winner is the candidate at the
//! counter's position and the fallbacks follow in ring order. No parameters.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::{ReplicaLoad, RoutingPolicy};

/// See the module doc.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl RoutingPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn rank(&self, _replicas: &[ReplicaLoad], mut candidates: Vec<usize>) -> Vec<usize> {
        let start = self.next.fetch_add(1, Ordering::Relaxed) % candidates.len().max(1);
        candidates.rotate_left(start);
        candidates
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::load;

    #[test]
    fn takes_turns() {
        let p = RoundRobin::default();
        let r = vec![load(0); 3];
        let winners: Vec<usize> = (0..6).map(|_| p.rank(&r, vec![0, 1, 2])[0]).collect();
        assert_eq!(winners, [0, 1, 2, 0, 1, 2]);
        assert_eq!(p.rank(&r, vec![0, 1, 2]), [0, 1, 2]);
        assert_eq!(p.rank(&r, vec![0, 1, 2]), [1, 2, 0]);
    }
}
