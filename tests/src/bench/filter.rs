//! `cargo xtask bench filter`: what kvgate adds to a request's path, tokenization inside
//! Envoy against native, and what a big prompt does to everyone else's latency.
//!
//! 1. **Overhead.** For chats of about 1k, 8k, 32k and 128k tokens, cold (a document never seen)
//!    and warm (the same document again with a new question: the segment cache), the time to
//!    response headers through Envoy alone, through Envoy + kvgate as shipped (bodies over
//!    `offload_bytes` tokenized by the sidecar), and through Envoy + kvgate tokenizing
//!    everything in Envoy (offload off), and through Envoy + kvgate with no tokenizer in Envoy
//!    (`envoy_tokenizers: "none"`: the sidecar tokenizes every request), and through Envoy +
//!    kvgate as shipped but with a long offloaded prompt spread over two sidecar threads
//!    (`offload_spread_threads = 2`). The engines answer
//!    headers on admission, so the
//!    differences are the filter's and sidecar's work. Native tokenization of the same
//!    prompts runs in this process.
//! 2. **Head-of-line blocking.** Small chats, one after another, while another client keeps
//!    sending ~400 KB prompts (until at least 5 went through); against an idle baseline. Envoy runs one worker thread, so a
//!    prompt tokenized on it stalls every request behind it; offloaded, it does not.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_shared::prompt::openai::{parse, Endpoint};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::wire::ModelBundle;
use serde::Serialize;
use serde_json::{json, Value};

use super::progress::Progress;
use super::stats::{median, percentile};
use crate::client::client;
use crate::workload::document;
use crate::{Artifacts, Routing, Stack, StackOptions};

/// Prompt sizes measured (about one token per word).
pub const SIZES: [usize; 4] = [1_000, 8_000, 32_000, 128_000];
/// Requests per (size, cache state, routing).
const SAMPLES: usize = 9;

/// One row of the overhead table.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Row {
    /// Prompt size (words ≈ tokens).
    pub tokens: usize,
    /// `cold` or `warm`.
    pub cache: &'static str,
    /// Median time to headers through Envoy alone, ms.
    pub envoy_ms: f64,
    /// Median time to headers through Envoy + kvgate as shipped (offload on), ms.
    pub kvgate_ms: f64,
    /// Median of that filter's whole decision (`x-kvgate-decision-us`), µs.
    pub filter_decision_us: f64,
    /// True when kvgate as shipped offloaded these prompts to the sidecar.
    pub offloaded: bool,
    /// Median time to headers through Envoy + kvgate with every prompt tokenized in Envoy, ms.
    pub inline_ms: f64,
    /// Median of the in-Envoy tokenize time (`x-kvgate-tokenize-us`, offload off), µs.
    pub inline_tokenize_us: f64,
    /// Median time to headers through Envoy + kvgate with every prompt tokenized by the
    /// sidecar (`envoy_tokenizers: "none"`), ms.
    pub sidecar_ms: f64,
    /// Median time to headers through Envoy + kvgate as shipped, but with long offloaded
    /// prompts spread over two sidecar threads (`offload_spread_threads = 2`), ms.
    pub spread_ms: f64,
    /// Median of that filter's whole decision (`x-kvgate-decision-us`), µs.
    pub spread_decision_us: f64,
    /// Median native tokenization of the same prompts (same segment-cache state), µs.
    pub native_tokenize_us: f64,
    /// The same spread over two threads (`prompt_tokens_on`), µs.
    pub native_spread_us: f64,
}

/// Small-request latency with big prompts in flight, for one gateway setup.
#[derive(Debug, Clone, Serialize)]
pub struct Stall {
    /// The gateway setup's label.
    pub setup: &'static str,
    /// Small requests' time to headers, idle gateway: p50, p99, ms.
    pub idle_p50_ms: f64,
    /// .
    pub idle_p99_ms: f64,
    /// The same with big prompts being sent all along: p50, p99, max, ms.
    pub loaded_p50_ms: f64,
    /// .
    pub loaded_p99_ms: f64,
    /// .
    pub loaded_max_ms: f64,
    /// Big prompts answered while the small ones ran.
    pub big_prompts: usize,
}

/// Everything `cargo xtask bench filter` measures.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The overhead table.
    pub rows: Vec<Row>,
    /// The head-of-line table.
    pub stalls: Vec<Stall>,
    /// Size of each big prompt's body, bytes.
    pub big_prompt_bytes: usize,
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

/// Small requests measured per head-of-line scenario.
const SMALL_REQUESTS: usize = 40;
/// Words in a big prompt (about 400 KB of JSON).
const BIG_PROMPT_WORDS: usize = 57_000;
/// Big prompts that must go through while the small requests of the loaded phase run.
const BIG_PROMPTS: usize = 5;

/// The gateway setups: Envoy alone, kvgate as shipped, kvgate with offload off, kvgate with
/// no tokenizer in Envoy, kvgate spreading long offloaded prompts over two threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Setup {
    EnvoyAlone,
    Kvgate,
    KvgateInline,
    KvgateSidecar,
    KvgateSpread,
}

impl Setup {
    /// The spreading setup right after the shipped one, so the two differ the least in time.
    const ALL: [Setup; 5] =
        [Setup::EnvoyAlone, Setup::Kvgate, Setup::KvgateSpread, Setup::KvgateInline, Setup::KvgateSidecar];

    fn label(self) -> &'static str {
        match self {
            Setup::EnvoyAlone => "Envoy alone",
            Setup::Kvgate => "kvgate (offload on, as shipped)",
            Setup::KvgateInline => "kvgate (offload off: all in Envoy)",
            Setup::KvgateSidecar => "kvgate (no tokenizer in Envoy: all in the sidecar)",
            Setup::KvgateSpread => "kvgate (offload on, long prompts spread over 2 sidecar threads)",
        }
    }

    fn options(self, sim_args: &[String]) -> StackOptions {
        let mut filter_config = serde_json::Map::new();
        if self == Setup::KvgateInline {
            filter_config.insert("offload_bytes".into(), (64usize << 20).into());
            filter_config.insert("max_tokenize_bytes".into(), (64usize << 20).into());
        }
        if self == Setup::KvgateSidecar {
            filter_config.insert("envoy_tokenizers".into(), "none".into());
        }
        StackOptions {
            name: "bench-filter".into(),
            replicas: 2,
            routing: if self == Setup::EnvoyAlone { Routing::RoundRobin } else { Routing::Kvgate },
            sim_args: sim_args.to_vec(),
            route_timeout_ms: 5000,
            filter_config,
            sidecar_toml: if self == Setup::KvgateSpread { "offload_spread_threads = 2".into() } else { String::new() },
            ..StackOptions::default()
        }
    }
}

/// Simulator flags for engines that answer at once (100 µs steps, no compute cost per token),
/// then `sizes` (cache and batch limits).
pub fn instant_engines(sizes: &[&str]) -> Vec<String> {
    ["--preset", "test", "--step-base-us", "100", "--prefill-us-per-token", "0", "--attn-us-per-token-pair", "0"]
        .iter()
        .chain(sizes)
        .map(|s| s.to_string())
        .collect()
}

/// Runs the measurement.
pub fn run(artifacts: &Artifacts) -> anyhow::Result<Report> {
    // Engines that answer at once and hold a 400 KB prompt.
    let sim_args = instant_engines(&["--num-gpu-blocks-override", "16384", "--max-num-batched-tokens", "131072"]);
    let bundle = ModelBundle::from_dir("qwen3", &artifacts.model_dir, 16)?;
    let native = ModelTokenizer::from_bundle(&bundle)?.with_segment_cache(16 << 20);
    // Its own segment cache: the one above has seen each cell's prompts by then.
    let native_spread = ModelTokenizer::from_bundle(&bundle)?.with_segment_cache(16 << 20);
    let mut rows: Vec<Row> = Vec::new();
    let mut stalls = Vec::new();
    // Every setup: each size cold and warm, then the head-of-line stall.
    let mut progress = Progress::new(Setup::ALL.len() * (SIZES.len() * 2 + 1));
    for (salt, setup) in (0u32..).zip(Setup::ALL) {
        let stack = Stack::start(&setup.options(&sim_args), artifacts)?;
        let url = stack.gateway("/v1/chat/completions");
        for size in SIZES {
            for warm in [false, true] {
                let cache = if warm { "warm" } else { "cold" };
                eprintln!("bench filter: {}", progress.start(&format!("{size} tokens {cache} {}", setup.label())));
                let started = Instant::now();
                let (prime, bodies) = requests(size, warm, salt);
                if let Some(p) = &prime {
                    time_to_headers(&url, p)?;
                }
                let (mut times, mut tokenize, mut decision, mut offloaded) =
                    (Vec::new(), Vec::new(), Vec::new(), false);
                for body in &bodies {
                    let (t, h) = time_to_headers(&url, body)?;
                    times.push(t.as_secs_f64() * 1000.0);
                    tokenize.extend(header_us(&h, "x-kvgate-tokenize-us"));
                    decision.extend(header_us(&h, "x-kvgate-decision-us"));
                    offloaded |= h.get("x-kvgate-offloaded").is_some_and(|v| v == "true");
                }
                let ms = median(&times).unwrap_or(0.0);
                eprintln!("bench filter: {size} tokens {cache} {}: {ms:.2} ms to headers", setup.label());
                eprintln!("bench filter: {}", progress.finish(started.elapsed()));
                if setup == Setup::EnvoyAlone {
                    let native_us = native_tokenize(&native, prime.as_ref(), &bodies, 1)?;
                    let spread_us = native_tokenize(&native_spread, prime.as_ref(), &bodies, 2)?;
                    rows.push(Row {
                        tokens: size,
                        cache,
                        envoy_ms: ms,
                        native_tokenize_us: native_us,
                        native_spread_us: spread_us,
                        ..Row::default()
                    });
                    continue;
                }
                let row = rows
                    .iter_mut()
                    .find(|r| r.tokens == size && r.cache == cache)
                    .ok_or_else(|| anyhow::anyhow!("no baseline row"))?;
                match setup {
                    Setup::Kvgate => {
                        row.kvgate_ms = ms;
                        row.filter_decision_us = median(&decision).unwrap_or(0.0);
                        row.offloaded = offloaded;
                    }
                    Setup::KvgateInline => {
                        row.inline_ms = ms;
                        row.inline_tokenize_us = median(&tokenize).unwrap_or(0.0);
                    }
                    Setup::KvgateSidecar => row.sidecar_ms = ms,
                    Setup::KvgateSpread => {
                        row.spread_ms = ms;
                        row.spread_decision_us = median(&decision).unwrap_or(0.0);
                    }
                    // Its row is the baseline, made above.
                    Setup::EnvoyAlone => {}
                }
            }
        }
        eprintln!("bench filter: {}", progress.start(&format!("head-of-line stall {}", setup.label())));
        let started = Instant::now();
        stalls.push(stall(&url, setup, salt)?);
        eprintln!("bench filter: {}", progress.finish(started.elapsed()));
    }
    let big_prompt_bytes = chat(&document(0, BIG_PROMPT_WORDS), "summarise").to_string().len();
    Ok(Report { rows, stalls, big_prompt_bytes })
}

/// Native tokenization of the cell's requests on `threads` threads (after its prime, like the
/// filter), median µs.
fn native_tokenize(
    native: &ModelTokenizer,
    prime: Option<&Value>,
    bodies: &[Value],
    threads: usize,
) -> anyhow::Result<f64> {
    if let Some(p) = prime {
        native.prompt_tokens(&parse(Endpoint::ChatCompletions, p.to_string().as_bytes())?)?;
    }
    let mut micros = Vec::new();
    for body in bodies {
        let request = parse(Endpoint::ChatCompletions, body.to_string().as_bytes())?;
        let started = Instant::now();
        native.prompt_tokens_on(&request, threads)?;
        micros.push(started.elapsed().as_secs_f64() * 1e6);
    }
    Ok(median(&micros).unwrap_or(0.0))
}

/// Small chats one after another, idle and then while another client keeps sending big
/// prompts (each a new document, so nothing is cached).
fn stall(url: &str, setup: Setup, salt: u32) -> anyhow::Result<Stall> {
    let small = |i: usize| chat(&document(90_000 + salt * 1000 + i as u32, 60), "short question");
    let idle = (0..SMALL_REQUESTS)
        .map(|i| Ok(time_to_headers(url, &small(i))?.0.as_secs_f64() * 1000.0))
        .collect::<anyhow::Result<Vec<f64>>>()?;
    let stop = Arc::new(AtomicBool::new(false));
    let big_done = Arc::new(AtomicUsize::new(0));
    let sender = {
        let (url, stop, big_done) = (url.to_owned(), stop.clone(), big_done.clone());
        std::thread::spawn(move || -> anyhow::Result<()> {
            for i in 0.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                time_to_headers(&url, &chat(&document(95_000 + salt * 1000 + i, BIG_PROMPT_WORDS), "summarise"))?;
                big_done.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        })
    };
    // Start measuring once the big prompts flow.
    let deadline = Instant::now() + Duration::from_secs(60);
    while big_done.load(Ordering::Relaxed) == 0 && Instant::now() < deadline && !sender.is_finished() {
        std::thread::sleep(Duration::from_millis(5));
    }
    // Small requests until several big prompts went through meanwhile.
    let before = big_done.load(Ordering::Relaxed);
    let started = Instant::now();
    let mut loaded = Ok(Vec::new());
    while let Ok(times) = &mut loaded {
        let enough = times.len() >= SMALL_REQUESTS && big_done.load(Ordering::Relaxed) >= before + BIG_PROMPTS;
        if enough || started.elapsed() > Duration::from_secs(120) || sender.is_finished() {
            break;
        }
        match time_to_headers(url, &small(SMALL_REQUESTS + times.len())) {
            Ok((t, _)) => times.push(t.as_secs_f64() * 1000.0),
            Err(e) => loaded = Err(e),
        }
    }
    stop.store(true, Ordering::Relaxed);
    let big_prompts = big_done.load(Ordering::Relaxed) - before;
    sender.join().map_err(|_| anyhow::anyhow!("big-prompt sender panicked"))??;
    let loaded = loaded?;
    let p = |v: &[f64], q| percentile(v, q).unwrap_or(0.0);
    let row = Stall {
        setup: setup.label(),
        idle_p50_ms: p(&idle, 50.0),
        idle_p99_ms: p(&idle, 99.0),
        loaded_p50_ms: p(&loaded, 50.0),
        loaded_p99_ms: p(&loaded, 99.0),
        loaded_max_ms: p(&loaded, 100.0),
        big_prompts,
    };
    eprintln!("bench filter: head-of-line {row:?}");
    Ok(row)
}

/// The report as Markdown tables.
pub fn tables(report: &Report) -> String {
    let mut md = String::from(
        "### What kvgate adds, and tokenizing in Envoy vs native\n\n\
         Medians of 9 requests per cell; time to response headers (the engines answer on admission).\n\n\
         | prompt | cache | Envoy alone | + kvgate as shipped | added | its decision | + kvgate, spread over 2 sidecar threads | added | its decision | + kvgate, all in Envoy | + kvgate, all in the sidecar | in-Envoy tokenize | native tokenize | native on 2 threads | in-Envoy ÷ native |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in &report.rows {
        let shipped = if r.offloaded { " (offloaded)" } else { "" };
        md += &format!(
            "| ~{}k tokens | {} | {:.2} ms | {:.2} ms{shipped} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {} |\n",
            r.tokens / 1000,
            r.cache,
            r.envoy_ms,
            r.kvgate_ms,
            r.kvgate_ms - r.envoy_ms,
            r.filter_decision_us / 1000.0,
            r.spread_ms,
            r.spread_ms - r.envoy_ms,
            r.spread_decision_us / 1000.0,
            r.inline_ms,
            r.sidecar_ms,
            r.inline_tokenize_us / 1000.0,
            r.native_tokenize_us / 1000.0,
            r.native_spread_us / 1000.0,
            super::report::gain(r.inline_tokenize_us / r.native_tokenize_us.max(1.0)),
        );
    }
    md += "\nCold ÷ warm in-Envoy tokenize time (the segment cache):";
    for size in SIZES {
        let cell = |cache| report.rows.iter().find(|r| r.tokens == size && r.cache == cache);
        if let (Some(cold), Some(warm)) = (cell("cold"), cell("warm")) {
            md += &format!(
                " ~{}k {} faster;",
                size / 1000,
                super::report::gain(cold.inline_tokenize_us / warm.inline_tokenize_us.max(1.0))
            );
        }
    }
    md += &format!(
        "\n\n### Small requests while ~{} KB prompts keep arriving (one Envoy worker)\n\n\
         Small chats one after another, time to headers: {SMALL_REQUESTS} idle, then at least {SMALL_REQUESTS} while another client sends big prompts back to back (until {BIG_PROMPTS} went through).\n\n\
         | setup | idle p50 | idle p99 | loaded p50 | loaded p99 | loaded max | big prompts meanwhile |\n|---|---|---|---|---|---|---|\n",
        report.big_prompt_bytes / 1000
    );
    for s in &report.stalls {
        md += &format!(
            "| {} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {} |\n",
            s.setup, s.idle_p50_ms, s.idle_p99_ms, s.loaded_p50_ms, s.loaded_p99_ms, s.loaded_max_ms, s.big_prompts
        );
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The segment cache's gain is printed to two decimals, from the medians themselves.
    #[test]
    fn the_warm_gain_keeps_two_decimals() {
        let row = |cache, us| Row { tokens: SIZES[0], cache, inline_tokenize_us: us, ..Row::default() };
        let report =
            Report { rows: vec![row("cold", 1000.0), row("warm", 300.0)], stalls: Vec::new(), big_prompt_bytes: 0 };
        let md = tables(&report);
        assert!(md.contains("Cold ÷ warm in-Envoy tokenize time (the segment cache): ~1k 3.33× faster;"), "{md}");
    }
}
