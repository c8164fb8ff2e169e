//! Load the engines report themselves: `vllm:num_requests_running` + `vllm:num_requests_waiting`
//! from each engine's `/metrics`, polled every `engine_metrics_secs`, so that traffic which
//! bypasses kvgate (other gateways without sync, batch jobs calling engines directly) still
//! counts. Data-parallel ranks are told apart by vLLM's `engine` label.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::index::ReplicaIdx;
use crate::pool::Pool;

/// How long one scrape may take.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);

/// Requests running or waiting per vLLM `engine` label (DP rank) in a Prometheus text page.
///
/// ```
/// let page = "vllm:num_requests_running{model_name=\"m\",engine=\"0\"} 3.0\n\
///             vllm:num_requests_waiting{model_name=\"m\",engine=\"0\"} 2.0\n\
///             vllm:num_requests_running{model_name=\"m\",engine=\"1\"} 1.0\n";
/// let counts = kvgate_sidecar::load::engine_metrics::requests_by_engine(page);
/// assert_eq!((counts["0"], counts["1"]), (5, 1));
/// ```
pub fn requests_by_engine(page: &str) -> HashMap<String, u64> {
    let mut out: HashMap<String, u64> = HashMap::new();
    for line in page.lines() {
        let Some(rest) =
            line.strip_prefix("vllm:num_requests_running").or_else(|| line.strip_prefix("vllm:num_requests_waiting"))
        else {
            continue;
        };
        let (labels, value) = match rest.strip_prefix('{') {
            Some(r) => match r.split_once('}') {
                Some((labels, value)) => (labels, value),
                None => continue,
            },
            None => ("", rest),
        };
        let Ok(value) = value.trim().parse::<f64>() else { continue };
        let engine = labels
            .split(',')
            .find_map(|kv| kv.trim().strip_prefix("engine=\""))
            .and_then(|v| v.strip_suffix('"'))
            .unwrap_or("0");
        *out.entry(engine.to_owned()).or_default() += value.max(0.0).round() as u64;
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
            let mut pages: HashMap<String, Option<HashMap<String, u64>>> = HashMap::new();
            for (slot, endpoint, rank) in targets {
                let counts = pages.entry(endpoint.clone()).or_insert_with(|| {
                    let url = format!("http://{endpoint}/metrics");
                    match client.get(&url).send().and_then(|r| r.error_for_status()).and_then(|r| r.text()) {
                        Ok(page) => Some(requests_by_engine(&page)),
                        Err(e) => {
                            tracing::debug!(%url, error = %e, "engine metrics unavailable");
                            None
                        }
                    }
                });
                // An engine we cannot read keeps its last figure rather than dropping to zero.
                if let Some(counts) = counts {
                    let running = match rank {
                        Some(r) => counts.get(&r.to_string()).copied().unwrap_or(0),
                        None => counts.values().sum(),
                    };
                    pool.observe_engine(slot, running);
                }
            }
        },
    )
}
