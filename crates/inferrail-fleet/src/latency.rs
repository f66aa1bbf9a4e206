//! Latency summaries: nearest-rank percentiles of a sample, in milliseconds.

use std::time::Duration;

use serde::Serialize;

/// Percentiles of a latency sample, in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    /// Observations.
    pub count: usize,
    /// Median.
    pub p50_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Largest.
    pub max_ms: f64,
    /// Arithmetic mean.
    pub mean_ms: f64,
}

/// The nearest-rank quantile `q` of a sorted sample (0 for none).
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Summarizes a sample (nearest-rank percentiles).
pub fn latency(mut sample: Vec<Duration>) -> Latency {
    sample.sort_unstable();
    let ms: Vec<f64> = sample.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    let at = |q: f64| quantile(&ms, q);
    let mean_ms = if sample.is_empty() { 0.0 } else { sample.iter().map(Duration::as_secs_f64).sum::<f64>() * 1e3 / sample.len() as f64 };
    Latency { count: sample.len(), p50_ms: at(0.50), p90_ms: at(0.90), p99_ms: at(0.99), max_ms: at(1.0), mean_ms }
}
