//! Whether the sidecar is whole: every long-running background thread holds a [`Worker`],
//! which it asks whether to stop once a loop — each ask is a heartbeat — and which marks the
//! thread ended when dropped (it returned, or unwound from a panic). [`Health::report`]
//! names the threads that ended while the sidecar runs and those whose last heartbeat is
//! older than their limit; `/healthz` answers 503 with that list, and the process ends on a
//! dead thread (its container restarts; Envoy, in its own, keeps serving and fails open).
//!
//! | state | owner | written by | read by |
//! |---|---|---|---|
//! | the stop flag | [`Health`] | `main` (shutdown) | every [`Worker`] |
//! | a thread's last beat, ended | its [`Worker`] | that thread | [`Health::report`] |
//! | why start-up failed | [`Health`] | `main` | [`Health::report`] |
//!
//! The event streams' threads are watched per replica instead (`stalled`, `degraded` in
//! `/debug/state`), since each engine's publisher decides how often they hear anything.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

/// The sidecar's threads and its stop flag.
#[derive(Debug)]
pub struct Health {
    stop: AtomicBool,
    started: Instant,
    workers: Mutex<Vec<Arc<Beats>>>,
    startup: Mutex<Option<String>>,
}

/// What one thread leaves behind.
#[derive(Debug)]
struct Beats {
    name: String,
    /// ms since [`Health::started`] at the last heartbeat.
    last_ms: AtomicU64,
    stale_after: Duration,
    ended: AtomicBool,
}

/// A background thread's handle on [`Health`]: its stop flag and its heartbeat.
#[derive(Debug)]
pub struct Worker {
    health: Arc<Health>,
    beats: Arc<Beats>,
}

impl Worker {
    /// Whether the sidecar is stopping. Asked once a loop, it is also the thread's heartbeat.
    pub fn stopping(&self) -> bool {
        self.beat();
        self.health.stop.load(Ordering::Relaxed)
    }

    /// A heartbeat without the question (before a call that may block for a while).
    pub fn beat(&self) {
        self.beats.last_ms.store(self.health.since_start(Instant::now()), Ordering::Relaxed);
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.beats.ended.store(true, Ordering::Relaxed);
    }
}

/// Something wrong with the sidecar.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "problem", rename_all = "snake_case")]
pub enum Problem {
    /// Start-up failed: the sidecar runs without pools and answers every route call 503.
    Startup {
        /// Why.
        error: String,
    },
    /// A thread ended while the sidecar runs.
    Ended {
        /// The thread.
        thread: String,
    },
    /// A thread has not beaten for longer than its limit.
    Stalled {
        /// The thread.
        thread: String,
        /// Seconds since its last heartbeat.
        silent_secs: u64,
    },
}

impl Health {
    /// A sidecar starting now, nothing watched yet.
    pub fn new() -> Arc<Health> {
        Arc::new(Health {
            stop: AtomicBool::new(false),
            started: Instant::now(),
            workers: Mutex::new(Vec::new()),
            startup: Mutex::new(None),
        })
    }

    /// A worker for thread `name`, stalled once it has not beaten for `stale_after`.
    pub fn worker(self: &Arc<Health>, name: &str, stale_after: Duration) -> Worker {
        let beats = Arc::new(Beats {
            name: name.to_owned(),
            last_ms: AtomicU64::new(self.since_start(Instant::now())),
            stale_after,
            ended: AtomicBool::new(false),
        });
        self.workers.lock().unwrap_or_else(|e| e.into_inner()).push(beats.clone());
        Worker { health: self.clone(), beats }
    }

    /// Tells every worker to stop.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Whether the sidecar is stopping.
    pub fn stopping(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Records that start-up failed, and why.
    pub fn startup_failed(&self, error: String) {
        *self.startup.lock().unwrap_or_else(|e| e.into_inner()) = Some(error);
    }

    /// What is wrong at `now`: nothing when healthy. While stopping, threads ending is no
    /// problem.
    pub fn report(&self, now: Instant) -> Vec<Problem> {
        let mut problems: Vec<Problem> = self
            .startup
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|e| Problem::Startup { error: e.clone() })
            .collect();
        if self.stopping() {
            return problems;
        }
        let at = self.since_start(now);
        for w in self.workers.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let silent = Duration::from_millis(at.saturating_sub(w.last_ms.load(Ordering::Relaxed)));
            if w.ended.load(Ordering::Relaxed) {
                problems.push(Problem::Ended { thread: w.name.clone() });
            } else if silent > w.stale_after {
                problems.push(Problem::Stalled { thread: w.name.clone(), silent_secs: silent.as_secs() });
            }
        }
        problems
    }

    fn since_start(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.started).as_millis() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_beating_thread_is_healthy_a_silent_one_stalled_an_ended_one_dead() {
        let health = Health::new();
        let t0 = Instant::now();
        let beating = health.worker("beating", Duration::from_secs(5));
        let silent = health.worker("silent", Duration::from_secs(5));
        let ended = health.worker("ended", Duration::from_secs(5));
        assert_eq!(health.report(t0), []);
        drop(ended);
        // `beating` beats three seconds in (a beat is stamped with the time it happens).
        beating.beats.last_ms.store(health.since_start(t0 + Duration::from_secs(3)), Ordering::Relaxed);
        let report = health.report(t0 + Duration::from_secs(6));
        assert!(report.contains(&Problem::Ended { thread: "ended".into() }), "{report:?}");
        assert!(report.contains(&Problem::Stalled { thread: "silent".into(), silent_secs: 6 }), "{report:?}");
        assert_eq!(report.len(), 2, "the beating thread is fine: {report:?}");
        drop((beating, silent));
    }

    #[test]
    fn while_stopping_ending_threads_are_no_problem_but_a_failed_start_is() {
        let health = Health::new();
        let w = health.worker("w", Duration::from_secs(1));
        health.stop();
        assert!(w.stopping());
        drop(w);
        assert_eq!(health.report(Instant::now()), []);
        health.startup_failed("no tokenizer".into());
        assert_eq!(health.report(Instant::now()), [Problem::Startup { error: "no tokenizer".into() }]);
    }

    #[test]
    fn a_panicking_thread_is_reported_ended() {
        let health = Health::new();
        let w = health.worker("doomed", Duration::from_secs(60));
        let t = std::thread::spawn(move || {
            let _w = w;
            panic!("a bug");
        });
        assert!(t.join().is_err());
        assert_eq!(health.report(Instant::now()), [Problem::Ended { thread: "doomed".into() }]);
    }
}
