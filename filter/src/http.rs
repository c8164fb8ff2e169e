//! The per-request context.
//!
//! 1. Request headers: strip any client-sent destination header (always, on every request);
//!    on a JSON `POST /v1/completions`, `/v1/chat/completions` or `/v1/responses`
//!    ([`crate::plan::routable`]), pause to buffer the body.
//! 2. Request body (complete): plan the route ([`crate::plan`]), call the sidecar, pause. A
//!    body above `offload_bytes` is not tokenized here: it goes whole to the sidecar's
//!    `/v1/route_body`, so a big prompt never stalls this worker thread.
//!    With `forward_tokens`, a completions string prompt is replaced by its token ids; with
//!    `forward_chat_tokens`, a chat carries them in `kv_transfer_params.prompt_token_ids`.
//! 3. Sidecar answer: set the destination header and resume. On *any* failure (bad body,
//!    sidecar down, timeout, bad answer) resume without it: Envoy's fallback LB routes.
//!    In a disaggregated pool the answer names a prefill leg too ([`crate::disagg`]): vLLM's
//!    is sent first and the request waits for it, then goes to its decode worker with the
//!    leg's `kv_transfer_params`; SGLang's is sent beside the request. A leg that cannot be
//!    sent, fails or times out leaves the request whole on its decode worker.
//! 4. Response: report the first body byte (prefill done) and the end of the exchange to the
//!    root context's lifecycle queue, with the engine's `usage` from the response's end. A
//!    streamed completion that did not ask for usage is made to (`request_usage`), and the
//!    extra event is taken out of what the client receives ([`crate::usage`]).

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use kvgate_shared::codec;
use kvgate_shared::prompt::openai::{envelope, Endpoint, Envelope};
use kvgate_shared::route::RequestKeys;
use kvgate_shared::wire::{
    LifecycleEvent, LifecycleKind, PrefillLeg, RouteResponse, Transfer, DESTINATION_HEADER, DP_RANK_HEADER,
    OVERRIDES_HEADER, SESSION_HEADER,
};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;

use crate::config::FilterConfig;
use crate::disagg;
use crate::host::{Envoy, Host};
use crate::metrics::{LegOutcome, Outcome};
use crate::plan::{
    booking_id, engine_usage, offload, parse_overrides, plan, routable, streamed_tokens, with_token_prompt, Skip,
    USAGE_TAIL_BYTES,
};
use crate::shared::Shared;
use crate::usage::{with_usage_requested, UsageStripper};

/// What the filter did with a request, for debug headers and lifecycle reports.
#[derive(Debug, Default)]
struct Decision {
    replica: Option<String>,
    /// The sidecar's choice, `ip:port`.
    endpoint: Option<String>,
    /// Where the request ran, when Envoy sent it elsewhere (a retry, or its fallback balancer).
    ran_on: Option<String>,
    prompt_tokens: Option<u32>,
    prompt_digest: Option<u64>,
    overlap_blocks: u32,
    micros: u128,
    /// Of which parsing, templating, tokenizing and hashing.
    plan_micros: u128,
    /// Prompt pieces served by the segment cache.
    segment_hits: u64,
    /// Only the prompt's head was tokenized.
    truncated: bool,
    /// The body went to the sidecar to be tokenized there.
    offloaded: bool,
    /// The prompt went to the engine as token ids.
    forwarded: bool,
}

/// A disaggregated request's prefill leg.
#[derive(Debug)]
struct Leg {
    /// The id its load is booked under.
    booking_id: String,
    /// Its prefill worker.
    replica: String,
    /// The call's token while it runs.
    token: Option<u32>,
    /// vLLM: the request waits for the leg's answer.
    awaited: bool,
    sent_at: Instant,
    /// How it went, once known.
    outcome: Option<LegOutcome>,
}

impl Leg {
    /// The sidecar's leg, sent as the call `token` (none: not sent).
    fn new(leg: PrefillLeg, token: Option<u32>, awaited: bool) -> Leg {
        Leg { booking_id: leg.booking_id, replica: leg.replica, token, awaited, sent_at: Instant::now(), outcome: None }
    }
}

/// The most bytes of a priority or tenant header passed on to the sidecar.
const MAX_KEY_BYTES: usize = 256;

/// One HTTP exchange, against its host (Envoy, or a fake in tests).
pub struct RequestContext<H: Host = Envoy> {
    host: H,
    shared: Rc<RefCell<Shared>>,
    context_id: u32,
    endpoint: Option<Endpoint>,
    hints: RequestKeys,
    /// The model the sidecar was asked about (so it may have booked load in that model's
    /// pool): report the end either way.
    booked: Option<String>,
    first_token_reported: bool,
    /// Decode progress: output tokens streamed so far, and the pool's block size.
    output_tokens: u32,
    /// The response's last bytes, where the engine's `usage` is.
    tail: Vec<u8>,
    block_size: u32,
    /// The request body's size buffered so far (a body followed by trailers never says it
    /// is over: the trailers do).
    buffered: usize,
    /// The request body's size as it goes upstream (token forwarding rewrites it).
    upstream_len: usize,
    /// Set when the filter asked the engine for usage the client did not: the usage event
    /// is taken out of the stream.
    stripper: Option<UsageStripper>,
    body_done_at: Option<Instant>,
    decision: Decision,
    /// The request's `:path`, which a prefill leg is sent to as well.
    path: String,
    /// In a disaggregated pool, the request's prefill leg.
    leg: Option<Leg>,
}

impl RequestContext<Envoy> {
    /// A context for a new stream in Envoy.
    pub fn new(shared: Rc<RefCell<Shared>>, context_id: u32) -> Self {
        RequestContext::with_host(Envoy, shared, context_id)
    }
}

impl<H: Host> RequestContext<H> {
    /// A context for a new stream on `host`.
    pub fn with_host(host: H, shared: Rc<RefCell<Shared>>, context_id: u32) -> Self {
        RequestContext {
            host,
            shared,
            context_id,
            endpoint: None,
            hints: RequestKeys::default(),
            booked: None,
            first_token_reported: false,
            output_tokens: 0,
            tail: Vec::new(),
            block_size: 0,
            buffered: 0,
            upstream_len: 0,
            stripper: None,
            body_done_at: None,
            decision: Decision::default(),
            path: String::new(),
            leg: None,
        }
    }

    fn request_header(&self, name: &str) -> Option<String> {
        self.host.request_header(name)
    }

    /// The value of a header the operator named in the configuration (none if unnamed), cut
    /// to [`MAX_KEY_BYTES`].
    fn configured_header(&self, name: impl Fn(&FilterConfig) -> Option<&str>) -> Option<String> {
        let name = name(&self.shared.borrow().config)?.to_owned();
        let mut value = self.request_header(&name)?;
        value.truncate(value.floor_char_boundary(MAX_KEY_BYTES));
        Some(value)
    }

    fn report(&self, kind: LifecycleKind) {
        self.report_for(&self.hints.request_id, kind);
    }

    /// Reports about one booking of the request: its own, or its prefill leg's.
    fn report_for(&self, booking_id: &str, kind: LifecycleKind) {
        let Some(model) = self.booked.clone() else { return };
        let Some(queue) = self.shared.borrow().queue else { return };
        let event = LifecycleEvent { model, request_id: booking_id.to_owned(), kind };
        if let Ok(bytes) = codec::encode(&event) {
            if let Err(status) = self.host.enqueue(queue, &bytes) {
                log::warn!("kvgate: lifecycle report lost: {status:?}");
            }
        }
    }

    /// Reports where a booked request really ran when that is not where the sidecar sent it
    /// (or the sidecar's answer did not arrive, and Envoy's balancer chose): the sidecar moves
    /// its booking there.
    fn check_upstream(&mut self) {
        if self.booked.is_none() {
            return;
        }
        let Some(upstream) = self.host.upstream_address() else { return };
        if self.decision.endpoint.as_deref() != Some(upstream.as_str()) {
            self.report(LifecycleKind::RanOn(upstream.clone()));
            self.decision.ran_on = Some(upstream);
        }
    }

    /// Keeps the last [`USAGE_TAIL_BYTES`] of the response: from `chunk` when it was read
    /// whole already, else reading only that much of it.
    fn keep_tail(&mut self, chunk_size: usize, chunk: Option<&[u8]>) {
        let take = chunk_size.min(USAGE_TAIL_BYTES);
        let read;
        let end = match chunk {
            Some(chunk) => &chunk[chunk.len().saturating_sub(take)..],
            None => {
                let Some(end) = self.host.response_body(chunk_size - take, take) else { return };
                read = end;
                &read
            }
        };
        self.tail.extend_from_slice(end);
        let excess = self.tail.len().saturating_sub(USAGE_TAIL_BYTES);
        self.tail.drain(..excess);
    }

    /// The whole body is buffered (its last chunk, or the trailers after it, came): ask the
    /// sidecar, keeping the request paused while it answers.
    fn route_body(&mut self) -> Action {
        let Some(endpoint) = self.endpoint else { return Action::Continue };
        self.body_done_at = Some(Instant::now());
        let mut body = self.host.request_body(self.buffered);
        self.upstream_len = body.len();
        // In a disaggregated deployment only kvgate says where an engine pulls KV from.
        if self.shared.borrow().config.prefill_cluster.is_some() {
            if let Some(clean) = disagg::without_transfer_fields(&body) {
                if self.replace_body(&clean) {
                    body = clean;
                }
            }
        }
        // One pass over the body, whatever its size: its model (all an offload reads) and
        // how it streams.
        let envelope = envelope(&body);
        self.booked = self.ask_sidecar(endpoint, &body, envelope.as_ref());
        let ask_usage = endpoint != Endpoint::Responses && self.shared.borrow().config.request_usage;
        if let (Some(envelope), Some(_), true) = (&envelope, &self.booked, ask_usage) {
            self.request_usage(&body, envelope);
        }
        if self.booked.is_some() {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    fn resume(&self) {
        if let Err(status) = self.host.resume() {
            log::warn!("kvgate: resume failed: {status:?}");
        }
    }

    /// Asks the sidecar; returns the model asked about if a call is in flight (the request
    /// stays paused).
    fn ask_sidecar(&mut self, endpoint: Endpoint, body: &[u8], envelope: Option<&Envelope<'_>>) -> Option<String> {
        if body.len() > self.shared.borrow().config.offload_bytes {
            return self.offload_to_sidecar(endpoint, body, envelope);
        }
        let planned = {
            let shared = self.shared.borrow();
            let stats = || {
                shared
                    .models
                    .values()
                    .filter_map(|m| m.tokenizer.segment_stats())
                    .fold((0, 0), |(h, m), s| (h + s.hits, m + s.misses))
            };
            let (started, before) = (Instant::now(), stats());
            let planned = plan(
                endpoint,
                body,
                &self.hints,
                &shared.models,
                shared.listed.as_ref(),
                shared.config.max_tokenize_bytes,
            );
            self.decision.plan_micros = started.elapsed().as_micros();
            let after = stats();
            self.decision.segment_hits = after.0 - before.0;
            if let (Ok(p), Some(m)) = (&planned, &shared.metrics) {
                m.planned(
                    &self.host,
                    self.decision.plan_micros as u64,
                    p.truncated,
                    after.0 - before.0,
                    after.1 - before.1,
                );
            }
            planned
        };
        let planned = match planned {
            Ok(p) => p,
            Err(Skip::Unroutable(why)) => return self.pass_through(&why),
        };
        if planned.tokenized {
            self.decision.prompt_tokens = Some(planned.request.prompt_tokens);
        }
        if let Some(why) = &planned.untokenizable {
            let client_id = self.hints.client_request_id.as_deref().unwrap_or("-");
            log::debug!("kvgate: routing request {client_id} on an estimate: {why}");
            if let Some(m) = &self.shared.borrow().metrics {
                m.untokenizable(&self.host);
            }
        }
        self.decision.truncated = planned.truncated;
        self.decision.prompt_digest = planned.digest;
        self.block_size = planned.request.block_size;
        let forwarding = match endpoint {
            Endpoint::Completions => self.shared.borrow().config.forward_tokens,
            Endpoint::ChatCompletions => self.shared.borrow().config.forward_chat_tokens,
            Endpoint::Responses => false,
        };
        if let Some(ids) = planned.forwardable.as_deref().filter(|_| forwarding) {
            self.forward_tokens(endpoint, body, ids);
        }
        let timeout = {
            let config = &self.shared.borrow().config;
            config.route_timeout_ms + config.admission_wait_ms
        };
        self.dispatch("/v1/route", &planned.request, timeout).then_some(planned.request.model)
    }

    /// Asks the engine for usage on a streamed request whose client did not, so its
    /// prediction can be checked: the body's opening brace gets `stream_options` in front of
    /// the other members, and the response's usage event will be taken out again.
    fn request_usage(&mut self, body: &[u8], envelope: &Envelope<'_>) {
        let Some((mut replaced, start)) = with_usage_requested(body, envelope) else { return };
        if self.decision.forwarded {
            // serde_json wrote the forwarded body: its `{` is its first byte.
            replaced = 1;
        }
        if let Err(status) = self.host.replace_request_body(replaced, &start) {
            log::warn!("kvgate: cannot ask for usage: {status:?}");
            return;
        }
        self.upstream_len = self.upstream_len - replaced + start.len();
        self.set_content_length();
        self.stripper = Some(UsageStripper::default());
    }

    /// The usage event is taken out of a successful event stream only: an error body is
    /// passed on untouched. A stream that is stripped loses its `content-length`, if it had
    /// one, since what the client receives is shorter.
    fn keep_stripping_if_streamed(&mut self) {
        let ok = self.host.response_header(":status").is_some_and(|s| s.starts_with('2'));
        let sse = self
            .host
            .response_header("content-type")
            .is_some_and(|ct| ct.trim_start().to_ascii_lowercase().starts_with("text/event-stream"));
        if !(ok && sse) {
            self.stripper = None;
            return;
        }
        if let Err(status) = self.host.remove_response_header("content-length") {
            log::warn!("kvgate: cannot drop content-length from a stream it shortens: {status:?}");
            self.stripper = None;
        }
    }

    /// Takes the usage event out of this response chunk ([`UsageStripper`]). If the host
    /// cannot read or write the chunk, stripping stops and what was held back is sent on.
    fn strip_usage(&mut self, body_size: usize, chunk: Option<&[u8]>, end_of_stream: bool) {
        let Some(stripper) = &mut self.stripper else { return };
        let sent = match (chunk, body_size) {
            (Some(chunk), _) => stripper.filter(chunk, end_of_stream),
            (None, 0) => stripper.filter(&[], end_of_stream),
            (None, _) => {
                log::warn!("kvgate: cannot read a response chunk; the stream is passed on as it is");
                let held = stripper.filter(&[], true).unwrap_or_default();
                self.stripper = None;
                if let Err(status) = self.host.replace_response_body(0, &held) {
                    log::warn!("kvgate: {} bytes of a stream lost: {status:?}", held.len());
                }
                return;
            }
        };
        if let Some(sent) = sent {
            if let Err(status) = self.host.replace_response_body(body_size, &sent) {
                log::warn!("kvgate: cannot take the usage event out of a stream; left as it is: {status:?}");
                self.stripper = None;
            }
        }
    }

    /// Updates `content-length`, if the request has one, to the body's size upstream.
    fn set_content_length(&self) {
        if self.request_header("content-length").is_some() {
            if let Err(status) = self.host.set_request_header("content-length", &self.upstream_len.to_string()) {
                log::warn!("kvgate: cannot update content-length after rewriting the body: {status:?}");
            }
        }
    }

    /// Token forwarding: the body carries its prompt as token ids ([`with_token_prompt`]). The
    /// body stays valid whatever the sidecar answers, so a failure here just leaves the text.
    fn forward_tokens(&mut self, endpoint: Endpoint, body: &[u8], ids: &[u32]) {
        let Some(forwarded) = with_token_prompt(endpoint, body, ids) else { return };
        if !self.replace_body(&forwarded) {
            return;
        }
        self.decision.forwarded = true;
        if let Some(m) = &self.shared.borrow().metrics {
            m.forwarded(&self.host);
        }
    }

    /// Hands a big body to the sidecar (`/v1/route_body`) instead of tokenizing it here.
    fn offload_to_sidecar(
        &mut self,
        endpoint: Endpoint,
        body: &[u8],
        envelope: Option<&Envelope<'_>>,
    ) -> Option<String> {
        let timeout = self.shared.borrow().config.offload_timeout_ms;
        let request = offload(endpoint, body, envelope, &self.hints, self.shared.borrow().listed.as_ref(), timeout);
        let (model, request) = match request {
            Ok(r) => r,
            Err(Skip::Unroutable(why)) => return self.pass_through(&why),
        };
        if let Some(m) = &self.shared.borrow().metrics {
            m.offloaded(&self.host);
        }
        self.decision.offloaded = true;
        let timeout = timeout + self.shared.borrow().config.admission_wait_ms;
        self.dispatch("/v1/route_body", &request, timeout).then_some(model)
    }

    /// Counts a request's outcome (when metrics are on).
    fn count(&self, outcome: Outcome) {
        if let Some(m) = &self.shared.borrow().metrics {
            m.outcome(&self.host, outcome);
        }
    }

    /// Leaves a request kvgate does not route to Envoy's own load balancer.
    fn pass_through(&self, why: &str) -> Option<String> {
        let client_id = self.hints.client_request_id.as_deref().unwrap_or("-");
        log::debug!("kvgate: not routing request {client_id}: {why}");
        self.count(Outcome::Passthrough);
        None
    }

    /// Calls the sidecar with an encoded `message`; true if the call is in flight.
    fn dispatch<T: serde::Serialize>(&mut self, path: &str, message: &T, timeout_ms: u64) -> bool {
        let Ok(encoded) = codec::encode(message) else {
            self.count(Outcome::FallbackError);
            return false;
        };
        let shared = self.shared.borrow();
        let (cluster, authority) = (&shared.config.sidecar_cluster, &shared.config.sidecar_authority);
        match self.host.dispatch(cluster, path, authority, &encoded, Duration::from_millis(timeout_ms)) {
            Ok(_) => true,
            Err(status) => {
                log::warn!("kvgate: sidecar call failed to dispatch: {status:?}");
                if let Some(m) = &shared.metrics {
                    m.outcome(&self.host, Outcome::FallbackError);
                }
                false
            }
        }
    }

    /// The sidecar shed the request (every replica saturated, its wait over): answer 429 with
    /// the sidecar's `Retry-After` and an OpenAI-style error, and book nothing. If the reply
    /// cannot be sent, the request goes on through Envoy's balancing instead.
    fn shed(&mut self) -> Outcome {
        let retry_after = self.host.call_header("retry-after").filter(|v| v.parse::<u32>().is_ok());
        let retry_after = retry_after.unwrap_or_else(|| "1".into());
        let model = self.booked.as_deref().unwrap_or_default();
        let error = serde_json::json!({"error": {
            "message": format!("every replica of model {model:?} is saturated; retry after {retry_after} s"),
            "type": "rate_limit_error",
            "param": null,
            "code": "rate_limit_exceeded",
        }});
        let headers = [("retry-after", retry_after.as_str()), ("content-type", "application/json")];
        match self.host.send_local_reply(429, &headers, error.to_string().as_bytes()) {
            Ok(()) => {
                self.booked = None;
                Outcome::Shed
            }
            Err(status) => {
                log::warn!("kvgate: cannot answer a shed request: {status:?}");
                Outcome::FallbackError
            }
        }
    }

    /// Sends a disaggregated request's prefill leg; a leg that cannot be sent leaves the
    /// request whole on its decode worker.
    fn start_leg(&mut self, leg: PrefillLeg) {
        match self.send_leg(&leg) {
            Ok((token, awaited)) => self.leg = Some(Leg::new(leg, Some(token), awaited)),
            Err(why) => {
                log::debug!("kvgate: prefill leg not sent, serving whole: {why}");
                self.drop_leg(Some(leg));
            }
        }
    }

    /// Sends the leg to its prefill worker (through `prefill_cluster`, whose `override_host`
    /// reads the destination header the filter sets on its own call); for SGLang, the
    /// request's body then carries the bootstrap room too. Returns the call's token and
    /// whether the request waits for its answer.
    fn send_leg(&mut self, leg: &PrefillLeg) -> Result<(u32, bool), String> {
        let (cluster, timeout) = {
            let config = &self.shared.borrow().config;
            let cluster = config.prefill_cluster.clone().ok_or("no prefill_cluster is configured")?;
            (cluster, Duration::from_millis(config.prefill_timeout_ms))
        };
        if self.endpoint == Some(Endpoint::Responses) {
            return Err("a Responses request has no prefill leg".into());
        }
        let body = self.host.request_body(self.upstream_len);
        let (leg_body, decode_body) = match &leg.transfer {
            Transfer::Vllm => (disagg::vllm_prefill(&body).map_err(|e| e.to_string())?, None),
            Transfer::Sglang { host, port, room } => {
                let (decode, prefill) = disagg::sglang(&body, host, *port, *room).map_err(|e| e.to_string())?;
                (prefill, Some(decode))
            }
        };
        let authority = self.request_header(":authority").unwrap_or_else(|| "kvgate".into());
        let rank = leg.dp_rank.map(|r| r.to_string());
        let passed: Vec<(&str, String)> = ["x-request-id", "authorization"]
            .into_iter()
            .filter_map(|name| Some((name, self.request_header(name)?)))
            .collect();
        let mut headers = vec![
            (":method", "POST"),
            (":path", self.path.as_str()),
            (":authority", authority.as_str()),
            ("content-type", "application/json"),
            (DESTINATION_HEADER, leg.endpoint.as_str()),
        ];
        headers.extend(rank.as_deref().map(|r| (DP_RANK_HEADER, r)));
        headers.extend(passed.iter().map(|(name, value)| (*name, value.as_str())));
        let token = self.host.call(&cluster, &headers, &leg_body, timeout).map_err(|s| format!("{s:?}"))?;
        if let Some(decode) = decode_body {
            if !self.replace_body(&decode) {
                log::warn!(
                    "kvgate: cannot add the bootstrap room to the decode request; its prefill leg will time out"
                );
            }
        }
        // vLLM's leg is awaited; SGLang's runs beside the request.
        Ok((token, matches!(leg.transfer, Transfer::Vllm)))
    }

    /// The prefill leg answered (or timed out): vLLM's request goes on to its decode worker
    /// with the leg's `kv_transfer_params`, or whole if the leg failed.
    fn leg_answered(&mut self, num_headers: usize, body_size: usize) {
        let Some(leg) = &mut self.leg else { return };
        leg.token = None;
        let awaited = std::mem::take(&mut leg.awaited);
        let booking_id = leg.booking_id.clone();
        let outcome = if num_headers == 0 {
            LegOutcome::Timeout
        } else if self.host.call_status().as_deref() != Some("200") {
            LegOutcome::Failed
        } else {
            let answer = self.host.call_body(body_size).unwrap_or_default();
            if let Some((prompt_tokens, cached_tokens)) = engine_usage(&answer) {
                self.report_for(&booking_id, LifecycleKind::Usage { prompt_tokens, cached_tokens });
            }
            match awaited {
                true => match disagg::vllm_decode(&self.host.request_body(self.upstream_len), &answer) {
                    Ok(decode) if self.replace_body(&decode) => LegOutcome::Ok,
                    Ok(_) => LegOutcome::Failed,
                    Err(e) => {
                        log::debug!("kvgate: prefill leg unusable, serving whole: {e}");
                        LegOutcome::Failed
                    }
                },
                false => LegOutcome::Ok,
            }
        };
        self.end_leg(outcome);
        if awaited {
            self.resume();
        }
    }

    /// The leg is over: its booking is released and its outcome counted.
    fn end_leg(&mut self, outcome: LegOutcome) {
        let Some(leg) = &mut self.leg else { return };
        leg.outcome = Some(outcome);
        let sent = (outcome != LegOutcome::Unsent).then(|| leg.sent_at.elapsed().as_micros() as u64);
        let booking_id = leg.booking_id.clone();
        self.report_for(&booking_id, LifecycleKind::Done);
        if outcome != LegOutcome::Ok {
            // The decode worker computes the prompt itself: its booking takes the prefill.
            self.report(LifecycleKind::ServedWhole);
        }
        if let Some(m) = &self.shared.borrow().metrics {
            m.leg(&self.host, outcome, sent);
        }
    }

    /// A leg the sidecar booked that will not be sent (the decision could not be applied, or
    /// the leg could not be built or dispatched): its booking is released.
    fn drop_leg(&mut self, leg: Option<PrefillLeg>) {
        let Some(leg) = leg else { return };
        self.leg = Some(Leg::new(leg, None, false));
        self.end_leg(LegOutcome::Unsent);
    }

    /// Replaces the whole request body as it goes upstream; false if the host refused.
    fn replace_body(&mut self, body: &[u8]) -> bool {
        if let Err(status) = self.host.replace_request_body(self.upstream_len, body) {
            log::warn!("kvgate: cannot rewrite the request body: {status:?}");
            return false;
        }
        self.upstream_len = body.len();
        self.set_content_length();
        true
    }

    fn apply_decision(&mut self, num_headers: usize, body_size: usize) -> Outcome {
        if num_headers == 0 {
            log::debug!("kvgate: sidecar timed out; falling back");
            return Outcome::FallbackTimeout;
        }
        let status = self.host.call_status();
        if status.as_deref() == Some("429") {
            return self.shed();
        }
        if status.as_deref() != Some("200") {
            log::debug!("kvgate: sidecar answered {status:?}; falling back");
            return Outcome::FallbackError;
        }
        let Some(body) = self.host.call_body(body_size) else {
            return Outcome::FallbackError;
        };
        let Ok(mut answer) = codec::decode::<RouteResponse>(&body) else {
            log::warn!("kvgate: undecodable sidecar answer; falling back");
            return Outcome::FallbackError;
        };
        let leg = answer.prefill.take();
        let Some(endpoint) = &answer.endpoint else {
            self.drop_leg(leg);
            return Outcome::FallbackError;
        };
        if let Some(rank) = answer.dp_rank {
            if let Err(status) = self.host.set_request_header(DP_RANK_HEADER, &rank.to_string()) {
                log::warn!("kvgate: cannot set {DP_RANK_HEADER}: {status:?}");
                self.drop_leg(leg);
                return Outcome::FallbackError;
            }
        }
        match self.host.set_request_header(DESTINATION_HEADER, endpoint) {
            Ok(()) => {
                self.decision.replica = answer.replica.clone();
                self.decision.endpoint = answer.endpoint.clone();
                self.decision.overlap_blocks = answer.overlap_blocks;
                if let Some(leg) = leg {
                    self.start_leg(leg);
                }
                Outcome::Routed
            }
            Err(status) => {
                log::warn!("kvgate: cannot set the destination header: {status:?}");
                self.drop_leg(leg);
                Outcome::FallbackError
            }
        }
    }
}

impl<H: Host> Context for RequestContext<H> {
    fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize, _trailers: usize) {
        if self.leg.as_ref().is_some_and(|l| l.token == Some(token)) {
            self.leg_answered(num_headers, body_size);
            return;
        }
        let outcome = self.apply_decision(num_headers, body_size);
        if let Some(t) = self.body_done_at {
            self.decision.micros = t.elapsed().as_micros();
        }
        if let Some(m) = &self.shared.borrow().metrics {
            m.outcome(&self.host, outcome);
            m.sidecar(&self.host, self.decision.micros.saturating_sub(self.decision.plan_micros) as u64);
        }
        let awaiting_leg = self.leg.as_ref().is_some_and(|l| l.awaited);
        if outcome != Outcome::Shed && !awaiting_leg {
            self.resume();
        }
    }
}

impl<H: Host> HttpContext for RequestContext<H> {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        // Never let a client pick the upstream (host or data-parallel rank), whatever happens next.
        for header in [DESTINATION_HEADER, DP_RANK_HEADER] {
            if let Err(status) = self.host.remove_request_header(header) {
                log::warn!("kvgate: cannot strip {header}: {status:?}");
            }
        }
        let method = self.request_header(":method");
        self.path = self.request_header(":path").unwrap_or_default();
        let content_type = self.request_header("content-type");
        self.endpoint = routable(method.as_deref(), &self.path, content_type.as_deref());
        if self.endpoint.is_none() || end_of_stream {
            self.endpoint = None;
            return Action::Continue;
        }
        let vm_tag = self.shared.borrow().vm_tag;
        self.hints = RequestKeys {
            request_id: booking_id(vm_tag, self.context_id),
            client_request_id: self.request_header("x-request-id"),
            session: self.request_header(SESSION_HEADER),
            overrides: parse_overrides(self.request_header(OVERRIDES_HEADER).as_deref()),
            wait_ms: u32::try_from(self.shared.borrow().config.admission_wait_ms).unwrap_or(u32::MAX),
            priority: self.configured_header(|c| c.priority_header.as_deref()),
            tenant: self.configured_header(|c| c.tenant_header.as_deref()),
            prefill_legs: self.shared.borrow().config.prefill_cluster.is_some()
                && self.endpoint != Some(Endpoint::Responses),
        };
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.endpoint.is_none() {
            return Action::Continue;
        }
        self.buffered = body_size;
        if !end_of_stream {
            return Action::Pause;
        }
        self.route_body()
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.endpoint.is_none() || self.body_done_at.is_some() {
            return Action::Continue;
        }
        self.route_body()
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        self.check_upstream();
        if let (Some(m), Some(_)) = (&self.shared.borrow().metrics, &self.booked) {
            // The request's own work (its body, its plan) is done: what it needed is in there.
            m.vm_memory(&self.host);
        }
        if self.stripper.is_some() {
            self.keep_stripping_if_streamed();
        }
        if self.endpoint.is_some() && self.shared.borrow().config.debug_headers {
            let d = &self.decision;
            let headers = [
                ("x-kvgate-routed-to", d.replica.clone().unwrap_or_else(|| "fallback".into())),
                ("x-kvgate-booking-id", self.hints.request_id.clone()),
                ("x-kvgate-ran-on", d.ran_on.clone().unwrap_or_default()),
                ("x-kvgate-prompt-tokens", d.prompt_tokens.map(|n| n.to_string()).unwrap_or_default()),
                ("x-kvgate-prompt-digest", d.prompt_digest.map(|n| format!("{n:016x}")).unwrap_or_default()),
                ("x-kvgate-overlap-blocks", d.overlap_blocks.to_string()),
                ("x-kvgate-decision-us", d.micros.to_string()),
                ("x-kvgate-tokenize-us", d.plan_micros.to_string()),
                ("x-kvgate-segment-hits", d.segment_hits.to_string()),
                ("x-kvgate-truncated", d.truncated.to_string()),
                ("x-kvgate-offloaded", d.offloaded.to_string()),
                ("x-kvgate-forwarded-tokens", d.forwarded.to_string()),
                ("x-kvgate-prefill-on", self.leg.as_ref().map(|l| l.replica.clone()).unwrap_or_default()),
                (
                    "x-kvgate-prefill-leg",
                    self.leg.as_ref().and_then(|l| l.outcome).map(LegOutcome::label).unwrap_or_default().into(),
                ),
            ];
            for (name, value) in headers {
                if let Err(status) = self.host.set_response_header(name, &value) {
                    log::debug!("kvgate: cannot set {name}: {status:?}");
                }
            }
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.booked.is_none() && self.stripper.is_none() {
            return Action::Continue;
        }
        // Decode progress and usage stripping read the whole chunk; the usage tail then comes
        // from it.
        let progress = self.block_size > 0 && self.shared.borrow().config.decode_progress;
        let whole = progress || self.stripper.is_some();
        let chunk = if whole && body_size > 0 { self.host.response_body(0, body_size) } else { None };
        if self.stripper.is_some() {
            self.strip_usage(body_size, chunk.as_deref(), end_of_stream);
        }
        if self.booked.is_none() || body_size == 0 {
            return Action::Continue;
        }
        if !self.first_token_reported {
            self.first_token_reported = true;
            self.report(LifecycleKind::FirstToken);
        }
        self.keep_tail(body_size, chunk.as_deref());
        if progress {
            let before = self.output_tokens;
            self.output_tokens += chunk.as_deref().map_or(0, streamed_tokens);
            // Once per KV block of output.
            if self.output_tokens / self.block_size > before / self.block_size {
                self.report(LifecycleKind::Progress(self.output_tokens));
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        // A leg still running when the exchange ends (its call is cancelled with it).
        if let Some(leg) = self.leg.as_ref().filter(|l| l.outcome.is_none()) {
            self.report_for(&leg.booking_id, LifecycleKind::Done);
        }
        if let Some((prompt_tokens, cached_tokens)) = engine_usage(&self.tail) {
            self.report(LifecycleKind::Usage { prompt_tokens, cached_tokens });
        }
        self.report(LifecycleKind::Done);
    }
}
