//! Property test: random stores, removes, clears and replica removals, applied in batches to
//! both copies of the index (as the pool keeps it) and to a naive reference model, give
//! identical `find_matches` for every query, on either copy.

use std::collections::HashMap;

use kvgate_shared::hash::{local_block_hash, next_sequence_hash, prompt_block_hashes, EngineHash, Salt, SequenceHash};
use kvgate_sidecar::index::mirror::Batch;
use kvgate_sidecar::index::{Change, KvIndex, Mirrored, Overlap, ReplicaIdx, Store, StoredBlocks, Tier, Write};
use proptest::prelude::*;

const BS: usize = 2;
const REPLICAS: usize = 3;
/// The index's replica number of each of the model's replicas: two share a word of the
/// lookup's replica bitset, and the pool is large enough for that bitset to live on the heap.
const IDS: [usize; REPLICAS] = [0, 63, 1100];

/// Chains over a tiny alphabet so prompts share prefixes a lot.
fn block_tokens(symbol: u8) -> Vec<u32> {
    vec![u32::from(symbol); BS]
}

#[derive(Debug, Clone)]
enum Op {
    /// Store the chain `path` on a replica: the first `skip` blocks are assumed present
    /// (parent link), the rest are new.
    Store {
        replica: usize,
        tier: usize,
        path: Vec<u8>,
        skip: usize,
    },
    /// Remove blocks, in order, in one call (by the engine hashes of the chains `paths`).
    Remove {
        replica: usize,
        tier: usize,
        paths: Vec<Vec<u8>>,
    },
    /// Remove blocks the replica holds on a tier (the `picks`-th of them, modulo their
    /// number, in one call), as an engine evicts: slots die in the middle of chains, and
    /// arenas fill with removed slots until they are compacted.
    Evict {
        replica: usize,
        tier: usize,
        picks: Vec<usize>,
    },
    Clear {
        replica: usize,
    },
}

fn seq_of(path: &[u8]) -> SequenceHash {
    path.iter()
        .fold(None, |parent, s| Some(next_sequence_hash(parent, local_block_hash(&block_tokens(*s), Salt::NONE))))
        .unwrap()
}

/// Engines hash content too, just differently: engine hash = f(seq).
fn engine_of(path: &[u8]) -> EngineHash {
    EngineHash(seq_of(path).0.rotate_left(17) ^ 0x9e37_79b9_7f4a_7c15)
}

fn tier(i: usize) -> Tier {
    Tier::ALL[i]
}

/// The reference: a flat multiset of (replica, tier, engine hash, seq hash).
#[derive(Default)]
struct Model {
    entries: HashMap<(usize, usize, EngineHash), (SequenceHash, u32)>,
}

impl Model {
    fn lookup(&self, replica: usize, engine: EngineHash) -> Option<SequenceHash> {
        (0..3).find_map(|t| self.entries.get(&(replica, t, engine)).map(|(s, _)| *s))
    }

    fn holds(&self, replica: usize, t: usize, seq: SequenceHash) -> bool {
        self.entries.iter().any(|((r, tt, _), (s, _))| *r == replica && *tt == t && *s == seq)
    }

    fn matches(&self, hashes: &[SequenceHash]) -> Vec<Overlap> {
        (0..REPLICAS)
            .map(|r| {
                let device = hashes.iter().take_while(|h| self.holds(r, 0, **h)).count();
                let host = hashes[device..].iter().take_while(|h| self.holds(r, 1, **h)).count();
                let disk = hashes[device + host..].iter().take_while(|h| self.holds(r, 2, **h)).count();
                Overlap { device: device as u32, host: host as u32, disk: disk as u32 }
            })
            .collect()
    }
}

fn op() -> impl Strategy<Value = Op> {
    let path = prop::collection::vec(0u8..3, 1..6);
    prop_oneof![
        6 => (0..REPLICAS, 0usize..3, path.clone(), 0usize..6).prop_map(|(replica, tier, path, skip)| {
            let skip = skip.min(path.len() - 1);
            Op::Store { replica, tier, path, skip }
        }),
        3 => (0..REPLICAS, 0usize..3, prop::collection::vec(path, 1..4)).prop_map(|(replica, tier, paths)| Op::Remove { replica, tier, paths }),
        3 => (0..REPLICAS, 0usize..3, prop::collection::vec(0usize..64, 1..8)).prop_map(|(replica, tier, picks)| Op::Evict { replica, tier, picks }),
        1 => (0..REPLICAS).prop_map(|replica| Op::Clear { replica }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]
    #[test]
    fn index_agrees_with_the_reference(ops in prop::collection::vec(op(), 1..60), per_batch in 1usize..4, queries in prop::collection::vec(prop::collection::vec(0u8..3, 1..7), 1..8)) {
        // Both copies of the pool's index go through every write, in batches.
        let index = Mirrored::new(KvIndex::new(BS, IDS[REPLICAS - 1] + 1));
        let mut model = Model::default();
        for ops in ops.chunks(per_batch) {
            let mut batch = index.write();
            for op in ops.iter().cloned() {
                match op {
                    Op::Store { replica, tier: t, path, skip } => {
                        let parent = (skip > 0).then(|| engine_of(&path[..skip]));
                        let new = &path[skip..];
                        let engine_hashes: Vec<EngineHash> = (skip..path.len()).map(|i| engine_of(&path[..=i])).collect();
                        let tokens: Vec<u32> = new.iter().flat_map(|s| block_tokens(*s)).collect();
                        let store = Store { parent, engine_hashes: &engine_hashes, token_ids: &tokens, block_size: BS, salt: Salt::NONE, extra: &[], tier: tier(t) };
                        let parent_known = parent.is_none_or(|p| model.lookup(replica, p).is_some());
                        let result = batch.apply(Write::Change(ReplicaIdx::new(IDS[replica]), Change::Store(StoredBlocks::from_store(store))));
                        prop_assert_eq!(result.is_ok(), parent_known);
                        if parent_known {
                            for i in skip..path.len() {
                                let e = model.entries.entry((replica, t, engine_of(&path[..=i]))).or_insert((seq_of(&path[..=i]), 0));
                                e.1 += 1;
                            }
                        }
                    }
                    Op::Remove { replica, tier: t, paths } => {
                        let engines: Vec<EngineHash> = paths.iter().map(|p| engine_of(p)).collect();
                        remove(&mut batch, &mut model, replica, t, engines);
                    }
                    Op::Evict { replica, tier: t, picks } => {
                        let mut held: Vec<EngineHash> = model.entries.keys().filter(|(r, tt, _)| *r == replica && *tt == t).map(|(_, _, e)| *e).collect();
                        held.sort_unstable();
                        if !held.is_empty() {
                            let engines = picks.iter().map(|p| held[p % held.len()]).collect();
                            remove(&mut batch, &mut model, replica, t, engines);
                        }
                    }
                    Op::Clear { replica } => {
                        batch.apply(Write::Change(ReplicaIdx::new(IDS[replica]), Change::Clear)).unwrap();
                        model.entries.retain(|(r, _, _), _| *r != replica);
                    }
                }
            }
        }
        // The live copy, then (an empty batch swaps them) the other one.
        for _copy in 0..2 {
            let copy = index.read();
            for q in &queries {
                let tokens: Vec<u32> = q.iter().flat_map(|s| block_tokens(*s)).collect();
                let hashes = prompt_block_hashes(&tokens, BS, Salt::NONE);
                let found = copy.find_matches(&hashes);
                prop_assert_eq!(IDS.map(|r| found[r]).to_vec(), model.matches(&hashes), "query {:?}", q);
                // One replica's walk alone holds what the walk of them all found for it.
                for id in IDS {
                    prop_assert_eq!(copy.device_held(ReplicaIdx::new(id), &hashes), found[id].device as usize);
                }
            }
            for (r, id) in IDS.iter().enumerate() {
                prop_assert_eq!(copy.replica_blocks(ReplicaIdx::new(*id)), model.entries.keys().filter(|(rr, _, _)| *rr == r).count());
            }
            drop(copy);
            drop(index.write());
        }
        // A peer restored from this index's export (the handover to a starting sidecar)
        // agrees with the model too, and every block leaves it after as many removals as
        // were stored.
        let mut restored = KvIndex::new(BS, IDS[REPLICAS - 1] + 1);
        {
            let mut live = index.write();
            for id in IDS {
                live.apply(Write::Change(ReplicaIdx::new(id), Change::Mark(Some(7)))).unwrap();
            }
            drop(live);
            let copy = index.read();
            for id in IDS {
                let snapshot = copy.export(ReplicaIdx::new(id)).expect("marked");
                prop_assert_eq!(snapshot.through_seq, 7);
                restored.restore(ReplicaIdx::new(id), &snapshot);
            }
        }
        for q in &queries {
            let tokens: Vec<u32> = q.iter().flat_map(|s| block_tokens(*s)).collect();
            let hashes = prompt_block_hashes(&tokens, BS, Salt::NONE);
            let found = restored.find_matches(&hashes);
            prop_assert_eq!(IDS.map(|r| found[r]).to_vec(), model.matches(&hashes), "restored, query {:?}", q);
        }
        // Every block survives all but its last removal (its extra references came along)…
        for ((replica, t, engine), (_, stored)) in &model.entries {
            for _ in 1..*stored {
                restored.remove(ReplicaIdx::new(IDS[*replica]), tier(*t), &[*engine]);
            }
        }
        for (r, id) in IDS.iter().enumerate() {
            let held = model.entries.keys().filter(|(rr, _, _)| *rr == r).count();
            prop_assert_eq!(restored.replica_blocks(ReplicaIdx::new(*id)), held);
        }
        // …and leaves with it.
        for (replica, t, engine) in model.entries.keys() {
            restored.remove(ReplicaIdx::new(IDS[*replica]), tier(*t), &[*engine]);
        }
        for id in IDS {
            prop_assert_eq!(restored.replica_blocks(ReplicaIdx::new(id)), 0);
        }
    }
}

/// Removes `engines` of a replica's tier from the index and the model.
fn remove(batch: &mut Batch<'_, KvIndex>, model: &mut Model, replica: usize, t: usize, engines: Vec<EngineHash>) {
    let change = Change::Remove { tier: tier(t), engine_hashes: engines.clone() };
    batch.apply(Write::Change(ReplicaIdx::new(IDS[replica]), change)).expect("removals are never refused");
    for engine in engines {
        if let Some(e) = model.entries.get_mut(&(replica, t, engine)) {
            e.1 -= 1;
            if e.1 == 0 {
                model.entries.remove(&(replica, t, engine));
            }
        }
    }
}
