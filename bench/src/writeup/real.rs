//! Capacity at the SLO on real simulator processes (`compare --capacity`):
//! each contender's highest rate per workload as a table and a chart, and
//! the rates the comparison ran at set against round robin's capacity.

use std::fmt::Write as _;
use std::path::Path;

use super::charts::{self, Bar, Bars};
use super::checks::BLIND;
use super::inputs::{Loaded, RealCapacity};
use super::{Contenders, contender_rank, in_workload_order, ms, num, pct, sources};

/// The share of round robin's capacity `just bench-routing` runs the comparison at.
const COMPARISON_LOAD: f64 = 0.7;
/// How far a run's share may be from it and still match (its rate is rounded to 0.001 req/s).
const LOAD_TOLERANCE: f64 = 0.01;

/// The capacity search of `contender` on `workload`, if one ran.
pub fn find<'a>(capacity: &'a [Loaded<RealCapacity>], workload: &str, contender: &str) -> Option<&'a RealCapacity> {
    capacity.iter().map(|c| &c.value).find(|c| c.workload == workload && c.contender == contender)
}

/// The search that found the highest capacity among `searches`.
pub fn fastest<'a>(searches: impl Iterator<Item = &'a RealCapacity>) -> Option<&'a RealCapacity> {
    searches.max_by(|a, b| a.rate.total_cmp(&b.rate))
}

/// The rates each workload's comparison ran at, as shares of round robin's
/// capacity on the same workload, and whether they are the share intended.
pub fn comparison_rates(routing: &Contenders, capacity: &[Loaded<RealCapacity>]) -> String {
    let (mut parts, mut off, mut unmeasured) = (Vec::new(), Vec::new(), Vec::new());
    for w in routing.workloads() {
        let mut rates: Vec<f64> =
            routing.contenders(&w).iter().flat_map(|c| routing.get(&w, c).unwrap_or_default().iter().map(|r| r.rate)).collect();
        rates.sort_by(f64::total_cmp);
        rates.dedup_by(|a, b| num(*a) == num(*b));
        let Some(rr) = find(capacity, &w, "round_robin") else {
            unmeasured.push(format!("{w} ({} req/s)", rates.iter().map(|r| num(*r)).collect::<Vec<_>>().join(", ")));
            continue;
        };
        for rate in rates {
            if rr.rate > 0.0 {
                let share = rate / rr.rate;
                parts.push(format!("{w} at {} req/s, {} of round_robin's {} req/s", num(rate), pct(share), num(rr.rate)));
                if (share - COMPARISON_LOAD).abs() > LOAD_TOLERANCE {
                    off.push(format!("{w} at {}", pct(share)));
                }
            } else {
                parts.push(format!("{w} at {} req/s, where round_robin met the SLO at no rate searched", num(rate)));
                off.push(format!("{w} (no capacity to take a share of)"));
            }
        }
    }
    let mut out = String::from("**Load.** ");
    if !parts.is_empty() {
        write!(out, "The comparison ran {} (round robin's capacity on real simulators, below).", parts.join("; ")).ok();
        if off.is_empty() {
            write!(out, " Each is {} of round robin's capacity, as `just bench-routing` intends.", pct(COMPARISON_LOAD)).ok();
        } else {
            write!(
                out,
                " These do not match the {} of round robin's capacity `just bench-routing` intends: {}.",
                pct(COMPARISON_LOAD),
                off.join(", ")
            )
            .ok();
        }
    }
    if !unmeasured.is_empty() {
        write!(
            out,
            "{}Round robin's capacity on real simulators is not measured for {}, so the load of those runs against it is not known.",
            if parts.is_empty() { "" } else { " " },
            unmeasured.join(", ")
        )
        .ok();
    }
    out
}

/// A section (its title and chart): every capacity search, as a table and a chart.
pub fn capacity_section(md: &mut String, out: &Path, (title, png): (&str, &str), capacity: &[Loaded<RealCapacity>]) -> anyhow::Result<()> {
    writeln!(md, "## {title}\n")?;
    if capacity.is_empty() {
        writeln!(md, "Not measured: the results hold no `compare --capacity` search (`capacity-*.json`).\n")?;
        return Ok(());
    }
    let runs = || capacity.iter().filter_map(|c| c.value.at_capacity.as_ref());
    writeln!(
        md,
        "Source: {}.\n",
        sources(capacity.iter().map(|c| (c.path.as_path(), c.value.at_capacity.as_ref().map_or("not recorded", |r| r.commit.as_str()))))
    )?;
    let commands: std::collections::BTreeSet<&str> = runs().map(|r| r.command.as_str()).collect();
    for c in commands {
        writeln!(md, "Command: `{c}`\n")?;
    }
    let slos: std::collections::BTreeSet<String> = runs().filter_map(|r| r.slo).map(|s| num(s.ttft_ms)).collect();
    writeln!(
        md,
        "A probe sends the same seeded requests at one rate to a cold fleet; it meets the SLO when every request succeeds and p99 TTFT after the warmup is within {}. The search doubles the rate from a first guess until a probe misses, then halves the bracket; *missed at* is the lowest rate found to miss. The last two columns are the probe at capacity's.\n",
        if slos.is_empty() {
            "the SLO (its value not recorded)".to_string()
        } else {
            format!("{} ms", slos.into_iter().collect::<Vec<_>>().join(" or "))
        }
    )?;
    writeln!(
        md,
        "| contender | workload | replicas | capacity req/s | against the best cache-blind | missed at req/s | probes | TTFT p99 ms | cached (usage) |\n|---|---|---|---|---|---|---|---|---|"
    )?;
    let workloads = in_workload_order(capacity.iter().map(|c| c.value.workload.clone()));
    let mut contenders: Vec<String> = Vec::new();
    for c in capacity {
        if !contenders.contains(&c.value.contender) {
            contenders.push(c.value.contender.clone());
        }
    }
    contenders.sort_by_key(|c| contender_rank(c));
    for w in &workloads {
        for name in &contenders {
            let Some(c) = find(capacity, w, name) else { continue };
            let blind = fastest(BLIND.iter().filter_map(|b| find(capacity, w, b)));
            let against = blind.filter(|b| b.rate > 0.0).map_or("n/a".into(), |b| format!("{:.2}x {}", c.rate / b.rate, b.contender));
            let probe = c.at_capacity.as_ref();
            writeln!(
                md,
                "| {name} | {w} | {} | {} | {against} | {} | {} | {} | {} |",
                c.replicas,
                num(c.rate),
                num(c.missed_at),
                c.probes,
                probe.map_or("n/a".into(), |r| ms(r.summary.ttft.p99_ms)),
                probe.and_then(|r| r.summary.prefix.hit_rate).map_or("n/a".into(), pct),
            )?;
        }
    }
    let values = workloads
        .iter()
        .map(|w| contenders.iter().map(|c| find(capacity, w, c).map(|c| Bar { value: c.rate, spread: None })).collect())
        .collect();
    charts::bars(&out.join(png), &Bars { title, y_label: "req/s", groups: workloads, series: contenders, values })?;
    writeln!(md, "\n![{title}]({png})\n")?;
    Ok(())
}
