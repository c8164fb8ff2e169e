//! Prefill/decode disaggregation: the two request protocols the simulator speaks, and the
//! moving of KV from a prefill engine to a decode engine.
//!
//! **vLLM's NixlConnector** (`--kv-transfer-config '{"kv_connector":"NixlConnector",…}'`):
//! - a request whose `kv_transfer_params.do_remote_decode` is true is prefilled as usual with
//!   one output token; its blocks are then held for the decoder (until read, or for
//!   `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`) and the response carries the `kv_transfer_params`
//!   `NixlConnectorScheduler.request_finished` returns ([`Nixl::prefill_params`]);
//! - a request with `do_remote_prefill` and those `remote_*` fields is a decode: the prompt
//!   past the local prefix hit is read from the prefill engine — here a sim-private
//!   `POST /_kv/pull` on its HTTP listener (the "side channel"), which frees the held
//!   blocks — and takes the transfer time; vLLM then computes the prompt's last token itself.
//!   A failed read follows `kv_load_failure_policy` (vLLM's default: `fail`, an error).
//!
//! **SGLang's bootstrap protocol** (`--disaggregation-mode prefill|decode`): the router sends
//! the same body, with `bootstrap_host`, `bootstrap_port` and `bootstrap_room`, to a prefill
//! and a decode server at once.
//! - The decoder, once it has blocks for the prompt, joins the room at the prefill's bootstrap
//!   server (`POST /_kv/bootstrap` on `--disaggregation-bootstrap-port`), which answers when
//!   the prefill has computed the room's prompt and frees its blocks; the transfer time
//!   follows, then the decoder decodes from the prefill's first token, computing no prompt.
//! - The prefill waits for the room's decoder before computing (SGLang's
//!   `PrefillBootstrapQueue`), computes one token and holds the blocks for the decoder.
//! - Either side gives up after `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT` with SGLang's 500.
//!
//! The transfer itself is a sleep of tokens × KV bytes per token ÷ bandwidth, ÷ `--speedup`
//! like every simulated duration; so are the hold and bootstrap timeouts.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use tokio::sync::Notify;

use crate::scheduler::{Load, LoadMode};

/// KV bytes per token without a model shape to derive it from: Llama-3.1-8B in BF16.
pub const DEFAULT_KV_BYTES_PER_TOKEN: u64 = 131_072;
/// How long a decoder waits for a prefill engine to answer a pull.
const PULL_TIMEOUT: Duration = Duration::from_secs(30);
/// The 400 SGLang's P/D servers give a request without a room.
pub const NO_ROOM: &str = "Disaggregated request received without bootstrap room id";

/// vLLM's `--kv-transfer-config` (`KVTransferConfig`): the fields the simulator reads. Other
/// vLLM keys are accepted and ignored.
#[derive(Debug, Clone, Deserialize)]
pub struct KvTransferConfig {
    kv_connector: Option<String>,
    kv_role: Option<KvRole>,
    engine_id: Option<String>,
    #[serde(default)]
    kv_load_failure_policy: FailurePolicy,
    /// Accepted (it must be an object, as vLLM's is a dict) and ignored.
    #[serde(rename = "kv_connector_extra_config", default)]
    _extra: Map<String, Value>,
}

/// `kv_role`. vLLM's NixlConnector serves both request kinds whatever the role, and so does
/// the simulator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum KvRole {
    /// `kv_producer`
    #[serde(rename = "kv_producer")]
    Producer,
    /// `kv_consumer`
    #[serde(rename = "kv_consumer")]
    Consumer,
    /// `kv_both`
    #[serde(rename = "kv_both")]
    Both,
}

/// vLLM's `kv_load_failure_policy`: what a decode whose remote prefill cannot be read does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FailurePolicy {
    /// Compute the prompt locally.
    Recompute,
    /// Fail the request (vLLM's default since the option exists: `config/kv_transfer.py`).
    #[default]
    Fail,
}

/// A `--kv-transfer-config` the simulator cannot play.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Not JSON, or a field of the wrong type.
    #[error("--kv-transfer-config is not valid: {0}")]
    Json(#[from] serde_json::Error),
    /// No connector named.
    #[error("--kv-transfer-config needs `kv_connector` (kvgate-sim simulates \"NixlConnector\")")]
    NoConnector,
    /// A connector other than NixlConnector.
    #[error("kv_connector {0:?} is not supported: kvgate-sim simulates only \"NixlConnector\"")]
    Unsupported(String),
    /// vLLM's rule: a connector needs a role.
    #[error(
        "--kv-transfer-config sets kv_connector without kv_role (\"kv_producer\", \"kv_consumer\" or \"kv_both\")"
    )]
    NoRole,
}

impl KvTransferConfig {
    /// Parses and checks `--kv-transfer-config`.
    pub fn parse(json: &str) -> Result<KvTransferConfig, ConfigError> {
        let config: KvTransferConfig = serde_json::from_str(json)?;
        match config.kv_connector.as_deref() {
            None => Err(ConfigError::NoConnector),
            Some("NixlConnector") if config.kv_role.is_none() => Err(ConfigError::NoRole),
            Some("NixlConnector") => Ok(config),
            Some(other) => Err(ConfigError::Unsupported(other.to_owned())),
        }
    }

    /// `engine_id`, if set (vLLM makes up a UUID otherwise).
    pub fn engine_id(&self) -> Option<&str> {
        self.engine_id.as_deref()
    }

    /// `kv_role`.
    pub fn role(&self) -> Option<KvRole> {
        self.kv_role
    }

    /// `kv_load_failure_policy`.
    pub fn failure_policy(&self) -> FailurePolicy {
        self.kv_load_failure_policy
    }
}

/// SGLang's `--disaggregation-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DisaggregationMode {
    /// No disaggregation.
    Null,
    /// A prefill server, with a bootstrap server.
    Prefill,
    /// A decode server.
    Decode,
}

/// The disaggregation protocol an engine speaks.
#[derive(Debug)]
pub enum Protocol {
    /// None: every request is prefilled and decoded here, P/D fields are ignored.
    Off,
    /// vLLM's NixlConnector.
    Nixl(Nixl),
    /// SGLang's bootstrap protocol.
    Bootstrap(Bootstrap),
}

/// A vLLM engine's NixlConnector identity.
#[derive(Debug)]
pub struct Nixl {
    engine_id: String,
    ranks: usize,
    host: String,
    port: u16,
}

/// The SGLang side an engine plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// A prefill server.
    Prefill,
    /// A decode server.
    Decode,
}

/// An SGLang prefill or decode server's settings.
#[derive(Debug)]
pub struct Bootstrap {
    /// Which side.
    pub side: Side,
    /// The prefill's bootstrap port; a decoder's default for requests naming none.
    pub port: u16,
    /// How long either side waits for the other (wall time).
    pub timeout: Duration,
    /// Prefill side: the rooms whose decoder has joined.
    pub arrivals: Arrivals,
}

/// What a request asks of disaggregation.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// Prefilled and decoded here.
    Local,
    /// vLLM `do_remote_decode`: prefill here and hold the blocks for the decoder.
    RemoteDecode,
    /// SGLang prefill server: wait for the room's decoder, prefill, hold the blocks for it.
    BootstrapPrefill(u64),
    /// Prefilled elsewhere: load the prompt from there.
    RemotePrefill(Source),
}

/// Where a decode loads its prompt's KV from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A vLLM prefill engine's held blocks.
    Nixl(NixlSource),
    /// An SGLang prefill server's room.
    Bootstrap {
        /// `bootstrap_host`
        host: String,
        /// `bootstrap_port`
        port: u16,
        /// `bootstrap_room`
        room: u64,
    },
}

/// The `remote_*` fields of a vLLM decode request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NixlSource {
    /// `remote_engine_id`
    pub engine_id: String,
    /// `remote_request_id`
    pub request_id: String,
    /// `remote_block_ids`
    pub block_ids: Vec<u64>,
    /// `remote_host`
    pub host: String,
    /// `remote_port`
    pub port: u16,
    /// `remote_prefill_cached_tokens`: the prefill engine's own cache hits, which vLLM 0.32's
    /// decode engine reports as its `cached_tokens` (`OutputProcessor`'s `RequestState`).
    pub prefill_cached_tokens: Option<usize>,
}

/// `POST /_kv/pull`: a decoder reads a prefill request's blocks.
#[derive(Debug, Serialize, Deserialize)]
pub struct PullRequest {
    /// The prefill engine (rank) holding them.
    pub remote_engine_id: String,
    /// The prefill request.
    pub remote_request_id: String,
    /// The blocks read: those past the decoder's local prefix hit.
    pub remote_block_ids: Vec<u64>,
}

/// The answer to a pull, or to a room's bootstrap: the blocks that were held, now freed.
#[derive(Debug, Serialize, Deserialize)]
pub struct Released {
    /// Their ids.
    pub block_ids: Vec<u64>,
}

/// `POST /_kv/bootstrap`: a decoder joins a room and waits for its prefill.
#[derive(Debug, Serialize, Deserialize)]
pub struct JoinRoom {
    /// `bootstrap_room`
    pub bootstrap_room: u64,
}

impl Protocol {
    /// Whether requests may be disaggregated.
    pub fn is_on(&self) -> bool {
        !matches!(self, Protocol::Off)
    }

    /// Reads a request body's disaggregation fields — vLLM's `kv_transfer_params`, SGLang's
    /// `bootstrap_host`, `bootstrap_port`, `bootstrap_room` — or says what is malformed.
    pub fn plan(&self, body: &[u8]) -> Result<Plan, String> {
        let obj = match serde_json::from_slice::<Value>(body) {
            Ok(Value::Object(obj)) => obj,
            _ => return Ok(Plan::Local),
        };
        match self {
            Protocol::Off => Ok(Plan::Local),
            Protocol::Nixl(_) => nixl_plan(&obj),
            Protocol::Bootstrap(b) => bootstrap_plan(b, &obj),
        }
    }
}

fn nixl_plan(body: &Map<String, Value>) -> Result<Plan, String> {
    let params = match body.get("kv_transfer_params") {
        None | Some(Value::Null) => return Ok(Plan::Local),
        Some(Value::Object(params)) => params,
        Some(_) => return Err("`kv_transfer_params` must be an object".into()),
    };
    let flag = |name: &str| match params.get(name) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(format!("`kv_transfer_params.{name}` must be a boolean")),
    };
    match (flag("do_remote_decode")?, flag("do_remote_prefill")?) {
        (false, false) => Ok(Plan::Local),
        (true, false) => Ok(Plan::RemoteDecode),
        (true, true) => Err("`kv_transfer_params` sets both do_remote_decode and do_remote_prefill".into()),
        (false, true) => {
            let text = |name: &str| {
                params.get(name).and_then(Value::as_str).map(str::to_owned).ok_or_else(|| {
                    format!("`kv_transfer_params.{name}` must be a string when do_remote_prefill is true")
                })
            };
            let block_ids = params
                .get("remote_block_ids")
                .and_then(Value::as_array)
                .and_then(|ids| ids.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
                .ok_or("`kv_transfer_params.remote_block_ids` must be a list of block ids")?;
            let port = params
                .get("remote_port")
                .and_then(Value::as_u64)
                .and_then(|p| u16::try_from(p).ok())
                .ok_or("`kv_transfer_params.remote_port` must be a port number")?;
            Ok(Plan::RemotePrefill(Source::Nixl(NixlSource {
                engine_id: text("remote_engine_id")?,
                request_id: text("remote_request_id")?,
                block_ids,
                host: text("remote_host")?,
                port,
                prefill_cached_tokens: params
                    .get("remote_prefill_cached_tokens")
                    .and_then(Value::as_u64)
                    .map(|n| n as usize),
            })))
        }
    }
}

fn bootstrap_plan(b: &Bootstrap, body: &Map<String, Value>) -> Result<Plan, String> {
    let room = match body.get("bootstrap_room") {
        None | Some(Value::Null) => return Err(NO_ROOM.into()),
        Some(room) => room.as_u64().ok_or("`bootstrap_room` must be a non-negative integer")?,
    };
    if b.side == Side::Prefill {
        return Ok(Plan::BootstrapPrefill(room));
    }
    let host = body.get("bootstrap_host").and_then(Value::as_str).ok_or("`bootstrap_host` must be a string")?;
    let port = match body.get("bootstrap_port") {
        None | Some(Value::Null) => b.port,
        Some(port) => {
            port.as_u64().and_then(|p| u16::try_from(p).ok()).ok_or("`bootstrap_port` must be a port number")?
        }
    };
    Ok(Plan::RemotePrefill(Source::Bootstrap { host: host.to_owned(), port, room }))
}

impl Plan {
    /// Its SGLang bootstrap room, if it has one.
    pub fn room(&self) -> Option<u64> {
        match self {
            Plan::BootstrapPrefill(room) | Plan::RemotePrefill(Source::Bootstrap { room, .. }) => Some(*room),
            _ => None,
        }
    }
}

impl Nixl {
    /// An engine of `ranks` data-parallel ranks, whose pull endpoint is at `host:port`.
    pub fn new(engine_id: String, ranks: usize, host: String, port: u16) -> Nixl {
        Nixl { engine_id, ranks, host, port }
    }

    /// A rank's engine id: with several ranks vLLM appends `_dp<rank>`.
    pub fn engine_id(&self, rank: usize) -> String {
        if self.ranks > 1 {
            format!("{}_dp{rank}", self.engine_id)
        } else {
            self.engine_id.clone()
        }
    }

    /// The rank an engine id names.
    pub fn rank_of(&self, engine_id: &str) -> Option<usize> {
        (0..self.ranks).find(|r| self.engine_id(*r) == engine_id)
    }

    /// A prefill response's `kv_transfer_params`: the keys, in order, of what vLLM's
    /// `NixlConnectorScheduler.request_finished` returns (connector version 2, which added
    /// `remote_request_id`), and the prefill's own cache hits, which vLLM 0.32's scheduler
    /// adds as `remote_prefill_cached_tokens` when the request finishes.
    pub fn prefill_params(&self, rank: usize, request_id: &str, block_ids: &[usize], cached: usize) -> Value {
        json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": block_ids,
            "remote_engine_id": self.engine_id(rank), "remote_request_id": request_id,
            "remote_host": self.host, "remote_port": self.port, "tp_size": 1,
            "remote_prefill_cached_tokens": cached})
    }
}

impl Source {
    /// How the decoder carries on once this is loaded.
    pub fn mode(&self) -> LoadMode {
        match self {
            Source::Nixl(_) => LoadMode::RecomputeLast,
            Source::Bootstrap { .. } => LoadMode::WithFirstToken,
        }
    }
}

/// The rank an SGLang prefill server puts a room on (SGLang's `bootstrap_room % dp_size`).
pub fn room_rank(room: u64, ranks: usize) -> usize {
    (room % ranks.max(1) as u64) as usize
}

/// How long moving KV takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TransferTiming {
    /// KV bytes per token.
    pub bytes_per_token: u64,
    /// Bandwidth, GB/s.
    pub gbps: f64,
    /// Simulated time runs this many times faster than the wall clock.
    pub speedup: f64,
}

impl TransferTiming {
    /// The wall time `tokens` tokens of KV take to move.
    pub fn duration(&self, tokens: usize) -> Duration {
        let seconds = tokens as f64 * self.bytes_per_token as f64 / (self.gbps * 1e9);
        Duration::from_secs_f64(seconds / self.speedup)
    }
}

/// A decoder's side of the transfers: reads remote prefills.
#[derive(Debug, Clone)]
pub struct Puller {
    client: reqwest::Client,
    timing: TransferTiming,
    bootstrap_wait: Duration,
}

impl Puller {
    /// A puller moving KV at `timing`, waiting up to `bootstrap_wait` for an SGLang room.
    pub fn new(timing: TransferTiming, bootstrap_wait: Duration) -> reqwest::Result<Puller> {
        // Engines talk directly, never through an HTTP proxy from the environment.
        let client = reqwest::Client::builder().no_proxy().build()?;
        Ok(Puller { client, timing, bootstrap_wait })
    }

    /// Loads a remote prefill: reads (and so frees) the remote blocks, then lets the transfer
    /// time pass. The error says why it could not.
    pub async fn pull(&self, source: &Source, load: &Load) -> Result<(), String> {
        match source {
            Source::Nixl(remote) => self.read_blocks(remote, load.blocks).await?,
            Source::Bootstrap { host, port, room } => self.join_room(host, *port, *room).await?,
        }
        tokio::time::sleep(self.timing.duration(load.tokens)).await;
        Ok(())
    }

    /// Reads the last `blocks` of the remote blocks, as vLLM's worker does: a local prefix hit
    /// covers the first ones.
    async fn read_blocks(&self, remote: &NixlSource, blocks: usize) -> Result<(), String> {
        let Some(first) = remote.block_ids.len().checked_sub(blocks) else {
            return Err(format!("the prompt needs {blocks} blocks, the remote prefill has {}", remote.block_ids.len()));
        };
        let pull = PullRequest {
            remote_engine_id: remote.engine_id.clone(),
            remote_request_id: remote.request_id.clone(),
            remote_block_ids: remote.block_ids[first..].to_vec(),
        };
        let url = format!("http://{}/_kv/pull", host_port(&remote.host, remote.port));
        let reply = self.client.post(&url).json(&pull).timeout(PULL_TIMEOUT).send().await;
        let reply = reply.map_err(|e| format!("cannot reach {url}: {e}"))?;
        let status = reply.status();
        if !status.is_success() {
            let text = reply.text().await.unwrap_or_default();
            return Err(format!("{url} answered {status}: {text}"));
        }
        let held: Released = reply.json().await.map_err(|e| format!("{url} answered: {e}"))?;
        match pull.remote_block_ids.iter().find(|b| !held.block_ids.contains(b)) {
            Some(b) => Err(format!("block {b} of request {} was not held", pull.remote_request_id)),
            None => Ok(()),
        }
    }

    /// Joins an SGLang room and waits for its prefill.
    async fn join_room(&self, host: &str, port: u16, room: u64) -> Result<(), String> {
        let url = format!("http://{}/_kv/bootstrap", host_port(host, port));
        let join = JoinRoom { bootstrap_room: room };
        let reply = self.client.post(&url).json(&join).timeout(self.bootstrap_wait).send().await;
        let reply =
            reply.map_err(|e| format!("Failed to get kvcache from prefill instance, it might be dead ({e})"))?;
        let status = reply.status();
        if status.is_success() {
            return Ok(());
        }
        Err(format!("{url} answered {status}: {}", reply.text().await.unwrap_or_default()))
    }
}

/// `host:port`, with an IPv6 host in brackets.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// SGLang prefill side: the rooms whose decoder has joined. A prefill request waits for its
/// room's decoder before it is computed, as SGLang's `PrefillBootstrapQueue` waits for the
/// decoder's handshake.
#[derive(Debug, Default)]
pub struct Arrivals {
    rooms: Mutex<HashMap<u64, Instant>>,
    changed: Notify,
}

impl Arrivals {
    /// A decoder joined `room`. Marks older than `ttl` (whose prefill never came) are dropped.
    pub fn arrive(&self, room: u64, ttl: Duration) {
        let now = Instant::now();
        {
            let mut rooms = self.rooms.lock().unwrap_or_else(|p| p.into_inner());
            rooms.retain(|_, at| now.duration_since(*at) < ttl);
            rooms.insert(room, now);
        }
        self.changed.notify_waiters();
    }

    /// The decoder of `room` gave up.
    pub fn forget(&self, room: u64) {
        self.rooms.lock().unwrap_or_else(|p| p.into_inner()).remove(&room);
    }

    /// Waits until `room`'s decoder has joined (taking its mark): false after `timeout`.
    pub async fn wait(&self, room: u64, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.rooms.lock().unwrap_or_else(|p| p.into_inner()).remove(&room).is_some() {
                return true;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return false;
            }
        }
    }
}

#[cfg(test)]
mod tests;
