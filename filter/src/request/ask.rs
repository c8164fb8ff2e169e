//! Buffering → Asking: the whole body is buffered; plan the route ([`crate::plan`]) and ask
//! the sidecar — unless the circuit breaker is open ([`super::breaker`]): then nothing is
//! planned and the request goes to Envoy's balancer as it is, like an unroutable one. A body
//! above `offload_bytes`, or for a model this VM has no tokenizer for (`envoy_tokenizers`, or
//! not loaded yet), is not tokenized here: it goes whole to the sidecar's `/v1/route_body`,
//! so a big prompt never stalls the worker thread. With `forward_tokens`, a
//! completions string prompt is replaced by its token ids; with `forward_chat_tokens`, a chat
//! carries them in `kv_transfer_params.prompt_token_ids`.

use std::time::{Duration, Instant};

use kvgate_shared::codec;
use kvgate_shared::ids::ModelName;
use kvgate_shared::prompt::openai::{Endpoint, Envelope};

use crate::host::Host;
use crate::metrics::{Flag, Outcome};
use crate::plan::{offload, plan, with_token_prompt, Skip};
use crate::shared::Shared;
use crate::usage::{with_usage_requested, UsageStripper};

use super::body::{read, refuse, Uncleanable};
use super::phase::Exchange;

/// Whether the sidecar tokenizes this request because this VM has no tokenizer for its
/// model: one the sidecar routes (its list is known) but `envoy_tokenizers` leaves out, or
/// whose tokenizer has not loaded yet.
fn tokenized_by_sidecar(shared: &Shared, envelope: Option<&Envelope<'_>>) -> bool {
    let Some(model) = envelope.map(|e| e.model.as_ref()) else { return false };
    shared.listed.as_ref().is_some_and(|l| l.contains(model)) && !shared.models.contains_key(model)
}

/// The client was answered here: the request goes no further.
pub(super) struct Answered;

/// What became of the call to the sidecar.
pub(super) enum Asked {
    /// In flight, about this model.
    InFlight(ModelName),
    /// Not made: kvgate does not route this request.
    Unroutable,
    /// Not made: the call could not be encoded or dispatched.
    NotSent,
}

/// The W3C trace-context headers a call to the sidecar (or a prefill leg) carries from its
/// request.
pub(super) const TRACE_HEADERS: [&str; 2] = ["traceparent", "tracestate"];

impl Exchange {
    /// Asks the sidecar about `body` (the whole body, as the client sent it), with the
    /// models and model list in `shared`, if its circuit breaker lets the request. Sets
    /// [`Exchange::booked`] if a call is in flight. An error if the client was answered here
    /// instead: its body may carry transfer fields that could not be taken out.
    pub(super) fn ask(&mut self, host: &impl Host, shared: &mut Shared, mut body: Vec<u8>) -> Result<(), Answered> {
        // One pass over the body, whatever its size: its model (all an offload reads and
        // what its metrics are tagged with), how it streams, and whether it names a transfer
        // field.
        let (mut envelope, may_carry) = read(&body);
        let listed = |m: &&str| shared.listed.as_ref().is_some_and(|l| l.contains(*m));
        self.metric_model = envelope.as_ref().map(|e| e.model.as_ref()).filter(listed).map(ModelName::from);
        // The engine runs the prompt routed on, and pulls KV only from where kvgate says: a
        // client's transfer fields go, unless the operator trusts its clients (and even then,
        // in a disaggregated deployment, all but the prompt's token ids).
        let (trusted, disaggregated) = (self.config().client_transfer_fields, self.config().prefill_cluster.is_some());
        if !trusted || disaggregated {
            match self.body.clean(host, &body, may_carry, trusted) {
                Ok(None) => {}
                Ok(Some(clean)) => {
                    body = clean;
                    envelope = read(&body).0;
                }
                Err(why) => return Err(self.refuse(host, &why)),
            }
        }
        let offload = body.len() > self.config().offload_bytes || tokenized_by_sidecar(shared, envelope.as_ref());
        let Some(ticket) = self.admit(host, &mut shared.breaker, body.len()) else { return Ok(()) };
        let asked = match offload {
            true => self.offload_to_sidecar(host, shared, &body, envelope.as_ref()),
            false => self.ask_sidecar(host, shared, &body),
        };
        self.booked = self.asked(host, &mut shared.breaker, ticket, asked);
        let ask_usage = !self.route.endpoint.is_converted() && self.config().request_usage;
        if let (Some(envelope), Some(_), true) = (&envelope, &self.booked, ask_usage) {
            self.request_usage(host, &body, envelope);
        }
        Ok(())
    }

    /// Answers 400: the body may carry transfer fields (which only kvgate may set) and they
    /// could not be taken out. Without the filter's reading of the body, the engine's would
    /// decide where it pulls KV from.
    fn refuse(&self, host: &impl Host, why: &Uncleanable) -> Answered {
        refuse(host, why);
        self.count(host, Outcome::Refused);
        Answered
    }

    /// How long the sidecar may take to decide about a `body_len`-byte body: a big one it
    /// must tokenize first; a small one, wherever it is tokenized, takes no longer to tokenize
    /// than to route, and a sick sidecar must not hold it longer.
    fn decide_timeout_ms(&self, body_len: usize) -> u64 {
        let config = self.config();
        if body_len > config.offload_bytes {
            config.offload_timeout_ms
        } else {
            config.route_timeout_ms
        }
    }

    /// How long the call about a `body_len`-byte body may take: the sidecar's time to decide
    /// and the admission wait.
    pub(super) fn call_timeout_ms(&self, body_len: usize) -> u64 {
        self.decide_timeout_ms(body_len) + self.config().admission_wait_ms
    }

    /// Plans the request here (tokenizing it) and asks the sidecar.
    fn ask_sidecar(&mut self, host: &impl Host, shared: &Shared, body: &[u8]) -> Asked {
        let endpoint = self.route.endpoint;
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
            &self.route.keys,
            &shared.models,
            shared.listed.as_ref(),
            self.config().max_tokenize_bytes,
        );
        self.decision.plan_micros = started.elapsed().as_micros();
        let after = stats();
        self.decision.segment_hits = after.0 - before.0;
        if let (Ok(p), Some(m)) = (&planned, self.metrics()) {
            m.planned(host, self.decision.plan_micros as u64, after.0 - before.0, after.1 - before.1);
            if p.truncated {
                self.flag(host, Flag::Truncated);
            }
        }
        let planned = match planned {
            Ok(p) => p,
            Err(Skip::Unroutable(why)) => return self.pass_through(host, &why),
        };
        if planned.tokenized {
            self.decision.prompt_tokens = Some(planned.request.prompt_tokens);
        }
        if let Some(why) = &planned.untokenizable {
            let client_id = self.route.keys.client_request_id.as_deref().unwrap_or("-");
            log::debug!("kvgate: routing request {client_id} on an estimate: {why}");
            self.flag(host, Flag::Untokenizable);
        }
        self.decision.truncated = planned.truncated;
        self.decision.prompt_digest = planned.digest;
        self.progress.block_size = planned.request.block_size;
        let forwarding = match endpoint {
            Endpoint::Completions => self.config().forward_tokens,
            Endpoint::ChatCompletions => self.config().forward_chat_tokens,
            Endpoint::Responses | Endpoint::Messages => false,
        };
        if let Some(ids) = planned.forwardable.as_deref().filter(|_| forwarding) {
            self.forward_tokens(host, body, ids);
        }
        let timeout = self.call_timeout_ms(body.len());
        match self.dispatch(host, "/v1/route", &planned.request, timeout) {
            true => Asked::InFlight(planned.request.model),
            false => Asked::NotSent,
        }
    }

    /// Asks the engine for usage on a streamed request whose client did not, so its
    /// prediction can be checked: the body's opening brace gets `stream_options` in front of
    /// the other members, and the response's usage event will be taken out again.
    fn request_usage(&mut self, host: &impl Host, body: &[u8], envelope: &Envelope<'_>) {
        let Some((mut replaced, start)) = with_usage_requested(body, envelope) else { return };
        if self.decision.forwarded {
            // serde_json wrote the forwarded body: its `{` is its first byte.
            replaced = 1;
        }
        if let Err(status) = self.body.splice(host, replaced, &start) {
            log::warn!("kvgate: cannot ask for usage: {status:?}");
            return;
        }
        self.stripper = Some(UsageStripper::default());
    }

    /// Token forwarding: the body carries its prompt as token ids ([`with_token_prompt`]). The
    /// body stays valid whatever the sidecar answers, so a failure here just leaves the text.
    fn forward_tokens(&mut self, host: &impl Host, body: &[u8], ids: &[u32]) {
        let Some(forwarded) = with_token_prompt(self.route.endpoint, body, ids) else { return };
        if !self.body.replace(host, &forwarded) {
            return;
        }
        self.decision.forwarded = true;
        self.flag(host, Flag::TokensForwarded);
    }

    /// Hands a body to the sidecar (`/v1/route_body`) instead of tokenizing it here.
    fn offload_to_sidecar(
        &mut self,
        host: &impl Host,
        shared: &Shared,
        body: &[u8],
        envelope: Option<&Envelope<'_>>,
    ) -> Asked {
        let budget = self.decide_timeout_ms(body.len());
        let request = offload(self.route.endpoint, body, envelope, &self.route.keys, shared.listed.as_ref(), budget);
        let (model, request) = match request {
            Ok(r) => r,
            Err(Skip::Unroutable(why)) => return self.pass_through(host, &why),
        };
        self.flag(host, Flag::Offloaded);
        self.decision.offloaded = true;
        let timeout = self.call_timeout_ms(body.len());
        match self.dispatch(host, "/v1/route_body", &request, timeout) {
            true => Asked::InFlight(model),
            false => Asked::NotSent,
        }
    }

    /// Leaves a request kvgate does not route to Envoy's own load balancer.
    fn pass_through(&self, host: &impl Host, why: &str) -> Asked {
        let client_id = self.route.keys.client_request_id.as_deref().unwrap_or("-");
        log::debug!("kvgate: not routing request {client_id}: {why}");
        self.count(host, Outcome::Passthrough);
        Asked::Unroutable
    }

    /// Calls the sidecar with an encoded `message`; true if the call is in flight.
    fn dispatch<T: serde::Serialize>(&self, host: &impl Host, path: &str, message: &T, timeout_ms: u64) -> bool {
        let Ok(encoded) = codec::encode(message) else {
            self.count(host, Outcome::FallbackError);
            return false;
        };
        let config = self.config();
        let (cluster, authority) = (&config.sidecar_cluster, &config.sidecar_authority);
        // The request's W3C trace context, so that the sidecar's log lines (and spans) about it
        // join its trace.
        let trace: Vec<(&str, String)> =
            TRACE_HEADERS.iter().filter_map(|h| Some((*h, host.request_header(h)?))).collect();
        let trace: Vec<(&str, &str)> = trace.iter().map(|(h, v)| (*h, v.as_str())).collect();
        match host.dispatch(cluster, path, authority, &trace, &encoded, Duration::from_millis(timeout_ms)) {
            Ok(_) => true,
            Err(status) => {
                log::warn!("kvgate: sidecar call failed to dispatch: {status:?}");
                self.count(host, Outcome::FallbackError);
                false
            }
        }
    }
}
