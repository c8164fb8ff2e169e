//! Tests of `index`.

use super::*;
use kvgate_shared::hash::prompt_block_hashes;

fn tokens(n: u32) -> Vec<u32> {
    (100..100 + n).collect()
}

/// Engine hashes from plain numbers.
fn e(hashes: &[u64]) -> Vec<EngineHash> {
    hashes.iter().copied().map(EngineHash).collect()
}

/// A device-tier store of `hashes` after `parent` (the hashes live as long as the test).
fn store<'a>(parent: Option<u64>, hashes: &[u64], tokens: &'a [u32], bs: usize) -> Store<'a> {
    Store {
        parent: parent.map(EngineHash),
        engine_hashes: e(hashes).leak(),
        token_ids: tokens,
        block_size: bs,
        salt: Salt::NONE,
        extra: &[],
        tier: Tier::Device,
    }
}

fn devices(o: &[Overlap]) -> Vec<u32> {
    o.iter().map(|o| o.device).collect()
}

#[test]
fn stored_chain_matches_prompt_hashes() {
    let mut idx = KvIndex::new(4, 2);
    let t = tokens(12);
    idx.store(ReplicaIdx::new(1), store(None, &[11, 12], &t[..8], 4)).unwrap();
    idx.store(ReplicaIdx::new(1), store(Some(12), &[13], &t[8..12], 4)).unwrap();
    let prompt = prompt_block_hashes(&t, 4, Salt::NONE);
    assert_eq!(devices(&idx.find_matches(&prompt)), vec![0, 3]);
    let mut other = t.clone();
    other[5] = 1;
    assert_eq!(devices(&idx.find_matches(&prompt_block_hashes(&other, 4, Salt::NONE))), vec![0, 1]);
}

#[test]
fn rejects_what_would_be_misplaced() {
    let mut idx = KvIndex::new(4, 1);
    assert_eq!(idx.store(ReplicaIdx::new(0), store(Some(99), &[1], &tokens(4), 4)), Err(ApplyError::ParentUnknown));
    assert_eq!(idx.store(ReplicaIdx::new(0), store(None, &[1], &tokens(8), 8)), Err(ApplyError::BlockSizeMismatch));
    assert_eq!(idx.store(ReplicaIdx::new(0), store(None, &[1, 2], &tokens(4), 4)), Err(ApplyError::TokenCountMismatch));
    assert_eq!(idx.replica_blocks(ReplicaIdx::new(0)), 0);
}

#[test]
fn duplicate_stores_need_matching_removes() {
    let mut idx = KvIndex::new(4, 1);
    let prompt = prompt_block_hashes(&tokens(4), 4, Salt::NONE);
    idx.store(ReplicaIdx::new(0), store(None, &[7], &tokens(4), 4)).unwrap();
    idx.store(ReplicaIdx::new(0), store(None, &[7], &tokens(4), 4)).unwrap();
    idx.remove(ReplicaIdx::new(0), Tier::Device, &e(&[7]));
    assert_eq!(devices(&idx.find_matches(&prompt)), vec![1]);
    idx.remove(ReplicaIdx::new(0), Tier::Device, &e(&[7]));
    idx.remove(ReplicaIdx::new(0), Tier::Device, &e(&[7, 12345]));
    assert_eq!(devices(&idx.find_matches(&prompt)), vec![0]);
}

#[test]
fn clear_and_salt_isolation() {
    let mut idx = KvIndex::new(4, 3);
    let t = tokens(4);
    idx.store(ReplicaIdx::new(0), store(None, &[1], &t, 4)).unwrap();
    idx.store(ReplicaIdx::new(1), Store { salt: Salt::for_lora(Some("adapter")), ..store(None, &[1], &t, 4) }).unwrap();
    let tenant = [Salt::for_extra_keys(&["tenant-a".into()])];
    idx.store(ReplicaIdx::new(2), Store { extra: &tenant, ..store(None, &[1], &t, 4) }).unwrap();
    let base = prompt_block_hashes(&t, 4, Salt::NONE);
    assert_eq!(devices(&idx.find_matches(&base)), vec![1, 0, 0], "salted blocks never match plain ones");
    idx.clear_replica(ReplicaIdx::new(0));
    assert_eq!(devices(&idx.find_matches(&base)), vec![0, 0, 0]);
    assert_eq!(idx.replica_blocks(ReplicaIdx::new(1)), 1);
}

/// Every head of tier `t`, sorted: (sequence hash, replica, slot).
fn heads(idx: &KvIndex, t: usize) -> Vec<(SequenceHash, u32, u32)> {
    let mut v: Vec<_> = idx.heads[t].shards.iter().flat_map(|s| s.iter()).map(|h| (h.seq, h.replica, h.slot)).collect();
    v.sort_unstable();
    v
}

#[test]
fn chains_break_where_blocks_are_removed_and_heal_when_compacted() {
    let mut idx = KvIndex::new(4, 2);
    let t = tokens(24);
    let prompt = prompt_block_hashes(&t, 4, Salt::NONE);
    // Replica 0: blocks 0-3 in one event (one chain, one head), then 4-5 after block 3.
    idx.store(ReplicaIdx::new(0), store(None, &[1, 2, 3, 4], &t[..16], 4)).unwrap();
    idx.store(ReplicaIdx::new(0), store(Some(4), &[5, 6], &t[16..], 4)).unwrap();
    assert_eq!(heads(&idx, 0), [(prompt[0], 0, 0)], "block 4 continues the chain of block 3");
    // Replica 1 stores 0-1, then 0-2 again: block 2 follows block 1 of the second copy.
    idx.store(ReplicaIdx::new(1), store(None, &[1, 2], &t[..8], 4)).unwrap();
    idx.store(ReplicaIdx::new(1), store(Some(2), &[3], &t[8..12], 4)).unwrap();
    assert_eq!(devices(&idx.find_matches(&prompt)), vec![6, 3]);
    // Removing block 1 of replica 0 ends its chain there; block 2 heads the rest.
    idx.remove(ReplicaIdx::new(0), Tier::Device, &e(&[2]));
    assert_eq!(devices(&idx.find_matches(&prompt)), vec![1, 3]);
    assert!(heads(&idx, 0).contains(&(prompt[2], 0, 2)));
    // Storing block 1 again (at the end of the arena) makes 0-5 whole again, through heads.
    idx.store(ReplicaIdx::new(0), store(Some(1), &[2], &t[4..8], 4)).unwrap();
    assert_eq!(devices(&idx.find_matches(&prompt)), vec![6, 3]);
    // Remove blocks until removed slots outnumber live ones: the arena is compacted, and
    // the heads and engine entries follow their blocks.
    idx.remove(ReplicaIdx::new(0), Tier::Device, &e(&[5, 3, 6]));
    assert_eq!(idx.replicas[0].tiers[0].arena.seqs(), [prompt[0], prompt[3], prompt[1]]);
    assert_eq!(heads(&idx, 0), {
        let mut v = vec![(prompt[0], 0, 0), (prompt[3], 0, 1), (prompt[1], 0, 2), (prompt[0], 1, 0)];
        v.sort_unstable();
        v
    });
    assert_eq!(devices(&idx.find_matches(&prompt)), vec![2, 3]);
    idx.store(ReplicaIdx::new(0), store(Some(2), &[3], &t[8..12], 4)).unwrap();
    idx.store(ReplicaIdx::new(0), store(Some(4), &[5, 6], &t[16..], 4)).unwrap();
    assert_eq!(devices(&idx.find_matches(&prompt)), vec![6, 3]);
    idx.clear_replica(ReplicaIdx::new(0));
    idx.remove(ReplicaIdx::new(1), Tier::Device, &e(&[3, 2, 1]));
    assert_eq!(heads(&idx, 0), [], "nothing left behind");
    assert_eq!(idx.live, [0; 3]);
}

#[test]
fn a_replica_holding_a_block_twice_is_never_credited_with_more_than_it_holds() {
    // Two engine hashes for one content (engines hash content, so this takes an engine
    // bug): each copy is a block of its own.
    let mut idx = KvIndex::new(4, 1);
    let t = tokens(12);
    let prompt = prompt_block_hashes(&t, 4, Salt::NONE);
    idx.store(ReplicaIdx::new(0), store(None, &[1, 2], &t[..8], 4)).unwrap();
    idx.store(ReplicaIdx::new(0), store(None, &[7], &t[..4], 4)).unwrap();
    idx.store(ReplicaIdx::new(0), store(Some(7), &[8, 9], &t[4..], 4)).unwrap();
    assert_eq!(devices(&idx.find_matches(&prompt)), vec![3], "the longer chain of the two first blocks");
    idx.remove(ReplicaIdx::new(0), Tier::Device, &e(&[9, 1]));
    assert_eq!(devices(&idx.find_matches(&prompt)), vec![2], "the copies left still chain");
    idx.remove(ReplicaIdx::new(0), Tier::Device, &e(&[7]));
    assert_eq!(devices(&idx.find_matches(&prompt)), vec![0], "block 1 without block 0 is no match");
    // A second copy in the middle of a chain: the walk follows the first copy's chain,
    // so it may stop early, but it never credits a block the replica does not hold.
    let mut idx = KvIndex::new(4, 1);
    idx.store(ReplicaIdx::new(0), store(None, &[1, 2], &t[..8], 4)).unwrap();
    idx.store(ReplicaIdx::new(0), store(Some(1), &[8, 9], &t[4..], 4)).unwrap();
    assert!((2..=3).contains(&idx.find_matches(&prompt)[0].device));
    idx.remove(ReplicaIdx::new(0), Tier::Device, &e(&[2, 8]));
    assert_eq!(devices(&idx.find_matches(&prompt)), vec![1]);
    // Many replicas, each with several copies of the first block, heads interleaved:
    // every replica gets its own longest chain.
    let mut idx = KvIndex::new(4, 3);
    for (r, blocks) in [(2, 1), (0, 2), (1, 3), (2, 3), (0, 1), (1, 2)] {
        let first = 100 * r + 10 * blocks;
        let hashes: Vec<u64> = (first..first + blocks).collect();
        idx.store(ReplicaIdx::new(r as usize), store(None, &hashes, &t[..4 * blocks as usize], 4)).unwrap();
    }
    assert_eq!(devices(&idx.find_matches(&prompt)), vec![2, 3, 3]);
}

#[test]
fn lower_tiers_continue_past_the_device_match() {
    let mut idx = KvIndex::new(4, 2);
    let t = tokens(16);
    let prompt = prompt_block_hashes(&t, 4, Salt::NONE);
    // Replica 0: blocks 0-1 on GPU, 2 on CPU, 3 on disk. Replica 1: block 0-3 on CPU only.
    idx.store(ReplicaIdx::new(0), store(None, &[1, 2], &t[..8], 4)).unwrap();
    idx.store(ReplicaIdx::new(0), Store { tier: Tier::Host, ..store(Some(2), &[3], &t[8..12], 4) }).unwrap();
    idx.store(ReplicaIdx::new(0), Store { tier: Tier::Disk, ..store(Some(3), &[4], &t[12..16], 4) }).unwrap();
    idx.store(ReplicaIdx::new(1), Store { tier: Tier::Host, ..store(None, &[1, 2, 3, 4], &t, 4) }).unwrap();
    let o = idx.find_matches(&prompt);
    assert_eq!(o[0], Overlap { device: 2, host: 1, disk: 1 });
    assert_eq!(o[1], Overlap { device: 0, host: 4, disk: 0 });
    idx.remove(ReplicaIdx::new(0), Tier::Host, &e(&[3]));
    assert_eq!(idx.find_matches(&prompt)[0], Overlap { device: 2, host: 0, disk: 0 }, "a hole stops the walk");
    assert_eq!(idx.replica_tier_blocks(ReplicaIdx::new(0), Tier::Disk), 1);
}

#[test]
fn a_walk_resumes_where_the_last_ended_only_over_an_unbroken_chain() {
    let mut idx = KvIndex::new(4, 3);
    let t = tokens(24);
    let prompt = prompt_block_hashes(&t, 4, Salt::NONE);
    // Every replica stores the prompt's first four blocks side by side, then each its own rest.
    for r in 0..3u64 {
        let own = [10 * r + 1, 10 * r + 2, 10 * r + 3, 10 * r + 4];
        idx.store(ReplicaIdx::new(r as usize), store(None, &own, &t[..16], 4)).unwrap();
    }
    let mut other = t.clone();
    other[16] = 1;
    idx.store(ReplicaIdx::new(0), store(Some(4), &[5, 6], &t[16..24], 4)).unwrap();
    idx.store(ReplicaIdx::new(2), store(Some(24), &[25, 26], &other[16..24], 4)).unwrap();
    // Replica 1 loses its second block: its third and fourth still sit where the walk of
    // replica 0 would resume, but no longer follow its first.
    idx.remove(ReplicaIdx::new(1), Tier::Device, &e(&[12]));
    assert_eq!(devices(&idx.find_matches(&prompt)), vec![6, 1, 4]);
    assert_eq!(devices(&idx.find_matches(&prompt[..4])), vec![4, 1, 4]);
}
