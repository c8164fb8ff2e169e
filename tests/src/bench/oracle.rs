//! What there was to win on a run's TTFT: its requests replayed in simulated time on engines
//! configured as the fleet's (`kvgate-sim --replay`), all measured the same way:
//! - the router's own placement (where each request was served): checks the replay against
//!   the run's measured TTFT;
//! - round robin, in arrival order: where the gain starts;
//! - a greedy placement that knows each engine's exact state at each arrival and sends the
//!   request where its own first token comes soonest: a reference, not a bound (it does not
//!   know the arrivals to come, and on a tight cache it spreads a prefix and evicts);
//! - the floor: each request alone on an idle engine holding every block of its prompt the
//!   cache ceiling ([`super::ceiling`]) holds. No placement beats it, for any request.
//!
//! A router's share of the gain is (round robin − own) ÷ (round robin − floor) at p90. The
//! replay keeps the run's arrival times. An open-loop plan's arrivals are the same under
//! every placement; a closed loop's (conversations, agents) depend on when the answers came,
//! so its replay approximates what those sessions would have sent.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::ceiling::Served;
use super::stats::{median, percentile};
use super::Fleet;

/// TTFT percentiles of each placement replayed, simulated seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Replayed {
    /// Requests replayed.
    pub requests: usize,
    /// The router's own placement: p50, p90.
    pub own: [f64; 2],
    /// Round robin, in arrival order.
    pub round_robin: [f64; 2],
    /// The greedy placement.
    pub greedy: [f64; 2],
    /// The floor: no placement's percentile is lower.
    pub floor: [f64; 2],
}

impl Replayed {
    /// Each figure's median over runs (`None` without runs).
    pub fn median(runs: &[Replayed]) -> Option<Replayed> {
        let med = |f: &dyn Fn(&Replayed) -> f64| median(&runs.iter().map(f).collect::<Vec<_>>());
        Some(Replayed {
            requests: med(&|r| r.requests as f64)? as usize,
            own: [med(&|r| r.own[0])?, med(&|r| r.own[1])?],
            round_robin: [med(&|r| r.round_robin[0])?, med(&|r| r.round_robin[1])?],
            greedy: [med(&|r| r.greedy[0])?, med(&|r| r.greedy[1])?],
            floor: [med(&|r| r.floor[0])?, med(&|r| r.floor[1])?],
        })
    }

    /// The router's share of the p90 gain there was to win (round robin → the floor);
    /// `None` when there was none.
    pub fn share_of_p90_gain(&self) -> Option<f64> {
        let room = self.round_robin[1] - self.floor[1];
        (room > 1e-9 * self.round_robin[1]).then(|| (self.round_robin[1] - self.own[1]) / room)
    }
}

/// One placement as the simulator prints it.
#[derive(Debug, Deserialize)]
struct Placement {
    name: String,
    ttft_s: Vec<Option<f64>>,
}

/// The longest one replay may take (wall clock). The greedy placement tries every engine on
/// a copy for each request, so an overloaded run's deep queues make it slow: a run at twice
/// the fleet's capacity took over a quarter of an hour.
const REPLAY_BUDGET: Duration = Duration::from_secs(180);

/// Replays `served` on `replicas` (the fleet's replica ids, in engine order), each engine
/// with `gpu_blocks`; `None` when nothing was served on a known replica, or when the replay
/// would take longer than [`REPLAY_BUDGET`] (it is stopped, and the run says so).
pub fn replay(
    sim: &Path,
    fleet: &Fleet,
    gpu_blocks: usize,
    replicas: &[String],
    served: &[Served],
) -> anyhow::Result<Option<Replayed>> {
    let placed: Vec<(&Served, usize)> =
        served.iter().filter_map(|s| Some((s, replicas.iter().position(|r| *r == s.replica)?))).collect();
    if placed.is_empty() {
        return Ok(None);
    }
    let requests: Vec<_> = placed
        .iter()
        .map(|(s, _)| json!({"at_s": s.at_s, "prompt": s.prompt, "output": s.answer, "best_cached": s.best_cached}))
        .collect();
    let own: Vec<usize> = placed.iter().map(|(_, e)| *e).collect();
    let round_robin: Vec<usize> = (0..placed.len()).map(|i| i % replicas.len()).collect();
    let input = json!({
        "engines": replicas.len(),
        "requests": requests,
        "placements": [{"name": "own", "engines": own}, {"name": "round_robin", "engines": round_robin}],
    });
    let file = tempfile_path();
    std::fs::write(&file, serde_json::to_vec(&input)?)?;
    let output = run_within(
        Command::new(sim)
            .args(fleet.sim_args(gpu_blocks))
            .args(["--block-size", &fleet.block_size.to_string(), "--replay"])
            .arg(&file),
        &file.with_extension("out"),
        REPLAY_BUDGET,
    )
    .with_context(|| format!("running {} --replay", sim.display()));
    let _ = std::fs::remove_file(&file);
    let Some(stdout) = output? else {
        eprintln!("bench:   the replay took over {REPLAY_BUDGET:?} and was stopped: this run has no bounds");
        return Ok(None);
    };
    let placements: Vec<Placement> = serde_json::from_slice(&stdout).context("reading the replay")?;
    let p = |name: &str| -> anyhow::Result<[f64; 2]> {
        let found = placements.iter().find(|p| p.name == name).with_context(|| format!("no {name} in the replay"))?;
        let ttfts: Vec<f64> = found.ttft_s.iter().flatten().copied().collect();
        Ok([percentile(&ttfts, 50.0).unwrap_or(0.0), percentile(&ttfts, 90.0).unwrap_or(0.0)])
    };
    Ok(Some(Replayed {
        requests: placed.len(),
        own: p("own")?,
        round_robin: p("round_robin")?,
        greedy: p("greedy")?,
        floor: p("floor")?,
    }))
}

/// Runs `command` with its output in `out` and its errors beside (both removed after), for
/// at most `budget`: its stdout if it succeeded, `None` if it was stopped for the budget, an
/// error if it failed.
fn run_within(command: &mut Command, out: &Path, budget: Duration) -> anyhow::Result<Option<Vec<u8>>> {
    let errors = out.with_extension("err");
    let mut child = command.stdout(std::fs::File::create(out)?).stderr(std::fs::File::create(&errors)?).spawn()?;
    let deadline = Instant::now() + budget;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (stdout, stderr) = (std::fs::read(out), std::fs::read_to_string(&errors).unwrap_or_default());
    let _ = (std::fs::remove_file(out), std::fs::remove_file(&errors));
    let Some(status) = status else { return Ok(None) };
    anyhow::ensure!(status.success(), "kvgate-sim --replay failed: {}", stderr.lines().last().unwrap_or(""));
    Ok(Some(stdout?))
}

/// A file of this process's own for one replay's input.
fn tempfile_path() -> std::path::PathBuf {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("kvgate-replay-{}-{n}.json", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replay that runs past its budget is stopped and gives nothing; one that fails says
    /// so; one that finishes gives its output.
    #[test]
    fn a_replay_is_bounded_in_time() {
        let out = |n: &str| std::env::temp_dir().join(format!("kvgate-run-within-{}-{n}.out", std::process::id()));
        let quick = run_within(Command::new("echo").arg("done"), &out("a"), Duration::from_secs(30)).unwrap();
        assert_eq!(quick.as_deref(), Some(&b"done\n"[..]));
        let slow = run_within(Command::new("sleep").arg("30"), &out("b"), Duration::from_millis(100)).unwrap();
        assert_eq!(slow, None, "stopped at its budget");
        assert!(run_within(&mut Command::new("false"), &out("c"), Duration::from_secs(30)).is_err());
        assert!(!out("a").exists() && !out("b").with_extension("err").exists(), "nothing left behind");
    }

    fn replayed(own: f64, round_robin: f64, floor: f64) -> Replayed {
        let p90 = |v| [0.0, v];
        Replayed { requests: 1, own: p90(own), round_robin: p90(round_robin), greedy: p90(0.1), floor: p90(floor) }
    }

    #[test]
    fn the_share_is_of_the_gain_from_round_robin_to_the_floor() {
        assert_eq!(replayed(0.6, 1.0, 0.2).share_of_p90_gain(), Some(0.5));
        assert_eq!(replayed(0.2, 1.0, 0.2).share_of_p90_gain(), Some(1.0), "at the floor");
        let worse = replayed(1.25, 1.0, 0.5).share_of_p90_gain();
        assert_eq!(worse, Some(-0.5), "worse than round robin");
        assert_eq!(replayed(1.0, 1.0, 1.0).share_of_p90_gain(), None, "nothing to win");
    }
}
