//! The fit recovers known parameters from noisy probes, and clamps at zero.

use super::*;
use proptest::prelude::*;

/// A grid wide enough that each term matters somewhere.
fn grid() -> Vec<(usize, usize)> {
    let mut g = Vec::new();
    for c in [0, 2048, 8192, 32768] {
        for u in [16, 64, 256, 1024, 4096] {
            g.push((u, c));
        }
    }
    g
}

fn observe(model: &Prefill, noise: &[f64]) -> Vec<Observation> {
    let shapes = grid();
    (0..noise.len())
        .map(|i| {
            let (u, c) = shapes[i % shapes.len()];
            Observation { uncached: u, cached: c, secs: model.secs(u, c) * (1.0 + noise[i]) }
        })
        .collect()
}

fn close(got: f64, want: f64, tol: f64) -> bool {
    (got - want).abs() <= tol * want.abs()
}

#[test]
fn exact_probes_give_exact_parameters() {
    let truth = Prefill { prefill_token_us: 100.0, prefill_pair_ns: 3.3, prefill_fixed_ms: 5.0 };
    let fit = match fit(&observe(&truth, &[0.0; 20])) {
        Ok(f) => f,
        Err(e) => panic!("{e}"),
    };
    assert!(close(fit.model.prefill_token_us, 100.0, 1e-9), "{:?}", fit.model);
    assert!(close(fit.model.prefill_pair_ns, 3.3, 1e-9), "{:?}", fit.model);
    assert!(close(fit.model.prefill_fixed_ms, 5.0, 1e-9), "{:?}", fit.model);
    assert!(fit.max_relative() < 1e-9);
}

#[test]
fn a_negative_fixed_cost_is_clamped_to_zero() {
    // Times generated with d = -2 ms: the best non-negative d is 0.
    let shapes = grid();
    let obs: Vec<Observation> = shapes
        .iter()
        .filter(|(u, _)| *u >= 256)
        .map(|&(u, c)| Observation {
            uncached: u,
            cached: c,
            secs: 80e-6 * u as f64 + 2e-9 * u as f64 * (c as f64 + u as f64 / 2.0) - 2e-3,
        })
        .collect();
    let fit = match fit(&obs) {
        Ok(f) => f,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(fit.model.prefill_fixed_ms, 0.0, "{:?}", fit.model);
    assert!(fit.model.prefill_token_us > 0.0 && fit.model.prefill_pair_ns > 0.0, "{:?}", fit.model);
}

#[test]
fn too_few_shapes_and_bad_times_are_refused() {
    let o = |u, c, secs| Observation { uncached: u, cached: c, secs };
    assert_eq!(fit(&[o(16, 0, 0.01), o(16, 0, 0.01), o(32, 0, 0.02)]), Err(FitError::TooFewShapes { distinct: 2 }));
    assert!(matches!(fit(&[o(16, 0, 0.01), o(32, 0, 0.0), o(64, 0, 0.02)]), Err(FitError::BadTime { uncached: 32, .. })));
}

#[test]
fn the_fragment_uses_the_config_keys() {
    let m = Prefill { prefill_token_us: 100.0, prefill_pair_ns: 3.3, prefill_fixed_ms: 0.0 };
    assert_eq!(yaml_fragment(&m), "prefill:\n  prefill_token_us: 100.0\n  prefill_pair_ns: 3.300\n  prefill_fixed_ms: 0.0\n");
}

proptest! {
    #[test]
    fn recovers_parameters_through_one_percent_noise(
        a in 20.0f64..200.0,
        b in 2.0f64..10.0,
        d in 1.0f64..20.0,
        noise in proptest::collection::vec(-0.01f64..0.01, 40),
    ) {
        let truth = Prefill { prefill_token_us: a, prefill_pair_ns: b, prefill_fixed_ms: d };
        let fit = fit(&observe(&truth, &noise)).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let m = fit.model;
        prop_assert!(close(m.prefill_token_us, a, 0.03), "a {} vs {a}", m.prefill_token_us);
        prop_assert!(close(m.prefill_pair_ns, b, 0.05), "b {} vs {b}", m.prefill_pair_ns);
        prop_assert!(close(m.prefill_fixed_ms, d, 0.05), "d {} vs {d}", m.prefill_fixed_ms);
        prop_assert!(fit.max_relative() < 0.03);
    }

    #[test]
    fn a_parameter_that_is_zero_stays_non_negative(
        a in 20.0f64..200.0,
        d in 1.0f64..20.0,
        noise in proptest::collection::vec(-0.01f64..0.01, 40),
    ) {
        // No pair cost at all: noise may push the unconstrained b below zero;
        // the fit must clamp it rather than report a negative cost.
        let truth = Prefill { prefill_token_us: a, prefill_pair_ns: 0.0, prefill_fixed_ms: d };
        let m = fit(&observe(&truth, &noise)).map_err(|e| TestCaseError::fail(e.to_string()))?.model;
        prop_assert!(m.prefill_token_us >= 0.0 && m.prefill_pair_ns >= 0.0 && m.prefill_fixed_ms >= 0.0, "{m:?}");
        prop_assert!(close(m.prefill_token_us, a, 0.03), "a {} vs {a}", m.prefill_token_us);
        prop_assert!(m.prefill_pair_ns < 0.1, "b {}", m.prefill_pair_ns);
    }
}
