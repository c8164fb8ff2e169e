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
//! Every decision and every peer's booking records here, so a record must cost little however
//! long its prompt: the blocks a record adds are one *run*, stored side by side, and the table
//! holds only each run's first block and every [`STRIDE`]th after it. A walk follows a run by
//! comparing the next slot, and finds the run holding a block from the table within
//! [`STRIDE`] lookups back. Sequence hashes chain, so a run holding the prompt's block at a
//! depth agrees with the prompt up to it.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvgate_shared::hash::SequenceHash;
use smallvec::SmallVec;

use super::sharded::Map;
use super::{Overlap, ReplicaIdx};

/// A run's blocks in the table: its first, and every `STRIDE`th after it.
const STRIDE: usize = 16;

/// Blocks recorded per replica, as runs; bounded and timed.
#[derive(Debug)]
pub struct ApproxIndex {
    /// Every run kept, by id.
    runs: Map<u64, Run>,
    /// Sequence hash → the runs holding it at their first block or at a multiple of
    /// [`STRIDE`] after it.
    table: Map<SequenceHash, SmallVec<[Entry; 1]>>,
    /// Every record of a run, oldest first: the run and its time then. A run leaves when its
    /// latest record is popped (a record refreshed since is skipped).
    order: VecDeque<(u64, u64)>,
    /// Blocks in all runs (a block recorded on two replicas counts twice).
    blocks: usize,
    /// Runs per replica: a replica with none is not walked.
    per_replica: Vec<u32>,
    /// The next run's id.
    next: u64,
    /// Blocks kept at most.
    capacity: usize,
    ttl: Duration,
    /// What [`Run::at`] counts from.
    epoch: Instant,
}

/// Blocks recorded on one replica in one go (or the part of such a record that a later one
/// refreshed), in prompt order.
#[derive(Debug)]
struct Run {
    replica: ReplicaIdx,
    /// When it was last recorded: milliseconds after the index's epoch.
    at: u64,
    hashes: Vec<SequenceHash>,
}

/// A run holding a block, and where. A block's entries are in replica order, so a walk finds
/// one replica's among a fleet's by bisection.
#[derive(Debug, Clone, Copy)]
struct Entry {
    run: u64,
    offset: u32,
    replica: ReplicaIdx,
}

/// What the table holds at each depth of the prompt a walk looked at, looked up once for
/// every replica walked. A walk looks at a few depths, not the prompt's length: nothing is
/// allocated until the first.
type Lookups<'a> = std::collections::HashMap<usize, Option<&'a [Entry]>, foldhash::fast::FixedState>;

impl ApproxIndex {
    /// An empty index keeping at most `capacity` blocks, each for `ttl`.
    pub fn new(capacity: usize, ttl: Duration) -> ApproxIndex {
        ApproxIndex {
            runs: Map::default(),
            table: Map::default(),
            order: VecDeque::new(),
            blocks: 0,
            per_replica: Vec::new(),
            next: 0,
            capacity: capacity.max(1),
            ttl,
            epoch: Instant::now(),
        }
    }

    /// Each of `replicas` replicas' overlap with the prompt: its leading blocks recorded on that
    /// replica and not expired at `now` (reported as device blocks).
    pub fn find_matches(&self, hashes: &[SequenceHash], replicas: usize, now: Instant) -> Vec<Overlap> {
        self.find_matches_past(hashes, &vec![0; replicas], now)
    }

    /// Each replica's overlap with the prompt when its KV events show it holding the prompt's
    /// first `held[r]` blocks: its leading blocks that are held by its events or recorded on it
    /// and not expired at `now` (one per entry of `held`).
    ///
    /// A decision records on its target only the blocks past what the target's events hold
    /// ([`ApproxIndex::record`] from there), so a prefix that the events show cached is not
    /// recorded again for every request; the walk counts what the events hold as held, and
    /// goes on with the runs recorded after it. A replica with no run is not walked; the
    /// others are walked from where their events end, the table's lookups shared among them.
    /// Where a run of an early block was forgotten and a later one was not, the walk stops at
    /// the gap.
    pub fn find_matches_past(&self, hashes: &[SequenceHash], held: &[u32], now: Instant) -> Vec<Overlap> {
        let fresh = self.fresh_at(now);
        let mut lookups = Lookups::default();
        held.iter()
            .enumerate()
            .map(|(r, &h)| {
                let from = (h as usize).min(hashes.len());
                let replica = ReplicaIdx::new(r);
                let device = match self.per_replica.get(r) {
                    Some(runs) if *runs > 0 => self.walk(replica, hashes, from, &fresh, &mut lookups, |_, _, _| ()),
                    _ => from,
                };
                Overlap { device: device as u32, ..Overlap::default() }
            })
            .collect()
    }

    /// Records that the prompt's blocks from `from` on were sent to `replica` at `now`. What
    /// is recorded there already is refreshed; the rest becomes a new run.
    pub fn record(&mut self, replica: ReplicaIdx, hashes: &[SequenceHash], from: usize, now: Instant) {
        let from = from.min(hashes.len());
        let (fresh, at) = (self.fresh_at(now), self.millis(now));
        let mut refreshed = Vec::new();
        let end = self.walk(replica, hashes, from, &fresh, &mut Lookups::default(), |run, offset, len| {
            refreshed.push((run, offset, len))
        });
        for (run, offset, len) in refreshed {
            self.refresh(run, offset, len, at);
        }
        if end < hashes.len() {
            self.add(replica, hashes[end..].to_vec(), at);
        }
        self.forget(now);
    }

    /// How far the prompt is held on `replica` from `from`: the runs holding its blocks, one
    /// after another, until none holds the next. `visit` gets each run followed, the offset
    /// where the walk entered it and how many of its blocks it followed.
    fn walk<'a>(
        &'a self,
        replica: ReplicaIdx,
        hashes: &[SequenceHash],
        from: usize,
        fresh: &impl Fn(u64) -> bool,
        lookups: &mut Lookups<'a>,
        mut visit: impl FnMut(u64, usize, usize),
    ) -> usize {
        let mut d = from;
        while d < hashes.len() {
            let Some((id, entered)) = self.locate(replica, hashes, d, fresh, lookups) else { break };
            let run = &self.runs[&id].hashes;
            let followed = run[entered..].iter().zip(&hashes[d..]).take_while(|(a, b)| a == b).count();
            visit(id, entered, followed);
            d += followed;
        }
        d
    }

    /// A fresh run of `replica` holding the prompt's block at depth `d`, and where: found
    /// through the table at one of the [`STRIDE`] depths up to `d` (the run's first block, or
    /// one of its every-`STRIDE`th, is among them).
    fn locate<'a>(
        &'a self,
        replica: ReplicaIdx,
        hashes: &[SequenceHash],
        d: usize,
        fresh: &impl Fn(u64) -> bool,
        lookups: &mut Lookups<'a>,
    ) -> Option<(u64, usize)> {
        (0..STRIDE.min(d + 1)).find_map(|back| {
            let at = d - back;
            let entries = (*lookups.entry(at).or_insert_with(|| self.table.get(&hashes[at]).map(|e| e.as_slice())))?;
            let first = entries.partition_point(|e| e.replica < replica);
            entries[first..].iter().take_while(|e| e.replica == replica).find_map(|e| {
                let run = &self.runs[&e.run];
                let offset = e.offset as usize + back;
                let holds = fresh(run.at) && run.hashes.get(offset) == Some(&hashes[d]);
                holds.then_some((e.run, offset))
            })
        })
    }

    /// Marks `len` blocks of run `id` from `offset` recorded at `at`: the run is split so that
    /// exactly those blocks take the new time. The blocks after them keep the run's id and
    /// its place in `order`; those before, if any, are a run of their own at the old time.
    fn refresh(&mut self, id: u64, offset: usize, len: usize, at: u64) {
        let Some(run) = self.runs.get_mut(&id) else { return };
        if offset == 0 && len == run.hashes.len() {
            run.at = at;
            self.order.push_back((id, at));
            return;
        }
        let Run { replica, at: before, hashes: mut front } = self.remove(id).expect("the run was just found");
        let back = front.split_off(offset + len);
        let middle = front.split_off(offset);
        front.shrink_to_fit();
        if back.is_empty() {
            self.insert(id, Run { replica, at: before, hashes: front });
        } else {
            self.insert(id, Run { replica, at: before, hashes: back });
            if !front.is_empty() {
                self.add(replica, front, before);
            }
        }
        self.add(replica, middle, at);
    }

    /// A new run of `hashes` on `replica`, recorded at `at`.
    fn add(&mut self, replica: ReplicaIdx, hashes: Vec<SequenceHash>, at: u64) {
        let id = self.next;
        self.next += 1;
        self.insert(id, Run { replica, at, hashes });
        self.order.push_back((id, at));
    }

    /// Puts run `id` in the table (its place in `order` is the caller's).
    fn insert(&mut self, id: u64, run: Run) {
        for offset in (0..run.hashes.len()).step_by(STRIDE) {
            let entries = self.table.entry(run.hashes[offset]).or_default();
            let after = entries.partition_point(|e| e.replica <= run.replica);
            entries.insert(after, Entry { run: id, offset: offset as u32, replica: run.replica });
        }
        let r = run.replica.get();
        if self.per_replica.len() <= r {
            self.per_replica.resize(r + 1, 0);
        }
        self.per_replica[r] += 1;
        self.blocks += run.hashes.len();
        self.runs.insert(id, run);
    }

    /// Takes run `id` out of the table.
    fn remove(&mut self, id: u64) -> Option<Run> {
        let run = self.runs.remove(&id)?;
        for offset in (0..run.hashes.len()).step_by(STRIDE) {
            if let Some(entries) = self.table.get_mut(&run.hashes[offset]) {
                entries.retain(|e| e.run != id);
                if entries.is_empty() {
                    self.table.remove(&run.hashes[offset]);
                }
            }
        }
        self.per_replica[run.replica.get()] -= 1;
        self.blocks -= run.hashes.len();
        Some(run)
    }

    /// Forgets the runs whose latest record has expired at `now`, then the least recently
    /// recorded while more than `capacity` blocks are kept (whole runs: it may keep up to a
    /// run's length fewer); and drops the records refreshed since, once they outnumber the
    /// runs kept, so `order` stays within about twice their number.
    fn forget(&mut self, now: Instant) {
        let fresh = self.fresh_at(now);
        while let Some(&(id, at)) = self.order.front() {
            let latest = self.runs.get(&id).is_some_and(|r| r.at == at);
            if latest && fresh(at) && self.blocks <= self.capacity {
                break;
            }
            self.order.pop_front();
            if latest {
                self.remove(id);
            }
        }
        if self.order.len() > 2 * self.runs.len() + 2 {
            let runs = &self.runs;
            self.order.retain(|(id, at)| runs.get(id).is_some_and(|r| r.at == *at));
        }
    }

    /// Whether a record made at a given [`Run::at`] has not expired at `now`.
    fn fresh_at(&self, now: Instant) -> impl Fn(u64) -> bool {
        let oldest = self.millis(now).checked_sub(self.ttl.as_millis() as u64);
        move |at| oldest.is_none_or(|oldest| at >= oldest)
    }

    /// `now` in [`Run::at`]'s terms (an instant before the epoch counts as the epoch).
    fn millis(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_millis() as u64
    }

    /// Forgets a replica (it left the pool).
    pub fn clear_replica(&mut self, replica: ReplicaIdx) {
        let gone: Vec<u64> = self.runs.iter().filter(|(_, r)| r.replica == replica).map(|(id, _)| *id).collect();
        for id in gone {
            self.remove(id);
        }
    }

    /// Blocks remembered (a block recorded on two replicas counts twice).
    pub fn len(&self) -> usize {
        self.blocks
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.blocks == 0
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
        idx.record(ReplicaIdx::new(1), &h(&[1, 2, 3, 4]), 0, t);
        idx.record(ReplicaIdx::new(0), &h(&[1, 2, 9]), 0, t);
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
        idx.record(ReplicaIdx::new(0), &h(&[1, 2, 3, 4]), 0, t);
        idx.record(ReplicaIdx::new(1), &h(&[1, 2]), 0, t);
        idx.record(ReplicaIdx::new(2), &h(&[1, 2, 3, 4, 5, 6]), 0, t);
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
        idx.record(ReplicaIdx::new(0), &prompt, 3, t);
        idx.record(ReplicaIdx::new(1), &prompt, 3, t);
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
        idx.record(ReplicaIdx::new(0), &h(&[1, 2]), 0, t);
        assert_eq!(idx.find_matches(&h(&[1, 2]), 1, t + Duration::from_secs(5))[0].device, 2);
        assert_eq!(idx.find_matches(&h(&[1, 2]), 1, t + Duration::from_secs(11))[0].device, 0, "expired");
        idx.record(ReplicaIdx::new(0), &h(&[1, 2]), 0, t + Duration::from_secs(11));
        assert_eq!(idx.find_matches(&h(&[1, 2]), 1, t + Duration::from_secs(12))[0].device, 2, "refreshed");
        idx.record(ReplicaIdx::new(0), &h(&[5, 6]), 0, t + Duration::from_secs(12));
        assert_eq!(idx.len(), 2, "the least recently routed run went, whole");
        assert_eq!(idx.find_matches(&h(&[1, 2]), 1, t + Duration::from_secs(12))[0].device, 0);
    }

    #[test]
    fn blocks_recorded_again_and_again_stay_within_the_bound() {
        let mut idx = ApproxIndex::new(6, Duration::from_secs(60));
        let t = Instant::now();
        for i in 0..1000u64 {
            idx.record(ReplicaIdx::new((i % 3) as usize), &h(&[1, 2]), 0, t + Duration::from_millis(i));
        }
        assert_eq!(idx.len(), 6, "two blocks on each of three replicas");
        assert_eq!(idx.runs.len(), 3, "each replica's record refreshed, not repeated");
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
        idx.record(ReplicaIdx::new(63), &h(&[1, 2]), 0, t);
        idx.record(ReplicaIdx::new(64), &h(&[1, 2, 3]), 0, t);
        idx.record(ReplicaIdx::new(129), &h(&[1]), 0, t);
        idx.record(ReplicaIdx::new(200), &h(&[1, 2, 3]), 0, t);
        let o = idx.find_matches(&h(&[1, 2, 3, 4]), 130, t);
        assert_eq!(o.len(), 130, "one per replica asked about; 200 is not one of them");
        let held: Vec<_> = o.iter().enumerate().filter(|(_, o)| o.device > 0).map(|(r, o)| (r, o.device)).collect();
        assert_eq!(held, [(63, 2), (64, 3), (129, 1)]);
    }

    #[test]
    fn a_long_record_is_one_run_found_from_any_depth() {
        let mut idx = ApproxIndex::new(10_000, Duration::from_secs(60));
        let t = Instant::now();
        let prompt: Vec<u64> = (1..=1000).collect();
        idx.record(ReplicaIdx::new(0), &h(&prompt), 0, t);
        assert_eq!(idx.table.len(), 63, "its first block and every 16th after it");
        let device = |o: Vec<Overlap>| o.iter().map(|o| o.device).collect::<Vec<_>>();
        for held in [0, 1, 15, 16, 17, 500, 999, 1000] {
            assert_eq!(device(idx.find_matches_past(&h(&prompt), &[held], t)), [1000], "events hold {held}");
        }
        let mut other = prompt.clone();
        other[700] = 5000;
        assert_eq!(device(idx.find_matches(&h(&other), 1, t)), [700], "to where the prompts part");
    }

    #[test]
    fn a_record_refreshes_only_the_blocks_it_sent() {
        let mut idx = ApproxIndex::new(100, Duration::from_secs(10));
        let t = Instant::now();
        let prompt: Vec<u64> = (1..=40).collect();
        idx.record(ReplicaIdx::new(0), &h(&prompt), 0, t);
        idx.record(ReplicaIdx::new(0), &h(&prompt[..20]), 5, t + Duration::from_secs(5));
        let at = |secs| t + Duration::from_secs(secs);
        let device = |o: Vec<Overlap>| o.iter().map(|o| o.device).collect::<Vec<_>>();
        assert_eq!(device(idx.find_matches(&h(&prompt), 1, at(9))), [40]);
        assert_eq!(device(idx.find_matches_past(&h(&prompt), &[5], at(12))), [20], "blocks 5..20 were sent again");
        assert_eq!(device(idx.find_matches(&h(&prompt), 1, at(12))), [0], "block 0 was not");
        assert_eq!(idx.len(), 40, "split, not copied");
    }

    proptest! {
        /// The overlap is, by definition, the leading prompt blocks that the replica's events
        /// hold or whose latest record on the replica is fresh: the walk over runs agrees with
        /// that on any records and event overlaps, over prompts longer than the table's stride.
        #[test]
        fn overlaps_match_their_definition(
            records in prop::collection::vec((0u32..130, 0usize..60, 1usize..60, 0u64..20), 0..40),
            held in prop::collection::vec(0u32..64, 130),
            prompt_len in 0usize..60,
        ) {
            let (ttl, start) = (Duration::from_secs(10), Instant::now());
            let mut idx = ApproxIndex::new(100_000, ttl);
            let mut latest: std::collections::HashMap<(u32, u64), u64> = Default::default();
            let mut records = records;
            records.sort_by_key(|r| r.3);
            for (replica, from, to, secs) in records {
                let prompt: Vec<u64> = (1..=to as u64).collect();
                let from = from.min(to);
                idx.record(ReplicaIdx::new(replica as usize), &h(&prompt), from, start + Duration::from_secs(secs));
                for &b in &prompt[from..] {
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
