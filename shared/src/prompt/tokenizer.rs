//! A model's tokenizer plus chat template: turns a parsed request into prompt token ids.

use std::borrow::Cow;
use std::cell::RefCell;
use std::path::Path;

use serde_json::Value;
use tokenizers::pipeline::{EncodeOptions, PipelineToken, PipelineTokenizer};

use super::content_format::ContentFormat;
use super::harmony::{self, Piece, Special};
use super::openai::{ParsedRequest, Prompt};
use super::segments::{SegmentCache, SegmentStats};
use super::spread::{encode_pieces, Spread};
use super::template::ChatTemplate;
use super::{PromptError, Renderer};
use crate::wire::ModelBundle;

/// The model's `tokenizer.json` and chat renderer, loaded and compiled.
pub struct ModelTokenizer {
    tokenizer: PipelineTokenizer,
    chat: ChatRenderer,
    segments: Option<SegmentCache>,
    /// Whether long texts may be cut for threads: checked on first use, so a filter (which
    /// never spreads) pays nothing for it at load.
    spread: std::sync::OnceLock<Option<Spread>>,
}

/// How chats become prompt tokens for this model.
enum ChatRenderer {
    /// The model's chat template, if it has one.
    Template(Option<Box<ChatTemplate>>),
    /// Harmony, with the ids of its special tokens in this vocabulary.
    Harmony(HarmonyIds),
}

/// The id of each harmony special token, in [`Special::ALL`]'s order.
struct HarmonyIds([u32; Special::ALL.len()]);

impl HarmonyIds {
    fn resolve(tokenizer: &PipelineTokenizer) -> Result<HarmonyIds, PromptError> {
        let added = tokenizer.get_added_vocabulary();
        let mut ids = [0; Special::ALL.len()];
        for (id, special) in ids.iter_mut().zip(Special::ALL) {
            *id = added.token_to_id(special.text()).ok_or_else(|| {
                PromptError::Tokenizer(format!("a harmony model's vocabulary has no {} token", special.text()))
            })?;
        }
        Ok(HarmonyIds(ids))
    }

    fn id(&self, special: Special) -> u32 {
        self.0[special as usize]
    }
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let renderer = match &self.chat {
            ChatRenderer::Template(Some(_)) => "template",
            ChatRenderer::Template(None) => "none",
            ChatRenderer::Harmony(_) => "harmony",
        };
        f.debug_struct("ModelTokenizer").field("chat", &renderer).finish()
    }
}

impl ModelTokenizer {
    /// Loads from a bundle as served by the sidecar. A `tokenizer.json` the tokenizer cannot
    /// run (a model kind or component not built in) is refused with an error naming it.
    pub fn from_bundle(bundle: &ModelBundle) -> Result<Self, PromptError> {
        let tokenizer = load_tokenizer(&bundle.tokenizer_json)?;
        let chat = match bundle.renderer {
            Renderer::Template => ChatRenderer::Template(bundle.template()?.map(Box::new)),
            Renderer::Harmony => ChatRenderer::Harmony(HarmonyIds::resolve(&tokenizer)?),
        };
        Ok(ModelTokenizer { tokenizer, chat, segments: None, spread: std::sync::OnceLock::new() })
    }

    /// Caches tokenized chat segments, up to `budget` bytes (see [`SegmentCache`]). A
    /// tokenizer whose special tokens make that inexact keeps encoding in one go.
    pub fn with_segment_cache(mut self, budget: usize) -> Self {
        self.segments = SegmentCache::for_tokenizer(&self.tokenizer, budget);
        self
    }

    /// The segment cache's counters, if it is on.
    pub fn segment_stats(&self) -> Option<SegmentStats> {
        self.segments.as_ref().map(SegmentCache::stats)
    }

    /// The prompt token ids vLLM would compute for this request.
    pub fn prompt_tokens(&self, request: &ParsedRequest) -> Result<Vec<u32>, PromptError> {
        self.prompt_tokens_on(request, 1)
    }

    /// [`ModelTokenizer::prompt_tokens`], spreading a long chat's new text over up to
    /// `threads` threads (this one included) where the tokenizer allows it ([`Spread`]);
    /// the ids are the same.
    pub fn prompt_tokens_on(&self, request: &ParsedRequest, threads: usize) -> Result<Vec<u32>, PromptError> {
        Ok(self.head(request, usize::MAX, now_unix_secs(), threads)?.tokens)
    }

    /// Whether [`ModelTokenizer::prompt_tokens_on`] can spread this model's prompts at all.
    pub fn spreads(&self) -> bool {
        self.spread().is_some()
    }

    fn spread(&self) -> Option<Spread> {
        *self.spread.get_or_init(|| Spread::for_tokenizer(&self.tokenizer))
    }

    /// The first tokens of the prompt, tokenizing at most about `max_bytes` of its text: the
    /// text is cut just before a whitespace character that follows a non-whitespace one, a
    /// point no pre-tokenizer split crosses, so the tokens are exactly the prompt's first
    /// tokens. Token-id prompts are never cut.
    pub fn prompt_head(&self, request: &ParsedRequest, max_bytes: usize) -> Result<PromptHead, PromptError> {
        self.prompt_head_at(request, max_bytes, now_unix_secs())
    }

    /// [`ModelTokenizer::prompt_head`] as it would be at `unix_secs`: the date templates and
    /// harmony print.
    pub fn prompt_head_at(
        &self,
        request: &ParsedRequest,
        max_bytes: usize,
        unix_secs: i64,
    ) -> Result<PromptHead, PromptError> {
        self.head(request, max_bytes, unix_secs, 1)
    }

    fn head(
        &self,
        request: &ParsedRequest,
        max_bytes: usize,
        unix_secs: i64,
        threads: usize,
    ) -> Result<PromptHead, PromptError> {
        let (text, add_special_tokens) = match (&request.prompt, &self.chat) {
            (Prompt::Tokens(ids), _) => {
                return Ok(PromptHead { tokens: ids.clone(), estimated_total: ids.len(), truncated: false })
            }
            (Prompt::Text { text, add_special_tokens }, _) => (Cow::Borrowed(text.as_str()), *add_special_tokens),
            (Prompt::Chat(chat) | Prompt::Responses(chat), ChatRenderer::Template(template)) => {
                let template = template.as_ref().ok_or(PromptError::NoTemplate)?;
                (Cow::Owned(template.render_at(chat, unix_secs)?), chat.add_special_tokens)
            }
            (Prompt::Messages(messages), ChatRenderer::Template(template)) => {
                let template = template.as_ref().ok_or(PromptError::NoTemplate)?;
                let chat = messages
                    .chat_input(template.requires_system_first(), || template.disabled_thinking_effort(unix_secs))?;
                (Cow::Owned(template.render_at(&chat, unix_secs)?), chat.add_special_tokens)
            }
            (Prompt::Responses(_), ChatRenderer::Harmony(_)) => {
                return Err(PromptError::Unsupported("Responses requests to a harmony model".into()))
            }
            (Prompt::Messages(_), ChatRenderer::Harmony(_)) => {
                return Err(PromptError::Unsupported("Messages requests to a harmony model".into()))
            }
            (Prompt::Chat(chat), ChatRenderer::Harmony(ids)) => {
                let date = super::strftime::strftime("%Y-%m-%d", unix_secs).map_err(PromptError::Template)?;
                return self.harmony_head(&harmony::render(chat, &date)?, ids, max_bytes);
            }
        };
        let head = &text[..safe_cut(&text, max_bytes)];
        let spread = if threads > 1 { self.spread() } else { None };
        let encode_all = |pieces: &[&str]| encode_pieces(pieces, threads, spread, |p| self.encode(p, false));
        let tokens = match (&self.segments, add_special_tokens) {
            (Some(cache), false) => cache.encode(head, encode_all)?,
            (None, false) => encode_all(&[head])?.concat(),
            (_, true) => self.encode(head, true)?,
        };
        Ok(PromptHead::of(tokens, head.len(), text.len()))
    }

    /// The head of a harmony prompt: its pieces in order, each text encoded by itself (through
    /// the segment cache when on), up to about `max_bytes` of text.
    fn harmony_head(
        &self,
        pieces: &[Piece<'_>],
        ids: &HarmonyIds,
        max_bytes: usize,
    ) -> Result<PromptHead, PromptError> {
        let total: usize = pieces.iter().map(|p| if let Piece::Text(t) = p { t.len() } else { 0 }).sum();
        let literal =
            EncodeOptions { add_special_tokens: false, encode_special_tokens: true, ..EncodeOptions::default() };
        let encode = |text: &str| self.encode_with(text, &literal);
        let mut tokens = Vec::new();
        let mut budget = max_bytes;
        for piece in pieces {
            match piece {
                Piece::Special(special) => tokens.push(ids.id(*special)),
                Piece::Text(text) => {
                    let head = &text[..safe_cut(text, budget)];
                    match &self.segments {
                        Some(cache) => tokens.extend(cache.encode_piece(head, encode)?),
                        None => tokens.extend(encode(head)?),
                    }
                    if head.len() < text.len() {
                        return Ok(PromptHead::of(tokens, max_bytes - budget + head.len(), total));
                    }
                    budget -= text.len();
                }
            }
        }
        Ok(PromptHead::of(tokens, total, total))
    }

    /// Encodes text with the model's tokenizer (into this thread's reused buffer, then copied
    /// out at its exact size).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, PromptError> {
        self.encode_with(text, &EncodeOptions { add_special_tokens, ..EncodeOptions::default() })
    }

    fn encode_with(&self, text: &str, options: &EncodeOptions) -> Result<Vec<u32>, PromptError> {
        ENCODED.with_borrow_mut(|out| {
            out.clear();
            self.tokenizer.encode_into(text, options, out).map_err(|e| PromptError::Tokenizer(e.to_string()))?;
            let ids = PipelineToken::cast_slice(out).to_vec();
            if out.capacity() > MAX_KEPT_BUFFER {
                *out = Vec::new();
            }
            Ok(ids)
        })
    }

    /// Decodes token ids to text (used by the simulator to produce output text).
    pub fn decode(&self, ids: &[u32]) -> Result<String, PromptError> {
        self.tokenizer.decode(ids, true).map_err(|e| PromptError::Tokenizer(e.to_string()))
    }
}

thread_local! {
    /// The encode buffer, reused across calls on this thread.
    static ENCODED: RefCell<Vec<PipelineToken>> = const { RefCell::new(Vec::new()) };
}

/// A buffer grown past this (a huge prompt) is let go rather than kept for the next call.
const MAX_KEPT_BUFFER: usize = 1 << 20;

/// Reads a `tokenizer.json` into the tokenizer: the canonical ("version 2.0") form directly,
/// any older form through the upgrade pass first (which [`canonical_tokenizer_json`] does once,
/// where the sidecar reads the model, so the filter never has to).
///
/// A tokenizer that loads but cannot encode (a split pattern its SIMD pre-tokenizer does not
/// recognise: the reader has no regex engine behind it) is refused here, naming the patterns,
/// rather than failing on every request.
pub fn load_tokenizer(json: &str) -> Result<PipelineTokenizer, PromptError> {
    let canonical = canonical(json)?;
    let tokenizer =
        tokenizers::from_json(&canonical).map_err(|e| PromptError::Tokenizer(format!("tokenizer.json: {e}")))?;
    let mut probe = Vec::new();
    match tokenizer.encode_into(PROBE, &EncodeOptions::no_specials(), &mut probe) {
        Ok(()) => Ok(tokenizer),
        Err(e) => Err(PromptError::Tokenizer(format!(
            "tokenizer.json loads but cannot encode ({e}); its split patterns: {}",
            split_patterns(json).join(", ")
        ))),
    }
}

/// Text that reaches every pre-tokenizer and model component.
const PROBE: &str = "Probe text, 123 ok?\n";

/// The regex split patterns a `tokenizer.json` names, quoted (for an error message).
fn split_patterns(json: &str) -> Vec<String> {
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(o) => {
                if let Some(Value::String(p)) = o.get("pattern").and_then(|p| p.get("Regex")) {
                    out.push(format!("{p:?}"));
                }
                o.values().for_each(|v| walk(v, out));
            }
            Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    if let Ok(Value::Object(root)) = serde_json::from_str::<Value>(json) {
        root.get("pre_tokenizer").into_iter().chain(root.get("normalizer")).for_each(|v| walk(v, &mut out));
    }
    out
}

/// A `tokenizer.json` of any version, rewritten into the canonical form the tokenizer reads
/// (compact: it travels to every filter). Refuses what the upgrade pass cannot decide.
pub fn canonical_tokenizer_json(json: &str) -> Result<String, PromptError> {
    canonical(json).map(Cow::into_owned)
}

/// [`canonical_tokenizer_json`], borrowing a file that is canonical already (no copy of a
/// many-megabyte string in a wasm VM).
fn canonical(json: &str) -> Result<Cow<'_, str>, PromptError> {
    if is_canonical(json) {
        return Ok(Cow::Borrowed(json));
    }
    let mut value: Value =
        serde_json::from_str(json).map_err(|e| PromptError::Tokenizer(format!("tokenizer.json: {e}")))?;
    tokenizers::canonicalize_value(&mut value)
        .map_err(|e| PromptError::Tokenizer(format!("tokenizer.json cannot be upgraded: {e}")))?;
    serde_json::to_string(&value).map(Cow::Owned).map_err(|e| PromptError::Tokenizer(e.to_string()))
}

/// Whether the file says it is the canonical form (its first key is `"version": "2.0"`).
fn is_canonical(json: &str) -> bool {
    let rest = json.trim_start().strip_prefix('{').map(str::trim_start);
    let rest = rest.and_then(|r| r.strip_prefix("\"version\"")).map(str::trim_start);
    let rest = rest.and_then(|r| r.strip_prefix(':')).map(str::trim_start);
    rest.is_some_and(|r| r.starts_with("\"2.0\""))
}

/// The head of a prompt, tokenized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptHead {
    /// The prompt's first tokens (all of them if it was not cut).
    pub tokens: Vec<u32>,
    /// The whole prompt's token count: exact when not cut, else extrapolated by bytes.
    pub estimated_total: usize,
    /// Whether the prompt was cut.
    pub truncated: bool,
}

impl PromptHead {
    /// The head whose `tokens` are the first `head_bytes` of a `total_bytes` prompt text.
    fn of(tokens: Vec<u32>, head_bytes: usize, total_bytes: usize) -> PromptHead {
        let truncated = head_bytes < total_bytes;
        let estimated_total = match (truncated, head_bytes == 0) {
            (false, _) => tokens.len(),
            // Nothing could be cut off safely: about 4 bytes per token.
            (true, true) => total_bytes.div_ceil(4),
            (true, false) => (tokens.len() as f64 * total_bytes as f64 / head_bytes as f64).ceil() as usize,
        };
        PromptHead { tokens, estimated_total, truncated }
    }
}

/// Now, in seconds since the Unix epoch.
pub(crate) fn now_unix_secs() -> i64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    i64::try_from(now).unwrap_or(i64::MAX)
}

/// The largest `n <= max` such that `text[..n]` is the whole text, or ends just before a
/// whitespace character preceded by a non-whitespace one (0 if there is none).
fn safe_cut(text: &str, max: usize) -> usize {
    if text.len() <= max {
        return text.len();
    }
    let mut cut = 0;
    let mut prev_is_space = true;
    for (i, c) in text.char_indices() {
        if i > max {
            break;
        }
        if c.is_whitespace() && !prev_is_space {
            cut = i;
        }
        prev_is_space = c.is_whitespace();
    }
    cut
}

impl ModelBundle {
    /// Reads a Hugging Face model directory: `tokenizer.json` (kept in its canonical form) and, if present,
    /// `tokenizer_config.json` (for `chat_template`, `bos_token`, `eos_token`) and
    /// `chat_template.jinja`. The content format is left to detection.
    pub fn from_dir(model: &str, dir: &Path, block_size: u32) -> Result<ModelBundle, PromptError> {
        let read = |name: &str| {
            std::fs::read_to_string(dir.join(name))
                .map_err(|e| PromptError::Tokenizer(format!("{}: {e}", dir.join(name).display())))
        };
        let tokenizer_json = canonical_tokenizer_json(&read("tokenizer.json")?)?;
        let config: Value = if dir.join("tokenizer_config.json").exists() {
            serde_json::from_str(&read("tokenizer_config.json")?)
                .map_err(|e| PromptError::Tokenizer(format!("tokenizer_config.json: {e}")))?
        } else {
            Value::Null
        };
        let chat_template = match dir.join(CHAT_TEMPLATE_FILE).exists() {
            true => Some(read(CHAT_TEMPLATE_FILE)?),
            false => chat_template_of(&config),
        };
        let renderer = renderer_of(dir, chat_template.as_deref())?;
        Ok(ModelBundle {
            model: model.to_owned(),
            block_size,
            tokenizer_json,
            chat_template,
            bos_token: special_token(&config, "bos_token"),
            eos_token: special_token(&config, "eos_token"),
            content_format: ContentFormat::Auto,
            renderer,
        })
    }
}

/// The renderer vLLM picks for the model in `dir`: harmony when its `config.json` says
/// `"model_type": "gpt_oss"`. A directory without `config.json` (tokenizer files only) is
/// judged by its template: harmony's own template is gpt-oss's.
fn renderer_of(dir: &Path, template: Option<&str>) -> Result<Renderer, PromptError> {
    let config = dir.join("config.json");
    let gpt_oss = match std::fs::read_to_string(&config) {
        Ok(json) => {
            let value: Value = serde_json::from_str(&json)
                .map_err(|e| PromptError::Tokenizer(format!("{}: {e}", config.display())))?;
            value.get("model_type").and_then(Value::as_str) == Some("gpt_oss")
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            template.is_some_and(|t| t.contains("<|channel|>") && t.contains("<|message|>"))
        }
        Err(e) => return Err(PromptError::Tokenizer(format!("{}: {e}", config.display()))),
    };
    Ok(if gpt_oss { Renderer::Harmony } else { Renderer::Template })
}

impl ModelBundle {
    /// The bundle's chat template, compiled with its special tokens and content format
    /// (`None` if the model has no template).
    pub fn template(&self) -> Result<Option<ChatTemplate>, PromptError> {
        self.chat_template
            .as_deref()
            .map(|src| ChatTemplate::new(src, self.bos_token.clone(), self.eos_token.clone(), self.content_format))
            .transpose()
    }
}

/// Where transformers saves a model's chat template since 4.43; it wins over
/// `tokenizer_config.json`'s `chat_template`.
const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// `chat_template` is a string, or a list of `{name, template}` (the `default` one is used).
fn chat_template_of(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(named) => named
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_owned),
        _ => None,
    }
}

/// A special token is a string or an AddedToken object `{"content": …}`.
fn special_token(config: &Value, key: &str) -> Option<String> {
    match config.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}
