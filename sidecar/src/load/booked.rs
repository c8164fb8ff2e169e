//! The prompt blocks of a replica's active bookings, each counted once however many bookings
//! share it (Dynamo's `active_decode_blocks`), with how many bookings hold each.
//!
//! A booking's prompt is a chain of sequence hashes from its first block, and a sequence hash
//! names its whole prefix, so the bookings' prompts form a tree. It is kept as a radix tree:
//! a node is a run of blocks that the same bookings hold, stored side by side, with the number
//! of bookings through it, and its children keyed by their first block. A booking of a long
//! prompt that shares nothing is one node (one copy of its hashes), not one table entry per
//! block; one that shares a system prompt splits at most one node where it leaves it.
//!
//! - **Book** ([`BookedBlocks::insert`]): the prompt is matched down the tree, block by block
//!   within each run (a comparison of hashes side by side), and every node on its way counts
//!   it; where it leaves a run, the run is split, and what is left of the prompt is a new node.
//!   So a booking always ends at the end of a node, and its nodes are its path.
//! - **Release** ([`BookedBlocks::remove`]): its path loses the booking; nodes no booking holds
//!   go. A node left with one child that the same bookings hold is joined to it, so the tree
//!   has no more nodes than the bookings made branch.
//! - **Look up** ([`BookedBlocks::overlap`], on every candidate of every decision): the
//!   prompt's booked prefix. Within a run it is found by bisection: if the run holds the
//!   prompt's block at some depth, it holds every block before it (the hashes chain). The
//!   run's last block the prompt reaches is compared first, so a prompt through a whole
//!   shared prefix costs one read of it, not one per halving.
//!
//! The tree counts a block once per position in it: for chained hashes, as the engines' are,
//! that is once per block. Hashes that are not chained (a peer's bug, a 64-bit collision) can
//! only make it count a block twice or misjudge an overlap (either way); it never fails on
//! them.

use std::collections::HashMap;

use kvgate_shared::hash::SequenceHash;

type Map<V> = HashMap<SequenceHash, V, foldhash::fast::RandomState>;

/// A run of blocks held by the same bookings.
#[derive(Debug, Default)]
struct Node {
    run: Vec<SequenceHash>,
    /// Bookings whose prompts go through the run (and maybe past it).
    refs: u32,
    /// The nodes that continue it, by their first block.
    children: Map<usize>,
}

/// The blocks of a replica's active bookings (see the module's docs).
#[derive(Debug, Default)]
pub struct BookedBlocks {
    /// Nodes by index; freed ones are on `free` (their runs emptied).
    nodes: Vec<Node>,
    free: Vec<usize>,
    /// The nodes a prompt starts with, by their first block.
    roots: Map<usize>,
    /// Distinct blocks held: the runs' lengths, summed.
    blocks: u64,
}

impl BookedBlocks {
    /// How many distinct blocks the bookings hold.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// A booking of a prompt of `hashes` holds its blocks.
    pub fn insert(&mut self, hashes: &[SequenceHash]) {
        let Some(&first) = hashes.first() else { return };
        let Some(&root) = self.roots.get(&first) else {
            let node = self.alloc(hashes);
            self.roots.insert(first, node);
            return;
        };
        let (mut node, mut at) = (root, 0);
        loop {
            let rest = &hashes[at..];
            let run = &self.nodes[node].run;
            let matched = run.iter().zip(rest).take_while(|(a, b)| a == b).count();
            if matched < run.len() {
                self.split(node, matched);
            }
            self.nodes[node].refs += 1;
            at += matched;
            let Some(&next) = hashes.get(at) else { return };
            match self.nodes[node].children.get(&next) {
                Some(&child) => node = child,
                None => {
                    let child = self.alloc(&hashes[at..]);
                    self.nodes[node].children.insert(next, child);
                    return;
                }
            }
        }
    }

    /// A booking of a prompt of `hashes` ([`insert`](Self::insert)ed before) releases them.
    /// A prompt whose blocks do not end at the end of a node was not inserted, and is ignored.
    pub fn remove(&mut self, hashes: &[SequenceHash]) {
        let path = self.path(hashes);
        let covered: usize = path.iter().map(|&(node, _)| self.nodes[node].run.len()).sum();
        if covered != hashes.len() {
            return;
        }
        // The deepest node that stays, and the key it is known by in its parent.
        let mut deepest_kept = None;
        for (i, &(node, key)) in path.iter().enumerate().rev() {
            let n = &mut self.nodes[node];
            n.refs -= 1;
            if n.refs > 0 {
                deepest_kept.get_or_insert(node);
                continue;
            }
            match i.checked_sub(1) {
                Some(parent) => self.nodes[path[parent].0].children.remove(&key),
                None => self.roots.remove(&key),
            };
            self.blocks -= self.nodes[node].run.len() as u64;
            self.release(node);
        }
        if let Some(node) = deepest_kept {
            self.join_only_child(node);
        }
    }

    /// How many of the prompt's blocks, from its first, the bookings hold.
    pub fn overlap(&self, hashes: &[SequenceHash]) -> usize {
        let mut next = hashes.first().and_then(|first| self.roots.get(first));
        let mut at = 0;
        while let Some(&node) = next {
            let run = &self.nodes[node].run;
            let rest = &hashes[at..];
            // The run's first block is the prompt's (it was found by it); the rest by bisection,
            // after one comparison at the end: a prompt mostly goes through a whole shared
            // prefix, and each comparison reads another part of the run from memory.
            let (mut matched, mut most) = (1, run.len().min(rest.len()));
            if run[most - 1] == rest[most - 1] {
                matched = most;
            }
            while matched < most {
                let mid = (matched + most).div_ceil(2);
                match run[mid - 1] == rest[mid - 1] {
                    true => matched = mid,
                    false => most = mid - 1,
                }
            }
            at += matched;
            if matched < run.len() {
                break;
            }
            next = hashes.get(at).and_then(|h| self.nodes[node].children.get(h));
        }
        at
    }

    /// Of a booked prompt's blocks, how many no other booking holds.
    pub fn held_only_by_one(&self, hashes: &[SequenceHash]) -> u64 {
        self.path(hashes)
            .into_iter()
            .filter(|&(node, _)| self.nodes[node].refs == 1)
            .map(|(node, _)| self.nodes[node].run.len() as u64)
            .sum()
    }

    /// The nodes of a booked prompt, from its first, each with its key in its parent.
    fn path(&self, hashes: &[SequenceHash]) -> Vec<(usize, SequenceHash)> {
        let mut path = Vec::new();
        let mut at = 0;
        let mut children = &self.roots;
        while let Some(&key) = hashes.get(at) {
            let Some(&node) = children.get(&key) else { break };
            path.push((node, key));
            at += self.nodes[node].run.len();
            children = &self.nodes[node].children;
        }
        path
    }

    /// A new node holding `run` for one booking.
    fn alloc(&mut self, run: &[SequenceHash]) -> usize {
        self.blocks += run.len() as u64;
        self.place(Node { run: run.to_vec(), refs: 1, children: Map::default() })
    }

    /// Stores `node` in a freed slot, or a new one; its index.
    fn place(&mut self, node: Node) -> usize {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i] = node;
                i
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        }
    }

    /// Frees `node`'s slot; what it held.
    fn release(&mut self, node: usize) -> Node {
        self.free.push(node);
        std::mem::take(&mut self.nodes[node])
    }

    /// Splits `node`'s run after `at` blocks (`0 < at < len`): the rest, with its children,
    /// becomes its only child, held by the same bookings.
    fn split(&mut self, node: usize, at: usize) {
        let n = &mut self.nodes[node];
        let tail = Node { run: n.run.split_off(at), refs: n.refs, children: std::mem::take(&mut n.children) };
        let key = tail.run[0];
        let child = self.place(tail);
        self.nodes[node].children.insert(key, child);
    }

    /// Joins `node`'s only child to it, if the same bookings hold both.
    fn join_only_child(&mut self, node: usize) {
        let n = &self.nodes[node];
        if n.children.len() != 1 {
            return;
        }
        let Some(&child) = n.children.values().next() else { return };
        if self.nodes[child].refs != n.refs {
            return;
        }
        let c = self.release(child);
        let n = &mut self.nodes[node];
        n.run.extend_from_slice(&c.run);
        n.children = c.children;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The definition: each block hash → how many bookings hold it.
    #[derive(Default)]
    struct Model(std::collections::HashMap<SequenceHash, u32>);

    impl Model {
        fn insert(&mut self, hashes: &[SequenceHash]) {
            for h in hashes {
                *self.0.entry(*h).or_default() += 1;
            }
        }
        fn remove(&mut self, hashes: &[SequenceHash]) {
            for h in hashes {
                let n = self.0.get_mut(h).expect("held");
                *n -= 1;
                if *n == 0 {
                    self.0.remove(h);
                }
            }
        }
        fn overlap(&self, hashes: &[SequenceHash]) -> usize {
            hashes.iter().take_while(|h| self.0.contains_key(h)).count()
        }
        fn held_only_by_one(&self, hashes: &[SequenceHash]) -> u64 {
            hashes.iter().filter(|h| self.0.get(h) == Some(&1)).count() as u64
        }
    }

    /// A prompt's sequence hashes: each names its prefix, as the engines' do.
    fn chain(blocks: &[u8]) -> Vec<SequenceHash> {
        let mut parent = 0u64;
        blocks
            .iter()
            .map(|&b| {
                parent = parent.wrapping_mul(1_000_003).wrapping_add(u64::from(b) + 1);
                SequenceHash(parent)
            })
            .collect()
    }

    #[test]
    fn a_prompt_that_shares_a_prefix_splits_one_run() {
        let mut booked = BookedBlocks::default();
        let (a, b) = (chain(&[1, 2, 3, 4, 5]), chain(&[1, 2, 3, 9]));
        booked.insert(&a);
        booked.insert(&b);
        assert_eq!(booked.blocks(), 6, "three shared, two of a's own, one of b's");
        assert_eq!(booked.overlap(&chain(&[1, 2, 3, 4, 7])), 4);
        assert_eq!((booked.held_only_by_one(&a), booked.held_only_by_one(&b)), (2, 1));
        booked.remove(&b);
        assert_eq!(booked.blocks(), 5);
        assert_eq!(booked.nodes.len() - booked.free.len(), 1, "a's runs are joined again");
        booked.remove(&a);
        assert_eq!((booked.blocks(), booked.roots.len()), (0, 0));
    }

    #[test]
    fn a_prompt_never_booked_releases_nothing() {
        let mut booked = BookedBlocks::default();
        let a = chain(&[1, 2, 3]);
        booked.insert(&a);
        for never in [chain(&[1, 2]), chain(&[1, 2, 3, 4]), chain(&[7])] {
            booked.remove(&never);
            assert_eq!((booked.blocks(), booked.held_only_by_one(&a)), (3, 3));
        }
    }

    proptest! {
        /// Bookings made and released in any order hold what the definition says they do.
        #[test]
        fn booked_blocks_match_their_definition(
            ops in prop::collection::vec((prop::collection::vec(0u8..3, 0..12), any::<bool>(), any::<u8>()), 1..80),
            probes in prop::collection::vec(prop::collection::vec(0u8..3, 0..14), 8),
        ) {
            let (mut booked, mut model) = (BookedBlocks::default(), Model::default());
            let mut live: Vec<Vec<SequenceHash>> = Vec::new();
            for (blocks, release, pick) in ops {
                if release && !live.is_empty() {
                    let hashes = live.swap_remove(usize::from(pick) % live.len());
                    booked.remove(&hashes);
                    model.remove(&hashes);
                } else {
                    let hashes = chain(&blocks);
                    booked.insert(&hashes);
                    model.insert(&hashes);
                    live.push(hashes);
                }
                prop_assert_eq!(booked.blocks(), model.0.len() as u64);
                for hashes in &live {
                    prop_assert_eq!(booked.held_only_by_one(hashes), model.held_only_by_one(hashes));
                }
                for probe in &probes {
                    let hashes = chain(probe);
                    prop_assert_eq!(booked.overlap(&hashes), model.overlap(&hashes));
                }
            }
            for hashes in &live {
                booked.remove(hashes);
            }
            prop_assert_eq!((booked.blocks(), booked.roots.len(), booked.nodes.len()), (0, 0, booked.free.len()));
        }
    }
}
