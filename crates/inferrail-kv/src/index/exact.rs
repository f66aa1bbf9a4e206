//! One replica's exact view of its engine's KV cache, built from the
//! engine's own KV events (ADR 0012).
//!
//! The engine names its blocks with hashes of its own; each `BlockStored`
//! carries the blocks' token ids, so the block is renamed here with the
//! router's chained hash: the chain continues from the router hash the
//! parent's engine hash maps to, or starts from the seed the caller resolved
//! for the event's model or adapter. The engine may keep two copies of one
//! block (two requests computed it in the same step); each copy is announced
//! and removed on its own, so copies are counted. Blocks live in tiers (the
//! medium, GPU or an offload tier such as CPU, and the KV cache group); only
//! the GPU tier of group 0 answers routing lookups, the others are kept apart.
//!
//! An offload tier holds blocks, not prefixes: it evicts its least recently
//! used blocks, a parent before its child at times, and is read only past
//! the GPU prefix ([`Exact::offloaded`]). So its events never end exact mode.
//! A stored block is named by the router hash its engine hash has in any
//! tier (vLLM's placeholder events carry nothing else: no tokens, no
//! parent, block size 0), else by its tokens after its parent; one it
//! cannot name is left out, and its removal ignored. Clearing the GPU cache
//! leaves the offload tiers as they are, as the engine does.
//!
//! The engine always holds whole prefixes (it frees a request's blocks last
//! first and evicts the least recently freed), and the index's lookup relies
//! on it: a stored block whose parent is unknown, a removed block that is
//! not held, or a removed block whose children are still held means events
//! went missing, and is an error the caller answers by leaving exact mode.
//!
//! Requests the router sent and the engine has not yet reported are claims:
//! each prompt block of a recorded request counts as held until that request
//! completes or is taken back, whatever the engine says meanwhile. A block is
//! present for routing when the engine holds it or a live request claims it.
//!
//! Claims also say what the engine is about to evict (ADR 0020). The claimed
//! blocks the engine does not hold, and one block for each live request (its
//! prompt's partial last block, then the one it generates into), are what
//! the requests sent will allocate before a request sent now starts; past
//! the cache's empty room each allocation evicts the least recently freed
//! block. So the view keeps the held blocks no request claims in the
//! engine's eviction order and presents the ones those allocations will take
//! as absent: a request sent now would not find them. The order follows the
//! engine's frees: a request's claim ends with its blocks freed last first,
//! what it generated (the blocks stored after its claimed ones) just before
//! its prompt; a block stored after one nobody claims goes just before it.
//! What a request generates is held by it until it ends, as its prompt is:
//! it enters the order only then, never ahead of blocks freed meanwhile.
//! So a block's descendants are always evicted before it, and what is
//! presented is still whole prefixes. A request whose tokens end inside a
//! block frees that block unnamed (no event stores or removes it); the
//! engine puts such a block at the head of its free queue, reused before any
//! cached block is evicted, so it is room like any never-used block.

use std::cmp::Reverse;
use std::collections::{BTreeSet, HashMap, HashSet};

use foldhash::fast::FixedState;

use super::{FoldState, Slot};
use crate::hash::{BlockHash, next};
use crate::host::{HostOrder, SharedHost};

/// Where an engine keeps a block: its medium and its KV cache group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tier<'a> {
    /// `GPU`, `CPU` or another offload tier's name, as the engine says it.
    pub medium: &'a str,
    /// The KV cache group (0 for a model with one kind of attention).
    pub group: u32,
}

impl Tier<'_> {
    /// The tier routing lookups count: the engine's GPU blocks of group 0.
    pub const ROUTING: Tier<'static> = Tier { medium: "GPU", group: 0 };

    /// Host memory, where vLLM's offloading connector keeps blocks.
    pub const HOST: Tier<'static> = Tier { medium: "CPU", group: 0 };

    /// Whether it is the engine's GPU memory (any group), which holds whole prefixes.
    fn routes(&self) -> bool {
        self.medium == "GPU"
    }
}

/// One engine KV event, borrowed from the decoded message.
#[derive(Debug, Clone, Copy)]
pub enum Event<'a> {
    /// Blocks stored, parent first.
    Stored(Stored<'a>),
    /// Blocks removed from a tier.
    Removed {
        /// The engine's hashes of the removed blocks.
        hashes: &'a [u64],
        /// Where they were.
        tier: Tier<'a>,
    },
    /// The engine emptied its cache.
    Cleared,
}

/// Blocks the engine stored, one chain: each block's parent is the one before it.
#[derive(Debug, Clone, Copy)]
pub struct Stored<'a> {
    /// The engine's hashes of the blocks.
    pub hashes: &'a [u64],
    /// The engine's hash of the first block's parent, `None` for a prompt's first block.
    pub parent: Option<u64>,
    /// The blocks' token ids, `block_size` a block.
    pub tokens: &'a [u32],
    /// Tokens per block, as the engine says.
    pub block_size: usize,
    /// The router's chain seed for the blocks' model or adapter and cache salt
    /// (used when `parent` is `None`).
    pub seed: BlockHash,
    /// Where the blocks are.
    pub tier: Tier<'a>,
}

/// Why an event cannot be applied; the replica's exact view is no longer trustworthy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    /// The slot is not in the index.
    #[error("slot {0} is not in the index")]
    UnknownReplica(Slot),
    /// The replica is in approximate mode.
    #[error("slot {0} is not in exact mode")]
    NotExact(Slot),
    /// The event's block size is not the replica's.
    #[error("the event's block size is {event}, the replica's {replica}")]
    BlockSizeMismatch {
        /// As the event says.
        event: usize,
        /// As configured or learned.
        replica: usize,
    },
    /// Token ids do not fill the blocks exactly.
    #[error("{tokens} token ids for {blocks} blocks of {block_size}")]
    Malformed {
        /// Token ids in the event.
        tokens: usize,
        /// Blocks in the event.
        blocks: usize,
        /// Tokens per block.
        block_size: usize,
    },
    /// A stored block's parent was never stored.
    #[error("parent block {0:#018x} was never stored")]
    UnknownParent(u64),
    /// A removed block was never stored.
    #[error("removed block {0:#018x} was never stored")]
    UnknownBlock(u64),
    /// A block was removed while blocks that follow it are still held.
    #[error("block {0:#018x} removed while blocks after it are still held")]
    BrokenPrefix(u64),
}

/// A block the engine holds.
#[derive(Debug, Clone, Copy)]
struct Block {
    router: BlockHash,
    /// The parent's engine hash, when the parent is in the same tier.
    parent: Option<u64>,
    copies: u32,
    /// Blocks in the same tier whose parent this is.
    children: u32,
    /// Blocks before it in its chain.
    depth: u32,
}

/// The blocks of one tier.
#[derive(Debug)]
struct TierBlocks {
    medium: String,
    group: u32,
    /// Engine hash -> block. Engine hashes need not be uniform (a
    /// simulator may count them up), so they are mixed properly.
    engine: HashMap<u64, Block, FixedState>,
    /// Router hash -> engine blocks that map to it.
    routed: HashMap<BlockHash, u32, FoldState>,
}

impl TierBlocks {
    fn new(tier: Tier<'_>, room: usize) -> Self {
        Self {
            medium: tier.medium.to_owned(),
            group: tier.group,
            engine: HashMap::with_capacity_and_hasher(room, FixedState::default()),
            routed: HashMap::with_capacity_and_hasher(room, FoldState::default()),
        }
    }

    fn is(&self, tier: Tier<'_>) -> bool {
        self.group == tier.group && self.medium == tier.medium
    }
}

/// Where a free block stands in the engine's eviction order: released at
/// `tick`, deepest first within a tick.
type Stamp = (u64, Reverse<u32>);

/// A replica's exact view; see the module doc.
#[derive(Debug)]
pub(super) struct Exact {
    block_size: usize,
    /// Blocks in the engine's cache.
    capacity: usize,
    /// The routing tier first, the others as they appear.
    tiers: Vec<TierBlocks>,
    /// Router hash -> live requests claiming it.
    claims: HashMap<BlockHash, u32, FoldState>,
    /// Claimed blocks the routing tier does not hold: what the requests sent will allocate.
    unheld: usize,
    /// Live requests: each also holds or will take a block no event names
    /// (its prompt's partial last block, then the one it generates into).
    live: usize,
    /// The routing tier's blocks no request claims, first to be evicted first.
    free: BTreeSet<(Stamp, BlockHash)>,
    /// Each free block's stamp.
    stamps: HashMap<BlockHash, Stamp, FoldState>,
    /// The free blocks the requests sent will evict: held, but absent for routing.
    doomed: HashSet<BlockHash, FoldState>,
    /// Free blocks stored after a claimed block (a request's generated
    /// tokens), by that block: the engine frees them with the request, just
    /// before its prompt, so they are stamped again when its claim ends.
    trailing: HashMap<BlockHash, Vec<BlockHash>, FoldState>,
    /// The claimed block each trailing block follows.
    anchor: HashMap<BlockHash, BlockHash, FoldState>,
    /// The last tick given out.
    tick: u64,
    /// The host memory tier (medium `CPU`, group 0) in eviction order,
    /// and what the requests sent will store there when admitted: each
    /// request's prompt past what it loads from there.
    host: HostOrder,
    /// Events applied so far.
    events: u64,
    /// The event that stored each block the routing tier holds.
    born: HashMap<BlockHash, u64, FoldState>,
    /// The event that stored each block the host memory tier holds.
    host_born: HashMap<BlockHash, u64, FoldState>,
    /// Blocks a request not yet known admitted claims, stored since last
    /// taken ([`Self::take_admitted`]) on the GPU or in host memory: their
    /// requests were admitted.
    admitted: Vec<BlockHash>,
    /// Claimed blocks after which a block was generated since last taken
    /// ([`Self::take_grown`]): their requests filled an output block then.
    grown: Vec<BlockHash>,
}

/// What of a request's prompt the engine uses in host memory (vLLM's
/// offloading connector): a request that loads blocks from there stores
/// only the blocks after them, and refreshes those it loaded and stored;
/// any other stores and refreshes its whole prompt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct HostUse {
    /// Its first block loaded (the GPU hit's length), else 0: foreseen when
    /// it was sent, and in approximate mode found again when the shadow
    /// admits it (exact mode finds it when the request ends, from `seen`).
    pub from: usize,
    /// Its first block stored.
    pub stores: usize,
    /// Exact mode: the events its replica's view had applied when it was
    /// sent. Its GPU hit ends at the first of its blocks stored since, and
    /// that says what it refreshes when it ends (`Exact::unclaim`).
    pub seen: u64,
    /// Exact mode: the engine admitted it (blocks it claimed were stored on
    /// the GPU, or its first token was heard), and so offered its blocks to
    /// host memory ([`Exact::host_started`]).
    pub started: bool,
}

impl HostUse {
    /// A request whose GPU hit is `hit` blocks and that finds `loads` more
    /// in host memory: it loads those, if any, and stores what follows;
    /// else it stores its whole prompt. `seen`: see the field.
    pub(super) fn found(hit: usize, loads: usize, seen: u64) -> Self {
        if loads > 0 { Self { from: hit, stores: hit + loads, seen, started: false } } else { Self { seen, ..Self::default() } }
    }
}

/// A change in what the routing tier presents: the block, and whether it is now present.
pub(super) type Change = (BlockHash, bool);

impl Exact {
    /// An empty view of a cache of `blocks` blocks of `block_size` tokens
    /// (room for them is taken at once, up to 65,536).
    /// Its host tier is mirrored in `host` (ADR 0059).
    pub(super) fn new(block_size: usize, blocks: usize, host_blocks: Option<usize>, host: &SharedHost) -> Self {
        Self {
            block_size,
            capacity: blocks,
            tiers: vec![TierBlocks::new(Tier::ROUTING, blocks.min(1 << 16))],
            claims: HashMap::default(),
            unheld: 0,
            live: 0,
            free: BTreeSet::new(),
            stamps: HashMap::default(),
            doomed: HashSet::default(),
            trailing: HashMap::default(),
            anchor: HashMap::default(),
            tick: 0,
            host: HostOrder::mirrored(host_blocks, host),
            events: 0,
            born: HashMap::default(),
            host_born: HashMap::default(),
            admitted: Vec::new(),
            grown: Vec::new(),
        }
    }

    /// Tokens per block.
    pub(super) fn block_size(&self) -> usize {
        self.block_size
    }

    /// Applies one event, pushing the routing tier's changes to `changes`.
    pub(super) fn apply(&mut self, event: &Event<'_>, changes: &mut Vec<Change>) -> Result<(), EventError> {
        self.events += 1;
        let applied = match event {
            Event::Stored(s) => self.store(s, changes),
            Event::Removed { hashes, tier } => self.remove(hashes, *tier, changes),
            Event::Cleared => {
                self.clear(changes);
                Ok(())
            }
        };
        self.settle(changes);
        applied
    }

    fn store(&mut self, s: &Stored<'_>, changes: &mut Vec<Change>) -> Result<(), EventError> {
        if !s.tier.routes() {
            let t = self.tier_index(s.tier);
            self.store_offloaded(t, s);
            return Ok(());
        }
        if s.block_size != self.block_size {
            return Err(EventError::BlockSizeMismatch { event: s.block_size, replica: self.block_size });
        }
        if s.tokens.len() != s.hashes.len() * s.block_size || s.block_size == 0 {
            return Err(EventError::Malformed { tokens: s.tokens.len(), blocks: s.hashes.len(), block_size: s.block_size });
        }
        let t = self.tier_index(s.tier);
        // The chain so far: the parent's engine hash, router hash and depth.
        let (parent, mut router, depth) = match s.parent {
            None => (None, s.seed, 0),
            Some(p) => match self.tiers[t].engine.get(&p) {
                Some(b) => (Some(p), b.router, b.depth + 1),
                None => return Err(EventError::UnknownParent(p)),
            },
        };
        let routing = t == 0;
        // The router hash of the parent in this tier, for the eviction order.
        let before = parent.map(|_| router);
        let TierBlocks { engine, routed, .. } = &mut self.tiers[t];
        // Router hashes first; then the blocks last first, so each learns
        // whether the block after it was new (its child) without a second lookup.
        let mut chain = Vec::with_capacity(s.hashes.len());
        for block in s.tokens.chunks_exact(s.block_size) {
            router = next(router, block);
            chain.push(router);
        }
        let mut child_added = false;
        // Blocks the routing tier did not hold under any engine hash, for the eviction order.
        let mut fresh = vec![false; chain.len()];
        for (i, (&e, &router)) in s.hashes.iter().zip(&chain).enumerate().rev() {
            let added = match engine.entry(e) {
                std::collections::hash_map::Entry::Occupied(mut b) => {
                    let b = b.get_mut();
                    b.copies += 1;
                    b.children += u32::from(child_added);
                    false
                }
                std::collections::hash_map::Entry::Vacant(v) => {
                    let up = if i == 0 { parent } else { Some(s.hashes[i - 1]) };
                    v.insert(Block { router, parent: up, copies: 1, children: u32::from(child_added), depth: depth + i as u32 });
                    let n = routed.entry(router).or_insert(0);
                    *n += 1;
                    if routing && *n == 1 {
                        fresh[i] = true;
                        self.born.insert(router, self.events);
                        if !self.claims.contains_key(&router) {
                            changes.push((router, true));
                        }
                    }
                    true
                }
            };
            child_added = added;
        }
        // The first block's parent, when in this tier, gained a child.
        if child_added && let Some(b) = parent.and_then(|p| engine.get_mut(&p)) {
            b.children += 1;
        }
        if routing {
            self.stored_free(before, &chain, &fresh, depth);
        }
        Ok(())
    }

    /// Blocks an offload tier `t` stored (see the module doc).
    fn store_offloaded(&mut self, t: usize, s: &Stored<'_>) {
        let bs = self.block_size;
        let described = s.block_size == bs && bs > 0 && s.tokens.len() == s.hashes.len() * bs;
        let mut router = match s.parent {
            None => Some(s.seed),
            Some(p) => self.named(p),
        };
        let host = self.tiers[t].is(Tier::HOST);
        for (i, &e) in s.hashes.iter().enumerate() {
            let by_tokens = router.filter(|_| described).map(|r| next(r, &s.tokens[i * bs..(i + 1) * bs]));
            router = self.named(e).or(by_tokens);
            let Some(r) = router else { continue };
            let TierBlocks { engine, routed, .. } = &mut self.tiers[t];
            match engine.entry(e) {
                std::collections::hash_map::Entry::Occupied(mut b) => b.get_mut().copies += 1,
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(Block { router: r, parent: None, copies: 1, children: 0, depth: 0 });
                    let n = routed.entry(r).or_insert(0);
                    *n += 1;
                    if host && *n == 1 {
                        self.note_admitted(r);
                        self.host.stored(r);
                        self.host_born.insert(r, self.events);
                    }
                }
            }
        }
    }

    /// The router hash an engine hash has in any tier.
    fn named(&self, e: u64) -> Option<BlockHash> {
        self.tiers.iter().find_map(|tb| tb.engine.get(&e).map(|b| b.router))
    }

    /// Sets the host tier's size (`None`: learned from what it holds).
    pub(super) fn set_host(&mut self, blocks: Option<usize>) {
        self.host.resize(blocks);
    }

    /// Its host memory tier.
    pub(super) fn host(&self) -> &HostOrder {
        &self.host
    }

    /// Of `keys` (those past the GPU prefix and the host memory run), the
    /// blocks the engine will find in other offload tiers of group 0 (disk,
    /// remote storage), consecutive from the first.
    pub(super) fn elsewhere(&self, keys: &[BlockHash]) -> usize {
        let others = |k: &BlockHash| self.tiers[1..].iter().any(|tb| tb.group == 0 && tb.medium != "CPU" && tb.routed.contains_key(k));
        keys.iter().take_while(|k| others(k)).count()
    }

    /// Newly held blocks of one chain enter the eviction order, or stop
    /// counting as allocations to come when claimed. A free block goes just
    /// before the free block it follows (same tick, deeper), so it is
    /// evicted first; after a claimed block or none, at a new tick.
    fn stored_free(&mut self, before: Option<BlockHash>, chain: &[BlockHash], fresh: &[bool], depth: u32) {
        let mut tick = before.and_then(|h| self.stamps.get(&h)).map(|s| s.0);
        let mut prev = before;
        for (i, (&h, &fresh)) in chain.iter().zip(fresh).enumerate() {
            if fresh && self.claims.contains_key(&h) {
                self.unheld = self.unheld.saturating_sub(1);
                self.note_admitted(h);
            } else if fresh {
                let t = *tick.get_or_insert_with(|| {
                    self.tick += 1;
                    self.tick
                });
                // After a claimed block, or after a block that follows one:
                // generated by the request in flight that claims it, which
                // holds it until it ends, so it enters the eviction order then.
                let anchor = prev.and_then(|p| if self.claims.contains_key(&p) { Some(p) } else { self.anchor.get(&p).copied() });
                match anchor {
                    Some(a) => {
                        self.stamps.insert(h, (t, Reverse(depth + i as u32)));
                        self.anchor.insert(h, a);
                        self.trailing.entry(a).or_default().push(h);
                        if self.grown.last() != Some(&a) {
                            self.grown.push(a);
                        }
                    }
                    None => self.stamp(h, (t, Reverse(depth + i as u32))),
                }
            } else {
                tick = self.stamps.get(&h).map(|s| s.0);
            }
            prev = Some(h);
        }
    }

    /// A free block takes its place in the eviction order, or moves there.
    fn stamp(&mut self, h: BlockHash, stamp: Stamp) {
        if let Some(old) = self.stamps.insert(h, stamp) {
            self.free.remove(&(old, h));
        }
        self.free.insert((stamp, h));
    }

    /// A block leaves the eviction order (claimed, or no longer held);
    /// returns whether it was about to be evicted (and so absent).
    fn unfree(&mut self, h: BlockHash) -> bool {
        if let Some(stamp) = self.stamps.remove(&h) {
            self.free.remove(&(stamp, h));
        }
        self.anchor.remove(&h);
        self.doomed.remove(&h)
    }

    fn remove(&mut self, hashes: &[u64], tier: Tier<'_>, changes: &mut Vec<Change>) -> Result<(), EventError> {
        let t = self.tiers.iter().position(|tb| tb.is(tier));
        if !tier.routes() {
            // Blocks, not prefixes; one never named was left out.
            let host = tier == Tier::HOST;
            let Some(TierBlocks { engine, routed, .. }) = t.map(|t| &mut self.tiers[t]) else { return Ok(()) };
            for e in hashes {
                let Some(b) = engine.get_mut(e) else { continue };
                b.copies -= 1;
                if b.copies == 0 {
                    let router = b.router;
                    engine.remove(e);
                    if let Some(n) = routed.get_mut(&router) {
                        *n -= 1;
                        if *n == 0 {
                            routed.remove(&router);
                            if host {
                                self.host.removed(router);
                                self.host_born.remove(&router);
                            }
                        }
                    }
                }
            }
            return Ok(());
        }
        let routing = t == Some(0);
        for &e in hashes {
            let Some(TierBlocks { engine, routed, .. }) = t.map(|t| &mut self.tiers[t]) else {
                return Err(EventError::UnknownBlock(e));
            };
            let b = engine.get_mut(&e).ok_or(EventError::UnknownBlock(e))?;
            if b.copies > 1 {
                b.copies -= 1;
                continue;
            }
            if b.children > 0 {
                return Err(EventError::BrokenPrefix(e));
            }
            let b = *b;
            engine.remove(&e);
            if let Some(p) = b.parent.and_then(|p| engine.get_mut(&p)) {
                p.children -= 1;
            }
            if let Some(n) = routed.get_mut(&b.router) {
                *n -= 1;
                if *n == 0 {
                    routed.remove(&b.router);
                    if routing {
                        self.born.remove(&b.router);
                    }
                    if routing && self.claims.contains_key(&b.router) {
                        self.unheld += 1;
                    } else if routing {
                        changes.push((b.router, false));
                        self.unfree(b.router);
                    }
                }
            }
        }
        Ok(())
    }

    fn clear(&mut self, changes: &mut Vec<Change>) {
        changes.extend(self.tiers[0].routed.keys().filter(|h| !self.claims.contains_key(*h)).map(|&h| (h, false)));
        // The GPU's tiers; offloaded blocks stay.
        for tb in self.tiers.iter_mut().filter(|tb| tb.medium == "GPU") {
            tb.engine.clear();
            tb.routed.clear();
        }
        self.unheld = self.claims.len();
        self.born.clear();
        self.free.clear();
        self.stamps.clear();
        self.doomed.clear();
        self.trailing.clear();
        self.anchor.clear();
    }

    /// The tier's index, added empty when new.
    fn tier_index(&mut self, tier: Tier<'_>) -> usize {
        match self.tiers.iter().position(|tb| tb.is(tier)) {
            Some(t) => t,
            None => {
                self.tiers.push(TierBlocks::new(tier, 0));
                self.tiers.len() - 1
            }
        }
    }

    /// A request routed here claims its prompt's blocks: the held ones leave
    /// the eviction order, the others are allocations to come.
    /// Returns what of it the engine will use in host memory.
    pub(super) fn claim(&mut self, keys: &[BlockHash], changes: &mut Vec<Change>) -> HostUse {
        let gpu = self.held_prefix(keys);
        let loads = self.host.run(&keys[gpu..]);
        let host = HostUse::found(gpu, loads, self.events);
        self.host.expect(&keys[host.stores..]);
        self.live += 1;
        for &h in keys {
            let n = self.claims.entry(h).or_insert(0);
            *n += 1;
            if *n > 1 {
                continue;
            }
            if !self.tiers[0].routed.contains_key(&h) {
                self.unheld += 1;
                changes.push((h, true));
                continue;
            }
            self.adopt(h);
            if self.unfree(h) {
                changes.push((h, true));
            }
        }
        self.settle(changes);
        host
    }

    /// A held block claimed again that was waiting, as a generated block,
    /// for an earlier claimed block's claim to end takes over the blocks
    /// stored after it that wait for the same one: its own descendants, and
    /// any other branch's stored after it. They are freed with it at the
    /// latest, just before it, and its claim (which claims that earlier block
    /// too) ends no later, so none is freed after its own ancestor. Left
    /// waiting, its descendants would be stamped after it, and its prefix
    /// evicted before them.
    fn adopt(&mut self, h: BlockHash) {
        let Some(a) = self.anchor.get(&h).copied() else { return };
        let Some(waiting) = self.trailing.get_mut(&a) else { return };
        let Some(at) = waiting.iter().position(|&t| t == h) else { return };
        let after = waiting.split_off(at + 1);
        let mine: Vec<BlockHash> = after.into_iter().filter(|t| self.anchor.get(t) == Some(&a)).collect();
        for &t in &mine {
            self.anchor.insert(t, h);
        }
        self.trailing.entry(h).or_default().extend(mine);
    }

    /// A request claiming `keys` was admitted: the blocks past
    /// `host.stores` it did not find in host memory are being stored, and
    /// the others will not be (`HostOrder::started`).
    pub(super) fn host_started(&mut self, keys: &[BlockHash], host: &mut HostUse) {
        if !host.started {
            host.started = true;
            self.host.started(&keys[host.stores.min(keys.len())..]);
        }
    }

    /// `h` was stored, on the GPU or in host memory: if a request not yet
    /// known admitted expects to store it in host memory, that request was
    /// admitted ([`Self::take_admitted`]).
    fn note_admitted(&mut self, h: BlockHash) {
        if self.host.expects(h) {
            self.admitted.push(h);
        }
    }

    /// The blocks expected in host memory that the GPU or host memory
    /// stored since the last call: a request claiming each was admitted.
    pub(super) fn take_admitted(&mut self) -> Vec<BlockHash> {
        std::mem::take(&mut self.admitted)
    }

    /// The claimed blocks after which blocks were generated since the last
    /// call, each with how many are held after it now: the request in
    /// flight that claims it as its prompt's last filled that many output
    /// blocks.
    pub(super) fn take_grown(&mut self) -> Vec<(BlockHash, usize)> {
        let mut grown = std::mem::take(&mut self.grown);
        grown.sort_unstable();
        grown.dedup();
        grown.into_iter().map(|a| (a, self.generated_count(a))).collect()
    }

    /// How many blocks requests in flight generated after `last`, a claimed
    /// block (the last of their prompts), that are held now.
    pub(super) fn generated_count(&self, last: BlockHash) -> usize {
        self.trailing.get(&last).map_or(0, |t| t.iter().filter(|h| self.anchor.get(*h) == Some(&last)).count())
    }

    /// The blocks stored after `keys` (a request's prompt blocks) while they
    /// are claimed: what requests in flight generated, in the order stored.
    pub(super) fn generated_after<'a>(&'a self, keys: &'a [BlockHash]) -> impl Iterator<Item = &'a BlockHash> + 'a {
        let anchor = &self.anchor;
        keys.iter()
            .filter_map(|k| Some((k, self.trailing.get(k)?)))
            .flat_map(move |(k, trail)| trail.iter().filter(move |t| anchor.get(*t) == Some(k)))
    }

    /// Whether `h` is held by the request in flight that generated it
    /// ([`Self::generated_after`]).
    pub(super) fn generated(&self, h: BlockHash) -> bool {
        self.anchor.contains_key(&h)
    }

    /// Whether a request in flight claims a block.
    pub(super) fn claimed(&self, h: BlockHash) -> bool {
        self.claims.contains_key(&h)
    }

    /// Requests in flight holding a block: those claiming it, or, for a
    /// block generated, those claiming the block it follows, whose claim
    /// frees it when it ends.
    pub(super) fn holders_of(&self, h: BlockHash) -> u32 {
        let claimed = self.anchor.get(&h).unwrap_or(&h);
        self.claims.get(claimed).copied().unwrap_or(0)
    }

    /// How many leading blocks of `keys` the routing tier holds.
    pub(super) fn held_prefix(&self, keys: &[BlockHash]) -> usize {
        keys.iter().take_while(|h| self.tiers[0].routed.contains_key(h)).count()
    }

    /// Blocks a request could take now without waiting: the cache's empty
    /// room and the held blocks no request claims, less what the requests
    /// sent will allocate (their claimed blocks not held, and one block
    /// each in flight).
    pub(super) fn available(&self) -> usize {
        (self.capacity + self.free.len()).saturating_sub(self.tiers[0].engine.len() + self.unheld + self.live)
    }

    /// The cache's room never used: blocks the engine holds no name in.
    pub(super) fn empty(&self) -> usize {
        self.capacity.saturating_sub(self.tiers[0].engine.len())
    }

    /// Blocks the requests sent will allocate: their claimed blocks not
    /// held, and one block each in flight.
    pub(super) fn to_allocate(&self) -> usize {
        self.unheld + self.live
    }

    /// The held blocks no request claims, in the order the engine evicts them.
    pub(super) fn free_order(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.free.iter().map(|&(_, h)| h)
    }

    /// The request completed or was taken back: its claims end. The engine
    /// frees a request's blocks last first, so its held blocks enter the
    /// eviction order at a new tick, deepest first (a partial last block it
    /// frees unnamed is room).
    pub(super) fn unclaim(&mut self, keys: &[BlockHash], host: HostUse, changes: &mut Vec<Change>) {
        self.live = self.live.saturating_sub(1);
        self.tick += 1;
        // The engine refreshes in host memory what it loaded and stored
        // there, past its GPU hit, if it loaded any; else its whole prompt.
        // Its GPU hit, as the engine found it when it admitted the request,
        // ends at the first block stored since it was sent (a block evicted
        // since, after the engine freed it, says nothing); it loaded if host
        // memory held the next block before then.
        let hit = keys.iter().position(|h| self.born.get(h).is_some_and(|&at| at > host.seen)).unwrap_or(keys.len());
        let loaded = keys.get(hit).and_then(|h| self.host_born.get(h)).is_some_and(|&at| at <= host.seen);
        let from = if loaded { hit } else { 0 };
        self.host.finished(&keys[from..]);
        let stores = &keys[host.stores.min(keys.len())..];
        if host.started {
            self.host.landed(stores)
        } else {
            self.host.expected(stores)
        }
        for (depth, h) in keys.iter().enumerate() {
            let Some(n) = self.claims.get_mut(h) else { continue };
            *n -= 1;
            if *n > 0 {
                continue;
            }
            self.claims.remove(h);
            // What the request generated after this block goes with it, first.
            for t in self.trailing.remove(h).unwrap_or_default() {
                if let Some(old) = self.stamps.get(&t).copied().filter(|_| self.anchor.get(&t) == Some(h)) {
                    self.stamp(t, (self.tick, old.1));
                    self.anchor.remove(&t);
                }
            }
            if self.tiers[0].routed.contains_key(h) {
                self.stamp(*h, (self.tick, Reverse(depth as u32)));
            } else {
                self.unheld = self.unheld.saturating_sub(1);
                changes.push((*h, false));
            }
        }
        self.settle(changes);
    }

    /// Presents as absent the free blocks that the allocations to come will
    /// evict once the cache's empty room is used up, and as present again
    /// those they no longer will.
    fn settle(&mut self, changes: &mut Vec<Change>) {
        let held = self.tiers[0].engine.len();
        let room = self.capacity.saturating_sub(held);
        let evicted = (self.unheld + self.live).saturating_sub(room);
        if evicted == 0 && self.doomed.is_empty() {
            return;
        }
        // The first `evicted` places in the eviction order.
        let doomed: HashSet<BlockHash, FoldState> = self.free.iter().take(evicted).map(|&(_, h)| h).collect();
        changes.extend(doomed.iter().filter(|h| !self.doomed.contains(*h)).map(|&h| (h, false)));
        changes.extend(self.doomed.iter().filter(|h| !doomed.contains(*h)).map(|&h| (h, true)));
        self.doomed = doomed;
    }

    /// Every block that may be present for routing: held or claimed (held
    /// ones about to be evicted are not, but releasing them again is harmless).
    pub(super) fn present(&self) -> impl Iterator<Item = BlockHash> + '_ {
        let routed = &self.tiers[0].routed;
        routed.keys().copied().chain(self.claims.keys().copied().filter(|h| !routed.contains_key(h)))
    }

    /// The routing tier's blocks, deepest first (the order an engine would
    /// evict them), for seeding an approximate shadow.
    pub(super) fn deepest_first(&self) -> Vec<BlockHash> {
        let mut blocks: Vec<(u32, BlockHash)> = self.tiers[0].engine.values().map(|b| (b.depth, b.router)).collect();
        blocks.sort_unstable_by_key(|b| std::cmp::Reverse(b.0));
        blocks.into_iter().map(|(_, h)| h).collect()
    }

    /// Blocks held in each tier: medium, group, blocks.
    pub(super) fn tiers(&self) -> Vec<(String, u32, usize)> {
        self.tiers.iter().map(|tb| (tb.medium.clone(), tb.group, tb.engine.len())).collect()
    }

    /// Blocks held over all tiers.
    pub(super) fn len(&self) -> usize {
        self.tiers.iter().map(|tb| tb.engine.len()).sum()
    }

    /// Bytes allocated, by the maps' capacities.
    pub(super) fn bytes(&self) -> usize {
        let per_engine = size_of::<(u64, Block)>() + 1;
        let per_routed = size_of::<(BlockHash, u32)>() + 1;
        let per_born = size_of::<(BlockHash, u64)>() + 1;
        let tiers: usize = self.tiers.iter().map(|tb| tb.engine.capacity() * per_engine + tb.routed.capacity() * per_routed).sum();
        tiers + self.claims.capacity() * per_routed + (self.born.capacity() + self.host_born.capacity()) * per_born
    }
}

#[cfg(test)]
mod tests;
