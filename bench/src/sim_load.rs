//! Load against a single engine (the simulator or a real vLLM): many streams
//! at once, and closed-loop requests per second.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::json;

use crate::report::{self, Latency};

/// Flags of `streams`.
#[derive(Debug, Clone, Args)]
pub struct StreamsArgs {
    /// Engine base URL.
    #[arg(long, default_value = "http://127.0.0.1:18001")]
    pub url: String,
    /// Model to ask for.
    #[arg(long, default_value = "inferrail/sim-8b")]
    pub model: String,
    /// Streams opened at once.
    #[arg(long, default_value_t = 2000)]
    pub streams: usize,
    /// Tokens each stream asks for.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// What the engine under test is, recorded in the result.
    #[arg(long, default_value = "inferrail-sim")]
    pub engine: String,
    /// Where to write the JSON result.
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Debug, Serialize)]
struct StreamsResult {
    benchmark: &'static str,
    engine: String,
    streams: usize,
    max_tokens: usize,
    completed: usize,
    errors: usize,
    first_error: Option<String>,
    wall_s: f64,
    time_to_first_token: Latency,
    stream_duration: Latency,
}

/// Opens every stream at once and reads each to `[DONE]`.
pub async fn streams(args: StreamsArgs) -> anyhow::Result<()> {
    let http = reqwest::Client::builder().pool_max_idle_per_host(args.streams).build()?;
    let url = format!("{}/v1/chat/completions", args.url);
    let start = Instant::now();
    let tasks: Vec<_> = (0..args.streams)
        .map(|i| {
            let (http, url) = (http.clone(), url.clone());
            let body = json!({
                "model": args.model,
                "messages": [{"role": "user", "content": format!("Stream number {i}: tell me a story.")}],
                "max_tokens": args.max_tokens,
                "stream": true,
                "stream_options": {"include_usage": true},
            });
            tokio::spawn(async move { one_stream(&http, &url, &body, args.max_tokens).await })
        })
        .collect();
    let (mut ttfts, mut totals, mut errors, mut first_error) = (Vec::new(), Vec::new(), 0, None);
    for t in tasks {
        match t.await.context("stream task")? {
            Ok((ttft, total)) => {
                ttfts.push(ttft);
                totals.push(total);
            }
            Err(e) => {
                errors += 1;
                first_error.get_or_insert(format!("{e:#}"));
            }
        }
    }
    let result = StreamsResult {
        benchmark: "concurrent-streams",
        engine: args.engine,
        streams: args.streams,
        max_tokens: args.max_tokens,
        completed: totals.len(),
        errors,
        first_error,
        wall_s: start.elapsed().as_secs_f64(),
        time_to_first_token: report::latency(ttfts),
        stream_duration: report::latency(totals),
    };
    report::write(&args.out, &result)?;
    anyhow::ensure!(result.errors == 0, "{} of {} streams failed", result.errors, result.streams);
    Ok(())
}

/// One stream read to its end: time to the first token and to `[DONE]`.
async fn one_stream(http: &reqwest::Client, url: &str, body: &serde_json::Value, want: usize) -> anyhow::Result<(Duration, Duration)> {
    let start = Instant::now();
    let r = http.post(url).json(body).send().await?.error_for_status()?;
    let mut events = r.bytes_stream().eventsource();
    let (mut first, mut tokens, mut done) = (None, 0, false);
    while let Some(event) = events.next().await {
        let data = event?.data;
        if data == "[DONE]" {
            done = true;
            break;
        }
        let v: serde_json::Value = serde_json::from_str(&data)?;
        if v["choices"][0]["delta"]["content"].as_str().is_some_and(|c| !c.is_empty()) {
            first.get_or_insert(start.elapsed());
            tokens += 1;
        }
    }
    anyhow::ensure!(done, "stream ended before [DONE]");
    anyhow::ensure!(tokens == want, "got {tokens} tokens, wanted {want}");
    Ok((first.unwrap_or_default(), start.elapsed()))
}

/// Flags of `throughput`.
#[derive(Debug, Clone, Args)]
pub struct ThroughputArgs {
    /// Engine base URL.
    #[arg(long, default_value = "http://127.0.0.1:18001")]
    pub url: String,
    /// Model to ask for.
    #[arg(long, default_value = "inferrail/sim-8b")]
    pub model: String,
    /// Requests kept in flight.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// How long to send, seconds.
    #[arg(long, default_value_t = 10.0)]
    pub duration_s: f64,
    /// Tokens each request asks for.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// What the engine under test is, recorded in the result.
    #[arg(long, default_value = "inferrail-sim --zero-latency")]
    pub engine: String,
    /// Where to write the JSON result.
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Debug, Serialize)]
struct ThroughputResult {
    benchmark: &'static str,
    engine: String,
    concurrency: usize,
    max_tokens: usize,
    duration_s: f64,
    requests: usize,
    errors: usize,
    requests_per_second: f64,
    latency: Latency,
}

/// Keeps `concurrency` non-streaming completions in flight for the duration.
pub async fn throughput(args: ThroughputArgs) -> anyhow::Result<()> {
    let http = reqwest::Client::builder().pool_max_idle_per_host(args.concurrency).build()?;
    let url = format!("{}/v1/completions", args.url);
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let workers: Vec<_> = (0..args.concurrency)
        .map(|w| {
            let (http, url, stop) = (http.clone(), url.clone(), stop.clone());
            let model = args.model.clone();
            let max_tokens = args.max_tokens;
            tokio::spawn(async move {
                let (mut lat, mut errors, mut n) = (Vec::new(), 0usize, 0usize);
                while !stop.load(Ordering::Relaxed) {
                    let body = json!({"model": model, "prompt": format!("worker {w} request {n}"), "max_tokens": max_tokens});
                    let t = Instant::now();
                    let ok = match http.post(&url).json(&body).send().await {
                        Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                        Err(_) => false,
                    };
                    if ok {
                        lat.push(t.elapsed())
                    } else {
                        errors += 1
                    }
                    n += 1;
                }
                (lat, errors)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs_f64(args.duration_s)).await;
    stop.store(true, Ordering::Relaxed);
    let (mut lat, mut errors) = (Vec::new(), 0);
    for w in workers {
        let (l, e) = w.await.context("worker")?;
        lat.extend(l);
        errors += e;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let result = ThroughputResult {
        benchmark: "closed-loop-throughput",
        engine: args.engine,
        concurrency: args.concurrency,
        max_tokens: args.max_tokens,
        duration_s: elapsed,
        requests: lat.len(),
        errors,
        requests_per_second: lat.len() as f64 / elapsed,
        latency: report::latency(lat),
    };
    report::write(&args.out, &result)?;
    anyhow::ensure!(result.errors == 0, "{} requests failed", result.errors);
    Ok(())
}
