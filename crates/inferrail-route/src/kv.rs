//! What each replica's KV cache is predicted to hold, and the prompt's cached
//! tokens on every candidate.
//!
//! Each replica has a slot in the approximate index (`inferrail_kv`), a block
//! size and a capacity, which the caller resolves (configured, else learned
//! from the engine, else the `kv` defaults) and passes in as plain values, so
//! this module knows nothing of replicas. A prompt is cut into the
//! candidates' blocks and hashed once per block size; the index says how
//! many leading blocks each holds. The winner records the prompt (taken back
//! if the engine refuses it).

use std::collections::HashMap;
use std::sync::Mutex;

use inferrail_config::Kv as KvConfig;
use inferrail_kv::hash::{BlockHash, block_hashes, salt};
use inferrail_kv::index::{KvIndex, Recorded, Slot, predicted_cached_tokens};

/// A prompt as the engine will see it, and what the KV index needs besides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Output tokens asked for, when the request says.
    pub max_tokens: Option<usize>,
    /// The request's `cache_salt`, which keeps its blocks apart.
    pub cache_salt: Option<String>,
}

/// Where a replica's cache is in the index: its slot and block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    /// Its slot.
    pub slot: Slot,
    /// Tokens per block.
    pub block_size: usize,
}

/// The index and the slots replicas hold in it.
pub struct Kv {
    index: KvIndex,
    slots: Mutex<Slots>,
    /// The configured defaults.
    pub defaults: KvConfig,
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

impl Prediction {
    /// A prompt of `prompt_tokens` cut at one block size, as another router
    /// recorded it: its blocks' hashes at `block_size` and the output it expected.
    pub fn of_blocks(prompt_tokens: usize, output_tokens: usize, block_size: usize, hashes: Vec<BlockHash>) -> Self {
        Self { prompt_tokens, output_tokens, hashes: vec![(block_size, hashes)] }
    }

    /// Output tokens expected.
    pub fn output_tokens(&self) -> usize {
        self.output_tokens
    }

    /// The prompt's full blocks' hashes at `block_size`, if it was cut at that size.
    pub fn blocks(&self, block_size: usize) -> Option<&[BlockHash]> {
        self.hashes.iter().find(|(b, _)| *b == block_size).map(|(_, h)| h.as_slice())
    }
}

/// Where the block hash chain of a prompt of `model` (a served model or
/// adapter name) with `cache_salt` starts.
pub fn seed(model: &str, cache_salt: Option<&str>) -> BlockHash {
    salt(&[model, cache_salt.unwrap_or_default()])
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

    /// Starts tracking a slot, empty, with room for `blocks` (again from empty when it was tracked).
    pub fn reset(&self, slot: Slot, blocks: usize) {
        self.index.add_replica(slot, blocks);
    }

    /// Forgets replica `id`, freeing its slot.
    pub fn leave(&self, id: &str, slot: Slot) {
        self.index.remove_replica(slot);
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if slots.by_id.remove(id).is_some() {
            slots.free.push(slot);
        }
    }

    /// Empties a slot's shadow (its engine restarted).
    pub fn clear(&self, slot: Slot) {
        self.index.clear_replica(slot);
    }

    /// The index itself, for the engines' KV events (exact mode).
    pub fn index(&self) -> &KvIndex {
        &self.index
    }

    /// Cuts a prompt into blocks of each of `block_sizes`.
    pub fn prepare(&self, model: &str, prompt: &Prompt, block_sizes: impl IntoIterator<Item = usize>) -> Prediction {
        let chain = seed(model, prompt.cache_salt.as_deref());
        let mut hashes: Vec<(usize, Vec<BlockHash>)> = Vec::new();
        for bs in block_sizes {
            if !hashes.iter().any(|(b, _)| *b == bs) {
                hashes.push((bs, block_hashes(chain, &prompt.ids, bs)));
            }
        }
        let output_tokens = prompt.max_tokens.unwrap_or(self.defaults.expected_output_tokens).max(1);
        Prediction { prompt_tokens: prompt.ids.len(), output_tokens, hashes }
    }

    /// Predicted cached tokens of the prompt at each place, and of those the
    /// ones a request in flight there holds; one index pass per block size.
    pub fn cached(&self, p: &Prediction, places: &[Place]) -> Vec<(usize, usize)> {
        let mut cached = vec![(0, 0); places.len()];
        let mut slots: Vec<Slot> = Vec::with_capacity(places.len());
        for (bs, hashes) in &p.hashes {
            slots.clear();
            slots.extend(places.iter().filter(|pl| pl.block_size == *bs).map(|pl| pl.slot));
            let at = places.iter().enumerate().filter(|(_, pl)| pl.block_size == *bs).map(|(i, _)| i);
            let depths: Vec<(Slot, usize)> = slots.iter().copied().zip(self.index.matched(hashes, &slots)).collect();
            for ((i, &(_, matched)), held) in at.zip(&depths).zip(self.index.held(hashes, &depths)) {
                let tokens = predicted_cached_tokens(matched, p.prompt_tokens, *bs);
                cached[i] = (tokens, (held * bs).min(tokens));
            }
        }
        cached
    }

    /// Records the prompt at the place it goes to.
    pub fn record(&self, p: &Prediction, at: Place) -> Record {
        let bs = at.block_size;
        let hashes = p.blocks(bs).unwrap_or_default();
        let n = p.prompt_tokens;
        // The engine holds every token it computed: the prompt, then all but the last generated one.
        let prompt_blocks = n.div_ceil(bs);
        let output_blocks = (n + p.output_tokens - 1).div_ceil(bs).saturating_sub(prompt_blocks);
        let partial = prompt_blocks.saturating_sub(hashes.len());
        let ends_partial = !(n + p.output_tokens).saturating_sub(1).is_multiple_of(bs);
        Record(self.index.record(at.slot, hashes, n.saturating_sub(1) / bs, partial, output_blocks, ends_partial))
    }

    /// The engine refused or failed the request: forget what it recorded.
    pub fn take_back(&self, rec: &Record) {
        self.index.take_back(&rec.0);
    }

    /// The request is over, its status unknown: a claim on an exact replica
    /// ends now. Returns whether the record was such a claim (and is done).
    pub fn end_claim(&self, rec: &Record) -> bool {
        self.index.end_claim(&rec.0)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(n: u32) -> Prompt {
        Prompt { ids: (0..n).collect(), max_tokens: Some(1), cache_salt: None }
    }

    #[test]
    fn a_recorded_prompt_is_predicted_at_its_place_and_block_size_only() {
        let kv = Kv::new(KvConfig::default());
        let (a, b) = (kv.slot("a"), kv.slot("b"));
        kv.reset(a, 100);
        kv.reset(b, 100);
        let (pa, pb) = (Place { slot: a, block_size: 16 }, Place { slot: b, block_size: 32 });
        let p = kv.prepare("m", &prompt(100), [16, 32, 16]);
        assert_eq!(p.hashes.len(), 2, "hashed once per block size");
        kv.record(&p, pa);
        assert_eq!(kv.cached(&p, &[pa, pb]), [(96, 96), (0, 0)], "the request recorded holds its blocks until it completes");
        kv.clear(a);
        assert_eq!(kv.cached(&p, &[pa, pb]), [(0, 0), (0, 0)]);
        let salted = kv.prepare("m", &Prompt { cache_salt: Some("s".into()), ..prompt(100) }, [16]);
        kv.record(&p, pa);
        assert_eq!(kv.cached(&salted, &[pa]), [(0, 0)], "a cache salt keeps blocks apart");
    }

    #[test]
    fn slots_are_reused() {
        let kv = Kv::new(KvConfig::default());
        let (a, b) = (kv.slot("a"), kv.slot("b"));
        assert_ne!(a, b);
        kv.leave("a", a);
        assert_eq!(kv.slot("c"), a, "a departed replica's slot is reused");
        assert_eq!(kv.slot("b"), b);
    }
}
