//! Fuzz-style: random bodies and headers through every request-path function the filter runs
//! on request data (natively — the same code runs in Envoy). None may panic, and what they
//! return must be consistent.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::rc::Rc;

use kvgate_filter::plan::{offload, parse_overrides, plan, routable, with_token_prompt, LoadedModel, Skip};
use kvgate_shared::hash::Salt;
use kvgate_shared::prompt::openai::{envelope, Endpoint};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::route::RequestKeys;
use kvgate_shared::wire::ModelBundle;
use proptest::prelude::*;
use serde_json::{json, Map, Value};

const BLOCK: u32 = 4;

thread_local! {
    static MODELS: RefCell<Option<Rc<HashMap<String, LoadedModel>>>> = const { RefCell::new(None) };
}

fn models() -> Rc<HashMap<String, LoadedModel>> {
    MODELS.with(|m| {
        m.borrow_mut()
            .get_or_insert_with(|| {
                let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3-0.6b");
                let bundle = ModelBundle::from_dir("qwen3", &dir, BLOCK).unwrap();
                let tokenizer = Rc::new(ModelTokenizer::from_bundle(&bundle).unwrap().with_segment_cache(1 << 20));
                Rc::new(HashMap::from([(
                    "qwen3".to_owned(),
                    LoadedModel { tokenizer, block_size: BLOCK, salt: Salt::NONE },
                )]))
            })
            .clone()
    })
}

/// Any JSON value, a few levels deep, with strings that include special-token text.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        "\\PC{0,40}".prop_map(Value::String),
        prop_oneof![Just("<|im_start|>"), Just("<think>"), Just("text"), Just("user"), Just("")]
            .prop_map(|s| Value::String(s.into())),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((field(), inner), 0..6).prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// Keys the parsers look at, plus noise.
fn field() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("model"),
        Just("prompt"),
        Just("messages"),
        Just("role"),
        Just("content"),
        Just("type"),
        Just("text"),
        Just("tools"),
        Just("function"),
        Just("arguments"),
        Just("tool_calls"),
        Just("chat_template_kwargs"),
        Just("add_generation_prompt"),
        Just("continue_final_message"),
        Just("add_special_tokens"),
        Just("reasoning_effort"),
        Just("max_tokens"),
        Just("user"),
        Just("session_id"),
        Just("stream"),
        Just("unknown_field"),
    ]
    .prop_map(String::from)
}

/// A request-shaped body: usually our model, fields filled with arbitrary JSON.
fn request_body() -> impl Strategy<Value = Vec<u8>> {
    let role = prop_oneof![Just("system"), Just("user"), Just("assistant"), Just("tool"), Just("developer")];
    let message = (role, any_json()).prop_map(|(role, content)| json!({"role": role, "content": content}));
    (
        prop_oneof![Just(json!("qwen3")), Just(json!("other")), any_json()],
        prop::option::of(any_json()),
        prop::option::of(prop::collection::vec(message, 0..5)),
        prop::collection::vec((field(), any_json()), 0..4),
    )
        .prop_map(|(model, prompt, messages, extra)| {
            let mut body: Map<String, Value> = extra.into_iter().collect();
            body.insert("model".into(), model);
            if let Some(p) = prompt {
                body.insert("prompt".into(), p);
            }
            if let Some(ms) = messages {
                body.insert("messages".into(), Value::Array(ms));
            }
            serde_json::to_vec(&body).unwrap()
        })
}

fn any_body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![request_body(), prop::collection::vec(any::<u8>(), 0..512)]
}

fn check(endpoint: Endpoint, body: &[u8], hints: &RequestKeys, max_bytes: usize) {
    let models = models();
    let listed: HashSet<String> = ["qwen3".to_owned()].into();
    match plan(endpoint, body, hints, &models, Some(&listed), max_bytes) {
        Ok(p) => {
            assert_eq!(p.request.request_id, hints.request_id);
            if p.tokenized && !p.truncated {
                assert_eq!(p.request.block_hashes.len() as u32, p.request.prompt_tokens / BLOCK);
            }
            if let Some(ids) = &p.forwardable {
                match with_token_prompt(endpoint, body, ids) {
                    Some(rewritten) => {
                        let again = plan(endpoint, &rewritten, hints, &models, Some(&listed), max_bytes).unwrap();
                        assert_eq!(again.request.block_hashes, p.request.block_hashes, "forwarded ids hash the same");
                        assert!(again.forwardable.is_none(), "forwarded once");
                    }
                    None => assert_eq!(endpoint, Endpoint::ChatCompletions, "completions always take their ids"),
                }
            }
            let read = envelope(body);
            assert!(
                offload(endpoint, body, read.as_ref(), hints, Some(&listed), 1000).is_ok(),
                "offload accepts what plan accepts"
            );
        }
        Err(Skip::Unroutable(why)) => assert!(!why.is_empty()),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn bodies_never_panic(body in any_body(), chat in any::<bool>(), small in any::<bool>()) {
        let endpoint = if chat { Endpoint::ChatCompletions } else { Endpoint::Completions };
        let hints = RequestKeys { request_id: "r".into(), ..RequestKeys::default() };
        check(endpoint, &body, &hints, if small { 7 } else { 1 << 20 });
    }

    #[test]
    fn headers_never_panic(
        method in prop::option::of("\\PC{0,8}"),
        path in "\\PC{0,40}",
        content_type in prop::option::of("\\PC{0,40}"),
        session in prop::option::of("\\PC{0,20}"),
        overrides in prop::option::of(prop_oneof!["\\PC{0,60}", any_json().prop_map(|v| v.to_string())]),
    ) {
        let endpoint = routable(method.as_deref(), &path, content_type.as_deref());
        if endpoint.is_some() {
            prop_assert_eq!(method.as_deref(), Some("POST"));
        }
        let hints = RequestKeys {
            request_id: "r".into(),
            client_request_id: None,
            session,
            overrides: parse_overrides(overrides.as_deref()),
            wait_ms: 0,
            priority: None,
            tenant: None,
            ttft_slo_ms: None,
            itl_slo_ms: None,
            prefill_legs: false,
        };
        let body = br#"{"model":"qwen3","prompt":"hello there","messages":[{"role":"user","content":"hi"}]}"#;
        check(endpoint.unwrap_or(Endpoint::Completions), body, &hints, 1 << 20);
    }
}
