//! `/v1/messages` parity: `testdata/parity/messages/` holds Anthropic Messages requests rendered
//! the way vLLM 0.32 renders them (its own `AnthropicMessagesRequest` and
//! `AnthropicServingMessages.to_chat_completion_request`, with vLLM's own per-model decisions of
//! where inline system messages go and which effort turns thinking off; then the chat path;
//! `tools/parity/gen_messages.py`), for Qwen3 and every template family. kvgate must make the
//! same two decisions, give the same ids for every case, and refuse the cases vLLM refuses.

mod common;

use kvgate_shared::prompt::openai::{parse, Endpoint, Prompt};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::prompt::PromptError;
use kvgate_shared::wire::ModelBundle;

/// Checks one model's reference file: vLLM's two per-model decisions, then every case;
/// returns how many cases it holds.
fn check(model: &str) -> usize {
    let cases = common::EndpointCases::load("messages", model);
    let template = cases.bundle.template().unwrap().unwrap();
    assert_eq!(
        template.requires_system_first(),
        cases.reference["merge_inline_system"].as_bool().unwrap(),
        "{model}: where inline system messages go"
    );
    assert_eq!(
        template.disabled_thinking_effort(cases.now()),
        cases.reference["disabled_thinking_effort"].as_str().unwrap(),
        "{model}: the effort that turns thinking off"
    );
    cases.check(Endpoint::Messages, |r| matches!(r.prompt, Prompt::Messages(_)))
}

#[test]
fn qwen3_messages_match_vllm() {
    assert!(check("qwen3") >= 28);
}

#[test]
fn every_template_family_renders_messages_as_vllm() {
    for family in common::TEMPLATE_FAMILIES {
        assert!(check(family) >= 28, "{family}");
    }
}

#[test]
fn messages_to_a_harmony_model_are_left_to_the_engine() {
    let dir = common::repo().join("../shared/testdata/tokenizers/gpt-oss-20b");
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
    // vLLM passes kv_transfer_params on to the chat request, which takes forwarded ids as the
    // prompt; the messages are still checked.
    let forwarded = br#"{"model":"m","max_tokens":8,"kv_transfer_params":{"prompt_token_ids":[5,6,7]},
        "messages":[{"role":"user","content":"hi"}]}"#;
    assert_eq!(parse(Endpoint::Messages, forwarded).unwrap().prompt, Prompt::Tokens(vec![5, 6, 7]));
    let invalid = br#"{"model":"m","max_tokens":8,"kv_transfer_params":{"prompt_token_ids":[5]},
        "messages":[{"role":"tool","content":"hi"}]}"#;
    assert!(parse(Endpoint::Messages, invalid).is_err());
}
