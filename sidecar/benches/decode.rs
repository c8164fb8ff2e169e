//! Decoding one KV-event message, as vLLM 0.33 publishes it for a stored prompt of 1k and 8k
//! tokens (blocks of 16: a `BlockStored` with 64 or 512 hashes, the tokens, `extra_keys` of
//! nils, and the tier, group and kind fields) and for the eviction of the same blocks.
//!
//! The baseline, in the same run, is reading the payload into a generic msgpack tree
//! (`rmpv::Value`) — the first step of the decoder before it read the payload in one typed
//! pass, and so a lower bound on what that decoder cost.
//! Run: `cargo bench -p kvgate-sidecar --bench decode`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvgate_sidecar::events::decode::decode_batch;
use rmp::encode as mp;

const BS: u64 = 16;

/// A batch of one event, in vLLM 0.33's map layout.
fn message(tokens: u64, stored: bool) -> Vec<u8> {
    let blocks = tokens / BS;
    let mut w = Vec::new();
    mp::write_array_len(&mut w, 3).unwrap();
    mp::write_f64(&mut w, 1_700_000_000.5).unwrap();
    mp::write_array_len(&mut w, 1).unwrap();
    mp::write_map_len(&mut w, if stored { 11 } else { 4 }).unwrap();
    mp::write_str(&mut w, "type").unwrap();
    mp::write_str(&mut w, if stored { "BlockStored" } else { "BlockRemoved" }).unwrap();
    mp::write_str(&mut w, "block_hashes").unwrap();
    mp::write_array_len(&mut w, blocks as u32).unwrap();
    for b in 0..blocks {
        mp::write_uint(&mut w, b.wrapping_mul(0x9e37_79b9_7f4a_7c15)).unwrap();
    }
    if stored {
        mp::write_str(&mut w, "parent_block_hash").unwrap();
        mp::write_nil(&mut w).unwrap();
        mp::write_str(&mut w, "token_ids").unwrap();
        mp::write_array_len(&mut w, tokens as u32).unwrap();
        for t in 0..tokens {
            mp::write_uint(&mut w, t * 7919 % 150_000).unwrap();
        }
        mp::write_str(&mut w, "block_size").unwrap();
        mp::write_uint(&mut w, BS).unwrap();
        mp::write_str(&mut w, "lora_id").unwrap();
        mp::write_nil(&mut w).unwrap();
        mp::write_str(&mut w, "lora_name").unwrap();
        mp::write_nil(&mut w).unwrap();
        mp::write_str(&mut w, "extra_keys").unwrap();
        mp::write_array_len(&mut w, blocks as u32).unwrap();
        for _ in 0..blocks {
            mp::write_nil(&mut w).unwrap();
        }
        mp::write_str(&mut w, "kv_cache_spec_kind").unwrap();
        mp::write_str(&mut w, "full_attention").unwrap();
    }
    mp::write_str(&mut w, "medium").unwrap();
    mp::write_str(&mut w, "GPU").unwrap();
    mp::write_str(&mut w, "group_idx").unwrap();
    mp::write_uint(&mut w, 0).unwrap();
    mp::write_uint(&mut w, 0).unwrap();
    w
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode");
    for (event, stored) in [("stored", true), ("removed", false)] {
        for tokens in [1024, 8192] {
            let payload = message(tokens, stored);
            assert!(decode_batch(&payload).is_ok(), "the message decodes");
            let id = format!("{event}/{tokens}");
            g.throughput(Throughput::Bytes(payload.len() as u64));
            g.bench_with_input(BenchmarkId::new("typed", &id), &payload, |b, p| b.iter(|| decode_batch(p)));
            g.bench_with_input(BenchmarkId::new("value-tree", &id), &payload, |b, p| {
                b.iter(|| rmpv::decode::read_value(&mut &p[..]))
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
