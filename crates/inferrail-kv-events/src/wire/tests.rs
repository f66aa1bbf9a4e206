//! The codec against real vLLM 0.32.0 payloads, hand-made variants of them,
//! and random input.

use super::*;
use proptest::prelude::*;
use serde_json::{Value, json};

const RECORDINGS: [&str; 2] =
    [include_str!("../../tests/fixtures/vllm-0.32.0/kvevents.jsonl"), include_str!("../../tests/fixtures/vllm-0.32.0/kvevents2.jsonl")];

/// One recorded message: what the engine sent and how Python decoded it.
struct Recorded {
    seq: u64,
    payload_len: usize,
    head: Vec<u8>,
    batch: EventBatch,
}

fn recorded() -> Vec<Recorded> {
    RECORDINGS.iter().flat_map(|file| file.lines()).map(read_record).collect()
}

fn read_record(line: &str) -> Recorded {
    let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
    let hex = v["payload_hex_head"].as_str().unwrap_or_default();
    let head = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap_or_default()).collect();
    let decoded = &v["decoded"];
    Recorded {
        seq: v["seq"].as_u64().unwrap_or(u64::MAX),
        payload_len: v["payload_len"].as_u64().unwrap_or_default() as usize,
        head,
        batch: EventBatch {
            ts: exact_ts(line),
            events: decoded[1].as_array().map(|e| e.iter().map(event_from_json).collect()).unwrap_or_default(),
            dp_rank: decoded[2].as_i64(),
        },
    }
}

/// The timestamp as written, parsed with correct rounding (a float's bytes
/// are part of the payload head).
fn exact_ts(line: &str) -> f64 {
    let start = line.find("\"decoded\": [").map(|i| i + "\"decoded\": [".len()).unwrap_or_default();
    let end = start + line[start..].find(',').unwrap_or_default();
    line[start..end].parse().unwrap_or(f64::NAN)
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array().map(|a| a.iter().filter_map(Value::as_u64).collect()).unwrap_or_default()
}

fn event_from_json(e: &Value) -> KvEvent {
    let text = |k: &str| e[k].as_str().map(str::to_owned);
    match e["type"].as_str() {
        Some("BlockStored") => KvEvent::BlockStored(BlockStored {
            block_hashes: u64s(&e["block_hashes"]),
            parent_block_hash: e["parent_block_hash"].as_u64(),
            token_ids: u64s(&e["token_ids"]).into_iter().map(|t| t as u32).collect(),
            block_size: e["block_size"].as_u64().unwrap_or_default() as u32,
            lora_id: e["lora_id"].as_i64(),
            medium: text("medium"),
            lora_name: text("lora_name"),
            extra_keys: e["extra_keys"].as_array().map(|a| a.iter().map(|k| k.as_array().map(|_| vec![])).collect()),
            group_idx: e["group_idx"].as_u64().map(|g| g as u32),
            kv_cache_spec_kind: text("kv_cache_spec_kind"),
            lookahead_token_ids: None,
        }),
        Some("BlockRemoved") => KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: u64s(&e["block_hashes"]),
            medium: text("medium"),
            group_idx: e["group_idx"].as_u64().map(|g| g as u32),
        }),
        _ => KvEvent::AllBlocksCleared,
    }
}

/// msgpack of a JSON value (objects become maps), for hand-made payloads.
fn mp(v: &Value) -> Vec<u8> {
    rmp_serde::to_vec(v).unwrap_or_default()
}

fn stored(hashes: Vec<u64>, parent: Option<u64>) -> BlockStored {
    BlockStored {
        token_ids: (0..hashes.len() as u32 * 4).collect(),
        block_hashes: hashes,
        parent_block_hash: parent,
        block_size: 4,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        extra_keys: None,
        group_idx: Some(0),
        kv_cache_spec_kind: Some("full_attention".into()),
        lookahead_token_ids: None,
    }
}

#[test]
fn the_recordings_cover_every_event_type() {
    let all = recorded();
    assert_eq!(all.len(), 14);
    let has = |f: fn(&KvEvent) -> bool| all.iter().any(|r| r.batch.events.iter().any(f));
    assert!(has(|e| matches!(e, KvEvent::BlockStored(s) if s.parent_block_hash.is_some())));
    assert!(has(|e| matches!(e, KvEvent::BlockStored(s) if s.parent_block_hash.is_none())));
    assert!(has(|e| matches!(e, KvEvent::BlockRemoved(_))));
    assert!(has(|e| matches!(e, KvEvent::AllBlocksCleared)));
}

#[test]
fn encoding_a_recorded_batch_gives_vllms_bytes() {
    for r in recorded() {
        let bytes = encode(&r.batch);
        assert!(bytes.starts_with(&r.head), "seq {}: {:02x?} does not start with {:02x?}", r.seq, &bytes[..r.head.len()], r.head);
        assert_eq!(bytes.len(), r.payload_len, "seq {}", r.seq);
    }
}

#[test]
fn recorded_batches_decode_and_encode_again_unchanged() {
    for r in recorded() {
        let bytes = encode(&r.batch);
        assert_eq!(decode(&bytes).ok(), Some(r.batch.clone()), "seq {}", r.seq);
        assert_eq!(decode(&bytes).map(|b| encode(&b)).ok(), Some(bytes), "seq {}", r.seq);
    }
}

#[test]
fn a_recorded_message_parses_into_topic_seq_and_batch() {
    let r = &recorded()[5];
    let parts = frames("kv-events", r.seq, &encode(&r.batch));
    let (topic, seq, batch) = parse_message(&parts).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((topic.as_str(), seq, batch), ("kv-events", r.seq, r.batch.clone()));
}

#[test]
fn the_event_map_starts_with_type_and_keeps_vllms_field_order() {
    let batch = EventBatch { ts: 1.5, events: vec![KvEvent::BlockStored(stored(vec![7], None))], dp_rank: Some(0) };
    let v: rmpv_like::Batch = rmp_serde::from_slice(&encode(&batch)).unwrap_or_default();
    assert_eq!(
        v.0[0],
        [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "group_idx",
            "kv_cache_spec_kind"
        ]
    );
}

/// Reads only the key order of each event, to check what the encoder wrote.
mod rmpv_like {
    use serde::Deserialize;
    use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
    use std::fmt;

    #[derive(Default)]
    pub struct Batch(pub Vec<Vec<String>>);

    struct Keys(Vec<String>);

    impl<'de> Deserialize<'de> for Keys {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = Keys;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("a map")
                }
                fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Keys, A::Error> {
                    let mut keys = Vec::new();
                    while let Some(k) = m.next_key::<String>()? {
                        m.next_value::<IgnoredAny>()?;
                        keys.push(k);
                    }
                    Ok(Keys(keys))
                }
            }
            d.deserialize_map(V)
        }
    }

    impl<'de> Deserialize<'de> for Batch {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            let (_, events, _): (f64, Vec<Keys>, Option<i64>) = Deserialize::deserialize(d)?;
            Ok(Batch(events.into_iter().map(|k| k.0).collect()))
        }
    }
}

#[test]
fn defaulted_fields_left_out_by_the_engine_decode_as_none() {
    let payload = mp(&json!([2.0, [
        {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": null, "token_ids": [1, 2, 3, 4],
         "block_size": 2, "lora_id": null, "medium": "GPU", "lora_name": null},
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"},
    ]]));
    let batch = decode(&payload).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(batch.dp_rank, None);
    let KvEvent::BlockStored(s) = &batch.events[0] else { panic!("{batch:?}") };
    assert_eq!((s.extra_keys.as_ref(), s.group_idx, s.kv_cache_spec_kind.as_ref()), (None, None, None));
    assert_eq!(batch.events[1], KvEvent::BlockRemoved(BlockRemoved { block_hashes: vec![1], medium: Some("GPU".into()), group_idx: None }));
    // And the encoder leaves them out the same way.
    assert_eq!(encode(&batch), payload);
}

#[test]
fn older_and_newer_engines_decode_fields_in_any_order_and_skip_unknown_ones() {
    // An older engine: no medium, lora_name or defaults; a newer one: a map
    // batch with data_parallel_rank and a field this decoder does not know.
    let payload = mp(&json!({"events": [
        {"block_size": 2, "token_ids": [5, 6], "block_hashes": [9], "type": "BlockStored", "parent_block_hash": 3, "lora_id": 1},
        {"type": "BlockStored", "block_hashes": [10], "parent_block_hash": 9, "token_ids": [7, 8], "block_size": 2,
         "lora_id": null, "medium": "CPU", "lora_name": "a", "kv_cache_spec_sliding_window": 128},
    ], "ts": 3, "data_parallel_rank": 2, "something_new": [1, 2]}));
    let batch = decode(&payload).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((batch.ts, batch.dp_rank), (3.0, Some(2)));
    let KvEvent::BlockStored(old) = &batch.events[0] else { panic!("{batch:?}") };
    assert_eq!((old.block_hashes.as_slice(), old.parent_block_hash, old.lora_id, old.medium.as_ref()), (&[9][..], Some(3), Some(1), None));
    let KvEvent::BlockStored(new) = &batch.events[1] else { panic!("{batch:?}") };
    assert_eq!((new.medium.as_deref(), new.lora_name.as_deref()), (Some("CPU"), Some("a")));
}

#[test]
fn lookahead_tokens_of_vllm_0_33_are_read_and_written_after_the_other_fields() {
    // vLLM 0.33 with EAGLE and prefix caching: each block's hash also covers
    // the one token after it, listed per block; 0.32's newer defaults too.
    let payload = mp(&json!([1.5, [
        {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": null, "token_ids": [1, 2, 3, 4], "block_size": 2,
         "lora_id": null, "medium": "GPU", "lora_name": null, "extra_keys": [null, null], "group_idx": 0,
         "kv_cache_spec_kind": "full_attention", "session_id": "s", "lookahead_token_ids": [[3], [5]]},
    ], 0]));
    let batch = decode(&payload).unwrap_or_else(|e| panic!("{e}"));
    let KvEvent::BlockStored(s) = &batch.events[0] else { panic!("{batch:?}") };
    assert_eq!(s.lookahead_token_ids, Some(vec![vec![3], vec![5]]));
    assert_eq!(decode(&encode(&batch)).ok(), Some(batch.clone()));
    // Without lookahead hashing the field is left out, as vLLM omits a nil default.
    let mut plain = batch;
    let KvEvent::BlockStored(s) = &mut plain.events[0] else { unreachable!() };
    s.lookahead_token_ids = None;
    let bytes = encode(&plain);
    assert!(!bytes.windows(19).any(|w| w == b"lookahead_token_ids"), "written though nil");
}

#[test]
fn extra_keys_round_trip_whatever_values_they_hold() {
    let mut s = stored(vec![1, 2, 3], Some(5));
    s.extra_keys = Some(vec![
        Some(vec![ExtraKey::Str("tenant-a".into())]),
        None,
        Some(vec![
            ExtraKey::Array(vec![ExtraKey::Str("mm".into()), ExtraKey::UInt(3)]),
            ExtraKey::Int(-4),
            ExtraKey::Bytes(vec![0, 1]),
            ExtraKey::Bool(true),
            ExtraKey::Float(0.5),
            ExtraKey::Nil,
        ]),
    ]);
    let batch = EventBatch { ts: 0.0, events: vec![KvEvent::BlockStored(s)], dp_rank: None };
    assert_eq!(decode(&encode(&batch)).ok(), Some(batch));
}

#[test]
fn payloads_that_are_not_vllms_are_errors_that_say_why() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (vec![], "reading marker"),
        (mp(&json!("hello")), "event batch"),
        (mp(&json!([1.0])), "invalid length 1"),
        (mp(&json!([1.0, [{"type": "BlockEvicted"}]])), "BlockEvicted"),
        (mp(&json!([1.0, [{"block_hashes": [1]}]])), "missing field `type`"),
        (mp(&json!([1.0, [{"type": "BlockRemoved"}]])), "missing field `block_hashes`"),
        (mp(&json!([1.0, [{"type": "BlockRemoved", "block_hashes": [-3], "medium": null}]])), "block_hashes: invalid value: integer `-3`"),
        (
            mp(&json!([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1, "parent_block_hash": "x"}]])),
            "parent_block_hash",
        ),
        (
            mp(&json!([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [5000000000u64], "block_size": 1}]])),
            "token_ids: invalid value: integer `5000000000`",
        ),
        ([mp(&json!([1.0, []])), vec![0xc0]].concat(), "1 bytes after"),
    ];
    for (payload, says) in cases {
        let err = decode(&payload).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains(says), "{payload:02x?}: expected an error saying {says:?}, got {err:?}");
    }
    // A block hash as a byte string, as some older vLLMs sent them.
    let mut bytes_hash = vec![0x92, 0x01, 0x91, 0x83];
    for (k, v) in [("type", mp(&json!("BlockRemoved"))), ("block_hashes", vec![0x91, 0xc4, 0x02, 0x01, 0x02]), ("medium", vec![0xc0])] {
        bytes_hash.extend(mp(&json!(k)));
        bytes_hash.extend(v);
    }
    let err = decode(&bytes_hash).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("block_hashes") && err.contains("Bin8"), "{err}");
}

#[test]
fn lists_longer_than_sixteen_bits_round_trip() {
    let removed =
        KvEvent::BlockRemoved(BlockRemoved { block_hashes: (0..70_000).map(|h| h << 40).collect(), medium: None, group_idx: None });
    let mut big = stored(vec![1], None);
    big.token_ids = (0..70_000).collect();
    let batch = EventBatch { ts: -0.0, events: vec![removed, KvEvent::BlockStored(big)], dp_rank: Some(-1) };
    assert_eq!(decode(&encode(&batch)).ok(), Some(batch));
}

#[test]
fn malformed_messages_are_errors() {
    let payload = encode(&EventBatch { ts: 1.0, events: vec![], dp_rank: Some(0) });
    let seq = 4u64.to_be_bytes().to_vec();
    assert!(matches!(parse_message(&[b"t".to_vec(), seq.clone()]), Err(WireError::Frames(2))));
    assert!(matches!(parse_message(&[b"t".to_vec(), seq.clone(), payload.clone(), vec![]]), Err(WireError::Frames(4))));
    assert!(matches!(parse_message(&[vec![0xff], seq.clone(), payload.clone()]), Err(WireError::Topic)));
    assert!(matches!(parse_message(&[b"t".to_vec(), vec![0; 4], payload.clone()]), Err(WireError::Seq(4))));
    assert!(matches!(parse_message(&[b"t".to_vec(), seq, b"\x93garbage".to_vec()]), Err(WireError::Payload(_))));
    assert_eq!(parse_seq(&REPLAY_END_SEQ).ok(), Some(u64::MAX));
}

#[test]
fn deeply_nested_extra_keys_are_refused_not_a_stack_overflow() {
    let mut payload = vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x89];
    payload.extend(mp(&json!("type")));
    payload.extend(mp(&json!("BlockStored")));
    for k in ["block_hashes", "token_ids"] {
        payload.extend(mp(&json!(k)));
        payload.push(0x90);
    }
    payload.extend(mp(&json!("block_size")));
    payload.push(1);
    for k in ["parent_block_hash", "lora_id", "medium", "lora_name"] {
        payload.extend(mp(&json!(k)));
        payload.push(0xc0);
    }
    payload.extend(mp(&json!("extra_keys")));
    payload.extend(std::iter::repeat_n(0x91, 100_000));
    payload.push(0xc0);
    assert!(decode(&payload).is_err());
}

fn arb_extra_key() -> impl Strategy<Value = ExtraKey> {
    let leaf = prop_oneof![
        Just(ExtraKey::Nil),
        any::<bool>().prop_map(ExtraKey::Bool),
        any::<u64>().prop_map(ExtraKey::UInt),
        (i64::MIN..0).prop_map(ExtraKey::Int),
        any::<f64>().prop_filter("NaN is not equal to itself", |f| !f.is_nan()).prop_map(ExtraKey::Float),
        ".{0,40}".prop_map(ExtraKey::Str),
        proptest::collection::vec(any::<u8>(), 0..40).prop_map(ExtraKey::Bytes),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| proptest::collection::vec(inner, 0..4).prop_map(ExtraKey::Array))
}

fn arb_event() -> impl Strategy<Value = KvEvent> {
    let text = proptest::option::of(".{0,300}");
    let stored = (
        proptest::collection::vec(any::<u64>(), 0..40),
        any::<Option<u64>>(),
        proptest::collection::vec(any::<u32>(), 0..300),
        any::<u32>(),
        any::<Option<i64>>(),
        (text.clone(), text.clone(), text.clone()),
        proptest::option::of(proptest::collection::vec(proptest::option::of(proptest::collection::vec(arb_extra_key(), 0..3)), 0..4)),
        (any::<Option<u32>>(), proptest::option::of(proptest::collection::vec(proptest::collection::vec(any::<u32>(), 0..3), 0..4))),
    )
        .prop_map(
            |(
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                (medium, lora_name, kind),
                extra_keys,
                (group_idx, lookahead_token_ids),
            )| {
                KvEvent::BlockStored(BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id,
                    medium,
                    lora_name,
                    extra_keys,
                    group_idx,
                    kv_cache_spec_kind: kind,
                    lookahead_token_ids,
                })
            },
        );
    let removed = (proptest::collection::vec(any::<u64>(), 0..300), text, any::<Option<u32>>())
        .prop_map(|(block_hashes, medium, group_idx)| KvEvent::BlockRemoved(BlockRemoved { block_hashes, medium, group_idx }));
    prop_oneof![4 => stored, 4 => removed, 1 => Just(KvEvent::AllBlocksCleared)]
}

fn arb_batch() -> impl Strategy<Value = EventBatch> {
    (
        any::<f64>().prop_filter("NaN is not equal to itself", |f| !f.is_nan()),
        proptest::collection::vec(arb_event(), 0..20),
        any::<Option<i64>>(),
    )
        .prop_map(|(ts, events, dp_rank)| EventBatch { ts, events, dp_rank })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn any_batch_round_trips(batch in arb_batch()) {
        let bytes = encode(&batch);
        prop_assert_eq!(decode(&bytes).ok(), Some(batch));
    }

    #[test]
    fn any_bytes_decode_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = decode(&bytes);
    }

    #[test]
    fn any_frames_parse_without_panicking(parts in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..5)) {
        let _ = parse_message(&parts);
    }

    #[test]
    fn a_damaged_recorded_payload_is_an_error_or_a_batch_never_a_panic(
        which in 0usize..14, cut in any::<prop::sample::Index>(), flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..8)
    ) {
        let mut bytes = encode(&recorded()[which].batch);
        for (at, byte) in flips {
            let i = at.index(bytes.len());
            bytes[i] = byte;
        }
        let keep = cut.index(bytes.len() + 1);
        bytes.truncate(keep);
        if let Ok(batch) = decode(&bytes) {
            // Whatever decoded must encode again into a payload that decodes the same.
            prop_assert_eq!(decode(&encode(&batch)).ok(), Some(batch));
        }
    }
}
