//! `random`: candidates in a uniformly random order, from the seeded generator.

use rand::Rng;
use rand::rngs::StdRng;

use crate::{Candidate, Request, RoutingPolicy, Score};

/// See the module doc.
#[derive(Debug)]
pub struct Random;

impl RoutingPolicy for Random {
    fn name(&self) -> &'static str {
        "random"
    }

    fn terms(&self) -> &'static [&'static str] {
        &["draw"]
    }

    fn score(&self, _req: &Request, _c: &[Candidate], _offered: &[usize], rng: &mut StdRng, out: &mut [Score]) -> Option<&'static str> {
        for s in out {
            *s = Score::single(rng.random());
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide;
    use crate::testing::{fleet, rng};

    #[test]
    fn spreads_over_every_candidate_whatever_the_load() {
        let c = fleet(&[0, 9, 3, 30]);
        let mut r = rng(3);
        let mut wins = [0; 4];
        for _ in 0..400 {
            wins[decide(&Random, &Request::default(), &c, &mut r).unwrap()[0]] += 1;
        }
        assert!(wins.iter().all(|&w| w > 50), "{wins:?}");
    }
}
