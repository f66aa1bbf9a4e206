//! Lookups: how many leading blocks of a prompt each replica holds, how
//! many of those a request in flight there holds, and how many it would
//! still hold once a prompt that must wait for room there starts.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use super::exact::Exact;
use super::{ESTIMATED_AT_MOST, FoldState, KvIndex, Pace, Replica, Request, Slot, ahead, is_placeholder};
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
    /// For each [`Wait`]: of the `matched` leading blocks of `hashes` on
    /// `slot`, how many a request sent at `now` still finds when it starts,
    /// needing `need` fresh blocks; under one lock. Where
    /// they do not fit beside the running requests (with the matched blocks
    /// it takes out of the free pool), it waits until enough of those have
    /// ended (each at its first token plus its span of block times), and
    /// meanwhile the others' outputs grow into the least recently freed
    /// blocks, which take a prefix from its tail. It starts no sooner than
    /// the prefills admitted before it have ended, one after another, at
    /// the replica's learned prefill time, and, when its LoRA adapter must
    /// wait for a slot, no sooner than the slot frees. Unchanged
    /// behind a queue (its forecast stands), where the request fits with no
    /// prefill or adapter ahead, and where the replica's block time is not
    /// known.
    pub fn kept_through_wait(&self, hashes: &[BlockHash], at: &[Wait], now: Duration) -> Vec<usize> {
        let replicas = self.lock();
        at.iter().map(|w| replicas.get(&w.slot).map_or(w.matched, |rep| kept(rep, hashes, w, now))).collect()
    }
}

/// A prompt on one replica, for [`KvIndex::kept_through_wait`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wait {
    /// The replica.
    pub slot: Slot,
    /// The leading blocks of the prompt held there.
    pub matched: usize,
    /// The fresh blocks it needs.
    pub need: usize,
    /// Where its LoRA adapter must wait for a slot (every one is taken by
    /// other adapters' requests): the adapters also waiting there, served
    /// first. It starts once that many adapters in flight, and one more,
    /// have no request left (vLLM defers such a request, ADR 0057).
    pub adapter_ahead: Option<usize>,
}

/// `KvIndex::kept_through_wait` on one replica.
fn kept(rep: &Replica, hashes: &[BlockHash], w: &Wait, now: Duration) -> usize {
    let (matched, need) = (w.matched, w.need);
    if let Some(exact) = &rep.exact {
        return kept_exact(rep, exact, hashes, w, now);
    }
    if !rep.queue.is_empty() {
        return matched;
    }
    let Some(per_block) = rep.per_block() else { return matched };
    let shadow = &rep.shadow;
    let prefix = &hashes[..matched.min(hashes.len())];
    let demand = need + prefix.iter().filter(|&&h| shadow.in_use(h) == Some(false)).count();
    let available = shadow.available();
    let prefilled = earliest_start(rep, w, per_block, now);
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
    let freed = freed_in_turn(running.iter().map(|r| r.1.clone()), |h| shadow.holders(h));
    let running: Vec<_> = running
        .into_iter()
        .zip(freed)
        .map(|((end, _, generated, owed, since, room), freed)| (end, freed, generated, owed, since, room))
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
    // The outputs' growth; a request that ended leaves its last block as
    // room when not full (it caches nothing).
    let ended = running.iter().take_while(|r| r.0 <= start).map(|r| (by(r.0).1, usize::from(r.5), r.3, r.1.as_slice()));
    let evicted = evicted(shadow.cap() - shadow.len(), ended, by(start).1, shadow.oldest_free());
    prefix.iter().position(|h| evicted.contains(h)).unwrap_or(matched)
}

/// For requests ending in the order given, the blocks (`blocks`, first to
/// last) each end frees: those no request still running holds, given how
/// many hold each now (`held`); last block first, as the engine frees them.
fn freed_in_turn<'a, B>(ending: impl Iterator<Item = B>, held: impl Fn(BlockHash) -> u32) -> Vec<Vec<BlockHash>>
where
    B: Iterator<Item = &'a BlockHash>,
{
    // Block hashes are uniform: the index's own hasher, not SipHash (this
    // runs for every candidate of every decision while a prompt must wait).
    let mut holders: HashMap<BlockHash, u32, FoldState> = HashMap::default();
    ending
        .map(|blocks| {
            let mut freed: Vec<BlockHash> = blocks
                .filter(|&&h| {
                    let left = holders.entry(h).or_insert_with(|| held(h));
                    *left = left.saturating_sub(1);
                    *left == 0
                })
                .copied()
                .collect();
            freed.reverse();
            freed
        })
        .collect()
}

/// The blocks a wait forecast finds evicted by the time a prompt starts.
/// The allocations to come first take the `room` never used, and at each
/// end before the start, in order, the room that end leaves. `ended` gives
/// for each end the blocks allocated by then, the room it leaves, its
/// output still owed and the blocks it frees (`freed_in_turn`);
/// `at_start`, the blocks allocated by the start. Past the room, each
/// allocation evicts the next of the blocks free now (`free_now`, in the
/// engine's order), then of what the ended requests free in turn: the
/// output still owed (named by nothing), then their blocks.
fn evicted<'a>(
    mut room: usize,
    ended: impl Iterator<Item = (usize, usize, usize, &'a [BlockHash])> + Clone,
    at_start: usize,
    free_now: impl Iterator<Item = BlockHash>,
) -> HashSet<BlockHash> {
    let (mut taken, mut evictions) = (0, 0);
    let mut allocate_to = |allocated: usize, room: &mut usize| {
        let more = allocated.saturating_sub(taken);
        evictions += more.saturating_sub(*room);
        *room = room.saturating_sub(more);
        taken = taken.max(allocated);
    };
    for (allocated, left, _, _) in ended.clone() {
        allocate_to(allocated, &mut room);
        room += left;
    }
    allocate_to(at_start, &mut room);
    let later = ended.flat_map(|(_, _, owed, freed)| std::iter::repeat_n(None, owed).chain(freed.iter().copied().map(Some)));
    free_now.map(Some).chain(later).take(evictions).flatten().collect()
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

/// The earliest a request sent at `now` can start: once the prefills
/// admitted before it have ended, one after another, and, where its
/// adapter must wait for a slot, once the slot frees.
fn earliest_start(rep: &Replica, w: &Wait, per_block: f64, now: Duration) -> Duration {
    let slot = w.adapter_ahead.and_then(|ahead| slot_frees(rep, ahead, per_block, now));
    rep.prefills_end().unwrap_or(now).max(now).max(slot.unwrap_or(now))
}

/// When an adapter's slot frees for a request that waits for one behind
/// `ahead` other adapters: the `ahead + 1`-th time an adapter of the
/// requests running (or in flight, in exact mode) has none left, each
/// ending at its first token plus its span of block times. None where
/// fewer adapters run (the router's view of the slots counts the engine's
/// report and its peers' requests too).
fn slot_frees(rep: &Replica, ahead: usize, per_block: f64, now: Duration) -> Option<Duration> {
    let mut last: HashMap<u64, Duration> = HashMap::new();
    for (id, r) in &rep.requests {
        let end = match r {
            Request::Claiming { output: owed, since, .. } | Request::Running { owed, since, .. } => ends_by(*since, *owed, per_block, now),
            Request::Waiting { .. } => continue,
        };
        if let Some(&tag) = rep.adapters.get(id) {
            last.entry(tag).and_modify(|e| *e = (*e).max(end)).or_insert(end);
        }
    }
    let mut frees: Vec<Duration> = last.into_values().collect();
    frees.sort_unstable();
    frees.get(ahead).copied()
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

/// A request in flight on an exact replica, for the wait forecast.
struct InFlight {
    /// When it ends.
    end: Duration,
    /// The blocks it frees then, deepest first: what was generated so far,
    /// then its prompt's.
    frees: Vec<BlockHash>,
    /// How many of those were generated.
    generated: usize,
    /// Its output in blocks.
    output: usize,
    /// Its first token and pace.
    since: Option<(Duration, Pace)>,
    /// The output blocks it took by now, as far as the events tell.
    told: usize,
}

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
fn kept_exact(rep: &Replica, exact: &Exact, hashes: &[BlockHash], w: &Wait, now: Duration) -> usize {
    let (matched, need) = (w.matched, w.need);
    let Some(per_block) = rep.per_block() else { return matched };
    let prefix = &hashes[..matched.min(hashes.len())];
    let demand = need + prefix.iter().filter(|&&h| !exact.claimed(h)).count();
    let available = exact.available();
    let prefilled = earliest_start(rep, w, per_block, now);
    // None before its first token (an estimated one may still be to come).
    let filled = |since: Option<(Duration, Pace)>, t: Duration, output: usize| match since {
        Some((at, pace)) if t >= at => pace.filled(t - at, per_block).min(output),
        _ => 0,
    };
    // The output blocks a request in flight took by now: by its pace, and
    // as far as the events tell (one for each block it stored after its
    // prompt, and the first at its first token where its prompt filled its
    // last block, ADR 0067). Those its pace has taken beyond what the events
    // tell are taken in the step under way, their events still to come, or
    // the request is behind its pace and takes them soon: either way they
    // evict as the ones to come.
    let taken = |keys: &[BlockHash], since: Option<(Duration, Pace)>, output: usize| {
        let paced = filled(since, now, output);
        let told = since.map_or(0, |(_, pace)| keys.last().map_or(0, |&last| exact.generated_count(last)) + usize::from(pace.lead <= 0.0));
        (paced, paced.min(told))
    };
    if demand <= available && prefilled <= now {
        // Past the bound on estimated first tokens, as cheap as before: a
        // decision should not cost time linear in thousands of streams.
        if rep.requests.len() > ESTIMATED_AT_MOST {
            return matched;
        }
        let unseen: usize = rep
            .requests
            .values()
            .map(|r| match r {
                Request::Claiming { keys, output, since, .. } => {
                    let (paced, told) = taken(keys, *since, *output);
                    paced - told
                }
                _ => 0,
            })
            .sum();
        if unseen == 0 {
            return matched;
        }
        let evicted = evicted(exact.empty(), std::iter::empty(), exact.to_allocate() + unseen, exact.free_order());
        return prefix.iter().position(|h| evicted.contains(h)).unwrap_or(matched);
    }
    // Each request in flight, in the order they end.
    let mut running: Vec<_> = rep
        .requests
        .values()
        .filter_map(|r| match r {
            Request::Claiming { keys, output, since, .. } => {
                Some((ends_by(*since, *output, per_block, now), keys.as_slice(), *output, *since, taken(keys, *since, *output).1))
            }
            _ => None,
        })
        .collect();
    running.sort_by_key(|r| r.0);
    // The blocks each frees when it ends: those of its prompt and of what
    // was generated after it that its end leaves held by no request.
    let freed = freed_in_turn(running.iter().map(|r| r.1.iter().chain(exact.generated_after(r.1))), |h| exact.holders_of(h));
    let running: Vec<InFlight> = running
        .into_iter()
        .zip(freed)
        .map(|((end, _, output, since, told), frees)| {
            let generated = frees.iter().filter(|&&h| exact.generated(h)).count();
            InFlight { end, frees, generated, output, since, told }
        })
        .collect();
    // By `t` (now at the earliest: a request may be taken to have ended
    // before now): blocks freed by the requests ended, and output blocks
    // taken since now.
    let by = |t: Duration| {
        let t = t.max(now);
        let (mut freed, mut grown) = (0, 0);
        for r in &running {
            if r.end <= t {
                // Its prompt blocks left unclaimed, and its whole output
                // (what it stored so far is among its own blocks too).
                freed += r.frees.len() - r.generated + r.output;
                grown += r.output - r.told;
            } else {
                grown += filled(r.since, t, r.output) - r.told;
            }
        }
        (freed, grown)
    };
    let Some(start) = starts(prefilled, running.iter().map(|r| r.end), &by, available, demand) else { return matched };
    // The allocations to come: the claims not held, a block for each request
    // in flight, and the outputs' growth; each request that ended leaves the
    // block it held unnamed as room.
    let ended = running
        .iter()
        .take_while(|r| r.end <= start)
        .map(|r| (exact.to_allocate() + by(r.end).1, 1, r.output - r.told, r.frees.as_slice()));
    let evicted = evicted(exact.empty(), ended, exact.to_allocate() + by(start).1, exact.free_order());
    prefix.iter().position(|h| evicted.contains(h)).unwrap_or(matched)
}

fn set_bit(bits: &mut Vec<u64>, slot: Slot) {
    let w = slot as usize / 64;
    if bits.len() <= w {
        bits.resize(w + 1, 0);
    }
    bits[w] |= 1 << (slot % 64);
}
