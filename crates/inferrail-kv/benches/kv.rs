//! Block hashing and index lookups at the sizes the router meets.
#![allow(missing_docs)]
// A bench whose events do not apply measures nothing: it stops.
#![allow(clippy::expect_used)]

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group};
use inferrail_kv::hash::block_hashes;
use inferrail_kv::index::{Event, KvIndex, Stored, Tier};

fn hashing(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..8192u32).map(|t| t.wrapping_mul(2_654_435_761) % 151_936).collect();
    let mut g = c.benchmark_group("hash");
    g.throughput(Throughput::Elements((tokens.len() / 16) as u64));
    g.bench_function("8192 tokens, 16-token blocks", |b| b.iter(|| block_hashes(7, std::hint::black_box(&tokens), 16)));
    g.finish();
}

fn lookup(c: &mut Criterion) {
    let index = KvIndex::new();
    let slots: Vec<u32> = (0..64).collect();
    let prompt: Vec<u128> = (0..512u128).collect();
    for &s in &slots {
        index.add_replica(s, 4096);
        // Every replica holds a different share of the prompt's prefix.
        let held = &prompt[..(s as usize * 8).min(512)];
        index.complete(&index.record(s, held, held.len(), 0, 0, false, None), Duration::ZERO);
    }
    percentiles("lookup 512 blocks over 64 replicas", || index.matched(std::hint::black_box(&prompt), &slots));
    c.bench_function("lookup 512 blocks over 64 replicas", |b| b.iter(|| index.matched(std::hint::black_box(&prompt), &slots)));
    // The common shape: most replicas hold a shared system prompt, a few a conversation, some nothing.
    let shared = KvIndex::new();
    for &s in &slots {
        shared.add_replica(s, 4096);
        let held = &prompt[..[0, 128, 128, 128, 128, 128, 300, 512][s as usize % 8]];
        shared.complete(&shared.record(s, held, held.len(), 0, 0, false, None), Duration::ZERO);
    }
    percentiles("lookup 512 blocks over 64 replicas at 4 depths", || shared.matched(std::hint::black_box(&prompt), &slots));
    c.bench_function("lookup 512 blocks over 64 replicas at 4 depths", |b| {
        b.iter(|| shared.matched(std::hint::black_box(&prompt), &slots))
    });
    c.bench_function("record and complete 512 blocks", |b| {
        let mut n = 0u128;
        b.iter(|| {
            n += 1;
            let fresh: Vec<u128> = (0..512u128).map(|k| (n << 64) | k).collect();
            index.complete(&index.record(3, &fresh, fresh.len(), 0, 0, false, None), Duration::ZERO)
        })
    });
}

/// The overhead ladder's long prompts, in approximate mode: each request a
/// new prompt of 2,344 blocks (220 KB of chat, 37,500 tokens) on one of
/// three replicas of 1,048,576 blocks each (the ladder's simulators), full,
/// so every block it adds evicts one; the lookup over all three included.
fn long_prompts(c: &mut Criterion) {
    const BLOCKS: u128 = 2344;
    let index = KvIndex::new();
    for s in 0..3 {
        index.add_replica(s, 1 << 20);
    }
    let mut n = 0u128;
    let mut request = move || {
        n += 1;
        let prompt: Vec<u128> = (0..BLOCKS).map(|k| (n << 64) | k).collect();
        let slot = (n % 3) as u32;
        std::hint::black_box(index.matched(&prompt, &[0, 1, 2]));
        index.complete(&index.record(slot, &prompt, prompt.len(), 0, 1, false, None), Duration::ZERO);
    };
    // Enough to fill every replica.
    for _ in 0..3 * (1 << 20) / BLOCKS + 3 {
        request();
    }
    let mut g = c.benchmark_group("long prompts");
    g.throughput(Throughput::Elements(BLOCKS as u64));
    g.bench_function("look up, record and complete 2,344 new blocks on full 1,048,576-block replicas", |b| b.iter(&mut request));
    g.finish();
}

/// The median and 99th percentile of 100,000 timed calls (criterion reports
/// means and medians; the lookup's target is a p99). Each time includes a
/// clock read, tens of nanoseconds.
fn percentiles<T>(name: &str, mut f: impl FnMut() -> T) {
    for _ in 0..10_000 {
        std::hint::black_box(f());
    }
    let mut times: Vec<u128> = (0..100_000)
        .map(|_| {
            let start = std::time::Instant::now();
            std::hint::black_box(f());
            start.elapsed().as_nanos()
        })
        .collect();
    times.sort_unstable();
    println!("{name}: p50 {} ns, p99 {} ns", times[times.len() / 2], times[times.len() * 99 / 100]);
}

/// Resident memory of this process, bytes (Linux).
fn rss() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    statm.split_whitespace().nth(1).and_then(|p| p.parse::<usize>().ok()).unwrap_or(0) * 4096
}

/// Index memory per block held: 64 replicas with 16,384-block caches, filled
/// with 1,024-block prompts that share their first 256 blocks.
fn memory() {
    let before = rss();
    let index = KvIndex::new();
    let (replicas, capacity) = (64u32, 16_384usize);
    for s in 0..replicas {
        index.add_replica(s, capacity);
        for p in 0..16u128 {
            let prompt: Vec<u128> = (0..1024u128).map(|k| if k < 256 { k } else { ((u128::from(s) * 16 + p + 1) << 64) | k }).collect();
            index.complete(&index.record(s, &prompt, prompt.len(), 0, 0, false, None), Duration::ZERO);
        }
    }
    let held = index.entries();
    let per_block = (rss() - before) as f64 / held as f64;
    println!("index memory: {held} blocks held over {replicas} replicas, {per_block:.0} bytes per block");
}

/// Engine events applied on one core: 1,000 prompts of 32 blocks of 32
/// tokens stored (each prompt one `BlockStored`, the first half of them
/// continuing a shared 8-block prefix) and then removed tail first, as an
/// engine evicts, one `BlockRemoved` a prompt; throughput counts blocks.
fn events(c: &mut Criterion) {
    const BS: usize = 32;
    let index = KvIndex::new();
    index.add_replica(0, 1 << 20);
    for s in 1..64 {
        index.add_replica(s, 4096);
    }
    let shared: Vec<u32> = (0..(8 * BS) as u32).collect();
    let shared_hashes: Vec<u64> = (0..8).map(|b| 0xfeed_0000 + b).collect();
    let prompts: Vec<(Vec<u64>, Option<u64>, Vec<u32>)> = (0..1000u64)
        .map(|p| {
            let tokens: Vec<u32> = (0..(32 * BS) as u32).map(|t| t.wrapping_mul(2_654_435_761) ^ p as u32).collect();
            // Engine hashes are the low 64 bits of a SHA-256: uniform.
            let hashes: Vec<u64> = (0..32).map(|b| xxhash_rust::xxh3::xxh3_64(&((p << 32) | b).to_le_bytes())).collect();
            (hashes, (p % 2 == 0).then_some(shared_hashes[7]), tokens)
        })
        .collect();
    let removals: Vec<Vec<u64>> = prompts.iter().map(|(h, _, _)| h.iter().rev().copied().collect()).collect();
    let blocks = prompts.iter().map(|(h, _, _)| h.len()).sum::<usize>() * 2;
    let stored = |hashes: &'static [u64], parent, tokens: &'static [u32]| {
        Event::Stored(Stored { hashes, parent, tokens, block_size: BS, seed: 7, tier: Tier::ROUTING })
    };
    let (shared, shared_hashes): (&'static [u32], &'static [u64]) = (shared.leak(), shared_hashes.leak());
    let prompts: &'static [(Vec<u64>, Option<u64>, Vec<u32>)] = prompts.leak();
    let mut g = c.benchmark_group("events");
    g.throughput(Throughput::Elements(blocks as u64));
    g.bench_function("store and remove 64,000 blocks", |b| {
        b.iter(|| {
            index.enter_exact(0, BS);
            index.apply(0, &stored(shared_hashes, None, shared)).expect("applies");
            for (hashes, parent, tokens) in prompts {
                index.apply(0, &stored(hashes, *parent, tokens)).expect("applies");
            }
            for r in &removals {
                index.apply(0, &Event::Removed { hashes: r, tier: Tier::ROUTING }).expect("applies");
            }
        })
    });
    g.finish();
}

/// A request sent to an exact replica whose 16,384-block cache is full of
/// blocks nobody claims (64 prompts of 256 blocks, freed one after another):
/// its 512 new blocks make the 513 least recently freed ones absent, and
/// its end brings them back (ADR 0020). One iteration claims and ends it.
fn in_flight(c: &mut Criterion) {
    const BS: usize = 16;
    let index = KvIndex::new();
    index.add_replica(0, 1 << 14);
    index.enter_exact(0, BS);
    // The tokens of prompt `p`, 256 blocks.
    let prompt = |p: u32| -> Vec<u32> { (0..(256 * BS) as u32).map(|t| t.wrapping_mul(2_654_435_761) ^ (p << 20)).collect() };
    for p in 0..64u32 {
        let tokens = prompt(p);
        let router = block_hashes(7, &tokens, BS);
        let hashes: Vec<u64> = router.iter().map(|&h| h as u64).collect();
        let rec = index.record(0, &router, router.len(), 0, 1, false, None);
        index
            .apply(
                0,
                &Event::Stored(Stored { hashes: &hashes, parent: None, tokens: &tokens, block_size: BS, seed: 7, tier: Tier::ROUTING }),
            )
            .expect("applies");
        index.end_claim(&rec);
    }
    let fresh: Vec<u32> = (0..(512 * BS) as u32).map(|t| t.wrapping_mul(2_246_822_519)).collect();
    let fresh = block_hashes(7, &fresh, BS);
    let held = block_hashes(7, &prompt(0), BS);
    assert_eq!(index.matched(&held, &[0]), [256], "the first prompt is held");
    let rec = index.record(0, &fresh, fresh.len(), 0, 1, false, None);
    assert_eq!(index.matched(&held, &[0]), [0], "the first prompt, freed first, would be evicted");
    index.end_claim(&rec);
    let mut g = c.benchmark_group("events");
    g.bench_function("claim and end 512 blocks on a full 16,384-block cache", |b| {
        b.iter(|| {
            let rec = index.record(0, std::hint::black_box(&fresh), fresh.len(), 0, 1, false, None);
            index.end_claim(&rec);
        })
    });
    g.finish();
}

/// A request sent to an approximate replica with a queue (ADR 0050): a
/// 4,096-block cache, a running request holding 3,584 blocks, 8 requests
/// of 512 blocks waiting behind it, and 2,048 blocks of earlier prompts
/// it evicted on paper. One iteration records a ninth request (it queues,
/// and the forecast is redone) and takes it back (redone again); beside
/// it, the same on a replica with no queue, where the forecast is skipped.
fn queue(c: &mut Criterion) {
    let index = KvIndex::new();
    let blocks = |n: u128, len: u128| -> Vec<u128> { (0..len).map(|k| (n << 64) | k).collect() };
    for s in 0..2 {
        index.add_replica(s, 4096);
        for p in 0..4 {
            index.complete(&index.record(s, &blocks(100 + p, 512), 512, 0, 0, false, None), Duration::ZERO);
        }
    }
    let _running = index.record(0, &blocks(1, 3584), 3584, 0, 0, false, None);
    for w in 0..8 {
        index.record(0, &blocks(2 + w, 512), 512, 0, 0, false, None);
    }
    assert_eq!(index.matched(&blocks(100, 512), &[0, 1]), [0, 512], "the queue evicts the earlier prompts on paper");
    let next = blocks(50, 512);
    let mut g = c.benchmark_group("queue");
    g.bench_function("record and take back 512 blocks behind 8 waiting", |b| {
        b.iter(|| index.take_back(&index.record(0, std::hint::black_box(&next), 512, 0, 0, false, None)))
    });
    g.bench_function("record and take back 512 blocks, no queue", |b| {
        b.iter(|| index.take_back(&index.record(1, std::hint::black_box(&next), 512, 0, 0, false, None)))
    });
    g.finish();
}

criterion_group!(benches, hashing, lookup, events, in_flight, long_prompts, queue);

fn main() {
    memory();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
