//! `kvgate-sim`: a vLLM-like engine for tests, the demo and benchmarks, without a GPU.
//!
//! ```text
//! kvgate-sim --listen 127.0.0.1:8001 --replica a --model qwen3 --tokenizer models/qwen3-0.6b \
//!            --block-size 16 --kv-events-config '{"endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}'
//! ```
//!
//! | module | responsibility |
//! |---|---|
//! | `api` | vLLM's OpenAI-compatible HTTP API |
//! | `engine` | admission, the time model, publishing |
//! | `kv_cache` | paged blocks, prefix caching, LRU eviction |
//! | `kv_events` | vLLM's KV-event wire format over ZMQ PUB |

mod api;
mod engine;
mod kv_cache;
mod kv_events;
mod vllm_hash;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use axum::serve::ListenerExt;
use clap::Parser;
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::wire::ModelBundle;

/// A simulated vLLM engine replica.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// HTTP listen address.
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: SocketAddr,
    /// This replica's id (returned in `x-kvgate-replica`).
    #[arg(long, default_value = "sim")]
    replica: String,
    /// The served model name.
    #[arg(long, default_value = "qwen3")]
    model: String,
    /// Directory with tokenizer.json and tokenizer_config.json.
    #[arg(long, default_value = "models/qwen3-0.6b")]
    tokenizer: PathBuf,
    /// KV block size in tokens (vLLM `--block-size`).
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV cache size in blocks (vLLM `--num-gpu-blocks-override`).
    #[arg(long, default_value_t = 8192)]
    num_gpu_blocks: usize,
    /// vLLM's KV-events configuration JSON: `endpoint`, `replay_endpoint`, `topic`,
    /// `buffer_steps`, `hwm` (other keys are accepted and ignored).
    #[arg(long, default_value = r#"{"endpoint":"tcp://*:5557"}"#)]
    kv_events_config: String,
    /// Event layout: `map` (vLLM 0.24+) or `legacy-array` (vLLM 0.22/0.23 positional).
    #[arg(long, value_enum, default_value_t = kv_events::Encoding::Map)]
    kv_events_encoding: kv_events::Encoding,
    /// Fault injection on the event stream at start (JSON, see `POST /_chaos/events`).
    #[arg(long, default_value = "{}")]
    chaos: String,
    /// Prefill time per uncached prompt token, in microseconds.
    #[arg(long, default_value_t = 100)]
    prefill_us_per_token: u64,
    /// Decode time per output token, in microseconds.
    #[arg(long, default_value_t = 5000)]
    decode_us_per_token: u64,
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
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let cli = Cli::parse();
    anyhow::ensure!(cli.block_size > 0 && cli.num_gpu_blocks > 0, "block size and block count must be positive");
    let bundle = ModelBundle::from_dir(&cli.model, &cli.tokenizer, cli.block_size as u32)
        .with_context(|| format!("loading the tokenizer from {}", cli.tokenizer.display()))?;
    let tokenizer = ModelTokenizer::from_bundle(&bundle)?;
    let events_config: kv_events::KvEventsConfig =
        serde_json::from_str(&cli.kv_events_config).context("--kv-events-config is not valid JSON")?;
    let chaos: kv_events::Chaos = serde_json::from_str(&cli.chaos).context("--chaos is not valid JSON")?;
    let publisher = kv_events::Publisher::start(events_config.clone(), cli.kv_events_encoding, chaos, cli.seed)
        .with_context(|| format!("opening KV events at {}", events_config.endpoint))?;
    let engine = Arc::new(engine::Engine::new(
        engine::EngineConfig {
            block_size: cli.block_size,
            num_blocks: cli.num_gpu_blocks,
            prefill_us_per_token: cli.prefill_us_per_token,
            decode_us_per_token: cli.decode_us_per_token,
            hasher: vllm_hash::VllmHasher::new(
                cli.prefix_caching_hash_algo,
                std::env::var("PYTHONHASHSEED").ok().as_deref(),
            ),
        },
        publisher,
    ));
    let state = Arc::new(api::AppState {
        engine,
        tokenizer,
        model: cli.model,
        replica: cli.replica.clone(),
        seed: cli.seed,
        prompt_tokens_details: cli.enable_prompt_tokens_details,
    });
    let listener =
        tokio::net::TcpListener::bind(cli.listen).await.with_context(|| format!("binding {}", cli.listen))?;
    tracing::info!(replica = %cli.replica, listen = %cli.listen, "kvgate-sim ready");
    axum::serve(listener.tap_io(no_delay), api::router(state)).await?;
    Ok(())
}

/// Small writes (a routing answer, an SSE chunk) must not wait for Nagle + delayed ACK (~40 ms).
fn no_delay(stream: &mut tokio::net::TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::warn!(error = %e, "cannot set TCP_NODELAY");
    }
}
