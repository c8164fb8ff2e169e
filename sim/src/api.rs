//! vLLM's OpenAI-compatible API, as far as kvgate needs it: completions, chat completions and
//! Responses (streaming or not, with `usage`; Responses keep no history), `/v1/models`, `/health`, `/tokenize`, `/metrics`,
//! `/reset_prefix_cache`, and LoRA adapters: a request's `model` may name one, and with
//! `VLLM_ALLOW_RUNTIME_LORA_UPDATING` adapters come and go through `/v1/load_lora_adapter` and
//! `/v1/unload_lora_adapter`.
//!
//! Every response carries `x-kvgate-replica: <id>` so tests can see who served it. A request
//! is one engine request per prompt of a completion's list, `n` each ([`crate::fanout`]); each
//! goes to the data-parallel rank named by `X-data-parallel-rank`, else to the next in turn, as
//! vLLM's load balancer places each. Output tokens are seeded by `--seed` and the request
//! body, and there are always exactly `max_tokens` of them per sequence (the simulator never
//! samples EOS, as with `ignore_eos`).
//!
//! With prefill/decode disaggregation on ([`crate::kv_transfer`]), completions and chat read
//! vLLM's `kv_transfer_params` or SGLang's `bootstrap_*` fields, answers say whether a remote
//! prefill was asked for (`x-kvgate-sim-remote-prefill`) and, unstreamed, the prompt tokens
//! computed here (`x-kvgate-sim-prompt-computed`); a vLLM prefill engine serves its held
//! blocks at `POST /_kv/pull`, an SGLang prefill server its rooms at `POST /_kv/bootstrap` on
//! its bootstrap listener.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvgate_shared::prompt::openai::{parse, Endpoint, ParsedRequest, Prompt};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::prompt::PromptError;
use rand::{Rng, SeedableRng};
use serde_json::{json, Map, Value};
use xxhash_rust::xxh3::xxh3_64;

use crate::engine::{Ending, Engine, Produced, Sequence, SubmitError, Submitted, Transfer};
use crate::extra_keys::ExtraKeys;
use crate::fanout::{self, Fanout, Gathered, Usage};
use crate::kv_events::Chaos;
use crate::kv_transfer::{room_rank, JoinRoom, Plan, Protocol, PullRequest, Released, Source};
use crate::lora::Registry;
use crate::scheduler::HoldKey;

/// The header naming the replica that served a response.
pub const REPLICA_HEADER: &str = "x-kvgate-replica";
/// vLLM's default `max_tokens` for completions (used for chat too).
const DEFAULT_MAX_TOKENS: u32 = 16;
/// The header that picks a data-parallel rank (vLLM's).
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";
/// With disaggregation on: whether the request asked for a remote prefill (`true`/`false`).
pub const REMOTE_PREFILL_HEADER: &str = "x-kvgate-sim-remote-prefill";
/// With disaggregation on, on answers that are not streamed: the prompt tokens this engine
/// computed for the request.
pub const PROMPT_COMPUTED_HEADER: &str = "x-kvgate-sim-prompt-computed";

/// What the handlers share.
pub struct AppState {
    /// The engine.
    pub engine: Arc<Engine>,
    /// The served model's tokenizer and template.
    pub tokenizer: ModelTokenizer,
    /// The served model's name.
    pub model: String,
    /// The LoRA adapters served on top of it.
    pub adapters: Registry,
    /// Whether adapters may be loaded and unloaded at run time.
    pub runtime_lora_updating: bool,
    /// This replica's id.
    pub replica: String,
    /// Seed of the output-token generator.
    pub seed: u64,
    /// Whether `usage.prompt_tokens_details.cached_tokens` is reported.
    pub prompt_tokens_details: bool,
    /// The longest sequence the cache can hold (reported by `/tokenize`).
    pub max_model_len: usize,
    /// Prompts this server tokenized itself (text and chat prompts; token-id prompts are not
    /// tokenized): `kvgate_sim:prompts_tokenized_total`, which shows token forwarding work.
    pub prompts_tokenized: AtomicU64,
    /// The prefill/decode disaggregation protocol spoken, if any.
    pub protocol: Protocol,
}

/// The routes.
pub fn router(state: Arc<AppState>) -> Router {
    let routes = Router::new();
    // A vLLM prefill engine's side channel: its decoders read held blocks here.
    let routes =
        if matches!(state.protocol, Protocol::Nixl(_)) { routes.route("/_kv/pull", post(kv_pull)) } else { routes };
    routes
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(responses))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/tokenize", post(tokenize))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/v1/load_lora_adapter", post(load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(unload_lora_adapter))
        .route("/_chaos/events", post(chaos_events))
        .route("/_chaos/restart_publisher", post(restart_publisher))
        // vLLM (uvicorn) puts no limit on request bodies; neither does the simulator.
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(state)
}

/// An SGLang prefill server's bootstrap listener (`--disaggregation-bootstrap-port`): its
/// decoders join rooms here.
pub fn bootstrap_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/_kv/bootstrap", post(join_room))
        .route("/health", get(|| async { StatusCode::OK }))
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

async fn completions(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    serve(state, Endpoint::Completions, &headers, body).await
}

async fn chat_completions(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    serve(state, Endpoint::ChatCompletions, &headers, body).await
}

async fn responses(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    serve(state, Endpoint::Responses, &headers, body).await
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A refusal, before it becomes a response.
struct Refusal {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl Refusal {
    fn bad_request(message: String) -> Refusal {
        Refusal { status: StatusCode::BAD_REQUEST, kind: "BadRequestError", message }
    }

    fn into_response(self, state: &AppState) -> Response {
        error(state, self.status, self.kind, self.message)
    }
}

/// A request, checked and tokenized.
struct Admitted {
    request: ParsedRequest,
    /// Each prompt's tokens: one, or a completion's list.
    prompts: Vec<Vec<u32>>,
    /// Sequences decoded per prompt (`n`).
    n: usize,
    /// The adapter its `model` names (if not the base model) and its `cache_salt`.
    keys: ExtraKeys,
}

/// Parses, checks the model (the base model or a loaded adapter) and `n`, and tokenizes every
/// prompt of a request the way vLLM's server does. Adapters share the base model's tokenizer.
fn admit(state: &AppState, endpoint: Endpoint, body: &[u8]) -> Result<Admitted, Refusal> {
    let request = parse(endpoint, body).map_err(|e| Refusal::bad_request(e.to_string()))?;
    let fields: Map<String, Value> = serde_json::from_slice(body).map_err(|e| Refusal::bad_request(e.to_string()))?;
    let n = fanout::samples(endpoint, &fields).map_err(Refusal::bad_request)?;
    let lora = if request.model == state.model {
        None
    } else {
        match state.adapters.get(&request.model) {
            Some(lora) => Some(lora),
            None => {
                let message = format!("The model `{}` does not exist.", request.model);
                return Err(Refusal { status: StatusCode::NOT_FOUND, kind: "NotFoundError", message });
            }
        }
    };
    let prompts = match fanout::prompts(&request, &fields).map_err(Refusal::bad_request)? {
        None => vec![prompt_tokens(state, &request)?],
        Some(list) => list
            .into_iter()
            .map(|prompt| prompt_tokens(state, &ParsedRequest { prompt, ..request.clone() }))
            .collect::<Result<_, _>>()?,
    };
    let keys = ExtraKeys { lora, cache_salt: request.cache_salt.as_deref().map(Arc::from) };
    Ok(Admitted { request, prompts, n, keys })
}

/// The tokens of `request`'s prompt.
fn prompt_tokens(state: &AppState, request: &ParsedRequest) -> Result<Vec<u32>, Refusal> {
    if !matches!(request.prompt, Prompt::Tokens(_)) {
        state.prompts_tokenized.fetch_add(1, Ordering::Relaxed);
    }
    match state.tokenizer.prompt_tokens(request) {
        Ok(t) if t.is_empty() => Err(Refusal::bad_request("the prompt is empty".into())),
        Ok(tokens) => Ok(tokens),
        Err(
            e @ (PromptError::Invalid(_)
            | PromptError::Template(_)
            | PromptError::NoTemplate
            | PromptError::Unsupported(_)),
        ) => Err(Refusal::bad_request(e.to_string())),
        Err(e) => Err(Refusal {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "InternalServerError",
            message: e.to_string(),
        }),
    }
}

async fn serve(state: Arc<AppState>, endpoint: Endpoint, headers: &HeaderMap, body: Bytes) -> Response {
    let Admitted { request, prompts, n, keys } = match admit(&state, endpoint, &body) {
        Ok(r) => r,
        Err(refusal) => return refusal.into_response(&state),
    };
    // Disaggregation covers completions and chat; a Responses request is always served here.
    let plan = if endpoint == Endpoint::Responses { Ok(Plan::Local) } else { state.protocol.plan(&body) };
    let plan = match plan {
        Ok(plan) => plan,
        Err(message) => return error(&state, StatusCode::BAD_REQUEST, "BadRequestError", message),
    };
    let fanout = Fanout::new(prompts.iter().map(Vec::len).collect(), n);
    if !matches!(plan, Plan::Local) && fanout.sequences() > 1 {
        let message = "kvgate-sim moves the KV of one sequence per request: prefill/decode disaggregation takes \
                       one prompt and n = 1"
            .to_owned();
        return error(&state, StatusCode::BAD_REQUEST, "BadRequestError", message);
    }
    let requested = match headers.get(DP_RANK_HEADER).map(|v| v.to_str().ok().and_then(|v| v.trim().parse().ok())) {
        None => None,
        Some(Some(rank)) => Some(rank),
        Some(None) => {
            let msg = format!("{DP_RANK_HEADER} must be a rank number");
            return error(&state, StatusCode::BAD_REQUEST, "BadRequestError", msg);
        }
    };
    // An SGLang prefill server keeps a room on the rank its decoder will ask.
    let requested = match plan {
        Plan::BootstrapPrefill(room) => Some(room_rank(room, state.engine.ranks().len())),
        _ => requested,
    };
    let Some((rank_index, rank)) = state.engine.pick(requested) else {
        let msg = format!("data-parallel rank {requested:?} out of range (size {})", state.engine.ranks().len());
        return error(&state, StatusCode::BAD_REQUEST, "BadRequestError", msg);
    };
    // A prefill for a remote decoder samples one token: SGLang's prefill sets
    // `max_new_tokens = 1`; vLLM's proxies ask for `max_tokens: 1`.
    let max_tokens = match plan {
        Plan::RemoteDecode | Plan::BootstrapPrefill(_) => 1,
        _ => request.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS).max(1),
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(state.seed ^ xxh3_64(&body));
    // Each sequence samples its own tokens, as vLLM's children do.
    let outputs: Vec<Vec<u32>> =
        (0..fanout.sequences()).map(|_| (0..max_tokens).map(|_| rng.random_range(1000..9000)).collect()).collect();
    let kind = match endpoint {
        Endpoint::Completions => "cmpl-",
        Endpoint::ChatCompletions => "chatcmpl-",
        Endpoint::Responses => "resp_",
    };
    let id = format!("{kind}{:016x}", rng.random::<u64>());
    // A vLLM 0.32 decoder reports the prefill engine's cache hits, which the prefill passed on.
    let prefill_cached = match &plan {
        Plan::RemotePrefill(Source::Nixl(source)) => source.prefill_cached_tokens,
        _ => None,
    };
    let remote_prefill = matches!(plan, Plan::RemotePrefill(_));
    let origin = Origin { rank: rank_index, remote_prefill, room: plan.room(), prefill_cached };
    let transfer = match plan {
        Plan::Local => Transfer::None,
        Plan::RemoteDecode => Transfer::Hold(HoldKey::Request(id.clone())),
        Plan::BootstrapPrefill(room) => {
            if let Some(refused) = wait_for_decoder(&state, rank_index, &id, room).await {
                return refused;
            }
            Transfer::Hold(HoldKey::Room(room))
        }
        Plan::RemotePrefill(source) => Transfer::Load(source),
    };
    // Sequence s is child s % n of prompt s / n; each is placed as vLLM's load balancer places
    // each child request: on the requested rank, else the next in turn.
    let mut transfer = Some(transfer);
    let mut sequences = Vec::with_capacity(fanout.sequences());
    for (seq, output) in outputs.into_iter().enumerate() {
        let rank = if seq == 0 { rank } else { state.engine.pick(requested).map_or(rank, |(_, r)| r) };
        let prompt = prompts[fanout.prompt_of(seq)].clone();
        let transfer = transfer.take().unwrap_or(Transfer::None);
        sequences.push((rank, Sequence { prompt, output, keys: keys.clone(), transfer }));
    }
    let submitted = match state.engine.submit(sequences) {
        Ok(submitted) => submitted,
        Err(e @ SubmitError::TooLong { .. }) => {
            return error(&state, StatusCode::BAD_REQUEST, "BadRequestError", e.to_string())
        }
        Err(e @ SubmitError::Stopped) => {
            return error(&state, StatusCode::SERVICE_UNAVAILABLE, "ServiceUnavailableError", e.to_string())
        }
    };
    match (endpoint, request.stream) {
        (Endpoint::Responses, true) => {
            let prompt_len = fanout.prompt_tokens();
            let response = stream_response(state.clone(), request, id, prompt_len, max_tokens, submitted.tokens);
            return disaggregation_headers(&state, response, origin, None);
        }
        (_, true) => {
            let response = stream(state.clone(), endpoint, request, id, fanout, submitted, origin);
            return disaggregation_headers(&state, response, origin, None);
        }
        _ => {}
    }
    let Submitted { tokens: mut tokens_rx, ending } = submitted;
    let mut gathered = Gathered::new(fanout);
    while !gathered.done() {
        let Some(produced) = tokens_rx.recv().await else { break };
        gathered.push(&produced);
    }
    // Sent before the last token, or dropped: this does not wait.
    let ending = ending.await.ok();
    if let Some(Ending::TransferFailed(reason)) = &ending {
        let (status, body) = transfer_failure(&state, &id, origin, reason);
        let response = tagged(&state, (status, Json(body)).into_response());
        return disaggregation_headers(&state, response, origin, None);
    }
    // `cached_tokens` is vLLM's `request.num_cached_tokens`: the tokens counted as computed when
    // the request is first scheduled (`Scheduler.schedule`), which after a remote load are the
    // local hits plus the loaded tokens, less the last one it recomputes
    // (`_update_waiting_for_remote_kv`). With several sequences, it is one sequence's (see
    // `fanout`).
    let mut usage = gathered.usage(false, state.prompt_tokens_details);
    // What this engine ran through the model of the prompt: all but what it found or loaded
    // (vLLM's `local_compute`, per request; disaggregated requests are one sequence).
    let computed = Some(usage.prompt - usage.cached);
    usage.cached = origin.reported_cached(usage.cached);
    let text = |seq: usize| state.tokenizer.decode(gathered.tokens(seq)).unwrap_or_default();
    if endpoint == Endpoint::Responses {
        let body = response_object(&id, &request.model, max_tokens, Some(&text(0)), Some(&usage));
        return disaggregation_headers(&state, tagged(&state, Json(body).into_response()), origin, computed);
    }
    let choices: Vec<Value> = (0..gathered.fanout().sequences())
        .map(|seq| match endpoint {
            Endpoint::Completions => {
                json!({"index": seq, "text": text(seq), "logprobs": null, "finish_reason": "length", "stop_reason": null})
            }
            _ => {
                json!({"index": seq, "message": {"role": "assistant", "content": text(seq)}, "logprobs": null, "finish_reason": "length", "stop_reason": null})
            }
        })
        .collect();
    let object = if endpoint == Endpoint::Completions { "text_completion" } else { "chat.completion" };
    let mut body = json!({"id": id, "object": object, "created": unix_now(), "model": request.model,
        "choices": choices, "usage": usage.json()});
    if let (Some(Ending::Held(block_ids)), Protocol::Nixl(nixl)) = (&ending, &state.protocol) {
        body["kv_transfer_params"] = nixl.prefill_params(rank_index, &id, block_ids, usage.cached);
    }
    disaggregation_headers(&state, tagged(&state, Json(body).into_response()), origin, computed)
}

/// Where a request was served, for what its disaggregation answers say.
#[derive(Debug, Clone, Copy)]
struct Origin {
    /// The data-parallel rank.
    rank: usize,
    /// Whether it asked for a remote prefill.
    remote_prefill: bool,
    /// Its SGLang bootstrap room.
    room: Option<u64>,
    /// The prefill engine's cache hits, which its vLLM prefill passed on.
    prefill_cached: Option<usize>,
}

impl Origin {
    /// The `cached_tokens` it reports for `cached` found or loaded: a vLLM 0.32 decoder whose
    /// prefill said what it found cached reports that instead (`RequestState`'s
    /// `remote_prefill_cached_tokens` in its output processor).
    fn reported_cached(&self, cached: usize) -> usize {
        self.prefill_cached.unwrap_or(cached)
    }
}

/// With disaggregation on, tags a response with whether its request asked for a remote
/// prefill and, when known (not for streams, whose headers leave before the load), the prompt
/// tokens this engine computed for it.
fn disaggregation_headers(
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
fn transfer_failure(state: &AppState, id: &str, origin: Origin, reason: &str) -> (StatusCode, Value) {
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
async fn wait_for_decoder(state: &AppState, rank: usize, id: &str, room: u64) -> Option<Response> {
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

/// A Responses API `response` object as vLLM writes it: `text` is the finished output (none
/// while in progress), `usage` is set once it is done. Output always stops at the limit, so a
/// finished response is `incomplete` for `max_output_tokens`, as vLLM reports it.
fn response_object(id: &str, model: &str, max_tokens: u32, text: Option<&str>, usage: Option<&Usage>) -> Value {
    let output = match text {
        Some(text) => json!([{"id": format!("msg_{id}"), "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": null}]}]),
        None => json!([]),
    };
    let (status, incomplete) = match usage {
        Some(_) => ("incomplete", json!({"reason": "max_output_tokens"})),
        None => ("in_progress", Value::Null),
    };
    json!({"id": id, "created_at": unix_now(), "incomplete_details": incomplete, "instructions": null,
        "metadata": null, "model": model, "object": "response", "output": output, "parallel_tool_calls": true,
        "temperature": 1.0, "tool_choice": "auto", "tools": [], "top_p": 1.0, "background": false,
        "max_output_tokens": max_tokens, "status": status, "truncation": "disabled",
        "usage": usage.map(Usage::responses_json)})
}

/// A streamed Responses request, with the events vLLM sends for a text answer: the response
/// created and in progress, its message and text part opened, one `response.output_text.delta`
/// per token, then everything closed and `response.completed` carrying `usage`.
fn stream_response(
    state: Arc<AppState>,
    request: ParsedRequest,
    id: String,
    prompt_len: usize,
    max_tokens: u32,
    mut tokens_rx: tokio::sync::mpsc::UnboundedReceiver<Produced>,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    let worker = state.clone();
    tokio::spawn(async move {
        let item_id = format!("msg_{id}");
        let mut sequence = 0u64;
        let mut event = |kind: &str, mut data: Value| -> Bytes {
            data["type"] = json!(kind);
            data["sequence_number"] = json!(sequence);
            sequence += 1;
            Bytes::from(format!("event: {kind}\ndata: {data}\n\n"))
        };
        let in_progress = response_object(&id, &request.model, max_tokens, None, None);
        let message =
            json!({"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []});
        let part = json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
        let opening = [
            event("response.created", json!({"response": in_progress})),
            event("response.in_progress", json!({"response": in_progress})),
            event("response.output_item.added", json!({"output_index": 0, "item": message})),
            event(
                "response.content_part.added",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": part}),
            ),
        ];
        for bytes in opening {
            if tx.send(bytes).await.is_err() {
                return;
            }
        }
        let mut usage = Usage { prompt: prompt_len, completion: 0, cached: 0, details: true };
        let mut text = String::new();
        while let Some(Produced { emitted: e, .. }) = tokens_rx.recv().await {
            usage.completion = e.index;
            usage.cached = e.cached_tokens;
            let delta = worker.tokenizer.decode(&[e.token]).unwrap_or_default();
            text.push_str(&delta);
            let data =
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "delta": delta, "logprobs": []});
            if tx.send(event("response.output_text.delta", data)).await.is_err() {
                return;
            }
            if e.finished {
                break;
            }
        }
        let done = json!({"type": "output_text", "text": text, "annotations": [], "logprobs": null});
        let closing = [
            event(
                "response.output_text.done",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "text": text, "logprobs": []}),
            ),
            event(
                "response.content_part.done",
                json!({"item_id": item_id, "output_index": 0, "content_index": 0, "part": done}),
            ),
            event(
                "response.output_item.done",
                json!({"output_index": 0, "item": {"id": item_id, "type": "message",
                "role": "assistant", "status": "completed", "content": [done]}}),
            ),
            event(
                "response.completed",
                json!({"response": response_object(&id, &request.model, max_tokens, Some(&text), Some(&usage))}),
            ),
        ];
        for bytes in closing {
            if tx.send(bytes).await.is_err() {
                return;
            }
        }
    });
    sse(&state, rx)
}

/// A streamed completion or chat, chunk by chunk as vLLM's `completion_stream_generator` and
/// `chat_completion_stream_generator` write it: a chat opens every choice with its role when
/// the first output arrives; each token is a chunk of its choice's `index`; `usage` at the end
/// if asked for ([`Gathered::usage`]).
fn stream(
    state: Arc<AppState>,
    endpoint: Endpoint,
    request: ParsedRequest,
    id: String,
    fanout: Fanout,
    submitted: Submitted,
    origin: Origin,
) -> Response {
    let Submitted { tokens: mut tokens_rx, ending } = submitted;
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    let worker = state.clone();
    tokio::spawn(async move {
        // When the client goes away, this task ends and drops `tokens_rx`: the engine aborts
        // the request's sequences and frees their blocks.
        let created = unix_now();
        let object = if endpoint == Endpoint::Completions { "text_completion" } else { "chat.completion.chunk" };
        let chunk = |choices: Value| -> Bytes {
            let body =
                json!({"id": id, "object": object, "created": created, "model": request.model, "choices": choices});
            Bytes::from(format!("data: {body}\n\n"))
        };
        let piece = |index: usize, delta: &str, finish: Value| match endpoint {
            Endpoint::Completions => {
                json!([{"index": index, "text": delta, "logprobs": null, "finish_reason": finish, "stop_reason": null}])
            }
            _ => json!([{"index": index, "delta": {"content": delta}, "logprobs": null, "finish_reason": finish}]),
        };
        let mut gathered = Gathered::new(fanout);
        while !gathered.done() {
            let Some(produced) = tokens_rx.recv().await else { break };
            if gathered.push(&produced) && endpoint == Endpoint::ChatCompletions {
                for index in 0..gathered.fanout().n() {
                    let role = json!([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]);
                    if tx.send(chunk(role)).await.is_err() {
                        return;
                    }
                }
            }
            let e = produced.emitted;
            let text = worker.tokenizer.decode(&[e.token]).unwrap_or_default();
            let finish = if e.finished { json!("length") } else { Value::Null };
            if tx.send(chunk(piece(produced.seq, &text, finish))).await.is_err() {
                return;
            }
        }
        if let Ok(Ending::TransferFailed(reason)) = ending.await {
            // The status line is gone: the error goes in the stream, as vLLM and SGLang send it.
            let (_, error) = transfer_failure(&worker, &id, origin, &reason);
            if tx.send(Bytes::from(format!("data: {error}\n\n"))).await.is_ok() {
                let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
            }
            return;
        }
        if request.include_usage {
            let mut body =
                json!({"id": id, "object": object, "created": created, "model": request.model, "choices": []});
            let mut usage = gathered.usage(true, worker.prompt_tokens_details);
            usage.cached = origin.reported_cached(usage.cached);
            body["usage"] = usage.json();
            if tx.send(Bytes::from(format!("data: {body}\n\n"))).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
    });
    sse(&state, rx)
}

/// An event stream of what `rx` yields.
fn sse(state: &AppState, rx: tokio::sync::mpsc::Receiver<Bytes>) -> Response {
    let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    }));
    let mut response = Response::new(body);
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    tagged(state, response)
}

/// vLLM's `/tokenize`: `{"prompt": …}` tokenizes like completions (special tokens added),
/// `{"messages": …}` like chat (template rendered, generation prompt added by default).
async fn tokenize(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
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
async fn models(State(state): State<Arc<AppState>>) -> Response {
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
struct LoadLora {
    lora_name: String,
    lora_path: String,
}

/// `POST /v1/unload_lora_adapter` body.
#[derive(serde::Deserialize)]
struct UnloadLora {
    lora_name: String,
}

/// The refusal of a run-time adapter change, unless they are allowed.
fn lora_updates_refused(state: &AppState) -> Option<Response> {
    let message = "runtime LoRA updates are off (set VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)".to_owned();
    (!state.runtime_lora_updating).then(|| error(state, StatusCode::NOT_FOUND, "NotFoundError", message))
}

async fn load_lora_adapter(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
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

async fn unload_lora_adapter(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
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

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
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

async fn reset_prefix_cache(State(state): State<Arc<AppState>>) -> Response {
    if state.engine.reset_prefix_cache().await {
        tagged(&state, StatusCode::OK.into_response())
    } else {
        error(&state, StatusCode::CONFLICT, "ConflictError", "requests are running".into())
    }
}

/// Fault injection for reliability tests: `{"drop_fraction": 0.05, "stall": false, "delay_ms": 0}`.
async fn chaos_events(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
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

/// Restarts the event publisher: seq back to 0, replay buffer emptied.
async fn restart_publisher(State(state): State<Arc<AppState>>) -> Response {
    for rank in state.engine.ranks() {
        rank.publisher().restart();
    }
    tagged(&state, StatusCode::OK.into_response())
}

/// `POST /_kv/pull` (vLLM protocol, sim-private): a decoder reads a prefill request's held
/// blocks, which frees them, as the NIXL read and its notification do. 404 if they are not
/// held (expired, already read, unknown).
async fn kv_pull(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
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
async fn join_room(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
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
