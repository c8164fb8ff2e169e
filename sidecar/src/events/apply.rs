//! The pool's applier: the one thread that writes a pool's KV index.
//!
//! The ingest workers ([`super::transport`]) decode each replica's messages and replay its gaps
//! with no lock held, and sends the resulting [`Change`]s here as a [`Job`]. The applier
//! takes the index's write lock for one bounded batch at a time — at most [`BATCH_BLOCKS`]
//! blocks, across as many queued jobs as fit — and releases it between batches, so a routing
//! decision never waits behind more than one batch, however fast the engines publish and
//! however long a replay takes.
//!
//! - Jobs of one replica are applied in the order they were sent; jobs of different replicas
//!   interleave.
//! - A job whose replica left the pool (its stop flag, checked under the lock) is dropped: the
//!   slot was emptied under the same lock after the flag was set, so nothing may be written.
//! - Health and metrics are updated once a job is applied, outside the lock.
//! - The job queue is bounded: an ingest worker that outruns the applier waits, a socket's
//!   inbox fills, and messages are dropped and counted there (then replayed as gaps).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::ingest::{Change, Planned, Progress};
use crate::index::ReplicaIdx;
use crate::metrics::Metrics;
use crate::pool::Pool;

/// The most blocks one write-lock hold applies. The index applies about 10–20 M blocks/s on
/// one core, so a batch holds the lock for about 6–12 µs (a compaction it triggers can take
/// longer): a decision that arrives during one waits about that long. Larger batches save
/// nothing measurable (a lock hold costs tens of nanoseconds) and lengthen the decisions'
/// tail under a full-speed ingest (`docs/benchmarks/contention.md`).
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
    /// Its event threads' stop flag: set when it left the pool.
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

/// A job being applied: how far, and the stores the index refused so far.
struct InProgress {
    job: Job,
    next: usize,
    refused: Vec<&'static str>,
}

fn run(pool: &Pool, metrics: &Metrics, rx: &Receiver<Job>, stop: &AtomicBool) {
    let mut queue: VecDeque<InProgress> = VecDeque::new();
    let start = |job| InProgress { job, next: 0, refused: Vec::new() };
    while !stop.load(Ordering::Relaxed) {
        if queue.is_empty() {
            match rx.recv_timeout(POLL) {
                Ok(job) => queue.push_back(start(job)),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
        while queue.len() < TAKEN_JOBS {
            let Ok(job) = rx.try_recv() else { break };
            queue.push_back(start(job));
        }
        for (job, applied) in apply_batch(pool, &mut queue) {
            if applied {
                finish(pool, metrics, job);
            }
        }
    }
}

/// Applies up to [`BATCH_BLOCKS`] blocks of the queued jobs under one write-lock hold.
/// Returns the jobs that are done: applied (true), or dropped because their replica left.
fn apply_batch(pool: &Pool, queue: &mut VecDeque<InProgress>) -> Vec<(InProgress, bool)> {
    let mut done = Vec::new();
    let mut budget = BATCH_BLOCKS;
    let mut index = pool.index_mut();
    while budget > 0 {
        let Some(current) = queue.front_mut() else { break };
        if current.job.stop.load(Ordering::Relaxed) {
            done.extend(queue.pop_front().map(|j| (j, false)));
            continue;
        }
        let changes: &[Change] = &current.job.planned.changes;
        while current.next < changes.len() && budget > 0 {
            let change = &changes[current.next];
            budget = budget.saturating_sub(change.blocks());
            if let Err(reason) = change.apply(current.job.replica, &mut index) {
                current.refused.push(reason);
            }
            current.next += 1;
        }
        if current.next == changes.len() {
            done.extend(queue.pop_front().map(|j| (j, true)));
        }
    }
    done
}

/// A job is applied: its replica's health and the event metrics.
fn finish(pool: &Pool, metrics: &Metrics, done: InProgress) {
    let InProgress { job, refused, .. } = done;
    let mut outcome = job.planned.outcome;
    outcome.refused(refused);
    pool.after_ingest(job.replica, job.progress, &outcome);
    let labels = pool.labels(job.replica);
    metrics.events_applied.get_or_create(&labels).inc_by(outcome.applied);
    metrics.gaps_replayed.get_or_create(&labels).inc_by(outcome.gaps_replayed);
    metrics.gaps_lost.get_or_create(&labels).inc_by(outcome.gaps_lost);
    for reason in &outcome.dropped {
        metrics.dropped(&labels, reason);
    }
}
