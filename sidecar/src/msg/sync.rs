//! What sidecars tell each other ([`SyncEvent`], batched as [`SyncBatch`]), and the
//! [`Outbox`] a pool queues its events in. Pure types: the sockets are in `crate::sync`.

use std::sync::mpsc::{SyncSender, TrySendError};

use kvgate_shared::hash::SequenceHash;
use kvgate_shared::ids::RequestId;
use serde::{Deserialize, Serialize};

/// What one sidecar tells the others.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SyncEvent {
    /// A request was booked on a routing target.
    Booked {
        /// The pool's model.
        model: String,
        /// The target's id (`replica` or `replica#rank`).
        target: String,
        /// The origin's request id.
        request_id: RequestId,
        /// Prefill tokens booked (after the target's cache overlap).
        prefill_tokens: u64,
        /// The prompt's block hashes.
        hashes: Vec<SequenceHash>,
        /// Of `hashes`, the leading blocks the target's KV events held when the origin decided:
        /// the in-flight credit records only the rest (the receiver's own events credit these).
        held_blocks: u32,
        /// All blocks the prompt occupies.
        total_blocks: u64,
        /// Sequences booked: the request's prompts times its samples (`n`).
        sequences: u64,
        /// The request's session, in a pool that binds sessions: bound to the target.
        session: Option<SessionKey>,
    },
    /// The request's first token arrived.
    FirstToken {
        /// The pool's model.
        model: String,
        /// The origin's request id.
        request_id: RequestId,
    },
    /// The request ended.
    Done {
        /// The pool's model.
        model: String,
        /// The origin's request id.
        request_id: RequestId,
    },
}

/// A session, as the pools that bind sessions key it: a 128-bit hash of the session key the
/// request carried, so that neither a table's entries nor a sync message grow with the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SessionKey(u128);

impl SessionKey {
    /// The key of `session`.
    pub fn of(session: &str) -> SessionKey {
        SessionKey(xxhash_rust::xxh3::xxh3_128(session.as_bytes()))
    }
}

/// One published message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncBatch {
    /// The publishing sidecar's id.
    pub origin: String,
    /// Its events, in order.
    pub events: Vec<SyncEvent>,
}

/// Where pools put the events to publish.
#[derive(Debug, Clone)]
pub struct Outbox(SyncSender<SyncEvent>);

impl Outbox {
    /// Events sent here go to `tx`.
    pub fn new(tx: SyncSender<SyncEvent>) -> Outbox {
        Outbox(tx)
    }

    /// Queues an event; if the queue is full the event is dropped (peers' TTL sweeps cover it).
    pub fn send(&self, event: SyncEvent) {
        if let Err(TrySendError::Full(_)) = self.0.try_send(event) {
            tracing::debug!("sync outbox full; event dropped");
        }
    }
}
