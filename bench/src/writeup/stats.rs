//! Statistics over the routing runs: means and medians, pooled TTFT
//! percentiles with the repetitions' spread, and two contenders' p99 over
//! the same requests with a bootstrap interval.

use super::charts::Bar;
use super::inputs::{CompareRun, Latency};

/// The median (none for nothing).
pub(super) fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    (n > 0).then(|| if n % 2 == 1 { values[n / 2] } else { (values[n / 2 - 1] + values[n / 2]) / 2.0 })
}

/// Arithmetic mean (0 for nothing).
pub fn mean(values: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = values.fold((0.0, 0usize), |(s, n), v| (s + v, n + 1));
    if n == 0 { 0.0 } else { sum / n as f64 }
}

/// The mean of a metric over repetitions, with the spread when there are several.
pub(super) fn bar(values: &[f64]) -> Bar {
    let spread = (values.len() > 1)
        .then(|| (values.iter().copied().fold(f64::INFINITY, f64::min), values.iter().copied().fold(f64::NEG_INFINITY, f64::max)));
    Bar { value: mean(values.iter().copied()), spread }
}

/// The measured TTFTs of every repetition together, sorted; none when a
/// repetition's result predates per-request TTFTs.
pub(super) fn pooled_ttfts(runs: &[CompareRun]) -> Option<Vec<f64>> {
    let mut all = Vec::new();
    for r in runs {
        all.extend_from_slice(r.ttft_ms.as_deref()?);
    }
    all.sort_by(f64::total_cmp);
    Some(all)
}

/// A TTFT percentile (`q`) of one contender on one workload over the
/// measured requests of all its repetitions together (nearest rank), with
/// the repetitions' own (`own`) as the spread. A 25-second repetition at
/// 70% load holds 100-150 requests, so its p99 is its slowest request or
/// next to it, and the mean of three such is the mean of three maxima;
/// pooled, the p99 rests on three to four hundred. Results without
/// per-request TTFTs give the mean of the repetitions' own; no request
/// served at all, infinity (never the best).
pub fn ttft(runs: &[CompareRun], q: f64, own: fn(&Latency) -> f64) -> Bar {
    let mut b = bar(&runs.iter().map(|r| own(&r.summary.ttft)).collect::<Vec<_>>());
    match pooled_ttfts(runs) {
        Some(all) if all.is_empty() => b.value = f64::INFINITY,
        Some(all) => b.value = crate::report::quantile(&all, q),
        None => {}
    }
    b
}

/// [`ttft`]'s p50.
pub fn ttft_p50(runs: &[CompareRun]) -> Bar {
    ttft(runs, 0.50, |l| l.p50_ms)
}

/// [`ttft`]'s p99.
pub fn ttft_p99(runs: &[CompareRun]) -> Bar {
    ttft(runs, 0.99, |l| l.p99_ms)
}

/// The same requests' TTFTs under two contenders, `(a's, b's)`, over the
/// repetitions both ran with the same seed at the same rate (the same
/// schedule) where each measured every request: their TTFTs are then of
/// the same requests in the same scheduled order. A repetition that lost a
/// request does not pair; none: no repetition pairs.
pub fn paired_ttfts(a: &[CompareRun], b: &[CompareRun]) -> Option<Vec<(f64, f64)>> {
    fn whole(r: &CompareRun) -> Option<&[f64]> {
        r.ttft_ms.as_deref().filter(|t| r.summary.ok == r.summary.requests && t.len() == r.summary.requests)
    }
    let mut pairs = Vec::new();
    for x in a {
        let same = b.iter().find(|y| y.seed == x.seed && y.rate == x.rate && y.sent == x.sent);
        if let Some((tx, ty)) = whole(x).zip(same.and_then(whole)) {
            pairs.extend(tx.iter().copied().zip(ty.iter().copied()));
        }
    }
    (!pairs.is_empty()).then_some(pairs)
}

/// Two contenders' p99 TTFT over the same requests, compared.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairedP99 {
    pub requests: usize,
    /// The first's p99 minus the second's, milliseconds.
    pub difference: f64,
    /// The 95% bootstrap interval of the difference.
    pub low: f64,
    pub high: f64,
    /// The median of the per-request differences: what every request pays or saves, tail or not.
    pub median_request: f64,
}

/// Resamples of the bootstrap; its seed is fixed, so the same results give the same interval.
pub(super) const RESAMPLES: usize = 2000;

/// [`PairedP99`] of `(a, b)` TTFT pairs: the interval resamples whole pairs,
/// so what the requests themselves ask (an 8,000-token prompt computed cold
/// under both) does not count as a difference between the contenders.
pub fn paired_p99(pairs: &[(f64, f64)]) -> PairedP99 {
    use rand::{Rng as _, SeedableRng as _};
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let mut resampled: Vec<f64> =
        (0..RESAMPLES).map(|_| p99_difference((0..pairs.len()).map(|_| pairs[rng.random_range(0..pairs.len())]))).collect();
    resampled.sort_by(f64::total_cmp);
    let mut each: Vec<f64> = pairs.iter().map(|(a, b)| a - b).collect();
    each.sort_by(f64::total_cmp);
    PairedP99 {
        requests: pairs.len(),
        difference: p99_difference(pairs.iter().copied()),
        low: crate::report::quantile(&resampled, 0.025),
        high: crate::report::quantile(&resampled, 0.975),
        median_request: crate::report::quantile(&each, 0.5),
    }
}

/// The first's p99 minus the second's over `(a, b)` pairs.
fn p99_difference(pairs: impl Iterator<Item = (f64, f64)>) -> f64 {
    let (mut a, mut b): (Vec<f64>, Vec<f64>) = pairs.unzip();
    a.sort_by(f64::total_cmp);
    b.sort_by(f64::total_cmp);
    crate::report::quantile(&a, 0.99) - crate::report::quantile(&b, 0.99)
}
