//! The index's hash maps: [`Sharded`] maps that grow one shard at a time, and [`HolderMap`],
//! whose entries (sequence hash → holder code) take 8 bytes.
//!
//! A hash map doubles when it fills and moves every entry as it does. For the index's holder
//! table at millions of blocks that is one `BlockStored` taking half a second, and it happens
//! under the pool's write lock, so every routing decision of the pool waits for it. Split
//! into `S` shards by some bits of the key, each shard grows on its own: the same number of
//! moves, in pieces `1/S` the size, at different events. A small shard's rehash also stays in
//! the CPU cache. A lookup pays a shift and a mask.
//!
//! Every key in a shard has the same shard bits, so an entry need not store them: the holder
//! table keeps a block's holder there.

use std::collections::HashMap;

use hashbrown::hash_table::{Entry, HashTable};
use nohash_hasher::BuildNoHashHasher;

/// A map from already-uniform `u64` hashes: hashing them again would only cost time.
pub(super) type Map<V> = HashMap<u64, V, BuildNoHashHasher<u64>>;

/// `S` maps `M` (`S` a power of two), each holding the keys whose bits `SHIFT..` select it.
/// hashbrown places an entry by the low bits of its hash and tags it with the top seven, so
/// the shard bits must be neither. The shards are allocated on the first insert: a replica's
/// unused tiers cost no more than one empty map.
#[derive(Debug)]
pub(super) struct Sharded<M, const S: usize, const SHIFT: u32> {
    /// Empty until the first insert, then `S` maps.
    shards: Box<[M]>,
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
    pub(super) fn shard_mut(&mut self, key: u64) -> &mut M {
        if self.shards.is_empty() {
            self.shards = (0..S).map(|_| M::default()).collect();
        }
        &mut self.shards[Self::index(key)]
    }
}

impl<M, const S: usize, const SHIFT: u32> Sharded<M, S, SHIFT> {
    /// The key bits that choose a shard (and that its entries need not store).
    pub(super) const MASK: u64 = (S as u64 - 1) << SHIFT;

    fn index(key: u64) -> usize {
        (key >> SHIFT) as usize & (S - 1)
    }

    /// The shard that holds `key`, if anything does.
    pub(super) fn shard(&self, key: u64) -> &M {
        self.shards.get(Self::index(key)).unwrap_or(&self.empty)
    }
}

/// Shards of a replica's engine map (engine hash bits 48..52): engine hash → sequence hash.
pub(super) type EngineShards = Sharded<Map<u64>, 16, 48>;

/// Shards of a holder table (sequence hash bits 32..42): 1024, so an entry has 10 bits for
/// its holder code and a table of 10 M blocks re-places ~10 k entries when a shard grows.
pub(super) type HolderShards = Sharded<HolderMap, 1024, 32>;

/// One holder shard: sequence hash → a 10-bit holder code, in one `u64` an entry — the key with
/// its shard bits (32..42) replaced by the code.
#[derive(Debug, Default)]
pub(super) struct HolderMap {
    table: HashTable<u64>,
}

impl HolderMap {
    const MASK: u64 = HolderShards::MASK;
    const SHIFT: u32 = Self::MASK.trailing_zeros();
    /// The largest holder code.
    pub(super) const MAX_CODE: u32 = (Self::MASK >> Self::SHIFT) as u32;

    /// The key bits an entry stores, which are also its hash: the shard's bits are the same
    /// for every key here, and the rest are uniform.
    fn stored(seq: u64) -> u64 {
        seq & !Self::MASK
    }

    fn code(entry: u64) -> u32 {
        ((entry & Self::MASK) >> Self::SHIFT) as u32
    }

    fn entry(seq: u64, code: u32) -> u64 {
        debug_assert!(code <= Self::MAX_CODE);
        Self::stored(seq) | u64::from(code) << Self::SHIFT
    }

    /// The code of `seq`.
    pub(super) fn get(&self, seq: u64) -> Option<u32> {
        let key = Self::stored(seq);
        self.table.find(key, |e| Self::stored(*e) == key).map(|e| Self::code(*e))
    }

    /// Sets the code of `seq` (present or not).
    pub(super) fn set(&mut self, seq: u64, code: u32) {
        let key = Self::stored(seq);
        match self.table.entry(key, |e| Self::stored(*e) == key, |e| Self::stored(*e)) {
            Entry::Occupied(mut o) => *o.get_mut() = Self::entry(seq, code),
            Entry::Vacant(v) => {
                v.insert(Self::entry(seq, code));
            }
        }
    }

    /// Sets the code of `seq` unless it has one already; returns that code (nothing changed)
    /// or `None` (inserted).
    pub(super) fn try_insert(&mut self, seq: u64, code: u32) -> Option<u32> {
        let key = Self::stored(seq);
        match self.table.entry(key, |e| Self::stored(*e) == key, |e| Self::stored(*e)) {
            Entry::Occupied(o) => Some(Self::code(*o.get())),
            Entry::Vacant(v) => {
                v.insert(Self::entry(seq, code));
                None
            }
        }
    }

    /// Removes `seq`; returns its code.
    pub(super) fn remove(&mut self, seq: u64) -> Option<u32> {
        let key = Self::stored(seq);
        self.table.find_entry(key, |e| Self::stored(*e) == key).ok().map(|o| Self::code(o.remove().0))
    }
}

impl<V, const S: usize, const SHIFT: u32> Sharded<Map<V>, S, SHIFT> {
    /// Entries in all shards.
    pub(super) fn len(&self) -> usize {
        self.shards.iter().map(Map::len).sum()
    }

    /// Every value, shard after shard.
    pub(super) fn into_values(self) -> impl Iterator<Item = V> {
        self.shards.into_vec().into_iter().flat_map(Map::into_values)
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
    fn holder_map_keeps_codes_in_the_shard_bits() {
        assert_eq!(HolderMap::MAX_CODE, 1023);
        let mut shards = HolderShards::default();
        let keys = keys(32, 10);
        let code = |k: u64| (k ^ k >> 36) as u32 & HolderMap::MAX_CODE;
        for k in &keys {
            assert_eq!(shards.shard_mut(*k).try_insert(*k, code(*k)), None, "{k:#x} is new");
        }
        assert!(keys.iter().all(|k| shards.shard(*k).get(*k) == Some(code(*k))));
        assert_eq!(shards.shard_mut(keys[3]).try_insert(keys[3], 9), Some(code(keys[3])), "try_insert keeps the code");
        shards.shard_mut(keys[3]).set(keys[3], HolderMap::MAX_CODE);
        assert_eq!(shards.shard(keys[3]).get(keys[3]), Some(HolderMap::MAX_CODE));
        // Keys that differ from keys[3] only in the shard bits are other blocks: found with
        // their own codes when stored, not found when not.
        assert_eq!(shards.shard(keys[3] ^ 1 << 32).get(keys[3] ^ 1 << 32), Some(code(keys[3] ^ 1 << 32)));
        assert_eq!(shards.shard(keys[3] ^ 512 << 32).get(keys[3] ^ 512 << 32), None);
        assert_eq!(shards.shard_mut(keys[5]).remove(keys[5]), Some(code(keys[5])));
        assert_eq!(shards.shard(keys[5]).get(keys[5]), None);
        assert_eq!(shards.shards.iter().map(|s| s.table.len()).sum::<usize>(), keys.len() - 1);
    }

    #[test]
    fn shards_are_allocated_on_the_first_insert_and_keep_every_key() {
        let mut m: Sharded<Map<u64>, 16, 48> = Sharded::default();
        assert_eq!((m.shards.len(), m.shard(5).get(&5), m.len()), (0, None, 0), "nothing allocated yet");
        let keys = keys(48, 4);
        for k in &keys {
            m.shard_mut(*k).insert(*k, k.wrapping_mul(3));
        }
        assert_eq!((m.shards.len(), m.len()), (16, keys.len()));
        assert!(keys.iter().all(|k| m.shard(*k).get(k) == Some(&k.wrapping_mul(3))));
        assert!(m.shards.iter().all(|s| !s.is_empty()), "one key per shard at least");
        let mut values: Vec<u64> = m.into_values().collect();
        values.sort_unstable();
        let mut expected: Vec<u64> = keys.iter().map(|k| k.wrapping_mul(3)).collect();
        expected.sort_unstable();
        assert_eq!(values, expected);
    }
}
