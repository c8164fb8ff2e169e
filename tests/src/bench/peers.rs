//! Peer routers, run against the same simulated fleet: SGLang's router (`cache_aware`) and
//! vLLM's router (`cache_aware`, and `kv_aware` fed by the engines' KV events — possible
//! because the simulator's block hashes are vLLM's own).
//!
//! They are installed from PyPI into `target/peers-venv` by `cargo xtask bench`; they listen
//! on loopback only, and their exact command lines go into the report.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::json;

use crate::client;
use crate::process::{free_port, wait_for, Proc};
use crate::stack::SimHandle;

/// What `cargo xtask bench` installs.
pub const PACKAGES: [&str; 2] = ["sglang-router==0.3.2", "vllm-router==0.1.17"];

/// The venv the peers live in.
pub fn venv_dir(target: &Path) -> PathBuf {
    target.join("peers-venv")
}

/// A peer router and policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Peer {
    /// `sglang-router launch --policy cache_aware` (approximate: a radix tree of the request
    /// text it has routed).
    SglangCacheAware,
    /// `vllm-router --policy cache_aware` (the same approximate tree, vLLM's fork).
    VllmRouterCacheAware,
    /// `vllm-router --policy kv_aware` with `--kv-event-source` (precise: the engines' events).
    VllmRouterKvAware,
}

impl Peer {
    /// Every peer.
    pub const ALL: [Peer; 3] = [Peer::SglangCacheAware, Peer::VllmRouterCacheAware, Peer::VllmRouterKvAware];

    /// The name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Peer::SglangCacheAware => "sglang-router-cache-aware",
            Peer::VllmRouterCacheAware => "vllm-router-cache-aware",
            Peer::VllmRouterKvAware => "vllm-router-kv-aware",
        }
    }

    /// The router's executable in the venv.
    pub fn binary(self, venv: &Path) -> PathBuf {
        venv.join("bin").join(match self {
            Peer::SglangCacheAware => "sglang-router",
            Peer::VllmRouterCacheAware | Peer::VllmRouterKvAware => "vllm-router",
        })
    }

    /// The full command line against `sims`, listening on `port`.
    pub fn command(self, venv: &Path, port: u16, sims: &[SimHandle], block_size: u32) -> Vec<String> {
        let mut cmd = vec![self.binary(venv).display().to_string()];
        if self == Peer::SglangCacheAware {
            cmd.push("launch".into());
        }
        cmd.extend(["--host", "127.0.0.1", "--port", &port.to_string()].map(String::from));
        cmd.push("--worker-urls".into());
        cmd.extend(sims.iter().map(|s| s.url("")));
        match self {
            Peer::SglangCacheAware | Peer::VllmRouterCacheAware => {
                cmd.extend(["--policy", "cache_aware"].map(String::from));
            }
            Peer::VllmRouterKvAware => {
                cmd.extend(["--policy", "kv_aware"].map(String::from));
                for s in sims {
                    cmd.push("--kv-event-source".into());
                    cmd.push(format!("{}=tcp://{}:{}", s.url(""), s.host, s.events_port));
                    cmd.push("--kv-event-replay-source".into());
                    cmd.push(format!("{}=tcp://127.0.0.1:{}", s.url(""), s.replay_port));
                }
                cmd.extend(
                    ["--kv-event-block-size", &block_size.to_string(), "--kv-event-model", "qwen3"].map(String::from),
                );
            }
        }
        cmd
    }

    /// Starts the router — its `instance`th copy: several run side by side as they are
    /// deployed, each on its own, without a shared store — and waits until it serves a
    /// request.
    pub fn start(
        self,
        venv: &Path,
        sims: &[SimHandle],
        block_size: u32,
        logs: &Path,
        instance: usize,
    ) -> anyhow::Result<Running> {
        let port = free_port()?;
        let command = self.command(venv, port, sims, block_size);
        let mut cmd = Command::new(&command[0]);
        cmd.args(&command[1..]);
        let proc = Proc::spawn(self.name(), cmd, &logs.join(format!("{}-{instance}.log", self.name())))?;
        let url = format!("http://127.0.0.1:{port}/v1/completions");
        let probe = json!({"model": "qwen3", "prompt": "ping", "max_tokens": 1}).to_string();
        wait_for(&format!("{} serving", self.name()), Duration::from_secs(60), || {
            (client::post(&url, probe.clone(), &[]).ok()?.status == 200).then_some(())
        })?;
        Ok(Running { base: format!("http://127.0.0.1:{port}"), command: command.join(" "), proc })
    }
}

/// A running peer router.
pub struct Running {
    /// `http://127.0.0.1:port`.
    pub base: String,
    /// The command line it runs with.
    pub command: String,
    proc: Proc,
}

impl Running {
    /// Its process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.proc.pid()
    }
}
