//! `cargo xtask demo`: kvgate vs round robin on the same multi-turn chat workload.
//!
//! Four users each hold a conversation with a long private system prompt (~1.5k tokens).
//! Their turns interleave. With kvgate, every turn after the first lands on the replica that
//! already holds the conversation's KV blocks; with round robin, two turns out of three land
//! elsewhere and pay the whole prefill again.

use std::time::Duration;

use kvgate_e2e::client::{post, stream};
use kvgate_e2e::workload::document;
use kvgate_e2e::{Artifacts, Routing, Stack, StackOptions};
use serde_json::{json, Value};

use crate::{build_wasm, cargo, install};

const USERS: usize = 4;
const TURNS: usize = 4;
const BLOCK_SIZE: u64 = 16;

struct Row {
    user: usize,
    turn: usize,
    replica: String,
    prompt_tokens: u64,
    cached_tokens: u64,
    ttft: Duration,
}

/// Builds, starts, runs both routings, prints, stops.
pub fn run() -> anyhow::Result<()> {
    install::all()?;
    build_wasm()?;
    cargo(&["build", "--release", "-p", "kvgate-sim", "-p", "kvgate-sidecar"])?;
    let artifacts = Artifacts::locate("release");

    println!("\n== kvgate: Envoy + kvgate filter + sidecar + 3 simulated engines ==");
    let kvgate = {
        let stack = Stack::start(&options("demo-kvgate", Routing::Kvgate), &artifacts)?;
        let rows = workload(&stack)?;
        decision_latency(&stack)?;
        rows
    };
    println!("\n== baseline: the same Envoy and engines, round robin ==");
    let rr = {
        let stack = Stack::start(&options("demo-rr", Routing::RoundRobin), &artifacts)?;
        workload(&stack)?
    };
    summary("kvgate", &kvgate);
    summary("round robin", &rr);
    let (k, r) = (mean_ttft(&kvgate), mean_ttft(&rr));
    println!(
        "\nmean TTFT: kvgate {:.1} ms vs round robin {:.1} ms ({:.1}x lower)",
        ms(k),
        ms(r),
        ms(r) / ms(k).max(1e-9)
    );
    Ok(())
}

fn options(name: &str, routing: Routing) -> StackOptions {
    StackOptions {
        name: name.into(),
        replicas: 3,
        block_size: BLOCK_SIZE as u32,
        routing,
        route_timeout_ms: 500,
        ..StackOptions::default()
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn workload(stack: &Stack) -> anyhow::Result<Vec<Row>> {
    let mut histories: Vec<Vec<Value>> =
        (0..USERS).map(|u| vec![json!({"role": "system", "content": document(100 + u as u32, 1500)})]).collect();
    let mut rows = Vec::new();
    println!("{:>3}  {:>4}  {:>4}  {:>7}  {:>13}  {:>9}", "#", "user", "turn", "replica", "cached/prompt", "TTFT ms");
    for turn in 0..TURNS {
        for (user, history) in histories.iter_mut().enumerate() {
            history.push(json!({"role": "user", "content": format!("Question {turn} from user {user}: what does section {turn} say?")}));
            let body = json!({"model": "qwen3", "max_tokens": 8, "messages": history});
            let reply = stream(&stack.gateway("/v1/chat/completions"), body)?;
            anyhow::ensure!(reply.status == 200, "request failed with {}", reply.status);
            let row = Row {
                user,
                turn,
                replica: reply.header("x-kvgate-replica").to_owned(),
                prompt_tokens: reply.usage.as_ref().and_then(|u| u["prompt_tokens"].as_u64()).unwrap_or(0),
                cached_tokens: reply.cached_tokens(),
                ttft: reply.ttft,
            };
            println!(
                "{:>3}  {:>4}  {:>4}  {:>7}  {:>6}/{:<6}  {:>9.1}",
                rows.len() + 1,
                row.user,
                row.turn,
                row.replica,
                row.cached_tokens / BLOCK_SIZE,
                row.prompt_tokens.div_ceil(BLOCK_SIZE),
                ms(row.ttft)
            );
            history.push(
                json!({"role": "assistant", "content": format!("Section {turn} explains the routing of user {user}.")}),
            );
            rows.push(row);
        }
    }
    Ok(rows)
}

fn mean_ttft(rows: &[Row]) -> Duration {
    rows.iter().map(|r| r.ttft).sum::<Duration>() / rows.len().max(1) as u32
}

fn summary(name: &str, rows: &[Row]) {
    let prompt: u64 = rows.iter().map(|r| r.prompt_tokens).sum();
    let cached: u64 = rows.iter().map(|r| r.cached_tokens).sum();
    let follow_ups: Vec<&Row> = rows.iter().filter(|r| r.turn > 0).collect();
    let hits = follow_ups.iter().filter(|r| r.cached_tokens > 0).count();
    println!(
        "\n{name}: {:.0}% of prompt tokens served from cache; {hits}/{} follow-up turns hit; mean TTFT {:.1} ms",
        100.0 * cached as f64 / prompt.max(1) as f64,
        follow_ups.len(),
        ms(mean_ttft(rows))
    );
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
        "  {tokens}-token conversation + one new turn: {:.2} ms warm (median of {}) vs {:.2} ms cold: {:.1}x faster",
        warm_median as f64 / 1000.0,
        warm.len(),
        cold as f64 / 1000.0,
        cold as f64 / warm_median.max(1) as f64
    );
    Ok(())
}
