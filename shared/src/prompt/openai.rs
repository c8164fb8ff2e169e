//! Reading an OpenAI `/v1/completions`, `/v1/chat/completions` or `/v1/responses` body, or an
//! Anthropic `/v1/messages` one.
//!
//! Unknown fields are ignored, as vLLM does; only what decides the prompt tokens is read.

use serde_json::{Map, Value};

use super::{chat, messages, responses, PromptError};

/// Which OpenAI endpoint a body was sent to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Endpoint {
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/chat/completions`
    ChatCompletions,
    /// `POST /v1/responses`: rendered as the chat vLLM builds from it.
    Responses,
    /// `POST /v1/messages` (Anthropic's Messages API): rendered as the chat vLLM builds from it.
    Messages,
}

impl Endpoint {
    /// The endpoint for a request path (query string allowed), or `None` if kvgate does not
    /// route it. The path is read as the engine's server reads it: uvicorn (vLLM's and
    /// SGLang's) cuts the query off, then percent-decodes the rest, so `/v1/chat/%63ompletions`
    /// is the chat endpoint there, and here.
    ///
    /// ```
    /// use kvgate_shared::prompt::openai::Endpoint;
    /// assert_eq!(Endpoint::from_path("/v1/chat/completions?x=1"), Some(Endpoint::ChatCompletions));
    /// assert_eq!(Endpoint::from_path("/v1/responses"), Some(Endpoint::Responses));
    /// assert_eq!(Endpoint::from_path("/v1/messages"), Some(Endpoint::Messages));
    /// assert_eq!(Endpoint::from_path("/v1/models"), None);
    /// assert_eq!(Endpoint::from_path("/v1/chat/%63ompletions"), Some(Endpoint::ChatCompletions));
    /// assert_eq!(Endpoint::from_path("/v1%2Fcompletions?a=%3F"), Some(Endpoint::Completions));
    /// assert_eq!(Endpoint::from_path("/v1/completions%3Fx"), None, "a decoded `?` is in the path");
    /// assert_eq!(Endpoint::from_path("/v1/completions%FF"), None);
    /// ```
    pub fn from_path(path: &str) -> Option<Endpoint> {
        let raw = path.split('?').next().unwrap_or("");
        let decoded = percent_encoding::percent_decode_str(raw).decode_utf8().ok()?;
        match decoded.as_ref() {
            "/v1/completions" => Some(Endpoint::Completions),
            "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
            "/v1/responses" => Some(Endpoint::Responses),
            "/v1/messages" => Some(Endpoint::Messages),
            _ => None,
        }
    }

    /// Whether the engine builds the chat from the body itself (Responses, Messages): such a
    /// body cannot carry token ids or be split into a prefill leg, and its response always
    /// reports usage.
    pub fn is_converted(self) -> bool {
        matches!(self, Endpoint::Responses | Endpoint::Messages)
    }
}

/// What the prompt is, before tokenization.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// A completions string prompt.
    Text {
        /// The prompt text.
        text: String,
        /// vLLM's default for completions is `true`.
        add_special_tokens: bool,
    },
    /// Token ids, used verbatim: a completions prompt given as ids, or a chat's forwarded
    /// `kv_transfer_params.prompt_token_ids`.
    Tokens(Vec<u32>),
    /// A chat conversation, already normalised as vLLM does.
    Chat(chat::ChatInput),
    /// The chat vLLM builds from a `/v1/responses` request: a template renders it as a chat;
    /// vLLM renders harmony models' Responses differently, which kvgate does not.
    Responses(chat::ChatInput),
    /// A `/v1/messages` request: a chat once the model's template is known.
    Messages(messages::MessagesChat),
}

/// The parts of an OpenAI request that routing needs.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedRequest {
    /// The `model` field.
    pub model: crate::ids::ModelName,
    /// The prompt to tokenize. For a list of prompts, the first one (see `prompt_count`).
    pub prompt: Prompt,
    /// How many prompts the request carries (a completions list gives one engine request each).
    pub prompt_count: usize,
    /// `max_completion_tokens`, else `max_tokens` (`max_output_tokens` for Responses).
    pub max_tokens: Option<u32>,
    /// Whether the response streams (SSE).
    pub stream: bool,
    /// Whether the stream's end carries `usage`: `stream_options.include_usage`, or always
    /// for Responses (`response.completed`) and Messages (`message_delta`).
    pub include_usage: bool,
    /// The body's `session_id`, else `user` (`metadata.user_id` for Messages): a session key
    /// for sticky policies.
    pub session: Option<String>,
    /// vLLM's `cache_salt`: the prompt's first block is hashed with it, so only requests
    /// with the same salt share cached prefixes.
    pub cache_salt: Option<String>,
    /// Sequences decoded per prompt: `n` (1 without it), at most vLLM's 16 384. vLLM 0.32
    /// has no `best_of` (its request models ignore unknown fields), so neither does kvgate.
    pub samples: u32,
}

/// The largest `n` vLLM accepts (`SamplingParams._verify_num_sequences`).
const MAX_N: u64 = 16_384;

/// Parses a request body for `endpoint`.
///
/// ```
/// use kvgate_shared::prompt::openai::{parse, Endpoint, Prompt};
/// let req = parse(Endpoint::Completions, br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
/// assert_eq!(req.prompt, Prompt::Tokens(vec![1, 2, 3]));
/// assert!(parse(Endpoint::Completions, b"{not json").is_err());
/// ```
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<ParsedRequest, PromptError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| PromptError::Json(e.to_string()))?;
    let Value::Object(obj) = value else {
        return Err(PromptError::Json("top level is not an object".into()));
    };
    let model = match obj.get("model") {
        Some(Value::String(m)) => m.clone(),
        _ => return Err(PromptError::Invalid("`model` must be a string".into())),
    };
    let limits: &[&str] = match endpoint {
        Endpoint::Responses => &["max_output_tokens"],
        _ => &["max_completion_tokens", "max_tokens"],
    };
    let max_tokens =
        limits.iter().find_map(|k| obj.get(*k).and_then(Value::as_u64)).map(|n| n.min(u32::MAX as u64) as u32);
    let stream = obj.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = matches!(endpoint, Endpoint::Responses | Endpoint::Messages)
        || obj.get("stream_options").and_then(|o| o.get("include_usage")).and_then(Value::as_bool).unwrap_or(false);
    let session = match endpoint {
        Endpoint::Messages => obj.get("metadata").and_then(|m| m.get("user_id")).and_then(Value::as_str),
        _ => ["session_id", "user"].iter().find_map(|k| obj.get(*k).and_then(Value::as_str)),
    }
    .map(str::to_owned);
    let (prompt, prompt_count) = match endpoint {
        Endpoint::Completions => completion_prompt(&obj)?,
        Endpoint::ChatCompletions => (chat_prompt(&obj)?, 1),
        Endpoint::Responses => (Prompt::Responses(responses::chat_input(&obj)?), 1),
        Endpoint::Messages => {
            let chat = messages::MessagesChat::from_request(&obj, super::tokenizer::now_unix_secs())?;
            // vLLM passes `kv_transfer_params` on to the chat request, which then uses the ids.
            match forwarded_ids(&obj)? {
                Some(ids) => (Prompt::Tokens(ids), 1),
                None => (Prompt::Messages(chat), 1),
            }
        }
    };
    let cache_salt = match obj.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(_) => return Err(PromptError::Invalid("`cache_salt` must be a non-empty string".into())),
    };
    // Responses and Messages have no `n`: one sequence.
    let samples = match endpoint {
        Endpoint::Responses | Endpoint::Messages => 1,
        _ => obj.get("n").and_then(Value::as_u64).map_or(1, |n| n.clamp(1, MAX_N) as u32),
    };
    Ok(ParsedRequest {
        model: model.into(),
        prompt,
        prompt_count,
        max_tokens,
        stream,
        include_usage,
        session,
        cache_salt,
        samples,
    })
}

/// What [`envelope`] reads of a body: its model and how it streams; every other field is
/// skipped unread. A member given twice counts as its last value, as in Python's `json`.
#[derive(Debug)]
pub struct Envelope<'a> {
    /// The `model`.
    pub model: std::borrow::Cow<'a, str>,
    /// `stream` is `true` (any other value, or none, is false).
    pub stream: bool,
    /// The body has a `stream_options` member (`null` included).
    pub stream_options: bool,
}

impl Envelope<'_> {
    /// The same envelope, holding its own `model`.
    pub fn into_owned(self) -> Envelope<'static> {
        Envelope { model: std::borrow::Cow::Owned(self.model.into_owned()), ..self }
    }
}

/// The top-level members only kvgate may set when it routes: those that make an engine pull
/// KV from a host, hold blocks for a peer or run token ids in place of the prompt (vLLM's
/// `kv_transfer_params`; SGLang's disaggregation fields: `bootstrap_*`, the decode side's TP
/// size, the prefill side's DP rank), pull encoder outputs from a host (vLLM's
/// `ec_transfer_params`), or pick the data-parallel worker that runs the request, which holds
/// its own cache (SGLang's `routed_dp_rank` and `data_parallel_rank`; vLLM's is a header,
/// [`crate::wire::DP_RANK_HEADER`], taken out by Envoy).
pub const TRANSFER_FIELDS: [&str; 10] = [
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
    "disagg_prefill_dp_rank",
    "ec_transfer_params",
    "routed_dp_rank",
    "data_parallel_rank",
];

/// The member whose transfer parameters vLLM also takes (as the request's extra arguments,
/// where the top-level ones are absent or empty).
pub const EXTRA_ARGS: &str = "vllm_xargs";

/// The members of [`EXTRA_ARGS`] vLLM reads as transfer parameters.
pub const EXTRA_ARGS_FIELDS: [&str; 2] = ["kv_transfer_params", "ec_transfer_params"];

/// What [`members`] reads of a JSON object in one pass: the [`Envelope`]'s members, and
/// whether any of [`TRANSFER_FIELDS`] is among them (or one of [`EXTRA_ARGS_FIELDS`] in
/// [`EXTRA_ARGS`]). Names are compared as the engine reads them: after JSON's escapes
/// (`"kv\u005ftransfer_params"` is `kv_transfer_params`).
#[derive(Debug)]
pub struct Members<'a> {
    /// The `model`, if it is a string.
    pub model: Option<std::borrow::Cow<'a, str>>,
    /// `stream` is `true` (any other value, or none, is false).
    pub stream: bool,
    /// The body has a `stream_options` member (`null` included).
    pub stream_options: bool,
    /// The body has a member named as one of [`TRANSFER_FIELDS`], or an [`EXTRA_ARGS`] object
    /// with one of [`EXTRA_ARGS_FIELDS`].
    pub transfer_fields: bool,
}

impl<'a> Members<'a> {
    /// The body's [`Envelope`]: `None` if its `model` is not a string.
    pub fn envelope(self) -> Option<Envelope<'a>> {
        let Members { model, stream, stream_options, .. } = self;
        Some(Envelope { model: model?, stream, stream_options })
    }
}

impl<'de: 'a, 'a> serde::Deserialize<'de> for Members<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::{IgnoredAny, MapAccess, Visitor};
        use std::borrow::Cow;

        /// A value read only for whether it is `true`.
        struct IsTrue(bool);
        impl<'de> serde::Deserialize<'de> for IsTrue {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                d.deserialize_any(Only(|v: Scalar<'_>| matches!(v, Scalar::Bool(true)))).map(IsTrue)
            }
        }

        /// A value read only for the string it is, if it is one.
        struct IfString<'a>(Option<Cow<'a, str>>);
        impl<'de: 'a, 'a> serde::Deserialize<'de> for IfString<'a> {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                d.deserialize_any(Only(|v: Scalar<'de>| match v {
                    Scalar::Str(s) => Some(s),
                    _ => None,
                }))
                .map(IfString)
            }
        }

        /// A JSON value as far as [`Only`] looks at it.
        enum Scalar<'a> {
            Bool(bool),
            Str(Cow<'a, str>),
            Other,
        }

        /// Visits any JSON value, skipping arrays and objects, and keeps what `f` makes of it.
        struct Only<F>(F);
        impl<'de, T, F: FnOnce(Scalar<'de>) -> T> Visitor<'de> for Only<F> {
            type Value = T;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_bool<E>(self, v: bool) -> Result<T, E> {
                Ok((self.0)(Scalar::Bool(v)))
            }
            fn visit_i64<E>(self, _: i64) -> Result<T, E> {
                Ok((self.0)(Scalar::Other))
            }
            fn visit_u64<E>(self, _: u64) -> Result<T, E> {
                Ok((self.0)(Scalar::Other))
            }
            fn visit_f64<E>(self, _: f64) -> Result<T, E> {
                Ok((self.0)(Scalar::Other))
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<T, E> {
                Ok((self.0)(Scalar::Str(Cow::Borrowed(v))))
            }
            fn visit_str<E>(self, v: &str) -> Result<T, E> {
                Ok((self.0)(Scalar::Str(Cow::Owned(v.to_owned()))))
            }
            fn visit_unit<E>(self) -> Result<T, E> {
                Ok((self.0)(Scalar::Other))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, seq: A) -> Result<T, A::Error> {
                IgnoredAny.visit_seq(seq).map(|_| (self.0)(Scalar::Other))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                IgnoredAny.visit_map(map).map(|_| (self.0)(Scalar::Other))
            }
        }

        /// A value read only for whether it is an object with one of [`EXTRA_ARGS_FIELDS`].
        struct NamesParams(bool);
        impl<'de> serde::Deserialize<'de> for NamesParams {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct V;
                impl<'de> Visitor<'de> for V {
                    type Value = NamesParams;
                    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                        f.write_str("any JSON value")
                    }
                    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<NamesParams, A::Error> {
                        let mut named = false;
                        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                            named |= EXTRA_ARGS_FIELDS.contains(&key.as_ref());
                            map.next_value::<IgnoredAny>()?;
                        }
                        Ok(NamesParams(named))
                    }
                    fn visit_bool<E>(self, _: bool) -> Result<NamesParams, E> {
                        Ok(NamesParams(false))
                    }
                    fn visit_i64<E>(self, _: i64) -> Result<NamesParams, E> {
                        Ok(NamesParams(false))
                    }
                    fn visit_u64<E>(self, _: u64) -> Result<NamesParams, E> {
                        Ok(NamesParams(false))
                    }
                    fn visit_f64<E>(self, _: f64) -> Result<NamesParams, E> {
                        Ok(NamesParams(false))
                    }
                    fn visit_str<E>(self, _: &str) -> Result<NamesParams, E> {
                        Ok(NamesParams(false))
                    }
                    fn visit_unit<E>(self) -> Result<NamesParams, E> {
                        Ok(NamesParams(false))
                    }
                    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, seq: A) -> Result<NamesParams, A::Error> {
                        IgnoredAny.visit_seq(seq).map(|_| NamesParams(false))
                    }
                }
                d.deserialize_any(V)
            }
        }

        struct Object;
        impl<'de> Visitor<'de> for Object {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members<'de>, A::Error> {
                let mut members = Members { model: None, stream: false, stream_options: false, transfer_fields: false };
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    match key.as_ref() {
                        "model" => members.model = map.next_value::<IfString<'de>>()?.0,
                        "stream" => members.stream = map.next_value::<IsTrue>()?.0,
                        "stream_options" => {
                            map.next_value::<IgnoredAny>()?;
                            members.stream_options = true;
                        }
                        EXTRA_ARGS => members.transfer_fields |= map.next_value::<NamesParams>()?.0,
                        name => {
                            members.transfer_fields |= TRANSFER_FIELDS.contains(&name);
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                Ok(members)
            }
        }
        deserializer.deserialize_map(Object)
    }
}

/// The [`Members`] of a JSON body, read without building a tree of the rest: for a body too
/// big to parse where it is (a wasm VM never gives memory back), or one [`parse`] refuses.
/// `None` if it is not a JSON object. Bytes in the skipped fields are not checked to be UTF-8.
///
/// ```
/// use kvgate_shared::prompt::openai::members;
/// let m = members(br#"{"prompt":"kv_transfer_params","kv\u005ftransfer_params":{}}"#).unwrap();
/// assert!(m.transfer_fields && m.model.is_none(), "named after its escapes, not in a value");
/// assert!(!members(br#"{"model":"m","messages":[{"bootstrap_host":"h"}]}"#).unwrap().transfer_fields);
/// assert!(members(br#"{"vllm_xargs":{"a":1,"kv_transfer_params":{}}}"#).unwrap().transfer_fields);
/// assert!(members(br#"{"vllm_xargs":{"ec_transfer_params":{}}}"#).unwrap().transfer_fields);
/// assert!(members(br#"{"model":"m","routed_dp_rank":3}"#).unwrap().transfer_fields);
/// assert!(!members(br#"{"vllm_xargs":{"a":"kv_transfer_params"}}"#).unwrap().transfer_fields);
/// assert!(members(b"[1,2]").is_none());
/// ```
pub fn members(body: &[u8]) -> Option<Members<'_>> {
    serde_json::from_slice(body).ok()
}

/// The [`Envelope`] of a JSON body ([`members`]). `None` if it is not a JSON object with a
/// string `model`.
///
/// ```
/// use kvgate_shared::prompt::openai::envelope;
/// let e = envelope(br#"{"stream":true,"model":"m","messages":[]}"#).unwrap();
/// assert!(e.stream && !e.stream_options);
/// let e = envelope(br#"{"model":"m","stream":"yes","stream_options":null}"#).unwrap();
/// assert!(!e.stream && e.stream_options);
/// let e = envelope(br#"{"model":"a","stream":false,"model":"b","stream":true}"#).unwrap();
/// assert!(e.stream && e.model == "b", "the last of each, as Python reads it");
/// assert!(envelope(br#"{"model":1}"#).is_none());
/// ```
pub fn envelope(body: &[u8]) -> Option<Envelope<'_>> {
    members(body)?.envelope()
}

/// The `model` of a JSON body ([`envelope`]).
///
/// ```
/// use kvgate_shared::prompt::openai::model_of;
/// assert_eq!(model_of(br#"{"messages":[{"content":[{"type":"image_url"}]}],"model":"m"}"#).as_deref(), Some("m"));
/// assert_eq!(model_of(b"[1,2]"), None);
/// ```
pub fn model_of(body: &[u8]) -> Option<std::borrow::Cow<'_, str>> {
    envelope(body).map(|e| e.model)
}

fn completion_prompt(obj: &Map<String, Value>) -> Result<(Prompt, usize), PromptError> {
    let add_special_tokens = obj.get("add_special_tokens").and_then(Value::as_bool).unwrap_or(true);
    let text = |s: &str| {
        if s.is_empty() {
            Err(PromptError::Invalid("`prompt` must not be empty".into()))
        } else {
            Ok(Prompt::Text { text: s.to_owned(), add_special_tokens })
        }
    };
    match obj.get("prompt") {
        Some(Value::String(s)) => Ok((text(s)?, 1)),
        Some(Value::Array(items)) if items.is_empty() => {
            Err(PromptError::Invalid("you must pass at least one prompt".into()))
        }
        Some(Value::Array(items)) => match &items[0] {
            Value::String(_) | Value::Array(_) => {
                let first = match &items[0] {
                    Value::String(s) => text(s)?,
                    Value::Array(ids) => Prompt::Tokens(token_ids(ids)?),
                    _ => unreachable!("matched above"),
                };
                Ok((first, items.len()))
            }
            _ => Ok((Prompt::Tokens(token_ids(items)?), 1)),
        },
        _ => Err(PromptError::Invalid("`prompt` must be a string, token ids or a list of them".into())),
    }
}

/// A chat's prompt: its messages — or the token ids forwarded with it. vLLM (0.32 on) takes
/// `kv_transfer_params.prompt_token_ids` on a chat as the prompt and renders and tokenizes
/// nothing, except when `echo` is set or a message has non-text content (then it renders the
/// messages; kvgate's renderer refuses such content before the ids are looked at). A value
/// that is not a non-empty list of token ids is a 400 there, so an error here.
fn chat_prompt(obj: &Map<String, Value>) -> Result<Prompt, PromptError> {
    let chat = chat::ChatInput::from_request(obj)?;
    let echo = obj.get("echo").and_then(Value::as_bool).unwrap_or(false);
    match forwarded_ids(obj)? {
        Some(ids) if !echo => Ok(Prompt::Tokens(ids)),
        _ => Ok(Prompt::Chat(chat)),
    }
}

/// A chat body's forwarded prompt: `kv_transfer_params.prompt_token_ids`, which vLLM 0.32
/// takes as the prompt instead of rendering the messages.
fn forwarded_ids(obj: &Map<String, Value>) -> Result<Option<Vec<u32>>, PromptError> {
    match obj.get("kv_transfer_params").and_then(|kv| kv.get(FORWARDED_IDS)) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) => token_ids(items).map(Some),
        Some(_) => {
            Err(PromptError::Invalid(format!("`kv_transfer_params.{FORWARDED_IDS}` must be a list of token ids")))
        }
    }
}

/// The `kv_transfer_params` key vLLM reads a chat's forwarded prompt token ids from.
pub const FORWARDED_IDS: &str = "prompt_token_ids";

fn token_ids(items: &[Value]) -> Result<Vec<u32>, PromptError> {
    if items.is_empty() {
        return Err(PromptError::Invalid("token prompt must not be empty".into()));
    }
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| PromptError::Invalid(format!("token id {v} is not a u32")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completion(body: &str) -> Result<ParsedRequest, PromptError> {
        parse(Endpoint::Completions, body.as_bytes())
    }

    #[test]
    fn a_chat_with_forwarded_ids_is_those_ids_as_vllm_takes_them() {
        let chat = |extra: &str| {
            let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}]{extra}}}"#);
            parse(Endpoint::ChatCompletions, body.as_bytes())
        };
        assert!(matches!(chat("").unwrap().prompt, Prompt::Chat(_)));
        let forwarded = chat(r#","kv_transfer_params":{"do_remote_decode":false,"prompt_token_ids":[5,6,7]}"#);
        assert_eq!(forwarded.unwrap().prompt, Prompt::Tokens(vec![5, 6, 7]));
        assert!(matches!(chat(r#","kv_transfer_params":{"prompt_token_ids":null}"#).unwrap().prompt, Prompt::Chat(_)));
        let echoed = chat(r#","echo":true,"kv_transfer_params":{"prompt_token_ids":[5]}"#);
        assert!(matches!(echoed.unwrap().prompt, Prompt::Chat(_)), "vLLM renders the messages when echo is set");
        for bad in [r#"[]"#, r#"[true]"#, r#"[1.5]"#, r#"[-1]"#, r#""5 6""#] {
            let body = format!(r#","kv_transfer_params":{{"prompt_token_ids":{bad}}}"#);
            assert!(matches!(chat(&body), Err(PromptError::Invalid(_))), "{bad} is a 400 in vLLM");
        }
    }

    #[test]
    fn completions_prompt_shapes() {
        let r = completion(r#"{"model":"m","prompt":"hi","max_tokens":5,"stream":true}"#).unwrap();
        assert_eq!(r.prompt, Prompt::Text { text: "hi".into(), add_special_tokens: true });
        assert_eq!((r.max_tokens, r.stream, r.prompt_count), (Some(5), true, 1));
        let r = completion(r#"{"model":"m","prompt":["a","b","c"]}"#).unwrap();
        assert_eq!((r.prompt_count, r.prompt), (3, Prompt::Text { text: "a".into(), add_special_tokens: true }));
        let r = completion(r#"{"model":"m","prompt":[[7,8],[9]]}"#).unwrap();
        assert_eq!((r.prompt_count, r.prompt), (2, Prompt::Tokens(vec![7, 8])));
        let r =
            completion(r#"{"model":"m","prompt":"x","stream":true,"stream_options":{"include_usage":true}}"#).unwrap();
        assert!(r.include_usage);
        let r = completion(r#"{"model":"m","prompt":"x","n":3}"#).unwrap();
        assert_eq!(r.samples, 3);
        let r = completion(r#"{"model":"m","prompt":"x","n":2,"best_of":5}"#).unwrap();
        assert_eq!(r.samples, 2, "vLLM 0.32 has no best_of: n sequences run");
        let r = completion(r#"{"model":"m","prompt":"x","n":99999}"#).unwrap();
        assert_eq!(r.samples, 16_384, "no more than vLLM accepts");
        let r = completion(r#"{"model":"m","prompt":"x","user":"u1"}"#).unwrap();
        assert_eq!(r.samples, 1);
        assert!(!r.include_usage);
        assert_eq!(r.session.as_deref(), Some("u1"));
        let r = completion(r#"{"model":"m","prompt":"x","add_special_tokens":false,"unknown":{"a":1}}"#).unwrap();
        assert_eq!(r.prompt, Prompt::Text { text: "x".into(), add_special_tokens: false });
    }

    #[test]
    fn bad_bodies_are_errors() {
        for body in [
            "",
            "[]",
            r#"{"prompt":"x"}"#,
            r#"{"model":"m","prompt":""}"#,
            r#"{"model":"m","prompt":[]}"#,
            r#"{"model":"m","prompt":[-1]}"#,
            r#"{"model":"m","prompt":[1.5]}"#,
            r#"{"model":"m","prompt":{"a":1}}"#,
        ] {
            assert!(completion(body).is_err(), "{body} should be rejected");
        }
    }
}
