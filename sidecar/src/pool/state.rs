//! `/debug/state`: a snapshot of every active replica's index, load and health.

use std::sync::atomic::Ordering;

use serde::Serialize;

use super::members::{CACHE_REPORT_NO, CACHE_REPORT_YES, NONE};
use super::Pool;
use crate::accuracy::AccuracyTotals;
use crate::admission::Gate;
use crate::index::{ReplicaIdx, Tier};
use crate::latency::{Latency, Predictor};

/// One replica in `/debug/state`.
#[derive(Debug, Serialize)]
pub struct ReplicaState {
    /// Replica id.
    pub id: String,
    /// `ip:port`.
    pub endpoint: String,
    /// What it does in a disaggregated pool (`both` elsewhere).
    pub role: super::Role,
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
    /// Booked prefill tokens (with engine metrics, plus the estimate for outside requests
    /// the engine reports waiting).
    pub prefill_tokens: u64,
    /// Unique active blocks.
    pub active_blocks: u64,
    /// Whether admission control counts it saturated (`null` with admission off).
    pub saturated: Option<bool>,
    /// What its engine last reported of itself (`engine_metrics_secs`): requests, waiting,
    /// KV cache usage and capacity in blocks.
    pub engine: Option<crate::load::EngineReport>,
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
    /// Whether its engine reports cached prompt tokens in `usage` (`null` before its first
    /// report): without them kvgate's predictions for it cannot be checked.
    pub reports_cached_tokens: Option<bool>,
    /// Its time-to-first-token model ([`crate::latency`]).
    pub ttft: LatencyState,
    /// Its inter-token-latency model.
    pub itl: LatencyState,
}

/// A replica's TTFT or ITL model in `/debug/state`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LatencyState {
    /// Timed requests it learned from since it joined (it predicts once its window holds
    /// `latency::MIN_SAMPLES` recent ones).
    pub samples: u64,
    /// The share of its last predictions close to what the filter measured.
    pub recent_close_ratio: f64,
    /// Whether its alarm is raised.
    pub alarm: bool,
}

impl LatencyState {
    fn of(p: &Predictor) -> LatencyState {
        LatencyState { samples: p.samples(), recent_close_ratio: p.recent_close_ratio(), alarm: p.alarm() }
    }
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
    /// Cache predictions checked against the engines' reports, and the alarm.
    pub prediction: AccuracyTotals,
    /// Replicas that left and are in their grace period (`leave_grace_secs`): not routed to,
    /// their index kept in case they come back.
    pub leaving: Vec<String>,
    /// Requests waiting for capacity (admission control on; else `null`).
    pub admission_waiting: Option<usize>,
    /// Tenants (per class) with requests in flight, among which admission control shares
    /// capacity fairly (admission control on; else `null`).
    pub admission_tenants: Option<usize>,
    /// Sessions bound to a replica (`[pools.sessions]`; else `null`).
    pub sessions_bound: Option<usize>,
    /// Active replicas, in slot order (the config's first).
    pub replicas: Vec<ReplicaState>,
}

impl Pool {
    /// A snapshot for `/debug/state`.
    pub fn state(&self) -> PoolState {
        // Lock order: members, index, load.
        let members = self.members();
        let index = self.index.read();
        let load = self.load_table();
        let replicas = members
            .iter()
            .enumerate()
            .filter(|(_, m)| m.active)
            .map(|(i, m)| {
                let i = ReplicaIdx::new(i);
                let (r, h) = (&m.replica, &m.health);
                let l = load.load(i);
                let last_seq = h.last_seq.load(Ordering::Relaxed);
                ReplicaState {
                    id: r.id.clone(),
                    endpoint: r.endpoint.to_string(),
                    role: r.role,
                    blocks_indexed: index.replica_blocks(i),
                    host_blocks: index.replica_tier_blocks(i, Tier::Host),
                    disk_blocks: index.replica_tier_blocks(i, Tier::Disk),
                    active_requests: l.requests - l.external,
                    external_requests: l.external,
                    prefill_tokens: l.prefill_tokens,
                    active_blocks: l.active_blocks,
                    saturated: self.admission.as_ref().map(|gate| gate.saturated(&l)),
                    engine: l.engine,
                    events_applied: h.events_applied.load(Ordering::Relaxed),
                    last_seq: (last_seq != NONE).then_some(last_seq),
                    degraded: h.degraded.load(Ordering::Relaxed),
                    stalled: h.stalled.load(Ordering::Relaxed),
                    disconnected: h.disconnected.load(Ordering::Relaxed),
                    adapters: m.adapters.iter().cloned().collect(),
                    reports_cached_tokens: match h.cache_report.load(Ordering::Relaxed) {
                        CACHE_REPORT_YES => Some(true),
                        CACHE_REPORT_NO => Some(false),
                        _ => None,
                    },
                    ttft: LatencyState::of(load.predictor(i, Latency::Ttft)),
                    itl: LatencyState::of(load.predictor(i, Latency::Itl)),
                }
            })
            .collect();
        let (bookings, ended_early) = load.bookkeeping();
        let tenants = load.flows_in_flight();
        drop(load);
        let leaving = members.iter().filter(|m| m.leaving_since.is_some()).map(|m| m.replica.id.clone()).collect();
        let prediction = self.accuracy.lock().unwrap_or_else(|e| e.into_inner()).totals();
        PoolState {
            model: self.config.model.clone(),
            block_size: self.config.block_size,
            tokenizer_fetches: self.bundles_served.load(Ordering::Relaxed),
            bookings,
            ended_early,
            prediction,
            leaving,
            admission_waiting: self.admission.as_ref().map(Gate::waiting),
            admission_tenants: self.admission.as_ref().map(|_| tenants),
            sessions_bound: self.sessions().map(|s| s.len()),
            replicas,
        }
    }
}
