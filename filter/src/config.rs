//! The filter's configuration: the plugin configuration JSON (a `StringValue` in Envoy,
//! `pluginConfig` in an Istio WasmPlugin). Every key is optional.
//!
//! ```json
//! {
//!   "sidecar_cluster": "kvgate-sidecar",
//!   "route_timeout_ms": 25,
//!   "offload_timeout_ms": 1000,
//!   "fetch_timeout_ms": 10000,
//!   "retry_ms": 1000,
//!   "models_refresh_ms": 10000,
//!   "max_tokenize_bytes": 1048576,
//!   "offload_bytes": 16384,
//!   "envoy_tokenizers": "all",
//!   "debug_headers": false,
//!   "segment_cache_bytes": 16777216,
//!   "forward_tokens": false,
//!   "forward_chat_tokens": false,
//!   "decode_progress": false,
//!   "request_usage": true,
//!   "admission_wait_ms": 0,
//!   "priority_header": null,
//!   "tenant_header": null,
//!   "ttft_slo_header": null,
//!   "itl_slo_header": null,
//!   "prefill_cluster": null,
//!   "prefill_timeout_ms": 60000,
//!   "client_transfer_fields": false,
//!   "breaker_failures": 5,
//!   "breaker_open_ms": 1000,
//!   "breaker_max_open_ms": 30000
//! }
//! ```

use std::time::Duration;

use kvgate_shared::wire::SESSION_HEADER;
use serde::Deserialize;

use crate::breaker::Limits;

/// Which models' tokenizers an Envoy worker loads (the filter's `envoy_tokenizers`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum EnvoyTokenizers {
    /// Every model the sidecar routes.
    #[default]
    All,
    /// None: the sidecar tokenizes every request.
    None,
    /// These models (base model names); the sidecar tokenizes the others'.
    Only(Vec<String>),
}

impl EnvoyTokenizers {
    /// Whether no worker loads any tokenizer (`"none"`, or an empty list).
    pub fn is_none(&self) -> bool {
        match self {
            EnvoyTokenizers::All => false,
            EnvoyTokenizers::None => true,
            EnvoyTokenizers::Only(models) => models.is_empty(),
        }
    }

    /// Whether a worker loads the tokenizer of base model `model`.
    pub fn wants(&self, model: &str) -> bool {
        match self {
            EnvoyTokenizers::All => true,
            EnvoyTokenizers::None => false,
            EnvoyTokenizers::Only(models) => models.iter().any(|m| m == model),
        }
    }
}

impl<'de> Deserialize<'de> for EnvoyTokenizers {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Spelled {
            Word(String),
            Models(Vec<String>),
        }
        match Spelled::deserialize(deserializer) {
            Ok(Spelled::Word(w)) if w == "all" => Ok(EnvoyTokenizers::All),
            Ok(Spelled::Word(w)) if w == "none" => Ok(EnvoyTokenizers::None),
            Ok(Spelled::Models(models)) => Ok(EnvoyTokenizers::Only(models)),
            _ => Err(serde::de::Error::custom("envoy_tokenizers must be \"all\", \"none\" or a list of model names")),
        }
    }
}

/// Validated filter settings.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FilterConfig {
    /// The Envoy cluster of the sidecar (loopback).
    pub sidecar_cluster: String,
    /// `:authority` of calls to the sidecar.
    pub sidecar_authority: String,
    /// How long a request waits for a routing decision before failing open (the sidecar
    /// answers in well under a millisecond; this bounds what a sick sidecar can add).
    pub route_timeout_ms: u64,
    /// The same for a body above `offload_bytes`, which the sidecar must tokenize first (natively about
    /// 1 ms per 32k-token chat; the biggest body Envoy buffers, 16 MiB, takes well under a
    /// second).
    pub offload_timeout_ms: u64,
    /// Timeout of tokenizer and lifecycle calls.
    pub fetch_timeout_ms: u64,
    /// Tick period: tokenizer fetch retries and lifecycle flushes.
    pub retry_ms: u64,
    /// How often the model list is fetched again, so that models and LoRA adapters the
    /// sidecar starts (or stops) routing — adapters it learns from the engines — are picked
    /// up (or dropped) by a running filter.
    pub models_refresh_ms: u64,
    /// At most this many bytes of a prompt's text are tokenized in Envoy; longer prompts are
    /// routed on their head (tokenizing blocks the Envoy worker, about 15 ms per MiB).
    pub max_tokenize_bytes: usize,
    /// Request bodies larger than this are not tokenized in Envoy: the whole body goes to the
    /// sidecar (`/v1/route_body`), which tokenizes it on its own threads, natively twice as
    /// fast as the wasm VM. Measured (`cargo xtask bench filter`): an 8k-token chat adds about
    /// the same either way (~1 ms), so offloading from 16 KiB (about 4k tokens, ~0.25 ms of
    /// tokenizing) keeps the Envoy worker free at no cost.
    pub offload_bytes: usize,
    /// Which models' tokenizers each Envoy worker loads: `"all"` (default), `"none"`, or a
    /// list of model names (an adapter follows its base model). A request for a model whose
    /// tokenizer this worker has not loaded — not wanted here, or not loaded yet — goes whole
    /// to the sidecar, which tokenizes it, as for a body above `offload_bytes`. Each worker's
    /// VM keeps what loading a tokenizer peaked at (Qwen3: about 64 MiB per worker), so
    /// `"none"` trades that memory for the sidecar's CPU. Token forwarding and decode progress
    /// need what is computed here (the ids, the pool's block size): only requests tokenized in
    /// Envoy have them, so `"none"` refuses both.
    pub envoy_tokenizers: EnvoyTokenizers,
    /// Add `x-kvgate-*` response headers describing the decision (for tests and debugging).
    pub debug_headers: bool,
    /// Bytes of tokenized chat segments kept per VM (earlier turns are not re-tokenized);
    /// 0 disables the cache.
    pub segment_cache_bytes: usize,
    /// Token forwarding: rewrite a `/v1/completions` string `prompt` into the token ids the
    /// filter computed, so the engine does not tokenize it again. Off by default: only for
    /// engines that take token-id prompts (vLLM, SGLang) with the same tokenizer.
    pub forward_tokens: bool,
    /// Token forwarding for chats: a chat tokenized whole in Envoy goes upstream with its ids
    /// as `kv_transfer_params.prompt_token_ids`, so the engine neither renders nor tokenizes
    /// it. Off by default: only for vLLM 0.32 or later with the same tokenizer (other engines
    /// ignore or refuse the field).
    pub forward_chat_tokens: bool,
    /// Decode progress: count a streamed response's tokens and report them to the sidecar at
    /// each KV block boundary, so a request's decode load decays as it nears `max_tokens`.
    /// Off by default (one more report per block of output).
    pub decode_progress: bool,
    /// Ask the engine for `usage` on a streamed request whose client did not
    /// (`stream_options.include_usage`), and take that extra event out of the stream the
    /// client receives, so every request's prediction is checked against the engine. On by
    /// default; off leaves such streams unchecked.
    pub request_usage: bool,
    /// How long a request may wait in the sidecar's admission queue when every replica of
    /// its pool is saturated (pools with `admission` on), on top of `route_timeout_ms` /
    /// `offload_timeout_ms`; past it the sidecar sheds it and the filter answers 429 with
    /// `Retry-After`. 0 (default): a request never waits, it is shed at once. A sidecar that
    /// hangs holds requests this much longer before they fail open.
    pub admission_wait_ms: u64,
    /// The request header that names a request's priority class for admission control (for
    /// example `x-kvgate-priority`). Unset (default): no request names one. Set it only to a
    /// header your own filters set or strip (an auth filter ahead of kvgate): a client could
    /// otherwise pick its own class.
    pub priority_header: Option<String>,
    /// The request header that names a request's tenant, so that tenants take turns while
    /// requests wait (for example `x-kvgate-tenant`, or an API-key hash your auth filter
    /// sets). Unset (default): every waiting request is a tenant of its own. As with
    /// `priority_header`, name only a header your own filters set: a client that could set it
    /// would take a fresh turn with every new value.
    pub tenant_header: Option<String>,
    /// The request header whose value is the request's TTFT SLO in milliseconds (for example
    /// `x-kvgate-ttft-slo-ms`), replacing its admission class's `ttft_slo_ms` (the sidecar's
    /// `[pools.admission]`, which must be enabled). Unset (default): no request names one. A
    /// value that is not a whole number, or 0, leaves the class's. As with `priority_header`,
    /// name a header your own filters set:
    /// a client could otherwise loosen its SLO, or tighten it to be sent to the replica
    /// predicted fastest.
    pub ttft_slo_header: Option<String>,
    /// The request header whose value is the request's ITL SLO in milliseconds — the mean
    /// time between its output tokens (for example `x-kvgate-itl-slo-ms`) — replacing its
    /// admission class's `itl_slo_ms`, as `ttft_slo_header` does its TTFT SLO.
    pub itl_slo_header: Option<String>,
    /// The request header whose value is the request's session key (default
    /// `x-session-id`; cut to 256 bytes): what the `consistent_hash` policy hashes and pools
    /// with `sessions` bind, ahead of the body's `session_id`, `user` or Messages
    /// `metadata.user_id`. Sessions only steer where a client's own requests go (a pool binds
    /// them only if its operator turned `sessions` on); name a header your auth filter sets
    /// if clients must not pick theirs.
    pub session_header: String,
    /// The Envoy cluster prefill legs go to (disaggregated pools): one whose load balancer
    /// is `override_host` on `x-gateway-destination-endpoint`, with the prefill workers among
    /// its hosts — the engines' own cluster will do. Unset (default): a disaggregated pool's
    /// requests are served whole on their decode worker.
    pub prefill_cluster: Option<String>,
    /// How long a prefill leg may take. A vLLM request waits for its leg (paused) and past
    /// this is served whole on its decode worker; an SGLang leg runs beside its request and
    /// is cancelled past this (its decode worker then fails the request, as SGLang does).
    pub prefill_timeout_ms: u64,
    /// Whether clients may set `kv_transfer_params` (its `prompt_token_ids` included) and the
    /// `bootstrap_*` fields. Off (default): they are taken out of every request before it is
    /// routed, so the engine runs the prompt kvgate routed on — the `messages` any content
    /// filter inspected, not token ids a client chose — and pulls KV from nowhere a client
    /// names. On, for trusted clients only (a router in front that sends its own transfer
    /// parameters): they pass, except that with `prefill_cluster` set everything but the
    /// prompt's token ids is still replaced, since only kvgate says where KV comes from.
    pub client_transfer_fields: bool,
    /// Route and offload calls to the sidecar that fail in a row (time out, cannot be
    /// dispatched, or are answered 5xx or 409) before the circuit breaker opens
    /// ([`crate::breaker`]): while it is open no request asks the sidecar, each goes straight
    /// to Envoy's balancer, so a hung sidecar stops adding `route_timeout_ms` to every
    /// request. A 429 (shed) is the sidecar working and never counts. 0 turns the breaker off.
    pub breaker_failures: u32,
    /// How long the breaker stays open the first time; then one request probes the sidecar
    /// (half-open): answered, the breaker closes; failed, it opens again for twice as long.
    pub breaker_open_ms: u64,
    /// The longest the breaker stays open, however many probes fail.
    pub breaker_max_open_ms: u64,
}

impl Default for FilterConfig {
    fn default() -> Self {
        FilterConfig {
            sidecar_cluster: "kvgate-sidecar".into(),
            sidecar_authority: "kvgate-sidecar".into(),
            route_timeout_ms: 25,
            offload_timeout_ms: 1000,
            fetch_timeout_ms: 10_000,
            retry_ms: 1000,
            models_refresh_ms: 10_000,
            max_tokenize_bytes: 1 << 20,
            offload_bytes: 16 << 10,
            envoy_tokenizers: EnvoyTokenizers::All,
            debug_headers: false,
            segment_cache_bytes: kvgate_shared::prompt::segments::DEFAULT_BUDGET,
            forward_tokens: false,
            forward_chat_tokens: false,
            decode_progress: false,
            request_usage: true,
            admission_wait_ms: 0,
            priority_header: None,
            ttft_slo_header: None,
            itl_slo_header: None,
            tenant_header: None,
            session_header: SESSION_HEADER.into(),
            prefill_cluster: None,
            prefill_timeout_ms: 60_000,
            client_transfer_fields: false,
            breaker_failures: 5,
            breaker_open_ms: 1000,
            breaker_max_open_ms: 30_000,
        }
    }
}

impl FilterConfig {
    /// Parses the plugin configuration; empty means all defaults.
    pub fn parse(bytes: &[u8]) -> Result<FilterConfig, String> {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(FilterConfig::default());
        }
        let config: FilterConfig =
            serde_json::from_slice(bytes).map_err(|e| format!("kvgate filter configuration: {e}"))?;
        if config.sidecar_cluster.is_empty() {
            return Err("kvgate filter configuration: sidecar_cluster must not be empty".into());
        }
        let periods = [
            config.route_timeout_ms,
            config.offload_timeout_ms,
            config.fetch_timeout_ms,
            config.retry_ms,
            config.models_refresh_ms,
            config.prefill_timeout_ms,
            config.breaker_open_ms,
        ];
        if config.session_header.is_empty() {
            return Err("kvgate filter configuration: session_header must not be empty".into());
        }
        if config.prefill_cluster.as_deref() == Some("") {
            return Err("kvgate filter configuration: prefill_cluster must not be empty".into());
        }
        if periods.contains(&0) {
            return Err(
                "kvgate filter configuration: timeouts, retry_ms, models_refresh_ms and breaker_open_ms must be positive"
                    .into(),
            );
        }
        let needs_envoy = [
            ("forward_tokens", config.forward_tokens),
            ("forward_chat_tokens", config.forward_chat_tokens),
            ("decode_progress", config.decode_progress),
        ];
        if let Some((key, _)) = needs_envoy.iter().find(|(_, on)| *on && config.envoy_tokenizers.is_none()) {
            return Err(format!(
                "kvgate filter configuration: {key} needs what Envoy's workers compute when they tokenize, \
                 and envoy_tokenizers loads no tokenizer"
            ));
        }
        if config.breaker_max_open_ms < config.breaker_open_ms {
            return Err("kvgate filter configuration: breaker_max_open_ms must be at least breaker_open_ms".into());
        }
        Ok(config)
    }

    /// The circuit breaker's settings.
    pub fn breaker_limits(&self) -> Limits {
        Limits {
            failures: self.breaker_failures,
            open: Duration::from_millis(self.breaker_open_ms),
            max_open: Duration::from_millis(self.breaker_max_open_ms),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_overrides() {
        assert_eq!(FilterConfig::parse(b"").unwrap(), FilterConfig::default());
        let c = FilterConfig::parse(br#"{"route_timeout_ms": 50, "debug_headers": true}"#).unwrap();
        assert_eq!((c.route_timeout_ms, c.debug_headers, c.retry_ms), (50, true, 1000));
        let c = FilterConfig::parse(br#"{"breaker_failures": 0, "breaker_open_ms": 200}"#).unwrap();
        let limits = c.breaker_limits();
        assert_eq!(
            (limits.failures, limits.open, limits.max_open),
            (0, Duration::from_millis(200), Duration::from_secs(30)),
            "0 failures: the breaker is off"
        );
    }

    #[test]
    fn envoy_tokenizers_is_a_word_or_a_list() {
        let wants = |json: &str, model| FilterConfig::parse(json.as_bytes()).unwrap().envoy_tokenizers.wants(model);
        assert!(wants("{}", "qwen3"), "all by default");
        assert!(!wants(r#"{"envoy_tokenizers": "none"}"#, "qwen3"));
        assert!(wants(r#"{"envoy_tokenizers": ["qwen3"]}"#, "qwen3"));
        assert!(!wants(r#"{"envoy_tokenizers": ["qwen3"]}"#, "llama"));
    }

    #[test]
    fn rejects_bad_configs() {
        for bad in [
            &b"{"[..],
            br#"{"unknown": 1}"#,
            br#"{"route_timeout_ms": 0}"#,
            br#"{"prefill_cluster": ""}"#,
            br#"{"sidecar_cluster": ""}"#,
            br#"{"breaker_open_ms": 0}"#,
            br#"{"breaker_open_ms": 5000, "breaker_max_open_ms": 4000}"#,
            br#"{"breaker_failures": -1}"#,
            br#"{"envoy_tokenizers": "some"}"#,
            br#"{"envoy_tokenizers": [1]}"#,
            br#"{"envoy_tokenizers": "none", "forward_chat_tokens": true}"#,
            br#"{"envoy_tokenizers": [], "forward_tokens": true}"#,
            br#"{"envoy_tokenizers": "none", "decode_progress": true}"#,
        ] {
            assert!(FilterConfig::parse(bad).is_err());
        }
    }
}
