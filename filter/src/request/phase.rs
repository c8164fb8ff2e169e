//! The phases of one request, each holding exactly the data it has by then, and the data
//! they share: the route a request's headers gave, the settings it runs under, what the
//! filter decided.

use std::time::Instant;

use kvgate_shared::codec;
use kvgate_shared::ids::{ModelName, RequestId};
use kvgate_shared::prompt::openai::Endpoint;
use kvgate_shared::route::RequestKeys;
use kvgate_shared::wire::{LifecycleEvent, LifecycleKind, PrefillLeg};

use crate::breaker::Ticket;
use crate::config::FilterConfig;
use crate::host::Host;
use crate::metrics::{FilterMetrics, Flag, LegOutcome, Outcome};
use crate::plan::{streamed_tokens, USAGE_TAIL_BYTES};
use crate::shared::Shared;
use crate::usage::UsageStripper;

use super::body::UpstreamBody;

/// Where a request is in its life (the transition table is in the module's README).
pub(super) enum Phase {
    /// Nothing seen yet.
    Headers,
    /// Not a request kvgate routes, or one without a body: it passes untouched and nothing
    /// is reported.
    Bypass,
    /// A JSON `POST` kvgate does not route (another path of the engine's, such as vLLM's
    /// `/invocations` or SGLang's `/generate`), whose body is buffered only to take a client's
    /// transfer fields out (the request is paused).
    Cleaning {
        /// The settings it runs under.
        settings: Box<Settings>,
        /// The body's size buffered so far.
        buffered: usize,
    },
    /// A routable request whose body is being buffered (the request is paused).
    Buffering {
        /// What its headers said.
        route: Box<Route>,
        /// The body's size buffered so far (a body followed by trailers never says it is
        /// over: the trailers do).
        buffered: usize,
    },
    /// The body is complete and the sidecar was asked: the request is paused until it
    /// answers (or the call times out).
    Asking(Box<Exchange>),
    /// vLLM disaggregation: the prefill leg was sent and the request is paused until it
    /// answers (or times out).
    Prefilling(Box<Exchange>),
    /// The request went on upstream (routed or not), or was answered here: its response
    /// passes.
    Responding(Box<Exchange>),
}

impl Phase {
    /// The exchange, once the body is complete.
    pub(super) fn exchange_mut(&mut self) -> Option<&mut Exchange> {
        match self {
            Phase::Asking(x) | Phase::Prefilling(x) | Phase::Responding(x) => Some(x),
            Phase::Headers | Phase::Bypass | Phase::Cleaning { .. } | Phase::Buffering { .. } => None,
        }
    }
}

/// The settings a request runs under, read from the VM's shared state once, at its headers
/// (the root context sets them when it is configured, before any request).
pub(super) struct Settings {
    /// The filter's configuration.
    pub(super) config: FilterConfig,
    /// Metric ids, if defined.
    pub(super) metrics: Option<FilterMetrics>,
    /// The lifecycle queue, if registered.
    pub(super) queue: Option<u32>,
}

impl Settings {
    /// The settings in `shared` now.
    pub(super) fn of(shared: &Shared) -> Settings {
        Settings { config: shared.config.clone(), metrics: shared.metrics.clone(), queue: shared.queue }
    }

    /// Whether a client's transfer fields are taken out of its bodies: unless the operator
    /// trusts its clients (and even then in a disaggregated deployment, all but the
    /// forwarded prompt's token ids).
    pub(super) fn cleans(&self) -> bool {
        !self.config.client_transfer_fields || self.config.prefill_cluster.is_some()
    }
}

/// A routable request as its headers described it.
pub(super) struct Route {
    /// The OpenAI endpoint.
    pub(super) endpoint: Endpoint,
    /// Its keys for the sidecar: the booking id the filter generated, the client's id,
    /// session, overrides, priority, tenant.
    pub(super) keys: RequestKeys,
    /// The request's `:path`, which a prefill leg is sent to as well.
    pub(super) path: String,
    /// The settings it runs under.
    pub(super) settings: Settings,
}

/// What the filter did with a request, for the debug headers.
#[derive(Debug, Default)]
pub(super) struct Decision {
    /// The sidecar's replica.
    pub(super) replica: Option<String>,
    /// The sidecar's choice, `ip:port`.
    pub(super) endpoint: Option<String>,
    /// Where the request ran, when Envoy sent it elsewhere (a retry, or its fallback balancer).
    pub(super) ran_on: Option<String>,
    /// The prompt's tokens, when tokenized here.
    pub(super) prompt_tokens: Option<u32>,
    /// The tokenized prompt's digest.
    pub(super) prompt_digest: Option<u64>,
    /// Blocks of the prompt the chosen replica has cached, as the sidecar predicts.
    pub(super) overlap_blocks: u32,
    /// From the complete body to the sidecar's answer.
    pub(super) micros: u128,
    /// Of which parsing, templating, tokenizing and hashing.
    pub(super) plan_micros: u128,
    /// Prompt pieces served by the segment cache.
    pub(super) segment_hits: u64,
    /// Only the prompt's head was tokenized.
    pub(super) truncated: bool,
    /// The body went to the sidecar to be tokenized there.
    pub(super) offloaded: bool,
    /// The prompt went to the engine as token ids.
    pub(super) forwarded: bool,
}

/// A routable request whose body is complete: what was decided, what was sent, and what is
/// still to be reported.
pub(super) struct Exchange {
    /// What its headers said, and its settings.
    pub(super) route: Box<Route>,
    /// When the body was complete: the decision's clock.
    pub(super) asked_at: Instant,
    /// The request body as it goes upstream.
    pub(super) body: UpstreamBody,
    /// The model the sidecar was asked about (so it may have booked load in that model's
    /// pool): its end is reported either way. `None`: nothing booked (passed through, not
    /// dispatched, or shed).
    pub(super) booked: Option<ModelName>,
    /// The model its metrics are tagged with: the body's, if the sidecar lists it (`None`:
    /// `other`).
    pub(super) metric_model: Option<ModelName>,
    /// The circuit breaker's leave for the call in flight, handed back with its answer.
    pub(super) ticket: Option<Ticket>,
    /// What was decided.
    pub(super) decision: Decision,
    /// In a disaggregated pool, the request's prefill leg.
    pub(super) leg: Option<Leg>,
    /// Set when the filter asked the engine for usage the client did not: the usage event
    /// is taken out of the stream.
    pub(super) stripper: Option<UsageStripper>,
    /// What the response has shown so far.
    pub(super) progress: Progress,
}

impl Exchange {
    /// The exchange of `route`, whose `body_len`-byte body was complete at `asked_at`.
    pub(super) fn new(route: Box<Route>, asked_at: Instant, body_len: usize) -> Exchange {
        Exchange {
            route,
            asked_at,
            body: UpstreamBody::new(body_len),
            booked: None,
            metric_model: None,
            ticket: None,
            decision: Decision::default(),
            leg: None,
            stripper: None,
            progress: Progress::default(),
        }
    }

    /// The request's configuration.
    pub(super) fn config(&self) -> &FilterConfig {
        &self.route.settings.config
    }

    /// The metric ids, if defined.
    pub(super) fn metrics(&self) -> Option<&FilterMetrics> {
        self.route.settings.metrics.as_ref()
    }

    /// The `model` tag of its metrics.
    pub(super) fn metric_model(&self) -> Option<&str> {
        self.metric_model.as_ref().map(ModelName::as_str)
    }

    /// Counts one of the request's flags (when metrics are on).
    pub(super) fn flag(&self, host: &impl Host, flag: Flag) {
        if let Some(m) = self.metrics() {
            m.flag(host, self.metric_model(), flag);
        }
    }

    /// Counts the request's outcome (when metrics are on), and leaves it for the access log.
    pub(super) fn count(&self, host: &impl Host, outcome: Outcome) {
        if let Err(status) = host.set_property("kvgate_outcome", outcome.label()) {
            log::debug!("kvgate: cannot set the property kvgate_outcome: {status:?}");
        }
        if let Some(m) = self.metrics() {
            m.outcome(host, self.metric_model(), outcome);
        }
    }

    /// Reports about the request's own booking.
    pub(super) fn report(&self, host: &impl Host, kind: LifecycleKind) {
        self.report_for(host, &self.route.keys.request_id, kind);
    }

    /// Reports about one booking of the request: its own, or its prefill leg's.
    pub(super) fn report_for(&self, host: &impl Host, booking_id: &RequestId, kind: LifecycleKind) {
        let Some(model) = self.booked.clone() else { return };
        let Some(queue) = self.route.settings.queue else { return };
        let event = LifecycleEvent { model, request_id: booking_id.clone(), kind };
        if let Ok(bytes) = codec::encode(&event) {
            if let Err(status) = host.enqueue(queue, &bytes) {
                log::warn!("kvgate: lifecycle report lost: {status:?}");
            }
        }
    }
}

/// A disaggregated request's prefill leg.
#[derive(Debug)]
pub(super) struct Leg {
    /// The id its load is booked under.
    pub(super) booking_id: RequestId,
    /// Its prefill worker.
    pub(super) replica: String,
    pub(super) sent_at: Instant,
    pub(super) state: LegState,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum LegState {
    /// Sent as call `token`. vLLM's is `awaited`: the request waits for its answer.
    Running { token: u32, awaited: bool },
    /// Over, this way.
    Over(LegOutcome),
}

impl Leg {
    /// The sidecar's leg, from now in `state`.
    pub(super) fn new(leg: PrefillLeg, state: LegState) -> Leg {
        Leg { booking_id: leg.booking_id, replica: leg.replica, sent_at: Instant::now(), state }
    }

    /// Whether it is still running.
    pub(super) fn running(&self) -> bool {
        matches!(self.state, LegState::Running { .. })
    }

    /// How it went, once over.
    pub(super) fn outcome(&self) -> Option<LegOutcome> {
        match self.state {
            LegState::Running { .. } => None,
            LegState::Over(outcome) => Some(outcome),
        }
    }
}

/// What the response has shown so far.
#[derive(Debug, Default)]
pub(super) struct Progress {
    /// The pool's block size (0: unknown, no decode progress).
    pub(super) block_size: u32,
    /// The response's status is a success (2xx): its first byte times the engine.
    pub(super) succeeded: bool,
    /// It is an event stream: its tokens come as they are produced.
    pub(super) streamed: bool,
    /// When its first and (so far) last body bytes came: the span its output was decoded in.
    pub(super) first_byte_at: Option<Instant>,
    pub(super) last_byte_at: Option<Instant>,
    /// Output tokens streamed so far.
    pub(super) output_tokens: u32,
    /// The response's last bytes, where the engine's `usage` is.
    pub(super) tail: Vec<u8>,
}

impl Progress {
    /// The mean time between its output tokens, in µs, once it is over: from the first body
    /// byte to the last over the `output_tokens` the engine reported, less one. `None` unless
    /// it was a successful stream of two tokens or more.
    pub(super) fn itl_us(&self, output_tokens: Option<u32>) -> Option<u64> {
        let gaps = output_tokens?.checked_sub(1).filter(|g| *g > 0)?;
        let span = self.last_byte_at?.saturating_duration_since(self.first_byte_at?);
        (self.succeeded && self.streamed)
            .then(|| u64::try_from(span.as_micros() / u128::from(gaps)).unwrap_or(u64::MAX))
    }

    /// Keeps the last [`USAGE_TAIL_BYTES`] of the response: from `chunk` when it was read
    /// whole already, else reading only that much of it.
    pub(super) fn keep_tail(&mut self, host: &impl Host, chunk_size: usize, chunk: Option<&[u8]>) {
        let take = chunk_size.min(USAGE_TAIL_BYTES);
        let read;
        let end = match chunk {
            Some(chunk) => &chunk[chunk.len().saturating_sub(take)..],
            None => {
                let Some(end) = host.response_body(chunk_size - take, take) else { return };
                read = end;
                &read
            }
        };
        self.tail.extend_from_slice(end);
        let excess = self.tail.len().saturating_sub(USAGE_TAIL_BYTES);
        self.tail.drain(..excess);
    }

    /// Counts a chunk's streamed tokens; the new total when it crosses a KV block boundary
    /// (reported once per block of output).
    pub(super) fn count(&mut self, chunk: Option<&[u8]>) -> Option<u32> {
        let before = self.output_tokens;
        self.output_tokens += chunk.map_or(0, streamed_tokens);
        (self.output_tokens / self.block_size > before / self.block_size).then_some(self.output_tokens)
    }
}
