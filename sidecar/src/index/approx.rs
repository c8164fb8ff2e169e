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
    blocks: LruCache<SequenceHash, Vec<(ReplicaIdx, Instant)>>,
    ttl: Duration,
}

impl ApproxIndex {
    /// An empty index keeping at most `capacity` distinct blocks, each for `ttl`.
    pub fn new(capacity: usize, ttl: Duration) -> ApproxIndex {
        ApproxIndex { blocks: LruCache::new(NonZeroUsize::new(capacity.max(1)).unwrap_or(NonZeroUsize::MIN)), ttl }
    }

    /// Each of `replicas` replicas' overlap with the prompt: its leading blocks recorded on that
    /// replica and not expired at `now` (reported as device blocks).
    pub fn find_matches(&self, hashes: &[SequenceHash], replicas: usize, now: Instant) -> Vec<Overlap> {
        let mut out = vec![Overlap::default(); replicas];
        let mut still: Vec<bool> = vec![true; replicas];
        for h in hashes {
            let Some(holders) = self.blocks.peek(h) else { break };
            let mut any = false;
            for (r, s) in still.iter_mut().enumerate() {
                *s = *s
                    && holders.iter().any(|(hr, at)| hr.get() == r && now.saturating_duration_since(*at) <= self.ttl);
                if *s {
                    out[r].device += 1;
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
        out
    }

    /// Records that the prompt's blocks were sent to `replica` at `now`.
    pub fn record(&mut self, replica: ReplicaIdx, hashes: &[SequenceHash], now: Instant) {
        for h in hashes {
            let holders = self.blocks.get_or_insert_mut(*h, Vec::new);
            holders.retain(|(r, at)| *r != replica && now.saturating_duration_since(*at) <= self.ttl);
            holders.push((replica, now));
        }
    }

    /// Forgets a replica (it left the pool).
    pub fn clear_replica(&mut self, replica: ReplicaIdx) {
        for (_, holders) in self.blocks.iter_mut() {
            holders.retain(|(r, _)| *r != replica);
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
