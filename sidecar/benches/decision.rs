//! The full routing decision — hashes in, endpoint out, reservation made — at 8, 64 and 512
//! replicas for 1k- and 8k-token prompts, against an index holding a realistic mix (see
//! `fleet/mod.rs`); and an agent's next turn, a 128k-token conversation one replica holds
//! all but its last turn of, at 8 and 64 replicas (`long_context`). Each decision's request
//! ends right after, so load stays steady.
//! Run: `cargo bench -p kvgate-sidecar --bench decision`.

mod fleet;

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvgate_shared::hash::{prompt_block_hashes, EngineHash, Salt};
use kvgate_shared::wire::RouteRequest;
use kvgate_sidecar::index::{ReplicaIdx, Store, Tier};
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
            let request = fleet::request(prompt_tokens, 42);
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

/// Tokens of the long conversation's next turn, and of the turn it adds.
const LONG_TOKENS: usize = 131_072;
const TURN_TOKENS: usize = 1_024;

/// Replica 0 of `pool` holds the conversation up to its last turn, stored as an engine
/// publishes it; returns the next turn's request.
fn conversation_on_first_replica(pool: &Pool) -> RouteRequest {
    let t = fleet::tokens(7, LONG_TOKENS);
    let held = (LONG_TOKENS - TURN_TOKENS) / BS;
    let engine: Vec<EngineHash> = (0..held as u64).map(|b| EngineHash(1 << 62 | b)).collect();
    let store = Store {
        parent: None,
        engine_hashes: &engine,
        token_ids: &t[..held * BS],
        block_size: BS,
        salt: Salt::NONE,
        extra: &[],
        tier: Tier::Device,
    };
    pool.store_blocks(ReplicaIdx::new(0), store).expect("consistent");
    RouteRequest::exact("bench", "m", LONG_TOKENS as u32, BS as u32, prompt_block_hashes(&t, BS, Salt::NONE))
}

fn long_context(c: &mut Criterion) {
    let mut group = c.benchmark_group("long_context");
    group.sample_size(20);
    let scoring = ScoringConfig::default();
    for replicas in [8usize, 64] {
        let p = pool(replicas, 1024);
        let request = conversation_on_first_replica(&p);
        let first = p.route(&request, &scoring);
        assert_eq!(first.replica.as_deref(), Some("r0"), "to the replica holding the conversation");
        assert_eq!(first.overlap_blocks as usize, (LONG_TOKENS - TURN_TOKENS) / BS, "the conversation is found");
        p.lifecycle(&"bench".into(), false);
        group.bench_function(BenchmarkId::new("next_turn_128k_tokens", replicas), |b| {
            b.iter(|| {
                let decision = p.route(&request, &scoring);
                p.lifecycle(&"bench".into(), false);
                decision
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench, long_context);
criterion_main!(benches);
