//! [`Arena`]: one replica's blocks on one tier, as sequence hashes in the order they were
//! stored, so a stored event's blocks sit side by side and a lookup reads a chain of them as
//! one run of memory.
//!
//! A slot holds a block's sequence hash, or [`DEAD`] once the block is removed. Removed slots
//! at the end are dropped at once; the rest are squeezed out by [`Arena::compact`] when they
//! outnumber the live ones, so the arena stays under twice its live blocks plus a quarter of
//! growth room, and compacting costs O(1) a removal, amortized.
//!
//! Each slot also has a **head** bit: set when the slot starts a chain the slot before it does
//! not continue (see the index's README). The bits let removals and compaction touch the
//! tier's head table only for slots that are in it.

/// What a removed slot holds. A block whose sequence hash happens to be this (probability
/// 2⁻⁶⁴) is stored as [`DEAD_STAND_IN`]: indexed, but never matched.
pub(super) const DEAD: SequenceHash = SequenceHash(0);

/// What a block whose sequence hash is [`DEAD`] is stored as.
pub(super) const DEAD_STAND_IN: SequenceHash = SequenceHash(u64::MAX);

use kvgate_shared::hash::SequenceHash;

/// One replica's blocks on one tier, in store order.
#[derive(Debug, Default, Clone)]
pub(super) struct Arena {
    /// Slot → the sequence hash of the block there, or [`DEAD`].
    seqs: Vec<SequenceHash>,
    /// One bit a slot: the slot heads a chain.
    heads: Vec<u64>,
    /// Removed slots not yet compacted away.
    dead: usize,
}

/// What [`Arena::compact`] moved.
#[derive(Debug, Default)]
pub(super) struct Compacted {
    /// Old slot → new slot (`u32::MAX` for removed slots).
    pub(super) remap: Vec<u32>,
    /// The heads that moved: (sequence hash, old slot, new slot), by old slot.
    pub(super) heads: Vec<(SequenceHash, u32, u32)>,
}

impl Arena {
    /// The sequence hashes of every slot, [`DEAD`] for removed ones.
    pub(super) fn seqs(&self) -> &[SequenceHash] {
        &self.seqs
    }

    /// The slot the next [`push`](Self::push) fills.
    pub(super) fn next_slot(&self) -> u32 {
        u32::try_from(self.seqs.len()).expect("an arena holds fewer than 2^32 slots")
    }

    /// The sequence hash at `slot` ([`DEAD`] if removed).
    pub(super) fn get(&self, slot: u32) -> SequenceHash {
        self.seqs[slot as usize]
    }

    /// Whether `slot` heads a chain.
    pub(super) fn is_head(&self, slot: u32) -> bool {
        self.heads[slot as usize / 64] >> (slot % 64) & 1 == 1
    }

    /// Whether no slot in `from..=to` heads a chain: then each live one continues the chain of
    /// the slot before it, and a live block at `to` has its ancestors in the slots before it,
    /// back to `from - 1` (a removed slot's live successor heads a chain).
    pub(super) fn no_head_in(&self, from: u32, to: u32) -> bool {
        let (from, to) = (from as usize, to as usize);
        if from > to {
            return true;
        }
        (from / 64..=to / 64).all(|w| {
            let low = if w == from / 64 { u64::MAX << (from % 64) } else { u64::MAX };
            let high = if w == to / 64 { u64::MAX >> (63 - to % 64) } else { u64::MAX };
            self.heads[w] & low & high == 0
        })
    }

    /// Marks `slot` as heading a chain.
    pub(super) fn set_head(&mut self, slot: u32) {
        self.heads[slot as usize / 64] |= 1 << (slot % 64);
    }

    /// Appends a block; returns its slot. The arena grows by a quarter at a time, so the
    /// room it keeps spare stays small.
    pub(super) fn push(&mut self, seq: SequenceHash, head: bool) -> u32 {
        let slot = self.next_slot();
        if self.seqs.len() == self.seqs.capacity() {
            self.seqs.reserve_exact((self.seqs.len() / 4).max(64));
        }
        self.seqs.push(if seq == DEAD { DEAD_STAND_IN } else { seq });
        if slot.is_multiple_of(64) {
            self.heads.push(0);
        }
        if head {
            self.set_head(slot);
        }
        slot
    }

    /// Removes the block at `slot`; returns its sequence hash and whether it headed a chain.
    pub(super) fn kill(&mut self, slot: u32) -> (SequenceHash, bool) {
        let seq = std::mem::replace(&mut self.seqs[slot as usize], DEAD);
        debug_assert_ne!(seq, DEAD, "slot {slot} removed twice");
        let head = self.is_head(slot);
        self.heads[slot as usize / 64] &= !(1 << (slot % 64));
        self.dead += 1;
        (seq, head)
    }

    /// Drops removed slots at the end; returns whether removed slots elsewhere outnumber the
    /// live ones (time to [`compact`](Self::compact)).
    pub(super) fn trim(&mut self) -> bool {
        while self.seqs.last() == Some(&DEAD) {
            self.seqs.pop();
            self.dead -= 1;
        }
        self.heads.truncate(self.seqs.len().div_ceil(64));
        self.dead > self.seqs.len() - self.dead
    }

    /// Squeezes out the removed slots, keeping the live ones in order (so a chain stays one
    /// run); returns where every slot went.
    pub(super) fn compact(&mut self) -> Compacted {
        let live = self.seqs.len() - self.dead;
        let mut seqs = Vec::with_capacity(live + live / 8);
        let mut heads = vec![0u64; live.div_ceil(64)];
        let mut moved = Compacted { remap: vec![u32::MAX; self.seqs.len()], heads: Vec::new() };
        for (old, seq) in self.seqs.iter().enumerate() {
            if *seq == DEAD {
                continue;
            }
            let new = seqs.len() as u32;
            moved.remap[old] = new;
            if self.is_head(old as u32) {
                heads[new as usize / 64] |= 1 << (new % 64);
                moved.heads.push((*seq, old as u32, new));
            }
            seqs.push(*seq);
        }
        *self = Arena { seqs, heads, dead: 0 };
        moved
    }

    /// Every head: (slot, sequence hash).
    pub(super) fn heads(&self) -> impl Iterator<Item = (u32, SequenceHash)> + '_ {
        self.seqs.iter().enumerate().filter(|(slot, _)| self.is_head(*slot as u32)).map(|(s, seq)| (s as u32, *seq))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const fn h(n: u64) -> SequenceHash {
        SequenceHash(n)
    }

    #[test]
    fn removed_slots_are_trimmed_at_the_end_and_compacted_away_elsewhere() {
        let mut a = Arena::default();
        for seq in 1..=10u64 {
            assert_eq!(a.push(h(seq), seq % 4 == 1), seq as u32 - 1);
        }
        assert_eq!(a.heads().collect::<Vec<_>>(), [(0, h(1)), (4, h(5)), (8, h(9))]);
        assert_eq!(a.kill(9), (h(10), false));
        assert_eq!(a.kill(8), (h(9), true));
        assert!(!a.trim(), "only the end was removed");
        assert_eq!(a.next_slot(), 8, "the removed end is gone");
        for slot in [0, 1, 2, 5, 6] {
            a.kill(slot);
        }
        assert!(a.trim(), "5 removed, 3 live");
        assert_eq!(a.seqs(), [DEAD, DEAD, DEAD, h(4), h(5), DEAD, DEAD, h(8)]);
        let moved = a.compact();
        assert_eq!(a.seqs(), [h(4), h(5), h(8)]);
        assert_eq!(moved.remap, [u32::MAX, u32::MAX, u32::MAX, 0, 1, u32::MAX, u32::MAX, 2]);
        assert_eq!(moved.heads, [(h(5), 4, 1)]);
        assert!(a.is_head(1) && !a.is_head(0) && !a.is_head(2));
        assert_eq!(a.push(h(11), true), 3);
        assert_eq!(a.heads().collect::<Vec<_>>(), [(1, h(5)), (3, h(11))]);
    }

    #[test]
    fn head_free_ranges_are_found_across_words() {
        let mut a = Arena::default();
        for seq in 0..200u64 {
            a.push(h(seq + 1), seq == 0 || seq == 70 || seq == 150);
        }
        assert!(a.no_head_in(1, 69) && a.no_head_in(71, 149) && a.no_head_in(151, 199));
        assert!(!a.no_head_in(1, 70) && !a.no_head_in(70, 70) && !a.no_head_in(60, 160));
        assert!(a.no_head_in(5, 4), "an empty range");
        assert!(a.no_head_in(64, 64) && a.no_head_in(127, 128), "word edges");
    }

    #[test]
    fn a_block_hashing_to_the_dead_marker_is_stored_as_its_stand_in() {
        let mut a = Arena::default();
        a.push(DEAD, true);
        assert_eq!(a.get(0), DEAD_STAND_IN);
        assert_eq!(a.kill(0), (DEAD_STAND_IN, true));
    }
}
