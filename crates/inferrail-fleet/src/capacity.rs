//! Capacity at an SLO: the highest arrival rate a fleet serves with p99 TTFT
//! within the SLO and no request refused, found by bisection; and the fewest
//! replicas that serve a given rate so (the GPUs-saved figure).
//!
//! A probe runs the same seeded requests at a new rate (the arrival gaps
//! scale with the rate; the prompts stay the same), so probes differ only in
//! load. The rate search doubles from a guess until a probe fails, then
//! halves the bracket until it is within [`Search::tolerance`]. The search
//! runs simulations here and real fleets in `compare --capacity`.

use serde::Serialize;

use crate::sim::Outcome;

/// How finely to search.
#[derive(Debug, Clone, Copy)]
pub struct Search {
    /// p99 TTFT the fleet must keep, seconds.
    pub slo_s: f64,
    /// Stop once the bracket is this fraction of its top.
    pub tolerance: f64,
    /// First rate tried per replica, requests per second.
    pub guess_per_replica: f64,
}

/// Whether a probe met the SLO.
pub fn met(o: &Outcome, slo_s: f64) -> bool {
    o.rejected == 0 && o.ttft.p99_ms <= slo_s * 1e3
}

/// One policy's capacity on one fleet size; `T` is what a probe measured.
#[derive(Debug, Clone, Serialize)]
pub struct Capacity<T = Outcome> {
    /// Replicas.
    pub replicas: usize,
    /// Highest rate that met the SLO, requests per second (0 when none did).
    pub rate: f64,
    /// The lowest rate found to miss it.
    pub missed_at: f64,
    /// The probe at `rate`, if one met the SLO.
    pub at_capacity: Option<T>,
    /// Probes run.
    pub probes: usize,
}

/// The highest rate at which `probe(rate)` meets the SLO on `replicas`.
pub fn rate(replicas: usize, search: Search, mut probe: impl FnMut(f64) -> anyhow::Result<Outcome>) -> anyhow::Result<Capacity> {
    search_rate(replicas, search, |rate| probe(rate).map(|o| (met(&o, search.slo_s), o)))
}

/// The highest rate at which `probe(rate)` says it met the SLO, as `rate` does it.
pub fn search_rate<T>(
    replicas: usize,
    search: Search,
    mut probe: impl FnMut(f64) -> anyhow::Result<(bool, T)>,
) -> anyhow::Result<Capacity<T>> {
    let mut probes = 0;
    let mut run = |rate: f64| {
        probes += 1;
        probe(rate)
    };
    let (mut lo, mut best) = (0.0, None);
    let mut hi = search.guess_per_replica * replicas as f64;
    // Double until a probe misses (or the rate is absurd).
    loop {
        let (ok, o) = run(hi)?;
        if !ok {
            break;
        }
        lo = hi;
        best = Some(o);
        hi *= 2.0;
        anyhow::ensure!(hi < 1e9, "every rate up to {lo} met the SLO");
    }
    // Below a tolerance's share of the first guess with nothing met, no rate meets it: capacity 0.
    let floor = search.guess_per_replica * replicas as f64 * search.tolerance;
    while hi - lo > search.tolerance * hi && !(best.is_none() && hi < floor) {
        let mid = (lo + hi) / 2.0;
        let (ok, o) = run(mid)?;
        if ok {
            lo = mid;
            best = Some(o);
        } else {
            hi = mid;
        }
    }
    Ok(Capacity { replicas, rate: lo, missed_at: hi, at_capacity: best, probes })
}

/// The fewest replicas for which `probe(replicas)` meets the SLO, from
/// `fewest` (a disaggregated fleet needs two) to at most `max`; `None` when
/// even `max` does not.
pub fn replicas(
    fewest: usize,
    max: usize,
    slo_s: f64,
    mut probe: impl FnMut(usize) -> anyhow::Result<Outcome>,
) -> anyhow::Result<Option<usize>> {
    let fewest = fewest.max(1);
    let mut hi = fewest;
    loop {
        if met(&probe(hi)?, slo_s) {
            break;
        }
        if hi >= max {
            return Ok(None);
        }
        hi = (hi * 2).min(max);
    }
    // hi meets it; every count at or below lo is known (or assumed) to miss.
    let mut lo = (hi / 2).max(fewest - 1);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if met(&probe(mid)?, slo_s) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(Some(hi))
}
