//! vLLM KV-event payload decoding (`../shared/docs/vllm-kv-events.md` §1).
//!
//! A payload is `[ts, [event, …], dp_rank?]`. Each event is either a positional array whose
//! first element is the tag (vLLM ≤ 0.23) or a map with a `"type"` key (vLLM ≥ 0.24). Array
//! tails may be short (missing trailing fields are `None`); map keys may come in any order and
//! unknown keys are ignored. Hashes may be u64, i64 or bin (last 8 bytes, big-endian).

use kvgate_shared::hash::{EngineHash, ExtraKey};
use rmpv::Value;
use serde::Serialize;

/// Why a payload could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DecodeError {
    /// Not valid msgpack.
    #[error("msgpack: {0}")]
    Msgpack(String),
    /// Valid msgpack, but not the shape of a vLLM event batch.
    #[error("shape: {0}")]
    Shape(String),
}

fn shape(msg: impl Into<String>) -> DecodeError {
    DecodeError::Shape(msg.into())
}

/// One published batch.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventBatch {
    /// Publish time (seconds since the epoch).
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<KvEvent>,
    /// The data-parallel rank of the publisher.
    pub data_parallel_rank: Option<i64>,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type")]
pub enum KvEvent {
    /// New full blocks were committed to the prefix cache.
    BlockStored(BlockStored),
    /// Blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The whole cache was reset.
    AllBlocksCleared,
}

/// `BlockStored`, with vLLM's field names.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BlockStored {
    /// The engine's hashes of the new blocks, in order (opaque ids).
    pub block_hashes: Vec<EngineHash>,
    /// The engine hash of the block before the first new one; `None` at the root.
    pub parent_block_hash: Option<EngineHash>,
    /// The new blocks' tokens, concatenated.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// Deprecated LoRA id.
    pub lora_id: Option<i64>,
    /// Storage tier (`GPU`, `CPU`, …); `None` means the device.
    pub medium: Option<String>,
    /// The LoRA adapter's name; salts the hash.
    pub lora_name: Option<String>,
    /// Per block: the extra keys that make its content distinct (LoRA name, multimodal
    /// identities, cache salt, prompt-embeds digest), or `None`.
    pub extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    /// SGLang's per-request cache salt.
    pub cache_salt: Option<String>,
    /// `LOCAL` or `REMOTE` (vLLM 0.26+); remote copies are not this replica's.
    pub locality: Option<String>,
    /// KV-cache group (hybrid models).
    pub group_idx: Option<i64>,
    /// The group's attention kind (`full_attention`, …).
    pub kv_cache_spec_kind: Option<String>,
}

/// `BlockRemoved`, with vLLM's field names.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BlockRemoved {
    /// Engine hashes of the evicted blocks.
    pub block_hashes: Vec<EngineHash>,
    /// Storage tier.
    pub medium: Option<String>,
    /// KV-cache group.
    pub group_idx: Option<i64>,
}

/// Deepest nesting accepted. A real batch nests about 7 levels (batch, events, event,
/// extra_keys, per-block keys, tuple, item); the decoder recurses per level, so hostile input
/// must not be allowed to nest deeply (it would overflow the thread's stack).
const MAX_DEPTH: usize = 32;

/// Decodes one msgpack payload.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut reader = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut reader, MAX_DEPTH)
        .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
    if !reader.is_empty() {
        return Err(shape(format!("{} trailing bytes after the batch", reader.len())));
    }
    let Value::Array(items) = value else { return Err(shape("batch is not an array")) };
    if items.len() < 2 {
        return Err(shape("batch has fewer than 2 elements"));
    }
    let ts = match &items[0] {
        Value::F64(f) => *f,
        Value::F32(f) => f64::from(*f),
        v => v.as_i64().map(|i| i as f64).ok_or_else(|| shape("ts is not a number"))?,
    };
    let Value::Array(raw_events) = &items[1] else { return Err(shape("events is not an array")) };
    let events = raw_events.iter().map(decode_event).collect::<Result<_, _>>()?;
    let data_parallel_rank = items.get(2).and_then(Value::as_i64);
    Ok(EventBatch { ts, events, data_parallel_rank })
}

/// An event's fields, whether positional or named.
enum Fields<'a> {
    Positional(&'a [Value]),
    Named(&'a [(Value, Value)]),
}

impl<'a> Fields<'a> {
    /// Field `name`, at `position` (1-based after the tag) in the positional layout.
    fn get(&self, position: usize, name: &str) -> Option<&'a Value> {
        let v = match self {
            Fields::Positional(items) => items.get(position),
            Fields::Named(pairs) => pairs.iter().find(|(k, _)| k.as_str() == Some(name)).map(|(_, v)| v),
        };
        v.filter(|v| !v.is_nil())
    }

    /// A field that only exists in the map layout (SGLang's `cache_salt`, vLLM's `locality`).
    fn named(&self, name: &str) -> Option<&'a Value> {
        match self {
            Fields::Positional(_) => None,
            Fields::Named(_) => self.get(usize::MAX, name),
        }
    }
}

fn decode_event(value: &Value) -> Result<KvEvent, DecodeError> {
    let (tag, fields) = match value {
        Value::Array(items) => {
            let tag = items.first().and_then(Value::as_str).ok_or_else(|| shape("event array has no tag"))?;
            (tag, Fields::Positional(items))
        }
        Value::Map(pairs) => {
            let tag = pairs
                .iter()
                .find(|(k, _)| k.as_str() == Some("type"))
                .and_then(|(_, v)| v.as_str())
                .ok_or_else(|| shape("event map has no \"type\""))?;
            (tag, Fields::Named(pairs))
        }
        _ => return Err(shape("event is neither an array nor a map")),
    };
    match tag {
        "BlockStored" => Ok(KvEvent::BlockStored(BlockStored {
            block_hashes: hashes(fields.get(1, "block_hashes"), "block_hashes")?,
            parent_block_hash: fields.get(2, "parent_block_hash").map(hash).transpose()?,
            token_ids: token_ids(fields.get(3, "token_ids"))?,
            block_size: fields
                .get(4, "block_size")
                .and_then(Value::as_u64)
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| shape("block_size missing or not a u32"))?,
            lora_id: fields.get(5, "lora_id").and_then(Value::as_i64),
            medium: string(fields.get(6, "medium")),
            lora_name: string(fields.get(7, "lora_name")),
            extra_keys: fields.get(8, "extra_keys").map(extra_keys).transpose()?,
            cache_salt: fields.named("cache_salt").and_then(Value::as_str).map(str::to_owned),
            locality: fields.named("locality").and_then(Value::as_str).map(str::to_owned),
            group_idx: fields.get(9, "group_idx").and_then(Value::as_i64),
            kv_cache_spec_kind: string(fields.get(10, "kv_cache_spec_kind")),
        })),
        "BlockRemoved" => Ok(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes(fields.get(1, "block_hashes"), "block_hashes")?,
            medium: string(fields.get(2, "medium")),
            group_idx: fields.get(3, "group_idx").and_then(Value::as_i64),
        })),
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        other => Err(shape(format!("unknown event type {other:?}"))),
    }
}

/// `extra_keys`: one entry per block, each `nil` or a list of items.
fn extra_keys(v: &Value) -> Result<Vec<Option<Vec<ExtraKey>>>, DecodeError> {
    let Value::Array(per_block) = v else { return Err(shape("extra_keys is not an array")) };
    Ok(per_block
        .iter()
        .map(|entry| match entry {
            Value::Nil => None,
            Value::Array(items) => Some(items.iter().map(extra_key).collect()),
            other => Some(vec![extra_key(other)]),
        })
        .collect())
}

fn extra_key(v: &Value) -> ExtraKey {
    match v {
        Value::String(s) => ExtraKey::Str(s.as_str().map(str::to_owned).unwrap_or_default()),
        Value::Integer(i) => ExtraKey::Int(i.as_i64().unwrap_or_else(|| i.as_u64().map(|u| u as i64).unwrap_or(0))),
        Value::Binary(b) => ExtraKey::Bytes(b.clone()),
        Value::Array(items) => ExtraKey::List(items.iter().map(extra_key).collect()),
        other => ExtraKey::Str(other.to_string()),
    }
}

fn string(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(str::to_owned)
}

/// A block hash: u64, i64 (reinterpreted), or bytes (last 8, big-endian, as vLLM's int mode).
fn hash(v: &Value) -> Result<EngineHash, DecodeError> {
    match v {
        Value::Integer(i) => {
            i.as_u64().or_else(|| i.as_i64().map(|s| s as u64)).map(EngineHash).ok_or_else(|| shape("bad hash"))
        }
        Value::Binary(b) if !b.is_empty() => {
            let tail = &b[b.len().saturating_sub(8)..];
            Ok(EngineHash(tail.iter().fold(0u64, |acc, byte| (acc << 8) | u64::from(*byte))))
        }
        _ => Err(shape("hash is not an integer or bytes")),
    }
}

fn hashes(v: Option<&Value>, name: &str) -> Result<Vec<EngineHash>, DecodeError> {
    match v {
        Some(Value::Array(items)) => items.iter().map(hash).collect(),
        _ => Err(shape(format!("{name} is not an array"))),
    }
}

fn token_ids(v: Option<&Value>) -> Result<Vec<u32>, DecodeError> {
    match v {
        Some(Value::Array(items)) => items
            .iter()
            .map(|t| t.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| shape("token id is not a u32")))
            .collect(),
        _ => Err(shape("token_ids is not an array")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s = s.trim();
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    fn expected(dp_rank: i64) -> EventBatch {
        EventBatch {
            ts: 1700000000.5,
            events: vec![
                KvEvent::BlockStored(BlockStored {
                    block_hashes: vec![EngineHash(9561501211280363793), EngineHash(15292913576410714033)],
                    parent_block_hash: None,
                    token_ids: (1..=8).collect(),
                    block_size: 4,
                    lora_id: None,
                    medium: Some("GPU".into()),
                    lora_name: None,
                    extra_keys: Some(vec![None, None]),
                    cache_salt: None,
                    locality: None,
                    group_idx: Some(0),
                    kv_cache_spec_kind: Some("full_attention".into()),
                }),
                KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![EngineHash(9561501211280363793)],
                    medium: Some("GPU".into()),
                    group_idx: Some(0),
                }),
                KvEvent::AllBlocksCleared,
            ],
            data_parallel_rank: Some(dp_rank),
        }
    }

    /// The positional (vLLM 0.22) hex example from the spec, §1.4.
    #[test]
    fn decodes_positional_spec_example() {
        let payload = hex(include_str!("../../../testdata/kv-events/vllm-0.22-positional.hex"));
        assert_eq!(decode_batch(&payload).unwrap(), expected(0));
    }

    /// The map (vLLM 0.33) example from the spec, §1.4, assembled from its annotated hex.
    #[test]
    fn decodes_map_spec_example() {
        let payload = hex(include_str!("../../../testdata/kv-events/vllm-0.33-map.hex"));
        assert_eq!(decode_batch(&payload).unwrap(), expected(0));
    }

    #[test]
    fn short_arrays_signed_and_binary_hashes() {
        // vLLM 0.9: [ts, [["BlockStored", [-1], nil, [1,2], 2, nil]]] — 2-element batch, 6-element event.
        let payload =
            hex("92cb3ff000000000000091 96ab426c6f636b53746f72656491ffc0920102 02c0".replace(' ', "").as_str());
        let batch = decode_batch(&payload).unwrap();
        let KvEvent::BlockStored(s) = &batch.events[0] else { panic!() };
        assert_eq!(
            (s.block_hashes[0], s.medium.as_deref(), batch.data_parallel_rank),
            (EngineHash(u64::MAX), None, None)
        );
        // bin hash: last 8 bytes big-endian.
        let payload = hex("92cb3ff00000000000009192ac426c6f636b52656d6f76656491c40a0000000000000000002a");
        let KvEvent::BlockRemoved(r) = &decode_batch(&payload).unwrap().events[0] else { panic!() };
        assert_eq!(r.block_hashes, [EngineHash(42)]);
    }

    /// SGLang 0.5.23: map events with `cache_salt`, signed hashes, one event per page.
    #[test]
    fn decodes_sglang_maps() {
        let mut b = Vec::new();
        let w = &mut b;
        rmp::encode::write_array_len(w, 3).unwrap();
        rmp::encode::write_f64(w, 2.0).unwrap();
        rmp::encode::write_array_len(w, 1).unwrap();
        rmp::encode::write_map_len(w, 7).unwrap();
        for (k, v) in [("type", "BlockStored"), ("medium", "CPU_PINNED"), ("cache_salt", "tenant-7")] {
            rmp::encode::write_str(w, k).unwrap();
            rmp::encode::write_str(w, v).unwrap();
        }
        rmp::encode::write_str(w, "block_hashes").unwrap();
        rmp::encode::write_array_len(w, 1).unwrap();
        rmp::encode::write_sint(w, -5).unwrap();
        rmp::encode::write_str(w, "parent_block_hash").unwrap();
        rmp::encode::write_sint(w, -6).unwrap();
        rmp::encode::write_str(w, "token_ids").unwrap();
        rmp::encode::write_array_len(w, 1).unwrap();
        rmp::encode::write_uint(w, 42).unwrap();
        rmp::encode::write_str(w, "block_size").unwrap();
        rmp::encode::write_uint(w, 1).unwrap();
        rmp::encode::write_sint(w, 3).unwrap(); // attn_dp_rank
        let batch = decode_batch(&b).unwrap();
        let KvEvent::BlockStored(s) = &batch.events[0] else { panic!("{batch:?}") };
        assert_eq!(s.block_hashes, [EngineHash(-5i64 as u64)]);
        assert_eq!(s.parent_block_hash, Some(EngineHash(-6i64 as u64)));
        assert_eq!((s.cache_salt.as_deref(), s.medium.as_deref()), (Some("tenant-7"), Some("CPU_PINNED")));
        assert_eq!(batch.data_parallel_rank, Some(3));
    }

    #[test]
    fn hostile_sizes_and_depths_fail_fast() {
        // An array declaring 2^32-1 events, with nothing behind it.
        assert!(decode_batch(b"\x92\xcb\0\0\0\0\0\0\0\0\xdd\xff\xff\xff\xff").is_err());
        // A string declaring 4 GiB.
        assert!(decode_batch(b"\x92\xcb\0\0\0\0\0\0\0\0\x91\x92\xdb\xff\xff\xff\xff").is_err());
        // 100k nested arrays.
        let mut deep = vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0];
        deep.extend(std::iter::repeat_n(0x91, 100_000));
        assert!(decode_batch(&deep).is_err());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for bad in [
            &b""[..],
            b"\xc1",
            b"\x93\x01",
            b"\x92\xcb\0\0\0\0\0\0\0\0\x91\x81\xa4type\xa3Foo",
            b"\xdd\xff\xff\xff\xff",
        ] {
            assert!(decode_batch(bad).is_err(), "{bad:?}");
        }
    }
}
