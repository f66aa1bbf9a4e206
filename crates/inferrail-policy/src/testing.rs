//! Candidates and generators for the crate's tests.

use super::*;
use rand::SeedableRng;

pub fn load(in_flight: u32) -> Candidate {
    Candidate {
        key: u64::from(in_flight).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5555,
        in_flight,
        pending: 0,
        max_concurrency: 100,
        max_pending: 100,
        healthy: true,
        cached_tokens: 0,
        held_cached_tokens: 0,
        queued_prefill_secs: 0.0,
        prefill: None,
        prompt_tokens_in_flight: 0,
        kv_capacity_tokens: 0,
        unreported_kv_tokens: 0,
        engine: None,
        own: None,
        adapter: None,
        offloaded: Offloaded::default(),
    }
}

/// Candidates with distinct keys.
pub fn fleet(loads: &[u32]) -> Vec<Candidate> {
    loads.iter().enumerate().map(|(i, &l)| Candidate { key: i as u64 * 0x9e37_79b9 + 17, ..load(l) }).collect()
}

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}
