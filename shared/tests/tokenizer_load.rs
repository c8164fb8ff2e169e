//! How a `tokenizer.json` becomes kvgate's tokenizer: the sidecar serves it in the canonical
//! form (so the filter loads it without the upgrade pass), any older form still loads, and what
//! the tokenizer cannot run (a model kind not built in, a split pattern its SIMD pre-tokenizer
//! does not recognise) is refused at load, by name.

use std::path::PathBuf;

use kvgate_shared::prompt::content_format::ContentFormat;
use kvgate_shared::prompt::tokenizer::{canonical_tokenizer_json, load_tokenizer, ModelTokenizer};
use kvgate_shared::prompt::{PromptError, Renderer};
use kvgate_shared::wire::ModelBundle;

fn qwen_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3-0.6b")
}

fn bundle(tokenizer_json: String) -> ModelBundle {
    ModelBundle {
        model: "m".into(),
        block_size: 16,
        tokenizer_json,
        chat_template: None,
        bos_token: None,
        eos_token: None,
        content_format: ContentFormat::Auto,
        renderer: Renderer::Template,
    }
}

/// A tiny legacy-format BPE tokenizer with `pre_tokenizer` as given.
fn tiny_bpe(pre_tokenizer: &str) -> String {
    format!(
        r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,
        "pre_tokenizer":{pre_tokenizer},"post_processor":null,"decoder":null,
        "model":{{"type":"BPE","dropout":null,"unk_token":"<unk>","continuing_subword_prefix":null,
        "end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,"ignore_merges":false,
        "vocab":{{"<unk>":0,"a":1,"b":2,"ab":3,"1":4,"2":5,"12":6}},"merges":["a b","1 2"]}}}}"#
    )
}

#[test]
fn the_served_bundle_is_canonical_and_loads_like_the_original() {
    let served = ModelBundle::from_dir("qwen3", &qwen_dir(), 16).unwrap();
    assert!(served.tokenizer_json.starts_with(r#"{"version":"2.0""#), "the sidecar serves the canonical form");
    assert_eq!(canonical_tokenizer_json(&served.tokenizer_json).unwrap(), served.tokenizer_json, "idempotent");
    let original = std::fs::read_to_string(qwen_dir().join("tokenizer.json")).unwrap();
    assert!(!original.contains(r#""version": "2.0""#), "the vendored file is the legacy form");
    let from_served = ModelTokenizer::from_bundle(&served).unwrap();
    let from_original = ModelTokenizer::from_bundle(&bundle(original)).unwrap();
    let text = "Routing on the KV cache: <|im_start|>user\nhello 12345 wörld<|im_end|>";
    assert_eq!(from_served.encode(text, false).unwrap(), from_original.encode(text, false).unwrap());
    assert!(served.tokenizer_json.len() < std::fs::metadata(qwen_dir().join("tokenizer.json")).unwrap().len() as usize);
}

#[test]
fn an_unrecognised_split_pattern_is_refused_at_load_naming_it() {
    let json =
        tiny_bpe(r#"{"type":"Split","pattern":{"Regex":"[a-z]+|[0-9]{1,2}"},"behavior":"Isolated","invert":false}"#);
    tokenizers_legacy::Tokenizer::from_bytes(json.as_bytes()).expect("0.22 runs it on its regex engine");
    let err = ModelTokenizer::from_bundle(&bundle(json)).unwrap_err();
    assert!(err.to_string().contains(r#""[a-z]+|[0-9]{1,2}""#), "names the pattern: {err}");
    let literal = tiny_bpe(r#"{"type":"Split","pattern":{"String":"1"},"behavior":"Isolated","invert":false}"#);
    let ours = ModelTokenizer::from_bundle(&bundle(literal.clone())).expect("a literal pattern needs no regex");
    let legacy = tokenizers_legacy::Tokenizer::from_bytes(literal.as_bytes()).unwrap();
    for text in ["ab1212", "ba121", "aab12b"] {
        assert_eq!(ours.encode(text, false).unwrap(), legacy.encode_fast(text, false).unwrap().get_ids(), "{text:?}");
    }
}

#[test]
fn what_the_tokenizer_cannot_run_is_refused_by_name() {
    let unigram = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,
        "pre_tokenizer":null,"post_processor":null,"decoder":null,
        "model":{"type":"Unigram","unk_id":0,"vocab":[["<unk>",0.0],["a",-1.0]],"byte_fallback":false}}"#;
    let Err(err) = load_tokenizer(unigram) else { panic!("a Unigram model loaded") };
    assert!(matches!(err, PromptError::Tokenizer(_)));
    assert!(err.to_string().contains("Unigram"), "names the model kind: {err}");
    let unknown = tiny_bpe(r#"{"type":"NoSuchPreTokenizer"}"#);
    let err = ModelTokenizer::from_bundle(&bundle(unknown)).unwrap_err();
    assert!(err.to_string().contains("NoSuchPreTokenizer"), "names the component: {err}");
    assert!(load_tokenizer("{not json").is_err());
}
