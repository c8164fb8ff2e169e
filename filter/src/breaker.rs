//! The circuit breaker in front of the sidecar: one per VM, in [`crate::shared::Shared`].
//!
//! A sidecar that hangs would add `route_timeout_ms` to every request, and
//! `offload_timeout_ms` to every offloaded body, for as long as it hangs. The breaker counts
//! the route and offload calls that fail in a row; at `breaker_failures` it opens, and for
//! `breaker_open_ms` no request asks the sidecar: each goes straight to Envoy's own balancer,
//! as an unroutable request does. The first request after that window is the one probe
//! (half-open) while the others keep passing: if the sidecar answers it, the breaker closes;
//! if not, it opens again for twice as long, up to `breaker_max_open_ms`.
//!
//! A call fails when it times out, cannot be dispatched, or is answered 5xx or 409 (a sidecar
//! of another wire version: a misconfiguration that does not heal by itself). That includes
//! the sidecar's own 503 for an offloaded body it has no room or tokenizer time for: it is
//! overloaded, and a while without calls relieves it. Any other answer shows the sidecar
//! working, a 429 shed included. Only the request path's calls
//! count: the root context's model list, tokenizer fetches and lifecycle batches hold no
//! request, go on while the breaker is open (with their own backoff) and neither count nor
//! probe.
//!
//! Every call carries the [`Ticket`] it was admitted with, so that an answer from before the
//! last change of state (a call already in flight when the breaker opened, a probe given up
//! on) is ignored. A probe whose answer never comes (its stream ended first, and Envoy
//! cancelled the call) is given up on once its call's timeout and [`PROBE_GRACE`] have passed,
//! and the next request probes.
//!
//! Pure logic: the time is an argument, so it runs natively in the unit tests below.

use std::time::{Duration, Instant};

/// How long past its call's own timeout a probe's answer is waited for before the next
/// request may probe instead.
pub const PROBE_GRACE: Duration = Duration::from_secs(1);

/// The breaker's settings (from the filter's configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Failed calls in a row that open it; 0: it never opens.
    pub failures: u32,
    /// How long it stays open the first time.
    pub open: Duration,
    /// The longest it stays open; each failed probe doubles the window up to this.
    pub max_open: Duration,
}

/// What the breaker lets through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Every request asks the sidecar.
    Closed,
    /// No request asks the sidecar.
    Open,
    /// One request probes the sidecar; the others do not ask it.
    HalfOpen,
}

impl State {
    /// The value of the `kvgate.breaker_state` gauge.
    pub fn gauge(self) -> u64 {
        match self {
            State::Closed => 0,
            State::Open => 1,
            State::HalfOpen => 2,
        }
    }
}

/// How a call to the sidecar went, as far as the breaker is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The sidecar answered as a working sidecar does (routed, shed, refused a body).
    Answered,
    /// No answer in time, no call, a 5xx, or a 409 (another wire version).
    Failed,
}

impl Verdict {
    /// The verdict on a call answered with `status` (`None`: no answer, the call timed out).
    pub fn of(status: Option<&str>) -> Verdict {
        match status.and_then(|s| s.parse::<u16>().ok()) {
            Some(409 | 500..=599) | None => Verdict::Failed,
            Some(_) => Verdict::Answered,
        }
    }
}

/// Leave to call the sidecar, from [`Breaker::admit`]; handed back with the call's verdict
/// ([`Breaker::record`]) or, if the call is not made after all, [`Breaker::release`]d.
#[derive(Debug, PartialEq, Eq)]
#[must_use]
pub struct Ticket {
    generation: u64,
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    Closed {
        /// Failed calls in a row.
        failures: u32,
    },
    Open {
        since: Instant,
        window: Duration,
    },
    HalfOpen {
        /// The window the breaker reopens with if the probe fails, doubled.
        window: Duration,
        /// The probe in flight: when it was sent and how long its answer is waited for.
        probe: Option<(Instant, Duration)>,
    },
}

/// One VM's circuit breaker.
#[derive(Debug, Clone)]
pub struct Breaker {
    limits: Limits,
    phase: Phase,
    /// Bumped at every change of state and every probe: tickets of an older generation are
    /// ignored.
    generation: u64,
}

impl Breaker {
    /// A closed breaker.
    pub fn new(limits: Limits) -> Breaker {
        Breaker { limits, phase: Phase::Closed { failures: 0 }, generation: 0 }
    }

    /// Its state now (half-open from the first request after the open window).
    pub fn state(&self) -> State {
        match self.phase {
            Phase::Closed { .. } => State::Closed,
            Phase::Open { .. } => State::Open,
            Phase::HalfOpen { .. } => State::HalfOpen,
        }
    }

    /// Whether a request may call the sidecar at `now`, its call timing out after `timeout`:
    /// always while closed; never while open; the first request after the open window, and
    /// the next after a probe given up on, as the probe.
    pub fn admit(&mut self, now: Instant, timeout: Duration) -> Option<Ticket> {
        match self.phase {
            Phase::Closed { .. } => Some(self.ticket()),
            Phase::Open { since, window } if now.saturating_duration_since(since) < window => None,
            Phase::Open { window, .. } => self.probe(window, now, timeout),
            Phase::HalfOpen { probe: Some((sent, wait)), .. } if now.saturating_duration_since(sent) < wait => None,
            Phase::HalfOpen { window, .. } => self.probe(window, now, timeout),
        }
    }

    /// The verdict on a call made with `ticket`, which came at `now`.
    pub fn record(&mut self, ticket: Ticket, verdict: Verdict, now: Instant) {
        if ticket.generation != self.generation {
            return;
        }
        match (self.phase, verdict) {
            (Phase::Closed { .. }, Verdict::Answered) => self.phase = Phase::Closed { failures: 0 },
            (Phase::Closed { failures }, Verdict::Failed) => {
                let failures = failures + 1;
                if self.limits.failures > 0 && failures >= self.limits.failures {
                    self.open(now, self.limits.open);
                } else {
                    self.phase = Phase::Closed { failures };
                }
            }
            (Phase::HalfOpen { .. }, Verdict::Answered) => self.change(Phase::Closed { failures: 0 }),
            (Phase::HalfOpen { window, .. }, Verdict::Failed) => {
                self.open(now, window.saturating_mul(2).min(self.limits.max_open));
            }
            // Opening starts a new generation: no ticket of the open breaker's is out.
            (Phase::Open { .. }, _) => {}
        }
    }

    /// The sidecar answered a call of the root context (the model list): if the breaker is
    /// open, its window ends now and the next request probes — a sidecar that was down and is
    /// back is asked again within one model-list refresh, not after the whole window.
    pub fn sidecar_answered(&mut self) {
        if let Phase::Open { window, .. } = self.phase {
            self.change(Phase::HalfOpen { window, probe: None });
        }
    }

    /// A call admitted with `ticket` is not made after all (the request turned out not to be
    /// routable): a probe's place goes to the next request.
    pub fn release(&mut self, ticket: Ticket) {
        if ticket.generation != self.generation {
            return;
        }
        if let Phase::HalfOpen { probe, .. } = &mut self.phase {
            *probe = None;
        }
    }

    fn ticket(&self) -> Ticket {
        Ticket { generation: self.generation }
    }

    fn probe(&mut self, window: Duration, now: Instant, timeout: Duration) -> Option<Ticket> {
        self.change(Phase::HalfOpen { window, probe: Some((now, timeout.saturating_add(PROBE_GRACE))) });
        Some(self.ticket())
    }

    fn open(&mut self, now: Instant, window: Duration) {
        self.change(Phase::Open { since: now, window });
    }

    fn change(&mut self, phase: Phase) {
        self.phase = phase;
        self.generation += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_millis(25);

    fn limits() -> Limits {
        Limits { failures: 3, open: Duration::from_millis(1000), max_open: Duration::from_millis(3000) }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Fails `n` calls in a row at `at`.
    fn fail(b: &mut Breaker, n: u32, at: Instant) {
        for _ in 0..n {
            let ticket = b.admit(at, TIMEOUT).expect("admitted");
            b.record(ticket, Verdict::Failed, at);
        }
    }

    #[test]
    fn opens_after_the_configured_failures_in_a_row() {
        let t0 = Instant::now();
        let mut b = Breaker::new(limits());
        fail(&mut b, 2, t0);
        assert_eq!(b.state(), State::Closed, "two failures are not three");
        fail(&mut b, 1, t0);
        assert_eq!(b.state(), State::Open);
        assert_eq!(b.admit(t0, TIMEOUT), None);
    }

    #[test]
    fn an_answer_resets_the_count() {
        let t0 = Instant::now();
        let mut b = Breaker::new(limits());
        fail(&mut b, 2, t0);
        let ticket = b.admit(t0, TIMEOUT).unwrap();
        b.record(ticket, Verdict::Answered, t0);
        fail(&mut b, 2, t0);
        assert_eq!(b.state(), State::Closed, "not three in a row");
        fail(&mut b, 1, t0);
        assert_eq!(b.state(), State::Open);
    }

    #[test]
    fn a_shed_is_the_sidecar_working_and_a_wire_mismatch_is_not() {
        assert_eq!(Verdict::of(Some("429")), Verdict::Answered);
        for working in ["200", "404", "422", "400"] {
            assert_eq!(Verdict::of(Some(working)), Verdict::Answered, "{working}");
        }
        for failed in [None, Some("409"), Some("500"), Some("503"), Some("504"), Some(""), Some("5xx")] {
            assert_eq!(Verdict::of(failed), Verdict::Failed, "{failed:?}");
        }
        // Shed after shed never opens it.
        let t0 = Instant::now();
        let mut b = Breaker::new(limits());
        for _ in 0..10 {
            let ticket = b.admit(t0, TIMEOUT).unwrap();
            b.record(ticket, Verdict::of(Some("429")), t0);
        }
        assert_eq!(b.state(), State::Closed);
    }

    #[test]
    fn stays_open_for_the_window_then_lets_exactly_one_probe_through() {
        let t0 = Instant::now();
        let mut b = Breaker::new(limits());
        fail(&mut b, 3, t0);
        for at in [ms(0), ms(1), ms(500), ms(999)] {
            assert_eq!(b.admit(t0 + at, TIMEOUT), None, "open at +{at:?}");
        }
        assert_eq!(b.state(), State::Open);
        let probe = b.admit(t0 + ms(1000), TIMEOUT).expect("the window is over: a probe");
        assert_eq!(b.state(), State::HalfOpen);
        for at in [ms(1000), ms(1001), ms(1020)] {
            assert_eq!(b.admit(t0 + at, TIMEOUT), None, "one probe at a time (+{at:?})");
        }
        b.record(probe, Verdict::Answered, t0 + ms(1001));
        assert_eq!(b.state(), State::Closed, "the probe was answered");
        assert!(b.admit(t0 + ms(1002), TIMEOUT).is_some());
        fail(&mut b, 2, t0 + ms(1003));
        assert_eq!(b.state(), State::Closed, "the count started over when it closed");
    }

    #[test]
    fn a_failed_probe_doubles_the_window_up_to_the_cap() {
        let t0 = Instant::now();
        let mut b = Breaker::new(limits());
        fail(&mut b, 3, t0);
        // Opened at t0 for 1 s; each probe fails at once: 2 s, then 3 s (capped), then 3 s.
        let mut at = t0;
        for window in [1000, 2000, 3000, 3000] {
            assert_eq!(b.admit(at + ms(window - 1), TIMEOUT), None, "still open {window} ms after opening");
            at += ms(window);
            let probe = b.admit(at, TIMEOUT).expect("probe after the window");
            b.record(probe, Verdict::Failed, at);
            assert_eq!(b.state(), State::Open);
        }
        // A probe that succeeds closes it, and the next opening is the first window again.
        at += ms(3000);
        let probe = b.admit(at, TIMEOUT).unwrap();
        b.record(probe, Verdict::Answered, at);
        assert_eq!(b.state(), State::Closed);
        fail(&mut b, 3, at);
        assert_eq!(b.admit(at + ms(999), TIMEOUT), None);
        assert!(b.admit(at + ms(1000), TIMEOUT).is_some(), "back to breaker_open_ms");
    }

    #[test]
    fn answers_from_before_a_change_are_ignored() {
        let t0 = Instant::now();
        let mut b = Breaker::new(limits());
        let late = b.admit(t0, TIMEOUT).unwrap();
        let late_ok = b.admit(t0, TIMEOUT).unwrap();
        fail(&mut b, 3, t0);
        // Calls in flight when it opened time out afterwards: the window is not moved.
        b.record(late, Verdict::Failed, t0 + ms(900));
        b.record(late_ok, Verdict::Answered, t0 + ms(900));
        assert_eq!(b.state(), State::Open, "an old success does not close it");
        assert!(b.admit(t0 + ms(1000), TIMEOUT).is_some(), "nor does an old failure extend it");
    }

    #[test]
    fn a_probe_never_answered_is_given_up_on() {
        let t0 = Instant::now();
        let mut b = Breaker::new(limits());
        fail(&mut b, 3, t0);
        let lost = b.admit(t0 + ms(1000), TIMEOUT).unwrap();
        let given_up = t0 + ms(1000) + TIMEOUT + PROBE_GRACE;
        assert_eq!(b.admit(given_up - ms(1), TIMEOUT), None);
        let probe = b.admit(given_up, TIMEOUT).expect("the next request probes");
        b.record(lost, Verdict::Answered, given_up);
        assert_eq!(b.state(), State::HalfOpen, "the lost probe's late answer is not the probe's");
        b.record(probe, Verdict::Answered, given_up);
        assert_eq!(b.state(), State::Closed);
    }

    #[test]
    fn a_released_probe_lets_the_next_request_probe() {
        let t0 = Instant::now();
        let mut b = Breaker::new(limits());
        fail(&mut b, 3, t0);
        let unroutable = b.admit(t0 + ms(1000), TIMEOUT).unwrap();
        b.release(unroutable);
        let probe = b.admit(t0 + ms(1001), TIMEOUT).expect("the place is free");
        b.record(probe, Verdict::Failed, t0 + ms(1002));
        assert_eq!(b.state(), State::Open);
        // Releasing while closed changes nothing.
        let mut closed = Breaker::new(limits());
        let ticket = closed.admit(t0, TIMEOUT).unwrap();
        closed.release(ticket);
        fail(&mut closed, 3, t0);
        assert_eq!(closed.state(), State::Open);
    }

    #[test]
    fn an_answer_to_another_call_ends_the_open_window_at_once() {
        let t0 = Instant::now();
        let mut b = Breaker::new(limits());
        fail(&mut b, 3, t0);
        assert_eq!(b.state(), State::Open);
        assert!(b.admit(t0 + ms(1), TIMEOUT).is_none());
        b.sidecar_answered();
        assert_eq!(b.state(), State::HalfOpen);
        let probe = b.admit(t0 + ms(2), TIMEOUT).expect("the next request probes at once");
        assert!(b.admit(t0 + ms(3), TIMEOUT).is_none(), "one probe at a time");
        b.record(probe, Verdict::Answered, t0 + ms(4));
        assert_eq!(b.state(), State::Closed);
        // Closed or half-open, it changes nothing.
        b.sidecar_answered();
        assert_eq!(b.state(), State::Closed);
    }

    #[test]
    fn no_failures_configured_means_it_never_opens() {
        let t0 = Instant::now();
        let mut b = Breaker::new(Limits { failures: 0, ..limits() });
        fail(&mut b, 100, t0);
        assert_eq!(b.state(), State::Closed);
    }
}
