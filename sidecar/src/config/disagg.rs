//! `[pools.disaggregation]`: prefill/decode disaggregation (`crate::pool`'s `disagg.rs`).

use serde::Deserialize;

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
