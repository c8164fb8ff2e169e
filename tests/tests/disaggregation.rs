//! End-to-end prefill/decode disaggregation: the real Envoy runs each request's prefill leg
//! on the prefill worker kvgate chose and sends the request to its decode worker, for vLLM's
//! protocol (sequential legs, `kv_transfer_params`) and SGLang's (parallel legs, a bootstrap
//! room), with simulated engines playing both roles.
//!
//! These need the built wasm, binaries and Envoy, so they are `#[ignore]`d in a plain
//! `cargo test`; `cargo xtask test` builds and installs everything and runs them.

use std::time::Duration;

use kvgate_e2e::client::{post, stream};
use kvgate_e2e::process::wait_for;
use kvgate_e2e::stack::{metric_sum, Disaggregation};
use kvgate_e2e::workload::document;
use kvgate_e2e::{Artifacts, Stack, StackOptions};
use serde_json::{json, Value};

/// Engines `a`, `b` prefill, `c`, `d` decode; prompts of 64 tokens or more not cached on
/// their decode worker are prefilled remotely.
fn start(name: &str, mode: &str) -> Stack {
    let disaggregation = Disaggregation {
        mode: mode.into(),
        roles: ["prefill", "prefill", "decode", "decode"].map(String::from).to_vec(),
        keys: "min_remote_prefill_tokens = 64".into(),
    };
    let opts =
        StackOptions { name: name.into(), replicas: 4, disaggregation: Some(disaggregation), ..Default::default() };
    Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts")
}

fn chat(system: &str, question: &str) -> Value {
    json!({"model": "qwen3", "max_tokens": 4, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": question}]})
}

/// A simulator's counter, summed over label sets.
fn sim_metric(stack: &Stack, id: &str, name: &str) -> f64 {
    stack.sim(id).metric(name).unwrap_or(0.0)
}

const REMOTE_PREFILLS: &str = "kvgate_sim:remote_prefill_requests_total";
const REMOTE_DECODES: &str = "kvgate_sim:remote_decode_requests_total";

/// The sidecar's explanation of booking `id`, once its prediction has been checked.
fn checked_decision(stack: &Stack, id: &str) -> Value {
    wait_for("the prediction checked", Duration::from_secs(10), || {
        let url = stack.sidecar_url(&format!("/debug/explain?request={id}"));
        let explained: Value = kvgate_e2e::client::client().get(url).send().ok()?.json().ok()?;
        let decision = explained["decisions"][0].clone();
        (!decision["checked"].is_null()).then_some(decision)
    })
    .unwrap()
}

#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn vllm_prefill_legs_run_where_the_prompt_is_cached_and_decode_elsewhere() {
    let stack = start("pd-vllm", "vllm");
    // A document only prefill worker `b` holds.
    let doc = document(41, 600);
    let warm = post(&stack.sim("b").url("/v1/chat/completions"), chat(&doc, "warm").to_string(), &[]).unwrap();
    assert_eq!(warm.status, 200, "{}", warm.body);
    let prompt_tokens = warm.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    stack.wait_indexed("b", prompt_tokens / 16).unwrap();
    let decisions = |mode: &str| {
        let metrics = stack.sidecar_metrics().unwrap();
        metric_sum(&metrics, "kvgate_disaggregation_decisions_total", &format!("mode=\"{mode}\""))
    };
    let disaggregated = decisions("disaggregated");
    // A client naming an upstream changes nothing: not the decode worker, not the leg's.
    let spoof = format!("127.0.0.1:{}", stack.sim("c").port);
    let first = post(
        &stack.gateway("/v1/chat/completions"),
        chat(&doc, "first question").to_string(),
        &[("x-gateway-destination-endpoint", spoof.as_str())],
    )
    .unwrap();
    assert_eq!(first.status, 200, "{}", first.body);
    let decoder = first.header("x-kvgate-replica").to_owned();
    assert_eq!(first.header("x-kvgate-prefill-on"), "b", "the leg ran where the prompt is cached");
    assert!(decoder == "c" || decoder == "d", "decoded on a decode worker: {decoder:?}");
    assert_eq!(first.header("x-kvgate-routed-to"), decoder, "where the sidecar sent it");
    assert_eq!(first.header("x-kvgate-prefill-leg"), "ok");
    assert_eq!(first.header("x-kvgate-sim-remote-prefill"), "true");
    assert_eq!(
        first.header("x-kvgate-sim-prompt-computed"),
        "1",
        "the decode worker computed only the last prompt token"
    );
    assert_eq!(sim_metric(&stack, "b", REMOTE_DECODES), 1.0);
    assert_eq!(sim_metric(&stack, &decoder, REMOTE_PREFILLS), 1.0);
    assert_eq!(decisions("disaggregated"), disaggregated + 1.0);
    // The leg's choice is explained, both prefill workers weighed, and its prediction of the
    // cache found on `b` checked against what `b` reported.
    let explained = checked_decision(&stack, &format!("{}/prefill", first.header("x-kvgate-booking-id")));
    assert_eq!(explained["disaggregation"], "prefill_leg", "{explained}");
    assert_eq!(explained["candidates"].as_array().map(Vec::len), Some(2), "{explained}");
    assert_eq!(explained["checked"]["check"]["cached_error"], 0, "{explained}");
    // The decode worker reports the prefill worker's cache hits (vLLM 0.32 passes them on in
    // `remote_prefill_cached_tokens`), and its prediction says so.
    let decoded = checked_decision(&stack, first.header("x-kvgate-booking-id"));
    assert_eq!(decoded["checked"]["check"]["class"], "exact", "{decoded}");
    assert_eq!(decoded["checked"]["engine"]["cached_tokens"], explained["checked"]["engine"]["cached_tokens"]);
    // The decode worker now holds the prompt too: the conversation's next turn is served
    // whole there, its prompt short of what it has cached.
    stack.wait_indexed(&decoder, prompt_tokens / 16).unwrap();
    let again = stream(&stack.gateway("/v1/chat/completions"), chat(&doc, "second question")).unwrap();
    assert_eq!(again.status, 200);
    assert_eq!((again.header("x-kvgate-replica"), again.header("x-kvgate-prefill-on")), (decoder.as_str(), ""));
    assert!(decisions("short_prompt") >= 1.0);
}

#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn short_prompts_are_served_whole_on_a_decode_worker() {
    let stack = start("pd-short", "vllm");
    let short = |s: &Stack| {
        let metrics = s.sidecar_metrics().unwrap();
        metric_sum(&metrics, "kvgate_disaggregation_decisions_total", "mode=\"short_prompt\"")
    };
    let before = short(&stack);
    let reply = post(&stack.gateway("/v1/chat/completions"), chat("Be brief.", "hi").to_string(), &[]).unwrap();
    assert_eq!(reply.status, 200);
    assert!(matches!(reply.header("x-kvgate-replica"), "c" | "d"));
    assert_eq!(reply.header("x-kvgate-prefill-on"), "", "no leg for a short prompt");
    assert_eq!(reply.header("x-kvgate-sim-remote-prefill"), "false");
    assert_eq!(short(&stack), before + 1.0);
}

#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn a_dead_prefill_worker_costs_no_request() {
    let mut stack = start("pd-dead", "vllm");
    stack.kill_sim("a");
    stack.kill_sim("b");
    let mut whole = 0;
    for i in 0..6 {
        let reply =
            post(&stack.gateway("/v1/chat/completions"), chat(&document(200 + i, 600), "q").to_string(), &[]).unwrap();
        assert_eq!(reply.status, 200, "request {i}: {}", reply.body);
        assert!(matches!(reply.header("x-kvgate-replica"), "c" | "d"), "request {i} decoded on a decode worker");
        if reply.header("x-kvgate-prefill-leg") == "failed" {
            whole += 1;
        }
    }
    // Until Envoy's health checks take them out, legs to the dead workers fail and their
    // requests are served whole; afterwards the fallback balancer sends legs to live hosts.
    assert!(whole >= 1, "the dead workers' legs failed and were served whole");
    assert!(stack.filter_stat("kvgate.prefill_legs_total", &[("outcome", "failed")]).unwrap() >= 1);
}

#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn sglang_legs_meet_in_a_bootstrap_room() {
    let stack = start("pd-sglang", "sglang");
    // Every request to a decode server gets a leg (the start-up probes too): count from here.
    let before = |metric: &str| ["a", "b", "c", "d"].map(|id| sim_metric(&stack, id, metric));
    let (prefills_before, decodes_before) = (before(REMOTE_PREFILLS), before(REMOTE_DECODES));
    let index = |id: &str| (id.as_bytes()[0] - b'a') as usize;
    let doc = document(43, 600);
    let reply = stream(&stack.gateway("/v1/chat/completions"), chat(&doc, "first question")).unwrap();
    assert_eq!(reply.status, 200);
    let prefill_on = reply.header("x-kvgate-prefill-on").to_owned();
    let decoder = reply.header("x-kvgate-replica").to_owned();
    assert!(matches!(prefill_on.as_str(), "a" | "b"), "{prefill_on:?}");
    assert!(matches!(decoder.as_str(), "c" | "d"), "{decoder:?}");
    assert_eq!(
        sim_metric(&stack, &decoder, REMOTE_PREFILLS),
        prefills_before[index(&decoder)] + 1.0,
        "the decode worker took the prompt's KV"
    );
    // The leg's own answer ends its booking on the prefill worker.
    wait_for("the prefill leg's booking released", Duration::from_secs(10), || {
        let state = stack.sidecar_state().ok()?;
        let replicas = state["pools"][0]["replicas"].as_array()?.clone();
        let prefill = replicas.iter().find(|r| r["id"] == prefill_on.as_str())?;
        (prefill["active_requests"] == 0).then_some(())
    })
    .unwrap();
    assert_eq!(sim_metric(&stack, &prefill_on, REMOTE_DECODES), decodes_before[index(&prefill_on)] + 1.0);
}
