//! Prefill/decode disaggregation: where a request's prompt is computed when its pool splits
//! the work ([`super::DisaggregationConfig`]).
//!
//! The decode worker is chosen first, as for any request, among the replicas that decode
//! ([`by_role`]); then [`split`] decides, from the decode worker's cache and the prefill
//! workers' books, whether the prompt is computed there (served whole) or on a prefill
//! worker, which one, and why. The prefill leg is booked as a request of its own
//! ([`BookingId::leg`]): its prefill on the prefill worker, released when the filter reports
//! the leg's end; the decode worker is booked with the decode only.

use std::sync::atomic::{AtomicUsize, Ordering};

use kvgate_shared::wire::{PrefillLeg, Transfer};

use super::candidates::{self, Eligible, Scored};
use super::Member;
use super::{DisaggregationConfig, PrefillPolicy, Role, TransferProtocol};
use crate::load::{BookingId, LoadTable};
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
    /// Several sequences: a `/v1/completions` list of prompts, or `n` above 1 —
    /// several engine requests, each of which would pull the one leg's KV.
    SeveralSequences,
    /// The filter cannot run a leg for it (no `prefill_cluster`, or a Responses request).
    NoLeg,
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
            Split::Whole(Whole::SeveralSequences) => Some("several_sequences"),
            Split::Whole(Whole::NoLeg) => Some("no_leg"),
        }
    }
}

/// The request's shape as the split needs it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Prompt {
    /// Prompt tokens (the first prompt's).
    pub tokens: u64,
    /// Sequences the request decodes (prompts × samples).
    pub sequences: u64,
    /// The pool's block size.
    pub block_size: u64,
    /// Whether the filter can run a leg for it.
    pub legs: bool,
}

/// Splits the candidates by role: those that decode (every candidate, outside a
/// disaggregated pool) and those that may take a prefill leg. SGLang's prefill legs go to
/// prefill servers only: an aggregated (`both`) server ignores the bootstrap room.
pub(super) fn by_role(
    members: &[Member],
    candidates: Vec<Eligible>,
    pool: Option<&DisaggregationConfig>,
) -> (Vec<Eligible>, Vec<Eligible>) {
    let Some(pool) = pool else { return (candidates, Vec::new()) };
    let role = |e: &Eligible| members[e.slot.get()].replica.role;
    let prefills = |r: Role| match pool.mode {
        TransferProtocol::Vllm => r.prefills(),
        TransferProtocol::Sglang => r == Role::Prefill,
    };
    let prefillers = candidates.iter().filter(|e| prefills(role(e))).copied().collect();
    let decoders = candidates.into_iter().filter(|e| role(e).decodes()).collect();
    (decoders, prefillers)
}

/// Where the prompt of a request going to `decoder` is computed, from the pool's
/// disaggregation settings, the prefill workers' cost and their books. `turn` is the
/// pool's count of round-robin turns (`prefill_policy = "round_robin"`). An SGLang decode
/// server serves nothing without a bootstrap room, so a request going to one gets a leg
/// whatever its length and the prefill workers' backlog.
#[allow(clippy::too_many_arguments)]
pub(super) fn split(
    pool: Option<&DisaggregationConfig>,
    load: &LoadTable,
    prefillers: &[Eligible],
    decoder: Eligible,
    decoder_role: Role,
    prompt: Prompt,
    scoring: &ScoringConfig,
    turn: &AtomicUsize,
) -> Split {
    let Some(pool) = pool else { return Split::Whole(Whole::Aggregated) };
    let must = pool.mode == TransferProtocol::Sglang && decoder_role == Role::Decode;
    if !prompt.legs {
        return Split::Whole(Whole::NoLeg);
    }
    if prompt.sequences > 1 {
        return Split::Whole(Whole::SeveralSequences);
    }
    let uncached = scoring.prefill_tokens(prompt.tokens, prompt.block_size, decoder.overlap);
    if !must && uncached < pool.min_remote_prefill_tokens {
        return Split::Whole(Whole::ShortPrompt);
    }
    let others: Vec<Eligible> = prefillers.iter().filter(|e| e.slot != decoder.slot).copied().collect();
    if others.is_empty() {
        return Split::Whole(Whole::NoPrefillWorker);
    }
    let room = |e: &Eligible| pool.max_prefill_backlog_tokens.is_none_or(|max| load.load(e.slot).prefill_tokens <= max);
    let open: Vec<Eligible> = others.iter().filter(|e| must || room(e)).copied().collect();
    if open.is_empty() {
        return Split::Whole(Whole::PrefillBusy);
    }
    let scored = score_prefill(load, &open, prompt, scoring);
    let best = match pool.prefill_policy {
        PrefillPolicy::KvAware => {
            let logits: Vec<f64> = scored.iter().map(|s| s.logit).collect();
            let Some(best) = score::select(&logits, scoring.temperature, &mut rand::rng()) else {
                return Split::Whole(Whole::NoPrefillWorker);
            };
            best
        }
        PrefillPolicy::RoundRobin => turn.fetch_add(1, Ordering::Relaxed) % open.len(),
    };
    Split::Remote { at: open[best], scored }
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
    candidates::scored(eligible, inputs, request, scoring)
}

/// The leg the filter runs, booked as `booking`: where, and with what the engines' protocol
/// needs.
pub(super) fn leg(
    booking: &BookingId,
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
        booking_id: booking.request_id(),
        transfer,
    }
}
