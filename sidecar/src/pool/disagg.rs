//! Prefill/decode disaggregation: where a request's prompt is computed when its pool splits
//! the work ([`crate::config::DisaggregationConfig`]).
//!
//! The decode worker is chosen first, as for any request, among the replicas that decode
//! ([`by_role`]); then [`split`] decides, from the decode worker's cache and the prefill
//! workers' books, whether the prompt is computed there (served whole) or on a prefill
//! worker, which one, and why. The prefill leg is booked as a request of its own
//! ([`leg_booking_id`]): its prefill on the prefill worker, released when the filter reports
//! the leg's end; the decode worker is booked with the decode only.

use kvgate_shared::wire::{PrefillLeg, RouteRequest, Transfer};

use super::route::{Eligible, Scored};
use super::Member;
use crate::config::{DisaggregationConfig, TransferProtocol};
use crate::load::LoadTable;
use crate::score::{self, Candidate, RequestShape, ScoringConfig};

/// Where a request's prompt is computed.
#[derive(Debug, Clone)]
pub(super) enum Split {
    /// On its decode worker, with the rest of the request.
    Whole(Whole),
    /// On a prefill worker, in a leg of its own.
    Remote {
        /// The prefill worker.
        at: Eligible,
        /// Every prefill worker's cost, for `/debug/explain`.
        scored: Vec<Scored>,
    },
}

/// Why a request of a disaggregated pool is served whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Whole {
    /// The pool does not disaggregate.
    Aggregated,
    /// Its prompt, less what the decode worker has cached, is below
    /// `min_remote_prefill_tokens`.
    ShortPrompt,
    /// Every prefill worker has more than `max_prefill_backlog_tokens` booked.
    PrefillBusy,
    /// No prefill worker may take it (none active, or only the decode worker itself).
    NoPrefillWorker,
    /// A `/v1/completions` list of prompts: one engine request each, which one leg cannot
    /// carry.
    SeveralPrompts,
}

impl Split {
    /// The `kvgate_disaggregation_decisions_total` mode; `None` outside disaggregated pools.
    pub(super) fn mode(&self) -> Option<&'static str> {
        match self {
            Split::Remote { .. } => Some("disaggregated"),
            Split::Whole(Whole::Aggregated) => None,
            Split::Whole(Whole::ShortPrompt) => Some("short_prompt"),
            Split::Whole(Whole::PrefillBusy) => Some("prefill_busy"),
            Split::Whole(Whole::NoPrefillWorker) => Some("no_prefill_worker"),
            Split::Whole(Whole::SeveralPrompts) => Some("several_prompts"),
        }
    }
}

/// The request's shape as the split needs it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Prompt {
    /// Prompt tokens (the first prompt's).
    pub tokens: u64,
    /// Prompts in the request.
    pub prompts: u32,
    /// The pool's block size.
    pub block_size: u64,
}

/// Splits the candidates by role: those that decode (every candidate, outside a
/// disaggregated pool) and those that may take a prefill leg.
pub(super) fn by_role(
    members: &[Member],
    candidates: Vec<Eligible>,
    pool: Option<&DisaggregationConfig>,
) -> (Vec<Eligible>, Vec<Eligible>) {
    if pool.is_none() {
        return (candidates, Vec::new());
    }
    let role = |e: &Eligible| members[e.slot.get()].replica.role;
    let prefillers = candidates.iter().filter(|e| role(e).prefills()).copied().collect();
    let decoders = candidates.into_iter().filter(|e| role(e).decodes()).collect();
    (decoders, prefillers)
}

/// Where the prompt of a request going to `decoder` is computed, from the pool's
/// disaggregation settings, the prefill workers' cost and their books.
pub(super) fn split(
    pool: Option<&DisaggregationConfig>,
    load: &LoadTable,
    prefillers: &[Eligible],
    decoder: Eligible,
    prompt: Prompt,
    scoring: &ScoringConfig,
) -> Split {
    let Some(pool) = pool else { return Split::Whole(Whole::Aggregated) };
    if prompt.prompts > 1 {
        return Split::Whole(Whole::SeveralPrompts);
    }
    let uncached = scoring.prefill_tokens(prompt.tokens, prompt.block_size, decoder.overlap);
    if uncached < pool.min_remote_prefill_tokens {
        return Split::Whole(Whole::ShortPrompt);
    }
    let others: Vec<Eligible> = prefillers.iter().filter(|e| e.slot != decoder.slot).copied().collect();
    if others.is_empty() {
        return Split::Whole(Whole::NoPrefillWorker);
    }
    let scored = score_prefill(load, &others, prompt, scoring);
    let logits: Vec<f64> = scored.iter().map(|s| s.logit).collect();
    let Some(best) = score::select(&logits, scoring.temperature, &mut rand::rng()) else {
        return Split::Whole(Whole::NoPrefillWorker);
    };
    let backlog = scored[best].inputs.prefill_tokens;
    if pool.max_prefill_backlog_tokens.is_some_and(|max| backlog > max) {
        return Split::Whole(Whole::PrefillBusy);
    }
    Split::Remote { at: others[best], scored }
}

/// Each prefill worker's cost on prefill terms alone: its prefill left after its cache
/// overlap plus the prefill booked there. Decode load is the decode worker's concern.
fn score_prefill(load: &LoadTable, eligible: &[Eligible], prompt: Prompt, scoring: &ScoringConfig) -> Vec<Scored> {
    let inputs: Vec<Candidate> = eligible
        .iter()
        .map(|e| Candidate {
            overlap: e.overlap,
            prefill_tokens: load.load(e.slot).prefill_tokens,
            decode_blocks: 0,
            requests: 0,
        })
        .collect();
    let request = RequestShape { prompt_tokens: prompt.tokens, block_size: prompt.block_size };
    let logits = score::logits(scoring, request, &inputs);
    eligible
        .iter()
        .zip(inputs)
        .zip(logits)
        .map(|((e, inputs), logit)| Scored { slot: e.slot, inputs, logit, trusted: e.trusted })
        .collect()
}

/// The id a request's prefill leg is booked under.
pub fn leg_booking_id(request_id: &str) -> String {
    format!("{request_id}/prefill")
}

/// The leg the filter runs: where, and with what the engines' protocol needs.
pub(super) fn leg(
    req: &RouteRequest,
    member: &Member,
    overlap_blocks: u32,
    protocol: TransferProtocol,
    room: u64,
) -> PrefillLeg {
    let transfer = match protocol {
        TransferProtocol::Vllm => Transfer::Vllm,
        TransferProtocol::Sglang => Transfer::Sglang {
            host: member.replica.endpoint.ip().to_string(),
            port: member.replica.bootstrap_port.unwrap_or_default(),
            room,
        },
    };
    PrefillLeg {
        endpoint: member.replica.endpoint.to_string(),
        replica: member.replica.id.clone(),
        dp_rank: member.rank,
        overlap_blocks,
        booking_id: leg_booking_id(&req.request_id),
        transfer,
    }
}
