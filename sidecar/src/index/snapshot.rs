//! A replica's index entries as one value: what a sidecar hands a peer that starts while it
//! runs (`crate::sync::state`), so the newcomer serves with the same view from its first
//! request instead of rebuilding it from engines whose replay buffers may have rolled over.
//!
//! A snapshot is taken at a known point of the replica's event stream (the index's *applied
//! mark*: every event through that sequence number is in, none after it), so the peer can
//! resume the stream right after it. Restoring is a [`super::Change`] like any other: the
//! applier writes it on both copies of the index.

use kvgate_shared::hash::{EngineHash, SequenceHash};
use serde::{Deserialize, Serialize};

use super::arena::DEAD;
use super::sharded::Head;
use super::{KvIndex, ReplicaIdx, ReplicaTier};

/// One replica's blocks on every tier, and the event sequence number they stand at.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaSnapshot {
    /// The replica's last event applied: the stream resumes after it.
    pub through_seq: u64,
    /// Device, host and disk, in that order.
    pub tiers: [TierSnapshot; 3],
}

/// One replica's blocks on one tier.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierSnapshot {
    /// The live blocks in store order (a chain stays a run, as in the arena).
    pub blocks: Vec<SnapshotBlock>,
    /// Engine hashes stored more than once, and how many times more.
    pub extra_refs: Vec<(EngineHash, u32)>,
}

/// One stored block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotBlock {
    /// The engine's hash of it (how its removal will name it).
    pub engine: EngineHash,
    /// Its sequence hash (what lookups match).
    pub seq: SequenceHash,
    /// Whether it heads a chain (the block before it does not continue into it).
    pub head: bool,
}

impl ReplicaSnapshot {
    /// Blocks on all tiers.
    pub fn blocks(&self) -> usize {
        self.tiers.iter().map(|t| t.blocks.len()).sum()
    }
}

impl ReplicaTier {
    fn export(&self) -> TierSnapshot {
        let mut engine_of = vec![None; self.arena.next_slot() as usize];
        for shard in self.engine.shards() {
            for (engine, slot) in shard.entries() {
                engine_of[slot as usize] = Some(engine);
            }
        }
        let blocks = (0..self.arena.next_slot())
            .filter(|&slot| self.arena.get(slot) != DEAD)
            .filter_map(|slot| {
                let engine = engine_of[slot as usize]?;
                Some(SnapshotBlock { engine, seq: self.arena.get(slot), head: self.arena.is_head(slot) })
            })
            .collect();
        let mut extra_refs: Vec<(EngineHash, u32)> = self.extra_refs.iter().map(|(e, n)| (*e, *n)).collect();
        extra_refs.sort_unstable();
        TierSnapshot { blocks, extra_refs }
    }
}

impl KvIndex {
    /// The replica's entries, if its applied mark is set (it is not while a message is half
    /// applied, nor after its events were lost).
    pub fn export(&self, replica: ReplicaIdx) -> Option<ReplicaSnapshot> {
        let r = &self.replicas[replica.get()];
        let through_seq = r.applied?;
        Some(ReplicaSnapshot { through_seq, tiers: r.tiers.each_ref().map(ReplicaTier::export) })
    }

    /// Replaces the replica's entries with a snapshot's, and its applied mark with the
    /// snapshot's sequence number. A snapshot is a peer's word, so it is taken defensively: a
    /// repeated engine hash is dropped, the first block of each tier heads a chain, and extra
    /// references count only for blocks present.
    pub fn restore(&mut self, replica: ReplicaIdx, snapshot: &ReplicaSnapshot) {
        self.clear_replica(replica);
        self.replicas[replica.get()].applied = Some(snapshot.through_seq);
        for (t, tier) in snapshot.tiers.iter().enumerate() {
            let rt = &mut self.replicas[replica.get()].tiers[t];
            let heads = &mut self.heads[t];
            // Whether the block before (in the snapshot) was kept: a block may only continue
            // a chain from a block that is in the arena right before it.
            let mut kept_before = false;
            for block in &tier.blocks {
                let slot = rt.arena.next_slot();
                if rt.engine.shard_mut(block.engine).try_insert(block.engine, || slot).is_some() {
                    kept_before = false;
                    continue;
                }
                let head = block.head || !kept_before;
                rt.arena.push(block.seq, head);
                if head {
                    let seq = rt.arena.get(slot);
                    heads.shard_mut(seq).insert(Head { seq, replica: replica.0, slot });
                }
                self.live[t] += 1;
                kept_before = true;
            }
            for &(engine, n) in &tier.extra_refs {
                if n > 0 && rt.engine.shard(engine).get(engine).is_some() {
                    rt.extra_refs.insert(engine, n);
                }
            }
        }
    }

    /// Sets the replica's applied mark: every event through `seq` is in, none after it
    /// (`None`: unknown, so the replica's entries are not exported).
    pub fn mark_applied(&mut self, replica: ReplicaIdx, seq: Option<u64>) {
        self.replicas[replica.get()].applied = seq;
    }
}

#[cfg(test)]
mod tests {
    use kvgate_shared::hash::{prompt_block_hashes, Salt};

    use super::*;
    use crate::index::{Store, Tier};

    fn store(index: &mut KvIndex, replica: usize, parent: Option<u64>, engine: &[u64], tokens: &[u32], tier: Tier) {
        let engine_hashes: Vec<EngineHash> = engine.iter().map(|&e| EngineHash(e)).collect();
        let s = Store {
            parent: parent.map(EngineHash),
            engine_hashes: &engine_hashes,
            token_ids: tokens,
            block_size: 2,
            salt: Salt::NONE,
            extra: &[],
            tier,
        };
        index.store(ReplicaIdx::new(replica), s).unwrap();
    }

    /// An index with chains, a removal in the middle of one, a twice-stored block, and blocks
    /// on the host tier: everything an export has to carry.
    fn busy_index() -> KvIndex {
        let mut index = KvIndex::new(2, 2);
        store(&mut index, 0, None, &[1, 2, 3, 4], &[1, 2, 3, 4, 5, 6, 7, 8], Tier::Device);
        store(&mut index, 0, Some(2), &[5], &[9, 9], Tier::Device);
        store(&mut index, 0, None, &[1], &[1, 2], Tier::Device);
        store(&mut index, 0, Some(4), &[6], &[10, 11], Tier::Host);
        store(&mut index, 1, None, &[1, 2], &[1, 2, 3, 4], Tier::Device);
        index.remove(ReplicaIdx::new(0), Tier::Device, &[EngineHash(3)]);
        index
    }

    fn matches(index: &KvIndex, tokens: &[u32]) -> Vec<crate::index::Overlap> {
        index.find_matches(&prompt_block_hashes(tokens, 2, Salt::NONE))
    }

    #[test]
    fn a_restored_replica_matches_what_its_source_matched() {
        let mut source = busy_index();
        source.mark_applied(ReplicaIdx::new(0), Some(41));
        let snapshot = source.export(ReplicaIdx::new(0)).expect("marked");
        assert_eq!(snapshot.through_seq, 41);
        assert_eq!(snapshot.blocks(), 5, "blocks 1, 2, 4, 5 on the device, 6 on the host");

        let mut copy = KvIndex::new(2, 2);
        copy.restore(ReplicaIdx::new(0), &snapshot);
        for prompt in [&[1, 2, 3, 4, 5, 6, 7, 8][..], &[1, 2, 3, 4, 9, 9], &[1, 2, 3, 4, 5, 6, 7, 8, 10, 11], &[7, 7]] {
            assert_eq!(matches(&copy, prompt)[0], matches(&source, prompt)[0], "prompt {prompt:?}");
        }
        assert_eq!(copy.replica_blocks(ReplicaIdx::new(0)), source.replica_blocks(ReplicaIdx::new(0)));
        assert_eq!(copy.export(ReplicaIdx::new(0)), Some(snapshot.clone()), "restored at the snapshot's mark");

        // Removals after the restore name blocks by engine hash, as the engine will; the
        // twice-stored block needs two.
        for index in [&mut source, &mut copy] {
            index.remove(ReplicaIdx::new(0), Tier::Device, &[EngineHash(1), EngineHash(5)]);
        }
        assert_eq!(matches(&copy, &[1, 2, 3, 4, 9, 9])[0], matches(&source, &[1, 2, 3, 4, 9, 9])[0]);
        assert_eq!(matches(&copy, &[1, 2])[0].device, 1, "block 1 was stored twice");
        copy.remove(ReplicaIdx::new(0), Tier::Device, &[EngineHash(1)]);
        assert_eq!(matches(&copy, &[1, 2])[0].device, 0);
    }

    #[test]
    fn a_replica_without_an_applied_mark_is_not_exported() {
        let mut index = busy_index();
        assert!(index.export(ReplicaIdx::new(0)).is_none(), "never marked");
        index.mark_applied(ReplicaIdx::new(0), Some(3));
        index.clear_replica(ReplicaIdx::new(0));
        assert!(index.export(ReplicaIdx::new(0)).is_none(), "a clear forgets the mark");
    }

    #[test]
    fn a_malformed_snapshot_is_restored_without_false_credit() {
        let seqs = prompt_block_hashes(&[1, 2, 3, 4, 5, 6], 2, Salt::NONE);
        let block = |engine, i: usize, head| SnapshotBlock { engine: EngineHash(engine), seq: seqs[i], head };
        let mut snapshot = ReplicaSnapshot::default();
        // Block 1 repeated (the copy is dropped), then block 2 claiming to continue it: it is
        // kept as the head of a chain of its own, and once block 1 goes, block 2 earns
        // nothing past the hole.
        snapshot.tiers[0].blocks =
            vec![block(10, 0, false), block(11, 1, false), block(11, 1, false), block(12, 2, false)];
        snapshot.tiers[0].extra_refs = vec![(EngineHash(99), 3), (EngineHash(10), 1)];
        let mut index = KvIndex::new(2, 1);
        index.restore(ReplicaIdx::new(0), &snapshot);
        assert_eq!(index.replica_blocks(ReplicaIdx::new(0)), 3);
        assert_eq!(matches(&index, &[1, 2, 3, 4, 5, 6])[0].device, 3);
        index.remove(ReplicaIdx::new(0), Tier::Device, &[EngineHash(11)]);
        assert_eq!(matches(&index, &[1, 2, 3, 4, 5, 6])[0].device, 1, "block 2 is not credited past the hole");
        index.remove(ReplicaIdx::new(0), Tier::Device, &[EngineHash(10)]);
        assert_eq!(matches(&index, &[1, 2])[0].device, 1, "block 0's extra reference holds it");
        index.remove(ReplicaIdx::new(0), Tier::Device, &[EngineHash(99)]);
        assert_eq!(index.replica_blocks(ReplicaIdx::new(0)), 2);
    }
}
