//! Lookups: how many leading blocks of a prompt each replica holds, and
//! how many of those a request in flight there holds.

use super::{KvIndex, Slot};
use crate::hash::BlockHash;

impl KvIndex {
    /// How many leading blocks of `hashes` each of `slots` holds.
    ///
    /// A shadow holds whole prefixes (`record` frees a prompt's last block
    /// first, and takes back only what follows the blocks it reused), so the
    /// replicas holding block `d` hold every block before it too. The search
    /// bisects the prompt: the replicas holding the same blocks at both ends
    /// of a stretch all stop outside it, and only stretches where some
    /// replica stops are probed further, about log2(blocks) probes per
    /// distinct depth rather than one per block.
    pub fn matched(&self, hashes: &[BlockHash], slots: &[Slot]) -> Vec<usize> {
        // The slots asked about, 64 to a word of the holder bitmaps; each word is searched on its own.
        let mut words: Vec<u64> = Vec::new();
        for &s in slots {
            set_bit(&mut words, s);
        }
        let mut depth_of = vec![0; words.len() * 64];
        // Stretches [lo, hi) with the slots holding the first lo and the first hi
        // blocks; the slots in the first set and not the second stop inside it.
        // A level's stretches are split together: their probes do not wait
        // for one another, so the processor overlaps them.
        let (mut level, mut next): (Vec<(usize, usize, u64, u64)>, Vec<_>) = (Vec::with_capacity(64), Vec::with_capacity(64));
        for (w, &wanted) in words.iter().enumerate().filter(|(_, wanted)| **wanted != 0) {
            level.push((0, hashes.len() + 1, wanted, 0));
            while !level.is_empty() {
                for &(lo, hi, at_lo, at_hi) in &level {
                    if hi == lo + 1 {
                        let mut stop = at_lo & !at_hi;
                        while stop != 0 {
                            depth_of[w * 64 + stop.trailing_zeros() as usize] = lo;
                            stop &= stop - 1;
                        }
                        continue;
                    }
                    let mid = (lo + hi) / 2;
                    let at_mid = at_lo & self.holders.word(hashes[mid - 1], w);
                    for half in [(lo, mid, at_lo, at_mid), (mid, hi, at_mid, at_hi)] {
                        if half.2 != half.3 {
                            next.push(half);
                        }
                    }
                }
                std::mem::swap(&mut level, &mut next);
                next.clear();
            }
        }
        slots.iter().map(|&s| depth_of[s as usize]).collect()
    }

    /// Of the first `depth` blocks of `hashes` each `(slot, depth)` holds,
    /// how many a request in flight there holds: the engine reuses those
    /// without taking them out of its free pool. A request holds a whole
    /// prefix of its prompt, so these are leading blocks too, found by
    /// bisection. Without a match anywhere the replicas are not locked.
    pub fn held(&self, hashes: &[BlockHash], at: &[(Slot, usize)]) -> Vec<usize> {
        if at.iter().all(|&(_, depth)| depth == 0) {
            return vec![0; at.len()];
        }
        let replicas = self.lock();
        at.iter()
            .map(|&(slot, depth)| {
                let Some(rep) = replicas.get(&slot).filter(|_| depth > 0) else { return 0 };
                let prefix = &hashes[..depth.min(hashes.len())];
                match &rep.exact {
                    Some(exact) => prefix.partition_point(|&h| exact.claimed(h)),
                    None => prefix.partition_point(|&h| rep.ahead.in_use(&rep.shadow, h)),
                }
            })
            .collect()
    }
}

fn set_bit(bits: &mut Vec<u64>, slot: Slot) {
    let w = slot as usize / 64;
    if bits.len() <= w {
        bits.resize(w + 1, 0);
    }
    bits[w] |= 1 << (slot % 64);
}
