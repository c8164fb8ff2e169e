//! The cost function: Dynamo 1.6.1's default worker scorer
//! (`scheduling/selector/reference.rs`, `../shared/docs/dynamo-and-ray.md` §2).
//!
//! For each candidate replica `i`, with `bs` the block size and `ISL` the prompt tokens:
//!
//! ```text
//! credit_i = CREDIT · decay_i · dev_i
//! decay_i  = 1 / (1 + DECAY · ((P_i − min_j P_j) / bs) / max(1, Q))
//! logit_i  = SCALE · max(0, (P_i + ISL)/bs − credit_i) + D_i + W_REQ · R_i
//! ```
//!
//! `dev_i` is the device-tier overlap in blocks, `P_i` the booked prefill tokens, `D_i` the
//! active blocks plus this request's new ones, `R_i` the active requests. The lowest logit wins;
//! ties are broken uniformly at random.

use rand::Rng;
use serde::Deserialize;

/// Scoring knobs, named after what they do; each maps one-to-one to a Dynamo variable.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScoringConfig {
    /// `DYN_ROUTER_PREFILL_LOAD_SCALE`.
    pub prefill_load_scale: f64,
    /// `DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT`.
    pub kv_overlap_credit: f64,
    /// `DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY`.
    pub kv_overlap_credit_decay: f64,
    /// `DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT`.
    pub active_request_weight: f64,
}

impl Default for ScoringConfig {
    fn default() -> Self {
        ScoringConfig {
            prefill_load_scale: 1.0,
            kv_overlap_credit: 1.0,
            kv_overlap_credit_decay: 0.0,
            active_request_weight: 0.0,
        }
    }
}

/// One replica's inputs to the cost function.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Device-tier overlap, in blocks (`dev_i`).
    pub overlap_blocks: u32,
    /// Booked prefill tokens (`P_i`).
    pub prefill_tokens: u64,
    /// Active blocks plus this request's new blocks (`D_i`).
    pub decode_blocks: u64,
    /// Active requests (`R_i`).
    pub requests: u64,
}

/// The request-level inputs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestShape {
    /// Prompt tokens (`ISL`).
    pub prompt_tokens: u64,
    /// Block size (`bs`).
    pub block_size: u64,
}

/// The logit (cost) of every candidate, in order.
pub fn logits(cfg: &ScoringConfig, req: RequestShape, candidates: &[Candidate]) -> Vec<f64> {
    let bs = req.block_size.max(1) as f64;
    let isl = req.prompt_tokens as f64;
    let q = (req.prompt_tokens.div_ceil(req.block_size.max(1))).max(1) as f64;
    let min_prefill = candidates.iter().map(|c| c.prefill_tokens).min().unwrap_or(0) as f64;
    candidates
        .iter()
        .map(|c| {
            let p = c.prefill_tokens as f64;
            let decay = 1.0 / (1.0 + cfg.kv_overlap_credit_decay * ((p - min_prefill) / bs) / q);
            let credit = cfg.kv_overlap_credit * decay * f64::from(c.overlap_blocks);
            let raw = (p + isl) / bs;
            cfg.prefill_load_scale * (raw - credit).max(0.0)
                + c.decode_blocks as f64
                + cfg.active_request_weight * c.requests as f64
        })
        .collect()
}

/// The index of the lowest logit, ties broken uniformly at random. `None` if empty.
pub fn argmin<R: Rng>(logits: &[f64], rng: &mut R) -> Option<usize> {
    let best = logits.iter().copied().fold(f64::INFINITY, f64::min);
    let ties: Vec<usize> = logits.iter().enumerate().filter(|(_, l)| **l == best).map(|(i, _)| i).collect();
    match ties.len() {
        0 => None,
        n => Some(ties[rng.random_range(0..n)]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The worked cases of `dynamo-and-ray.md` §2.2 (1024-token prompt, bs 16: its own 64 new
    /// blocks are the decode term on an idle worker).
    #[test]
    fn matches_dynamos_logged_logits() {
        let cfg = ScoringConfig::default();
        let req = RequestShape { prompt_tokens: 1024, block_size: 16 };
        let c = |overlap, prefill, decode| Candidate {
            overlap_blocks: overlap,
            prefill_tokens: prefill,
            decode_blocks: decode,
            requests: 0,
        };
        let l = logits(&cfg, req, &[c(48, 0, 64), c(0, 0, 64)]);
        assert_eq!(l, vec![80.0, 128.0]);
        // After a pinned 2048-token reservation on w0: 3072/16 − 48 + (128 + 64) = 336.
        assert_eq!(logits(&cfg, req, &[c(48, 2048, 192)])[0], 336.0);
    }

    #[test]
    fn decay_and_request_weight() {
        let cfg = ScoringConfig { kv_overlap_credit_decay: 1.0, active_request_weight: 2.0, ..Default::default() };
        let req = RequestShape { prompt_tokens: 64, block_size: 16 };
        let l = logits(
            &cfg,
            req,
            &[
                Candidate { overlap_blocks: 4, prefill_tokens: 0, decode_blocks: 0, requests: 1 },
                Candidate { overlap_blocks: 4, prefill_tokens: 64, decode_blocks: 0, requests: 0 },
            ],
        );
        // w0: 4 − 4 + 2 = 2. w1: decay = 1/(1 + 4/4) = 0.5 → 8 − 2 = 6.
        assert_eq!(l, vec![2.0, 6.0]);
    }

    #[test]
    fn argmin_breaks_ties_at_random() {
        let mut rng = rand::rng();
        let mut seen = [0; 3];
        for _ in 0..300 {
            seen[argmin(&[1.0, 0.5, 0.5], &mut rng).unwrap()] += 1;
        }
        assert_eq!(seen[0], 0);
        assert!(seen[1] > 50 && seen[2] > 50, "{seen:?}");
        assert_eq!(argmin(&[], &mut rng), None);
    }
}
