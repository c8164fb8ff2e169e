//! `cargo xtask bench e2e`: every routing policy on the same simulated fleet and workloads.
//!
//! ```text
//! cargo xtask bench e2e [--quick] [--workload shared-prefix,multi-turn,mooncake-conversation,cache-pressure,agentic]
//!                       [--qps 2,4,8] [--repeats 3] [--policies envoy-round-robin,kvgate-kv-aware]
//!                       [--speedup 10] [--mix none|priorities|tenants|outside] [--gateways 1,2,4]
//!                       [--users 48] [--user-spacing 0.25] [--trace-speed 4] [--no-replay]
//!                       [--pin] [--nice-engines 10]
//!                       [--out DIR [--resume]]
//! ```
//!
//! `--users` and `--user-spacing` set multi-turn's load (it is a closed loop, so `--qps` does
//! not drive it): how many users, and the simulated seconds between their first questions.
//! `--trace-speed F` sets the Mooncake trace's load: its arrival times divided by F (2 at quick
//! scale, 1 at full scale). `--no-replay` skips the offline replay behind the bounds table
//! (an overloaded cell's runs out its three minutes and gives none).
//! `--pin` puts the routers on one core and the engines on the other; `--nice-engines N`
//! instead runs the engines' threads at nice N, so a router never waits for a CPU an engine
//! holds and the engines still get every cycle the routers leave.
//!
//! Writes `target/bench/<UTC timestamp>/{report.md,results.json,*.svg}` (or `--out`).
//!
//! Before each cell it prints `cell i of N: <cell>`, after it the cell's time and an estimate
//! of the time left. Each finished cell is written at once to `<out>/cells.jsonl`, beside the
//! run's configuration (`<out>/config.json`), and the report is built from that file. A cell
//! that fails is reported and the run goes on; the command then fails, naming the failed
//! cells. `--resume --out DIR` runs only the cells DIR does not hold yet (those that failed or
//! were never reached) and reports on all of them; it refuses a DIR of another configuration
//! (other flags), and without `--resume` a DIR that holds finished cells is refused.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context};
use kvgate_e2e::bench::agentic::{self, AgenticParams};
use kvgate_e2e::bench::cells::{self, CellStore};
use kvgate_e2e::bench::report::{self, Facts};
use kvgate_e2e::bench::scale::ScaleParams;
use kvgate_e2e::bench::workloads::{Agentic, CachePressure, Mix, Mooncake, MultiTurn, SharedPrefix, Workload};
use kvgate_e2e::bench::{self, BenchConfig, Fleet, Policy};
use kvgate_e2e::{repo_root, Artifacts};

use crate::{build_wasm, cargo, install};

/// Parsed command line.
struct Args {
    quick: bool,
    workloads: Option<Vec<String>>,
    qps: Option<Vec<f64>>,
    gateways: Vec<usize>,
    repeats: Option<usize>,
    policies: Option<Vec<String>>,
    speedup: Option<f64>,
    mix: Mix,
    users: Option<usize>,
    user_spacing_s: Option<f64>,
    trace_speed: Option<f64>,
    no_replay: bool,
    pin: bool,
    nice_engines: Option<i32>,
    out: Option<PathBuf>,
    resume: bool,
}

/// A flag's comma-separated values.
fn list(value: Option<&String>, flag: &str) -> anyhow::Result<Vec<String>> {
    Ok(value.with_context(|| format!("{flag} needs a value"))?.split(',').map(str::to_owned).collect())
}

/// A flag's comma-separated values, each parsed.
fn parsed_list<T: std::str::FromStr>(value: Option<&String>, flag: &str) -> anyhow::Result<Vec<T>>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    list(value, flag)?.iter().map(|v| v.parse::<T>().with_context(|| format!("{flag}: {v:?}"))).collect()
}

fn parse(args: &[String]) -> anyhow::Result<Args> {
    let mut a = Args {
        quick: false,
        workloads: None,
        qps: None,
        gateways: vec![1],
        repeats: None,
        policies: None,
        speedup: None,
        mix: Mix::None,
        users: None,
        user_spacing_s: None,
        trace_speed: None,
        no_replay: false,
        pin: false,
        nice_engines: None,
        out: None,
        resume: false,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--quick" => a.quick = true,
            "--workload" => a.workloads = Some(list(it.next(), flag)?),
            "--policies" => a.policies = Some(list(it.next(), flag)?),
            "--qps" => a.qps = Some(parsed_list(it.next(), flag)?),
            "--gateways" => {
                a.gateways = parsed_list(it.next(), flag)?;
                if a.gateways.contains(&0) {
                    bail!("--gateways: at least one gateway");
                }
            }
            "--repeats" => a.repeats = Some(it.next().context("--repeats needs a value")?.parse()?),
            "--speedup" => a.speedup = Some(it.next().context("--speedup needs a value")?.parse()?),
            "--mix" => a.mix = Mix::parse(it.next().context("--mix needs a value")?)?,
            "--users" => {
                let users: usize = it.next().context("--users needs a value")?.parse()?;
                if users == 0 {
                    bail!("--users: at least one user");
                }
                a.users = Some(users);
            }
            "--user-spacing" => {
                let s: f64 = it.next().context("--user-spacing needs a value")?.parse()?;
                if !(s.is_finite() && s >= 0.0) {
                    bail!("--user-spacing: a number of seconds ≥ 0");
                }
                a.user_spacing_s = Some(s);
            }
            "--trace-speed" => {
                let f: f64 = it.next().context("--trace-speed needs a value")?.parse()?;
                if !(f.is_finite() && f > 0.0) {
                    bail!("--trace-speed: a positive factor");
                }
                a.trace_speed = Some(f);
            }
            "--no-replay" => a.no_replay = true,
            "--pin" => a.pin = true,
            "--nice-engines" => {
                let nice: i32 = it.next().context("--nice-engines needs a value")?.parse()?;
                if !(1..=19).contains(&nice) {
                    bail!("--nice-engines: a nice value from 1 to 19");
                }
                a.nice_engines = Some(nice);
            }
            "--out" => a.out = Some(PathBuf::from(it.next().context("--out needs a value")?)),
            "--resume" => a.resume = true,
            other => bail!("unknown flag {other}"),
        }
    }
    if a.resume && a.out.is_none() {
        bail!("--resume needs --out DIR: the directory of the run to resume");
    }
    Ok(a)
}

/// The agentic workload's committed trace.
fn agentic_trace_path() -> PathBuf {
    repo_root().join("tests/traces/agentic-coding.jsonl")
}

/// `cargo xtask bench agentic-trace [--seed N] [--sessions N]`: writes the agentic trace.
pub fn agentic_trace(raw: &[String]) -> anyhow::Result<()> {
    let mut params = AgenticParams::default();
    let mut it = raw.iter();
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--seed" => params.seed = it.next().context("--seed needs a value")?.parse()?,
            "--sessions" => params.sessions = it.next().context("--sessions needs a value")?.parse()?,
            other => bail!("unknown flag {other}"),
        }
    }
    let sessions = agentic::generate(&params);
    let path = agentic_trace_path();
    std::fs::write(&path, agentic::trace_text(&params, &sessions)?)?;
    let calls: usize = sessions.iter().map(agentic::calls).sum();
    println!("{} sessions, {calls} model calls: {}", sessions.len(), path.display());
    Ok(())
}

/// `cargo xtask bench scale [--engines 64,256,1000] [--rate-scale 1,1,0.25] [--gateways 1,16]
/// [--warmup S] [--window S] [--decisions N] [--publisher-threads N] [--out DIR]`: one sidecar
/// as the fleet grows, with its peers' bookings when there are several gateways
/// (`tests/src/bench/scale.rs`); writes `scale.md` and `scale.json`.
pub fn scale(raw: &[String]) -> anyhow::Result<()> {
    let mut params = ScaleParams::default();
    let mut out = None;
    let mut it = raw.iter();
    while let Some(flag) = it.next() {
        let value =
            |it: &mut std::slice::Iter<'_, String>| it.next().with_context(|| format!("{flag} needs a value")).cloned();
        match flag.as_str() {
            "--engines" => params.engines = parsed_list(it.next(), flag)?,
            "--rate-scale" => params.rate_scale = parsed_list(it.next(), flag)?,
            "--warmup" => params.warmup_s = value(&mut it)?.parse()?,
            "--window" => params.window_s = value(&mut it)?.parse()?,
            "--decisions" => params.decisions_per_s = value(&mut it)?.parse()?,
            "--publisher-threads" => params.publisher_threads = value(&mut it)?.parse()?,
            "--gateways" => params.gateways = parsed_list(it.next(), flag)?,
            "--out" => out = Some(PathBuf::from(value(&mut it)?)),
            other => bail!("unknown flag {other}"),
        }
    }
    anyhow::ensure!(
        !params.engines.is_empty() && params.engines.iter().all(|e| *e > 0),
        "--engines: at least one engine count, each positive"
    );
    anyhow::ensure!(
        !params.rate_scale.is_empty() && params.rate_scale.iter().all(|r| r.is_finite() && *r > 0.0),
        "--rate-scale: positive shares of the recorded rate"
    );
    anyhow::ensure!(params.window_s > 0.0 && params.decisions_per_s > 0.0, "--window and --decisions must be positive");
    anyhow::ensure!(
        !params.gateways.is_empty() && params.gateways.iter().all(|g| *g > 0),
        "--gateways: at least one gateway count, each positive"
    );
    cargo(&["build", "--release", "-p", "kvgate-sim", "-p", "kvgate-sidecar"])?;
    if params.gateways.iter().any(|g| *g > 1) {
        cargo(&["build", "--release", "-p", "kvgate-sidecar", "--example", kvgate_e2e::bench::scale::PEERS])?;
    }
    let artifacts = Artifacts::locate("release");
    let facts = facts(format!("cargo xtask bench scale {}", raw.join(" ")).trim().to_owned());
    let dir = out.unwrap_or_else(|| repo_root().join("target/bench").join(sh("date", &["-u", "+%Y%m%dT%H%M%SZ"])));
    let rows = kvgate_e2e::bench::scale::run(&artifacts, &dir.join("scale-logs"), &params)?;
    let md = format!(
        "# One sidecar as the fleet grows

- command: `{}`
- commit: `{}`
- machine: {}
- started: {}

{}",
        facts.command,
        facts.commit,
        facts.machine,
        facts.started,
        kvgate_e2e::bench::scale::table(&rows)
    );
    std::fs::write(dir.join("scale.md"), &md)?;
    std::fs::write(
        dir.join("scale.json"),
        serde_json::to_string_pretty(&serde_json::json!({ "params": params, "rows": rows }))?,
    )?;
    println!(
        "{md}
written to {}",
        dir.display()
    );
    Ok(())
}

/// The workloads at full or quick scale.
fn workloads(quick: bool) -> Vec<Workload> {
    let agentic = Workload::Agentic(Agentic { trace: agentic_trace_path() });
    if quick {
        vec![
            Workload::SharedPrefix(SharedPrefix {
                groups: 40,
                prompts_per_group: 5,
                system_tokens: 2000,
                question_tokens: 400,
                output_tokens: 100,
            }),
            Workload::MultiTurn(MultiTurn {
                users: 12,
                rounds: 4,
                system_tokens: 1000,
                context_tokens: 1500,
                question_tokens: 100,
                output_tokens: 100,
                user_spacing_s: 1.0,
                think_s: 2.0,
            }),
            Workload::MooncakeConversation(Mooncake {
                requests: 1000,
                time_compression: 2.0,
                max_input_tokens: 8192,
                max_output_tokens: 200,
            }),
            Workload::CachePressure(CachePressure {
                documents: 30,
                reads_per_document: 6,
                document_tokens: 3000,
                one_offs: 180,
                one_off_tokens: 2000,
                question_tokens: 100,
                output_tokens: 50,
                pressure: 3.0,
            }),
            agentic,
        ]
    } else {
        vec![
            Workload::SharedPrefix(SharedPrefix {
                groups: 150,
                prompts_per_group: 5,
                system_tokens: 6000,
                question_tokens: 1200,
                output_tokens: 1000,
            }),
            Workload::MultiTurn(MultiTurn {
                users: 40,
                rounds: 6,
                system_tokens: 1000,
                context_tokens: 4000,
                question_tokens: 200,
                output_tokens: 300,
                user_spacing_s: 1.0,
                think_s: 5.0,
            }),
            Workload::MooncakeConversation(Mooncake {
                requests: 1500,
                time_compression: 1.0,
                max_input_tokens: 16_384,
                max_output_tokens: 500,
            }),
            Workload::CachePressure(CachePressure {
                documents: 60,
                reads_per_document: 8,
                document_tokens: 6000,
                one_offs: 480,
                one_off_tokens: 4000,
                question_tokens: 200,
                output_tokens: 200,
                pressure: 3.0,
            }),
            agentic,
        ]
    }
}

/// The trimmed standard output of a command run from the repo root ("" if it fails).
pub fn sh(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .current_dir(repo_root())
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default()
}

/// The benchmark's fleet: 4 simulated engines with an 8B model's time model on an H100.
pub fn fleet(speedup: f64) -> Fleet {
    Fleet {
        replicas: 4,
        block_size: 16,
        preset: "llama8b-h100".into(),
        speedup,
        // 256k tokens: a third of what an H100 holds for an 8B model after its weights.
        gpu_blocks: 16_384,
        max_num_seqs: 256,
        max_num_batched_tokens: 8192,
    }
}

/// The exact command, commit and machine, for a report.
pub fn facts(command: String) -> Facts {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_default();
    let dirty = if sh("git", &["status", "--porcelain"]).is_empty() { "" } else { "-dirty" };
    Facts {
        command,
        commit: format!("{}{dirty}", sh("git", &["rev-parse", "--short", "HEAD"])),
        machine: format!("{cpu}, {} cores, Linux {}", sh("nproc", &[]), sh("uname", &["-r"])),
        started: sh("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]),
    }
}

/// `cargo xtask bench e2e …`.
pub fn e2e(raw: &[String]) -> anyhow::Result<()> {
    let args = parse(raw)?;
    let mut all = workloads(args.quick);
    if let Some(names) = &args.workloads {
        for n in names {
            if !all.iter().any(|w| w.name() == n) {
                bail!("unknown workload {n}");
            }
        }
        all.retain(|w| names.iter().any(|n| n == w.name()));
    }
    for w in &mut all {
        match w {
            Workload::MultiTurn(m) => {
                m.users = args.users.unwrap_or(m.users);
                m.user_spacing_s = args.user_spacing_s.unwrap_or(m.user_spacing_s);
            }
            Workload::MooncakeConversation(m) => m.time_compression = args.trace_speed.unwrap_or(m.time_compression),
            _ => {}
        }
    }
    let policies = match &args.policies {
        Some(names) => names.iter().map(|n| Policy::parse(n)).collect::<anyhow::Result<Vec<_>>>()?,
        None => Policy::ALL.to_vec(),
    };
    // The gateway's CPU work is real: the wall-clock request rate is QPS × speedup, and on a
    // 2-core machine shared with the engines, more than ~2× starves Envoy.
    let speedup = args.speedup.unwrap_or(2.0);
    let config = BenchConfig {
        workloads: all,
        policies,
        gateways: args.gateways,
        qps: args.qps.unwrap_or_else(|| if args.quick { vec![12.0, 20.0, 28.0] } else { vec![2.0, 3.0, 4.0] }),
        repeats: args.repeats.unwrap_or(if args.quick { 1 } else { 3 }),
        fleet: fleet(speedup),
        max_duration_s: if args.quick { 200.0 } else { 600.0 },
        slo_ttft_s: 2.0,
        slo_itl_s: 0.1,
        trace: repo_root().join("../shared/testdata/traces/mooncake-conversation.jsonl"),
        seed: 7,
        mix: args.mix,
        peers_venv: kvgate_e2e::bench::peers::venv_dir(&repo_root().join("target")),
        pin: args.pin,
        engines_nice: args.nice_engines,
        replay: !args.no_replay,
    };
    let dir = args.out.unwrap_or_else(|| repo_root().join("target/bench").join(sh("date", &["-u", "+%Y%m%dT%H%M%SZ"])));
    // Before building anything: a directory of another configuration is refused at once.
    let mut store = CellStore::open(&dir, &config, args.resume)?;
    install::all()?;
    if config.policies.iter().any(|p| matches!(p, Policy::Peer(_))) {
        install::peers()?;
    }
    build_wasm()?;
    cargo(&["build", "--release", "-p", "kvgate-sim", "-p", "kvgate-sidecar"])?;
    let artifacts = Artifacts::locate("release");
    let facts = facts(format!("cargo xtask bench e2e {}", raw.join(" ")).trim().to_owned());
    let failed = bench::run_into(&config, &artifacts, &mut store)?;
    let results = store.into_results(&cells::plan(&config));
    let md = report::write(&dir, &config, &facts, &results)?;
    println!("{md}\nwritten to {}", dir.display());
    if !failed.is_empty() {
        bail!(
            "{} cell(s) failed, the report has the rest:\n  {}\nrun them again with: cargo xtask bench e2e <the same flags> --out {} --resume",
            failed.len(),
            failed.join("\n  "),
            dir.display()
        );
    }
    Ok(())
}

/// `cargo xtask bench memory`: only the memory parts of `bench filter` (what big bodies leave
/// in Envoy's memory, Envoy's memory by worker count and models), then what keeping the
/// tokenizers out of Envoy costs per request; `KVGATE_WASM` measures another build of the
/// filter.
pub fn memory() -> anyhow::Result<()> {
    install::all()?;
    if std::env::var_os("KVGATE_WASM").is_none() {
        build_wasm()?;
    }
    cargo(&["build", "--release", "-p", "kvgate-sim", "-p", "kvgate-sidecar"])?;
    let artifacts = Artifacts::locate("release");
    let placement = kvgate_e2e::bench::placement::run(&artifacts)?;
    let rows = kvgate_e2e::bench::memory::run(&artifacts)?;
    let workers = kvgate_e2e::bench::workers::run(&artifacts)?;
    println!(
        "{}\n{}\n{}",
        kvgate_e2e::bench::memory::table(&rows),
        kvgate_e2e::bench::workers::table(&workers),
        kvgate_e2e::bench::placement::table(&placement)
    );
    Ok(())
}

/// `cargo xtask bench throughput`: only the throughput part of `bench filter` (requests/s and
/// latency by offered rate, then the closed-loop ceiling).
pub fn throughput() -> anyhow::Result<()> {
    install::all()?;
    build_wasm()?;
    cargo(&["build", "--release", "-p", "kvgate-sim", "-p", "kvgate-sidecar"])?;
    let throughput = kvgate_e2e::bench::throughput::run(&Artifacts::locate("release"))?;
    println!("{}", kvgate_e2e::bench::throughput::table(&throughput));
    Ok(())
}

/// `cargo xtask bench filter`: the latency kvgate adds, and tokenization in Envoy vs native.
pub fn filter(raw: &[String]) -> anyhow::Result<()> {
    let usage = "usage: cargo xtask bench filter [--out DIR] [--overhead-only]";
    let (mut out, mut overhead_only) = (None, false);
    let mut args = raw.iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--out" => out = Some(PathBuf::from(args.next().ok_or_else(|| anyhow::anyhow!(usage))?)),
            "--overhead-only" => overhead_only = true,
            _ => bail!(usage),
        }
    }
    install::all()?;
    build_wasm()?;
    cargo(&["build", "--release", "-p", "kvgate-sim", "-p", "kvgate-sidecar"])?;
    let artifacts = Artifacts::locate("release");
    let facts = facts(format!("cargo xtask bench filter {}", raw.join(" ")).trim().to_owned());
    let report = kvgate_e2e::bench::filter::run(&artifacts)?;
    let mut tables = kvgate_e2e::bench::filter::tables(&report);
    let mut json = serde_json::json!({"facts": facts, "report": report});
    if !overhead_only {
        let throughput = kvgate_e2e::bench::throughput::run(&artifacts)?;
        let memory = kvgate_e2e::bench::memory::run(&artifacts)?;
        let workers = kvgate_e2e::bench::workers::run(&artifacts)?;
        let placement = kvgate_e2e::bench::placement::run(&artifacts)?;
        for table in [
            kvgate_e2e::bench::throughput::table(&throughput),
            kvgate_e2e::bench::memory::table(&memory),
            kvgate_e2e::bench::workers::table(&workers),
            kvgate_e2e::bench::placement::table(&placement),
        ] {
            tables += &format!("\n{table}");
        }
        json["throughput"] = serde_json::to_value(&throughput)?;
        json["memory"] = serde_json::to_value(&memory)?;
        json["workers"] = serde_json::to_value(&workers)?;
        json["placement"] = serde_json::to_value(&placement)?;
    }
    let md = format!(
        "# kvgate filter overhead\n\n- command: `{}`\n- commit: `{}`\n- machine: {}\n- started: {}\n\n{tables}",
        facts.command, facts.commit, facts.machine, facts.started
    );
    let dir = out.unwrap_or_else(|| repo_root().join("target/bench").join(sh("date", &["-u", "+%Y%m%dT%H%M%SZ"])));
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("filter.md"), &md)?;
    std::fs::write(dir.join("filter.json"), serde_json::to_string_pretty(&json)?)?;
    println!("{md}\nwritten to {}", dir.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> anyhow::Result<Args> {
        parse(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn multi_turn_load_flags_are_read_and_checked() {
        let a = args(&["--users", "128", "--user-spacing", "0.1"]).unwrap();
        assert_eq!((a.users, a.user_spacing_s), (Some(128), Some(0.1)));
        for bad in [&["--users", "0"][..], &["--users"], &["--user-spacing", "-1"], &["--user-spacing", "inf"]] {
            assert!(args(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn resume_is_read_and_needs_an_out_dir() {
        let a = args(&["--out", "d", "--resume"]).unwrap();
        assert_eq!((a.out, a.resume), (Some(PathBuf::from("d")), true));
        assert!(!args(&["--out", "d"]).unwrap().resume);
        let err = args(&["--resume"]).err().expect("--resume alone is refused");
        assert!(err.to_string().contains("--resume needs --out"), "{err}");
    }

    #[test]
    fn engines_nice_is_read_and_checked() {
        assert_eq!(args(&["--nice-engines", "10"]).unwrap().nice_engines, Some(10));
        assert_eq!(args(&[]).unwrap().nice_engines, None);
        for bad in
            [&["--nice-engines", "0"][..], &["--nice-engines", "20"], &["--nice-engines", "-5"], &["--nice-engines"]]
        {
            assert!(args(bad).is_err(), "{bad:?}");
        }
    }
}
