//! [`Sharded`]: a hash map split into shards that grow one at a time.
//!
//! A hash map doubles when it fills and moves every entry as it does. For the index's holder
//! table at millions of blocks that is one `BlockStored` taking half a second, and it happens
//! under the pool's write lock, so every routing decision of the pool waits for it. Split
//! into `S` shards by a byte of the key, each shard grows on its own: the same number of
//! moves, in pieces `1/S` the size, at different events. A small shard's rehash also stays in
//! the CPU cache, where the whole table's scattered writes to DRAM did not, so the total cost
//! of growing drops too. A lookup pays a shift and a mask.

use std::collections::HashMap;

use nohash_hasher::BuildNoHashHasher;

/// A map from already-uniform `u64` hashes: hashing them again would only cost time.
pub(super) type Map<V> = HashMap<u64, V, BuildNoHashHasher<u64>>;

/// The key bits that choose a shard start here. hashbrown places an entry by the key's low
/// bits and tags it with the top seven, so the keys of one shard still differ in both.
const SHARD_SHIFT: u32 = 48;

/// `S` maps (a power of two, at most 256), each holding the keys whose bits 48.. select it.
#[derive(Debug)]
pub(super) struct Sharded<V, const S: usize> {
    shards: Box<[Map<V>]>,
}

impl<V, const S: usize> Default for Sharded<V, S> {
    fn default() -> Self {
        const { assert!(S.is_power_of_two() && S <= 256) };
        Sharded { shards: (0..S).map(|_| Map::default()).collect() }
    }
}

impl<V, const S: usize> Sharded<V, S> {
    fn index(key: u64) -> usize {
        (key >> SHARD_SHIFT) as usize & (S - 1)
    }

    /// The shard that holds `key`, if anything does.
    pub(super) fn shard(&self, key: u64) -> &Map<V> {
        &self.shards[Self::index(key)]
    }

    /// The shard that holds `key`, to change.
    pub(super) fn shard_mut(&mut self, key: u64) -> &mut Map<V> {
        &mut self.shards[Self::index(key)]
    }

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

    #[test]
    fn keys_spread_over_shards_and_stay_findable() {
        let mut m: Sharded<u64, 16> = Sharded::default();
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
}
