//! One replica's shadow of its KV cache, kept as the engine keeps its block
//! pool: blocks held by running requests cannot be evicted; the others wait
//! in a queue, least recently freed first out, and keep their prefix until
//! they are reused. About 30 bytes a block, taken for the whole capacity
//! (up to `UP_FRONT` blocks) when the first block comes.
//!
//! Blocks live in a slab (one array of nodes, linked in freeing order by
//! index, not pointer) and a hash table holds only each block's node index,
//! hashed and compared through the slab. A general LRU map would spend a
//! heap allocation and two pointers a block, and keep every key twice.

use std::hash::BuildHasher;

use hashbrown::HashTable;

use super::{FoldState, UP_FRONT};
use crate::hash::BlockHash;

/// No node.
const NIL: u32 = u32::MAX;
/// The `older` link of a node held by running requests (its `newer` counts them).
const IN_USE: u32 = u32::MAX - 1;
/// Set in the count of a block a second request took while the first still held it.
const SHARED: u32 = 1 << 31;

#[derive(Debug, Clone, Copy)]
struct Node {
    /// The block hash in two halves, so a node is 24 bytes, not 32.
    key: [u64; 2],
    /// Towards the most recently freed; the holder count while in use.
    newer: u32,
    /// Towards the least recently freed; `IN_USE` while in use; the next free node while the node is unused.
    older: u32,
}

fn split(h: BlockHash) -> [u64; 2] {
    [h as u64, (h >> 64) as u64]
}

fn join(k: [u64; 2]) -> BlockHash {
    BlockHash::from(k[0]) | (BlockHash::from(k[1]) << 64)
}

fn hash(h: BlockHash) -> u64 {
    FoldState::default().hash_one(h)
}

/// A fixed-capacity pool of block hashes; see the module doc.
#[derive(Debug)]
pub(super) struct Shadow {
    nodes: Vec<Node>,
    table: HashTable<u32>,
    cap: usize,
    /// Blocks held by running requests.
    in_use: usize,
    newest: u32,
    oldest: u32,
    unused: u32,
}

impl Shadow {
    /// An empty shadow that holds up to `cap` blocks (at least one).
    pub(super) fn new(cap: usize) -> Self {
        Shadow { nodes: Vec::new(), table: HashTable::new(), cap: cap.max(1), in_use: 0, newest: NIL, oldest: NIL, unused: NIL }
    }

    pub(super) fn cap(&self) -> usize {
        self.cap
    }

    /// Blocks held, in use or not.
    pub(super) fn len(&self) -> usize {
        self.table.len()
    }

    /// Blocks a new request can take: the empty ones and those no running request holds.
    pub(super) fn available(&self) -> usize {
        self.cap.saturating_sub(self.in_use)
    }

    /// Holds up to `cap` blocks (at least one) from now on: past a smaller
    /// size the least recently freed blocks leave (added to `evicted`);
    /// blocks running requests hold stay, over the size, until freed.
    pub(super) fn set_cap(&mut self, cap: usize, evicted: &mut Vec<BlockHash>) {
        self.cap = cap.max(1);
        while self.len() > self.cap
            && let Some(oldest) = self.evict_oldest()
        {
            evicted.push(oldest);
        }
    }

    /// Bytes this shadow has allocated.
    pub(super) fn bytes(&self) -> usize {
        self.nodes.capacity() * size_of::<Node>() + self.table.capacity() * (size_of::<u32>() + 1)
    }

    fn find(&self, h: BlockHash) -> Option<u32> {
        let key = split(h);
        self.table.find(hash(h), |&i| self.nodes[i as usize].key == key).copied()
    }

    pub(super) fn contains(&self, h: BlockHash) -> bool {
        self.find(h).is_some()
    }

    /// One more running request holds a block; false if the block is not held.
    pub(super) fn hold(&mut self, h: BlockHash) -> bool {
        let Some(i) = self.find(h) else { return false };
        if self.nodes[i as usize].older == IN_USE {
            self.nodes[i as usize].newer = (self.nodes[i as usize].newer + 1) | SHARED;
        } else {
            self.unlink(i);
            self.set_in_use(i);
        }
        true
    }

    /// A running request let go of a block: when none holds it any more it is
    /// the most recently freed. Does nothing for a block not in use.
    pub(super) fn release(&mut self, h: BlockHash) {
        let Some(i) = self.find(h) else { return };
        let node = &mut self.nodes[i as usize];
        if node.older != IN_USE {
            return;
        }
        node.newer -= 1;
        if node.newer & !SHARED == 0 {
            self.in_use -= 1;
            self.link_newest(i);
        }
    }

    /// Frees room for `n` more blocks, evicting the least recently freed
    /// ones while the pool is too full and some block is not in use; returns
    /// how many fit now (at most `n`). The next pushes, up to that many,
    /// evict nothing.
    pub(super) fn make_room(&mut self, n: usize, evicted: &mut Vec<BlockHash>) -> usize {
        while self.len() + n > self.cap
            && let Some(oldest) = self.evict_oldest()
        {
            evicted.push(oldest);
        }
        n.min(self.cap.saturating_sub(self.len()))
    }

    /// Adds a block not held, in use by one request, reusing the least
    /// recently freed block when the pool is full (returned). `Err` when
    /// every block is in use.
    pub(super) fn push(&mut self, h: BlockHash) -> Result<Option<BlockHash>, Full> {
        debug_assert!(!self.contains(h), "push takes a block not held");
        let evicted = if self.len() >= self.cap { Some(self.evict_oldest().ok_or(Full)?) } else { None };
        let node = Node { key: split(h), newer: 0, older: 0 };
        let i = if self.unused == NIL {
            if self.nodes.len() == self.nodes.capacity() {
                // The first block takes room for a full shadow (up to
                // `UP_FRONT` blocks, whatever the engine claims): growing
                // one later would copy it all while every request waits. An
                // exact replica's shadow is never pushed to and takes none.
                // Past that, grow by doubling, never past the capacity.
                let more = match self.nodes.capacity() {
                    0 => self.cap.min(UP_FRONT),
                    n => n.min(self.cap.saturating_sub(n)).max(1),
                };
                if self.table.capacity() == 0 {
                    self.table = HashTable::with_capacity(more);
                }
                self.nodes.reserve_exact(more);
            }
            self.nodes.push(node);
            u32::try_from(self.nodes.len() - 1).unwrap_or(NIL)
        } else {
            let i = self.unused;
            self.unused = self.nodes[i as usize].older;
            self.nodes[i as usize] = node;
            i
        };
        let nodes = &self.nodes;
        self.table.insert_unique(hash(h), i, |&j| hash(join(nodes[j as usize].key)));
        self.set_in_use(i);
        Ok(evicted)
    }

    /// A request gives up a block it added and never filled (the engine
    /// refused it): the block goes, unless another request took it meanwhile
    /// (that one filled it), in which case it is only released. True if it went.
    pub(super) fn withdraw(&mut self, h: BlockHash) -> bool {
        match self.find(h) {
            Some(i) if self.nodes[i as usize].older == IN_USE && self.nodes[i as usize].newer & SHARED != 0 => {
                self.release(h);
                false
            }
            _ => self.remove(h),
        }
    }

    /// Gives block `from` the name `to`, keeping its place in the pool and
    /// its holders; false (and nothing changes) when `from` is not held or
    /// `to` is.
    pub(super) fn rename(&mut self, from: BlockHash, to: BlockHash) -> bool {
        let Some(i) = self.find(from) else { return false };
        if self.contains(to) {
            return false;
        }
        if let Ok(entry) = self.table.find_entry(hash(from), |&j| j == i) {
            entry.remove();
        }
        self.nodes[i as usize].key = split(to);
        let nodes = &self.nodes;
        self.table.insert_unique(hash(to), i, |&j| hash(join(nodes[j as usize].key)));
        true
    }

    /// How many running requests hold a block.
    pub(super) fn holders(&self, h: BlockHash) -> u32 {
        match self.find(h).map(|i| self.nodes[i as usize]) {
            Some(node) if node.older == IN_USE => node.newer & !SHARED,
            _ => 0,
        }
    }

    /// Whether a running request holds a block; `None` if the block is not held.
    pub(super) fn in_use(&self, h: BlockHash) -> Option<bool> {
        self.find(h).map(|i| self.nodes[i as usize].older == IN_USE)
    }

    /// Removes a block, in use or not; false if it was not held.
    pub(super) fn remove(&mut self, h: BlockHash) -> bool {
        let key = split(h);
        let nodes = &self.nodes;
        let Ok(entry) = self.table.find_entry(hash(h), |&i| nodes[i as usize].key == key) else { return false };
        let (i, _) = entry.remove();
        self.free_node(i);
        true
    }

    /// Removes the least recently freed block and returns it; `None` when every block is in use.
    fn evict_oldest(&mut self) -> Option<BlockHash> {
        let i = self.oldest;
        let h = join(self.nodes.get(i as usize)?.key);
        // The node is known: the table's entries are compared by index, not through the slab.
        if let Ok(entry) = self.table.find_entry(hash(h), |&j| j == i) {
            entry.remove();
        }
        self.free_node(i);
        Some(h)
    }

    /// A node whose block left the table goes back to the unused ones.
    fn free_node(&mut self, i: u32) {
        if self.nodes[i as usize].older == IN_USE {
            self.in_use -= 1;
        } else {
            self.unlink(i);
        }
        self.nodes[i as usize].older = self.unused;
        self.unused = i;
    }

    /// The blocks no running request holds, least recently freed first.
    pub(super) fn oldest_free(&self) -> impl Iterator<Item = BlockHash> + '_ {
        std::iter::successors(Some(self.oldest).filter(|&i| i != NIL), |&i| Some(self.nodes[i as usize].newer).filter(|&n| n != NIL))
            .map(|i| join(self.nodes[i as usize].key))
    }

    /// Every block held, in no particular order.
    pub(super) fn blocks(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.table.iter().map(|&i| join(self.nodes[i as usize].key))
    }

    fn set_in_use(&mut self, i: u32) {
        self.nodes[i as usize].older = IN_USE;
        self.nodes[i as usize].newer = 1;
        self.in_use += 1;
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

/// Every block of a shadow is in use: nothing can be evicted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Full;

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, VecDeque};

    use proptest::prelude::*;

    use super::*;

    impl Shadow {
        /// The blocks no request holds, most recently freed first.
        fn free_order(&self) -> Vec<BlockHash> {
            let mut order: Vec<BlockHash> = self.oldest_free().collect();
            order.reverse();
            order
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Push(u8),
        Hold(u8),
        Release(u8),
        Remove(u8),
        MakeRoom(u8),
        Rename(u8, u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            any::<u8>().prop_map(Op::Push),
            any::<u8>().prop_map(Op::Hold),
            any::<u8>().prop_map(Op::Release),
            any::<u8>().prop_map(Op::Remove),
            any::<u8>().prop_map(Op::MakeRoom),
            (any::<u8>(), any::<u8>()).prop_map(|(a, b)| Op::Rename(a, b))
        ]
    }

    /// Keys with structure in both halves, as placeholders have.
    fn key(k: u8) -> BlockHash {
        (BlockHash::from(k % 3) << 64) | BlockHash::from(k % 16)
    }

    proptest! {
        #[test]
        fn the_shadow_is_the_engines_block_pool(ops in proptest::collection::vec(op(), 1..200), cap in 1usize..10) {
            let mut shadow = Shadow::new(cap);
            // Free blocks, most recently freed first, and blocks in use with their holders.
            let mut free: VecDeque<BlockHash> = VecDeque::new();
            let mut in_use: HashMap<BlockHash, u32> = HashMap::new();
            for op in ops {
                match op {
                    Op::Push(k) if !free.contains(&key(k)) && !in_use.contains_key(&key(k)) => {
                        let want = if free.len() + in_use.len() < cap {
                            Ok(None)
                        } else {
                            free.pop_back().map(Some).ok_or(Full)
                        };
                        if want.is_ok() {
                            in_use.insert(key(k), 1);
                        }
                        prop_assert_eq!(shadow.push(key(k)), want);
                    }
                    Op::Push(_) => {}
                    Op::Hold(k) => {
                        let held = if let Some(n) = in_use.get_mut(&key(k)) {
                            *n += 1;
                            true
                        } else if let Some(at) = free.iter().position(|&h| h == key(k)) {
                            free.remove(at);
                            in_use.insert(key(k), 1);
                            true
                        } else {
                            false
                        };
                        prop_assert_eq!(shadow.hold(key(k)), held);
                    }
                    Op::Release(k) => {
                        if let Some(n) = in_use.get_mut(&key(k)) {
                            *n -= 1;
                            if *n == 0 {
                                in_use.remove(&key(k));
                                free.push_front(key(k));
                            }
                        }
                        shadow.release(key(k));
                    }
                    Op::Remove(k) => {
                        let held = in_use.remove(&key(k)).is_some()
                            || free.iter().position(|&h| h == key(k)).map(|at| free.remove(at)).is_some();
                        prop_assert_eq!(shadow.remove(key(k)), held);
                    }
                    Op::Rename(a, b) => {
                        let (from, to) = (key(a), key(b));
                        let held = |h: &BlockHash| free.contains(h) || in_use.contains_key(h);
                        let renamed = held(&from) && !held(&to);
                        if renamed {
                            if let Some(n) = in_use.remove(&from) {
                                in_use.insert(to, n);
                            }
                            for h in free.iter_mut().filter(|h| **h == from) {
                                *h = to;
                            }
                        }
                        prop_assert_eq!(shadow.rename(from, to), renamed);
                    }
                    Op::MakeRoom(n) => {
                        // The least recently freed go while n more would not fit; n fit, or as many as there is room for.
                        let n = usize::from(n % 12);
                        let mut want = Vec::new();
                        while free.len() + in_use.len() + n > cap && let Some(h) = free.pop_back() {
                            want.push(h);
                        }
                        let mut evicted = Vec::new();
                        prop_assert_eq!(shadow.make_room(n, &mut evicted), n.min(cap - free.len() - in_use.len()));
                        prop_assert_eq!(evicted, want);
                    }
                }
                prop_assert_eq!(shadow.free_order(), free.iter().copied().collect::<Vec<_>>());
                prop_assert_eq!(shadow.len(), free.len() + in_use.len());
                prop_assert_eq!(shadow.available(), cap - in_use.len());
                prop_assert!(shadow.nodes.len() <= cap, "unused nodes are reused");
            }
        }
    }

    #[test]
    fn a_full_shadow_costs_under_forty_bytes_a_block() {
        let mut shadow = Shadow::new(100_000);
        for k in 0..100_000u128 {
            shadow.push(k << 3).unwrap();
            shadow.release(k << 3);
        }
        assert_eq!(shadow.len(), 100_000);
        assert!(shadow.bytes() < 40 * 100_000, "{} bytes", shadow.bytes());
    }
}
