//! The cost function: Dynamo 1.6.1's default worker scorer
//! (`lib/kv-router`, `scheduling/selector/reference.rs`).
//!
//! For each candidate replica `i`, with `bs` the block size and `ISL` the prompt tokens:
//!
//! ```text
//! credit_i = CREDIT · decay_i · dev_i + W_HOST · host_i + W_DISK · disk_i
//! decay_i  = 1 / (1 + DECAY · ((P_i − min_j P_j) / bs) / max(1, Q))
//! logit_i  = SCALE · max(0, (P_i + ISL)/bs − credit_i) + D_i + W_REQ · R_i
//!          + W_DUP · (max_j overlap_j − overlap_i)
//! ```
//!
//! kvgate's defaults differ from Dynamo's in `SCALE` (4, Dynamo's 1: a block of prefill is
//! what a new request waits behind, a block of decode only slows each step slightly) and in
//! the last term, kvgate's own (`W_DUP` = 0 and `SCALE` = 1 are Dynamo's cost exactly,
//! [`ScoringConfig::dynamo`]): a replica that would recompute blocks another candidate holds
//! also *duplicates* them, and with a full cache every duplicated block evicts some other
//! prefix's block. `W_DUP` charges for that, so a prefix stays on its replica unless the load
//! difference outweighs the lost cache too.
//!
//! `dev_i` is the device-tier overlap in blocks, `host_i`/`disk_i` the blocks continuing it
//! on lower tiers, `P_i` the booked prefill tokens (with engine metrics, also an estimate for
//! the outside requests the engine reports waiting), `D_i` the
//! active blocks plus this request's new ones, `R_i` the active requests. The lowest logit wins;
//! ties are broken uniformly at random.

use rand::Rng;
use serde::Deserialize;

use crate::index::Overlap;

/// Scoring knobs, named after what they do; each maps one-to-one to a Dynamo variable.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScoringConfig {
    /// `DYN_ROUTER_PREFILL_LOAD_SCALE`: what a block of prefill weighs against a block of
    /// active decode. kvgate's default 4 (Dynamo's: 1): a new request waits behind the
    /// prefills ahead of it and its own, while decodes slow each step only slightly
    /// (measured in `docs/benchmarks`: TTFT better or equal on every workload measured).
    pub prefill_load_scale: f64,
    /// `DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT`.
    pub kv_overlap_credit: f64,
    /// `DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY`.
    pub kv_overlap_credit_decay: f64,
    /// `DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT`.
    pub active_request_weight: f64,
    /// Credit per host-memory (CPU offload) block (`DYN_ROUTER_HOST_CACHE_HIT_WEIGHT`).
    pub host_cache_hit_weight: f64,
    /// Credit per disk/external block (`DYN_ROUTER_DISK_CACHE_HIT_WEIGHT`).
    pub disk_cache_hit_weight: f64,
    /// `DYN_ROUTER_TEMPERATURE`: 0 picks the cheapest (ties at random); above 0, a softmax
    /// over min-max-normalised costs spreads load across near-equal replicas.
    pub temperature: f64,
    /// Cost per block that a replica would recompute although another candidate holds it
    /// (`W_DUP`; overlaps counted as in the credit, lower tiers discounted; not multiplied by
    /// `prefill_load_scale`). 0 with `prefill_load_scale = 1` is Dynamo's cost; the defaults
    /// (4 and 4) make recomputing a prefix held elsewhere cost twice its prefill (measured in
    /// `docs/benchmarks`: higher keeps more prefixes in one place and balances load less).
    pub duplicate_penalty: f64,
}

impl Default for ScoringConfig {
    fn default() -> Self {
        ScoringConfig {
            prefill_load_scale: 4.0,
            kv_overlap_credit: 1.0,
            kv_overlap_credit_decay: 0.0,
            active_request_weight: 0.0,
            host_cache_hit_weight: 0.75,
            disk_cache_hit_weight: 0.25,
            temperature: 0.0,
            duplicate_penalty: 4.0,
        }
    }
}

impl ScoringConfig {
    /// Dynamo 1.6.1's default cost exactly: kvgate's defaults with Dynamo's prefill weight
    /// and without the duplicate penalty.
    pub fn dynamo() -> ScoringConfig {
        ScoringConfig { prefill_load_scale: 1.0, duplicate_penalty: 0.0, ..ScoringConfig::default() }
    }

    /// This configuration with a request's overrides applied.
    pub fn with_overrides(&self, o: &kvgate_shared::wire::ScoringOverrides) -> ScoringConfig {
        let finite = |v: Option<f64>| v.filter(|v| v.is_finite() && *v >= 0.0);
        ScoringConfig {
            kv_overlap_credit: finite(o.kv_overlap_credit).unwrap_or(self.kv_overlap_credit),
            prefill_load_scale: finite(o.prefill_load_scale).unwrap_or(self.prefill_load_scale),
            temperature: finite(o.temperature).unwrap_or(self.temperature),
            ..self.clone()
        }
    }

    /// Overlap in blocks, lower tiers discounted: `dev + W_HOST·host + W_DISK·disk`.
    pub fn effective_overlap(&self, o: Overlap) -> f64 {
        f64::from(o.device)
            + self.host_cache_hit_weight * f64::from(o.host)
            + self.disk_cache_hit_weight * f64::from(o.disk)
    }

    /// Prefill tokens a request will cost on a replica with this overlap (Dynamo's
    /// `effective_prefill_tokens`, independent of the credit knobs).
    pub fn prefill_tokens(&self, prompt_tokens: u64, block_size: u64, o: Overlap) -> u64 {
        let cached = (self.effective_overlap(o) * block_size as f64).round() as u64;
        prompt_tokens - cached.min(prompt_tokens)
    }
}

/// One replica's inputs to the cost function.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    /// Overlap in blocks per tier (`dev_i`, `host_i`, `disk_i`).
    pub overlap: Overlap,
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
    let best_overlap = candidates.iter().map(|c| cfg.effective_overlap(c.overlap)).fold(0.0, f64::max);
    candidates
        .iter()
        .map(|c| {
            let p = c.prefill_tokens as f64;
            let decay = 1.0 / (1.0 + cfg.kv_overlap_credit_decay * ((p - min_prefill) / bs) / q);
            let credit = cfg.kv_overlap_credit * decay * f64::from(c.overlap.device)
                + cfg.host_cache_hit_weight * f64::from(c.overlap.host)
                + cfg.disk_cache_hit_weight * f64::from(c.overlap.disk);
            let raw = (p + isl) / bs;
            cfg.prefill_load_scale * (raw - credit).max(0.0)
                + c.decode_blocks as f64
                + cfg.active_request_weight * c.requests as f64
                + cfg.duplicate_penalty * (best_overlap - cfg.effective_overlap(c.overlap))
        })
        .collect()
}

/// Picks a candidate: the argmin at temperature 0, else a draw with
/// `p_i ∝ exp(−(c_i − c_min) / ((c_max − c_min) · T))` (uniform when all costs are equal).
pub fn select<R: Rng>(logits: &[f64], temperature: f64, rng: &mut R) -> Option<usize> {
    if temperature <= 0.0 || logits.len() < 2 {
        return argmin(logits, rng);
    }
    let min = logits.iter().copied().fold(f64::INFINITY, f64::min);
    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let range = max - min;
    let weights: Vec<f64> =
        logits.iter().map(|c| if range > 0.0 { (-(c - min) / (range * temperature)).exp() } else { 1.0 }).collect();
    let mut draw = rng.random::<f64>() * weights.iter().sum::<f64>();
    for (i, w) in weights.iter().enumerate() {
        if draw < *w {
            return Some(i);
        }
        draw -= w;
    }
    Some(weights.len() - 1)
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

    /// The cases Dynamo's scorer logs for a 1024-token prompt (bs 16: its own 64 new
    /// blocks are the decode term on an idle worker).
    #[test]
    fn matches_dynamos_logged_logits() {
        let cfg = ScoringConfig::dynamo();
        let req = RequestShape { prompt_tokens: 1024, block_size: 16 };
        let c = |device, host, prefill, decode| Candidate {
            overlap: Overlap { device, host, disk: 0 },
            prefill_tokens: prefill,
            decode_blocks: decode,
            requests: 0,
        };
        // w0: 48 GPU blocks; w1: 16 GPU + 32 CPU blocks; w2: nothing cached.
        let l = logits(&cfg, req, &[c(48, 0, 0, 64), c(16, 32, 0, 64), c(0, 0, 0, 64)]);
        assert_eq!(l, vec![80.0, 88.0, 128.0]);
        // After a pinned 2048-token reservation on w0: 3072/16 − 48 + (128 + 64) = 336.
        assert_eq!(logits(&cfg, req, &[c(48, 0, 2048, 192)])[0], 336.0);
        // Booked prefill: Dynamo logged potential_prefill_tokens 256 and 384.
        assert_eq!(cfg.prefill_tokens(1024, 16, Overlap { device: 48, host: 0, disk: 0 }), 256);
        assert_eq!(cfg.prefill_tokens(1024, 16, Overlap { device: 16, host: 32, disk: 0 }), 384);
    }

    #[test]
    fn decay_and_request_weight() {
        let cfg = ScoringConfig { kv_overlap_credit_decay: 1.0, active_request_weight: 2.0, ..ScoringConfig::dynamo() };
        let req = RequestShape { prompt_tokens: 64, block_size: 16 };
        let l = logits(
            &cfg,
            req,
            &[
                Candidate {
                    overlap: Overlap { device: 4, host: 0, disk: 0 },
                    prefill_tokens: 0,
                    decode_blocks: 0,
                    requests: 1,
                },
                Candidate {
                    overlap: Overlap { device: 4, host: 0, disk: 0 },
                    prefill_tokens: 64,
                    decode_blocks: 0,
                    requests: 0,
                },
            ],
        );
        // w0: 4 − 4 + 2 = 2. w1: decay = 1/(1 + 4/4) = 0.5 → 8 − 2 = 6.
        assert_eq!(l, vec![2.0, 6.0]);
    }

    #[test]
    fn duplicate_penalty_charges_recomputing_what_another_replica_holds() {
        // 2400 tokens = 150 blocks; the owner holds the first 125 and is busier.
        let req = RequestShape { prompt_tokens: 2400, block_size: 16 };
        let cand = |device, host, decode| Candidate {
            overlap: Overlap { device, host, disk: 0 },
            prefill_tokens: 0,
            decode_blocks: decode,
            requests: 0,
        };
        let (owner, other) = (cand(125, 0, 900), cand(0, 0, 700));
        // Dynamo's cost: owner 25 + 900, other 150 + 700: the prefix is recomputed elsewhere.
        assert_eq!(logits(&ScoringConfig::dynamo(), req, &[owner, other]), vec![925.0, 850.0]);
        // W_DUP = 1: the other also pays for the 125 blocks it would duplicate, and loses.
        let cfg = ScoringConfig { duplicate_penalty: 1.0, ..ScoringConfig::dynamo() };
        assert_eq!(logits(&cfg, req, &[owner, other]), vec![925.0, 975.0]);
        // Held nowhere: nothing is duplicated, the cost is Dynamo's.
        let cold = [cand(0, 0, 900), other];
        assert_eq!(logits(&cfg, req, &cold), logits(&ScoringConfig::dynamo(), req, &cold));
        // Lower tiers count as in the credit: 100 host blocks are 75 device blocks, 50 short
        // of the owner's 125.
        let host = cand(0, 100, 700);
        assert_eq!(logits(&cfg, req, &[owner, host]), vec![925.0, 150.0 - 75.0 + 700.0 + 50.0]);
    }

    #[test]
    fn temperature_spreads_by_cost() {
        let mut rng = rand::rng();
        let mut seen = [0u32; 3];
        for _ in 0..3000 {
            seen[select(&[0.0, 5.0, 10.0], 1.0, &mut rng).unwrap()] += 1;
        }
        // p ∝ exp(0), exp(-0.5), exp(-1): 0.51, 0.31, 0.19.
        assert!(seen[0] > seen[1] && seen[1] > seen[2] && seen[2] > 300, "{seen:?}");
        assert_eq!(select(&[3.0, 1.0], 0.0, &mut rng), Some(1));
        let cfg = ScoringConfig::default();
        let o = kvgate_shared::wire::ScoringOverrides {
            temperature: Some(2.0),
            kv_overlap_credit: Some(-1.0),
            prefill_load_scale: None,
        };
        let c = cfg.with_overrides(&o);
        assert_eq!((c.temperature, c.kv_overlap_credit), (2.0, 1.0), "invalid values are ignored");
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
