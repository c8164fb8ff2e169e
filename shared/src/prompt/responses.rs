//! `/v1/responses` bodies, turned into the chat vLLM renders for them.
//!
//! vLLM 0.32 serves the Responses API by building chat messages from the request and then
//! rendering them exactly as a chat completion (`entrypoints/openai/responses/utils.py`,
//! `construct_input_messages`, and `ResponsesRequest.build_chat_params`). This module does
//! the first half and hands the result to [`ChatInput::from_request`], so everything after it
//! (content shapes, tool-call arguments, system merging, the template) is the chat path's.
//!
//! The rules, each visible in the prompt ids:
//! - non-empty `instructions` become a leading `system` message;
//! - a string `input` is one `user` message; a list of items becomes messages in order:
//!   - a message item (`role` user, system, developer) is kept as sent, its `input_text`
//!     parts read as text;
//!   - an assistant message (`output_text` parts, or a string) contributes the text of its
//!     first part, filling the content of an assistant message just before it that has none;
//!   - `reasoning` items become an assistant message's `reasoning` (their first content
//!     text, else their first summary text), joining the assistant message just before them
//!     when it has no reasoning yet;
//!   - `function_call` items become tool calls, joining the assistant message just before
//!     them; a namespaced call is named `namespace__name`;
//!   - `function_call_output` / `custom_tool_call_output` items become `tool` messages;
//! - `function` tools (and `namespace` tools' functions, flattened) are the template's tools;
//!   other tool kinds are never shown to the model;
//! - the last item, if it is an assistant message or reasoning with status `in_progress` or
//!   `incomplete`, is continued (`continue_final_message`) instead of answered;
//! - `reasoning.effort` is the template's `reasoning_effort` (and `enable_thinking` unless the
//!   request's `chat_template_kwargs` set it).
//!
//! What is refused with [`PromptError::Unsupported`] (the request is then routed on an
//! estimate): history the engine keeps (`previous_response_id`), custom tools and calls, and
//! encrypted reasoning. `previous_input_messages` is ignored, as vLLM ignores it outside
//! harmony; a `prompt` template is refused, as vLLM refuses it.

use serde_json::{json, Map, Value};

use super::chat::ChatInput;
use super::PromptError;

/// How vLLM names a namespaced function for the model.
const NAMESPACE_SEPARATOR: &str = "__";

/// The chat vLLM renders for a `/v1/responses` body.
pub fn chat_input(obj: &Map<String, Value>) -> Result<ChatInput, PromptError> {
    let (chat, tools) = chat_request(obj)?;
    let mut input = ChatInput::from_request(&chat)?;
    if tools == Tools::NoneShown {
        // vLLM hands the template an empty list (a chat body cannot say that).
        input.tools = Some(Vec::new());
    }
    Ok(input)
}

/// What the template is given as tools.
#[derive(Debug, PartialEq, Eq)]
enum Tools {
    /// No `tools` (or an empty list): none.
    Absent,
    /// Function tools, in the chat body.
    Functions,
    /// Tools, none of which the model is shown (web search, MCP…): an empty list.
    NoneShown,
}

/// The `/v1/chat/completions` body that renders as the Responses request `obj` does, and
/// what its template is given as tools.
fn chat_request(obj: &Map<String, Value>) -> Result<(Map<String, Value>, Tools), PromptError> {
    if obj.get("previous_response_id").is_some_and(|v| !v.is_null()) {
        return Err(PromptError::Unsupported("`previous_response_id`: the engine holds that conversation".into()));
    }
    if obj.get("prompt").is_some_and(|v| !v.is_null()) {
        return Err(PromptError::Invalid("prompt templates are not supported".into()));
    }
    let mut messages = Vec::new();
    match obj.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) => messages.push(json!({"role": "system", "content": s})),
        Some(_) => return Err(PromptError::Invalid("`instructions` must be a string".into())),
    }
    let input = obj.get("input").ok_or_else(|| PromptError::Invalid("`input` is required".into()))?;
    let continue_final = match input {
        Value::String(s) => {
            messages.push(json!({"role": "user", "content": s}));
            false
        }
        Value::Array(items) => {
            let mut turns: Vec<Value> = Vec::new();
            for item in items {
                add_item(&mut turns, item)?;
            }
            messages.extend(turns);
            items.last().is_some_and(is_partial)
        }
        _ => return Err(PromptError::Invalid("`input` must be a string or a list of items".into())),
    };
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    let tools = match function_tools(obj.get("tools"))? {
        None => Tools::Absent,
        Some(functions) if functions.is_empty() => Tools::NoneShown,
        Some(functions) => {
            chat.insert("tools".into(), Value::Array(functions));
            Tools::Functions
        }
    };
    if let Some(kwargs) = obj.get("chat_template_kwargs") {
        chat.insert("chat_template_kwargs".into(), kwargs.clone());
    }
    chat.insert("add_generation_prompt".into(), Value::Bool(!continue_final));
    chat.insert("continue_final_message".into(), Value::Bool(continue_final));
    match obj.get("reasoning") {
        None | Some(Value::Null) => {}
        Some(Value::Object(r)) => {
            if let Some(effort) = r.get("effort").filter(|e| !e.is_null()) {
                chat.insert("reasoning_effort".into(), effort.clone());
            }
        }
        Some(_) => return Err(PromptError::Invalid("`reasoning` must be an object".into())),
    }
    Ok((chat, tools))
}

fn item_type(item: &Map<String, Value>) -> Option<&str> {
    item.get("type").and_then(Value::as_str)
}

/// Whether the last input item is a message or reasoning left `in_progress` or `incomplete`.
fn is_partial(item: &Value) -> bool {
    let Value::Object(item) = item else { return false };
    matches!(item_type(item).unwrap_or("message"), "message" | "reasoning")
        && matches!(item.get("status").and_then(Value::as_str), Some("in_progress" | "incomplete"))
}

/// The assistant message just before, if the last message is one.
fn last_assistant(turns: &mut [Value]) -> Option<&mut Map<String, Value>> {
    let last = turns.last_mut()?.as_object_mut()?;
    (last.get("role").and_then(Value::as_str) == Some("assistant")).then_some(last)
}

/// Sets `key` of the assistant message just before when it has none; else starts one.
fn join_assistant(turns: &mut Vec<Value>, key: &str, value: Value) {
    if let Some(last) = last_assistant(turns) {
        if last.get(key).is_none_or(Value::is_null) {
            last.insert(key.into(), value);
            return;
        }
    }
    turns.push(json!({"role": "assistant", key: value}));
}

/// A message item as vLLM's validation leaves it: its role and content (other keys, `name`
/// among them, are not members of the item types).
fn message(fields: &Map<String, Value>) -> Value {
    json!({"role": fields["role"], "content": fields.get("content").cloned().unwrap_or(Value::Null)})
}

/// Adds one input item as vLLM's `_construct_message_from_response_item` does.
fn add_item(turns: &mut Vec<Value>, item: &Value) -> Result<(), PromptError> {
    let invalid = |why: String| PromptError::Invalid(format!("input item: {why}"));
    let Value::Object(fields) = item else { return Err(invalid("must be an object".into())) };
    let text = |key: &str| fields.get(key).and_then(Value::as_str);
    match item_type(fields) {
        Some("function_call") => {
            let (Some(call_id), Some(name), Some(arguments)) = (text("call_id"), text("name"), text("arguments"))
            else {
                return Err(invalid("a function call needs string `call_id`, `name` and `arguments`".into()));
            };
            let name = match text("namespace") {
                Some(ns) if !ns.is_empty() => format!("{ns}{NAMESPACE_SEPARATOR}{name}"),
                _ => name.to_owned(),
            };
            let call = json!({"id": call_id, "function": {"name": name, "arguments": arguments}, "type": "function"});
            match last_assistant(turns) {
                Some(last) => match last.get_mut("tool_calls") {
                    Some(Value::Array(calls)) => calls.push(call),
                    _ => {
                        last.insert("tool_calls".into(), Value::Array(vec![call]));
                    }
                },
                None => turns.push(json!({"role": "assistant", "tool_calls": [call]})),
            }
        }
        Some("reasoning") => {
            if fields.get("encrypted_content").and_then(Value::as_str).is_some_and(|s| !s.is_empty()) {
                return Err(PromptError::Unsupported("encrypted reasoning".into()));
            }
            let first_text = |key: &str| fields.get(key)?.as_array()?.first()?.get("text")?.as_str().map(str::to_owned);
            let reasoning = first_text("content").or_else(|| first_text("summary")).unwrap_or_default();
            join_assistant(turns, "reasoning", Value::String(reasoning));
        }
        Some("function_call_output" | "custom_tool_call_output") => {
            let output = fields.get("output").cloned().unwrap_or(Value::Null);
            let call_id = fields.get("call_id").cloned().unwrap_or(Value::Null);
            turns.push(json!({"role": "tool", "content": output, "tool_call_id": call_id}));
        }
        Some("custom_tool_call") => return Err(PromptError::Unsupported("custom tool calls".into())),
        kind if fields.get("role").and_then(Value::as_str) == Some("assistant") => {
            let first = match fields.get("content") {
                Some(Value::String(s)) => Some(s.as_str()),
                Some(Value::Array(parts)) => parts.first().and_then(|p| p.get("text")).and_then(Value::as_str),
                _ => None,
            };
            match first {
                Some(t) => join_assistant(turns, "content", Value::String(t.to_owned())),
                None if matches!(kind, None | Some("message")) => turns.push(message(fields)),
                None => return Err(invalid(format!("unsupported type {kind:?}"))),
            }
        }
        None | Some("message") if fields.contains_key("role") => turns.push(message(fields)),
        kind => return Err(invalid(format!("unsupported type {kind:?}"))),
    }
    Ok(())
}

/// The Responses tools the model is shown, as chat tools: functions, and namespaces'
/// functions named `namespace__name`. Other kinds (web search, MCP, …) are dropped; custom
/// tools are refused. `None` without tools (or with an empty list).
fn function_tools(tools: Option<&Value>) -> Result<Option<Vec<Value>>, PromptError> {
    let tools = match tools {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(tools)) if tools.is_empty() => return Ok(None),
        Some(Value::Array(tools)) => tools,
        Some(_) => return Err(PromptError::Invalid("`tools` must be an array".into())),
    };
    let as_chat = |tool: &Map<String, Value>, name: String| {
        let mut function: Map<String, Value> =
            tool.iter().filter(|(k, _)| k.as_str() != "type").map(|(k, v)| (k.clone(), v.clone())).collect();
        function.insert("name".into(), Value::String(name));
        json!({"type": "function", "function": function})
    };
    let name_of = |tool: &Map<String, Value>| -> Result<String, PromptError> {
        tool.get("name")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| PromptError::Invalid("tool: `name` must be a string".into()))
    };
    let mut out = Vec::new();
    for tool in tools {
        let Value::Object(tool) = tool else { return Err(PromptError::Invalid("tool: must be an object".into())) };
        match item_type(tool) {
            Some("function") => out.push(as_chat(tool, name_of(tool)?)),
            Some("namespace") => {
                let namespace = name_of(tool)?;
                let inner = tool.get("tools").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
                for f in inner.iter().filter_map(Value::as_object).filter(|f| item_type(f) == Some("function")) {
                    out.push(as_chat(f, format!("{namespace}{NAMESPACE_SEPARATOR}{}", name_of(f)?)));
                }
            }
            Some("custom") => return Err(PromptError::Unsupported("custom tools".into())),
            _ => {}
        }
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: Value) -> Result<Map<String, Value>, PromptError> {
        chat_request(body.as_object().unwrap()).map(|(chat, _)| chat)
    }

    #[test]
    fn a_string_input_is_one_user_turn_after_the_instructions() {
        let c = chat(json!({"input": "hi", "instructions": "Be brief."})).unwrap();
        assert_eq!(
            c["messages"],
            json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
        );
        assert_eq!((&c["add_generation_prompt"], &c["continue_final_message"]), (&json!(true), &json!(false)));
        let c = chat(json!({"input": "hi", "instructions": ""})).unwrap();
        assert_eq!(c["messages"], json!([{"role": "user", "content": "hi"}]), "empty instructions add nothing");
    }

    #[test]
    fn items_join_the_assistant_turn_before_them() {
        let c = chat(json!({"input": [
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
            {"type": "message", "role": "assistant", "id": "m", "status": "completed",
             "content": [{"type": "output_text", "text": "let me look", "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{\"city\":\"Paris\"}"},
            {"type": "function_call", "call_id": "c2", "name": "f", "namespace": "ns", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "21C"},
            {"role": "user", "content": "thanks"}]}))
        .unwrap();
        let ms = c["messages"].as_array().unwrap();
        assert_eq!(ms.len(), 4);
        assert_eq!(ms[1]["reasoning"], "think");
        assert_eq!(ms[1]["content"], "let me look");
        assert_eq!(ms[1]["tool_calls"][0]["id"], "c1");
        assert_eq!(ms[1]["tool_calls"][1]["function"]["name"], "ns__f");
        assert_eq!(ms[2], json!({"role": "tool", "content": "21C", "tool_call_id": "c1"}));
    }

    #[test]
    fn a_partial_last_message_is_continued() {
        let c = chat(json!({"input": [{"role": "user", "content": "haiku"},
            {"type": "message", "role": "assistant", "status": "incomplete", "content": [{"type": "output_text", "text": "Autumn"}]}]}))
        .unwrap();
        assert_eq!((&c["add_generation_prompt"], &c["continue_final_message"]), (&json!(false), &json!(true)));
    }

    #[test]
    fn tools_and_reasoning_effort() {
        let c = chat(json!({"input": "x", "reasoning": {"effort": "low"}, "tools": [
            {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": null},
            {"type": "web_search"},
            {"type": "namespace", "name": "crm", "tools": [{"type": "function", "name": "find"}]}]}))
        .unwrap();
        let names: Vec<_> = c["tools"].as_array().unwrap().iter().map(|t| t["function"]["name"].clone()).collect();
        assert_eq!(names, [json!("f"), json!("crm__find")]);
        assert_eq!(c["reasoning_effort"], "low");
        assert!(chat(json!({"input": "x", "tools": []})).unwrap().get("tools").is_none());
        let shown =
            |tools: Value| chat_input(json!({"input": "x", "tools": tools}).as_object().unwrap()).unwrap().tools;
        assert_eq!(shown(json!([])), None, "no tools: none");
        assert_eq!(shown(json!([{"type": "web_search"}])), Some(Vec::new()), "tools the model is not shown: []");
    }

    #[test]
    fn what_the_engine_holds_or_kvgate_does_not_render_is_unsupported() {
        for body in [
            json!({"input": "x", "previous_response_id": "resp_1"}),
            json!({"input": "x", "tools": [{"type": "custom", "name": "c"}]}),
            json!({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "zz"}]}),
        ] {
            assert!(matches!(chat(body.clone()), Err(PromptError::Unsupported(_))), "{body}");
        }
        for body in [
            json!({}),
            json!({"input": 3}),
            json!({"input": [{"type": "image_generation_call"}]}),
            json!({"input": "x", "prompt": {"id": "p"}}),
        ] {
            assert!(matches!(chat(body.clone()), Err(PromptError::Invalid(_))), "{body}");
        }
    }
}
