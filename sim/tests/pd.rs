//! Prefill/decode disaggregation across two simulator processes, driven as the protocols'
//! own proxies drive real engines: vLLM's NixlConnector flow (prefill answer's
//! `kv_transfer_params` → decode request) and SGLang's bootstrap flow (one body to both at
//! once), with what each does when the other side is missing.

mod common;

use std::thread;
use std::time::{Duration, Instant};

use kvgate_e2e::client::{client, post, stream, Reply};
use kvgate_e2e::process::{free_port, wait_for, Proc};
use serde_json::{json, Value};

const NIXL_PRODUCER: &str = r#"{"kv_connector":"NixlConnector","kv_role":"kv_producer"}"#;
const NIXL_CONSUMER: &str = r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}"#;
const BLOCK: u64 = 16;

/// A running simulator.
struct Sim {
    port: u16,
    _proc: Proc,
}

impl Sim {
    fn start(name: &str, extra: &[&str]) -> Sim {
        let (port, events) = (free_port().unwrap(), free_port().unwrap());
        Sim { port, _proc: common::spawn_sim(name, port, events, extra) }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn post(&self, path: &str, body: &Value) -> Reply {
        post(&self.url(path), body.to_string(), &[]).unwrap()
    }

    /// The sum over ranks of a metric's series whose labels include `labels`.
    fn metric(&self, name: &str, labels: &str) -> f64 {
        let text = client().get(self.url("/metrics")).send().unwrap().text().unwrap();
        let series: Vec<f64> = text
            .lines()
            .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(labels))
            .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
            .collect();
        assert!(!series.is_empty(), "{name} {labels} missing:\n{text}");
        series.iter().sum()
    }

    /// Waits until a metric reads `value`.
    fn await_metric(&self, name: &str, labels: &str, value: f64) {
        let mut last = f64::NAN;
        wait_for(&format!("{name} == {value}"), Duration::from_secs(10), || {
            last = self.metric(name, labels);
            (last == value).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}: it is {last}"));
    }
}

fn long_prompt(topic: &str) -> String {
    (0..40).map(|i| format!("{topic} sentence {i} is here.")).collect::<Vec<_>>().join(" ")
}

/// The first leg, as vLLM's `toy_proxy_server.py` sends it.
fn prefill_leg(mut body: Value) -> Value {
    body["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
    body["stream"] = json!(false);
    body["max_tokens"] = json!(1);
    body
}

#[test]
fn vllm_decode_pulls_the_prefill_engines_held_blocks() {
    let prefill = Sim::start("nixl-p", &["--kv-transfer-config", NIXL_PRODUCER]);
    let decode = Sim::start("nixl-d", &["--kv-transfer-config", NIXL_CONSUMER]);
    let request = json!({"model": "qwen3", "prompt": long_prompt("nixl"), "max_tokens": 5});

    let first = prefill.post("/v1/completions", &prefill_leg(request.clone()));
    assert_eq!(first.status, 200, "{}", first.body);
    let answer = first.json();
    let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 1);
    let params = answer["kv_transfer_params"].clone();
    // The key set is the unit tests' (`kv_transfer`); here, what the leg's own answer carries.
    assert!(params["remote_engine_id"].is_string(), "{params}");
    assert_eq!(
        (params["do_remote_prefill"].as_bool(), params["do_remote_decode"].as_bool()),
        (Some(true), Some(false))
    );
    assert_eq!(
        (params["remote_host"].as_str(), params["remote_port"].as_u64()),
        (Some("127.0.0.1"), Some(prefill.port.into()))
    );
    assert_eq!((&params["remote_request_id"], &params["tp_size"]), (&answer["id"], &json!(1)));
    let blocks = params["remote_block_ids"].as_array().unwrap().len() as u64;
    assert_eq!(blocks, prompt_tokens.div_ceil(BLOCK), "the prompt's blocks, the last one partial");
    assert_eq!(first.header("x-kvgate-sim-remote-prefill"), "false");
    prefill.await_metric("kvgate_sim:kv_transfer_held_blocks", "", blocks as f64);
    assert!(prefill.metric("vllm:kv_cache_usage_perc", "") > 0.0, "held blocks are in use");

    let mut second = request.clone();
    second["kv_transfer_params"] = params.clone();
    let reply = decode.post("/v1/completions", &second);
    assert_eq!(reply.status, 200, "{}", reply.body);
    let usage = &reply.json()["usage"];
    assert_eq!((usage["prompt_tokens"].as_u64(), usage["completion_tokens"].as_u64()), (Some(prompt_tokens), Some(5)));
    // The decoder loaded all but the last token, which it computes, but vLLM 0.32 reports the
    // prefill engine's own cache hits, passed on in `remote_prefill_cached_tokens`.
    let prefill_cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    assert_eq!(params["remote_prefill_cached_tokens"].as_u64(), prefill_cached);
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"].as_u64(), prefill_cached);
    assert_eq!(reply.header("x-kvgate-sim-remote-prefill"), "true");
    assert_eq!(reply.header("x-kvgate-sim-prompt-computed"), "1");
    assert_eq!(decode.metric("kvgate_sim:remote_prefill_requests_total", ""), 1.0);
    assert_eq!(decode.metric("kvgate_sim:kv_transfer_tokens_total", ""), prompt_tokens as f64);
    assert_eq!(decode.metric("vllm:prompt_tokens_by_source_total", r#"source="local_compute""#), 1.0);
    assert_eq!(
        decode.metric("vllm:prompt_tokens_by_source_total", r#"source="external_kv_transfer""#),
        prompt_tokens as f64
    );
    assert!(
        decode.metric("kvgate_sim:cached_blocks", "") >= (prompt_tokens / BLOCK) as f64,
        "the loaded blocks are cached"
    );
    assert_eq!(decode.metric("kvgate_sim:kv_transfer_failures_total", ""), 0.0);
    // Read, the prefill's blocks are freed; they stay in its prefix cache.
    prefill.await_metric("kvgate_sim:kv_transfer_held_blocks", "", 0.0);
    prefill.await_metric("vllm:kv_cache_usage_perc", "", 0.0);
    assert_eq!(prefill.metric("kvgate_sim:remote_decode_requests_total", ""), 1.0);
    assert!(prefill.metric("kvgate_sim:cached_blocks", "") >= (prompt_tokens / BLOCK) as f64);

    // The blocks were read once: another decode finds nothing and fails, vLLM's default policy.
    let again = decode.post("/v1/completions", &second);
    assert_eq!((again.status, again.json()["message"].as_str()), (500, Some("Internal server error")));
    assert_eq!(decode.metric("kvgate_sim:kv_transfer_failures_total", ""), 1.0);
    assert_eq!(decode.metric("vllm:nixl_num_failed_transfers_total", ""), 1.0);
}

/// A chat's decode leg carries the forwarded prompt token ids beside the P/D fields, and
/// streams.
#[test]
fn vllm_chat_decode_streams_with_forwarded_token_ids() {
    let prefill = Sim::start("nixl-chat-p", &["--kv-transfer-config", NIXL_PRODUCER]);
    let decode = Sim::start("nixl-chat-d", &["--kv-transfer-config", NIXL_CONSUMER]);
    let messages = json!([{"role": "user", "content": long_prompt("chat")}]);
    let request = json!({"model": "qwen3", "messages": messages, "max_tokens": 4});
    let first = prefill.post("/v1/chat/completions", &prefill_leg(request.clone()));
    assert_eq!(first.status, 200, "{}", first.body);
    let mut params = first.json()["kv_transfer_params"].clone();
    let prefill_cached = first.json()["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let ids = prefill.post("/tokenize", &json!({"model": "qwen3", "messages": messages})).json()["tokens"].clone();
    params["prompt_token_ids"] = ids.clone();
    let mut second = request.clone();
    second["kv_transfer_params"] = params;
    let streamed = stream(&decode.url("/v1/chat/completions"), second).unwrap();
    assert_eq!(streamed.status, 200);
    assert_eq!(streamed.header("x-kvgate-sim-remote-prefill"), "true");
    let usage = streamed.usage.clone().unwrap();
    let prompt_tokens = ids.as_array().unwrap().len() as u64;
    assert_eq!((usage["prompt_tokens"].as_u64(), usage["completion_tokens"].as_u64()), (Some(prompt_tokens), Some(4)));
    assert_eq!(streamed.cached_tokens(), prefill_cached, "the prefill engine's hits, as vLLM 0.32 reports");
    assert_eq!(decode.metric("kvgate_sim:remote_prefill_requests_total", ""), 1.0);
    assert_eq!(decode.metric("kvgate_sim:prompts_tokenized_total", ""), 0.0, "the forwarded ids were the prompt");
    prefill.await_metric("kvgate_sim:kv_transfer_held_blocks", "", 0.0);
}

#[test]
fn vllm_expired_or_unreachable_prefills_are_recomputed_with_the_recompute_policy() {
    let prefill =
        Sim::start("nixl-expire-p", &["--kv-transfer-config", NIXL_PRODUCER, "--kv-transfer-hold-secs", "0.5"]);
    let recompute = r#"{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_load_failure_policy":"recompute"}"#;
    let decode = Sim::start("nixl-expire-d", &["--kv-transfer-config", recompute]);
    let request = json!({"model": "qwen3", "prompt": long_prompt("expire"), "max_tokens": 2});
    let first = prefill.post("/v1/completions", &prefill_leg(request.clone()));
    assert_eq!(first.status, 200, "{}", first.body);
    let params = first.json()["kv_transfer_params"].clone();
    // Nobody reads the blocks: the hold times out.
    prefill.await_metric("vllm:nixl_num_kv_expired_reqs_total", "", 1.0);
    prefill.await_metric("kvgate_sim:kv_transfer_held_blocks", "", 0.0);
    let mut second = request.clone();
    second["kv_transfer_params"] = params.clone();
    let reply = decode.post("/v1/completions", &second);
    assert_eq!(reply.status, 200, "{}", reply.body);
    let prompt_tokens = reply.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(reply.header("x-kvgate-sim-remote-prefill"), "true");
    assert_eq!(reply.header("x-kvgate-sim-prompt-computed"), prompt_tokens.to_string(), "computed here");
    assert_eq!(decode.metric("kvgate_sim:kv_transfer_failures_total", ""), 1.0);
    assert_eq!(decode.metric("kvgate_sim:remote_prefill_requests_total", ""), 0.0);

    // A prefill engine that is gone: the same, for a prompt the decoder has not seen.
    let mut gone = json!({"model": "qwen3", "prompt": long_prompt("gone"), "max_tokens": 2});
    let mut dead = params;
    dead["remote_port"] = json!(free_port().unwrap());
    gone["kv_transfer_params"] = dead;
    let reply = decode.post("/v1/completions", &gone);
    assert_eq!(reply.status, 200, "{}", reply.body);
    let prompt_tokens = reply.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(reply.header("x-kvgate-sim-prompt-computed"), prompt_tokens.to_string());
    assert_eq!(decode.metric("kvgate_sim:kv_transfer_failures_total", ""), 2.0);

    let malformed = json!({"model": "qwen3", "prompt": "x", "kv_transfer_params": {"do_remote_prefill": true}});
    let reply = decode.post("/v1/completions", &malformed);
    assert_eq!(reply.status, 400);
    assert!(reply.json()["message"].as_str().unwrap().contains("remote_block_ids"), "{}", reply.body);
}

fn sglang_pair(name: &str, timeout: &str) -> (Sim, Sim, u16) {
    let bootstrap = free_port().unwrap();
    let prefill = Sim::start(
        &format!("{name}-p"),
        &[
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            &bootstrap.to_string(),
            "--disaggregation-bootstrap-timeout-secs",
            timeout,
        ],
    );
    let decode = Sim::start(
        &format!("{name}-d"),
        &["--disaggregation-mode", "decode", "--disaggregation-bootstrap-timeout-secs", timeout],
    );
    (prefill, decode, bootstrap)
}

/// The body SGLang's router sends to both servers.
fn with_room(mut body: Value, bootstrap: u16, room: u64) -> Value {
    body["bootstrap_host"] = json!("127.0.0.1");
    body["bootstrap_port"] = json!(bootstrap);
    body["bootstrap_room"] = json!(room);
    body
}

#[test]
fn sglang_prefill_and_decode_meet_in_their_room() {
    let (prefill, decode, bootstrap) = sglang_pair("room", "30");
    let room = rand::random::<u64>() >> 1;
    let body = with_room(json!({"model": "qwen3", "prompt": long_prompt("room"), "max_tokens": 6}), bootstrap, room);
    let (p_body, d_body) = (body.clone(), body.clone());
    let (p_url, d_url) = (prefill.url("/v1/completions"), decode.url("/v1/completions"));
    // The decode leg first: it must wait for the prefill, which waits for it to join.
    let decoding = thread::spawn(move || post(&d_url, d_body.to_string(), &[]).unwrap());
    let prefilling = thread::spawn(move || post(&p_url, p_body.to_string(), &[]).unwrap());
    let (p_reply, d_reply) = (prefilling.join().unwrap(), decoding.join().unwrap());
    assert_eq!(p_reply.status, 200, "{}", p_reply.body);
    assert_eq!(p_reply.json()["usage"]["completion_tokens"], 1, "the prefill samples one token");
    assert_eq!(d_reply.status, 200, "{}", d_reply.body);
    let usage = &d_reply.json()["usage"];
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    assert_eq!(usage["completion_tokens"], 6);
    assert_eq!(
        (d_reply.header("x-kvgate-sim-remote-prefill"), d_reply.header("x-kvgate-sim-prompt-computed")),
        ("true", "0")
    );
    assert_eq!(decode.metric("kvgate_sim:remote_prefill_requests_total", ""), 1.0);
    assert_eq!(decode.metric("kvgate_sim:kv_transfer_tokens_total", ""), prompt_tokens as f64);
    assert_eq!(decode.metric("vllm:prompt_tokens_by_source_total", r#"source="local_compute""#), 0.0);
    assert_eq!(prefill.metric("kvgate_sim:remote_decode_requests_total", ""), 1.0);
    prefill.await_metric("kvgate_sim:kv_transfer_held_blocks", "", 0.0);

    // Both servers refuse a request that bypassed the router, as SGLang's do.
    for sim in [&prefill, &decode] {
        let reply = sim.post("/v1/completions", &json!({"model": "qwen3", "prompt": "direct"}));
        assert_eq!(reply.status, 400);
        assert_eq!(reply.json()["message"], "Disaggregated request received without bootstrap room id");
    }
}

#[test]
fn sglang_rooms_time_out_on_either_side() {
    let (prefill, decode, bootstrap) = sglang_pair("timeout", "1");
    // A decode whose prefill never comes.
    let orphan = with_room(json!({"model": "qwen3", "prompt": long_prompt("orphan"), "max_tokens": 3}), bootstrap, 41);
    let started = Instant::now();
    let reply = decode.post("/v1/completions", &orphan);
    assert_eq!(reply.status, 500, "{}", reply.body);
    let message = reply.json()["message"].as_str().unwrap().to_owned();
    assert!(message.starts_with("Decode transfer failed for request rank=0"), "{message}");
    assert!(message.contains("KVTransferError(bootstrap_room=41)"), "{message}");
    assert!(started.elapsed() >= Duration::from_millis(900), "it waited for the bootstrap timeout");
    assert_eq!(decode.metric("kvgate_sim:kv_transfer_failures_total", ""), 1.0);
    // A prefill whose decoder never joins.
    let lonely = with_room(json!({"model": "qwen3", "prompt": long_prompt("lonely"), "max_tokens": 3}), bootstrap, 42);
    let reply = prefill.post("/v1/completions", &lonely);
    assert_eq!(reply.status, 500, "{}", reply.body);
    assert!(reply.json()["message"].as_str().unwrap().starts_with("Prefill bootstrap failed"), "{}", reply.body);
    assert_eq!(prefill.metric("kvgate_sim:bootstrap_failures_total", ""), 1.0);
    assert_eq!(prefill.metric("vllm:prompt_tokens_total", ""), 0.0, "nothing was computed");
}
