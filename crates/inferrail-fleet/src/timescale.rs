//! Time scale: the simulator's latency model, and the router's costs that
//! mirror it, made uniformly faster (or slower) by one factor, so that a
//! comparison of many runs fits the machine's time. At scale `s` an engine
//! does in `s` seconds what the default model does in one: the same load is
//! `1 / s` times the arrival rate, and the SLO is `s` times as long. The
//! router reads the engines' load `1 / s` times as often too, so a report is
//! as old, measured in engine steps, as it is at scale 1.

use std::time::Duration;

use inferrail_engine::cost::{DEFAULT, LORA_LOAD_MS, LORA_SLOT_MS, LatencyModel, OFFLOAD_GBS};
use inferrail_policy::{Params, Prefill};

/// A time scale flag: a positive, finite number.
pub fn parse(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("{s:?} is not a positive number")),
    }
}

/// The simulator's default latency model scaled by `s`.
pub fn latency(s: f64) -> LatencyModel {
    LatencyModel {
        prefill_token_us: DEFAULT.prefill_token_us * s,
        prefill_pair_ns: DEFAULT.prefill_pair_ns * s,
        prefill_fixed_ms: DEFAULT.prefill_fixed_ms * s,
        decode_token_ms: DEFAULT.decode_token_ms * s,
        decode_seq_us: DEFAULT.decode_seq_us * s,
        transfer_block_us: DEFAULT.transfer_block_us * s,
        zero: false,
    }
}

/// The router's policy parameters for engines timed by `latency(s)`: the
/// prefill cost, and `cost_model`'s times (its decode interference is one
/// running sequence's share of a decode step).
pub fn params(s: f64) -> Params {
    let l = latency(s);
    let mut p = Params {
        prefill: Prefill { prefill_token_us: l.prefill_token_us, prefill_pair_ns: l.prefill_pair_ns, prefill_fixed_ms: l.prefill_fixed_ms },
        ..Params::default()
    };
    p.cost_model.decode_interference_ms = l.decode_seq_us * 1e-3;
    p.kv_transfer.block_us = l.transfer_block_us;
    p.cost_model.adapters.load_ms *= s;
    p.cost_model.adapters.slot_wait_ms *= s;
    p.cost_model.offload.host_token_us *= s;
    p.cost_model.offload.disk_token_us *= s;
    p
}

/// How often the router reads each engine's load at scale `s`: the
/// scraper's default interval scaled, at least a millisecond.
pub fn scrape_interval(s: f64) -> Duration {
    let default = Duration::from_millis(inferrail_config::Load::default().interval_ms);
    default.mul_f64(s).max(Duration::from_millis(1))
}

/// A `--policy-params` flag: a JSON object, laid over the time scale's
/// parameters as a model's own `policies` in the routing YAML are (only the
/// fields given change; the router's config checks them).
pub fn parse_overrides(s: &str) -> Result<serde_json::Value, String> {
    match serde_json::from_str::<serde_json::Value>(s) {
        Ok(v) if v.is_object() => Ok(v),
        Ok(_) => Err("not a JSON object".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// The simulator's flags for `latency(s)`.
pub fn sim_flags(s: f64) -> Vec<String> {
    let l = latency(s);
    [
        ("--prefill-token-us", l.prefill_token_us),
        ("--prefill-pair-ns", l.prefill_pair_ns),
        ("--prefill-fixed-ms", l.prefill_fixed_ms),
        ("--decode-token-ms", l.decode_token_ms),
        ("--decode-seq-us", l.decode_seq_us),
        ("--kv-transfer-block-us", l.transfer_block_us),
        ("--lora-load-ms", LORA_LOAD_MS * s),
        ("--lora-slot-ms", LORA_SLOT_MS * s),
        ("--kv-offload-bandwidth-gbs", OFFLOAD_GBS / s),
    ]
    .into_iter()
    .flat_map(|(flag, v)| [flag.to_string(), v.to_string()])
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_one_is_the_default_and_every_time_scales_alike() {
        assert_eq!(latency(1.0), DEFAULT);
        assert_eq!(params(1.0).cost_model.decode_interference_ms, Params::default().cost_model.decode_interference_ms);
        let (one, tenth) = (latency(1.0), latency(0.1));
        for (u, c) in [(5_000, 0), (300, 4_700)] {
            assert!((tenth.prefill_secs(u, c) - 0.1 * one.prefill_secs(u, c)).abs() < 1e-12);
        }
        assert!((tenth.decode_secs(8) - 0.1 * one.decode_secs(8)).abs() < 1e-12);
        let p = params(0.1);
        assert!((p.prefill.secs(5_000, 0) - tenth.prefill_secs(5_000, 0)).abs() < 1e-12, "the router prices what the engine does");
        assert_eq!(sim_flags(0.1)[..2], ["--prefill-token-us".to_string(), "10".to_string()]);
        assert_eq!(scrape_interval(1.0), Duration::from_millis(100));
        assert_eq!(scrape_interval(0.1), Duration::from_millis(10));
        assert_eq!(scrape_interval(0.001), Duration::from_millis(1));
    }
}
