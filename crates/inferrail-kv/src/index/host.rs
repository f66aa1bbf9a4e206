//! What a replica's engine holds in host memory, in the order it evicts it
//! (vLLM 0.32's `OffloadingConnector`, ADR 0059): least recently used
//! first, where a block is used when it is stored and when a request that
//! stored or found it finishes, its first block last.
//!
//! In exact mode the engine's events say which blocks it holds, and the
//! requests the router sent say when they finish; in approximate mode a
//! request's full prompt blocks are taken as stored when it is sent, and
//! the least recent go past the tier's size. Either way, the requests sent
//! and not yet admitted will store their prompt blocks the tier lacks
//! before a request sent now is: past the tier's size, that many of the
//! least recent blocks are as good as gone ([`HostOrder::run`]).

use std::collections::{BTreeMap, HashMap};

use super::FoldState;
use crate::hash::BlockHash;

/// The blocks in host memory and their recency; see the module doc.
#[derive(Debug, Default)]
pub(super) struct HostOrder {
    rank: HashMap<BlockHash, u64, FoldState>,
    /// Least recent first.
    order: BTreeMap<u64, BlockHash>,
    next: u64,
    /// Its size in blocks, when configured.
    size: Option<usize>,
    /// The most blocks it held at once: its size, once it has had to evict.
    peak: usize,
}

impl HostOrder {
    /// An empty tier of `size` blocks, when known.
    pub(super) fn new(size: Option<usize>) -> Self {
        Self { size, ..Self::default() }
    }

    /// Sets its size (`None`: the most it held).
    pub(super) fn resize(&mut self, size: Option<usize>) {
        self.size = size;
    }

    /// Whether it holds `h`.
    pub(super) fn contains(&self, h: BlockHash) -> bool {
        self.rank.contains_key(&h)
    }

    /// Its size: configured, else the most it held.
    fn size(&self) -> usize {
        self.size.unwrap_or(self.peak)
    }

    /// `h` was stored: the most recent.
    pub(super) fn stored(&mut self, h: BlockHash) {
        self.touch(h);
        self.peak = self.peak.max(self.rank.len());
    }

    /// `h` was evicted.
    pub(super) fn removed(&mut self, h: BlockHash) {
        if let Some(r) = self.rank.remove(&h) {
            self.order.remove(&r);
        }
    }

    /// A request that used `keys` (its prompt's blocks, first first)
    /// finished: those held become the most recent, the first one last.
    pub(super) fn finished(&mut self, keys: &[BlockHash]) {
        for &h in keys.iter().rev() {
            if self.rank.contains_key(&h) {
                self.touch(h);
            }
        }
    }

    /// Approximate mode: a request with these full prompt blocks was sent.
    /// They are stored (the most recent, the first one last) and the least
    /// recent others go past the tier's size.
    pub(super) fn sent(&mut self, keys: &[BlockHash]) {
        for &h in keys.iter().rev() {
            self.touch(h);
        }
        let size = self.size();
        while self.rank.len() > size {
            let Some((_, h)) = self.order.pop_first() else { break };
            self.rank.remove(&h);
        }
    }

    /// How many of `keys`, consecutive from the first, will still be held
    /// when a request sent now looks them up: `incoming` blocks the
    /// requests ahead of it will store first evict the least recent past
    /// the tier's size.
    pub(super) fn run(&self, keys: &[BlockHash], incoming: usize) -> usize {
        let doomed = (self.rank.len() + incoming).saturating_sub(self.size()).min(self.rank.len());
        // Blocks ranked below this one are gone by then.
        let kept_from = self.order.keys().nth(doomed).copied().unwrap_or(u64::MAX);
        keys.iter().take_while(|h| self.rank.get(h).is_some_and(|&r| r >= kept_from)).count()
    }

    fn touch(&mut self, h: BlockHash) {
        self.next += 1;
        if let Some(old) = self.rank.insert(h, self.next) {
            self.order.remove(&old);
        }
        self.order.insert(self.next, h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_evicted_least_recent_first_and_a_finish_refreshes_the_first_block_last() {
        let mut t = HostOrder::new(Some(4));
        for h in 1..=4 {
            t.stored(h);
        }
        t.finished(&[1, 2, 9]);
        // Least recent first: 3, 4, then 2, then 1.
        assert_eq!(t.run(&[1, 2, 3, 4], 0), 4);
        assert_eq!(t.run(&[3, 4], 1), 0, "one block to come evicts 3");
        assert_eq!(t.run(&[4], 1), 1);
        assert_eq!(t.run(&[1, 2], 3), 1, "three evict 3, 4 and 2");
        assert_eq!(t.run(&[1, 2], 9), 0);
        t.removed(1);
        assert_eq!((t.contains(1), t.run(&[1, 2], 0)), (false, 0));
    }

    #[test]
    fn without_a_configured_size_the_most_it_held_is_its_size() {
        let mut t = HostOrder::new(None);
        for h in 1..=3 {
            t.stored(h);
        }
        t.removed(1);
        t.stored(4);
        // It held three at most: one block to come evicts the least recent, 2.
        assert_eq!((t.run(&[2], 0), t.run(&[2], 1), t.run(&[3], 1)), (1, 0, 1));
    }

    #[test]
    fn sent_prompts_are_stored_and_the_least_recent_go() {
        let mut t = HostOrder::new(Some(3));
        t.sent(&[1, 2]);
        t.sent(&[5, 6]);
        // 2 was the least recent (1 was refreshed after it).
        assert_eq!((t.contains(1), t.contains(2), t.contains(5), t.contains(6)), (true, false, true, true));
        t.sent(&[1, 7, 8, 9]);
        assert_eq!(t.run(&[1, 7, 8], 0), 3, "a prompt longer than the tier keeps its head");
    }
}
