//! Which cells a benchmark runs, and where each finished one is kept, so that a failure or a
//! kill loses at most the cell it hit.
//!
//! A cell is one (workload, gateways, QPS, repeat, policy) run. [`plan`] lists a
//! configuration's cells in the order they run. A [`CellStore`] appends each finished cell to
//! `<out>/cells.jsonl` as one JSON line (its outcomes included), flushed and synced, beside the
//! run's configuration in `<out>/config.json`. Opened again with `resume`, it refuses another
//! configuration ([`ConfigMismatch`]), reads the cells already finished — a last line cut short
//! by a kill is dropped, and that cell runs again — and [`pending`] is what is left to run.
//! The report is then built from every finished cell, old and new, in plan order.

use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::loadgen::Outcome;
use super::workloads::Workload;
use super::{BenchConfig, Policy, RunResult};

/// The finished cells, one JSON line each.
pub const CELLS_FILE: &str = "cells.jsonl";
/// The configuration the cells were run with.
pub const CONFIG_FILE: &str = "config.json";

/// One run of one policy: what [`super::run_cell`] runs and a [`RunResult`] reports.
#[derive(Debug, Clone)]
pub struct Cell<'c> {
    /// The workload.
    pub workload: &'c Workload,
    /// Gateway pods (or peer router instances).
    pub gateways: usize,
    /// Arrival rate (`None`: a workload not driven by QPS).
    pub qps: Option<f64>,
    /// Repeat index (the plan's seed is the run's seed plus it).
    pub repeat: usize,
    /// The policy.
    pub policy: Policy,
}

impl Cell<'_> {
    /// `shared-prefix gateways=1 qps=4 repeat=0 kvgate-kv-aware`.
    pub fn label(&self) -> String {
        format!(
            "{} gateways={} qps={} repeat={} {}",
            self.workload.name(),
            self.gateways,
            self.qps.map_or("trace".into(), |q| q.to_string()),
            self.repeat,
            self.policy.name()
        )
    }

    /// Whether `result` is this cell's.
    pub fn is(&self, result: &RunResult) -> bool {
        result.workload == self.workload.name()
            && result.policy == self.policy.name()
            && result.gateways == self.gateways
            && result.qps == self.qps
            && result.repeat == self.repeat
    }
}

/// Every cell of `config`, in the order they run: by workload, gateways, QPS, repeat, then
/// policy (each repeat's policies side by side, so a cut-short run has whole repeats).
pub fn plan(config: &BenchConfig) -> Vec<Cell<'_>> {
    let mut cells = Vec::new();
    for workload in &config.workloads {
        let ladder: Vec<Option<f64>> =
            if workload.uses_qps() { config.qps.iter().copied().map(Some).collect() } else { vec![None] };
        for &gateways in &config.gateways {
            for &qps in &ladder {
                for repeat in 0..config.repeats {
                    for &policy in &config.policies {
                        cells.push(Cell { workload, gateways, qps, repeat, policy });
                    }
                }
            }
        }
    }
    cells
}

/// The cells of `plan` with no result in `finished`, in plan order.
pub fn pending<'c>(plan: &[Cell<'c>], finished: &[RunResult]) -> Vec<Cell<'c>> {
    plan.iter().filter(|c| !finished.iter().any(|r| c.is(r))).cloned().collect()
}

/// The output directory holds cells of another configuration.
#[derive(Debug)]
pub struct ConfigMismatch {
    /// The output directory.
    pub dir: PathBuf,
    /// The configuration's top-level keys that differ.
    pub keys: Vec<String>,
}

impl fmt::Display for ConfigMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} holds cells of another configuration (differs in: {}); resume with the same flags, or choose another --out",
            self.dir.display(),
            self.keys.join(", ")
        )
    }
}

impl std::error::Error for ConfigMismatch {}

/// A line of `cells.jsonl`: the result and its requests' outcomes (which `results.json`
/// leaves out, and `requests/*.jsonl` and the charts need).
#[derive(Serialize)]
struct Line<'a> {
    run: &'a RunResult,
    outcomes: &'a [Outcome],
}

/// [`Line`], read back.
#[derive(Deserialize)]
struct ReadLine {
    run: RunResult,
    outcomes: Vec<Outcome>,
}

/// The finished cells of one output directory, appended to as cells finish.
#[derive(Debug)]
pub struct CellStore {
    file: File,
    path: PathBuf,
    finished: Vec<RunResult>,
}

impl CellStore {
    /// Opens `dir` for `config`'s cells. Without `resume`, `dir` must hold no finished cells;
    /// with it, they must be of the same configuration (else [`ConfigMismatch`]) and are kept.
    pub fn open(dir: &Path, config: &BenchConfig, resume: bool) -> anyhow::Result<CellStore> {
        std::fs::create_dir_all(dir)?;
        // Through text both ways, so numbers compare as the file will read back.
        let want: Value = serde_json::from_str(&serde_json::to_string(config)?)?;
        let path = dir.join(CELLS_FILE);
        let (finished, valid_len) = match std::fs::read(&path) {
            Ok(bytes) => read_cells(&path, &bytes)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (Vec::new(), 0),
            Err(e) => return Err(anyhow::anyhow!("reading {}: {e}", path.display())),
        };
        if !finished.is_empty() {
            let have: Value = match std::fs::read_to_string(dir.join(CONFIG_FILE)) {
                Ok(text) => serde_json::from_str(&text)?,
                Err(e) => anyhow::bail!("{} has cells but no readable {CONFIG_FILE}: {e}", dir.display()),
            };
            if have != want {
                return Err(ConfigMismatch { dir: dir.to_owned(), keys: differing_keys(&have, &want) }.into());
            }
            if !resume {
                anyhow::bail!(
                    "{} already holds {} finished cells: pass --resume to run the rest, or choose another --out",
                    dir.display(),
                    finished.len()
                );
            }
        }
        std::fs::write(dir.join(CONFIG_FILE), serde_json::to_string_pretty(&want)?)?;
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        // Drops a last line cut short (or every line, starting afresh) before appending.
        file.set_len(valid_len)?;
        file.sync_data()?;
        Ok(CellStore { file, path, finished })
    }

    /// The cells finished so far, in the order they finished.
    pub fn finished(&self) -> &[RunResult] {
        &self.finished
    }

    /// Writes a finished cell at once: one line, flushed and synced. The store keeps the
    /// cell as the line reads back (JSON may round a float's last bit), so a report is the
    /// same whether its cells were run in this session or read from an earlier one.
    pub fn append(&mut self, result: RunResult) -> anyhow::Result<()> {
        let mut line = serde_json::to_vec(&Line { run: &result, outcomes: &result.outcomes })?;
        let ReadLine { mut run, outcomes } = serde_json::from_slice(&line)?;
        run.outcomes = outcomes;
        line.push(b'\n');
        self.file.write_all(&line)?;
        self.file.sync_data().map_err(|e| anyhow::anyhow!("syncing {}: {e}", self.path.display()))?;
        self.finished.push(run);
        Ok(())
    }

    /// The finished cells of `plan`, in plan order (the report's order, however many
    /// sessions wrote them).
    pub fn into_results(self, plan: &[Cell<'_>]) -> Vec<RunResult> {
        let mut finished: Vec<Option<RunResult>> = self.finished.into_iter().map(Some).collect();
        plan.iter()
            .filter_map(|cell| finished.iter_mut().find(|r| r.as_ref().is_some_and(|r| cell.is(r)))?.take())
            .collect()
    }
}

/// The cells in `bytes` and the length of its whole lines. A last line without its newline
/// was cut short by a kill and is left out; any other line that does not read is an error.
fn read_cells(path: &Path, bytes: &[u8]) -> anyhow::Result<(Vec<RunResult>, u64)> {
    let whole = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    if whole < bytes.len() {
        eprintln!(
            "bench: {}: dropping a last line cut short ({} bytes); its cell runs again",
            path.display(),
            bytes.len() - whole
        );
    }
    let mut cells = Vec::new();
    for (n, line) in bytes[..whole].split(|&b| b == b'\n').enumerate().filter(|(_, l)| !l.is_empty()) {
        let ReadLine { mut run, outcomes } =
            serde_json::from_slice(line).map_err(|e| anyhow::anyhow!("{} line {}: {e}", path.display(), n + 1))?;
        run.outcomes = outcomes;
        cells.push(run);
    }
    Ok((cells, whole as u64))
}

/// The top-level keys whose values differ between two configurations.
fn differing_keys(a: &Value, b: &Value) -> Vec<String> {
    let (Value::Object(a), Value::Object(b)) = (a, b) else { return vec!["(the whole configuration)".into()] };
    let only_b = b.keys().filter(|k| !a.contains_key(*k));
    a.keys().filter(|k| a.get(*k) != b.get(*k)).chain(only_b).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::report::{self, Facts};
    use crate::bench::stats::Summary;
    use crate::bench::workloads::{Mix, MultiTurn, SharedPrefix};
    use crate::bench::Fleet;

    fn config() -> BenchConfig {
        BenchConfig {
            workloads: vec![
                Workload::SharedPrefix(SharedPrefix {
                    groups: 2,
                    prompts_per_group: 2,
                    system_tokens: 100,
                    question_tokens: 10,
                    output_tokens: 10,
                }),
                Workload::MultiTurn(MultiTurn {
                    users: 2,
                    rounds: 2,
                    system_tokens: 100,
                    context_tokens: 100,
                    question_tokens: 10,
                    output_tokens: 10,
                    user_spacing_s: 0.1,
                    think_s: 1.0,
                }),
            ],
            policies: vec![Policy::EnvoyRoundRobin, Policy::Kvgate("kv_aware")],
            qps: vec![2.0, 4.0],
            gateways: vec![1],
            repeats: 2,
            fleet: Fleet {
                replicas: 2,
                block_size: 16,
                preset: "test".into(),
                speedup: 2.0,
                gpu_blocks: 10,
                max_num_seqs: 1,
                max_num_batched_tokens: 1,
            },
            max_duration_s: 10.0,
            slo_ttft_s: 2.0,
            slo_itl_s: 0.1,
            trace: "t".into(),
            seed: 7,
            mix: Mix::Priorities,
            peers_venv: "v".into(),
            pin: false,
            engines_nice: None,
            replay: true,
        }
    }

    /// What running `cell` could have given: numbers that differ from cell to cell.
    fn result_of(cell: &Cell<'_>, n: usize) -> RunResult {
        let ttft = 0.1 * (n + 1) as f64;
        let mut tagged = Outcome::served("1", "b", ttft * 2.0);
        tagged.tags.priority = Some("interactive");
        RunResult {
            workload: cell.workload.name().into(),
            policy: cell.policy.name(),
            gateways: cell.gateways,
            qps: cell.qps,
            repeat: cell.repeat,
            summary: Summary {
                requests: 2,
                ok: 2,
                ttft_p50: Some(ttft),
                ttft_p90: Some(ttft * 2.0),
                ..Summary::default()
            },
            router_command: None,
            kvgate_routed: Some((2, 0)),
            by_tag: Vec::new(),
            outcomes: vec![Outcome::served("0", "a", ttft), tagged],
        }
    }

    fn labels(cells: &[Cell<'_>]) -> Vec<String> {
        cells.iter().map(Cell::label).collect()
    }

    fn fresh_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kvgate-cells-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// Writes the cells of `plan[range]` into `dir` as one session does.
    fn session(dir: &Path, config: &BenchConfig, range: std::ops::Range<usize>, resume: bool) -> CellStore {
        let plan = plan(config);
        let mut store = CellStore::open(dir, config, resume).unwrap();
        for n in range {
            store.append(result_of(&plan[n], n)).unwrap();
        }
        store
    }

    #[test]
    fn the_plan_runs_every_repeat_of_every_policy_at_every_qps() {
        let config = config();
        let labels = labels(&plan(&config));
        // shared-prefix: 2 QPS × 2 repeats × 2 policies; multi-turn (closed loop): 2 × 2.
        assert_eq!(labels.len(), 12);
        assert_eq!(labels[0], "shared-prefix gateways=1 qps=2 repeat=0 envoy-round-robin");
        assert_eq!(labels[1], "shared-prefix gateways=1 qps=2 repeat=0 kvgate-kv-aware");
        assert_eq!(labels[2], "shared-prefix gateways=1 qps=2 repeat=1 envoy-round-robin");
        assert_eq!(labels[4], "shared-prefix gateways=1 qps=4 repeat=0 envoy-round-robin");
        assert_eq!(labels[11], "multi-turn gateways=1 qps=trace repeat=1 kvgate-kv-aware");
    }

    #[test]
    fn a_resumed_run_plans_exactly_the_missing_cells_in_order() {
        let (config, dir) = (config(), fresh_dir("resume"));
        let all = plan(&config);
        drop(session(&dir, &config, 0..5, false));
        let store = CellStore::open(&dir, &config, true).unwrap();
        assert_eq!(store.finished().len(), 5);
        assert_eq!(labels(&pending(&all, store.finished())), labels(&all[5..]));
        // The written outcomes come back (the requests files and charts need them).
        assert_eq!(store.finished()[1].outcomes[1].tags.priority, Some("interactive"));
        assert_eq!(store.finished()[1].outcomes[1].ttft, Some(0.4));
        // Finished out of order (a failed cell skipped, run later): the gaps, in plan order.
        let finished = vec![result_of(&all[1], 1), result_of(&all[3], 3)];
        let gaps: Vec<Cell<'_>> = [0, 2].into_iter().chain(4..all.len()).map(|n| all[n].clone()).collect();
        assert_eq!(labels(&pending(&all, &finished)), labels(&gaps));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn another_configuration_or_a_forgotten_resume_is_refused() {
        let (config, dir) = (config(), fresh_dir("mismatch"));
        drop(session(&dir, &config, 0..3, false));
        let mut other = config.clone();
        other.seed = 8;
        other.repeats = 3;
        let err = CellStore::open(&dir, &other, true).unwrap_err();
        let mismatch = err.downcast_ref::<ConfigMismatch>().expect("a ConfigMismatch");
        assert_eq!(mismatch.keys, ["repeats", "seed"], "{err}");
        assert!(err.to_string().contains("another configuration (differs in: repeats, seed)"), "{err}");
        let err = CellStore::open(&dir, &config, false).unwrap_err();
        assert!(err.to_string().contains("already holds 3 finished cells: pass --resume"), "{err}");
        // Refusals leave the finished cells alone.
        assert_eq!(CellStore::open(&dir, &config, true).unwrap().finished().len(), 3);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_last_line_cut_short_is_dropped_and_its_cell_runs_again() {
        let (config, dir) = (config(), fresh_dir("cut"));
        let all = plan(&config);
        drop(session(&dir, &config, 0..3, false));
        // A kill in the middle of writing the fourth cell.
        let line = serde_json::to_string(&Line { run: &result_of(&all[3], 3), outcomes: &[] }).unwrap();
        let mut file = OpenOptions::new().append(true).open(dir.join(CELLS_FILE)).unwrap();
        file.write_all(&line.as_bytes()[..line.len() / 2]).unwrap();
        drop(file);
        let mut store = CellStore::open(&dir, &config, true).unwrap();
        assert_eq!(labels(&pending(&all, store.finished())), labels(&all[3..]));
        store.append(result_of(&all[3], 3)).unwrap();
        drop(store);
        // The fragment is gone: the file reads whole.
        let store = CellStore::open(&dir, &config, true).unwrap();
        assert_eq!(labels(&pending(&all, store.finished())), labels(&all[4..]));
        // A broken line before the last is not a kill's doing: an error, not skipped.
        std::fs::write(dir.join(CELLS_FILE), "{\"run\": 1}\n").unwrap();
        let err = CellStore::open(&dir, &config, true).unwrap_err();
        assert!(err.to_string().contains("cells.jsonl line 1"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_report_from_two_sessions_is_the_report_from_one() {
        // `result_of`'s numbers include some JSON reads back a last bit off (0.1 × 7).
        let (config, two, one) = (config(), fresh_dir("two"), fresh_dir("one"));
        let all = plan(&config);
        drop(session(&two, &config, 0..7, false));
        let resumed = session(&two, &config, 7..all.len(), true);
        let single = session(&one, &config, 0..all.len(), false);
        let facts = Facts { command: "c".into(), commit: "x".into(), machine: "m".into(), started: "s".into() };
        let (out_two, out_one) = (two.join("report"), one.join("report"));
        let md_two = report::write(&out_two, &config, &facts, &resumed.into_results(&all)).unwrap();
        let md_one = report::write(&out_one, &config, &facts, &single.into_results(&all)).unwrap();
        assert_eq!(md_two, md_one);
        assert!(md_one.contains("## multi-turn\n"), "{md_one}");
        let read = |dir: &Path, file: &str| std::fs::read_to_string(dir.join(file)).unwrap();
        assert_eq!(read(&out_two, "results.json"), read(&out_one, "results.json"));
        let requests = "requests/shared-prefix-kvgate-kv-aware-1gw-4qps-r1.jsonl";
        assert_eq!(read(&out_two, requests), read(&out_one, requests));
        assert_eq!(read(&out_one, requests).lines().count(), 2, "the outcomes were kept");
        for dir in [two, one] {
            std::fs::remove_dir_all(dir).unwrap();
        }
    }
}
