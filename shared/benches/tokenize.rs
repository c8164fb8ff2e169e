//! Chat tokenization for ~1k, 8k, 32k and 128k-token conversations, every variant in the same
//! run so the ratios between them are what to read (`cargo bench -p kvgate-shared`):
//!
//! - `legacy`: the chat rendered by kvgate, encoded by `tokenizers` 0.22 (what kvgate ran
//!   before 1.0; the baseline);
//! - `cold`: the whole pipeline (parse, render, encode) on a conversation never seen;
//! - `cold-cached`: the same with the segment cache on (what the cache costs when it misses);
//! - `cold-spread-2`: `cold`, spread over two threads (`prompt_tokens_on`, as the sidecar
//!   tokenizes a long offloaded prompt on an idle machine of two cores);
//! - `warm`: the segment cache on, the conversation seen before plus one new turn.
//!
//! Every cold iteration is a different conversation: prose cut from the repo's own docs at a
//! moving offset, with fresh identifiers and numbers sprinkled in, so no tokenizer-internal
//! word cache makes a repeated document look cheap.

use std::path::{Path, PathBuf};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvgate_shared::prompt::openai::{parse, Endpoint, Prompt};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::wire::ModelBundle;
use serde_json::{json, Value};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The words of every Markdown file in the repo's docs and README.
fn corpus() -> Vec<String> {
    let mut files = vec![repo().join("README.md")];
    let mut stack = vec![repo().join("docs")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(dir).expect("docs/") {
            let path = entry.expect("entry").path();
            match path.extension().and_then(|e| e.to_str()) {
                _ if path.is_dir() => stack.push(path),
                Some("md") => files.push(path),
                _ => {}
            }
        }
    }
    files.sort();
    files
        .iter()
        .flat_map(|f| std::fs::read_to_string(f).expect("doc").split(' ').map(str::to_owned).collect::<Vec<_>>())
        .collect()
}

/// `n` words of prose starting at a place `seed` picks, with an identifier every 17 words.
fn prose(corpus: &[String], seed: usize, n: usize) -> String {
    let start = seed.wrapping_mul(7_919) % corpus.len();
    (0..n)
        .map(|i| match i % 17 {
            16 => format!("req-{:x}", (seed as u64 * 1_000_003 + i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40),
            _ => corpus[(start + i) % corpus.len()].clone(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A conversation of about `tokens` tokens (the docs' prose runs about two tokens a word): a
/// system document and turns of ~500 tokens, none shared with another seed's.
fn conversation(corpus: &[String], seed: usize, tokens: usize) -> Vec<Value> {
    let seed = seed * 1_000;
    let mut messages = vec![json!({"role": "system", "content": prose(corpus, seed, 200)})];
    for turn in 0..tokens.saturating_sub(500) / 500 {
        messages.push(json!({"role": "user", "content": prose(corpus, seed + turn * 2 + 1, 100)}));
        messages.push(json!({"role": "assistant", "content": prose(corpus, seed + turn * 2 + 2, 100)}));
    }
    messages
}

fn body(messages: &[Value], question: usize) -> Vec<u8> {
    let mut messages = messages.to_vec();
    messages.push(json!({"role": "user", "content": format!("new question {question}")}));
    json!({"model": "qwen3", "messages": messages}).to_string().into_bytes()
}

fn bench(c: &mut Criterion) {
    let dir = repo().join("models/qwen3-0.6b");
    let bundle = ModelBundle::from_dir("qwen3", &dir, 16).expect("the vendored model");
    let legacy = tokenizers_legacy::Tokenizer::from_file(dir.join("tokenizer.json")).expect("tokenizer");
    let template = bundle.template().expect("template").expect("the model has a template");
    let cold = ModelTokenizer::from_bundle(&bundle).expect("tokenizer");
    let cached = ModelTokenizer::from_bundle(&bundle).expect("tokenizer").with_segment_cache(64 << 20);
    // Its own instance: the tokenizer's word cache fills as it runs, so a variant sharing one
    // would meet another's leftovers.
    let spread = ModelTokenizer::from_bundle(&bundle).expect("tokenizer");
    let corpus = corpus();
    let mut group = c.benchmark_group("chat");
    group.sample_size(10);
    for size in [1_000, 8_000, 32_000, 128_000] {
        let n = cold
            .prompt_tokens(&parse(Endpoint::ChatCompletions, &body(&conversation(&corpus, 0, size), 0)).expect("body"))
            .expect("tokens")
            .len();
        // Each variant meets the same conversations in the same order, none seen before.
        let corpus = &corpus;
        let fresh = || {
            let mut seed = 1;
            move || {
                seed += 1;
                body(&conversation(corpus, seed, size), seed)
            }
        };
        let mut conversations = fresh();
        group.bench_function(BenchmarkId::new("legacy", n), |b| {
            b.iter_batched(
                &mut conversations,
                |body| {
                    let request = parse(Endpoint::ChatCompletions, &body).expect("body");
                    let Prompt::Chat(chat) = &request.prompt else { unreachable!("a chat") };
                    let text = template.render(chat).expect("render");
                    legacy.encode_fast(text, false).expect("encode").get_ids().len()
                },
                criterion::BatchSize::PerIteration,
            )
        });
        for (name, tokenizer, threads) in
            [("cold", &cold, 1), ("cold-cached", &cached, 1), ("cold-spread-2", &spread, 2)]
        {
            let mut conversations = fresh();
            group.bench_function(BenchmarkId::new(name, n), |b| {
                b.iter_batched(
                    &mut conversations,
                    |body| {
                        tokenizer
                            .prompt_tokens_on(&parse(Endpoint::ChatCompletions, &body).expect("body"), threads)
                            .expect("tokens")
                    },
                    criterion::BatchSize::PerIteration,
                )
            });
        }
        let seen = conversation(corpus, 0, size);
        let mut question = 0;
        group.bench_function(BenchmarkId::new("warm", n), |b| {
            b.iter_batched(
                || {
                    question += 1;
                    body(&seen, question)
                },
                |body| cached.prompt_tokens(&parse(Endpoint::ChatCompletions, &body).expect("body")).expect("tokens"),
                criterion::BatchSize::PerIteration,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
