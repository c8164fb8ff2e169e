//! What the pool and its drivers pass each other, as pure types: below both, so that the
//! drivers (`events`, `sync`) import the pool and these, and the pool imports only these.
//!
//! | file | what | written by | read by |
//! |---|---|---|---|
//! | `ingest.rs` | what ingesting a message did ([`ingest::Outcome`], [`ingest::Progress`]) | `events` | `pool` (health) |
//! | `sync.rs` | what sidecars tell each other ([`sync::SyncEvent`]) and the [`sync::Outbox`] | `pool` | `sync` (sockets), peers' `pool` |
//! | `handover.rs` | a running sidecar's view for a peer that starts ([`handover::Handover`]) | `pool` (export) | `sync::state` (sockets), `pool` (take over) |

pub mod handover;
pub mod ingest;
pub mod sync;
