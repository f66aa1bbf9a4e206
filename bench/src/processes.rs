//! Child processes of a benchmark (simulators, routers, Envoys), stopped
//! when dropped, and the readiness wait that fails as soon as one dies.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

/// Where the programs a benchmark starts are.
#[derive(Debug, Clone, Args)]
pub struct Programs {
    /// Where the inferrail, inferrail-sim binaries are.
    #[arg(long, default_value = "target/release")]
    pub bin_dir: PathBuf,
    /// The Envoy binary.
    #[arg(long, default_value = ".venv/bin/envoy")]
    pub envoy: PathBuf,
    /// The Python that has `sglang_router` installed.
    #[arg(long, default_value = ".venv-sglang/bin/python")]
    pub sglang_python: PathBuf,
    /// `smg` (`just setup-peers`).
    #[arg(long, default_value = ".venv-smg/bin/smg")]
    pub smg: PathBuf,
    /// `vllm-router` (`just setup-peers`).
    #[arg(long, default_value = ".venv-vllm-router/bin/vllm-router")]
    pub vllm_router: PathBuf,
}

/// Processes that are stopped when dropped.
#[derive(Default)]
pub struct Processes {
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
    /// Starts `program` as `name`, its output to `logs/<name>.log`; returns its pid.
    pub fn spawn(&mut self, name: &str, logs: &Path, program: &Path, args: &[String]) -> anyhow::Result<u32> {
        self.spawn_with(name, logs, program, args, &[])
    }

    /// [`Processes::spawn`] with `envs` added to the program's environment.
    pub fn spawn_with(&mut self, name: &str, logs: &Path, program: &Path, args: &[String], envs: &[(&str, &Path)]) -> anyhow::Result<u32> {
        let log = std::fs::File::create(logs.join(format!("{name}.log")))?;
        let child = Command::new(program)
            .args(args)
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", program.display()))?;
        let pid = child.id();
        self.children.push((name.to_string(), child));
        Ok(pid)
    }

    /// Stops the process `pid` (killed, waited for, no longer watched).
    pub fn stop(&mut self, pid: u32) -> anyhow::Result<()> {
        let at = self.children.iter().position(|(_, c)| c.id() == pid).ok_or_else(|| anyhow::anyhow!("no process {pid}"))?;
        let (_, mut child) = self.children.remove(at);
        child.kill()?;
        child.wait()?;
        Ok(())
    }

    /// Waits for the process `pid` to exit; fails unless it succeeded.
    pub async fn wait(&mut self, pid: u32) -> anyhow::Result<()> {
        let at = self.children.iter().position(|(_, c)| c.id() == pid).ok_or_else(|| anyhow::anyhow!("no process {pid}"))?;
        let (name, mut child) = self.children.remove(at);
        let status = tokio::task::spawn_blocking(move || child.wait()).await??;
        anyhow::ensure!(status.success(), "{name} exited with {status}");
        Ok(())
    }

    /// Fails if any process has exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        for (name, c) in &mut self.children {
            if let Some(status) = c.try_wait()? {
                anyhow::bail!("{name} exited with {status}");
            }
        }
        Ok(())
    }
}

/// Polls `ok` until it holds or `limit` passes, failing if a process died.
pub async fn until(fleet: &mut Processes, limit: Duration, what: &str, mut ok: impl AsyncFnMut() -> bool) -> anyhow::Result<()> {
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

/// An Envoy bootstrap read from `path` with each `port_value: from` moved to
/// `to`; every port named must stand in it exactly once.
pub fn envoy_config(path: impl AsRef<std::path::Path>, moves: &[(u16, u16)]) -> anyhow::Result<String> {
    let path = path.as_ref();
    let mut text = std::fs::read_to_string(path).with_context(|| format!("reading {} (run from the repository root)", path.display()))?;
    for &(from, to) in moves {
        let old = format!("port_value: {from}");
        // The port as a whole number: 8001 must not match 80010.
        let at: Vec<usize> = text
            .match_indices(&old)
            .map(|(i, _)| i)
            .filter(|&i| !text[i + old.len()..].starts_with(|c: char| c.is_ascii_digit()))
            .collect();
        anyhow::ensure!(at.len() == 1, "{} should name port {from} once", path.display());
        text.replace_range(at[0]..at[0] + old.len(), &format!("port_value: {to}"));
    }
    Ok(text)
}

/// An Envoy bootstrap whose `inferrail` cluster has one router, turned
/// into one over every router at `addresses` (`ip:port`), each ext_proc
/// stream's router drawn at random, as `just ROUTERS=2 up` and the e2e
/// fleet draw them (ADR 0034).
pub fn several_routers(bootstrap: &str, addresses: &[String]) -> anyhow::Result<String> {
    let cluster = "  - name: inferrail\n    type: STATIC\n";
    anyhow::ensure!(bootstrap.matches(cluster).count() == 1, "the bootstrap should have one STATIC inferrail cluster");
    let endpoint = |a: &str| -> anyhow::Result<String> {
        let (ip, port) = a.rsplit_once(':').ok_or_else(|| anyhow::anyhow!("{a:?} is not ip:port"))?;
        Ok(format!("{{endpoint: {{address: {{socket_address: {{address: {ip}, port_value: {port}}}}}}}}}"))
    };
    let first = endpoint(addresses.first().ok_or_else(|| anyhow::anyhow!("no router"))?)?;
    anyhow::ensure!(bootstrap.matches(&first).count() == 1, "the inferrail cluster should name {} once", addresses[0]);
    let all = addresses.iter().map(|a| endpoint(a)).collect::<anyhow::Result<Vec<_>>>()?.join(", ");
    Ok(bootstrap.replace(cluster, &format!("{cluster}    lb_policy: RANDOM\n")).replace(&first, &all))
}

/// The ports inferrail listens on.
#[derive(Debug, Clone, Copy)]
pub struct RouterPorts {
    /// Envoy's ext_proc filters call it here.
    pub ext_proc: u16,
    /// Health, metrics.
    pub admin: u16,
    /// Explain, Replicas.
    pub admin_grpc: u16,
}

/// Where one simulator publishes its KV events and answers replays.
#[derive(Debug, Clone, Copy)]
pub struct KvEventPorts {
    pub publish: u16,
    pub replay: u16,
}

impl KvEventPorts {
    /// The simulator's `--kv-events-config`: it binds both, the router connects.
    pub fn sim_flags(&self) -> [String; 2] {
        let config = serde_json::json!({
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "endpoint": format!("tcp://*:{}", self.publish),
            "replay_endpoint": format!("tcp://*:{}", self.replay),
        });
        ["--kv-events-config".into(), config.to_string()]
    }
}

/// Inferrail's configuration for one policy over simulators on `sims`, each
/// followed by its KV events when `kv_events` has its ports (exact mode),
/// with the time scale's policy parameters and `overrides` laid over them as
/// the model's own. Checked as the router will check it, so a bad override
/// fails here rather than as a router that never starts; returns the YAML
/// and the configuration it reads as.
pub fn router_config(
    policy: &str,
    (tokenizer, adapters): (&str, &[String]),
    seed: u64,
    ports: RouterPorts,
    (sims, prefill, prefills, host_blocks): (&[u16], &[Option<inferrail_policy::Prefill>], usize, Option<usize>),
    (time_scale, overrides): (f64, Option<&serde_json::Value>),
    kv_events: Option<&[KvEventPorts]>,
) -> anyhow::Result<(String, inferrail_config::Config)> {
    let events = |i: usize| match kv_events.and_then(|e| e.get(i)) {
        Some(KvEventPorts { publish, replay }) => {
            format!(", kv_events: {{endpoint: 'tcp://127.0.0.1:{publish}', replay_endpoint: 'tcp://127.0.0.1:{replay}'}}")
        }
        None => String::new(),
    };
    let cost = |i: usize| match prefill.get(i).copied().flatten() {
        Some(p) => format!(", prefill: {}", serde_json::to_string(&p).unwrap_or_default()),
        None => String::new(),
    };
    // A disaggregated fleet: the first `prefills` only prefill, the rest decode.
    let role = |i: usize| match (prefills, i < prefills) {
        (0, _) => "",
        (_, true) => ", role: prefill",
        (_, false) => ", role: decode",
    };
    let host = host_blocks.map_or_else(String::new, |b| format!(", host_kv_blocks: {b}"));
    let replicas: String = sims
        .iter()
        .enumerate()
        .map(|(i, p)| {
            format!(
                "  - {{id: sim-{}, address: 127.0.0.1:{p}, models: [inferrail/sim-8b]{}{}{}{host}}}\n",
                i + 1,
                cost(i),
                events(i),
                role(i)
            )
        })
        .collect();
    let RouterPorts { ext_proc, admin, admin_grpc } = ports;
    // JSON is YAML: the time scale's parameters, and the model's own over them.
    let policies = serde_json::to_string(&inferrail_fleet::timescale::params(time_scale))?;
    let own = match overrides {
        Some(o) => format!(", policies: {}", serde_json::to_string(o)?),
        None => String::new(),
    };
    let scrape_ms = inferrail_fleet::timescale::scrape_interval(time_scale).as_millis();
    let adapters = adapters.join(", ");
    let yaml = format!(
        "server: {{listen: 127.0.0.1:{ext_proc}}}\n\
         admin: {{listen: 127.0.0.1:{admin}, grpc_listen: 127.0.0.1:{admin_grpc}}}\n\
         load: {{interval_ms: {scrape_ms}}}\n\
         routing: {{seed: {seed}, policies: {policies}}}\n\
         models:\n  - {{name: inferrail/sim-8b, aliases: [sim], adapters: [{adapters}], policy: {policy}, tokenizer: {tokenizer}{own}}}\n\
         replicas:\n{replicas}"
    );
    let config = inferrail_config::Config::parse(&yaml).map_err(|e| anyhow::anyhow!("the router's config: {e}"))?;
    Ok((yaml, config))
}

/// Blocks the simulators' flags give their host tier, as the simulator
/// sizes it: `--kv-offloading-size` GiB over a block's KV bytes rounded up
/// to a page; `None` without the flag.
pub fn host_blocks(sim_flags: &str) -> anyhow::Result<Option<usize>> {
    let flags: Vec<&str> = sim_flags.split_whitespace().collect();
    let value = |name: &str| flags.iter().position(|f| *f == name).and_then(|i| flags.get(i + 1)).map(|v| v.parse::<f64>());
    let Some(gib) = value("--kv-offloading-size").transpose()? else { return Ok(None) };
    let block_size = value("--block-size").transpose()?.unwrap_or(16.0);
    let per_token = value("--kv-cache-bytes-per-token").transpose()?.unwrap_or(inferrail_engine::cost::KV_BYTES_PER_TOKEN as f64);
    let block = ((block_size * per_token) as usize).next_multiple_of(4096);
    Ok(Some((gib * f64::from(1u32 << 30)) as usize / block))
}

/// Named variants of a policy's parameters: a contender `<policy>+<name>`.
const VARIANTS: [(&str, &str, &str); 1] = [("cost_model", "gpu_only", r#"{"offload": {"aware": false}}"#)];

/// The policy a contender names and the parameters it runs with: the
/// run's `--policy-params` (`overrides`), with a variant's laid over its policy's.
pub fn variant<'a>(contender: &'a str, overrides: Option<&serde_json::Value>) -> anyhow::Result<(&'a str, Option<serde_json::Value>)> {
    let Some((policy, name)) = contender.split_once('+') else { return Ok((contender, overrides.cloned())) };
    let Some((_, _, params)) = VARIANTS.iter().find(|(p, n, _)| *p == policy && *n == name) else {
        let known: Vec<String> = VARIANTS.iter().map(|(p, n, _)| format!("{p}+{n}")).collect();
        anyhow::bail!("unknown variant {contender} (known: {})", known.join(", "));
    };
    let mut all = overrides.cloned().unwrap_or_else(|| serde_json::json!({}));
    lay_over(&mut all[policy], serde_json::from_str(params)?);
    Ok((policy, Some(all)))
}

/// Lays `over`'s fields over `base`'s, object by object.
fn lay_over(base: &mut serde_json::Value, over: serde_json::Value) {
    match (base, over) {
        (serde_json::Value::Object(b), serde_json::Value::Object(o)) => {
            for (k, v) in o {
                lay_over(b.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (b, o) => *b = o,
    }
}

/// A peer router the benchmarks run in front of the same simulators.
/// All three take SGLang's router's flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// SGLang's router 0.3.2 (PyPI `sglang-router`).
    Sglang,
    /// `smg` 1.13.0 (PyPI), SGLang's router today.
    Smg,
    /// vLLM's router 0.1.17 (PyPI `vllm-router`).
    VllmRouter,
    /// vLLM's router 0.1.17 in its disaggregated mode: the first
    /// simulators prefill, the rest decode (NixlConnector's protocol).
    VllmRouterPd,
}

impl Peer {
    /// A contender named `<peer>:<policy>`, as the peer and its policy.
    pub fn of(contender: &str) -> Option<(Peer, &str)> {
        let (peer, policy) = contender.split_once(':')?;
        let peer = match peer {
            "sglang" => Peer::Sglang,
            "smg" => Peer::Smg,
            "vllm-router" => Peer::VllmRouter,
            "vllm-router-pd" => Peer::VllmRouterPd,
            _ => return None,
        };
        Some((peer, policy))
    }

    /// Its process name in logs.
    pub fn name(self) -> &'static str {
        match self {
            Peer::Sglang => "sglang-router",
            Peer::Smg => "smg",
            Peer::VllmRouter | Peer::VllmRouterPd => "vllm-router",
        }
    }

    /// Whether it splits each request into a prefill and a decode leg.
    pub fn disaggregated(self) -> bool {
        self == Peer::VllmRouterPd
    }

    /// The program and arguments of the peer with `policy` on `port` in
    /// front of simulators on `sims`; a disaggregated one prefills on the
    /// first `prefills` of them.
    pub fn command(
        self,
        programs: &Programs,
        port: u16,
        policy: &str,
        sims: &[u16],
        prefills: usize,
        prometheus_port: u16,
    ) -> (PathBuf, Vec<String>) {
        let (program, lead, level): (&Path, &[&str], &str) = match self {
            Peer::Sglang => (&programs.sglang_python, &["-m", "sglang_router.launch_router"], "warn"),
            Peer::Smg => (&programs.smg, &["launch"], "warn"),
            Peer::VllmRouter => (&programs.vllm_router, &[], "warning"),
            Peer::VllmRouterPd => (&programs.vllm_router, &["--vllm-pd-disaggregation"], "warning"),
        };
        let url = |p: &u16| format!("http://127.0.0.1:{p}");
        let mut flags: Vec<String> = lead.iter().map(|s| s.to_string()).collect();
        flags.extend(["--host", "127.0.0.1", "--port", &port.to_string(), "--policy", policy].map(str::to_string));
        if self.disaggregated() {
            let (prefill, decode) = sims.split_at(prefills.min(sims.len()));
            flags.extend(prefill.iter().flat_map(|p| ["--prefill".to_string(), url(p)]));
            flags.extend(decode.iter().flat_map(|p| ["--decode".to_string(), url(p)]));
        } else {
            flags.push("--worker-urls".into());
            flags.extend(sims.iter().map(url));
        }
        flags.extend(["--log-level", level, "--prometheus-port", &prometheus_port.to_string()].map(str::to_string));
        (program.to_path_buf(), flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn several_routers_share_the_inferrail_cluster_drawn_at_random() -> anyhow::Result<()> {
        let one = envoy_config("../envoy/local.yaml", &[(9002, 19002)])?;
        let two = several_routers(&one, &["127.0.0.1:19002".into(), "127.0.0.1:19012".into()])?;
        let config: serde_yaml::Value = serde_yaml::from_str(&two)?;
        let inferrail = config["static_resources"]["clusters"].as_sequence().and_then(|c| c.iter().find(|c| c["name"] == "inferrail"));
        let inferrail = inferrail.ok_or_else(|| anyhow::anyhow!("no inferrail cluster"))?;
        assert_eq!(inferrail["lb_policy"], "RANDOM");
        let ports: Vec<u64> = inferrail["load_assignment"]["endpoints"][0]["lb_endpoints"]
            .as_sequence()
            .map(|e| e.iter().filter_map(|e| e["endpoint"]["address"]["socket_address"]["port_value"].as_u64()).collect())
            .unwrap_or_default();
        assert_eq!(ports, [19002, 19012]);
        Ok(())
    }

    #[test]
    fn the_host_tier_is_sized_from_the_simulators_flags() -> anyhow::Result<()> {
        assert_eq!(host_blocks("--block-size 16 --kv-offloading-size 4")?, Some(2048), "4 GiB of 2 MiB blocks");
        assert_eq!(host_blocks("--kv-offloading-size 0.5 --block-size 64 --kv-cache-bytes-per-token 1000")?, Some(8192));
        assert_eq!(host_blocks("--block-size 16")?, None);
        assert!(host_blocks("--kv-offloading-size lots").is_err());
        Ok(())
    }

    #[test]
    fn a_variant_lays_its_parameters_over_the_runs() -> anyhow::Result<()> {
        let run = serde_json::json!({"cost_model": {"epsilon": 1.0, "offload": {"host_token_us": 1.0}}, "kv_aware": {"load_weight": 2.0}});
        let (policy, params) = variant("cost_model+gpu_only", Some(&run))?;
        let expected = serde_json::json!({"cost_model": {"epsilon": 1.0, "offload": {"host_token_us": 1.0, "aware": false}}, "kv_aware": {"load_weight": 2.0}});
        assert_eq!((policy, params), ("cost_model", Some(expected)));
        assert_eq!(variant("cost_model", Some(&run))?, ("cost_model", Some(run.clone())));
        assert_eq!(
            variant("dynamo_kv+gpu_only", None).err().map(|e| e.to_string()),
            Some("unknown variant dynamo_kv+gpu_only (known: cost_model+gpu_only)".into())
        );
        // The variant's router config is valid.
        let (_, params) = variant("cost_model+gpu_only", None)?;
        let ports = RouterPorts { ext_proc: 1, admin: 2, admin_grpc: 3 };
        let (_, config) =
            router_config("cost_model", ("builtin:sim", &[]), 1, ports, (&[8001], &[], 0, None), (0.1, params.as_ref()), None)?;
        assert_eq!(config.models[0].policies["cost_model"]["offload"]["aware"], serde_yaml::Value::Bool(false));
        Ok(())
    }

    #[test]
    fn envoy_ports_move_as_whole_numbers() -> anyhow::Result<()> {
        let text = envoy_config("../envoy/local.yaml", &[(8001, 18001), (9002, 19002)])?;
        assert!(text.contains("port_value: 18001") && text.contains("port_value: 19002") && text.contains("port_value: 8002"));
        assert!(envoy_config("../envoy/local.yaml", &[(8004, 1)]).is_err(), "a port that is not there is an error");
        Ok(())
    }

    #[test]
    fn with_kv_event_ports_each_replica_follows_its_simulators_events() -> anyhow::Result<()> {
        let ports = RouterPorts { ext_proc: 1, admin: 2, admin_grpc: 3 };
        let events = [KvEventPorts { publish: 7001, replay: 7101 }, KvEventPorts { publish: 7002, replay: 7102 }];
        let params = inferrail_fleet::timescale::params(0.1);
        let (yaml, config) =
            router_config("cost_model", ("builtin:sim", &[]), 1, ports, (&[8001, 8002], &[], 0, None), (0.1, None), Some(&events))?;
        assert_eq!(inferrail_config::Config::parse(&yaml)?, config, "the YAML reads as the configuration returned");
        let ip = "127.0.0.1".parse()?;
        let own = |c: &inferrail_config::Config, id: &str| c.replicas.iter().find(|r| r.id == id).and_then(|r| r.kv_events.clone());
        let second = config.event_source(own(&config, "sim-2").as_ref(), ip).expect("sim-2 follows events");
        assert_eq!((second.endpoint.as_str(), second.bind), ("tcp://127.0.0.1:7002", false), "the router connects");
        assert_eq!(second.replay_endpoint.as_deref(), Some("tcp://127.0.0.1:7102"));
        assert_eq!(config.routing.policies, params);
        assert_eq!(config.load.interval_ms, 10, "the engines' load is read ten times as often at a tenth of the time");
        let (_, plain) = router_config("cost_model", ("builtin:sim", &[]), 1, ports, (&[8001], &[], 0, None), (0.1, None), None)?;
        assert_eq!(plain.event_source(own(&plain, "sim-1").as_ref(), ip), None, "no events: approximate mode");
        // The simulator binds what the router connects to, as vLLM does for `*`.
        let [flag, json] = events[1].sim_flags();
        let json: serde_json::Value = serde_json::from_str(&json)?;
        assert_eq!(flag, "--kv-events-config");
        assert_eq!((json["endpoint"].as_str(), json["replay_endpoint"].as_str()), (Some("tcp://*:7002"), Some("tcp://*:7102")));
        Ok(())
    }

    #[test]
    fn each_replica_is_priced_by_its_own_calibration_when_given() -> anyhow::Result<()> {
        let ports = RouterPorts { ext_proc: 1, admin: 2, admin_grpc: 3 };
        let slow = inferrail_policy::Prefill { prefill_token_us: 21.5, prefill_pair_ns: 0.61, prefill_fixed_ms: 1.0 };
        let (yaml, config) =
            router_config("cost_model", ("builtin:sim", &[]), 1, ports, (&[8001, 8002], &[None, Some(slow)], 0, None), (0.1, None), None)?;
        assert_eq!(inferrail_config::Config::parse(&yaml)?, config);
        assert_eq!(config.replicas.iter().map(|r| r.serving.prefill).collect::<Vec<_>>(), [None, Some(slow)]);
        Ok(())
    }

    #[test]
    fn peers_are_named_with_their_policy_and_take_sglangs_flags() {
        let programs =
            Programs { bin_dir: "b".into(), envoy: "e".into(), sglang_python: "py".into(), smg: "smg".into(), vllm_router: "vr".into() };
        assert_eq!(Peer::of("cost_model"), None);
        assert_eq!(Peer::of("other:cache_aware"), None);
        let (peer, policy) = Peer::of("smg:cache_aware").unwrap();
        assert_eq!((peer, policy), (Peer::Smg, "cache_aware"));
        let (program, flags) = peer.command(&programs, 9, policy, &[1, 2], 0, 7);
        assert_eq!(program, PathBuf::from("smg"));
        assert_eq!(flags[..2], ["launch", "--host"]);
        assert!(flags.windows(3).any(|w| w == ["--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2"]), "{flags:?}");
        let (program, flags) = Peer::VllmRouter.command(&programs, 9, "cache_aware", &[1], 0, 7);
        assert_eq!((program, flags[0].as_str()), (PathBuf::from("vr"), "--host"));
        assert!(flags.windows(2).any(|w| w == ["--log-level", "warning"]));
        assert_eq!(Peer::Sglang.command(&programs, 9, "round_robin", &[1], 0, 7).1[..2], ["-m", "sglang_router.launch_router"]);
        let (peer, policy) = Peer::of("vllm-router-pd:round_robin").unwrap();
        let (_, flags) = peer.command(&programs, 9, policy, &[1, 2, 3], 1, 7);
        assert_eq!(flags[0], "--vllm-pd-disaggregation");
        let pools: Vec<&[String]> = flags.windows(2).filter(|w| w[0] == "--prefill" || w[0] == "--decode").collect();
        assert_eq!(
            pools.iter().map(|w| format!("{} {}", w[0], w[1])).collect::<Vec<_>>(),
            ["--prefill http://127.0.0.1:1", "--decode http://127.0.0.1:2", "--decode http://127.0.0.1:3"]
        );
        assert!(!flags.contains(&"--worker-urls".to_string()));
    }

    #[test]
    fn policy_overrides_change_only_what_they_name_and_bad_ones_fail_before_the_router_starts() -> anyhow::Result<()> {
        let ports = RouterPorts { ext_proc: 1, admin: 2, admin_grpc: 3 };
        let with = |over: &str| -> anyhow::Result<inferrail_config::Config> {
            let over = inferrail_fleet::timescale::parse_overrides(over).map_err(anyhow::Error::msg)?;
            Ok(router_config("cost_model", ("builtin:sim", &[]), 1, ports, (&[8001], &[], 0, None), (0.1, Some(&over)), None)?.1)
        };
        let config = with(r#"{"cost_model": {"share_weight": 0, "hot_prefix": {"enabled": false}}}"#)?;
        let (base, p) = (inferrail_fleet::timescale::params(0.1), config.params(0).map_err(|e| anyhow::anyhow!(e.join("; ")))?);
        assert_eq!(p.cost_model.share_weight, 0.0);
        assert!(!p.cost_model.hot_prefix.enabled);
        assert_eq!(p.cost_model.hot_prefix.blocks, base.cost_model.hot_prefix.blocks, "its siblings kept");
        assert_eq!(p.cost_model.decode_interference_ms, base.cost_model.decode_interference_ms, "the time scale's kept");
        assert_eq!(p.prefill, base.prefill);
        assert!(with(r#"{"cost_model": {"kappa": 2}}"#).is_err(), "kappa above 1");
        assert!(with(r#"{"cost_model": {"share_wieght": 0}}"#).is_err(), "an unknown key");
        assert!(inferrail_fleet::timescale::parse_overrides("[1]").is_err());
        Ok(())
    }
}
