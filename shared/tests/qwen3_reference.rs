//! The shipped Qwen3 tokenizer and template reproduce the reference ids generated with Python
//! `tokenizers` + transformers (`../shared/testdata/tokenizers/qwen3-0.6b/reference.json`).

use std::path::PathBuf;

use kvgate_shared::prompt::openai::{parse, Endpoint};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::wire::ModelBundle;
use serde_json::{json, Value};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn load() -> (ModelTokenizer, Value) {
    let bundle = ModelBundle::from_dir("qwen3", &repo().join("models/qwen3-0.6b"), 16).unwrap();
    let reference = repo().join("../shared/testdata/tokenizers/qwen3-0.6b/reference.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(&reference).unwrap()).unwrap();
    (ModelTokenizer::from_bundle(&bundle).unwrap(), reference)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn plain_text_samples_match() {
    let (tok, reference) = load();
    let samples = reference["samples"].as_object().unwrap();
    assert!(!samples.is_empty());
    for (name, sample) in samples {
        let text = sample["text"].as_str().unwrap();
        assert_eq!(tok.encode(text, false).unwrap(), ids(&sample["ids_add_special_tokens_false"]), "{name}");
        assert_eq!(tok.encode(text, true).unwrap(), ids(&sample["ids_add_special_tokens_true"]), "{name}");
    }
}

#[test]
fn chat_samples_match() {
    let (tok, reference) = load();
    let chats = reference["chat"].as_array().unwrap();
    assert!(!chats.is_empty());
    for case in chats {
        let body = json!({
            "model": "qwen3",
            "messages": case["messages"],
            "add_generation_prompt": case["add_generation_prompt"],
            "chat_template_kwargs": case["chat_template_kwargs"],
        });
        let request = parse(Endpoint::ChatCompletions, body.to_string().as_bytes()).unwrap();
        let got = tok.prompt_tokens(&request).unwrap();
        assert_eq!(got, ids(&case["ids_add_special_tokens_false"]), "{}", case["name"]);
    }
}
