//! The pure part of the filter: from a request body to the [`RouteRequest`] for the sidecar.
//! No hostcalls here, so it runs (and is tested) natively too.

use std::collections::HashMap;

use kvgate_shared::hash::{prompt_block_hashes, Salt};
use kvgate_shared::prompt::openai::{parse, Endpoint};
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::wire::RouteRequest;

/// A model the filter can tokenize for.
pub struct LoadedModel {
    /// Its tokenizer and chat template.
    pub tokenizer: ModelTokenizer,
    /// The pool's block size.
    pub block_size: u32,
}

/// Why a request is passed through without asking the sidecar (Envoy's LB decides).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skip {
    /// The body is not a request we can route (bad JSON, no model…); the engine will answer.
    Unroutable(String),
}

/// The decision request, plus what the filter reports about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// What to send to the sidecar.
    pub request: RouteRequest,
    /// True when the prompt was tokenized (false: load-only routing on an estimate).
    pub tokenized: bool,
}

/// A rough token count for prompts we cannot tokenize: ~4 bytes per token.
fn estimate_tokens(body_len: usize) -> u32 {
    u32::try_from(body_len / 4).unwrap_or(u32::MAX)
}

/// Plans the routing call for one request body.
///
/// Without a loaded tokenizer for the model, or for a body above `max_tokenize_bytes`, the
/// plan routes on load alone with an estimated prompt size; requests are never held back.
pub fn plan(
    endpoint: Endpoint,
    body: &[u8],
    request_id: &str,
    models: &HashMap<String, LoadedModel>,
    max_tokenize_bytes: usize,
) -> Result<Plan, Skip> {
    let parsed = parse(endpoint, body).map_err(|e| Skip::Unroutable(e.to_string()))?;
    let load_only = |block_size: u32| Plan {
        request: RouteRequest {
            request_id: request_id.to_owned(),
            model: parsed.model.clone(),
            prompt_tokens: estimate_tokens(body.len()),
            block_hashes: Vec::new(),
            block_size,
        },
        tokenized: false,
    };
    let Some(model) = models.get(&parsed.model) else { return Ok(load_only(0)) };
    if body.len() > max_tokenize_bytes {
        return Ok(load_only(model.block_size));
    }
    let tokens = model.tokenizer.prompt_tokens(&parsed).map_err(|e| Skip::Unroutable(e.to_string()))?;
    Ok(Plan {
        request: RouteRequest {
            request_id: request_id.to_owned(),
            model: parsed.model.clone(),
            prompt_tokens: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
            block_hashes: prompt_block_hashes(&tokens, model.block_size as usize, Salt::NONE),
            block_size: model.block_size,
        },
        tokenized: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_shared::wire::ModelBundle;
    use std::path::Path;

    fn models() -> HashMap<String, LoadedModel> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3-0.6b");
        let bundle = ModelBundle::from_dir("qwen3", &dir, 4).unwrap();
        let tokenizer = ModelTokenizer::from_bundle(&bundle).unwrap();
        HashMap::from([("qwen3".to_owned(), LoadedModel { tokenizer, block_size: 4 })])
    }

    #[test]
    fn tokenizes_and_hashes_full_blocks() {
        let m = models();
        let body = br#"{"model":"qwen3","messages":[{"role":"user","content":"What is the capital of France?"}]}"#;
        let p = plan(Endpoint::ChatCompletions, body, "r", &m, 1 << 20).unwrap();
        assert!(p.tokenized);
        let n = p.request.prompt_tokens as usize;
        assert!(n > 8);
        assert_eq!(p.request.block_hashes.len(), n / 4);
        assert_eq!(p.request.block_size, 4);
    }

    #[test]
    fn unknown_model_or_big_body_routes_on_load_only() {
        let m = models();
        let body = br#"{"model":"other","prompt":"hello"}"#;
        let p = plan(Endpoint::Completions, body, "r", &m, 1 << 20).unwrap();
        assert!(!p.tokenized && p.request.block_hashes.is_empty());
        let body = br#"{"model":"qwen3","prompt":"hello hello hello hello hello hello"}"#;
        let p = plan(Endpoint::Completions, body, "r", &m, 10).unwrap();
        assert_eq!((p.tokenized, p.request.prompt_tokens, p.request.block_size), (false, body.len() as u32 / 4, 4));
    }

    #[test]
    fn malformed_bodies_are_skipped() {
        let m = models();
        assert!(matches!(plan(Endpoint::Completions, b"{oops", "r", &m, 1 << 20), Err(Skip::Unroutable(_))));
        assert!(plan(Endpoint::ChatCompletions, br#"{"model":"qwen3","messages":"x"}"#, "r", &m, 1 << 20).is_err());
    }
}
