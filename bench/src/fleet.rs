//! `fleet`: the command that runs the fleet simulation (crate
//! `inferrail-fleet`): one simulation per policy and fleet size, or a
//! capacity search at the SLO. Results are JSON stamped with the commit
//! and the command, as `run`'s.

#[cfg(test)]
mod tests;

use std::path::PathBuf;

use clap::Args;
use inferrail_config::Limits;
use inferrail_policy::PolicyKind;
use serde::Serialize;

use inferrail_fleet::capacity::{self, Capacity, Search};
use inferrail_fleet::sim::{self, Outcome, Setup};
use inferrail_fleet::traffic::Traffic;
use inferrail_fleet::{default_kv_blocks, line};
use inferrail_workload::Spec;

use crate::report;
use crate::run::{command_line, commit};

/// Flags of `fleet`.
#[derive(Debug, Clone, Args)]
pub struct FleetArgs {
    /// Policies to compare, comma separated (`cost_model,round_robin,...`).
    #[arg(long, value_delimiter = ',', default_value = "cost_model,round_robin", value_parser = policy_kind)]
    pub policy: Vec<PolicyKind>,
    /// Replicas, comma separated: one simulation (or capacity search) per count.
    #[arg(long, value_delimiter = ',', default_value = "3")]
    pub replicas: Vec<usize>,
    /// What arrives.
    #[command(flatten)]
    pub spec: Spec,
    /// Arrivals per second (Poisson).
    #[arg(long, default_value_t = 10.0)]
    pub rate: f64,
    /// Requests per simulation (per probe with `--capacity`).
    #[arg(long, default_value_t = 100_000)]
    pub requests: usize,
    /// Seed of the workload, its schedule and the router.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// KV blocks per replica; default: half the shared system prompts'
    /// blocks (a third of them, and room for the requests running), and at
    /// least the largest request's.
    #[arg(long)]
    pub kv_blocks: Option<usize>,
    /// A mixed fleet: each kind of replica's latency model as a multiple
    /// of the time scale's, comma separated, the kinds taken in turn over
    /// the replicas (`0.5,1,2`: a third twice as fast, a third half as
    /// fast); the router is given each one's prefill cost, as calibrated.
    #[arg(long, value_delimiter = ',', value_parser = inferrail_fleet::timescale::parse)]
    pub replica_time_scale: Vec<f64>,
    /// A mixed fleet: each kind of replica's KV blocks, comma separated, in
    /// the order of `--replica-time-scale` (default: `--kv-blocks`'s).
    #[arg(long, value_delimiter = ',')]
    pub replica_kv_blocks: Vec<usize>,
    /// A disaggregated fleet: this share of each fleet's replicas (rounded,
    /// at least one, and at least one decodes) prefills, the rest decode; 0:
    /// every replica does both.
    #[arg(long, default_value_t = 0.0)]
    pub prefill_share: f64,
    /// LoRA adapters one engine step runs (vLLM's `--max-loras`), for the
    /// `lora` workload; 0: no limit.
    #[arg(long, default_value_t = 4)]
    pub max_loras: usize,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Blocks each engine keeps in host memory (vLLM's `--kv-offloading-size`
    /// in blocks), which the router is told of; 0: none.
    #[arg(long, default_value_t = 0)]
    pub host_blocks: usize,
    /// Most requests in flight the router sends one replica.
    #[arg(long, default_value_t = Limits::default().max_concurrency)]
    pub max_concurrency: u32,
    /// Scales the engines' latency model and the router's matching costs
    /// (0.1: ten times faster engines); rates and the SLO are as given.
    #[arg(long, default_value_t = 1.0, value_parser = inferrail_fleet::timescale::parse)]
    pub time_scale: f64,
    /// Policy parameters laid over the time scale's, as the routing YAML's
    /// `policies` in JSON: `'{"cost_model": {"share_weight": 0}}'`.
    #[arg(long, value_parser = inferrail_fleet::timescale::parse_overrides)]
    pub policy_params: Option<serde_json::Value>,
    /// Search each policy's capacity at the SLO instead of one simulation.
    #[arg(long)]
    pub capacity: bool,
    /// SLO on p99 time to first token, milliseconds.
    #[arg(long, default_value_t = 2000.0)]
    pub slo_ttft_ms: f64,
    /// The rate the replicas-needed search serves; default: round robin's
    /// (else the first policy's) capacity on the largest `--replicas`.
    #[arg(long)]
    pub fixed_rate: Option<f64>,
    /// Bisection stops once the bracket is this fraction of the rate.
    #[arg(long, default_value_t = 0.02)]
    pub tolerance: f64,
    /// Routers deciding in turn (as Envoy balances ext_proc streams).
    #[arg(long, default_value_t = 1)]
    pub routers: usize,
    /// The routers are not each other's peers: each knows only its own decisions.
    #[arg(long)]
    pub no_peers: bool,
    /// How long a router's word takes to reach its peers, microseconds.
    #[arg(long, default_value_t = 500)]
    pub peer_delay_us: u64,
    /// How the routers hear each response's first byte: `log`, from the
    /// access log after the response's end, 50 ms later (the shipped
    /// layout, ADR 0035); `observe`, as it comes (the observe filter's).
    #[arg(long, value_enum, default_value_t = FirstByte::Log)]
    pub first_byte: FirstByte,
    /// Where to write the JSON result.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// How a router hears a response's first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FirstByte {
    /// From the access log, after the end.
    Log,
    /// As it comes.
    Observe,
}

/// The access log's batch interval (`envoy/filters/access-log.yaml`): a
/// record comes at most this long after its request's end.
const LOG_DELAY: std::time::Duration = std::time::Duration::from_millis(50);

fn policy_kind(s: &str) -> Result<PolicyKind, String> {
    serde_json::from_value(serde_json::Value::String(s.to_owned())).map_err(|e| format!("{s:?}: {e}"))
}

/// The simulated fleet for `args` with `replicas` replicas.
pub(crate) fn setup(args: &FleetArgs, replicas: usize) -> anyhow::Result<Setup> {
    anyhow::ensure!(args.block_size > 0 && args.tolerance > 0.0, "--block-size and --tolerance must be positive");
    let kv_blocks = match args.kv_blocks {
        Some(b) => b,
        None => default_kv_blocks(&args.spec, args.seed, args.block_size)?,
    };
    let (speeds, blocks) = (&args.replica_time_scale, &args.replica_kv_blocks);
    let kinds = speeds.len().max(blocks.len());
    anyhow::ensure!(
        [0, kinds].contains(&speeds.len()) && [0, kinds].contains(&blocks.len()),
        "--replica-time-scale and --replica-kv-blocks name the same kinds of replica"
    );
    let mixed = (0..kinds).map(|i| (speeds.get(i).copied().unwrap_or(1.0), blocks.get(i).copied().unwrap_or(kv_blocks))).collect();
    anyhow::ensure!((0.0..1.0).contains(&args.prefill_share), "--prefill-share is a share below 1");
    let prefill_replicas = if args.prefill_share > 0.0 {
        ((replicas as f64 * args.prefill_share).round() as usize).clamp(1, replicas.saturating_sub(1))
    } else {
        0
    };
    let setup = Setup {
        replicas,
        prefill_replicas,
        kv_blocks,
        mixed,
        block_size: args.block_size,
        max_loras: args.max_loras,
        host_blocks: args.host_blocks,
        time_scale: args.time_scale,
        policies: args.policy_params.as_ref().map_or(Ok(serde_yaml::Value::Null), serde_yaml::to_value)?,
        limits: Limits { max_concurrency: args.max_concurrency, max_pending: args.max_concurrency },
        seed: args.seed,
        model: args.spec.model.clone(),
        routers: args.routers,
        peers: !args.no_peers,
        peer_delay: std::time::Duration::from_micros(args.peer_delay_us),
        timing: inferrail_route::lifecycle::Timing::ROUTER,
        status_after_end: None,
        first_byte_after_end: (args.first_byte == FirstByte::Log).then_some(LOG_DELAY),
    };
    // The router checks them as it checks a model's own `policies`: unknown keys and ranges.
    let params = sim::config(&setup, PolicyKind::RoundRobin).params(0).map_err(|p| anyhow::anyhow!("--policy-params: {}", p.join("; ")))?;
    let problems = params.validate("--policy-params");
    anyhow::ensure!(problems.is_empty(), "{}", problems.join("; "));
    Ok(setup)
}

/// One simulation of `policy` at `rate` on `setup`.
pub fn simulate(args: &FleetArgs, setup: &Setup, policy: PolicyKind, rate: f64) -> anyhow::Result<Outcome> {
    let text = inferrail_route::Core::new(&sim::config(setup, policy))?.wants_text(0);
    let traffic = Traffic::new(&args.spec, rate, args.requests, args.seed, text)?;
    sim::simulate(setup, policy, traffic)
}

#[derive(Debug, Serialize)]
struct FleetResult<T> {
    benchmark: &'static str,
    commit: String,
    command: String,
    workload: Spec,
    requests: usize,
    seed: u64,
    kv_blocks: usize,
    block_size: usize,
    #[serde(flatten)]
    result: T,
}

#[derive(Debug, Serialize)]
struct Runs {
    rate: f64,
    runs: Vec<Outcome>,
}

#[derive(Debug, Serialize)]
struct Capacities {
    slo_ttft_ms: f64,
    /// Per policy, its capacity at each fleet size.
    capacity: Vec<(String, Vec<Capacity>)>,
    /// The rate the replicas-needed search serves.
    fixed_rate: f64,
    /// Per policy, the fewest replicas that serve `fixed_rate` (none: not within 4x the largest fleet).
    replicas_needed: Vec<(String, Option<usize>)>,
}

/// Runs the simulations (or the capacity searches) and writes the result.
pub fn fleet(args: FleetArgs) -> anyhow::Result<()> {
    anyhow::ensure!(!args.policy.is_empty() && !args.replicas.is_empty(), "--policy and --replicas need at least one value");
    anyhow::ensure!(args.requests > 0, "--requests must be positive");
    let largest = args.replicas.iter().copied().max().unwrap_or(1);
    let shape = setup(&args, largest)?;
    let value = if args.capacity {
        serde_json::to_value(stamp(&args, &shape, capacities(&args)?))?
    } else {
        let mut runs = Vec::new();
        for &n in &args.replicas {
            let setup = setup(&args, n)?;
            for &p in &args.policy {
                let o = simulate(&args, &setup, p, args.rate)?;
                eprintln!("{}", line(&o));
                runs.push(o);
            }
        }
        serde_json::to_value(stamp(&args, &shape, Runs { rate: args.rate, runs }))?
    };
    match &args.out {
        Some(out) => report::write(out, &value)?,
        None => println!("{}", serde_json::to_string_pretty(&value)?),
    }
    Ok(())
}

fn stamp<T>(args: &FleetArgs, shape: &Setup, result: T) -> FleetResult<T> {
    FleetResult {
        benchmark: "fleet-simulation",
        commit: commit(),
        command: command_line(),
        workload: args.spec.clone(),
        requests: args.requests,
        seed: args.seed,
        kv_blocks: shape.kv_blocks,
        block_size: shape.block_size,
        result,
    }
}

fn capacities(args: &FleetArgs) -> anyhow::Result<Capacities> {
    let search = Search { slo_s: args.slo_ttft_ms / 1e3, tolerance: args.tolerance, guess_per_replica: 2.0 };
    let mut capacity = Vec::new();
    for &p in &args.policy {
        let mut per = Vec::new();
        for &n in &args.replicas {
            let s = setup(args, n)?;
            let c = capacity::rate(n, search, |rate| simulate(args, &s, p, rate))?;
            eprintln!("{p:?} on {n} replicas: {:.2} req/s within p99 TTFT {} ms ({} probes)", c.rate, args.slo_ttft_ms, c.probes);
            per.push(c);
        }
        capacity.push((name(p), per));
    }
    let fixed_rate = match args.fixed_rate {
        Some(r) => r,
        None => capacity
            .iter()
            .find(|(p, _)| p == "round_robin")
            .or(capacity.first())
            .and_then(|(_, per)| per.iter().max_by_key(|c| c.replicas))
            .map_or(0.0, |c| c.rate),
    };
    let largest = args.replicas.iter().copied().max().unwrap_or(1);
    let mut replicas_needed = Vec::new();
    if fixed_rate > 0.0 {
        for &p in &args.policy {
            let needed = capacity::replicas(if args.prefill_share > 0.0 { 2 } else { 1 }, largest * 4, search.slo_s, |n| {
                simulate(args, &setup(args, n)?, p, fixed_rate)
            })?;
            eprintln!("{p:?} needs {needed:?} replicas for {fixed_rate:.2} req/s");
            replicas_needed.push((name(p), needed));
        }
    }
    Ok(Capacities { slo_ttft_ms: args.slo_ttft_ms, capacity, fixed_rate, replicas_needed })
}

fn name(p: PolicyKind) -> String {
    serde_json::to_value(p).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_else(|| format!("{p:?}"))
}
