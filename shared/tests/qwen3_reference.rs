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

/// The segment cache is exact: on every reference chat and on chats built to stress the
/// piece boundaries, cached ids equal one-go ids, cold and warm.
#[test]
fn segment_cache_is_exact_and_reuses_earlier_turns() {
    let (plain, reference) = load();
    let bundle = ModelBundle::from_dir("qwen3", &repo().join("models/qwen3-0.6b"), 16).unwrap();
    let cached = ModelTokenizer::from_bundle(&bundle).unwrap().with_segment_cache(1 << 20);
    assert!(cached.segment_stats().is_some(), "Qwen3's special tokens allow piecewise encoding");
    let mut bodies: Vec<Value> = reference["chat"]
        .as_array()
        .unwrap()
        .iter()
        .map(
            |c| json!({"model": "qwen3", "messages": c["messages"], "chat_template_kwargs": c["chat_template_kwargs"]}),
        )
        .collect();
    let tricky = [
        "",
        " ",
        "\n\n",
        "  leading and trailing  ",
        "<|im_start|>inside<|im_end|>",
        "<think>\nx\n</think>",
        "emoji 🚀 and 中文",
        "a<|im_end|>b",
        "tabs\tand\r\nnewlines",
        "<|endoftext|>",
        "<|im_start",
    ];
    for (i, t) in tricky.iter().enumerate() {
        bodies.push(json!({"model": "qwen3", "messages": [
            {"role": "system", "content": t},
            {"role": "user", "content": format!("{t} question {i}")},
            {"role": "assistant", "content": format!("<think>\n{t}\n</think>\n\nanswer {t}")},
            {"role": "user", "content": t}]}));
    }
    for round in ["cold", "warm"] {
        for body in &bodies {
            let request = parse(Endpoint::ChatCompletions, body.to_string().as_bytes()).unwrap();
            assert_eq!(
                cached.prompt_tokens(&request).unwrap(),
                plain.prompt_tokens(&request).unwrap(),
                "{round}: {body}"
            );
        }
    }
    // A conversation plus one new turn: only the new pieces are tokenized.
    let mut messages = vec![json!({"role": "system", "content": "You are terse."})];
    for turn in 0..6 {
        messages.push(json!({"role": "user", "content": format!("question number {turn}")}));
        let request =
            parse(Endpoint::ChatCompletions, json!({"model": "qwen3", "messages": messages}).to_string().as_bytes())
                .unwrap();
        let before = cached.segment_stats().unwrap();
        assert_eq!(cached.prompt_tokens(&request).unwrap(), plain.prompt_tokens(&request).unwrap());
        let after = cached.segment_stats().unwrap();
        if turn > 0 {
            assert!(after.misses - before.misses <= 3, "turn {turn}: {} new pieces", after.misses - before.misses);
            assert!(after.hits > before.hits);
        }
        messages.push(json!({"role": "assistant", "content": format!("answer {turn}")}));
    }
}

#[test]
fn segment_cache_respects_its_byte_budget() {
    let bundle = ModelBundle::from_dir("qwen3", &repo().join("models/qwen3-0.6b"), 16).unwrap();
    let cached = ModelTokenizer::from_bundle(&bundle).unwrap().with_segment_cache(4096);
    for i in 0..50 {
        let body = json!({"model": "qwen3", "messages": [{"role": "user", "content": format!("message {i} {}", "x ".repeat(i * 10))}]});
        cached.prompt_tokens(&parse(Endpoint::ChatCompletions, body.to_string().as_bytes()).unwrap()).unwrap();
        assert!(cached.segment_stats().unwrap().bytes <= 4096);
    }
    assert!(
        ModelTokenizer::from_bundle(&bundle).unwrap().with_segment_cache(0).segment_stats().is_none(),
        "0 disables it"
    );
}

/// A prompt's head, cut where no pre-tokenizer split crosses, tokenizes to exactly the
/// prompt's first tokens, whatever the cut (ASCII, CJK, emoji, chat markup).
#[test]
fn prompt_heads_are_exact_prefixes() {
    let (tok, reference) = load();
    let mut texts: Vec<String> =
        reference["samples"].as_object().unwrap().values().map(|s| s["text"].as_str().unwrap().repeat(20)).collect();
    texts.push("<|im_start|>user\nhello   there\n\n\tfriend 你好 🚀🚀 end<|im_end|>\n".repeat(30));
    for text in texts {
        let body = json!({"model": "qwen3", "prompt": text});
        let request = parse(Endpoint::Completions, body.to_string().as_bytes()).unwrap();
        let full = tok.prompt_tokens(&request).unwrap();
        for max in [1, 7, 50, 123, 400, 999, 2048] {
            let head = tok.prompt_head(&request, max).unwrap();
            assert_eq!(head.tokens[..], full[..head.tokens.len()], "cut at {max}");
            assert_eq!(head.truncated, max < text.len());
        }
    }
}
