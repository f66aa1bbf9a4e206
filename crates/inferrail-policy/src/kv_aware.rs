//! `kv_aware`: a weighted score of the predicted cached share of the prompt
//! against relative load.
//!
//! A candidate's score is `cache_weight * cached / prompt - load_weight *
//! in_flight / busiest`, where `busiest` is the most requests in flight on
//! any offered candidate; the highest score wins (it is negated into a cost
//! here), ties to fewer requests in flight. Without a prediction only the
//! load term counts. Parameters: `cache_weight` (1.0), `load_weight` (1.0).

use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

use crate::{Candidate, Request, RoutingPolicy, Score};

/// `kv_aware` parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Config {
    /// Weight of the predicted cached share.
    pub cache_weight: f64,
    /// Weight of the load relative to the busiest candidate.
    pub load_weight: f64,
}

impl Default for Config {
    fn default() -> Self {
        Self { cache_weight: 1.0, load_weight: 1.0 }
    }
}

impl Config {
    pub(crate) fn validate(&self, at: &str, p: &mut Vec<String>) {
        for (name, v) in [("cache_weight", self.cache_weight), ("load_weight", self.load_weight)] {
            if !(v.is_finite() && v >= 0.0) {
                p.push(format!("{at}.{name}: {v} is not a non-negative number"));
            }
        }
    }
}

/// See the module doc.
#[derive(Debug)]
pub struct KvAware {
    config: Config,
}

impl KvAware {
    /// With its parameters.
    pub fn new(config: Config) -> Self {
        Self { config }
    }
}

impl RoutingPolicy for KvAware {
    fn name(&self) -> &'static str {
        "kv_aware"
    }

    fn terms(&self) -> &'static [&'static str] {
        &["cache", "load"]
    }

    fn score(&self, req: &Request, c: &[Candidate], offered: &[usize], _rng: &mut StdRng, out: &mut [Score]) -> Option<&'static str> {
        let busiest = offered.iter().map(|&i| c[i].in_flight).max().unwrap_or(0).max(1);
        let prompt = req.prompt_tokens.unwrap_or(0);
        for (s, &i) in out.iter_mut().zip(offered) {
            let cache = if prompt == 0 { 0.0 } else { self.config.cache_weight * c[i].cached_tokens as f64 / prompt as f64 };
            let load = self.config.load_weight * f64::from(c[i].in_flight) / f64::from(busiest);
            *s = Score { total: load - cache, terms: [-cache, load, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0] };
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
    fn cache_wins_until_the_load_outweighs_it() {
        let p = KvAware::new(Config::default());
        let req = Request { prompt_tokens: Some(1000), ..Request::default() };
        let mut r = rng(0);
        let mut c = fleet(&[3, 4]);
        c[1].cached_tokens = 900;
        assert_eq!(decide(&p, &req, &c, &mut r).unwrap()[0], 1, "0.9 cached against 0.25 more load");
        c[0].in_flight = 0;
        c[1].cached_tokens = 500;
        assert_eq!(decide(&p, &req, &c, &mut r).unwrap()[0], 0, "0.5 cached against the busiest");
    }
}
