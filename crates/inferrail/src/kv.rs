//! What each replica's KV cache is predicted to hold, and the prompt's cached
//! tokens on every candidate.
//!
//! Each replica has a slot in the approximate index (`inferrail_kv`), a block
//! size and a capacity: configured, else learned from its engine's
//! `vllm:cache_config_info`, else the `kv` defaults. A prompt is cut into the
//! candidates' blocks and hashed once per block size; the index says how many
//! leading blocks each holds. The winner records the prompt (taken back if the
//! engine refuses it); a replica whose engine's prefix-cache counters go
//! backwards restarted, so its shadow is emptied.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use inferrail_config::Kv as KvConfig;
use inferrail_kv::hash::{BlockHash, block_hashes, salt};
use inferrail_kv::index::{KvIndex, Recorded, Slot, predicted_cached_tokens};

use crate::fleet::Replica;
use crate::prompt::Prompt;

/// The index and the slots replicas hold in it.
pub struct Kv {
    index: KvIndex,
    slots: Mutex<Slots>,
    defaults: KvConfig,
}

#[derive(Default)]
struct Slots {
    by_id: HashMap<String, Slot>,
    free: Vec<Slot>,
}

/// A prompt's blocks on each block size the candidates use.
#[derive(Debug, Default)]
pub struct Prediction {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Output tokens expected (they take cache room).
    output_tokens: usize,
    /// Block hashes by block size.
    hashes: Vec<(usize, Vec<BlockHash>)>,
}

/// What a decision recorded on a replica: its blocks are freed when the
/// request completes, or taken back if the engine refused it first.
#[derive(Debug)]
pub struct Record(Recorded);

impl Kv {
    /// An empty index with the configured defaults.
    pub fn new(defaults: KvConfig) -> Self {
        Self { index: KvIndex::new(), slots: Mutex::new(Slots::default()), defaults }
    }

    /// The slot of replica `id`: its old one if it had one, else a fresh one.
    pub fn slot(&self, id: &str) -> Slot {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&s) = slots.by_id.get(id) {
            return s;
        }
        let s = slots.free.pop().unwrap_or(slots.by_id.len() as Slot);
        slots.by_id.insert(id.to_owned(), s);
        s
    }

    /// Starts tracking a replica that just joined, empty.
    pub fn join(&self, r: &Replica) {
        self.index.add_replica(r.slot, self.blocks(r));
    }

    /// Forgets a replica that left, freeing its slot.
    pub fn leave(&self, r: &Replica) {
        self.index.remove_replica(r.slot);
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if slots.by_id.remove(&r.id).is_some() {
            slots.free.push(r.slot);
        }
    }

    /// The engine reported its cache shape; a shape that changes what is
    /// used (a new block size or capacity) restarts the shadow.
    pub fn learned(&self, r: &Replica, block_size: usize, blocks: usize) {
        let shape = |r: &Replica| (r.block_size(self.defaults.block_size), self.blocks(r));
        let before = shape(r);
        if r.learn_cache(block_size, blocks) {
            let (block_size, blocks) = shape(r);
            tracing::info!(replica = %r.id, block_size, blocks, "KV cache shape learned");
        }
        if shape(r) != before {
            self.index.add_replica(r.slot, self.blocks(r));
        }
    }

    /// The engine's prefix-cache query counter; one that went backwards means
    /// the engine restarted with an empty cache.
    pub fn prefix_cache_queries(&self, r: &Replica, queries: u64) {
        let before = r.prefix_queries.swap(queries, Ordering::Relaxed);
        if queries < before {
            tracing::info!(replica = %r.id, "engine counters went backwards: restarted, cache empty");
            metrics::counter!("inferrail_kv_resets_total", "replica" => r.id.clone()).increment(1);
            self.index.clear_replica(r.slot);
        }
    }

    fn blocks(&self, r: &Replica) -> usize {
        r.blocks(self.defaults.blocks)
    }

    /// Cuts a prompt into the blocks of every candidate's block size.
    pub fn prepare(&self, model: &str, prompt: &Prompt, candidates: &[Arc<Replica>]) -> Prediction {
        let chain = salt(&[model, prompt.cache_salt.as_deref().unwrap_or_default()]);
        let mut hashes: Vec<(usize, Vec<BlockHash>)> = Vec::new();
        for r in candidates {
            let bs = r.block_size(self.defaults.block_size);
            if !hashes.iter().any(|(b, _)| *b == bs) {
                hashes.push((bs, block_hashes(chain, &prompt.ids, bs)));
            }
        }
        let output_tokens = prompt.max_tokens.unwrap_or(self.defaults.expected_output_tokens).max(1);
        Prediction { prompt_tokens: prompt.ids.len(), output_tokens, hashes }
    }

    /// Predicted cached tokens of the prompt on each replica, one index pass per block size.
    pub fn cached(&self, p: &Prediction, replicas: &[Arc<Replica>]) -> Vec<usize> {
        let mut cached = vec![0; replicas.len()];
        for (bs, hashes) in &p.hashes {
            let (at, slots): (Vec<usize>, Vec<Slot>) = replicas
                .iter()
                .enumerate()
                .filter(|(_, r)| r.block_size(self.defaults.block_size) == *bs)
                .map(|(i, r)| (i, r.slot))
                .unzip();
            for (i, matched) in at.into_iter().zip(self.index.matched(hashes, &slots)) {
                cached[i] = predicted_cached_tokens(matched, p.prompt_tokens, *bs);
            }
        }
        cached
    }

    /// Records the prompt on the replica it goes to.
    pub fn record(&self, p: &Prediction, r: &Replica) -> Record {
        let bs = r.block_size(self.defaults.block_size);
        let hashes = p.hashes.iter().find(|(b, _)| *b == bs).map_or(&[][..], |(_, h)| &h[..]);
        let n = p.prompt_tokens;
        // The engine holds every token it computed: the prompt, then all but the last generated one.
        let prompt_blocks = n.div_ceil(bs);
        let output_blocks = (n + p.output_tokens - 1).div_ceil(bs).saturating_sub(prompt_blocks);
        let partial = prompt_blocks.saturating_sub(hashes.len());
        Record(self.index.record(r.slot, hashes, n.saturating_sub(1) / bs, partial, output_blocks))
    }

    /// The engine refused or failed the request: forget what it recorded.
    pub fn take_back(&self, rec: &Record) {
        self.index.take_back(&rec.0);
    }

    /// The request completed: the engine freed its blocks (once per record).
    pub fn complete(&self, rec: &Record) {
        self.index.complete(&rec.0);
    }

    /// Entries in the index (blocks held, over all replicas).
    pub fn entries(&self) -> usize {
        self.index.entries()
    }

    /// Bytes the index has allocated.
    pub fn bytes(&self) -> usize {
        self.index.bytes()
    }
}

/// The values of `vllm:cache_config_info`'s `block_size` and `num_gpu_blocks`
/// labels and the sum of `vllm:prefix_cache_queries_total`, from a metrics page.
pub fn parse_metrics(page: &str) -> (Option<(usize, usize)>, Option<u64>) {
    let label = |line: &str, name: &str| -> Option<usize> {
        let at = [format!("{{{name}=\""), format!(",{name}=\"")].iter().find_map(|p| line.find(p.as_str()).map(|i| i + p.len()))?;
        line[at..].split('"').next()?.parse().ok()
    };
    let mut shape = None;
    let mut queries: Option<f64> = None;
    for line in page.lines() {
        if line.starts_with("vllm:cache_config_info{") {
            if let (Some(bs), Some(n)) = (label(line, "block_size"), label(line, "num_gpu_blocks")) {
                shape = Some((bs, n));
            }
        } else if line.starts_with("vllm:prefix_cache_queries_total")
            && let Some(v) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok())
        {
            *queries.get_or_insert(0.0) += v;
        }
    }
    (shape, queries.map(|q| q as u64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use inferrail_config::{CacheShape, Limits};

    fn replica(kv: &Kv, id: &str, cache: CacheShape) -> Arc<Replica> {
        let r = Arc::new(Replica::new(id.into(), "127.0.0.1:1".parse().unwrap(), vec![0], Limits::default(), cache, kv.slot(id)));
        kv.join(&r);
        r
    }

    fn prompt(n: u32) -> Prompt {
        Prompt { ids: (0..n).collect(), max_tokens: Some(1), cache_salt: None }
    }

    #[test]
    fn a_restarted_engine_and_a_learned_shape_empty_the_shadow() {
        let kv = Kv::new(KvConfig::default());
        let r = replica(&kv, "a", CacheShape::default());
        let recorded = |kv: &Kv| {
            let p = kv.prepare("m", &prompt(100), std::slice::from_ref(&r));
            kv.cached(&p, std::slice::from_ref(&r))[0]
        };
        let p = kv.prepare("m", &prompt(100), std::slice::from_ref(&r));
        kv.record(&p, &r);
        assert_eq!(recorded(&kv), 96);
        kv.prefix_cache_queries(&r, 1_000);
        kv.prefix_cache_queries(&r, 1_200);
        assert_eq!(recorded(&kv), 96, "counters going up change nothing");
        kv.prefix_cache_queries(&r, 10);
        assert_eq!(recorded(&kv), 0, "counters going back: the engine restarted");

        kv.record(&p, &r);
        kv.learned(&r, 16, 8192);
        assert_eq!(recorded(&kv), 96, "the shape it already used");
        kv.learned(&r, 32, 100);
        assert_eq!(r.block_size(16), 32);
        assert_eq!(recorded(&kv), 0, "a new shape starts a new shadow");
    }

    #[test]
    fn configured_shapes_win_over_learned_ones_and_slots_are_reused() {
        let kv = Kv::new(KvConfig::default());
        let r = replica(&kv, "a", CacheShape { block_size: Some(64), blocks: Some(10) });
        kv.learned(&r, 32, 100);
        assert_eq!((r.block_size(16), r.blocks(8192)), (64, 10));
        let b = replica(&kv, "b", CacheShape::default());
        assert_ne!(r.slot, b.slot);
        kv.leave(&r);
        assert_eq!(kv.slot("c"), r.slot, "a departed replica's slot is reused");
        assert_eq!(kv.slot("b"), b.slot);
    }

    #[test]
    fn metrics_pages_give_the_cache_shape_and_the_query_counter() {
        let page =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../sim/tests/fixtures/vllm-0.32.0/metrics-under-load.txt"))
                .unwrap();
        assert_eq!(parse_metrics(&page), (Some((32, 32768)), Some(9249)));
        assert_eq!(parse_metrics("# nothing\n"), (None, None));
    }
}
