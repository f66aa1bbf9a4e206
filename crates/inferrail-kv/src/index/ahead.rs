//! The queue ahead: what the requests waiting on an approximate replica
//! will do to its cache before a request sent there now starts.
//!
//! The engine admits waiting requests first come first, so every one queued
//! now starts before a request sent now. The head waits until running
//! requests have ended and freed enough room; it then takes its reused
//! blocks out of the free queue, takes fresh blocks from the empty room and
//! then from the least recently freed blocks (evicting them), and stores
//! its prompt's blocks under their names. A lookup must see the cache as
//! the new request will find it: the blocks the queue will evict absent,
//! the blocks it will store present (ADR 0050). Running requests are taken
//! to end in the order they were recorded, each at its first token plus
//! its span of block times (never, while it has not begun decoding).
//! Before each ends, the others' outputs take the blocks they fill by then
//! (ADR 0054); it takes what it still owes and frees its blocks as
//! `complete` does, behind every block free before.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;

use super::shadow::Shadow;
use super::{FoldState, PLACEHOLDER, Pace, Request, is_placeholder};
use crate::hash::BlockHash;

/// Blocks the forecast takes for the queue at most, and at most twice the
/// cache (half a million tokens in blocks of 16): it runs under the
/// index's lock after every change on a replica with a queue, and a request
/// sent behind more than this waits long enough that the rest of the queue
/// is not followed.
pub(super) const FORESIGHT: usize = 1 << 15;

/// When a running request ends at `per_block` seconds a block: its first
/// token plus its span of block times; never, while it has not begun
/// decoding.
pub(super) fn ends(since: Option<(Duration, Pace)>, per_block: f64) -> Duration {
    let Some((at, pace)) = since else { return Duration::MAX };
    // Spans come from what requests asked for: an absurd one ends never, not in a panic.
    at.saturating_add(Duration::try_from_secs_f64(pace.span * per_block).unwrap_or(Duration::MAX))
}

/// A set of block hashes, hashed as the index hashes them.
type Blocks = HashSet<BlockHash, FoldState>;

/// What the waiting requests will have done when a request sent now starts.
#[derive(Debug, Default)]
pub(super) struct Ahead {
    /// Blocks held now that will be gone (placeholders too).
    evicted: Blocks,
    /// Blocks not held now that the queue will store.
    stored: Blocks,
    /// Blocks the queue's requests will hold (the ones they reuse).
    held: Blocks,
    /// Blocks in use now that ended requests will have freed, still free.
    released: Blocks,
}

impl Ahead {
    /// Admits `queue`'s waiting requests in order against `shadow`, each
    /// once enough running requests have ended for it to fit (or none is
    /// left), and in full.
    pub(super) fn foresee(shadow: &Shadow, requests: &HashMap<u64, Request>, queue: &VecDeque<u64>, per_block: Option<f64>) -> Self {
        let mut ending: Vec<(u64, Duration, &Request)> = requests
            .iter()
            .filter_map(|(&id, r)| match r {
                Request::Running { since, .. } => Some((id, per_block.map_or(Duration::MAX, |t| ends(*since, t)), r)),
                _ => None,
            })
            .collect();
        ending.sort_unstable_by_key(|&(id, ..)| id);
        let mut run = Run {
            shadow,
            ahead: Ahead::default(),
            empty: shadow.cap() - shadow.len(),
            available: shadow.available(),
            oldest: shadow.oldest_free(),
            freed: VecDeque::new(),
            ending: ending.into_iter().map(|(_, end, r)| (end, r, 0)).collect(),
            per_block,
            let_go: HashMap::default(),
            taken: 0,
            unnamed: 0,
        };
        let budget = FORESIGHT.min(2 * shadow.cap());
        for id in queue {
            if run.taken > budget {
                break;
            }
            let Some(&Request::Waiting { ref prompt, reusable, partial, output, .. }) = requests.get(id) else { continue };
            let reusable = &prompt[..reusable.min(prompt.len())];
            // An ending request may evict one first (with the blocks its output still owes).
            let mut hits;
            loop {
                hits = reusable.iter().take_while(|&&h| run.ahead.holds(shadow, h)).count();
                let free_reused = prompt[..hits].iter().filter(|&&h| run.is_free(h)).count();
                if prompt.len() - hits + partial + free_reused <= run.available || !run.end_one() {
                    break;
                }
            }
            for &h in &prompt[..hits] {
                if run.is_free(h) {
                    run.available = run.available.saturating_sub(1);
                }
                run.ahead.released.remove(&h);
                run.ahead.held.insert(h);
            }
            run.take(prompt.len() - hits + partial);
            // A fresh block takes the prompt's name unless the replica holds that block elsewhere.
            for &h in &prompt[hits..] {
                if !run.ahead.holds(shadow, h) {
                    run.ahead.stored.insert(h);
                    run.ahead.evicted.remove(&h);
                }
            }
            run.take(output);
        }
        run.ahead
    }

    /// Whether the replica will hold `h` when a request sent now starts.
    pub(super) fn holds(&self, shadow: &Shadow, h: BlockHash) -> bool {
        self.stored.contains(&h) || (shadow.contains(h) && !self.evicted.contains(&h))
    }

    /// Whether a request in flight will hold `h` then.
    pub(super) fn in_use(&self, shadow: &Shadow, h: BlockHash) -> bool {
        self.stored.contains(&h)
            || self.held.contains(&h)
            || (shadow.in_use(h) == Some(true) && !self.released.contains(&h) && !self.evicted.contains(&h))
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
        self.evicted.is_empty() && self.stored.is_empty() && self.held.is_empty() && self.released.is_empty()
    }
}

/// The replica's pool as the forecast runs it.
struct Run<'a, I> {
    shadow: &'a Shadow,
    ahead: Ahead,
    /// Blocks never used.
    empty: usize,
    /// Blocks neither in use nor about to be (the engine's free count).
    available: usize,
    /// The shadow's free blocks, oldest first.
    oldest: I,
    /// Blocks freed by the running requests ended so far, in freeing order.
    freed: VecDeque<BlockHash>,
    /// Running requests in the order they will end: when, and the output
    /// blocks each has taken so far in the forecast.
    ending: VecDeque<(Duration, &'a Request, usize)>,
    /// The replica's block time, if known.
    per_block: Option<f64>,
    /// Holders each block has lost to ended requests.
    let_go: HashMap<BlockHash, u32, FoldState>,
    /// Fresh blocks taken so far.
    taken: usize,
    /// Placeholders made so far.
    unnamed: u64,
}

impl<I: Iterator<Item = BlockHash>> Run<'_, I> {
    /// Whether `h` sits in the free queue then.
    fn is_free(&self, h: BlockHash) -> bool {
        // A block evicted on paper and stored again is the storing request's.
        let free_now = self.shadow.in_use(h) == Some(false) && !self.ahead.evicted.contains(&h) && !self.ahead.stored.contains(&h);
        !self.ahead.held.contains(&h) && (free_now || self.ahead.released.contains(&h))
    }

    /// The next running request ends; false when none is left.
    fn end_one(&mut self) -> bool {
        let Some((end, Request::Running { keys, generated, owed, ends_partial, .. }, grown)) = self.ending.pop_front() else {
            return false;
        };
        // Until then the others' outputs take the blocks they fill.
        if let Some(per_block) = self.per_block {
            let mut due = 0;
            for (_, other, taken) in &mut self.ending {
                if let Request::Running { generated, owed, since: Some((at, pace)), .. } = other {
                    let filled = pace.filled(end.saturating_sub(*at), per_block).saturating_sub(generated.len()).min(*owed);
                    due += filled.saturating_sub(*taken);
                    *taken = (*taken).max(filled);
                }
            }
            self.take(due);
        }
        // The blocks its output has still to fill are taken before it ends (unnamed), and freed first.
        self.take(owed.saturating_sub(grown));
        let owed: Vec<BlockHash> = (0..*owed).map(|_| self.unnamed()).collect();
        for (i, &h) in owed.iter().rev().chain(generated.iter().rev()).chain(keys.iter().rev()).enumerate() {
            let lost = self.let_go.entry(h).or_default();
            *lost += 1;
            if *lost < self.shadow.holders(h) || self.ahead.held.contains(&h) {
                continue;
            }
            self.available += 1;
            if i == 0 && *ends_partial && is_placeholder(h) {
                // Its last block, not full, becomes room.
                self.empty += 1;
                self.ahead.evicted.insert(h);
            } else {
                self.freed.push_back(h);
                self.ahead.released.insert(h);
            }
        }
        true
    }

    /// A placeholder for a block a running request will fill before it
    /// ends: counted down from the top, apart from the index's own.
    fn unnamed(&mut self) -> BlockHash {
        self.unnamed += 1;
        PLACEHOLDER | BlockHash::from(u64::MAX - self.unnamed)
    }

    /// The least recently freed block, to evict: one free now, else one an
    /// ended request freed.
    fn oldest(&mut self) -> Option<BlockHash> {
        let held = &self.ahead.held;
        if let Some(h) = self.oldest.by_ref().find(|h| !held.contains(h)) {
            return Some(h);
        }
        while let Some(h) = self.freed.pop_front() {
            if self.ahead.released.remove(&h) {
                return Some(h);
            }
        }
        None
    }

    /// Takes `n` fresh blocks: the empty ones, then the least recently
    /// freed, then (when none is left) blocks not followed.
    fn take(&mut self, n: usize) {
        self.taken += n;
        self.available = self.available.saturating_sub(n);
        let from_empty = n.min(self.empty);
        self.empty -= from_empty;
        for _ in from_empty..n {
            let Some(h) = self.oldest() else { break };
            self.ahead.evicted.insert(h);
        }
    }
}
