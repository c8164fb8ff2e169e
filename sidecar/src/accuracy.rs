//! The closed loop: kvgate's prediction of each request checked against what the engine
//! reported for it. Pure bookkeeping; the pool feeds it and publishes what it says.
//!
//! At the decision kvgate predicts, for the replica it chose, how many prompt tokens the
//! engine will find cached: the device-tier overlap in blocks × the block size, at most
//! `prompt_tokens − 1` rounded down to a block (vLLM always computes at least one token).
//! When the request ends the filter reports the engine's `usage.prompt_tokens` and
//! `usage.prompt_tokens_details.cached_tokens`; [`Check`] compares the two.
//!
//! A pool whose predictions keep missing raises an **alarm**: over the last [`WINDOW`]
//! checks, fewer than half exact (cleared again at 90 %). Its usual causes are a block size
//! that differs from the engines' `--block-size`, a salt kvgate does not apply (LoRA,
//! `cache_salt`), a chat template or tokenizer that differs from the engine's (then prompt
//! token counts differ too), or engines without prefix caching.

use std::collections::VecDeque;

use serde::Serialize;

/// Checks the alarm looks at.
pub const WINDOW: usize = 64;
/// Checks needed before the alarm can be raised.
const MIN_CHECKS: usize = 32;

/// What kvgate expected of a request on the replica it chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prediction {
    /// Prompt tokens the engine will find cached.
    pub cached_tokens: u64,
    /// The prompt's tokens, if counted exactly (not estimated or extrapolated).
    pub prompt_tokens: Option<u64>,
}

impl Prediction {
    /// The prediction for `overlap_blocks` cached device blocks of a `prompt_tokens`-token
    /// prompt (`exact`: counted, not estimated).
    pub fn new(overlap_blocks: u64, block_size: u64, prompt_tokens: u64, exact: bool) -> Prediction {
        let max_blocks = prompt_tokens.saturating_sub(1) / block_size.max(1);
        Prediction {
            cached_tokens: overlap_blocks.min(max_blocks) * block_size,
            prompt_tokens: exact.then_some(prompt_tokens),
        }
    }

    /// The prediction for a decode worker that receives an exactly counted prompt's KV from
    /// a prefill worker: engines report transferred tokens as cached. vLLM computes the last
    /// prompt token itself (it samples the first output token from it); SGLang computes none.
    pub fn transferred(prompt_tokens: u64, computes_last: bool) -> Prediction {
        Prediction {
            cached_tokens: prompt_tokens.saturating_sub(u64::from(computes_last)),
            prompt_tokens: Some(prompt_tokens),
        }
    }
}

/// What the engine reported for the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct EngineUsage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens` (0 when the engine reports no details).
    pub cached_tokens: u64,
}

/// One prediction against the engine's report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Predicted minus reported cached tokens.
    pub cached_error: i64,
    /// The prompt was counted exactly and the engine counted it differently.
    pub prompt_mismatch: bool,
}

impl Check {
    /// Compares a prediction with the engine's report.
    pub fn new(predicted: Prediction, engine: EngineUsage) -> Check {
        Check {
            cached_error: predicted.cached_tokens as i64 - engine.cached_tokens as i64,
            prompt_mismatch: predicted.prompt_tokens.is_some_and(|p| p != engine.prompt_tokens),
        }
    }

    /// `exact`, `over` or `under`.
    pub fn outcome(&self) -> &'static str {
        match self.cached_error {
            0 => "exact",
            e if e > 0 => "over",
            _ => "under",
        }
    }
}

/// A pool's running record of its checks.
#[derive(Debug, Default)]
pub struct Accuracy {
    recent: VecDeque<bool>,
    totals: AccuracyTotals,
    alarm: bool,
}

/// Counts since the sidecar started, and the alarm, for `/debug/state`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct AccuracyTotals {
    /// Requests checked.
    pub checked: u64,
    /// Predicted exactly.
    pub exact: u64,
    /// Predicted more cached than the engine found.
    pub over: u64,
    /// Predicted less.
    pub under: u64,
    /// Prompt token counts that differed from the engine's.
    pub prompt_mismatches: u64,
    /// The share of the last checks predicted exactly.
    pub recent_exact_ratio: f64,
    /// Whether the alarm is raised.
    pub alarm: bool,
}

/// What a check did to the alarm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AlarmChange {
    /// Nothing.
    None,
    /// Raised by this check.
    Raised,
    /// Cleared by this check.
    Cleared,
}

impl Accuracy {
    /// Records a check.
    pub fn record(&mut self, check: Check) -> AlarmChange {
        let t = &mut self.totals;
        t.checked += 1;
        match check.outcome() {
            "exact" => t.exact += 1,
            "over" => t.over += 1,
            _ => t.under += 1,
        }
        t.prompt_mismatches += u64::from(check.prompt_mismatch);
        if self.recent.len() == WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(check.cached_error == 0);
        let ratio = self.recent_exact_ratio();
        match (self.alarm, self.recent.len() >= MIN_CHECKS && ratio < 0.5, ratio >= 0.9) {
            (false, true, _) => {
                self.alarm = true;
                AlarmChange::Raised
            }
            (true, _, true) => {
                self.alarm = false;
                AlarmChange::Cleared
            }
            _ => AlarmChange::None,
        }
    }

    fn recent_exact_ratio(&self) -> f64 {
        if self.recent.is_empty() {
            return 1.0;
        }
        self.recent.iter().filter(|e| **e).count() as f64 / self.recent.len() as f64
    }

    /// The counts and the alarm.
    pub fn totals(&self) -> AccuracyTotals {
        AccuracyTotals { recent_exact_ratio: self.recent_exact_ratio(), alarm: self.alarm, ..self.totals }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prediction_leaves_one_token_to_compute() {
        assert_eq!(
            Prediction::new(4, 16, 64, true).cached_tokens,
            48,
            "a fully cached prompt recomputes its last block"
        );
        assert_eq!(Prediction::new(3, 16, 65, true).cached_tokens, 48);
        assert_eq!(Prediction::new(0, 16, 10, false), Prediction { cached_tokens: 0, prompt_tokens: None });
    }

    #[test]
    fn checks_compare_cached_and_prompt_tokens() {
        let predicted = Prediction::new(2, 16, 40, true);
        let c = Check::new(predicted, EngineUsage { prompt_tokens: 40, cached_tokens: 32 });
        assert_eq!((c.outcome(), c.prompt_mismatch), ("exact", false));
        let c = Check::new(predicted, EngineUsage { prompt_tokens: 41, cached_tokens: 0 });
        assert_eq!((c.outcome(), c.cached_error, c.prompt_mismatch), ("over", 32, true));
        let c = Check::new(Prediction::new(0, 16, 40, false), EngineUsage { prompt_tokens: 41, cached_tokens: 16 });
        assert_eq!((c.outcome(), c.prompt_mismatch), ("under", false), "an estimate is not compared");
    }

    #[test]
    fn the_alarm_rises_on_persistent_misses_and_clears_when_they_stop() {
        let mut a = Accuracy::default();
        let miss = Check { cached_error: -64, prompt_mismatch: false };
        let hit = Check { cached_error: 0, prompt_mismatch: false };
        for _ in 0..MIN_CHECKS - 1 {
            assert_eq!(a.record(miss), AlarmChange::None, "too few checks to judge");
        }
        assert_eq!(a.record(miss), AlarmChange::Raised);
        assert!(a.totals().alarm);
        let mut cleared = None;
        for i in 0..WINDOW {
            if a.record(hit) == AlarmChange::Cleared {
                cleared = Some(i);
                break;
            }
        }
        assert_eq!(cleared, Some((WINDOW * 9).div_ceil(10) - 1), "cleared once 90 % of the window is exact");
        let t = a.totals();
        assert_eq!(
            (t.checked, t.under, t.alarm),
            (MIN_CHECKS as u64 + cleared.unwrap() as u64 + 1, MIN_CHECKS as u64, false)
        );
    }
}
