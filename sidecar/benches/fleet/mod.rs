//! The fleet the decision benchmarks route over: every replica caches 64 prompts of the
//! measured size, in 8 groups that share a 16-block prefix, and the decided prompt shares one
//! group's prefix with every replica and then goes on with new content.
//!
//! The replicas' blocks are stored as an engine publishes them. An engine names a block by
//! its content (vLLM hashes the parent's hash and the block's tokens), so a replica holds a
//! group's prefix once: the group's first prompt stores it, and the others store only their
//! own blocks, with the prefix's last block as their parent.

use kvgate_shared::hash::{prompt_block_hashes, EngineHash, Salt};
use kvgate_shared::wire::RouteRequest;
use kvgate_sidecar::index::{ReplicaIdx, Store, Tier};
use kvgate_sidecar::pool::Pool;

/// Tokens per block.
pub const BS: usize = 16;
/// Blocks of a group's shared prefix.
pub const PREFIX_BLOCKS: usize = 16;
/// Prompts cached per replica, and the groups they fall in.
const PROMPTS: u64 = 64;
const GROUPS: u64 = 8;

/// `n` token ids drawn from `seed`.
pub fn tokens(seed: u64, n: usize) -> Vec<u32> {
    (0..n as u64).map(|i| (seed.wrapping_mul(0x9e37_79b9).wrapping_add(i * 7919) % 150_000) as u32).collect()
}

/// Stores the cached prompts of replicas `0..replicas` in `pool`. `tag` is or'ed into every
/// engine hash, to keep them apart from those a benchmark publishes.
pub fn preload(pool: &Pool, replicas: usize, prompt_tokens: usize, tag: u64) {
    for r in 0..replicas as u64 {
        for q in 0..PROMPTS {
            let group = q % GROUPS;
            let mut t = tokens(group, PREFIX_BLOCKS * BS);
            t.extend(tokens(1_000_000 + r * 1000 + q, prompt_tokens - PREFIX_BLOCKS * BS));
            // The prefix's blocks are named by group, the rest by prompt.
            let engine_hash = |b: usize| {
                let (owner, kind) = if b < PREFIX_BLOCKS { (group, 0) } else { (q, 1 << 39) };
                EngineHash(tag | r << 40 | kind | owner << 20 | b as u64)
            };
            let first = if q < GROUPS { 0 } else { PREFIX_BLOCKS };
            let engine: Vec<EngineHash> = (first..t.len() / BS).map(engine_hash).collect();
            let store = Store {
                parent: first.checked_sub(1).map(engine_hash),
                engine_hashes: &engine,
                token_ids: &t[first * BS..(first + engine.len()) * BS],
                block_size: BS,
                salt: Salt::NONE,
                extra: &[],
                tier: Tier::Device,
            };
            pool.store_blocks(ReplicaIdx::new(r as usize), store).expect("consistent");
        }
    }
}

/// A decided request: group 3's prefix, then new content drawn from `content`.
pub fn request(prompt_tokens: usize, content: u64) -> RouteRequest {
    let mut t = tokens(3, PREFIX_BLOCKS * BS);
    t.extend(tokens(content, prompt_tokens - PREFIX_BLOCKS * BS));
    RouteRequest::exact("bench", "m", prompt_tokens as u32, BS as u32, prompt_block_hashes(&t, BS, Salt::NONE))
}
