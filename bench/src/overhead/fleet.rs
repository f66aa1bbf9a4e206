//! The processes of the overhead ladder, all started once and kept for the
//! whole run: three near-instant simulators, and in front of them a plain
//! Envoy, an Envoy with the no-op processor, an Envoy with inferrail (the
//! same filters as `envoy/local.yaml`), an Envoy with inferrail inside as
//! its dynamic module (`envoy/module.yaml`) and SGLang's router. For the
//! streams, paced simulators take the near-instant ones' ports. Each rung has
//! its own entry URL; the ones not being measured sit idle.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;

use super::{OverheadArgs, Rung};
use crate::processes::{self, Processes, RouterPorts};

/// Ports of the ladder: clear of the local fleet's and of `compare`'s.
const SIMS: [u16; 3] = [18201, 18202, 18203];
const PLAIN: u16 = 18281;
const NOOP_ENVOY: u16 = 18282;
const INFERRAIL_ENVOY: u16 = 18283;
const SGLANG: u16 = 18284;
const MODULE_ENVOY: u16 = 18285;
const MODULE_SIDECAR_ENVOY: u16 = 18286;
const SCRAPER: u16 = 19216;
const NOOP: u16 = 19202;
const ROUTER: RouterPorts = RouterPorts { ext_proc: 19203, admin: 19204, admin_grpc: 19205 };
/// The router inside the module's Envoy: its own listeners (ext_proc for gateways, admin), unused by the ladder.
const MODULE_ROUTER: RouterPorts = RouterPorts { ext_proc: 19206, admin: 19207, admin_grpc: 19208 };
const MODULE_SIDECAR_ROUTER: RouterPorts = RouterPorts { ext_proc: 19217, admin: 19218, admin_grpc: 19219 };
const ENVOY_ADMINS: [u16; 5] = [19211, 19212, 19213, 19215, 19220];
const SGLANG_PROMETHEUS: u16 = 19214;

/// Simulator flags: room for 150 prompts of 220 KB at once; with
/// `--zero-latency` before them, no time per step.
const SIM_FLAGS: [&str; 8] = [
    "--max-model-len",
    "262144",
    "--num-gpu-blocks-override",
    "1048576",
    "--max-num-seqs",
    "1024",
    "--served-model-name",
    "inferrail/sim-8b",
];

/// A process whose CPU time is read, under the name the results use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// This benchmark's own process, which sends the requests.
    Client,
    /// The three simulators together.
    Simulators,
    /// Envoy without ext_proc filters.
    EnvoyPlain,
    /// Envoy in front of the no-op processor.
    EnvoyNoop,
    /// The no-op ext_proc processor.
    NoopProcessor,
    /// Envoy in front of inferrail.
    EnvoyInferrail,
    /// Inferrail.
    Inferrail,
    /// Envoy with inferrail inside as its dynamic module: the router's own threads are in it.
    EnvoyModule,
    /// The same with the engines' load from the scraper sidecar.
    EnvoyModuleSidecar,
    /// The `inferrail-scraper` sidecar, reading the engines' `/metrics`.
    Scraper,
    /// SGLang's router (its Python launcher and everything it started).
    SglangRouter,
}

impl Rung {
    /// The processes a request of this rung goes through.
    pub fn roles(self) -> &'static [Role] {
        match self {
            Rung::Direct => &[Role::Client, Role::Simulators],
            Rung::Envoy => &[Role::Client, Role::EnvoyPlain, Role::Simulators],
            Rung::Noop => &[Role::Client, Role::EnvoyNoop, Role::NoopProcessor, Role::Simulators],
            Rung::Inferrail => &[Role::Client, Role::EnvoyInferrail, Role::Inferrail, Role::Simulators],
            Rung::Module => &[Role::Client, Role::EnvoyModule, Role::Simulators],
            Rung::ModuleSidecar => &[Role::Client, Role::EnvoyModuleSidecar, Role::Scraper, Role::Simulators],
            Rung::Sglang => &[Role::Client, Role::SglangRouter, Role::Simulators],
        }
    }

    /// Base URLs a request of this rung goes to (in turn, when several).
    pub fn urls(self) -> Vec<String> {
        let one = |port: u16| vec![format!("http://127.0.0.1:{port}")];
        match self {
            Rung::Direct => SIMS.iter().flat_map(|&p| one(p)).collect(),
            Rung::Envoy => one(PLAIN),
            Rung::Noop => one(NOOP_ENVOY),
            Rung::Inferrail => one(INFERRAIL_ENVOY),
            Rung::Module => one(MODULE_ENVOY),
            Rung::ModuleSidecar => one(MODULE_SIDECAR_ENVOY),
            Rung::Sglang => one(SGLANG),
        }
    }
}

/// The started processes and whose CPU is whose.
pub struct Fleet {
    /// Stopped when dropped.
    processes: Processes,
    /// Process ids of each role.
    pub pids: Vec<(Role, u32)>,
}

/// Starts simulator `i` on its port, paced (`zero_latency` false: the
/// default cost model's time per step) or not; returns its pid.
fn simulator(fleet: &mut Processes, args: &OverheadArgs, logs: &Path, i: usize, zero_latency: bool) -> anyhow::Result<u32> {
    let mut flags: Vec<String> = zero_latency.then(|| "--zero-latency".to_string()).into_iter().collect();
    flags.extend(SIM_FLAGS.map(str::to_string));
    flags.extend(["--port".into(), SIMS[i].to_string(), "--seed".into(), (i + 1).to_string()]);
    let name = if zero_latency { format!("sim-{}", i + 1) } else { format!("sim-{}-paced", i + 1) };
    fleet.spawn(&name, logs, &args.programs.bin_dir.join("inferrail-sim"), &flags)
}

/// Returns when a request through each of `rungs` is answered.
async fn until_each_answers(fleet: &mut Processes, rungs: &[Rung], http: &reqwest::Client) -> anyhow::Result<()> {
    let hello = serde_json::json!({"model": "inferrail/sim-8b", "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1});
    for &rung in rungs {
        for url in rung.urls() {
            processes::until(fleet, Duration::from_secs(60), &format!("a first request through {rung:?}"), async || {
                http.post(format!("{url}/v1/chat/completions"))
                    .json(&hello)
                    .timeout(Duration::from_secs(2))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success())
            })
            .await?;
        }
    }
    Ok(())
}

impl Fleet {
    /// Replaces the near-instant simulators with paced ones on the same
    /// ports (every rung keeps its processes) and returns when each of
    /// `rungs` answers again.
    pub async fn pace(&mut self, args: &OverheadArgs, logs: &Path, rungs: &[Rung], http: &reqwest::Client) -> anyhow::Result<()> {
        let old: Vec<u32> = self.pids.iter().filter(|(r, _)| *r == Role::Simulators).map(|&(_, pid)| pid).collect();
        for pid in old {
            self.processes.stop(pid)?;
        }
        self.pids.retain(|(r, _)| *r != Role::Simulators);
        for i in 0..SIMS.len() {
            let pid = simulator(&mut self.processes, args, logs, i, false)?;
            self.pids.push((Role::Simulators, pid));
        }
        until_each_answers(&mut self.processes, rungs, http).await
    }
}

/// `envoy/module.yaml` listening on `port` (admin on `admin`), its
/// module reading the routing file at `path`.
fn module_envoy(path: &Path, port: u16, admin: u16) -> anyhow::Result<String> {
    let sims = [(8001, SIMS[0]), (8002, SIMS[1]), (8003, SIMS[2])];
    let moves = [[(8080, port), (9901, admin)].as_slice(), &sims].concat();
    let config = processes::envoy_config("envoy/module.yaml", &moves)?;
    let named = "value: envoy/local-inferrail.yaml";
    anyhow::ensure!(config.matches(named).count() == 1, "envoy/module.yaml should name its routing file once");
    Ok(config.replace(named, &format!("value: {}", path.display())))
}

/// Starts what `rungs` need and returns when each rung answers a request.
pub async fn start(args: &OverheadArgs, rungs: &[Rung], logs: &Path, http: &reqwest::Client) -> anyhow::Result<Fleet> {
    std::fs::create_dir_all(logs)?;
    let mut fleet = Processes::default();
    let mut pids = vec![(Role::Client, std::process::id())];
    for i in 0..SIMS.len() {
        pids.push((Role::Simulators, simulator(&mut fleet, args, logs, i, true)?));
    }
    let sims = [(8001, SIMS[0]), (8002, SIMS[1]), (8003, SIMS[2])];
    let envoy = |fleet: &mut Processes, name: &str, config: String, base_id: u16| -> anyhow::Result<u32> {
        let path = logs.join(format!("{name}.yaml"));
        std::fs::write(&path, config)?;
        let flags = ["-c", &path.display().to_string(), "--disable-hot-restart", "--log-level", "error", "--concurrency", "1"];
        let mut flags = flags.map(str::to_string).to_vec();
        flags.extend(["--base-id".into(), base_id.to_string()]);
        // The module's Envoy finds libinferrail_module.so beside the other binaries.
        fleet.spawn_with(name, logs, &args.programs.envoy, &flags, &[("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", &args.programs.bin_dir)])
    };
    // Zero-latency simulators: the default time scale prices nothing they do.
    // With `sidecar`, the engines' load comes from the scraper sidecar on that port.
    let router_config = |name: &str, ports: RouterPorts, sidecar: Option<u16>| -> anyhow::Result<std::path::PathBuf> {
        let path = logs.join(name);
        let sims = (&SIMS[..], &[][..], 0, None);
        let mut yaml = processes::router_config(&args.policy, (&args.tokenizer, &[]), args.seed, ports, sims, (1.0, None), None)?.0;
        if let Some(port) = sidecar {
            anyhow::ensure!(yaml.matches("load: {").count() == 1, "the routing file should have one load section");
            yaml = yaml.replace("load: {", &format!("load: {{sidecar: 'http://127.0.0.1:{port}',"));
        }
        std::fs::write(&path, yaml)?;
        Ok(path)
    };
    for &rung in rungs {
        match rung {
            Rung::Direct => {}
            Rung::Envoy => {
                let moves = [[(8081, PLAIN), (9911, ENVOY_ADMINS[0])].as_slice(), &sims].concat();
                let config = processes::envoy_config("bench/envoy/plain.yaml", &moves)?;
                pids.push((Role::EnvoyPlain, envoy(&mut fleet, "envoy-plain", config, 11)?));
            }
            Rung::Noop => {
                let exe = std::env::current_exe().context("finding this benchmark's own binary")?;
                let flags = ["noop-extproc".into(), "--listen".into(), format!("127.0.0.1:{NOOP}")];
                pids.push((Role::NoopProcessor, fleet.spawn("noop-extproc", logs, &exe, &flags)?));
                let moves = [[(8080, NOOP_ENVOY), (9901, ENVOY_ADMINS[1]), (9002, NOOP)].as_slice(), &sims].concat();
                let config = processes::envoy_config("envoy/local.yaml", &moves)?;
                pids.push((Role::EnvoyNoop, envoy(&mut fleet, "envoy-noop", config, 12)?));
            }
            Rung::Inferrail => {
                let path = router_config("inferrail.yaml", ROUTER, None)?;
                let flags = ["--config".into(), path.display().to_string()];
                pids.push((Role::Inferrail, fleet.spawn("inferrail", logs, &args.programs.bin_dir.join("inferrail"), &flags)?));
                let moves = [[(8080, INFERRAIL_ENVOY), (9901, ENVOY_ADMINS[2]), (9002, ROUTER.ext_proc)].as_slice(), &sims].concat();
                let config = processes::envoy_config("envoy/local.yaml", &moves)?;
                pids.push((Role::EnvoyInferrail, envoy(&mut fleet, "envoy-inferrail", config, 13)?));
            }
            Rung::Module => {
                let path = router_config("inferrail-module.yaml", MODULE_ROUTER, None)?;
                let config = module_envoy(&path, MODULE_ENVOY, ENVOY_ADMINS[3])?;
                pids.push((Role::EnvoyModule, envoy(&mut fleet, "envoy-module", config, 14)?));
            }
            Rung::ModuleSidecar => {
                let path = router_config("inferrail-module-sidecar.yaml", MODULE_SIDECAR_ROUTER, Some(SCRAPER))?;
                let flags = ["--config".into(), path.display().to_string(), "--listen".into(), format!("127.0.0.1:{SCRAPER}")];
                pids.push((Role::Scraper, fleet.spawn("scraper", logs, &args.programs.bin_dir.join("inferrail-scraper"), &flags)?));
                let config = module_envoy(&path, MODULE_SIDECAR_ENVOY, ENVOY_ADMINS[4])?;
                pids.push((Role::EnvoyModuleSidecar, envoy(&mut fleet, "envoy-module-sidecar", config, 15)?));
            }
            Rung::Sglang => {
                anyhow::ensure!(
                    args.programs.sglang_python.exists(),
                    "{} is missing: run `just setup-sglang`",
                    args.programs.sglang_python.display()
                );
                let (program, flags) =
                    processes::Peer::Sglang.command(&args.programs, SGLANG, &args.sglang_policy, &SIMS, 0, SGLANG_PROMETHEUS);
                pids.push((Role::SglangRouter, fleet.spawn("sglang-router", logs, &program, &flags)?));
            }
        }
    }
    until_each_answers(&mut fleet, rungs, http).await?;
    Ok(Fleet { processes: fleet, pids })
}
