//! Capacity at the SLO in the fleet simulation: each workload's highest
//! rate per policy and replica count, the replicas a fixed rate needs, and
//! a chart of the rate per replica.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use super::charts::{self, Bar, Bars};
use super::inputs::FleetWorkload;
use super::stats::bar;
use super::text::{cell, pct, sources};

/// Capacity searches of the fleet simulation, grouped by workload, under a
/// heading (its title, and a paragraph unless empty), with the chart `png`.
pub fn section(md: &mut String, out: &Path, (title, intro): (&str, &str), png: &str, fleet: &[FleetWorkload]) -> anyhow::Result<()> {
    writeln!(md, "## {title}\n")?;
    if !intro.is_empty() {
        writeln!(md, "{intro}\n")?;
    }
    let files = fleet.iter().flat_map(|g| &g.files);
    writeln!(md, "Source: {}.\n", sources(files.map(|f| (f.path.as_path(), f.value.commit.as_str()))))?;
    let mut groups = Vec::new();
    let mut rows: Vec<BTreeMap<String, Bar>> = Vec::new();
    let mut policies: Vec<String> = Vec::new();
    for g in fleet {
        for f in &g.files {
            writeln!(md, "Command: `{}`\n", f.value.command)?;
        }
        let mut seeds: Vec<String> = g.files.iter().map(|f| f.value.seed.to_string()).collect();
        seeds.dedup();
        let over = if seeds.len() > 1 {
            format!(
                "; the mean over seeds {} with the lowest and highest in parentheses, and the ratio to round robin of the sums over the seeds",
                seeds.join(", ")
            )
        } else {
            String::new()
        };
        let slo = g.files.first().map_or(0.0, |f| f.value.slo_ttft_ms);
        writeln!(md, "**{}**, p99 TTFT within {slo} ms: highest arrival rate (req/s) per policy and replica count{over}\n", g.workload)?;
        let sizes = g.sizes();
        writeln!(
            md,
            "| policy | {} |\n|---|{}",
            sizes.iter().map(|n| format!("{n} replicas")).collect::<Vec<_>>().join(" | "),
            "---|".repeat(sizes.len())
        )?;
        for policy in g.policies() {
            if !policies.iter().any(|p| p == policy) {
                policies.push(policy.to_owned());
            }
            let cells: Vec<String> = sizes
                .iter()
                .map(|&n| {
                    let rates = g.rates(policy, n);
                    if rates.is_empty() {
                        return "n/a".into();
                    }
                    let b = bar(&rates);
                    let spread = b.spread.map_or(String::new(), |(lo, hi)| format!("{lo:.2}–{hi:.2}; "));
                    match g.ratio(policy, "round_robin", n) {
                        Some((r, _)) if r.is_finite() => format!("{:.2} ({spread}{r:.2}x rr)", b.value),
                        _ => cell(b, |x| format!("{x:.2}")),
                    }
                })
                .collect();
            writeln!(md, "| {policy} | {} |", cells.join(" | "))?;
        }
        for &n in &sizes {
            groups.push(format!("{} x{n}", g.workload));
            rows.push(
                g.policies()
                    .into_iter()
                    .filter_map(|p| {
                        let per: Vec<f64> = g.rates(p, n).iter().map(|r| r / n as f64).collect();
                        (!per.is_empty()).then(|| (p.to_owned(), bar(&per)))
                    })
                    .collect(),
            );
        }
        writeln!(md)?;
        for f in &g.files {
            let v = &f.value;
            let Some(rate) = v.fixed_rate else { continue };
            let needed: Vec<String> = v
                .replicas_needed
                .iter()
                .map(|(p, n)| format!("{p} {}", n.map_or("more than searched".into(), |n| n.to_string())))
                .collect();
            let saved = v
                .replicas_needed
                .iter()
                .find(|(p, _)| p == "cost_model")
                .and_then(|(_, n)| *n)
                .zip(v.replicas_needed.iter().find(|(p, _)| p == "round_robin").and_then(|(_, n)| *n));
            // The search's default rate is round robin's capacity on the largest fleet: say so when it is.
            let rr_largest = v.capacity.iter().find(|(p, _)| p == "round_robin").and_then(|(_, per)| per.iter().max_by_key(|c| c.replicas));
            let whose = rr_largest
                .filter(|c| c.rate == rate)
                .map_or(String::new(), |c| format!(" (round_robin's capacity on {} replicas)", c.replicas));
            writeln!(
                md,
                "Seed {}: replicas needed for {rate} req/s{whose} within the SLO: {}.{}\n",
                v.seed,
                needed.join(", "),
                saved.map_or(String::new(), |(c, r)| format!(
                    " GPUs saved by cost_model against round_robin: {} of {r} ({}).",
                    r as i64 - c as i64,
                    pct(1.0 - c as f64 / r as f64)
                ))
            )?;
        }
    }
    let values = rows.iter().map(|row| policies.iter().map(|p| row.get(p).copied()).collect()).collect();
    let chart_title = format!("{title} (req/s per replica)");
    charts::bars(&out.join(png), &Bars { title: &chart_title, y_label: "req/s per replica", groups, series: policies, values })?;
    writeln!(md, "![{title}]({png})\n")?;
    Ok(())
}
