//! `/debug/explain`: the last decisions with every candidate's cost terms. Owns the
//! `explanations` ring ([`Explanations`]); the decision writes it ([`Pool::record`]),
//! operators read it, by request id or the most recent. A pool keeps its last
//! `explain_keep` decisions, each for at most `explain_max_age_secs`: memory is bounded by
//! the count, whatever the request rate.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::load::BookingId;
use kvgate_shared::ids::RequestId;
use kvgate_shared::wire::RouteRequest;

use super::candidates::Scored;
use super::Policy;
use super::Pool;
use crate::accuracy::{Check, EngineUsage};
use crate::index::{Overlap, ReplicaIdx};
use crate::latency::{self, Latency, PerLatency};
use crate::metrics::{DecisionLabels, ModeLabels};

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
    /// The time to first token predicted on the chosen replica, in seconds, if its model
    /// predicts yet (`f32`s: a kept decision stays small).
    predicted_ttft: Option<f32>,
    /// What the filter measured, once the first token came.
    measured_ttft: Option<f32>,
    /// The ITL predicted there, in seconds, if its model predicts yet.
    predicted_itl: Option<f32>,
    /// What the filter measured, once the response ended.
    measured_itl: Option<f32>,
    /// What each latency's model was given on the chosen replica, for a timed request.
    faced: PerLatency<Option<latency::Inputs>>,
    /// What was left of its TTFT SLO when it was decided, in seconds, if it had one.
    ttft_slo: Option<f32>,
    /// Its ITL SLO, in seconds, if it had one.
    itl_slo: Option<f32>,
    /// In a disaggregated pool: the decision's mode, or `prefill_leg` for a leg's.
    disaggregation: Option<&'static str>,
    /// In a pool that binds sessions, a request with a session: what its binding did.
    session: Option<&'static str>,
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

/// The replica a decision chose, what it has cached of the prompt, and the TTFT and ITL
/// predicted there.
pub(super) struct Chosen {
    pub(super) slot: ReplicaIdx,
    pub(super) overlap: Overlap,
    /// Of each latency, for a timed request: what its model was given there, and what it
    /// predicted from that (once it predicts).
    pub(super) timed: PerLatency<Option<(latency::Inputs, Option<Duration>)>>,
    /// What the request's session binding did (`new`, `kept`, or why it moved).
    pub(super) session: Option<&'static str>,
    /// What was left of its TTFT SLO, if it had one.
    pub(super) ttft_slo: Option<Duration>,
    /// Its ITL SLO, if it had one.
    pub(super) itl_slo: Option<Duration>,
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
    /// Under `predicted_latency` or a TTFT SLO, the time to first token predicted there, in
    /// seconds (under `predicted_latency` the lowest wins; under an SLO only those within it
    /// are chosen while any is). Absent while its model does not predict, and then the decision
    /// is `kv_aware`'s and holds to no SLO.
    pub predicted_ttft_secs: Option<f64>,
    /// Likewise, with an ITL SLO, the inter-token latency predicted there, in seconds (only
    /// those within it are chosen while any is).
    pub predicted_itl_secs: Option<f64>,
    /// The credit taken off `logit` because the request's session is bound here, holds its
    /// prefix and has headroom (`[pools.sessions]`; 0 otherwise).
    pub session_credit: f64,
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
    /// The time to first token predicted on the chosen replica, in seconds (a streamed
    /// request, once the replica's model has learned enough).
    pub predicted_ttft_secs: Option<f64>,
    /// That prediction against the TTFT the filter measured, once the first token came.
    pub ttft_checked: Option<latency::Check>,
    /// What the chosen replica's TTFT model was given for this request when it was booked —
    /// prefill tokens before its first token (its own after the cache overlap, and what was
    /// left of those booked there before it) and sequences decoding — whether or not it
    /// predicted yet; a streamed request's only (see `crate::latency`).
    pub ttft_inputs: Option<latency::Inputs>,
    /// The inter-token latency predicted on the chosen replica, in seconds (a streamed
    /// request, once the replica's ITL model has learned enough).
    pub predicted_itl_secs: Option<f64>,
    /// That prediction against the ITL the filter measured, once the response ended.
    pub itl_checked: Option<latency::Check>,
    /// What the chosen replica's ITL model was given for it: the prefill booked there before
    /// it, and every sequence there, its own included.
    pub itl_inputs: Option<latency::Inputs>,
    /// With a TTFT SLO (its own, or its class's; admission control): what was left of it after
    /// the request's wait, in seconds. The candidates predicted above it were not chosen,
    /// unless every one was; a candidate whose model does not predict yet could be.
    pub ttft_slo_secs: Option<f64>,
    /// With an ITL SLO (its own, or its class's): the SLO, in seconds. The candidates
    /// predicted above it were not chosen, unless every one was.
    pub itl_slo_secs: Option<f64>,
    /// In a disaggregated pool: `disaggregated` (its prefill leg is explained under
    /// `<request_id>/prefill`, marked `prefill_leg`) or why it was served whole
    /// (`short_prompt`, `prefill_busy`, `no_prefill_worker`, `several_prompts`).
    pub disaggregation: Option<&'static str>,
    /// In a pool that binds sessions, for a request with a session: `new` (it was not
    /// bound), `kept`, or why it moved — `replica_gone`, `prefix_gone` (its replica holds less
    /// of the prompt than another), `saturated`, `slo` (predicted to miss the request's TTFT
    /// SLO), `outweighed` (another was cheaper by more than the credit). The session is now
    /// bound to `chosen`.
    pub session: Option<&'static str>,
}

/// A pool's kept decisions: the last `keep`, none older than `max_age`, findable by booking
/// id without a scan (a usage report attaches its check to its decision this way).
#[derive(Debug)]
pub(super) struct Explanations {
    keep: usize,
    max_age: Duration,
    /// Oldest first; `seq` rises by one per decision kept.
    kept: VecDeque<Entry>,
    /// The `seq` of the latest decision kept under each booking id.
    by_id: HashMap<RequestId, u64>,
    next_seq: u64,
}

#[derive(Debug)]
struct Entry {
    seq: u64,
    at: Instant,
    kept: Kept,
}

impl Explanations {
    /// Keeps the last `keep` decisions (at least one), each for at most `max_age`.
    pub(super) fn new(keep: usize, max_age: Duration) -> Explanations {
        let keep = keep.max(1);
        // Grown as decisions come: a large `keep` costs nothing until it is used.
        let kept = VecDeque::with_capacity(keep.min(1024));
        Explanations { keep, max_age, kept, by_id: HashMap::with_capacity(keep.min(1024)), next_seq: 0 }
    }

    /// Keeps a decision made at `now`, dropping the oldest beyond the count and the age.
    fn push(&mut self, kept: Kept, now: Instant) {
        self.expire(now);
        while self.kept.len() >= self.keep {
            self.pop_oldest();
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.by_id.insert(kept.request_id.clone(), seq);
        self.kept.push_back(Entry { seq, at: now, kept });
    }

    /// Drops the decisions older than the age limit at `now`.
    fn expire(&mut self, now: Instant) {
        while self.kept.front().is_some_and(|e| now.saturating_duration_since(e.at) > self.max_age) {
            self.pop_oldest();
        }
    }

    fn pop_oldest(&mut self) {
        if let Some(oldest) = self.kept.pop_front() {
            if self.by_id.get(&oldest.kept.request_id) == Some(&oldest.seq) {
                self.by_id.remove(&oldest.kept.request_id);
            }
        }
    }

    /// Where the latest decision kept under booking id `id` is.
    fn position(&self, id: &str) -> Option<usize> {
        let seq = self.by_id.get(id)?;
        self.kept.binary_search_by_key(seq, |e| e.seq).ok()
    }

    /// The latest decision kept under booking id `id`.
    fn by_booking(&mut self, id: &str) -> Option<&mut Kept> {
        let at = self.position(id)?;
        Some(&mut self.kept[at].kept)
    }

    /// The decisions kept, newest first.
    fn newest_first(&self) -> impl Iterator<Item = &Kept> {
        self.kept.iter().rev().map(|e| &e.kept)
    }

    /// Drops the decisions that name `slot`.
    fn forget_slot(&mut self, slot: ReplicaIdx) {
        self.kept.retain(|e| e.kept.chosen != slot && e.kept.candidates.iter().all(|c| c.slot != slot));
        let kept = &self.kept;
        self.by_id.retain(|_, seq| kept.binary_search_by_key(seq, |e| e.seq).is_ok());
    }
}

/// A kept prediction against its measurement, once both are there.
fn checked(latency: Latency, predicted: Option<f32>, measured: Option<f32>) -> Option<latency::Check> {
    let secs = |s: f32| Duration::from_secs_f32(s.max(0.0));
    predicted.zip(measured).map(|(p, m)| latency::Check::new(latency, secs(p), secs(m)))
}

impl Pool {
    /// The kept decisions for `request_id` — its booking key's, or else every one whose client
    /// sent that `x-request-id` — or the most recent `last` decisions (newest first).
    pub fn explain(&self, request_id: Option<&str>, last: usize) -> Vec<Explanation> {
        let mut explanations = self.explanations.lock().unwrap_or_else(|e| e.into_inner());
        explanations.expire(Instant::now());
        let explanations = &*explanations;
        let found: Vec<&Kept> = match request_id {
            Some(id) => match explanations.position(id) {
                Some(at) => vec![&explanations.kept[at].kept],
                None => explanations
                    .newest_first()
                    .filter(|k| k.client_request_id.as_deref() == Some(id))
                    .take(last)
                    .collect(),
            },
            None => explanations.newest_first().take(last).collect(),
        };
        let members = self.members();
        let name = |i: ReplicaIdx| members[i.get()].replica.id.clone();
        found
            .into_iter()
            .map(|k| Explanation {
                request_id: k.request_id.clone(),
                client_request_id: k.client_request_id.clone(),
                policy: k.policy,
                prompt_tokens: k.prompt_tokens,
                chosen: Some(name(k.chosen)),
                checked: k.checked,
                predicted_ttft_secs: k.predicted_ttft.map(f64::from),
                ttft_checked: checked(Latency::Ttft, k.predicted_ttft, k.measured_ttft),
                ttft_inputs: k.faced[Latency::Ttft],
                predicted_itl_secs: k.predicted_itl.map(f64::from),
                itl_checked: checked(Latency::Itl, k.predicted_itl, k.measured_itl),
                itl_inputs: k.faced[Latency::Itl],
                ttft_slo_secs: k.ttft_slo.map(f64::from),
                itl_slo_secs: k.itl_slo.map(f64::from),
                disaggregation: k.disaggregation,
                session: k.session,
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
                        predicted_ttft_secs: s.predicted_ttft.map(f64::from),
                        predicted_itl_secs: s.predicted_itl.map(f64::from),
                        session_credit: s.session_credit,
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
        chosen: Chosen,
        mode: Option<&'static str>,
    ) {
        let Chosen { slot: best, overlap, timed, session, ttft_slo, itl_slo } = chosen;
        let predicted = |latency| timed[latency].and_then(|(_, p)| p).map(|d| d.as_secs_f32());
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
        self.trace_decision(&labels.replica, overlap.device, &candidates);
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
            predicted_ttft: predicted(Latency::Ttft),
            measured_ttft: None,
            predicted_itl: predicted(Latency::Itl),
            measured_itl: None,
            faced: PerLatency::from_fn(|latency| timed[latency].map(|(inputs, _)| inputs)),
            ttft_slo: ttft_slo.map(|d| d.as_secs_f32()),
            itl_slo: itl_slo.map(|d| d.as_secs_f32()),
            disaggregation: mode,
            session,
        });
    }

    /// Writes the decision on the request's span (`kvgate_telemetry`): the replica, its cached
    /// blocks and, when spans are exported, every candidate as `replica=cost/cached_blocks`.
    fn trace_decision(&self, replica: &str, cached_blocks: u32, candidates: &[Scored]) {
        let span = tracing::Span::current();
        if span.is_disabled() {
            return;
        }
        span.record("replica", replica);
        span.record("cached_blocks", cached_blocks);
        if kvgate_telemetry::exporting() {
            let members = self.members();
            let costs: Vec<String> = candidates
                .iter()
                .map(|c| format!("{}={:.1}/{}", members[c.slot.get()].replica.id, c.logit, c.inputs.overlap.device))
                .collect();
            span.record("candidates", costs.join(" "));
        }
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
            predicted_ttft: None,
            measured_ttft: None,
            predicted_itl: None,
            measured_itl: None,
            faced: PerLatency::default(),
            ttft_slo: None,
            itl_slo: None,
            disaggregation: Some("prefill_leg"),
            session: None,
        });
    }

    fn keep(&self, explanation: Kept) {
        self.explanations.lock().unwrap_or_else(|e| e.into_inner()).push(explanation, Instant::now());
    }

    /// Drops the kept decisions that name slot `slot` (it is being given to another replica).
    pub(super) fn forget_slot(&self, slot: ReplicaIdx) {
        self.explanations.lock().unwrap_or_else(|e| e.into_inner()).forget_slot(slot);
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
        if let Some(k) = kept.by_booking(request_id.as_str()) {
            k.checked = Some(Checked { predicted_cached_tokens, engine, check });
        }
    }

    /// Attaches the TTFT the filter measured to the kept decision of `request_id`, if it is
    /// still kept.
    pub(super) fn latency_explained(&self, request_id: &RequestId, latency: Latency, measured_secs: f64) {
        let mut kept = self.explanations.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = kept.by_booking(request_id.as_str()) {
            *match latency {
                Latency::Ttft => &mut k.measured_ttft,
                Latency::Itl => &mut k.measured_itl,
            } = Some(measured_secs as f32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(id: &str) -> Kept {
        Kept {
            request_id: id.into(),
            client_request_id: Some(format!("client-{id}")),
            policy: Policy::KvAware,
            prompt_tokens: 64,
            chosen: ReplicaIdx::new(0),
            candidates: Vec::new(),
            checked: None,
            predicted_ttft: None,
            measured_ttft: None,
            predicted_itl: None,
            measured_itl: None,
            faced: PerLatency::default(),
            ttft_slo: None,
            itl_slo: None,
            disaggregation: None,
            session: None,
        }
    }

    fn found(e: &Explanations, id: &str) -> bool {
        e.position(id).is_some_and(|at| e.kept[at].kept.request_id == id)
    }

    #[test]
    fn a_decision_is_found_by_id_after_as_many_later_ones_as_are_kept() {
        let t0 = Instant::now();
        let mut e = Explanations::new(1000, Duration::from_secs(300));
        e.push(decision("target"), t0);
        for i in 1..1000 {
            e.push(decision(&format!("later-{i}")), t0);
        }
        assert!(found(&e, "target"), "999 later decisions: still kept");
        assert!(e.by_booking("target").is_some());
        e.push(decision("one-more"), t0);
        assert!(!found(&e, "target") && e.by_booking("target").is_none(), "the 1001st pushes it out");
        assert!(found(&e, "later-1") && found(&e, "one-more"));
    }

    #[test]
    fn a_decision_is_gone_after_the_age_limit() {
        let t0 = Instant::now();
        let mut e = Explanations::new(1000, Duration::from_secs(300));
        e.push(decision("old"), t0);
        e.push(decision("newer"), t0 + Duration::from_secs(200));
        e.expire(t0 + Duration::from_secs(300));
        assert!(found(&e, "old"), "kept for exactly its age limit");
        e.expire(t0 + Duration::from_secs(301));
        assert!(!found(&e, "old") && found(&e, "newer"));
        assert!(!e.by_id.contains_key("old"), "its index entry went with it");
        // A new decision also drops what has aged out.
        e.push(decision("newest"), t0 + Duration::from_secs(501));
        assert_eq!(e.newest_first().map(|k| k.request_id.as_str()).collect::<Vec<_>>(), ["newest"]);
    }

    #[test]
    fn the_count_bound_holds_and_so_does_the_index() {
        let t0 = Instant::now();
        let mut e = Explanations::new(64, Duration::from_secs(300));
        for i in 0..10_000 {
            // Some ids repeat (a decision made again under the same booking id).
            e.push(decision(&format!("r{}", i % 5000)), t0);
            assert!(e.kept.len() <= 64 && e.by_id.len() <= 64);
        }
        assert_eq!((e.kept.len(), e.by_id.len()), (64, 64));
        assert!(found(&e, "r4999") && !found(&e, "r4935"));
    }

    #[test]
    fn forgetting_a_slot_keeps_the_others_findable() {
        let t0 = Instant::now();
        let mut e = Explanations::new(16, Duration::from_secs(300));
        for i in 0..8 {
            let mut d = decision(&format!("r{i}"));
            d.chosen = ReplicaIdx::new(i % 2);
            e.push(d, t0);
        }
        e.forget_slot(ReplicaIdx::new(1));
        for i in 0..8 {
            assert_eq!(found(&e, &format!("r{i}")), i % 2 == 0, "r{i}");
        }
        assert_eq!(e.by_id.len(), 4);
    }

    /// The memory the `explain_keep` documentation states: a kept decision in about 350 bytes
    /// (its ids on the heap included) plus 80 per candidate.
    #[test]
    fn a_kept_decision_is_as_small_as_documented() {
        assert!(std::mem::size_of::<Entry>() + 2 * 24 <= 350, "{}", std::mem::size_of::<Entry>());
        assert!(std::mem::size_of::<Scored>() <= 80, "{}", std::mem::size_of::<Scored>());
    }
}
