//! `cargo xtask faults [SCENARIO…] [--out DIR]`: the fault suite (`kvgate_e2e::faults`), each
//! scenario under steady load through the real Envoy, the sidecar and simulated engines.
//! Prints the table of scenario, expected behaviour and measured result, and writes it to
//! `target/faults/<UTC timestamp>/report.md` (or `--out`). Fails if any promise is broken.

use std::path::PathBuf;

use anyhow::{bail, Context};
use kvgate_e2e::faults::{self, Row, SCENARIOS};
use kvgate_e2e::{repo_root, Artifacts};

use crate::{bench::sh, build_wasm, cargo, install};

/// Runs the named scenarios (all by default).
pub fn run(args: &[String]) -> anyhow::Result<()> {
    let mut names = Vec::new();
    let mut out = None;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--out" => out = Some(PathBuf::from(it.next().context("--out needs a value")?)),
            name if SCENARIOS.iter().any(|(n, _)| *n == name) => names.push(name.to_owned()),
            other => bail!(
                "unknown scenario {other}; scenarios: {}",
                SCENARIOS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            ),
        }
    }
    if names.is_empty() {
        names = SCENARIOS.iter().map(|(n, _)| (*n).to_owned()).collect();
    }
    install::all()?;
    build_wasm()?;
    cargo(&["build", "--workspace", "--bins"])?;
    let artifacts = Artifacts::locate("debug");
    let mut rows: Vec<Row> = Vec::new();
    for name in &names {
        eprintln!("\n== {name}");
        rows.push(faults::run(name, &artifacts).with_context(|| format!("scenario {name}"))?);
        eprintln!("{}", faults::table(&rows[rows.len() - 1..]));
    }
    let table = faults::table(&rows);
    let dir = out.unwrap_or_else(|| repo_root().join("target/faults").join(sh("date", &["-u", "+%Y%m%dT%H%M%SZ"])));
    std::fs::create_dir_all(&dir)?;
    let report = format!(
        "# kvgate fault suite\n\nRun {} on {}. Each scenario: 3 simulated engines, the sidecar and Envoy with the filter, steady load of 20 small chats per second.\n\n{table}",
        sh("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]),
        sh("uname", &["-srm"]),
    );
    std::fs::write(dir.join("report.md"), report)?;
    println!("\n{table}\nreport: {}", dir.join("report.md").display());
    if rows.iter().any(|r| !r.pass) {
        bail!("some promises were broken");
    }
    Ok(())
}
