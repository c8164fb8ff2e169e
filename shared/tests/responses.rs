//! `/v1/responses` parity: `testdata/parity/responses/` holds Responses requests rendered the
//! way vLLM 0.32 renders them (its own `ResponsesRequest`, `construct_input_messages` and
//! `construct_tool_dicts`, then the chat path; `tools/parity/gen_responses.py`), for Qwen3 and
//! every template family. kvgate must give the same ids for every case, and refuse the cases
//! the template refuses (vLLM answers 400 there).

mod common;

use kvgate_shared::prompt::openai::{parse, Endpoint, Prompt};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::prompt::PromptError;
use kvgate_shared::wire::ModelBundle;

fn check(model: &str) -> usize {
    common::EndpointCases::load("responses", model)
        .check(Endpoint::Responses, |r| matches!(r.prompt, Prompt::Responses(_)))
}

#[test]
fn qwen3_responses_match_vllm() {
    assert!(check("qwen3") >= 15);
}

#[test]
fn every_template_family_renders_responses_as_vllm() {
    for family in common::TEMPLATE_FAMILIES {
        assert!(check(family) >= 15, "{family}");
    }
}

#[test]
fn responses_to_a_harmony_model_are_left_to_the_engine() {
    let dir = common::repo().join("../shared/testdata/tokenizers/gpt-oss-20b");
    let mut bundle = ModelBundle::from_dir("gpt-oss", &dir, 16).unwrap();
    bundle.renderer = kvgate_shared::prompt::Renderer::Harmony;
    let tokenizer = ModelTokenizer::from_bundle(&bundle).unwrap();
    let request = parse(Endpoint::Responses, br#"{"model":"gpt-oss","input":"hi"}"#).unwrap();
    assert!(matches!(tokenizer.prompt_tokens(&request), Err(PromptError::Unsupported(_))));
}

#[test]
fn a_responses_body_reads_its_limits_and_keys() {
    let body = br#"{"model":"m","input":"hi","max_output_tokens":64,"max_tokens":9,"stream":true,
        "user":"u1","cache_salt":"tenant-a","n":4}"#;
    let r = parse(Endpoint::Responses, body).unwrap();
    assert_eq!(r.max_tokens, Some(64), "max_output_tokens; max_tokens is not a Responses field");
    assert!(r.stream && r.include_usage, "response.completed always carries usage");
    assert_eq!((r.session.as_deref(), r.cache_salt.as_deref(), r.samples), (Some("u1"), Some("tenant-a"), 1));
    let held = parse(Endpoint::Responses, br#"{"model":"m","input":"hi","previous_response_id":"resp_1"}"#);
    assert!(matches!(held, Err(PromptError::Unsupported(_))), "the engine holds that history");
}
