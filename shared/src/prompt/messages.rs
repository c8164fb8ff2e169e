//! `/v1/messages` bodies (the Anthropic Messages API), turned into the chat vLLM renders for them.
//!
//! vLLM 0.32 serves the Messages API by converting the request into a chat completion
//! (`entrypoints/anthropic/serving.py`, `AnthropicServingMessages.to_chat_completion_request`)
//! and rendering that as any chat. This module does the conversion and hands the result to
//! [`ChatInput::from_request`], so everything after it is the chat path's.
//!
//! The rules, each visible in the prompt ids:
//! - the top-level `system` (a string, or its non-empty `text` blocks joined with `""`, blocks
//!   that start with Claude Code's `x-anthropic-billing-header` dropped) is a leading system
//!   message;
//! - inline `system` messages (Claude Code's per-turn reminders) keep their place when the
//!   model's template accepts a system message after the first turn, and are appended to the
//!   leading system text otherwise ([`super::template::ChatTemplate::requires_system_first`]);
//! - a message's blocks: `text` parts (one part becomes a string), `thinking` joined into the
//!   assistant's `reasoning`, `tool_use` into `tool_calls` (`input` as JSON arguments), a
//!   user's `tool_result` into a `tool` message placed before the user's own text, an
//!   assistant's into a `Tool result: …` text part; `redacted_thinking` and `tool_reference`
//!   blocks are dropped; a user message left with no content is dropped;
//! - tools are function tools (`input_schema` is the parameters, `"type": "object"` added when
//!   missing); an empty `tools` list reaches the template as an empty list (vLLM sets it after
//!   validating the chat request; with the tool parser agents need, the template gets `[]`);
//! - `output_config.effort` is the template's `reasoning_effort`; `thinking: disabled` replaces
//!   it with the effort vLLM found to turn thinking off for the model
//!   ([`super::template::ChatTemplate::disabled_thinking_effort`]).
//!
//! What is refused with [`PromptError::Unsupported`] (the request is then routed on an
//! estimate): images, `tool_reference` items in a tool result, an assistant's tool result given
//! as a list (vLLM prints Python's repr of it), and `tool_addition`/`tool_removal` blocks.

use serde_json::{json, Map, Value};

use super::chat::ChatInput;
use super::PromptError;

/// What Claude Code puts first in its system prompt: a per-request hash that vLLM drops so the
/// prefix stays cacheable.
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// The efforts `output_config.effort` accepts (vLLM's `AnthropicEffort`).
pub const EFFORTS: [&str; 5] = ["low", "medium", "high", "xhigh", "max"];

/// A `/v1/messages` body, read and checked. Becomes a chat once the model's template has said
/// where inline system messages go and how thinking is turned off ([`MessagesChat::chat_input`]).
#[derive(Debug, Clone, PartialEq)]
pub struct MessagesChat {
    /// The top-level system texts.
    system: Vec<String>,
    /// The conversation, in order.
    turns: Vec<Turn>,
    /// The chat body's other fields: `tools`, `chat_template_kwargs`, `reasoning_effort`.
    fields: Map<String, Value>,
    /// `thinking: {"type": "disabled"}`.
    thinking_disabled: bool,
    /// `tools: []`: the template gets an empty list.
    empty_tools: bool,
}

/// One entry of the converted conversation.
#[derive(Debug, Clone, PartialEq)]
enum Turn {
    /// An inline system message's text.
    System(String),
    /// A chat message.
    Chat(Value),
}

impl MessagesChat {
    /// Reads a `/v1/messages` body. `now` stands in for a `tool_use` block without an `id`
    /// (vLLM names it `call_<unix seconds>`).
    pub fn from_request(obj: &Map<String, Value>, now: i64) -> Result<MessagesChat, PromptError> {
        let max_tokens = match obj.get("max_tokens").and_then(Value::as_f64) {
            Some(n) if n > 0.0 => n,
            _ => return Err(PromptError::Invalid("`max_tokens` is required and must be positive".into())),
        };
        let system = match obj.get("system") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) if s.is_empty() => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(blocks)) => {
                let blocks = blocks.iter().map(Block::read).collect::<Result<Vec<_>, _>>()?;
                if blocks.iter().any(Block::is_tool_change) {
                    return Err(PromptError::Invalid("tool changes are only allowed in system messages".into()));
                }
                blocks.iter().filter_map(Block::system_text).map(str::to_owned).collect()
            }
            Some(_) => return Err(PromptError::Invalid("`system` must be a string or a list of blocks".into())),
        };
        let Some(Value::Array(messages)) = obj.get("messages") else {
            return Err(PromptError::Invalid("`messages` must be an array".into()));
        };
        let mut turns = Vec::new();
        for message in messages {
            convert_message(message, now, &mut turns)?;
        }
        let mut fields = Map::new();
        let tools = tools(obj.get("tools"))?;
        let empty_tools = tools.as_ref().is_some_and(Vec::is_empty);
        if let Some(tools) = tools.filter(|t| !t.is_empty()) {
            fields.insert("tools".into(), Value::Array(tools));
        }
        check_tool_choice(obj.get("tool_choice"))?;
        match obj.get("chat_template_kwargs") {
            None | Some(Value::Null) => {}
            Some(kwargs @ Value::Object(_)) => {
                fields.insert("chat_template_kwargs".into(), kwargs.clone());
            }
            Some(_) => return Err(PromptError::Invalid("`chat_template_kwargs` must be an object".into())),
        }
        if let Some(effort) = output_effort(obj.get("output_config"))? {
            fields.insert("reasoning_effort".into(), Value::String(effort));
        }
        // A prefill leg (`do_remote_decode`) is sent with `max_tokens: 1`: vLLM skips the check.
        let prefill_leg = obj.get("kv_transfer_params").and_then(|p| p.get("do_remote_decode")).is_some_and(truthy);
        let thinking_disabled = thinking_disabled(obj.get("thinking"), (!prefill_leg).then_some(max_tokens))?;
        Ok(MessagesChat { system, turns, fields, thinking_disabled, empty_tools })
    }

    /// The chat vLLM renders: inline system messages merged into the leading one when
    /// `merge_inline_system`, and `disabled_effort` asked for only if thinking is turned off.
    pub fn chat_input(
        &self,
        merge_inline_system: bool,
        disabled_effort: impl FnOnce() -> &'static str,
    ) -> Result<ChatInput, PromptError> {
        let mut system = self.system.clone();
        if merge_inline_system {
            system.extend(self.turns.iter().filter_map(|t| match t {
                Turn::System(text) => Some(text.clone()),
                Turn::Chat(_) => None,
            }));
        }
        let mut messages = Vec::with_capacity(self.turns.len() + 1);
        if !system.is_empty() {
            messages.push(json!({"role": "system", "content": system.concat()}));
        }
        for turn in &self.turns {
            match turn {
                Turn::System(_) if merge_inline_system => {}
                Turn::System(text) => messages.push(json!({"role": "system", "content": text})),
                Turn::Chat(message) => messages.push(message.clone()),
            }
        }
        let mut body = self.fields.clone();
        body.insert("messages".into(), Value::Array(messages));
        if self.thinking_disabled {
            body.insert("reasoning_effort".into(), Value::String(disabled_effort().to_owned()));
        }
        let mut input = ChatInput::from_request(&body)?;
        if self.empty_tools {
            input.tools = Some(Vec::new());
        }
        Ok(input)
    }
}

/// A content block, its fields checked as vLLM's `AnthropicContentBlock` checks them.
struct Block<'a> {
    kind: &'a str,
    fields: &'a Map<String, Value>,
}

impl<'a> Block<'a> {
    fn read(value: &'a Value) -> Result<Block<'a>, PromptError> {
        let invalid = |why: String| PromptError::Invalid(format!("content block: {why}"));
        let Value::Object(fields) = value else { return Err(invalid("must be an object".into())) };
        let kind = fields.get("type").and_then(Value::as_str).ok_or_else(|| invalid("`type` is required".into()))?;
        if !matches!(
            kind,
            "text"
                | "image"
                | "tool_use"
                | "tool_result"
                | "tool_reference"
                | "thinking"
                | "redacted_thinking"
                | "tool_addition"
                | "tool_removal"
        ) {
            return Err(invalid(format!("unknown type `{kind}`")));
        }
        for key in ["text", "id", "tool_use_id", "name", "tool_name", "thinking", "signature", "data"] {
            if fields.get(key).is_some_and(|v| !v.is_null() && !v.is_string()) {
                return Err(invalid(format!("`{key}` must be a string")));
            }
        }
        if fields.get("input").is_some_and(|v| !v.is_null() && !v.is_object()) {
            return Err(invalid("`input` must be an object".into()));
        }
        match fields.get("content") {
            None | Some(Value::Null | Value::String(_)) => {}
            Some(Value::Array(items)) if items.iter().all(Value::is_object) => {}
            Some(_) => return Err(invalid("`content` must be a string or a list of objects".into())),
        }
        Ok(Block { kind, fields })
    }

    fn is_tool_change(&self) -> bool {
        matches!(self.kind, "tool_addition" | "tool_removal")
    }

    fn str(&self, key: &str) -> Option<&'a str> {
        self.fields.get(key).and_then(Value::as_str)
    }

    /// The non-empty text of a `text` block.
    fn text(&self) -> Option<&'a str> {
        (self.kind == "text").then(|| self.str("text")).flatten().filter(|t| !t.is_empty())
    }

    /// The text a system block contributes: a text block's, unless it is the billing header.
    fn system_text(&self) -> Option<&'a str> {
        self.text().filter(|t| !t.starts_with(BILLING_HEADER))
    }
}

/// The blocks of a list content.
fn blocks(content: &Value) -> Result<Option<Vec<Block<'_>>>, PromptError> {
    match content {
        Value::String(_) => Ok(None),
        Value::Array(items) => items.iter().map(Block::read).collect::<Result<_, _>>().map(Some),
        _ => Err(PromptError::Invalid("message `content` must be a string or a list of blocks".into())),
    }
}

/// Converts one Anthropic message into turns (a user's tool results come before its text).
fn convert_message(message: &Value, now: i64, turns: &mut Vec<Turn>) -> Result<(), PromptError> {
    let Value::Object(m) = message else { return Err(PromptError::Invalid("each message must be an object".into())) };
    let role = match m.get("role").and_then(Value::as_str) {
        Some(role @ ("user" | "assistant" | "system")) => role,
        _ => return Err(PromptError::Invalid("message `role` must be user, assistant or system".into())),
    };
    let content = m.get("content").ok_or_else(|| PromptError::Invalid("message `content` is required".into()))?;
    let blocks = blocks(content)?;
    if let Some(change) = blocks.iter().flatten().find(|b| b.is_tool_change()) {
        if role != "system" {
            return Err(PromptError::Invalid(format!("{} blocks are only allowed in system messages", change.kind)));
        }
        return Err(PromptError::Unsupported(format!("{} blocks", change.kind)));
    }
    if role == "system" {
        let text = match (content, &blocks) {
            (Value::String(s), _) => (!s.starts_with(BILLING_HEADER)).then(|| s.clone()),
            (_, Some(blocks)) => {
                let parts: Vec<&str> = blocks.iter().filter_map(Block::system_text).collect();
                (!parts.is_empty()).then(|| parts.concat())
            }
            _ => None,
        };
        if let Some(text) = text.filter(|t| !t.is_empty()) {
            turns.push(Turn::System(text));
        }
        return Ok(());
    }
    let Some(blocks) = blocks else {
        turns.push(Turn::Chat(json!({"role": role, "content": content})));
        return Ok(());
    };
    let mut parts = Vec::new();
    let mut tool_calls = Vec::new();
    let mut reasoning = Vec::new();
    for block in &blocks {
        match block.kind {
            "text" => parts.extend(block.text().map(|t| json!({"type": "text", "text": t}))),
            "image" if block.fields.get("source").is_some_and(|s| !s.is_null()) => {
                return Err(PromptError::Unsupported("image content".into()))
            }
            "thinking" => reasoning.extend(block.str("thinking")),
            "tool_use" => tool_calls.push(tool_call(block, now)),
            "tool_result" if role == "user" => turns.push(Turn::Chat(tool_message(block)?)),
            "tool_result" => {
                parts.push(json!({"type": "text", "text": format!("Tool result: {}", tool_result_repr(block)?)}))
            }
            _ => {}
        }
    }
    let mut out = Map::new();
    out.insert("role".into(), Value::String(role.to_owned()));
    if !reasoning.is_empty() {
        out.insert("reasoning".into(), Value::String(reasoning.concat()));
    }
    let has_calls = !tool_calls.is_empty();
    if has_calls {
        out.insert("tool_calls".into(), Value::Array(tool_calls));
    }
    match parts.len() {
        0 => {}
        1 => {
            let text = parts.pop().and_then(|p| p.get("text").cloned()).unwrap_or_default();
            out.insert("content".into(), text);
        }
        _ => {
            out.insert("content".into(), Value::Array(parts));
        }
    }
    if role != "user" || out.contains_key("content") {
        turns.push(Turn::Chat(Value::Object(out)));
    }
    Ok(())
}

/// A `tool_use` block as an OpenAI tool call.
fn tool_call(block: &Block<'_>, now: i64) -> Value {
    let id = block.str("id").filter(|id| !id.is_empty()).map_or_else(|| format!("call_{now}"), str::to_owned);
    let input = block.fields.get("input").filter(|v| v.as_object().is_some_and(|o| !o.is_empty()));
    let arguments = input.map_or_else(|| "{}".to_owned(), Value::to_string);
    json!({"id": id, "type": "function", "function": {"name": block.str("name").unwrap_or_default(), "arguments": arguments}})
}

/// A user's `tool_result` block as a `tool` message.
fn tool_message(block: &Block<'_>) -> Result<Value, PromptError> {
    let text = match block.fields.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) => {
            let mut texts = Vec::new();
            for item in items {
                match item.get("type").and_then(Value::as_str) {
                    Some("text") => texts.push(item.get("text").and_then(Value::as_str).unwrap_or_default()),
                    Some("image") => return Err(PromptError::Unsupported("images in a tool result".into())),
                    Some("tool_reference") => {
                        return Err(PromptError::Unsupported("tool references in a tool result".into()))
                    }
                    _ => {}
                }
            }
            texts.join("\n")
        }
        _ => String::new(),
    };
    Ok(json!({"role": "tool", "tool_call_id": block.str("tool_use_id").unwrap_or_default(), "content": text}))
}

/// Python's `str()` of an assistant's tool result content, where kvgate can give it.
fn tool_result_repr(block: &Block<'_>) -> Result<String, PromptError> {
    match block.fields.get("content") {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(items)) if !items.is_empty() => {
            Err(PromptError::Unsupported("an assistant's tool result given as a list".into()))
        }
        _ => Ok(String::new()),
    }
}

/// The function tools for the chat body; `None` without a `tools` list.
fn tools(tools: Option<&Value>) -> Result<Option<Vec<Value>>, PromptError> {
    let invalid = |why: &str| PromptError::Invalid(format!("tool: {why}"));
    let tools = match tools {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(tools)) => tools,
        Some(_) => return Err(PromptError::Invalid("`tools` must be an array".into())),
    };
    let mut out = Vec::with_capacity(tools.len());
    for tool in tools {
        let Value::Object(t) = tool else { return Err(invalid("must be an object")) };
        let Some(Value::String(name)) = t.get("name") else { return Err(invalid("`name` must be a string")) };
        let Some(Value::Object(schema)) = t.get("input_schema") else {
            return Err(invalid("`input_schema` must be an object"));
        };
        let mut schema = schema.clone();
        schema.entry("type").or_insert_with(|| Value::String("object".into()));
        let description = t.get("description").cloned().unwrap_or(Value::Null);
        if !description.is_null() && !description.is_string() {
            return Err(invalid("`description` must be a string"));
        }
        let mut function = Map::new();
        function.insert("name".into(), Value::String(name.clone()));
        function.insert("description".into(), description);
        function.insert("parameters".into(), Value::Object(schema));
        for flag in ["strict", "defer_loading"] {
            match t.get(flag) {
                None | Some(Value::Null) => {}
                Some(v @ Value::Bool(_)) => {
                    function.insert(flag.into(), v.clone());
                }
                Some(_) => return Err(invalid(&format!("`{flag}` must be a boolean"))),
            }
        }
        out.push(json!({"type": "function", "function": Value::Object(function)}));
    }
    Ok(Some(out))
}

/// `tool_choice` changes nothing in the prompt, but vLLM refuses a malformed one.
fn check_tool_choice(choice: Option<&Value>) -> Result<(), PromptError> {
    let invalid = |why: &str| Err(PromptError::Invalid(format!("tool_choice: {why}")));
    let choice = match choice {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Object(c)) => c,
        Some(_) => return invalid("must be an object"),
    };
    match choice.get("type").and_then(Value::as_str) {
        Some("auto" | "any" | "none") => Ok(()),
        Some("tool") if choice.get("name").and_then(Value::as_str).is_some_and(|n| !n.is_empty()) => Ok(()),
        Some("tool") => invalid("`name` is required when `type` is \"tool\""),
        _ => invalid("`type` must be auto, any, tool or none"),
    }
}

/// `output_config.effort`, checked.
fn output_effort(config: Option<&Value>) -> Result<Option<String>, PromptError> {
    let config = match config {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(c)) => c,
        Some(_) => return Err(PromptError::Invalid("`output_config` must be an object".into())),
    };
    match config.get("effort") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(e)) if EFFORTS.contains(&e.as_str()) => Ok(Some(e.clone())),
        Some(_) => Err(PromptError::Invalid(format!("output_config.effort must be one of {EFFORTS:?}"))),
    }
}

/// Python's truth of a JSON value.
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// Whether `thinking` turns thinking off; a malformed one is refused as vLLM refuses it, and so
/// is a thinking budget not below `max_tokens` (when given).
fn thinking_disabled(thinking: Option<&Value>, max_tokens: Option<f64>) -> Result<bool, PromptError> {
    let thinking = match thinking {
        None | Some(Value::Null) => return Ok(false),
        Some(Value::Object(t)) => t,
        Some(_) => return Err(PromptError::Invalid("`thinking` must be an object".into())),
    };
    match thinking.get("type").and_then(Value::as_str) {
        Some("disabled") => Ok(true),
        Some("adaptive") => Ok(false),
        Some("enabled") => match thinking.get("budget_tokens").and_then(Value::as_u64) {
            Some(budget) if budget < 1024 => {
                Err(PromptError::Invalid("thinking.budget_tokens must be at least 1024".into()))
            }
            Some(budget) if max_tokens.is_some_and(|max| budget as f64 >= max) => {
                Err(PromptError::Invalid("thinking.budget_tokens must be less than max_tokens".into()))
            }
            Some(_) => Ok(false),
            None => Err(PromptError::Invalid("thinking.budget_tokens must be an integer".into())),
        },
        _ => Err(PromptError::Invalid("thinking.type must be enabled, disabled or adaptive".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompt::content_format::ContentFormat;

    fn read(body: Value) -> Result<MessagesChat, PromptError> {
        let mut body = body.as_object().unwrap().clone();
        body.entry("max_tokens").or_insert(json!(16));
        MessagesChat::from_request(&body, 1_700_000_000)
    }

    fn messages(body: Value, merge: bool) -> Vec<Value> {
        read(body).unwrap().chat_input(merge, || "none").unwrap().messages_for(ContentFormat::String, false)
    }

    #[test]
    fn system_blocks_join_without_the_billing_header() {
        let body = json!({"system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1"},
            {"type": "text", "text": "A."}, {"type": "text", "text": " B."}],
            "messages": [{"role": "user", "content": "q"}]});
        assert_eq!(messages(body, false)[0], json!({"role": "system", "content": "A. B."}));
    }

    #[test]
    fn inline_system_messages_stay_or_merge() {
        let body = json!({"system": "Top.", "messages": [{"role": "user", "content": "a"},
            {"role": "system", "content": "Reminder."}, {"role": "user", "content": "b"}]});
        let chat = read(body).unwrap();
        let kept = chat.chat_input(false, || "none").unwrap();
        assert_eq!(kept.messages[2], json!({"role": "system", "content": "Reminder."}));
        let merged = chat.chat_input(true, || "none").unwrap();
        assert_eq!(merged.messages[0], json!({"role": "system", "content": "Top.Reminder."}));
        assert_eq!(merged.messages.len(), 3);
    }

    #[test]
    fn a_users_tool_results_come_before_its_text() {
        let body = json!({"messages": [
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "t"},
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"b": 1, "a": "é"}}]},
            {"role": "user", "content": [{"type": "text", "text": "see"},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "x"},
                    {"type": "text", "text": "y"}]}]}]});
        let chat = read(body).unwrap().chat_input(false, || "none").unwrap();
        assert_eq!(chat.messages[0]["tool_calls"][0]["function"]["arguments"], r#"{"b":1,"a":"é"}"#);
        assert_eq!(chat.messages[0]["reasoning"], "t");
        assert_eq!(chat.messages[1], json!({"role": "tool", "content": "x\ny", "tool_call_id": "toolu_1"}));
        assert_eq!(chat.messages[2]["content"], "see");
    }

    #[test]
    fn a_tool_use_without_an_id_is_named_after_the_time() {
        let body = json!({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]});
        let chat = read(body).unwrap().chat_input(false, || "none").unwrap();
        assert_eq!(chat.messages[0]["tool_calls"][0]["id"], "call_1700000000");
        assert_eq!(chat.messages[0]["tool_calls"][0]["function"]["arguments"], "{}");
    }

    #[test]
    fn thinking_disabled_asks_the_model_for_its_effort() {
        let body = json!({"thinking": {"type": "disabled"}, "output_config": {"effort": "max"},
            "messages": [{"role": "user", "content": "q"}]});
        let chat = read(body).unwrap().chat_input(false, || "low").unwrap();
        assert_eq!(chat.reasoning_effort.as_deref(), Some("low"));
        let body = json!({"output_config": {"effort": "high"}, "messages": [{"role": "user", "content": "q"}]});
        let chat = read(body).unwrap().chat_input(false, || unreachable!("thinking is not disabled")).unwrap();
        assert_eq!(chat.reasoning_effort.as_deref(), Some("high"));
    }

    #[test]
    fn tools_become_function_tools() {
        let body = json!({"tools": [{"name": "f", "input_schema": {"properties": {}}, "strict": true}],
            "messages": [{"role": "user", "content": "q"}]});
        let chat = read(body).unwrap().chat_input(false, || "none").unwrap();
        let tool = serde_json::to_string(&chat.tools.unwrap()[0]).unwrap();
        assert_eq!(
            tool,
            r#"{"type":"function","function":{"name":"f","description":null,"parameters":{"properties":{},"type":"object"},"strict":true}}"#
        );
    }

    #[test]
    fn an_empty_tool_list_reaches_the_template_as_one() {
        let chat = |tools: Value| {
            read(json!({"tools": tools, "messages": [{"role": "user", "content": "q"}]}))
                .unwrap()
                .chat_input(false, || "none")
                .unwrap()
        };
        assert_eq!(chat(json!([])).tools, Some(Vec::new()));
        assert_eq!(chat(Value::Null).tools, None);
    }

    #[test]
    fn what_kvgate_does_not_render_is_unsupported() {
        for body in [
            json!({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                "content": [{"type": "tool_reference", "tool_name": "f"}]}]}]}),
            json!({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t",
                "content": [{"type": "text", "text": "x"}]}]}]}),
            json!({"messages": [{"role": "system", "content": [{"type": "tool_addition",
                "tool": {"type": "tool_reference", "name": "f"}}]}]}),
        ] {
            assert!(matches!(read(body.clone()), Err(PromptError::Unsupported(_))), "{body}");
        }
    }

    #[test]
    fn malformed_requests_are_invalid() {
        for body in [
            json!({"max_tokens": null, "messages": [{"role": "user", "content": "q"}]}),
            json!({"messages": [{"role": "tool", "content": "q"}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "video"}]}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "tool_addition"}]}]}),
            json!({"thinking": {"type": "enabled", "budget_tokens": 10}, "messages": []}),
            json!({"thinking": {"type": "enabled", "budget_tokens": 2048}, "max_tokens": 2048, "messages": []}),
            json!({"max_tokens": 0, "messages": []}),
            json!({"system": [{"type": "tool_removal", "tool": {"type": "tool_reference", "name": "f"}}], "messages": []}),
            json!({"tool_choice": {"type": "tool"}, "messages": []}),
            json!({"output_config": {"effort": "extreme"}, "messages": []}),
            json!({"tools": [{"name": "f"}], "messages": []}),
        ] {
            assert!(matches!(read(body.clone()), Err(PromptError::Invalid(_))), "{body}");
        }
    }
}
