//! The host tier through the HTTP API and the KV event stream: a prompt the
//! GPU evicted is loaded back and reported cached, and the tier's events
//! come in both of vLLM's forms (placeholders naming the GPU block's hash,
//! or self-describing with tokens and parents), after the GPU's own.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{get, json, metric, post, start};
use inferrail_kv_events::subscribe::{Subscriber, SubscriberConfig, replay};
use inferrail_kv_events::wire::{BlockStored, EventBatch, KvEvent};
use inferrail_sim::Sim;
use serde_json::json;

/// 2^-14 GiB: 16 blocks of 4 tokens at 1,024 bytes a token.
const HOST_GIB: &str = "0.00006103515625";

async fn offloading(extra: &[&str]) -> (Sim, Subscriber) {
    let sub = Subscriber::start(&SubscriberConfig::new("tcp://127.0.0.1:0", "")).await.unwrap_or_else(|e| panic!("{e}"));
    let events = json!({"enable_kv_cache_events": true, "endpoint": sub.endpoint(), "replay_endpoint": "tcp://127.0.0.1:*"}).to_string();
    let mut flags = vec![
        "--zero-latency",
        "--enable-prompt-tokens-details",
        "--block-size",
        "4",
        "--num-gpu-blocks-override",
        "5",
        "--max-model-len",
        "20",
        "--kv-cache-bytes-per-token",
        "1024",
        "--kv-offloading-size",
        HOST_GIB,
        "--kv-events-config",
        &events,
    ];
    flags.extend(extra);
    (start(&flags).await, sub)
}

async fn cached(sim: &Sim, prompt: &[u32]) -> u64 {
    let (status, text) = post(sim, "/v1/completions", &json!({"model": "inferrail/sim-8b", "prompt": prompt, "max_tokens": 1})).await;
    assert_eq!(status, 200, "{text}");
    json(&text)["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(u64::MAX)
}

/// Every batch the simulator published, read back from its replay service
/// once it holds `host_stores` host stores: the last copies end in steps
/// the engine takes after the last answer went out.
async fn batches(sim: &Sim, host_stores: usize) -> Vec<EventBatch> {
    let publisher = sim.app.engine.kv_events().unwrap_or_else(|| panic!("events are on"));
    let at = publisher.replay_endpoint().unwrap_or_default().to_owned();
    for _ in 0..200 {
        let published = publisher.stats().published;
        let batches: Vec<EventBatch> =
            replay(&at, 0, Duration::from_secs(10)).await.unwrap_or_else(|e| panic!("{e}")).into_iter().map(|(_, b)| b).collect();
        assert!(batches.len() as u64 >= published, "replay holds every batch published");
        if stored(&batches, "CPU").len() >= host_stores {
            return batches;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("fewer than {host_stores} host stores were published");
}

fn stored(batches: &[EventBatch], medium: &str) -> Vec<BlockStored> {
    let events = batches.iter().flat_map(|b| &b.events);
    events
        .filter_map(|e| if let KvEvent::BlockStored(s) = e { Some(s.clone()) } else { None })
        .filter(|s| s.medium.as_deref() == Some(medium))
        .collect()
}

/// A: 12 tokens, then B and C evict it from the five GPU blocks, then A
/// again with two tokens more finds A's three blocks in the host tier.
async fn evict_and_reload(sim: &Sim) {
    let a: Vec<u32> = (10..22).collect();
    assert_eq!(cached(sim, &a).await, 0);
    assert_eq!(cached(sim, &(100..116).collect::<Vec<u32>>()).await, 0);
    assert_eq!(cached(sim, &(200..216).collect::<Vec<u32>>()).await, 0);
    let mut longer = a;
    longer.extend([7, 7]);
    assert_eq!(cached(sim, &longer).await, 12, "all from the host tier");
    let page = get(sim, "/metrics").await.1;
    let labels = |source: &str| format!("engine=\"0\",model_name=\"inferrail/sim-8b\",source=\"{source}\"");
    assert_eq!(metric(&page, "vllm:prompt_tokens_cached_by_source_total", &labels("host")), 12.0);
    assert_eq!(metric(&page, "vllm:prompt_tokens_cached_by_source_total", &labels("device")), 0.0);
    assert_eq!(metric(&page, "vllm:kv_offload_load_bytes_total", "engine=\"0\",model_name=\"inferrail/sim-8b\""), 3.0 * 4096.0);
    let config = page.lines().find(|l| l.starts_with("vllm:cache_config_info")).unwrap_or_default();
    // As Python prints the float.
    assert!(config.contains("kv_offloading_size=\"6.103515625e-05\""), "{config}");
}

#[tokio::test]
async fn placeholders_name_the_gpu_blocks_hashes_after_the_gpu_events() {
    let (sim, _sub) = offloading(&[]).await;
    evict_and_reload(&sim).await;
    let batches = batches(&sim, 11).await;
    let gpu = stored(&batches, "GPU");
    let host = stored(&batches, "CPU");
    // A's 3 blocks, B's 4 and C's 4, one event a block, no tokens, no parent, no block size.
    assert_eq!(host.len(), 11);
    for s in &host {
        assert_eq!((s.block_hashes.len(), s.parent_block_hash, s.token_ids.len(), s.block_size), (1, None, 0, 0), "{s:?}");
        assert_eq!(
            (s.lora_name.as_deref(), s.extra_keys.as_ref(), s.kv_cache_spec_kind.as_deref(), s.group_idx),
            (None, None, None, Some(0))
        );
    }
    // Each names a block the GPU stored in an earlier batch.
    let first_gpu: HashMap<u64, usize> = batches
        .iter()
        .enumerate()
        .flat_map(|(i, b)| b.events.iter().map(move |e| (i, e)))
        .filter_map(|(i, e)| match e {
            KvEvent::BlockStored(s) if s.medium.as_deref() == Some("GPU") => Some(s.block_hashes.iter().map(move |&h| (h, i))),
            _ => None,
        })
        .flatten()
        .rev()
        .collect();
    for (i, b) in batches.iter().enumerate() {
        for e in &b.events {
            if let KvEvent::BlockStored(s) = e
                && s.medium.as_deref() == Some("CPU")
            {
                let at = first_gpu.get(&s.block_hashes[0]).unwrap_or_else(|| panic!("{s:?} names no GPU block"));
                assert!(*at < i, "a host store is seen done a step after the GPU stored the block");
            }
        }
        // The GPU's events come first in a batch.
        let medium = |e: &KvEvent| match e {
            KvEvent::BlockStored(s) => s.medium.clone(),
            KvEvent::BlockRemoved(r) => r.medium.clone(),
            KvEvent::AllBlocksCleared => None,
        };
        let media: Vec<Option<String>> = b.events.iter().map(medium).collect();
        assert!(media.is_sorted_by_key(|m| m.as_deref() == Some("CPU")), "{media:?}");
    }
    // The reload stored A's blocks on the GPU again, under the same hashes.
    let a: Vec<u64> = gpu[0].block_hashes.clone();
    assert_eq!(gpu.iter().filter(|s| s.block_hashes.iter().any(|h| a.contains(h))).count(), 2, "{gpu:?}");
    assert!(batches.iter().flat_map(|b| &b.events).all(|e| !matches!(e, KvEvent::BlockRemoved(r) if r.medium.as_deref() == Some("CPU"))));
}

#[tokio::test]
async fn self_describing_events_carry_the_gpu_events_tokens_and_parents() {
    let transfer = json!({"kv_connector_extra_config": {"self_describing_kv_events": true}}).to_string();
    let (sim, _sub) = offloading(&["--kv-transfer-config", &transfer]).await;
    evict_and_reload(&sim).await;
    let batches = batches(&sim, 11).await;
    let mut gpu: HashMap<u64, (Option<u64>, Vec<u32>)> = HashMap::new();
    for s in stored(&batches, "GPU") {
        for (i, &h) in s.block_hashes.iter().enumerate() {
            let parent = if i == 0 { s.parent_block_hash } else { Some(s.block_hashes[i - 1]) };
            gpu.insert(h, (parent, s.token_ids[i * 4..(i + 1) * 4].to_vec()));
        }
    }
    let host = stored(&batches, "CPU");
    assert_eq!(host.len(), 11);
    for s in &host {
        assert_eq!((s.block_hashes.len(), s.block_size, s.extra_keys.as_ref()), (1, 4, None), "{s:?}");
        assert_eq!(gpu.get(&s.block_hashes[0]), Some(&(s.parent_block_hash, s.token_ids.clone())));
    }
}

#[tokio::test]
async fn a_full_host_tier_evicts_and_says_so() {
    // 16 host blocks; five prompts of four blocks each overflow it.
    let (sim, _sub) = offloading(&[]).await;
    for f in 0..5u32 {
        cached(&sim, &(f * 100..f * 100 + 16).collect::<Vec<u32>>()).await;
    }
    let batches = batches(&sim, 20).await;
    let removed: Vec<u64> = batches
        .iter()
        .flat_map(|b| &b.events)
        .filter_map(|e| match e {
            KvEvent::BlockRemoved(r) if r.medium.as_deref() == Some("CPU") => Some(r.block_hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    // The least recent prompt's four blocks, its last block first.
    let host = stored(&batches, "CPU");
    let first: Vec<u64> = host[..4].iter().map(|s| s.block_hashes[0]).collect();
    assert_eq!(removed, first.into_iter().rev().collect::<Vec<u64>>());
}
