//! The end-to-end benchmark: the same simulated fleet, the same workloads, every routing
//! policy, side by side (`cargo xtask bench e2e`).
//!
//! | module | what it does |
//! |---|---|
//! | `workloads` | shared-prefix, mooncake-conversation, multi-turn, cache-pressure, agentic → a plan of requests |
//! | `agentic` | the agentic workload's generator and trace file, from published agent-trace statistics |
//! | `ceiling` | a run's cache-hit ceiling: an infinite cache shared by the fleet, the same prompts |
//! | `oracle` | a run's TTFT replayed in simulated time: the router's placement, round robin, a greedy clairvoyant one |
//! | `cells` | which cells a run has left, each finished one kept in `cells.jsonl` at once |
//! | `progress` | "cell i of N", each cell's time and an estimate of the time left |
//! | `loadgen` | sends the plan through the gateway (open or closed loop), streaming SSE |
//! | `stats` | percentiles, goodput, hit ratio, load balance |
//! | `peers` | SGLang's and vLLM's routers, installed from PyPI, on the same fleet |
//! | `report` | `report.md`, `results.json`, `requests/*.jsonl`, SVG charts |
//! | `filter` | `cargo xtask bench filter`: latency kvgate adds, tokenization in Envoy vs native |
//! | `throughput` | `cargo xtask bench filter`, then: routed requests/s one Envoy worker sustains |
//! | `memory` | `cargo xtask bench filter`, then: what 15 MiB bodies leave in Envoy's memory |
//! | `workers` | `cargo xtask bench filter`, last: Envoy's memory by worker count and models |
//! | `scale` | `cargo xtask bench scale`: one sidecar as the fleet grows to 1 000 engines |
//! | `placement` | `cargo xtask bench memory`, last: tokenizing in Envoy or in the sidecar, per request |
//!
//! Each (workload, QPS, repeat) starts a fresh fleet per policy, so no policy inherits
//! another's warm caches; ratios against round robin are taken within the same repeat.

pub mod agentic;
pub mod ceiling;
pub mod cells;
pub mod filter;
pub mod loadgen;
pub mod memory;
pub mod oracle;
pub mod peers;
pub mod placement;
pub mod progress;
pub mod report;
pub mod scale;
pub mod stats;
pub mod throughput;
pub mod workers;
pub mod workloads;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::stack::Predicted;
use crate::{Artifacts, Routing, Stack, StackOptions};
use cells::{Cell, CellStore};
use loadgen::{Outcome, Target};
use peers::Peer;
use progress::Progress;
use stats::{EngineWork, Summary};
use workloads::{Plan, Workload};

/// A routing policy under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Policy {
    /// Envoy alone, round robin.
    EnvoyRoundRobin,
    /// Envoy alone, least request.
    EnvoyLeastRequest,
    /// kvgate with a pool policy (`round_robin`, `least_load`, `kv_aware`, …) and kvgate's
    /// default scoring.
    Kvgate(&'static str),
    /// kvgate `kv_aware` with one scoring knob set to a value.
    KvgateTuned(Knob, u32),
    /// kvgate `kv_aware` with Dynamo 1.6.1's cost exactly (`prefill_load_scale = 1`, no
    /// duplicate penalty): Dynamo's scoring on kvgate's index.
    KvgateDynamoCost,
    /// kvgate `kv_aware` with admission control: a replica is saturated at 90 % of its KV
    /// cache booked or two full prefill batches booked, and a request waits at most one
    /// simulated second for one that is not, else it is shed (429).
    KvgateAdmission,
    /// kvgate `kv_aware` held to the run's SLOs (`[pools.admission]` `ttft_slo_ms` and
    /// `itl_slo_ms`, in wall-clock ms, `sheddable`): once the replicas' models predict, a
    /// request goes only where it is predicted to meet both, and is shed at once (429) when no
    /// replica is. No saturation criterion: the predictions alone decide.
    KvgateSlo,
    /// [`Policy::KvgateSlo`] with [`Policy::KvgateAdmission`]'s saturation criterion: a
    /// request that finds every replica saturated waits for capacity as long as it can still
    /// meet its TTFT SLO (the filter's `admission_wait_ms` and the pool's `max_queue_ms` are
    /// the SLO), and is shed at once when no replica is predicted to meet what is left of it.
    /// The engines are kept out of the overload their queues would bring, where predictions
    /// from kvgate's view cannot see the engines' own waits.
    KvgateSloAdmission,
    /// [`Policy::KvgateAdmission`] with two priority classes and tenants, named by the
    /// requests' [`loadgen::PRIORITY_HEADER`] and [`loadgen::TENANT_HEADER`] (see
    /// [`workloads::Mix`]): `interactive` goes first and may fill 90 % of a replica's KV
    /// cache and two prefill batches; `batch` (also the class of untagged requests) waits at
    /// 70 % and one batch, so interactive requests find headroom.
    KvgateFlowControl,
    /// kvgate `kv_aware` binding sessions (`[pools.sessions]`, the defaults) on the requests'
    /// `x-session-id`.
    KvgateSessions,
    /// kvgate `kv_aware` with several gateways whose sidecars do not share their bookings:
    /// the sync mesh's ablation (the same as `kvgate-kv-aware` at one gateway).
    KvgateNoSync,
    /// kvgate `kv_aware` also reading each engine's own load from its `/metrics` every
    /// second (`engine_metrics_secs = 1`), so traffic that bypasses the gateways counts.
    KvgateEngineMetrics,
    /// kvgate `kv_aware` on a disaggregated fleet (vLLM's protocol): the first half of the
    /// engines prefill, the rest decode; prefill workers chosen by `prefill_policy`
    /// (`kv_aware` or `round_robin`).
    KvgatePd(&'static str),
    /// [`Policy::KvgatePd`] (`kv_aware`) with conditional disaggregation on load too: a
    /// request is served whole on its decode worker while every prefill worker has two full
    /// prefill batches (`2 × max_num_batched_tokens`) booked.
    KvgatePdConditional,
    /// A peer router in place of Envoy.
    Peer(Peer),
}

/// A kvgate setting a [`Policy::KvgateTuned`] sets on top of `kv_aware`: a scoring weight or
/// the filter's offload threshold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Knob {
    /// `prefill_load_scale = N`: a prefill block costs N decode blocks.
    PrefillLoadScale,
    /// `duplicate_penalty = N`: recomputing a block another replica holds costs N more
    /// blocks (0: none, as in Dynamo's cost).
    DuplicatePenalty,
    /// The filter's `offload_bytes = N KiB`: larger bodies are tokenized by the sidecar,
    /// smaller ones in Envoy.
    OffloadKib,
}

impl Knob {
    const ALL: [Knob; 3] = [Knob::PrefillLoadScale, Knob::DuplicatePenalty, Knob::OffloadKib];

    /// The key in the pool's `[scoring]` table (`None`: a filter setting).
    fn scoring_key(self) -> Option<&'static str> {
        match self {
            Knob::PrefillLoadScale => Some("prefill_load_scale"),
            Knob::DuplicatePenalty => Some("duplicate_penalty"),
            Knob::OffloadKib => None,
        }
    }

    /// The policy name's prefix before the value: `kvgate-kv-aware-dup-x0`.
    fn name_prefix(self) -> &'static str {
        match self {
            Knob::PrefillLoadScale => "kvgate-kv-aware-prefill-x",
            Knob::DuplicatePenalty => "kvgate-kv-aware-dup-x",
            Knob::OffloadKib => "kvgate-kv-aware-offload-kib-",
        }
    }
}

impl Policy {
    /// Every policy the harness knows.
    pub const ALL: [Policy; 21] = [
        Policy::EnvoyRoundRobin,
        Policy::EnvoyLeastRequest,
        Policy::Kvgate("round_robin"),
        Policy::Kvgate("least_load"),
        Policy::Kvgate("prefix_affinity"),
        Policy::Kvgate("kv_aware"),
        Policy::KvgateDynamoCost,
        Policy::KvgateAdmission,
        Policy::KvgateSlo,
        Policy::KvgateSloAdmission,
        Policy::KvgateFlowControl,
        Policy::KvgateSessions,
        Policy::KvgateNoSync,
        Policy::KvgateEngineMetrics,
        Policy::KvgatePd("kv_aware"),
        Policy::KvgatePd("round_robin"),
        Policy::KvgatePdConditional,
        Policy::Peer(Peer::SglangCacheAware),
        Policy::Peer(Peer::SmgCacheAware),
        Policy::Peer(Peer::VllmRouterCacheAware),
        Policy::Peer(Peer::VllmRouterKvAware),
    ];

    /// The name in reports and on the command line.
    pub fn name(&self) -> String {
        match self {
            Policy::EnvoyRoundRobin => "envoy-round-robin".into(),
            Policy::EnvoyLeastRequest => "envoy-least-request".into(),
            Policy::Kvgate(p) => format!("kvgate-{}", p.replace('_', "-")),
            Policy::KvgateTuned(knob, n) => format!("{}{n}", knob.name_prefix()),
            Policy::KvgateDynamoCost => "kvgate-kv-aware-dynamo-cost".into(),
            Policy::KvgateAdmission => "kvgate-kv-aware-admission".into(),
            Policy::KvgateSlo => "kvgate-kv-aware-slo".into(),
            Policy::KvgateSloAdmission => "kvgate-kv-aware-slo-admission".into(),
            Policy::KvgateFlowControl => "kvgate-kv-aware-flow-control".into(),
            Policy::KvgateSessions => "kvgate-kv-aware-sessions".into(),
            Policy::KvgateNoSync => "kvgate-kv-aware-no-sync".into(),
            Policy::KvgateEngineMetrics => "kvgate-kv-aware-engine-metrics".into(),
            Policy::KvgatePd("kv_aware") => "kvgate-pd".into(),
            Policy::KvgatePd(p) => format!("kvgate-pd-{}-prefill", p.replace('_', "-")),
            Policy::KvgatePdConditional => "kvgate-pd-conditional".into(),
            Policy::Peer(p) => p.name().into(),
        }
    }

    /// The policy with this name.
    pub fn parse(name: &str) -> anyhow::Result<Policy> {
        for knob in Knob::ALL {
            if let Some(n) = name.strip_prefix(knob.name_prefix()).and_then(|n| n.parse().ok()) {
                return Ok(Policy::KvgateTuned(knob, n));
            }
        }
        Policy::ALL.into_iter().find(|p| p.name() == name).ok_or_else(|| {
            let known: Vec<String> = Policy::ALL.iter().map(Policy::name).collect();
            anyhow::anyhow!("unknown policy {name}; known: {}", known.join(", "))
        })
    }

    /// How the stack's Envoy routes under this policy, and the kvgate pool policy.
    fn routing(&self) -> (Routing, &'static str) {
        match self {
            // A peer replaces Envoy: the stack's Envoy idles.
            Policy::EnvoyRoundRobin | Policy::Peer(_) => (Routing::RoundRobin, "round_robin"),
            Policy::EnvoyLeastRequest => (Routing::LeastRequest, "round_robin"),
            Policy::Kvgate(p) => (Routing::Kvgate, p),
            Policy::KvgateTuned(..)
            | Policy::KvgateDynamoCost
            | Policy::KvgateAdmission
            | Policy::KvgateSlo
            | Policy::KvgateSloAdmission
            | Policy::KvgateFlowControl
            | Policy::KvgateSessions
            | Policy::KvgateNoSync
            | Policy::KvgateEngineMetrics
            | Policy::KvgatePd(_)
            | Policy::KvgatePdConditional => (Routing::Kvgate, "kv_aware"),
        }
    }

    /// The stack this policy runs on, with `gateways` gateway pods (a peer runs that many
    /// instances of its own instead, and the stack's one Envoy idles), for a run held to `slo`
    /// (simulated seconds).
    fn stack_options(
        &self,
        name: &str,
        fleet: &Fleet,
        gpu_blocks: usize,
        gateways: usize,
        slo: stats::Slo,
    ) -> StackOptions {
        let (routing, pool_policy) = self.routing();
        let scoring_toml = match self {
            Policy::KvgateTuned(knob, n) => knob.scoring_key().map(|key| format!("{key} = {n}.0")).unwrap_or_default(),
            Policy::KvgateDynamoCost => "prefill_load_scale = 1.0\nduplicate_penalty = 0.0".into(),
            _ => String::new(),
        };
        // The SLOs in wall-clock ms: the filter measures on the wall clock.
        let wall_ms = |simulated_s: f64| (simulated_s * 1000.0 / fleet.speedup).round() as u64;
        let slos =
            format!("ttft_slo_ms = {}, itl_slo_ms = {}, sheddable = true", wall_ms(slo.ttft_s), wall_ms(slo.itl_s));
        let saturation = format!("kv_blocks = {gpu_blocks}, max_prefill_tokens = {}", 2 * fleet.max_num_batched_tokens);
        let (pool_toml, filter_config) = match self {
            Policy::KvgateAdmission | Policy::KvgateFlowControl => {
                // One simulated second of waiting, in wall-clock ms.
                let wait_ms = (1000.0 / fleet.speedup).round() as u64;
                let batch = fleet.max_num_batched_tokens;
                let classes = if *self == Policy::KvgateFlowControl {
                    format!(
                        ", classes = [{{ name = \"interactive\", priority = 10 }}, {{ name = \"batch\", kv_fraction = 0.7, max_prefill_tokens = {batch} }}], default_class = \"batch\""
                    )
                } else {
                    String::new()
                };
                let pool = format!(
                    "admission = {{ enabled = true, {saturation}, max_queue_ms = {wait_ms}, max_queued = 1024{classes} }}"
                );
                let mut filter = serde_json::Map::new();
                filter.insert("admission_wait_ms".into(), wait_ms.into());
                if *self == Policy::KvgateFlowControl {
                    filter.insert("priority_header".into(), loadgen::PRIORITY_HEADER.into());
                    filter.insert("tenant_header".into(), loadgen::TENANT_HEADER.into());
                }
                (pool, filter)
            }
            Policy::KvgateSlo => (format!("admission = {{ enabled = true, {slos} }}"), serde_json::Map::new()),
            Policy::KvgateSloAdmission => {
                let wait_ms = wall_ms(slo.ttft_s);
                let pool = format!(
                    "admission = {{ enabled = true, {saturation}, max_queue_ms = {wait_ms}, max_queued = 1024, {slos} }}"
                );
                let mut filter = serde_json::Map::new();
                filter.insert("admission_wait_ms".into(), wait_ms.into());
                (pool, filter)
            }
            Policy::KvgateEngineMetrics => ("engine_metrics_secs = 1".into(), serde_json::Map::new()),
            Policy::KvgateSessions => ("[pools.sessions]".into(), serde_json::Map::new()),
            Policy::KvgateTuned(Knob::OffloadKib, kib) => {
                let mut filter = serde_json::Map::new();
                filter.insert("offload_bytes".into(), (u64::from(*kib) << 10).into());
                (String::new(), filter)
            }
            _ => (String::new(), serde_json::Map::new()),
        };
        StackOptions {
            name: name.into(),
            replicas: fleet.replicas,
            block_size: fleet.block_size,
            routing,
            route_timeout_ms: 200,
            pool_policy: pool_policy.into(),
            scoring_toml,
            pool_toml,
            filter_config,
            sim_args: fleet.sim_args(gpu_blocks),
            gateways: if matches!(self, Policy::Peer(_)) { 1 } else { gateways },
            sync: *self != Policy::KvgateNoSync,
            disaggregation: {
                let keys = match self {
                    Policy::KvgatePd(prefill_policy) => Some(format!("prefill_policy = \"{prefill_policy}\"")),
                    Policy::KvgatePdConditional => {
                        Some(format!("max_prefill_backlog_tokens = {}", 2 * fleet.max_num_batched_tokens))
                    }
                    _ => None,
                };
                keys.map(|keys| crate::stack::Disaggregation {
                    mode: "vllm".into(),
                    roles: (0..fleet.replicas)
                        .map(|i| if i < fleet.replicas / 2 { "prefill" } else { "decode" }.to_owned())
                        .collect(),
                    keys,
                })
            },
            ..StackOptions::default()
        }
    }
}

/// The simulated fleet every policy runs on.
#[derive(Debug, Clone, Serialize)]
pub struct Fleet {
    /// Engines.
    pub replicas: usize,
    /// KV block size.
    pub block_size: u32,
    /// Time-model preset (`kvgate-sim --list-presets`).
    pub preset: String,
    /// Simulated time runs this much faster than the wall clock.
    pub speedup: f64,
    /// GPU blocks per engine (shared-prefix sizes its own: 70 % of its resident set, at
    /// least 4 whole requests; cache-pressure its working set over its pressure).
    pub gpu_blocks: usize,
    /// `--max-num-seqs`.
    pub max_num_seqs: usize,
    /// `--max-num-batched-tokens`.
    pub max_num_batched_tokens: usize,
}

impl Fleet {
    /// GPU blocks per engine for `workload`.
    pub fn gpu_blocks_for(&self, workload: &Workload) -> usize {
        match workload {
            // 70 % of the resident set, but room for at least 4 whole requests per engine.
            Workload::SharedPrefix(s) => {
                let request = s.system_tokens + s.question_tokens + s.output_tokens as usize;
                (s.resident_tokens() * 7 / 10 / self.replicas).max(4 * request) / self.block_size as usize
            }
            // The working set over the pressure, but room for at least 4 whole requests.
            Workload::CachePressure(c) => {
                let request = c.document_tokens.max(c.one_off_tokens) + c.question_tokens + c.output_tokens as usize;
                let fleet = (c.working_set_tokens() as f64 / c.pressure) as usize;
                (fleet / self.replicas).max(4 * request) / self.block_size as usize
            }
            _ => self.gpu_blocks,
        }
    }

    fn sim_args(&self, gpu_blocks: usize) -> Vec<String> {
        [
            "--preset",
            &self.preset,
            "--speedup",
            &self.speedup.to_string(),
            "--num-gpu-blocks-override",
            &gpu_blocks.to_string(),
            "--max-num-seqs",
            &self.max_num_seqs.to_string(),
            "--max-num-batched-tokens",
            &self.max_num_batched_tokens.to_string(),
        ]
        .map(String::from)
        .to_vec()
    }
}

/// Everything a benchmark run needs.
#[derive(Debug, Clone, Serialize)]
pub struct BenchConfig {
    /// Workloads to run.
    pub workloads: Vec<Workload>,
    /// Policies to compare.
    pub policies: Vec<Policy>,
    /// Arrival rates (simulated requests/s) for workloads driven by QPS; a ladder if several.
    pub qps: Vec<f64>,
    /// Gateway pods, each run of a policy with each count: the load generator spreads
    /// requests over them at random.
    pub gateways: Vec<usize>,
    /// Runs per point (medians are reported).
    pub repeats: usize,
    /// The fleet.
    pub fleet: Fleet,
    /// No new requests after this much simulated time.
    pub max_duration_s: f64,
    /// A request is "good" if its TTFT is within this (simulated seconds).
    pub slo_ttft_s: f64,
    /// And meets the SLO if its mean inter-token latency is within this too (simulated
    /// seconds).
    pub slo_itl_s: f64,
    /// The Mooncake trace.
    pub trace: PathBuf,
    /// Seed of every random choice.
    pub seed: u64,
    /// How requests are split between priority classes or tenants.
    pub mix: workloads::Mix,
    /// The venv with the peer routers.
    pub peers_venv: PathBuf,
    /// Pin the routers (every gateway's Envoy and sidecar, or every peer instance) to core 0
    /// and the engines and the load generator to core 1, so neither side's CPU slows the
    /// other's (`taskset`; a 2-core machine's only split).
    pub pin: bool,
    /// Run every engine's threads at this nice value (1–19): the routers take the CPU when
    /// they need it and the engines every other cycle, as if the engines had hardware of
    /// their own, without halving their share as [`BenchConfig::pin`] does on two cores.
    pub engines_nice: Option<i32>,
    /// Replay each cell's requests offline for the bounds table. Off, the report has none;
    /// an overloaded cell's replay runs out its budget and gives none anyway.
    pub replay: bool,
}

impl BenchConfig {
    /// What a request must meet to count as served well.
    pub fn slo(&self) -> stats::Slo {
        stats::Slo { ttft_s: self.slo_ttft_s, itl_s: self.slo_itl_s }
    }
}

/// One run's result.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunResult {
    /// Workload name.
    pub workload: String,
    /// Policy name.
    pub policy: String,
    /// Gateway pods (or peer router instances) the requests were spread over.
    pub gateways: usize,
    /// Arrival rate (for QPS-driven workloads).
    pub qps: Option<f64>,
    /// Repeat index.
    pub repeat: usize,
    /// The numbers.
    pub summary: Summary,
    /// The peer router's command line, for peers.
    pub router_command: Option<String>,
    /// Requests the kvgate filter routed, and those it let Envoy balance (timeouts, errors,
    /// passthrough); `None` without kvgate.
    pub kvgate_routed: Option<(u64, u64)>,
    /// Per priority class and tenant (runs with a [`workloads::Mix`]).
    pub by_tag: Vec<stats::TagSummary>,
    /// Every request's outcome (`requests/*.jsonl` and the CDF chart).
    #[serde(skip)]
    pub outcomes: Vec<Outcome>,
}

impl RunResult {
    /// Every successful request's TTFT.
    pub fn ttfts(&self) -> Vec<f64> {
        self.outcomes.iter().filter(|o| o.ok()).filter_map(|o| o.ttft).collect()
    }

    /// The file its requests are written to, under `requests/`.
    pub fn requests_file(&self) -> String {
        let load = self.qps.map_or("closed".to_owned(), |q| format!("{q}qps"));
        format!("{}-{}-{}gw-{load}-r{}.jsonl", self.workload, self.policy, self.gateways, self.repeat)
    }
}

/// Runs every (workload, QPS, repeat, policy) combination, reporting progress on stderr;
/// fails if any cell did.
pub fn run(config: &BenchConfig, artifacts: &Artifacts) -> anyhow::Result<Vec<RunResult>> {
    let mut results = Vec::new();
    let failed = run_cells(config, artifacts, &cells::plan(config), |r| {
        results.push(r);
        Ok(())
    })?;
    if !failed.is_empty() {
        anyhow::bail!("{} cell(s) failed: {}", failed.len(), failed.join("; "));
    }
    Ok(results)
}

/// Runs the cells of `config` that `store` does not hold yet, writing each into it as it
/// finishes; returns the cells that failed (each with its error), after running the rest.
pub fn run_into(config: &BenchConfig, artifacts: &Artifacts, store: &mut CellStore) -> anyhow::Result<Vec<String>> {
    let plan = cells::plan(config);
    let todo = cells::pending(&plan, store.finished());
    eprintln!("bench: {} cells, {} finished before, {} to run", plan.len(), plan.len() - todo.len(), todo.len());
    run_cells(config, artifacts, &todo, |r| store.append(r))
}

/// Runs `cells` in order, handing each result to `done` (whose error stops the run); a cell
/// that fails is reported and skipped. Returns the failed cells' labels and errors.
fn run_cells(
    config: &BenchConfig,
    artifacts: &Artifacts,
    cells: &[Cell<'_>],
    mut done: impl FnMut(RunResult) -> anyhow::Result<()>,
) -> anyhow::Result<Vec<String>> {
    if config.pin {
        // Before the runtime and every stack start, so their threads inherit core 1.
        crate::process::pin(std::process::id(), 1)?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let mut progress = Progress::new(cells.len());
    let mut failed = Vec::new();
    for cell in cells {
        eprintln!("bench: {}", progress.start(&cell.label()));
        let started = Instant::now();
        let result = run_cell(config, artifacts, &runtime, cell);
        let took = progress.finish(started.elapsed());
        match result {
            Ok(r) => done(r)?,
            Err(e) => {
                eprintln!("bench:   FAILED: {e:#}");
                failed.push(format!("{}: {e:#}", cell.label()));
            }
        }
        eprintln!("bench: {took}");
    }
    Ok(failed)
}

/// Runs one cell on a fresh stack.
fn run_cell(
    config: &BenchConfig,
    artifacts: &Artifacts,
    runtime: &tokio::runtime::Runtime,
    cell: &Cell<'_>,
) -> anyhow::Result<RunResult> {
    let Cell { workload, gateways, qps, repeat, policy } = cell;
    let (gateways, qps, repeat) = (*gateways, *qps, *repeat);
    let plan_seed = config.seed + repeat as u64;
    let mut plan = workload.plan(qps.unwrap_or(1.0), plan_seed, &config.trace)?;
    config.mix.tag(&mut plan, plan_seed);
    let gpu_blocks = config.fleet.gpu_blocks_for(workload);
    let options = policy.stack_options(&policy.name(), &config.fleet, gpu_blocks, gateways, config.slo());
    let stack = Stack::start(&options, artifacts)?;
    if let Some(nice) = config.engines_nice {
        for pid in stack.engine_pids() {
            crate::process::renice(pid, nice)?;
        }
    }
    let peers = match policy {
        Policy::Peer(p) => {
            let ports = (0..gateways).map(|_| crate::process::free_port()).collect::<Result<Vec<_>, _>>()?;
            (0..gateways)
                .map(|index| {
                    let metrics_port = crate::process::free_port()?;
                    let instance = peers::Instance { index, mesh_ports: &ports, metrics_port };
                    p.start(&config.peers_venv, &stack.sims, config.fleet.block_size, &stack.dir, instance)
                })
                .collect::<anyhow::Result<Vec<_>>>()?
        }
        _ => Vec::new(),
    };
    let bases = match peers.is_empty() {
        true => stack.gateways(""),
        false => peers.iter().map(|p| p.base.clone()).collect(),
    };
    // The routers' processes, whose CPU time is the routing's cost.
    let router_pids: Vec<u32> = match peers.is_empty() {
        true => stack.gateway_pids(),
        false => peers.iter().filter_map(|p| p.pid()).collect(),
    };
    if config.pin {
        for &pid in &router_pids {
            crate::process::pin(pid, 0)?;
        }
    }
    let cpu_before = cpu_of(&router_pids);
    let before = engine_counters(&stack)?;
    let routed_before = kvgate_routed(&stack, *policy)?;
    let engines: Vec<String> = stack.sims.iter().map(|s| s.url("")).collect();
    let target = Target::spread(&bases, config.fleet.speedup, Duration::from_secs(600))?.with_engines(&engines)?;
    let duration = Duration::from_secs_f64(config.max_duration_s);
    let mut outcomes: Vec<Outcome> = runtime.block_on(async {
        match plan {
            Plan::OpenLoop(plan) => target.open_loop(plan, duration).await,
            Plan::Conversations(c) => target.conversations(c, workloads::MODEL, duration).await,
            Plan::Agents(sessions, systems) => target.agents(sessions, systems, workloads::MODEL, duration).await,
        }
    });
    let cpu = cpu_used(&cpu_before, &cpu_of(&router_pids));
    let after = engine_counters(&stack)?;
    // The run's own requests, not the stack's start-up probes.
    let kvgate_routed =
        kvgate_routed(&stack, *policy)?.zip(routed_before).map(|((routed, other), (r0, o0))| (routed - r0, other - o0));
    let work: Vec<EngineWork> = after
        .iter()
        .zip(&before)
        .map(|(a, b)| EngineWork {
            queried: a.queried - b.queried,
            hits: a.hits - b.hits,
            generated: a.generated - b.generated,
            stepped_s: a.stepped_s - b.stepped_s,
            lost_s: a.lost_s - b.lost_s,
        })
        .collect();
    let mut summary = stats::summarize(&outcomes, config.slo(), &work);
    summary.router_cpu_ms = (!outcomes.is_empty()).then(|| cpu * 1000.0 / outcomes.len() as f64);
    if policy.routing().0 == Routing::Kvgate {
        // A sidecar that cannot say leaves the figures out, not the run.
        let decisions = kept_decisions(&stack).unwrap_or_else(|e| {
            eprintln!("bench:   the kept decisions could not be read: {e:#}");
            Vec::new()
        });
        let errors = crate::stack::latency_errors_in(&decisions, "ttft");
        summary.ttft_error_p50 = stats::percentile(&errors, 50.0);
        summary.ttft_error_p90 = stats::percentile(&errors, 90.0);
        summary.ttft_checks = errors.len();
        attach_predictions(&mut outcomes, crate::stack::predictions_in(&decisions), config.fleet.speedup);
    }
    let served = ceiling::served(&artifacts.model_dir, config.fleet.block_size, &outcomes)?;
    summary.hit_ceiling = ceiling::infinite_cache_hit_ratio(&served);
    // Only a fleet of whole engines replays: a disaggregated one's requests ran on two.
    if config.replay && stack.sims.iter().all(|s| s.role.is_none()) {
        let replicas: Vec<String> = stack.sims.iter().map(|s| s.id.clone()).collect();
        summary.replayed = oracle::replay(&artifacts.sim, &config.fleet, gpu_blocks, &replicas, &served)?;
    }
    // The bodies have served their purpose; a whole bench's would weigh gigabytes.
    for o in &mut outcomes {
        o.body = None;
    }
    eprintln!(
        "bench:   {} ok, {} errors ({} shed), TTFT p50 {:?} p90 {:?} (served), hit ratio {:?}, load max/mean {:?}, sim clock lag {:?}, kvgate routed/other {:?}",
        summary.ok,
        summary.errors,
        summary.status_429,
        summary.ttft_p50,
        summary.ttft_p90,
        summary.hit_ratio,
        summary.load_max_over_mean,
        summary.sim_clock_lag,
        kvgate_routed
    );
    if let Some(failed) = outcomes.iter().find(|o| !o.ok()) {
        eprintln!("bench:   first failure: status {} {:?}", failed.status, failed.error);
    }
    Ok(RunResult {
        workload: workload.name().into(),
        policy: policy.name(),
        gateways,
        qps,
        repeat,
        router_command: peers.first().map(|p| p.command.clone()),
        kvgate_routed,
        by_tag: stats::by_tag(&outcomes, config.slo()),
        summary,
        outcomes,
    })
}

/// CPU seconds each process has used so far (`None`: not running).
fn cpu_of(pids: &[u32]) -> Vec<Option<f64>> {
    pids.iter().map(|&pid| crate::process::cpu_seconds(pid)).collect()
}

/// CPU seconds used between two readings of the same processes, by those running at both.
fn cpu_used(before: &[Option<f64>], after: &[Option<f64>]) -> f64 {
    before.iter().zip(after).filter_map(|(b, a)| Some(a.as_ref()? - b.as_ref()?)).sum()
}

/// What kvgate's filters have counted so far, summed over the gateways: requests the sidecar
/// routed, and requests left to Envoy (passed through, fallen back, or not asked about while
/// the circuit breaker was open). `None` when kvgate is not routing.
fn kvgate_routed(stack: &Stack, policy: Policy) -> anyhow::Result<Option<(u64, u64)>> {
    if policy.routing().0 != Routing::Kvgate {
        return Ok(None);
    }
    let stat = |n: &str| stack.filter_stat_total("kvgate.requests_total", &[("outcome", n)]);
    let other = stat("passthrough")? + stat("fallback_timeout")? + stat("fallback_error")? + stat("breaker_open")?;
    Ok(Some((stat("routed")?, other)))
}

/// Every gateway's kept decisions (as many as each sidecar keeps: `explain_keep`), each
/// fetched once for all the figures read from them.
fn kept_decisions(stack: &Stack) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut decisions = Vec::new();
    for gateway in 0..stack.gateways("").len() {
        decisions.extend(stack.decisions_of(gateway, 1 << 20)?);
    }
    Ok(decisions)
}

/// Writes into each outcome the TTFT and ITL kvgate predicted for it (`predicted`, in
/// wall-clock seconds), in simulated seconds: joined on the booking key.
fn attach_predictions(outcomes: &mut [Outcome], predicted: Vec<Predicted>, speedup: f64) {
    let by_booking: std::collections::HashMap<_, _> = predicted.into_iter().map(|p| (p.booking.clone(), p)).collect();
    for o in outcomes {
        if let Some(p) = by_booking.get(&o.booking) {
            (o.predicted_ttft, o.predicted_itl) = (p.ttft.map(|s| s * speedup), p.itl.map(|s| s * speedup));
            (o.ttft_inputs, o.itl_inputs) = (p.ttft_inputs.clone(), p.itl_inputs.clone());
        }
    }
}

/// Each engine's cumulative counters, from its `/metrics` (summed over its ranks).
fn engine_counters(stack: &Stack) -> anyhow::Result<Vec<EngineWork>> {
    let mut out = Vec::new();
    for sim in &stack.sims {
        out.push(EngineWork {
            queried: sim.metric("vllm:prefix_cache_queries_total")?,
            hits: sim.metric("vllm:prefix_cache_hits_total")?,
            generated: sim.metric("vllm:generation_tokens_total")?,
            stepped_s: sim.metric("kvgate_sim:step_wall_seconds_total")?,
            lost_s: sim.metric("kvgate_sim:clock_lost_seconds_total")?,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SLOs the stacks below are held to (simulated seconds).
    const SLO: stats::Slo = stats::Slo { ttft_s: 2.0, itl_s: 0.1 };

    #[test]
    fn policy_names_parse_back() {
        let tuned = Knob::ALL.into_iter().flat_map(|k| [Policy::KvgateTuned(k, 0), Policy::KvgateTuned(k, 12)]);
        for policy in Policy::ALL.into_iter().chain(tuned) {
            assert_eq!(Policy::parse(&policy.name()).unwrap(), policy, "{}", policy.name());
        }
        assert_eq!(Policy::KvgateTuned(Knob::DuplicatePenalty, 0).name(), "kvgate-kv-aware-dup-x0");
        assert!(Policy::parse("kvgate-kv-aware-dup-xfour").is_err());
    }

    #[test]
    fn tuned_policies_set_their_knob_on_kv_aware() {
        let fleet = Fleet {
            replicas: 2,
            block_size: 16,
            preset: "p".into(),
            speedup: 1.0,
            gpu_blocks: 100,
            max_num_seqs: 8,
            max_num_batched_tokens: 2048,
        };
        let o = Policy::KvgateTuned(Knob::DuplicatePenalty, 3).stack_options("x", &fleet, 100, 1, SLO);
        assert_eq!(
            (o.routing, o.pool_policy.as_str(), o.scoring_toml.as_str()),
            (Routing::Kvgate, "kv_aware", "duplicate_penalty = 3.0")
        );
        let o = Policy::KvgateTuned(Knob::OffloadKib, 256).stack_options("x", &fleet, 100, 1, SLO);
        assert_eq!((o.scoring_toml.as_str(), &o.filter_config["offload_bytes"]), ("", &serde_json::json!(262_144)));
        let o = Policy::KvgateDynamoCost.stack_options("x", &fleet, 100, 1, SLO);
        assert_eq!(o.scoring_toml, "prefill_load_scale = 1.0\nduplicate_penalty = 0.0");
        let o = Policy::KvgateAdmission.stack_options("x", &fleet, 100, 1, SLO);
        assert!(
            o.pool_toml.contains("kv_blocks = 100") && o.pool_toml.contains("max_queue_ms = 1000"),
            "{}",
            o.pool_toml
        );
        assert_eq!(o.filter_config["admission_wait_ms"], 1000);
        let o = Policy::KvgateSlo.stack_options("x", &fleet, 100, 1, SLO);
        assert!(
            o.pool_toml.contains("ttft_slo_ms = 2000, itl_slo_ms = 100, sheddable = true")
                && !o.pool_toml.contains("kv_blocks"),
            "{}",
            o.pool_toml
        );
        let o = Policy::KvgateSloAdmission.stack_options("x", &fleet, 100, 1, SLO);
        assert!(
            o.pool_toml.contains("kv_blocks = 100")
                && o.pool_toml.contains("max_queue_ms = 2000")
                && o.pool_toml.contains("ttft_slo_ms = 2000, itl_slo_ms = 100, sheddable = true"),
            "{}",
            o.pool_toml
        );
        assert_eq!(o.filter_config["admission_wait_ms"], 2000, "it waits as long as its SLO allows");
        let o = Policy::Peer(Peer::SglangCacheAware).stack_options("x", &fleet, 100, 4, SLO);
        assert_eq!(
            (o.routing, o.scoring_toml.as_str(), o.gateways),
            (Routing::RoundRobin, "", 1),
            "peers run their own"
        );
        let (synced, alone) = (
            Policy::Kvgate("kv_aware").stack_options("x", &fleet, 100, 4, SLO),
            Policy::KvgateNoSync.stack_options("x", &fleet, 100, 4, SLO),
        );
        assert_eq!((synced.gateways, synced.sync, alone.gateways, alone.sync), (4, true, 4, false));
    }

    /// Each request gets what kvgate predicted for it, found by its booking key and scaled to
    /// simulated time; a request kvgate kept no decision for gets nothing.
    #[test]
    fn each_request_gets_the_prediction_of_its_own_decision() {
        let mut outcomes = vec![
            Outcome { booking: "g-1".into(), ..Outcome::served("0", "a", 0.5) },
            Outcome { booking: "g-2".into(), ..Outcome::served("1", "b", 0.5) },
            Outcome::served("2", "a", 0.5),
        ];
        let predicted = vec![
            Predicted { booking: "g-2".into(), ttft: Some(0.1), itl: None, ttft_inputs: None, itl_inputs: None },
            Predicted {
                booking: "g-1".into(),
                ttft: Some(0.2),
                itl: Some(0.01),
                ttft_inputs: Some(serde_json::json!({"prefill_ahead": 900, "decoding": 2})),
                itl_inputs: None,
            },
        ];
        attach_predictions(&mut outcomes, predicted, 2.0);
        let got: Vec<_> = outcomes.iter().map(|o| (o.predicted_ttft, o.predicted_itl)).collect();
        assert_eq!(got, [(Some(0.4), Some(0.02)), (Some(0.2), None), (None, None)]);
        assert_eq!(outcomes[0].ttft_inputs, Some(serde_json::json!({"prefill_ahead": 900, "decoding": 2})));
        assert_eq!((&outcomes[1].ttft_inputs, &outcomes[2].ttft_inputs), (&None, &None));
    }
}
