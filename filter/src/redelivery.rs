//! Lifecycle batches that did not reach the sidecar, kept to be sent again: pure bookkeeping,
//! no hostcalls, so the rules are unit-tested natively.
//!
//! - A batch whose POST failed (not dispatched, no answer, an answer other than 204) is sent
//!   again after `retry`, doubling with each failure up to [`MAX_BACKOFF`], at most
//!   [`MAX_ATTEMPTS`] times in all; then it is dropped and counted.
//! - At most [`MAX_BATCHES`] wait; past that the oldest is dropped and counted.
//! - Sending a report twice is harmless: the sidecar's lifecycle is idempotent (a second
//!   first-token or end of the same booking key changes nothing).

use std::collections::VecDeque;
use std::time::{Duration, SystemTime};

use crate::fetches::backoff;

/// Sends of one batch, the first included.
pub const MAX_ATTEMPTS: u32 = 8;
/// Batches waiting at most.
pub const MAX_BATCHES: usize = 256;
/// The longest wait between two sends of a batch.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// A batch to send again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    /// The encoded batch.
    pub body: Vec<u8>,
    /// Sends so far.
    pub attempts: u32,
    /// Not sent again before this.
    pub at: SystemTime,
}

/// The batches waiting to be sent again.
#[derive(Debug, Default)]
pub struct Redelivery {
    waiting: VecDeque<Pending>,
    dropped: u64,
}

impl Redelivery {
    /// A send of `body` (its `attempts`-th) failed: keeps it for later, unless it has been
    /// tried enough. Returns false if it was dropped.
    pub fn failed(&mut self, body: Vec<u8>, attempts: u32, retry: Duration, now: SystemTime) -> bool {
        if attempts >= MAX_ATTEMPTS {
            self.dropped += 1;
            return false;
        }
        if self.waiting.len() == MAX_BATCHES {
            self.waiting.pop_front();
            self.dropped += 1;
        }
        let wait = backoff(retry, attempts, MAX_BACKOFF);
        self.waiting.push_back(Pending { body, attempts, at: now + wait });
        true
    }

    /// The batches due at `now`, taken out of the queue.
    pub fn due(&mut self, now: SystemTime) -> Vec<Pending> {
        let (due, waiting): (VecDeque<Pending>, VecDeque<Pending>) =
            std::mem::take(&mut self.waiting).into_iter().partition(|p| p.at <= now);
        self.waiting = waiting;
        due.into()
    }

    /// Batches dropped so far (tried too often, or crowded out).
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Batches waiting.
    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RETRY: Duration = Duration::from_millis(200);

    fn at(ms: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
    }

    #[test]
    fn a_failed_batch_comes_back_with_backoff_then_is_dropped() {
        let mut r = Redelivery::default();
        let (mut now, mut attempts, mut waits) = (0, 1, Vec::new());
        while r.failed(b"batch".to_vec(), attempts, RETRY, at(now)) {
            let due_at = r.waiting[0].at.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_millis() as u64;
            assert!(r.due(at(due_at - 1)).is_empty(), "not before its time");
            let due = r.due(at(due_at));
            assert_eq!(due.len(), 1);
            waits.push(due_at - now);
            (now, attempts) = (due_at, due[0].attempts + 1);
        }
        assert_eq!(waits, [200, 400, 800, 1600, 3200, 6400, 12800], "seven more sends after the first");
        assert_eq!((r.dropped(), r.len()), (1, 0));
    }

    #[test]
    fn the_queue_is_bounded_oldest_first() {
        let mut r = Redelivery::default();
        for i in 0..MAX_BATCHES + 3 {
            assert!(r.failed(vec![i as u8], 1, RETRY, at(0)));
        }
        assert_eq!((r.len(), r.dropped()), (MAX_BATCHES, 3));
        assert_eq!(r.due(at(1000))[0].body, vec![3], "the three oldest made room");
    }
}
