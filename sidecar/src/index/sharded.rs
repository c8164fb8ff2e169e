//! The index's hash tables: [`Sharded`] tables that grow one shard at a time; [`EngineMap`]
//! (engine hash → arena slot, 12 bytes an entry); [`HeadMap`] (sequence hash → the chain
//! heads that hold it, several per key).
//!
//! A hash table doubles when it fills and moves every entry as it does. For a table of
//! millions of entries that is one `BlockStored` taking a large fraction of a second, and
//! the index's writes become visible to routing only when their batch ends. Split into `S`
//! shards by some bits of the key, each shard grows on its own: the same number of moves, in
//! pieces `1/S` the size, at different events. A small shard's rehash also stays in the CPU
//! cache. A lookup pays a shift and a mask.
//!
//! Keys are already uniform hashes, so every table here uses the key itself as its hash.

use std::collections::HashMap;

use hashbrown::hash_table::{Entry, HashTable};
use kvgate_shared::hash::{EngineHash, SequenceHash};
use nohash_hasher::BuildNoHashHasher;

/// A map from already-uniform hashes: hashing them again would only cost time.
pub(super) type Map<K, V> = HashMap<K, V, BuildNoHashHasher<K>>;

/// A key of a [`Sharded`] table: an already-uniform hash, whose bits place it.
pub(super) trait Key: Copy {
    fn bits(self) -> u64;
}

impl Key for SequenceHash {
    fn bits(self) -> u64 {
        self.0
    }
}

impl Key for EngineHash {
    fn bits(self) -> u64 {
        self.0
    }
}

/// `S` tables `M` (`S` a power of two), each holding the keys whose bits `SHIFT..` select it.
/// hashbrown places an entry by the low bits of its hash and tags it with the top seven, so
/// the shard bits must be neither. The shards are allocated on the first insert: a replica's
/// unused tiers cost no more than one empty table.
#[derive(Debug, Clone)]
pub(super) struct Sharded<M, const S: usize, const SHIFT: u32> {
    /// Empty until the first insert, then `S` tables.
    pub(super) shards: Box<[M]>,
    /// What every shard is before the first insert.
    empty: M,
}

impl<M: Default, const S: usize, const SHIFT: u32> Default for Sharded<M, S, SHIFT> {
    fn default() -> Self {
        const { assert!(S.is_power_of_two() && SHIFT >= 24 && SHIFT + S.trailing_zeros() <= 57) };
        Sharded { shards: Box::default(), empty: M::default() }
    }
}

impl<M: Default, const S: usize, const SHIFT: u32> Sharded<M, S, SHIFT> {
    /// The shard that holds `key`, to change.
    pub(super) fn shard_mut(&mut self, key: impl Key) -> &mut M {
        if self.shards.is_empty() {
            self.shards = (0..S).map(|_| M::default()).collect();
        }
        &mut self.shards[Self::index(key)]
    }
}

impl<M, const S: usize, const SHIFT: u32> Sharded<M, S, SHIFT> {
    fn index(key: impl Key) -> usize {
        (key.bits() >> SHIFT) as usize & (S - 1)
    }

    /// The shard that holds `key`, if anything does.
    pub(super) fn shard(&self, key: impl Key) -> &M {
        self.shards.get(Self::index(key)).unwrap_or(&self.empty)
    }

    /// Every shard (none before the first insert).
    pub(super) fn shards(&self) -> impl Iterator<Item = &M> {
        self.shards.iter()
    }

    /// Every shard, to change (none before the first insert).
    pub(super) fn shards_mut(&mut self) -> impl Iterator<Item = &mut M> {
        self.shards.iter_mut()
    }
}

/// A replica's engine hashes on one tier, sharded by bits 48..52.
pub(super) type EngineShards = Sharded<EngineMap, 16, 48>;

/// A tier's chain heads, sharded by sequence-hash bits 40..48.
pub(super) type HeadShards = Sharded<HeadMap, 256, 40>;

impl EngineShards {
    /// Entries in all shards.
    pub(super) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.table.len()).sum()
    }
}

/// An [`EngineMap`] entry: 12 bytes, where a `(u64, u32)` tuple would take 16 (the engine
/// hash is kept as two 4-byte halves, so the entry needs only 4-byte alignment).
#[derive(Debug, Clone, Copy)]
struct EngineEntry {
    engine: [u32; 2],
    slot: u32,
}

impl EngineEntry {
    fn new(EngineHash(engine): EngineHash, slot: u32) -> Self {
        EngineEntry { engine: [engine as u32, (engine >> 32) as u32], slot }
    }

    fn engine(&self) -> u64 {
        u64::from(self.engine[0]) | u64::from(self.engine[1]) << 32
    }
}

/// One shard of a replica's engine map: the engine's block hash → the block's slot in the
/// replica's arena.
#[derive(Debug, Default, Clone)]
pub(super) struct EngineMap {
    table: HashTable<EngineEntry>,
}

impl EngineMap {
    /// The slot of `engine`.
    pub(super) fn get(&self, EngineHash(engine): EngineHash) -> Option<u32> {
        self.table.find(engine, |e| e.engine() == engine).map(|e| e.slot)
    }

    /// Inserts `engine` at the slot `slot()` returns, unless it is present; returns its slot
    /// if it was (nothing changed).
    pub(super) fn try_insert(&mut self, key: EngineHash, slot: impl FnOnce() -> u32) -> Option<u32> {
        let engine = key.0;
        match self.table.entry(engine, |e| e.engine() == engine, EngineEntry::engine) {
            Entry::Occupied(o) => Some(o.get().slot),
            Entry::Vacant(v) => {
                v.insert(EngineEntry::new(key, slot()));
                None
            }
        }
    }

    /// Removes `engine`; returns its slot.
    pub(super) fn remove(&mut self, EngineHash(engine): EngineHash) -> Option<u32> {
        self.table.find_entry(engine, |e| e.engine() == engine).ok().map(|o| o.remove().0.slot)
    }

    /// Every entry: (engine hash, slot).
    pub(super) fn entries(&self) -> impl Iterator<Item = (EngineHash, u32)> + '_ {
        self.table.iter().map(|e| (EngineHash(e.engine()), e.slot))
    }

    /// Every entry's slot, to change.
    pub(super) fn slots_mut(&mut self) -> impl Iterator<Item = &mut u32> {
        self.table.iter_mut().map(|e| &mut e.slot)
    }
}

/// A chain head: block `seq` of replica `replica` is at `slot` of its arena and cannot be
/// reached from the slot before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Head {
    /// The block's sequence hash.
    pub(super) seq: SequenceHash,
    /// The replica holding it.
    pub(super) replica: u32,
    /// Its slot in the replica's arena of this tier.
    pub(super) slot: u32,
}

/// One shard of a tier's head table: a multimap from sequence hash to every [`Head`] with
/// that hash (one per replica whose chain starts there).
#[derive(Debug, Default, Clone)]
pub(super) struct HeadMap {
    table: HashTable<Head>,
}

impl HeadMap {
    /// Every head in this shard.
    #[cfg(test)]
    pub(super) fn iter(&self) -> impl Iterator<Item = &Head> {
        self.table.iter()
    }

    /// Every head of block `seq`.
    pub(super) fn of(&self, seq: SequenceHash) -> impl Iterator<Item = &Head> {
        self.table.iter_hash(seq.0).filter(move |h| h.seq == seq)
    }

    /// Adds a head (the caller knows it is not present).
    pub(super) fn insert(&mut self, head: Head) {
        self.table.insert_unique(head.seq.0, head, |h| h.seq.0);
    }

    /// Removes a head; returns whether it was present.
    pub(super) fn remove(&mut self, head: Head) -> bool {
        self.table.find_entry(head.seq.0, |h| *h == head).map(|o| o.remove()).is_ok()
    }

    /// Moves a head to another slot; returns whether it was present.
    pub(super) fn move_to(&mut self, head: Head, slot: u32) -> bool {
        self.table.find_mut(head.seq.0, |h| *h == head).map(|h| h.slot = slot).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys that differ only in the shard bits (`shift..shift+bits`): the first 256, in shard
    /// order. Then keys that differ in the bits below, just above and at the top.
    fn keys(shift: u32, bits: u32) -> Vec<u64> {
        let spread = (0..256u64).map(|i| i << shift | 7);
        let around =
            [0, shift - 8, shift + bits, 57].into_iter().flat_map(|b| (1..=40u64).map(move |i| i << b | 1 << 63));
        let mut keys: Vec<u64> = spread.chain(around).collect();
        keys.sort_unstable();
        keys.dedup();
        keys
    }

    #[test]
    fn engine_map_entries_are_12_bytes_and_keep_every_key() {
        assert_eq!(std::mem::size_of::<EngineEntry>(), 12);
        let mut m = EngineShards::default();
        let five = EngineHash(5);
        assert_eq!((m.shards.len(), m.shard(five).get(five), m.len()), (0, None, 0), "nothing allocated yet");
        let keys: Vec<EngineHash> = keys(48, 4).into_iter().map(EngineHash).collect();
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(m.shard_mut(*k).try_insert(*k, || i as u32), None, "{k:#x} is new");
        }
        assert_eq!((m.shards.len(), m.len()), (16, keys.len()));
        assert!(m.shards.iter().all(|s| !s.table.is_empty()), "one key per shard at least");
        assert!(keys.iter().enumerate().all(|(i, k)| m.shard(*k).get(*k) == Some(i as u32)));
        assert_eq!(m.shard_mut(keys[3]).try_insert(keys[3], || 99), Some(3), "present: unchanged");
        let never = EngineHash(keys[3].0 | 1 << 62);
        assert_eq!(m.shard(never).get(never), None, "a key never stored");
        for shard in m.shards_mut() {
            shard.slots_mut().for_each(|s| *s += 1000);
        }
        assert_eq!(m.shard_mut(keys[5]).remove(keys[5]), Some(1005));
        assert_eq!(m.shard(keys[5]).get(keys[5]), None);
        assert_eq!(m.shard(keys[6]).get(keys[6]), Some(1006));
        assert_eq!(m.len(), keys.len() - 1);
    }

    #[test]
    fn head_map_holds_several_heads_per_block() {
        let mut heads = HeadShards::default();
        let keys: Vec<SequenceHash> = keys(40, 8).into_iter().map(SequenceHash).collect();
        let head = |seq: SequenceHash, replica: u32| Head { seq, replica, slot: replica * 10 };
        for k in &keys {
            for r in 0..3 {
                heads.shard_mut(*k).insert(head(*k, r));
            }
        }
        let of = |heads: &HeadShards, k: SequenceHash| {
            let mut v: Vec<(u32, u32)> = heads.shard(k).of(k).map(|h| (h.replica, h.slot)).collect();
            v.sort_unstable();
            v
        };
        assert!(keys.iter().all(|k| of(&heads, *k) == [(0, 0), (1, 10), (2, 20)]));
        assert!(heads.shard_mut(keys[4]).remove(head(keys[4], 1)));
        assert!(!heads.shard_mut(keys[4]).remove(head(keys[4], 1)), "already gone");
        assert!(heads.shard_mut(keys[4]).move_to(head(keys[4], 2), 7));
        assert_eq!(of(&heads, keys[4]), [(0, 0), (2, 7)]);
        assert_eq!(of(&heads, keys[5]), [(0, 0), (1, 10), (2, 20)], "the key one shard over");
        assert!(of(&heads, SequenceHash(12345)).is_empty());
    }
}
