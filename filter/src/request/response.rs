//! The response, whatever phase the request is in when it comes: where the request really
//! ran, the debug headers, the first body byte (prefill done), decode progress, the engine's
//! `usage` (kept from the response's end; taken out of a stream whose client did not ask for
//! it, [`crate::usage`]), and the end of the exchange. Reports go to the root context's
//! lifecycle queue.

use std::time::Instant;

use kvgate_shared::wire::LifecycleKind;

use crate::host::Host;
use crate::metrics::LegOutcome;
use crate::plan::{engine_usage, output_tokens};

use super::phase::{Decision, Exchange, Leg, Route};

impl Exchange {
    /// The response headers came.
    pub(super) fn on_response_headers(&mut self, host: &impl Host) {
        self.check_upstream(host);
        self.progress.succeeded = host.response_header(":status").is_some_and(|s| s.starts_with('2'));
        self.progress.streamed = host
            .response_header("content-type")
            .is_some_and(|ct| ct.trim_start().to_ascii_lowercase().starts_with("text/event-stream"));
        if let (Some(m), Some(_)) = (self.metrics(), &self.booked) {
            // The request's own work (its body, its plan) is done: what it needed is in there.
            m.vm_memory(host);
        }
        if self.stripper.is_some() {
            self.keep_stripping_if_streamed(host);
        }
        debug_headers(host, &self.route, &self.decision, self.leg.as_ref());
        access_log_fields(host, &self.route, &self.decision, self.leg.as_ref());
    }

    /// A response body chunk of `body_size` bytes came.
    pub(super) fn on_response_body(&mut self, host: &impl Host, body_size: usize, end_of_stream: bool) {
        if self.booked.is_none() && self.stripper.is_none() {
            return;
        }
        // Decode progress and usage stripping read the whole chunk; the usage tail then comes
        // from it.
        let progress = self.progress.block_size > 0 && self.config().decode_progress;
        let whole = progress || self.stripper.is_some();
        let chunk = if whole && body_size > 0 { host.response_body(0, body_size) } else { None };
        if self.stripper.is_some() {
            self.strip_usage(host, body_size, chunk.as_deref(), end_of_stream);
        }
        if self.booked.is_none() || body_size == 0 {
            return;
        }
        let now = Instant::now();
        self.progress.last_byte_at = Some(now);
        if self.progress.first_byte_at.is_none() {
            self.progress.first_byte_at = Some(now);
            // From the sidecar's answer (the request left for the engine) to this byte; an
            // error's first byte times nothing.
            let ttft = now.duration_since(self.asked_at).as_micros().saturating_sub(self.decision.micros);
            let ttft_us = self.progress.succeeded.then(|| u64::try_from(ttft).unwrap_or(u64::MAX));
            self.report(host, LifecycleKind::FirstToken { ttft_us });
        }
        self.progress.keep_tail(host, body_size, chunk.as_deref());
        if progress {
            if let Some(tokens) = self.progress.count(chunk.as_deref()) {
                self.report(host, LifecycleKind::Progress(tokens));
            }
        }
    }

    /// The exchange is over: the engine's usage and the end are reported, and a leg still
    /// running (its call is cancelled with the exchange) is released.
    pub(super) fn on_log(&self, host: &impl Host) {
        if let Some(leg) = self.leg.as_ref().filter(|l| l.running()) {
            self.report_for(host, &leg.booking_id, LifecycleKind::Done);
        }
        if let Some((prompt_tokens, cached_tokens)) = engine_usage(&self.progress.tail) {
            self.report(host, LifecycleKind::Usage { prompt_tokens, cached_tokens });
        }
        if let Some(itl_us) = self.progress.itl_us(output_tokens(&self.progress.tail)) {
            self.report(host, LifecycleKind::Decoded { itl_us });
        }
        self.report(host, LifecycleKind::Done);
    }

    /// Reports where a booked request really ran when that is not where the sidecar sent it
    /// (or the sidecar's answer did not arrive, and Envoy's balancer chose): the sidecar moves
    /// its booking there.
    fn check_upstream(&mut self, host: &impl Host) {
        if self.booked.is_none() {
            return;
        }
        let Some(upstream) = host.upstream_address() else { return };
        if self.decision.endpoint.as_deref() != Some(upstream.as_str()) {
            self.report(host, LifecycleKind::RanOn(upstream.clone()));
            self.decision.ran_on = Some(upstream);
        }
    }

    /// The usage event is taken out of a successful event stream only: an error body is
    /// passed on untouched. A stream that is stripped loses its `content-length`, if it had
    /// one, since what the client receives is shorter.
    fn keep_stripping_if_streamed(&mut self, host: &impl Host) {
        if !(self.progress.succeeded && self.progress.streamed) {
            self.stripper = None;
            return;
        }
        if let Err(status) = host.remove_response_header("content-length") {
            log::warn!("kvgate: cannot drop content-length from a stream it shortens: {status:?}");
            self.stripper = None;
        }
    }

    /// Takes the usage event out of this response chunk ([`crate::usage::UsageStripper`]).
    /// If the host cannot read or write the chunk, stripping stops and what was held back is
    /// sent on.
    fn strip_usage(&mut self, host: &impl Host, body_size: usize, chunk: Option<&[u8]>, end_of_stream: bool) {
        let Some(stripper) = &mut self.stripper else { return };
        let sent = match (chunk, body_size) {
            (Some(chunk), _) => stripper.filter(chunk, end_of_stream),
            (None, 0) => stripper.filter(&[], end_of_stream),
            (None, _) => {
                log::warn!("kvgate: cannot read a response chunk; the stream is passed on as it is");
                let held = stripper.filter(&[], true).unwrap_or_default();
                self.stripper = None;
                if let Err(status) = host.replace_response_body(0, &held) {
                    log::warn!("kvgate: {} bytes of a stream lost: {status:?}", held.len());
                }
                return;
            }
        };
        if let Some(sent) = sent {
            if let Err(status) = host.replace_response_body(body_size, &sent) {
                log::warn!("kvgate: cannot take the usage event out of a stream; left as it is: {status:?}");
                self.stripper = None;
            }
        }
    }
}

/// Describes the decision in `x-kvgate-*` response headers, when `debug_headers` is on.
/// The decision, for the access log: request properties (Envoy filter state `wasm.kvgate_*`)
/// whatever `debug_headers` says; `kvgate_outcome` is set where the outcome is counted.
pub(super) fn access_log_fields(host: &impl Host, route: &Route, d: &Decision, leg: Option<&Leg>) {
    let fields = [
        ("kvgate_booking_id", route.keys.request_id.to_string()),
        ("kvgate_replica", d.replica.clone().unwrap_or_default()),
        ("kvgate_overlap_blocks", d.overlap_blocks.to_string()),
        ("kvgate_prompt_tokens", d.prompt_tokens.map(|n| n.to_string()).unwrap_or_default()),
        ("kvgate_decision_us", d.micros.to_string()),
        ("kvgate_prefill_on", leg.map(|l| l.replica.clone()).unwrap_or_default()),
    ];
    for (name, value) in fields {
        if let Err(status) = host.set_property(name, &value) {
            log::debug!("kvgate: cannot set the property {name}: {status:?}");
        }
    }
}

pub(super) fn debug_headers(host: &impl Host, route: &Route, d: &Decision, leg: Option<&Leg>) {
    if !route.settings.config.debug_headers {
        return;
    }
    let headers = [
        ("x-kvgate-routed-to", d.replica.clone().unwrap_or_else(|| "fallback".into())),
        ("x-kvgate-booking-id", route.keys.request_id.to_string()),
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
        ("x-kvgate-prefill-on", leg.map(|l| l.replica.clone()).unwrap_or_default()),
        ("x-kvgate-prefill-leg", leg.and_then(Leg::outcome).map(LegOutcome::label).unwrap_or_default().into()),
    ];
    for (name, value) in headers {
        if let Err(status) = host.set_response_header(name, &value) {
            log::debug!("kvgate: cannot set {name}: {status:?}");
        }
    }
}
