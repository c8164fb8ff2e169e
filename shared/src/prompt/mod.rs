//! Request → prompt token ids, the way vLLM does it (the rules this follows, one by one:
//! `docs/chat-rendering.md` at the repository's root).
//!
//! The pipeline is pure: bytes in, token ids out, no I/O. The filter runs it inside Envoy, the
//! simulator runs it to count `usage.prompt_tokens`, and the CLI runs it for debugging, so all
//! three always agree.
//!
//! 1. [`openai::parse`] reads the OpenAI body into a [`openai::ParsedRequest`]; a
//!    `/v1/responses` body is first turned into the chat vLLM renders for it ([`responses`]),
//!    a `/v1/messages` body into one that waits on two answers of the model's template
//!    ([`messages`]).
//! 2. [`chat`] normalises chat messages and tools as vLLM's renderer does.
//! 3. [`template::ChatTemplate`] renders them with the model's Jinja template (its printed
//!    concatenations printed piece by piece, the same text copied once: [`chains`]), with message
//!    content shaped as the template expects ([`content_format`]) — or, for gpt-oss,
//!    [`harmony`] renders them as vLLM does, into pieces of text and special tokens.
//! 4. [`tokenizer::ModelTokenizer`] encodes the text (or passes token ids through), through an
//!    exact [`segments::SegmentCache`] when enabled, so repeated turns are not re-tokenized;
//!    a caller with threads to spare spreads a long prompt's new text over them, cut where the
//!    ids stay exact ([`spread`]).

pub mod chains;
pub mod chat;
pub mod content_format;
pub mod harmony;
pub mod messages;
pub mod openai;
pub mod responses;
pub mod segments;
pub mod spread;
pub mod strftime;
pub mod template;
pub mod tokenizer;

/// How a model's chat requests become a prompt: what the engine does for the model, never
/// what a client asks for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Renderer {
    /// The model's Jinja chat template, with transformers' semantics.
    #[default]
    Template,
    /// openai-harmony, as vLLM renders gpt-oss ([`harmony`]).
    Harmony,
}

/// Why a request could not be turned into tokens. The filter fails open on every one of them.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    /// The body is not JSON, or not an object.
    #[error("body is not a JSON object: {0}")]
    Json(String),
    /// A field has the wrong type or value (what vLLM answers 400 for).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The chat template failed to compile or render.
    #[error("chat template: {0}")]
    Template(String),
    /// The model has no chat template but a chat request arrived.
    #[error("model has no chat template")]
    NoTemplate,
    /// The tokenizer failed to load or encode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A request shape the engine serves but kvgate does not render (history the engine
    /// keeps, a kind of tool it does not know): routed on an estimate.
    #[error("not rendered by kvgate: {0}")]
    Unsupported(String),
}
