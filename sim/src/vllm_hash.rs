//! vLLM's prefix-cache block hashes, byte for byte (`vllm/utils/hashing.py`,
//! `vllm/v1/core/kv_cache_utils.py`, 0.29+):
//!
//! - `hash_block_tokens(parent, tokens) = H((parent or NONE_HASH, tuple(tokens), None))`, chained
//!   on the parent's full 32-byte digest;
//! - `sha256` (the default) is SHA-256 over `pickle.dumps(x, protocol=5)`; `sha256_cbor` is
//!   SHA-256 over canonical CBOR;
//! - `NONE_HASH = H(PYTHONHASHSEED)` if that is set, else `H("vllm-none-hash")`;
//! - events carry the digest's last 8 bytes, big-endian, as a u64
//!   (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, the default).
//!
//! Only the handful of pickle/CBOR encodings these tuples need are written here (protocol 5
//! with framing; canonical CBOR), which is what makes the bytes match Python's exactly.

use sha2::{Digest as _, Sha256};

use crate::extra_keys::ExtraKeys;
use crate::lora::Lora;

/// A full block digest.
pub type Digest = [u8; 32];

/// `--prefix-caching-hash-algo`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum HashAlgo {
    /// SHA-256 over pickle protocol 5 (vLLM's default).
    Sha256,
    /// SHA-256 over canonical CBOR.
    #[value(name = "sha256_cbor")]
    Sha256Cbor,
}

/// Computes vLLM's block hashes.
#[derive(Debug, Clone)]
pub struct VllmHasher {
    algo: HashAlgo,
    none_hash: Digest,
}

impl VllmHasher {
    /// A hasher seeded like vLLM: `seed` is `PYTHONHASHSEED` if set.
    pub fn new(algo: HashAlgo, seed: Option<&str>) -> VllmHasher {
        let seed = seed.unwrap_or("vllm-none-hash");
        let bytes = match algo {
            HashAlgo::Sha256 => pickle_str(seed),
            HashAlgo::Sha256Cbor => cbor_str(seed),
        };
        VllmHasher { algo, none_hash: Sha256::digest(bytes).into() }
    }

    /// The digest of a block chained after `parent` (`None`: the first block), with the
    /// request's extra keys: `("lora", name, path)` under an adapter, then
    /// `("cache_salt", salt)` on the first block, as vLLM 0.33 (`None` when there are none).
    pub fn block(&self, parent: Option<&Digest>, tokens: &[u32], keys: &ExtraKeys) -> Digest {
        let items = tagged(keys.lora.as_deref(), keys.salt_of(parent.is_none()));
        let parent = parent.unwrap_or(&self.none_hash);
        let bytes = match self.algo {
            HashAlgo::Sha256 => pickle_block(parent, tokens, &items),
            HashAlgo::Sha256Cbor => cbor_block(parent, tokens, &items),
        };
        Sha256::digest(bytes).into()
    }
}

/// What an event carries: the digest's last 8 bytes, big-endian.
pub fn event_value(d: &Digest) -> u64 {
    u64::from_be_bytes(d[24..].try_into().expect("8 bytes"))
}

/// `pickle.dumps(body, protocol=5)`: PROTO 5, one FRAME, the body, STOP.
fn pickle(body: Vec<u8>) -> Vec<u8> {
    let mut out = vec![0x80, 0x05, 0x95];
    out.extend_from_slice(&(body.len() as u64 + 1).to_le_bytes());
    out.extend(body);
    out.push(b'.');
    out
}

fn pickle_str(s: &str) -> Vec<u8> {
    let mut body = Vec::new();
    pickle_unicode(&mut body, s);
    pickle(body)
}

/// A memoized str: SHORT_BINUNICODE below 256 bytes, else BINUNICODE.
fn pickle_unicode(out: &mut Vec<u8>, s: &str) {
    match u8::try_from(s.len()) {
        Ok(n) => out.extend_from_slice(&[0x8c, n]),
        Err(_) => {
            out.push(b'X');
            out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        }
    }
    out.extend_from_slice(s.as_bytes());
    out.push(0x94); // MEMOIZE
}

fn pickle_int(out: &mut Vec<u8>, v: u32) {
    match v {
        0..=0xff => out.extend_from_slice(&[b'K', v as u8]),
        0x100..=0xffff => {
            out.push(b'M');
            out.extend_from_slice(&(v as u16).to_le_bytes());
        }
        0x1_0000..=0x7fff_ffff => {
            out.push(b'J');
            out.extend_from_slice(&v.to_le_bytes());
        }
        _ => {
            // LONG1: little-endian two's complement, 5 bytes for a u32 >= 2^31.
            out.extend_from_slice(&[0x8a, 5]);
            out.extend_from_slice(&u64::from(v).to_le_bytes()[..5]);
        }
    }
}

/// The tagged extra keys of a block: each a tuple of strings.
fn tagged<'a>(lora: Option<&'a Lora>, cache_salt: Option<&'a str>) -> Vec<Vec<&'a str>> {
    let mut items = Vec::new();
    if let Some(l) = lora {
        items.push(vec!["lora", l.name.as_str(), l.path.as_str()]);
    }
    if let Some(salt) = cache_salt {
        items.push(vec!["cache_salt", salt]);
    }
    items
}

/// Pickle's opcode that makes a tuple of the last `n` (1 to 3) items.
fn pickle_tuple(n: usize) -> u8 {
    0x84 + n as u8
}

/// `(parent_bytes, tuple(tokens), extra_keys)`, extra keys `None` or a tuple of the tagged
/// tuples.
fn pickle_block(parent: &Digest, tokens: &[u32], extra: &[Vec<&str>]) -> Vec<u8> {
    let mut body = vec![b'C', 32]; // SHORT_BINBYTES
    body.extend_from_slice(parent);
    body.push(0x94);
    match tokens.len() {
        0 => body.push(b')'), // EMPTY_TUPLE, not memoized
        n @ 1..=3 => {
            for t in tokens {
                pickle_int(&mut body, *t);
            }
            body.extend_from_slice(&[0x84 + n as u8, 0x94]); // TUPLE1..3, MEMOIZE
        }
        _ => {
            body.push(b'(');
            for t in tokens {
                pickle_int(&mut body, *t);
            }
            body.extend_from_slice(&[b't', 0x94]);
        }
    }
    if extra.is_empty() {
        body.push(b'N');
    } else {
        for item in extra {
            for s in item {
                pickle_unicode(&mut body, s);
            }
            body.extend_from_slice(&[pickle_tuple(item.len()), 0x94]); // TUPLEn, MEMOIZE
        }
        body.extend_from_slice(&[pickle_tuple(extra.len()), 0x94]);
    }
    body.extend_from_slice(&[0x87, 0x94]); // TUPLE3, MEMOIZE
    pickle(body)
}

fn cbor_head(out: &mut Vec<u8>, major: u8, v: u64) {
    let m = major << 5;
    match v {
        0..=23 => out.push(m | v as u8),
        24..=0xff => out.extend_from_slice(&[m | 24, v as u8]),
        0x100..=0xffff => {
            out.push(m | 25);
            out.extend_from_slice(&(v as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(m | 26);
            out.extend_from_slice(&(v as u32).to_be_bytes());
        }
        _ => {
            out.push(m | 27);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }
}

fn cbor_str(s: &str) -> Vec<u8> {
    let mut out = Vec::new();
    cbor_head(&mut out, 3, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
    out
}

fn cbor_block(parent: &Digest, tokens: &[u32], extra: &[Vec<&str>]) -> Vec<u8> {
    let mut out = vec![0x83];
    cbor_head(&mut out, 2, 32);
    out.extend_from_slice(parent);
    cbor_head(&mut out, 4, tokens.len() as u64);
    for t in tokens {
        cbor_head(&mut out, 0, u64::from(*t));
    }
    if extra.is_empty() {
        out.push(0xf6);
    } else {
        cbor_head(&mut out, 4, extra.len() as u64);
        for item in extra {
            cbor_head(&mut out, 4, item.len() as u64);
            for s in item {
                out.extend(cbor_str(s));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_blocks(algo: HashAlgo, seed: Option<&str>) -> (u64, u64) {
        let h = VllmHasher::new(algo, seed);
        let none = ExtraKeys::default();
        let b0 = h.block(None, &[1, 2, 3, 4], &none);
        let b1 = h.block(Some(&b0), &[5, 6, 7, 8], &none);
        (event_value(&b0), event_value(&b1))
    }

    /// Block hashes vLLM 0.33's own `hash_block_tokens` gives for these tokens.
    #[test]
    fn vllm_test_vectors() {
        assert_eq!(two_blocks(HashAlgo::Sha256Cbor, None), (9561501211280363793, 15292913576410714033));
        assert_eq!(two_blocks(HashAlgo::Sha256, None), (1882140585328457242, 15284023028817948126));
        assert_eq!(two_blocks(HashAlgo::Sha256Cbor, Some("0")), (2164874634404590027, 17270480062156288726));
        assert_eq!(two_blocks(HashAlgo::Sha256, Some("0")), (10362225831949560093, 12472515041799373675));
    }

    #[test]
    fn pickle_bytes_match_the_spec() {
        let parent = [0xabu8; 32];
        let mut expected = vec![0x80, 0x05, 0x95, 0x32, 0, 0, 0, 0, 0, 0, 0, 0x43, 0x20];
        expected.extend_from_slice(&parent);
        expected
            .extend_from_slice(&[0x94, 0x28, 0x4b, 1, 0x4b, 2, 0x4b, 3, 0x4b, 4, 0x74, 0x94, 0x4e, 0x87, 0x94, 0x2e]);
        assert_eq!(pickle_block(&parent, &[1, 2, 3, 4], &[]), expected);
        assert_eq!(&cbor_str("vllm-none-hash")[..1], &[0x6e]);
    }

    /// Computed by Python's own `pickle` and `hashlib` (the functions vLLM calls) for
    /// `(parent, (1, 2, 3, 4), (("lora", "my-lora", "/adapters/my-lora"),))`.
    #[test]
    fn lora_blocks_match_python() {
        let lora = Lora { id: 1, name: "my-lora".into(), path: "/adapters/my-lora".into() };
        let expected = "8005955a000000000000004320abababababababababababababababababababababababababababababababab94\
            284b014b024b034b0474948c046c6f7261948c076d792d6c6f7261948c112f61646170746572732f6d792d6c6f72\
            61948794859487942e";
        let bytes = pickle_block(&[0xab; 32], &[1, 2, 3, 4], &tagged(Some(&lora), None));
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, expected.split_whitespace().collect::<String>());
        let h = VllmHasher::new(HashAlgo::Sha256, None);
        let keys = ExtraKeys { lora: Some(std::sync::Arc::new(lora)), cache_salt: None };
        let b0 = h.block(None, &[1, 2, 3, 4], &keys);
        let b1 = h.block(Some(&b0), &[5, 6, 7, 8], &keys);
        assert_eq!((event_value(&b0), event_value(&b1)), (9669051952841315133, 3058926329788360012));
        assert_ne!(event_value(&h.block(None, &[1, 2, 3, 4], &ExtraKeys::default())), event_value(&b0));
    }

    /// A `cache_salt` changes the first block's hash, and through the chain every later one;
    /// the salt itself is in the first block's extra keys only.
    #[test]
    fn a_cache_salt_salts_the_first_block() {
        let h = VllmHasher::new(HashAlgo::Sha256, None);
        let salted = ExtraKeys { lora: None, cache_salt: Some("tenant-a".into()) };
        let plain = ExtraKeys::default();
        let (s0, p0) = (h.block(None, &[1, 2, 3, 4], &salted), h.block(None, &[1, 2, 3, 4], &plain));
        assert_ne!(s0, p0);
        assert_eq!(
            h.block(Some(&s0), &[5, 6, 7, 8], &salted),
            h.block(Some(&s0), &[5, 6, 7, 8], &plain),
            "block 1 has no extra keys"
        );
        let items = tagged(None, salted.salt_of(true));
        assert_eq!(items, [vec!["cache_salt", "tenant-a"]]);
        assert!(salted.salt_of(false).is_none());
    }

    /// The real vLLM 0.32 frames (sha256, block size 32): the same tokens give the same
    /// `block_hashes` through this hasher.
    #[test]
    fn reproduces_real_vllm_frames() {
        let path =
            concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/testdata/vllm-frames/vllm-0.32-run1/decoded.json");
        let decoded: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let h = VllmHasher::new(HashAlgo::Sha256, None);
        let mut digests: std::collections::HashMap<u64, Digest> = std::collections::HashMap::new();
        let mut checked = 0;
        for msg in decoded.as_array().unwrap() {
            for ev in msg["payload"][1].as_array().unwrap() {
                if ev["type"] != "BlockStored" {
                    continue;
                }
                let tokens: Vec<u32> =
                    ev["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
                let mut parent = ev["parent_block_hash"].as_u64().map(|p| digests[&p]);
                for (block, expected) in tokens.chunks(32).zip(ev["block_hashes"].as_array().unwrap()) {
                    let d = h.block(parent.as_ref(), block, &ExtraKeys::default());
                    assert_eq!(event_value(&d), expected.as_u64().unwrap());
                    digests.insert(event_value(&d), d);
                    parent = Some(d);
                    checked += 1;
                }
            }
        }
        assert!(checked >= 6, "checked {checked} blocks");
    }
}
