//! One pool: a model's replicas, its KV index and load table, and the routing decision.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use kvgate_shared::wire::{RouteRequest, RouteResponse};
use serde::Serialize;

use crate::config::PoolConfig;
use crate::index::{KvIndex, ReplicaIdx};
use crate::load::{LoadTable, NewBooking};
use crate::metrics::{Metrics, ReplicaLabels};
use crate::score::{self, Candidate, RequestShape, ScoringConfig};

/// Per-replica ingestion counters, shown in `/debug/state`.
#[derive(Debug, Default)]
pub struct ReplicaStats {
    /// Events applied to the index.
    pub events_applied: AtomicU64,
    /// The last sequence number received plus one (0: nothing yet).
    pub next_seq: AtomicU64,
}

/// A model's pool of replicas.
pub struct Pool {
    /// The pool's settings.
    pub config: PoolConfig,
    /// Which replica holds which blocks.
    pub index: RwLock<KvIndex>,
    /// What each replica is busy with.
    pub load: Mutex<LoadTable>,
    /// Ingestion counters, by replica index.
    pub stats: Vec<ReplicaStats>,
    /// The encoded [`kvgate_shared::wire::ModelBundle`] served to filters.
    pub bundle: Vec<u8>,
    metrics: Arc<Metrics>,
}

/// One replica in `/debug/state`.
#[derive(Debug, Serialize)]
pub struct ReplicaState {
    /// Replica id.
    pub id: String,
    /// `ip:port`.
    pub endpoint: String,
    /// Blocks indexed.
    pub blocks_indexed: usize,
    /// Booked, unfinished requests.
    pub active_requests: u64,
    /// Booked prefill tokens.
    pub prefill_tokens: u64,
    /// Unique active blocks.
    pub active_blocks: u64,
    /// KV events applied.
    pub events_applied: u64,
}

/// One pool in `/debug/state`.
#[derive(Debug, Serialize)]
pub struct PoolState {
    /// Model name.
    pub model: String,
    /// Block size.
    pub block_size: u32,
    /// Replicas, in config order.
    pub replicas: Vec<ReplicaState>,
}

// Locks are only poisoned if a holder panicked; the data is still consistent enough to serve.
fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|e| e.into_inner())
}

impl Pool {
    /// An empty pool.
    pub fn new(config: PoolConfig, bundle: Vec<u8>, metrics: Arc<Metrics>) -> Pool {
        let n = config.replicas.len();
        Pool {
            index: RwLock::new(KvIndex::new(config.block_size as usize, n)),
            load: Mutex::new(LoadTable::new(n)),
            stats: (0..n).map(|_| ReplicaStats::default()).collect(),
            config,
            bundle,
            metrics,
        }
    }

    /// Metric labels for a replica.
    pub fn labels(&self, replica: ReplicaIdx) -> ReplicaLabels {
        ReplicaLabels { model: self.config.model.clone(), replica: self.config.replicas[replica].id.clone() }
    }

    /// Exclusive access to the index (for the event subscribers).
    pub fn index_mut(&self) -> std::sync::RwLockWriteGuard<'_, KvIndex> {
        self.index.write().unwrap_or_else(|e| e.into_inner())
    }

    fn load_table(&self) -> std::sync::MutexGuard<'_, LoadTable> {
        self.load.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Scores every replica and books the request on the cheapest, atomically (no herding:
    /// concurrent requests see each other's bookings).
    pub fn route(&self, req: &RouteRequest, scoring: &ScoringConfig) -> RouteResponse {
        let bs = u64::from(self.config.block_size);
        // Hashes computed with another block size would match nothing correctly: drop them.
        let hashes: &[u64] = if req.block_size == self.config.block_size { &req.block_hashes } else { &[] };
        let overlaps = read(&self.index).find_matches(hashes);
        let prompt_tokens = u64::from(req.prompt_tokens);
        let total_blocks = prompt_tokens.div_ceil(bs);
        let mut load = self.load_table();
        let candidates: Vec<Candidate> = (0..self.config.replicas.len())
            .map(|i| {
                let l = load.load(i);
                Candidate {
                    overlap_blocks: overlaps[i],
                    prefill_tokens: l.prefill_tokens,
                    decode_blocks: l.active_blocks + load.additional_blocks(i, hashes, total_blocks),
                    requests: l.requests,
                }
            })
            .collect();
        let logits = score::logits(scoring, RequestShape { prompt_tokens, block_size: bs }, &candidates);
        let Some(best) = score::argmin(&logits, &mut rand::rng()) else {
            return RouteResponse { endpoint: None, replica: None, overlap_blocks: 0 };
        };
        let overlap = overlaps[best];
        let cached_tokens = (u64::from(overlap) * bs).min(prompt_tokens);
        load.book(
            best,
            NewBooking {
                request_id: &req.request_id,
                prefill_tokens: prompt_tokens - cached_tokens,
                hashes,
                total_blocks,
            },
            Instant::now(),
        );
        self.publish_load(&load, best);
        let replica = &self.config.replicas[best];
        self.metrics.route_decisions.get_or_create(&self.labels(best)).inc();
        RouteResponse {
            endpoint: Some(replica.endpoint.to_string()),
            replica: Some(replica.id.clone()),
            overlap_blocks: overlap,
        }
    }

    /// Applies a lifecycle report. Returns false if the request is not booked in this pool.
    pub fn lifecycle(&self, request_id: &str, first_token: bool) -> bool {
        let mut load = self.load_table();
        let known = if first_token { load.prefill_done(request_id) } else { load.finish(request_id) };
        for i in 0..self.config.replicas.len() {
            self.publish_load(&load, i);
        }
        known
    }

    /// Releases bookings older than `max_age`.
    pub fn expire(&self, max_age: std::time::Duration) -> usize {
        let mut load = self.load_table();
        let n = load.expire(Instant::now(), max_age);
        for i in 0..self.config.replicas.len() {
            self.publish_load(&load, i);
        }
        n
    }

    fn publish_load(&self, load: &LoadTable, replica: ReplicaIdx) {
        let l = load.load(replica);
        let labels = self.labels(replica);
        self.metrics.active_requests.get_or_create(&labels).set(l.requests as i64);
        self.metrics.prefill_tokens.get_or_create(&labels).set(l.prefill_tokens as i64);
    }

    /// A snapshot for `/debug/state`.
    pub fn state(&self) -> PoolState {
        let index = read(&self.index);
        let load = self.load_table();
        let replicas = self
            .config
            .replicas
            .iter()
            .enumerate()
            .map(|(i, r)| {
                let l = load.load(i);
                ReplicaState {
                    id: r.id.clone(),
                    endpoint: r.endpoint.to_string(),
                    blocks_indexed: index.replica_blocks(i),
                    active_requests: l.requests,
                    prefill_tokens: l.prefill_tokens,
                    active_blocks: l.active_blocks,
                    events_applied: self.stats[i].events_applied.load(Ordering::Relaxed),
                }
            })
            .collect();
        PoolState { model: self.config.model.clone(), block_size: self.config.block_size, replicas }
    }
}
