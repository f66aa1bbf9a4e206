//! The fleet simulation against the HTTP harness: the same workload, seed
//! and rate through a policy on real simulators (`compare`, repetition 0)
//! and in the simulation on as many replicas, side by side with the gap.

use std::fmt::Write as _;

use super::inputs::{FleetOutcome, FleetRuns, Latency, Loaded};
use super::{CompareRun, Contenders, contender_rank, median, ms, num, pct, sources, workload_rank};

/// One policy on one workload in both.
struct Pair<'a> {
    workload: &'a str,
    harness: &'a CompareRun,
    sim: &'a FleetOutcome,
}

/// Reads one percentile, milliseconds.
type Percentile = fn(&Latency) -> f64;

/// The TTFT percentiles compared, by name.
const PERCENTILES: [(&str, Percentile); 3] = [("p50", |l| l.p50_ms), ("p90", |l| l.p90_ms), ("p99", |l| l.p99_ms)];

/// Simulated replicas matched with the harness's simulators, policy names
/// matched exactly (the harness's `sglang:cache_aware`, SGLang's own
/// router, is not the simulation's `sglang_cache_aware`).
fn pairs<'a>(routing: &'a Contenders, files: &'a [Loaded<FleetRuns>]) -> Vec<Pair<'a>> {
    let mut out: Vec<Pair> = Vec::new();
    for f in files {
        let workload = f.value.workload.workload.as_str();
        for sim in &f.value.runs {
            let harness = routing.get(workload, &sim.policy).and_then(|runs| runs.iter().find(|r| r.rep == 0));
            let replicas = harness.and_then(|r| r.engines.as_ref()).map(|e| e.engines.len());
            if let Some(harness) = harness.filter(|_| replicas == Some(sim.replicas)) {
                out.push(Pair { workload, harness, sim });
            }
        }
    }
    out.sort_by_key(|p| (workload_rank(p.workload), p.workload.to_string(), contender_rank(&p.sim.policy)));
    out
}

/// `harness / simulation / gap` for a TTFT percentile: the gap in ms and as a ratio.
fn ttft_cell(harness: f64, sim: f64) -> String {
    let ratio = if harness > 0.0 { format!(" ({:.2}x)", sim / harness) } else { String::new() };
    // The gap of the values as shown, so that the row adds up.
    let (h, s) = (ms(harness), ms(sim));
    let gap = s.parse::<f64>().unwrap_or(sim) - h.parse::<f64>().unwrap_or(harness);
    format!("{h} / {s} / {gap:+.0} ms{ratio}")
}

/// The cached share in points, simulation minus harness.
fn hit_gap(p: &Pair) -> Option<f64> {
    p.harness.prefix_all.as_ref().and_then(|h| h.hit_rate).map(|h| (p.sim.hit_rate - h) * 100.0)
}

/// One row of the table.
fn row(p: &Pair) -> String {
    let harness_hit = p.harness.prefix_all.as_ref().and_then(|h| h.hit_rate);
    let hit = format!(
        "{} / {} / {}",
        harness_hit.map_or("n/a".into(), pct),
        pct(p.sim.hit_rate),
        // No "-0.0" for a gap that rounds to nothing.
        hit_gap(p).map_or("n/a".into(), |g| format!("{:+.1} pts", if g.abs() < 0.05 { 0.0 } else { g }))
    );
    let ttft: Vec<String> = PERCENTILES.iter().map(|(_, f)| ttft_cell(f(&p.harness.summary.ttft), f(&p.sim.ttft))).collect();
    format!("| {} | {} | {} | {hit} | {} |", p.workload, p.sim.policy, p.sim.replicas, ttft.join(" | "))
}

/// The median gaps over every row.
fn summary(pairs: &[Pair]) -> String {
    let hit = median(pairs.iter().filter_map(hit_gap).map(f64::abs).collect());
    let ttft: Vec<String> = PERCENTILES
        .iter()
        .map(|(name, f)| {
            let gaps = pairs.iter().map(|p| (f(&p.sim.ttft) - f(&p.harness.summary.ttft)).abs()).collect();
            let ratios =
                pairs.iter().filter(|p| f(&p.harness.summary.ttft) > 0.0).map(|p| f(&p.sim.ttft) / f(&p.harness.summary.ttft)).collect();
            format!(
                "{name} {} ms apart, simulation over harness {}",
                median(gaps).map_or("n/a".into(), ms),
                median(ratios).map_or("n/a".into(), |r| format!("{r:.2}x"))
            )
        })
        .collect();
    format!(
        "Median gap over {} policy and workload pairs: cached share {} points apart; TTFT {}.",
        pairs.len(),
        hit.map_or("n/a".into(), |h| format!("{h:.1}")),
        ttft.join("; ")
    )
}

/// The section: per workload the settings of both, the table and the median gap.
pub fn section(md: &mut String, routing: &Contenders, files: &[Loaded<FleetRuns>]) -> anyhow::Result<()> {
    writeln!(md, "## Fleet simulation against the HTTP harness\n")?;
    if files.is_empty() {
        writeln!(md, "Not measured: the results hold no fleet simulation of the comparison's requests (`fleet-<workload>.json`).\n")?;
        return Ok(());
    }
    writeln!(md, "Source: {}.\n", sources(files.iter().map(|f| (f.path.as_path(), f.value.commit.as_str()))))?;
    for f in files {
        writeln!(md, "Command: `{}`\n", f.value.command)?;
    }
    writeln!(
        md,
        "Each row sets a policy's first repetition through the HTTP harness on real simulators against the fleet simulation of the same workload on as many simulated replicas. Cached share: prompt tokens cached, from usage, over every request, warmup included, in both. TTFT: the harness's summary leaves the warmup out while the fleet simulation counts every request, warmup included. Each cell is harness / simulation / gap, the gap being the simulation's value less the harness's (points for the cached share; ms, and the simulation over the harness as a ratio, for TTFT).\n"
    )?;
    let pairs = pairs(routing, files);
    let mut files: Vec<&Loaded<FleetRuns>> = files.iter().collect();
    files.sort_by_key(|f| workload_rank(&f.value.workload.workload));
    for f in files {
        let v = &f.value;
        let w = &v.workload.workload;
        let harness = pairs.iter().find(|p| p.workload == w).map(|p| p.harness);
        writeln!(
            md,
            "- {w}: simulation {} requests at {} req/s, seed {}; harness {}.",
            v.runs.first().map_or(0, |o| o.requests),
            num(v.rate),
            v.seed,
            harness.map_or("has no run of a simulated policy on as many replicas".into(), |r| format!(
                "{} requests sent at {} req/s, seed {}",
                r.sent.map_or("an unrecorded number of".into(), |n| n.to_string()),
                num(r.rate),
                r.seed
            ))
        )?;
    }
    writeln!(md, "\n| workload | policy | replicas | cached | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms |\n|---|---|---|---|---|---|---|")?;
    for p in &pairs {
        writeln!(md, "{}", row(p))?;
    }
    writeln!(
        md,
        "\n{}\n",
        if pairs.is_empty() { "No policy ran in both on the same workload and replicas.".into() } else { summary(&pairs) }
    )?;
    Ok(())
}
