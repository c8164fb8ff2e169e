//! The KV index: which replica of a pool holds which prefix blocks, on which storage tier.
//!
//! Blocks are keyed by the **sequence hash** of [`kvgate_shared::hash`], recomputed from the
//! `token_ids` of every `BlockStored` event. A sequence hash names a whole prefix, so "replica
//! r holds block i of this prompt" implies it holds blocks `0..i` too, and a lookup is a walk
//! down the prompt's hashes that keeps the replicas still matching. See `README.md` beside
//! this file for the design and its measurements.
//!
//! The engine's own block hash is opaque to us: each replica keeps a map from engine hash to
//! sequence hash, used to find a stored block's parent and to apply removals. Engines may store
//! the same block twice (two requests computing it concurrently) and then remove it twice, so
//! each (replica, tier, block) is reference-counted.
//!
//! Cost: `store`/`remove` are O(blocks in the event); [`KvIndex::find_matches`] is
//! O(matched depth × replicas still matching); clearing a replica is O(its blocks).

pub mod approx;
mod sharded;

use std::collections::hash_map::Entry;

use kvgate_shared::hash::{local_block_hash, next_sequence_hash, Salt};
use serde::Serialize;
use sharded::{EngineShards, HolderMap, HolderShards, Map};

/// A replica's position in its pool (the order of the config).
pub type ReplicaIdx = usize;

/// Where a cached block lives. Overlap on a lower tier is worth less (it must be loaded).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Tier {
    /// GPU memory: a hit costs nothing.
    Device,
    /// Host (CPU, pinned) memory.
    Host,
    /// Disk, storage, or an external/remote store.
    Disk,
}

impl Tier {
    /// All tiers, best first.
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

    /// The tier of a vLLM/SGLang/LMCache `medium` string (any case). `None` is the device.
    /// Unknown media give `None` (the event is dropped and counted).
    ///
    /// ```
    /// use kvgate_sidecar::index::Tier;
    /// assert_eq!(Tier::from_medium(None), Some(Tier::Device));
    /// assert_eq!(Tier::from_medium(Some("cpu_pinned")), Some(Tier::Host));
    /// assert_eq!(Tier::from_medium(Some("NVME")), Some(Tier::Disk));
    /// assert_eq!(Tier::from_medium(Some("tape")), None);
    /// ```
    pub fn from_medium(medium: Option<&str>) -> Option<Tier> {
        let Some(m) = medium else { return Some(Tier::Device) };
        match m.to_ascii_uppercase().as_str() {
            "GPU" | "DEVICE" => Some(Tier::Device),
            "CPU" | "CPU_PINNED" | "CPU_TIER1" => Some(Tier::Host),
            "DISK" | "STORAGE" | "NVME" | "CPU_TIER2" | "FS" | "OBJ" | "EXTERNAL" | "REMOTE" | "SHARED" | "NETWORK" => {
                Some(Tier::Disk)
            }
            _ => None,
        }
    }

    fn idx(self) -> usize {
        self as usize
    }
}

/// A replica's overlap with a prompt, in blocks, per tier. Lower tiers count only blocks that
/// continue past the better tiers' match (as Dynamo's lower-tier indexers do).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Overlap {
    /// Leading prompt blocks on the device.
    pub device: u32,
    /// Following blocks in host memory.
    pub host: u32,
    /// Following blocks on disk or external storage.
    pub disk: u32,
}

impl Overlap {
    /// This overlap with at least `device` leading blocks on the device: lower-tier blocks the
    /// longer device run now covers stop counting on their tier.
    ///
    /// ```
    /// use kvgate_sidecar::index::Overlap;
    /// let o = Overlap { device: 2, host: 3, disk: 1 };
    /// assert_eq!(o.with_device_at_least(4), Overlap { device: 4, host: 1, disk: 1 });
    /// assert_eq!(o.with_device_at_least(9), Overlap { device: 9, host: 0, disk: 0 });
    /// assert_eq!(o.with_device_at_least(1), o);
    /// ```
    pub fn with_device_at_least(self, device: u32) -> Overlap {
        if device <= self.device {
            return self;
        }
        let host_end = self.device + self.host;
        let disk_end = host_end + self.disk;
        Overlap { device, host: host_end.saturating_sub(device), disk: disk_end.saturating_sub(device.max(host_end)) }
    }
}

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

/// A `BlockStored`, as the index needs it.
#[derive(Debug, Clone, Copy)]
pub struct Store<'a> {
    /// Engine hash of the block before the first new one (`None`: the prompt's start).
    pub parent: Option<u64>,
    /// Engine hashes of the new blocks.
    pub engine_hashes: &'a [u64],
    /// Their tokens, concatenated.
    pub token_ids: &'a [u32],
    /// The event's block size.
    pub block_size: usize,
    /// The salt of these blocks (LoRA adapter).
    pub salt: Salt,
    /// Per-block extra salts (cache salt, multimodal identity), aligned with the blocks;
    /// empty when there are none.
    pub extra: &'a [Salt],
    /// The storage tier.
    pub tier: Tier,
}

/// The holder code of a block held by several replicas, or by one whose index is above the
/// codes (its holders are in [`Tables::spill`]).
const SPILLED: u32 = HolderMap::MAX_CODE;

/// One tier's tables.
#[derive(Debug, Default)]
struct Tables {
    /// Sequence hash → its holder code: the replica index of its only holder, or
    /// [`SPILLED`]. Most blocks have one holder, so an entry is 8 bytes (the code lives in
    /// the key bits the shard implies).
    blocks: HolderShards,
    /// Holder lists of spilled blocks, sorted; duplicates allowed (two engine hashes of one
    /// replica may name the same content).
    spill: Map<Vec<u32>>,
    /// Blocks in `blocks` (counting them would visit every shard).
    len: usize,
}

impl Tables {
    /// The holder code of a replica.
    fn code(replica: u32) -> u32 {
        replica.min(SPILLED)
    }

    /// The holder code of block `seq`, if any replica holds it.
    fn get(&self, seq: u64) -> Option<u32> {
        self.blocks.shard(seq).get(seq)
    }

    fn add_holder(&mut self, seq: u64, replica: u32) {
        let own = Self::code(replica);
        let Some(code) = self.blocks.shard_mut(seq).try_insert(seq, own) else {
            if own == SPILLED {
                self.spill.insert(seq, vec![replica]);
            }
            self.len += 1;
            return;
        };
        if code == SPILLED {
            let list = self.spill.entry(seq).or_default();
            list.insert(list.partition_point(|r| *r < replica), replica);
        } else {
            self.spill.insert(seq, if code < replica { vec![code, replica] } else { vec![replica, code] });
            self.blocks.shard_mut(seq).set(seq, SPILLED);
        }
    }

    fn remove_holder(&mut self, seq: u64, replica: u32) {
        let Some(code) = self.get(seq) else { return };
        if code != SPILLED {
            if code == replica {
                self.blocks.shard_mut(seq).remove(seq);
                self.len -= 1;
            }
            return;
        }
        let Some(list) = self.spill.get_mut(&seq) else { return };
        if let Ok(at) = list.binary_search(&replica) {
            list.remove(at);
        }
        match *list.as_slice() {
            [] => {
                self.blocks.shard_mut(seq).remove(seq);
                self.len -= 1;
            }
            [only] if only < SPILLED => self.blocks.shard_mut(seq).set(seq, only),
            _ => return,
        }
        self.spill.remove(&seq);
    }

    /// The holders of block `seq` whose holder code is `code`, sorted (a one-element slice
    /// for a single holder).
    fn holders<'a>(&'a self, seq: u64, code: &'a u32) -> &'a [u32] {
        if *code != SPILLED {
            std::slice::from_ref(code)
        } else {
            self.spill.get(&seq).map_or(&[], Vec::as_slice)
        }
    }
}

/// One replica's engine-hash bookkeeping on one tier.
#[derive(Debug, Default)]
struct EngineBlocks {
    /// Engine hash → sequence hash.
    seq: EngineShards,
    /// Engine hashes stored more than once (reported twice, removed twice): extra count.
    extra_refs: Map<u32>,
}

#[derive(Debug, Default)]
struct ReplicaBlocks {
    tiers: [EngineBlocks; 3],
}

/// The index of one pool (one model, one block size).
#[derive(Debug)]
pub struct KvIndex {
    block_size: usize,
    tiers: [Tables; 3],
    replicas: Vec<ReplicaBlocks>,
    /// Sequence hashes of the event being stored (kept to reuse its allocation).
    scratch: Vec<u64>,
}

/// How many prompt blocks are looked up together: independent lookups let the CPU overlap
/// their cache misses.
const LOOKUP_BATCH: usize = 8;

impl KvIndex {
    /// An empty index for `replicas` replicas with the pool's `block_size`.
    pub fn new(block_size: usize, replicas: usize) -> Self {
        KvIndex {
            block_size,
            tiers: Default::default(),
            replicas: (0..replicas).map(|_| ReplicaBlocks::default()).collect(),
            scratch: Vec::new(),
        }
    }

    /// Makes room for one more replica (discovery found a new one); returns its index.
    pub fn add_replica(&mut self) -> ReplicaIdx {
        self.replicas.push(ReplicaBlocks::default());
        self.replicas.len() - 1
    }

    /// The sequence hash of a replica's engine block, on any tier.
    fn lookup(&self, replica: ReplicaIdx, engine_hash: u64) -> Option<u64> {
        self.replicas[replica].tiers.iter().find_map(|t| t.seq.shard(engine_hash).get(&engine_hash)).copied()
    }

    /// Applies a `BlockStored`: `engine_hashes[i]` names the block of
    /// `token_ids[i*bs..(i+1)*bs]`, chained after `parent`.
    pub fn store(&mut self, replica: ReplicaIdx, s: Store<'_>) -> Result<(), ApplyError> {
        if s.block_size != self.block_size {
            return Err(ApplyError::BlockSizeMismatch);
        }
        if s.token_ids.len() != s.engine_hashes.len() * s.block_size {
            return Err(ApplyError::TokenCountMismatch);
        }
        let mut parent_seq = match s.parent {
            None => None,
            Some(p) => Some(self.lookup(replica, p).ok_or(ApplyError::ParentUnknown)?),
        };
        let t = s.tier.idx();
        let engine = &mut self.replicas[replica].tiers[t];
        let tables = &mut self.tiers[t];
        let mut seqs = std::mem::take(&mut self.scratch);
        seqs.clear();
        for (i, tokens) in s.token_ids.chunks_exact(s.block_size).enumerate() {
            let salt = s.salt.combine(s.extra.get(i).copied().unwrap_or(Salt::NONE));
            let seq = next_sequence_hash(parent_seq, local_block_hash(tokens, salt));
            seqs.push(seq);
            parent_seq = Some(seq);
        }
        // Look every block up once before inserting: the lookups are independent, so the CPU
        // overlaps their cache misses, and the inserts below find their lines in cache.
        for (engine_hash, seq) in s.engine_hashes.iter().zip(&seqs) {
            std::hint::black_box((engine.seq.shard(*engine_hash).get(engine_hash), tables.get(*seq)));
        }
        for (engine_hash, seq) in s.engine_hashes.iter().zip(&seqs) {
            match engine.seq.shard_mut(*engine_hash).entry(*engine_hash) {
                Entry::Occupied(_) => *engine.extra_refs.entry(*engine_hash).or_default() += 1,
                Entry::Vacant(v) => {
                    v.insert(*seq);
                    tables.add_holder(*seq, replica as u32);
                }
            }
        }
        self.scratch = seqs;
        Ok(())
    }

    /// Applies a `BlockRemoved` (or several in a row: their hashes, in order). Unknown hashes
    /// are ignored (they may predate us).
    pub fn remove(&mut self, replica: ReplicaIdx, tier: Tier, engine_hashes: &[u64]) {
        let t = tier.idx();
        let engine = &mut self.replicas[replica].tiers[t];
        if engine_hashes.len() > 1 {
            // Look everything up before changing anything, in two passes (the engine entries,
            // then the holder entries they name): lookups within a pass are independent, so
            // the CPU overlaps their cache misses, and the removals below find their lines
            // in cache.
            let mut seqs = std::mem::take(&mut self.scratch);
            seqs.clear();
            seqs.extend(engine_hashes.iter().filter_map(|h| engine.seq.shard(*h).get(h)));
            for seq in &seqs {
                std::hint::black_box(self.tiers[t].get(*seq));
            }
            self.scratch = seqs;
        }
        for engine_hash in engine_hashes {
            if let Some(extra) = engine.extra_refs.get_mut(engine_hash) {
                *extra -= 1;
                if *extra == 0 {
                    engine.extra_refs.remove(engine_hash);
                }
                continue;
            }
            if let Some(seq) = engine.seq.shard_mut(*engine_hash).remove(engine_hash) {
                self.tiers[t].remove_holder(seq, replica as u32);
            }
        }
    }

    /// Forgets everything a replica holds (`AllBlocksCleared`, restart, removal).
    pub fn clear_replica(&mut self, replica: ReplicaIdx) {
        let tiers = std::mem::take(&mut self.replicas[replica].tiers);
        for (t, engine) in tiers.into_iter().enumerate() {
            for seq in engine.seq.into_values() {
                self.tiers[t].remove_holder(seq, replica as u32);
            }
        }
    }

    /// Whether `replica` holds `seq` on tier `t`.
    fn holds(&self, t: usize, seq: u64, replica: ReplicaIdx) -> bool {
        let tables = &self.tiers[t];
        tables.get(seq).is_some_and(|c| tables.holders(seq, &c).binary_search(&(replica as u32)).is_ok())
    }

    /// Each replica's [`Overlap`] with the prompt (given as sequence hashes), in replica order.
    pub fn find_matches(&self, hashes: &[u64]) -> Vec<Overlap> {
        let mut out = vec![Overlap::default(); self.replicas.len()];
        for (r, o) in self.find_overlaps(hashes) {
            out[r as usize] = o;
        }
        out
    }

    /// The replicas with a non-zero [`Overlap`] with the prompt, with it (no allocation for a
    /// miss). The device walk keeps the replicas holding every block so far and stops as soon
    /// as none is left.
    pub fn find_overlaps(&self, hashes: &[u64]) -> Vec<(u32, Overlap)> {
        let mut out: Vec<(u32, Overlap)> = Vec::new();
        let device = &self.tiers[0];
        // The first block decides the candidates; most misses end here.
        let first = hashes.first().and_then(|h| Some((*h, device.get(*h)?)));
        let mut active: Vec<u32> = first.map_or(Vec::new(), |(seq, code)| device.holders(seq, &code).to_vec());
        active.dedup();
        let mut depth = usize::from(!active.is_empty());
        'walk: for chunk in hashes[depth.min(hashes.len())..].chunks(LOOKUP_BATCH) {
            if active.is_empty() {
                break;
            }
            let mut found = [None; LOOKUP_BATCH];
            for (slot, h) in found.iter_mut().zip(chunk) {
                *slot = device.get(*h);
            }
            for (code, seq) in found.iter().zip(chunk) {
                let Some(code) = code else { break 'walk };
                let holders = device.holders(*seq, code);
                if holders != active.as_slice() {
                    active.retain(|r| {
                        let keep = holders.binary_search(r).is_ok();
                        if !keep {
                            out.push((*r, Overlap { device: depth as u32, host: 0, disk: 0 }));
                        }
                        keep
                    });
                    if active.is_empty() {
                        break 'walk;
                    }
                }
                depth += 1;
            }
        }
        out.extend(active.iter().map(|r| (*r, Overlap { device: depth as u32, host: 0, disk: 0 })));
        if self.tiers[1].len == 0 && self.tiers[2].len == 0 {
            return out;
        }
        let mut dense = vec![Overlap::default(); self.replicas.len()];
        for (r, o) in out {
            dense[r as usize] = o;
        }
        for (r, overlap) in dense.iter_mut().enumerate() {
            let mut pos = overlap.device as usize;
            let host = hashes[pos..].iter().take_while(|h| self.holds(1, **h, r)).count();
            pos += host;
            let disk = hashes[pos..].iter().take_while(|h| self.holds(2, **h, r)).count();
            overlap.host = host as u32;
            overlap.disk = disk as u32;
        }
        dense.into_iter().enumerate().filter(|(_, o)| *o != Overlap::default()).map(|(r, o)| (r as u32, o)).collect()
    }

    /// Blocks indexed for a replica, on all tiers.
    pub fn replica_blocks(&self, replica: ReplicaIdx) -> usize {
        self.replicas[replica].tiers.iter().map(|t| t.seq.len()).sum()
    }

    /// Blocks indexed for a replica on one tier.
    pub fn replica_tier_blocks(&self, replica: ReplicaIdx, tier: Tier) -> usize {
        self.replicas[replica].tiers[tier.idx()].seq.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_shared::hash::prompt_block_hashes;

    fn tokens(n: u32) -> Vec<u32> {
        (100..100 + n).collect()
    }

    fn store<'a>(parent: Option<u64>, hashes: &'a [u64], tokens: &'a [u32], bs: usize) -> Store<'a> {
        Store {
            parent,
            engine_hashes: hashes,
            token_ids: tokens,
            block_size: bs,
            salt: Salt::NONE,
            extra: &[],
            tier: Tier::Device,
        }
    }

    fn devices(o: &[Overlap]) -> Vec<u32> {
        o.iter().map(|o| o.device).collect()
    }

    #[test]
    fn stored_chain_matches_prompt_hashes() {
        let mut idx = KvIndex::new(4, 2);
        let t = tokens(12);
        idx.store(1, store(None, &[11, 12], &t[..8], 4)).unwrap();
        idx.store(1, store(Some(12), &[13], &t[8..12], 4)).unwrap();
        let prompt = prompt_block_hashes(&t, 4, Salt::NONE);
        assert_eq!(devices(&idx.find_matches(&prompt)), vec![0, 3]);
        let mut other = t.clone();
        other[5] = 1;
        assert_eq!(devices(&idx.find_matches(&prompt_block_hashes(&other, 4, Salt::NONE))), vec![0, 1]);
    }

    #[test]
    fn rejects_what_would_be_misplaced() {
        let mut idx = KvIndex::new(4, 1);
        assert_eq!(idx.store(0, store(Some(99), &[1], &tokens(4), 4)), Err(ApplyError::ParentUnknown));
        assert_eq!(idx.store(0, store(None, &[1], &tokens(8), 8)), Err(ApplyError::BlockSizeMismatch));
        assert_eq!(idx.store(0, store(None, &[1, 2], &tokens(4), 4)), Err(ApplyError::TokenCountMismatch));
        assert_eq!(idx.replica_blocks(0), 0);
    }

    #[test]
    fn duplicate_stores_need_matching_removes() {
        let mut idx = KvIndex::new(4, 1);
        let prompt = prompt_block_hashes(&tokens(4), 4, Salt::NONE);
        idx.store(0, store(None, &[7], &tokens(4), 4)).unwrap();
        idx.store(0, store(None, &[7], &tokens(4), 4)).unwrap();
        idx.remove(0, Tier::Device, &[7]);
        assert_eq!(devices(&idx.find_matches(&prompt)), vec![1]);
        idx.remove(0, Tier::Device, &[7]);
        idx.remove(0, Tier::Device, &[7, 12345]);
        assert_eq!(devices(&idx.find_matches(&prompt)), vec![0]);
    }

    #[test]
    fn clear_and_salt_isolation() {
        let mut idx = KvIndex::new(4, 3);
        let t = tokens(4);
        idx.store(0, store(None, &[1], &t, 4)).unwrap();
        idx.store(1, Store { salt: Salt::for_lora(Some("adapter")), ..store(None, &[1], &t, 4) }).unwrap();
        let tenant = [Salt::for_extra_keys(&["tenant-a".into()])];
        idx.store(2, Store { extra: &tenant, ..store(None, &[1], &t, 4) }).unwrap();
        let base = prompt_block_hashes(&t, 4, Salt::NONE);
        assert_eq!(devices(&idx.find_matches(&base)), vec![1, 0, 0], "salted blocks never match plain ones");
        idx.clear_replica(0);
        assert_eq!(devices(&idx.find_matches(&base)), vec![0, 0, 0]);
        assert_eq!(idx.replica_blocks(1), 1);
    }

    #[test]
    fn replicas_past_the_inline_holder_codes_still_match() {
        // Replica 1023 and up do not fit an entry's holder code: their blocks are listed in
        // the spill, alone or with others.
        let mut idx = KvIndex::new(4, 1100);
        let t = tokens(8);
        let prompt = prompt_block_hashes(&t, 4, Salt::NONE);
        let at = |idx: &KvIndex, rs: [usize; 4]| rs.map(|r| idx.find_matches(&prompt)[r].device);
        idx.store(1023, store(None, &[1, 2], &t, 4)).unwrap();
        idx.store(3, store(None, &[1], &t[..4], 4)).unwrap();
        idx.store(1022, store(None, &[5, 6], &t, 4)).unwrap();
        assert_eq!(at(&idx, [1023, 3, 1022, 1099]), [2, 1, 2, 0]);
        idx.remove(3, Tier::Device, &[1]);
        idx.remove(1022, Tier::Device, &[6]);
        assert_eq!(at(&idx, [1023, 3, 1022, 1099]), [2, 0, 1, 0]);
        idx.remove(1023, Tier::Device, &[2, 1]);
        assert_eq!(at(&idx, [1023, 3, 1022, 1099]), [0, 0, 1, 0]);
        idx.clear_replica(1022);
        assert_eq!(at(&idx, [1023, 3, 1022, 1099]), [0, 0, 0, 0]);
        assert_eq!((idx.tiers[0].len, idx.tiers[0].spill.len()), (0, 0), "nothing left behind");
    }

    #[test]
    fn lower_tiers_continue_past_the_device_match() {
        let mut idx = KvIndex::new(4, 2);
        let t = tokens(16);
        let prompt = prompt_block_hashes(&t, 4, Salt::NONE);
        // Replica 0: blocks 0-1 on GPU, 2 on CPU, 3 on disk. Replica 1: block 0-3 on CPU only.
        idx.store(0, store(None, &[1, 2], &t[..8], 4)).unwrap();
        idx.store(0, Store { tier: Tier::Host, ..store(Some(2), &[3], &t[8..12], 4) }).unwrap();
        idx.store(0, Store { tier: Tier::Disk, ..store(Some(3), &[4], &t[12..16], 4) }).unwrap();
        idx.store(1, Store { tier: Tier::Host, ..store(None, &[1, 2, 3, 4], &t, 4) }).unwrap();
        let o = idx.find_matches(&prompt);
        assert_eq!(o[0], Overlap { device: 2, host: 1, disk: 1 });
        assert_eq!(o[1], Overlap { device: 0, host: 4, disk: 0 });
        idx.remove(0, Tier::Host, &[3]);
        assert_eq!(idx.find_matches(&prompt)[0], Overlap { device: 2, host: 0, disk: 0 }, "a hole stops the walk");
        assert_eq!(idx.replica_tier_blocks(0, Tier::Disk), 1);
    }
}
