//! One pool: a model's replicas, its KV index and load table, their health, and the routing
//! decision. See `README.md` beside this file for which file owns which state and which way
//! writes flow.
//!
//! Membership changes at run time (config reload, DNS or Envoy discovery) through
//! [`Pool::set_members`]. Every replica has a slot: bookings, index entries and metrics refer
//! to slots by number, so a replica that leaves keeps its slot — emptied, inactive, never a
//! candidate — and gets it back if it returns.
//!
//! Locks are taken in one order — members, index (its live copy), affinity, load table,
//! accuracy, explanations; a batch of index writes is opened before `members` is locked
//! (`README.md`, "Lock order") — and a replica's
//! metric labels (which read the members) are never looked up while the load table is held,
//! so a membership change can never deadlock with routing or lifecycle reports. Every lock is
//! a private field: only this module's files take them.

mod candidates;
mod config;
mod disagg;
mod explain;
mod handover;
mod health;
mod lifecycle;
mod members;
mod offload;
mod route;
mod sessions;
mod state;

use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kvgate_shared::hash::SequenceHash;
use kvgate_shared::prompt::tokenizer::ModelTokenizer;

use crate::accuracy::Accuracy;
use crate::admission::Gate;
use crate::index::approx::ApproxIndex;
use crate::index::{ApplyError, Change, KvIndex, Mirrored, Overlap, ReplicaIdx, Store, StoredBlocks, Write};
use crate::load::LoadTable;
use crate::metrics::{Metrics, PoolLabels, ReplicaLabels};
use crate::msg::sync::Outbox;

pub use config::{
    DisaggregationConfig, EventsMode, Policy, PoolConfig, PrefillPolicy, ReplicaConfig, Role, TransferProtocol,
    MAX_EXPLAIN_KEEP,
};
pub use explain::{CandidateTerms, Checked, Explanation};
pub use handover::TakenOver;
pub use members::{targets, Member, ReplicaHealth, Target};
pub use offload::{OffloadError, Offloaded};
pub use route::{Admit, NotAdmitted};
pub use sessions::SessionConfig;
pub use state::{LatencyState, PoolState, ReplicaState};

use explain::Explanations;
use members::{member, Slots};

/// Segment-cache budget of the tokenizer used for offloaded prompts.
const OFFLOAD_SEGMENT_CACHE_BYTES: usize = 64 << 20;

/// A model's pool of replicas.
pub struct Pool {
    /// The pool's settings.
    config: PoolConfig,
    /// Which replica holds which blocks: two copies, so decisions never wait for the applier.
    index: Mirrored<KvIndex>,
    /// What each replica is busy with.
    load: Mutex<LoadTable>,
    /// The replicas' slots, by replica index (the config's replicas first).
    members: RwLock<Slots>,
    /// The encoded [`kvgate_shared::wire::ModelBundle`] served to filters.
    bundle: Vec<u8>,
    /// How often filters fetched it (a model no filter ever fetched routes on load alone).
    bundles_served: AtomicU64,
    /// The same tokenizer, loaded on first use, for prompts the filter offloads.
    tokenizer: std::sync::OnceLock<Result<ModelTokenizer, String>>,
    metrics: Arc<Metrics>,
    started: Instant,
    /// The last decisions with every candidate's cost terms (`/debug/explain`), kept compact
    /// (indices, not names) so that recording costs no allocation per candidate.
    explanations: Mutex<Explanations>,
    /// The `round_robin` cursor.
    next: AtomicUsize,
    /// Round-robin turns among prefill workers (`prefill_policy = "round_robin"`).
    next_prefill: AtomicUsize,
    /// Where bookings and their lifecycle go for the other gateways (when sync is on).
    outbox: std::sync::OnceLock<Outbox>,
    /// Where this gateway sent which blocks: the `prefix_affinity` policy's overlap, or, for
    /// `kv_aware`, the in-flight credit (`inflight_credit_secs`), peers' bookings included.
    affinity: Mutex<ApproxIndex>,
    /// Every prediction checked against what the engine reported, and the alarm.
    accuracy: Mutex<Accuracy>,
    /// The queue of requests waiting for capacity (with admission control on).
    admission: Option<Gate>,
    /// What a peer handed over and is not used yet (`handover.rs`).
    handover: Mutex<handover::Staged>,
    /// Where each session is bound (`[pools.sessions]`; `sessions.rs`).
    sessions: Option<Mutex<sessions::Sessions>>,
}

// Locks are only poisoned if a holder panicked; the data is still consistent enough to serve.
fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|e| e.into_inner())
}

impl Pool {
    /// An empty pool.
    pub fn new(config: PoolConfig, bundle: Vec<u8>, metrics: Arc<Metrics>) -> Pool {
        let initial = targets(&config.replicas);
        let n = initial.len();
        let ttl = match config.policy {
            Policy::PrefixAffinity => config.affinity_ttl_secs,
            _ => config.inflight_credit_secs,
        };
        let affinity = ApproxIndex::new(config.affinity_blocks, Duration::from_secs(ttl));
        let admission = config.admission.enabled.then(|| Gate::new(&config.admission));
        let explanations = Explanations::new(config.explain_keep, Duration::from_secs(config.explain_max_age_secs));
        let sessions = config.sessions.as_ref().map(|s| Mutex::new(sessions::Sessions::new(s)));
        Pool {
            sessions,
            admission,
            index: Mirrored::new(KvIndex::new(config.block_size as usize, n)),
            load: Mutex::new(LoadTable::new(n, config.prefill_tokens_per_sec)),
            members: RwLock::new(Slots::new(initial.into_iter().map(member).collect())),
            config,
            bundle,
            bundles_served: AtomicU64::new(0),
            tokenizer: std::sync::OnceLock::new(),
            metrics,
            started: Instant::now(),
            explanations: Mutex::new(explanations),
            next: AtomicUsize::new(0),
            next_prefill: AtomicUsize::new(0),
            affinity: Mutex::new(affinity),
            accuracy: Mutex::default(),
            outbox: std::sync::OnceLock::new(),
            handover: Mutex::default(),
        }
    }

    /// The pool's settings.
    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// The admission gate, if admission control is on.
    pub fn admission(&self) -> Option<&Gate> {
        self.admission.as_ref()
    }

    /// Capacity may have freed: the oldest waiting request decides again.
    fn capacity_freed(&self) {
        if let Some(gate) = &self.admission {
            gate.freed();
        }
    }

    /// Each replica's overlap with a prompt's block hashes, in slot order, as the index holds
    /// it now (before health and in-flight credit are taken into account).
    pub fn find_matches(&self, hashes: &[SequenceHash]) -> Vec<Overlap> {
        self.index.read().find_matches(hashes)
    }

    /// Stores blocks on a replica directly, as its events would (for tools, tests and
    /// benchmarks that preload an index).
    pub fn store_blocks(&self, replica: ReplicaIdx, store: Store<'_>) -> Result<(), ApplyError> {
        self.index_mut().apply(Write::Change(replica, Change::Store(StoredBlocks::from_store(store))))
    }

    fn affinity_index(&self) -> std::sync::MutexGuard<'_, ApproxIndex> {
        self.affinity.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Metric labels for a replica.
    pub fn labels(&self, replica: ReplicaIdx) -> ReplicaLabels {
        ReplicaLabels { model: self.config.model.clone(), replica: self.members()[replica.get()].replica.id.clone() }
    }

    /// Metric labels for the pool.
    pub fn pool_labels(&self) -> PoolLabels {
        PoolLabels { model: self.config.model.clone() }
    }

    /// A batch of writes to the index: the pool's applier ([`crate::events::apply`]) and
    /// membership changes. Decisions see the batch when it is dropped.
    pub(crate) fn index_mut(&self) -> crate::index::mirror::Batch<'_, KvIndex> {
        self.index.write()
    }

    fn load_table(&self) -> std::sync::MutexGuard<'_, LoadTable> {
        self.load.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The session bindings, if the pool binds sessions (a lock taken alone).
    fn sessions(&self) -> Option<std::sync::MutexGuard<'_, sessions::Sessions>> {
        self.sessions.as_ref().map(|s| s.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

#[cfg(test)]
mod tests;
