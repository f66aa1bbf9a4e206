//! Reading one engine's metrics page, which the scraper does ten times a
//! second per replica: the recorded vLLM 0.32.0 page under load (60 KB,
//! about 600 lines, of which the router reads six families).
#![allow(missing_docs, clippy::unwrap_used)]

use criterion::{Criterion, criterion_group, criterion_main};
use inferrail_load::page::parse;

const VLLM_LOADED: &str = include_str!("../../../sim/tests/fixtures/vllm-0.32.0/metrics-under-load.txt");

fn page(c: &mut Criterion) {
    assert_eq!(parse(VLLM_LOADED).unwrap().running, 4);
    c.bench_function("recorded vLLM page parsed", |b| b.iter(|| parse(std::hint::black_box(VLLM_LOADED)).unwrap()));
}

criterion_group!(benches, page);
criterion_main!(benches);
