//! Who is in the pool: each slot's replica, rank, health flags, stop flag and learned LoRA
//! adapters, and the active slots by id ([`Slots`]). Owns the `members` lock; writes come
//! from discovery ([`Pool::set_members`], [`Pool::retire_departed`]) and the adapter poller
//! ([`Pool::set_adapters`]).

use std::collections::{BTreeSet, HashMap};
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{read, Pool};
use super::{PoolConfig, ReplicaConfig};
use crate::index::mirror::Batch;
use crate::index::{Change, KvIndex, ReplicaIdx, Write};
use crate::metrics::ReplicaLabels;

pub(super) const NONE: u64 = u64::MAX;

/// An active routing target, as code outside the pool sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    /// Its slot.
    pub slot: ReplicaIdx,
    /// Its engine's HTTP endpoint.
    pub endpoint: std::net::SocketAddr,
    /// Its data-parallel rank, if it is one.
    pub rank: Option<u32>,
}

/// Per-replica ingestion state visible to routing and `/debug/state`.
#[derive(Debug)]
pub struct ReplicaHealth {
    /// Events applied to the index.
    pub events_applied: AtomicU64,
    /// The last sequence number applied.
    pub last_seq: AtomicU64,
    /// Messages were lost and could not be replayed (the blocks indexed before were dropped).
    pub degraded: AtomicBool,
    /// Requests that must create blocks were routed here, but no event came.
    pub stalled: AtomicBool,
    /// The connection to its publisher dropped (the engine may have restarted with an empty
    /// cache). Cleared by the next message, which either continues the sequence or — a
    /// restart — clears the replica.
    pub disconnected: AtomicBool,
    /// Since when (ms since the pool started) events are expected; `NONE` if not.
    pub(super) awaiting_events_since: AtomicU64,
    /// Whether its engine reports cached prompt tokens: [`CACHE_REPORT_UNKNOWN`] until its
    /// first usage report, then [`CACHE_REPORT_YES`] or [`CACHE_REPORT_NO`].
    pub(super) cache_report: AtomicU8,
}

/// [`ReplicaHealth::cache_report`] before any usage report.
pub(super) const CACHE_REPORT_UNKNOWN: u8 = 0;
/// The engine's last usage report had cached tokens.
pub(super) const CACHE_REPORT_YES: u8 = 1;
/// It had none.
pub(super) const CACHE_REPORT_NO: u8 = 2;

impl Default for ReplicaHealth {
    fn default() -> Self {
        ReplicaHealth {
            events_applied: AtomicU64::new(0),
            last_seq: AtomicU64::new(NONE),
            degraded: AtomicBool::new(false),
            stalled: AtomicBool::new(false),
            disconnected: AtomicBool::new(false),
            awaiting_events_since: AtomicU64::new(NONE),
            cache_report: AtomicU8::new(CACHE_REPORT_UNKNOWN),
        }
    }
}

impl ReplicaHealth {
    /// Whether the replica's index entries may be trusted for cache credit: not while its
    /// publisher is stalled (its removals may be pending), nor while its connection is down
    /// (its engine may have restarted empty). A degraded replica's possibly stale blocks
    /// were already dropped, so what remains is trusted.
    pub fn trusted(&self) -> bool {
        !self.stalled.load(Ordering::Relaxed) && !self.disconnected.load(Ordering::Relaxed)
    }
}

/// One routing target's slot: a replica, or one data-parallel rank of it.
#[derive(Debug)]
pub struct Member {
    /// Where it is and where its events come from (a rank's own endpoints, id `replica#rank`).
    pub replica: ReplicaConfig,
    /// Its data-parallel rank, for engines that have ranks.
    pub rank: Option<u32>,
    /// In the pool now, routable (false: it left).
    pub active: bool,
    /// When it left, while its grace period runs (`leave_grace_secs`): not routable, but its
    /// index and event subscription are kept in case it comes back. `None` once its slot is
    /// emptied (then the slot may be given to a newcomer).
    pub leaving_since: Option<Instant>,
    /// Its ingestion health.
    pub health: Arc<ReplicaHealth>,
    /// Set to stop reading and ingesting its events (when it leaves or its endpoints change).
    pub stop: Arc<AtomicBool>,
    /// LoRA adapters its engine lists in `/v1/models` (see `adapters_poll_secs`).
    pub adapters: BTreeSet<String>,
}

impl Member {
    pub(super) fn new((replica, rank): (ReplicaConfig, Option<u32>)) -> Member {
        Member {
            replica,
            rank,
            active: true,
            leaving_since: None,
            health: Arc::default(),
            stop: Arc::default(),
            adapters: BTreeSet::new(),
        }
    }

    /// Whether it can serve a request for `model` in `pool`: the base model and configured
    /// adapters everywhere, learned adapters where its engine lists them.
    pub(super) fn serves(&self, model: &str, pool: &PoolConfig) -> bool {
        model == pool.model || pool.adapters.iter().any(|a| a == model) || self.adapters.contains(model)
    }
}

/// The pool's slots by replica index, and the active ones by id: a peer's booking names its
/// target by id, and thousands a second must not each compare it with every member's. Read
/// as a list (`Deref`); changed only in this file, which indexes the ids again after any
/// change of an id or of who is active.
#[derive(Debug)]
pub struct Slots {
    list: Vec<Member>,
    active: HashMap<String, ReplicaIdx, foldhash::fast::RandomState>,
}

impl Slots {
    pub(super) fn new(list: Vec<Member>) -> Slots {
        let mut slots = Slots { list, active: HashMap::default() };
        slots.index_ids();
        slots
    }

    /// The slot of the active target `id`.
    pub(super) fn active_slot(&self, id: &str) -> Option<ReplicaIdx> {
        self.active.get(id).copied()
    }

    /// Indexes the active slots' ids again: after any change of an id or of who is active.
    fn index_ids(&mut self) {
        let active = self.list.iter().enumerate().filter(|(_, m)| m.active);
        self.active = active.map(|(i, m)| (m.replica.id.clone(), ReplicaIdx::new(i))).collect();
        debug_assert_eq!(self.active.len(), self.list.iter().filter(|m| m.active).count(), "active ids are unique");
    }
}

impl Deref for Slots {
    type Target = [Member];

    fn deref(&self) -> &[Member] {
        &self.list
    }
}

/// The routing targets of replicas: each replica itself, or — with `data_parallel_size` N > 1
/// — one target per rank: id `replica#r`, events and replay at vLLM's per-rank endpoints
/// (port + r), the replica's HTTP endpoint, and `X-data-parallel-rank: r` on the request.
pub fn targets(replicas: &[ReplicaConfig]) -> Vec<(ReplicaConfig, Option<u32>)> {
    let mut out = Vec::new();
    for r in replicas {
        if r.data_parallel_size <= 1 {
            out.push((r.clone(), None));
            continue;
        }
        for rank in 0..r.data_parallel_size {
            // Validation guarantees offsettable endpoints.
            let offset = |e: &str| kvgate_shared::endpoint::for_rank(e, rank).unwrap_or_else(|_| e.to_owned());
            let target = ReplicaConfig {
                id: format!("{}#{rank}", r.id),
                kv_events: offset(&r.kv_events),
                kv_replay: r.kv_replay.as_deref().map(offset),
                data_parallel_size: 1,
                ..r.clone()
            };
            out.push((target, Some(rank)));
        }
    }
    out
}

/// A new member's slot contents.
pub(super) fn member(target: (ReplicaConfig, Option<u32>)) -> Member {
    Member::new(target)
}

impl Pool {
    /// The replicas' slots, locked (see `README.md`, "Lock order"): for this module's files
    /// only; callers outside take one of the snapshots below.
    pub(super) fn members(&self) -> std::sync::RwLockReadGuard<'_, Slots> {
        read(&self.members)
    }

    /// The active routing targets (each data-parallel rank one): what pollers of the
    /// engines visit.
    pub fn active_targets(&self) -> Vec<Target> {
        let members = self.members();
        let active = members.iter().enumerate().filter(|(_, m)| m.active);
        active.map(|(i, m)| Target { slot: ReplicaIdx::new(i), endpoint: m.replica.endpoint, rank: m.rank }).collect()
    }

    /// Whether a slot's index entries are trusted for routing now (see
    /// [`ReplicaHealth::trusted`]); false for a slot the pool does not have.
    pub fn trusted(&self, slot: ReplicaIdx) -> bool {
        self.members().get(slot.get()).is_some_and(|m| m.health.trusted())
    }

    /// The active replicas' slots with their event stop flags: what to start
    /// ingestion for at startup.
    pub fn active(&self) -> Vec<(ReplicaIdx, ReplicaConfig, Arc<AtomicBool>)> {
        let members = self.members();
        let active = members.iter().enumerate().filter(|(_, m)| m.active);
        active.map(|(i, m)| (ReplicaIdx::new(i), m.replica.clone(), m.stop.clone())).collect()
    }

    /// Makes `replicas` the pool's membership, and returns the slots whose events must
    /// be started, with their config and stop flag.
    ///
    /// - An unchanged replica keeps everything (index, bookings, health).
    /// - A replica that left stops being a candidate at once. For `leave_grace_secs` it keeps
    ///   its index and event ingestion: back within that (a health-check flap, an outlier
    ///   ejection) it is routable again, warm. After that its slot is emptied
    ///   ([`Pool::retire_departed`]): events no longer read, index and bookings dropped.
    /// - A new replica — or one whose endpoints changed, which is a new engine as far as its
    ///   cache goes — starts empty, in an emptied slot if there is one (so pod rollouts do not
    ///   grow the slots every decision scans), else a new one.
    pub fn set_members(&self, replicas: &[ReplicaConfig]) -> Vec<(ReplicaIdx, ReplicaConfig, Arc<AtomicBool>)> {
        self.retire_departed();
        let wanted_targets = targets(replicas);
        let grace = Duration::from_secs(self.config.leave_grace_secs);
        // The index's changes go in one batch, opened before `members` is locked: opening it
        // waits for the applier's batch in progress, and decisions must not wait behind that.
        let mut index = self.index_mut();
        let mut slots = self.members.write().unwrap_or_else(|e| e.into_inner());
        let members = &mut slots.list;
        let mut start = Vec::new();
        let (mut returned, mut left) = (false, false);
        for (i, m) in members.iter_mut().enumerate() {
            let i = ReplicaIdx::new(i);
            let wanted = wanted_targets.iter().find(|(r, _)| r.id == m.replica.id);
            let kept = m.active || m.leaving_since.is_some();
            match wanted {
                Some((r, rank)) if m.active && *r == m.replica && *rank == m.rank => {}
                Some((r, rank)) if m.leaving_since.is_some() && *r == m.replica && *rank == m.rank => {
                    tracing::info!(model = %self.config.model, replica = %r.id, "replica back within its grace period; its index was kept");
                    m.leaving_since = None;
                    m.active = true;
                    returned = true;
                }
                Some(target) => {
                    if kept {
                        self.retire(i, m, &mut index);
                    }
                    self.join(i, m, target, &mut start);
                }
                None if m.active && !grace.is_zero() => {
                    tracing::info!(model = %self.config.model, replica = %m.replica.id, grace_secs = grace.as_secs(), "replica left; not routed to, its index kept for the grace period");
                    m.active = false;
                    m.leaving_since = Some(Instant::now());
                    left = true;
                }
                None if kept => {
                    self.retire(i, m, &mut index);
                    left = true;
                }
                None => {}
            }
        }
        for target in wanted_targets {
            if members.iter().any(|m| m.replica.id == target.0.id) {
                continue;
            }
            let free = members.iter().position(|m| !m.active && m.leaving_since.is_none());
            let slot = match free.map(ReplicaIdx::new) {
                Some(slot) => {
                    // What the decisions kept and the sessions bound name by slot would now
                    // name the newcomer.
                    self.forget_slot(slot);
                    if let Some(mut sessions) = self.sessions() {
                        sessions.forget_slot(slot);
                    }
                    slot
                }
                None => {
                    let i = ReplicaIdx::new(members.len());
                    debug_assert_eq!(index.get().replicas(), i.get(), "slots and index stay aligned");
                    index.apply(Write::AddReplica).expect("adding a replica cannot fail");
                    let j = self.load_table().add_replica();
                    debug_assert_eq!(j, i, "slots and load stay aligned");
                    members.push(Member::new(target.clone()));
                    i
                }
            };
            self.join(slot, &mut members[slot.get()], &target, &mut start);
        }
        if returned || left || !start.is_empty() {
            slots.index_ids();
        }
        // The index's new slots go live before the members that name them.
        drop(index);
        drop(slots);
        // Bookings and session bindings a peer handed over that were waiting for these targets.
        self.book_handed_over();
        self.bind_handed_over();
        if returned || !start.is_empty() {
            // A replica joined or came back: room for the requests that wait.
            self.capacity_freed();
        }
        start
    }

    /// Puts a new replica in slot `i` (emptied already) and queues it to be read.
    fn join(
        &self,
        i: ReplicaIdx,
        m: &mut Member,
        target: &(ReplicaConfig, Option<u32>),
        start: &mut Vec<(ReplicaIdx, ReplicaConfig, Arc<AtomicBool>)>,
    ) {
        tracing::info!(model = %self.config.model, replica = %target.0.id, endpoint = %target.0.endpoint, slot = i.get(), "replica joined");
        *m = Member::new(target.clone());
        start.push((i, target.0.clone(), m.stop.clone()));
    }

    /// Empties the slots of replicas whose grace period has run out.
    pub fn retire_departed(&self) {
        let grace = Duration::from_secs(self.config.leave_grace_secs);
        let due = |m: &Member| m.leaving_since.is_some_and(|since| since.elapsed() >= grace);
        if !self.members().iter().any(due) {
            return;
        }
        // As in `set_members`: the index batch first, then `members`.
        let mut index = self.index_mut();
        let mut slots = self.members.write().unwrap_or_else(|e| e.into_inner());
        for (i, m) in slots.list.iter_mut().enumerate() {
            if due(m) {
                self.retire(ReplicaIdx::new(i), m, &mut index);
            }
        }
        slots.index_ids();
    }

    /// Takes a replica out: stops reading its events, then (in `index`, a batch opened after
    /// any the applier had begun, so a stopped applier cannot write after it) drops its blocks
    /// and bookings.
    fn retire(&self, i: ReplicaIdx, m: &mut Member, index: &mut Batch<'_, KvIndex>) {
        tracing::info!(model = %self.config.model, replica = %m.replica.id, "replica removed; its slot is emptied");
        m.stop.store(true, Ordering::Relaxed);
        m.active = false;
        m.leaving_since = None;
        index.apply(Write::Change(i, Change::Clear)).expect("a clear is never refused");
        self.affinity_index().clear_replica(i);
        let mut load = self.load_table();
        load.clear_replica(i);
        self.metrics.forget_replica(&ReplicaLabels { model: self.config.model.clone(), replica: m.replica.id.clone() });
    }

    /// Sets slot `slot`'s gauges with `set`, given its replica's labels, if a replica is in the
    /// slot (active, or in its grace period). `members` is held meanwhile, so no gauge is set
    /// after [`Pool::retire`] removed the replica's series: an applier, poller or timer that
    /// has not seen it leave would bring them back.
    pub(super) fn set_gauges(&self, slot: ReplicaIdx, set: impl FnOnce(&ReplicaLabels)) {
        let members = self.members();
        if let Some(m) = members.get(slot.get()).filter(|m| m.active || m.leaving_since.is_some()) {
            set(&ReplicaLabels { model: self.config.model.clone(), replica: m.replica.id.clone() });
        }
    }

    /// Records the LoRA adapters the engine at `endpoint` lists (every DP rank of it). Returns
    /// whether anything changed.
    pub fn set_adapters(&self, endpoint: &str, adapters: &BTreeSet<String>) -> bool {
        let mut slots = self.members.write().unwrap_or_else(|e| e.into_inner());
        let mut changed = false;
        for m in slots.list.iter_mut().filter(|m| m.active && m.replica.endpoint.to_string() == endpoint) {
            if m.adapters != *adapters {
                tracing::info!(model = %self.config.model, replica = %m.replica.id, ?adapters, "LoRA adapters changed");
                m.adapters.clone_from(adapters);
                changed = true;
            }
        }
        changed
    }

    /// Whether `name` is a LoRA adapter of this pool: configured, or listed by an active engine.
    pub fn serves_adapter(&self, name: &str) -> bool {
        self.config.adapters.iter().any(|a| a == name)
            || self.members().iter().any(|m| m.active && m.adapters.contains(name))
    }

    /// Every LoRA adapter of this pool, configured or learned, sorted.
    pub fn adapters(&self) -> BTreeSet<String> {
        let mut all: BTreeSet<String> = self.config.adapters.iter().cloned().collect();
        for m in self.members().iter().filter(|m| m.active) {
            all.extend(m.adapters.iter().cloned());
        }
        all
    }

    /// Stops reading every replica's events (shutdown).
    pub fn stop_all(&self) {
        for m in self.members().iter() {
            m.stop.store(true, Ordering::Relaxed);
        }
    }
}
