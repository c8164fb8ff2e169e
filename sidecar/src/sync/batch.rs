//! When a sidecar's sync events go out: the publisher's batching, as pure logic over a clock
//! it is given (the publisher thread drives it; the scale benchmark's peers use it too).
//!
//! Every message costs each of the other gateways a wake-up, a decryption and a decode,
//! whatever it holds: at 16 gateways, when every event went out within 1 ms (2.3 messages a
//! request), sending one message a request instead took 14 % off the receivers' sync
//! threads (`docs/scale.md`). So the deadline depends on what waits:
//! - a **booking** goes out within [`BOOKED_WITHIN`]: peers deciding meanwhile do not see it,
//!   and a burst of one new prefix over several gateways would herd onto one replica;
//! - a **first token** or an **end** waits up to [`LIFECYCLE_WITHIN`] and leaves with the next
//!   booking: until then peers count the request's prefill (or decode) on its replica a few
//!   milliseconds longer, against prefills that take tens to hundreds.
//!
//! A batch also goes out as soon as it holds [`BATCH_EVENTS`] events, and everything goes
//! when the publisher stops ([`Batcher::take_all`]). Order is kept: a request's end never
//! leaves before its booking. The windows run from when the publisher takes the event from
//! the pools' outbox.

use std::time::{Duration, Instant};

use crate::msg::sync::SyncEvent;

/// A booking goes out this long after it was made, at the latest…
pub const BOOKED_WITHIN: Duration = Duration::from_millis(1);
/// …a first token or an end this long.
pub const LIFECYCLE_WITHIN: Duration = Duration::from_millis(10);
/// A batch with this many events goes out at once.
pub const BATCH_EVENTS: usize = 256;

/// The events waiting to go out, and when they must.
#[derive(Debug, Default)]
pub struct Batcher {
    events: Vec<SyncEvent>,
    deadline: Option<Instant>,
}

impl Batcher {
    /// Queues `event`, made at `now`.
    pub fn push(&mut self, event: SyncEvent, now: Instant) {
        let within = match event {
            SyncEvent::Booked { .. } => BOOKED_WITHIN,
            SyncEvent::FirstToken { .. } | SyncEvent::Done { .. } => LIFECYCLE_WITHIN,
        };
        let due = now + within;
        self.deadline = Some(self.deadline.map_or(due, |d| d.min(due)));
        self.events.push(event);
    }

    /// When the waiting events must go out (`None`: nothing waits).
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// The batch to send at `now`, if one is due: full, or past its deadline.
    pub fn take_due(&mut self, now: Instant) -> Option<Vec<SyncEvent>> {
        let due = self.events.len() >= BATCH_EVENTS || self.deadline.is_some_and(|d| d <= now);
        if !due {
            return None;
        }
        Some(self.take_all())
    }

    /// Every waiting event, due or not (the publisher is stopping).
    pub fn take_all(&mut self) -> Vec<SyncEvent> {
        self.deadline = None;
        std::mem::take(&mut self.events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_shared::ids::RequestId;

    fn booked(id: &str) -> SyncEvent {
        SyncEvent::Booked {
            model: "m".into(),
            target: "r".into(),
            request_id: RequestId::from(id),
            prefill_tokens: 1,
            hashes: Vec::new(),
            held_blocks: 0,
            total_blocks: 1,
            sequences: 1,
            session: None,
        }
    }

    fn done(id: &str) -> SyncEvent {
        SyncEvent::Done { model: "m".into(), request_id: RequestId::from(id) }
    }

    #[test]
    fn a_booking_goes_out_within_its_window() {
        let (mut b, t0) = (Batcher::default(), Instant::now());
        b.push(booked("a"), t0);
        assert_eq!(b.deadline(), Some(t0 + BOOKED_WITHIN));
        assert!(b.take_due(t0).is_none());
        assert_eq!(b.take_due(t0 + BOOKED_WITHIN), Some(vec![booked("a")]));
        assert_eq!(b.deadline(), None);
        assert!(b.take_due(t0 + LIFECYCLE_WITHIN).is_none(), "nothing waits after a send");
    }

    #[test]
    fn an_end_waits_for_the_next_booking_and_leaves_before_it() {
        let (mut b, t0) = (Batcher::default(), Instant::now());
        b.push(done("a"), t0);
        assert!(b.take_due(t0 + BOOKED_WITHIN).is_none(), "an end alone waits longer than a booking");
        let t1 = t0 + Duration::from_millis(4);
        b.push(booked("b"), t1);
        assert_eq!(b.deadline(), Some(t1 + BOOKED_WITHIN), "the booking's deadline is the batch's");
        assert_eq!(b.take_due(t1 + BOOKED_WITHIN), Some(vec![done("a"), booked("b")]));
    }

    #[test]
    fn an_end_alone_goes_out_within_its_own_window() {
        let (mut b, t0) = (Batcher::default(), Instant::now());
        b.push(done("a"), t0);
        let later = t0 + Duration::from_millis(3);
        b.push(done("b"), later);
        assert_eq!(b.deadline(), Some(t0 + LIFECYCLE_WITHIN), "the first event's deadline holds");
        assert!(b.take_due(t0 + LIFECYCLE_WITHIN - Duration::from_micros(1)).is_none());
        assert_eq!(b.take_due(t0 + LIFECYCLE_WITHIN), Some(vec![done("a"), done("b")]));
    }

    #[test]
    fn a_full_batch_goes_out_at_once() {
        let (mut b, t0) = (Batcher::default(), Instant::now());
        for i in 0..BATCH_EVENTS - 1 {
            b.push(done(&i.to_string()), t0);
        }
        assert!(b.take_due(t0).is_none());
        b.push(done("last"), t0);
        assert_eq!(b.take_due(t0).map(|e| e.len()), Some(BATCH_EVENTS));
    }
}
