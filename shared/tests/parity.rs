//! Parity with vLLM's renderer: `testdata/parity/qwen3-chat.json` holds chats rendered by
//! transformers (Python Jinja2) after vLLM's normalisation and encoded by HF tokenizers,
//! written by `tools/parity/gen_reference.py`. kvgate's pipeline must give the same text and
//! the same ids for every case. On a mismatch the first divergence is printed.
//! `testdata/parity/openai-format-chat.json` does the same for a template that iterates
//! content parts, which vLLM detects as "openai" content format.

use std::path::PathBuf;

use kvgate_shared::prompt::content_format::ContentFormat;
use kvgate_shared::prompt::openai::{parse, Endpoint, Prompt};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::wire::ModelBundle;
use serde_json::Value;

fn first_divergence<T: PartialEq + std::fmt::Debug>(a: &[T], b: &[T]) -> String {
    let i = a.iter().zip(b).position(|(x, y)| x != y).unwrap_or(a.len().min(b.len()));
    format!("at {i}: ours {:?} vs reference {:?}", &a[i..(i + 8).min(a.len())], &b[i..(i + 8).min(b.len())])
}

/// Checks every case of a reference file; the file's own `chat_template`, if it has one,
/// replaces the model's. Returns the case count.
fn check(file: &str, expected_format: ContentFormat) -> usize {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf();
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(repo.join("testdata/parity").join(file)).unwrap()).unwrap();
    let mut bundle = ModelBundle::from_dir("qwen3", &repo.join("models/qwen3-0.6b"), 16).unwrap();
    if let Some(template) = reference["chat_template"].as_str() {
        bundle.chat_template = Some(template.to_owned());
    }
    let tokenizer = ModelTokenizer::from_bundle(&bundle).unwrap();
    let template = bundle.template().unwrap().expect("the model has a template");
    assert_eq!(template.content_format(), expected_format, "{file}: detected content format");
    let cases = reference["cases"].as_array().unwrap();
    let mut failures = Vec::new();
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let mut body = case["request"].clone();
        body["model"] = "qwen3".into();
        let request = parse(Endpoint::ChatCompletions, body.to_string().as_bytes()).unwrap();
        let Prompt::Chat(chat) = &request.prompt else { panic!("{name}: not a chat") };
        let rendered = template.render(chat).unwrap();
        let expected_text = case["rendered"].as_str().unwrap();
        if rendered != expected_text {
            let (a, b): (Vec<char>, Vec<char>) = (rendered.chars().collect(), expected_text.chars().collect());
            failures.push(format!("{name}: text differs {}", first_divergence(&a, &b)));
            continue;
        }
        let ids = tokenizer.prompt_tokens(&request).unwrap();
        let expected: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        if ids != expected {
            failures.push(format!("{name}: ids differ {}", first_divergence(&ids, &expected)));
        }
    }
    assert!(
        failures.is_empty(),
        "{file}: {} of {} cases differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    cases.len()
}

#[test]
fn chats_match_the_python_reference() {
    assert!(check("qwen3-chat.json", ContentFormat::String) >= 15);
}

#[test]
fn content_part_templates_get_openai_format_content() {
    assert!(check("openai-format-chat.json", ContentFormat::Openai) >= 8);
}
