//! KV blocks offloaded to host memory, as vLLM 0.32.0's `OffloadingConnector`
//! (`--kv-offloading-size`, backend `native`) keeps them.
//!
//! The rules, from vLLM's connector (`kv_offload/cpu`, `offloading/scheduler.py`):
//! - One offloaded chunk is one GPU block (`blocks_per_chunk` 1, the
//!   default), named by the block's hash. The tier holds
//!   `floor(bytes / round_up(bytes per block, 4096))` of them.
//! - Only prompt blocks are stored (`offload_prompt_only`, the default).
//!   Each step every scheduled request offers the full prompt blocks it has
//!   not offered yet; blocks the tier has (stored or being stored) are
//!   skipped. The rest take free chunks, then evict the least recently used
//!   ready chunks that no load holds and the offer does not name. If that is
//!   not enough the whole offer fails (counted) and is made again next step.
//! - A store is copied after the step that offered it, and its chunks can be
//!   loaded only once a later step sees it done. Until then a request whose
//!   hit reaches them waits, as it does for chunks another request is loading.
//! - A new request looks past its GPU prefix hit for consecutive chunks the
//!   tier holds, up to its last full block (the GPU lookup stops a token
//!   short; this one does not). A hit is loaded asynchronously into blocks
//!   allocated for it: the request waits outside the batch for at least one
//!   step, then its loaded blocks join the GPU prefix cache and it is
//!   scheduled without a new lookup, computing at least its last token.
//! - A request that finishes makes every chunk it stored, loaded or found
//!   the most recent, its first block last, so tails are evicted first.
//!
//! Stores and loads each run one at a time on their own copy stream, taking
//! a block's bytes over the flag's bandwidth.

use std::collections::{BTreeMap, HashMap, VecDeque};

use anyhow::{Context, bail, ensure};
use inferrail_kv::hash::BlockHash;
use inferrail_kv_events::wire::KvEvent;
use serde::Deserialize;
use serde_json::{Map, Value};
use tokio::time::{Duration, Instant};

/// vLLM rounds each chunk's bytes up to a page.
const PAGE: usize = 4096;

/// The tier the flags describe.
#[derive(Debug, Clone, PartialEq)]
pub struct OffloadConfig {
    /// Chunks (blocks) the tier holds.
    pub blocks: usize,
    /// Seconds to copy one block either way.
    pub block_secs: f64,
    /// Bytes of one block, for the transfer counters.
    pub block_bytes: usize,
    /// `self_describing_kv_events`: events carry the blocks' tokens and
    /// parents; else each is a placeholder naming the block's hash alone.
    pub self_describing: bool,
}

/// The keys of vLLM's `KVTransferConfig` the connector reads.
#[derive(Debug, Deserialize)]
struct RawTransfer {
    kv_connector: Option<String>,
    kv_role: Option<String>,
    #[serde(default)]
    kv_connector_extra_config: Map<String, Value>,
}

impl OffloadConfig {
    /// The tier asked for by `--kv-offloading-size` (GiB) and/or a
    /// `--kv-transfer-config` naming `OffloadingConnector`; `None` when
    /// neither does. `block_bytes` is one GPU block's KV in bytes.
    pub fn from_flags(
        size_gib: Option<f64>,
        backend: &str,
        transfer: Option<&str>,
        gpu_block_size: usize,
        block_bytes: usize,
        bandwidth_gbs: f64,
    ) -> anyhow::Result<Option<Self>> {
        let raw = transfer
            .map(|json| serde_json::from_str::<RawTransfer>(json).context("--kv-transfer-config is not vLLM's KVTransferConfig JSON"))
            .transpose()?;
        let named = raw.as_ref().is_some_and(|r| r.kv_connector.as_deref() == Some("OffloadingConnector"));
        if size_gib.is_none() && !named {
            return Ok(None);
        }
        ensure!(backend == "native", "--kv-offloading-backend {backend:?} is not simulated (native is)");
        let extra = raw.as_ref().map(|r| r.kv_connector_extra_config.clone()).unwrap_or_default();
        if let Some(r) = &raw {
            // With the size flag vLLM makes whatever connector was named the offloading one.
            if size_gib.is_none() {
                ensure!(
                    r.kv_role.is_some(),
                    "Please specify kv_role when kv_connector is set, supported roles are kv_producer, kv_consumer and kv_both"
                );
            } else if let Some(other) = r.kv_connector.as_deref().filter(|c| *c != "OffloadingConnector") {
                bail!(
                    "--kv-offloading-size with kv_connector {other:?}: one engine cannot both offload and transfer here (vLLM would replace {other})"
                );
            }
        }
        let bytes = match size_gib {
            Some(gib) => {
                ensure!(gib.is_finite() && gib > 0.0, "--kv-offloading-size must be a positive number of GiB");
                gib * f64::from(1u32 << 30)
            }
            None => extra.get("cpu_bytes_to_use").and_then(Value::as_f64).filter(|b| *b > 0.0).context(
                "--kv-transfer-config: OffloadingConnector needs kv_connector_extra_config.cpu_bytes_to_use (or --kv-offloading-size)",
            )?,
        };
        let per_chunk = match (extra.get("block_size"), extra.get("blocks_per_chunk")) {
            (Some(_), Some(_)) => bail!("--kv-transfer-config: give block_size or blocks_per_chunk, not both"),
            (Some(b), None) => b.as_u64().context("block_size must be a whole number of tokens")? as usize / gpu_block_size.max(1),
            (None, Some(n)) => n.as_u64().context("blocks_per_chunk must be a whole number")? as usize,
            (None, None) => 1,
        };
        ensure!(per_chunk == 1, "--kv-transfer-config: offloaded chunks of more than one GPU block are not simulated");
        match extra.get("eviction_policy").map(Value::as_str) {
            None | Some(Some("lru")) => {}
            Some(other) => bail!("--kv-transfer-config: eviction_policy {other:?} is not simulated (lru is)"),
        }
        if let Some(false) = extra.get("offload_prompt_only").map(|v| v.as_bool().unwrap_or(true)) {
            bail!("--kv-transfer-config: offload_prompt_only false is not simulated");
        }
        let self_describing = extra.get("self_describing_kv_events").and_then(Value::as_bool).unwrap_or(false);
        ensure!(bandwidth_gbs > 0.0, "--kv-offload-bandwidth-gbs must be positive");
        let blocks = (bytes as usize) / block_bytes.max(1).next_multiple_of(PAGE);
        Ok(Some(Self { blocks, block_secs: block_bytes as f64 / (bandwidth_gbs * 1e9), block_bytes, self_describing }))
    }
}

/// What a request finds in the tier past its GPU hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found {
    /// This many consecutive blocks are ready to load (0: none).
    Hit(usize),
    /// A block of the hit is still being stored or loaded: wait a step.
    Busy,
}

#[derive(Debug, Clone, Copy)]
struct Chunk {
    /// Stored (a lookup may load it); false while being stored.
    ready: bool,
    /// Loads holding it.
    loads: u32,
    /// Recency: larger is more recent.
    rank: u64,
}

/// Stores under way: their blocks, the step that offered them, when the copy
/// ends, and the events that announce them.
struct Store {
    keys: Vec<BlockHash>,
    step: u64,
    done: Instant,
    events: Vec<KvEvent>,
}

/// Copy-stream work a step finished.
#[derive(Debug, Default)]
pub struct Finished {
    /// Events of the stores completed, in order.
    pub events: Vec<KvEvent>,
    /// Blocks stored and the seconds they took.
    pub stored: (usize, f64),
}

/// The host tier; see the module doc.
pub struct CpuTier {
    /// Its size and timing.
    pub config: OffloadConfig,
    chunks: HashMap<BlockHash, Chunk>,
    /// Ready chunks no load holds, least recent first.
    lru: BTreeMap<u64, BlockHash>,
    rank: u64,
    stores: VecDeque<Store>,
    store_free: Instant,
    load_free: Instant,
}

impl CpuTier {
    /// An empty tier.
    pub fn new(config: OffloadConfig, now: Instant) -> Self {
        Self { config, chunks: HashMap::new(), lru: BTreeMap::new(), rank: 0, stores: VecDeque::new(), store_free: now, load_free: now }
    }

    /// Blocks held, stored or being stored.
    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Whether it holds `key`, stored or being stored.
    pub fn holds(&self, key: BlockHash) -> bool {
        self.chunks.contains_key(&key)
    }

    /// The consecutive blocks of `keys` it holds, from the first.
    pub fn lookup(&self, keys: &[BlockHash]) -> Found {
        let mut n = 0;
        for k in keys {
            match self.chunks.get(k) {
                None => break,
                Some(c) if !c.ready || c.loads > 0 => return Found::Busy,
                Some(_) => n += 1,
            }
        }
        Found::Hit(n)
    }

    /// Starts loading `keys` at `start` (each held and ready); returns when
    /// the copy ends. They cannot be evicted until [`Self::loaded`].
    pub fn load(&mut self, keys: &[BlockHash], start: Instant) -> Instant {
        for k in keys {
            if let Some(c) = self.chunks.get_mut(k) {
                if c.loads == 0 {
                    self.lru.remove(&c.rank);
                }
                c.loads += 1;
            }
        }
        let done = self.load_free.max(start) + self.copy(keys.len());
        self.load_free = done;
        done
    }

    /// A load of `keys` ended (or its request went away).
    pub fn loaded(&mut self, keys: &[BlockHash]) {
        for k in keys {
            if let Some(c) = self.chunks.get_mut(k) {
                c.loads = c.loads.saturating_sub(1);
                if c.loads == 0 && c.ready {
                    self.lru.insert(c.rank, *k);
                }
            }
        }
    }

    /// Offers `keys` for storing in step `step`, the copy to start at
    /// `start`. The blocks it lacks are stored, evicting as needed;
    /// `describe` gives their events from their indexes in `keys`. Returns
    /// the evicted blocks, or `None` (nothing done) when too few could be.
    pub fn offer(
        &mut self,
        keys: &[BlockHash],
        step: u64,
        start: Instant,
        describe: impl FnOnce(&[usize]) -> Vec<KvEvent>,
    ) -> Option<Vec<BlockHash>> {
        let fresh: Vec<usize> = (0..keys.len()).filter(|&i| !self.chunks.contains_key(&keys[i]) && !keys[..i].contains(&keys[i])).collect();
        if fresh.is_empty() {
            return Some(Vec::new());
        }
        let short = (self.chunks.len() + fresh.len()).saturating_sub(self.config.blocks);
        // The keys offered are protected; those the tier holds are not in the
        // order while loading or being stored, and the others are absent.
        let victims: Vec<(u64, BlockHash)> =
            self.lru.iter().filter(|(_, k)| !keys.contains(k)).take(short).map(|(&r, &k)| (r, k)).collect();
        if victims.len() < short {
            return None;
        }
        for (r, k) in &victims {
            self.lru.remove(r);
            self.chunks.remove(k);
        }
        for &i in &fresh {
            self.rank += 1;
            self.chunks.insert(keys[i], Chunk { ready: false, loads: 0, rank: self.rank });
        }
        let done = self.store_free.max(start) + self.copy(fresh.len());
        self.store_free = done;
        let events = describe(&fresh);
        self.stores.push_back(Store { keys: fresh.iter().map(|&i| keys[i]).collect(), step, done, events });
        Some(victims.into_iter().map(|(_, k)| k).collect())
    }

    /// The stores a step `step` ending at `end` sees done: offered in an
    /// earlier step, their copy over. Their blocks become loadable.
    pub fn finish(&mut self, step: u64, end: Instant) -> Finished {
        let mut out = Finished::default();
        while self.stores.front().is_some_and(|s| s.step < step && s.done <= end) {
            let Some(s) = self.stores.pop_front() else { break };
            for k in &s.keys {
                if let Some(c) = self.chunks.get_mut(k) {
                    c.ready = true;
                    self.lru.insert(c.rank, *k);
                }
            }
            out.stored.0 += s.keys.len();
            out.stored.1 += s.keys.len() as f64 * self.config.block_secs;
            out.events.extend(s.events);
        }
        out
    }

    /// When the next store's copy ends, if one is under way.
    pub fn next_store(&self) -> Option<Instant> {
        self.stores.front().map(|s| s.done)
    }

    /// A request finished that stored, loaded or found `keys` (its first
    /// block first): they become the most recent, the first one last.
    pub fn finished(&mut self, keys: &[BlockHash]) {
        for k in keys.iter().rev() {
            if let Some(c) = self.chunks.get_mut(k) {
                self.rank += 1;
                let listed = c.ready && c.loads == 0;
                if listed {
                    self.lru.remove(&c.rank);
                }
                c.rank = self.rank;
                if listed {
                    self.lru.insert(c.rank, *k);
                }
            }
        }
    }

    fn copy(&self, blocks: usize) -> Duration {
        Duration::from_secs_f64(blocks as f64 * self.config.block_secs)
    }
}

#[cfg(test)]
mod tests;
