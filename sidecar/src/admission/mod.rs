//! Admission control: whether a replica is saturated, judged from kvgate's own books, and the
//! queue of requests that wait for capacity while every replica of their pool is.
//!
//! The rules:
//! - a replica is saturated once the blocks booked on it reach `kv_fraction × kv_blocks`, or
//!   the prefill tokens booked on it (with engine metrics, plus an estimate for the outside
//!   requests its engine reports waiting) reach `max_prefill_tokens` (either criterion off at 0);
//! - a request that finds every candidate saturated waits; so does one that finds others
//!   waiting ahead of it. A request decides only when nobody waits ahead of it, or on its
//!   tenant's fair-share headroom (below);
//! - who is ahead: a higher priority class first; within a class, tenants take turns (each
//!   waiting request of a tenant is tagged one turn after that tenant's previous one, and no
//!   earlier than the class's current turn: start-time fair queuing, one request a turn), then
//!   arrival. The class's current turn is that of the last request that left the queue after
//!   a wake-up, and never past a request of the class still waiting (a waiter that was woken
//!   and did not fit keeps its turn, and a newcomer must not be put behind it). A request
//!   without a tenant is a tenant of its own;
//! - capacity frees when a booked request reaches its first token or ends (or a replica
//!   joins): the first waiter wakes and decides again, so it goes where its prefix is cached
//!   *now*; if it routes, the next one is woken too (one release may make room for several),
//!   and if it finds the pool still full it waits again, keeping its place;
//! - a request is shed when its class already holds `max_queued` waiters, or when its wait
//!   would pass its class's `max_queue_ms` or what the filter said it waits;
//! - fairness beyond turns: a tenant that holds less than its fair share of its class's
//!   requests in flight (counted by the load table, [`crate::load::flows`]; a tenant with
//!   nothing in flight always does) is judged against its class's limits raised by
//!   `fair_headroom` — never past the limits of a higher class, whose headroom stays its own —
//!   and may route so even with others of its class waiting ahead of it, but not while a
//!   request of a higher class waits. A wake-up that finds no room is passed on to a waiter
//!   of another tenant, which may have headroom where this one has none. Turns alone cannot
//!   keep a quiet tenant's requests fast once a burst holds the capacity: whoever is first
//!   still waits for a release.
//!
//! - a TTFT SLO (`ttft_slo_ms`, per class): once every candidate's TTFT model predicts, the
//!   decision keeps to the replicas predicted to meet what is left of the SLO after the
//!   request's wait; when none is, a request of a `sheddable` class is shed at once (outcome
//!   `slo`) instead of being routed late or after `max_queue_ms`, and another class's is
//!   decided as without an SLO (`crate::pool`, `route.rs`). An ITL SLO (`itl_slo_ms`) keeps
//!   the decision to the replicas whose ITL model predicts the request's tokens will come at
//!   least that often, alongside.
//!
//! A waiter that gave up (timed out, or its client left and the filter stopped waiting) is
//! skipped. Tenants are remembered only while they have a turn ahead of their class's
//! (at most [`MAX_TENANTS`] per pool; beyond that a tenant is treated as a newcomer).

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::load::flows::Flow;
use crate::load::ReplicaLoad;

mod config;

pub use config::{AdmissionConfig, ClassConfig};

/// The most tenants whose turn is remembered per pool.
pub const MAX_TENANTS: usize = 4096;

/// Why a request was shed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShedReason {
    /// Its class's queue was full.
    QueueFull,
    /// Capacity did not free within the request's wait.
    QueueTime,
    /// No replica is predicted to meet its class's TTFT SLO, and the class is sheddable.
    Slo,
}

impl ShedReason {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            ShedReason::QueueFull => "queue_full",
            ShedReason::QueueTime => "queue_time",
            ShedReason::Slo => "slo",
        }
    }
}

/// A class as the gate uses it.
#[derive(Debug)]
struct Class {
    name: String,
    /// Its position in priority order: 0 goes first.
    rank: usize,
    max_wait: Duration,
    max_queued: usize,
    /// The share of a replica's KV cache, and the prefill backlog, it may fill.
    kv_fraction: f64,
    max_prefill_tokens: u64,
    /// The same for a tenant under its fair share: raised by the headroom, capped at every
    /// higher class's.
    fair_kv_fraction: f64,
    fair_max_prefill_tokens: u64,
    /// Its TTFT and ITL SLOs, and whether a request that no replica is predicted to meet them
    /// with is shed at once.
    ttft_slo: Option<Duration>,
    itl_slo: Option<Duration>,
    sheddable: bool,
}

/// A pool's admission gate.
#[derive(Debug)]
pub struct Gate {
    kv_blocks: u64,
    engine_signals: bool,
    max_engine_waiting: u64,
    retry_after_secs: u32,
    /// Tenants under their fair share have headroom (`fair_headroom` > 0).
    fair: bool,
    classes: Vec<Class>,
    default_class: usize,
    queue: Mutex<Queue>,
}

/// Where a waiter stands: lower goes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    rank: usize,
    turn: u64,
    arrival: u64,
    /// What it asks for (the model or an adapter, hashed): requests of one class that ask
    /// for the same thing fit, or not, alike. Unique arrivals make it moot for the order.
    asks: u64,
    /// Its tenant, hashed: with fair-share headroom, another tenant's request may fit where
    /// this one does not.
    tenant: Option<u64>,
}

#[derive(Debug, Default)]
struct Queue {
    /// Every request in the queue, in order: waiting (with the sender that wakes it), or woken
    /// and deciding again (`None`), so that nobody overtakes it meanwhile.
    places: BTreeMap<Key, Option<oneshot::Sender<()>>>,
    /// Requests per class that count against its `max_queued`.
    queued: Vec<usize>,
    /// Per class, the current turn (see the module's rules).
    turn: Vec<u64>,
    /// Each tenant's last turn, by class and tenant hash.
    tenants: HashMap<(usize, u64), u64>,
    arrivals: u64,
    /// Calls of [`Gate::freed`] so far.
    releases: u64,
}

impl Queue {
    /// Wakes the first waiting request after `after` (from the start for `None`) that might
    /// fit where `after` did not: of another class, asking for another model or adapter, or,
    /// with fair-share headroom (`fair`), of another named tenant.
    fn wake_after(&mut self, after: Option<Key>, fair: bool) {
        let lower = after.map_or(std::ops::Bound::Unbounded, std::ops::Bound::Excluded);
        let other_tenant = |a: &Key, k: &Key| fair && k.tenant.is_some() && k.tenant != a.tenant;
        let alike = |k: &Key| after.is_some_and(|a| (a.rank, a.asks) == (k.rank, k.asks) && !other_tenant(&a, k));
        for (_, waiter) in self.places.range_mut((lower, std::ops::Bound::Unbounded)).filter(|(k, _)| !alike(k)) {
            let Some(tx) = waiter.take() else { continue };
            if tx.is_closed() {
                // Its wait is over (timed out, its place about to go): it was not woken.
                *waiter = Some(tx);
                continue;
            }
            if tx.send(()).is_ok() {
                return;
            }
        }
    }
}

/// A request's place in its pool's queue, kept across wake-ups. Dropping it — the request
/// was admitted or shed, or its handler was dropped because the filter stopped waiting —
/// takes it out of the queue and passes a wake-up it had not used to the next waiter.
#[derive(Debug)]
pub struct Place<'g> {
    gate: &'g Gate,
    key: Key,
    class: usize,
    /// Its tenant (class and hash), whose turn is recorded when it first waits.
    tenant: Option<(usize, u64)>,
    /// Whether it is in the queue (and counts against its class's `max_queued`).
    queued: bool,
}

impl Place<'_> {
    /// Whether the request has waited.
    pub fn waited(&self) -> bool {
        self.queued
    }

    /// Whether nobody is in the queue ahead of this request.
    pub fn is_first(&self) -> bool {
        self.gate.lock().places.keys().find(|k| **k != self.key).is_none_or(|first| self.key < *first)
    }

    /// Waits for capacity until `until`. `seen` is [`Gate::releases`] as read before the
    /// decision that found the pool full: if capacity was freed since, it returns at once
    /// (`Ok(false)`: decide again if first). `Ok(true)`: it was woken, and decides now. A
    /// request that was woken and still finds the pool full passes the wake-up on to the next
    /// waiter behind it that may fit where this one does not: of another class (other
    /// thresholds), or asking for another model or adapter (other replicas). Not to one like
    /// itself: it would not fit either, and while it decided, capacity freed meanwhile could
    /// go to it ahead of the waiters in front.
    /// Returns why the request is shed, if it is.
    pub async fn wait(&mut self, seen: u64, until: Instant) -> Result<bool, ShedReason> {
        let gate = self.gate;
        let woken = {
            let mut queue = gate.lock();
            if !self.queued && queue.queued[self.class] >= gate.classes[self.class].max_queued {
                return Err(ShedReason::QueueFull);
            }
            if Instant::now() >= until {
                return Err(ShedReason::QueueTime);
            }
            if queue.releases != seen {
                return Ok(false);
            }
            let (tx, rx) = oneshot::channel();
            let was_woken = queue.places.insert(self.key, Some(tx)).is_some();
            if !self.queued {
                self.queued = true;
                queue.queued[self.class] += 1;
                if let Some(id) = self.tenant {
                    record_turn(&mut queue, id, self.key.turn);
                }
            }
            if was_woken {
                queue.wake_after(Some(self.key), gate.fair);
            }
            rx
        };
        match tokio::time::timeout_at(until.into(), woken).await {
            Ok(Ok(())) => Ok(true),
            _ => Err(ShedReason::QueueTime),
        }
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        if !self.queued {
            return;
        }
        let mut queue = self.gate.lock();
        queue.queued[self.class] = queue.queued[self.class].saturating_sub(1);
        // Woken and gone (admitted, shed after a wake-up, or dropped before deciding): its
        // class's turn has come to its own (only now: a request woken that did not fit keeps
        // waiting, and moving the turn past it would put a newcomer behind it), and the next
        // one may fit now.
        if let Some(None) = queue.places.remove(&self.key) {
            // Never past a request of the class still waiting (this one may have been woken
            // ahead of it: another model, another class's wake-up passed on).
            let rank = self.key.rank;
            let first = Key { rank, turn: 0, arrival: 0, asks: 0, tenant: None };
            let waiting = queue.places.range(first..).next().map(|(k, _)| *k).filter(|k| k.rank == rank);
            let turn = waiting.map_or(self.key.turn, |w| self.key.turn.min(w.turn.saturating_sub(1)));
            queue.turn[self.class] = queue.turn[self.class].max(turn);
            queue.releases += 1;
            queue.wake_after(None, false);
        }
    }
}

/// A name, kept as a hash (a tenant, a model): fixed-size however long the header was.
fn hash_of(name: &str) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut hasher);
    hasher.finish()
}

/// A class's limits for a tenant under its fair share: its own raised by `headroom` (a KV
/// fraction `f` to `f + h(1 − f)`, a prefill backlog `p` to `p(1 + h)`), but never past those
/// of a higher class (`limits`: every class's rank, KV fraction and backlog; a backlog of 0
/// is no limit), nor below its own.
fn fair_limits(class: &Class, headroom: f64, limits: &[(usize, f64, u64)]) -> (f64, u64) {
    let higher = limits.iter().filter(|(rank, ..)| *rank < class.rank);
    let kv_cap = higher.clone().map(|l| l.1).fold(1.0, f64::min);
    let prefill_cap = higher.filter(|l| l.2 > 0).map(|l| l.2).min().unwrap_or(u64::MAX);
    let kv = (class.kv_fraction + headroom * (1.0 - class.kv_fraction)).min(kv_cap).max(class.kv_fraction);
    let prefill = match class.max_prefill_tokens {
        0 => 0,
        p => (p + (headroom * p as f64).round() as u64).min(prefill_cap).max(p),
    };
    (kv, prefill)
}

/// Remembers a tenant's last turn (at most [`MAX_TENANTS`], those with a turn still ahead).
fn record_turn(queue: &mut Queue, id: (usize, u64), turn: u64) {
    if queue.tenants.len() >= MAX_TENANTS {
        let turns = queue.turn.clone();
        queue.tenants.retain(|&(c, _), &mut last| last > turns[c]);
    }
    if queue.tenants.len() < MAX_TENANTS || queue.tenants.contains_key(&id) {
        queue.tenants.insert(id, turn);
    }
}

impl Gate {
    /// A gate with `config`'s thresholds, classes and bounds.
    pub fn new(config: &AdmissionConfig) -> Gate {
        let configured = config.classes_or_implicit();
        let mut classes: Vec<Class> = configured
            .iter()
            .map(|c| Class {
                name: c.name.clone(),
                rank: 0,
                max_wait: Duration::from_millis(c.max_queue_ms.unwrap_or(config.max_queue_ms)),
                max_queued: c.max_queued.unwrap_or(config.max_queued),
                kv_fraction: c.kv_fraction.unwrap_or(config.kv_fraction),
                max_prefill_tokens: c.max_prefill_tokens.unwrap_or(config.max_prefill_tokens),
                fair_kv_fraction: 0.0,
                fair_max_prefill_tokens: 0,
                ttft_slo: Some(Duration::from_millis(c.ttft_slo_ms_in(config))).filter(|slo| !slo.is_zero()),
                itl_slo: Some(Duration::from_millis(c.itl_slo_ms_in(config))).filter(|slo| !slo.is_zero()),
                sheddable: c.sheddable_in(config),
            })
            .collect();
        let mut by_priority: Vec<usize> = (0..classes.len()).collect();
        by_priority.sort_by_key(|&i| std::cmp::Reverse(configured[i].priority));
        for (rank, &i) in by_priority.iter().enumerate() {
            classes[i].rank = rank;
        }
        let limits: Vec<(usize, f64, u64)> =
            classes.iter().map(|c| (c.rank, c.kv_fraction, c.max_prefill_tokens)).collect();
        for c in &mut classes {
            (c.fair_kv_fraction, c.fair_max_prefill_tokens) = fair_limits(c, config.fair_headroom, &limits);
        }
        let lowest = by_priority.last().copied().unwrap_or_default();
        let default_class = config
            .default_class
            .as_deref()
            .and_then(|name| classes.iter().position(|c| c.name == name))
            .unwrap_or(lowest);
        let queue = Queue { queued: vec![0; classes.len()], turn: vec![0; classes.len()], ..Queue::default() };
        Gate {
            kv_blocks: config.kv_blocks,
            engine_signals: config.engine_signals,
            max_engine_waiting: config.max_engine_waiting,
            retry_after_secs: config.retry_after_secs,
            fair: config.fair_headroom > 0.0,
            classes,
            default_class,
            queue: Mutex::new(queue),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a replica with this load takes no more requests of the default class.
    pub fn saturated(&self, load: &ReplicaLoad) -> bool {
        self.saturated_for(load, self.default_class, false)
    }

    /// Whether a replica with this load takes no more requests of `class`: by kvgate's books
    /// (KV capacity configured, else as its engine reports it) against the class's share, or,
    /// with `engine_signals`, by what its engine last said. `under_share`: the request's
    /// tenant holds less than its fair share, and the class's limits are raised by
    /// `fair_headroom`.
    pub fn saturated_for(&self, load: &ReplicaLoad, class: usize, under_share: bool) -> bool {
        let c = &self.classes[class];
        let (kv_fraction, max_prefill_tokens) = match under_share {
            true => (c.fair_kv_fraction, c.fair_max_prefill_tokens),
            false => (c.kv_fraction, c.max_prefill_tokens),
        };
        let kv_blocks = match self.kv_blocks {
            0 => load.engine.and_then(|e| e.kv_blocks).unwrap_or(0),
            configured => configured,
        };
        let kv_full = kv_blocks > 0 && load.active_blocks as f64 >= kv_fraction * kv_blocks as f64;
        let prefill_full = max_prefill_tokens > 0 && load.prefill_tokens >= max_prefill_tokens;
        let engine_full = self.engine_signals
            && load.engine.is_some_and(|e| {
                e.kv_usage.is_some_and(|u| u >= kv_fraction)
                    || (self.max_engine_waiting > 0 && e.waiting >= self.max_engine_waiting)
            });
        kv_full || prefill_full || engine_full
    }

    /// The class a request names (`None`, or a name no class has: the default class).
    pub fn class_of(&self, name: Option<&str>) -> usize {
        name.and_then(|n| self.classes.iter().position(|c| c.name == n)).unwrap_or(self.default_class)
    }

    /// The flow a request of `class` from `tenant` counts in (none without a tenant).
    pub fn flow_of(&self, class: usize, tenant: Option<&str>) -> Option<Flow> {
        tenant.map(|t| Flow { class, tenant: hash_of(t) })
    }

    /// Whether a tenant under its fair share gets more room than its class's limits.
    pub fn has_fair_headroom(&self) -> bool {
        self.fair
    }

    /// Whether a request of a higher class than `class` is in the queue (then no request of
    /// `class` routes on headroom ahead of it).
    pub fn higher_waiting(&self, class: usize) -> bool {
        let rank = self.classes[class].rank;
        self.lock().places.keys().next().is_some_and(|first| first.rank < rank)
    }

    /// A class's name, for metrics.
    pub fn class_name(&self, class: usize) -> &str {
        &self.classes[class].name
    }

    /// The TTFT SLO of `class`, if it has one.
    pub fn ttft_slo(&self, class: usize) -> Option<Duration> {
        self.classes[class].ttft_slo
    }

    /// The ITL SLO of `class`, if it has one.
    pub fn itl_slo(&self, class: usize) -> Option<Duration> {
        self.classes[class].itl_slo
    }

    /// Whether a request of `class` that no replica is predicted to serve within its SLO is
    /// shed at once.
    pub fn sheddable(&self, class: usize) -> bool {
        self.classes[class].sheddable
    }

    /// The longest a request of `class` waits.
    pub fn max_wait(&self, class: usize) -> Duration {
        self.classes[class].max_wait
    }

    /// How many requests wait (not counting those woken and deciding).
    pub fn waiting(&self) -> usize {
        self.lock().places.values().filter(|tx| tx.is_some()).count()
    }

    /// Whether anyone is in the queue, waiting or woken.
    pub fn is_empty(&self) -> bool {
        self.lock().places.is_empty()
    }

    /// How many times capacity was freed: read before deciding, handed to [`Place::wait`], so
    /// that a release between the decision and the wait is not missed.
    pub fn releases(&self) -> u64 {
        self.lock().releases
    }

    /// A place for a request of `class` from `tenant` asking for model (or adapter) `asks`: its
    /// tenant's next turn, no earlier than the class's current one (recorded only if it comes
    /// to wait).
    pub fn place(&self, class: usize, asks: &str, tenant: Option<&str>) -> Place<'_> {
        let mut queue = self.lock();
        queue.arrivals += 1;
        let current = queue.turn[class];
        let tenant = tenant.map(|t| (class, hash_of(t)));
        let last = tenant.and_then(|id| queue.tenants.get(&id).copied()).unwrap_or(current);
        let key = Key {
            rank: self.classes[class].rank,
            turn: last.max(current) + 1,
            arrival: queue.arrivals,
            asks: hash_of(asks),
            tenant: tenant.map(|(_, hash)| hash),
        };
        Place { gate: self, key, class, tenant, queued: false }
    }

    /// Capacity may have freed: wakes the first waiter that is still waiting.
    pub fn freed(&self) {
        let mut queue = self.lock();
        queue.releases += 1;
        queue.wake_after(None, false);
    }

    /// The `Retry-After` for a shed request, in seconds.
    pub fn retry_after_secs(&self) -> u32 {
        self.retry_after_secs
    }
}

#[cfg(test)]
mod tests;
