//! Block hashing, compatible with NVIDIA Dynamo's KV router.
//!
//! A prompt is cut into blocks of `block_size` tokens; only full blocks are hashed.
//!
//! - The **local** hash of a block is `xxh3_64` over its `u32` tokens as little-endian bytes,
//!   seeded with [`SEED`] (plus a LoRA salt, see [`Salt`]).
//! - The **sequence** hash chains them: `seq[0] = local[0]` and
//!   `seq[i] = xxh3_64(le(seq[i-1]) ‖ le(local[i]), SEED)`. A sequence hash therefore names a
//!   whole prefix, which is what the index is keyed by.
//!
//! ```
//! use kvgate_shared::hash::{local_block_hashes, sequence_hashes, LocalBlockHash, Salt, SequenceHash};
//! let local = local_block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4, Salt::NONE);
//! // The 9th token is a partial block.
//! assert_eq!(local, [LocalBlockHash(14643705804678351452), LocalBlockHash(16777012769546811212)]);
//! assert_eq!(sequence_hashes(&local)[1], SequenceHash(4945711292740353085));
//! ```
//!
//! Three kinds of 64-bit hash name a block, each its own type so one is never taken for
//! another: [`LocalBlockHash`] (one block's tokens), [`SequenceHash`] (the prefix ending at a
//! block: what the index is keyed by and the filter sends) and [`EngineHash`] (the engine's own
//! name for a block, opaque to kvgate, from its KV events). On the wire each is a bare `u64`.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// A 64-bit hash newtype: `u64` on the wire, hashed as itself in `nohash` tables.
macro_rules! hash_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
        #[serde(transparent)]
        #[repr(transparent)]
        pub struct $name(pub u64);

        impl nohash_hasher::IsEnabled for $name {}

        impl std::fmt::LowerHex for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                std::fmt::LowerHex::fmt(&self.0, f)
            }
        }
    };
}

hash_type!(
    /// The hash of one block's tokens (and salt), alone.
    LocalBlockHash
);
hash_type!(
    /// The hash of the prefix that ends at a block: its local hash chained after its parent's
    /// sequence hash. Equal sequence hashes mean equal prefixes.
    SequenceHash
);
hash_type!(
    /// The engine's own name for a block (vLLM's `block_hashes`, SGLang's), as its KV events
    /// carry it: opaque, unique per engine only, used to find a stored block's parent and to
    /// apply removals.
    EngineHash
);

/// Dynamo's `XXH3_SEED`, used for local and chained hashes.
pub const SEED: u64 = 1337;

/// The seed adjustment that separates one namespace of blocks (a LoRA adapter) from another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Salt(u64);

impl Salt {
    /// No salt: the base model.
    pub const NONE: Salt = Salt(0);

    /// The salt for blocks computed under a LoRA adapter: `xxh3_64(lora_name, 0)`.
    /// An empty or absent name is the base model.
    pub fn for_lora(lora_name: Option<&str>) -> Salt {
        match lora_name {
            Some(name) if !name.is_empty() => Salt(xxh3_64_with_seed(name.as_bytes(), 0)),
            _ => Salt::NONE,
        }
    }

    /// The salt of per-request extra keys (a `cache_salt`, multimodal identities): a single
    /// string is Dynamo's cache-namespace salt, `xxh3_64(s, 1)`; anything else hashes a tagged
    /// encoding of the keys. No keys is no salt.
    ///
    /// ```
    /// use kvgate_shared::hash::{ExtraKey, Salt};
    /// assert_eq!(Salt::for_extra_keys(&[]), Salt::NONE);
    /// assert_ne!(Salt::for_extra_keys(&["a".into()]), Salt::for_extra_keys(&["b".into()]));
    /// ```
    pub fn for_extra_keys(keys: &[ExtraKey]) -> Salt {
        match keys {
            [] => Salt::NONE,
            [ExtraKey::Str(s)] => Salt(xxh3_64_with_seed(s.as_bytes(), 1)),
            keys => {
                let mut bytes = Vec::new();
                for k in keys {
                    k.encode(&mut bytes);
                }
                Salt(xxh3_64_with_seed(&bytes, 1))
            }
        }
    }

    /// Both salts at once.
    pub fn combine(self, other: Salt) -> Salt {
        Salt(self.0.wrapping_add(other.0))
    }

    /// The seed used for local block hashes under this salt.
    pub fn seed(self) -> u64 {
        SEED.wrapping_add(self.0)
    }
}

/// One item of a block's extra keys (vLLM `extra_keys`, SGLang `cache_salt`): what makes the
/// same tokens different content (a tenant's cache salt, an image's identity).
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(untagged)]
pub enum ExtraKey {
    /// A string (a cache salt, a multimodal identifier).
    Str(String),
    /// An integer (an offset).
    Int(i64),
    /// Bytes (a prompt-embeds digest).
    Bytes(Vec<u8>),
    /// A tuple.
    List(Vec<ExtraKey>),
}

impl From<&str> for ExtraKey {
    fn from(s: &str) -> Self {
        ExtraKey::Str(s.to_owned())
    }
}

impl ExtraKey {
    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            ExtraKey::Str(s) => {
                out.push(b's');
                out.extend_from_slice(&(s.len() as u64).to_le_bytes());
                out.extend_from_slice(s.as_bytes());
            }
            ExtraKey::Int(i) => {
                out.push(b'i');
                out.extend_from_slice(&i.to_le_bytes());
            }
            ExtraKey::Bytes(b) => {
                out.push(b'b');
                out.extend_from_slice(&(b.len() as u64).to_le_bytes());
                out.extend_from_slice(b);
            }
            ExtraKey::List(items) => {
                out.push(b'l');
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for item in items {
                    item.encode(out);
                }
            }
        }
    }
}

/// The local hash of one block's tokens.
pub fn local_block_hash(tokens: &[u32], salt: Salt) -> LocalBlockHash {
    LocalBlockHash(xxh3_64_with_seed(&le_bytes(tokens), salt.seed()))
}

/// A digest of prompt token ids: the local hash of one block holding them all. The filter's
/// `x-kvgate-prompt-digest` debug header and `kvgate-sidecar tokenize` print it (hex), so two
/// pipelines' ids can be compared without shipping them.
pub fn prompt_digest(ids: &[u32]) -> u64 {
    local_block_hash(ids, Salt::NONE).0
}

/// The tokens as little-endian bytes: a free view on little-endian machines (x86, ARM, wasm).
#[cfg(target_endian = "little")]
fn le_bytes(tokens: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    std::borrow::Cow::Borrowed(bytemuck::cast_slice(tokens))
}

#[cfg(not(target_endian = "little"))]
fn le_bytes(tokens: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    std::borrow::Cow::Owned(tokens.iter().flat_map(|t| t.to_le_bytes()).collect())
}

/// Local hashes of every full block of `tokens`. A trailing partial block is ignored.
///
/// # Panics
/// If `block_size` is 0.
pub fn local_block_hashes(tokens: &[u32], block_size: usize, salt: Salt) -> Vec<LocalBlockHash> {
    assert!(block_size > 0, "block_size must be positive");
    tokens.chunks_exact(block_size).map(|block| local_block_hash(block, salt)).collect()
}

/// The next sequence hash after `parent` (None for the first block).
pub fn next_sequence_hash(parent: Option<SequenceHash>, local: LocalBlockHash) -> SequenceHash {
    match parent {
        None => SequenceHash(local.0),
        Some(parent) => {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&parent.0.to_le_bytes());
            bytes[8..].copy_from_slice(&local.0.to_le_bytes());
            SequenceHash(xxh3_64_with_seed(&bytes, SEED))
        }
    }
}

/// Chains local hashes into sequence hashes, starting from the root.
pub fn sequence_hashes(local: &[LocalBlockHash]) -> Vec<SequenceHash> {
    let mut out = Vec::with_capacity(local.len());
    let mut parent = None;
    for &l in local {
        let h = next_sequence_hash(parent, l);
        out.push(h);
        parent = Some(h);
    }
    out
}

/// Sequence hashes of every full block of `tokens`: what the filter sends and the index keys by.
pub fn prompt_block_hashes(tokens: &[u32], block_size: usize, salt: Salt) -> Vec<SequenceHash> {
    sequence_hashes(&local_block_hashes(tokens, block_size, salt))
}

/// The salt vLLM's `cache_salt` adds to a prompt's first block: the extra key its events
/// carry there (the index salts stored blocks from those extra keys the same way).
pub fn cache_salt(salt: &str) -> Salt {
    Salt::for_extra_keys(&[ExtraKey::Str(salt.to_owned())])
}

/// [`prompt_block_hashes`] with `first` combined into the first block's salt only (a
/// [`cache_salt`]): every later block differs through the chain.
pub fn prompt_block_hashes_first_salted(
    tokens: &[u32],
    block_size: usize,
    salt: Salt,
    first: Salt,
) -> Vec<SequenceHash> {
    assert!(block_size > 0, "block_size must be positive");
    let locals: Vec<LocalBlockHash> = tokens
        .chunks_exact(block_size)
        .enumerate()
        .map(|(i, block)| local_block_hash(block, if i == 0 { salt.combine(first) } else { salt }))
        .collect();
    sequence_hashes(&locals)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamo_test_vectors() {
        assert_eq!(local_block_hash(&[1, 2, 3, 4], Salt::NONE), LocalBlockHash(14643705804678351452));
        assert_eq!(local_block_hash(&[5, 6, 7, 8], Salt::NONE), LocalBlockHash(16777012769546811212));
        let seq = prompt_block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4, Salt::NONE);
        assert_eq!(seq, [SequenceHash(14643705804678351452), SequenceHash(4945711292740353085)]);
    }

    #[test]
    fn lora_salt_matches_dynamo() {
        let salt = Salt::for_lora(Some("my-lora"));
        assert_eq!(salt.seed(), 12827409268353072861);
        assert_eq!(local_block_hash(&[1, 2, 3, 4], salt), LocalBlockHash(15671544057904749233));
        assert_eq!(Salt::for_lora(Some("")), Salt::NONE);
        assert_eq!(Salt::for_lora(None), Salt::NONE);
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        assert!(prompt_block_hashes(&[1, 2, 3], 4, Salt::NONE).is_empty());
        assert_eq!(prompt_block_hashes(&[1, 2, 3, 4, 5], 4, Salt::NONE).len(), 1);
    }

    #[test]
    fn sequence_hash_names_the_whole_prefix() {
        let a = prompt_block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4, Salt::NONE);
        let b = prompt_block_hashes(&[9, 2, 3, 4, 5, 6, 7, 8], 4, Salt::NONE);
        assert_ne!(a[1], b[1], "same second block under a different prefix must differ");
    }
}
