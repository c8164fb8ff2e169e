//! `/debug/explain`: the last decisions with every candidate's cost terms. Owns the
//! `explanations` ring; the decision writes it ([`Pool::record`]), operators read it.

use serde::Serialize;

use crate::load::BookingId;
use kvgate_shared::ids::RequestId;
use kvgate_shared::wire::RouteRequest;

use super::candidates::Scored;
use super::Policy;
use super::Pool;
use crate::accuracy::{Check, EngineUsage};
use crate::index::{Overlap, ReplicaIdx};
use crate::metrics::{DecisionLabels, ModeLabels};

/// Decisions kept for `/debug/explain`.
pub(super) const EXPLANATIONS: usize = 256;

/// A kept decision, before names are attached.
#[derive(Debug)]
pub(super) struct Kept {
    request_id: RequestId,
    client_request_id: Option<String>,
    policy: Policy,
    prompt_tokens: u64,
    chosen: ReplicaIdx,
    /// Every candidate's cost inputs and cost.
    candidates: Vec<Scored>,
    /// The prediction, once the engine's report has been checked against it.
    checked: Option<Checked>,
    /// In a disaggregated pool: the decision's mode, or `prefill_leg` for a leg's.
    disaggregation: Option<&'static str>,
}

/// A decision's prediction against what the engine reported.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Checked {
    /// Prompt tokens kvgate predicted the engine would find cached.
    pub predicted_cached_tokens: u64,
    /// What the engine reported.
    pub engine: EngineUsage,
    /// The comparison.
    pub check: Check,
}

/// One candidate's cost terms in a decision.
#[derive(Debug, Clone, Serialize)]
pub struct CandidateTerms {
    /// Replica id.
    pub replica: String,
    /// Whether its cache credit counted (false while its publisher is stalled).
    pub trusted: bool,
    /// Overlap in blocks per tier.
    pub overlap: Overlap,
    /// Booked prefill tokens before this request (`P_i`).
    pub prefill_tokens: u64,
    /// Active blocks plus this request's new ones (`D_i`).
    pub decode_blocks: u64,
    /// Active requests (`R_i`).
    pub requests: u64,
    /// The cost; lowest wins under `kv_aware` and `least_load`.
    pub logit: f64,
}

/// Why a request went where it went.
#[derive(Debug, Clone, Serialize)]
pub struct Explanation {
    /// The booking key the filter generated (`x-kvgate-booking-id` among its debug headers).
    pub request_id: RequestId,
    /// The request's `x-request-id`, if it had one.
    pub client_request_id: Option<String>,
    /// The policy that decided.
    pub policy: Policy,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// The chosen replica.
    pub chosen: Option<String>,
    /// Every candidate, in pool order.
    pub candidates: Vec<CandidateTerms>,
    /// The prediction against the engine's report, once the request has ended.
    pub checked: Option<Checked>,
    /// In a disaggregated pool: `disaggregated` (its prefill leg is explained under
    /// `<request_id>/prefill`, marked `prefill_leg`) or why it was served whole
    /// (`short_prompt`, `prefill_busy`, `no_prefill_worker`, `several_prompts`).
    pub disaggregation: Option<&'static str>,
}

impl Pool {
    /// The kept decisions for `request_id` (a booking key or a client's `x-request-id`), or the
    /// most recent `last` decisions (newest first).
    pub fn explain(&self, request_id: Option<&str>, last: usize) -> Vec<Explanation> {
        let kept = self.explanations.lock().unwrap_or_else(|e| e.into_inner());
        let members = self.members();
        let name = |i: ReplicaIdx| members[i.get()].replica.id.clone();
        kept.iter()
            .rev()
            .filter(|e| request_id.is_none_or(|id| e.request_id == id || e.client_request_id.as_deref() == Some(id)))
            .take(last)
            .map(|k| Explanation {
                request_id: k.request_id.clone(),
                client_request_id: k.client_request_id.clone(),
                policy: k.policy,
                prompt_tokens: k.prompt_tokens,
                chosen: Some(name(k.chosen)),
                checked: k.checked,
                disaggregation: k.disaggregation,
                candidates: k
                    .candidates
                    .iter()
                    .map(|s| CandidateTerms {
                        replica: name(s.slot),
                        trusted: s.trusted,
                        overlap: s.inputs.overlap,
                        prefill_tokens: s.inputs.prefill_tokens,
                        decode_blocks: s.inputs.decode_blocks,
                        requests: s.inputs.requests,
                        logit: s.logit,
                    })
                    .collect(),
            })
            .collect()
    }

    /// Counts a decision and keeps it for `/debug/explain`; `mode` is its disaggregation mode
    /// in a disaggregated pool.
    pub(super) fn record(
        &self,
        req: &RouteRequest,
        policy: Policy,
        candidates: Vec<Scored>,
        best: ReplicaIdx,
        overlap: Overlap,
        mode: Option<&'static str>,
    ) {
        let labels = self.labels(best);
        tracing::debug!(
            request_id = %req.request_id,
            client_request_id = req.client_request_id.as_deref(),
            model = %labels.model,
            replica = %labels.replica,
            policy = policy.name(),
            cached_blocks = overlap.device,
            "routed"
        );
        self.metrics.route_decisions.get_or_create(&labels).inc();
        let outcome = if overlap.device > 0 { "hit" } else { "miss" };
        let decision = DecisionLabels {
            model: labels.model.clone(),
            policy: policy.name().to_owned(),
            outcome: outcome.to_owned(),
        };
        self.metrics.decisions.get_or_create(&decision).inc();
        self.metrics.chosen_overlap_blocks.observe(f64::from(overlap.device));
        if let Some(mode) = mode {
            self.metrics.disaggregation.get_or_create(&ModeLabels { model: labels.model, mode: mode.to_owned() }).inc();
        }
        self.keep(Kept {
            request_id: req.request_id.clone(),
            client_request_id: req.client_request_id.clone(),
            policy,
            prompt_tokens: u64::from(req.prompt_tokens),
            chosen: best,
            candidates,
            checked: None,
            disaggregation: mode,
        });
    }

    /// Keeps a request's prefill leg for `/debug/explain`, under the leg's booking id.
    pub(super) fn record_leg(
        &self,
        req: &RouteRequest,
        leg_id: &BookingId,
        policy: Policy,
        candidates: Vec<Scored>,
        chosen: ReplicaIdx,
    ) {
        tracing::debug!(
            request_id = %leg_id,
            model = %self.config.model,
            replica = %self.labels(chosen).replica,
            "prefill leg routed"
        );
        self.keep(Kept {
            request_id: leg_id.request_id(),
            client_request_id: req.client_request_id.clone(),
            policy,
            prompt_tokens: u64::from(req.prompt_tokens),
            chosen,
            candidates,
            checked: None,
            disaggregation: Some("prefill_leg"),
        });
    }

    fn keep(&self, explanation: Kept) {
        let mut kept = self.explanations.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() == EXPLANATIONS {
            kept.pop_front();
        }
        kept.push_back(explanation);
    }

    /// Drops the kept decisions that name slot `slot` (it is being given to another replica).
    pub(super) fn forget_slot(&self, slot: ReplicaIdx) {
        let mut kept = self.explanations.lock().unwrap_or_else(|e| e.into_inner());
        kept.retain(|k| k.chosen != slot && k.candidates.iter().all(|c| c.slot != slot));
    }

    /// Attaches a check to the kept decision of `request_id`, if it is still kept.
    pub(super) fn checked(
        &self,
        request_id: &RequestId,
        predicted_cached_tokens: u64,
        engine: EngineUsage,
        check: Check,
    ) {
        let mut kept = self.explanations.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = kept.iter_mut().rev().find(|k| k.request_id == *request_id) {
            k.checked = Some(Checked { predicted_cached_tokens, engine, check });
        }
    }
}
