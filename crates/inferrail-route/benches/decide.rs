//! The whole decision core on an 8,000-token prompt: `plan` (index lookup
//! for every candidate, guards, scores, order) with `cost_model`, over 8, 64
//! and 256 replicas, a quarter of which hold the prompt's first half; and
//! `prepare` (cutting the prompt into block hashes) apart; and `decide`
//! (plan and commit, the lease released) at 64 replicas with and without a
//! `kv_aware` shadow policy, for what shadow mode adds. Prints the p50 and
//! p99 of 20,000 timed plans besides criterion's means.
#![allow(missing_docs, clippy::expect_used)]

use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use inferrail_config::Config;
use inferrail_route::fleet::{Fleet, Replica};
use inferrail_route::kv::{Place, Prediction, Prompt};
use inferrail_route::{Core, Report, Share, View};
use std::sync::Arc;

fn setup(n: usize) -> (Core, Arc<Fleet>, Prompt) {
    setup_with(n, "")
}

/// `n` replicas, the model's YAML fields besides its name and policy in `more`.
fn setup_with(n: usize, more: &str) -> (Core, Arc<Fleet>, Prompt) {
    let mut yaml = format!("models:\n  - {{name: m, policy: cost_model{more}}}\nreplicas:\n");
    for i in 0..n {
        yaml += &format!("  - {{id: r{i}, address: '10.0.{}.{}:8000', models: [m]}}\n", i / 250, i % 250);
    }
    let config = Config::parse(&yaml).expect("config");
    let core = Core::new(&config).expect("core");
    let replicas: Vec<Arc<Replica>> = config
        .replicas
        .iter()
        .map(|r| {
            Arc::new(Replica::new(
                r.id.clone(),
                r.address.parse().expect("addr"),
                vec![0],
                r.serving.limits(),
                r.serving.cache(),
                core.kv.slot(&r.id),
            ))
        })
        .collect();
    for r in &replicas {
        core.join(r);
    }
    let fleet = Arc::new(Fleet::new(replicas, 1));
    let prompt = Prompt { ids: (0..8_000).collect(), max_tokens: Some(64), cache_salt: None, adapter: None, special_at: Vec::new() };
    let half = core.prepare(0, &Prompt { ids: (0..4_000).collect(), ..prompt.clone() }, &fleet);
    for r in fleet.replicas.iter().step_by(4) {
        core.kv.record(&half, Place { slot: r.slot, block_size: 16, lookahead: 0 });
    }
    (core, fleet, prompt)
}

fn percentiles(name: &str, mut f: impl FnMut()) {
    let mut times: Vec<u128> = (0..20_000)
        .map(|_| {
            let start = std::time::Instant::now();
            f();
            start.elapsed().as_nanos()
        })
        .collect();
    times.sort_unstable();
    let at = |q: usize| times[times.len() * q / 1000];
    println!("{name}: p50 {} ns, p90 {} ns, p99 {} ns, p99.9 {} ns", at(500), at(900), at(990), at(999));
}

/// A request's view of the whole fleet, alone on it.
fn whole(prediction: Arc<Prediction>) -> View<'static> {
    View { model: 0, prediction: Some(prediction), session: None, text: None, subset: None, share: Share::ALONE, replica_share: 1.0 }
}

fn decide(c: &mut Criterion) {
    let mut group = c.benchmark_group("cost_model_8k");
    for n in [8usize, 64, 256] {
        let (core, fleet, prompt) = setup(n);
        let prediction = core.prepare(0, &prompt, &fleet);
        let view = whole(prediction);
        let reports = |_: &Replica| None::<Report>;
        let plan = || std::hint::black_box(core.plan(&view, &fleet, &reports, Duration::from_secs(1)).expect("plan"));
        percentiles(&format!("plan/{n}"), || {
            plan();
        });
        group.bench_function(format!("plan/{n}"), |b| b.iter(plan));
    }
    let (core, fleet, prompt) = setup(8);
    group.bench_function("prepare", |b| b.iter(|| std::hint::black_box(core.prepare(0, &prompt, &fleet))));
    for (name, more) in [("decide/64", ""), ("decide+shadow/64", ", shadow_policy: kv_aware")] {
        let (core, fleet, prompt) = setup_with(64, more);
        let prediction = core.prepare(0, &prompt, &fleet);
        let view = whole(prediction);
        let reports = |_: &Replica| None::<Report>;
        let decide = || {
            let (plan, committed) = core.decide(&view, &fleet, &reports, Duration::from_secs(1)).expect("decide");
            committed.lease.release();
            std::hint::black_box(plan);
        };
        percentiles(name, &decide);
        group.bench_function(name, |b| b.iter(&decide));
    }
    group.finish();
}

criterion_group!(benches, decide);
criterion_main!(benches);
