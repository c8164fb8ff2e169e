//! The replicas a request may go to and their costs: what the decision (`route.rs`) and the
//! prefill/decode split (`disagg.rs`) both weigh.

use crate::index::{Churn, Overlap, ReplicaIdx};
use crate::score::{self, Candidate, RequestShape, ScoringConfig};

/// A replica the request may go to, and the cache it is credited with.
#[derive(Debug, Clone, Copy)]
pub(super) struct Eligible {
    /// Its slot.
    pub slot: ReplicaIdx,
    /// Its overlap with the prompt, as credited (none while its events cannot be trusted).
    pub overlap: Overlap,
    /// Of the device blocks credited, those its index held (the rest: in-flight credit).
    pub indexed: u32,
    /// What its events had done to its cache when the index was read.
    pub churn: Churn,
    /// Whether its index entries were trusted.
    pub trusted: bool,
}

/// An eligible replica's cost inputs and cost, as `/debug/explain` keeps them.
#[derive(Debug, Clone, Copy)]
pub(super) struct Scored {
    /// Its slot.
    pub slot: ReplicaIdx,
    /// The cost function's inputs.
    pub inputs: Candidate,
    /// The cost.
    pub logit: f64,
    /// Whether its cache credit counted.
    pub trusted: bool,
    /// Under `predicted_latency` or an SLO, the TTFT predicted there, in seconds, if its
    /// model predicts.
    pub predicted_ttft: Option<f32>,
    /// Likewise, the ITL predicted there.
    pub predicted_itl: Option<f32>,
    /// The credit taken off its cost for being the request's session's replica (0 if none).
    pub session_credit: f64,
}

/// The eligible replicas' costs for these inputs (one per replica, in order).
pub(super) fn scored(
    eligible: &[Eligible],
    inputs: Vec<Candidate>,
    request: RequestShape,
    scoring: &ScoringConfig,
) -> Vec<Scored> {
    let logits = score::logits(scoring, request, &inputs);
    eligible
        .iter()
        .zip(inputs)
        .zip(logits)
        .map(|((e, inputs), logit)| Scored {
            slot: e.slot,
            inputs,
            logit,
            trusted: e.trusted,
            predicted_ttft: None,
            predicted_itl: None,
            session_credit: 0.0,
        })
        .collect()
}
