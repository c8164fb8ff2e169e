//! `cargo xtask` — everything the README promises, in one place.
//!
//! - `cargo xtask test`: installs what is missing (wasm target, Envoy, vLLM's CPU build),
//!   checks formatting and lints, runs the unit and integration tests, builds the filter and
//!   runs the end-to-end tests and the fault suite through a real Envoy, the real-vLLM suite,
//!   then a 3-minute soak. `.ci/run` calls exactly this.
//! - `cargo xtask demo`: builds everything in release mode and runs the benchmark harness
//!   scaled down to about two minutes: a shared-prefix workload through 4 simulated engines
//!   behind Envoy alone (round robin, least request) and behind Envoy + kvgate, then prints
//!   the summary table and the routing decision's cost inside Envoy.
//! - `cargo xtask bench e2e`: the side-by-side benchmark of every routing policy on the same
//!   simulated fleet (see `bench.rs` for its flags); writes a report under `target/bench/`.
//! - `cargo xtask faults [SCENARIO…]`: the fault suite under load, with its table of expected
//!   and measured behaviour; writes a report under `target/faults/` (see `faults.rs`).
//! - `cargo xtask soak [--minutes N]`: an hour (by default) of steady load with engine
//!   restarts, tracking the sidecar's and Envoy's memory and the index size (see `soak.rs`).
//! - `cargo xtask e2e-vllm`: only the real-vLLM suite — kvgate in front of real vLLM engines
//!   (vLLM's CPU build, installed once into a venv outside the clone; see `e2e_vllm.rs`).
//! - `cargo xtask package`: the filter as a file and as an OCI image layout (Wasm image
//!   format, for WasmPlugin `oci://` URLs), with its digests; see `package.rs`.
//! - `cargo xtask install`: only the installation step.
//! - `cargo xtask build-wasm`: only the filter build.

#![forbid(unsafe_code)]

mod bench;
mod demo;
mod e2e_vllm;
mod faults;
mod install;
mod package;
mod soak;

use std::process::Command;

use anyhow::{bail, Context};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("test") => test(),
        Some("demo") => demo::run(),
        Some("install") => install::all(),
        Some("build-wasm") => build_wasm(),
        Some("package") => package::run(&args[1..]),
        Some("faults") => faults::run(&args[1..]),
        Some("soak") => soak::run(&args[1..]),
        Some("e2e-vllm") => e2e_vllm::run(&args[1..]),
        Some("bench") if args.get(1).map(String::as_str) == Some("e2e") => bench::e2e(&args[2..]),
        Some("bench") if args.get(1).map(String::as_str) == Some("filter") => bench::filter(&args[2..]),
        Some("bench") if args.get(1).map(String::as_str) == Some("memory") => bench::memory(),
        _ => {
            eprintln!(
                "usage: cargo xtask <test|demo|faults|soak|e2e-vllm|bench e2e|bench filter|bench memory|package|install|build-wasm>"
            );
            std::process::exit(2);
        }
    }
}

/// Runs a command from the repo root, failing on a non-zero exit.
pub fn run(program: &str, args: &[&str]) -> anyhow::Result<()> {
    eprintln!("\n$ {program} {}", args.join(" "));
    let status = Command::new(program)
        .args(args)
        .current_dir(kvgate_e2e::repo_root())
        .status()
        .with_context(|| format!("running {program}"))?;
    if !status.success() {
        bail!("`{program} {}` failed: {status}", args.join(" "));
    }
    Ok(())
}

fn cargo(args: &[&str]) -> anyhow::Result<()> {
    run(&std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()), args)
}

/// Builds the filter for Envoy (always release: opt-level 3 tokenizes ~2x faster than "z").
pub fn build_wasm() -> anyhow::Result<()> {
    install::wasm_target()?;
    cargo(&["build", "-p", "kvgate-filter", "--target", "wasm32-wasip1", "--release"])
}

fn test() -> anyhow::Result<()> {
    install::all()?;
    // First, so that an install that cannot be had fails the command at once.
    let vllm = e2e_vllm::prepare(&kvgate_e2e::repo_root().join("target/e2e-vllm/ci"))?;
    cargo(&["fmt", "--all", "--check"])?;
    cargo(&["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"])?;
    cargo(&["clippy", "-p", "kvgate-filter", "--target", "wasm32-wasip1", "--release", "--", "-D", "warnings"])?;
    cargo(&["test", "--workspace"])?;
    build_wasm()?;
    // `--workspace` keeps feature unification identical to the step above: no rebuilds.
    cargo(&["build", "--workspace", "--bins"])?;
    for suite in ["gateway", "disaggregation", "faults"] {
        cargo(&["test", "--workspace", "--test", suite, "--", "--ignored", "--test-threads", "1"])?;
    }
    // The simulator is kvgate's own: the engine itself says whether kvgate understands it.
    e2e_vllm::suite(&vllm)?;
    // Three minutes, not the hour: CI must stay under 60 minutes on 2 cores.
    soak::soak_in(3, &kvgate_e2e::repo_root().join("target/soak/ci"))?;
    eprintln!("\nall tests passed");
    Ok(())
}
