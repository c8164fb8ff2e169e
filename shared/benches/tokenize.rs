//! Chat tokenization, cold (no segment cache) vs warm (the conversation seen before, one new
//! turn), for ~1k, ~8k and ~32k-token conversations. Run: `cargo bench -p kvgate-shared`.
//! The ratio of the two, measured in the same run, is what matters.

use std::path::Path;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvgate_shared::prompt::openai::{parse, Endpoint};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::wire::ModelBundle;
use serde_json::{json, Value};

fn words(seed: usize, n: usize) -> String {
    const VOCAB: [&str; 10] =
        ["router", "cache", "prefix", "token", "envoy", "replica", "latency", "decode", "kernel", "block"];
    (0..n).map(|i| VOCAB[(i * 7 + seed * 3 + i / 11) % VOCAB.len()]).collect::<Vec<_>>().join(" ")
}

/// A conversation of about `tokens` tokens in turns of ~500.
fn conversation(tokens: usize) -> Vec<Value> {
    let mut messages = vec![json!({"role": "system", "content": words(0, 500)})];
    for turn in 0..tokens.saturating_sub(500) / 500 {
        messages.push(json!({"role": "user", "content": words(turn * 2 + 1, 250)}));
        messages.push(json!({"role": "assistant", "content": words(turn * 2 + 2, 250)}));
    }
    messages
}

fn bench(c: &mut Criterion) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3-0.6b");
    let bundle = ModelBundle::from_dir("qwen3", &dir, 16).expect("the vendored model");
    let cold = ModelTokenizer::from_bundle(&bundle).expect("tokenizer");
    let warm = ModelTokenizer::from_bundle(&bundle).expect("tokenizer").with_segment_cache(64 << 20);
    let mut group = c.benchmark_group("chat");
    group.sample_size(10);
    for size in [1_000, 8_000, 32_000] {
        let base = conversation(size);
        let body = |i: usize| {
            let mut messages = base.clone();
            messages.push(json!({"role": "user", "content": format!("new question {i}")}));
            json!({"model": "qwen3", "messages": messages}).to_string()
        };
        let first = parse(Endpoint::ChatCompletions, body(0).as_bytes()).expect("body");
        let n = cold.prompt_tokens(&first).expect("tokens").len();
        warm.prompt_tokens(&first).expect("tokens");
        let mut i = 0;
        group.bench_function(BenchmarkId::new("cold", n), |b| {
            b.iter(|| {
                i += 1;
                let request = parse(Endpoint::ChatCompletions, body(i).as_bytes()).expect("body");
                cold.prompt_tokens(&request).expect("tokens")
            })
        });
        group.bench_function(BenchmarkId::new("warm", n), |b| {
            b.iter(|| {
                i += 1;
                let request = parse(Endpoint::ChatCompletions, body(i).as_bytes()).expect("body");
                warm.prompt_tokens(&request).expect("tokens")
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
