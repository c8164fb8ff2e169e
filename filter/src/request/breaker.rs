//! The request's side of the VM's circuit breaker ([`crate::breaker`]): whether it may ask
//! the sidecar (if not, it goes to Envoy's balancer as it is, counted), what its call came to,
//! and the gauge and log line at each change of state.

use std::time::{Duration, Instant};

use kvgate_shared::ids::ModelName;

use crate::breaker::{Breaker, State, Ticket, Verdict};
use crate::host::Host;
use crate::metrics::Outcome;

use super::ask::Asked;
use super::phase::Exchange;

impl Exchange {
    /// Leave to ask the sidecar about this request's `body_len`-byte body; `None` (counted)
    /// while the breaker is open or its probe is out: the request is not planned and goes to
    /// Envoy's balancer, nothing booked.
    pub(super) fn admit(&self, host: &impl Host, breaker: &mut Breaker, body_len: usize) -> Option<Ticket> {
        let timeout = Duration::from_millis(self.call_timeout_ms(body_len));
        let before = breaker.state();
        let ticket = breaker.admit(self.asked_at, timeout);
        self.breaker_changed(host, before, breaker);
        if ticket.is_none() {
            self.count(host, Outcome::BreakerOpen);
        }
        ticket
    }

    /// The call was made, or not: a call in flight keeps its ticket for the answer and books
    /// the model it asked about; one not made for an unroutable request gives the ticket back;
    /// one that could not be sent is a failure.
    pub(super) fn asked(
        &mut self,
        host: &impl Host,
        breaker: &mut Breaker,
        ticket: Ticket,
        asked: Asked,
    ) -> Option<ModelName> {
        match asked {
            Asked::InFlight(model) => {
                self.ticket = Some(ticket);
                Some(model)
            }
            Asked::Unroutable => {
                breaker.release(ticket);
                None
            }
            Asked::NotSent => {
                self.settle(host, breaker, ticket, Verdict::Failed);
                None
            }
        }
    }

    /// The sidecar answered with `status` (`None`: the call timed out).
    pub(super) fn sidecar_verdict(&mut self, host: &impl Host, breaker: &mut Breaker, status: Option<&str>) {
        if let Some(ticket) = self.ticket.take() {
            self.settle(host, breaker, ticket, Verdict::of(status));
        }
    }

    fn settle(&self, host: &impl Host, breaker: &mut Breaker, ticket: Ticket, verdict: Verdict) {
        let before = breaker.state();
        breaker.record(ticket, verdict, Instant::now());
        self.breaker_changed(host, before, breaker);
    }

    /// Sets the gauge and says so in the log when the breaker's state changed.
    fn breaker_changed(&self, host: &impl Host, before: State, breaker: &Breaker) {
        let now = breaker.state();
        if now == before {
            return;
        }
        if let Some(m) = self.metrics() {
            m.breaker(host, now);
        }
        let config = self.config();
        match (before, now) {
            (State::Closed, _) => log::warn!(
                "kvgate: {} calls to the sidecar failed in a row; requests go to Envoy's balancer for {} ms",
                config.breaker_failures,
                config.breaker_open_ms
            ),
            (_, State::HalfOpen) => log::info!("kvgate: probing the sidecar with one request"),
            (_, State::Open) => log::warn!("kvgate: the sidecar failed its probe; not asking it for longer"),
            (_, State::Closed) => log::info!("kvgate: the sidecar answered its probe; routing again"),
        }
    }
}
