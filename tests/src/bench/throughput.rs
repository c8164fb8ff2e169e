//! Gateway throughput (`cargo xtask bench filter`, last section): how many routed requests one
//! Envoy worker sustains, which is what sizes a gateway tier.
//!
//! Distinct ~1k-token chats (a new document each, so no cache of any kind helps), engines that
//! answer at once with one token. Envoy (one worker) and the sidecar are pinned to core 0; the
//! engines and this load generator to core 1. Requests are sent open loop at a fixed rate
//! (each timed from when it was due, so a gateway that falls behind shows its queue), for
//! Envoy alone, for Envoy with kvgate, and for Envoy with kvgate and no tokenizer in Envoy
//! (`envoy_tokenizers: "none"`: the sidecar, on the same core, tokenizes); the difference at
//! the same rate is what kvgate adds. A closed loop of [`CLIENTS`] clients then finds each
//! setup's ceiling.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::json;

use super::stats::percentile;
use crate::client::client;
use crate::process::{cpu_seconds, pin};
use crate::workload::document;
use crate::{Artifacts, Routing, Stack, StackOptions};

/// Offered rates, requests per second.
pub const RATES: [usize; 4] = [250, 500, 1000, 1500];
/// How long each rate is offered.
const SECS_PER_RATE: u64 = 4;
/// Senders of the open loop (the most requests in flight).
const SENDERS: usize = 64;
/// Clients of the closed loop.
pub const CLIENTS: usize = 32;
/// Requests of the closed loop.
const CLOSED_REQUESTS: usize = 3_000;
/// Words per prompt (about 1k tokens in the chat).
const WORDS: usize = 1_000;

/// One (setup, rate) cell.
#[derive(Debug, Clone, Serialize)]
pub struct Cell {
    /// One of [`SETUPS`]' labels.
    pub setup: &'static str,
    /// Offered requests/s (`None`: the closed loop).
    pub offered: Option<usize>,
    /// Completed requests/s.
    pub achieved: f64,
    /// Latency from when each request was due to its full answer, ms.
    pub p50_ms: f64,
    /// .
    pub p99_ms: f64,
    /// Requests that failed or were not answered 200.
    pub errors: usize,
    /// Requests kvgate did not route (`x-kvgate-routed-to: fallback`: its answer came late,
    /// or the sidecar had no room): Envoy's balancer placed them.
    pub fallbacks: usize,
    /// CPU per request sent, ms: Envoy's and the sidecar's (closed loop only: the core is
    /// saturated there, so this is what sets the ceiling).
    pub cpu_ms: Option<(f64, f64)>,
}

/// What the section measures.
#[derive(Debug, Clone, Serialize)]
pub struct Throughput {
    /// Every (setup, rate) cell.
    pub cells: Vec<Cell>,
    /// Envoy's peak resident memory after each setup's run (`VmHWM`), MB: the difference is
    /// the filter's VM with its tokenizer and caches.
    pub envoy_peak_rss_mb: Vec<(&'static str, f64)>,
}

/// Peak resident memory of `pid`, MB.
fn peak_rss_mb(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// The setups: label, routing, `envoy_tokenizers`, and a seed apart from the others'.
const SETUPS: [(&str, Routing, &str, u32); 3] = [
    ("Envoy alone", Routing::RoundRobin, "all", 200_000),
    ("Envoy + kvgate", Routing::Kvgate, "all", 400_000),
    ("+ kvgate, sidecar tokenizes", Routing::Kvgate, "none", 600_000),
];

fn options(routing: Routing, envoy_tokenizers: &str) -> StackOptions {
    let sim_args = super::filter::instant_engines(&[
        "--num-gpu-blocks-override",
        "65536",
        "--max-num-batched-tokens",
        "262144",
        "--max-num-seqs",
        "1024",
    ]);
    StackOptions {
        name: "bench-throughput".into(),
        replicas: 2,
        routing,
        sim_args,
        route_timeout_ms: 25,
        filter_config: serde_json::Map::from_iter([("envoy_tokenizers".to_owned(), json!(envoy_tokenizers))]),
        ..StackOptions::default()
    }
}

/// Distinct chat bodies, `n` of them, seeded apart from every other setup's.
fn bodies(seed: u32, n: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            json!({"model": "qwen3", "max_tokens": 1, "messages": [
                {"role": "system", "content": document(seed + i as u32, WORDS)},
                {"role": "user", "content": "answer in one word"}]})
            .to_string()
        })
        .collect()
}

/// Sends `bodies` in order, each at `start + i / rate` (open loop), or as fast as
/// [`CLIENTS`] clients can (`rate` = `None`). Returns the cell.
fn offer(url: &str, setup: &'static str, rate: Option<usize>, bodies: Vec<String>) -> Cell {
    let bodies = Arc::new(bodies);
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now() + Duration::from_millis(50);
    let threads = if rate.is_some() { SENDERS } else { CLIENTS };
    let senders: Vec<_> = (0..threads)
        .map(|_| {
            let (bodies, next, url) = (bodies.clone(), next.clone(), url.to_owned());
            std::thread::spawn(move || {
                let http = client();
                let mut done = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(body) = bodies.get(i) else { break };
                    let due = match rate {
                        Some(r) => start + Duration::from_secs_f64(i as f64 / r as f64),
                        None => Instant::now().max(start),
                    };
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    let answer =
                        http.post(&url).header("content-type", "application/json").body(body.clone()).send().and_then(
                            |r| {
                                let fallback = r.headers().get("x-kvgate-routed-to").is_some_and(|v| v == "fallback");
                                Ok((r.status().is_success(), fallback, r.bytes()?))
                            },
                        );
                    let (ok, fallback) = answer.map_or((false, false), |(ok, fallback, _)| (ok, fallback));
                    done.push((ok, fallback, due.elapsed(), Instant::now()));
                }
                done
            })
        })
        .collect();
    let results: Vec<(bool, bool, Duration, Instant)> =
        senders.into_iter().flat_map(|t| t.join().unwrap_or_default()).collect();
    let last = results.iter().map(|r| r.3).max().unwrap_or(start);
    let ms: Vec<f64> = results.iter().filter(|r| r.0).map(|r| r.2.as_secs_f64() * 1000.0).collect();
    let cell = Cell {
        setup,
        offered: rate,
        achieved: ms.len() as f64 / last.saturating_duration_since(start).as_secs_f64().max(1e-3),
        p50_ms: percentile(&ms, 50.0).unwrap_or(0.0),
        p99_ms: percentile(&ms, 99.0).unwrap_or(0.0),
        errors: results.len() - ms.len(),
        fallbacks: results.iter().filter(|r| r.1).count(),
        cpu_ms: None,
    };
    eprintln!("bench throughput: {cell:?}");
    cell
}

/// Runs every setup and rate.
pub fn run(artifacts: &Artifacts) -> anyhow::Result<Throughput> {
    pin(std::process::id(), 1)?;
    let (mut cells, mut envoy_peak_rss_mb) = (Vec::new(), Vec::new());
    for (setup, routing, envoy_tokenizers, seed) in SETUPS {
        let stack = Stack::start(&options(routing, envoy_tokenizers), artifacts)?;
        for pid in stack.gateway_pids() {
            pin(pid, 0)?;
        }
        for pid in stack.engine_pids() {
            pin(pid, 1)?;
        }
        let url = stack.gateway("/v1/chat/completions");
        let mut seed = seed;
        for rate in RATES {
            let n = rate * SECS_PER_RATE as usize;
            cells.push(offer(&url, setup, Some(rate), bodies(seed, n)));
            seed += n as u32;
        }
        let envoy = stack.gateway_pids().first().copied();
        let cpu = || [envoy, stack.sidecar_pid()].map(|pid| pid.and_then(cpu_seconds).unwrap_or(0.0));
        let before = cpu();
        let mut closed = offer(&url, setup, None, bodies(seed, CLOSED_REQUESTS));
        let after = cpu();
        let per_request = |i: usize| (after[i] - before[i]) * 1000.0 / CLOSED_REQUESTS as f64;
        closed.cpu_ms = Some((per_request(0), per_request(1)));
        cells.push(closed);
        if let Some(mb) = stack.gateway_pids().first().and_then(|pid| peak_rss_mb(*pid)) {
            envoy_peak_rss_mb.push((setup, mb));
        }
    }
    Ok(Throughput { cells, envoy_peak_rss_mb })
}

/// The section of the report.
pub fn table(throughput: &Throughput) -> String {
    let cells = &throughput.cells;
    let mut md = format!(
        "### Gateway throughput (one Envoy worker)\n\n\
         Distinct ~1k-token chats, engines answering at once with one token; Envoy and the sidecar \
         on core 0, engines and load generator on core 1. Open loop at each rate for {SECS_PER_RATE} s \
         (latency from when each request was due), then a closed loop of {CLIENTS} clients.\n\n\
         | offered | Envoy alone: achieved | p50 | p99 | + kvgate: achieved | p50 | p99 | added p99 | + kvgate, sidecar tokenizes: achieved | p50 | p99 | added p99 | errors | not routed by kvgate |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    );
    let find = |setup: &str, offered| cells.iter().find(|c| c.setup == setup && c.offered == offered);
    for offered in RATES.iter().map(|r| Some(*r)).chain([None]) {
        let [Some(a), Some(k), Some(s)] = SETUPS.map(|(setup, ..)| find(setup, offered)) else { continue };
        let label = offered.map_or(format!("closed loop ({CLIENTS})"), |r| format!("{r}/s"));
        md += &format!("| {label} | {:.0}/s | {:.2} ms | {:.2} ms ", a.achieved, a.p50_ms, a.p99_ms);
        for c in [k, s] {
            md += &format!(
                "| {:.0}/s | {:.2} ms | {:.2} ms | {:.2} ms ",
                c.achieved,
                c.p50_ms,
                c.p99_ms,
                c.p99_ms - a.p99_ms
            );
        }
        md += &format!("| {} | {} + {} |\n", a.errors + k.errors + s.errors, k.fallbacks, s.fallbacks);
    }
    md += "\nCPU per request in the closed loop (Envoy + sidecar):";
    for c in cells.iter().filter(|c| c.offered.is_none()) {
        if let Some((envoy, sidecar)) = c.cpu_ms {
            md += &format!(" {} {:.3} + {:.3} ms;", c.setup, envoy, sidecar);
        }
    }
    md += "\n\nEnvoy's peak resident memory:";
    for (setup, mb) in &throughput.envoy_peak_rss_mb {
        md += &format!(" {setup} {mb:.0} MB;");
    }
    md + "\n"
}
