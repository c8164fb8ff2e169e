//! The KV index: which replica of a pool holds which prefix blocks.
//!
//! Blocks are keyed by the **sequence hash** of [`kvgate_shared::hash`], recomputed from the
//! `token_ids` of every `BlockStored` event. A sequence hash names a whole prefix, so "replica
//! r holds block i of this prompt" implies it holds blocks `0..i` too, and a lookup is a walk
//! down the prompt's hashes that keeps the replicas still matching.
//!
//! The engine's own block hash is opaque to us: each replica keeps a map from engine hash to
//! sequence hash, used to find a stored block's parent and to apply removals. Engines may store
//! the same block twice (two requests computing it concurrently) and then remove it twice, so
//! each (replica, block) pair is reference-counted.
//!
//! Cost: `store`/`remove` are O(blocks in the event); [`KvIndex::find_matches`] is
//! O(matched depth × replicas holding it); clearing a replica is O(its blocks).

use std::collections::HashMap;

use kvgate_shared::hash::{local_block_hash, next_sequence_hash, Salt};

/// A replica's position in its pool (the order of the config).
pub type ReplicaIdx = usize;

/// Why an event was not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ApplyError {
    /// The event's block size differs from the pool's: chunking would be wrong.
    #[error("block size mismatch")]
    BlockSizeMismatch,
    /// The parent block is unknown: attaching would put blocks at the wrong depth.
    #[error("parent block unknown")]
    ParentUnknown,
    /// `token_ids` does not cover `block_hashes` blocks.
    #[error("token count does not match the block count")]
    TokenCountMismatch,
}

impl ApplyError {
    /// A short label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            ApplyError::BlockSizeMismatch => "block_size_mismatch",
            ApplyError::ParentUnknown => "parent_unknown",
            ApplyError::TokenCountMismatch => "token_count_mismatch",
        }
    }
}

#[derive(Debug, Default)]
struct ReplicaBlocks {
    /// engine hash → (sequence hash, how many times stored).
    by_engine: HashMap<u64, (u64, u32)>,
}

/// The index of one pool (one model, one block size).
#[derive(Debug)]
pub struct KvIndex {
    block_size: usize,
    /// sequence hash → replicas holding it, each with a reference count.
    blocks: HashMap<u64, Vec<(ReplicaIdx, u32)>>,
    replicas: Vec<ReplicaBlocks>,
}

impl KvIndex {
    /// An empty index for `replicas` replicas with the pool's `block_size`.
    pub fn new(block_size: usize, replicas: usize) -> Self {
        KvIndex {
            block_size,
            blocks: HashMap::new(),
            replicas: (0..replicas).map(|_| ReplicaBlocks::default()).collect(),
        }
    }

    /// Applies a `BlockStored`: `engine_hashes[i]` names the block of
    /// `token_ids[i*bs..(i+1)*bs]`, chained after `parent` (an engine hash).
    pub fn store(
        &mut self,
        replica: ReplicaIdx,
        parent: Option<u64>,
        engine_hashes: &[u64],
        token_ids: &[u32],
        block_size: usize,
        lora_name: Option<&str>,
    ) -> Result<(), ApplyError> {
        if block_size != self.block_size {
            return Err(ApplyError::BlockSizeMismatch);
        }
        if token_ids.len() != engine_hashes.len() * block_size {
            return Err(ApplyError::TokenCountMismatch);
        }
        let mut parent_seq = match parent {
            None => None,
            Some(p) => Some(self.replicas[replica].by_engine.get(&p).ok_or(ApplyError::ParentUnknown)?.0),
        };
        let salt = Salt::for_lora(lora_name);
        for (engine_hash, tokens) in engine_hashes.iter().zip(token_ids.chunks_exact(block_size)) {
            let seq = next_sequence_hash(parent_seq, local_block_hash(tokens, salt));
            let entry = self.replicas[replica].by_engine.entry(*engine_hash).or_insert((seq, 0));
            entry.1 += 1;
            if entry.1 == 1 {
                let holders = self.blocks.entry(seq).or_default();
                match holders.iter_mut().find(|(r, _)| *r == replica) {
                    Some((_, n)) => *n += 1,
                    None => holders.push((replica, 1)),
                }
            }
            parent_seq = Some(seq);
        }
        Ok(())
    }

    /// Applies a `BlockRemoved`. Unknown hashes are ignored (they may predate us).
    pub fn remove(&mut self, replica: ReplicaIdx, engine_hashes: &[u64]) {
        for engine_hash in engine_hashes {
            let by_engine = &mut self.replicas[replica].by_engine;
            let Some(entry) = by_engine.get_mut(engine_hash) else { continue };
            entry.1 -= 1;
            if entry.1 > 0 {
                continue;
            }
            let seq = entry.0;
            by_engine.remove(engine_hash);
            self.release(replica, seq);
        }
    }

    fn release(&mut self, replica: ReplicaIdx, seq: u64) {
        if let Some(holders) = self.blocks.get_mut(&seq) {
            if let Some(pos) = holders.iter().position(|(r, _)| *r == replica) {
                holders[pos].1 -= 1;
                if holders[pos].1 == 0 {
                    holders.swap_remove(pos);
                }
            }
            if holders.is_empty() {
                self.blocks.remove(&seq);
            }
        }
    }

    /// Forgets everything a replica holds (`AllBlocksCleared`, restart, removal).
    pub fn clear_replica(&mut self, replica: ReplicaIdx) {
        let by_engine = std::mem::take(&mut self.replicas[replica].by_engine);
        for (seq, _) in by_engine.into_values() {
            self.release(replica, seq);
        }
    }

    /// For each replica, how many leading blocks of the prompt (given as sequence hashes) it
    /// holds. Stops as soon as no replica matches further.
    pub fn find_matches(&self, hashes: &[u64]) -> Vec<u32> {
        let mut depth = vec![0u32; self.replicas.len()];
        let Some(first) = hashes.first().and_then(|h| self.blocks.get(h)) else { return depth };
        let mut active: Vec<ReplicaIdx> = first.iter().map(|(r, _)| *r).collect();
        for r in &active {
            depth[*r] = 1;
        }
        for (i, h) in hashes.iter().enumerate().skip(1) {
            let Some(holders) = self.blocks.get(h) else { break };
            active.retain(|r| holders.iter().any(|(hr, _)| hr == r));
            if active.is_empty() {
                break;
            }
            for r in &active {
                depth[*r] = i as u32 + 1;
            }
        }
        depth
    }

    /// Blocks indexed for a replica.
    pub fn replica_blocks(&self, replica: ReplicaIdx) -> usize {
        self.replicas[replica].by_engine.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_shared::hash::prompt_block_hashes;

    fn tokens(n: u32) -> Vec<u32> {
        (100..100 + n).collect()
    }

    #[test]
    fn stored_chain_matches_prompt_hashes() {
        let mut idx = KvIndex::new(4, 2);
        let t = tokens(12);
        idx.store(1, None, &[11, 12], &t[..8], 4, None).unwrap();
        idx.store(1, Some(12), &[13], &t[8..12], 4, None).unwrap();
        let prompt = prompt_block_hashes(&t, 4, Salt::NONE);
        assert_eq!(idx.find_matches(&prompt), vec![0, 3]);
        // A prompt sharing only the first block.
        let mut other = t.clone();
        other[5] = 1;
        assert_eq!(idx.find_matches(&prompt_block_hashes(&other, 4, Salt::NONE)), vec![0, 1]);
    }

    #[test]
    fn rejects_what_would_be_misplaced() {
        let mut idx = KvIndex::new(4, 1);
        assert_eq!(idx.store(0, Some(99), &[1], &tokens(4), 4, None), Err(ApplyError::ParentUnknown));
        assert_eq!(idx.store(0, None, &[1], &tokens(8), 8, None), Err(ApplyError::BlockSizeMismatch));
        assert_eq!(idx.store(0, None, &[1, 2], &tokens(4), 4, None), Err(ApplyError::TokenCountMismatch));
        assert_eq!(idx.replica_blocks(0), 0);
    }

    #[test]
    fn duplicate_stores_need_matching_removes() {
        let mut idx = KvIndex::new(4, 1);
        let prompt = prompt_block_hashes(&tokens(4), 4, Salt::NONE);
        idx.store(0, None, &[7], &tokens(4), 4, None).unwrap();
        idx.store(0, None, &[7], &tokens(4), 4, None).unwrap();
        idx.remove(0, &[7]);
        assert_eq!(idx.find_matches(&prompt), vec![1]);
        idx.remove(0, &[7]);
        idx.remove(0, &[7, 12345]);
        assert_eq!(idx.find_matches(&prompt), vec![0]);
    }

    #[test]
    fn clear_and_lora_isolation() {
        let mut idx = KvIndex::new(4, 2);
        idx.store(0, None, &[1], &tokens(4), 4, None).unwrap();
        idx.store(1, None, &[1], &tokens(4), 4, Some("adapter")).unwrap();
        let base = prompt_block_hashes(&tokens(4), 4, Salt::NONE);
        assert_eq!(idx.find_matches(&base), vec![1, 0], "a LoRA block never matches the base model");
        idx.clear_replica(0);
        assert_eq!(idx.find_matches(&base), vec![0, 0]);
        assert_eq!(idx.replica_blocks(1), 1);
    }
}
