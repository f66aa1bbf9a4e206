//! `prefix_hash`: rendezvous (highest random weight) hashing on the prompt's
//! first blocks, whatever the load.
//!
//! The hash of block `blocks - 1` (or the prompt's last full block when it
//! has fewer) names the prompt's whole leading prefix, since block hashes
//! chain. Each candidate's weight mixes that hash with the candidate's key;
//! the heaviest wins and the others follow by weight, so a replica leaving
//! moves only its own prefixes. A prompt without a full block (or without a
//! prediction) goes to the power of two choices. Parameters: `blocks` (4).

use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

use crate::p2c::two_choices;
use crate::{Candidate, Request, RoutingPolicy, Score, weight};

/// `prefix_hash` parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Config {
    /// Leading blocks that name a prompt's prefix.
    pub blocks: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self { blocks: 4 }
    }
}

impl Config {
    pub(crate) fn validate(&self, at: &str, p: &mut Vec<String>) {
        if self.blocks == 0 {
            p.push(format!("{at}.blocks: must be at least 1"));
        }
    }
}

/// See the module doc.
#[derive(Debug)]
pub struct PrefixHash {
    config: Config,
}

impl PrefixHash {
    /// With its parameters.
    pub fn new(config: Config) -> Self {
        Self { config }
    }
}

impl RoutingPolicy for PrefixHash {
    fn name(&self) -> &'static str {
        "prefix_hash"
    }

    fn terms(&self) -> &'static [&'static str] {
        &["rank"]
    }

    fn score(&self, req: &Request, c: &[Candidate], offered: &[usize], rng: &mut StdRng, out: &mut [Score]) -> Option<&'static str> {
        let Some(&prefix) = req.blocks.get(self.config.blocks.min(req.blocks.len()).wrapping_sub(1)) else {
            two_choices(c, offered, rng, out);
            return Some("no_prefix");
        };
        let mut by_weight: Vec<(u64, usize)> = offered.iter().enumerate().map(|(k, &i)| (weight(prefix, c[i].key), k)).collect();
        by_weight.sort_unstable_by(|a, b| b.cmp(a));
        for (rank, (_, k)) in by_weight.into_iter().enumerate() {
            out[k] = Score::single(rank as f64);
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
    fn a_prefix_always_goes_to_the_same_replica_whatever_the_load_and_a_departure_moves_only_its_own() {
        let p = PrefixHash::new(Config::default());
        let mut r = rng(0);
        let c = fleet(&[0, 50, 3, 7]);
        let mut homes = Vec::new();
        for prompt in 0..64u128 {
            let blocks: Vec<u128> = (0..6).map(|b| prompt * 1_000 + b).collect();
            let req = Request { blocks: &blocks, prompt_tokens: Some(96), block_size: 16, ..Request::default() };
            let first = decide(&p, &req, &c, &mut r).unwrap()[0];
            assert_eq!(decide(&p, &req, &c, &mut r).unwrap()[0], first);
            // Only the first 4 blocks count.
            let mut longer = blocks.clone();
            longer.push(7);
            assert_eq!(decide(&p, &Request { blocks: &longer, ..req }, &c, &mut r).unwrap()[0], first);
            homes.push((blocks, first));
        }
        assert!((0..4).all(|i| homes.iter().filter(|h| h.1 == i).count() > 5), "prefixes spread over every replica");
        let without_1: Vec<Candidate> = c.iter().enumerate().filter(|(i, _)| *i != 1).map(|(_, x)| x.clone()).collect();
        for (blocks, home) in &homes {
            let req = Request { blocks, prompt_tokens: Some(96), block_size: 16, ..Request::default() };
            let now = decide(&p, &req, &without_1, &mut r).unwrap()[0];
            if *home != 1 {
                assert_eq!(without_1[now].key, c[*home].key, "a prefix whose home stayed did not move");
            }
        }
    }

    #[test]
    fn a_prompt_without_a_full_block_goes_to_two_choices() {
        let p = PrefixHash::new(Config::default());
        let mut r = rng(0);
        for _ in 0..50 {
            assert_ne!(decide(&p, &Request::default(), &fleet(&[1, 9, 2]), &mut r).unwrap()[0], 1);
        }
    }
}
