//! The approximate index of the `prefix_affinity` policy, for engines that publish no KV
//! events: it remembers where this gateway *sent* each prompt's blocks, not where engines say
//! they hold them.
//!
//! A routed request's block hashes are recorded on the chosen replica; a later prompt's overlap
//! with a replica is how many of its leading blocks were recorded there within `ttl`. The
//! guess is right while the engine still caches what it was sent; the TTL and the bound on
//! blocks approximate its eviction. Like SGLang's and vLLM's approximate routers — and unlike
//! kvgate's event-fed index — it cannot know about evictions, restarts, or traffic that did not
//! come through this gateway.
//!
//! The same index is the in-flight credit of `kv_aware` (where prefixes went moments ago).
//! Every decision and every peer's booking records here, so a record costs one lookup per
//! block in a flat table, and blocks leave in the order they were last recorded: when they
//! expire, or when the table is full.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvgate_shared::hash::SequenceHash;
use smallvec::SmallVec;

use super::sharded::Map;
use super::{Overlap, ReplicaIdx};

/// Blocks recorded per replica, most recently routed last; bounded and timed.
#[derive(Debug)]
pub struct ApproxIndex {
    /// Sequence hash → the replicas it was sent to, with when.
    blocks: Map<SequenceHash, Block>,
    /// Every record, oldest first: a block and when it was recorded. A block leaves when its
    /// latest record is popped (a record refreshed since is skipped).
    order: VecDeque<(SequenceHash, u64)>,
    /// Blocks kept at most.
    capacity: usize,
    ttl: Duration,
    /// What [`Holder::at`] counts from.
    epoch: Instant,
}

/// A block's holders, and when it was last recorded.
#[derive(Debug, Default)]
struct Block {
    holders: SmallVec<[Holder; 2]>,
    last: u64,
}

/// A replica a block was sent to, and when: 16 bytes (an `Instant` alone takes 16), since
/// every decision reads the holders of each of its prompt's blocks.
#[derive(Debug, Clone, Copy)]
struct Holder {
    replica: ReplicaIdx,
    /// Milliseconds after the index's epoch.
    at: u64,
}

impl ApproxIndex {
    /// An empty index keeping at most `capacity` distinct blocks, each for `ttl`.
    pub fn new(capacity: usize, ttl: Duration) -> ApproxIndex {
        let capacity = capacity.max(1);
        ApproxIndex { blocks: Map::default(), order: VecDeque::new(), capacity, ttl, epoch: Instant::now() }
    }

    /// Each of `replicas` replicas' overlap with the prompt: its leading blocks recorded on that
    /// replica and not expired at `now` (reported as device blocks).
    ///
    /// O(blocks × (holders + replicas / 64)): the replicas still matching are a bit set, and a
    /// replica's overlap is written once, when it stops matching.
    pub fn find_matches(&self, hashes: &[SequenceHash], replicas: usize, now: Instant) -> Vec<Overlap> {
        self.find_matches_past(hashes, &vec![0; replicas], now)
    }

    /// Each replica's overlap with the prompt when its KV events show it holding the prompt's
    /// first `held[r]` blocks: its leading blocks that are held by its events or recorded on it
    /// and not expired at `now` (one per entry of `held`).
    ///
    /// A decision records on its target only the blocks past what the target's events hold
    /// ([`ApproxIndex::record`] of the rest), so a prefix that the events show cached does not
    /// grow every one of its blocks' holder lists with the fleet; the walk counts what the
    /// events hold as held, so the blocks recorded after it still count. The walk starts at the
    /// fewest blocks any replica's events hold (a shared system prompt costs nothing). Where a
    /// record of an early block was forgotten (the table was full) and a later one's was not,
    /// the walk stops at the gap.
    pub fn find_matches_past(&self, hashes: &[SequenceHash], held: &[u32], now: Instant) -> Vec<Overlap> {
        let replicas = held.len();
        let start = (held.iter().copied().min().unwrap_or(0) as usize).min(hashes.len());
        let words = replicas.div_ceil(64);
        // Replicas whose events hold blocks past `start`, in the order they stop holding them.
        let mut by_events: Vec<(u32, usize)> =
            held.iter().enumerate().filter(|(_, h)| **h as usize > start).map(|(r, h)| (*h, r)).collect();
        by_events.sort_unstable();
        let mut event_held = vec![0u64; words];
        for &(_, r) in &by_events {
            event_held[r / 64] |= 1 << (r % 64);
        }
        let mut leaving = by_events.iter().peekable();
        let mut out = vec![Overlap::default(); replicas];
        let mut still: Vec<u64> = (0..words).map(|w| bits_below(replicas - w * 64)).collect();
        let mut here = vec![0u64; words];
        let fresh = self.fresh_at(now);
        for (depth, h) in (start..).zip(&hashes[start..]) {
            while let Some(&(_, r)) = leaving.next_if(|(until, _)| *until as usize <= depth) {
                event_held[r / 64] &= !(1 << (r % 64));
            }
            here.copy_from_slice(&event_held);
            for &Holder { replica: r, at } in self.blocks.get(h).into_iter().flat_map(|b| &b.holders) {
                if r.get() < replicas && fresh(at) {
                    here[r.get() / 64] |= 1 << (r.get() % 64);
                }
            }
            let mut any = false;
            for (w, (s, held)) in still.iter_mut().zip(&here).enumerate() {
                set_overlap(&mut out, w, *s & !held, depth as u32);
                *s &= held;
                any |= *s != 0;
            }
            if !any {
                return out;
            }
        }
        for (w, s) in still.iter().enumerate() {
            set_overlap(&mut out, w, *s, hashes.len() as u32);
        }
        out
    }

    /// Records that the prompt's blocks were sent to `replica` at `now`.
    pub fn record(&mut self, replica: ReplicaIdx, hashes: &[SequenceHash], now: Instant) {
        let fresh = self.fresh_at(now);
        let at = self.millis(now);
        for h in hashes {
            let block = self.blocks.entry(*h).or_default();
            block.holders.retain(|h| h.replica != replica && fresh(h.at));
            block.holders.push(Holder { replica, at });
            block.last = at;
            self.order.push_back((*h, at));
        }
        self.forget(now);
    }

    /// Forgets the blocks whose latest record has expired at `now`, then the least recently
    /// recorded while more than `capacity` are kept; and drops the records refreshed since, once
    /// they outnumber the blocks kept, so `order` stays within twice the capacity.
    fn forget(&mut self, now: Instant) {
        let fresh = self.fresh_at(now);
        while let Some(&(h, at)) = self.order.front() {
            if fresh(at) && self.blocks.len() <= self.capacity {
                break;
            }
            self.order.pop_front();
            if self.blocks.get(&h).is_some_and(|b| b.last == at) {
                self.blocks.remove(&h);
            }
        }
        if self.order.len() > 2 * self.capacity {
            let blocks = &self.blocks;
            self.order.retain(|(h, at)| blocks.get(h).is_some_and(|b| b.last == *at));
        }
    }

    /// Whether a record made at a given [`Holder::at`] has not expired at `now`.
    fn fresh_at(&self, now: Instant) -> impl Fn(u64) -> bool {
        let oldest = self.millis(now).checked_sub(self.ttl.as_millis() as u64);
        move |at| oldest.is_none_or(|oldest| at >= oldest)
    }

    /// `now` in [`Holder::at`]'s terms (an instant before the epoch counts as the epoch).
    fn millis(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_millis() as u64
    }

    /// Forgets a replica (it left the pool).
    pub fn clear_replica(&mut self, replica: ReplicaIdx) {
        self.blocks.retain(|_, b| {
            b.holders.retain(|h| h.replica != replica);
            !b.holders.is_empty()
        });
    }

    /// Distinct blocks remembered.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

/// The lowest `n` bits set (all 64 for `n` ≥ 64).
fn bits_below(n: usize) -> u64 {
    if n >= 64 {
        u64::MAX
    } else {
        (1 << n) - 1
    }
}

/// Sets the device overlap of the replicas whose bits are set in `word` (word `w` of a set).
fn set_overlap(out: &mut [Overlap], w: usize, mut word: u64, depth: u32) {
    while word != 0 {
        out[w * 64 + word.trailing_zeros() as usize].device = depth;
        word &= word - 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn h(hashes: &[u64]) -> Vec<SequenceHash> {
        hashes.iter().copied().map(SequenceHash).collect()
    }

    #[test]
    fn overlap_is_the_leading_blocks_sent_to_each_replica() {
        let mut idx = ApproxIndex::new(100, Duration::from_secs(60));
        let t = Instant::now();
        idx.record(ReplicaIdx::new(1), &h(&[1, 2, 3, 4]), t);
        idx.record(ReplicaIdx::new(0), &h(&[1, 2, 9]), t);
        let o = idx.find_matches(&h(&[1, 2, 3, 5]), 3, t);
        assert_eq!(o.iter().map(|o| o.device).collect::<Vec<_>>(), [2, 3, 0]);
        assert_eq!(
            idx.find_matches(&h(&[7, 1]), 3, t),
            vec![Overlap::default(); 3],
            "a miss on the first block ends it"
        );
        idx.clear_replica(ReplicaIdx::new(1));
        assert_eq!(idx.find_matches(&h(&[1, 2, 3]), 3, t)[1].device, 0);
    }

    #[test]
    fn a_prefix_every_replica_holds_is_not_walked_but_counted() {
        let mut idx = ApproxIndex::new(100, Duration::from_secs(60));
        let t = Instant::now();
        idx.record(ReplicaIdx::new(0), &h(&[1, 2, 3, 4]), t);
        idx.record(ReplicaIdx::new(1), &h(&[1, 2]), t);
        idx.record(ReplicaIdx::new(2), &h(&[1, 2, 3, 4, 5, 6]), t);
        let prompt = h(&[1, 2, 3, 4, 5, 6]);
        let device = |o: Vec<Overlap>| o.iter().map(|o| o.device).collect::<Vec<_>>();
        assert_eq!(device(idx.find_matches(&prompt, 4, t)), [4, 2, 6, 0]);
        assert_eq!(device(idx.find_matches_past(&prompt, &[3; 4], t)), [4, 3, 6, 3], "the larger of the two");
        assert_eq!(device(idx.find_matches_past(&prompt, &[0; 4], t)), [4, 2, 6, 0]);
        assert_eq!(device(idx.find_matches_past(&prompt, &[9; 4], t)), [6; 4], "no further than the prompt");
    }

    #[test]
    fn blocks_recorded_past_what_the_events_hold_are_counted_after_them() {
        let mut idx = ApproxIndex::new(100, Duration::from_secs(60));
        let t = Instant::now();
        let prompt = h(&[1, 2, 3, 4, 5, 6]);
        // Each target's events held the first three blocks: only the rest was recorded.
        idx.record(ReplicaIdx::new(0), &prompt[3..], t);
        idx.record(ReplicaIdx::new(1), &prompt[3..], t);
        let device = |o: Vec<Overlap>| o.iter().map(|o| o.device).collect::<Vec<_>>();
        assert_eq!(device(idx.find_matches_past(&prompt, &[3, 3, 0], t)), [6, 6, 0]);
        assert_eq!(
            device(idx.find_matches_past(&prompt, &[3, 1, 0], t)),
            [6, 1, 0],
            "a replica whose events lost a block before the recorded ones stops at the gap"
        );
        assert_eq!(device(idx.find_matches(&prompt, 3, t)), [0, 0, 0], "the records alone start at block 3");
    }

    #[test]
    fn entries_expire_and_the_size_is_bounded() {
        let mut idx = ApproxIndex::new(3, Duration::from_secs(10));
        let t = Instant::now();
        idx.record(ReplicaIdx::new(0), &h(&[1, 2]), t);
        assert_eq!(idx.find_matches(&h(&[1, 2]), 1, t + Duration::from_secs(5))[0].device, 2);
        assert_eq!(idx.find_matches(&h(&[1, 2]), 1, t + Duration::from_secs(11))[0].device, 0, "expired");
        idx.record(ReplicaIdx::new(0), &h(&[1, 2]), t + Duration::from_secs(11));
        assert_eq!(idx.find_matches(&h(&[1, 2]), 1, t + Duration::from_secs(12))[0].device, 2, "refreshed");
        idx.record(ReplicaIdx::new(0), &h(&[5, 6]), t + Duration::from_secs(12));
        assert_eq!(idx.len(), 3, "the least recently routed block went");
        assert_eq!(idx.find_matches(&h(&[1, 2]), 1, t + Duration::from_secs(12))[0].device, 0);
    }

    #[test]
    fn blocks_recorded_again_and_again_stay_within_the_bound() {
        let mut idx = ApproxIndex::new(4, Duration::from_secs(60));
        let t = Instant::now();
        for i in 0..1000u64 {
            idx.record(ReplicaIdx::new((i % 3) as usize), &h(&[1, 2]), t + Duration::from_millis(i));
        }
        assert_eq!(idx.len(), 2);
        assert!(idx.order.len() <= 8, "records refreshed since are dropped: {}", idx.order.len());
        let o = idx.find_matches(&h(&[1, 2]), 3, t + Duration::from_secs(1));
        assert_eq!(o.iter().map(|o| o.device).collect::<Vec<_>>(), [2, 2, 2]);
        (0..3).for_each(|r| idx.clear_replica(ReplicaIdx::new(r)));
        assert!(idx.is_empty(), "a block no replica holds is forgotten");
    }

    #[test]
    fn replicas_past_the_first_word_of_the_set_are_matched() {
        let mut idx = ApproxIndex::new(100, Duration::from_secs(60));
        let t = Instant::now();
        idx.record(ReplicaIdx::new(63), &h(&[1, 2]), t);
        idx.record(ReplicaIdx::new(64), &h(&[1, 2, 3]), t);
        idx.record(ReplicaIdx::new(129), &h(&[1]), t);
        idx.record(ReplicaIdx::new(200), &h(&[1, 2, 3]), t);
        let o = idx.find_matches(&h(&[1, 2, 3, 4]), 130, t);
        assert_eq!(o.len(), 130, "one per replica asked about; 200 is not one of them");
        let held: Vec<_> = o.iter().enumerate().filter(|(_, o)| o.device > 0).map(|(r, o)| (r, o.device)).collect();
        assert_eq!(held, [(63, 2), (64, 3), (129, 1)]);
    }

    proptest! {
        /// The overlap is, by definition, the leading prompt blocks that the replica's events
        /// hold or whose latest record on the replica is fresh: the bit-set walk agrees with that
        /// on any records and event overlaps, over one or several words of replicas.
        #[test]
        fn overlaps_match_their_definition(
            records in prop::collection::vec((0u32..130, 0usize..6, 1usize..6, 0u64..20), 0..40),
            held in prop::collection::vec(0u32..8, 130),
            prompt_len in 0usize..6,
        ) {
            let (ttl, start) = (Duration::from_secs(10), Instant::now());
            let mut idx = ApproxIndex::new(1000, ttl);
            let mut latest: std::collections::HashMap<(u32, u64), u64> = Default::default();
            let mut records = records;
            records.sort_by_key(|r| r.3);
            for (replica, from, to, secs) in records {
                let hashes: Vec<u64> = (from.min(to) as u64 + 1..=to as u64).collect();
                idx.record(ReplicaIdx::new(replica as usize), &h(&hashes), start + Duration::from_secs(secs));
                for b in hashes {
                    latest.insert((replica, b), secs);
                }
            }
            let now_secs = 20;
            let prompt: Vec<u64> = (1..=prompt_len as u64).collect();
            let got = idx.find_matches_past(&h(&prompt), &held, start + Duration::from_secs(now_secs));
            prop_assert_eq!(got.len(), held.len());
            for (r, o) in got.iter().enumerate() {
                let fresh = |b: &u64| latest.get(&(r as u32, *b)).is_some_and(|at| now_secs - at <= 10);
                let held_at = |b: &u64| *b <= u64::from(held[r]) || fresh(b);
                prop_assert_eq!(o.device as usize, prompt.iter().take_while(|b| held_at(b)).count(), "replica {}", r);
            }
        }
    }
}
