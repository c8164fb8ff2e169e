//! A disaggregated request's prefill leg ([`crate::disagg`] builds its bodies). vLLM's is
//! sent first and the request waits for it (Prefilling), then goes to its decode worker with
//! the leg's `kv_transfer_params`; SGLang's is sent beside the request. A leg that cannot be
//! sent, fails or times out leaves the request whole on its decode worker.

use std::time::Duration;

use kvgate_shared::wire::{LifecycleKind, PrefillLeg, Transfer, DESTINATION_HEADER, DP_RANK_HEADER};

use crate::disagg::{self, LegError};
use crate::host::{Host, HostStatus};
use crate::metrics::LegOutcome;
use crate::plan::engine_usage;

use super::ask::TRACE_HEADERS;
use super::phase::{Exchange, Leg, LegState};

/// Why a leg was not sent.
#[derive(Debug, thiserror::Error)]
enum NotSent {
    #[error("no prefill_cluster is configured")]
    NoCluster,
    #[error("a Responses or Messages request has no prefill leg")]
    Converted,
    #[error(transparent)]
    Body(#[from] LegError),
    #[error("{0:?}")]
    Dispatch(HostStatus),
}

impl Exchange {
    /// The call token of the running leg.
    pub(super) fn leg_token(&self) -> Option<u32> {
        match self.leg.as_ref()?.state {
            LegState::Running { token, .. } => Some(token),
            LegState::Over(_) => None,
        }
    }

    /// Whether the request waits for its leg (vLLM's, running).
    pub(super) fn awaits_leg(&self) -> bool {
        self.leg.as_ref().is_some_and(|l| matches!(l.state, LegState::Running { awaited: true, .. }))
    }

    /// Sends a disaggregated request's prefill leg; a leg that cannot be sent leaves the
    /// request whole on its decode worker.
    pub(super) fn start_leg(&mut self, host: &impl Host, leg: PrefillLeg) {
        match self.send_leg(host, &leg) {
            Ok((token, awaited)) => self.leg = Some(Leg::new(leg, LegState::Running { token, awaited })),
            Err(why) => {
                log::debug!("kvgate: prefill leg not sent, serving whole: {why}");
                self.drop_leg(host, Some(leg));
            }
        }
    }

    /// Sends the leg to its prefill worker (through `prefill_cluster`, whose `override_host`
    /// reads the destination header the filter sets on its own call); for SGLang, the
    /// request's body then carries the bootstrap room too. Returns the call's token and
    /// whether the request waits for its answer.
    fn send_leg(&mut self, host: &impl Host, leg: &PrefillLeg) -> Result<(u32, bool), NotSent> {
        let config = self.config();
        let cluster = config.prefill_cluster.clone().ok_or(NotSent::NoCluster)?;
        let timeout = Duration::from_millis(config.prefill_timeout_ms);
        if self.route.endpoint.is_converted() {
            return Err(NotSent::Converted);
        }
        let body = self.body.read(host);
        let (leg_body, decode_body) = match &leg.transfer {
            Transfer::Vllm => (disagg::vllm_prefill(&body)?, None),
            Transfer::Sglang { host: bootstrap, port, room } => {
                let (decode, prefill) = disagg::sglang(&body, bootstrap, *port, *room)?;
                (prefill, Some(decode))
            }
        };
        let authority = host.request_header(":authority").unwrap_or_else(|| "kvgate".into());
        let rank = leg.dp_rank.map(|r| r.to_string());
        // The request's trace context too: the prefill worker's span joins the request's trace.
        let passed: Vec<(&str, String)> = ["x-request-id", "authorization"]
            .into_iter()
            .chain(TRACE_HEADERS)
            .filter_map(|name| Some((name, host.request_header(name)?)))
            .collect();
        let mut headers = vec![
            (":method", "POST"),
            (":path", self.route.path.as_str()),
            (":authority", authority.as_str()),
            ("content-type", "application/json"),
            (DESTINATION_HEADER, leg.endpoint.as_str()),
        ];
        headers.extend(rank.as_deref().map(|r| (DP_RANK_HEADER, r)));
        headers.extend(passed.iter().map(|(name, value)| (*name, value.as_str())));
        let token = host.call(&cluster, &headers, &leg_body, timeout).map_err(NotSent::Dispatch)?;
        if let Some(decode) = decode_body {
            if !self.body.replace(host, &decode) {
                log::warn!(
                    "kvgate: cannot add the bootstrap room to the decode request; its prefill leg will time out"
                );
            }
        }
        // vLLM's leg is awaited; SGLang's runs beside the request.
        Ok((token, matches!(leg.transfer, Transfer::Vllm)))
    }

    /// The prefill leg answered (`num_headers` 0: it timed out): vLLM's request is to go on
    /// to its decode worker with the leg's `kv_transfer_params`, or whole if the leg failed.
    /// Returns whether the request was waiting for it (and is to be resumed).
    pub(super) fn leg_answered(&mut self, host: &impl Host, num_headers: usize, body_size: usize) -> bool {
        let Some(leg) = &self.leg else { return false };
        let LegState::Running { awaited, .. } = leg.state else { return false };
        let booking_id = leg.booking_id.clone();
        let outcome = if num_headers == 0 {
            LegOutcome::Timeout
        } else if host.call_status().as_deref() != Some("200") {
            LegOutcome::Failed
        } else {
            let answer = host.call_body(body_size).unwrap_or_default();
            if let Some((prompt_tokens, cached_tokens)) = engine_usage(&answer) {
                self.report_for(host, &booking_id, LifecycleKind::Usage { prompt_tokens, cached_tokens });
            }
            match awaited {
                true => match disagg::vllm_decode(&self.body.read(host), &answer) {
                    Ok(decode) if self.body.replace(host, &decode) => LegOutcome::Ok,
                    Ok(_) => LegOutcome::Failed,
                    Err(e) => {
                        log::debug!("kvgate: prefill leg unusable, serving whole: {e}");
                        LegOutcome::Failed
                    }
                },
                false => LegOutcome::Ok,
            }
        };
        self.end_leg(host, outcome);
        awaited
    }

    /// The leg is over: its booking is released and its outcome counted.
    fn end_leg(&mut self, host: &impl Host, outcome: LegOutcome) {
        let Some(leg) = &mut self.leg else { return };
        leg.state = LegState::Over(outcome);
        let sent = (outcome != LegOutcome::Unsent).then(|| leg.sent_at.elapsed().as_micros() as u64);
        let booking_id = leg.booking_id.clone();
        self.report_for(host, &booking_id, LifecycleKind::Done);
        if outcome != LegOutcome::Ok {
            // The decode worker computes the prompt itself: its booking takes the prefill.
            self.report(host, LifecycleKind::ServedWhole);
        }
        if let Some(m) = self.metrics() {
            m.leg(host, self.metric_model(), outcome, sent);
        }
    }

    /// A leg the sidecar booked that will not be sent (the decision could not be applied, or
    /// the leg could not be built or dispatched): its booking is released.
    pub(super) fn drop_leg(&mut self, host: &impl Host, leg: Option<PrefillLeg>) {
        let Some(leg) = leg else { return };
        self.leg = Some(Leg::new(leg, LegState::Over(LegOutcome::Unsent)));
        self.end_leg(host, LegOutcome::Unsent);
    }
}
