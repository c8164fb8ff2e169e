//! A sidecar that starts while its peers run takes over their view instead of rebuilding it
//! from the engines (whose replay buffers may have rolled over): what a pool exports for a
//! starting peer ([`Pool::export_handover`]) and how it takes a peer's export over
//! ([`Pool::take_over`]). Owns the `handover` lock: what was handed over and not yet used.
//!
//! - Index entries are staged per target id and restored when the target's event stream
//!   starts ([`Pool::restore`], before the stream reads a message, in one batch of index
//!   writes): its ingestion resumes after the snapshot's sequence number, so the gap up to
//!   the engine's next message is replayed and nothing is applied twice.
//! - Bookings are booked at once on the targets the pool has; those naming targets it does not
//!   have yet (discovery has not answered) wait for the next membership change, then go.
//!   Bookings of other gateways keep their `origin/request_id` ids, so their ends, which the
//!   origin publishes, release them; this sidecar's own (a restart under the same id) keep
//!   their plain ids, so its filter's reports release them.
//! - Session bindings are bound the same way, each with its age (`sessions.rs`,
//!   [`super::sessions::Sessions::adopt`]); one already made here stands.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::Pool;
use crate::index::{Change, ReplicaIdx, ReplicaSnapshot, Write};
use crate::load::{BookingId, NewBooking};
use crate::msg::handover::{BookingHandover, PoolHandover, ReplicaHandover, SessionHandover};
use crate::msg::ingest::{Outcome, Progress};
use kvgate_shared::ids::RequestId;

/// How long after a handover a target that joins still restores its snapshot.
const RESTORE_WITHIN: Duration = Duration::from_secs(30);
/// How often, and how far apart, an export tries a replica that is mid-message.
const UNMARKED_TRIES: usize = 5;
const UNMARKED_WAIT: Duration = Duration::from_millis(2);

/// What a peer handed over and is not used yet.
#[derive(Debug, Default)]
pub(super) struct Staged {
    /// Target id → its `kv_events` endpoint and snapshot, until its event stream starts.
    restores: HashMap<String, (String, ReplicaSnapshot)>,
    /// When they were handed over: a target that joins later than [`RESTORE_WITHIN`] starts
    /// from the engine's replay instead of an old snapshot.
    taken_at: Option<Instant>,
    /// Bookings and session bindings on targets the pool does not have yet, and this
    /// sidecar's id.
    bookings: Vec<BookingHandover>,
    sessions: Vec<SessionHandover>,
    own_id: String,
    /// The waiting bookings and bindings had their one more membership change.
    retried: bool,
}

/// What [`Pool::take_over`] took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TakenOver {
    /// Targets whose index entries were staged.
    pub replicas: usize,
    /// Their blocks.
    pub blocks: usize,
    /// Bookings booked now.
    pub bookings: usize,
    /// Bookings waiting for their targets to join.
    pub waiting: usize,
    /// Session bindings bound now (those waiting for their targets are bound when they join).
    pub sessions: usize,
}

impl Pool {
    /// This pool's view for a starting peer: [`Pool::export_view`] and every booking.
    /// `own_id` is this sidecar's id.
    pub fn export_handover(&self, own_id: &str) -> PoolHandover {
        PoolHandover { bookings: self.export_bookings(own_id), ..self.export_view() }
    }

    /// This pool's view without its bookings (what a saved view keeps): the index entries of
    /// every active, trusted target whose applied mark is set, and every session binding not
    /// expired. Holds no lock for long: `members` only to list the targets, the index one
    /// replica at a time.
    pub fn export_view(&self) -> PoolHandover {
        let targets: Vec<(ReplicaIdx, String, String)> = self
            .members()
            .iter()
            .enumerate()
            .filter(|(_, m)| m.active && m.health.trusted())
            .map(|(slot, m)| (ReplicaIdx::new(slot), m.replica.id.clone(), m.replica.kv_events.clone()))
            .collect();
        let mut replicas = Vec::new();
        for (slot, target, kv_events) in targets {
            // A replica whose applier is mid-message has no mark: it gets a few more tries.
            let snapshot = (0..UNMARKED_TRIES).find_map(|try_| {
                if try_ > 0 {
                    std::thread::sleep(UNMARKED_WAIT);
                }
                self.index.read().export(slot)
            });
            // The slot may have changed hands meanwhile: only a snapshot of the same target.
            let same = || self.members().get(slot.get()).is_some_and(|m| m.active && m.replica.id == target);
            if let Some(snapshot) = snapshot.filter(|_| same()) {
                replicas.push(ReplicaHandover { target, kv_events, snapshot });
            }
        }
        PoolHandover {
            model: self.config.model.clone(),
            block_size: self.config.block_size,
            replicas,
            bookings: Vec::new(),
            sessions: self.export_sessions(),
        }
    }

    /// Every booking, named as the gateway that made it names it (`own_id` for ours).
    fn export_bookings(&self, own_id: &str) -> Vec<BookingHandover> {
        // Lock order: members, then the load table.
        let members = self.members();
        self.load_table()
            .export(Instant::now())
            .into_iter()
            .map(|b| {
                let (origin, request_id) = match b.id.peer_parts().filter(|_| b.from_peer) {
                    Some((origin, id)) => (origin.to_owned(), RequestId::from(id)),
                    None => (own_id.to_owned(), b.id.request_id()),
                };
                BookingHandover {
                    origin,
                    request_id,
                    target: members[b.replica.get()].replica.id.clone(),
                    prefill_tokens: b.prefill_tokens,
                    hashes: b.hashes,
                    total_blocks: b.total_blocks,
                    sequences: b.sequences,
                    age_ms: b.age.as_millis() as u64,
                }
            })
            .collect()
    }

    /// The session bindings to active targets, least recently routed first.
    fn export_sessions(&self) -> Vec<SessionHandover> {
        // The sessions lock is taken alone.
        let Some(bound) = self.sessions().map(|table| table.export(Instant::now())) else { return Vec::new() };
        let members = self.members();
        bound
            .into_iter()
            .filter_map(|(key, slot, idle)| {
                let m = members.get(slot.get()).filter(|m| m.active)?;
                Some(SessionHandover { key, target: m.replica.id.clone(), idle_ms: idle.as_millis() as u64 })
            })
            .collect()
    }

    /// Takes a peer's view over: stages its index entries, books its bookings, binds its
    /// sessions. `own_id` is this sidecar's id. Call it before the pool's event streams start.
    pub fn take_over(&self, view: PoolHandover, own_id: &str) -> TakenOver {
        let mut taken = TakenOver { replicas: view.replicas.len(), ..TakenOver::default() };
        let mut staged = self.staged();
        for r in view.replicas {
            taken.blocks += r.snapshot.blocks();
            staged.restores.insert(r.target, (r.kv_events, r.snapshot));
        }
        staged.taken_at = Some(Instant::now());
        staged.own_id = own_id.to_owned();
        staged.bookings = view.bookings;
        staged.sessions = view.sessions;
        staged.retried = false;
        drop(staged);
        (taken.bookings, taken.waiting) = self.book_handed_over();
        taken.sessions = self.bind_handed_over();
        taken
    }

    /// Restores the snapshot handed over for the target in `slot`, if one waits for it (its
    /// event stream is about to start); returns the sequence number its stream resumes after.
    pub fn restore(&self, slot: ReplicaIdx) -> Option<u64> {
        let (target, kv_events) = {
            let members = self.members();
            let m = members.get(slot.get())?;
            (m.replica.id.clone(), m.replica.kv_events.clone())
        };
        let snapshot = {
            let mut staged = self.staged();
            let fresh = staged.taken_at.is_some_and(|t| t.elapsed() < RESTORE_WITHIN);
            let (from, snapshot) = staged.restores.remove(&target)?;
            // Only onto the engine it was taken from, and only soon after.
            (fresh && from == kv_events).then_some(snapshot)?
        };
        let (seq, blocks) = (snapshot.through_seq, snapshot.blocks());
        // The restore sets the replica's applied mark too: it is exportable again at once.
        self.index_mut()
            .apply(Write::Change(slot, Change::Restore(Box::new(snapshot))))
            .expect("a restore is never refused");
        self.after_ingest(slot, Progress { last_seq: Some(seq), degraded: false }, &Outcome::default());
        self.metrics.handover_restored_blocks.get_or_create(&self.labels(slot)).inc_by(blocks as u64);
        tracing::info!(model = %self.config.model, replica = %target, seq, blocks, "index entries restored from a handed-over view");
        Some(seq)
    }

    /// Books the handed-over bookings whose targets are in the pool; the others wait for one
    /// more membership change, then are dropped. Returns how many were booked and how many
    /// wait.
    pub(super) fn book_handed_over(&self) -> (usize, usize) {
        let (bookings, own_id) = {
            let mut staged = self.staged();
            if staged.bookings.is_empty() {
                return (0, 0);
            }
            (std::mem::take(&mut staged.bookings), staged.own_id.clone())
        };
        // Lock order: members, then the load table.
        let members = self.members();
        let (mut booked, mut waiting, mut touched) = (0, Vec::new(), Vec::new());
        let mut load = self.load_table();
        let now = Instant::now();
        for b in bookings {
            let Some(slot) = members.active_slot(&b.target) else {
                waiting.push(b);
                continue;
            };
            let from_peer = b.origin != own_id;
            let id = if from_peer { BookingId::peer(&b.origin, &b.request_id) } else { BookingId::new(&b.request_id) };
            let booking = NewBooking {
                id: &id,
                prefill_tokens: b.prefill_tokens,
                hashes: &b.hashes,
                total_blocks: b.total_blocks,
                max_tokens: None,
                prediction: None,
                sequences: b.sequences,
                // Its first token is reported by its origin (or this sidecar's filter).
                streamed: true,
                flow: None,
                from_peer,
                // Its inputs were another sidecar's.
                timed: false,
                computed: None,
            };
            // It keeps its age: expiry comes when it would have at its origin.
            let booked_at = now.checked_sub(Duration::from_millis(b.age_ms)).unwrap_or(now);
            if load.book(slot, booking, booked_at) {
                booked += 1;
                touched.push(slot);
            }
        }
        touched.sort_unstable();
        touched.dedup();
        let figures: Vec<_> = touched.into_iter().map(|slot| (slot, load.load(slot))).collect();
        drop(load);
        drop(members);
        for (slot, f) in figures {
            self.publish_load(slot, f);
        }
        let mut staged = self.staged();
        if !staged.retried {
            staged.retried = true;
            let n = waiting.len();
            staged.bookings = waiting;
            return (booked, n);
        }
        if !waiting.is_empty() {
            tracing::info!(model = %self.config.model, n = waiting.len(), "handed-over bookings name targets this pool does not have; dropped");
        }
        (booked, 0)
    }

    /// Binds the handed-over sessions whose targets are in the pool, each with its age
    /// grown by the time since the handover; the others wait for a membership change that
    /// brings their target, until their TTL runs out. Returns how many were bound.
    pub(super) fn bind_handed_over(&self) -> usize {
        let (handed, since) = {
            let mut staged = self.staged();
            (std::mem::take(&mut staged.sessions), staged.taken_at.map_or(Duration::ZERO, |t| t.elapsed()))
        };
        if handed.is_empty() {
            return 0;
        }
        let slots: Vec<Option<ReplicaIdx>> = {
            let members = self.members();
            handed.iter().map(|s| members.active_slot(&s.target)).collect()
        };
        let Some(ttl) = self.config.sessions.as_ref().map(|c| Duration::from_secs(c.ttl_secs)) else { return 0 };
        let (mut bound, mut waiting) = (0, Vec::new());
        let Some(mut table) = self.sessions() else { return 0 };
        let now = Instant::now();
        for (s, slot) in handed.into_iter().zip(slots) {
            let idle = Duration::from_millis(s.idle_ms) + since;
            match slot {
                Some(slot) => bound += usize::from(table.adopt(s.key, slot, idle, now)),
                None if idle <= ttl => waiting.push(s),
                None => {}
            }
        }
        let count = table.len();
        drop(table);
        self.publish_sessions_bound(count);
        self.staged().sessions = waiting;
        bound
    }

    fn staged(&self) -> std::sync::MutexGuard<'_, Staged> {
        self.handover.lock().unwrap_or_else(|e| e.into_inner())
    }
}
