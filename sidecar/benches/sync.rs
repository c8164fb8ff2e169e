//! What a peer gateway's requests cost this sidecar (`[sync]`): applying one request's three
//! sync events — `Booked` (its prompt's hashes to the in-flight credit, its load to the load
//! table), `FirstToken` and `Done` — at 64 and 1 000 replicas, for 3k-token prompts whose first
//! 16 blocks every replica holds (`fleet/mod.rs`) and whose rest is each request's own; and the
//! bytes one request's events take encoded, before sealing adds its fixed envelope. A
//! gateway's CPU for booking sync is then its peers' decisions per second × this time
//! (`docs/scale.md`). `held_by_events` is a booking as peers send it, saying the target's events
//! hold the shared blocks; `held_unknown` one that does not (as before sync version 4), whose
//! every block is recorded in the in-flight credit.
//! Run: `cargo bench -p kvgate-sidecar --bench sync`.

mod fleet;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvgate_shared::wire::RouteRequest;
use kvgate_sidecar::metrics::Metrics;
use kvgate_sidecar::msg::sync::{SyncBatch, SyncEvent};
use kvgate_sidecar::pool::Pool;
use kvgate_sidecar::pool::{PoolConfig, ReplicaConfig};

use fleet::BS;

/// Tokens of a peer's booked prompt.
const PROMPT_TOKENS: usize = 3072;

fn pool(replicas: usize) -> Pool {
    let configs = (0..replicas)
        .map(|i| {
            let endpoint = format!("10.{}.{}.1:8000", i / 250, i % 250).parse().expect("valid address");
            ReplicaConfig::new(&format!("r{i}"), endpoint, "tcp://127.0.0.1:1")
        })
        .collect();
    let p = Pool::new(PoolConfig::new("m", "unused", BS as u32, configs), Vec::new(), Arc::new(Metrics::default()));
    fleet::preload(&p, replicas, 1024, 0);
    p
}

/// Distinct prompts the peers' requests cycle through, each the group prefix and its own tokens.
const PROMPTS: usize = 4096;

/// A peer's request `n`: booked on replica `n % replicas`, whose events hold its first
/// `held_blocks`; first token; end.
fn events(n: u64, replicas: usize, request: &RouteRequest, held_blocks: u32) -> [SyncEvent; 3] {
    let request_id: kvgate_shared::ids::RequestId = format!("peer-{n}").as_str().into();
    [
        SyncEvent::Booked {
            model: "m".into(),
            target: format!("r{}", n % replicas as u64),
            request_id: request_id.clone(),
            prefill_tokens: PROMPT_TOKENS as u64,
            hashes: request.block_hashes.clone(),
            held_blocks,
            total_blocks: (PROMPT_TOKENS / BS) as u64,
            sequences: 1,
            session: None,
        },
        SyncEvent::FirstToken { model: "m".into(), request_id: request_id.clone() },
        SyncEvent::Done { model: "m".into(), request_id },
    ]
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("peer_request");
    group.sample_size(20);
    let prompts: Vec<RouteRequest> =
        (0..PROMPTS as u64).map(|n| fleet::request(PROMPT_TOKENS, 2_000_000 + n)).collect();
    let held = fleet::PREFIX_BLOCKS as u32;
    let one = SyncBatch { origin: "peer".into(), events: events(0, 1, &prompts[0], held).to_vec() };
    let bytes = kvgate_shared::codec::encode(&one).expect("encodable").len();
    eprintln!("one request's sync events, {PROMPT_TOKENS}-token prompt: {bytes} bytes encoded");
    for replicas in [64usize, 1000] {
        for (name, held_blocks) in [("held_by_events", held), ("held_unknown", 0)] {
            let p = pool(replicas);
            let next = AtomicU64::new(0);
            group.bench_function(BenchmarkId::new(name, replicas), |b| {
                b.iter(|| {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    for event in events(n, replicas, &prompts[n as usize % PROMPTS], held_blocks) {
                        p.apply_remote("peer", &event);
                    }
                })
            });
            assert_eq!(p.state().bookings, 0, "every peer request ended");
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
