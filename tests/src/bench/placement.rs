//! `cargo xtask bench memory`, last: what keeping tokenizers out of Envoy costs a request.
//!
//! Two gateways side by side, one Envoy worker each: kvgate as shipped (the worker tokenizes
//! bodies up to `offload_bytes`) and kvgate with `envoy_tokenizers: "none"` (the sidecar
//! tokenizes every body). The same chats go to both, interleaved (the order flipped every
//! round, so drift and order cancel out), on engines that answer at once; per cell the time
//! to response headers and the router CPU (Envoy and sidecar) per request. Chats are below
//! `offload_bytes`, the only bodies the setting moves: a bigger one goes to the sidecar
//! either way.

use std::time::Instant;

use serde::Serialize;
use serde_json::{json, Value};

use super::stats::percentile;
use crate::client::client;
use crate::process::cpu_seconds;
use crate::workload::document;
use crate::{Artifacts, Routing, Stack, StackOptions};

/// Prompt sizes (words ≈ tokens): a short chat, and one just under `offload_bytes`.
const SIZES: [usize; 2] = [1_000, 1_800];
/// Rounds per cell: each sends one chat to each gateway.
const ROUNDS: usize = 300;

/// One (size, cache) cell.
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    /// Prompt size, words.
    pub words: usize,
    /// `cold` (a new document each round) or `warm` (one document, a new question).
    pub cache: &'static str,
    /// Body size, bytes.
    pub body_bytes: usize,
    /// Time to headers, in Envoy: p50, p90, ms.
    pub envoy_p50_ms: f64,
    /// .
    pub envoy_p90_ms: f64,
    /// The same with the sidecar tokenizing.
    pub sidecar_p50_ms: f64,
    /// .
    pub sidecar_p90_ms: f64,
    /// Envoy's and the sidecar's CPU per request, tokenizing in Envoy, ms.
    pub envoy_cpu_ms: f64,
    /// The same with the sidecar tokenizing.
    pub sidecar_cpu_ms: f64,
}

fn chat(doc: &str, question: &str) -> Value {
    json!({"model": "qwen3", "max_tokens": 1,
        "messages": [{"role": "system", "content": doc}, {"role": "user", "content": question}]})
}

fn options(envoy_tokenizers: &str) -> StackOptions {
    StackOptions {
        name: format!("bench-placement-{envoy_tokenizers}"),
        replicas: 2,
        routing: Routing::Kvgate,
        sim_args: super::filter::instant_engines(&[]),
        route_timeout_ms: 5000,
        filter_config: serde_json::Map::from_iter([("envoy_tokenizers".to_owned(), json!(envoy_tokenizers))]),
        ..StackOptions::default()
    }
}

/// Sends `body`; its time to headers, and whether it was offloaded (`x-kvgate-offloaded`).
fn timed(url: &str, body: &str) -> anyhow::Result<(f64, bool)> {
    let started = Instant::now();
    let response = client().post(url).header("content-type", "application/json").body(body.to_owned()).send()?;
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    let offloaded = response.headers().get("x-kvgate-offloaded").is_some_and(|v| v == "true");
    anyhow::ensure!(response.status().is_success(), "status {}", response.status());
    response.bytes()?;
    Ok((ms, offloaded))
}

/// The router CPU seconds of a stack so far.
fn router_cpu(stack: &Stack) -> f64 {
    stack.gateway_pids().into_iter().filter_map(cpu_seconds).sum()
}

/// Runs every cell on one pair of gateways.
pub fn run(artifacts: &Artifacts) -> anyhow::Result<Vec<Cell>> {
    let stacks = [Stack::start(&options("all"), artifacts)?, Stack::start(&options("none"), artifacts)?];
    let urls = stacks.each_ref().map(|s| s.gateway("/v1/chat/completions"));
    let mut cells = Vec::new();
    for (seed, words) in (0u32..).zip(SIZES) {
        for warm in [false, true] {
            let base = 700_000 + seed * 10_000;
            let prime = chat(&document(base, words), "first question").to_string();
            let body = |i: usize| match warm {
                true => chat(&document(base, words), &format!("question number {i}")).to_string(),
                false => chat(&document(base + 1 + i as u32, words), "question").to_string(),
            };
            for url in &urls {
                timed(url, &prime)?;
            }
            let cpu_before = stacks.each_ref().map(router_cpu);
            let mut ms = [Vec::new(), Vec::new()];
            for i in 0..ROUNDS {
                let body = body(i);
                for side in [i % 2, 1 - i % 2] {
                    let (t, offloaded) = timed(&urls[side], &body)?;
                    anyhow::ensure!(
                        offloaded == (side == 1),
                        "a {words}-word chat ({} bytes) went the other way",
                        body.len()
                    );
                    ms[side].push(t);
                }
            }
            let cpu = [0, 1].map(|side| (router_cpu(&stacks[side]) - cpu_before[side]) * 1000.0 / ROUNDS as f64);
            let p = |side: usize, q| percentile(&ms[side], q).unwrap_or(0.0);
            let cell = Cell {
                words,
                cache: if warm { "warm" } else { "cold" },
                body_bytes: body(0).len(),
                envoy_p50_ms: p(0, 50.0),
                envoy_p90_ms: p(0, 90.0),
                sidecar_p50_ms: p(1, 50.0),
                sidecar_p90_ms: p(1, 90.0),
                envoy_cpu_ms: cpu[0],
                sidecar_cpu_ms: cpu[1],
            };
            eprintln!("bench placement: {cell:?}");
            cells.push(cell);
        }
    }
    Ok(cells)
}

/// The section of the report.
pub fn table(cells: &[Cell]) -> String {
    let mut md = format!(
        "### Tokenizing in Envoy or in the sidecar (`envoy_tokenizers`)\n\n\
         The same chats to two gateways (one Envoy worker each), interleaved, {ROUNDS} per cell; engines answering at once. \
         Time to response headers, and Envoy's plus the sidecar's CPU per request.\n\n\
         | prompt | cache | body | in Envoy: p50 | p90 | CPU | in the sidecar: p50 | p90 | CPU | sidecar ÷ Envoy, p50 | CPU |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n"
    );
    for c in cells {
        md += &format!(
            "| ~{} tokens | {} | {:.1} KB | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} | {:.2} |\n",
            c.words,
            c.cache,
            c.body_bytes as f64 / 1000.0,
            c.envoy_p50_ms,
            c.envoy_p90_ms,
            c.envoy_cpu_ms,
            c.sidecar_p50_ms,
            c.sidecar_p90_ms,
            c.sidecar_cpu_ms,
            c.sidecar_p50_ms / c.envoy_p50_ms.max(1e-9),
            c.sidecar_cpu_ms / c.envoy_cpu_ms.max(1e-9),
        );
    }
    md
}
