//! The real-vLLM suite (`cargo xtask e2e-vllm`): two real vLLM engines (vLLM 0.32's CPU build,
//! a tiny random-weight Qwen3 on the real Qwen3 tokenizer) behind kvgate's sidecar and Envoy.
//! The simulator is ours, so agreeing with it proves little; every difference found here is a
//! bug in kvgate's understanding of vLLM: token ids, an event field, a block size, a replay
//! layout.
//!
//! Checks, each a row of the report:
//! 1. parity — for chat and completion requests (strings, content parts, tools, tool calls,
//!    multi-turn with reasoning, `enable_thinking`, unicode, long), `kvgate-sidecar tokenize`
//!    gives vLLM's `/tokenize` ids, and the filter in Envoy counts the real request's
//!    `usage.prompt_tokens`; a mismatch prints both lists at the first divergence;
//!    (1c) `/v1/responses` requests (instructions, input items, tool calls and outputs,
//!    reasoning effort, a continued answer) count as many prompt tokens in kvgate as in vLLM's
//!    `usage.input_tokens`, in Envoy too, and a streamed chat whose client asked for no usage
//!    reaches it without a usage event while kvgate still reads vLLM's; Anthropic
//!    `/v1/messages` requests (system blocks with Claude Code's billing header, an inline
//!    system reminder, tool use and results, thinking history, thinking disabled), streamed and
//!    not, count as many prompt tokens in kvgate as vLLM's `usage` (its `input_tokens` plus
//!    `cache_read_input_tokens`), in Envoy too;
//! 2. routing follows the real cache — a prefix warmed directly on one engine draws the same
//!    prefix through Envoy there, and vLLM serves it from cache (for each engine); (2a) a
//!    prefix warmed under a `cache_salt` is credited to that salt only, as vLLM caches it;
//! 3. reset — `/reset_prefix_cache` publishes `AllBlocksCleared` and the engine's index empties;
//! 4. events — after a burst, the index holds exactly the full blocks the engines cached;
//! 5. sidecar restart — the index is rebuilt (replay or live events) and routing follows again;
//! 6. engine restart — the restarted engine's seq starts over, it is cleared, and the prefix it
//!    lost is credited nowhere;
//! 7. a second family (Llama 3.2) — parity as in 1, `/v1/messages` as in 1c (its template
//!    ignores `reasoning_effort`, so vLLM turns thinking off with effort "low"), then, on its
//!    engine's small KV cache, predictions under load with evictions;
//! 8. prefill/decode — kvgate's vLLM disaggregation in front of two engines sharing KV through
//!    vLLM's `ExampleConnector`, which runs without a GPU.
//!
//! Checks 2c–2f and 7b run clients concurrently and class every prediction ([`load`]).

pub mod load;
pub mod ttft;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};

use crate::client::{self, post};
use crate::faults::Row;
use crate::process::{free_port, wait_for, Proc};
use crate::stack::{metric_sum, SimHandle};
use crate::workload::document;
use crate::{Artifacts, Stack, StackOptions};

/// vLLM's CPU attention needs a multiple of 32.
pub const BLOCK: u32 = 32;

/// Where vLLM is installed and the model built.
#[derive(Debug, Clone)]
pub struct Setup {
    /// The venv's Python.
    pub python: PathBuf,
    /// The tiny Qwen3 model directory.
    pub model_dir: PathBuf,
    /// The tiny Llama model directory (Llama 3.2's tokenizer and template): the second family.
    pub second_model_dir: PathBuf,
    /// Logs and the report.
    pub out: PathBuf,
}

/// Starts one vLLM engine on `core`, serving the tiny Qwen3 as `qwen3` with prefix caching,
/// prompt-token details and KV events with replay, loopback only.
pub fn start_engine(setup: &Setup, id: &str, core: usize) -> anyhow::Result<SimHandle> {
    start_vllm(setup, Served::qwen3(setup), id, core, &[], &[])
}

/// A model as an engine serves it.
#[derive(Debug, Clone, Copy)]
struct Served<'a> {
    /// Its directory.
    dir: &'a Path,
    /// The name it is served as.
    name: &'a str,
    /// Its family's tool-call parser.
    tool_parser: &'a str,
}

impl Served<'_> {
    /// The tiny Qwen3, as `qwen3`.
    fn qwen3(setup: &Setup) -> Served<'_> {
        Served { dir: &setup.model_dir, name: "qwen3", tool_parser: "hermes" }
    }
}

/// Starts one vLLM engine on `core` serving `model`, with `extra` arguments and `env`
/// variables.
fn start_vllm(
    setup: &Setup,
    model: Served<'_>,
    id: &str,
    core: usize,
    extra: &[&str],
    env: &[(&str, String)],
) -> anyhow::Result<SimHandle> {
    let Served { dir: model_dir, name: served, tool_parser } = model;
    let (port, events, replay) = (free_port()?, free_port()?, free_port()?);
    let kv_events = json!({"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": format!("tcp://*:{events}"),
        "replay_endpoint": format!("tcp://*:{replay}"), "topic": "kv-events"});
    let mut cmd = Command::new(&setup.python);
    cmd.args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
        .arg(model_dir)
        .args(["--served-model-name", served, "--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "8"])
        .args(["--max-num-batched-tokens", "2048", "--block-size", &BLOCK.to_string()])
        .args(["--enable-prefix-caching", "--enforce-eager", "--enable-prompt-tokens-details"])
        .args(["--enable-auto-tool-choice", "--tool-call-parser", tool_parser])
        .args(["--kv-events-config", &kv_events.to_string()])
        .args(extra)
        .env("VLLM_TARGET_DEVICE", "cpu")
        .env("VLLM_CPU_KVCACHE_SPACE", "1")
        .env("VLLM_CPU_OMP_THREADS_BIND", core.to_string())
        .env("VLLM_HOST_IP", "127.0.0.1")
        .env("VLLM_SERVER_DEV_MODE", "1")
        .env("VLLM_NO_USAGE_STATS", "1")
        .env("DO_NOT_TRACK", "1")
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())));
    // vLLM forks its engine core, which binds the events ports: kill the whole group.
    let proc = Proc::spawn_group(&format!("vllm {id}"), cmd, &setup.out.join(format!("vllm-{id}.log")))?;
    Ok(SimHandle::new(id, port, events, replay, proc))
}

/// The requests of the parity check: (name, endpoint path, body).
fn parity_cases() -> Vec<(&'static str, &'static str, Value)> {
    let chat = |messages: Value| json!({"model": "qwen3", "messages": messages, "max_tokens": 1});
    let weather = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let mut tools = chat(json!([{"role": "user", "content": "Weather in Paris?"}]));
    tools["tools"] = weather;
    let mut no_thinking = chat(json!([{"role": "user", "content": "Think less."}]));
    no_thinking["chat_template_kwargs"] = json!({"enable_thinking": false});
    vec![
        ("chat, one string", "/v1/chat/completions", chat(json!([{"role": "user", "content": "Hello there!"}]))),
        (
            "chat, system and user",
            "/v1/chat/completions",
            chat(
                json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]),
            ),
        ),
        (
            "chat, content parts",
            "/v1/chat/completions",
            chat(
                json!([{"role": "user", "content": [{"type": "text", "text": "first part"}, {"type": "text", "text": "second part"}]}]),
            ),
        ),
        ("chat, tools", "/v1/chat/completions", tools),
        (
            "chat, tool call and result",
            "/v1/chat/completions",
            chat(json!([
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\":   \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}])),
        ),
        (
            "chat, multi-turn with reasoning",
            "/v1/chat/completions",
            chat(json!([
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "<think>\nSimple sum.\n</think>\n\n4"},
                {"role": "user", "content": "And 3+3?"}])),
        ),
        ("chat, enable_thinking false", "/v1/chat/completions", no_thinking),
        (
            "chat, a system message after the first turn",
            "/v1/chat/completions",
            chat(json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "first"},
                {"role": "system", "content": "A reminder."},
                {"role": "user", "content": "second"}])),
        ),
        (
            "chat, unicode",
            "/v1/chat/completions",
            chat(json!([{"role": "user", "content": "Grüße aus Zürich — 你好，世界 🌍🚀 naïve café"}])),
        ),
        ("chat, long", "/v1/chat/completions", chat(json!([{"role": "user", "content": document(7, 1000)}]))),
        (
            "completions, string",
            "/v1/completions",
            json!({"model": "qwen3", "prompt": "The quick brown fox jumps over", "max_tokens": 1}),
        ),
    ]
}

/// kvgate's token ids for a body (`kvgate-sidecar tokenize`, the filter's own code).
fn kvgate_ids(artifacts: &Artifacts, path: &str, body: &Value) -> anyhow::Result<Vec<u64>> {
    use std::io::Write as _;
    let endpoint = ["chat", "responses", "messages"].into_iter().find(|e| path.contains(e)).unwrap_or("completions");
    let mut child = Command::new(&artifacts.sidecar)
        .args(["tokenize", "--block-size", &BLOCK.to_string(), "--endpoint", endpoint, "--model-dir"])
        .arg(&artifacts.model_dir)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    child.stdin.take().ok_or_else(|| anyhow::anyhow!("no stdin"))?.write_all(body.to_string().as_bytes())?;
    let out = child.wait_with_output()?;
    anyhow::ensure!(out.status.success(), "kvgate-sidecar tokenize failed");
    let v: Value = serde_json::from_slice(&out.stdout)?;
    Ok(v["token_ids"].as_array().map(|a| a.iter().filter_map(Value::as_u64).collect()).unwrap_or_default())
}

/// vLLM's token ids for a body (`POST /tokenize`, the engine's own renderer).
fn vllm_ids(engine: &SimHandle, body: &Value) -> anyhow::Result<Vec<u64>> {
    let mut req = body.clone();
    if let Some(o) = req.as_object_mut() {
        o.remove("max_tokens");
    }
    let reply = post(&engine.url("/tokenize"), req.to_string(), &[])?;
    anyhow::ensure!(reply.status == 200, "/tokenize: {} {}", reply.status, reply.body);
    Ok(reply.json()["tokens"].as_array().map(|a| a.iter().filter_map(Value::as_u64).collect()).unwrap_or_default())
}

/// Where two id lists first differ, with a few ids of each from there.
fn divergence(a: &[u64], b: &[u64]) -> Option<String> {
    let at = a.iter().zip(b).position(|(x, y)| x != y).or((a.len() != b.len()).then(|| a.len().min(b.len())))?;
    let window = |v: &[u64]| format!("{:?}", &v[at.saturating_sub(3)..(at + 8).min(v.len())]);
    Some(format!(
        "first difference at {at} (kvgate {} ids, vLLM {}): kvgate …{} vLLM …{}",
        a.len(),
        b.len(),
        window(a),
        window(b)
    ))
}

fn usage(reply: &client::Reply) -> (u64, u64) {
    let v = reply.json();
    let u = &v["usage"];
    (u["prompt_tokens"].as_u64().unwrap_or(0), u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0))
}

/// Check 1 (and 7, on the second family): every parity case, as a request for `model`.
fn parity(stack: &Stack, artifacts: &Artifacts, model: &str, scenario: &'static str) -> anyhow::Result<Row> {
    let mut problems = Vec::new();
    let mut cases = parity_cases();
    for (_, _, body) in &mut cases {
        body["model"] = model.into();
    }
    for (name, path, body) in &cases {
        let ours = kvgate_ids(artifacts, path, body)?;
        let theirs = vllm_ids(&stack.sims[0], body)?;
        if let Some(d) = divergence(&ours, &theirs) {
            eprintln!("parity {name}: {d}");
            problems.push(format!("{name}: {d}"));
            continue;
        }
        let reply = post(&stack.gateway(path), body.to_string(), &[])?;
        let (prompt_tokens, _) = usage(&reply);
        let in_envoy: u64 = reply.header("x-kvgate-prompt-tokens").parse().unwrap_or(0);
        if reply.status != 200 || prompt_tokens != ours.len() as u64 || in_envoy != prompt_tokens {
            problems.push(format!(
                "{name}: status {}, usage.prompt_tokens {prompt_tokens}, filter in Envoy {in_envoy}, kvgate {}",
                reply.status,
                ours.len()
            ));
        }
    }
    Ok(Row {
        scenario,
        expected: "kvgate's ids equal vLLM's /tokenize for every request; the filter in Envoy counts the real request's usage.prompt_tokens",
        measured: if problems.is_empty() {
            format!("{} of {} requests identical, in Envoy too", cases.len(), cases.len())
        } else {
            problems.join("; ")
        },
        pass: problems.is_empty(),
    })
}

/// Check 1b: what chat token forwarding relies on. vLLM takes a chat's
/// `kv_transfer_params.prompt_token_ids` as its prompt (ids of another chat, so the count
/// tells which was used), beside other parameters in that object, and renders the messages
/// instead when `echo` is set; kvgate's parser (the filter's, the sidecar's, the simulator's)
/// reads such a body the same way.
fn chat_forwarding(stack: &Stack, artifacts: &Artifacts) -> anyhow::Result<Row> {
    let chat = |text: &str| json!({"model": "qwen3", "max_tokens": 1, "messages": [{"role": "user", "content": text}]});
    let (asked, other) = (chat("What is a KV cache?"), chat(&"a much longer question about prefix caching ".repeat(8)));
    let (asked_ids, other_ids) = (kvgate_ids(artifacts, "chat", &asked)?, kvgate_ids(artifacts, "chat", &other)?);
    let forwarded = |extra: Value| {
        let mut body = asked.clone();
        body["kv_transfer_params"] = json!({"note": "kept", "prompt_token_ids": other_ids});
        for (k, v) in extra.as_object().into_iter().flatten() {
            body[k] = v.clone();
        }
        body
    };
    let prompt_tokens = |body: &Value| -> anyhow::Result<u64> {
        let reply = post(&stack.sims[0].url("/v1/chat/completions"), body.to_string(), &[])?;
        anyhow::ensure!(reply.status == 200, "vLLM answered {}: {}", reply.status, reply.body);
        Ok(usage(&reply).0)
    };
    let used = prompt_tokens(&forwarded(json!({})))?;
    let echoed = prompt_tokens(&forwarded(json!({"echo": true})))?;
    let ours = |body: &Value| -> anyhow::Result<usize> {
        let parsed = kvgate_shared::prompt::openai::parse(
            kvgate_shared::prompt::openai::Endpoint::ChatCompletions,
            body.to_string().as_bytes(),
        )?;
        Ok(match parsed.prompt {
            kvgate_shared::prompt::openai::Prompt::Tokens(ids) => ids.len(),
            _ => asked_ids.len(),
        })
    };
    let expected = (other_ids.len() as u64, asked_ids.len() as u64);
    let kvgate = (ours(&forwarded(json!({})))? as u64, ours(&forwarded(json!({"echo": true})))? as u64);
    Ok(Row {
        scenario: "1b. chat token forwarding",
        expected: "vLLM counts the forwarded kv_transfer_params.prompt_token_ids as the prompt (not the messages), and the messages when echo is set; kvgate's parser agrees",
        measured: format!(
            "forwarded: vLLM {used} tokens (ids {}, messages {}); with echo: vLLM {echoed}; kvgate reads {} and {}",
            expected.0, expected.1, kvgate.0, kvgate.1
        ),
        pass: (used, echoed) == expected && kvgate == expected && expected.0 != expected.1,
    })
}

/// Check 1d: requests that run several sequences, through Envoy. vLLM answers `n` choices per
/// prompt of a completion's list, counts each prompt once in `usage.prompt_tokens` (summed over
/// a list), and has no `best_of` (it runs `n`); the sidecar books them all, releases them at
/// the end, and counts their prediction unchecked (`several_sequences`: vLLM reports the cached
/// tokens of one sequence, not a known one).
fn several_sequences(stack: &Stack, artifacts: &Artifacts) -> anyhow::Result<Row> {
    let unchecked = || -> anyhow::Result<u64> {
        let text = stack.sidecar_metrics()?;
        Ok(metric_sum(&text, "kvgate_predictions_unchecked_total", "reason=\"several_sequences\"") as u64)
    };
    let before = unchecked()?;
    let (first, second) = (document(950, 200), document(951, 150));
    // vLLM runs n > 1 only when sampling (temperature above 0).
    let chat = json!({"model": "qwen3", "max_tokens": 4, "n": 3, "ignore_eos": true, "temperature": 1.0,
        "messages": [{"role": "user", "content": first}]});
    let list = json!({"model": "qwen3", "max_tokens": 4, "ignore_eos": true, "prompt": [first, second]});
    let best_of = json!({"model": "qwen3", "max_tokens": 4, "ignore_eos": true, "temperature": 1.0, "n": 2,
        "best_of": 4, "prompt": second});
    let count = |path: &str, body: &Value| kvgate_ids(artifacts, path, body).map(|ids| ids.len() as u64);
    let one = |prompt: &str| count("/v1/completions", &json!({"model": "qwen3", "prompt": prompt}));
    let list_tokens = one(&first)? + one(&second)?;
    let cases = [
        ("n=3 chat", "/v1/chat/completions", &chat, 3, count("/v1/chat/completions", &chat)?, 12),
        ("two-prompt completion", "/v1/completions", &list, 2, list_tokens, 8),
        ("n=2, best_of=4", "/v1/completions", &best_of, 2, count("/v1/completions", &best_of)?, 8),
    ];
    let mut notes = Vec::new();
    let mut pass = true;
    for (name, path, body, choices, prompt_tokens, completion_tokens) in cases {
        let reply = post(&stack.gateway(path), body.to_string(), &[])?;
        let answer = reply.json();
        let got = (
            answer["choices"].as_array().map_or(0, Vec::len),
            answer["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
            answer["usage"]["completion_tokens"].as_u64().unwrap_or(0),
        );
        let released = wait_for("its bookings released", Duration::from_secs(20), || {
            let state = stack.sidecar_state().ok()?;
            (state["pools"][0]["bookings"] == 0).then_some(())
        });
        let ok = reply.status == 200 && got == (choices, prompt_tokens, completion_tokens) && released.is_ok();
        pass &= ok;
        notes.push(format!(
            "{name}: {} choices, {} prompt and {} completion tokens (kvgate: {choices}, {prompt_tokens}, \
             {completion_tokens}){}",
            got.0,
            got.1,
            got.2,
            if released.is_ok() { "" } else { "; bookings left" }
        ));
    }
    let counted = wait_for("their predictions counted", Duration::from_secs(20), || {
        unchecked().ok().filter(|n| n - before >= cases.len() as u64)
    });
    pass &= counted.is_ok();
    notes.push(format!("{} counted unchecked as several_sequences", unchecked()? - before));
    Ok(Row {
        scenario: "1d. several sequences",
        expected: "vLLM answers n choices per prompt, counts each prompt once (a list's summed), runs n (no best_of); \
                   kvgate counts the same, releases every booking, and counts the prediction unchecked",
        measured: notes.join("; "),
        pass,
    })
}

/// The Responses requests of check 1c.
fn responses_cases() -> Vec<(&'static str, Value)> {
    let weather = json!({"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}});
    let body = |input: Value| json!({"model": "qwen3", "max_output_tokens": 1, "input": input});
    let mut instructions = body(json!("Why is the sky blue?"));
    instructions["instructions"] = json!("Be brief.");
    let mut tools = body(json!([
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "{\"temp\": 21}"},
        {"role": "user", "content": "And Tokyo?"}]));
    tools["tools"] = json!([weather]);
    let mut effort = body(json!("Think less."));
    effort["reasoning"] = json!({"effort": "none"});
    let continued = body(json!([{"role": "user", "content": "Write a haiku"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "incomplete",
         "content": [{"type": "output_text", "text": "Autumn moon", "annotations": []}]}]));
    vec![
        ("a string", body(json!("Hello there!"))),
        ("instructions", instructions),
        ("items, reasoning and a tool call", tools),
        ("reasoning effort none", effort),
        ("a continued answer", continued),
    ]
}

/// The Anthropic Messages requests of checks 1c and 7, for `model`.
fn messages_cases(model: &str) -> Vec<(&'static str, Value)> {
    let body = |system: Value, messages: Value| json!({"model": model, "max_tokens": 1, "system": system, "messages": messages});
    let system = json!([{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=7f3a"},
        {"type": "text", "text": "You are a coding agent."}, {"type": "text", "text": " Use the tools."}]);
    let reminder = body(
        json!("Top."),
        json!([{"role": "user", "content": "first"},
        {"role": "assistant", "content": [{"type": "text", "text": "one"}]},
        {"role": "system", "content": "<system-reminder>todo list</system-reminder>"},
        {"role": "user", "content": "second"}]),
    );
    let mut tools = body(
        system.clone(),
        json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Call it.", "signature": "s"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "21C"},
            {"type": "text", "text": "And Tokyo?"}]}]),
    );
    tools["tools"] = json!([{"name": "get_weather", "description": "Weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]);
    let mut off = body(system.clone(), json!([{"role": "user", "content": "2+2?"}]));
    off["thinking"] = json!({"type": "disabled"});
    let mut streamed = tools.clone();
    streamed["stream"] = json!(true);
    vec![
        ("system blocks and the billing header", body(system, json!([{"role": "user", "content": "hi"}]))),
        ("an inline system reminder", reminder),
        ("thinking, tool use and results", tools),
        ("thinking disabled", off),
        ("streamed", streamed),
    ]
}

/// The prompt tokens in a Messages `usage`: vLLM's `input_tokens` leave out the cache's.
fn messages_prompt(usage: &Value) -> u64 {
    ["input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"]
        .iter()
        .filter_map(|k| usage[*k].as_u64())
        .sum()
}

/// `/v1/messages` counted by kvgate, vLLM and the filter in Envoy: what differs, and how many
/// requests went through the gateway.
fn messages_counted(stack: &Stack, artifacts: &Artifacts, model: &str) -> anyhow::Result<(Vec<String>, u64)> {
    let mut problems = Vec::new();
    let cases = messages_cases(model);
    for (name, body) in &cases {
        let ours = kvgate_ids(artifacts, "/v1/messages", body)?.len() as u64;
        let reply = post(&stack.gateway("/v1/messages"), body.to_string(), &[])?;
        anyhow::ensure!(reply.status == 200, "{name}: vLLM answered {}: {}", reply.status, reply.body);
        let theirs = if body["stream"] == json!(true) {
            let delta = reply.body.split("\n\n").find(|e| e.starts_with("event: message_delta"));
            let data = delta.and_then(|d| d.split_once("data: ")).map(|(_, data)| data).unwrap_or("{}");
            messages_prompt(&serde_json::from_str::<Value>(data)?["usage"])
        } else {
            messages_prompt(&reply.json()["usage"])
        };
        let in_envoy: u64 = reply.header("x-kvgate-prompt-tokens").parse().unwrap_or(0);
        if ours != theirs || in_envoy != theirs {
            problems.push(format!("{name}: vLLM {theirs} prompt tokens, kvgate {ours}, filter in Envoy {in_envoy}"));
        }
    }
    Ok((problems, cases.len() as u64))
}

/// Check 7's Messages row, on the second family.
fn messages_row(stack: &Stack, artifacts: &Artifacts, model: &str) -> anyhow::Result<Row> {
    let (problems, n) = messages_counted(stack, artifacts, model)?;
    Ok(Row {
        scenario: "7a. Anthropic Messages on Llama 3.2",
        expected: "kvgate counts each /v1/messages prompt as vLLM's usage (input_tokens + cache_read_input_tokens), in Envoy too, with thinking disabled as effort \"low\"",
        measured: if problems.is_empty() {
            format!("{n} of {n} Messages requests counted alike")
        } else {
            problems.join("; ")
        },
        pass: problems.is_empty(),
    })
}

/// Check 1c: `/v1/responses` and `/v1/messages` counted as vLLM counts them, directly and
/// through Envoy, and a stream whose client asked for no usage still checked. Returns the row
/// and how many requests went through the gateway.
fn responses_and_usage(stack: &Stack, artifacts: &Artifacts) -> anyhow::Result<(Row, u64)> {
    let (mut problems, messages) = messages_counted(stack, artifacts, "qwen3")?;
    let cases = responses_cases();
    for (name, body) in &cases {
        let ours = kvgate_ids(artifacts, "/v1/responses", body)?.len() as u64;
        let direct = post(&stack.sims[0].url("/v1/responses"), body.to_string(), &[])?;
        anyhow::ensure!(direct.status == 200, "{name}: vLLM answered {}: {}", direct.status, direct.body);
        let theirs = direct.json()["usage"]["input_tokens"].as_u64().unwrap_or(0);
        let reply = post(&stack.gateway("/v1/responses"), body.to_string(), &[])?;
        let in_envoy: u64 = reply.header("x-kvgate-prompt-tokens").parse().unwrap_or(0);
        if ours != theirs || in_envoy != theirs || reply.status != 200 {
            problems.push(format!("{name}: vLLM {theirs} input tokens, kvgate {ours}, filter in Envoy {in_envoy}"));
        }
    }
    let mut streamed = json!({"model": "qwen3", "max_tokens": 3, "stream": true,
        "messages": [{"role": "user", "content": "Stream without usage, please."}]});
    let reply = post(&stack.gateway("/v1/chat/completions"), streamed.to_string(), &[])?;
    let clean = reply.status == 200 && reply.body.ends_with("data: [DONE]\n\n") && !reply.body.contains("\"usage\"");
    if !clean {
        problems.push(format!("the stream without usage reached the client as {}: {}", reply.status, reply.body));
    }
    streamed["stream_options"] = json!({"include_usage": true});
    let asked = post(&stack.gateway("/v1/chat/completions"), streamed.to_string(), &[])?;
    if !asked.body.contains("\"usage\"") {
        problems.push("a client that asked for usage did not get it".into());
    }
    let row = Row {
        scenario: "1c. Responses, Messages and usage on the client's behalf",
        expected: "kvgate counts each /v1/responses prompt as vLLM's usage.input_tokens and each /v1/messages prompt as its input_tokens + cache_read_input_tokens, in Envoy too; a stream whose client asked for no usage gets none (and is still checked in 2b), one that asked gets it",
        measured: if problems.is_empty() {
            format!(
                "{n} of {n} Responses and {messages} of {messages} Messages requests counted alike; the streams as their clients asked",
                n = cases.len()
            )
        } else {
            problems.join("; ")
        },
        pass: problems.is_empty(),
    };
    Ok((row, cases.len() as u64 + messages + 2))
}

/// Waits until the sidecar's index for `id` satisfies `ok`; returns the last count.
fn wait_blocks(stack: &Stack, id: &str, what: &str, ok: impl Fn(u64) -> bool) -> Result<u64, u64> {
    let got = wait_for(what, Duration::from_secs(20), || stack.indexed_blocks(id).ok().filter(|n| ok(*n)));
    got.map_err(|_| stack.indexed_blocks(id).unwrap_or(0))
}

/// Check 2 (and its repeat after the sidecar restart): for each engine, warm a prefix on it
/// directly, then send the prefix with a new question through Envoy.
fn routing(stack: &Stack, artifacts: &Artifacts, seed: u32, label: &'static str) -> anyhow::Result<Row> {
    let mut notes = Vec::new();
    let mut pass = true;
    for (i, engine) in stack.sims.iter().enumerate().rev() {
        let doc = document(seed + i as u32, 700);
        let body = |q: &str| json!({"model": "qwen3", "max_tokens": 1, "messages": [{"role": "system", "content": doc}, {"role": "user", "content": q}]});
        let before = stack.indexed_blocks(&engine.id)?;
        let warm = post(&engine.url("/v1/chat/completions"), body("first question").to_string(), &[])?;
        anyhow::ensure!(warm.status == 200, "warming {}: {}", engine.id, warm.body);
        let (warm_tokens, _) = usage(&warm);
        let indexed =
            wait_blocks(stack, &engine.id, "the warmed blocks", |n| n >= before + warm_tokens / u64::from(BLOCK) - 1);
        let ours_warm = kvgate_ids(artifacts, "/v1/chat/completions", &body("first question"))?;
        let ours_next = kvgate_ids(artifacts, "/v1/chat/completions", &body("a follow-up question"))?;
        let common = ours_warm.iter().zip(&ours_next).take_while(|(a, b)| a == b).count() as u64;
        let shared_blocks = common / u64::from(BLOCK);
        let reply = post(&stack.gateway("/v1/chat/completions"), body("a follow-up question").to_string(), &[])?;
        let (_, cached) = usage(&reply);
        let routed = reply.header("x-kvgate-routed-to").to_owned();
        let ok = indexed.is_ok() && routed == engine.id && cached >= shared_blocks * u64::from(BLOCK);
        pass &= ok;
        notes.push(format!(
            "{}: routed to {routed}, {cached} cached tokens (shared prefix {shared_blocks} blocks)",
            engine.id
        ));
    }
    Ok(Row {
        scenario: label,
        expected: "a prefix warmed on one engine draws the same prefix through Envoy to it, and vLLM serves it from cache (each engine)",
        measured: notes.join("; "),
        pass,
    })
}

/// Check 2a: `cache_salt` hashed as vLLM hashes it. A salted prefix warmed on one engine is
/// credited to the same tenant's request through Envoy (and vLLM serves it from cache), and
/// to no other tenant's nor to an unsalted request (vLLM finds nothing cached for them).
/// Returns the row and how many requests went through the gateway.
fn cache_salt(stack: &Stack, artifacts: &Artifacts) -> anyhow::Result<(Row, u64)> {
    let engine = &stack.sims[0];
    let doc = document(900, 700);
    let body = |salt: Option<&str>, q: &str| {
        let mut b = json!({"model": "qwen3", "max_tokens": 1, "messages": [{"role": "system", "content": doc}, {"role": "user", "content": q}]});
        if let Some(salt) = salt {
            b["cache_salt"] = json!(salt);
        }
        b
    };
    let before = stack.indexed_blocks(&engine.id)?;
    let warm = post(&engine.url("/v1/chat/completions"), body(Some("tenant-a"), "first question").to_string(), &[])?;
    anyhow::ensure!(warm.status == 200, "warming {}: {}", engine.id, warm.body);
    let (warm_tokens, _) = usage(&warm);
    let indexed =
        wait_blocks(stack, &engine.id, "the salted blocks", |n| n >= before + warm_tokens / u64::from(BLOCK) - 1);
    let ours_warm = kvgate_ids(artifacts, "/v1/chat/completions", &body(None, "first question"))?;
    let ours_next = kvgate_ids(artifacts, "/v1/chat/completions", &body(None, "a follow-up question"))?;
    let shared_blocks = ours_warm.iter().zip(&ours_next).take_while(|(a, b)| a == b).count() as u64 / u64::from(BLOCK);
    let mut notes = Vec::new();
    let mut pass = indexed.is_ok();
    let requests = [(Some("tenant-a"), true), (Some("tenant-b"), false), (None, false)];
    for (salt, credited) in requests {
        let reply = post(&stack.gateway("/v1/chat/completions"), body(salt, "a follow-up question").to_string(), &[])?;
        let (_, cached) = usage(&reply);
        let overlap: u64 = reply.header("x-kvgate-overlap-blocks").parse().unwrap_or(u64::MAX);
        let routed = reply.header("x-kvgate-routed-to").to_owned();
        let ok = reply.status == 200
            && if credited {
                routed == engine.id && overlap >= shared_blocks - 1 && cached >= shared_blocks * u64::from(BLOCK)
            } else {
                overlap == 0 && cached == 0
            };
        pass &= ok;
        notes.push(format!(
            "{}: routed to {routed} with {overlap} blocks credited, vLLM {cached} cached tokens",
            salt.unwrap_or("no salt")
        ));
    }
    let row = Row {
        scenario: "2a. cache_salt",
        expected: "a prefix warmed under one cache_salt is credited (and served from vLLM's cache) for that salt only: not for another salt, not unsalted",
        measured: format!("shared prefix {shared_blocks} blocks; {}", notes.join("; ")),
        pass,
    };
    Ok((row, requests.len() as u64))
}

/// Check 2b: every prediction the sidecar made so far, checked against what vLLM reported
/// (`usage.prompt_tokens_details.cached_tokens` and `prompt_tokens`, read by the filter from
/// each response): the `sent` requests through the gateway were each checked, the cached
/// tokens predicted for the chosen engine equal the engine's, and no prompt was counted
/// differently. Whatever was not checked is named with its reason. `before`: the counters
/// once the stack's start-up probes were counted (how many it took depends on the host).
fn predictions(stack: &Stack, before: &load::Counters, sent: u64) -> anyhow::Result<Row> {
    let tally = load::tally_since(stack, before, sent, 0, Duration::from_secs(20))?;
    Ok(Row {
        scenario: "2b. predictions",
        expected:
            "every request through the gateway checked: its cache prediction for the chosen engine equals vLLM's \
             reported cached_tokens, or misses it for a reason the engine's events show (a request decided before \
             the events of the previous one's blocks arrived); no prompt-token mismatch",
        measured: tally.summary(),
        pass: tally.checked() == sent && tally.accounted(),
    })
}

/// Check 3: reset both engines' prefix caches. vLLM queues `AllBlocksCleared` and publishes
/// it with the engine's next step, so a short request (no full block) follows the reset.
fn reset(stack: &Stack) -> anyhow::Result<Row> {
    let mut notes = Vec::new();
    let mut pass = true;
    for engine in &stack.sims {
        let before = stack.indexed_blocks(&engine.id)?;
        let reply = post(&engine.url("/reset_prefix_cache"), "", &[])?;
        let nudge = json!({"model": "qwen3", "max_tokens": 1, "prompt": "hi"});
        post(&engine.url("/v1/completions"), nudge.to_string(), &[])?;
        let emptied = wait_blocks(stack, &engine.id, "the index to empty", |n| n == 0);
        pass &= reply.status == 200 && before > 0 && emptied == Ok(0);
        notes.push(format!(
            "{}: HTTP {}, {before} blocks indexed before, {} after",
            engine.id,
            reply.status,
            emptied.unwrap_or_else(|n| n)
        ));
    }
    Ok(Row {
        scenario: "3. reset",
        expected: "POST /reset_prefix_cache publishes AllBlocksCleared (with the engine's next step); the engine's index empties",
        measured: notes.join("; "),
        pass,
    })
}

/// The distinct full blocks of the chat prompts sent to one engine, by kvgate's own hashes.
fn distinct_blocks(artifacts: &Artifacts, bodies: &[Value]) -> anyhow::Result<u64> {
    let chats: Vec<(&str, &Value)> = bodies.iter().map(|b| ("/v1/chat/completions", b)).collect();
    distinct_blocks_of(artifacts, &chats)
}

/// The distinct full blocks of `(path, body)` prompts, by kvgate's own hashes.
fn distinct_blocks_of(artifacts: &Artifacts, requests: &[(&str, &Value)]) -> anyhow::Result<u64> {
    let mut all = std::collections::HashSet::new();
    for (path, b) in requests {
        let ids: Vec<u32> = kvgate_ids(artifacts, path, b)?.iter().map(|t| *t as u32).collect();
        all.extend(kvgate_shared::hash::prompt_block_hashes(&ids, BLOCK as usize, kvgate_shared::hash::Salt::NONE));
    }
    Ok(all.len() as u64)
}

/// Check 4: a burst sent straight to both (freshly reset) engines; the index must hold
/// exactly the full blocks they cached. Returns the row and the expected counts.
fn events(stack: &Stack, artifacts: &Artifacts) -> anyhow::Result<(Row, Vec<u64>)> {
    let mut expected = Vec::new();
    let mut notes = Vec::new();
    let mut pass = true;
    for (i, engine) in stack.sims.iter().enumerate() {
        let bodies: Vec<Value> = (0..6)
            .map(|k| {
                let shared = document(300 + i as u32, 250);
                json!({"model": "qwen3", "max_tokens": 1, "messages": [{"role": "system", "content": shared},
                    {"role": "user", "content": document(400 + 10 * i as u32 + k, 40 + 30 * k as usize)}]})
            })
            .collect();
        for b in &bodies {
            let reply = post(&engine.url("/v1/chat/completions"), b.to_string(), &[])?;
            anyhow::ensure!(reply.status == 200, "burst on {}: {}", engine.id, reply.body);
        }
        let want = distinct_blocks(artifacts, &bodies)?;
        let got = wait_blocks(stack, &engine.id, "the burst indexed", |n| n == want);
        pass &= got.is_ok();
        notes.push(format!("{}: {} indexed, {want} cached", engine.id, got.unwrap_or_else(|n| n)));
        expected.push(want);
    }
    let row = Row {
        scenario: "4. events",
        expected: "after a burst of requests the index holds exactly the full blocks each engine cached",
        measured: notes.join("; "),
        pass,
    };
    Ok((row, expected))
}

/// Check 5: the sidecar restarts; a new request to each engine (its first message to the new
/// sidecar) replays its history, and the index is whole again: exactly the blocks the engine
/// held before, plus the full blocks of that request (a new prompt, so none were cached).
fn sidecar_restart(stack: &mut Stack, expected: &[u64]) -> anyhow::Result<Row> {
    stack.restart_sidecar()?;
    let mut notes = Vec::new();
    let mut pass = true;
    for (engine, before) in stack.sims.iter().zip(expected) {
        // At least one full block, so the engine publishes an event.
        let probe = json!({"model": "qwen3", "max_tokens": 1, "prompt": document(500 + *before as u32, 60)});
        let reply = post(&engine.url("/v1/completions"), probe.to_string(), &[])?;
        anyhow::ensure!(reply.status == 200, "the probe of {}: {}", engine.id, reply.body);
        let (probe_tokens, probe_cached) = usage(&reply);
        let probe_blocks = (probe_tokens - probe_cached) / u64::from(BLOCK);
        let want = before + probe_blocks;
        let got = wait_blocks(stack, &engine.id, "the index rebuilt", |n| n == want);
        pass &= got.is_ok();
        let got = got.unwrap_or_else(|n| n);
        notes.push(format!(
            "{}: {got} of {want} blocks ({before} before the restart + {probe_blocks} of the probe)",
            engine.id
        ));
    }
    Ok(Row {
        scenario: "5. sidecar restart",
        expected: "the restarted sidecar rebuilds each engine's blocks (replay from seq 0, then live events)",
        measured: notes.join("; "),
        pass,
    })
}

/// Check 6: restart engine `id`.
fn engine_restart(stack: &mut Stack, artifacts: &Artifacts, id: &str) -> anyhow::Result<Row> {
    let doc = document(600, 700);
    let body = |q: &str| json!({"model": "qwen3", "max_tokens": 1, "messages": [{"role": "system", "content": doc}, {"role": "user", "content": q}]});
    let before = stack.indexed_blocks(id)?;
    let warm = post(&stack.sim(id).url("/v1/chat/completions"), body("warm").to_string(), &[])?;
    let (tokens, _) = usage(&warm);
    wait_blocks(stack, id, "the warmed prefix", |n| n >= before + tokens / u64::from(BLOCK) - 1)
        .map_err(|n| anyhow::anyhow!("only {n} blocks indexed on {id}"))?;
    let seq_before = engine_seq(stack, id);
    stack.restart_sim(id)?;
    let reply = post(&stack.gateway("/v1/chat/completions"), body("after the restart").to_string(), &[])?;
    let credited: u64 = reply.header("x-kvgate-overlap-blocks").parse().unwrap_or(u64::MAX);
    // Its first event after the restart starts the sequence over: the replica is cleared.
    let probe = json!({"model": "qwen3", "max_tokens": 1, "prompt": document(601, 100)});
    post(&stack.sim(id).url("/v1/completions"), probe.to_string(), &[])?;
    let seq_after = wait_for("the restarted engine's first event", Duration::from_secs(20), || {
        engine_seq(stack, id).filter(|s| Some(*s) < seq_before)
    })
    .ok();
    // What the new engine holds: the blocks of the requests it served since its restart.
    let after = body("after the restart");
    let mut since: Vec<(&str, &Value)> = vec![("/v1/completions", &probe)];
    if reply.header("x-kvgate-routed-to") == id {
        since.push(("/v1/chat/completions", &after));
    }
    let want = distinct_blocks_of(artifacts, &since)?;
    let left = wait_blocks(stack, id, "the restarted engine's blocks", |n| n == want);
    Ok(Row {
        scenario: "6. engine restart",
        expected: "the restarted engine's seq starts over, the sidecar clears it (keeping only what the new engine stored), and the prefix it lost is credited nowhere",
        measured: format!(
            "{id}: seq {seq_before:?} before, {seq_after:?} after; the lost prefix was routed to {} with {credited} blocks credited; {} blocks indexed, {want} held by the new engine",
            reply.header("x-kvgate-routed-to"),
            left.unwrap_or_else(|n| n)
        ),
        pass: reply.status == 200 && credited == 0 && seq_after.is_some() && left.is_ok(),
    })
}

fn engine_seq(stack: &Stack, id: &str) -> Option<u64> {
    let state = stack.sidecar_state().ok()?;
    state["pools"][0]["replicas"].as_array()?.iter().find(|r| r["id"] == id)?["last_seq"].as_u64()
}

/// How the prefill engine's KV reaches the decode engine in checks 8 and 8b.
#[derive(Debug, Clone, Copy)]
enum Connector {
    /// vLLM's `ExampleConnector`: KV saved to and loaded from shared storage, keyed by the
    /// prompt. It answers the leg with no `kv_transfer_params`, so the filter counts the leg
    /// failed and the request is booked whole on its decode worker.
    Example,
    /// vLLM's `NixlConnector` (the protocol kvgate's vLLM mode speaks) over NIXL's UCX
    /// backend on CPU memory: the decode engine pulls the prefill engine's blocks.
    Nixl,
}

/// Checks 8 and 8b: prefill/decode disaggregation with vLLM's CPU build. kvgate's vLLM mode
/// sends the leg to the prefill engine and the request to the decode engine, which gets the
/// prompt's KV through `connector` and reports it as cached. What the sidecar made of the
/// decode engine's report (a class, or why it was not checked) is reported; with NIXL the
/// leg must succeed and the prediction be exact.
fn prefill_decode(setup: &Setup, artifacts: &Artifacts, connector: Connector) -> anyhow::Result<Row> {
    let config = match connector {
        Connector::Example => {
            let storage = setup.out.join("kv-storage");
            std::fs::create_dir_all(&storage)?;
            json!({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": storage}})
        }
        Connector::Nixl => json!({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}),
    }
    .to_string();
    let transfer = ["--kv-transfer-config", config.as_str()];
    let mut engines = Vec::new();
    for (id, core, role) in [("p", 0, "prefill"), ("d", 1, "decode")] {
        // NIXL's side channel: one port per engine.
        let env = [("VLLM_NIXL_SIDE_CHANNEL_PORT", free_port()?.to_string())];
        let mut engine = start_vllm(setup, Served::qwen3(setup), id, core, &transfer, &env)?;
        engine.role = Some(role.into());
        engines.push(engine);
    }
    let disaggregation = crate::stack::Disaggregation {
        mode: "vllm".into(),
        roles: vec!["prefill".into(), "decode".into()],
        keys: "min_remote_prefill_tokens = 64".into(),
    };
    let opts = StackOptions {
        name: "vllm-pd".into(),
        block_size: BLOCK,
        route_timeout_ms: 500,
        disaggregation: Some(disaggregation),
        ..Default::default()
    };
    let stack = Stack::start_with_engines(&opts, artifacts, engines)?;
    // What the sidecar made of the decode worker's report: a class, or why it was unchecked.
    let outcomes = || -> BTreeMap<&'static str, f64> {
        let text = stack.sidecar_metrics().unwrap_or_default();
        let of = |metric: &str, reason: &str| metric_sum(&text, metric, &format!("replica=\"d\",reason=\"{reason}\""));
        let classes = load::CLASSES.iter().map(|c| (*c, of("kvgate_predictions_total", c)));
        classes.chain(load::UNCHECKED.iter().map(|r| (*r, of("kvgate_predictions_unchecked_total", r)))).collect()
    };
    let before = outcomes();
    let body = json!({"model": "qwen3", "max_tokens": 4,
        "messages": [{"role": "system", "content": document(990, 700)}, {"role": "user", "content": "Split me."}]});
    let prompt = kvgate_ids(artifacts, "/v1/chat/completions", &body)?.len() as u64;
    let reply = post(&stack.gateway("/v1/chat/completions"), body.to_string(), &[])?;
    let (prompt_tokens, cached) = usage(&reply);
    let (leg, prefill_on, routed) = (
        reply.header("x-kvgate-prefill-leg").to_owned(),
        reply.header("x-kvgate-prefill-on").to_owned(),
        reply.header("x-kvgate-routed-to").to_owned(),
    );
    // Whether the decode engine got the KV: from storage, or pulled over NIXL.
    let moved = match connector {
        Connector::Example => {
            std::fs::read_to_string(setup.out.join("vllm-d.log")).unwrap_or_default().contains("External Cache Hit")
        }
        Connector::Nixl => {
            let decoder = &stack.sims[1];
            let metrics = client::client().get(decoder.url("/metrics")).send()?.text()?;
            metric_sum(&metrics, "vllm:nixl_xfer_time_seconds_count", "") >= 1.0
        }
    };
    let next_outcome = |before: &BTreeMap<&'static str, f64>| {
        wait_for("the decode worker's report checked or counted", Duration::from_secs(20), || {
            outcomes().into_iter().find(|(k, v)| *v > before.get(k).copied().unwrap_or(0.0)).map(|(k, _)| k)
        })
        .unwrap_or("none")
    };
    let outcome = next_outcome(&before);
    // With NIXL, a second prompt sharing the first's system prompt and adding more than a
    // leg's worth of its own: the prefill engine finds the shared blocks cached, and the
    // decode engine reports those hits, so the prediction checked is not zero.
    let warm = match connector {
        Connector::Example => None,
        Connector::Nixl => {
            let before = outcomes();
            let body = json!({"model": "qwen3", "max_tokens": 4, "messages": [
                {"role": "system", "content": document(990, 700)}, {"role": "user", "content": document(991, 200)}]});
            let reply = post(&stack.gateway("/v1/chat/completions"), body.to_string(), &[])?;
            let leg = reply.header("x-kvgate-prefill-leg").to_owned();
            Some((reply.status, leg, usage(&reply).1, next_outcome(&before)))
        }
    };
    let (scenario, expected, transfer_right) = match connector {
        Connector::Example => (
            "8. prefill/decode (vLLM ExampleConnector on CPU)",
            "the leg prefills on the prefill engine, the decode engine loads the prompt's KV from the connector and \
             reports it cached; kvgate's prediction for the decode worker is checked",
            true,
        ),
        Connector::Nixl => (
            "8b. prefill/decode (vLLM NixlConnector, NIXL over UCX on CPU)",
            "the leg prefills on the prefill engine and answers NixlConnector's kv_transfer_params, the decode engine \
             pulls the KV over NIXL and reports the prefill engine's cache hits as cached; kvgate's prediction for the \
             decode worker is exact, cold and with the system prompt cached (warm)",
            leg == "ok"
                && outcome == "exact"
                && warm.as_ref().is_some_and(|(status, leg, cached, outcome)| {
                    *status == 200 && leg == "ok" && *cached > 0 && *outcome == "exact"
                }),
        ),
    };
    let warm = warm.map_or(String::new(), |(status, leg, cached, outcome)| {
        format!("; warm: HTTP {status}, leg {leg:?}, {cached} reported cached, check {outcome}")
    });
    Ok(Row {
        scenario,
        expected,
        measured: format!(
            "HTTP {}; leg {leg:?} on {prefill_on:?}, decoded on {routed:?}; prompt {prompt_tokens} tokens (kvgate {prompt}), \
             {cached} reported cached, KV moved to the decode engine: {moved}; kvgate's check for the decode worker: \
             {outcome}{warm}",
            reply.status
        ),
        pass: reply.status == 200
            && prefill_on == "p"
            && routed == "d"
            && moved
            && prompt_tokens == prompt
            && transfer_right,
    })
}

/// Checks 2c–2f: concurrent clients against both Qwen3 engines.
const LOAD_CASES: [load::Case; 4] = [
    load::Case {
        name: "2c. load: 8 clients over 4 shared prefixes",
        clients: 8,
        traffic: load::Traffic::Shared { prefixes: 4, per_client: 8 },
        seed: 2000,
        max_tokens: 4,
        exact: true,
    },
    load::Case {
        name: "2d. load: 32 clients over 4 shared prefixes",
        clients: 32,
        traffic: load::Traffic::Shared { prefixes: 4, per_client: 8 },
        seed: 2100,
        max_tokens: 4,
        exact: true,
    },
    load::Case {
        name: "2e. load: 16 requests with one new prefix at once",
        clients: 16,
        traffic: load::Traffic::Burst,
        seed: 2200,
        max_tokens: 4,
        exact: true,
    },
    load::Case {
        name: "2f. load: 8 conversations growing over 4 turns",
        clients: 8,
        traffic: load::Traffic::Conversation { turns: 4 },
        seed: 2300,
        max_tokens: 16,
        exact: true,
    },
];

/// Check 7b: concurrent clients against one engine whose cache holds fewer blocks than the
/// prefixes they share, with answers long enough (160 tokens, 5 blocks) that running
/// sequences may need blocks the engine must take from others (preemption).
const EVICTION_CASE: load::Case = load::Case {
    name: "7b. load: 8 clients over 6 prefixes, a 96-block cache",
    clients: 8,
    traffic: load::Traffic::Shared { prefixes: 6, per_client: 6 },
    seed: 2400,
    max_tokens: 160,
    exact: false,
};

/// Starts the engines and the gateway, runs every check, and writes `report.md` to
/// `setup.out`. Returns the rows.
pub fn run(setup: &Setup, artifacts: &Artifacts) -> anyhow::Result<Vec<Row>> {
    std::fs::create_dir_all(&setup.out)?;
    let engines = vec![start_engine(setup, "a", 0)?, start_engine(setup, "b", 1)?];
    let opts = StackOptions { name: "vllm".into(), block_size: BLOCK, route_timeout_ms: 500, ..Default::default() };
    let mut stack = Stack::start_with_engines(&opts, artifacts, engines)?;
    let before = load::settled(&stack)?;
    let mut rows = Vec::new();
    let mut done = |row: Row| {
        eprintln!("{}", crate::faults::table(std::slice::from_ref(&row)));
        rows.push(row);
    };
    done(parity(&stack, artifacts, "qwen3", "1. parity")?);
    done(chat_forwarding(&stack, artifacts)?);
    let (row, through_gateway) = responses_and_usage(&stack, artifacts)?;
    done(row);
    done(routing(&stack, artifacts, 700, "2. routing follows the real cache")?);
    let (row, salted) = cache_salt(&stack, artifacts)?;
    done(row);
    // Check 1's and 1c's requests, check 2's follow-ups and check 2a's went through the gateway.
    let sent = parity_cases().len() as u64 + through_gateway + stack.sims.len() as u64 + salted;
    done(predictions(&stack, &before, sent)?);
    done(several_sequences(&stack, artifacts)?);
    let mut tallies = Vec::new();
    for case in LOAD_CASES {
        let (row, tally) = load::check(&stack, &case)?;
        done(row);
        tallies.push(tally);
    }
    done(load::together("2g. load: 2c–2f together", &tallies));
    done(ttft::check(&stack, "qwen3")?);
    done(ttft::check_concurrent(&stack, "qwen3", &setup.out)?);
    done(reset(&stack)?);
    let (row, expected) = events(&stack, artifacts)?;
    done(row);
    done(sidecar_restart(&mut stack, &expected)?);
    done(routing(&stack, artifacts, 800, "5b. routing after the sidecar restart")?);
    done(engine_restart(&mut stack, artifacts, "b")?);
    drop(stack);
    // A second family: Llama 3.2's tokenizer (byte-level BPE, cl100k's split, ignore_merges)
    // and its template, which prints today's date.
    let llama = Artifacts { model_dir: setup.second_model_dir.clone(), ..artifacts.clone() };
    // A small KV cache (96 blocks, 3 072 tokens), so that load evicts.
    let small = ["--num-gpu-blocks-override", "96"];
    let tiny_llama = Served { dir: &setup.second_model_dir, name: "llama", tool_parser: "llama3_json" };
    let engine = start_vllm(setup, tiny_llama, "l", 0, &small, &[])?;
    let opts = StackOptions {
        name: "vllm-llama".into(),
        model: "llama".into(),
        block_size: BLOCK,
        route_timeout_ms: 500,
        ..Default::default()
    };
    let stack = Stack::start_with_engines(&opts, &llama, vec![engine])?;
    done(parity(&stack, &llama, "llama", "7. a second family: Llama 3.2 (its template prints today's date)")?);
    done(messages_row(&stack, &llama, "llama")?);
    done(load::check(&stack, &EVICTION_CASE)?.0);
    drop(stack);
    done(prefill_decode(setup, artifacts, Connector::Example)?);
    done(prefill_decode(setup, artifacts, Connector::Nixl)?);
    Ok(rows)
}

/// The report, in Markdown.
pub fn report(rows: &[Row], facts: &str, path: &Path) -> anyhow::Result<String> {
    let text = format!("# kvgate against real vLLM\n\n{facts}\n\n{}", crate::faults::table(rows));
    std::fs::write(path, &text)?;
    Ok(text)
}
