//! Starting and stopping a whole kvgate deployment on loopback.

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{json, Value};

use crate::client;
use crate::delay_proxy::DelayProxy;
use crate::envoy::{self, EnvoyParams, Fallback};
use crate::hung::HungSidecar;
use crate::process::{free_port, free_port_run, wait_for, Proc};
use crate::{repo_root, Artifacts};

/// How the gateway routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing {
    /// The kvgate filter and sidecar.
    Kvgate,
    /// Plain Envoy round robin (no filter, no sidecar): the baseline.
    RoundRobin,
    /// Plain Envoy least request (no filter, no sidecar).
    LeastRequest,
}

/// A kept decision's booking key, and the TTFT and ITL it predicted on the replica it chose
/// (wall-clock seconds; `None` while that replica's model did not predict), with the inputs
/// each model was given there (`/debug/explain`'s `ttft_inputs`, `itl_inputs`; `None` for a
/// request that was not timed).
#[derive(Debug, Clone, PartialEq)]
pub struct Predicted {
    pub booking: String,
    pub ttft: Option<f64>,
    pub itl: Option<f64>,
    pub ttft_inputs: Option<Value>,
    pub itl_inputs: Option<Value>,
}

/// Each checked `latency` (`"ttft"` or `"itl"`) prediction's relative error,
/// |predicted − measured| / measured, among kept decisions ([`Stack::decisions_of`]).
pub fn latency_errors_in(decisions: &[Value], latency: &str) -> Vec<f64> {
    let field = format!("{latency}_checked");
    decisions
        .iter()
        .filter_map(|d| {
            let checked = &d[field.as_str()];
            let (predicted, measured) = (checked["predicted_secs"].as_f64()?, checked["measured_secs"].as_f64()?);
            Some((predicted - measured).abs() / measured)
        })
        .collect()
}

/// What each of the kept decisions ([`Stack::decisions_of`]) predicted.
pub fn predictions_in(decisions: &[Value]) -> Vec<Predicted> {
    decisions
        .iter()
        .filter_map(|d| {
            let inputs = |field: &str| Some(d[field].clone()).filter(|v| !v.is_null());
            Some(Predicted {
                booking: d["request_id"].as_str()?.to_owned(),
                ttft: d["predicted_ttft_secs"].as_f64(),
                itl: d["predicted_itl_secs"].as_f64(),
                ttft_inputs: inputs("ttft_inputs"),
                itl_inputs: inputs("itl_inputs"),
            })
        })
        .collect()
}

/// What to start.
#[derive(Debug, Clone)]
pub struct StackOptions {
    /// A name for the log directory.
    pub name: String,
    /// The model name the engines serve and the pool routes (`qwen3`; a Hugging Face name
    /// such as `Qwen/Qwen3-0.6B` works the same).
    pub model: String,
    /// Number of simulated engines.
    pub replicas: usize,
    /// KV block size (engines and pool).
    pub block_size: u32,
    /// A pool block size other than the engines' (a misconfiguration, for tests of what
    /// kvgate says about it).
    pub pool_block_size: Option<u32>,
    /// Routing mode.
    pub routing: Routing,
    /// Filter decision timeout.
    pub route_timeout_ms: u64,
    /// The kvgate pool's policy (`kv_aware`, `least_load`, `round_robin`, …).
    pub pool_policy: String,
    /// Lines of the sidecar's `[scoring]` table (empty: kvgate's defaults).
    pub scoring_toml: String,
    /// More keys of the sidecar's pool (e.g. `engine_metrics_secs = 1`).
    pub pool_toml: String,
    /// Simulator flags for the time model, cache size and batch limits (see `kvgate-sim
    /// --help`); the default is fast functional-test timing: 2 ms steps, 100 µs per prompt
    /// token.
    pub sim_args: Vec<String>,
    /// More pools beside the engines' model, routed to the same engines: each a model name and
    /// its tokenizer's directory (so that the filter loads several tokenizers).
    pub extra_models: Vec<(String, PathBuf)>,
    /// Filter configuration keys set over the test defaults (`forward_tokens`,
    /// `offload_bytes`, …).
    pub filter_config: serde_json::Map<String, Value>,
    /// The sidecar discovers the engines from Envoy's admin API (`envoy` discovery) instead
    /// of a list; each engine's events and replay ports are its HTTP port + 1 and + 2.
    pub envoy_discovery: bool,
    /// Data-parallel ranks per engine (`--data-parallel-size`); each rank publishes on its
    /// own events port (the base + rank).
    pub data_parallel_size: u32,
    /// The sidecar replays missed events from the engines (`kv_replay`); false leaves it out.
    pub replay: bool,
    /// Engine steps each engine keeps for replay (vLLM's `buffer_steps`; default 10 000).
    pub replay_buffer_steps: Option<usize>,
    /// Top-level keys of the sidecar's config (e.g. `stall_timeout_secs = 1`).
    pub sidecar_toml: String,
    /// Envoy reaches the sidecar through a proxy that delays each request this long (0: directly).
    pub sidecar_delay_ms: u64,
    /// Start Envoy ready for hot restarts ([`Stack::hot_restart_envoy`]).
    pub hot_restart: bool,
    /// Gateway pods in front of the engines, each its own Envoy (and sidecar, with kvgate):
    /// the first is the one every single-gateway method speaks to.
    pub gateways: usize,
    /// With several kvgate gateways, their sidecars share bookings over the sync mesh.
    pub sync: bool,
    /// Prefill/decode disaggregation of the pool (none by default).
    pub disaggregation: Option<Disaggregation>,
    /// The engines report cached prompt tokens (`--enable-prompt-tokens-details`, as vLLM
    /// must be told to); false leaves the flag out.
    pub prompt_tokens_details: bool,
    /// A wasm module Envoy loads in the filter's place (a VM that fails, for the fail-open
    /// tests); `None`: the built filter.
    pub wasm: Option<PathBuf>,
    /// Also start Envoy alone (no filter, round robin) in front of the same engines: the
    /// baseline the latency kvgate adds is measured against ([`Stack::baseline`]).
    pub baseline_gateway: bool,
    /// Envoy's worker threads (`--concurrency`), each with its own wasm VM.
    pub envoy_concurrency: u32,
    /// The port of an OTLP/HTTP collector on loopback ([`crate::otlp::Collector`]): Envoy,
    /// the sidecars and the engines export their spans to it. None: no tracing.
    pub otlp_port: Option<u16>,
}

/// A disaggregated pool: the engines' protocol and what each engine does.
#[derive(Debug, Clone)]
pub struct Disaggregation {
    /// `vllm` (engines run with a NixlConnector `--kv-transfer-config`) or `sglang` (prefill
    /// engines with a bootstrap port).
    pub mode: String,
    /// Each engine's role in order: `prefill`, `decode` or `both`.
    pub roles: Vec<String>,
    /// More keys of the pool's `disaggregation` table, e.g. `min_remote_prefill_tokens = 64`.
    pub keys: String,
}

impl Disaggregation {
    /// The role of engine `i` (`both` past the list).
    fn role(&self, i: usize) -> &str {
        self.roles.get(i).map_or("both", String::as_str)
    }
}

impl Default for StackOptions {
    fn default() -> Self {
        StackOptions {
            name: "stack".into(),
            model: "qwen3".into(),
            replicas: 3,
            block_size: 16,
            pool_block_size: None,
            routing: Routing::Kvgate,
            route_timeout_ms: 500,
            pool_policy: "kv_aware".into(),
            scoring_toml: String::new(),
            pool_toml: String::new(),
            sim_args: ["--preset", "test", "--prefill-us-per-token", "100", "--step-base-us", "2000"]
                .map(String::from)
                .to_vec(),
            extra_models: Vec::new(),
            filter_config: serde_json::Map::new(),
            envoy_discovery: false,
            data_parallel_size: 1,
            replay: true,
            replay_buffer_steps: None,
            sidecar_toml: String::new(),
            sidecar_delay_ms: 0,
            hot_restart: false,
            gateways: 1,
            sync: true,
            disaggregation: None,
            prompt_tokens_details: true,
            wasm: None,
            baseline_gateway: false,
            otlp_port: None,
            envoy_concurrency: 1,
        }
    }
}

/// One simulated engine.
pub struct SimHandle {
    /// Replica id (`x-kvgate-replica`).
    pub id: String,
    /// Its address.
    pub host: std::net::IpAddr,
    /// HTTP port.
    pub port: u16,
    /// KV-events PUB port.
    pub events_port: u16,
    /// KV-events replay ROUTER port.
    pub replay_port: u16,
    /// Its SGLang bootstrap port, when it prefills for an SGLang-mode pool.
    pub bootstrap_port: Option<u16>,
    /// Its role in a disaggregated pool.
    pub role: Option<String>,
    proc: Proc,
}

impl SimHandle {
    /// An engine on 127.0.0.1 that the caller started (a real vLLM, say): its HTTP port, its
    /// KV-events PUB and replay ports, and its process.
    pub fn new(id: &str, port: u16, events_port: u16, replay_port: u16, proc: Proc) -> SimHandle {
        SimHandle {
            id: id.to_owned(),
            host: [127, 0, 0, 1].into(),
            port,
            events_port,
            replay_port,
            bootstrap_port: None,
            role: None,
            proc,
        }
    }

    /// `http://host:port{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}:{}{path}", self.host, self.port)
    }

    /// `host:port`: the replica id the sidecar gives it under `envoy` discovery.
    pub fn endpoint(&self) -> std::net::SocketAddr {
        std::net::SocketAddr::new(self.host, self.port)
    }

    /// A metric from the engine's `/metrics`, summed over its label sets (DP ranks).
    pub fn metric(&self, name: &str) -> anyhow::Result<f64> {
        let text = client::client().get(self.url("/metrics")).send()?.error_for_status()?.text()?;
        Ok(metric_sum(&text, name, ""))
    }
}

/// The sum of metric `name`'s samples in a Prometheus text exposition, over the label sets
/// whose labels contain `labels` (`""`: all of them).
pub fn metric_sum(text: &str, name: &str, labels: &str) -> f64 {
    let (labelled, bare) = (format!("{name}{{"), format!("{name} "));
    text.lines()
        .filter(|line| {
            (line.starts_with(&labelled) && line.contains(labels)) || (labels.is_empty() && line.starts_with(&bare))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A running deployment; dropping it stops everything.
pub struct Stack {
    /// The model name the engines serve.
    pub model: String,
    /// The engines, in pool order.
    pub sims: Vec<SimHandle>,
    /// Every gateway pod ([`StackOptions::gateways`]); the first is the one the
    /// single-gateway methods speak to.
    gateways: Vec<Gateway>,
    _delay_proxy: Option<DelayProxy>,
    /// Envoy alone in front of the same engines, and its listener port.
    baseline: Option<(Proc, u16)>,
    /// Envoy processes replaced by a hot restart, draining until they exit by themselves.
    retired_envoys: Vec<Proc>,
    envoy_config: PathBuf,
    envoy_bin: PathBuf,
    envoy_epoch: u32,
    envoy_concurrency: u32,
    hot_restart: bool,
    /// Where logs and generated configs are.
    pub dir: PathBuf,
}

static STACKS: AtomicUsize = AtomicUsize::new(0);

const START_TIMEOUT: Duration = Duration::from_secs(60);
/// Engines may take longer: a real vLLM on CPU needs about a minute to load.
const ENGINE_START_TIMEOUT: Duration = Duration::from_secs(240);

fn http_ok(url: &str) -> bool {
    client::client().get(url).timeout(Duration::from_secs(2)).send().is_ok_and(|r| r.status().is_success())
}

impl Stack {
    /// Starts engines, sidecar (kvgate mode) and Envoy, and waits until the gateway routes
    /// with a loaded tokenizer.
    pub fn start(opts: &StackOptions, artifacts: &Artifacts) -> anyhow::Result<Stack> {
        artifacts.check()?;
        let dir = log_dir(&opts.name)?;
        // The engines load their tokenizers side by side (about two seconds of CPU each),
        // then each is waited for in turn.
        let ids: Vec<String> = (0..opts.replicas).map(|i| ((b'a' + i as u8) as char).to_string()).collect();
        let launched = ids
            .iter()
            .enumerate()
            .map(|(i, id)| Stack::launch_sim(opts, artifacts, id, i, &dir, 1))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut sims = Vec::new();
        for (i, sim) in launched.into_iter().enumerate() {
            sims.push(Stack::sim_ready(opts, artifacts, sim, i, &dir)?);
        }
        Stack::front(opts, artifacts, sims, dir)
    }

    /// Waits until a launched engine is healthy. A port found free can be taken by someone
    /// else before the engine binds it (other processes open connections all the time): an
    /// engine that exits while starting is started again on other ports, up to three times
    /// in all.
    fn sim_ready(
        opts: &StackOptions,
        artifacts: &Artifacts,
        mut sim: SimHandle,
        index: usize,
        dir: &std::path::Path,
    ) -> anyhow::Result<SimHandle> {
        let id = sim.id.clone();
        for attempt in 1..=3 {
            if attempt > 1 {
                sim = Stack::launch_sim(opts, artifacts, &id, index, dir, attempt)?;
            }
            let url = sim.url("/health");
            let started = wait_for(&format!("sim {id} health"), START_TIMEOUT, || {
                if sim.proc.check_alive().is_err() {
                    return Some(false);
                }
                http_ok(&url).then_some(true)
            })?;
            if started {
                return Ok(sim);
            }
        }
        anyhow::bail!("sim {id} exited while starting, three times; see its logs in {}", dir.display())
    }

    /// Starts one simulated engine on free ports, without waiting for it.
    fn launch_sim(
        opts: &StackOptions,
        artifacts: &Artifacts,
        id: &str,
        index: usize,
        dir: &std::path::Path,
        attempt: u32,
    ) -> anyhow::Result<SimHandle> {
        let (port, events_port, replay_port) = match (opts.envoy_discovery, opts.data_parallel_size) {
            (true, _) => {
                let p = free_port_run(3)?;
                (p, p + 1, p + 2)
            }
            (false, 1) => (free_port()?, free_port()?, free_port()?),
            // Ranks publish on base + rank: events and replay each need a run of ports.
            (false, n) => (free_port()?, free_port_run(n as u16)?, free_port_run(n as u16)?),
        };
        let mut events_config =
            json!({"endpoint": format!("tcp://*:{events_port}"), "replay_endpoint": format!("tcp://*:{replay_port}")});
        if let Some(steps) = opts.replay_buffer_steps {
            events_config["buffer_steps"] = json!(steps);
        }
        let mut cmd = Command::new(&artifacts.sim);
        // LoRA adapters may be loaded at run time when a test passes `--enable-lora`.
        cmd.env("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True");
        cmd.args(["--port", &port.to_string(), "--replica", id, "--model", &opts.model])
            .arg("--tokenizer")
            .arg(&artifacts.model_dir)
            .args(["--block-size", &opts.block_size.to_string(), "--kv-events-config", &events_config.to_string()])
            .args(["--data-parallel-size", &opts.data_parallel_size.to_string()])
            .args(&opts.sim_args);
        if opts.prompt_tokens_details {
            cmd.arg("--enable-prompt-tokens-details");
        }
        if let Some(port) = opts.otlp_port {
            cmd.args(["--otlp-traces-endpoint", &format!("http://127.0.0.1:{port}")]);
            cmd.env("OTEL_BSP_SCHEDULE_DELAY", SPAN_DELAY_MS);
        }
        // Its part in a disaggregated pool, with the flags the engines take for it.
        let role = opts.disaggregation.as_ref().map(|d| (d.mode.as_str(), d.role(index)));
        let bootstrap_port = match role {
            Some(("sglang", "prefill" | "both")) => Some(free_port()?),
            _ => None,
        };
        match role {
            Some(("vllm", _)) => {
                let config = json!({"kv_connector": "NixlConnector", "kv_role": "kv_both"});
                cmd.args(["--kv-transfer-config", &config.to_string()]);
            }
            Some(("sglang", role)) => {
                let mode = if role == "both" { "null" } else { role };
                cmd.args(["--disaggregation-mode", mode]);
                if let Some(port) = bootstrap_port {
                    cmd.args(["--disaggregation-bootstrap-port", &port.to_string()]);
                }
            }
            _ => {}
        }
        let log = dir.join(format!("sim-{id}-{attempt}.log"));
        let mut sim = SimHandle::new(id, port, events_port, replay_port, Proc::spawn(&format!("sim {id}"), cmd, &log)?);
        sim.bootstrap_port = bootstrap_port;
        sim.role = role.map(|(_, r)| r.to_owned());
        Ok(sim)
    }

    /// Starts the sidecar and Envoy in front of engines the caller started (`opts.replicas`
    /// and `opts.sim_args` do not apply), once each answers `/health`; waits until the
    /// gateway routes with a loaded tokenizer.
    pub fn start_with_engines(
        opts: &StackOptions,
        artifacts: &Artifacts,
        sims: Vec<SimHandle>,
    ) -> anyhow::Result<Stack> {
        artifacts.check()?;
        Stack::front(opts, artifacts, sims, log_dir(&opts.name)?)
    }

    fn front(opts: &StackOptions, artifacts: &Artifacts, sims: Vec<SimHandle>, dir: PathBuf) -> anyhow::Result<Stack> {
        let mut replicas_toml = String::new();
        for sim in &sims {
            let (id, port, events_port, replay_port) = (&sim.id, sim.port, sim.events_port, sim.replay_port);
            let replay =
                if opts.replay { format!("kv_replay = \"tcp://127.0.0.1:{replay_port}\"\n") } else { String::new() };
            let role = sim.role.as_deref().map(|r| format!("role = \"{r}\"\n")).unwrap_or_default();
            let bootstrap = sim.bootstrap_port.map(|p| format!("bootstrap_port = {p}\n")).unwrap_or_default();
            replicas_toml.push_str(&format!(
                "\n[[pools.replicas]]\nid = \"{id}\"\nendpoint = \"127.0.0.1:{port}\"\nkv_events = \"tcp://127.0.0.1:{events_port}\"\n{replay}data_parallel_size = {}\n{role}{bootstrap}",
                opts.data_parallel_size
            ));
        }
        for sim in &sims {
            let healthy = || http_ok(&sim.url("/health")).then_some(());
            wait_for(&format!("engine {} health", sim.id), ENGINE_START_TIMEOUT, healthy)?;
        }

        anyhow::ensure!(opts.gateways >= 1, "at least one gateway");
        anyhow::ensure!(
            opts.gateways == 1 || !(opts.envoy_discovery || opts.hot_restart || opts.sidecar_delay_ms > 0),
            "several gateways run without Envoy discovery, hot restarts or a delayed sidecar"
        );
        let (sidecar_port, admin_port, gateway_port) = (free_port()?, free_port()?, free_port()?);
        if opts.envoy_discovery {
            replicas_toml = format!(
                "[pools.discovery]\nkind = \"envoy\"\nname = \"pool\"\nadmin = \"http://127.0.0.1:{admin_port}\"\n\
                 kv_events = \"tcp://{{ip}}:{{port+1}}\"\nkv_replay = \"tcp://{{ip}}:{{port+2}}\"\ninterval_secs = 1\n"
            );
        }
        // Each gateway's sync endpoint, when their sidecars form a mesh.
        let meshed = opts.routing == Routing::Kvgate && opts.gateways > 1 && opts.sync;
        let sync_ports: Vec<u16> =
            // Each sync port and the one after it (the handover to a starting peer).
            if meshed {
                let first = free_port_run(2 * opts.gateways as u16)?;
                (0..opts.gateways as u16).map(|i| first + 2 * i).collect()
            } else {
                Vec::new()
            };
        // The mesh is sealed, as in a deployment: one key for the stack's gateways.
        let key_file = dir.join("sync.key");
        if meshed {
            let key: String = (0..32).map(|_| format!("{:02x}", rand::random::<u8>())).collect();
            std::fs::write(&key_file, key)?;
        }
        let sync_toml = |i: usize| -> String {
            let Some(own) = sync_ports.get(i) else { return String::new() };
            let peers: Vec<String> =
                sync_ports.iter().filter(|p| *p != own).map(|p| format!("\"tcp://127.0.0.1:{p}\"")).collect();
            format!(
                "\n[sync]\nid = \"gw{i}\"\nlisten = \"tcp://127.0.0.1:{own}\"\npeers = [{}]\nkey_file = {:?}\n",
                peers.join(", "),
                key_file.display().to_string()
            )
        };
        let disaggregation = match &opts.disaggregation {
            Some(d) if d.keys.is_empty() => format!("disaggregation = {{ mode = \"{}\" }}", d.mode),
            Some(d) => format!("disaggregation = {{ mode = \"{}\", {} }}", d.mode, d.keys),
            None => String::new(),
        };
        let extra_pools: String = opts
            .extra_models
            .iter()
            .map(|(model, dir)| {
                format!(
                    "\n[[pools]]\nmodel = {model:?}\ntokenizer = {:?}\nblock_size = {}\n{replicas_toml}",
                    dir.display().to_string(),
                    opts.block_size
                )
            })
            .collect();
        let sidecar_config = |port: u16, i: usize| {
            format!(
                "listen = \"127.0.0.1:{port}\"\n{}\n{}\n\n[scoring]\n{}\n\n[[pools]]\nmodel = {:?}\ntokenizer = \"{}\"\nblock_size = {}\npolicy = \"{}\"\n{}\n{disaggregation}\n{replicas_toml}{extra_pools}",
                opts.sidecar_toml,
                sync_toml(i),
                opts.scoring_toml,
                opts.model,
                artifacts.model_dir.display(),
                opts.pool_block_size.unwrap_or(opts.block_size),
                opts.pool_policy,
                opts.pool_toml
            )
        };
        let with_sidecar = opts.routing == Routing::Kvgate;
        let sidecar = if with_sidecar {
            Some(spawn_sidecar(artifacts, &dir, "", sidecar_port, &sidecar_config(sidecar_port, 0), opts.otlp_port)?)
        } else {
            None
        };

        let mut filter_config = json!({"route_timeout_ms": opts.route_timeout_ms, "offload_timeout_ms": opts.route_timeout_ms.max(1000),
                "retry_ms": 200, "debug_headers": true});
        if opts.disaggregation.is_some() {
            // Prefill legs go to the engines' own cluster.
            filter_config["prefill_cluster"] = json!("pool");
        }
        if let Value::Object(config) = &mut filter_config {
            config.extend(opts.filter_config.clone());
        }
        let filter_config = filter_config.to_string();
        let delay_proxy = match opts.sidecar_delay_ms {
            0 => None,
            ms => Some(DelayProxy::start(sidecar_port, Duration::from_millis(ms))?),
        };
        let endpoints: Vec<std::net::SocketAddr> = sims.iter().map(SimHandle::endpoint).collect();
        let envoy_at = |name: &str, sidecar_port: u16, admin_port: u16, gateway_port: u16| {
            let ports = EnvoyPorts { sidecar: sidecar_port, admin: admin_port, gateway: gateway_port };
            spawn_envoy(opts, artifacts, &dir, name, ports, &endpoints, &filter_config)
        };
        let (envoy, envoy_config, ports) =
            envoy_at("envoy", delay_proxy.as_ref().map_or(sidecar_port, |p| p.port), admin_port, gateway_port)?;
        let mut gateways =
            vec![Gateway { sidecar, sidecar_port, envoy, admin_port: ports.admin, gateway_port: ports.gateway }];
        for i in 1..opts.gateways {
            let sidecar_port = free_port()?;
            let sidecar = if with_sidecar {
                Some(spawn_sidecar(
                    artifacts,
                    &dir,
                    &format!("-gw{i}"),
                    sidecar_port,
                    &sidecar_config(sidecar_port, i),
                    opts.otlp_port,
                )?)
            } else {
                None
            };
            let (envoy, _, ports) = envoy_at(&format!("envoy-gw{i}"), sidecar_port, free_port()?, free_port()?)?;
            gateways.push(Gateway {
                sidecar,
                sidecar_port,
                envoy,
                admin_port: ports.admin,
                gateway_port: ports.gateway,
            });
        }

        let baseline = match opts.baseline_gateway {
            true => {
                let alone = StackOptions { routing: Routing::RoundRobin, hot_restart: false, ..opts.clone() };
                let ports = EnvoyPorts { sidecar: sidecar_port, admin: free_port()?, gateway: free_port()? };
                let (envoy, _, ports) =
                    spawn_envoy(&alone, artifacts, &dir, "envoy-baseline", ports, &endpoints, &filter_config)?;
                Some((envoy, ports.gateway))
            }
            false => None,
        };
        let stack = Stack {
            model: opts.model.clone(),
            sims,
            gateways,
            _delay_proxy: delay_proxy,
            baseline,
            retired_envoys: Vec::new(),
            envoy_config,
            envoy_bin: artifacts.envoy.clone(),
            envoy_epoch: 0,
            envoy_concurrency: opts.envoy_concurrency,
            hot_restart: opts.hot_restart,
            dir,
        };
        // A module in the filter's place reports no tokenizer: nothing to wait for.
        if opts.routing == Routing::Kvgate && opts.wasm.is_none() {
            // Tokenized in Envoy unless `envoy_tokenizers` leaves the stack's model out.
            let in_envoy = match opts.filter_config.get("envoy_tokenizers") {
                Some(Value::String(word)) => word != "none",
                Some(Value::Array(models)) => models.contains(&json!(opts.model)),
                _ => true,
            };
            for url in stack.gateways("/v1/chat/completions") {
                stack.wait_tokenizer_loaded(&url, in_envoy)?;
            }
        }
        Ok(stack)
    }

    /// Waits until a request through a gateway (its chat `url`) reports a tokenized prompt:
    /// tokenized `in_envoy` (the filter's tokenizer has loaded), or by the sidecar.
    fn wait_tokenizer_loaded(&self, url: &str, in_envoy: bool) -> anyhow::Result<()> {
        let probe = json!({"model": self.model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1})
            .to_string();
        wait_for("the filter's tokenizer", START_TIMEOUT, || {
            let reply = client::post(url, probe.clone(), &[]).ok()?;
            let ready = match in_envoy {
                true => !reply.header("x-kvgate-prompt-tokens").is_empty(),
                false => {
                    reply.header("x-kvgate-offloaded") == "true" && reply.header("x-kvgate-routed-to") != "fallback"
                }
            };
            ready.then_some(())
        })
    }

    /// The gateway the single-gateway methods speak to.
    fn first(&self) -> &Gateway {
        &self.gateways[0]
    }

    /// The processes on the request path in front of the engines: every gateway's Envoy and
    /// sidecar.
    pub fn gateway_pids(&self) -> Vec<u32> {
        self.gateways
            .iter()
            .flat_map(|g| g.envoy.pid().into_iter().chain(g.sidecar.as_ref().and_then(Proc::pid)))
            .collect()
    }

    /// The engines' processes.
    pub fn engine_pids(&self) -> Vec<u32> {
        self.sims.iter().filter_map(|s| s.proc.pid()).collect()
    }

    /// `http://127.0.0.1:<gateway>{path}`.
    pub fn gateway(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.first().gateway_port)
    }

    /// Every gateway's `http://127.0.0.1:<gateway>{path}`, the first first.
    pub fn gateways(&self, path: &str) -> Vec<String> {
        self.gateways.iter().map(|g| format!("http://127.0.0.1:{}{path}", g.gateway_port)).collect()
    }

    /// The engine with this replica id.
    pub fn sim(&self, id: &str) -> &SimHandle {
        self.sims.iter().find(|s| s.id == id).unwrap_or_else(|| panic!("no replica {id}"))
    }

    /// `http://127.0.0.1:<baseline gateway>{path}`: Envoy alone in front of the same engines
    /// ([`StackOptions::baseline_gateway`]).
    pub fn baseline(&self, path: &str) -> anyhow::Result<String> {
        let Some((_, port)) = &self.baseline else { anyhow::bail!("start the stack with baseline_gateway") };
        Ok(format!("http://127.0.0.1:{port}{path}"))
    }

    /// Kills the first gateway's sidecar and puts a [`HungSidecar`] on its port: from now on
    /// the filter's calls are taken and never answered. Keep it for as long as the sidecar is
    /// to hang.
    pub fn hang_sidecar(&mut self) -> anyhow::Result<HungSidecar> {
        self.kill_sidecar();
        let port = self.first().sidecar_port;
        // The killed sidecar's port is free once the process is reaped.
        wait_for("the sidecar's port for a hung listener", START_TIMEOUT, || HungSidecar::listen(port).ok())
    }

    /// `http://127.0.0.1:<sidecar>{path}`.
    pub fn sidecar_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.first().sidecar_port)
    }

    /// The sidecar's `/metrics`, as text (read it with [`metric_sum`]).
    pub fn sidecar_metrics(&self) -> anyhow::Result<String> {
        Ok(client::client().get(self.sidecar_url("/metrics")).send()?.error_for_status()?.text()?)
    }

    /// The sidecar's `/debug/state`.
    pub fn sidecar_state(&self) -> anyhow::Result<Value> {
        Ok(client::client().get(self.sidecar_url("/debug/state")).send()?.json()?)
    }

    /// The relative error `|predicted − measured| / measured` of each `latency` prediction
    /// (`"ttft"` or `"itl"`) the first sidecar checked among its last `last` decisions kept
    /// (`/debug/explain`).
    pub fn latency_errors(&self, latency: &str, last: usize) -> anyhow::Result<Vec<f64>> {
        self.latency_errors_of(0, latency, last)
    }

    /// [`Stack::latency_errors`] of gateway `i`'s sidecar.
    ///
    /// # Panics
    /// If there is no gateway `i`.
    pub fn latency_errors_of(&self, i: usize, latency: &str, last: usize) -> anyhow::Result<Vec<f64>> {
        Ok(latency_errors_in(&self.decisions_of(i, last)?, latency))
    }

    /// Gateway `i`'s last `last` kept decisions, as its `/debug/explain` gives them.
    ///
    /// # Panics
    /// If there is no gateway `i`.
    pub fn decisions_of(&self, i: usize, last: usize) -> anyhow::Result<Vec<Value>> {
        let url = self.sidecar_url_of(i, &format!("/debug/explain?last={last}"));
        let mut explained: Value = client::client().get(url).send()?.json()?;
        Ok(match explained["decisions"].take() {
            Value::Array(decisions) => decisions,
            _ => Vec::new(),
        })
    }

    /// `http://127.0.0.1:<gateway i's sidecar>{path}` (0: the first's).
    ///
    /// # Panics
    /// If there is no gateway `i`.
    pub fn sidecar_url_of(&self, i: usize, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.gateways[i].sidecar_port)
    }

    /// The `/debug/state` of gateway `i`'s sidecar (0: the first's).
    pub fn sidecar_state_of(&self, i: usize) -> anyhow::Result<Value> {
        anyhow::ensure!(i < self.gateways.len(), "no gateway {i}");
        Ok(client::client().get(self.sidecar_url_of(i, "/debug/state")).send()?.json()?)
    }

    /// Blocks the sidecar has indexed for a replica.
    pub fn indexed_blocks(&self, replica: &str) -> anyhow::Result<u64> {
        let state = self.sidecar_state()?;
        let replicas = state["pools"][0]["replicas"].as_array().cloned().unwrap_or_default();
        Ok(replicas.iter().find(|r| r["id"] == replica).and_then(|r| r["blocks_indexed"].as_u64()).unwrap_or(0))
    }

    /// Waits until the sidecar has indexed at least `blocks` blocks for `replica`.
    pub fn wait_indexed(&self, replica: &str, blocks: u64) -> anyhow::Result<()> {
        wait_for(&format!("{blocks} blocks indexed on {replica}"), Duration::from_secs(10), || {
            (self.indexed_blocks(replica).ok()? >= blocks).then_some(())
        })
    }

    /// Kills an engine (it stays in Envoy's cluster; health checks take it out).
    pub fn kill_sim(&mut self, id: &str) {
        if let Some(s) = self.sims.iter_mut().find(|s| s.id == id) {
            s.proc.kill();
        }
    }

    /// Kills the sidecar (the filter must fail open).
    pub fn kill_sidecar(&mut self) {
        if let Some(p) = self.gateways[0].sidecar.as_mut() {
            p.kill();
        }
    }

    /// Starts the sidecar again with its config (after [`Stack::kill_sidecar`], or killing
    /// it first) and waits until it answers.
    pub fn restart_sidecar(&mut self) -> anyhow::Result<()> {
        self.restart_sidecar_of(0)
    }

    /// [`Stack::restart_sidecar`] for gateway `i`'s sidecar.
    pub fn restart_sidecar_of(&mut self, i: usize) -> anyhow::Result<()> {
        let gateway = self.gateways.get_mut(i).ok_or_else(|| anyhow::anyhow!("no gateway {i}"))?;
        let Some(p) = gateway.sidecar.as_mut() else { anyhow::bail!("this stack has no sidecar") };
        p.restart()?;
        let url = format!("http://127.0.0.1:{}/healthz", gateway.sidecar_port);
        wait_for("sidecar health", START_TIMEOUT, || http_ok(&url).then_some(()))
    }

    /// Kills an engine and starts it again on the same ports: its cache is empty and its
    /// event sequence starts over at 0, as a restarted vLLM's. Waits until it is healthy.
    pub fn restart_sim(&mut self, id: &str) -> anyhow::Result<()> {
        let sim = self.sims.iter_mut().find(|s| s.id == id).ok_or_else(|| anyhow::anyhow!("no replica {id}"))?;
        // Its ports are free again once the old process is reaped; the new one binds them.
        sim.proc.restart()?;
        let url = sim.url("/health");
        wait_for(&format!("engine {id} health after restart"), ENGINE_START_TIMEOUT, || http_ok(&url).then_some(()))
    }

    /// Envoy's process id, while it runs.
    pub fn envoy_pid(&self) -> Option<u32> {
        self.first().envoy.pid()
    }

    /// The first gateway's sidecar's process id, if it runs.
    pub fn sidecar_pid(&self) -> Option<u32> {
        self.first().sidecar.as_ref().and_then(Proc::pid)
    }

    /// An Envoy counter or gauge by its full name (0 if absent), from the admin `/stats`.
    pub fn envoy_stat(&self, name: &str) -> anyhow::Result<u64> {
        envoy_stat(self.first().admin_port, name)
    }

    /// The first gateway's Envoy admin and sidecar addresses (`host:port`), for scrapers.
    pub fn scrape_targets(&self) -> (String, String) {
        let g = self.first();
        (format!("127.0.0.1:{}", g.admin_port), format!("127.0.0.1:{}", g.sidecar_port))
    }

    /// The filter's metric `name` (`kvgate.requests_total`…) in the first Envoy, summed over
    /// the series whose tags include `tags` (`[("outcome", "routed")]`).
    pub fn filter_stat(&self, name: &str, tags: &[(&str, &str)]) -> anyhow::Result<u64> {
        filter_stat(self.first().admin_port, name, tags)
    }

    /// The value of each series of the filter's metric `name` in the first Envoy (one per tag
    /// combination: per VM for `kvgate.vm_memory_bytes`).
    pub fn filter_stat_series(&self, name: &str) -> anyhow::Result<Vec<u64>> {
        Ok(filter_stat_values(&filter_stats(self.first().admin_port)?, name, &[]))
    }

    /// [`Stack::filter_stat`] summed over every gateway's Envoy.
    pub fn filter_stat_total(&self, name: &str, tags: &[(&str, &str)]) -> anyhow::Result<u64> {
        self.gateways.iter().map(|g| filter_stat(g.admin_port, name, tags)).sum()
    }

    /// [`Stack::envoy_stat`] summed over every gateway's Envoy.
    pub fn envoy_stat_total(&self, name: &str) -> anyhow::Result<u64> {
        self.gateways.iter().map(|g| envoy_stat(g.admin_port, name)).sum()
    }

    /// Hot-restarts Envoy (a new process, the next restart epoch, the same config): it takes
    /// over the listeners and loads the filter afresh, while the old one drains and exits.
    /// Needs [`StackOptions::hot_restart`]. Waits until the new process is ready.
    pub fn hot_restart_envoy(&mut self) -> anyhow::Result<()> {
        anyhow::ensure!(self.hot_restart, "start the stack with hot_restart");
        self.envoy_epoch += 1;
        let epoch = self.envoy_epoch;
        let admin_port = self.first().admin_port;
        let cmd = envoy_command(&self.envoy_bin, &self.envoy_config, self.envoy_concurrency, Some((admin_port, epoch)));
        let mut next = Proc::spawn("envoy", cmd, &self.dir.join(format!("envoy-epoch{epoch}.log")))?;
        let ready = format!("http://127.0.0.1:{admin_port}/ready");
        let server_info = format!("http://127.0.0.1:{admin_port}/server_info");
        wait_for("the new Envoy ready", START_TIMEOUT, || {
            if next.check_alive().is_err() {
                return Some(Err(anyhow::anyhow!("the new Envoy exited; see its log in {}", self.dir.display())));
            }
            // The admin port answers from the new process once it took over.
            let info: Value = client::client().get(&server_info).send().ok()?.json().ok()?;
            let epoch_now = info["command_line_options"]["restart_epoch"].as_u64()?;
            (epoch_now == u64::from(epoch) && http_ok(&ready)).then_some(Ok(()))
        })??;
        let old = std::mem::replace(&mut self.gateways[0].envoy, next);
        self.retired_envoys.push(old);
        Ok(())
    }

    /// Waits until every Envoy replaced by a hot restart has drained and exited.
    pub fn wait_retired_envoys(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let retired = &mut self.retired_envoys;
        wait_for("replaced Envoys to exit", timeout, || {
            retired.iter_mut().all(|p| p.check_alive().is_err()).then_some(())
        })
    }

    /// Resident memory of the sidecar and of Envoy, bytes (from `/proc`; `None` if not running).
    pub fn rss(&self) -> (Option<u64>, Option<u64>) {
        let of = |p: Option<&Proc>| p.and_then(Proc::pid).and_then(crate::process::rss_bytes);
        (of(self.first().sidecar.as_ref()), of(Some(&self.first().envoy)))
    }

    /// Fails if Envoy died.
    pub fn check_envoy(&mut self) -> anyhow::Result<()> {
        self.gateways[0].envoy.check_alive()
    }
}

/// A gateway pod: its Envoy and, with kvgate, its sidecar.
struct Gateway {
    sidecar: Option<Proc>,
    /// The sidecar's own port (the first gateway's Envoy may reach it through a delay proxy).
    sidecar_port: u16,
    envoy: Proc,
    admin_port: u16,
    gateway_port: u16,
}

/// The ports an Envoy is started with.
#[derive(Debug, Clone, Copy)]
struct EnvoyPorts {
    /// The sidecar its filter calls.
    sidecar: u16,
    admin: u16,
    gateway: u16,
}

/// An Envoy counter or gauge by its full name (0 if absent), from the admin `/stats` on
/// `admin_port`.
fn envoy_stat(admin_port: u16, name: &str) -> anyhow::Result<u64> {
    let url = format!("http://127.0.0.1:{admin_port}/stats?filter={name}");
    let text = client::client().get(url).send()?.text()?;
    Ok(text
        .lines()
        .filter_map(|l| l.split_once(": "))
        .find(|(k, _)| *k == name)
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0))
}

fn filter_stat(admin_port: u16, name: &str, tags: &[(&str, &str)]) -> anyhow::Result<u64> {
    Ok(sum_filter_stat(&filter_stats(admin_port)?, name, tags))
}

/// The filter's lines of Envoy's admin `/stats`.
fn filter_stats(admin_port: u16) -> anyhow::Result<String> {
    let url = format!("http://127.0.0.1:{admin_port}/stats?filter=^wasmcustom\\.");
    Ok(client::client().get(url).send()?.error_for_status()?.text()?)
}

/// The sum of [`filter_stat_values`].
fn sum_filter_stat(text: &str, name: &str, tags: &[(&str, &str)]) -> u64 {
    filter_stat_values(text, name, tags).into_iter().sum()
}

/// The values of `name` in Envoy's `/stats` text whose tags (Istio's form, `tag=.=value;.;`,
/// as the filter names its metrics) include `tags`, one per series.
fn filter_stat_values(text: &str, name: &str, tags: &[(&str, &str)]) -> Vec<u64> {
    fn parse(full: &str) -> Option<(&str, Vec<(&str, &str)>)> {
        let mut rest = full.strip_prefix("wasmcustom.")?;
        let mut found = Vec::new();
        while let Some((tag, after)) = rest.split_once("=.=") {
            let (value, after) = after.split_once(";.;")?;
            found.push((tag, value));
            rest = after;
        }
        Some((rest, found))
    }
    text.lines()
        .filter_map(|l| l.split_once(": "))
        .filter_map(|(k, v)| Some((parse(k)?, v.trim().parse::<u64>().ok()?)))
        .filter(|((base, found), _)| *base == name && tags.iter().all(|t| found.contains(t)))
        .map(|(_, v)| v)
        .collect()
}

/// How long a traced process holds a span before exporting it (the OTLP default is 5 s).
const SPAN_DELAY_MS: &str = "100";

/// Starts a sidecar on `port` with `config` (written as `kvgate{suffix}.toml`), exporting spans
/// to the collector on `otlp_port` if any, and waits until it answers.
fn spawn_sidecar(
    artifacts: &Artifacts,
    dir: &std::path::Path,
    suffix: &str,
    port: u16,
    config: &str,
    otlp_port: Option<u16>,
) -> anyhow::Result<Proc> {
    let config_path = dir.join(format!("kvgate{suffix}.toml"));
    std::fs::write(&config_path, config)?;
    let mut cmd = Command::new(&artifacts.sidecar);
    cmd.arg("--config").arg(&config_path);
    if let Some(port) = otlp_port {
        cmd.args(["--otlp-endpoint", &format!("http://127.0.0.1:{port}")])
            .env("OTEL_BSP_SCHEDULE_DELAY", SPAN_DELAY_MS);
    }
    let proc = Proc::spawn("sidecar", cmd, &dir.join(format!("sidecar{suffix}.log")))?;
    let url = format!("http://127.0.0.1:{port}/healthz");
    wait_for("sidecar health", START_TIMEOUT, || http_ok(&url).then_some(()))?;
    Ok(proc)
}

/// Starts an Envoy named `name` (its config and log files) in front of `endpoints` and waits
/// until it is ready. Its ports were free when picked, but a process started since (the
/// sidecar's outgoing connections take ephemeral ports) may hold one: then it picks again.
/// Returns the process, its config file and the ports it runs on.
fn spawn_envoy(
    opts: &StackOptions,
    artifacts: &Artifacts,
    dir: &std::path::Path,
    name: &str,
    mut ports: EnvoyPorts,
    endpoints: &[std::net::SocketAddr],
    filter_config: &str,
) -> anyhow::Result<(Proc, PathBuf, EnvoyPorts)> {
    let template = std::fs::read_to_string(repo_root().join("envoy/envoy.yaml.tmpl"))?;
    let envoy_config = dir.join(format!("{name}.yaml"));
    let envoy_log = dir.join(format!("{name}.log"));
    let mut attempts = 0;
    loop {
        let yaml = envoy::render(
            &template,
            &EnvoyParams {
                admin_port: ports.admin,
                listen_port: ports.gateway,
                sidecar_port: ports.sidecar,
                wasm: opts.wasm.as_ref().unwrap_or(&artifacts.wasm),
                filter_config,
                pool_endpoints: endpoints,
                with_filter: opts.routing == Routing::Kvgate,
                fallback: if opts.routing == Routing::LeastRequest {
                    Fallback::LeastRequest
                } else {
                    Fallback::RoundRobin
                },
                otlp_port: opts.otlp_port,
            },
        );
        std::fs::write(&envoy_config, yaml)?;
        let restart = opts.hot_restart.then_some((ports.admin, 0));
        let cmd = envoy_command(&artifacts.envoy, &envoy_config, opts.envoy_concurrency, restart);
        let mut envoy_proc = Proc::spawn(name, cmd, &envoy_log)?;
        let ready = format!("http://127.0.0.1:{}/ready", ports.admin);
        let alive = wait_for(&format!("{name} ready"), START_TIMEOUT, || {
            if envoy_proc.check_alive().is_err() {
                return Some(false);
            }
            http_ok(&ready).then_some(true)
        })?;
        if alive {
            return Ok((envoy_proc, envoy_config, ports));
        }
        let log = std::fs::read_to_string(&envoy_log).unwrap_or_default();
        attempts += 1;
        if attempts == 3 || !log.contains("Address already in use") {
            anyhow::bail!("envoy exited; see {}", envoy_log.display());
        }
        // The sidecar was told Envoy's admin port (Envoy discovery): only the listener moves.
        if !opts.envoy_discovery {
            ports.admin = free_port()?;
        }
        ports.gateway = free_port()?;
    }
}

/// A fresh log directory under `target/e2e-logs/`.
fn log_dir(name: &str) -> anyhow::Result<PathBuf> {
    let n = STACKS.fetch_add(1, Ordering::Relaxed);
    let dir = repo_root().join("target/e2e-logs").join(format!("{name}-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Envoy's command line: `workers` worker threads; hot restart off, or on with `(base id,
/// restart epoch)` (a short drain so a replaced process exits within seconds).
fn envoy_command(
    envoy: &std::path::Path,
    config: &std::path::Path,
    workers: u32,
    hot_restart: Option<(u16, u32)>,
) -> Command {
    let mut cmd = Command::new(envoy);
    cmd.arg("-c").arg(config).args(["--concurrency", &workers.to_string(), "--log-level", "warn"]);
    match hot_restart {
        None => cmd.arg("--disable-hot-restart"),
        Some((base_id, epoch)) => cmd.args([
            "--base-id",
            &base_id.to_string(),
            "--restart-epoch",
            &epoch.to_string(),
            "--drain-time-s",
            "2",
            "--parent-shutdown-time-s",
            "4",
        ]),
    };
    cmd
}

#[cfg(test)]
mod tests {
    use super::{filter_stat_values, latency_errors_in, predictions_in, sum_filter_stat, Predicted};
    use serde_json::json;

    #[test]
    fn filter_stats_are_summed_over_the_tags_not_asked_for() {
        let text = "wasmcustom.model=.=a;.;outcome=.=routed;.;kvgate.requests_total: 3\n\
                    wasmcustom.model=.=b;.;outcome=.=routed;.;kvgate.requests_total: 4\n\
                    wasmcustom.model=.=b;.;outcome=.=shed;.;kvgate.requests_total: 5\n\
                    wasmcustom.kvgate.tokenize_us: P0(nan,1) P25(nan,2)\n\
                    wasmcustom.kvgate.segment_cache_hits_total: 7\n";
        assert_eq!(sum_filter_stat(text, "kvgate.requests_total", &[("outcome", "routed")]), 7);
        assert_eq!(sum_filter_stat(text, "kvgate.requests_total", &[("model", "b")]), 9);
        assert_eq!(sum_filter_stat(text, "kvgate.segment_cache_hits_total", &[]), 7);
        assert_eq!(sum_filter_stat(text, "kvgate.requests_total", &[("outcome", "passthrough")]), 0);
        assert_eq!(filter_stat_values(text, "kvgate.requests_total", &[]), [3, 4, 5], "one value a series");
    }

    /// Kept decisions, as `/debug/explain` gives them: a checked one, one not predicted yet,
    /// and one without an id (which names no request and is left out).
    #[test]
    fn kept_decisions_give_their_errors_and_predictions() {
        let decisions = [
            json!({"request_id": "a-1", "predicted_ttft_secs": 0.3, "predicted_itl_secs": 0.02,
                   "ttft_checked": {"predicted_secs": 0.3, "measured_secs": 0.2},
                   "ttft_inputs": {"prefill_ahead": 700, "decoding": 3}, "itl_inputs": null}),
            json!({"request_id": "a-2", "predicted_ttft_secs": null, "ttft_checked": null}),
            json!({"predicted_ttft_secs": 0.1}),
        ];
        let errors = latency_errors_in(&decisions, "ttft");
        assert_eq!(errors.len(), 1);
        assert!((errors[0] - 0.5).abs() < 1e-12, "{errors:?}");
        assert!(latency_errors_in(&decisions, "itl").is_empty(), "no ITL was checked");
        assert_eq!(
            predictions_in(&decisions),
            [
                Predicted {
                    booking: "a-1".into(),
                    ttft: Some(0.3),
                    itl: Some(0.02),
                    ttft_inputs: Some(json!({"prefill_ahead": 700, "decoding": 3})),
                    itl_inputs: None,
                },
                Predicted { booking: "a-2".into(), ttft: None, itl: None, ttft_inputs: None, itl_inputs: None },
            ]
        );
    }
}
