//! The whole decision core on an 8,000-token prompt: `plan` (index lookup
//! for every candidate, guards, scores, order) with `cost_model`, over 8, 64
//! and 256 replicas, a quarter of which hold the prompt's first half; and
//! `prepare` (cutting the prompt into block hashes) apart; and `decide`
//! (plan and commit, the lease released) at 64 replicas with and without a
//! `kv_aware` shadow policy, for what shadow mode adds; and over 64 and 256
//! replicas in exact mode, `plan+exact` (a quarter hold the first half on
//! the GPU, as their events said) and `plan+host` with host memory tiers
//! besides (ADR 0059): those hold the next quarter in host memory, every
//! host tier is full of other blocks, and requests sent and not yet
//! admitted will store more there. Prints the p50 and p99 of 20,000 timed
//! plans besides criterion's means.
#![allow(missing_docs, clippy::expect_used)]

use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use inferrail_config::Config;
use inferrail_kv::index::{Event, Stored, Tier};
use inferrail_route::fleet::{Fleet, Replica};
use inferrail_route::kv::{Place, Prediction, Prompt, seed};
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
        core.kv.record(&half, Place { slot: r.slot, block_size: 16, lookahead: 0, adapter_ahead: None });
    }
    (core, fleet, prompt)
}

/// The same fleet in exact mode, with host tiers of 2,048 blocks when
/// `host`, as the engines' events would fill them; see the module doc.
fn setup_exact(n: usize, host: bool) -> (Core, Arc<Fleet>, Prompt) {
    let (core, fleet, prompt) = setup_with(n, "");
    let index = core.kv.index();
    let chain = seed("m", None);
    let stored = |slot, ids: &[u32], first: u32, parent: Option<u64>, tier| {
        let blocks = ids.len() / 16;
        let hashes: Vec<u64> = (0..blocks as u64).map(|k| (u64::from(first) << 20) + k).collect();
        let event = Event::Stored(Stored { hashes: &hashes, parent, tokens: &ids[..blocks * 16], block_size: 16, seed: chain, tier });
        index.apply(slot, &event).expect("event");
    };
    for (i, r) in fleet.replicas.iter().enumerate() {
        index.set_host(r.slot, host.then_some(2_048));
        assert!(index.enter_exact(r.slot, 16));
        // Other prompts fill most of the host tier.
        let filler: Vec<u32> = (0..1_600 * 16).map(|t| 1_000_000 + t).collect();
        if host {
            stored(r.slot, &filler, 1, None, Tier::HOST);
        }
        if i % 4 == 0 {
            stored(r.slot, &prompt.ids[..4_000], 2, None, Tier::ROUTING);
            if host {
                stored(r.slot, &prompt.ids[..6_000], 3, None, Tier::HOST);
            }
        }
        // Requests sent and not yet admitted: each will store 64 blocks there.
        for k in 0..4u32 {
            let other = Prompt { ids: (0..1_024).map(|t| 2_000_000 + k * 10_000 + t).collect(), ..prompt.clone() };
            core.kv.record(&core.prepare(0, &other, &fleet), Place { slot: r.slot, block_size: 16, lookahead: 0, adapter_ahead: None });
        }
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
    for (name, host) in [("plan+exact", false), ("plan+host", true)] {
        for n in [64usize, 256] {
            let (core, fleet, prompt) = setup_exact(n, host);
            let prediction = core.prepare(0, &prompt, &fleet);
            let view = whole(prediction);
            let reports = |_: &Replica| None::<Report>;
            let plan = core.plan(&view, &fleet, &reports, Duration::from_secs(1)).expect("plan");
            let held = if host { 2_000 } else { 0 };
            assert!(plan.candidates.iter().step_by(4).all(|c| c.cached_tokens == 4_000 && c.offloaded.host == held), "the tiers are seen");
            let plan = || std::hint::black_box(core.plan(&view, &fleet, &reports, Duration::from_secs(1)).expect("plan"));
            percentiles(&format!("{name}/{n}"), || {
                plan();
            });
            group.bench_function(format!("{name}/{n}"), |b| b.iter(plan));
        }
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
