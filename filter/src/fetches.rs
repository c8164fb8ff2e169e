//! When to (re)fetch each model's tokenizer bundle: pure bookkeeping, no hostcalls, so the
//! rules are unit-tested natively.
//!
//! - A listed model without a loaded tokenizer is fetched at once.
//! - A failed fetch (the sidecar answered an error, nothing, or a bundle that does not load)
//!   is retried after `retry`, doubling with each further failure up to [`MAX_BACKOFF`]: a
//!   model that cannot load costs one request to the sidecar every minute, not every tick.
//! - Each failure is logged by the caller with the model and the cause; [`Fetches::missing`]
//!   lists the models whose requests the sidecar tokenizes because of it.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

/// The longest wait between two fetches of a model whose tokenizer keeps failing.
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// How long to wait after the `failures`-th failure in a row (1 or more): `retry`, doubling
/// with each further failure, at most `max`. [`crate::redelivery`] backs off the same way.
pub fn backoff(retry: Duration, failures: u32, max: Duration) -> Duration {
    retry.saturating_mul(1 << (failures.max(1) - 1).min(16)).min(max)
}

/// A model whose last fetch failed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Failed {
    /// Failures in a row.
    failures: u32,
    /// Not fetched again before this.
    retry_at: SystemTime,
    /// The last failure's cause.
    cause: String,
}

/// Per-model fetch state of one VM.
#[derive(Debug, Default)]
pub struct Fetches {
    /// Fetches in flight.
    in_flight: std::collections::HashSet<String>,
    failed: HashMap<String, Failed>,
}

impl Fetches {
    /// The models among `wanted` (listed, tokenizer not loaded) to fetch now; each is marked in
    /// flight.
    pub fn due<'a>(&mut self, wanted: impl IntoIterator<Item = &'a str>, now: SystemTime) -> Vec<String> {
        let mut due = Vec::new();
        for model in wanted {
            let waiting = self.failed.get(model).is_some_and(|f| now < f.retry_at);
            if !waiting && self.in_flight.insert(model.to_owned()) {
                due.push(model.to_owned());
            }
        }
        due
    }

    /// The fetch of `model` succeeded.
    pub fn loaded(&mut self, model: &str) {
        self.in_flight.remove(model);
        self.failed.remove(model);
    }

    /// The fetch of `model` failed with `cause`; returns how long until it is tried again.
    pub fn failed(&mut self, model: &str, cause: String, retry: Duration, now: SystemTime) -> Duration {
        self.in_flight.remove(model);
        let failures = self.failed.get(model).map_or(1, |f| f.failures.saturating_add(1));
        let wait = backoff(retry, failures, MAX_BACKOFF);
        self.failed.insert(model.to_owned(), Failed { failures, retry_at: now + wait, cause });
        wait
    }

    /// Forgets models the sidecar no longer lists.
    pub fn retain(&mut self, listed: impl Fn(&str) -> bool) {
        self.failed.retain(|m, _| listed(m));
    }

    /// Models whose tokenizer could not be loaded, with the failures in a row and the last
    /// cause, sorted by name.
    pub fn missing(&self) -> Vec<(&str, u32, &str)> {
        let mut out: Vec<(&str, u32, &str)> =
            self.failed.iter().map(|(m, f)| (m.as_str(), f.failures, f.cause.as_str())).collect();
        out.sort_unstable();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RETRY: Duration = Duration::from_secs(1);

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn a_missing_model_is_fetched_once_at_a_time() {
        let mut f = Fetches::default();
        assert_eq!(f.due(["a", "b"], at(0)), ["a", "b"]);
        assert!(f.due(["a", "b"], at(0)).is_empty(), "in flight: not asked again");
        f.loaded("a");
        assert_eq!(f.due(["a"], at(0)), ["a"], "a model that is wanted again is fetched again");
    }

    #[test]
    fn failures_back_off_exponentially_up_to_a_minute() {
        let mut f = Fetches::default();
        let mut now = at(100);
        let mut waits = Vec::new();
        for _ in 0..10 {
            assert_eq!(f.due(["Qwen/Qwen3-8B"], now), ["Qwen/Qwen3-8B"]);
            let wait = f.failed("Qwen/Qwen3-8B", "404".into(), RETRY, now);
            assert!(f.due(["Qwen/Qwen3-8B"], now + wait - Duration::from_millis(1)).is_empty(), "not before its time");
            waits.push(wait.as_secs());
            now += wait;
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 60, 60, 60, 60]);
        assert_eq!(f.missing(), [("Qwen/Qwen3-8B", 10, "404")]);
        f.loaded("Qwen/Qwen3-8B");
        assert!(f.missing().is_empty());
    }

    #[test]
    fn unlisted_models_are_forgotten() {
        let mut f = Fetches::default();
        f.due(["a", "b"], at(0));
        f.failed("a", "x".into(), RETRY, at(0));
        f.failed("b", "y".into(), RETRY, at(0));
        f.retain(|m| m == "b");
        assert_eq!(f.missing(), [("b", 1, "y")]);
    }
}
