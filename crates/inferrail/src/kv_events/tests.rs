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

/// A publisher on loopback that binds, losing `skip`.
async fn publisher(skip: &[u64], replay: bool) -> inferrail_kv_events::Publisher {
    use inferrail_kv_events::{Publisher, PublisherConfig, Skip};
    let config = PublisherConfig {
        endpoint: "tcp://*:0".into(),
        replay_endpoint: replay.then(|| "tcp://*:0".into()),
        buffer_steps: 10_000,
        max_queue_size: 10_000,
        topic: "kv-events".into(),
        dp_rank: 0,
        skip: Skip::Seqs(skip.iter().copied().collect()),
    };
    Publisher::start(config).await.unwrap()
}

fn loopback(endpoint: &str) -> String {
    format!("tcp://127.0.0.1:{}", endpoint.rsplit(':').next().unwrap())
}

/// A router following `publisher` over ZMQ, exact: its subscription
/// connects in the background and misses what comes before, so empty
/// batches go until it has word of one, then a clear makes it exact.
async fn following(publisher: &inferrail_kv_events::Publisher) -> Arc<Router> {
    let router = Arc::new(router());
    let source = EventSource {
        endpoint: loopback(publisher.endpoint()),
        replay_endpoint: publisher.replay_endpoint().map(loopback),
        topic: "kv-events".into(),
        bind: false,
    };
    tokio::spawn(follow_replica(router.clone(), router.fleet().replicas[0].clone(), source));
    let connected = async {
        // Before its task starts the replica has no events configured; then it waits for the first.
        while matches!(mode(&router), Mode::Approximate(Reason::NoEventsConfigured | Reason::WaitingForFirstEvent)) {
            publisher.publish(batch(vec![]));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(60), connected).await.is_err() {
        panic!("the router never had word of the publisher: {:?}", publisher.stats());
    }
    let word = mode(&router);
    publisher.publish(batch(vec![KvEvent::AllBlocksCleared]));
    until(&format!("exact after a clear (first word: {word:?})"), || mode(&router) == Mode::Exact).await;
    router
}

/// Waits for a condition the router's tasks will make true (a minute at
/// most: a bound against a hang, not a timing threshold).
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let waiting = async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(60), waiting).await.is_err() {
        panic!("never came: {what}");
    }
}

/// Publishes a chain of blocks up to sequence number `last`; returns its length.
fn publish_chain(publisher: &inferrail_kv_events::Publisher, last: u64) -> usize {
    let mut n = 0;
    while publisher.stats().published <= last {
        publisher.publish(batch(vec![stored(n, 1, None, None)]));
        n += 1;
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_zmq_skipped_messages_are_replayed_and_the_replica_stays_exact() {
    let publisher = publisher(&[500, 503], true).await;
    let router = following(&publisher).await;
    let n = publish_chain(&publisher, 510);
    until("the whole chain, or a fall back", || matched(&router, "m", None, n) == n || mode(&router) != Mode::Exact).await;
    assert_eq!((mode(&router), matched(&router, "m", None, n)), (Mode::Exact, n));
    assert_eq!(publisher.stats().skipped, 2, "the fault fired");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_zmq_without_replay_a_skipped_message_ends_exact_mode() {
    let publisher = publisher(&[500], false).await;
    let router = following(&publisher).await;
    publish_chain(&publisher, 510);
    until("a fall back", || mode(&router) != Mode::Exact).await;
    assert_eq!(mode(&router), Mode::Approximate(Reason::SequenceGap));
    assert_eq!(publisher.stats().skipped, 1, "the fault fired");
    publisher.publish(batch(vec![KvEvent::AllBlocksCleared]));
    until("exact after a clear", || mode(&router) == Mode::Exact).await;
}
