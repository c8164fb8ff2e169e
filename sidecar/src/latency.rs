//! Time to first token (TTFT) and inter-token latency (ITL), predicted per replica from the
//! exact view, learned online, and checked. Pure: the load table keeps one [`Predictor`] of
//! each per replica, asks them at each decision and feeds them what each streamed request
//! measured; the pool publishes the checks.
//!
//! **Inputs** ([`Inputs`]), taken when the request is booked. For its TTFT: the prefill
//! tokens the replica must compute before the request's first token — its own, left after
//! the cache overlap, plus what is left of the prefill booked there before it (the load table
//! drains that backlog at the speed the TTFT model learned, `b` — at the replica's prefill
//! rate while the model does not predict — and never counts more than the prefill whose first
//! token has not come); the prefill booked there that the replica's KV events do not show
//! computed beyond that (a chunk whose step has not ended, prefill the engine keeps waiting:
//! what a speed cannot see; 0 without trusted events) — and the sequences it is decoding
//! meanwhile, which share each engine
//! step with the prefill. For its ITL: what will share the steps that decode it — the
//! sequences on the replica, this one included, and the prefill booked there before it (an
//! engine that chunks prefill computes it in the same steps), drained and not stored alike.
//!
//! **Model.** `latency = a + b · prefill + c · sequences + d · not_stored` with
//! `b, c, d ≥ 0`, fitted per replica
//! by least squares over its last [`WINDOW`] timed requests — streamed, their prompt counted
//! and computed there, answered 2xx — as the filter measured them: the TTFT from the moment
//! the request left the filter for the engine to the first byte of its response; the ITL as
//! the time from that first byte to the last over the tokens the engine reported producing,
//! less one. Each request weighs
//! `1 / latency²`, so the fit minimises the relative error, which is what the check measures: on a
//! busy replica the slow requests scatter most (they share steps with requests booked after
//! them), and an unweighted fit lets that scatter set the line for the quick ones. The inputs
//! are centred on the window's means and their slopes lightly ridged, so an input that does not vary (a
//! replica that never decodes while it prefills) gets no weight, whatever its value; a slope
//! the data would make negative is held at 0, so more load never looks faster. Nothing is
//! assumed up front, no constant from any engine or simulator: a replica predicts nothing until
//! its window holds [`MIN_SAMPLES`] requests. A replica that slows down (throttled, a noisy
//! neighbour, a changed engine configuration) is relearned once the window holds only its new
//! self; one that has taught nothing for [`FORGET_AFTER`] (routed around because it looked
//! slow, or idle) is forgotten and learned afresh, so a replica that recovered is found again.
//!
//! **Check.** Each prediction is compared with the measurement ([`Check`]): *close* when
//! within [`TOLERANCE`] of it, plus a slack ([`Latency::slack`]). Each replica watches its last
//! [`WATCH`] checks of each: fewer than half close (after [`MIN_WATCHED`]) raises its alarm,
//! 80 % close clears it. A replica slowed behind kvgate's back raises it until its model has
//! relearned it; one whose latency the inputs do not explain keeps it raised.

use std::collections::VecDeque;
use std::ops::{Index, IndexMut};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::watch::Watch;

/// Requests a replica's window must hold before it predicts.
pub const MIN_SAMPLES: usize = 8;
/// Requests each replica's model is fitted to: its latest.
pub const WINDOW: usize = 32;
/// A replica that has taught its model nothing for this long is forgotten.
pub const FORGET_AFTER: Duration = Duration::from_secs(60);
/// A measurement below this share of the window's median weighs in the fit as one at it
/// does: one freak quick answer must not outweigh the rest of the window (with `1 / latency²`
/// weights, a tenth of the median would weigh a hundred times as much as it).
const WEIGHT_FLOOR_OF_MEDIAN: f64 = 0.25;
/// The ridge on each slope's normal equation, in the scaled units of [`features`]: far below
/// what any varying input contributes.
const RIDGE: f64 = 1e-3;
/// How far a prediction may be from the measurement, as a share of it, and still be close.
pub const TOLERANCE: f64 = 0.25;
/// Checks each replica's alarm looks at.
pub const WATCH: usize = 16;
/// Checks needed before the alarm can be raised.
pub const MIN_WATCHED: usize = 8;

/// What a [`Predictor`] predicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Latency {
    /// Time to first token.
    Ttft,
    /// Inter-token latency: the mean time between a request's output tokens.
    Itl,
}

impl Latency {
    /// Both, in the order [`PerLatency`] keeps them.
    pub const ALL: [Latency; 2] = [Latency::Ttft, Latency::Itl];

    /// How far a prediction may be off in absolute terms, on top of [`TOLERANCE`]: what says
    /// nothing about the model (a few milliseconds of a TTFT, one of an ITL).
    pub fn slack(self) -> Duration {
        match self {
            Latency::Ttft => Duration::from_millis(5),
            Latency::Itl => Duration::from_millis(1),
        }
    }
}

/// What the replica faces when a request is booked on it (the module docs say which figures
/// each latency takes); `/debug/explain` shows them beside each prediction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Inputs {
    /// Prefill tokens: for the TTFT, its own left after the cache overlap and those booked
    /// there ahead of it; for the ITL, those booked ahead.
    pub prefill_ahead: u64,
    /// Sequences: for the TTFT, those the replica is decoding; for the ITL, all it holds,
    /// this one's included.
    pub decoding: u64,
    /// Prefill tokens booked ahead that the replica's KV events do not show computed, beyond
    /// those counted in `prefill_ahead` (which drains them at the speed learned): prefill the
    /// engine keeps waiting, or a chunk whose step has not ended. 0 without trusted events.
    pub prefill_not_stored: u64,
}

/// How many inputs the model weighs.
const FEATURES: usize = 3;
/// The model's inputs, scaled ([`features`]).
type Features = [f64; FEATURES];
/// A timed request as the model keeps it: its scaled inputs and its measured latency (ms).
type Sample = (Features, f64);

/// One replica's model: its latest requests and the line fitted to them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Model {
    /// The scaled inputs and the measured latency (ms) of the last [`WINDOW`] requests.
    window: VecDeque<Sample>,
    /// Milliseconds at rest (all inputs 0), and per unit of each scaled input.
    intercept: f64,
    slopes: Features,
    /// Requests learned from since the replica joined.
    samples: u64,
    /// When it last learned.
    learned_at: Option<Instant>,
}

/// The model's inputs, scaled so their slopes are of like size: thousands of prefill tokens,
/// tens of decoding sequences.
fn features(inputs: Inputs) -> Features {
    [inputs.prefill_ahead as f64 / 1_000.0, inputs.decoding as f64 / 10.0, inputs.prefill_not_stored as f64 / 1_000.0]
}

impl Model {
    /// The latency it predicts at `now` for `inputs`; `None` until its window holds
    /// [`MIN_SAMPLES`] requests, or once it has learned nothing for [`FORGET_AFTER`].
    ///
    /// ```
    /// use kvgate_sidecar::latency::{Inputs, Model};
    /// use std::time::{Duration, Instant};
    /// let (mut m, now) = (Model::default(), Instant::now());
    /// let inputs = |tokens| Inputs { prefill_ahead: tokens, decoding: 0, prefill_not_stored: 0 };
    /// assert_eq!(m.predict(inputs(1000), now), None, "nothing learned yet");
    /// // 5 ms at rest and 20 ms per thousand tokens.
    /// for tokens in (0..40).map(|i| 100 + (i % 8) * 500) {
    ///     m.learn(inputs(tokens), Duration::from_micros(5_000 + 20 * tokens), now);
    /// }
    /// let predicted = m.predict(inputs(3000), now).unwrap().as_secs_f64() * 1e3;
    /// assert!((predicted - 65.0).abs() < 0.5, "{predicted}");
    /// ```
    pub fn predict(&self, inputs: Inputs, now: Instant) -> Option<Duration> {
        if self.window.len() < MIN_SAMPLES || self.forgotten(now) {
            return None;
        }
        let x = features(inputs);
        Some(millis(self.intercept + x.iter().zip(self.slopes).map(|(x, b)| x * b).sum::<f64>()))
    }

    /// Learns at `now` from one request that met `inputs` and measured `measured`.
    pub fn learn(&mut self, inputs: Inputs, measured: Duration, now: Instant) {
        if self.forgotten(now) {
            self.window.clear();
        } else if self.window.len() == WINDOW {
            self.window.pop_front();
        }
        self.window.push_back((features(inputs), measured.as_secs_f64() * 1e3));
        if let Some((intercept, slopes)) = fit(&self.window) {
            (self.intercept, self.slopes) = (intercept, slopes);
        }
        self.samples += 1;
        self.learned_at = Some(now);
    }

    /// Requests learned from since the replica joined.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Seconds each prefill token ahead adds, as learned: `None` while it does not predict.
    pub fn secs_per_prefill_token(&self, now: Instant) -> Option<f64> {
        (self.window.len() >= MIN_SAMPLES && !self.forgotten(now)).then(|| self.slopes[0] / 1e6)
    }

    fn forgotten(&self, now: Instant) -> bool {
        self.learned_at.is_some_and(|at| now.saturating_duration_since(at) > FORGET_AFTER)
    }
}

/// The least-squares fit through `samples` with non-negative slopes, each sample weighted by
/// `1 / latency²` (no more than at a quarter of the window's median) so that the fit
/// minimises the *relative* error (the check's measure): unweighted,
/// the few slow requests of a busy window pull the line up and a quick one on an idle replica
/// is predicted at twice its TTFT. Returns the intercept and the slopes. The inputs are centred
/// on their (weighted) means and each slope's normal equation ridged by [`RIDGE`]; of the fits
/// with each subset of the slopes free (the others held at 0), the best whose free slopes come
/// out non-negative. `None` if there are none, or the figures are not finite.
fn fit(samples: &VecDeque<Sample>) -> Option<(f64, Features)> {
    let n = samples.len() as f64;
    // Weights summing to `n`, so the ridge keeps its scale.
    let mut measured: Vec<f64> = samples.iter().map(|s| s.1).collect();
    measured.sort_by(f64::total_cmp);
    let floor = (measured.get(measured.len() / 2)? * WEIGHT_FLOOR_OF_MEDIAN).max(1e-3);
    let raw = |s: &Sample| 1.0 / s.1.max(floor).powi(2);
    let total: f64 = samples.iter().map(raw).sum();
    let weight = |s: &Sample| n * raw(s) / total;
    let mean = |f: &dyn Fn(&Sample) -> f64| samples.iter().map(|s| weight(s) * f(s)).sum::<f64>() / n;
    let mx: Features = std::array::from_fn(|i| mean(&|s| s.0[i]));
    let my = mean(&|s| s.1);
    // Weighted, centred sums of squares and products.
    let (mut sxx, mut sxy, mut syy) = ([[0.0; FEATURES]; FEATURES], [0.0; FEATURES], 0.0);
    for sample in samples {
        let (w, (x, y)) = (weight(sample), sample);
        let (x, y): (Features, f64) = (std::array::from_fn(|i| x[i] - mx[i]), y - my);
        for i in 0..FEATURES {
            for j in 0..FEATURES {
                sxx[i][j] += w * x[i] * x[j];
            }
            sxy[i] += w * x[i] * y;
        }
        syy += w * y * y;
    }
    for (i, row) in sxx.iter_mut().enumerate() {
        row[i] += RIDGE;
    }
    let residual = |b: &Features| {
        let pairs = (0..FEATURES).flat_map(|i| (0..FEATURES).map(move |j| (i, j)));
        let quadratic: f64 = pairs.map(|(i, j)| b[i] * b[j] * sxx[i][j]).sum();
        syy - 2.0 * (0..FEATURES).map(|i| b[i] * sxy[i]).sum::<f64>() + quadratic
    };
    let slopes = (0..1u32 << FEATURES)
        .filter_map(|free| solve(&sxx, &sxy, free))
        .filter(|b| b.iter().all(|v| *v >= 0.0))
        .min_by(|a, b| residual(a).total_cmp(&residual(b)))?;
    let intercept = my - (0..FEATURES).map(|i| slopes[i] * mx[i]).sum::<f64>();
    (intercept.is_finite() && slopes.iter().all(|v| v.is_finite())).then_some((intercept, slopes))
}

/// The normal equations `a · b = y` solved for the slopes in `free` (a bit each), the others
/// held at 0; `None` if they have no single solution.
fn solve(a: &[Features; FEATURES], y: &Features, free: u32) -> Option<Features> {
    let index: Vec<usize> = (0..FEATURES).filter(|i| free >> i & 1 == 1).collect();
    let n = index.len();
    // The free rows and columns, with `y` beside them, reduced by Gauss–Jordan elimination.
    let mut m: Vec<Vec<f64>> =
        index.iter().map(|&i| index.iter().map(|&j| a[i][j]).chain(std::iter::once(y[i])).collect()).collect();
    for c in 0..n {
        let pivot = (c..n).max_by(|&p, &q| m[p][c].abs().total_cmp(&m[q][c].abs()))?;
        m.swap(c, pivot);
        if m[c][c].abs() < f64::EPSILON {
            return None;
        }
        let pivot_row = m[c].clone();
        for (_, row) in m.iter_mut().enumerate().filter(|(r, _)| *r != c) {
            let f = row[c] / pivot_row[c];
            for (v, p) in row.iter_mut().zip(&pivot_row).skip(c) {
                *v -= f * p;
            }
        }
    }
    let mut slopes = [0.0; FEATURES];
    for (row, &i) in index.iter().enumerate() {
        slopes[i] = m[row][n] / m[row][row];
    }
    Some(slopes)
}

/// One prediction against what the filter measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Check {
    /// Predicted at the decision, in seconds.
    pub predicted_secs: f64,
    /// Measured by the filter (a TTFT: from the request leaving it to the response's first
    /// byte; an ITL: the mean time between the response's tokens).
    pub measured_secs: f64,
    /// What is close regardless, in seconds ([`Latency::slack`]).
    #[serde(skip)]
    slack_secs: f64,
}

impl Check {
    /// A prediction of `latency` against the measurement.
    pub fn new(latency: Latency, predicted: Duration, measured: Duration) -> Check {
        Check {
            predicted_secs: predicted.as_secs_f64(),
            measured_secs: measured.as_secs_f64(),
            slack_secs: latency.slack().as_secs_f64(),
        }
    }

    /// `|predicted − measured|`, in seconds.
    fn error(&self) -> f64 {
        (self.predicted_secs - self.measured_secs).abs()
    }

    /// `|predicted − measured| / measured` (a measurement under a microsecond counts as one).
    pub fn relative_error(&self) -> f64 {
        self.error() / self.measured_secs.max(1e-6)
    }

    /// Within [`TOLERANCE`] of the measurement, plus its slack.
    ///
    /// ```
    /// use kvgate_sidecar::latency::{Check, Latency::{Itl, Ttft}};
    /// use std::time::Duration;
    /// let ms = Duration::from_millis;
    /// assert!(Check::new(Ttft, ms(120), ms(100)).close());
    /// assert!(!Check::new(Ttft, ms(140), ms(100)).close());
    /// assert!(Check::new(Ttft, ms(6), ms(2)).close(), "a few milliseconds off");
    /// assert!(!Check::new(Itl, ms(6), ms(2)).close(), "a few milliseconds are much of an ITL");
    /// ```
    pub fn close(&self) -> bool {
        self.error() <= TOLERANCE * self.measured_secs + self.slack_secs
    }
}

/// What a replica's check of one prediction came to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Watched {
    /// The prediction against the measurement.
    pub check: Check,
    /// The replica's alarm, after this check.
    pub alarm: bool,
    /// Whether this check raised or cleared it.
    pub changed: bool,
}

/// One replica's TTFT or ITL: its model, and the watch over its last predictions.
#[derive(Debug, Clone)]
pub struct Predictor {
    latency: Latency,
    model: Model,
    /// Whether its last [`WATCH`] predictions were close.
    watch: Watch,
}

impl Predictor {
    /// A replica's predictor of `latency`, which has learned nothing.
    pub fn new(latency: Latency) -> Predictor {
        Predictor { latency, model: Model::default(), watch: Watch::new(WATCH, MIN_WATCHED, 0.8) }
    }

    /// The latency predicted at `now` for `inputs` (see [`Model::predict`]).
    pub fn predict(&self, inputs: Inputs, now: Instant) -> Option<Duration> {
        self.model.predict(inputs, now)
    }

    /// A request that met `inputs`, for which `predicted` was predicted, measured `measured`
    /// (reported at `now`): the model learns from it. Returns the check, if something was
    /// predicted, with the alarm's state.
    pub fn measured(
        &mut self,
        inputs: Inputs,
        predicted: Option<Duration>,
        measured: Duration,
        now: Instant,
    ) -> Option<Watched> {
        self.model.learn(inputs, measured, now);
        let check = Check::new(self.latency, predicted?, measured);
        let changed = self.watch.record(check.close());
        Some(Watched { check, alarm: self.watch.alarm(), changed })
    }

    /// Whether its alarm is raised.
    pub fn alarm(&self) -> bool {
        self.watch.alarm()
    }

    /// The share of its last checks that were close (1 with none).
    pub fn recent_close_ratio(&self) -> f64 {
        self.watch.ratio()
    }

    /// Requests its model learned from.
    pub fn samples(&self) -> u64 {
        self.model.samples()
    }

    /// Seconds each prefill token ahead adds, as learned (see [`Model::secs_per_prefill_token`]).
    pub fn secs_per_prefill_token(&self, now: Instant) -> Option<f64> {
        self.model.secs_per_prefill_token(now)
    }
}

/// One value per kind of latency (the TTFT's and the ITL's), reached by indexing with a
/// [`Latency`]: what is kept twice is written once.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PerLatency<T>([T; 2]);

impl<T> PerLatency<T> {
    /// Each kind's value, made from the kind.
    pub fn from_fn(mut make: impl FnMut(Latency) -> T) -> PerLatency<T> {
        PerLatency(Latency::ALL.map(&mut make))
    }
}

impl<T> Index<Latency> for PerLatency<T> {
    type Output = T;

    fn index(&self, latency: Latency) -> &T {
        &self.0[latency as usize]
    }
}

impl<T> IndexMut<Latency> for PerLatency<T> {
    fn index_mut(&mut self, latency: Latency) -> &mut T {
        &mut self.0[latency as usize]
    }
}

/// One replica's latencies: its TTFT and its ITL, each learned and watched on its own.
pub type ReplicaLatency = PerLatency<Predictor>;

impl Default for ReplicaLatency {
    fn default() -> Self {
        PerLatency::from_fn(Predictor::new)
    }
}

/// `ms` milliseconds as a duration, never negative (the line may dip below zero far from what
/// it learned) and never beyond what a duration holds.
fn millis(ms: f64) -> Duration {
    Duration::try_from_secs_f64(ms.max(0.0) / 1e3).unwrap_or(Duration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replica whose TTFT is `at_rest` ms plus `per_k` ms per thousand prefill tokens plus
    /// `per_seq` ms per decoding sequence.
    fn replica(at_rest: f64, per_k: f64, per_seq: f64) -> impl Fn(Inputs) -> Duration {
        move |i| millis(at_rest + per_k * i.prefill_ahead as f64 / 1e3 + per_seq * i.decoding as f64)
    }

    fn traffic(n: u64) -> impl Iterator<Item = Inputs> {
        (0..n).map(|i| Inputs { prefill_ahead: 200 + (i * 733) % 6000, decoding: (i * 7) % 24, prefill_not_stored: 0 })
    }

    fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1e3
    }

    /// A model taught `truth` over `inputs`, all at `now`.
    fn taught(m: &mut Model, inputs: impl Iterator<Item = Inputs>, truth: impl Fn(Inputs) -> Duration, now: Instant) {
        for i in inputs {
            m.learn(i, truth(i), now);
        }
    }

    #[test]
    fn it_learns_each_input_and_predicts_inputs_it_has_not_seen() {
        let (truth, now) = (replica(12.0, 30.0, 1.5), Instant::now());
        let mut m = Model::default();
        taught(&mut m, traffic(60), &truth, now);
        let unseen = Inputs { prefill_ahead: 9_000, decoding: 40, prefill_not_stored: 0 };
        let (predicted, actual) = (ms(m.predict(unseen, now).unwrap()), ms(truth(unseen)));
        assert!((predicted - actual).abs() < 0.01 * actual, "{predicted} vs {actual}");
    }

    /// Prefill the engine has not stored costs more than prefill the speed learned counts: a
    /// replica whose queue is behind what it drained on paper. Each is learned apart.
    #[test]
    fn prefill_not_stored_is_learned_apart_from_prefill_ahead() {
        let now = Instant::now();
        let truth =
            |i: Inputs| millis(5.0 + 10.0 * i.prefill_ahead as f64 / 1e3 + 40.0 * i.prefill_not_stored as f64 / 1e3);
        let mut m = Model::default();
        let traffic = (0..60u64).map(|i| Inputs {
            prefill_ahead: 100 + (i * 733) % 4000,
            decoding: 0,
            prefill_not_stored: (i * 389) % 3000,
        });
        taught(&mut m, traffic, truth, now);
        for (ahead, not_stored) in [(2_000, 0), (0, 2_000), (5_000, 5_000)] {
            let unseen = Inputs { prefill_ahead: ahead, decoding: 0, prefill_not_stored: not_stored };
            let (predicted, actual) = (ms(m.predict(unseen, now).unwrap()), ms(truth(unseen)));
            assert!((predicted - actual).abs() < 0.01 * actual, "{unseen:?}: {predicted} vs {actual}");
        }
    }

    #[test]
    fn a_replica_that_slows_down_is_relearned_once_its_window_holds_only_the_new_self() {
        let now = Instant::now();
        let mut m = Model::default();
        taught(&mut m, traffic(200), replica(10.0, 20.0, 1.0), now);
        let slow = replica(30.0, 80.0, 4.0);
        let probe = Inputs { prefill_ahead: 3_000, decoding: 10, prefill_not_stored: 0 };
        let before = ms(m.predict(probe, now).unwrap());
        assert!(before < 0.5 * ms(slow(probe)), "{before}: still the fast replica");
        taught(&mut m, traffic(WINDOW as u64), &slow, now);
        let after = ms(m.predict(probe, now).unwrap());
        assert!((after - ms(slow(probe))).abs() < 0.01 * ms(slow(probe)), "{after} vs {}", ms(slow(probe)));
    }

    #[test]
    fn an_input_that_never_varies_gets_no_weight_whatever_its_value() {
        let now = Instant::now();
        // Eight sequences decoding throughout, and a TTFT that does not depend on them.
        let truth = replica(10.0, 20.0, 0.0);
        let mut m = Model::default();
        taught(&mut m, traffic(100).map(|i| Inputs { decoding: 8, ..i }), &truth, now);
        for decoding in [0, 8, 40] {
            let probe = Inputs { prefill_ahead: 1_000, decoding, prefill_not_stored: 0 };
            assert!((ms(m.predict(probe, now).unwrap()) - 30.0).abs() < 0.1, "{decoding}: {m:?}");
        }
    }

    #[test]
    fn more_load_never_looks_faster() {
        let now = Instant::now();
        // Measurements where more decoding came with shorter TTFTs (a coincidence of the
        // window): the slope is held at 0, not fitted negative.
        let mut m = Model::default();
        let falling = |i: Inputs| millis(20.0 + 0.01 * i.prefill_ahead as f64 - 0.5 * i.decoding as f64);
        taught(&mut m, traffic(40), falling, now);
        let probe =
            |decoding| ms(m.predict(Inputs { prefill_ahead: 2_000, decoding, prefill_not_stored: 0 }, now).unwrap());
        assert!(probe(40) >= probe(0), "{} < {}", probe(40), probe(0));
        assert!(m.slopes.iter().all(|b| *b >= 0.0) && m.slopes[1] == 0.0, "{m:?}");
    }

    /// A busy window: most requests quick and exact, a few slow ones whose TTFT the inputs
    /// explain only to within ±40 % (steps shared with requests booked after them). Fitted for
    /// the relative error, a quick one is predicted within 2 %; an unweighted fit, pulled by the
    /// slow ones' scatter, predicted it 16 % low.
    #[test]
    fn slow_requests_scatter_does_not_pull_the_quick_ones_predictions() {
        let (truth, now) = (replica(5.0, 100.0, 0.0), Instant::now());
        let mut m = Model::default();
        for i in 0..WINDOW as u64 {
            let inputs = Inputs { prefill_ahead: 100 + (i * 37) % 200, decoding: 0, prefill_not_stored: 0 };
            let slow = Inputs { prefill_ahead: 1_000 + (i * 53) % 1_000, decoding: 0, prefill_not_stored: 0 };
            let scatter = [1.4, 0.6, 1.4, 1.4][(i / 4) as usize % 4];
            let (inputs, measured) = match i % 4 {
                0 => (slow, truth(slow).mul_f64(scatter)),
                _ => (inputs, truth(inputs)),
            };
            m.learn(inputs, measured, now);
        }
        let quick = Inputs { prefill_ahead: 150, decoding: 0, prefill_not_stored: 0 };
        let (predicted, actual) = (ms(m.predict(quick, now).unwrap()), ms(truth(quick)));
        assert!((predicted - actual).abs() < 0.02 * actual, "{predicted} vs {actual}: {m:?}");
    }

    #[test]
    fn it_predicts_nothing_until_its_window_holds_enough_nor_once_it_is_forgotten() {
        let t0 = Instant::now();
        let mut m = Model::default();
        let inputs = |i: u64| Inputs { prefill_ahead: 1_000 + 100 * i, decoding: 0, prefill_not_stored: 0 };
        for i in 1..MIN_SAMPLES as u64 {
            m.learn(inputs(i), Duration::from_millis(10 + i), t0);
            assert_eq!(m.predict(inputs(0), t0), None);
        }
        m.learn(inputs(0), Duration::from_millis(10), t0);
        assert!(m.predict(inputs(0), t0).is_some());
        // Taught nothing for longer than FORGET_AFTER (routed around, or idle): forgotten,
        // and learned afresh from the next requests.
        let later = t0 + FORGET_AFTER + Duration::from_secs(1);
        assert_eq!(m.predict(inputs(0), later), None);
        m.learn(inputs(0), Duration::from_millis(90), later);
        assert_eq!(m.predict(inputs(0), later), None, "one request is not enough");
        assert_eq!(m.samples(), MIN_SAMPLES as u64 + 1, "the count is of all it learned from");
        // A line that dips below zero far from what it learned predicts zero there, not less.
        let mut m = Model::default();
        let steep = |i: Inputs| millis(0.1 * i.prefill_ahead as f64 - 50.0);
        taught(
            &mut m,
            (0..9).map(|k| Inputs { prefill_ahead: 1_000 + 100 * k, decoding: 0, prefill_not_stored: 0 }),
            steep,
            t0,
        );
        assert_eq!(m.predict(Inputs::default(), t0), Some(Duration::ZERO));
    }

    #[test]
    fn a_replica_slowed_behind_its_back_raises_its_alarm_until_relearned() {
        let (mut r, now) = (Predictor::new(Latency::Ttft), Instant::now());
        let fast = replica(10.0, 20.0, 1.0);
        let record = |r: &mut Predictor, inputs: Inputs, truth: Duration| {
            let predicted = r.predict(inputs, now);
            r.measured(inputs, predicted, truth, now)
        };
        for inputs in traffic(100) {
            let watched = record(&mut r, inputs, fast(inputs));
            assert!(watched.is_none_or(|w| w.check.close() && !w.alarm && !w.changed), "{watched:?}");
        }
        let slow = replica(40.0, 80.0, 4.0);
        let changes: Vec<(usize, bool)> = traffic(200)
            .enumerate()
            .filter_map(|(i, inputs)| record(&mut r, inputs, slow(inputs)).filter(|w| w.changed).map(|w| (i, w.alarm)))
            .collect();
        assert_eq!(changes.len(), 2, "raised once, cleared once: {changes:?}");
        let ((raised, up), (cleared, down)) = (changes[0], changes[1]);
        assert!(up && !down);
        // Its watch was all close: raised by the ninth miss, when fewer than half of it are.
        assert_eq!(raised, WATCH / 2, "{changes:?}");
        assert!(cleared < WINDOW + WATCH, "relearned, then close for most of its watch: {changes:?}");
        assert!(!r.alarm() && r.recent_close_ratio() >= 0.8);
    }
}
