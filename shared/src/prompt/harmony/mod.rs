//! gpt-oss prompts as vLLM 0.32 renders them: not with the model's chat template but with
//! openai-harmony (`_make_request_with_harmony` in `renderers/online_renderer.py`, the
//! functions of `entrypoints/openai/parser/harmony_utils.py`, and the `oss-harmony` 0.0.11
//! renderer they call). vLLM picks this renderer for every model whose `config.json` says
//! `"model_type": "gpt_oss"`.
//!
//! The rules, each visible in the prompt ids:
//! - a system message opens every prompt: the model identity, `Knowledge cutoff: 2024-06`,
//!   `Current date:` (the engine's local date, `%Y-%m-%d`), `Reasoning:` (the request's
//!   top-level `reasoning_effort`: `low`, `medium` by default, `high`; any other value is a
//!   400), the channel rules, and a line about the `functions` channel when there are tools;
//! - a leading system or developer message is peeled off as instructions; a developer message
//!   follows with `# Instructions` and `# Tools` (the request's tools, their parameters in
//!   harmony's TypeScript-like notation: [`schema`]) when there is either;
//! - later system and developer messages become developer messages of instructions;
//! - an assistant message becomes its `reasoning` (channel `analysis`), then its content
//!   (`final`, or `commentary` beside tool calls: a message is left out when its first content
//!   part is empty), then one `commentary` message per tool call (`to=functions.NAME`, content
//!   type `json`, the `arguments` string as sent, ended by `<|call|>`);
//! - a tool result is authored by `functions.NAME` (the name of the call its `tool_call_id`
//!   names, `""` if none) and sent `to=assistant` on `commentary`;
//! - `analysis` messages before the last assistant `final` one are dropped;
//! - the prompt ends with `<|start|>assistant`, whatever `add_generation_prompt` and
//!   `continue_final_message` say;
//! - text is tokenized piece by piece as harmony does, special-token text inside a message as
//!   plain text.
//!
//! What vLLM's request validation refuses (a `null` user content, say) is rendered anyway:
//! the engine answers 400 whatever kvgate routes on.

mod schema;

use std::borrow::Cow;
use std::collections::HashMap;

use serde_json::Value;

use super::chat::ChatInput;
use super::PromptError;

/// The special tokens harmony writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Special {
    /// `<|start|>`: a message's header follows.
    Start,
    /// `<|message|>`: its content follows.
    Message,
    /// `<|end|>`: the message is over.
    End,
    /// `<|call|>`: a tool call is over.
    Call,
    /// `<|channel|>`: the header's channel follows.
    Channel,
}

impl Special {
    /// Every special token, in declaration order (a token's index is `special as usize`), for
    /// resolving their ids once.
    pub const ALL: [Special; 5] = [Special::Start, Special::Message, Special::End, Special::Call, Special::Channel];

    /// The token's text in the vocabulary.
    pub fn text(self) -> &'static str {
        match self {
            Special::Start => "<|start|>",
            Special::Message => "<|message|>",
            Special::End => "<|end|>",
            Special::Call => "<|call|>",
            Special::Channel => "<|channel|>",
        }
    }
}

/// One piece of a rendered prompt: a special token, or text tokenized on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece<'a> {
    /// A special token.
    Special(Special),
    /// Text, encoded by itself with special-token text taken literally.
    Text(Cow<'a, str>),
}

/// The prompt of `chat` as harmony pieces, with `date` as the conversation's start date.
pub fn render<'a>(chat: &'a ChatInput, date: &str) -> Result<Vec<Piece<'a>>, PromptError> {
    let effort = reasoning_effort(chat.reasoning_effort.as_deref())?;
    let (instructions, rest) = peel_instructions(&chat.messages);
    let tools = chat.tools.as_deref();
    let mut messages = vec![Message::text(Header::Role("system"), system_text(effort, date, tools.is_some()))];
    if instructions.as_deref().is_some_and(|i| !i.is_empty()) || tools.is_some() {
        messages.push(Message::text(Header::Role("developer"), developer_text(instructions.as_deref(), tools)));
    }
    let names = tool_call_names(rest);
    for message in rest {
        conversation_messages(message, &names, &mut messages)?;
    }
    drop_settled_analysis(&mut messages);
    let mut pieces = Vec::new();
    for message in messages {
        message.render_into(&mut pieces);
    }
    pieces.push(Piece::Special(Special::Start));
    pieces.push(Piece::Text(Cow::Borrowed("assistant")));
    Ok(pieces)
}

fn reasoning_effort(effort: Option<&str>) -> Result<&str, PromptError> {
    match effort {
        None => Ok("medium"),
        Some(effort @ ("low" | "medium" | "high")) => Ok(effort),
        Some(other) => Err(PromptError::Invalid(format!(
            "reasoning_effort {other:?} is not supported by harmony (low, medium or high)"
        ))),
    }
}

/// Who a message is from, and what its header says.
#[derive(Debug)]
enum Header<'a> {
    /// `system`, `developer`, `user`.
    Role(&'static str),
    /// `assistant<|channel|>CHANNEL`.
    Assistant(&'static str),
    /// `assistant to=functions.NAME<|channel|>commentary json`, the tool-call header vLLM
    /// writes back over oss-harmony's newer one.
    Call(&'a str),
    /// `functions.NAME<|channel|>commentary to=assistant`.
    ToolResult(&'a str),
}

/// One harmony message.
#[derive(Debug)]
struct Message<'a> {
    header: Header<'a>,
    /// Each content part, tokenized on its own.
    contents: Vec<Cow<'a, str>>,
}

impl<'a> Message<'a> {
    fn text(header: Header<'a>, text: String) -> Message<'a> {
        Message { header, contents: vec![Cow::Owned(text)] }
    }

    fn channel(&self) -> Option<&'static str> {
        match self.header {
            Header::Assistant(channel) => Some(channel),
            Header::Call(_) | Header::ToolResult(_) => Some("commentary"),
            Header::Role(_) => None,
        }
    }

    fn render_into(self, pieces: &mut Vec<Piece<'a>>) {
        let text = |s: String| Piece::Text(Cow::Owned(s));
        pieces.push(Piece::Special(Special::Start));
        match self.header {
            Header::Role(role) => pieces.push(Piece::Text(Cow::Borrowed(role))),
            Header::Assistant(channel) => pieces.extend([
                Piece::Text(Cow::Borrowed("assistant")),
                Piece::Special(Special::Channel),
                Piece::Text(Cow::Borrowed(channel)),
            ]),
            Header::Call(name) => pieces.extend([
                text(format!("assistant to=functions.{name}")),
                Piece::Special(Special::Channel),
                Piece::Text(Cow::Borrowed("commentary json")),
            ]),
            Header::ToolResult(name) => pieces.extend([
                text(format!("functions.{name}")),
                Piece::Special(Special::Channel),
                Piece::Text(Cow::Borrowed("commentary to=assistant")),
            ]),
        }
        pieces.push(Piece::Special(Special::Message));
        let end = if matches!(self.header, Header::Call(_)) { Special::Call } else { Special::End };
        pieces.extend(self.contents.into_iter().map(Piece::Text));
        pieces.push(Piece::Special(end));
    }
}

fn system_text(effort: &str, date: &str, has_tools: bool) -> String {
    let mut text = format!(
        "You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n\
         Current date: {date}\n\nReasoning: {effort}\n\n# Valid channels: analysis, commentary, final. \
         Channel must be included for every message."
    );
    if has_tools {
        text.push_str("\nCalls to these tools must go to the commentary channel: 'functions'.");
    }
    text
}

fn developer_text(instructions: Option<&str>, tools: Option<&[Value]>) -> String {
    let mut sections: Vec<Cow<str>> = Vec::new();
    if let Some(instructions) = instructions {
        sections.extend([Cow::Borrowed("# Instructions"), Cow::Borrowed(instructions)]);
    }
    if let Some(tools) = tools {
        sections.push(Cow::Owned(tools_section(tools)));
    }
    sections.join("\n\n")
}

/// `# Tools`, then the `functions` namespace: each tool's description as comments and its
/// parameters as a type.
fn tools_section(tools: &[Value]) -> String {
    let mut lines = vec!["## functions\n".to_owned(), "namespace functions {\n".to_owned()];
    for function in tools.iter().filter_map(|t| t.get("function")) {
        let name = function.get("name").and_then(Value::as_str).unwrap_or_default();
        let description = function.get("description").and_then(Value::as_str).unwrap_or_default();
        lines.extend(description.lines().map(|line| format!("// {line}")));
        lines.push(match function.get("parameters").filter(|p| !p.is_null()) {
            Some(parameters) => format!("type {name} = (_: {}) => any;\n", schema::typescript(parameters, "")),
            None => format!("type {name} = () => any;\n"),
        });
    }
    lines.push("} // namespace functions".to_owned());
    format!("# Tools\n\n{}", lines.join("\n"))
}

/// A leading system or developer message's text, and the messages after it.
fn peel_instructions(messages: &[Value]) -> (Option<Cow<'_, str>>, &[Value]) {
    match messages.split_first() {
        Some((first, rest)) if matches!(role(first), "system" | "developer") => (flattened(first.get("content")), rest),
        _ => (None, messages),
    }
}

fn role(message: &Value) -> &str {
    message.get("role").and_then(Value::as_str).unwrap_or_default()
}

fn field<'a>(message: &'a Value, key: &str) -> Option<&'a str> {
    message.get(key).and_then(Value::as_str)
}

/// Content as one string, its parts joined with nothing; `None` for `null` or no parts.
fn flattened(content: Option<&Value>) -> Option<Cow<'_, str>> {
    match content? {
        Value::String(s) => Some(Cow::Borrowed(s)),
        Value::Array(parts) if !parts.is_empty() => Some(Cow::Owned(parts.iter().filter_map(Value::as_str).collect())),
        _ => None,
    }
}

/// Content as its parts, each tokenized on its own (`null` is one empty part).
fn parts(content: Option<&Value>) -> Vec<Cow<'_, str>> {
    match content {
        Some(Value::String(s)) => vec![Cow::Borrowed(s.as_str())],
        Some(Value::Array(parts)) => parts.iter().map(|p| Cow::Borrowed(p.as_str().unwrap_or_default())).collect(),
        _ => vec![Cow::Borrowed("")],
    }
}

/// Each tool call's id and function name (a later call with the same id wins).
fn tool_call_names(messages: &[Value]) -> HashMap<&str, &str> {
    let calls = messages.iter().filter_map(|m| m.get("tool_calls")?.as_array()).flatten();
    calls.filter_map(|c| Some((field(c, "id")?, c.get("function").and_then(|f| field(f, "name"))?))).collect()
}

/// The harmony messages one chat message becomes.
fn conversation_messages<'a>(
    message: &'a Value,
    names: &HashMap<&str, &'a str>,
    out: &mut Vec<Message<'a>>,
) -> Result<(), PromptError> {
    let content = message.get("content");
    let reasoning = field(message, "reasoning").filter(|r| !r.is_empty());
    let analysis = |r: &'a str| Message { header: Header::Assistant("analysis"), contents: vec![Cow::Borrowed(r)] };
    match role(message) {
        "assistant" => {
            let calls = message.get("tool_calls").and_then(Value::as_array).filter(|c| !c.is_empty());
            if let Some(calls) = calls {
                if let Some(text) = flattened(content).filter(|t| !t.is_empty()) {
                    out.push(Message { header: Header::Assistant("commentary"), contents: vec![text] });
                }
                out.extend(reasoning.map(analysis));
                for function in calls.iter().filter_map(|c| c.get("function")) {
                    let name = field(function, "name").unwrap_or_default();
                    let arguments = field(function, "arguments").unwrap_or_default();
                    out.push(Message { header: Header::Call(name), contents: vec![Cow::Borrowed(arguments)] });
                }
                return Ok(());
            }
            out.extend(reasoning.map(analysis));
            let contents = parts(content);
            if contents.first().is_some_and(|c| !c.is_empty()) {
                out.push(Message { header: Header::Assistant("final"), contents });
            }
        }
        "tool" => {
            let name = field(message, "tool_call_id").and_then(|id| names.get(id).copied()).unwrap_or_default();
            let text = flattened(content).unwrap_or_default();
            out.push(Message { header: Header::ToolResult(name), contents: vec![text] });
        }
        "system" | "developer" => {
            if let Some(instructions) = flattened(content) {
                out.push(Message::text(Header::Role("developer"), format!("# Instructions\n\n{instructions}")));
            }
        }
        "user" => out.push(Message { header: Header::Role("user"), contents: parts(content) }),
        other => return Err(PromptError::Invalid(format!("harmony has no role {other:?}"))),
    }
    Ok(())
}

/// Drops the `analysis` messages before the last assistant `final` one: reasoning whose answer
/// was given is not shown again.
fn drop_settled_analysis(messages: &mut Vec<Message<'_>>) {
    let Some(last_final) = messages.iter().rposition(|m| matches!(m.header, Header::Assistant("final"))) else {
        return;
    };
    let mut index = 0;
    messages.retain(|m| {
        index += 1;
        !(index - 1 < last_final && m.channel() == Some("analysis"))
    });
}
