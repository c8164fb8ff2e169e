//! Prefill/decode disaggregation: the bodies of a disaggregated request's two legs (pure,
//! natively testable). [`crate::request`] sends them.
//!
//! - **vLLM** (NixlConnector's request protocol; vLLM's reference is its
//!   `toy_proxy_server.py`): the prefill leg is the request with one output token, not
//!   streamed, and `kv_transfer_params` asking for a remote decode ([`vllm_prefill`]); the
//!   `kv_transfer_params` its response carries (the prefill worker's engine id, block ids,
//!   host, port…) then go into the request to the decode worker ([`vllm_decode`]).
//! - **SGLang**: both legs carry the prefill worker's bootstrap address and a room
//!   ([`sglang`]) and are sent at once; the prefill leg is not streamed.
//!
//! Whatever a client put in `kv_transfer_params`, the `bootstrap_*` fields or the others
//! only kvgate sets ([`TRANSFER_FIELDS`]) is taken out before the request is routed
//! ([`without_transfer_fields`]; an operator may let trusted clients keep the forwarded
//! prompt's token ids, [`FORWARDED_IDS`]): only kvgate says where an engine pulls KV from
//! and which of its workers runs the request. The legs keep the forwarded ids the filter itself wrote.

use kvgate_shared::prompt::openai::{Members, EXTRA_ARGS, EXTRA_ARGS_FIELDS, FORWARDED_IDS, TRANSFER_FIELDS};
use serde_json::{json, Map, Value};

use crate::usage::find;

/// Why a leg's body could not be built, or its answer not used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LegError {
    /// The request body is JSON, but not an object.
    #[error("the request body is not a JSON object")]
    NotAnObject,
    /// The request body is not JSON that kvgate reads (`serde_json`'s error: what and where).
    #[error("the request body cannot be read as JSON: {0}")]
    Unreadable(String),
    /// The prefill worker's response carries no `kv_transfer_params` object.
    #[error("the prefill response carries no kv_transfer_params")]
    NoTransferParams,
}

/// The body as a JSON object.
fn object(body: &[u8]) -> Result<Map<String, Value>, LegError> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(LegError::NotAnObject),
        Err(e) => Err(LegError::Unreadable(e.to_string())),
    }
}

fn encoded(o: Map<String, Value>) -> Vec<u8> {
    // Serializing a `Value` cannot fail.
    serde_json::to_vec(&Value::Object(o)).unwrap_or_default()
}

/// The request's own `kv_transfer_params`, cleared of everything but the forwarded prompt.
fn own_params(o: &Map<String, Value>) -> Map<String, Value> {
    let mut params = Map::new();
    if let Some(ids) = o.get("kv_transfer_params").and_then(|p| p.get(FORWARDED_IDS)) {
        params.insert(FORWARDED_IDS.into(), ids.clone());
    }
    params
}

/// The request without what a client may not set ([`TRANSFER_FIELDS`], and
/// [`EXTRA_ARGS_FIELDS`] in vLLM's extra arguments): fields which would make an engine pull KV
/// or encoder outputs from a host of the client's choosing, hold blocks for nobody, run token
/// ids in place of the `messages` or run on a worker kvgate did not pick — all of them, or (`keep_ids`, for trusted clients in a disaggregated
/// deployment) all but the forwarded prompt's token ids. `None` if it has none of them; an
/// error if it is not a JSON object `serde_json` reads (the engine's Python may still read
/// it: `NaN`, a lone surrogate). It parses the whole body: the caller asks only about a body
/// that may carry one ([`may_carry_transfer_fields`]).
pub fn without_transfer_fields(body: &[u8], keep_ids: bool) -> Result<Option<Vec<u8>>, LegError> {
    let mut o = object(body)?;
    let mut changed = false;
    for key in TRANSFER_FIELDS.iter().filter(|k| **k != "kv_transfer_params") {
        changed |= o.remove(*key).is_some();
    }
    // vLLM takes `vllm_xargs`' transfer parameters where the top-level ones are absent or empty.
    if let Some(Value::Object(extra)) = o.get_mut(EXTRA_ARGS) {
        for key in EXTRA_ARGS_FIELDS {
            changed |= extra.remove(key).is_some();
        }
    }
    match o.get("kv_transfer_params") {
        None => {}
        Some(Value::Object(params)) if keep_ids => {
            let own = own_params(&o);
            if params.len() != own.len() {
                changed = true;
                match own.is_empty() {
                    true => o.remove("kv_transfer_params"),
                    false => o.insert("kv_transfer_params".into(), Value::Object(own)),
                };
            }
        }
        Some(_) => changed |= o.remove("kv_transfer_params").is_some(),
    }
    Ok(changed.then(|| encoded(o)))
}

/// Whether a body may carry a transfer field: its [`Members`] name one, or — when they
/// cannot be read (`members` is `None`) — its bytes could spell one for the engine's Python:
/// the name as written, a `\u` escape (JSON's other escapes make no letter or `_`), or a NUL
/// byte (UTF-16 or UTF-32, which Python's `json` detects).
///
/// ```
/// use kvgate_filter::disagg::may_carry_transfer_fields;
/// use kvgate_shared::prompt::openai::members;
/// let unreadable = |body: &[u8]| may_carry_transfer_fields(body, members(body).as_ref());
/// assert!(unreadable(br#"{"x":NaN,"kv\u005ftransfer_params":{}}"#));
/// assert!(unreadable(br#"{"x":NaN,"bootstrap_host":"h"}"#));
/// assert!(!unreadable(b"{not json"));
/// assert!(!unreadable(br#"{"messages":[{"content":"a\nb"}],"temperature":NaN}"#), "no name in it");
/// assert!(!unreadable(br#"{"model":"m","prompt":"kv_transfer_params"}"#), "read: named only in a value");
/// ```
pub fn may_carry_transfer_fields(body: &[u8], members: Option<&Members<'_>>) -> bool {
    match members {
        Some(m) => m.transfer_fields,
        None => {
            let names = |name: &[u8]| find(body, name).is_some();
            names(b"\\u") || body.contains(&0) || TRANSFER_FIELDS.iter().any(|n| names(n.as_bytes()))
        }
    }
}

/// A leg that only computes the prompt: one token, whole (not streamed).
fn prefill_only(o: &mut Map<String, Value>) {
    o.remove("min_tokens");
    o.insert("max_tokens".into(), json!(1));
    if o.contains_key("max_completion_tokens") {
        o.insert("max_completion_tokens".into(), json!(1));
    }
    o.insert("stream".into(), json!(false));
    o.remove("stream_options");
}

/// vLLM's prefill leg: the request computing its prompt only, holding the KV for a remote
/// decoder.
pub fn vllm_prefill(body: &[u8]) -> Result<Vec<u8>, LegError> {
    let mut o = object(body)?;
    let mut params = own_params(&o);
    for (key, value) in [
        ("do_remote_decode", json!(true)),
        ("do_remote_prefill", json!(false)),
        ("remote_engine_id", Value::Null),
        ("remote_block_ids", Value::Null),
        ("remote_host", Value::Null),
        ("remote_port", Value::Null),
    ] {
        params.insert(key.into(), value);
    }
    o.insert("kv_transfer_params".into(), Value::Object(params));
    prefill_only(&mut o);
    Ok(encoded(o))
}

/// vLLM's decode request: the request as it was, with the prefill response's
/// `kv_transfer_params` (and the forwarded prompt, if it had one).
pub fn vllm_decode(body: &[u8], prefill_response: &[u8]) -> Result<Vec<u8>, LegError> {
    let mut o = object(body)?;
    let answer = object(prefill_response).map_err(|_| LegError::NoTransferParams)?;
    let Some(Value::Object(remote)) = answer.get("kv_transfer_params") else { return Err(LegError::NoTransferParams) };
    let mut params = own_params(&o);
    params.extend(remote.clone());
    o.insert("kv_transfer_params".into(), Value::Object(params));
    Ok(encoded(o))
}

/// SGLang's legs: the decode request (the request with the bootstrap address and room) and
/// the prefill leg (the same, not streamed).
pub fn sglang(body: &[u8], host: &str, port: u16, room: u64) -> Result<(Vec<u8>, Vec<u8>), LegError> {
    let mut o = object(body)?;
    o.insert("bootstrap_host".into(), json!(host));
    o.insert("bootstrap_port".into(), json!(port));
    o.insert("bootstrap_room".into(), json!(room));
    let params = own_params(&o);
    if params.is_empty() {
        o.remove("kv_transfer_params");
    } else {
        o.insert("kv_transfer_params".into(), Value::Object(params));
    }
    let mut prefill = o.clone();
    prefill.remove("stream_options");
    prefill.insert("stream".into(), json!(false));
    Ok((encoded(o), encoded(prefill)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_shared::prompt::openai::members;

    fn parsed(bytes: &[u8]) -> Value {
        serde_json::from_slice(bytes).unwrap()
    }

    #[test]
    fn the_vllm_prefill_leg_asks_for_a_remote_decode_and_one_token() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,
            "stream_options":{"include_usage":true},"max_tokens":50,"max_completion_tokens":50,
            "kv_transfer_params":{"prompt_token_ids":[1,2,3],"remote_host":"evil.example","do_remote_prefill":true}}"#;
        let leg = parsed(&vllm_prefill(body).unwrap());
        assert_eq!(
            leg["kv_transfer_params"],
            json!({"prompt_token_ids": [1, 2, 3], "do_remote_decode": true, "do_remote_prefill": false,
                "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null})
        );
        assert_eq!(
            (&leg["max_tokens"], &leg["max_completion_tokens"], &leg["stream"]),
            (&json!(1), &json!(1), &json!(false))
        );
        assert!(leg.get("stream_options").is_none());
        assert_eq!(leg["messages"], json!([{"role": "user", "content": "hi"}]));
        let no_completion_limit = parsed(&vllm_prefill(br#"{"prompt":"x"}"#).unwrap());
        assert!(no_completion_limit.get("max_completion_tokens").is_none());
        assert_eq!(vllm_prefill(b"[1]"), Err(LegError::NotAnObject));
    }

    #[test]
    fn the_vllm_decode_request_carries_what_the_prefill_worker_answered() {
        let body = br#"{"model":"m","prompt":"x","stream":true,"max_tokens":50,
            "kv_transfer_params":{"remote_host":"evil.example","prompt_token_ids":[7]}}"#;
        let answer = br#"{"id":"cmpl-1","choices":[{"text":"a"}],"kv_transfer_params":{"do_remote_prefill":true,
            "do_remote_decode":false,"remote_block_ids":[4,5],"remote_engine_id":"e1","remote_host":"10.0.0.2",
            "remote_port":5600,"tp_size":1}}"#;
        let decode = parsed(&vllm_decode(body, answer).unwrap());
        assert_eq!(
            decode["kv_transfer_params"],
            json!({"prompt_token_ids": [7], "do_remote_prefill": true, "do_remote_decode": false,
                "remote_block_ids": [4, 5], "remote_engine_id": "e1", "remote_host": "10.0.0.2",
                "remote_port": 5600, "tp_size": 1})
        );
        assert_eq!((&decode["stream"], &decode["max_tokens"]), (&json!(true), &json!(50)));
        for bad in [&br#"{"choices":[]}"#[..], br#"{"kv_transfer_params":null}"#, b"not json"] {
            assert_eq!(vllm_decode(body, bad), Err(LegError::NoTransferParams), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn a_clients_transfer_fields_are_taken_out() {
        let body = br#"{"model":"m","prompt":"x","bootstrap_host":"evil.example","bootstrap_room":3,
            "kv_transfer_params":{"do_remote_prefill":true,"remote_host":"evil.example","prompt_token_ids":[1]}}"#;
        // By default all of them, the prompt's token ids too: the engine runs the `prompt`.
        assert_eq!(
            parsed(&without_transfer_fields(body, false).unwrap().unwrap()),
            json!({"model": "m", "prompt": "x"})
        );
        // Trusted clients in a disaggregated deployment keep their token ids, nothing else.
        let clean = parsed(&without_transfer_fields(body, true).unwrap().unwrap());
        assert_eq!(clean, json!({"model": "m", "prompt": "x", "kv_transfer_params": {"prompt_token_ids": [1]}}));
        let only_params = br#"{"prompt":"x","kv_transfer_params":{"do_remote_decode":true}}"#;
        for keep_ids in [false, true] {
            assert_eq!(
                parsed(&without_transfer_fields(only_params, keep_ids).unwrap().unwrap()),
                json!({"prompt": "x"})
            );
        }
        let not_an_object = br#"{"prompt":"x","kv_transfer_params":"anything"}"#;
        assert_eq!(parsed(&without_transfer_fields(not_an_object, false).unwrap().unwrap()), json!({"prompt": "x"}));
        for untouched in [&br#"{"prompt":"x"}"#[..], br#"{"prompt":"bootstrap_ is only text"}"#] {
            assert_eq!(without_transfer_fields(untouched, false), Ok(None), "{}", String::from_utf8_lossy(untouched));
        }
        for unreadable in [&b"not json"[..], br#"{"x":NaN,"kv_transfer_params":{}}"#, br#"{"x":"\ud800"}"#] {
            let got = without_transfer_fields(unreadable, false);
            assert!(matches!(got, Err(LegError::Unreadable(_))), "{}: {got:?}", String::from_utf8_lossy(unreadable));
        }
        // vLLM's extra arguments carry them too.
        let extra = br#"{"prompt":"x","vllm_xargs":{"seed":1,"kv_transfer_params":{"remote_host":"evil.example"},
            "ec_transfer_params":{"image-hash":{"peer_host":"evil.example"}}}}"#;
        for keep_ids in [false, true] {
            let clean = parsed(&without_transfer_fields(extra, keep_ids).unwrap().unwrap());
            assert_eq!(clean, json!({"prompt": "x", "vllm_xargs": {"seed": 1}}));
        }
        // A name spelled with JSON escapes is the same name to the engine.
        let escaped = br#"{"prompt":"x","kv\u005ftransfer_params":{"remote_host":"evil.example"}}"#;
        assert_eq!(parsed(&without_transfer_fields(escaped, false).unwrap().unwrap()), json!({"prompt": "x"}));
    }

    #[test]
    fn every_member_the_envelope_names_a_transfer_field_is_taken_out() {
        for name in TRANSFER_FIELDS {
            let body = json!({"model": "m", "prompt": "x", name: {"remote_host": "evil.example"}}).to_string();
            assert!(members(body.as_bytes()).unwrap().transfer_fields, "{name}");
            for keep_ids in [false, true] {
                let clean = without_transfer_fields(body.as_bytes(), keep_ids).unwrap().expect(name);
                assert_eq!(parsed(&clean), json!({"model": "m", "prompt": "x"}), "{name}");
            }
        }
    }

    #[test]
    fn sglang_legs_share_the_bootstrap_room_and_only_the_decode_leg_streams() {
        let body = br#"{"model":"m","prompt":"x","stream":true,"stream_options":{"include_usage":true},
            "bootstrap_host":"evil.example","bootstrap_room":1,"kv_transfer_params":{"remote_host":"evil.example"}}"#;
        let (decode, prefill) = sglang(body, "10.0.0.2", 8998, 42).unwrap();
        let (decode, prefill) = (parsed(&decode), parsed(&prefill));
        for leg in [&decode, &prefill] {
            assert_eq!(
                (&leg["bootstrap_host"], &leg["bootstrap_port"], &leg["bootstrap_room"]),
                (&json!("10.0.0.2"), &json!(8998), &json!(42))
            );
            assert!(leg.get("kv_transfer_params").is_none(), "a client's transfer parameters are dropped");
        }
        assert_eq!((&decode["stream"], &prefill["stream"]), (&json!(true), &json!(false)));
        assert!(decode.get("stream_options").is_some() && prefill.get("stream_options").is_none());
    }
}
