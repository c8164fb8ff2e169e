//! `cargo xtask bench filter`: what kvgate adds to a request's path, and tokenization inside
//! Envoy against native.
//!
//! For chats of about 1k, 8k and 32k tokens, cold (a document never seen) and warm (the same
//! document again with a new question: the filter's segment cache), it measures the time to
//! response headers through Envoy alone and through Envoy with kvgate, on the same engines.
//! The engines answer headers on admission, so the difference is the filter's and sidecar's
//! work. Native tokenization of the same prompts runs in this process.

use std::time::{Duration, Instant};

use kvgate_shared::prompt::openai::{parse, Endpoint};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::wire::ModelBundle;
use serde::Serialize;
use serde_json::{json, Value};

use super::stats::median;
use crate::client::client;
use crate::workload::document;
use crate::{Artifacts, Routing, Stack, StackOptions};

/// Prompt sizes measured (about one token per word).
pub const SIZES: [usize; 3] = [1_000, 8_000, 32_000];
/// Requests per (size, cache state, routing).
const SAMPLES: usize = 9;

/// One row of the report.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Prompt size (words ≈ tokens).
    pub tokens: usize,
    /// `cold` or `warm`.
    pub cache: &'static str,
    /// Median time to headers through Envoy alone, ms.
    pub envoy_ms: f64,
    /// Median time to headers through Envoy + kvgate, ms.
    pub kvgate_ms: f64,
    /// Median of the filter's own tokenize time (`x-kvgate-tokenize-us`), µs; 0 when the
    /// prompt was offloaded to the sidecar.
    pub filter_tokenize_us: f64,
    /// Median of the filter's whole decision (`x-kvgate-decision-us`), µs.
    pub filter_decision_us: f64,
    /// Median native tokenization of the same prompts (same segment-cache state), µs.
    pub native_tokenize_us: f64,
}

fn chat(doc: &str, question: &str) -> Value {
    json!({"model": "qwen3", "max_tokens": 1, "stream": true,
        "messages": [{"role": "system", "content": doc}, {"role": "user", "content": question}]})
}

/// The requests of one (size, cache) cell: cold ones each carry a new document; warm ones
/// share one (sent once before, unmeasured).
fn requests(size: usize, warm: bool, salt: u32) -> (Option<Value>, Vec<Value>) {
    let base = 50_000 + salt * 1000 + size as u32;
    if warm {
        let doc = document(base, size);
        let prime = chat(&doc, "first question");
        (Some(prime), (0..SAMPLES).map(|i| chat(&doc, &format!("question number {i}"))).collect())
    } else {
        (None, (0..SAMPLES).map(|i| chat(&document(base + 1 + i as u32, size), "question")).collect())
    }
}

/// Sends `body`; returns time to headers and the response headers.
fn time_to_headers(url: &str, body: &Value) -> anyhow::Result<(Duration, reqwest::header::HeaderMap)> {
    let started = Instant::now();
    let response = client().post(url).json(body).send()?;
    let elapsed = started.elapsed();
    let headers = response.headers().clone();
    anyhow::ensure!(response.status().is_success(), "status {}", response.status());
    response.text()?;
    Ok((elapsed, headers))
}

fn header_us(h: &reqwest::header::HeaderMap, name: &str) -> Option<f64> {
    h.get(name)?.to_str().ok()?.parse().ok()
}

/// Runs the measurement.
pub fn run(artifacts: &Artifacts) -> anyhow::Result<Vec<Row>> {
    let sim_args =
        ["--preset", "test", "--step-base-us", "100", "--prefill-us-per-token", "0"].map(String::from).to_vec();
    let options = |name: &str, routing| StackOptions {
        name: name.into(),
        replicas: 2,
        routing,
        sim_args: sim_args.clone(),
        route_timeout_ms: 2000,
        ..StackOptions::default()
    };
    let bundle = ModelBundle::from_dir("qwen3", &artifacts.model_dir, 16)?;
    let native = ModelTokenizer::from_bundle(&bundle)?.with_segment_cache(16 << 20);
    let mut rows = Vec::new();
    for (salt, routing) in [(0, Routing::RoundRobin), (1, Routing::Kvgate)] {
        let stack = Stack::start(&options("bench-filter", routing), artifacts)?;
        let url = stack.gateway("/v1/chat/completions");
        for size in SIZES {
            for warm in [false, true] {
                let (prime, bodies) = requests(size, warm, salt);
                if let Some(p) = &prime {
                    time_to_headers(&url, p)?;
                }
                let mut times = Vec::new();
                let mut tokenize = Vec::new();
                let mut decision = Vec::new();
                for body in &bodies {
                    let (t, h) = time_to_headers(&url, body)?;
                    times.push(t.as_secs_f64() * 1000.0);
                    tokenize.extend(header_us(&h, "x-kvgate-tokenize-us"));
                    decision.extend(header_us(&h, "x-kvgate-decision-us"));
                }
                let cache = if warm { "warm" } else { "cold" };
                let ms = median(&times).unwrap_or(0.0);
                match routing {
                    Routing::Kvgate => {
                        let row = rows
                            .iter_mut()
                            .find(|r: &&mut Row| r.tokens == size && r.cache == cache)
                            .ok_or_else(|| anyhow::anyhow!("no baseline row"))?;
                        row.kvgate_ms = ms;
                        row.filter_tokenize_us = median(&tokenize).unwrap_or(0.0);
                        row.filter_decision_us = median(&decision).unwrap_or(0.0);
                    }
                    _ => {
                        let mut native_us = Vec::new();
                        if let Some(p) = &prime {
                            native.prompt_tokens(&parse(Endpoint::ChatCompletions, p.to_string().as_bytes())?)?;
                        }
                        for body in &bodies {
                            let request = parse(Endpoint::ChatCompletions, body.to_string().as_bytes())?;
                            let started = Instant::now();
                            native.prompt_tokens(&request)?;
                            native_us.push(started.elapsed().as_secs_f64() * 1e6);
                        }
                        rows.push(Row {
                            tokens: size,
                            cache,
                            envoy_ms: ms,
                            kvgate_ms: 0.0,
                            filter_tokenize_us: 0.0,
                            filter_decision_us: 0.0,
                            native_tokenize_us: median(&native_us).unwrap_or(0.0),
                        });
                    }
                }
                eprintln!("bench filter: {size} tokens {cache} {routing:?}: {ms:.2} ms to headers");
            }
        }
    }
    Ok(rows)
}

/// The rows as a Markdown table.
pub fn table(rows: &[Row]) -> String {
    let mut md = String::from(
        "| prompt | cache | Envoy alone | Envoy + kvgate | added | filter tokenize | filter decision | native tokenize | in-Envoy ÷ native |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        // An offloaded prompt is tokenized by the sidecar: the filter's decision time includes it.
        let (tokenize, ratio) = if r.filter_tokenize_us == 0.0 {
            ("offloaded to the sidecar".to_owned(), "–".to_owned())
        } else {
            (
                format!("{:.2} ms", r.filter_tokenize_us / 1000.0),
                format!("{:.1}×", r.filter_tokenize_us / r.native_tokenize_us.max(1.0)),
            )
        };
        md += &format!(
            "| ~{}k tokens | {} | {:.2} ms | {:.2} ms | {:.2} ms | {tokenize} | {:.2} ms | {:.2} ms | {ratio} |\n",
            r.tokens / 1000,
            r.cache,
            r.envoy_ms,
            r.kvgate_ms,
            r.kvgate_ms - r.envoy_ms,
            r.filter_decision_us / 1000.0,
            r.native_tokenize_us / 1000.0,
        );
    }
    md
}
