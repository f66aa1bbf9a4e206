//! What a replica's engine holds in host memory, in the order it evicts it
//! (vLLM 0.32's `OffloadingConnector`, ADR 0059): least recently used
//! first, where a block is used when it is stored and when a request that
//! stored or found it finishes, its first block last.
//!
//! In exact mode the engine's events say which blocks it holds, and the
//! requests the router sent say when they finish; in approximate mode a
//! request's full prompt blocks are taken as stored when its first token is
//! heard (or it ends), and the least recent go past the tier's size. Either
//! way, the requests sent and not yet admitted will store their prompt
//! blocks the tier lacks ([`HostOrder::expect`]) before a request sent now
//! is: past the tier's size, that many of the least recent blocks are as
//! good as gone ([`HostOrder::run`]). The fleet
//! simulation's engines keep their own host tier with it too.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};

use crate::hash::BlockHash;
use crate::index::FoldState;

/// The blocks in host memory and their recency; see the module doc.
#[derive(Debug, Default)]
pub struct HostOrder {
    rank: HashMap<BlockHash, u64, FoldState>,
    /// Least recent first.
    order: BTreeMap<u64, BlockHash>,
    next: u64,
    /// Its size in blocks, when configured.
    size: Option<usize>,
    /// The most blocks it held at once: its size, once it has had to evict.
    peak: usize,
    /// Blocks the requests sent will store when admitted, by how many will.
    pending: HashMap<BlockHash, u32, FoldState>,
    /// Of those, the ones it lacks.
    incoming: usize,
    /// The rank below which blocks are as good as gone, once found: found
    /// again only after a change, as lookups far outnumber changes.
    kept_from: Cell<Option<u64>>,
}

impl HostOrder {
    /// An empty tier of `size` blocks, when known.
    pub fn new(size: Option<usize>) -> Self {
        Self { size, ..Self::default() }
    }

    /// Sets its size (`None`: the most it held).
    pub fn resize(&mut self, size: Option<usize>) {
        self.kept_from.set(None);
        self.size = size;
    }

    /// Whether it holds `h`.
    pub fn contains(&self, h: BlockHash) -> bool {
        self.rank.contains_key(&h)
    }

    /// Its size: configured, else the most it held.
    fn size(&self) -> usize {
        self.size.unwrap_or(self.peak)
    }

    /// `h` was stored: the most recent.
    pub fn stored(&mut self, h: BlockHash) {
        self.touch(h);
        self.peak = self.peak.max(self.rank.len());
    }

    /// `h` was evicted.
    pub fn removed(&mut self, h: BlockHash) {
        self.kept_from.set(None);
        if let Some(r) = self.rank.remove(&h) {
            self.order.remove(&r);
            self.incoming += usize::from(self.pending.contains_key(&h));
        }
    }

    /// A request sent will store `keys` when the engine admits it.
    pub fn expect(&mut self, keys: &[BlockHash]) {
        self.kept_from.set(None);
        for &h in keys {
            let n = self.pending.entry(h).or_insert(0);
            *n += 1;
            self.incoming += usize::from(*n == 1 && !self.rank.contains_key(&h));
        }
    }

    /// A request [`Self::expect`] named `keys` for is admitted or over.
    pub fn expected(&mut self, keys: &[BlockHash]) {
        self.kept_from.set(None);
        for h in keys {
            let Some(n) = self.pending.get_mut(h) else { continue };
            *n -= 1;
            if *n == 0 {
                self.pending.remove(h);
                if !self.rank.contains_key(h) {
                    self.incoming = self.incoming.saturating_sub(1);
                }
            }
        }
    }

    /// A request that used `keys` (its prompt's blocks, first first)
    /// finished: those held become the most recent, the first one last.
    pub fn finished(&mut self, keys: &[BlockHash]) {
        for &h in keys.iter().rev() {
            if self.rank.contains_key(&h) {
                self.touch(h);
            }
        }
    }

    /// Approximate mode: a request with these full prompt blocks was sent.
    /// They are stored (the most recent, the first one last) and the least
    /// recent others go past the tier's size.
    pub fn sent(&mut self, keys: &[BlockHash]) {
        self.kept_from.set(None);
        for &h in keys.iter().rev() {
            self.touch(h);
        }
        let size = self.size();
        while self.rank.len() > size {
            let Some((_, h)) = self.order.pop_first() else { break };
            self.rank.remove(&h);
            self.incoming += usize::from(self.pending.contains_key(&h));
        }
    }

    /// How many of `keys`, consecutive from the first, will still be held
    /// when a request sent now looks them up: the blocks the requests
    /// ahead of it will store first evict the least recent past the tier's
    /// size.
    pub fn run(&self, keys: &[BlockHash]) -> usize {
        if keys.first().is_none_or(|h| !self.rank.contains_key(h)) {
            return 0;
        }
        // Blocks ranked below this one are gone by then.
        let kept_from = self.kept_from.get().unwrap_or_else(|| {
            let doomed = (self.rank.len() + self.incoming).saturating_sub(self.size()).min(self.rank.len());
            let from = self.order.keys().nth(doomed).copied().unwrap_or(u64::MAX);
            self.kept_from.set(Some(from));
            from
        });
        keys.iter().take_while(|h| self.rank.get(h).is_some_and(|&r| r >= kept_from)).count()
    }

    /// `h` becomes the most recent; every change to the order passes here
    /// or clears the rank found ([`Self::run`]) itself.
    fn touch(&mut self, h: BlockHash) {
        self.kept_from.set(None);
        self.next += 1;
        match self.rank.insert(h, self.next) {
            Some(old) => {
                self.order.remove(&old);
            }
            None if self.pending.contains_key(&h) => self.incoming = self.incoming.saturating_sub(1),
            None => {}
        }
        self.order.insert(self.next, h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` blocks the tier lacks, expected from requests sent.
    fn coming(t: &mut HostOrder, n: u128) -> Vec<BlockHash> {
        let keys: Vec<BlockHash> = (1_000..1_000 + n).collect();
        t.expect(&keys);
        keys
    }

    #[test]
    fn blocks_are_evicted_least_recent_first_and_a_finish_refreshes_the_first_block_last() {
        let mut t = HostOrder::new(Some(4));
        for h in 1..=4 {
            t.stored(h);
        }
        t.finished(&[1, 2, 9]);
        // Least recent first: 3, 4, then 2, then 1.
        assert_eq!(t.run(&[1, 2, 3, 4]), 4);
        let one = coming(&mut t, 1);
        assert_eq!((t.run(&[3, 4]), t.run(&[4])), (0, 1), "one block to come evicts 3");
        t.expected(&one);
        let three = coming(&mut t, 3);
        assert_eq!(t.run(&[1, 2]), 1, "three evict 3, 4 and 2");
        // Stored as foretold: nothing more is to come.
        t.removed(3);
        t.removed(4);
        t.removed(2);
        for &h in &three {
            t.stored(h);
        }
        assert_eq!(t.run(&[1]), 1);
        t.expected(&three);
        assert_eq!((t.contains(2), t.run(&[1, 2])), (false, 1));
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
        assert_eq!(t.run(&[2]), 1);
        coming(&mut t, 1);
        assert_eq!((t.run(&[2]), t.run(&[3])), (0, 1));
    }

    #[test]
    fn sent_prompts_are_stored_and_the_least_recent_go() {
        let mut t = HostOrder::new(Some(3));
        t.sent(&[1, 2]);
        t.sent(&[5, 6]);
        // 2 was the least recent (1 was refreshed after it).
        assert_eq!((t.contains(1), t.contains(2), t.contains(5), t.contains(6)), (true, false, true, true));
        t.sent(&[1, 7, 8, 9]);
        assert_eq!(t.run(&[1, 7, 8]), 3, "a prompt longer than the tier keeps its head");
        // A prompt expected and then sent is to come no more.
        t.expect(&[20, 21]);
        assert_eq!((t.run(&[7]), t.run(&[1])), (0, 1), "two to come evict 8 and 7");
        t.sent(&[20, 21]);
        t.expected(&[20, 21]);
        assert_eq!(t.run(&[20, 21]), 2);
    }
}
