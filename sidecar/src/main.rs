//! `kvgate-sidecar`: one per gateway pod. Subscribes to every engine's KV events, keeps the KV
//! index and the load table, and answers the filter's routing calls on loopback.
//!
//! ```text
//! kvgate-sidecar --config kvgate.toml
//! ```

#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::serve::ListenerExt;
use clap::{Parser, Subcommand};
use kvgate_shared::codec;
use kvgate_shared::prompt::content_format::ContentFormat;
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::prompt::Renderer;

use kvgate_sidecar::config::{Config, PoolSection, ProcessEnv};
use kvgate_sidecar::discovery::dns::SystemResolver;
use kvgate_sidecar::discovery::{DiscoveryConfig, DiscoveryKind, Supervisor};
use kvgate_sidecar::health::Health;
use kvgate_sidecar::metrics::Metrics;
use kvgate_sidecar::pool::Pool;
use kvgate_sidecar::sync::SyncConfig;
use kvgate_sidecar::{api, discovery};
use kvgate_telemetry as telemetry;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::Layer;

/// KV-cache-aware routing sidecar for Envoy.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// The TOML configuration file (for serving, the default command).
    #[arg(long, short, env = "KVGATE_CONFIG", default_value = "kvgate.toml")]
    config: PathBuf,
    /// How log lines are written, on stderr: `text`, or `json` (one object a line, each
    /// event's fields — a request's `request_id` — at its top level).
    #[arg(long, global = true, env = "KVGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Export spans over OTLP/HTTP to this collector (`http://host:4318`; spans are posted to
    /// `<endpoint>/v1/traces`). Off when unset.
    #[arg(long, global = true, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the filter's API (the default).
    Serve,
    /// Validate a configuration file and exit.
    CheckConfig {
        /// The file.
        file: PathBuf,
    },
    /// Inspect KV events with the sidecar's own decoder.
    #[command(subcommand)]
    Events(EventsCommand),
    /// Fetch a model's tokenizer files from the Hugging Face Hub into a directory (an init
    /// step's job), and check that they load.
    FetchTokenizer {
        /// The repository, e.g. `Qwen/Qwen3-8B`.
        #[arg(long)]
        repo: String,
        /// A commit to pin (a branch or tag works, and moves).
        #[arg(long)]
        revision: String,
        /// The directory to fill: the pool's `tokenizer`.
        #[arg(long)]
        dest: PathBuf,
        /// The Hub, or a mirror with its layout.
        #[arg(long, env = "HF_ENDPOINT", default_value = kvgate_sidecar::tools::hub::HUB)]
        endpoint: String,
        /// A token for gated or private repositories.
        #[arg(long, env = "HF_TOKEN", hide_env_values = true)]
        token: Option<String>,
    },
    /// Print the token ids and block hashes the filter computes for a request body (stdin).
    Tokenize {
        /// Directory with tokenizer.json and tokenizer_config.json.
        #[arg(long)]
        model_dir: PathBuf,
        /// The pool's block size.
        #[arg(long, default_value_t = 16)]
        block_size: u32,
        /// Which endpoint the body is for.
        #[arg(long, value_enum, default_value_t = Api::Chat)]
        endpoint: Api,
        /// How message content reaches the chat template (as vLLM's flag of this name).
        #[arg(long, value_enum, default_value_t = Format::Auto)]
        chat_template_content_format: Format,
    },
}

/// vLLM's `--chat-template-content-format`.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum Format {
    /// Detected from the template.
    Auto,
    /// One string per message.
    String,
    /// A list of text parts per message.
    Openai,
}

/// The OpenAI endpoint of a body.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum Api {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completions,
    /// `/v1/responses`
    Responses,
    /// `/v1/messages`
    Messages,
}

#[derive(Subcommand, Debug)]
enum EventsCommand {
    /// Decode msgpack payload files (one payload per file), one JSON line each.
    Decode {
        /// Payload files.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Subscribe to an engine and print every batch as a JSON line, flagging gaps.
    Tap {
        /// The engine's KV-events endpoint, e.g. tcp://127.0.0.1:5557.
        endpoint: String,
        /// The engine's replay endpoint: gaps are replayed and printed.
        #[arg(long)]
        replay: Option<String>,
        /// Topic prefix.
        #[arg(long, default_value = "")]
        topic: String,
        /// Stop after this many messages.
        #[arg(long)]
        count: Option<u64>,
    },
}

/// How log lines are written.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object a line, for log pipelines.
    Json,
}

/// Logs to stderr in `format`, filtered by `RUST_LOG`; with a tracer provider, spans go to it too.
fn init_logging(format: LogFormat, traces: Option<&SdkTracerProvider>) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    // The tokenizer describes every table it builds at info: not the operator's business.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info,tk_encode=warn".into());
    let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let logs = match format {
        LogFormat::Text => logs.boxed(),
        // A request's span (its trace id) comes along as `span`.
        LogFormat::Json => logs.json().flatten_event(true).with_current_span(true).with_span_list(false).boxed(),
    };
    let spans = traces.map(telemetry::layer);
    tracing_subscriber::registry().with(filter).with(logs).with(spans).init();
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // Built before any runtime: the exporter's client blocks, on the batch processor's thread.
    let traces = telemetry::configured(cli.otlp_endpoint.as_deref(), "kvgate-sidecar")?;
    init_logging(cli.log_format, traces.as_ref());
    let result = run_command(cli);
    // Sends the spans still waiting.
    if let Some(provider) = traces {
        let _ = provider.shutdown();
    }
    result
}

fn run_command(cli: Cli) -> anyhow::Result<()> {
    let stdout = &mut std::io::stdout();
    match cli.command.unwrap_or(Command::Serve) {
        Command::Serve => match tokio::runtime::Runtime::new()?.block_on(run(cli.config)) {
            Ended::Shutdown => Ok(()),
            // The container restarts; Envoy, in its own, keeps serving and fails open.
            Ended::Unhealthy => std::process::exit(EXIT_UNHEALTHY),
        },
        Command::CheckConfig { file } => {
            let config = Config::load(&file, &ProcessEnv)?;
            // Load each tokenizer and template as the filter will: a `tokenizer.json` using a
            // component kvgate's tokenizer does not build in is refused here, by name.
            for PoolSection { pool, .. } in &config.pools {
                let bundle = pool.bundle().with_context(|| format!("pool {:?}: tokenizer", pool.model))?;
                ModelTokenizer::from_bundle(&bundle).with_context(|| format!("pool {:?}: tokenizer", pool.model))?;
                if bundle.renderer == Renderer::Harmony {
                    println!("pool {:?}: chats are rendered with harmony, as vLLM renders gpt-oss", pool.model);
                }
            }
            println!("{}: ok ({} pools)", file.display(), config.pools.len());
            Ok(())
        }
        Command::Events(EventsCommand::Decode { files }) => {
            if kvgate_sidecar::tools::decode_files(&files, stdout)? {
                Ok(())
            } else {
                anyhow::bail!("some payloads did not decode")
            }
        }
        Command::Events(EventsCommand::Tap { endpoint, replay, topic, count }) => {
            kvgate_sidecar::tools::tap(&endpoint, replay.as_deref(), &topic, count, stdout)
        }
        Command::FetchTokenizer { repo, revision, dest, endpoint, token } => {
            let fetch = kvgate_sidecar::tools::hub::Fetch { endpoint, repo, revision, token, dest };
            let written = kvgate_sidecar::tools::hub::fetch(&fetch)?;
            println!(
                "{}: {} from {} at {}, loads",
                fetch.dest.display(),
                written.join(", "),
                fetch.repo,
                fetch.revision
            );
            Ok(())
        }
        Command::Tokenize { model_dir, block_size, endpoint, chat_template_content_format } => {
            let mut body = Vec::new();
            std::io::Read::read_to_end(&mut std::io::stdin(), &mut body)?;
            let endpoint = match endpoint {
                Api::Chat => kvgate_shared::prompt::openai::Endpoint::ChatCompletions,
                Api::Completions => kvgate_shared::prompt::openai::Endpoint::Completions,
                Api::Responses => kvgate_shared::prompt::openai::Endpoint::Responses,
                Api::Messages => kvgate_shared::prompt::openai::Endpoint::Messages,
            };
            let format = match chat_template_content_format {
                Format::Auto => ContentFormat::Auto,
                Format::String => ContentFormat::String,
                Format::Openai => ContentFormat::Openai,
            };
            println!("{}", kvgate_sidecar::tools::tokenize(&model_dir, block_size, format, endpoint, &body)?);
            Ok(())
        }
    }
}

/// Runs `work` on every pool each `period`, for as long as the runtime runs.
fn every(pools: &HashMap<String, Arc<Pool>>, period: Duration, work: impl Fn(&Pool) + Send + 'static) {
    let pools: Vec<Arc<Pool>> = pools.values().cloned().collect();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        loop {
            tick.tick().await;
            pools.iter().for_each(|pool| work(pool));
        }
    });
}

/// The exit status of a sidecar that ended because a background thread died or stalled.
const EXIT_UNHEALTHY: i32 = 70;
/// The first wait before a failed start-up is tried again; it doubles up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_secs(5);
const RETRY_MAX: Duration = Duration::from_secs(60);

/// How serving ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    /// A shutdown signal.
    Shutdown,
    /// A background thread ended or stalled: the process ends, and its container restarts.
    Unhealthy,
}

/// Serves until a shutdown signal or a dead thread. A start-up that fails (a config that does
/// not load, a tokenizer that cannot, a port in use) does not end the process — a container
/// that crash-loops takes the whole gateway pod out of its Service: the sidecar serves
/// degraded ([`api::degraded_router`]: route calls answered 503 at once, so the filter fails
/// open; `/livez` up, `/healthz` saying why) and tries again, waiting 5 s, then twice as long
/// each time up to a minute.
async fn run(config_path: PathBuf) -> Ended {
    let mut wait = RETRY_FIRST;
    loop {
        let health = Health::new();
        let loaded = Config::load(&config_path, &ProcessEnv);
        let listeners = loaded.as_ref().map_or_else(|_| fallback_listeners(), |c| (c.listen, c.metrics_listen));
        let error = match loaded {
            Ok(config) => match serve(config, config_path.clone(), health.clone()).await {
                Ok(ended) => return ended,
                Err(e) => e,
            },
            Err(e) => e,
        };
        // Whatever started is told to stop before the next try binds its ports again.
        health.stop();
        tracing::error!(error = %format!("{error:#}"), retry_in_secs = wait.as_secs(), "start-up failed; serving degraded until the next try");
        health.startup_failed(format!("{error:#}"));
        if degraded(listeners, health, wait).await {
            return Ended::Shutdown;
        }
        wait = (wait * 2).min(RETRY_MAX);
    }
}

/// Where a sidecar whose config cannot be read listens while degraded: the API's default
/// address, and `KVGATE_METRICS_LISTEN` if set (the liveness probe's port).
fn fallback_listeners() -> (SocketAddr, Option<SocketAddr>) {
    let metrics = std::env::var("KVGATE_METRICS_LISTEN").ok().and_then(|v| v.parse().ok());
    (Config::default_listen(), metrics)
}

/// Serves [`api::degraded_router`] on `listeners` for `wait`, or until a shutdown signal
/// (then true).
async fn degraded(listeners: (SocketAddr, Option<SocketAddr>), health: Arc<Health>, wait: Duration) -> bool {
    let (tx, _) = tokio::sync::broadcast::channel::<()>(1);
    let mut servers = Vec::new();
    for addr in std::iter::once(listeners.0).chain(listeners.1) {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(listener) => {
                let mut done = tx.subscribe();
                let app = api::degraded_router(health.clone());
                servers.push(tokio::spawn(async move {
                    let shutdown = async move {
                        let _ = done.recv().await;
                    };
                    let _ = axum::serve(listener, app).with_graceful_shutdown(shutdown).await;
                }));
            }
            Err(e) => tracing::warn!(%addr, error = %e, "cannot listen while degraded"),
        }
    }
    let shutdown = tokio::select! {
        _ = tokio::time::sleep(wait) => false,
        _ = shutdown_signal() => true,
    };
    let _ = tx.send(());
    for s in servers {
        let _ = s.await;
    }
    shutdown
}

/// Starts everything and serves; `Err` when start-up fails (nothing left running but what
/// `health`'s stop flag stops).
async fn serve(config: Config, config_path: PathBuf, health: Arc<Health>) -> anyhow::Result<Ended> {
    let metrics = Arc::new(Metrics::default());
    // The ports first: a port in use fails start-up before any thread starts.
    let listener =
        tokio::net::TcpListener::bind(config.listen).await.with_context(|| format!("binding {}", config.listen))?;
    let metrics_listener = match config.metrics_listen {
        Some(addr) => Some(tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?),
        None => None,
    };

    let mut pools = HashMap::new();
    let mut sources = HashMap::new();
    for PoolSection { pool: pool_config, discovery: found } in &config.pools {
        let bundle =
            pool_config.bundle().with_context(|| format!("loading the tokenizer of {:?}", pool_config.model))?;
        tracing::info!(model = %pool_config.model, renderer = ?bundle.renderer, "chat renderer");
        let bundle = codec::encode(&bundle)?;
        let pool = Arc::new(Pool::new(pool_config.clone(), bundle, metrics.clone()));
        pools.insert(pool_config.model.clone(), pool);
        sources.insert(pool_config.model.clone(), found.clone());
    }
    // What reading the tokenizer files peaked at goes back to the system (`heap`) before the
    // tokenizers for offloaded prompts load, so that the two peaks do not add up. Those load
    // now so that the first such prompt does not pay for it (and time out in the filter): off
    // the runtime, while the API already answers, and one model after another on one thread,
    // so that each load reuses the memory the one before freed; then the rest goes back too.
    kvgate_sidecar::heap::release_free_pages();
    let warming: Vec<Arc<Pool>> = pools.values().cloned().collect();
    tokio::task::spawn_blocking(move || {
        for pool in warming {
            if let Err(e) = pool.tokenizer() {
                tracing::error!(model = %pool.config().model, error = %e, "cannot load the tokenizer for offloaded prompts");
            }
        }
        kvgate_sidecar::heap::release_free_pages();
    });

    let reload = Arc::new(AtomicBool::new(false));
    let zmq_ctx = zmq::Context::new();
    let (mut supervisors, mut watchers) = (Vec::new(), Vec::new());
    let drivers = Drivers { supervisors: &mut supervisors, watchers: &mut watchers };
    if let Err(e) =
        start_drivers(&config, &config_path, &pools, &sources, &metrics, &health, &zmq_ctx, &reload, drivers)
    {
        for s in &supervisors {
            s.shutdown();
        }
        return Err(e);
    }
    tokio::spawn(async move {
        let Ok(mut hup) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) else { return };
        while hup.recv().await.is_some() {
            tracing::info!("SIGHUP: reloading the config file");
            reload.store(true, Ordering::Relaxed);
        }
    });

    let expiry = Duration::from_secs(config.request_expiry_secs);
    let stall = Duration::from_secs(config.stall_timeout_secs);
    every(&pools, Duration::from_secs(1), move |pool| {
        pool.check_stalls(stall);
        pool.retire_departed();
        let n = pool.expire(expiry);
        if n > 0 {
            tracing::warn!(model = %pool.config().model, n, "released bookings whose end was never reported");
        }
    });
    // Non-streamed requests' prefills end on estimates: checked ten times a second.
    every(&pools, Duration::from_millis(100), Pool::end_estimated_prefills);

    let state = api::AppState::new(pools, config.scoring.clone(), config.allow_request_overrides, metrics)
        .with_offload_queue_bytes(config.offload_queue_bytes)
        .with_offload_spread(config.offload_spread_threads)
        .with_health(health.clone());
    let state = Arc::new(match config.offload_threads {
        Some(threads) => state.with_offload_slots(threads),
        None => state,
    });
    if let Some(listener) = metrics_listener {
        let app = api::metrics_router(state.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "the metrics listener failed");
            }
        });
        tracing::info!(addr = ?config.metrics_listen, "metrics and health on");
    }
    tracing::info!(listen = %config.listen, "kvgate-sidecar ready");
    let ended = Arc::new(std::sync::Mutex::new(Ended::Shutdown));
    let stopped = {
        let (health, ended) = (health.clone(), ended.clone());
        async move {
            let why = tokio::select! {
                _ = shutdown_signal() => Ended::Shutdown,
                _ = unhealthy(&health) => Ended::Unhealthy,
            };
            *ended.lock().unwrap_or_else(|e| e.into_inner()) = why;
        }
    };
    axum::serve(listener.tap_io(no_delay), api::router(state)).with_graceful_shutdown(stopped).await?;

    health.stop();
    for w in watchers {
        let _ = w.join();
    }
    for s in &supervisors {
        s.shutdown();
    }
    let ended = *ended.lock().unwrap_or_else(|e| e.into_inner());
    Ok(ended)
}

/// Resolves once a background thread has ended or stalled (checked every second), logging it.
async fn unhealthy(health: &Health) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let problems = health.report(std::time::Instant::now());
        if !problems.is_empty() {
            tracing::error!(
                ?problems,
                "a background thread died or stalled; ending the sidecar (its container restarts)"
            );
            return;
        }
    }
}

/// What [`start_drivers`] has started so far: the caller's, so that a start-up failing half
/// way can shut the supervisors down (the threads stop with `health`'s flag).
struct Drivers<'a> {
    supervisors: &'a mut Vec<Arc<Supervisor>>,
    watchers: &'a mut Vec<std::thread::JoinHandle<()>>,
}

/// The sidecars' mesh, event streams, discovery and pollers, started in order for `serve`.
#[allow(clippy::too_many_arguments)]
fn start_drivers(
    config: &Config,
    config_path: &std::path::Path,
    pools: &HashMap<String, Arc<Pool>>,
    sources: &HashMap<String, DiscoveryConfig>,
    metrics: &Arc<Metrics>,
    health: &Arc<Health>,
    zmq_ctx: &zmq::Context,
    reload: &Arc<AtomicBool>,
    started: Drivers<'_>,
) -> anyhow::Result<()> {
    let Drivers { supervisors, watchers } = started;
    // The mesh id is settled once (it may be random): the handover and sync use the same.
    let sync = config.sync.clone().map(|s| SyncConfig { id: Some(s.id()), ..s });
    // The key read once: every socket of the mesh seals with the same.
    let sealer = sync.as_ref().map(SyncConfig::sealer).transpose()?;
    let own_id = sync.as_ref().map_or_else(|| "local".to_owned(), SyncConfig::id);
    if let Some(file) = &config.state_file {
        let dir = file.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
        anyhow::ensure!(dir.is_dir(), "state_file = {}: its directory does not exist", file.display());
    }
    let mut from_peer = None;
    if let (Some(sync), Some(sealer)) = (&sync, &sealer) {
        // The mesh first, so that peers' request ends are heard while their view is taken
        // over (an end that comes before its booking is remembered, and the booking skipped);
        // then, before any event stream starts, a peer's view, if a peer runs.
        watchers.extend(kvgate_sidecar::sync::start(sync, pools, metrics.clone(), zmq_ctx, health, sealer)?);
        from_peer = kvgate_sidecar::sync::state::recover(sync, &own_id, pools, zmq_ctx, sealer);
    }
    // With no peer's view, the one this sidecar saved before it restarted, if any.
    if let (None, Some(file)) = (&from_peer, &config.state_file) {
        if let Err(e) = kvgate_sidecar::sync::saved::restore(file, &own_id, pools) {
            tracing::warn!(error = %e, "the saved view was not taken; the index is rebuilt from the engines");
        }
    }
    for (model, pool) in pools {
        let found = sources[model].clone();
        let kind = found.kind;
        let supervisor = Arc::new(Supervisor::start(zmq_ctx.clone(), pool.clone(), found, metrics.clone())?);
        match kind {
            DiscoveryKind::Static => {}
            DiscoveryKind::Dns => watchers.push(discovery::dns::spawn(supervisor.clone(), SystemResolver, health)?),
            DiscoveryKind::Envoy => watchers.push(discovery::envoy::spawn(supervisor.clone(), health)?),
        }
        supervisors.push(supervisor);
    }
    let static_pools: Vec<Arc<Supervisor>> =
        supervisors.iter().filter(|s| s.discovery().kind == DiscoveryKind::Static).cloned().collect();
    if !static_pools.is_empty() {
        let interval = Duration::from_secs(static_pools[0].discovery().interval_secs);
        let path = config_path.to_path_buf();
        let load = move || {
            let config = Config::load(&path, &ProcessEnv)?;
            Ok(config.pools.into_iter().map(|s| (s.pool, s.discovery)).collect())
        };
        let file = config_path.to_path_buf();
        watchers.push(discovery::watch_file(file, load, interval, static_pools, reload.clone(), health)?);
    }
    for pool in pools.values().filter(|p| p.config().adapters_poll_secs > 0) {
        let interval = Duration::from_secs(pool.config().adapters_poll_secs);
        watchers.push(discovery::adapters::spawn(pool.clone(), interval, health)?);
    }
    for pool in pools.values().filter(|p| p.config().engine_metrics_secs > 0) {
        let interval = Duration::from_secs(pool.config().engine_metrics_secs);
        watchers.push(kvgate_sidecar::engine_poller::spawn(pool.clone(), interval, health)?);
    }
    if let (Some(sync), Some(sealer)) = (&sync, &sealer) {
        // Our own view is handed to starting peers once our streams run.
        let handover = kvgate_sidecar::sync::state::serve(
            sync,
            sync.id(),
            pools.clone(),
            metrics.clone(),
            zmq_ctx,
            health,
            sealer,
        );
        watchers.push(handover?);
    }
    if let Some(file) = &config.state_file {
        let every = Duration::from_secs(config.state_save_secs);
        let saver =
            kvgate_sidecar::sync::saved::spawn(file.clone(), every, own_id, pools.clone(), metrics.clone(), health);
        watchers.push(saver?);
    }
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return ctrl_c.await.unwrap_or(()),
    };
    tokio::select! {
        _ = ctrl_c => {}
        _ = term.recv() => {}
    }
}

/// Small writes (a routing answer, an SSE chunk) must not wait for Nagle + delayed ACK (~40 ms).
fn no_delay(stream: &mut tokio::net::TcpStream) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::warn!(error = %e, "cannot set TCP_NODELAY");
    }
}
