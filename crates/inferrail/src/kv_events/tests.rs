//! Wire batches through a replica's follow into the index: predictions by the router's own hashes, modes and reasons.

use super::*;
use inferrail_config::Config;
use inferrail_kv::hash::block_hashes;
use inferrail_kv_events::{BlockRemoved, BlockStored};

const BS: usize = 4;

fn router() -> Router {
    let yaml = "models: [{name: m}, {name: adapter}]\nreplicas: [{id: a, address: 127.0.0.1:1, models: [m, adapter], block_size: 4, kv_blocks: 64}]\n";
    Router::new(Config::parse(yaml).unwrap()).unwrap()
}

fn follow(router: &Router, replay: bool) -> Follow {
    Follow::new(router, router.fleet().replicas[0].clone(), replay)
}

fn tokens(blocks: usize) -> Vec<u32> {
    (0..(blocks * BS) as u32).collect()
}

/// Engine hashes: any renaming of block positions will do.
fn engine(first: usize, n: usize) -> Vec<u64> {
    (first..first + n).map(|i| 0xe000 + i as u64).collect()
}

fn stored(first: usize, n: usize, lora: Option<&str>, extra: Option<Vec<Option<Vec<ExtraKey>>>>) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: engine(first, n),
        parent_block_hash: first.checked_sub(1).map(|p| 0xe000 + p as u64),
        token_ids: tokens(first + n)[first * BS..].to_vec(),
        block_size: BS as u32,
        lora_id: lora.map(|_| 1),
        medium: Some("GPU".into()),
        lora_name: lora.map(str::to_owned),
        extra_keys: extra,
        group_idx: Some(0),
        kv_cache_spec_kind: Some("full_attention".into()),
    })
}

fn batch(events: Vec<KvEvent>) -> EventBatch {
    EventBatch { ts: 0.0, events, dp_rank: Some(0) }
}

fn matched(router: &Router, model: &str, salt: Option<&str>, blocks: usize) -> usize {
    router.core.kv.index().matched(&block_hashes(seed(model, salt), &tokens(blocks), BS), &[0])[0]
}

fn mode(router: &Router) -> Mode {
    router.fleet().replicas[0].kv_mode()
}

#[test]
fn the_engines_first_message_makes_the_index_exact_in_the_routers_own_hashes() {
    let router = router();
    let mut f = follow(&router, false);
    assert_eq!(mode(&router), Mode::Approximate(Reason::WaitingForFirstEvent));
    assert_eq!(f.message(&router, 0, &batch(vec![stored(0, 3, None, None)])), None);
    assert_eq!(mode(&router), Mode::Exact);
    assert_eq!(matched(&router, "m", None, 8), 3);
    f.message(&router, 1, &batch(vec![stored(3, 2, None, None)]));
    assert_eq!(matched(&router, "m", None, 8), 5);
    let removed = KvEvent::BlockRemoved(BlockRemoved { block_hashes: vec![0xe004], medium: Some("GPU".into()), group_idx: Some(0) });
    f.message(&router, 2, &batch(vec![removed]));
    assert_eq!(matched(&router, "m", None, 8), 4);
    f.message(&router, 3, &batch(vec![KvEvent::AllBlocksCleared]));
    assert_eq!((matched(&router, "m", None, 8), mode(&router)), (0, Mode::Exact));
}

#[test]
fn adapters_and_cache_salts_seed_their_own_chains() {
    let router = router();
    let mut f = follow(&router, false);
    let salted = Some(vec![Some(vec![ExtraKey::Str("adapter".into()), ExtraKey::Str("s3cret".into())])]);
    f.message(&router, 0, &batch(vec![stored(0, 2, Some("adapter"), salted)]));
    assert_eq!(matched(&router, "adapter", Some("s3cret"), 2), 2);
    assert_eq!(matched(&router, "adapter", None, 2), 0);
    assert_eq!(matched(&router, "m", Some("s3cret"), 2), 0);
}

#[test]
fn a_long_stored_event_is_applied_in_pieces() {
    let router = router();
    let mut f = follow(&router, false);
    f.message(&router, 0, &batch(vec![stored(0, 3 * PIECE + 5, None, None)]));
    assert_eq!(matched(&router, "m", None, 3 * PIECE + 5), 3 * PIECE + 5);
}

#[test]
fn a_gap_without_replay_falls_back_keeping_what_was_known() {
    let router = router();
    let mut f = follow(&router, false);
    f.message(&router, 0, &batch(vec![stored(0, 3, None, None)]));
    f.message(&router, 2, &batch(vec![stored(3, 1, None, None)]));
    assert_eq!(mode(&router), Mode::Approximate(Reason::SequenceGap));
    assert_eq!(matched(&router, "m", None, 8), 3, "the shadow starts from the last exact view");
    f.message(&router, 3, &batch(vec![KvEvent::AllBlocksCleared, stored(0, 1, None, None)]));
    assert_eq!((mode(&router), matched(&router, "m", None, 8)), (Mode::Exact, 1));
}

#[test]
fn a_gap_with_replay_asks_for_it_and_stays_exact_when_filled() {
    let router = router();
    let mut f = follow(&router, true);
    f.message(&router, 0, &batch(vec![stored(0, 1, None, None)]));
    let late = batch(vec![stored(2, 1, None, None)]);
    assert_eq!(f.message(&router, 2, &late), Some((1, 2)));
    f.replayed(&router, &[(1, batch(vec![stored(1, 1, None, None)]))]);
    assert_eq!(f.message(&router, 2, &late), None);
    assert_eq!((mode(&router), matched(&router, "m", None, 8)), (Mode::Exact, 3));
    // A replay endpoint that does not answer.
    let later = batch(vec![stored(3, 1, None, None)]);
    assert_eq!(f.message(&router, 5, &later), Some((3, 5)));
    f.replayed(&router, &[]);
    assert_eq!(f.message(&router, 5, &later), None);
    assert_eq!(mode(&router), Mode::Approximate(Reason::SequenceGap));
}

#[test]
fn refused_events_garbage_drops_and_restarts_are_reasons() {
    let router = router();
    let mut f = follow(&router, false);
    f.message(&router, 0, &batch(vec![stored(0, 1, None, None)]));
    f.garbage(&router, None);
    assert_eq!(mode(&router), Mode::Exact, "junk proves no loss");
    f.message(&router, 1, &batch(vec![stored(5, 1, None, None)]));
    assert_eq!(mode(&router), Mode::Approximate(Reason::UnknownParent));

    let mut f = follow(&router, false);
    f.message(&router, 0, &batch(vec![stored(0, 1, None, None)]));
    f.garbage(&router, Some(1));
    assert_eq!(mode(&router), Mode::Approximate(Reason::GarbageFrames));

    let mut f = follow(&router, false);
    f.message(&router, 0, &batch(vec![stored(0, 1, None, None)]));
    f.dropped(&router);
    assert_eq!(mode(&router), Mode::Approximate(Reason::FellBehind));

    let mut f = follow(&router, false);
    f.message(&router, 0, &batch(vec![stored(0, 2, None, None)]));
    let replica = router.fleet().replicas[0].clone();
    router.core.prefix_cache_queries(&replica, 10);
    assert!(router.core.prefix_cache_queries(&replica, 1), "the counters went back");
    f.tick(&router);
    assert_eq!((mode(&router), matched(&router, "m", None, 8)), (Mode::Approximate(Reason::EngineRestarted), 0));
    f.message(&router, 0, &batch(vec![stored(0, 1, None, None)]));
    assert_eq!((mode(&router), matched(&router, "m", None, 8)), (Mode::Exact, 1), "the new engine's first message");
}
