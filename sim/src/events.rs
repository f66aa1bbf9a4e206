//! KV cache events, published as vLLM 0.32.0 publishes them.
//!
//! `--kv-events-config` takes vLLM's JSON (an unknown field is an error, as
//! in vLLM). With events on, the engine reports what its prefix cache does
//! to [`StepEvents`], which makes one batch per engine step, in vLLM's order:
//! for each sequence in the order the step scheduled it, one `BlockRemoved`
//! per block its allocation evicted, then one `BlockStored` for the blocks it
//! filled; then the host tier's events (`crate::offload`): one `BlockRemoved`
//! per batch of blocks it evicted, one `BlockStored` per block whose store
//! a step saw done. A `POST /reset_prefix_cache` queues `AllBlocksCleared`, which goes
//! out first in the next step's batch, as vLLM's does: an idle engine sends
//! it with its next request. Steps that change nothing send nothing.
//!
//! Block hashes on the wire are the engine's own, deliberately not the
//! router's: a keyed XXH3-64 of the simulator's chained block hash, with a
//! key drawn per process, so a consumer must map blocks by their tokens (as
//! it must with vLLM, whose hashes are SHA-256 of pickled tuples). See
//! `docs/adr/0011-kv-events-on-zmq-rs.md`.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use inferrail_kv::hash::BlockHash;
use inferrail_kv_events::publish::{Publisher, PublisherConfig, Skip};
use inferrail_kv_events::wire::{BlockRemoved, BlockStored, EventBatch, ExtraKey, KvEvent};

use crate::lora::Adapter;
use serde::Deserialize;

/// vLLM 0.32.0's `--kv-events-config`, with its defaults.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvEventsConfig {
    /// Produce events at all.
    pub enable_kv_cache_events: bool,
    /// `"zmq"` or `"null"`; unset means `"zmq"` when enabled.
    pub publisher: Option<String>,
    /// The PUB endpoint (the engine binds `*`, `::`, `ipc://`; else connects).
    pub endpoint: String,
    /// Where the replay service binds, if anywhere.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// ZMQ high-water mark; zmq.rs's fixed per-subscriber queue (100,000,
    /// vLLM's default) stands in for it.
    pub hwm: usize,
    /// Batches waiting to be sent before new ones are dropped.
    pub max_queue_size: usize,
    /// The first frame of every message.
    pub topic: String,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            enable_kv_cache_events: false,
            publisher: None,
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            hwm: 100_000,
            max_queue_size: 100_000,
            topic: String::new(),
        }
    }
}

impl KvEventsConfig {
    /// Reads the flag's JSON, refusing what vLLM would refuse and what the
    /// simulator cannot do.
    pub fn parse(json: &str) -> anyhow::Result<Self> {
        let config: Self = serde_json::from_str(json).with_context(|| format!("--kv-events-config {json}"))?;
        match config.publisher.as_deref() {
            None | Some("zmq" | "null") => {}
            Some(other) => bail!("--kv-events-config: unknown event publisher {other:?} (expected \"zmq\" or \"null\")"),
        }
        if config.max_queue_size == 0 {
            bail!("--kv-events-config: max_queue_size must be at least 1 (the simulator never lets the engine wait on its queue)");
        }
        Ok(config)
    }

    /// Whether events are produced and published over ZMQ.
    pub fn enabled(&self) -> bool {
        self.enable_kv_cache_events && self.publisher.as_deref().unwrap_or("zmq") == "zmq"
    }

    /// The publisher these settings describe, with a skip fault.
    pub fn publisher(&self, skip: Skip) -> PublisherConfig {
        PublisherConfig {
            endpoint: self.endpoint.clone(),
            replay_endpoint: self.replay_endpoint.clone(),
            buffer_steps: self.buffer_steps,
            max_queue_size: self.max_queue_size,
            topic: self.topic.clone(),
            dp_rank: 0,
            skip,
        }
    }
}

/// A key for the engine's block hashes, different in every process.
pub fn process_key() -> u64 {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or_default();
    xxhash_rust::xxh3::xxh3_64(&[nanos.to_le_bytes().as_slice(), &std::process::id().to_le_bytes()].concat())
}

/// The engine's name for a block: a keyed hash of the simulator's own.
pub fn engine_hash(key: u64, hash: BlockHash) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(&hash.to_le_bytes(), key)
}

/// The events of one engine step, gathered per sequence; see the module doc.
pub struct StepEvents {
    publisher: Arc<Publisher>,
    key: u64,
    block_size: usize,
    /// Events from between steps (a reset), sent first.
    pending: Vec<KvEvent>,
    /// This step's events per sequence, in scheduling order.
    seqs: Vec<Vec<KvEvent>>,
    index: HashMap<u64, usize>,
    /// This step's host tier events, sent after the sequences'.
    host: Vec<KvEvent>,
}

/// The blocks of one sequence that a step cached.
pub struct Stored<'a> {
    /// The sequence's chained block hashes.
    pub hashes: &'a [BlockHash],
    /// Its tokens.
    pub tokens: &'a [u32],
    /// Indexes of the blocks cached now, ascending.
    pub blocks: &'a [usize],
    /// Its `cache_salt`, an extra key of its first block.
    pub cache_salt: Option<&'a str>,
    /// Its adapter, an extra key of every block.
    pub lora: Option<&'a Adapter>,
}

/// A block's extra keys as vLLM's events give them: the adapter's name,
/// then the cache salt (first block only); none when neither.
fn extra_keys(lora: Option<&Adapter>, salt: Option<&str>) -> Option<Vec<ExtraKey>> {
    let keys: Vec<ExtraKey> = lora.map(|a| a.name.to_string()).into_iter().chain(salt.map(str::to_owned)).map(ExtraKey::Str).collect();
    (!keys.is_empty()).then_some(keys)
}

impl StepEvents {
    /// Events for `publisher`, naming blocks with `key`.
    pub fn new(publisher: Arc<Publisher>, key: u64, block_size: usize) -> Self {
        Self { publisher, key, block_size, pending: Vec::new(), seqs: Vec::new(), index: HashMap::new(), host: Vec::new() }
    }

    /// The publisher, for its counters.
    pub fn publisher(&self) -> &Publisher {
        &self.publisher
    }

    fn of(&mut self, seq: u64) -> &mut Vec<KvEvent> {
        let at = *self.index.entry(seq).or_insert_with(|| {
            self.seqs.push(Vec::new());
            self.seqs.len() - 1
        });
        &mut self.seqs[at]
    }

    /// Sequence `seq` got blocks in this step; its events go in this order.
    pub fn scheduled(&mut self, seq: u64) {
        self.of(seq);
    }

    /// Sequence `seq`'s allocation evicted these cached blocks.
    pub fn evicted(&mut self, seq: u64, hashes: Vec<BlockHash>) {
        let key = self.key;
        let removed = hashes.into_iter().map(|h| {
            KvEvent::BlockRemoved(BlockRemoved { block_hashes: vec![engine_hash(key, h)], medium: Some("GPU".into()), group_idx: Some(0) })
        });
        self.of(seq).extend(removed);
    }

    /// Sequence `seq` cached these blocks: one `BlockStored` per run of
    /// consecutive blocks (a block whose prefix another block already
    /// caches is not cached again, and breaks the run).
    pub fn stored(&mut self, seq: u64, stored: &Stored<'_>) {
        let events: Vec<KvEvent> = runs(stored.blocks).map(|run| KvEvent::BlockStored(self.block_stored(stored, run))).collect();
        self.of(seq).extend(events);
    }

    fn block_stored(&self, s: &Stored<'_>, run: Range<usize>) -> BlockStored {
        let bs = self.block_size;
        BlockStored {
            block_hashes: s.hashes[run.clone()].iter().map(|&h| engine_hash(self.key, h)).collect(),
            parent_block_hash: run.start.checked_sub(1).map(|p| engine_hash(self.key, s.hashes[p])),
            token_ids: s.tokens[run.start * bs..run.end * bs].to_vec(),
            block_size: u32::try_from(bs).unwrap_or(u32::MAX),
            lora_id: s.lora.map(|a| a.id as i64),
            medium: Some("GPU".into()),
            lora_name: s.lora.map(|a| a.name.to_string()),
            extra_keys: Some(run.map(|k| extra_keys(s.lora, s.cache_salt.filter(|_| k == 0))).collect()),
            group_idx: Some(0),
            kv_cache_spec_kind: Some("full_attention".into()),
            lookahead_token_ids: None,
        }
    }

    /// The events announcing `stored`'s blocks in the host tier, one per
    /// block: self-describing (tokens, parent, adapter, as the GPU's), or
    /// vLLM's placeholder, which names the block's hash and nothing else.
    pub fn offloaded(&self, s: &Stored<'_>, self_describing: bool) -> Vec<KvEvent> {
        s.blocks
            .iter()
            .map(|&k| {
                let event = if self_describing {
                    let mut e = self.block_stored(s, k..k + 1);
                    e.extra_keys = None;
                    e
                } else {
                    BlockStored {
                        block_hashes: vec![engine_hash(self.key, s.hashes[k])],
                        parent_block_hash: None,
                        token_ids: Vec::new(),
                        block_size: 0,
                        lora_id: None,
                        medium: None,
                        lora_name: None,
                        extra_keys: None,
                        group_idx: Some(0),
                        kv_cache_spec_kind: None,
                        lookahead_token_ids: None,
                    }
                };
                KvEvent::BlockStored(BlockStored { medium: Some("CPU".into()), ..event })
            })
            .collect()
    }

    /// The host tier evicted these blocks to make room for a store.
    pub fn offload_evicted(&mut self, hashes: Vec<BlockHash>) {
        let block_hashes = hashes.into_iter().map(|h| engine_hash(self.key, h)).collect();
        self.host.push(KvEvent::BlockRemoved(BlockRemoved { block_hashes, medium: Some("CPU".into()), group_idx: Some(0) }));
    }

    /// Stores into the host tier are done: their events (from [`Self::offloaded`]).
    pub fn offload_stored(&mut self, events: Vec<KvEvent>) {
        self.host.extend(events);
    }

    /// The prefix cache was reset.
    pub fn cleared(&mut self) {
        self.pending.push(KvEvent::AllBlocksCleared);
    }

    /// Ends the step: publishes its batch, if anything happened.
    pub fn publish(&mut self) {
        let mut events = std::mem::take(&mut self.pending);
        events.extend(self.seqs.drain(..).flatten());
        events.append(&mut self.host);
        self.index.clear();
        if events.is_empty() {
            return;
        }
        let ts = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or_default();
        // A full queue drops the batch and counts it; the engine never waits.
        self.publisher.publish(EventBatch { ts, events, dp_rank: None });
    }
}

/// Ascending block indexes as runs of consecutive ones.
fn runs(blocks: &[usize]) -> impl Iterator<Item = Range<usize>> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        let start = *blocks.get(i)?;
        let mut end = start + 1;
        i += 1;
        while blocks.get(i) == Some(&end) {
            end += 1;
            i += 1;
        }
        Some(start..end)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllms_flag_parses_with_its_defaults_and_refuses_unknown_fields() {
        let c = KvEventsConfig::parse(
            r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:5557","topic":"kv-events"}"#,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert!(c.enabled());
        assert_eq!((c.buffer_steps, c.hwm, c.max_queue_size, c.replay_endpoint), (10_000, 100_000, 100_000, None));
        assert!(KvEventsConfig::parse(r#"{"enable_kv_cache_events":true}"#).is_ok_and(|c| c.enabled() && c.endpoint == "tcp://*:5557"));
        assert!(KvEventsConfig::parse(r#"{"enable_kv_cache_events":true,"publisher":"null"}"#).is_ok_and(|c| !c.enabled()));
        assert!(KvEventsConfig::parse(r#"{"publisher":"zmq"}"#).is_ok_and(|c| !c.enabled()));
        for bad in [
            r#"{"enable_kv_cache_events":true,"port":5557}"#,
            r#"{"publisher":"kafka"}"#,
            r#"{"buffer_steps":-1}"#,
            r#"{"max_queue_size":0}"#,
            "nope",
        ] {
            let err = KvEventsConfig::parse(bad).err().map(|e| format!("{e:#}")).unwrap_or_default();
            assert!(err.contains("--kv-events-config"), "{bad}: {err}");
        }
    }

    #[test]
    fn runs_split_where_a_block_is_missing() {
        let r: Vec<Range<usize>> = runs(&[2, 3, 4, 6, 8, 9]).collect();
        assert_eq!(r, [2..5, 6..7, 8..10]);
        assert_eq!(runs(&[]).count(), 0);
    }

    #[test]
    fn engine_hashes_differ_from_the_simulators_and_between_keys() {
        let h: BlockHash = 0x1234_5678_9abc_def0_0fed_cba9_8765_4321;
        assert_ne!(u128::from(engine_hash(1, h)), h);
        assert_ne!(engine_hash(1, h) as u128, h & u128::from(u64::MAX));
        assert_ne!(engine_hash(1, h), engine_hash(2, h));
        assert_eq!(engine_hash(1, h), engine_hash(1, h));
    }
}
