//! A check's last verdicts and the alarm they drive, with hysteresis: raised when, after
//! `min` checks, fewer than half of the last `size` were right; cleared once at least
//! `clear_at` of them are. Pure. The cache predictions keep one per pool
//! ([`crate::accuracy`]), the TTFT predictions one per replica ([`crate::latency`]).

use std::collections::VecDeque;

/// The last `size` verdicts and the alarm.
#[derive(Debug, Clone)]
pub struct Watch {
    size: usize,
    min: usize,
    clear_at: f64,
    recent: VecDeque<bool>,
    alarm: bool,
}

impl Watch {
    /// A watch over the last `size` checks, judging from `min` on, cleared at the share
    /// `clear_at` right.
    pub const fn new(size: usize, min: usize, clear_at: f64) -> Watch {
        Watch { size, min, clear_at, recent: VecDeque::new(), alarm: false }
    }

    /// Records one verdict. Returns whether it raised or cleared the alarm.
    ///
    /// ```
    /// use kvgate_sidecar::watch::Watch;
    /// let mut w = Watch::new(4, 2, 0.75);
    /// assert!(!w.record(false), "too few to judge");
    /// assert!(w.record(false) && w.alarm());
    /// assert!(!w.record(true) && !w.record(true), "half right: still raised");
    /// assert!(w.record(true) && !w.alarm(), "three of the last four");
    /// ```
    pub fn record(&mut self, right: bool) -> bool {
        if self.recent.len() == self.size {
            self.recent.pop_front();
        }
        self.recent.push_back(right);
        let ratio = self.ratio();
        let raise = !self.alarm && self.recent.len() >= self.min && ratio < 0.5;
        let clear = self.alarm && ratio >= self.clear_at;
        if raise || clear {
            self.alarm = raise;
        }
        raise || clear
    }

    /// Whether the alarm is raised.
    pub fn alarm(&self) -> bool {
        self.alarm
    }

    /// The share of the last verdicts that were right (1 with none).
    pub fn ratio(&self) -> f64 {
        if self.recent.is_empty() {
            return 1.0;
        }
        self.recent.iter().filter(|r| **r).count() as f64 / self.recent.len() as f64
    }
}
