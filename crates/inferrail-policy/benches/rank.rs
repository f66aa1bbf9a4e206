//! Decision time per policy over plain candidates: eligibility, guards,
//! scores and order (no index lookup; `inferrail-route`'s benchmark has the
//! whole decision).
#![allow(missing_docs)]

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use inferrail_policy::{ALL, Candidate, Offloaded, Params, Request, build, decide};
use rand::SeedableRng;
use rand::rngs::StdRng;

fn fleet(n: usize) -> Vec<Candidate> {
    (0..n)
        .map(|i| Candidate {
            key: i as u64 * 0x9e37_79b9_7f4a_7c15,
            in_flight: (i * 7 % 13) as u32,
            pending: (i % 3) as u32,
            max_concurrency: 256,
            max_pending: 64,
            healthy: i % 17 != 5,
            cached_tokens: (i * 997) % 8_000,
            held_cached_tokens: 0,
            queued_prefill_secs: (i % 5) as f64 * 0.1,
            prefill: None,
            prompt_tokens_in_flight: (i * 311 % 5_000) as u64,
            kv_capacity_tokens: 0,
            unreported_kv_tokens: 0,
            engine: None,
            own: None,
            adapter: None,
            // Every fourth replica holds the next 512 tokens in host memory.
            offloaded: Offloaded { host: if i % 4 == 0 { 512 } else { 0 }, disk: 0 },
        })
        .collect()
}

fn rank(c: &mut Criterion) {
    let mut group = c.benchmark_group("decide");
    let blocks: Vec<u128> = (0..500).collect();
    let req = Request { prompt_tokens: Some(8_000), blocks: &blocks, block_size: 16, ..Request::default() };
    for n in [3usize, 16, 64] {
        let candidates = fleet(n);
        for kind in ALL {
            let policy = build(kind, &Params::default());
            let mut rng = StdRng::seed_from_u64(1);
            group.bench_with_input(BenchmarkId::new(policy.name(), n), &candidates, |b, c| {
                b.iter(|| std::hint::black_box(decide(policy.as_ref(), &req, c, &mut rng)))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, rank);
criterion_main!(benches);
