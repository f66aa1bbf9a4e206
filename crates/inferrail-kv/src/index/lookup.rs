//! Lookups: how many leading blocks of a prompt each replica holds, how
//! many of those a request in flight there holds, and how many it would
//! still hold once a prompt that must wait for room there starts.

use std::collections::HashMap;
use std::time::Duration;

use super::exact::Exact;
use super::{FoldState, KvIndex, Pace, Replica, Request, Slot, ahead, is_placeholder};
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

impl KvIndex {
    /// For each `(slot, matched, need)`: of the `matched` leading blocks of
    /// `hashes` on `slot`, how many a request sent at `now` still finds
    /// when it starts, needing `need` fresh blocks; under one lock. Where
    /// they do not fit beside the running requests (with the matched blocks
    /// it takes out of the free pool), it waits until enough of those have
    /// ended (each at its first token plus its span of block times), and
    /// meanwhile the others' outputs grow into the least recently freed
    /// blocks, which take a prefix from its tail. It starts no sooner than
    /// the prefills admitted before it have ended, one after another, at
    /// the replica's learned prefill time. Unchanged behind a queue (its
    /// forecast stands), where the request fits with no prefill ahead, and
    /// where the replica's block time is not known.
    pub fn kept_through_wait(&self, hashes: &[BlockHash], at: &[(Slot, usize, usize)], now: Duration) -> Vec<usize> {
        let replicas = self.lock();
        at.iter().map(|&(slot, matched, need)| replicas.get(&slot).map_or(matched, |rep| kept(rep, hashes, matched, need, now))).collect()
    }
}

/// `KvIndex::kept_through_wait` on one replica.
fn kept(rep: &Replica, hashes: &[BlockHash], matched: usize, need: usize, now: Duration) -> usize {
    if let Some(exact) = &rep.exact {
        return kept_exact(rep, exact, hashes, matched, need, now);
    }
    if !rep.queue.is_empty() {
        return matched;
    }
    let Some(per_block) = rep.per_block() else { return matched };
    let shadow = &rep.shadow;
    let prefix = &hashes[..matched.min(hashes.len())];
    let demand = need + prefix.iter().filter(|&&h| shadow.in_use(h) == Some(false)).count();
    let available = shadow.available();
    // It starts no sooner than the prefills admitted before it end, one after another.
    let prefilled = rep.prefills_end().unwrap_or(now).max(now);
    if demand <= available && prefilled <= now {
        return matched;
    }
    // Each running request: when it ends, the blocks it frees then (those
    // no request still running holds), what its output has filled and
    // what it owes, its pace, and whether its last block will be room
    // (not full, and unnamed).
    let mut running: Vec<_> = rep
        .requests
        .values()
        .filter_map(|r| match r {
            Request::Running { keys, generated, owed, since, ends_partial, .. } => {
                let end = ends_by(*since, *owed, per_block, now);
                let room = *ends_partial && (*owed > 0 || keys.iter().chain(generated).last().is_some_and(|&h| is_placeholder(h)));
                Some((end, keys.iter().chain(generated), generated.len(), *owed, *since, room))
            }
            _ => None,
        })
        .collect();
    running.sort_by_key(|r| r.0);
    // Block hashes are uniform: the index's own hasher, not SipHash (this
    // runs for every candidate of every decision while a prompt must wait).
    let blocks = running.iter().map(|r| r.1.size_hint().0).sum();
    let mut holders: HashMap<BlockHash, u32, FoldState> = HashMap::with_capacity_and_hasher(blocks, FoldState::default());
    // What each frees, last block first as the engine frees them: those no
    // request still running holds.
    let running: Vec<_> = running
        .into_iter()
        .map(|(end, blocks, generated, owed, since, room)| {
            let mut freed: Vec<BlockHash> = blocks
                .filter(|&&h| {
                    let left = holders.entry(h).or_insert_with(|| shadow.holders(h));
                    *left = left.saturating_sub(1);
                    *left == 0
                })
                .copied()
                .collect();
            freed.reverse();
            (end, freed, generated, owed, since, room)
        })
        .collect();
    // By `t`: blocks the ended requests freed (with the output blocks they
    // took first), and blocks the outputs took (the ended ones' in full).
    let by = |t: Duration| {
        let (mut freed, mut grown) = (0, 0);
        for &(end, ref holds, generated, owed, since, _) in &running {
            if end <= t {
                freed += holds.len() + owed;
                grown += owed;
            } else if let Some((at, pace)) = since {
                grown += pace.filled(t.saturating_sub(at), per_block).saturating_sub(generated).min(owed);
            }
        }
        (freed, grown)
    };
    let Some(start) = starts(prefilled, running.iter().map(|r| r.0), &by, available, demand) else { return matched };
    // The outputs' growth first fills the room never used, and the room
    // each request that ended leaves in its last block when not full
    // (it caches nothing), then evicts the least recently freed blocks.
    let (mut room, mut taken, mut evictions) = (shadow.cap() - shadow.len(), 0, 0);
    let mut grow_to = |grown: usize, room: &mut usize| {
        let more = grown.saturating_sub(taken);
        evictions += more.saturating_sub(*room);
        *room = room.saturating_sub(more);
        taken = taken.max(grown);
    };
    for r in running.iter().take_while(|r| r.0 <= start) {
        grow_to(by(r.0).1, &mut room);
        room += usize::from(r.5);
    }
    grow_to(by(start).1, &mut room);
    // The blocks free now in the engine's order, then what each request that
    // ended frees, in the order they end: its output still owed, then its
    // blocks from the last.
    let order = shadow.oldest_free().map(Some).chain(
        running
            .iter()
            .take_while(|r| r.0 <= start)
            .flat_map(|(_, freed, _, owed, _, _)| std::iter::repeat_n(None, *owed).chain(freed.iter().copied().map(Some))),
    );
    let evicted: std::collections::HashSet<BlockHash> = order.take(evictions).flatten().collect();
    prefix.iter().position(|h| evicted.contains(h)).unwrap_or(matched)
}

/// When a request in flight ends, at `per_block` seconds a block: its
/// first token plus its span of block times; one not yet decoding is taken
/// to start now and owe `owed` blocks.
fn ends_by(since: Option<(Duration, Pace)>, owed: usize, per_block: f64, now: Duration) -> Duration {
    match since {
        Some(_) => ahead::ends(since, per_block),
        None => now.saturating_add(Duration::try_from_secs_f64(owed as f64 * per_block).unwrap_or(Duration::MAX)),
    }
}

/// When a request waiting for `demand` blocks starts: once the prefills
/// ahead have ended (`prefilled`) and, at one of the running requests'
/// `ends`, the blocks `available` now and those freed by then (`by`:
/// freed, and taken by the outputs meanwhile) leave it room.
fn starts(
    prefilled: Duration,
    ends: impl Iterator<Item = Duration>,
    by: &impl Fn(Duration) -> (usize, usize),
    available: usize,
    demand: usize,
) -> Option<Duration> {
    std::iter::once(prefilled).chain(ends.map(|end| end.max(prefilled))).find(|&t| {
        let (freed, grown) = by(t);
        (available + freed).saturating_sub(grown) >= demand
    })
}

/// A request in flight on an exact replica, for the wait forecast: when it
/// ends, the prompt blocks it frees then (deepest first), its output in
/// blocks, and its first token and pace.
type InFlight = (Duration, Vec<BlockHash>, usize, Option<(Duration, Pace)>);

/// A request in flight on an exact replica, as recorded: when it
/// ends, its prompt, its output in blocks, and its first token and pace.
type Claim<'a> = (Duration, &'a [BlockHash], usize, Option<(Duration, Pace)>);

/// `kept` on a replica in exact mode (ADR 0055, ADR 0061): the engine's events say
/// what it holds now and the claims what the requests sent will allocate;
/// where a request sent now must wait for room (or for the prefills ahead),
/// the requests in flight end in turn, each at its first token plus its
/// span of block times, freeing its output and the prompt blocks no request
/// still in flight claims, and meanwhile their outputs grow from their first
/// tokens. Past the empty room, each block the requests sent take evicts the
/// next free one: those free now in the engine's order, then what each
/// request that ends frees, in the order they end (its output first, then
/// its prompt from the tail, as the engine frees a request's blocks). A
/// prefix a request in flight claims now is kept only if it survives that.
fn kept_exact(rep: &Replica, exact: &Exact, hashes: &[BlockHash], matched: usize, need: usize, now: Duration) -> usize {
    let Some(per_block) = rep.per_block() else { return matched };
    let prefix = &hashes[..matched.min(hashes.len())];
    let demand = need + prefix.iter().filter(|&&h| !exact.claimed(h)).count();
    let available = exact.available();
    let prefilled = rep.prefills_end().unwrap_or(now).max(now);
    if demand <= available && prefilled <= now {
        return matched;
    }
    // Each request in flight, in the order they end.
    let mut running: Vec<Claim<'_>> = rep
        .requests
        .values()
        .filter_map(|r| match r {
            Request::Claiming { keys, output, since, .. } => {
                Some((ends_by(*since, *output, per_block, now), keys.as_slice(), *output, *since))
            }
            _ => None,
        })
        .collect();
    running.sort_by_key(|r| r.0);
    // The prompt blocks each frees when it ends: those its end leaves unclaimed.
    let mut claims: HashMap<BlockHash, u32, FoldState> = HashMap::default();
    let running: Vec<InFlight> = running
        .into_iter()
        .map(|(end, keys, output, since)| {
            let freed = keys
                .iter()
                .rev()
                .filter(|&&h| {
                    let left = claims.entry(h).or_insert_with(|| exact.claims_of(h));
                    *left = left.saturating_sub(1);
                    *left == 0
                })
                .copied()
                .collect();
            (end, freed, output, since)
        })
        .collect();
    // None before its first token (an estimated one may still be to come).
    let filled = |since: Option<(Duration, Pace)>, t: Duration, output: usize| match since {
        Some((at, pace)) if t >= at => pace.filled(t - at, per_block).min(output),
        _ => 0,
    };
    // By `t` (now at the earliest: a request may be taken to have ended
    // before now): blocks freed by the requests ended, and output blocks
    // taken since now.
    let by = |t: Duration| {
        let t = t.max(now);
        let (mut freed, mut grown) = (0, 0);
        for (end, own, output, since) in &running {
            let before = filled(*since, now, *output);
            if *end <= t {
                freed += own.len() + output;
                grown += output - before;
            } else {
                grown += filled(*since, t, *output) - before;
            }
        }
        (freed, grown)
    };
    let Some(start) = starts(prefilled, running.iter().map(|r| r.0), &by, available, demand) else { return matched };
    let ended = || running.iter().take_while(|r| r.0 <= start);
    // The allocations to come first fill the room never used, and the room
    // each request that ended leaves in the block it held unnamed, then
    // evict.
    let (mut room, mut taken, mut evictions) = (exact.empty(), 0, 0);
    let mut allocate_to = |allocated: usize, room: &mut usize| {
        let more = allocated.saturating_sub(taken);
        evictions += more.saturating_sub(*room);
        *room = room.saturating_sub(more);
        taken = taken.max(allocated);
    };
    for r in ended() {
        allocate_to(exact.to_allocate() + by(r.0).1, &mut room);
        room += 1;
    }
    allocate_to(exact.to_allocate() + by(start).1, &mut room);
    let order = exact.free_order().map(Some).chain(ended().flat_map(|(_, own, output, since)| {
        let more = output - filled(*since, now, *output);
        std::iter::repeat_n(None, more).chain(own.iter().copied().map(Some))
    }));
    let evicted: std::collections::HashSet<BlockHash> = order.take(evictions).flatten().collect();
    prefix.iter().position(|h| evicted.contains(h)).unwrap_or(matched)
}

fn set_bit(bits: &mut Vec<u64>, slot: Slot) {
    let w = slot as usize / 64;
    if bits.len() <= w {
        bits.resize(w + 1, 0);
    }
    bits[w] |= 1 << (slot % 64);
}
