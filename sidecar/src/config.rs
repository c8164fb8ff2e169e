//! The sidecar's configuration: a TOML file, then `KVGATE_*` environment overrides.
//!
//! ```toml
//! listen = "127.0.0.1:9911"        # loopback by default: only the local Envoy may call us
//! allow_non_loopback_api = false    # must be true for any other listen address
//! request_expiry_secs = 300         # bookings whose end is never reported are dropped after this
//! stall_timeout_secs = 30           # no events while blocks are expected: no cache credit
//!
//! [scoring]                         # see score::ScoringConfig; Dynamo's cost, with kvgate's
//! prefill_load_scale = 4.0          # defaults (Dynamo's: 1.0) and duplicate_penalty = 4.0
//!
//! [[pools]]
//! model = "qwen3"                   # the OpenAI `model` field
//! policy = "kv_aware"               # or least_load, round_robin, consistent_hash
//! tokenizer = "models/qwen3-0.6b"   # dir with tokenizer.json (+ tokenizer_config.json),
//!                                   # relative to this file
//! block_size = 16                   # must equal the engines' --block-size
//!
//! [[pools.replicas]]
//! id = "a"
//! endpoint = "10.0.0.5:8000"        # ip:port as Envoy's cluster knows the host
//! kv_events = "tcp://10.0.0.5:5557" # the engine's KV-events PUB socket
//! kv_replay = "tcp://10.0.0.5:5558" # optional: its replay ROUTER (closes gaps)
//! kv_events_mode = "connect"        # or "bind" when the engine connects to us
//! kv_events_topic = ""              # topic prefix filter
//! ```

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use kvgate_shared::prompt::content_format::ContentFormat;
use kvgate_shared::prompt::PromptError;
use kvgate_shared::wire::ModelBundle;
use serde::Deserialize;

use crate::score::ScoringConfig;

/// The whole sidecar configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Where the HTTP API listens. Default `127.0.0.1:9911`. Anything but a loopback address
    /// needs `allow_non_loopback_api`.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// Lets `listen` be a non-loopback address. Whoever reaches the API can book load on any
    /// replica, post lifecycle reports, read every routing decision (`/debug/explain`) and
    /// fetch the tokenizers: only turn this on behind a network policy that admits the
    /// gateway alone.
    #[serde(default)]
    pub allow_non_loopback_api: bool,
    /// Optional second listener serving only `GET /metrics` and `GET /healthz`, for
    /// Prometheus and the kubelet (which cannot reach loopback), e.g. `0.0.0.0:9912`.
    /// Nothing on it can change or steer routing.
    #[serde(default)]
    pub metrics_listen: Option<SocketAddr>,
    /// Seconds after which a booking with no reported end is released. Default 300 (Dynamo's).
    #[serde(default = "default_expiry")]
    pub request_expiry_secs: u64,
    /// Seconds a replica may go without any KV event while requests that must create blocks
    /// are routed to it; past that its publisher counts as stalled and its blocks earn no
    /// credit (routing on load continues). Default 30.
    #[serde(default = "default_stall")]
    pub stall_timeout_secs: u64,
    /// Cost-function knobs.
    #[serde(default)]
    pub scoring: ScoringConfig,
    /// Honour per-request `x-kvgate-scoring` overrides (credit, prefill scale, temperature).
    /// Off by default: clients should not tune the fleet's routing.
    #[serde(default)]
    pub allow_request_overrides: bool,
    /// One pool per model.
    pub pools: Vec<PoolConfig>,
    /// Share bookings with the sidecars of the other gateway pods (off when absent).
    #[serde(default)]
    pub sync: Option<SyncConfig>,
}

/// Several gateways: where this sidecar publishes its bookings and whose it reads
/// (see [`crate::sync`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyncConfig {
    /// This sidecar's id in the mesh (default: the pod's `HOSTNAME`).
    #[serde(default)]
    pub id: Option<String>,
    /// The ZMQ endpoint to publish on, e.g. `tcp://0.0.0.0:9913`.
    pub listen: String,
    /// Peers' endpoints, e.g. `tcp://10.0.0.12:9913`.
    #[serde(default)]
    pub peers: Vec<String>,
    /// A name whose addresses are the peers (a headless Service over the gateway pods),
    /// dialled on the `listen` port and re-resolved every 5 s.
    #[serde(default)]
    pub peers_dns: Option<String>,
    /// How long a starting sidecar waits for a peer to hand its view over (on the port after
    /// the sync port) before it rebuilds the index from the engines instead (default 5000;
    /// peers that do not accept connections are not waited for).
    #[serde(default = "default_handover_timeout_ms")]
    pub handover_timeout_ms: u64,
}

fn default_handover_timeout_ms() -> u64 {
    5_000
}

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
    /// `prefix_affinity`, and `kv_aware`'s in-flight credit: distinct blocks remembered, least
    /// recently routed dropped first (default 262144, about 25 MiB). With the sync mesh the
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
    /// Where the replicas come from (default: the `replicas` below, reloaded with the file).
    #[serde(default)]
    pub discovery: DiscoveryConfig,
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
    /// The replicas (static discovery).
    #[serde(default)]
    pub replicas: Vec<ReplicaConfig>,
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

/// When a replica counts as saturated, from kvgate's own books, and how long requests may
/// wait for one that is not ([`crate::admission`]).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Turns admission control on for the pool.
    #[serde(default)]
    pub enabled: bool,
    /// Each replica's KV cache capacity in blocks (vLLM logs it at start-up, "GPU KV cache
    /// size", and exports it as `num_gpu_blocks` in `vllm:cache_config_info`). 0: learned from
    /// that metric when `engine_metrics_secs` polls the engines, else not a criterion.
    #[serde(default)]
    pub kv_blocks: u64,
    /// A replica is saturated once the blocks booked on it reach this share of `kv_blocks`.
    #[serde(default = "default_kv_fraction")]
    pub kv_fraction: f64,
    /// A replica is saturated once the prefill tokens booked on it (uncached, not yet
    /// computed; with `engine_metrics_secs`, plus the mean booked prefill for each outside
    /// request its engine reports waiting) reach this. 0: not a criterion.
    #[serde(default)]
    pub max_prefill_tokens: u64,
    /// Also trust what the engines say (needs `engine_metrics_secs`): a replica is saturated
    /// while its engine reports `vllm:kv_cache_usage_perc` ≥ `kv_fraction`, or at least
    /// `max_engine_waiting` requests waiting. Those figures are as old as the last poll.
    #[serde(default)]
    pub engine_signals: bool,
    /// With `engine_signals`: waiting requests an engine may report before it counts as
    /// saturated (0: not a criterion).
    #[serde(default)]
    pub max_engine_waiting: u64,
    /// The longest a request waits for capacity before it is shed (the filter's
    /// `admission_wait_ms` bounds it too).
    #[serde(default = "default_max_queue_ms")]
    pub max_queue_ms: u64,
    /// The most requests of a class that wait at once (each class has its own count); one
    /// more is shed at once.
    #[serde(default = "default_max_queued")]
    pub max_queued: usize,
    /// The `Retry-After` a shed request is answered with, in seconds.
    #[serde(default = "default_retry_after")]
    pub retry_after_secs: u32,
    /// Priority classes. A request names its class in the filter's `priority_header` (a
    /// header the operator's own auth filter sets); waiters of a higher `priority` go first,
    /// and each class has its own bounds. None: one class with the bounds above.
    #[serde(default)]
    pub classes: Vec<ClassConfig>,
    /// The class of a request that names none, or an unknown one (default: the lowest).
    #[serde(default)]
    pub default_class: Option<String>,
    /// Fairness between tenants (requests that name one, with the filter's `tenant_header`):
    /// a tenant holding less than its fair share of its class's requests in flight (the
    /// class's requests split evenly over its tenants, at this gateway) goes past its class's
    /// limits by this share of what they leave: a KV fraction `f` becomes `f + h × (1 − f)`, a
    /// prefill backlog `p` becomes `p × (1 + h)`. So a quiet tenant is not held behind a
    /// bursting one's backlog. 0: tenants only take turns in the queue.
    #[serde(default = "default_fair_headroom")]
    pub fair_headroom: f64,
}

/// One priority class of admission control.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassConfig {
    /// The name requests give in the priority header.
    pub name: String,
    /// Higher goes first.
    #[serde(default)]
    pub priority: i32,
    /// The longest a request of this class waits (default: the pool's `max_queue_ms`).
    #[serde(default)]
    pub max_queue_ms: Option<u64>,
    /// The most requests of this class that wait at once (default: the pool's `max_queued`).
    #[serde(default)]
    pub max_queued: Option<usize>,
    /// The share of a replica's KV cache this class may fill (default: the pool's
    /// `kv_fraction`). A lower share for lower classes keeps headroom for higher ones: a batch
    /// request waits at 70 % while an interactive one still routes until 90 %.
    #[serde(default)]
    pub kv_fraction: Option<f64>,
    /// The prefill backlog this class may add to (default: the pool's `max_prefill_tokens`).
    #[serde(default)]
    pub max_prefill_tokens: Option<u64>,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            enabled: false,
            kv_blocks: 0,
            kv_fraction: default_kv_fraction(),
            max_prefill_tokens: 0,
            engine_signals: false,
            max_engine_waiting: 0,
            max_queue_ms: default_max_queue_ms(),
            max_queued: default_max_queued(),
            retry_after_secs: default_retry_after(),
            classes: Vec::new(),
            default_class: None,
            fair_headroom: default_fair_headroom(),
        }
    }
}

impl AdmissionConfig {
    fn validate(&self, model: &str, engine_metrics_secs: u64) -> anyhow::Result<()> {
        if !self.enabled {
            return Ok(());
        }
        let polled = engine_metrics_secs > 0;
        if self.engine_signals && !polled {
            bail!("pool {model:?}: admission.engine_signals needs engine_metrics_secs > 0 to read the engines");
        }
        if self.kv_blocks == 0 && self.max_prefill_tokens == 0 && !polled {
            bail!(
                "pool {model:?}: admission needs kv_blocks or max_prefill_tokens, or engine_metrics_secs to learn \
                 each engine's KV capacity, to tell when a replica is saturated"
            );
        }
        if !(self.kv_fraction > 0.0 && self.kv_fraction <= 1.0) {
            bail!("pool {model:?}: admission.kv_fraction must be in (0, 1], got {}", self.kv_fraction);
        }
        if !(0.0..=1.0).contains(&self.fair_headroom) {
            bail!("pool {model:?}: admission.fair_headroom must be in [0, 1], got {}", self.fair_headroom);
        }
        if let Some(c) = self.classes.iter().find(|c| c.kv_fraction.is_some_and(|f| !(f > 0.0 && f <= 1.0))) {
            bail!("pool {model:?}: admission class {:?}: kv_fraction must be in (0, 1]", c.name);
        }
        let mut names: Vec<&str> = self.classes.iter().map(|c| c.name.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            bail!("pool {model:?}: admission class {:?} is defined twice", w[0]);
        }
        if let Some(default) = &self.default_class {
            if !names.contains(&default.as_str()) {
                bail!("pool {model:?}: admission.default_class {default:?} is not one of the classes {names:?}");
            }
        }
        Ok(())
    }
}

fn default_fair_headroom() -> f64 {
    0.5
}

fn default_kv_fraction() -> f64 {
    0.9
}

fn default_max_queue_ms() -> u64 {
    2000
}

fn default_max_queued() -> usize {
    256
}

fn default_retry_after() -> u32 {
    1
}

/// How a pool finds its replicas.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// `static` (default), `dns` or `envoy`.
    #[serde(default)]
    pub kind: DiscoveryKind,
    /// `dns`: the name to resolve (a headless Service: one A/AAAA record per ready pod);
    /// `envoy`: the Envoy cluster whose healthy hosts are the replicas.
    #[serde(default)]
    pub name: String,
    /// `dns`: the engines' HTTP port (the port Envoy's cluster has for them).
    #[serde(default)]
    pub port: u16,
    /// `envoy`: the admin address of the Envoy in this pod (Istio's is `127.0.0.1:15000`).
    #[serde(default = "default_admin")]
    pub admin: String,
    /// The KV-events endpoint of a discovered replica, with `{ip}` filled in, e.g.
    /// `tcp://{ip}:5557` (pods); `{port}`, `{port+N}` and `{port-N}` give a port relative to
    /// its HTTP port (several engines per host, e.g. `tcp://{ip}:{port-2443}`).
    #[serde(default)]
    pub kv_events: String,
    /// Its replay endpoint, e.g. `tcp://{ip}:5558`.
    #[serde(default)]
    pub kv_replay: Option<String>,
    /// Topic prefix filter.
    #[serde(default)]
    pub kv_events_topic: String,
    /// How often to look again (`dns`, `envoy`), or to check the file for changes (`static`).
    #[serde(default = "default_discovery_interval")]
    pub interval_secs: u64,
    /// Data-parallel ranks of every discovered engine (see [`ReplicaConfig::data_parallel_size`]).
    #[serde(default = "one")]
    pub data_parallel_size: u32,
    /// A disaggregated pool's prefill workers: a second name (`dns`) or cluster (`envoy`),
    /// found the same way; `name`'s engines are then its decode workers.
    #[serde(default)]
    pub prefill_name: Option<String>,
    /// SGLang's bootstrap port of every discovered prefill worker (`sglang` mode).
    #[serde(default)]
    pub bootstrap_port: Option<u16>,
}

/// A discovery source.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DiscoveryKind {
    /// The config file's `replicas`, reloaded when the file changes or on SIGHUP.
    #[default]
    Static,
    /// A DNS name's addresses.
    Dns,
    /// The healthy hosts of a cluster of the local Envoy (its admin `/clusters`).
    Envoy,
}

impl DiscoveryKind {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            DiscoveryKind::Static => "static",
            DiscoveryKind::Dns => "dns",
            DiscoveryKind::Envoy => "envoy",
        }
    }
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        DiscoveryConfig {
            kind: DiscoveryKind::Static,
            name: String::new(),
            port: 0,
            admin: default_admin(),
            kv_events: String::new(),
            kv_replay: None,
            kv_events_topic: String::new(),
            interval_secs: default_discovery_interval(),
            data_parallel_size: 1,
            prefill_name: None,
            bootstrap_port: None,
        }
    }
}

impl DiscoveryConfig {
    /// The replicas found at `name` and, in a disaggregated pool, at `prefill_name`
    /// (`prefill` those, `decode` the others); an address found at both is a prefill worker.
    pub fn replicas(&self, found: Vec<SocketAddr>, prefill: Vec<SocketAddr>) -> Vec<ReplicaConfig> {
        let main = if self.prefill_name.is_some() { Role::Decode } else { Role::Both };
        let mut by_addr = std::collections::BTreeMap::new();
        by_addr.extend(found.into_iter().map(|a| (a, main)));
        by_addr.extend(prefill.into_iter().map(|a| (a, Role::Prefill)));
        by_addr
            .into_iter()
            .map(|(addr, role)| ReplicaConfig {
                role,
                bootstrap_port: self.bootstrap_port.filter(|_| role == Role::Prefill),
                ..self.replica(addr)
            })
            .collect()
    }

    /// The replica at `addr` (its HTTP address): id and endpoint `ip:port`, event endpoints
    /// from the templates.
    pub fn replica(&self, addr: SocketAddr) -> ReplicaConfig {
        let ip = match addr.ip() {
            std::net::IpAddr::V4(ip) => ip.to_string(),
            std::net::IpAddr::V6(ip) => format!("[{ip}]"),
        };
        let fill = |t: &str| fill_ports(&t.replace("{ip}", &ip), addr.port());
        ReplicaConfig {
            id: addr.to_string(),
            endpoint: addr,
            kv_events: fill(&self.kv_events),
            kv_events_mode: EventsMode::Connect,
            kv_events_topic: self.kv_events_topic.clone(),
            kv_replay: self.kv_replay.as_deref().map(fill),
            data_parallel_size: self.data_parallel_size,
            role: Role::Both,
            bootstrap_port: None,
        }
    }
}

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
            discovery: DiscoveryConfig::default(),
            adapters: Vec::new(),
            adapters_poll_secs: default_adapters_poll(),
            admission: AdmissionConfig::default(),
            disaggregation: None,
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

    /// Roles only with disaggregation; with it, workers for both legs (listed, or a discovered
    /// `prefill_name`) and, in `sglang` mode, prefill servers' bootstrap port.
    fn check_roles(&self) -> anyhow::Result<()> {
        let Some(d) = &self.disaggregation else {
            if let Some(r) = self.replicas.iter().find(|r| r.role != Role::Both) {
                bail!("pool {:?}: replica {:?} has a role but the pool has no disaggregation", self.model, r.id);
            }
            if self.discovery.prefill_name.is_some() {
                bail!("pool {:?}: discovery.prefill_name but the pool has no disaggregation", self.model);
            }
            return Ok(());
        };
        let discovered = self.discovery.kind != DiscoveryKind::Static;
        if discovered && self.discovery.prefill_name.is_none() {
            bail!("pool {:?}: a discovered disaggregated pool needs discovery.prefill_name", self.model);
        }
        if discovered && d.mode == TransferProtocol::Sglang && self.discovery.bootstrap_port.is_none() {
            bail!("pool {:?}: discovery.bootstrap_port is needed in sglang mode", self.model);
        }
        if self.policy == Policy::PrefixAffinity {
            bail!(
                "pool {:?}: disaggregation chooses prefill workers by their KV events; prefix_affinity reads none",
                self.model
            );
        }
        let prefills = |r: &&ReplicaConfig| match d.mode {
            TransferProtocol::Vllm => r.role.prefills(),
            // An SGLang server in neither disaggregation mode ignores a bootstrap room.
            TransferProtocol::Sglang => r.role == Role::Prefill,
        };
        let both = self.replicas.iter().any(|r| prefills(&r)) && self.replicas.iter().any(|r| r.role.decodes());
        if !discovered && !both {
            bail!("pool {:?}: disaggregation needs replicas for prefill and for decode", self.model);
        }
        if d.mode == TransferProtocol::Sglang {
            if let Some(r) = self.replicas.iter().find(|r| r.role == Role::Prefill && r.bootstrap_port.is_none()) {
                bail!("pool {:?}: prefill replica {:?} has no bootstrap_port (sglang mode)", self.model, r.id);
            }
        }
        Ok(())
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

/// Replaces `{port}`, `{port+N}` and `{port-N}` with `port` (plus or minus N). A placeholder
/// that does not parse, or a result outside 0..=65535, is left as written (the endpoint is then
/// invalid and ZMQ says so).
fn fill_ports(template: &str, port: u16) -> String {
    let mut out = String::new();
    let mut rest = template;
    while let Some(at) = rest.find("{port") {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        let Some(end) = rest.find('}') else { break };
        let spec = &rest["{port".len()..end];
        let offset = match spec.as_bytes().first() {
            None => Some(0),
            Some(b'+') => spec[1..].parse::<i64>().ok(),
            Some(b'-') => spec[1..].parse::<i64>().ok().map(|n| -n),
            _ => None,
        };
        match offset.map(|o| i64::from(port) + o).filter(|p| (0..=65535).contains(p)) {
            Some(p) => out.push_str(&p.to_string()),
            None => out.push_str(&rest[..=end]),
        }
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    out
}

fn one() -> u32 {
    1
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

fn default_admin() -> String {
    "http://127.0.0.1:15000".into()
}

fn default_discovery_interval() -> u64 {
    5
}

fn default_listen() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9911))
}

fn default_expiry() -> u64 {
    300
}

fn default_stall() -> u64 {
    30
}

/// A source of environment variables (so tests need not touch the process environment).
pub trait Env {
    /// The variable's value, if set.
    fn var(&self, key: &str) -> Option<String>;
}

/// The process environment.
pub struct ProcessEnv;

impl Env for ProcessEnv {
    fn var(&self, key: &str) -> Option<String> {
        std::env::var(key).ok()
    }
}

impl Config {
    /// Loads `path`, resolves relative tokenizer paths against its directory, applies
    /// environment overrides and validates.
    pub fn load(path: &Path, env: &dyn Env) -> anyhow::Result<Config> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut config: Config = toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let base = path.parent().unwrap_or(Path::new("."));
        for pool in &mut config.pools {
            if pool.tokenizer.is_relative() {
                pool.tokenizer = base.join(&pool.tokenizer);
            }
        }
        config.apply_env(env)?;
        config.validate()?;
        Ok(config)
    }

    /// `KVGATE_LISTEN` and the scoring knobs, under kvgate's names or Dynamo's.
    fn apply_env(&mut self, env: &dyn Env) -> anyhow::Result<()> {
        if let Some(v) = env.var("KVGATE_LISTEN") {
            self.listen = v.parse().with_context(|| format!("KVGATE_LISTEN={v}"))?;
        }
        if let Some(v) = env.var("KVGATE_METRICS_LISTEN") {
            self.metrics_listen = Some(v.parse().with_context(|| format!("KVGATE_METRICS_LISTEN={v}"))?);
        }
        let s = &mut self.scoring;
        // kvgate's name, then Dynamo's for the knobs that are Dynamo's.
        let knobs: [(&str, Option<&str>, &mut f64); 8] = [
            ("KVGATE_PREFILL_LOAD_SCALE", Some("DYN_ROUTER_PREFILL_LOAD_SCALE"), &mut s.prefill_load_scale),
            ("KVGATE_KV_OVERLAP_CREDIT", Some("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT"), &mut s.kv_overlap_credit),
            (
                "KVGATE_KV_OVERLAP_CREDIT_DECAY",
                Some("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY"),
                &mut s.kv_overlap_credit_decay,
            ),
            (
                "KVGATE_ACTIVE_REQUEST_WEIGHT",
                Some("DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT"),
                &mut s.active_request_weight,
            ),
            ("KVGATE_HOST_CACHE_HIT_WEIGHT", Some("DYN_ROUTER_HOST_CACHE_HIT_WEIGHT"), &mut s.host_cache_hit_weight),
            ("KVGATE_DISK_CACHE_HIT_WEIGHT", Some("DYN_ROUTER_DISK_CACHE_HIT_WEIGHT"), &mut s.disk_cache_hit_weight),
            ("KVGATE_TEMPERATURE", Some("DYN_ROUTER_TEMPERATURE"), &mut s.temperature),
            ("KVGATE_DUPLICATE_PENALTY", None, &mut s.duplicate_penalty),
        ];
        for (ours, dynamo, slot) in knobs {
            let found = env.var(ours).map(|v| (ours, v)).or_else(|| dynamo.and_then(|d| env.var(d).map(|v| (d, v))));
            if let Some((key, v)) = found {
                *slot = v.parse().with_context(|| format!("{key}={v}"))?;
            }
        }
        Ok(())
    }

    /// Rejects configurations that cannot route correctly.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.pools.is_empty() {
            bail!("no pools configured");
        }
        if self.metrics_listen == Some(self.listen) {
            bail!("metrics_listen must differ from listen");
        }
        if !self.listen.ip().is_loopback() && !self.allow_non_loopback_api {
            bail!(
                "listen = {} is not a loopback address: the API steers routing, so it is meant for the local Envoy only; set allow_non_loopback_api = true to expose it anyway",
                self.listen
            );
        }
        for pool in &self.pools {
            pool.check_tokenizer_mode()?;
            pool.admission.validate(&pool.model, pool.engine_metrics_secs)?;
        }
        if let Some(sync) = &self.sync {
            for e in std::iter::once(&sync.listen).chain(&sync.peers) {
                if !e.starts_with("tcp://") {
                    bail!("sync endpoints must be tcp://, got {e:?}");
                }
            }
            if sync.peers.is_empty() && sync.peers_dns.is_none() {
                bail!("sync needs peers or peers_dns");
            }
            // The handover to starting peers listens on the sync port + 1.
            let port = sync.listen.rsplit_once(':').and_then(|(_, p)| p.parse::<u16>().ok());
            let Some(handover) = port.and_then(|p| p.checked_add(1)) else {
                bail!("sync.listen {:?} needs a port below 65535 (the handover takes the next)", sync.listen);
            };
            let taken = std::iter::once(self.listen.port()).chain(self.metrics_listen.map(|m| m.port()));
            if let Some(p) = taken.into_iter().find(|p| *p == handover) {
                bail!("sync.listen's port + 1 ({p}) is where starting peers are handed this sidecar's view; listen and metrics_listen must not use it");
            }
        }
        let s = &self.scoring;
        for (name, v) in [
            ("prefill_load_scale", s.prefill_load_scale),
            ("kv_overlap_credit", s.kv_overlap_credit),
            ("kv_overlap_credit_decay", s.kv_overlap_credit_decay),
            ("active_request_weight", s.active_request_weight),
            ("host_cache_hit_weight", s.host_cache_hit_weight),
            ("disk_cache_hit_weight", s.disk_cache_hit_weight),
            ("temperature", s.temperature),
            ("duplicate_penalty", s.duplicate_penalty),
        ] {
            if !v.is_finite() || v < 0.0 {
                bail!("scoring.{name} must be a finite number >= 0, got {v}");
            }
        }
        let mut models = HashSet::new();
        for pool in &self.pools {
            for name in std::iter::once(&pool.model).chain(&pool.adapters) {
                if name.is_empty() || !models.insert(name.as_str()) {
                    bail!("model or adapter name {name:?} is empty or configured twice");
                }
            }
            if pool.block_size == 0 {
                bail!("pool {:?}: block_size must be positive", pool.model);
            }
            if !(pool.prefill_tokens_per_sec.is_finite() && pool.prefill_tokens_per_sec >= 1.0) {
                bail!("pool {:?}: prefill_tokens_per_sec must be at least 1", pool.model);
            }
            let d = &pool.discovery;
            match d.kind {
                DiscoveryKind::Static if pool.replicas.is_empty() => bail!("pool {:?}: no replicas", pool.model),
                DiscoveryKind::Static => {}
                kind => {
                    let kind = kind.label();
                    if !pool.replicas.is_empty() {
                        bail!("pool {:?}: replicas are listed but discovery.kind is {kind:?}", pool.model);
                    }
                    if d.name.is_empty() {
                        bail!("pool {:?}: discovery.name is required for {kind:?} discovery", pool.model);
                    }
                    if d.kind == DiscoveryKind::Dns && d.port == 0 {
                        bail!("pool {:?}: discovery.port (the engines' HTTP port) is required for dns", pool.model);
                    }
                    if d.kind == DiscoveryKind::Envoy && !d.admin.starts_with("http://") {
                        bail!("pool {:?}: discovery.admin must be an http:// URL, got {:?}", pool.model, d.admin);
                    }
                    let example = d.replica(SocketAddr::from(([10, 0, 0, 1], 8000)));
                    if pool.reads_events() && !d.kv_events.contains("{ip}") {
                        bail!(
                            "pool {:?}: discovery.kv_events must contain {{ip}}, e.g. \"tcp://{{ip}}:5557\"",
                            pool.model
                        );
                    }
                    if pool.reads_events() {
                        check_endpoints(&example)?;
                    }
                }
            }
            if d.interval_secs == 0 {
                bail!("pool {:?}: discovery.interval_secs must be positive", pool.model);
            }
            pool.check_roles()?;
            let mut ids = HashSet::new();
            let mut endpoints = HashSet::new();
            for r in &pool.replicas {
                if !ids.insert(r.id.as_str()) {
                    bail!("pool {:?}: replica id {:?} is used twice", pool.model, r.id);
                }
                if !endpoints.insert(r.endpoint) {
                    bail!("pool {:?}: endpoint {} is used twice", pool.model, r.endpoint);
                }
                if pool.reads_events() {
                    check_endpoints(r)?;
                }
            }
        }
        Ok(())
    }
}

/// Event endpoints must be ZMQ tcp:// or ipc:// addresses, and offsettable per rank for
/// data-parallel engines.
fn check_endpoints(r: &ReplicaConfig) -> anyhow::Result<()> {
    if !(1..=1024).contains(&r.data_parallel_size) {
        bail!("replica {:?}: data_parallel_size must be 1..=1024, got {}", r.id, r.data_parallel_size);
    }
    for endpoint in std::iter::once(&r.kv_events).chain(&r.kv_replay) {
        if r.data_parallel_size > 1 {
            kvgate_shared::endpoint::for_rank(endpoint, 1).with_context(|| format!("replica {:?}", r.id))?;
        }
    }
    for (key, endpoint) in [("kv_events", Some(&r.kv_events)), ("kv_replay", r.kv_replay.as_ref())] {
        if let Some(e) = endpoint {
            if !(e.starts_with("tcp://") || e.starts_with("ipc://")) {
                bail!("replica {:?}: {key} must be a tcp:// or ipc:// endpoint, got {e:?}", r.id);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct MapEnv(HashMap<&'static str, &'static str>);
    impl Env for MapEnv {
        fn var(&self, key: &str) -> Option<String> {
            self.0.get(key).map(|v| v.to_string())
        }
    }

    const BASE: &str = r#"
        [[pools]]
        model = "m"
        tokenizer = "tok"
        block_size = 16
        [[pools.replicas]]
        id = "a"
        endpoint = "127.0.0.1:8001"
        kv_events = "tcp://127.0.0.1:5557"
    "#;

    fn load(text: &str, env: &[(&'static str, &'static str)]) -> anyhow::Result<Config> {
        let dir = std::env::temp_dir().join(format!("kvgate-config-{}-{}", std::process::id(), rand::random::<u64>()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("kvgate.toml");
        std::fs::write(&path, text)?;
        let result = Config::load(&path, &MapEnv(env.iter().copied().collect()));
        std::fs::remove_dir_all(&dir)?;
        result
    }

    #[test]
    fn policy_names_are_the_configured_ones() {
        let all =
            [Policy::KvAware, Policy::LeastLoad, Policy::RoundRobin, Policy::ConsistentHash, Policy::PrefixAffinity];
        for p in all {
            let parsed: Policy = serde_json::from_value(serde_json::Value::from(p.name())).unwrap();
            assert_eq!(parsed, p, "{}", p.name());
        }
    }

    #[test]
    fn tokenizer_modes_kvgate_cannot_reproduce_are_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("kvgate-mode-{}-{}", std::process::id(), rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = |mode: Option<&str>| {
            let mode = mode.map(|m| format!("tokenizer_mode = {m:?}\n")).unwrap_or_default();
            BASE.replace("tokenizer = \"tok\"", &format!("tokenizer = {:?}\n{mode}", dir.display().to_string()))
        };
        assert!(load(&config(None), &[]).is_ok(), "an ordinary directory: auto is hf");
        let named = load(&config(Some("mistral")), &[]).unwrap_err().to_string();
        assert!(named.contains("\"mistral\"") && named.contains("tokenizer_mode = \"hf\""), "{named}");
        std::fs::write(dir.join("tekken.json"), "{}").unwrap();
        let auto = load(&config(None), &[]).unwrap_err().to_string();
        assert!(auto.contains("\"mistral\""), "auto picks mistral for a Mistral repository: {auto}");
        assert!(load(&config(Some("hf")), &[]).is_ok(), "engines run with --tokenizer-mode hf");
        std::fs::remove_file(dir.join("tekken.json")).unwrap();
        std::fs::write(dir.join("config.json"), r#"{"architectures": ["DeepseekV32ForCausalLM"]}"#).unwrap();
        assert!(load(&config(None), &[]).unwrap_err().to_string().contains("deepseek_v32"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn admission_needs_a_saturation_criterion() {
        let with = |keys: &str| BASE.replace("block_size = 16", &format!("block_size = 16\nadmission = {{ {keys} }}"));
        assert!(!load(BASE, &[]).unwrap().pools[0].admission.enabled, "off by default");
        let none = load(&with("enabled = true"), &[]).unwrap_err().to_string();
        assert!(none.contains("kv_blocks or max_prefill_tokens"), "{none}");
        assert!(
            load(&with("enabled = true, engine_signals = true, kv_blocks = 1"), &[]).is_err(),
            "signals need polling"
        );
        let learned =
            BASE.replace("block_size = 16", "block_size = 16\nengine_metrics_secs = 1\nadmission = { enabled = true }");
        assert!(load(&learned, &[]).is_ok(), "capacity learned from the engines");
        assert!(load(&with("enabled = true, kv_blocks = 100, kv_fraction = 1.5"), &[]).is_err());
        assert!(load(&with("enabled = true, kv_blocks = 100, fair_headroom = -0.1"), &[]).is_err());
        let ok = load(&with("enabled = true, kv_blocks = 100"), &[]).unwrap();
        let a = &ok.pools[0].admission;
        assert_eq!((a.kv_fraction, a.max_queue_ms, a.max_queued, a.retry_after_secs), (0.9, 2000, 256, 1));
        assert_eq!(a.fair_headroom, 0.5);
    }

    #[test]
    fn defaults_are_loopback_and_dynamos() {
        let c = load(BASE, &[]).unwrap();
        assert_eq!(c.listen, "127.0.0.1:9911".parse().unwrap());
        assert_eq!(c.scoring, ScoringConfig::default());
        assert!(c.pools[0].tokenizer.ends_with("tok"));
        assert_ne!(c.pools[0].tokenizer, PathBuf::from("tok"), "resolved against the config's directory");
    }

    #[test]
    fn a_non_loopback_api_needs_the_explicit_flag() {
        let open = BASE.replace("[[pools]]", "listen = \"0.0.0.0:9911\"\n\n[[pools]]");
        let err = load(&open, &[]).unwrap_err().to_string();
        assert!(err.contains("allow_non_loopback_api"), "{err}");
        assert!(load(&BASE.replace("[[pools]]", "allow_non_loopback_api = true\n\n[[pools]]"), &[]).is_ok());
        let allowed = open.replace("[[pools]]", "allow_non_loopback_api = true\n\n[[pools]]");
        assert_eq!(load(&allowed, &[]).unwrap().listen, "0.0.0.0:9911".parse().unwrap());
        assert!(load(BASE, &[("KVGATE_LISTEN", "10.0.0.1:9911")]).is_err(), "the environment too");
        assert!(load(&BASE.replace("[[pools]]", "listen = \"[::1]:9911\"\n\n[[pools]]"), &[]).is_ok());
    }

    #[test]
    fn constructors_match_a_minimal_toml() {
        let c = load(BASE, &[]).unwrap();
        let replica = ReplicaConfig::new("a", "127.0.0.1:8001".parse().unwrap(), "tcp://127.0.0.1:5557");
        assert_eq!(c.pools[0], PoolConfig::new("m", c.pools[0].tokenizer.clone(), 16, vec![replica]));
    }

    #[test]
    fn env_overrides_with_both_names() {
        let c = load(
            BASE,
            &[
                ("KVGATE_LISTEN", "127.0.0.1:1"),
                ("DYN_ROUTER_PREFILL_LOAD_SCALE", "2.5"),
                ("KVGATE_ACTIVE_REQUEST_WEIGHT", "1"),
            ],
        )
        .unwrap();
        assert_eq!(c.listen.port(), 1);
        assert_eq!((c.scoring.prefill_load_scale, c.scoring.active_request_weight), (2.5, 1.0));
        let ours_wins =
            load(BASE, &[("KVGATE_PREFILL_LOAD_SCALE", "3"), ("DYN_ROUTER_PREFILL_LOAD_SCALE", "2")]).unwrap();
        assert_eq!(ours_wins.scoring.prefill_load_scale, 3.0);
        let penalty = load(BASE, &[("KVGATE_DUPLICATE_PENALTY", "0")]).unwrap();
        assert_eq!(penalty.scoring.duplicate_penalty, 0.0);
        assert!(load(BASE, &[("KVGATE_DUPLICATE_PENALTY", "-1")]).is_err(), "negative values are refused");
        assert!(load(BASE, &[("KVGATE_KV_OVERLAP_CREDIT", "x")]).is_err());
        assert!(load(BASE, &[("KVGATE_KV_OVERLAP_CREDIT", "-1")]).is_err());
    }

    #[test]
    fn shipped_example_is_valid() {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("kvgate.example.toml");
        let c = Config::load(&path, &MapEnv(HashMap::new())).unwrap();
        assert_eq!(c.pools[0].replicas.len(), 2);
        assert!(c.pools[0].tokenizer.join("tokenizer.json").exists(), "the example points at the vendored model");
    }

    #[test]
    fn invalid_configs_are_rejected() {
        assert!(load("pools = []", &[]).is_err());
        assert!(load(&BASE.replace("block_size = 16", "block_size = 0"), &[]).is_err());
        assert!(load(
            &format!(
                "{BASE}\n[[pools.replicas]]\nid = \"a\"\nendpoint = \"127.0.0.1:8002\"\nkv_events = \"tcp://x:1\""
            ),
            &[]
        )
        .is_err());
        assert!(load(&BASE.replace("tcp://", "http://"), &[]).is_err());
        assert!(load(&format!("bogus = 1\n{BASE}"), &[]).is_err(), "unknown keys are errors");
        assert!(
            load(&BASE.replace("block_size = 16", "block_size = 16\nadapters = [\"m\"]"), &[]).is_err(),
            "adapter named like a model"
        );
        assert!(load(&BASE.replace("block_size = 16", "block_size = 16\nadapters = [\"a\", \"a\"]"), &[]).is_err());
        assert!(load(&BASE.replace("block_size = 16", "block_size = 16\nadapters = [\"a\"]"), &[]).is_ok());
        assert!(load(&BASE.replace("127.0.0.1:8001", "not-an-address"), &[]).is_err());
        let dp = |n: u32, events: &str| {
            BASE.replace(
                "kv_events = \"tcp://127.0.0.1:5557\"",
                &format!("kv_events = \"{events}\"\ndata_parallel_size = {n}"),
            )
        };
        assert!(load(&dp(4, "tcp://127.0.0.1:5557"), &[]).is_ok());
        assert!(load(&dp(2, "ipc:///tmp/kv"), &[]).is_err(), "ipc endpoints cannot be offset per rank");
        assert!(load(&dp(0, "tcp://127.0.0.1:5557"), &[]).is_err());
    }

    const DNS: &str = r#"
        [[pools]]
        model = "m"
        tokenizer = "tok"
        block_size = 16
        [pools.discovery]
        kind = "dns"
        name = "vllm.llm.svc.cluster.local"
        port = 8000
        kv_events = "tcp://{ip}:5557"
        kv_replay = "tcp://{ip}:5558"
    "#;

    #[test]
    fn sync_needs_tcp_endpoints_and_peers() {
        let with = |sync: &str| load(&format!("{sync}\n{BASE}"), &[]);
        let ok = with("[sync]\nlisten = \"tcp://0.0.0.0:9913\"\npeers_dns = \"gw.ns.svc.cluster.local\"").unwrap();
        assert_eq!(ok.sync.unwrap().peers_dns.as_deref(), Some("gw.ns.svc.cluster.local"));
        assert!(with("[sync]\nlisten = \"tcp://0.0.0.0:9913\"").is_err(), "no peers");
        assert!(with("[sync]\nlisten = \"ipc:///x\"\npeers = [\"tcp://a:1\"]").is_err());
        assert!(load(BASE, &[]).unwrap().sync.is_none(), "off by default");
        let clash = load(&format!("metrics_listen = \"0.0.0.0:9914\"\n[sync]\nlisten = \"tcp://0.0.0.0:9913\"\npeers = [\"tcp://a:1\"]\n{BASE}"), &[]);
        assert!(clash.unwrap_err().to_string().contains("port + 1"), "the handover's port is taken");
    }

    #[test]
    fn disaggregated_pools_need_both_roles_and_sglang_bootstrap_ports() {
        let pd = |mode: &str, prefill: &str| {
            format!(
                r#"
                [[pools]]
                model = "m"
                tokenizer = "tok"
                block_size = 16
                disaggregation = {{ mode = "{mode}" }}
                [[pools.replicas]]
                id = "p"
                endpoint = "127.0.0.1:8001"
                kv_events = "tcp://127.0.0.1:5557"
                {prefill}
                [[pools.replicas]]
                id = "d"
                endpoint = "127.0.0.1:8002"
                kv_events = "tcp://127.0.0.1:5567"
                role = "decode"
                "#
            )
        };
        let c = load(&pd("vllm", "role = \"prefill\""), &[]).unwrap();
        let d = c.pools[0].disaggregation.as_ref().unwrap();
        assert_eq!(
            (d.mode, d.min_remote_prefill_tokens, d.max_prefill_backlog_tokens),
            (TransferProtocol::Vllm, 256, None)
        );
        assert_eq!(c.pools[0].replicas[0].role, Role::Prefill);
        assert!(load(&pd("sglang", "role = \"prefill\""), &[]).is_err(), "no bootstrap port");
        assert!(load(&pd("sglang", "role = \"prefill\"\nbootstrap_port = 8998"), &[]).is_ok());
        assert!(load(&pd("vllm", "role = \"decode\""), &[]).is_err(), "nothing prefills");
        assert!(load(&pd("vllm", ""), &[]).is_ok(), "`both` takes vLLM's prefill legs too");
        assert!(load(&pd("sglang", ""), &[]).is_err(), "an SGLang server in neither mode takes no leg");
        assert!(load(&pd("nixl", "role = \"prefill\""), &[]).is_err());
        let roles_alone = BASE
            .replace("kv_events = \"tcp://127.0.0.1:5557\"", "kv_events = \"tcp://127.0.0.1:5557\"\nrole = \"decode\"");
        assert!(load(&roles_alone, &[]).is_err(), "a role without disaggregation");
        let discovered = DNS.replace("block_size = 16", "block_size = 16\ndisaggregation = { mode = \"vllm\" }");
        assert!(load(&discovered, &[]).is_err(), "no prefill_name: every engine one role");
        let replay = "kv_replay = \"tcp://{ip}:5558\"";
        let named = discovered.replace(replay, &format!("{replay}\nprefill_name = \"prefill.llm.svc\""));
        let c = load(&named, &[]).unwrap();
        let d = &c.pools[0].discovery;
        let addr = |s: &str| s.parse::<SocketAddr>().unwrap();
        let found = d.replicas(vec![addr("10.0.0.1:8000"), addr("10.0.0.2:8000")], vec![addr("10.0.0.2:8000")]);
        let roles: Vec<(String, Role)> = found.into_iter().map(|r| (r.id, r.role)).collect();
        assert_eq!(roles, [("10.0.0.1:8000".into(), Role::Decode), ("10.0.0.2:8000".into(), Role::Prefill)]);
        assert!(load(&named.replace("\"vllm\"", "\"sglang\""), &[]).is_err(), "sglang needs the bootstrap port");
        assert!(
            load(&DNS.replace(replay, &format!("{replay}\nprefill_name = \"p\"")), &[]).is_err(),
            "no disaggregation"
        );
    }

    #[test]
    fn prefix_affinity_pools_need_no_event_endpoints() {
        let no_events = BASE.replace("kv_events = \"tcp://127.0.0.1:5557\"", "");
        assert!(load(&no_events, &[]).is_err(), "kv_aware reads events");
        let affinity = no_events.replace("block_size = 16", "block_size = 16\npolicy = \"prefix_affinity\"");
        let c = load(&affinity, &[]).unwrap();
        assert!(!c.pools[0].reads_events());
        assert_eq!((c.pools[0].affinity_ttl_secs, c.pools[0].affinity_blocks), (120, 1 << 18));
    }

    #[test]
    fn event_endpoints_can_be_relative_to_the_http_port() {
        let d = DiscoveryConfig {
            kv_events: "tcp://{ip}:{port+1}".into(),
            kv_replay: Some("tcp://{ip}:{port-2443}".into()),
            ..DiscoveryConfig::default()
        };
        let r = d.replica("10.1.2.3:8000".parse().unwrap());
        assert_eq!(
            (r.kv_events.as_str(), r.kv_replay.as_deref()),
            ("tcp://10.1.2.3:8001", Some("tcp://10.1.2.3:5557"))
        );
        assert_eq!(fill_ports("{port}/{port+x}/{port-9000}/{port", 8000), "8000/{port+x}/{port-9000}/{port");
    }

    #[test]
    fn discovered_pools_need_a_name_port_and_templates() {
        let c = load(DNS, &[]).unwrap();
        let d = &c.pools[0].discovery;
        assert_eq!((d.kind, d.interval_secs, d.admin.as_str()), (DiscoveryKind::Dns, 5, "http://127.0.0.1:15000"));
        let envoy = DNS.replace("\"dns\"", "\"envoy\"").replace("port = 8000", "admin = \"http://127.0.0.1:9901\"");
        assert_eq!(load(&envoy, &[]).unwrap().pools[0].discovery.kind, DiscoveryKind::Envoy);
        for (broken, why) in [
            (DNS.replace("name = \"vllm.llm.svc.cluster.local\"", ""), "no name"),
            (DNS.replace("port = 8000", ""), "no port"),
            (DNS.replace("tcp://{ip}:5557", "tcp://10.0.0.1:5557"), "events without {ip}"),
            (DNS.replace("tcp://{ip}:5558", "http://{ip}:5558"), "not a ZMQ endpoint"),
            (DNS.replace("kind = \"dns\"", "kind = \"dns\"\ninterval_secs = 0"), "zero interval"),
            (DNS.replace("kind = \"dns\"", "kind = \"consul\""), "unknown kind"),
            (envoy.replace("http://127.0.0.1:9901", "127.0.0.1:9901"), "admin without http://"),
            (
                format!("{DNS}\n[[pools.replicas]]\nid = \"a\"\nendpoint = \"127.0.0.1:1\"\nkv_events = \"tcp://x:1\""),
                "replicas and dns",
            ),
        ] {
            assert!(load(&broken, &[]).is_err(), "{why} must be rejected");
        }
    }
}
