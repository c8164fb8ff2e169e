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
}

impl ShedReason {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            ShedReason::QueueFull => "queue_full",
            ShedReason::QueueTime => "queue_time",
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
        // No classes configured: one, with the pool's bounds.
        let implicit = [ClassConfig { name: "default".into(), ..ClassConfig::default() }];
        let configured = if config.classes.is_empty() { &implicit[..] } else { &config.classes[..] };
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
mod tests {
    use super::*;
    use crate::load::EngineReport;
    use tokio::sync::mpsc;

    /// A gate that lives for the whole test (so that places can move into tasks).
    fn gate(max_queued: usize, classes: Vec<ClassConfig>) -> &'static Gate {
        Box::leak(Box::new(Gate::new(&AdmissionConfig {
            enabled: true,
            kv_blocks: 100,
            max_prefill_tokens: 1000,
            max_queued,
            classes,
            ..AdmissionConfig::default()
        })))
    }

    fn class(name: &str, priority: i32) -> ClassConfig {
        ClassConfig { name: name.into(), priority, ..ClassConfig::default() }
    }

    /// A request holding a place, driven by the test: wait (until a deadline), or leave.
    struct Waiter {
        waits: mpsc::UnboundedSender<Option<Duration>>,
        results: mpsc::UnboundedReceiver<Result<bool, ShedReason>>,
        task: tokio::task::JoinHandle<()>,
    }

    impl Waiter {
        fn new(g: &'static Gate, class: usize, tenant: Option<&'static str>) -> Waiter {
            Waiter::asking(g, class, "m", tenant)
        }

        fn asking(g: &'static Gate, class: usize, asks: &'static str, tenant: Option<&'static str>) -> Waiter {
            let (waits, mut commands) = mpsc::unbounded_channel::<Option<Duration>>();
            let (report, results) = mpsc::unbounded_channel();
            let task = tokio::spawn(async move {
                let mut place = g.place(class, asks, tenant);
                while let Some(Some(within)) = commands.recv().await {
                    let _ = report.send(place.wait(g.releases(), Instant::now() + within).await);
                }
            });
            Waiter { waits, results, task }
        }

        /// Starts waiting and returns once it is in the queue.
        async fn wait(&mut self, g: &Gate, within: Duration) {
            let before = g.waiting();
            self.waits.send(Some(within)).unwrap();
            while g.waiting() == before {
                tokio::task::yield_now().await;
            }
        }

        /// Its last wait's outcome, once there is one.
        async fn result(&mut self) -> Result<(), ShedReason> {
            self.results.recv().await.unwrap().map(|woken| assert!(woken, "woken, not released"))
        }

        /// Waits again after a wake-up that found no room (its place is kept).
        async fn wait_again(&mut self, within: Duration) {
            self.waits.send(Some(within)).unwrap();
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
        }

        /// Whether its wait is over, after the other tasks have run.
        async fn is_woken(&mut self) -> bool {
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
            !self.results.is_empty()
        }

        /// Lets its place go (admitted, or gone) and waits until it has.
        async fn leave(self) {
            let _ = self.waits.send(None);
            self.task.await.unwrap();
        }
    }

    const FAR: Duration = Duration::from_secs(10);

    /// `n` requests from `tenant`, queued one after the other.
    async fn queued(g: &'static Gate, n: usize, tenant: &'static str) -> Vec<Waiter> {
        let mut waiters = Vec::new();
        for _ in 0..n {
            let mut w = Waiter::new(g, 0, Some(tenant));
            w.wait(g, FAR).await;
            waiters.push(w);
        }
        waiters
    }

    #[test]
    fn saturation_is_either_threshold() {
        let g = gate(1, Vec::new());
        let load = |active_blocks, prefill_tokens| ReplicaLoad { active_blocks, prefill_tokens, ..Default::default() };
        assert!(!g.saturated(&load(89, 999)));
        assert!(g.saturated(&load(90, 0)), "90 % of 100 blocks");
        assert!(g.saturated(&load(0, 1000)), "the prefill backlog");
    }

    #[test]
    fn capacity_and_signals_can_come_from_the_engine() {
        let learned = Gate::new(&AdmissionConfig { enabled: true, ..AdmissionConfig::default() });
        let report = |kv_blocks, kv_usage, waiting| EngineReport { kv_blocks, kv_usage, waiting, requests: waiting };
        let load = |active_blocks, engine| ReplicaLoad { active_blocks, engine, ..Default::default() };
        assert!(!learned.saturated(&load(1000, None)), "no capacity known: never saturated");
        assert!(!learned.saturated(&load(89, Some(report(Some(100), None, 0)))));
        assert!(learned.saturated(&load(90, Some(report(Some(100), None, 0)))), "90 % of what the engine has");
        assert!(!learned.saturated(&load(0, Some(report(None, Some(0.99), 50)))), "signals are off by default");
        let signals = Gate::new(&AdmissionConfig {
            enabled: true,
            engine_signals: true,
            max_engine_waiting: 4,
            ..AdmissionConfig::default()
        });
        assert!(!signals.saturated(&load(0, Some(report(None, Some(0.5), 3)))));
        assert!(signals.saturated(&load(0, Some(report(None, Some(0.95), 0)))), "the engine's cache is full");
        assert!(signals.saturated(&load(0, Some(report(None, Some(0.5), 4)))), "the engine queues");
    }

    #[tokio::test]
    async fn a_waiting_higher_class_is_seen_by_lower_ones() {
        let g = gate(8, vec![class("batch", 0), class("interactive", 10)]);
        let (batch, chat) = (g.class_of(Some("batch")), g.class_of(Some("interactive")));
        // Short waits: a waiter that is never woken leaves when its wait ends.
        const SHORT: Duration = Duration::from_millis(300);
        let mut low = Waiter::new(g, batch, Some("t"));
        low.wait(g, SHORT).await;
        assert!(!g.higher_waiting(batch) && !g.higher_waiting(chat), "only batch waits");
        let mut high = Waiter::new(g, chat, None);
        high.wait(g, SHORT).await;
        assert!(g.higher_waiting(batch) && !g.higher_waiting(chat));
        high.leave().await;
        assert!(!g.higher_waiting(batch));
        low.leave().await;
    }

    #[tokio::test]
    async fn a_wake_up_without_room_goes_on_to_another_tenant_only_with_headroom() {
        for headroom in [0.5, 0.0] {
            let g: &'static Gate = Box::leak(Box::new(Gate::new(&AdmissionConfig {
                enabled: true,
                kv_blocks: 100,
                fair_headroom: headroom,
                ..AdmissionConfig::default()
            })));
            let mut burst = Waiter::new(g, 0, Some("burst"));
            burst.wait(g, FAR).await;
            // Short waits: a waiter that is never woken leaves when its wait ends.
            let short = Duration::from_millis(300);
            let mut more = Waiter::new(g, 0, Some("burst"));
            more.wait(g, short).await;
            let mut quiet = Waiter::new(g, 0, Some("quiet"));
            quiet.wait(g, short).await;
            g.freed();
            burst.result().await.unwrap();
            // It finds no room and waits again, passing the wake-up on.
            burst.wait_again(short).await;
            assert!(!more.is_woken().await, "not to the burst's own next request");
            assert_eq!(quiet.is_woken().await, headroom > 0.0, "to the other tenant's, with headroom {headroom}");
            for w in [burst, more, quiet] {
                w.leave().await;
            }
        }
    }

    #[test]
    fn a_lower_class_leaves_headroom_for_a_higher_one() {
        let batch = ClassConfig { kv_fraction: Some(0.5), ..class("batch", 0) };
        let g = gate(8, vec![batch, class("interactive", 10)]);
        let load = ReplicaLoad { active_blocks: 60, ..Default::default() };
        assert!(g.saturated_for(&load, g.class_of(Some("batch")), false), "batch stops at 50 of 100 blocks");
        assert!(!g.saturated_for(&load, g.class_of(Some("interactive")), false), "interactive goes on to 90");
    }

    #[test]
    fn a_tenant_under_its_share_has_headroom_past_its_class() {
        // Defaults: 90 % of 100 blocks, 1000 prefill tokens; headroom 0.5 → 95 blocks, 1500.
        let g = gate(8, vec![]);
        let default = g.class_of(None);
        let load =
            |blocks, prefill| ReplicaLoad { active_blocks: blocks, prefill_tokens: prefill, ..Default::default() };
        for (blocks, prefill, over, under) in [(92, 0, true, false), (95, 0, true, true), (0, 1200, true, false)] {
            assert_eq!(g.saturated_for(&load(blocks, prefill), default, false), over, "{blocks} blocks, {prefill}");
            assert_eq!(g.saturated_for(&load(blocks, prefill), default, true), under, "{blocks} blocks, {prefill}");
        }
        assert!(g.saturated_for(&load(0, 1500), default, true), "the raised backlog is a limit too");
        assert!(g.has_fair_headroom() && g.flow_of(default, None).is_none(), "no tenant, no flow");
        assert_ne!(g.flow_of(default, Some("a")), g.flow_of(default, Some("b")));

        // A lower class's raised limits stop at a higher class's: its headroom stays its own.
        let batch = ClassConfig { kv_fraction: Some(0.7), max_prefill_tokens: Some(800), ..class("batch", 0) };
        let chat = ClassConfig { kv_fraction: Some(0.8), ..class("chat", 10) };
        let g = gate(8, vec![batch, chat]);
        let (batch, chat) = (g.class_of(Some("batch")), g.class_of(Some("chat")));
        assert!(
            !g.saturated_for(&load(79, 0), batch, true) && g.saturated_for(&load(80, 0), batch, true),
            "0.85 capped at 0.8"
        );
        assert!(
            !g.saturated_for(&load(0, 999), batch, true) && g.saturated_for(&load(0, 1000), batch, true),
            "1200 capped at 1000"
        );
        assert!(
            !g.saturated_for(&load(89, 0), chat, true) && g.saturated_for(&load(90, 0), chat, true),
            "the top class: 0.9"
        );
    }

    #[tokio::test]
    async fn waiters_wake_in_order_and_nobody_overtakes_a_woken_one() {
        let g = gate(8, Vec::new());
        let (mut a, mut b) = (Waiter::new(g, 0, None), Waiter::new(g, 0, None));
        a.wait(g, FAR).await;
        b.wait(g, FAR).await;
        assert!(!g.place(0, "m", None).is_first(), "a newcomer does not overtake");
        g.freed();
        assert_eq!(a.result().await, Ok(()));
        assert!(!b.is_woken().await, "one release wakes one waiter");
        assert!(!g.place(0, "m", None).is_first(), "a woken request keeps its place while it decides");
        a.leave().await;
        assert_eq!(b.result().await, Ok(()), "admitted: the next one is woken, there may be room for it too");
    }

    #[tokio::test]
    async fn a_woken_request_that_still_does_not_fit_passes_the_wake_on() {
        let g = gate(8, Vec::new());
        let mut a = Waiter::new(g, 0, None);
        let mut alike = Waiter::new(g, 0, None);
        let mut adapter = Waiter::asking(g, 0, "m-lora", None);
        a.wait(g, FAR).await;
        alike.wait(g, FAR).await;
        adapter.wait(g, FAR).await;
        g.freed();
        assert_eq!(a.result().await, Ok(()));
        // a finds the pool still full and waits again: the next request for the same model
        // would not fit either, so the wake-up goes to one for an adapter (other replicas).
        a.wait_again(FAR).await;
        assert!(!alike.is_woken().await, "a request like a is not woken");
        assert_eq!(adapter.result().await, Ok(()), "one that may fit where a does not is");
        assert_eq!(g.waiting(), 2, "a waits again");
        g.freed();
        assert_eq!(a.result().await, Ok(()), "a kept its place ahead of the others");
        a.leave().await;
        assert_eq!(alike.result().await, Ok(()), "admitted, a passes its wake-up on");
        alike.leave().await;
        adapter.leave().await;
    }

    #[tokio::test]
    async fn a_higher_class_goes_first_and_tenants_take_turns() {
        let g = gate(16, vec![class("batch", 0), class("interactive", 10)]);
        let (batch, interactive) = (g.class_of(Some("batch")), g.class_of(Some("interactive")));
        assert_eq!(g.class_of(None), batch, "the lowest class is the default");
        assert_eq!(g.class_of(Some("unknown")), batch);
        // A tenant that was admitted at once many times is not charged for it.
        for _ in 0..100 {
            drop(g.place(batch, "m", Some("noisy")));
        }
        // A bursting tenant queues three batch requests, then a quiet one queues one; then an
        // interactive request arrives last of all.
        let mut order = Vec::new();
        for (who, class, tenant) in [
            ("noisy-1", batch, "noisy"),
            ("noisy-2", batch, "noisy"),
            ("noisy-3", batch, "noisy"),
            ("quiet-1", batch, "quiet"),
            ("chat", interactive, "noisy"),
        ] {
            let mut w = Waiter::new(g, class, Some(tenant));
            w.wait(g, FAR).await;
            order.push((who, w));
        }
        let mut woken = Vec::new();
        for _ in 0..order.len() {
            g.freed();
            for (who, w) in &mut order {
                if !woken.contains(who) && w.is_woken().await {
                    woken.push(*who);
                }
            }
        }
        assert_eq!(woken, ["chat", "noisy-1", "quiet-1", "noisy-2", "noisy-3"]);
    }

    #[tokio::test]
    async fn a_wake_up_that_finds_no_room_does_not_send_a_quiet_tenant_back() {
        let g = gate(16, vec![]);
        let mut noisy = queued(g, 3, "noisy").await;
        // A release that makes no room: the first waiter is woken, finds the pool still
        // full, and waits again. Its turn has not come: nobody was admitted.
        g.freed();
        noisy[0].result().await.unwrap();
        noisy[0].wait_again(FAR).await;
        // A quiet tenant's first request still goes right after the noisy tenant's first.
        let mut quiet = Waiter::new(g, 0, Some("quiet"));
        quiet.wait(g, FAR).await;
        g.freed();
        let first = noisy.remove(0);
        assert!(!quiet.is_woken().await, "the noisy tenant's first request is ahead");
        first.leave().await;
        assert!(quiet.is_woken().await, "then the quiet tenant's, before the noisy tenant's second");
        for w in &mut noisy {
            assert!(!w.is_woken().await);
        }
        quiet.leave().await;
        for w in noisy {
            w.leave().await;
        }
    }

    #[tokio::test]
    async fn a_request_admitted_out_of_turn_does_not_move_the_turn_past_the_waiters() {
        let g = gate(16, vec![]);
        let mut noisy = queued(g, 3, "noisy").await;
        let mut adapter = Waiter::asking(g, 0, "m-lora", Some("noisy"));
        adapter.wait(g, FAR).await;
        // The first waiter does not fit; the adapter's request, last in the queue, does.
        g.freed();
        noisy[0].result().await.unwrap();
        noisy[0].wait_again(FAR).await;
        adapter.result().await.unwrap();
        adapter.leave().await;
        // A quiet tenant's request still goes before the noisy tenant's second.
        let mut quiet = Waiter::new(g, 0, Some("quiet"));
        quiet.wait(g, FAR).await;
        let first = noisy.remove(0);
        first.leave().await;
        assert!(quiet.is_woken().await, "the quiet tenant is next");
        quiet.leave().await;
        for w in noisy {
            w.leave().await;
        }
    }

    #[tokio::test]
    async fn a_full_class_and_a_long_wait_are_shed() {
        let g = gate(1, Vec::new());
        let mut a = Waiter::new(g, 0, None);
        a.wait(g, Duration::from_millis(50)).await;
        assert_eq!(g.place(0, "m", None).wait(g.releases(), Instant::now() + FAR).await, Err(ShedReason::QueueFull));
        assert_eq!(a.result().await, Err(ShedReason::QueueTime));
        a.leave().await;
        let mut next = Waiter::new(g, 0, None);
        next.wait(g, FAR).await;
        g.freed();
        assert_eq!(next.result().await, Ok(()), "its place in the class is free again");
    }

    #[tokio::test]
    async fn a_request_dropped_while_it_waits_gives_its_place_back() {
        let g = gate(1, Vec::new());
        let mut a = Waiter::new(g, 0, None);
        a.wait(g, FAR).await;
        // The filter stopped waiting: the sidecar drops the request's handler mid-wait.
        a.task.abort();
        let _ = a.task.await;
        assert_eq!(g.waiting(), 0);
        let mut b = Waiter::new(g, 0, None);
        tokio::time::timeout(Duration::from_secs(5), b.wait(g, FAR)).await.expect("the class has room again");
        g.freed();
        assert_eq!(b.result().await, Ok(()));
    }

    #[tokio::test]
    async fn a_request_woken_then_dropped_passes_its_wake_up_on() {
        let g = gate(8, Vec::new());
        let (mut x, mut y) = (Waiter::new(g, 0, None), Waiter::new(g, 0, None));
        x.wait(g, FAR).await;
        y.wait(g, FAR).await;
        g.freed();
        assert_eq!(x.result().await, Ok(()));
        x.task.abort();
        let _ = x.task.await;
        assert_eq!(y.result().await, Ok(()), "the release x did not use goes to y");
    }

    #[tokio::test]
    async fn a_release_before_the_wait_is_not_missed() {
        let g = gate(1, Vec::new());
        let seen = g.releases();
        g.freed();
        assert_eq!(
            g.place(0, "m", None).wait(seen, Instant::now() + FAR).await,
            Ok(false),
            "returns at once to decide again"
        );
        assert_eq!(g.waiting(), 0);
    }
}
