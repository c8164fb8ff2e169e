//! The HTTP API the filter (and operators) call. Bodies of the `/v1` endpoints are
//! [`kvgate_shared::codec`]-encoded; see [`kvgate_shared::wire`] for the table of endpoints.
//!
//! Operator endpoints: `GET /metrics` (Prometheus), `GET /healthz` (200 `ok`, or 503 with what
//! is wrong: a failed start-up, a background thread ended or stalled — `crate::health`),
//! `GET /livez` (200 while the process answers: the liveness probe, which must not restart a
//! sidecar that is degraded but serving), `GET /debug/state` (JSON),
//! `GET /debug/explain[?request=ID][&last=N]` (every candidate's cost terms per decision; `ID`
//! a booking key or a client's `x-request-id`, also as `request_id=ID`).
//! A sidecar whose start-up failed serves [`degraded_router`] meanwhile.
//!
//! Spans (exported with `--otlp-endpoint`, children of the request's `traceparent`):
//! `kvgate.route`, one per decision, with the chosen `replica`, its `cached_blocks` and every
//! candidate's cost (`candidates`: `replica=cost/cached_blocks`); inside it
//! `kvgate.admission_wait`, each wait in the pool's queue, and `kvgate.tokenize`, an offloaded
//! prompt rendered and tokenized here.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvgate_shared::codec;
use kvgate_shared::prompt::openai::{model_of, parse, ParsedRequest};
use kvgate_shared::prompt::spread::MIN_PART_BYTES;
use kvgate_shared::wire::{
    Adapter, LifecycleBatch, LifecycleKind, ModelList, RouteBodyRequest, RouteRequest, CONTENT_TYPE, MAX_BODY_BYTES,
    SHED_REASON_HEADER, WIRE_VERSION, WIRE_VERSION_HEADER,
};

use crate::admission::{Place, ShedReason};
use crate::health::Health;
use crate::metrics::{AdmissionLabels, FallbackLabels, LifecycleLabels, Metrics, PoolLabels};
use crate::pool::{Admit, NotAdmitted, OffloadError, Offloaded, Pool};
use crate::score::ScoringConfig;
use kvgate_telemetry as telemetry;
use tracing::Instrument;

pub mod trace;

/// What every handler shares.
pub struct AppState {
    /// Pools by base model name.
    pub pools: HashMap<String, Arc<Pool>>,
    /// Cost-function knobs.
    pub scoring: ScoringConfig,
    /// Whether requests may override scoring knobs.
    pub allow_request_overrides: bool,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Offloaded prompts tokenized at once: one per core unless configured (`offload_threads`).
    /// Others wait, up to their deadline.
    offload_slots: Arc<tokio::sync::Semaphore>,
    /// The most slots one long offloaded prompt is tokenized on.
    offload_spread: usize,
    /// Bytes of offloaded bodies held at once (read, waiting or tokenizing), one permit a byte.
    offload_bytes: Arc<tokio::sync::Semaphore>,
    /// The background threads' heartbeats, for `/healthz`.
    health: Arc<Health>,
}

/// Offloaded bodies held at once unless configured otherwise: four of the largest.
pub const DEFAULT_OFFLOAD_QUEUE_BYTES: usize = 4 * MAX_BODY_BYTES;

impl AppState {
    /// The state of a sidecar routing `pools`.
    pub fn new(
        pools: HashMap<String, Arc<Pool>>,
        scoring: ScoringConfig,
        allow_request_overrides: bool,
        metrics: Arc<Metrics>,
    ) -> AppState {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let offload_slots = Arc::new(tokio::sync::Semaphore::new(cores));
        let offload_bytes = Arc::new(tokio::sync::Semaphore::new(DEFAULT_OFFLOAD_QUEUE_BYTES));
        AppState {
            pools,
            scoring,
            allow_request_overrides,
            metrics,
            offload_slots,
            offload_spread: 1,
            offload_bytes,
            health: Health::new(),
        }
    }

    /// Reports the health of `health`'s threads on `/healthz`.
    pub fn with_health(self, health: Arc<Health>) -> AppState {
        AppState { health, ..self }
    }

    /// Tokenizes at most `slots` offloaded prompts at once (default: one per core).
    pub fn with_offload_slots(self, slots: usize) -> AppState {
        AppState { offload_slots: Arc::new(tokio::sync::Semaphore::new(slots.max(1))), ..self }
    }

    /// Tokenizes a long offloaded prompt on up to `threads` slots, those no other prompt holds
    /// (the config's `offload_spread_threads`; default 1).
    pub fn with_offload_spread(self, threads: usize) -> AppState {
        AppState { offload_spread: threads.max(1), ..self }
    }

    /// Holds at most `bytes` of offloaded bodies at once (the config's `offload_queue_bytes`).
    pub fn with_offload_queue_bytes(self, bytes: usize) -> AppState {
        AppState { offload_bytes: Arc::new(tokio::sync::Semaphore::new(bytes)), ..self }
    }

    /// Reserves room for an offloaded body of `bytes`, if there is room now; released (and
    /// the gauge lowered) when the reservation is dropped.
    fn reserve_offload(&self, bytes: usize) -> Option<OffloadRoom> {
        let permits = u32::try_from(bytes).ok()?;
        let permit = self.offload_bytes.clone().try_acquire_many_owned(permits).ok()?;
        self.metrics.offload_bytes_held.inc_by(i64::from(permits));
        Some(OffloadRoom { _permit: permit, bytes: i64::from(permits), metrics: self.metrics.clone() })
    }

    /// The pool a request's `model` routes in: the pool of that base model, else the pool
    /// that serves an adapter of that name (configured or learned from its engines).
    pub fn pool_for(&self, model: &str) -> Option<&Arc<Pool>> {
        self.pools.get(model).or_else(|| self.pools.values().find(|p| p.serves_adapter(model)))
    }
}

/// Room held for one offloaded body.
struct OffloadRoom {
    _permit: tokio::sync::OwnedSemaphorePermit,
    bytes: i64,
    metrics: Arc<Metrics>,
}

impl Drop for OffloadRoom {
    fn drop(&mut self) {
        self.metrics.offload_bytes_held.dec_by(self.bytes);
    }
}

/// The API's routes.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/route", post(route))
        .route("/v1/route_body", post(route_body))
        .route("/v1/lifecycle", post(lifecycle))
        .route("/v1/models", get(models))
        // A Hugging Face name (`org/name`) arrives percent-encoded from the filter; its
        // slashes may also arrive as they are, from other clients: both name the model.
        .route("/v1/models/{*model_path}", get(tokenizer))
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/livez", get(|| async { "ok" }))
        .route("/debug/state", get(debug_state))
        .route("/debug/explain", get(debug_explain))
        // Offloaded bodies and lifecycle batches are as large as Envoy buffers, plus the
        // envelope (axum's own default is 2 MiB).
        .layer(DefaultBodyLimit::max(OFFLOAD_LIMIT))
        // A filter of another release: refused by name before its body is misread.
        .layer(axum::middleware::from_fn_with_state(state.clone(), same_wire))
        .with_state(state)
}

/// Refuses a call whose `x-kvgate-wire` names another wire version (409, counted in
/// `kvgate_wire_mismatches_total`); calls without it (curl, probes) pass.
async fn same_wire(
    State(state): State<Arc<AppState>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let other = request.headers().get(WIRE_VERSION_HEADER).filter(|v| v.as_bytes() != WIRE_VERSION.as_bytes());
    let Some(theirs) = other else { return next.run(request).await };
    state.metrics.wire_mismatches.inc();
    let message = format!(
        "kvgate wire version mismatch: the filter speaks {}, this sidecar {WIRE_VERSION}; \
         deploy the filter and the sidecar from the same release",
        String::from_utf8_lossy(theirs.as_bytes())
    );
    (StatusCode::CONFLICT, message).into_response()
}

/// Room for a [`RouteBodyRequest`]'s fields around the body it carries.
const ENVELOPE_BYTES: usize = 64 << 10;
/// An offload call this small carries a body about the filter's default `offload_bytes` (16
/// KiB) or less, with its fields: sent because the filter holds no tokenizer for its model,
/// not because it is big. It takes no room in `offload_queue_bytes` and, once the pool's
/// tokenizer has loaded, is tokenized on its own task (natively at most about 0.3 ms, about
/// what a decision takes) rather than waiting for one of the slots big bodies share.
const SMALL_OFFLOAD: usize = 20 << 10;
/// The largest offload call read.
const OFFLOAD_LIMIT: usize = MAX_BODY_BYTES + ENVELOPE_BYTES;

/// The read-only routes of the optional `metrics_listen` listener: `/metrics`, `/healthz` and
/// `/livez`.
pub fn metrics_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/livez", get(|| async { "ok" }))
        .with_state(state)
}

/// What a sidecar whose start-up failed serves while it retries: `/livez` answers, `/healthz`
/// says why it is not running (503), and every other call is answered 503 at once, so the
/// filter fails open without waiting out its timeout.
pub fn degraded_router(health: Arc<Health>) -> Router {
    let why = health.clone();
    let not_running = move || {
        let why: Vec<String> = why.report(Instant::now()).iter().map(|p| format!("{p:?}")).collect();
        let message = format!("kvgate-sidecar is not running: {}", why.join("; "));
        async move { (StatusCode::SERVICE_UNAVAILABLE, message) }
    };
    Router::new()
        .route("/livez", get(|| async { "ok" }))
        .route("/healthz", get(move || report(health.clone())))
        .fallback(not_running)
}

async fn healthz(State(state): State<Arc<AppState>>) -> Response {
    report(state.health.clone()).await
}

/// `ok`, or 503 and the problems as JSON.
async fn report(health: Arc<Health>) -> Response {
    let problems = health.report(Instant::now());
    if problems.is_empty() {
        return "ok".into_response();
    }
    (StatusCode::SERVICE_UNAVAILABLE, Json(serde_json::json!({ "problems": problems }))).into_response()
}

fn encoded<T: serde::Serialize>(value: &T) -> Response {
    match codec::encode(value) {
        Ok(bytes) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], bytes).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

fn fallback(state: &AppState, reason: &str, status: StatusCode, message: String) -> Response {
    state.metrics.route_fallbacks.get_or_create(&FallbackLabels { reason: reason.to_owned() }).inc();
    (status, message).into_response()
}

/// The span a call about one request runs in: a child of the request's trace when the filter passed its `traceparent` on, so that the decision is a
/// span of the request's trace and every line logged about the request names its trace id.
/// None when the call is neither traced nor exported: the decision then pays for no span.
fn request_span(headers: &HeaderMap) -> tracing::Span {
    use tracing::field::Empty;
    let trace_id = headers.get("traceparent").and_then(|v| trace::trace_id(v.to_str().ok()?));
    if trace_id.is_none() && !telemetry::exporting() {
        return tracing::Span::none();
    }
    let span = tracing::info_span!(
        "kvgate.route",
        trace_id,
        request_id = Empty,
        model = Empty,
        replica = Empty,
        cached_blocks = Empty,
        candidates = Empty
    );
    telemetry::adopt_parent(&span, headers);
    span
}

async fn route(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    route_in(state, body).instrument(request_span(&headers)).await
}

/// Names the request on its span, once its body is read.
fn name_request(span: &tracing::Span, request_id: &impl std::fmt::Display, model: &impl std::fmt::Display) {
    span.record("request_id", tracing::field::display(request_id));
    span.record("model", tracing::field::display(model));
}

async fn route_in(state: Arc<AppState>, body: Bytes) -> Response {
    let started = Instant::now();
    let req: RouteRequest = match codec::decode(&body) {
        Ok(r) => r,
        Err(e) => return fallback(&state, "bad_request", StatusCode::BAD_REQUEST, e.to_string()),
    };
    name_request(&tracing::Span::current(), &req.request_id, &req.model);
    let Some(pool) = state.pool_for(req.model.as_str()) else {
        tracing::debug!(request_id = %req.request_id, model = %req.model, "no pool for the request's model");
        return fallback(&state, "unknown_model", StatusCode::NOT_FOUND, format!("no pool for model {:?}", req.model));
    };
    let scoring = match (&req.overrides, state.allow_request_overrides) {
        (Some(o), true) => state.scoring.with_overrides(o),
        _ => state.scoring.clone(),
    };
    let (answer, waited) = admitted(&state, pool, &req, &scoring, started).await;
    state.metrics.route_seconds.observe(started.elapsed().saturating_sub(waited).as_secs_f64());
    answer
}

/// Decides, with admission control where the pool has it: a request that finds every
/// replica saturated (or others in the queue ahead of it, unless its tenant's fair-share
/// headroom lets it through) waits in the pool's queue — at most
/// its class's `max_queue_ms` from `arrived`, and no longer than the filter said it waits —
/// and decides again when it is woken, where its prefix is cached then. Past that it is shed:
/// 429 with `Retry-After`, nothing booked; so is a request of a sheddable class that no
/// replica is predicted to serve within its class's TTFT SLO, at once. If the filter stops waiting, this future is
/// dropped and its place with it. Returns the answer and the time spent waiting (which the
/// decision-time histogram leaves out).
async fn admitted(
    state: &AppState,
    pool: &Pool,
    req: &RouteRequest,
    scoring: &ScoringConfig,
    arrived: Instant,
) -> (Response, Duration) {
    let Some(gate) = pool.admission() else { return (encoded(&pool.route(req, scoring)), Duration::ZERO) };
    let class = gate.class_of(req.priority.as_deref());
    let until = arrived + gate.max_wait(class).min(Duration::from_millis(u64::from(req.wait_ms)));
    let model = pool.config().model.clone();
    let waiting = state.metrics.admission_waiting.get_or_create(&PoolLabels { model: model.clone() }).clone();
    let outcome = |outcome: &str| {
        let class = gate.class_name(class).to_owned();
        let labels = AdmissionLabels { model: model.clone(), class, outcome: outcome.to_owned() };
        state.metrics.admission.get_or_create(&labels).inc();
        state.metrics.admission_wait_seconds.observe(arrived.elapsed().as_secs_f64());
    };
    let shed = |reason: ShedReason, waited: Duration| {
        outcome(reason.label());
        tracing::debug!(
            request_id = %req.request_id,
            %model,
            reason = reason.label(),
            waited_ms = waited.as_millis() as u64,
            "shed"
        );
        let retry_after = gate.retry_after_secs().to_string();
        let message = match reason {
            ShedReason::Slo => format!("no replica of {model:?} is predicted to meet the request's TTFT SLO (slo)"),
            _ => format!("every replica of {model:?} is saturated ({})", reason.label()),
        };
        let headers = [(header::RETRY_AFTER.as_str(), retry_after.as_str()), (SHED_REASON_HEADER, reason.label())];
        (StatusCode::TOO_MANY_REQUESTS, headers, message).into_response()
    };
    let mut place = None;
    let mut woken = false;
    let mut waited = Duration::ZERO;
    loop {
        let seen = gate.releases();
        // Woken: decide. Otherwise with nobody in the queue ahead, or on its tenant's
        // fair-share headroom with nobody of a higher class waiting.
        let first = woken
            || match &place {
                None if gate.is_empty() => true,
                None => place.insert(gate.place(class, req.model.as_str(), req.tenant.as_deref())).is_first(),
                Some(p) => p.is_first(),
            };
        if first || (gate.has_fair_headroom() && req.tenant.is_some() && !gate.higher_waiting(class)) {
            match pool.admit(req, scoring, Admit { behind: !first, waited: arrived.elapsed() }) {
                Ok(decision) => {
                    if place.as_ref().is_some_and(|p: &Place<'_>| p.waited()) {
                        outcome("admitted");
                    }
                    // Dropping the place wakes the next waiter: there may be room for it too.
                    return (encoded(&decision), waited);
                }
                Err(NotAdmitted::OverSlo) => return (shed(ShedReason::Slo, waited), waited),
                Err(NotAdmitted::Saturated) => {}
            }
        }
        let p = place.get_or_insert_with(|| gate.place(class, req.model.as_str(), req.tenant.as_deref()));
        waiting.set(gate.waiting() as i64 + 1);
        let wait_started = Instant::now();
        let span = tracing::info_span!("kvgate.admission_wait", class = gate.class_name(class));
        let result = p.wait(seen, until).instrument(span).await;
        waited += wait_started.elapsed();
        waiting.set(gate.waiting() as i64);
        match result {
            Ok(signalled) => woken = signalled,
            Err(reason) => return (shed(reason, waited), waited),
        }
    }
}

/// The deadline of an offload whose request names no budget.
const DEFAULT_OFFLOAD_BUDGET: Duration = Duration::from_secs(1);

/// A prompt the filter offloaded: parsed and tokenized on a blocking thread, so that neither
/// an Envoy worker nor this runtime's threads stall on that — except a small one
/// ([`SMALL_OFFLOAD`]), parsed and (once its pool's tokenizer has loaded) tokenized on its own
/// task like a decision. At most one big
/// prompt per core is tokenized at once; a prompt that cannot be routed within the filter's
/// budget is skipped (`late`, 503) and not booked: the filter has given up on it. Bodies held
/// at once (read, waiting, tokenizing) are bounded in bytes: one past the bound is answered at
/// once (`offload_full`, 503) before it is read, and Envoy routes it.
async fn route_body(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let span = request_span(&headers);
    route_body_in(state, headers, body).instrument(span).await
}

async fn route_body_in(state: Arc<AppState>, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    // Room for the body as it says it is (at most what the route accepts) before reading it.
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
        .map_or(OFFLOAD_LIMIT, |n| n.min(OFFLOAD_LIMIT));
    // A small body (a request whose model the filter holds no tokenizer for) takes no room:
    // big bodies filling the queue must not turn it away.
    let small = declared <= SMALL_OFFLOAD;
    let _room = match small {
        true => None,
        false => match state.reserve_offload(declared) {
            Some(room) => Some(room),
            None => {
                let message = format!("{declared} bytes would pass the sidecar's offload_queue_bytes; routed by Envoy");
                return fallback(&state, "offload_full", StatusCode::SERVICE_UNAVAILABLE, message);
            }
        },
    };
    let body = match axum::body::to_bytes(body, declared).await {
        Ok(b) => b,
        Err(e) => return fallback(&state, "bad_request", StatusCode::BAD_REQUEST, e.to_string()),
    };
    // The envelope, read in place: the body stays in the call's bytes.
    let req: RouteBodyRequest<'_> = match codec::decode(&body) {
        Ok(r) => r,
        Err(e) => return fallback(&state, "bad_request", StatusCode::BAD_REQUEST, e.to_string()),
    };
    let budget = match req.budget_ms {
        0 => DEFAULT_OFFLOAD_BUDGET,
        ms => Duration::from_millis(u64::from(ms)),
    };
    let deadline = started + budget;
    let scoring = match (&req.overrides, state.allow_request_overrides) {
        (Some(o), true) => state.scoring.with_overrides(o),
        _ => state.scoring.clone(),
    };
    let request_id = req.request_id.clone();
    let offloaded = Offloaded::of(&req);
    let request = tracing::Span::current();
    // Read: a small body on this task, as quick as a decision; a big one on a blocking thread,
    // since parsing megabytes of JSON must not hold one of this runtime's threads. Neither
    // waits for a tokenizer: what cannot be routed is answered at once.
    let read = if small {
        parse_offloaded(&state, &req, &offloaded, &request)
    } else {
        drop(req);
        let (reading, offloaded) = (state.clone(), offloaded.clone());
        // Decoded again, in place, where it is parsed (the task read only its envelope).
        let parse = move || match codec::decode::<RouteBodyRequest<'_>>(&body) {
            Ok(req) => parse_offloaded(&reading, &req, &offloaded, &request),
            Err(e) => Read::Decided(Err(bad_request(e))),
        };
        match tokio::task::spawn_blocking(parse).await {
            Ok(read) => read,
            Err(e) => Read::Decided(Err(internal(&request_id, "reading", e))),
        }
    };
    let (pool, parsed) = match read {
        Read::Parsed(pool, parsed) => (pool, parsed),
        Read::Decided(Err(r)) => return fallback(&state, r.reason, r.status, r.message),
        Read::Decided(Ok((pool, estimated))) => {
            let (answer, waited) = admitted(&state, &pool, &estimated, &scoring, started).await;
            state.metrics.route_seconds.observe(started.elapsed().saturating_sub(waited).as_secs_f64());
            return answer;
        }
    };
    let tokenize = tracing::info_span!("kvgate.tokenize", body_bytes = offloaded.body_bytes(), threads = 1);
    let outcome = if small && pool.tokenizer_ready() {
        // Tokenized here too once its pool's tokenizer has loaded, never behind a big body.
        let _span = tokenize.enter();
        tokenized(pool, &parsed, &offloaded, deadline, 1)
    } else {
        let slot = tokio::time::timeout_at(deadline.into(), state.offload_slots.clone().acquire_owned()).await;
        let Ok(Ok(slot)) = slot else {
            tracing::debug!(%request_id, "no tokenizer free within the filter's budget");
            return fallback(&state, "late", StatusCode::SERVICE_UNAVAILABLE, "no tokenizer free in time".into());
        };
        // A long prompt may also take slots no other prompt is using, and spread over them.
        let mut slots = vec![slot];
        while slots.len() < state.offload_spread.min(offloaded.body_bytes() / MIN_PART_BYTES) {
            let Ok(spare) = state.offload_slots.clone().try_acquire_owned() else { break };
            slots.push(spare);
        }
        tokenize.record("threads", slots.len());
        state.metrics.offload_spare_threads.inc_by(slots.len() as u64 - 1);
        let job = move || {
            let _span = tokenize.enter();
            tokenized(pool, &parsed, &offloaded, deadline, slots.len())
        };
        match tokio::task::spawn_blocking(job).await {
            Ok(outcome) => outcome,
            Err(e) => Err(internal(&request_id, "tokenizing", e)),
        }
    };
    let (answer, waited) = match outcome {
        Ok((pool, route)) => admitted(&state, &pool, &route, &scoring, started).await,
        Err(r) => (fallback(&state, r.reason, r.status, r.message), Duration::ZERO),
    };
    state.metrics.route_seconds.observe(started.elapsed().saturating_sub(waited).as_secs_f64());
    answer
}

/// What an offloaded body came to: the request to route and its pool, or the fallback to
/// answer with.
type Outcome = Result<(Arc<Pool>, RouteRequest), Refusal>;

/// A fallback answer: its reason (the metric's label), status and message.
struct Refusal {
    reason: &'static str,
    status: StatusCode,
    message: String,
}

/// A blocking thread that failed while `doing` a request's body (a panic): 500.
fn internal(request_id: &impl std::fmt::Display, doing: &str, e: impl std::fmt::Display) -> Refusal {
    tracing::warn!(%request_id, error = %e, "{doing} an offloaded prompt failed");
    Refusal { reason: "internal", status: StatusCode::INTERNAL_SERVER_ERROR, message: e.to_string() }
}

fn bad_request(e: impl std::fmt::Display) -> Refusal {
    Refusal { reason: "bad_request", status: StatusCode::BAD_REQUEST, message: e.to_string() }
}

/// An offloaded body read.
enum Read {
    /// Parsed, with its pool: to tokenize.
    Parsed(Arc<Pool>, ParsedRequest),
    /// Decided already: a prompt that cannot be read, for a model routed here, to be booked
    /// on an estimate (its load is real), or a refusal.
    Decided(Outcome),
}

/// An offloaded body parsed and its pool found (`request`: the span its request is named in).
fn parse_offloaded(
    state: &AppState,
    req: &RouteBodyRequest<'_>,
    offloaded: &Offloaded,
    request: &tracing::Span,
) -> Read {
    let parsed = match parse(req.endpoint, &req.body) {
        Ok(p) => p,
        Err(e) => {
            // Still a request for a model routed here (content parts kvgate does not read, …).
            let model = std::str::from_utf8(&req.body).ok().and(model_of(&req.body));
            if let Some((model, pool)) = model.as_deref().and_then(|m| Some((m, state.pool_for(m)?))) {
                tracing::debug!(request_id = %req.request_id, %model, error = %e, "prompt unreadable; booked on an estimate");
                return Read::Decided(Ok((pool.clone(), pool.estimated(model, offloaded, "unparsable"))));
            }
            tracing::debug!(request_id = %req.request_id, error = %e, "offloaded body unreadable");
            let status = StatusCode::UNPROCESSABLE_ENTITY;
            return Read::Decided(Err(Refusal { reason: "unparsable_body", status, message: e.to_string() }));
        }
    };
    name_request(request, &req.request_id, &parsed.model);
    let Some(pool) = state.pool_for(parsed.model.as_str()) else {
        tracing::debug!(request_id = %req.request_id, model = %parsed.model, "no pool for the request's model");
        let message = format!("no pool for model {:?}", parsed.model);
        return Read::Decided(Err(Refusal { reason: "unknown_model", status: StatusCode::NOT_FOUND, message }));
    };
    Read::Parsed(pool.clone(), parsed)
}

/// A parsed offloaded body tokenized on its pool, on up to `threads` threads (blocking) —
/// unless the filter's `deadline` passes first.
fn tokenized(
    pool: Arc<Pool>,
    parsed: &ParsedRequest,
    offloaded: &Offloaded,
    deadline: Instant,
    threads: usize,
) -> Outcome {
    match pool.request_for_body(parsed, offloaded, deadline, threads) {
        Ok(route) => Ok((pool, route)),
        Err(e @ OffloadError::Late) => {
            tracing::debug!(error = %e, "offloaded prompt not routed in time");
            Err(Refusal { reason: "late", status: StatusCode::SERVICE_UNAVAILABLE, message: e.to_string() })
        }
    }
}

async fn lifecycle(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let batch: LifecycleBatch = match codec::decode(&body) {
        Ok(b) => b,
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    for event in &batch.events {
        let id = &event.request_id;
        // Only the pool of the request's model applies its report.
        let pool = state.pool_for(event.model.as_str());
        let (kind, known) = match &event.kind {
            LifecycleKind::FirstToken { ttft_us } => {
                ("first_token", pool.is_some_and(|p| p.first_token(id, ttft_us.map(Duration::from_micros))))
            }
            LifecycleKind::Decoded { itl_us } => {
                ("decoded", pool.is_some_and(|p| p.decoded(id, Duration::from_micros(*itl_us))))
            }
            LifecycleKind::Done => ("done", pool.is_some_and(|p| p.lifecycle(id, false))),
            LifecycleKind::Progress(n) => ("progress", pool.is_some_and(|p| p.progress(id, *n))),
            LifecycleKind::RanOn(endpoint) => ("ran_on", pool.is_some_and(|p| p.ran_on(id, endpoint))),
            LifecycleKind::ServedWhole => ("served_whole", pool.is_some_and(|p| p.served_whole(id))),
            LifecycleKind::Usage { prompt_tokens, cached_tokens } => {
                let (prompt, cached) = (u64::from(*prompt_tokens), cached_tokens.map(u64::from));
                ("usage", pool.is_some_and(|p| p.engine_usage(id, prompt, cached)))
            }
        };
        if !known {
            tracing::debug!(request_id = %id, model = %event.model, kind, "lifecycle report names no booking of its pool");
        }
        state.metrics.lifecycle_events.get_or_create(&LifecycleLabels { kind, known }).inc();
    }
    StatusCode::NO_CONTENT.into_response()
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let mut models: Vec<String> = state.pools.keys().cloned().collect();
    models.sort();
    let mut adapters: Vec<Adapter> = state
        .pools
        .values()
        .flat_map(|p| p.adapters().into_iter().map(|a| Adapter { name: a, base: p.config().model.clone() }))
        .collect();
    adapters.sort_by(|a, b| a.name.cmp(&b.name));
    adapters.dedup_by(|a, b| a.name == b.name);
    encoded(&ModelList { models, adapters })
}

/// `GET /v1/models/{model}/tokenizer`: `model_path` is everything after `/v1/models/`,
/// percent-decoded.
async fn tokenizer(State(state): State<Arc<AppState>>, Path(model_path): Path<String>) -> Response {
    let Some(model) = model_path.strip_suffix("/tokenizer") else {
        return (StatusCode::NOT_FOUND, format!("no such resource: /v1/models/{model_path}")).into_response();
    };
    match state.pools.get(model) {
        Some(pool) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], pool.served_bundle()).into_response(),
        None => (StatusCode::NOT_FOUND, format!("no pool for model {model:?}")).into_response(),
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], state.metrics.render())
        .into_response()
}

async fn debug_state(State(state): State<Arc<AppState>>) -> Response {
    let mut pools: Vec<_> = state.pools.values().map(|p| p.state()).collect();
    pools.sort_by(|a, b| a.model.cmp(&b.model));
    Json(serde_json::json!({ "pools": pools })).into_response()
}

/// Query of `/debug/explain`.
#[derive(Debug, serde::Deserialize)]
struct ExplainQuery {
    /// One request's decision.
    #[serde(alias = "request_id")]
    request: Option<String>,
    /// How many recent decisions (default 20).
    last: Option<usize>,
}

/// Every candidate's cost terms for recent decisions (each pool keeps its last
/// `explain_keep`, for `explain_max_age_secs`), or for one request's; 404 with a JSON `error`
/// if none of that request is kept.
async fn debug_explain(State(state): State<Arc<AppState>>, Query(q): Query<ExplainQuery>) -> Response {
    let last = q.last.unwrap_or(20);
    let decisions: Vec<_> = state.pools.values().flat_map(|p| p.explain(q.request.as_deref(), last)).collect();
    if let (Some(id), true) = (&q.request, decisions.is_empty()) {
        let error = format!(
            "no decision for request {id:?} is kept: it was never routed here, or is older than its pool's \
             explain_keep decisions or explain_max_age_secs"
        );
        return (StatusCode::NOT_FOUND, Json(serde_json::json!({ "error": error }))).into_response();
    }
    Json(serde_json::json!({ "decisions": decisions })).into_response()
}
