//! Open-loop load: requests leave on a seeded Poisson schedule whatever the
//! earlier ones are doing, and latency counts from the scheduled send time,
//! so a server that falls behind cannot hide its queueing.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::Serialize;
use serde_json::json;
use tokio::time::Instant;

use crate::arrivals;
use crate::report::{self, Latency};

/// Flags of `overhead`.
#[derive(Debug, Clone, Args)]
pub struct OverheadArgs {
    /// Envoy with inferrail's ext_proc filters.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub with: String,
    /// The same Envoy without them (plain round robin).
    #[arg(long, default_value = "http://127.0.0.1:8081")]
    pub without: String,
    /// Model to ask for.
    #[arg(long, default_value = "inferrail/sim-8b")]
    pub model: String,
    /// Request rates to measure, per second.
    #[arg(long, value_delimiter = ',', default_value = "1000,2000")]
    pub rates: Vec<f64>,
    /// Measured seconds per rate and Envoy, over all rounds.
    #[arg(long, default_value_t = 10.0)]
    pub duration_s: f64,
    /// Unmeasured seconds before each round.
    #[arg(long, default_value_t = 1.0)]
    pub warmup_s: f64,
    /// Rounds per rate, each through one Envoy then the other, so drift in
    /// the machine's load falls on both alike.
    #[arg(long, default_value_t = 4)]
    pub rounds: u32,
    /// Seed of the arrival schedule.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// When above 0, send chats that share a system prompt of about this many
    /// tokens (`builtin:sim`: one per word) instead of short completions.
    #[arg(long, default_value_t = 0)]
    pub system_prompt_tokens: usize,
    /// What is being measured, recorded in the result.
    #[arg(long, default_value = "")]
    pub setup: String,
    /// Where to write the JSON result.
    #[arg(long)]
    pub out: PathBuf,
}

/// One open-loop run.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    /// Requests measured.
    pub sent: usize,
    /// Failed or non-2xx.
    pub errors: usize,
    /// Latency from scheduled send to the last byte.
    pub latency: Latency,
    /// How late requests left against their schedule.
    pub send_lag: Latency,
}

#[derive(Debug, Serialize)]
struct RatePoint {
    rate: f64,
    without: Run,
    with: Run,
    added_p50_ms: f64,
    added_p99_ms: f64,
}

#[derive(Debug, Serialize)]
struct OverheadResult {
    benchmark: &'static str,
    setup: String,
    duration_s: f64,
    rounds: u32,
    seed: u64,
    points: Vec<RatePoint>,
}

/// Measures, per rate, the same schedules through both Envoys, alternating
/// between them round by round.
pub async fn overhead(args: OverheadArgs) -> anyhow::Result<()> {
    let http = reqwest::Client::builder().pool_max_idle_per_host(512).tcp_nodelay(true).build()?;
    let mut points = Vec::new();
    for &rate in &args.rates {
        let (mut without, mut with) = (Samples::default(), Samples::default());
        for round in 0..u64::from(args.rounds.max(1)) {
            run(&http, &args.without, rate, round, &args, &mut without).await;
            run(&http, &args.with, rate, round, &args, &mut with).await;
        }
        let (without, with) = (without.run(), with.run());
        eprintln!(
            "{rate} req/s: p50 {:.3} -> {:.3} ms, p99 {:.3} -> {:.3} ms",
            without.latency.p50_ms, with.latency.p50_ms, without.latency.p99_ms, with.latency.p99_ms
        );
        points.push(RatePoint {
            rate,
            added_p50_ms: with.latency.p50_ms - without.latency.p50_ms,
            added_p99_ms: with.latency.p99_ms - without.latency.p99_ms,
            without,
            with,
        });
    }
    let result = OverheadResult {
        benchmark: "added-latency-open-loop",
        setup: args.setup.clone(),
        duration_s: args.duration_s,
        rounds: args.rounds,
        seed: args.seed,
        points,
    };
    report::write(&args.out, &result)?;
    anyhow::ensure!(result.points.iter().all(|p| p.with.errors == 0 && p.without.errors == 0), "some requests failed");
    Ok(())
}

/// What the rounds measured through one Envoy.
#[derive(Default)]
struct Samples {
    latency: Vec<Duration>,
    lag: Vec<Duration>,
    errors: usize,
}

impl Samples {
    fn run(self) -> Run {
        Run {
            sent: self.latency.len() + self.errors,
            errors: self.errors,
            latency: report::latency(self.latency),
            send_lag: report::latency(self.lag),
        }
    }
}

/// One round through `base`: a warmup, then `duration_s / rounds` measured
/// seconds, on the round's own schedule (the same for both Envoys).
async fn run(http: &reqwest::Client, base: &str, rate: f64, round: u64, args: &OverheadArgs, out: &mut Samples) {
    let (model, chat) = (&args.model, args.system_prompt_tokens > 0);
    let url = format!("{base}/v1/{}", if chat { "chat/completions" } else { "completions" });
    let system = "lantern ".repeat(args.system_prompt_tokens);
    let secs = args.duration_s / f64::from(args.rounds.max(1));
    let offsets = arrivals::poisson(&mut StdRng::seed_from_u64(args.seed.wrapping_add(round)), rate, args.warmup_s + secs);
    let start = Instant::now() + Duration::from_millis(50);
    let warmup = Duration::from_secs_f64(args.warmup_s);
    let tasks: Vec<_> = offsets
        .into_iter()
        .enumerate()
        .map(|(i, offset)| {
            let (http, url) = (http.clone(), url.clone());
            let body = if chat {
                json!({"model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": format!("request {round}.{i}")}], "max_tokens": 1})
            } else {
                json!({"model": model, "prompt": format!("request {round}.{i}"), "max_tokens": 1})
            };
            let at = start + offset;
            tokio::spawn(async move {
                tokio::time::sleep_until(at).await;
                let lag = at.elapsed();
                let ok = match http.post(&url).json(&body).send().await {
                    Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                    Err(_) => false,
                };
                (offset >= warmup, ok, at.elapsed(), lag)
            })
        })
        .collect();
    for t in tasks {
        let Ok((measured, ok, took, late)) = t.await else {
            out.errors += 1;
            continue;
        };
        if !measured {
            continue;
        }
        if ok {
            out.latency.push(took);
            out.lag.push(late);
        } else {
            out.errors += 1;
        }
    }
}
