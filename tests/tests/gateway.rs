//! End-to-end: real Envoy + the wasm filter + the sidecar + simulated engines.
//!
//! These need the built wasm, binaries and Envoy, so they are `#[ignore]`d in a plain
//! `cargo test`; `cargo xtask test` builds and installs everything and runs them.

use std::collections::HashMap;
use std::time::Duration;

use kvgate_e2e::bench::stats::percentile;
use kvgate_e2e::client::{client, post, stream, Reply};
use kvgate_e2e::process::wait_for;
use kvgate_e2e::stack::metric_sum;
use kvgate_e2e::workload::document;
use kvgate_e2e::{Artifacts, Stack, StackOptions};
use kvgate_shared::hash::prompt_digest;
use serde_json::{json, Value};

fn start(name: &str) -> Stack {
    let opts = StackOptions { name: name.into(), ..Default::default() };
    Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts")
}

fn chat(system: &str, question: &str) -> Value {
    json!({"model": "qwen3", "max_tokens": 2, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": question}]})
}

/// 1. A prefix warmed directly on one replica pulls later requests with that prefix to it.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn warmed_prefix_attracts_requests() {
    let stack = start("affinity");
    for (seed, target) in [(1, "b"), (2, "c")] {
        let doc = document(seed, 600);
        let warm = post(&stack.sim(target).url("/v1/chat/completions"), chat(&doc, "first question").to_string(), &[])
            .unwrap();
        assert_eq!(warm.status, 200);
        let prompt_tokens = warm.json()["usage"]["prompt_tokens"].as_u64().unwrap();
        stack.wait_indexed(target, prompt_tokens / 16).unwrap();
        for i in 0..3 {
            let reply =
                stream(&stack.gateway("/v1/chat/completions"), chat(&doc, &format!("follow-up number {i}"))).unwrap();
            assert_eq!(reply.status, 200);
            assert_eq!(reply.header("x-kvgate-replica"), target, "request {i} for the prefix warmed on {target}");
            assert!(reply.cached_tokens() >= 16 * 30, "served from cache: {:?}", reply.usage);
        }
    }
    assert!(
        stack.filter_stat("kvgate.requests_total", &[("outcome", "routed")]).unwrap() >= 6,
        "the filter counts its decisions"
    );
}

/// 2. A client-sent destination header never decides the route: not for a member of the pool,
///    not for a host outside it, with or without the sidecar.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn client_destination_header_is_ignored() {
    let mut stack = start("spoof");
    let doc = document(3, 600);
    let warm = post(&stack.sim("b").url("/v1/chat/completions"), chat(&doc, "q").to_string(), &[]).unwrap();
    stack.wait_indexed("b", warm.json()["usage"]["prompt_tokens"].as_u64().unwrap() / 16).unwrap();
    let spoof = format!("127.0.0.1:{}", stack.sim("c").port);
    for i in 0..3 {
        let body = chat(&doc, &format!("spoofed {i}")).to_string();
        let reply =
            post(&stack.gateway("/v1/chat/completions"), body, &[("x-gateway-destination-endpoint", &spoof)]).unwrap();
        assert_eq!(reply.header("x-kvgate-replica"), "b", "the cache, not the client, decides");
    }
    // Fail-open path: with no decision, the header is still stripped and round robin spreads.
    stack.kill_sidecar();
    let mut served: HashMap<String, usize> = HashMap::new();
    for i in 0..6 {
        let body = chat("short", &format!("spoofed without sidecar {i}")).to_string();
        let reply =
            post(&stack.gateway("/v1/chat/completions"), body, &[("x-gateway-destination-endpoint", &spoof)]).unwrap();
        assert_eq!(reply.status, 200);
        *served.entry(reply.header("x-kvgate-replica").to_owned()).or_default() += 1;
    }
    assert!(served.get("c").copied().unwrap_or(0) < 6, "spoofed header must not pin traffic: {served:?}");
    assert!(served.len() >= 2, "fallback LB spreads requests: {served:?}");
    // A host outside the cluster is never reached, with or without the sidecar.
    let outside = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    outside.set_nonblocking(true).unwrap();
    let outside_addr = outside.local_addr().unwrap().to_string();
    for i in 0..3 {
        let body = chat("short", &format!("to an outside host {i}")).to_string();
        let reply =
            post(&stack.gateway("/v1/chat/completions"), body, &[("x-gateway-destination-endpoint", &outside_addr)])
                .unwrap();
        assert_eq!(reply.status, 200, "served by the pool");
    }
    stack.restart_sidecar().unwrap();
    // Routed by kvgate again once its circuit breaker's window is over.
    wait_for("a request routed by the restarted sidecar", Duration::from_secs(20), || {
        let body = chat("short", "to an outside host, routed").to_string();
        let reply =
            post(&stack.gateway("/v1/chat/completions"), body, &[("x-gateway-destination-endpoint", &outside_addr)])
                .unwrap();
        assert_eq!(reply.status, 200);
        (reply.header("x-kvgate-routed-to") != "fallback").then_some(())
    })
    .unwrap();
    assert!(outside.accept().is_err(), "nothing ever connected to the outside host");
}

/// 3. With the sidecar dead, every request still succeeds through the fallback LB; after five
///    failed calls the filter's circuit breaker stops asking it.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn sidecar_down_fails_open() {
    let mut stack = start("failopen");
    let routed_before = stack.filter_stat("kvgate.requests_total", &[("outcome", "routed")]).unwrap();
    stack.kill_sidecar();
    for i in 0..10 {
        let body = chat(&document(4, 100), &format!("question {i}"));
        let reply = stream(&stack.gateway("/v1/chat/completions"), body).unwrap();
        assert_eq!(reply.status, 200, "request {i}");
        assert!(!reply.header("x-kvgate-replica").is_empty());
        assert_eq!(reply.header("x-kvgate-routed-to"), "fallback");
    }
    let completion = post(
        &stack.gateway("/v1/completions"),
        json!({"model": "qwen3", "prompt": "hello", "max_tokens": 1}).to_string(),
        &[],
    )
    .unwrap();
    assert_eq!(completion.status, 200);
    stack.check_envoy().unwrap();
    let fallbacks = stack.filter_stat("kvgate.requests_total", &[("outcome", "fallback_error")]).unwrap()
        + stack.filter_stat("kvgate.requests_total", &[("outcome", "fallback_timeout")]).unwrap();
    let not_asked = stack.filter_stat("kvgate.requests_total", &[("outcome", "breaker_open")]).unwrap();
    assert!(fallbacks + not_asked >= 11, "every request fell back, and was counted: {fallbacks} + {not_asked}");
    assert!(fallbacks >= 5 && not_asked > 0, "after breaker_failures (5) failed calls the sidecar is not asked");
    assert_eq!(stack.filter_stat("kvgate.breaker_state", &[]).unwrap(), 1, "the circuit breaker is open");
    assert_eq!(stack.filter_stat("kvgate.requests_total", &[("outcome", "routed")]).unwrap(), routed_before);
}

/// 4. The filter's token count in Envoy equals the simulator's `usage.prompt_tokens`. The
///    simulator renders and tokenizes with kvgate's own code, so this checks the filter in
///    Envoy against the sidecar's renderer — kvgate against itself; check 1 of the real-vLLM
///    suite (`kvgate_e2e::vllm`) compares the same kinds of request with vLLM.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn filter_token_count_matches_the_simulator() {
    let stack = start("tokens");
    let bodies = [
        chat("You are a helpful assistant.", "What is the capital of France? 请用中文回答。"),
        json!({"model": "qwen3", "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
            {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer"},
            {"role": "user", "content": "and then? 🚀"}], "chat_template_kwargs": {"enable_thinking": false}}),
        json!({"model": "qwen3", "max_tokens": 1, "prompt": document(5, 300)}),
    ];
    for body in bodies {
        let path = if body.get("prompt").is_some() { "/v1/completions" } else { "/v1/chat/completions" };
        let reply = post(&stack.gateway(path), body.to_string(), &[]).unwrap();
        assert_eq!(reply.status, 200, "{}", reply.body);
        let engine = reply.json()["usage"]["prompt_tokens"].as_u64().unwrap();
        let filter: u64 = reply.header("x-kvgate-prompt-tokens").parse().unwrap();
        assert_eq!(filter, engine, "the filter and the simulator (kvgate's own renderer) disagree for {body}");
    }
}

/// A Hugging Face model name (`org/name`, as `vllm serve Qwen/Qwen3-0.6B` serves it) gets
/// its tokenizer, and its requests are routed by kvgate on their cache overlap.
/// Caches `body("first")`'s prompt on replica `c`, then sends three follow-ups through the
/// gateway: each must be routed to `c` on (nearly) the whole cached prefix. Returns their
/// replies.
fn follow_ups_find_their_prefix_on_c(stack: &Stack, body: impl Fn(&str) -> Value) -> Vec<kvgate_e2e::client::Streamed> {
    let warm = post(&stack.sim("c").url("/v1/chat/completions"), body("first").to_string(), &[]).unwrap();
    assert_eq!(warm.status, 200, "{}", warm.body);
    let prompt_tokens = warm.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    stack.wait_indexed("c", prompt_tokens / 16).unwrap();
    (0..3)
        .map(|i| {
            let reply = stream(&stack.gateway("/v1/chat/completions"), body(&format!("follow-up {i}"))).unwrap();
            assert_eq!(reply.status, 200);
            assert_eq!(reply.header("x-kvgate-routed-to"), "c", "routed by kvgate to the replica holding the prefix");
            let overlap: u64 = reply.header("x-kvgate-overlap-blocks").parse().unwrap();
            assert!(overlap >= prompt_tokens / 16 - 1, "the sidecar saw the cached prefix: {overlap} blocks");
            reply
        })
        .collect()
}

#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn hugging_face_model_names_are_routed_on_their_cache() {
    let model = "Qwen/Qwen3-0.6B";
    let opts = StackOptions { name: "hf-name".into(), model: model.into(), ..Default::default() };
    let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let doc = document(21, 600);
    let body = |question: &str| {
        json!({"model": model, "max_tokens": 2, "messages": [
            {"role": "system", "content": doc}, {"role": "user", "content": question}]})
    };
    for reply in follow_ups_find_their_prefix_on_c(&stack, body) {
        assert!(!reply.header("x-kvgate-prompt-tokens").is_empty(), "tokenized in the filter");
    }
    let fetches = stack.sidecar_state().unwrap()["pools"][0]["tokenizer_fetches"].as_u64().unwrap();
    assert!(fetches >= 1, "the filter fetched the tokenizer of {model}");
    // Both spellings of the name reach the same bundle.
    for path in ["/v1/models/Qwen%2FQwen3-0.6B/tokenizer", "/v1/models/Qwen/Qwen3-0.6B/tokenizer"] {
        let reply = client().get(stack.sidecar_url(path)).send().unwrap();
        assert_eq!(reply.status().as_u16(), 200, "{path}");
    }
    assert_eq!(client().get(stack.sidecar_url("/v1/models/nope/tokenizer")).send().unwrap().status().as_u16(), 404);
}

/// With `envoy_tokenizers: "none"` no Envoy worker loads a tokenizer: the sidecar tokenizes
/// every request, and routes it on its cache as exactly.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn with_no_tokenizer_in_envoy_the_sidecar_tokenizes_and_routes_on_the_cache() {
    let filter_config = serde_json::Map::from_iter([("envoy_tokenizers".to_owned(), json!("none"))]);
    let opts = StackOptions { name: "sidecar-tokenizes".into(), filter_config, ..Default::default() };
    let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let doc = document(22, 600);
    let body = |question: &str| chat(&doc, question);
    assert!(body("follow-up 0").to_string().len() < 16 << 10, "below offload_bytes: offloaded for no tokenizer");
    for reply in follow_ups_find_their_prefix_on_c(&stack, body) {
        assert_eq!(reply.header("x-kvgate-offloaded"), "true", "tokenized by the sidecar");
    }
    let fetches = stack.sidecar_state().unwrap()["pools"][0]["tokenizer_fetches"].as_u64().unwrap();
    assert_eq!(fetches, 0, "no worker fetched a tokenizer");
}

/// Requests that share one client `x-request-id` are booked and released each on its own:
/// the filter keys bookings by an id of its own, never by a header the client controls.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn a_reused_client_request_id_keys_nothing() {
    let stack = start("request-id");
    let url = stack.gateway("/v1/chat/completions");
    let replies: Vec<kvgate_e2e::client::Reply> = std::thread::scope(|s| {
        let sent: Vec<_> = (0..8)
            .map(|i| {
                let (url, body) = (&url, chat(&document(40 + i, 200), "q").to_string());
                s.spawn(move || post(url, body, &[("x-request-id", "the-same-id")]).unwrap())
            })
            .collect();
        sent.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let keys: std::collections::HashSet<&str> = replies.iter().map(|r| r.header("x-kvgate-booking-id")).collect();
    assert_eq!(keys.len(), 8, "eight bookings, eight keys: {keys:?}");
    assert!(replies.iter().all(|r| r.status == 200 && r.header("x-kvgate-routed-to") != "fallback"));
    let explained = client().get(stack.sidecar_url("/debug/explain?request=the-same-id&last=100")).send().unwrap();
    let explained: Value = serde_json::from_str(&explained.text().unwrap()).unwrap();
    assert_eq!(explained["decisions"].as_array().unwrap().len(), 8, "each was decided and kept: {explained}");
    wait_for("every booking released", Duration::from_secs(10), || {
        let pool = &stack.sidecar_state().unwrap()["pools"][0];
        let active: u64 =
            pool["replicas"].as_array().unwrap().iter().map(|r| r["active_requests"].as_u64().unwrap()).sum();
        (pool["bookings"] == 0 && active == 0).then_some(())
    })
    .unwrap();
}

/// Mixed traffic: repeated documents, streamed (with usage) and not.
fn send_repeated_documents(stack: &Stack, documents: u32, rounds: usize) -> usize {
    let url = stack.gateway("/v1/chat/completions");
    let mut sent = 0;
    for round in 0..rounds {
        for d in 0..documents {
            let body = chat(&document(60 + d, 300), &format!("question {round}"));
            let status = if round % 2 == 0 {
                post(&url, body.to_string(), &[]).unwrap().status
            } else {
                stream(&url, body).unwrap().status
            };
            assert_eq!(status, 200);
            sent += 1;
        }
    }
    sent
}

/// The pool's prediction record in `/debug/state`, once `n` requests have been checked.
fn predictions_after(stack: &Stack, n: u64) -> Value {
    wait_for("every prediction checked", Duration::from_secs(20), || {
        let prediction = stack.sidecar_state().ok()?["pools"][0]["prediction"].clone();
        (prediction["checked"].as_u64()? >= n).then_some(prediction)
    })
    .unwrap()
}

/// kvgate predicts, for every request, how many prompt tokens the engine will find cached;
/// the filter reports what the engine said (`usage`) and the sidecar checks. On a correctly
/// configured pool the predictions are exact.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn cache_predictions_match_what_the_engines_report() {
    let stack = start("predictions");
    let sent = send_repeated_documents(&stack, 3, 12);
    let prediction = predictions_after(&stack, sent as u64);
    eprintln!("predictions on a correct pool: {prediction}");
    let exact = prediction["exact"].as_u64().unwrap() as f64 / prediction["checked"].as_u64().unwrap() as f64;
    assert!(exact >= 0.99, "exact on {:.1} % of {sent} requests: {prediction}", exact * 100.0);
    assert_eq!(prediction["prompt_mismatches"], 0, "the filter counts prompts as the simulator does: {prediction}");
    assert_eq!(prediction["alarm"], false);
    let explained = client().get(stack.sidecar_url("/debug/explain?last=1")).send().unwrap().text().unwrap();
    let explained: Value = serde_json::from_str(&explained).unwrap();
    let checked = &explained["decisions"][0]["checked"];
    assert_eq!(checked["check"]["cached_error"], 0, "{explained}");
    assert!(checked["engine"]["cached_tokens"].as_u64().unwrap() > 0, "a repeated document was cached: {checked}");
    let metrics = client().get(stack.sidecar_url("/metrics")).send().unwrap().text().unwrap();
    assert!(metrics.contains("kvgate_predictions_total{"), "exported");
}

/// kvgate predicts each streamed request's time to first token and inter-token latency from
/// what its replica faces, learns each replica from what the filter measures, and checks every
/// prediction: on a steady replica they come close; slowed behind kvgate's back (its events
/// and metrics say nothing of it), the predictions miss and its TTFT and ITL alarms fire, in
/// `/debug/state` and `kvgate_{ttft,itl}_prediction_alarm`, until the models have relearned it.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn latency_predictions_come_close_and_alarm_when_a_replica_is_slowed() {
    let opts = StackOptions { name: "ttft".into(), replicas: 1, ..Default::default() };
    let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let url = stack.gateway("/v1/chat/completions");
    // Prompts of 100 to 1 000 tokens, none cached: prefill is most of each TTFT. 24 tokens
    // out: the ITL is a mean over 23 engine steps.
    let send = |i: u32| {
        let words = 60 + (i as usize * 37) % 700;
        let mut body = chat(&document(5_000 + i, words), "Summarise.");
        body["max_tokens"] = json!(24);
        let reply = stream(&url, body).unwrap();
        assert_eq!(reply.status, 200);
    };
    let pool = || stack.sidecar_state().ok().map(|s| s["pools"][0].clone());
    let alarm = |latency: &str| pool().map(|p| p["replicas"][0][latency]["alarm"] == true);
    for i in 0..60 {
        send(i);
    }
    for latency in ["ttft", "itl"] {
        let steady = wait_for("the steady replica's checks", Duration::from_secs(20), || {
            pool().map(|p| p["prediction"][latency].clone()).filter(|t| t["checked"].as_u64().is_some_and(|n| n >= 40))
        })
        .unwrap();
        eprintln!("{latency} predictions on a steady replica: {steady}");
        let close = steady["close"].as_u64().unwrap() as f64 / steady["checked"].as_u64().unwrap() as f64;
        assert!(close >= 0.9, "{latency}: close to the measurement in {:.0} % of the checks: {steady}", close * 100.0);
        assert_eq!(alarm(latency), Some(false));
        let errors = stack.latency_errors(latency, 60).unwrap();
        let (p50, p90) = (percentile(&errors, 50.0).unwrap(), percentile(&errors, 90.0).unwrap());
        eprintln!("{latency} error over {} checks: p50 {p50:.3}, p90 {p90:.3}", errors.len());
        assert!(errors.len() >= 40 && p90 <= 0.15, "{latency}: p90 within 15 %: {errors:?}");
    }
    let slowed = client().post(stack.sim("a").url("/_chaos/slowdown")).body(r#"{"factor": 4}"#).send().unwrap();
    assert_eq!(slowed.status(), 200);
    let mut sent = 60;
    let raised = wait_for("the TTFT and ITL alarms", Duration::from_secs(120), || {
        send(sent);
        sent += 1;
        (alarm("ttft")? && alarm("itl")?).then_some(())
    });
    let replica = pool().map(|p| (p["replicas"][0]["ttft"].clone(), p["replicas"][0]["itl"].clone()));
    eprintln!("after slowing the replica 4×, {} requests: {replica:?}", sent - 60);
    assert!(raised.is_ok(), "{replica:?}");
    let metrics = client().get(stack.sidecar_url("/metrics")).send().unwrap().text().unwrap();
    for latency in ["ttft", "itl"] {
        let line = format!("kvgate_{latency}_prediction_alarm{{model=\"qwen3\",replica=\"a\"}} 1");
        assert!(metrics.contains(&line), "{line}: {metrics}");
    }
}

/// Four clients at once on one replica, each pausing a random while (100 ms on average)
/// between streamed chats of 60–760 words: requests share engine steps and queue behind each
/// other's prefill. The predictions stay close — the prefill ahead drains at the speed the
/// model learned (what the engine's events do not show stored beyond that is an input of its
/// own), and the fit is for the relative error. (Before the speed and the fit, the same
/// traffic gave p50 12 % and p90 48 %.)
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn ttft_predictions_stay_close_with_concurrent_clients() {
    use rand::{Rng, SeedableRng};
    let opts = StackOptions { name: "ttft-concurrent".into(), replicas: 1, ..Default::default() };
    let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let url = stack.gateway("/v1/chat/completions");
    std::thread::scope(|s| {
        for c in 0..4u32 {
            let url = &url;
            s.spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(u64::from(c));
                for i in 0..40u32 {
                    let pause_ms = -100.0 * (1.0 - rng.random::<f64>()).ln();
                    std::thread::sleep(Duration::from_secs_f64(pause_ms / 1e3));
                    let mut body = chat(&document(20_000 + c * 1000 + i, 60 + rng.random_range(0..700)), "Summarise.");
                    body["max_tokens"] = json!(rng.random_range(8..64));
                    assert_eq!(stream(url, body).unwrap().status, 200);
                }
            });
        }
    });
    let errors = wait_for("the TTFT checks", Duration::from_secs(20), || {
        stack.latency_errors("ttft", 400).ok().filter(|e| e.len() >= 140)
    })
    .unwrap();
    let (p50, p90) = (percentile(&errors, 50.0).unwrap(), percentile(&errors, 90.0).unwrap());
    eprintln!("TTFT error with 4 concurrent clients, {} checks: p50 {p50:.3}, p90 {p90:.3}", errors.len());
    // Quiet hosts give p90 9–15 %; a host running twice as slow as usual gave 35.1 % once
    // (2026-12-06), its slow spell in the middle of the run. Before the model's fixes the same
    // traffic gave p90 48 %, and predictions of zero score 100 %.
    assert!(p50 <= 0.08 && p90 <= 0.42, "p50 {p50:.3}, p90 {p90:.3}: {errors:?}");
    let errors = stack.latency_errors("itl", 400).unwrap();
    let (p50, p90) = (percentile(&errors, 50.0).unwrap(), percentile(&errors, 90.0).unwrap());
    eprintln!("ITL error with 4 concurrent clients, {} checks: p50 {p50:.3}, p90 {p90:.3}", errors.len());
}

/// `predicted_latency` routes on the TTFT each replica's model predicts: with one of two
/// replicas slowed 3× behind kvgate's back, `kv_aware` (which sees idle replicas as equal)
/// keeps sending it half the requests, while `predicted_latency`, once it has learned both,
/// sends the fast one every request an idle fleet gets.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn predicted_latency_avoids_a_replica_slowed_behind_kvgates_back() {
    let mut shares = Vec::new();
    for policy in ["kv_aware", "predicted_latency"] {
        let name = format!("slowed-{}", policy.replace('_', "-"));
        let opts = StackOptions { name, replicas: 2, pool_policy: policy.into(), ..Default::default() };
        let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
        let slowed = client().post(stack.sim("b").url("/_chaos/slowdown")).body(r#"{"factor": 3}"#).send().unwrap();
        assert_eq!(slowed.status(), 200);
        let url = stack.gateway("/v1/chat/completions");
        let send = |i: u32| {
            let words = 60 + (i as usize * 37) % 400;
            let reply = stream(&url, chat(&document(8_000 + i, words), "Summarise.")).unwrap();
            assert_eq!(reply.status, 200);
            (reply.header("x-kvgate-routed-to").to_owned(), reply.ttft)
        };
        // Enough for both replicas' models to learn, whichever way the first requests go.
        for i in 0..40 {
            send(i);
        }
        let measured: Vec<(String, Duration)> = (40..80).map(send).collect();
        let to_slow = measured.iter().filter(|(replica, _)| replica == "b").count();
        let mean_ttft = measured.iter().map(|(_, t)| t.as_secs_f64()).sum::<f64>() / measured.len() as f64;
        eprintln!("{policy}: {to_slow} of 40 requests to the slowed replica, mean TTFT {:.1} ms", mean_ttft * 1e3);
        shares.push(to_slow);
    }
    assert!(shares[0] >= 8, "kv_aware sees two idle replicas alike: {shares:?}");
    assert!(shares[1] <= 2, "predicted_latency avoids the slowed one: {shares:?}");
}

/// A pool configured with another block size than its engines' never gets the cache right;
/// kvgate says so: the alarm in `/debug/state` and `kvgate_prediction_alarm`.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn a_wrong_block_size_raises_the_prediction_alarm() {
    let opts = StackOptions { name: "wrong-block-size".into(), pool_block_size: Some(32), ..Default::default() };
    let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let sent = send_repeated_documents(&stack, 2, 20);
    let prediction = predictions_after(&stack, sent as u64);
    eprintln!("predictions with the wrong block size: {prediction}");
    assert_eq!(prediction["alarm"], true, "{prediction}");
    assert!(
        prediction["under"].as_u64().unwrap() >= 32,
        "the engines found cached what kvgate could not: {prediction}"
    );
    let metrics = client().get(stack.sidecar_url("/metrics")).send().unwrap().text().unwrap();
    assert!(metrics.contains("kvgate_prediction_alarm{model=\"qwen3\"} 1"), "{metrics}");
}

/// Engines that do not report cached tokens (vLLM without `--enable-prompt-tokens-details`,
/// its default) leave kvgate's predictions unchecked: counted as such, shown per replica, and
/// no alarm — where reading the missing field as 0 cached would call every hit a miss.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn engines_without_cached_token_reports_raise_no_alarm() {
    let opts = StackOptions { name: "no-cache-report".into(), prompt_tokens_details: false, ..Default::default() };
    let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let sent = send_repeated_documents(&stack, 2, 20) as u64;
    let state = wait_for("every request counted unchecked", Duration::from_secs(20), || {
        let state = stack.sidecar_state().ok()?;
        let unchecked = state["pools"][0]["prediction"]["unchecked"]["no_cached_tokens"].as_u64()?;
        (unchecked >= sent).then_some(state)
    })
    .unwrap();
    let pool = &state["pools"][0];
    eprintln!("engines without cached-token reports: {}", pool["prediction"]);
    assert_eq!(pool["prediction"]["checked"], 0, "nothing compared with a missing field: {pool}");
    assert_eq!(pool["prediction"]["alarm"], false, "{pool}");
    assert_eq!(pool["prediction"]["prompt_mismatches"], 0, "prompt counts are still checked: {pool}");
    let reporting: Vec<&Value> =
        pool["replicas"].as_array().unwrap().iter().map(|r| &r["reports_cached_tokens"]).collect();
    assert!(reporting.iter().all(|r| **r != true), "no replica reports cached tokens: {reporting:?}");
    assert!(reporting.iter().any(|r| **r == false), "the replicas that served say so: {reporting:?}");
    let metrics = stack.sidecar_metrics().unwrap();
    assert!(
        metrics.contains("kvgate_prediction_alarm{model=\"qwen3\"} 0") || !metrics.contains("kvgate_prediction_alarm{")
    );
    // Every request counted, the stack's start-up probe too.
    assert_eq!(
        kvgate_e2e::stack::metric_sum(&metrics, "kvgate_predictions_unchecked_total", "reason=\"no_cached_tokens\"")
            as u64,
        pool["prediction"]["unchecked"]["no_cached_tokens"].as_u64().unwrap(),
        "{metrics}"
    );
    assert!(metrics.contains("kvgate_engine_reports_cached_tokens{"), "{metrics}");
    let log = std::fs::read_to_string(stack.dir.join("sidecar.log")).unwrap_or_default();
    assert!(log.contains("--enable-prompt-tokens-details"), "one log line names the flag");
}

/// A client that streams without asking for usage gets exactly the stream it asked for, and
/// kvgate still checks its prediction: the filter asked the engine for usage on its behalf and
/// took that event back out.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn streams_without_usage_are_checked_and_reach_the_client_as_asked() {
    let stack = start("usage-on-behalf");
    let url = stack.gateway("/v1/chat/completions");
    let rounds = 8;
    for round in 0..rounds {
        let mut body = chat(&document(80 + round % 2, 300), &format!("question {round}"));
        body["stream"] = json!(true);
        let reply = post(&url, body.to_string(), &[]).unwrap();
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_ne!(reply.header("x-kvgate-routed-to"), "fallback");
        let events: Vec<&str> = reply.body.split("\n\n").filter(|e| !e.is_empty()).collect();
        assert_eq!(events.last(), Some(&"data: [DONE]"), "{}", reply.body);
        assert!(events.len() >= 3, "the tokens are all there: {}", reply.body);
        assert!(!reply.body.contains("\"usage\""), "no usage event the client did not ask for: {}", reply.body);
    }
    let prediction = predictions_after(&stack, rounds as u64);
    eprintln!("predictions on streams that asked for no usage: {prediction}");
    assert_eq!(prediction["exact"], prediction["checked"], "every stream checked, and exact: {prediction}");
    // A client that asks for usage still gets it.
    let asked = stream(&url, chat(&document(80, 300), "one more")).unwrap();
    assert!(asked.usage.is_some_and(|u| u["prompt_tokens"].as_u64().unwrap() > 300));
}

/// `/v1/responses` is routed on its cache and its prediction checked against the engine's
/// `input_tokens_details.cached_tokens`, streamed or not. The simulator renders with kvgate's
/// code, so the prompt count here is kvgate against itself; vLLM's own rendering is checked by
/// the real-vLLM suite (check 1c) and the vectors of `shared/tests`.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn responses_requests_are_routed_on_their_cache() {
    let stack = start("responses");
    let doc = document(23, 600);
    let body = |question: &str| {
        json!({"model": "qwen3", "max_output_tokens": 2, "instructions": doc,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": question}]}]})
    };
    let warm = post(&stack.sim("c").url("/v1/responses"), body("first").to_string(), &[]).unwrap();
    assert_eq!(warm.status, 200, "{}", warm.body);
    let input_tokens = warm.json()["usage"]["input_tokens"].as_u64().unwrap();
    stack.wait_indexed("c", input_tokens / 16).unwrap();
    for i in 0..4 {
        let mut request = body(&format!("follow-up {i}"));
        request["stream"] = json!(i % 2 == 1);
        let reply = post(&stack.gateway("/v1/responses"), request.to_string(), &[]).unwrap();
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(reply.header("x-kvgate-routed-to"), "c", "routed by kvgate to the replica holding the prefix");
        let overlap: u64 = reply.header("x-kvgate-overlap-blocks").parse().unwrap();
        assert!(overlap >= input_tokens / 16 - 1, "the sidecar saw the cached prefix: {overlap} blocks");
        let engine_count = if i % 2 == 1 {
            let completed = reply.body.split("\n\n").find(|e| e.starts_with("event: response.completed")).unwrap();
            let data: Value = serde_json::from_str(completed.split_once("data: ").unwrap().1).unwrap();
            data["response"]["usage"]["input_tokens"].as_u64().unwrap()
        } else {
            reply.json()["usage"]["input_tokens"].as_u64().unwrap()
        };
        let filter_count: u64 = reply.header("x-kvgate-prompt-tokens").parse().unwrap();
        assert_eq!(filter_count, engine_count, "the filter renders the request as the simulator (kvgate's code) does");
    }
    let prediction = predictions_after(&stack, 4);
    assert_eq!(prediction["exact"], prediction["checked"], "{prediction}");
    assert_eq!(prediction["prompt_mismatches"], 0, "{prediction}");
}

/// Anthropic's `/v1/messages` is routed on its cache and its prediction checked against the
/// engine's `usage` (`input_tokens` plus `cache_read_input_tokens`), streamed or not. As for
/// Responses, the simulator renders with kvgate's code; vLLM's own conversion is checked by the
/// vectors of `shared/tests/messages.rs` and by the real-vLLM suite (check 1c).
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn messages_requests_are_routed_on_their_cache() {
    let stack = start("messages");
    let doc = document(29, 600);
    let body = |question: &str| {
        json!({"model": "qwen3", "max_tokens": 2,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=a1"}, {"type": "text", "text": doc}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": question}]}]})
    };
    let prompt = |usage: &Value| {
        usage["input_tokens"].as_u64().unwrap() + usage["cache_read_input_tokens"].as_u64().unwrap_or(0)
    };
    let warm = post(&stack.sim("b").url("/v1/messages"), body("first").to_string(), &[]).unwrap();
    assert_eq!(warm.status, 200, "{}", warm.body);
    let prompt_tokens = prompt(&warm.json()["usage"]);
    stack.wait_indexed("b", prompt_tokens / 16).unwrap();
    for i in 0..4 {
        let mut request = body(&format!("follow-up {i}"));
        request["stream"] = json!(i % 2 == 1);
        // Claude Code's billing header changes every request; vLLM drops it, and so does kvgate.
        request["system"][0]["text"] = json!(format!("x-anthropic-billing-header: cch={i}"));
        let reply = post(&stack.gateway("/v1/messages"), request.to_string(), &[]).unwrap();
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(reply.header("x-kvgate-routed-to"), "b", "routed by kvgate to the replica holding the prefix");
        let overlap: u64 = reply.header("x-kvgate-overlap-blocks").parse().unwrap();
        assert!(overlap >= prompt_tokens / 16 - 1, "the sidecar saw the cached prefix: {overlap} blocks");
        let engine_count = if i % 2 == 1 {
            let delta = reply.body.split("\n\n").find(|e| e.starts_with("event: message_delta")).unwrap();
            let data: Value = serde_json::from_str(delta.split_once("data: ").unwrap().1).unwrap();
            prompt(&data["usage"])
        } else {
            prompt(&reply.json()["usage"])
        };
        let filter_count: u64 = reply.header("x-kvgate-prompt-tokens").parse().unwrap();
        assert_eq!(filter_count, engine_count, "the filter renders the request as the simulator (kvgate's code) does");
    }
    let prediction = predictions_after(&stack, 4);
    assert_eq!(prediction["exact"], prediction["checked"], "{prediction}");
    assert_eq!(prediction["prompt_mismatches"], 0, "{prediction}");
}

/// A streamed chat of `max_tokens` about document `seed`, its headers read and its body left
/// to read: a request that stays in flight while the test looks at the sidecar.
fn open_stream(url: &str, seed: u32, max_tokens: u32) -> reqwest::blocking::Response {
    let mut body = chat(&document(seed, 100), "go on");
    body["max_tokens"] = json!(max_tokens);
    body["stream"] = json!(true);
    client().post(url).header("content-type", "application/json").body(body.to_string()).send().unwrap()
}

/// Envoy retries a request that kvgate sent to an engine that just died on another engine:
/// the booking follows the request, so its load is counted where it runs and nothing stays
/// booked on the dead host.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn a_retried_request_is_booked_where_it_ran() {
    let mut stack = start("ran-on");
    let url = stack.gateway("/v1/chat/completions");
    let open = |seed: u32| open_stream(&url, seed, 1500);
    let header = |r: &reqwest::blocking::Response, name: &str| {
        r.headers().get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned()
    };
    // Two long streams keep two engines busy: kvgate sends the next request to the third.
    let busy = [open(90), open(91)];
    let busy_on: Vec<String> = busy.iter().map(|r| header(r, "x-kvgate-routed-to")).collect();
    assert_ne!(busy_on[0], busy_on[1], "the second went where nothing was booked");
    let idle = ["a", "b", "c"].into_iter().find(|id| !busy_on.iter().any(|b| b == id)).unwrap();
    stack.kill_sim(idle);
    let moved = open(92);
    assert_eq!(moved.status().as_u16(), 200);
    assert_eq!(header(&moved, "x-kvgate-routed-to"), idle, "kvgate chose the engine with nothing booked");
    let ran_on = header(&moved, "x-kvgate-replica");
    assert!(busy_on.contains(&ran_on), "Envoy ran it on a live engine: {ran_on}");
    assert!(!header(&moved, "x-kvgate-ran-on").is_empty(), "the filter saw where it ran");
    wait_for("the booking to follow the request", Duration::from_secs(5), || {
        let on = |id: &str| replica_state(&stack, id)["active_requests"].as_u64();
        (on(idle)? == 0 && on(&ran_on)? == 2).then_some(())
    })
    .unwrap();
    for r in busy.into_iter().chain([moved]) {
        let _ = r.text();
    }
    wait_for("every booking released", Duration::from_secs(10), || {
        (stack.sidecar_state().ok()?["pools"][0]["bookings"] == 0).then_some(())
    })
    .unwrap();
}

/// Lifecycle reports that cannot reach the sidecar are sent again: streams that end while
/// the sidecar is down have their reports delivered once it is back, and no booking is left.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn lifecycle_reports_are_delivered_after_a_sidecar_outage() {
    let mut stack = start("redelivery");
    let url = stack.gateway("/v1/chat/completions");
    let open = |seed: u32| open_stream(&url, seed, 800);
    let streams = [open(110), open(111)];
    assert!(streams.iter().all(|r| r.status().as_u16() == 200));
    stack.kill_sidecar();
    // They end while the sidecar is down: their reports cannot be delivered now.
    for s in streams {
        assert!(s.text().unwrap().contains("[DONE]"), "the engines answer without kvgate");
    }
    stack.restart_sidecar().unwrap();
    let delivered = || -> Option<u64> {
        let metrics = client().get(stack.sidecar_url("/metrics")).send().ok()?.text().ok()?;
        let line =
            metrics.lines().find(|l| l.starts_with(r#"kvgate_lifecycle_events_total{kind="done",known="false"}"#))?;
        line.rsplit(' ').next()?.parse().ok()
    };
    wait_for("the reports sent during the outage", Duration::from_secs(20), || delivered().filter(|n| *n >= 2))
        .unwrap();
    assert_eq!(stack.sidecar_state().unwrap()["pools"][0]["bookings"], 0, "nothing booked is left over");
}

/// A non-streamed response's first byte is its last: its prefill is booked until the
/// sidecar's estimate of its end (prompt tokens at the pool's prefill rate), not for the whole
/// generation, while the request itself stays booked until it ends.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn a_non_streamed_prefill_ends_on_its_estimate() {
    let opts = StackOptions {
        name: "non-streamed".into(),
        replicas: 1,
        // 20 ms steps: 200 output tokens take 4 s; 1 000 prefill tokens/s until learned.
        sim_args: ["--preset", "test", "--step-base-us", "20000"].map(String::from).to_vec(),
        pool_toml: "prefill_tokens_per_sec = 1000".into(),
        ..Default::default()
    };
    let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let gauge = |name: &str| -> Option<f64> {
        stack.sidecar_metrics().ok().map(|text| metric_sum(&text, &format!("kvgate_{name}"), ""))
    };
    let mut body = chat(&document(130, 1000), "summarise it");
    body["max_tokens"] = 200.into();
    let url = stack.gateway("/v1/chat/completions");
    let request = std::thread::spawn(move || post(&url, body.to_string(), &[]));
    let booked = wait_for("the booking, prefill counted", Duration::from_secs(10), || {
        gauge("prefill_tokens").filter(|n| *n > 0.0)
    })
    .unwrap();
    assert!(booked > 1000.0, "its prompt's prefill is booked: {booked}");
    wait_for("its prefill to end on the estimate", Duration::from_secs(10), || {
        (gauge("prefill_tokens") == Some(0.0)).then_some(())
    })
    .unwrap();
    assert!(!request.is_finished(), "the answer is still being generated");
    assert_eq!(gauge("active_requests"), Some(1.0), "and the request is still booked");
    let reply = request.join().unwrap().unwrap();
    assert_eq!(reply.status, 200);
    wait_for("its release", Duration::from_secs(10), || (gauge("active_requests") == Some(0.0)).then_some(())).unwrap();
}

/// A `cache_salt` keeps tenants' caches apart in vLLM: kvgate credits a salted request only
/// with blocks cached under the same salt, and its predictions stay exact.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn cache_salts_are_credited_only_within_their_tenant() {
    let stack = start("cache-salt");
    let doc = document(120, 600);
    let salted = |salt: Option<&str>, question: &str| {
        let mut body = chat(&doc, question);
        if let Some(salt) = salt {
            body["cache_salt"] = json!(salt);
        }
        body
    };
    let warm =
        post(&stack.sim("c").url("/v1/chat/completions"), salted(Some("tenant-a"), "first").to_string(), &[]).unwrap();
    assert_eq!(warm.status, 200, "{}", warm.body);
    let prompt_tokens = warm.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    stack.wait_indexed("c", prompt_tokens / 16).unwrap();
    let url = stack.gateway("/v1/chat/completions");
    let overlap = |r: &kvgate_e2e::client::Streamed| r.header("x-kvgate-overlap-blocks").parse::<u64>().unwrap();
    let same = stream(&url, salted(Some("tenant-a"), "again")).unwrap();
    assert_eq!(same.header("x-kvgate-routed-to"), "c", "the same tenant follows its cache");
    assert!(overlap(&same) >= prompt_tokens / 16 - 1 && same.cached_tokens() > 0, "{:?}", same.usage);
    for other in [Some("tenant-b"), None] {
        let r = stream(&url, salted(other, "again")).unwrap();
        assert_eq!((overlap(&r), r.cached_tokens()), (0, 0), "{other:?} gets no credit for tenant-a's blocks");
    }
    let prediction = predictions_after(&stack, 4);
    assert_eq!(prediction["exact"], prediction["checked"], "every prediction exact: {prediction}");
}

/// 4f. A body that trailers end (HTTP/2 clients, or HTTP/1 chunked with a `Trailer`) never says
///     end-of-stream on its last chunk: the filter routes it when the trailers come, on its
///     cache like any other request.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn a_request_with_trailers_is_routed_on_its_cache() {
    use std::io::{Read, Write};
    let stack = start("trailers");
    let doc = document(31, 600);
    let warm = post(&stack.sim("c").url("/v1/chat/completions"), chat(&doc, "first").to_string(), &[]).unwrap();
    stack.wait_indexed("c", warm.json()["usage"]["prompt_tokens"].as_u64().unwrap() / 16).unwrap();
    let body = chat(&doc, "second").to_string();
    let address = stack.gateway("").trim_start_matches("http://").to_owned();
    let mut connection = std::net::TcpStream::connect(&address).unwrap();
    connection.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: {address}\r\ncontent-type: application/json\r\n\
         transfer-encoding: chunked\r\ntrailer: x-checksum\r\nconnection: close\r\n\r\n\
         {:x}\r\n{body}\r\n0\r\nx-checksum: 1234\r\n\r\n",
        body.len()
    );
    connection.write_all(request.as_bytes()).unwrap();
    let mut reply = String::new();
    connection.read_to_string(&mut reply).unwrap();
    let head = reply.split("\r\n\r\n").next().unwrap().to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("\r\nx-kvgate-routed-to: c\r\n"), "routed by kvgate to the cached replica: {head}");
    assert!(head.contains("\r\nx-kvgate-replica: c\r\n"), "and served there: {head}");
}

/// A stack of two engines whose pool has `pool_toml` (admission control), a filter that waits
/// up to 5 s for capacity (and `filter` keys), and `sim_args` on top of the test defaults.
fn admission_stack(name: &str, pool_toml: &str, filter: &[(&str, Value)], sim_args: &[&str]) -> Stack {
    let mut filter_config = serde_json::Map::new();
    filter_config.insert("admission_wait_ms".into(), 5_000.into());
    filter_config.extend(filter.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
    let mut opts = StackOptions {
        name: name.into(),
        replicas: 2,
        pool_toml: pool_toml.into(),
        filter_config,
        ..Default::default()
    };
    opts.sim_args.extend(sim_args.iter().map(|a| (*a).to_owned()));
    Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts")
}

/// A chat that keeps an engine busy: 300 words of document, 150 tokens out.
fn long_chat(seed: u32) -> Value {
    let mut body = chat(&document(seed, 300), "tell me everything");
    body["max_tokens"] = 150.into();
    body
}

/// Bookings held by the stack's pool.
fn bookings(stack: &Stack) -> Option<Value> {
    stack.sidecar_state().ok().map(|s| s["pools"][0]["bookings"].clone())
}

/// Streams two long chats, one per replica, and returns once both are booked.
fn fill_both_replicas(stack: &Stack, seeds: [u32; 2]) -> [std::thread::JoinHandle<kvgate_e2e::client::Streamed>; 2] {
    let url = stack.gateway("/v1/chat/completions");
    let running = seeds.map(|seed| {
        let (url, body) = (url.clone(), long_chat(seed));
        std::thread::spawn(move || stream(&url, body).unwrap())
    });
    wait_for("both replicas full", Duration::from_secs(10), || (bookings(stack)? == 2).then_some(())).unwrap();
    running
}

/// 4g. Admission control: with every replica saturated (one long request fills each of two
///     here), a request waits in the sidecar — paused in Envoy — and is routed when one ends;
///     one more than the queue holds gets 429 with `Retry-After` and an OpenAI error from the
///     filter. No 5xx, and nothing stays booked.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn a_saturated_pool_queues_then_sheds_with_429() {
    let stack = admission_stack(
        "admission",
        "admission = { enabled = true, kv_blocks = 10, max_queued = 1, retry_after_secs = 2 }",
        &[],
        &[],
    );
    let url = stack.gateway("/v1/chat/completions");
    let running = fill_both_replicas(&stack, [41, 42]);
    let late = [43, 44].map(|seed| {
        let (url, body) = (url.clone(), long_chat(seed).to_string());
        std::thread::spawn(move || post(&url, body, &[]).unwrap())
    });
    let first: Vec<_> = running.into_iter().map(|t| t.join().unwrap()).collect();
    let late: Vec<_> = late.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(first.iter().all(|r| r.status == 200), "{:?}", first.iter().map(|r| r.status).collect::<Vec<_>>());
    let mut statuses: Vec<u16> = late.iter().map(|r| r.status).collect();
    statuses.sort_unstable();
    assert_eq!(statuses, [200, 429], "one waits for capacity, one more than the queue holds is shed");
    let admitted = late.iter().find(|r| r.status == 200).unwrap();
    assert_ne!(admitted.header("x-kvgate-routed-to"), "fallback", "the waiter is routed by kvgate");
    let waited_us: u64 = admitted.header("x-kvgate-decision-us").parse().unwrap();
    assert!(waited_us > 50_000, "it waited for a running request to end: {waited_us} µs");
    let shed = late.iter().find(|r| r.status == 429).unwrap();
    assert_eq!(shed.header("retry-after"), "2");
    let error = shed.json();
    assert_eq!(error["error"]["code"], "rate_limit_exceeded", "{}", shed.body);
    wait_for("nothing stays booked", Duration::from_secs(10), || (bookings(&stack)? == 0).then_some(())).unwrap();
    let metrics = stack.sidecar_metrics().unwrap();
    assert_eq!(metric_sum(&metrics, "kvgate_admission_total", "outcome=\"admitted\""), 1.0, "{metrics}");
    assert_eq!(metric_sum(&metrics, "kvgate_admission_total", "outcome=\"queue_full\""), 1.0);
}

/// 4g'. Priority classes through Envoy: with the batch class allowed only a sliver of each
///      replica and the interactive class all of it, a batch request waits behind two running
///      ones while an interactive request that comes later is routed at once. The class comes
///      from the header the operator named (`priority_header`).
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn a_higher_class_keeps_its_headroom() {
    let classes = "classes = [{ name = \"batch\", priority = 0, kv_fraction = 0.0001 }, \
                   { name = \"interactive\", priority = 10, kv_fraction = 1.0 }]";
    let pool = format!("admission = {{ enabled = true, kv_blocks = 100000, {classes} }}");
    let stack = admission_stack("admission-classes", &pool, &[("priority_header", "x-kvgate-priority".into())], &[]);
    let url = stack.gateway("/v1/chat/completions");
    let send = |seed: u32, class: &'static str| {
        let (url, body) = (url.clone(), long_chat(seed).to_string());
        std::thread::spawn(move || post(&url, body, &[("x-kvgate-priority", class)]).unwrap())
    };
    let running = [send(71, "batch"), send(72, "batch")];
    wait_for("both replicas hold a batch request", Duration::from_secs(10), || (bookings(&stack)? == 2).then_some(()))
        .unwrap();
    let batch = send(73, "batch");
    let waiting = |stack: &Stack| stack.sidecar_state().ok().map(|s| s["pools"][0]["admission_waiting"].clone());
    wait_for("the batch request waits", Duration::from_secs(10), || (waiting(&stack)? == 1).then_some(())).unwrap();
    let interactive = post(&url, long_chat(74).to_string(), &[("x-kvgate-priority", "interactive")]).unwrap();
    assert_eq!(interactive.status, 200);
    let decided_us: u64 = interactive.header("x-kvgate-decision-us").parse().unwrap();
    assert!(decided_us < 50_000, "routed at once into the headroom: {decided_us} µs");
    assert!(!batch.is_finished(), "the batch request, though it came first, still waits");
    for reply in running {
        assert_eq!(reply.join().unwrap().status, 200);
    }
    let batch = batch.join().unwrap();
    assert_eq!(batch.status, 200, "admitted once a batch request ended");
    let waited_us: u64 = batch.header("x-kvgate-decision-us").parse().unwrap();
    assert!(waited_us > decided_us, "it waited: {waited_us} µs");
}

/// 4h. A client that gives up while its request waits for capacity leaks nothing: the filter
///     reports the end, and the booking made when the wait ends is released at once.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn a_client_that_leaves_the_queue_leaks_no_booking() {
    let stack = admission_stack("admission-leave", "admission = { enabled = true, kv_blocks = 10 }", &[], &[]);
    let url = stack.gateway("/v1/chat/completions");
    let running = fill_both_replicas(&stack, [51, 52]);
    let impatient = reqwest::blocking::Client::builder().timeout(Duration::from_millis(200)).build().unwrap();
    let gave_up =
        impatient.post(&url).header("content-type", "application/json").body(long_chat(53).to_string()).send();
    assert!(gave_up.is_err(), "the client timed out while its request waited");
    let waiting = |stack: &Stack| stack.sidecar_state().ok().map(|s| s["pools"][0]["admission_waiting"].clone());
    for reply in running.map(|t| t.join().unwrap()) {
        assert_eq!(reply.status, 200);
    }
    wait_for("nothing waits or stays booked", Duration::from_secs(15), || {
        (bookings(&stack)? == 0 && waiting(&stack)? == 0).then_some(())
    })
    .unwrap();
}

/// 4i. Admission control with the engines' own KV capacity: no `kv_blocks` configured, each
///     engine's `vllm:cache_config_info` (polled with `engine_metrics_secs`) says how many
///     blocks it has, and a request that would find both full waits until one frees.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn admission_learns_each_engines_kv_capacity() {
    let pool = "engine_metrics_secs = 1\nadmission = { enabled = true, kv_fraction = 0.25 }";
    let stack = admission_stack("admission-learned", pool, &[], &["--num-gpu-blocks-override", "64"]);
    let learned = |stack: &Stack| -> Option<Vec<Value>> {
        let state = stack.sidecar_state().ok()?;
        Some(state["pools"][0]["replicas"].as_array()?.iter().map(|r| r["engine"]["kv_blocks"].clone()).collect())
    };
    wait_for("each engine's capacity read", Duration::from_secs(10), || {
        (learned(&stack)? == [Value::from(64), Value::from(64)]).then_some(())
    })
    .unwrap();
    let url = stack.gateway("/v1/chat/completions");
    let running = fill_both_replicas(&stack, [61, 62]);
    let saturated = stack.sidecar_state().unwrap()["pools"][0]["replicas"][0]["saturated"].clone();
    assert_eq!(saturated, true, "a quarter of 64 blocks booked");
    let third = post(&url, long_chat(63).to_string(), &[]).unwrap();
    for reply in running.map(|t| t.join().unwrap()) {
        assert_eq!(reply.status, 200);
    }
    assert_eq!(third.status, 200, "{}", third.body);
    let waited_us: u64 = third.header("x-kvgate-decision-us").parse().unwrap();
    assert!(waited_us > 50_000, "it waited for capacity: {waited_us} µs");
}

/// 5. Malformed JSON passes through untouched and the engine answers 400; other methods,
///    paths and content types are not routed.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn malformed_json_reaches_the_engine() {
    let stack = start("malformed");
    for body in ["{not json", "[1,2,3]", r#"{"model":"qwen3","messages":"nope"}"#, ""] {
        let reply = post(&stack.gateway("/v1/chat/completions"), body.to_owned(), &[]).unwrap();
        assert_eq!(reply.status, 400, "body {body:?}: {}", reply.body);
        assert!(!reply.header("x-kvgate-replica").is_empty(), "answered by an engine, not by kvgate");
        assert_eq!(reply.json()["object"], "error");
    }
    assert!(
        stack.filter_stat("kvgate.requests_total", &[("outcome", "passthrough")]).unwrap() >= 2,
        "unroutable bodies are counted"
    );
    // A request for a routed model whose prompt kvgate cannot read is routed and booked on an
    // estimate of its size: here the engine refuses it, elsewhere (image parts) it serves it.
    assert!(stack.filter_stat("kvgate.requests_untokenizable_total", &[]).unwrap() >= 1);
    let image = json!({"model": "qwen3", "max_tokens": 1, "messages": [{"role": "user",
        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]});
    let reply = post(&stack.gateway("/v1/chat/completions"), image.to_string(), &[]).unwrap();
    assert!(!matches!(reply.header("x-kvgate-routed-to"), "" | "fallback"), "routed by kvgate on load");
    // A model kvgate does not route passes through untouched: the engine answers for it.
    let before = stack.filter_stat("kvgate.requests_total", &[("outcome", "passthrough")]).unwrap();
    let other = json!({"model": "someone-elses-model", "prompt": "hello", "max_tokens": 1}).to_string();
    let reply = post(&stack.gateway("/v1/completions"), other, &[]).unwrap();
    assert_eq!(reply.status, 404, "{}", reply.body);
    assert_eq!(reply.header("x-kvgate-routed-to"), "fallback");
    assert_eq!(stack.filter_stat("kvgate.requests_total", &[("outcome", "passthrough")]).unwrap(), before + 1);
    // Other methods, paths and content types are not routed (a JSON `POST` elsewhere is only
    // cleaned of transfer fields, which this one has none of): no decision, no debug headers,
    // the engine answers as it would without kvgate.
    let routed = stack.filter_stat("kvgate.requests_total", &[("outcome", "routed")]).unwrap();
    let chat = chat("sys", "q").to_string();
    let replies = [
        client().get(stack.gateway("/v1/models")).send().unwrap(),
        client()
            .post(stack.gateway("/v1/embeddings"))
            .header("content-type", "application/json")
            .body(chat.clone())
            .send()
            .unwrap(),
        client()
            .post(stack.gateway("/v1/chat/completions"))
            .header("content-type", "text/plain")
            .body(chat)
            .send()
            .unwrap(),
    ];
    let statuses: Vec<u16> = replies.iter().map(|r| r.status().as_u16()).collect();
    assert_eq!(statuses, [200, 404, 200], "the engine's own answers");
    assert!(replies[2].headers().get("x-kvgate-replica").is_some(), "a text/plain chat still reaches an engine");
    for r in &replies {
        assert!(r.headers().get("x-kvgate-routed-to").is_none(), "the filter stayed out of {}", r.url());
    }
    assert_eq!(
        stack.filter_stat("kvgate.requests_total", &[("outcome", "routed")]).unwrap(),
        routed,
        "no routing decision"
    );
}

fn replica_state(stack: &Stack, id: &str) -> Value {
    let state = stack.sidecar_state().unwrap();
    state["pools"][0]["replicas"].as_array().unwrap().iter().find(|r| r["id"] == id).unwrap().clone()
}

/// 6. Half of an engine's event messages are lost: the sidecar replays the gaps from the
///    engine's replay socket, stays healthy, and routes to the blocks it learned that way.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn lost_events_are_replayed() {
    let stack = start("replay");
    let b = stack.sim("b");
    let chaos = post(&b.url("/_chaos/events"), json!({"drop_fraction": 0.5}).to_string(), &[]).unwrap();
    assert_eq!(chaos.status, 200);
    let docs: Vec<String> = (0..6).map(|i| document(20 + i, 300)).collect();
    for doc in &docs {
        assert_eq!(post(&b.url("/v1/chat/completions"), chat(doc, "warm").to_string(), &[]).unwrap().status, 200);
    }
    // A last lossless message makes any trailing gap visible.
    post(&b.url("/_chaos/events"), json!({"drop_fraction": 0.0}).to_string(), &[]).unwrap();
    post(&b.url("/v1/chat/completions"), chat(&document(99, 300), "flush").to_string(), &[]).unwrap();
    kvgate_e2e::process::wait_for("gaps replayed", std::time::Duration::from_secs(10), || {
        let metrics = kvgate_e2e::client::client().get(stack.sidecar_url("/metrics")).send().ok()?.text().ok()?;
        metrics.contains("kvgate_kv_gaps_replayed_total{model=\"qwen3\",replica=\"b\"}").then_some(())
    })
    .unwrap();
    assert_eq!(replica_state(&stack, "b")["degraded"], false);
    for doc in &docs {
        let reply = stream(&stack.gateway("/v1/chat/completions"), chat(doc, "and now?")).unwrap();
        assert_eq!(reply.header("x-kvgate-replica"), "b", "every warmed prefix is known, dropped events included");
        assert!(reply.cached_tokens() > 0);
    }
}

/// 7. An engine's publisher restarts (seq back to 0): its old blocks leave the index before
///    the next decision.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn publisher_restart_clears_the_replica() {
    let stack = start("restart");
    let c = stack.sim("c");
    let doc = document(30, 600);
    let warm = post(&c.url("/v1/chat/completions"), chat(&doc, "warm").to_string(), &[]).unwrap();
    stack.wait_indexed("c", warm.json()["usage"]["prompt_tokens"].as_u64().unwrap() / 16).unwrap();
    assert_eq!(post(&c.url("/_chaos/restart_publisher"), String::new(), &[]).unwrap().status, 200);
    let fresh = post(&c.url("/v1/chat/completions"), chat(&document(31, 40), "new").to_string(), &[]).unwrap();
    assert_eq!(fresh.status, 200);
    // The warm-up was the old publisher's first message (seq 0 too), so `last_seq` alone
    // cannot tell the restart was seen: wait for the old blocks to leave.
    let fresh_blocks = fresh.json()["usage"]["prompt_tokens"].as_u64().unwrap() / 16;
    let indexed = || replica_state(&stack, "c")["blocks_indexed"].as_u64().unwrap();
    let seen = kvgate_e2e::process::wait_for("the restart seen", std::time::Duration::from_secs(10), || {
        (indexed() <= fresh_blocks + 1).then_some(())
    });
    assert!(seen.is_ok(), "only blocks stored after the restart remain: {} > {fresh_blocks}", indexed());
    assert_eq!(replica_state(&stack, "c")["last_seq"], 0, "the new publisher's sequence");
}

/// 8. Inside Envoy, a conversation's earlier turns come from the filter's segment cache, and
///    the token count still equals the engine's.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn repeated_turns_use_the_segment_cache() {
    let stack = start("segments");
    let mut messages = vec![json!({"role": "system", "content": document(40, 400)})];
    for turn in 0..4 {
        messages.push(json!({"role": "user", "content": format!("question {turn}")}));
        let body = json!({"model": "qwen3", "max_tokens": 1, "messages": messages});
        let reply = post(&stack.gateway("/v1/chat/completions"), body.to_string(), &[]).unwrap();
        assert_eq!(reply.status, 200);
        let engine = reply.json()["usage"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(reply.header("x-kvgate-prompt-tokens").parse::<u64>().unwrap(), engine, "turn {turn}");
        let hits: u64 = reply.header("x-kvgate-segment-hits").parse().unwrap();
        if turn > 0 {
            assert!(hits >= 2 * turn as u64, "turn {turn}: earlier turns come from the cache ({hits} hits)");
        }
        messages.push(json!({"role": "assistant", "content": format!("answer {turn}")}));
    }
}

/// 9. The benchmark harness end to end, at toy scale: three policies on fresh fleets, every
///    request completes, kvgate routes all of them itself, requests tagged with priority
///    classes are reported per class, every run is replayed above its floor, and the report
///    is written.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn bench_harness_runs_policies_side_by_side() {
    use kvgate_e2e::bench::workloads::{Mix, SharedPrefix, Workload};
    use kvgate_e2e::bench::{self, report, BenchConfig, Fleet, Knob, Policy};
    let config = BenchConfig {
        workloads: vec![Workload::SharedPrefix(SharedPrefix {
            groups: 3,
            prompts_per_group: 4,
            system_tokens: 600,
            question_tokens: 40,
            output_tokens: 6,
        })],
        policies: vec![
            Policy::EnvoyRoundRobin,
            Policy::KvgateTuned(Knob::PrefillLoadScale, 4),
            Policy::KvgateFlowControl,
        ],
        qps: vec![4.0],
        gateways: vec![1],
        repeats: 1,
        fleet: Fleet {
            replicas: 3,
            block_size: 16,
            preset: "test".into(),
            speedup: 1.0,
            gpu_blocks: 4096,
            max_num_seqs: 64,
            max_num_batched_tokens: 8192,
        },
        max_duration_s: 60.0,
        slo_ttft_s: 5.0,
        slo_itl_s: 1.0,
        trace: kvgate_e2e::repo_root().join("unused.jsonl"),
        seed: 1,
        mix: Mix::Priorities,
        peers_venv: kvgate_e2e::repo_root().join("target/peers-venv"),
        pin: false,
        engines_nice: None,
        replay: true,
    };
    let results = bench::run(&config, &Artifacts::locate("debug")).expect("the benchmark runs");
    assert_eq!(results.len(), 3);
    for r in &results {
        let s = &r.summary;
        assert_eq!((s.requests, s.ok, s.errors), (12, 12, 0), "{}: {s:?}", r.policy);
        assert!(s.ttft_p50.is_some() && s.e2e_p99.is_some() && s.output_tps > 0.0, "{}: {s:?}", r.policy);
        assert!(s.hit_ratio.is_some_and(|h| h > 0.0), "{}: the engines' counters were read", r.policy);
        assert_eq!(s.slo_attainment, 1.0, "{}: every request within the SLOs below capacity: {s:?}", r.policy);
        let (served, ceiling) = (s.hit_ratio_served.unwrap(), s.hit_ceiling.expect("every run has a ceiling"));
        assert!(served <= ceiling + 1e-9, "{}: served {served} above the ceiling {ceiling}", r.policy);
        let replayed = s.replayed.expect("every run is replayed");
        assert_eq!(replayed.requests, 12, "{}: every request served is replayed", r.policy);
        let placed = [replayed.own, replayed.round_robin, replayed.greedy];
        assert!(
            placed.iter().all(|p| replayed.floor[0] <= p[0] + 1e-9 && replayed.floor[1] <= p[1] + 1e-9),
            "{}: no placement beats the floor: {replayed:?}",
            r.policy
        );
    }
    assert_eq!(results[0].kvgate_routed, None);
    for r in &results[1..] {
        let (routed, other) = r.kvgate_routed.expect("kvgate's counters");
        assert!(
            routed == 12 && other == 0,
            "{}: kvgate routed every request itself: {routed} routed, {other} not",
            r.policy
        );
    }
    let classes: Vec<(&str, usize)> = results[2].by_tag.iter().map(|t| (t.tag.as_str(), t.summary.requests)).collect();
    assert!(
        classes.len() == 2 && classes.iter().map(|c| c.1).sum::<usize>() == 12,
        "every request in one of the two classes: {classes:?}"
    );
    assert!(
        results[2].by_tag.iter().all(|t| t.summary.ok == t.summary.requests),
        "nothing shed below capacity: {:?}",
        results[2].by_tag
    );
    let dir = Artifacts::locate("debug").sim.parent().unwrap().join("bench-smoke");
    let md = report::write(
        &dir,
        &config,
        &report::Facts {
            command: "test".into(),
            commit: "test".into(),
            machine: "test".into(),
            started: "test".into(),
        },
        &results,
    )
    .unwrap();
    assert!(md.contains("| envoy-round-robin |") && md.contains("| kvgate-kv-aware-prefill-x4 |"), "{md}");
    assert!(md.contains("| kvgate-kv-aware-flow-control | 0 | priority=interactive |"), "{md}");
    assert!(md.contains("What there was to win") && md.contains("| envoy-round-robin | 0."), "{md}");
    assert!(results.iter().all(|r| r.summary.router_cpu_ms.is_some_and(|ms| ms > 0.0)), "the routers' CPU is counted");

    // Two gateways: requests spread over both Envoys, kvgate routing every one of them.
    let two = BenchConfig {
        gateways: vec![2],
        policies: vec![Policy::EnvoyRoundRobin, Policy::Kvgate("kv_aware")],
        mix: Mix::None,
        ..config
    };
    let results = bench::run(&two, &Artifacts::locate("debug")).expect("the benchmark runs on two gateways");
    assert_eq!(results.iter().map(|r| (r.gateways, r.summary.ok)).collect::<Vec<_>>(), vec![(2, 12), (2, 12)]);
    let (routed, other) = results[1].kvgate_routed.expect("kvgate's counters");
    assert!(routed >= 12 && other == 0, "both Envoys' counters: {routed} routed, {other} not");
}

/// 10. A prompt too big to tokenize on Envoy's worker is handed to the sidecar whole, and is
///     routed by its cached prefix all the same.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn big_prompts_are_tokenized_by_the_sidecar() {
    let stack = start("offload");
    let doc = document(77, 5000);
    assert!(doc.len() > 16 << 10, "larger than the filter's default offload_bytes");
    let warm =
        post(&stack.sim("c").url("/v1/chat/completions"), chat(&doc, "first question").to_string(), &[]).unwrap();
    assert_eq!(warm.status, 200);
    let prompt_tokens = warm.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    stack.wait_indexed("c", prompt_tokens / 16).unwrap();
    for i in 0..3 {
        let reply = stream(&stack.gateway("/v1/chat/completions"), chat(&doc, &format!("follow-up {i}"))).unwrap();
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-kvgate-offloaded"), "true");
        assert_eq!(
            reply.header("x-kvgate-replica"),
            "c",
            "request {i} follows the prefix cached on c (routed to {:?}, overlap {:?}, fallbacks {:?} {:?}, decision {:?} µs)",
            reply.header("x-kvgate-routed-to"),
            reply.header("x-kvgate-overlap-blocks"),
            stack.filter_stat("kvgate.requests_total", &[("outcome", "fallback_timeout")]),
            stack.filter_stat("kvgate.requests_total", &[("outcome", "fallback_error")]),
            reply.header("x-kvgate-decision-us"),
        );
        assert!(reply.cached_tokens() >= prompt_tokens / 2, "served from cache: {:?}", reply.usage);
    }
    assert!(stack.filter_stat("kvgate.requests_offloaded_total", &[]).unwrap() >= 3);
    let small = stream(&stack.gateway("/v1/chat/completions"), chat("short", "question")).unwrap();
    assert_eq!(small.header("x-kvgate-offloaded"), "false", "small prompts are tokenized in Envoy");
}

/// Prompts the engines rendered or tokenized themselves (not given as ids).
fn prompts_tokenized(stack: &Stack) -> f64 {
    stack.sims.iter().map(|s| s.metric("kvgate_sim:prompts_tokenized_total").unwrap()).sum()
}

/// 11. Token forwarding: a completions string prompt reaches the engine as the filter's
///     token ids, so the engine tokenizes nothing, and answers (and caches) exactly as for
///     the text.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn completions_prompts_are_forwarded_as_token_ids() {
    let mut filter_config = serde_json::Map::new();
    filter_config.insert("forward_tokens".into(), true.into());
    let opts = StackOptions { name: "forward".into(), filter_config, ..Default::default() };
    let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let text = document(11, 400);
    let before = prompts_tokenized(&stack);
    let direct = post(
        &stack.sim("a").url("/v1/completions"),
        json!({"model": "qwen3", "max_tokens": 1, "prompt": text}).to_string(),
        &[],
    )
    .unwrap();
    let engine_tokens = direct.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(prompts_tokenized(&stack) - before, 1.0, "the direct text request was tokenized by the engine");
    for i in 0..3 {
        let body = json!({"model": "qwen3", "max_tokens": 2, "prompt": text});
        let reply = stream(&stack.gateway("/v1/completions"), body).unwrap();
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-kvgate-forwarded-tokens"), "true");
        let prompt_tokens = reply.usage.as_ref().and_then(|u| u["prompt_tokens"].as_u64());
        assert_eq!(prompt_tokens, Some(engine_tokens), "the same prompt, as ids");
        if i > 0 {
            assert!(reply.cached_tokens() >= engine_tokens / 2, "repeats hit the cache: {:?}", reply.usage);
        }
    }
    assert_eq!(prompts_tokenized(&stack) - before, 1.0, "forwarded prompts were not tokenized again");
    assert_eq!(stack.filter_stat("kvgate.requests_tokens_forwarded_total", &[]).unwrap(), 3);
    let chat = post(&stack.gateway("/v1/chat/completions"), chat("sys", "q").to_string(), &[]).unwrap();
    assert_eq!((chat.status, chat.header("x-kvgate-forwarded-tokens")), (200, "false"), "chats are never rewritten");
    assert_eq!(prompts_tokenized(&stack) - before, 2.0);
}

/// 11b. Token forwarding for chats: with `forward_chat_tokens`, a chat reaches the engine with
///     the filter's ids in `kv_transfer_params.prompt_token_ids` (the client's own parameters
///     are taken out first), as vLLM 0.32 takes them (check 1b of the real-vLLM suite shows vLLM does):
///     the engine renders and tokenizes nothing and counts exactly the prompt it would have
///     rendered. A chat with `echo` is left alone.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn chats_are_forwarded_as_token_ids() {
    let mut filter_config = serde_json::Map::new();
    filter_config.insert("forward_chat_tokens".into(), true.into());
    let opts = StackOptions { name: "forward-chat".into(), filter_config, ..Default::default() };
    let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let body = |extra: Value| {
        let mut b = chat(&document(12, 300), "what does it say?");
        b["max_tokens"] = 2.into();
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let (before, forwarded) =
        (prompts_tokenized(&stack), stack.filter_stat("kvgate.requests_tokens_forwarded_total", &[]).unwrap());
    let direct = post(&stack.sim("a").url("/v1/chat/completions"), body(json!({})).to_string(), &[]).unwrap();
    let engine_tokens = direct.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(prompts_tokenized(&stack) - before, 1.0, "the direct chat was rendered and tokenized by the engine");
    for i in 0..3 {
        let reply =
            stream(&stack.gateway("/v1/chat/completions"), body(json!({"kv_transfer_params": {"note": i}}))).unwrap();
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-kvgate-forwarded-tokens"), "true");
        let prompt_tokens = reply.usage.as_ref().and_then(|u| u["prompt_tokens"].as_u64());
        assert_eq!(prompt_tokens, Some(engine_tokens), "the same prompt, as ids");
    }
    assert_eq!(prompts_tokenized(&stack) - before, 1.0, "forwarded chats were not tokenized again");
    assert_eq!(stack.filter_stat("kvgate.requests_tokens_forwarded_total", &[]).unwrap() - forwarded, 3);
    let echoed = stream(&stack.gateway("/v1/chat/completions"), body(json!({"echo": true}))).unwrap();
    assert_eq!((echoed.status, echoed.header("x-kvgate-forwarded-tokens")), (200, "false"), "echo: left as text");
    assert_eq!(prompts_tokenized(&stack) - before, 2.0);
}

/// 12. Parity inside Envoy: every reference chat (`testdata/parity/qwen3-chat.json`, rendered
///     by transformers and tokenized by HF tokenizers) gets exactly the reference ids from the
///     filter running in Envoy's V8 — compared by count and digest. The simulator's count is
///     compared too, but it is kvgate's own renderer; the real-vLLM suite checks vLLM's.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn filter_in_envoy_matches_the_reference_ids() {
    let mut filter_config = serde_json::Map::new();
    filter_config.insert("offload_bytes".into(), (1 << 20).into());
    let opts = StackOptions { name: "parity".into(), filter_config, ..Default::default() };
    let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let file = kvgate_e2e::repo_root().join("testdata/parity/qwen3-chat.json");
    let (cases, failures) = parity_in_envoy(&stack, &reference_cases(&file));
    assert!(cases >= 15);
    assert!(failures.is_empty(), "{} of {cases} differ:\n{}", failures.len(), failures.join("\n"));
}

/// 12b. The same inside Envoy for a sample of the other families (those whose templates do not
///      print the date, so the vectors stay valid): DeepSeek-V3, Gemma 3, Mistral Nemo and
///      Phi-3.5, each on a stack whose engines and pool serve that family's tokenizer; and
///      gpt-oss rendered with harmony, whose system message prints today's date, so no vector
///      stays valid: there the filter in Envoy is checked against kvgate's native renderer
///      run now — kvgate against itself; the native suite holds that renderer to vLLM's own
///      vectors at their instant.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn filter_in_envoy_matches_other_families() {
    let mut filter_config = serde_json::Map::new();
    filter_config.insert("offload_bytes".into(), (1 << 20).into());
    let testdata = kvgate_e2e::repo_root().join("../shared/testdata/tokenizers");
    for family in ["deepseek-v3", "gemma-3-1b-it", "mistral-nemo-instruct-2407", "phi-3.5-mini-instruct"] {
        let artifacts = Artifacts { model_dir: testdata.join(family), ..Artifacts::locate("debug") };
        let opts = StackOptions {
            name: format!("parity-{family}"),
            model: family.into(),
            replicas: 1,
            filter_config: filter_config.clone(),
            ..Default::default()
        };
        let stack = Stack::start(&opts, &artifacts).expect("stack starts");
        let file = kvgate_e2e::repo_root().join(format!("testdata/parity/families/{family}-chat.json"));
        let (cases, failures) = parity_in_envoy(&stack, &reference_cases(&file));
        assert!(cases >= 12, "{family}: {cases} cases");
        assert!(failures.is_empty(), "{family}: {} of {cases} differ:\n{}", failures.len(), failures.join("\n"));
    }

    let family = "gpt-oss-20b";
    let artifacts = Artifacts { model_dir: testdata.join(family), ..Artifacts::locate("debug") };
    let opts = StackOptions {
        name: "parity-harmony".into(),
        model: family.into(),
        replicas: 1,
        filter_config,
        ..Default::default()
    };
    let stack = Stack::start(&opts, &artifacts).expect("stack starts");
    let file = kvgate_e2e::repo_root().join(format!("testdata/parity/families/{family}-harmony.json"));
    let (cases, failures) = parity_in_envoy(&stack, &harmony_cases_now(&testdata.join(family), &file));
    assert!(cases >= 20, "harmony: {cases} cases");
    assert!(failures.is_empty(), "harmony: {} of {cases} differ:\n{}", failures.len(), failures.join("\n"));
}

/// The cases of a reference file that render, with their ids.
fn reference_cases(file: &std::path::Path) -> Vec<(String, Value, Vec<u32>)> {
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    let cases = reference["cases"].as_array().unwrap().iter().filter(|c| c.get("ids").is_some());
    let ids = |case: &Value| case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    cases.map(|c| (c["name"].as_str().unwrap().to_owned(), c["request"].clone(), ids(c))).collect()
}

/// The cases of the harmony reference file that render, with the ids kvgate renders for them
/// natively, now.
fn harmony_cases_now(model_dir: &std::path::Path, file: &std::path::Path) -> Vec<(String, Value, Vec<u32>)> {
    use kvgate_shared::prompt::openai::{parse, Endpoint};
    use kvgate_shared::prompt::tokenizer::ModelTokenizer;
    let bundle = kvgate_shared::wire::ModelBundle::from_dir("m", model_dir, 16).unwrap();
    let tokenizer = ModelTokenizer::from_bundle(&bundle).unwrap();
    let mut cases = reference_cases(file);
    for (_, request, ids) in &mut cases {
        let mut body = request.clone();
        body["model"] = "m".into();
        *ids =
            tokenizer.prompt_tokens(&parse(Endpoint::ChatCompletions, body.to_string().as_bytes()).unwrap()).unwrap();
    }
    cases
}

/// Sends every case through the gateway; returns how many were sent and how each that differs
/// does: the filter's count and digest of the prompt ids in Envoy, and the engine's
/// `usage.prompt_tokens`, against the expected ids.
fn parity_in_envoy(stack: &Stack, cases: &[(String, Value, Vec<u32>)]) -> (usize, Vec<String>) {
    let mut failures = Vec::new();
    for (name, request, ids) in cases {
        let mut body = request.clone();
        body["model"] = stack.model.clone().into();
        body["max_tokens"] = 1.into();
        let reply = post(&stack.gateway("/v1/chat/completions"), body.to_string(), &[]).unwrap();
        assert_eq!(reply.status, 200, "{name}: {}", reply.body);
        let seen = (
            reply.header("x-kvgate-prompt-tokens").to_owned(),
            reply.header("x-kvgate-prompt-digest").to_owned(),
            reply.json()["usage"]["prompt_tokens"].as_u64(),
        );
        let expected = (ids.len().to_string(), format!("{:016x}", prompt_digest(ids)), Some(ids.len() as u64));
        if seen != expected {
            failures.push(format!("{name}: filter/engine {seen:?}, reference {expected:?}"));
        }
    }
    (cases.len(), failures)
}

/// 13. Pod-like deployment with `envoy` discovery: the sidecar learns the engines from
///     Envoy's admin API, routes on their cache, and stops choosing an engine once Envoy's
///     health checks take it out; after that no request fails.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn envoy_discovery_follows_health_checks() {
    let opts = StackOptions { name: "envoy-discovery".into(), envoy_discovery: true, ..Default::default() };
    let mut stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let ids = |stack: &Stack| -> Vec<String> {
        let state = stack.sidecar_state().unwrap_or_default();
        let replicas = state["pools"][0]["replicas"].as_array().cloned().unwrap_or_default();
        let mut ids: Vec<String> = replicas.iter().filter_map(|r| r["id"].as_str().map(str::to_owned)).collect();
        ids.sort();
        ids
    };
    let mut all: Vec<String> = stack.sims.iter().map(|s| s.endpoint().to_string()).collect();
    all.sort();
    wait_for("all engines discovered", Duration::from_secs(20), || (ids(&stack) == all).then_some(())).unwrap();

    let doc = document(21, 600);
    let warm = post(&stack.sim("b").url("/v1/chat/completions"), chat(&doc, "first").to_string(), &[]).unwrap();
    let prompt_tokens = warm.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    stack.wait_indexed(&stack.sim("b").endpoint().to_string(), prompt_tokens / 16).unwrap();
    let reply = stream(&stack.gateway("/v1/chat/completions"), chat(&doc, "second")).unwrap();
    assert_eq!(
        (reply.status, reply.header("x-kvgate-replica")),
        (200, "b"),
        "follows the cache on a discovered engine"
    );

    stack.kill_sim("b");
    let b = stack.sim("b").endpoint().to_string();
    wait_for("b leaves the pool", Duration::from_secs(20), || (!ids(&stack).contains(&b)).then_some(())).unwrap();
    for i in 0..10 {
        let reply = stream(&stack.gateway("/v1/chat/completions"), chat(&doc, &format!("after {i}"))).unwrap();
        assert_eq!(reply.status, 200, "request {i} after b left");
        assert_ne!(reply.header("x-kvgate-routed-to"), "fallback", "kvgate still routes");
        assert!(["a", "c"].contains(&reply.header("x-kvgate-replica")));
    }
}

/// 14. `prefix_affinity` (no events read): a conversation's next turn goes where the gateway
///     sent its previous one, and is served from that engine's cache.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn prefix_affinity_routes_on_the_gateways_own_history() {
    let opts =
        StackOptions { name: "affinity-approx".into(), pool_policy: "prefix_affinity".into(), ..Default::default() };
    let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    for seed in [31, 32, 33] {
        let doc = document(seed, 500);
        let first = stream(&stack.gateway("/v1/chat/completions"), chat(&doc, "first")).unwrap();
        assert_eq!(first.status, 200);
        let home = first.header("x-kvgate-replica").to_owned();
        for i in 0..2 {
            let next = stream(&stack.gateway("/v1/chat/completions"), chat(&doc, &format!("next {i}"))).unwrap();
            assert_eq!(next.header("x-kvgate-replica"), home, "turn {i} of document {seed} follows the first");
            assert!(next.header("x-kvgate-overlap-blocks").parse::<u64>().unwrap() >= 25);
            assert!(next.cached_tokens() >= 16 * 25, "served from cache: {:?}", next.usage);
        }
    }
    let state = stack.sidecar_state().unwrap();
    let events: u64 =
        state["pools"][0]["replicas"].as_array().unwrap().iter().map(|r| r["events_applied"].as_u64().unwrap()).sum();
    assert_eq!(events, 0, "the policy reads no KV events");
}

/// 15. Data-parallel engines: each rank is a target of its own. A prefix cached on rank 1 of
///     engine b draws the request to b with `X-data-parallel-rank: 1`, where the engine's
///     rank 1 serves it from its cache.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn data_parallel_ranks_are_routed_to() {
    let opts = StackOptions { name: "dp".into(), replicas: 2, data_parallel_size: 2, ..Default::default() };
    let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let doc = document(41, 600);
    let warm = post(
        &stack.sim("b").url("/v1/chat/completions"),
        chat(&doc, "first").to_string(),
        &[("x-data-parallel-rank", "1")],
    )
    .unwrap();
    assert_eq!(warm.status, 200, "{}", warm.body);
    let prompt_tokens = warm.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    stack.wait_indexed("b#1", prompt_tokens / 16).unwrap();
    let hits = |rank: &str| -> f64 {
        let text = kvgate_e2e::client::client().get(stack.sim("b").url("/metrics")).send().unwrap().text().unwrap();
        let prefix = format!("vllm:prefix_cache_hits_total{{model_name=\"qwen3\",engine=\"{rank}\"}} ");
        text.lines().find_map(|l| l.strip_prefix(&prefix)).unwrap().parse().unwrap()
    };
    let before = (hits("0"), hits("1"));
    // A client's own rank header is stripped: kvgate picks the rank.
    let reply = post(
        &stack.gateway("/v1/chat/completions"),
        chat(&doc, "second").to_string(),
        &[("x-data-parallel-rank", "0")],
    )
    .unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-kvgate-routed-to"), "b#1");
    let gained = hits("1") - before.1;
    assert!(gained >= (prompt_tokens / 2) as f64, "rank 1 served the prompt from its cache: +{gained} hit tokens");
    assert_eq!(hits("0"), before.0, "rank 0 saw nothing");
    let state = stack.sidecar_state().unwrap();
    let ids: Vec<&str> =
        state["pools"][0]["replicas"].as_array().unwrap().iter().map(|r| r["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["a#0", "a#1", "b#0", "b#1"]);
}

/// 16. Traffic that bypasses kvgate: with `engine_metrics_secs`, requests an engine runs
///     that kvgate did not book count as its load, and kvgate routes around them.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn load_from_bypassing_traffic_is_seen_in_engine_metrics() {
    let opts =
        StackOptions { name: "external".into(), pool_toml: "engine_metrics_secs = 1".into(), ..Default::default() };
    let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    // Long generations sent to engine a directly, behind kvgate's back.
    let direct: Vec<_> = (0..6)
        .map(|i| {
            let url = stack.sim("a").url("/v1/completions");
            let body = json!({"model": "qwen3", "prompt": document(50 + i, 100), "max_tokens": 4000}).to_string();
            std::thread::spawn(move || post(&url, body, &[]))
        })
        .collect();
    let external = |stack: &Stack| -> u64 {
        let state = stack.sidecar_state().unwrap_or_default();
        let replicas = state["pools"][0]["replicas"].as_array().cloned().unwrap_or_default();
        replicas.iter().find(|r| r["id"] == "a").and_then(|r| r["external_requests"].as_u64()).unwrap_or(0)
    };
    wait_for("a's external load", Duration::from_secs(15), || (external(&stack) >= 6).then_some(())).unwrap();
    for i in 0..6 {
        let reply = stream(&stack.gateway("/v1/chat/completions"), chat(&document(70 + i, 200), "q")).unwrap();
        assert_eq!(reply.status, 200);
        assert_ne!(reply.header("x-kvgate-replica"), "a", "request {i} avoids the engine busy with bypassing traffic");
    }
    drop(stack);
    for d in direct {
        let _ = d.join();
    }
}

/// 17. Decode progress: a streamed answer is reported to the sidecar at each KV block of
///     output, and every report finds its booking.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn decode_progress_is_reported_per_block_of_output() {
    let mut filter_config = serde_json::Map::new();
    filter_config.insert("decode_progress".into(), true.into());
    let opts = StackOptions { name: "progress".into(), filter_config, ..Default::default() };
    let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let mut body = chat(&document(81, 100), "count to a hundred");
    body["max_tokens"] = 64.into();
    let reply = stream(&stack.gateway("/v1/chat/completions"), body).unwrap();
    assert_eq!(reply.status, 200);
    let reports = |known: bool| -> u64 {
        let text = kvgate_e2e::client::client().get(stack.sidecar_url("/metrics")).send().unwrap().text().unwrap();
        let prefix = format!("kvgate_lifecycle_events_total{{kind=\"progress\",known=\"{known}\"}} ");
        text.lines().find_map(|l| l.strip_prefix(&prefix)).map_or(0, |v| v.parse().unwrap())
    };
    // 64 output tokens in blocks of 16: four boundaries; the last may race the end report.
    wait_for("progress reports", Duration::from_secs(10), || (reports(true) >= 3).then_some(())).unwrap();
    assert!(reports(true) <= 4);
    assert_eq!(reports(false), 0);
}

/// 18. LoRA adapters learned from the engines' `/v1/models`: an adapter loaded at run time on
///     one engine routes there only; its cached prefix never counts for the base model, but
///     does for itself; when it moves to another engine routing follows, and once no engine
///     serves it its requests pass through untouched.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn lora_adapters_are_learned_from_the_engines() {
    let mut filter_config = serde_json::Map::new();
    filter_config.insert("models_refresh_ms".into(), 300.into());
    let mut opts = StackOptions {
        name: "lora".into(),
        pool_toml: "adapters_poll_secs = 1".into(),
        filter_config,
        ..Default::default()
    };
    opts.sim_args.push("--enable-lora".into());
    let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let adapter = |sim: &str, action: &str| {
        let url = stack.sim(sim).url(&format!("/v1/{action}_lora_adapter"));
        let body = json!({"lora_name": "sql-lora", "lora_path": "/adapters/sql"}).to_string();
        let reply = post(&url, body, &[("content-type", "application/json")]).unwrap();
        assert_eq!(reply.status, 200, "{action} on {sim}: {}", reply.body);
    };
    let lora_chat = |system: &str, question: &str| {
        let mut body = chat(system, question);
        body["model"] = "sql-lora".into();
        body
    };
    let gateway = stack.gateway("/v1/chat/completions");
    let wait_routed_to = |target: &str| {
        wait_for(&format!("sql-lora routed to {target}"), Duration::from_secs(20), || {
            let reply = stream(&gateway, lora_chat("probe", "ping")).ok()?;
            (reply.status == 200 && reply.header("x-kvgate-routed-to") == target).then_some(())
        })
        .unwrap();
    };

    adapter("b", "load");
    wait_routed_to("b");
    for i in 0..6 {
        let reply = stream(&gateway, lora_chat(&document(90 + i, 100), "q")).unwrap();
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-kvgate-replica"), "b", "request {i}: only b serves the adapter");
    }
    let state = stack.sidecar_state().unwrap();
    let b = state["pools"][0]["replicas"].as_array().unwrap().iter().find(|r| r["id"] == "b").unwrap().clone();
    assert_eq!(b["adapters"], json!(["sql-lora"]));

    // The adapter's blocks are salted with its name, in the engine and in kvgate.
    let doc = document(97, 600);
    let before = stack.indexed_blocks("b").unwrap();
    let first = stream(&gateway, lora_chat(&doc, "first")).unwrap();
    let prompt_blocks = first.usage.as_ref().unwrap()["prompt_tokens"].as_u64().unwrap() / 16;
    stack.wait_indexed("b", before + prompt_blocks).unwrap();
    let base = stream(&gateway, chat(&doc, "second")).unwrap();
    assert_eq!(base.status, 200);
    assert_eq!(base.header("x-kvgate-overlap-blocks"), "0", "the adapter's cache is not the base model's");
    assert_eq!(base.cached_tokens(), 0, "nor does the engine find it");
    let again = stream(&gateway, lora_chat(&doc, "third")).unwrap();
    let overlap: u64 = again.header("x-kvgate-overlap-blocks").parse().unwrap();
    assert!(overlap + 2 >= prompt_blocks, "the adapter's own prefix counts: {overlap} of {prompt_blocks} blocks");
    assert!(again.cached_tokens() >= 16 * (prompt_blocks - 2), "and the engine serves it from cache");

    // The adapter moves from b to c: routing follows.
    adapter("c", "load");
    adapter("b", "unload");
    wait_routed_to("c");
    for i in 0..4 {
        let reply = stream(&gateway, lora_chat(&document(100 + i, 100), "q")).unwrap();
        assert_eq!(reply.header("x-kvgate-replica"), "c", "request {i} after the move");
    }

    // Gone everywhere: the filter drops it and passes its requests through untokenized (the
    // engines answer 404, as vLLM would).
    adapter("c", "unload");
    wait_for("sql-lora passed through", Duration::from_secs(20), || {
        let reply = stream(&gateway, lora_chat("probe", "ping")).ok()?;
        let untouched =
            reply.header("x-kvgate-routed-to") == "fallback" && reply.header("x-kvgate-prompt-tokens").is_empty();
        (reply.status == 404 && untouched).then_some(())
    })
    .unwrap();
}

/// 19. Abusive bodies get the documented answer, never a 5xx made by kvgate: an empty body is
///     not the filter's business; bodies it cannot parse (bytes that are not UTF-8, JSON nested
///     10 000 deep) pass through to the engine's own 400; big bodies (1 MiB of text, 8 MiB of
///     token ids, 100 000 messages) are handed to the sidecar and fall back to Envoy's
///     balancing if it cannot answer within `offload_timeout_ms`; past the 16 MiB body limit
///     Envoy answers 413 itself. kvgate keeps routing afterwards.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn abusive_bodies_get_documented_answers() {
    // Room for the sidecar to tokenize a megabyte even on a loaded CI machine: this test is
    // about what it accepts, not how fast.
    let mut filter_config = serde_json::Map::new();
    filter_config.insert("offload_timeout_ms".into(), json!(30_000));
    let opts = StackOptions { name: "abuse".into(), filter_config, ..Default::default() };
    let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let chat_url = stack.gateway("/v1/chat/completions");
    let engine_answered = |r: &kvgate_e2e::client::Reply| !r.header("x-kvgate-replica").is_empty();

    let empty = post(&chat_url, Vec::<u8>::new(), &[]).unwrap();
    assert_eq!((empty.status, engine_answered(&empty)), (400, true), "{}", empty.body);
    assert_eq!(empty.header("x-kvgate-routed-to"), "", "a request without a body is not routed");

    let mut not_utf8 = br#"{"model":"qwen3","messages":[{"role":"user","content":"caf"#.to_vec();
    not_utf8.extend([0xff, 0xfe]);
    not_utf8.extend(br#""}]}"#);
    let reply = post(&chat_url, not_utf8, &[]).unwrap();
    assert_eq!((reply.status, engine_answered(&reply)), (400, true), "{}", reply.body);
    assert_eq!(reply.header("x-kvgate-routed-to"), "fallback");

    let nested = format!(
        r#"{{"model":"qwen3","messages":[{{"role":"user","content":"x"}}],"metadata":{}{}}}"#,
        "[".repeat(10_000),
        "]".repeat(10_000)
    );
    let reply = post(&chat_url, nested, &[]).unwrap();
    assert!(reply.status < 500 && engine_answered(&reply), "{}: {}", reply.status, reply.body);
    // A request for a routed model that kvgate cannot parse is routed on an estimate.
    assert!(!matches!(reply.header("x-kvgate-routed-to"), "" | "fallback"), "booked on an estimate");

    // Too long for the engines' context, so they answer 400 once they have counted it.
    let megabyte = chat(&"word ".repeat(1 << 18), "q").to_string();
    let ids: Vec<u32> = (0..1_800_000).map(|i| 1000 + i % 5000).collect();
    let eight_megabytes = json!({"model": "qwen3", "prompt": ids, "max_tokens": 1}).to_string();
    assert!(eight_megabytes.len() > 8 << 20);
    let messages: Vec<Value> =
        (0..100_000).map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": "hi"})).collect();
    let many = json!({"model": "qwen3", "messages": messages, "max_tokens": 1}).to_string();
    for (what, url, body) in [
        ("1 MiB of text", &chat_url, megabyte),
        ("8 MiB of token ids", &stack.gateway("/v1/completions"), eight_megabytes),
        ("100 000 messages", &chat_url, many),
    ] {
        let reply = post(url, body, &[]).unwrap();
        assert_eq!((reply.status, engine_answered(&reply)), (400, true), "{what}: {}", reply.body);
        assert_eq!(reply.header("x-kvgate-offloaded"), "true", "{what} goes to the sidecar");
        let routed_to = reply.header("x-kvgate-routed-to");
        assert_eq!(routed_to, reply.header("x-kvgate-replica"), "{what}: the sidecar decided where it went");
        let last = client().get(stack.sidecar_url("/debug/explain?last=1")).send().unwrap().text().unwrap();
        let last: Value = serde_json::from_str(&last).unwrap();
        let decision = &last["decisions"][0];
        assert_eq!(decision["chosen"], routed_to, "{what}: the sidecar's last decision");
        assert!(decision["prompt_tokens"].as_u64().unwrap() > 100_000, "{what}: tokenized whole: {decision}");
    }

    let over = chat(&"a".repeat(17 << 20), "q").to_string();
    let reply = post(&chat_url, over, &[]).unwrap();
    assert_eq!((reply.status, engine_answered(&reply)), (413, false), "Envoy's own limit");

    let after = post(&chat_url, chat("after the abuse", "hello").to_string(), &[]).unwrap();
    assert_eq!(after.status, 200);
    assert!(!matches!(after.header("x-kvgate-routed-to"), "" | "fallback"), "kvgate still routes");
}

/// 37. Two gateway pods in front of one fleet: each sidecar hears the other's bookings over
///     the sync mesh, so a request through one gateway avoids the replica busy with a request
///     that came through the other (alone, each would think both replicas idle).
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn gateways_share_their_bookings_over_the_mesh() {
    let opts = StackOptions { name: "mesh".into(), replicas: 2, gateways: 2, ..Default::default() };
    let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let urls = stack.gateways("/v1/chat/completions");
    assert_eq!(urls.len(), 2);
    // Gateway 1's filter decides (its tokenizer is loaded) before the test starts: a request
    // it let Envoy balance would say nothing of the mesh.
    wait_for("gateway 1 routes", Duration::from_secs(20), || {
        let reply = post(&urls[1], chat(&document(49, 50), "warm").to_string(), &[]).ok()?;
        (reply.status == 200 && !matches!(reply.header("x-kvgate-routed-to"), "" | "fallback")).then_some(())
    })
    .unwrap();
    // A long answer through gateway 0 holds one replica (2 ms a token: ~6 s).
    let mut long = chat(&document(40, 600), "tell a long story");
    long["max_tokens"] = json!(3000);
    let first = urls[0].clone();
    let held = std::thread::spawn(move || stream(&first, long));
    let active = |state: &Value| -> Vec<(String, u64)> {
        let replicas = state["pools"][0]["replicas"].as_array().cloned().unwrap_or_default();
        replicas
            .iter()
            .map(|r| (r["id"].as_str().unwrap_or("").to_owned(), r["active_requests"].as_u64().unwrap_or(0)))
            .collect()
    };
    // Gateway 1's sidecar books it where gateway 0's did.
    let busy = wait_for("gateway 1 hears gateway 0's booking", Duration::from_secs(10), || {
        let heard = active(&stack.sidecar_state_of(1).ok()?);
        heard.into_iter().find(|(_, n)| *n == 1).map(|(id, _)| id)
    })
    .unwrap();
    let own = active(&stack.sidecar_state_of(0).unwrap());
    assert!(own.contains(&(busy.clone(), 1)), "gateway 0 booked it there: {own:?}");
    for i in 0..3 {
        let reply = post(&urls[1], chat(&document(50 + i, 600), "q").to_string(), &[]).unwrap();
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-kvgate-routed-to"), reply.header("x-kvgate-replica"), "gateway 1's sidecar chose");
        assert_ne!(reply.header("x-kvgate-replica"), busy, "request {i} through gateway 1 avoids the busy replica");
    }
    assert!(!held.is_finished(), "the long answer was still running throughout");
    let reply = held.join().unwrap().unwrap();
    assert_eq!((reply.status, reply.header("x-kvgate-replica")), (200, busy.as_str()));
}

/// 38. A gateway's sidecar restarts while the other runs, after the engines' replay buffers
///     (4 steps here) have rolled past the cached documents: it takes its peer's index and
///     bookings over before it reads an event, so its first decisions follow the documents
///     to the engines holding them, as its peer's do. (Rebuilding from replay alone, it would
///     know none of them.)
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn a_restarted_sidecar_takes_its_peers_view_over() {
    let opts = StackOptions {
        name: "handover".into(),
        replicas: 2,
        gateways: 2,
        replay_buffer_steps: Some(4),
        ..Default::default()
    };
    let mut stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let urls = stack.gateways("/v1/chat/completions");
    let docs: Vec<String> = (0..6).map(|i| document(70 + i, 400)).collect();
    let mut homes = Vec::new();
    for doc in &docs {
        let reply = post(&urls[0], chat(doc, "q").to_string(), &[]).unwrap();
        assert_eq!(reply.status, 200);
        homes.push(reply.header("x-kvgate-replica").to_owned());
    }
    // More traffic, so the engines' replay buffers hold none of the documents' steps.
    for i in 0..4 {
        assert_eq!(post(&urls[0], chat(&document(90 + i, 200), "q").to_string(), &[]).unwrap().status, 200);
    }
    let blocks = |stack: &Stack, i: usize| -> Option<u64> {
        let state = stack.sidecar_state_of(i).ok()?;
        Some(state["pools"][0]["replicas"].as_array()?.iter().filter_map(|r| r["blocks_indexed"].as_u64()).sum())
    };
    wait_for("both sidecars indexed the same blocks", Duration::from_secs(10), || {
        let (a, b) = (blocks(&stack, 0)?, blocks(&stack, 1)?);
        (a > 0 && a == b).then_some(())
    })
    .unwrap();

    stack.restart_sidecar_of(1).unwrap();
    let restored = blocks(&stack, 1).unwrap();
    assert_eq!(restored, blocks(&stack, 0).unwrap(), "gateway 1's sidecar starts with its peer's index");
    for (doc, home) in docs.iter().zip(&homes) {
        let reply = post(&urls[1], chat(doc, "q").to_string(), &[]).unwrap();
        assert_eq!(reply.status, 200);
        let overlap: u64 = reply.header("x-kvgate-overlap-blocks").parse().unwrap();
        assert_eq!(reply.header("x-kvgate-replica"), home, "the document is followed to its engine");
        assert!(overlap >= 400 / 16, "its cached blocks are credited: {overlap}");
    }
    let metrics = client().get(stack.sidecar_url_of(1, "/metrics")).send().unwrap().text().unwrap();
    assert_eq!(metric_sum(&metrics, "kvgate_handover_restored_blocks_total", ""), restored as f64);
}

/// A lone sidecar (no sync peer) killed and started again takes over the view it saved
/// (`state_file`, every second here): the engines' replay buffers have rolled over, yet it
/// starts with every block it had indexed, and follows each document to its engine.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn a_lone_sidecar_restarted_takes_its_saved_view_over() {
    let dir = std::env::temp_dir().join(format!("kvgate-saved-view-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("view.bin");
    let opts = StackOptions {
        name: "saved-view".into(),
        replicas: 2,
        replay_buffer_steps: Some(4),
        sidecar_toml: format!("state_file = \"{}\"\nstate_save_secs = 1\n", file.display()),
        ..Default::default()
    };
    let mut stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let url = stack.gateway("/v1/chat/completions");
    let docs: Vec<String> = (0..6).map(|i| document(110 + i, 400)).collect();
    let mut homes = Vec::new();
    for doc in &docs {
        let reply = post(&url, chat(doc, "q").to_string(), &[]).unwrap();
        assert_eq!(reply.status, 200);
        homes.push(reply.header("x-kvgate-replica").to_owned());
    }
    // More traffic, so the engines' replay buffers hold none of the documents' steps.
    for i in 0..4 {
        assert_eq!(post(&url, chat(&document(130 + i, 200), "q").to_string(), &[]).unwrap().status, 200);
    }
    let blocks = |stack: &Stack| -> Option<u64> {
        let state = stack.sidecar_state().ok()?;
        Some(state["pools"][0]["replicas"].as_array()?.iter().filter_map(|r| r["blocks_indexed"].as_u64()).sum())
    };
    // The index has settled once two reads a second apart agree; then a save after that.
    let mut last = None;
    let indexed = wait_for("the index settled", Duration::from_secs(20), || {
        std::thread::sleep(Duration::from_secs(1));
        let now = blocks(&stack).filter(|b| *b > 0);
        let settled = now.filter(|b| last == Some(*b));
        last = now;
        settled
    })
    .unwrap();
    let settled_at = std::time::SystemTime::now();
    let saved_after = || std::fs::metadata(&file).and_then(|m| m.modified()).is_ok_and(|t| t > settled_at);
    wait_for("a save after that", Duration::from_secs(10), || saved_after().then_some(())).unwrap();

    stack.restart_sidecar().unwrap();
    assert_eq!(blocks(&stack), Some(indexed), "the restarted sidecar starts with every block it had indexed");
    for (doc, home) in docs.iter().zip(&homes) {
        let reply = post(&url, chat(doc, "q").to_string(), &[]).unwrap();
        assert_eq!(reply.status, 200);
        let overlap: u64 = reply.header("x-kvgate-overlap-blocks").parse().unwrap();
        assert_eq!(reply.header("x-kvgate-replica"), home, "the document is followed to its engine");
        assert!(overlap >= 400 / 16, "its cached blocks are credited: {overlap}");
    }
    let metrics = stack.sidecar_metrics().unwrap();
    assert_eq!(metric_sum(&metrics, "kvgate_handover_restored_blocks_total", ""), indexed as f64);
    wait_for("it saves again as it runs", Duration::from_secs(10), || {
        let metrics = stack.sidecar_metrics().ok()?;
        let bytes = metrics.lines().find_map(|l| l.strip_prefix("kvgate_saved_view_bytes "))?;
        (bytes.parse::<f64>().ok()? > 0.0).then_some(())
    })
    .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// 39. `n` and a completion's list of prompts, through Envoy: the engine answers `n` choices
///     per prompt (the simulator runs them as vLLM 0.32 does), and the sidecar, which books
///     prompts × `n` sequences, releases every one of them when the answer ends and counts the
///     request unchecked (`several_sequences`): vLLM reports one sequence's cached tokens,
///     which no prediction can name. The real-vLLM suite (check 1d) checks the same with vLLM.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn n_choices_and_prompt_lists_are_booked_released_and_counted() {
    let stack = start("fanout");
    let several = || {
        let metrics = stack.sidecar_metrics().unwrap();
        metric_sum(&metrics, "kvgate_predictions_unchecked_total", "reason=\"several_sequences\"")
    };
    let mut three = chat(&document(95, 300), "three answers, please");
    three["n"] = json!(3);
    let two_prompts = json!({"model": "qwen3", "prompt": [document(96, 300), document(97, 300)], "max_tokens": 2});
    for (path, body, choices) in [("/v1/chat/completions", three, 3), ("/v1/completions", two_prompts, 2)] {
        let before = several();
        let reply = post(&stack.gateway(path), body.to_string(), &[]).unwrap();
        assert_eq!(reply.status, 200, "{path}: {}", reply.body);
        let answer = reply.json();
        let indexes: Vec<u64> =
            answer["choices"].as_array().unwrap().iter().map(|c| c["index"].as_u64().unwrap()).collect();
        assert_eq!(indexes, (0..choices).collect::<Vec<u64>>(), "{path}: {answer}");
        let routed = reply.header("x-kvgate-routed-to").to_owned();
        assert!(!matches!(routed.as_str(), "" | "fallback"), "{path}: kvgate routed it");
        assert_eq!(reply.header("x-kvgate-replica"), routed, "{path}: served where it was booked");
        wait_for("the bookings released", Duration::from_secs(10), || {
            let replica = replica_state(&stack, &routed);
            let idle = ["active_requests", "prefill_tokens", "active_blocks"].iter().all(|k| replica[*k] == 0);
            (idle && bookings(&stack)? == 0).then_some(())
        })
        .unwrap_or_else(|e| panic!("{path}: {e}: {}", replica_state(&stack, &routed)));
        wait_for("counted unchecked", Duration::from_secs(10), || (several() > before).then_some(())).unwrap();
        let prediction = stack.sidecar_state().unwrap()["pools"][0]["prediction"].clone();
        assert_eq!(prediction["over"].as_u64().unwrap() + prediction["under"].as_u64().unwrap(), 0, "{prediction}");
    }
}

/// A proxy-wasm module whose VM dies on the first request's headers (it traps), as a filter
/// with a bug would: Envoy then runs with the VM failed.
const FAILING_FILTER: &str = r#"(module
  (memory (export "memory") 1)
  (func (export "proxy_abi_version_0_2_1"))
  (func (export "proxy_on_memory_allocate") (param i32) (result i32) i32.const 1024)
  (func (export "proxy_on_context_create") (param i32 i32))
  (func (export "proxy_on_vm_start") (param i32 i32) (result i32) i32.const 1)
  (func (export "proxy_on_configure") (param i32 i32) (result i32) i32.const 1)
  (func (export "proxy_on_request_headers") (param i32 i32 i32) (result i32) unreachable)
  (func (export "proxy_on_done") (param i32) (result i32) i32.const 1)
  (func (export "proxy_on_log") (param i32))
  (func (export "proxy_on_delete") (param i32)))"#;

/// 40. With the filter's VM failed (Envoy's `FAIL_OPEN` then skips it, so nothing of kvgate's
///     runs), a client still cannot pick its engine: Envoy itself removes the routing headers
///     as each request arrives, before any filter, and the fallback balancer spreads requests
///     that all name one engine.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn with_the_filter_vm_failed_a_client_still_cannot_pick_its_engine() {
    let module = std::env::temp_dir().join(format!("kvgate-failing-filter-{}.wasm", std::process::id()));
    std::fs::write(&module, wat::parse_str(FAILING_FILTER).unwrap()).unwrap();
    let opts = StackOptions { name: "vm-failed".into(), wasm: Some(module), ..Default::default() };
    let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let url = stack.gateway("/v1/chat/completions");
    // The first request kills the VM; Envoy holds it (FAIL_OPEN does not save the request
    // that failed), so it is sent with a short timeout. Later ones bypass the dead filter.
    let impatient = reqwest::blocking::Client::builder().timeout(Duration::from_secs(2)).build().unwrap();
    let _ = impatient.post(&url).header("content-type", "application/json").body(chat("x", "kill").to_string()).send();
    wait_for("requests past the failed VM", Duration::from_secs(30), || {
        let reply = impatient
            .post(&url)
            .header("content-type", "application/json")
            .body(chat("x", "ok").to_string())
            .send()
            .ok()?;
        (reply.status() == 200).then_some(())
    })
    .unwrap();

    let pinned = format!("127.0.0.1:{}", stack.sim("c").port);
    let mut served: HashMap<String, usize> = HashMap::new();
    for i in 0..12 {
        let body = chat("short", &format!("naming engine c {i}")).to_string();
        let reply =
            post(&url, body, &[("x-gateway-destination-endpoint", &pinned), ("x-data-parallel-rank", "0")]).unwrap();
        assert_eq!(reply.status, 200);
        assert!(reply.header("x-kvgate-routed-to").is_empty(), "the filter did not run");
        *served.entry(reply.header("x-kvgate-replica").to_owned()).or_default() += 1;
    }
    assert_eq!(served.len(), 3, "round robin spreads what the client tried to pin: {served:?}");
    assert!(served["c"] < 12, "{served:?}");
}

/// 41. A client's `kv_transfer_params.prompt_token_ids` would have the engine run those ids in
///     place of the `messages` (vLLM 0.32 does, as the simulator): kvgate takes them out, so
///     the engine runs the messages it routed on. Also however the engine's server would read
///     the same request: the name spelled with JSON escapes, a `+json` content type, the
///     path percent-encoded, or another path of the engine's that reads the same fields
///     (vLLM's `/invocations`: cleaned, not routed). Nor can a client switch the filter off first with a header of
///     bytes that are not UTF-8 (HTTP allows them; reading one as UTF-8 panicked the VM, and
///     a failed VM lets every later request on its worker pass unfiltered).
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn a_clients_token_ids_do_not_replace_the_messages_the_engine_runs() {
    let stack = start("client-ids");
    let mut body = chat("a system prompt", "a question a content filter read");
    body["kv_transfer_params"] = json!({"prompt_token_ids": [1, 2, 3]});
    let plain = body.to_string();
    for (name, value) in [("content-type", &b"application/json\xff"[..]), ("x-request-id", b"id-\xe9")] {
        let value = reqwest::header::HeaderValue::from_bytes(value).unwrap();
        let reply = client().post(stack.gateway("/v1/chat/completions")).header(name, value).body(plain.clone()).send();
        let status = reply.unwrap().status();
        assert!(!status.is_server_error(), "{name}: {status}");
    }
    let escaped = plain.replace("\"kv_transfer_params\"", "\"kv\\u005ftransfer_params\"");
    assert_ne!(escaped, plain);
    let send = |base: &str, (path, content_type, body): (&str, &str, &str)| -> Reply {
        let response =
            client().post(format!("{base}{path}")).header("content-type", content_type).body(body.to_owned()).send();
        let response = response.unwrap();
        let (status, headers) = (response.status().as_u16(), response.headers().clone());
        Reply { status, headers, body: response.text().unwrap() }
    };
    let sent = [
        ("/v1/chat/completions", "application/json", plain.as_str()),
        ("/v1/chat/completions", "application/json", &escaped),
        ("/v1/chat/completions", "application/vnd.example+json", &plain),
        ("/v1/chat/%63ompletions", "application/json", &plain),
        ("/invocations", "application/json", &plain),
    ];
    for request in sent {
        let direct = send(&stack.sim("a").url(""), request);
        assert_eq!(direct.json()["usage"]["prompt_tokens"], 3, "the engine itself runs a client's ids: {request:?}");
        let reply = send(&stack.gateway(""), request);
        assert_eq!(reply.status, 200, "{request:?}: {}", reply.body);
        let ran = reply.json()["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(ran > 3, "through kvgate the engine ran the messages: {ran} tokens for {request:?}");
        if request.0 != "/invocations" {
            assert_eq!(reply.header("x-kvgate-prompt-tokens"), ran.to_string(), "and kvgate routed on what it ran");
        }
    }
    // A body the engine's Python reads but kvgate cannot (NaN) is refused here when it may
    // carry them: kvgate could not take them out.
    let nan = plain.replacen("\"max_tokens\":2", "\"max_tokens\":2,\"x\":NaN", 1);
    assert_ne!(nan, plain);
    let reply = send(&stack.gateway(""), ("/v1/chat/completions", "application/json", &nan));
    assert_eq!(reply.status, 400, "{}", reply.body);
    assert_eq!(reply.json()["error"]["code"], "unreadable_transfer_fields", "{}", reply.body);
    assert!(reply.header("x-kvgate-replica").is_empty(), "answered by kvgate, not by an engine");
}

/// 42. Sessions, named by the operator's header, bound softly and shared by the gateways: with
///     `[pools.sessions]` and the filter's `session_header = "x-agent-session"`, an agent's
///     first turn through gateway 0 binds its session where it went; gateway 1 hears the
///     binding over the mesh and credits that replica for its next turn, which the decision
///     explains. A client's `x-session-id`, not the operator's header, keys nothing.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn sessions_named_by_the_operators_header_are_bound_across_gateways() {
    let mut filter_config = serde_json::Map::new();
    filter_config.insert("session_header".into(), json!("x-agent-session"));
    let opts = StackOptions {
        name: "sessions".into(),
        replicas: 2,
        gateways: 2,
        pool_toml: "[pools.sessions]\nttl_secs = 60\n".into(),
        filter_config,
        ..Default::default()
    };
    let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let urls = stack.gateways("/v1/chat/completions");
    let explained = |gateway: usize, booking: &str| -> Option<Value> {
        let url = stack.sidecar_url_of(gateway, &format!("/debug/explain?request={booking}"));
        let body: Value = serde_json::from_str(&client().get(url).send().ok()?.text().ok()?).ok()?;
        body["decisions"].as_array()?.first().cloned()
    };
    let bound = |gateway: usize| stack.sidecar_state_of(gateway).ok()?["pools"][0]["sessions_bound"].as_u64();
    let system = document(60, 600);
    // Each gateway's filter decides before the test starts (its tokenizer is loaded).
    for url in &urls {
        wait_for("the gateway routes", Duration::from_secs(20), || {
            let reply = post(url, chat(&document(61, 50), "warm").to_string(), &[]).ok()?;
            (reply.status == 200 && !matches!(reply.header("x-kvgate-routed-to"), "" | "fallback")).then_some(())
        })
        .unwrap();
    }
    let turn = |gateway: usize, question: &str| {
        let body = chat(&system, question).to_string();
        let reply = post(&urls[gateway], body, &[("x-agent-session", "agent-7")]).unwrap();
        assert_eq!(reply.status, 200);
        (reply.header("x-kvgate-replica").to_owned(), reply.header("x-kvgate-booking-id").to_owned())
    };
    let (home, first) = turn(0, "read the repository");
    let decision = explained(0, &first).expect("the first turn is explained");
    assert_eq!(decision["session"], "new", "{decision}");
    wait_for("gateway 1 hears the binding", Duration::from_secs(10), || (bound(1)? == 1).then_some(())).unwrap();
    let (next, second) = turn(1, "read the repository, then fix the test");
    let decision = explained(1, &second).expect("the second turn is explained");
    assert_eq!((next.as_str(), decision["session"].as_str()), (home.as_str(), Some("kept")), "{decision}");
    let credited: Vec<(&str, f64)> = decision["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["replica"].as_str().unwrap(), c["session_credit"].as_f64().unwrap()))
        .filter(|(_, credit)| *credit > 0.0)
        .collect();
    assert_eq!(credited, [(home.as_str(), 64.0)], "the bound replica, and only it, is credited: {decision}");
    // The default header is not the operator's here: it keys no session.
    let body = chat(&document(62, 100), "q").to_string();
    let reply = post(&urls[0], body, &[("x-session-id", "someone-else")]).unwrap();
    let decision = explained(0, reply.header("x-kvgate-booking-id")).expect("explained");
    assert!(decision["session"].is_null(), "{decision}");
    assert_eq!(bound(0), Some(1));
}

/// 4j. TTFT and ITL SLOs through Envoy: once both replicas' models have learned, a replica
///     slowed 5× behind kvgate's back gets none of the requests it is predicted to serve too
///     late — whether by its class's TTFT SLO or by the ITL SLO a request's header names — and
///     a request of a sheddable class that no replica can serve in time is answered 429 by the
///     filter at once, saying why.
#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn slos_keep_requests_off_a_slowed_replica_and_shed_what_none_can_meet() {
    let pool = "admission = { enabled = true, ttft_slo_ms = 100, default_class = \"chat\", retry_after_secs = 3, \
                classes = [{ name = \"chat\" }, { name = \"smooth\", ttft_slo_ms = 0, itl_slo_ms = 50 }, \
                { name = \"batch\", ttft_slo_ms = 1, sheddable = true }] }";
    let filter = [("priority_header", "x-class".into()), ("itl_slo_header", "x-itl-slo-ms".into())];
    let stack = admission_stack("slo", pool, &filter, &[]);
    let slowed = client().post(stack.sim("b").url("/_chaos/slowdown")).body(r#"{"factor": 5}"#).send().unwrap();
    assert_eq!(slowed.status(), 200);
    let url = stack.gateway("/v1/chat/completions");
    // 200-300 words: 25-40 ms to the first token on a, 5× that on b.
    let send = |i: u32| {
        let reply = stream(&url, chat(&document(9_000 + i, 200 + (i as usize * 37) % 100), "Summarise.")).unwrap();
        assert_eq!(reply.status, 200);
        reply.header("x-kvgate-routed-to").to_owned()
    };
    let learned = || {
        let state = stack.sidecar_state().ok()?;
        let replicas = state["pools"][0]["replicas"].as_array()?.clone();
        replicas.iter().all(|r| r["ttft"]["samples"].as_u64().is_some_and(|n| n >= 8)).then_some(())
    };
    let mut sent = 0;
    wait_for("both replicas' TTFT models", Duration::from_secs(120), || {
        send(sent);
        sent += 1;
        learned()
    })
    .unwrap();
    let to_slowed = (100..120).map(send).filter(|replica| replica == "b").count();
    assert_eq!(to_slowed, 0, "the slowed replica is predicted past the 100 ms SLO");
    // No TTFT SLO, but 5 ms between tokens (the header replaces the class's 50): a streams one
    // every 2 ms, b every 10.
    let smooth = |i: u32, itl_slo: &str| {
        let body = chat(&document(9_200 + i, 200 + (i as usize * 37) % 100), "Summarise.").to_string();
        let reply = post(&url, body, &[("x-class", "smooth"), ("x-itl-slo-ms", itl_slo)]).unwrap();
        assert_eq!(reply.status, 200);
        reply.header("x-kvgate-routed-to").to_owned()
    };
    let to_slowed = (0..20).map(|i| smooth(i, "5")).filter(|replica| replica == "b").count();
    assert_eq!(to_slowed, 0, "the slowed replica is predicted past the 5 ms ITL SLO");
    let loose = (20..40).map(|i| smooth(i, "50")).filter(|replica| replica == "b").count();
    assert!(loose > 0, "with 50 ms, both are within it and idle replicas share the requests");
    let body = chat(&document(9_500, 250), "Summarise.").to_string();
    let shed = post(&url, body, &[("x-class", "batch")]).unwrap();
    assert_eq!((shed.status, shed.header("retry-after")), (429, "3"), "{}", shed.body);
    assert!(shed.body.contains("predicted to meet the request's latency objectives"), "{}", shed.body);
    let metrics = stack.sidecar_metrics().unwrap();
    assert_eq!(metric_sum(&metrics, "kvgate_slo_decisions_total", "outcome=\"shed\""), 1.0, "{metrics}");
    assert!(metric_sum(&metrics, "kvgate_slo_decisions_total", "outcome=\"within\"") >= 60.0, "{metrics}");
    assert_eq!(metric_sum(&metrics, "kvgate_admission_total", "outcome=\"slo\""), 1.0, "{metrics}");
}
