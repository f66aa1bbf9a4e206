use super::*;

fn config(blocks: usize) -> OffloadConfig {
    OffloadConfig { blocks, block_secs: 0.001, block_bytes: 1 << 21, self_describing: false }
}

fn keys(r: std::ops::Range<u128>) -> Vec<BlockHash> {
    r.collect()
}

/// Offers `k` in step `step` and sees the store done in the next.
fn store(t: &mut CpuTier, k: &[BlockHash], step: u64, now: Instant) -> Vec<BlockHash> {
    let evicted = t.offer(k, step, now, |_| Vec::new()).unwrap_or_else(|| panic!("offer of {k:?} failed"));
    t.finish(step + 1, now + Duration::from_secs(1));
    evicted
}

#[test]
fn flags_size_the_tier_as_vllm_does() {
    // 1 GiB over 2 MiB blocks; a 1,000-byte block rounds up to a page.
    let c = OffloadConfig::from_flags(Some(1.0), "native", None, 16, 1 << 21, 25.0)
        .unwrap_or_else(|e| panic!("{e:#}"))
        .unwrap_or_else(|| panic!("no tier"));
    assert_eq!(c.blocks, 512);
    assert!((c.block_secs - (1 << 21) as f64 / 25e9).abs() < 1e-12);
    assert!(!c.self_describing);
    let c = OffloadConfig::from_flags(Some(1.0), "native", None, 16, 1000, 25.0)
        .unwrap_or_else(|e| panic!("{e:#}"))
        .unwrap_or_else(|| panic!("no tier"));
    assert_eq!(c.blocks, (1 << 30) / PAGE);
    let json = r#"{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"cpu_bytes_to_use":4194304,"self_describing_kv_events":true}}"#;
    let c = OffloadConfig::from_flags(None, "native", Some(json), 16, 1 << 21, 25.0)
        .unwrap_or_else(|e| panic!("{e:#}"))
        .unwrap_or_else(|| panic!("no tier"));
    assert_eq!((c.blocks, c.self_describing), (2, true));
    assert!(OffloadConfig::from_flags(None, "native", None, 16, 1 << 21, 25.0).is_ok_and(|c| c.is_none()));
    let nixl = r#"{"kv_connector":"NixlConnector","kv_role":"kv_both"}"#;
    assert!(OffloadConfig::from_flags(None, "native", Some(nixl), 16, 1 << 21, 25.0).is_ok_and(|c| c.is_none()));
    for (size, backend, json, says) in [
        (Some(0.0), "native", None, "positive"),
        (Some(1.0), "lmcache", None, "lmcache"),
        (Some(1.0), "native", Some(nixl), "NixlConnector"),
        (None, "native", Some(r#"{"kv_connector":"OffloadingConnector","kv_role":"kv_both"}"#), "cpu_bytes_to_use"),
        (None, "native", Some(r#"{"kv_connector":"OffloadingConnector","kv_connector_extra_config":{"cpu_bytes_to_use":1}}"#), "kv_role"),
        (Some(1.0), "native", Some(r#"{"kv_connector_extra_config":{"blocks_per_chunk":4}}"#), "more than one"),
        (Some(1.0), "native", Some(r#"{"kv_connector_extra_config":{"block_size":64}}"#), "more than one"),
        (Some(1.0), "native", Some(r#"{"kv_connector_extra_config":{"eviction_policy":"arc"}}"#), "arc"),
        (Some(1.0), "native", Some("nope"), "KVTransferConfig"),
    ] {
        let err = OffloadConfig::from_flags(size, backend, json, 16, 1 << 21, 25.0).err().map(|e| format!("{e:#}")).unwrap_or_default();
        assert!(err.contains(says), "{size:?} {backend} {json:?}: {err:?}");
    }
}

#[test]
fn a_store_is_loadable_only_once_a_later_step_sees_its_copy_done() {
    let now = Instant::now();
    let mut t = CpuTier::new(config(8), now);
    let k = keys(1..4);
    assert_eq!(t.offer(&k, 5, now, |fresh| fresh.iter().map(|_| KvEvent::AllBlocksCleared).collect()), Some(Vec::new()));
    assert!(t.holds(2));
    assert_eq!(t.lookup(&k), Found::Busy, "being stored");
    // The same step, or a later one before the copy ends, sees nothing done.
    assert!(t.finish(5, now + Duration::from_secs(1)).events.is_empty());
    assert!(t.finish(6, now + Duration::from_micros(2_999)).events.is_empty());
    assert_eq!(t.next_store(), Some(now + Duration::from_millis(3)));
    let done = t.finish(6, now + Duration::from_millis(3));
    assert_eq!((done.events.len(), done.stored.0), (3, 3));
    assert_eq!(t.lookup(&k), Found::Hit(3));
    assert_eq!(t.lookup(&[1, 2, 9, 3]), Found::Hit(2), "consecutive from the first");
    assert_eq!(t.lookup(&[9, 1]), Found::Hit(0));
    // Offering them again stores nothing.
    assert_eq!(t.offer(&k, 7, now, |_| panic!("nothing to describe")), Some(Vec::new()));
    assert_eq!(t.next_store(), None);
}

#[test]
fn stores_take_their_turn_on_the_copy_stream() {
    let now = Instant::now();
    let mut t = CpuTier::new(config(8), now);
    t.offer(&keys(1..3), 0, now, |_| Vec::new());
    t.offer(&keys(3..4), 0, now, |_| Vec::new());
    assert_eq!(t.next_store(), Some(now + Duration::from_millis(2)));
    assert_eq!(t.finish(1, now + Duration::from_millis(2)).stored.0, 2);
    assert_eq!(t.next_store(), Some(now + Duration::from_millis(3)), "the second copy starts when the first ends");
}

#[test]
fn eviction_takes_the_least_recent_ready_blocks_and_tails_first_after_a_finish() {
    let now = Instant::now();
    let mut t = CpuTier::new(config(4), now);
    store(&mut t, &keys(1..3), 0, now);
    store(&mut t, &keys(3..5), 2, now);
    // A request that used 1 and 2 finished: 2 then 1 become the most recent.
    t.finished(&keys(1..3));
    assert_eq!(store(&mut t, &keys(10..12), 4, now), keys(3..5));
    assert_eq!(store(&mut t, &keys(12..13), 6, now), vec![2], "the tail before the head");
    assert_eq!(t.lookup(&keys(1..3)), Found::Hit(1));
}

#[test]
fn loads_and_stores_under_way_and_the_offer_itself_are_never_evicted() {
    let now = Instant::now();
    let mut t = CpuTier::new(config(3), now);
    store(&mut t, &keys(1..3), 0, now);
    let done = t.load(&keys(1..2), now);
    assert_eq!(done, now + Duration::from_millis(1));
    assert_eq!(t.lookup(&keys(1..3)), Found::Busy, "another request's load");
    // One free chunk and one evictable (2): a third would need 1, loading.
    assert_eq!(t.offer(&keys(10..13), 2, now, |_| Vec::new()), None);
    assert_eq!(t.len(), 2, "a failed offer changes nothing");
    // An offer naming 2 cannot evict it either.
    assert_eq!(t.offer(&[2, 10, 11], 2, now, |_| Vec::new()), None);
    assert_eq!(t.offer(&[10, 11], 2, now, |_| Vec::new()), Some(vec![2]));
    // 10 and 11 are being stored: nothing can make room for 12 until they are done.
    t.loaded(&keys(1..2));
    assert_eq!(t.offer(&[12, 13, 14], 3, now, |_| Vec::new()), None);
    assert_eq!(t.offer(&[12], 3, now, |_| Vec::new()), Some(vec![1]));
    assert!(t.finish(3, now + Duration::from_secs(1)).stored.0 == 2);
    assert!(!t.is_empty());
}
