//! What the simulator's process tests share: starting one.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use kvgate_e2e::client::client;
use kvgate_e2e::process::{wait_for, Proc};
use serde_json::json;

/// Starts `kvgate-sim` as replica `name` on `port`, publishing KV events on `events`, with
/// the vendored Qwen3 tokenizer, blocks of 16, prompt token details and `extra` flags; waits
/// until it answers `/health`.
pub fn spawn_sim(name: &str, port: u16, events: u16, extra: &[&str]) -> Proc {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate-sim"));
    cmd.args(["--port", &port.to_string(), "--replica", name, "--model", "qwen3", "--block-size", "16"])
        .arg("--tokenizer")
        .arg(repo.join("models/qwen3-0.6b"))
        .arg("--enable-prompt-tokens-details")
        .args(["--kv-events-config", &json!({"endpoint": format!("tcp://*:{events}")}).to_string()])
        .args(extra);
    let log = repo.join(format!("target/e2e-logs/sim-{name}-{}.log", std::process::id()));
    let proc = Proc::spawn(name, cmd, &log).unwrap();
    let url = format!("http://127.0.0.1:{port}/health");
    wait_for("sim health", Duration::from_secs(30), || {
        client().get(&url).send().ok().filter(|r| r.status().is_success())
    })
    .unwrap();
    proc
}
