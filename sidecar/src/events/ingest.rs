//! One replica's event stream → the index changes it implies: sequence tracking, replay of
//! gaps, and the conversion of decoded events into [`Change`]s. No sockets and no index here:
//! [`Ingest::on_message`] runs with no lock held (decoding and replay take as long as they
//! take), and the pool's applier ([`super::apply`]) applies the changes in bounded
//! batches. Every rule is unit-tested.
//!
//! Sequence rules, per replica:
//! - **first message**: replay from 0 if a replay endpoint is configured (rebuilds the state
//!   after a sidecar restart). Whatever older history the engine no longer buffers is simply
//!   unknown: missing stores only lose credit, they never give stale credit.
//! - **seq = last + 1**: apply.
//! - **gap**: replay the missing range. If any of it cannot be had (or a payload cannot be
//!   decoded), a removal may have been lost, so every block indexed so far might be stale: they
//!   are dropped, and the replica is marked **degraded** until the engine clears its cache.
//!   It keeps its load-based candidacy and earns credit again for blocks stored after the loss.
//! - **seq ≤ last**: the engine restarted with an empty cache: clear the replica at once, then
//!   treat the message as a first message.
//! - **resumed** from a peer's snapshot (`Ingest::resume`): the snapshot's sequence number is
//!   the last; a gap to the first message that cannot be replayed clears the replica and
//!   rebuilds it as at first contact (the snapshot may hold removed blocks; nothing is
//!   degraded, as nothing this sidecar saw was lost).
//!
//! Event rules: the tier comes from `medium` (unknown media are dropped), `locality: REMOTE`
//! is dropped, only the main full-attention KV group is indexed, LoRA names and extra keys
//! salt the hashes, and partial-block entries are ignored.

use std::collections::HashMap;

use kvgate_shared::hash::{EngineHash, ExtraKey, Salt};

use super::decode::{decode_batch, BlockStored, KvEvent};
use crate::index::{Change, KvIndex, ReplicaIdx, StoredBlocks, Tier};
use crate::msg::ingest::{Outcome, Progress};

/// Applies `changes` to `replica`'s entries in order; returns the reasons of refused stores.
pub fn apply(replica: ReplicaIdx, changes: &[Change], index: &mut KvIndex) -> Vec<&'static str> {
    changes.iter().filter_map(|c| c.apply(replica, index).err().map(|e| e.label())).collect()
}

/// One message's changes, in order, and what happened to it.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Planned {
    /// The index changes, to apply in order.
    pub changes: Vec<Change>,
    /// For metrics; stores the index refuses are counted when applied ([`Outcome::refused`]).
    pub outcome: Outcome,
}

/// A source of past messages (the engine's replay socket). `Ok` holds the messages it had,
/// in order, from `start` on.
pub trait Replay {
    /// Fetches buffered `(seq, payload)` messages with `seq >= start`.
    fn replay(&mut self, start: u64) -> Result<Vec<(u64, Vec<u8>)>, String>;
}

/// No replay endpoint configured.
pub struct NoReplay;

impl Replay for NoReplay {
    fn replay(&mut self, _start: u64) -> Result<Vec<(u64, Vec<u8>)>, String> {
        Err("no replay endpoint".into())
    }
}

/// The ingestion state of one replica.
#[derive(Debug)]
pub struct Ingest {
    block_size: usize,
    last_seq: Option<u64>,
    degraded: bool,
    /// Restored from a peer's snapshot and no message seen since: if the gap to the first
    /// one cannot be replayed, the stream starts over as at first contact (not degraded).
    resumed: bool,
    /// Learned `kv_cache_spec_kind` per KV group.
    group_kinds: HashMap<i64, String>,
}

fn is_full_attention(kind: &str) -> bool {
    matches!(kind, "full_attention" | "mla_attention")
}

impl Ingest {
    /// A replica seen for the first time, in a pool of `block_size`.
    pub fn new(block_size: usize) -> Ingest {
        Ingest { block_size, last_seq: None, degraded: false, resumed: false, group_kinds: HashMap::new() }
    }

    /// A replica whose entries were restored from a peer's snapshot through `seq`: its
    /// stream goes on from `seq + 1` (a gap before the next message is replayed as usual, and
    /// if it cannot be, the replica starts over as at first contact; an earlier sequence
    /// number means the engine restarted since, and clears it).
    pub fn resume(block_size: usize, seq: u64) -> Ingest {
        Ingest { last_seq: Some(seq), resumed: true, ..Ingest::new(block_size) }
    }

    /// Whether a lost range may have left stale blocks in the index.
    pub fn degraded(&self) -> bool {
        self.degraded
    }

    /// The last sequence number applied.
    pub fn last_seq(&self) -> Option<u64> {
        self.last_seq
    }

    /// The state health reports.
    pub fn progress(&self) -> Progress {
        Progress { last_seq: self.last_seq, degraded: self.degraded }
    }

    /// Handles one message received live: the changes it implies, replayed gaps included.
    pub fn on_message(&mut self, seq: u64, payload: &[u8], replay: &mut dyn Replay) -> Planned {
        let mut planned = Planned::default();
        let (changes, out) = (&mut planned.changes, &mut planned.outcome);
        if let Some(last) = self.last_seq {
            if seq <= last {
                changes.push(Change::Clear);
                self.last_seq = None;
                self.degraded = false;
                out.cleared = true;
            }
        }
        match self.last_seq {
            None => self.rebuild(seq, replay, changes, out),
            Some(last) if seq > last + 1 => {
                let missing = last + 1..seq;
                let got = replay.replay(missing.start).unwrap_or_default();
                let mut expected = missing.start;
                for (s, p) in got.into_iter().filter(|(s, _)| missing.contains(s)) {
                    if s != expected {
                        break;
                    }
                    self.apply_payload(s, &p, changes, out);
                    expected += 1;
                }
                if expected == missing.end {
                    out.gaps_replayed += 1;
                } else if self.resumed {
                    // A peer's snapshot older than the engine's buffer: start over as at first
                    // contact, with nothing of the snapshot kept (it may hold removed blocks).
                    changes.push(Change::Clear);
                    out.cleared = true;
                    self.rebuild(seq, replay, changes, out);
                } else {
                    out.gaps_lost += 1;
                    self.lose(changes, &mut out.cleared);
                }
            }
            Some(_) => {}
        }
        self.resumed = false;
        self.apply_payload(seq, payload, changes, out);
        planned
    }

    /// First contact: rebuilds from whatever the engine still buffers before `seq`.
    fn rebuild(&mut self, seq: u64, replay: &mut dyn Replay, changes: &mut Vec<Change>, out: &mut Outcome) {
        if seq > 0 {
            if let Ok(messages) = replay.replay(0) {
                for (s, p) in messages.into_iter().filter(|(s, _)| *s < seq) {
                    self.apply_payload(s, &p, changes, out);
                }
            }
        }
    }

    /// Events were lost: what is indexed may be stale. Forget it and say so.
    fn lose(&mut self, changes: &mut Vec<Change>, cleared: &mut bool) {
        changes.push(Change::Clear);
        self.degraded = true;
        *cleared = true;
    }

    fn apply_payload(&mut self, seq: u64, payload: &[u8], changes: &mut Vec<Change>, out: &mut Outcome) {
        self.last_seq = Some(seq);
        let batch = match decode_batch(payload) {
            Ok(b) => b,
            Err(_) => {
                out.dropped.push("decode");
                self.lose(changes, &mut out.cleared);
                return;
            }
        };
        out.published = Some(batch.ts);
        // Consecutive removals on one tier become one change. Anything else ends the run, so
        // events still take effect in order.
        let mut removals: Option<(Tier, Vec<EngineHash>)> = None;
        let end_run = |removals: &mut Option<(Tier, Vec<EngineHash>)>, changes: &mut Vec<Change>| {
            if let Some((tier, engine_hashes)) = removals.take() {
                changes.push(Change::Remove { tier, engine_hashes });
            }
        };
        for event in batch.events {
            match event {
                KvEvent::BlockRemoved(r) => {
                    let Some(tier) = Tier::from_medium(r.medium.as_deref()) else {
                        out.dropped.push("unknown_medium");
                        continue;
                    };
                    if !self.main_group(r.group_idx, None) {
                        out.dropped.push("other_kv_group");
                        continue;
                    }
                    match &mut removals {
                        Some((run_tier, hashes)) if *run_tier == tier => hashes.extend(r.block_hashes),
                        _ => {
                            end_run(&mut removals, changes);
                            removals = Some((tier, r.block_hashes));
                        }
                    }
                    out.applied += 1;
                }
                KvEvent::BlockStored(s) => {
                    end_run(&mut removals, changes);
                    match self.store(s) {
                        Ok(stored) => {
                            changes.push(Change::Store(stored));
                            out.applied += 1;
                        }
                        Err(reason) => out.dropped.push(reason),
                    }
                }
                KvEvent::AllBlocksCleared => {
                    end_run(&mut removals, changes);
                    changes.push(Change::Clear);
                    self.degraded = false;
                    out.cleared = true;
                    out.applied += 1;
                }
            }
        }
        end_run(&mut removals, changes);
    }

    /// Whether events of KV group `group` belong to the main full-attention group. Kinds are
    /// learned from `BlockStored`; a group of unknown kind is accepted only if it is group 0.
    fn main_group(&mut self, group: Option<i64>, kind: Option<&str>) -> bool {
        let Some(g) = group else { return true };
        if let Some(k) = kind {
            self.group_kinds.insert(g, k.to_owned());
        }
        match self.group_kinds.get(&g) {
            None => g == 0,
            Some(k) if !is_full_attention(k) => false,
            Some(_) => {
                let first_full = self.group_kinds.iter().filter(|(_, k)| is_full_attention(k)).map(|(g, _)| *g).min();
                first_full == Some(g)
            }
        }
    }

    fn store(&mut self, s: BlockStored) -> Result<StoredBlocks, &'static str> {
        let tier = Tier::from_medium(s.medium.as_deref()).ok_or("unknown_medium")?;
        if s.locality.as_deref().is_some_and(|l| !l.eq_ignore_ascii_case("LOCAL")) {
            return Err("remote_locality");
        }
        if !self.main_group(s.group_idx, s.kv_cache_spec_kind.as_deref()) {
            return Err("other_kv_group");
        }
        if s.token_ids.is_empty() || s.block_size == 0 {
            return Err("no_tokens");
        }
        if s.block_hashes.len() == 1 && s.token_ids.len() < self.block_size && (s.block_size as usize) < self.block_size
        {
            return Err("partial_block");
        }
        let salt = match (&s.lora_name, s.lora_id) {
            (Some(name), _) => Salt::for_lora(Some(name)),
            (None, Some(id)) => Salt::for_lora(Some(&format!("lora-id:{id}"))),
            (None, None) => Salt::NONE,
        };
        let extra = extra_salts(&s);
        Ok(StoredBlocks {
            parent: s.parent_block_hash,
            engine_hashes: s.block_hashes,
            token_ids: s.token_ids,
            block_size: s.block_size as usize,
            salt,
            extra,
            tier,
        })
    }
}

/// Per-block salts from vLLM's `extra_keys` (minus the LoRA name, which is the base salt)
/// and SGLang's `cache_salt` (on the prompt's first block).
fn extra_salts(s: &BlockStored) -> Vec<Salt> {
    let mut salts: Vec<Salt> = match &s.extra_keys {
        Some(per_block) => per_block
            .iter()
            .map(|keys| {
                let keys: Vec<ExtraKey> = keys
                    .iter()
                    .flatten()
                    .filter(|k| !matches!((k, &s.lora_name), (ExtraKey::Str(a), Some(b)) if a == b))
                    .cloned()
                    .collect();
                Salt::for_extra_keys(&keys)
            })
            .collect(),
        None => Vec::new(),
    };
    if let (Some(salt), None) = (&s.cache_salt, s.parent_block_hash) {
        let cache = Salt::for_extra_keys(&[ExtraKey::Str(salt.clone())]);
        match salts.first_mut() {
            Some(first) => *first = first.combine(cache),
            None => salts.push(cache),
        }
    }
    salts
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_shared::hash::prompt_block_hashes;
    use rmp::encode as mp;

    /// A map-format batch with one BlockStored (optionally more keys) — enough to drive the
    /// state machine.
    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], extra: &[(&str, &str)]) -> Vec<u8> {
        batch(&[stored_event(hashes, parent, tokens, extra)])
    }

    /// A map-format batch of encoded events.
    fn batch(events: &[Vec<u8>]) -> Vec<u8> {
        let mut b = Vec::new();
        mp::write_array_len(&mut b, 3).unwrap();
        mp::write_f64(&mut b, 1.0).unwrap();
        mp::write_array_len(&mut b, events.len() as u32).unwrap();
        for e in events {
            b.extend_from_slice(e);
        }
        mp::write_uint(&mut b, 0).unwrap();
        b
    }

    /// An event map of `keys` entries, its first two written: `type` and `block_hashes`.
    fn event_head(keys: u32, kind: &str, hashes: &[u64]) -> Vec<u8> {
        let mut b = Vec::new();
        mp::write_map_len(&mut b, keys).unwrap();
        mp::write_str(&mut b, "type").unwrap();
        mp::write_str(&mut b, kind).unwrap();
        mp::write_str(&mut b, "block_hashes").unwrap();
        mp::write_array_len(&mut b, hashes.len() as u32).unwrap();
        for h in hashes {
            mp::write_uint(&mut b, *h).unwrap();
        }
        b
    }

    /// A BlockRemoved event, map format.
    fn removed_event(hashes: &[u64], medium: &str) -> Vec<u8> {
        let mut b = event_head(3, "BlockRemoved", hashes);
        mp::write_str(&mut b, "medium").unwrap();
        mp::write_str(&mut b, medium).unwrap();
        b
    }

    /// A BlockStored event, map format, with optional extra keys.
    fn stored_event(hashes: &[u64], parent: Option<u64>, tokens: &[u32], extra: &[(&str, &str)]) -> Vec<u8> {
        let own_medium = extra.iter().any(|(k, _)| *k == "medium");
        let mut b = event_head(6 + u32::from(!own_medium) + extra.len() as u32, "BlockStored", hashes);
        mp::write_str(&mut b, "parent_block_hash").unwrap();
        match parent {
            Some(p) => drop(mp::write_uint(&mut b, p).unwrap()),
            None => mp::write_nil(&mut b).unwrap(),
        }
        mp::write_str(&mut b, "token_ids").unwrap();
        mp::write_array_len(&mut b, tokens.len() as u32).unwrap();
        for t in tokens {
            mp::write_uint(&mut b, u64::from(*t)).unwrap();
        }
        mp::write_str(&mut b, "block_size").unwrap();
        mp::write_uint(&mut b, 4).unwrap();
        mp::write_str(&mut b, "lora_id").unwrap();
        mp::write_nil(&mut b).unwrap();
        if !own_medium {
            mp::write_str(&mut b, "medium").unwrap();
            mp::write_str(&mut b, "GPU").unwrap();
        }
        for (k, v) in extra {
            mp::write_str(&mut b, k).unwrap();
            mp::write_str(&mut b, v).unwrap();
        }
        b
    }

    fn cleared() -> Vec<u8> {
        let mut b = Vec::new();
        mp::write_array_len(&mut b, 3).unwrap();
        mp::write_f64(&mut b, 1.0).unwrap();
        mp::write_array_len(&mut b, 1).unwrap();
        mp::write_map_len(&mut b, 1).unwrap();
        mp::write_str(&mut b, "type").unwrap();
        mp::write_str(&mut b, "AllBlocksCleared").unwrap();
        mp::write_uint(&mut b, 0).unwrap();
        b
    }

    /// Plans one message and applies its changes, as the transport does.
    fn feed(ingest: &mut Ingest, seq: u64, payload: &[u8], index: &mut KvIndex, replay: &mut dyn Replay) -> Outcome {
        let Planned { changes, mut outcome } = ingest.on_message(seq, payload, replay);
        outcome.refused(apply(ReplicaIdx::new(0), &changes, index));
        outcome
    }

    /// A replay source holding some messages.
    struct Buffer(Vec<(u64, Vec<u8>)>);
    impl Replay for Buffer {
        fn replay(&mut self, start: u64) -> Result<Vec<(u64, Vec<u8>)>, String> {
            Ok(self.0.iter().filter(|(s, _)| *s >= start).cloned().collect())
        }
    }

    fn toks(block: u32) -> Vec<u32> {
        (block * 4..block * 4 + 4).collect()
    }

    fn depth(index: &KvIndex, blocks: u32) -> u32 {
        let tokens: Vec<u32> = (0..blocks).flat_map(toks).collect();
        index.find_matches(&prompt_block_hashes(&tokens, 4, Salt::NONE))[0].device
    }

    #[test]
    fn gap_is_replayed() {
        let mut index = KvIndex::new(4, 1);
        let mut ingest = Ingest::new(4);
        let m: Vec<Vec<u8>> =
            (0..3).map(|i| stored(&[i as u64 + 1], (i > 0).then_some(i as u64), &toks(i), &[])).collect();
        feed(&mut ingest, 0, &m[0], &mut index, &mut NoReplay);
        let mut buffer = Buffer(vec![(1, m[1].clone())]);
        let out = feed(&mut ingest, 2, &m[2], &mut index, &mut buffer);
        assert_eq!((out.gaps_replayed, out.gaps_lost, out.applied), (1, 0, 2));
        assert_eq!(depth(&index, 3), 3);
        assert!(!ingest.degraded());
    }

    #[test]
    fn a_resumed_stream_replays_only_what_came_after_its_snapshot() {
        // A peer's snapshot holds blocks 0 and 1 (messages 0 and 1); the engine has since
        // published message 2, and buffers all three.
        let m: Vec<Vec<u8>> =
            (0..4).map(|i| stored(&[i as u64 + 1], (i > 0).then_some(i as u64), &toks(i), &[])).collect();
        let mut source = KvIndex::new(4, 1);
        let mut ingest = Ingest::new(4);
        feed(&mut ingest, 0, &m[0], &mut source, &mut NoReplay);
        feed(&mut ingest, 1, &m[1], &mut source, &mut NoReplay);
        source.mark_applied(ReplicaIdx::new(0), ingest.last_seq());
        let snapshot = source.export(ReplicaIdx::new(0)).unwrap();

        let mut index = KvIndex::new(4, 1);
        index.restore(ReplicaIdx::new(0), &snapshot);
        let mut resumed = Ingest::resume(4, snapshot.through_seq);
        let mut buffer = Buffer((0..3).map(|s| (s, m[s as usize].clone())).collect());
        let out = feed(&mut resumed, 3, &m[3], &mut index, &mut buffer);
        assert_eq!((out.gaps_replayed, out.applied, out.cleared), (1, 2, false), "message 2 replayed, then 3");
        assert_eq!(depth(&index, 4), 4);
        assert!(!resumed.degraded());

        // A snapshot older than the engine's buffer (only 2 and 3 kept): the replica starts
        // over from what the buffer holds, not degraded.
        let mut resumed = Ingest::resume(4, 0);
        let mut short = Buffer((2..4).map(|s| (s, m[s as usize].clone())).collect());
        let mut stale = KvIndex::new(4, 1);
        stale.restore(ReplicaIdx::new(0), &snapshot);
        let out = feed(&mut resumed, 4, &stored(&[9], None, &toks(9), &[]), &mut stale, &mut short);
        assert!(out.cleared && out.gaps_lost == 0 && !resumed.degraded());
        assert_eq!(depth(&stale, 1), 0, "the snapshot's blocks are gone");

        // An engine that restarted since the snapshot starts its sequence again: cleared.
        let mut resumed = Ingest::resume(4, snapshot.through_seq);
        let out = feed(&mut resumed, 0, &m[0], &mut index, &mut NoReplay);
        assert!(out.cleared);
        assert_eq!(depth(&index, 2), 1);
    }

    #[test]
    fn unrecoverable_gap_drops_possibly_stale_blocks_and_degrades_until_cleared() {
        let mut index = KvIndex::new(4, 1);
        let mut ingest = Ingest::new(4);
        feed(&mut ingest, 0, &stored(&[1], None, &toks(0), &[]), &mut index, &mut NoReplay);
        let out = feed(&mut ingest, 5, &stored(&[9], None, &toks(9), &[]), &mut index, &mut NoReplay);
        assert_eq!(out.gaps_lost, 1);
        assert!(ingest.degraded());
        assert_eq!(depth(&index, 1), 0, "a removal of block 0 may have been lost: it earns no credit");
        let after: Vec<u32> = toks(9);
        assert_eq!(
            index.find_matches(&prompt_block_hashes(&after, 4, Salt::NONE))[0].device,
            1,
            "blocks stored after the loss count"
        );
        let out = feed(&mut ingest, 6, &cleared(), &mut index, &mut NoReplay);
        assert!(out.cleared && !ingest.degraded());
    }

    #[test]
    fn restart_clears_and_first_contact_replays() {
        let mut index = KvIndex::new(4, 1);
        let mut ingest = Ingest::new(4);
        let mut buffer =
            Buffer(vec![(0, stored(&[1], None, &toks(0), &[])), (1, stored(&[2], Some(1), &toks(1), &[]))]);
        // First contact at seq 2: seqs 0 and 1 come from the replay buffer.
        let out = feed(&mut ingest, 2, &stored(&[3], Some(2), &toks(2), &[]), &mut index, &mut buffer);
        assert_eq!(out.applied, 3);
        assert_eq!(depth(&index, 3), 3);
        // The engine restarts: seq back to 0, cache empty.
        let out = feed(&mut ingest, 0, &stored(&[7], None, &toks(7), &[]), &mut index, &mut NoReplay);
        assert!(out.cleared);
        assert_eq!(depth(&index, 1), 0);
        assert_eq!(ingest.last_seq(), Some(0));
    }

    #[test]
    fn garbage_is_counted_not_fatal() {
        let mut index = KvIndex::new(4, 1);
        let mut ingest = Ingest::new(4);
        feed(&mut ingest, 0, &stored(&[1], None, &toks(0), &[]), &mut index, &mut NoReplay);
        let out = feed(&mut ingest, 1, b"\xc1garbage", &mut index, &mut NoReplay);
        assert_eq!(out.dropped, vec!["decode"]);
        assert!(ingest.degraded(), "an undecodable batch may have held a removal");
        assert_eq!(depth(&index, 1), 0);
        let out = feed(&mut ingest, 2, &stored(&[1], None, &toks(0), &[]), &mut index, &mut NoReplay);
        assert_eq!(out.applied, 1);
        assert_eq!(depth(&index, 1), 1);
    }

    #[test]
    fn salts_and_tiers_and_locality() {
        let mut index = KvIndex::new(4, 1);
        let mut ingest = Ingest::new(4);
        let out =
            feed(&mut ingest, 0, &stored(&[1], None, &toks(0), &[("cache_salt", "tenant")]), &mut index, &mut NoReplay);
        assert_eq!(out.applied, 1);
        assert_eq!(depth(&index, 1), 0, "a salted block never matches an unsalted prompt");
        let tenant = [Salt::for_extra_keys(&["tenant".into()])];
        let h =
            kvgate_shared::hash::next_sequence_hash(None, kvgate_shared::hash::local_block_hash(&toks(0), tenant[0]));
        assert_eq!(index.find_matches(&[h])[0].device, 1, "but matches the same salt");
        let out =
            feed(&mut ingest, 1, &stored(&[2], None, &toks(1), &[("locality", "REMOTE")]), &mut index, &mut NoReplay);
        assert_eq!(out.dropped, vec!["remote_locality"]);
        let out = feed(&mut ingest, 2, &stored(&[3], None, &toks(2), &[("medium", "tape")]), &mut index, &mut NoReplay);
        assert_eq!(out.dropped, vec!["unknown_medium"]);
    }

    #[test]
    fn a_batch_applies_in_order_with_removal_runs_batched() {
        let mut index = KvIndex::new(4, 1);
        let mut ingest = Ingest::new(4);
        let host = [("medium", "CPU")];
        let events = [
            stored_event(&[1, 2, 3], None, &(0..3).flat_map(toks).collect::<Vec<_>>(), &[]),
            stored_event(&[1], None, &toks(0), &host),
            // A run of removals, the last one of another tier; the stores after it see it
            // applied: block 2 is no parent any more, and can be stored again.
            removed_event(&[3], "GPU"),
            removed_event(&[2, 99], "GPU"),
            removed_event(&[1], "CPU"),
            stored_event(&[4], Some(2), &toks(2), &[]),
            stored_event(&[2], Some(1), &toks(1), &[]),
            removed_event(&[1], "tape"),
        ];
        let out = feed(&mut ingest, 0, &batch(&events), &mut index, &mut NoReplay);
        // What decoding drops is counted first, what the index refuses when it is applied.
        assert_eq!((out.applied, out.dropped.clone()), (6, vec!["unknown_medium", "parent_unknown"]));
        assert_eq!(depth(&index, 3), 2, "block 3 removed, block 2 removed then stored again");
        assert_eq!(
            index.replica_tier_blocks(ReplicaIdx::new(0), Tier::Host),
            0,
            "the host-tier removal in the run applied"
        );
        let out = feed(
            &mut ingest,
            1,
            &batch(&[removed_event(&[2], "GPU"), removed_event(&[1], "GPU")]),
            &mut index,
            &mut NoReplay,
        );
        assert_eq!(out.applied, 2);
        assert_eq!(depth(&index, 1), 0, "a run that ends the batch is applied");
    }

    #[test]
    fn only_the_main_attention_group_is_indexed() {
        let mut ingest = Ingest::new(4);
        assert!(ingest.main_group(None, None));
        assert!(ingest.main_group(Some(0), None), "unknown kind: group 0 only");
        assert!(!ingest.main_group(Some(1), None));
        assert!(!ingest.main_group(Some(1), Some("sliding_window")));
        assert!(ingest.main_group(Some(2), Some("full_attention")));
        assert!(!ingest.main_group(Some(1), None), "learned kind sticks");
        assert!(!ingest.main_group(Some(3), Some("full_attention")), "only the first full-attention group");
    }
}
