//! The KV index: which replica of a pool holds which prefix blocks, on which storage tier.
//!
//! Blocks are keyed by the **sequence hash** of [`kvgate_shared::hash`], recomputed from the
//! `token_ids` of every `BlockStored` event. A sequence hash names a whole prefix, so "replica
//! r holds block i of this prompt" implies it holds blocks `0..i` too, and a lookup is a walk
//! down the prompt's hashes that keeps the replicas still matching. See `README.md` beside
//! this file for the design and its measurements.
//!
//! Each replica keeps, per tier, an **arena**: its blocks' sequence hashes in the order they
//! were stored, so an event's chain of blocks is one run of memory. A block whose parent is
//! not the slot before it **heads** a chain, and the tier's head table lists it under its
//! sequence hash. A lookup starts at the heads of the prompt's first block, reads each
//! replica's chain slot by slot while it holds the prompt's next block, and where a chain
//! breaks, goes on from that replica's head of the next block, if any.
//!
//! The engine's own block hash is opaque to us: each replica maps engine hash → arena slot,
//! to find a stored block's parent and to apply removals. Engines may store the same block
//! twice (two requests computing it concurrently) and then remove it twice, so each
//! (replica, tier, block) is reference-counted.
//!
//! Cost: `store`/`remove` are O(blocks in the event), plus compacting an arena now and then
//! (O(1) a removal, amortized); [`KvIndex::find_matches`] is O(replicas holding the first
//! block × matched depth), with a small constant: a chain is read as contiguous memory;
//! clearing a replica is O(its blocks).

pub mod approx;
mod arena;
mod change;
pub mod mirror;
mod sharded;
mod snapshot;

use arena::{Arena, DEAD};
pub use change::{Change, StoredBlocks, Write};
use kvgate_shared::hash::{local_block_hash, next_sequence_hash, EngineHash, Salt, SequenceHash};
pub use mirror::Mirrored;
use serde::Serialize;
use sharded::{EngineShards, Head, HeadShards, Map};
pub use snapshot::{ReplicaSnapshot, SnapshotBlock, TierSnapshot};

/// A replica's slot in its pool: its position in the pool's member list and in every
/// per-replica table. The list only grows; a slot emptied when its replica left is taken by
/// the next replica to join.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct ReplicaIdx(u32);

impl ReplicaIdx {
    /// The slot at `position` of the member list.
    ///
    /// # Panics
    /// Past 2³² replicas.
    pub fn new(position: usize) -> ReplicaIdx {
        ReplicaIdx(u32::try_from(position).expect("fewer than 2^32 replicas in a pool"))
    }

    /// Its position in the member list (and in every per-replica table).
    pub fn get(self) -> usize {
        self.0 as usize
    }
}

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
    pub parent: Option<EngineHash>,
    /// Engine hashes of the new blocks.
    pub engine_hashes: &'a [EngineHash],
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

/// One replica's blocks on one tier.
#[derive(Debug, Default, Clone)]
struct ReplicaTier {
    /// Engine hash → the block's slot in `arena`.
    engine: EngineShards,
    /// Engine hashes stored more than once (reported twice, removed twice): extra count.
    extra_refs: Map<EngineHash, u32>,
    /// The blocks' sequence hashes, in store order.
    arena: Arena,
}

impl ReplicaTier {
    /// Removes the block at `slot` (its engine entry is gone already), keeping the chain
    /// heads of tier table `heads` right.
    fn kill(&mut self, slot: u32, replica: u32, heads: &mut HeadShards) {
        let (seq, head) = self.arena.kill(slot);
        if head {
            let removed = heads.shard_mut(seq).remove(Head { seq, replica, slot });
            debug_assert!(removed, "a head bit without its head");
        }
        // The block after it, if it continued this one, now heads a chain.
        let after = slot + 1;
        if after < self.arena.next_slot() && !self.arena.is_head(after) {
            let seq = self.arena.get(after);
            if seq != DEAD {
                self.arena.set_head(after);
                heads.shard_mut(seq).insert(Head { seq, replica, slot: after });
            }
        }
    }

    /// Drops removed slots at the end, and compacts the arena when removed slots outnumber
    /// live ones, moving the engine entries and heads that point into it.
    fn tidy(&mut self, replica: u32, heads: &mut HeadShards) {
        if !self.arena.trim() {
            return;
        }
        let moved = self.arena.compact();
        for (seq, old, new) in moved.heads {
            let moved = heads.shard_mut(seq).move_to(Head { seq, replica, slot: old }, new);
            debug_assert!(moved, "a head bit without its head");
        }
        for shard in self.engine.shards_mut() {
            shard.slots_mut().for_each(|slot| *slot = moved.remap[*slot as usize]);
        }
    }
}

#[derive(Debug, Default, Clone)]
struct ReplicaBlocks {
    tiers: [ReplicaTier; 3],
    /// The applied mark: the replica's events through this sequence number are in, none
    /// after it (`None`: unknown). Set by the applier; what [`KvIndex::export`] stands on.
    applied: Option<u64>,
    /// Device blocks stored and removed so far.
    churn: Churn,
}

/// How many blocks a replica's events have stored on, and removed from, its device tier since
/// the index began: two readings tell whether its cache changed in between (for
/// [`crate::accuracy`], which explains a missed prediction by them).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Churn {
    /// Device blocks stored.
    pub stored: u64,
    /// Device blocks removed, evicted or cleared.
    pub removed: u64,
}

/// The index of one pool (one model, one block size).
#[derive(Debug, Clone)]
pub struct KvIndex {
    block_size: usize,
    /// Per tier: the chain heads of every replica.
    heads: [HeadShards; 3],
    /// Per tier: blocks held, all replicas together.
    live: [usize; 3],
    replicas: Vec<ReplicaBlocks>,
}

/// The heads of the block at one prompt position, fetched once for every replica whose chain
/// breaks there.
struct HeadsAt {
    pos: usize,
    heads: Vec<(u32, u32)>,
}

impl KvIndex {
    /// An empty index for `replicas` replicas with the pool's `block_size`.
    pub fn new(block_size: usize, replicas: usize) -> Self {
        KvIndex {
            block_size,
            heads: Default::default(),
            live: [0; 3],
            replicas: (0..replicas).map(|_| ReplicaBlocks::default()).collect(),
        }
    }

    /// Makes room for one more replica (discovery found a new one); returns its index.
    pub fn add_replica(&mut self) -> ReplicaIdx {
        self.replicas.push(ReplicaBlocks::default());
        ReplicaIdx::new(self.replicas.len() - 1)
    }

    /// Where a replica's engine block is: its tier and slot, looking on `tier` first.
    fn locate(&self, replica: ReplicaIdx, tier: usize, engine_hash: EngineHash) -> Option<(usize, u32)> {
        let tiers = &self.replicas[replica.get()].tiers;
        [tier, 0, 1, 2]
            .into_iter()
            .find_map(|t| tiers[t].engine.shard(engine_hash).get(engine_hash).map(|slot| (t, slot)))
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
        let t = s.tier.idx();
        let parent = match s.parent {
            None => None,
            Some(p) => Some(self.locate(replica, t, p).ok_or(ApplyError::ParentUnknown)?),
        };
        let mut parent_seq = parent.map(|(pt, slot)| self.replicas[replica.get()].tiers[pt].arena.get(slot));
        let rt = &mut self.replicas[replica.get()].tiers[t];
        let heads = &mut self.heads[t];
        // The slot of the block the next one chains to, if it is on this tier.
        let mut prev = parent.and_then(|(pt, slot)| (pt == t).then_some(slot));
        let mut stored = 0;
        for (i, (engine_hash, tokens)) in s.engine_hashes.iter().zip(s.token_ids.chunks_exact(s.block_size)).enumerate()
        {
            let salt = s.salt.combine(s.extra.get(i).copied().unwrap_or(Salt::NONE));
            let seq = next_sequence_hash(parent_seq, local_block_hash(tokens, salt));
            parent_seq = Some(seq);
            let slot = rt.arena.next_slot();
            match rt.engine.shard_mut(*engine_hash).try_insert(*engine_hash, || slot) {
                Some(stored) => {
                    *rt.extra_refs.entry(*engine_hash).or_default() += 1;
                    prev = Some(stored);
                }
                None => {
                    // A block continues its chain if its parent is the slot before; otherwise
                    // it heads one, and lookups find it through the head table.
                    let head = prev.is_none_or(|p| p + 1 != slot);
                    rt.arena.push(seq, head);
                    if head {
                        let seq = rt.arena.get(slot);
                        heads.shard_mut(seq).insert(Head { seq, replica: replica.0, slot });
                    }
                    self.live[t] += 1;
                    stored += 1;
                    prev = Some(slot);
                }
            }
        }
        if t == Tier::Device.idx() {
            self.replicas[replica.get()].churn.stored += stored;
        }
        Ok(())
    }

    /// Applies a `BlockRemoved` (or several in a row: their hashes, in order). Unknown hashes
    /// are ignored (they may predate us).
    pub fn remove(&mut self, replica: ReplicaIdx, tier: Tier, engine_hashes: &[EngineHash]) {
        let t = tier.idx();
        let rt = &mut self.replicas[replica.get()].tiers[t];
        let heads = &mut self.heads[t];
        let mut removed = 0;
        for engine_hash in engine_hashes {
            if let Some(extra) = rt.extra_refs.get_mut(engine_hash) {
                *extra -= 1;
                if *extra == 0 {
                    rt.extra_refs.remove(engine_hash);
                }
                continue;
            }
            if let Some(slot) = rt.engine.shard_mut(*engine_hash).remove(*engine_hash) {
                rt.kill(slot, replica.0, heads);
                self.live[t] -= 1;
                removed += 1;
            }
        }
        rt.tidy(replica.0, heads);
        if tier == Tier::Device {
            self.replicas[replica.get()].churn.removed += removed;
        }
    }

    /// Forgets everything a replica holds (`AllBlocksCleared`, restart, removal).
    pub fn clear_replica(&mut self, replica: ReplicaIdx) {
        let r = &mut self.replicas[replica.get()];
        r.applied = None;
        r.churn.removed += r.tiers[Tier::Device.idx()].engine.len() as u64;
        let tiers = std::mem::take(&mut r.tiers);
        for (t, rt) in tiers.into_iter().enumerate() {
            self.live[t] -= rt.engine.len();
            for (slot, seq) in rt.arena.heads() {
                let removed = self.heads[t].shard_mut(seq).remove(Head { seq, replica: replica.0, slot });
                debug_assert!(removed, "a head bit without its head");
            }
        }
    }

    /// Each replica's [`Overlap`] with the prompt (given as sequence hashes), in replica order.
    pub fn find_matches(&self, hashes: &[SequenceHash]) -> Vec<Overlap> {
        let mut out = vec![Overlap::default(); self.replicas.len()];
        for (r, o) in self.find_overlaps(hashes) {
            out[r as usize] = o;
        }
        out
    }

    /// The replicas with a non-zero [`Overlap`] with the prompt, with it (no allocation for a
    /// miss).
    ///
    /// A replica's device overlap is the length of its chain through the prompt: it starts at
    /// a head of the first block, goes on slot by slot while the replica's arena holds the
    /// prompt's next block in the next slot, and when it does not, goes on from the replica's
    /// head of that block, if any.
    pub fn find_overlaps(&self, hashes: &[SequenceHash]) -> Vec<(u32, Overlap)> {
        let mut starts = hashes.first().into_iter().flat_map(|first| self.heads[0].shard(*first).of(*first)).peekable();
        let lower_tiers = self.live[1] != 0 || self.live[2] != 0;
        if starts.peek().is_none() && !lower_tiers {
            return Vec::new();
        }
        // Room for every replica's entry at once (a hit is usually on many).
        let mut out: Vec<(u32, Overlap)> = Vec::with_capacity(self.replicas.len());
        // A hash equal to the removed-slot marker would match removed slots: the walk stops
        // before it (no block is stored under it).
        let hashes = &hashes[..hashes.iter().position(|h| *h == DEAD).unwrap_or(hashes.len())];
        if starts.peek().is_some() {
            // Replicas with a chain so far, as bits (on the stack for pools of up to 1024).
            let (mut small, mut large) = ([0u64; 16], Vec::new());
            let words = self.replicas.len().div_ceil(64);
            let seen: &mut [u64] = if words <= small.len() {
                &mut small[..words]
            } else {
                large.resize(words, 0);
                &mut large
            };
            let mut memo = HeadsAt { pos: usize::MAX, heads: Vec::new() };
            // Where each replica is in `out`, built only once a replica has a second head of
            // the first block (two engine hashes for one content), so that many such heads
            // cost a lookup each, not a scan of `out`.
            let mut position: Vec<u32> = Vec::new();
            // How far the last replica's chain went: the next replica's walk tries to start
            // there (`shortcut`), so replicas that hold one shared prompt cost a few reads each
            // instead of one per block.
            let mut reached = 0;
            for &Head { replica: r, slot, .. } in starts {
                let (from_slot, from_pos) = self.shortcut(r, slot, reached, hashes).unwrap_or((slot, 0));
                reached = self.chain_end(0, r, from_slot, from_pos, hashes, &mut memo);
                let device = reached as u32;
                let (word, bit) = (r as usize / 64, 1 << (r % 64));
                if seen[word] & bit == 0 {
                    seen[word] |= bit;
                    if !position.is_empty() {
                        position[r as usize] = out.len() as u32;
                    }
                    out.push((r, Overlap { device, host: 0, disk: 0 }));
                    continue;
                }
                if position.is_empty() {
                    position = vec![u32::MAX; self.replicas.len()];
                    for (i, (rr, _)) in out.iter().enumerate() {
                        position[*rr as usize] = i as u32;
                    }
                }
                let o = &mut out[position[r as usize] as usize].1;
                o.device = o.device.max(device);
            }
        }
        if !lower_tiers {
            return out;
        }
        let mut dense = vec![Overlap::default(); self.replicas.len()];
        for (r, o) in out {
            dense[r as usize] = o;
        }
        self.lower_tier(Tier::Host, hashes, &mut dense);
        self.lower_tier(Tier::Disk, hashes, &mut dense);
        dense.into_iter().enumerate().filter(|(_, o)| *o != Overlap::default()).map(|(r, o)| (r as u32, o)).collect()
    }

    /// How many of the prompt's leading blocks one replica holds on its device tier: its
    /// device overlap in [`KvIndex::find_overlaps`], walked for that replica alone.
    pub fn device_held(&self, replica: ReplicaIdx, hashes: &[SequenceHash]) -> usize {
        let r = replica.0;
        let hashes = &hashes[..hashes.iter().position(|h| *h == DEAD).unwrap_or(hashes.len())];
        let Some(first) = hashes.first().filter(|_| replica.get() < self.replicas.len()) else { return 0 };
        let mut memo = HeadsAt { pos: usize::MAX, heads: Vec::new() };
        let starts: Vec<u32> =
            self.heads[0].shard(*first).of(*first).filter(|h| h.replica == r).map(|h| h.slot).collect();
        starts.into_iter().map(|slot| self.chain_end(0, r, slot, 0, hashes, &mut memo)).max().unwrap_or(0)
    }

    /// Where replica `r`'s device chain from the prompt's first block at `slot` can resume
    /// its walk: at the prompt's block `reached - 1`, if the slot that many after `slot` holds
    /// it and no slot in between heads a chain. Each of those slots then continues the one
    /// before it, so they hold that block's ancestors: the prompt's blocks before it (a
    /// sequence hash names its whole prefix).
    fn shortcut(&self, r: u32, slot: u32, reached: usize, hashes: &[SequenceHash]) -> Option<(u32, usize)> {
        let pos = reached.checked_sub(1).filter(|pos| *pos > 0 && *pos < hashes.len())?;
        let arena = &self.replicas[r as usize].tiers[Tier::Device.idx()].arena;
        let at = slot.checked_add(u32::try_from(pos).ok()?)?;
        let holds = arena.seqs().get(at as usize) == Some(&hashes[pos]);
        (holds && arena.no_head_in(slot + 1, at)).then_some((at, pos))
    }

    /// Where replica `r`'s chain on tier `t` through the prompt ends (an index into `hashes`,
    /// exclusive), starting from `hashes[pos]` at `slot` of its arena.
    fn chain_end(
        &self,
        t: usize,
        r: u32,
        mut slot: u32,
        mut pos: usize,
        hashes: &[SequenceHash],
        memo: &mut HeadsAt,
    ) -> usize {
        let seqs = self.replicas[r as usize].tiers[t].arena.seqs();
        loop {
            // The run of prompt blocks in the slots after this one.
            pos += 1 + common_prefix(&seqs[slot as usize + 1..], &hashes[pos + 1..]);
            if pos == hashes.len() {
                return pos;
            }
            // The chain breaks at `pos`: go on from the replica's head of that block, if any.
            if memo.pos != pos {
                memo.pos = pos;
                memo.heads.clear();
                memo.heads.extend(self.heads[t].shard(hashes[pos]).of(hashes[pos]).map(|h| (h.replica, h.slot)));
            }
            match memo.heads.iter().find(|(rr, _)| *rr == r) {
                Some((_, s)) => slot = *s,
                None => return pos,
            }
        }
    }

    /// Fills in each replica's overlap on lower tier `tier` (`hashes` already cut at any
    /// [`DEAD`]): the prompt blocks it holds
    /// there, consecutively from where the better tiers' match ends. A replica's chain on the
    /// tier may start anywhere up to that point, so the prompt's heads on it are looked up at
    /// every position up to the furthest one.
    fn lower_tier(&self, tier: Tier, hashes: &[SequenceHash], dense: &mut [Overlap]) {
        let t = tier.idx();
        if self.live[t] == 0 {
            return;
        }
        let from = |o: &Overlap| (if tier == Tier::Host { o.device } else { o.device + o.host }) as usize;
        let furthest = dense.iter().map(&from).max().unwrap_or(0);
        let mut memo = HeadsAt { pos: usize::MAX, heads: Vec::new() };
        for pos in 0..hashes.len().min(furthest + 1) {
            for head in self.heads[t].shard(hashes[pos]).of(hashes[pos]) {
                let o = &mut dense[head.replica as usize];
                let start = from(o);
                if pos > start || start >= hashes.len() {
                    continue;
                }
                let end = self.chain_end(t, head.replica, head.slot, pos, hashes, &mut memo);
                let held = if tier == Tier::Host { &mut o.host } else { &mut o.disk };
                *held = (*held).max(end.saturating_sub(start) as u32);
            }
        }
    }

    /// How many replica slots it has.
    pub fn replicas(&self) -> usize {
        self.replicas.len()
    }

    /// Blocks indexed for a replica, on all tiers.
    pub fn replica_blocks(&self, replica: ReplicaIdx) -> usize {
        self.replicas[replica.get()].tiers.iter().map(|t| t.engine.len()).sum()
    }

    /// What a replica's events have done to its device tier so far.
    pub fn churn(&self, replica: ReplicaIdx) -> Churn {
        self.replicas[replica.get()].churn
    }

    /// Blocks indexed for a replica on one tier.
    pub fn replica_tier_blocks(&self, replica: ReplicaIdx, tier: Tier) -> usize {
        self.replicas[replica.get()].tiers[tier.idx()].engine.len()
    }
}

/// How many leading elements `a` and `b` have in common. Compares four at a time (without
/// branching between them, so the compiler can use one vector compare).
fn common_prefix(a: &[SequenceHash], b: &[SequenceHash]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut i = 0;
    while i + 4 <= n && (a[i] == b[i]) & (a[i + 1] == b[i + 1]) & (a[i + 2] == b[i + 2]) & (a[i + 3] == b[i + 3]) {
        i += 4;
    }
    i + a[i..].iter().zip(&b[i..]).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests;
