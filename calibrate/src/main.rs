//! `inferrail-calibrate`: measures an idle engine and prints the `prefill`
//! fragment of the router config (for `routing.policies`). Flags and output only; the work is in the library.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use inferrail_calibrate::engine::Engine;
use inferrail_calibrate::fit::{fit, yaml_fragment};
use inferrail_calibrate::plan::{Grid, TokenRange, plan};
use inferrail_calibrate::report;
use inferrail_calibrate::run::{RunOptions, Step, run};

/// Fits the prefill cost model `a*u + b*u*(c + u/2) + d` to an idle vLLM-compatible engine.
#[derive(Debug, Parser)]
#[command(name = "inferrail-calibrate", version)]
struct Cli {
    /// The engine's base URL.
    #[arg(long)]
    url: String,
    /// Served model name to probe (default: the first one /v1/models lists).
    #[arg(long)]
    model: Option<String>,
    /// Seed for the probe tokens (default: from the clock, so each run sends tokens the cache has not seen).
    #[arg(long)]
    seed: Option<u64>,
    /// Also write the YAML fragment to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Cached prefix lengths to probe, tokens.
    #[arg(long, value_delimiter = ',', default_value = "0,512,1024,2048,4096")]
    cached: Vec<usize>,
    /// Fresh (uncached) lengths to probe, tokens.
    #[arg(long, value_delimiter = ',', default_value = "16,256,1024,2048")]
    uncached: Vec<usize>,
    /// Times each grid point is probed.
    #[arg(long, default_value_t = 2)]
    repeats: usize,
    /// Unmeasured requests sent first (an engine's first requests are slow).
    #[arg(long, default_value_t = 4)]
    warmup: usize,
    /// Smallest token id probes use.
    #[arg(long, default_value_t = TokenRange::default().lo)]
    min_token_id: u32,
    /// One past the largest token id probes use (keep it inside the vocabulary).
    #[arg(long, default_value_t = TokenRange::default().hi)]
    max_token_id: u32,
    /// Timeout of each HTTP request, seconds.
    #[arg(long, default_value_t = 300.0)]
    request_timeout_s: f64,
    /// Longest wait for the engine to go idle or for its metrics to count a request, seconds.
    #[arg(long, default_value_t = 10.0)]
    settle_timeout_s: f64,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let timeout = Duration::try_from_secs_f64(cli.request_timeout_s).context("--request-timeout-s")?;
    let settle = Duration::try_from_secs_f64(cli.settle_timeout_s).context("--settle-timeout-s")?;
    let engine = Engine::connect(&cli.url, cli.model.as_deref(), timeout).await?;
    let seed = cli.seed.unwrap_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0));
    let grid = Grid { cached: cli.cached.clone(), uncached: cli.uncached.clone(), repeats: cli.repeats, warmup: cli.warmup };
    let plan = plan(&grid, engine.max_model_len, TokenRange { lo: cli.min_token_id, hi: cli.max_token_id }, seed)?;
    eprintln!(
        "calibrating {} at {} (max_model_len {}, seed {seed}): {} probes, {} requests",
        engine.model,
        engine.url(),
        engine.max_model_len,
        plan.probes(),
        plan.requests()
    );
    if !plan.skipped.is_empty() {
        eprintln!("skipped (cached, uncached) points longer than the context: {:?}", plan.skipped);
    }

    let bar = ProgressBar::with_draw_target(Some(plan.requests() as u64), ProgressDrawTarget::stderr());
    bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} {msg} [{elapsed}]").unwrap_or_else(|_| ProgressStyle::default_bar()));
    let measurements = run(&engine, &plan, RunOptions { settle, ..RunOptions::default() }, |step| {
        match step {
            Step::Prefix { tokens } => bar.set_message(format!("cached a {tokens}-token prefix")),
            Step::Warmup => bar.set_message("warming up"),
            Step::Probe(m) => bar.set_message(format!("c={} u={}: {:.1} ms", m.planned_cached, m.planned_uncached, m.engine_secs * 1e3)),
        }
        bar.inc(1);
    })
    .await
    .context("probing the engine")?;
    bar.finish_and_clear();

    let observations: Vec<_> = measurements.iter().map(|m| m.observation()).collect();
    let fit = fit(&observations).context("fitting the cost model")?;
    if let Some(m) = measurements.first() {
        eprintln!("timed by {:?}; cached tokens from {:?}", m.timed_by, m.cached_from);
    }
    print!("{}\n{}\n", report::probe_table(&measurements, &fit), report::summary(&measurements, &fit));
    let fragment = yaml_fragment(&fit.model);
    print!("{fragment}");
    if let Some(path) = &cli.out {
        std::fs::write(path, &fragment).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
