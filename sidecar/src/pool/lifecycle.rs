//! What happens to a booking after the decision: first token, decode progress, end, expiry;
//! the same for other gateways' bookings (sync); and load the engines report that kvgate did
//! not book. Every write goes to the load table (a peer's booking also to the in-flight
//! credit), then the replica's gauges are published (never while the table is held).

use std::time::{Duration, Instant};

use super::Pool;
use crate::accuracy::{AlarmChange, Check, EngineUsage, Unchecked};
use crate::index::ReplicaIdx;
use crate::latency::{Latency, Watched};
use crate::load::{BookingId, EngineReport, NewBooking, ReplicaLoad};
use crate::metrics::ReasonLabels;
use crate::msg::sync::{Outbox, SyncEvent};
use kvgate_shared::ids::RequestId;

impl Pool {
    /// Checks what the engine reported for a request (its response's `usage`: prompt tokens,
    /// and cached tokens if the engine reports them) against what was predicted when it was
    /// booked: metrics, `/debug/explain`, the pool's alarm. An engine that reports no cached
    /// tokens has its prompt count checked, is shown as such, and raises no alarm. Returns
    /// false if the request is not booked here (or nothing was predicted for it).
    pub fn engine_usage(&self, request_id: &RequestId, prompt_tokens: u64, cached_tokens: Option<u64>) -> bool {
        let id = BookingId::new(request_id);
        let Some((slot, predicted)) = self.load_table().take_prediction(&id) else { return false };
        let labels = self.labels(slot);
        if predicted.prompt_tokens.is_some_and(|p| p != prompt_tokens) {
            self.metrics.prompt_token_mismatches.get_or_create(&labels).inc();
            self.accuracy.lock().unwrap_or_else(|e| e.into_inner()).prompt_mismatch();
        }
        self.cache_report(slot, cached_tokens.is_some());
        let Some(cached_tokens) = cached_tokens else {
            self.unchecked(slot, Unchecked::NoCachedTokens);
            return true;
        };
        let usage = EngineUsage { prompt_tokens, cached_tokens };
        let check = Check::new(predicted, usage, self.index.read().churn(slot));
        self.metrics.prediction_error.get_or_create(&labels).observe(check.cached_error as f64);
        let outcome = ReasonLabels {
            model: labels.model.clone(),
            replica: labels.replica.clone(),
            reason: check.class.label().into(),
        };
        self.metrics.predictions.get_or_create(&outcome).inc();
        let change = self.accuracy.lock().unwrap_or_else(|e| e.into_inner()).record(check);
        let pool = self.pool_labels();
        match change {
            AlarmChange::Raised => {
                tracing::warn!(
                    model = %self.config.model,
                    "kvgate's cache predictions keep missing what the engines report (see /debug/state and \
                     kvgate_prediction_error_tokens): check that the pool's block_size equals the engines' \
                     --block-size, that the engines run with prefix caching, and that the chat template and \
                     tokenizer are the engines' (kvgate_prompt_token_mismatches_total counts prompts they \
                     count differently)"
                );
                self.metrics.prediction_alarm.get_or_create(&pool).set(1);
            }
            AlarmChange::Cleared => {
                tracing::info!(model = %self.config.model, "cache predictions match the engines again");
                self.metrics.prediction_alarm.get_or_create(&pool).set(0);
            }
            AlarmChange::None => {}
        }
        self.checked(request_id, predicted.cached_tokens, usage, check);
        true
    }

    /// Counts a routed request whose prediction was not checked.
    pub(super) fn unchecked(&self, slot: ReplicaIdx, reason: Unchecked) {
        let labels = self.labels(slot);
        let labels = ReasonLabels { model: labels.model, replica: labels.replica, reason: reason.label().into() };
        self.metrics.predictions_unchecked.get_or_create(&labels).inc();
        self.accuracy.lock().unwrap_or_else(|e| e.into_inner()).unchecked(reason);
    }

    /// The request ran on the replica at `endpoint` (`ip:port`), not where it was booked: its
    /// booking moves there, and so does the credit for its prefix. Returns false if it is not
    /// booked here, or was already there, or `endpoint` is no active replica of this pool.
    pub fn ran_on(&self, request_id: &RequestId, endpoint: &str) -> bool {
        let to = self.members().iter().position(|m| m.active && m.replica.endpoint.to_string() == endpoint);
        let Some(to) = to.map(ReplicaIdx::new) else { return false };
        let moved = {
            let mut load = self.load_table();
            let moved = load.move_booking(&BookingId::new(request_id), to, Instant::now());
            moved.map(|(from, hashes, predicted)| (from, hashes, load.load(from), load.load(to), predicted))
        };
        let Some((from, hashes, left, arrived, predicted)) = moved else { return false };
        if predicted {
            self.unchecked(from, Unchecked::Moved);
        }
        if self.records_routes() {
            self.affinity_index().record(to, &hashes, 0, Instant::now());
        }
        self.publish_load(from, left);
        self.publish_load(to, arrived);
        // The replica it was booked on has room again.
        self.capacity_freed();
        true
    }

    /// A disaggregated request's prefill leg did not deliver and its decode worker computes
    /// the prompt itself: its booking there gets the prefill of what that worker has not
    /// cached. Returns false if it is not booked here.
    pub fn served_whole(&self, request_id: &RequestId) -> bool {
        // Lock order: index, then load; the booking is read first without holding either.
        let id = BookingId::new(request_id);
        let Some((slot, hashes, blocks)) = self.load_table().booked_prompt(&id) else { return false };
        let cached = self.index.read().find_matches(&hashes).get(slot.get()).map_or(0, |o| u64::from(o.device));
        let block_size = u64::from(self.config.block_size);
        let prefill = blocks.saturating_sub(cached) * block_size;
        let figures = {
            let mut load = self.load_table();
            load.served_whole(&id, prefill, Instant::now()).map(|predicted| (load.load(slot), predicted))
        };
        let Some((figures, predicted)) = figures else { return false };
        if predicted {
            self.unchecked(slot, Unchecked::Moved);
        }
        self.publish_load(slot, figures);
        true
    }

    /// Records what an engine reports it is running (see [`crate::load::engine_metrics`]).
    pub fn observe_engine(&self, slot: ReplicaIdx, report: EngineReport) {
        let figures = {
            let mut load = self.load_table();
            load.observe(slot, report);
            load.load(slot)
        };
        // The engine may say it has room again.
        self.capacity_freed();
        self.publish_load(slot, figures);
        self.set_gauges(slot, |labels| {
            self.metrics.external_requests.get_or_create(labels).set(figures.external as i64);
        });
    }

    /// Publishes this pool's bookings and their lifecycle to the other gateways from now on.
    pub fn set_outbox(&self, outbox: Outbox) {
        let _ = self.outbox.set(outbox);
    }

    /// Applies another gateway's booking or lifecycle event to the load table, under
    /// `origin/request_id`, a booking's prefix to the in-flight credit
    /// ([`Pool::record_peer_route`]) and its session's binding (in a pool that binds
    /// sessions). A booking on a target this pool does not have is ignored.
    pub fn apply_remote(&self, origin: &str, event: &SyncEvent) {
        // Lock order: members, affinity, load. `members` is held until the booking is made, so
        // the slot cannot be retired and given to a newcomer in between.
        let members = self.members();
        let target_slot = match event {
            SyncEvent::Booked { target, .. } => members.active_slot(target),
            _ => None,
        };
        if let (Some(slot), SyncEvent::Booked { hashes, held_blocks, session, .. }) = (target_slot, event) {
            self.record_peer_route(slot, hashes, *held_blocks);
            // The peer bound the request's session there.
            if let Some(key) = session {
                self.bind_session(*key, slot);
            }
        }
        let mut load = self.load_table();
        let touched = match event {
            SyncEvent::Booked { request_id, prefill_tokens, hashes, total_blocks, sequences, .. } => {
                let Some(slot) = target_slot else { return };
                let id = BookingId::peer(origin, request_id);
                // Decode progress is not shared between gateways (as in Dynamo's replica sync).
                let booking = NewBooking {
                    id: &id,
                    prefill_tokens: *prefill_tokens,
                    hashes,
                    total_blocks: *total_blocks,
                    max_tokens: None,
                    prediction: None,
                    sequences: *sequences,
                    // The origin reports its first token, or its estimated prefill end.
                    streamed: true,
                    // Fairness between tenants is each gateway's own.
                    flow: None,
                    from_peer: true,
                    timed: false,
                    computed: None,
                };
                load.book(slot, booking, Instant::now());
                Some(slot)
            }
            SyncEvent::FirstToken { request_id, .. } => {
                let id = BookingId::peer(origin, request_id);
                let slot = load.replica_of(&id);
                load.prefill_done(&id, Instant::now());
                slot
            }
            SyncEvent::Done { request_id, .. } => {
                let id = BookingId::peer(origin, request_id);
                let slot = load.replica_of(&id);
                load.finish(&id);
                slot
            }
        };
        let figures = touched.map(|slot| (slot, load.load(slot)));
        drop(load);
        drop(members);
        if let Some((slot, figures)) = figures {
            self.publish_load(slot, figures);
        }
        if !matches!(event, SyncEvent::Booked { .. }) {
            self.capacity_freed();
        }
    }

    /// Applies a decode-progress report (see [`LoadTable::progress`]). Returns false if the
    /// request is not booked in this pool.
    pub fn progress(&self, request_id: &RequestId, output_tokens: u32) -> bool {
        let (known, figures) = {
            let (id, mut load) = (BookingId::new(request_id), self.load_table());
            let known = load.progress(&id, u64::from(output_tokens), u64::from(self.config.block_size));
            (known, load.replica_of(&id).map(|r| (r, load.load(r))))
        };
        if let Some((r, figures)) = figures {
            self.publish_load(r, figures);
        }
        if known {
            // Its footprint shrank as it nears its end.
            self.capacity_freed();
        }
        known
    }

    /// The request's first token came, `ttft` after it left the filter if its response was a
    /// success (an error's first byte says nothing of the replica's speed): its replica's TTFT
    /// model learns from it, the prediction made for it is checked (metrics, `/debug/explain`,
    /// `/debug/state`, the replica's TTFT alarm), and its prefill is over
    /// ([`Pool::lifecycle`]). Returns false if the request is not booked in this pool.
    pub fn first_token(&self, request_id: &RequestId, ttft: Option<Duration>) -> bool {
        if let Some(ttft) = ttft {
            self.latency_measured(request_id, Latency::Ttft, ttft);
        }
        self.lifecycle(request_id, true)
    }

    /// The request streamed its output with `itl` between tokens on average: its replica's
    /// ITL model learns from it and the prediction made for it is checked, as for its TTFT.
    /// Returns false if the request is not booked in this pool.
    pub fn decoded(&self, request_id: &RequestId, itl: Duration) -> bool {
        self.latency_measured(request_id, Latency::Itl, itl)
    }

    /// The filter measured the request's `latency`: its replica's model learns from it and,
    /// if a prediction was made for it, the prediction is checked. Whether the request is
    /// booked in this pool.
    fn latency_measured(&self, request_id: &RequestId, latency: Latency, measured: Duration) -> bool {
        let id = BookingId::new(request_id);
        let mut load = self.load_table();
        let known = load.replica_of(&id).is_some();
        let checked = load.measured(&id, latency, measured, Instant::now());
        drop(load);
        if let Some((slot, watched)) = checked {
            self.latency_checked(request_id, slot, latency, watched);
        }
        known
    }

    fn latency_checked(&self, request_id: &RequestId, slot: ReplicaIdx, latency: Latency, watched: Watched) {
        let (labels, check) = (self.labels(slot), watched.check);
        let (error, alarm, name) = match latency {
            Latency::Ttft => (&self.metrics.ttft_prediction_error, &self.metrics.ttft_prediction_alarm, "TTFT"),
            Latency::Itl => (&self.metrics.itl_prediction_error, &self.metrics.itl_prediction_alarm, "ITL"),
        };
        error.get_or_create(&labels).observe(check.relative_error());
        alarm.get_or_create(&labels).set(i64::from(watched.alarm));
        self.latency_explained(request_id, latency, check.measured_secs);
        self.accuracy.lock().unwrap_or_else(|e| e.into_inner()).record_latency(latency, check.close());
        match (watched.changed, watched.alarm) {
            (true, true) => tracing::warn!(
                model = %labels.model,
                replica = %labels.replica,
                latency = name,
                "kvgate's latency predictions for this replica keep missing what the gateway measures (see \
                 /debug/explain and kvgate_ttft_prediction_error_ratio or kvgate_itl_prediction_error_ratio): it \
                 slowed down, or its latency depends on more than the prefill booked there and the sequences it \
                 runs; its model relearns a steady change within 32 timed requests"
            ),
            (true, false) => {
                tracing::info!(model = %labels.model, replica = %labels.replica, latency = name, "latency predictions match again")
            }
            (false, _) => {}
        }
    }

    /// Applies a lifecycle report. Returns false if the request is not booked in this pool.
    pub fn lifecycle(&self, request_id: &RequestId, first_token: bool) -> bool {
        let (id, mut load) = (BookingId::new(request_id), self.load_table());
        let replica = load.replica_of(&id);
        // An end with its prediction still there came without a usage report.
        let unchecked = if first_token { None } else { load.take_prediction(&id).map(|(slot, _)| slot) };
        let known = if first_token { load.prefill_done(&id, Instant::now()) } else { load.finish(&id) };
        let figures = replica.map(|r| (r, load.load(r)));
        drop(load);
        if let Some(slot) = unchecked {
            self.unchecked(slot, Unchecked::NoUsage);
        }
        if let Some((r, figures)) = figures {
            self.publish_load(r, figures);
        }
        if known {
            self.capacity_freed();
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

    /// Ends the estimated prefills of non-streamed requests that are due (see
    /// [`LoadTable::end_prefills`]), and tells the sync mesh as a first token would.
    pub fn end_estimated_prefills(&self) {
        let (ended, figures) = {
            let mut load = self.load_table();
            let ended = load.end_prefills(Instant::now());
            let mut slots: Vec<ReplicaIdx> = ended.iter().filter_map(|id| load.replica_of(id)).collect();
            slots.sort_unstable();
            slots.dedup();
            let figures: Vec<(ReplicaIdx, ReplicaLoad)> = slots.into_iter().map(|r| (r, load.load(r))).collect();
            (ended, figures)
        };
        for (r, f) in figures {
            self.publish_load(r, f);
        }
        if !ended.is_empty() {
            self.capacity_freed();
        }
        if let Some(outbox) = self.outbox.get() {
            for id in ended {
                outbox.send(SyncEvent::FirstToken { model: self.config.model.clone(), request_id: id.request_id() });
            }
        }
    }

    /// Releases bookings older than `max_age`.
    pub fn expire(&self, max_age: Duration) -> usize {
        let slots = self.members().len();
        let (n, unchecked, figures) = {
            let mut load = self.load_table();
            let (n, unchecked) = load.expire(Instant::now(), max_age);
            (n, unchecked, (0..slots).map(|i| load.load(ReplicaIdx::new(i))).collect::<Vec<_>>())
        };
        for slot in unchecked {
            self.unchecked(slot, Unchecked::NoUsage);
        }
        self.publish_pool_load(&figures);
        for (i, f) in figures.into_iter().enumerate() {
            self.publish_load(ReplicaIdx::new(i), f);
        }
        if n > 0 {
            self.capacity_freed();
        }
        n
    }

    /// Sets the pool's autoscaling gauges from each slot's load: the prefill backlog and the
    /// requests in flight over its routable replicas, and (with admission control) the share
    /// of them saturated.
    fn publish_pool_load(&self, figures: &[ReplicaLoad]) {
        let routable: Vec<&ReplicaLoad> =
            self.members().iter().zip(figures).filter(|(m, _)| m.active).map(|(_, f)| f).collect();
        let labels = self.pool_labels();
        let backlog: u64 = routable.iter().map(|l| l.prefill_tokens).sum();
        let requests: u64 = routable.iter().map(|l| l.requests).sum();
        self.metrics.pool_prefill_backlog.get_or_create(&labels).set(backlog as i64);
        self.metrics.pool_active_requests.get_or_create(&labels).set(requests as i64);
        if let (Some(gate), false) = (&self.admission, routable.is_empty()) {
            let saturated = routable.iter().filter(|l| gate.saturated(l)).count();
            self.metrics.pool_saturation.get_or_create(&labels).set(saturated as f64 / routable.len() as f64);
        }
    }

    /// Sets a replica's load gauges. Takes the members lock: never call it holding the load
    /// table (the lock order is members, index, affinity, load).
    pub(super) fn publish_load(&self, replica: ReplicaIdx, l: ReplicaLoad) {
        self.set_gauges(replica, |labels| {
            self.metrics.active_requests.get_or_create(labels).set((l.requests - l.external) as i64);
            self.metrics.prefill_tokens.get_or_create(labels).set(l.prefill_tokens as i64);
        });
    }
}
