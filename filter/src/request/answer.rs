//! Asking → Prefilling or Responding: the sidecar's answer. Set the destination header (and
//! the data-parallel rank's); on *any* failure (sidecar down, timeout, bad answer, a header
//! that cannot be set) leave it unset: Envoy's fallback balancer routes. A 429 means the
//! request is shed — every replica saturated and its wait over, or none predicted to meet its
//! TTFT SLO: the client is answered here. In a disaggregated pool the answer
//! names a prefill leg too, which is sent now ([`super::leg`]).

use kvgate_shared::codec;
use kvgate_shared::ids::ModelName;
use kvgate_shared::wire::{RouteResponse, DESTINATION_HEADER, DP_RANK_HEADER, SHED_REASON_HEADER};

use crate::host::Host;
use crate::metrics::Outcome;

use super::phase::Exchange;

impl Exchange {
    /// The sidecar answered (`num_headers` 0: the call timed out): applies its decision,
    /// times and counts it. Returns how the request leaves the filter.
    pub(super) fn sidecar_answered(&mut self, host: &impl Host, num_headers: usize, body_size: usize) -> Outcome {
        let outcome = self.apply_decision(host, num_headers, body_size);
        self.decision.micros = self.asked_at.elapsed().as_micros();
        self.count(host, outcome);
        if let Some(m) = self.metrics() {
            m.sidecar(host, self.decision.micros.saturating_sub(self.decision.plan_micros) as u64);
        }
        outcome
    }

    fn apply_decision(&mut self, host: &impl Host, num_headers: usize, body_size: usize) -> Outcome {
        if num_headers == 0 {
            log::debug!("kvgate: sidecar timed out; falling back");
            return Outcome::FallbackTimeout;
        }
        let status = host.call_status();
        if status.as_deref() == Some("429") {
            return self.shed(host);
        }
        if status.as_deref() != Some("200") {
            log::debug!("kvgate: sidecar answered {status:?}; falling back");
            return Outcome::FallbackError;
        }
        let Some(body) = host.call_body(body_size) else {
            return Outcome::FallbackError;
        };
        let Ok(mut answer) = codec::decode::<RouteResponse>(&body) else {
            log::warn!("kvgate: undecodable sidecar answer; falling back");
            return Outcome::FallbackError;
        };
        let leg = answer.prefill.take();
        let Some(endpoint) = &answer.endpoint else {
            self.drop_leg(host, leg);
            return Outcome::FallbackError;
        };
        if let Some(rank) = answer.dp_rank {
            if let Err(status) = host.set_request_header(DP_RANK_HEADER, &rank.to_string()) {
                log::warn!("kvgate: cannot set {DP_RANK_HEADER}: {status:?}");
                self.drop_leg(host, leg);
                return Outcome::FallbackError;
            }
        }
        match host.set_request_header(DESTINATION_HEADER, endpoint) {
            Ok(()) => {
                self.decision.replica = answer.replica.clone();
                self.decision.endpoint = answer.endpoint.clone();
                self.decision.overlap_blocks = answer.overlap_blocks;
                if let Some(leg) = leg {
                    self.start_leg(host, leg);
                }
                Outcome::Routed
            }
            Err(status) => {
                log::warn!("kvgate: cannot set the destination header: {status:?}");
                self.drop_leg(host, leg);
                Outcome::FallbackError
            }
        }
    }

    /// The sidecar shed the request (every replica saturated and its wait over, or none
    /// predicted to meet its class's TTFT SLO): answer 429 with the sidecar's `Retry-After` and
    /// an OpenAI-style error saying which, and book nothing. If the reply cannot be sent, the
    /// request goes on through Envoy's balancing instead.
    fn shed(&mut self, host: &impl Host) -> Outcome {
        let retry_after = host.call_header("retry-after").filter(|v| v.parse::<u32>().is_ok());
        let retry_after = retry_after.unwrap_or_else(|| "1".into());
        let model = self.booked.as_ref().map_or("", ModelName::as_str);
        let why = match host.call_header(SHED_REASON_HEADER).as_deref() {
            Some("slo") => format!(
                "no replica of model {model:?} is predicted to meet the request's latency objectives (TTFT, ITL)"
            ),
            _ => format!("every replica of model {model:?} is saturated"),
        };
        let error = serde_json::json!({"error": {
            "message": format!("{why}; retry after {retry_after} s"),
            "type": "rate_limit_error",
            "param": null,
            "code": "rate_limit_exceeded",
        }});
        let headers = [("retry-after", retry_after.as_str()), ("content-type", "application/json")];
        match host.send_local_reply(429, &headers, error.to_string().as_bytes()) {
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
}
