//! Open-loop load: requests leave on a seeded Poisson schedule whatever the
//! earlier ones are doing, and latency counts from the scheduled send time,
//! so a server that falls behind cannot hide its queueing.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::json;
use tokio::time::Instant;

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
    /// Measured seconds per run.
    #[arg(long, default_value_t = 10.0)]
    pub duration_s: f64,
    /// Unmeasured seconds before each run.
    #[arg(long, default_value_t = 2.0)]
    pub warmup_s: f64,
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
    seed: u64,
    points: Vec<RatePoint>,
}

/// Measures, per rate, the same schedule through both Envoys.
pub async fn overhead(args: OverheadArgs) -> anyhow::Result<()> {
    let http = reqwest::Client::builder().pool_max_idle_per_host(512).tcp_nodelay(true).build()?;
    let mut points = Vec::new();
    for &rate in &args.rates {
        let without = run(&http, &args.without, &args.model, rate, &args).await;
        let with = run(&http, &args.with, &args.model, rate, &args).await;
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
        seed: args.seed,
        points,
    };
    report::write(&args.out, &result)?;
    anyhow::ensure!(result.points.iter().all(|p| p.with.errors == 0 && p.without.errors == 0), "some requests failed");
    Ok(())
}

/// Poisson send times (offsets from the start) for `rate` over `secs`.
pub fn schedule(rate: f64, secs: f64, seed: u64) -> Vec<Duration> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = 0.0;
    let mut out = Vec::with_capacity((rate * secs * 1.1) as usize);
    loop {
        let u: f64 = rng.random_range(f64::EPSILON..1.0);
        t += -u.ln() / rate;
        if t >= secs {
            return out;
        }
        out.push(Duration::from_secs_f64(t));
    }
}

async fn run(http: &reqwest::Client, base: &str, model: &str, rate: f64, args: &OverheadArgs) -> Run {
    let chat = args.system_prompt_tokens > 0;
    let url = format!("{base}/v1/{}", if chat { "chat/completions" } else { "completions" });
    let system = "lantern ".repeat(args.system_prompt_tokens);
    let offsets = schedule(rate, args.warmup_s + args.duration_s, args.seed);
    let start = Instant::now() + Duration::from_millis(50);
    let warmup = Duration::from_secs_f64(args.warmup_s);
    let tasks: Vec<_> = offsets
        .into_iter()
        .enumerate()
        .map(|(i, offset)| {
            let (http, url) = (http.clone(), url.clone());
            let body = if chat {
                json!({"model": model, "messages": [{"role": "system", "content": system}, {"role": "user", "content": format!("request {i}")}], "max_tokens": 1})
            } else {
                json!({"model": model, "prompt": format!("request {i}"), "max_tokens": 1})
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
    let (mut latency, mut lag, mut errors) = (Vec::new(), Vec::new(), 0);
    for t in tasks {
        let Ok((measured, ok, took, late)) = t.await else {
            errors += 1;
            continue;
        };
        if !measured {
            continue;
        }
        if ok {
            latency.push(took);
            lag.push(late);
        } else {
            errors += 1;
        }
    }
    Run { sent: latency.len() + errors, errors, latency: report::latency(latency), send_lag: report::latency(lag) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedule_has_the_asked_rate_and_replays_from_its_seed() {
        let s = schedule(1000.0, 10.0, 3);
        assert!((9_700..10_300).contains(&s.len()), "{}", s.len());
        assert!(s.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(s, schedule(1000.0, 10.0, 3));
        assert_ne!(s, schedule(1000.0, 10.0, 4));
    }
}
