//! The engine: continuous batching over the KV block pool on a virtual timeline.
//!
//! One task owns all engine state and runs steps. Each step first gives every
//! running sequence a block for its next token (preempting the newest running
//! sequence when none is left, as vLLM recomputes), then admits waiting
//! sequences in arrival order while there is a sequence slot, prefill budget
//! and free blocks for their uncached part. The step lasts the latency model's
//! prefill time of what it admitted plus one decode step for the rest; at its
//! end every admitted sequence has its first token and every other one its
//! next. A step's deadline is the previous step's deadline plus its length,
//! never "now" plus its length, so timer overshoot never accumulates, and
//! every latency metric is stamped with these planned times.
//!
//! With KV events on, the step tells [`StepEvents`] which sequences it
//! scheduled, which cached blocks their allocations evicted and which blocks
//! they filled, and publishes the step's batch at its end.
//!
//! For disaggregated serving (`crate::nixl`) a prefill leg's blocks are kept
//! in use after it finishes, under its id, until a decoder has read them
//! (`pin`, then `release`) or the lease ends. A decode leg is admitted with
//! blocks for its whole prompt but computes nothing: it waits outside the
//! batch while its handler reads the blocks it lacks (`Event::Read`), and
//! joins the running sequences when told they arrived (`Submitted::loaded`),
//! its full prompt blocks cached then.
//!
//! With a host tier (`crate::offload`) every step offers the prompt blocks
//! of the sequences it scheduled for storing, and a new sequence whose
//! prompt continues past its GPU hit in that tier waits outside the batch
//! while those blocks load (`Load`), then is scheduled with them cached.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use inferrail_kv::hash::{BlockHash, extend_block_hashes};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use inferrail_kv_events::publish::Publisher;

use crate::cache::{BlockId, BlockPool};
use crate::cost::{LatencyModel, secs};
use crate::events::{StepEvents, Stored, process_key};
use crate::lora::{Adapter, Weights};
use crate::metrics::{EngineInfo, FinishReason, LoraInfo, Stats};
use crate::nixl::FailurePolicy;
use crate::offload::{CpuTier, Found, OffloadConfig};

/// How the engine is sized and timed.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks.
    pub num_blocks: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Prompt tokens prefilled per step (one longer prompt may run alone).
    pub max_num_batched_tokens: usize,
    /// Step timing.
    pub latency: LatencyModel,
    /// Seed for generated tokens.
    pub seed: u64,
    /// Ids generated tokens are drawn from (never empty).
    pub generation_ids: Vec<u32>,
    /// Labels for the metrics page.
    pub info: EngineInfo,
    /// Where KV events go; `None` keeps them off at no cost.
    pub kv_events: Option<Arc<Publisher>>,
    /// How long a prefill leg's blocks are kept for a decoder (`kv_lease_duration`).
    pub lease: Duration,
    /// What a decode leg does when its read fails.
    pub failure: FailurePolicy,
    /// Adapter weights and slots, when adapters are on (`crate::lora`).
    pub lora: Option<Weights>,
    /// The host tier, when offloading is on.
    pub offload: Option<OffloadConfig>,
}

/// A request's part in a disaggregated pair, if any.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Transfer {
    /// An ordinary request.
    #[default]
    None,
    /// A prefill leg: keep its blocks under this id when it finishes.
    Keep(String),
    /// A decode leg: read the prompt blocks it lacks before decoding.
    Read,
}

/// A request as the engine sees it: tokens in, a token budget out.
#[derive(Debug, Clone)]
pub struct Request {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate.
    pub max_tokens: usize,
    /// Reported when `max_tokens` is reached: `Length` when the client set
    /// it, `Stop` when it is the simulator's stand-in for an end of sequence.
    pub at_limit: FinishReason,
    /// Start of the block hash chain (`cache_salt`).
    pub salt: BlockHash,
    /// `cache_salt` as sent, for KV events.
    pub cache_salt: Option<String>,
    /// Its part in a disaggregated pair.
    pub transfer: Transfer,
    /// The adapter it names, if any.
    pub lora: Option<Adapter>,
    /// Its `x-request-id`, for the log.
    pub request_id: String,
}

/// What a request hears from the engine, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// First scheduled; this many prompt tokens were found cached.
    Scheduled {
        /// Cached prompt tokens.
        cached_tokens: usize,
    },
    /// A decode leg was given blocks: read this many from the prefill
    /// (the tail of its list), then call [`Submitted::loaded`].
    Read {
        /// Blocks to read.
        blocks: usize,
    },
    /// A prefill leg's blocks are kept for a decoder: the prompt's, in order.
    /// Comes just before the last token.
    Kept {
        /// Block ids.
        block_ids: Vec<u32>,
    },
    /// A decode leg's read failed and the policy is to fail: the request is over.
    Failed,
    /// One generated token; the last one says why generation finished.
    Token {
        /// The token id.
        id: u32,
        /// Set on the last token.
        finish: Option<FinishReason>,
    },
}

enum Command {
    Submit { id: u64, request: Request, events: mpsc::UnboundedSender<Event>, arrival: Instant },
    Abort(u64),
    Reset(oneshot::Sender<Option<usize>>),
    Loaded { id: u64, ok: bool },
    Pin { key: String, blocks: Vec<u32>, reply: oneshot::Sender<Result<(), Unread>> },
    Release(String),
    Expire(String),
    PreloadLora(u64),
}

/// Why kept blocks cannot be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unread {
    /// No blocks are kept under that id: never, already read, or expired.
    Unknown,
    /// Blocks were named that the request does not keep.
    NotKept,
}

/// A handle on the running engine; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    tx: mpsc::UnboundedSender<Command>,
    stats: Arc<Mutex<Stats>>,
    info: Arc<EngineInfo>,
    next_id: Arc<AtomicU64>,
    kv_events: Option<Arc<Publisher>>,
}

/// A submitted request. Dropping it before it finished aborts it, which is
/// how a client that goes away frees its slot and blocks.
pub struct Submitted {
    id: u64,
    events: mpsc::UnboundedReceiver<Event>,
    tx: mpsc::UnboundedSender<Command>,
    done: bool,
}

impl Submitted {
    /// The next event; `None` only if the engine stopped.
    pub async fn next(&mut self) -> Option<Event> {
        let event = self.events.recv().await;
        if matches!(event, Some(Event::Token { finish: Some(_), .. } | Event::Failed) | None) {
            self.done = true;
        }
        event
    }

    /// A decode leg's blocks arrived (`ok`) or could not be read.
    pub fn loaded(&self, ok: bool) {
        // The engine only stops with the process.
        let _ = self.tx.send(Command::Loaded { id: self.id, ok });
    }
}

impl Drop for Submitted {
    fn drop(&mut self) {
        if !self.done {
            // The engine only stops with the process; nothing to do if it has.
            let _ = self.tx.send(Command::Abort(self.id));
        }
    }
}

impl Engine {
    /// Starts the engine task on the current tokio runtime.
    pub fn start(cfg: EngineConfig) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut cfg = cfg;
        let mut stats = Stats::new(cfg.info.max_model_len);
        stats.lora = cfg.lora.as_ref().map(|w| LoraInfo::new(w.max_loras as u64));
        stats.offload = cfg.offload.as_ref().map(|_| Default::default());
        let stats = Arc::new(Mutex::new(stats));
        let weights = cfg.lora.take();
        let info = Arc::new(cfg.info.clone());
        let kv_events = cfg.kv_events.clone();
        let mut pool = BlockPool::new(cfg.num_blocks);
        let events = cfg.kv_events.clone().map(|publisher| {
            pool.log_evictions();
            StepEvents::new(publisher, process_key(), cfg.block_size)
        });
        let core = Core {
            pool,
            evictions: HashMap::new(),
            cpu: cfg.offload.clone().map(|c| CpuTier::new(c, Instant::now())),
            step: 0,
            events,
            kept: HashMap::new(),
            me: tx.downgrade(),
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            deferred: HashSet::new(),
            weights,
            stats: stats.clone(),
            cfg,
        };
        tokio::spawn(core.run(rx));
        Self { tx, stats, info, next_id: Arc::new(AtomicU64::new(0)), kv_events }
    }

    /// Queues a request.
    pub fn submit(&self, request: Request) -> Submitted {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events_tx, events) = mpsc::unbounded_channel();
        let done = self.tx.send(Command::Submit { id, request, events: events_tx, arrival: Instant::now() }).is_err();
        Submitted { id, events, tx: self.tx.clone(), done }
    }

    /// Forgets every cached prefix; returns how many blocks it forgot, or
    /// `None` when blocks are in use and nothing was forgotten (as in vLLM).
    pub async fn reset_prefix_cache(&self) -> Option<usize> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Command::Reset(reply)).ok()?;
        rx.await.ok().flatten()
    }

    /// Marks blocks kept under `key` as being read; they stay until
    /// [`Engine::release`], whatever the lease.
    pub async fn pin(&self, key: &str, blocks: Vec<u32>) -> Result<(), Unread> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Command::Pin { key: key.to_owned(), blocks, reply }).map_err(|_| Unread::Unknown)?;
        rx.await.unwrap_or(Err(Unread::Unknown))
    }

    /// Frees the blocks kept under `key` (they stay cached).
    pub fn release(&self, key: &str) {
        let _ = self.tx.send(Command::Release(key.to_owned()));
    }

    /// Puts adapter `id` in host memory and a slot, outside any step (a
    /// load through the API, or at start).
    pub fn preload_lora(&self, id: u64) {
        let _ = self.tx.send(Command::PreloadLora(id));
    }

    /// Changes the statistics, for what the API layer measures.
    pub fn record(&self, f: impl FnOnce(&mut Stats)) {
        f(&mut lock(&self.stats));
    }

    /// The KV event publisher, when events are on.
    pub fn kv_events(&self) -> Option<&Publisher> {
        self.kv_events.as_deref()
    }

    /// The `/metrics` page.
    pub fn metrics_page(&self) -> String {
        lock(&self.stats).render(&self.info)
    }

    /// Sequences running and waiting.
    pub fn load(&self) -> (usize, usize) {
        let s = lock(&self.stats);
        (s.running, s.waiting)
    }
}

fn lock(stats: &Mutex<Stats>) -> MutexGuard<'_, Stats> {
    stats.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

struct Seq {
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    at_limit: FinishReason,
    salt: BlockHash,
    cache_salt: Option<String>,
    transfer: Transfer,
    lora: Option<Adapter>,
    request_id: String,
    hashes: Vec<BlockHash>,
    blocks: Vec<BlockId>,
    registered: usize,
    rng: StdRng,
    events: mpsc::UnboundedSender<Event>,
    /// A load from the host tier under way.
    load: Option<Load>,
    /// Prompt blocks offered to the host tier so far.
    offered: usize,
    /// The first block it stored, loaded or found in the host tier.
    host_from: usize,
    arrival: Instant,
    /// Debug only: the tokens it would have found on the GPU and in host memory when it arrived.
    at_arrival: Option<(usize, usize)>,
    scheduled: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    preemptions: u32,
}

impl Seq {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// The blocks it stored, loaded or found in the host tier.
    fn host_keys(&self) -> &[BlockHash] {
        &self.hashes[self.host_from.min(self.offered)..self.offered]
    }
}

/// Prompt blocks being loaded from the host tier into a sequence's blocks.
#[derive(Debug, Clone, Copy)]
struct Load {
    /// Its first block (the GPU hit's length).
    from: usize,
    /// Blocks loaded.
    blocks: usize,
    /// When the copy ends.
    done: Instant,
    /// A step saw it end: the sequence may be scheduled.
    ready: bool,
}

impl Load {
    fn range(&self) -> std::ops::Range<usize> {
        self.from..self.from + self.blocks
    }
}

#[derive(Default)]
struct Plan {
    prefill: Vec<u64>,
    decode: Vec<u64>,
    /// (uncached, cached) tokens of each prefill.
    work: Vec<(usize, usize)>,
    secs: f64,
    tokens: usize,
}

/// A finished prefill leg's blocks, kept for a decoder.
struct Kept {
    blocks: Vec<BlockId>,
    /// Being read: the lease no longer ends it.
    pinned: bool,
}

struct Core {
    cfg: EngineConfig,
    kept: HashMap<String, Kept>,
    /// To end leases; weak, so the engine still stops when its handles go.
    me: mpsc::WeakUnboundedSender<Command>,
    pool: BlockPool,
    /// With KV events and debug logging on: the blocks evicted lately, each
    /// with the step and what took it, for the `scheduled` line.
    evictions: HashMap<BlockHash, (u64, &'static str)>,
    /// The host tier, when offloading is on.
    cpu: Option<CpuTier>,
    /// Steps scheduled so far (copies offered in one are seen done in a later one).
    step: u64,
    events: Option<StepEvents>,
    seqs: HashMap<u64, Seq>,
    waiting: VecDeque<u64>,
    running: Vec<u64>,
    /// Waiting sequences a step passed over for want of an adapter slot,
    /// until they are admitted.
    deferred: HashSet<u64>,
    /// Adapter weights and slots (`cfg.lora`, taken).
    weights: Option<Weights>,
    stats: Arc<Mutex<Stats>>,
}

impl Core {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Command>) {
        let mut clock = Instant::now();
        loop {
            let plan = if self.seqs.is_empty() {
                Plan::default()
            } else {
                while let Ok(cmd) = rx.try_recv() {
                    self.apply(cmd);
                }
                self.schedule(clock)
            };
            if plan.prefill.is_empty() && plan.decode.is_empty() {
                // Nothing to compute. Every sequence waits: for blocks that
                // nothing will free (until an abort or a new request), for
                // its KV to be read, or for a copy from the host tier; the
                // engine steps on, empty, while a copy is under way.
                let cmd = match self.copy_due() {
                    None => rx.recv().await,
                    Some(due) => tokio::select! {
                        biased;
                        cmd = rx.recv() => cmd,
                        () = tokio::time::sleep_until(due) => {
                            clock = clock.max(due);
                            self.step += 1;
                            self.copies_done(clock);
                            if let Some(events) = &mut self.events {
                                events.publish();
                            }
                            continue;
                        }
                    },
                };
                let Some(cmd) = cmd else { return };
                clock = clock.max(Instant::now());
                self.apply(cmd);
                continue;
            }
            if self.cfg.latency.zero {
                tokio::task::yield_now().await;
                clock = Instant::now();
            } else {
                let end = clock + secs(plan.secs);
                let sleep = tokio::time::sleep_until(end);
                tokio::pin!(sleep);
                loop {
                    tokio::select! {
                        biased;
                        () = &mut sleep => break,
                        cmd = rx.recv() => match cmd {
                            Some(cmd) => self.apply(cmd),
                            None => return,
                        },
                    }
                }
                clock = end;
            }
            self.complete(plan, clock);
        }
    }

    fn apply(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { id, request, events, arrival } => {
                let seed =
                    self.cfg.seed ^ xxhash_rust::xxh3::xxh3_64(&request.prompt.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>());
                self.seqs.insert(
                    id,
                    Seq {
                        prompt_len: request.prompt.len(),
                        tokens: request.prompt,
                        max_tokens: request.max_tokens,
                        at_limit: request.at_limit,
                        salt: request.salt,
                        cache_salt: request.cache_salt,
                        transfer: request.transfer,
                        lora: request.lora,
                        request_id: request.request_id,
                        hashes: Vec::new(),
                        blocks: Vec::new(),
                        registered: 0,
                        rng: StdRng::seed_from_u64(seed),
                        events,
                        load: None,
                        offered: 0,
                        host_from: 0,
                        arrival,
                        scheduled: None,
                        first_token: None,
                        last_token: None,
                        preemptions: 0,
                        at_arrival: None,
                    },
                );
                // What it would find now, to set beside what it finds when scheduled.
                if tracing::enabled!(tracing::Level::DEBUG)
                    && let Some(seq) = self.seqs.get_mut(&id)
                {
                    let bs = self.cfg.block_size;
                    let gpu = gpu_hit(&self.pool, seq, bs).len();
                    let host = match self.cpu.as_ref().map(|c| c.lookup(&seq.hashes[gpu..])) {
                        Some(Found::Hit(n)) => n,
                        _ => 0,
                    };
                    seq.at_arrival = Some((gpu * bs, host * bs));
                }
                self.waiting.push_back(id);
            }
            Command::Abort(id) => {
                if let Some(seq) = self.seqs.remove(&id) {
                    self.waiting.retain(|&w| w != id);
                    self.running.retain(|&r| r != id);
                    self.deferred.remove(&id);
                    self.pool.release(seq.blocks.iter().rev().copied());
                    if let Some(cpu) = &mut self.cpu {
                        if let Some(load) = seq.load {
                            cpu.loaded(&seq.hashes[load.range()]);
                        }
                        cpu.finished(seq.host_keys());
                    }
                    let mut st = lock(&self.stats);
                    st.count_finish(FinishReason::Abort);
                    ended_output(&mut st, &seq);
                }
            }
            Command::Reset(reply) => {
                let forgot = self.pool.reset();
                if let (Some(events), Some(_)) = (&mut self.events, forgot) {
                    events.cleared();
                }
                // The caller may have gone; the reset happened either way.
                let _ = reply.send(forgot);
            }
            Command::Loaded { id, ok } => self.loaded(id, ok),
            Command::Pin { key, blocks, reply } => {
                let answer = match self.kept.get_mut(&key) {
                    None => {
                        lock(&self.stats).nixl.notifications_after_expiry += 1;
                        Err(Unread::Unknown)
                    }
                    Some(k) if !blocks.iter().all(|b| k.blocks.contains(b)) => Err(Unread::NotKept),
                    Some(k) => {
                        k.pinned = true;
                        Ok(())
                    }
                };
                let _ = reply.send(answer);
            }
            Command::Release(key) => {
                if let Some(k) = self.kept.remove(&key) {
                    self.pool.release(k.blocks.into_iter().rev());
                }
            }
            Command::PreloadLora(id) => {
                if let Some(w) = &mut self.weights {
                    w.activate(id);
                }
            }
            Command::Expire(key) => {
                if self.kept.get(&key).is_some_and(|k| !k.pinned)
                    && let Some(k) = self.kept.remove(&key)
                {
                    tracing::warn!(request = key, "Releasing expired KV blocks for request {key}");
                    self.pool.release(k.blocks.into_iter().rev());
                    lock(&self.stats).nixl.kv_expired_reqs += 1;
                }
            }
        }
        self.publish_gauges();
    }

    /// A decode leg's read ended: it joins the running sequences with its
    /// prompt cached, or fails, or is prefilled here (the failure policy).
    fn loaded(&mut self, id: u64, ok: bool) {
        let bs = self.cfg.block_size;
        let Some(seq) = self.seqs.get_mut(&id).filter(|s| s.transfer == Transfer::Read) else { return };
        seq.transfer = Transfer::None;
        if ok {
            cache_blocks(&mut self.pool, &mut self.events, id, seq, seq.prompt_len / bs);
            // The last prompt token is computed again with the first decode step.
            self.running.push(id);
            return;
        }
        self.pool.release(seq.blocks.drain(..).rev());
        seq.registered = 0;
        match self.cfg.failure {
            FailurePolicy::Recompute => self.waiting.push_front(id),
            FailurePolicy::Fail => {
                let _ = seq.events.send(Event::Failed);
                self.seqs.remove(&id);
                lock(&self.stats).count_finish(FinishReason::Error);
            }
        }
    }

    fn schedule(&mut self, start: Instant) -> Plan {
        self.step += 1;
        let bs = self.cfg.block_size;
        let mut plan = Plan::default();
        let stats = self.stats.clone();
        let mut st = lock(&stats);

        // A block for every running sequence's next token, newest preempted first.
        let mut i = 0;
        while i < self.running.len() {
            let id = self.running[i];
            let Some(seq) = self.seqs.get_mut(&id) else {
                self.running.remove(i);
                continue;
            };
            let need = seq.tokens.len().div_ceil(bs).saturating_sub(seq.blocks.len());
            match self.pool.allocate(need) {
                Some(fresh) => {
                    seq.blocks.extend(fresh);
                    if let Some(events) = &mut self.events {
                        events.scheduled(id);
                        let evicted = self.pool.take_evicted();
                        note_evictions(&mut self.evictions, self.cfg.num_blocks, self.step, &evicted, "decode");
                        events.evicted(id, evicted);
                    }
                    plan.decode.push(id);
                    i += 1;
                }
                None => {
                    let Some(victim) = self.running.pop() else { break };
                    self.preempt(victim, &mut st);
                }
            }
        }

        // The adapters this step runs: those of the running sequences.
        let mut loras: HashSet<u64> = plan.decode.iter().filter_map(|id| self.seqs.get(id)?.lora.as_ref().map(|a| a.id)).collect();
        let mut lora_secs = 0.0;
        if let Some(w) = &mut self.weights {
            lora_secs += loras.iter().map(|&l| w.activate(l)).sum::<f64>();
        }

        // Admit waiting sequences in arrival order. One whose adapter would
        // be one too many for the step is passed over (deferred) and the
        // scan goes on; the passed-over keep their place at the head.
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut passed = Vec::new();
        while self.running.len() < self.cfg.max_num_seqs {
            let Some(&id) = self.waiting.front() else { break };
            let Some(seq) = self.seqs.get_mut(&id) else {
                self.waiting.pop_front();
                continue;
            };
            if let (Some(a), Some(w)) = (&seq.lora, &self.weights)
                && loras.len() >= w.max_loras
                && !loras.contains(&a.id)
            {
                self.deferred.insert(id);
                passed.push(id);
                self.waiting.pop_front();
                continue;
            }
            let len = seq.tokens.len().max(1);
            if let Some(load) = seq.load {
                if !load.ready {
                    passed.push(id);
                    self.waiting.pop_front();
                    continue;
                }
                // Its loaded blocks join the prefix cache; it computes the
                // rest, at least the last token, with no new lookup.
                let cached = (load.range().end * bs).min(len - 1);
                if len - cached > budget && !plan.prefill.is_empty() {
                    break;
                }
                seq.load = None;
                if let Some(cpu) = &mut self.cpu {
                    cpu.loaded(&seq.hashes[load.range()]);
                }
                if let Some(events) = &mut self.events {
                    events.scheduled(id);
                }
                cache_blocks(&mut self.pool, &mut self.events, id, seq, load.range().end);
                self.waiting.pop_front();
                budget = budget.saturating_sub(len - cached);
                self.start_prefill(id, (len - cached, cached), &mut loras, &mut lora_secs, &mut plan);
                continue;
            }
            let hit = gpu_hit(&self.pool, seq, bs);
            let cached = hit.len() * bs;
            let read = seq.transfer == Transfer::Read;
            // Past the GPU hit, the host tier may hold more, up to the last
            // full block: loaded before the sequence computes anything.
            let host = match &self.cpu {
                Some(cpu) if !read => cpu.lookup(&seq.hashes[hit.len()..]),
                _ => Found::Hit(0),
            };
            let host = match host {
                Found::Busy => {
                    passed.push(id);
                    self.waiting.pop_front();
                    continue;
                }
                Found::Hit(n) => n,
            };
            // A decode leg reads what it lacks rather than computing it, and a
            // load from the host tier computes nothing in this step.
            let uncached = if read || host > 0 { 0 } else { len - cached };
            if uncached > budget && !plan.prefill.is_empty() {
                break;
            }
            let need = len.div_ceil(bs) - hit.len();
            if need + self.pool.count_free(&hit) > self.pool.num_free() {
                break;
            }
            self.pool.touch(&hit);
            let Some(fresh) = self.pool.allocate(need) else { break };
            if let Some(events) = &mut self.events {
                events.scheduled(id);
                let evicted = self.pool.take_evicted();
                note_evictions(&mut self.evictions, self.cfg.num_blocks, self.step, &evicted, "admission");
                events.evicted(id, evicted);
            }
            seq.blocks = hit;
            seq.registered = seq.blocks.len();
            seq.blocks.extend(fresh);
            self.deferred.remove(&id);
            // Tokens the engine reports cached: a decode leg counts what it
            // reads, as vLLM does, and a load what it loads.
            let found = if read { len } else { cached + host * bs };
            if seq.scheduled.is_none() {
                // What it found where: the router's predictions are checked against this.
                if tracing::enabled!(tracing::Level::DEBUG) {
                    // What took the first block it lacked, if the engine evicted it lately.
                    let taken = seq.hashes.get(seq.registered).and_then(|h| self.evictions.get(h));
                    tracing::debug!(
                        request_id = %seq.request_id,
                        step = self.step,
                        prompt_tokens = len,
                        gpu_cached_tokens = cached,
                        host_cached_tokens = host * bs,
                        gpu_at_arrival = seq.at_arrival.map_or(0, |a| a.0),
                        host_at_arrival = seq.at_arrival.map_or(0, |a| a.1),
                        queued_ms = start.saturating_duration_since(seq.arrival).as_millis() as u64,
                        free_blocks = self.pool.num_free(),
                        host_blocks = self.cpu.as_ref().map_or(0, |c| c.len()),
                        first_missing_evicted_by = %taken.map_or("none", |e| e.1),
                        first_missing_evicted_steps_ago = taken.map_or(0, |e| self.step - e.0),
                        "scheduled"
                    );
                }
                seq.scheduled = Some(start);
                st.prompt_tokens += len as u64;
                st.prefix_queries += len as u64;
                st.prefix_hits += cached as u64;
                st.queue.observe(start.saturating_duration_since(seq.arrival).as_secs_f64());
                st.prefill_computed_tokens.observe(if read { 0.0 } else { (len - found.min(len - 1)) as f64 });
                if read || self.cpu.is_some() {
                    st.external_queries += (len - cached) as u64;
                    st.external_hits += (found - cached) as u64;
                }
                if host > 0 {
                    st.host_hits += (host * bs) as u64;
                }
                // A receiver that went away is aborted by its drop.
                let _ = seq.events.send(Event::Scheduled { cached_tokens: found });
            }
            if read {
                let _ = seq.events.send(Event::Read { blocks: need });
                self.waiting.pop_front();
                continue;
            }
            if let Some(cpu) = &mut self.cpu {
                let from = seq.registered;
                if host > 0 {
                    // It offers only what follows its hit, and waits for the load.
                    let done = cpu.load(&seq.hashes[from..from + host], start);
                    seq.load = Some(Load { from, blocks: host, done, ready: false });
                    (seq.host_from, seq.offered) = (from, from + host);
                    passed.push(id);
                    self.waiting.pop_front();
                    continue;
                }
                (seq.host_from, seq.offered) = (0, 0);
            }
            self.waiting.pop_front();
            budget = budget.saturating_sub(uncached);
            self.start_prefill(id, (uncached, cached), &mut loras, &mut lora_secs, &mut plan);
        }
        for id in passed.into_iter().rev() {
            self.waiting.push_front(id);
        }
        // A step that brings an adapter into a slot waits for its weights.
        plan.secs = self.cfg.latency.step_secs(&plan.work, plan.decode.len()) + lora_secs;
        plan.tokens += plan.decode.len();
        drop(st);
        self.offer(&plan, start + secs(plan.secs));
        self.publish_gauges();
        plan
    }

    /// Admits a waiting sequence (taken off the queue) into the step:
    /// its adapter, then its prompt's full blocks cached as they are
    /// scheduled, as vLLM's `allocate_slots` does (a request scheduled
    /// after it, in this step or the next, finds them).
    fn start_prefill(&mut self, id: u64, work: (usize, usize), loras: &mut HashSet<u64>, lora_secs: &mut f64, plan: &mut Plan) {
        let Some(seq) = self.seqs.get_mut(&id) else { return };
        if let (Some(a), Some(w)) = (&seq.lora, &mut self.weights) {
            loras.insert(a.id);
            *lora_secs += w.activate(a.id);
        }
        cache_blocks(&mut self.pool, &mut self.events, id, seq, seq.tokens.len() / self.cfg.block_size);
        plan.work.push(work);
        plan.tokens += work.0;
        self.running.push(id);
        plan.prefill.push(id);
    }

    /// Every sequence the step runs offers the host tier the full prompt
    /// blocks it has not offered yet, to be copied from `start` (the step's
    /// end); a failed offer is made again next step.
    fn offer(&mut self, plan: &Plan, start: Instant) {
        let Some(cpu) = &mut self.cpu else { return };
        let bs = self.cfg.block_size;
        let self_describing = cpu.config.self_describing;
        for &id in plan.prefill.iter().chain(&plan.decode) {
            let Some(seq) = self.seqs.get_mut(&id) else { continue };
            let full = (seq.prompt_len / bs).min(seq.hashes.len());
            if seq.offered >= full {
                continue;
            }
            let (from, events) = (seq.offered, &self.events);
            let offered = cpu.offer(&seq.hashes[from..full], self.step, start, |fresh| match events {
                Some(events) => {
                    let blocks: Vec<usize> = fresh.iter().map(|i| from + i).collect();
                    events.offloaded(&stored(seq, &blocks), self_describing)
                }
                None => Vec::new(),
            });
            match offered {
                Some(evicted) => {
                    seq.offered = full;
                    if let Some(events) = &mut self.events
                        && !evicted.is_empty()
                    {
                        events.offload_evicted(evicted);
                    }
                }
                None => {
                    if let Some(o) = &mut lock(&self.stats).offload {
                        o.allocation_failures += 1;
                    }
                }
            }
        }
    }

    /// When the next copy to or from the host tier ends, if one is under way.
    fn copy_due(&self) -> Option<Instant> {
        let store = self.cpu.as_ref().and_then(CpuTier::next_store);
        let loads = self.waiting.iter().filter_map(|id| self.seqs.get(id)?.load.filter(|l| !l.ready).map(|l| l.done));
        store.into_iter().chain(loads).min()
    }

    /// The copies a step ending at `end` sees done: stored blocks become
    /// loadable (and are announced), loaded sequences may be scheduled.
    fn copies_done(&mut self, end: Instant) {
        let Some(cpu) = &mut self.cpu else { return };
        let done = cpu.finish(self.step, end);
        let (block_secs, block_bytes) = (cpu.config.block_secs, cpu.config.block_bytes as u64);
        let mut st = lock(&self.stats);
        let Some(o) = &mut st.offload else { return };
        o.store_bytes += done.stored.0 as u64 * block_bytes;
        o.store_secs += done.stored.1;
        for id in &self.waiting {
            if let Some(load) = self.seqs.get_mut(id).and_then(|s| s.load.as_mut())
                && !load.ready
                && load.done <= end
            {
                load.ready = true;
                o.load_bytes += load.blocks as u64 * block_bytes;
                o.load_secs += load.blocks as f64 * block_secs;
            }
        }
        if let Some(events) = &mut self.events
            && !done.events.is_empty()
        {
            events.offload_stored(done.events);
        }
    }

    fn preempt(&mut self, id: u64, st: &mut Stats) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            tracing::debug!(request_id = %seq.request_id, blocks = seq.blocks.len(), "preempted");
            self.pool.release(seq.blocks.drain(..).rev());
            seq.registered = 0;
            seq.preemptions += 1;
            st.preemptions += 1;
            self.waiting.push_front(id);
        }
    }

    fn complete(&mut self, plan: Plan, end: Instant) {
        let bs = self.cfg.block_size;
        let stats = self.stats.clone();
        self.copies_done(end);
        let mut st = lock(&stats);
        st.iteration_tokens.observe(plan.tokens as f64);
        let mut finished = Vec::new();
        // Tokens go out after the step's KV events are published, so a
        // client that has its answer finds the step's batch counted.
        let mut tokens = Vec::new();
        for id in plan.prefill.into_iter().chain(plan.decode) {
            let Some(seq) = self.seqs.get_mut(&id) else { continue };
            // Every token so far is now computed; cache its full blocks.
            extend_block_hashes(&mut seq.hashes, seq.salt, &seq.tokens, bs);
            cache_blocks(&mut self.pool, &mut self.events, id, seq, seq.tokens.len() / bs);
            let ids = &self.cfg.generation_ids;
            let token = ids[seq.rng.random_range(0..ids.len())];
            seq.tokens.push(token);
            st.generation_tokens += 1;
            match seq.last_token {
                None => st.ttft.observe((end - seq.arrival).as_secs_f64()),
                Some(last) => st.inter_token.observe((end - last).as_secs_f64()),
            }
            if seq.first_token.is_none()
                && let (Some(info), Some(a)) = (&mut st.lora, &seq.lora)
            {
                info.started(&a.name);
            }
            seq.first_token.get_or_insert(end);
            seq.last_token = Some(end);
            let finish = (seq.generated() >= seq.max_tokens).then_some(seq.at_limit);
            if finish.is_some() && matches!(seq.transfer, Transfer::Keep(_)) {
                let block_ids = seq.blocks[..seq.prompt_len.div_ceil(bs)].to_vec();
                tokens.push((seq.events.clone(), Event::Kept { block_ids }));
            }
            tokens.push((seq.events.clone(), Event::Token { id: token, finish }));
            if finish.is_some() {
                finished.push(id);
            }
        }
        if let Some(events) = &mut self.events {
            events.publish();
        }
        for (to, token) in tokens {
            // A receiver that went away is aborted by its drop.
            let _ = to.send(token);
        }
        for id in finished {
            self.finish(id, end, &mut st);
        }
        if let Some(info) = &mut st.lora {
            info.stamp(SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64()));
        }
        drop(st);
        self.publish_gauges();
    }

    fn finish(&mut self, id: u64, end: Instant, st: &mut Stats) {
        let Some(seq) = self.seqs.remove(&id) else { return };
        self.running.retain(|&r| r != id);
        if let Some(cpu) = &mut self.cpu {
            cpu.finished(seq.host_keys());
        }
        if let Transfer::Keep(key) = &seq.transfer {
            self.keep(key.clone(), seq.blocks.clone());
        } else {
            self.pool.release(seq.blocks.iter().rev().copied());
        }
        let scheduled = seq.scheduled.unwrap_or(seq.arrival);
        let first = seq.first_token.unwrap_or(end);
        let generated = seq.generated();
        st.count_finish(seq.at_limit);
        ended_output(st, &seq);
        st.e2e.observe((end - seq.arrival).as_secs_f64());
        st.inference.observe((end - scheduled).as_secs_f64());
        st.prefill.observe((first - scheduled).as_secs_f64());
        st.decode.observe((end - first).as_secs_f64());
        if generated > 1 {
            st.time_per_output_token.observe((end - first).as_secs_f64() / (generated - 1) as f64);
        }
        st.request_prompt_tokens.observe(seq.prompt_len as f64);
        st.request_generation_tokens.observe(generated as f64);
        st.request_max_generation_tokens.observe(seq.max_tokens as f64);
        st.params_max_tokens.observe(seq.max_tokens as f64);
        st.params_n.observe(1.0);
        st.request_preemptions.observe(f64::from(seq.preemptions));
    }

    /// Keeps a finished prefill leg's blocks until read or until the lease ends.
    fn keep(&mut self, key: String, blocks: Vec<BlockId>) {
        let (me, lease) = (self.me.clone(), self.cfg.lease);
        let expire = key.clone();
        tokio::spawn(async move {
            tokio::time::sleep(lease).await;
            if let Some(tx) = me.upgrade() {
                let _ = tx.send(Command::Expire(expire));
            }
        });
        self.kept.insert(key, Kept { blocks, pinned: false });
    }

    fn publish_gauges(&self) {
        let mut st = lock(&self.stats);
        st.running = self.running.len();
        st.waiting = self.waiting.len();
        st.deferred = self.deferred.len();
        st.kv_usage = self.pool.usage();
    }
}

/// A sequence that had output and is over leaves the adapters' info gauge.
fn ended_output(st: &mut Stats, seq: &Seq) {
    if let (Some(info), Some(a), Some(_)) = (&mut st.lora, &seq.lora, seq.first_token) {
        info.ended(&a.name);
    }
}

/// Caches `seq`'s first `full` blocks (those not cached yet), telling the
/// step's events which ones it stored.
/// The blocks of `seq`'s prompt the GPU cache holds, consecutive from the
/// first, as a lookup finds them now (its block hashes extended first).
/// The last token is always computed, so a fully cached prompt still
/// recomputes its last block.
fn gpu_hit(pool: &BlockPool, seq: &mut Seq, bs: usize) -> Vec<BlockId> {
    extend_block_hashes(&mut seq.hashes, seq.salt, &seq.tokens, bs);
    let limit = ((seq.tokens.len().max(1) - 1) / bs).min(seq.hashes.len());
    pool.lookup(&seq.hashes[..limit])
}

fn cache_blocks(pool: &mut BlockPool, events: &mut Option<StepEvents>, id: u64, seq: &mut Seq, full: usize) {
    let mut cached = Vec::new();
    for k in seq.registered..full {
        if pool.register(seq.blocks[k], seq.hashes[k]) && events.is_some() {
            cached.push(k);
        }
    }
    if let Some(events) = events
        && !cached.is_empty()
    {
        events.stored(id, &stored(seq, &cached));
    }
    seq.registered = full.max(seq.registered);
}

/// With debug logging on, remembers that `evicted` went in `step`, taken
/// by `by`; past four times the cache's blocks, it starts over.
fn note_evictions(
    evictions: &mut HashMap<BlockHash, (u64, &'static str)>,
    blocks: usize,
    step: u64,
    evicted: &[BlockHash],
    by: &'static str,
) {
    if !tracing::enabled!(tracing::Level::DEBUG) {
        return;
    }
    if evictions.len() > 4 * blocks {
        evictions.clear();
    }
    for &h in evicted {
        evictions.insert(h, (step, by));
    }
}

/// `blocks` of `seq`, as the events describe them.
fn stored<'a>(seq: &'a Seq, blocks: &'a [usize]) -> Stored<'a> {
    Stored { hashes: &seq.hashes, tokens: &seq.tokens, blocks, cache_salt: seq.cache_salt.as_deref(), lora: seq.lora.as_ref() }
}

#[cfg(test)]
mod tests;
