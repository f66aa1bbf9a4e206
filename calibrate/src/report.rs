//! Human-readable output: one line per probe, then the fit and its residuals.

use std::fmt::Write as _;

use crate::fit::Fit;
use crate::run::Measurement;

/// A table of the probes beside the fitted model's predictions.
/// `fit.residuals` must be in the order of `measurements`, as [`crate::fit::fit`] returns them.
pub fn probe_table(measurements: &[Measurement], fit: &Fit) -> String {
    let mut out = String::from("planned c  planned u     cached   computed  engine ms   model ms  resid %  overhead ms\n");
    for (m, r) in measurements.iter().zip(&fit.residuals) {
        let o = m.observation();
        // Writing to a String cannot fail.
        let _ = writeln!(
            out,
            "{:>9}  {:>9}  {:>9}  {:>9}  {:>9.3}  {:>9.3}  {:>+7.2}  {:>11.3}",
            m.planned_cached,
            m.planned_uncached,
            o.cached,
            o.uncached,
            o.secs * 1e3,
            r.predicted_secs * 1e3,
            r.relative() * 100.0,
            m.overhead_secs() * 1e3
        );
    }
    out
}

/// The fitted parameters, the residuals in summary and the client overhead.
pub fn summary(measurements: &[Measurement], fit: &Fit) -> String {
    let m = fit.model;
    let mut overhead: Vec<f64> = measurements.iter().map(|m| m.overhead_secs() * 1e3).collect();
    overhead.sort_by(f64::total_cmp);
    let median = overhead.get(overhead.len() / 2).copied().unwrap_or(f64::NAN);
    let short_cached = measurements.iter().filter(|m| m.cached_tokens < m.planned_cached).count();
    let mut out = format!(
        "fit over {} probes: a = {:.4} us/token, b = {:.4} ns/pair, d = {:.4} ms\n\
         relative residuals: rms {:.2}%, max {:.2}%\n\
         client overhead beyond engine TTFT (not in the fit): median {median:.3} ms, max {:.3} ms\n",
        fit.residuals.len(),
        m.prefill_token_us,
        m.prefill_pair_ns,
        m.prefill_fixed_ms,
        fit.rms_relative() * 100.0,
        fit.max_relative() * 100.0,
        overhead.last().copied().unwrap_or(f64::NAN),
    );
    if short_cached > 0 {
        let _ = writeln!(out, "{short_cached} probes found less cached than planned; they were fitted on what the engine computed");
    }
    out
}
