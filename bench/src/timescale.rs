//! Time scale: the simulator's latency model, and the router's costs that
//! mirror it, made uniformly faster (or slower) by one factor, so that a
//! comparison of many runs fits the machine's time. At scale `s` an engine
//! does in `s` seconds what the default model does in one: the same load is
//! `1 / s` times the arrival rate, and the SLO is `s` times as long.

use inferrail_policy::{Params, Prefill};
use inferrail_sim::cost::{DEFAULT, LatencyModel};

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
    p
}

/// `params(s)` with `overrides` (the routing YAML's `policies`, as JSON)
/// laid over it key by key: `{"cost_model": {"share_weight": 0}}` changes
/// that one parameter and keeps the time scale's others.
pub fn tuned(s: f64, overrides: Option<&serde_json::Value>) -> anyhow::Result<Params> {
    fn lay(base: &mut serde_json::Value, over: &serde_json::Value) {
        match (base, over) {
            (serde_json::Value::Object(b), serde_json::Value::Object(o)) => {
                for (k, v) in o {
                    lay(b.entry(k.clone()).or_insert(serde_json::Value::Null), v);
                }
            }
            (b, o) => *b = o.clone(),
        }
    }
    let mut p = serde_json::to_value(params(s))?;
    if let Some(o) = overrides {
        lay(&mut p, o);
    }
    let p: Params = serde_json::from_value(p)?;
    let problems = p.validate("policies");
    anyhow::ensure!(problems.is_empty(), "--policy-params: {}", problems.join("; "));
    Ok(p)
}

/// A `--policy-params` flag: a JSON object.
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
    }

    #[test]
    fn overrides_change_only_what_they_name_and_bad_ones_are_refused() -> anyhow::Result<()> {
        let over =
            parse_overrides(r#"{"cost_model": {"share_weight": 0, "hot_prefix": {"enabled": false}}}"#).map_err(anyhow::Error::msg)?;
        let (base, p) = (params(0.1), tuned(0.1, Some(&over))?);
        assert_eq!(p.cost_model.share_weight, 0.0);
        assert!(!p.cost_model.hot_prefix.enabled);
        assert_eq!(p.cost_model.hot_prefix.blocks, base.cost_model.hot_prefix.blocks, "its siblings kept");
        assert_eq!(p.cost_model.decode_interference_ms, base.cost_model.decode_interference_ms, "the time scale's kept");
        assert_eq!(p.prefill, base.prefill);
        assert_eq!(tuned(0.1, None)?.cost_model, base.cost_model);
        assert!(
            tuned(1.0, Some(&parse_overrides(r#"{"cost_model": {"kappa": 2}}"#).map_err(anyhow::Error::msg)?)).is_err(),
            "kappa above 1"
        );
        assert!(parse_overrides("[1]").is_err());
        Ok(())
    }
}
