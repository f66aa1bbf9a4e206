//! `round_robin`: each candidate in turn.
//!
//! A counter advances once per committed decision; the candidate at the
//! counter's position (among those offered) scores 0 and the others follow
//! in ring order. No parameters.

use std::sync::atomic::{AtomicUsize, Ordering};

use rand::rngs::StdRng;

use crate::{Candidate, Request, RoutingPolicy, Score};

/// See the module doc.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl RoutingPolicy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }

    fn terms(&self) -> &'static [&'static str] {
        &["turn"]
    }

    fn score(&self, _req: &Request, _c: &[Candidate], offered: &[usize], _rng: &mut StdRng, out: &mut [Score]) -> Option<&'static str> {
        let n = offered.len();
        let start = self.next.load(Ordering::Relaxed) % n;
        for (k, s) in out.iter_mut().enumerate() {
            *s = Score::single(((k + n - start) % n) as f64);
        }
        None
    }

    fn picked(&self, _req: &Request, _c: &[Candidate], _winner: usize) {
        self.next.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide;
    use crate::testing::{load, rng};

    #[test]
    fn takes_turns_and_only_a_committed_decision_moves_the_counter() {
        let p = RoundRobin::default();
        let c = vec![load(0); 3];
        let req = Request::default();
        let mut r = rng(0);
        let mut winners = Vec::new();
        for _ in 0..6 {
            let o = decide(&p, &req, &c, &mut r).unwrap();
            assert_eq!(decide(&p, &req, &c, &mut r).unwrap(), o, "planning twice changes nothing");
            p.picked(&req, &c, o[0]);
            winners.push(o[0]);
        }
        assert_eq!(winners, [0, 1, 2, 0, 1, 2]);
        assert_eq!(decide(&p, &req, &c, &mut r).unwrap(), [0, 1, 2]);
    }
}
