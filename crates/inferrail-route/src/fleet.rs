//! The replicas the router knows, with the router's own live counters:
//! requests in flight and waiting for a first byte, prompt tokens in flight,
//! the prefill it has sent and that is not done yet (a virtual queue that
//! drains in real time and is empty once every request there has had its
//! first byte), and health (active probes plus passive ejection with
//! doubling backoff). Times are on the router's clock, passed in.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;

use inferrail_config::{CacheShape, Health as HealthConfig, Limits, ReplicaKvEvents, Role};
use inferrail_kv::index::Slot;
use inferrail_kv::mode::{Mode, Reason};
use inferrail_policy::{AdapterFit, Candidate, Offloaded, Own, Prefill, Share};

use crate::kv::{Prediction, Record};
use crate::{FRESH, Hold, Report};

/// One replica and its live state.
#[derive(Debug)]
pub struct Replica {
    /// Unique id, as configured or `<group>-<ip>-<port>`.
    pub id: String,
    /// Where Envoy reaches it: `ip:port` as in the cluster.
    pub addr: SocketAddr,
    /// Indices of the models it serves.
    pub models: Vec<usize>,
    max_concurrency: AtomicU32,
    max_pending: AtomicU32,
    /// Its engine's prefill cost when configured for it (else its model's).
    prefill: RwLock<Option<Prefill>>,
    /// Its role in disaggregated serving.
    role: RwLock<Role>,
    /// Its slot in the KV index.
    pub slot: Slot,
    /// Its KV cache shape as configured.
    pub cache: CacheShape,
    /// Where its KV events come from, when its entry or its pod says (else the `kv_events` template).
    pub kv_events: Option<ReplicaKvEvents>,
    /// A stable number for it (a hash of its id), for hashing policies and sessions.
    pub key: u64,
    learned_block_size: AtomicUsize,
    learned_blocks: AtomicUsize,
    /// Tokens after each block its engine's hashes cover, from its KV events.
    learned_lookahead: AtomicUsize,
    /// The engine's prefix-cache query counter when last read.
    pub prefix_queries: AtomicU64,
    /// Times the engine's counters went back (it restarted), for its KV events' follower.
    pub restarts: AtomicU64,
    /// Its KV index mode: 0 exact, else 1 + the reason's place in `Reason::ALL`.
    kv_mode: AtomicU8,
    in_flight: AtomicU32,
    pending: AtomicU32,
    /// Of `in_flight` and `pending`, the requests this router decided (the
    /// rest are its peers', mirrored).
    own_in_flight: AtomicU32,
    own_pending: AtomicU32,
    prompt_tokens: AtomicU64,
    /// Estimated prefill of the requests still waiting for their first byte, microseconds.
    pending_prefill_us: AtomicU64,
    /// LoRA adapters of the requests in flight, and how many of each.
    adapters: Mutex<Vec<(Arc<str>, u32)>>,
    /// The engine's last word on its adapters (`vllm:lora_requests_info`).
    engine_adapters: Mutex<Option<EngineAdapters>>,
    /// What each request sent lately takes, by decision time, as long as a
    /// fresh engine report may predate it.
    sent: Mutex<VecDeque<(Duration, Arc<Sent>)>>,
    probe_ok: AtomicBool,
    /// Whether Envoy has been told of it (the EDS file lists it); one that
    /// is not is never probed, so it stays unhealthy (offered only when the
    /// whole fleet is, in panic).
    announced: AtomicBool,
    /// Probes in a row that got no answer.
    probe_misses: AtomicU32,
    draining: AtomicBool,
    failures: AtomicU32,
    ejections: AtomicU32,
    ejected_until_ms: AtomicU64,
}

/// The current replicas, grouped by model; replaced whole when membership changes.
#[derive(Debug, Default)]
pub struct Fleet {
    /// Every replica.
    pub replicas: Vec<Arc<Replica>>,
    per_model: Vec<Vec<Arc<Replica>>>,
}

impl Fleet {
    /// Groups `replicas` by the models they serve.
    pub fn new(replicas: Vec<Arc<Replica>>, models: usize) -> Self {
        let mut per_model = vec![Vec::new(); models];
        for r in &replicas {
            for &m in &r.models {
                per_model[m].push(r.clone());
            }
        }
        Self { replicas, per_model }
    }

    /// The replicas serving model `m`, in membership order.
    pub fn serving(&self, m: usize) -> &[Arc<Replica>] {
        self.per_model.get(m).map_or(&[], Vec::as_slice)
    }

    /// Whether model `m` is served disaggregated: some replica of it only prefills.
    pub fn disaggregated(&self, m: usize) -> bool {
        self.serving(m).iter().any(|r| r.role() == Role::Prefill)
    }
}

fn mode_code(mode: Mode) -> u8 {
    match mode {
        Mode::Exact => 0,
        Mode::Approximate(r) => Reason::ALL.iter().position(|&x| x == r).map_or(1, |p| p as u8 + 1),
    }
}

/// Lease states: waiting for the first byte, streaming, released.
const PENDING: u8 = 0;
const STREAMING: u8 = 1;
const RELEASED: u8 = 2;
impl Replica {
    /// A replica with nothing in flight, healthy until shown otherwise.
    pub fn new(id: String, addr: SocketAddr, models: Vec<usize>, limits: Limits, cache: CacheShape, slot: Slot) -> Self {
        Self {
            addr,
            models,
            max_concurrency: AtomicU32::new(limits.max_concurrency),
            max_pending: AtomicU32::new(limits.max_pending),
            prefill: RwLock::new(None),
            role: RwLock::new(Role::Both),
            slot,
            cache,
            kv_events: None,
            key: xxhash_rust::xxh3::xxh3_64(id.as_bytes()),
            learned_block_size: AtomicUsize::new(0),
            learned_blocks: AtomicUsize::new(0),
            learned_lookahead: AtomicUsize::new(0),
            prefix_queries: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            kv_mode: AtomicU8::new(mode_code(Mode::Approximate(Reason::NoEventsConfigured))),
            in_flight: AtomicU32::new(0),
            pending: AtomicU32::new(0),
            own_in_flight: AtomicU32::new(0),
            own_pending: AtomicU32::new(0),
            prompt_tokens: AtomicU64::new(0),
            pending_prefill_us: AtomicU64::new(0),
            adapters: Mutex::new(Vec::new()),
            engine_adapters: Mutex::new(None),
            sent: Mutex::new(VecDeque::new()),
            probe_ok: AtomicBool::new(true),
            announced: AtomicBool::new(true),
            probe_misses: AtomicU32::new(0),
            draining: AtomicBool::new(false),
            failures: AtomicU32::new(0),
            ejections: AtomicU32::new(0),
            ejected_until_ms: AtomicU64::new(0),
            id,
        }
    }

    /// The same, with its own KV events source.
    pub fn with_kv_events(self, kv_events: Option<ReplicaKvEvents>) -> Self {
        Self { kv_events, ..self }
    }

    /// Its engine's prefill cost when configured for it.
    pub fn prefill(&self) -> Option<Prefill> {
        *self.prefill.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes its engine's prefill cost (at start or on a reload; `None`: its model's).
    pub fn set_prefill(&self, prefill: Option<Prefill>) {
        *self.prefill.write().unwrap_or_else(|p| p.into_inner()) = prefill;
    }

    /// Its role in disaggregated serving.
    pub fn role(&self) -> Role {
        *self.role.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes its role (at start or on a reload).
    pub fn set_role(&self, role: Role) {
        *self.role.write().unwrap_or_else(|p| p.into_inner()) = role;
    }

    /// How its KV index entry is known.
    pub fn kv_mode(&self) -> Mode {
        match self.kv_mode.load(Ordering::Relaxed) {
            0 => Mode::Exact,
            c => Mode::Approximate(Reason::ALL.get(usize::from(c) - 1).copied().unwrap_or(Reason::NoEventsConfigured)),
        }
    }

    /// Sets its KV mode; returns the one before.
    pub fn set_kv_mode(&self, mode: Mode) -> Mode {
        let before = self.kv_mode();
        self.kv_mode.store(mode_code(mode), Ordering::Relaxed);
        before
    }

    /// Tokens per KV block: configured, else learned from the engine, else `default`.
    pub fn block_size(&self, default: usize) -> usize {
        self.cache.block_size.unwrap_or_else(|| Some(self.learned_block_size.load(Ordering::Relaxed)).filter(|&b| b > 0).unwrap_or(default))
    }

    /// KV blocks: configured, else learned from the engine, else `default`.
    pub fn blocks(&self, default: usize) -> usize {
        self.cache.blocks.unwrap_or_else(|| Some(self.learned_blocks.load(Ordering::Relaxed)).filter(|&b| b > 0).unwrap_or(default))
    }

    /// Keeps what the engine reports of its cache (configured values still win); true when the report is new.
    pub fn learn_cache(&self, block_size: usize, blocks: usize) -> bool {
        let before = (self.learned_block_size.swap(block_size, Ordering::Relaxed), self.learned_blocks.swap(blocks, Ordering::Relaxed));
        before != (block_size, blocks)
    }

    /// Tokens after each block that its engine's block hashes also cover
    /// (vLLM 0.33's lookahead hashing), as its KV events show; 0 without.
    pub fn lookahead(&self) -> usize {
        self.learned_lookahead.load(Ordering::Relaxed)
    }

    /// Keeps the lookahead its KV events show; true when it changed.
    pub fn learn_lookahead(&self, tokens: usize) -> bool {
        self.learned_lookahead.swap(tokens, Ordering::Relaxed) != tokens
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Whether it may be offered at `now_ms` (milliseconds on the fleet clock).
    pub fn healthy(&self, now_ms: u64) -> bool {
        self.probe_ok.load(Ordering::Relaxed) && !self.ejected(now_ms)
    }

    /// Whether passive health has it ejected at `now_ms`.
    pub fn ejected(&self, now_ms: u64) -> bool {
        self.ejected_until_ms.load(Ordering::Relaxed) > now_ms
    }

    /// Requests still waiting for their first byte.
    pub fn pending(&self) -> u32 {
        self.pending.load(Ordering::Relaxed)
    }

    /// Prompt tokens of the requests in flight.
    pub fn prompt_tokens(&self) -> u64 {
        self.prompt_tokens.load(Ordering::Relaxed)
    }

    /// Prefill sent to it and not done yet: the estimated prefill of the
    /// requests there still waiting for their first byte. It does not
    /// drain with time: an engine behind its estimate (out of KV room,
    /// slower than calibrated) has not done their work until it says so.
    pub fn queued_prefill(&self) -> Duration {
        Duration::from_micros(self.pending_prefill_us.load(Ordering::Relaxed))
    }

    /// What the engine's `report` does not show of the requests sent to it:
    /// the KV tokens of those sent since, and the prefill queued as the
    /// report corrects the router's count. The engine serves its queue
    /// first come first: of the requests sent before it reported and still
    /// without a first byte, only the newest `waiting` it reported had not
    /// started, so those and the ones sent since are queued (the router
    /// hears a first byte only at the response's end, ADR 0035, and long
    /// generations would otherwise count as queued to the end; the prefill
    /// under way is not counted). Requests it passes over until an adapter
    /// slot frees (deferred) hold no place in that queue. `None` when the
    /// engine waits on more than the router remembers sending: the
    /// router's own count stands.
    fn unreported(&self, report: Report) -> (u64, Option<Duration>) {
        let (mut kv, mut queued, mut waiting) = (0, 0, report.load.waiting.saturating_sub(report.load.deferred));
        // Newest first: the sends since the report, then the newest waiting ones before it.
        for (at, sent) in self.sent.lock().unwrap_or_else(|p| p.into_inner()).iter().rev() {
            let prefill = sent.prefill_us.load(Ordering::Relaxed);
            if *at > report.at {
                kv += sent.kv_tokens.load(Ordering::Relaxed);
                queued += prefill;
            } else if prefill > 0 && waiting > 0 {
                queued += prefill;
                waiting -= 1;
            }
        }
        (kv, (waiting == 0).then(|| Duration::from_micros(queued)))
    }

    /// A request decided at `at` was sent to it and will take `kv_tokens` of
    /// its KV cache (its prompt less what is cached there) until it is over,
    /// and its `prefill_us` until its first byte; the returned counts are
    /// zeroed then.
    pub fn sent(&self, at: Duration, kv_tokens: u64, prefill_us: u64) -> Arc<Sent> {
        let mut sent = self.sent.lock().unwrap_or_else(|p| p.into_inner());
        while sent.front().is_some_and(|(t, _)| *t + FRESH < at) {
            sent.pop_front();
        }
        let held = Arc::new(Sent { kv_tokens: AtomicU64::new(kv_tokens), prefill_us: AtomicU64::new(prefill_us) });
        sent.push_back((at, held.clone()));
        held
    }

    /// What a policy sees of it at `now`, with the prompt's predicted cached
    /// tokens there (and of those, the ones requests in flight hold), the
    /// engine's report when it is fresh, and where this router stands among
    /// the routers sharing it.
    pub fn candidate(
        &self,
        now: Duration,
        (cached_tokens, held_cached_tokens): (usize, usize),
        engine: Option<Report>,
        share: Share,
    ) -> Candidate {
        let limits = self.limits();
        let (unreported_kv_tokens, reported_queue) = engine.map_or((0, None), |e| self.unreported(e));
        let queued = self.queued_prefill();
        let own = (share.of > 1).then(|| Own {
            in_flight: self.own_in_flight.load(Ordering::Relaxed),
            pending: self.own_pending.load(Ordering::Relaxed),
            max_concurrency: share.part(limits.max_concurrency),
            max_pending: share.part(limits.max_pending),
        });
        Candidate {
            key: self.key,
            in_flight: self.in_flight.load(Ordering::Relaxed),
            pending: self.pending(),
            max_concurrency: limits.max_concurrency,
            max_pending: limits.max_pending,
            healthy: self.healthy(now.as_millis() as u64),
            cached_tokens,
            held_cached_tokens,
            queued_prefill_secs: reported_queue.map_or(queued, |q| q.min(queued)).as_secs_f64(),
            prefill: self.prefill(),
            prompt_tokens_in_flight: self.prompt_tokens(),
            kv_capacity_tokens: (self.blocks(0) * self.block_size(0)) as u64,
            unreported_kv_tokens,
            engine: engine.map(|e| e.load),
            own,
            adapter: None,
            offloaded: Offloaded::default(),
        }
    }

    /// Its limits now.
    pub fn limits(&self) -> Limits {
        Limits { max_concurrency: self.max_concurrency.load(Ordering::Relaxed), max_pending: self.max_pending.load(Ordering::Relaxed) }
    }

    /// Takes new limits (a reload); requests already in flight stay.
    pub fn set_limits(&self, limits: Limits) {
        self.max_concurrency.store(limits.max_concurrency, Ordering::Relaxed);
        self.max_pending.store(limits.max_pending, Ordering::Relaxed);
    }

    /// Whether it is draining: it finishes its requests and is offered no new one.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Starts or ends its drain; returns whether that changed anything.
    pub fn set_draining(&self, draining: bool) -> bool {
        self.draining.swap(draining, Ordering::Relaxed) != draining
    }

    /// Holds a replica that joins a running fleet until its first
    /// successful probe, as Envoy holds a new host of a health-checked
    /// cluster; with `unannounced`, also until Envoy has been told of it
    /// ([`Replica::announce`]), since before then Envoy could not send it
    /// the requests the router names it for.
    pub fn hold_until_probed(&self, unannounced: bool) {
        self.probe_ok.store(false, Ordering::Relaxed);
        if unannounced {
            self.announced.store(false, Ordering::Relaxed);
        }
    }

    /// Envoy has been told of it: it may be probed, and offered.
    pub fn announce(&self) {
        self.announced.store(true, Ordering::Relaxed);
    }

    /// Whether Envoy knows it (always, without an EDS file).
    pub fn announced(&self) -> bool {
        self.announced.load(Ordering::Relaxed)
    }

    /// Records a probe result; returns whether the probe state changed.
    pub fn set_probe(&self, ok: bool) -> bool {
        self.probe_ok.swap(ok, Ordering::Relaxed) != ok
    }

    /// Counts a probe that got no answer (`true`) or one that did; returns
    /// how many in a row got none.
    pub fn probe_missed(&self, missed: bool) -> u32 {
        if missed {
            self.probe_misses.fetch_add(1, Ordering::Relaxed) + 1
        } else {
            self.probe_misses.store(0, Ordering::Relaxed);
            0
        }
    }

    /// A request succeeded: the failure streak ends.
    pub fn record_success(&self) {
        self.failures.store(0, Ordering::Relaxed);
    }

    /// A request failed; returns the streak length.
    pub fn record_failure(&self) -> u32 {
        self.failures.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Ejects it from `now_ms` for the base time doubled per earlier
    /// ejection, capped; returns the ejection length in milliseconds. A
    /// replica that stayed in for `max_ejection_ms` since its last ejection
    /// ended starts again from the base time.
    pub fn eject(&self, now_ms: u64, cfg: &HealthConfig) -> u64 {
        if now_ms > self.ejected_until_ms.load(Ordering::Relaxed).saturating_add(cfg.max_ejection_ms) {
            self.ejections.store(0, Ordering::Relaxed);
        }
        let n = self.ejections.fetch_add(1, Ordering::Relaxed).min(20);
        let length = cfg.base_ejection_ms.saturating_mul(1 << n).min(cfg.max_ejection_ms);
        self.ejected_until_ms.store(now_ms + length, Ordering::Relaxed);
        self.failures.store(0, Ordering::Relaxed);
        length
    }

    /// Where adapter `name` stands here at `now`, for a model that runs at
    /// most `max_loras` adapters a step (configured; else as the engine
    /// reports): see [`Replica::adapters`].
    pub fn adapter_fit(&self, name: &str, max_loras: Option<u32>, now: Duration) -> AdapterFit {
        let view = self.adapters(max_loras, now);
        let running = view.running.iter().any(|a| &**a == name);
        AdapterFit {
            resident: running || view.idle.iter().any(|a| &**a == name),
            others: (view.running.len() - usize::from(running)) as u32,
            max_loras: view.max_loras,
        }
    }

    /// Its adapters at `now`. Running: those of the requests in flight
    /// (this router's and its peers'), and those the engine's fresh report
    /// names. Idle in a slot: those whose requests ended, most recently
    /// used first, while the slots the running ones leave hold them (the
    /// engine evicts the least recently used first); none with `max_loras`
    /// unknown. Waiting: as the engine's fresh report names them.
    pub fn adapters(&self, max_loras: Option<u32>, now: Duration) -> Adapters {
        // Locked in this order only here; each is otherwise locked alone.
        let engine = self.engine_adapters.lock().unwrap_or_else(|p| p.into_inner());
        let max_loras = max_loras.or(engine.as_ref().map(|e| e.max_loras).filter(|&m| m > 0));
        let fresh = engine.as_ref().filter(|e| now.saturating_sub(e.at) <= FRESH);
        let ours = self.adapters.lock().unwrap_or_else(|p| p.into_inner());
        let mut running: Vec<Arc<str>> = ours.iter().filter(|(_, n)| *n > 0).map(|(a, _)| a.clone()).collect();
        for a in fresh.iter().flat_map(|e| &e.running) {
            if !running.contains(a) {
                running.push(a.clone());
            }
        }
        let idle_slots = max_loras.map_or(0, |m| (m as usize).saturating_sub(running.len()));
        let idle = ours.iter().rev().filter(|(a, n)| *n == 0 && !running.contains(a)).take(idle_slots).map(|(a, _)| a.clone()).collect();
        Adapters { running, idle, waiting: fresh.map(|e| e.waiting.clone()).unwrap_or_default(), max_loras }
    }

    /// Keeps what the engine reported of its adapters at `at` (router clock).
    pub fn learn_adapters(&self, at: Duration, max_loras: u32, running: &[String], waiting: &[String]) {
        let names = |v: &[String]| v.iter().map(|n| Arc::from(n.as_str())).collect();
        let report = EngineAdapters { at, max_loras, running: names(running), waiting: names(waiting) };
        *self.engine_adapters.lock().unwrap_or_else(|p| p.into_inner()) = Some(report);
    }

    /// A request of adapter `name` came (`up`) or went: it is the most
    /// recently used. Adapters with none in flight are remembered, the
    /// least recently used forgotten first past [`ADAPTERS_REMEMBERED`].
    fn count_adapter(&self, name: &Arc<str>, up: bool) {
        let mut adapters = self.adapters.lock().unwrap_or_else(|p| p.into_inner());
        let (name, count) = match adapters.iter().position(|(a, _)| a == name) {
            Some(i) => adapters.remove(i),
            None if up => (name.clone(), 0),
            None => return,
        };
        adapters.push((name, if up { count + 1 } else { count.saturating_sub(1) }));
        if adapters.len() > ADAPTERS_REMEMBERED
            && let Some(i) = adapters.iter().position(|(_, n)| *n == 0)
        {
            adapters.remove(i);
        }
    }

    fn acquire(&self, prompt_tokens: u64, mine: bool) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.pending.fetch_add(1, Ordering::Relaxed);
        if mine {
            self.own_in_flight.fetch_add(1, Ordering::Relaxed);
            self.own_pending.fetch_add(1, Ordering::Relaxed);
        }
        self.prompt_tokens.fetch_add(prompt_tokens, Ordering::Relaxed);
    }
}

/// An engine's report of its adapters.
#[derive(Debug, Clone)]
struct EngineAdapters {
    /// When it was read, on the router's clock.
    at: Duration,
    max_loras: u32,
    running: Vec<Arc<str>>,
    waiting: Vec<Arc<str>>,
}

/// A replica's LoRA adapters as the router sees them ([`Replica::adapters`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Adapters {
    /// Adapters of the requests running there.
    pub running: Vec<Arc<str>>,
    /// Adapters with nothing running that still hold a slot, most recently used first.
    pub idle: Vec<Arc<str>>,
    /// Adapters of the requests the engine has waiting.
    pub waiting: Vec<Arc<str>>,
    /// Adapters one engine step runs, when known.
    pub max_loras: Option<u32>,
}

/// Adapters a replica remembers, most recently used last, beyond those
/// with requests in flight: more than any engine holds in its slots.
const ADAPTERS_REMEMBERED: usize = 64;

/// What a request sent lately still takes on its replica: KV tokens until
/// it is over, its estimated prefill until its first byte.
#[derive(Debug)]
pub struct Sent {
    kv_tokens: AtomicU64,
    prefill_us: AtomicU64,
}

/// A request's hold on a replica: counted in flight (and pending until its
/// first byte) from the decision until it is released, however the request
/// ends. Release is explicit and happens once; dropping an unreleased lease
/// releases it too. When each happens is the request's life's to say
/// ([`crate::lifecycle`]).
#[derive(Debug)]
pub struct Lease {
    /// The replica it holds.
    pub replica: Arc<Replica>,
    /// The model's index.
    pub model: usize,
    /// Prompt tokens it counts in flight on its replica.
    pub prompt_tokens: u64,
    /// This router decided it (else it mirrors a peer's decision).
    pub mine: bool,
    /// The router's estimate of its time to first token, microseconds (0: none).
    estimate_us: AtomicU64,
    state: AtomicU8,
    /// Its estimated prefill while it counts in its replica's queue, microseconds.
    prefill_us: AtomicU64,
    /// Its entry among its replica's requests sent lately.
    sent: OnceLock<Arc<Sent>>,
    /// The LoRA adapter it asks for, counted on its replica while it holds.
    adapter: OnceLock<Arc<str>>,
    /// What the decision recorded in the KV index, to take back if the engine refuses the request.
    pub kv: Mutex<Option<(Arc<Prediction>, Record)>>,
    /// The record once the request completed, for a first byte heard after
    /// the end (from the access log) to teach the index.
    pub completed: OnceLock<Record>,
}

impl Lease {
    /// Takes a slot on `replica` for a prompt of `prompt_tokens`.
    pub fn new(replica: Arc<Replica>, model: usize, prompt_tokens: u64) -> Self {
        Self::held(replica, model, prompt_tokens, true)
    }

    /// A slot on `to` for the same request (Envoy retried there):
    /// this router's or a peer's as this one is.
    pub fn moved(&self, to: Arc<Replica>) -> Self {
        let moved = Self::held(to, self.model, self.prompt_tokens, self.mine);
        if let Some(a) = self.adapter.get() {
            moved.set_adapter(a.clone());
        }
        moved
    }

    /// It asks for LoRA adapter `name`: counted on its replica until it is
    /// released. Once; a later call changes nothing.
    pub fn set_adapter(&self, name: Arc<str>) {
        if !self.released() && self.adapter.set(name.clone()).is_ok() {
            self.replica.count_adapter(&name, true);
        }
    }

    /// Takes a slot on `replica` for a request a peer router decided: it
    /// counts in flight there, but not in this router's part of the limits.
    pub fn mirror(replica: Arc<Replica>, model: usize, prompt_tokens: u64) -> Self {
        Self::held(replica, model, prompt_tokens, false)
    }

    fn held(replica: Arc<Replica>, model: usize, prompt_tokens: u64, mine: bool) -> Self {
        replica.acquire(prompt_tokens, mine);
        let (state, kv) = (AtomicU8::new(PENDING), Mutex::new(None));
        let (estimate_us, prefill_us) = (AtomicU64::new(0), AtomicU64::new(0));
        let sent = OnceLock::new();
        let (adapter, completed) = (OnceLock::new(), OnceLock::new());
        Self { replica, model, prompt_tokens, mine, estimate_us, state, prefill_us, sent, adapter, kv, completed }
    }

    /// What it holds now, as a peer is told to hold it: its prompt, the
    /// prefill still queued (none once its first byte came), the KV room it
    /// takes (none once released) and its prompt's record.
    pub fn hold(&self) -> Hold {
        Hold {
            prompt_tokens: (self.prompt_tokens > 0).then_some(self.prompt_tokens as usize),
            prefill: Duration::from_micros(self.prefill_us.load(Ordering::Relaxed)),
            estimate: self.estimate().unwrap_or_default(),
            kv_tokens: self.sent.get().map_or(0, |s| s.kv_tokens.load(Ordering::Relaxed)),
            prediction: self.kv.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|(p, _)| p.clone()),
        }
    }

    /// Queues its estimated `prefill` on its replica, until its first byte or release.
    pub fn queue_prefill(&self, prefill: Duration) {
        let us = prefill.as_micros() as u64;
        self.prefill_us.store(us, Ordering::Relaxed);
        self.replica.pending_prefill_us.fetch_add(us, Ordering::Relaxed);
    }

    /// It was decided at `at` and will take `tokens` of its replica's KV
    /// cache until it is released, and its queued prefill until its first
    /// byte (see [`Replica::sent`]). Once, when the decision is committed,
    /// after its prefill is queued; a later call changes nothing.
    pub fn sent_kv(&self, at: Duration, tokens: u64) {
        self.sent.get_or_init(|| self.replica.sent(at, tokens, self.prefill_us.load(Ordering::Relaxed)));
    }

    /// Its prefill is done, or will never be: out of its replica's queue.
    fn unqueue(&self) {
        self.replica.pending_prefill_us.fetch_sub(self.prefill_us.swap(0, Ordering::Relaxed), Ordering::Relaxed);
        if let Some(sent) = self.sent.get() {
            sent.prefill_us.store(0, Ordering::Relaxed);
        }
    }

    /// Records the router's estimate of its time to first token.
    pub fn set_estimate(&self, estimate: Duration) {
        self.estimate_us.store(estimate.as_micros() as u64, Ordering::Relaxed);
    }

    /// The router's estimate of its time to first token, if one was made.
    pub fn estimate(&self) -> Option<Duration> {
        Some(self.estimate_us.load(Ordering::Relaxed)).filter(|&us| us > 0).map(Duration::from_micros)
    }

    /// Whether the slot was given back.
    pub fn released(&self) -> bool {
        self.state.load(Ordering::SeqCst) == RELEASED
    }

    /// Gives the slot back; only the first call counts.
    pub fn release(&self) {
        let before = self.state.swap(RELEASED, Ordering::SeqCst);
        if before == PENDING {
            self.replica.pending.fetch_sub(1, Ordering::Relaxed);
            if self.mine {
                self.replica.own_pending.fetch_sub(1, Ordering::Relaxed);
            }
            self.unqueue();
        }
        if before != RELEASED {
            self.replica.in_flight.fetch_sub(1, Ordering::Relaxed);
            if self.mine {
                self.replica.own_in_flight.fetch_sub(1, Ordering::Relaxed);
            }
            self.replica.prompt_tokens.fetch_sub(self.prompt_tokens, Ordering::Relaxed);
            if let Some(sent) = self.sent.get() {
                sent.kv_tokens.store(0, Ordering::Relaxed);
            }
            if let Some(a) = self.adapter.get() {
                self.replica.count_adapter(a, false);
            }
        }
    }

    /// Marks the first byte; true the first time only, and never after release.
    pub fn first_byte(&self) -> bool {
        let first = self.state.compare_exchange(PENDING, STREAMING, Ordering::AcqRel, Ordering::Relaxed).is_ok();
        if first {
            self.replica.pending.fetch_sub(1, Ordering::Relaxed);
            if self.mine {
                self.replica.own_pending.fetch_sub(1, Ordering::Relaxed);
            }
            self.unqueue();
        }
        first
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.release();
    }
}

/// Whether `replica` may be ejected without ejecting more than the allowed
/// share of any model it serves.
pub fn may_eject(replica: &Replica, all: &[Arc<Replica>], now_ms: u64, cfg: &HealthConfig) -> bool {
    replica.models.iter().all(|m| {
        let peers: Vec<&Arc<Replica>> = all.iter().filter(|r| r.models.contains(m)).collect();
        let ejected = peers.iter().filter(|r| r.ejected(now_ms)).count();
        (ejected + 1) as f64 <= cfg.max_ejected_fraction * peers.len() as f64
    })
}

#[cfg(test)]
mod tests;
