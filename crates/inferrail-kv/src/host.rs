//! What a replica's engine holds in host memory, in the order it evicts it
//! (vLLM 0.32's `OffloadingConnector`, ADR 0059): least recently used
//! first, where a block is used when it is stored and when a request that
//! stored or found it finishes, its first block last.
//!
//! In exact mode the engine's events say which blocks it holds, and the
//! requests the router sent say when they finish; in approximate mode a
//! request's full prompt blocks are taken as stored when the shadow admits
//! it (or its first token is heard, or it ends, if that comes first), and
//! the least recent go past the tier's size. Either
//! way, the requests sent and not yet admitted will store their prompt
//! blocks the tier lacks ([`HostOrder::expect`]) before a request sent now
//! is: past the tier's size, that many of the least recent blocks are as
//! good as gone, and the blocks they store are as good as held
//! ([`HostOrder::run`]). The fleet
//! simulation's engines keep their own host tier with it too.
//!
//! An index's tiers are also mirrored, block by block, in one
//! [`HostHolders`] map, so that a lookup over many replicas probes each of
//! the prompt's blocks once for all of them ([`HostHolders::runs`]) instead
//! of once for each replica's own map.

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::hash::BlockHash;
use crate::index::FoldState;

/// The blocks in host memory and their recency; see the module doc.
#[derive(Debug)]
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
    pending: HashMap<BlockHash, Pending, FoldState>,
    /// Of those, the ones still due that it lacks.
    incoming: usize,
    /// The rank below which blocks are as good as gone, once found: found
    /// again only after a change, as lookups far outnumber changes.
    kept_from: Cell<Option<u64>>,
    /// Its id in the index's [`HostHolders`], which mirror its blocks.
    mirror: Option<(u32, SharedHost)>,
}

/// A block requests sent will store: how many of them have not been
/// admitted yet (the engine offers a request's blocks once, when it admits
/// it), and whether one admitted is storing it now. Either way it is to
/// come; once stored, an eviction makes it to come again only while a
/// request not yet admitted expects it.
///
/// A block being stored already has its place in the order: the engine
/// ranks it when it offers it, not when the copy lands, and a finishing
/// request that names it moves it up meanwhile (vLLM's LRU manager inserts
/// it at `prepare_store` and `touch` moves it before `complete_store`).
#[derive(Debug, Clone, Copy, Default)]
struct Pending {
    requests: u32,
    /// Its place in the order, while a request admitted is storing it.
    landing: Option<u64>,
}

impl Pending {
    fn due(self) -> bool {
        self.requests > 0 || self.landing.is_some()
    }
}

/// What [`HostOrder::sent`] changed: the blocks it added, and those it
/// evicted with their places in the order.
#[derive(Debug, Default)]
pub struct Sent {
    added: Vec<BlockHash>,
    evicted: Vec<(u64, BlockHash)>,
}

/// The [`HostHolders`] of an index, shared by its tiers.
pub type SharedHost = Arc<Mutex<HostHolders>>;

/// Every mirrored tier's blocks, by block: the tiers holding it (by id) and
/// its rank in each; see the module doc.
#[derive(Debug, Default)]
pub struct HostHolders {
    blocks: HashMap<BlockHash, Vec<(u32, u64)>, FoldState>,
    /// Ids of dropped tiers, taken again first, so that ids stay few.
    free: Vec<u32>,
    next: u32,
}

/// The rank a block to come has in the mirror: held after every block held.
const TO_COME: u64 = u64::MAX;

/// No candidate: an id's entry in [`HostHolders::runs`]'s table.
const NONE: usize = usize::MAX;

impl HostHolders {
    /// Locks `shared`, whatever a panicking holder left.
    pub fn lock(shared: &SharedHost) -> MutexGuard<'_, HostHolders> {
        shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn set(&mut self, id: u32, h: BlockHash, rank: u64) {
        let tiers = self.blocks.entry(h).or_default();
        match tiers.iter_mut().find(|(t, _)| *t == id) {
            Some(held) => held.1 = rank,
            None => tiers.push((id, rank)),
        }
    }

    fn remove(&mut self, id: u32, h: BlockHash) {
        let Some(tiers) = self.blocks.get_mut(&h) else { return };
        tiers.retain(|(t, _)| *t != id);
        if tiers.is_empty() {
            self.blocks.remove(&h);
        }
    }

    /// For each of `wanted` (one of the tiers mirrored here, and the first
    /// of `keys` it looks from), what [`HostOrder::run`] gives for
    /// `keys[from..]`: the blocks held from there, consecutive. Each block is
    /// probed once, however many tiers look at it.
    pub fn runs(&self, keys: &[BlockHash], wanted: &[(&HostOrder, usize)]) -> Vec<usize> {
        let mut runs = vec![0; wanted.len()];
        // A tier not mirrored finds nothing here.
        let id = |c: usize| wanted[c].0.mirror.as_ref().map(|m| m.0 as usize);
        let ids = (0..wanted.len()).filter_map(|c| Some(id(c)? + 1)).max().unwrap_or(0);
        // The first candidate of each id, and each candidate's next of the same id.
        let (mut of_id, mut same) = (vec![NONE; ids], vec![NONE; wanted.len()]);
        for c in (0..wanted.len()).rev() {
            if let Some(first) = id(c).and_then(|i| of_id.get_mut(i)) {
                same[c] = std::mem::replace(first, c);
            }
        }
        let mut starts: Vec<usize> = (0..wanted.len()).filter(|&c| wanted[c].1 < keys.len()).collect();
        starts.sort_unstable_by_key(|&c| wanted[c].1);
        let mut starts = starts.into_iter().peekable();
        // The tiers whose runs go on at block `i`, and when each last held one.
        let (mut live, mut held_at) = (Vec::new(), vec![usize::MAX; wanted.len()]);
        let mut i = 0;
        loop {
            if live.is_empty() {
                let Some(&c) = starts.peek() else { break };
                i = i.max(wanted[c].1);
            }
            while let Some(c) = starts.next_if(|&c| wanted[c].1 <= i) {
                live.push(c);
            }
            let Some(tiers) = keys.get(i).and_then(|h| self.blocks.get(h)) else {
                live.clear();
                i += 1;
                continue;
            };
            for &(id, rank) in tiers {
                let mut c = of_id.get(id as usize).copied().unwrap_or(NONE);
                while c != NONE {
                    // Found (after a change) only for the tiers that hold a block looked at.
                    if rank >= wanted[c].0.kept_from() {
                        held_at[c] = i;
                    }
                    c = same[c];
                }
            }
            live.retain(|&c| {
                let on = held_at[c] == i;
                runs[c] += usize::from(on);
                on
            });
            i += 1;
        }
        runs
    }
}

impl HostOrder {
    /// An empty tier of `size` blocks, when known.
    pub fn new(size: Option<usize>) -> Self {
        Self::empty(size, None)
    }

    fn empty(size: Option<usize>, mirror: Option<(u32, SharedHost)>) -> Self {
        Self {
            rank: HashMap::default(),
            order: BTreeMap::new(),
            next: 0,
            size,
            peak: 0,
            pending: HashMap::default(),
            incoming: 0,
            kept_from: Cell::new(None),
            mirror,
        }
    }

    /// The same, its blocks mirrored in `shared` (see the module doc).
    pub fn mirrored(size: Option<usize>, shared: &SharedHost) -> Self {
        let id = {
            let mut holders = HostHolders::lock(shared);
            holders.free.pop().unwrap_or_else(|| {
                holders.next += 1;
                holders.next - 1
            })
        };
        Self::empty(size, Some((id, shared.clone())))
    }

    fn mirror_set(&self, h: BlockHash, rank: u64) {
        if let Some((id, shared)) = &self.mirror {
            HostHolders::lock(shared).set(*id, h, rank);
        }
    }

    fn mirror_remove(&self, h: BlockHash) {
        if let Some((id, shared)) = &self.mirror {
            HostHolders::lock(shared).remove(*id, h);
        }
    }

    /// Mirrors `h`, which it does not hold: as the most recent of all
    /// (`TO_COME`) while a request sent is to store it, else not at all.
    fn mirror_absent(&self, h: BlockHash) {
        if self.is_due(h) { self.mirror_set(h, TO_COME) } else { self.mirror_remove(h) }
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
        self.store(h);
        self.peak = self.peak.max(self.rank.len());
    }

    /// `h` was evicted.
    pub fn removed(&mut self, h: BlockHash) {
        self.kept_from.set(None);
        if let Some(r) = self.rank.remove(&h) {
            self.order.remove(&r);
            self.incoming += usize::from(self.is_due(h));
            self.mirror_absent(h);
        }
    }

    /// A request sent will store `keys` when the engine admits it.
    pub fn expect(&mut self, keys: &[BlockHash]) {
        for &h in keys {
            self.pend(h, |p| p.requests += 1);
        }
    }

    /// Whether a request not yet admitted is to store `h`.
    pub fn expects(&self, h: BlockHash) -> bool {
        self.pending.get(&h).is_some_and(|p| p.requests > 0)
    }

    /// A request [`Self::expect`] named `keys` for was admitted: it found in
    /// host memory the blocks held there, and is storing the others, which
    /// take their places in the order now, first first ([`Self::landed`]
    /// when it ends).
    pub fn started(&mut self, keys: &[BlockHash]) {
        for &h in keys {
            let Some(p) = self.pending.get(&h) else { continue };
            let offered = (!self.rank.contains_key(&h) && p.landing.is_none()).then(|| {
                self.next += 1;
                self.next
            });
            self.pend(h, |p| {
                p.requests = p.requests.saturating_sub(1);
                p.landing = p.landing.or(offered);
            });
        }
    }

    /// A request [`Self::started`] for `keys` ended: its stores are over.
    pub fn landed(&mut self, keys: &[BlockHash]) {
        for &h in keys {
            if self.pending.contains_key(&h) {
                self.pend(h, |p| p.landing = None);
            }
        }
    }

    /// A request [`Self::expect`] named `keys` for is over, never admitted,
    /// or admitted in approximate mode, which stores them itself.
    pub fn expected(&mut self, keys: &[BlockHash]) {
        for &h in keys {
            if self.pending.contains_key(&h) {
                self.pend(h, |p| p.requests = p.requests.saturating_sub(1));
            }
        }
    }

    /// Changes what is to come of `h`, keeping the count of those the tier lacks.
    fn pend(&mut self, h: BlockHash, change: impl FnOnce(&mut Pending)) {
        self.kept_from.set(None);
        let p = self.pending.entry(h).or_default();
        let was = p.due();
        change(p);
        let now = p.due();
        if !now {
            self.pending.remove(&h);
        }
        if !self.rank.contains_key(&h) && now != was {
            self.incoming = (self.incoming + usize::from(now)).saturating_sub(usize::from(was));
            self.mirror_absent(h);
        }
    }

    /// A request that used `keys` (its prompt's blocks, first first)
    /// finished: those held, or being stored, become the most recent, the
    /// first one last.
    pub fn finished(&mut self, keys: &[BlockHash]) {
        for &h in keys.iter().rev() {
            if self.rank.contains_key(&h) {
                self.touch(h);
            } else if let Some(Pending { landing: Some(r), .. }) = self.pending.get_mut(&h) {
                self.next += 1;
                *r = self.next;
            }
        }
    }

    /// Approximate mode: a request with these full prompt blocks was sent.
    /// Those it lacks are stored, in order (the first one least recent, as
    /// vLLM's LRU manager adds them; those it holds are skipped, not
    /// refreshed), and the least recent others go past the tier's size.
    /// Returns what changed, for [`Self::unsent`].
    pub fn sent(&mut self, keys: &[BlockHash]) -> Sent {
        self.kept_from.set(None);
        let mut sent = Sent::default();
        for &h in keys {
            if !self.rank.contains_key(&h) {
                self.store(h);
                sent.added.push(h);
            }
        }
        let size = self.size();
        while self.rank.len() > size {
            let Some((r, h)) = self.order.pop_first() else { break };
            self.rank.remove(&h);
            self.incoming += usize::from(self.is_due(h));
            self.mirror_absent(h);
            sent.evicted.push((r, h));
        }
        sent
    }

    /// Undoes [`Self::sent`] (the request never reached the engine): the
    /// blocks it added go, and those it evicted and no later store took
    /// again come back where they were in the order.
    pub fn unsent(&mut self, sent: &Sent) {
        self.kept_from.set(None);
        for &h in &sent.added {
            self.removed(h);
        }
        for &(r, h) in &sent.evicted {
            if !self.rank.contains_key(&h) && self.rank.len() < self.size() {
                self.place(h, r);
            }
        }
    }

    /// How many of `keys`, consecutive from the first, will be held when a
    /// request sent now looks them up: the blocks the requests ahead of it
    /// will store first evict the least recent past the tier's size, and
    /// are then the most recent.
    pub fn run(&self, keys: &[BlockHash]) -> usize {
        if keys.first().is_none_or(|&h| !self.rank.contains_key(&h) && !self.is_due(h)) {
            return 0;
        }
        let kept_from = self.kept_from();
        keys.iter()
            .take_while(|&&h| match self.rank.get(&h) {
                Some(&r) => r >= kept_from,
                None => self.is_due(h),
            })
            .count()
    }

    /// The rank below which blocks are gone by the time a request sent now
    /// looks them up.
    fn kept_from(&self) -> u64 {
        self.kept_from.get().unwrap_or_else(|| {
            let doomed = (self.rank.len() + self.incoming).saturating_sub(self.size()).min(self.rank.len());
            let from = self.order.keys().nth(doomed).copied().unwrap_or(u64::MAX);
            self.kept_from.set(Some(from));
            from
        })
    }

    /// Whether a request sent is still to store `h`.
    fn is_due(&self, h: BlockHash) -> bool {
        self.pending.get(&h).is_some_and(|p| p.due())
    }

    /// `h` becomes the most recent.
    fn touch(&mut self, h: BlockHash) {
        self.next += 1;
        self.place(h, self.next);
    }

    /// `h` is stored: where it was offered if a request admitted was
    /// storing it (see [`Pending`]), else the most recent; it lands.
    fn store(&mut self, h: BlockHash) {
        match self.pending.get(&h).and_then(|p| p.landing).filter(|_| !self.rank.contains_key(&h)) {
            Some(r) => self.place(h, r),
            None => self.touch(h),
        }
        if self.pending.get(&h).is_some_and(|p| p.landing.is_some()) {
            self.pend(h, |p| p.landing = None);
        }
    }

    /// `h` takes place `r` in the order; every change to the order passes
    /// here, or clears the rank found ([`Self::run`]) itself.
    fn place(&mut self, h: BlockHash, r: u64) {
        self.kept_from.set(None);
        match self.rank.insert(h, r) {
            Some(old) => {
                self.order.remove(&old);
            }
            None if self.is_due(h) => self.incoming = self.incoming.saturating_sub(1),
            None => {}
        }
        self.order.insert(r, h);
        self.mirror_set(h, r);
    }
}

impl Drop for HostOrder {
    /// Its blocks leave the mirror, and its id is free again.
    fn drop(&mut self) {
        let Some((id, shared)) = &self.mirror else { return };
        let mut holders = HostHolders::lock(shared);
        for &h in self.rank.keys().chain(self.pending.keys()) {
            holders.remove(*id, h);
        }
        holders.free.push(*id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A change to one of three mirrored tiers, over blocks 0..12.
    #[derive(Debug, Clone)]
    enum Op {
        Stored(usize, u128),
        Removed(usize, u128),
        Expect(usize, Vec<u128>),
        Expected(usize, Vec<u128>),
        Started(usize, Vec<u128>),
        Landed(usize, Vec<u128>),
        Finished(usize, Vec<u128>),
        Sent(usize, Vec<u128>),
        /// Sent, then undone.
        Unsent(usize, Vec<u128>),
        /// The tier is replaced by an empty one (its engine restarted).
        Restart(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        let keys = || proptest::collection::vec(0u128..12, 0..6);
        prop_oneof![
            (0..3usize, 0u128..12).prop_map(|(t, h)| Op::Stored(t, h)),
            (0..3usize, 0u128..12).prop_map(|(t, h)| Op::Removed(t, h)),
            (0..3usize, keys()).prop_map(|(t, k)| Op::Expect(t, k)),
            (0..3usize, keys()).prop_map(|(t, k)| Op::Expected(t, k)),
            (0..3usize, keys()).prop_map(|(t, k)| Op::Started(t, k)),
            (0..3usize, keys()).prop_map(|(t, k)| Op::Landed(t, k)),
            (0..3usize, keys()).prop_map(|(t, k)| Op::Finished(t, k)),
            (0..3usize, keys()).prop_map(|(t, k)| Op::Sent(t, k)),
            (0..3usize, keys()).prop_map(|(t, k)| Op::Unsent(t, k)),
            (0..3usize).prop_map(Op::Restart),
        ]
    }

    proptest! {
        /// The mirror's runs, every tier's at once, are each tier's own.
        #[test]
        fn the_mirror_runs_as_each_tier_does(
            ops in proptest::collection::vec(op(), 1..80),
            sizes in proptest::collection::vec(proptest::option::of(1usize..8), 3),
            keys in proptest::collection::vec(0u128..12, 0..10),
            from in proptest::collection::vec((0usize..3, 0usize..11), 1..6),
        ) {
            let shared = SharedHost::default();
            let mut tiers: Vec<HostOrder> = sizes.iter().map(|&s| HostOrder::mirrored(s, &shared)).collect();
            for op in ops {
                match op {
                    Op::Stored(t, h) => tiers[t].stored(h),
                    Op::Removed(t, h) => tiers[t].removed(h),
                    Op::Expect(t, k) => tiers[t].expect(&k),
                    Op::Expected(t, k) => tiers[t].expected(&k),
                    Op::Started(t, k) => tiers[t].started(&k),
                    Op::Landed(t, k) => tiers[t].landed(&k),
                    Op::Finished(t, k) => tiers[t].finished(&k),
                    Op::Sent(t, k) => {
                        tiers[t].sent(&k);
                    }
                    Op::Unsent(t, k) => {
                        let sent = tiers[t].sent(&k);
                        tiers[t].unsent(&sent);
                    }
                    Op::Restart(t) => tiers[t] = HostOrder::mirrored(sizes[t], &shared),
                }
            }
            // Each of the looks, some at one tier from two places.
            let wanted: Vec<(&HostOrder, usize)> = from.iter().map(|&(t, f)| (&tiers[t], f)).collect();
            let runs = HostHolders::lock(&shared).runs(&keys, &wanted);
            let own: Vec<usize> = from.iter().map(|&(t, f)| tiers[t].run(keys.get(f..).unwrap_or_default())).collect();
            prop_assert_eq!(runs, own);
            drop(wanted);
            // A dropped tier leaves nothing behind.
            drop(tiers);
            prop_assert!(HostHolders::lock(&shared).blocks.is_empty());
        }
    }

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
    fn blocks_requests_ahead_will_store_are_found_by_a_request_sent_after_them() {
        let shared = SharedHost::default();
        let mut t = HostOrder::mirrored(Some(4), &shared);
        for h in 1..=4 {
            t.stored(h);
        }
        t.expect(&[7, 8, 9]);
        let both = |t: &HostOrder, keys: &[BlockHash]| (t.run(keys), HostHolders::lock(&shared).runs(keys, &[(t, 0)])[0]);
        assert_eq!(both(&t, &[4, 7, 8, 9]), (4, 4), "4 is kept, then the three to come");
        assert_eq!(both(&t, &[1, 7]), (0, 0), "1 is evicted by them");
        // Admitted: it stores 7 and 8, then 9 is evicted while it runs.
        t.started(&[7, 8, 9]);
        for h in [7, 8, 9] {
            t.stored(h);
        }
        for h in [1, 2, 3, 9] {
            t.removed(h);
        }
        assert_eq!(both(&t, &[7, 8, 9]), (2, 2), "9 is no longer to come");
        t.landed(&[7, 8, 9]);
        t.expected(&[7, 8, 9]);
        drop(t);
        assert!(HostHolders::lock(&shared).blocks.is_empty());
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
        // 1 was the least recent: a prompt is stored first block first.
        assert_eq!((t.contains(1), t.contains(2), t.contains(5), t.contains(6)), (false, true, true, true));
        // A block held is skipped, not refreshed: 2 goes next.
        t.sent(&[2, 7]);
        assert_eq!((t.contains(2), t.contains(5), t.contains(7)), (false, true, true));
        // A prompt expected and then sent is to come no more.
        t.expect(&[20, 21]);
        assert_eq!((t.run(&[5]), t.run(&[6]), t.run(&[7])), (0, 0, 1), "two to come evict 5 and 6");
        t.sent(&[20, 21]);
        t.expected(&[20, 21]);
        assert_eq!(t.run(&[20, 21]), 2);
    }

    #[test]
    fn a_prompt_sent_and_undone_leaves_the_tier_as_it_was() {
        let mut t = HostOrder::new(Some(3));
        t.sent(&[1, 2, 3]);
        t.expect(&[9]);
        let before = |t: &HostOrder| (t.run(&[1, 2, 3]), t.run(&[2, 3]), t.run(&[3]), t.run(&[5, 6]));
        assert_eq!(before(&t), (0, 2, 1, 0), "one block to come evicts 1");
        let sent = t.sent(&[5, 6, 3]);
        assert_eq!((t.contains(1), t.contains(2), t.run(&[5, 6])), (false, false, 2), "5 and 6 evicted 1 and 2");
        t.unsent(&sent);
        assert_eq!(before(&t), (0, 2, 1, 0));
        // 1 is back as the least recent: the block to come evicts it again.
        t.expected(&[9]);
        assert_eq!(t.run(&[1, 2, 3]), 3);
    }

    #[test]
    fn a_block_takes_its_place_when_offered_and_a_finish_before_it_lands_moves_it() {
        let mut t = HostOrder::new(Some(4));
        for h in 1..=4 {
            t.stored(h);
        }
        // Admitted: 7, 8 and 9 are offered (the engine evicts 1, 2 and 3 for them).
        t.expect(&[7, 8, 9]);
        t.started(&[7, 8, 9]);
        for h in 1..=3 {
            t.removed(h);
        }
        // Before the copies land, a request that used 4 and one that used 8 finish.
        t.finished(&[4]);
        t.finished(&[8]);
        for h in [7, 8, 9] {
            t.stored(h);
        }
        t.landed(&[7, 8, 9]);
        t.expected(&[7, 8, 9]);
        // Least recent first: 7 and 9 as offered, then 4, then 8.
        coming(&mut t, 2);
        assert_eq!((t.run(&[7]), t.run(&[9]), t.run(&[4]), t.run(&[8])), (0, 0, 1, 1), "two to come evict 7 and 9");
        t.expect(&[2_000]);
        assert_eq!((t.run(&[4]), t.run(&[8])), (0, 1), "a third evicts 4, stored before 7 landed but refreshed after it was offered");
    }
}
