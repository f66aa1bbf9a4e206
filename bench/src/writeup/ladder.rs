//! The overhead ladder (`overhead`): latency and CPU each layer adds, as
//! tables and charts, and the long-prompt closed loop when it ran.

use std::fmt::Write as _;
use std::path::Path;

use super::charts::{self, Bar, Bars};
use super::inputs::{Ladder, Loaded, RungResult};

/// The overhead ladder's section.
pub fn section(md: &mut String, out: &Path, l: &Loaded<Ladder>) -> anyhow::Result<()> {
    let v = &l.value;
    writeln!(md, "## Overhead ladder\n")?;
    // The recipe passes the setup in the command; say it once.
    let setup = if v.command.contains(&v.setup) { String::new() } else { format!("; {}", v.setup) };
    writeln!(md, "Source: `{}` (commit `{}`), `{}`. {} req/s open loop{setup}.\n", l.path.display(), v.commit, v.command, v.rate)?;
    writeln!(md, "Latency counts from each request's scheduled send to the last byte of its answer.\n")?;
    writeln!(
        md,
        "| rung | ok | errors | latency p50 ms | latency p99 ms | added p50 ms | added p99 ms | CPU µs per request, by process |\n|---|---|---|---|---|---|---|---|"
    )?;
    let cpu = |r: &RungResult| r.cpu_us_per_request.iter().map(|(k, v)| format!("{k} {v:.0}")).collect::<Vec<_>>().join(", ");
    for r in &v.rungs {
        writeln!(
            md,
            "| {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {} |",
            r.rung,
            r.ok,
            r.errors,
            r.latency.p50_ms,
            r.latency.p99_ms,
            r.added_p50_ms,
            r.added_p99_ms,
            cpu(r)
        )?;
    }
    let groups: Vec<String> = v.rungs.iter().map(|r| r.rung.clone()).collect();
    let one = |x: f64| Some(Bar { value: x, spread: None });
    let values = v.rungs.iter().map(|r| vec![one(r.added_p50_ms), one(r.added_p99_ms)]).collect();
    charts::bars(
        &out.join("overhead-latency.png"),
        &Bars {
            title: "Latency added over straight to the simulators",
            y_label: "ms",
            groups: groups.clone(),
            series: vec!["added p50".into(), "added p99".into()],
            values,
        },
    )?;
    // In the chart each rung's Envoy is "Envoy" and its processor or router "router", so the bars line up.
    let kind = |role: &str| match role {
        "client" | "simulators" => role.to_string(),
        r if r.starts_with("envoy") => "Envoy".into(),
        _ => "processor or router".into(),
    };
    let roles: Vec<String> = ["client", "Envoy", "processor or router", "simulators"].map(str::to_string).to_vec();
    let values = v
        .rungs
        .iter()
        .map(|r| {
            roles.iter().map(|k| r.cpu_us_per_request.iter().find(|(role, _)| kind(role) == *k).and_then(|(_, us)| one(*us))).collect()
        })
        .collect();
    charts::bars(
        &out.join("overhead-cpu.png"),
        &Bars { title: "CPU time per request, by process", y_label: "µs", groups, series: roles, values },
    )?;
    writeln!(md, "\n![Latency added per rung](overhead-latency.png)\n\n![CPU per request per rung](overhead-cpu.png)\n")?;
    if let Some(lp) = &v.long_prompt {
        writeln!(md, "### Long prompts ({} kB), closed loop\n", lp.prompt_bytes / 1000)?;
        writeln!(
            md,
            "Each client sends its next request when the last one's first byte is in, so with every process on the same \
             cores the mean TTFT is close to the clients times the CPU time all processes spend per request, over the \
             cores: on 2 cores each millisecond of CPU per request adds about 10 ms at 20 clients.{}\n",
            if lp.levels.iter().any(|l| l.clients == 1) {
                " With one client nothing waits for the cores: what each layer adds there is the time it takes itself."
            } else {
                ""
            }
        )?;
        writeln!(
            md,
            "| clients | rung | ok | errors | TTFT mean ms | TTFT p99 ms | added mean ms | added p99 ms | CPU µs per request, by process |\n|---|---|---|---|---|---|---|---|---|"
        )?;
        for level in &lp.levels {
            for r in &level.rungs {
                writeln!(
                    md,
                    "| {} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {} |",
                    level.clients,
                    r.rung,
                    r.ok,
                    r.errors,
                    r.latency.mean_ms,
                    r.latency.p99_ms,
                    r.added_mean_ms,
                    r.added_p99_ms,
                    cpu(r)
                )?;
            }
        }
        let series: Vec<String> = lp.levels.first().map(|l| l.rungs.iter().map(|r| r.rung.clone()).collect()).unwrap_or_default();
        let groups = lp.levels.iter().map(|l| format!("{} client{}", l.clients, if l.clients == 1 { "" } else { "s" })).collect();
        let values = lp
            .levels
            .iter()
            .map(|l| series.iter().map(|s| l.rungs.iter().find(|r| &r.rung == s).and_then(|r| one(r.added_mean_ms))).collect())
            .collect();
        charts::bars(
            &out.join("overhead-long-prompt.png"),
            &Bars { title: "Mean TTFT added over straight to the simulators, long prompts", y_label: "ms", groups, series, values },
        )?;
        writeln!(md, "\n![Long prompts](overhead-long-prompt.png)\n")?;
    }
    Ok(())
}
