//! The approximate index of the `prefix_affinity` policy, for engines that publish no KV
//! events: it remembers where this gateway *sent* each prompt's blocks, not where engines say
//! they hold them.
//!
//! A routed request's block hashes are recorded on the chosen replica; a later prompt's overlap
//! with a replica is how many of its leading blocks were recorded there within `ttl`. The
//! guess is right while the engine still caches what it was sent; the TTL and the LRU bound on
//! blocks approximate its eviction. Like SGLang's and vLLM's approximate routers — and unlike
//! kvgate's event-fed index — it cannot know about evictions, restarts, or traffic that did not
//! come through this gateway.

use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use kvgate_shared::hash::SequenceHash;
use lru::LruCache;

use super::{Overlap, ReplicaIdx};

/// Blocks recorded per replica, most recently routed first; bounded and timed.
#[derive(Debug)]
pub struct ApproxIndex {
    /// Sequence hash → the replicas it was sent to, with when.
    blocks: LruCache<SequenceHash, Vec<Holder>>,
    ttl: Duration,
    /// What [`Holder::at`] counts from.
    epoch: Instant,
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
        let blocks = LruCache::new(NonZeroUsize::new(capacity.max(1)).unwrap_or(NonZeroUsize::MIN));
        ApproxIndex { blocks, ttl, epoch: Instant::now() }
    }

    /// Each of `replicas` replicas' overlap with the prompt: its leading blocks recorded on that
    /// replica and not expired at `now` (reported as device blocks).
    ///
    /// O(blocks × (holders + replicas / 64)): the replicas still matching are a bit set, and a
    /// replica's overlap is written once, when it stops matching.
    pub fn find_matches(&self, hashes: &[SequenceHash], replicas: usize, now: Instant) -> Vec<Overlap> {
        self.walk(hashes, replicas, now, 0)
    }

    /// The larger of each replica's overlap here and `known`, for a caller that knows every
    /// replica holds the prompt's first `known` blocks (the event-fed index says so): the walk
    /// starts at block `known`, with every replica matching. A shared system prompt that every
    /// replica caches then costs nothing, however many replicas it was sent to — the walk over
    /// its blocks reads every holder of each, O(blocks × replicas) on a large fleet.
    ///
    /// Where a record of an early block was evicted from the LRU and a later one's was not,
    /// this credits the later one and `find_matches` stops at the gap; a block's sequence hash
    /// names its whole prefix, so its fresh record means the whole prefix was sent there.
    pub fn find_matches_past(
        &self,
        hashes: &[SequenceHash],
        replicas: usize,
        now: Instant,
        known: usize,
    ) -> Vec<Overlap> {
        self.walk(hashes, replicas, now, known.min(hashes.len()))
    }

    /// Every replica's overlap, taking the first `start` blocks as held by all.
    fn walk(&self, hashes: &[SequenceHash], replicas: usize, now: Instant, start: usize) -> Vec<Overlap> {
        let mut out = vec![Overlap::default(); replicas];
        let words = replicas.div_ceil(64);
        let mut still: Vec<u64> = (0..words).map(|w| bits_below(replicas - w * 64)).collect();
        let mut here = vec![0u64; words];
        let mut depth = start as u32;
        let fresh = self.fresh_at(now);
        for h in &hashes[start..] {
            let Some(holders) = self.blocks.peek(h) else { break };
            here.fill(0);
            for &Holder { replica: r, at } in holders {
                if r.get() < replicas && fresh(at) {
                    here[r.get() / 64] |= 1 << (r.get() % 64);
                }
            }
            let mut any = false;
            for (w, (s, held)) in still.iter_mut().zip(&here).enumerate() {
                set_overlap(&mut out, w, *s & !held, depth);
                *s &= held;
                any |= *s != 0;
            }
            if !any {
                return out;
            }
            depth += 1;
        }
        for (w, s) in still.iter().enumerate() {
            set_overlap(&mut out, w, *s, depth);
        }
        out
    }

    /// Records that the prompt's blocks were sent to `replica` at `now`.
    pub fn record(&mut self, replica: ReplicaIdx, hashes: &[SequenceHash], now: Instant) {
        let fresh = self.fresh_at(now);
        let at = self.millis(now);
        for h in hashes {
            let holders = self.blocks.get_or_insert_mut(*h, Vec::new);
            holders.retain(|h| h.replica != replica && fresh(h.at));
            holders.push(Holder { replica, at });
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
        for (_, holders) in self.blocks.iter_mut() {
            holders.retain(|h| h.replica != replica);
        }
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
        assert_eq!(device(idx.find_matches_past(&prompt, 4, t, 3)), [4, 3, 6, 3], "the larger of the two");
        assert_eq!(device(idx.find_matches_past(&prompt, 4, t, 0)), [4, 2, 6, 0]);
        assert_eq!(device(idx.find_matches_past(&prompt, 4, t, 9)), [6; 4], "no further than the prompt");
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
        /// The overlap is, by definition, the leading prompt blocks whose latest record on the
        /// replica is fresh: the bit-set walk agrees with that on any records, over one or
        /// several words of replicas.
        #[test]
        fn overlaps_match_their_definition(
            records in prop::collection::vec((0u32..130, 1usize..6, 0u64..20), 0..40),
            prompt_len in 0usize..6,
        ) {
            let (ttl, start) = (Duration::from_secs(10), Instant::now());
            let mut idx = ApproxIndex::new(1000, ttl);
            let mut latest: std::collections::HashMap<(u32, u64), u64> = Default::default();
            let mut records = records;
            records.sort_by_key(|r| r.2);
            for (replica, blocks, secs) in records {
                let hashes: Vec<u64> = (1..=blocks as u64).collect();
                idx.record(ReplicaIdx::new(replica as usize), &h(&hashes), start + Duration::from_secs(secs));
                for b in hashes {
                    latest.insert((replica, b), secs);
                }
            }
            let now_secs = 20;
            let prompt: Vec<u64> = (1..=prompt_len as u64).collect();
            let got = idx.find_matches(&h(&prompt), 130, start + Duration::from_secs(now_secs));
            for (r, o) in got.iter().enumerate() {
                let fresh = |b: &u64| latest.get(&(r as u32, *b)).is_some_and(|at| now_secs - at <= 10);
                prop_assert_eq!(o.device as usize, prompt.iter().take_while(|b| fresh(b)).count(), "replica {}", r);
            }
        }
    }
}
