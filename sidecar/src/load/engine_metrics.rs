//! Load the engines report themselves: `vllm:num_requests_running` + `vllm:num_requests_waiting`
//! from each engine's `/metrics`, polled every `engine_metrics_secs`, so that traffic which
//! bypasses kvgate (other gateways without sync, batch jobs calling engines directly) still
//! counts; and, for admission control, how full each engine says it is (waiting requests, KV
//! cache usage) and its KV capacity (`vllm:cache_config_info`). Data-parallel ranks are told
//! apart by vLLM's `engine` label.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::EngineReport;
use crate::index::ReplicaIdx;
use crate::pool::Pool;

/// How long one scrape may take.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);

/// Each engine's report in a Prometheus text page, by vLLM's `engine` label (DP rank).
///
/// ```
/// let page = "vllm:num_requests_running{model_name=\"m\",engine=\"0\"} 3.0\n\
///             vllm:num_requests_waiting{model_name=\"m\",engine=\"0\"} 2.0\n\
///             vllm:kv_cache_usage_perc{model_name=\"m\",engine=\"0\"} 0.5\n\
///             vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1024\",engine=\"0\"} 1.0\n\
///             vllm:num_requests_running{model_name=\"m\",engine=\"1\"} 1.0\n";
/// let reports = kvgate_sidecar::load::engine_metrics::reports_by_engine(page);
/// assert_eq!((reports["0"].requests, reports["0"].waiting, reports["1"].requests), (5, 2, 1));
/// assert_eq!((reports["0"].kv_usage, reports["0"].kv_blocks, reports["1"].kv_blocks), (Some(0.5), Some(1024), None));
/// // A cache config labelled `engine=""` is every rank's.
/// let shared = "vllm:num_requests_running{engine=\"1\"} 1.0\n\
///               vllm:cache_config_info{num_gpu_blocks=\"64\",engine=\"\"} 1.0\n";
/// assert_eq!(kvgate_sidecar::load::engine_metrics::reports_by_engine(shared)["1"].kv_blocks, Some(64));
/// ```
pub fn reports_by_engine(page: &str) -> HashMap<String, EngineReport> {
    let mut out: HashMap<String, EngineReport> = HashMap::new();
    // Some vLLM versions label the cache config `engine=""`: it is every rank's.
    let mut shared_blocks = None;
    for line in page.lines() {
        let Some((name, rest)) = line.split_once('{').or_else(|| line.split_once(' ')) else { continue };
        let (labels, value) = match line.split_once('{') {
            Some(_) => match rest.split_once('}') {
                Some((labels, value)) => (labels, value),
                None => continue,
            },
            None => ("", rest),
        };
        let label = |key: &str| {
            labels.split(',').find_map(|kv| kv.trim().strip_prefix(key)?.strip_prefix("=\"")?.strip_suffix('"'))
        };
        let Ok(value) = value.trim().parse::<f64>() else { continue };
        if !matches!(
            name,
            "vllm:num_requests_running"
                | "vllm:num_requests_waiting"
                | "vllm:kv_cache_usage_perc"
                | "vllm:cache_config_info"
        ) {
            continue;
        }
        let engine = label("engine").unwrap_or("0");
        if engine.is_empty() {
            if name == "vllm:cache_config_info" {
                shared_blocks = label("num_gpu_blocks").and_then(|b| b.parse().ok()).or(shared_blocks);
            }
            continue;
        }
        let report = out.entry(engine.to_owned()).or_default();
        let count = value.max(0.0).round() as u64;
        match name {
            "vllm:num_requests_running" => report.requests += count,
            "vllm:num_requests_waiting" => {
                report.requests += count;
                report.waiting += count;
            }
            // Its name before vLLM 0.10.
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => report.kv_usage = Some(value),
            _ => report.kv_blocks = label("num_gpu_blocks").and_then(|b| b.parse().ok()).or(report.kv_blocks),
        }
    }
    if let Some(blocks) = shared_blocks {
        if out.is_empty() {
            out.insert("0".into(), EngineReport::default());
        }
        for report in out.values_mut() {
            report.kv_blocks = report.kv_blocks.or(Some(blocks));
        }
    }
    out
}

/// Scrapes every active engine of `pool` every `interval` until `stop`, and books what they
/// report beyond kvgate's own bookings as external load.
pub fn spawn(pool: Arc<Pool>, interval: Duration, stop: Arc<AtomicBool>) -> std::io::Result<JoinHandle<()>> {
    crate::poll::every(
        format!("engine-metrics-{}", pool.config().model),
        interval,
        SCRAPE_TIMEOUT,
        stop,
        move |client| {
            let targets: Vec<(ReplicaIdx, String, Option<u32>)> = pool
                .members()
                .iter()
                .enumerate()
                .filter(|(_, m)| m.active)
                .map(|(i, m)| (ReplicaIdx::new(i), m.replica.endpoint.to_string(), m.rank))
                .collect();
            let mut pages: HashMap<String, Option<HashMap<String, EngineReport>>> = HashMap::new();
            for (slot, endpoint, rank) in targets {
                let counts = pages.entry(endpoint.clone()).or_insert_with(|| {
                    let url = format!("http://{endpoint}/metrics");
                    match client.get(&url).send().and_then(|r| r.error_for_status()).and_then(|r| r.text()) {
                        Ok(page) => Some(reports_by_engine(&page)),
                        Err(e) => {
                            tracing::debug!(%url, error = %e, "engine metrics unavailable");
                            None
                        }
                    }
                });
                // An engine we cannot read keeps its last figure rather than dropping to zero.
                if let Some(reports) = counts {
                    let report = match rank {
                        Some(r) => reports.get(&r.to_string()).copied().unwrap_or_default(),
                        None => reports.values().fold(EngineReport::default(), |a, b| a.merge(*b)),
                    };
                    pool.observe_engine(slot, report);
                }
            }
        },
    )
}
