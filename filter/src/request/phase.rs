//! The phases of one request, each holding exactly the data it has by then, and the data
//! they share: the route a request's headers gave, the settings it runs under, what the
//! filter decided.

use std::time::Instant;

use kvgate_shared::codec;
use kvgate_shared::prompt::openai::Endpoint;
use kvgate_shared::route::RequestKeys;
use kvgate_shared::wire::{LifecycleEvent, LifecycleKind};

use crate::config::FilterConfig;
use crate::host::Host;
use crate::metrics::{FilterMetrics, Outcome};
use crate::shared::Shared;
use crate::usage::UsageStripper;

use super::body::UpstreamBody;
use super::leg::Leg;
use super::response::Progress;

/// Where a request is in its life (the transition table is in the module's README).
pub(super) enum Phase {
    /// Nothing seen yet.
    Headers,
    /// Not a request kvgate routes, or one without a body: it passes untouched and nothing
    /// is reported.
    Bypass,
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
            Phase::Headers | Phase::Bypass | Phase::Buffering { .. } => None,
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
        Settings { config: shared.config.clone(), metrics: shared.metrics, queue: shared.queue }
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
    pub(super) booked: Option<String>,
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

    /// Counts the request's outcome (when metrics are on).
    pub(super) fn count(&self, host: &impl Host, outcome: Outcome) {
        if let Some(m) = self.metrics() {
            m.outcome(host, outcome);
        }
    }

    /// Reports about the request's own booking.
    pub(super) fn report(&self, host: &impl Host, kind: LifecycleKind) {
        self.report_for(host, &self.route.keys.request_id, kind);
    }

    /// Reports about one booking of the request: its own, or its prefill leg's.
    pub(super) fn report_for(&self, host: &impl Host, booking_id: &str, kind: LifecycleKind) {
        let Some(model) = self.booked.clone() else { return };
        let Some(queue) = self.route.settings.queue else { return };
        let event = LifecycleEvent { model, request_id: booking_id.to_owned(), kind };
        if let Ok(bytes) = codec::encode(&event) {
            if let Err(status) = host.enqueue(queue, &bytes) {
                log::warn!("kvgate: lifecycle report lost: {status:?}");
            }
        }
    }
}
