//! Real vLLM 0.32 KV-event frames (and the same events in the old array layout) decode to
//! what `decoded.json` says, and indexing them finds the prompt that produced them.

use std::path::PathBuf;

use kvgate_shared::hash::{prompt_block_hashes, Salt};
use kvgate_sidecar::events::decode::{decode_batch, KvEvent};
use kvgate_sidecar::index::{KvIndex, ReplicaIdx, Store, Tier};
use serde_json::Value;

fn frames_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/testdata/vllm-frames")
}

fn read_json(path: PathBuf) -> Value {
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

fn assert_same(ours: &KvEvent, theirs: &Value) {
    let ours = serde_json::to_value(ours).unwrap();
    // Positional fixtures are [tag, hashes, parent, tokens, block_size, lora_id, medium].
    let theirs = match theirs {
        Value::Array(a) => serde_json::json!({
            "type": a[0], "block_hashes": a[1], "parent_block_hash": a[2], "token_ids": a[3],
            "block_size": a[4], "medium": a.get(6).cloned().unwrap_or(Value::Null)}),
        other => other.clone(),
    };
    for key in [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "medium",
        "group_idx",
        "kv_cache_spec_kind",
    ] {
        if let Some(expected) = theirs.get(key) {
            assert_eq!(ours.get(key).unwrap_or(&Value::Null), expected, "field {key}");
        }
    }
}

#[test]
fn real_vllm_032_frames_decode_and_index() {
    let dir = frames_dir().join("vllm-0.32-run1");
    let decoded = read_json(dir.join("decoded.json"));
    let index_json = read_json(dir.join("raw_index.json"));
    let mut index = KvIndex::new(32, 1);
    let mut stored_tokens = Vec::new();
    for (msg, expected) in index_json.as_array().unwrap().iter().zip(decoded.as_array().unwrap()) {
        let files = msg["files"].as_array().unwrap();
        let seq = std::fs::read(dir.join(files[1].as_str().unwrap())).unwrap();
        assert_eq!(u64::from_be_bytes(seq.try_into().unwrap()), msg["seq"].as_u64().unwrap());
        let payload = std::fs::read(dir.join(files[2].as_str().unwrap())).unwrap();
        let batch = decode_batch(&payload).unwrap();
        let events = expected["payload"][1].as_array().unwrap();
        assert_eq!(batch.events.len(), events.len());
        for (ours, theirs) in batch.events.iter().zip(events) {
            assert_same(ours, theirs);
            if let KvEvent::BlockStored(s) = ours {
                let store = Store {
                    parent: s.parent_block_hash,
                    engine_hashes: &s.block_hashes,
                    token_ids: &s.token_ids,
                    block_size: 32,
                    salt: Salt::NONE,
                    extra: &[],
                    tier: Tier::Device,
                };
                index.store(ReplicaIdx::new(0), store).unwrap();
                if s.parent_block_hash.is_none() {
                    stored_tokens.push(s.token_ids.clone());
                }
            }
        }
    }
    assert!(!stored_tokens.is_empty());
    for tokens in stored_tokens {
        let hashes = prompt_block_hashes(&tokens, 32, Salt::NONE);
        assert!(index.find_matches(&hashes)[0].device >= hashes.len() as u32, "the stored prompt is found");
    }
}

#[test]
fn legacy_array_frames_decode() {
    let dir = frames_dir().join("legacy-array-transcoded");
    let index_json = read_json(dir.join("index.json"));
    let frames = index_json["frames"].as_array().unwrap();
    assert!(!frames.is_empty());
    for frame in frames {
        let payload = std::fs::read(dir.join(frame["file"].as_str().unwrap())).unwrap();
        let batch = decode_batch(&payload).unwrap();
        let events = frame["decoded"][1].as_array().unwrap();
        assert_eq!(batch.events.len(), events.len());
        for (ours, theirs) in batch.events.iter().zip(events) {
            assert_same(ours, theirs);
        }
    }
}
