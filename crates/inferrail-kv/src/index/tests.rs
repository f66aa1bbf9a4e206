//! The index against a naive model: per replica, a vector in LRU order.

use super::*;
use proptest::prelude::*;

#[derive(Debug, Default)]
struct Naive {
    /// slot -> (capacity, blocks, most recent last)
    replicas: HashMap<Slot, (usize, Vec<BlockHash>)>,
}

impl Naive {
    /// The engine's layout, spelled out on a vector: placeholders are `None`-like keys from a counter.
    fn record(&mut self, slot: Slot, prompt: &[BlockHash], reusable: usize, extra: usize, next: &mut u128) -> Vec<BlockHash> {
        let Some((cap, blocks)) = self.replicas.get_mut(&slot) else { return Vec::new() };
        let to_back = |blocks: &mut Vec<BlockHash>, h: BlockHash| {
            if let Some(i) = blocks.iter().position(|&b| b == h) {
                blocks.remove(i);
                blocks.push(h);
            }
        };
        let hits = prompt[..reusable.min(prompt.len())].iter().take_while(|h| blocks.contains(h)).count();
        for &h in &prompt[..hits] {
            to_back(blocks, h);
        }
        let mut keys: Vec<BlockHash> = prompt[..hits].to_vec();
        for _ in 0..(prompt.len() - hits + extra).min(*cap - hits) {
            *next += 1;
            keys.push((7u128 << 100) | *next);
        }
        for &p in keys[hits..].iter().rev() {
            blocks.push(p);
            if blocks.len() > *cap {
                blocks.remove(0);
            }
        }
        for i in hits..prompt.len().min(keys.len()) {
            if !blocks.contains(&prompt[i])
                && let Some(at) = blocks.iter().position(|&b| b == keys[i])
            {
                blocks[at] = prompt[i];
                keys[i] = prompt[i];
            }
        }
        for &k in keys.iter().rev() {
            to_back(blocks, k);
        }
        keys[hits..].iter().copied().filter(|k| blocks.contains(k)).collect()
    }

    fn matched(&self, hashes: &[BlockHash], slot: Slot) -> usize {
        let Some((_, blocks)) = self.replicas.get(&slot) else { return 0 };
        hashes.iter().take_while(|h| blocks.contains(h)).count()
    }
}

#[derive(Debug, Clone)]
enum Op {
    Record { slot: Slot, family: u8, len: usize, reusable: usize, extra: usize, take_back: bool },
    Clear(Slot),
    Remove(Slot),
    Add(Slot),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        // An engine reuses every full block of a prompt, or all but the last when the prompt ends on a block boundary.
        8 => (0u32..4, 0u8..3, 1usize..8, any::<bool>(), 0usize..3, any::<bool>()).prop_map(|(slot, family, len, all, extra, take_back)| {
            Op::Record { slot, family, len, reusable: if all { len } else { len - 1 }, extra, take_back }
        }),
        1 => (0u32..4).prop_map(Op::Clear),
        1 => (0u32..4).prop_map(Op::Remove),
        1 => (0u32..4).prop_map(Op::Add),
    ]
}

fn chain(family: u8, len: usize) -> Vec<BlockHash> {
    (0..len).map(|k| (u128::from(family) << 64) | k as u128).collect()
}

proptest! {
    #[test]
    fn the_index_behaves_like_the_naive_model(ops in proptest::collection::vec(op(), 1..120), cap in 1usize..12) {
        let index = KvIndex::new();
        let mut naive = Naive::default();
        let mut next = 0u128;
        for s in 0..4 {
            index.add_replica(s, cap);
            naive.replicas.insert(s, (cap, Vec::new()));
        }
        for op in ops {
            match op {
                Op::Record { slot, family, len, reusable, extra, take_back } => {
                    let hashes = chain(family, len);
                    let recorded = index.record(slot, &hashes, reusable, extra);
                    let added = naive.record(slot, &hashes, reusable, extra, &mut next);
                    let real = |v: &[BlockHash]| -> (Vec<BlockHash>, usize) {
                        let mut r: Vec<BlockHash> = v.iter().copied().filter(|h| hashes.contains(h)).collect();
                        r.sort_unstable();
                        (r, v.len())
                    };
                    prop_assert_eq!(real(&recorded.added), real(&added));
                    if take_back {
                        index.take_back(&recorded);
                        if let Some((_, blocks)) = naive.replicas.get_mut(&slot) {
                            blocks.retain(|b| !added.contains(b));
                        }
                    }
                }
                Op::Clear(s) => {
                    index.clear_replica(s);
                    if let Some((_, blocks)) = naive.replicas.get_mut(&s) { blocks.clear(); }
                }
                Op::Remove(s) => {
                    index.remove_replica(s);
                    naive.replicas.remove(&s);
                }
                Op::Add(s) => {
                    index.add_replica(s, cap);
                    naive.replicas.insert(s, (cap, Vec::new()));
                }
            }
            for family in 0..3 {
                let hashes = chain(family, 8);
                let slots: Vec<Slot> = (0..4).collect();
                let want: Vec<usize> = slots.iter().map(|&s| naive.matched(&hashes, s)).collect();
                prop_assert_eq!(index.matched(&hashes, &slots), want);
            }
            prop_assert_eq!(index.entries(), naive.replicas.values().map(|(_, b)| b.len()).sum::<usize>());
        }
    }
}

#[test]
fn a_long_prefix_is_evicted_from_its_tail() {
    let index = KvIndex::new();
    index.add_replica(0, 4);
    index.record(0, &chain(0, 4), 4, 0);
    index.record(0, &chain(1, 1), 1, 0);
    assert_eq!(index.matched(&chain(0, 4), &[0]), [3]);
}

#[test]
fn partial_and_generated_blocks_take_room() {
    let index = KvIndex::new();
    index.add_replica(0, 4);
    // Two full blocks and two more the index cannot name: the shadow is full.
    index.record(0, &chain(0, 2), 2, 2);
    assert_eq!(index.entries(), 4);
    // One fresh block evicts the least recent: the first request's last (unnamed) block.
    index.record(0, &chain(1, 1), 1, 0);
    assert_eq!(index.matched(&chain(0, 2), &[0]), [2]);
    index.record(0, &chain(2, 2), 2, 0);
    assert_eq!(index.matched(&chain(0, 2), &[0]), [1], "then its tail");
}

#[test]
fn a_fully_cached_prompt_recomputes_its_last_block_without_moving_it() {
    let index = KvIndex::new();
    index.add_replica(0, 8);
    index.record(0, &chain(0, 2), 1, 0);
    // The same prompt again, its last block not reusable: the engine fills a
    // fresh block that caches nothing, and the old one keeps its place.
    let r = index.record(0, &chain(0, 2), 1, 0);
    assert_eq!(r.added.len(), 1);
    assert!(!chain(0, 2).contains(&r.added[0]));
    assert_eq!(index.matched(&chain(0, 2), &[0]), [2]);
}

#[test]
fn predictions_never_claim_the_last_token() {
    assert_eq!(predicted_cached_tokens(4, 64, 16), 48);
    assert_eq!(predicted_cached_tokens(4, 65, 16), 64);
    assert_eq!(predicted_cached_tokens(2, 100, 16), 32);
    assert_eq!(predicted_cached_tokens(0, 0, 16), 0);
}

#[test]
fn slots_past_the_first_64_are_searched_too() {
    let index = KvIndex::new();
    let prompt = chain(1, 40);
    let slots: [Slot; 5] = [0, 63, 64, 130, 200];
    for (i, &s) in slots.iter().enumerate() {
        index.add_replica(s, 100);
        let held = &prompt[..i * 9];
        index.record(s, held, held.len(), 0);
    }
    assert_eq!(index.matched(&prompt, &slots), vec![0, 9, 18, 27, 36]);
    assert_eq!(index.matched(&prompt, &[200, 64]), vec![36, 18], "any subset, in the order asked");
    index.remove_replica(64);
    index.clear_replica(200);
    assert_eq!(index.matched(&prompt, &slots), vec![0, 9, 0, 27, 0]);
    // Blocks shared by slots in different words keep the other holders when one lets go.
    index.record(130, &prompt[..5], 5, 0);
    index.remove_replica(63);
    assert_eq!(index.matched(&prompt, &[63, 130]), vec![0, 27]);
}
