//! The index's hash maps: [`Sharded`] maps that grow one shard at a time, and [`PackedMap`],
//! whose `u64 → u32` entries take 12 bytes.
//!
//! A hash map doubles when it fills and moves every entry as it does. For the index's holder
//! table at millions of blocks that is one `BlockStored` taking half a second, and it happens
//! under the pool's write lock, so every routing decision of the pool waits for it. Split
//! into `S` shards by a byte of the key, each shard grows on its own: the same number of
//! moves, in pieces `1/S` the size, at different events. A small shard's rehash also stays in
//! the CPU cache. A lookup pays a shift and a mask.

use std::collections::HashMap;

use hashbrown::hash_table::{Entry, HashTable};
use nohash_hasher::BuildNoHashHasher;

/// A map from already-uniform `u64` hashes: hashing them again would only cost time.
pub(super) type Map<V> = HashMap<u64, V, BuildNoHashHasher<u64>>;

/// The key bits that choose a shard start here. hashbrown places an entry by the key's low
/// bits and tags it with the top seven, so the keys of one shard still differ in both.
const SHARD_SHIFT: u32 = 48;

/// `S` maps `M` (a power of two, at most 256), each holding the keys whose bits 48.. select
/// it.
#[derive(Debug)]
pub(super) struct Sharded<M, const S: usize> {
    shards: Box<[M]>,
}

impl<M: Default, const S: usize> Default for Sharded<M, S> {
    fn default() -> Self {
        const { assert!(S.is_power_of_two() && S <= 256) };
        Sharded { shards: (0..S).map(|_| M::default()).collect() }
    }
}

impl<M, const S: usize> Sharded<M, S> {
    fn index(key: u64) -> usize {
        (key >> SHARD_SHIFT) as usize & (S - 1)
    }

    /// The shard that holds `key`, if anything does.
    pub(super) fn shard(&self, key: u64) -> &M {
        &self.shards[Self::index(key)]
    }

    /// The shard that holds `key`, to change.
    pub(super) fn shard_mut(&mut self, key: u64) -> &mut M {
        &mut self.shards[Self::index(key)]
    }
}

impl<V, const S: usize> Sharded<Map<V>, S> {
    /// Entries in all shards.
    pub(super) fn len(&self) -> usize {
        self.shards.iter().map(Map::len).sum()
    }

    /// Every value, shard after shard.
    pub(super) fn into_values(self) -> impl Iterator<Item = V> {
        self.shards.into_vec().into_iter().flat_map(Map::into_values)
    }
}

/// A `u64 → u32` map for already-uniform keys, 12 bytes an entry plus hashbrown's control
/// byte (`HashMap<u64, u32>` aligns its entries to 16 bytes).
#[derive(Debug, Default)]
pub(super) struct PackedMap {
    table: HashTable<Packed>,
}

/// A key split in two halves so the entry needs only 4-byte alignment.
#[derive(Debug, Clone, Copy)]
struct Packed {
    key: [u32; 2],
    val: u32,
}

impl Packed {
    fn new(key: u64, val: u32) -> Packed {
        Packed { key: [key as u32, (key >> 32) as u32], val }
    }

    fn key(&self) -> u64 {
        u64::from(self.key[0]) | u64::from(self.key[1]) << 32
    }
}

impl PackedMap {
    /// The value of `key`.
    pub(super) fn get(&self, key: u64) -> Option<u32> {
        self.table.find(key, |e| e.key() == key).map(|e| e.val)
    }

    /// Sets `key` to `val`; returns the previous value.
    pub(super) fn insert(&mut self, key: u64, val: u32) -> Option<u32> {
        match self.table.entry(key, |e| e.key() == key, Packed::key) {
            Entry::Occupied(mut o) => Some(std::mem::replace(&mut o.get_mut().val, val)),
            Entry::Vacant(v) => {
                v.insert(Packed::new(key, val));
                None
            }
        }
    }

    /// Sets `key` to `val` unless it has a value already; returns that value (nothing
    /// changed) or `None` (inserted).
    pub(super) fn try_insert(&mut self, key: u64, val: u32) -> Option<u32> {
        match self.table.entry(key, |e| e.key() == key, Packed::key) {
            Entry::Occupied(o) => Some(o.get().val),
            Entry::Vacant(v) => {
                v.insert(Packed::new(key, val));
                None
            }
        }
    }

    /// Removes `key`; returns its value.
    pub(super) fn remove(&mut self, key: u64) -> Option<u32> {
        self.table.find_entry(key, |e| e.key() == key).ok().map(|o| o.remove().0.val)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_spread_over_shards_and_stay_findable() {
        let mut m: Sharded<Map<u64>, 16> = Sharded::default();
        assert_eq!(m.len(), 0);
        // Keys that differ only in their shard bits, and keys that differ only in low bits.
        let keys: Vec<u64> = (0..16u64).map(|i| i << 48 | 7).chain((1..=100).map(|i| 3u64 << 48 | i << 8)).collect();
        for k in &keys {
            m.shard_mut(*k).insert(*k, k.wrapping_mul(3));
        }
        assert_eq!(m.len(), keys.len());
        assert!(keys.iter().all(|k| m.shard(*k).get(k) == Some(&k.wrapping_mul(3))));
        assert_eq!(m.shards.iter().filter(|s| !s.is_empty()).count(), 16, "one key per shard at least");
        assert_eq!(m.shard(3 << 48).len(), 101);
        let mut values: Vec<u64> = m.into_values().collect();
        values.sort_unstable();
        let mut expected: Vec<u64> = keys.iter().map(|k| k.wrapping_mul(3)).collect();
        expected.sort_unstable();
        assert_eq!(values, expected);
    }

    #[test]
    fn packed_map_is_a_map_in_12_byte_entries() {
        assert_eq!(std::mem::size_of::<Packed>(), 12);
        let mut m = PackedMap::default();
        let keys = [0, 1, u64::MAX, 1 << 32, (1 << 32) | 1, 0xdead_beef_0000_0001];
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(m.try_insert(*k, i as u32), None);
        }
        assert_eq!(m.try_insert(1 << 32, 99), Some(3), "try_insert keeps the value");
        assert_eq!(m.insert(1 << 32, 99), Some(3), "insert replaces it");
        for (i, k) in keys.iter().enumerate().filter(|(_, k)| **k != 1 << 32) {
            assert_eq!(m.get(*k), Some(i as u32));
        }
        assert_eq!(m.remove(1 << 32), Some(99));
        assert_eq!((m.get(1 << 32), m.remove(1 << 32)), (None, None));
        assert_eq!(m.get(1), Some(1), "a key sharing half of a removed one stays");
    }
}
