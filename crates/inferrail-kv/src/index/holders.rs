//! The holder map: for each block hash, the replicas holding it, as a
//! bitmap of slots. Lookups read it from any thread while one writer (the
//! index, under its lock) changes it.
//!
//! It is split in 64 shards, each a hash table behind its own lock: a
//! lookup locks one shard for one probe, and a table reuses the slots of
//! the entries removed from it. The map churns as fast as prompts arrive
//! (a 220 KB prompt adds about 2,300 blocks and evicts as many), and a
//! concurrent map that leaves removed entries as tombstones must copy its
//! whole table now and then to reclaim them, holding every lookup for the
//! copy (ADR 0036); here a table rehashes in place, one shard at a time.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::{FoldState, Slot};
use crate::hash::BlockHash;

const SHARDS: usize = 64;

type Shard = HashMap<BlockHash, Bits, FoldState>;

/// The holder map; see the module doc.
#[derive(Debug)]
pub(super) struct Holders {
    shards: Box<[RwLock<Shard>]>,
}

impl Holders {
    pub(super) fn new() -> Self {
        Self { shards: (0..SHARDS).map(|_| RwLock::new(Shard::default())).collect() }
    }

    /// The shard of `h`, chosen by bits of its hash that the tables within
    /// do not use to place or tag entries (the low bits and the top seven).
    fn shard(&self, h: BlockHash) -> &RwLock<Shard> {
        &self.shards[(FoldState::default().hash_one(h) >> 40) as usize % SHARDS]
    }

    fn read(&self, h: BlockHash) -> RwLockReadGuard<'_, Shard> {
        self.shard(h).read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self, h: BlockHash) -> RwLockWriteGuard<'_, Shard> {
        self.shard(h).write().unwrap_or_else(|p| p.into_inner())
    }

    /// Every block some replica holds, with the slots holding it (among the first 64).
    #[cfg(test)]
    pub(super) fn entries(&self) -> Vec<(BlockHash, u64)> {
        self.shards
            .iter()
            .flat_map(|s| s.read().unwrap_or_else(|p| p.into_inner()).iter().map(|(&h, b)| (h, b.word(0))).collect::<Vec<_>>())
            .collect()
    }

    /// `slot` holds `h` from now on; false if it did already.
    pub(super) fn add(&self, h: BlockHash, slot: Slot) -> bool {
        let mut shard = self.write(h);
        let bits = shard.entry(h).or_default();
        let added = !bits.has(slot);
        bits.set(slot);
        added
    }

    /// `slot` no longer holds `h`.
    pub(super) fn release(&self, h: BlockHash, slot: Slot) {
        let mut shard = self.write(h);
        if let Some(bits) = shard.get_mut(&h) {
            bits.clear(slot);
            if bits.is_empty() {
                shard.remove(&h);
            }
        }
    }

    /// Word `w` of `h`'s holder bitmap (slots `64 w` to `64 w + 63`).
    pub(super) fn word(&self, h: BlockHash, w: usize) -> u64 {
        self.read(h).get(&h).map_or(0, |b| b.word(w))
    }

    /// Makes room for `total` blocks in all, spread over the shards.
    pub(super) fn reserve(&self, total: usize) {
        let each = total.div_ceil(SHARDS);
        for shard in &self.shards {
            let mut shard = shard.write().unwrap_or_else(|p| p.into_inner());
            let more = each.saturating_sub(shard.len());
            shard.reserve(more);
        }
    }

    /// Bytes the tables have allocated: a table keeps an entry and a control
    /// byte a bucket, and at least one bucket in eight empty.
    pub(super) fn bytes(&self) -> usize {
        let per_bucket = size_of::<(BlockHash, Bits)>() + 1;
        self.shards
            .iter()
            .map(|s| {
                let capacity = s.read().unwrap_or_else(|p| p.into_inner()).capacity();
                let buckets = if capacity == 0 { 0 } else { (capacity * 8 / 7).next_power_of_two() };
                buckets * per_bucket
            })
            .sum()
    }
}

/// The slots holding a block: the first 64 inline, so the common fleet costs
/// no allocation beyond the table's entry; more in a boxed tail.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Bits {
    low: u64,
    /// Words 1.. of the bitmap (slot `s` is bit `s % 64` of word `s / 64`).
    high: Option<Box<[u64]>>,
}

impl Bits {
    fn word(&self, i: usize) -> u64 {
        match i {
            0 => self.low,
            _ => self.high.as_ref().and_then(|h| h.get(i - 1)).copied().unwrap_or(0),
        }
    }

    fn has(&self, slot: Slot) -> bool {
        self.word(slot as usize / 64) & (1 << (slot % 64)) != 0
    }

    fn set(&mut self, slot: Slot) {
        let (w, bit) = (slot as usize / 64, 1u64 << (slot % 64));
        if w == 0 {
            self.low |= bit;
            return;
        }
        let mut high = self.high.take().map(Vec::from).unwrap_or_default();
        if high.len() < w {
            high.resize(w, 0);
        }
        high[w - 1] |= bit;
        self.high = Some(high.into());
    }

    fn clear(&mut self, slot: Slot) {
        let (w, bit) = (slot as usize / 64, 1u64 << (slot % 64));
        match (w, self.high.as_mut()) {
            (0, _) => self.low &= !bit,
            (w, Some(high)) if w <= high.len() => high[w - 1] &= !bit,
            _ => {}
        }
        if self.high.as_ref().is_some_and(|h| h.iter().all(|&x| x == 0)) {
            self.high = None;
        }
    }

    fn is_empty(&self) -> bool {
        self.low == 0 && self.high.is_none()
    }
}
