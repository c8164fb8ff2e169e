//! Chat requests: the conversation, tools and template kwargs exactly as vLLM hands them to
//! the chat template (`renderers/chat_utils.py`, `renderers/params.py` in vLLM 0.32).
//!
//! The rules implemented here, each visible in the prompt ids:
//! - content is shaped for the template's [`ContentFormat`] at render time
//!   ([`ChatInput::messages_for`]): for `string` templates list content (OpenAI content parts)
//!   becomes its non-empty text parts joined with `"\n"` and `null` becomes `""`; for `openai`
//!   templates every content becomes a list of `{"type": "text", "text": …}` parts (`null` →
//!   `[]`); `tool` messages always get the joined string;
//! - only `role`, `content`, `name`, and per role `tool_calls`/`reasoning`/`tool_call_id` survive;
//! - tool-call `arguments` strings are parsed into objects (invalid or non-object → `{}`) for
//!   the template, which re-serialises them (the raw string is kept: harmony renders it as sent);
//! - tools are re-serialised in OpenAI's canonical key order, `description`/`parameters`
//!   always present;
//! - `add_generation_prompt`/`continue_final_message` top-level fields beat
//!   `chat_template_kwargs`; `null` and `"auto"` kwargs are dropped; `reasoning_effort` implies
//!   `enable_thinking`.

use serde_json::{json, Map, Value};

use super::content_format::ContentFormat;
use super::PromptError;

/// A chat request, normalised and ready for [`super::template::ChatTemplate::render`].
#[derive(Debug, Clone, PartialEq)]
pub struct ChatInput {
    /// Normalised messages. Their `content` is still format-neutral: the request's string,
    /// `null`, or the list of its text parts' texts (empty ones kept), and tool-call
    /// `arguments` are the strings sent; see [`ChatInput::messages_for`].
    pub messages: Vec<Value>,
    /// Normalised tools, if the request has any.
    pub tools: Option<Vec<Value>>,
    /// Whether to append the assistant header (vLLM default `true`).
    pub add_generation_prompt: bool,
    /// Whether to leave the last message open (vLLM default `false`).
    pub continue_final_message: bool,
    /// Whether the tokenizer adds special tokens to the rendered text (chat default `false`).
    pub add_special_tokens: bool,
    /// Every other template variable (`enable_thinking`, `documents`, …).
    pub kwargs: Map<String, Value>,
    /// The request's top-level `reasoning_effort` (harmony reads only this one; templates get
    /// it among `kwargs`).
    pub reasoning_effort: Option<String>,
}

impl ChatInput {
    /// Reads and normalises the chat part of a `/v1/chat/completions` body.
    pub fn from_request(obj: &Map<String, Value>) -> Result<ChatInput, PromptError> {
        let messages = match obj.get("messages") {
            Some(Value::Array(ms)) if !ms.is_empty() => {
                ms.iter().map(normalize_message).collect::<Result<Vec<_>, _>>()?
            }
            _ => return Err(PromptError::Invalid("`messages` must be a non-empty array".into())),
        };
        let tools = match obj.get("tools") {
            None | Some(Value::Null) => None,
            Some(Value::Array(ts)) if ts.is_empty() => {
                return Err(PromptError::Invalid("`tools` must not be empty".into()))
            }
            Some(Value::Array(ts)) => Some(ts.iter().map(normalize_tool).collect::<Result<_, _>>()?),
            Some(_) => return Err(PromptError::Invalid("`tools` must be an array".into())),
        };
        let flag = |key: &str, default: bool| -> Result<bool, PromptError> {
            match obj.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Bool(b)) => Ok(*b),
                Some(_) => Err(PromptError::Invalid(format!("`{key}` must be a boolean"))),
            }
        };
        let add_generation_prompt = flag("add_generation_prompt", true)?;
        let continue_final_message = flag("continue_final_message", false)?;
        if add_generation_prompt && continue_final_message {
            return Err(PromptError::Invalid(
                "cannot set both `continue_final_message` and `add_generation_prompt`".into(),
            ));
        }
        let add_special_tokens = flag("add_special_tokens", false)?;

        let mut kwargs = Map::new();
        match obj.get("chat_template_kwargs") {
            None | Some(Value::Null) => {}
            Some(Value::Object(kw)) => {
                for (k, v) in kw {
                    if !is_dropped_kwarg(v) {
                        kwargs.insert(k.clone(), v.clone());
                    }
                }
            }
            Some(_) => return Err(PromptError::Invalid("`chat_template_kwargs` must be an object".into())),
        }
        for key in ["documents", "reasoning_effort"] {
            if let Some(v) = obj.get(key).filter(|v| !is_dropped_kwarg(v)) {
                kwargs.insert(key.to_owned(), v.clone());
            }
        }
        // vLLM looks for the key in the kwargs as sent: one sent as `null` is dropped later,
        // but still keeps `enable_thinking` from being implied.
        let sent = obj.get("chat_template_kwargs").and_then(Value::as_object);
        if let Some(effort) = obj.get("reasoning_effort").and_then(Value::as_str) {
            if !sent.is_some_and(|kw| kw.contains_key("enable_thinking")) {
                kwargs.insert("enable_thinking".into(), Value::Bool(effort != "none"));
            }
        }
        let reasoning_effort = obj.get("reasoning_effort").and_then(Value::as_str).map(str::to_owned);
        Ok(ChatInput {
            messages,
            tools,
            add_generation_prompt,
            continue_final_message,
            add_special_tokens,
            kwargs,
            reasoning_effort,
        })
    }
}

impl ChatInput {
    /// The messages as a template of `format` sees them (tool-call arguments parsed), after
    /// vLLM's last step (`renderers/hf.py`): if there is a `developer` message and the template
    /// does not know the role (`knows_developer`), developer messages become `system`, and then,
    /// if a system message is not first or there are several, all of them merge into one at
    /// position 0, their non-empty texts joined with `"\n\n"` (a plain string in either format).
    /// Without a developer message to convert, system messages stay where they are.
    /// `format` must be resolved ([`ContentFormat::String`] or [`ContentFormat::Openai`]).
    pub fn messages_for(&self, format: ContentFormat, knows_developer: bool) -> Vec<Value> {
        fn has_role(m: &Value, role: &str) -> bool {
            m.get("role").and_then(Value::as_str) == Some(role)
        }
        let mut out: Vec<Value> = self.messages.iter().map(|m| shape_content(m.clone(), format)).collect();
        if knows_developer || !out.iter().any(|m| has_role(m, "developer")) {
            return out;
        }
        for message in out.iter_mut().filter(|m| has_role(m, "developer")) {
            message["role"] = Value::String("system".into());
        }
        let is_system = |m: &Value| has_role(m, "system");
        // A system message after the first (a second one is always after it).
        if !out.iter().skip(1).any(is_system) {
            return out;
        }
        let texts: Vec<String> =
            out.iter().filter(|m| is_system(m)).map(shaped_text).filter(|t| !t.is_empty()).collect();
        let merged = json!({"role": "system", "content": texts.join("\n\n")});
        std::iter::once(merged).chain(out.into_iter().filter(|m| !is_system(m))).collect()
    }
}

/// The message with its neutral content shaped for `format` and its tool-call arguments parsed
/// (invalid or non-object → `{}`).
fn shape_content(mut message: Value, format: ContentFormat) -> Value {
    if let Some(Value::Array(calls)) = message.get_mut("tool_calls") {
        for arguments in calls.iter_mut().filter_map(|c| c.get_mut("function")?.get_mut("arguments")) {
            *arguments = match serde_json::from_str::<Value>(arguments.as_str().unwrap_or_default()) {
                Ok(Value::Object(args)) => Value::Object(args),
                _ => Value::Object(Map::new()),
            };
        }
    }
    let is_tool = message.get("role").and_then(Value::as_str) == Some("tool");
    let Some(content) = message.get_mut("content") else { return message };
    *content = match (format, is_tool, content.take()) {
        (ContentFormat::Openai, false, Value::String(s)) => json!([{"type": "text", "text": s}]),
        (ContentFormat::Openai, false, Value::Null) => json!([]),
        (ContentFormat::Openai, false, Value::Array(texts)) => {
            Value::Array(texts.into_iter().map(|t| json!({"type": "text", "text": t})).collect())
        }
        (_, _, Value::String(s)) => Value::String(s),
        (_, _, neutral) => Value::String(joined_text(Some(&neutral))),
    };
    message
}

/// A shaped message's content as vLLM's consolidation reads it: the string, or every text
/// part's text (empty ones too) joined with `"\n"`.
fn shaped_text(message: &Value) -> String {
    match message.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect::<Vec<_>>().join("\n")
        }
        _ => String::new(),
    }
}

/// Neutral content as one string: the string itself, `""` for `null`, the non-empty part
/// texts joined with `"\n"` for a list.
fn joined_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(texts)) => {
            texts.iter().filter_map(Value::as_str).filter(|t| !t.is_empty()).collect::<Vec<_>>().join("\n")
        }
        _ => String::new(),
    }
}

fn is_dropped_kwarg(v: &Value) -> bool {
    v.is_null() || v.as_str() == Some("auto")
}

/// A message's `content`, format-neutral: the string, `null`, or the texts of its parts.
fn neutral_content(content: Option<&Value>) -> Result<Value, PromptError> {
    match content {
        None | Some(Value::Null) => Ok(Value::Null),
        Some(Value::String(s)) => Ok(Value::String(s.clone())),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::new();
            for part in parts {
                let text = match part {
                    Value::String(s) => Some(s.as_str()),
                    Value::Object(p) => match p.get("type").and_then(Value::as_str) {
                        Some(kind @ ("text" | "input_text" | "output_text" | "refusal" | "thinking")) => {
                            p.get(kind_field(kind)).and_then(Value::as_str)
                        }
                        Some(other) => {
                            return Err(PromptError::Invalid(format!(
                                "content part `{other}` is not supported by a text-only model"
                            )))
                        }
                        None => return Err(PromptError::Invalid("content part without `type`".into())),
                    },
                    _ => return Err(PromptError::Invalid("content part must be an object or string".into())),
                };
                texts.push(Value::String(text.unwrap_or_default().to_owned()));
            }
            Ok(Value::Array(texts))
        }
        Some(_) => Err(PromptError::Invalid("`content` must be a string, a list or null".into())),
    }
}

fn kind_field(kind: &str) -> &str {
    match kind {
        "refusal" => "refusal",
        "thinking" => "thinking",
        _ => "text",
    }
}

fn normalize_message(message: &Value) -> Result<Value, PromptError> {
    let Value::Object(m) = message else {
        return Err(PromptError::Invalid("each message must be an object".into()));
    };
    let role = m
        .get("role")
        .and_then(Value::as_str)
        .ok_or_else(|| PromptError::Invalid("message `role` must be a string".into()))?;
    let mut out = Map::new();
    out.insert("role".into(), Value::String(role.to_owned()));
    out.insert("content".into(), neutral_content(m.get("content"))?);
    if let Some(Value::String(name)) = m.get("name") {
        out.insert("name".into(), Value::String(name.clone()));
    }
    match role {
        "assistant" => {
            if let Some(Value::Array(calls)) = m.get("tool_calls") {
                if !calls.is_empty() {
                    let calls = calls.iter().map(normalize_tool_call).collect::<Result<Vec<_>, _>>()?;
                    out.insert("tool_calls".into(), Value::Array(calls));
                }
            }
            let reasoning = m.get("reasoning").or_else(|| m.get("reasoning_content"));
            if let Some(Value::String(r)) = reasoning {
                out.insert("reasoning".into(), Value::String(r.clone()));
                out.insert("reasoning_content".into(), Value::String(r.clone()));
            }
        }
        "tool" => {
            if let Some(Value::String(id)) = m.get("tool_call_id") {
                out.insert("tool_call_id".into(), Value::String(id.clone()));
            }
        }
        _ => {}
    }
    Ok(Value::Object(out))
}

fn normalize_tool_call(call: &Value) -> Result<Value, PromptError> {
    let invalid = |why: &str| PromptError::Invalid(format!("tool call: {why}"));
    let Value::Object(c) = call else { return Err(invalid("must be an object")) };
    if c.get("type").and_then(Value::as_str).unwrap_or("function") != "function" {
        return Err(invalid("`type` must be \"function\""));
    }
    let Some(Value::Object(f)) = c.get("function") else { return Err(invalid("`function` must be an object")) };
    if !matches!(f.get("arguments"), Some(Value::String(_))) {
        return Err(invalid("`function.arguments` must be a string"));
    }
    Ok(call.clone())
}

fn normalize_tool(tool: &Value) -> Result<Value, PromptError> {
    let invalid = |why: &str| PromptError::Invalid(format!("tool: {why}"));
    let Value::Object(t) = tool else { return Err(invalid("must be an object")) };
    let Some(Value::Object(f)) = t.get("function") else { return Err(invalid("`function` must be an object")) };
    let Some(Value::String(name)) = f.get("name") else { return Err(invalid("`function.name` must be a string")) };
    let mut function = Map::new();
    function.insert("name".into(), Value::String(name.clone()));
    function.insert("description".into(), f.get("description").cloned().unwrap_or(Value::Null));
    function.insert("parameters".into(), f.get("parameters").cloned().unwrap_or(Value::Null));
    for optional in ["strict", "defer_loading"] {
        if let Some(v) = f.get(optional).filter(|v| !v.is_null()) {
            function.insert(optional.into(), v.clone());
        }
    }
    Ok(json!({"type": "function", "function": Value::Object(function)}))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: Value) -> Result<ChatInput, PromptError> {
        ChatInput::from_request(body.as_object().unwrap())
    }

    #[test]
    fn content_parts_join_with_newline_and_drop_empty() {
        let c = chat(json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": ""}, {"type": "text", "text": "b"}]}]}))
        .unwrap();
        assert_eq!(c.messages_for(ContentFormat::String, false)[0]["content"], "a\nb");
        let c = chat(json!({"messages": [{"role": "user", "content": null, "extra": 1}]})).unwrap();
        assert_eq!(c.messages_for(ContentFormat::String, false)[0], json!({"role": "user", "content": ""}));
    }

    #[test]
    fn openai_format_keeps_every_part_and_wraps_strings() {
        let c = chat(json!({"messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": ""}, "b"]},
            {"role": "assistant", "content": "plain"},
            {"role": "assistant", "content": null},
            {"role": "tool", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]}))
        .unwrap();
        let ms = c.messages_for(ContentFormat::Openai, false);
        let part = |t: &str| json!({"type": "text", "text": t});
        assert_eq!(ms[0]["content"], json!([part("a"), part(""), part("b")]));
        assert_eq!(ms[1]["content"], json!([part("plain")]));
        assert_eq!(ms[2]["content"], json!([]));
        assert_eq!(ms[3]["content"], "x\ny", "tool results are always one string");
    }

    #[test]
    fn tool_call_arguments_are_parsed() {
        let c = chat(json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}},
            {"id": "2", "type": "function", "function": {"name": "g", "arguments": "[1,2]"}}]}]}))
        .unwrap();
        assert_eq!(c.messages[0]["tool_calls"][0]["function"]["arguments"], "{\"a\":1}", "kept as sent");
        let shaped = c.messages_for(ContentFormat::String, false);
        assert_eq!(shaped[0]["tool_calls"][0]["function"]["arguments"], json!({"a": 1}));
        assert_eq!(shaped[0]["tool_calls"][1]["function"]["arguments"], json!({}));
    }

    #[test]
    fn kwargs_precedence() {
        let c = chat(json!({"messages": [{"role": "user", "content": "x"}],
            "chat_template_kwargs": {"add_generation_prompt": false, "enable_thinking": false, "x": "auto"},
            "reasoning_effort": "none"}))
        .unwrap();
        assert!(c.add_generation_prompt, "top-level default wins over kwargs");
        assert_eq!(c.kwargs.get("enable_thinking"), Some(&Value::Bool(false)));
        assert!(!c.kwargs.contains_key("x"));
        let c = chat(json!({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "high"})).unwrap();
        assert_eq!(c.kwargs.get("enable_thinking"), Some(&Value::Bool(true)));
        let c = chat(json!({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "none",
            "chat_template_kwargs": {"enable_thinking": null}}))
        .unwrap();
        assert!(!c.kwargs.contains_key("enable_thinking"), "sent as null: dropped, and not implied");
    }

    #[test]
    fn invalid_chats_are_rejected() {
        for body in [
            json!({"messages": []}),
            json!({"messages": [{"content": "x"}]}),
            json!({"messages": [{"role": "user", "content": "x"}], "tools": []}),
            json!({"messages": [{"role": "user", "content": "x"}], "continue_final_message": true}),
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            json!({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]}),
        ] {
            assert!(chat(body.clone()).is_err(), "{body} should be rejected");
        }
    }

    #[test]
    fn tools_get_canonical_shape() {
        let c = chat(json!({"messages": [{"role": "user", "content": "x"}],
            "tools": [{"function": {"parameters": {"b": 1, "a": 2}, "name": "f", "junk": 1}, "type": "function"}]}))
        .unwrap();
        let t = serde_json::to_string(&c.tools.unwrap()[0]).unwrap();
        assert_eq!(t, r#"{"type":"function","function":{"name":"f","description":null,"parameters":{"b":1,"a":2}}}"#);
    }

    #[test]
    fn system_and_developer_messages_merge_first() {
        let c = chat(json!({"messages": [
            {"role": "user", "content": "u"},
            {"role": "system", "content": "s1"},
            {"role": "developer", "content": [{"type": "text", "text": "d1"}, {"type": "text", "text": ""},
                {"type": "text", "text": "d2"}]}]}))
        .unwrap();
        let out = c.messages_for(ContentFormat::String, false);
        assert_eq!(
            out,
            vec![json!({"role": "system", "content": "s1\n\nd1\nd2"}), json!({"role": "user", "content": "u"})]
        );
        assert_eq!(c.messages_for(ContentFormat::String, true).len(), 3);
        let out = c.messages_for(ContentFormat::Openai, false);
        assert_eq!(out[0]["content"], "s1\n\nd1\n\nd2", "a plain string, empty parts joined too");
    }

    /// vLLM merges system messages only after turning developer messages into system ones.
    #[test]
    fn system_messages_stay_in_place_without_a_developer_message() {
        let c = chat(json!({"messages": [
            {"role": "system", "content": "s1"},
            {"role": "user", "content": "u"},
            {"role": "system", "content": "s2"}]}))
        .unwrap();
        let roles: Vec<_> = c
            .messages_for(ContentFormat::String, false)
            .iter()
            .map(|m| m["role"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(roles, ["system", "user", "system"]);
    }
}
