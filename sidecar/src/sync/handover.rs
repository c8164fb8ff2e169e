//! What a running sidecar hands a peer that starts: each pool's index, replica by replica,
//! and its bookings ([`Handover`]), sent as one [`Part`] a frame so that no frame grows with
//! the fleet. Pure types; the sockets are in [`super::state`], what a pool exports and takes
//! over in `crate::pool::handover`.

use kvgate_shared::hash::SequenceHash;
use serde::{Deserialize, Serialize};

use crate::index::ReplicaSnapshot;

/// What a starting sidecar sends to ask for a handover; the version moves whenever
/// [`Handover`]'s encoding does. A peer of another release does not answer it.
pub const REQUEST: &[u8] = b"kvgate-handover/1";

/// One frame of a handover: the first names the sender, then each replica and each pool's
/// bookings come on their own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Part {
    /// Who answers.
    From {
        /// The answering sidecar's id.
        origin: String,
    },
    /// One pool (model, block size) and its bookings; its replicas follow.
    Pool {
        /// The pool's model.
        model: String,
        /// Its block size.
        block_size: u32,
        /// Its bookings.
        bookings: Vec<BookingHandover>,
    },
    /// One replica of the pool named last.
    Replica(ReplicaHandover),
}

/// Why frames are not a handover.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandoverError {
    /// A frame did not decode.
    #[error("frame {0} does not decode: {1}")]
    Frame(usize, String),
    /// The frames are not `From`, then pools each followed by their replicas.
    #[error("frame {0} is out of order")]
    Order(usize),
}

impl Handover {
    /// Its frames, in order.
    pub fn into_parts(self) -> impl Iterator<Item = Part> {
        std::iter::once(Part::From { origin: self.origin }).chain(self.pools.into_iter().flat_map(|p| {
            std::iter::once(Part::Pool { model: p.model, block_size: p.block_size, bookings: p.bookings })
                .chain(p.replicas.into_iter().map(Part::Replica))
        }))
    }

    /// Put back together from its frames.
    pub fn from_parts(parts: impl IntoIterator<Item = Part>) -> Result<Handover, HandoverError> {
        let mut parts = parts.into_iter().enumerate();
        let Some((_, Part::From { origin })) = parts.next() else { return Err(HandoverError::Order(0)) };
        let mut pools: Vec<PoolHandover> = Vec::new();
        for (i, part) in parts {
            match part {
                Part::From { .. } => return Err(HandoverError::Order(i)),
                Part::Pool { model, block_size, bookings } => {
                    pools.push(PoolHandover { model, block_size, replicas: Vec::new(), bookings })
                }
                Part::Replica(r) => pools.last_mut().ok_or(HandoverError::Order(i))?.replicas.push(r),
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
}

/// One routing target's index entries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaHandover {
    /// The target's id (`replica` or `replica#rank`).
    pub target: String,
    /// Its blocks, and the event it stands at.
    pub snapshot: ReplicaSnapshot,
}

/// One booking, as the gateway that made it names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BookingHandover {
    /// The sidecar that booked it.
    pub origin: String,
    /// Its request id there.
    pub request_id: String,
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handover_survives_its_frames_and_bad_orders_are_refused() {
        let replica = |t: &str| ReplicaHandover { target: t.into(), snapshot: ReplicaSnapshot::default() };
        let pool = |m: &str, rs: Vec<ReplicaHandover>| PoolHandover {
            model: m.into(),
            block_size: 16,
            replicas: rs,
            bookings: vec![BookingHandover {
                origin: "gw-b".into(),
                request_id: "r1".into(),
                target: "a".into(),
                prefill_tokens: 5,
                hashes: vec![SequenceHash(7)],
                total_blocks: 2,
                sequences: 1,
            }],
        };
        let h = Handover {
            origin: "gw-a".into(),
            pools: vec![
                pool("m1", vec![replica("a"), replica("b")]),
                pool("m2", vec![]),
                pool("m3", vec![replica("c")]),
            ],
        };
        let parts: Vec<Part> = h.clone().into_parts().collect();
        assert_eq!(parts.len(), 1 + 3 + 3);
        assert_eq!(Handover::from_parts(parts.clone()), Ok(h));
        assert_eq!(Handover::from_parts(parts[1..].to_vec()), Err(HandoverError::Order(0)));
        let orphan = vec![parts[0].clone(), Part::Replica(replica("a"))];
        assert_eq!(Handover::from_parts(orphan), Err(HandoverError::Order(1)));
    }
}
