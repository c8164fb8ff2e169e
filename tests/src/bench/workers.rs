//! `cargo xtask bench filter`, workers: Envoy's resident memory by worker count and models.
//!
//! Each Envoy worker runs its own wasm VM, which holds every routed model's tokenizer; a VM's
//! linear memory never shrinks, so each keeps what loading its tokenizers peaked at. This
//! starts Envoy with 1, 2, 4 and 8 workers, alone and with kvgate routing one model (Qwen3)
//! or three (Qwen3, Llama 3.2 and Gemma 3, the largest tokenizer of the seven families), sends
//! distinct ~1k-token Qwen3 chats on fresh connections (the kernel spreads connections over
//! the workers) until every worker's VM has routed one with every tokenizer loaded (each VM's
//! `kvgate.vm_memory_bytes` gauge, set at its routed responses, the same two rounds running
//! once the sidecar has served each tokenizer to every worker), and reads Envoy's `VmRSS`.
//! Each kvgate setup runs twice: as shipped, and with `envoy_tokenizers: "none"`, where no
//! worker loads a tokenizer and the sidecar tokenizes.

use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;
use serde_json::json;

use crate::client::post;
use crate::process::wait_for;
use crate::workload::document;
use crate::{repo_root, Artifacts, Routing, Stack, StackOptions};

/// The worker counts measured.
pub const WORKERS: [u32; 4] = [1, 2, 4, 8];

/// The models routed beside Qwen3 in the three-model setups (test data beside the repo).
const MORE_MODELS: [&str; 2] = ["llama-3.2-1b-instruct", "gemma-3-1b-it"];

/// Envoy's memory at one worker count, for one setup.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerMemory {
    /// `Envoy alone`, `kvgate` or `kvgate, sidecar tokenizes`.
    pub setup: &'static str,
    /// Models routed (0 for Envoy alone).
    pub models: usize,
    /// Envoy's worker threads.
    pub workers: u32,
    /// Chats sent.
    pub requests: usize,
    /// Envoy's RSS after them, MiB.
    pub rss_mib: f64,
    /// With kvgate, the sidecar's RSS then, MiB: where the tokenizers are when Envoy's
    /// workers do not hold them.
    pub sidecar_rss_mib: Option<f64>,
    /// With kvgate, each VM's linear memory, MiB (one per worker that routed a request).
    pub vm_mib: Vec<f64>,
}

/// The kvgate setups: a label and whether Envoy's workers load the tokenizers.
const KVGATE_SETUPS: [(&str, bool); 2] = [("kvgate", true), (SIDECAR_TOKENIZES, false)];

/// The setup with `envoy_tokenizers: "none"`.
const SIDECAR_TOKENIZES: &str = "kvgate, sidecar tokenizes";

/// Runs every worker count: Envoy alone, then each kvgate setup with one model and three.
pub fn run(artifacts: &Artifacts) -> anyhow::Result<Vec<WorkerMemory>> {
    let mut out = Vec::new();
    for workers in WORKERS {
        let mut setups = vec![("Envoy alone", Routing::RoundRobin, false, 0)];
        for models in [1, 3] {
            setups.extend(KVGATE_SETUPS.map(|(setup, in_envoy)| (setup, Routing::Kvgate, in_envoy, models)));
        }
        for (setup, routing, in_envoy, models) in setups {
            let row = measure(artifacts, setup, routing, in_envoy, models, workers)?;
            eprintln!(
                "bench workers: {setup}, {models} model(s), {workers} worker(s): Envoy {:.0} MiB after {} chats; VMs {:?} MiB; sidecar {:?} MiB",
                row.rss_mib, row.requests, row.vm_mib, row.sidecar_rss_mib
            );
            out.push(row);
        }
    }
    Ok(out)
}

fn measure(
    artifacts: &Artifacts,
    setup: &'static str,
    routing: Routing,
    in_envoy: bool,
    models: usize,
    workers: u32,
) -> anyhow::Result<WorkerMemory> {
    let mut filter_config = serde_json::Map::new();
    if routing == Routing::Kvgate && !in_envoy {
        filter_config.insert("envoy_tokenizers".into(), json!("none"));
    }
    let testdata = repo_root().join("../shared/testdata/tokenizers");
    let extra_models: Vec<(String, PathBuf)> =
        MORE_MODELS.iter().take(models.saturating_sub(1)).map(|m| (m.to_string(), testdata.join(m))).collect();
    let opts = StackOptions {
        filter_config,
        extra_models,
        name: "bench-workers".into(),
        replicas: 1,
        routing,
        envoy_concurrency: workers,
        sim_args: super::filter::instant_engines(&[]),
        ..StackOptions::default()
    };
    let stack = Stack::start(&opts, artifacts)?;
    let url = stack.gateway("/v1/chat/completions");
    let mut requests = 0;
    let mut chat = || -> anyhow::Result<()> {
        let body = json!({"model": opts.model, "max_tokens": 1,
            "messages": [{"role": "user", "content": document(requests as u32, 800)}]});
        requests += 1;
        anyhow::ensure!(post(&url, body.to_string(), &[])?.status == 200, "a chat failed");
        Ok(())
    };
    // Envoy alone: eight chats a worker.
    let vm_mib = if routing == Routing::Kvgate {
        // Each pool's tokenizer served to every worker (as shipped), then the VMs' sizes the
        // same two rounds running: every load is over.
        let served = || -> Option<bool> {
            let state = stack.sidecar_state().ok()?;
            let fetches = state["pools"].as_array()?.iter().map(|p| p["tokenizer_fetches"].as_u64().unwrap_or(0));
            Some(fetches.clone().count() == models && fetches.into_iter().all(|f| f >= u64::from(workers)))
        };
        let mut last: Vec<f64> = Vec::new();
        wait_for("every worker's VM to route with its tokenizers loaded", Duration::from_secs(300), || {
            (0..workers).try_for_each(|_| chat()).ok()?;
            let vms = stack.filter_stat_series("kvgate.vm_memory_bytes").ok()?;
            let mut routed: Vec<f64> =
                vms.into_iter().filter(|b| *b > 0).map(|b| b as f64 / f64::from(1 << 20)).collect();
            routed.sort_by(f64::total_cmp);
            // As shipped, every VM grows to hold its tokenizers: none far below the largest.
            let largest = routed.last().copied().unwrap_or(0.0);
            let loaded = !in_envoy || (served()? && routed.iter().all(|m| *m >= largest / 2.0));
            let settled = routed.len() == workers as usize && routed == last;
            last = routed.clone();
            (loaded && settled).then_some(routed)
        })?
    } else {
        for _ in 0..8 * workers {
            chat()?;
        }
        Vec::new()
    };
    let pid = stack.envoy_pid().ok_or_else(|| anyhow::anyhow!("Envoy is not running"))?;
    let rss_mib = super::memory::rss_mib(pid)?;
    let sidecar_rss_mib = stack.sidecar_pid().map(super::memory::rss_mib).transpose()?;
    Ok(WorkerMemory { setup, models, workers, requests, rss_mib, sidecar_rss_mib, vm_mib })
}

/// The table: Envoy's RSS by workers, alone and with kvgate, and what kvgate adds per worker,
/// for each kvgate setup and model count.
pub fn table(rows: &[WorkerMemory]) -> String {
    let mut md = String::from(
        "### Envoy's memory by workers and models\n\n\
         Envoy's resident memory once every worker has routed a ~1k-token chat with its tokenizers loaded; with kvgate, each worker's VM memory (`kvgate.vm_memory_bytes`). \
         One model: Qwen3; three: Qwen3, Llama 3.2 and Gemma 3. `sidecar tokenizes`: `envoy_tokenizers: \"none\"`, no worker loads a tokenizer.\n\n\
         | setup | models | workers | Envoy alone | with kvgate | kvgate adds | per worker after the first | VMs | sidecar |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    let find = |setup: &str, models: usize, w: u32| {
        rows.iter().find(|r| r.setup == setup && r.models == models && r.workers == w)
    };
    for (setup, _) in KVGATE_SETUPS {
        for models in [1, 3] {
            let adds = |w: u32| Some(find(setup, models, w)?.rss_mib - find("Envoy alone", 0, w)?.rss_mib);
            for w in WORKERS {
                let (Some(alone), Some(kv), Some(added)) = (find("Envoy alone", 0, w), find(setup, models, w), adds(w))
                else {
                    continue;
                };
                let per_worker = match (adds(WORKERS[0]), w > 1) {
                    (Some(first), true) => format!("{:.0} MiB", (added - first) / f64::from(w - 1)),
                    _ => "–".into(),
                };
                let vms: Vec<String> = kv.vm_mib.iter().map(|m| format!("{m:.0}")).collect();
                md += &format!(
                    "| {setup} | {models} | {w} | {:.0} MiB | {:.0} MiB | {added:.0} MiB | {per_worker} | {} MiB | {} |\n",
                    alone.rss_mib,
                    kv.rss_mib,
                    vms.join(", "),
                    kv.sidecar_rss_mib.map_or("–".into(), |m| format!("{m:.0} MiB"))
                );
            }
        }
    }
    md
}
