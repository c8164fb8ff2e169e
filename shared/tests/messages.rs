//! `/v1/messages` parity: `testdata/parity/messages/` holds Anthropic Messages requests rendered
//! the way vLLM 0.32 renders them (its own `AnthropicMessagesRequest` and
//! `AnthropicServingMessages.to_chat_completion_request`, with vLLM's own per-model decisions of
//! where inline system messages go and which effort turns thinking off; then the chat path;
//! `tools/parity/gen_messages.py`), for Qwen3 and every template family. kvgate must make the
//! same two decisions, give the same ids for every case, and refuse the cases vLLM refuses.

mod common;

use std::path::PathBuf;

use kvgate_shared::prompt::openai::{parse, Endpoint, Prompt};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::prompt::PromptError;
use kvgate_shared::wire::ModelBundle;
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Checks one model's reference file; returns how many cases it holds.
fn check(model: &str) -> usize {
    let file = repo().join("testdata/parity/messages").join(format!("{model}-messages.json"));
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(file).unwrap()).unwrap();
    let dir = match model {
        "qwen3" => repo().join("models/qwen3-0.6b"),
        family => repo().join("../shared/testdata/tokenizers").join(family),
    };
    let bundle = ModelBundle::from_dir(model, &dir, 16).unwrap();
    let now = reference["now_unix"].as_i64().unwrap();
    let template = bundle.template().unwrap().unwrap();
    assert_eq!(
        template.requires_system_first(),
        reference["merge_inline_system"].as_bool().unwrap(),
        "{model}: where inline system messages go"
    );
    assert_eq!(
        template.disabled_thinking_effort(now),
        reference["disabled_thinking_effort"].as_str().unwrap(),
        "{model}: the effort that turns thinking off"
    );
    let tokenizer = ModelTokenizer::from_bundle(&bundle).unwrap();
    let cases = reference["cases"].as_array().unwrap();
    let mut failures = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let mut body = case["request"].clone();
        body["model"] = model.into();
        let ids = parse(Endpoint::Messages, body.to_string().as_bytes()).and_then(|request| {
            assert!(matches!(request.prompt, Prompt::Messages(_)), "{model} {name}");
            tokenizer.prompt_head_at(&request, usize::MAX, now).map(|head| head.tokens)
        });
        match (ids, case.get("error")) {
            (Err(_), Some(_)) => {}
            (Ok(_), Some(e)) => failures.push(format!("{name}: rendered, but vLLM refuses it ({e})")),
            (Err(e), None) => failures.push(format!("{name}: {e}")),
            (Ok(ids), None) => {
                if let Some(d) = common::divergence(&ids, &common::reference_ids(case)) {
                    failures.push(format!("{name}: {d}"));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{model}: {} of {} cases differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    cases.len()
}

#[test]
fn qwen3_messages_match_vllm() {
    assert!(check("qwen3") >= 28);
}

#[test]
fn every_template_family_renders_messages_as_vllm() {
    for family in
        ["llama-3.2-1b-instruct", "deepseek-v3", "gemma-3-1b-it", "mistral-nemo-instruct-2407", "phi-3.5-mini-instruct"]
    {
        assert!(check(family) >= 28, "{family}");
    }
}

#[test]
fn messages_to_a_harmony_model_are_left_to_the_engine() {
    let dir = repo().join("../shared/testdata/tokenizers/gpt-oss-20b");
    let mut bundle = ModelBundle::from_dir("gpt-oss", &dir, 16).unwrap();
    bundle.renderer = kvgate_shared::prompt::Renderer::Harmony;
    let tokenizer = ModelTokenizer::from_bundle(&bundle).unwrap();
    let body = br#"{"model":"gpt-oss","max_tokens":8,"messages":[{"role":"user","content":"hi"}]}"#;
    let request = parse(Endpoint::Messages, body).unwrap();
    assert!(matches!(tokenizer.prompt_tokens(&request), Err(PromptError::Unsupported(_))));
}

#[test]
fn a_messages_body_reads_its_limits_and_keys() {
    let body = br#"{"model":"m","max_tokens":64,"stream":true,"metadata":{"user_id":"u1"},"user":"x",
        "cache_salt":"tenant-a","messages":[{"role":"user","content":"hi"}]}"#;
    let r = parse(Endpoint::Messages, body).unwrap();
    assert_eq!(r.max_tokens, Some(64));
    assert!(r.stream && r.include_usage, "message_delta always carries usage");
    assert_eq!((r.session.as_deref(), r.cache_salt.as_deref(), r.samples), (Some("u1"), Some("tenant-a"), 1));
}
