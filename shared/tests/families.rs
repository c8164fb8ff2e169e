//! Every model family in `../shared/testdata/tokenizers`, rendered and tokenized by kvgate as
//! transformers renders and tokenizes it for vLLM (`testdata/parity/families/`, written by
//! `tools/parity/gen_families.py` with the transformers vLLM 0.32 runs). Templates that print
//! the date are rendered at the instant the vectors were made; a case the template refuses
//! must be refused here too (vLLM answers 400).

mod common;

use std::path::PathBuf;

use kvgate_shared::prompt::openai::{parse, Endpoint, Prompt};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::wire::ModelBundle;
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The cases of one family that differ from the reference, described.
fn divergences(family: &str) -> (usize, Vec<String>) {
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("testdata/parity/families").join(format!("{family}-chat.json"))).unwrap(),
    )
    .unwrap();
    let dir = repo().join("../shared/testdata/tokenizers").join(family);
    let bundle = ModelBundle::from_dir(family, &dir, 16).unwrap();
    let tokenizer = ModelTokenizer::from_bundle(&bundle).unwrap();
    let template = bundle.template().unwrap().expect("the model has a template");
    let now = reference["now_unix"].as_i64().unwrap();
    let cases = reference["cases"].as_array().unwrap();
    let mut out = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let mut body = case["request"].clone();
        body["model"] = family.into();
        let request = parse(Endpoint::ChatCompletions, body.to_string().as_bytes()).unwrap();
        let Prompt::Chat(chat) = &request.prompt else { panic!("{family} {name}: not a chat") };
        let rendered = template.render_at(chat, now);
        match (rendered, case.get("error")) {
            (Err(_), Some(_)) => {}
            (Ok(_), Some(e)) => out.push(format!("{name}: rendered, but the template raises there ({e})")),
            (Err(e), None) => out.push(format!("{name}: {e}")),
            (Ok(text), None) => {
                let expected_text = case["rendered"].as_str().unwrap();
                if text != expected_text {
                    let at = text.chars().zip(expected_text.chars()).take_while(|(a, b)| a == b).count();
                    let (ours, theirs): (String, String) =
                        (text.chars().skip(at).take(40).collect(), expected_text.chars().skip(at).take(40).collect());
                    out.push(format!("{name}: text differs at char {at}: {ours:?} vs {theirs:?}"));
                    continue;
                }
                let ids = tokenizer.encode(&text, false).unwrap();
                if let Some(d) = common::divergence(&ids, &common::reference_ids(case)) {
                    out.push(format!("{name}: {d}"));
                }
            }
        }
    }
    (cases.len(), out)
}

fn assert_family(family: &str) {
    let (n, failures) = divergences(family);
    assert!(n >= 15, "{family}: only {n} cases");
    assert!(failures.is_empty(), "{family}: {} of {n} cases differ:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn llama_3() {
    assert_family("llama-3.2-1b-instruct");
}

/// gpt-oss's template, for a model that ships it under another `model_type` (vLLM renders
/// gpt-oss itself with harmony: `tests/harmony.rs`).
#[test]
fn gpt_oss_template() {
    assert_family("gpt-oss-20b");
}

#[test]
fn deepseek_v3() {
    assert_family("deepseek-v3");
}

#[test]
fn gemma_3() {
    assert_family("gemma-3-1b-it");
}

#[test]
fn mistral_nemo() {
    assert_family("mistral-nemo-instruct-2407");
}

#[test]
fn phi_3_5() {
    assert_family("phi-3.5-mini-instruct");
}
