//! `cost_model`: the lowest estimated time to first token, inside load guards.
//!
//! For each candidate the estimate is `W + P(u, c)`: `W` is the prefill the
//! router has queued there plus `decode_interference_ms` per running request
//! (the engine's count while its report is fresh), and `P(u, c) = a*u +
//! b*u*(c + u/2) + d` ([`crate::Prefill`], the replica's own when its
//! engine was calibrated apart, as in a mixed fleet) prices the `u` prompt
//! tokens it would compute after the `c` it holds. To that is added, for a replica
//! that took more than its fair share (`1 / n`) of the recent requests
//! (counted in a decaying sketch over `hot_prefix.window_secs`, once there
//! are at least `MIN_SHARE_EVIDENCE` per replica), `share_weight` times the
//! prompt's whole prefill `P(n, 0)` per fair share above one: a replica
//! twice as busy as fair must save more than the prompt's whole prefill to
//! win, so a holder keeps its prefix against a miss unless it is far over
//! its share, ties among holders go to the least busy, and new prefixes go
//! where there is room. Lowest wins; ties go to fewer requests in flight,
//! then by the prompt ([`crate::order`]).
//!
//! Offloaded tokens (ADR 0059): the `o` prompt tokens a replica's engine
//! holds right after its GPU prefix in host memory or on disk are loaded,
//! not computed, so the prefill is `P(u - o, c + o)` and the load `X` is
//! added: each tier's tokens at its `offload` time per token. vLLM loads
//! every such hit whatever it costs, so `X` is priced as the engine will
//! pay it; a tier slower than recomputing makes its replica lose.
//!
//! Guards, before scoring:
//! - bounded load: never a replica that would hold more than
//!   `ceil((1 + epsilon) * (in_flight + 1) / n)` requests, `in_flight` summed
//!   over the `n` offered replicas (consistent hashing with bounded loads;
//!   the least loaded always qualifies);
//! - KV pressure: never a replica whose engine reports more than `kappa` of
//!   its KV cache in use, or fewer free tokens than the prompt takes (it
//!   would wait for running requests to finish before it starts, and hold
//!   up every request queued behind it; the cached blocks it reuses leave
//!   the free pool too, but for those a request in flight holds), for a
//!   prompt with more than `short_prompt_tokens` to compute there, unless
//!   it holds most of the prompt (it would compute at most a quarter as
//!   many tokens as every replica not under pressure) or every remaining
//!   replica is in that state. Pressure never turns a hit into a miss: the
//!   miss would take more KV room elsewhere; a few shared blocks, or half
//!   the prompt, are not worth the wait.
//!
//! Copies (off by default: `copy_weight` 0, ADR 0019): when some replica
//! holds the request's root prefix, one without it that was sent another
//! root within `hot_prefix.window_secs` is charged `copy_weight` times the
//! prefill of what it would compute. Its cache serves that other prefix,
//! and a copy there evicts it or squeezes the requests running on it; an
//! idle replica is not charged, nor is any for a root nobody holds (a first
//! copy, or a prompt shared with none). Without the charge a miss next to a
//! holder still computing its first copy looks as cheap as waiting for it,
//! and early copies leave replicas holding two prefixes that each keep
//! hitting. The same charge delays the copies a hot prompt needs, and on
//! three replicas those waits made hot traffic's tail. The roots sent to
//! each replica are tracked either way: hot copies look at them too.
//!
//! Hot prefixes: the requests for each root prefix (its first
//! `hot_prefix.blocks` blocks) and for all of them are counted in a decaying
//! count-min sketch ([`crate::sketch`]). A root asked for by more than
//! `hot_prefix.fair_shares` times one replica's share of the requests (`1 /
//! n`) gets `ceil(share * n / fair_shares)` owners: when fewer replicas hold
//! it and every holder takes more than `fair_shares` of the requests and
//! is serving one now, the least loaded others are priced as if they held
//! it too, so its load spreads by queue and share. A root whose holders keep up stays put:
//! copying a prefix evicts others, and on a busy fleet that cascades. So
//! does a prompt whose shared part would take more than
//! `hot_prefix.max_cache_share` of a replica's KV cache (a long context),
//! or would not fit in it beside the other prompt last sent there within
//! the window: its copy would evict what that replica serves.
//!
//! Session affinity (off by default): a request naming its conversation goes
//! back to the conversation's last replica while the guards allow it.

use std::num::NonZeroUsize;
use std::sync::Mutex;
use std::time::Duration;

use lru::LruCache;
use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

use crate::sketch::Sketch;
use crate::{AdapterFit, Candidate, Offloaded, Prefill, Request, RoutingPolicy, Score, SetAside};

/// `cost_model` parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Config {
    /// Time a running request adds to a new request's first token, milliseconds.
    pub decode_interference_ms: f64,
    /// Bounded load: a replica holds at most `1 + epsilon` times its share.
    pub epsilon: f64,
    /// Charged per fair share (`1 / n`) of recent requests above one, in whole prefills of the prompt.
    pub share_weight: f64,
    /// KV pressure: reported KV usage above which long uncached prompts go elsewhere.
    pub kappa: f64,
    /// KV pressure spares prompts with at most this many tokens to compute.
    pub short_prompt_tokens: usize,
    /// Send a conversation back to its last replica while the guards allow.
    pub session_affinity: bool,
    /// Conversations remembered for affinity (least recent forgotten first).
    pub sessions: usize,
    /// Charged, in prefills of what it would compute, to a replica without the root prefix that serves another (off by default, ADR 0019).
    pub copy_weight: f64,
    /// Hot prefix replication.
    pub hot_prefix: HotPrefix,
    /// LoRA adapters: their load and the wait for a slot.
    pub adapters: Adapters,
    /// Loading offloaded KV: time per token from each tier.
    pub offload: Offload,
}

/// How long loading a prompt token's KV from an offload tier takes, on the
/// engine's copy stream beside its steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Offload {
    /// From host memory, microseconds per token: an 8B model's 128 KiB a
    /// token over 25 GB/s (PCIe 4.0 x16).
    pub host_token_us: f64,
    /// From disk or remote storage, microseconds per token: the same over
    /// 2.5 GB/s (one NVMe drive).
    pub disk_token_us: f64,
    /// Price offloaded tokens at all; without, they are computed as far as
    /// the estimate knows (the GPU-only cost model, for comparisons).
    pub aware: bool,
}

impl Default for Offload {
    fn default() -> Self {
        Self { host_token_us: 5.24, disk_token_us: 52.4, aware: true }
    }
}

impl Offload {
    /// Seconds to load `o`.
    pub fn secs(&self, o: Offloaded) -> f64 {
        (self.host_token_us * o.host as f64 + self.disk_token_us * o.disk as f64) * 1e-6
    }

    /// What the estimate counts of `c`'s offloaded tokens.
    fn of(&self, c: &Candidate) -> Offloaded {
        if self.aware { c.offloaded } else { Offloaded::default() }
    }
}

/// What a request's LoRA adapter adds to its first token on a replica
/// where it is not running.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Adapters {
    /// Bringing it into a slot (a read from disk and a copy), milliseconds.
    pub load_ms: f64,
    /// Waiting for a slot when the model's `max_loras` other adapters run
    /// there: until one of them has no request left, milliseconds. A coarse
    /// stand-in for the forecast of when those requests end: a whole
    /// 256-token answer at 20 ms a token, since a slot frees only when the
    /// last of an adapter's requests in flight ends. Adapters waiting there
    /// already (more others in flight than slots) are served first: each
    /// adds one such wait.
    pub slot_wait_ms: f64,
    /// Taking a replica's last free slot: this share of `slot_wait_ms`,
    /// for the next other adapter sent there, which must then wait.
    pub last_slot_share: f64,
}

impl Default for Adapters {
    fn default() -> Self {
        Self { load_ms: 55.0, slot_wait_ms: 5120.0, last_slot_share: 0.5 }
    }
}

impl Adapters {
    /// Seconds the adapter adds on a replica where it stands as `fit`.
    pub fn secs(&self, fit: Option<AdapterFit>) -> f64 {
        match fit {
            Some(f) if !f.resident => {
                let last = f.max_loras.is_some_and(|m| f.others + 1 == m);
                let wait = if let Some(ahead) = f.ahead() {
                    self.slot_wait_ms * (1 + ahead) as f64
                } else if last {
                    self.last_slot_share * self.slot_wait_ms
                } else {
                    0.0
                };
                (self.load_ms + wait) * 1e-3
            }
            _ => 0.0,
        }
    }
}

/// Hot prefix replication parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct HotPrefix {
    /// Replicate hot prefixes at all.
    pub enabled: bool,
    /// Leading blocks that make a root prefix.
    pub blocks: usize,
    /// Seconds over which demand is averaged (the sketch's decay).
    pub window_secs: f64,
    /// Fair shares of the requests (one replica's, `1 / n`) a root may take before it gets another owner.
    pub fair_shares: f64,
    /// The most of a replica's KV cache a copy may take: a prompt whose
    /// shared prefix is longer is not copied for being hot (ADR 0043).
    pub max_cache_share: f64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            decode_interference_ms: 0.06,
            epsilon: 1.5,
            share_weight: 1.0,
            kappa: 0.92,
            short_prompt_tokens: 256,
            session_affinity: false,
            sessions: 100_000,
            copy_weight: 0.0,
            hot_prefix: HotPrefix::default(),
            adapters: Adapters::default(),
            offload: Offload::default(),
        }
    }
}

impl Default for HotPrefix {
    fn default() -> Self {
        Self { enabled: true, blocks: 16, window_secs: 60.0, fair_shares: 1.0, max_cache_share: 0.6 }
    }
}

impl Config {
    pub(crate) fn validate(&self, at: &str, p: &mut Vec<String>) {
        let h = &self.hot_prefix;
        let non_negative = [
            ("decode_interference_ms", self.decode_interference_ms),
            ("epsilon", self.epsilon),
            ("share_weight", self.share_weight),
            ("copy_weight", self.copy_weight),
            ("adapters.load_ms", self.adapters.load_ms),
            ("adapters.slot_wait_ms", self.adapters.slot_wait_ms),
            ("offload.host_token_us", self.offload.host_token_us),
            ("offload.disk_token_us", self.offload.disk_token_us),
        ];
        for (name, v) in non_negative {
            if !(v.is_finite() && v >= 0.0) {
                p.push(format!("{at}.{name}: {v} is not a non-negative number"));
            }
        }
        if !(0.0..=1.0).contains(&self.adapters.last_slot_share) {
            p.push(format!("{at}.adapters.last_slot_share: {} is not in [0, 1]", self.adapters.last_slot_share));
        }
        if !(self.kappa > 0.0 && self.kappa <= 1.0) {
            p.push(format!("{at}.kappa: {} is not in (0, 1]", self.kappa));
        }
        if self.sessions == 0 {
            p.push(format!("{at}.sessions: must be at least 1"));
        }
        if h.blocks == 0 {
            p.push(format!("{at}.hot_prefix.blocks: must be at least 1"));
        }
        if !(h.window_secs.is_finite() && h.window_secs > 0.0) {
            p.push(format!("{at}.hot_prefix.window_secs: {} is not a positive number", h.window_secs));
        }
        if !(h.fair_shares.is_finite() && h.fair_shares > 0.0) {
            p.push(format!("{at}.hot_prefix.fair_shares: {} is not a positive number", h.fair_shares));
        }
        if !(h.max_cache_share > 0.0 && h.max_cache_share <= 1.0) {
            p.push(format!("{at}.hot_prefix.max_cache_share: {} is not in (0, 1]", h.max_cache_share));
        }
    }
}

/// A replica short of KV room keeps a long prompt only when every replica
/// with room would compute at least this many times as many of its tokens:
/// a smaller saving is not worth waiting for running requests to finish.
const HIT_SAVES: usize = 4;

/// Recent requests per replica before shares count: fewer say nothing of load.
const MIN_SHARE_EVIDENCE: f64 = 4.0;

/// Replicas whose recent roots are remembered (least recently sent to forgotten first).
const REPLICAS_REMEMBERED: NonZeroUsize = NonZeroUsize::new(4_096).unwrap();

/// The two most recent distinct root prefixes sent to a replica, each with
/// when it was last sent there: enough to tell whether it served a root
/// other than a given one since some time.
#[derive(Debug, Clone, Copy)]
struct Roots {
    last: Sent,
    before: Option<Sent>,
}

/// A root sent to a replica: when, and the prompt's tokens (what its
/// cache holds of that root afterwards).
#[derive(Debug, Clone, Copy)]
struct Sent {
    root: u128,
    at: Duration,
    tokens: usize,
}

impl Roots {
    fn sent(&mut self, sent: Sent) {
        if self.last.root != sent.root {
            self.before = Some(self.last);
        }
        self.last = sent;
    }

    /// The latest root other than `root` sent there at or after `since`.
    fn other_since(&self, root: u128, since: Duration) -> Option<Sent> {
        let other = if self.last.root != root { Some(self.last) } else { self.before };
        other.filter(|o| o.at >= since)
    }
}

/// See the module doc.
#[derive(Debug)]
pub struct CostModel {
    config: Config,
    prefill: Prefill,
    demand: Mutex<Sketch>,
    /// Requests each replica took recently, by key.
    taken: Mutex<Sketch>,
    sessions: Mutex<LruCache<String, u64>>,
    /// Roots each replica was sent recently, by key.
    roots: Mutex<LruCache<u64, Roots>>,
}

impl CostModel {
    /// With its parameters and the engine's prefill cost.
    pub fn new(config: Config, prefill: Prefill) -> Self {
        let half_life = Duration::from_secs_f64(config.hot_prefix.window_secs * std::f64::consts::LN_2);
        let sessions = NonZeroUsize::new(config.sessions).unwrap_or(NonZeroUsize::MIN);
        Self {
            config,
            prefill,
            demand: Mutex::new(Sketch::new(half_life)),
            taken: Mutex::new(Sketch::new(half_life)),
            sessions: Mutex::new(LruCache::new(sessions)),
            roots: Mutex::new(LruCache::new(REPLICAS_REMEMBERED)),
        }
    }

    /// The root prefix of a request and its tokens, when it has one.
    fn root(&self, req: &Request) -> Option<(u128, usize)> {
        let h = &self.config.hot_prefix;
        let last = req.blocks.get(h.blocks.checked_sub(1)?)?;
        h.enabled.then_some((*last, h.blocks * req.block_size))
    }

    /// Owners the request's root prefix needs now among `n` replicas (1 when it is not hot).
    fn owners(&self, root: u128, n: usize) -> usize {
        let h = &self.config.hot_prefix;
        let sketch = self.demand.lock().unwrap_or_else(|p| p.into_inner());
        let total = sketch.total();
        let shares = if total > 0.0 { sketch.estimate(root) / total * n as f64 } else { 0.0 };
        if shares > h.fair_shares { (shares / h.fair_shares).ceil() as usize } else { 1 }
    }

    /// The estimated time to first token of a prompt on `c`, as if it held
    /// `cached` tokens on the GPU and then `offloaded` in other tiers.
    fn estimate(&self, c: &Candidate, prompt: Option<usize>, cached: usize, offloaded: Offloaded) -> Score {
        let queue = c.queued_prefill_secs;
        let decode = self.config.decode_interference_ms * 1e-3 * f64::from(c.running());
        let prefill = c.prompt_prefill_secs(self.prefill, prompt, cached + offloaded.tokens());
        let adapter = self.config.adapters.secs(c.adapter);
        let load = self.config.offload.secs(offloaded);
        Score { total: queue + decode + prefill + adapter + load, terms: [queue, decode, prefill, 0.0, 0.0, 0.0, adapter, load] }
    }
}

impl RoutingPolicy for CostModel {
    fn name(&self) -> &'static str {
        "cost_model"
    }

    fn terms(&self) -> &'static [&'static str] {
        &["queue", "decode", "prefill", "hot_credit", "share", "copy", "adapter", "offload"]
    }

    fn guard(&self, req: &Request, c: &[Candidate], aside: &mut [Option<SetAside>]) -> Option<&'static str> {
        let (n, total) = c
            .iter()
            .zip(aside.iter())
            .filter(|(_, a)| a.is_none())
            .fold((0u64, 0u64), |(n, t), (x, _)| (n + 1, t + u64::from(x.in_flight)));
        if n == 0 {
            return None;
        }
        let cap = ((1.0 + self.config.epsilon) * (total + 1) as f64 / n as f64).ceil() as u32;
        for (x, a) in c.iter().zip(aside.iter_mut()) {
            if a.is_none() && x.in_flight + 1 > cap {
                *a = Some(SetAside::BoundedLoad { cap });
            }
        }
        let prompt = req.prompt_tokens?;
        // Tokens the prompt would take new KV blocks for on a replica:
        // offloaded ones too, since they are loaded into fresh blocks.
        let new = |x: &Candidate| prompt.saturating_sub(x.cached_tokens);
        let long = |x: &Candidate| new(x) > self.config.short_prompt_tokens;
        // Above kappa, or without free room for the prompt (it would wait
        // for running requests to finish): its cached blocks leave the free
        // pool too, but for those a request in flight holds.
        let full = |x: &Candidate| {
            let e = x.engine?;
            if e.kv_usage > self.config.kappa {
                return Some(SetAside::KvPressure { usage: e.kv_usage });
            }
            let need = prompt.saturating_sub(x.held_cached_tokens) as u64;
            x.free_kv_tokens().filter(|&free| need > free).map(|free| SetAside::KvRoom { free_tokens: free })
        };
        let remaining = || c.iter().zip(aside.iter()).filter(|(_, a)| a.is_none()).map(|(x, _)| x);
        // Not under pressure somewhere: the fewest tokens such a replica computes.
        let Some(fewest) = remaining().filter(|x| full(x).is_none()).map(new).min() else {
            return remaining().any(&long).then_some("kv_waived");
        };
        // Pressure never turns a hit into a miss: a full replica that would
        // compute at most a quarter of the tokens every other computes
        // stays, since computing them elsewhere takes more KV room there
        // (and, on a small fleet, evicts another prefix that will be asked
        // for). A smaller saving is not worth waiting for room.
        for (x, a) in c.iter().zip(aside.iter_mut()) {
            if a.is_none()
                && long(x)
                && new(x) * HIT_SAVES > fewest
                && let Some(why) = full(x)
            {
                *a = Some(why);
            }
        }
        None
    }

    fn score(&self, req: &Request, c: &[Candidate], offered: &[usize], _rng: &mut StdRng, out: &mut [Score]) -> Option<&'static str> {
        // The share term: what keeps each replica's part of the requests,
        // and of the decoding they bring, near its fair one.
        let shares: Vec<f64> = {
            let taken = self.taken.lock().unwrap_or_else(|p| p.into_inner());
            let total = taken.total();
            let n = offered.len() as f64;
            let known = total >= MIN_SHARE_EVIDENCE * n;
            offered.iter().map(|&i| if known { taken.estimate(u128::from(c[i].key)) / total * n } else { 0.0 }).collect()
        };
        let share: Vec<f64> = offered
            .iter()
            .zip(&shares)
            .map(|(&i, s)| {
                let whole = req.prompt_tokens.map_or(0.0, |n| c[i].prefill_secs(self.prefill, n, 0));
                self.config.share_weight * whole * (s - 1.0).max(0.0)
            })
            .collect();
        for (s, &i) in out.iter_mut().zip(offered) {
            *s = self.estimate(&c[i], req.prompt_tokens, c[i].cached_tokens, self.config.offload.of(&c[i]));
        }
        if let Some((root, root_tokens)) = self.root(req) {
            // Roots sent within the window are the ones a replica serves.
            let since = req.now.saturating_sub(Duration::from_secs_f64(self.config.hot_prefix.window_secs));
            // The copy term, for a root held somewhere, before the hot
            // credit: a credited replica is priced as a holder.
            let holders = offered.iter().filter(|&&i| c[i].cached_tokens >= root_tokens).count();
            if self.config.copy_weight > 0.0 && holders > 0 {
                let roots = self.roots.lock().unwrap_or_else(|p| p.into_inner());
                for (s, &i) in out.iter_mut().zip(offered) {
                    if c[i].cached_tokens < root_tokens && roots.peek(&c[i].key).is_some_and(|r| r.other_since(root, since).is_some()) {
                        let copy = self.config.copy_weight * s.terms[2];
                        s.terms[5] = copy;
                        s.total += copy;
                    }
                }
            }
            let owners = self.owners(root, offered.len()).min(offered.len());
            // A hot root held somewhere: the least loaded replicas without it
            // (queue, decode and share) are priced as if they held it too, up
            // to its owners. A root nobody holds, or one that is not hot, is
            // priced as it is.
            // Only while every holder takes more than its fair share and
            // is serving a request now: a root whose holders keep up stays
            // where it is cached, and an idle holder serves the next
            // request at once.
            let fair = self.config.hot_prefix.fair_shares;
            let busy = (0..offered.len())
                .filter(|&k| c[offered[k]].cached_tokens >= root_tokens)
                .all(|k| shares[k] > fair && c[offered[k]].in_flight > 0);
            if owners > 1 && holders >= 1 && owners > holders && busy {
                // Priced as holding what the best holder holds: the others
                // would cache the whole shared prefix after one miss.
                let held = offered.iter().map(|&i| c[i].cached_tokens).max().unwrap_or(root_tokens);
                let load = |k: usize| out[k].terms[0] + out[k].terms[1] + share[k];
                // A copy that would fill much of a replica's cache, or that
                // does not fit beside the other prompt it was last sent,
                // evicts what it serves, and its own request pays the whole
                // long prefill: long contexts stay where they are cached.
                let roots = self.roots.lock().unwrap_or_else(|p| p.into_inner());
                let room = |x: &Candidate| {
                    let capacity = x.kv_capacity_tokens;
                    let beside = roots.peek(&x.key).and_then(|r| r.other_since(root, since)).map_or(0, |o| o.tokens);
                    capacity == 0
                        || (held as f64 <= self.config.hot_prefix.max_cache_share * capacity as f64 && (held + beside) as u64 <= capacity)
                };
                let mut others: Vec<usize> =
                    (0..offered.len()).filter(|&k| c[offered[k]].cached_tokens < root_tokens && room(&c[offered[k]])).collect();
                others.sort_by(|&a, &b| load(a).total_cmp(&load(b)));
                for k in others.into_iter().take(owners - holders) {
                    let credited = self.estimate(&c[offered[k]], req.prompt_tokens, held, Offloaded::default());
                    let saved = out[k].total - credited.total;
                    let [queue, decode, prefill, .., adapter, load] = credited.terms;
                    out[k] = Score { terms: [queue, decode, prefill, saved, 0.0, 0.0, adapter, load], ..credited };
                }
            }
        }
        for (s, &sh) in out.iter_mut().zip(&share) {
            s.terms[4] = sh;
            s.total += sh;
        }
        if self.config.session_affinity
            && let Some(session) = req.session
            && let Some(&home) = self.sessions.lock().unwrap_or_else(|p| p.into_inner()).peek(session)
            && let Some(k) = offered.iter().position(|&i| c[i].key == home)
        {
            out[k].total = -1.0;
            return Some("session");
        }
        None
    }

    fn picked(&self, req: &Request, c: &[Candidate], winner: usize) {
        self.taken.lock().unwrap_or_else(|p| p.into_inner()).add(u128::from(c[winner].key), 1.0, req.now);
        if let Some((root, _)) = self.root(req) {
            self.demand.lock().unwrap_or_else(|p| p.into_inner()).add(root, 1.0, req.now);
            let mut roots = self.roots.lock().unwrap_or_else(|p| p.into_inner());
            let sent = Sent { root, at: req.now, tokens: req.prompt_tokens.unwrap_or(0) };
            roots.get_or_insert_mut(c[winner].key, || Roots { last: sent, before: None }).sent(sent);
        }
        if self.config.session_affinity
            && let Some(session) = req.session
        {
            self.sessions.lock().unwrap_or_else(|p| p.into_inner()).put(session.to_owned(), c[winner].key);
        }
    }
}

#[cfg(test)]
mod tests;
