//! Prefill/decode disaggregation in the API: where a request's KV comes from (`Origin`),
//! the answers' disaggregation headers, a vLLM prefill engine's `POST /_kv/pull` and an
//! SGLang prefill server's `POST /_kv/bootstrap`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::kv_transfer::{room_rank, JoinRoom, Protocol, PullRequest, Released};
use crate::scheduler::HoldKey;

use super::{error, tagged, AppState, PROMPT_COMPUTED_HEADER, REMOTE_PREFILL_HEADER};

/// Where a request was served, for what its disaggregation answers say.
#[derive(Debug, Clone, Copy)]
pub(super) struct Origin {
    /// The data-parallel rank.
    pub(super) rank: usize,
    /// Whether it asked for a remote prefill.
    pub(super) remote_prefill: bool,
    /// Its SGLang bootstrap room.
    pub(super) room: Option<u64>,
    /// The prefill engine's cache hits, which its vLLM prefill passed on.
    pub(super) prefill_cached: Option<usize>,
}

impl Origin {
    /// The `cached_tokens` it reports for `cached` found or loaded: a vLLM 0.32 decoder whose
    /// prefill said what it found cached reports that instead (`RequestState`'s
    /// `remote_prefill_cached_tokens` in its output processor).
    pub(super) fn reported_cached(&self, cached: usize) -> usize {
        self.prefill_cached.unwrap_or(cached)
    }
}

/// With disaggregation on, tags a response with whether its request asked for a remote
/// prefill and, when known (not for streams, whose headers leave before the load), the prompt
/// tokens this engine computed for it.
pub(super) fn disaggregation_headers(
    state: &AppState,
    mut response: Response,
    origin: Origin,
    computed: Option<usize>,
) -> Response {
    if state.protocol.is_on() {
        let headers = response.headers_mut();
        headers.insert(
            REMOTE_PREFILL_HEADER,
            HeaderValue::from_static(if origin.remote_prefill { "true" } else { "false" }),
        );
        if let Some(computed) = computed {
            headers.insert(PROMPT_COMPUTED_HEADER, HeaderValue::from(computed));
        }
    }
    response
}

/// The error a decode whose remote prefill could not be loaded gets. vLLM fails it with
/// finish reason `error`, which its server answers with `GenerationError`: 500, "Internal
/// server error" (`serving.py`, `_raise_if_error`). SGLang's decode aborts it with a 500 whose
/// message is the transfer error (`decode.py`, `pop_transferred`), and its OpenAI server
/// answers an `HTTPException` with the status as the error type.
pub(super) fn transfer_failure(state: &AppState, id: &str, origin: Origin, reason: &str) -> (StatusCode, Value) {
    let status = StatusCode::INTERNAL_SERVER_ERROR;
    let (message, kind) = match (&state.protocol, origin.room) {
        (Protocol::Bootstrap(_), Some(room)) => (
            format!(
                "Decode transfer failed for request rank={} decode_req.req.rid='{id}' decode_req.req.bootstrap_room={room} with exception KVTransferError(bootstrap_room={room}): {reason}",
                origin.rank
            ),
            "500",
        ),
        _ => ("Internal server error".to_owned(), "InternalServerError"),
    };
    (status, json!({"object": "error", "message": message, "type": kind, "param": null, "code": status.as_u16()}))
}

/// An SGLang prefill request waits for its room's decoder to join before it is computed
/// (`PrefillBootstrapQueue`); one that waits in vain is refused as SGLang's prefill refuses
/// it (`Prefill bootstrap failed …`, 500).
pub(super) async fn wait_for_decoder(state: &AppState, rank: usize, id: &str, room: u64) -> Option<Response> {
    let Protocol::Bootstrap(bootstrap) = &state.protocol else { return None };
    if bootstrap.arrivals.wait(room, bootstrap.timeout).await {
        return None;
    }
    if let Some(r) = state.engine.ranks().get(rank) {
        r.stats.bootstrap_failures.fetch_add(1, Ordering::Relaxed);
    }
    let message = format!(
        "Prefill bootstrap failed for request rank={rank} req.rid='{id}' req.bootstrap_room={room} with exception KVTransferError(bootstrap_room={room}): Request {room} timed out after {:.1}s in KVPoll.Bootstrapping",
        bootstrap.timeout.as_secs_f64()
    );
    Some(error(state, StatusCode::INTERNAL_SERVER_ERROR, "500", message))
}

/// `POST /_kv/pull` (vLLM protocol, sim-private): a decoder reads a prefill request's held
/// blocks, which frees them, as the NIXL read and its notification do. 404 if they are not
/// held (expired, already read, unknown).
pub(super) async fn kv_pull(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let Protocol::Nixl(nixl) = &state.protocol else {
        return error(&state, StatusCode::NOT_FOUND, "NotFoundError", "no KV connector".into());
    };
    let pull: PullRequest = match serde_json::from_slice(&body) {
        Ok(pull) => pull,
        Err(e) => return error(&state, StatusCode::BAD_REQUEST, "BadRequestError", e.to_string()),
    };
    let Some(rank) = nixl.rank_of(&pull.remote_engine_id) else {
        let message = format!("engine {:?} is not here", pull.remote_engine_id);
        return error(&state, StatusCode::NOT_FOUND, "NotFoundError", message);
    };
    match state.engine.release(rank, HoldKey::Request(pull.remote_request_id.clone())).await {
        Some(blocks) => {
            let released = Released { block_ids: blocks.into_iter().map(|b| b as u64).collect() };
            tagged(&state, Json(released).into_response())
        }
        None => {
            let message =
                format!("request {:?} holds no blocks here (expired, read, or unknown)", pull.remote_request_id);
            error(&state, StatusCode::NOT_FOUND, "NotFoundError", message)
        }
    }
}

/// `POST /_kv/bootstrap` (SGLang protocol, sim-private, on the bootstrap listener): a decoder
/// joins a room — which lets the room's prefill request be computed — and waits until the
/// prefill holds the room's blocks, which it takes (they are freed). 408 after the bootstrap
/// timeout.
pub(super) async fn join_room(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let Protocol::Bootstrap(bootstrap) = &state.protocol else {
        return error(&state, StatusCode::NOT_FOUND, "NotFoundError", "not a prefill server".into());
    };
    let room = match serde_json::from_slice::<JoinRoom>(&body) {
        Ok(join) => join.bootstrap_room,
        Err(e) => return error(&state, StatusCode::BAD_REQUEST, "BadRequestError", e.to_string()),
    };
    bootstrap.arrivals.arrive(room, bootstrap.timeout);
    let rank = room_rank(room, state.engine.ranks().len());
    let deadline = tokio::time::Instant::now() + bootstrap.timeout;
    loop {
        let changed = state.engine.holds_changed().notified();
        tokio::pin!(changed);
        changed.as_mut().enable();
        if let Some(blocks) = state.engine.release(rank, HoldKey::Room(room)).await {
            let released = Released { block_ids: blocks.into_iter().map(|b| b as u64).collect() };
            return tagged(&state, Json(released).into_response());
        }
        if tokio::time::timeout_at(deadline, changed).await.is_err() {
            bootstrap.arrivals.forget(room);
            let message = format!(
                "Request {room} timed out after {:.1}s in KVPoll.WaitingForInput",
                bootstrap.timeout.as_secs_f64()
            );
            return error(&state, StatusCode::REQUEST_TIMEOUT, "RequestTimeout", message);
        }
    }
}
