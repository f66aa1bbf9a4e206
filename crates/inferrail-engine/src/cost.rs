//! The latency model: how long an engine step takes.
//!
//! Prefilling `u` uncached tokens that attend to `c` cached ones costs
//! `P(u, c) = a*u + b*u*(c + u/2) + d`, the shape of the router's cost model,
//! so calibration can recover `a`, `b` and `d`. Prompts prefilled together in
//! one step share its fixed cost `d`. A decode step costs a base time plus a
//! little for each further running sequence. A step that both prefills and
//! decodes takes the sum, so prefill slows the decodes beside it. Reading a
//! disaggregated prefill's KV costs a time per block moved, beside the steps.

use std::time::Duration;

/// Parameters of the latency model; see the module doc.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyModel {
    /// `a`: microseconds per uncached token.
    pub prefill_token_us: f64,
    /// `b`: nanoseconds per attended token pair.
    pub prefill_pair_ns: f64,
    /// `d`: milliseconds per prefill.
    pub prefill_fixed_ms: f64,
    /// Decode step time with one running sequence, milliseconds.
    pub decode_token_ms: f64,
    /// Extra decode step time per further running sequence, microseconds.
    pub decode_seq_us: f64,
    /// Time to move one KV block between engines, microseconds.
    pub transfer_block_us: f64,
    /// Every step takes no time.
    pub zero: bool,
}

/// Time to read a LoRA adapter from disk into host memory, milliseconds:
/// an assumption (tens of megabytes from local disk), not a measurement.
pub const LORA_LOAD_MS: f64 = 50.0;

/// Time to copy a LoRA adapter from host memory into a GPU slot,
/// milliseconds: an assumption (tens of megabytes over PCIe).
pub const LORA_SLOT_MS: f64 = 5.0;

/// Bytes of KV one token takes over all layers: an 8B model's in 16 bits
/// (32 layers, 8 KV heads of 128 dimensions, keys and values).
pub const KV_BYTES_PER_TOKEN: usize = 131_072;

/// Speed of KV copies between the GPU and host memory, GB/s: an assumption,
/// about what PCIe 4.0 x16 sustains.
pub const OFFLOAD_GBS: f64 = 25.0;

/// Defaults that approximate an 8B model on one 24 GB GPU.
pub const DEFAULT: LatencyModel = LatencyModel {
    prefill_token_us: 100.0,
    prefill_pair_ns: 3.3,
    prefill_fixed_ms: 5.0,
    decode_token_ms: 20.0,
    decode_seq_us: 60.0,
    // A 16-token block of an 8B model's KV is 2 MiB in 16 bits: about
    // 100 us over a 20 GB/s RDMA link.
    transfer_block_us: 100.0,
    zero: false,
};

impl LatencyModel {
    /// Prefill time of `uncached` tokens after `cached` ones, in seconds.
    pub fn prefill_secs(&self, uncached: usize, cached: usize) -> f64 {
        if self.zero {
            return 0.0;
        }
        let (u, c) = (uncached as f64, cached as f64);
        self.prefill_token_us * 1e-6 * u + self.prefill_pair_ns * 1e-9 * u * (c + u / 2.0) + self.prefill_fixed_ms * 1e-3
    }

    /// Length of a step that prefills `prompts` (uncached, cached tokens) and
    /// decodes `decoding` sequences, in seconds.
    pub fn step_secs(&self, prompts: &[(usize, usize)], decoding: usize) -> f64 {
        if self.zero {
            return 0.0;
        }
        let fixed = self.prefill_fixed_ms * 1e-3;
        let prefill: f64 = prompts.iter().map(|&(u, c)| self.prefill_secs(u, c) - fixed).sum();
        let shared = if prompts.is_empty() { 0.0 } else { fixed };
        prefill + shared + self.decode_secs(decoding)
    }

    /// Time to move `blocks` KV blocks between engines, in seconds.
    pub fn transfer_secs(&self, blocks: usize) -> f64 {
        if self.zero {
            return 0.0;
        }
        self.transfer_block_us * 1e-6 * blocks as f64
    }

    /// Time of a decode step with `running` sequences decoding, in seconds.
    pub fn decode_secs(&self, running: usize) -> f64 {
        if self.zero || running == 0 {
            return 0.0;
        }
        self.decode_token_ms * 1e-3 + self.decode_seq_us * 1e-6 * (running - 1) as f64
    }
}

/// Seconds as a duration, rounded to the nanosecond.
pub fn secs(s: f64) -> Duration {
    Duration::from_nanos((s.max(0.0) * 1e9).round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn model() -> LatencyModel {
        DEFAULT
    }

    #[test]
    fn prefill_matches_the_formula() {
        // 1000 tokens cold: 0.1 s + 3.3e-9 * 1000 * 500 + 0.005
        let p = model().prefill_secs(1000, 0);
        assert!((p - (0.1 + 0.00165 + 0.005)).abs() < 1e-12, "{p}");
    }

    #[test]
    fn prompts_in_one_step_share_the_fixed_cost() {
        let m = model();
        let both = m.step_secs(&[(100, 0), (50, 200)], 3);
        let apart = m.prefill_secs(100, 0) + m.prefill_secs(50, 200) + m.decode_secs(3);
        assert!((both - (apart - 0.005)).abs() < 1e-12);
        assert_eq!(m.step_secs(&[(100, 0)], 0), m.prefill_secs(100, 0));
        assert_eq!(m.step_secs(&[], 2), m.decode_secs(2));
    }

    #[test]
    fn zero_latency_is_free() {
        let m = LatencyModel { zero: true, ..model() };
        assert_eq!(m.prefill_secs(5000, 100), 0.0);
        assert_eq!(m.decode_secs(10), 0.0);
    }

    proptest! {
        #[test]
        fn latency_is_monotone_in_uncached_tokens(u in 1usize..50_000, c in 0usize..50_000, more in 1usize..1000) {
            let m = model();
            prop_assert!(m.prefill_secs(u + more, c) > m.prefill_secs(u, c));
            prop_assert!(m.prefill_secs(u, c + more) >= m.prefill_secs(u, c));
        }

        #[test]
        fn decode_grows_with_the_batch(n in 1usize..1000) {
            prop_assert!(model().decode_secs(n + 1) > model().decode_secs(n));
        }
    }
}
