//! What the index is told: one replica's changes, owned, so that [`super::mirror`] can apply
//! each to both copies of the index.

use kvgate_shared::hash::{EngineHash, Salt};

use super::{ApplyError, KvIndex, ReplicaIdx, ReplicaSnapshot, Store, Tier};

/// A change to one replica's index entries (decoded from its events by `crate::events`).
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    /// Drop every block of the replica (restart, lost events, `AllBlocksCleared`).
    Clear,
    /// A `BlockStored`.
    Store(StoredBlocks),
    /// A run of consecutive `BlockRemoved`s on one tier, applied in one call (an engine step
    /// evicts many blocks, one event each; the index overlaps their cache misses).
    Remove {
        /// Their tier.
        tier: Tier,
        /// The engine hashes removed.
        engine_hashes: Vec<EngineHash>,
    },
    /// Replace the replica's entries and applied mark with a peer's snapshot of them (a
    /// sidecar starting while its peers run, `crate::sync::state`).
    Restore(Box<ReplicaSnapshot>),
    /// Set the replica's applied mark ([`KvIndex::mark_applied`]): written by the applier
    /// after each message, so that an export always stands at a message boundary.
    Mark(Option<u64>),
}

/// A `BlockStored`, owned, with its salts worked out: [`Store`] without the borrow.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredBlocks {
    /// See [`Store::parent`].
    pub parent: Option<EngineHash>,
    /// See [`Store::engine_hashes`].
    pub engine_hashes: Vec<EngineHash>,
    /// See [`Store::token_ids`].
    pub token_ids: Vec<u32>,
    /// See [`Store::block_size`].
    pub block_size: usize,
    /// See [`Store::salt`].
    pub salt: Salt,
    /// See [`Store::extra`].
    pub extra: Vec<Salt>,
    /// See [`Store::tier`].
    pub tier: Tier,
}

impl Change {
    /// How many blocks it touches: what a batch of index writes is measured in.
    pub fn blocks(&self) -> usize {
        match self {
            Change::Clear => 1,
            Change::Store(s) => s.engine_hashes.len(),
            Change::Remove { engine_hashes, .. } => engine_hashes.len(),
            Change::Restore(snapshot) => snapshot.blocks(),
            Change::Mark(_) => 0,
        }
    }

    /// Applies it to `replica`'s entries; `Err` says why the index refused a store.
    pub fn apply(&self, replica: ReplicaIdx, index: &mut KvIndex) -> Result<(), ApplyError> {
        match self {
            Change::Clear => index.clear_replica(replica),
            Change::Remove { tier, engine_hashes } => index.remove(replica, *tier, engine_hashes),
            Change::Store(s) => return index.store(replica, s.as_store()),
            Change::Restore(snapshot) => index.restore(replica, snapshot),
            Change::Mark(seq) => index.mark_applied(replica, *seq),
        }
        Ok(())
    }
}

impl StoredBlocks {
    /// The same store, borrowed.
    pub fn as_store(&self) -> Store<'_> {
        Store {
            parent: self.parent,
            engine_hashes: &self.engine_hashes,
            token_ids: &self.token_ids,
            block_size: self.block_size,
            salt: self.salt,
            extra: &self.extra,
            tier: self.tier,
        }
    }

    /// A borrowed store, owned.
    pub fn from_store(s: Store<'_>) -> StoredBlocks {
        StoredBlocks {
            parent: s.parent,
            engine_hashes: s.engine_hashes.to_vec(),
            token_ids: s.token_ids.to_vec(),
            block_size: s.block_size,
            salt: s.salt,
            extra: s.extra.to_vec(),
            tier: s.tier,
        }
    }
}

/// One write to the index, as [`super::Mirrored`] logs it to replay on the other copy.
#[derive(Debug, Clone, PartialEq)]
pub enum Write {
    /// Room for one more replica, at the end ([`KvIndex::add_replica`]).
    AddReplica,
    /// A change to one replica's entries.
    Change(ReplicaIdx, Change),
}

impl super::mirror::Absorb for KvIndex {
    type Op = Write;
    type Out = Result<(), ApplyError>;

    fn absorb(&mut self, op: &Write) -> Result<(), ApplyError> {
        match op {
            Write::AddReplica => {
                self.add_replica();
                Ok(())
            }
            Write::Change(replica, change) => change.apply(*replica, self),
        }
    }
}
