//! The queue ahead: what the requests waiting on an approximate replica
//! will do to its cache before a request sent there now starts.
//!
//! The engine admits waiting requests first come first, so every one queued
//! now starts before a request sent now. Each takes its reused blocks out of
//! the free queue, takes fresh blocks from the empty room and then from the
//! least recently freed blocks (evicting them), and stores its prompt's
//! blocks under their names. A lookup must see the cache as the new request
//! will find it: the blocks the queue will evict absent, the blocks it will
//! store present (ADR 0050). The requests running now are taken to end
//! after: the blocks they free go behind every block free now, so the
//! queue's evictions come from those first.

use std::collections::{HashMap, HashSet, VecDeque};

use super::Request;
use super::shadow::Shadow;
use crate::hash::BlockHash;

/// The blocks the waiting requests will evict, reuse and store.
#[derive(Debug, Default)]
pub(super) struct Ahead {
    /// Blocks held now that the queue's requests will evict (placeholders too).
    evicted: HashSet<BlockHash>,
    /// Blocks free now that they will reuse, and so hold.
    reused: HashSet<BlockHash>,
    /// Blocks not held now that they will store.
    stored: HashSet<BlockHash>,
}

impl Ahead {
    /// Admits `queue`'s waiting requests in order against `shadow`, each
    /// in full: the room it takes comes from the empty blocks, then from the
    /// blocks free now, oldest first, then from blocks the running requests
    /// will free, which are not followed.
    pub(super) fn foresee(shadow: &Shadow, requests: &HashMap<u64, Request>, queue: &VecDeque<u64>) -> Self {
        let mut ahead = Ahead::default();
        let mut empty = shadow.cap() - shadow.len();
        let mut oldest = shadow.oldest_free();
        for id in queue {
            let Some(&Request::Waiting { ref prompt, reusable, partial, output, .. }) = requests.get(id) else { continue };
            let hits = prompt[..reusable.min(prompt.len())].iter().take_while(|&&h| ahead.holds(shadow, h)).count();
            for &h in &prompt[..hits] {
                if shadow.in_use(h) == Some(false) && !ahead.stored.contains(&h) {
                    ahead.reused.insert(h);
                }
            }
            // The prompt's fresh blocks (and its partial last one), then its output's.
            for (i, need) in [prompt.len() - hits + partial, output].into_iter().enumerate() {
                let from_empty = need.min(empty);
                empty -= from_empty;
                let mut evicting = need - from_empty;
                while evicting > 0 {
                    let Some(h) = oldest.next() else { break };
                    if !ahead.reused.contains(&h) {
                        ahead.evicted.insert(h);
                        evicting -= 1;
                    }
                }
                if i == 0 {
                    // A fresh block takes the prompt's name unless the replica holds that block elsewhere.
                    for &h in &prompt[hits..] {
                        if !ahead.holds(shadow, h) {
                            ahead.stored.insert(h);
                            ahead.evicted.remove(&h);
                        }
                    }
                }
            }
        }
        ahead
    }

    /// Whether the replica will hold `h` when a request sent now starts.
    pub(super) fn holds(&self, shadow: &Shadow, h: BlockHash) -> bool {
        self.stored.contains(&h) || (shadow.contains(h) && !self.evicted.contains(&h))
    }

    /// Whether a request in flight will hold `h` then.
    pub(super) fn in_use(&self, shadow: &Shadow, h: BlockHash) -> bool {
        self.stored.contains(&h) || self.reused.contains(&h) || shadow.in_use(h) == Some(true)
    }

    /// Every block whose presence the queue changes.
    pub(super) fn changed(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.evicted.iter().chain(&self.stored).copied()
    }

    /// The blocks presented that the shadow does not hold.
    pub(super) fn stored(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.stored.iter().copied()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.evicted.is_empty() && self.stored.is_empty() && self.reused.is_empty()
    }
}
