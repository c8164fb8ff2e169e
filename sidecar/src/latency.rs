//! Time to first token, predicted per replica from the exact view, learned online, and
//! checked. Pure: the load table keeps one [`ReplicaTtft`] per replica, asks it at each
//! decision and feeds it what each streamed request measured; the pool publishes the checks.
//!
//! **Inputs** ([`TtftInputs`]), taken when the request is booked: the prefill tokens the
//! replica must compute before the request's first token — its own, left after the cache
//! overlap, plus the prefill booked there that has not produced a first token yet (and what
//! the engine reports waiting beyond kvgate's bookings) — and the sequences it is decoding
//! meanwhile, which share each engine step with the prefill.
//!
//! **Model.** `ttft = a + b · prefill_ahead + c · decoding`, fitted per replica by least
//! squares (with a slight ridge, so that an input that never varies — a replica that never
//! decodes while it prefills — gets no weight rather than any) over its last [`WINDOW`]
//! streamed requests' TTFT as the filter measured it: from the moment the request left the
//! filter for the engine to the first byte of its response. Nothing is assumed up front, no
//! constant from any engine or simulator: a replica predicts nothing until it has learned
//! from [`MIN_SAMPLES`] requests. A replica that slows down (throttled, a noisy neighbour, a
//! changed engine configuration) is relearned once the window holds only its new self. (A
//! recursive least-squares fit with forgetting, tried first, lost its forgetting or its
//! stability when an input stayed constant.)
//!
//! **Check.** Each prediction is compared with the measured TTFT ([`TtftCheck`]): *close* when
//! within [`TOLERANCE`] of it, plus [`SLACK`]. Each replica watches its last [`WATCH`] checks:
//! fewer than half close (after [`MIN_WATCHED`]) raises its alarm, 80 % close clears it. A
//! replica slowed behind kvgate's back raises it until its model has relearned it; one whose
//! TTFT the inputs do not explain keeps it raised.

use std::collections::VecDeque;
use std::time::Duration;

use serde::Serialize;

/// Requests a replica learns from before it predicts.
pub const MIN_SAMPLES: u64 = 8;
/// Requests each replica's model is fitted to: its latest.
pub const WINDOW: usize = 32;
/// The ridge added to each coefficient's normal equation, in the scaled units of
/// [`features`]: far below what any varying input contributes.
const RIDGE: f64 = 1e-3;
/// How far a prediction may be from the measured TTFT, as a share of it, and still be close.
pub const TOLERANCE: f64 = 0.25;
/// And in absolute terms, on top: a few milliseconds say nothing about the model.
pub const SLACK: Duration = Duration::from_millis(5);
/// Checks each replica's alarm looks at.
pub const WATCH: usize = 16;
/// Checks needed before the alarm can be raised.
pub const MIN_WATCHED: usize = 8;

/// What the replica faces when a request is booked on it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TtftInputs {
    /// Prefill tokens to compute before its first token: its own left after the cache
    /// overlap, and those booked there ahead of it.
    pub prefill_ahead: u64,
    /// Sequences the replica is decoding.
    pub decoding: u64,
}

/// One replica's model: its latest requests and the coefficients fitted to them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TtftModel {
    /// The scaled inputs and the measured TTFT (ms) of the last [`WINDOW`] requests.
    window: VecDeque<([f64; 3], f64)>,
    /// Milliseconds: at rest, per thousand prefill tokens, per ten decoding sequences.
    coefficients: [f64; 3],
    samples: u64,
}

/// The model's inputs, scaled so their coefficients are of like size.
fn features(inputs: TtftInputs) -> [f64; 3] {
    [1.0, inputs.prefill_ahead as f64 / 1_000.0, inputs.decoding as f64 / 10.0]
}

fn dot(a: &[f64; 3], b: &[f64; 3]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

impl TtftModel {
    /// The TTFT it predicts for `inputs`; `None` until it has learned from [`MIN_SAMPLES`]
    /// requests.
    ///
    /// ```
    /// use kvgate_sidecar::latency::{TtftInputs, TtftModel};
    /// use std::time::Duration;
    /// let mut m = TtftModel::default();
    /// let inputs = |tokens| TtftInputs { prefill_ahead: tokens, decoding: 0 };
    /// assert_eq!(m.predict(inputs(1000)), None, "nothing learned yet");
    /// // 5 ms at rest and 20 ms per thousand tokens.
    /// for tokens in (0..40).map(|i| 100 + (i % 8) * 500) {
    ///     m.learn(inputs(tokens), Duration::from_micros(5_000 + 20 * tokens));
    /// }
    /// let predicted = m.predict(inputs(3000)).unwrap().as_secs_f64() * 1e3;
    /// assert!((predicted - 65.0).abs() < 0.5, "{predicted}");
    /// ```
    pub fn predict(&self, inputs: TtftInputs) -> Option<Duration> {
        (self.samples >= MIN_SAMPLES).then(|| millis(dot(&self.coefficients, &features(inputs))))
    }

    /// Learns from one request that met `inputs` and whose first token came after `measured`.
    pub fn learn(&mut self, inputs: TtftInputs, measured: Duration) {
        if self.window.len() == WINDOW {
            self.window.pop_front();
        }
        self.window.push_back((features(inputs), measured.as_secs_f64() * 1e3));
        self.coefficients = fit(&self.window);
        self.samples += 1;
    }

    /// Requests learned from.
    pub fn samples(&self) -> u64 {
        self.samples
    }
}

/// The ridge least-squares coefficients of `samples`: the solution of `(XᵀX + RIDGE·I) c = Xᵀy`.
fn fit(samples: &VecDeque<([f64; 3], f64)>) -> [f64; 3] {
    let mut a = [[0.0; 3]; 3];
    let mut b = [0.0; 3];
    for (x, y) in samples {
        for i in 0..3 {
            for j in 0..3 {
                a[i][j] += x[i] * x[j];
            }
            b[i] += x[i] * y;
        }
    }
    for (i, row) in a.iter_mut().enumerate() {
        row[i] += RIDGE;
    }
    solve(a, b)
}

/// Solves `a c = b` for a symmetric positive definite `a` (Cholesky).
fn solve(a: [[f64; 3]; 3], b: [f64; 3]) -> [f64; 3] {
    let mut l = [[0.0; 3]; 3];
    for i in 0..3 {
        for j in 0..=i {
            let sum: f64 = (0..j).map(|k| l[i][k] * l[j][k]).sum();
            l[i][j] = if i == j { (a[i][i] - sum).max(f64::MIN_POSITIVE).sqrt() } else { (a[i][j] - sum) / l[j][j] };
        }
    }
    let mut z = [0.0; 3];
    for i in 0..3 {
        z[i] = (b[i] - (0..i).map(|k| l[i][k] * z[k]).sum::<f64>()) / l[i][i];
    }
    let mut c = [0.0; 3];
    for i in (0..3).rev() {
        c[i] = (z[i] - (i + 1..3).map(|k| l[k][i] * c[k]).sum::<f64>()) / l[i][i];
    }
    c
}

/// One TTFT prediction against what the filter measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TtftCheck {
    /// Predicted at the decision, in seconds.
    pub predicted_secs: f64,
    /// Measured by the filter: from the request leaving it to the response's first byte.
    pub measured_secs: f64,
}

impl TtftCheck {
    /// The prediction against the measurement.
    pub fn new(predicted: Duration, measured: Duration) -> TtftCheck {
        TtftCheck { predicted_secs: predicted.as_secs_f64(), measured_secs: measured.as_secs_f64() }
    }

    /// `|predicted − measured| / measured` (0 when both are 0).
    pub fn relative_error(&self) -> f64 {
        let error = (self.predicted_secs - self.measured_secs).abs();
        if error == 0.0 {
            0.0
        } else {
            error / self.measured_secs.max(1e-6)
        }
    }

    /// Within [`TOLERANCE`] of the measured TTFT, plus [`SLACK`].
    ///
    /// ```
    /// use kvgate_sidecar::latency::TtftCheck;
    /// use std::time::Duration;
    /// let ms = Duration::from_millis;
    /// assert!(TtftCheck::new(ms(120), ms(100)).close());
    /// assert!(!TtftCheck::new(ms(140), ms(100)).close());
    /// assert!(TtftCheck::new(ms(6), ms(2)).close(), "a few milliseconds off");
    /// ```
    pub fn close(&self) -> bool {
        let error = (self.predicted_secs - self.measured_secs).abs();
        error <= TOLERANCE * self.measured_secs + SLACK.as_secs_f64()
    }
}

/// One replica's TTFT: its model, and the watch over its last predictions.
#[derive(Debug, Clone, Default)]
pub struct ReplicaTtft {
    model: TtftModel,
    recent: VecDeque<bool>,
    alarm: bool,
}

impl ReplicaTtft {
    /// The TTFT predicted for `inputs` (see [`TtftModel::predict`]).
    pub fn predict(&self, inputs: TtftInputs) -> Option<Duration> {
        self.model.predict(inputs)
    }

    /// A request that met `inputs`, for which `predicted` was predicted, measured `measured`:
    /// the model learns from it. Returns the check, if something was predicted, and the
    /// alarm's new state if this check changed it.
    pub fn measured(
        &mut self,
        inputs: TtftInputs,
        predicted: Option<Duration>,
        measured: Duration,
    ) -> Option<(TtftCheck, Option<bool>)> {
        self.model.learn(inputs, measured);
        let check = TtftCheck::new(predicted?, measured);
        if self.recent.len() == WATCH {
            self.recent.pop_front();
        }
        self.recent.push_back(check.close());
        let ratio = self.recent_close_ratio();
        let raise = !self.alarm && self.recent.len() >= MIN_WATCHED && ratio < 0.5;
        let clear = self.alarm && ratio >= 0.8;
        if raise || clear {
            self.alarm = raise;
        }
        Some((check, (raise || clear).then_some(self.alarm)))
    }

    /// Whether its alarm is raised.
    pub fn alarm(&self) -> bool {
        self.alarm
    }

    /// The share of its last checks that were close (1 with none).
    pub fn recent_close_ratio(&self) -> f64 {
        if self.recent.is_empty() {
            return 1.0;
        }
        self.recent.iter().filter(|c| **c).count() as f64 / self.recent.len() as f64
    }

    /// Requests its model learned from.
    pub fn samples(&self) -> u64 {
        self.model.samples()
    }
}

/// `ms` milliseconds as a duration, never negative (the fitted line may dip below zero far
/// from what it learned).
fn millis(ms: f64) -> Duration {
    Duration::from_secs_f64(ms.max(0.0) / 1e3)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replica whose TTFT is `at_rest` ms plus `per_k` ms per thousand prefill tokens plus
    /// `per_seq` ms per decoding sequence.
    fn replica(at_rest: f64, per_k: f64, per_seq: f64) -> impl Fn(TtftInputs) -> Duration {
        move |i| millis(at_rest + per_k * i.prefill_ahead as f64 / 1e3 + per_seq * i.decoding as f64)
    }

    fn traffic(n: u64) -> impl Iterator<Item = TtftInputs> {
        (0..n).map(|i| TtftInputs { prefill_ahead: 200 + (i * 733) % 6000, decoding: (i * 7) % 24 })
    }

    fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1e3
    }

    #[test]
    fn it_learns_each_input_and_predicts_inputs_it_has_not_seen() {
        let truth = replica(12.0, 30.0, 1.5);
        let mut m = TtftModel::default();
        for inputs in traffic(60) {
            m.learn(inputs, truth(inputs));
        }
        let unseen = TtftInputs { prefill_ahead: 9_000, decoding: 40 };
        let (predicted, actual) = (ms(m.predict(unseen).unwrap()), ms(truth(unseen)));
        assert!((predicted - actual).abs() < 0.01 * actual, "{predicted} vs {actual}");
    }

    #[test]
    fn a_replica_that_slows_down_is_relearned() {
        let mut m = TtftModel::default();
        for inputs in traffic(200) {
            m.learn(inputs, replica(10.0, 20.0, 1.0)(inputs));
        }
        let slow = replica(30.0, 80.0, 4.0);
        let probe = TtftInputs { prefill_ahead: 3_000, decoding: 10 };
        let before = ms(m.predict(probe).unwrap());
        assert!(before < 0.5 * ms(slow(probe)), "{before}: still the fast replica");
        for inputs in traffic(80) {
            m.learn(inputs, slow(inputs));
        }
        let after = ms(m.predict(probe).unwrap());
        assert!((after - ms(slow(probe))).abs() < 0.05 * ms(slow(probe)), "{after} vs {}", ms(slow(probe)));
    }

    #[test]
    fn an_input_that_never_varies_gets_no_weight_and_breaks_nothing() {
        let truth = replica(8.0, 25.0, 0.0);
        let mut m = TtftModel::default();
        for inputs in traffic(5_000).map(|i| TtftInputs { decoding: 0, ..i }) {
            m.learn(inputs, truth(inputs));
        }
        assert!(m.coefficients.iter().all(|c| c.is_finite()) && m.coefficients[2].abs() < 1e-3, "{m:?}");
        let probe = TtftInputs { prefill_ahead: 2_000, decoding: 0 };
        assert!((ms(m.predict(probe).unwrap()) - 58.0).abs() < 0.5);
    }

    #[test]
    fn it_predicts_nothing_before_it_has_learned_enough_and_never_below_zero() {
        let mut m = TtftModel::default();
        let inputs = TtftInputs { prefill_ahead: 1_000, decoding: 0 };
        for _ in 1..MIN_SAMPLES {
            m.learn(inputs, Duration::from_millis(10));
            assert_eq!(m.predict(inputs), None);
        }
        m.learn(inputs, Duration::from_millis(10));
        assert!(m.predict(inputs).is_some());
        // Steeply falling with load, then asked far beyond: the line dips below zero.
        let mut m = TtftModel::default();
        for tokens in [100u64, 200, 300, 400, 500, 600, 700, 800, 900] {
            m.learn(TtftInputs { prefill_ahead: tokens, decoding: 0 }, millis(100.0 - 0.1 * tokens as f64));
        }
        assert_eq!(m.predict(TtftInputs { prefill_ahead: 5_000, decoding: 0 }), Some(Duration::ZERO));
    }

    #[test]
    fn a_replica_slowed_behind_its_back_raises_its_alarm_until_relearned() {
        let mut r = ReplicaTtft::default();
        let fast = replica(10.0, 20.0, 1.0);
        let record = |r: &mut ReplicaTtft, inputs: TtftInputs, truth: Duration| {
            let predicted = r.predict(inputs);
            r.measured(inputs, predicted, truth)
        };
        for inputs in traffic(100) {
            let checked = record(&mut r, inputs, fast(inputs));
            assert!(checked.is_none_or(|(c, change)| c.close() && change.is_none()), "{checked:?}");
        }
        let slow = replica(40.0, 80.0, 4.0);
        let changes: Vec<(usize, bool)> = traffic(200)
            .enumerate()
            .filter_map(|(i, inputs)| Some((i, record(&mut r, inputs, slow(inputs))?.1?)))
            .collect();
        assert_eq!(changes.len(), 2, "raised once, cleared once: {changes:?}");
        let ((raised, up), (cleared, down)) = (changes[0], changes[1]);
        assert!(up && !down);
        // Its watch was all close: raised by the ninth miss, when fewer than half of it are.
        assert_eq!(raised, WATCH / 2, "{changes:?}");
        assert!(cleared < 60, "relearned within tens of requests: {changes:?}");
        assert!(!r.alarm() && r.recent_close_ratio() >= 0.8);
    }

    #[test]
    fn an_input_that_never_varies_does_not_stop_the_others_being_relearned() {
        let still = |n| traffic(n).map(|i| TtftInputs { decoding: 0, ..i });
        let mut m = TtftModel::default();
        for inputs in still(1_000) {
            m.learn(inputs, replica(10.0, 20.0, 0.0)(inputs));
        }
        let slow = replica(30.0, 80.0, 0.0);
        for inputs in still(150) {
            m.learn(inputs, slow(inputs));
        }
        let probe = TtftInputs { prefill_ahead: 3_000, decoding: 0 };
        let (after, truth) = (ms(m.predict(probe).unwrap()), ms(slow(probe)));
        assert!((after - truth).abs() < 0.05 * truth, "{after} vs {truth}");
    }
}
