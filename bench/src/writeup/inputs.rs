//! The committed results the report reads, as the fields it needs: compare
//! runs, capacity searches on real simulators, fleet simulations (capacity
//! searches and single runs), prediction accuracy and the overhead ladder.
//! Unknown fields are ignored; a missing or mistyped needed one is an error
//! that names the file.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::Deserialize;
use serde::de::DeserializeOwned;

/// Percentiles as `report::Latency` writes them.
#[derive(Debug, Clone, Deserialize)]
pub struct Latency {
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
}

/// One `compare` run (`bench/results/routing/<dir>/<workload>-<contender>-rep<n>.json`).
#[derive(Debug, Clone, Deserialize)]
pub struct CompareRun {
    pub commit: String,
    pub command: String,
    pub contender: String,
    pub workload: String,
    pub rep: u64,
    pub seed: u64,
    pub rate: f64,
    /// Requests sent, warmup included (older results lack it).
    #[serde(default)]
    pub sent: Option<usize>,
    /// The latency model's time scale (older results lack it).
    #[serde(default)]
    pub time_scale: Option<f64>,
    /// The SLO, already scaled (older results lack it).
    #[serde(default)]
    pub slo: Option<Slo>,
    /// How often Inferrail read each engine's load (older results, and SGLang's router's, lack it).
    #[serde(default)]
    pub load_interval_ms: Option<f64>,
    pub summary: Summary,
    /// Hit rate from usage over every request, warmup included (older results lack it).
    #[serde(default)]
    pub prefix_all: Option<Prefix>,
    pub engines: Option<Engines>,
    /// Every measured TTFT (results written before it was recorded lack it;
    /// a run none of whose requests succeeded has none).
    #[serde(default)]
    pub ttft_ms: Option<Vec<f64>>,
}

/// The SLO a run was measured against, milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct Slo {
    pub ttft_ms: f64,
    pub tpot_ms: f64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Summary {
    pub requests: usize,
    pub ok: usize,
    pub ttft: Latency,
    pub goodput: Goodput,
    pub prefix: Prefix,
    pub prediction: Prediction,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Goodput {
    pub share: f64,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Prefix {
    pub hit_rate: Option<f64>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Prediction {
    pub compared: usize,
    pub exact: usize,
    pub over: usize,
    pub under: usize,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Engines {
    /// One entry per simulator scraped: how many replicas served.
    #[serde(default)]
    pub engines: Vec<serde::de::IgnoredAny>,
    pub hit_rate: Option<f64>,
    pub busiest_share: Option<f64>,
}

/// A fleet-simulation capacity search (`bench/results/fleet/capacity-*.json`).
#[derive(Debug, Clone, Deserialize)]
pub struct FleetCapacity {
    pub commit: String,
    pub command: String,
    pub workload: Workload,
    /// The seed of its workload, schedule and router.
    pub seed: u64,
    pub slo_ttft_ms: f64,
    /// Per policy, the highest rate within the SLO at each replica count.
    pub capacity: Vec<(String, Vec<Capacity>)>,
    pub fixed_rate: Option<f64>,
    /// Per policy, the replicas needed for `fixed_rate` (none found: `null`).
    #[serde(default)]
    pub replicas_needed: Vec<(String, Option<usize>)>,
}

/// One workload's fleet capacity searches, one per seed, in seed order.
#[derive(Debug)]
pub struct FleetWorkload<'a> {
    pub workload: &'a str,
    pub files: Vec<&'a Loaded<FleetCapacity>>,
}

impl FleetWorkload<'_> {
    /// The searches grouped by workload, in the order each first appears,
    /// each group's by seed. A seed searched twice on one replica count, or
    /// SLOs that differ within a workload, are an error: summed, they would
    /// skew the ratio. One seed searched on other counts in another file
    /// (a large fleet run apart) is not.
    pub fn group(capacity: &[Loaded<FleetCapacity>]) -> anyhow::Result<Vec<FleetWorkload<'_>>> {
        let mut out: Vec<FleetWorkload> = Vec::new();
        for f in capacity {
            let w = f.value.workload.workload.as_str();
            match out.iter_mut().find(|g| g.workload == w) {
                Some(g) => {
                    let other = g.files[0];
                    let sizes = Self::sizes_of(&f.value);
                    anyhow::ensure!(
                        g.files.iter().all(|o| o.value.seed != f.value.seed || Self::sizes_of(&o.value).is_disjoint(&sizes)),
                        "{} and another file both search {w} on seed {} with the same replicas",
                        f.path.display(),
                        f.value.seed
                    );
                    anyhow::ensure!(
                        other.value.slo_ttft_ms == f.value.slo_ttft_ms,
                        "{} and {} search {w} against different SLOs",
                        f.path.display(),
                        other.path.display()
                    );
                    g.files.push(f);
                }
                None => out.push(FleetWorkload { workload: w, files: vec![f] }),
            }
        }
        for g in &mut out {
            g.files.sort_by_key(|f| f.value.seed);
        }
        Ok(out)
    }

    /// Policies, in the order the searches name them.
    pub fn policies(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for (p, _) in self.files.iter().flat_map(|f| &f.value.capacity) {
            if !out.contains(&p.as_str()) {
                out.push(p);
            }
        }
        out
    }

    /// Fleet sizes searched.
    pub fn sizes(&self) -> BTreeSet<usize> {
        self.files.iter().flat_map(|f| Self::sizes_of(&f.value)).collect()
    }

    /// Fleet sizes one search covers.
    fn sizes_of(f: &FleetCapacity) -> BTreeSet<usize> {
        f.capacity.iter().flat_map(|(_, c)| c.iter().map(|c| c.replicas)).collect()
    }

    /// `policy`'s capacity on `replicas` in one search.
    fn rate(f: &FleetCapacity, policy: &str, replicas: usize) -> Option<f64> {
        f.capacity.iter().find(|(p, _)| p == policy)?.1.iter().find(|c| c.replicas == replicas).map(|c| c.rate)
    }

    /// `policy`'s capacity on `replicas` on each seed that searched it.
    pub fn rates(&self, policy: &str, replicas: usize) -> Vec<f64> {
        self.files.iter().filter_map(|f| Self::rate(&f.value, policy, replicas)).collect()
    }

    /// `policy`'s capacity over `base`'s on `replicas`, summed over the
    /// seeds that searched both, and how many did: how much more traffic it
    /// serves on the same fleet, one lucky seed weighing no more than its
    /// share. None where no seed searched both, or both served nothing.
    pub fn ratio(&self, policy: &str, base: &str, replicas: usize) -> Option<(f64, usize)> {
        let pairs: Vec<(f64, f64)> =
            self.files.iter().filter_map(|f| Self::rate(&f.value, policy, replicas).zip(Self::rate(&f.value, base, replicas))).collect();
        let (p, b) = pairs.iter().fold((0.0, 0.0), |(p, b), (x, y)| (p + x, b + y));
        match (b > 0.0, p > 0.0) {
            (true, _) => Some((p / b, pairs.len())),
            (false, true) => Some((f64::INFINITY, pairs.len())),
            (false, false) => None,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct Workload {
    pub workload: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Capacity {
    pub replicas: usize,
    pub rate: f64,
}

/// One contender's capacity on real simulators
/// (`compare --capacity`: `capacity-<workload>-<contender>.json`).
#[derive(Debug, Clone, Deserialize)]
pub struct RealCapacity {
    /// From the probe at capacity, else from the file's name.
    #[serde(skip)]
    pub workload: String,
    /// From the probe at capacity, else from the file's name (`:` written `-`).
    #[serde(skip)]
    pub contender: String,
    pub replicas: usize,
    /// Highest rate that met the SLO (0 when none did).
    pub rate: f64,
    pub missed_at: f64,
    /// The probe at `rate`, if one met the SLO.
    pub at_capacity: Option<CompareRun>,
    pub probes: usize,
}

/// Single fleet simulations (`fleet --out`, without `--capacity`).
#[derive(Debug, Clone, Deserialize)]
pub struct FleetRuns {
    pub commit: String,
    pub command: String,
    pub workload: Workload,
    pub seed: u64,
    pub rate: f64,
    pub runs: Vec<FleetOutcome>,
}

/// One simulated policy on one fleet size.
#[derive(Debug, Clone, Deserialize)]
pub struct FleetOutcome {
    pub policy: String,
    pub replicas: usize,
    pub requests: usize,
    pub hit_rate: f64,
    pub ttft: Latency,
    /// Seconds simulated.
    pub virtual_s: f64,
    /// Seconds the simulation took on the machine (one core).
    pub wall_s: f64,
}

/// `bench/results/prediction/accuracy.json`.
#[derive(Debug, Clone, Deserialize)]
pub struct Accuracy {
    pub setup: String,
    pub points: Vec<AccuracyPoint>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct AccuracyPoint {
    /// `approximate` (the router's own decisions) or `events` (the engines' KV events).
    pub mode: String,
    pub users: usize,
    pub blocks: usize,
    pub requests: usize,
    pub exact: usize,
    pub over_predicted: usize,
    pub under_predicted: usize,
}

/// `bench/results/overhead/ladder.json`.
#[derive(Debug, Clone, Deserialize)]
pub struct Ladder {
    pub commit: String,
    pub command: String,
    pub setup: String,
    pub rate: f64,
    pub rungs: Vec<RungResult>,
    pub long_prompt: Option<LongPrompt>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RungResult {
    pub rung: String,
    pub ok: usize,
    pub errors: usize,
    pub latency: Latency,
    pub added_p50_ms: f64,
    pub added_p99_ms: f64,
    pub added_mean_ms: f64,
    pub cpu_us_per_request: BTreeMap<String, f64>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct LongPrompt {
    pub prompt_bytes: usize,
    pub levels: Vec<LongLevel>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct LongLevel {
    pub clients: usize,
    pub rungs: Vec<RungResult>,
}

/// A parsed file and where it came from.
#[derive(Debug, Clone)]
pub struct Loaded<T> {
    pub path: PathBuf,
    pub value: T,
}

/// Reads and parses one JSON file.
pub fn load<T: DeserializeOwned>(path: &Path) -> anyhow::Result<Loaded<T>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let value = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    Ok(Loaded { path: path.to_path_buf(), value })
}

/// The JSON files of `dir` that say `"benchmark": <benchmark>` and have the
/// field `key`, sorted by name; a missing `dir` has none.
pub fn load_dir_having<T: DeserializeOwned>(dir: &Path, benchmark: &str, key: &str) -> anyhow::Result<Vec<Loaded<T>>> {
    if !dir.exists() {
        return Ok(Vec::new());
    }
    load_dir::<serde_json::Value>(dir, benchmark)?
        .into_iter()
        .filter(|f| f.value.get(key).is_some())
        .map(|f| {
            Ok(Loaded { value: serde_json::from_value(f.value).with_context(|| format!("reading {}", f.path.display()))?, path: f.path })
        })
        .collect()
}

/// Every `capacity-*.json` in `dirs`, sorted by name within each; a missing folder has none.
pub fn load_capacities(dirs: &[PathBuf]) -> anyhow::Result<Vec<Loaded<RealCapacity>>> {
    let mut out = Vec::new();
    for dir in dirs.iter().filter(|d| d.exists()) {
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .map(|e| e.map(|e| e.path()))
            .collect::<Result<_, _>>()?;
        paths.sort();
        for path in paths {
            let Some(stem) = path.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix("capacity-")?.strip_suffix(".json"))
            else {
                continue;
            };
            let (workload, contender) = stem.split_once('-').unwrap_or((stem, ""));
            let (workload, contender) = (workload.to_string(), contender.to_string());
            let mut c: Loaded<RealCapacity> = load(&path)?;
            let (w, name) = c.value.at_capacity.as_ref().map_or((workload, contender), |r| (r.workload.clone(), r.contender.clone()));
            (c.value.workload, c.value.contender) = (w, name);
            out.push(c);
        }
    }
    Ok(out)
}

/// The JSON files of `dir` whose first field says `"benchmark": <benchmark>`, sorted by name.
pub fn load_dir<T: DeserializeOwned>(dir: &Path, benchmark: &str) -> anyhow::Result<Vec<Loaded<T>>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    paths.sort();
    let mut out = Vec::new();
    for path in paths.into_iter().filter(|p| p.extension().is_some_and(|e| e == "json")) {
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let head: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        if head.get("benchmark").and_then(|b| b.as_str()) != Some(benchmark) {
            continue;
        }
        out.push(Loaded { value: serde_json::from_value(head).with_context(|| format!("reading {}", path.display()))?, path });
    }
    Ok(out)
}
