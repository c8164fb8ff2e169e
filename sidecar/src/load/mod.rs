//! Per-replica token load: what each replica is busy with, from kvgate's own decisions.
//!
//! Every routed request is booked on its replica with its prefill tokens left after cache
//! overlap and its prompt blocks. The filter reports the first token (prefill done: the
//! prefill tokens are released) and the end of the response (everything is released). A
//! request whose end is never reported expires after [`LoadTable::expire`]'s age.
//!
//! Decode load is counted in blocks, deduplicated across requests sharing a prompt prefix on
//! the same replica (Dynamo's `active_decode_blocks`), in a radix tree of the bookings'
//! prompts ([`booked`]: a long prompt is a run of blocks, not an entry per block).
//!
//! A non-streamed response's first byte is its last, so its first token is never reported in
//! time: its prefill is taken to end `prefill_tokens / rate` after it was booked, where `rate`
//! is the replica's prefill rate learned from streamed requests (an exponential average of
//! their prefill tokens over the time from booking to first token, queueing included), or the
//! pool's `prefill_tokens_per_sec` until one is learned ([`LoadTable::end_prefills`]).
//!
//! Traffic that does not come through kvgate is invisible to bookings. With
//! `engine_metrics_secs`, [`engine_metrics`] reads each engine's own request count and
//! [`LoadTable::observe`] books the difference as *external* requests, each charged the
//! pool's mean blocks per booked request (their sizes are unknown); those of them the engine
//! reports still waiting — its waiting requests beyond kvgate's own bookings in prefill —
//! are charged the pool's mean prefill tokens per booked request too, since a request queued
//! behind them waits for their prefill.

pub mod booked;
pub mod engine_metrics;
pub mod flows;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use kvgate_shared::hash::SequenceHash;
use kvgate_shared::ids::RequestId;

use crate::accuracy::Prediction;
use crate::index::ReplicaIdx;
use crate::latency::{Inputs, Latency, PerLatency, Predictor, ReplicaLatency, Watched};
use booked::BookedBlocks;
use flows::{Flow, Flows};

/// What one engine (a data-parallel rank: vLLM's `engine` label, SGLang's `dp_rank`) reports
/// of itself ([`engine_metrics`] says which metric each figure is read from).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct EngineReport {
    /// Requests running + waiting.
    pub requests: u64,
    /// Requests the engine has not scheduled yet.
    pub waiting: u64,
    /// How full its KV cache is (0–1).
    pub kv_usage: Option<f64>,
    /// Its KV cache in blocks: the `num_gpu_blocks` label of `vllm:cache_config_info`.
    pub kv_blocks: Option<u64>,
}

impl EngineReport {
    /// Several engines behind one target, as one: counts and blocks add up, usage is the
    /// fullest's.
    pub fn merge(self, other: EngineReport) -> EngineReport {
        let add = |a: Option<u64>, b: Option<u64>| {
            if a.is_none() && b.is_none() {
                None
            } else {
                Some(a.unwrap_or(0) + b.unwrap_or(0))
            }
        };
        EngineReport {
            requests: self.requests + other.requests,
            waiting: self.waiting + other.waiting,
            kv_usage: match (self.kv_usage, other.kv_usage) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            },
            kv_blocks: add(self.kv_blocks, other.kv_blocks),
        }
    }
}

/// What a replica is busy with, as the scorer sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReplicaLoad {
    /// Booked prefill tokens of requests that have not produced a first token, and the mean
    /// booked prefill for each external request the engine reports waiting (`P_i`).
    pub prefill_tokens: u64,
    /// Unique blocks of the active requests (`active_decode_blocks`), external ones included.
    pub active_blocks: u64,
    /// Active requests (`R_i`), external ones included.
    pub requests: u64,
    /// Of those, requests the engine reports that kvgate did not book.
    pub external: u64,
    /// What the engine last said of itself (with `engine_metrics_secs`), if it has.
    pub engine: Option<EngineReport>,
}

#[derive(Debug)]
struct Booking {
    replica: ReplicaIdx,
    prefill_tokens: u64,
    prefill_done: bool,
    hashes: Vec<SequenceHash>,
    /// Blocks of the prompt beyond its full hashed blocks (the partial tail): never shared.
    private_blocks: u64,
    booked_at: Instant,
    /// Decode progress: output blocks so far, and blocks of the unique footprint currently
    /// not counted (its weight is `1 − output/max_tokens`).
    output_blocks: u64,
    discounted: u64,
    max_tokens: Option<u64>,
    /// What the engine should report for it.
    prediction: Option<Prediction>,
    /// Sequences it decodes (prompts × `n`): what it adds to `requests`.
    sequences: u64,
    /// When its prefill is taken to end, for a response that is not streamed (its first
    /// token is never reported in time).
    prefill_ends_at: Option<Instant>,
    /// Its tenant and class, if it named a tenant.
    flow: Option<Flow>,
    /// Booked by a peer gateway (its id is `origin/request_id`).
    from_peer: bool,
    /// Of each latency: what its replica faced when it was booked, and what was predicted
    /// from that, for a timed request (whose measurements teach the replica's models), until
    /// measured.
    timed: PerLatency<Option<(Inputs, Option<Duration>)>>,
}

impl Booking {
    /// Its prefill the replica's events do not show computed: its own hashed blocks — past
    /// the prefix it was booked as holding, cached or credited in flight — that the replica
    /// does not hold yet, in tokens (at most its prefill). To within a block: the blocks
    /// before its own are taken to be all but the ones its prefill tokens fill. What has no
    /// hash (a partial last block, a prompt hashed with another block size or not tokenized,
    /// the prompts of a list past the first) is never counted: the events cannot tell of it.
    fn uncomputed(&self, computed: Computed<'_>) -> u64 {
        let hashed = self.hashes.len() as u64;
        let blocks = hashed + self.private_blocks;
        let own_from = blocks.saturating_sub(self.prefill_tokens.div_ceil(computed.block_size)).min(hashed);
        let held = ((computed.held)(&self.hashes) as u64).clamp(own_from, hashed);
        ((hashed - held) * computed.block_size).min(self.prefill_tokens)
    }
}

/// What a replica's engine has computed, as its own KV events say: how many of a prompt's
/// leading blocks its cache holds (the pool's index, read by the caller, for a replica whose
/// events are trusted). vLLM publishes the blocks a step computed once the step has run, so
/// a chunk in progress counts as not computed until its step ends, and a request the engine
/// keeps waiting (for KV space, for a batch slot) computes nothing.
#[derive(Clone, Copy)]
pub struct Computed<'a> {
    /// Tokens per block.
    pub block_size: u64,
    /// The prompt's leading blocks the replica holds.
    pub held: &'a dyn Fn(&[SequenceHash]) -> usize,
}

impl std::fmt::Debug for Computed<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Computed").field("block_size", &self.block_size).finish_non_exhaustive()
    }
}

#[derive(Debug, Default)]
struct Replica {
    prefill_tokens: u64,
    /// Sequences of the bookings whose prefill is not over (the engine counts each one).
    prefilling: u64,
    /// Those bookings.
    in_prefill: HashSet<BookingId>,
    private_blocks: u64,
    requests: u64,
    /// Requests the engine last reported beyond those booked here.
    external: u64,
    /// Of those, how many it reported waiting beyond the bookings in prefill here.
    external_waiting: u64,
    /// The engine's last report.
    engine: Option<EngineReport>,
    /// Output blocks of active requests, and the blocks their decode-progress weights
    /// discount (see [`LoadTable::progress`]).
    output_blocks: u64,
    discounted: u64,
    /// The prompt blocks of the active requests here, each counted once, and how many
    /// requests hold each: every decision looks up the prompt's booked prefix on each
    /// candidate, every booking adds its prompt.
    shared_blocks: BookedBlocks,
    /// Prefill tokens per second, learned from streamed requests (`None` until one is).
    prefill_rate: Option<f64>,
    /// Its time to first token and inter-token latency, learned from the filter's
    /// measurements, and checked.
    latency: ReplicaLatency,
    /// The prefill booked here still to compute, as last set (at `backlog_at`): drained since
    /// at the speed its TTFT model learned.
    backlog: f64,
    backlog_at: Option<Instant>,
}

impl Replica {
    /// Its prefill tokens per second, as learned (`default_rate` until it has served a
    /// streamed request).
    fn prefill_rate(&self, default_rate: f64) -> f64 {
        self.prefill_rate.unwrap_or(default_rate)
    }

    /// The prefill booked here still to compute at `now`: what was booked, less what the
    /// replica computed since — at the speed its TTFT model learned, or while that model
    /// does not predict (or learned no cost per token), at its prefill rate (`default_rate`
    /// until it has one) — never more than the prefill booked and not yet past its first token.
    fn backlog(&self, now: Instant, default_rate: f64) -> f64 {
        let elapsed = self.backlog_at.map_or(0.0, |at| now.saturating_duration_since(at).as_secs_f64());
        let secs_per_token = match self.latency[Latency::Ttft].secs_per_prefill_token(now) {
            Some(secs) if secs > 0.0 => secs,
            _ => 1.0 / self.prefill_rate(default_rate),
        };
        (self.backlog - elapsed / secs_per_token).clamp(0.0, self.prefill_tokens as f64)
    }

    /// Adds `tokens` of prefill to compute to the backlog at `now`.
    fn add_backlog(&mut self, tokens: u64, now: Instant, default_rate: f64) {
        (self.backlog, self.backlog_at) = (self.backlog(now, default_rate) + tokens as f64, Some(now));
    }
}

/// Weight of the newest sample in a replica's prefill rate.
const RATE_WEIGHT: f64 = 0.2;
/// Streamed requests with fewer prefill tokens say little about the rate.
const RATE_MIN_TOKENS: u64 = 64;

/// The load table of one pool.
#[derive(Debug)]
pub struct LoadTable {
    replicas: Vec<Replica>,
    bookings: HashMap<BookingId, Booking>,
    /// Prompt blocks of all bookings (for the mean an external request is charged).
    blocks_booked: u64,
    /// Prefill tokens all bookings were booked with (for the mean a waiting external
    /// request is charged).
    prefill_booked: u64,
    /// Requests whose end was reported before they were booked (a lifecycle batch can
    /// overtake a slow decision): booking them later must not leak load.
    ended_early: EndedEarly,
    /// Estimated prefill ends of non-streamed bookings, soonest first.
    prefill_ends: BinaryHeap<Reverse<(Instant, BookingId)>>,
    /// The prefill rate assumed for a replica that has not served a streamed request yet.
    default_prefill_rate: f64,
    /// Bookings in flight per tenant and class.
    flows: Flows,
}

/// The key of a booking: a request's id as the filter reports it (Envoy's `x-request-id`, or
/// its prefill leg's, [`BookingId::leg`]), or a peer gateway's booking ([`BookingId::peer`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BookingId(String);

impl BookingId {
    /// A request's booking, under the id the filter reports its lifecycle with.
    pub fn new(id: &RequestId) -> BookingId {
        BookingId(id.as_str().to_owned())
    }

    /// The booking of a request's prefill leg on its prefill worker: `<id>/prefill`.
    pub fn leg(id: &RequestId) -> BookingId {
        BookingId(format!("{id}/prefill"))
    }

    /// A peer gateway's booking, as the sync mesh names it here: `<origin>/<id>`.
    pub fn peer(origin: &str, id: &RequestId) -> BookingId {
        BookingId(format!("{origin}/{id}"))
    }

    /// A peer's booking as the origin and its id there: the inverse of [`BookingId::peer`]
    /// (`None` without a `/`). A request's own id may hold a `/` too: callers check that it was
    /// booked as a peer's.
    pub fn peer_parts(&self) -> Option<(&str, &str)> {
        self.0.split_once('/')
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id the booking's lifecycle is reported under: a request's own id, or its leg's.
    pub fn request_id(&self) -> RequestId {
        RequestId::new(self.0.as_str())
    }
}

impl std::fmt::Display for BookingId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// How many early ends are remembered.
const ENDED_EARLY: usize = 4096;

/// The ids of [`LoadTable::finish`]es that came before their booking, the oldest forgotten
/// first: O(1) to check and to add, whatever its size.
#[derive(Debug, Default)]
struct EndedEarly {
    /// Id → when it was remembered (a running count).
    ids: HashMap<BookingId, u64>,
    /// (when, id), oldest first; entries of ids taken since are skipped when they age out.
    order: VecDeque<(u64, BookingId)>,
    next: u64,
}

impl EndedEarly {
    fn insert(&mut self, id: &BookingId) {
        if self.ids.contains_key(id) {
            return;
        }
        while self.ids.len() >= ENDED_EARLY || self.order.len() >= 2 * ENDED_EARLY {
            let Some((at, oldest)) = self.order.pop_front() else { break };
            if self.ids.get(&oldest) == Some(&at) {
                self.ids.remove(&oldest);
            }
        }
        self.next += 1;
        self.ids.insert(id.clone(), self.next);
        self.order.push_back((self.next, id.clone()));
    }

    /// Whether `id` ended early; forgets it (its late booking is the one it was waiting for).
    /// Its place in `order` ages out later: removing it now would be O(n).
    fn take(&mut self, id: &BookingId) -> bool {
        self.ids.remove(id).is_some()
    }

    fn len(&self) -> usize {
        self.ids.len()
    }
}

/// A request to book on a replica.
#[derive(Debug, Clone)]
pub struct NewBooking<'a> {
    /// Its key.
    pub id: &'a BookingId,
    /// Prefill tokens left after the replica's cache overlap.
    pub prefill_tokens: u64,
    /// The prompt's sequence hashes.
    pub hashes: &'a [SequenceHash],
    /// All blocks the prompt occupies, `ceil(ISL / block_size)`.
    pub total_blocks: u64,
    /// The request's `max_tokens`, for decode progress.
    pub max_tokens: Option<u64>,
    /// What the engine should report for it (checked by [`crate::accuracy`]).
    pub prediction: Option<Prediction>,
    /// Sequences it decodes: a list of prompts, or `n` above 1, count each.
    pub sequences: u64,
    /// Whether the response streams (its first token is reported when it arrives).
    pub streamed: bool,
    /// Its tenant and class, if it named a tenant (for fairness under admission control).
    pub flow: Option<Flow>,
    /// Booked by a peer gateway (its id is `origin/request_id`), not by this one.
    pub from_peer: bool,
    /// Whether its TTFT and ITL, as the filter measures them, are the replica's own: a
    /// streamed request that computes its prompt there (not one whose KV a prefill worker
    /// sends). They are then predicted, checked and learned from.
    pub timed: bool,
    /// What the replica's events say it has computed, for a timed request's inputs (`None`:
    /// none is known beyond the speed learned).
    pub computed: Option<Computed<'a>>,
}

/// What a request brings to a replica, as its latencies are predicted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Own {
    /// Prefill tokens left after the replica's cache overlap (its TTFT's).
    pub prefill_tokens: u64,
    /// Sequences it decodes (its ITL's; none counts as one).
    pub sequences: u64,
}

/// A booking as a starting peer takes it over (`crate::pool::handover`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BookingExport {
    /// Its id in this table.
    pub id: BookingId,
    /// Its replica.
    pub replica: ReplicaIdx,
    /// Prefill tokens still to compute (0 once its prefill is over).
    pub prefill_tokens: u64,
    /// The prompt's sequence hashes.
    pub hashes: Vec<SequenceHash>,
    /// All blocks the prompt occupies.
    pub total_blocks: u64,
    /// Sequences it decodes.
    pub sequences: u64,
    /// Booked by a peer gateway, not by this one.
    pub from_peer: bool,
    /// How long ago it was booked.
    pub age: Duration,
}

impl LoadTable {
    /// An idle table for `replicas` replicas, assuming `default_prefill_rate` tokens/s of
    /// prefill on a replica until it has served a streamed request.
    pub fn new(replicas: usize, default_prefill_rate: f64) -> Self {
        LoadTable {
            replicas: (0..replicas).map(|_| Replica::default()).collect(),
            bookings: HashMap::new(),
            blocks_booked: 0,
            prefill_booked: 0,
            flows: Flows::default(),
            ended_early: EndedEarly::default(),
            prefill_ends: BinaryHeap::new(),
            default_prefill_rate: default_prefill_rate.max(1.0),
        }
    }

    /// The prefill rate a replica is assumed to run at, tokens/s.
    pub fn prefill_rate(&self, replica: ReplicaIdx) -> f64 {
        self.replicas[replica.get()].prefill_rate(self.default_prefill_rate)
    }

    /// Ends the estimated prefills due by `now`. Returns the ids ended (for the sync mesh).
    pub fn end_prefills(&mut self, now: Instant) -> Vec<BookingId> {
        let mut ended = Vec::new();
        while let Some(Reverse((at, _))) = self.prefill_ends.peek() {
            if *at > now {
                break;
            }
            let Some(Reverse((at, id))) = self.prefill_ends.pop() else { break };
            // Still the booking this estimate was made for, still in prefill.
            let due = self.bookings.get(&id).is_some_and(|b| b.prefill_ends_at == Some(at) && !b.prefill_done);
            if due {
                self.prefill_done(&id, now);
                ended.push(id);
            }
        }
        ended
    }

    /// Makes room for one more replica; returns its index.
    pub fn add_replica(&mut self) -> ReplicaIdx {
        self.replicas.push(Replica::default());
        ReplicaIdx::new(self.replicas.len() - 1)
    }

    /// The replica left the pool: drops every booking on it (their lifecycle reports are
    /// then ignored as unknown), its external load and its TTFT model (a replica that takes
    /// the slot is learned afresh). Returns how many bookings.
    pub fn clear_replica(&mut self, replica: ReplicaIdx) -> usize {
        let r = &mut self.replicas[replica.get()];
        (r.external, r.external_waiting) = (0, 0);
        r.latency = ReplicaLatency::default();
        let gone: Vec<BookingId> =
            self.bookings.iter().filter(|(_, b)| b.replica == replica).map(|(id, _)| id.clone()).collect();
        for id in &gone {
            self.release(id);
        }
        gone.len()
    }

    /// Decode progress (Ray's rule on Dynamo's block tracker): the request has streamed
    /// `output_tokens`; its output occupies `ceil(output_tokens / block_size)` more blocks, and
    /// its unique footprint — prompt blocks no other active request shares, its partial tail
    /// and its output blocks — counts with weight `max(0, 1 − output_tokens / max_tokens)`
    /// (1 without `max_tokens`), rounded as Dynamo rounds. Returns false for an unknown id.
    pub fn progress(&mut self, id: &BookingId, output_tokens: u64, block_size: u64) -> bool {
        let Some(b) = self.bookings.get_mut(id) else { return false };
        let r = &mut self.replicas[b.replica.get()];
        let output_blocks = output_tokens.div_ceil(block_size.max(1));
        r.output_blocks += output_blocks.saturating_sub(b.output_blocks);
        b.output_blocks = b.output_blocks.max(output_blocks);
        let weight = b.max_tokens.map_or(1.0, |m| (1.0 - output_tokens as f64 / m.max(1) as f64).max(0.0));
        let shared_only_here = r.shared_blocks.held_only_by_one(&b.hashes);
        let unique = shared_only_here + b.private_blocks + b.output_blocks;
        let discounted = unique - (weight * unique as f64).round() as u64;
        r.discounted = r.discounted - b.discounted + discounted;
        b.discounted = discounted;
        true
    }

    /// The replica's current load.
    pub fn load(&self, replica: ReplicaIdx) -> ReplicaLoad {
        let r = &self.replicas[replica.get()];
        let external_blocks = if r.external == 0 { 0 } else { r.external * self.mean_blocks_per_request() };
        let external_prefill = r.external_waiting * self.mean_prefill_per_request();
        let blocks = r.shared_blocks.blocks() + r.private_blocks + r.output_blocks;
        ReplicaLoad {
            prefill_tokens: r.prefill_tokens + external_prefill,
            active_blocks: blocks.saturating_sub(r.discounted) + external_blocks,
            requests: r.requests + r.external,
            external: r.external,
            engine: r.engine,
        }
    }

    /// The engine reports itself: whatever of its requests (running + waiting) exceeds the
    /// requests booked here is external load until the next report, and whatever of its
    /// waiting requests exceeds the bookings in prefill here (at most the external ones) is
    /// external prefill still to come.
    pub fn observe(&mut self, replica: ReplicaIdx, report: EngineReport) {
        let r = &mut self.replicas[replica.get()];
        r.external = report.requests.saturating_sub(r.requests);
        r.external_waiting = report.waiting.saturating_sub(r.prefilling).min(r.external);
        r.engine = Some(report);
    }

    /// Mean blocks of a booked request (prompt blocks), 1 when nothing is booked.
    fn mean_blocks_per_request(&self) -> u64 {
        if self.bookings.is_empty() {
            return 1;
        }
        (self.blocks_booked / self.bookings.len() as u64).max(1)
    }

    /// Mean prefill tokens a request was booked with, 0 when nothing is booked.
    fn mean_prefill_per_request(&self) -> u64 {
        self.prefill_booked.checked_div(self.bookings.len() as u64).unwrap_or(0)
    }

    /// How many of the prompt's blocks would be new on this replica's active set: Dynamo's
    /// `additional_active_blocks` (the prompt's total minus its leading blocks already active).
    pub fn additional_blocks(&self, replica: ReplicaIdx, hashes: &[SequenceHash], total_blocks: u64) -> u64 {
        let overlap = self.replicas[replica.get()].shared_blocks.overlap(hashes) as u64;
        total_blocks.saturating_sub(overlap)
    }

    /// Books a request on a replica. Booking an id again first releases the old booking.
    /// Returns false (and books nothing) if the request already ended.
    pub fn book(&mut self, replica: ReplicaIdx, booking: NewBooking<'_>, now: Instant) -> bool {
        if self.ended_early.take(booking.id) {
            return false;
        }
        self.release(booking.id);
        let default_rate = self.default_prefill_rate;
        let own = Own { prefill_tokens: booking.prefill_tokens, sequences: booking.sequences };
        let faced = booking.timed.then(|| self.faced(replica, own, now, booking.computed));
        let timed = PerLatency::from_fn(|latency| {
            // Several sequences' tokens interleave in one stream: its mean gap is not an ITL.
            let timed = latency == Latency::Ttft || booking.sequences <= 1;
            faced.filter(|_| timed).map(|faced| {
                let inputs = faced[latency];
                (inputs, self.replicas[replica.get()].latency[latency].predict(inputs, now))
            })
        });
        let r = &mut self.replicas[replica.get()];
        r.add_backlog(booking.prefill_tokens, now, default_rate);
        r.prefill_tokens += booking.prefill_tokens;
        r.prefilling += booking.sequences.max(1);
        r.in_prefill.insert(booking.id.to_owned());
        r.requests += booking.sequences.max(1);
        r.shared_blocks.insert(booking.hashes);
        let private_blocks = booking.total_blocks.saturating_sub(booking.hashes.len() as u64);
        r.private_blocks += private_blocks;
        self.blocks_booked += booking.hashes.len() as u64 + private_blocks;
        self.prefill_booked += booking.prefill_tokens;
        let prefill_ends_at = (!booking.streamed).then(|| {
            let secs = booking.prefill_tokens as f64 / self.prefill_rate(replica);
            now + Duration::from_secs_f64(secs.min(3_600.0))
        });
        if let Some(at) = prefill_ends_at {
            self.prefill_ends.push(Reverse((at, booking.id.to_owned())));
        }
        self.bookings.insert(
            booking.id.to_owned(),
            Booking {
                replica,
                prefill_tokens: booking.prefill_tokens,
                prefill_done: false,
                hashes: booking.hashes.to_vec(),
                private_blocks,
                booked_at: now,
                output_blocks: 0,
                discounted: 0,
                max_tokens: booking.max_tokens,
                prediction: booking.prediction,
                sequences: booking.sequences.max(1),
                prefill_ends_at,
                flow: booking.flow,
                from_peer: booking.from_peer,
                timed,
            },
        );
        if let Some(flow) = booking.flow {
            self.flows.add(flow);
        }
        true
    }

    /// Whether `flow` holds less than its fair share of its class's bookings (see
    /// [`Flows::under_share`]).
    pub fn under_share(&self, flow: Flow) -> bool {
        self.flows.under_share(flow)
    }

    /// Flows (tenants per class) with bookings in flight.
    pub fn flows_in_flight(&self) -> usize {
        self.flows.len()
    }

    /// The replica a request is booked on and what was predicted for it there, taken: a
    /// prediction is checked once.
    pub fn take_prediction(&mut self, id: &BookingId) -> Option<(ReplicaIdx, Prediction)> {
        self.bookings.get_mut(id).and_then(|b| Some((b.replica, b.prediction.take()?)))
    }

    /// The latencies a request of `own` would have if booked on `replica` at `now`, each if
    /// the replica's model of it predicts; `computed`: what its events say it has computed.
    pub fn predict(
        &self,
        replica: ReplicaIdx,
        own: Own,
        now: Instant,
        computed: Option<Computed<'_>>,
    ) -> PerLatency<Option<Duration>> {
        let faced = self.faced(replica, own, now, computed);
        PerLatency::from_fn(|latency| self.replicas[replica.get()].latency[latency].predict(faced[latency], now))
    }

    /// What a request of `own` faces on `replica` at `now`, for each latency: for its TTFT,
    /// the prefill ahead with its own and the sequences decoding meanwhile; for its ITL, the
    /// prefill booked before it and every sequence, its own included. For both, the prefill
    /// booked there that the replica's events (`computed`) do not show computed, beyond the
    /// backlog the speed learned has left.
    fn faced(&self, replica: ReplicaIdx, own: Own, now: Instant, computed: Option<Computed<'_>>) -> PerLatency<Inputs> {
        let r = &self.replicas[replica.get()];
        let left = r.backlog(now, self.default_prefill_rate).round() as u64;
        let not_stored = computed.map_or(0, |c| self.not_stored(replica, c)).saturating_sub(left);
        PerLatency::from_fn(|latency| match latency {
            Latency::Ttft => Inputs {
                prefill_ahead: left + own.prefill_tokens,
                decoding: r.requests - r.prefilling,
                prefill_not_stored: not_stored,
            },
            Latency::Itl => Inputs {
                prefill_ahead: left,
                decoding: r.requests + own.sequences.max(1),
                prefill_not_stored: not_stored,
            },
        })
    }

    /// The prefill of the bookings in prefill on `replica` that its events do not show
    /// computed.
    fn not_stored(&self, replica: ReplicaIdx, computed: Computed<'_>) -> u64 {
        let r = &self.replicas[replica.get()];
        r.in_prefill.iter().filter_map(|id| self.bookings.get(id)).map(|b| b.uncomputed(computed)).sum()
    }

    /// The `latency` predicted for a request when it was booked, if its replica's model had
    /// learned enough.
    pub fn predicted(&self, id: &BookingId, latency: Latency) -> Option<Duration> {
        self.timed(id, latency)?.1
    }

    /// What booking `id`'s replica faced, for `latency`, when it was booked — the inputs its
    /// prediction was (or would have been) made from — and what was predicted from them;
    /// `None` unless it is timed.
    pub fn timed(&self, id: &BookingId, latency: Latency) -> Option<(Inputs, Option<Duration>)> {
        self.bookings.get(id)?.timed[latency]
    }

    /// The filter measured the request's `latency`, reported at `now`: its replica's model
    /// learns from it (once). Returns its replica and the check of the prediction made for
    /// it, with the replica's alarm, if there was one.
    pub fn measured(
        &mut self,
        id: &BookingId,
        latency: Latency,
        measured: Duration,
        now: Instant,
    ) -> Option<(ReplicaIdx, Watched)> {
        let b = self.bookings.get_mut(id)?;
        let (inputs, predicted) = b.timed[latency].take()?;
        let watched = self.replicas[b.replica.get()].latency[latency].measured(inputs, predicted, measured, now)?;
        Some((b.replica, watched))
    }

    /// A replica's model of `latency` and the watch over its predictions.
    pub fn predictor(&self, replica: ReplicaIdx, latency: Latency) -> &Predictor {
        &self.replicas[replica.get()].latency[latency]
    }

    /// Its bookkeeping: bookings held, and ends remembered that came before their booking.
    pub fn bookkeeping(&self) -> (usize, usize) {
        (self.bookings.len(), self.ended_early.len())
    }

    /// The replica a request is booked on, if it is.
    pub fn replica_of(&self, id: &BookingId) -> Option<ReplicaIdx> {
        self.bookings.get(id).map(|b| b.replica)
    }

    /// The request produced its first token, at `now`. A streamed request's time from booking
    /// to first token teaches its replica's prefill rate. Returns false if the id is unknown.
    pub fn prefill_done(&mut self, id: &BookingId, now: Instant) -> bool {
        let Some(b) = self.bookings.get_mut(id) else { return false };
        if !b.prefill_done {
            b.prefill_done = true;
            let r = &mut self.replicas[b.replica.get()];
            r.prefill_tokens -= b.prefill_tokens;
            r.prefilling -= b.sequences;
            r.in_prefill.remove(id);
            let secs = now.saturating_duration_since(b.booked_at).as_secs_f64();
            if b.prefill_ends_at.is_none() && b.prefill_tokens >= RATE_MIN_TOKENS && secs > 0.0 {
                let sample = b.prefill_tokens as f64 / secs;
                r.prefill_rate = Some(r.prefill_rate.map_or(sample, |old| old + RATE_WEIGHT * (sample - old)));
            }
        }
        true
    }

    /// The request ended: release everything it holds. Returns false if the id is unknown
    /// (it is then remembered, in case its booking is still on its way).
    pub fn finish(&mut self, id: &BookingId) -> bool {
        if self.release(id) {
            return true;
        }
        self.ended_early.insert(id);
        false
    }

    /// The request ran on another replica than the one it was booked on (Envoy retried it
    /// elsewhere, or its host was unhealthy and Envoy's fallback balancer picked): its load
    /// moves there, as it stands (prefill done or not, decode progress). Its prediction was for
    /// the first replica and is dropped. Returns the replica it left, the prompt's hashes and
    /// whether an unchecked prediction was dropped, or `None` if it is not booked or already
    /// there.
    pub fn move_booking(
        &mut self,
        id: &BookingId,
        to: ReplicaIdx,
        now: Instant,
    ) -> Option<(ReplicaIdx, Vec<SequenceHash>, bool)> {
        let mut b = self.bookings.remove(id)?;
        let from = b.replica;
        if from == to {
            self.bookings.insert(id.clone(), b);
            return None;
        }
        self.detach(id, &b);
        b.replica = to;
        // What was predicted and measured is about the replica it was booked on.
        b.timed = PerLatency::default();
        let dropped = b.prediction.take().is_some();
        let default_rate = self.default_prefill_rate;
        let r = &mut self.replicas[to.get()];
        if !b.prefill_done {
            r.add_backlog(b.prefill_tokens, now, default_rate);
            r.prefill_tokens += b.prefill_tokens;
            r.prefilling += b.sequences;
            r.in_prefill.insert(id.clone());
        }
        r.requests += b.sequences;
        r.private_blocks += b.private_blocks;
        r.output_blocks += b.output_blocks;
        r.discounted += b.discounted;
        r.shared_blocks.insert(&b.hashes);
        let hashes = b.hashes.clone();
        self.bookings.insert(id.clone(), b);
        Some((from, hashes, dropped))
    }

    /// A booking's replica, its prompt's hashes and all its prompt blocks.
    pub fn booked_prompt(&self, id: &BookingId) -> Option<(ReplicaIdx, Vec<SequenceHash>, u64)> {
        let b = self.bookings.get(id)?;
        Some((b.replica, b.hashes.clone(), b.hashes.len() as u64 + b.private_blocks))
    }

    /// A request booked without prefill (its prompt was to be computed by a prefill leg) is
    /// computing it where it is booked after all: `prefill_tokens` are added, unless its
    /// prefill is already over, and its prediction, made for a transfer, is dropped. Returns
    /// whether an unchecked prediction was dropped, or `None` if it is not booked.
    pub fn served_whole(&mut self, id: &BookingId, prefill_tokens: u64, now: Instant) -> Option<bool> {
        let b = self.bookings.get_mut(id)?;
        let dropped = b.prediction.take().is_some();
        if !b.prefill_done {
            b.prefill_tokens += prefill_tokens;
            let r = &mut self.replicas[b.replica.get()];
            r.add_backlog(prefill_tokens, now, self.default_prefill_rate);
            r.prefill_tokens += prefill_tokens;
            self.prefill_booked += prefill_tokens;
        }
        Some(dropped)
    }

    fn release(&mut self, id: &BookingId) -> bool {
        let Some(b) = self.bookings.remove(id) else { return false };
        self.blocks_booked -= b.hashes.len() as u64 + b.private_blocks;
        self.prefill_booked -= b.prefill_tokens;
        self.detach(id, &b);
        if let Some(flow) = b.flow {
            self.flows.remove(flow);
        }
        true
    }

    /// Takes a booking's load off its replica.
    fn detach(&mut self, id: &BookingId, b: &Booking) {
        let r = &mut self.replicas[b.replica.get()];
        if !b.prefill_done {
            r.prefill_tokens -= b.prefill_tokens;
            r.prefilling -= b.sequences;
            r.in_prefill.remove(id);
        }
        r.requests -= b.sequences;
        r.private_blocks -= b.private_blocks;
        r.output_blocks -= b.output_blocks;
        r.discounted -= b.discounted;
        r.shared_blocks.remove(&b.hashes);
    }

    /// Every booking as of `now`, for a peer that starts ([`BookingExport`]).
    pub fn export(&self, now: Instant) -> Vec<BookingExport> {
        self.bookings
            .iter()
            .map(|(id, b)| BookingExport {
                id: id.clone(),
                replica: b.replica,
                prefill_tokens: if b.prefill_done { 0 } else { b.prefill_tokens },
                hashes: b.hashes.clone(),
                total_blocks: b.hashes.len() as u64 + b.private_blocks,
                sequences: b.sequences,
                from_peer: b.from_peer,
                age: now.saturating_duration_since(b.booked_at),
            })
            .collect()
    }

    /// Releases bookings older than `max_age` (their end was never reported). Returns how
    /// many, and the replicas of those whose prediction was never checked.
    pub fn expire(&mut self, now: Instant, max_age: Duration) -> (usize, Vec<ReplicaIdx>) {
        let stale: Vec<BookingId> = self
            .bookings
            .iter()
            .filter(|(_, b)| now.saturating_duration_since(b.booked_at) > max_age)
            .map(|(id, _)| id.clone())
            .collect();
        let unchecked = stale.iter().filter_map(|id| self.take_prediction(id)).map(|(slot, _)| slot).collect();
        for id in &stale {
            self.release(id);
        }
        (stale.len(), unchecked)
    }
}

#[cfg(test)]
mod tests;
