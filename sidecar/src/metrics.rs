//! Prometheus metrics, served at `GET /metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// Labels naming one replica.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplicaLabels {
    /// The pool's model.
    pub model: String,
    /// The replica id.
    pub replica: String,
}

/// Labels naming a replica and a reason.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// The pool's model.
    pub model: String,
    /// The replica id.
    pub replica: String,
    /// Why.
    pub reason: String,
}

/// The reasons [`Metrics::degraded`] is labelled with, each a series per replica, in the order
/// of the replica's health flags: degraded, stalled, disconnected.
pub const DEGRADED_REASONS: [&str; 3] = ["lost_events", "stalled", "disconnected"];

/// Labels of a decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// The pool's model.
    pub model: String,
    /// The policy that decided.
    pub policy: String,
    /// `hit` if the chosen replica held part of the prompt, else `miss`.
    pub outcome: String,
}

/// Labels of a lifecycle report.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LifecycleLabels {
    /// `first_token`, `progress`, `done`, `ran_on`, `served_whole` or `usage`.
    pub kind: &'static str,
    /// Whether the report found its request's booking in its model's pool.
    pub known: bool,
}

/// Labels for requests that could not be scored.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FallbackLabels {
    /// Why routing fell back to Envoy's load balancer.
    pub reason: String,
}

/// Labels of something refused.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabels {
    /// Why it was refused.
    pub reason: String,
}

/// Labels of a pool's discovery source.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DiscoveryLabels {
    /// The pool's model.
    pub model: String,
    /// `static`, `dns` or `envoy`.
    pub kind: String,
}

/// Every metric the sidecar exports.
pub struct Metrics {
    registry: Registry,
    /// Route decisions, per chosen replica.
    pub route_decisions: Family<ReplicaLabels, Counter>,
    /// Decisions by policy and outcome.
    pub decisions: Family<DecisionLabels, Counter>,
    /// Device-tier overlap of the chosen replica, in blocks.
    pub chosen_overlap_blocks: Histogram,
    /// Route calls answered without a replica.
    pub route_fallbacks: Family<FallbackLabels, Counter>,
    /// Calls refused because the filter speaks another wire version (another release).
    pub wire_mismatches: Counter,
    /// Sync messages dropped because the peer sidecar speaks another sync version.
    pub sync_mismatches: Counter,
    /// Sync messages refused: not sealed with the mesh's key, or too old.
    pub sync_rejected: Family<RefusalLabels, Counter>,
    /// Views handed over to starting peers.
    pub handovers_served: Counter,
    /// Bytes of offloaded bodies held now (read, waiting for a tokenizer, or tokenizing).
    pub offload_bytes_held: Gauge,
    /// Idle tokenizer slots that long offloaded prompts spread over, beyond their own.
    pub offload_spare_threads: Counter,
    /// Handover requests not answered: unauthenticated, too old, or over the rate limit.
    pub handovers_refused: Family<RefusalLabels, Counter>,
    /// Bytes of the handover answers sent.
    pub handover_bytes: Counter,
    /// Blocks restored at start from a peer's view or the saved one, per replica.
    pub handover_restored_blocks: Family<ReplicaLabels, Counter>,
    /// Bytes of the view last saved to `state_file`.
    pub saved_view_bytes: Gauge,
    /// Saves of the view to `state_file` that failed.
    pub saved_view_failures: Counter,
    /// Time to score and book one request.
    pub route_seconds: Histogram,
    /// KV events applied to the index.
    pub events_applied: Family<ReplicaLabels, Counter>,
    /// KV events or messages dropped, by reason.
    pub events_dropped: Family<ReasonLabels, Counter>,
    /// Sequence gaps closed by replay.
    pub gaps_replayed: Family<ReplicaLabels, Counter>,
    /// Sequence gaps that could not be closed (the replica became degraded).
    pub gaps_lost: Family<ReplicaLabels, Counter>,
    /// 1 while a replica's blocks earn no credit (degraded or its publisher stalled).
    pub degraded: Family<ReasonLabels, Gauge>,
    /// Blocks indexed per replica.
    pub index_blocks: Family<ReplicaLabels, Gauge>,
    /// Unix time of the last KV-event message applied per replica (event lag: now minus it).
    pub last_event: Family<ReplicaLabels, Gauge>,
    /// From an engine's batch timestamp to its changes being visible to decisions, per pool.
    pub event_lag_seconds: Family<PoolLabels, Histogram, fn() -> Histogram>,
    /// Active (booked, not finished) requests per replica.
    pub active_requests: Family<ReplicaLabels, Gauge>,
    /// Booked prefill tokens per replica.
    pub prefill_tokens: Family<ReplicaLabels, Gauge>,
    /// Requests an engine reports beyond kvgate's bookings (`engine_metrics_secs`).
    pub external_requests: Family<ReplicaLabels, Gauge>,
    /// Lifecycle reports received, by kind and whether the request was known.
    pub lifecycle_events: Family<LifecycleLabels, Counter>,
    /// Active replicas per pool, as discovery last saw them.
    pub replicas: Family<DiscoveryLabels, Gauge>,
    /// Discovery refreshes that failed (the last membership was kept).
    pub discovery_errors: Family<DiscoveryLabels, Counter>,
    /// Predicted minus engine-reported cached prompt tokens, per chosen replica.
    pub prediction_error: Family<ReplicaLabels, Histogram, fn() -> Histogram>,
    /// Predictions checked against the engine, per replica (`reason`: a
    /// [`crate::accuracy::Class`]: exact, in_flight, evicted, cached_since, over, under).
    pub predictions: Family<ReasonLabels, Counter>,
    /// Routed requests whose prediction was not checked (`reason`: an
    /// [`crate::accuracy::Unchecked`]: no_cached_tokens, no_usage, moved, estimated).
    pub predictions_unchecked: Family<ReasonLabels, Counter>,
    /// 1 if a replica's engine reports cached prompt tokens, 0 if its last usage had none.
    pub engine_reports_cached_tokens: Family<ReplicaLabels, Gauge>,
    /// Exactly counted prompts whose token count the engine reported differently.
    pub prompt_token_mismatches: Family<ReplicaLabels, Counter>,
    /// 1 while a pool's predictions keep missing what its engines report.
    pub prediction_alarm: Family<PoolLabels, Gauge>,
    /// `|predicted − measured| / measured` time to first token, per chosen replica.
    pub ttft_prediction_error: Family<ReplicaLabels, Histogram, fn() -> Histogram>,
    /// 1 while a replica's TTFT predictions keep missing what the filter measures.
    pub ttft_prediction_alarm: Family<ReplicaLabels, Gauge>,
    /// `|predicted − measured| / measured` inter-token latency, per chosen replica.
    pub itl_prediction_error: Family<ReplicaLabels, Histogram, fn() -> Histogram>,
    /// 1 while a replica's ITL predictions keep missing what the filter measures.
    pub itl_prediction_alarm: Family<ReplicaLabels, Gauge>,
    /// Offloaded requests routed and booked on an estimate of their size: their prompt could
    /// not be read (reason `unparsable` or `untokenizable`).
    pub estimated_requests: Family<FallbackLabels, Counter>,
    /// Requests that waited for capacity (admission control), by how it ended: `admitted`,
    /// or shed for `queue_full` / `queue_time`.
    pub admission: Family<AdmissionLabels, Counter>,
    /// How long requests that waited for capacity waited, admitted or shed.
    pub admission_wait_seconds: Histogram,
    /// Requests waiting for capacity now, per pool.
    pub admission_waiting: Family<PoolLabels, Gauge>,
    /// For an autoscaler: booked prefill tokens not yet computed, over the pool's replicas.
    pub pool_prefill_backlog: Family<PoolLabels, Gauge>,
    /// For an autoscaler: requests in flight on the pool's replicas (external ones included).
    pub pool_active_requests: Family<PoolLabels, Gauge>,
    /// For an autoscaler: the share of the pool's replicas admission control counts saturated
    /// (set only with admission control).
    pub pool_saturation: Family<PoolLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    /// Decisions in disaggregated pools, by mode: `disaggregated`, or served whole for
    /// `short_prompt`, `prefill_busy`, `no_prefill_worker` or `several_prompts`.
    pub disaggregation: Family<ModeLabels, Counter>,
    /// Decisions of requests with a session in pools that bind sessions, by outcome: `new`,
    /// `kept`, or why the session moved (`replica_gone`, `prefix_gone`, `saturated`,
    /// `outweighed`).
    pub session_decisions: Family<OutcomeLabels, Counter>,
    /// Decisions held to a TTFT SLO, by outcome: `within` (the replica chosen is predicted to
    /// meet it), `missed` (none is, and the class is not sheddable), `unpredicted` (some
    /// candidate's model does not predict yet), `shed`.
    pub slo_decisions: Family<OutcomeLabels, Counter>,
    /// Sessions bound, per pool (expired bindings are dropped as new ones come).
    pub sessions_bound: Family<PoolLabels, Gauge>,
}

/// Labels of a pool's decision counted by outcome (a session's, one held to a TTFT SLO).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// The pool's model.
    pub model: String,
    /// The outcome (see the metric).
    pub outcome: String,
}

/// Labels of a disaggregated pool's decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabels {
    /// The pool's model.
    pub model: String,
    /// `disaggregated`, or why the request was served whole.
    pub mode: String,
}

/// Labels of an admission outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdmissionLabels {
    /// The pool's model.
    pub model: String,
    /// The request's priority class.
    pub class: String,
    /// `admitted`, `queue_full` or `queue_time`.
    pub outcome: String,
}

/// Labels naming a pool.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    /// The pool's model.
    pub model: String,
}

/// Buckets of the prediction error, in tokens: symmetric around the exact 0.
fn prediction_error_histogram() -> Histogram {
    let up = [1.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0];
    let mut bounds: Vec<f64> = up.iter().rev().map(|b| -b - 0.5).collect();
    bounds.push(-0.5);
    bounds.push(0.5);
    bounds.extend(up.iter().map(|b| b - 0.5 + 1.0));
    Histogram::new(bounds)
}

/// Buckets of the event lag: 0.5 ms to about 16 s.
fn event_lag_histogram() -> Histogram {
    Histogram::new(exponential_buckets(5e-4, 2.0, 16))
}

/// Buckets of the relative TTFT or ITL prediction error.
fn latency_error_histogram() -> Histogram {
    Histogram::new([0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0, 5.0])
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("kvgate");
        let route_decisions = Family::default();
        let route_fallbacks = Family::default();
        let wire_mismatches = Counter::default();
        let sync_mismatches = Counter::default();
        let handovers_served = Counter::default();
        let offload_bytes_held = Gauge::default();
        let offload_spare_threads = Counter::default();
        let sync_rejected = Family::default();
        let handovers_refused = Family::default();
        let handover_bytes = Counter::default();
        let handover_restored_blocks = Family::default();
        let saved_view_bytes = Gauge::default();
        let saved_view_failures = Counter::default();
        let decisions = Family::default();
        let chosen_overlap_blocks = Histogram::new([0.0, 1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0]);
        let route_seconds = Histogram::new(exponential_buckets(5e-6, 2.0, 16));
        let events_applied = Family::default();
        let events_dropped = Family::default();
        let gaps_replayed = Family::default();
        let gaps_lost = Family::default();
        let degraded = Family::default();
        let index_blocks = Family::default();
        let last_event = Family::default();
        let event_lag_seconds: Family<PoolLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(event_lag_histogram);
        let active_requests = Family::default();
        let prefill_tokens = Family::default();
        let external_requests = Family::default();
        let lifecycle_events = Family::default();
        let replicas = Family::default();
        let discovery_errors = Family::default();
        let prediction_error: Family<ReplicaLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(prediction_error_histogram);
        let predictions = Family::default();
        let predictions_unchecked = Family::default();
        let engine_reports_cached_tokens = Family::default();
        let prompt_token_mismatches = Family::default();
        let prediction_alarm = Family::default();
        let ttft_prediction_error: Family<ReplicaLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_error_histogram);
        let ttft_prediction_alarm = Family::default();
        let itl_prediction_error: Family<ReplicaLabels, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_error_histogram);
        let itl_prediction_alarm = Family::default();
        let estimated_requests = Family::default();
        let admission = Family::default();
        let admission_wait_seconds = Histogram::new(exponential_buckets(1e-3, 2.0, 14));
        let admission_waiting = Family::default();
        let pool_prefill_backlog = Family::default();
        let pool_active_requests = Family::default();
        let pool_saturation = Family::default();
        registry.register(
            "pool_prefill_backlog_tokens",
            "Booked prefill tokens not yet computed over the pool's replicas (an autoscaling signal)",
            pool_prefill_backlog.clone(),
        );
        registry.register(
            "pool_active_requests",
            "Requests in flight on the pool's replicas, external ones included (an autoscaling signal)",
            pool_active_requests.clone(),
        );
        registry.register(
            "pool_saturation",
            "Share of the pool's replicas admission control counts saturated (an autoscaling signal)",
            pool_saturation.clone(),
        );
        let disaggregation = Family::default();
        registry.register(
            "disaggregation_decisions",
            "Decisions in disaggregated pools, by mode (disaggregated, or why served whole)",
            disaggregation.clone(),
        );
        let session_decisions = Family::default();
        registry.register(
            "session_decisions",
            "Decisions of requests with a session, by outcome (new, kept, or why the session moved)",
            session_decisions.clone(),
        );
        let sessions_bound = Family::default();
        registry.register("sessions_bound", "Sessions bound to a replica, per pool", sessions_bound.clone());
        let slo_decisions = Family::default();
        registry.register(
            "slo_decisions",
            "Decisions held to a TTFT SLO, by outcome (within, missed, unpredicted, shed)",
            slo_decisions.clone(),
        );
        registry.register(
            "admission",
            "Requests that waited for capacity or were shed, by outcome (admitted after waiting, queue_full, queue_time, slo)",
            admission.clone(),
        );
        registry.register(
            "admission_wait_seconds",
            "How long requests that waited for capacity waited",
            admission_wait_seconds.clone(),
        );
        registry.register("admission_waiting", "Requests waiting for capacity now", admission_waiting.clone());
        registry.register(
            "estimated_requests",
            "Offloaded requests routed on an estimate of their size: their prompt could not be read",
            estimated_requests.clone(),
        );
        registry.register(
            "prediction_error_tokens",
            "Predicted minus engine-reported cached prompt tokens (usage.prompt_tokens_details), per chosen replica",
            prediction_error.clone(),
        );
        registry.register(
            "predictions",
            "Cache predictions checked against the engine's usage (reason: exact; in_flight, short by the credit \
             for a prefix routed there moments ago; evicted, or cached_since, the replica's events changed its cache \
             in between; over, under: unexplained)",
            predictions.clone(),
        );
        registry.register(
            "predictions_unchecked",
            "Routed requests whose cache prediction was not checked (reason: no_cached_tokens, the engine reports \
             none; no_usage; moved, it ran elsewhere; estimated, its prompt was not counted)",
            predictions_unchecked.clone(),
        );
        registry.register(
            "engine_reports_cached_tokens",
            "1 if the replica's engine reports cached prompt tokens (vLLM --enable-prompt-tokens-details, SGLang \
             --enable-cache-report), 0 if it does not",
            engine_reports_cached_tokens.clone(),
        );
        registry.register(
            "prompt_token_mismatches",
            "Prompts tokenized whole whose token count the engine reported differently (template or tokenizer drift)",
            prompt_token_mismatches.clone(),
        );
        registry.register(
            "prediction_alarm",
            "1 while a pool's cache predictions keep missing what its engines report",
            prediction_alarm.clone(),
        );
        registry.register(
            "ttft_prediction_error_ratio",
            "|predicted - measured| / measured time to first token of streamed requests, per chosen replica (the \
             filter measures from the request leaving it to the response's first byte)",
            ttft_prediction_error.clone(),
        );
        registry.register(
            "ttft_prediction_alarm",
            "1 while a replica's TTFT predictions keep missing what the filter measures: fewer than half of its \
             last 16 within 25 % + 5 ms (it slowed down behind kvgate's back, or its TTFT depends on more than the \
             model's inputs)",
            ttft_prediction_alarm.clone(),
        );
        registry.register(
            "itl_prediction_error_ratio",
            "|predicted - measured| / measured inter-token latency of streamed requests, per chosen replica (the \
             filter measures from the response's first byte to its last, over the tokens the engine produced less \
             one)",
            itl_prediction_error.clone(),
        );
        registry.register(
            "itl_prediction_alarm",
            "1 while a replica's ITL predictions keep missing what the filter measures: fewer than half of its last \
             16 within 25 % + 1 ms (its decode slowed down behind kvgate's back, or depends on more than the model's \
             inputs)",
            itl_prediction_alarm.clone(),
        );
        registry.register("replicas", "Active replicas per pool", replicas.clone());
        registry.register(
            "discovery_errors",
            "Discovery refreshes that failed; the last membership was kept",
            discovery_errors.clone(),
        );
        registry.register("route_decisions", "Route decisions per chosen replica", route_decisions.clone());
        registry.register("route_fallbacks", "Route calls answered without a replica", route_fallbacks.clone());
        registry.register(
            "wire_mismatches",
            "Calls refused: the filter speaks another wire version (deploy both from one release)",
            wire_mismatches.clone(),
        );
        registry.register(
            "sync_mismatches",
            "Sync messages dropped: the peer sidecar runs another release (deploy gateways from one release)",
            sync_mismatches.clone(),
        );
        registry.register(
            "sync_rejected",
            "Sync messages refused, by reason: unauthenticated (not sealed with this mesh's key) or stale (older than 60 s)",
            sync_rejected.clone(),
        );
        registry.register(
            "handovers_refused",
            "Handover requests not answered, by reason: unauthenticated, stale or rate_limited",
            handovers_refused.clone(),
        );
        registry.register("handover_bytes", "Bytes of the views handed over to starting peers", handover_bytes.clone());
        registry.register(
            "offload_bytes_held",
            "Bytes of offloaded bodies held now (read, waiting for a tokenizer, or tokenizing), at most offload_queue_bytes",
            offload_bytes_held.clone(),
        );
        registry.register(
            "offload_spare_threads",
            "Idle tokenizer slots (one per core) that long offloaded prompts spread over, beyond their own",
            offload_spare_threads.clone(),
        );
        registry.register(
            "handovers_served",
            "Views (index and bookings) handed over to sidecars that started while this one ran",
            handovers_served.clone(),
        );
        registry.register(
            "handover_restored_blocks",
            "Blocks this sidecar restored at start from a peer's view, or its own saved one, instead of the engines' replay",
            handover_restored_blocks.clone(),
        );
        registry.register(
            "saved_view_bytes",
            "Bytes of the view last saved to state_file, for the sidecar's next start",
            saved_view_bytes.clone(),
        );
        registry.register(
            "saved_view_failures",
            "Saves of the view to state_file that failed (the log says why)",
            saved_view_failures.clone(),
        );
        registry.register(
            "decisions",
            "Decisions by policy and outcome (hit: the chosen replica held part of the prompt)",
            decisions.clone(),
        );
        registry.register(
            "chosen_overlap_blocks",
            "Device-tier overlap of the chosen replica, in blocks",
            chosen_overlap_blocks.clone(),
        );
        registry.register("route_seconds", "Time to score and book one request", route_seconds.clone());
        registry.register("kv_events_applied", "KV events applied to the index", events_applied.clone());
        registry.register("kv_events_dropped", "KV events or messages dropped, by reason", events_dropped.clone());
        registry.register("kv_gaps_replayed", "Event sequence gaps closed by replay", gaps_replayed.clone());
        registry.register("kv_gaps_lost", "Event sequence gaps that could not be replayed", gaps_lost.clone());
        registry.register(
            "replica_degraded",
            "1 while a replica earns no cache credit (reason: lost_events or stalled)",
            degraded.clone(),
        );
        registry.register("index_blocks", "Blocks indexed per replica", index_blocks.clone());
        registry.register(
            "kv_last_event_timestamp_seconds",
            "Unix time of the last KV-event message applied per replica",
            last_event.clone(),
        );
        registry.register(
            "kv_event_lag_seconds",
            "From an engine's KV-event batch timestamp to its changes being visible to decisions \
             (engine and gateway clocks both count: a skewed clock reads as lag, or as 0)",
            event_lag_seconds.clone(),
        );
        registry.register("active_requests", "Booked, unfinished requests per replica", active_requests.clone());
        registry.register(
            "prefill_tokens",
            "Booked prefill tokens per replica (with engine metrics, plus outside requests waiting)",
            prefill_tokens.clone(),
        );
        registry.register(
            "external_requests",
            "Requests an engine reports beyond those kvgate booked",
            external_requests.clone(),
        );
        registry.register(
            "lifecycle_events",
            "Lifecycle reports, by kind and whether they found their request's booking (known)",
            lifecycle_events.clone(),
        );
        Metrics {
            registry,
            route_decisions,
            route_fallbacks,
            wire_mismatches,
            sync_mismatches,
            handovers_served,
            offload_bytes_held,
            offload_spare_threads,
            sync_rejected,
            handovers_refused,
            handover_bytes,
            handover_restored_blocks,
            saved_view_bytes,
            saved_view_failures,
            decisions,
            chosen_overlap_blocks,
            route_seconds,
            events_applied,
            events_dropped,
            gaps_replayed,
            gaps_lost,
            degraded,
            index_blocks,
            last_event,
            event_lag_seconds,
            active_requests,
            prefill_tokens,
            external_requests,
            lifecycle_events,
            replicas,
            discovery_errors,
            prediction_error,
            predictions,
            predictions_unchecked,
            engine_reports_cached_tokens,
            prompt_token_mismatches,
            prediction_alarm,
            ttft_prediction_error,
            ttft_prediction_alarm,
            itl_prediction_error,
            itl_prediction_alarm,
            estimated_requests,
            admission,
            admission_wait_seconds,
            admission_waiting,
            pool_prefill_backlog,
            pool_active_requests,
            pool_saturation,
            disaggregation,
            session_decisions,
            sessions_bound,
            slo_decisions,
        }
    }
}

impl Metrics {
    /// Counts a dropped event or message of a replica.
    pub fn dropped(&self, replica: &ReplicaLabels, reason: &str) {
        let labels =
            ReasonLabels { model: replica.model.clone(), replica: replica.replica.clone(), reason: reason.to_owned() };
        self.events_dropped.get_or_create(&labels).inc();
    }

    /// Removes a replica's gauge series once it has left its pool: their last values would
    /// read as live (a degraded replica, events gone stale) and keep alerts firing. Its
    /// counters and histograms stay, being cumulative.
    pub fn forget_replica(&self, replica: &ReplicaLabels) {
        let gauges = [
            &self.index_blocks,
            &self.last_event,
            &self.active_requests,
            &self.prefill_tokens,
            &self.external_requests,
            &self.engine_reports_cached_tokens,
            &self.ttft_prediction_alarm,
            &self.itl_prediction_alarm,
        ];
        for gauge in gauges {
            gauge.remove(replica);
        }
        for reason in DEGRADED_REASONS {
            let labels = ReasonLabels {
                model: replica.model.clone(),
                replica: replica.replica.clone(),
                reason: reason.to_owned(),
            };
            self.degraded.remove(&labels);
        }
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
