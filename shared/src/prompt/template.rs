//! Rendering a chat template the way transformers' `apply_chat_template` does.
//!
//! transformers renders with a Jinja2 sandbox configured with `trim_blocks` and `lstrip_blocks`,
//! adds `raise_exception`, `strftime_now` ([`super::strftime`], in UTC) and a `tojson` that is Python's
//! `json.dumps(ensure_ascii=False)` (`", "` and `": "` separators, keys in insertion order).
//! minijinja plus its Python-compatibility methods (`.startswith`, `.strip`, …) gives the same
//! text; the few differences that matter are implemented here.

use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;
use serde_json::Value as Json;

use std::sync::OnceLock;

use super::chat::ChatInput;
use super::content_format::ContentFormat;
use super::messages::EFFORTS;
use super::PromptError;

const TEMPLATE_NAME: &str = "chat";

/// A compiled chat template. Compile once per model, render per request.
pub struct ChatTemplate {
    env: Environment<'static>,
    knows_developer_role: bool,
    content_format: ContentFormat,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// [`ChatTemplate::requires_system_first`], found at first use.
    system_first: OnceLock<bool>,
    /// [`ChatTemplate::disabled_thinking_effort`], found at first use.
    disabled_effort: OnceLock<&'static str>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source` with the model's special tokens. `content_format` is the content
    /// shape the template gets ([`ContentFormat::Auto`]: detected from `source`, as vLLM does).
    pub fn new(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
        content_format: ContentFormat,
    ) -> Result<Self, PromptError> {
        let mut env = bare_environment()?;
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        // The template as written must compile; its chains split, it renders the same text.
        env.add_template_owned(TEMPLATE_NAME, source.to_owned()).map_err(|e| PromptError::Template(e.to_string()))?;
        env.add_template_owned(TEMPLATE_NAME, super::chains::split(source))
            .map_err(|e| PromptError::Template(e.to_string()))?;
        let knows_developer_role = source.contains("\"developer\"") || source.contains("'developer'");
        let content_format = content_format.resolve(source);
        Ok(ChatTemplate {
            env,
            knows_developer_role,
            content_format,
            bos_token,
            eos_token,
            system_first: OnceLock::new(),
            disabled_effort: OnceLock::new(),
        })
    }

    /// The content shape this template gets (never [`ContentFormat::Auto`]).
    pub fn content_format(&self) -> ContentFormat {
        self.content_format
    }

    /// Whether the template refuses a system message after the first turn. vLLM then merges a
    /// `/v1/messages` request's inline system messages into the leading one: it renders the
    /// template on system, user, system, user in a bare Jinja environment — no
    /// `raise_exception`, no `strftime_now`, so a template that calls either fails — and merges
    /// if that fails (`AnthropicServingMessages._detect_merge_inline_system`).
    pub fn requires_system_first(&self) -> bool {
        *self.system_first.get_or_init(|| {
            let turn = |role: &str| serde_json::json!({"role": role, "content": "t"});
            let ctx = serde_json::json!({
                "messages": [turn("system"), turn("user"), turn("system"), turn("user")],
                "add_generation_prompt": false,
            });
            let rendered = || -> Result<String, Error> {
                let source = self.env.get_template(TEMPLATE_NAME)?.source().to_owned();
                let mut bare =
                    bare_environment().map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
                bare.add_template_owned(TEMPLATE_NAME, source)?;
                bare.get_template(TEMPLATE_NAME)?.render(Value::from(minijinja::value::Serde(&ctx)))
            };
            rendered().is_err()
        })
    }

    /// The `reasoning_effort` vLLM sends for a `/v1/messages` request with thinking disabled:
    /// `"none"`, unless the template renders effort `"none"` as it renders a real effort (it
    /// ignores it) or fails on it; then `"low"` (`_probe_disabled_thinking_effort`, on a
    /// one-message chat, rendered at `unix_secs`).
    pub fn disabled_thinking_effort(&self, unix_secs: i64) -> &'static str {
        self.disabled_effort.get_or_init(|| {
            let probe = |effort: &str| {
                let body =
                    serde_json::json!({"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": effort});
                let chat = ChatInput::from_request(body.as_object()?).ok()?;
                self.render_at(&chat, unix_secs).ok()
            };
            match probe("none") {
                Some(none) if EFFORTS.iter().all(|e| probe(e).as_ref() != Some(&none)) => "none",
                _ => "low",
            }
        })
    }

    /// Renders a normalised chat into the prompt text, now.
    pub fn render(&self, chat: &ChatInput) -> Result<String, PromptError> {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        self.render_at(chat, i64::try_from(now).unwrap_or(i64::MAX))
    }

    /// Renders as [`ChatTemplate::render`] would at `unix_secs` (what `strftime_now` prints).
    pub fn render_at(&self, chat: &ChatInput, unix_secs: i64) -> Result<String, PromptError> {
        let mut messages = chat.messages_for(self.content_format, self.knows_developer_role);
        if chat.continue_final_message {
            // transformers 5: mark where the final message ends, render, cut there.
            let content = messages.last_mut().and_then(|m| m.get_mut("content"));
            let last_text = match content {
                Some(Json::Array(parts)) => parts.last_mut().and_then(|p| p.get_mut("text")),
                other => other,
            };
            match last_text {
                Some(Json::String(content)) => content.push_str(CONTINUE_TAG),
                _ => return Err(PromptError::Template("continue_final_message: the final message has no text".into())),
            }
        }
        // What the render sets, over the request's `chat_template_kwargs`; each converted to
        // the template's values from where it is (a copy of a long history or of many tools
        // costs as much as a render).
        let own = Context {
            messages: &messages,
            tools: chat.tools.as_deref(),
            now: unix_secs,
            add_generation_prompt: chat.add_generation_prompt,
            continue_final_message: chat.continue_final_message,
            bos_token: self.bos_token.as_deref(),
            eos_token: self.eos_token.as_deref(),
        };
        let ctx = minijinja::value::merge_maps([
            Value::from(minijinja::value::Serde(&own)),
            Value::from(minijinja::value::Serde(&chat.kwargs)),
        ]);
        let template = self.env.get_template(TEMPLATE_NAME).map_err(|e| PromptError::Template(e.to_string()))?;
        let rendered = template.render(ctx).map_err(|e| PromptError::Template(format!("{e:#}")))?;
        if chat.continue_final_message {
            continue_final(rendered)
        } else {
            Ok(rendered)
        }
    }
}

/// Jinja2's environment as transformers and vLLM configure it (`trim_blocks`, `lstrip_blocks`,
/// Python's string and dict methods, `tojson`), before transformers adds its functions.
fn bare_environment() -> Result<Environment<'static>, PromptError> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| PromptError::Template(e.to_string()))?;
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson);
    env.add_filter(super::chains::STRING_FILTER, super::chains::string_only);
    Ok(env)
}

/// The marker transformers appends to the final message for `continue_final_message`.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// transformers' `continue_final_message` cut: at the marker if the template kept its
/// trailing space (the message's own trailing whitespace survives), else at the marker with
/// trailing whitespace trimmed.
fn continue_final(rendered: String) -> Result<String, PromptError> {
    let tag = CONTINUE_TAG.trim_end();
    let Some(at) = rendered.rfind(tag) else {
        return Err(PromptError::Template(
            "continue_final_message: the final message does not appear in the rendered chat".into(),
        ));
    };
    if rendered[at..].starts_with(CONTINUE_TAG) {
        Ok(rendered[..at].to_owned())
    } else {
        Ok(rendered[..at].trim_end().to_owned())
    }
}

/// Where `strftime_now` finds the render's instant (seconds since the epoch): [`Context::now`].
const NOW_VAR: &str = "__kvgate_now__";

/// The variables a render sets; a request's `chat_template_kwargs` of the same names give way.
#[derive(Serialize)]
struct Context<'a> {
    messages: &'a [Json],
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<&'a [Json]>,
    /// [`NOW_VAR`].
    #[serde(rename = "__kvgate_now__")]
    now: i64,
    add_generation_prompt: bool,
    continue_final_message: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    bos_token: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    eos_token: Option<&'a str>,
}

fn strftime_now(state: &minijinja::State, format: String) -> Result<Value, Error> {
    let now = state.lookup(NOW_VAR).and_then(|v| v.as_i64()).unwrap_or(0);
    super::strftime::strftime(&format, now).map(Value::from).map_err(|e| Error::new(ErrorKind::InvalidOperation, e))
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// Python's `json.dumps(value, ensure_ascii=False)` formatting: `", "` and `": "`.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// The `tojson` filter of transformers' environment (optional `indent=N`).
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let result = match indent {
        None => value.serialize(&mut serde_json::Serializer::with_formatter(&mut out, PythonFormatter)),
        Some(n) => {
            let pad = vec![b' '; n];
            let formatter = serde_json::ser::PrettyFormatter::with_indent(&pad);
            value.serialize(&mut serde_json::Serializer::with_formatter(&mut out, formatter))
        }
    };
    result.map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let text = String::from_utf8(out).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(Value::from_safe_string(text))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(source: &str, body: Json) -> Result<String, PromptError> {
        let chat = ChatInput::from_request(body.as_object().unwrap()).unwrap();
        ChatTemplate::new(source, Some("<s>".into()), Some("</s>".into()), ContentFormat::Auto)?.render(&chat)
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let out = render(
            "{{ messages[0].tool_calls[0].function.arguments | tojson }}",
            json!({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                "function": {"name": "f", "arguments": "{\"b\":[1,2],\"a\":\"ü<\"}"}}]}]}),
        )
        .unwrap();
        assert_eq!(out, r#"{"b": [1, 2], "a": "ü<"}"#);
    }

    #[test]
    fn trims_blocks_and_knows_special_tokens() {
        let src = "{{ bos_token }}{% for m in messages %}\n  {% if true %}{{ m.role }}:{{ m.content.strip() }}{% endif %}\n{% endfor %}{{ eos_token }}";
        let out = render(src, json!({"messages": [{"role": "user", "content": "  hi  "}]})).unwrap();
        assert_eq!(out, "<s>user:hi</s>"); // what Jinja2 gives
    }

    /// vLLM's probe renders in a bare environment: a template that calls `raise_exception` or
    /// `strftime_now` on system, user, system, user needs system messages first.
    #[test]
    fn system_first_is_probed_as_vllm_probes_it() {
        let probe =
            |source: &str| ChatTemplate::new(source, None, None, ContentFormat::Auto).unwrap().requires_system_first();
        let each = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}";
        assert!(!probe(each));
        let guarded = "{% for m in messages %}{% if m.role == 'system' and not loop.first %}\
            {{ raise_exception('System message must be at the beginning.') }}{% endif %}{{ m.content }}{% endfor %}";
        assert!(probe(guarded));
        let dated = format!("{{% set today = strftime_now('%Y-%m-%d') %}}{each}");
        assert!(probe(&dated), "no strftime_now in vLLM's probe");
        let checked = format!("{{% if strftime_now is defined %}}{{{{ strftime_now('%Y') }}}}{{% endif %}}{each}");
        assert!(!probe(&checked));
    }

    #[test]
    fn raise_exception_is_an_error() {
        let err = render("{{ raise_exception('nope') }}", json!({"messages": [{"role": "user", "content": "x"}]}));
        assert!(matches!(err, Err(PromptError::Template(m)) if m.contains("nope")));
    }

    /// transformers 5's rule: the message's trailing whitespace is kept if the template kept
    /// it, trimmed if the template trimmed it.
    #[test]
    fn continue_final_message_cuts_after_last_content() {
        let body = json!({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "partial "}],
                          "continue_final_message": true, "add_generation_prompt": false});
        let keeps = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}";
        assert_eq!(render(keeps, body.clone()).unwrap(), "<user>q</user><assistant>partial ");
        let trims = "{% for m in messages %}<{{ m.role }}>{{ m.content.strip() }}</{{ m.role }}>{% endfor %}";
        assert_eq!(render(trims, body.clone()).unwrap(), "<user>q</user><assistant>partial");
        let drops = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}";
        assert!(render(drops, body).is_err(), "a template that drops the final message cannot continue it");
    }
}
