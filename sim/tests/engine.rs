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
    // vLLM's load balancer places every child request of `n` on its own: with no rank asked
    // for, two children go one to each rank, and neither finds the other's blocks.
    let children = |topic: &str, headers: &[(&str, &str)]| {
        let body = json!({"model": "qwen3", "prompt": long_prompt(topic), "n": 2, "max_tokens": 1});
        let reply = post(&sim.url("/v1/completions"), body.to_string(), headers).unwrap();
        assert_eq!(reply.status, 200, "{}", reply.body);
        reply.json()
    };
    assert_eq!(cached(&children("spread", &[])), 0, "the last child computed the prompt on its own rank");
    let together = children("together", &[("x-data-parallel-rank", "0")]);
    assert!(cached(&together) >= 16 * 10, "on one rank the second child finds the first's blocks: {together}");
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

/// A chat's body: `document` as the system prompt, one question.
fn chat_body(document: &str, question: &str) -> Value {
    json!({"model": "qwen3", "messages": [
        {"role": "system", "content": document}, {"role": "user", "content": question}]})
}

impl Sim {
    /// `body` to `path`, answered 200.
    fn answer(&self, path: &str, body: &Value) -> Value {
        let reply = post(&self.url(path), body.to_string(), &[]).unwrap();
        assert_eq!(reply.status, 200, "{}", reply.body);
        reply.json()
    }

    /// `body` to `path`, streamed with usage: every chunk, in order.
    fn chunks(&self, path: &str, body: &Value) -> Vec<Value> {
        let mut body = body.clone();
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let reply = post(&self.url(path), body.to_string(), &[]).unwrap();
        assert_eq!(reply.status, 200, "{}", reply.body);
        let events: Vec<&str> = reply.body.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(events.last(), Some(&"data: [DONE]"), "{}", reply.body);
        let data = events[..events.len() - 1].iter().map(|e| e.strip_prefix("data: ").expect("an SSE data event"));
        data.map(|d| serde_json::from_str(d).unwrap()).collect()
    }

    /// The prompt tokens of `body` (a completion's `prompt`, or a chat's `messages`).
    fn tokens(&self, body: &Value) -> Vec<u64> {
        let counted = self.answer("/tokenize", body);
        counted["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
    }

    /// A chat about `topic` whose prompt ends inside a block, two tokens short of its end at
    /// most (so two output tokens complete no block), and its length.
    fn chat_ending_mid_block(&self, topic: &str) -> (Value, usize) {
        (0..32)
            .map(|i| chat_body(&long_prompt(topic), &format!("question {i}")))
            .map(|body| {
                let len = self.tokens(&body).len();
                (body, len)
            })
            .find(|(_, len)| (1..=14).contains(&(len % 16)))
            .expect("some question ends mid-block")
    }

    /// Blocks stored on rank 0 from now until a sentinel request's blocks come: what the
    /// requests before the sentinel stored, every hash as often as it was stored.
    fn stored_before_sentinel(&self, sentinel: &str) -> Vec<u64> {
        let first = self.tokens(&json!({"model": "qwen3", "prompt": sentinel}))[..16].to_vec();
        self.completion(sentinel, 1, &[]);
        let is_sentinel = |e: &KvEvent| matches!(e, KvEvent::BlockStored(s) if s.token_ids.iter().map(|t| u64::from(*t)).take(16).eq(first.iter().copied()));
        let seen = self.events_until(0, is_sentinel);
        seen.iter()
            .filter(|(_, e)| !is_sentinel(e))
            .flat_map(|(_, e)| match e {
                KvEvent::BlockStored(s) if s.medium.as_deref().unwrap_or("GPU") == "GPU" => s.block_hashes.clone(),
                _ => Vec::new(),
            })
            .map(|h| h.0)
            .collect()
    }

    /// A counter of `/metrics`, summed over ranks.
    fn counter(&self, name: &str) -> f64 {
        let text = client().get(self.url("/metrics")).send().unwrap().text().unwrap();
        kvgate_e2e::stack::metric_sum(&text, name, "")
    }
}

/// The `index` of each choice of a whole answer.
fn indexes(answer: &Value) -> Vec<u64> {
    answer["choices"].as_array().unwrap().iter().map(|c| c["index"].as_u64().unwrap()).collect()
}

/// `(prompt, completion, cached)` tokens of a `usage`.
fn usage_of(usage: &Value) -> (u64, u64, u64) {
    let n = |v: &Value| v.as_u64().unwrap_or_else(|| panic!("not a count: {usage}"));
    (n(&usage["prompt_tokens"]), n(&usage["completion_tokens"]), n(&usage["prompt_tokens_details"]["cached_tokens"]))
}

/// What a stream says per choice: its index's chunks with a finish reason, in order of first
/// appearance; and the final `usage`.
fn finishes(chunks: &[Value]) -> (Vec<(u64, usize)>, Value) {
    let mut seen: Vec<(u64, usize)> = Vec::new();
    for choice in chunks.iter().flat_map(|c| c["choices"].as_array().unwrap()) {
        let index = choice["index"].as_u64().unwrap();
        let finished = usize::from(!choice["finish_reason"].is_null());
        match seen.iter_mut().find(|(i, _)| *i == index) {
            Some((_, n)) => *n += finished,
            None => seen.push((index, finished)),
        }
    }
    let usage = chunks.last().unwrap()["usage"].clone();
    (seen, usage)
}

/// Cached tokens a request finds when its whole prompt of `len` tokens is cached: vLLM
/// computes at least the last token, so its last full block below `len` is as far as it hits.
fn all_but_last(len: usize) -> u64 {
    ((len - 1) / 16 * 16) as u64
}

/// `n` = 3 on a chat, as vLLM 0.32 runs it: three child requests with the prompt; the first
/// computes it and stores its blocks, the other two find them in the cache. The whole answer
/// reports the last child's cached tokens (`chat_completion_full_generator` takes the final
/// output, which `ParentRequest.get_outputs` builds in the child that finished last), the
/// stream the first output's (`chat_completion_stream_generator`); prompt tokens once,
/// completion tokens of all three choices.
#[test]
fn n_children_share_the_prompt_of_a_chat() {
    let sim = Sim::start("chat-n", 1, &[]);
    let (mut body, len) = sim.chat_ending_mid_block("children");
    body["n"] = json!(3);
    body["max_tokens"] = json!(2);
    let before = ["prompt_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total"]
        .map(|m| sim.counter(&format!("vllm:{m}")));
    let ttfts = sim.counter("vllm:time_to_first_token_seconds_count");
    let answer = sim.answer("/v1/chat/completions", &body);
    assert_eq!(indexes(&answer), vec![0, 1, 2], "{answer}");
    let texts: Vec<&str> =
        answer["choices"].as_array().unwrap().iter().map(|c| c["message"]["content"].as_str().unwrap()).collect();
    assert!(texts[0] != texts[1] && texts[1] != texts[2] && texts[0] != texts[2], "each child samples: {texts:?}");
    assert_eq!(usage_of(&answer["usage"]), (len as u64, 6, all_but_last(len)), "{answer}");
    let stored = sim.stored_before_sentinel(&long_prompt("sentinel one"));
    let mut distinct = stored.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!((stored.len(), distinct.len()), (len / 16, len / 16), "the prompt's blocks, each stored once");
    // The sentinel (one request) is in the counters too: only the children's share is checked.
    let sentinel = sim.tokens(&json!({"model": "qwen3", "prompt": long_prompt("sentinel one")})).len() as f64;
    let after = ["prompt_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total"]
        .map(|m| sim.counter(&format!("vllm:{m}")));
    let hits = 2.0 * all_but_last(len) as f64;
    assert_eq!(
        [after[0] - before[0] - sentinel, after[1] - before[1] - sentinel, after[2] - before[2]],
        [3.0 * len as f64, 3.0 * len as f64, hits],
        "three engine requests; two found the first's blocks"
    );
    assert_eq!(sim.counter("vllm:time_to_first_token_seconds_count") - ttfts, 4.0, "a first token per child");

    let (mut body, len) = sim.chat_ending_mid_block("streamed children");
    body["n"] = json!(3);
    body["max_tokens"] = json!(2);
    let chunks = sim.chunks("/v1/chat/completions", &body);
    let roles: Vec<u64> = chunks[..3].iter().map(|c| c["choices"][0]["index"].as_u64().unwrap()).collect();
    assert_eq!(roles, vec![0, 1, 2], "every choice's role first");
    assert!(chunks[..3].iter().all(|c| c["choices"][0]["delta"]["role"] == "assistant"));
    let (finished, usage) = finishes(&chunks);
    assert_eq!(finished, vec![(0, 1), (1, 1), (2, 1)], "each choice finishes once");
    assert_eq!(usage_of(&usage), (len as u64, 6, 0), "the first output is the first child's, which computed");
    let greedy = json!({"model": "qwen3", "prompt": "x", "n": 2, "temperature": 0});
    let refused = post(&sim.url("/v1/completions"), greedy.to_string(), &[]).unwrap();
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert_eq!(refused.json()["message"], "n must be 1 when using greedy sampling, got 2.");
}

/// A completion with a list of two prompts: two engine requests, a choice each (`index` 0
/// and 1). `request_output_to_completion_response` sums the prompts' tokens and reports the
/// cached tokens of the last prompt's output; the stream (`completion_stream_generator`)
/// those of the first output that arrived.
#[test]
fn a_list_of_prompts_is_a_choice_per_prompt() {
    let sim = Sim::start("prompt-list", 1, &[]);
    let (a, b) = (long_prompt("first prompt"), long_prompt("second prompt"));
    let len = |p: &str| sim.tokens(&json!({"model": "qwen3", "prompt": p})).len();
    // The second prompt is cached, the first is not.
    sim.completion(&b, 1, &[]);
    let body = json!({"model": "qwen3", "prompt": [a, b], "max_tokens": 2});
    let answer = sim.answer("/v1/completions", &body);
    assert_eq!(indexes(&answer), vec![0, 1], "{answer}");
    assert_eq!(usage_of(&answer["usage"]), ((len(&a) + len(&b)) as u64, 4, all_but_last(len(&b))), "{answer}");

    let (c, d) = (long_prompt("third prompt"), long_prompt("fourth prompt"));
    sim.completion(&d, 1, &[]);
    let chunks = sim.chunks("/v1/completions", &json!({"model": "qwen3", "prompt": [c, d], "max_tokens": 2}));
    let (finished, usage) = finishes(&chunks);
    assert_eq!(finished, vec![(0, 1), (1, 1)]);
    assert_eq!(usage_of(&usage), ((len(&c) + len(&d)) as u64, 4, 0), "the first output is the first prompt's");
}

/// Two prompts, `n` = 2: four engine requests, choice `index` = prompt · n + child. Each
/// prompt is computed and stored once; its second child finds it. The whole answer's cached
/// tokens are the second prompt's last child's; the stream's, the first output's.
#[test]
fn a_list_of_prompts_with_n_is_n_choices_per_prompt() {
    let sim = Sim::start("prompt-list-n", 1, &[]);
    let (a, b) = (long_prompt("one of two"), long_prompt("two of two"));
    let len = |p: &str| sim.tokens(&json!({"model": "qwen3", "prompt": p})).len();
    let (la, lb) = (len(&a), len(&b));
    let answer = sim.answer("/v1/completions", &json!({"model": "qwen3", "prompt": [a, b], "n": 2, "max_tokens": 1}));
    assert_eq!(indexes(&answer), vec![0, 1, 2, 3], "{answer}");
    assert_eq!(usage_of(&answer["usage"]), ((la + lb) as u64, 4, all_but_last(lb)), "{answer}");
    let stored = sim.stored_before_sentinel(&long_prompt("sentinel two"));
    let mut distinct = stored.clone();
    distinct.sort_unstable();
    distinct.dedup();
    let blocks = la / 16 + lb / 16 + usize::from(la % 16 == 0) + usize::from(lb % 16 == 0);
    assert_eq!((stored.len(), distinct.len()), (blocks, la / 16 + lb / 16), "each prompt's blocks stored once");

    let (c, d) = (long_prompt("three of four"), long_prompt("four of four"));
    let body = json!({"model": "qwen3", "prompt": [c, d], "n": 2, "max_tokens": 2});
    let chunks = sim.chunks("/v1/completions", &body);
    let (finished, usage) = finishes(&chunks);
    assert_eq!(finished, vec![(0, 1), (1, 1), (2, 1), (3, 1)]);
    assert_eq!(usage_of(&usage), ((len(&c) + len(&d)) as u64, 8, 0), "the first output is prompt 0's first child's");
}
