//! The discrete-event simulation: the router's decision core
//! (`inferrail_route::Core`, its policy and KV index, unchanged) over N
//! simulated replicas on a virtual clock. Nothing sleeps; the `now` each
//! decision sees is the virtual time.
//!
//! A simulated replica is a FIFO prefill queue in front of one prefill at a
//! time, priced by the simulator's latency model (`inferrail_engine::cost`:
//! `a*u + b*u*(c + u/2) + d` for `u` uncached tokens after `c` cached), and a
//! real block pool with a prefix cache and LRU eviction (`inferrail_engine::cache`).
//! When a request reaches the head of the queue its cached tokens are looked
//! up in that pool (the truth, not the router's prediction); it takes blocks
//! for its prompt and waits there, holding up the queue, while they are not
//! free. Its first token comes when its prefill ends; it then decodes
//! `max_tokens` at the decode step time for the sequences running when it
//! started, taking a block each time its tokens fill the last, and frees
//! its blocks, last block first. When no block is free the newest decoding
//! request is preempted, as vLLM's scheduler does: its blocks are freed
//! (the full ones stay cached) and it rejoins the head of the queue to
//! recompute its prompt and what it had generated. Decode does not slow
//! prefill (TTFT is what is measured, once per request).
//!
//! Events: an arrival is tokenized ([`super::traffic`]), cut into blocks by
//! `Core::prepare`, decided by `Core::decide` at the virtual now and
//! entered in the router's own `Ledger`, which runs each request's life as
//! the service does (ADR 0029): the engine's status and first token are
//! heard when its prefill ends, its end when it completes, and the ledger
//! completes the KV record and releases the lease as the lifecycle says.
//! `Setup::status_after_end` tells the status only after the end, as an
//! access log would, so that the grace period decides;
//! `Setup::first_byte_after_end` tells the first byte (when it came) only
//! after the end, as the shipped layout's access log does. Each engine's load (running, waiting, KV usage)
//! is read as the scraper reads it, every scrape interval of virtual time
//! (the scraper's default at the time scale, [`timescale::scrape_interval`]),
//! and the decisions see those reports with their age, as the router's do.
//!
//! A closed-loop agent's step (`Arrival::agent`) also caches the blocks its
//! reply fills, as an engine does, under the hashes of its prompt and the
//! reply's tokens (all but the last, whose KV is never computed); when it
//! completes, its agent's next step arrives after its think time, resending
//! that reply. Other requests' output blocks are freed uncached, as before.
//!
//! A disaggregated fleet (`Setup::prefill_replicas`) gives the replicas
//! roles; the core plans a split request's two legs and the ledger holds
//! both, as the service's does when it runs the prefill leg itself (ADR
//! 0056). The prefill leg queues and prefills on its replica like any
//! request; its answer is heard as it comes, and the replica keeps its
//! blocks. The request then queues on its decoder, takes blocks there for
//! its prompt (a hit for each the decoder caches) and reads the rest at
//! the decoder's transfer time per block, while the decoder's queue goes
//! on; once read, the prefill replica lets go of its blocks (they stay
//! cached), and the first token comes one decode step later. The prefill
//! leg ends when the decode leg's first byte is heard. A request the core
//! keeps whole runs on its decoder as on any replica. What is predicted and
//! measured of a split request is the prefill replica's cache.
//!
//! With several routers (`Setup::routers`) arrivals go to them in turn, as
//! Envoy balances ext_proc streams. Each router has its own core, counters
//! and KV index. With `peers` on, as `inferrail` with `peers:` (ADR 0034),
//! each router's decisions, first tokens and completions reach the others
//! `peer_delay` later and they hold those requests as mirrors (their
//! policies learn the pick too), and each admits within its part of the
//! limits; without, each knows only its own.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use inferrail_config::CacheShape;
use inferrail_engine::cache::{BlockId, BlockPool};
use inferrail_engine::cost::{LORA_LOAD_MS, LORA_SLOT_MS, LatencyModel};
use inferrail_kv::hash::{BlockHash, extend_block_hashes};
use inferrail_kv::host::HostOrder;
use inferrail_policy::{EngineReport, PolicyKind};
use inferrail_route::fleet::{Fleet, Replica};
use inferrail_route::kv::{Prediction, Prompt, seed};
use inferrail_route::ledger::{Ledger, mirror_id, prefill_leg_event};
use inferrail_route::lifecycle;
use inferrail_route::{Core, Hold, Report, Share, View};

use crate::latency;
pub use crate::outcome::Outcome;
use crate::outcome::{prefixes_served, slowest};
pub use crate::setup::{Setup, config};
use crate::timescale;
use crate::traffic::{Agent, Arrival};
use inferrail_workload::Counter;

/// The high bits of the names given to blocks of generated tokens no prompt resends.
const GENERATED: BlockHash = 0x6e6e << 112;

/// A request on its replica.
struct Job {
    arrival_ns: u64,
    replica: usize,
    prediction: Arc<Prediction>,
    prompt_tokens: usize,
    max_tokens: usize,
    predicted: usize,
    /// Blocks it holds, and how many of them were cache hits.
    blocks: Vec<BlockId>,
    hit: usize,
    /// Its first prompt block it loaded from host memory (0 when none).
    host_from: usize,
    /// When it first found no room for its blocks at the head of the queue.
    blocked_ns: Option<u64>,
    /// A split request's wait for room on its decoder: since when, and in all.
    read_blocked_ns: Option<u64>,
    read_wait_ns: u64,
    /// When its first prefill started.
    started_ns: u64,
    /// Tokens generated so far, as of `decode_from_ns`.
    generated: usize,
    /// When its current run of decode steps began, and each step's length.
    decode_from_ns: u64,
    step_ns: u64,
    /// Counts its preemptions: its events from before the last one are stale.
    epoch: u32,
    /// When its first token came, for a router that hears it only after the end.
    first_ns: u64,
    /// A closed-loop agent's step: the rest of the agent, and the prompt's ids.
    agent: Option<(Box<Agent>, Vec<u32>)>,
    /// Where a split request is in its two legs.
    stage: Stage,
    /// The LoRA adapter it asks for, and whether a step has passed it over for want of a slot.
    adapter: Option<usize>,
    deferred: bool,
}

/// Where a request is in its legs: whole (or done with its prefill leg),
/// or a split request's prefill leg on the prefill replica, then its wait
/// for room on the decoder and its read of the prefill's blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Stage {
    Whole,
    /// Prefilling on its replica, to be read by `decoder`; `leg` is the
    /// prefill leg's id in the ledger.
    Prefill {
        decoder: usize,
        leg: String,
    },
    /// Queued on (then reading into) its decoder the blocks replica
    /// `prefill` keeps for it (`kept`) until the read ends.
    Read {
        prefill: usize,
        kept: Vec<BlockId>,
    },
}

impl Job {
    /// When it completes if nothing stops it: a decode step after its last
    /// token (as the single decode event always timed it).
    fn completes_at(&self) -> u64 {
        self.decode_from_ns + (self.max_tokens.saturating_sub(self.generated) as u64 + 1) * self.step_ns
    }

    /// Tokens generated by `now`, in the current run of decode steps.
    fn generated_by(&self, now: u64) -> usize {
        let steps = (now.saturating_sub(self.decode_from_ns) / self.step_ns.max(1)) as usize;
        (self.generated + steps).min(self.max_tokens)
    }
}

/// One simulated engine.
struct Engine {
    latency: LatencyModel,
    blocks: usize,
    pool: BlockPool,
    queue: VecDeque<usize>,
    prefilling: Option<usize>,
    /// The jobs decoding, oldest first: the newest is preempted first.
    decoding: Vec<usize>,
    /// Jobs preempted for room, each time.
    preemptions: u64,
    requests: u64,
    prompt_tokens: u64,
    cached_tokens: u64,
    /// Requests it started, by their prompt's root prefix.
    roots: HashMap<u128, u64>,
    /// LoRA adapters in its slots, least recently used first, and how
    /// many times one was loaded.
    slots: Vec<usize>,
    adapter_loads: u64,
    /// Its host memory tier, when it has one.
    host: Option<HostOrder>,
    /// Prompt tokens it loaded from there.
    host_tokens: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    PrefillDone(usize),
    /// Job `.0` has read the blocks its decoder lacked from its prefill replica.
    Read(usize),
    /// Job `.0`'s decoder has taken the first step after the read: its first token.
    FirstStep(usize),
    /// Job `.0` needs a block for its next token (its epoch `.1`).
    Grow(usize, u32),
    /// Job `.0` (its epoch `.1`) has generated its last token.
    Complete(usize, u32),
    /// An agent's next step (in `World::next_steps`) arrives.
    Step(usize),
    /// A peer hears of job `.0`, decided by another router.
    Peer(usize, usize, Heard),
    /// The status of job `.0` from replica `.1`, told after its end (`Setup::status_after_end`).
    LateStatus(usize, usize),
    /// The first byte of job `.0`, at `.1`, told after its end (`Setup::first_byte_after_end`).
    LateFirstByte(usize, u64),
    /// Router `.0`'s ledger delivers the deadlines due.
    Tick(usize),
}

/// What a router hears of a request: its decision (peers only), then its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Heard {
    Decided,
    /// Replica `.0` answered 200.
    Status(usize),
    /// The first byte, which came at `.0`.
    FirstByte(u64),
    End,
}

impl Heard {
    /// When what is heard happened, told at `now`: a first byte says when it came.
    fn moment(self, now: u64) -> Duration {
        Duration::from_nanos(match self {
            Heard::FirstByte(at) => at,
            _ => now,
        })
    }
}

/// One router: its decision core, its ledger, its view of the replicas and its place among the routers.
struct Router {
    core: Core,
    ledger: Ledger,
    fleet: Arc<Fleet>,
    by_slot: HashMap<u64, usize>,
    share: Share,
}

/// What a router's peers are told of a decision, to hold it as a mirror.
#[derive(Clone)]
struct Told {
    replica: usize,
    hold: Hold,
    session: Option<String>,
}

/// The simulation's state.
struct World<'a> {
    setup: &'a Setup,
    routers: Vec<Router>,
    engines: Vec<Engine>,
    jobs: HashMap<usize, Job>,
    /// The most requests one engine had at once.
    peak_in_flight: usize,
    /// The decisions peers are told of, by job, until every peer holds them.
    told: HashMap<usize, Told>,
    events: BinaryHeap<Reverse<(u64, u64, Event)>>,
    seq: u64,
    ttft: Vec<Duration>,
    /// Each first token's (queued, KV wait, prefill) nanoseconds.
    phases: Vec<[u64; 3]>,
    exact: usize,
    measured: usize,
    /// Predictions above and below the engine's cached tokens, and the tokens they were off by in all.
    over_under: (usize, usize),
    missed_by: u64,
    /// Each engine's last read load.
    reports: Vec<Report>,
    /// Leading blocks that name a prompt's root prefix, as `cost_model`
    /// names hot prefixes by default: a shared system prompt, not a
    /// template's opening tokens.
    root_blocks: usize,
    /// Requests that arrived, of those the ones the router refused, and the ones completed.
    arrived: usize,
    rejected: usize,
    completed: usize,
    /// Requests split into two legs.
    split: usize,
    /// Requests a step passed over for want of an adapter slot.
    deferred: usize,
    /// Agents' next steps waiting for their arrival, by key.
    next_steps: HashMap<usize, Arrival>,
    /// Tokenizes agents' next steps and finds prompts' turn markers.
    counter: Counter,
}

/// Runs `arrivals` through a cold fleet routed by `policy`.
pub fn simulate(setup: &Setup, policy: PolicyKind, arrivals: impl Iterator<Item = anyhow::Result<Arrival>>) -> anyhow::Result<Outcome> {
    let wall = std::time::Instant::now();
    let mut world = World::new(setup, policy)?;
    let mut first_ns = None;
    for arrival in arrivals {
        let arrival = arrival?;
        let at = arrival.at.as_nanos() as u64;
        first_ns.get_or_insert(at);
        world.run_until(at)?;
        world.arrive(arrival, at);
    }
    let end = world.run_until(u64::MAX)?;
    let (requests, rejected) = (world.arrived, world.rejected);
    let replica_hits: Vec<f64> =
        world.engines.iter().filter(|e| e.prompt_tokens > 0).map(|e| e.cached_tokens as f64 / e.prompt_tokens as f64).collect();
    let shares: Vec<f64> = world.engines.iter().map(|e| e.requests as f64 / (requests - rejected).max(1) as f64).collect();
    let (prompt, cached) = world.engines.iter().fold((0u64, 0u64), |(p, c), e| (p + e.prompt_tokens, c + e.cached_tokens));
    let min = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    Ok(Outcome {
        policy: world.routers[0].core.policy(0).to_owned(),
        replicas: setup.replicas,
        routers: (setup.routers, setup.peers),
        peak_in_flight: world.peak_in_flight,
        requests,
        rejected,
        completed: world.completed,
        prefill_replicas: setup.prefill_replicas,
        split: world.split,
        deferred: world.deferred,
        adapter_loads: world.engines.iter().map(|e| e.adapter_loads).sum(),
        host_tokens: world.engines.iter().map(|e| e.host_tokens).sum(),
        leases_at_end: world.routers.iter().flat_map(|r| &r.fleet.replicas).map(|r| r.in_flight()).sum(),
        hit_rate: if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 },
        replica_hit_rate: if replica_hits.is_empty() { (0.0, 0.0) } else { (min(&replica_hits), max(&replica_hits)) },
        busiest_share: max(&shares),
        idlest_share: if shares.is_empty() { 0.0 } else { min(&shares) },
        prefixes_per_replica: prefixes_served(world.engines.iter().map(|e| &e.roots)),
        ttft: latency::latency(std::mem::take(&mut world.ttft)),
        slowest: slowest(std::mem::take(&mut world.phases), 0.01),
        prediction_exact: if world.measured == 0 { 0.0 } else { world.exact as f64 / world.measured as f64 },
        predicted_over_under: world.over_under,
        misprediction_tokens: world.missed_by as f64 / (world.measured - world.exact).max(1) as f64,
        preemptions: world.engines.iter().map(|e| e.preemptions).sum(),
        virtual_s: end.saturating_sub(first_ns.unwrap_or(0)) as f64 * 1e-9,
        wall_s: wall.elapsed().as_secs_f64(),
    })
}

/// One router over `setup`'s replicas.
fn router(setup: &Setup, policy: PolicyKind, share: Share) -> anyhow::Result<Router> {
    let core = Core::new(&config(setup, policy))?;
    let mut by_slot = HashMap::new();
    let replicas: Vec<Arc<Replica>> = (0..setup.replicas)
        .map(|i| {
            let id = format!("sim-{i}");
            let addr = SocketAddr::from(([10, (i >> 16) as u8, (i >> 8) as u8, i as u8], 8000));
            let (latency, blocks) = setup.engine(i);
            let cache = CacheShape {
                block_size: Some(setup.block_size),
                blocks: Some(blocks),
                host_blocks: (setup.host_blocks > 0).then_some(setup.host_blocks),
            };
            let r = Arc::new(Replica::new(id.clone(), addr, vec![0], setup.limits, cache, core.kv.slot(&id)));
            r.set_role(setup.role(i));
            if !setup.mixed.is_empty() {
                r.set_prefill(Some(inferrail_policy::Prefill {
                    prefill_token_us: latency.prefill_token_us,
                    prefill_pair_ns: latency.prefill_pair_ns,
                    prefill_fixed_ms: latency.prefill_fixed_ms,
                }));
            }
            core.join(&r);
            by_slot.insert(u64::from(r.slot), i);
            r
        })
        .collect();
    Ok(Router { core, ledger: Ledger::new(setup.timing), fleet: Arc::new(Fleet::new(replicas, 1)), by_slot, share })
}

impl<'a> World<'a> {
    fn new(setup: &'a Setup, policy: PolicyKind) -> anyhow::Result<Self> {
        anyhow::ensure!(
            setup.replicas > 0
                && setup.block_size > 0
                && setup.kv_blocks > 0
                && setup.routers > 0
                && setup.mixed.iter().all(|&(s, b)| s > 0.0 && b > 0),
            "replicas, block size, KV blocks, speeds and routers must be positive"
        );
        anyhow::ensure!(
            setup.prefill_replicas == 0 || (setup.prefill_replicas < setup.replicas && setup.routers == 1),
            "a disaggregated fleet needs a decode replica, and is simulated with one router"
        );
        let routers = (0..setup.routers)
            .map(|k| {
                let share = if setup.peers { Share { rank: k as u32, of: setup.routers as u32 } } else { Share::ALONE };
                router(setup, policy, share)
            })
            .collect::<anyhow::Result<_>>()?;
        let engines = (0..setup.replicas)
            .map(|i| setup.engine(i))
            .map(|(latency, blocks)| Engine {
                latency,
                blocks,
                pool: BlockPool::new(blocks),
                queue: VecDeque::new(),
                prefilling: None,
                decoding: Vec::new(),
                preemptions: 0,
                requests: 0,
                prompt_tokens: 0,
                cached_tokens: 0,
                roots: HashMap::new(),
                slots: Vec::new(),
                adapter_loads: 0,
                host: (setup.host_blocks > 0).then(|| HostOrder::new(Some(setup.host_blocks))),
                host_tokens: 0,
            })
            .collect();
        Ok(Self {
            setup,
            routers,
            engines,
            jobs: HashMap::new(),
            told: HashMap::new(),
            peak_in_flight: 0,
            events: BinaryHeap::new(),
            seq: 0,
            ttft: Vec::new(),
            phases: Vec::new(),
            exact: 0,
            over_under: (0, 0),
            missed_by: 0,
            measured: 0,
            reports: vec![
                Report { at: Duration::ZERO, load: EngineReport { running: 0, waiting: 0, deferred: 0, kv_usage: 0.0 } };
                setup.replicas
            ],
            root_blocks: inferrail_policy::cost_model::HotPrefix::default().blocks,
            arrived: 0,
            rejected: 0,
            completed: 0,
            split: 0,
            deferred: 0,
            next_steps: HashMap::new(),
            counter: Counter::new()?,
        })
    }

    fn at(&mut self, ns: u64, event: Event) {
        self.seq += 1;
        self.events.push(Reverse((ns, self.seq, event)));
    }

    /// Handles every event up to and including `until`; returns the time of the last one.
    fn run_until(&mut self, until: u64) -> anyhow::Result<u64> {
        let mut last = 0;
        while let Some(&Reverse((ns, _, event))) = self.events.peek() {
            if ns > until {
                break;
            }
            self.events.pop();
            last = ns;
            match event {
                Event::PrefillDone(r) => self.prefill_done(r, ns),
                Event::Read(j) => self.read(j, ns),
                Event::FirstStep(j) => {
                    if let Some(r) = self.jobs.get(&j).map(|job| job.replica) {
                        self.first_token(r, j, ns);
                    }
                }
                Event::Grow(j, epoch) => self.grow(j, epoch, ns),
                Event::Complete(j, epoch) => {
                    if self.jobs.get(&j).is_some_and(|job| job.epoch == epoch) {
                        self.complete(j, ns)?;
                    }
                }
                Event::Step(k) => {
                    if let Some(a) = self.next_steps.remove(&k) {
                        self.arrive(a, ns);
                    }
                }
                Event::Peer(j, k, heard) => self.peer_heard(j, k, heard, ns),
                Event::LateStatus(j, r) => self.hear(j, Heard::Status(r), ns),
                Event::LateFirstByte(j, first) => self.hear(j, Heard::FirstByte(first), ns),
                Event::Tick(k) => {
                    let router = &self.routers[k];
                    router.ledger.tick(Duration::from_nanos(ns), &router.core, &router.fleet);
                }
            }
        }
        Ok(last)
    }

    /// Routes one arrival, counting it and whether the router refused it.
    fn arrive(&mut self, a: Arrival, now: u64) {
        let id = self.arrived;
        self.arrived += 1;
        if !self.route(a, now, id) {
            self.rejected += 1;
        }
    }

    /// Routes arrival `id` on router `id` mod routers; false when the router refused it.
    fn route(&mut self, a: Arrival, now: u64, id: usize) -> bool {
        let decider = id % self.routers.len();
        let router = &self.routers[decider];
        let agent = a.agent.map(|agent| (agent, a.ids.clone()));
        let special_at = self.counter.special_positions(&a.ids);
        let adapter = a.adapter;
        let prompt = Prompt {
            ids: a.ids,
            max_tokens: Some(a.max_tokens),
            cache_salt: None,
            adapter: adapter.map(inferrail_workload::adapter_name),
            special_at,
        };
        let prediction = router.core.prepare(0, &prompt, &router.fleet);
        let view = View {
            model: 0,
            prediction: Some(prediction.clone()),
            session: a.session.as_deref(),
            text: a.text.as_deref(),
            subset: None,
            share: router.share,
            replica_share: 1.0,
        };
        let now_d = Duration::from_nanos(now);
        self.scrape(now_d);
        let router = &self.routers[decider];
        let report = |r: &Replica| router.by_slot.get(&u64::from(r.slot)).map(|&i| self.reports[i]);
        let Ok((_, committed)) = router.core.decide(&view, &router.fleet, &report, now_d) else {
            return false;
        };
        let Some(&replica) = router.by_slot.get(&u64::from(committed.lease.replica.slot)) else {
            return false;
        };
        let key = router.ledger.insert(&id.to_string(), committed.lease.clone(), now_d);
        // A split request runs its prefill leg first, on the leg's replica;
        // what is predicted, and measured, is the prefill replica's cache.
        let (queued_on, predicted, stage) = match &committed.prefill {
            Some(leg) => {
                let Some(&p) = router.by_slot.get(&u64::from(leg.lease.replica.slot)) else { return false };
                let leg_id = router.ledger.insert_prefill(&key, leg.lease.clone(), now_d);
                self.split += 1;
                (p, leg.cached_tokens.first().copied().unwrap_or(0), Stage::Prefill { decoder: replica, leg: leg_id })
            }
            None => (replica, committed.cached_tokens.first().copied().unwrap_or(0), Stage::Whole),
        };
        self.tell_peers(id, decider, Heard::Decided, now);
        if self.setup.peers && self.routers.len() > 1 {
            self.told.insert(id, Told { replica, hold: committed.lease.hold(), session: a.session.clone() });
        }
        let job = Job {
            arrival_ns: now,
            replica: queued_on,
            prediction,
            prompt_tokens: prompt.ids.len(),
            max_tokens: a.max_tokens.max(1),
            predicted,
            blocks: Vec::new(),
            hit: 0,
            host_from: 0,
            blocked_ns: None,
            read_blocked_ns: None,
            read_wait_ns: 0,
            started_ns: 0,
            generated: 0,
            decode_from_ns: 0,
            step_ns: 0,
            epoch: 0,
            first_ns: 0,
            agent,
            stage,
            adapter,
            deferred: false,
        };
        self.jobs.insert(id, job);
        self.enqueue(queued_on, id, now);
        true
    }

    /// Queues job `j` on replica `r` and starts what it can.
    fn enqueue(&mut self, r: usize, j: usize, now: u64) {
        let engine = &mut self.engines[r];
        engine.queue.push_back(j);
        let in_flight = engine.queue.len() + usize::from(engine.prefilling.is_some()) + engine.decoding.len();
        self.peak_in_flight = self.peak_in_flight.max(in_flight);
        self.start_prefill(r, now);
    }

    /// Reads every engine's load when a scrape interval has passed since the last read.
    fn scrape(&mut self, now: Duration) {
        if self.reports.first().is_some_and(|r| now < r.at + timescale::scrape_interval(self.setup.time_scale)) {
            return;
        }
        for (report, e) in self.reports.iter_mut().zip(&self.engines) {
            let blocks = e.blocks as f64;
            let running = e.decoding.len() + usize::from(e.prefilling.is_some());
            // Waiting on an adapter slot: every slot runs another adapter.
            let active = active_adapters(&self.jobs, &e.decoding);
            let max = self.setup.max_loras;
            let slotless = |j: &&usize| max > 0 && !fits_slots(&self.jobs, **j, &active, max);
            let load = EngineReport {
                running: running as u32,
                waiting: e.queue.len() as u32,
                deferred: e.queue.iter().filter(slotless).count() as u32,
                kv_usage: (blocks - e.pool.num_free() as f64) / blocks,
            };
            *report = Report { at: now, load };
        }
    }

    /// Starts the next prefill on replica `r` if it is idle and the head of
    /// its queue has room for the tokens it computes: its prompt, and after
    /// a preemption what it had generated too (recomputed, as vLLM does).
    fn start_prefill(&mut self, r: usize, now: u64) {
        if self.setup.max_loras > 0 && !self.pick_for_slots(r) {
            return; // every request waiting needs an adapter slot: one frees at a completion
        }
        let bs = self.setup.block_size;
        let engine = &mut self.engines[r];
        let Some(&j) = engine.queue.front() else { return };
        let Some(job) = self.jobs.get(&j) else {
            engine.queue.pop_front();
            return;
        };
        if matches!(job.stage, Stage::Read { .. }) {
            self.start_read(r, j, now);
            return;
        }
        if engine.prefilling.is_some() {
            return;
        }
        let first = job.generated == 0;
        let len = job.prompt_tokens.max(1) + job.generated;
        let hashes = computed_hashes(self.setup, j, job, len);
        let engine = &mut self.engines[r];
        let Some(job) = self.jobs.get_mut(&j) else { return };
        // The last token is always computed.
        let limit = ((len - 1) / bs).min(hashes.len());
        let hit = engine.pool.lookup(&hashes[..limit]);
        // Past the GPU hit, host memory may hold more, up to the last full
        // block; those are loaded, and the rest of the prompt is stored there.
        let host = engine.host.as_ref().map_or(0, |h| h.run(&hashes[hit.len()..]));
        let cached = if len.div_ceil(bs) > engine.blocks {
            // It can never fit: computed from scratch, cached nowhere.
            0
        } else {
            let need = len.div_ceil(bs) - hit.len();
            if need + engine.pool.count_free(&hit) > engine.pool.num_free() {
                job.blocked_ns.get_or_insert(now);
                return; // waits for a completion to free blocks
            }
            engine.pool.touch(&hit);
            let Some(fresh) = engine.pool.allocate(need) else {
                job.blocked_ns.get_or_insert(now);
                return;
            };
            job.hit = hit.len();
            job.blocks = hit;
            job.blocks.extend(fresh);
            (job.hit + host) * bs
        };
        let loaded = cached.saturating_sub(job.hit * bs);
        if let Some(h) = &mut engine.host {
            // A request that loads stores only what follows, and refreshes from its first block loaded.
            let full = &hashes[..(job.prompt_tokens / bs).min(hashes.len())];
            job.host_from = if loaded > 0 { job.hit } else { 0 };
            h.sent(&full[if loaded > 0 { job.hit + host } else { 0 }.min(full.len())..]);
        }
        engine.queue.pop_front();
        engine.prefilling = Some(j);
        if first {
            job.started_ns = now;
            engine.requests += 1;
            if let Some(&root) = hashes.get(self.root_blocks - 1) {
                *engine.roots.entry(root).or_default() += 1;
            }
            engine.prompt_tokens += len as u64;
            engine.cached_tokens += cached as u64;
            engine.host_tokens += loaded as u64;
            self.measured += 1;
            self.exact += usize::from(job.predicted == cached);
            self.over_under.0 += usize::from(job.predicted > cached);
            self.over_under.1 += usize::from(job.predicted < cached);
            self.missed_by += job.predicted.abs_diff(cached) as u64;
        }
        // A loaded prompt computes at least its last token, after its load.
        let computed = len - cached.min(len - 1);
        let mut secs = engine.latency.prefill_secs(computed, len - computed) + loaded as f64 * self.setup.host_token_secs();
        if let Some(a) = job.adapter.filter(|_| self.setup.max_loras > 0) {
            let active = active_adapters(&self.jobs, &engine.decoding);
            if load_adapter(&mut engine.slots, a, &active, self.setup.max_loras) {
                engine.adapter_loads += 1;
                secs += ADAPTER_LOAD_SECS * self.setup.time_scale;
            }
        }
        self.at(now + (secs * 1e9) as u64, Event::PrefillDone(r));
    }

    /// Brings to the head of replica `r`'s queue the first request a step
    /// could run there: one without an adapter, or whose adapter runs
    /// there, or with a slot free for it. Those passed over are deferred
    /// (vLLM's scan goes on past them). False when none could run.
    fn pick_for_slots(&mut self, r: usize) -> bool {
        let engine = &mut self.engines[r];
        let active = active_adapters(&self.jobs, &engine.decoding);
        let max = self.setup.max_loras;
        let Some(i) = engine.queue.iter().position(|&j| fits_slots(&self.jobs, j, &active, max)) else {
            self.defer(r, usize::MAX);
            return false;
        };
        self.defer(r, i);
        if i > 0 {
            let engine = &mut self.engines[r];
            if let Some(j) = engine.queue.remove(i) {
                engine.queue.push_front(j);
            }
        }
        true
    }

    /// Marks the first `n` requests queued on replica `r` deferred.
    fn defer(&mut self, r: usize, n: usize) {
        for j in self.engines[r].queue.iter().take(n) {
            if let Some(job) = self.jobs.get_mut(j).filter(|job| !job.deferred) {
                job.deferred = true;
                self.deferred += 1;
            }
        }
    }

    fn prefill_done(&mut self, r: usize, now: u64) {
        let Some(j) = self.engines[r].prefilling.take() else { return };
        if let Some(job) = self.jobs.get(&j) {
            // The tokens it computed are in its blocks now: cache the full ones.
            let hashes = computed_hashes(self.setup, j, job, job.prompt_tokens + job.generated);
            let engine = &mut self.engines[r];
            let Some(job) = self.jobs.get_mut(&j) else { return };
            cache_blocks(&mut engine.pool, &job.blocks, &hashes, job.hit);
            match std::mem::replace(&mut job.stage, Stage::Whole) {
                Stage::Prefill { decoder, leg } => {
                    // The prefill leg's answer: the replica keeps the blocks
                    // for the decoder, which queues the request to read them.
                    let kept = std::mem::take(&mut job.blocks);
                    job.hit = 0;
                    job.stage = Stage::Read { prefill: r, kept };
                    job.replica = decoder;
                    self.hear_leg(j, &leg, r, now);
                    self.enqueue(decoder, j, now);
                }
                stage => {
                    job.stage = stage;
                    self.first_token(r, j, now);
                }
            }
        }
        self.start_prefill(r, now);
    }

    /// Job `j` has its next token on replica `r` (from a prefill, or a split
    /// request's first step after its read); the rest come a decode step
    /// apart. Its first is its time to first token, and what the router hears.
    fn first_token(&mut self, r: usize, j: usize, now: u64) {
        let engine = &mut self.engines[r];
        let Some(job) = self.jobs.get_mut(&j) else { return };
        let first = job.generated == 0;
        if first {
            job.first_ns = now;
            self.ttft.push(Duration::from_nanos(now - job.arrival_ns));
            // A split request's wait for room on its decoder is a KV wait too.
            let kv_wait = job.blocked_ns.map_or(0, |b| job.started_ns - b);
            let queued = job.started_ns - job.arrival_ns - kv_wait;
            self.phases.push([queued, kv_wait + job.read_wait_ns, now - job.started_ns - job.read_wait_ns]);
        }
        job.generated += 1;
        engine.decoding.push(j);
        job.decode_from_ns = now;
        job.step_ns = (engine.latency.decode_secs(engine.decoding.len()) * 1e9) as u64;
        self.next_step_event(j, now);
        if first {
            if self.setup.status_after_end.is_none() {
                self.hear(j, Heard::Status(r), now);
            }
            if self.setup.first_byte_after_end.is_none() {
                self.hear(j, Heard::FirstByte(now), now);
            }
        }
    }

    /// Job `j`, a split request at the head of decoder `r`'s queue, takes
    /// blocks there for its prompt (those the decoder caches are hits) and
    /// reads the rest from its prefill replica, at the decoder's transfer
    /// time a block; the queue goes on meanwhile. Without room it waits,
    /// holding up the queue, as a prefill does.
    fn start_read(&mut self, r: usize, j: usize, now: u64) {
        let bs = self.setup.block_size;
        let Some(job) = self.jobs.get(&j) else { return };
        let len = job.prompt_tokens.max(1);
        let hashes = computed_hashes(self.setup, j, job, len);
        let engine = &mut self.engines[r];
        let Some(job) = self.jobs.get_mut(&j) else { return };
        let total = len.div_ceil(bs);
        let mut lacking = total;
        if total <= engine.blocks {
            let hit = engine.pool.lookup(&hashes);
            let need = total - hit.len();
            if need + engine.pool.count_free(&hit) > engine.pool.num_free() {
                job.read_blocked_ns.get_or_insert(now);
                return; // waits for a completion to free blocks
            }
            engine.pool.touch(&hit);
            let Some(fresh) = engine.pool.allocate(need) else { return };
            job.read_wait_ns = job.read_blocked_ns.map_or(0, |b| now - b);
            job.hit = hit.len();
            job.blocks = hit;
            job.blocks.extend(fresh);
            lacking = need;
        }
        engine.queue.pop_front();
        engine.requests += 1;
        let read_ns = (engine.latency.transfer_block_us * 1e3 * lacking as f64) as u64;
        self.at(now + read_ns, Event::Read(j));
        self.start_prefill(r, now);
    }

    /// Job `j` has read its blocks: its prefill replica lets go of them
    /// (they stay cached there), its decoder caches them, and its first
    /// token comes one decode step later.
    fn read(&mut self, j: usize, now: u64) {
        let Some(job) = self.jobs.get(&j) else { return };
        let hashes = computed_hashes(self.setup, j, job, job.prompt_tokens);
        let Some(job) = self.jobs.get_mut(&j) else { return };
        let Stage::Read { prefill, kept } = std::mem::replace(&mut job.stage, Stage::Whole) else { return };
        let d = job.replica;
        cache_blocks(&mut self.engines[d].pool, &job.blocks, &hashes, job.hit);
        self.engines[prefill].pool.release(kept.into_iter().rev());
        let engine = &self.engines[d];
        let step = engine.latency.decode_secs(engine.decoding.len() + 1);
        self.at(now + (step * 1e9) as u64, Event::FirstStep(j));
        self.start_prefill(prefill, now);
    }

    /// Schedules what job `j` does next as it decodes: take a block when its
    /// tokens outgrow its blocks, else complete after its last token (a
    /// decode step after it, as the first run of steps always did).
    fn next_step_event(&mut self, j: usize, now: u64) {
        let bs = self.setup.block_size;
        let Some(job) = self.jobs.get(&j) else { return };
        let len = job.prompt_tokens.max(1);
        let fits = len.div_ceil(bs) <= self.engines[job.replica].blocks;
        // The step that makes token g + 1 computes the KV of the first len + g tokens.
        let grows_at = (job.blocks.len() * bs + 1).saturating_sub(len);
        let at_step = |g: usize| job.decode_from_ns + (g.saturating_sub(job.generated) as u64) * job.step_ns;
        let event = if fits && grows_at < job.max_tokens {
            (at_step(grows_at).max(now), Event::Grow(j, job.epoch))
        } else {
            (job.completes_at(), Event::Complete(j, job.epoch))
        };
        self.at(event.0, event.1);
    }

    /// Job `j` needs a block for its next token: it takes a free one, or
    /// the newest decoding job is preempted (freed, its tokens to be
    /// recomputed when it reaches the head of the queue again, which it
    /// rejoins first), as vLLM's scheduler does; that may be `j` itself.
    fn grow(&mut self, j: usize, epoch: u32, now: u64) {
        let Some(job) = self.jobs.get_mut(&j).filter(|job| job.epoch == epoch) else { return };
        let r = job.replica;
        job.generated = job.generated_by(now);
        job.decode_from_ns = now;
        loop {
            let engine = &mut self.engines[r];
            if let Some(block) = engine.pool.allocate(1) {
                if let Some(job) = self.jobs.get_mut(&j) {
                    job.blocks.extend(block);
                }
                break;
            }
            // The newest still decoding: one that has its last token only waits to complete.
            let jobs = &self.jobs;
            let decoding = |d: &&usize| **d == j || jobs.get(*d).is_some_and(|x| x.generated_by(now) < x.max_tokens);
            let Some(&victim) = engine.decoding.iter().rev().find(decoding) else { break };
            if victim == j && engine.decoding.iter().filter(decoding).count() == 1 {
                // Alone and out of room: nothing to free but itself, so it goes on short of a block.
                break;
            }
            self.preempt(r, victim, now);
            if victim == j {
                self.start_prefill(r, now);
                return;
            }
        }
        let Some(job) = self.jobs.get(&j) else { return };
        if job.blocks.len() * self.setup.block_size < job.prompt_tokens + job.generated {
            // Short of a block: it completes without another.
            let event = (job.completes_at(), Event::Complete(j, job.epoch));
            self.at(event.0, event.1);
        } else {
            self.next_step_event(j, now);
        }
        self.start_prefill(r, now);
    }

    /// Preempts job `v` on replica `r`: what it computed is cached (full
    /// blocks), its blocks are freed, last first, and it waits at the head
    /// of the queue to recompute them.
    fn preempt(&mut self, r: usize, v: usize, now: u64) {
        let Some(job) = self.jobs.get(&v) else { return };
        let generated = job.generated_by(now);
        // The last token generated has no KV yet.
        let hashes = computed_hashes(self.setup, v, job, job.prompt_tokens + generated.saturating_sub(1));
        let engine = &mut self.engines[r];
        let Some(job) = self.jobs.get_mut(&v) else { return };
        cache_blocks(&mut engine.pool, &job.blocks, &hashes, job.hit);
        engine.pool.release(job.blocks.drain(..).rev());
        job.hit = 0;
        job.generated = generated;
        job.epoch += 1;
        engine.decoding.retain(|&d| d != v);
        engine.queue.push_front(v);
        engine.preemptions += 1;
    }

    fn complete(&mut self, j: usize, now: u64) -> anyhow::Result<()> {
        let Some(job) = self.jobs.get(&j) else { return Ok(()) };
        // Every token but the last was computed, and each full block cached as it filled.
        let hashes = computed_hashes(self.setup, j, job, job.prompt_tokens + job.max_tokens - 1);
        let Some(job) = self.jobs.remove(&j) else { return Ok(()) };
        self.completed += 1;
        let engine = &mut self.engines[job.replica];
        cache_blocks(&mut engine.pool, &job.blocks, &hashes, job.hit);
        if let Some(h) = &mut engine.host {
            let full = &hashes[..(job.prompt_tokens / self.setup.block_size).min(hashes.len())];
            h.finished(&full[job.host_from.min(full.len())..]);
        }
        let next = match job.agent {
            Some((agent, _)) => {
                let reply = agent.reply(job.max_tokens);
                agent.next(&reply, Duration::from_nanos(now), &self.counter).transpose()?
            }
            None => None,
        };
        engine.pool.release(job.blocks.iter().rev().copied());
        engine.decoding.retain(|&d| d != j);
        let replica = job.replica;
        self.hear(j, Heard::End, now);
        if let Some(after) = self.setup.first_byte_after_end {
            self.at(now + after.as_nanos() as u64, Event::LateFirstByte(j, job.first_ns));
        }
        if let Some(after) = self.setup.status_after_end {
            self.at(now + after.as_nanos() as u64, Event::LateStatus(j, replica));
            // Every router's ledger ends what it holds of the job once its grace is over.
            let due = now + self.setup.timing.grace.as_nanos() as u64 + 1 + self.setup.peer_delay.as_nanos() as u64;
            for k in 0..self.routers.len() {
                self.at(due, Event::Tick(k));
            }
        }
        self.start_prefill(replica, now);
        if let Some(step) = next {
            self.at(step.at.as_nanos() as u64, Event::Step(j));
            self.next_steps.insert(j, step);
        }
        Ok(())
    }

    /// Job `j`'s decider hears `heard` at `now` in its ledger, and tells its peers.
    fn hear(&mut self, j: usize, heard: Heard, now: u64) {
        let decider = j % self.routers.len();
        let Some(event) = self.event(heard) else { return };
        let router = &self.routers[decider];
        let at = heard.moment(now);
        let leg = router.ledger.hear(&j.to_string(), at, event, &router.core, &router.fleet).and_then(|h| h.prefill);
        if let Some(leg) = leg
            && let Some(event) = prefill_leg_event(event, false)
        {
            router.ledger.hear(&leg, at, event, &router.core, &router.fleet);
        }
        self.tell_peers(j, decider, heard, now);
    }

    /// Job `j`'s router hears its prefill leg (`leg`) answered by replica
    /// `r` at `now`: as it comes, for the router sent it.
    fn hear_leg(&mut self, j: usize, leg: &str, r: usize, now: u64) {
        let router = &self.routers[j % self.routers.len()];
        let key = router.fleet.replicas[r].key;
        for event in [lifecycle::Event::Status { code: 200, served_by: Some(key) }, lifecycle::Event::FirstByte] {
            router.ledger.hear(leg, Duration::from_nanos(now), event, &router.core, &router.fleet);
        }
    }

    /// What `heard` is as an event of a request's life (the decision is none).
    fn event(&self, heard: Heard) -> Option<lifecycle::Event> {
        Some(match heard {
            Heard::Decided => return None,
            // Every router names a replica by the same key (its id's hash).
            Heard::Status(r) => lifecycle::Event::Status { code: 200, served_by: Some(self.routers[0].fleet.replicas[r].key) },
            Heard::FirstByte(_) => lifecycle::Event::FirstByte,
            Heard::End => lifecycle::Event::End,
        })
    }

    /// Tells every peer of router `decider` what it heard of job `j`, `peer_delay` from `now`.
    fn tell_peers(&mut self, j: usize, decider: usize, heard: Heard, now: u64) {
        if !self.setup.peers {
            return;
        }
        let at = now + self.setup.peer_delay.as_nanos() as u64;
        for k in (0..self.routers.len()).filter(|&k| k != decider) {
            self.at(at, Event::Peer(j, k, heard));
        }
    }

    /// Router `k` hears of job `j`, which another decided: it holds it as a
    /// mirror in its ledger (slot, queued prefill, KV record), and its
    /// ledger runs the mirror's life on what the decider heard.
    fn peer_heard(&mut self, j: usize, k: usize, heard: Heard, now: u64) {
        let decider = j % self.routers.len();
        let at = heard.moment(now);
        let router = &self.routers[k];
        match self.event(heard) {
            None => {
                let Some(told) = self.told.get(&j) else { return };
                let replica = &router.fleet.replicas[told.replica];
                let lease = router.core.mirror(0, replica, &told.hold, told.session.as_deref(), at);
                router.ledger.mirror(decider as u64, &j.to_string(), lease, at);
                // Every peer is told at the same instant, in router order: the last one lets go of it.
                if (0..self.routers.len()).rev().find(|&p| p != decider) == Some(k) {
                    self.told.remove(&j);
                }
            }
            Some(event) => {
                router.ledger.hear(&mirror_id(decider as u64, &j.to_string()), at, event, &router.core, &router.fleet);
            }
        }
    }
}

/// How long an engine takes to bring an adapter into a slot, at time scale
/// 1: the simulator's defaults, read and copied (host memory holds as many
/// as the slots, vLLM's default, so a slot miss is a read too).
const ADAPTER_LOAD_SECS: f64 = (LORA_LOAD_MS + LORA_SLOT_MS) * 1e-3;

/// The adapters of the requests `decoding`.
fn active_adapters(jobs: &HashMap<usize, Job>, decoding: &[usize]) -> HashSet<usize> {
    decoding.iter().filter_map(|d| jobs.get(d)?.adapter).collect()
}

/// Whether request `j` could run in a step beside the `active` adapters,
/// `max` at most: it has no adapter, or its adapter runs, or a slot is free.
fn fits_slots(jobs: &HashMap<usize, Job>, j: usize, active: &HashSet<usize>, max: usize) -> bool {
    jobs.get(&j).and_then(|job| job.adapter).is_none_or(|a| active.contains(&a) || active.len() < max)
}

/// Puts adapter `a` in `slots` (least recently used first), evicting the
/// least recently used not `active` when all `max` are taken; true when it
/// had to be loaded.
fn load_adapter(slots: &mut Vec<usize>, a: usize, active: &HashSet<usize>, max: usize) -> bool {
    if let Some(i) = slots.iter().position(|&s| s == a) {
        slots.remove(i);
        slots.push(a);
        return false;
    }
    if slots.len() >= max
        && let Some(i) = slots.iter().position(|s| !active.contains(s))
    {
        slots.remove(i);
    }
    slots.push(a);
    true
}

/// Caches `blocks` from the `from`-th on under `hashes`, as far as both go
/// (a block cached already keeps its name).
fn cache_blocks(pool: &mut BlockPool, blocks: &[BlockId], hashes: &[BlockHash], from: usize) {
    for (&block, &hash) in blocks.iter().zip(hashes).skip(from) {
        pool.register(block, hash);
    }
}

/// The names of the full blocks of job `j`'s first `tokens` tokens (prompt,
/// then generated): the prompt's own, then an agent's reply's (its next
/// step resends them), or names no prompt asks for again.
fn computed_hashes(setup: &Setup, j: usize, job: &Job, tokens: usize) -> Vec<BlockHash> {
    let bs = setup.block_size;
    let mut hashes = job.prediction.blocks(bs).unwrap_or_default().to_vec();
    hashes.truncate(tokens / bs);
    let generated = tokens.saturating_sub(job.prompt_tokens);
    if generated == 0 {
        return hashes;
    }
    match &job.agent {
        Some((agent, ids)) => {
            let reply = inferrail_tokenize::sim::encode(&agent.reply(job.max_tokens));
            let mut ids = ids.clone();
            ids.extend_from_slice(&reply[..generated.min(reply.len())]);
            extend_block_hashes(&mut hashes, seed(&setup.model, None), &ids, bs);
        }
        None => hashes.extend((job.prompt_tokens / bs..tokens / bs).map(|k| GENERATED | (j as BlockHash) << 32 | k as BlockHash)),
    }
    hashes
}
