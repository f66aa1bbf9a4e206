//! The simulator's KV event stream against its own prefix cache: a consumer
//! that applies every batch knows exactly what the engine has cached, so it
//! predicts each request's cached tokens without error, through evictions,
//! a reset, cache salts, and sequence numbers skipped on purpose (filled by
//! replay).
//!
//! A PUB socket drops what it sends before the subscription reaches it, so
//! each test first sends small requests until a batch arrives live, and
//! fetches what came before from the replay service. From then on every
//! wait is for a sequence number the simulator says it has published.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use common::{json, post, start};
use inferrail_kv_events::publish::Skip;
use inferrail_kv_events::subscribe::{Subscriber, SubscriberConfig, replay};
use inferrail_kv_events::wire::{EventBatch, ExtraKey, KvEvent};
use inferrail_sim::Sim;
use serde_json::json;

const BS: usize = 4;
const TOPIC: &str = "kv-events";

/// What a consumer knows of the engine's cache: each block by its parent,
/// its first block's extra keys and its tokens, as a router maps them. A
/// block computed twice in one step is cached twice, as in vLLM: copies count.
#[derive(Default)]
struct Model {
    by_content: HashMap<Content, u64>,
    by_hash: HashMap<u64, (Content, u32)>,
}

/// A block's parent, its cache salt (first blocks only) and its tokens.
type Content = (Option<u64>, Option<String>, Vec<u32>);

impl Model {
    fn apply(&mut self, seq: u64, batch: &EventBatch) {
        for event in &batch.events {
            match event {
                KvEvent::BlockStored(s) => {
                    assert_eq!((s.block_size as usize, s.medium.as_deref(), s.group_idx), (BS, Some("GPU"), Some(0)), "seq {seq}");
                    assert_eq!((s.lora_id, s.lora_name.as_deref(), s.kv_cache_spec_kind.as_deref()), (None, None, Some("full_attention")));
                    assert_eq!(s.token_ids.len(), s.block_hashes.len() * BS);
                    let extra = s.extra_keys.clone().unwrap_or_default();
                    assert_eq!(extra.len(), s.block_hashes.len());
                    let mut parent = s.parent_block_hash;
                    for (i, &hash) in s.block_hashes.iter().enumerate() {
                        if let Some(p) = parent {
                            assert!(self.by_hash.contains_key(&p), "seq {seq}: block {hash} stored under an unknown parent {p}");
                        }
                        let salt = match extra[i].as_deref() {
                            Some([ExtraKey::Str(salt)]) => Some(salt.clone()),
                            None => None,
                            other => panic!("unexpected extra keys {other:?}"),
                        };
                        let key = (parent, salt, s.token_ids[i * BS..(i + 1) * BS].to_vec());
                        let copy = self.by_hash.entry(hash).or_insert((key.clone(), 0));
                        assert_eq!(copy.0, key, "seq {seq}: block {hash} stored again with other content");
                        copy.1 += 1;
                        self.by_content.insert(key, hash);
                        parent = Some(hash);
                    }
                }
                KvEvent::BlockRemoved(r) => {
                    assert_eq!(r.block_hashes.len(), 1, "vLLM removes one block per event");
                    for hash in &r.block_hashes {
                        let copy = self.by_hash.get_mut(hash).unwrap_or_else(|| panic!("seq {seq}: removed {hash}, which was not cached"));
                        copy.1 -= 1;
                        if copy.1 == 0 {
                            let (key, _) = self.by_hash.remove(hash).unwrap_or_default();
                            self.by_content.remove(&key);
                        }
                    }
                }
                KvEvent::AllBlocksCleared => {
                    self.by_content.clear();
                    self.by_hash.clear();
                }
            }
        }
    }

    /// Cached tokens the engine will report for `prompt`: whole blocks, never
    /// the last token.
    fn predict(&self, prompt: &[u32], salt: Option<&str>) -> usize {
        let mut parent = None;
        let mut blocks = 0;
        for (k, block) in prompt[..prompt.len() - 1].chunks_exact(BS).enumerate() {
            let key = (parent, salt.filter(|_| k == 0).map(str::to_owned), block.to_vec());
            match self.by_content.get(&key) {
                Some(&hash) => parent = Some(hash),
                None => break,
            }
            blocks += 1;
        }
        blocks * BS
    }
}

/// The stream as the test consumes it: live messages, gaps filled by replay.
struct Stream {
    sub: Subscriber,
    replay_at: String,
    skip: Skip,
    model: Model,
    applied: u64,
    pending: BTreeMap<u64, EventBatch>,
    /// Sequence numbers that never arrived live and came from replay.
    replayed: Vec<u64>,
    batches: Vec<EventBatch>,
}

impl Stream {
    /// Brings the model up to every batch `sim` has published.
    async fn sync(&mut self, sim: &Sim) {
        let published = sim.app.engine.kv_events().map(|p| p.stats().published).unwrap_or_default();
        // Wait for the last batch that is sent live; the rest come by replay.
        if let Some(last) = (self.applied..published).rev().find(|&s| !self.skip.skips(s)) {
            while self.pending.last_key_value().is_none_or(|(&s, _)| s < last) {
                let (seq, batch) = match tokio::time::timeout(Duration::from_secs(10), self.sub.next()).await {
                    Ok(Ok(m)) => m,
                    other => panic!("waiting for seq {last}: {other:?}"),
                };
                self.pending.insert(seq, batch);
            }
        }
        let gaps: Vec<u64> = (self.applied..published).filter(|s| !self.pending.contains_key(s)).collect();
        if let Some(&first) = gaps.first() {
            let replayed = replay(&self.replay_at, first, Duration::from_secs(10)).await.unwrap_or_else(|e| panic!("{e}"));
            for (seq, batch) in replayed {
                if gaps.contains(&seq) {
                    self.pending.insert(seq, batch);
                    self.replayed.push(seq);
                }
            }
        }
        while let Some(batch) = self.pending.remove(&self.applied) {
            self.model.apply(self.applied, &batch);
            self.batches.push(batch);
            self.applied += 1;
        }
        assert_eq!(self.applied, published, "every batch up to the last published one, in order");
    }
}

/// A simulator with a small cache publishing to a subscriber, attached.
async fn attached(skip: Option<&str>) -> (Sim, Stream) {
    let sub = Subscriber::start(&SubscriberConfig::new("tcp://127.0.0.1:0", TOPIC)).await.unwrap_or_else(|e| panic!("{e}"));
    let config = json!({
        "enable_kv_cache_events": true, "publisher": "zmq", "endpoint": sub.endpoint(),
        "replay_endpoint": "tcp://127.0.0.1:*", "topic": TOPIC,
    })
    .to_string();
    let mut flags = vec![
        "--zero-latency",
        "--enable-prompt-tokens-details",
        "--block-size",
        "4",
        "--num-gpu-blocks-override",
        "24",
        "--max-model-len",
        "96",
        "--seed",
        "5",
        "--kv-events-config",
        &config,
    ];
    if let Some(s) = skip {
        flags.extend(["--kv-events-skip", s]);
    }
    let sim = start(&flags).await;
    let publisher = sim.app.engine.kv_events().unwrap_or_else(|| panic!("events are on"));
    let replay_at = publisher.replay_endpoint().unwrap_or_default().to_owned();
    let skip = skip.map(|s| Skip::parse(s, 5).unwrap_or_else(|e| panic!("{e}"))).unwrap_or(Skip::Never);
    let mut stream = Stream {
        sub,
        replay_at,
        skip,
        model: Model::default(),
        applied: 0,
        pending: BTreeMap::new(),
        replayed: Vec::new(),
        batches: Vec::new(),
    };
    // Small requests (one full block each) until one batch arrives live.
    for i in 0..400u32 {
        complete(&sim, &[4000 + i, 1, 2, 3, 9], None).await;
        if let Ok(m) = tokio::time::timeout(Duration::from_millis(50), stream.sub.next()).await {
            let (seq, batch) = m.unwrap_or_else(|e| panic!("{e}"));
            stream.pending.insert(seq, batch);
            stream.sync(&sim).await;
            stream.replayed.clear();
            return (sim, stream);
        }
    }
    panic!("no KV event batch arrived in 20 s");
}

/// Runs a completion of `prompt` (token ids); returns its cached tokens.
async fn complete(sim: &Sim, prompt: &[u32], salt: Option<&str>) -> usize {
    let mut body = json!({"model": "inferrail/sim-8b", "prompt": prompt, "max_tokens": 6});
    if let Some(s) = salt {
        body["cache_salt"] = json!(s);
    }
    let (status, text) = post(sim, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{text}");
    json(&text)["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(u64::MAX) as usize
}

/// `n` tokens of prompt family `f`: families share nothing, a longer
/// prompt of a family extends a shorter one.
fn prompt(f: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 100 + f * 200 + i).collect()
}

/// Sends each request after predicting its cached tokens from the stream
/// alone; returns how many predictions were of a hit.
async fn predict_and_send(sim: &Sim, stream: &mut Stream, requests: &[(Vec<u32>, Option<&str>)]) -> usize {
    let mut hits = 0;
    for (i, (p, salt)) in requests.iter().enumerate() {
        stream.sync(sim).await;
        let predicted = stream.model.predict(p, *salt);
        let reported = complete(sim, p, *salt).await;
        assert_eq!(reported, predicted, "request {i} ({} tokens, salt {salt:?})", p.len());
        hits += usize::from(predicted > 0);
    }
    stream.sync(sim).await;
    hits
}

#[tokio::test]
async fn the_stream_describes_the_cache_exactly_through_evictions_and_a_reset() {
    let (sim, mut stream) = attached(None).await;
    // 24 blocks of 4 tokens: each request takes 6 to 10 blocks with its
    // reply, so three families (each extended right away, a hit) and a salted
    // pair cannot all stay; later requests evict earlier ones.
    let mut requests = Vec::new();
    for round in 0..3 {
        for f in 0..3 {
            requests.push((prompt(f, 20 + 6 * round), None));
            requests.push((prompt(f, 24 + 6 * round), None));
        }
        requests.push((prompt(9, 21), Some("tenant-a")));
        requests.push((prompt(9, 21), None));
        requests.push((prompt(9, 21), Some("tenant-a")));
    }
    let hits = predict_and_send(&sim, &mut stream, &requests).await;
    assert!(hits >= 9, "the workload must reuse prefixes ({hits} hits)");
    let removed = stream.batches.iter().flat_map(|b| &b.events).filter(|e| matches!(e, KvEvent::BlockRemoved(_))).count();
    assert!(removed > 24, "the workload must evict ({removed} removals)");
    // Within a batch, a sequence's evictions come before what it stores.
    for b in &stream.batches {
        let first_store = b.events.iter().position(|e| matches!(e, KvEvent::BlockStored(_)));
        let last_removal = b.events.iter().rposition(|e| matches!(e, KvEvent::BlockRemoved(_)));
        if let (Some(s), Some(r)) = (first_store, last_removal) {
            assert!(r < s, "{b:?}");
        }
    }

    // A reset is published with the next step, first in its batch; before
    // that, the stream still says the prefix is cached (as with vLLM).
    let warm = prompt(9, 21);
    assert!(stream.model.predict(&warm, Some("tenant-a")) > 0);
    let before = stream.applied;
    let (status, _) = post(&sim, "/reset_prefix_cache", &json!({})).await;
    assert_eq!(status, 200);
    stream.sync(&sim).await;
    assert_eq!(stream.applied, before, "an idle engine publishes the reset with its next step");
    assert_eq!(complete(&sim, &warm, Some("tenant-a")).await, 0);
    stream.sync(&sim).await;
    assert_eq!(stream.batches[before as usize].events.first(), Some(&KvEvent::AllBlocksCleared));
    // After it the stream is exact again.
    let hits = predict_and_send(&sim, &mut stream, &[(warm.clone(), Some("tenant-a")), (prompt(1, 30), None), (warm, None)]).await;
    assert_eq!(hits, 1);
}

#[tokio::test]
async fn skipped_sequence_numbers_are_gaps_that_replay_fills() {
    let (sim, mut stream) = attached(Some("rate:0.3")).await;
    let after_attach = stream.applied;
    let requests: Vec<(Vec<u32>, Option<&str>)> = (0..24).map(|i| (prompt(i % 5, 17 + (i as usize % 3) * 7), None)).collect();
    predict_and_send(&sim, &mut stream, &requests).await;
    let skipped: Vec<u64> = (after_attach..stream.applied).filter(|&s| stream.skip.skips(s)).collect();
    assert!(!skipped.is_empty());
    stream.replayed.sort_unstable();
    assert_eq!(stream.replayed, skipped, "exactly the skipped numbers were missing live");
    let stats = sim.app.engine.kv_events().map(|p| p.stats()).unwrap_or_default();
    assert_eq!(stats.skipped, (0..stats.published).filter(|&s| stream.skip.skips(s)).count() as u64);
    let (_, text) = common::get(&sim, "/_sim/kv_events").await;
    assert_eq!(json(&text)["skipped"], stats.skipped);
}

#[tokio::test]
async fn events_are_off_without_the_flag() {
    let sim = start(&["--zero-latency"]).await;
    assert!(sim.app.engine.kv_events().is_none());
    assert_eq!(common::get(&sim, "/_sim/kv_events").await.1, r#"{"enabled":false}"#);
    let bad = Sim::start(inferrail_sim::args::Args::for_test(&["--kv-events-skip", "rate:0.5"])).await.err().map(|e| format!("{e:#}"));
    assert!(bad.is_some_and(|e| e.contains("--kv-events-skip needs KV events on")));
    let bad = Sim::start(inferrail_sim::args::Args::for_test(&["--kv-events-config", r#"{"enable_kv_cache_events":true,"bogus":1}"#]))
        .await
        .err()
        .map(|e| format!("{e:#}"));
    assert!(bad.is_some_and(|e| e.contains("unknown field `bogus`")));
}
