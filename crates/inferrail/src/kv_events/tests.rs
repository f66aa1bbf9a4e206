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
        lookahead_token_ids: None,
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
fn lookahead_tokens_in_stored_events_set_the_replicas_lookahead_until_they_stop() {
    let router = router();
    let mut f = follow(&router, false);
    let replica = router.fleet().replicas[0].clone();
    let KvEvent::BlockStored(mut ahead) = stored(0, 2, None, None) else { unreachable!() };
    ahead.lookahead_token_ids = Some(vec![vec![4, 5, 6], vec![8, 9, 10]]);
    f.message(&router, 0, &batch(vec![KvEvent::BlockStored(ahead)]));
    assert_eq!((replica.lookahead(), mode(&router)), (3, Mode::Exact));
    assert_eq!(matched(&router, "m", None, 2), 2, "the blocks are the router's own by their tokens");
    // The engine restarted without speculative decoding.
    f.message(&router, 1, &batch(vec![stored(2, 1, None, None)]));
    assert_eq!(replica.lookahead(), 0);
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

/// One thing that can happen to a replica's follow, drawn by the fuzzer below.
#[derive(Debug, Clone)]
enum Step {
    /// A message `ahead` of the next sequence number (0: in order; negative: repeated or from before).
    Message {
        ahead: i8,
        events: Vec<KvEvent>,
    },
    Replayed(Vec<(u8, Vec<KvEvent>)>),
    Garbage(Option<u8>),
    Dropped,
    /// The engine's counters went back.
    Restarted,
    Tick,
    /// A request decided and sent to the replica.
    Decide(u8),
    /// The oldest request sent ends.
    End,
}

/// Events over a few engine blocks: chains whose parents may be known or
/// not, token ids that fill the blocks or not, other block sizes and tiers,
/// removals of held and unheld blocks, clears.
fn any_event() -> impl proptest::strategy::Strategy<Value = KvEvent> {
    use proptest::prelude::*;
    let stored = (
        0usize..8,
        0usize..4,
        any::<bool>(),
        prop_oneof![6 => Just(BS as u32), 1 => Just(8u32), 1 => Just(0u32)],
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(first, n, fill, block_size, cpu, orphan)| {
            let KvEvent::BlockStored(mut s) = stored(first, n, None, None) else { unreachable!() };
            if !fill {
                s.token_ids.pop();
            }
            if orphan {
                s.parent_block_hash = Some(0xdead);
            }
            s.block_size = block_size;
            s.medium = Some(if cpu { "CPU" } else { "GPU" }.into());
            KvEvent::BlockStored(s)
        });
    let removed = (proptest::collection::vec(0u64..10, 0..4), any::<bool>()).prop_map(|(blocks, cpu)| {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: blocks.into_iter().map(|b| 0xe000 + b).collect(),
            medium: Some(if cpu { "CPU" } else { "GPU" }.into()),
            group_idx: None,
        })
    });
    prop_oneof![4 => stored, 3 => removed, 1 => Just(KvEvent::AllBlocksCleared)]
}

fn any_step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    let events = || proptest::collection::vec(any_event(), 0..5);
    prop_oneof![
        8 => (prop_oneof![6 => Just(0i8), 1 => -3i8..0, 1 => 1i8..4], events()).prop_map(|(ahead, events)| Step::Message { ahead, events }),
        1 => proptest::collection::vec((0u8..12, events()), 0..3).prop_map(Step::Replayed),
        1 => any::<Option<u8>>().prop_map(|s| Step::Garbage(s.map(|s| s % 12))),
        1 => Just(Step::Dropped),
        1 => Just(Step::Restarted),
        1 => Just(Step::Tick),
        3 => (0u8..6).prop_map(Step::Decide),
        2 => Just(Step::End),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 256, ..proptest::prelude::ProptestConfig::default() })]

    /// A fuzzer of the KV-event stream as the router follows it (issue 54):
    /// any messages in any order, repeated, missing, replayed, unreadable,
    /// dropped, refused by the index, with engine restarts and requests
    /// decided and ended in between. Nothing panics, every request is still
    /// decided, and whatever state it was left in, an engine that clears
    /// its cache and stores a prefix is followed exactly again, holding just
    /// that prefix.
    #[test]
    fn any_event_stream_leaves_the_follow_sound_and_recoverable(steps in proptest::collection::vec(any_step(), 1..40), replay in proptest::prelude::any::<bool>()) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let router = router();
        let replica = router.fleet().replicas[0].clone();
        let mut f = follow(&router, replay);
        let mut next = 0u64;
        let mut sent = std::collections::VecDeque::new();
        for (k, step) in steps.into_iter().enumerate() {
            match step {
                Step::Message { ahead, events } => {
                    let seq = next.saturating_add_signed(i64::from(ahead));
                    let b = batch(events);
                    if f.message(&router, seq, &b).is_some() {
                        // The replay endpoint does not answer; the message is handed over again, as the loop does.
                        f.replayed(&router, &[]);
                        proptest::prop_assert_eq!(f.message(&router, seq, &b), None, "a replay is asked once");
                    }
                    next = next.max(seq + 1);
                }
                Step::Replayed(messages) => {
                    let messages: Vec<_> = messages.into_iter().map(|(s, e)| (u64::from(s), batch(e))).collect();
                    f.replayed(&router, &messages);
                }
                Step::Garbage(seq) => f.garbage(&router, seq.map(u64::from)),
                Step::Dropped => f.dropped(&router),
                Step::Restarted => {
                    router.core.prefix_cache_queries(&replica, 1_000_000);
                    router.core.prefix_cache_queries(&replica, 1);
                    f.tick(&router);
                }
                Step::Tick => f.tick(&router),
                Step::Decide(words) => {
                    let body = format!(r#"{{"model": "m", "prompt": "{}"}}"#, "w ".repeat(usize::from(words) * 5));
                    let id = format!("r{k}");
                    let decided = runtime.block_on(router.decide(body.as_bytes(), inferrail_tokenize::chat::Endpoint::Completions, &id, None, None));
                    proptest::prop_assert!(decided.is_ok(), "{decided:?}");
                    router.hear(&id, inferrail_route::lifecycle::Event::Status { code: 200, served_by: None });
                    sent.push_back(id);
                }
                Step::End => {
                    if let Some(id) = sent.pop_front() {
                        router.hear(&id, inferrail_route::lifecycle::Event::End);
                    }
                }
            }
        }
        let fresh = batch(vec![KvEvent::AllBlocksCleared, stored(0, 3, None, None)]);
        if f.message(&router, next, &fresh).is_some() {
            f.replayed(&router, &[]);
            f.message(&router, next, &fresh);
        }
        proptest::prop_assert_eq!(mode(&router), Mode::Exact);
        proptest::prop_assert_eq!(matched(&router, "m", None, 8), 3);
    }
}
