//! `compare`: every policy, and the peer routers (SGLang's router, `smg`,
//! vLLM's router) as real peers, on the same requests at the same times,
//! each on a cold fleet.
//!
//! For each workload and repetition the requests are generated once (the
//! repetition's seed); then for each contender three simulators start
//! fresh (each with its own speed and cache in a mixed fleet, calibrated
//! once beforehand with `--calibrate`), with either inferrail behind Envoy
//! (the shipped `envoy/local.yaml` on other ports) configured with the
//! policy, or a peer router in front of the
//! same simulators; the requests are sent open loop, warmup left out of the
//! summary, and everything is stopped before the next contender. Each run's
//! result is a JSON file; the table of all of them is printed and written as
//! Markdown and JSON beside them. Replica shares come from the engines' own
//! request counters, so the peer, which names no replica, is measured alike.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use serde::Serialize;

use inferrail_policy::Prefill;

use crate::processes::{self, KvEventPorts, Processes, Programs, until};
use crate::run::{self, Measured};
use crate::summary::Slo;
use inferrail_fleet::capacity::{self, Search};
use inferrail_workload::{self as workload, Kind, Spec};

/// Flags of `compare`.
#[derive(Debug, Clone, Args)]
pub struct CompareArgs {
    /// Contenders: inferrail policies by name, and `<peer>:<policy>` for a
    /// peer router with one of its policies (`cache_aware`, `round_robin`):
    /// `sglang` (PyPI `sglang-router`), `smg` and `vllm-router`; and on a
    /// fleet split by `--prefill-replicas`, `pd:<policy>` for Inferrail
    /// routing it disaggregated and `vllm-router-pd:<policy>` for vLLM's
    /// router in its disaggregated mode; and `<policy>+<variant>` for a
    /// variant of a policy's parameters (`cost_model+gpu_only`: offloaded
    /// KV priced as computed).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "round_robin,random,least_request,p2c,prefix_hash,kv_aware,cost_model,sglang_cache_aware,dynamo_kv,gie_default,sglang:cache_aware,sglang:round_robin"
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
    /// Search each contender's capacity at the SLO instead (`--rate` is the
    /// first guess; one repetition).
    #[arg(long)]
    pub capacity: bool,
    /// The capacity search stops once its bracket is this fraction of the rate.
    #[arg(long, default_value_t = 0.1)]
    pub tolerance: f64,
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
    #[arg(long, default_value_t = 1.0, value_parser = inferrail_fleet::timescale::parse)]
    pub time_scale: f64,
    /// Policy parameters laid over the time scale's, as the routing YAML's
    /// `policies` in JSON: `'{"cost_model": {"share_weight": 0}}'`.
    #[arg(long, value_parser = inferrail_fleet::timescale::parse_overrides)]
    pub policy_params: Option<serde_json::Value>,
    /// The simulators publish their KV events and Inferrail follows them
    /// (exact mode); the peer routers ignore them.
    #[arg(long)]
    pub kv_events: bool,
    /// Extra flags of every simulator (cache size), space separated; they come after the time scale's.
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub sim_flags: String,
    /// A mixed fleet: each simulator's latency model as a multiple of the
    /// time scale's, comma separated, one per simulator (2: half as fast).
    #[arg(long, value_delimiter = ',', default_value = "1,1,1", value_parser = inferrail_fleet::timescale::parse)]
    pub replica_time_scale: Vec<f64>,
    /// A mixed fleet: each simulator's own extra flags after `--sim-flags`
    /// (its cache size), `|` between simulators.
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub replica_sim_flags: String,
    /// A disaggregated contender prefills on this many simulators (the
    /// first ones, NixlConnector's `kv_producer`s) and decodes on the rest
    /// (`kv_consumer`s).
    #[arg(long, default_value_t = 1)]
    pub prefill_replicas: usize,
    /// LoRA adapters one simulator step runs (vLLM's `--max-loras`). With
    /// the `lora` workload every simulator serves its adapters
    /// (`--system-prompts` of them) and Inferrail lists them under the model.
    #[arg(long, default_value_t = 4)]
    pub max_loras: usize,
    /// Calibrate each simulator first (`inferrail-calibrate` on a fresh
    /// fleet) and give Inferrail each replica's own prefill cost, as an
    /// operator of a mixed fleet would; else every replica is priced at
    /// the time scale's.
    #[arg(long)]
    pub calibrate: bool,
    /// The programs it starts.
    #[command(flatten)]
    pub programs: Programs,
    /// The router's tokenizer for the simulators' model.
    #[arg(long, default_value = "builtin:sim")]
    pub tokenizer: String,
    /// Inferrail routers behind Envoy, peers of one another (ADR 0034);
    /// Envoy draws each ext_proc stream's router at random.
    #[arg(long, default_value_t = 1)]
    pub routers: u16,
    /// The Envoy bootstrap in front of inferrail, with the local fleet's
    /// ports (8080, 9901, 9002, 8001-8003), which the run moves to its own.
    #[arg(long, default_value = "envoy/local.yaml")]
    pub envoy_config: PathBuf,
    /// Where results (and the processes' logs) go.
    #[arg(long, default_value = "bench/results/routing/runs")]
    pub out_dir: PathBuf,
}

/// Ports of the fleet under test: clear of the local fleet's.
const SIMS: [u16; 3] = [18101, 18102, 18103];
const ENTRY: u16 = 18180;
const KV_EVENTS: [KvEventPorts; 3] = [
    KvEventPorts { publish: 18111, replay: 18121 },
    KvEventPorts { publish: 18112, replay: 18122 },
    KvEventPorts { publish: 18113, replay: 18123 },
];
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
    /// Inferrail routers, peers of one another.
    routers: u16,
    workload: Kind,
    rep: u64,
    seed: u64,
    rate: f64,
    duration_s: f64,
    warmup_s: f64,
    time_scale: f64,
    /// How often Inferrail read each engine's load (peers read none).
    load_interval_ms: Option<u64>,
    sim_flags: String,
    /// Each simulator's latency model as a multiple of the time scale's.
    replica_time_scale: Vec<f64>,
    /// Each simulator's own flags.
    replica_sim_flags: Vec<String>,
    /// Each replica's prefill cost as Inferrail was given it (`--calibrate`; none: the time scale's).
    prefill: Vec<Option<Prefill>>,
    slo: Slo,
    spec: Spec,
    #[serde(flatten)]
    measured: Measured,
}

/// Starts the simulators, each with its own latency model and flags when
/// the fleet is mixed, and its KV transfer role when `disaggregated`;
/// returns when every one is healthy.
async fn start_sims(args: &CompareArgs, logs: &Path, http: &reqwest::Client, disaggregated: bool) -> anyhow::Result<Processes> {
    std::fs::create_dir_all(logs)?;
    let mut fleet = Processes::default();
    let sim = args.programs.bin_dir.join("inferrail-sim");
    let own: Vec<&str> = args.replica_sim_flags.split('|').collect();
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
        flags.extend(inferrail_fleet::timescale::sim_flags(args.time_scale * args.replica_time_scale.get(i).copied().unwrap_or(1.0)));
        flags.extend(args.sim_flags.split_whitespace().map(str::to_string));
        flags.extend(own.get(i).into_iter().flat_map(|f| f.split_whitespace()).map(str::to_string));
        if args.kv_events {
            flags.extend(KV_EVENTS[i].sim_flags());
        }
        let adapters = adapters(args);
        if !adapters.is_empty() {
            // Every simulator serves every adapter; its path only has to exist.
            flags.extend(["--enable-lora".into(), "--max-loras".into(), args.max_loras.to_string(), "--lora-modules".into()]);
            flags.extend(adapters.iter().map(|a| format!("{a}={}", logs.display())));
        }
        if disaggregated {
            let role = if i < args.prefill_replicas { "kv_producer" } else { "kv_consumer" };
            flags.extend(["--kv-transfer-config".into(), format!(r#"{{"kv_connector":"NixlConnector","kv_role":"{role}"}}"#)]);
        }
        fleet.spawn(&format!("sim-{}", i + 1), logs, &sim, &flags)?;
    }
    for port in SIMS {
        until(&mut fleet, Duration::from_secs(30), "a simulator", async || {
            http.get(format!("http://127.0.0.1:{port}/health")).timeout(PROBE).send().await.is_ok_and(|r| r.status().is_success())
        })
        .await?;
    }
    Ok(fleet)
}

/// The adapters the runs' `lora` workload asks for (none without it).
fn adapters(args: &CompareArgs) -> Vec<String> {
    let lora = args.workloads.contains(&Kind::Lora);
    (0..if lora { args.spec.system_prompts } else { 0 }).map(inferrail_workload::adapter_name).collect()
}

/// Each simulator's prefill cost as `inferrail-calibrate` fits it on a
/// fresh fleet of them (its logs and fits under `logs`).
async fn calibrate(args: &CompareArgs, logs: &Path, http: &reqwest::Client) -> anyhow::Result<Vec<Option<Prefill>>> {
    let mut fleet = start_sims(args, logs, http, false).await?;
    let mut fits = Vec::new();
    for (i, port) in SIMS.iter().enumerate() {
        let out = logs.join(format!("sim-{}.prefill.yaml", i + 1));
        let flags = [
            "--url".to_string(),
            format!("http://127.0.0.1:{port}"),
            "--seed".into(),
            "1".into(),
            "--out".into(),
            out.display().to_string(),
        ];
        let pid = fleet.spawn(&format!("calibrate-{}", i + 1), logs, &args.programs.bin_dir.join("inferrail-calibrate"), &flags)?;
        fleet.wait(pid).await.with_context(|| format!("calibrating sim-{} (see {})", i + 1, logs.display()))?;
        #[derive(serde::Deserialize)]
        struct Fragment {
            prefill: Prefill,
        }
        let fit: Fragment = serde_yaml::from_str(&std::fs::read_to_string(&out)?).with_context(|| format!("reading {}", out.display()))?;
        eprintln!("sim-{}: {:?}", i + 1, fit.prefill);
        fits.push(Some(fit.prefill));
    }
    Ok(fits)
}

/// Starts the simulators and the contender in front of them; returns when a
/// request is served, with how often Inferrail reads the engines' load
/// (milliseconds, from its config; `None` for a peer router). Inferrail
/// prices each replica by its `prefill` when given.
async fn start(
    args: &CompareArgs,
    contender: &str,
    seed: u64,
    logs: &Path,
    http: &reqwest::Client,
    prefill: &[Option<Prefill>],
) -> anyhow::Result<(Processes, Option<u64>)> {
    let peer = processes::Peer::of(contender);
    let (contender, overrides) = processes::variant(contender, args.policy_params.as_ref())?;
    let split = contender.strip_prefix("pd:");
    let mut fleet = start_sims(args, logs, http, split.is_some() || peer.is_some_and(|(p, _)| p.disaggregated())).await?;
    let load_interval_ms = match peer {
        Some((peer, policy)) => {
            let (program, flags) = peer.command(&args.programs, ENTRY, policy, &SIMS, args.prefill_replicas, 19290);
            fleet.spawn(peer.name(), logs, &program, &flags)?;
            None
        }
        None => {
            // Router k on the ports 10 k above the first's.
            let ports =
                |k: u16| processes::RouterPorts { ext_proc: EXT_PROC + 10 * k, admin: ADMIN + 10 * k, admin_grpc: ADMIN_GRPC + 10 * k };
            let routers = args.routers.max(1);
            let addresses: Vec<String> = (0..routers).map(|k| format!("127.0.0.1:{}", ports(k).ext_proc)).collect();
            let mut parsed = None;
            for k in 0..routers {
                let (yaml, config) = processes::router_config(
                    split.unwrap_or(contender),
                    (&args.tokenizer, &adapters(args)),
                    seed,
                    ports(k),
                    (&SIMS, prefill, if split.is_some() { args.prefill_replicas } else { 0 }, processes::host_blocks(&args.sim_flags)?),
                    (args.time_scale, overrides.as_ref()),
                    args.kv_events.then_some(&KV_EVENTS[..]),
                )?;
                let name = if k == 0 { "inferrail".to_string() } else { format!("inferrail-{}", k + 1) };
                // Every decision, beside the run's other logs, to say afterwards why a request went where it did.
                let decisions = logs.join(format!("{}.jsonl", name.replace("inferrail", "decisions")));
                let _ = std::fs::remove_file(&decisions);
                let mut extra = format!("observability: {{decision_log: {{path: '{}', sample_rate: 1.0}}}}\n", decisions.display());
                if routers > 1 {
                    extra += &format!("peers: {{addresses: [{}]}}\n", addresses.join(", "));
                }
                let file = logs.join(format!("{name}.yaml"));
                std::fs::write(&file, format!("{yaml}{extra}"))?;
                fleet.spawn(&name, logs, &args.programs.bin_dir.join("inferrail"), &["--config".into(), file.display().to_string()])?;
                parsed.get_or_insert(config);
            }
            let parsed = parsed.ok_or_else(|| anyhow::anyhow!("no router"))?;
            let envoy = logs.join("envoy.yaml");
            let moves = [(8080, ENTRY), (9901, ENVOY_ADMIN), (9002, EXT_PROC), (8001, SIMS[0]), (8002, SIMS[1]), (8003, SIMS[2])];
            let mut bootstrap = processes::envoy_config(&args.envoy_config, &moves)?;
            if routers > 1 {
                bootstrap = processes::several_routers(&bootstrap, &addresses)?;
            }
            std::fs::write(&envoy, bootstrap)?;
            let flags = ["-c", &envoy.display().to_string(), "--disable-hot-restart", "--log-level", "warn", "--concurrency", "1"];
            fleet.spawn("envoy", logs, &args.programs.envoy, &flags.map(str::to_string))?;
            Some(parsed.load.interval_ms)
        }
    };
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
    Ok((fleet, load_interval_ms))
}

/// Runs every contender on every workload and repetition.
pub async fn compare(args: CompareArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.rate > 0.0 && args.duration_s > 0.0 && args.warmup_s >= 0.0 && args.tolerance > 0.0,
        "--rate, --duration-s and --tolerance must be positive, --warmup-s at least 0"
    );
    anyhow::ensure!(args.replica_time_scale.len() == SIMS.len(), "--replica-time-scale takes one value per simulator ({})", SIMS.len());
    anyhow::ensure!(
        args.replica_sim_flags.split('|').count() <= SIMS.len(),
        "--replica-sim-flags names more simulators than {}",
        SIMS.len()
    );
    let http = run::client(600.0)?;
    let prefill = if args.calibrate { calibrate(&args, &args.out_dir.join("logs").join("calibrate"), &http).await? } else { Vec::new() };
    let bench = Bench {
        http,
        prefill,
        slo: Slo { ttft_ms: args.slo_ttft_ms * args.time_scale, tpot_ms: args.slo_tpot_ms * args.time_scale },
        commit: run::commit(),
        command: run::command_line(),
        args,
    };
    if bench.args.capacity {
        return tokio::task::block_in_place(|| capacity(&bench));
    }
    let args = &bench.args;
    let mut runs = Vec::new();
    for &kind in &args.workloads {
        for rep in 0..args.reps {
            let seed = args.seed + rep;
            let spec = Spec { workload: kind, ..args.spec.clone() };
            let requests = workload::generate(&spec, args.rate, args.warmup_s + args.duration_s, seed)?;
            for contender in &args.contenders {
                let name = format!("{}-{contender}-rep{rep}", format!("{kind:?}").to_lowercase()).replace(':', "-");
                let result = bench.run(&name, contender, &spec, rep, seed, args.rate, &requests).await?;
                crate::report::save(&args.out_dir.join(format!("{name}.json")), &result)?;
                runs.push(result);
            }
        }
    }
    write_table(&args.out_dir.join("table.md"), HEADER, runs.iter().map(|r| row(&r.contender, r.workload, &r.measured)))?;
    let paired = paired_rows(&args.out_dir)?;
    if !paired.is_empty() {
        write_table(&args.out_dir.join("paired.md"), PAIRED_HEADER, paired.into_iter())?;
    }
    Ok(())
}

/// Each Inferrail policy's (aggregated or `pd:`) p99 TTFT against every other contender's on
/// the same requests (ADR 0027), from every run in `dir`: the difference,
/// its 95% bootstrap interval and the median per-request difference.
/// Contenders whose runs do not pair (a request lost, or closed loops that
/// sent other requests) have no row.
fn paired_rows(dir: &Path) -> anyhow::Result<Vec<String>> {
    let files = crate::writeup::inputs::load_dir::<crate::writeup::inputs::CompareRun>(dir, "routing-compare")?;
    let mut groups: Vec<((String, String), Vec<crate::writeup::inputs::CompareRun>)> = Vec::new();
    for f in files {
        let key = (f.value.workload.clone(), f.value.contender.clone());
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, runs)) => runs.push(f.value),
            None => groups.push((key, vec![f.value])),
        }
    }
    let mut rows = Vec::new();
    let mut done: Vec<(&str, &str, &str)> = Vec::new();
    for ((workload, a), runs_a) in groups.iter().filter(|((_, c), _)| processes::Peer::of(c).is_none()) {
        for ((_, b), runs_b) in groups.iter().filter(|((w, b), _)| w == workload && b != a) {
            // Each pair once: two Inferrail policies are compared one way.
            if done.contains(&(workload.as_str(), b.as_str(), a.as_str())) {
                continue;
            }
            done.push((workload, a, b));
            let Some(pairs) = crate::writeup::paired_ttfts(runs_a, runs_b) else { continue };
            let p = crate::writeup::paired_p99(&pairs);
            rows.push(format!(
                "| {workload} | {a} | {b} | {} | {:+.0} | {:+.0} to {:+.0} | {:+.1} |",
                p.requests, p.difference, p.low, p.high, p.median_request
            ));
        }
    }
    Ok(rows)
}

const PAIRED_HEADER: &str = "| workload | policy | against | requests | p99 TTFT difference ms | 95% interval | median per-request difference ms |\n|---|---|---|---|---|---|---|";

/// What every run of one `compare` shares.
struct Bench {
    args: CompareArgs,
    http: reqwest::Client,
    /// Each replica's prefill cost as calibrated (`--calibrate`), else none.
    prefill: Vec<Option<Prefill>>,
    slo: Slo,
    commit: String,
    command: String,
}

impl Bench {
    /// One contender on a cold fleet with `requests` sent at `rate`.
    #[allow(clippy::too_many_arguments)]
    async fn run(
        &self,
        name: &str,
        contender: &str,
        spec: &Spec,
        rep: u64,
        seed: u64,
        rate: f64,
        requests: &[workload::Request],
    ) -> anyhow::Result<CompareRun> {
        let args = &self.args;
        eprintln!("{name}: {} requests at {rate} req/s", requests.len());
        let logs = args.out_dir.join("logs").join(name);
        let (fleet, load_interval_ms) = start(args, contender, seed, &logs, &self.http, &self.prefill)
            .await
            .with_context(|| format!("starting the fleet for {name}"))?;
        let engines: Vec<String> = SIMS.iter().map(|p| format!("http://127.0.0.1:{p}")).collect();
        let entry = format!("http://127.0.0.1:{ENTRY}");
        let measured = run::measure(&self.http, &entry, requests, &engines, Duration::from_secs_f64(args.warmup_s), self.slo, true).await?;
        drop(fleet);
        eprintln!("{}", row(contender, spec.workload, &measured));
        Ok(CompareRun {
            benchmark: "routing-compare",
            commit: self.commit.clone(),
            command: self.command.clone(),
            contender: contender.to_owned(),
            routers: if processes::Peer::of(contender).is_some() { 0 } else { args.routers.max(1) },
            workload: spec.workload,
            rep,
            seed,
            rate,
            duration_s: args.duration_s,
            warmup_s: args.warmup_s,
            time_scale: args.time_scale,
            load_interval_ms,
            sim_flags: args.sim_flags.clone(),
            replica_time_scale: args.replica_time_scale.clone(),
            replica_sim_flags: args.replica_sim_flags.split('|').map(str::to_owned).collect(),
            prefill: self.prefill.clone(),
            slo: self.slo,
            spec: spec.clone(),
            measured,
        })
    }
}

/// Each contender's capacity on each workload: the highest rate at which
/// the three simulators serve every request with p99 TTFT within the SLO,
/// found by the fleet simulation's search (`--rate` the first guess,
/// `--seed`'s requests at every rate), each probe on a cold fleet.
fn capacity(bench: &Bench) -> anyhow::Result<()> {
    let args = &bench.args;
    let rt = tokio::runtime::Handle::current();
    for &kind in &args.workloads {
        let spec = Spec { workload: kind, ..args.spec.clone() };
        for contender in &args.contenders {
            let search =
                Search { slo_s: bench.slo.ttft_ms * 1e-3, tolerance: args.tolerance, guess_per_replica: args.rate / SIMS.len() as f64 };
            let found = capacity::search_rate(SIMS.len(), search, |rate| {
                let requests = workload::generate(&spec, rate, args.warmup_s + args.duration_s, args.seed)?;
                let name = format!("capacity-{}-{contender}-{rate:.3}", format!("{kind:?}").to_lowercase()).replace(':', "-");
                let r = rt.block_on(bench.run(&name, contender, &spec, 0, args.seed, rate, &requests))?;
                let s = &r.measured.summary;
                Ok((s.ok == s.requests && s.ttft.p99_ms <= bench.slo.ttft_ms, r))
            })?;
            let name = format!("capacity-{}-{contender}", format!("{kind:?}").to_lowercase()).replace(':', "-");
            eprintln!("{name}: {:.3} req/s within p99 TTFT {} ms ({} probes)", found.rate, bench.slo.ttft_ms, found.probes);
            crate::report::save(&args.out_dir.join(format!("{name}.json")), &found)?;
        }
    }
    // Every search in the folder, earlier runs' too: a recipe may search
    // workloads in separate runs, each from its own first guess. The
    // searches are saved; a folder the table cannot be made of only says so.
    match capacity_rows(&args.out_dir) {
        Ok(rows) => {
            let header = "| contender | workload | capacity req/s | missed at req/s | probes | commit |\n|---|---|---|---|---|---|";
            write_table(&args.out_dir.join("capacity.md"), header, rows.into_iter())
        }
        Err(e) => {
            eprintln!("{}: no capacity table: {e:#}", args.out_dir.display());
            Ok(())
        }
    }
}

/// A table row for every capacity search in `dir`, as the report reads them
/// ([`crate::writeup::inputs::load_capacities`]), with the commit of its probe at capacity.
fn capacity_rows(dir: &Path) -> anyhow::Result<Vec<String>> {
    let found = crate::writeup::inputs::load_capacities(&[dir.to_path_buf()])?;
    Ok(found
        .iter()
        .map(|f| {
            let c = &f.value;
            let commit = c.at_capacity.as_ref().map_or("none met the SLO", |r| r.commit.as_str());
            format!("| {} | {} | {:.3} | {:.3} | {} | {commit} |", c.contender, c.workload, c.rate, c.missed_at, c.probes)
        })
        .collect())
}

/// Prints a table and writes it as Markdown.
fn write_table(path: &Path, header: &str, rows: impl Iterator<Item = String>) -> anyhow::Result<()> {
    let table = std::iter::once(header.to_string()).chain(rows).collect::<Vec<_>>().join("\n");
    println!("{table}");
    std::fs::write(path, format!("{table}\n"))?;
    Ok(())
}

/// The engines' columns count the warmup too; the others only the measured requests.
const HEADER: &str = "| contender | workload | ok / measured | completed/s | TTFT p50 ms | TTFT p99 ms | TPOT p99 ms | ITL p99 ms | cached (usage) | cached (engines, with warmup) | busiest share (engines, with warmup) | goodput | predicted exactly (over / under) | deferred, mean / most (engines, with warmup) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|";

/// One run as a Markdown table row.
fn row(contender: &str, kind: Kind, m: &Measured) -> String {
    let pct = |x: Option<f64>| x.map_or("n/a".into(), |v| format!("{:.1}%", v * 100.0));
    let s = &m.summary;
    let p = &s.prediction;
    let predicted = match p.compared {
        0 => "n/a".to_string(),
        n => format!("{:.1}% ({} / {})", p.exact as f64 * 100.0 / n as f64, p.over, p.under),
    };
    let deferred = m.deferred.map_or("n/a".to_string(), |d| format!("{:.2} / {:.0}", d.mean, d.max));
    format!(
        "| {contender} | {} | {} / {} | {:.2} | {:.0} | {:.0} | {:.1} | {:.1} | {} | {} | {} | {} | {predicted} | {deferred} |",
        format!("{kind:?}").to_lowercase(),
        s.ok,
        s.requests,
        s.requests_per_s,
        s.ttft.p50_ms,
        s.ttft.p99_ms,
        s.tpot.p99_ms,
        s.itl.p99_ms,
        pct(s.prefix.hit_rate),
        pct(m.engines.as_ref().and_then(|e| e.hit_rate)),
        pct(m.engines.as_ref().and_then(|e| e.busiest_share)),
        pct(Some(s.goodput.share)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::writeup::tests::real_capacity;

    #[test]
    fn the_capacity_table_lists_every_search_in_the_folder() -> anyhow::Result<()> {
        let dir = std::env::temp_dir().join(format!("inferrail-capacity-rows-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        // Two runs' searches (a peer's name written with `-` in the file's), the table itself and a probe's logs.
        std::fs::write(dir.join("capacity-w2-round_robin.json"), real_capacity("w2", "round_robin", 60.0).to_string())?;
        std::fs::write(dir.join("capacity-w1-sglang-cache_aware.json"), real_capacity("w1", "sglang:cache_aware", 5.25).to_string())?;
        std::fs::write(dir.join("capacity.md"), "| an earlier table |")?;
        std::fs::create_dir_all(dir.join("logs"))?;
        // A search in which no rate met the SLO has no probe at capacity.
        std::fs::write(
            dir.join("capacity-w6-round_robin.json"),
            r#"{"replicas": 3, "rate": 0.0, "missed_at": 0.4, "probes": 5, "at_capacity": null}"#,
        )?;
        let rows = capacity_rows(&dir)?;
        assert_eq!(
            rows,
            [
                "| sglang:cache_aware | w1 | 5.250 | 5.775 | 7 | abc1234 |",
                "| round_robin | w2 | 60.000 | 66.000 | 7 | abc1234 |",
                "| round_robin | w6 | 0.000 | 0.400 | 5 | none met the SLO |",
            ]
        );
        // A file that is not a search is an error, not a row of zeros.
        std::fs::write(dir.join("capacity-hot-round_robin.json"), r#"{"missed_at": 7.5, "probes": 5}"#)?;
        assert!(capacity_rows(&dir).is_err());
        std::fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
