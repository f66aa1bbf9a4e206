//! One replica's shadow of its KV cache: the blocks it holds, least recently
//! used first out, in about 30 bytes a block.
//!
//! Blocks live in a slab (one array of nodes linked in recency order by
//! index, not pointer) and a hash table holds only each block's node index,
//! hashed and compared through the slab. A general LRU map would spend a
//! heap allocation and two pointers a block, and keep every key twice.

use std::hash::BuildHasher;

use hashbrown::HashTable;

use super::FoldState;
use crate::hash::BlockHash;

/// No node.
const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    /// The block hash in two halves, so a node is 24 bytes, not 32.
    key: [u64; 2],
    /// Towards the most recent.
    newer: u32,
    /// Towards the least recent; the next free node while the node is free.
    older: u32,
}

fn split(h: BlockHash) -> [u64; 2] {
    [h as u64, (h >> 64) as u64]
}

fn join(k: [u64; 2]) -> BlockHash {
    BlockHash::from(k[0]) | (BlockHash::from(k[1]) << 64)
}

/// A fixed-capacity LRU set of block hashes.
#[derive(Debug)]
pub(super) struct Shadow {
    nodes: Vec<Node>,
    table: HashTable<u32>,
    cap: usize,
    newest: u32,
    oldest: u32,
    free: u32,
}

impl Shadow {
    /// An empty shadow that holds up to `cap` blocks (at least one).
    pub(super) fn new(cap: usize) -> Self {
        Shadow { nodes: Vec::new(), table: HashTable::new(), cap: cap.max(1), newest: NIL, oldest: NIL, free: NIL }
    }

    pub(super) fn cap(&self) -> usize {
        self.cap
    }

    pub(super) fn len(&self) -> usize {
        self.table.len()
    }

    /// Bytes this shadow has allocated.
    pub(super) fn bytes(&self) -> usize {
        self.nodes.capacity() * size_of::<Node>() + self.table.capacity() * (size_of::<u32>() + 1)
    }

    fn find(&self, h: BlockHash) -> Option<u32> {
        let key = split(h);
        self.table.find(FoldState::default().hash_one(h), |&i| self.nodes[i as usize].key == key).copied()
    }

    pub(super) fn contains(&self, h: BlockHash) -> bool {
        self.find(h).is_some()
    }

    /// Makes a held block the most recent; does nothing for one not held.
    pub(super) fn promote(&mut self, h: BlockHash) {
        if let Some(i) = self.find(h) {
            self.unlink(i);
            self.link_newest(i);
        }
    }

    /// Adds a block not held as the most recent, and returns the least recent
    /// block when that makes one too many.
    pub(super) fn push(&mut self, h: BlockHash) -> Option<BlockHash> {
        debug_assert!(!self.contains(h), "push takes a block not held");
        let evicted = if self.len() == self.cap { self.pop_oldest() } else { None };
        let node = Node { key: split(h), newer: NIL, older: NIL };
        let i = if self.free == NIL {
            if self.nodes.len() == self.nodes.capacity() {
                // Grow by doubling, but never past the capacity a full shadow needs.
                self.nodes.reserve_exact(self.nodes.len().max(16).min(self.cap - self.nodes.len()));
            }
            self.nodes.push(node);
            u32::try_from(self.nodes.len() - 1).unwrap_or(NIL)
        } else {
            let i = self.free;
            self.free = self.nodes[i as usize].older;
            self.nodes[i as usize] = node;
            i
        };
        let nodes = &self.nodes;
        self.table.insert_unique(FoldState::default().hash_one(h), i, |&j| FoldState::default().hash_one(join(nodes[j as usize].key)));
        self.link_newest(i);
        evicted
    }

    /// Removes a block; false if it was not held.
    pub(super) fn remove(&mut self, h: BlockHash) -> bool {
        let key = split(h);
        let nodes = &self.nodes;
        let Ok(entry) = self.table.find_entry(FoldState::default().hash_one(h), |&i| nodes[i as usize].key == key) else { return false };
        let (i, _) = entry.remove();
        self.unlink(i);
        self.nodes[i as usize].older = self.free;
        self.free = i;
        true
    }

    /// Every block held, most recent first.
    pub(super) fn iter(&self) -> impl Iterator<Item = BlockHash> + '_ {
        std::iter::successors(Some(self.newest).filter(|&i| i != NIL), |&i| Some(self.nodes[i as usize].older).filter(|&o| o != NIL))
            .map(|i| join(self.nodes[i as usize].key))
    }

    fn pop_oldest(&mut self) -> Option<BlockHash> {
        let h = join(self.nodes.get(self.oldest as usize)?.key);
        self.remove(h);
        Some(h)
    }

    fn unlink(&mut self, i: u32) {
        let Node { newer, older, .. } = self.nodes[i as usize];
        match newer {
            NIL => self.newest = older,
            n => self.nodes[n as usize].older = older,
        }
        match older {
            NIL => self.oldest = newer,
            o => self.nodes[o as usize].newer = newer,
        }
    }

    fn link_newest(&mut self, i: u32) {
        let old_newest = self.newest;
        self.nodes[i as usize].newer = NIL;
        self.nodes[i as usize].older = old_newest;
        match old_newest {
            NIL => self.oldest = i,
            n => self.nodes[n as usize].newer = i,
        }
        self.newest = i;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use proptest::prelude::*;

    use super::*;

    #[derive(Debug, Clone)]
    enum Op {
        Push(u8),
        Promote(u8),
        Remove(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![any::<u8>().prop_map(Op::Push), any::<u8>().prop_map(Op::Promote), any::<u8>().prop_map(Op::Remove)]
    }

    /// Keys with structure in both halves, as placeholders have.
    fn key(k: u8) -> BlockHash {
        (BlockHash::from(k % 3) << 64) | BlockHash::from(k)
    }

    proptest! {
        #[test]
        fn the_shadow_is_an_lru_set(ops in proptest::collection::vec(op(), 1..200), cap in 1usize..10) {
            let mut shadow = Shadow::new(cap);
            // Most recent first.
            let mut model: VecDeque<BlockHash> = VecDeque::new();
            for op in ops {
                match op {
                    Op::Push(k) if !model.contains(&key(k)) => {
                        let evicted = if model.len() == cap { model.pop_back() } else { None };
                        model.push_front(key(k));
                        prop_assert_eq!(shadow.push(key(k)), evicted);
                    }
                    Op::Push(_) => {}
                    Op::Promote(k) => {
                        if let Some(at) = model.iter().position(|&h| h == key(k)) {
                            model.remove(at);
                            model.push_front(key(k));
                        }
                        shadow.promote(key(k));
                    }
                    Op::Remove(k) => {
                        let held = model.iter().position(|&h| h == key(k)).map(|at| model.remove(at)).is_some();
                        prop_assert_eq!(shadow.remove(key(k)), held);
                    }
                }
                prop_assert_eq!(shadow.iter().collect::<Vec<_>>(), model.iter().copied().collect::<Vec<_>>());
                prop_assert_eq!(shadow.len(), model.len());
                prop_assert!(shadow.nodes.len() <= cap, "freed nodes are reused");
            }
        }
    }

    #[test]
    fn a_full_shadow_costs_under_forty_bytes_a_block() {
        let mut shadow = Shadow::new(100_000);
        for k in 0..100_000u128 {
            shadow.push(k << 3);
        }
        assert_eq!(shadow.len(), 100_000);
        assert!(shadow.bytes() < 40 * 100_000, "{} bytes", shadow.bytes());
    }
}
