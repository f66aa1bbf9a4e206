//! vLLM 0.32.0's KV event wire format: the types, the msgpack codec and the
//! three-frame ZMQ message.
//!
//! A message is `[topic, seq, payload]`: the topic as UTF-8, the batch's
//! sequence number as 8 bytes big-endian, and the payload, a msgpack array
//! `[ts, [events], dp_rank]` (`ts` a float64, `dp_rank` an int or nil, left
//! out when nil as msgspec's `omit_defaults` does). Each event is a msgpack
//! map whose first key is `"type"`, followed by the fields in vLLM's
//! declaration order; the fields vLLM gives a default (`extra_keys`,
//! `group_idx`, `kv_cache_spec_kind`, and 0.33's `lookahead_token_ids`) are left out when they are nil, the
//! others are always written. Integers take msgpack's smallest encoding, so a
//! large block hash is a `uint 64` (`0xcf`) as in the recordings.
//!
//! Decoding is as tolerant as vLLM's own msgspec decoder and no more: fields
//! may come in any order, unknown fields are skipped (newer vLLMs add some),
//! fields that may be nil may also be missing, and the batch may be an array
//! of two or three items or a map. Anything else (a wrong type, a negative or
//! byte-string block hash, trailing bytes) is a [`WireError`], never a panic.

use std::convert::Infallible;
use std::fmt;
use std::io::Cursor;

use rmp::encode::{self as mp, ByteBuf, ValueWriteError};
use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// The sequence number vLLM's replay service sends after the last buffered
/// batch: -1 as a signed 8-byte big-endian integer, with an empty payload.
pub const REPLAY_END_SEQ: [u8; 8] = [0xff; 8];

/// How deeply nested a payload may be (events nest three levels, extra keys a
/// few more); deeper input is refused before it can exhaust the stack.
const MAX_DEPTH: usize = 32;

/// What one engine step did to the cache, published as one message.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Seconds since the Unix epoch when the batch was made.
    pub ts: f64,
    /// The events, in the order the engine applied them.
    pub events: Vec<KvEvent>,
    /// The data-parallel rank of the engine (vLLM sends 0 without DP).
    pub dp_rank: Option<i64>,
}

/// One change to an engine's prefix cache.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Full blocks were cached.
    BlockStored(BlockStored),
    /// Cached blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// Every cached block was forgotten (`POST /reset_prefix_cache`).
    AllBlocksCleared,
}

/// A run of consecutive full blocks of one sequence that the engine cached.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    /// The engine's hashes of the blocks, in prefix order.
    pub block_hashes: Vec<u64>,
    /// The engine's hash of the block before the first one; `None` when the
    /// first block starts the sequence.
    pub parent_block_hash: Option<u64>,
    /// The tokens of all the blocks, `block_size` per block.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// LoRA adapter id (deprecated by vLLM in favour of `lora_name`).
    pub lora_id: Option<i64>,
    /// Where the blocks live: `"GPU"`, or a CPU or disk offload tier.
    pub medium: Option<String>,
    /// LoRA adapter name, part of the engine's block hash.
    pub lora_name: Option<String>,
    /// Per block, the extra keys of its hash (cache salt, multi-modal
    /// hashes, LoRA name) or `None`; vLLM sends `[null, ...]` for plain text.
    pub extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    /// KV cache group (hybrid models have several); vLLM sends 0.
    pub group_idx: Option<u32>,
    /// The attention kind of the group, e.g. `"full_attention"`.
    pub kv_cache_spec_kind: Option<String>,
    /// vLLM 0.33 and later, with lookahead hashing (EAGLE or MTP drafts and
    /// prefix caching): per block, the tokens after it that its hash also
    /// covers; `None` when the engine hashes blocks alone (ADR 0058).
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
}

/// Blocks the engine evicted (vLLM sends one event per block).
#[derive(Debug, Clone, PartialEq)]
pub struct BlockRemoved {
    /// The engine's hashes of the evicted blocks.
    pub block_hashes: Vec<u64>,
    /// Where the blocks lived.
    pub medium: Option<String>,
    /// KV cache group.
    pub group_idx: Option<u32>,
}

/// One item of a block's extra keys: whatever msgpack value vLLM put there.
#[derive(Debug, Clone, PartialEq)]
pub enum ExtraKey {
    /// nil.
    Nil,
    /// A boolean.
    Bool(bool),
    /// A non-negative integer.
    UInt(u64),
    /// A negative integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A string (a cache salt, a LoRA name, a multi-modal hash).
    Str(String),
    /// A byte string.
    Bytes(Vec<u8>),
    /// A nested tuple.
    Array(Vec<ExtraKey>),
}

/// Why a message or payload is not a vLLM KV event batch.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// A message must have exactly three frames.
    #[error("expected 3 frames [topic, seq, payload], got {0}")]
    Frames(usize),
    /// The topic frame is not UTF-8.
    #[error("the topic frame is not UTF-8")]
    Topic,
    /// A replay reply must start with an empty delimiter frame.
    #[error("a replay reply must start with an empty delimiter frame")]
    Delimiter,
    /// The sequence frame must be 8 bytes.
    #[error("the sequence frame must be 8 bytes, got {0}")]
    Seq(usize),
    /// The payload does not decode as an event batch.
    #[error("the payload is not a KV event batch: {0}")]
    Payload(#[from] rmp_serde::decode::Error),
    /// The payload has bytes after the batch.
    #[error("the payload has {0} bytes after the event batch")]
    Trailing(usize),
}

/// Encodes a batch as vLLM does (see the module doc).
pub fn encode(batch: &EventBatch) -> Vec<u8> {
    let mut w = ByteBuf::with_capacity(64 + batch.events.len() * 64);
    let len = if batch.dp_rank.is_some() { 3 } else { 2 };
    ok(mp::write_array_len(&mut w, len));
    ok(mp::write_f64(&mut w, batch.ts));
    ok(mp::write_array_len(&mut w, len32(batch.events.len())));
    for event in &batch.events {
        write_event(&mut w, event);
    }
    if let Some(rank) = batch.dp_rank {
        write_int(&mut w, rank);
    }
    w.into_vec()
}

/// Decodes a payload (see the module doc for what is accepted).
pub fn decode(payload: &[u8]) -> Result<EventBatch, WireError> {
    let mut de = rmp_serde::Deserializer::new(Cursor::new(payload));
    de.set_max_depth(MAX_DEPTH);
    let batch = EventBatch::deserialize(&mut de)?;
    let read = usize::try_from(de.position()).unwrap_or(usize::MAX);
    match payload.len().saturating_sub(read) {
        0 => Ok(batch),
        rest => Err(WireError::Trailing(rest)),
    }
}

/// The three frames of a message: topic, sequence number, payload.
pub fn frames(topic: &str, seq: u64, payload: &[u8]) -> [Vec<u8>; 3] {
    [topic.as_bytes().to_vec(), seq.to_be_bytes().to_vec(), payload.to_vec()]
}

/// Reads a received multipart message into its topic, sequence number and batch.
pub fn parse_message(parts: &[impl AsRef<[u8]>]) -> Result<(String, u64, EventBatch), WireError> {
    let [topic, seq, payload] = parts else { return Err(WireError::Frames(parts.len())) };
    let topic = std::str::from_utf8(topic.as_ref()).map_err(|_| WireError::Topic)?;
    let seq = parse_seq(seq.as_ref())?;
    Ok((topic.to_owned(), seq, decode(payload.as_ref())?))
}

/// Reads an 8-byte big-endian sequence number.
pub fn parse_seq(frame: &[u8]) -> Result<u64, WireError> {
    let bytes: [u8; 8] = frame.try_into().map_err(|_| WireError::Seq(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

// ---- encoding --------------------------------------------------------------

/// Writes to a [`ByteBuf`] cannot fail; this unwraps their uninhabited error.
fn ok<T>(r: Result<T, ValueWriteError<Infallible>>) -> T {
    match r {
        Ok(v) => v,
        Err(ValueWriteError::InvalidMarkerWrite(e) | ValueWriteError::InvalidDataWrite(e)) => match e {},
    }
}

fn ok_marker(r: Result<(), Infallible>) {
    match r {
        Ok(()) => {}
        Err(e) => match e {},
    }
}

/// msgpack lengths are 32-bit; a longer list cannot come from one engine step.
fn len32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn write_str(w: &mut ByteBuf, s: &str) {
    ok(mp::write_str(w, s));
}

/// msgspec writes a non-negative integer in its unsigned form.
fn write_int(w: &mut ByteBuf, v: i64) {
    match u64::try_from(v) {
        Ok(u) => {
            ok(mp::write_uint(w, u));
        }
        Err(_) => {
            ok(mp::write_sint(w, v));
        }
    }
}

fn write_opt_str(w: &mut ByteBuf, v: Option<&str>) {
    match v {
        Some(s) => write_str(w, s),
        None => ok_marker(mp::write_nil(w)),
    }
}

fn write_opt_uint(w: &mut ByteBuf, v: Option<u64>) {
    match v {
        Some(u) => {
            ok(mp::write_uint(w, u));
        }
        None => ok_marker(mp::write_nil(w)),
    }
}

fn write_u64s(w: &mut ByteBuf, values: impl ExactSizeIterator<Item = u64>) {
    ok(mp::write_array_len(w, len32(values.len())));
    for v in values {
        ok(mp::write_uint(w, v));
    }
}

fn write_event(w: &mut ByteBuf, event: &KvEvent) {
    match event {
        KvEvent::BlockStored(s) => {
            let optional = [s.extra_keys.is_some(), s.group_idx.is_some(), s.kv_cache_spec_kind.is_some(), s.lookahead_token_ids.is_some()];
            ok(mp::write_map_len(w, 8 + optional.iter().filter(|&&b| b).count() as u32));
            write_str(w, "type");
            write_str(w, "BlockStored");
            write_str(w, "block_hashes");
            write_u64s(w, s.block_hashes.iter().copied());
            write_str(w, "parent_block_hash");
            write_opt_uint(w, s.parent_block_hash);
            write_str(w, "token_ids");
            write_u64s(w, s.token_ids.iter().map(|&t| u64::from(t)));
            write_str(w, "block_size");
            ok(mp::write_uint(w, u64::from(s.block_size)));
            write_str(w, "lora_id");
            match s.lora_id {
                Some(id) => write_int(w, id),
                None => ok_marker(mp::write_nil(w)),
            }
            write_str(w, "medium");
            write_opt_str(w, s.medium.as_deref());
            write_str(w, "lora_name");
            write_opt_str(w, s.lora_name.as_deref());
            if let Some(keys) = &s.extra_keys {
                write_str(w, "extra_keys");
                ok(mp::write_array_len(w, len32(keys.len())));
                for block in keys {
                    match block {
                        Some(items) => write_extra_keys(w, items),
                        None => ok_marker(mp::write_nil(w)),
                    }
                }
            }
            if let Some(g) = s.group_idx {
                write_str(w, "group_idx");
                ok(mp::write_uint(w, u64::from(g)));
            }
            if let Some(kind) = &s.kv_cache_spec_kind {
                write_str(w, "kv_cache_spec_kind");
                write_str(w, kind);
            }
            if let Some(lists) = &s.lookahead_token_ids {
                write_str(w, "lookahead_token_ids");
                ok(mp::write_array_len(w, len32(lists.len())));
                for tokens in lists {
                    write_u64s(w, tokens.iter().map(|&t| u64::from(t)));
                }
            }
        }
        KvEvent::BlockRemoved(r) => {
            ok(mp::write_map_len(w, 3 + u32::from(r.group_idx.is_some())));
            write_str(w, "type");
            write_str(w, "BlockRemoved");
            write_str(w, "block_hashes");
            write_u64s(w, r.block_hashes.iter().copied());
            write_str(w, "medium");
            write_opt_str(w, r.medium.as_deref());
            if let Some(g) = r.group_idx {
                write_str(w, "group_idx");
                ok(mp::write_uint(w, u64::from(g)));
            }
        }
        KvEvent::AllBlocksCleared => {
            ok(mp::write_map_len(w, 1));
            write_str(w, "type");
            write_str(w, "AllBlocksCleared");
        }
    }
}

fn write_extra_keys(w: &mut ByteBuf, items: &[ExtraKey]) {
    ok(mp::write_array_len(w, len32(items.len())));
    for item in items {
        match item {
            ExtraKey::Nil => ok_marker(mp::write_nil(w)),
            ExtraKey::Bool(b) => ok_marker(mp::write_bool(w, *b)),
            ExtraKey::UInt(u) => {
                ok(mp::write_uint(w, *u));
            }
            ExtraKey::Int(i) => write_int(w, *i),
            ExtraKey::Float(f) => ok(mp::write_f64(w, *f)),
            ExtraKey::Str(s) => write_str(w, s),
            ExtraKey::Bytes(b) => ok(mp::write_bin(w, b)),
            ExtraKey::Array(inner) => write_extra_keys(w, inner),
        }
    }
}

// ---- decoding --------------------------------------------------------------

impl<'de> Deserialize<'de> for EventBatch {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(BatchVisitor)
    }
}

struct BatchVisitor;

impl<'de> Visitor<'de> for BatchVisitor {
    type Value = EventBatch;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an event batch [ts, [events], dp_rank]")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<EventBatch, A::Error> {
        let ts: Float = seq.next_element()?.ok_or_else(|| de::Error::invalid_length(0, &self))?;
        let events = seq.next_element()?.ok_or_else(|| de::Error::invalid_length(1, &self))?;
        let dp_rank = seq.next_element::<Option<i64>>()?.flatten();
        // Trailing items a newer engine may add are skipped, as msgspec does.
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(EventBatch { ts: ts.0, events, dp_rank })
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<EventBatch, A::Error> {
        let (mut ts, mut events, mut dp_rank) = (None, None, None);
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Ts => ts = Some(value::<_, Float>(&mut map, "ts")?.0),
                Key::Events => events = Some(value(&mut map, "events")?),
                Key::DpRank => dp_rank = value(&mut map, "data_parallel_rank")?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(EventBatch {
            ts: ts.ok_or_else(|| de::Error::missing_field("ts"))?,
            events: events.ok_or_else(|| de::Error::missing_field("events"))?,
            dp_rank,
        })
    }
}

/// The next value of a map, its errors prefixed with the field's name.
fn value<'de, A: MapAccess<'de>, T: Deserialize<'de>>(map: &mut A, name: &str) -> Result<T, A::Error> {
    map.next_value().map_err(|e| de::Error::custom(format_args!("{name}: {e}")))
}

/// A float that msgspec would also accept as an integer.
struct Float(f64);

impl<'de> Deserialize<'de> for Float {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Float;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a number")
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Float, E> {
                Ok(Float(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Float, E> {
                Ok(Float(v as f64))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Float, E> {
                Ok(Float(v as f64))
            }
        }
        d.deserialize_any(V)
    }
}

/// Every field name the decoder knows; anything else is skipped.
enum Key {
    Type,
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    KvCacheSpecKind,
    LookaheadTokenIds,
    Ts,
    Events,
    DpRank,
    Other,
}

impl<'de> Deserialize<'de> for Key {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Key;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key, E> {
                Ok(match v {
                    "type" => Key::Type,
                    "block_hashes" => Key::BlockHashes,
                    "parent_block_hash" => Key::ParentBlockHash,
                    "token_ids" => Key::TokenIds,
                    "block_size" => Key::BlockSize,
                    "lora_id" => Key::LoraId,
                    "medium" => Key::Medium,
                    "lora_name" => Key::LoraName,
                    "extra_keys" => Key::ExtraKeys,
                    "group_idx" => Key::GroupIdx,
                    "kv_cache_spec_kind" => Key::KvCacheSpecKind,
                    "lookahead_token_ids" => Key::LookaheadTokenIds,
                    "ts" => Key::Ts,
                    "events" => Key::Events,
                    "data_parallel_rank" | "dp_rank" => Key::DpRank,
                    _ => Key::Other,
                })
            }
        }
        d.deserialize_str(V)
    }
}

impl<'de> Deserialize<'de> for KvEvent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(EventVisitor)
    }
}

struct EventVisitor;

/// The fields of any event, as read; which are required depends on the type.
#[derive(Default)]
struct Fields {
    kind: Option<String>,
    block_hashes: Option<Vec<u64>>,
    parent_block_hash: Option<u64>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<String>,
    lora_name: Option<String>,
    extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    group_idx: Option<u32>,
    kv_cache_spec_kind: Option<String>,
    lookahead_token_ids: Option<Vec<Vec<u32>>>,
}

impl<'de> Visitor<'de> for EventVisitor {
    type Value = KvEvent;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a KV event map with a \"type\"")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<KvEvent, A::Error> {
        let mut f = Fields::default();
        while let Some(key) = map.next_key::<Key>()? {
            match key {
                Key::Type => f.kind = Some(value(&mut map, "type")?),
                Key::BlockHashes => f.block_hashes = Some(value(&mut map, "block_hashes")?),
                Key::ParentBlockHash => f.parent_block_hash = value(&mut map, "parent_block_hash")?,
                Key::TokenIds => f.token_ids = Some(value(&mut map, "token_ids")?),
                Key::BlockSize => f.block_size = Some(value(&mut map, "block_size")?),
                Key::LoraId => f.lora_id = value(&mut map, "lora_id")?,
                Key::Medium => f.medium = value(&mut map, "medium")?,
                Key::LoraName => f.lora_name = value(&mut map, "lora_name")?,
                Key::ExtraKeys => f.extra_keys = value(&mut map, "extra_keys")?,
                Key::GroupIdx => f.group_idx = value(&mut map, "group_idx")?,
                Key::KvCacheSpecKind => f.kv_cache_spec_kind = value(&mut map, "kv_cache_spec_kind")?,
                Key::LookaheadTokenIds => f.lookahead_token_ids = value(&mut map, "lookahead_token_ids")?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        match f.kind.as_deref() {
            Some("BlockStored") => Ok(KvEvent::BlockStored(BlockStored {
                block_hashes: f.block_hashes.ok_or_else(|| de::Error::missing_field("block_hashes"))?,
                parent_block_hash: f.parent_block_hash,
                token_ids: f.token_ids.ok_or_else(|| de::Error::missing_field("token_ids"))?,
                block_size: f.block_size.ok_or_else(|| de::Error::missing_field("block_size"))?,
                lora_id: f.lora_id,
                medium: f.medium,
                lora_name: f.lora_name,
                extra_keys: f.extra_keys,
                group_idx: f.group_idx,
                kv_cache_spec_kind: f.kv_cache_spec_kind,
                lookahead_token_ids: f.lookahead_token_ids,
            })),
            Some("BlockRemoved") => Ok(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: f.block_hashes.ok_or_else(|| de::Error::missing_field("block_hashes"))?,
                medium: f.medium,
                group_idx: f.group_idx,
            })),
            Some("AllBlocksCleared") => Ok(KvEvent::AllBlocksCleared),
            Some(other) => Err(de::Error::unknown_variant(other, &["BlockStored", "BlockRemoved", "AllBlocksCleared"])),
            None => Err(de::Error::missing_field("type")),
        }
    }
}

impl<'de> Deserialize<'de> for ExtraKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ExtraKeyVisitor)
    }
}

struct ExtraKeyVisitor;

impl<'de> Visitor<'de> for ExtraKeyVisitor {
    type Value = ExtraKey;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an extra key: nil, a bool, a number, a string, bytes or an array")
    }
    fn visit_unit<E: de::Error>(self) -> Result<ExtraKey, E> {
        Ok(ExtraKey::Nil)
    }
    fn visit_none<E: de::Error>(self) -> Result<ExtraKey, E> {
        Ok(ExtraKey::Nil)
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<ExtraKey, E> {
        Ok(ExtraKey::Bool(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<ExtraKey, E> {
        Ok(ExtraKey::UInt(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<ExtraKey, E> {
        Ok(u64::try_from(v).map_or(ExtraKey::Int(v), ExtraKey::UInt))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<ExtraKey, E> {
        Ok(ExtraKey::Float(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<ExtraKey, E> {
        Ok(ExtraKey::Str(v.to_owned()))
    }
    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<ExtraKey, E> {
        Ok(ExtraKey::Bytes(v.to_vec()))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ExtraKey, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(ExtraKey::Array(items))
    }
}

#[cfg(test)]
mod tests;
