//! Calibration against the simulator, whose latency model is the cost model:
//! the fit must give back the parameters the simulator was started with.
//!
//! Each simulator runs in this test process on its own port, with real
//! (not paused) time; the simulator stamps its metrics with its planned
//! step times, so the fit is exact up to the metrics page's rounding however
//! loaded the machine is. One test calls the library, the other runs the
//! `inferrail-calibrate` binary as a separate process.
#![allow(missing_docs)]

use std::time::Duration;

use inferrail_calibrate::engine::Engine;
use inferrail_calibrate::fit::{Prefill, fit};
use inferrail_calibrate::plan::{Grid, TokenRange, plan};
use inferrail_calibrate::run::{CachedFrom, RunOptions, TimedBy, run};
use inferrail_sim::Sim;
use inferrail_sim::args::Args;

/// Small enough to finish in a couple of seconds, wide enough to separate a, b and d.
fn grid() -> Grid {
    Grid { cached: vec![0, 1024, 4096], uncached: vec![16, 512, 2048], repeats: 1, warmup: 1 }
}

async fn start_sim(a: f64, b: f64, d: f64, extra: &[&str]) -> Sim {
    let (a, b, d) = (a.to_string(), b.to_string(), d.to_string());
    let mut flags = vec!["--prefill-token-us", &a, "--prefill-pair-ns", &b, "--prefill-fixed-ms", &d, "--max-model-len", "8192"];
    flags.extend_from_slice(extra);
    match Sim::start(Args::for_test(&flags)).await {
        Ok(sim) => sim,
        Err(e) => panic!("simulator did not start: {e:#}"),
    }
}

fn assert_close(got: Prefill, want: Prefill) {
    let pairs = [
        ("a", got.prefill_token_us, want.prefill_token_us),
        ("b", got.prefill_pair_ns, want.prefill_pair_ns),
        ("d", got.prefill_fixed_ms, want.prefill_fixed_ms),
    ];
    for (name, g, w) in pairs {
        assert!((g - w).abs() <= 0.05 * w, "{name}: fitted {g}, simulator has {w} (fit {got:?})");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_recovers_the_default_parameters() {
    let sim = start_sim(100.0, 3.3, 5.0, &["--enable-prompt-tokens-details"]).await;
    let engine = match Engine::connect(&sim.url(), None, Duration::from_secs(30)).await {
        Ok(e) => e,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(engine.max_model_len, 8192);
    let plan = match plan(&grid(), engine.max_model_len, TokenRange::default(), 11) {
        Ok(p) => p,
        Err(e) => panic!("{e}"),
    };
    let mut steps = 0;
    let measurements = match run(&engine, &plan, RunOptions::default(), |_| steps += 1).await {
        Ok(m) => m,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(steps, plan.requests());
    assert_eq!(measurements.len(), 9);
    for m in &measurements {
        assert_eq!(m.timed_by, TimedBy::PrefillHistogram);
        assert_eq!(m.cached_from, CachedFrom::HitsCounter);
        // Every prefix is block-aligned, so the engine found all of it.
        assert_eq!((m.cached_tokens, m.prompt_tokens), (m.planned_cached, m.planned_cached + m.planned_uncached), "{m:?}");
        assert!(m.overhead_secs() > -1e-3, "{m:?}");
    }
    let observations: Vec<_> = measurements.iter().map(|m| m.observation()).collect();
    let fit = match fit(&observations) {
        Ok(f) => f,
        Err(e) => panic!("{e}"),
    };
    eprintln!("defaults: {:?}, rms residual {:.4}%", fit.model, fit.rms_relative() * 100.0);
    assert_close(fit.model, Prefill { prefill_token_us: 100.0, prefill_pair_ns: 3.3, prefill_fixed_ms: 5.0 });
    if let Err(e) = sim.stop().await {
        panic!("{e:#}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_recovers_other_parameters_and_writes_the_fragment() {
    let sim = start_sim(40.0, 1.2, 12.0, &[]).await;
    let out = std::env::temp_dir().join(format!("inferrail-calibrate-test-{}.yaml", std::process::id()));
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_inferrail-calibrate"))
        .args(["--url", &sim.url(), "--seed", "5", "--cached", "0,1024,4096", "--uncached", "16,512,2048", "--repeats", "1"])
        .arg("--out")
        .arg(&out)
        .output()
        .await;
    let output = match output {
        Ok(o) => o,
        Err(e) => panic!("running inferrail-calibrate: {e}"),
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "inferrail-calibrate failed:\n{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    eprintln!("{stdout}");
    let written = std::fs::read_to_string(&out).unwrap_or_else(|e| panic!("reading {}: {e}", out.display()));
    let _ = std::fs::remove_file(&out);
    assert!(stdout.ends_with(&written), "stdout ends with the fragment");
    let yaml: serde_yaml::Value = serde_yaml::from_str(&written).unwrap_or_else(|e| panic!("{e}: {written}"));
    let key = |k: &str| yaml["prefill"][k].as_f64().unwrap_or_else(|| panic!("no prefill.{k} in {written}"));
    let got = Prefill {
        prefill_token_us: key("prefill_token_us"),
        prefill_pair_ns: key("prefill_pair_ns"),
        prefill_fixed_ms: key("prefill_fixed_ms"),
    };
    assert_close(got, Prefill { prefill_token_us: 40.0, prefill_pair_ns: 1.2, prefill_fixed_ms: 12.0 });
    if let Err(e) = sim.stop().await {
        panic!("{e:#}");
    }
}
