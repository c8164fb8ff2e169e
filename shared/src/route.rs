//! The one way a [`RouteRequest`] is built from a parsed OpenAI request. The filter (a prompt
//! tokenized in Envoy, or one it could not tokenize) and the sidecar's offload path (a body
//! tokenized there) both call [`route_request`], so the two can never disagree on what is
//! booked, salted or keyed.

use crate::hash::{cache_salt, prompt_block_hashes_first_salted, Salt};
use crate::ids::{ModelName, RequestId};
use crate::prompt::openai::ParsedRequest;
use crate::wire::{PromptCount, RouteRequest, ScoringOverrides};

/// What identifies and steers one request, besides its body.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestKeys {
    /// The booking key the filter generated for the stream.
    pub request_id: RequestId,
    /// The client's `x-request-id`, for logs.
    pub client_request_id: Option<String>,
    /// The `x-session-id` header: it takes precedence over the body's `session_id`/`user`.
    pub session: Option<String>,
    /// The `x-kvgate-scoring` header, parsed.
    pub overrides: Option<ScoringOverrides>,
    /// How long the filter waits for capacity (see [`crate::wire::RouteRequest::wait_ms`]).
    pub wait_ms: u32,
    /// The priority class header's value, if the filter is configured to read one.
    pub priority: Option<String>,
    /// The tenant header's value, if the filter is configured to read one.
    pub tenant: Option<String>,
    /// The TTFT SLO header's value in ms, if the filter is configured to read one and it is a
    /// whole number.
    pub ttft_slo_ms: Option<u32>,
    /// The ITL SLO header's value in ms, likewise.
    pub itl_slo_ms: Option<u32>,
    /// Whether the filter can run a prefill leg for it (see
    /// [`crate::wire::RouteRequest::prefill_legs`]).
    pub prefill_legs: bool,
}

/// The prompt as far as it is known.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PromptTokens<'a> {
    /// Tokenized: `tokens` (the whole prompt, or its head when `total` is larger), hashed in
    /// blocks of `block_size` with `salt` (a LoRA adapter's name, or none) — and the request's
    /// `cache_salt` on the first block, as vLLM hashes it.
    Tokenized {
        /// The prompt's first tokens (all of them unless truncated).
        tokens: &'a [u32],
        /// All its tokens, counted or extrapolated.
        total: usize,
        /// The pool's block size.
        block_size: u32,
        /// The hash salt.
        salt: Salt,
    },
    /// Not tokenized: an estimate of its size, routed on load alone.
    Estimated {
        /// Estimated prompt tokens.
        tokens: u32,
        /// The pool's block size, if known (0 if not).
        block_size: u32,
    },
}

/// The route request for `parsed`.
pub fn route_request(parsed: &ParsedRequest, keys: &RequestKeys, prompt: PromptTokens<'_>) -> RouteRequest {
    let (prompt_tokens, prompt_count, block_hashes, block_size) = match prompt {
        PromptTokens::Tokenized { tokens, total, block_size, salt } => {
            let first = parsed.cache_salt.as_deref().map_or(Salt::NONE, cache_salt);
            let hashes = prompt_block_hashes_first_salted(tokens, block_size as usize, salt, first);
            let count = if total == tokens.len() { PromptCount::Exact } else { PromptCount::Head };
            (u32::try_from(total).unwrap_or(u32::MAX), count, hashes, block_size)
        }
        PromptTokens::Estimated { tokens, block_size } => (tokens, PromptCount::Estimated, Vec::new(), block_size),
    };
    RouteRequest {
        request_id: keys.request_id.clone(),
        client_request_id: keys.client_request_id.clone(),
        model: parsed.model.clone(),
        prompt_tokens,
        prompt_count,
        block_hashes,
        block_size,
        session: keys.session.clone().or_else(|| parsed.session.clone()),
        overrides: keys.overrides,
        max_tokens: parsed.max_tokens,
        prompts: u32::try_from(parsed.prompt_count).unwrap_or(u32::MAX).max(1),
        samples: parsed.samples,
        stream: parsed.stream,
        wait_ms: keys.wait_ms,
        priority: keys.priority.clone(),
        tenant: keys.tenant.clone(),
        ttft_slo_ms: keys.ttft_slo_ms,
        itl_slo_ms: keys.itl_slo_ms,
        prefill_legs: keys.prefill_legs,
    }
}

/// The route request of a request for `model` whose prompt could not be read (content parts
/// kvgate does not render, a template that fails): routed and booked on `tokens`, an estimate,
/// on load alone — its load is real even if its prompt is unknown.
pub fn estimated_request(model: &str, keys: &RequestKeys, tokens: u32, block_size: u32) -> RouteRequest {
    RouteRequest {
        request_id: keys.request_id.clone(),
        client_request_id: keys.client_request_id.clone(),
        model: ModelName::from(model),
        prompt_tokens: tokens,
        prompt_count: PromptCount::Estimated,
        block_hashes: Vec::new(),
        block_size,
        session: keys.session.clone(),
        overrides: keys.overrides,
        max_tokens: None,
        prompts: 1,
        samples: 1,
        // Unknown: its first token is waited for, as for a streamed one.
        stream: true,
        wait_ms: keys.wait_ms,
        priority: keys.priority.clone(),
        tenant: keys.tenant.clone(),
        ttft_slo_ms: keys.ttft_slo_ms,
        itl_slo_ms: keys.itl_slo_ms,
        prefill_legs: keys.prefill_legs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompt::openai::{parse, Endpoint};

    #[test]
    fn a_cache_salt_salts_the_first_block_only() {
        let body = |salt: &str| format!(r#"{{"model":"m","prompt":"hi"{salt}}}"#);
        let keys = RequestKeys::default();
        let tokens: Vec<u32> = (0..8).collect();
        let prompt = PromptTokens::Tokenized { tokens: &tokens, total: 8, block_size: 4, salt: Salt::NONE };
        let hashes =
            |b: &str| route_request(&parse(Endpoint::Completions, b.as_bytes()).unwrap(), &keys, prompt).block_hashes;
        let plain = hashes(&body(""));
        let salted = hashes(&body(r#","cache_salt":"tenant-a""#));
        let other = hashes(&body(r#","cache_salt":"tenant-b""#));
        assert_eq!(plain, crate::hash::prompt_block_hashes(&tokens, 4, Salt::NONE));
        assert!(salted.iter().zip(&plain).all(|(s, p)| s != p), "every block differs through the chain");
        assert_ne!(salted, other, "tenants do not share");
        let first =
            crate::hash::next_sequence_hash(None, crate::hash::local_block_hash(&tokens[..4], cache_salt("tenant-a")));
        assert_eq!(salted[0], first, "the first block is salted as the index salts a stored one");
        let rest = crate::hash::local_block_hash(&tokens[4..], Salt::NONE);
        assert_eq!(salted[1], crate::hash::next_sequence_hash(Some(first), rest), "the second is not salted itself");
        assert!(parse(Endpoint::Completions, body(r#","cache_salt":7"#).as_bytes()).is_err(), "vLLM refuses it too");
    }

    #[test]
    fn the_header_session_wins_and_the_body_fills_in() {
        let parsed = parse(Endpoint::Completions, br#"{"model":"m","prompt":"hi","user":"u","max_tokens":7}"#).unwrap();
        let keys = RequestKeys { request_id: "k".into(), ..RequestKeys::default() };
        let prompt = PromptTokens::Tokenized { tokens: &[1, 2, 3, 4, 5], total: 9, block_size: 2, salt: Salt::NONE };
        let r = route_request(&parsed, &keys, prompt);
        assert_eq!((r.session.as_deref(), r.max_tokens, r.prompt_tokens), (Some("u"), Some(7), 9));
        assert_eq!(r.prompt_count, PromptCount::Head, "9 tokens, 5 of them tokenized");
        assert_eq!(r.block_hashes.len(), 2, "full blocks of the tokens known");
        let keys = RequestKeys { session: Some("header".into()), ..keys };
        let r = route_request(&parsed, &keys, PromptTokens::Estimated { tokens: 40, block_size: 0 });
        assert_eq!((r.session.as_deref(), r.prompt_tokens, r.block_hashes.len()), (Some("header"), 40, 0));
        assert_eq!(r.prompt_count, PromptCount::Estimated);
    }
}
