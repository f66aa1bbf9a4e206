//! Fitting the prefill cost model to measured probes.
//!
//! The router estimates a prefill of `u` uncached tokens after `c` cached
//! ones as `P(u, c) = a*u + b*u*(c + u/2) + d` seconds. Given probes with
//! known `u`, `c` and engine-measured seconds, [`fit`] finds `a, b, d >= 0` by
//! non-negative least squares over the columns `u`, `u*(c + u/2)` and `1`.
//!
//! Residuals are *relative*: each row is divided by its measured time, so a
//! 5 ms probe weighs as much as a 500 ms one. Engine timing noise is roughly
//! proportional to the step length, and without the weighting the long
//! probes would drown the fixed cost `d`. Columns are then scaled to unit
//! length so the solver sees numbers of similar size.

pub use inferrail_policy::Prefill;

use crate::nnls::{NnlsError, nnls};

/// One measured prefill.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Observation {
    /// Prompt tokens the engine computed.
    pub uncached: usize,
    /// Prompt tokens the engine found cached.
    pub cached: usize,
    /// Prefill time as the engine measured it, seconds.
    pub secs: f64,
}

/// The router config fragment that sets `model`, for `routing.policies`.
pub fn yaml_fragment(model: &Prefill) -> String {
    format!(
        "prefill:\n  prefill_token_us: {}\n  prefill_pair_ns: {}\n  prefill_fixed_ms: {}\n",
        decimal(model.prefill_token_us),
        decimal(model.prefill_pair_ns),
        decimal(model.prefill_fixed_ms)
    )
}

/// How far one probe lies from the fitted model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Residual {
    /// The probe.
    pub observation: Observation,
    /// The model's prediction, seconds.
    pub predicted_secs: f64,
}

impl Residual {
    /// `(measured - predicted) / measured`.
    pub fn relative(&self) -> f64 {
        (self.observation.secs - self.predicted_secs) / self.observation.secs
    }
}

/// A fitted model and how well it fits.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    /// The parameters.
    pub model: Prefill,
    /// One per observation, in order.
    pub residuals: Vec<Residual>,
}

impl Fit {
    /// Root mean square of the relative residuals.
    pub fn rms_relative(&self) -> f64 {
        let n = self.residuals.len().max(1) as f64;
        (self.residuals.iter().map(|r| r.relative().powi(2)).sum::<f64>() / n).sqrt()
    }

    /// The largest relative residual in magnitude.
    pub fn max_relative(&self) -> f64 {
        self.residuals.iter().map(|r| r.relative().abs()).fold(0.0, f64::max)
    }
}

/// Why the model could not be fitted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FitError {
    /// Three parameters need probes of at least three different shapes.
    #[error("{distinct} distinct (uncached, cached) probe shapes; at least 3 are needed to fit a, b and d")]
    TooFewShapes {
        /// Distinct shapes among the observations.
        distinct: usize,
    },
    /// A probe took no time, negative time or an unreadable time.
    #[error("probe of {uncached} uncached after {cached} cached tokens measured {secs} s; times must be positive")]
    BadTime {
        /// The probe's uncached tokens.
        uncached: usize,
        /// The probe's cached tokens.
        cached: usize,
        /// What was measured.
        secs: f64,
    },
    /// The solver refused the problem.
    #[error(transparent)]
    Nnls(#[from] NnlsError),
}

/// Fits `a, b, d >= 0` to the observations; see the module doc.
pub fn fit(observations: &[Observation]) -> Result<Fit, FitError> {
    if let Some(o) = observations.iter().find(|o| !(o.secs.is_finite() && o.secs > 0.0)) {
        return Err(FitError::BadTime { uncached: o.uncached, cached: o.cached, secs: o.secs });
    }
    let mut shapes: Vec<(usize, usize)> = observations.iter().map(|o| (o.uncached, o.cached)).collect();
    shapes.sort_unstable();
    shapes.dedup();
    if shapes.len() < 3 {
        return Err(FitError::TooFewShapes { distinct: shapes.len() });
    }
    let mut rows: Vec<Vec<f64>> = observations.iter().map(|o| columns(o.uncached, o.cached).iter().map(|x| x / o.secs).collect()).collect();
    let y = vec![1.0; rows.len()];
    let mut scale = [0.0f64; 3];
    for (j, s) in scale.iter_mut().enumerate() {
        let norm = rows.iter().map(|r| r[j] * r[j]).sum::<f64>().sqrt();
        *s = if norm > 0.0 { norm } else { 1.0 };
    }
    for r in &mut rows {
        for (x, s) in r.iter_mut().zip(&scale) {
            *x /= s;
        }
    }
    let z = nnls(&rows, &y)?;
    let coef = |j: usize| z.get(j).copied().unwrap_or(0.0) / scale[j];
    let model = Prefill { prefill_token_us: coef(0) * 1e6, prefill_pair_ns: coef(1) * 1e9, prefill_fixed_ms: coef(2) * 1e3 };
    let residuals = observations.iter().map(|&o| Residual { observation: o, predicted_secs: model.secs(o.uncached, o.cached) }).collect();
    Ok(Fit { model, residuals })
}

/// The design row of a probe: `u`, `u*(c + u/2)`, `1`.
fn columns(uncached: usize, cached: usize) -> [f64; 3] {
    let (u, c) = (uncached as f64, cached as f64);
    [u, u * (c + u / 2.0), 1.0]
}

/// A number with four significant digits, written plainly (YAML reads it as a float).
fn decimal(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return "0.0".into();
    }
    let digits = (3 - v.abs().log10().floor() as i32).clamp(1, 12) as usize;
    format!("{v:.digits$}")
}

#[cfg(test)]
mod tests;
