#![doc = include_str!("README.md")]

mod answer;
mod ask;
mod body;
mod breaker;
mod leg;
mod phase;
mod response;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

use kvgate_shared::route::RequestKeys;
use kvgate_shared::wire::{DESTINATION_HEADER, DP_RANK_HEADER, OVERRIDES_HEADER};

use crate::host::Host;
use crate::metrics::Outcome;
use crate::plan::{booking_id, parse_overrides, read_as_json, routable};
use crate::shared::Shared;

use body::{read, refuse, UpstreamBody};
use phase::{Decision, Exchange, Phase, Route, Settings};

/// What the host is to do with the request (or response) after a callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Let it go on.
    Continue,
    /// Hold it (buffering its body) until the filter resumes it.
    Pause,
}

/// The most bytes of a priority or tenant header passed on to the sidecar.
const MAX_KEY_BYTES: usize = 256;

/// One HTTP exchange through the filter, against its host (Envoy, or a fake in tests).
pub struct Request<H: Host> {
    host: H,
    shared: Rc<RefCell<Shared>>,
    context_id: u32,
    phase: Phase,
}

impl<H: Host> Request<H> {
    /// The request of stream `context_id` on `host`, in the VM whose state is `shared`.
    pub fn new(host: H, shared: Rc<RefCell<Shared>>, context_id: u32) -> Self {
        Request { host, shared, context_id, phase: Phase::Headers }
    }

    /// The request headers came (`end_of_stream`: there is no body). Strips any client-sent
    /// destination header, always; pauses a routable request to buffer its body.
    pub fn on_request_headers(&mut self, end_of_stream: bool) -> Action {
        // Never let a client pick the upstream (host or data-parallel rank), whatever happens next.
        for header in [DESTINATION_HEADER, DP_RANK_HEADER] {
            if let Err(status) = self.host.remove_request_header(header) {
                log::warn!("kvgate: cannot strip {header}: {status:?}");
            }
        }
        let method = self.host.request_header(":method");
        let path = self.host.request_header(":path").unwrap_or_default();
        let content_type = self.host.request_header("content-type");
        let endpoint = routable(method.as_deref(), &path, content_type.as_deref());
        let (settings, vm_tag) = {
            let shared = self.shared.borrow();
            (Settings::of(&shared), shared.vm_tag)
        };
        let Some(endpoint) = endpoint.filter(|_| !end_of_stream) else {
            // Another JSON `POST` still has its body cleaned: the engine may read it as a
            // request too.
            let json_post = method.as_deref() == Some("POST") && read_as_json(content_type.as_deref());
            if json_post && !end_of_stream && settings.cleans() {
                self.phase = Phase::Cleaning { settings: Box::new(settings), buffered: 0 };
                return Action::Pause;
            }
            self.phase = Phase::Bypass;
            return Action::Continue;
        };
        let config = &settings.config;
        let keys = RequestKeys {
            request_id: booking_id(vm_tag, self.context_id),
            client_request_id: self.host.request_header("x-request-id"),
            session: self.configured_header(Some(&config.session_header)),
            overrides: parse_overrides(self.host.request_header(OVERRIDES_HEADER).as_deref()),
            wait_ms: u32::try_from(config.admission_wait_ms).unwrap_or(u32::MAX),
            priority: self.configured_header(config.priority_header.as_deref()),
            tenant: self.configured_header(config.tenant_header.as_deref()),
            ttft_slo_ms: self.configured_header(config.ttft_slo_header.as_deref()).and_then(|v| v.trim().parse().ok()),
            itl_slo_ms: self.configured_header(config.itl_slo_header.as_deref()).and_then(|v| v.trim().parse().ok()),
            prefill_legs: config.prefill_cluster.is_some() && !endpoint.is_converted(),
        };
        self.phase = Phase::Buffering { route: Box::new(Route { endpoint, keys, path, settings }), buffered: 0 };
        Action::Pause
    }

    /// `body_size` bytes of the request body are buffered (`end_of_stream`: all of it).
    pub fn on_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let (Phase::Buffering { buffered, .. } | Phase::Cleaning { buffered, .. }) = &mut self.phase else {
            return Action::Continue;
        };
        *buffered = body_size;
        if !end_of_stream {
            return Action::Pause;
        }
        self.body_complete()
    }

    /// The request trailers came: the body, if still buffering, is complete.
    pub fn on_request_trailers(&mut self) -> Action {
        match self.phase {
            Phase::Buffering { .. } | Phase::Cleaning { .. } => self.body_complete(),
            _ => Action::Continue,
        }
    }

    /// The answer to call `token` came (`num_headers` 0: the call timed out): the sidecar's,
    /// or the prefill leg's.
    pub fn on_call_response(&mut self, token: u32, num_headers: usize, body_size: usize) {
        match &mut self.phase {
            Phase::Asking(x) => {
                let outcome = x.sidecar_answered(&self.host, num_headers, body_size);
                let status = if num_headers == 0 { None } else { self.host.call_status() };
                x.sidecar_verdict(&self.host, &mut self.shared.borrow_mut().breaker, status.as_deref());
                if x.awaits_leg() {
                    self.enter(Phase::Prefilling);
                } else {
                    self.enter(Phase::Responding);
                    if outcome != Outcome::Shed {
                        self.resume();
                    }
                }
            }
            Phase::Prefilling(x) | Phase::Responding(x) if x.leg_token() == Some(token) => {
                let awaited = x.leg_answered(&self.host, num_headers, body_size);
                if awaited {
                    self.enter(Phase::Responding);
                    self.resume();
                }
            }
            _ => {}
        }
    }

    /// The response headers came.
    pub fn on_response_headers(&mut self) -> Action {
        match &mut self.phase {
            Phase::Headers | Phase::Bypass | Phase::Cleaning { .. } => {}
            Phase::Buffering { route, .. } => response::debug_headers(&self.host, route, &Decision::default(), None),
            Phase::Asking(x) | Phase::Prefilling(x) | Phase::Responding(x) => x.on_response_headers(&self.host),
        }
        Action::Continue
    }

    /// A response body chunk of `body_size` bytes came (`end_of_stream`: the last).
    pub fn on_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if let Some(x) = self.phase.exchange_mut() {
            x.on_response_body(&self.host, body_size, end_of_stream);
        }
        Action::Continue
    }

    /// The exchange is over.
    pub fn on_log(&mut self) {
        if let Some(x) = self.phase.exchange_mut() {
            x.on_log(&self.host);
        }
    }

    /// The whole body is buffered (its last chunk, or the trailers after it, came): ask the
    /// sidecar, keeping the request paused while it answers.
    fn body_complete(&mut self) -> Action {
        let (route, buffered) = match std::mem::replace(&mut self.phase, Phase::Bypass) {
            Phase::Buffering { route, buffered } => (route, buffered),
            Phase::Cleaning { settings, buffered } => return self.cleaned(&settings, buffered),
            _ => return Action::Continue,
        };
        let asked_at = Instant::now();
        let body = self.host.request_body(buffered);
        let mut x = Box::new(Exchange::new(route, asked_at, body.len()));
        if x.ask(&self.host, &mut self.shared.borrow_mut(), body).is_err() {
            // Answered here: the request stays paused, and its local reply goes out.
            self.phase = Phase::Responding(x);
            return Action::Pause;
        }
        if x.booked.is_some() {
            self.phase = Phase::Asking(x);
            Action::Pause
        } else {
            self.phase = Phase::Responding(x);
            Action::Continue
        }
    }

    /// A body buffered only to be cleaned is complete: the request goes on without a client's
    /// transfer fields, or is answered 400 if they cannot be taken out. Nothing is reported.
    fn cleaned(&mut self, settings: &Settings, buffered: usize) -> Action {
        let body = self.host.request_body(buffered);
        let (_, may_carry) = read(&body);
        let keep_ids = settings.config.client_transfer_fields;
        let Err(why) = UpstreamBody::new(body.len()).clean(&self.host, &body, may_carry, keep_ids) else {
            return Action::Continue;
        };
        refuse(&self.host, &why);
        if let Some(m) = &settings.metrics {
            m.outcome(&self.host, None, Outcome::Refused);
        }
        Action::Pause
    }

    /// Moves the exchange on to the phase `next` makes of it.
    fn enter(&mut self, next: fn(Box<Exchange>) -> Phase) {
        self.phase = match std::mem::replace(&mut self.phase, Phase::Bypass) {
            Phase::Asking(x) | Phase::Prefilling(x) | Phase::Responding(x) => next(x),
            other => other,
        };
    }

    fn resume(&self) {
        if let Err(status) = self.host.resume() {
            log::warn!("kvgate: resume failed: {status:?}");
        }
    }

    /// The value of a header the operator named in the configuration (none if unnamed), cut
    /// to [`MAX_KEY_BYTES`].
    fn configured_header(&self, name: Option<&str>) -> Option<String> {
        let mut value = self.host.request_header(name?)?;
        value.truncate(value.floor_char_boundary(MAX_KEY_BYTES));
        Some(value)
    }
}
