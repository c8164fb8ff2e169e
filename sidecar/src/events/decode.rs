//! vLLM KV-event payload decoding: the msgspec classes of vLLM's
//! `vllm/distributed/kv_events.py`, in every version's layout.
//!
//! A payload is `[ts, [event, …], dp_rank?]`. Each event is either a positional array whose
//! first element is the tag (vLLM ≤ 0.23) or a map with a `"type"` key (vLLM ≥ 0.24). Array
//! tails may be short (missing trailing fields are `None`); map keys may come in any order and
//! unknown keys are ignored. Hashes may be u64, i64 or bin (last 8 bytes, big-endian).

use kvgate_shared::hash::{EngineHash, ExtraKey};
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
/// extra_keys, per-block keys, tuple, item); skipping and `extra_keys` recurse per level, so
/// hostile input must not be allowed to nest deeply (it would overflow the thread's stack).
const MAX_DEPTH: usize = 32;

/// How deep an event's fields sit: batch, events, event.
const FIELD_DEPTH: usize = 3;

/// Decodes one msgpack payload.
///
/// It reads the payload in one pass, straight into the events' fields: no intermediate tree,
/// so a stored prompt's thousands of hashes and token ids cost one allocation each list.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut r = Reader { rest: payload };
    let Head::Array(len) = r.head()? else { return Err(shape("batch is not an array")) };
    if len < 2 {
        return Err(shape("batch has fewer than 2 elements"));
    }
    let ts = match r.scalar(1)? {
        Head::Float(f) => f,
        Head::Int(i) => i64::try_from(i).map_err(|_| shape("ts is not a number"))? as f64,
        _ => return Err(shape("ts is not a number")),
    };
    let Head::Array(count) = r.head()? else { return Err(shape("events is not an array")) };
    let mut events = Vec::with_capacity(r.capacity(count));
    for _ in 0..count {
        events.push(decode_event(&mut r)?);
    }
    let mut data_parallel_rank = None;
    for position in 2..len {
        let item = r.scalar(1)?;
        if position == 2 {
            data_parallel_rank = item.as_i64();
        }
    }
    if !r.rest.is_empty() {
        return Err(shape(format!("{} trailing bytes after the batch", r.rest.len())));
    }
    Ok(EventBatch { ts, events, data_parallel_rank })
}

/// The fields an event may carry, in the order of `BlockStored`'s positional layout.
#[derive(Clone, Copy, PartialEq)]
enum Field {
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
    /// Map layout only (SGLang).
    CacheSalt,
    /// Map layout only (vLLM 0.26+).
    Locality,
}

impl Field {
    /// The name in the map layout.
    fn name(self) -> &'static str {
        match self {
            Field::BlockHashes => "block_hashes",
            Field::ParentBlockHash => "parent_block_hash",
            Field::TokenIds => "token_ids",
            Field::BlockSize => "block_size",
            Field::LoraId => "lora_id",
            Field::Medium => "medium",
            Field::LoraName => "lora_name",
            Field::ExtraKeys => "extra_keys",
            Field::GroupIdx => "group_idx",
            Field::KvCacheSpecKind => "kv_cache_spec_kind",
            Field::CacheSalt => "cache_salt",
            Field::Locality => "locality",
        }
    }
}

/// An event's kind, and its fields: positional (after the tag) and map-only.
#[derive(Clone, Copy)]
enum Kind {
    Stored,
    Removed,
    Cleared,
}

impl Kind {
    fn from_tag(tag: &str) -> Result<Kind, DecodeError> {
        match tag {
            "BlockStored" => Ok(Kind::Stored),
            "BlockRemoved" => Ok(Kind::Removed),
            "AllBlocksCleared" => Ok(Kind::Cleared),
            other => Err(shape(format!("unknown event type {other:?}"))),
        }
    }

    fn positional(self) -> &'static [Field] {
        match self {
            Kind::Stored => &[
                Field::BlockHashes,
                Field::ParentBlockHash,
                Field::TokenIds,
                Field::BlockSize,
                Field::LoraId,
                Field::Medium,
                Field::LoraName,
                Field::ExtraKeys,
                Field::GroupIdx,
                Field::KvCacheSpecKind,
            ],
            Kind::Removed => &[Field::BlockHashes, Field::Medium, Field::GroupIdx],
            Kind::Cleared => &[],
        }
    }

    fn named(self, name: &str) -> Option<Field> {
        let map_only: &[Field] = match self {
            Kind::Stored => &[Field::CacheSalt, Field::Locality],
            _ => &[],
        };
        self.positional().iter().chain(map_only).copied().find(|f| f.name() == name)
    }
}

/// An event's fields as read; `None` where absent or nil.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<EngineHash>>,
    parent_block_hash: Option<EngineHash>,
    token_ids: Option<Vec<u32>>,
    /// Kept only when a u32; anything else is the same as missing.
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<String>,
    lora_name: Option<String>,
    extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    group_idx: Option<i64>,
    kv_cache_spec_kind: Option<String>,
    cache_salt: Option<String>,
    locality: Option<String>,
}

impl Fields {
    /// Reads `field`'s value. Optional fields of another type read as absent, as vLLM's
    /// readers would ignore them; the lists an event is made of must be well-formed.
    fn read(&mut self, field: Field, r: &mut Reader<'_>) -> Result<(), DecodeError> {
        if r.take_nil() {
            return Ok(());
        }
        match field {
            Field::BlockHashes => self.block_hashes = Some(r.list("block_hashes", Reader::hash)?),
            Field::ParentBlockHash => self.parent_block_hash = Some(r.hash()?),
            Field::TokenIds => self.token_ids = Some(r.list("token_ids", Reader::token_id)?),
            Field::BlockSize => self.block_size = r.scalar(FIELD_DEPTH)?.as_u64().and_then(|n| u32::try_from(n).ok()),
            Field::LoraId => self.lora_id = r.scalar(FIELD_DEPTH)?.as_i64(),
            Field::GroupIdx => self.group_idx = r.scalar(FIELD_DEPTH)?.as_i64(),
            Field::Medium => self.medium = r.scalar(FIELD_DEPTH)?.into_string(),
            Field::LoraName => self.lora_name = r.scalar(FIELD_DEPTH)?.into_string(),
            Field::KvCacheSpecKind => self.kv_cache_spec_kind = r.scalar(FIELD_DEPTH)?.into_string(),
            Field::CacheSalt => self.cache_salt = r.scalar(FIELD_DEPTH)?.into_string(),
            Field::Locality => self.locality = r.scalar(FIELD_DEPTH)?.into_string(),
            Field::ExtraKeys => self.extra_keys = Some(r.extra_keys(FIELD_DEPTH)?),
        }
        Ok(())
    }

    fn into_event(self, kind: Kind) -> Result<KvEvent, DecodeError> {
        let no_hashes = || shape("block_hashes is not an array");
        Ok(match kind {
            Kind::Stored => KvEvent::BlockStored(BlockStored {
                block_hashes: self.block_hashes.ok_or_else(no_hashes)?,
                parent_block_hash: self.parent_block_hash,
                token_ids: self.token_ids.ok_or_else(|| shape("token_ids is not an array"))?,
                block_size: self.block_size.ok_or_else(|| shape("block_size missing or not a u32"))?,
                lora_id: self.lora_id,
                medium: self.medium,
                lora_name: self.lora_name,
                extra_keys: self.extra_keys,
                cache_salt: self.cache_salt,
                locality: self.locality,
                group_idx: self.group_idx,
                kv_cache_spec_kind: self.kv_cache_spec_kind,
            }),
            Kind::Removed => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: self.block_hashes.ok_or_else(no_hashes)?,
                medium: self.medium,
                group_idx: self.group_idx,
            }),
            Kind::Cleared => KvEvent::AllBlocksCleared,
        })
    }
}

/// One event: a positional array whose first element is the tag, or a map with a `"type"`.
fn decode_event(r: &mut Reader<'_>) -> Result<KvEvent, DecodeError> {
    let mut fields = Fields::default();
    let kind = match r.head()? {
        Head::Array(len) => {
            let tag = if len == 0 { None } else { r.scalar(FIELD_DEPTH)?.into_string() };
            let kind = Kind::from_tag(&tag.ok_or_else(|| shape("event array has no tag"))?)?;
            let layout = kind.positional();
            for position in 1..len as usize {
                match layout.get(position - 1) {
                    Some(field) => fields.read(*field, r)?,
                    None => r.skip(FIELD_DEPTH)?,
                }
            }
            kind
        }
        Head::Map(len) => {
            // vLLM writes the tag first; where it is not, find it before reading the rest.
            let kind = Kind::from_tag(&r.clone().map_tag(len)?)?;
            for _ in 0..len {
                let key = r.scalar(FIELD_DEPTH)?;
                match key.as_str().and_then(|name| kind.named(name)) {
                    Some(field) => fields.read(field, r)?,
                    None => r.skip(FIELD_DEPTH)?,
                }
            }
            kind
        }
        _ => return Err(shape("event is neither an array nor a map")),
    };
    fields.into_event(kind)
}

/// The head of one msgpack value: a scalar whole, or a container's length (its items follow).
#[derive(Debug)]
enum Head<'a> {
    Nil,
    Bool,
    Int(i128),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Ext,
    Array(u32),
    Map(u32),
}

impl<'a> Head<'a> {
    fn as_u64(&self) -> Option<u64> {
        match self {
            Head::Int(i) => u64::try_from(*i).ok(),
            _ => None,
        }
    }

    fn as_i64(&self) -> Option<i64> {
        match self {
            Head::Int(i) => i64::try_from(*i).ok(),
            _ => None,
        }
    }

    fn as_str(&self) -> Option<&'a str> {
        match self {
            Head::Str(bytes) => std::str::from_utf8(bytes).ok(),
            _ => None,
        }
    }

    fn into_string(self) -> Option<String> {
        self.as_str().map(str::to_owned)
    }
}

/// A cursor over a payload.
#[derive(Clone)]
struct Reader<'a> {
    rest: &'a [u8],
}

fn truncated() -> DecodeError {
    DecodeError::Msgpack("the payload ends inside a value".into())
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.rest.len() < n {
            return Err(truncated());
        }
        let (head, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(head)
    }

    /// A big-endian unsigned integer of `n` bytes (n ≤ 8).
    fn uint(&mut self, n: usize) -> Result<u64, DecodeError> {
        Ok(self.take(n)?.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b)))
    }

    /// A signed big-endian integer of `n` bytes (n ≤ 8).
    fn int(&mut self, n: usize) -> Result<i64, DecodeError> {
        let shift = 64 - 8 * n as u32;
        Ok(((self.uint(n)? << shift) as i64) >> shift)
    }

    /// A length-prefixed payload whose length takes `n` bytes.
    fn sized(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let len = self.uint(n)?;
        self.take(usize::try_from(len).map_err(|_| truncated())?)
    }

    /// How much room to reserve for `len` items: never more than the bytes left could hold
    /// (every item takes at least one), so a declared length cannot make it allocate.
    fn capacity(&self, len: u32) -> usize {
        (len as usize).min(self.rest.len())
    }

    fn head(&mut self) -> Result<Head<'a>, DecodeError> {
        use rmp::Marker as M;
        let marker = M::from_u8(self.take(1)?[0]);
        Ok(match marker {
            M::Null => Head::Nil,
            M::True | M::False => Head::Bool,
            M::FixPos(n) => Head::Int(i128::from(n)),
            M::FixNeg(n) => Head::Int(i128::from(n)),
            M::U8 => Head::Int(i128::from(self.uint(1)?)),
            M::U16 => Head::Int(i128::from(self.uint(2)?)),
            M::U32 => Head::Int(i128::from(self.uint(4)?)),
            M::U64 => Head::Int(i128::from(self.uint(8)?)),
            M::I8 => Head::Int(i128::from(self.int(1)?)),
            M::I16 => Head::Int(i128::from(self.int(2)?)),
            M::I32 => Head::Int(i128::from(self.int(4)?)),
            M::I64 => Head::Int(i128::from(self.int(8)?)),
            M::F32 => Head::Float(f64::from(f32::from_bits(self.uint(4)? as u32))),
            M::F64 => Head::Float(f64::from_bits(self.uint(8)?)),
            M::FixStr(n) => Head::Str(self.take(usize::from(n))?),
            M::Str8 => Head::Str(self.sized(1)?),
            M::Str16 => Head::Str(self.sized(2)?),
            M::Str32 => Head::Str(self.sized(4)?),
            M::Bin8 => Head::Bin(self.sized(1)?),
            M::Bin16 => Head::Bin(self.sized(2)?),
            M::Bin32 => Head::Bin(self.sized(4)?),
            M::FixArray(n) => Head::Array(u32::from(n)),
            M::Array16 => Head::Array(self.uint(2)? as u32),
            M::Array32 => Head::Array(self.uint(4)? as u32),
            M::FixMap(n) => Head::Map(u32::from(n)),
            M::Map16 => Head::Map(self.uint(2)? as u32),
            M::Map32 => Head::Map(self.uint(4)? as u32),
            M::FixExt1 | M::FixExt2 | M::FixExt4 | M::FixExt8 | M::FixExt16 => {
                let size = match marker {
                    M::FixExt1 => 1,
                    M::FixExt2 => 2,
                    M::FixExt4 => 4,
                    M::FixExt8 => 8,
                    _ => 16,
                };
                self.take(1 + size)?;
                Head::Ext
            }
            M::Ext8 | M::Ext16 | M::Ext32 => {
                let width = match marker {
                    M::Ext8 => 1,
                    M::Ext16 => 2,
                    _ => 4,
                };
                let len = self.uint(width)?;
                self.take(1 + usize::try_from(len).map_err(|_| truncated())?)?;
                Head::Ext
            }
            M::Reserved => return Err(DecodeError::Msgpack("reserved marker 0xc1".into())),
        })
    }

    /// Consumes a nil, if one is next.
    fn take_nil(&mut self) -> bool {
        let nil = self.rest.first() == Some(&0xc0);
        if nil {
            self.rest = &self.rest[1..];
        }
        nil
    }

    /// Skips one value of any shape, `depth` levels down.
    fn skip(&mut self, depth: usize) -> Result<(), DecodeError> {
        let items = match self.head()? {
            Head::Array(n) => u64::from(n),
            Head::Map(n) => 2 * u64::from(n),
            _ => return Ok(()),
        };
        if depth >= MAX_DEPTH {
            return Err(DecodeError::Msgpack(format!("nested deeper than {MAX_DEPTH}")));
        }
        for _ in 0..items {
            self.skip(depth + 1)?;
        }
        Ok(())
    }

    /// One value read as a scalar; a container is skipped whole and returned as its head.
    fn scalar(&mut self, depth: usize) -> Result<Head<'a>, DecodeError> {
        let mut ahead = self.clone();
        let head = ahead.head()?;
        if matches!(head, Head::Array(_) | Head::Map(_)) {
            self.skip(depth)?;
        } else {
            *self = ahead;
        }
        Ok(head)
    }

    /// An array of `item`s; anything else is an error naming `field`.
    fn list<T>(
        &mut self,
        field: &str,
        item: impl Fn(&mut Self) -> Result<T, DecodeError>,
    ) -> Result<Vec<T>, DecodeError> {
        let Head::Array(len) = self.head()? else { return Err(shape(format!("{field} is not an array"))) };
        let mut items = Vec::with_capacity(self.capacity(len));
        for _ in 0..len {
            items.push(item(self)?);
        }
        Ok(items)
    }

    /// A block hash: u64, i64 (reinterpreted), or bytes (last 8, big-endian, as vLLM's int
    /// mode).
    fn hash(&mut self) -> Result<EngineHash, DecodeError> {
        // vLLM's usual encoding (a u64, or an i64), read without the general path.
        if let Some(0xcf | 0xd3) = self.rest.first() {
            if let Some((word, rest)) = self.rest[1..].split_first_chunk::<8>() {
                self.rest = rest;
                return Ok(EngineHash(u64::from_be_bytes(*word)));
            }
        }
        match self.head()? {
            Head::Int(i) => u64::try_from(i)
                .or_else(|_| i64::try_from(i).map(|s| s as u64))
                .map(EngineHash)
                .map_err(|_| shape("bad hash")),
            Head::Bin(b) if !b.is_empty() => {
                let tail = &b[b.len().saturating_sub(8)..];
                Ok(EngineHash(tail.iter().fold(0u64, |acc, byte| (acc << 8) | u64::from(*byte))))
            }
            _ => Err(shape("hash is not an integer or bytes")),
        }
    }

    fn token_id(&mut self) -> Result<u32, DecodeError> {
        // The encodings a token id takes, read without the general path: most of a stored
        // prompt's values are these.
        let width = match self.rest.first() {
            Some(&b) if b < 0x80 => {
                self.rest = &self.rest[1..];
                return Ok(u32::from(b));
            }
            Some(0xcc) => 1,
            Some(0xcd) => 2,
            Some(0xce) => 4,
            _ => 0,
        };
        if width > 0 {
            self.take(1)?;
            return Ok(self.uint(width)? as u32);
        }
        self.head()?.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| shape("token id is not a u32"))
    }

    /// The `"type"` of a map event with `len` pairs (this cursor at its first key).
    fn map_tag(&mut self, len: u32) -> Result<String, DecodeError> {
        for _ in 0..len {
            if self.scalar(FIELD_DEPTH)?.as_str() == Some("type") {
                if let Some(tag) = self.scalar(FIELD_DEPTH)?.into_string() {
                    return Ok(tag);
                }
                break;
            }
            self.skip(FIELD_DEPTH)?;
        }
        Err(shape("event map has no \"type\""))
    }

    /// `extra_keys`: one entry per block, each `nil` or a list of items.
    fn extra_keys(&mut self, depth: usize) -> Result<Vec<Option<Vec<ExtraKey>>>, DecodeError> {
        self.list("extra_keys", |r| {
            if r.take_nil() {
                return Ok(None);
            }
            let mut bytes = r.rest;
            let entry = rmpv::decode::read_value_with_max_depth(&mut bytes, MAX_DEPTH - depth - 1)
                .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
            r.rest = bytes;
            Ok(Some(match entry {
                rmpv::Value::Array(items) => items.iter().map(extra_key).collect(),
                other => vec![extra_key(&other)],
            }))
        })
    }
}

fn extra_key(v: &rmpv::Value) -> ExtraKey {
    use rmpv::Value;
    match v {
        Value::String(s) => ExtraKey::Str(s.as_str().map(str::to_owned).unwrap_or_default()),
        Value::Integer(i) => ExtraKey::Int(i.as_i64().unwrap_or_else(|| i.as_u64().map(|u| u as i64).unwrap_or(0))),
        Value::Binary(b) => ExtraKey::Bytes(b.clone()),
        Value::Array(items) => ExtraKey::List(items.iter().map(extra_key).collect()),
        other => ExtraKey::Str(other.to_string()),
    }
}

#[cfg(test)]
mod tests;
