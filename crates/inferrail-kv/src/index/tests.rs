//! The index against a naive model: per replica, the engine's block pool spelled out on a vector and a map.

use super::*;
use proptest::prelude::*;

/// A prompt on `slot` holding `matched` blocks and needing `need` fresh ones, its adapter (if any) in a slot.
pub(super) fn wait(slot: Slot, matched: usize, need: usize) -> Wait {
    Wait { slot, matched, need, adapter_ahead: None }
}

impl KvIndex {
    /// Blocks a running request added when it was recorded (none while it waits).
    fn added(&self, r: &Recorded) -> Vec<BlockHash> {
        match self.lock().get(&r.slot).and_then(|rep| rep.requests.get(&r.request)) {
            Some(Request::Running { keys, reused, .. }) => keys[*reused..].to_vec(),
            _ => Vec::new(),
        }
    }
}

/// A running request in the model.
#[derive(Debug, Clone)]
struct Running {
    keys: Vec<BlockHash>,
    reused: usize,
    /// Blocks its output filled so far, and how many more it will fill.
    generated: Vec<BlockHash>,
    owed: usize,
    /// When its first token came, and its pace.
    since: Option<(Duration, Pace)>,
    ends_partial: bool,
    /// When it began decoding, against the others.
    order: u64,
}

/// A waiting request in the model; `resume`: a preempted one's prompt
/// blocks (its output's follow), how long it had decoded, and its pace.
#[derive(Debug, Clone)]
struct Waiting {
    id: u64,
    prompt: Vec<BlockHash>,
    reusable: usize,
    partial: usize,
    output: usize,
    ends_partial: bool,
    resume: Option<(usize, Duration, Pace)>,
}

#[derive(Debug, Default, Clone)]
struct Pool {
    cap: usize,
    /// Blocks no request holds, least recently freed first.
    free: Vec<BlockHash>,
    /// Blocks running requests hold, with how many hold each and whether a second took it while one held it.
    in_use: HashMap<BlockHash, (u32, bool)>,
    /// Which incarnation: records of an older one are ignored.
    generation: u32,
    /// Requests in flight by id: running, or waiting in order.
    running: HashMap<u64, Running>,
    waiting: Vec<Waiting>,
    /// Seconds a request's output takes per block here, once one completed after its first token.
    block_time: Option<f64>,
    /// A request takes every block it needs, growing the pool when none is free (blocks running requests will free).
    grows: bool,
    /// Fresh blocks taken.
    taken: usize,
    /// The latest time the pool was brought to, and a counter ordering decoding requests.
    clock: Duration,
    orders: u64,
}

impl Pool {
    fn contains(&self, h: BlockHash) -> bool {
        self.free.contains(&h) || self.in_use.contains_key(&h)
    }

    fn hold(&mut self, h: BlockHash) -> bool {
        if let Some((n, shared)) = self.in_use.get_mut(&h) {
            *n += 1;
            *shared = true;
        } else if let Some(at) = self.free.iter().position(|&b| b == h) {
            self.free.remove(at);
            self.in_use.insert(h, (1, false));
        } else {
            return false;
        }
        true
    }

    fn release(&mut self, h: BlockHash) {
        if let Some((n, _)) = self.in_use.get_mut(&h) {
            *n -= 1;
            if *n == 0 {
                self.in_use.remove(&h);
                self.free.push(h);
            }
        }
    }

    /// A fresh placeholder block in use, reusing the least recently freed block when full.
    fn take(&mut self, next: &mut u128) -> BlockHash {
        if self.free.len() + self.in_use.len() == self.cap {
            if self.free.is_empty() && self.grows {
                self.cap += 1;
            } else {
                self.free.remove(0);
            }
        }
        *next += 1;
        self.taken += 1;
        let p = (7u128 << 100) | *next;
        self.in_use.insert(p, (1, false));
        p
    }

    fn admit(
        &mut self,
        prompt: &[BlockHash],
        reusable: usize,
        partial: usize,
        anyway: bool,
        next: &mut u128,
    ) -> Option<(Vec<BlockHash>, usize)> {
        let reused = prompt[..reusable.min(prompt.len())].iter().take_while(|&&h| self.contains(h)).count();
        let need = prompt.len() - reused + partial;
        let free_reused = prompt[..reused].iter().filter(|h| !self.in_use.contains_key(h)).count();
        if need + free_reused > self.cap - self.in_use.len() && !anyway {
            return None;
        }
        for &h in &prompt[..reused] {
            self.hold(h);
        }
        let mut keys: Vec<BlockHash> = prompt[..reused].to_vec();
        for _ in 0..self.room(need) {
            keys.push(self.take(next));
        }
        for i in reused..prompt.len().min(keys.len()) {
            if !self.contains(prompt[i]) {
                self.in_use.remove(&keys[i]);
                self.in_use.insert(prompt[i], (1, false));
                keys[i] = prompt[i];
            }
        }
        Some((keys, reused))
    }

    /// Blocks for `output` generated tokens, as many as fit beside the running requests'.
    fn generate(&mut self, output: usize, next: &mut u128) -> Vec<BlockHash> {
        (0..self.room(output)).map(|_| self.take(next)).collect()
    }

    /// How many of `n` more blocks a request gets.
    fn room(&self, n: usize) -> usize {
        if self.grows { n } else { n.min(self.cap - self.in_use.len()) }
    }

    /// A running request ends; false if there is none by that id.
    fn end(&mut self, id: u64) -> bool {
        let Some(r) = self.running.remove(&id) else { return false };
        self.free(&r.keys, &r.generated, r.ends_partial);
        true
    }

    /// A running request fills the `n` blocks its output owes (as many as fit).
    fn fill(&mut self, id: u64, n: usize, next: &mut u128) {
        let n = n.min(self.running.get(&id).map_or(0, |r| r.owed));
        let blocks = self.generate(n, next);
        if let Some(r) = self.running.get_mut(&id) {
            r.generated.extend(blocks);
            r.owed -= n;
        }
    }

    /// Frees a request's blocks, last first. The last block, when not full (a placeholder), caches nothing: it goes, as room.
    fn free(&mut self, keys: &[BlockHash], generated: &[BlockHash], ends_partial: bool) {
        for (i, &h) in generated.iter().rev().chain(keys.iter().rev()).enumerate() {
            if i == 0 && ends_partial && h >> 100 == 7 {
                self.in_use.remove(&h);
                self.free.retain(|&b| b != h);
            } else {
                self.release(h);
            }
        }
    }

    fn admit_waiting(&mut self, next: &mut u128) {
        while let Some(w) = self.waiting.first().cloned() {
            let Some(admitted) = self.admit(&w.prompt, w.reusable, w.partial, false, next) else { break };
            self.waiting.remove(0);
            let running = self.started(admitted, &w);
            self.running.insert(w.id, running);
        }
    }

    /// A waiting request starts with the blocks it was admitted with; a
    /// preempted one goes on decoding where it stopped, from the clock.
    fn started(&mut self, (mut keys, reused): (Vec<BlockHash>, usize), w: &Waiting) -> Running {
        let mut running =
            Running { keys, reused, generated: Vec::new(), owed: w.output, since: None, ends_partial: w.ends_partial, order: 0 };
        if let Some((prompt_blocks, decoded, pace)) = w.resume {
            keys = std::mem::take(&mut running.keys);
            running.generated = keys.split_off(prompt_blocks.min(keys.len()));
            running.keys = keys;
            running.reused = reused.min(prompt_blocks);
            running.since = Some((self.clock.saturating_sub(decoded), pace));
            self.orders += 1;
            running.order = self.orders;
        }
        running
    }

    /// A running request's next output block, due at `at`: taken if
    /// there is room; if not, the newest request still decoding (by its
    /// pace) is preempted and it tries again; alone, it goes on short and
    /// takes no more.
    fn fill_one(&mut self, id: u64, at: Duration, per_block: f64, next: &mut u128) {
        while self.running.contains_key(&id) {
            if self.room(1) == 1 {
                let block = self.take(next);
                let r = self.running.get_mut(&id).expect("running");
                r.generated.push(block);
                r.owed -= 1;
                return;
            }
            let decoding: Vec<(u64, u64)> = self
                .running
                .iter()
                .filter(|&(&i, r)| r.since.is_some() && (i == id || ahead::ends(r.since, per_block) > at))
                .map(|(&i, r)| (r.order, i))
                .collect();
            let newest = decoding.iter().max().map(|&(_, i)| i);
            if newest.is_none_or(|v| v == id && decoding.len() == 1) {
                self.running.get_mut(&id).expect("running").owed = 0;
                return;
            }
            let victim = newest.unwrap_or(id);
            self.preempt(victim, at);
            if victim == id {
                return;
            }
        }
    }

    /// The engine preempts a running request: its blocks are freed last
    /// first (its last, a placeholder, as room) and it waits first in line.
    fn preempt(&mut self, id: u64, at: Duration) {
        let Some(r) = self.running.remove(&id) else { return };
        let prompt_blocks = r.keys.len();
        let mut blocks: Vec<BlockHash> = r.keys.iter().chain(&r.generated).copied().collect();
        let last = blocks.last().copied().filter(|&h| h >> 100 == 7);
        if let Some(h) = last {
            blocks.pop();
            self.in_use.remove(&h);
        }
        for &h in blocks.iter().rev() {
            self.release(h);
        }
        let resume = r.since.map(|(first, pace)| (prompt_blocks, at.saturating_sub(first), pace));
        let partial = usize::from(last.is_some());
        let waiting = Waiting { id, reusable: blocks.len(), prompt: blocks, partial, output: r.owed, ends_partial: r.ends_partial, resume };
        self.waiting.insert(0, waiting);
    }

    /// Every output block due by `now`, in the order they fall due.
    fn grow(&mut self, now: Duration, next: &mut u128) {
        if let Some(per_block) = self.block_time.filter(|&t| t > 0.0) {
            loop {
                let due = self
                    .running
                    .iter()
                    .filter(|(_, r)| r.owed > 0)
                    .filter_map(|(&id, r)| r.since.map(|(since, pace)| (since.saturating_add(pace.due(r.generated.len(), per_block)), id)))
                    .min();
                let Some((at, id)) = due.filter(|&(at, _)| at <= now) else { break };
                self.clock = self.clock.max(at);
                self.fill_one(id, at, per_block, next);
            }
        }
        self.clock = self.clock.max(now);
    }
}

/// A request in flight in the model: its replica, the pool's generation, its id.
type Flight = (Slot, u32, u64);

#[derive(Debug, Default)]
struct Naive {
    replicas: HashMap<Slot, Pool>,
    ids: u64,
}

impl Naive {
    /// The engine's layout, spelled out: placeholders are keys from a counter. Returns the flight and the blocks it added.
    fn record(
        &mut self,
        slot: Slot,
        prompt: &[BlockHash],
        reusable: usize,
        partial: usize,
        (output, ends_partial): (usize, bool),
        next: &mut u128,
    ) -> Option<(Flight, Vec<BlockHash>)> {
        self.ids += 1;
        let id = self.ids;
        let pool = self.replicas.get_mut(&slot)?;
        // No sequence outgrows the cache.
        let output = output.min(pool.cap);
        let admitted = if pool.waiting.is_empty() { pool.admit(prompt, reusable, partial, false, next) } else { None };
        let added = match admitted {
            Some((keys, reused)) => {
                let added = keys[reused..].to_vec();
                let running = Running { keys, reused, generated: Vec::new(), owed: output, since: None, ends_partial, order: 0 };
                pool.running.insert(id, running);
                added
            }
            None => {
                pool.waiting.push(Waiting { id, prompt: prompt.to_vec(), reusable, partial, output, ends_partial, resume: None });
                Vec::new()
            }
        };
        Some(((slot, pool.generation, id), added))
    }

    fn pool(&mut self, flight: &Flight) -> Option<&mut Pool> {
        self.replicas.get_mut(&flight.0).filter(|p| p.generation == flight.1)
    }

    /// Its first token came at `at`: its output fills a block each block
    /// time from then on, or all at once while the block time is unknown.
    /// A request still waiting has started: it takes its blocks now.
    fn first_token(&mut self, flight: &Flight, at: Duration, pace: Pace, next: &mut u128) {
        let Some(pool) = self.pool(flight) else { return };
        pool.clock = pool.clock.max(at);
        if let Some(w) = pool.waiting.iter().position(|w| w.id == flight.2) {
            let w = pool.waiting.remove(w);
            let admitted = pool.admit(&w.prompt, w.reusable, w.partial, true, next).unwrap_or_default();
            let running = pool.started(admitted, &w);
            pool.running.insert(w.id, running);
        }
        pool.orders += 1;
        let order = pool.orders;
        let Some(r) = pool.running.get_mut(&flight.2).filter(|r| r.since.is_none()) else { return };
        r.since = Some((at, pace));
        r.order = order;
        if pool.block_time.is_none_or(|t| t <= 0.0) {
            pool.fill(flight.2, usize::MAX, next);
        }
    }

    /// Every running request fills the blocks its output filled by `now`, in the order they fall due.
    fn advance(&mut self, now: Duration, next: &mut u128) {
        for pool in self.replicas.values_mut() {
            pool.grow(now, next);
        }
    }

    fn complete(&mut self, flight: &Flight, at: Duration, next: &mut u128) {
        let Some(pool) = self.pool(flight) else { return };
        // The others catch up first; this one, done, is no victim.
        let running = pool.running.remove(&flight.2);
        pool.grow(at, next);
        if let Some(mut r) = running {
            if let Some((since, pace)) = r.since {
                pool.block_time = pace.learn(pool.block_time, at.saturating_sub(since));
            }
            let owed = pool.generate(r.owed, next);
            r.generated.extend(owed);
            pool.free(&r.keys, &r.generated, r.ends_partial);
        } else {
            let Some(at) = pool.waiting.iter().position(|w| w.id == flight.2) else { return };
            let w = pool.waiting.remove(at);
            let keys = pool.admit(&w.prompt, w.reusable, w.partial, true, next).map(|(k, _)| k).unwrap_or_default();
            let generated = pool.generate(w.output, next);
            pool.free(&keys, &generated, w.ends_partial);
        }
        pool.admit_waiting(next);
    }

    fn take_back(&mut self, flight: &Flight, next: &mut u128) {
        let Some(pool) = self.pool(flight) else { return };
        if let Some(Running { keys, reused, generated, .. }) = pool.running.remove(&flight.2) {
            for &h in generated.iter().rev().chain(keys[reused..].iter().rev()) {
                match pool.in_use.get(&h) {
                    Some((_, true)) => pool.release(h),
                    _ => {
                        pool.in_use.remove(&h);
                        pool.free.retain(|&b| b != h);
                    }
                }
            }
            for &h in keys[..reused].iter().rev() {
                pool.release(h);
            }
        } else if let Some(at) = pool.waiting.iter().position(|w| w.id == flight.2) {
            pool.waiting.remove(at);
        } else {
            return;
        }
        pool.admit_waiting(next);
    }

    /// The pool as a request sent now finds it when it starts: every
    /// waiting request admitted before it, in order and in full, each once
    /// the running requests, ending in the order they came (the others
    /// first filling what their outputs fill by then, and it what its
    /// output still owes), leave it room (or none is left), until they have
    /// taken twice the cache.
    fn ahead(&self, slot: Slot) -> Option<Pool> {
        let mut pool = Pool { grows: true, taken: 0, ..self.replicas.get(&slot)?.clone() };
        let budget = ahead::FORESIGHT.min(2 * pool.cap);
        let mut ending: Vec<u64> = pool.running.keys().copied().collect();
        ending.sort_unstable();
        let mut ending = ending.into_iter();
        let mut next = 1u128 << 90;
        for Waiting { prompt, reusable, partial, output, .. } in std::mem::take(&mut pool.waiting) {
            if pool.taken > budget {
                break;
            }
            while pool.admit(&prompt, reusable, partial, false, &mut next).is_none() {
                match ending.next() {
                    Some(id) => {
                        // Until it ends, the others' outputs fill what they fill by then.
                        if let Some(per_block) = pool.block_time.filter(|&t| t > 0.0) {
                            let end = ahead::ends(pool.running.get(&id).and_then(|r| r.since), per_block);
                            let mut others: Vec<u64> = pool.running.keys().copied().filter(|&o| o != id).collect();
                            others.sort_unstable();
                            for o in others {
                                let Some((at, pace)) = pool.running.get(&o).and_then(|r| r.since) else { continue };
                                let due = pace.filled(end.saturating_sub(at), per_block).saturating_sub(pool.running[&o].generated.len());
                                pool.fill(o, due, &mut next);
                            }
                        }
                        pool.fill(id, usize::MAX, &mut next);
                        pool.end(id);
                    }
                    None => {
                        pool.admit(&prompt, reusable, partial, true, &mut next);
                        break;
                    }
                }
            }
            pool.generate(output, &mut next);
        }
        Some(pool)
    }

    fn matched(&self, hashes: &[BlockHash], slot: Slot) -> usize {
        let Some(pool) = self.ahead(slot) else { return 0 };
        hashes.iter().take_while(|&&h| pool.contains(h)).count()
    }

    /// Of the first `depth` blocks, those a running request holds, wherever they are.
    fn held(&self, hashes: &[BlockHash], slot: Slot, depth: usize) -> usize {
        let Some(pool) = self.ahead(slot) else { return 0 };
        hashes[..depth].iter().filter(|h| pool.in_use.contains_key(h)).count()
    }
}

#[derive(Debug, Clone)]
enum Op {
    Record {
        slot: Slot,
        family: u8,
        len: usize,
        reusable: usize,
        partial: usize,
        output: usize,
        ends_partial: bool,
    },
    /// Completes (or takes back) the in-flight request at this index, if there is one.
    Finish {
        which: usize,
        take_back: bool,
    },
    /// The in-flight request at this index has its first token, at a pace (room in its last prompt block, output in blocks), in quarters.
    FirstToken(usize, u8, u8),
    /// Time passes, in milliseconds.
    Wait(u64),
    Clear(Slot),
    Remove(Slot),
    Add(Slot),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        // An engine reuses every full block of a prompt, or all but the last when the prompt ends on a block boundary.
        6 => (0u32..4, 0u8..3, 1usize..8, any::<bool>(), 0usize..2, 0usize..3, any::<bool>()).prop_map(
            |(slot, family, len, all, partial, output, ends_partial)| Op::Record {
                slot,
                family,
                len,
                reusable: if all { len } else { len - 1 },
                partial,
                output,
                ends_partial
            }
        ),
        6 => (0usize..4, prop::bool::weighted(0.2)).prop_map(|(which, take_back)| Op::Finish { which, take_back }),
        4 => (0usize..4, 0u8..4, 0u8..12).prop_map(|(which, lead, span)| Op::FirstToken(which, lead, span)),
        3 => (1u64..40).prop_map(Op::Wait),
        1 => (0u32..4).prop_map(Op::Clear),
        1 => (0u32..4).prop_map(Op::Remove),
        1 => (0u32..4).prop_map(Op::Add),
    ]
}

fn chain(family: u8, len: usize) -> Vec<BlockHash> {
    (0..len).map(|k| (u128::from(family) << 64) | k as u128).collect()
}

proptest! {
    #[test]
    fn the_index_behaves_like_the_naive_model(ops in proptest::collection::vec(op(), 1..120), cap in 1usize..12) {
        let index = KvIndex::new();
        let mut naive = Naive::default();
        let mut next = 0u128;
        let mut generation = 0;
        let mut now = Duration::ZERO;
        // Requests in flight: the index's record and the model's.
        let mut flights: Vec<(Recorded, Option<Flight>)> = Vec::new();
        let mut add = |naive: &mut Naive, s: Slot| {
            index.add_replica(s, cap);
            generation += 1;
            naive.replicas.insert(s, Pool { cap, generation, ..Pool::default() });
        };
        for s in 0..4 {
            add(&mut naive, s);
        }
        for op in ops {
            match op {
                Op::Record { slot, family, len, reusable, partial, output, ends_partial } => {
                    let hashes = chain(family, len);
                    let recorded = index.record(slot, &hashes, reusable, partial, output, ends_partial, None);
                    let flight = naive.record(slot, &hashes, reusable, partial, (output, ends_partial), &mut next);
                    let real = |v: &[BlockHash]| -> (Vec<BlockHash>, usize) {
                        let mut r: Vec<BlockHash> = v.iter().copied().filter(|h| hashes.contains(h)).collect();
                        r.sort_unstable();
                        (r, v.len())
                    };
                    let want = flight.as_ref().map(|(_, added)| real(added)).unwrap_or_default();
                    prop_assert_eq!(real(&index.added(&recorded)), want);
                    flights.push((recorded, flight.map(|(f, _)| f)));
                }
                Op::Finish { which, take_back } if which < flights.len() => {
                    let (recorded, flight) = flights.remove(which);
                    if take_back {
                        index.take_back(&recorded);
                        if let Some(f) = &flight { naive.take_back(f, &mut next); }
                    } else {
                        index.complete(&recorded, now);
                        if let Some(f) = &flight { naive.complete(f, now, &mut next); }
                        if which % 2 == 1 {
                            // A refusal whose status came after the request ended changes nothing.
                            index.take_back(&recorded);
                        }
                    }
                }
                Op::Finish { .. } => {}
                Op::FirstToken(which, lead, span) => {
                    let pace = Pace { lead: f64::from(lead) / 4.0, span: f64::from(span) / 4.0 };
                    if let Some((recorded, flight)) = flights.get(which) {
                        index.decoding(recorded, now, pace);
                        if let Some(f) = flight { naive.first_token(f, now, pace, &mut next); }
                    }
                }
                Op::Wait(ms) => {
                    now += Duration::from_millis(ms);
                    index.advance(&[0, 1, 2, 3], now);
                    naive.advance(now, &mut next);
                }
                Op::Clear(s) => {
                    index.clear_replica(s);
                    if naive.replicas.contains_key(&s) { add(&mut naive, s); }
                }
                Op::Remove(s) => {
                    index.remove_replica(s);
                    naive.replicas.remove(&s);
                }
                Op::Add(s) => add(&mut naive, s),
            }
            for family in 0..3 {
                let hashes = chain(family, 8);
                let slots: Vec<Slot> = (0..4).collect();
                let want: Vec<usize> = slots.iter().map(|&s| naive.matched(&hashes, s)).collect();
                prop_assert_eq!(index.matched(&hashes, &slots), want.clone());
                let at: Vec<(Slot, usize)> = slots.iter().copied().zip(want).collect();
                let held: Vec<usize> = at.iter().map(|&(s, d)| naive.held(&hashes, s, d)).collect();
                prop_assert_eq!(index.held(&hashes, &at), held);
            }
            prop_assert_eq!(index.entries(), naive.replicas.values().map(|p| p.free.len() + p.in_use.len()).sum::<usize>());
            // The holder map names exactly the prompt blocks the model's replicas hold (as a request sent now finds them): no placeholder, none left behind.
            let mut want: Vec<(BlockHash, Slot)> = Vec::new();
            for &s in naive.replicas.keys() {
                let pool = naive.ahead(s).unwrap_or_default();
                want.extend(pool.free.iter().chain(pool.in_use.keys()).filter(|&&h| h >> 100 != 7).map(|&h| (h, s)));
            }
            want.sort_unstable();
            want.dedup();
            let mut got: Vec<(BlockHash, Slot)> =
                index.holders.entries().into_iter().flat_map(|(h, bits)| (0..4).filter(move |&s| bits & (1 << s) != 0).map(move |s| (h, s))).collect();
            got.sort_unstable();
            prop_assert_eq!(got, want);
        }
    }
}

#[test]
fn a_long_prefix_is_evicted_from_its_tail() {
    let index = KvIndex::new();
    index.add_replica(0, 4);
    index.complete(&index.record(0, &chain(0, 4), 4, 0, 0, false, None), Duration::ZERO);
    index.complete(&index.record(0, &chain(1, 1), 1, 0, 0, false, None), Duration::ZERO);
    assert_eq!(index.matched(&chain(0, 4), &[0]), [3]);
}

#[test]
fn a_reported_size_resizes_the_shadow_and_keeps_what_it_holds() {
    let index = KvIndex::new();
    index.add_replica(0, 4);
    index.complete(&index.record(0, &chain(0, 2), 2, 0, 0, false, None), Duration::ZERO);
    index.complete(&index.record(0, &chain(1, 2), 2, 0, 0, false, None), Duration::ZERO);
    // Larger: both prompts stay, and a third no longer evicts the first.
    assert!(index.resize_replica(0, 8));
    assert_eq!(index.matched(&chain(0, 2), &[0]), [2]);
    index.complete(&index.record(0, &chain(2, 2), 2, 0, 0, false, None), Duration::ZERO);
    assert_eq!((index.matched(&chain(0, 2), &[0]), index.matched(&chain(2, 2), &[0])), (vec![2], vec![2]));
    // Smaller: the least recently freed leave, tails first (a prompt's first block is freed last).
    assert!(index.resize_replica(0, 3));
    assert_eq!(index.matched(&chain(0, 2), &[0]), [0]);
    assert_eq!(index.matched(&chain(1, 2), &[0]), [1]);
    assert_eq!(index.matched(&chain(2, 2), &[0]), [2]);
    assert_eq!(index.entries(), 3);
    // A block a running request holds stays past the size until it is freed.
    let running = index.record(0, &chain(3, 3), 3, 0, 0, false, None);
    assert!(index.resize_replica(0, 1));
    assert_eq!(index.matched(&chain(3, 3), &[0]), [3]);
    index.complete(&running, Duration::ZERO);
    index.complete(&index.record(0, &chain(4, 1), 1, 0, 0, false, None), Duration::ZERO);
    assert_eq!((index.entries(), index.matched(&chain(4, 1), &[0])), (1, vec![1]));
    // An exact replica is not resized: its events say what it holds.
    index.add_replica(1, 4);
    assert!(index.enter_exact(1, 16));
    assert!(!index.resize_replica(1, 8));
}

#[test]
fn partial_and_generated_blocks_take_room() {
    let index = KvIndex::new();
    index.add_replica(0, 4);
    // Two full blocks and two more the index cannot name: the shadow is full.
    index.complete(&index.record(0, &chain(0, 2), 2, 0, 2, false, None), Duration::ZERO);
    assert_eq!(index.entries(), 4);
    // One fresh block evicts the least recent: the first request's last (unnamed) block.
    index.complete(&index.record(0, &chain(1, 1), 1, 0, 0, false, None), Duration::ZERO);
    assert_eq!(index.matched(&chain(0, 2), &[0]), [2]);
    index.complete(&index.record(0, &chain(2, 2), 2, 0, 0, false, None), Duration::ZERO);
    assert_eq!(index.matched(&chain(0, 2), &[0]), [1], "then its tail");
}

#[test]
fn a_fully_cached_prompt_recomputes_its_last_block_without_moving_it() {
    let index = KvIndex::new();
    index.add_replica(0, 8);
    index.complete(&index.record(0, &chain(0, 2), 1, 0, 0, false, None), Duration::ZERO);
    // The same prompt again, its last block not reusable: the engine fills a
    // fresh block that caches nothing, and the old one keeps its place.
    let r = index.record(0, &chain(0, 2), 1, 0, 0, false, None);
    let added = index.added(&r);
    assert_eq!(added.len(), 1);
    assert!(!chain(0, 2).contains(&added[0]));
    assert_eq!(index.matched(&chain(0, 2), &[0]), [2]);
}

#[test]
fn predictions_never_claim_the_last_token() {
    assert_eq!(predicted_cached_tokens(4, 64, 16), 48);
    assert_eq!(predicted_cached_tokens(4, 65, 16), 64);
    assert_eq!(predicted_cached_tokens(2, 100, 16), 32);
    assert_eq!(predicted_cached_tokens(0, 0, 16), 0);
}

#[test]
fn slots_past_the_first_64_are_searched_too() {
    let index = KvIndex::new();
    let prompt = chain(1, 40);
    let slots: [Slot; 5] = [0, 63, 64, 130, 200];
    for (i, &s) in slots.iter().enumerate() {
        index.add_replica(s, 100);
        let held = &prompt[..i * 9];
        index.complete(&index.record(s, held, held.len(), 0, 0, false, None), Duration::ZERO);
    }
    assert_eq!(index.matched(&prompt, &slots), vec![0, 9, 18, 27, 36]);
    assert_eq!(index.matched(&prompt, &[200, 64]), vec![36, 18], "any subset, in the order asked");
    index.remove_replica(64);
    index.clear_replica(200);
    assert_eq!(index.matched(&prompt, &slots), vec![0, 9, 0, 27, 0]);
    // Blocks shared by slots in different words keep the other holders when one lets go.
    index.complete(&index.record(130, &prompt[..5], 5, 0, 0, false, None), Duration::ZERO);
    index.remove_replica(63);
    assert_eq!(index.matched(&prompt, &[63, 130]), vec![0, 27]);
}

#[test]
fn blocks_of_running_requests_are_not_evicted() {
    let index = KvIndex::new();
    index.add_replica(0, 4);
    let first = index.record(0, &chain(0, 3), 3, 0, 0, false, None);
    // Three more blocks do not fit beside the running request's: the engine queues the second request.
    let second = index.record(0, &chain(1, 3), 3, 0, 0, false, None);
    assert!(index.added(&second).is_empty());
    assert!(chain(0, 3).iter().all(|&h| index.lock()[&0].shadow.contains(h)), "the running request's blocks stay");
    // A request sent now starts after the queued one, which waits for the
    // first to end and then takes its blocks from their tail.
    assert_eq!(index.matched(&chain(0, 3), &[0]), [1]);
    assert_eq!(index.matched(&chain(1, 3), &[0]), [3]);
    index.complete(&first, Duration::ZERO);
    // The queued one ran after: it took the first request's blocks from the tail.
    index.complete(&second, Duration::ZERO);
    assert_eq!(index.matched(&chain(0, 3), &[0]), [1]);
    assert_eq!(index.matched(&chain(1, 3), &[0]), [3]);
    // Freed last block first: the second request's tail goes before its head.
    index.complete(&index.record(0, &chain(2, 1), 1, 0, 0, false, None), Duration::ZERO);
    assert_eq!(index.matched(&chain(0, 3), &[0]), [0]);
    index.complete(&index.record(0, &chain(3, 1), 1, 0, 0, false, None), Duration::ZERO);
    assert_eq!(index.matched(&chain(1, 3), &[0]), [2]);
}

#[test]
fn a_request_sent_now_finds_what_the_queue_ahead_will_leave() {
    let index = KvIndex::new();
    index.add_replica(0, 6);
    // A prefix of two blocks, free, and a running request that holds three.
    index.complete(&index.record(0, &chain(0, 2), 2, 0, 0, false, None), Duration::ZERO);
    let running = index.record(0, &chain(1, 3), 3, 0, 0, false, None);
    assert_eq!(index.matched(&chain(0, 2), &[0]), [2]);
    // Four blocks do not fit in the one empty and two free: the request
    // waits, and when it starts it takes the free ones.
    let waiting = index.record(0, &chain(2, 4), 4, 0, 0, false, None);
    assert!(index.added(&waiting).is_empty(), "it waits");
    assert_eq!(index.matched(&chain(0, 2), &[0]), [0], "its start will evict the prefix");
    assert_eq!(index.matched(&chain(2, 4), &[0]), [4], "and store its own blocks");
    let (prompt, held) = (chain(2, 4), [(0, 4)]);
    assert_eq!(index.held(&prompt, &held), [4], "which it will hold while it runs");
    // Taken back, nothing will evict the prefix.
    index.take_back(&waiting);
    assert_eq!(index.matched(&chain(0, 2), &[0]), [2]);
    assert_eq!(index.matched(&chain(2, 4), &[0]), [0]);
    index.complete(&running, Duration::ZERO);
}

#[test]
fn a_record_from_before_a_restart_changes_nothing() {
    let index = KvIndex::new();
    index.add_replica(0, 4);
    let old = index.record(0, &chain(0, 2), 2, 0, 0, false, None);
    index.clear_replica(0);
    let new = index.record(0, &chain(0, 2), 2, 0, 0, false, None);
    index.take_back(&old);
    assert_eq!(index.matched(&chain(0, 2), &[0]), [2], "the old record does not touch the new shadow");
    index.take_back(&new);
    assert_eq!(index.matched(&chain(0, 2), &[0]), [0]);
}

#[test]
fn an_absurd_reported_capacity_takes_no_absurd_room() {
    // An engine that claims more blocks than memory could hold: the index
    // takes room for at most `UP_FRONT` blocks and still answers (an
    // allocation of the claimed size would abort the router).
    let index = KvIndex::new();
    index.add_replica(0, usize::MAX / 2);
    index.add_replica(1, usize::MAX / 2);
    index.complete(&index.record(0, &chain(0, 8), 8, 0, 1, false, None), Duration::ZERO);
    assert_eq!(index.matched(&chain(0, 8), &[0, 1]), [8, 0]);
    assert!(index.bytes() < 1 << 30, "{} bytes", index.bytes());
}

#[test]
fn a_decoding_request_takes_its_output_blocks_as_the_engine_fills_them() {
    let ms = Duration::from_millis;
    let index = KvIndex::new();
    index.add_replica(0, 8);
    // Before any request completed, the block time is unknown: the output is taken whole at the first token.
    let first = index.record(0, &chain(0, 2), 2, 0, 2, false, None);
    index.decoding(&first, ms(0), Pace { lead: 0.0, span: 2.0 });
    assert_eq!(index.entries_of(0), 4);
    // Two blocks' worth of tokens in 200 ms: 100 ms a block.
    index.complete(&first, ms(200));
    assert_eq!(index.matched(&chain(0, 2), &[0]), [2]);
    // Four fresh blocks fill the cache; the first request's blocks are free, the next to go.
    let second = index.record(0, &chain(1, 4), 4, 0, 3, false, None);
    assert_eq!(index.entries_of(0), 8);
    // Half its prompt's last block is room: its first output block is needed 50 ms after its first token, then one every 100 ms.
    index.decoding(&second, ms(1_000), Pace { lead: 0.5, span: 2.5 });
    let held_after = |at: u64| {
        index.advance(&[0], ms(at));
        index.matched(&chain(0, 2), &[0])[0]
    };
    // Its first two output blocks (at 1,050 and 1,150 ms) evict the first request's output, freed first; its third
    // (at 1,250 ms) that request's prompt, from the tail.
    assert_eq!(held_after(1_040), 2);
    assert_eq!(held_after(1_160), 2);
    assert_eq!(held_after(1_240), 2, "two output blocks so far");
    assert_eq!(held_after(1_260), 1, "the third evicts the first prompt's last block");
    assert_eq!(held_after(5_000), 1, "and it owed no more");
    // It owed three blocks and took three: the cache holds its prompt and its output.
    index.complete(&second, ms(1_260));
    assert_eq!(index.matched(&chain(1, 4), &[0]), [4]);
    assert_eq!(index.entries_of(0), 8);
}

#[test]
fn a_pace_says_when_the_engine_needs_each_output_block() {
    // An engine takes a block when a token no longer fits in the last: a
    // prompt of 40 tokens in blocks of 16 leaves room for 8, so the first
    // output block is needed at the 9th token after the first, then every 16.
    let pace = Pace { lead: 8.0 / 16.0, span: 64.0 / 16.0 };
    let token = 0.01;
    let block = 16.0 * token;
    let at = |tokens: f64| Duration::from_secs_f64(tokens * token + 1e-9);
    assert_eq!(pace.filled(at(7.0), block), 0);
    assert_eq!(pace.filled(at(8.0), block), 1);
    assert_eq!(pace.filled(at(23.0), block), 1);
    assert_eq!(pace.filled(at(24.0), block), 2);
    // A prompt ending on a block boundary needs a block for its first token's KV at once.
    assert_eq!(Pace { lead: 0.0, span: 1.0 }.filled(Duration::ZERO, block), 1);
    // The block time is learned from requests with a block of output or more, a fifth at a time.
    assert_eq!(pace.learn(None, Duration::from_secs_f64(0.64)), Some(0.16));
    assert_eq!(Pace { lead: 0.0, span: 0.5 }.learn(Some(0.16), Duration::from_secs(9)), Some(0.16));
    let learned = pace.learn(Some(0.16), Duration::from_secs_f64(1.28)).unwrap_or_default();
    assert!((learned - (0.8 * 0.16 + 0.2 * 0.32)).abs() < 1e-12, "{learned}");
}

#[test]
fn a_prompt_that_waits_for_room_loses_what_running_outputs_grow_into() {
    let ms = Duration::from_millis;
    let index = KvIndex::new();
    index.add_replica(0, 8);
    let first = index.record(0, &chain(0, 2), 2, 0, 2, false, None);
    index.decoding(&first, ms(0), Pace { lead: 0.0, span: 2.0 });
    let prompt: Vec<BlockHash> = chain(0, 2).into_iter().chain(chain(5, 4)).collect();
    assert_eq!(index.kept_through_wait(&prompt, &[wait(0, 2, 4)], ms(100))[0], 2, "no block time yet: nothing foreseen");
    index.complete(&first, ms(200));
    // Free, least recent first: the first request's two output blocks, then its prompt from the tail.
    let second = index.record(0, &chain(1, 4), 4, 0, 3, false, None);
    index.decoding(&second, ms(1_000), Pace { lead: 0.0, span: 3.0 });
    index.advance(&[0], ms(1_000));
    // Five blocks in use, three free. A prompt reusing the first two needs
    // four fresh ones and takes its two hits out of the free pool: it waits
    // for the second request to end (at 1,300 ms), whose output takes two
    // more blocks first: the other output block and the first prompt's last.
    assert_eq!(index.matched(&prompt, &[0]), [2]);
    assert_eq!(index.kept_through_wait(&prompt, &[wait(0, 2, 4)], ms(1_000))[0], 1);
    assert_eq!(index.kept_through_wait(&prompt, &[wait(0, 2, 1)], ms(1_000))[0], 2, "one fresh block fits now: nothing to wait for");
    // Unless its LoRA adapter must wait for the second request's slot: it
    // starts when that request ends, as the prompt that waits for room.
    index.adapter(&second, 3);
    assert_eq!(index.kept_through_wait(&prompt, &[Wait { adapter_ahead: Some(0), ..wait(0, 2, 1) }], ms(1_000))[0], 1);
}

/// An index with one replica of `cap` blocks whose block time is learned
/// (100 ms): a request of one prompt block and one output block decoded for
/// 100 ms, and left both blocks free, its output's least recently freed.
fn paced(cap: usize) -> KvIndex {
    let index = KvIndex::new();
    index.add_replica(0, cap);
    let first = index.record(0, &chain(9, 1), 1, 0, 1, false, None);
    index.decoding(&first, Duration::ZERO, Pace { lead: 0.0, span: 1.0 });
    index.complete(&first, Duration::from_millis(100));
    index
}

/// Records `prompt` on replica 0, every block reusable, owing `output`
/// blocks; its first token comes at 1,000 ms and its output spans `output`
/// block times, the first block needed at once.
fn decoding_from_1s(index: &KvIndex, prompt: &[BlockHash], output: usize, ends_partial: bool) -> Recorded {
    let recorded = index.record(0, prompt, prompt.len(), 0, output, ends_partial, None);
    index.decoding(&recorded, Duration::from_secs(1), Pace { lead: 0.0, span: output as f64 });
    recorded
}

#[test]
fn a_request_that_finds_no_block_to_grow_into_preempts_the_newest_decoding_one() {
    let ms = Duration::from_millis;
    let index = paced(8);
    let a = decoding_from_1s(&index, &chain(1, 2), 4, false);
    let b = decoding_from_1s(&index, &chain(2, 2), 4, false);
    // Each takes an output block at 1,000 and 1,100 ms: the cache is full of them.
    index.advance(&[0], ms(1_100));
    assert_eq!(index.held(&chain(2, 2), &[(0, 2)]), [2], "the second's prompt is in use");
    // At 1,200 ms the first needs a block and none is free: the second, the
    // newer, is preempted. Its blocks are free (its prompt still cached) and
    // its last, not full, is the room the first grows into.
    index.advance(&[0], ms(1_200));
    assert_eq!(index.matched(&chain(2, 2), &[0]), [2]);
    // It waits first in line: a request that would fit waits behind it.
    let behind = index.record(0, &chain(3, 1), 1, 0, 0, false, None);
    assert!(index.added(&behind).is_empty());
    // The first takes its last block at 1,300 ms and ends at 1,400: the
    // second is readmitted, reusing its prompt, and goes on decoding where
    // it stopped (two blocks in, 200 ms after its first token), one block
    // at 1,400 ms and one at 1,500, each evicting the least recently freed:
    // the first's output, then its prompt from the tail.
    index.advance(&[0], ms(1_300));
    index.complete(&a, ms(1_400));
    assert_eq!(index.held(&chain(2, 2), &[(0, 2)]), [2]);
    assert_eq!(index.added(&behind).len(), 1);
    index.advance(&[0], ms(1_450));
    assert_eq!(index.matched(&chain(1, 2), &[0]), [2]);
    index.advance(&[0], ms(1_500));
    assert_eq!(index.matched(&chain(1, 2), &[0]), [1], "its fourth block evicts the first's prompt's last");
    index.complete(&b, ms(1_600));
}

#[test]
fn a_prompt_waiting_for_room_sees_ended_requests_free_only_their_own_blocks_and_leave_room() {
    let ms = Duration::from_millis;
    // Two requests decode from 1,000 ms: the first owes one block and ends
    // at 1,100 ms, the second owes three (taken at 1,000, 1,100 and 1,200
    // ms) and ends at 1,300. Two blocks are free: the learning request's
    // output, then its prompt. A prompt reusing that prompt and needing four
    // fresh blocks waits for both.
    let kept = |first: &[BlockHash], second: &[BlockHash], first_ends_partial: bool| {
        let index = paced(8);
        let a = decoding_from_1s(&index, first, 1, first_ends_partial);
        let b = decoding_from_1s(&index, second, 3, false);
        index.advance(&[0], ms(1_000));
        let prompt: Vec<BlockHash> = chain(9, 1).into_iter().chain(chain(5, 4)).collect();
        assert_eq!(index.matched(&prompt, &[0]), [1]);
        let kept = index.kept_through_wait(&prompt, &[wait(0, 1, 4)], ms(1_000))[0];
        index.complete(&a, ms(1_100));
        index.complete(&b, ms(1_300));
        kept
    };
    // The first shares its three blocks with the second: its end frees only
    // its output block, and the second's output takes both free blocks.
    assert_eq!(kept(&chain(1, 3), &chain(1, 4), false), 0);
    // The first's last block is not full: the second's block at 1,200 ms
    // takes the room it leaves, and the prompt keeps its block.
    assert_eq!(kept(&chain(1, 2), &chain(2, 2), true), 1);
}

#[test]
fn a_prompt_that_fits_still_waits_for_the_prefills_admitted_before_it() {
    let ms = Duration::from_millis;
    let index = paced(9);
    // Admitted alone at 1,000 ms, two fresh blocks, first token at 1,200:
    // 100 ms a computed block. Its output takes a block every 100 ms from
    // 1,200 to 1,600 ms.
    index.advance(&[0], ms(1_000));
    let first = index.record(0, &chain(1, 2), 2, 0, 5, false, None);
    index.decoding(&first, ms(1_200), Pace { lead: 0.0, span: 5.0 });
    index.advance(&[0], ms(1_400));
    // A second prompt of two fresh blocks is admitted at 1,400 ms: its prefill ends at 1,600.
    let second = index.record(0, &chain(2, 2), 2, 0, 0, false, None);
    assert_eq!(index.added(&second).len(), 2);
    // A prompt reusing the learning request's prompt (free, behind its
    // output) and needing one fresh block fits now, but starts after the
    // second's prefill: by then the first's blocks at 1,500 and 1,600 ms
    // have evicted both free blocks.
    let prompt: Vec<BlockHash> = chain(9, 1).into_iter().chain(chain(5, 1)).collect();
    assert_eq!(index.matched(&prompt, &[0]), [1]);
    assert_eq!(index.kept_through_wait(&prompt, &[wait(0, 1, 1)], ms(1_400)), [0]);
    index.decoding(&second, ms(1_600), Pace::default());
    assert_eq!(index.kept_through_wait(&prompt, &[wait(0, 1, 1)], ms(1_600)), [1], "no prefill ahead any more: it fits");
    index.complete(&first, ms(1_700));
    index.complete(&second, ms(1_700));
}

#[test]
fn an_absurd_output_is_bounded_by_the_cache() {
    let index = paced(8);
    // Running, owing at most the cache, with a learned block time.
    let huge = index.record(0, &chain(1, 2), 2, 0, usize::MAX, false, None);
    index.decoding(&huge, Duration::from_secs(1), Pace { lead: 0.0, span: 1e30 });
    // A queued request makes the forecast run through the huge one's end.
    let queued = index.record(0, &chain(2, 7), 7, 0, 0, false, None);
    assert!(index.added(&queued).is_empty(), "it waits");
    index.advance(&[0], Duration::from_secs(2));
    let prompt = chain(0, 8);
    let matched = index.matched(&prompt, &[0])[0];
    assert!(index.kept_through_wait(&prompt, &[wait(0, matched, 8)], Duration::from_secs(2))[0] <= matched);
    assert!(index.entries_of(0) <= 8);
}

/// The shipped layout hears a first token only after its request ended
/// (from the access log). Heard then, it teaches the replica its prefill
/// time (admission to first token, a request admitted alone) and its block
/// time (first token to end); a request admitted later begins decoding, as
/// far as the index knows, when the prefills up to it end, and its output
/// grows into the cache from then on, unheard.
#[test]
fn a_first_token_heard_after_the_end_teaches_the_times_and_later_outputs_grow_unheard() {
    let ms = Duration::from_millis;
    let index = KvIndex::new();
    index.add_replica(0, 6);
    let pace = |span: f64| Some(Pace { lead: 0.0, span });
    // Admitted alone at 0 with two fresh blocks, ended at 400 ms; its first token, at 200 ms, heard after.
    let first = index.record(0, &chain(0, 2), 2, 0, 2, false, pace(2.0));
    index.complete(&first, ms(400));
    let cached = index.entries_of(0);
    index.decoding(&first, ms(200), Pace { lead: 0.0, span: 2.0 });
    assert_eq!(index.entries_of(0), cached, "a first token heard late changes no block");
    // 100 ms a computed block and 100 ms an output block. A request
    // admitted at 1,000 ms with two fresh blocks begins decoding at 1,200:
    // its output takes a block at 1,200, 1,300, 1,400 and 1,500 ms, each
    // evicting the least recently freed (the first's output, then its
    // prompt from the tail).
    index.advance(&[0], ms(1_000));
    let second = index.record(0, &chain(1, 2), 2, 0, 4, false, pace(4.0));
    let held_at = |at: u64| {
        index.advance(&[0], ms(at));
        index.matched(&chain(0, 2), &[0])[0]
    };
    assert_eq!(held_at(1_350), 2);
    assert_eq!(held_at(1_450), 1);
    assert_eq!(held_at(1_550), 0);
    index.complete(&second, ms(1_600));
    assert_eq!(index.matched(&chain(1, 2), &[0]), [2]);
    // Once a first token is heard while its request runs, first tokens
    // come as they happen there: none is estimated any more, and a
    // request's output waits for its own.
    index.advance(&[0], ms(2_000));
    let third = index.record(0, &chain(2, 2), 2, 0, 4, false, pace(4.0));
    index.decoding(&third, ms(2_200), Pace { lead: 0.0, span: 4.0 });
    index.complete(&third, ms(2_600));
    index.advance(&[0], ms(3_000));
    let fourth = index.record(0, &chain(3, 2), 2, 0, 4, false, pace(4.0));
    index.advance(&[0], ms(3_500));
    assert_eq!(index.matched(&chain(2, 2), &[0]), [2], "no output taken before its first token is heard");
    index.decoding(&fourth, ms(3_200), Pace { lead: 0.0, span: 4.0 });
    index.advance(&[0], ms(3_450));
    assert_eq!(index.matched(&chain(2, 2), &[0]), [1], "heard, it grows from its first token");
    index.complete(&fourth, ms(3_600));
}

#[test]
fn a_prefill_takes_a_fixed_part_and_a_part_per_block() {
    let mut fit = super::PrefillFit::default();
    assert_eq!(fit.secs(10), None, "nothing learned");
    fit.add(10.0, 0.012);
    // One size seen: per block alone.
    assert!((fit.secs(20).unwrap_or_default() - 0.024).abs() < 1e-12);
    // 10 ms fixed and 0.2 ms a block, from prefills of two sizes.
    fit.add(100.0, 0.030);
    fit.add(10.0, 0.012);
    let cold = fit.secs(356).unwrap_or_default();
    assert!((cold - 0.0812).abs() < 1e-9, "{cold}");
}

/// An approximate replica's host tier takes a prompt as stored when the
/// shadow admits its request, as the engine stores it when it computes it
/// (ADR 0063): at once when it fits, once room is made when it waits.
/// Until then its blocks are to come: a request sent now finds them, and
/// the stores still to come never doom them (ADR 0065), where they doom
/// blocks stored.
#[test]
fn a_prompt_is_in_host_memory_once_the_shadow_admits_it() {
    let index = KvIndex::new();
    index.add_replica(0, 4);
    index.set_host(0, Some(8));
    let held = |prompt: u8, n: usize| index.offloaded(&chain(prompt, n), &[(0, 0)])[0].0;
    let first = index.record(0, &chain(1, 2), 2, 0, 0, false, None);
    assert_eq!(held(1, 2), 2);
    // Three fresh blocks do not fit beside the first's two: it waits.
    let second = index.record(0, &chain(2, 3), 3, 0, 0, false, None);
    assert_eq!(held(2, 3), 3, "waiting: to come, before a request sent now looks");
    // Eight blocks more to come, behind both, push out eight of the tier's.
    let third = index.record(0, &chain(3, 8), 8, 0, 0, false, None);
    assert_eq!((held(1, 2), held(2, 3)), (0, 3), "the first was admitted at once: stored, and doomed; the second is to come");
    index.complete(&first, Duration::from_millis(1_600));
    assert_eq!(held(2, 3), 0, "admitted once the first made room: stored, and doomed");
    index.take_back(&third);
    index.complete(&second, Duration::from_millis(2_000));
    assert_eq!((held(1, 2), held(2, 3)), (2, 3));
}

/// An approximate replica's request whose GPU prefix lost its tail while it
/// waited loads the tail from host memory when admitted, stores only what
/// follows, and refreshes there only what it loaded and stored: the head of
/// its prefix stays the least recent, as in the engine (ADR 0062).
#[test]
fn a_waiting_request_that_loads_its_lost_tail_refreshes_only_that() {
    let ms = Duration::from_millis;
    let index = KvIndex::new();
    index.add_replica(0, 8);
    index.set_host(0, Some(10));
    // A block time of 100 ms, taught by a request of two output blocks.
    let teach = index.record(0, &chain(9, 1), 1, 0, 2, false, None);
    index.decoding(&teach, ms(200), Pace { lead: 0.0, span: 2.0 });
    index.complete(&teach, ms(400));
    // Prefix a (4 blocks) ran: free in the GPU, stored in host memory.
    let a = index.record(0, &chain(0, 4), 4, 0, 0, false, None);
    index.decoding(&a, ms(500), Pace { lead: 0.0, span: 0.0 });
    index.complete(&a, ms(600));
    // z runs; the request for a and one block more waits for room.
    let z = index.record(0, &chain(1, 4), 4, 0, 2, false, None);
    let r = index.record(0, &chain(0, 5), 4, 0, 0, false, None);
    // z's two output blocks evict a's last two; z ends and r starts, reusing a's first two.
    index.decoding(&z, ms(700), Pace { lead: 0.0, span: 2.0 });
    index.advance(&[0], ms(850));
    index.complete(&z, ms(900));
    index.decoding(&r, ms(1_000), Pace { lead: 0.0, span: 0.0 });
    index.complete(&r, ms(1_100));
    // Three blocks to be stored there evict the three least recent: the
    // teaching request's, then a's first two, which r did not use there.
    let _c = index.record(0, &chain(2, 3), 3, 0, 0, false, None);
    assert_eq!(index.offloaded(&chain(0, 5), &[(0, 0)])[0].0, 0, "a's head is the least recent in host memory");
    assert_eq!(index.offloaded(&chain(0, 5), &[(0, 2)])[0].0, 3, "what r loaded and stored is kept");
}
