//! The engine's other endpoints: `/tokenize`, `/v1/models`, LoRA adapters, `/metrics`,
//! `/reset_prefix_cache`, and the simulator's own fault hooks.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvgate_shared::prompt::openai::Endpoint;
use serde_json::{json, Value};

use crate::kv_events::Chaos;

use super::{admit, error, tagged, unix_now, Admitted, AppState};

/// vLLM's `/tokenize`: `{"prompt": …}` tokenizes like completions (special tokens added),
/// `{"messages": …}` like chat (template rendered, generation prompt added by default).
pub(super) async fn tokenize(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let is_chat = serde_json::from_slice::<Value>(&body).ok().is_some_and(|v| v.get("messages").is_some());
    let endpoint = if is_chat { Endpoint::ChatCompletions } else { Endpoint::Completions };
    match admit(&state, endpoint, &body) {
        Ok(Admitted { mut prompts, .. }) => {
            let tokens = prompts.swap_remove(0);
            let body = json!({"count": tokens.len(), "max_model_len": state.max_model_len, "tokens": tokens, "token_strs": null});
            tagged(&state, Json(body).into_response())
        }
        Err(refusal) => refusal.into_response(&state),
    }
}

/// vLLM's model list: the base model, then each adapter with `parent` = the base model.
pub(super) async fn models(State(state): State<Arc<AppState>>) -> Response {
    let created = unix_now();
    let base = json!({"id": state.model, "object": "model", "created": created, "owned_by": "vllm",
        "root": state.model, "parent": null, "max_model_len": state.max_model_len});
    let adapters = state.adapters.list().into_iter().map(|a| {
        json!({"id": a.name, "object": "model", "created": created, "owned_by": "vllm", "root": a.path,
            "parent": state.model, "max_model_len": null})
    });
    let body = json!({"object": "list", "data": std::iter::once(base).chain(adapters).collect::<Vec<_>>()});
    tagged(&state, Json(body).into_response())
}

/// `POST /v1/load_lora_adapter` body.
#[derive(serde::Deserialize)]
pub(super) struct LoadLora {
    lora_name: String,
    lora_path: String,
}

/// `POST /v1/unload_lora_adapter` body.
#[derive(serde::Deserialize)]
pub(super) struct UnloadLora {
    lora_name: String,
}

/// The refusal of a run-time adapter change, unless they are allowed.
pub(super) fn lora_updates_refused(state: &AppState) -> Option<Response> {
    let message = "runtime LoRA updates are off (set VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)".to_owned();
    (!state.runtime_lora_updating).then(|| error(state, StatusCode::NOT_FOUND, "NotFoundError", message))
}

pub(super) async fn load_lora_adapter(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    if let Some(refused) = lora_updates_refused(&state) {
        return refused;
    }
    let req: LoadLora = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(&state, StatusCode::BAD_REQUEST, "BadRequestError", e.to_string()),
    };
    if req.lora_name.is_empty() || req.lora_name == state.model {
        let message = format!("invalid adapter name {:?}", req.lora_name);
        return error(&state, StatusCode::BAD_REQUEST, "BadRequestError", message);
    }
    match state.adapters.load(&req.lora_name, &req.lora_path) {
        Ok(_) => {
            let text = format!("Success: LoRA adapter '{}' added successfully.", req.lora_name);
            tagged(&state, text.into_response())
        }
        Err(e) => error(&state, StatusCode::BAD_REQUEST, "BadRequestError", e.to_string()),
    }
}

pub(super) async fn unload_lora_adapter(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    if let Some(refused) = lora_updates_refused(&state) {
        return refused;
    }
    let req: UnloadLora = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(&state, StatusCode::BAD_REQUEST, "BadRequestError", e.to_string()),
    };
    match state.adapters.unload(&req.lora_name) {
        Ok(()) => {
            let text = format!("Success: LoRA adapter '{}' removed successfully.", req.lora_name);
            tagged(&state, text.into_response())
        }
        Err(e) => error(&state, StatusCode::NOT_FOUND, "NotFoundError", e.to_string()),
    }
}

pub(super) async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let mut text = crate::metrics::render(&state.model, state.engine.ranks(), state.engine.config(), &state.protocol);
    let tokenized = state.prompts_tokenized.load(Ordering::Relaxed);
    text.push_str(&format!(
        "# TYPE kvgate_sim:prompts_tokenized_total counter\nkvgate_sim:prompts_tokenized_total{{model_name=\"{}\"}} {tokenized}\n",
        state.model
    ));
    text.push_str("# TYPE kvgate_sim:cached_blocks gauge\n");
    for (i, rank) in state.engine.ranks().iter().enumerate() {
        let blocks = rank.stats.cached_blocks.load(Ordering::Relaxed);
        text.push_str(&format!("kvgate_sim:cached_blocks{{model_name=\"{}\",engine=\"{i}\"}} {blocks}\n", state.model));
    }
    tagged(&state, ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

pub(super) async fn reset_prefix_cache(State(state): State<Arc<AppState>>) -> Response {
    if state.engine.reset_prefix_cache().await {
        tagged(&state, StatusCode::OK.into_response())
    } else {
        error(&state, StatusCode::CONFLICT, "ConflictError", "requests are running".into())
    }
}

/// Fault injection for reliability tests: `{"drop_fraction": 0.05, "stall": false, "delay_ms": 0}`.
pub(super) async fn chaos_events(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match serde_json::from_slice::<Chaos>(&body) {
        Ok(chaos) => {
            for rank in state.engine.ranks() {
                rank.publisher().set_chaos(chaos);
            }
            tagged(&state, Json(chaos).into_response())
        }
        Err(e) => error(&state, StatusCode::BAD_REQUEST, "BadRequestError", e.to_string()),
    }
}

/// `{"factor": f}`: every step runs `f` times slower than modelled from now on (1 undoes it),
/// without a word to the router: its events and metrics say nothing of it.
pub(super) async fn chaos_slowdown(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    #[derive(serde::Deserialize)]
    struct Slowdown {
        factor: f64,
    }
    match serde_json::from_slice::<Slowdown>(&body) {
        Ok(s) if state.engine.set_slowdown(s.factor) => tagged(&state, StatusCode::OK.into_response()),
        Ok(s) => {
            error(&state, StatusCode::BAD_REQUEST, "BadRequestError", format!("factor {} is not positive", s.factor))
        }
        Err(e) => error(&state, StatusCode::BAD_REQUEST, "BadRequestError", e.to_string()),
    }
}

/// Restarts the event publisher: seq back to 0, replay buffer emptied.
pub(super) async fn restart_publisher(State(state): State<Arc<AppState>>) -> Response {
    for rank in state.engine.ranks() {
        rank.publisher().restart();
    }
    tagged(&state, StatusCode::OK.into_response())
}
