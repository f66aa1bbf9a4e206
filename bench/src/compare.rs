//! `compare`: every policy, and SGLang's own router as a real peer, on the
//! same requests at the same times, each on a cold fleet.
//!
//! For each workload and repetition the requests are generated once (the
//! repetition's seed); then for each contender three simulators start
//! fresh, with either inferrail behind Envoy (the shipped `envoy/local.yaml`
//! on other ports) configured with the policy, or SGLang's router
//! (`sglang_router.launch_router`, PyPI `sglang-router`) in front of the
//! same simulators; the requests are sent open loop, warmup left out of the
//! summary, and everything is stopped before the next contender. Each run's
//! result is a JSON file; the table of all of them is printed and written as
//! Markdown and JSON beside them. Replica shares come from the engines' own
//! request counters, so the peer, which names no replica, is measured alike.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use serde::Serialize;

use crate::run::{self, Measured};
use crate::summary::Slo;
use crate::workload::{self, Kind, Spec};

/// Flags of `compare`.
#[derive(Debug, Clone, Args)]
pub struct CompareArgs {
    /// Contenders: inferrail policies by name, and `sglang:<policy>` for
    /// SGLang's router with one of its policies (`cache_aware`, `round_robin`).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "round_robin,least_request,prefix_hash,kv_aware,cost_model,sglang_cache_aware,dynamo_kv,gie_default,sglang:cache_aware,sglang:round_robin"
    )]
    pub contenders: Vec<String>,
    /// Workloads to run.
    #[arg(long, value_delimiter = ',', value_enum, default_value = "w1,mix")]
    pub workloads: Vec<Kind>,
    /// Repetitions of each workload, each with its own seed (`seed + rep`).
    #[arg(long, default_value_t = 1)]
    pub reps: u64,
    /// The shape of the workloads (`--workload` is ignored: see `--workloads`).
    #[command(flatten)]
    pub spec: Spec,
    /// Arrivals per second (Poisson). With 640-block caches, three
    /// simulators serve W1 at under 1 req/s: a replica holds about two
    /// decoding 5,000-token prompts.
    #[arg(long, default_value_t = 0.5)]
    pub rate: f64,
    /// Measured seconds of arrivals, after the warmup.
    #[arg(long, default_value_t = 60.0)]
    pub duration_s: f64,
    /// Seconds of arrivals sent first and left out of the summary.
    #[arg(long, default_value_t = 15.0)]
    pub warmup_s: f64,
    /// Seed of the first repetition.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// SLO on time to first token, milliseconds, at time scale 1.
    #[arg(long, default_value_t = 2000.0)]
    pub slo_ttft_ms: f64,
    /// SLO on time per output token, milliseconds, at time scale 1.
    #[arg(long, default_value_t = 100.0)]
    pub slo_tpot_ms: f64,
    /// Scales the simulators' latency model, the router's matching costs and
    /// the SLO ([`crate::timescale`]; 0.1: ten times faster engines, a 200 ms
    /// TTFT SLO); rates and durations are as given.
    #[arg(long, default_value_t = 1.0, value_parser = crate::timescale::parse)]
    pub time_scale: f64,
    /// Extra flags of every simulator (cache size), space separated; they come after the time scale's.
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub sim_flags: String,
    /// Where the inferrail, inferrail-sim binaries are.
    #[arg(long, default_value = "target/release")]
    pub bin_dir: PathBuf,
    /// The Envoy binary.
    #[arg(long, default_value = ".venv/bin/envoy")]
    pub envoy: PathBuf,
    /// The Python that has `sglang_router` installed.
    #[arg(long, default_value = ".venv-sglang/bin/python")]
    pub sglang_python: PathBuf,
    /// The router's tokenizer for the simulators' model.
    #[arg(long, default_value = "builtin:sim")]
    pub tokenizer: String,
    /// Where results (and the processes' logs) go.
    #[arg(long, default_value = "bench/results/routing/runs")]
    pub out_dir: PathBuf,
}

/// Ports of the fleet under test: clear of the local fleet's.
const SIMS: [u16; 3] = [18101, 18102, 18103];
const ENTRY: u16 = 18180;
const ENVOY_ADMIN: u16 = 19901;
const EXT_PROC: u16 = 19002;
const ADMIN: u16 = 19090;
const ADMIN_GRPC: u16 = 19091;
/// A readiness probe that takes longer has failed (the run's client waits up to 600 s).
const PROBE: Duration = Duration::from_secs(2);

/// One contender's run on one workload and repetition.
#[derive(Debug, Serialize)]
pub struct CompareRun {
    benchmark: &'static str,
    commit: String,
    command: String,
    contender: String,
    workload: Kind,
    rep: u64,
    seed: u64,
    rate: f64,
    duration_s: f64,
    warmup_s: f64,
    time_scale: f64,
    sim_flags: String,
    slo: Slo,
    spec: Spec,
    #[serde(flatten)]
    measured: Measured,
}

/// Processes that are stopped when dropped.
struct Processes {
    children: Vec<(String, Child)>,
}

impl Drop for Processes {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            // Already gone is fine: the point is that nothing outlives the run.
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Processes {
    fn spawn(&mut self, name: &str, logs: &Path, program: &Path, args: &[String]) -> anyhow::Result<()> {
        let log = std::fs::File::create(logs.join(format!("{name}.log")))?;
        let child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        self.children.push((name.to_string(), child));
        Ok(())
    }

    fn check_alive(&mut self) -> anyhow::Result<()> {
        for (name, c) in &mut self.children {
            if let Some(status) = c.try_wait()? {
                anyhow::bail!("{name} exited with {status}");
            }
        }
        Ok(())
    }
}

/// Polls `ok` until it holds or `limit` passes, failing if a process died.
async fn until(fleet: &mut Processes, limit: Duration, what: &str, mut ok: impl AsyncFnMut() -> bool) -> anyhow::Result<()> {
    let start = Instant::now();
    while start.elapsed() < limit {
        fleet.check_alive()?;
        if ok().await {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("timed out waiting for {what}")
}

/// The router's configuration for one policy over the simulators.
fn router_config(policy: &str, tokenizer: &str, seed: u64, time_scale: f64) -> anyhow::Result<String> {
    let replicas: String = SIMS
        .iter()
        .enumerate()
        .map(|(i, p)| format!("  - {{id: sim-{}, address: 127.0.0.1:{p}, models: [inferrail/sim-8b]}}\n", i + 1))
        .collect();
    // JSON is YAML: the policies' parameters as the time scale sets them.
    let policies = serde_json::to_string(&crate::timescale::params(time_scale))?;
    Ok(format!(
        "server: {{listen: 127.0.0.1:{EXT_PROC}}}\n\
         admin: {{listen: 127.0.0.1:{ADMIN}, grpc_listen: 127.0.0.1:{ADMIN_GRPC}}}\n\
         routing: {{seed: {seed}, policies: {policies}}}\n\
         models:\n  - {{name: inferrail/sim-8b, aliases: [sim], policy: {policy}, tokenizer: {tokenizer}}}\n\
         replicas:\n{replicas}"
    ))
}

/// The shipped local Envoy bootstrap on the ports of the fleet under test.
fn envoy_config() -> anyhow::Result<String> {
    let mut text = std::fs::read_to_string("envoy/local.yaml").context("reading envoy/local.yaml (run from the repository root)")?;
    let moves = [(8080, ENTRY), (9901, ENVOY_ADMIN), (9002, EXT_PROC), (8001, SIMS[0]), (8002, SIMS[1]), (8003, SIMS[2])];
    for (from, to) in moves {
        let old = format!("port_value: {from}");
        // The port as a whole number: 8001 must not match 80010.
        let at: Vec<usize> = text
            .match_indices(&old)
            .map(|(i, _)| i)
            .filter(|&i| !text[i + old.len()..].starts_with(|c: char| c.is_ascii_digit()))
            .collect();
        anyhow::ensure!(at.len() == 1, "envoy/local.yaml should name port {from} once");
        text.replace_range(at[0]..at[0] + old.len(), &format!("port_value: {to}"));
    }
    Ok(text)
}

/// Starts the simulators and the contender in front of them; returns when a request is served.
async fn start(args: &CompareArgs, contender: &str, seed: u64, logs: &Path, http: &reqwest::Client) -> anyhow::Result<Processes> {
    std::fs::create_dir_all(logs)?;
    let mut fleet = Processes { children: Vec::new() };
    let sim = args.bin_dir.join("inferrail-sim");
    for (i, port) in SIMS.iter().enumerate() {
        let mut flags: Vec<String> = [
            "--port",
            &port.to_string(),
            "--served-model-name",
            "inferrail/sim-8b",
            "--enable-prompt-tokens-details",
            "--seed",
            &(i + 1).to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        flags.extend(crate::timescale::sim_flags(args.time_scale));
        flags.extend(args.sim_flags.split_whitespace().map(str::to_string));
        fleet.spawn(&format!("sim-{}", i + 1), logs, &sim, &flags)?;
    }
    for port in SIMS {
        until(&mut fleet, Duration::from_secs(30), "a simulator", async || {
            http.get(format!("http://127.0.0.1:{port}/health")).timeout(PROBE).send().await.is_ok_and(|r| r.status().is_success())
        })
        .await?;
    }
    match contender.strip_prefix("sglang:") {
        Some(policy) => {
            let mut flags: Vec<String> =
                ["-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", &ENTRY.to_string(), "--policy", policy]
                    .iter()
                    .map(|s| s.to_string())
                    .collect();
            flags.push("--worker-urls".into());
            flags.extend(SIMS.iter().map(|p| format!("http://127.0.0.1:{p}")));
            flags.extend(["--log-level", "warn", "--prometheus-port", "19290"].map(str::to_string));
            fleet.spawn("sglang-router", logs, &args.sglang_python, &flags)?;
        }
        None => {
            let config = logs.join("inferrail.yaml");
            std::fs::write(&config, router_config(contender, &args.tokenizer, seed, args.time_scale)?)?;
            fleet.spawn("inferrail", logs, &args.bin_dir.join("inferrail"), &["--config".into(), config.display().to_string()])?;
            let envoy = logs.join("envoy.yaml");
            std::fs::write(&envoy, envoy_config()?)?;
            let flags = ["-c", &envoy.display().to_string(), "--disable-hot-restart", "--log-level", "warn", "--concurrency", "1"];
            fleet.spawn("envoy", logs, &args.envoy, &flags.map(str::to_string))?;
        }
    }
    let hello = serde_json::json!({"model": "inferrail/sim-8b", "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1});
    until(&mut fleet, Duration::from_secs(60), "a first request through the router", async || {
        http.post(format!("http://127.0.0.1:{ENTRY}/v1/chat/completions"))
            .json(&hello)
            .timeout(PROBE)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
    })
    .await?;
    Ok(fleet)
}

/// Runs every contender on every workload and repetition.
pub async fn compare(args: CompareArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.rate > 0.0 && args.duration_s > 0.0 && args.warmup_s >= 0.0,
        "--rate and --duration-s must be positive, --warmup-s at least 0"
    );
    let http = run::client(600.0)?;
    let slo = Slo { ttft_ms: args.slo_ttft_ms * args.time_scale, tpot_ms: args.slo_tpot_ms * args.time_scale };
    let engines: Vec<String> = SIMS.iter().map(|p| format!("http://127.0.0.1:{p}")).collect();
    let (commit, command) = (run::commit(), run::command_line());
    let mut runs = Vec::new();
    for &kind in &args.workloads {
        for rep in 0..args.reps {
            let seed = args.seed + rep;
            let spec = Spec { workload: kind, ..args.spec.clone() };
            let requests = workload::generate(&spec, args.rate, args.warmup_s + args.duration_s, seed)?;
            for contender in &args.contenders {
                let name = format!("{}-{contender}-rep{rep}", format!("{kind:?}").to_lowercase()).replace(':', "-");
                eprintln!("{name}: {} requests at {} req/s", requests.len(), args.rate);
                let logs = args.out_dir.join("logs").join(&name);
                let fleet = start(&args, contender, seed, &logs, &http).await.with_context(|| format!("starting the fleet for {name}"))?;
                let measured = run::measure(
                    &http,
                    &format!("http://127.0.0.1:{ENTRY}"),
                    &requests,
                    &engines,
                    Duration::from_secs_f64(args.warmup_s),
                    slo,
                    true,
                )
                .await?;
                drop(fleet);
                eprintln!("{}", row(contender, kind, &measured));
                let result = CompareRun {
                    benchmark: "routing-compare",
                    commit: commit.clone(),
                    command: command.clone(),
                    contender: contender.clone(),
                    workload: kind,
                    rep,
                    seed,
                    rate: args.rate,
                    duration_s: args.duration_s,
                    warmup_s: args.warmup_s,
                    time_scale: args.time_scale,
                    sim_flags: args.sim_flags.clone(),
                    slo,
                    spec: spec.clone(),
                    measured,
                };
                crate::report::save(&args.out_dir.join(format!("{name}.json")), &result)?;
                runs.push(result);
            }
        }
    }
    let table = std::iter::once(HEADER.to_string())
        .chain(runs.iter().map(|r| row(&r.contender, r.workload, &r.measured)))
        .collect::<Vec<_>>()
        .join("\n");
    println!("{table}");
    std::fs::write(args.out_dir.join("table.md"), format!("{table}\n"))?;
    Ok(())
}

/// The engines' columns count the warmup too; the others only the measured requests.
const HEADER: &str = "| contender | workload | ok / measured | TTFT p50 ms | TTFT p99 ms | cached (usage) | cached (engines, with warmup) | busiest share (engines, with warmup) | goodput |\n|---|---|---|---|---|---|---|---|---|";

/// One run as a Markdown table row.
fn row(contender: &str, kind: Kind, m: &Measured) -> String {
    let pct = |x: Option<f64>| x.map_or("n/a".into(), |v| format!("{:.1}%", v * 100.0));
    let s = &m.summary;
    format!(
        "| {contender} | {} | {} / {} | {:.0} | {:.0} | {} | {} | {} | {} |",
        format!("{kind:?}").to_lowercase(),
        s.ok,
        s.requests,
        s.ttft.p50_ms,
        s.ttft.p99_ms,
        pct(s.prefix.hit_rate),
        pct(m.engines.as_ref().and_then(|e| e.hit_rate)),
        pct(m.engines.as_ref().and_then(|e| e.busiest_share)),
        pct(Some(s.goodput.share)),
    )
}
