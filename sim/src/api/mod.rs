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
//!
//! | file | what |
//! |---|---|
//! | `mod.rs` | the routes, the shared state, and serving a completion, chat or Responses request |
//! | `reply.rs` | the answer: a whole response object or a stream of server-sent events |
//! | `transfer.rs` | disaggregation: the request's origin, its headers, `/_kv/pull`, `/_kv/bootstrap` |
//! | `admin.rs` | `/tokenize`, `/v1/models`, LoRA adapters, `/metrics`, resets, fault hooks |

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvgate_shared::prompt::openai::{parse, Endpoint, ParsedRequest, Prompt};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::prompt::PromptError;
use rand::{Rng, SeedableRng};
use serde_json::{json, Map, Value};
use tracing::Instrument;
use xxhash_rust::xxh3::xxh3_64;

use crate::engine::{Ending, Engine, Sequence, SubmitError, Submitted, Transfer};
use crate::extra_keys::ExtraKeys;
use crate::fanout::{self, Fanout, Gathered};
use crate::kv_transfer::{room_rank, Plan, Protocol, Source};
use crate::lora::Registry;
use crate::scheduler::HoldKey;

mod admin;
mod reply;
mod transfer;

use admin::{
    chaos_events, chaos_slowdown, load_lora_adapter, metrics, models, reset_prefix_cache, restart_publisher, tokenize,
    unload_lora_adapter,
};
use reply::{message_object, response_object, stream, stream_message, stream_response};
use transfer::{disaggregation_headers, join_room, kv_pull, transfer_failure, wait_for_decoder, Origin};

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
        .route("/v1/messages", post(messages))
        .route("/invocations", post(invocations))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/tokenize", post(tokenize))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/v1/load_lora_adapter", post(load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(unload_lora_adapter))
        .route("/_chaos/events", post(chaos_events))
        .route("/_chaos/restart_publisher", post(restart_publisher))
        .route("/_chaos/slowdown", post(chaos_slowdown))
        .fallback(percent_encoded)
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
    serve(state, Endpoint::Completions, &headers, body).instrument(request_span(&headers)).await
}

async fn chat_completions(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    serve(state, Endpoint::ChatCompletions, &headers, body).instrument(request_span(&headers)).await
}

/// vLLM's `/invocations` (SageMaker's path): a body with `messages` is a chat, any other a
/// completion.
async fn invocations(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let chat = serde_json::from_slice::<Map<String, Value>>(&body).is_ok_and(|o| o.contains_key("messages"));
    let endpoint = if chat { Endpoint::ChatCompletions } else { Endpoint::Completions };
    serve(state, endpoint, &headers, body).instrument(request_span(&headers)).await
}

/// A path no route matched as sent. uvicorn percent-decodes the path before vLLM's routes see
/// it, so `POST /v1/chat/%63ompletions` is a chat there: served as one here too.
async fn percent_encoded(
    State(state): State<Arc<AppState>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match Endpoint::from_path(uri.path()) {
        Some(endpoint) if method == Method::POST => {
            serve(state, endpoint, &headers, body).instrument(request_span(&headers)).await
        }
        _ => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn responses(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    serve(state, Endpoint::Responses, &headers, body).instrument(request_span(&headers)).await
}

async fn messages(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    serve(state, Endpoint::Messages, &headers, body).instrument(request_span(&headers)).await
}

/// vLLM's span for a request (`--otlp-traces-endpoint`): `llm_request`, a server span that is a
/// child of the request's `traceparent`, naming the request and its prompt tokens. None when
/// spans are not exported.
fn request_span(headers: &HeaderMap) -> tracing::Span {
    use tracing::field::Empty;
    if !kvgate_telemetry::exporting() {
        return tracing::Span::none();
    }
    let span = tracing::info_span!(
        "llm_request",
        otel.kind = "server",
        gen_ai.request.id = Empty,
        gen_ai.usage.prompt_tokens = Empty
    );
    kvgate_telemetry::adopt_parent(&span, headers);
    span
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
        match state.adapters.get(request.model.as_str()) {
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
    // Disaggregation covers completions and chat; a Responses or Messages request is always
    // served here.
    let plan = if endpoint.is_converted() { Ok(Plan::Local) } else { state.protocol.plan(&body) };
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
        // vLLM's Messages API answers with its chat completion's id.
        Endpoint::ChatCompletions | Endpoint::Messages => "chatcmpl-",
        Endpoint::Responses => "resp_",
    };
    let id = format!("{kind}{:016x}", rng.random::<u64>());
    let span = tracing::Span::current();
    span.record("gen_ai.request.id", id.as_str());
    span.record("gen_ai.usage.prompt_tokens", prompts.iter().map(Vec::len).sum::<usize>());
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
        (Endpoint::Messages, true) => {
            let response = stream_message(state.clone(), request, id, fanout.prompt_tokens(), submitted.tokens);
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
        let body = response_object(&id, request.model.as_str(), max_tokens, Some(&text(0)), Some(&usage));
        return disaggregation_headers(&state, tagged(&state, Json(body).into_response()), origin, computed);
    }
    if endpoint == Endpoint::Messages {
        let body = message_object(&id, request.model.as_str(), &text(0), &usage);
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
