//! `cargo xtask bench filter`, memory: what big bodies leave behind in Envoy.
//!
//! A wasm VM's linear memory only grows: whatever the filter allocates for one request stays
//! resident for the life of the worker. This sends a few chats of about 15 MiB (the biggest
//! body Envoy buffers is 16 MiB) through Envoy alone and through Envoy + kvgate, and reads
//! Envoy's resident memory (`VmRSS`) before and after, and with kvgate the filter's own
//! `kvgate.vm_memory_bytes` gauge (set at each routed response's headers, so before the
//! client reads them; Envoy runs one worker here). `KVGATE_WASM` measures another build of the filter.

use serde::Serialize;
use serde_json::json;

use crate::client::post;
use crate::workload::document;
use crate::{Artifacts, Routing, Stack, StackOptions};

/// Big chats sent per setup.
pub const BIG_BODIES: usize = 4;
/// Words in each big chat (about 15 MiB of JSON).
const WORDS: usize = 2_300_000;

/// Envoy's resident memory around the big bodies, for one setup.
#[derive(Debug, Clone, Serialize)]
pub struct Memory {
    /// `Envoy alone` or `kvgate`.
    pub setup: &'static str,
    /// Size of each big body, bytes.
    pub body_bytes: usize,
    /// Envoy's RSS after one small request, MiB.
    pub before_mib: f64,
    /// Envoy's RSS after the big bodies, MiB.
    pub after_mib: f64,
    /// The filter's VM memory before and after, MiB (kvgate only).
    pub vm_mib: Option<(f64, f64)>,
}

/// Envoy's resident memory, MiB.
pub(crate) fn rss_mib(pid: u32) -> anyhow::Result<f64> {
    let bytes = crate::process::rss_bytes(pid).ok_or_else(|| anyhow::anyhow!("no VmRSS for {pid}"))?;
    Ok(bytes as f64 / f64::from(1 << 20))
}

/// Runs the measurement on Envoy alone, then on Envoy + kvgate.
pub fn run(artifacts: &Artifacts) -> anyhow::Result<Vec<Memory>> {
    let body = json!({"model": "qwen3", "max_tokens": 1,
        "messages": [{"role": "user", "content": document(3, WORDS)}]})
    .to_string();
    anyhow::ensure!(body.len() < 16 << 20, "a big body must fit Envoy's 16 MiB buffer: {} bytes", body.len());
    let small = json!({"model": "qwen3", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]});
    let mut out = Vec::new();
    for (setup, routing) in [("Envoy alone", Routing::RoundRobin), ("kvgate", Routing::Kvgate)] {
        let opts = StackOptions {
            name: "bench-memory".into(),
            replicas: 1,
            routing,
            route_timeout_ms: 5000,
            sim_args: super::filter::instant_engines(&[]),
            ..StackOptions::default()
        };
        let stack = Stack::start(&opts, artifacts)?;
        let pid = stack.envoy_pid().ok_or_else(|| anyhow::anyhow!("Envoy is not running"))?;
        let url = stack.gateway("/v1/chat/completions");
        let vm = || -> anyhow::Result<f64> {
            Ok(stack.filter_stat("kvgate.vm_memory_bytes", &[])? as f64 / f64::from(1 << 20))
        };
        post(&url, small.to_string(), &[])?;
        let vm_before = if routing == Routing::Kvgate { Some(vm()?) } else { None };
        let before_mib = rss_mib(pid)?;
        for _ in 0..BIG_BODIES {
            post(&url, body.clone(), &[])?;
        }
        let vm_mib = match vm_before {
            Some(before) => Some((before, vm()?)),
            None => None,
        };
        let after_mib = rss_mib(pid)?;
        let offloaded = stack.filter_stat("kvgate.requests_offloaded_total", &[])?;
        eprintln!(
            "bench memory: {setup}: Envoy {before_mib:.0} MiB before, {after_mib:.0} MiB after; VM {vm_mib:?}; {offloaded} offloaded"
        );
        out.push(Memory { setup, body_bytes: body.len(), before_mib, after_mib, vm_mib });
    }
    Ok(out)
}

/// The memory table, with what kvgate keeps beyond Envoy alone.
pub fn table(rows: &[Memory]) -> String {
    let mut md = format!(
        "### What {BIG_BODIES} bodies of {:.1} MiB leave in Envoy's memory\n\n\
         Envoy's resident memory after one small chat, then after the big chats (each offloaded to the sidecar by kvgate); with kvgate, the filter's VM memory (`kvgate.vm_memory_bytes`) too.\n\n\
         | setup | Envoy before | Envoy after | grown | VM before | VM after | VM grown |\n|---|---|---|---|---|---|---|\n",
        rows.first().map_or(0.0, |r| r.body_bytes as f64 / f64::from(1 << 20))
    );
    for r in rows {
        let vm = match r.vm_mib {
            Some((before, after)) => format!("{before:.0} MiB | {after:.0} MiB | {:.0} MiB", after - before),
            None => "– | – | –".into(),
        };
        md += &format!(
            "| {} | {:.0} MiB | {:.0} MiB | {:.0} MiB | {vm} |\n",
            r.setup,
            r.before_mib,
            r.after_mib,
            r.after_mib - r.before_mib
        );
    }
    md
}
