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
//!
//! Each section is owned by the module it configures, beside its code; this file keeps the
//! file as a whole — loading, `KVGATE_*` overrides, and the checks that span sections — and
//! sits above every module whose section it reads.
//!
//! | section | type | owner |
//! |---|---|---|
//! | top level | [`Config`] | here |
//! | `[scoring]` | `ScoringConfig` | `crate::score` |
//! | `[[pools]]`, `[[pools.replicas]]`, `[pools.disaggregation]` | `PoolConfig`, `ReplicaConfig`, `DisaggregationConfig` | `crate::pool` (`config.rs`) |
//! | `[pools.sessions]` | `SessionConfig` | `crate::pool` (`sessions.rs`) |
//! | `[pools.admission]` | `AdmissionConfig` | `crate::admission` (`config.rs`) |
//! | `[pools.discovery]` | `DiscoveryConfig` | `crate::discovery` (`config.rs`) |
//! | `[sync]` | `SyncConfig` | `crate::sync` (`config.rs`) |

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;

use anyhow::{bail, Context};
use serde::Deserialize;

use serde::de::Error as _;
use serde::Deserializer;

use crate::discovery::{DiscoveryConfig, DiscoveryKind};
use crate::pool::{Policy, PoolConfig, ReplicaConfig, Role, TransferProtocol, MAX_EXPLAIN_KEEP};
use crate::score::ScoringConfig;
use crate::sync::SyncConfig;

#[cfg(test)]
mod tests;

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
    /// Bytes of offloaded bodies (prompts too big to tokenize in Envoy) held at once, read,
    /// waiting for a tokenizer or tokenizing (default 64 MiB, four of the largest): one that
    /// would pass it is answered at once, unread, and Envoy routes it
    /// (`kvgate_route_fallbacks_total{reason="offload_full"}`).
    #[serde(default = "default_offload_queue_bytes")]
    pub offload_queue_bytes: usize,
    /// Offloaded prompts tokenized at once (default: one per core the sidecar may use). At
    /// least 1.
    #[serde(default)]
    pub offload_threads: Option<usize>,
    /// The most threads one long offloaded prompt is tokenized on, taken from the slots of
    /// `offload_threads` that no other prompt holds (default 1: no spreading). Worth raising
    /// only where the sidecar has cores of its own: on cores it shares with Envoy, a spread
    /// prompt slows the worker's other requests. At least 1.
    #[serde(default = "default_offload_spread_threads")]
    pub offload_spread_threads: usize,
    /// One pool per model.
    pub pools: Vec<PoolSection>,
    /// Share bookings with the sidecars of the other gateway pods (off when absent).
    #[serde(default)]
    pub sync: Option<SyncConfig>,
    /// A file the sidecar saves its view to (each pool's index and session bindings) and
    /// takes over when it starts again with no sync peer up, so that a lone sidecar's
    /// restart does not lose what the engines' replay buffers no longer hold
    /// (`crate::sync::saved`). Off when absent; its directory must exist (checked at start).
    #[serde(default)]
    pub state_file: Option<std::path::PathBuf>,
    /// Seconds between saves of `state_file` (default 10; one more on shutdown). A restart
    /// resumes each engine's stream from the last save, so this must stay well inside the
    /// engines' replay window.
    #[serde(default = "default_state_save_secs")]
    pub state_save_secs: u64,
}

/// One `[[pools]]` table: the pool's own settings and, from its `[pools.discovery]`
/// sub-table, where its replicas come from — two sections owned by two modules (the pool, and
/// the discovery that feeds it).
#[derive(Debug, Clone, PartialEq)]
pub struct PoolSection {
    /// The pool's settings.
    pub pool: PoolConfig,
    /// Where its replicas come from (default: the listed `replicas`, reloaded with the file).
    pub discovery: DiscoveryConfig,
}

impl<'de> Deserialize<'de> for PoolSection {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let mut table = toml::Table::deserialize(deserializer)?;
        let discovery = match table.remove("discovery") {
            Some(value) => {
                DiscoveryConfig::deserialize(value).map_err(|e| D::Error::custom(format!("discovery: {e}")))?
            }
            None => DiscoveryConfig::default(),
        };
        let pool = PoolConfig::deserialize(toml::Value::Table(table)).map_err(D::Error::custom)?;
        Ok(PoolSection { pool, discovery })
    }
}

fn default_state_save_secs() -> u64 {
    10
}

fn default_offload_spread_threads() -> usize {
    1
}

fn default_offload_queue_bytes() -> usize {
    crate::api::DEFAULT_OFFLOAD_QUEUE_BYTES
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
        for PoolSection { pool, .. } in &mut config.pools {
            if pool.tokenizer.is_relative() {
                pool.tokenizer = base.join(&pool.tokenizer);
            }
        }
        config.apply_env(env)?;
        config.validate()?;
        Ok(config)
    }

    /// The API's address unless configured: loopback.
    pub fn default_listen() -> SocketAddr {
        default_listen()
    }

    /// `KVGATE_LISTEN`, `KVGATE_METRICS_LISTEN`, `KVGATE_SYNC_LISTEN` and the scoring knobs, under kvgate's names or Dynamo's.
    fn apply_env(&mut self, env: &dyn Env) -> anyhow::Result<()> {
        if let Some(v) = env.var("KVGATE_LISTEN") {
            self.listen = v.parse().with_context(|| format!("KVGATE_LISTEN={v}"))?;
        }
        if let Some(v) = env.var("KVGATE_METRICS_LISTEN") {
            self.metrics_listen = Some(v.parse().with_context(|| format!("KVGATE_METRICS_LISTEN={v}"))?);
        }
        if let (Some(v), Some(sync)) = (env.var("KVGATE_SYNC_LISTEN"), self.sync.as_mut()) {
            sync.listen = v;
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
        if self.offload_threads == Some(0) {
            bail!("offload_threads must be at least 1 (offloaded prompts tokenized at once)");
        }
        if self.offload_spread_threads == 0 {
            bail!("offload_spread_threads must be at least 1 (threads one offloaded prompt is tokenized on)");
        }
        if self.state_save_secs == 0 {
            bail!("state_save_secs must be at least 1 (seconds between saves of state_file)");
        }
        if !self.listen.ip().is_loopback() && !self.allow_non_loopback_api {
            bail!(
                "listen = {} is not a loopback address: the API steers routing, so it is meant for the local Envoy only; set allow_non_loopback_api = true to expose it anyway",
                self.listen
            );
        }
        for PoolSection { pool, .. } in &self.pools {
            pool.check_tokenizer_mode()?;
            pool.admission.validate(&pool.model, pool.engine_metrics_secs)?;
            if let Some(sessions) = &pool.sessions {
                sessions.validate(&pool.model)?;
                if pool.policy != Policy::KvAware {
                    bail!(
                        "pool {:?}: sessions are bound by a credit in the kv_aware cost; the {} policy has none \
                         (consistent_hash pins sessions by their key instead)",
                        pool.model,
                        pool.policy.name()
                    );
                }
            }
        }
        if let Some(sync) = &self.sync {
            sync.validate()?;
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
        for PoolSection { pool, discovery: d } in &self.pools {
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
            if !(1..=MAX_EXPLAIN_KEEP).contains(&pool.explain_keep) {
                bail!("pool {:?}: explain_keep must be 1..={MAX_EXPLAIN_KEEP}, got {}", pool.model, pool.explain_keep);
            }
            if pool.explain_max_age_secs == 0 {
                bail!("pool {:?}: explain_max_age_secs must be at least 1", pool.model);
            }
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
            check_roles(pool, d)?;
            let mut ids = HashSet::new();
            let mut endpoints = HashSet::new();
            for r in &pool.replicas {
                if !ids.insert(r.id.as_str()) {
                    bail!("pool {:?}: replica id {:?} is used twice", pool.model, r.id);
                }
                if r.id.contains('#') {
                    bail!(
                        "pool {:?}: replica id {:?} holds '#', which names data-parallel ranks (`id#rank`)",
                        pool.model,
                        r.id
                    );
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

/// Roles only with disaggregation; with it, workers for both legs (listed, or a discovered
/// `prefill_name`) and, in `sglang` mode, prefill servers' bootstrap port.
fn check_roles(pool: &PoolConfig, discovery: &DiscoveryConfig) -> anyhow::Result<()> {
    let Some(d) = &pool.disaggregation else {
        if let Some(r) = pool.replicas.iter().find(|r| r.role != Role::Both) {
            bail!("pool {:?}: replica {:?} has a role but the pool has no disaggregation", pool.model, r.id);
        }
        if discovery.prefill_name.is_some() {
            bail!("pool {:?}: discovery.prefill_name but the pool has no disaggregation", pool.model);
        }
        return Ok(());
    };
    let discovered = discovery.kind != DiscoveryKind::Static;
    if discovered && discovery.prefill_name.is_none() {
        bail!("pool {:?}: a discovered disaggregated pool needs discovery.prefill_name", pool.model);
    }
    if discovered && d.mode == TransferProtocol::Sglang && discovery.bootstrap_port.is_none() {
        bail!("pool {:?}: discovery.bootstrap_port is needed in sglang mode", pool.model);
    }
    if pool.policy == Policy::PrefixAffinity {
        bail!(
            "pool {:?}: disaggregation chooses prefill workers by their KV events; prefix_affinity reads none",
            pool.model
        );
    }
    if pool.policy == Policy::PredictedLatency {
        bail!(
            "pool {:?}: predicted_latency predicts a replica's time to compute a prompt it is sent whole; in a \
             disaggregated pool a prefill worker computes it",
            pool.model
        );
    }
    if pool.admission.has_slo() {
        bail!(
            "pool {:?}: an SLO is held to each replica's predicted latencies for a prompt it is sent whole; in a \
             disaggregated pool a prefill worker computes it",
            pool.model
        );
    }
    let prefills = |r: &&ReplicaConfig| match d.mode {
        TransferProtocol::Vllm => r.role.prefills(),
        // An SGLang server in neither disaggregation mode ignores a bootstrap room.
        TransferProtocol::Sglang => r.role == Role::Prefill,
    };
    let both = pool.replicas.iter().any(|r| prefills(&r)) && pool.replicas.iter().any(|r| r.role.decodes());
    if !discovered && !both {
        bail!("pool {:?}: disaggregation needs replicas for prefill and for decode", pool.model);
    }
    if d.mode == TransferProtocol::Sglang {
        if let Some(r) = pool.replicas.iter().find(|r| r.role == Role::Prefill && r.bootstrap_port.is_none()) {
            bail!("pool {:?}: prefill replica {:?} has no bootstrap_port (sglang mode)", pool.model, r.id);
        }
    }
    Ok(())
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
