//! `p2c`: the power of two choices.
//!
//! Two distinct candidates are drawn at random; the one with fewer requests
//! in flight wins (the first drawn on a tie) and the other is the first
//! fallback. The remaining candidates follow, fewest in flight first.

use rand::rngs::StdRng;
use rand::seq::index::sample;

use crate::{Candidate, Request, RoutingPolicy, Score};

/// See the module doc.
#[derive(Debug)]
pub struct P2c;

/// Scores `offered` as p2c ranks them: the better of two drawn first.
pub fn two_choices(c: &[Candidate], offered: &[usize], rng: &mut StdRng, out: &mut [Score]) {
    // The rest, after the two drawn, by load.
    for (s, &i) in out.iter_mut().zip(offered) {
        *s = Score::single(2.0 + f64::from(c[i].in_flight));
    }
    if offered.len() < 2 {
        out[0] = Score::single(0.0);
        return;
    }
    let picked = sample(rng, offered.len(), 2);
    let (a, b) = (picked.index(0), picked.index(1));
    let (first, second) = if c[offered[b]].in_flight < c[offered[a]].in_flight { (b, a) } else { (a, b) };
    out[first] = Score::single(0.0);
    out[second] = Score::single(1.0);
}

impl RoutingPolicy for P2c {
    fn name(&self) -> &'static str {
        "p2c"
    }

    fn terms(&self) -> &'static [&'static str] {
        &["draw"]
    }

    fn score(&self, _req: &Request, c: &[Candidate], offered: &[usize], rng: &mut StdRng, out: &mut [Score]) -> Option<&'static str> {
        two_choices(c, offered, rng, out);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide;
    use crate::testing::{fleet, rng};

    #[test]
    fn the_busiest_never_wins_and_two_candidates_order_by_load() {
        let mut r = rng(9);
        let req = Request::default();
        let c = fleet(&[1, 7, 4]);
        for _ in 0..100 {
            assert_ne!(decide(&P2c, &req, &c, &mut r).unwrap()[0], 1);
        }
        assert_eq!(decide(&P2c, &req, &fleet(&[7, 4]), &mut r).unwrap(), [1, 0]);
    }
}
