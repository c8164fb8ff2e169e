//! Admission control: whether a replica is saturated, judged from kvgate's own books, and the
//! queue of requests that wait for capacity while every replica of their pool is.
//!
//! The rules:
//! - a replica is saturated once the blocks booked on it reach `kv_fraction × kv_blocks`, or
//!   the prefill tokens booked on it reach `max_prefill_tokens` (either criterion off at 0);
//! - a request that finds every candidate saturated takes a ticket and waits; so does one
//!   that finds others already waiting (no overtaking); a request routes only as the head of
//!   the queue or when nobody waits;
//! - capacity frees when a booked request reaches its first token or ends (or a replica
//!   joins): the oldest waiter wakes and decides again, so it goes where its prefix is cached
//!   *now*; if it routes, the next one is woken too (one release may make room for several),
//!   and if it finds the pool still full it waits again, keeping its place;
//! - a request is shed when the queue holds `max_queued` already, or when its wait would pass
//!   `max_queue_ms` or what the filter said it waits.
//!
//! Waiters are woken in arrival order; a waiter that gave up (timed out, or its client left
//! and the filter stopped waiting) is skipped.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Instant;

use tokio::sync::oneshot;

use crate::config::AdmissionConfig;
use crate::load::ReplicaLoad;

/// Why a request was shed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShedReason {
    /// The queue was full.
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

/// A pool's admission gate.
#[derive(Debug)]
pub struct Gate {
    config: AdmissionConfig,
    queue: Mutex<Queue>,
}

#[derive(Debug, Default)]
struct Queue {
    /// Waiters by arrival number: the first is the oldest.
    waiting: BTreeMap<u64, oneshot::Sender<()>>,
    next: u64,
    /// Calls of [`Gate::freed`] so far.
    releases: u64,
}

/// A place in the queue, kept across wake-ups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket(u64);

impl Gate {
    /// A gate with `config`'s thresholds and bounds.
    pub fn new(config: AdmissionConfig) -> Gate {
        Gate { config, queue: Mutex::new(Queue::default()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a replica with this load takes no more requests.
    pub fn saturated(&self, load: &ReplicaLoad) -> bool {
        let c = &self.config;
        let kv_full = c.kv_blocks > 0 && load.active_blocks as f64 >= c.kv_fraction * c.kv_blocks as f64;
        let prefill_full = c.max_prefill_tokens > 0 && load.prefill_tokens >= c.max_prefill_tokens;
        kv_full || prefill_full
    }

    /// How many times capacity was freed: read before deciding, handed to [`Gate::wait`], so
    /// that a release between the decision and the wait is not missed.
    pub fn releases(&self) -> u64 {
        self.lock().releases
    }

    /// How many requests wait.
    pub fn waiting(&self) -> usize {
        self.lock().waiting.len()
    }

    /// Whether a request holding `ticket` (or a new one, `None`) may decide now: nobody older
    /// waits.
    pub fn may_decide(&self, ticket: Option<Ticket>) -> bool {
        let queue = self.lock();
        match (queue.waiting.keys().next(), ticket) {
            (None, _) => true,
            (Some(&oldest), Some(Ticket(mine))) => mine <= oldest,
            (Some(_), None) => false,
        }
    }

    /// Waits for capacity until `until`, in the place `ticket` holds (a new place at the back
    /// for `None`). `seen` is [`Gate::releases`] as read before the decision that found the
    /// pool full: if capacity was freed since, it returns at once. Returns the ticket to decide
    /// with, or why the request is shed.
    pub async fn wait(&self, ticket: Option<Ticket>, seen: u64, until: Instant) -> Result<Ticket, ShedReason> {
        let (ticket, woken) = {
            let mut queue = self.lock();
            if ticket.is_none() && queue.waiting.len() >= self.config.max_queued {
                return Err(ShedReason::QueueFull);
            }
            let ticket = ticket.unwrap_or_else(|| {
                queue.next += 1;
                Ticket(queue.next)
            });
            if queue.releases != seen {
                return Ok(ticket);
            }
            if Instant::now() >= until {
                return Err(ShedReason::QueueTime);
            }
            let (tx, rx) = oneshot::channel();
            queue.waiting.insert(ticket.0, tx);
            (ticket, rx)
        };
        let woken = tokio::time::timeout_at(until.into(), woken).await;
        if !matches!(woken, Ok(Ok(()))) {
            // Timed out: leave the queue. A wake-up that raced with the timeout goes on to the
            // next waiter.
            let was_waiting = self.lock().waiting.remove(&ticket.0).is_some();
            if !was_waiting {
                self.freed();
            }
            return Err(ShedReason::QueueTime);
        }
        Ok(ticket)
    }

    /// Capacity may have freed: wakes the oldest waiter that is still waiting.
    pub fn freed(&self) {
        let mut queue = self.lock();
        queue.releases += 1;
        while let Some((_, waiter)) = queue.waiting.pop_first() {
            if waiter.send(()).is_ok() {
                return;
            }
        }
    }

    /// The `Retry-After` for a shed request, in seconds.
    pub fn retry_after_secs(&self) -> u32 {
        self.config.retry_after_secs
    }

    /// The longest a request waits.
    pub fn max_wait(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.config.max_queue_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    fn gate(max_queued: usize) -> Arc<Gate> {
        Arc::new(Gate::new(AdmissionConfig {
            enabled: true,
            kv_blocks: 100,
            max_prefill_tokens: 1000,
            max_queued,
            ..AdmissionConfig::default()
        }))
    }

    #[test]
    fn saturation_is_either_threshold() {
        let g = gate(1);
        let load = |active_blocks, prefill_tokens| ReplicaLoad { active_blocks, prefill_tokens, ..Default::default() };
        assert!(!g.saturated(&load(89, 999)));
        assert!(g.saturated(&load(90, 0)), "90 % of 100 blocks");
        assert!(g.saturated(&load(0, 1000)), "the prefill backlog");
    }

    #[tokio::test]
    async fn waiters_wake_oldest_first_and_keep_their_place() {
        let g = gate(8);
        let far = Instant::now() + Duration::from_secs(10);
        let first = tokio::spawn({
            let g = g.clone();
            async move { g.wait(None, g.releases(), far).await }
        });
        while g.waiting() < 1 {
            tokio::task::yield_now().await;
        }
        let second = tokio::spawn({
            let g = g.clone();
            async move { g.wait(None, g.releases(), far).await }
        });
        while g.waiting() < 2 {
            tokio::task::yield_now().await;
        }
        assert!(!g.may_decide(None), "a newcomer does not overtake");
        g.freed();
        let ticket = first.await.unwrap().unwrap();
        assert!(g.may_decide(Some(ticket)), "the woken oldest decides before the one still waiting");
        // Still full: it waits again, ahead of the second.
        let again = tokio::spawn({
            let g = g.clone();
            async move { g.wait(Some(ticket), g.releases(), far).await }
        });
        while g.waiting() < 2 {
            tokio::task::yield_now().await;
        }
        g.freed();
        assert_eq!(again.await.unwrap(), Ok(ticket), "woken first again");
        g.freed();
        assert!(second.await.unwrap().is_ok());
    }

    #[tokio::test]
    async fn a_full_queue_and_a_long_wait_are_shed() {
        let g = gate(1);
        let soon = Instant::now() + Duration::from_millis(50);
        let waiting = tokio::spawn({
            let g = g.clone();
            async move { g.wait(None, g.releases(), soon).await }
        });
        while g.waiting() < 1 {
            tokio::task::yield_now().await;
        }
        assert_eq!(g.wait(None, g.releases(), soon).await, Err(ShedReason::QueueFull));
        assert_eq!(waiting.await.unwrap(), Err(ShedReason::QueueTime));
        assert_eq!(g.waiting(), 0, "a waiter that timed out leaves the queue");
    }

    #[tokio::test]
    async fn a_release_before_the_wait_is_not_missed() {
        let g = gate(1);
        let seen = g.releases();
        g.freed();
        let far = Instant::now() + Duration::from_secs(10);
        assert!(g.wait(None, seen, far).await.is_ok(), "returns at once to decide again");
        assert_eq!(g.waiting(), 0);
    }
}
