//! The full routing decision — hashes in, endpoint out, reservation made — at 8, 64 and 512
//! replicas for 1k- and 8k-token prompts, against an index holding a realistic mix (see
//! `fleet/mod.rs`). Each decision's request ends right after, so load stays steady.
//! Run: `cargo bench -p kvgate-sidecar --bench decision`.

mod fleet;

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvgate_sidecar::metrics::Metrics;
use kvgate_sidecar::pool::Pool;
use kvgate_sidecar::pool::{PoolConfig, ReplicaConfig};
use kvgate_sidecar::score::ScoringConfig;

use fleet::BS;

fn pool(replicas: usize, prompt_tokens: usize) -> Pool {
    let configs = (0..replicas)
        .map(|i| {
            let endpoint = format!("10.0.{}.{}:8000", i / 250, i % 250 + 1).parse().expect("valid address");
            ReplicaConfig::new(&format!("r{i}"), endpoint, "tcp://127.0.0.1:1")
        })
        .collect();
    let config = PoolConfig::new("m", "unused", BS as u32, configs);
    let p = Pool::new(config, Vec::new(), Arc::new(Metrics::default()));
    fleet::preload(&p, replicas, prompt_tokens, 0);
    p
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("decision");
    group.sample_size(20);
    let scoring = ScoringConfig::default();
    for prompt_tokens in [1024usize, 8192] {
        for replicas in [8usize, 64, 512] {
            let p = pool(replicas, prompt_tokens);
            let request = fleet::request(prompt_tokens);
            assert_eq!(p.route(&request, &scoring).overlap_blocks, 16, "the group prefix is found");
            p.lifecycle(&"bench".into(), false);
            group.bench_function(BenchmarkId::new(format!("{prompt_tokens}_tokens"), replicas), |b| {
                b.iter(|| {
                    let decision = p.route(&request, &scoring);
                    p.lifecycle(&"bench".into(), false);
                    decision
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
