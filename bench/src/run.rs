//! `run`: one workload, open loop, against one URL (the router, or an engine
//! directly); warmup requests are sent but left out of the summary. The
//! result is stamped with the commit and the exact command line.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use clap::Args;
use serde::Serialize;

use crate::engines::{self, Deferred, FleetHits};
use crate::summary::{self, Prefix, Slo, Summary};
use crate::{harness, report};
use inferrail_workload::{self as workload, Spec};

/// Flags of `run`.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Base URL requests go to.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// What to send.
    #[command(flatten)]
    pub spec: Spec,
    /// Arrivals per second (Poisson).
    #[arg(long, default_value_t = 5.0)]
    pub rate: f64,
    /// Measured seconds of arrivals, after the warmup.
    #[arg(long, default_value_t = 60.0)]
    pub duration_s: f64,
    /// Seconds of arrivals sent first and left out of the summary.
    #[arg(long, default_value_t = 10.0)]
    pub warmup_s: f64,
    /// Seed of the workload and its schedule.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Engine base URLs whose `/metrics` prefix cache counters are scraped
    /// before and after the run.
    #[arg(long, value_delimiter = ',')]
    pub engines: Vec<String>,
    /// SLO on time to first token, milliseconds.
    #[arg(long, default_value_t = 2000.0)]
    pub slo_ttft_ms: f64,
    /// SLO on time per output token, milliseconds.
    #[arg(long, default_value_t = 100.0)]
    pub slo_tpot_ms: f64,
    /// Seconds one request may take before it counts as failed.
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout_s: f64,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
    /// Where to write the JSON result.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// What one run measured.
#[derive(Debug, Serialize)]
pub struct Measured {
    /// Requests sent, warmup included.
    pub sent: usize,
    /// The summary after the warmup.
    pub summary: Summary,
    /// Hit rate from usage over every request, warmup included: what the
    /// engines' counters cover.
    pub prefix_all: Prefix,
    /// The engines' own counters over the run.
    pub engines: Option<FleetHits>,
    /// The requests the engines held deferred, sampled over the run (warmup included).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub deferred: Option<Deferred>,
    /// Every measured request's time to first token, milliseconds, in
    /// scheduled order: the distribution the report draws.
    pub ttft_ms: Vec<f64>,
    /// The measured requests with the longest time to first token, slowest
    /// first: which replica, prompt and prediction make the tail.
    pub slowest: Vec<Slow>,
    /// The first measured requests whose predicted cached tokens were not
    /// the engine's, in scheduled order: where the KV index was wrong.
    pub mispredicted: Vec<Slow>,
}

/// One request as a result lists it.
#[derive(Debug, Serialize)]
pub struct Slow {
    /// Scheduled send, seconds from the start of the run.
    pub at_s: f64,
    /// Time to first token, milliseconds.
    pub ttft_ms: f64,
    /// The replica the router named.
    pub replica: Option<String>,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// The cached tokens the router predicted.
    pub predicted_cached_tokens: Option<u64>,
    /// Prompt tokens the workload shares with earlier requests.
    pub shared_prefix_tokens: usize,
    /// Its `x-request-id`: its decision in the router's decision log, and
    /// what the simulator found for it in its log (`scheduled`, at debug).
    pub request_id: Option<String>,
}

/// Requests of the tail kept in a result.
const SLOWEST: usize = 10;

/// Mispredicted requests kept in a result, enough to tell a run's misses apart.
const MISPREDICTED_KEPT: usize = 200;

/// An HTTP client for open-loop runs.
pub fn client(request_timeout_s: f64) -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .tcp_nodelay(true)
        .timeout(Duration::from_secs_f64(request_timeout_s))
        .build()?)
}

/// Sends `requests` open loop to `url` and summarizes them, the engines'
/// counters scraped before and after.
pub async fn measure(
    http: &reqwest::Client,
    url: &str,
    requests: &[workload::Request],
    engine_urls: &[String],
    warmup: Duration,
    slo: Slo,
    progress: bool,
) -> anyhow::Result<Measured> {
    let before = engines::scrape(http, engine_urls).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let sampler =
        (!engine_urls.is_empty()).then(|| tokio::spawn(engines::sample_deferred(http.clone(), engine_urls.to_vec(), stop.clone())));
    let sent = harness::send_all(http, url.trim_end_matches('/'), requests, progress).await;
    stop.store(true, Ordering::Relaxed);
    let deferred = match sampler {
        Some(task) => task.await.ok().flatten(),
        None => None,
    };
    let outcomes = sent?;
    // An engine that died under load costs its counters, not the run's results.
    let after = match engines::scrape(http, engine_urls).await {
        Ok(after) => Some(after),
        Err(e) => {
            eprintln!("the engines' counters after the run are lost: {e:#}");
            None
        }
    };
    let summary = summary::summarize(&outcomes, warmup, slo);
    let prefix_all = summary::prefix(outcomes.iter().filter(|o| o.ok()));
    let engines = after.filter(|_| !engine_urls.is_empty()).map(|after| engines::over_run(engine_urls, &before, &after));
    let ttft_ms = measured(&outcomes, warmup).filter_map(|o| o.ttft).map(|t| t.as_secs_f64() * 1e3).collect();
    let slowest = slowest(&outcomes, warmup);
    let mispredicted = mispredicted(&outcomes, warmup);
    Ok(Measured { sent: requests.len(), summary, prefix_all, engines, deferred, ttft_ms, slowest, mispredicted })
}

#[derive(Debug, Serialize)]
struct RunResult {
    benchmark: &'static str,
    commit: String,
    command: String,
    url: String,
    workload: Spec,
    rate: f64,
    duration_s: f64,
    warmup_s: f64,
    seed: u64,
    #[serde(flatten)]
    measured: Measured,
}

/// Generates the workload, sends it, and summarizes.
pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.rate > 0.0 && args.duration_s > 0.0 && args.warmup_s >= 0.0 && args.request_timeout_s > 0.0,
        "--rate, --duration-s and --request-timeout-s must be positive, --warmup-s at least 0"
    );
    let requests = workload::generate(&args.spec, args.rate, args.warmup_s + args.duration_s, args.seed)?;
    anyhow::ensure!(!requests.is_empty(), "the workload has no requests");
    eprintln!(
        "{} requests of {:?} over {} s ({} s warmup)",
        requests.len(),
        args.spec.workload,
        args.warmup_s + args.duration_s,
        args.warmup_s
    );
    let http = client(args.request_timeout_s)?;
    let slo = Slo { ttft_ms: args.slo_ttft_ms, tpot_ms: args.slo_tpot_ms };
    let warmup = Duration::from_secs_f64(args.warmup_s);
    let measured = measure(&http, &args.url, &requests, &args.engines, warmup, slo, !args.quiet).await?;
    eprint!("{}", measured.summary.text());
    if let Some(e) = &measured.engines {
        eprintln!(
            "engines' hit rate over the run {} (usage, warmup included: {})",
            e.hit_rate.map_or("n/a".into(), |r| format!("{:.1}%", r * 100.0)),
            measured.prefix_all.hit_rate.map_or("n/a".into(), |r| format!("{:.1}%", r * 100.0))
        );
    }
    let result = RunResult {
        benchmark: "open-loop-run",
        commit: commit(),
        command: command_line(),
        url: args.url.clone(),
        workload: args.spec.clone(),
        rate: args.rate,
        duration_s: args.duration_s,
        warmup_s: args.warmup_s,
        seed: args.seed,
        measured,
    };
    if let Some(out) = &args.out {
        report::write(out, &result)?;
    }
    Ok(())
}

/// `INFERRAIL_COMMIT`, else `git rev-parse --short HEAD` with `-dirty` when
/// tracked files outside `bench/results` changed, else `unknown`.
pub fn commit() -> String {
    if let Ok(c) = std::env::var("INFERRAIL_COMMIT") {
        return c;
    }
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match git(&["rev-parse", "--short", "HEAD"]) {
        // Results written by this or an earlier command of the same recipe
        // are not a change to the code that produced them.
        Some(head) => match git(&["status", "--porcelain", "--untracked-files=no", "--", ":/", ":(top,exclude)bench/results"]) {
            Some(changes) if !changes.is_empty() => format!("{head}-dirty"),
            _ => head,
        },
        None => "unknown".into(),
    }
}

/// The command line, each argument quoted when it needs it.
pub fn command_line() -> String {
    std::env::args()
        .map(|a| {
            if !a.is_empty() && a.chars().all(|c| c.is_ascii_alphanumeric() || "-_./:=,@+".contains(c)) {
                a
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The requests a run measures: scheduled after `warmup`, and successful.
fn measured(outcomes: &[harness::Outcome], warmup: Duration) -> impl Iterator<Item = &harness::Outcome> {
    outcomes.iter().filter(move |o| o.at >= warmup && o.ok())
}

/// The measured requests with the longest time to first token, slowest first.
fn slowest(outcomes: &[harness::Outcome], warmup: Duration) -> Vec<Slow> {
    let mut tail: Vec<&harness::Outcome> = measured(outcomes, warmup).filter(|o| o.ttft.is_some()).collect();
    tail.sort_by_key(|o| std::cmp::Reverse(o.ttft));
    tail.into_iter().take(SLOWEST).map(listed).collect()
}

/// The first measured requests whose prediction and usage both came and differ.
fn mispredicted(outcomes: &[harness::Outcome], warmup: Duration) -> Vec<Slow> {
    let wrong = |o: &&harness::Outcome| matches!((o.predicted_cached_tokens, o.cached_tokens), (Some(p), Some(c)) if p != c);
    measured(outcomes, warmup).filter(wrong).take(MISPREDICTED_KEPT).map(listed).collect()
}

fn listed(o: &harness::Outcome) -> Slow {
    Slow {
        at_s: o.at.as_secs_f64(),
        ttft_ms: o.ttft.unwrap_or_default().as_secs_f64() * 1e3,
        replica: o.replica.clone(),
        prompt_tokens: o.prompt_tokens,
        cached_tokens: o.cached_tokens,
        predicted_cached_tokens: o.predicted_cached_tokens,
        shared_prefix_tokens: o.shared_prefix_tokens,
        request_id: o.request_id.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tail_is_the_slowest_measured_requests_slowest_first() {
        let ms = Duration::from_millis;
        let at = |i: u64, ttft: u64| harness::Outcome {
            at: ms(i * 100),
            ttft: Some(ms(ttft)),
            replica: Some(format!("r{i}")),
            ..Default::default()
        };
        let mut outcomes: Vec<harness::Outcome> = (0..30).map(|i| at(i, 10 + i)).collect();
        // In the warmup, and failed: neither counts however slow.
        outcomes[0].ttft = Some(ms(5_000));
        outcomes[5].ttft = Some(ms(4_000));
        outcomes[5].error = Some("reset".into());
        let tail = slowest(&outcomes, ms(200));
        assert_eq!(tail.len(), SLOWEST);
        let ttfts: Vec<f64> = tail.iter().map(|s| s.ttft_ms).collect();
        assert_eq!(
            ttfts,
            (30..40).rev().map(f64::from).collect::<Vec<_>>(),
            "the warmup's and the failed request's 5 s and 4 s are left out"
        );
        assert_eq!(tail[0].replica.as_deref(), Some("r29"));
    }

    #[test]
    fn mispredicted_requests_are_those_whose_prediction_and_usage_differ() {
        let ms = Duration::from_millis;
        let at = |i: u64, predicted: Option<u64>, cached: Option<u64>| harness::Outcome {
            at: ms(i * 100),
            predicted_cached_tokens: predicted,
            cached_tokens: cached,
            request_id: Some(format!("r{i}")),
            ..Default::default()
        };
        let outcomes = vec![
            at(1, Some(32), Some(16)),
            at(3, Some(32), Some(32)),
            at(4, Some(32), None),
            at(5, Some(0), Some(16)),
            at(6, None, Some(16)),
        ];
        let wrong: Vec<(f64, Option<String>)> = mispredicted(&outcomes, ms(200)).into_iter().map(|s| (s.at_s, s.request_id)).collect();
        assert_eq!(wrong, [(0.5, Some("r5".into()))], "the warmup's, the exact one and those missing a side are left out");
    }
}
