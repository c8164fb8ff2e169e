//! Admission control: whether a replica is saturated, judged from kvgate's own books, and the
//! queue of requests that wait for capacity while every replica of their pool is.
//!
//! The rules:
//! - a replica is saturated once the blocks booked on it reach `kv_fraction × kv_blocks`, or
//!   the prefill tokens booked on it reach `max_prefill_tokens` (either criterion off at 0);
//! - a request that finds every candidate saturated waits; so does one that finds others
//!   waiting ahead of it. A request decides only when nobody waits ahead of it;
//! - who is ahead: a higher priority class first; within a class, tenants take turns (each
//!   waiting request of a tenant is tagged one turn after that tenant's previous one, and no
//!   earlier than the class's current turn: start-time fair queuing, one request a turn), then
//!   arrival. A request without a tenant is a tenant of its own;
//! - capacity frees when a booked request reaches its first token or ends (or a replica
//!   joins): the first waiter wakes and decides again, so it goes where its prefix is cached
//!   *now*; if it routes, the next one is woken too (one release may make room for several),
//!   and if it finds the pool still full it waits again, keeping its place;
//! - a request is shed when its class already holds `max_queued` waiters, or when its wait
//!   would pass its class's `max_queue_ms` or what the filter said it waits.
//!
//! A waiter that gave up (timed out, or its client left and the filter stopped waiting) is
//! skipped. Tenants are remembered only while they have a turn ahead of their class's
//! (at most [`MAX_TENANTS`] per pool; beyond that a tenant is treated as a newcomer).

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::config::AdmissionConfig;
use crate::load::ReplicaLoad;

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
}

/// A pool's admission gate.
#[derive(Debug)]
pub struct Gate {
    kv_blocks: u64,
    engine_signals: bool,
    max_engine_waiting: u64,
    retry_after_secs: u32,
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
}

#[derive(Debug, Default)]
struct Queue {
    waiting: BTreeMap<Key, oneshot::Sender<()>>,
    /// Waiters per class.
    queued: Vec<usize>,
    /// Per class, the turn of the last waiter woken.
    turn: Vec<u64>,
    /// Each tenant's last turn, by class and tenant hash.
    tenants: HashMap<(usize, u64), u64>,
    arrivals: u64,
    /// Calls of [`Gate::freed`] so far.
    releases: u64,
}

/// A request's place, kept across wake-ups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    key: Key,
    class: usize,
    /// Whether it has waited (and so counts against its class's `max_queued` already).
    queued: bool,
}

impl Ticket {
    /// Whether the request holding it has waited.
    pub fn waited(&self) -> bool {
        self.queued
    }
}

impl Gate {
    /// A gate with `config`'s thresholds, classes and bounds.
    pub fn new(config: &AdmissionConfig) -> Gate {
        let mut classes: Vec<Class> = config
            .classes
            .iter()
            .map(|c| Class {
                name: c.name.clone(),
                rank: 0,
                max_wait: Duration::from_millis(c.max_queue_ms.unwrap_or(config.max_queue_ms)),
                max_queued: c.max_queued.unwrap_or(config.max_queued),
                kv_fraction: c.kv_fraction.unwrap_or(config.kv_fraction),
                max_prefill_tokens: c.max_prefill_tokens.unwrap_or(config.max_prefill_tokens),
            })
            .collect();
        if classes.is_empty() {
            classes.push(Class {
                name: "default".into(),
                rank: 0,
                max_wait: Duration::from_millis(config.max_queue_ms),
                max_queued: config.max_queued,
                kv_fraction: config.kv_fraction,
                max_prefill_tokens: config.max_prefill_tokens,
            });
        }
        let mut by_priority: Vec<usize> = (0..classes.len()).collect();
        by_priority.sort_by_key(|&i| std::cmp::Reverse(config.classes.get(i).map_or(0, |c| c.priority)));
        for (rank, &i) in by_priority.iter().enumerate() {
            classes[i].rank = rank;
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
        self.saturated_for(load, self.default_class)
    }

    /// Whether a replica with this load takes no more requests of `class`: by kvgate's books
    /// (KV capacity configured, else as its engine reports it) against the class's share, or,
    /// with `engine_signals`, by what its engine last said.
    pub fn saturated_for(&self, load: &ReplicaLoad, class: usize) -> bool {
        let Class { kv_fraction, max_prefill_tokens, .. } = self.classes[class];
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

    /// A class's name, for metrics.
    pub fn class_name(&self, class: usize) -> &str {
        &self.classes[class].name
    }

    /// The longest a request of `class` waits.
    pub fn max_wait(&self, class: usize) -> Duration {
        self.classes[class].max_wait
    }

    /// How many requests wait.
    pub fn waiting(&self) -> usize {
        self.lock().waiting.len()
    }

    /// How many times capacity was freed: read before deciding, handed to [`Gate::wait`], so
    /// that a release between the decision and the wait is not missed.
    pub fn releases(&self) -> u64 {
        self.lock().releases
    }

    /// A place for a request of `class` from `tenant`: its tenant's next turn, no earlier than
    /// the class's current one.
    pub fn ticket(&self, class: usize, tenant: Option<&str>) -> Ticket {
        let mut queue = self.lock();
        queue.arrivals += 1;
        let current = queue.turn[class];
        let turn = match tenant {
            None => current + 1,
            Some(tenant) => {
                let mut hasher = std::collections::hash_map::DefaultHasher::new();
                tenant.hash(&mut hasher);
                let id = (class, hasher.finish());
                let turn = queue.tenants.get(&id).map_or(current, |&last| last.max(current)) + 1;
                if queue.tenants.len() >= MAX_TENANTS {
                    let turns = queue.turn.clone();
                    queue.tenants.retain(|&(c, _), &mut last| last > turns[c]);
                }
                if queue.tenants.len() < MAX_TENANTS {
                    queue.tenants.insert(id, turn);
                }
                turn
            }
        };
        let key = Key { rank: self.classes[class].rank, turn, arrival: queue.arrivals };
        Ticket { key, class, queued: false }
    }

    /// Whether a request holding `ticket` may decide now: nobody waits ahead of it.
    pub fn may_decide(&self, ticket: &Ticket) -> bool {
        self.lock().waiting.keys().next().is_none_or(|first| ticket.key <= *first)
    }

    /// Waits for capacity until `until`, in the place `ticket` holds. `seen` is
    /// [`Gate::releases`] as read before the decision that found the pool full: if capacity
    /// was freed since, it returns at once. Returns why the request is shed, if it is.
    pub async fn wait(&self, ticket: &mut Ticket, seen: u64, until: Instant) -> Result<(), ShedReason> {
        let woken = {
            let mut queue = self.lock();
            if !ticket.queued && queue.queued[ticket.class] >= self.classes[ticket.class].max_queued {
                return Err(ShedReason::QueueFull);
            }
            if queue.releases != seen {
                return Ok(());
            }
            if Instant::now() >= until {
                return Err(ShedReason::QueueTime);
            }
            if !ticket.queued {
                ticket.queued = true;
                queue.queued[ticket.class] += 1;
            }
            let (tx, rx) = oneshot::channel();
            queue.waiting.insert(ticket.key, tx);
            rx
        };
        let woken = tokio::time::timeout_at(until.into(), woken).await;
        if matches!(woken, Ok(Ok(()))) {
            return Ok(());
        }
        // Timed out: leave the queue. A wake-up that raced with the timeout goes on to the
        // next waiter.
        let was_waiting = self.lock().waiting.remove(&ticket.key).is_some();
        if !was_waiting {
            self.freed();
        }
        self.leave(ticket);
        Err(ShedReason::QueueTime)
    }

    /// The request is done waiting (admitted or shed): it no longer counts against its class.
    pub fn leave(&self, ticket: &mut Ticket) {
        if std::mem::take(&mut ticket.queued) {
            let mut queue = self.lock();
            queue.queued[ticket.class] = queue.queued[ticket.class].saturating_sub(1);
        }
    }

    /// Capacity may have freed: wakes the first waiter that is still waiting.
    pub fn freed(&self) {
        let mut queue = self.lock();
        queue.releases += 1;
        while let Some((key, waiter)) = queue.waiting.pop_first() {
            let class = self.classes.iter().position(|c| c.rank == key.rank).unwrap_or_default();
            queue.turn[class] = queue.turn[class].max(key.turn);
            if waiter.send(()).is_ok() {
                return;
            }
        }
    }

    /// The `Retry-After` for a shed request, in seconds.
    pub fn retry_after_secs(&self) -> u32 {
        self.retry_after_secs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ClassConfig;
    use crate::load::engine_metrics::EngineReport;
    use std::sync::Arc;

    fn gate(max_queued: usize, classes: Vec<ClassConfig>) -> Arc<Gate> {
        Arc::new(Gate::new(&AdmissionConfig {
            enabled: true,
            kv_blocks: 100,
            max_prefill_tokens: 1000,
            max_queued,
            classes,
            ..AdmissionConfig::default()
        }))
    }

    fn class(name: &str, priority: i32) -> ClassConfig {
        ClassConfig { name: name.into(), priority, ..ClassConfig::default() }
    }

    /// Starts a waiter and returns once it is in the queue.
    async fn waiter(g: &Arc<Gate>, mut ticket: Ticket) -> tokio::task::JoinHandle<(Ticket, Result<(), ShedReason>)> {
        let before = g.waiting();
        let far = Instant::now() + Duration::from_secs(10);
        let handle = tokio::spawn({
            let g = g.clone();
            async move {
                let result = g.wait(&mut ticket, g.releases(), far).await;
                (ticket, result)
            }
        });
        while g.waiting() == before {
            tokio::task::yield_now().await;
        }
        handle
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
    async fn waiters_wake_in_order_and_keep_their_place() {
        let g = gate(8, Vec::new());
        let first = waiter(&g, g.ticket(0, None)).await;
        let second = waiter(&g, g.ticket(0, None)).await;
        assert!(!g.may_decide(&g.ticket(0, None)), "a newcomer does not overtake");
        g.freed();
        let (mut ticket, woken) = first.await.unwrap();
        assert_eq!(woken, Ok(()));
        assert!(g.may_decide(&ticket), "the woken first decides before the one still waiting");
        // Still full: it waits again, ahead of the second.
        let again = waiter(&g, ticket).await;
        g.freed();
        let (again_ticket, woken) = again.await.unwrap();
        assert_eq!((again_ticket.key, woken), (ticket.key, Ok(())), "woken first again");
        g.leave(&mut ticket);
        g.freed();
        assert_eq!(second.await.unwrap().1, Ok(()));
    }

    #[tokio::test]
    async fn a_higher_class_goes_first_and_tenants_take_turns() {
        let g = gate(16, vec![class("batch", 0), class("interactive", 10)]);
        let (batch, interactive) = (g.class_of(Some("batch")), g.class_of(Some("interactive")));
        assert_eq!(g.class_of(None), batch, "the lowest class is the default");
        assert_eq!(g.class_of(Some("unknown")), batch);
        let mut order = Vec::new();
        // A bursting tenant queues three batch requests, then a quiet one queues one; then an
        // interactive request arrives last of all.
        for (who, class, tenant) in [
            ("noisy-1", batch, "noisy"),
            ("noisy-2", batch, "noisy"),
            ("noisy-3", batch, "noisy"),
            ("quiet-1", batch, "quiet"),
            ("chat", interactive, "noisy"),
        ] {
            order.push((who, waiter(&g, g.ticket(class, Some(tenant))).await));
        }
        let mut woken = Vec::new();
        for _ in 0..order.len() {
            g.freed();
            tokio::task::yield_now().await;
            for (who, handle) in &mut order {
                if !woken.contains(who) && handle.is_finished() {
                    woken.push(*who);
                }
            }
        }
        assert_eq!(woken, ["chat", "noisy-1", "quiet-1", "noisy-2", "noisy-3"]);
    }

    #[test]
    fn a_lower_class_leaves_headroom_for_a_higher_one() {
        let batch = ClassConfig { kv_fraction: Some(0.5), ..class("batch", 0) };
        let g = gate(8, vec![batch, class("interactive", 10)]);
        let load = ReplicaLoad { active_blocks: 60, ..Default::default() };
        assert!(g.saturated_for(&load, g.class_of(Some("batch"))), "batch stops at 50 of 100 blocks");
        assert!(!g.saturated_for(&load, g.class_of(Some("interactive"))), "interactive goes on to 90");
    }

    #[tokio::test]
    async fn a_full_class_and_a_long_wait_are_shed() {
        let g = gate(1, Vec::new());
        let soon = Instant::now() + Duration::from_millis(50);
        let mut first = g.ticket(0, None);
        let waiting = tokio::spawn({
            let g = g.clone();
            async move { g.wait(&mut first, g.releases(), soon).await }
        });
        while g.waiting() < 1 {
            tokio::task::yield_now().await;
        }
        assert_eq!(g.wait(&mut g.ticket(0, None), g.releases(), soon).await, Err(ShedReason::QueueFull));
        assert_eq!(waiting.await.unwrap(), Err(ShedReason::QueueTime));
        assert_eq!(g.waiting(), 0, "a waiter that timed out leaves the queue");
        let next = waiter(&g, g.ticket(0, None)).await;
        g.freed();
        assert_eq!(next.await.unwrap().1, Ok(()), "its place in the class is free again");
    }

    #[tokio::test]
    async fn a_release_before_the_wait_is_not_missed() {
        let g = gate(1, Vec::new());
        let seen = g.releases();
        g.freed();
        let far = Instant::now() + Duration::from_secs(10);
        assert!(g.wait(&mut g.ticket(0, None), seen, far).await.is_ok(), "returns at once to decide again");
        assert_eq!(g.waiting(), 0);
    }
}
