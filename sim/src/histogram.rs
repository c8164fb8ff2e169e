//! vLLM's time-to-first-token histogram: what an engine records, and [`crate::metrics`]
//! renders.

/// vLLM's buckets for `vllm:time_to_first_token_seconds`.
pub const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];

/// A cumulative histogram over vLLM's TTFT buckets.
#[derive(Debug, Clone, Default)]
pub struct Histogram {
    /// Observations at or below each bucket's bound.
    pub counts: [u64; TTFT_BUCKETS.len()],
    /// All observations.
    pub count: u64,
    /// Their sum, in seconds.
    pub sum: f64,
}

impl Histogram {
    /// Records one observation, in seconds.
    pub fn observe(&mut self, seconds: f64) {
        for (bound, count) in TTFT_BUCKETS.iter().zip(&mut self.counts) {
            if seconds <= *bound {
                *count += 1;
            }
        }
        self.count += 1;
        self.sum += seconds;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::default();
        h.observe(0.003);
        h.observe(0.3);
        h.observe(5000.0);
        assert_eq!(h.counts[0], 0);
        assert_eq!(h.counts[1], 1, "≤ 5 ms");
        assert_eq!(h.counts[9], 2, "≤ 0.5 s");
        assert_eq!(h.counts[21], 2, "5000 s is only in +Inf");
        assert_eq!(h.count, 3);
    }
}
