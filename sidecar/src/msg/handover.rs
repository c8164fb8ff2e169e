//! What a running sidecar hands a peer that starts: each pool's index, replica by replica,
//! its bookings and its session bindings ([`Handover`]), sent as one [`Part`] a frame so that no frame grows with
//! the fleet. Pure types; the sockets are in `crate::sync::state`, what a pool exports and takes
//! over in `crate::pool::handover`.

use kvgate_shared::hash::SequenceHash;
use kvgate_shared::ids::RequestId;
use serde::{Deserialize, Serialize};

use crate::index::ReplicaSnapshot;
use crate::msg::sync::SessionKey;

/// What a starting sidecar sends to ask for a handover; the version moves whenever
/// [`Part`]'s encoding does. A peer of another release does not answer it.
pub const REQUEST: &[u8] = b"kvgate-handover/2";

/// The most prompt hashes a frame of bookings carries (~9 MB): bookings come in as many
/// frames as that takes.
pub const BOOKING_HASHES_PER_FRAME: usize = 1 << 20;
/// The most session bindings a frame carries (~4 MB with short target ids).
pub const SESSIONS_PER_FRAME: usize = 1 << 16;
/// A replica with more blocks than this (~34 MB decoded) is not handed over: the starting
/// peer rebuilds it from the engine's replay, as it would without a peer.
pub const MAX_REPLICA_BLOCKS: usize = 2 << 20;

/// One frame of a handover. The first names the sender; every other frame names its pool,
/// so each stands on its own: a frame that cannot be read loses only itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Part {
    /// Who answers.
    From {
        /// The answering sidecar's id.
        origin: String,
    },
    /// A pool: its model and block size. Its bookings and replicas come in their own frames.
    Pool {
        /// The pool's model.
        model: String,
        /// Its block size.
        block_size: u32,
    },
    /// Some of a pool's bookings.
    Bookings {
        /// The pool's model.
        model: String,
        /// The bookings.
        bookings: Vec<BookingHandover>,
    },
    /// One replica of a pool.
    Replica {
        /// The pool's model.
        model: String,
        /// The replica's entries.
        replica: ReplicaHandover,
    },
    /// Some of a pool's session bindings.
    Sessions {
        /// The pool's model.
        model: String,
        /// The bindings.
        sessions: Vec<SessionHandover>,
    },
}

/// Why frames are not a handover.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandoverError {
    /// A frame did not decode.
    #[error("frame {0} does not decode: {1}")]
    Frame(usize, String),
    /// The first frame does not name the sender.
    #[error("the first frame does not name the sender")]
    NoSender,
}

impl Handover {
    /// Its frames: the sender, then per pool its name, its bookings in frames of at most
    /// [`BOOKING_HASHES_PER_FRAME`] hashes, its session bindings in frames of at most
    /// [`SESSIONS_PER_FRAME`], and each replica of at most [`MAX_REPLICA_BLOCKS`] blocks
    /// (bigger ones are left out).
    pub fn into_parts(self) -> Vec<Part> {
        let mut parts = vec![Part::From { origin: self.origin }];
        for pool in self.pools {
            let model = pool.model;
            parts.push(Part::Pool { model: model.clone(), block_size: pool.block_size });
            let mut chunk: Vec<BookingHandover> = Vec::new();
            let mut hashes = 0;
            for b in pool.bookings {
                if !chunk.is_empty() && hashes + b.hashes.len() > BOOKING_HASHES_PER_FRAME {
                    parts.push(Part::Bookings { model: model.clone(), bookings: std::mem::take(&mut chunk) });
                    hashes = 0;
                }
                hashes += b.hashes.len();
                chunk.push(b);
            }
            if !chunk.is_empty() {
                parts.push(Part::Bookings { model: model.clone(), bookings: chunk });
            }
            let mut sessions = pool.sessions;
            while !sessions.is_empty() {
                let rest = sessions.split_off(sessions.len().min(SESSIONS_PER_FRAME));
                parts.push(Part::Sessions { model: model.clone(), sessions });
                sessions = rest;
            }
            for replica in pool.replicas.into_iter().filter(|r| r.snapshot.blocks() <= MAX_REPLICA_BLOCKS) {
                parts.push(Part::Replica { model: model.clone(), replica });
            }
        }
        parts
    }

    /// Put back together from its frames, in any order after the first; frames of a pool
    /// whose own frame is missing are dropped.
    pub fn from_parts(parts: impl IntoIterator<Item = Part>) -> Result<Handover, HandoverError> {
        let mut parts = parts.into_iter();
        let Some(Part::From { origin }) = parts.next() else { return Err(HandoverError::NoSender) };
        let mut pools: Vec<PoolHandover> = Vec::new();
        let mut orphans = Vec::new();
        for part in parts {
            match part {
                Part::From { .. } => {}
                Part::Pool { model, block_size } => {
                    if !pools.iter().any(|p| p.model == model) {
                        pools.push(PoolHandover {
                            model,
                            block_size,
                            replicas: Vec::new(),
                            bookings: Vec::new(),
                            sessions: Vec::new(),
                        });
                    }
                }
                other => orphans.push(other),
            }
        }
        for part in orphans {
            match part {
                Part::Bookings { model, bookings } => {
                    if let Some(pool) = pools.iter_mut().find(|p| p.model == model) {
                        pool.bookings.extend(bookings);
                    }
                }
                Part::Replica { model, replica } => {
                    if let Some(pool) = pools.iter_mut().find(|p| p.model == model) {
                        pool.replicas.push(replica);
                    }
                }
                Part::Sessions { model, sessions } => {
                    if let Some(pool) = pools.iter_mut().find(|p| p.model == model) {
                        pool.sessions.extend(sessions);
                    }
                }
                Part::From { .. } | Part::Pool { .. } => {}
            }
        }
        Ok(Handover { origin, pools })
    }
}

/// One sidecar's view, for a peer that starts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Handover {
    /// The answering sidecar's id.
    pub origin: String,
    /// Its pools.
    pub pools: Vec<PoolHandover>,
}

/// One pool's view.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolHandover {
    /// The pool's model.
    pub model: String,
    /// Its block size: a pool of another block size hashes other blocks and is not taken.
    pub block_size: u32,
    /// The index entries of every replica the peer trusts and knows up to a message boundary.
    pub replicas: Vec<ReplicaHandover>,
    /// Every booking it holds, its own and its peers'.
    pub bookings: Vec<BookingHandover>,
    /// Its session bindings not yet expired, least recently routed first (empty when the pool
    /// binds no sessions).
    pub sessions: Vec<SessionHandover>,
}

/// One session binding.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionHandover {
    /// The session.
    pub key: SessionKey,
    /// The target it is bound to.
    pub target: String,
    /// How long since its last request, ms: it keeps its age, so it expires when it would
    /// have at the peer.
    pub idle_ms: u64,
}

/// One routing target's index entries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaHandover {
    /// The target's id (`replica` or `replica#rank`).
    pub target: String,
    /// Where its events come from: a snapshot is restored only onto the same engine.
    pub kv_events: String,
    /// Its blocks, and the event it stands at.
    pub snapshot: ReplicaSnapshot,
}

/// One booking, as the gateway that made it names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BookingHandover {
    /// The sidecar that booked it.
    pub origin: String,
    /// Its request id there.
    pub request_id: RequestId,
    /// The target it is booked on.
    pub target: String,
    /// Prefill tokens still to compute (0 once its prefill is over).
    pub prefill_tokens: u64,
    /// The prompt's sequence hashes.
    pub hashes: Vec<SequenceHash>,
    /// All blocks the prompt occupies.
    pub total_blocks: u64,
    /// Sequences it decodes.
    pub sequences: u64,
    /// How long ago it was booked, ms: it keeps its age, so a booking whose end never comes
    /// expires when it would have at its origin.
    pub age_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn booking(id: &str, hashes: usize) -> BookingHandover {
        BookingHandover {
            origin: "gw-b".into(),
            request_id: id.into(),
            target: "a".into(),
            prefill_tokens: 5,
            hashes: vec![SequenceHash(7); hashes],
            total_blocks: hashes as u64,
            sequences: 1,
            age_ms: 3,
        }
    }

    fn replica(target: &str, blocks: usize) -> ReplicaHandover {
        let mut snapshot = ReplicaSnapshot::default();
        snapshot.tiers[2].blocks =
            vec![crate::index::SnapshotBlock { engine: Default::default(), seq: SequenceHash(1), head: true }; blocks];
        ReplicaHandover { target: target.into(), kv_events: format!("tcp://{target}:5557"), snapshot }
    }

    #[test]
    fn a_handover_survives_its_frames_and_big_parts_are_split_or_left_out() {
        let pool = |m: &str, rs: Vec<ReplicaHandover>, bs: Vec<BookingHandover>| PoolHandover {
            model: m.into(),
            block_size: 16,
            replicas: rs,
            bookings: bs,
            sessions: Vec::new(),
        };
        let big = BOOKING_HASHES_PER_FRAME / 2 + 1;
        let h = Handover {
            origin: "gw-a".into(),
            pools: vec![
                pool(
                    "m1",
                    vec![replica("a", 3), replica("b", 0)],
                    vec![booking("r1", big), booking("r2", big), booking("r3", 1)],
                ),
                pool("m2", vec![], vec![]),
                pool("m3", vec![replica("c", 1), replica("huge", MAX_REPLICA_BLOCKS + 1)], vec![booking("r4", 0)]),
            ],
        };
        let parts = h.clone().into_parts();
        let kinds: Vec<&str> = parts
            .iter()
            .map(|p| match p {
                Part::From { .. } => "from",
                Part::Pool { .. } => "pool",
                Part::Bookings { .. } => "bookings",
                Part::Replica { .. } => "replica",
                Part::Sessions { .. } => "sessions",
            })
            .collect();
        assert_eq!(
            kinds,
            ["from", "pool", "bookings", "bookings", "replica", "replica", "pool", "pool", "bookings", "replica"],
            "m1's bookings in two frames; the huge replica left out"
        );
        let mut expected = h.clone();
        expected.pools[2].replicas.pop();
        assert_eq!(Handover::from_parts(parts.clone()), Ok(expected.clone()));

        // Any order after the sender; a frame of a pool never named is dropped.
        let mut shuffled = parts.clone();
        shuffled[1..].reverse();
        let back = Handover::from_parts(shuffled).unwrap();
        assert_eq!(back.pools.len(), 3);
        assert_eq!(back.pools.iter().map(|p| p.replicas.len() + p.bookings.len()).sum::<usize>(), 3 + 4);
        let orphan = vec![parts[0].clone(), Part::Replica { model: "m9".into(), replica: replica("x", 1) }];
        assert_eq!(Handover::from_parts(orphan).unwrap().pools, []);
        assert_eq!(Handover::from_parts(parts[1..].to_vec()), Err(HandoverError::NoSender));
    }

    #[test]
    fn session_bindings_travel_in_frames_of_a_bounded_count() {
        let sessions: Vec<SessionHandover> = (0..SESSIONS_PER_FRAME + 3)
            .map(|i| SessionHandover { key: SessionKey::of(&i.to_string()), target: "a".into(), idle_ms: i as u64 })
            .collect();
        let h = Handover {
            origin: "gw-a".into(),
            pools: vec![PoolHandover {
                model: "m".into(),
                block_size: 16,
                replicas: Vec::new(),
                bookings: Vec::new(),
                sessions,
            }],
        };
        let parts = h.clone().into_parts();
        let counts: Vec<usize> = parts
            .iter()
            .filter_map(|p| match p {
                Part::Sessions { sessions, .. } => Some(sessions.len()),
                _ => None,
            })
            .collect();
        assert_eq!(counts, [SESSIONS_PER_FRAME, 3]);
        assert_eq!(Handover::from_parts(parts), Ok(h), "in order, least recently routed first");
    }
}
