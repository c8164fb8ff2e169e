//! A paged KV cache with prefix caching, after vLLM's `BlockPool`.
//!
//! - The cache has a fixed number of blocks of `block_size` tokens.
//! - A full block gets a hash chained on its parent's, and is findable by it (prefix caching).
//! - Blocks in use are reference-counted; free blocks wait in an LRU queue and keep their
//!   contents (and hash) until reused. Reusing a cached block evicts it: `BlockRemoved`.
//! - Freed requests return their blocks tail first, so a sequence's later blocks are evicted
//!   before its earlier ones (children before parents).
//! - Committing newly full blocks emits one `BlockStored` per request step.
//!
//! Block hashes are vLLM's own ([`crate::vllm_hash`]), so consumers that rely on vLLM's hash
//! values work against the simulator too; kvgate treats them as opaque.

use std::collections::{HashMap, VecDeque};

use crate::kv_events::Event;
use crate::vllm_hash::{event_value, Digest, VllmHasher};

#[derive(Debug, Default, Clone)]
struct Block {
    hash: Option<Digest>,
    refs: u32,
}

/// Blocks held by one running request.
#[derive(Debug)]
pub struct Allocation {
    /// Block ids, in prompt order.
    pub blocks: Vec<usize>,
    /// Prompt tokens served from the cache (a multiple of the block size).
    pub cached_tokens: usize,
    /// How many leading blocks are already committed (hashed).
    committed: usize,
}

/// Not enough free blocks for a request.
#[derive(Debug, PartialEq, Eq)]
pub struct OutOfBlocks;

/// The cache.
#[derive(Debug)]
pub struct KvCache {
    block_size: usize,
    hasher: VllmHasher,
    blocks: Vec<Block>,
    /// Free blocks, least recently used first.
    free: VecDeque<usize>,
    /// hash → block id of committed blocks.
    cached: HashMap<Digest, usize>,
}

impl KvCache {
    /// An empty cache of `num_blocks` blocks.
    pub fn new(block_size: usize, num_blocks: usize, hasher: VllmHasher) -> KvCache {
        KvCache {
            block_size,
            hasher,
            blocks: vec![Block::default(); num_blocks],
            free: (0..num_blocks).collect(),
            cached: HashMap::new(),
        }
    }

    /// Digests of the prompt's full blocks.
    fn hashes(&self, tokens: &[u32]) -> Vec<Digest> {
        let mut parent: Option<Digest> = None;
        tokens
            .chunks_exact(self.block_size)
            .map(|b| {
                let h = self.hasher.block(parent.as_ref(), b);
                parent = Some(h);
                h
            })
            .collect()
    }

    /// Allocates a prompt: reuses the longest cached prefix (at most `len − 1` tokens, as vLLM
    /// always computes at least one), takes fresh blocks for the rest, evicting LRU cached
    /// blocks as needed (their `BlockRemoved` events are appended to `events`).
    pub fn allocate(&mut self, tokens: &[u32], events: &mut Vec<Event>) -> Result<Allocation, OutOfBlocks> {
        let hashes = self.hashes(tokens);
        let max_hit_blocks = tokens.len().saturating_sub(1) / self.block_size;
        let hits: Vec<usize> = hashes.iter().take(max_hit_blocks).map_while(|h| self.cached.get(h).copied()).collect();
        let needed = tokens.len().div_ceil(self.block_size) - hits.len();
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
        let mut blocks = hits.clone();
        let mut removed = Vec::new();
        for _ in 0..needed {
            let b = self.free.pop_front().ok_or(OutOfBlocks)?;
            if let Some(h) = self.blocks[b].hash.take() {
                self.cached.remove(&h);
                removed.push(h);
            }
            self.blocks[b].refs = 1;
            blocks.push(b);
        }
        // vLLM emits one single-hash BlockRemoved per evicted block.
        events.extend(removed.into_iter().map(|h| Event::BlockRemoved { block_hashes: vec![event_value(&h)] }));
        Ok(Allocation { cached_tokens: hits.len() * self.block_size, committed: hits.len(), blocks })
    }

    /// Adds one block to a running request (its next decode token starts a new block),
    /// evicting a cached block if needed.
    pub fn grow(&mut self, alloc: &mut Allocation, events: &mut Vec<Event>) -> Result<(), OutOfBlocks> {
        let b = self.free.pop_front().ok_or(OutOfBlocks)?;
        if let Some(h) = self.blocks[b].hash.take() {
            self.cached.remove(&h);
            events.push(Event::BlockRemoved { block_hashes: vec![event_value(&h)] });
        }
        self.blocks[b].refs = 1;
        alloc.blocks.push(b);
        Ok(())
    }

    /// Tokens the allocation has room for.
    pub fn capacity(&self, alloc: &Allocation) -> usize {
        alloc.blocks.len() * self.block_size
    }

    /// Commits the allocation's full blocks covering `tokens` (after a step computed them):
    /// hashes them, makes them findable, and emits one `BlockStored` for the new ones.
    pub fn commit(&mut self, alloc: &mut Allocation, tokens: &[u32], events: &mut Vec<Event>) {
        let full = (tokens.len() / self.block_size).min(alloc.blocks.len());
        if full <= alloc.committed {
            return;
        }
        let hashes = self.hashes(&tokens[..full * self.block_size]);
        let start = alloc.committed;
        for (i, &h) in hashes.iter().enumerate().skip(start) {
            let b = alloc.blocks[i];
            // A concurrent request may have committed the same content already: vLLM keeps
            // the first block in the map and still reports this store.
            self.cached.entry(h).or_insert(b);
            self.blocks[b].hash = Some(h);
        }
        events.push(Event::BlockStored {
            block_hashes: hashes[start..].iter().map(event_value).collect(),
            parent_block_hash: start.checked_sub(1).map(|p| event_value(&hashes[p])),
            token_ids: tokens[start * self.block_size..full * self.block_size].to_vec(),
            block_size: self.block_size as u32,
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
                    events.push(Event::BlockRemoved { block_hashes: vec![event_value(&h)] });
                }
                self.free.push_back(b);
            }
        }
    }

    /// Drops every cached hash (`/reset_prefix_cache`). Fails if any block is in use.
    pub fn reset(&mut self, events: &mut Vec<Event>) -> bool {
        if self.blocks.iter().any(|b| b.refs > 0) {
            return false;
        }
        for b in &mut self.blocks {
            b.hash = None;
        }
        self.cached.clear();
        events.push(Event::AllBlocksCleared);
        true
    }

    /// Fraction of blocks in use.
    pub fn usage(&self) -> f64 {
        1.0 - self.free.len() as f64 / self.blocks.len().max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hasher() -> VllmHasher {
        VllmHasher::new(crate::vllm_hash::HashAlgo::Sha256, None)
    }

    fn toks(n: u32, salt: u32) -> Vec<u32> {
        (0..n).map(|i| i * 7 + salt).collect()
    }

    #[test]
    fn prefix_hits_and_store_events() {
        let mut c = KvCache::new(4, 16, hasher());
        let mut ev = Vec::new();
        let t = toks(10, 1);
        let mut a = c.allocate(&t, &mut ev).unwrap();
        assert_eq!((a.cached_tokens, a.blocks.len()), (0, 3));
        c.commit(&mut a, &t, &mut ev);
        assert!(matches!(&ev[..], [Event::BlockStored { block_hashes, parent_block_hash: None, token_ids, .. }]
            if block_hashes.len() == 2 && token_ids.len() == 8));
        c.free(a, &mut ev);
        // Same 8-token prefix, new suffix: 2 cached blocks.
        let mut t2 = t[..8].to_vec();
        t2.extend([99, 98, 97, 96, 95]);
        ev.clear();
        let mut a2 = c.allocate(&t2, &mut ev).unwrap();
        assert_eq!(a2.cached_tokens, 8);
        c.commit(&mut a2, &t2, &mut ev);
        let Event::BlockStored { parent_block_hash, block_hashes, .. } = &ev[0] else { panic!() };
        assert_eq!(block_hashes.len(), 1);
        assert!(parent_block_hash.is_some());
    }

    #[test]
    fn decode_fills_and_commits_new_blocks() {
        let mut c = KvCache::new(4, 8, hasher());
        let mut ev = Vec::new();
        let mut t = toks(6, 2);
        let mut a = c.allocate(&t, &mut ev).unwrap();
        c.commit(&mut a, &t, &mut ev);
        ev.clear();
        for token in [100, 101, 102] {
            t.push(token);
            if t.len() > c.capacity(&a) {
                c.grow(&mut a, &mut ev).unwrap();
            }
            c.commit(&mut a, &t, &mut ev);
        }
        // Block 1 (tokens 4..8) completed during decode: one store, parented on block 0.
        assert!(matches!(&ev[..], [Event::BlockStored { block_hashes, parent_block_hash: Some(_), token_ids, .. }]
            if block_hashes.len() == 1 && token_ids[2..] == [100, 101]));
        assert_eq!(a.blocks.len(), 3);
    }

    #[test]
    fn at_least_one_token_is_computed() {
        let mut c = KvCache::new(4, 8, hasher());
        let mut ev = Vec::new();
        let t = toks(8, 3);
        let mut a = c.allocate(&t, &mut ev).unwrap();
        c.commit(&mut a, &t, &mut ev);
        c.free(a, &mut ev);
        assert_eq!(c.allocate(&t, &mut ev).unwrap().cached_tokens, 4);
    }

    #[test]
    fn eviction_is_lru_tail_first_with_removed_events() {
        let mut c = KvCache::new(4, 2, hasher());
        let mut ev = Vec::new();
        let t = toks(8, 5);
        let mut a = c.allocate(&t, &mut ev).unwrap();
        c.commit(&mut a, &t, &mut ev);
        let Event::BlockStored { block_hashes, .. } = ev[0].clone() else { panic!() };
        c.free(a, &mut ev);
        ev.clear();
        let _b = c.allocate(&toks(4, 9), &mut ev).unwrap();
        assert_eq!(ev, vec![Event::BlockRemoved { block_hashes: vec![block_hashes[1]] }], "child evicted first");
        assert_eq!(c.allocate(&toks(8, 11), &mut ev).unwrap_err(), OutOfBlocks);
    }

    #[test]
    fn reset_clears_only_when_idle() {
        let mut c = KvCache::new(4, 4, hasher());
        let mut ev = Vec::new();
        let a = c.allocate(&toks(4, 1), &mut ev).unwrap();
        assert!(!c.reset(&mut ev));
        c.free(a, &mut ev);
        assert!(c.reset(&mut ev));
        assert_eq!(ev.last(), Some(&Event::AllBlocksCleared));
    }
}
