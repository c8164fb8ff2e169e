//! A request's sequences, as vLLM 0.32's OpenAI server fans a request out into engine
//! requests and gathers their outputs back into choices and `usage`.
//!
//! Fanning out:
//! - a completion whose `prompt` is a list is one engine request per prompt
//!   (`OpenAIServingCompletion._create_completion`, request ids `{id}-{i}`);
//! - `n` > 1 makes each prompt a parent of `n` child requests with the same prompt
//!   (`AsyncLLM.add_request`, `ParentRequest.get_child_info`), queued one after the other.
//!   The first child scheduled caches its prompt's full blocks as it is scheduled
//!   (`KVCacheManager.allocate_slots`), so the others — scheduled after it in the same step
//!   when the budget allows — find them in the prefix cache (at most `len − 1` tokens, as any
//!   request): the prompt is computed once, its blocks stored once, and each child reports its
//!   own cached tokens.
//!
//! Sequences are numbered prompt by prompt, children in order: sequence `s` is child `s % n`
//! of prompt `s / n`. `best_of` is no field of vLLM 0.32's requests: like any unknown field it
//! is ignored, and `n` sequences are decoded.
//!
//! Gathering back ([`Gathered`]):
//! - choice `index`: a chat's is the child's (`output.index`); a completion's is
//!   `prompt · n + child`, streamed (`completion_stream_generator`) or not (`len(choices)` in
//!   `request_output_to_completion_response`). Both are the sequence number here;
//! - `usage.prompt_tokens`: each prompt's tokens once, however many children it has (a chat's
//!   `len(prompt_token_ids)`; a completion's sum over its prompts);
//! - `usage.completion_tokens`: every choice's tokens, summed;
//! - `usage.prompt_tokens_details.cached_tokens`: one engine request's `num_cached_tokens`,
//!   never a sum. Not streamed, the final output of the request's last prompt
//!   (`last_final_res` in completions, `final_res` in chat), which is made by that prompt's
//!   child that finished last (`ParentRequest.get_outputs` aggregates the children's outputs
//!   when the last one finishes, and that child's `RequestState.make_request_output` builds
//!   the output with its own `num_cached_tokens`). Streamed, the first output that arrived
//!   (`num_cached_tokens = res.num_cached_tokens` on the first iteration of
//!   `chat_completion_stream_generator` and `completion_stream_generator`).

use kvgate_shared::prompt::openai::{Endpoint, ParsedRequest, Prompt};
use serde_json::{json, Map, Value};

use crate::engine::Produced;

/// vLLM's cap on `n` (`VLLM_MAX_N_SEQUENCES`' default).
const MAX_N: i64 = 16_384;
/// Temperatures below this sample greedily (vLLM's `_SAMPLING_EPS`).
const SAMPLING_EPS: f64 = 1e-5;

/// `n`, the sequences decoded per prompt, checked as vLLM checks it: an integer (a chat's may
/// be `null`, read as 1), at least 1 and at most `VLLM_MAX_N_SEQUENCES`
/// (`_verify_num_sequences`), and 1 under greedy sampling, `temperature` 0
/// (`_verify_greedy_sampling`). Responses and Messages have no `n`: one sequence. The error is
/// vLLM's message.
pub fn samples(endpoint: Endpoint, body: &Map<String, Value>) -> Result<usize, String> {
    if endpoint.is_converted() {
        return Ok(1);
    }
    let n = match body.get("n") {
        None => 1,
        Some(Value::Null) if endpoint == Endpoint::ChatCompletions => 1,
        Some(v) => v
            .as_i64()
            .or_else(|| v.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64))
            .ok_or_else(|| format!("n: Input should be a valid integer, got {v}"))?,
    };
    if n < 1 {
        return Err(format!("n must be at least 1, got {n}."));
    }
    if n > MAX_N {
        return Err(format!(
            "n must be at most {MAX_N}, got {n}. To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable."
        ));
    }
    let greedy = body.get("temperature").and_then(Value::as_f64).is_some_and(|t| t < SAMPLING_EPS);
    if greedy && n > 1 {
        return Err(format!("n must be 1 when using greedy sampling, got {n}."));
    }
    Ok(n as usize)
}

/// The prompts of a completion whose `prompt` is a list of them (strings, or lists of token
/// ids, not mixed, as vLLM's `prompt` field types them); `None` for a request of one prompt,
/// the one kvgate's parser read. (The parser reads a list's first prompt and counts them; the
/// others are read here the same way.)
pub fn prompts(request: &ParsedRequest, body: &Map<String, Value>) -> Result<Option<Vec<Prompt>>, String> {
    let items = match body.get("prompt") {
        Some(Value::Array(items)) if request.prompt_count > 1 => items,
        _ => return Ok(None),
    };
    items
        .iter()
        .map(|item| match (&request.prompt, item) {
            (Prompt::Text { add_special_tokens, .. }, Value::String(text)) if !text.is_empty() => {
                Ok(Prompt::Text { text: text.clone(), add_special_tokens: *add_special_tokens })
            }
            (Prompt::Text { .. }, Value::String(_)) => Err("`prompt` must not be empty".to_owned()),
            (Prompt::Tokens(_), Value::Array(ids)) => token_ids(ids).map(Prompt::Tokens),
            _ => Err("a list of prompts holds strings or lists of token ids, not both".to_owned()),
        })
        .collect::<Result<_, _>>()
        .map(Some)
}

fn token_ids(ids: &[Value]) -> Result<Vec<u32>, String> {
    if ids.is_empty() {
        return Err("token prompt must not be empty".to_owned());
    }
    ids.iter()
        .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(|| format!("token id {v} is not a u32")))
        .collect()
}

/// The shape of a request's sequences: its prompts' lengths and `n`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fanout {
    prompt_lens: Vec<usize>,
    n: usize,
}

impl Fanout {
    /// `n` sequences for each prompt of `prompt_lens` tokens (at least one prompt, `n` ≥ 1).
    pub fn new(prompt_lens: Vec<usize>, n: usize) -> Fanout {
        debug_assert!(!prompt_lens.is_empty() && n >= 1);
        Fanout { prompt_lens, n }
    }

    /// Sequences per prompt.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Sequences in all.
    pub fn sequences(&self) -> usize {
        self.prompt_lens.len() * self.n
    }

    /// The prompt sequence `seq` decodes.
    pub fn prompt_of(&self, seq: usize) -> usize {
        seq / self.n
    }

    /// Prompt tokens as `usage` counts them: each prompt once.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_lens.iter().sum()
    }
}

/// `usage`, vLLM style.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// `prompt_tokens`.
    pub prompt: usize,
    /// `completion_tokens`.
    pub completion: usize,
    /// `prompt_tokens_details.cached_tokens`.
    pub cached: usize,
    /// Whether `prompt_tokens_details` is reported (`--enable-prompt-tokens-details`).
    pub details: bool,
}

impl Usage {
    /// The chat and completions `usage` object.
    pub fn json(&self) -> Value {
        let mut u = json!({"prompt_tokens": self.prompt, "completion_tokens": self.completion, "total_tokens": self.prompt + self.completion});
        if self.details {
            u["prompt_tokens_details"] = json!({"cached_tokens": self.cached});
        }
        u
    }

    /// The Messages API's `usage` (vLLM's `_build_anthropic_usage`): `input_tokens` leave out
    /// what the cache read, which is reported beside them when `prompt_tokens_details` is.
    pub fn anthropic_json(&self) -> Value {
        if self.details {
            json!({"input_tokens": self.prompt - self.cached, "output_tokens": self.completion,
                "cache_read_input_tokens": self.cached})
        } else {
            json!({"input_tokens": self.prompt, "output_tokens": self.completion})
        }
    }

    /// The Responses API's `usage`: cached tokens are always reported there.
    pub fn responses_json(&self) -> Value {
        json!({"input_tokens": self.prompt, "input_tokens_details": {"cached_tokens": self.cached},
            "output_tokens": self.completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt + self.completion})
    }
}

/// A request's outputs as they arrive from the engine, in the order it produced them.
#[derive(Debug, Clone)]
pub struct Gathered {
    fanout: Fanout,
    /// Each sequence's tokens so far.
    tokens: Vec<Vec<u32>>,
    /// Each sequence's cached prompt tokens, known with its first token.
    cached: Vec<Option<usize>>,
    /// The cached prompt tokens of the first output that arrived.
    first_cached: Option<usize>,
    /// Sequences in the order they finished.
    finished: Vec<usize>,
}

impl Gathered {
    /// Nothing yet of `fanout`'s sequences.
    pub fn new(fanout: Fanout) -> Gathered {
        let count = fanout.sequences();
        Gathered {
            fanout,
            tokens: vec![Vec::new(); count],
            cached: vec![None; count],
            first_cached: None,
            finished: Vec::new(),
        }
    }

    /// The request's shape.
    pub fn fanout(&self) -> &Fanout {
        &self.fanout
    }

    /// Takes a token; true if it is the request's first output. Tokens of sequences it does
    /// not have are ignored.
    pub fn push(&mut self, produced: &Produced) -> bool {
        let (seq, e) = (produced.seq, produced.emitted);
        let Some(tokens) = self.tokens.get_mut(seq) else { return false };
        tokens.push(e.token);
        self.cached[seq].get_or_insert(e.cached_tokens);
        if e.finished {
            self.finished.push(seq);
        }
        let first = self.first_cached.is_none();
        self.first_cached.get_or_insert(e.cached_tokens);
        first
    }

    /// Whether every sequence has finished.
    pub fn done(&self) -> bool {
        self.finished.len() == self.fanout.sequences()
    }

    /// Sequence `seq`'s tokens so far.
    pub fn tokens(&self, seq: usize) -> &[u32] {
        self.tokens.get(seq).map_or(&[], Vec::as_slice)
    }

    /// `usage` as vLLM reports it (see the module's doc): `streamed`, at the end of a stream;
    /// otherwise in a whole answer.
    pub fn usage(&self, streamed: bool, details: bool) -> Usage {
        let cached = if streamed {
            self.first_cached
        } else {
            let last_prompt = self.fanout.prompt_lens.len() - 1;
            let last = self.finished.iter().rev().find(|s| self.fanout.prompt_of(**s) == last_prompt);
            last.and_then(|s| self.cached[*s])
        };
        Usage {
            prompt: self.fanout.prompt_tokens(),
            completion: self.tokens.iter().map(Vec::len).sum(),
            cached: cached.unwrap_or(0),
            details,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::Emitted;
    use kvgate_shared::prompt::openai::parse;

    fn body(json: Value) -> Map<String, Value> {
        let Value::Object(map) = json else { panic!("an object") };
        map
    }

    #[test]
    fn n_is_checked_as_vllm_checks_it() {
        let chat = |json: Value| samples(Endpoint::ChatCompletions, &body(json));
        let completion = |json: Value| samples(Endpoint::Completions, &body(json));
        assert_eq!(chat(json!({})), Ok(1));
        assert_eq!(chat(json!({"n": 3})), Ok(3));
        assert_eq!(chat(json!({"n": null})), Ok(1), "a chat's n is `int | None`");
        assert!(completion(json!({"n": null})).is_err(), "a completion's n is `int`");
        assert_eq!(completion(json!({"n": 2.0})), Ok(2), "pydantic takes an integral float");
        assert!(completion(json!({"n": 2.5})).is_err());
        assert_eq!(completion(json!({"n": 0})), Err("n must be at least 1, got 0.".into()));
        assert!(completion(json!({"n": 16_385})).unwrap_err().contains("VLLM_MAX_N_SEQUENCES"));
        assert_eq!(
            chat(json!({"n": 3, "temperature": 0})),
            Err("n must be 1 when using greedy sampling, got 3.".into())
        );
        assert_eq!(chat(json!({"n": 1, "temperature": 0})), Ok(1));
        assert_eq!(completion(json!({"n": 2, "best_of": 5})), Ok(2), "best_of is ignored");
        assert_eq!(samples(Endpoint::Responses, &body(json!({"n": 4}))), Ok(1));
    }

    #[test]
    fn a_list_of_prompts_is_every_prompt() {
        let read = |json: Value| {
            let request = parse(Endpoint::Completions, json.to_string().as_bytes()).unwrap();
            prompts(&request, &body(json))
        };
        let text = |t: &str| Prompt::Text { text: t.into(), add_special_tokens: true };
        assert_eq!(read(json!({"model": "m", "prompt": "one"})), Ok(None));
        assert_eq!(read(json!({"model": "m", "prompt": ["a", "b"]})), Ok(Some(vec![text("a"), text("b")])));
        let ids = vec![Prompt::Tokens(vec![1, 2]), Prompt::Tokens(vec![3])];
        assert_eq!(read(json!({"model": "m", "prompt": [[1, 2], [3]]})), Ok(Some(ids)));
        assert_eq!(read(json!({"model": "m", "prompt": [1, 2, 3]})), Ok(None), "one prompt of ids");
        assert_eq!(read(json!({"model": "m", "prompt": ["only"]})), Ok(None), "a list of one is its first");
        assert!(read(json!({"model": "m", "prompt": ["a", [1]]})).is_err(), "not mixed");
        assert!(read(json!({"model": "m", "prompt": ["a", ""]})).is_err());
        assert!(read(json!({"model": "m", "prompt": [[1], []]})).is_err());
        assert!(read(json!({"model": "m", "prompt": [[1], [-1]]})).is_err());
    }

    fn produced(seq: usize, cached_tokens: usize, index: usize, finished: bool) -> Produced {
        Produced { seq, emitted: Emitted { id: seq as u64, token: 7, index, cached_tokens, finished } }
    }

    #[test]
    fn usage_sums_prompts_once_and_reports_one_requests_cached_tokens() {
        // Two prompts of 40 and 30 tokens, n = 2: sequences 0, 1 decode the first, 2, 3 the
        // second. Each child produces two tokens; the first children found nothing cached,
        // the second ones 32 and 16 tokens of their sibling's blocks.
        let mut g = Gathered::new(Fanout::new(vec![40, 30], 2));
        let cached = [0, 32, 0, 16];
        assert!(g.push(&produced(0, cached[0], 1, false)), "the first output");
        for (seq, cached) in cached.iter().enumerate().skip(1) {
            assert!(!g.push(&produced(seq, *cached, 1, false)));
        }
        // They finish in the order 0, 3, 2, 1: prompt 1's last to finish is sequence 2.
        for seq in [0, 3, 2, 1] {
            g.push(&produced(seq, cached[seq], 2, true));
        }
        assert!(g.done());
        let whole = g.usage(false, true);
        assert_eq!((whole.prompt, whole.completion, whole.cached), (70, 8, 0), "sequence 2's cached tokens");
        assert_eq!(g.usage(true, true).cached, 0, "the first output's");
        assert_eq!(whole.json()["total_tokens"], 78);
        assert!(g.usage(false, false).json().get("prompt_tokens_details").is_none());
    }

    #[test]
    fn a_chat_reports_the_cached_tokens_of_its_last_child_to_finish() {
        let mut g = Gathered::new(Fanout::new(vec![100], 3));
        for (seq, cached) in [(0, 0), (1, 96), (2, 96)] {
            g.push(&produced(seq, cached, 1, true));
        }
        assert_eq!(g.usage(false, true), Usage { prompt: 100, completion: 3, cached: 96, details: true });
        assert_eq!(g.usage(true, true).cached, 0);
        assert_eq!((g.tokens(2), g.tokens(3)), (&[7][..], &[][..]));
    }
}
