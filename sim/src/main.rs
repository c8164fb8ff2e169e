//! `kvgate-sim`: a vLLM-like engine for tests, the demo and benchmarks, without a GPU.
//!
//! ```text
//! kvgate-sim --port 8001 --replica a --model qwen3 --tokenizer models/qwen3-0.6b \
//!            --block-size 16 --preset llama8b-h100 --speedup 10 \
//!            --kv-events-config '{"endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}'
//! ```
//!
//! Prefill/decode disaggregation, as vLLM (`--kv-transfer-config
//! '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'`) or as SGLang
//! (`--disaggregation-mode prefill --disaggregation-bootstrap-port 8998`, or `decode`).
//!
//! | module | responsibility |
//! |---|---|
//! | `api` | vLLM's OpenAI-compatible HTTP API |
//! | `fleet` | many engines' KV-event streams from one recording, for scale benchmarks |
//! | `replay` | a run's requests replayed in simulated time under given placements and a greedy one |
//! | `fanout` | a request's sequences (`n`, a completion's prompt list), its choices and `usage` |
//! | `engine` | one scheduler loop per data-parallel rank, in (sped-up) wall-clock time |
//! | `scheduler` | vLLM v1's continuous batching, chunked prefill and preemption |
//! | `time_model` | step duration; calibrated presets |
//! | `kv_cache` | paged blocks, prefix caching, LRU eviction, the CPU offload tier |
//! | `kv_events` | vLLM's KV-event wire format over ZMQ PUB, replay ROUTER |
//! | `kv_transfer` | prefill/decode disaggregation: vLLM's NixlConnector and SGLang's bootstrap request protocols, pulling held blocks, transfer time |
//! | `lora` | LoRA adapters: registered at start or at run time, salting their blocks |
//! | `vllm_hash` | vLLM's block hashes (sha256 over pickle or CBOR) |
//! | `metrics` | vLLM's Prometheus metrics |

#![forbid(unsafe_code)]

mod api;
mod engine;
mod extra_keys;
mod fanout;
mod fleet;
mod histogram;
mod kv_cache;
mod kv_events;
mod kv_transfer;
mod lora;
mod metrics;
mod replay;
mod scheduler;
mod time_model;
mod vllm_hash;

use std::future::IntoFuture;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::serve::ListenerExt;
use clap::Parser;
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::wire::ModelBundle;

/// A simulated vLLM engine replica. Flags mirror `vllm serve` where vLLM has one.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// HTTP listen host.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// HTTP listen port.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// This replica's id (returned in `x-kvgate-replica`).
    #[arg(long, default_value = "sim")]
    replica: String,
    /// The model (its name, unless `--served-model-name` is given).
    #[arg(long, default_value = "qwen3")]
    model: String,
    /// The name the API serves the model under.
    #[arg(long)]
    served_model_name: Option<String>,
    /// Directory with tokenizer.json and tokenizer_config.json.
    #[arg(long, default_value = "models/qwen3-0.6b")]
    tokenizer: PathBuf,
    /// KV block size in tokens.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV cache size in GPU blocks, per data-parallel rank.
    #[arg(long, default_value_t = 8192)]
    num_gpu_blocks_override: usize,
    /// CPU offload tier size in blocks, per rank (0: none). Evicted GPU blocks move there.
    #[arg(long, default_value_t = 0)]
    cpu_offload_blocks: usize,
    /// Sequences running at once, per rank.
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Tokens computed per step (the chunked-prefill budget), per rank.
    #[arg(long, default_value_t = 8192)]
    max_num_batched_tokens: usize,
    /// Data-parallel ranks: each has its own scheduler, cache and events port (port + rank).
    #[arg(long, default_value_t = 1)]
    data_parallel_size: u32,
    /// vLLM's KV-events configuration JSON: `endpoint`, `replay_endpoint`, `topic`,
    /// `buffer_steps`, `hwm` (other keys are accepted and ignored).
    #[arg(long, default_value = r#"{"endpoint":"tcp://*:5557"}"#)]
    kv_events_config: String,
    /// Export each request's `llm_request` span over OTLP/HTTP to this collector
    /// (`http://host:4318`), a child of the request's `traceparent`, as vLLM's flag does.
    #[arg(long)]
    otlp_traces_endpoint: Option<String>,
    /// Event layout: `map` (vLLM 0.24+) or `legacy-array` (vLLM 0.22/0.23 positional).
    #[arg(long, value_enum, default_value_t = kv_events::Encoding::Map)]
    kv_events_encoding: kv_events::Encoding,
    /// Fault injection on the event stream at start (JSON, see `POST /_chaos/events`).
    #[arg(long, default_value = "{}")]
    chaos: String,
    /// The time model's calibrated preset; the coefficient flags below override it.
    #[arg(long, value_enum, default_value_t = time_model::Preset::Test)]
    preset: time_model::Preset,
    /// Fixed cost of a step, µs.
    #[arg(long)]
    step_base_us: Option<f64>,
    /// Cost per prompt token computed, µs.
    #[arg(long)]
    prefill_us_per_token: Option<f64>,
    /// Cost per (prompt token × context token) of prefill attention, µs.
    #[arg(long)]
    attn_us_per_token_pair: Option<f64>,
    /// Cost per decoding sequence in a step, µs.
    #[arg(long)]
    decode_us_per_seq: Option<f64>,
    /// Cost per context token a decode reads, µs.
    #[arg(long)]
    kv_read_us_per_token: Option<f64>,
    /// Cost per block loaded from the CPU tier, µs.
    #[arg(long)]
    cpu_load_us_per_block: Option<f64>,
    /// Serve no API: record this engine's KV events under load in simulated time, then
    /// publish them as many engines (JSON, see `fleet::FleetConfig`), and exit.
    #[arg(long)]
    fleet_config: Option<String>,
    /// Serve no API: replay the requests in this file (JSON, see `replay::Input`) in simulated
    /// time on engines of this configuration, under each placement it names and a greedy one;
    /// print each request's time to first token (JSON) and exit.
    #[arg(long)]
    replay: Option<PathBuf>,
    /// Print the presets, their coefficients and calibration targets, and exit.
    #[arg(long)]
    list_presets: bool,
    /// Run simulated time this many times faster than the wall clock.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// vLLM's `--prefix-caching-hash-algo`; the seed is `PYTHONHASHSEED` if set, else
    /// "vllm-none-hash", as in vLLM 0.29+.
    #[arg(long, value_enum, default_value_t = vllm_hash::HashAlgo::Sha256)]
    prefix_caching_hash_algo: vllm_hash::HashAlgo,
    /// Seed of the output tokens.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Report `usage.prompt_tokens_details.cached_tokens` (vLLM's flag of the same name).
    #[arg(long)]
    enable_prompt_tokens_details: bool,
    /// Serve LoRA adapters (needed for `--lora-modules` and for loading them at run time,
    /// which also needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`).
    #[arg(long)]
    enable_lora: bool,
    /// LoRA adapters served from the start: `name=path` or `{"name": …, "path": …}`.
    #[arg(long, num_args = 1..)]
    lora_modules: Vec<String>,
    /// vLLM's KV-transfer configuration JSON: `kv_connector` (only "NixlConnector"),
    /// `kv_role`, `engine_id`, `kv_load_failure_policy` ("fail" by default, or "recompute");
    /// `kv_connector_extra_config` and other keys are accepted and ignored. Turns on vLLM's
    /// prefill/decode request protocol (`kv_transfer_params`).
    #[arg(long)]
    kv_transfer_config: Option<String>,
    /// The host decoders reach this engine's held blocks at (`remote_host` in prefill
    /// answers; vLLM's `VLLM_NIXL_SIDE_CHANNEL_HOST`). Default: `--host`, or 127.0.0.1 when
    /// that is a wildcard. The port is `--port`.
    #[arg(long, env = "VLLM_NIXL_SIDE_CHANNEL_HOST")]
    kv_side_channel_host: Option<String>,
    /// How long a prefill holds finished blocks for their decoder, in simulated seconds
    /// (vLLM's `VLLM_NIXL_ABORT_REQUEST_TIMEOUT`).
    #[arg(long, env = "VLLM_NIXL_ABORT_REQUEST_TIMEOUT", default_value_t = 480.0)]
    kv_transfer_hold_secs: f64,
    /// Bandwidth of KV transfers between engines, GB/s.
    #[arg(long, default_value_t = 25.0)]
    kv_transfer_gbps: f64,
    /// KV bytes per token a transfer moves. Default: the preset's model's, else 131072
    /// (Llama-3.1-8B in BF16).
    #[arg(long)]
    kv_bytes_per_token: Option<u64>,
    /// SGLang's `--disaggregation-mode`: `prefill` or `decode` turns on SGLang's
    /// prefill/decode request protocol (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`).
    #[arg(long, value_enum, default_value_t = kv_transfer::DisaggregationMode::Null)]
    disaggregation_mode: kv_transfer::DisaggregationMode,
    /// SGLang's `--disaggregation-bootstrap-port`: a prefill server's bootstrap listener (on
    /// `--host`); for a decode server, the port of requests whose `bootstrap_port` is null.
    #[arg(long, default_value_t = 8998)]
    disaggregation_bootstrap_port: u16,
    /// How long one side of an SGLang room waits for the other, in simulated seconds (SGLang's
    /// `SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`): a prefill for its decoder to join, a
    /// decoder for its prefill's KV, a prefill's blocks for their decoder.
    #[arg(long, env = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", default_value_t = 300.0)]
    disaggregation_bootstrap_timeout_secs: f64,
}

impl Cli {
    fn limits(&self) -> scheduler::Limits {
        scheduler::Limits { max_num_seqs: self.max_num_seqs, max_num_batched_tokens: self.max_num_batched_tokens }
    }

    /// vLLM's block hasher, seeded as vLLM seeds it.
    fn hasher(&self) -> vllm_hash::VllmHasher {
        vllm_hash::VllmHasher::new(self.prefix_caching_hash_algo, std::env::var("PYTHONHASHSEED").ok().as_deref())
    }

    fn cost(&self) -> time_model::StepCost {
        let mut c = self.preset.cost();
        let overrides = [
            (self.step_base_us, &mut c.base_us),
            (self.prefill_us_per_token, &mut c.prefill_us_per_token),
            (self.attn_us_per_token_pair, &mut c.attn_us_per_token_pair),
            (self.decode_us_per_seq, &mut c.decode_us_per_seq),
            (self.kv_read_us_per_token, &mut c.kv_read_us_per_token),
            (self.cpu_load_us_per_block, &mut c.cpu_load_us_per_block),
        ];
        for (value, field) in overrides {
            if let Some(v) = value {
                *field = v;
            }
        }
        c
    }

    fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.block_size > 0 && self.num_gpu_blocks_override > 0,
            "block size and block count must be positive"
        );
        anyhow::ensure!(self.max_num_seqs > 0 && self.max_num_batched_tokens > 0, "batch limits must be positive");
        anyhow::ensure!(self.data_parallel_size > 0, "--data-parallel-size must be at least 1");
        anyhow::ensure!(self.speedup.is_finite() && self.speedup > 0.0, "--speedup must be positive");
        anyhow::ensure!(self.lora_modules.is_empty() || self.enable_lora, "--lora-modules needs --enable-lora");
        let c = self.cost();
        let coefficients = [c.base_us, c.prefill_us_per_token, c.attn_us_per_token_pair, c.decode_us_per_seq];
        anyhow::ensure!(
            coefficients
                .iter()
                .chain([&c.kv_read_us_per_token, &c.cpu_load_us_per_block])
                .all(|v| v.is_finite() && *v >= 0.0),
            "time-model coefficients must be finite and non-negative"
        );
        anyhow::ensure!(c.base_us > 0.0 || c.prefill_us_per_token > 0.0, "a step must take some time");
        anyhow::ensure!(
            self.kv_transfer_config.is_none() || self.disaggregation_mode == kv_transfer::DisaggregationMode::Null,
            "--kv-transfer-config (vLLM) and --disaggregation-mode (SGLang) are two protocols: pick one"
        );
        let positive = [self.kv_transfer_gbps, self.kv_transfer_hold_secs, self.disaggregation_bootstrap_timeout_secs];
        anyhow::ensure!(
            positive.iter().all(|v| v.is_finite() && *v > 0.0),
            "--kv-transfer-gbps, --kv-transfer-hold-secs and --disaggregation-bootstrap-timeout-secs must be positive"
        );
        anyhow::ensure!(self.kv_bytes_per_token != Some(0), "--kv-bytes-per-token must be positive");
        Ok(())
    }

    /// The disaggregation protocol the flags ask for, and how this engine moves KV for it.
    fn disaggregation(&self) -> anyhow::Result<(kv_transfer::Protocol, Option<engine::TransferSetup>)> {
        use kv_transfer::{Bootstrap, DisaggregationMode, FailurePolicy, Nixl, Protocol, Side};
        // Every duration is simulated time, run `--speedup` times faster.
        let wall = |secs: f64| Duration::from_secs_f64(secs / self.speedup);
        let bootstrap_wait = wall(self.disaggregation_bootstrap_timeout_secs);
        let timing = kv_transfer::TransferTiming {
            bytes_per_token: self
                .kv_bytes_per_token
                .or(self.preset.kv_bytes_per_token())
                .unwrap_or(kv_transfer::DEFAULT_KV_BYTES_PER_TOKEN),
            gbps: self.kv_transfer_gbps,
            speedup: self.speedup,
        };
        let puller = || kv_transfer::Puller::new(timing, bootstrap_wait).context("building the KV transfer client");
        if let Some(json) = &self.kv_transfer_config {
            let config = kv_transfer::KvTransferConfig::parse(json)?;
            let engine_id = match config.engine_id() {
                Some(id) => id.to_owned(),
                None => format!("{}-{:016x}", self.replica, rand::random::<u64>()),
            };
            let host = match &self.kv_side_channel_host {
                Some(host) => host.clone(),
                None if self.host.is_unspecified() => "127.0.0.1".to_owned(),
                None => self.host.to_string(),
            };
            tracing::info!(%engine_id, role = ?config.role(), policy = ?config.failure_policy(), "vLLM NixlConnector protocol");
            let setup = engine::TransferSetup {
                puller: puller()?,
                on_failure: config.failure_policy(),
                hold: wall(self.kv_transfer_hold_secs),
            };
            let nixl = Nixl::new(engine_id, self.data_parallel_size as usize, host, self.port);
            return Ok((Protocol::Nixl(nixl), Some(setup)));
        }
        let side = match self.disaggregation_mode {
            DisaggregationMode::Null => return Ok((Protocol::Off, None)),
            DisaggregationMode::Prefill => Side::Prefill,
            DisaggregationMode::Decode => Side::Decode,
        };
        // An SGLang decode that cannot get its KV is aborted: there is no recompute policy.
        let setup = engine::TransferSetup { puller: puller()?, on_failure: FailurePolicy::Fail, hold: bootstrap_wait };
        let bootstrap = Bootstrap {
            side,
            port: self.disaggregation_bootstrap_port,
            timeout: bootstrap_wait,
            arrivals: Default::default(),
        };
        Ok((Protocol::Bootstrap(bootstrap), Some(setup)))
    }
}

fn main() -> anyhow::Result<()> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let cli = Cli::parse();
    // Built before the runtime: the exporter's client blocks, on the batch processor's thread.
    let traces = kvgate_telemetry::configured(cli.otlp_traces_endpoint.as_deref(), "vllm")?;
    // The tokenizer describes every table it builds at info: not the operator's business.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info,tk_encode=warn".into());
    tracing_subscriber::registry()
        .with(filter)
        .with(tracing_subscriber::fmt::layer())
        .with(traces.as_ref().map(kvgate_telemetry::layer))
        .init();
    if cli.list_presets {
        print!("{}", time_model::describe_presets());
        return Ok(());
    }
    cli.validate()?;
    if let Some(json) = &cli.fleet_config {
        let config: fleet::FleetConfig = serde_json::from_str(json).context("--fleet-config is not valid")?;
        let cache = kv_cache::KvCache::new(cli.block_size, cli.num_gpu_blocks_override, 0, cli.hasher());
        return fleet::run(&config, cli.limits(), cli.cost(), cache);
    }
    if let Some(path) = &cli.replay {
        let cache = kv_cache::KvCache::new(cli.block_size, cli.num_gpu_blocks_override, 0, cli.hasher());
        return replay::main(path, scheduler::Scheduler::new(cli.limits(), cli.cost(), cache));
    }
    let served = tokio::runtime::Runtime::new()?.block_on(serve(cli));
    if let Some(provider) = traces {
        let _ = provider.shutdown();
    }
    served
}

/// Runs the engine and serves its API until it fails.
async fn serve(cli: Cli) -> anyhow::Result<()> {
    let (protocol, transfer) = cli.disaggregation()?;
    let model = cli.served_model_name.clone().unwrap_or_else(|| cli.model.clone());
    let bundle = ModelBundle::from_dir(&model, &cli.tokenizer, cli.block_size as u32)
        .with_context(|| format!("loading the tokenizer from {}", cli.tokenizer.display()))?;
    let tokenizer = ModelTokenizer::from_bundle(&bundle)?;
    let events_config: kv_events::KvEventsConfig =
        serde_json::from_str(&cli.kv_events_config).context("--kv-events-config is not valid JSON")?;
    let chaos: kv_events::Chaos = serde_json::from_str(&cli.chaos).context("--chaos is not valid JSON")?;
    let mut publishers = Vec::new();
    for rank in 0..cli.data_parallel_size {
        let config = kv_events::KvEventsConfig {
            endpoint: kvgate_shared::endpoint::for_rank(&events_config.endpoint, rank)?,
            replay_endpoint: match &events_config.replay_endpoint {
                Some(e) => Some(kvgate_shared::endpoint::for_rank(e, rank)?),
                None => None,
            },
            ..events_config.clone()
        };
        let endpoint = config.endpoint.clone();
        let publisher =
            kv_events::Publisher::start(config, cli.kv_events_encoding, chaos, cli.seed ^ u64::from(rank), rank)
                .with_context(|| format!("opening KV events at {endpoint}"))?;
        publishers.push(publisher);
    }
    let engine = Arc::new(engine::Engine::start(
        engine::EngineConfig {
            block_size: cli.block_size,
            num_gpu_blocks: cli.num_gpu_blocks_override,
            cpu_offload_blocks: cli.cpu_offload_blocks,
            limits: cli.limits(),
            cost: cli.cost(),
            speedup: cli.speedup,
            hasher: cli.hasher(),
            transfer,
        },
        publishers,
    ));
    let adapters = lora::Registry::default();
    for module in &cli.lora_modules {
        let (name, path) = lora::parse_module(module)?;
        anyhow::ensure!(name != model, "LoRA adapter {name:?} is named like the base model");
        adapters.load(&name, &path)?;
    }
    let runtime_lora_updating = cli.enable_lora
        && std::env::var("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
            .is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true"));
    let state = Arc::new(api::AppState {
        engine,
        tokenizer,
        model,
        adapters,
        runtime_lora_updating,
        replica: cli.replica.clone(),
        seed: cli.seed,
        prompt_tokens_details: cli.enable_prompt_tokens_details,
        max_model_len: cli.num_gpu_blocks_override * cli.block_size,
        prompts_tokenized: Default::default(),
        protocol,
    });
    let listen = SocketAddr::new(cli.host, cli.port);
    let listener = tokio::net::TcpListener::bind(listen).await.with_context(|| format!("binding {listen}"))?;
    // An SGLang prefill server's bootstrap server listens beside the API.
    let bootstrap = match &state.protocol {
        kv_transfer::Protocol::Bootstrap(b) if b.side == kv_transfer::Side::Prefill => {
            let listen = SocketAddr::new(cli.host, cli.disaggregation_bootstrap_port);
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("binding the bootstrap server {listen}"))?;
            Some(axum::serve(listener.tap_io(no_delay), api::bootstrap_router(state.clone())))
        }
        _ => None,
    };
    tracing::info!(replica = %cli.replica, %listen, preset = %cli.preset, speedup = cli.speedup, ranks = cli.data_parallel_size, "kvgate-sim ready");
    let api = axum::serve(listener.tap_io(no_delay), api::router(state));
    match bootstrap {
        Some(bootstrap) => {
            tokio::try_join!(api.into_future(), bootstrap.into_future())?;
        }
        None => api.await?,
    }
    Ok(())
}

/// Small writes (a routing answer, an SSE chunk) must not wait for Nagle + delayed ACK (~40 ms).
fn no_delay(stream: &mut tokio::net::TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::warn!(error = %e, "cannot set TCP_NODELAY");
    }
}
