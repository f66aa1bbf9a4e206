//! A peer's messages, whatever they say: never a panic, and once the peer
//! is gone nothing it made this router hold is left.

use std::time::Duration;

use inferrail_config::Config;
use inferrail_proto::peer::v1::heard::Event as WireEvent;
use inferrail_proto::peer::v1::{Status as WireStatus, Usage as WireUsage};
use proptest::prelude::*;
use proptest::sample::select;

use super::*;

const CONFIG: &str = "
models: [{name: m}]
replicas:
  - {id: r1, address: 127.0.0.1:8001, models: [m]}
  - {id: r2, address: 127.0.0.1:8002, models: [m]}
";

fn event() -> impl Strategy<Value = WireEvent> {
    prop_oneof![
        (any::<u32>(), proptest::option::of(any::<u64>())).prop_map(|(code, served_by)| WireEvent::Status(WireStatus { code, served_by })),
        Just(WireEvent::FirstByte(true)),
        (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(prompt_tokens, cached_tokens, completion_tokens)| {
            WireEvent::Usage(WireUsage { prompt_tokens, cached_tokens, completion_tokens })
        }),
        Just(WireEvent::End(true)),
        Just(WireEvent::Gone(true)),
    ]
}

/// Token counts: mostly plausible, often none, sometimes anything.
fn tokens() -> impl Strategy<Value = u64> {
    prop_oneof![1 => Just(0u64), 3 => 0..5_000u64, 1 => any::<u64>()]
}

fn message() -> impl Strategy<Value = Kind> {
    let id = select(vec!["a", "b", "c", ""]);
    let decided = (
        (id.clone(), select(vec!["m", "nobody", ""]), select(vec!["r1", "r2", "r9"])),
        (tokens(), proptest::bool::weighted(0.75), tokens(), prop_oneof![3 => Just(16u32), 1 => Just(0), 1 => any::<u32>()]),
        (
            prop_oneof![3 => (0..4usize).prop_map(|n| vec![7u8; 16 * n]), 1 => proptest::collection::vec(any::<u8>(), 0..80)],
            prop_oneof![3 => 0..1_000_000u64, 1 => any::<u64>()],
            tokens(),
            proptest::option::of("[a-z]{0,8}"),
        ),
    )
        .prop_map(
            |(
                (request, model, replica),
                (prompt_tokens, tokenized, output_tokens, block_size),
                (blocks, prefill_us, kv_tokens, session),
            )| {
                Kind::Decided(Decided {
                    request: request.into(),
                    model: model.into(),
                    replica: replica.into(),
                    prompt_tokens,
                    tokenized,
                    output_tokens,
                    block_size,
                    blocks,
                    prefill_us,
                    kv_tokens,
                    session,
                })
            },
        );
    let heard = (id, any::<bool>(), proptest::option::of(event()), any::<u64>())
        .prop_map(|(request, to_decider, event, ago_us)| Kind::Heard(Heard { request: request.into(), to_decider, event, ago_us }));
    prop_oneof![decided, heard, Just(Kind::Hello(Hello { router: 7 }))]
}

/// Any sequence of a peer's messages (decisions naming unknown models or
/// replicas, impossible sizes, damaged block lists, statuses that are not
/// HTTP statuses, events of requests never decided) is applied without a
/// panic; once the peer is gone, and past the longest life, no lease, slot
/// or pending count of its requests is left here.
#[test]
fn a_peers_messages_never_panic_and_leave_nothing_once_it_is_gone() {
    let held = std::sync::atomic::AtomicUsize::new(0);
    let config = proptest::test_runner::Config { cases: 512, ..Default::default() };
    proptest::test_runner::TestRunner::new(config)
        .run(&proptest::collection::vec(message(), 0..30), |messages| {
            let router = Router::new(Config::parse(CONFIG).unwrap()).unwrap();
            for m in messages {
                apply(&router, 7, m);
            }
            if router.leases_held() > 0 {
                held.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            router.ledger.forget_decider(7);
            router.sweep_at(router.now() + Duration::from_secs(3_601));
            prop_assert_eq!(router.leases_held(), 0);
            prop_assert!(router.fleet().replicas.iter().all(|r| r.in_flight() == 0 && r.pending() == 0));
            Ok(())
        })
        .unwrap();
    // Not vacuous: many cases held a peer's requests here before it went.
    let held = held.load(std::sync::atomic::Ordering::Relaxed);
    assert!(held > 50, "{held} of 512 cases held a mirror");
}

/// A case the fuzzer once found: a peer's decision of a tokenized prompt of
/// no tokens and no output made recording it subtract past zero (a panic).
#[test]
fn a_peers_decision_of_an_empty_prompt_with_no_output_is_held() {
    let router = Router::new(Config::parse(CONFIG).unwrap()).unwrap();
    let d = Decided {
        request: "a".into(),
        model: "m".into(),
        replica: "r1".into(),
        prompt_tokens: 0,
        tokenized: true,
        output_tokens: 0,
        block_size: 16,
        blocks: vec![],
        prefill_us: 0,
        kv_tokens: 0,
        session: None,
    };
    apply(&router, 7, Kind::Decided(d));
    assert_eq!(router.leases_held(), 1);
}
