//! The routing decision: candidates → `score::logits` → the pool's policy → the booking.
//! [`Pool::route`] reads as its steps, one line each; each step is a function below.

use std::sync::atomic::Ordering;
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

use kvgate_shared::hash::SequenceHash;
use kvgate_shared::wire::{PromptCount, RouteRequest, RouteResponse};

use super::candidates::{scored, Eligible, Scored};
use super::disagg::{self, Prompt, Split};
use super::explain::Chosen;
use super::members::NONE;
use super::sessions::{self, Weighed};
use super::{Member, Pool};
use super::{Policy, TransferProtocol};
use crate::accuracy::{Prediction, Unchecked};
use crate::index::approx::ApproxIndex;
use crate::index::{KvIndex, Overlap, ReplicaIdx};
use crate::latency::{Latency, PerLatency};
use crate::load::flows::Flow;
use crate::load::{BookingId, Computed, LoadTable, NewBooking, Own};
use crate::metrics::OutcomeLabels;
use crate::msg::sync::{SessionKey, SyncEvent};
use crate::score::{self, Candidate, RequestShape, ScoringConfig};
use kvgate_shared::ids::RequestId;

/// Blocks of one peer's booking counted as in-flight credit, at most (256k tokens in blocks of
/// 16): a quarter of the smallest sensible `affinity_blocks`, so no one message flushes it.
const PEER_ROUTE_BLOCKS: usize = 16_384;

/// The request as the pool measures it.
#[derive(Clone, Copy)]
struct Shape<'a> {
    /// The prompt's block hashes (none if computed with another block size).
    hashes: &'a [SequenceHash],
    /// The (first) prompt's tokens.
    prompt_tokens: u64,
    /// Prompt tokens of all the request's prompts: what its prefill costs, uncached.
    booked_tokens: u64,
    /// Sequences it decodes: prompts × samples.
    sequences: u64,
    /// How `prompt_tokens` was counted.
    prompt_count: PromptCount,
    block_size: u64,
    /// Blocks of all its prompts.
    total_blocks: u64,
    /// Its output limit: the request's `max_tokens`, else what the engine defaults to (its
    /// context length left after the prompt, with the pool's `max_model_len`).
    max_tokens: Option<u64>,
    /// Whether its response streams.
    stream: bool,
}

impl Shape<'_> {
    /// A disaggregated request's prefill leg: its prompt, one sequence, one token, not
    /// streamed.
    fn leg(&self) -> Self {
        Shape { sequences: 1, max_tokens: Some(1), stream: false, ..*self }
    }
}

/// Under which id, for which flow, and whether the prompt is computed elsewhere (and its KV
/// sent over with which protocol).
struct BookAs<'a> {
    id: &'a BookingId,
    flow: Option<Flow>,
    /// The prompt's KV comes over this protocol from this prefill worker.
    remote: Option<(TransferProtocol, Eligible)>,
}

/// What was booked where.
struct Booked {
    slot: ReplicaIdx,
    overlap: Overlap,
    /// Of `overlap`'s device blocks, those the target's events held (under `prefix_affinity`,
    /// those routed there before).
    indexed: u32,
    prefill_tokens: u64,
    /// False if the request had already ended (its end overtook the decision).
    booked: bool,
    /// Why the engine's report will not be checked against a prediction, if it will not.
    unpredicted: Option<Unchecked>,
}

fn nowhere() -> RouteResponse {
    RouteResponse { endpoint: None, replica: None, overlap_blocks: 0, dp_rank: None, prefill: None }
}

/// Why an admission-controlled request was not decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotAdmitted {
    /// Every replica it may go to is saturated: it waits, or is shed.
    Saturated,
    /// No replica is predicted to meet its class's TTFT SLO, and its class is sheddable: it
    /// is shed at once.
    OverSlo,
}

/// How an admission-controlled decision is made.
#[derive(Debug, Clone, Copy)]
pub struct Admit {
    /// Others of its class wait ahead of the request: it routes only on its tenant's
    /// fair-share headroom.
    pub behind: bool,
    /// How long it has waited so far: its class's TTFT SLO is what is left after it.
    pub waited: Duration,
}

/// A decision held to SLOs: what is left of its TTFT SLO, its ITL SLO, and whether missing
/// them sheds.
#[derive(Debug, Clone, Copy)]
struct Slo {
    ttft_left: Option<Duration>,
    itl: Option<Duration>,
    sheddable: bool,
}

impl Slo {
    /// Whether every latency it bounds is predicted on `candidate`.
    fn predicted_on(&self, candidate: &Scored) -> bool {
        (self.ttft_left.is_none() || candidate.predicted_ttft.is_some())
            && (self.itl.is_none() || candidate.predicted_itl.is_some())
    }
}

impl Pool {
    /// Scores every replica, picks one by the pool's policy, and books the request there,
    /// atomically (no herding: concurrent requests see each other's bookings).
    pub fn route(&self, req: &RouteRequest, scoring: &ScoringConfig) -> RouteResponse {
        self.decide(req, scoring, None).unwrap_or_else(|_| nowhere())
    }

    /// [`Pool::route`], unless admission control is on and every eligible replica is
    /// saturated for the request, or, for a sheddable class, predicted to miss its TTFT SLO:
    /// then nothing is booked.
    pub fn admit(
        &self,
        req: &RouteRequest,
        scoring: &ScoringConfig,
        admit: Admit,
    ) -> Result<RouteResponse, NotAdmitted> {
        self.decide(req, scoring, self.admission.is_some().then_some(admit))
    }

    fn decide(
        &self,
        req: &RouteRequest,
        scoring: &ScoringConfig,
        admit: Option<Admit>,
    ) -> Result<RouteResponse, NotAdmitted> {
        // The prompt in the pool's terms: hashes of another block size are dropped.
        let shape = self.shape(req);
        // Lock order: members, index, affinity, load.
        let members = self.members();
        // Active replicas serving the model, with the cache each is credited; the routes
        // remembered are held until this decision's own is added, so concurrent decisions see
        // each other's prefixes.
        let (candidates, mut routes) = self.eligible(&members, req, shape.hashes);
        // In a disaggregated pool, decode workers take the request, prefill workers its leg.
        let pd = self.config.disaggregation.as_ref();
        let (eligible, prefillers) = disagg::by_role(&members, candidates, pd);
        if eligible.is_empty() {
            return Ok(nowhere());
        }
        // `consistent_hash` without a session key decides as `kv_aware`.
        let policy = self.policy_for(req);
        // `least_load` weighs no cache.
        let scoring = policy_scoring(policy, scoring);
        let mut load = self.load_table();
        // Its tenant's flow, whose bookings count towards fairness.
        let flow =
            self.admission.as_ref().and_then(|g| g.flow_of(g.class_of(req.priority.as_deref()), req.tenant.as_deref()));
        // With admission control, a full pool books nothing: the request waits — unless its
        // class sheds what misses its TTFT SLO, which is judged first (below).
        let saturated = admit.is_some_and(|a| self.all_saturated(&load, &eligible, req, flow, a));
        // Its TTFT SLO, what is left of it after its wait (admission control).
        let slo = admit.and_then(|a| self.slo_for(req, a));
        if saturated && !slo.is_some_and(|s| s.sheddable) {
            return Err(NotAdmitted::Saturated);
        }
        // Every eligible replica's cost, from its booked load.
        let mut scored = score_all(&load, &eligible, &shape, &scoring);
        // Its session's replica credited for keeping it, while it holds the session's prefix
        // and has headroom (`[pools.sessions]`, `kv_aware`).
        let session = self.session_of(req, policy);
        let weighed = session.map(|key| self.weigh_session(key, &load, &eligible, &mut scored, req, &scoring));
        // Where latencies are predicted (for the policy, an SLO, or a streamed request's
        // check), what each replica's events say it has computed of the prefill booked there:
        // the index read again, under `load` (a read never waits for its writer, README),
        // unless the pool indexes no events.
        let predicts = policy == Policy::PredictedLatency || slo.is_some();
        let computes = self.config.policy != Policy::PrefixAffinity && (predicts || shape.stream);
        let live = computes.then(|| self.index.read());
        let index = live.as_deref();
        // Each candidate's predicted TTFT and ITL, where the policy or the SLO needs them;
        // whether every candidate's TTFT model predicts.
        let predicted = predicts && predict_all(&load, index, &eligible, &mut scored, &shape, &scoring);
        // Under SLOs, the candidates the choice keeps to: those predicted within them (what is
        // left of the TTFT SLO), a model that does not predict yet counting as within (being
        // chosen is how it learns). None — every candidate predicted to miss — and a sheddable
        // class's request is shed.
        let within = slo.map(|slo| within(&scored, slo));
        if slo.is_some_and(|s| s.sheddable) && within.as_ref().is_some_and(Vec::is_empty) {
            drop((load, live));
            self.count_slo("shed");
            return Err(NotAdmitted::OverSlo);
        }
        if saturated {
            return Err(NotAdmitted::Saturated);
        }
        let allowed = within.as_deref().filter(|w| !w.is_empty());
        // Under `predicted_latency`, the lowest predicted TTFT; until every candidate's model
        // predicts, the request is decided (and recorded) as `kv_aware`.
        let fastest = (policy == Policy::PredictedLatency && predicted).then(|| fastest(&scored, allowed)).flatten();
        let policy = if policy == Policy::PredictedLatency && fastest.is_none() { Policy::KvAware } else { policy };
        // The policy's pick, an index into `eligible`.
        let Some(choice) =
            fastest.or_else(|| self.choose(policy, req, &members, &eligible, &scored, &scoring, allowed))
        else {
            return Ok(nowhere());
        };
        let slo_outcome = slo.map(|slo| match allowed {
            None => "missed",
            Some(_) if !slo.predicted_on(&scored[choice]) => "unpredicted",
            Some(_) => "within",
        });
        // Where the prompt is computed: there, or in a prefill worker's leg.
        let prompt = Prompt {
            tokens: shape.prompt_tokens,
            sequences: shape.sequences,
            block_size: shape.block_size,
            legs: req.prefill_legs,
        };
        let role = members[eligible[choice].slot.get()].replica.role;
        let split = disagg::split(pd, &load, &prefillers, eligible[choice], role, prompt, &scoring, &self.next_prefill);
        // Reserve the request's load there before anyone else decides.
        let remote = match (&split, pd) {
            (Split::Remote { at, .. }, Some(d)) => Some((d.mode, *at)),
            _ => None,
        };
        let id = BookingId::new(&req.request_id);
        let decode = BookAs { id: &id, flow, remote };
        let booked = book(&mut load, index, &shape, &scoring, eligible[choice], decode);
        // And the leg's prefill on its worker, under the leg's own id — unless the request
        // has ended already (its filter stopped waiting): nobody would end the leg.
        let leg_id = BookingId::leg(&req.request_id);
        let leg = match &split {
            Split::Remote { at, .. } if booked.booked => {
                let prefill = BookAs { id: &leg_id, flow: None, remote: None };
                Some(book(&mut load, index, &shape.leg(), &scoring, *at, prefill))
            }
            _ => None,
        };
        let figures: Vec<_> = std::iter::once(&booked).chain(&leg).map(|b| (b.slot, load.load(b.slot))).collect();
        let timed = PerLatency::from_fn(|latency| load.timed(&id, latency));
        drop((load, live));
        // The session is bound where it went, afresh.
        let session_outcome = session.zip(weighed).filter(|_| booked.booked).map(|(key, w)| {
            self.bind_session(key, booked.slot);
            let outcome = w.outcome(choice, allowed);
            self.count_session(outcome);
            outcome
        });
        if let Some(outcome) = slo_outcome.filter(|_| booked.booked) {
            self.count_slo(outcome);
        }
        // Remember where the prefix went, and expect the engine's events for it.
        for b in std::iter::once(&booked).chain(&leg) {
            self.after_booking(routes.as_deref_mut(), &members[b.slot.get()], &shape, b);
        }
        drop(routes);
        let (replica, dp_rank) = (members[booked.slot.get()].replica.clone(), members[booked.slot.get()].rank);
        let prefill = leg.as_ref().zip(pd).map(|(leg, pd)| {
            disagg::leg(&leg_id, &members[leg.slot.get()], leg.overlap.device, pd.mode, rand::random::<u64>() >> 1)
        });
        drop(members);
        // Gauges, the other gateways, `/debug/explain`, what will not be checked.
        for (slot, figures) in figures {
            self.publish_load(slot, figures);
        }
        for b in std::iter::once(&booked).chain(&leg).filter(|b| b.booked) {
            if let Some(reason) = b.unpredicted {
                self.unchecked(b.slot, reason);
            }
        }
        let bound = session_outcome.and(session);
        self.share_booking(&req.request_id, &replica.id, &shape, &booked, bound);
        if let (Some(leg), Some(p)) = (&leg, &prefill) {
            self.share_booking(&leg_id.request_id(), &p.replica, &shape.leg(), leg, None);
        }
        let mode = split.mode();
        let chosen = Chosen {
            slot: booked.slot,
            overlap: booked.overlap,
            timed,
            session: session_outcome,
            ttft_slo: slo.and_then(|s| s.ttft_left),
            itl_slo: slo.and_then(|s| s.itl),
        };
        self.record(req, policy, scored, chosen, mode);
        if let (Split::Remote { scored, .. }, Some(leg)) = (split, &leg) {
            self.record_leg(req, &leg_id, policy, scored, leg.slot);
        }
        Ok(RouteResponse {
            endpoint: Some(replica.endpoint.to_string()),
            replica: Some(replica.id),
            overlap_blocks: booked.overlap.device,
            dp_rank,
            prefill,
        })
    }

    /// Whether no eligible replica takes the request: none within its class's limits, or,
    /// for a tenant under its fair share, within the limits raised by the headroom — the only
    /// room a request with others waiting ahead of it may take.
    fn all_saturated(
        &self,
        load: &LoadTable,
        eligible: &[Eligible],
        req: &RouteRequest,
        flow: Option<Flow>,
        admit: Admit,
    ) -> bool {
        let Some(gate) = &self.admission else { return false };
        let class = gate.class_of(req.priority.as_deref());
        let under_share = gate.has_fair_headroom() && flow.is_some_and(|f| load.under_share(f));
        if admit.behind && !under_share {
            return true;
        }
        eligible.iter().all(|e| gate.saturated_for(&load.load(e.slot), class, under_share))
    }

    /// The request's SLOs — its own (the filter's `ttft_slo_header`, `itl_slo_header`), else
    /// its class's — its TTFT SLO less what it has waited, with admission control; `None`
    /// without either.
    fn slo_for(&self, req: &RouteRequest, admit: Admit) -> Option<Slo> {
        let gate = self.admission.as_ref()?;
        let class = gate.class_of(req.priority.as_deref());
        let own = |ms: Option<u32>| ms.filter(|ms| *ms > 0).map(|ms| Duration::from_millis(u64::from(ms)));
        let ttft = own(req.ttft_slo_ms).or_else(|| gate.ttft_slo(class));
        let itl = own(req.itl_slo_ms).or_else(|| gate.itl_slo(class));
        (ttft.is_some() || itl.is_some()).then(|| Slo {
            ttft_left: ttft.map(|slo| slo.saturating_sub(admit.waited)),
            itl,
            sheddable: gate.sheddable(class),
        })
    }

    /// Counts a decision held to a TTFT SLO by outcome.
    fn count_slo(&self, outcome: &'static str) {
        let labels = OutcomeLabels { model: self.config.model.clone(), outcome: outcome.to_owned() };
        self.metrics.slo_decisions.get_or_create(&labels).inc();
    }

    fn shape<'a>(&self, req: &'a RouteRequest) -> Shape<'a> {
        let block_size = u64::from(self.config.block_size);
        let hashes: &[SequenceHash] = if req.block_size == self.config.block_size { &req.block_hashes } else { &[] };
        let prompt_tokens = u64::from(req.prompt_tokens);
        let prompts = u64::from(req.prompts.max(1));
        Shape {
            hashes,
            prompt_tokens,
            booked_tokens: prompt_tokens * prompts,
            sequences: prompts * u64::from(req.samples.max(1)),
            prompt_count: req.prompt_count,
            block_size,
            total_blocks: prompt_tokens.div_ceil(block_size) * prompts,
            max_tokens: req
                .max_tokens
                .map(u64::from)
                .or_else(|| self.config.max_model_len.map(|len| len.saturating_sub(prompt_tokens).max(1))),
            stream: req.stream,
        }
    }

    /// The candidates: active replicas that serve the model (a learned adapter only where it
    /// is loaded), credited with their overlap — none while their publisher cannot be trusted
    /// — and, under `kv_aware` and `predicted_latency`, with prefixes routed there moments ago
    /// (`inflight_credit_secs`).
    /// Returns them with the routes remembered, locked, when the pool remembers routes.
    fn eligible(
        &self,
        members: &[Member],
        req: &RouteRequest,
        hashes: &[SequenceHash],
    ) -> (Vec<Eligible>, Option<MutexGuard<'_, ApproxIndex>>) {
        let affinity = self.config.policy == Policy::PrefixAffinity;
        let index = self.index.read();
        let overlaps = if affinity { Vec::new() } else { index.find_matches(hashes) };
        let mut eligible: Vec<Eligible> = members
            .iter()
            .enumerate()
            .filter(|(_, m)| m.active && m.serves(req.model.as_str(), &self.config))
            .map(|(i, m)| {
                // The affinity index does not depend on events, so a silent publisher is moot.
                let trusted = affinity || m.health.trusted();
                let overlap = if trusted { overlaps.get(i).copied().unwrap_or_default() } else { Overlap::default() };
                let slot = ReplicaIdx::new(i);
                Eligible { slot, overlap, indexed: overlap.device, churn: index.churn(slot), trusted }
            })
            .collect();
        drop(index);
        let routes = self.records_routes().then(|| self.affinity_index());
        if let Some(routes) = &routes {
            // Under `kv_aware` a candidate's blocks held by its events count as routed there:
            // its bookings recorded only the blocks past them, and the blocks every candidate
            // holds (a shared system prompt) need no walk. Members that are not candidates
            // hold what the least of them holds, so they neither start the walk earlier nor
            // prolong it.
            let known = eligible.iter().map(|e| e.overlap.device).min().unwrap_or(0);
            let mut held = vec![if affinity { 0 } else { known }; members.len()];
            for e in eligible.iter().filter(|_| !affinity) {
                held[e.slot.get()] = e.overlap.device;
            }
            let recent = routes.find_matches_past(hashes, &held, Instant::now());
            for e in &mut eligible {
                let here = recent[e.slot.get()];
                if affinity {
                    (e.overlap, e.indexed) = (here, here.device);
                } else {
                    e.overlap = e.overlap.with_device_at_least(here.device);
                }
            }
        }
        (eligible, routes)
    }

    /// Whether the pool remembers where it sent each prefix: the `prefix_affinity` policy's
    /// overlap, or the in-flight credit of `kv_aware` and `predicted_latency`.
    pub(super) fn records_routes(&self) -> bool {
        self.config.policy == Policy::PrefixAffinity || self.inflight_credit()
    }

    /// Whether prefixes routed moments ago count as cached where they went.
    fn inflight_credit(&self) -> bool {
        matches!(self.config.policy, Policy::KvAware | Policy::PredictedLatency) && self.config.inflight_credit_secs > 0
    }

    /// The request's session, if it has one and the pool binds sessions under this policy.
    fn session_of(&self, req: &RouteRequest, policy: Policy) -> Option<SessionKey> {
        let session = req.session.as_deref().filter(|_| self.sessions.is_some() && policy == Policy::KvAware)?;
        Some(SessionKey::of(session))
    }

    /// Where the session is bound, credited in `scored` if it holds the session's prefix and
    /// is not saturated for the request (with admission control on).
    fn weigh_session(
        &self,
        key: SessionKey,
        load: &LoadTable,
        eligible: &[Eligible],
        scored: &mut [Scored],
        req: &RouteRequest,
        scoring: &ScoringConfig,
    ) -> Weighed {
        let (Some(config), Some(mut table)) = (&self.config.sessions, self.sessions()) else {
            return Weighed::Unbound;
        };
        let bound = table.bound(key, Instant::now());
        drop(table);
        let saturated = |slot| {
            let gate = self.admission.as_ref();
            gate.is_some_and(|g| g.saturated_for(&load.load(slot), g.class_of(req.priority.as_deref()), false))
        };
        sessions::weigh(bound, eligible, scored, scoring, config.stickiness_blocks, saturated)
    }

    /// Binds a session to `slot` from now, and publishes the pool's count.
    pub(super) fn bind_session(&self, key: SessionKey, slot: ReplicaIdx) {
        let Some(mut table) = self.sessions() else { return };
        table.bind(key, slot, Instant::now());
        let bound = table.len();
        drop(table);
        self.publish_sessions_bound(bound);
    }

    /// Publishes how many sessions the pool has bound.
    pub(super) fn publish_sessions_bound(&self, bound: usize) {
        let pool = self.pool_labels();
        self.metrics.sessions_bound.get_or_create(&pool).set(i64::try_from(bound).unwrap_or(i64::MAX));
    }

    /// Counts a session's decision by outcome.
    fn count_session(&self, outcome: &'static str) {
        let labels = OutcomeLabels { model: self.config.model.clone(), outcome: outcome.to_owned() };
        self.metrics.session_decisions.get_or_create(&labels).inc();
    }

    fn policy_for(&self, req: &RouteRequest) -> Policy {
        match (self.config.policy, &req.session) {
            (Policy::ConsistentHash, None) => Policy::KvAware,
            (p, _) => p,
        }
    }

    /// The policy's choice among the `allowed` candidates (indices into `eligible`, in order,
    /// not empty; `None`: every one): an index into `eligible`.
    #[allow(clippy::too_many_arguments)]
    fn choose(
        &self,
        policy: Policy,
        req: &RouteRequest,
        members: &[Member],
        eligible: &[Eligible],
        scored: &[Scored],
        scoring: &ScoringConfig,
        allowed: Option<&[usize]>,
    ) -> Option<usize> {
        let among = among(allowed, eligible.len());
        match policy {
            Policy::KvAware | Policy::LeastLoad | Policy::PrefixAffinity | Policy::PredictedLatency => {
                let logits: Vec<f64> = among.clone().map(|c| scored[c].logit).collect();
                score::select(&logits, scoring.temperature, &mut rand::rng()).and_then(|k| among.clone().nth(k))
            }
            Policy::RoundRobin => {
                let turn = self.next.fetch_add(1, Ordering::Relaxed) % among.clone().count();
                among.clone().nth(turn)
            }
            Policy::ConsistentHash => req.session.as_deref().and_then(|key| rendezvous(key, members, eligible, among)),
        }
    }

    /// Records where the prefix went (`prefix_affinity`, in-flight credit), and that events
    /// are now expected from the replica if its engine must store a new block.
    fn after_booking(&self, routes: Option<&mut ApproxIndex>, member: &Member, shape: &Shape<'_>, booked: &Booked) {
        if let (Some(routes), true) = (routes, booked.booked) {
            routes.record(booked.slot, shape.hashes, self.held_by_events(booked), Instant::now());
        }
        if self.config.policy != Policy::PrefixAffinity && booked.booked && booked.prefill_tokens >= shape.block_size {
            let since = &member.health.awaiting_events_since;
            let _ = since.compare_exchange(NONE, self.now_ms(), Ordering::Relaxed, Ordering::Relaxed);
        }
    }

    /// The leading blocks of a booking's prompt that its target's events held when it was
    /// decided: the in-flight credit records only the blocks after them, since the walk counts
    /// what the events hold (`ApproxIndex::find_matches_past`). `prefix_affinity` records every
    /// block: its routes are all it knows.
    fn held_by_events(&self, booked: &Booked) -> usize {
        match self.config.policy {
            Policy::PrefixAffinity => 0,
            _ => booked.indexed as usize,
        }
    }

    /// A peer gateway booked `hashes` on `slot`, whose events held the first `held` of them
    /// there: under the in-flight credit the rest count as routed from here too, so a request
    /// sharing the prefix that reaches this gateway before the engine's events follows it there
    /// instead of prefilling it a second time elsewhere. At most [`PEER_ROUTE_BLOCKS`] of its
    /// blocks, so one peer message cannot flush what this gateway remembers.
    /// (`prefix_affinity` keeps to its own routes.)
    pub(super) fn record_peer_route(&self, slot: ReplicaIdx, hashes: &[SequenceHash], held: u32) {
        if self.inflight_credit() {
            let held = (held as usize).min(hashes.len());
            let end = (held + PEER_ROUTE_BLOCKS).min(hashes.len());
            self.affinity_index().record(slot, &hashes[..end], held, Instant::now());
        }
    }

    /// Tells the other gateways (when sync is on), with the session bound to the target.
    fn share_booking(
        &self,
        request_id: &RequestId,
        target: &str,
        shape: &Shape<'_>,
        booked: &Booked,
        session: Option<SessionKey>,
    ) {
        let (true, Some(outbox)) = (booked.booked, self.outbox.get()) else { return };
        outbox.send(SyncEvent::Booked {
            model: self.config.model.clone(),
            target: target.to_owned(),
            request_id: request_id.clone(),
            prefill_tokens: booked.prefill_tokens,
            hashes: shape.hashes.to_vec(),
            held_blocks: self.held_by_events(booked) as u32,
            total_blocks: shape.total_blocks,
            sequences: shape.sequences,
            session,
        });
    }
}

/// The scoring a policy uses: `least_load` gives no credit for cache.
fn policy_scoring(policy: Policy, scoring: &ScoringConfig) -> ScoringConfig {
    match policy {
        Policy::LeastLoad => ScoringConfig {
            kv_overlap_credit: 0.0,
            host_cache_hit_weight: 0.0,
            disk_cache_hit_weight: 0.0,
            duplicate_penalty: 0.0,
            ..scoring.clone()
        },
        _ => scoring.clone(),
    }
}

/// Every eligible replica's cost inputs (its booked load, this request's new blocks there)
/// and cost.
fn score_all(load: &LoadTable, eligible: &[Eligible], shape: &Shape<'_>, scoring: &ScoringConfig) -> Vec<Scored> {
    let inputs: Vec<Candidate> = eligible
        .iter()
        .map(|e| {
            let l = load.load(e.slot);
            Candidate {
                overlap: e.overlap,
                prefill_tokens: l.prefill_tokens,
                decode_blocks: l.active_blocks + load.additional_blocks(e.slot, shape.hashes, shape.total_blocks),
                requests: l.requests,
            }
        })
        .collect();
    let request = RequestShape { prompt_tokens: shape.booked_tokens, block_size: shape.block_size };
    scored(eligible, inputs, request, scoring)
}

/// Each candidate's predicted time to first token, its own prefill being what it has not
/// cached there, and inter-token latency, kept in `scored` (for the choice and
/// `/debug/explain`). Whether every candidate's TTFT model predicts.
fn predict_all(
    load: &LoadTable,
    index: Option<&KvIndex>,
    eligible: &[Eligible],
    scored: &mut [Scored],
    shape: &Shape<'_>,
    scoring: &ScoringConfig,
) -> bool {
    let now = Instant::now();
    for (e, s) in eligible.iter().zip(scored.iter_mut()) {
        let prefill_tokens = scoring.prefill_tokens(shape.booked_tokens, shape.block_size, e.overlap);
        let own = Own { prefill_tokens, sequences: shape.sequences };
        let predicted = with_computed(index, e, shape.block_size, |computed| load.predict(e.slot, own, now, computed));
        let secs = |latency: Latency| predicted[latency].map(|d| d.as_secs_f32());
        (s.predicted_ttft, s.predicted_itl) = (secs(Latency::Ttft), secs(Latency::Itl));
    }
    scored.iter().all(|s| s.predicted_ttft.is_some())
}

/// The candidates a choice is made among: `allowed` (indices into the `n` candidates), or
/// every one.
fn among(allowed: Option<&[usize]>, n: usize) -> impl Iterator<Item = usize> + Clone + '_ {
    let every = allowed.is_none().then_some(0..n);
    allowed.into_iter().flatten().copied().chain(every.into_iter().flatten())
}

/// Of the `allowed` candidates (indices into `scored`; `None`: every one), the one with the
/// lowest predicted TTFT; `None` if one of them does not predict.
fn fastest(scored: &[Scored], allowed: Option<&[usize]>) -> Option<usize> {
    let among = among(allowed, scored.len());
    let predicted: Option<Vec<f64>> = among.clone().map(|c| scored[c].predicted_ttft.map(f64::from)).collect();
    score::argmin(&predicted?, &mut rand::rng()).and_then(|k| among.clone().nth(k))
}

/// The candidates (indices into `scored`) the SLOs keep: those predicted within what is left
/// of the TTFT SLO and within the ITL SLO, a latency not predicted yet counting as within.
/// Nothing is within a TTFT SLO that is spent.
fn within(scored: &[Scored], slo: Slo) -> Vec<usize> {
    let keeps = |bound: Option<Duration>, t: Option<f32>| {
        let Some(bound) = bound.map(|b| b.as_secs_f64()) else { return true };
        t.is_none_or(|t| bound > 0.0 && f64::from(t) <= bound)
    };
    let within = |s: &Scored| keeps(slo.ttft_left, s.predicted_ttft) && keeps(slo.itl, s.predicted_itl);
    (0..scored.len()).filter(|&c| within(&scored[c])).collect()
}

/// Books the request (or its prefill leg) on the chosen replica: its prefill left after the
/// overlap — none if the prompt is computed elsewhere — and its blocks.
fn book(
    load: &mut LoadTable,
    index: Option<&KvIndex>,
    shape: &Shape<'_>,
    scoring: &ScoringConfig,
    at: Eligible,
    to: BookAs<'_>,
) -> Booked {
    let prefill_tokens = match to.remote {
        Some(_) => 0,
        None => scoring.prefill_tokens(shape.booked_tokens, shape.block_size, at.overlap),
    };
    // What the engine should report: a prompt that was not tokenized predicts nothing, nor
    // does a transferred one that was not counted exactly, nor several sequences (the engine
    // reports one of them).
    let prediction = if shape.sequences > 1 { None } else { predict(shape, at, to.remote) };
    let unpredicted = match prediction {
        Some(_) => None,
        None if shape.sequences > 1 => Some(Unchecked::SeveralSequences),
        None => Some(Unchecked::Estimated),
    };
    let booked = with_computed(index, &at, shape.block_size, |computed| {
        let booking = NewBooking {
            id: to.id,
            prefill_tokens,
            hashes: shape.hashes,
            total_blocks: shape.total_blocks,
            max_tokens: shape.max_tokens,
            sequences: shape.sequences,
            prediction,
            streamed: shape.stream,
            flow: to.flow,
            from_peer: false,
            // Its TTFT is its replica's own, of a prompt whose size is known.
            timed: shape.stream && to.remote.is_none() && shape.prompt_count != PromptCount::Estimated,
            computed,
        };
        load.book(at.slot, booking, Instant::now())
    });
    Booked { slot: at.slot, overlap: at.overlap, indexed: at.indexed, prefill_tokens, booked, unpredicted }
}

/// `f` given what `at`'s events say it has computed, where the pool indexes events and
/// `at`'s are trusted.
fn with_computed<R>(
    index: Option<&KvIndex>,
    at: &Eligible,
    block_size: u64,
    f: impl FnOnce(Option<Computed<'_>>) -> R,
) -> R {
    let Some(index) = index.filter(|_| at.trusted) else { return f(None) };
    let held = |hashes: &[SequenceHash]| index.device_held(at.slot, hashes);
    f(Some(Computed { block_size, held: &held }))
}

/// What the engine should report for one sequence's prompt booked `at` (`remote`: its KV comes
/// from that prefill worker over that protocol).
fn predict(shape: &Shape<'_>, at: Eligible, remote: Option<(TransferProtocol, Eligible)>) -> Option<Prediction> {
    let exact = shape.prompt_count == PromptCount::Exact;
    let cached_at = |at: Eligible| {
        let (indexed, credited) = (u64::from(at.indexed), u64::from(at.overlap.device));
        Prediction::new(indexed, credited, shape.block_size, shape.prompt_tokens, exact, at.churn)
    };
    match remote {
        // vLLM 0.32's decoder reports the prefill worker's cache hits, which the prefill
        // passes on (`remote_prefill_cached_tokens`): the leg's prediction, whose churn is
        // another replica's.
        Some((TransferProtocol::Vllm, prefill)) => {
            (shape.prompt_count != PromptCount::Estimated).then(|| Prediction { churn: None, ..cached_at(prefill) })
        }
        // SGLang's decoder reports every transferred token as cached.
        Some((TransferProtocol::Sglang, _)) => exact.then(|| Prediction::transferred(shape.prompt_tokens)),
        None => (shape.prompt_count != PromptCount::Estimated).then(|| cached_at(at)),
    }
}

/// Rendezvous (highest-random-weight) hashing over the `allowed` eligible replicas (indices
/// into `eligible`): a session keeps its replica, and only the sessions of a replica that
/// leaves (or, under a TTFT SLO, is predicted to miss it) move. Returns an index into
/// `eligible`; `None` if none is allowed.
fn rendezvous(
    key: &str,
    members: &[Member],
    eligible: &[Eligible],
    allowed: impl Iterator<Item = usize>,
) -> Option<usize> {
    let weight = |id: &str| {
        let mut bytes = key.as_bytes().to_vec();
        bytes.push(0);
        bytes.extend_from_slice(id.as_bytes());
        xxhash_rust::xxh3::xxh3_64(&bytes)
    };
    allowed.max_by_key(|&c| weight(&members[eligible[c].slot.get()].replica.id))
}
