//! The engine's KV block pool with its prefix cache, as vLLM keeps it.
//!
//! Every block is either in use (held by running sequences, counted by
//! `refs`) or free. Free blocks sit in one LRU queue; a free block may still
//! hold a cached prefix (its hash) until it is reused. Allocation takes the
//! least recently freed block and forgets its hash. A finished sequence frees
//! its blocks last block first, so a long prefix is evicted from its tail;
//! a freed block that caches nothing goes to the front of the queue, to be
//! reused before any cached prefix is evicted.
//! A cache hit on a free block takes it back out of the queue. Two
//! sequences that compute the same block in one step each cache their copy,
//! as vLLM's `BlockHashToBlockMap` does (a hit takes the copy cached first),
//! and each copy is stored and evicted on its own: so a cached block's
//! prefix always stays cached in some copy while it does, which KV event
//! consumers rely on. Every operation is O(1) per block (a block has few
//! copies). Resetting forgets every cached prefix, and like vLLM's reset it
//! is refused while any block is in use. When KV events are on, the pool
//! logs the hashes it evicts (`log_evictions`).

use std::collections::HashMap;

use inferrail_kv::hash::BlockHash;

/// Index of a block in the pool.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Block {
    refs: u32,
    hash: Option<BlockHash>,
    prev: u32,
    next: u32,
}

/// The pool; see the module doc.
#[derive(Debug, Clone)]
pub struct BlockPool {
    blocks: Vec<Block>,
    /// Hash -> the blocks caching it, first cached first.
    by_hash: HashMap<BlockHash, Vec<BlockId>>,
    /// Blocks caching a prefix (copies counted).
    cached: usize,
    head: u32,
    tail: u32,
    free: usize,
    /// Hashes evicted since the last `take_evicted`, when logging.
    evicted: Option<Vec<BlockHash>>,
}

impl BlockPool {
    /// A pool of `n` free, empty blocks.
    pub fn new(n: usize) -> Self {
        let n32 = u32::try_from(n).unwrap_or(NIL - 1);
        let blocks = (0..n32)
            .map(|i| Block { refs: 0, hash: None, prev: i.checked_sub(1).unwrap_or(NIL), next: if i + 1 < n32 { i + 1 } else { NIL } })
            .collect::<Vec<_>>();
        let head = if n32 > 0 { 0 } else { NIL };
        let tail = n32.checked_sub(1).unwrap_or(NIL);
        Self { free: blocks.len(), blocks, by_hash: HashMap::new(), cached: 0, head, tail, evicted: None }
    }

    /// From now on, keep the hashes of evicted blocks for [`Self::take_evicted`].
    pub fn log_evictions(&mut self) {
        self.evicted.get_or_insert_with(Vec::new);
    }

    /// The hashes evicted since the last call, in eviction order (empty
    /// unless [`Self::log_evictions`] was called).
    pub fn take_evicted(&mut self) -> Vec<BlockHash> {
        self.evicted.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Blocks not held by any sequence (cached or not).
    pub fn num_free(&self) -> usize {
        self.free
    }

    /// Blocks that hold a cached prefix (each copy counts).
    pub fn num_cached(&self) -> usize {
        self.cached
    }

    /// Fraction of blocks held by sequences, as `vllm:kv_cache_usage_perc`.
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() { 0.0 } else { 1.0 - self.free as f64 / self.blocks.len() as f64 }
    }

    /// The cached blocks of the longest cached prefix of `hashes`.
    pub fn lookup(&self, hashes: &[BlockHash]) -> Vec<BlockId> {
        hashes.iter().map_while(|h| self.by_hash.get(h).and_then(|c| c.first().copied())).collect()
    }

    /// How many of `blocks` are free now (a hit on them uses up free space).
    pub fn count_free(&self, blocks: &[BlockId]) -> usize {
        blocks.iter().filter(|&&b| self.blocks[b as usize].refs == 0).count()
    }

    /// Takes a reference on cached blocks found by [`Self::lookup`].
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            if self.blocks[b as usize].refs == 0 {
                self.unlink(b);
            }
            self.blocks[b as usize].refs += 1;
        }
    }

    /// Takes `n` blocks from the front of the free queue, evicting what they
    /// cached; `None` (and nothing taken) when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let b = self.head;
            self.unlink(b);
            let block = &mut self.blocks[b as usize];
            block.refs = 1;
            if let Some(h) = block.hash.take() {
                if let Some(copies) = self.by_hash.get_mut(&h) {
                    copies.retain(|&c| c != b);
                    if copies.is_empty() {
                        self.by_hash.remove(&h);
                    }
                }
                self.cached -= 1;
                if let Some(log) = &mut self.evicted {
                    log.push(h);
                }
            }
            out.push(b);
        }
        Some(out)
    }

    /// Records that a full block now holds the prefix named `hash`; returns
    /// whether it newly does (false for a block that caches one already, a
    /// hit). A prefix cached in another block too is a second copy, as in vLLM.
    pub fn register(&mut self, block: BlockId, hash: BlockHash) -> bool {
        if self.blocks[block as usize].hash.is_some() {
            return false;
        }
        self.blocks[block as usize].hash = Some(hash);
        self.by_hash.entry(hash).or_default().push(block);
        self.cached += 1;
        true
    }

    /// Drops one reference on each block, in the order given. A block no one
    /// holds that caches a prefix joins the back of the free queue, keeping
    /// it; one that caches nothing (a partial last block, or one never
    /// filled) goes to the front, to be reused before any cached prefix is
    /// evicted, as vLLM 0.32's `BlockPool.free_blocks` does.
    pub fn release(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        for b in blocks {
            let block = &mut self.blocks[b as usize];
            block.refs = block.refs.saturating_sub(1);
            if block.refs == 0 {
                if block.hash.is_some() { self.push_back(b) } else { self.push_front(b) }
            }
        }
    }

    /// Forgets every cached prefix and returns how many there were; `None`,
    /// forgetting nothing, while any block is in use (vLLM refuses then too).
    pub fn reset(&mut self) -> Option<usize> {
        if self.free < self.blocks.len() {
            return None;
        }
        for block in &mut self.blocks {
            block.hash = None;
        }
        self.by_hash.clear();
        Some(std::mem::take(&mut self.cached))
    }

    fn unlink(&mut self, b: u32) {
        let Block { prev, next, .. } = self.blocks[b as usize];
        if prev == NIL {
            self.head = next
        } else {
            self.blocks[prev as usize].next = next
        }
        if next == NIL {
            self.tail = prev
        } else {
            self.blocks[next as usize].prev = prev
        }
        self.blocks[b as usize].prev = NIL;
        self.blocks[b as usize].next = NIL;
        self.free -= 1;
    }

    fn push_front(&mut self, b: u32) {
        self.blocks[b as usize].prev = NIL;
        self.blocks[b as usize].next = self.head;
        if self.head == NIL {
            self.tail = b
        } else {
            self.blocks[self.head as usize].prev = b
        }
        self.head = b;
        self.free += 1;
    }

    fn push_back(&mut self, b: u32) {
        self.blocks[b as usize].prev = self.tail;
        self.blocks[b as usize].next = NIL;
        if self.tail == NIL {
            self.head = b
        } else {
            self.blocks[self.tail as usize].next = b
        }
        self.tail = b;
        self.free += 1;
    }
}

#[cfg(test)]
mod tests;
