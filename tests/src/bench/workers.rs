//! `cargo xtask bench filter`, workers: Envoy's resident memory by worker count.
//!
//! Each Envoy worker runs its own wasm VM, which holds the model's tokenizer; a VM's linear
//! memory never shrinks, so each keeps what loading the tokenizer peaked at. This starts Envoy
//! with 1, 2, 4 and 8 workers, alone and with kvgate, sends distinct ~1k-token chats on fresh
//! connections (the kernel spreads connections over the workers) until, with kvgate, every
//! worker's VM has routed one with its tokenizer loaded (each VM's `kvgate.vm_memory_bytes`
//! gauge is set at its routed responses), and reads Envoy's `VmRSS`.

use std::time::Duration;

use serde::Serialize;
use serde_json::json;

use crate::client::post;
use crate::process::wait_for;
use crate::workload::document;
use crate::{Artifacts, Routing, Stack, StackOptions};

/// The worker counts measured.
pub const WORKERS: [u32; 4] = [1, 2, 4, 8];

/// Envoy's memory at one worker count, for one setup.
#[derive(Debug, Clone, Serialize)]
pub struct WorkerMemory {
    /// `Envoy alone` or `kvgate`.
    pub setup: &'static str,
    /// Envoy's worker threads.
    pub workers: u32,
    /// Chats sent.
    pub requests: usize,
    /// Envoy's RSS after them, MiB.
    pub rss_mib: f64,
    /// With kvgate, each VM's linear memory, MiB (one per worker that routed a request).
    pub vm_mib: Vec<f64>,
}

/// Runs every worker count, Envoy alone then with kvgate.
pub fn run(artifacts: &Artifacts) -> anyhow::Result<Vec<WorkerMemory>> {
    let mut out = Vec::new();
    for workers in WORKERS {
        for (setup, routing) in [("Envoy alone", Routing::RoundRobin), ("kvgate", Routing::Kvgate)] {
            let row = measure(artifacts, setup, routing, workers)?;
            eprintln!(
                "bench workers: {setup}, {workers} worker(s): Envoy {:.0} MiB after {} chats; VMs {:?} MiB",
                row.rss_mib, row.requests, row.vm_mib
            );
            out.push(row);
        }
    }
    Ok(out)
}

fn measure(artifacts: &Artifacts, setup: &'static str, routing: Routing, workers: u32) -> anyhow::Result<WorkerMemory> {
    let opts = StackOptions {
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
        wait_for("every worker's VM to route", Duration::from_secs(120), || {
            (0..workers).try_for_each(|_| chat()).ok()?;
            let vms = stack.filter_stat_series("kvgate.vm_memory_bytes").ok()?;
            let routed: Vec<f64> = vms.into_iter().filter(|b| *b > 0).map(|b| b as f64 / f64::from(1 << 20)).collect();
            // A VM that routed before its tokenizer loaded has not yet grown to its size: wait
            // until every VM holds at least half the largest's (the tokenizer is most of it).
            let largest = routed.iter().copied().fold(0.0, f64::max);
            (routed.len() == workers as usize && routed.iter().all(|m| *m >= largest / 2.0)).then_some(routed)
        })?
    } else {
        for _ in 0..8 * workers {
            chat()?;
        }
        Vec::new()
    };
    let pid = stack.envoy_pid().ok_or_else(|| anyhow::anyhow!("Envoy is not running"))?;
    let rss_mib = super::memory::rss_mib(pid)?;
    Ok(WorkerMemory { setup, workers, requests, rss_mib, vm_mib })
}

/// The table: Envoy's RSS by workers, alone and with kvgate, and what kvgate adds per worker.
pub fn table(rows: &[WorkerMemory]) -> String {
    let mut md = String::from(
        "### Envoy's memory by workers (one model, Qwen3)\n\n\
         Envoy's resident memory once every worker has routed a ~1k-token chat; with kvgate, each worker's VM memory (`kvgate.vm_memory_bytes`).\n\n\
         | workers | Envoy alone | kvgate | kvgate adds | per worker after the first | VMs |\n|---|---|---|---|---|---|\n",
    );
    let rss = |setup: &str, w: u32| rows.iter().find(|r| r.setup == setup && r.workers == w);
    let first = rss("kvgate", WORKERS[0]).zip(rss("Envoy alone", WORKERS[0])).map(|(k, a)| k.rss_mib - a.rss_mib);
    for w in WORKERS {
        let (Some(alone), Some(kv)) = (rss("Envoy alone", w), rss("kvgate", w)) else { continue };
        let added = kv.rss_mib - alone.rss_mib;
        let per_worker = match (first, w > 1) {
            (Some(first), true) => format!("{:.0} MiB", (added - first) / f64::from(w - 1)),
            _ => "–".into(),
        };
        let vms: Vec<String> = kv.vm_mib.iter().map(|m| format!("{m:.0}")).collect();
        md += &format!(
            "| {w} | {:.0} MiB | {:.0} MiB | {added:.0} MiB | {per_worker} | {} MiB |\n",
            alone.rss_mib,
            kv.rss_mib,
            vms.join(", ")
        );
    }
    md
}
