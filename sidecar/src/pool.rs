//! One pool: a model's replicas, its KV index and load table, their health, and the routing
//! decision.
//!
//! Membership changes at run time (config reload, DNS or Envoy discovery) through
//! [`Pool::set_members`]. Every replica has a slot for good: bookings, index entries and
//! metrics refer to slots by number, so a replica that leaves keeps its slot — emptied,
//! inactive, never a candidate — and gets it back if it returns.
//!
//! Locks are taken in one order — members, index, affinity, load table — and a replica's
//! metric labels (which read the members) are never looked up while the load table is held,
//! so a membership change can never deadlock with routing or lifecycle reports.

use std::collections::{BTreeSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kvgate_shared::hash::{prompt_block_hashes, Salt};
use kvgate_shared::prompt::openai::ParsedRequest;
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::wire::{ModelBundle, RouteBodyRequest, RouteRequest, RouteResponse};
use serde::Serialize;

use crate::config::{Policy, PoolConfig, ReplicaConfig};
use crate::events::ingest::{Outcome, Progress};
use crate::index::approx::ApproxIndex;
use crate::index::{KvIndex, Overlap, ReplicaIdx, Tier};
use crate::load::{LoadTable, NewBooking, ReplicaLoad};
use crate::metrics::{DecisionLabels, Metrics, ReasonLabels, ReplicaLabels};
use crate::score::{self, Candidate, RequestShape, ScoringConfig};
use crate::sync::event::{Outbox, SyncEvent};

/// No value yet, in the atomics below.
const NONE: u64 = u64::MAX;

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
    awaiting_events_since: AtomicU64,
}

impl Default for ReplicaHealth {
    fn default() -> Self {
        ReplicaHealth {
            events_applied: AtomicU64::new(0),
            last_seq: AtomicU64::new(NONE),
            degraded: AtomicBool::new(false),
            stalled: AtomicBool::new(false),
            disconnected: AtomicBool::new(false),
            awaiting_events_since: AtomicU64::new(NONE),
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
    /// In the pool now (false: it left; its slot is empty).
    pub active: bool,
    /// Its ingestion health.
    pub health: Arc<ReplicaHealth>,
    /// Set to stop its event threads (when it leaves or its endpoints change).
    pub stop: Arc<AtomicBool>,
    /// LoRA adapters its engine lists in `/v1/models` (see `adapters_poll_secs`).
    pub adapters: BTreeSet<String>,
}

impl Member {
    fn new((replica, rank): (ReplicaConfig, Option<u32>)) -> Member {
        Member { replica, rank, active: true, health: Arc::default(), stop: Arc::default(), adapters: BTreeSet::new() }
    }

    /// Whether it can serve a request for `model` in `pool`: the base model and configured
    /// adapters everywhere, learned adapters where its engine lists them.
    fn serves(&self, model: &str, pool: &PoolConfig) -> bool {
        model == pool.model || pool.adapters.iter().any(|a| a == model) || self.adapters.contains(model)
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

/// Segment-cache budget of the tokenizer used for offloaded prompts.
const OFFLOAD_SEGMENT_CACHE_BYTES: usize = 64 << 20;

/// A model's pool of replicas.
pub struct Pool {
    /// The pool's settings.
    pub config: PoolConfig,
    /// Which replica holds which blocks.
    pub index: RwLock<KvIndex>,
    /// What each replica is busy with.
    pub load: Mutex<LoadTable>,
    /// The replicas' slots, by replica index (the config's replicas first).
    members: RwLock<Vec<Member>>,
    /// The encoded [`kvgate_shared::wire::ModelBundle`] served to filters.
    bundle: Vec<u8>,
    /// How often filters fetched it (a model no filter ever fetched routes on load alone).
    bundles_served: AtomicU64,
    /// The same tokenizer, loaded on first use, for prompts the filter offloads.
    tokenizer: std::sync::OnceLock<Result<ModelTokenizer, String>>,
    metrics: Arc<Metrics>,
    started: Instant,
    /// The last decisions with every candidate's cost terms (`/debug/explain`), kept compact
    /// (indices, not names) so that recording costs no allocation per candidate.
    explanations: Mutex<VecDeque<Kept>>,
    /// The `round_robin` cursor.
    next: AtomicUsize,
    /// Where bookings and their lifecycle go for the other gateways (when sync is on).
    outbox: std::sync::OnceLock<Outbox>,
    /// Where this gateway sent which blocks: the `prefix_affinity` policy's overlap, or, for
    /// `kv_aware`, the in-flight credit (`inflight_credit_secs`).
    affinity: Mutex<ApproxIndex>,
}

/// Why an offloaded prompt was not routed.
#[derive(Debug, thiserror::Error)]
pub enum OffloadError {
    /// The pool's tokenizer failed to load, or failed on this prompt.
    #[error("cannot tokenize the prompt: {0}")]
    Tokenizer(String),
    /// The filter's budget ran out before the decision: nothing was booked.
    #[error("the filter's deadline passed before the prompt was routed")]
    Late,
}

/// Decisions kept for `/debug/explain`.
const EXPLANATIONS: usize = 256;

/// A kept decision, before names are attached.
#[derive(Debug)]
struct Kept {
    request_id: String,
    client_request_id: Option<String>,
    policy: Policy,
    prompt_tokens: u64,
    chosen: ReplicaIdx,
    /// (replica, cost inputs, logit, trusted) per candidate.
    candidates: Vec<(ReplicaIdx, Candidate, f64, bool)>,
}

/// One candidate's cost terms in a decision.
#[derive(Debug, Clone, Serialize)]
pub struct CandidateTerms {
    /// Replica id.
    pub replica: String,
    /// Whether its cache credit counted (false while its publisher is stalled).
    pub trusted: bool,
    /// Overlap in blocks per tier.
    pub overlap: Overlap,
    /// Booked prefill tokens before this request (`P_i`).
    pub prefill_tokens: u64,
    /// Active blocks plus this request's new ones (`D_i`).
    pub decode_blocks: u64,
    /// Active requests (`R_i`).
    pub requests: u64,
    /// The cost; lowest wins under `kv_aware` and `least_load`.
    pub logit: f64,
}

/// Why a request went where it went.
#[derive(Debug, Clone, Serialize)]
pub struct Explanation {
    /// The booking key the filter generated (`x-kvgate-booking-id` among its debug headers).
    pub request_id: String,
    /// The request's `x-request-id`, if it had one.
    pub client_request_id: Option<String>,
    /// The policy that decided.
    pub policy: Policy,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// The chosen replica.
    pub chosen: Option<String>,
    /// Every candidate, in pool order.
    pub candidates: Vec<CandidateTerms>,
}

/// One replica in `/debug/state`.
#[derive(Debug, Serialize)]
pub struct ReplicaState {
    /// Replica id.
    pub id: String,
    /// `ip:port`.
    pub endpoint: String,
    /// Blocks indexed, all tiers.
    pub blocks_indexed: usize,
    /// Blocks indexed on host memory.
    pub host_blocks: usize,
    /// Blocks indexed on disk/external storage.
    pub disk_blocks: usize,
    /// Booked, unfinished requests.
    pub active_requests: u64,
    /// Requests the engine reports beyond those (`engine_metrics_secs`).
    pub external_requests: u64,
    /// Booked prefill tokens.
    pub prefill_tokens: u64,
    /// Unique active blocks.
    pub active_blocks: u64,
    /// KV events applied.
    pub events_applied: u64,
    /// The last event sequence number applied.
    pub last_seq: Option<u64>,
    /// Events were lost since the engine's cache was last cleared (blocks indexed before the
    /// loss were dropped).
    pub degraded: bool,
    /// Its publisher went quiet while serving: no cache credit until events resume.
    pub stalled: bool,
    /// Its publisher's connection dropped: no cache credit until its next message.
    pub disconnected: bool,
    /// LoRA adapters its engine lists.
    pub adapters: Vec<String>,
}

/// One pool in `/debug/state`.
#[derive(Debug, Serialize)]
pub struct PoolState {
    /// Model name.
    pub model: String,
    /// Block size.
    pub block_size: u32,
    /// How often filters fetched the model's tokenizer bundle: 0 means every request of the
    /// model was routed on load alone (see the filter's `kvgate.tokenizer_missing.*` gauges).
    pub tokenizer_fetches: u64,
    /// Bookings held (every routed request until its end is reported or it expires).
    pub bookings: usize,
    /// Ends reported before their booking, remembered (at most 4096) so a late booking is not
    /// leaked.
    pub ended_early: usize,
    /// Active replicas, in slot order (the config's first).
    pub replicas: Vec<ReplicaState>,
}

// Locks are only poisoned if a holder panicked; the data is still consistent enough to serve.
fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|e| e.into_inner())
}

impl Pool {
    /// An empty pool.
    pub fn new(config: PoolConfig, bundle: Vec<u8>, metrics: Arc<Metrics>) -> Pool {
        let initial = targets(&config.replicas);
        let n = initial.len();
        let ttl = match config.policy {
            Policy::PrefixAffinity => config.affinity_ttl_secs,
            _ => config.inflight_credit_secs,
        };
        let affinity = ApproxIndex::new(config.affinity_blocks, Duration::from_secs(ttl));
        Pool {
            index: RwLock::new(KvIndex::new(config.block_size as usize, n)),
            load: Mutex::new(LoadTable::new(n)),
            members: RwLock::new(initial.into_iter().map(Member::new).collect()),
            config,
            bundle,
            bundles_served: AtomicU64::new(0),
            tokenizer: std::sync::OnceLock::new(),
            metrics,
            started: Instant::now(),
            explanations: Mutex::new(VecDeque::with_capacity(EXPLANATIONS)),
            next: AtomicUsize::new(0),
            affinity: Mutex::new(affinity),
            outbox: std::sync::OnceLock::new(),
        }
    }

    /// The replicas' slots.
    pub fn members(&self) -> std::sync::RwLockReadGuard<'_, Vec<Member>> {
        read(&self.members)
    }

    /// The active replicas' slots with their event-thread stop flags: what to start
    /// ingestion for at startup.
    pub fn active(&self) -> Vec<(ReplicaIdx, ReplicaConfig, Arc<AtomicBool>)> {
        let members = self.members();
        let active = members.iter().enumerate().filter(|(_, m)| m.active);
        active.map(|(i, m)| (i, m.replica.clone(), m.stop.clone())).collect()
    }

    /// Makes `replicas` the pool's membership. Unchanged replicas keep everything (index,
    /// bookings, health). A replica that left has its event threads stopped, its index
    /// entries and bookings dropped, and is no longer a candidate. A new replica — or one
    /// whose endpoints changed, which is a new engine as far as its cache goes — starts
    /// empty. Returns the slots whose event threads must be started, with their config and
    /// stop flag.
    pub fn set_members(&self, replicas: &[ReplicaConfig]) -> Vec<(ReplicaIdx, ReplicaConfig, Arc<AtomicBool>)> {
        let wanted_targets = targets(replicas);
        let mut members = self.members.write().unwrap_or_else(|e| e.into_inner());
        let mut start = Vec::new();
        for (i, m) in members.iter_mut().enumerate() {
            let wanted = wanted_targets.iter().find(|(r, _)| r.id == m.replica.id);
            if m.active && wanted.is_some_and(|(r, rank)| *r == m.replica && *rank == m.rank) {
                continue;
            }
            if m.active {
                self.retire(i, m);
            }
            if let Some(target) = wanted {
                tracing::info!(model = %self.config.model, replica = %target.0.id, endpoint = %target.0.endpoint, "replica joined");
                *m = Member::new(target.clone());
                start.push((i, target.0.clone(), m.stop.clone()));
            }
        }
        for target in wanted_targets {
            if members.iter().all(|m| m.replica.id != target.0.id) {
                let i = self.index_mut().add_replica();
                let j = self.load_table().add_replica();
                debug_assert_eq!((i, j), (members.len(), members.len()), "slots, index and load stay aligned");
                tracing::info!(model = %self.config.model, replica = %target.0.id, endpoint = %target.0.endpoint, "replica joined");
                let m = Member::new(target.clone());
                start.push((members.len(), target.0, m.stop.clone()));
                members.push(m);
            }
        }
        start
    }

    /// Takes a replica out: stops its event threads, then (under the index lock, so a
    /// stopped applier cannot write after it) drops its blocks and bookings.
    fn retire(&self, i: ReplicaIdx, m: &mut Member) {
        tracing::info!(model = %self.config.model, replica = %m.replica.id, "replica left");
        m.stop.store(true, Ordering::Relaxed);
        m.active = false;
        self.index_mut().clear_replica(i);
        self.affinity_index().clear_replica(i);
        let mut load = self.load_table();
        load.clear_replica(i);
        let labels = ReplicaLabels { model: self.config.model.clone(), replica: m.replica.id.clone() };
        self.metrics.index_blocks.get_or_create(&labels).set(0);
        self.metrics.active_requests.get_or_create(&labels).set(0);
        self.metrics.prefill_tokens.get_or_create(&labels).set(0);
    }

    /// Records the LoRA adapters the engine at `endpoint` lists (every DP rank of it). Returns
    /// whether anything changed.
    pub fn set_adapters(&self, endpoint: &str, adapters: &BTreeSet<String>) -> bool {
        let mut members = self.members.write().unwrap_or_else(|e| e.into_inner());
        let mut changed = false;
        for m in members.iter_mut().filter(|m| m.active && m.replica.endpoint.to_string() == endpoint) {
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

    fn affinity_index(&self) -> std::sync::MutexGuard<'_, ApproxIndex> {
        self.affinity.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records what an engine reports it is running (see [`crate::load::engine_metrics`]).
    pub fn observe_engine(&self, slot: ReplicaIdx, running: u64) {
        let figures = {
            let mut load = self.load_table();
            load.observe(slot, running);
            load.load(slot)
        };
        self.publish_load(slot, figures);
        self.metrics.external_requests.get_or_create(&self.labels(slot)).set(figures.external as i64);
    }

    /// Publishes this pool's bookings and their lifecycle to the other gateways from now on.
    pub fn set_outbox(&self, outbox: Outbox) {
        let _ = self.outbox.set(outbox);
    }

    /// Applies another gateway's booking or lifecycle event to the load table, under
    /// `origin/request_id`. A booking on a target this pool does not have is ignored.
    pub fn apply_remote(&self, origin: &str, event: &SyncEvent) {
        // Lock order: members before load.
        let target_slot = match event {
            SyncEvent::Booked { target, .. } => self.members().iter().position(|m| m.active && m.replica.id == *target),
            _ => None,
        };
        let mut load = self.load_table();
        let touched = match event {
            SyncEvent::Booked { request_id, prefill_tokens, hashes, total_blocks, .. } => {
                let Some(slot) = target_slot else { return };
                let id = format!("{origin}/{request_id}");
                // Decode progress is not shared between gateways (as in Dynamo's replica sync).
                let booking = NewBooking {
                    request_id: &id,
                    prefill_tokens: *prefill_tokens,
                    hashes,
                    total_blocks: *total_blocks,
                    max_tokens: None,
                };
                load.book(slot, booking, Instant::now());
                Some(slot)
            }
            SyncEvent::FirstToken { request_id, .. } => {
                let id = format!("{origin}/{request_id}");
                let slot = load.replica_of(&id);
                load.prefill_done(&id);
                slot
            }
            SyncEvent::Done { request_id, .. } => {
                let id = format!("{origin}/{request_id}");
                let slot = load.replica_of(&id);
                load.finish(&id);
                slot
            }
        };
        let figures = touched.map(|slot| (slot, load.load(slot)));
        drop(load);
        if let Some((slot, figures)) = figures {
            self.publish_load(slot, figures);
        }
    }

    /// Stops every replica's event threads (shutdown).
    pub fn stop_all(&self) {
        for m in self.members().iter() {
            m.stop.store(true, Ordering::Relaxed);
        }
    }

    /// The encoded bundle, for a filter that fetches it (counted for `/debug/state`).
    pub fn served_bundle(&self) -> Vec<u8> {
        self.bundles_served.fetch_add(1, Ordering::Relaxed);
        self.bundle.clone()
    }

    /// The pool's tokenizer (with a segment cache), loaded from its bundle on first use.
    /// Blocking: call it off the async runtime.
    pub fn tokenizer(&self) -> Result<&ModelTokenizer, String> {
        self.tokenizer
            .get_or_init(|| {
                let bundle: ModelBundle = kvgate_shared::codec::decode(&self.bundle).map_err(|e| e.to_string())?;
                ModelTokenizer::from_bundle(&bundle)
                    .map(|t| t.with_segment_cache(OFFLOAD_SEGMENT_CACHE_BYTES))
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Routes a whole request body (the filter's offload): tokenizes it exactly as the filter
    /// would, then decides as [`Pool::route`] — unless `deadline` has passed by then (the
    /// filter has routed the request without us: booking it would count load that is not
    /// there). Blocking (it tokenizes).
    pub fn route_body(
        &self,
        parsed: &ParsedRequest,
        req: &RouteBodyRequest<'_>,
        scoring: &ScoringConfig,
        deadline: Instant,
    ) -> Result<RouteResponse, OffloadError> {
        if Instant::now() >= deadline {
            return Err(OffloadError::Late);
        }
        let tokenizer = self.tokenizer().map_err(OffloadError::Tokenizer)?;
        let tokens = tokenizer.prompt_tokens(parsed).map_err(|e| OffloadError::Tokenizer(e.to_string()))?;
        if Instant::now() >= deadline {
            return Err(OffloadError::Late);
        }
        // A LoRA adapter's blocks are salted with its name, as its engine salts them.
        let salt = if parsed.model == self.config.model { Salt::NONE } else { Salt::for_lora(Some(&parsed.model)) };
        let route = RouteRequest {
            request_id: req.request_id.clone(),
            client_request_id: req.client_request_id.clone(),
            model: parsed.model.clone(),
            prompt_tokens: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
            block_hashes: prompt_block_hashes(&tokens, self.config.block_size as usize, salt),
            block_size: self.config.block_size,
            session: req.session.clone().or_else(|| parsed.session.clone()),
            overrides: req.overrides,
            max_tokens: parsed.max_tokens,
        };
        Ok(self.route(&route, scoring))
    }

    /// The kept decisions for `request_id` (a booking key or a client's `x-request-id`), or the
    /// most recent `last` decisions (newest first).
    pub fn explain(&self, request_id: Option<&str>, last: usize) -> Vec<Explanation> {
        let kept = self.explanations.lock().unwrap_or_else(|e| e.into_inner());
        let members = self.members();
        let name = |i: ReplicaIdx| members[i].replica.id.clone();
        kept.iter()
            .rev()
            .filter(|e| request_id.is_none_or(|id| e.request_id == id || e.client_request_id.as_deref() == Some(id)))
            .take(last)
            .map(|k| Explanation {
                request_id: k.request_id.clone(),
                client_request_id: k.client_request_id.clone(),
                policy: k.policy,
                prompt_tokens: k.prompt_tokens,
                chosen: Some(name(k.chosen)),
                candidates: k
                    .candidates
                    .iter()
                    .map(|(i, c, logit, trusted)| CandidateTerms {
                        replica: name(*i),
                        trusted: *trusted,
                        overlap: c.overlap,
                        prefill_tokens: c.prefill_tokens,
                        decode_blocks: c.decode_blocks,
                        requests: c.requests,
                        logit: *logit,
                    })
                    .collect(),
            })
            .collect()
    }

    fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// Metric labels for a replica.
    pub fn labels(&self, replica: ReplicaIdx) -> ReplicaLabels {
        ReplicaLabels { model: self.config.model.clone(), replica: self.members()[replica].replica.id.clone() }
    }

    /// Exclusive access to the index (for the event appliers).
    pub fn index_mut(&self) -> std::sync::RwLockWriteGuard<'_, KvIndex> {
        self.index.write().unwrap_or_else(|e| e.into_inner())
    }

    fn load_table(&self) -> std::sync::MutexGuard<'_, LoadTable> {
        self.load.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records what one ingested message did to a replica's health.
    pub fn after_ingest(&self, replica: ReplicaIdx, progress: Progress, outcome: &Outcome) {
        let h = self.members()[replica].health.clone();
        h.events_applied.fetch_add(outcome.applied, Ordering::Relaxed);
        h.last_seq.store(progress.last_seq.unwrap_or(NONE), Ordering::Relaxed);
        h.degraded.store(progress.degraded, Ordering::Relaxed);
        h.awaiting_events_since.store(NONE, Ordering::Relaxed);
        h.stalled.store(false, Ordering::Relaxed);
        h.disconnected.store(false, Ordering::Relaxed);
        let blocks = read(&self.index).replica_blocks(replica);
        let labels = self.labels(replica);
        self.metrics.index_blocks.get_or_create(&labels).set(blocks as i64);
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        self.metrics.last_event.get_or_create(&labels).set(now as i64);
        self.publish_health(replica);
    }

    /// Flags replicas whose publisher has been silent for `timeout` while they were expected
    /// to store blocks.
    pub fn check_stalls(&self, timeout: Duration) {
        let now = self.now_ms();
        let stalled: Vec<ReplicaIdx> = {
            let members = self.members();
            let newly_stalled = |m: &Member| {
                let since = m.health.awaiting_events_since.load(Ordering::Relaxed);
                m.active
                    && since != NONE
                    && now.saturating_sub(since) > timeout.as_millis() as u64
                    && !m.health.stalled.swap(true, Ordering::Relaxed)
            };
            members.iter().enumerate().filter(|(_, m)| newly_stalled(m)).map(|(i, _)| i).collect()
        };
        for i in stalled {
            tracing::warn!(replica = %self.labels(i).replica, "KV-event publisher stalled; routing on load only");
            self.publish_health(i);
        }
    }

    /// Records that the connection to a replica's publisher dropped: it earns no cache
    /// credit until its next message shows whether its engine restarted.
    pub fn publisher_disconnected(&self, replica: ReplicaIdx) {
        let h = self.members()[replica].health.clone();
        if !h.disconnected.swap(true, Ordering::Relaxed) {
            tracing::warn!(replica = %self.labels(replica).replica, "KV-event publisher disconnected; no cache credit until it is back");
            self.publish_health(replica);
        }
    }

    fn publish_health(&self, replica: ReplicaIdx) {
        let h = self.members()[replica].health.clone();
        let l = self.labels(replica);
        for (reason, flag) in [("lost_events", &h.degraded), ("stalled", &h.stalled), ("disconnected", &h.disconnected)]
        {
            let labels = ReasonLabels { model: l.model.clone(), replica: l.replica.clone(), reason: reason.into() };
            self.metrics.degraded.get_or_create(&labels).set(i64::from(flag.load(Ordering::Relaxed)));
        }
    }

    /// Scores every replica, picks one by the pool's policy, and books the request there,
    /// atomically (no herding: concurrent requests see each other's bookings).
    pub fn route(&self, req: &RouteRequest, scoring: &ScoringConfig) -> RouteResponse {
        let bs = u64::from(self.config.block_size);
        // Hashes computed with another block size would match nothing correctly: drop them.
        let hashes: &[u64] = if req.block_size == self.config.block_size { &req.block_hashes } else { &[] };
        let members = self.members();
        let affinity = self.config.policy == Policy::PrefixAffinity;
        let inflight = self.config.policy == Policy::KvAware && self.config.inflight_credit_secs > 0;
        let overlaps = if affinity {
            self.affinity_index().find_matches(hashes, members.len(), Instant::now())
        } else {
            read(&self.index).find_matches(hashes)
        };
        // The candidates: active replicas that serve the model (a learned adapter is served
        // only where it is loaded), with no cache credit while their publisher stalls.
        let mut active: Vec<(ReplicaIdx, Overlap, bool)> = members
            .iter()
            .enumerate()
            .filter(|(_, m)| m.active && m.serves(&req.model, &self.config))
            .map(|(i, m)| {
                // The affinity index does not depend on events, so a silent publisher is moot.
                let trusted = affinity || m.health.trusted();
                (i, if trusted { overlaps[i] } else { Overlap::default() }, trusted)
            })
            .collect();
        if inflight {
            // Prefixes routed moments ago are as good as cached where they went.
            let recent = self.affinity_index().find_matches(hashes, members.len(), Instant::now());
            for (i, overlap, _) in &mut active {
                *overlap = overlap.with_device_at_least(recent[*i].device);
            }
        }
        if active.is_empty() {
            return RouteResponse { endpoint: None, replica: None, overlap_blocks: 0, dp_rank: None };
        }
        let prompt_tokens = u64::from(req.prompt_tokens);
        let total_blocks = prompt_tokens.div_ceil(bs);
        let policy = match (self.config.policy, &req.session) {
            (Policy::ConsistentHash, None) => Policy::KvAware,
            (p, _) => p,
        };
        let cost_config = match policy {
            Policy::LeastLoad => ScoringConfig {
                kv_overlap_credit: 0.0,
                host_cache_hit_weight: 0.0,
                disk_cache_hit_weight: 0.0,
                duplicate_penalty: 0.0,
                ..scoring.clone()
            },
            _ => scoring.clone(),
        };
        let mut load = self.load_table();
        let candidates: Vec<Candidate> = active
            .iter()
            .map(|&(i, overlap, _)| {
                let l = load.load(i);
                Candidate {
                    overlap,
                    prefill_tokens: l.prefill_tokens,
                    decode_blocks: l.active_blocks + load.additional_blocks(i, hashes, total_blocks),
                    requests: l.requests,
                }
            })
            .collect();
        let logits = score::logits(&cost_config, RequestShape { prompt_tokens, block_size: bs }, &candidates);
        // `choice` indexes `active`.
        let choice = match policy {
            Policy::KvAware | Policy::LeastLoad | Policy::PrefixAffinity => {
                score::select(&logits, cost_config.temperature, &mut rand::rng())
            }
            Policy::RoundRobin => Some(self.next.fetch_add(1, Ordering::Relaxed) % active.len()),
            Policy::ConsistentHash => req.session.as_deref().map(|key| rendezvous(key, &members, &active)),
        };
        let Some(choice) = choice else {
            return RouteResponse { endpoint: None, replica: None, overlap_blocks: 0, dp_rank: None };
        };
        let (best, overlap, _) = active[choice];
        let prefill_tokens = scoring.prefill_tokens(prompt_tokens, bs, overlap);
        let booked = load.book(
            best,
            NewBooking {
                request_id: &req.request_id,
                prefill_tokens,
                hashes,
                total_blocks,
                max_tokens: req.max_tokens.map(u64::from),
            },
            Instant::now(),
        );
        let figures = load.load(best);
        drop(load);
        if affinity || inflight {
            self.affinity_index().record(best, hashes, Instant::now());
        }
        if !affinity && booked && prefill_tokens >= bs {
            // The engine must store at least one new block: an event is now expected.
            let _ = members[best].health.awaiting_events_since.compare_exchange(
                NONE,
                self.now_ms(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
        let (replica, dp_rank) = (members[best].replica.clone(), members[best].rank);
        drop(members);
        self.publish_load(best, figures);
        if let (true, Some(outbox)) = (booked, self.outbox.get()) {
            outbox.send(SyncEvent::Booked {
                model: self.config.model.clone(),
                target: replica.id.clone(),
                request_id: req.request_id.clone(),
                prefill_tokens,
                hashes: hashes.to_vec(),
                total_blocks,
            });
        }
        let kept = active.iter().zip(&candidates).zip(&logits).map(|((a, c), l)| (a.0, *c, *l, a.2)).collect();
        self.record(req, policy, kept, best, overlap);
        RouteResponse {
            endpoint: Some(replica.endpoint.to_string()),
            replica: Some(replica.id.clone()),
            overlap_blocks: overlap.device,
            dp_rank,
        }
    }

    fn record(
        &self,
        req: &RouteRequest,
        policy: Policy,
        candidates: Vec<(ReplicaIdx, Candidate, f64, bool)>,
        best: ReplicaIdx,
        overlap: Overlap,
    ) {
        let labels = self.labels(best);
        self.metrics.route_decisions.get_or_create(&labels).inc();
        let outcome = if overlap.device > 0 { "hit" } else { "miss" };
        let policy_name =
            serde_json::to_value(policy).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default();
        let decision = DecisionLabels { model: labels.model, policy: policy_name, outcome: outcome.to_owned() };
        self.metrics.decisions.get_or_create(&decision).inc();
        self.metrics.chosen_overlap_blocks.observe(f64::from(overlap.device));
        let explanation = Kept {
            request_id: req.request_id.clone(),
            client_request_id: req.client_request_id.clone(),
            policy,
            prompt_tokens: u64::from(req.prompt_tokens),
            chosen: best,
            candidates,
        };
        let mut kept = self.explanations.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() == EXPLANATIONS {
            kept.pop_front();
        }
        kept.push_back(explanation);
    }

    /// Applies a decode-progress report (see [`LoadTable::progress`]). Returns false if the
    /// request is not booked in this pool.
    pub fn progress(&self, request_id: &str, output_tokens: u32) -> bool {
        let (known, figures) = {
            let mut load = self.load_table();
            let known = load.progress(request_id, u64::from(output_tokens), u64::from(self.config.block_size));
            (known, load.replica_of(request_id).map(|r| (r, load.load(r))))
        };
        if let Some((r, figures)) = figures {
            self.publish_load(r, figures);
        }
        known
    }

    /// Applies a lifecycle report. Returns false if the request is not booked in this pool.
    pub fn lifecycle(&self, request_id: &str, first_token: bool) -> bool {
        let mut load = self.load_table();
        let replica = load.replica_of(request_id);
        let known = if first_token { load.prefill_done(request_id) } else { load.finish(request_id) };
        let figures = replica.map(|r| (r, load.load(r)));
        drop(load);
        if let Some((r, figures)) = figures {
            self.publish_load(r, figures);
        }
        if let (true, Some(outbox)) = (known, self.outbox.get()) {
            let (model, request_id) = (self.config.model.clone(), request_id.to_owned());
            outbox.send(if first_token {
                SyncEvent::FirstToken { model, request_id }
            } else {
                SyncEvent::Done { model, request_id }
            });
        }
        known
    }

    /// Releases bookings older than `max_age`.
    pub fn expire(&self, max_age: Duration) -> usize {
        let slots = self.members().len();
        let (n, figures) = {
            let mut load = self.load_table();
            let n = load.expire(Instant::now(), max_age);
            (n, (0..slots).map(|i| load.load(i)).collect::<Vec<_>>())
        };
        for (i, f) in figures.into_iter().enumerate() {
            self.publish_load(i, f);
        }
        n
    }

    /// Sets a replica's load gauges. Takes the members lock: never call it holding the load
    /// table (the lock order is members, index, affinity, load).
    fn publish_load(&self, replica: ReplicaIdx, l: ReplicaLoad) {
        let labels = self.labels(replica);
        self.metrics.active_requests.get_or_create(&labels).set((l.requests - l.external) as i64);
        self.metrics.prefill_tokens.get_or_create(&labels).set(l.prefill_tokens as i64);
    }

    /// A snapshot for `/debug/state`.
    pub fn state(&self) -> PoolState {
        // Lock order: members, index, load.
        let members = self.members();
        let index = read(&self.index);
        let load = self.load_table();
        let replicas = members
            .iter()
            .enumerate()
            .filter(|(_, m)| m.active)
            .map(|(i, m)| {
                let (r, h) = (&m.replica, &m.health);
                let l = load.load(i);
                let last_seq = h.last_seq.load(Ordering::Relaxed);
                ReplicaState {
                    id: r.id.clone(),
                    endpoint: r.endpoint.to_string(),
                    blocks_indexed: index.replica_blocks(i),
                    host_blocks: index.replica_tier_blocks(i, Tier::Host),
                    disk_blocks: index.replica_tier_blocks(i, Tier::Disk),
                    active_requests: l.requests - l.external,
                    external_requests: l.external,
                    prefill_tokens: l.prefill_tokens,
                    active_blocks: l.active_blocks,
                    events_applied: h.events_applied.load(Ordering::Relaxed),
                    last_seq: (last_seq != NONE).then_some(last_seq),
                    degraded: h.degraded.load(Ordering::Relaxed),
                    stalled: h.stalled.load(Ordering::Relaxed),
                    disconnected: h.disconnected.load(Ordering::Relaxed),
                    adapters: m.adapters.iter().cloned().collect(),
                }
            })
            .collect();
        let (bookings, ended_early) = load.bookkeeping();
        PoolState {
            model: self.config.model.clone(),
            block_size: self.config.block_size,
            tokenizer_fetches: self.bundles_served.load(Ordering::Relaxed),
            bookings,
            ended_early,
            replicas,
        }
    }
}

/// Rendezvous (highest-random-weight) hashing over the active replicas: a session keeps its
/// replica, and only the sessions of a replica that leaves move. Returns an index into `active`.
fn rendezvous(key: &str, members: &[Member], active: &[(ReplicaIdx, Overlap, bool)]) -> usize {
    let weight = |id: &str| {
        let mut bytes = key.as_bytes().to_vec();
        bytes.push(0);
        bytes.extend_from_slice(id.as_bytes());
        xxhash_rust::xxh3::xxh3_64(&bytes)
    };
    (0..active.len()).max_by_key(|&c| weight(&members[active[c].0].replica.id)).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ReplicaConfig;
    use crate::index::Store;
    use kvgate_shared::hash::{prompt_block_hashes, Salt};

    fn pool(replicas: usize) -> Pool {
        pool_with(replicas, Policy::KvAware)
    }

    fn pool_with(replicas: usize, policy: Policy) -> Pool {
        let replicas = (0..replicas)
            .map(|i| {
                let endpoint = format!("127.0.0.1:{}", 8000 + i).parse().unwrap();
                ReplicaConfig::new(&format!("r{i}"), endpoint, "tcp://127.0.0.1:1")
            })
            .collect();
        let config = PoolConfig { policy, ..PoolConfig::new("m", "unused", 4, replicas) };
        Pool::new(config, Vec::new(), Arc::new(Metrics::default()))
    }

    fn request(id: &str, tokens: &[u32]) -> RouteRequest {
        RouteRequest {
            request_id: id.into(),
            client_request_id: None,
            model: "m".into(),
            prompt_tokens: tokens.len() as u32,
            block_hashes: prompt_block_hashes(tokens, 4, Salt::NONE),
            block_size: 4,
            session: None,
            overrides: None,
            max_tokens: None,
        }
    }

    #[test]
    fn cache_hits_win_and_concurrent_misses_spread() {
        let p = pool(3);
        let cached: Vec<u32> = (0..64).collect();
        p.index_mut()
            .store(
                2,
                Store {
                    parent: None,
                    engine_hashes: &(0..16).collect::<Vec<u64>>(),
                    token_ids: &cached,
                    block_size: 4,
                    salt: Salt::NONE,
                    extra: &[],
                    tier: Tier::Device,
                },
            )
            .unwrap();
        let cfg = ScoringConfig::default();
        let hit = p.route(&request("hit", &cached), &cfg);
        assert_eq!((hit.replica.as_deref(), hit.overlap_blocks), (Some("r2"), 16));
        // Six distinct uncached prompts in a row, none finished: bookings spread them.
        let mut per_replica = [0; 3];
        for i in 0..6u32 {
            let tokens: Vec<u32> = (0..64).map(|t| 10_000 + i * 100 + t).collect();
            let r = p.route(&request(&format!("miss{i}"), &tokens), &cfg);
            per_replica[r.replica.unwrap()[1..].parse::<usize>().unwrap()] += 1;
        }
        assert!(per_replica.iter().all(|n| *n >= 1), "no herding onto one replica: {per_replica:?}");
    }

    fn cache_on(p: &Pool, replica: ReplicaIdx, tokens: &[u32]) {
        let engine: Vec<u64> = (0..(tokens.len() / 4) as u64).map(|i| i + 1000 * replica as u64).collect();
        let store = Store {
            parent: None,
            engine_hashes: &engine,
            token_ids: tokens,
            block_size: 4,
            salt: Salt::NONE,
            extra: &[],
            tier: Tier::Device,
        };
        p.index_mut().store(replica, store).unwrap();
    }

    fn chosen(r: &RouteResponse) -> usize {
        r.replica.as_deref().unwrap()[1..].parse().unwrap()
    }

    #[test]
    fn learned_adapters_route_only_where_they_are_loaded() {
        let p = pool(3);
        let sql = BTreeSet::from(["sql".to_owned()]);
        assert!(!p.serves_adapter("sql"));
        let endpoint = p.members()[1].replica.endpoint.to_string();
        assert!(p.set_adapters(&endpoint, &sql));
        assert!(!p.set_adapters(&endpoint, &sql), "the same list changes nothing");
        assert!(p.serves_adapter("sql"));
        assert_eq!(p.adapters(), sql);
        let scoring = ScoringConfig::default();
        for i in 0..6 {
            let req = RouteRequest { model: "sql".into(), ..request(&format!("a{i}"), &[i, 2, 3, 4, 5]) };
            assert_eq!(chosen(&p.route(&req, &scoring)), 1, "only replica 1 has the adapter");
        }
        let spread: BTreeSet<usize> =
            (0..6).map(|i| chosen(&p.route(&request(&format!("b{i}"), &[i, 9, 9, 9, 9]), &scoring))).collect();
        assert_eq!(spread.len(), 2, "the base model spreads over the other replicas, which are idle");
        assert!(p.set_adapters(&endpoint, &BTreeSet::new()));
        assert!(!p.serves_adapter("sql"), "unloaded everywhere: no longer routed");
        let req = RouteRequest { model: "sql".into(), ..request("c", &[1, 2, 3, 4]) };
        assert_eq!(p.route(&req, &scoring).endpoint, None);
    }

    #[test]
    fn least_load_ignores_the_cache_and_kv_aware_weighs_it() {
        let cached: Vec<u32> = (0..256).collect();
        for (policy, expected) in [(Policy::KvAware, 0), (Policy::LeastLoad, 1)] {
            let p = pool_with(2, policy);
            cache_on(&p, 0, &cached);
            // r0 is a little busy; its cache saves far more than that.
            p.load_table().book(
                0,
                NewBooking { request_id: "busy", prefill_tokens: 40, hashes: &[], total_blocks: 10, max_tokens: None },
                Instant::now(),
            );
            let r = p.route(&request("q", &cached), &ScoringConfig::default());
            assert_eq!(chosen(&r), expected, "{policy:?}");
        }
    }

    #[test]
    fn round_robin_cycles_and_still_books_load() {
        let p = pool_with(3, Policy::RoundRobin);
        let picks: Vec<usize> = (0..6)
            .map(|i| chosen(&p.route(&request(&format!("r{i}"), &[1, 2, 3, 4]), &ScoringConfig::default())))
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        assert_eq!(p.state().replicas.iter().map(|r| r.active_requests).sum::<u64>(), 6);
    }

    #[test]
    fn consistent_hash_keeps_sessions_and_falls_back_without_one() {
        let p = pool_with(4, Policy::ConsistentHash);
        let cfg = ScoringConfig::default();
        let with_session = |id: &str, s: &str| RouteRequest { session: Some(s.into()), ..request(id, &[1, 2, 3, 4]) };
        let first = chosen(&p.route(&with_session("a0", "alice"), &cfg));
        for i in 1..10 {
            assert_eq!(chosen(&p.route(&with_session(&format!("a{i}"), "alice"), &cfg)), first, "sticky");
        }
        let spread: std::collections::HashSet<usize> =
            (0..40).map(|i| chosen(&p.route(&with_session(&format!("u{i}"), &format!("user-{i}")), &cfg))).collect();
        assert!(spread.len() >= 3, "sessions spread over replicas: {spread:?}");
        let cached: Vec<u32> = (0..64).collect();
        cache_on(&p, 2, &cached);
        let r = p.route(&request("no-session", &cached), &cfg);
        assert_eq!(chosen(&r), 2, "no session: kv_aware");
        assert_eq!(p.explain(Some("no-session"), 1)[0].policy, Policy::KvAware);
    }

    #[test]
    fn decisions_are_explained() {
        let p = pool(2);
        let cached: Vec<u32> = (0..64).collect();
        cache_on(&p, 1, &cached);
        p.route(&request("why", &cached), &ScoringConfig::default());
        let e = &p.explain(Some("why"), 10)[0];
        assert_eq!(e.chosen.as_deref(), Some("r1"));
        assert_eq!(e.candidates[1].overlap.device, 16);
        assert!(e.candidates[1].logit < e.candidates[0].logit);
        assert!(p.explain(Some("unknown"), 10).is_empty());
    }

    #[test]
    fn a_silent_publisher_is_flagged_stalled_and_earns_no_credit() {
        let p = pool(1);
        let tokens: Vec<u32> = (0..64).collect();
        p.route(&request("a", &tokens), &ScoringConfig::default());
        let deadline = Instant::now() + Duration::from_secs(5);
        while !p.state().replicas[0].stalled {
            assert!(Instant::now() < deadline, "never flagged");
            p.check_stalls(Duration::ZERO);
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(!p.members()[0].health.trusted());
        // Any event brings it back.
        p.after_ingest(0, Progress::default(), &Outcome::default());
        assert!(!p.state().replicas[0].stalled);
    }

    #[test]
    fn membership_changes_keep_what_is_unchanged_and_empty_what_left() {
        let p = pool(3);
        let replicas = p.config.replicas.clone();
        let prompt: Vec<u32> = (0..64).collect();
        for r in 0..3 {
            cache_on(&p, r, &prompt);
        }
        let only_r1: Vec<u32> = (500..564).collect();
        let engine: Vec<u64> = (5000..5016).collect();
        let store = Store {
            parent: None,
            engine_hashes: &engine,
            token_ids: &only_r1,
            block_size: 4,
            salt: Salt::NONE,
            extra: &[],
            tier: Tier::Device,
        };
        p.index_mut().store(1, store).unwrap();
        let cfg = ScoringConfig::default();
        assert_eq!(chosen(&p.route(&request("held", &only_r1), &cfg)), 1);
        assert!(p.set_members(&replicas).is_empty(), "the same membership changes nothing");

        // r1 leaves, r0's events endpoint changes, r3 joins.
        let mut moved = replicas[0].clone();
        moved.kv_events = "tcp://10.9.9.9:5557".into();
        let newcomer = ReplicaConfig { id: "r3".into(), endpoint: "127.0.0.1:8003".parse().unwrap(), ..moved.clone() };
        let stop_r1 = p.members()[1].stop.clone();
        let start = p.set_members(&[moved.clone(), replicas[2].clone(), newcomer.clone()]);
        let started: Vec<(ReplicaIdx, &str)> = start.iter().map(|(i, r, _)| (*i, r.id.as_str())).collect();
        assert_eq!(
            started,
            [(0, "r0"), (3, "r3")],
            "a changed replica restarts in its slot; a new one gets a new slot"
        );
        assert!(stop_r1.load(Ordering::Relaxed), "the leaver's event threads are told to stop");
        let matches = read(&p.index).find_matches(&prompt_block_hashes(&prompt, 4, Salt::NONE));
        let device: Vec<u32> = matches.iter().map(|o| o.device).collect();
        assert_eq!(device, [0, 0, 16, 0], "r2 keeps its blocks; r0 (new engine) and r1 (gone) are emptied");
        let state: Vec<String> = p.state().replicas.into_iter().map(|r| r.id).collect();
        assert_eq!(state, ["r0", "r2", "r3"]);
        assert!(!p.lifecycle("held", false), "r1's booking left with it");
        for i in 0..30 {
            let r = p.route(&request(&format!("q{i}"), &[i; 8]), &cfg);
            assert_ne!(r.replica.as_deref(), Some("r1"), "a replica that left is never chosen");
        }

        // r1 comes back: its old slot, empty.
        let start = p.set_members(&[moved, replicas[1].clone(), replicas[2].clone(), newcomer]);
        assert_eq!(start.iter().map(|(i, _, _)| *i).collect::<Vec<_>>(), [1]);
        assert_eq!(p.members().len(), 4, "slots are reused, never multiplied");
        assert_eq!(p.state().replicas.len(), 4);
    }

    #[test]
    fn an_empty_pool_routes_nowhere() {
        let p = pool(2);
        p.set_members(&[]);
        let r = p.route(&request("x", &[1, 2, 3, 4]), &ScoringConfig::default());
        assert_eq!((r.endpoint, r.replica), (None, None));
        assert!(p.state().replicas.is_empty());
    }

    #[test]
    fn prefix_affinity_follows_its_own_routing_not_events() {
        let p = pool_with(3, Policy::PrefixAffinity);
        let cfg = ScoringConfig::default();
        let prompt: Vec<u32> = (0..64).collect();
        let first = p.route(&request("first", &prompt), &cfg);
        let home = chosen(&first);
        assert!(p.lifecycle("first", false));
        // Events say another replica holds the prompt: this policy does not read them.
        cache_on(&p, (home + 1) % 3, &prompt);
        let mut longer = prompt.clone();
        longer.extend(1000..1016);
        let again = p.route(&request("again", &longer), &cfg);
        assert_eq!((chosen(&again), again.overlap_blocks), (home, 16), "where the gateway sent the prefix");
        // Distinct prompts still spread by load.
        let mut per_replica = [0; 3];
        for i in 0..6u32 {
            let tokens: Vec<u32> = (0..64).map(|t| 20_000 + i * 100 + t).collect();
            per_replica[chosen(&p.route(&request(&format!("d{i}"), &tokens), &cfg))] += 1;
        }
        assert!(per_replica.iter().all(|n| *n >= 1), "{per_replica:?}");
        let explained = &p.explain(Some("again"), 1)[0];
        assert_eq!(explained.policy, Policy::PrefixAffinity);
        assert!(p.state().replicas.iter().all(|r| !r.stalled), "no events expected, none missed");
    }

    #[test]
    fn data_parallel_ranks_are_targets_of_their_own() {
        let mut config = pool(1).config;
        config.replicas[0].data_parallel_size = 2;
        config.replicas[0].kv_events = "tcp://10.0.0.7:5557".into();
        config.replicas[0].kv_replay = Some("tcp://10.0.0.7:5600".into());
        let t = targets(&config.replicas);
        let ids: Vec<(&str, &str, Option<&str>, Option<u32>)> =
            t.iter().map(|(r, rank)| (r.id.as_str(), r.kv_events.as_str(), r.kv_replay.as_deref(), *rank)).collect();
        assert_eq!(
            ids,
            [
                ("r0#0", "tcp://10.0.0.7:5557", Some("tcp://10.0.0.7:5600"), Some(0)),
                ("r0#1", "tcp://10.0.0.7:5558", Some("tcp://10.0.0.7:5601"), Some(1))
            ]
        );
        assert!(t.iter().all(|(r, _)| r.endpoint == config.replicas[0].endpoint), "one HTTP endpoint");
        let p = Pool::new(config, Vec::new(), Arc::new(Metrics::default()));
        let prompt: Vec<u32> = (0..64).collect();
        cache_on(&p, 1, &prompt);
        let r = p.route(&request("dp", &prompt), &ScoringConfig::default());
        assert_eq!((r.replica.as_deref(), r.dp_rank), (Some("r0#1"), Some(1)), "the rank that holds the prefix");
        assert_eq!(pool(1).route(&request("x", &prompt), &ScoringConfig::default()).dp_rank, None);
    }

    #[test]
    fn kv_aware_credits_prefixes_routed_moments_ago() {
        let cfg = ScoringConfig::default();
        let prompt: Vec<u32> = (0..256).collect();
        let mut longer = prompt.clone();
        longer.extend(5000..5016);
        // The first request's prefill is done (it streams its answer) but the engine's events
        // have not arrived yet.
        let p = pool(3);
        let home = chosen(&p.route(&request("first", &prompt), &cfg));
        assert!(p.lifecycle("first", true));
        let second = p.route(&request("second", &longer), &cfg);
        assert_eq!((chosen(&second), second.overlap_blocks), (home, 64), "follows the first before any event");
        let mut config = pool(3).config;
        config.inflight_credit_secs = 0;
        let p = Pool::new(config, Vec::new(), Arc::new(Metrics::default()));
        p.route(&request("first", &prompt), &cfg);
        assert!(p.lifecycle("first", true));
        assert_eq!(p.route(&request("second", &longer), &cfg).overlap_blocks, 0, "no credit without events");
    }

    #[test]
    fn membership_changes_under_traffic_do_not_deadlock() {
        let p = Arc::new(pool(4));
        let all = p.config.replicas.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        for w in 0..3u32 {
            let (p, tx) = (p.clone(), tx.clone());
            std::thread::spawn(move || {
                for i in 0..1500u32 {
                    let id = format!("w{w}-{i}");
                    p.route(&request(&id, &[i % 50; 8]), &ScoringConfig::default());
                    p.lifecycle(&id, true);
                    p.lifecycle(&id, false);
                    if i % 100 == 0 {
                        p.expire(Duration::from_secs(300));
                        p.state();
                        p.observe_engine(0, 3);
                    }
                }
                tx.send(()).unwrap();
            });
        }
        let changer = p.clone();
        std::thread::spawn(move || {
            for k in 0..600 {
                changer.set_members(&all[..2 + k % 3]);
            }
            tx.send(()).unwrap();
        });
        for _ in 0..4 {
            rx.recv_timeout(Duration::from_secs(60)).expect("routing and membership changes deadlocked");
        }
    }
}
