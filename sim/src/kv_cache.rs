//! A paged KV cache with prefix caching, after vLLM's `BlockPool`, and an optional CPU tier.
//!
//! - The cache has a fixed number of blocks of `block_size` tokens.
//! - A full block gets a hash chained on its parent's, and is findable by it (prefix caching).
//! - Blocks in use are reference-counted; free blocks wait in an LRU queue and keep their
//!   contents (and hash) until reused. Reusing a cached block evicts it: `BlockRemoved`.
//! - Freed requests return their blocks tail first, so a sequence's later blocks are evicted
//!   before its earlier ones (children before parents).
//! - Committing newly full blocks emits one `BlockStored` per request step.
//! - A request under a LoRA adapter hashes its blocks with the adapter as an extra key, so it
//!   shares a prefix only with requests under the same adapter.
//! - With a CPU tier (`--cpu-offload-blocks`), an evicted GPU block moves to CPU memory
//!   (`BlockStored` with `medium: "CPU"`; the CPU tier evicts its own LRU block with a CPU
//!   `BlockRemoved`). A prompt whose prefix continues in the CPU tier loads those blocks
//!   instead of recomputing them.
//!
//! Block hashes are vLLM's own ([`crate::vllm_hash`]), so consumers that rely on vLLM's hash
//! values work against the simulator too; kvgate treats them as opaque.

use std::collections::{HashMap, VecDeque};
use std::num::NonZeroUsize;

use lru::LruCache;

use crate::extra_keys::ExtraKeys;
use crate::kv_events::{Event, Medium};
use crate::vllm_hash::{event_value, Digest, VllmHasher};

#[derive(Debug, Default, Clone)]
struct Block {
    hash: Option<Digest>,
    parent: Option<Digest>,
    tokens: Vec<u32>,
    keys: ExtraKeys,
    refs: u32,
}

/// Blocks held by one request.
#[derive(Debug, Clone)]
pub struct Allocation {
    /// Block ids, in sequence order.
    blocks: Vec<usize>,
    /// How many leading blocks are already committed (hashed).
    committed: usize,
    /// Prompt tokens found in GPU blocks at admission (a multiple of the block size).
    pub cached_tokens: usize,
    /// Prompt tokens loaded from the CPU tier at admission (a multiple of the block size).
    pub loaded_tokens: usize,
    /// The request's extra keys (its LoRA adapter, its `cache_salt`): they salt the hashes.
    keys: ExtraKeys,
}

impl Allocation {
    /// Tokens the request need not compute: GPU hits plus CPU loads.
    pub fn computed_tokens(&self) -> usize {
        self.cached_tokens + self.loaded_tokens
    }

    /// Its block ids, in sequence order.
    pub fn block_ids(&self) -> &[usize] {
        &self.blocks
    }
}

/// Not enough free blocks.
#[derive(Debug, PartialEq, Eq)]
pub struct OutOfBlocks;

/// The cache.
#[derive(Debug, Clone)]
pub struct KvCache {
    block_size: usize,
    hasher: VllmHasher,
    blocks: Vec<Block>,
    /// Free blocks, least recently used first.
    free: VecDeque<usize>,
    /// hash → block id of committed blocks.
    cached: HashMap<Digest, usize>,
    /// The CPU tier, if any: the hashes it holds, least recently used first.
    cpu: Option<LruCache<Digest, ()>>,
}

impl KvCache {
    /// An empty cache of `num_blocks` GPU blocks and `cpu_blocks` CPU blocks (0: no CPU tier).
    pub fn new(block_size: usize, num_blocks: usize, cpu_blocks: usize, hasher: VllmHasher) -> KvCache {
        KvCache {
            block_size,
            hasher,
            blocks: vec![Block::default(); num_blocks],
            free: (0..num_blocks).collect(),
            cached: HashMap::new(),
            cpu: NonZeroUsize::new(cpu_blocks).map(LruCache::new),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// GPU blocks in the cache.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Digests of the full blocks of `tokens`, with the request's extra keys.
    fn hashes(&self, tokens: &[u32], keys: &ExtraKeys) -> Vec<Digest> {
        let mut parent: Option<Digest> = None;
        tokens
            .chunks_exact(self.block_size)
            .map(|b| {
                let h = self.hasher.block(parent.as_ref(), b, keys);
                parent = Some(h);
                h
            })
            .collect()
    }

    /// Admits a sequence: finds its longest cached prefix (GPU blocks, then CPU blocks; at most
    /// `len − 1` tokens, as vLLM always computes at least one) and takes blocks for that prefix
    /// plus up to `budget` tokens to compute. Fails, taking nothing, if blocks run out. Under a
    /// LoRA adapter only that adapter's blocks match.
    pub fn allocate(
        &mut self,
        tokens: &[u32],
        keys: &ExtraKeys,
        budget: usize,
        events: &mut Vec<Event>,
    ) -> Result<Allocation, OutOfBlocks> {
        let hashes = self.hashes(tokens, keys);
        let max_hit_blocks = tokens.len().saturating_sub(1) / self.block_size;
        let hits: Vec<usize> = hashes.iter().take(max_hit_blocks).map_while(|h| self.cached.get(h).copied()).collect();
        let loads = match &self.cpu {
            Some(cpu) => hashes[hits.len()..max_hit_blocks].iter().take_while(|h| cpu.contains(*h)).count(),
            None => 0,
        };
        let computed = (hits.len() + loads) * self.block_size;
        let upto = tokens.len().min(computed.saturating_add(budget));
        let needed = upto.div_ceil(self.block_size) - hits.len();
        let reusable_hits = hits.iter().filter(|b| self.blocks[**b].refs == 0).count();
        if self.free.len() - reusable_hits < needed {
            return Err(OutOfBlocks);
        }
        for &b in &hits {
            if self.blocks[b].refs == 0 {
                self.free.retain(|f| *f != b);
            }
            self.blocks[b].refs += 1;
        }
        if let Some(cpu) = self.cpu.as_mut() {
            for h in &hashes[hits.len()..hits.len() + loads] {
                cpu.promote(h);
            }
        }
        let mut alloc = Allocation {
            committed: hits.len(),
            cached_tokens: hits.len() * self.block_size,
            loaded_tokens: loads * self.block_size,
            blocks: hits,
            keys: keys.clone(),
        };
        for _ in 0..needed {
            let b = self.take_free(events).ok_or(OutOfBlocks)?;
            alloc.blocks.push(b);
        }
        Ok(alloc)
    }

    /// Grows `alloc` to hold `tokens` tokens, evicting cached blocks as needed. Fails, taking
    /// nothing, if blocks run out.
    pub fn ensure(
        &mut self,
        alloc: &mut Allocation,
        tokens: usize,
        events: &mut Vec<Event>,
    ) -> Result<(), OutOfBlocks> {
        let needed = tokens.div_ceil(self.block_size).saturating_sub(alloc.blocks.len());
        if self.free.len() < needed {
            return Err(OutOfBlocks);
        }
        for _ in 0..needed {
            let b = self.take_free(events).ok_or(OutOfBlocks)?;
            alloc.blocks.push(b);
        }
        Ok(())
    }

    /// Takes the least recently used free block, evicting its cached content (one single-hash
    /// `BlockRemoved`, as vLLM emits, and an offload to the CPU tier if there is one).
    fn take_free(&mut self, events: &mut Vec<Event>) -> Option<usize> {
        let b = self.free.pop_front()?;
        let block = std::mem::take(&mut self.blocks[b]);
        if let Some(h) = block.hash {
            self.cached.remove(&h);
            events.push(Event::BlockRemoved { block_hashes: vec![event_value(&h)], medium: Medium::Gpu });
            self.offload(h, block, events);
        }
        self.blocks[b].refs = 1;
        Some(b)
    }

    /// Copies an evicted GPU block to the CPU tier.
    fn offload(&mut self, hash: Digest, block: Block, events: &mut Vec<Event>) {
        let Some(cpu) = self.cpu.as_mut() else { return };
        if cpu.promote(&hash) {
            return;
        }
        let stored = Event::BlockStored {
            block_hashes: vec![event_value(&hash)],
            parent_block_hash: block.parent.as_ref().map(event_value),
            token_ids: block.tokens,
            block_size: self.block_size as u32,
            medium: Medium::Cpu,
            keys: block.keys,
        };
        if let Some((evicted, ())) = cpu.push(hash, ()) {
            events.push(Event::BlockRemoved { block_hashes: vec![event_value(&evicted)], medium: Medium::Cpu });
        }
        events.push(stored);
    }

    /// Commits the allocation's full blocks covering `tokens` (their KV is computed, or being
    /// computed this step): hashes them, makes them findable, and emits one `BlockStored` for
    /// the new ones.
    pub fn commit(&mut self, alloc: &mut Allocation, tokens: &[u32], events: &mut Vec<Event>) {
        let full = (tokens.len() / self.block_size).min(alloc.blocks.len());
        if full <= alloc.committed {
            return;
        }
        let hashes = self.hashes(&tokens[..full * self.block_size], &alloc.keys);
        let start = alloc.committed;
        for (i, &h) in hashes.iter().enumerate().skip(start) {
            let b = alloc.blocks[i];
            // A concurrent request may have committed the same content already: vLLM keeps
            // the first block in the map and still reports this store.
            self.cached.entry(h).or_insert(b);
            let block = &mut self.blocks[b];
            block.hash = Some(h);
            block.parent = i.checked_sub(1).map(|p| hashes[p]);
            block.tokens = tokens[i * self.block_size..(i + 1) * self.block_size].to_vec();
            block.keys = alloc.keys.clone();
        }
        events.push(Event::BlockStored {
            block_hashes: hashes[start..].iter().map(event_value).collect(),
            parent_block_hash: start.checked_sub(1).map(|p| event_value(&hashes[p])),
            token_ids: tokens[start * self.block_size..full * self.block_size].to_vec(),
            block_size: self.block_size as u32,
            medium: Medium::Gpu,
            keys: alloc.keys.clone(),
        });
        alloc.committed = full;
    }

    /// Releases a request's blocks, tail first, to the LRU queue.
    pub fn free(&mut self, alloc: Allocation, events: &mut Vec<Event>) {
        for &b in alloc.blocks.iter().rev() {
            let block = &mut self.blocks[b];
            block.refs -= 1;
            if block.refs == 0 {
                if let Some(h) = block.hash.filter(|h| self.cached.get(h) != Some(&b)) {
                    // A duplicate of a block cached elsewhere (it was stored, and reported, by
                    // a concurrent request): nothing can find it, so it is dropped, and its
                    // store is balanced by a removal.
                    block.hash = None;
                    events.push(Event::BlockRemoved { block_hashes: vec![event_value(&h)], medium: Medium::Gpu });
                }
                self.free.push_back(b);
            }
        }
    }

    /// Drops every cached hash, in both tiers (`/reset_prefix_cache`). Fails if any block is
    /// in use.
    pub fn reset(&mut self, events: &mut Vec<Event>) -> bool {
        if self.blocks.iter().any(|b| b.refs > 0) {
            return false;
        }
        for b in &mut self.blocks {
            *b = Block::default();
        }
        self.cached.clear();
        if let Some(cpu) = self.cpu.as_mut() {
            cpu.clear();
        }
        events.push(Event::AllBlocksCleared);
        true
    }

    /// Blocks findable by their hash on the GPU: the prefix cache a KV-event consumer should
    /// see indexed.
    pub fn cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// Fraction of GPU blocks in use.
    pub fn usage(&self) -> f64 {
        1.0 - self.free.len() as f64 / self.blocks.len().max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lora::Lora;
    use std::sync::Arc;

    fn hasher() -> VllmHasher {
        VllmHasher::new(crate::vllm_hash::HashAlgo::Sha256, None)
    }

    fn toks(n: u32, salt: u32) -> Vec<u32> {
        (0..n).map(|i| i * 7 + salt).collect()
    }

    /// Allocates and computes a whole prompt, as one unchunked prefill.
    fn prefill(c: &mut KvCache, t: &[u32], ev: &mut Vec<Event>) -> Allocation {
        let mut a = c.allocate(t, &ExtraKeys::default(), usize::MAX, ev).unwrap();
        c.commit(&mut a, t, ev);
        a
    }

    /// An adapter's blocks and the base model's never match each other; each matches its own.
    #[test]
    fn lora_requests_share_prefixes_only_with_their_adapter() {
        let mut c = KvCache::new(4, 32, 0, hasher());
        let mut ev = Vec::new();
        let t = toks(12, 1);
        let base = prefill(&mut c, &t, &mut ev);
        c.free(base, &mut ev);
        let lora = Arc::new(Lora { id: 1, name: "sql".into(), path: "/a/sql".into() });
        let mut computed = Vec::new();
        for _ in 0..2 {
            let mut a =
                c.allocate(&t, &ExtraKeys { lora: Some(lora.clone()), cache_salt: None }, usize::MAX, &mut ev).unwrap();
            c.commit(&mut a, &t, &mut ev);
            computed.push(a.cached_tokens);
            c.free(a, &mut ev);
        }
        assert_eq!(computed, [0, 8], "a miss against the base model's blocks, then a hit on its own");
        let stored: Vec<_> = ev
            .iter()
            .filter_map(|e| match e {
                Event::BlockStored { keys, .. } => Some(keys.lora.as_ref().map(|l| l.name.as_str())),
                _ => None,
            })
            .collect();
        // The second run recomputes its last block (vLLM always computes one token) and
        // reports that store again.
        assert_eq!(stored, [None, Some("sql"), Some("sql")], "the adapter's stores name it");
    }

    #[test]
    fn prefix_hits_and_store_events() {
        let mut c = KvCache::new(4, 16, 0, hasher());
        let mut ev = Vec::new();
        let t = toks(10, 1);
        let a = prefill(&mut c, &t, &mut ev);
        assert_eq!((a.cached_tokens, a.blocks.len()), (0, 3));
        assert!(
            matches!(&ev[..], [Event::BlockStored { block_hashes, parent_block_hash: None, token_ids, medium: Medium::Gpu, .. }]
            if block_hashes.len() == 2 && token_ids.len() == 8)
        );
        c.free(a, &mut ev);
        // Same 8-token prefix, new suffix: 2 cached blocks.
        let mut t2 = t[..8].to_vec();
        t2.extend([99, 98, 97, 96, 95]);
        ev.clear();
        let a2 = prefill(&mut c, &t2, &mut ev);
        assert_eq!(a2.cached_tokens, 8);
        let Event::BlockStored { parent_block_hash, block_hashes, .. } = &ev[0] else { panic!() };
        assert_eq!(block_hashes.len(), 1);
        assert!(parent_block_hash.is_some());
    }

    #[test]
    fn chunked_allocation_takes_blocks_for_the_budget_only() {
        let mut c = KvCache::new(4, 16, 0, hasher());
        let mut ev = Vec::new();
        let t = toks(20, 1);
        let mut a = c.allocate(&t, &ExtraKeys::default(), 6, &mut ev).unwrap();
        assert_eq!(a.blocks.len(), 2, "6 tokens need 2 blocks");
        c.commit(&mut a, &t[..6], &mut ev);
        c.ensure(&mut a, 20, &mut ev).unwrap();
        assert_eq!(a.blocks.len(), 5);
        c.commit(&mut a, &t, &mut ev);
        assert!(
            matches!(&ev[..], [Event::BlockStored { block_hashes: first, .. }, Event::BlockStored { block_hashes: rest, parent_block_hash: Some(_), .. }]
            if first.len() == 1 && rest.len() == 4)
        );
    }

    #[test]
    fn decode_fills_and_commits_new_blocks() {
        let mut c = KvCache::new(4, 8, 0, hasher());
        let mut ev = Vec::new();
        let mut t = toks(6, 2);
        let mut a = prefill(&mut c, &t, &mut ev);
        ev.clear();
        for token in [100, 101, 102] {
            t.push(token);
            c.ensure(&mut a, t.len(), &mut ev).unwrap();
            c.commit(&mut a, &t, &mut ev);
        }
        // Block 1 (tokens 4..8) completed during decode: one store, parented on block 0.
        assert!(matches!(&ev[..], [Event::BlockStored { block_hashes, parent_block_hash: Some(_), token_ids, .. }]
            if block_hashes.len() == 1 && token_ids[2..] == [100, 101]));
        assert_eq!(a.blocks.len(), 3);
    }

    #[test]
    fn at_least_one_token_is_computed() {
        let mut c = KvCache::new(4, 8, 0, hasher());
        let mut ev = Vec::new();
        let t = toks(8, 3);
        let a = prefill(&mut c, &t, &mut ev);
        c.free(a, &mut ev);
        assert_eq!(c.allocate(&t, &ExtraKeys::default(), usize::MAX, &mut ev).unwrap().cached_tokens, 4);
    }

    #[test]
    fn eviction_is_lru_tail_first_with_removed_events() {
        let mut c = KvCache::new(4, 2, 0, hasher());
        let mut ev = Vec::new();
        let t = toks(8, 5);
        let a = prefill(&mut c, &t, &mut ev);
        let Event::BlockStored { block_hashes, .. } = ev[0].clone() else { panic!() };
        c.free(a, &mut ev);
        ev.clear();
        let _b = c.allocate(&toks(4, 9), &ExtraKeys::default(), usize::MAX, &mut ev).unwrap();
        assert_eq!(
            ev,
            vec![Event::BlockRemoved { block_hashes: vec![block_hashes[1]], medium: Medium::Gpu }],
            "child evicted first"
        );
        assert_eq!(c.allocate(&toks(8, 11), &ExtraKeys::default(), usize::MAX, &mut ev).unwrap_err(), OutOfBlocks);
    }

    #[test]
    fn evicted_blocks_move_to_the_cpu_tier_and_load_back() {
        let mut c = KvCache::new(4, 3, 2, hasher());
        let mut ev = Vec::new();
        let t = toks(9, 5);
        let a = prefill(&mut c, &t, &mut ev);
        let Event::BlockStored { block_hashes: stored, .. } = ev[0].clone() else { panic!() };
        c.free(a, &mut ev);
        ev.clear();
        // A different prompt takes all three blocks: both cached blocks are evicted to CPU.
        let other = prefill(&mut c, &toks(9, 77), &mut ev);
        let cpu_stores: Vec<u64> = ev
            .iter()
            .filter_map(|e| match e {
                Event::BlockStored { block_hashes, medium: Medium::Cpu, .. } => Some(block_hashes[0]),
                _ => None,
            })
            .collect();
        let mut expected = stored.clone();
        expected.sort_unstable();
        let mut got = cpu_stores.clone();
        got.sort_unstable();
        assert_eq!(got, expected, "both evicted GPU blocks offloaded");
        c.free(other, &mut ev);
        ev.clear();
        // The first prompt again: its prefix is loaded from CPU, not found on GPU.
        let a = c.allocate(&t, &ExtraKeys::default(), usize::MAX, &mut ev).unwrap();
        assert_eq!((a.cached_tokens, a.loaded_tokens, a.computed_tokens()), (0, 8, 8));
    }

    #[test]
    fn the_cpu_tier_evicts_its_own_lru_block() {
        let mut c = KvCache::new(4, 1, 1, hasher());
        let mut ev = Vec::new();
        for salt in [1, 2, 3] {
            let a = prefill(&mut c, &toks(4, salt), &mut ev);
            c.free(a, &mut ev);
        }
        let cpu_removed = ev.iter().filter(|e| matches!(e, Event::BlockRemoved { medium: Medium::Cpu, .. })).count();
        assert_eq!(cpu_removed, 1, "the second offload pushed the first out: {ev:?}");
    }

    #[test]
    fn reset_clears_only_when_idle() {
        let mut c = KvCache::new(4, 4, 0, hasher());
        let mut ev = Vec::new();
        let a = c.allocate(&toks(4, 1), &ExtraKeys::default(), usize::MAX, &mut ev).unwrap();
        assert!(!c.reset(&mut ev));
        c.free(a, &mut ev);
        assert!(c.reset(&mut ev));
        assert_eq!(ev.last(), Some(&Event::AllBlocksCleared));
    }
}
