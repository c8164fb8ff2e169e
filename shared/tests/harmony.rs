//! gpt-oss as vLLM 0.32 renders it — openai-harmony, not the chat template — token for token:
//! `testdata/parity/families/gpt-oss-20b-harmony.json`, written by `tools/parity/gen_harmony.py`
//! with vLLM's own functions and the `oss-harmony` it runs, at a recorded instant (the system
//! message prints the date).

mod common;

use std::path::{Path, PathBuf};

use kvgate_shared::prompt::openai::{parse, Endpoint};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::prompt::Renderer;
use kvgate_shared::wire::ModelBundle;
use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn family(name: &str) -> PathBuf {
    repo().join("../shared/testdata/tokenizers").join(name)
}

fn reference() -> Value {
    let path = repo().join("testdata/parity/families/gpt-oss-20b-harmony.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn tokenizer(segment_cache: bool) -> ModelTokenizer {
    let bundle = ModelBundle::from_dir("gpt-oss", &family("gpt-oss-20b"), 16).unwrap();
    assert_eq!(bundle.renderer, Renderer::Harmony);
    let tokenizer = ModelTokenizer::from_bundle(&bundle).unwrap();
    if segment_cache {
        tokenizer.with_segment_cache(1 << 20)
    } else {
        tokenizer
    }
}

fn request(case: &Value) -> kvgate_shared::prompt::openai::ParsedRequest {
    let mut body = case["request"].clone();
    body["model"] = "gpt-oss".into();
    parse(Endpoint::ChatCompletions, body.to_string().as_bytes()).unwrap()
}

/// Every case where vLLM renders: the same ids. Where harmony itself refuses (an unsupported
/// `reasoning_effort`), refused here too; what vLLM's request validation refuses first is not
/// checked (the engine answers 400 whatever kvgate routes on).
fn check(tokenizer: &ModelTokenizer, runs: usize) {
    let reference = reference();
    let now = reference["now_unix"].as_i64().unwrap();
    let mut failures = Vec::new();
    let mut checked = 0;
    for _ in 0..runs {
        for case in reference["cases"].as_array().unwrap() {
            let name = case["name"].as_str().unwrap();
            let ours = tokenizer.prompt_head_at(&request(case), usize::MAX, now).map(|h| h.tokens);
            match (ours, case.get("error").and_then(Value::as_str)) {
                (Err(_), Some(e)) if e.contains("reasoning_effort") => {}
                (Ok(ids), Some(e)) if e.contains("reasoning_effort") => {
                    failures.push(format!("{name}: rendered {} ids, but harmony refuses ({e})", ids.len()))
                }
                (_, Some(_)) => continue,
                (Err(e), None) => failures.push(format!("{name}: {e}")),
                (Ok(ids), None) => {
                    if let Some(d) = common::divergence(&ids, &common::reference_ids(case)) {
                        failures.push(format!("{name}: {d}"));
                    }
                }
            }
            checked += 1;
        }
    }
    assert!(failures.is_empty(), "{} of {checked} differ:\n{}", failures.len(), failures.join("\n"));
    assert!(checked >= 20 * runs, "only {checked} cases checked");
}

#[test]
fn every_case_matches_vllm() {
    check(&tokenizer(false), 1);
}

#[test]
fn the_segment_cache_stays_exact() {
    let tokenizer = tokenizer(true);
    check(&tokenizer, 2);
    let stats = tokenizer.segment_stats().unwrap();
    assert!(stats.hits > 0, "the second pass reads cached pieces: {stats:?}");
}

#[test]
fn a_cut_head_is_the_prompt_s_first_tokens() {
    let tokenizer = tokenizer(false);
    let reference = reference();
    let now = reference["now_unix"].as_i64().unwrap();
    let case = reference["cases"].as_array().unwrap().iter().find(|c| c["name"] == "long_document").unwrap();
    let full = tokenizer.prompt_head_at(&request(case), usize::MAX, now).unwrap();
    assert!(!full.truncated);
    for max_bytes in [0, 100, 5_000] {
        let head = tokenizer.prompt_head_at(&request(case), max_bytes, now).unwrap();
        assert!(head.truncated, "{max_bytes}");
        assert!(!head.tokens.is_empty() && full.tokens.starts_with(&head.tokens), "{max_bytes}");
        let error = head.estimated_total.abs_diff(full.tokens.len()) as f64 / full.tokens.len() as f64;
        assert!(
            max_bytes < 1_000 || error < 0.2,
            "{max_bytes}: estimated {} of {}",
            head.estimated_total,
            full.tokens.len()
        );
    }
}

/// vLLM renders with harmony exactly the models whose `config.json` says `gpt_oss`; a
/// directory of tokenizer files only is judged by its template.
#[test]
fn harmony_is_chosen_as_vllm_chooses_it() {
    let renderer = |dir: &Path| ModelBundle::from_dir("m", dir, 16).unwrap().renderer;
    assert_eq!(renderer(&family("gpt-oss-20b")), Renderer::Harmony);
    assert_eq!(renderer(&family("llama-3.2-1b-instruct")), Renderer::Template);
    assert_eq!(renderer(&family("qwen3-0.6b")), Renderer::Template);
    let with_config = |source: &str, model_type: &str| {
        let dir = std::env::temp_dir().join(format!("kvgate-harmony-{}-{source}-{model_type}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for entry in std::fs::read_dir(family(source)).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
        }
        std::fs::write(dir.join("config.json"), format!(r#"{{"model_type": "{model_type}"}}"#)).unwrap();
        let chosen = renderer(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        chosen
    };
    assert_eq!(with_config("gpt-oss-20b", "gpt_oss"), Renderer::Harmony);
    assert_eq!(with_config("gpt-oss-20b", "llama"), Renderer::Template, "model_type decides, not the template");
    assert_eq!(with_config("llama-3.2-1b-instruct", "gpt_oss"), Renderer::Harmony);
}
