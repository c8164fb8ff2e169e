//! The closed loop: kvgate's prediction of each request checked against what the engine
//! reported for it. Pure bookkeeping; the pool feeds it and publishes what it says.
//!
//! At the decision kvgate predicts, for the replica it chose, how many prompt tokens the
//! engine will find cached: the device-tier overlap in blocks × the block size, at most
//! `prompt_tokens − 1` rounded down to a block (vLLM always computes at least one token).
//! The prediction keeps apart what the index held (*cached now*) and what it credited for
//! prefixes routed there moments ago whose blocks the engine had not announced yet (*in
//! flight*), and remembers the replica's [`Churn`] at that moment. When the request ends the
//! filter reports the engine's `usage.prompt_tokens` and
//! `usage.prompt_tokens_details.cached_tokens`; [`Check`] compares the two and classes the
//! result ([`Class`]): exact; short by the in-flight credit only (the engine scheduled the
//! request before the prefix it was credited with was cached); evicted since (the engine found
//! less than the index held, and its events removed blocks in between); cached since (it found
//! more, and its events stored blocks in between); or over / under with no such explanation.
//!
//! Requests that cannot be checked are counted by [`Unchecked`] reason, never as misses: an
//! engine that does not report cached tokens (vLLM without `--enable-prompt-tokens-details`,
//! SGLang without `--enable-cache-report`), a request that ended without a usage report, one
//! that ran elsewhere than predicted, one whose prompt was estimated, not counted, and one that
//! runs several sequences (the engine reports one sequence's cached tokens, not a known one).
//!
//! A pool whose predictions keep missing raises an **alarm**: over the last [`WINDOW`]
//! checks, fewer than half right (cleared again at 90 %). Exact, in-flight and evicted
//! checks count as right — the index was right when the decision was made. Its usual causes
//! are a block size that differs from the engines' `--block-size`, a salt kvgate does not
//! apply (LoRA, `cache_salt`), a chat template or tokenizer that differs from the engine's
//! (then prompt token counts differ too), or engines without prefix caching.
//!
//! Time to first token is predicted and checked per replica ([`crate::latency`]); the pool's
//! totals of those checks are kept here beside the cache's.

use serde::Serialize;

use crate::index::Churn;
use crate::latency::Latency;
use crate::watch::Watch;

/// Checks the alarm looks at.
pub const WINDOW: usize = 64;
/// Checks needed before the alarm can be raised.
const MIN_CHECKS: usize = 32;

/// What kvgate expected of a request on the replica it chose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prediction {
    /// Prompt tokens the engine will find cached: cached now plus in flight.
    pub cached_tokens: u64,
    /// Of those, the tokens credited for prefixes routed there moments ago that the index
    /// did not hold yet.
    pub in_flight_tokens: u64,
    /// The prompt's tokens, if counted exactly (not estimated or extrapolated).
    pub prompt_tokens: Option<u64>,
    /// The replica's churn when the prediction was made (`None` for a transfer, which does
    /// not depend on the replica's cache).
    pub churn: Option<Churn>,
}

impl Prediction {
    /// The prediction for a `prompt_tokens`-token prompt (`exact`: counted, not estimated) on
    /// a replica whose index held `indexed_blocks` leading device blocks of it and which was
    /// credited `credited_blocks` (at least as many: the in-flight credit), at `churn`.
    pub fn new(
        indexed_blocks: u64,
        credited_blocks: u64,
        block_size: u64,
        prompt_tokens: u64,
        exact: bool,
        churn: Churn,
    ) -> Prediction {
        let max_blocks = prompt_tokens.saturating_sub(1) / block_size.max(1);
        let cached_tokens = credited_blocks.max(indexed_blocks).min(max_blocks) * block_size;
        let cached_now = indexed_blocks.min(max_blocks) * block_size;
        Prediction {
            cached_tokens,
            in_flight_tokens: cached_tokens - cached_now,
            prompt_tokens: exact.then_some(prompt_tokens),
            churn: Some(churn),
        }
    }

    /// The prediction for an SGLang decode worker that receives an exactly counted prompt's
    /// KV from a prefill worker: it reports every transferred token as cached. (A vLLM 0.32
    /// decoder reports the prefill worker's own cache hits instead: the leg's prediction.)
    pub fn transferred(prompt_tokens: u64) -> Prediction {
        Prediction {
            cached_tokens: prompt_tokens,
            in_flight_tokens: 0,
            prompt_tokens: Some(prompt_tokens),
            churn: None,
        }
    }

    /// What the index held: the prediction without its in-flight credit.
    pub fn cached_now(&self) -> u64 {
        self.cached_tokens - self.in_flight_tokens
    }
}

/// What the engine reported for the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct EngineUsage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
}

/// What a check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    /// The engine found exactly the tokens predicted.
    Exact,
    /// It found what the index held, and not (all of) the in-flight credit: it scheduled the
    /// request before the credited prefix was cached.
    InFlight,
    /// It found less than the index held, and the replica's events removed blocks since the
    /// decision.
    Evicted,
    /// It found more than predicted, and the replica's events stored blocks since.
    CachedSince,
    /// Predicted more, unexplained.
    Over,
    /// Predicted less, unexplained.
    Under,
}

impl Class {
    /// Its label in metrics.
    pub fn label(self) -> &'static str {
        match self {
            Class::Exact => "exact",
            Class::InFlight => "in_flight",
            Class::Evicted => "evicted",
            Class::CachedSince => "cached_since",
            Class::Over => "over",
            Class::Under => "under",
        }
    }

    /// Whether the index was right when the decision was made.
    pub fn index_was_right(self) -> bool {
        matches!(self, Class::Exact | Class::InFlight | Class::Evicted)
    }
}

/// One prediction against the engine's report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Predicted minus reported cached tokens.
    pub cached_error: i64,
    /// The prompt was counted exactly and the engine counted it differently.
    pub prompt_mismatch: bool,
    /// What the difference was, if any.
    pub class: Class,
}

impl Check {
    /// Compares a prediction with the engine's report; `churn` is the replica's now.
    pub fn new(predicted: Prediction, engine: EngineUsage, churn: Churn) -> Check {
        let reported = engine.cached_tokens;
        let since = predicted.churn.map(|then| (churn.stored > then.stored, churn.removed > then.removed));
        let (stored, removed) = since.unwrap_or((false, false));
        let class = if reported == predicted.cached_tokens {
            Class::Exact
        } else if predicted.in_flight_tokens > 0
            && (predicted.cached_now()..predicted.cached_tokens).contains(&reported)
        {
            Class::InFlight
        } else if reported < predicted.cached_now() && removed {
            Class::Evicted
        } else if reported > predicted.cached_tokens && stored {
            Class::CachedSince
        } else if reported < predicted.cached_tokens {
            Class::Over
        } else {
            Class::Under
        };
        Check {
            cached_error: predicted.cached_tokens as i64 - reported as i64,
            prompt_mismatch: predicted.prompt_tokens.is_some_and(|p| p != engine.prompt_tokens),
            class,
        }
    }
}

/// Why a routed request's prediction was not checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unchecked {
    /// Its engine reports no cached tokens.
    NoCachedTokens,
    /// It ended (or expired) without a usage report.
    NoUsage,
    /// It ran on another replica than predicted, or computed a prompt it was to receive.
    Moved,
    /// Its prompt was estimated, so nothing was predicted.
    Estimated,
    /// It runs several sequences (a list of prompts, or `n` above 1), and the engine reports
    /// the cached tokens of one of them (vLLM: whichever finished last, or streamed, the
    /// first to answer), which no prediction can name in advance.
    SeveralSequences,
}

impl Unchecked {
    /// Its label in metrics.
    pub fn label(self) -> &'static str {
        match self {
            Unchecked::NoCachedTokens => "no_cached_tokens",
            Unchecked::NoUsage => "no_usage",
            Unchecked::Moved => "moved",
            Unchecked::Estimated => "estimated",
            Unchecked::SeveralSequences => "several_sequences",
        }
    }
}

/// A pool's running record of its checks.
#[derive(Debug)]
pub struct Accuracy {
    /// Whether the index was right, over the last [`WINDOW`] checks.
    watch: Watch,
    totals: AccuracyTotals,
}

impl Default for Accuracy {
    fn default() -> Self {
        Accuracy { watch: Watch::new(WINDOW, MIN_CHECKS, 0.9), totals: AccuracyTotals::default() }
    }
}

/// Counts since the sidecar started, and the alarm, for `/debug/state`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct AccuracyTotals {
    /// Requests checked.
    pub checked: u64,
    /// Predicted exactly.
    pub exact: u64,
    /// Short by the in-flight credit only.
    pub in_flight: u64,
    /// Evicted since the decision.
    pub evicted: u64,
    /// Cached since the decision.
    pub cached_since: u64,
    /// Predicted more cached than the engine found, unexplained.
    pub over: u64,
    /// Predicted less, unexplained.
    pub under: u64,
    /// Prompt token counts that differed from the engine's.
    pub prompt_mismatches: u64,
    /// Routed requests not checked, by reason.
    pub unchecked: UncheckedTotals,
    /// The share of the last checks the index was right about.
    pub recent_exact_ratio: f64,
    /// Whether the alarm is raised.
    pub alarm: bool,
    /// Time-to-first-token predictions checked against the filter's measurement.
    pub ttft: LatencyTotals,
    /// Inter-token-latency predictions checked against the filter's measurement.
    pub itl: LatencyTotals,
}

/// Latency predictions of one kind checked, since the sidecar started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct LatencyTotals {
    /// Predictions checked.
    pub checked: u64,
    /// Of those, close to the measurement ([`crate::latency::Check::close`]).
    pub close: u64,
}

/// Routed requests not checked, by [`Unchecked`] reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct UncheckedTotals {
    /// The engine reports no cached tokens.
    pub no_cached_tokens: u64,
    /// No usage was reported.
    pub no_usage: u64,
    /// It ran elsewhere than predicted.
    pub moved: u64,
    /// Its prompt was estimated.
    pub estimated: u64,
    /// It runs several sequences.
    pub several_sequences: u64,
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
        *match check.class {
            Class::Exact => &mut t.exact,
            Class::InFlight => &mut t.in_flight,
            Class::Evicted => &mut t.evicted,
            Class::CachedSince => &mut t.cached_since,
            Class::Over => &mut t.over,
            Class::Under => &mut t.under,
        } += 1;
        match (self.watch.record(check.class.index_was_right()), self.watch.alarm()) {
            (true, true) => AlarmChange::Raised,
            (true, false) => AlarmChange::Cleared,
            (false, _) => AlarmChange::None,
        }
    }

    /// Counts a check of a `latency` prediction (each replica's alarm is its own:
    /// [`crate::latency::Predictor`]).
    pub fn record_latency(&mut self, latency: Latency, close: bool) {
        let totals = match latency {
            Latency::Ttft => &mut self.totals.ttft,
            Latency::Itl => &mut self.totals.itl,
        };
        totals.checked += 1;
        totals.close += u64::from(close);
    }

    /// Records a prompt the engine counted differently from kvgate (checked or not: the count
    /// is compared even where the cache cannot be).
    pub fn prompt_mismatch(&mut self) {
        self.totals.prompt_mismatches += 1;
    }

    /// Records a routed request that was not checked; it does not move the alarm.
    pub fn unchecked(&mut self, reason: Unchecked) {
        let u = &mut self.totals.unchecked;
        *match reason {
            Unchecked::NoCachedTokens => &mut u.no_cached_tokens,
            Unchecked::NoUsage => &mut u.no_usage,
            Unchecked::Moved => &mut u.moved,
            Unchecked::Estimated => &mut u.estimated,
            Unchecked::SeveralSequences => &mut u.several_sequences,
        } += 1;
    }

    /// The counts and the alarm.
    pub fn totals(&self) -> AccuracyTotals {
        AccuracyTotals { recent_exact_ratio: self.watch.ratio(), alarm: self.watch.alarm(), ..self.totals }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AT: Churn = Churn { stored: 10, removed: 5 };

    fn usage(prompt_tokens: u64, cached_tokens: u64) -> EngineUsage {
        EngineUsage { prompt_tokens, cached_tokens }
    }

    #[test]
    fn the_prediction_leaves_one_token_to_compute() {
        assert_eq!(
            Prediction::new(4, 4, 16, 64, true, AT).cached_tokens,
            48,
            "a fully cached prompt recomputes its last block"
        );
        assert_eq!(Prediction::new(3, 3, 16, 65, true, AT).cached_tokens, 48);
        let p = Prediction::new(0, 0, 16, 10, false, AT);
        assert_eq!((p.cached_tokens, p.in_flight_tokens, p.prompt_tokens), (0, 0, None));
    }

    #[test]
    fn the_in_flight_credit_is_kept_apart() {
        let p = Prediction::new(1, 3, 16, 100, true, AT);
        assert_eq!((p.cached_tokens, p.in_flight_tokens, p.cached_now()), (48, 32, 16));
        let capped = Prediction::new(2, 9, 16, 64, true, AT);
        assert_eq!((capped.cached_tokens, capped.in_flight_tokens), (48, 16), "the cap applies to the credit");
    }

    #[test]
    fn checks_compare_cached_and_prompt_tokens() {
        let predicted = Prediction::new(2, 2, 16, 40, true, AT);
        let c = Check::new(predicted, usage(40, 32), AT);
        assert_eq!((c.class, c.prompt_mismatch), (Class::Exact, false));
        let c = Check::new(predicted, usage(41, 0), AT);
        assert_eq!((c.class, c.cached_error, c.prompt_mismatch), (Class::Over, 32, true));
        let c = Check::new(Prediction::new(0, 0, 16, 40, false, AT), usage(41, 16), AT);
        assert_eq!((c.class, c.prompt_mismatch), (Class::Under, false), "an estimate is not compared");
    }

    #[test]
    fn misses_are_explained_only_by_what_happened_in_between() {
        let credited = Prediction::new(1, 3, 16, 100, true, AT);
        assert_eq!(Check::new(credited, usage(100, 48), AT).class, Class::Exact);
        assert_eq!(Check::new(credited, usage(100, 16), AT).class, Class::InFlight, "the credit had not landed");
        assert_eq!(Check::new(credited, usage(100, 32), AT).class, Class::InFlight, "part of it had");
        assert_eq!(Check::new(credited, usage(100, 0), AT).class, Class::Over, "less than the index held");
        let removed = Churn { removed: AT.removed + 1, ..AT };
        let stored = Churn { stored: AT.stored + 1, ..AT };
        let indexed = Prediction::new(3, 3, 16, 100, true, AT);
        assert_eq!(Check::new(indexed, usage(100, 16), removed).class, Class::Evicted);
        assert_eq!(Check::new(indexed, usage(100, 16), stored).class, Class::Over, "a store explains no shortfall");
        assert_eq!(Check::new(indexed, usage(100, 80), stored).class, Class::CachedSince);
        assert_eq!(Check::new(indexed, usage(100, 80), removed).class, Class::Under, "a removal explains no gain");
        let transfer = Prediction::transferred(100);
        assert_eq!(Check::new(transfer, usage(100, 0), removed).class, Class::Over, "a transfer has no churn");
    }

    #[test]
    fn unchecked_requests_are_counted_apart_and_leave_the_alarm_alone() {
        let mut a = Accuracy::default();
        for _ in 0..WINDOW {
            a.unchecked(Unchecked::NoCachedTokens);
        }
        a.unchecked(Unchecked::NoUsage);
        let t = a.totals();
        assert_eq!((t.checked, t.unchecked.no_cached_tokens, t.unchecked.no_usage, t.alarm), (0, 64, 1, false));
    }

    #[test]
    fn the_alarm_rises_on_persistent_misses_and_clears_when_they_stop() {
        let mut a = Accuracy::default();
        let miss = Check { cached_error: -64, prompt_mismatch: false, class: Class::Under };
        let hit = Check { cached_error: 0, prompt_mismatch: false, class: Class::Exact };
        let evicted = Check { cached_error: 32, prompt_mismatch: false, class: Class::Evicted };
        for _ in 0..MIN_CHECKS - 1 {
            assert_eq!(a.record(miss), AlarmChange::None, "too few checks to judge");
        }
        assert_eq!(a.record(miss), AlarmChange::Raised);
        assert!(a.totals().alarm);
        let mut cleared = None;
        for i in 0..WINDOW {
            if a.record(if i % 2 == 0 { hit } else { evicted }) == AlarmChange::Cleared {
                cleared = Some(i);
                break;
            }
        }
        assert_eq!(cleared, Some((WINDOW * 9).div_ceil(10) - 1), "cleared once 90 % of the window was right");
        let t = a.totals();
        assert_eq!(
            (t.checked, t.under, t.exact + t.evicted, t.alarm),
            (MIN_CHECKS as u64 + cleared.unwrap() as u64 + 1, MIN_CHECKS as u64, cleared.unwrap() as u64 + 1, false)
        );
    }
}
