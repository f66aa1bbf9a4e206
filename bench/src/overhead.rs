//! `overhead`: the latency each layer in front of an engine adds, as a
//! ladder measured in one run against the same near-instant simulators with
//! the same requests on the same open-loop schedule. The rungs: straight to
//! the simulators (the floor), a plain Envoy, Envoy with a no-op ext_proc
//! processor behind inferrail's own filters (what the architecture costs),
//! Envoy with inferrail (tokenizing prompts of about 2,000 tokens for real),
//! Envoy with inferrail inside as its dynamic module (no hop), the same with
//! the engines' load from the scraper sidecar (whose CPU is counted apart)
//! and SGLang's router. Rounds go through every rung in turn, starting one
//! rung later each round, so drift in the machine's load falls on all alike.
//!
//! Latency on a shared machine is noisy; CPU time per request is steadier:
//! each process's user and system time from `/proc` over each rung's window,
//! divided by the requests the rung sent. The long-prompt case then sends
//! 220 KB prompts from 1, 20 and 150 closed-loop clients and reports the time
//! to first token each rung adds: with one client nothing waits for the
//! cores, so that is what each layer itself takes; with more, the CPU each
//! spends per request turns into queueing on a small machine. Last, paced
//! simulators take the near-instant ones' ports and closed-loop clients
//! read streams of 256 tokens at the engine's own pace: what each layer
//! spends per stream, a chunk at a time.

mod fleet;
mod send;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use rand::SeedableRng;
use rand::rngs::StdRng;
use serde::Serialize;

use crate::cpu::Snapshot;
use crate::processes::Programs;
use crate::report::{self, Latency};
use crate::run;
use fleet::Role;
use inferrail_workload::arrivals;
use inferrail_workload::text;
use send::Sample;

/// A layer in front of the simulators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rung {
    /// Straight to the simulators, in turn: the floor.
    Direct,
    /// Envoy without ext_proc filters (`bench/envoy/plain.yaml`).
    Envoy,
    /// Envoy with inferrail's filters and the no-op processor behind them.
    Noop,
    /// Envoy with inferrail.
    Inferrail,
    /// Envoy with inferrail inside, as its dynamic module.
    Module,
    /// The same, the engines' load read by the `inferrail-scraper` sidecar
    /// and streamed to the module (the deployment that keeps scrapes out of
    /// Envoy's process).
    ModuleSidecar,
    /// SGLang's router.
    Sglang,
}

/// Flags of `overhead`.
#[derive(Debug, Clone, Args)]
pub struct OverheadArgs {
    /// Rungs to measure; the first is the floor the others are compared to.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "direct,envoy,noop,inferrail,module,module-sidecar,sglang")]
    pub rungs: Vec<Rung>,
    /// Arrivals per second (Poisson) of the ladder.
    #[arg(long, default_value_t = 100.0)]
    pub rate: f64,
    /// Measured seconds per rung, over all rounds.
    #[arg(long, default_value_t = 20.0)]
    pub duration_s: f64,
    /// Unmeasured seconds before each round's measured part, per rung.
    #[arg(long, default_value_t = 1.0)]
    pub warmup_s: f64,
    /// Rounds, each through every rung.
    #[arg(long, default_value_t = 4)]
    pub rounds: u32,
    /// Words of each ladder prompt (unique per request; about one Qwen3 token each).
    #[arg(long, default_value_t = 2000)]
    pub prompt_words: usize,
    /// Kilobytes of each long prompt (0 leaves the long-prompt case out).
    #[arg(long, default_value_t = 220)]
    pub long_prompt_kb: usize,
    /// Concurrent clients of the long-prompt case.
    #[arg(long, value_delimiter = ',', default_value = "1,20,150")]
    pub long_clients: Vec<usize>,
    /// Seconds per rung and client count of the long-prompt case, over all rounds.
    #[arg(long, default_value_t = 8.0)]
    pub long_duration_s: f64,
    /// Output tokens of each stream of the streams case, at the simulators'
    /// default pace (0 leaves the case out).
    #[arg(long, default_value_t = 256)]
    pub stream_tokens: usize,
    /// Concurrent clients of the streams case.
    #[arg(long, default_value_t = 20)]
    pub stream_clients: usize,
    /// Seconds per rung of the streams case, over all rounds.
    #[arg(long, default_value_t = 24.0)]
    pub stream_duration_s: f64,
    /// Seed of the schedules and prompts.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Inferrail's policy.
    #[arg(long, default_value = "cost_model")]
    pub policy: String,
    /// Inferrail's tokenizer (a real one: the ladder measures tokenizing).
    #[arg(long, default_value = ".cache/tokenizers/qwen3")]
    pub tokenizer: String,
    /// SGLang's router policy.
    #[arg(long, default_value = "cache_aware")]
    pub sglang_policy: String,
    /// The programs it starts.
    #[command(flatten)]
    pub programs: Programs,
    /// The machine and software, recorded in the result.
    #[arg(long, default_value = "")]
    pub setup: String,
    /// Where to write the JSON result (the processes' logs go beside it, in `<stem>-logs/`).
    #[arg(long, default_value = "bench/results/overhead/ladder.json")]
    pub out: PathBuf,
}

/// One rung's measurement.
#[derive(Debug, Serialize)]
struct RungResult {
    rung: Rung,
    /// Measured requests that were answered, and those that failed.
    ok: usize,
    errors: usize,
    /// The failures by kind.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    failures: BTreeMap<String, usize>,
    /// Open loop: scheduled send to the last byte. Long prompts: send to the first byte.
    latency: Latency,
    /// Open loop only: how late requests left.
    #[serde(skip_serializing_if = "Option::is_none")]
    send_lag: Option<Latency>,
    /// Over the floor (the first rung), milliseconds.
    added_p50_ms: f64,
    added_p99_ms: f64,
    added_mean_ms: f64,
    /// This rung's percentile over the floor's.
    ratio_p50: f64,
    ratio_p99: f64,
    /// Answered requests inferrail named a replica for (the rest it let through unrouted).
    named: usize,
    /// Mean prompt tokens inferrail counted, where it said.
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_tokens_mean: Option<f64>,
    /// CPU time per request sent (warmup included) of each process the rung goes through, µs.
    cpu_us_per_request: BTreeMap<Role, f64>,
    /// Requests sent, warmup included, over the CPU windows.
    cpu_requests: usize,
}

/// The long-prompt case at one client count.
#[derive(Debug, Serialize)]
struct LongLevel {
    clients: usize,
    rungs: Vec<RungResult>,
}

#[derive(Debug, Serialize)]
struct LongPrompt {
    prompt_bytes: usize,
    duration_s: f64,
    levels: Vec<LongLevel>,
}

/// Streams at the simulators' own pace, closed loop.
#[derive(Debug, Serialize)]
struct Streams {
    output_tokens: usize,
    clients: usize,
    duration_s: f64,
    /// CPU each process used per second with no traffic, paced simulators in place, ms/s.
    idle_cpu_ms_per_s: BTreeMap<Role, f64>,
    /// Latency is to the first byte; CPU is per stream.
    rungs: Vec<RungResult>,
}

#[derive(Debug, Serialize)]
struct OverheadResult {
    benchmark: &'static str,
    commit: String,
    command: String,
    setup: String,
    rate: f64,
    duration_s: f64,
    warmup_s: f64,
    rounds: u32,
    seed: u64,
    prompt_words: usize,
    policy: String,
    tokenizer: String,
    sglang_policy: String,
    /// CPU each process used per second with no traffic at all (health checks, scrapes), ms/s.
    idle_cpu_ms_per_s: BTreeMap<Role, f64>,
    rungs: Vec<RungResult>,
    #[serde(skip_serializing_if = "Option::is_none")]
    long_prompt: Option<LongPrompt>,
    #[serde(skip_serializing_if = "Option::is_none")]
    streams: Option<Streams>,
}

/// What a rung accumulates over the rounds.
#[derive(Default)]
struct Acc {
    sample: Sample,
    cpu: BTreeMap<Role, Duration>,
}

/// CPU time used so far by each role (the client alone, the others with their descendants).
fn cpu_by_role(pids: &[(Role, u32)]) -> anyhow::Result<BTreeMap<Role, Duration>> {
    let snapshot = Snapshot::take()?;
    let mut by = BTreeMap::new();
    for &(role, pid) in pids {
        let used = if role == Role::Client { snapshot.own(pid)? } else { snapshot.tree(pid)? };
        *by.entry(role).or_default() += used;
    }
    Ok(by)
}

/// Runs `send` with the CPU of every process read before and after, adding
/// the differences of `rung`'s processes to `acc`.
async fn measured(
    pids: &[(Role, u32)],
    rung: Rung,
    acc: &mut Acc,
    send: impl AsyncFnOnce(&mut Sample) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let before = cpu_by_role(pids)?;
    send(&mut acc.sample).await?;
    let after = cpu_by_role(pids)?;
    for role in rung.roles() {
        let (Some(a), Some(b)) = (after.get(role), before.get(role)) else { continue };
        *acc.cpu.entry(*role).or_default() += a.saturating_sub(*b);
    }
    Ok(())
}

/// The rungs' results against the first one's, in the order given.
fn results(rungs: &[Rung], accs: Vec<Acc>, open_loop: bool) -> Vec<RungResult> {
    let mut out: Vec<RungResult> = rungs
        .iter()
        .zip(accs)
        .map(|(&rung, acc)| {
            let s = acc.sample;
            let per_request = |d: &Duration| if s.sent == 0 { 0.0 } else { d.as_secs_f64() * 1e6 / s.sent as f64 };
            let prompt_tokens_mean =
                (!s.prompt_tokens.is_empty()).then(|| s.prompt_tokens.iter().sum::<u64>() as f64 / s.prompt_tokens.len() as f64);
            RungResult {
                rung,
                ok: s.latency.len(),
                errors: s.errors(),
                failures: s.failures.clone(),
                latency: report::latency(s.latency),
                send_lag: open_loop.then(|| report::latency(s.lag)),
                added_p50_ms: 0.0,
                added_p99_ms: 0.0,
                added_mean_ms: 0.0,
                ratio_p50: 1.0,
                ratio_p99: 1.0,
                named: s.named,
                prompt_tokens_mean,
                cpu_us_per_request: acc.cpu.iter().map(|(r, d)| (*r, per_request(d))).collect(),
                cpu_requests: s.sent,
            }
        })
        .collect();
    let Some(floor) = out.first().map(|r| r.latency.clone()) else { return out };
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
    for r in &mut out {
        r.added_p50_ms = r.latency.p50_ms - floor.p50_ms;
        r.added_p99_ms = r.latency.p99_ms - floor.p99_ms;
        r.added_mean_ms = r.latency.mean_ms - floor.mean_ms;
        r.ratio_p50 = ratio(r.latency.p50_ms, floor.p50_ms);
        r.ratio_p99 = ratio(r.latency.p99_ms, floor.p99_ms);
    }
    out
}

/// A chat request with one user message and `max_tokens` output tokens.
fn chat(model: &str, content: &str, max_tokens: usize, stream: bool) -> anyhow::Result<Vec<u8>> {
    let body =
        serde_json::json!({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "stream": stream});
    Ok(serde_json::to_vec(&body)?)
}

/// The rungs in round `round`'s order: one later each round.
fn order(rungs: &[Rung], round: u32) -> Vec<(usize, Rung)> {
    let n = rungs.len();
    (0..n).map(|k| (k + round as usize) % n).map(|i| (i, rungs[i])).collect()
}

/// Runs the ladder and the long-prompt case and writes the result.
pub async fn overhead(args: OverheadArgs) -> anyhow::Result<()> {
    anyhow::ensure!(!args.rungs.is_empty(), "--rungs names no rung");
    anyhow::ensure!(
        args.rate > 0.0 && args.duration_s > 0.0 && args.warmup_s >= 0.0 && args.rounds > 0 && args.long_duration_s > 0.0,
        "--rate, --duration-s, --rounds and --long-duration-s must be positive, --warmup-s at least 0"
    );
    anyhow::ensure!(args.long_clients.iter().all(|&c| c > 0), "--long-clients must be positive");
    anyhow::ensure!(args.stream_clients > 0 && args.stream_duration_s > 0.0, "--stream-clients and --stream-duration-s must be positive");
    let http = run::client(120.0)?;
    let logs = args.out.with_extension("").to_string_lossy().into_owned() + "-logs";
    let mut fleet = fleet::start(&args, &args.rungs, std::path::Path::new(&logs), &http).await?;
    let model = "inferrail/sim-8b";

    let idle_cpu_ms_per_s = idle_cpu(&fleet.pids).await?;

    let secs = args.duration_s / f64::from(args.rounds);
    let warmup = Duration::from_secs_f64(args.warmup_s);
    let mut accs: Vec<Acc> = args.rungs.iter().map(|_| Acc::default()).collect();
    for round in 0..args.rounds {
        let mut rng = StdRng::seed_from_u64(args.seed.wrapping_add(u64::from(round)));
        let offsets = arrivals::poisson(&mut rng, args.rate, args.warmup_s + secs);
        let bodies: Vec<Vec<u8>> = (0..offsets.len())
            .map(|i| chat(model, &text::unique(&mut rng, &format!("r{round}n{i}"), args.prompt_words), 1, false))
            .collect::<anyhow::Result<_>>()?;
        for (i, rung) in order(&args.rungs, round) {
            let urls = rung.urls();
            measured(&fleet.pids, rung, &mut accs[i], async |s| send::open_loop(&http, &urls, &bodies, &offsets, warmup, s).await).await?;
        }
        eprintln!("ladder round {} of {} done", round + 1, args.rounds);
    }
    let rungs = results(&args.rungs, accs, true);
    for r in &rungs {
        eprintln!(
            "{:?}: p50 {:.3} ms (+{:.3}), p99 {:.3} ms (+{:.3}), {} errors, CPU µs/request {:?}",
            r.rung, r.latency.p50_ms, r.added_p50_ms, r.latency.p99_ms, r.added_p99_ms, r.errors, r.cpu_us_per_request
        );
    }

    let long_prompt = if args.long_prompt_kb > 0 { Some(long_prompt(&args, &fleet.pids, &http, model).await?) } else { None };
    let streams = if args.stream_tokens > 0 {
        fleet.pace(&args, std::path::Path::new(&logs), &args.rungs, &http).await?;
        Some(streams(&args, &fleet.pids, &http, model).await?)
    } else {
        None
    };
    let result = OverheadResult {
        benchmark: "overhead-ladder",
        commit: run::commit(),
        command: run::command_line(),
        setup: args.setup.clone(),
        rate: args.rate,
        duration_s: args.duration_s,
        warmup_s: args.warmup_s,
        rounds: args.rounds,
        seed: args.seed,
        prompt_words: args.prompt_words,
        policy: args.policy.clone(),
        tokenizer: args.tokenizer.clone(),
        sglang_policy: args.sglang_policy.clone(),
        idle_cpu_ms_per_s,
        rungs,
        long_prompt,
        streams,
    };
    drop(fleet);
    report::save(&args.out, &result)?;
    eprintln!("wrote {}", args.out.display());
    let long = result.long_prompt.iter().flat_map(|l| l.levels.iter().flat_map(|l| &l.rungs));
    let failed: usize = result.rungs.iter().chain(long).chain(result.streams.iter().flat_map(|s| &s.rungs)).map(|r| r.errors).sum();
    anyhow::ensure!(failed == 0, "{failed} requests failed");
    Ok(())
}

/// CPU each process uses per second over two seconds with no traffic, ms/s.
async fn idle_cpu(pids: &[(Role, u32)]) -> anyhow::Result<BTreeMap<Role, f64>> {
    let window = Duration::from_secs(2);
    let before = cpu_by_role(pids)?;
    tokio::time::sleep(window).await;
    let after = cpu_by_role(pids)?;
    Ok(after.iter().map(|(r, a)| (*r, a.saturating_sub(before[r]).as_secs_f64() * 1e3 / window.as_secs_f64())).collect())
}

/// Runs `clients` closed-loop clients of `body` through each rung for
/// `secs` a round, spread over the rung's URLs, in rounds.
async fn closed_rounds(
    args: &OverheadArgs,
    pids: &[(Role, u32)],
    http: &reqwest::Client,
    clients: usize,
    secs: f64,
    body: impl Fn(Rung, u32) -> Arc<dyn Fn(usize, usize) -> Vec<u8> + Send + Sync>,
) -> anyhow::Result<Vec<RungResult>> {
    let mut accs: Vec<Acc> = args.rungs.iter().map(|_| Acc::default()).collect();
    for round in 0..args.rounds {
        for (i, rung) in order(&args.rungs, round) {
            let body = body(rung, round);
            // One URL per rung but the floor's three: clients spread over them.
            let urls = rung.urls();
            measured(pids, rung, &mut accs[i], async |s| {
                let per = clients.div_ceil(urls.len());
                let mut parts = Vec::new();
                for (k, url) in urls.iter().enumerate() {
                    let n = per.min(clients - (k * per).min(clients));
                    let body = body.clone();
                    parts.push(async move {
                        let mut part = Sample::default();
                        send::closed_loop(http, url, n, secs, body, &mut part).await.map(|()| part)
                    });
                }
                for part in futures_util::future::join_all(parts).await {
                    s.merge(part?);
                }
                Ok(())
            })
            .await?;
        }
    }
    Ok(results(&args.rungs, accs, false))
}

/// Streams of `--stream-tokens` output tokens at the simulators' own pace
/// from closed-loop clients, through every rung in rounds: what each layer
/// spends per stream, chunk by chunk.
async fn streams(args: &OverheadArgs, pids: &[(Role, u32)], http: &reqwest::Client, model: &str) -> anyhow::Result<Streams> {
    let idle_cpu_ms_per_s = idle_cpu(pids).await?;
    let (tokens, secs) = (args.stream_tokens, args.stream_duration_s / f64::from(args.rounds));
    let model = model.to_string();
    let rungs = closed_rounds(args, pids, http, args.stream_clients, secs, |rung, round| {
        let model = model.clone();
        Arc::new(move |c, n| chat(&model, &format!("stream {rung:?} {round} {c} {n}: tell a long story"), tokens, true).unwrap_or_default())
    })
    .await?;
    for r in &rungs {
        eprintln!(
            "{} clients, {tokens}-token streams, {:?}: TTFT mean {:.1} ms, {} ok, {} errors {:?}, CPU µs/stream {:?}",
            args.stream_clients, r.rung, r.latency.mean_ms, r.ok, r.errors, r.failures, r.cpu_us_per_request
        );
    }
    Ok(Streams { output_tokens: tokens, clients: args.stream_clients, duration_s: args.stream_duration_s, idle_cpu_ms_per_s, rungs })
}

/// 220 KB prompts (by default) from closed-loop clients, through every rung in rounds.
async fn long_prompt(args: &OverheadArgs, pids: &[(Role, u32)], http: &reqwest::Client, model: &str) -> anyhow::Result<LongPrompt> {
    let bytes = args.long_prompt_kb * 1024;
    // Words until the body's text has the size; each request starts with its own marker, so nothing is cached.
    let mut filler = text::unique(&mut StdRng::seed_from_u64(args.seed), "", bytes / 6);
    filler.truncate(filler[..bytes.min(filler.len())].rfind(' ').unwrap_or(0));
    let template = chat(model, "MARKER", 1, true)?;
    let text = String::from_utf8(template)?;
    let (head, tail) = text.split_once("MARKER").ok_or_else(|| anyhow::anyhow!("no marker in the template"))?;
    let (head, tail) = (head.to_string(), format!("{filler}{tail}"));
    let mut levels = Vec::new();
    for &clients in &args.long_clients {
        let secs = args.long_duration_s / f64::from(args.rounds);
        let rungs = closed_rounds(args, pids, http, clients, secs, |rung, round| {
            let (head, tail) = (head.clone(), tail.clone());
            Arc::new(move |c, n| format!("{head}{rung:?}{round}c{c}n{n}{tail}").into_bytes())
        })
        .await?;
        for r in &rungs {
            eprintln!(
                "{clients} clients, {} KB prompts, {:?}: TTFT mean {:.1} ms (+{:.1}), p99 {:.1} ms (+{:.1}), {} ok, {} errors {:?}, {} named",
                args.long_prompt_kb,
                r.rung,
                r.latency.mean_ms,
                r.added_mean_ms,
                r.latency.p99_ms,
                r.added_p99_ms,
                r.ok,
                r.errors,
                r.failures,
                r.named
            );
        }
        levels.push(LongLevel { clients, rungs });
    }
    Ok(LongPrompt { prompt_bytes: head.len() + tail.len(), duration_s: args.long_duration_s, levels })
}
