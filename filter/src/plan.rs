//! The pure part of the filter: from a request body to the [`RouteRequest`] for the sidecar.
//! No hostcalls here, so it runs (and is tested) natively too.

use std::collections::{HashMap, HashSet};
use std::rc::Rc;

use kvgate_shared::hash::{prompt_digest, Salt};
use kvgate_shared::ids::{ModelName, RequestId};
use kvgate_shared::prompt::openai::{model_of, parse, Endpoint, Envelope, Prompt, FORWARDED_IDS};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::route::{estimated_request, route_request, PromptTokens, RequestKeys};
use kvgate_shared::wire::{RouteBodyRequest, RouteRequest, ScoringOverrides};

use crate::usage::find;

/// A model (or LoRA adapter) the filter can tokenize for.
pub struct LoadedModel {
    /// Its tokenizer and chat template (an adapter shares its base model's).
    pub tokenizer: Rc<ModelTokenizer>,
    /// The pool's block size.
    pub block_size: u32,
    /// The hash salt: the adapter's for a LoRA adapter, none for a base model.
    pub salt: Salt,
}

/// Why a request is passed through without asking the sidecar (Envoy's LB decides).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skip {
    /// The body is not a request we can route (bad JSON, no model…); the engine will answer.
    Unroutable(String),
}

/// The decision request, plus what the filter reports about it.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// What to send to the sidecar.
    pub request: RouteRequest,
    /// True when the prompt was tokenized (false: load-only routing on an estimate).
    pub tokenized: bool,
    /// True when only the prompt's head was tokenized (`max_tokenize_bytes`): the hashes
    /// cover the head, the token count is extrapolated.
    pub truncated: bool,
    /// The complete prompt token ids of a `/v1/completions` request with one string prompt, or
    /// of a chat: what token forwarding may send the engine instead of the text.
    pub forwardable: Option<Vec<u32>>,
    /// [`prompt_digest`] of the tokenized prompt (its head, if truncated).
    pub digest: Option<u64>,
    /// Why the prompt could not be read, when the request is routed (and booked) on an
    /// estimate of its size: content parts kvgate does not render, a failing template.
    pub untokenizable: Option<String>,
}

/// Which requests the filter routes: `POST` to `/v1/completions`, `/v1/chat/completions`,
/// `/v1/responses` or `/v1/messages` (the path as the engine reads it: [`Endpoint::from_path`])
/// with a body the engine reads as JSON ([`read_as_json`]). Everything else passes through
/// untouched, with no sidecar call.
///
/// ```
/// use kvgate_filter::plan::routable;
/// use kvgate_shared::prompt::openai::Endpoint;
///
/// assert_eq!(routable(Some("POST"), "/v1/completions", Some("application/json; charset=utf-8")), Some(Endpoint::Completions));
/// assert_eq!(routable(Some("GET"), "/v1/completions", None), None);
/// assert_eq!(routable(Some("POST"), "/v1/embeddings", None), None);
/// assert_eq!(routable(Some("POST"), "/v1/chat/completions", Some("text/plain")), None);
/// assert_eq!(routable(Some("POST"), "/v1/chat/%63ompletions", Some("application/x+json")), Some(Endpoint::ChatCompletions));
/// ```
pub fn routable(method: Option<&str>, path: &str, content_type: Option<&str>) -> Option<Endpoint> {
    if method != Some("POST") || !read_as_json(content_type) {
        return None;
    }
    Endpoint::from_path(path)
}

/// Whether the engine's server may read a body of this content type as JSON: FastAPI
/// (vLLM's and SGLang's) does with none (or an empty one), with `application/json` and with
/// any `application/…+json`. Some of their routes also insist on `application/json` itself
/// (vLLM's OpenAI ones), so this takes in more than any one route reads, which costs only a
/// buffered body. Any other body is not parsed there, so it needs no routing and carries
/// nothing to take out.
///
/// ```
/// use kvgate_filter::plan::read_as_json;
/// for ct in [None, Some(""), Some("Application/JSON"), Some("application/vnd.api+json; charset=utf-8")] {
///     assert!(read_as_json(ct), "{ct:?}");
/// }
/// for ct in ["text/plain", "application/x-www-form-urlencoded", "application/jsonl", "text/json"] {
///     assert!(!read_as_json(Some(ct)), "{ct}");
/// }
/// ```
pub fn read_as_json(content_type: Option<&str>) -> bool {
    let essence = content_type.map_or("", |ct| ct.split(';').next().unwrap_or("").trim());
    if essence.is_empty() {
        return true;
    }
    let Some((kind, subtype)) = essence.split_once('/') else { return false };
    let subtype = subtype.to_ascii_lowercase();
    kind.eq_ignore_ascii_case("application") && (subtype == "json" || subtype.ends_with("+json"))
}

/// A rough token count for prompts we cannot tokenize: ~4 bytes per token.
fn estimate_tokens(body_len: usize) -> u32 {
    u32::try_from(body_len / 4).unwrap_or(u32::MAX)
}

/// The booking key of one stream: the VM's random tag and the stream's context id, which
/// Envoy never reuses within a VM. Unique across the workers' VMs and across Envoy restarts,
/// and nothing a client sends goes into it.
///
/// ```
/// assert_eq!(kvgate_filter::plan::booking_id(0xabc, 7), "0000000000000abc-7");
/// ```
pub fn booking_id(vm_tag: u64, context_id: u32) -> RequestId {
    RequestId::new(format!("{vm_tag:016x}-{context_id}"))
}

/// Parses the `x-kvgate-scoring` header value; anything invalid is dropped.
pub fn parse_overrides(value: Option<&str>) -> Option<ScoringOverrides> {
    value.and_then(|v| serde_json::from_str(v).ok())
}

/// Plans the routing call for one request body. `listed` is the sidecar's model list once
/// known: a request for any other model passes through to Envoy's own routing.
///
/// Without a loaded tokenizer for the model the plan routes on load alone with an estimated
/// prompt size; requests are never held back. A prompt longer than `max_tokenize_bytes` is
/// routed on its head (exactly its first tokens) with an extrapolated size, which bounds the
/// time an Envoy worker spends tokenizing.
pub fn plan(
    endpoint: Endpoint,
    body: &[u8],
    hints: &RequestKeys,
    models: &HashMap<String, LoadedModel>,
    listed: Option<&HashSet<String>>,
    max_tokenize_bytes: usize,
) -> Result<Plan, Skip> {
    let parsed = match parse(endpoint, body) {
        Ok(parsed) => parsed,
        Err(e) => return estimated(body, hints, models, listed, e.to_string()),
    };
    if listed.is_some_and(|names| !names.contains(parsed.model.as_str())) {
        return Err(Skip::Unroutable(format!("model {:?} is not routed by kvgate", parsed.model)));
    }
    let load_only = |block_size: u32| Plan {
        request: route_request(
            &parsed,
            hints,
            PromptTokens::Estimated { tokens: estimate_tokens(body.len()), block_size },
        ),
        tokenized: false,
        truncated: false,
        forwardable: None,
        digest: None,
        untokenizable: None,
    };
    let Some(model) = models.get(parsed.model.as_str()) else { return Ok(load_only(0)) };
    let head = match model.tokenizer.prompt_head(&parsed, max_tokenize_bytes) {
        Ok(head) => head,
        Err(e) => return estimated(body, hints, models, listed, e.to_string()),
    };
    if head.tokens.is_empty() && head.truncated {
        return Ok(load_only(model.block_size));
    }
    // One text prompt or a chat, tokenized whole, may go upstream as its ids instead.
    let forwardable = match parsed.prompt {
        Prompt::Text { .. } => parsed.prompt_count == 1,
        Prompt::Chat(_) => true,
        Prompt::Tokens(_) | Prompt::Responses(_) | Prompt::Messages(_) => false,
    };
    Ok(Plan {
        truncated: head.truncated,
        request: route_request(
            &parsed,
            hints,
            PromptTokens::Tokenized {
                tokens: &head.tokens,
                total: head.estimated_total,
                block_size: model.block_size,
                salt: model.salt,
            },
        ),
        tokenized: true,
        digest: Some(prompt_digest(&head.tokens)),
        forwardable: (forwardable && !head.truncated).then_some(head.tokens),
        untokenizable: None,
    })
}

/// A body whose prompt cannot be read (`why`): if it is still a request for a model kvgate
/// routes, it is routed and booked on an estimate of its size; otherwise it passes through.
fn estimated(
    body: &[u8],
    hints: &RequestKeys,
    models: &HashMap<String, LoadedModel>,
    listed: Option<&HashSet<String>>,
    why: String,
) -> Result<Plan, Skip> {
    // Not UTF-8 is not JSON, even where serde would skip the bytes unread.
    let model = std::str::from_utf8(body).ok().and(model_of(body));
    let Some(model) = model.as_deref() else { return Err(Skip::Unroutable(why)) };
    if listed.is_some_and(|names| !names.contains(model)) {
        return Err(Skip::Unroutable(format!("model {model:?} is not routed by kvgate")));
    }
    let block_size = models.get(model).map_or(0, |m| m.block_size);
    Ok(Plan {
        request: estimated_request(model, hints, estimate_tokens(body.len()), block_size),
        tokenized: false,
        truncated: false,
        forwardable: None,
        digest: None,
        untokenizable: Some(why),
    })
}

/// Output tokens in a chunk of a streamed (SSE) completion: vLLM sends one `data:` event per
/// generated token (or a few, for speculative decoding: this then counts low); `[DONE]` and
/// the usage event (no `choices`) are not tokens. A named event is a token only if it is a
/// delta of the output: the Responses API's `….delta`, the Messages API's `content_block_delta`.
///
/// ```
/// let chunk = b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[],\"usage\":{}}\n\ndata: [DONE]\n\n";
/// assert_eq!(kvgate_filter::plan::streamed_tokens(chunk), 1);
/// let events = b"event: response.created\ndata: {}\n\nevent: response.output_text.delta\ndata: {}\n\n";
/// assert_eq!(kvgate_filter::plan::streamed_tokens(events), 1);
/// let anthropic = b"event: content_block_delta\ndata: {}\n\nevent: message_delta\ndata: {}\n\n";
/// assert_eq!(kvgate_filter::plan::streamed_tokens(anthropic), 1);
/// ```
pub fn streamed_tokens(chunk: &[u8]) -> u32 {
    let mut n = 0;
    let mut event: Option<&[u8]> = None;
    for line in chunk.split(|b| *b == b'\n') {
        if let Some(name) = line.strip_prefix(b"event:") {
            event = Some(name.trim_ascii());
        } else if let Some(data) = line.strip_prefix(b"data:") {
            let token = match event.take() {
                Some(name) => name.ends_with(b".delta") || name == b"content_block_delta",
                None => data.trim_ascii() != b"[DONE]" && find(data, b"\"choices\":[]").is_none(),
            };
            n += u32::from(token);
        }
    }
    n
}

/// How much of a response's end the filter keeps to find the engine's `usage` in.
pub const USAGE_TAIL_BYTES: usize = 4096;

/// The engine's `usage` (`prompt_tokens`, and `prompt_tokens_details.cached_tokens` if
/// reported; `input_tokens` and `input_tokens_details.cached_tokens` for Responses; for
/// Messages, whose `input_tokens` leave out what the cache read and wrote, their sum with
/// `cache_read_input_tokens` and `cache_creation_input_tokens`) from the end of a response:
/// the JSON body, or a stream's last events (a stream carries usage when
/// `stream_options.include_usage` asks for it, a Responses stream in `response.completed`, a
/// Messages stream in `message_delta`). `None` if the tail holds no usage.
///
/// ```
/// let tail = br#"data: {"choices":[],"usage":{"prompt_tokens":1215,"total_tokens":1217,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":1200}}}
///
/// data: [DONE]"#;
/// assert_eq!(kvgate_filter::plan::engine_usage(tail), Some((1215, Some(1200))));
/// assert_eq!(kvgate_filter::plan::engine_usage(br#"{"usage":{"prompt_tokens":7}}"#), Some((7, None)));
/// assert_eq!(kvgate_filter::plan::engine_usage(b"data: [DONE]"), None);
/// let completed = br#"event: response.completed
/// data: {"response":{"usage":{"input_tokens":40,"input_tokens_details":{"cached_tokens":32,"cached_tokens_per_turn":[]},"output_tokens":4}},"type":"response.completed"}"#;
/// assert_eq!(kvgate_filter::plan::engine_usage(completed), Some((40, Some(32))));
/// let delta = br#"event: message_delta
/// data: {"type":"message_delta","delta":{"stop_reason":"max_tokens"},"usage":{"input_tokens":8,"output_tokens":4,"cache_read_input_tokens":32}}"#;
/// assert_eq!(kvgate_filter::plan::engine_usage(delta), Some((40, Some(32))));
/// assert_eq!(kvgate_filter::plan::engine_usage(br#"{"usage":{"input_tokens":40,"output_tokens":4}}"#), Some((40, None)));
/// ```
pub fn engine_usage(tail: &[u8]) -> Option<(u32, Option<u32>)> {
    let number = usage_reader(tail)?;
    let prompt = number(b"\"prompt_tokens\"").or_else(|| number(b"\"input_tokens\""))?;
    if let Some(read) = number(b"\"cache_read_input_tokens\"") {
        let written = number(b"\"cache_creation_input_tokens\"").unwrap_or(0);
        return Some((prompt.saturating_add(read).saturating_add(written), Some(read)));
    }
    Some((prompt, number(b"\"cached_tokens\"")))
}

/// The tokens the engine says it produced (`usage.completion_tokens`; `output_tokens` for
/// Responses and Messages), from the end of a response as [`engine_usage`] reads it.
///
/// ```
/// use kvgate_filter::plan::output_tokens;
/// let tail = br#"data: {"choices":[],"usage":{"prompt_tokens":12,"total_tokens":40,"completion_tokens":28}}
///
/// data: [DONE]"#;
/// assert_eq!(output_tokens(tail), Some(28));
/// assert_eq!(output_tokens(br#"{"usage":{"input_tokens":8,"output_tokens":4}}"#), Some(4));
/// assert_eq!(output_tokens(br#"{"usage":{"prompt_tokens":7}}"#), None);
/// ```
pub fn output_tokens(tail: &[u8]) -> Option<u32> {
    let number = usage_reader(tail)?;
    number(b"\"completion_tokens\"").or_else(|| number(b"\"output_tokens\""))
}

/// Reads the whole number after a key in the last `usage` of `tail`; `None` if it has none.
fn usage_reader(tail: &[u8]) -> Option<impl Fn(&[u8]) -> Option<u32> + '_> {
    let usage = &tail[find_last(tail, b"\"usage\"")?..];
    Some(move |key: &[u8]| -> Option<u32> {
        let from = find_last(usage, key)? + key.len();
        let rest = usage[from..].trim_ascii_start().strip_prefix(b":")?.trim_ascii_start();
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
    })
}

fn find_last(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).rposition(|w| w == needle)
}

/// Token forwarding: `body` rewritten to carry its prompt as token ids, so the engine
/// tokenizes nothing. A completions `prompt` is replaced by the ids (vLLM and SGLang take
/// token-id prompts); a chat gets them as `kv_transfer_params.prompt_token_ids` beside any
/// parameters the client sent there (vLLM 0.32 on then skips rendering and tokenizing). `None`
/// when the body cannot carry them: not a JSON object, a chat with `echo` set (vLLM renders
/// those anyway) or whose `kv_transfer_params` is not an object.
///
/// ```
/// use kvgate_shared::prompt::openai::Endpoint;
/// use kvgate_filter::plan::with_token_prompt;
/// let body = br#"{"model":"m","prompt":"hello world","max_tokens":4}"#;
/// let forwarded = with_token_prompt(Endpoint::Completions, body, &[9707, 1879]).unwrap();
/// let v: serde_json::Value = serde_json::from_slice(&forwarded).unwrap();
/// assert_eq!((&v["prompt"], &v["max_tokens"]), (&serde_json::json!([9707, 1879]), &serde_json::json!(4)));
/// let chat = br#"{"model":"m","messages":[],"kv_transfer_params":{"x":1}}"#;
/// let v: serde_json::Value = serde_json::from_slice(&with_token_prompt(Endpoint::ChatCompletions, chat, &[7]).unwrap()).unwrap();
/// assert_eq!(v["kv_transfer_params"], serde_json::json!({"x": 1, "prompt_token_ids": [7]}));
/// ```
pub fn with_token_prompt(endpoint: Endpoint, body: &[u8], ids: &[u32]) -> Option<Vec<u8>> {
    use serde_json::{Map, Value};
    let mut request: Map<String, Value> = serde_json::from_slice(body).ok()?;
    match endpoint {
        Endpoint::Completions => {
            request.insert("prompt".into(), ids.into());
        }
        Endpoint::Responses | Endpoint::Messages => return None,
        Endpoint::ChatCompletions => {
            if request.get("echo").and_then(Value::as_bool) == Some(true) {
                return None;
            }
            let params = request.entry("kv_transfer_params").or_insert_with(|| Value::Object(Map::new()));
            if params.is_null() {
                *params = Value::Object(Map::new());
            }
            params.as_object_mut()?.insert(FORWARDED_IDS.into(), ids.into());
        }
    }
    serde_json::to_vec(&request).ok()
}

/// Plans an offload: the whole body goes to the sidecar, which parses and tokenizes it. Here
/// only its [`Envelope`] is read (`envelope`, already read: no tree of the body in the VM),
/// so that bodies that are not JSON objects with a model, and models kvgate does not route,
/// pass through as [`plan`] would let them; anything else the sidecar rejects falls back to
/// Envoy's LB. Returns the model with the request.
pub fn offload<'a>(
    endpoint: Endpoint,
    body: &'a [u8],
    envelope: Option<&Envelope<'_>>,
    hints: &RequestKeys,
    listed: Option<&HashSet<String>>,
    budget_ms: u64,
) -> Result<(ModelName, RouteBodyRequest<'a>), Skip> {
    let model = &envelope.ok_or_else(|| Skip::Unroutable("not a JSON object with a string `model`".into()))?.model;
    if listed.is_some_and(|names| !names.contains(model.as_ref())) {
        return Err(Skip::Unroutable(format!("model {model:?} is not routed by kvgate")));
    }
    let request = RouteBodyRequest {
        request_id: hints.request_id.clone(),
        client_request_id: hints.client_request_id.clone(),
        endpoint,
        body: std::borrow::Cow::Borrowed(body),
        session: hints.session.clone(),
        overrides: hints.overrides,
        budget_ms: u32::try_from(budget_ms).unwrap_or(u32::MAX),
        wait_ms: hints.wait_ms,
        priority: hints.priority.clone(),
        tenant: hints.tenant.clone(),
        ttft_slo_ms: hints.ttft_slo_ms,
        itl_slo_ms: hints.itl_slo_ms,
        prefill_legs: hints.prefill_legs,
    };
    Ok((ModelName::from(model.as_ref()), request))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_shared::prompt::openai::envelope;
    use kvgate_shared::wire::ModelBundle;
    use kvgate_shared::wire::PromptCount;
    use std::path::Path;

    fn models() -> HashMap<String, LoadedModel> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3-0.6b");
        let bundle = ModelBundle::from_dir("qwen3", &dir, 4).unwrap();
        let tokenizer = Rc::new(ModelTokenizer::from_bundle(&bundle).unwrap());
        let adapter =
            LoadedModel { tokenizer: tokenizer.clone(), block_size: 4, salt: Salt::for_lora(Some("my-lora")) };
        HashMap::from([
            ("qwen3".to_owned(), LoadedModel { tokenizer, block_size: 4, salt: Salt::NONE }),
            ("my-lora".to_owned(), adapter),
        ])
    }

    fn hints() -> RequestKeys {
        RequestKeys { request_id: "r".into(), ..Default::default() }
    }

    #[test]
    fn adapters_salt_their_hashes() {
        let m = models();
        let base = plan(
            Endpoint::Completions,
            br#"{"model":"qwen3","prompt":"one two three four five six seven eight"}"#,
            &hints(),
            &m,
            None,
            1 << 20,
        )
        .unwrap();
        let lora = plan(
            Endpoint::Completions,
            br#"{"model":"my-lora","prompt":"one two three four five six seven eight"}"#,
            &hints(),
            &m,
            None,
            1 << 20,
        )
        .unwrap();
        assert_eq!(base.request.prompt_tokens, lora.request.prompt_tokens, "same tokenizer");
        assert!(!lora.request.block_hashes.is_empty());
        assert!(
            base.request.block_hashes.iter().all(|h| !lora.request.block_hashes.contains(h)),
            "an adapter's blocks never match the base model's"
        );
    }

    #[test]
    fn session_comes_from_the_header_else_the_body() {
        let m = models();
        let body = br#"{"model":"qwen3","prompt":"hi","user":"alice"}"#;
        assert_eq!(
            plan(Endpoint::Completions, body, &hints(), &m, None, 1 << 20).unwrap().request.session.as_deref(),
            Some("alice")
        );
        let h = RequestKeys { session: Some("s-1".into()), ..hints() };
        assert_eq!(
            plan(Endpoint::Completions, body, &h, &m, None, 1 << 20).unwrap().request.session.as_deref(),
            Some("s-1")
        );
        assert_eq!(parse_overrides(Some(r#"{"temperature": 0.5}"#)).unwrap().temperature, Some(0.5));
        assert_eq!(parse_overrides(Some(r#"{"nope": 1}"#)), None);
        assert_eq!(parse_overrides(Some("garbage")), None);
    }

    #[test]
    fn tokenizes_and_hashes_full_blocks() {
        let m = models();
        let body = br#"{"model":"qwen3","messages":[{"role":"user","content":"What is the capital of France?"}]}"#;
        let p = plan(Endpoint::ChatCompletions, body, &hints(), &m, None, 1 << 20).unwrap();
        assert!(p.tokenized);
        let n = p.request.prompt_tokens as usize;
        assert!(n > 8);
        assert_eq!(p.request.block_hashes.len(), n / 4);
        assert_eq!(p.request.block_size, 4);
    }

    #[test]
    fn unknown_model_routes_on_load_only_and_long_prompts_on_their_head() {
        let m = models();
        let body = br#"{"model":"other","prompt":"hello"}"#;
        let p = plan(Endpoint::Completions, body, &hints(), &m, None, 1 << 20).unwrap();
        assert!(!p.tokenized && p.request.block_hashes.is_empty());
        // A long prompt is routed on its head: the hashes are exactly the full prompt's first.
        let text = "The quick brown fox jumps over the lazy dog. ".repeat(40);
        let body = serde_json::json!({"model": "qwen3", "prompt": text}).to_string();
        let full = plan(Endpoint::Completions, body.as_bytes(), &hints(), &m, None, 1 << 20).unwrap();
        let head = plan(Endpoint::Completions, body.as_bytes(), &hints(), &m, None, 300).unwrap();
        assert!(head.truncated && !full.truncated);
        assert!(!head.request.block_hashes.is_empty());
        assert_eq!(head.request.block_hashes[..], full.request.block_hashes[..head.request.block_hashes.len()]);
        let (est, exact) = (head.request.prompt_tokens as f64, full.request.prompt_tokens as f64);
        assert!((est - exact).abs() / exact < 0.1, "extrapolated {est} vs {exact}");
    }

    #[test]
    fn models_kvgate_does_not_route_pass_through() {
        let m = models();
        let listed: HashSet<String> = ["qwen3".to_owned(), "my-lora".to_owned()].into();
        let body = br#"{"model":"other","prompt":"hello"}"#;
        assert!(matches!(
            plan(Endpoint::Completions, body, &hints(), &m, Some(&listed), 1 << 20),
            Err(Skip::Unroutable(_))
        ));
        let body = br#"{"model":"my-lora","prompt":"hello"}"#;
        assert!(plan(Endpoint::Completions, body, &hints(), &m, Some(&listed), 1 << 20).is_ok());
    }

    #[test]
    fn malformed_bodies_are_skipped_and_invalid_requests_estimated() {
        let m = models();
        assert!(matches!(plan(Endpoint::Completions, b"{oops", &hints(), &m, None, 1 << 20), Err(Skip::Unroutable(_))));
        // A request for a routed model that the engine will refuse is booked on an estimate
        // until its 400 ends it: what kvgate cannot read it does not second-guess.
        let invalid =
            plan(Endpoint::ChatCompletions, br#"{"model":"qwen3","messages":"x"}"#, &hints(), &m, None, 1 << 20);
        assert!(invalid.unwrap().untokenizable.is_some());
    }

    #[test]
    fn whole_single_string_prompts_and_chats_are_forwardable() {
        let m = models();
        let p = |endpoint, body: &str, max| plan(endpoint, body.as_bytes(), &hints(), &m, None, max).unwrap();
        let text = r#"{"model":"qwen3","prompt":"one two three four five six"}"#;
        let ids = p(Endpoint::Completions, text, 1 << 20).forwardable.unwrap();
        assert_eq!(ids.len(), p(Endpoint::Completions, text, 1 << 20).request.prompt_tokens as usize);
        let body = with_token_prompt(Endpoint::Completions, text.as_bytes(), &ids).unwrap();
        let again = plan(Endpoint::Completions, &body, &hints(), &m, None, 1 << 20).unwrap();
        assert_eq!(again.request.block_hashes, p(Endpoint::Completions, text, 1 << 20).request.block_hashes);
        assert_eq!(again.forwardable, None, "already tokens");
        assert_eq!(p(Endpoint::Completions, text, 12).forwardable, None, "only a head was tokenized");
        let list = r#"{"model":"qwen3","prompt":["one two","three"]}"#;
        assert_eq!(p(Endpoint::Completions, list, 1 << 20).forwardable, None, "several prompts");
        assert_eq!(with_token_prompt(Endpoint::Completions, b"[1]", &[1]), None);

        let chat = r#"{"model":"qwen3","messages":[{"role":"user","content":"hi"}],"kv_transfer_params":{"k":"v"}}"#;
        let planned = p(Endpoint::ChatCompletions, chat, 1 << 20);
        let ids = planned.forwardable.clone().expect("a chat tokenized whole");
        let body = with_token_prompt(Endpoint::ChatCompletions, chat.as_bytes(), &ids).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["kv_transfer_params"]["k"], "v", "the client's parameters stay");
        assert_eq!(v["messages"][0]["content"], "hi", "the messages stay (vLLM still validates them)");
        let again = plan(Endpoint::ChatCompletions, &body, &hints(), &m, None, 1 << 20).unwrap();
        assert_eq!(again.request.block_hashes, planned.request.block_hashes, "the ids hash as the rendered chat");
        assert_eq!(again.forwardable, None, "already tokens");
        let echo = r#"{"model":"qwen3","messages":[{"role":"user","content":"hi"}],"echo":true}"#;
        assert_eq!(with_token_prompt(Endpoint::ChatCompletions, echo.as_bytes(), &ids), None, "echo renders");
        let odd = r#"{"model":"qwen3","messages":[{"role":"user","content":"hi"}],"kv_transfer_params":[1]}"#;
        assert_eq!(with_token_prompt(Endpoint::ChatCompletions, odd.as_bytes(), &ids), None);
    }

    #[test]
    fn a_request_whose_prompt_cannot_be_read_is_routed_on_an_estimate() {
        let m = models();
        let image = br#"{"model":"qwen3","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:x"}}]}]}"#;
        let p = plan(Endpoint::ChatCompletions, image, &hints(), &m, None, 1 << 20).unwrap();
        assert!(!p.tokenized && p.untokenizable.is_some(), "routed and booked, on load alone");
        assert_eq!((p.request.model.as_str(), p.request.prompt_count), ("qwen3", PromptCount::Estimated));
        assert!(p.request.prompt_tokens > 0 && p.request.block_hashes.is_empty());
        let listed = HashSet::from(["other".to_owned()]);
        assert!(plan(Endpoint::ChatCompletions, image, &hints(), &m, Some(&listed), 1 << 20).is_err(), "unlisted");
        for not_a_request in [&b"{not json"[..], b"[1,2,3]", br#"{"messages":[]}"#] {
            assert!(plan(Endpoint::ChatCompletions, not_a_request, &hints(), &m, None, 1 << 20).is_err());
        }
    }

    #[test]
    fn offload_hands_over_the_body_and_respects_the_model_list() {
        let body = br#"{"model":"qwen3","messages":[{"role":"user","content":"hi"}],"user":"u1"}"#;
        let hints = RequestKeys {
            request_id: "r9".into(),
            client_request_id: Some("client".into()),
            session: Some("s".into()),
            overrides: None,
            wait_ms: 250,
            priority: Some("batch".into()),
            tenant: Some("t1".into()),
            ttft_slo_ms: Some(300),
            itl_slo_ms: Some(40),
            prefill_legs: true,
        };
        fn off<'a>(
            endpoint: Endpoint,
            body: &'a [u8],
            hints: &RequestKeys,
            listed: Option<&HashSet<String>>,
        ) -> Result<(ModelName, RouteBodyRequest<'a>), Skip> {
            offload(endpoint, body, envelope(body).as_ref(), hints, listed, 1000)
        }
        let (model, req) = off(Endpoint::ChatCompletions, body, &hints, None).unwrap();
        assert_eq!(
            (req.request_id.as_str(), req.endpoint, req.session.as_deref()),
            ("r9", Endpoint::ChatCompletions, Some("s"))
        );
        assert_eq!(req.wait_ms, 250, "the sidecar's admission queue holds it at most this long");
        assert_eq!((req.priority.as_deref(), req.tenant.as_deref()), (Some("batch"), Some("t1")));
        assert_eq!(req.ttft_slo_ms, Some(300), "the sidecar holds the offloaded request to it too");
        assert_eq!(req.itl_slo_ms, Some(40));
        assert_eq!((model.as_str(), req.client_request_id.as_deref()), ("qwen3", Some("client")));
        assert_eq!(req.body.as_ref(), body);
        let listed = HashSet::from(["other".to_owned()]);
        assert!(off(Endpoint::ChatCompletions, body, &hints, Some(&listed)).is_err(), "unlisted model");
        assert!(off(Endpoint::Completions, b"{oops", &hints, None).is_err(), "unparsable body");
        assert!(off(Endpoint::Completions, br#"{"model":7}"#, &hints, None).is_err(), "no model name");
    }
}
