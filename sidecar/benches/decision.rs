//! The full routing decision — hashes in, endpoint out, reservation made — at 8, 64 and 512
//! replicas for 1k- and 8k-token prompts, against an index holding a realistic mix: every
//! replica caches 64 prompts of the size measured, sharing 16-block group prefixes. Each
//! decision's request ends right after, so load stays steady.
//! Run: `cargo bench -p kvgate-sidecar --bench decision`.

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvgate_shared::hash::{prompt_block_hashes, EngineHash, Salt};
use kvgate_shared::wire::RouteRequest;
use kvgate_sidecar::config::{PoolConfig, ReplicaConfig};
use kvgate_sidecar::index::{ReplicaIdx, Store, Tier};
use kvgate_sidecar::metrics::Metrics;
use kvgate_sidecar::pool::Pool;
use kvgate_sidecar::score::ScoringConfig;

const BS: usize = 16;

fn tokens(seed: u64, n: usize) -> Vec<u32> {
    (0..n as u64).map(|i| (seed.wrapping_mul(0x9e37_79b9).wrapping_add(i * 7919) % 150_000) as u32).collect()
}

fn pool(replicas: usize, prompt_tokens: usize) -> Pool {
    let configs = (0..replicas)
        .map(|i| {
            let endpoint = format!("10.0.{}.{}:8000", i / 250, i % 250 + 1).parse().expect("valid address");
            ReplicaConfig::new(&format!("r{i}"), endpoint, "tcp://127.0.0.1:1")
        })
        .collect();
    let config = PoolConfig::new("m", "unused", BS as u32, configs);
    let p = Pool::new(config, Vec::new(), Arc::new(Metrics::default()));
    for r in 0..replicas {
        for q in 0..64u64 {
            let mut t = tokens(q % 8, 16 * BS);
            t.extend(tokens(1_000_000 + r as u64 * 1000 + q, prompt_tokens - 16 * BS));
            let engine: Vec<EngineHash> =
                (0..t.len() / BS).map(|b| EngineHash((r as u64) << 40 | q << 20 | b as u64)).collect();
            let store = Store {
                parent: None,
                engine_hashes: &engine,
                token_ids: &t[..engine.len() * BS],
                block_size: BS,
                salt: Salt::NONE,
                extra: &[],
                tier: Tier::Device,
            };
            p.store_blocks(ReplicaIdx::new(r), store).expect("consistent");
        }
    }
    p
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("decision");
    group.sample_size(20);
    let scoring = ScoringConfig::default();
    for prompt_tokens in [1024usize, 8192] {
        for replicas in [8usize, 64, 512] {
            let p = pool(replicas, prompt_tokens);
            // A prompt sharing a group prefix with every replica, then new content.
            let mut t = tokens(3, 16 * BS);
            t.extend(tokens(42, prompt_tokens - 16 * BS));
            let request = RouteRequest {
                request_id: "bench".into(),
                client_request_id: None,
                model: "m".into(),
                prompt_tokens: prompt_tokens as u32,
                prompt_count: kvgate_shared::wire::PromptCount::Exact,
                block_hashes: prompt_block_hashes(&t, BS, Salt::NONE),
                block_size: BS as u32,
                session: None,
                overrides: None,
                max_tokens: None,
                prompts: 1,
                samples: 1,
                stream: true,
                wait_ms: 0,
                priority: None,
                tenant: None,
                prefill_legs: false,
            };
            group.bench_function(BenchmarkId::new(format!("{prompt_tokens}_tokens"), replicas), |b| {
                b.iter(|| {
                    let decision = p.route(&request, &scoring);
                    p.lifecycle("bench", false);
                    decision
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
