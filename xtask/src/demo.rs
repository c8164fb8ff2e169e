//! `cargo xtask demo`: the benchmark harness, scaled down to under two minutes.
//!
//! The shared-prefix workload (groups of prompts sharing a long system prompt, arriving at a
//! rate that queues round robin up) through the same fleet of simulated engines, once per
//! policy, each on a fresh fleet: Envoy alone with round robin and least request, and kvgate.
//! Prints the benchmark's summary table and the time kvgate's routing decision takes inside
//! Envoy. `cargo xtask bench e2e` is the full version, with the peer routers.

use kvgate_e2e::bench::report;
use kvgate_e2e::bench::workloads::{SharedPrefix, Workload};
use kvgate_e2e::bench::{self, BenchConfig, Policy};
use kvgate_e2e::client::post;
use kvgate_e2e::workload::document;
use kvgate_e2e::{repo_root, Artifacts, Routing, Stack, StackOptions};
use serde_json::{json, Value};

use crate::bench::{facts, fleet, sh};
use crate::{build_wasm, cargo, install};

/// Arrivals per simulated second: past what round robin's four engines absorb without queueing.
const QPS: f64 = 28.0;

/// Builds, runs the three policies, prints the table and the decision time.
pub fn run() -> anyhow::Result<()> {
    install::all()?;
    build_wasm()?;
    cargo(&["build", "--release", "-p", "kvgate-sim", "-p", "kvgate-sidecar"])?;
    let artifacts = Artifacts::locate("release");
    let config = BenchConfig {
        workloads: vec![Workload::SharedPrefix(SharedPrefix {
            groups: 24,
            prompts_per_group: 5,
            system_tokens: 2000,
            question_tokens: 400,
            output_tokens: 100,
        })],
        policies: vec![Policy::EnvoyRoundRobin, Policy::EnvoyLeastRequest, Policy::Kvgate("kv_aware")],
        qps: vec![QPS],
        gateways: vec![1],
        repeats: 1,
        fleet: fleet(2.0),
        max_duration_s: 60.0,
        slo_ttft_s: 2.0,
        slo_itl_s: 0.1,
        trace: repo_root().join("../shared/testdata/traces/mooncake-conversation.jsonl"),
        seed: 7,
        mix: kvgate_e2e::bench::workloads::Mix::None,
        peers_venv: bench::peers::venv_dir(&repo_root().join("target")),
        pin: false,
        engines_nice: None,
        replay: true,
    };
    println!(
        "\n== {} simulated engines; Envoy alone vs Envoy + kvgate, each on a fresh fleet ==",
        config.fleet.replicas
    );
    let results = bench::run(&config, &artifacts)?;
    let dir = repo_root().join("target/demo").join(sh("date", &["-u", "+%Y%m%dT%H%M%SZ"]));
    report::write(&dir, &config, &facts("cargo xtask demo".into()), &results)?;
    let points = report::points(&results);
    let workload = &config.workloads[0];
    println!("\n{} at {QPS} req/s ({}), latencies in simulated time:\n", workload.name(), workload.describe());
    let setting = report::Setting { workload: workload.name().into(), gateways: 1, qps: Some(QPS) };
    print!("{}", report::table(&points, &setting));
    print!("{}", report::bounds_table(&points, &setting));
    let kvgate = points.iter().find(|p| p.policy == Policy::Kvgate("kv_aware").name());
    let rr = points.iter().find(|p| p.policy == Policy::EnvoyRoundRobin.name());
    if let (Some(k), Some(r)) = (kvgate, rr) {
        println!(
            "\nkvgate kv_aware vs Envoy round robin: TTFT p90 {} lower, p50 {} lower; prefix-cache hit ratio {:.2} vs {:.2}",
            report::gain(k.ttft_p90_vs_round_robin.unwrap_or(f64::NAN)),
            report::gain(k.ttft_p50_vs_round_robin.unwrap_or(f64::NAN)),
            k.median.hit_ratio.unwrap_or(f64::NAN),
            r.median.hit_ratio.unwrap_or(f64::NAN),
        );
    }
    println!("(report with the TTFT CDF chart: {})", dir.join("report.md").display());

    let stack = Stack::start(
        &StackOptions {
            name: "demo-decision".into(),
            replicas: 3,
            routing: Routing::Kvgate,
            route_timeout_ms: 500,
            ..StackOptions::default()
        },
        &artifacts,
    )?;
    decision_latency(&stack)
}

/// Time from the end of the request body to the routing decision, inside Envoy (parse,
/// template, tokenize, hash, sidecar round trip), for a 1k- and an 8k-token chat.
fn decision_latency(stack: &Stack) -> anyhow::Result<()> {
    println!("\nrouting decision time (parse + template + tokenize + hash + decide; prompts over 16 KiB are");
    println!("tokenized by the sidecar instead of on Envoy's worker):");
    for (label, words) in [("1k", 1000), ("8k", 8000)] {
        let mut samples = Vec::new();
        let (mut tokens, mut offloaded) = (0, false);
        for i in 0..7 {
            let body = json!({"model": "qwen3", "max_tokens": 1, "messages": [
                {"role": "user", "content": document(1000 + i + words as u32, words)}]});
            let reply = post(&stack.gateway("/v1/chat/completions"), body.to_string(), &[])?;
            tokens = reply.json()["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
            offloaded = reply.header("x-kvgate-offloaded") == "true";
            samples.push(reply.header("x-kvgate-decision-us").parse::<u64>().unwrap_or(0));
        }
        samples.sort_unstable();
        println!(
            "  {label}-token chat ({tokens} tokens, {}): median {:.2} ms, min {:.2} ms over {} requests",
            if offloaded { "in the sidecar" } else { "in Envoy" },
            samples[samples.len() / 2] as f64 / 1000.0,
            samples[0] as f64 / 1000.0,
            samples.len()
        );
    }
    // The same 8k-token conversation again with one new turn: the segment cache (the
    // sidecar's, as the conversation is offloaded) tokenizes only the new turn.
    let mut messages = vec![json!({"role": "user", "content": document(7000, 8000)})];
    let decide = |messages: &[Value]| -> anyhow::Result<(u64, u64)> {
        let body = json!({"model": "qwen3", "max_tokens": 1, "messages": messages});
        let reply = post(&stack.gateway("/v1/chat/completions"), body.to_string(), &[])?;
        Ok((
            reply.header("x-kvgate-decision-us").parse().unwrap_or(0),
            reply.json()["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
        ))
    };
    let (cold, tokens) = decide(&messages)?;
    let mut warm = Vec::new();
    for turn in 0..7 {
        messages.push(json!({"role": "assistant", "content": format!("Answer {turn}.")}));
        messages.push(json!({"role": "user", "content": format!("Follow-up {turn}?")}));
        warm.push(decide(&messages)?.0);
    }
    warm.sort_unstable();
    let warm_median = warm[warm.len() / 2];
    println!(
        "  {tokens}-token conversation + one new turn: {:.2} ms warm (median of {}) vs {:.2} ms cold: {} faster",
        warm_median as f64 / 1000.0,
        warm.len(),
        cold as f64 / 1000.0,
        report::gain(cold as f64 / warm_median.max(1) as f64)
    );
    Ok(())
}
