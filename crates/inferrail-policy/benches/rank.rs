//! Decision time per policy: eligibility plus ranking over a fleet.
#![allow(missing_docs)]

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use inferrail_policy::{PolicyKind, ReplicaLoad, build, eligible};

fn fleet(n: usize) -> Vec<ReplicaLoad> {
    (0..n)
        .map(|i| ReplicaLoad {
            in_flight: (i * 7 % 13) as u32,
            pending: (i % 3) as u32,
            max_concurrency: 256,
            max_pending: 64,
            healthy: i % 17 != 5,
        })
        .collect()
}

fn rank(c: &mut Criterion) {
    let mut group = c.benchmark_group("decide");
    for n in [3usize, 16, 64] {
        let replicas = fleet(n);
        for kind in [PolicyKind::RoundRobin, PolicyKind::Random, PolicyKind::LeastRequest, PolicyKind::P2c] {
            let policy = build(kind, 1);
            group.bench_with_input(BenchmarkId::new(policy.name(), n), &replicas, |b, r| {
                b.iter(|| {
                    let candidates = eligible(r).unwrap_or_default();
                    std::hint::black_box(policy.rank(r, candidates))
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, rank);
criterion_main!(benches);
