//! Publisher and subscriber over real ZMQ sockets on this machine: both
//! bind/connect directions, ipc, replay, the skip fault, a full queue,
//! reconnection and garbage.
//!
//! A PUB socket drops what it publishes before a subscription reaches it, so
//! each test first publishes probes until one arrives; from then on nothing
//! may be lost.

use std::time::Duration;

use bytes::Bytes;
use inferrail_kv_events::publish::{Publisher, PublisherConfig, Skip};
use inferrail_kv_events::subscribe::{Subscriber, SubscriberConfig, replay};
use inferrail_kv_events::wire::{self, BlockRemoved, EventBatch, KvEvent};
use inferrail_kv_events::{ReplayError, SubscribeError};
use zeromq::{DealerSocket, PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const TOPIC: &str = "kv-events";

fn config(endpoint: &str) -> PublisherConfig {
    PublisherConfig {
        endpoint: endpoint.to_owned(),
        replay_endpoint: None,
        buffer_steps: 10_000,
        max_queue_size: 100_000,
        topic: TOPIC.to_owned(),
        dp_rank: 0,
        skip: Skip::Never,
    }
}

/// A subscriber that connects to an engine's bound (and resolved) endpoint.
fn connect_to(endpoint: &str) -> SubscriberConfig {
    SubscriberConfig { endpoint: endpoint.to_owned(), topic: TOPIC.to_owned(), bind: false }
}

fn batch(hash: u64) -> EventBatch {
    let removed = BlockRemoved { block_hashes: vec![hash], medium: Some("GPU".into()), group_idx: Some(0) };
    EventBatch { ts: hash as f64, events: vec![KvEvent::BlockRemoved(removed)], dp_rank: None }
}

fn hash_of(b: &EventBatch) -> Option<u64> {
    match b.events.first() {
        Some(KvEvent::BlockRemoved(r)) => r.block_hashes.first().copied(),
        _ => None,
    }
}

async fn next(sub: &mut Subscriber) -> (u64, EventBatch) {
    match tokio::time::timeout(Duration::from_secs(10), sub.next()).await {
        Ok(Ok(m)) => m,
        other => panic!("no batch: {other:?}"),
    }
}

/// Publishes probes until one reaches `sub`; returns the sequence number of
/// the first one that did.
async fn attach(publisher: &Publisher, sub: &mut Subscriber) -> u64 {
    for _ in 0..400 {
        publisher.publish(batch(u64::MAX));
        if let Ok(received) = tokio::time::timeout(Duration::from_millis(50), sub.next()).await {
            return received.map(|(seq, _)| seq).unwrap_or_else(|e| panic!("{e}"));
        }
    }
    panic!("no probe reached the subscriber in 20 s");
}

/// Publishes `n` batches after attaching and checks they arrive complete
/// and in order, right after the probes.
async fn stream_arrives_in_order(publisher: &Publisher, sub: &mut Subscriber, n: u64) {
    let first = attach(publisher, sub).await;
    let seqs: Vec<u64> = (0..n).filter_map(|i| publisher.publish(batch(i))).collect();
    assert_eq!(seqs.len() as u64, n);
    let mut expect = first + 1;
    let mut real = 0;
    while real < n {
        let (seq, b) = next(sub).await;
        assert_eq!(seq, expect, "sequence numbers must be consecutive");
        expect += 1;
        if seq >= seqs[0] {
            assert_eq!(hash_of(&b), Some(seq - seqs[0]));
            assert_eq!(b.dp_rank, Some(0), "the publisher fills in dp_rank");
            real += 1;
        }
    }
}

#[tokio::test]
async fn an_engine_that_connects_reaches_a_subscriber_that_binds() {
    let mut sub = Subscriber::start(&SubscriberConfig::new("tcp://127.0.0.1:0", TOPIC)).await.unwrap_or_else(|e| panic!("{e}"));
    let endpoint = sub.endpoint().to_owned();
    assert!(!endpoint.ends_with(":0"), "the bound port is resolved: {endpoint}");
    let publisher = Publisher::start(config(&endpoint)).await.unwrap_or_else(|e| panic!("{e}"));
    stream_arrives_in_order(&publisher, &mut sub, 200).await;
}

#[tokio::test]
async fn an_engine_that_binds_is_reached_by_a_subscriber_that_connects() {
    let publisher = Publisher::start(config("tcp://127.0.0.1:*")).await.unwrap_or_else(|e| panic!("{e}"));
    assert!(!SubscriberConfig::new("tcp://127.0.0.1:*", TOPIC).bind);
    let mut sub = Subscriber::start(&connect_to(publisher.endpoint())).await.unwrap_or_else(|e| panic!("{e}"));
    stream_arrives_in_order(&publisher, &mut sub, 200).await;
}

#[tokio::test]
async fn ipc_endpoints_are_bound_by_the_engine() {
    let path = std::env::temp_dir().join(format!("inferrail-kv-events-{}.ipc", std::process::id()));
    let endpoint = format!("ipc://{}", path.display());
    let publisher = Publisher::start(config(&endpoint)).await.unwrap_or_else(|e| panic!("{e}"));
    let mut sub = Subscriber::start(&SubscriberConfig::new(&endpoint, TOPIC)).await.unwrap_or_else(|e| panic!("{e}"));
    stream_arrives_in_order(&publisher, &mut sub, 50).await;
    drop(publisher);
    let _ = std::fs::remove_file(path);
}

#[tokio::test]
async fn replay_serves_buffered_batches_from_the_asked_sequence_then_the_end_marker() {
    let mut cfg = config("tcp://127.0.0.1:*");
    cfg.replay_endpoint = Some("tcp://127.0.0.1:*".into());
    cfg.buffer_steps = 5;
    let publisher = Publisher::start(cfg).await.unwrap_or_else(|e| panic!("{e}"));
    let replay_at = publisher.replay_endpoint().unwrap_or_default().to_owned();
    for i in 0..8 {
        assert_eq!(publisher.publish(batch(i)), Some(i));
    }
    publisher.flush().await;
    let got = |from| {
        let replay_at = replay_at.clone();
        async move {
            let batches = replay(&replay_at, from, Duration::from_secs(10)).await.unwrap_or_else(|e| panic!("{e}"));
            batches.into_iter().map(|(seq, b)| (seq, hash_of(&b))).collect::<Vec<_>>()
        }
    };
    assert_eq!(got(5).await, [(5, Some(5)), (6, Some(6)), (7, Some(7))]);
    // Only the last five are kept.
    assert_eq!(got(0).await.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [3, 4, 5, 6, 7]);
    assert_eq!(got(8).await, []);
}

/// vLLM 0.32.0's replay frames, as a DEALER reads them after the empty
/// delimiter: `[topic, seq, payload]` per batch, then `["", -1, ""]`.
#[tokio::test]
async fn replay_frames_are_vllms_and_the_client_also_reads_the_older_form_without_the_topic() {
    let mut cfg = config("tcp://127.0.0.1:*");
    cfg.replay_endpoint = Some("tcp://127.0.0.1:*".into());
    let publisher = Publisher::start(cfg).await.unwrap_or_else(|e| panic!("{e}"));
    publisher.publish(batch(7));
    publisher.flush().await;
    let mut dealer = DealerSocket::new();
    dealer.connect(publisher.replay_endpoint().unwrap_or_default()).await.unwrap_or_else(|e| panic!("{e}"));
    let mut ask = ZmqMessage::from(Bytes::new());
    ask.push_back(Bytes::copy_from_slice(&0u64.to_be_bytes()));
    dealer.send(ask).await.unwrap_or_else(|e| panic!("{e}"));
    let mut frames = Vec::new();
    for _ in 0..2 {
        let m = tokio::time::timeout(Duration::from_secs(10), dealer.recv()).await;
        frames.push(m.ok().and_then(Result::ok).map(ZmqMessage::into_vec).unwrap_or_default());
    }
    assert_eq!(frames[0].len(), 4, "{:?}", frames[0]);
    assert_eq!((&frames[0][0][..], &frames[0][1][..], &frames[0][2][..]), (&b""[..], TOPIC.as_bytes(), &0u64.to_be_bytes()[..]));
    assert_eq!(wire::decode(&frames[0][3]).ok().as_ref().and_then(hash_of), Some(7));
    assert_eq!(frames[1], [Bytes::new(), Bytes::new(), Bytes::from_static(&wire::REPLAY_END_SEQ), Bytes::new()]);

    // A service that sends no topic, as vLLM did before 0.32.
    let mut older = RouterSocket::new();
    let bound = older.bind("tcp://127.0.0.1:0").await.unwrap_or_else(|e| panic!("{e}")).to_string();
    let serve = tokio::spawn(async move {
        let request = older.recv().await.unwrap_or_else(|e| panic!("{e}")).into_vec();
        let client = request[0].clone();
        let payload = wire::encode(&batch(9));
        for frames in [
            vec![client.clone(), Bytes::new(), Bytes::copy_from_slice(&4u64.to_be_bytes()), Bytes::from(payload)],
            vec![client, Bytes::new(), Bytes::from_static(&wire::REPLAY_END_SEQ), Bytes::new()],
        ] {
            older.send(ZmqMessage::try_from(frames).unwrap_or_else(|e| panic!("{e}"))).await.unwrap_or_else(|e| panic!("{e}"));
        }
        older
    });
    let got = replay(&bound, 4, Duration::from_secs(10)).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(got.iter().map(|(seq, b)| (*seq, hash_of(b))).collect::<Vec<_>>(), [(4, Some(9))]);
    drop(serve.await);
}

#[tokio::test]
async fn a_replay_endpoint_that_does_not_answer_or_is_not_there_times_out() {
    let mut silent = RouterSocket::new();
    let bound = silent.bind("tcp://127.0.0.1:0").await.unwrap_or_else(|e| panic!("{e}")).to_string();
    let err = replay(&bound, 0, Duration::from_millis(300)).await.err();
    assert!(matches!(err, Some(ReplayError::Timeout { .. })), "{err:?}");
    drop(silent);
    // Nobody listens there any more: connecting keeps being refused.
    let err = replay(&bound, 0, Duration::from_millis(300)).await.err();
    assert!(matches!(err, Some(ReplayError::Timeout { .. } | ReplayError::Socket { .. })), "{err:?}");
    let err = replay("inproc://x", 0, Duration::from_millis(300)).await.err();
    assert!(matches!(err, Some(ReplayError::Endpoint(_))), "{err:?}");
}

#[tokio::test]
async fn skipped_sequence_numbers_are_gaps_that_replay_fills() {
    let mut cfg = config("tcp://127.0.0.1:*");
    cfg.replay_endpoint = Some("tcp://127.0.0.1:*".into());
    let skip = Skip::Random { probability: 0.3, seed: 9 };
    cfg.skip = skip.clone();
    let publisher = Publisher::start(cfg).await.unwrap_or_else(|e| panic!("{e}"));
    let mut sub = Subscriber::start(&connect_to(publisher.endpoint())).await.unwrap_or_else(|e| panic!("{e}"));
    let first = attach(&publisher, &mut sub).await;
    let seqs: Vec<u64> = (0..100).filter_map(|i| publisher.publish(batch(i))).collect();
    let last = seqs[seqs.len() - 1];
    let expected: Vec<u64> = (first + 1..=last).filter(|&s| !skip.skips(s)).collect();
    assert!(expected.len() < seqs.len(), "some must be skipped");
    let mut received = Vec::new();
    while received.last() != expected.last() {
        received.push(next(&mut sub).await.0);
    }
    assert_eq!(received, expected);
    let gaps: Vec<u64> = (first + 1..=last).filter(|s| !received.contains(s)).collect();
    let replayed =
        replay(publisher.replay_endpoint().unwrap_or_default(), gaps[0], Duration::from_secs(10)).await.unwrap_or_else(|e| panic!("{e}"));
    for gap in gaps {
        let found = replayed.iter().find(|(s, _)| *s == gap).map(|(_, b)| hash_of(b));
        assert_eq!(found, Some(Some(gap - seqs[0])), "seq {gap}");
    }
    publisher.flush().await;
    let stats = publisher.stats();
    assert_eq!(stats.skipped, (0..stats.published).filter(|&s| skip.skips(s)).count() as u64);
}

#[tokio::test]
async fn a_full_queue_drops_and_counts_without_waiting() {
    let mut cfg = config("tcp://127.0.0.1:*");
    cfg.max_queue_size = 1;
    let publisher = Publisher::start(cfg).await.unwrap_or_else(|e| panic!("{e}"));
    // On this single-threaded runtime the sending task cannot run during the
    // loop, so the queue's one place is taken by the first batch.
    let queued: Vec<Option<u64>> = (0..1000).map(|i| publisher.publish(batch(i))).collect();
    assert_eq!(queued[0], Some(0));
    assert!(queued[1..].iter().all(Option::is_none));
    publisher.flush().await;
    let stats = publisher.stats();
    assert_eq!((stats.published, stats.dropped, stats.sent), (1000, 999, 1));
    // The numbers of dropped batches are never reused.
    assert_eq!(publisher.publish(batch(0)), Some(1000));
}

#[tokio::test]
async fn a_connecting_engine_reaches_its_subscriber_again_after_it_restarts() {
    let mut sub = Subscriber::start(&SubscriberConfig::new("tcp://127.0.0.1:0", TOPIC)).await.unwrap_or_else(|e| panic!("{e}"));
    let endpoint = sub.endpoint().to_owned();
    let publisher = Publisher::start(config(&endpoint)).await.unwrap_or_else(|e| panic!("{e}"));
    let before = attach(&publisher, &mut sub).await;
    sub.close().await;
    let mut sub = Subscriber::start(&SubscriberConfig::new(&endpoint, TOPIC)).await.unwrap_or_else(|e| panic!("{e}"));
    let after = attach(&publisher, &mut sub).await;
    assert!(after > before);
}

#[tokio::test]
async fn garbage_and_other_topics_do_not_stop_the_subscriber() {
    let mut raw = PubSocket::new();
    let endpoint = raw.bind("tcp://127.0.0.1:0").await.unwrap_or_else(|e| panic!("{e}")).to_string();
    let mut sub = Subscriber::start(&connect_to(&endpoint)).await.unwrap_or_else(|e| panic!("{e}"));
    let good = |seq: u64| message(wire::frames(TOPIC, seq, &wire::encode(&batch(seq))));
    let mut attached = false;
    for seq in 0..400 {
        raw.send(good(seq)).await.unwrap_or_else(|e| panic!("{e}"));
        if tokio::time::timeout(Duration::from_millis(50), sub.next()).await.is_ok() {
            attached = true;
            break;
        }
    }
    assert!(attached);
    let sends = [
        message([TOPIC.as_bytes().to_vec(), 7u64.to_be_bytes().to_vec(), b"\x93junk".to_vec()]),
        message([TOPIC.as_bytes().to_vec(), 8u64.to_be_bytes().to_vec()]),
        message([TOPIC.as_bytes().to_vec(), vec![1, 2], wire::encode(&batch(1))]),
        message(wire::frames("kv-events-other", 9, &wire::encode(&batch(9)))),
        good(10),
    ];
    for m in sends {
        raw.send(m).await.unwrap_or_else(|e| panic!("{e}"));
    }
    let garbage_seq = |r: Result<(u64, EventBatch), SubscribeError>| match r {
        Err(SubscribeError::Garbage { seq, .. }) => seq,
        other => panic!("expected garbage, got {other:?}"),
    };
    assert_eq!(garbage_seq(sub.next().await), Some(7));
    assert_eq!(garbage_seq(sub.next().await), Some(8));
    assert_eq!(garbage_seq(sub.next().await), None);
    // The other topic is passed over.
    assert_eq!(next(&mut sub).await.0, 10);
}

fn message<const N: usize>(frames: [Vec<u8>; N]) -> ZmqMessage {
    let mut frames = frames.into_iter();
    let mut m = ZmqMessage::from(frames.next().unwrap_or_default());
    for f in frames {
        m.push_back(f.into());
    }
    m
}
