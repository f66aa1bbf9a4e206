//! The report rendered from small fixture results in a temporary folder:
//! the Markdown names every chart, every chart is a PNG of the chart size,
//! a failing must-show check is reported as failing, the capacity on real
//! simulators decides its check, the fleet simulation's gap to the harness
//! is computed, issue 39's checks read their own results, and missing
//! folders read as not measured.

use serde_json::{Value, json};

use super::*;

fn latency(p50: f64, p99: f64) -> Value {
    json!({"count": 10, "p50_ms": p50, "p90_ms": (p50 + p99) / 2.0, "p99_ms": p99, "max_ms": p99 * 1.1, "mean_ms": p50 * 1.2})
}

pub(crate) fn compare_run(workload: &str, contender: &str, rep: u64, p99: f64, hit: f64, busiest: f64) -> Value {
    json!({
        "benchmark": "routing-compare", "commit": "abc1234", "command": "inferrail-bench compare --fixture",
        "contender": contender, "workload": workload, "rep": rep, "seed": 1 + rep, "rate": 0.5, "sent": 12,
        "time_scale": 0.1, "slo": {"ttft_ms": 2000.0 * 0.1, "tpot_ms": 100.0 * 0.1},
        "load_interval_ms": if contender.starts_with("sglang:") { Value::Null } else { json!(10) },
        "summary": {
            "requests": 10, "ok": 10, "ttft": latency(p99 / 4.0, p99), "goodput": {"share": 0.9},
            "prefix": {"hit_rate": hit}, "prediction": {"compared": 10, "exact": 10, "over": 0, "under": 0}
        },
        "prefix_all": {"hit_rate": hit - 0.05},
        "engines": {"engines": [{}, {}, {}], "hit_rate": hit, "busiest_share": busiest},
        "ttft_ms": (1..=10).map(|i| f64::from(i) * p99 / 10.0).collect::<Vec<_>>()
    })
}

fn write(path: &Path, value: &Value) -> anyhow::Result<()> {
    std::fs::create_dir_all(path.parent().unwrap_or(Path::new(".")))?;
    std::fs::write(path, serde_json::to_string(value)?)?;
    Ok(())
}

/// Width and height from a PNG's IHDR chunk, after checking the signature and the end chunk.
fn png_size(bytes: &[u8]) -> anyhow::Result<(u32, u32)> {
    anyhow::ensure!(bytes.len() > 1000, "only {} bytes", bytes.len());
    anyhow::ensure!(bytes.starts_with(b"\x89PNG\r\n\x1a\n") && &bytes[12..16] == b"IHDR", "not a PNG");
    anyhow::ensure!(bytes.ends_with(b"IEND\xaeB`\x82"), "the PNG does not end");
    let be = |at: usize| u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
    Ok((be(16), be(20)))
}

/// `compare --capacity`'s result: `rate` met the SLO, the probe at it a compare run.
pub(crate) fn real_capacity(workload: &str, contender: &str, rate: f64) -> Value {
    let mut probe = compare_run(workload, contender, 0, 150.0, 0.6, 0.34);
    probe["rate"] = json!(rate);
    json!({"replicas": 3, "rate": rate, "missed_at": rate * 1.1, "at_capacity": probe, "probes": 7})
}

/// A fleet simulation of the comparison's requests: `(policy, replicas, hit rate, TTFT p99)` per run.
fn fleet_runs(workload: &str, runs: &[(&str, usize, f64, f64)]) -> Value {
    let runs: Vec<Value> = runs
        .iter()
        .map(|&(policy, replicas, hit, p99)| {
            json!({"policy": policy, "replicas": replicas, "requests": 12, "hit_rate": hit, "ttft": latency(p99 / 4.0, p99),
                                                  "virtual_s": 30.0, "wall_s": 0.5})
        })
        .collect();
    json!({"benchmark": "fleet-simulation", "commit": "fee9999", "command": "inferrail-bench fleet --fixture", "workload": {"workload": workload},
           "requests": 12, "seed": 1, "rate": 0.5, "runs": runs})
}

/// Fixtures in a fresh folder; `cost_model_p99_w1` decides whether the p99
/// check passes, `cost_model_capacity` (against round robin's 0.714 req/s on
/// W1 and mix) the real-capacity check.
fn fixtures(name: &str, cost_model_p99_w1: f64, cost_model_capacity: f64) -> anyhow::Result<ReportArgs> {
    let dir = std::env::temp_dir().join(format!("inferrail-report-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let routing = dir.join("routing");
    for rep in 0..2 {
        let jitter = rep as f64 * 10.0;
        write(&routing.join(format!("w1-round_robin-rep{rep}.json")), &compare_run("w1", "round_robin", rep, 4000.0 + jitter, 0.4, 0.34))?;
        write(
            &routing.join(format!("w1-least_request-rep{rep}.json")),
            &compare_run("w1", "least_request", rep, 3000.0 + jitter, 0.41, 0.34),
        )?;
        write(
            &routing.join(format!("w1-cost_model-rep{rep}.json")),
            &compare_run("w1", "cost_model", rep, cost_model_p99_w1 + jitter, 0.9, 0.35),
        )?;
        write(
            &routing.join(format!("w1-sglang-cache_aware-rep{rep}.json")),
            &compare_run("w1", "sglang:cache_aware", rep, 2500.0, 0.8, 0.5),
        )?;
    }
    write(&routing.join("hot-cost_model-rep0.json"), &compare_run("hot", "cost_model", 0, 900.0, 0.9, 0.36))?;
    write(&routing.join("hot-round_robin-rep0.json"), &compare_run("hot", "round_robin", 0, 3000.0, 0.4, 0.34))?;
    write(&routing.join("table.json"), &json!({"not": "a run"}))?;
    let capacity = |p: &str, rate: f64| json!([p, [{"replicas": 4, "rate": rate}, {"replicas": 16, "rate": rate * 5.0}]]);
    write(
        &dir.join("fleet/capacity-w1.json"),
        &json!({
            "benchmark": "fleet-simulation", "commit": "def5678", "command": "inferrail-bench fleet --capacity", "workload": {"workload": "w1"},
            "seed": 1, "slo_ttft_ms": 2000.0, "capacity": [capacity("cost_model", 2.0), capacity("round_robin", 1.0)],
            "fixed_rate": 10.0, "replicas_needed": [["cost_model", 17], ["round_robin", 63]]
        }),
    )?;
    write(
        &dir.join("fleet-scale/capacity-mix-seed1.json"),
        &json!({
            "benchmark": "fleet-simulation", "commit": "def5678", "command": "inferrail-bench fleet --capacity --time-scale 0.1", "workload": {"workload": "mix"},
            "seed": 1, "slo_ttft_ms": 200.0, "capacity": [["cost_model", [{"replicas": 3, "rate": 7.0}]], ["round_robin", [{"replicas": 3, "rate": 5.6}]]],
            "fixed_rate": null, "replicas_needed": []
        }),
    )?;
    for w in ["w1", "mix"] {
        // The comparison's 0.5 req/s is 70% of this.
        write(&dir.join(format!("capacity/capacity-{w}-round_robin.json")), &real_capacity(w, "round_robin", 0.714))?;
        write(
            &dir.join(format!("capacity-cost-model/capacity-{w}-cost_model.json")),
            &real_capacity(w, "cost_model", cost_model_capacity),
        )?;
    }
    write(&dir.join("capacity/capacity.md"), &json!("a table"))?;
    write(
        &dir.join("validation/fleet-w1.json"),
        &fleet_runs(
            "w1",
            &[
                ("round_robin", 3, 0.40, 4400.0),
                ("cost_model", 3, 0.80, 900.0),
                ("cost_model", 16, 0.9, 500.0),
                ("prefix_hash", 3, 0.7, 2000.0),
            ],
        ),
    )?;
    write(&dir.join("fleet/speed/w1-256.json"), &fleet_runs("w1", &[("cost_model", 256, 0.9, 800.0)]))?;
    write(&dir.join("fleet/w1-3-replicas.json"), &json!({"benchmark": "fleet-simulation", "commit": "def5678", "runs": []}))?;
    write(
        &dir.join("prediction/accuracy.json"),
        &json!({"benchmark": "prediction-accuracy-under-concurrency", "setup": "fixture", "points": [
            {"mode": "approximate", "users": 1, "blocks": 64, "requests": 100, "exact": 100, "over_predicted": 0, "under_predicted": 0},
            {"mode": "events", "users": 16, "blocks": 64, "requests": 100, "exact": 80, "over_predicted": 12, "under_predicted": 8}]}),
    )?;
    let rung = |name: &str, p50: f64, added: f64| {
        json!({"rung": name, "ok": 100, "errors": 0, "latency": latency(p50, p50 * 3.0), "added_p50_ms": added, "added_p99_ms": added * 3.0,
               "added_mean_ms": added, "cpu_us_per_request": {"client": 300.0, "simulators": 800.0}})
    };
    write(
        &dir.join("overhead/ladder.json"),
        &json!({"benchmark": "overhead-ladder", "commit": "aaa1111", "command": "inferrail-bench overhead", "setup": "fixture", "rate": 100.0,
            "rungs": [rung("direct", 2.0, 0.0), rung("envoy", 2.5, 0.5), rung("inferrail", 4.0, 2.0)],
            "long_prompt": {"prompt_bytes": 225280, "levels": [
                {"clients": 1, "rungs": [rung("direct", 3.0, 0.0), rung("envoy", 3.5, 0.5), rung("inferrail", 6.5, 3.5)]},
                {"clients": 20, "rungs": [rung("direct", 10.0, 0.0), rung("envoy", 11.0, 1.0), rung("inferrail", 15.0, 5.0)]},
                {"clients": 150, "rungs": [rung("direct", 50.0, 0.0), rung("envoy", 60.0, 10.0), rung("inferrail", 90.0, 40.0)]}]}}),
    )?;
    Ok(ReportArgs {
        routing: vec![routing],
        fleet: dir.join("fleet"),
        fleet_scale: dir.join("fleet-scale"),
        real_capacity: vec![dir.join("capacity"), dir.join("capacity-cost-model")],
        mixed_capacity: vec![dir.join("mixed")],
        fleet_reuse: vec![dir.join("fleet-reuse/capacity-agent-seed1.json")],
        predictions: vec![dir.join("agent-exact")],
        validation: dir.join("validation"),
        fleet_speed: dir.join("fleet/speed/w1-256.json"),
        prediction: dir.join("prediction/accuracy.json"),
        overhead: dir.join("overhead/ladder.json"),
        font: PathBuf::from("../.cache/fonts/DejaVuSans.ttf"),
        out_dir: dir.join("report"),
    })
}

#[test]
fn the_report_names_every_chart_and_each_is_a_png_of_the_chart_size() -> anyhow::Result<()> {
    let args = fixtures("charts", 1000.0, 1.0)?;
    let failed = render(&args)?;
    let md = std::fs::read_to_string(args.out_dir.join("report.md"))?;
    let mut pngs: Vec<String> = std::fs::read_dir(&args.out_dir)?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .filter(|n| n.ends_with(".png"))
        .collect();
    pngs.sort();
    let expected = [
        "busiest-share.png",
        "fleet-capacity-bench-scale.png",
        "fleet-capacity.png",
        "hit-rate-engines.png",
        "hit-rate-usage.png",
        "overhead-cpu.png",
        "overhead-latency.png",
        "overhead-long-prompt.png",
        "prediction.png",
        "real-capacity.png",
        "ttft-cdf-hot.png",
        "ttft-cdf-w1.png",
        "ttft-p50.png",
        "ttft-p99.png",
    ];
    assert_eq!(pngs, expected);
    for png in &pngs {
        assert!(md.contains(&format!("]({png})")), "the report does not show {png}");
        assert_eq!(png_size(&std::fs::read(args.out_dir.join(png))?)?, charts::SIZE, "{png}");
    }
    // Sources and computed values, with the spread over the two repetitions:
    // the p99 of their 20 requests together is the slower one's slowest.
    assert!(md.contains("commit `abc1234`") && md.contains("commit `def5678`") && md.contains("commit `aaa1111`"));
    assert!(md.contains("| w1 | cost_model | 2 |") && md.contains("1010 (1000–1010)"), "{md}");
    assert!(md.contains("GPUs saved by cost_model against round_robin: 46 of 63"));
    // The searches at the comparison's scale have a section of their own, outside the checks.
    let scaled = md.split("## Fleet simulation at the comparison's scale").nth(1).unwrap_or_default();
    assert!(
        scaled.contains("| cost_model | 7.00 (1.25x rr) |") && scaled.contains("inferrail-bench fleet --capacity --time-scale 0.1"),
        "{md}"
    );
    assert!(failed.is_empty(), "{failed:?}");
    assert!(
        md.contains("| approximate mode, 1 user, 64 blocks | 100 | 100 | 0 | 0 |")
            && md.contains("| events mode, 16 users, 64 blocks | 100 | 80 | 12 | 8 |"),
        "{md}"
    );
    assert!(
        md.contains("w1 at 0.5 req/s, seed 1, simulated on one core") && md.contains("| cost_model | 256 | 12 | 30.0 | 0.5 | 800 |"),
        "{md}"
    );
    assert!(md.contains("| 4.8 ms (5.0 ms over straight to the simulators; 3.6 ms from one client) | pass |"), "{md}");
    assert!(md.contains("ran at time scale 0.1 (every modelled duration times 0.1), with the SLO scaled alike: TTFT at most 200 ms and TPOT at most 10 ms (2000 ms and 100 ms at scale 1). Inferrail read each engine's load every 10 ms"), "{md}");
    assert!(
        md.contains("w1 at 0.5 req/s, 70.0% of round_robin's 0.714 req/s") && md.contains("Each is 70.0% of round robin's capacity"),
        "{md}"
    );
    assert!(md.contains("| cost_model | w1 | 3 | 1 | 1.40x round_robin | 1.1 | 7 | 150 | 60.0% |"), "{md}");
    std::fs::remove_dir_all(args.out_dir.parent().unwrap_or(&args.out_dir))?;
    Ok(())
}

#[test]
fn fleet_capacity_over_seeds_is_compared_by_its_sums() -> anyhow::Result<()> {
    let args = fixtures("seeds", 1000.0, 1.0)?;
    let mix = |seed: u64, hero: f64, rr: f64| {
        json!({
            "benchmark": "fleet-simulation", "commit": "def5678", "command": format!("inferrail-bench fleet --capacity --seed {seed}"),
            "workload": {"workload": "mix"}, "seed": seed, "slo_ttft_ms": 2000.0,
            "capacity": [["cost_model", [{"replicas": 4, "rate": hero}]], ["round_robin", [{"replicas": 4, "rate": rr}]]],
            "fixed_rate": null, "replicas_needed": []
        })
    };
    let row = |md: &str| md.lines().find(|l| l.contains("capacity at the SLO on mix")).unwrap_or_default().to_owned();
    // Seed 2's file sorts first by name: the table and the commands go by seed all the same.
    write(&args.fleet.join("capacity-mix-a.json"), &mix(2, 1.0, 1.0))?;
    write(&args.fleet.join("capacity-mix-seed1.json"), &mix(1, 2.0, 1.0))?;
    render(&args)?;
    let md = std::fs::read_to_string(args.out_dir.join("report.md"))?;
    assert!(row(&md).contains("1.50x at 4 (summed over 2 seeds)") && row(&md).ends_with("| pass |"), "{}", row(&md));
    assert!(md.contains("| cost_model | 1.50 (1.00\u{2013}2.00; 1.50x rr) |"), "{md}");
    assert!(md.find("--seed 1`").zip(md.find("--seed 2`")).is_some_and(|(one, two)| one < two), "{md}");
    // A third seed where round robin does better: seed 1 alone would still pass, the sums do not.
    write(&args.fleet.join("capacity-mix-seed3.json"), &mix(3, 0.5, 1.5))?;
    let failed = render(&args)?;
    let md = std::fs::read_to_string(args.out_dir.join("report.md"))?;
    assert!(row(&md).contains("1.00x at 4 (summed over 3 seeds)") && row(&md).ends_with("| **FAIL** |"), "{}", row(&md));
    assert!(failed.iter().any(|f| f.contains("capacity at the SLO on mix")), "{failed:?}");
    // W1's single search is still read as one seed.
    assert!(md.contains("2.00x at 4, 2.00x at 16 (one seed)"), "{md}");
    // A seed that did not search round robin counts in the mean, not in the ratio.
    let mut alone = mix(4, 9.0, 1.0);
    if let Some(c) = alone["capacity"].as_array_mut() {
        c.truncate(1);
    }
    write(&args.fleet.join("capacity-mix-seed4.json"), &alone)?;
    render(&args)?;
    let md = std::fs::read_to_string(args.out_dir.join("report.md"))?;
    assert!(row(&md).contains("1.00x at 4 (summed over 3 seeds)"), "{}", row(&md));
    assert!(md.contains("| cost_model | 3.12 (0.50–9.00; 1.00x rr) |"), "{md}");
    // The same seed twice would count twice: refused, naming the file.
    write(&args.fleet.join("capacity-mix-seed4-again.json"), &mix(4, 1.0, 1.0))?;
    let err = render(&args).err().map(|e| format!("{e:#}")).unwrap_or_default();
    assert!(err.contains("both search mix on seed 4"), "{err}");
    std::fs::remove_dir_all(args.out_dir.parent().unwrap_or(&args.out_dir))?;
    Ok(())
}

#[test]
fn a_failing_check_is_reported_as_failing() -> anyhow::Result<()> {
    // cost_model's W1 p99 above SGLang's 2,500 ms and least_request's 3,000 ms.
    let args = fixtures("failing", 3500.0, 1.0)?;
    let failed = render(&args)?;
    assert!(failed.iter().any(|f| f.contains("lowest p99 TTFT of all contenders on w1")), "{failed:?}");
    assert!(failed.iter().any(|f| f.contains("never has a worse p99 TTFT than least_request")), "{failed:?}");
    let md = std::fs::read_to_string(args.out_dir.join("report.md"))?;
    let row = md.lines().find(|l| l.contains("lowest p99 TTFT of all contenders on w1")).unwrap_or_default();
    assert!(row.ends_with("| **FAIL** |") && row.contains("best other: sglang:cache_aware 2500 ms"), "{row}");
    // The fixtures' repetitions pair (same seeds, every request measured):
    // request i of repetition r took (350 + r) i ms under cost_model and
    // 250i under SGLang's router; the pooled p99s are the slowest of each.
    assert!(row.contains("over the same 20 requests, cost_model's p99 minus sglang:cache_aware's +1010.0 ms"), "{row}");
    assert!(row.contains("the median request's difference +505.0 ms"), "{row}");
    let mix = md.lines().find(|l| l.contains("on mix")).unwrap_or_default();
    assert!(mix.ends_with("| not measured |"), "{mix}");
    std::fs::remove_dir_all(args.out_dir.parent().unwrap_or(&args.out_dir))?;
    Ok(())
}

#[test]
fn against_the_peer_the_path_is_read_from_the_same_algorithm_through_inferrail() -> anyhow::Result<()> {
    let args = fixtures("path", 1000.0, 1.0)?;
    // SGLang's round robin beats cost_model's 900 ms on hot; round_robin through inferrail took 3,000.
    write(&args.routing[0].join("hot-sglang-round_robin-rep0.json"), &compare_run("hot", "sglang:round_robin", 0, 800.0, 0.4, 0.34))?;
    render(&args)?;
    let md = std::fs::read_to_string(args.out_dir.join("report.md"))?;
    let hot = md.lines().find(|l| l.contains("lowest p99 TTFT of all contenders on hot")).unwrap_or_default();
    assert!(hot.ends_with("| **FAIL** |") && hot.contains("best other: sglang:round_robin 800 ms"), "{hot}");
    // Request i took 300i ms through inferrail's round robin and 80i through SGLang's.
    assert!(
        hot.contains("the path alone (round_robin through Envoy and inferrail minus sglang:round_robin, one algorithm): p99 +2200.0 ms, the median request +1100.0 ms"),
        "{hot}"
    );
    // W1's best other is SGLang's cache_aware, and SGLang's round robin did not run W1: no path figure.
    let w1 = md.lines().find(|l| l.contains("lowest p99 TTFT of all contenders on w1")).unwrap_or_default();
    assert!(w1.contains("best other: sglang:cache_aware") && !w1.contains("the path alone"), "{w1}");
    // Once it has, its path stands beside any SGLang policy's.
    write(&args.routing[0].join("w1-sglang-round_robin-rep0.json"), &compare_run("w1", "sglang:round_robin", 0, 5000.0, 0.4, 0.34))?;
    render(&args)?;
    let md = std::fs::read_to_string(args.out_dir.join("report.md"))?;
    let w1 = md.lines().find(|l| l.contains("lowest p99 TTFT of all contenders on w1")).unwrap_or_default();
    assert!(w1.contains("best other: sglang:cache_aware"), "{w1}");
    assert!(w1.contains("the path alone (round_robin through Envoy and inferrail minus sglang:round_robin, one algorithm)"), "{w1}");
    std::fs::remove_dir_all(args.out_dir.parent().unwrap_or(&args.out_dir))?;
    Ok(())
}

#[test]
fn the_real_simulator_capacity_check_passes_or_fails_from_the_files() -> anyhow::Result<()> {
    for (name, capacity, verdict) in [("real-pass", 1.0, "pass"), ("real-fail", 0.9, "**FAIL**")] {
        let args = fixtures(name, 1000.0, capacity)?;
        let failed = render(&args)?;
        let md = std::fs::read_to_string(args.out_dir.join("report.md"))?;
        for w in ["w1", "mix"] {
            let check = format!("at least 1.33x round_robin's on {w}");
            let row = md.lines().find(|l| l.contains("three real simulator processes") && l.contains(&check)).unwrap_or_default();
            let ratio =
                format!("| {:.2}x (cost_model {capacity} req/s, round_robin 0.714 req/s, on 3 simulators each) |", capacity / 0.714);
            assert!(row.contains(&ratio) && row.ends_with(&format!("| {verdict} |")), "{row}");
            assert_eq!(failed.iter().any(|f| f.contains(&check) && f.contains("real")), verdict != "pass", "{failed:?}");
        }
        std::fs::remove_dir_all(args.out_dir.parent().unwrap_or(&args.out_dir))?;
    }
    Ok(())
}

#[test]
fn a_validation_row_sets_the_simulation_against_the_harness_with_the_gap() -> anyhow::Result<()> {
    let args = fixtures("validation", 1000.0, 1.0)?;
    render(&args)?;
    let md = std::fs::read_to_string(args.out_dir.join("report.md"))?;
    // Harness rep 0: cached 85% over every request, TTFT p50 250, p90 625, p99 1000 ms; the simulation: 80%, 225, 562.5, 900
    // (shown as 562, so its gap is -63).
    let row = md.lines().find(|l| l.starts_with("| w1 | cost_model | 3 |")).unwrap_or_default();
    assert_eq!(
        row,
        "| w1 | cost_model | 3 | 85.0% / 80.0% / -5.0 pts | 250 / 225 / -25 ms (0.90x) | 625 / 562 / -63 ms (0.90x) | 1000 / 900 / -100 ms (0.90x) |"
    );
    // Round robin (harness p99 4000 ms, 35%) too; the 16-replica run and prefix_hash, not in the harness, are left out.
    assert!(md.contains("| w1 | round_robin | 3 | 35.0% / 40.0% / +5.0 pts |"), "{md}");
    assert!(!md.contains("| w1 | cost_model | 16 |") && !md.contains("| w1 | prefix_hash |"), "{md}");
    assert!(md.contains("- w1: simulation 12 requests at 0.5 req/s, seed 1; harness 12 requests sent at 0.5 req/s, seed 1."), "{md}");
    assert!(md.contains("Median gap over 2 policy and workload pairs: cached share 5.0 points apart;"), "{md}");
    assert!(md.contains("the harness's summary leaves the warmup out while the fleet simulation counts every request"), "{md}");
    std::fs::remove_dir_all(args.out_dir.parent().unwrap_or(&args.out_dir))?;
    Ok(())
}

#[test]
fn missing_folders_read_as_not_measured() -> anyhow::Result<()> {
    let mut args = fixtures("missing", 1000.0, 1.0)?;
    let gone = args.out_dir.with_file_name("nowhere");
    args.real_capacity = vec![gone.join("capacity"), gone.join("capacity-cost-model")];
    args.validation = gone.join("validation");
    args.fleet_scale = gone.join("fleet-scale");
    render(&args)?;
    let md = std::fs::read_to_string(args.out_dir.join("report.md"))?;
    for w in ["w1", "mix"] {
        let row = md.lines().find(|l| l.contains("three real simulator processes") && l.contains(&format!("on {w} |"))).unwrap_or_default();
        assert!(row.ends_with("| not measured |"), "{row}");
    }
    assert!(md.contains("Round robin's capacity on real simulators is not measured for w1 (0.5 req/s)"), "{md}");
    assert!(md.contains("Not measured: the results hold no `compare --capacity` search"), "{md}");
    assert!(md.contains("Not measured: the results hold no fleet simulation of the comparison's requests"), "{md}");
    assert!(!args.out_dir.join("real-capacity.png").exists());
    assert!(!md.contains("at the comparison's scale") && !args.out_dir.join("fleet-capacity-bench-scale.png").exists(), "{md}");
    std::fs::remove_dir_all(args.out_dir.parent().unwrap_or(&args.out_dir))?;
    Ok(())
}

/// A repetition of 100 requests at 10 ms with `slow` of them at 500 ms.
fn run_with_slow(rep: u64, slow: usize, per_request: bool) -> anyhow::Result<CompareRun> {
    let ttfts: Vec<f64> = (0..100).map(|i| if i < slow { 500.0 } else { 10.0 }).collect();
    let p99 = if slow >= 2 { 500.0 } else { 10.0 };
    let mut v = compare_run("w1", "cost_model", rep, p99, 0.9, 0.35);
    if per_request {
        v["ttft_ms"] = json!(ttfts);
    } else if let Some(fields) = v.as_object_mut() {
        fields.remove("ttft_ms");
    }
    Ok(serde_json::from_value(v)?)
}

#[test]
fn ttft_percentiles_pool_every_repetitions_requests() -> anyhow::Result<()> {
    // One repetition's p99 is 500 ms (three slow requests in 100), the
    // others' 10: their mean is 173 ms, but of the 300 requests together
    // only three are slow, so the pooled p99 is 10 ms.
    let runs = [run_with_slow(0, 3, true)?, run_with_slow(1, 0, true)?, run_with_slow(2, 0, true)?];
    let p99 = ttft_p99(&runs);
    assert_eq!(p99.value, 10.0);
    assert_eq!(p99.spread, Some((10.0, 500.0)));
    // A fourth slow request in another repetition puts the pooled p99 at 500.
    let runs = [run_with_slow(0, 3, true)?, run_with_slow(1, 1, true)?, run_with_slow(2, 0, true)?];
    assert_eq!(ttft_p99(&runs).value, 500.0);
    // Results without per-request TTFTs: the mean of the repetitions' own.
    let runs = [run_with_slow(0, 3, false)?, run_with_slow(1, 0, false)?, run_with_slow(2, 0, false)?];
    assert!((ttft_p99(&runs).value - 520.0 / 3.0).abs() < 1e-9);
    // Repetitions that served nothing have no percentile to win with.
    let mut failed = compare_run("w1", "cost_model", 0, 0.0, 0.0, 0.0);
    failed["ttft_ms"] = json!([]);
    let runs: [CompareRun; 2] = [serde_json::from_value(failed.clone())?, serde_json::from_value(failed)?];
    assert_eq!(ttft_p99(&runs).value, f64::INFINITY);
    Ok(())
}

#[test]
fn repetitions_at_another_rate_are_not_pooled() -> anyhow::Result<()> {
    let args = fixtures("stale-rate", 1000.0, 1.0)?;
    // A third W1 repetition of cost_model left from a run at another rate.
    let mut stale = compare_run("w1", "cost_model", 2, 500.0, 0.9, 0.35);
    stale["rate"] = json!(0.7);
    let path = args.routing[0].join("w1-cost_model-rep2.json");
    write(&path, &stale)?;
    let e = render(&args).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("w1-cost_model-rep2.json") && e.contains("at 0.5 and 0.7 req/s"), "{e}");
    // At the same rate it is a third repetition.
    stale["rate"] = json!(0.5);
    write(&path, &stale)?;
    render(&args)?;
    let md = std::fs::read_to_string(args.out_dir.join("report.md"))?;
    assert!(md.contains("| w1 | cost_model | 3 |"), "{md}");
    std::fs::remove_dir_all(args.out_dir.parent().unwrap_or(&args.out_dir))?;
    Ok(())
}

#[test]
fn only_repetitions_of_the_same_schedule_that_lost_nothing_pair() -> anyhow::Result<()> {
    let run =
        |rep: u64, p99: f64| -> anyhow::Result<CompareRun> { Ok(serde_json::from_value(compare_run("mix", "x", rep, p99, 0.5, 0.4))?) };
    let (a, b) = ([run(0, 100.0)?, run(1, 100.0)?], [run(0, 50.0)?, run(1, 50.0)?]);
    let pairs = paired_ttfts(&a, &b).unwrap_or_default();
    assert_eq!(pairs.len(), 20);
    assert_eq!(pairs[0], (10.0, 5.0));
    // Another seed is another schedule; a lost request shifts the order.
    let mut lost = b.clone();
    lost[0].seed = 9;
    lost[1].summary.ok = 9;
    assert_eq!(paired_ttfts(&a, &lost), None);
    lost[1].summary.ok = 10;
    assert_eq!(paired_ttfts(&a, &lost).map(|p| p.len()), Some(10));
    Ok(())
}

#[test]
fn the_paired_interval_sees_a_constant_difference_whatever_the_requests() {
    // Requests from 1 ms to 10 s, each 5 ms slower under the first: every
    // resample's p99s differ by 5, however different the requests drawn.
    let pairs: Vec<(f64, f64)> = (0..300).map(|i| (f64::from(i * i) / 9.0 + 5.0, f64::from(i * i) / 9.0)).collect();
    let p = paired_p99(&pairs);
    assert_eq!((p.requests, p.difference, p.median_request), (300, 5.0, 5.0));
    assert!((p.low - 5.0).abs() < 1e-9 && (p.high - 5.0).abs() < 1e-9, "{p:?}");
    // Unpaired noise widens it: the first is faster on odd requests, slower on even ones.
    let noisy: Vec<(f64, f64)> =
        pairs.iter().enumerate().map(|(i, &(a, b))| if i % 2 == 0 { (a + 20.0, b) } else { (b - 20.0, b) }).collect();
    let p = paired_p99(&noisy);
    assert!(p.low < 0.0 && p.high > 0.0, "{p:?}");
}

#[test]
fn issue_39s_checks_read_the_mixed_fleet_the_agent_steps_by_mode_and_the_reuse_fleet() -> anyhow::Result<()> {
    let args = fixtures("reuse", 1000.0, 1.0)?;
    let dir = args.out_dir.parent().unwrap_or(&args.out_dir).to_path_buf();
    let mixed = |contender: &str, rate: f64| -> anyhow::Result<()> {
        write(&dir.join(format!("mixed/capacity-mix-{}.json", contender.replace(':', "-"))), &real_capacity("mix", contender, rate))
    };
    mixed("cost_model", 3.0)?;
    mixed("least_request", 2.0)?;
    mixed("vllm-router:cache_aware", 2.5)?;
    // Approximate mode in the comparison: 10 of 10 steps exact; exact mode kept for predictions alone: 998 of 1000.
    write(&args.routing[0].join("agent-cost_model-rep0.json"), &compare_run("agent", "cost_model", 0, 100.0, 0.9, 0.3))?;
    let mut exact = compare_run("agent", "cost_model", 0, 100.0, 0.9, 0.3);
    exact["command"] = json!("inferrail-bench compare --kv-events --workloads agent");
    exact["summary"]["prediction"] = json!({"compared": 1000, "exact": 998, "over": 1, "under": 1});
    write(&dir.join("agent-exact/agent-cost_model-rep0.json"), &exact)?;
    // Agent loops on 4 and 16 replicas in one file, 64 on the same seed in another.
    let search = |sizes: &[(usize, f64, f64, f64)]| {
        let policy = |k: usize, name: &str| {
            let caps: Vec<Value> = sizes.iter().map(|s| json!({"replicas": s.0, "rate": ([s.1, s.2, s.3][k])})).collect();
            json!([name, caps])
        };
        json!({
            "benchmark": "fleet-simulation", "commit": "def5678", "command": "inferrail-bench fleet --capacity --workload agent",
            "workload": {"workload": "agent"}, "seed": 1, "slo_ttft_ms": 2000.0,
            "capacity": [policy(0, "cost_model"), policy(1, "round_robin"), policy(2, "gie_default")], "fixed_rate": null, "replicas_needed": []
        })
    };
    write(&args.fleet_reuse[0], &search(&[(4, 10.0, 8.0, 12.5), (16, 50.0, 40.0, 45.0)]))?;
    let mut args = args;
    // The comparison's folder among them too: its run counts once.
    args.predictions.push(args.routing[0].clone());
    args.fleet_reuse.push(dir.join("fleet-reuse/capacity-agent-64-seed1.json"));
    write(&args.fleet_reuse[1], &search(&[(64, 200.0, 100.0, 160.0)]))?;
    let failed = render(&args)?;
    let md = std::fs::read_to_string(args.out_dir.join("report.md"))?;
    let row = |needle: &str| md.lines().find(|l| l.contains(needle)).unwrap_or_default().to_owned();
    let mix = row("on a mixed fleet of real simulators, cost_model's capacity at the SLO on mix");
    assert!(
        mix.contains(
            "| 3 req/s on 3 simulators: 1.50x least_request (2 req/s), 1.20x the best peer, vllm-router:cache_aware (2.5 req/s) | pass |"
        ),
        "{mix}"
    );
    assert!(row("on a mixed fleet of real simulators, cost_model's capacity at the SLO on w1").ends_with("| not measured |"), "{md}");
    assert!(row("approximate mode: cost_model's predicted").ends_with("| 100.0% (10 of 10) | pass |"), "{md}");
    assert!(row("exact mode (KV events): cost_model's predicted").ends_with("| 99.8% (998 of 1000) | **FAIL** |"), "{md}");
    let agent = row("fleet simulation: cost_model's capacity at the SLO on agent");
    assert!(
        agent.contains("at 4: 1.25x round_robin, 0.80x gie_default (the best other); at 16: 1.25x round_robin, 1.11x gie_default (the best other); at 64: 2.00x round_robin, 1.25x gie_default (the best other) | **FAIL** |"),
        "{agent}"
    );
    assert!(row("fleet simulation: cost_model's capacity at the SLO on rag").ends_with("| not measured |"), "{md}");
    assert_eq!(failed.len(), 2, "{failed:?}");
    // Their sections, with a chart each; against the best cache-blind policy on the mixed fleet.
    assert!(
        md.contains("## Capacity at the SLO on a mixed fleet of real simulators")
            && md.contains("| cost_model | mix | 3 | 3 | 1.50x least_request |"),
        "{md}"
    );
    assert!(
        md.contains("## Fleet simulation: reuse patterns")
            && md.contains("| cost_model | 10.00 (1.25x rr) | 50.00 (1.25x rr) | 200.00 (2.00x rr) |"),
        "{md}"
    );
    for png in ["mixed-capacity.png", "fleet-capacity-reuse.png"] {
        assert!(md.contains(&format!("]({png})")), "{png}");
        assert_eq!(png_size(&std::fs::read(args.out_dir.join(png))?)?, charts::SIZE, "{png}");
    }
    // One seed may be searched on other replica counts in another file, not on the same ones.
    write(&dir.join("fleet-reuse/again.json"), &search(&[(16, 1.0, 1.0, 1.0)]))?;
    args.fleet_reuse.push(dir.join("fleet-reuse/again.json"));
    assert!(render(&args).is_err());
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
