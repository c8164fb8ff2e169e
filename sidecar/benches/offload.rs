//! An offloaded prompt made into its route request (`Pool::request_for_body`: render,
//! tokenize, hash; what the sidecar does on a tokenizer slot for a body the filter hands it):
//! a cold chat of about 32k and 128k words (a document never seen, and a question), on one
//! thread and spread over two, so what an idle core saves is measured against the same pool
//! without it. Run: `cargo bench -p kvgate-sidecar --bench offload`.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvgate_shared::codec;
use kvgate_shared::prompt::openai::{parse, Endpoint, ParsedRequest};
use kvgate_shared::wire::{ModelBundle, RouteBodyRequest};
use kvgate_sidecar::metrics::Metrics;
use kvgate_sidecar::pool::{Pool, PoolConfig, ReplicaConfig};

const BLOCK: u32 = 16;

fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// A pool of two replicas serving the vendored Qwen3, its tokenizer loaded.
fn pool() -> Pool {
    let model_dir = repo().join("models/qwen3-0.6b");
    let replicas = (0..2)
        .map(|i| {
            let endpoint = format!("127.0.0.1:{}", 9000 + i).parse().expect("address");
            ReplicaConfig::new(&format!("r{i}"), endpoint, "tcp://127.0.0.1:1")
        })
        .collect();
    let config = PoolConfig::new("qwen3", model_dir.clone(), BLOCK, replicas);
    let bundle = codec::encode(&ModelBundle::from_dir("qwen3", &model_dir, BLOCK).expect("model")).expect("bundle");
    let pool = Pool::new(config, bundle, Arc::new(Metrics::default()));
    pool.tokenizer().expect("tokenizer");
    pool
}

/// The offload of a chat: a document of `n` words no other seed shares, and a question.
fn offload(words: &[&str], seed: usize, n: usize) -> (ParsedRequest, RouteBodyRequest<'static>) {
    let document: Vec<String> = (0..n)
        .map(|i| match i % 13 {
            0 => format!("id{i}x{seed}"),
            _ => words[(i * 7 + seed * 977) % words.len()].to_owned(),
        })
        .collect();
    let body = serde_json::json!({"model": "qwen3", "max_tokens": 1, "messages": [
        {"role": "system", "content": document.join(" ")},
        {"role": "user", "content": "question"},
    ]})
    .to_string();
    let parsed = parse(Endpoint::ChatCompletions, body.as_bytes()).expect("body");
    let request = RouteBodyRequest {
        request_id: format!("r{seed}").into(),
        client_request_id: None,
        endpoint: Endpoint::ChatCompletions,
        body: body.into_bytes().into(),
        session: None,
        overrides: None,
        budget_ms: 60_000,
        wait_ms: 0,
        priority: None,
        tenant: None,
        ttft_slo_ms: None,
        itl_slo_ms: None,
        prefill_legs: false,
    };
    (parsed, request)
}

fn bench(c: &mut Criterion) {
    let readme = std::fs::read_to_string(repo().join("README.md")).expect("README");
    let words: Vec<&str> = readme.split_whitespace().collect();
    let mut group = c.benchmark_group("offload");
    group.sample_size(20);
    for n in [32_000, 128_000] {
        for threads in [1, 2] {
            // Its own pool (and segment cache); every variant meets the same documents.
            let pool = pool();
            let mut seed = 0;
            group.bench_function(BenchmarkId::new(format!("cold/{threads}-thread"), n), |b| {
                b.iter_batched(
                    || {
                        seed += 1;
                        offload(&words, seed, n)
                    },
                    |(parsed, request)| {
                        let deadline = Instant::now() + Duration::from_secs(60);
                        pool.request_for_body(&parsed, &request, deadline, threads).expect("routed")
                    },
                    criterion::BatchSize::PerIteration,
                )
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
