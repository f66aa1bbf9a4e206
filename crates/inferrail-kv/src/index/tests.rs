//! The index against a naive model: per replica, a vector in LRU order.

use super::*;
use proptest::prelude::*;

#[derive(Debug, Default)]
struct Naive {
    /// slot -> (capacity, blocks, most recent last)
    replicas: HashMap<Slot, (usize, Vec<BlockHash>)>,
}

impl Naive {
    fn record(&mut self, slot: Slot, hashes: &[BlockHash]) -> Vec<BlockHash> {
        let Some((cap, blocks)) = self.replicas.get_mut(&slot) else { return Vec::new() };
        let mut added = Vec::new();
        for &h in hashes.iter().rev() {
            if let Some(i) = blocks.iter().position(|&b| b == h) {
                blocks.remove(i);
            } else {
                added.push(h);
            }
            blocks.push(h);
            if blocks.len() > *cap {
                let out = blocks.remove(0);
                added.retain(|&a| a != out);
            }
        }
        added
    }
    fn matched(&self, hashes: &[BlockHash], slot: Slot) -> usize {
        let Some((_, blocks)) = self.replicas.get(&slot) else { return 0 };
        hashes.iter().take_while(|h| blocks.contains(h)).count()
    }
}

#[derive(Debug, Clone)]
enum Op {
    Record { slot: Slot, family: u8, len: usize, take_back: bool },
    Clear(Slot),
    Remove(Slot),
    Add(Slot),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0u32..4, 0u8..3, 1usize..8, any::<bool>()).prop_map(|(slot, family, len, take_back)| Op::Record { slot, family, len, take_back }),
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
        for s in 0..4 {
            index.add_replica(s, cap);
            naive.replicas.insert(s, (cap, Vec::new()));
        }
        for op in ops {
            match op {
                Op::Record { slot, family, len, take_back } => {
                    let hashes = chain(family, len);
                    let recorded = index.record(slot, &hashes);
                    let mut added = naive.record(slot, &hashes);
                    let mut got = recorded.added.clone();
                    got.sort_unstable();
                    added.sort_unstable();
                    prop_assert_eq!(&got, &added);
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
    index.record(0, &chain(0, 4));
    index.record(0, &chain(1, 1));
    assert_eq!(index.matched(&chain(0, 4), &[0]), [3]);
}

#[test]
fn predictions_never_claim_the_last_token() {
    assert_eq!(predicted_cached_tokens(4, 64, 16), 48);
    assert_eq!(predicted_cached_tokens(4, 65, 16), 64);
    assert_eq!(predicted_cached_tokens(2, 100, 16), 32);
    assert_eq!(predicted_cached_tokens(0, 0, 16), 0);
}
