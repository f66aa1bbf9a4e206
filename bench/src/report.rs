//! The JSON result files, and the latency summaries they hold.

use std::path::Path;

use serde::Serialize;

pub use inferrail_fleet::latency::{Latency, latency, quantile};

/// Writes `result` as pretty JSON to `out` (creating its folder) and prints it.
pub fn write(out: &Path, result: &impl Serialize) -> anyhow::Result<()> {
    println!("{}", save(out, result)?);
    Ok(())
}

/// Writes `result` as pretty JSON to `out` (creating its folder); returns the text.
pub fn save(out: &Path, result: &impl Serialize) -> anyhow::Result<String> {
    let text = serde_json::to_string_pretty(result)?;
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(out, format!("{text}\n"))?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let s: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let l = latency(s);
        assert_eq!((l.p50_ms, l.p99_ms, l.max_ms), (50.0, 99.0, 100.0));
        assert!((l.mean_ms - 50.5).abs() < 1e-9);
        assert_eq!(latency(Vec::new()).count, 0);
    }
}
