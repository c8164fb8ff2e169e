//! Peer routers, run against the same simulated fleet: SGLang's gateway SMG and its
//! predecessor `sglang-router` (`cache_aware`), and vLLM's router (`cache_aware`, and
//! `kv_aware` fed by the engines' KV events — possible because the simulator's block hashes
//! are vLLM's own). SMG's event-driven mode reads KV events from engines it speaks gRPC or
//! ZMQ to (SGLang, vLLM's gRPC entry point), not from HTTP workers, so it runs here in
//! `cache_aware` only.
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

/// What `cargo xtask bench` installs, per venv (a folder under the peers' venv; `.` is that
/// venv itself). SMG has its own: `sglang-router` 0.3.2 installs an `smg` script too.
pub const VENVS: [(&str, &[&str]); 2] =
    [(".", &["sglang-router==0.3.2", "vllm-router==0.1.17"]), ("smg", &["smg==1.13.0"])];

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
    /// `smg launch --policy cache_aware`: SGLang's current gateway (Shepherd Model Gateway),
    /// the successor of `sglang-router`.
    SmgCacheAware,
    /// `vllm-router --policy cache_aware` (the same approximate tree, vLLM's fork).
    VllmRouterCacheAware,
    /// `vllm-router --policy kv_aware` with `--kv-event-source` (precise: the engines' events).
    VllmRouterKvAware,
}

impl Peer {
    /// Every peer.
    pub const ALL: [Peer; 4] =
        [Peer::SglangCacheAware, Peer::SmgCacheAware, Peer::VllmRouterCacheAware, Peer::VllmRouterKvAware];

    /// The name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Peer::SglangCacheAware => "sglang-router-cache-aware",
            Peer::SmgCacheAware => "smg-cache-aware",
            Peer::VllmRouterCacheAware => "vllm-router-cache-aware",
            Peer::VllmRouterKvAware => "vllm-router-kv-aware",
        }
    }

    /// The router's executable in the venv.
    pub fn binary(self, venv: &Path) -> PathBuf {
        venv.join(match self {
            Peer::SglangCacheAware => "bin/sglang-router",
            Peer::SmgCacheAware => "smg/bin/smg",
            Peer::VllmRouterCacheAware | Peer::VllmRouterKvAware => "bin/vllm-router",
        })
    }

    /// The full command line against `sims`, listening on `port`, as copy `instance` (SMG
    /// joins its copies in its HA mesh, which shares its cache-aware trees; the others have
    /// none).
    pub fn command(
        self,
        venv: &Path,
        port: u16,
        sims: &[SimHandle],
        block_size: u32,
        instance: Instance<'_>,
    ) -> Vec<String> {
        let mut cmd = vec![self.binary(venv).display().to_string()];
        if matches!(self, Peer::SglangCacheAware | Peer::SmgCacheAware) {
            cmd.push("launch".into());
        }
        cmd.extend(["--host", "127.0.0.1", "--port", &port.to_string()].map(String::from));
        let metrics_port = instance.metrics_port.to_string();
        cmd.extend(["--prometheus-host", "127.0.0.1", "--prometheus-port", &metrics_port].map(String::from));
        cmd.push("--worker-urls".into());
        cmd.extend(sims.iter().map(|s| s.url("")));
        match self {
            Peer::SglangCacheAware | Peer::SmgCacheAware | Peer::VllmRouterCacheAware => {
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
        if let (Peer::SmgCacheAware, [_, _, ..]) = (self, instance.mesh_ports) {
            let own = instance.mesh_ports[instance.index];
            cmd.extend(
                ["--enable-mesh", "--mesh-host", "127.0.0.1", "--mesh-port", &own.to_string()].map(String::from),
            );
            cmd.extend(["--mesh-server-name".into(), format!("smg-{}", instance.index), "--mesh-peer-urls".into()]);
            cmd.extend(instance.mesh_ports.iter().filter(|p| **p != own).map(|p| format!("127.0.0.1:{p}")));
        }
        cmd
    }

    /// Starts the router — one of `instance.mesh_ports.len()` copies side by side, as they are
    /// deployed: without a shared store, joined in their own mesh where they have one — and
    /// waits until it serves a request.
    pub fn start(
        self,
        venv: &Path,
        sims: &[SimHandle],
        block_size: u32,
        logs: &Path,
        instance: Instance<'_>,
    ) -> anyhow::Result<Running> {
        let port = free_port()?;
        let command = self.command(venv, port, sims, block_size, instance);
        let mut cmd = Command::new(&command[0]);
        cmd.args(&command[1..]);
        let proc = Proc::spawn(self.name(), cmd, &logs.join(format!("{}-{}.log", self.name(), instance.index)))?;
        let url = format!("http://127.0.0.1:{port}/v1/completions");
        let probe = json!({"model": "qwen3", "prompt": "ping", "max_tokens": 1}).to_string();
        wait_for(&format!("{} serving", self.name()), Duration::from_secs(60), || {
            (client::post(&url, probe.clone(), &[]).ok()?.status == 200).then_some(())
        })?;
        Ok(Running { base: format!("http://127.0.0.1:{port}"), command: command.join(" "), proc })
    }
}

/// Which of several copies of a router this is, and its ports besides the one it serves on.
#[derive(Debug, Clone, Copy)]
pub struct Instance<'a> {
    /// This copy's index.
    pub index: usize,
    /// Every copy's mesh port (none, or one, for a router on its own).
    pub mesh_ports: &'a [u16],
    /// Where it serves its Prometheus metrics: on loopback (by default the routers bind
    /// 0.0.0.0:29000, which two copies cannot share, nor should a benchmark expose).
    pub metrics_port: u16,
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
