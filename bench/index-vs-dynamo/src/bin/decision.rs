//! kvgate's full routing decision vs Dynamo's, in one run: prompt token ids in, a worker out,
//! its reservation made — and released, so load does not grow over the run.
//!
//! - kvgate: block hashing (`prompt_block_hashes`, which the filter does in Envoy) plus
//!   `Pool::route` (overlap lookup, Dynamo's cost over every replica, argmin, booking), then
//!   the end-of-request report.
//! - Dynamo 1.6.1: `SelectionCore::select_and_reserve` with the token ids (it hashes them
//!   itself) and the reference `DefaultWorkerSelector` policy, then `free_reservation` — the
//!   path its own `selection_core` criterion bench measures.
//!
//! 8, 64 and 512 replicas, 1k- and 8k-token prompts, both on one thread. Usage:
//! `cargo run --release --bin decision -- [iterations]` (default 2000).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dynamo_kv_router::protocols::RoutingConstraints;
use dynamo_kv_router::services::selection::{
    PromptRequest, SelectAndReserveRequest, SelectionCacheConfig, SelectionCore, WorkerRequest,
};
use dynamo_kv_router::KvRouterConfig;
use kvgate_shared::hash::{prompt_block_hashes, Salt};
use kvgate_shared::wire::RouteRequest;
use kvgate_sidecar::metrics::Metrics;
use kvgate_sidecar::pool::{Pool, PoolConfig, ReplicaConfig};
use kvgate_sidecar::score::ScoringConfig;
use tokio_util::sync::CancellationToken;

const BLOCK: u32 = 16;

fn tokens(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) % 150_000).collect()
}

fn percentile(mut v: Vec<Duration>, p: f64) -> Duration {
    v.sort();
    v[((p / 100.0) * (v.len() - 1) as f64).round() as usize]
}

fn kvgate(replicas: usize, prompt_len: usize, iterations: usize) -> Vec<Duration> {
    let replicas = (0..replicas)
        .map(|i| {
            let endpoint = format!("10.0.{}.{}:8000", i / 250, i % 250 + 1).parse().unwrap();
            ReplicaConfig::new(&format!("r{i}"), endpoint, "tcp://127.0.0.1:1")
        })
        .collect();
    let config = PoolConfig { inflight_credit_secs: 0, ..PoolConfig::new("m", "unused", BLOCK, replicas) };
    let pool = Pool::new(config, Vec::new(), Arc::new(Metrics::default()));
    let scoring = ScoringConfig::dynamo();
    let prompt = tokens(prompt_len, 7);
    let mut times = Vec::with_capacity(iterations);
    for i in 0..iterations {
        let id = format!("bench-{i}");
        let started = Instant::now();
        let request = RouteRequest::exact(&id, "m", prompt.len() as u32, BLOCK, prompt_block_hashes(&prompt, BLOCK as usize, Salt::NONE));
        let decision = pool.route(&request, &scoring);
        pool.lifecycle(&id, false);
        times.push(started.elapsed());
        assert!(decision.endpoint.is_some());
    }
    times
}

fn dynamo(runtime: &tokio::runtime::Runtime, workers: u64, prompt_len: usize, iterations: usize) -> Vec<Duration> {
    let config = KvRouterConfig { use_kv_events: true, router_queue_threshold: None, ..Default::default() };
    let core = SelectionCore::try_new_local(
        config,
        1,
        CancellationToken::new(),
        SelectionCacheConfig::default(),
        Arc::new(|config, role, _| {
            dynamo_kv_router::WorkerSelectionPolicy::reference(config.clone(), role.default_selector_label())
        }),
    )
    .expect("core");
    runtime.block_on(async {
        for worker_id in 1..=workers {
            let request = WorkerRequest {
                worker_id,
                endpoint: Some(format!("http://worker-{worker_id}:8000")),
                kv_events_endpoint: Some(format!("tcp://127.0.0.1:{}", 40_000 + worker_id)),
                block_size: Some(BLOCK),
                max_num_batched_tokens: Some(8192),
                ..WorkerRequest::default()
            };
            core.upsert_worker(request).await.expect("upsert");
        }
    });
    let prompt = tokens(prompt_len, 7);
    let mut times = Vec::with_capacity(iterations);
    for i in 0..iterations {
        let id = format!("bench-{i}");
        let request = SelectAndReserveRequest {
            model_name: "default".to_string(),
            routing_group: "default".to_string(),
            selection_id: Some(id.clone()),
            prompt: PromptRequest { token_ids: Some(prompt.clone()), ..PromptRequest::default() },
            router_config_override: None,
            expected_output_tokens: None,
            priority_jump: None,
            strict_priority: None,
            session_id: None,
            session_context: None,
            affinity_target: None,
            pinned_worker: None,
            allowed_worker_ids: None,
            routing_constraints: RoutingConstraints::default(),
        };
        let started = Instant::now();
        runtime.block_on(async {
            core.select_and_reserve(request).await.expect("reserve");
            core.free_reservation(&id).await.expect("free");
        });
        times.push(started.elapsed());
    }
    times
}

fn main() {
    let iterations: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(2000);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    println!("| replicas | prompt | kvgate p50 | kvgate p99 | Dynamo p50 | Dynamo p99 | Dynamo ÷ kvgate (p50) |");
    println!("|---|---|---|---|---|---|---|");
    let mut by_key: HashMap<(usize, usize), (Duration, Duration)> = HashMap::new();
    for replicas in [8usize, 64, 512] {
        for prompt_len in [1024usize, 8192] {
            let k = kvgate(replicas, prompt_len, iterations);
            let d = dynamo(&runtime, replicas as u64, prompt_len, iterations);
            let (kp50, kp99, dp50, dp99) =
                (percentile(k.clone(), 50.0), percentile(k, 99.0), percentile(d.clone(), 50.0), percentile(d, 99.0));
            by_key.insert((replicas, prompt_len), (kp50, dp50));
            println!(
                "| {replicas} | {}k tokens | {:.1} µs | {:.1} µs | {:.1} µs | {:.1} µs | {:.2}× |",
                prompt_len / 1024,
                kp50.as_secs_f64() * 1e6,
                kp99.as_secs_f64() * 1e6,
                dp50.as_secs_f64() * 1e6,
                dp99.as_secs_f64() * 1e6,
                dp50.as_secs_f64() / kp50.as_secs_f64()
            );
        }
    }
}
