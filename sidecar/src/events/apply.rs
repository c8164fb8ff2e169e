//! The pool's applier: the one thread that writes a pool's KV index.
//!
//! The ingest workers ([`super::transport`]) decode each replica's messages and replay its gaps
//! with no lock held, and sends the resulting [`Change`]s here as a [`Job`]. The applier
//! writes the index in bounded batches — at most [`BATCH_BLOCKS`] blocks, across as many
//! queued jobs as fit — each on the standby copy of the pool's [`crate::index::Mirrored`]
//! index, made live when the batch ends: a routing decision never waits for the applier,
//! however fast the engines publish and however long a replay takes.
//!
//! - Jobs of one replica are applied in the order they were sent; jobs of different replicas
//!   interleave.
//! - A job whose replica left the pool (its stop flag, checked within the batch) is dropped:
//!   the slot is emptied in a later batch after the flag was set (batches never overlap), so
//!   nothing may be written.
//! - Health and metrics are updated once a job is applied, outside the lock.
//! - Each job ends with the replica's applied mark ([`Change::Mark`]), written in the same
//!   batch, so an export of the index always stands at a message boundary.
//! - The job queue is bounded: an ingest worker that outruns the applier waits, a socket's
//!   inbox fills, and messages are dropped and counted there (then replayed as gaps).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::ingest::Planned;
use crate::index::{Change, ReplicaIdx, Write};
use crate::metrics::Metrics;
use crate::msg::ingest::{Outcome, Progress};
use crate::pool::Pool;

/// The most blocks one batch applies. The index applies about 10–20 M blocks/s on one core,
/// so a batch takes about 6–12 µs (twice that with its replay on the other copy): events
/// become visible to decisions that soon after they are decoded. Decisions never wait for a
/// batch; a larger one would only delay what they see (`docs/benchmarks/contention.md`).
pub const BATCH_BLOCKS: usize = 128;
/// Jobs queued for the applier, all replicas together.
const QUEUED_JOBS: usize = 1024;
/// Jobs taken off the queue at once, so a batch can span the small messages of many replicas.
const TAKEN_JOBS: usize = 64;
/// How often an idle applier checks for shutdown.
const POLL: Duration = Duration::from_millis(200);

/// One message's changes to one replica's entries.
#[derive(Debug)]
pub struct Job {
    /// The replica's slot.
    pub replica: ReplicaIdx,
    /// Its events' stop flag: set when it left the pool.
    pub stop: Arc<AtomicBool>,
    /// The changes and what happened to the message.
    pub planned: Planned,
    /// The replica's ingestion state after the message.
    pub progress: Progress,
}

/// Where the ingest workers send their jobs.
#[derive(Debug, Clone)]
pub struct Applier {
    tx: SyncSender<Job>,
}

impl Applier {
    /// Starts `pool`'s applier thread; it runs until `stop` is set.
    pub fn spawn(
        pool: Arc<Pool>,
        metrics: Arc<Metrics>,
        stop: Arc<AtomicBool>,
    ) -> std::io::Result<(Applier, JoinHandle<()>)> {
        let (tx, rx) = sync_channel(QUEUED_JOBS);
        let name = format!("kv-apply-{}", pool.config().model);
        let thread = std::thread::Builder::new().name(name).spawn(move || run(&pool, &metrics, &rx, &stop))?;
        Ok((Applier { tx }, thread))
    }

    /// Queues a job, waiting while the queue is full. False once the applier has stopped.
    pub fn send(&self, job: Job) -> bool {
        self.tx.send(job).is_ok()
    }
}

/// A job being applied: its changes not applied yet, and the stores the index refused so far.
struct InProgress {
    replica: ReplicaIdx,
    stop: Arc<AtomicBool>,
    changes: std::iter::Peekable<std::vec::IntoIter<Change>>,
    outcome: Outcome,
    progress: Progress,
    refused: Vec<&'static str>,
}

impl InProgress {
    fn new(job: Job) -> InProgress {
        let Job { replica, stop, planned: Planned { changes, outcome }, progress } = job;
        InProgress { replica, stop, changes: changes.into_iter().peekable(), outcome, progress, refused: Vec::new() }
    }
}

fn run(pool: &Pool, metrics: &Metrics, rx: &Receiver<Job>, stop: &AtomicBool) {
    // Decisions never wait for this thread (they read the index's live copy), so it can give
    // way to them like the other event threads.
    crate::niceness::give_way_to_routing();
    let mut queue: VecDeque<InProgress> = VecDeque::new();
    while !stop.load(Ordering::Relaxed) {
        if queue.is_empty() {
            match rx.recv_timeout(POLL) {
                Ok(job) => queue.push_back(InProgress::new(job)),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
        while queue.len() < TAKEN_JOBS {
            let Ok(job) = rx.try_recv() else { break };
            queue.push_back(InProgress::new(job));
        }
        for (job, applied) in apply_batch(pool, &mut queue) {
            if applied {
                finish(pool, metrics, job);
            }
        }
    }
}

/// Applies up to [`BATCH_BLOCKS`] blocks of the queued jobs in one batch of the index's
/// writes (decisions see it when it ends). Returns the jobs that are done: applied (true), or
/// dropped because their replica left.
fn apply_batch(pool: &Pool, queue: &mut VecDeque<InProgress>) -> Vec<(InProgress, bool)> {
    let mut done = Vec::new();
    let mut budget = BATCH_BLOCKS;
    let mut index = pool.index_mut();
    while budget > 0 {
        let Some(current) = queue.front_mut() else { break };
        if current.stop.load(Ordering::Relaxed) {
            done.extend(queue.pop_front().map(|j| (j, false)));
            continue;
        }
        while budget > 0 {
            let Some(change) = current.changes.next() else { break };
            budget = budget.saturating_sub(change.blocks());
            if let Err(e) = index.apply(Write::Change(current.replica, change)) {
                current.refused.push(e.label());
            }
        }
        // The applied mark stands at a message boundary: the message's sequence number once
        // it is all in (none while a lost range may have left stale entries), unknown while
        // it is half applied. Peers export only marked replicas (`crate::sync::state`).
        let whole = current.changes.peek().is_none();
        let mark = (whole && !current.progress.degraded).then_some(current.progress.last_seq).flatten();
        let _ = index.apply(Write::Change(current.replica, Change::Mark(mark)));
        if whole {
            done.extend(queue.pop_front().map(|j| (j, true)));
        }
    }
    done
}

/// A job is applied: its replica's health and the event metrics.
fn finish(pool: &Pool, metrics: &Metrics, done: InProgress) {
    let InProgress { replica, mut outcome, progress, refused, .. } = done;
    outcome.refused(refused);
    pool.after_ingest(replica, progress, &outcome);
    if let Some(published) = outcome.published {
        metrics.event_lag_seconds.get_or_create(&pool.pool_labels()).observe(lag_since(published));
    }
    let labels = pool.labels(replica);
    metrics.events_applied.get_or_create(&labels).inc_by(outcome.applied);
    metrics.gaps_replayed.get_or_create(&labels).inc_by(outcome.gaps_replayed);
    metrics.gaps_lost.get_or_create(&labels).inc_by(outcome.gaps_lost);
    for reason in &outcome.dropped {
        metrics.dropped(&labels, reason);
    }
}

/// Seconds from `published` (Unix seconds, the engine's clock) to now; 0 when the engine's
/// clock is ahead.
fn lag_since(published: f64) -> f64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    (now - published).max(0.0)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kvgate_shared::hash::{EngineHash, Salt};

    use super::*;
    use crate::index::{StoredBlocks, Tier};
    use crate::pool::{PoolConfig, ReplicaConfig};

    fn pool() -> Pool {
        pool_with(Arc::new(Metrics::default()))
    }

    fn pool_with(metrics: Arc<Metrics>) -> Pool {
        let replica = ReplicaConfig::new("r0", "127.0.0.1:8000".parse().unwrap(), "tcp://127.0.0.1:1");
        Pool::new(PoolConfig::new("m", "unused", 4, vec![replica]), Vec::new(), metrics)
    }

    /// A message `seq` storing `chains` chains of `blocks` blocks, one change each.
    fn job(seq: u64, chains: u64, blocks: u64, degraded: bool) -> InProgress {
        let store = |c: u64| {
            let first = (seq * 10 + c) * 1000;
            Change::Store(StoredBlocks {
                parent: None,
                engine_hashes: (0..blocks).map(|b| EngineHash(first + b)).collect(),
                token_ids: (0..blocks * 4).map(|t| (first * 4 + t) as u32).collect(),
                block_size: 4,
                salt: Salt::NONE,
                extra: Vec::new(),
                tier: Tier::Device,
            })
        };
        InProgress::new(Job {
            replica: ReplicaIdx::new(0),
            stop: Arc::default(),
            planned: Planned { changes: (0..chains).map(store).collect(), outcome: Outcome::default() },
            progress: Progress { last_seq: Some(seq), degraded },
        })
    }

    /// What a starting peer would be handed: (sequence number, blocks) of the replica.
    fn exported(pool: &Pool) -> Option<(u64, usize)> {
        pool.export_handover("me").replicas.first().map(|r| (r.snapshot.through_seq, r.snapshot.blocks()))
    }

    #[test]
    fn a_replica_is_exported_only_at_message_boundaries_and_never_after_a_loss() {
        let pool = pool();
        // Three changes of 100 blocks: a batch (128 blocks) takes two.
        let mut queue = VecDeque::from([job(0, 3, 100, false)]);
        assert!(apply_batch(&pool, &mut queue).is_empty(), "the message spans two batches");
        assert_eq!(exported(&pool), None, "half applied: not exported");
        assert_eq!(apply_batch(&pool, &mut queue).len(), 1);
        assert_eq!(exported(&pool), Some((0, 300)));

        queue.push_back(job(1, 1, 1, true));
        assert_eq!(apply_batch(&pool, &mut queue).len(), 1);
        assert_eq!(exported(&pool), None, "a loss may have left stale entries");
    }

    #[test]
    fn lag_is_measured_from_the_engines_timestamp_to_the_batch_that_applies_it() {
        let metrics = Arc::new(Metrics::default());
        let pool = pool_with(metrics.clone());
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
        // Published 3 s ago, and by an engine whose clock is 60 s ahead.
        for (seq, published) in [(0, now - 3.0), (1, now + 60.0)] {
            let mut job = job(seq, 1, 1, false);
            job.outcome.published = Some(published);
            let mut queue = VecDeque::from([job]);
            for (done, applied) in apply_batch(&pool, &mut queue) {
                assert!(applied);
                finish(&pool, &metrics, done);
            }
        }
        let text = metrics.render();
        let bucket = |le: &str| {
            let line = format!("kvgate_kv_event_lag_seconds_bucket{{le=\"{le}\",model=\"m\"}} ");
            text.lines().find_map(|l| l.strip_prefix(&line)).unwrap_or_else(|| panic!("{line} in {text}")).to_owned()
        };
        assert_eq!(bucket("0.0005"), "1", "an engine clock ahead reads as no lag");
        assert_eq!(bucket("2.048"), "1", "the message published 3 s ago is later than 2 s");
        assert_eq!(bucket("4.096"), "2");
    }
}
