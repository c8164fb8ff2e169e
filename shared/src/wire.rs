//! The messages between the filter (inside Envoy) and the sidecar, over loopback HTTP.
//!
//! Every body is encoded with [`crate::codec`]. The endpoints are:
//!
//! | endpoint | request body | response body |
//! |---|---|---|
//! | `POST /v1/route` | [`RouteRequest`] | [`RouteResponse`] |
//! | `POST /v1/route_body` | [`RouteBodyRequest`] | [`RouteResponse`] |
//! | `POST /v1/lifecycle` | [`LifecycleBatch`] | empty (204) |
//! | `GET /v1/models` | — | [`ModelList`] |
//! | `GET /v1/models/{model}/tokenizer` | — | [`ModelBundle`] |
//!
//! A model name goes into the tokenizer path percent-encoded ([`tokenizer_path`]): vLLM serves
//! Hugging Face names such as `Qwen/Qwen3-8B` as they are, slashes included.

use crate::ids::{ModelName, RequestId};
use serde::{Deserialize, Serialize};

/// Content type of every codec-encoded body.
pub const CONTENT_TYPE: &str = "application/x-kvgate-bincode";

/// The version of these types as encoded. The filter sends it on every sidecar call
/// ([`WIRE_VERSION_HEADER`]); a sidecar of another version answers 409 naming both, instead
/// of misreading the body. Bump it with any change to an encoded type's fields.
pub const WIRE_VERSION: &str = "10";

/// The header that carries [`WIRE_VERSION`].
pub const WIRE_VERSION_HEADER: &str = "x-kvgate-wire";

/// On a route call answered 429 (the request is shed), why: `slo` when no replica is
/// predicted to meet its TTFT SLO; otherwise (or absent) every replica is saturated.
pub const SHED_REASON_HEADER: &str = "x-kvgate-shed-reason";

/// The largest request body Envoy buffers for the filter (`request_body_buffer_limit` in
/// `envoy/`): the sidecar accepts an offloaded body this large, plus its envelope.
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// What [`tokenizer_path`] escapes: everything but RFC 3986's unreserved characters.
const PATH_SEGMENT: &percent_encoding::AsciiSet =
    &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// The sidecar path of `model`'s [`ModelBundle`], the name percent-encoded as one path segment.
///
/// ```
/// use kvgate_shared::wire::tokenizer_path;
///
/// assert_eq!(tokenizer_path("Qwen/Qwen3-8B"), "/v1/models/Qwen%2FQwen3-8B/tokenizer");
/// assert_eq!(tokenizer_path("qwen3"), "/v1/models/qwen3/tokenizer");
/// ```
pub fn tokenizer_path(model: &str) -> String {
    format!("/v1/models/{}/tokenizer", percent_encoding::utf8_percent_encode(model, PATH_SEGMENT))
}

/// The request header Envoy's `override_host` load-balancing policy reads: `ip:port`.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";

/// vLLM's header selecting a data-parallel rank of the engine the request reaches.
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";

/// Asks the sidecar where one LLM request should go.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteRequest {
    /// The booking key: an id the filter generates, unique per stream, and the key of later
    /// [`LifecycleEvent`]s. Never the client's `x-request-id`, which a client may reuse (two
    /// requests would then release each other's load) or omit.
    pub request_id: RequestId,
    /// The request's `x-request-id`, for logs and `/debug/explain`: it keys nothing.
    pub client_request_id: Option<String>,
    /// The `model` field of the OpenAI body.
    pub model: ModelName,
    /// Number of prompt tokens (ISL). When the prompt could not be tokenized this is an
    /// estimate and `block_hashes` is empty: the sidecar then routes on load alone.
    pub prompt_tokens: u32,
    /// How `prompt_tokens` was arrived at.
    pub prompt_count: PromptCount,
    /// Sequence hashes ([`crate::hash::prompt_block_hashes`]) of the prompt's full blocks.
    pub block_hashes: Vec<crate::hash::SequenceHash>,
    /// The block size the hashes were computed with. The sidecar ignores hashes whose block
    /// size differs from the pool's rather than mis-scoring them.
    pub block_size: u32,
    /// A session key for the `consistent_hash` policy: the `x-session-id` header, else the
    /// body's `session_id` or `user`.
    pub session: Option<String>,
    /// Per-request scoring overrides (the `x-kvgate-scoring` header), applied only where the
    /// sidecar's configuration allows them.
    pub overrides: Option<ScoringOverrides>,
    /// The request's `max_tokens` (or `max_completion_tokens`): with decode progress, a
    /// request's decode load is weighted by `1 − output/max_tokens`.
    pub max_tokens: Option<u32>,
    /// Prompts in the request (a `/v1/completions` list is one engine request each; the hashes
    /// and `prompt_tokens` are the first's, the others are booked as its size, uncached).
    pub prompts: u32,
    /// Sequences decoded per prompt: `n`.
    pub samples: u32,
    /// Whether the response streams. A non-streamed response's first byte is its last, so
    /// the sidecar estimates when its prefill ends instead of waiting for that report.
    pub stream: bool,
    /// How long the filter waits for capacity when every replica is saturated (its
    /// `admission_wait_ms`), in ms: the sidecar's admission queue holds the request at most
    /// this long. 0: it does not wait.
    pub wait_ms: u32,
    /// The request's priority class for admission control: the value of the header the
    /// filter's `priority_header` names (set by the operator's own filters), if configured.
    pub priority: Option<String>,
    /// The request's tenant, for fairness between tenants while requests wait: the value of
    /// the filter's `tenant_header`, if configured.
    pub tenant: Option<String>,
    /// The request's TTFT SLO in ms: the value of the filter's `ttft_slo_header`, if
    /// configured and a whole number. It replaces its admission class's `ttft_slo_ms`.
    pub ttft_slo_ms: Option<u32>,
    /// The request's ITL SLO in ms (the mean time between its output tokens): the value of
    /// the filter's `itl_slo_header`, if configured and a whole number. It replaces its
    /// admission class's `itl_slo_ms`.
    pub itl_slo_ms: Option<u32>,
    /// Whether the filter can run a prefill leg for it (its `prefill_cluster` is set and the
    /// endpoint is one legs exist for): in a disaggregated pool a request that cannot is
    /// served whole.
    pub prefill_legs: bool,
}

impl RouteRequest {
    /// A streamed request of one prompt, `prompt_tokens` long exactly, whose full blocks of
    /// `block_size` tokens hash to `block_hashes`; nothing else set (no session, overrides,
    /// class, tenant or prefill leg). Tests, benchmarks and tools start from it.
    pub fn exact(
        request_id: &str,
        model: &str,
        prompt_tokens: u32,
        block_size: u32,
        block_hashes: Vec<crate::hash::SequenceHash>,
    ) -> RouteRequest {
        RouteRequest {
            request_id: RequestId::from(request_id),
            client_request_id: None,
            model: ModelName::from(model),
            prompt_tokens,
            prompt_count: PromptCount::Exact,
            block_hashes,
            block_size,
            session: None,
            overrides: None,
            max_tokens: None,
            prompts: 1,
            samples: 1,
            stream: true,
            wait_ms: 0,
            priority: None,
            tenant: None,
            ttft_slo_ms: None,
            itl_slo_ms: None,
            prefill_legs: false,
        }
    }
}

/// How a [`RouteRequest`]'s `prompt_tokens` was arrived at: what its prediction of the
/// engine's `usage` can be checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum PromptCount {
    /// Tokenized whole: the count the engine should report.
    Exact,
    /// Only the prompt's head was tokenized (`max_tokenize_bytes`): the hashes are exact, the
    /// count extrapolated.
    Head,
    /// Not tokenized: an estimate from the body's size, no hashes.
    Estimated,
}

/// Asks the sidecar to route a request the filter hands over whole: a prompt too big to
/// tokenize on an Envoy worker thread (the filter's `offload_bytes`) is tokenized on the
/// sidecar's own threads instead, with the same code.
///
/// The body is borrowed both where the filter builds the message and where the sidecar
/// decodes it: a 16 MiB body is not copied once more on either side.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteBodyRequest<'a> {
    /// The booking key, as in [`RouteRequest`].
    pub request_id: RequestId,
    /// The request's `x-request-id`, as in [`RouteRequest`].
    pub client_request_id: Option<String>,
    /// The endpoint the body was sent to.
    pub endpoint: crate::prompt::openai::Endpoint,
    /// The OpenAI request body, as the client sent it. Encoded as bytes, which bincode writes
    /// as it writes a sequence of `u8` (its length, then the bytes), but writes in one copy
    /// instead of a call a byte, and reads in place.
    #[serde(borrow, with = "serde_bytes")]
    pub body: std::borrow::Cow<'a, [u8]>,
    /// The `x-session-id` header, if any (the body's `session_id`/`user` are read by the
    /// sidecar).
    pub session: Option<String>,
    /// Per-request scoring overrides, as in [`RouteRequest`].
    pub overrides: Option<ScoringOverrides>,
    /// How long the filter waits for the answer (its `offload_timeout_ms`): work that cannot
    /// finish by then is skipped and nothing is booked, since the request has gone on.
    pub budget_ms: u32,
    /// How long it waits on top for capacity, as in [`RouteRequest`].
    pub wait_ms: u32,
    /// Its priority class, as in [`RouteRequest`].
    pub priority: Option<String>,
    /// Its tenant, as in [`RouteRequest`].
    pub tenant: Option<String>,
    /// Its TTFT SLO, as in [`RouteRequest`].
    pub ttft_slo_ms: Option<u32>,
    /// Its ITL SLO, as in [`RouteRequest`].
    pub itl_slo_ms: Option<u32>,
    /// Whether the filter can run a prefill leg for it, as in [`RouteRequest`].
    pub prefill_legs: bool,
}

impl<'a> RouteBodyRequest<'a> {
    /// An offload of `body` sent to `endpoint`, answered within `budget_ms`; nothing else set
    /// (no session, overrides, wait, class, tenant, SLOs or prefill leg). Tests and
    /// benchmarks start from it.
    pub fn of(
        request_id: &str,
        endpoint: crate::prompt::openai::Endpoint,
        body: impl Into<std::borrow::Cow<'a, [u8]>>,
        budget_ms: u32,
    ) -> RouteBodyRequest<'a> {
        RouteBodyRequest {
            request_id: RequestId::from(request_id),
            client_request_id: None,
            endpoint,
            body: body.into(),
            session: None,
            overrides: None,
            budget_ms,
            wait_ms: 0,
            priority: None,
            tenant: None,
            ttft_slo_ms: None,
            itl_slo_ms: None,
            prefill_legs: false,
        }
    }
}

/// Scoring knobs a request may override (Dynamo's `router_config_override`).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScoringOverrides {
    /// Overrides `kv_overlap_credit`.
    pub kv_overlap_credit: Option<f64>,
    /// Overrides `prefill_load_scale`.
    pub prefill_load_scale: Option<f64>,
    /// Overrides `temperature`.
    pub temperature: Option<f64>,
}

/// The request header carrying [`ScoringOverrides`] as JSON.
pub const OVERRIDES_HEADER: &str = "x-kvgate-scoring";

/// The request header carrying a session key, unless the filter names another
/// (`session_header`).
pub const SESSION_HEADER: &str = "x-session-id";

/// The sidecar's decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteResponse {
    /// `ip:port` to put in [`DESTINATION_HEADER`]; `None` lets Envoy's fallback LB pick.
    pub endpoint: Option<String>,
    /// The chosen replica's id (for logs and debug headers).
    pub replica: Option<String>,
    /// Prompt blocks already cached on the chosen replica's device tier.
    pub overlap_blocks: u32,
    /// The data-parallel rank chosen within the replica, for [`DP_RANK_HEADER`]; `None` for an
    /// engine without ranks.
    pub dp_rank: Option<u32>,
    /// In a disaggregated pool, the prefill leg the filter runs before (vLLM) or beside
    /// (SGLang) sending the request to `endpoint`, its decode worker; `None`: the request is
    /// served whole at `endpoint`.
    pub prefill: Option<PrefillLeg>,
}

/// Where a disaggregated request's prompt is computed, and how its KV reaches the decode
/// worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillLeg {
    /// The prefill worker, `ip:port` for [`DESTINATION_HEADER`] on the leg.
    pub endpoint: String,
    /// Its replica id.
    pub replica: String,
    /// Its data-parallel rank, for [`DP_RANK_HEADER`] on the leg.
    pub dp_rank: Option<u32>,
    /// Prompt blocks already cached there.
    pub overlap_blocks: u32,
    /// The id the leg's load is booked under: lifecycle reports about the leg (its usage,
    /// its end) name it.
    pub booking_id: RequestId,
    /// The engines' KV-transfer protocol.
    pub transfer: Transfer,
}

/// A KV-transfer protocol, with what the filter puts in the request bodies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Transfer {
    /// vLLM (NixlConnector's request protocol): the leg asks for `do_remote_decode` and one
    /// token; its response's `kv_transfer_params` go into the request to the decode worker.
    Vllm,
    /// SGLang: both legs carry the prefill worker's bootstrap address and a room, and are
    /// sent at once.
    Sglang {
        /// `bootstrap_host`: the prefill worker's address.
        host: String,
        /// `bootstrap_port`: its bootstrap server.
        port: u16,
        /// `bootstrap_room`: pairs the two legs.
        room: u64,
    },
}

/// A point in a routed request's life, reported by the filter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum LifecycleKind {
    /// The first response body byte arrived: prefill is done.
    FirstToken {
        /// Microseconds from the request leaving the filter for the engine (the sidecar's
        /// answer applied) to that byte: the engine's time to first token as the gateway sees
        /// it, which the sidecar's TTFT predictions are checked against. `None` for a response
        /// that is not a success (2xx), whose first byte says nothing of the engine's speed.
        ttft_us: Option<u64>,
    },
    /// The response streamed its output: the mean time between its output tokens, in
    /// microseconds — from its first body byte to its last, over the engine's
    /// `usage.completion_tokens` less one — which the sidecar's ITL predictions are checked
    /// against. Sent before [`LifecycleKind::Done`] for a successful (2xx) stream whose
    /// `usage` said it produced two tokens or more.
    Decoded {
        /// The mean inter-token latency, µs.
        itl_us: u64,
    },
    /// The response ended (or the request was abandoned): the replica's load is released.
    Done,
    /// The prefill leg did not deliver (it failed or timed out): the request was served whole
    /// on its decode worker, which computes its prompt after all.
    ServedWhole,
    /// Decode progress (the filter's `decode_progress`): output tokens streamed so far,
    /// reported each time the sequence crosses a KV block boundary.
    Progress(u32),
    /// The request ran on another host than the one the sidecar chose (`ip:port`, Envoy's
    /// `upstream.address`): Envoy retried it elsewhere, or the chosen host was unhealthy and
    /// the fallback balancer picked. Its booking moves there.
    RanOn(String),
    /// What the engine reported in the response's `usage`, sent before [`LifecycleKind::Done`]
    /// when the response carried it: checked against the sidecar's prediction.
    Usage {
        /// `usage.prompt_tokens`.
        prompt_tokens: u32,
        /// `usage.prompt_tokens_details.cached_tokens` (vLLM's
        /// `--enable-prompt-tokens-details`); `None` when the engine reported no details.
        cached_tokens: Option<u32>,
    },
}

/// One lifecycle report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LifecycleEvent {
    /// The `model` of the matching [`RouteRequest`]: only that model's pool applies it.
    pub model: ModelName,
    /// The `request_id` of the matching [`RouteRequest`].
    pub request_id: RequestId,
    /// What happened.
    pub kind: LifecycleKind,
}

/// Lifecycle reports, batched by the filter's root context.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LifecycleBatch {
    /// In the order they happened.
    pub events: Vec<LifecycleEvent>,
}

/// The models the sidecar routes for.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ModelList {
    /// Base model names, as clients put them in the OpenAI `model` field.
    pub models: Vec<String>,
    /// LoRA adapters: requested by name like a model, served by their base model's pool,
    /// with block hashes salted by the adapter name (never matching the base model's).
    pub adapters: Vec<Adapter>,
}

/// A LoRA adapter served by a base model's replicas.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Adapter {
    /// The adapter's name (the request's `model`, and vLLM's `lora_name` in KV events).
    pub name: String,
    /// Its base model.
    pub base: String,
}

/// Everything the filter needs to turn a request for `model` into block hashes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelBundle {
    /// The model name.
    pub model: String,
    /// The pool's KV block size in tokens.
    pub block_size: u32,
    /// The model's `tokenizer.json`, in the canonical ("version 2.0") form the tokenizer reads.
    pub tokenizer_json: String,
    /// The Jinja chat template from `tokenizer_config.json`, if the model has one.
    pub chat_template: Option<String>,
    /// `bos_token` as the template sees it.
    pub bos_token: Option<String>,
    /// `eos_token` as the template sees it.
    pub eos_token: Option<String>,
    /// How message content reaches the template (vLLM's `--chat-template-content-format`).
    pub content_format: crate::prompt::content_format::ContentFormat,
    /// How chat requests are rendered: the template, or harmony (gpt-oss).
    pub renderer: crate::prompt::Renderer,
}
