//! `cargo xtask soak [--minutes N] [--out DIR]`: the gateway under steady load with engine
//! restarts, for an hour by default (`kvgate_e2e::soak`); writes `report.md`, `samples.csv`
//! and `rss.svg` to `target/soak/<UTC timestamp>/` (or `--out`). Fails if a promise broke.

use std::path::PathBuf;

use anyhow::{bail, Context};
use kvgate_e2e::soak::{self, SoakConfig};
use kvgate_e2e::{repo_root, Artifacts};

use crate::bench::sh;
use crate::{build_wasm, cargo, install};

/// Parses the flags and runs the soak.
pub fn run(args: &[String]) -> anyhow::Result<()> {
    let mut minutes = 60;
    let mut out = None;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--minutes" => minutes = it.next().context("--minutes needs a value")?.parse()?,
            "--out" => out = Some(PathBuf::from(it.next().context("--out needs a value")?)),
            other => bail!("unknown flag {other}; usage: cargo xtask soak [--minutes N] [--out DIR]"),
        }
    }
    install::all()?;
    build_wasm()?;
    cargo(&["build", "--workspace", "--bins"])?;
    let dir = out.unwrap_or_else(|| repo_root().join("target/soak").join(sh("date", &["-u", "+%Y%m%dT%H%M%SZ"])));
    soak_in(minutes, &dir)
}

/// Runs a soak of `minutes` with the debug binaries (already built) into `dir`.
pub fn soak_in(minutes: u64, dir: &std::path::Path) -> anyhow::Result<()> {
    let config = SoakConfig::minutes(minutes);
    eprintln!("\n== soak: {minutes} minutes, report in {}", dir.display());
    let report = soak::run(&config, &Artifacts::locate("debug"), dir)?;
    println!("{}", report.markdown(&config));
    if !report.pass() {
        bail!("the soak broke a promise; see {}", dir.join("report.md").display());
    }
    Ok(())
}
