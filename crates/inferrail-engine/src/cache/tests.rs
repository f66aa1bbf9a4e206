//! The pool against a naive model: a vector in LRU order and linear scans.

use super::*;
use proptest::prelude::*;

/// The same rules, written as plainly as possible.
#[derive(Debug, Default)]
struct Naive {
    refs: Vec<u32>,
    hash: Vec<Option<BlockHash>>,
    queue: Vec<BlockId>,
    evicted: Vec<BlockHash>,
    /// Blocks caching a prefix, in the order they cached it.
    order: Vec<BlockId>,
}

impl Naive {
    fn new(n: usize) -> Self {
        Self { refs: vec![0; n], hash: vec![None; n], queue: (0..n as u32).collect(), evicted: Vec::new(), order: Vec::new() }
    }
    /// The copy cached first.
    fn find(&self, h: BlockHash) -> Option<BlockId> {
        self.order.iter().copied().find(|&b| self.hash[b as usize] == Some(h))
    }
    fn lookup(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        hashes.iter().map_while(|&h| self.find(h)).collect()
    }
    fn touch(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            self.queue.retain(|&q| q != b);
            self.refs[b as usize] += 1;
        }
    }
    fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.queue.len() {
            return None;
        }
        let taken: Vec<BlockId> = self.queue.drain(..n).collect();
        for &b in &taken {
            self.refs[b as usize] = 1;
            self.evicted.extend(self.hash[b as usize].take());
            self.order.retain(|&o| o != b);
        }
        Some(taken)
    }
    fn register(&mut self, b: BlockId, h: BlockHash) {
        if self.hash[b as usize].is_none() {
            self.hash[b as usize] = Some(h);
            self.order.push(b);
        }
    }
    fn release(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            self.refs[b as usize] = self.refs[b as usize].saturating_sub(1);
            if self.refs[b as usize] == 0 {
                // A block that caches nothing is reused first.
                if self.hash[b as usize].is_some() { self.queue.push(b) } else { self.queue.insert(0, b) }
            }
        }
    }
    fn reset(&mut self) -> Option<usize> {
        if self.refs.iter().any(|&r| r > 0) {
            return None;
        }
        let n = self.hash.iter().filter(|h| h.is_some()).count();
        self.hash.iter_mut().for_each(|h| *h = None);
        self.order.clear();
        Some(n)
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// A sequence over prompt `prefix` of a shared family, `len` full
    /// blocks long, and a partial last block (never cached) when `partial`.
    Start {
        family: u8,
        len: usize,
        partial: bool,
    },
    /// Finish the `i`-th live sequence.
    Finish(usize),
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..4, 1usize..8, any::<bool>()).prop_map(|(family, len, partial)| Op::Start { family, len, partial }),
        4 => (0usize..16).prop_map(Op::Finish),
        1 => Just(Op::Reset),
    ]
}

proptest! {
    #[test]
    fn pool_behaves_like_the_naive_model(ops in proptest::collection::vec(op(), 1..200), cap in 1usize..24) {
        let mut pool = BlockPool::new(cap);
        pool.log_evictions();
        let mut naive = Naive::new(cap);
        let mut live: Vec<Vec<BlockId>> = Vec::new();
        for op in ops {
            match op {
                Op::Start { family, len, partial } => {
                    // Hashes of a chain: family f, block k is named (f, k), so
                    // sequences of one family share a prefix.
                    let hashes: Vec<BlockHash> = (0..len).map(|k| (u128::from(family) << 64) | k as u128).collect();
                    let hit = pool.lookup(&hashes);
                    prop_assert_eq!(&hit, &naive.lookup(&hashes));
                    let new = len - hit.len() + usize::from(partial);
                    if new + pool.count_free(&hit) > pool.num_free() { continue; }
                    pool.touch(&hit);
                    naive.touch(&hit);
                    let fresh = pool.allocate(new);
                    prop_assert_eq!(&fresh, &naive.allocate(new));
                    prop_assert_eq!(pool.take_evicted(), std::mem::take(&mut naive.evicted));
                    let blocks: Vec<BlockId> = hit.iter().copied().chain(fresh.unwrap_or_default()).collect();
                    for (k, &b) in blocks.iter().enumerate().take(len) {
                        let before = naive.hash[b as usize].is_none();
                        naive.register(b, hashes[k]);
                        prop_assert_eq!(pool.register(b, hashes[k]), before);
                    }
                    live.push(blocks);
                }
                Op::Finish(i) => {
                    if live.is_empty() { continue; }
                    let blocks = live.remove(i % live.len());
                    let rev: Vec<BlockId> = blocks.into_iter().rev().collect();
                    pool.release(rev.iter().copied());
                    naive.release(&rev);
                }
                Op::Reset => {
                    prop_assert_eq!(pool.reset(), naive.reset());
                }
            }
            prop_assert_eq!(pool.num_free(), naive.queue.len());
            // The same free queue: the next allocation of everything takes the same blocks in the same order.
            let mut probe = pool.clone();
            prop_assert_eq!(probe.allocate(probe.num_free()), Some(naive.queue.clone()));
            prop_assert_eq!(pool.num_cached(), naive.hash.iter().filter(|h| h.is_some()).count());
        }
    }
}

#[test]
fn a_long_prefix_is_evicted_from_its_tail() {
    let mut pool = BlockPool::new(4);
    let blocks = pool.allocate(4).unwrap_or_default();
    for (k, &b) in blocks.iter().enumerate() {
        pool.register(b, k as u128);
    }
    pool.release(blocks.iter().rev().copied());
    // One new block evicts the last block of the prefix; the first three stay.
    let _ = pool.allocate(1);
    assert_eq!(pool.lookup(&[0, 1, 2, 3]).len(), 3);
}

#[test]
fn a_hit_on_a_free_block_protects_it_from_eviction() {
    let mut pool = BlockPool::new(2);
    let a = pool.allocate(1).unwrap_or_default();
    pool.register(a[0], 7);
    pool.release(a.clone());
    let hit = pool.lookup(&[7]);
    pool.touch(&hit);
    assert_eq!(pool.allocate(2), None);
    assert_eq!(pool.allocate(1).map(|v| v.len()), Some(1));
    assert_eq!(pool.lookup(&[7]), a);
}

#[test]
fn a_block_computed_twice_is_cached_twice_and_its_prefix_outlives_it() {
    // Two sequences compute blocks 0 and 0,1 in one step: each caches its
    // copy of block 0 (vLLM does), so when the shorter one's copy is evicted
    // block 1's prefix is still cached.
    let mut pool = BlockPool::new(4);
    pool.log_evictions();
    let short = pool.allocate(1).unwrap_or_default();
    let long = pool.allocate(2).unwrap_or_default();
    assert!(pool.register(short[0], 10));
    assert!(pool.register(long[0], 10), "a second copy");
    assert!(pool.register(long[1], 11));
    assert_eq!(pool.num_cached(), 3);
    assert_eq!(pool.lookup(&[10, 11]), [short[0], long[1]], "a hit takes the copy cached first");
    pool.release(short.iter().copied());
    let _ = pool.allocate(2);
    assert_eq!(pool.take_evicted(), [10], "one copy evicted");
    assert_eq!(pool.lookup(&[10, 11]), [long[0], long[1]], "the prefix stays cached in the other");
}
