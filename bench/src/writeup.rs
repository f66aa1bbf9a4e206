//! `report`: the committed Markdown report with PNG charts, made from the
//! committed JSON results alone: the routing comparison (TTFT distributions,
//! p50 and p99, prefix hit rates, replica shares, prediction), prediction
//! accuracy under concurrency, the overhead ladder, capacity at the SLO on
//! real simulators and in the fleet simulation, the fleet simulation's
//! speed on a large fleet, and the fleet simulation against the HTTP
//! harness on the same requests. The must-show checks of
//! issue 11 are computed from the same data and a failing one says so; the
//! report asserts no conclusion of its own. Every table and chart
//! names the files and commits it came from; repeated runs show their mean
//! and the spread (lowest to highest) across repetitions, but for TTFT
//! percentiles, which are taken over every repetition's requests together.

mod charts;
mod checks;
pub(crate) mod inputs;
mod ladder;
mod real;
mod sim_capacity;
mod stats;
#[cfg(test)]
pub(crate) mod tests;
mod text;
mod validation;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use clap::Args;

use charts::{Bar, Bars, Cdf};
use checks::Verdict;
use inputs::{Accuracy, CompareRun, FleetCapacity, FleetRuns, FleetWorkload, Ladder, Loaded, RealCapacity};
use stats::{RESAMPLES, bar, median, pooled_ttfts};
pub use stats::{mean, paired_p99, paired_ttfts, ttft_p50, ttft_p99};
use text::{cell, ms, num, pct, sources};

/// Flags of `report`.
#[derive(Debug, Clone, Args)]
pub struct ReportArgs {
    /// Folders of `compare` results (every `routing-compare` JSON in them).
    #[arg(long, value_delimiter = ',', default_value = "bench/results/routing/quick")]
    pub routing: Vec<PathBuf>,
    /// Folder of fleet-simulation results (capacity searches are `capacity-*.json`).
    #[arg(long, default_value = "bench/results/fleet")]
    pub fleet: PathBuf,
    /// Folder of fleet-simulation capacity searches at the HTTP comparison's
    /// scale (`just bench-fleet-scale`); missing: left out.
    #[arg(long, default_value = "bench/results/fleet/bench-scale")]
    pub fleet_scale: PathBuf,
    /// Folders of `compare --capacity` results on real simulators (every
    /// `capacity-*.json` in them); a missing folder: not measured.
    #[arg(long, value_delimiter = ',', default_value = "bench/results/routing/capacity,bench/results/routing/capacity-cost-model")]
    pub real_capacity: Vec<PathBuf>,
    /// Folders of `compare --capacity` results on a mixed fleet of real
    /// simulators (issue 39); a missing folder: not measured.
    #[arg(long, value_delimiter = ',', default_value = "bench/results/mixed/capacity")]
    pub mixed_capacity: Vec<PathBuf>,
    /// Fleet-simulation capacity searches of the reuse patterns (issue 39),
    /// as files: their folder also holds variants; a missing file is left out.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "bench/results/fleet/reuse/capacity-agent-seed1.json,bench/results/fleet/reuse/capacity-agent-64-seed1.json,bench/results/fleet/reuse/capacity-rag-seed1.json"
    )]
    pub fleet_reuse: Vec<PathBuf>,
    /// Folders of `compare` results that count only toward the agent-loop
    /// prediction checks (each mode's; a run also in `--routing` counts
    /// once); a missing folder has none.
    #[arg(long, value_delimiter = ',', default_value = "bench/results/reuse/agent,bench/results/reuse/agent-exact")]
    pub predictions: Vec<PathBuf>,
    /// Folder of fleet simulations on the comparison's requests (`fleet-<workload>.json`); missing: not measured.
    #[arg(long, default_value = "bench/results/routing/validation")]
    pub validation: PathBuf,
    /// A large fleet simulation, timed (`just bench-fleet-speed`); missing: left out.
    #[arg(long, default_value = "bench/results/fleet/speed/w1-256.json")]
    pub fleet_speed: PathBuf,
    /// Prediction accuracy under concurrency.
    #[arg(long, default_value = "bench/results/prediction/accuracy.json")]
    pub prediction: PathBuf,
    /// The overhead ladder.
    #[arg(long, default_value = "bench/results/overhead/ladder.json")]
    pub overhead: PathBuf,
    /// The TTF font charts are drawn with.
    #[arg(long, default_value = ".cache/fonts/DejaVuSans.ttf")]
    pub font: PathBuf,
    /// Where the report and its charts go.
    #[arg(long, default_value = "bench/report/routing")]
    pub out_dir: PathBuf,
}

/// Compare runs by workload and contender, repetitions together.
pub struct Contenders {
    runs: BTreeMap<(String, String), Vec<CompareRun>>,
    /// Contenders in the order they were first seen.
    order: Vec<String>,
}

impl Contenders {
    /// Repetitions of one contender on one workload are pooled: they must
    /// share a rate (a folder holding an earlier run's files at another
    /// rate is an error, not a silent mixture).
    fn new(files: &[Loaded<CompareRun>]) -> anyhow::Result<Self> {
        let mut runs: BTreeMap<(String, String), Vec<CompareRun>> = BTreeMap::new();
        let mut order: Vec<String> = Vec::new();
        let mut rates: BTreeMap<(String, String), (f64, &Path)> = BTreeMap::new();
        for f in files {
            let r = &f.value;
            let key = (r.workload.clone(), r.contender.clone());
            let (rate, first) = *rates.entry(key.clone()).or_insert((r.rate, &f.path));
            anyhow::ensure!(
                rate == r.rate,
                "{} and {}: {} on {} at {rate} and {} req/s; repetitions are pooled, so rerun or remove one",
                first.display(),
                f.path.display(),
                r.contender,
                r.workload,
                r.rate
            );
            if !order.contains(&r.contender) {
                order.push(r.contender.clone());
            }
            runs.entry(key).or_default().push(r.clone());
        }
        for reps in runs.values_mut() {
            reps.sort_by_key(|r| r.rep);
        }
        order.sort_by_key(|c| contender_rank(c));
        Ok(Self { runs, order })
    }

    /// The repetitions of `contender` on `workload`.
    pub fn get(&self, workload: &str, contender: &str) -> Option<&[CompareRun]> {
        self.runs.get(&(workload.to_string(), contender.to_string())).map(Vec::as_slice)
    }

    /// Workloads, in the order.
    pub fn workloads(&self) -> Vec<String> {
        in_workload_order(self.runs.keys().map(|(w, _)| w.clone()))
    }

    /// Contenders that ran `workload`.
    pub fn contenders(&self, workload: &str) -> Vec<String> {
        self.order.iter().filter(|c| self.get(workload, c).is_some()).cloned().collect()
    }
}

/// The order of contenders where known: cache-blind first, the product, then the peer.
fn contender_rank(c: &str) -> usize {
    ["round_robin", "least_request", "prefix_hash", "kv_aware", "cost_model"].iter().position(|k| *k == c).unwrap_or(5)
}

/// The order of workloads.
fn workload_rank(w: &str) -> usize {
    ["w1", "mix", "hot", "w6", "w2"].iter().position(|k| *k == w).unwrap_or(5)
}

/// Distinct workloads in the order.
fn in_workload_order(workloads: impl Iterator<Item = String>) -> Vec<String> {
    let mut out: Vec<String> = workloads.collect::<BTreeSet<_>>().into_iter().collect();
    out.sort_by_key(|w| (workload_rank(w), w.clone()));
    out
}

/// Writes the report; returns the checks that failed.
pub fn report(args: ReportArgs) -> anyhow::Result<()> {
    let failed = render(&args)?;
    println!("wrote {}", args.out_dir.join("report.md").display());
    if !failed.is_empty() {
        eprintln!("must-show checks that fail: {}", failed.join("; "));
    }
    Ok(())
}

/// Renders the report into `args.out_dir`; returns the names of failing checks.
pub fn render(args: &ReportArgs) -> anyhow::Result<Vec<String>> {
    charts::register_font(&args.font)?;
    std::fs::create_dir_all(&args.out_dir)?;
    let mut compare_files = Vec::new();
    for dir in &args.routing {
        compare_files.extend(inputs::load_dir::<CompareRun>(dir, "routing-compare")?);
    }
    anyhow::ensure!(!compare_files.is_empty(), "no routing-compare results in {:?}", args.routing);
    let routing = Contenders::new(&compare_files)?;
    let capacity: Vec<Loaded<FleetCapacity>> = inputs::load_dir_having(&args.fleet, "fleet-simulation", "capacity")?;
    let capacity_scaled: Vec<Loaded<FleetCapacity>> = inputs::load_dir_having(&args.fleet_scale, "fleet-simulation", "capacity")?;
    let real_capacity = inputs::load_capacities(&args.real_capacity)?;
    let mixed_capacity = inputs::load_capacities(&args.mixed_capacity)?;
    let reuse_capacity: Vec<Loaded<FleetCapacity>> =
        args.fleet_reuse.iter().filter(|f| f.exists()).map(|f| inputs::load(f)).collect::<anyhow::Result<_>>()?;
    let mut prediction_runs = Vec::new();
    for dir in args.predictions.iter().filter(|d| d.exists()) {
        prediction_runs.extend(inputs::load_dir::<CompareRun>(dir, "routing-compare")?.into_iter().map(|f| f.value));
    }
    let validation: Vec<Loaded<FleetRuns>> = inputs::load_dir_having(&args.validation, "fleet-simulation", "runs")?;
    let speed = args.fleet_speed.exists().then(|| inputs::load::<FleetRuns>(&args.fleet_speed)).transpose()?;
    let accuracy = args.prediction.exists().then(|| inputs::load::<Accuracy>(&args.prediction)).transpose()?;
    let ladder = args.overhead.exists().then(|| inputs::load::<Ladder>(&args.overhead)).transpose()?;

    let fleet = FleetWorkload::group(&capacity)?;
    let fleet_scaled = FleetWorkload::group(&capacity_scaled)?;
    let fleet_reuse = FleetWorkload::group(&reuse_capacity)?;
    let mut checks = checks::all(&routing, &fleet, &real_capacity, ladder.as_ref());
    checks.extend(checks::reuse(&routing, &prediction_runs, &mixed_capacity, &fleet_reuse));
    let mut md = String::new();
    writeln!(md, "# Inferrail benchmark report\n")?;
    writeln!(
        md,
        "Made by `inferrail-bench report` from the committed JSON results alone (regenerate: `just bench-report`). Every section names the result files and the commits that produced them; where a workload was repeated with new seeds, values are the mean over repetitions with the lowest and highest in parentheses, and bars carry a whisker over that spread; TTFT percentiles are taken over the requests of all repetitions together, with the repetitions' own lowest and highest in parentheses.\n"
    )?;
    writeln!(md, "{}\n", time_scale(&compare_files))?;
    writeln!(md, "## Must-show checks (issues 11 and 39)\n")?;
    writeln!(
        md,
        "Computed from the results below; a check whose data is not in them says \"not measured\". Every contender got the same \
         requests at the same times, so a lowest-p99 check also compares {} with the best other over the same requests: the \
         difference of their p99s with a 95% bootstrap interval ({} resamples of request pairs), and the median request's \
         difference (ADR 0027). The result is the strict comparison; the interval says how much it can be trusted. Where the \
         best other is SGLang's round robin, the check also gives the path apart from the routing: the same algorithm \
         through Envoy and inferrail, over the same requests (ADR 0028).\n",
        checks::HERO,
        num(RESAMPLES as f64)
    )?;
    writeln!(md, "| check | target | measured | result |\n|---|---|---|---|")?;
    for c in &checks {
        let verdict = match c.verdict {
            Verdict::Pass => "pass",
            Verdict::Fail => "**FAIL**",
            Verdict::NotMeasured => "not measured",
        };
        writeln!(md, "| {} | {} | {} | {verdict} |", c.name, c.target, c.measured)?;
    }
    let failed: Vec<String> = checks.iter().filter(|c| c.verdict == Verdict::Fail).map(|c| c.name.clone()).collect();
    writeln!(
        md,
        "\n{} of {} checks pass, {} fail, {} not measured.\n",
        checks.iter().filter(|c| c.verdict == Verdict::Pass).count(),
        checks.len(),
        failed.len(),
        checks.iter().filter(|c| c.verdict == Verdict::NotMeasured).count()
    )?;

    routing_section(&mut md, &args.out_dir, &routing, &compare_files, &real_capacity)?;
    real::capacity_section(&mut md, &args.out_dir, ("Capacity at the SLO on real simulators", "real-capacity.png"), &real_capacity)?;
    if !mixed_capacity.is_empty() {
        let heading = ("Capacity at the SLO on a mixed fleet of real simulators", "mixed-capacity.png");
        real::capacity_section(&mut md, &args.out_dir, heading, &mixed_capacity)?;
    }
    if let Some(a) = &accuracy {
        accuracy_section(&mut md, &args.out_dir, a, &routing)?;
    }
    if let Some(l) = &ladder {
        ladder::section(&mut md, &args.out_dir, l)?;
    }
    if !fleet.is_empty() {
        sim_capacity::section(&mut md, &args.out_dir, ("Fleet simulation: capacity at the SLO", ""), "fleet-capacity.png", &fleet)?;
    }
    if !fleet_scaled.is_empty() {
        let intro = "The same searches on fleets like the HTTP comparison's: 3 and 4 replicas, its caches and its time scale, so its SLO. They show what the three real simulators' capacity (above) would be on other seeds, and with a fourth replica.";
        let heading = ("Fleet simulation at the comparison's scale", intro);
        sim_capacity::section(&mut md, &args.out_dir, heading, "fleet-capacity-bench-scale.png", &fleet_scaled)?;
    }
    if !fleet_reuse.is_empty() {
        let heading = ("Fleet simulation: reuse patterns", "Agent loops and RAG (issue 39), each on one seed.");
        sim_capacity::section(&mut md, &args.out_dir, heading, "fleet-capacity-reuse.png", &fleet_reuse)?;
    }
    if let Some(s) = &speed {
        speed_section(&mut md, s)?;
    }
    validation::section(&mut md, &routing, &validation)?;
    std::fs::write(args.out_dir.join("report.md"), md)?;
    Ok(failed)
}

/// How long the fleet simulation takes on one core for a large fleet.
fn speed_section(md: &mut String, speed: &Loaded<FleetRuns>) -> anyhow::Result<()> {
    let v = &speed.value;
    writeln!(md, "## Fleet simulation: speed\n")?;
    writeln!(md, "{} at {} req/s, seed {}, simulated on one core:\n", v.workload.workload, num(v.rate), v.seed)?;
    writeln!(md, "| policy | replicas | requests | simulated s | wall-clock s | TTFT p99 ms |\n|---|---|---|---|---|---|")?;
    for r in &v.runs {
        writeln!(md, "| {} | {} | {} | {:.1} | {:.1} | {} |", r.policy, r.replicas, r.requests, r.virtual_s, r.wall_s, ms(r.ttft.p99_ms))?;
    }
    writeln!(md, "\nSource: `{}` (commit `{}`), `{}`.\n", speed.path.display(), v.commit, v.command)?;
    Ok(())
}

/// The latency model's time scale and the SLO the routing runs record, scaled with it.
fn time_scale(files: &[Loaded<CompareRun>]) -> String {
    let settings: BTreeSet<String> = files
        .iter()
        .filter_map(|f| {
            let (scale, slo) = (f.value.time_scale?, f.value.slo?);
            Some(format!(
                "time scale {} (every modelled duration times {}), with the SLO scaled alike: TTFT at most {} ms and TPOT at most {} ms ({} ms and {} ms at scale 1)",
                num(scale),
                num(scale),
                num(slo.ttft_ms),
                num(slo.tpot_ms),
                num(slo.ttft_ms / scale),
                num(slo.tpot_ms / scale)
            ))
        })
        .collect();
    let unrecorded = files.iter().filter(|f| f.value.time_scale.is_none() || f.value.slo.is_none()).count();
    let mut out = match settings.len() {
        0 => "The routing results do not record the simulators' time scale or the SLO.".to_string(),
        1 => format!("The simulators' latency model ran at {}.", settings.iter().next().map_or("", String::as_str)),
        _ => format!("The routing runs differ in their setting: {}.", settings.into_iter().collect::<Vec<_>>().join("; ")),
    };
    if unrecorded > 0 && unrecorded < files.len() {
        write!(out, " {unrecorded} of {} routing results do not record it.", files.len()).ok();
    }
    let intervals: BTreeSet<String> = files.iter().filter_map(|f| f.value.load_interval_ms).map(num).collect();
    match intervals.len() {
        0 => {}
        1 => {
            let ms = intervals.iter().next().map_or("", String::as_str);
            write!(out, " Inferrail read each engine's load every {ms} ms, its 100 ms default at the same scale.").ok();
        }
        _ => {
            let all = intervals.into_iter().collect::<Vec<_>>().join(", ");
            write!(out, " Inferrail's runs read the engines' load at different intervals: {all} ms.").ok();
        }
    }
    out
}

fn routing_section(
    md: &mut String,
    out: &Path,
    routing: &Contenders,
    files: &[Loaded<CompareRun>],
    capacity: &[Loaded<RealCapacity>],
) -> anyhow::Result<()> {
    writeln!(md, "## Routing comparison\n")?;
    writeln!(md, "Source: {}.\n", sources(files.iter().map(|f| (f.path.as_path(), f.value.commit.as_str()))))?;
    let commands: BTreeSet<&str> = files.iter().map(|f| f.value.command.as_str()).collect();
    for c in commands {
        writeln!(md, "Command: `{c}`\n")?;
    }
    writeln!(md, "{}\n", real::comparison_rates(routing, capacity))?;
    writeln!(
        md,
        "Contenders: `sglang:<policy>` is SGLang's own router (PyPI `sglang-router`) with that policy in front of the same \
         simulators; every other name is an Inferrail policy, Inferrail in front. Of those, `sglang_cache_aware`, \
         `dynamo_kv` and `gie_default` are Inferrail's stand-ins for the defaults of SGLang's router, NVIDIA Dynamo's KV \
         router and the Gateway API Inference Extension's endpoint picker, run inside Inferrail on the data it gives every policy.\n"
    )?;
    writeln!(
        md,
        "| workload | contender | reps | req/s | ok / measured | TTFT p50 ms, pooled (reps) | TTFT p99 ms, pooled (reps) | cached (usage) | cached (engines) | busiest share (engines) | goodput | prediction exact |"
    )?;
    writeln!(md, "|---|---|---|---|---|---|---|---|---|---|---|---|")?;
    let workloads = routing.workloads();
    for w in &workloads {
        for c in routing.contenders(w) {
            let runs = routing.get(w, &c).unwrap_or_default();
            let metric = |f: &dyn Fn(&CompareRun) -> Option<f64>| runs.iter().map(f).collect::<Option<Vec<f64>>>().map(|v| bar(&v));
            let opt = |b: Option<Bar>, unit: fn(f64) -> String| b.map_or("n/a".into(), |b| cell(b, unit));
            let (ok, n): (usize, usize) = runs.iter().fold((0, 0), |(o, n), r| (o + r.summary.ok, n + r.summary.requests));
            let (exact, compared): (usize, usize) =
                runs.iter().fold((0, 0), |(e, n), r| (e + r.summary.prediction.exact, n + r.summary.prediction.compared));
            writeln!(
                md,
                "| {w} | {c} | {} | {} | {ok} / {n} | {} | {} | {} | {} | {} | {} | {} |",
                runs.len(),
                runs.first().map_or(0.0, |r| r.rate),
                cell(ttft_p50(runs), ms),
                cell(ttft_p99(runs), ms),
                opt(metric(&|r| r.summary.prefix.hit_rate), pct),
                opt(metric(&|r| r.engines.as_ref().and_then(|e| e.hit_rate)), pct),
                opt(metric(&|r| r.engines.as_ref().and_then(|e| e.busiest_share)), pct),
                opt(metric(&|r| Some(r.summary.goodput.share)), pct),
                if compared > 0 { format!("{} of {compared}", exact) } else { "n/a".into() },
            )?;
        }
    }
    writeln!(
        md,
        "\nTTFT percentiles are over the measured requests of all repetitions together; in brackets, the lowest and highest of the repetitions' own. The other columns are means over the repetitions, with their spread. The engines' columns count the warmup as well (their counters cover the whole run).\n"
    )?;
    for w in &workloads {
        let lines = routing
            .contenders(w)
            .into_iter()
            .map(|c| {
                let runs = routing.get(w, &c).unwrap_or_default();
                let points = match pooled_ttfts(runs) {
                    Some(all) => {
                        let n = all.len() as f64;
                        all.iter().enumerate().map(|(i, &x)| (x, (i + 1) as f64 / n)).collect()
                    }
                    None => {
                        // Older results hold percentiles only: the distribution through them.
                        let l = runs.iter().map(|r| &r.summary.ttft);
                        let q = |f: &dyn Fn(&inputs::Latency) -> f64| mean(l.clone().map(f));
                        vec![(q(&|l| l.p50_ms), 0.5), (q(&|l| l.p90_ms), 0.9), (q(&|l| l.p99_ms), 0.99), (q(&|l| l.max_ms), 1.0)]
                    }
                };
                (c, points)
            })
            .collect();
        let file = format!("ttft-cdf-{w}.png");
        charts::cdf(
            &out.join(&file),
            &Cdf { title: &format!("TTFT distribution, {w} (all repetitions)"), x_label: "time to first token, ms (log)", lines },
        )?;
        let sampled = routing.contenders(w).iter().all(|c| pooled_ttfts(routing.get(w, c).unwrap_or_default()).is_some());
        let how = if sampled {
            "every measured request"
        } else {
            "drawn through p50, p90, p99 and max (these results hold no per-request TTFTs)"
        };
        writeln!(md, "![TTFT distribution on {w}]({file})\n\n*TTFT distribution on {w}, {how}.*\n")?;
    }
    let grouped = |title: &str, y: &str, file: &str, f: &dyn Fn(&[CompareRun]) -> Option<Bar>, md: &mut String| -> anyhow::Result<()> {
        let series = routing.order.clone();
        let values = workloads.iter().map(|w| series.iter().map(|c| routing.get(w, c).and_then(f)).collect()).collect();
        charts::bars(&out.join(file), &Bars { title, y_label: y, groups: workloads.clone(), series, values })?;
        writeln!(md, "![{title}]({file})\n")?;
        Ok(())
    };
    // A metric of each repetition: their mean and spread.
    let each =
        |f: fn(&CompareRun) -> Option<f64>| move |runs: &[CompareRun]| runs.iter().map(f).collect::<Option<Vec<f64>>>().map(|v| bar(&v));
    grouped("TTFT p50 per workload and contender (all repetitions)", "ms", "ttft-p50.png", &|r| Some(ttft_p50(r)), md)?;
    grouped("TTFT p99 per workload and contender (all repetitions)", "ms", "ttft-p99.png", &|r| Some(ttft_p99(r)), md)?;
    grouped(
        "Prompt tokens cached, from usage (measured requests)",
        "share",
        "hit-rate-usage.png",
        &each(|r| r.summary.prefix.hit_rate),
        md,
    )?;
    grouped(
        "Prompt tokens cached, engines' counters (whole run)",
        "share",
        "hit-rate-engines.png",
        &each(|r| r.engines.as_ref().and_then(|e| e.hit_rate)),
        md,
    )?;
    grouped(
        "Busiest replica's share of requests (engines' counters)",
        "share",
        "busiest-share.png",
        &each(|r| r.engines.as_ref().and_then(|e| e.busiest_share)),
        md,
    )?;
    Ok(())
}

fn accuracy_section(md: &mut String, out: &Path, a: &Loaded<Accuracy>, routing: &Contenders) -> anyhow::Result<()> {
    writeln!(md, "## Prediction accuracy\n")?;
    writeln!(
        md,
        "Source: `{}` ({}), and the routing runs above (predicted `x-inferrail-cached-tokens` against usage).\n",
        a.path.display(),
        a.value.setup
    )?;
    writeln!(md, "| setting | requests | exact | over | under |\n|---|---|---|---|---|")?;
    let mut groups = Vec::new();
    let mut values = Vec::new();
    let share = |k: usize, n: usize| Some(Bar { value: if n > 0 { k as f64 / n as f64 } else { 0.0 }, spread: None });
    for p in &a.value.points {
        let users = if p.users == 1 { "1 user".to_string() } else { format!("{} users", p.users) };
        writeln!(
            md,
            "| {} mode, {users}, {} blocks | {} | {} | {} | {} |",
            p.mode, p.blocks, p.requests, p.exact, p.over_predicted, p.under_predicted
        )?;
        values.push(vec![share(p.exact, p.requests), share(p.over_predicted, p.requests), share(p.under_predicted, p.requests)]);
        let mode = if p.mode == "approximate" { "approx" } else { p.mode.as_str() };
        groups.push(format!("{mode} {}u/{}b", p.users, p.blocks));
    }
    for w in routing.workloads() {
        for c in routing.contenders(&w) {
            let runs = routing.get(&w, &c).unwrap_or_default();
            let (e, o, u, n) = runs
                .iter()
                .map(|r| &r.summary.prediction)
                .fold((0, 0, 0, 0), |(e, o, u, n), p| (e + p.exact, o + p.over, u + p.under, n + p.compared));
            if n == 0 {
                continue;
            }
            writeln!(md, "| routing {w}, {c} | {n} | {e} | {o} | {u} |")?;
            // The chart shows the checked policy's runs; the table has every contender's.
            if c == checks::HERO {
                values.push(vec![share(e, n), share(o, n), share(u, n)]);
                groups.push(format!("{w} {c}"));
            }
        }
    }
    let series = ["exact", "over", "under"].map(str::to_string).to_vec();
    charts::bars(
        &out.join("prediction.png"),
        &Bars { title: "Predicted cached tokens against the engines'", y_label: "share of requests", groups, series, values },
    )?;
    writeln!(md, "\n![Prediction accuracy](prediction.png)\n")?;
    Ok(())
}
