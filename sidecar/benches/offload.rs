//! An offloaded prompt made into its route request (`Pool::request_for_body`: render,
//! tokenize, hash; what the sidecar does on a tokenizer slot for a body the filter hands it):
//! a cold chat of about 32k and 128k words (a document never seen, and a question), on one
//! thread and spread over two, so what an idle core saves is measured against the same pool
//! without it. And where a cold offload of ~128k tokens spends its time in the sidecar, stage by stage
//! on the same documents (`stages`): encoding the call (the filter's part); decoding it and parsing the body; render,
//! tokenize and hash; the decision (index lookup, scoring, booking, the in-flight credit); and
//! all of them in a row; and the same for a warm turn, the document again with a new
//! question (`warm_stages`).
//! Run: `cargo bench -p kvgate-sidecar --bench offload`.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion};
use kvgate_shared::codec;
use kvgate_shared::prompt::openai::{parse, Endpoint, ParsedRequest};
use kvgate_shared::wire::{ModelBundle, RouteBodyRequest};
use kvgate_sidecar::metrics::Metrics;
use kvgate_sidecar::pool::{Offloaded, Pool, PoolConfig, ReplicaConfig};
use kvgate_sidecar::score::ScoringConfig;

const BLOCK: u32 = 16;

fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// A pool of two replicas serving the vendored Qwen3, its tokenizer loaded.
fn pool() -> Pool {
    pool_with(|_| ())
}

/// [`pool`], its config changed by `change` first.
fn pool_with(change: impl FnOnce(&mut PoolConfig)) -> Pool {
    let model_dir = repo().join("models/qwen3-0.6b");
    let replicas = (0..2)
        .map(|i| {
            let endpoint = format!("127.0.0.1:{}", 9000 + i).parse().expect("address");
            ReplicaConfig::new(&format!("r{i}"), endpoint, "tcp://127.0.0.1:1")
        })
        .collect();
    let mut config = PoolConfig::new("qwen3", model_dir.clone(), BLOCK, replicas);
    change(&mut config);
    let bundle = codec::encode(&ModelBundle::from_dir("qwen3", &model_dir, BLOCK).expect("model")).expect("bundle");
    let pool = Pool::new(config, bundle, Arc::new(Metrics::default()));
    pool.tokenizer().expect("tokenizer");
    pool
}

/// The offload of a chat: a document of `n` words no other seed shares, and a question.
fn offload(words: &[&str], seed: usize, n: usize) -> (ParsedRequest, RouteBodyRequest<'static>) {
    turn(words, seed, n, seed)
}

/// The offload of one turn on a document: the document of `n` words of `seed` (as
/// [`offload`]'s), and question number `turn`, under its own request id.
fn turn(words: &[&str], seed: usize, n: usize, turn: usize) -> (ParsedRequest, RouteBodyRequest<'static>) {
    let document: Vec<String> = (0..n)
        .map(|i| match i % 13 {
            0 => format!("id{i}x{seed}"),
            _ => words[(i * 7 + seed * 977) % words.len()].to_owned(),
        })
        .collect();
    let body = serde_json::json!({"model": "qwen3", "max_tokens": 1, "messages": [
        {"role": "system", "content": document.join(" ")},
        {"role": "user", "content": format!("question {turn}")},
    ]})
    .to_string();
    let parsed = parse(Endpoint::ChatCompletions, body.as_bytes()).expect("body");
    let request = RouteBodyRequest::of(&format!("r{turn}"), Endpoint::ChatCompletions, body.into_bytes(), 60_000);
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
                        pool.request_for_body(&parsed, &Offloaded::of(&request), deadline, threads).expect("routed")
                    },
                    criterion::BatchSize::PerIteration,
                )
            });
        }
    }
    group.finish();
}

/// The filter's call decoded and its body parsed in place, as the sidecar does first.
fn decode_and_parse(call: &[u8]) -> (ParsedRequest, Offloaded) {
    let request: RouteBodyRequest<'_> = codec::decode(call).expect("decoded");
    let parsed = parse(request.endpoint, &request.body).expect("parsed");
    (parsed, Offloaded::of(&request))
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(60)
}

/// The sidecar's stages for the offloads `make` makes (the `i`-th for each iteration, from 1;
/// the 0th once, first), each on its own pool: render, tokenize and hash; the decision, on
/// each of `decide_on`, the previous request ended before each one (untimed: an end is not on
/// the decision's path, and the load stays steady); and all of them from the encoded call.
fn sidecar_stages(
    group: &mut BenchmarkGroup<'_, WallTime>,
    n: usize,
    make: impl Fn(usize) -> (ParsedRequest, RouteBodyRequest<'static>),
    decide_on: &[(&str, Pool)],
) {
    let scoring = ScoringConfig::default();
    let pool_for_tokenize = pool();
    let (parsed, request) = make(0);
    pool_for_tokenize.request_for_body(&parsed, &Offloaded::of(&request), deadline(), 1).expect("routed");
    let mut i = 0;
    group.bench_function(BenchmarkId::new("tokenize_and_hash", n), |b| {
        b.iter_batched(
            || {
                i += 1;
                make(i)
            },
            |(parsed, request)| {
                pool_for_tokenize.request_for_body(&parsed, &Offloaded::of(&request), deadline(), 1).expect("routed")
            },
            criterion::BatchSize::PerIteration,
        )
    });

    for (name, pool) in decide_on {
        let mut i = 0;
        group.bench_function(BenchmarkId::new(*name, n), |b| {
            b.iter_batched(
                || {
                    pool.lifecycle(&format!("r{i}").into(), false);
                    i += 1;
                    let (parsed, request) = make(i);
                    pool.request_for_body(&parsed, &Offloaded::of(&request), deadline(), 1).expect("routed")
                },
                |route| pool.route(&route, &scoring),
                criterion::BatchSize::PerIteration,
            )
        });
    }

    let pool_for_all = pool();
    let mut i = 0;
    group.bench_function(BenchmarkId::new("all", n), |b| {
        b.iter_batched(
            || {
                pool_for_all.lifecycle(&format!("r{i}").into(), false);
                i += 1;
                codec::encode(&make(i).1).expect("encoded")
            },
            |call| {
                let (parsed, offloaded) = decode_and_parse(&call);
                let route = pool_for_all.request_for_body(&parsed, &offloaded, deadline(), 1).expect("routed");
                pool_for_all.route(&route, &scoring)
            },
            criterion::BatchSize::PerIteration,
        )
    });
}

/// The words of a ~128k-token document (the words of the README, with ids, run ~2.3 tokens
/// each): the one [`stages`] and [`warm_stages`] share.
const WORDS_128K: usize = 55_000;

/// A cold offload's stages, each timed on its own over the same documents, and all in a row.
fn stages(c: &mut Criterion) {
    let readme = std::fs::read_to_string(repo().join("README.md")).expect("README");
    let words: Vec<&str> = readme.split_whitespace().collect();
    let n = WORDS_128K;
    let mut group = c.benchmark_group("offload_stages");
    group.sample_size(20);

    // The size of what every stage handles (each seed's document is about as long).
    let (parsed, request) = offload(&words, 0, n);
    let route = pool().request_for_body(&parsed, &Offloaded::of(&request), deadline(), 1).expect("routed");
    eprintln!(
        "offload_stages: a {} KB body, {} prompt tokens, {} full blocks of {BLOCK}",
        request.body.len() / 1000,
        route.prompt_tokens,
        route.block_hashes.len()
    );

    // What the filter does before the call: encode it (here natively; in Envoy, in its VM).
    let mut seed = 0;
    group.bench_function(BenchmarkId::new("encode_call", n), |b| {
        b.iter_batched(
            || {
                seed += 1;
                offload(&words, seed, n).1
            },
            |request| codec::encode(&request).expect("encoded"),
            criterion::BatchSize::PerIteration,
        )
    });

    let mut seed = 0;
    group.bench_function(BenchmarkId::new("decode_and_parse", n), |b| {
        b.iter_batched(
            || {
                seed += 1;
                codec::encode(&offload(&words, seed, n).1).expect("encoded")
            },
            |call| decode_and_parse(&call),
            criterion::BatchSize::PerIteration,
        )
    });

    // The documents are cold in each pool's index and in-flight credit too. Without the
    // in-flight credit (`inflight_credit_secs = 0`): what remembering where the prompt went
    // costs.
    let pools = [("decide", pool()), ("decide_without_inflight_credit", pool_with(|c| c.inflight_credit_secs = 0))];
    sidecar_stages(&mut group, n, |seed| offload(&words, seed, n), &pools);
    group.finish();
}

/// A warm turn's stages: the same ~128k-token document as [`stages`], every turn with a new
/// question (an agent's next turn), after the previous turn has ended. Parsing is a cold
/// turn's; rendering and tokenizing meet the document in the segment cache, and the decision
/// finds it in the in-flight credit of the replica the previous turn went to.
fn warm_stages(c: &mut Criterion) {
    let readme = std::fs::read_to_string(repo().join("README.md")).expect("README");
    let words: Vec<&str> = readme.split_whitespace().collect();
    let n = WORDS_128K;
    let mut group = c.benchmark_group("warm_stages");
    group.sample_size(20);
    sidecar_stages(&mut group, n, |i| turn(&words, 0, n, i), &[("decide", pool())]);
    group.finish();
}

criterion_group!(benches, bench, stages, warm_stages);
criterion_main!(benches);
