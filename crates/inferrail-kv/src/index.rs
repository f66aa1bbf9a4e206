//! The KV index: which leading blocks of a prompt each replica already
//! holds, learned from the router's own decisions (approximate mode) or from
//! the engine's KV events (exact mode, `exact`).
//!
//! Every prompt routed to a replica is recorded in that replica's shadow LRU,
//! as large as its KV cache, in the order an engine frees blocks: a prompt's
//! last block is the least recent of its blocks, so a long prefix is evicted
//! from its tail. A concurrent map from block hash to the replicas holding it
//! answers, for every candidate at once, how many leading blocks it holds.
//! What an attempt recorded can be taken back (the engine refused it), a
//! replica can be cleared (its engine restarted) or forgotten (it left).
//!
//! A running request's output takes blocks as its engine fills them: from
//! its first token, one every block time (the replica's, learned from the
//! requests that completed), the rest when it completes; lookups first
//! bring the replicas to the decision's time (`advance`, ADR 0053). A
//! request that finds no free block preempts the newest decoding one, which
//! waits first in line and resumes where it stopped (ADR 0054). Where the
//! first token is heard only after the end (the shipped layout's access
//! log), a request begins decoding when the prefills admitted up to it
//! end, at the replica's learned prefill time, and the first token heard
//! late teaches the prefill and block times (ADR 0055).
//!
//! While requests wait on an approximate replica, lookups see its cache as
//! a request sent now will find it, once the requests ahead have started
//! (`ahead`, ADR 0050).
//!
//! A replica in exact mode has no shadow in use: the engine's events say what
//! it holds, and the requests the router sent and the engine has not
//! reported claim their prompt blocks until they complete (ADR 0012); the
//! blocks those requests will evict before a new one starts are absent
//! (ADR 0020). Either
//! way the holder map is the one lookup reads, so a lookup costs the same in
//! both modes.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::hash::BlockHash;
use crate::host::{HostOrder, Sent, SharedHost};
use ahead::Ahead;
use exact::{Change, Exact, HostUse};
pub use exact::{Event, EventError, Stored, Tier};
use holders::Holders;
pub use lookup::Wait;
use shadow::Shadow;

mod ahead;
mod exact;
mod exact_mode;
mod holders;
mod lookup;
mod shadow;

/// Most blocks a shadow, and the holder map, take room for before they
/// hold any (about 100 MB of slab): an engine's report of its cache is
/// input, and an absurd one must not allocate the router's memory away.
const UP_FRONT: usize = 1 << 22;

/// A replica's slot in the index.
pub type Slot = u32;

/// A recorded request, for its completion or take-back; what it holds stays in the index.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recorded {
    /// The replica.
    pub slot: Slot,
    /// Which incarnation of the replica (a cleared or re-added replica starts a new one).
    replica: u64,
    request: u64,
}

/// What a request's reply leaves in the engine's cache after its prompt,
/// for the conversation's next turn, which resends prompt and reply
/// (approximate mode): the engine caches the blocks its generated tokens
/// fill, and the router learns their names from the next turn's prompt.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reply {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Output tokens the request asked for at most, if it said.
    pub asked: Option<usize>,
    /// The prompt's tokens after its last full block.
    pub tail: Vec<u32>,
}

/// A completed request's reply: its blocks in the shadow, unnamed, from the
/// one holding the prompt's partial last block on.
#[derive(Debug)]
struct Replied {
    reply: Reply,
    blocks: Vec<BlockHash>,
}

/// One replica as the index sees it: its shadow or exact view, and the requests it runs or queues.
#[derive(Debug)]
struct Replica {
    /// Which incarnation.
    id: u64,
    shadow: Shadow,
    /// The engine's blocks from its events, in exact mode.
    exact: Option<Exact>,
    /// Blocks its engine keeps in host memory, when configured.
    host_blocks: Option<usize>,
    /// Approximate mode's shadow of that tier (with `host_blocks`).
    host: Option<HostOrder>,
    /// Requests sent there and what of their prompts they use in host memory.
    host_coming: HashMap<u64, HostComing>,
    /// Requests recorded and not yet completed or taken back.
    requests: HashMap<u64, Request>,
    /// The LoRA adapter of each request that asked for one, as a tag
    /// ([`KvIndex::adapter`]); entries of requests gone are dropped lazily.
    adapters: HashMap<u64, u64>,
    /// Requests waiting for room, first come first, as in the engine's queue.
    queue: VecDeque<u64>,
    /// What they will evict and store before a request sent now starts, as lookups see it.
    ahead: Ahead,
    /// The replies requests recorded and not yet completed will leave, and their prompts' full blocks.
    coming: HashMap<u64, (Reply, usize)>,
    /// Completed requests' replies by their prompt's last full block.
    replies: HashMap<BlockHash, Replied>,
    /// When `replies` holds more, the ones evicted from the shadow go.
    prune_at: usize,
    /// Running requests still to fill blocks as they decode.
    growing: BTreeSet<u64>,
    /// Seconds a request's decoding takes per block of output tokens here,
    /// learned from the requests that completed (none yet: output is taken
    /// whole at the first token).
    block_time: Option<f64>,
    /// The latest time the replica was brought to.
    clock: Duration,
    /// Requests admitted and not yet decoding, in the order admitted: the
    /// request, when (the clock then), the blocks it computes, and whether
    /// no other was prefilling then.
    prefilling: VecDeque<(u64, Duration, usize, bool)>,
    /// How long a prefill takes here by the blocks it computes, learned
    /// from requests admitted alone (admission to first token): a request
    /// sent now starts after the prefills admitted before it.
    prefill: PrefillFit,
    /// Requests that completed before their first token was heard (the
    /// shipped layout hears it from the access log, after the end), newest
    /// last: when it is, they teach the block and prefill times.
    ended: VecDeque<(u64, Ended)>,
    /// A first token was heard while its request ran: this replica's come
    /// as they happen (the observe filter), and none is estimated.
    on_time: bool,
}

/// A request sent to an approximate replica with a host tier, until it is over.
#[derive(Debug)]
struct HostComing {
    /// Its prompt's full blocks.
    keys: Vec<BlockHash>,
    /// What of them it loads from host memory and stores there.
    used: HostUse,
    /// Once it started: what its stores changed there.
    stored: Option<Sent>,
}

/// A request that completed before its first token was heard.
#[derive(Debug, Clone, Copy)]
struct Ended {
    /// Its entry among the prefills: when it was admitted, the blocks it computed, and whether alone.
    prefill: Option<(Duration, usize, bool)>,
    end: Duration,
}

/// Completed requests kept for their first token to come.
const ENDED_KEPT: usize = 1024;

/// First tokens are estimated on a replica with at most this many requests
/// recorded; above it, outputs are taken at the end, as before ADR 0055.
/// An estimated request grows and is forecast, and while a prompt must
/// wait, every candidate's lookup costs time linear in the blocks the
/// running requests hold. With 2,000 concurrent streams over three
/// replicas (`just stress`, `streams`), that held the router past Envoy's
/// message timeout, and 141-543 of the streams failed open. That happened
/// in 3 runs of 3 with no bound, and in 2 of 5 with a bound of 256; with
/// this bound, none failed in 3 runs. The pressure workloads run at most
/// a few dozen requests a replica and route the same.
const ESTIMATED_AT_MOST: usize = 64;

impl Replica {
    /// Exact mode: the GPU or host memory stored blocks that requests not
    /// yet known admitted claim (`stored`), so those requests were
    /// admitted, each the first sent of those that claim one: each has
    /// offered its blocks to host memory (`Exact::host_started`). Its first
    /// token, heard later, says the same; the engine's events say it sooner.
    fn host_admitted_by_events(&mut self, stored: Vec<BlockHash>) {
        let Some(exact) = &mut self.exact else { return };
        let mut stored: HashSet<BlockHash> = stored.into_iter().collect();
        let mut waiting: Vec<(&u64, &mut Request)> =
            self.requests.iter_mut().filter(|(_, r)| matches!(r, Request::Claiming { host, .. } if !host.started)).collect();
        waiting.sort_unstable_by_key(|(id, _)| **id);
        for (_, request) in waiting {
            let Request::Claiming { keys, host, .. } = request else { continue };
            if stored.is_empty() {
                break;
            }
            if keys.iter().any(|k| stored.contains(k)) {
                for k in keys.iter() {
                    stored.remove(k);
                }
                exact.host_started(keys, host);
            }
        }
    }

    /// Exact mode: the engine stored output blocks that requests in flight
    /// generated (`grown`: the last block of a prompt claimed, and how many
    /// are held after it), at the replica's clock. The engine stores a
    /// block once it is full, as it takes the next: that tells when the
    /// request takes its output blocks, which an estimated first token only
    /// guesses. Its first token is placed where its pace has it take that
    /// block now. A prompt that several requests in flight end with, or a
    /// request not forecast (no first token foretold), is left alone; so is
    /// every request past `ESTIMATED_AT_MOST` in flight, where none is
    /// forecast and a pass over them for each event would cost the most.
    fn filled_by_events(&mut self, grown: &[(BlockHash, usize)]) {
        let Some(per_block) = self.per_block().filter(|_| self.requests.len() <= ESTIMATED_AT_MOST) else { return };
        for &(last, generated) in grown {
            let mut ending = self.requests.values_mut().filter_map(|r| match r {
                Request::Claiming { keys, since, .. } if keys.last() == Some(&last) => Some(since),
                _ => None,
            });
            let (Some(Some((first, pace))), None) = (ending.next(), ending.next()) else { continue };
            // Its output block taken now: the one after the prompt's last
            // block, filled, or after the last of its own blocks filled.
            let taken = generated + usize::from(pace.lead <= 0.0);
            *first = self.clock.saturating_sub(pace.due(taken - 1, per_block));
        }
    }

    /// Request `id`, sent in approximate mode to a replica with a host
    /// tier, is admitted reusing `reused` blocks: the engine's GPU hit. It
    /// loads from host memory the blocks held there from the next one on,
    /// stores the rest now (ADR 0063), and refreshes there, when it ends,
    /// what it loaded and stored; else it stores and refreshes its whole
    /// prompt. What it was foreseen to store when sent is corrected.
    fn host_admitted(&mut self, id: u64, reused: usize) {
        let (Some(host), Some(coming)) = (&mut self.host, self.host_coming.get_mut(&id)) else { return };
        let (keys, used) = (&coming.keys, &mut coming.used);
        let loads = keys.get(reused..).map_or(0, |rest| rest.iter().take_while(|&&h| host.contains(h)).count());
        let found = HostUse::found(reused, loads, used.seen);
        if found.stores != used.stores {
            host.expected(&keys[used.stores..]);
            host.expect(&keys[found.stores..]);
        }
        *used = found;
        self.host_heard(id, true, false);
    }

    /// Request `id`, sent in approximate mode to a replica with a host
    /// tier, started (its prompt stored there), or is `over` (it refreshes
    /// what it used there) or taken back (`!stored`: what it stored there
    /// and the tier lacked before goes again).
    fn host_heard(&mut self, id: u64, stored: bool, over: bool) {
        let (Some(host), Some(coming)) = (&mut self.host, self.host_coming.get_mut(&id)) else { return };
        let (keys, used) = (&coming.keys, &coming.used);
        match &coming.stored {
            None => {
                host.expected(&keys[used.stores..]);
                coming.stored = Some(if stored { host.sent(&keys[used.stores..]) } else { Sent::default() });
            }
            Some(sent) if !stored => host.unsent(sent),
            Some(_) => {}
        }
        if over {
            if stored {
                host.finished(&keys[used.from..]);
            }
            self.host_coming.remove(&id);
        }
    }

    /// Blocks held for it: its shadow's, and in exact mode the engine's in every tier.
    fn entries(&self) -> usize {
        self.shadow.len() + self.exact.as_ref().map_or(0, Exact::len)
    }

    /// Its block time, once learned and not nil.
    fn per_block(&self) -> Option<f64> {
        self.block_time.filter(|&t| t > 0.0)
    }

    /// Request `id`, admitted to compute `fresh` blocks, starts its prefill
    /// after those admitted before it.
    /// It is alone when no prefill admitted before is still under way: none
    /// is left, or, where first tokens are heard only after the end and the
    /// prefill time is known, all have ended by it as estimated.
    fn prefills(&mut self, id: u64, fresh: usize) {
        let estimated = self.prefills_end().filter(|_| !self.on_time);
        let alone = estimated.map_or(self.prefilling.is_empty(), |end| end <= self.clock);
        self.prefilling.push_back((id, self.clock, fresh, alone));
    }

    /// When the prefills admitted and not yet heard decoding end, one after
    /// another at the replica's learned prefill time; `None` while that is
    /// not known.
    fn prefills_end(&self) -> Option<Duration> {
        self.prefill.secs(0)?;
        Some(self.prefilling.iter().fold(Duration::ZERO, |t, &(_, admitted, fresh, _)| {
            let took = self.prefill.secs(fresh).and_then(|s| Duration::try_from_secs_f64(s).ok()).unwrap_or(Duration::MAX);
            t.max(admitted).saturating_add(took)
        }))
    }

    /// Request `id`, just admitted, begins decoding when the prefills
    /// admitted up to it end (an estimate, until its first token is heard):
    /// its output grows at `pace` from then on. Nothing while the prefill
    /// time is not known, once first tokens are heard as they come (an
    /// estimate earlier than the engine would take blocks too soon), or
    /// past `ESTIMATED_AT_MOST` requests. A running request decodes after
    /// the others by `next_order` (a claim has no order).
    fn foretell(&mut self, id: u64, pace: Option<Pace>, next_order: u64) {
        if self.requests.len() > ESTIMATED_AT_MOST {
            return;
        }
        let (Some(pace), Some(first), false) = (pace, self.prefills_end(), self.on_time) else { return };
        match self.requests.get_mut(&id) {
            Some(Request::Running { since: since @ None, owed, order, .. }) => {
                *since = Some((first, pace));
                *order = next_order;
                if *owed > 0 {
                    self.growing.insert(id);
                }
            }
            Some(Request::Claiming { since: since @ None, .. }) => *since = Some((first, pace)),
            _ => {}
        }
    }

    /// Request `id` ended at `at`: one whose first token was heard teaches
    /// the block time now; any other is kept, with its entry among the
    /// prefills, for its first token to teach it when heard.
    fn learn_end(
        &mut self,
        id: u64,
        since: Option<(Duration, Pace)>,
        heard: bool,
        prefill: Option<(u64, Duration, usize, bool)>,
        at: Duration,
    ) {
        match since {
            Some((since, pace)) if heard => self.block_time = pace.learn(self.block_time, at.saturating_sub(since)),
            _ => {
                if self.ended.len() >= ENDED_KEPT {
                    self.ended.pop_front();
                }
                let prefill = prefill.map(|(_, admitted, fresh, alone)| (admitted, fresh, alone));
                self.ended.push_back((id, Ended { prefill, end: at }));
            }
        }
    }

    /// Learns the prefill time from a request admitted alone, `prefill` its
    /// entry among the prefills, whose first token came at `at`: from
    /// admission to first token, by the blocks it computed.
    fn learn_prefill(&mut self, prefill: (Duration, usize, bool), at: Duration) {
        let (admitted, fresh, alone) = prefill;
        if alone && fresh > 0 && at > admitted {
            self.prefill.add(fresh as f64, (at - admitted).as_secs_f64());
        }
    }

    /// The engine preempts running request `id` at `at`: its blocks are
    /// freed, last first (its last, not full, as room), and it waits at the
    /// head of the queue to compute them again, reusing those that survive.
    fn preempt(&mut self, id: u64, at: Duration) {
        if !matches!(self.requests.get(&id), Some(Request::Running { .. })) {
            return;
        }
        let Some(Request::Running { mut keys, generated, owed, since, heard, ends_partial, .. }) = self.requests.remove(&id) else {
            return;
        };
        self.growing.remove(&id);
        let prompt_blocks = keys.len();
        keys.extend(generated);
        let last = keys.last().copied().filter(|&h| is_placeholder(h));
        if let Some(h) = last {
            keys.pop();
            self.shadow.withdraw(h);
        }
        for &h in keys.iter().rev() {
            self.shadow.release(h);
        }
        let resume = since.map(|(first, pace)| Resume { prompt_blocks, decoded: at.saturating_sub(first), pace, heard });
        let waiting = Request::Waiting {
            reusable: keys.len(),
            prompt: keys,
            partial: usize::from(last.is_some()),
            output: owed,
            ends_partial,
            pace: since.map(|(_, pace)| pace),
            resume,
        };
        self.requests.insert(id, waiting);
        self.queue.push_front(id);
    }
}

/// When a decoding request needs its output blocks, in blocks of its
/// replica's size: the engine takes a block when a token no longer fits
/// in the last, one block's worth of tokens apart.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Pace {
    /// The room left in the prompt's last block, in blocks (0 to 1): the
    /// first output block is needed once the tokens have filled it.
    pub lead: f64,
    /// The output tokens asked for, in blocks: the time from the first
    /// token to the end spans this many block times.
    pub span: f64,
}

impl Pace {
    /// Output blocks a request needs `elapsed` after its first token, at
    /// `block_time` seconds a block: the first token's block at once
    /// unless the prompt's last block has room, then one a block time.
    pub fn filled(self, elapsed: Duration, block_time: f64) -> usize {
        (elapsed.as_secs_f64() / block_time + 1.0 - self.lead).floor().max(0.0) as usize
    }

    /// How long after its first token a request at this pace needs its
    /// output block after the first `filled`, at `block_time` seconds a
    /// block (`filled` counts it from then on).
    pub fn due(self, filled: usize, block_time: f64) -> Duration {
        Duration::try_from_secs_f64((filled as f64 + self.lead) * block_time).unwrap_or(Duration::MAX)
    }

    /// A replica's block time after a request at this pace decoded for
    /// `took` (from its first token to its end as the router heard them):
    /// a moving average, each request weighing a fifth. Only a request
    /// that asked for a block of output or more counts: the router hears
    /// an end a little after the engine's, and over a few tokens that
    /// delay would make a block time many times the engine's.
    pub fn learn(self, old: Option<f64>, took: Duration) -> Option<f64> {
        if self.span < 1.0 {
            return old;
        }
        let sample = took.as_secs_f64() / self.span;
        Some(old.map_or(sample, |old| 0.8 * old + 0.2 * sample))
    }
}

/// A prefill's time as a fixed part (the engine step it waits for, the
/// decode step after it) plus a part per block computed, fitted by least
/// squares over the requests admitted alone, each sample weighing a tenth
/// less than the next. A per-block time alone spread the fixed part over
/// the blocks: on W1's prompts it took a cold prompt (356 blocks) for
/// nearly twice its time, and every first token estimated behind it late.
#[derive(Debug, Clone, Copy, Default)]
struct PrefillFit {
    n: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

impl PrefillFit {
    /// A prefill of `blocks` blocks took `secs`.
    fn add(&mut self, blocks: f64, secs: f64) {
        for v in [&mut self.n, &mut self.x, &mut self.y, &mut self.xx, &mut self.xy] {
            *v *= 0.9;
        }
        self.n += 1.0;
        self.x += blocks;
        self.y += secs;
        self.xx += blocks * blocks;
        self.xy += blocks * secs;
    }

    /// Seconds a prefill of `blocks` blocks takes; `None` before any
    /// sample. Until the samples differ in size (or where the fit says a
    /// negative part), the time is per block alone.
    fn secs(&self, blocks: usize) -> Option<f64> {
        if self.n == 0.0 || self.x <= 0.0 {
            return None;
        }
        let b = blocks as f64;
        let det = self.n * self.xx - self.x * self.x;
        let per = (self.n * self.xy - self.x * self.y) / det;
        let fixed = (self.y - per * self.x) / self.n;
        if det > 1e-9 * self.n * self.xx && per >= 0.0 && fixed >= 0.0 { Some(fixed + per * b) } else { Some(b * self.y / self.x) }
    }
}

/// Replies kept before the first prune.
const REPLIES_KEPT: usize = 1024;

/// Where a preempted request takes up its decoding again once readmitted.
#[derive(Debug, Clone, Copy)]
struct Resume {
    /// Its prompt's blocks: the ones after them are its output's.
    prompt_blocks: usize,
    /// How long it had decoded, and at what pace.
    decoded: Duration,
    pace: Pace,
    /// Whether its first token was heard (else its decoding is estimated).
    heard: bool,
}

#[derive(Debug)]
enum Request {
    /// In the engine's queue: holds nothing yet; `pace`: its output's, if
    /// known. A preempted request waits to compute its prompt and output
    /// again (`resume`).
    Waiting {
        prompt: Vec<BlockHash>,
        reusable: usize,
        partial: usize,
        output: usize,
        ends_partial: bool,
        pace: Option<Pace>,
        resume: Option<Resume>,
    },
    /// Running: holds its prompt's blocks, the reused ones first, and
    /// those its generated tokens filled so far; `owed` more are to come,
    /// at its pace from its first token (`since`: as heard, `heard`, or
    /// estimated from the prefills ahead); `ends_partial`: its last block
    /// will not be full, and the engine
    /// frees it as room; `order`: when it began decoding, against the
    /// others (the newest is preempted first).
    Running {
        keys: Vec<BlockHash>,
        reused: usize,
        generated: Vec<BlockHash>,
        owed: usize,
        since: Option<(Duration, Pace)>,
        heard: bool,
        ends_partial: bool,
        order: u64,
    },
    /// Sent to a replica in exact mode: claims its prompt blocks; its
    /// `output` blocks grow from its first token (`since`, `heard` as for
    /// `Running`), which the wait forecast follows.
    /// `host`: what of its prompt the engine will load from and store in host memory.
    Claiming { keys: Vec<BlockHash>, host: HostUse, output: usize, since: Option<(Duration, Pace)>, heard: bool },
}

/// Hashes a block hash with two multiplies: a block hash is uniform already
/// and a general-purpose hasher would spend longer than the lookup, but keys
/// with structure (placeholders count up) must not collide or gather in a few
/// buckets, and the concurrent map places entries by the hash's high bits.
#[derive(Debug, Clone, Copy, Default)]
pub struct Fold(u64);

impl std::hash::Hasher for Fold {
    fn finish(&self) -> u64 {
        self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15)
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 ^= u64::from_le_bytes(word);
        }
    }

    fn write_u128(&mut self, v: u128) {
        self.0 ^= (v as u64).wrapping_mul(0xd6e8_feb8_6659_fd93) ^ ((v >> 64) as u64).wrapping_mul(0xa076_1d64_78bd_642f).rotate_left(32);
    }
}

pub(crate) type FoldState = std::hash::BuildHasherDefault<Fold>;

/// The index; see the module doc.
#[derive(Debug)]
pub struct KvIndex {
    /// Block -> the slots holding it.
    holders: Holders,
    replicas: Mutex<HashMap<Slot, Replica>>,
    /// The replicas' host memory tiers, block by block (locked only under
    /// `replicas`' lock).
    host: SharedHost,
    placeholders: AtomicU64,
    /// Replica incarnations and requests take their ids from here.
    ids: AtomicU64,
}

/// Placeholder keys carry this tag in their high half; a real block hash does
/// with probability 2^-64.
const PLACEHOLDER: BlockHash = (u64::MAX as BlockHash) << 64;

fn is_placeholder(h: BlockHash) -> bool {
    h >> 64 == u64::MAX as BlockHash
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl KvIndex {
    /// An empty index.
    pub fn new() -> Self {
        Self {
            holders: Holders::new(),
            replicas: Mutex::default(),
            host: SharedHost::default(),
            placeholders: AtomicU64::new(0),
            ids: AtomicU64::new(0),
        }
    }

    /// Adds a replica that holds nothing and can hold `capacity` blocks (at least one).
    pub fn add_replica(&self, slot: Slot, capacity: usize) {
        let mut replicas = self.lock();
        if let Some(old) = replicas.insert(slot, self.new_replica(capacity, None)) {
            self.drop_all(slot, old);
        }
        // The map holds no more blocks than the replicas together: room for
        // them now spares the writes that would wait while a table grows.
        self.holders.reserve(room_up_front(&replicas));
    }

    fn new_replica(&self, capacity: usize, host_blocks: Option<usize>) -> Replica {
        let id = self.ids.fetch_add(1, Ordering::Relaxed);
        Replica {
            id,
            shadow: Shadow::new(capacity),
            exact: None,
            host_blocks,
            host: host_blocks.map(|b| HostOrder::mirrored(Some(b), &self.host)),
            host_coming: HashMap::new(),
            requests: HashMap::new(),
            adapters: HashMap::new(),
            queue: VecDeque::new(),
            ahead: Ahead::default(),
            coming: HashMap::new(),
            replies: HashMap::new(),
            prune_at: REPLIES_KEPT,
            growing: BTreeSet::new(),
            block_time: None,
            clock: Duration::ZERO,
            prefilling: VecDeque::new(),
            prefill: PrefillFit::default(),
            ended: VecDeque::new(),
            on_time: false,
        }
    }

    /// Forgets a replica that left.
    pub fn remove_replica(&self, slot: Slot) {
        let mut replicas = self.lock();
        if let Some(old) = replicas.remove(&slot) {
            self.drop_all(slot, old);
        }
    }

    /// Sets how many blocks `slot`'s engine keeps in host memory (`None`:
    /// none, or unknown), starting its view of them from empty.
    pub fn set_host(&self, slot: Slot, blocks: Option<usize>) {
        let mut replicas = self.lock();
        let Some(rep) = replicas.get_mut(&slot) else { return };
        if rep.host_blocks == blocks {
            return;
        }
        rep.host_blocks = blocks;
        rep.host = blocks.map(|b| HostOrder::mirrored(Some(b), &self.host));
        // The new tier starts empty: the requests not yet started will store
        // there, and what the others stored in the old one cannot be undone.
        match &mut rep.host {
            Some(host) => {
                for coming in rep.host_coming.values_mut() {
                    match &mut coming.stored {
                        None => host.expect(&coming.keys[coming.used.stores..]),
                        Some(sent) => *sent = Sent::default(),
                    }
                }
            }
            None => rep.host_coming.clear(),
        }
        if let Some(exact) = &mut rep.exact {
            exact.set_host(blocks);
        }
    }

    /// Gives an approximate replica room for `capacity` blocks (its engine
    /// reported its size), keeping what the shadow holds: past a smaller
    /// size the least recently freed blocks leave, as the engine would have
    /// evicted them. False, and nothing changes, for a replica in exact
    /// mode (its events say what it holds) or one not tracked.
    pub fn resize_replica(&self, slot: Slot, capacity: usize) -> bool {
        let mut replicas = self.lock();
        let Some(rep) = replicas.get_mut(&slot).filter(|r| r.exact.is_none()) else { return false };
        let mut evicted = Vec::new();
        rep.shadow.set_cap(capacity, &mut evicted);
        for h in evicted.into_iter().filter(|&h| !is_placeholder(h)) {
            self.holders.release(h, slot);
        }
        self.foresee(slot, rep);
        true
    }

    /// Empties a replica whose engine restarted, keeping its capacity and mode.
    pub fn clear_replica(&self, slot: Slot) {
        let mut replicas = self.lock();
        let Some(entry) = replicas.get_mut(&slot) else { return };
        let mut fresh = self.new_replica(entry.shadow.cap(), entry.host_blocks);
        fresh.exact = entry.exact.as_ref().map(|e| Exact::new(e.block_size(), entry.shadow.cap(), entry.host_blocks, &self.host));
        let old = std::mem::replace(entry, fresh);
        self.drop_all(slot, old);
    }

    /// Sets or clears `slot`'s bit for each changed block.
    fn present(&self, slot: Slot, changes: &[Change]) {
        if changes.is_empty() {
            return;
        }
        for &(h, present) in changes {
            if present {
                self.holders.add(h, slot);
            } else {
                self.holders.release(h, slot);
            }
        }
    }

    /// Records a request sent to `slot` as the engine will lay it out in its
    /// KV cache: `prompt` holds the hashes of the prompt's full blocks, of
    /// which the engine may reuse at most `reusable` leading ones (all, or all
    /// but the last when the prompt ends on a block boundary: it always
    /// computes the last prompt token); `partial` more blocks (the prompt's
    /// partial last block) take room but can never be matched, and `output`
    /// blocks of generated tokens are taken as the engine fills them: one
    /// every block time from its first token (`decoding`, `advance`), the
    /// rest when it completes (from its first token as estimated, when its
    /// output's `pace` is given and the replica's prefill time known, until
    /// it is heard); `ends_partial`:
    /// its last block (prompt and output) is not full, so the engine caches
    /// nothing in it and frees it to be reused first, as room. As in the
    /// engine, a request that fits beside the running ones holds its blocks
    /// until it completes: reused blocks cannot be evicted meanwhile, fresh
    /// blocks take the least recently freed ones, and a fresh block whose
    /// prefix is still cached caches nothing. One that does not fit, or
    /// comes behind one waiting, waits its turn in a queue, first come
    /// first, and starts when completions make room for it (at the latest
    /// when it completes).
    #[allow(clippy::too_many_arguments)]
    pub fn record(
        &self,
        slot: Slot,
        prompt: &[BlockHash],
        reusable: usize,
        partial: usize,
        output: usize,
        ends_partial: bool,
        pace: Option<Pace>,
    ) -> Recorded {
        let mut replicas = self.lock();
        let Some(rep) = replicas.get_mut(&slot) else { return Recorded { slot, ..Recorded::default() } };
        let request = self.ids.fetch_add(1, Ordering::Relaxed);
        // What a request asks for is input: no sequence outgrows the cache.
        let output = output.min(rep.shadow.cap());
        if let Some(exact) = &mut rep.exact {
            let mut changes = Vec::new();
            let fresh = prompt.len() - exact.held_prefix(prompt) + partial;
            let host = exact.claim(prompt, &mut changes);
            rep.requests.insert(request, Request::Claiming { keys: prompt.to_vec(), host, output, since: None, heard: false });
            self.present(slot, &changes);
            rep.prefills(request, fresh);
            rep.foretell(request, pace, 0);
            return Recorded { slot, replica: rep.id, request };
        }
        // Its full prompt blocks are stored in host memory when it starts
        // (past those it loads from there): when the shadow admits it, else
        // once its first token is heard, or it ends.
        if let Some(host) = &mut rep.host {
            let gpu = prompt.iter().take_while(|&&h| rep.shadow.contains(h)).count();
            let loads = host.run(&prompt[gpu..]);
            let used = HostUse::found(gpu, loads, 0);
            host.expect(&prompt[used.stores..]);
            rep.host_coming.insert(request, HostComing { keys: prompt.to_vec(), used, stored: None });
        }
        // Behind a queue it waits its turn; before one, it runs if it fits.
        let admitted = if rep.queue.is_empty() { self.admit(&mut rep.shadow, slot, prompt, reusable, partial, false) } else { None };
        match admitted {
            Some(admitted) => {
                rep.prefills(request, admitted.0.len() - admitted.1);
                rep.host_admitted(request, admitted.1);
                rep.requests.insert(request, self.started(rep, admitted, output, ends_partial, None));
                rep.foretell(request, pace, self.ids.fetch_add(1, Ordering::Relaxed));
            }
            None => {
                let waiting = Request::Waiting { prompt: prompt.to_vec(), reusable, partial, output, ends_partial, pace, resume: None };
                rep.requests.insert(request, waiting);
                rep.queue.push_back(request);
                self.foresee(slot, rep);
            }
        }
        Recorded { slot, replica: rep.id, request }
    }

    /// The request recorded asks for a LoRA adapter, named by `tag` (one
    /// tag per adapter): a request of an adapter that must wait for a slot
    /// there starts once the adapters running end (see
    /// [`KvIndex::kept_through_wait`]).
    pub fn adapter(&self, recorded: &Recorded, tag: u64) {
        let mut replicas = self.lock();
        let Some(rep) = replicas.get_mut(&recorded.slot).filter(|r| r.id == recorded.replica) else { return };
        if rep.adapters.len() > 2 * rep.requests.len() + 16 {
            let requests = &rep.requests;
            rep.adapters.retain(|id, _| requests.contains_key(id));
        }
        rep.adapters.insert(recorded.request, tag);
    }

    /// Starts waiting requests, first come first, while the first fits,
    /// and foresees what the rest will do.
    fn admit_waiting(&self, slot: Slot, rep: &mut Replica) {
        while let Some(&head) = rep.queue.front() {
            let Some(&Request::Waiting { ref prompt, reusable, partial, output, ends_partial, pace, resume }) = rep.requests.get(&head)
            else {
                rep.queue.pop_front();
                continue;
            };
            let Some(admitted) = self.admit(&mut rep.shadow, slot, prompt, reusable, partial, false) else { break };
            if resume.is_none() {
                rep.prefills(head, admitted.0.len() - admitted.1);
                rep.host_admitted(head, admitted.1);
            }
            let running = self.started(rep, admitted, output, ends_partial, resume);
            if matches!(running, Request::Running { since: Some(_), owed: 1.., .. }) {
                rep.growing.insert(head);
            }
            rep.requests.insert(head, running);
            rep.queue.pop_front();
            if resume.is_none() {
                rep.foretell(head, pace, self.ids.fetch_add(1, Ordering::Relaxed));
            }
        }
        self.foresee(slot, rep);
    }

    /// A request admitted with `admitted` (its blocks, and how many it
    /// reused), owing `output` blocks. A preempted one goes on decoding
    /// where it stopped: its output's blocks are the ones after its
    /// prompt's, and its pace goes on from the replica's clock.
    fn started(
        &self,
        rep: &Replica,
        (mut keys, reused): (Vec<BlockHash>, usize),
        output: usize,
        ends_partial: bool,
        resume: Option<Resume>,
    ) -> Request {
        let Some(Resume { prompt_blocks, decoded, pace, heard }) = resume else {
            return Request::Running {
                keys,
                reused,
                generated: Vec::new(),
                owed: output,
                since: None,
                heard: false,
                ends_partial,
                order: 0,
            };
        };
        let generated = keys.split_off(prompt_blocks.min(keys.len()));
        let since = Some((rep.clock.saturating_sub(decoded), pace));
        let order = self.ids.fetch_add(1, Ordering::Relaxed);
        Request::Running { keys, reused: reused.min(prompt_blocks), generated, owed: output, since, heard, ends_partial, order }
    }

    /// Running request `id` fills its next output block, due at `at`: it
    /// takes one while some block is free; when none is, the engine
    /// preempts the newest request still decoding (its paced end, at
    /// `per_block` seconds a block, not passed) and tries again (rule 6 of
    /// `docs/engine-rules.md`), and a request decoding alone goes on short
    /// of blocks and takes no more.
    fn fill(&self, slot: Slot, rep: &mut Replica, id: u64, at: Duration, per_block: f64) {
        while matches!(rep.requests.get(&id), Some(Request::Running { .. })) {
            if let Some(h) = self.take_fresh(&mut rep.shadow, slot, 1, &[]).pop() {
                if let Some(Request::Running { generated, owed, .. }) = rep.requests.get_mut(&id) {
                    generated.push(h);
                    *owed -= 1;
                }
                return;
            }
            let mut decoding = rep.requests.iter().filter_map(|(&r, req)| match req {
                Request::Running { since: Some(since), order, .. } if r == id || ahead::ends(Some(*since), per_block) > at => {
                    Some((*order, r))
                }
                _ => None,
            });
            let newest = decoding.clone().max().map(|(_, r)| r);
            let Some(victim) = newest.filter(|&r| r != id || decoding.nth(1).is_some()) else {
                if let Some(Request::Running { owed, .. }) = rep.requests.get_mut(&id) {
                    *owed = 0;
                }
                return;
            };
            rep.preempt(victim, at);
            if victim == id {
                return;
            }
        }
    }

    /// Presents an approximate replica's cache as a request sent now will
    /// find it: the blocks the waiting requests will evict absent from the
    /// holder map, those they will store present.
    fn foresee(&self, slot: Slot, rep: &mut Replica) {
        if rep.queue.is_empty() && rep.ahead.is_empty() {
            return;
        }
        let ahead = Ahead::foresee(&rep.shadow, &rep.requests, &rep.queue, rep.per_block());
        let old = std::mem::replace(&mut rep.ahead, ahead);
        // Read first: a write locks out the lookups reading that shard, and most bits are already right.
        let (word, bit) = (slot as usize / 64, 1u64 << (slot % 64));
        for h in old.changed().chain(rep.ahead.changed()).filter(|&h| !is_placeholder(h)) {
            match (rep.ahead.holds(&rep.shadow, h), self.holders.word(h, word) & bit != 0) {
                (true, false) => {
                    self.holders.add(h, slot);
                }
                (false, true) => self.holders.release(h, slot),
                _ => {}
            }
        }
    }

    /// Takes blocks for a request's prompt; `None` when they do not fit
    /// beside the running requests' (unless `anyway`: then the prompt keeps
    /// its leading blocks). Returns the blocks and how many were reused.
    fn admit(
        &self,
        shadow: &mut Shadow,
        slot: Slot,
        prompt: &[BlockHash],
        reusable: usize,
        partial: usize,
        anyway: bool,
    ) -> Option<(Vec<BlockHash>, usize)> {
        let reusable = reusable.min(prompt.len());
        // The leading blocks held, and of those, how many no running request holds.
        let mut free_reused = 0;
        let reused = prompt[..reusable].iter().map_while(|&h| shadow.in_use(h)).inspect(|&used| free_reused += usize::from(!used)).count();
        let need = prompt.len() - reused + partial;
        // Taking its reused blocks out of the free queue leaves less room; the engine checks before it touches anything.
        if need + free_reused > shadow.available() && !anyway {
            return None;
        }
        for &h in &prompt[..reused] {
            shadow.hold(h);
        }
        let fresh = self.take_fresh(shadow, slot, need, &prompt[reused..]);
        let mut keys: Vec<BlockHash> = prompt[..reused].to_vec();
        keys.extend(fresh);
        Some((keys, reused))
    }

    /// Takes up to `n` fresh blocks on `slot` while some block is not in
    /// use, and returns them. Room for all of them is made first: what they
    /// evict is chosen (and leaves the holder map) before any of them is
    /// named. Each takes the next of `names` (the prompt's blocks), unless
    /// the shadow holds that one already (its prefix was evicted: the block
    /// caches nothing) or `names` has run out; a placeholder names it then.
    fn take_fresh(&self, shadow: &mut Shadow, slot: Slot, n: usize, names: &[BlockHash]) -> Vec<BlockHash> {
        let mut evicted = Vec::new();
        let room = shadow.make_room(n, &mut evicted);
        for h in evicted.into_iter().filter(|&h| !is_placeholder(h)) {
            self.holders.release(h, slot);
        }
        let mut fresh = Vec::with_capacity(room);
        for i in 0..room {
            let key = match names.get(i) {
                Some(&h) if !shadow.contains(h) => {
                    if !is_placeholder(h) {
                        self.holders.add(h, slot);
                    }
                    h
                }
                _ => self.placeholder(),
            };
            // Cannot fail: `make_room` left room for it.
            let _ = shadow.push(key);
            fresh.push(key);
        }
        fresh
    }

    /// A key for a block no prompt can match.
    fn placeholder(&self) -> BlockHash {
        PLACEHOLDER | BlockHash::from(self.placeholders.fetch_add(1, Ordering::Relaxed))
    }

    /// The request completed at `at`: the blocks its output had still to
    /// fill are taken, then all its blocks are freed as the engine frees
    /// them, last block first, so a long prefix is later evicted from its
    /// tail. Only the first call for a record changes what it holds.
    pub fn complete(&self, recorded: &Recorded, at: Duration) {
        let mut replicas = self.lock();
        let Some(rep) = replicas.get_mut(&recorded.slot).filter(|r| r.id == recorded.replica) else { return };
        rep.host_heard(recorded.request, true, true);
        // The engine took the blocks the others' outputs filled before this
        // one ended (this one, done, is no victim), then freed its own.
        let request = rep.requests.remove(&recorded.request);
        rep.growing.remove(&recorded.request);
        let prefill = rep.prefilling.iter().position(|p| p.0 == recorded.request).and_then(|i| rep.prefilling.remove(i));
        self.grow(recorded.slot, rep, at);
        let (keys, generated, ends_partial) = match request {
            Some(Request::Running { keys, mut generated, owed, since, heard, ends_partial, .. }) => {
                rep.learn_end(recorded.request, since, heard, prefill, at);
                generated.extend(self.take_fresh(&mut rep.shadow, recorded.slot, owed, &[]));
                (keys, generated, ends_partial)
            }
            // It ran, though the index did not see room for it: it took what it could.
            Some(Request::Waiting { prompt, reusable, partial, output, ends_partial, .. }) => {
                rep.queue.retain(|&r| r != recorded.request);
                let keys = self.admit(&mut rep.shadow, recorded.slot, &prompt, reusable, partial, true).map(|(k, _)| k).unwrap_or_default();
                (keys, self.take_fresh(&mut rep.shadow, recorded.slot, output, &[]), ends_partial)
            }
            Some(Request::Claiming { keys, host, since, heard, .. }) => {
                rep.learn_end(recorded.request, since, heard, prefill, at);
                return self.unclaim(recorded.slot, rep, &keys, host);
            }
            None => return,
        };
        // Generated tokens' blocks, the request's last, are freed first; a
        // last block that is not full (a placeholder: no prompt names it)
        // caches nothing and becomes room.
        let shadow = &mut rep.shadow;
        for (i, &h) in generated.iter().rev().chain(keys.iter().rev()).enumerate() {
            if i == 0 && ends_partial && is_placeholder(h) {
                shadow.withdraw(h);
            } else {
                shadow.release(h);
            }
        }
        if let Some((reply, full)) = rep.coming.remove(&recorded.request) {
            // Kept when the prompt's blocks all went in under their names.
            if keys.len() >= full && !is_placeholder(keys[full - 1]) && keys.len() + generated.len() > full {
                let blocks = keys[full..].iter().chain(&generated).copied().collect();
                keep_reply(rep, keys[full - 1], Replied { reply, blocks });
            }
        }
        self.admit_waiting(recorded.slot, rep);
    }

    /// The request's first token came at `at`: from then on its output
    /// fills blocks at `pace` (taken by `advance`), or all at once now
    /// while the replica's block time is unknown (or nil). A request the
    /// index still had waiting has started (the engine found room the
    /// index did not see): it takes its blocks now. One heard after its
    /// request completed (the shipped layout's access log tells first
    /// tokens after the end; until then the index estimates them) teaches
    /// the replica its prefill and block times, and changes nothing else.
    pub fn decoding(&self, recorded: &Recorded, at: Duration, pace: Pace) {
        let mut replicas = self.lock();
        let Some(rep) = replicas.get_mut(&recorded.slot).filter(|r| r.id == recorded.replica) else { return };
        // Heard after its end (from the access log): it teaches the times now.
        if let Some(i) = rep.ended.iter().rposition(|e| e.0 == recorded.request) {
            let Some((_, Ended { prefill, end })) = rep.ended.remove(i) else { return };
            if let Some(prefill) = prefill {
                rep.learn_prefill(prefill, at);
            }
            rep.block_time = pace.learn(rep.block_time, end.saturating_sub(at));
            return;
        }
        rep.clock = rep.clock.max(at);
        rep.host_heard(recorded.request, true, false);
        if matches!(rep.requests.get(&recorded.request), Some(Request::Waiting { .. }))
            && let Some(Request::Waiting { prompt, reusable, partial, output, ends_partial, resume, .. }) =
                rep.requests.remove(&recorded.request)
        {
            rep.queue.retain(|&r| r != recorded.request);
            let admitted = self.admit(&mut rep.shadow, recorded.slot, &prompt, reusable, partial, true).unwrap_or_default();
            let running = self.started(rep, admitted, output, ends_partial, resume);
            rep.requests.insert(recorded.request, running);
        }
        // Its prefill is over: one admitted alone tells the replica's time a block.
        if let Some(i) = rep.prefilling.iter().position(|p| p.0 == recorded.request)
            && let Some((_, admitted, fresh, alone)) = rep.prefilling.remove(i)
        {
            rep.learn_prefill((admitted, fresh, alone), at);
        }
        let untimed = rep.per_block().is_none();
        rep.on_time |= matches!(rep.requests.get(&recorded.request), Some(Request::Running { .. } | Request::Claiming { .. }));
        if let Some(Request::Claiming { keys, host, since, heard, .. }) = rep.requests.get_mut(&recorded.request) {
            *since = Some((at, pace));
            *heard = true;
            if let Some(exact) = &mut rep.exact {
                exact.host_started(keys, host);
            }
            return;
        }
        let Some(Request::Running { generated, owed, since, heard, order, .. }) = rep.requests.get_mut(&recorded.request) else { return };
        if !*heard {
            if since.is_none() {
                *order = self.ids.fetch_add(1, Ordering::Relaxed);
                if untimed {
                    generated.extend(self.take_fresh(&mut rep.shadow, recorded.slot, std::mem::take(owed), &[]));
                }
            }
            *since = Some((at, pace));
            *heard = true;
        }
        // A preempted request readmitted here goes on where it stopped.
        if *owed > 0 {
            rep.growing.insert(recorded.request);
        }
        self.foresee(recorded.slot, rep);
    }

    /// Brings `slots` to `now`: each running request takes the blocks its
    /// output has filled since its first token, at its pace and the
    /// replica's block time, in the order they fell due (preempting as
    /// the engine does). Lookups made at `now` see the caches as they are
    /// then.
    pub fn advance(&self, slots: &[Slot], now: Duration) {
        let mut replicas = self.lock();
        for &slot in slots {
            if let Some(rep) = replicas.get_mut(&slot) {
                self.grow(slot, rep, now);
            }
        }
    }

    /// Brings one replica to `now` (see `advance`): the output blocks due
    /// are taken in the order they fall due, each at its time, so that a
    /// preemption happens when the engine's would.
    fn grow(&self, slot: Slot, rep: &mut Replica, now: Duration) {
        let Some(per_block) = rep.per_block() else {
            rep.clock = rep.clock.max(now);
            return;
        };
        // Every block due by now, each as (when, request, which of its
        // output blocks), in one pass: a fill changes no other request's
        // times, and one it preempts stops running (its later blocks are
        // then skipped). One pass keeps a decision's cost linear in the
        // requests running, however many blocks fell due since the last.
        let mut due = Vec::new();
        for &id in &rep.growing {
            let Some(Request::Running { generated, owed, since: Some((since, pace)), .. }) = rep.requests.get(&id) else { continue };
            for k in generated.len()..generated.len() + owed {
                let at = since.saturating_add(pace.due(k, per_block));
                if at > now {
                    break;
                }
                due.push((at, id, k));
            }
        }
        due.sort_unstable();
        let changed = !due.is_empty();
        for (at, id, k) in due {
            if !matches!(rep.requests.get(&id), Some(Request::Running { generated, owed: 1.., .. }) if generated.len() == k) {
                continue;
            }
            rep.clock = rep.clock.max(at);
            self.fill(slot, rep, id, at, per_block);
        }
        let requests = &rep.requests;
        rep.growing.retain(|id| matches!(requests.get(id), Some(Request::Running { owed: 1.., .. })));
        rep.clock = rep.clock.max(now);
        if changed {
            self.foresee(slot, rep);
        }
    }

    /// A recorded request on an approximate replica keeps, when it
    /// completes, the blocks its reply fills after its prompt's `full` full
    /// blocks, for the next turn to name (`adopt`).
    pub fn expect_reply(&self, recorded: &Recorded, reply: Reply, full: usize) {
        let mut replicas = self.lock();
        let Some(rep) = replicas.get_mut(&recorded.slot).filter(|r| r.id == recorded.replica && r.exact.is_none()) else { return };
        if full > 0 && rep.requests.contains_key(&recorded.request) {
            rep.coming.insert(recorded.request, (reply, full));
        }
    }

    /// The reply a completed request left after a prompt whose last full
    /// block is `last` on `slot`, and how many of its leading blocks the
    /// replica still holds.
    pub fn reply(&self, slot: Slot, last: BlockHash) -> Option<(Reply, usize)> {
        let replicas = self.lock();
        let rep = replicas.get(&slot).filter(|r| r.exact.is_none())?;
        let replied = rep.replies.get(&last)?;
        let held = replied.blocks.iter().take_while(|&&h| rep.ahead.holds(&rep.shadow, h)).count();
        Some((replied.reply.clone(), held))
    }

    /// A prompt resends the reply kept after `last` on `slot`: its blocks
    /// take the prompt's names for them, `names`, as far as the replica
    /// still holds them, and are looked up like any other from now on.
    /// Returns how many were named.
    pub fn adopt(&self, slot: Slot, last: BlockHash, names: &[BlockHash]) -> usize {
        let mut replicas = self.lock();
        let Some(rep) = replicas.get_mut(&slot).filter(|r| r.exact.is_none()) else { return 0 };
        let Some(replied) = rep.replies.remove(&last) else { return 0 };
        let mut named = 0;
        for (&block, &name) in replied.blocks.iter().zip(names) {
            if !rep.shadow.rename(block, name) {
                break;
            }
            self.holders.add(name, slot);
            named += 1;
        }
        named
    }

    /// Takes back what an attempt recorded (the engine refused or failed it):
    /// the blocks it added are forgotten (but for those another request
    /// reused, which that one fills) and the ones it reused freed. After
    /// `complete` nothing changes: other requests may have reused or remade
    /// its blocks since, and forgetting them could strand what follows them.
    pub fn take_back(&self, recorded: &Recorded) {
        let mut replicas = self.lock();
        let Some(rep) = replicas.get_mut(&recorded.slot).filter(|r| r.id == recorded.replica) else { return };
        rep.host_heard(recorded.request, false, true);
        rep.coming.remove(&recorded.request);
        rep.growing.remove(&recorded.request);
        rep.prefilling.retain(|p| p.0 != recorded.request);
        let shadow = &mut rep.shadow;
        // Last block first, as every release goes, so a prefix stays newer than what follows it.
        match rep.requests.remove(&recorded.request) {
            Some(Request::Running { keys, reused, generated, .. }) => {
                for &h in generated.iter().rev().chain(keys[reused..].iter().rev()) {
                    if shadow.withdraw(h) && !is_placeholder(h) {
                        self.holders.release(h, recorded.slot);
                    }
                }
                for &h in keys[..reused].iter().rev() {
                    shadow.release(h);
                }
            }
            Some(Request::Waiting { .. }) => rep.queue.retain(|&r| r != recorded.request),
            Some(Request::Claiming { keys, host, .. }) => return self.unclaim(recorded.slot, rep, &keys, host),
            None => return,
        }
        self.admit_waiting(recorded.slot, rep);
    }

    /// The request is over, whatever its status: a request sent to an exact
    /// replica ends its claims now (the engine's events say what it left
    /// behind, held or not). With several routers the status may never reach
    /// the router that decided (Envoy sends the response to any of them), so
    /// a claim must not wait for it. Returns whether the record was a claim;
    /// any other record is left for `complete` or `take_back`.
    pub fn end_claim(&self, recorded: &Recorded) -> bool {
        let mut replicas = self.lock();
        let Some(rep) = replicas.get_mut(&recorded.slot).filter(|r| r.id == recorded.replica) else { return false };
        if !matches!(rep.requests.get(&recorded.request), Some(Request::Claiming { .. })) {
            return false;
        }
        let Some(Request::Claiming { keys, host, .. }) = rep.requests.remove(&recorded.request) else { return false };
        rep.prefilling.retain(|p| p.0 != recorded.request);
        self.unclaim(recorded.slot, rep, &keys, host);
        true
    }

    /// A request sent to an exact replica ends its claims.
    fn unclaim(&self, slot: Slot, rep: &mut Replica, keys: &[BlockHash], host: HostUse) {
        let Some(exact) = &mut rep.exact else { return };
        let mut changes = Vec::new();
        exact.unclaim(keys, host, &mut changes);
        self.present(slot, &changes);
    }

    /// Blocks the index holds, over every replica (an exact replica's in every tier).
    pub fn entries(&self) -> usize {
        self.lock().values().map(Replica::entries).sum()
    }

    /// Blocks the index holds for the replica in `slot`.
    pub fn entries_of(&self, slot: Slot) -> usize {
        self.lock().get(&slot).map_or(0, Replica::entries)
    }

    /// Bytes the index has allocated: the shadows' exactly, the holder
    /// map's tables estimated from their capacity.
    pub fn bytes(&self) -> usize {
        let replicas = self.lock();
        let shadows: usize = replicas.values().map(|r| r.shadow.bytes() + r.exact.as_ref().map_or(0, Exact::bytes)).sum();
        shadows + self.holders.bytes()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Slot, Replica>> {
        self.replicas.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Releases every block of a replica's old shadow or exact view; called under the lock.
    fn drop_all(&self, slot: Slot, old: Replica) {
        for h in old.shadow.blocks().chain(old.ahead.stored()).filter(|&h| !is_placeholder(h)) {
            self.holders.release(h, slot);
        }
        for h in old.exact.iter().flat_map(Exact::present) {
            self.holders.release(h, slot);
        }
    }
}

/// Keeps a completed request's reply; past `prune_at` replies, those whose
/// blocks the shadow no longer holds go first.
fn keep_reply(rep: &mut Replica, last: BlockHash, replied: Replied) {
    if rep.replies.len() >= rep.prune_at {
        let shadow = &rep.shadow;
        rep.replies.retain(|_, r| r.blocks.first().is_some_and(|&h| shadow.contains(h)));
        rep.prune_at = (rep.replies.len() * 2).max(REPLIES_KEPT);
    }
    rep.replies.insert(last, replied);
}

/// The blocks the holder map takes room for up front: every replica full,
/// up to `UP_FRONT`.
fn room_up_front(replicas: &HashMap<Slot, Replica>) -> usize {
    replicas.values().map(|r| r.shadow.cap()).fold(0, usize::saturating_add).min(UP_FRONT)
}

/// Cached tokens to predict from matched blocks: whole blocks, never the
/// last token of the prompt (an engine always computes it).
pub fn predicted_cached_tokens(matched_blocks: usize, prompt_tokens: usize, block_size: usize) -> usize {
    (matched_blocks * block_size).min(prompt_tokens.saturating_sub(1) / block_size.max(1) * block_size)
}

#[cfg(test)]
mod tests;
