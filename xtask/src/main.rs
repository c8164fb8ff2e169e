//! `cargo xtask` — everything the README promises, in one place.
//!
//! - `cargo xtask test`: installs what is missing (wasm target, Envoy, the Helm chart's
//!   checkers, vLLM's CPU build),
//!   checks formatting and lints, runs the unit and integration tests, builds the filter and
//!   runs the end-to-end tests and the fault suite through a real Envoy, the real-vLLM suite,
//!   then a 3-minute soak. `.ci/run` calls exactly this.
//! - `cargo xtask demo`: builds everything in release mode and runs the benchmark harness
//!   scaled down to about two minutes: a shared-prefix workload through 4 simulated engines
//!   behind Envoy alone (round robin, least request) and behind Envoy + kvgate, then prints
//!   the summary table and the routing decision's cost inside Envoy.
//! - `cargo xtask bench e2e`: the side-by-side benchmark of every routing policy on the same
//!   simulated fleet (see `bench.rs` for its flags); writes a report under `target/bench/`.
//! - `cargo xtask bench scale`: one sidecar subscribed to 64 to 1 000 engines' KV events,
//!   deciding at a fixed rate (see `tests/src/bench/scale.rs`); writes `scale.md`.
//! - `cargo xtask bench agentic-trace [--seed N] [--sessions N]`: writes the agentic workload's
//!   trace file, `tests/traces/agentic-coding.jsonl` (see `tests/src/bench/agentic.rs`).
//! - `cargo xtask faults [SCENARIO…]`: the fault suite under load, with its table of expected
//!   and measured behaviour; writes a report under `target/faults/` (see `faults.rs`).
//! - `cargo xtask soak [--minutes N]`: an hour (by default) of steady load with engine
//!   restarts, tracking the sidecar's and Envoy's memory and the index size (see `soak.rs`).
//! - `cargo xtask e2e-vllm`: only the real-vLLM suite — kvgate in front of real vLLM engines
//!   (vLLM's CPU build, installed once into a venv outside the clone; see `e2e_vllm.rs`).
//! - `cargo xtask package`: the filter as a file and as an OCI image layout (Wasm image
//!   format, for WasmPlugin `oci://` URLs), with its digests; see `package.rs`.
//! - `cargo xtask install`: only the installation step (the wasm target, both Envoys, the
//!   chart checkers and Prometheus).
//! - `cargo xtask build-wasm`: only the filter build.

#![forbid(unsafe_code)]

mod bench;
mod demo;
mod e2e_vllm;
mod faults;
mod install;
mod package;
mod soak;
mod wasm_imports;

use std::process::Command;

use anyhow::{bail, Context};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("test") => test(),
        Some("demo") => demo::run(),
        Some("install") => {
            install::all().and_then(|()| install::chart_tools()).and_then(|()| install::prometheus().map(drop))
        }
        Some("build-wasm") => build_wasm(),
        Some("package") => package::run(&args[1..]),
        Some("faults") => faults::run(&args[1..]),
        Some("soak") => soak::run(&args[1..]),
        Some("e2e-vllm") => e2e_vllm::run(&args[1..]),
        Some("bench") if args.get(1).map(String::as_str) == Some("e2e") => bench::e2e(&args[2..]),
        Some("bench") if args.get(1).map(String::as_str) == Some("filter") => bench::filter(&args[2..]),
        Some("bench") if args.get(1).map(String::as_str) == Some("memory") => bench::memory(),
        Some("bench") if args.get(1).map(String::as_str) == Some("throughput") => bench::throughput(),
        Some("bench") if args.get(1).map(String::as_str) == Some("agentic-trace") => bench::agentic_trace(&args[2..]),
        Some("bench") if args.get(1).map(String::as_str) == Some("scale") => bench::scale(&args[2..]),
        _ => {
            eprintln!(
                "usage: cargo xtask <test|demo|faults|soak|e2e-vllm|bench e2e|bench filter|bench memory|bench throughput|bench agentic-trace|bench scale|package|install|build-wasm>"
            );
            std::process::exit(2);
        }
    }
}

/// Runs a command from the repo root, failing on a non-zero exit.
pub fn run(program: &str, args: &[&str]) -> anyhow::Result<()> {
    run_with(&[], program, args)
}

/// [`run`], with the variables `env` set for the command.
fn run_with(env: &[(&str, &std::path::Path)], program: &str, args: &[&str]) -> anyhow::Result<()> {
    let vars: String = env.iter().map(|(k, v)| format!("{k}={} ", v.display())).collect();
    eprintln!("\n$ {vars}{program} {}", args.join(" "));
    let status = Command::new(program)
        .args(args)
        .envs(env.iter().copied())
        .current_dir(kvgate_e2e::repo_root())
        .status()
        .with_context(|| format!("running {program}"))?;
    if !status.success() {
        bail!("`{vars}{program} {}` failed: {status}", args.join(" "));
    }
    Ok(())
}

fn cargo(args: &[&str]) -> anyhow::Result<()> {
    run(&cargo_program(), args)
}

fn cargo_program() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// The gateway tests also run on the oldest Envoy: routing on the cache, the routing headers
/// removed (by the filter, and by Envoy with the VM failed), the client's transfer fields
/// taken out, the sidecar down, admission's 429, documented answers to bad bodies.
const ON_THE_OLDEST_ENVOY: &[&str] = &[
    "warmed_prefix_attracts_requests",
    "client_destination_header_is_ignored",
    "with_the_filter_vm_failed_a_client_still_cannot_pick_its_engine",
    "a_clients_token_ids_do_not_replace_the_messages_the_engine_runs",
    "sidecar_down_fails_open",
    "a_saturated_pool_queues_then_sheds_with_429",
    "abusive_bodies_get_documented_answers",
];

/// Runs [`ON_THE_OLDEST_ENVOY`] with `envoy`.
fn gateway_tests_on(envoy: &std::path::Path) -> anyhow::Result<()> {
    let mut args =
        vec!["test", "--workspace", "--test", "gateway", "--", "--ignored", "--test-threads", "1", "--exact"];
    args.extend(ON_THE_OLDEST_ENVOY);
    run_with(&[("ENVOY_BIN", envoy)], &cargo_program(), &args)
}

/// Builds the filter for Envoy (always release: opt-level 3 tokenizes ~2x faster than "z"),
/// loadable by every supported Envoy ([`wasm_imports`]).
pub fn build_wasm() -> anyhow::Result<()> {
    install::wasm_target()?;
    cargo(&["build", "-p", "kvgate-filter", "--target", "wasm32-wasip1", "--release"])?;
    let wasm = install::target_dir().join("wasm32-wasip1/release/kvgate_filter.wasm");
    let stubbed = wasm_imports::stub_unprovided(&wasm)?;
    if !stubbed.is_empty() {
        println!("{}: WASI calls older Envoys lack answer ENOSYS: {}", wasm.display(), stubbed.join(", "));
    }
    Ok(())
}

fn test() -> anyhow::Result<()> {
    install::all()?;
    let oldest_envoy = install::envoy_oldest()?;
    // `cargo test` below checks the Helm chart with them (xtask/tests/chart.rs).
    install::chart_tools()?;
    // And the alert rules and the dashboard's queries with promtool (xtask/tests/alerts.rs).
    install::prometheus()?;
    // First, so that an install that cannot be had fails the command at once.
    let vllm = e2e_vllm::prepare(&kvgate_e2e::repo_root().join("target/e2e-vllm/ci"))?;
    cargo(&["fmt", "--all", "--check"])?;
    cargo(&["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"])?;
    cargo(&["clippy", "-p", "kvgate-filter", "--target", "wasm32-wasip1", "--release", "--", "-D", "warnings"])?;
    cargo(&["test", "--workspace"])?;
    build_wasm()?;
    // The module imports only what every supported Envoy provides.
    let wasm = install::target_dir().join("wasm32-wasip1/release/kvgate_filter.wasm");
    let unprovided: Vec<String> = wasm_imports::wasi_imports(&wasm)?
        .into_iter()
        .filter(|i| !wasm_imports::ENVOY_WASI.contains(&i.as_str()))
        .collect();
    anyhow::ensure!(unprovided.is_empty(), "the filter imports WASI calls older Envoys lack: {unprovided:?}");
    // Every binary the suites start. With `--tests`, dependencies' features are unified as
    // in `cargo test` above (dev-dependencies included), so nothing is built twice.
    cargo(&["build", "--workspace", "--bins", "--tests"])?;
    for suite in ["gateway", "breaker", "disaggregation", "faults", "metrics", "tracing"] {
        cargo(&["test", "--workspace", "--test", suite, "--", "--ignored", "--test-threads", "1"])?;
    }
    gateway_tests_on(&oldest_envoy)?;
    // The simulator is kvgate's own: the engine itself says whether kvgate understands it.
    e2e_vllm::suite(&vllm)?;
    // Three minutes, not the hour: CI must stay under 60 minutes on 2 cores.
    soak::soak_in(3, &kvgate_e2e::repo_root().join("target/soak/ci"))?;
    eprintln!("\nall tests passed");
    Ok(())
}
