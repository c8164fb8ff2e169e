//! vLLM's OpenAI-compatible API, as far as kvgate needs it: completions and chat completions
//! (streaming or not, with `usage`), `/v1/models`, `/health`, `/metrics`, `/reset_prefix_cache`.
//!
//! Every response carries `x-kvgate-replica: <id>` so tests can see who served it.

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvgate_shared::prompt::openai::{parse, Endpoint, ParsedRequest};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::prompt::PromptError;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use xxhash_rust::xxh3::xxh3_64;

use crate::engine::Engine;
use crate::kv_events::Chaos;

/// The header naming the replica that served a response.
pub const REPLICA_HEADER: &str = "x-kvgate-replica";
/// vLLM's default `max_tokens` for completions (used for chat too).
const DEFAULT_MAX_TOKENS: u32 = 16;

/// What the handlers share.
pub struct AppState {
    /// The engine.
    pub engine: Arc<Engine>,
    /// The served model's tokenizer and template.
    pub tokenizer: ModelTokenizer,
    /// The served model's name.
    pub model: String,
    /// This replica's id.
    pub replica: String,
    /// Seed of the output-token generator.
    pub seed: u64,
    /// Whether `usage.prompt_tokens_details.cached_tokens` is reported.
    pub prompt_tokens_details: bool,
}

/// The routes.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/_chaos/events", post(chaos_events))
        .route("/_chaos/restart_publisher", post(restart_publisher))
        .with_state(state)
}

fn tagged(state: &AppState, mut response: Response) -> Response {
    if let Ok(v) = HeaderValue::from_str(&state.replica) {
        response.headers_mut().insert(REPLICA_HEADER, v);
    }
    response
}

/// vLLM's error body.
fn error(state: &AppState, status: StatusCode, kind: &str, message: String) -> Response {
    let body = json!({"object": "error", "message": message, "type": kind, "param": null, "code": status.as_u16()});
    tagged(state, (status, Json(body)).into_response())
}

async fn completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    serve(state, Endpoint::Completions, body).await
}

async fn chat_completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    serve(state, Endpoint::ChatCompletions, body).await
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

async fn serve(state: Arc<AppState>, endpoint: Endpoint, body: Bytes) -> Response {
    let request = match parse(endpoint, &body) {
        Ok(r) => r,
        Err(e) => return error(&state, StatusCode::BAD_REQUEST, "BadRequestError", e.to_string()),
    };
    if request.model != state.model {
        let msg = format!("The model `{}` does not exist.", request.model);
        return error(&state, StatusCode::NOT_FOUND, "NotFoundError", msg);
    }
    let tokens = match state.tokenizer.prompt_tokens(&request) {
        Ok(t) => t,
        Err(e @ (PromptError::Invalid(_) | PromptError::Template(_) | PromptError::NoTemplate)) => {
            return error(&state, StatusCode::BAD_REQUEST, "BadRequestError", e.to_string())
        }
        Err(e) => return error(&state, StatusCode::INTERNAL_SERVER_ERROR, "InternalServerError", e.to_string()),
    };
    let mut running = match state.engine.prefill(&tokens).await {
        Ok(r) => r,
        Err(_) => {
            let msg = "not enough free KV cache blocks".to_owned();
            return error(&state, StatusCode::SERVICE_UNAVAILABLE, "ServiceUnavailableError", msg);
        }
    };
    let max_tokens = request.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    let mut rng = rand::rngs::StdRng::seed_from_u64(state.seed ^ xxh3_64(&body));
    let output: Vec<u32> = (0..max_tokens).map(|_| rng.random_range(1000..9000)).collect();
    let usage = Usage {
        prompt: tokens.len(),
        completion: output.len(),
        cached: running.cached_tokens,
        details: state.prompt_tokens_details,
    };
    let id =
        format!("{}-{:016x}", if endpoint == Endpoint::Completions { "cmpl" } else { "chatcmpl" }, rng.random::<u64>());
    if request.stream {
        let include_usage = request.include_usage;
        stream(state, endpoint, request, id, output, usage, include_usage, running)
    } else {
        for token in &output {
            running.decode(*token).await;
        }
        drop(running);
        let text = state.tokenizer.decode(&output).unwrap_or_default();
        let choice = match endpoint {
            Endpoint::Completions => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length", "stop_reason": null})
            }
            Endpoint::ChatCompletions => {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": "length", "stop_reason": null})
            }
        };
        let object = if endpoint == Endpoint::Completions { "text_completion" } else { "chat.completion" };
        let body = json!({"id": id, "object": object, "created": unix_now(), "model": request.model,
            "choices": [choice], "usage": usage.json()});
        tagged(&state, Json(body).into_response())
    }
}

/// `usage`, vLLM style.
struct Usage {
    prompt: usize,
    completion: usize,
    cached: usize,
    details: bool,
}

impl Usage {
    fn json(&self) -> Value {
        let mut u = json!({"prompt_tokens": self.prompt, "completion_tokens": self.completion, "total_tokens": self.prompt + self.completion});
        if self.details {
            u["prompt_tokens_details"] = json!({"cached_tokens": self.cached});
        }
        u
    }
}

#[allow(clippy::too_many_arguments)]
fn stream(
    state: Arc<AppState>,
    endpoint: Endpoint,
    request: ParsedRequest,
    id: String,
    output: Vec<u32>,
    usage: Usage,
    include_usage: bool,
    running: crate::engine::Running,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    let worker = state.clone();
    tokio::spawn(async move {
        let mut running = running; // blocks are freed when this task ends, even on disconnect
        let created = unix_now();
        let object = if endpoint == Endpoint::Completions { "text_completion" } else { "chat.completion.chunk" };
        let chunk = |choices: Value| -> Bytes {
            let body =
                json!({"id": id, "object": object, "created": created, "model": request.model, "choices": choices});
            Bytes::from(format!("data: {body}\n\n"))
        };
        let piece = |delta: &str, finish: Value| match endpoint {
            Endpoint::Completions => {
                json!([{"index": 0, "text": delta, "logprobs": null, "finish_reason": finish, "stop_reason": null}])
            }
            Endpoint::ChatCompletions => {
                json!([{"index": 0, "delta": {"content": delta}, "logprobs": null, "finish_reason": finish}])
            }
        };
        if endpoint == Endpoint::ChatCompletions {
            let first = json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]);
            if tx.send(chunk(first)).await.is_err() {
                return;
            }
        }
        for (i, token) in output.iter().enumerate() {
            if i > 0 {
                running.decode(*token).await;
            }
            let text = worker.tokenizer.decode(&[*token]).unwrap_or_default();
            let finish = if i + 1 == output.len() { json!("length") } else { Value::Null };
            if tx.send(chunk(piece(&text, finish))).await.is_err() {
                return;
            }
        }
        if include_usage {
            let mut body =
                json!({"id": id, "object": object, "created": created, "model": request.model, "choices": []});
            body["usage"] = usage.json();
            if tx.send(Bytes::from(format!("data: {body}\n\n"))).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
    });
    let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    }));
    let mut response = Response::new(body);
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    tagged(&state, response)
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let body = json!({"object": "list", "data": [{"id": state.model, "object": "model", "owned_by": "kvgate-sim"}]});
    tagged(&state, Json(body).into_response())
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let s = &state.engine.stats;
    let m = &state.model;
    let text = format!(
        "vllm:num_requests_running{{model_name=\"{m}\"}} {}\nvllm:num_requests_waiting{{model_name=\"{m}\"}} {}\nvllm:kv_cache_usage_perc{{model_name=\"{m}\"}} {}\nvllm:prefix_cache_queries_total{{model_name=\"{m}\"}} {}\nvllm:prefix_cache_hits_total{{model_name=\"{m}\"}} {}\n",
        s.running.load(Ordering::Relaxed),
        s.waiting.load(Ordering::Relaxed),
        state.engine.cache_usage(),
        s.prefix_queries.load(Ordering::Relaxed),
        s.prefix_hits.load(Ordering::Relaxed),
    );
    tagged(&state, ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

async fn reset_prefix_cache(State(state): State<Arc<AppState>>) -> Response {
    if state.engine.reset_prefix_cache() {
        tagged(&state, StatusCode::OK.into_response())
    } else {
        error(&state, StatusCode::CONFLICT, "ConflictError", "requests are running".into())
    }
}

/// Fault injection for reliability tests: `{"drop_fraction": 0.05, "stall": false, "delay_ms": 0}`.
async fn chaos_events(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    match serde_json::from_slice::<Chaos>(&body) {
        Ok(chaos) => {
            state.engine.publisher().set_chaos(chaos);
            tagged(&state, Json(chaos).into_response())
        }
        Err(e) => error(&state, StatusCode::BAD_REQUEST, "BadRequestError", e.to_string()),
    }
}

/// Restarts the event publisher: seq back to 0, replay buffer emptied.
async fn restart_publisher(State(state): State<Arc<AppState>>) -> Response {
    state.engine.publisher().restart();
    tagged(&state, StatusCode::OK.into_response())
}
