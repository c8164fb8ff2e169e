//! Prompts the filter offloads: the pool's own tokenizer (loaded once, from the same bundle
//! the filters fetch) turns the body into the same `RouteRequest` the filter would have sent.

use std::sync::atomic::Ordering;
use std::time::Instant;

use kvgate_shared::hash::Salt;
use kvgate_shared::prompt::openai::ParsedRequest;
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::route::{estimated_request, route_request, PromptTokens, RequestKeys};
use kvgate_shared::wire::{ModelBundle, RouteBodyRequest, RouteRequest};

use super::{Pool, OFFLOAD_SEGMENT_CACHE_BYTES};
use crate::metrics::FallbackLabels;

/// Why an offloaded prompt was not routed.
#[derive(Debug, thiserror::Error)]
pub enum OffloadError {
    /// The filter's budget ran out before the decision: nothing was booked.
    #[error("the filter's deadline passed before the prompt was routed")]
    Late,
}

/// What routing an offloaded request needs besides its parsed body: the filter's keys and the
/// body's size. The body itself stays in the call it arrived in, read there and not copied.
#[derive(Debug, Clone)]
pub struct Offloaded {
    keys: RequestKeys,
    body_bytes: usize,
}

impl Offloaded {
    /// The keys and size of `req`.
    pub fn of(req: &RouteBodyRequest<'_>) -> Offloaded {
        Offloaded { keys: keys(req), body_bytes: req.body.len() }
    }

    /// The body's size in bytes.
    pub fn body_bytes(&self) -> usize {
        self.body_bytes
    }
}

impl Pool {
    /// The route request of an offloaded request for `model` whose prompt could not be read
    /// (`reason`): booked on an estimate of its size, routed on load alone.
    pub fn estimated(&self, model: &str, offloaded: &Offloaded, reason: &str) -> RouteRequest {
        let tokens = u32::try_from(offloaded.body_bytes / 4).unwrap_or(u32::MAX);
        self.metrics.estimated_requests.get_or_create(&FallbackLabels { reason: reason.to_owned() }).inc();
        estimated_request(model, &offloaded.keys, tokens, self.config.block_size)
    }

    /// The encoded bundle, for a filter that fetches it (counted for `/debug/state`).
    pub fn served_bundle(&self) -> Vec<u8> {
        self.bundles_served.fetch_add(1, Ordering::Relaxed);
        self.bundle.clone()
    }

    /// The pool's tokenizer (with a segment cache), loaded from its bundle on first use.
    /// Blocking: call it off the async runtime.
    pub fn tokenizer(&self) -> Result<&ModelTokenizer, String> {
        self.tokenizer
            .get_or_init(|| {
                let bundle: ModelBundle = kvgate_shared::codec::decode(&self.bundle).map_err(|e| e.to_string())?;
                ModelTokenizer::from_bundle(&bundle)
                    .map(|t| t.with_segment_cache(OFFLOAD_SEGMENT_CACHE_BYTES))
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Whether the tokenizer for offloaded prompts has loaded (or failed to): [`Pool::tokenizer`]
    /// then returns at once.
    pub fn tokenizer_ready(&self) -> bool {
        self.tokenizer.get().is_some()
    }

    /// The route request of a whole request body (the filter's offload): tokenized exactly as
    /// the filter would — unless `deadline` has passed by then (the filter has routed the
    /// request without us: booking it would count load that is not there). Blocking (it
    /// tokenizes, on up to `threads` threads for a long prompt). A pool whose tokenizer cannot
    /// load books it on an estimate (the filter cannot tokenize it either: it loads the same
    /// bundle).
    pub fn request_for_body(
        &self,
        parsed: &ParsedRequest,
        offloaded: &Offloaded,
        deadline: Instant,
        threads: usize,
    ) -> Result<RouteRequest, OffloadError> {
        if Instant::now() >= deadline {
            return Err(OffloadError::Late);
        }
        let tokenizer = match self.tokenizer() {
            Ok(tokenizer) => tokenizer,
            Err(_) => return Ok(self.estimated(parsed.model.as_str(), offloaded, "no_tokenizer")),
        };
        let tokens = match tokenizer.prompt_tokens_on(parsed, threads) {
            Ok(tokens) => tokens,
            // Content parts it does not render, a template that fails: still real load.
            Err(_) => return Ok(self.estimated(parsed.model.as_str(), offloaded, "untokenizable")),
        };
        if Instant::now() >= deadline {
            return Err(OffloadError::Late);
        }
        // A LoRA adapter's blocks are salted with its name, as its engine salts them.
        let salt =
            if parsed.model == self.config.model { Salt::NONE } else { Salt::for_lora(Some(parsed.model.as_str())) };
        let prompt =
            PromptTokens::Tokenized { tokens: &tokens, total: tokens.len(), block_size: self.config.block_size, salt };
        Ok(route_request(parsed, &offloaded.keys, prompt))
    }
}

/// The filter's keys of an offloaded request.
fn keys(req: &RouteBodyRequest<'_>) -> RequestKeys {
    RequestKeys {
        request_id: req.request_id.clone(),
        client_request_id: req.client_request_id.clone(),
        session: req.session.clone(),
        overrides: req.overrides,
        wait_ms: req.wait_ms,
        priority: req.priority.clone(),
        tenant: req.tenant.clone(),
        ttft_slo_ms: req.ttft_slo_ms,
        itl_slo_ms: req.itl_slo_ms,
        prefill_legs: req.prefill_legs,
    }
}
