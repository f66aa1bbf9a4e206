//! `least_request`: fewest requests in flight first; ties by the shared
//! tie-break of [`crate::order`] (a weight of the prompt's last full block
//! on each replica), so equal loads share traffic evenly.

use rand::rngs::StdRng;

use crate::{Candidate, Request, RoutingPolicy, Score};

/// See the module doc.
#[derive(Debug)]
pub struct LeastRequest;

impl RoutingPolicy for LeastRequest {
    fn name(&self) -> &'static str {
        "least_request"
    }

    fn terms(&self) -> &'static [&'static str] {
        &["in_flight"]
    }

    fn score(&self, _req: &Request, c: &[Candidate], offered: &[usize], _rng: &mut StdRng, out: &mut [Score]) -> Option<&'static str> {
        for (s, &i) in out.iter_mut().zip(offered) {
            *s = Score::single(f64::from(c[i].in_flight));
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
    fn least_loaded_first_and_ties_shared() {
        let mut r = rng(1);
        let req = Request::default();
        assert_eq!(decide(&LeastRequest, &req, &fleet(&[5, 1, 3]), &mut r).unwrap(), [1, 2, 0]);
        let even = fleet(&[2, 2, 9]);
        let mut wins = [0; 3];
        for _ in 0..200 {
            wins[decide(&LeastRequest, &req, &even, &mut r).unwrap()[0]] += 1;
        }
        assert!(wins[0] > 50 && wins[1] > 50 && wins[2] == 0, "{wins:?}");
    }
}
