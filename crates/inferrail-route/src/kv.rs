//! What each replica's KV cache is predicted to hold, and the prompt's cached
//! tokens on every candidate.
//!
//! Each replica has a slot in the approximate index (`inferrail_kv`), a block
//! size and a capacity, which the caller resolves (configured, else learned
//! from the engine, else the `kv` defaults) and passes in as plain values, so
//! this module knows nothing of replicas. A prompt is cut into the
//! candidates' blocks and hashed once per block size; the index says how
//! many leading blocks each holds. The winner records the prompt (taken back
//! if the engine refuses it); its first token and its end tell the index
//! when its output fills blocks, and lookups first bring the candidates'
//! caches to the time of the decision.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use inferrail_config::Kv as KvConfig;
use inferrail_kv::hash::{BlockHash, block_hashes, salt};
use inferrail_kv::index::{KvIndex, Pace, Recorded, Reply, Slot, Wait, predicted_cached_tokens};
use inferrail_policy::Offloaded;

/// A prompt as the engine will see it, and what the KV index needs besides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Output tokens asked for, when the request says.
    pub max_tokens: Option<usize>,
    /// The request's `cache_salt`, which keeps its blocks apart.
    pub cache_salt: Option<String>,
    /// The LoRA adapter it asks for, whose blocks are its own.
    pub adapter: Option<String>,
    /// Where in `ids` the special tokens are (the chat template's turn
    /// markers), in order: a resent reply ends at the first after it.
    pub special_at: Vec<usize>,
}

/// Where a replica's cache is in the index: its slot and block size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    /// Its slot.
    pub slot: Slot,
    /// Tokens per block.
    pub block_size: usize,
    /// Tokens after a block that its engine hash also covers (vLLM 0.33's
    /// lookahead hashing, ADR 0058): the engine finds no block of a prompt
    /// that ends fewer than this many tokens before the prompt does.
    pub lookahead: usize,
    /// Where the request's LoRA adapter must wait for a slot: the other
    /// adapters waiting there first ([`Wait::adapter_ahead`]).
    pub adapter_ahead: Option<usize>,
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
    /// Output tokens the request asked for at most, if it said.
    asked: Option<usize>,
    /// Block hashes by block size.
    hashes: Vec<(usize, Vec<BlockHash>)>,
    /// The prompt's ids and where its special tokens are, to find the
    /// replies it resends; empty for a prompt another router recorded.
    ids: Vec<u32>,
    special_at: Vec<usize>,
    /// The LoRA adapter the prompt asks for.
    pub adapter: Option<Arc<str>>,
}

impl Prediction {
    /// A prompt of `prompt_tokens` cut at one block size, as another router
    /// recorded it: its blocks' hashes at `block_size` and the output it expected.
    pub fn of_blocks(prompt_tokens: usize, output_tokens: usize, block_size: usize, hashes: Vec<BlockHash>) -> Self {
        Self { prompt_tokens, output_tokens, hashes: vec![(block_size, hashes)], ..Self::default() }
    }

    /// Output tokens expected.
    pub fn output_tokens(&self) -> usize {
        self.output_tokens
    }

    /// The same prompt as a split request's prefill leg sends it: one output token.
    pub fn prefill_leg(&self) -> Self {
        Self {
            prompt_tokens: self.prompt_tokens,
            output_tokens: 1,
            asked: Some(1),
            hashes: self.hashes.clone(),
            ids: self.ids.clone(),
            special_at: self.special_at.clone(),
            adapter: self.adapter.clone(),
        }
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
pub struct Record(Recorded, Pace);

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

    /// Gives an approximate slot room for `blocks`, keeping what it holds;
    /// false for one in exact mode (which [`Kv::reset`] restarts instead).
    pub fn resize(&self, slot: Slot, blocks: usize) -> bool {
        self.index.resize_replica(slot, blocks)
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

    /// Cuts a prompt of `model` (or of its adapter, if it asks for one)
    /// into blocks of each of `block_sizes`.
    pub fn prepare(&self, model: &str, prompt: &Prompt, block_sizes: impl IntoIterator<Item = usize>) -> Prediction {
        let chain = seed(prompt.adapter.as_deref().unwrap_or(model), prompt.cache_salt.as_deref());
        let mut hashes: Vec<(usize, Vec<BlockHash>)> = Vec::new();
        for bs in block_sizes {
            if !hashes.iter().any(|(b, _)| *b == bs) {
                hashes.push((bs, block_hashes(chain, &prompt.ids, bs)));
            }
        }
        let output_tokens = prompt.max_tokens.unwrap_or(self.defaults.expected_output_tokens).max(1);
        Prediction {
            prompt_tokens: prompt.ids.len(),
            output_tokens,
            asked: prompt.max_tokens,
            hashes,
            ids: prompt.ids.clone(),
            special_at: prompt.special_at.clone(),
            adapter: prompt.adapter.as_deref().map(Arc::from),
        }
    }

    /// Blocks past the `depth` leading ones `slot` holds that the engine
    /// holds too because the prompt resends a reply it generated: the reply
    /// kept after the prompt's block `depth - 1`, when the prompt goes on
    /// with that request's prompt tail and then the reply up to the next
    /// special token (the end of the turn). The engine computed the reply's
    /// tokens but the last it generated: a reply cut at the request's
    /// `max_tokens`, all but its last; one that ended at a stop token, all.
    /// Assumes the client resent the reply as it came (the usual agent
    /// loop and chat); the engine's usage shows where it did not.
    fn reply_blocks(&self, p: &Prediction, slot: Slot, bs: usize, depth: usize) -> usize {
        let Some(hashes) = p.blocks(bs) else { return 0 };
        if !self.defaults.resent_replies || depth == 0 || depth > hashes.len() || p.ids.is_empty() {
            return 0;
        }
        let Some((reply, held)) = self.index.reply(slot, hashes[depth - 1]) else { return 0 };
        let n = reply.prompt_tokens;
        if n / bs != depth || n >= p.ids.len() || p.ids[depth * bs..n] != reply.tail[..] {
            return 0;
        }
        let Some(&end) = p.special_at.get(p.special_at.partition_point(|&at| at < n)) else { return 0 };
        let resent = end - n;
        let computed = match reply.asked {
            Some(asked) if resent > asked => return 0,
            Some(asked) if resent == asked => n + resent - 1,
            _ => n + resent,
        };
        (computed / bs).saturating_sub(depth).min(held).min(hashes.len() - depth)
    }

    /// Predicted cached tokens of the prompt at each place, and of those the
    /// ones a request in flight there holds, for a request sent at `now`;
    /// one index pass per block size.
    pub fn cached(&self, p: &Prediction, places: &[Place], now: Duration) -> Vec<(usize, usize)> {
        let mut cached = vec![(0, 0); places.len()];
        let mut slots: Vec<Slot> = Vec::with_capacity(places.len());
        for (bs, hashes) in &p.hashes {
            slots.clear();
            slots.extend(places.iter().filter(|pl| pl.block_size == *bs).map(|pl| pl.slot));
            let at = places.iter().enumerate().filter(|(_, pl)| pl.block_size == *bs).map(|(i, _)| i);
            // Where the prompt must wait for room, what the running requests grow into meanwhile is gone.
            let prompt_blocks = p.prompt_tokens.div_ceil(*bs);
            let ahead = places.iter().filter(|pl| pl.block_size == *bs).map(|pl| pl.adapter_ahead);
            let waits: Vec<Wait> = slots
                .iter()
                .zip(self.index.matched(hashes, &slots))
                .zip(ahead)
                .map(|((&slot, matched), adapter_ahead)| Wait { slot, matched, need: prompt_blocks.saturating_sub(matched), adapter_ahead })
                .collect();
            let depths: Vec<(Slot, usize)> = slots.iter().copied().zip(self.index.kept_through_wait(hashes, &waits, now)).collect();
            for ((i, &(slot, matched)), held) in at.zip(&depths).zip(self.index.held(hashes, &depths)) {
                let matched = matched + self.reply_blocks(p, slot, *bs, matched);
                // The last prompt token is never cached; with lookahead, the last `lookahead`.
                let hashed = p.prompt_tokens.saturating_sub(places[i].lookahead.saturating_sub(1));
                let tokens = predicted_cached_tokens(matched, hashed, *bs);
                cached[i] = (tokens, (held * bs).min(tokens));
            }
        }
        cached
    }

    /// What each place's engine holds of the prompt right after the GPU
    /// prefix `cached` says it has (its tokens, as [`Self::cached`] gives
    /// them), in offload tiers: tokens it will load, up to the prompt's last
    /// full block (the engine's lookup there reaches it). Known where the
    /// engine's events are followed.
    pub fn offloaded(&self, p: &Prediction, places: &[Place], cached: &[(usize, usize)]) -> Vec<Offloaded> {
        let mut out = vec![Offloaded::default(); places.len()];
        for (bs, hashes) in &p.hashes {
            let at: Vec<usize> = (0..places.len()).filter(|&i| places[i].block_size == *bs).collect();
            let from: Vec<(Slot, usize)> = at.iter().map(|&i| (places[i].slot, cached[i].0 / bs)).collect();
            for (&i, (host, disk)) in at.iter().zip(self.index.offloaded(hashes, &from)) {
                out[i] = Offloaded { host: host * bs, disk: disk * bs };
            }
        }
        out
    }

    /// Records the prompt at the place it goes to.
    pub fn record(&self, p: &Prediction, at: Place) -> Record {
        let bs = at.block_size;
        let hashes = p.blocks(bs).unwrap_or_default();
        let n = p.prompt_tokens;
        // The engine holds every token it computed: the prompt, then all but the last generated one.
        let prompt_blocks = n.div_ceil(bs);
        // `max_tokens` is the client's: any number, summed without overflow.
        let tokens = n.saturating_add(p.output_tokens);
        let output_blocks = tokens.saturating_sub(1).div_ceil(bs).saturating_sub(prompt_blocks);
        let partial = prompt_blocks.saturating_sub(hashes.len());
        let ends_partial = !tokens.saturating_sub(1).is_multiple_of(bs);
        // A resent reply's blocks take their names first, so the request reuses them.
        let depth = self.index.matched(hashes, &[at.slot])[0];
        let named = self.reply_blocks(p, at.slot, bs, depth);
        if named > 0 {
            self.index.adopt(at.slot, hashes[depth - 1], &hashes[depth..depth + named]);
        }
        // The prompt's last block has room for this many tokens before the output needs a block.
        let room = (prompt_blocks * bs - n) as f64 / bs as f64;
        let pace = Pace { lead: room, span: p.output_tokens as f64 / bs as f64 };
        let recorded = self.index.record(at.slot, hashes, n.saturating_sub(1) / bs, partial, output_blocks, ends_partial, Some(pace));
        if let Some(adapter) = &p.adapter {
            self.index.adapter(&recorded, xxhash_rust::xxh3::xxh3_64(adapter.as_bytes()));
        }
        if !p.ids.is_empty() {
            let full = hashes.len();
            self.index.expect_reply(&recorded, Reply { prompt_tokens: n, asked: p.asked, tail: p.ids[full * bs..].to_vec() }, full);
        }
        Record(recorded, pace)
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

    /// The request completed at `at`: the engine freed its blocks (once per record).
    pub fn complete(&self, rec: &Record, at: Duration) {
        self.index.complete(&rec.0, at);
    }

    /// The request's first token came at `at`: its output fills blocks from then on.
    pub fn decoding(&self, rec: &Record, at: Duration) {
        self.index.decoding(&rec.0, at, rec.1);
    }

    /// Brings the caches at `places` to `now`: the blocks requests running there have filled since their first token.
    pub fn advance(&self, places: &[Place], now: Duration) {
        let slots: Vec<Slot> = places.iter().map(|pl| pl.slot).collect();
        self.index.advance(&slots, now);
    }

    /// Entries in the index (blocks held, over all replicas).
    pub fn entries(&self) -> usize {
        self.index.entries()
    }

    /// Entries in the index for the replica in `slot`.
    pub fn entries_of(&self, slot: Slot) -> usize {
        self.index.entries_of(slot)
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
        Prompt { ids: (0..n).collect(), max_tokens: Some(1), cache_salt: None, adapter: None, special_at: Vec::new() }
    }

    /// An index over replicas `a` and `b` of 100 blocks, with these block sizes.
    fn two_replicas(config: KvConfig, sizes: [usize; 2]) -> (Kv, Place, Place) {
        let kv = Kv::new(config);
        let (a, b) = (kv.slot("a"), kv.slot("b"));
        kv.reset(a, 100);
        kv.reset(b, 100);
        (
            kv,
            Place { slot: a, block_size: sizes[0], lookahead: 0, adapter_ahead: None },
            Place { slot: b, block_size: sizes[1], lookahead: 0, adapter_ahead: None },
        )
    }

    #[test]
    fn any_max_tokens_is_recorded_paced_and_completed() {
        let (kv, pa, _) = two_replicas(KvConfig::default(), [16, 16]);
        let huge = Prompt { max_tokens: Some(usize::MAX), ..prompt(40) };
        let rec = kv.record(&kv.prepare("m", &huge, [16]), pa);
        kv.decoding(&rec, Duration::from_secs(1));
        kv.advance(&[pa], Duration::from_secs(2));
        kv.complete(&rec, Duration::from_secs(3));
        assert!(kv.entries_of(pa.slot) <= 100, "no more than the cache: {}", kv.entries_of(pa.slot));
        assert_eq!(kv.cached(&kv.prepare("m", &prompt(40), [16]), &[pa], Duration::from_secs(3)), [(32, 0)]);
    }

    #[test]
    fn a_recorded_prompt_is_predicted_at_its_place_and_block_size_only() {
        let (kv, pa, pb) = two_replicas(KvConfig::default(), [16, 32]);
        let p = kv.prepare("m", &prompt(100), [16, 32, 16]);
        assert_eq!(p.hashes.len(), 2, "hashed once per block size");
        kv.record(&p, pa);
        assert_eq!(
            kv.cached(&p, &[pa, pb], Duration::ZERO),
            [(96, 96), (0, 0)],
            "the request recorded holds its blocks until it completes"
        );
        kv.clear(pa.slot);
        assert_eq!(kv.cached(&p, &[pa, pb], Duration::ZERO), [(0, 0), (0, 0)]);
        let salted = kv.prepare("m", &Prompt { cache_salt: Some("s".into()), ..prompt(100) }, [16]);
        kv.record(&p, pa);
        assert_eq!(kv.cached(&salted, &[pa], Duration::ZERO), [(0, 0)], "a cache salt keeps blocks apart");
    }

    #[test]
    fn with_lookahead_hashing_the_blocks_ending_within_the_last_tokens_are_not_found() {
        let (kv, pa, _) = two_replicas(KvConfig::default(), [4, 4]);
        // 18 tokens: blocks end at 4, 8, 12, 16. Without lookahead (or with
        // EAGLE's one token) the last token alone is never cached: 16; with
        // three tokens of lookahead the block ending at 16 is not hashed yet: 12.
        let p = kv.prepare("m", &prompt(18), [4]);
        kv.complete(&kv.record(&p, pa), Duration::ZERO);
        let cached = |lookahead| kv.cached(&p, &[Place { lookahead, ..pa }], Duration::ZERO)[0].0;
        assert_eq!((cached(0), cached(1), cached(2), cached(3), cached(6)), (16, 16, 16, 12, 12));
        assert_eq!(cached(100), 0, "more lookahead than prompt");
    }

    /// `prompt` then `reply`, the end of the turn (a special token), and `more`.
    fn next_turn(prompt: &Prompt, reply: std::ops::Range<u32>, more: std::ops::Range<u32>, max_tokens: Option<usize>) -> Prompt {
        let mut ids = prompt.ids.clone();
        ids.extend(reply);
        let end = ids.len();
        ids.push(7);
        ids.extend(more);
        let mut special_at = prompt.special_at.clone();
        special_at.push(end);
        Prompt { ids, max_tokens, cache_salt: None, adapter: None, special_at }
    }

    #[test]
    fn a_resent_reply_is_predicted_where_it_was_generated() {
        let (kv, pa, pb) = two_replicas(KvConfig::default(), [16, 16]);
        // 40 prompt tokens, a reply cut at its 20 max_tokens: the engine computed 59 tokens, 3 full blocks.
        let first = Prompt { max_tokens: Some(20), ..prompt(40) };
        kv.complete(&kv.record(&kv.prepare("m", &first, [16]), pa), Duration::ZERO);
        let second = next_turn(&first, 1_000..1_020, 2_000..2_030, Some(10));
        let p = kv.prepare("m", &second, [16]);
        assert_eq!(kv.cached(&p, &[pa, pb], Duration::ZERO), [(48, 0), (0, 0)], "the prompt's 2 full blocks and the one its reply filled");
        kv.complete(&kv.record(&p, pa), Duration::ZERO);
        // The reply's blocks were named by the second turn: a copy of it finds them by hash.
        assert_eq!(kv.cached(&kv.prepare("m", &second, [16]), &[pa], Duration::ZERO), [(80, 0)], "91 tokens: 5 full blocks");
        // A reply that ended at a stop token (5 of 10): all its tokens were computed, 96 tokens in all.
        let third = next_turn(&second, 3_000..3_005, 4_000..4_020, Some(10));
        assert_eq!(kv.cached(&kv.prepare("m", &third, [16]), &[pa, pb], Duration::ZERO), [(96, 0), (0, 0)]);
        // A turn that changed the earlier prompt's last tokens resends no reply of this replica's.
        let mut edited = second.clone();
        edited.ids[35] = 999;
        assert_eq!(kv.cached(&kv.prepare("m", &edited, [16]), &[pa], Duration::ZERO), [(32, 0)]);
    }

    #[test]
    fn replies_are_not_predicted_when_clients_do_not_resend_them() {
        let (kv, pa, _) = two_replicas(KvConfig { resent_replies: false, ..KvConfig::default() }, [16, 16]);
        let first = Prompt { max_tokens: Some(20), ..prompt(40) };
        kv.complete(&kv.record(&kv.prepare("m", &first, [16]), pa), Duration::ZERO);
        let second = next_turn(&first, 1_000..1_020, 2_000..2_030, None);
        assert_eq!(kv.cached(&kv.prepare("m", &second, [16]), &[pa], Duration::ZERO), [(32, 0)]);
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
