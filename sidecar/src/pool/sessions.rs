//! Session binding (`[pools.sessions]`): a session's requests stay on the replica that holds
//! its cache, softly. Owns the `sessions` table ([`Sessions`]); the decision reads it and
//! writes where each session went (`route.rs`), peers' bookings write theirs
//! (`lifecycle.rs`, `apply_remote`), a slot given to a newcomer clears its sessions
//! (`members.rs`).
//!
//! The binding is a term in the cost, not a pin: the replica a session is bound to is
//! credited `stickiness_blocks` ([`weigh`]) while it
//! - is eligible (active, serving the model),
//! - holds the session's prefix: at least one block of the prompt, and no less of it than any
//!   other candidate (its cache is why the session stays), and
//! - has headroom: not saturated for the request, with admission control on; and, always,
//!   its cost exceeds the cheapest by less than the credit.
//!
//! Whatever replica is chosen, the session is bound there afresh: a session moves when its
//! replica has lost its prefix, is full, has gone, or costs more than the credit. Bindings
//! last `ttl_secs` after their last request; at most `max_sessions` are kept, the least
//! recently used dropped first. Sessions are keyed by a 128-bit hash of the session key
//! ([`SessionKey`]), so a key's length never sizes the table and peers share the hash only.
//! A sidecar that starts is handed its peers' bindings with their index and bookings
//! (`handover.rs`, [`Sessions::export`] and [`Sessions::adopt`]): each keeps its age, so it
//! expires when it would have at the peer, and a session already bound here keeps its own.

use std::num::NonZeroUsize;
use std::time::{Duration, Instant};

use lru::LruCache;
use serde::Deserialize;

use super::candidates::{Eligible, Scored};
use crate::index::ReplicaIdx;
use crate::msg::sync::SessionKey;
use crate::score::ScoringConfig;

/// The most sessions a pool may bind (`max_sessions`).
const MAX_SESSIONS: usize = 10_000_000;

/// `[pools.sessions]`: bind sessions to the replica holding their cache. Off when absent.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionConfig {
    /// How long a binding lasts after the session's last request, in seconds (default 600).
    pub ttl_secs: u64,
    /// The credit taken off the bound replica's cost (default 64), in the cost's units: a
    /// block of decode, while a block of prefill weighs `scoring.prefill_load_scale` (4 by
    /// default: 64 is 16 blocks of prefill). A session stays unless another replica is
    /// cheaper by more than this.
    pub stickiness_blocks: f64,
    /// Sessions bound at most, least recently used dropped first (default 100 000, about
    /// 64 bytes each).
    pub max_sessions: usize,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig { ttl_secs: 600, stickiness_blocks: 64.0, max_sessions: 100_000 }
    }
}

impl SessionConfig {
    /// Refuses settings that cannot bind.
    pub fn validate(&self, model: &str) -> anyhow::Result<()> {
        if self.ttl_secs == 0 {
            anyhow::bail!("pool {model:?}: sessions.ttl_secs must be at least 1");
        }
        if !(self.stickiness_blocks.is_finite() && self.stickiness_blocks >= 0.0) {
            anyhow::bail!("pool {model:?}: sessions.stickiness_blocks must be a finite number >= 0");
        }
        if !(1..=MAX_SESSIONS).contains(&self.max_sessions) {
            anyhow::bail!(
                "pool {model:?}: sessions.max_sessions must be 1..={MAX_SESSIONS}, got {}",
                self.max_sessions
            );
        }
        Ok(())
    }
}

/// Where a session is bound, and when it was last routed.
#[derive(Debug, Clone, Copy)]
struct Binding {
    slot: ReplicaIdx,
    at: Instant,
}

/// The pool's session bindings.
#[derive(Debug)]
pub(super) struct Sessions {
    ttl: Duration,
    /// Least recently routed first, so the expired ones are at that end.
    bound: LruCache<SessionKey, Binding>,
}

impl Sessions {
    pub(super) fn new(config: &SessionConfig) -> Sessions {
        let capacity = NonZeroUsize::new(config.max_sessions).unwrap_or(NonZeroUsize::MIN);
        Sessions { ttl: Duration::from_secs(config.ttl_secs), bound: LruCache::new(capacity) }
    }

    /// The replica `key` is bound to at `now`, if its binding has not expired.
    pub(super) fn bound(&mut self, key: SessionKey, now: Instant) -> Option<ReplicaIdx> {
        let binding = *self.bound.peek(&key)?;
        if now.saturating_duration_since(binding.at) > self.ttl {
            self.bound.pop(&key);
            return None;
        }
        Some(binding.slot)
    }

    /// Binds `key` to `slot` from `now`, dropping expired bindings (and, if the table is full,
    /// the least recently used).
    pub(super) fn bind(&mut self, key: SessionKey, slot: ReplicaIdx, now: Instant) {
        while self.bound.peek_lru().is_some_and(|(_, b)| now.saturating_duration_since(b.at) > self.ttl) {
            self.bound.pop_lru();
        }
        self.bound.put(key, Binding { slot, at: now });
    }

    /// Drops the bindings to `slot` (its replica left, and the slot goes to another).
    pub(super) fn forget_slot(&mut self, slot: ReplicaIdx) {
        let gone: Vec<SessionKey> = self.bound.iter().filter(|(_, b)| b.slot == slot).map(|(k, _)| *k).collect();
        for key in gone {
            self.bound.pop(&key);
        }
    }

    /// Every binding not expired at `now`, least recently routed first: the session, its
    /// slot, and how long since its last request.
    pub(super) fn export(&self, now: Instant) -> Vec<(SessionKey, ReplicaIdx, Duration)> {
        self.bound
            .iter()
            .rev()
            .map(|(key, b)| (*key, b.slot, now.saturating_duration_since(b.at)))
            .filter(|(_, _, idle)| *idle <= self.ttl)
            .collect()
    }

    /// Binds `key` to `slot` as last routed `idle` before `now`, unless it is bound here
    /// already (this sidecar's own binding is newer) or that is past its TTL. Returns whether
    /// it was bound.
    pub(super) fn adopt(&mut self, key: SessionKey, slot: ReplicaIdx, idle: Duration, now: Instant) -> bool {
        if idle > self.ttl || self.bound(key, now).is_some() {
            return false;
        }
        let at = now.checked_sub(idle).unwrap_or(now);
        self.bound.put(key, Binding { slot, at });
        true
    }

    /// Sessions bound (expired ones not yet dropped included).
    pub(super) fn len(&self) -> usize {
        self.bound.len()
    }
}

/// How a session's binding weighed in a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Weighed {
    /// The session was not bound (new, or its binding had expired).
    Unbound,
    /// Its replica is not a candidate now (gone, leaving, or not serving the model).
    Gone,
    /// Its replica holds less of the prompt than another candidate, or none of it.
    NoPrefix,
    /// Its replica is saturated for the request.
    Saturated,
    /// Its replica, at index `at` of the candidates, was credited.
    Credited { at: usize },
}

impl Weighed {
    /// The decision's session outcome once `chosen` (an index into the candidates) is picked
    /// among `allowed` (those within the request's TTFT SLO; `None`: every candidate): `new`,
    /// `kept`, or why it moved — `replica_gone`, `prefix_gone`, `saturated`, `slo` (predicted
    /// to miss the request's TTFT SLO), or `outweighed` (another replica was cheaper by more
    /// than the credit).
    pub(super) fn outcome(self, chosen: usize, allowed: Option<&[usize]>) -> &'static str {
        match self {
            Weighed::Unbound => "new",
            Weighed::Credited { at } if at == chosen => "kept",
            Weighed::Credited { at } if allowed.is_some_and(|a| !a.contains(&at)) => "slo",
            Weighed::Credited { .. } => "outweighed",
            Weighed::Gone => "replica_gone",
            Weighed::NoPrefix => "prefix_gone",
            Weighed::Saturated => "saturated",
        }
    }
}

/// Credits the replica a session is bound to (`bound`) with `stickiness` blocks of cost, in
/// `scored`, if it is a candidate, holds the session's prefix and is not saturated
/// (`saturated`, asked of that slot only).
pub(super) fn weigh(
    bound: Option<ReplicaIdx>,
    eligible: &[Eligible],
    scored: &mut [Scored],
    scoring: &ScoringConfig,
    stickiness: f64,
    saturated: impl FnOnce(ReplicaIdx) -> bool,
) -> Weighed {
    let Some(slot) = bound else { return Weighed::Unbound };
    let Some(at) = eligible.iter().position(|e| e.slot == slot) else { return Weighed::Gone };
    let held = |e: &Eligible| scoring.effective_overlap(e.overlap);
    let most = eligible.iter().map(held).fold(0.0, f64::max);
    if eligible[at].overlap.device == 0 || held(&eligible[at]) < most {
        return Weighed::NoPrefix;
    }
    if saturated(slot) {
        return Weighed::Saturated;
    }
    scored[at].session_credit = stickiness;
    scored[at].logit -= stickiness;
    Weighed::Credited { at }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &str) -> SessionKey {
        SessionKey::of(s)
    }

    #[test]
    fn bindings_handed_over_keep_their_age_and_never_replace_ones_made_here() {
        let config = SessionConfig { ttl_secs: 10, ..SessionConfig::default() };
        let (mut peer, mut here) = (Sessions::new(&config), Sessions::new(&config));
        let t0 = Instant::now();
        let slot = |i| ReplicaIdx::new(i);
        peer.bind(key("old"), slot(0), t0);
        peer.bind(key("new"), slot(1), t0 + Duration::from_secs(6));
        peer.bind(key("mine"), slot(1), t0 + Duration::from_secs(6));
        let now = t0 + Duration::from_secs(8);
        let exported = peer.export(now);
        assert_eq!(
            exported,
            [
                (key("old"), slot(0), Duration::from_secs(8)),
                (key("new"), slot(1), Duration::from_secs(2)),
                (key("mine"), slot(1), Duration::from_secs(2))
            ],
            "least recently routed first"
        );
        here.bind(key("mine"), slot(0), now);
        let adopted: Vec<bool> = exported.into_iter().map(|(k, s, idle)| here.adopt(k, s, idle, now)).collect();
        assert_eq!(adopted, [true, true, false], "the binding made here stands");
        assert_eq!(here.bound(key("mine"), now), Some(slot(0)));
        // Each expires when it would have at the peer: "old" 10 s after t0.
        let later = t0 + Duration::from_secs(11);
        assert_eq!((here.bound(key("old"), later), here.bound(key("new"), later)), (None, Some(slot(1))));
        assert!(peer.export(later).iter().all(|(k, ..)| *k != key("old")), "an expired one is not exported");
        assert!(!here.adopt(key("late"), slot(0), Duration::from_secs(11), later), "nor adopted");
    }

    #[test]
    fn a_binding_expires_after_its_ttl_from_the_last_request() {
        let mut s = Sessions::new(&SessionConfig { ttl_secs: 10, ..SessionConfig::default() });
        let t0 = Instant::now();
        s.bind(key("a"), ReplicaIdx::new(1), t0);
        assert_eq!(s.bound(key("a"), t0 + Duration::from_secs(9)), Some(ReplicaIdx::new(1)));
        s.bind(key("a"), ReplicaIdx::new(1), t0 + Duration::from_secs(9));
        assert_eq!(s.bound(key("a"), t0 + Duration::from_secs(18)), Some(ReplicaIdx::new(1)), "refreshed");
        assert_eq!(s.bound(key("a"), t0 + Duration::from_secs(20)), None, "expired");
        assert_eq!(s.len(), 0, "an expired binding is dropped when read");
    }

    #[test]
    fn the_table_keeps_the_most_recent_sessions_and_drops_expired_ones_first() {
        let mut s = Sessions::new(&SessionConfig { ttl_secs: 10, max_sessions: 2, ..SessionConfig::default() });
        let t0 = Instant::now();
        s.bind(key("a"), ReplicaIdx::new(0), t0);
        s.bind(key("b"), ReplicaIdx::new(1), t0 + Duration::from_secs(1));
        s.bind(key("c"), ReplicaIdx::new(2), t0 + Duration::from_secs(2));
        assert_eq!(s.bound(key("a"), t0 + Duration::from_secs(2)), None, "the least recently used went");
        assert_eq!(s.bound(key("b"), t0 + Duration::from_secs(2)), Some(ReplicaIdx::new(1)));
        s.forget_slot(ReplicaIdx::new(2));
        assert_eq!(s.bound(key("c"), t0 + Duration::from_secs(2)), None, "its slot was given away");

        let mut s = Sessions::new(&SessionConfig { ttl_secs: 10, max_sessions: 3, ..SessionConfig::default() });
        s.bind(key("a"), ReplicaIdx::new(0), t0);
        s.bind(key("b"), ReplicaIdx::new(1), t0 + Duration::from_secs(5));
        s.bind(key("c"), ReplicaIdx::new(2), t0 + Duration::from_secs(12));
        assert_eq!(s.len(), 2, "a expired and was dropped on the way, b was not");
        assert_eq!(s.bound(key("b"), t0 + Duration::from_secs(12)), Some(ReplicaIdx::new(1)));
    }
}
