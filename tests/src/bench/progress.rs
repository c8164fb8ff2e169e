//! Where a long benchmark run is: "cell i of N", each cell's time, and an estimate of the
//! time left from the mean of the cells finished so far. Pure: durations in, text out (the
//! caller measures and prints), so it is tested without waiting.

use std::time::Duration;

/// The cells of one run: how many, which one is running, and how long the finished ones took.
#[derive(Debug, Clone)]
pub struct Progress {
    total: usize,
    started: usize,
    took: Vec<Duration>,
}

impl Progress {
    /// A run of `total` cells, none started.
    pub fn new(total: usize) -> Progress {
        Progress { total, started: 0, took: Vec::new() }
    }

    /// Starts the next cell: `cell 3 of 24: <what>`.
    pub fn start(&mut self, what: &str) -> String {
        self.started += 1;
        format!("cell {} of {}: {what}", self.started, self.total)
    }

    /// Ends the running cell after `took` (finished or failed, it took the time): `cell 3 of
    /// 24 took 4m 10s (12m 30s so far); estimate: 1h 27m left (mean of 3 cells × 21 to go)`.
    pub fn finish(&mut self, took: Duration) -> String {
        self.took.push(took);
        let so_far: Duration = self.took.iter().sum();
        let head = format!("cell {} of {} took {} ({} so far)", self.started, self.total, human(took), human(so_far));
        match self.left() {
            None => format!("{head}; all done"),
            Some(left) => format!(
                "{head}; estimate: {} left (mean of {} cell{} × {} to go)",
                human(left),
                self.took.len(),
                if self.took.len() == 1 { "" } else { "s" },
                self.total - self.took.len()
            ),
        }
    }

    /// The mean time of the finished cells times the cells not finished (`None`: none left).
    pub fn left(&self) -> Option<Duration> {
        let to_go = self.total.checked_sub(self.took.len()).filter(|&n| n > 0)?;
        let mean = self.took.iter().sum::<Duration>().checked_div(self.took.len() as u32)?;
        Some(mean * to_go as u32)
    }
}

/// `42s`, `3m 12s`, `1h 04m`.
fn human(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {:02}s", s / 60, s % 60),
        _ => format!("{}h {:02}m", s / 3600, s % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_cells_and_estimates_from_the_mean_of_finished_ones() {
        let mut p = Progress::new(4);
        assert_eq!(p.left(), None, "nothing finished: no estimate");
        assert_eq!(p.start("shared-prefix qps=4 kvgate-kv-aware"), "cell 1 of 4: shared-prefix qps=4 kvgate-kv-aware");
        assert_eq!(
            p.finish(Duration::from_secs(60)),
            "cell 1 of 4 took 1m 00s (1m 00s so far); estimate: 3m 00s left (mean of 1 cell × 3 to go)"
        );
        assert_eq!(p.start("b"), "cell 2 of 4: b");
        assert_eq!(
            p.finish(Duration::from_secs(180)),
            "cell 2 of 4 took 3m 00s (4m 00s so far); estimate: 4m 00s left (mean of 2 cells × 2 to go)"
        );
        p.start("c");
        assert_eq!(
            p.finish(Duration::from_secs(7200)),
            "cell 3 of 4 took 2h 00m (2h 04m so far); estimate: 41m 20s left (mean of 3 cells × 1 to go)"
        );
        p.start("d");
        assert_eq!(p.finish(Duration::from_millis(500)), "cell 4 of 4 took 0s (2h 04m so far); all done");
        assert_eq!(p.left(), None);
    }

    #[test]
    fn durations_read_at_a_glance() {
        assert_eq!(human(Duration::from_secs(59)), "59s");
        assert_eq!(human(Duration::from_secs(61)), "1m 01s");
        assert_eq!(human(Duration::from_secs(3600 + 4 * 60 + 59)), "1h 04m");
        assert_eq!(human(Duration::from_secs(30 * 3600)), "30h 00m");
    }
}
