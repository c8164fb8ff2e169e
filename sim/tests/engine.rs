//! The simulator as a process: its HTTP API and its KV events, checked with kvgate's own
//! decoder. (The scheduler, cache and time model are unit-tested inside the crate.)

mod common;

use std::time::{Duration, Instant};

use kvgate_e2e::client::{client, post};
use kvgate_e2e::process::{free_port, free_port_run, wait_for, Proc};
use kvgate_sidecar::events::decode::{decode_batch, EventBatch, KvEvent};
use serde_json::{json, Value};

/// A running simulator with subscribers on each rank's events port.
struct Sim {
    port: u16,
    subs: Vec<zmq::Socket>,
    _proc: Proc,
    _ctx: zmq::Context,
}

impl Sim {
    fn start(name: &str, ranks: u32, extra: &[&str]) -> Sim {
        // Rank r publishes on events + r: the events ports are one run, none another test's.
        let (port, events) = (free_port().unwrap(), free_port_run(ranks as u16).unwrap());
        let ranks_flag = ranks.to_string();
        let mut flags = vec!["--data-parallel-size", ranks_flag.as_str()];
        flags.extend_from_slice(extra);
        let proc = common::spawn_sim(name, port, events, &flags);
        let ctx = zmq::Context::new();
        let subs = (0..ranks)
            .map(|r| {
                let sub = ctx.socket(zmq::SUB).unwrap();
                sub.set_subscribe(b"").unwrap();
                sub.connect(&format!("tcp://127.0.0.1:{}", u32::from(events) + r)).unwrap();
                sub
            })
            .collect();
        // PUB/SUB joins are asynchronous: wait until a probe request's events reach every rank.
        let sim = Sim { port, subs, _proc: proc, _ctx: ctx };
        for r in 0..ranks {
            let rank = r.to_string();
            wait_for("the event subscription", Duration::from_secs(30), || {
                sim.completion(&format!("probe {r} {:?}", Instant::now()), 1, &[("x-data-parallel-rank", &rank)]);
                sim.next_batch(r as usize, Duration::from_millis(300))
            })
            .unwrap();
            sim.drain(r as usize);
        }
        sim
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn completion(&self, prompt: &str, max_tokens: u32, headers: &[(&str, &str)]) -> Value {
        let body = json!({"model": "qwen3", "prompt": prompt, "max_tokens": max_tokens});
        let reply = post(&self.url("/v1/completions"), body.to_string(), headers).unwrap();
        assert_eq!(reply.status, 200, "{}", reply.body);
        reply.json()
    }

    fn next_batch(&self, rank: usize, timeout: Duration) -> Option<EventBatch> {
        self.subs[rank].set_rcvtimeo(timeout.as_millis() as i32).unwrap();
        let frames = self.subs[rank].recv_multipart(0).ok()?;
        Some(decode_batch(&frames[2]).expect("kvgate decodes the simulator's events"))
    }

    fn drain(&self, rank: usize) {
        while self.next_batch(rank, Duration::from_millis(200)).is_some() {}
    }

    /// Events on `rank` until `done` says stop, or a timeout.
    fn events_until(&self, rank: usize, mut done: impl FnMut(&KvEvent) -> bool) -> Vec<(EventBatch, KvEvent)> {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut seen = Vec::new();
        while Instant::now() < deadline {
            if let Some(batch) = self.next_batch(rank, Duration::from_millis(200)) {
                for e in batch.events.clone() {
                    let stop = done(&e);
                    seen.push((batch.clone(), e));
                    if stop {
                        return seen;
                    }
                }
            }
        }
        panic!("condition not met; saw {seen:?}");
    }
}

fn cached(reply: &Value) -> u64 {
    reply["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap()
}

fn long_prompt(topic: &str) -> String {
    (0..60).map(|i| format!("{topic} sentence {i} is here.")).collect::<Vec<_>>().join(" ")
}

#[test]
fn data_parallel_ranks_have_their_own_cache_and_events_port() {
    let sim = Sim::start("dp", 2, &[]);
    let prompt = long_prompt("ranks");
    let first = sim.completion(&prompt, 2, &[("x-data-parallel-rank", "1")]);
    let stored = sim.events_until(1, |e| matches!(e, KvEvent::BlockStored(_)));
    assert_eq!(stored.last().unwrap().0.data_parallel_rank, Some(1), "rank 1's batches say so");
    assert_eq!(cached(&first), 0);
    let again = sim.completion(&prompt, 2, &[("x-data-parallel-rank", "1")]);
    assert!(cached(&again) >= 16 * 10, "rank 1 holds the prefix: {again}");
    let other = sim.completion(&prompt, 2, &[("x-data-parallel-rank", "0")]);
    assert_eq!(cached(&other), 0, "rank 0 has its own cache");
    let stored0 = sim.events_until(0, |e| matches!(e, KvEvent::BlockStored(_)));
    assert_eq!(stored0.last().unwrap().0.data_parallel_rank, Some(0));
    let bad = post(
        &sim.url("/v1/completions"),
        json!({"model": "qwen3", "prompt": "x"}).to_string(),
        &[("x-data-parallel-rank", "2")],
    )
    .unwrap();
    assert_eq!(bad.status, 400, "{}", bad.body);
}

#[test]
fn tokenize_agrees_with_what_the_engine_charges() {
    let sim = Sim::start("tokenize", 1, &[]);
    let messages =
        json!([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Héllo 世界 — tokens?"}]);
    let counted =
        post(&sim.url("/tokenize"), json!({"model": "qwen3", "messages": messages}).to_string(), &[]).unwrap().json();
    let chat = post(
        &sim.url("/v1/chat/completions"),
        json!({"model": "qwen3", "messages": messages, "max_tokens": 1}).to_string(),
        &[],
    )
    .unwrap()
    .json();
    assert_eq!(counted["count"], chat["usage"]["prompt_tokens"], "{counted} vs {chat}");
    assert_eq!(counted["tokens"].as_array().unwrap().len() as u64, counted["count"].as_u64().unwrap());
    let counted =
        post(&sim.url("/tokenize"), json!({"model": "qwen3", "prompt": "plain text"}).to_string(), &[]).unwrap().json();
    let completion = sim.completion("plain text", 1, &[]);
    assert_eq!(counted["count"], completion["usage"]["prompt_tokens"]);
}

#[test]
fn errors_are_shaped_like_vllms() {
    let sim = Sim::start("errors", 1, &[]);
    let unknown = post(&sim.url("/v1/completions"), json!({"model": "nope", "prompt": "x"}).to_string(), &[]).unwrap();
    assert_eq!((unknown.status, unknown.json()["object"].as_str()), (404, Some("error")));
    let malformed = post(&sim.url("/v1/chat/completions"), "{not json", &[]).unwrap();
    assert_eq!((malformed.status, malformed.json()["code"].as_u64()), (400, Some(400)));
}

/// Adapters from `--lora-modules`: listed with their parent, served by name, their events
/// tagged as vLLM tags them (as kvgate's decoder reads them); run-time loading stays off
/// without `VLLM_ALLOW_RUNTIME_LORA_UPDATING`.
#[test]
fn lora_modules_are_served_listed_and_named_in_events() {
    let sim = Sim::start("lora", 1, &["--enable-lora", "--lora-modules", "sql=/adapters/sql"]);
    let models: Value = client().get(sim.url("/v1/models")).send().unwrap().json().unwrap();
    let sql = models["data"].as_array().unwrap().iter().find(|m| m["id"] == "sql").unwrap().clone();
    assert_eq!((sql["parent"].as_str(), sql["root"].as_str()), (Some("qwen3"), Some("/adapters/sql")));
    let body = json!({"model": "sql", "prompt": long_prompt("lora"), "max_tokens": 1});
    let reply = post(&sim.url("/v1/completions"), body.to_string(), &[]).unwrap();
    assert_eq!(reply.status, 200, "{}", reply.body);
    let seen = sim.events_until(0, |e| matches!(e, KvEvent::BlockStored(_)));
    let Some((_, KvEvent::BlockStored(stored))) = seen.last() else { unreachable!() };
    assert_eq!((stored.lora_name.as_deref(), stored.lora_id), (Some("sql"), Some(1)));
    let load = json!({"lora_name": "other", "lora_path": "/adapters/other"}).to_string();
    assert_eq!(post(&sim.url("/v1/load_lora_adapter"), load, &[]).unwrap().status, 404);
}

#[test]
fn metrics_count_requests_and_reset_clears_the_cache() {
    let sim = Sim::start("metrics", 1, &[]);
    let prompt = long_prompt("metrics");
    sim.completion(&prompt, 3, &[]);
    sim.completion(&prompt, 3, &[]);
    let text = client().get(sim.url("/metrics")).send().unwrap().text().unwrap();
    let value = |name: &str| -> f64 {
        let line = text.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name} missing:\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    // The probe request plus ours.
    assert_eq!(value("vllm:time_to_first_token_seconds_count"), 3.0);
    assert!(value("vllm:prefix_cache_hits_total") >= 160.0, "the second request hit");
    assert!(value("vllm:prefix_cache_queries_total") > value("vllm:prefix_cache_hits_total"));
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"] {
        value(name);
    }
    sim.drain(0);
    let reset = post(&sim.url("/reset_prefix_cache"), "", &[]).unwrap();
    assert_eq!(reset.status, 200);
    sim.events_until(0, |e| matches!(e, KvEvent::AllBlocksCleared));
    assert_eq!(cached(&sim.completion(&prompt, 1, &[])), 0, "nothing cached after the reset");
}

#[test]
fn evicted_blocks_go_to_the_cpu_tier_and_come_back_from_it() {
    // 40 GPU blocks of 16 tokens: one ~470-token prompt fits, two do not.
    let sim = Sim::start("offload", 1, &["--num-gpu-blocks-override", "40", "--cpu-offload-blocks", "64"]);
    let (a, b) = (long_prompt("alpha"), long_prompt("beta"));
    sim.completion(&a, 1, &[]);
    sim.completion(&b, 1, &[]);
    let offloaded = sim.events_until(0, |e| matches!(e, KvEvent::BlockStored(s) if s.medium.as_deref() == Some("CPU")));
    assert!(offloaded.iter().any(|(_, e)| matches!(e, KvEvent::BlockRemoved(r) if r.medium.as_deref() == Some("GPU"))));
    let back = sim.completion(&a, 1, &[]);
    assert!(cached(&back) > 0, "alpha's prefix is loaded from the CPU tier: {back}");
}

#[test]
fn speedup_compresses_simulated_time() {
    // The test preset: 5 ms per step, so 200 output tokens take 1 s of simulated time.
    let sim = Sim::start("speedup", 1, &["--speedup", "20"]);
    let started = Instant::now();
    sim.completion("count", 200, &[]);
    let wall = started.elapsed();
    assert!(wall < Duration::from_millis(900), "1 s of simulated decode took {wall:?} at 20x");
    let text = client().get(sim.url("/metrics")).send().unwrap().text().unwrap();
    let sum: f64 = text
        .lines()
        .find(|l| l.starts_with("vllm:time_to_first_token_seconds_sum"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(sum > 0.0, "TTFT is reported in simulated seconds");
}
