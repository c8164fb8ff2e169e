//! A real kvgate stack on loopback, for the end-to-end tests and the demo.
//!
//! [`Stack::start`] launches N simulated engines, the sidecar and Envoy (with the wasm filter,
//! or without it for a round-robin baseline), each on free ports, with logs under
//! `target/e2e-logs/`. Everything is killed when the [`Stack`] is dropped. Readiness is waited
//! for on conditions with timeouts, never on fixed sleeps.
//!
//! The binaries come from [`Artifacts`]: `KVGATE_WASM`, `KVGATE_SIDECAR_BIN`, `KVGATE_SIM_BIN`
//! and `ENVOY_BIN`/`ENVOY_PATH` override the defaults that `cargo xtask` builds and installs.

pub mod bench;
pub mod client;
pub mod delay_proxy;
pub mod envoy;
pub mod faults;
pub mod hung;
pub mod otlp;
pub mod process;
pub mod prometheus;
pub mod soak;
pub mod stack;
pub mod vllm;
pub mod workload;

pub use stack::{Routing, Stack, StackOptions};

use std::path::PathBuf;

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// Where the built and installed pieces are.
#[derive(Debug, Clone)]
pub struct Artifacts {
    /// `kvgate_filter.wasm`.
    pub wasm: PathBuf,
    /// `kvgate-sidecar`.
    pub sidecar: PathBuf,
    /// `kvgate-sim`.
    pub sim: PathBuf,
    /// The scale benchmark's other gateways (`sidecar/examples/peer_gateways.rs`), built only
    /// for it (`KVGATE_PEERS_BIN` names another build, as `KVGATE_SIDECAR_BIN` and
    /// `KVGATE_SIM_BIN` do for theirs).
    pub peer_gateways: PathBuf,
    /// Envoy.
    pub envoy: PathBuf,
    /// The tokenizer directory of the default model.
    pub model_dir: PathBuf,
}

impl Artifacts {
    /// Paths from the environment, else where `cargo xtask` puts them (`profile` is the
    /// cargo profile of the native binaries: `debug` or `release`).
    pub fn locate(profile: &str) -> Artifacts {
        let root = repo_root();
        let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"));
        let from_env = |key: &str| std::env::var_os(key).map(PathBuf::from);
        Artifacts {
            wasm: from_env("KVGATE_WASM").unwrap_or_else(|| target.join("wasm32-wasip1/release/kvgate_filter.wasm")),
            sidecar: from_env("KVGATE_SIDECAR_BIN").unwrap_or_else(|| target.join(profile).join("kvgate-sidecar")),
            sim: from_env("KVGATE_SIM_BIN").unwrap_or_else(|| target.join(profile).join("kvgate-sim")),
            peer_gateways: from_env("KVGATE_PEERS_BIN")
                .unwrap_or_else(|| target.join(profile).join("examples").join(bench::scale::PEERS)),
            envoy: envoy::locate(&target),
            model_dir: root.join("models/qwen3-0.6b"),
        }
    }

    /// Fails with a clear message if anything is missing.
    pub fn check(&self) -> anyhow::Result<()> {
        for (what, path) in
            [("wasm filter", &self.wasm), ("sidecar", &self.sidecar), ("simulator", &self.sim), ("envoy", &self.envoy)]
        {
            anyhow::ensure!(path.exists(), "{what} not found at {} (run `cargo xtask test` or `cargo xtask demo`, which build and install everything)", path.display());
        }
        Ok(())
    }
}
