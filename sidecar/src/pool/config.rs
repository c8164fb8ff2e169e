//! `[[pools]]`: one model's pool — its policy, replicas, admission and disaggregation
//! sections — as the config file gives it.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::bail;
use kvgate_shared::prompt::content_format::ContentFormat;
use kvgate_shared::prompt::PromptError;
use kvgate_shared::wire::ModelBundle;
use serde::Deserialize;

use super::sessions::SessionConfig;
use crate::admission::AdmissionConfig;

/// A model served by a set of interchangeable replicas.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// The OpenAI `model` name clients send.
    pub model: String,
    /// Directory holding `tokenizer.json` and optionally `tokenizer_config.json`.
    pub tokenizer: PathBuf,
    /// KV block size in tokens; must match the engines'.
    pub block_size: u32,
    /// How message content reaches the chat template: `auto` (default: detected from the
    /// template, as vLLM does), `string` or `openai`. Set it to what the engines'
    /// `--chat-template-content-format` is, if they override it.
    #[serde(default)]
    pub chat_template_content_format: ContentFormat,
    /// How replicas are chosen (default `kv_aware`).
    #[serde(default)]
    pub policy: Policy,
    /// `prefix_affinity`: how long a routed prompt's blocks count as cached where they were
    /// sent (default 120 s).
    #[serde(default = "default_affinity_ttl")]
    pub affinity_ttl_secs: u64,
    /// `prefix_affinity`, and the in-flight credit of `kv_aware` and `predicted_latency`: blocks
    /// remembered (a block sent to two replicas counts twice), the least recently routed
    /// records dropped first, whole (default 262144, about 3 MiB by its layout). With the sync mesh the
    /// in-flight credit holds every gateway's routes: size it for the fleet's traffic.
    #[serde(default = "default_affinity_blocks")]
    pub affinity_blocks: usize,
    /// `kv_aware`: for this long after routing a prompt to a replica, its blocks count as cached
    /// there even before the engine's events say so (default 10 s; 0 turns it off). Without
    /// it, prompts sharing a prefix that arrive while the first is still queued or in prefill
    /// see no overlap anywhere and spread, duplicating the prefix across engines. With the
    /// sync mesh, prompts routed by the other gateways count too.
    #[serde(default = "default_inflight_credit")]
    pub inflight_credit_secs: u64,
    /// A replica that leaves the pool (health checks, outlier ejection, a DNS change) stops
    /// being routed to at once, but keeps its index and event subscription this long (default
    /// 30 s): if it comes back within that, it comes back warm. 0 empties it at once.
    #[serde(default = "default_leave_grace")]
    pub leave_grace_secs: u64,
    /// The prefill rate, tokens/s, assumed for a replica until it has served a streamed
    /// request (default 8 000): a non-streamed response's first byte is its last, so its
    /// prefill is taken to end after `prefill tokens / rate`, the rate learned per replica
    /// from streamed requests' time to first token once there is one.
    #[serde(default = "default_prefill_rate")]
    pub prefill_tokens_per_sec: f64,
    /// The engines' context length (vLLM's `--max-model-len`), if set: a request without
    /// `max_tokens` is booked with the limit vLLM gives it, the context left after its prompt
    /// (decode progress weighs a request's footprint by `1 − output / max_tokens`). Unset, such
    /// a request's footprint keeps its full weight until it ends.
    #[serde(default)]
    pub max_model_len: Option<u64>,
    /// The engines' `--tokenizer-mode` (vLLM's names; default `auto`). kvgate renders and
    /// tokenizes as vLLM's `hf` mode does; `auto` is `hf` unless the tokenizer directory is a
    /// Mistral repository's (`tekken.json` or `tokenizer.model.v*`: vLLM then picks `mistral`)
    /// or its `config.json` names an architecture vLLM gives its own encoder. What kvgate
    /// cannot match is refused at load, by name ([`PoolConfig::check_tokenizer_mode`]).
    #[serde(default = "default_tokenizer_mode")]
    pub tokenizer_mode: String,
    /// Poll each engine's `/metrics` this often and count the requests it runs beyond those
    /// kvgate booked as load (traffic that bypasses kvgate), those it reports waiting as
    /// prefill still to come. 0 (default) turns it off.
    #[serde(default)]
    pub engine_metrics_secs: u64,
    /// LoRA adapters every replica serves. A request for an adapter routes in this pool, and
    /// its blocks (salted by the adapter name, as vLLM's `lora_name` salts stored events)
    /// never match the base model's.
    #[serde(default)]
    pub adapters: Vec<String>,
    /// Poll each engine's `/v1/models` this often and route the LoRA adapters it lists (those
    /// whose `parent` is this pool's model) to the replicas that serve them, beside the
    /// configured `adapters`. 0 turns it off.
    #[serde(default = "default_adapters_poll")]
    pub adapters_poll_secs: u64,
    /// Admission control: when every replica is saturated, requests wait here instead of
    /// piling onto an engine, and are shed (429) past a bound. Off by default.
    #[serde(default)]
    pub admission: AdmissionConfig,
    /// Prefill/decode disaggregation: replicas with `role = "prefill"` compute prompts,
    /// `role = "decode"` ones generate, and each request gets a prefill worker (by cache
    /// and prefill load) and a decode worker (by load). Off (unset) by default.
    #[serde(default)]
    pub disaggregation: Option<DisaggregationConfig>,
    /// Session binding (`kv_aware` only): a request's session key — the filter's
    /// `session_header`, else the body's `session_id`, `user` or Messages `metadata.user_id` —
    /// binds its session to the replica it went to, and later requests of the session are
    /// credited for staying there while it holds their prefix (see `sessions.rs`). Off
    /// (unset) by default: nothing a client sends then keys any state.
    #[serde(default)]
    pub sessions: Option<SessionConfig>,
    /// `/debug/explain`: how many of the last decisions are kept, each with every candidate's
    /// cost terms (default 4096, at most 1 048 576 — [`MAX_EXPLAIN_KEEP`]). Memory is bounded
    /// by this count: about 350 bytes a decision plus 80 per candidate replica.
    #[serde(default = "default_explain_keep")]
    pub explain_keep: usize,
    /// `/debug/explain`: how long a decision is kept, in seconds (default 300, at least 1).
    #[serde(default = "default_explain_max_age")]
    pub explain_max_age_secs: u64,
    /// The replicas (static discovery).
    #[serde(default)]
    pub replicas: Vec<ReplicaConfig>,
}

/// The most decisions a pool may keep for `/debug/explain` (`explain_keep`).
pub const MAX_EXPLAIN_KEEP: usize = 1 << 20;

impl PoolConfig {
    /// A pool of `replicas` with every optional setting at its default — what a TOML table
    /// with only these four keys gives.
    pub fn new(
        model: &str,
        tokenizer: impl Into<PathBuf>,
        block_size: u32,
        replicas: Vec<ReplicaConfig>,
    ) -> PoolConfig {
        PoolConfig {
            model: model.to_owned(),
            tokenizer: tokenizer.into(),
            block_size,
            chat_template_content_format: ContentFormat::default(),
            policy: Policy::default(),
            affinity_ttl_secs: default_affinity_ttl(),
            affinity_blocks: default_affinity_blocks(),
            inflight_credit_secs: default_inflight_credit(),
            leave_grace_secs: default_leave_grace(),
            prefill_tokens_per_sec: default_prefill_rate(),
            max_model_len: None,
            tokenizer_mode: default_tokenizer_mode(),
            engine_metrics_secs: 0,
            adapters: Vec::new(),
            adapters_poll_secs: default_adapters_poll(),
            admission: AdmissionConfig::default(),
            disaggregation: None,
            sessions: None,
            explain_keep: default_explain_keep(),
            explain_max_age_secs: default_explain_max_age(),
            replicas,
        }
    }

    /// Refuses a `tokenizer_mode` whose renderer kvgate does not reproduce: vLLM's `mistral`
    /// (mistral-common), its DeepSeek V3.2/V4, Kimi, Inkling and Cohere encoders — named, or
    /// what `auto` resolves to for this tokenizer directory.
    pub fn check_tokenizer_mode(&self) -> anyhow::Result<()> {
        let mode = match self.tokenizer_mode.as_str() {
            "hf" => return Ok(()),
            "auto" => self.auto_tokenizer_mode(),
            other => Some(other.to_owned()),
        };
        match mode {
            None => Ok(()),
            Some(mode) => bail!(
                "pool {:?}: the engines would tokenize with vLLM's {mode:?} tokenizer mode, which kvgate does not \
                 reproduce (it renders and tokenizes as the `hf` mode does); if the engines run \
                 --tokenizer-mode hf, set tokenizer_mode = \"hf\"",
                self.model
            ),
        }
    }

    /// What vLLM's `auto` tokenizer mode picks for this tokenizer directory, if not `hf`.
    fn auto_tokenizer_mode(&self) -> Option<String> {
        let files: Vec<String> = std::fs::read_dir(&self.tokenizer)
            .map(|d| d.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect())
            .unwrap_or_default();
        if files.iter().any(|f| f == "tekken.json" || f.starts_with("tokenizer.model.v")) {
            return Some("mistral".into());
        }
        let config = std::fs::read_to_string(self.tokenizer.join("config.json")).ok()?;
        let config: serde_json::Value = serde_json::from_str(&config).ok()?;
        let architectures = config.get("architectures")?.as_array()?;
        OWN_ENCODER_ARCHITECTURES
            .iter()
            .find(|(arch, _)| architectures.iter().any(|a| a.as_str() == Some(arch)))
            .map(|(_, mode)| (*mode).to_owned())
    }

    /// Whether this pool subscribes to its engines' KV events (all but `prefix_affinity`).
    pub fn reads_events(&self) -> bool {
        self.policy != Policy::PrefixAffinity
    }

    /// The model bundle the filter and the offload path tokenize with: the tokenizer
    /// directory, read, with this pool's block size and content format.
    pub fn bundle(&self) -> Result<ModelBundle, PromptError> {
        let mut bundle = ModelBundle::from_dir(&self.model, &self.tokenizer, self.block_size)?;
        bundle.content_format = self.chat_template_content_format;
        Ok(bundle)
    }
}

impl ReplicaConfig {
    /// A replica at `endpoint` whose engine publishes events on `kv_events` (connect mode,
    /// every topic, no replay, one rank) — what a TOML table with only these keys gives.
    pub fn new(id: &str, endpoint: SocketAddr, kv_events: &str) -> ReplicaConfig {
        ReplicaConfig {
            id: id.to_owned(),
            endpoint,
            kv_events: kv_events.to_owned(),
            kv_events_mode: EventsMode::default(),
            kv_events_topic: String::new(),
            kv_replay: None,
            data_parallel_size: 1,
            role: Role::Both,
            bootstrap_port: None,
        }
    }
}

/// One engine replica.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaConfig {
    /// A stable, unique name.
    pub id: String,
    /// `ip:port` exactly as the Envoy cluster has the host (what override_host matches).
    pub endpoint: SocketAddr,
    /// The engine's KV-events ZMQ endpoint, e.g. `tcp://10.0.0.5:5557` (may be left out only
    /// in a `prefix_affinity` pool, which reads no events).
    #[serde(default)]
    pub kv_events: String,
    /// `connect` (default: the engine binds its PUB, as vLLM does with `tcp://*:5557`) or
    /// `bind` (the engine is configured to connect to us).
    #[serde(default)]
    pub kv_events_mode: EventsMode,
    /// Only messages whose topic starts with this are read (vLLM's `topic`; default all).
    #[serde(default)]
    pub kv_events_topic: String,
    /// The engine's replay ROUTER (vLLM's `replay_endpoint`), e.g. `tcp://10.0.0.5:5558`.
    /// Without it, lost messages leave the replica degraded until its cache is cleared.
    #[serde(default)]
    pub kv_replay: Option<String>,
    /// The engine's `--data-parallel-size` (default 1). With N > 1 each rank is a routing
    /// target of its own: its events at `kv_events` port + rank (vLLM's rule), requests sent
    /// with `X-data-parallel-rank`.
    #[serde(default = "one")]
    pub data_parallel_size: u32,
    /// In a disaggregated pool: `prefill`, `decode` or `both` (default).
    #[serde(default)]
    pub role: Role,
    /// SGLang's `--disaggregation-bootstrap-port` of a prefill engine (disaggregation mode
    /// `sglang`): the decode worker fetches the prompt's KV through it.
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
}

/// A pool's routing policy. Every policy books load, so switching keeps load tracking.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Lowest token load after KV-cache credit (Dynamo's cost).
    #[default]
    KvAware,
    /// The same token-load cost without any cache credit.
    LeastLoad,
    /// In turn.
    RoundRobin,
    /// Rendezvous hashing of the session key (`x-session-id`, else the body's `session_id` or
    /// `user`); requests without one are routed `kv_aware`.
    ConsistentHash,
    /// The `kv_aware` cost with overlap from this gateway's own routing history instead of
    /// KV events (for engines that publish none): see [`crate::index::approx`].
    PrefixAffinity,
    /// The lowest predicted time to first token ([`crate::latency`]): the prefill each
    /// replica has ahead, this request's own after its cache overlap there, and what it
    /// decodes, at the speed learned for that replica. `kv_aware` until every candidate's
    /// model predicts.
    PredictedLatency,
}

impl Policy {
    /// Its name in the configuration (and in metric labels).
    pub fn name(self) -> &'static str {
        match self {
            Policy::KvAware => "kv_aware",
            Policy::LeastLoad => "least_load",
            Policy::RoundRobin => "round_robin",
            Policy::ConsistentHash => "consistent_hash",
            Policy::PrefixAffinity => "prefix_affinity",
            Policy::PredictedLatency => "predicted_latency",
        }
    }
}

/// Who binds the KV-event socket.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventsMode {
    /// We connect a SUB to the engine's bound PUB.
    #[default]
    Connect,
    /// We bind the SUB; the engine's PUB connects to us.
    Bind,
}

fn default_affinity_ttl() -> u64 {
    120
}

fn default_inflight_credit() -> u64 {
    10
}

fn default_leave_grace() -> u64 {
    30
}

fn default_explain_keep() -> usize {
    4096
}

fn default_explain_max_age() -> u64 {
    300
}

fn default_prefill_rate() -> f64 {
    8_000.0
}

fn default_tokenizer_mode() -> String {
    "auto".into()
}

/// Architectures vLLM's `auto` tokenizer mode gives their own encoder (vLLM 0.32).
const OWN_ENCODER_ARCHITECTURES: [(&str, &str); 6] = [
    ("DeepseekV32ForCausalLM", "deepseek_v32"),
    ("DeepseekV4ForCausalLM", "deepseek_v4"),
    ("DeepseekV4ForConditionalGeneration", "deepseek_v4"),
    ("DeepseekV41ForCausalLM", "deepseek_v41"),
    ("InklingForCausalLM", "inkling"),
    ("KimiK3ForConditionalGeneration", "kimi_k3"),
];

fn default_adapters_poll() -> u64 {
    10
}

fn default_affinity_blocks() -> usize {
    1 << 18
}

/// How a pool's requests are split between prefill and decode workers ([`Role`]).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DisaggregationConfig {
    /// The engines' protocol: `vllm` (the prefill leg first, its `kv_transfer_params` then
    /// go with the request to the decode worker: NixlConnector and the connectors sharing
    /// its request protocol) or `sglang` (both legs at once, joined by a bootstrap room).
    pub mode: TransferProtocol,
    /// Conditional disaggregation: a request whose prompt, less what the chosen decode
    /// worker has cached, is shorter than this many tokens is served whole on the decode
    /// worker (default 256): a transfer costs more than so short a prefill.
    #[serde(default = "default_min_remote_prefill")]
    pub min_remote_prefill_tokens: u64,
    /// Serve a request whole on its decode worker when even the best prefill worker has
    /// more than this many prefill tokens booked (prefill saturated). Unset: never.
    #[serde(default)]
    pub max_prefill_backlog_tokens: Option<u64>,
    /// How prefill workers are chosen: `kv_aware` (default: the cost on prefill terms, cache
    /// overlap credited) or `round_robin` (in turn, blind to cache and load: what a
    /// disaggregating router without a KV index does; the benchmark's baseline).
    #[serde(default)]
    pub prefill_policy: PrefillPolicy,
}

/// How a disaggregated pool chooses prefill workers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefillPolicy {
    /// Lowest prefill cost after cache credit.
    #[default]
    KvAware,
    /// In turn.
    RoundRobin,
}

/// The KV-transfer protocol of a disaggregated pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferProtocol {
    /// vLLM: sequential legs, `kv_transfer_params` from the prefill response.
    Vllm,
    /// SGLang: parallel legs, `bootstrap_host`/`bootstrap_port`/`bootstrap_room`.
    Sglang,
}

/// What a replica does in a disaggregated pool.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Whole requests, and either leg (the default, and the only role without
    /// disaggregation).
    #[default]
    Both,
    /// Prefill legs only.
    Prefill,
    /// Decode legs and requests served whole.
    Decode,
}

impl Role {
    /// Whether it takes prefill legs.
    pub fn prefills(self) -> bool {
        self != Role::Decode
    }

    /// Whether it takes decode legs (and whole requests).
    pub fn decodes(self) -> bool {
        self != Role::Prefill
    }
}

fn default_min_remote_prefill() -> u64 {
    256
}

/// The serde default of counts that are 1 unless set.
fn one() -> u32 {
    1
}
