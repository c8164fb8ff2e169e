//! Load the engines report themselves: `vllm:num_requests_running` + `vllm:num_requests_waiting`
//! from each engine's `/metrics`, polled every `engine_metrics_secs` (`crate::engine_poller`), so that traffic which
//! bypasses kvgate (other gateways without sync, batch jobs calling engines directly) still
//! counts; and, for admission control, how full each engine says it is (waiting requests, KV
//! cache usage) and its KV capacity (`vllm:cache_config_info`). Data-parallel ranks are told
//! apart by vLLM's `engine` label.

use std::collections::HashMap;

use super::EngineReport;

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
/// // vLLM before 0.10 calls the usage `gpu_cache_usage_perc`.
/// let old = "vllm:gpu_cache_usage_perc{engine=\"0\"} 0.25\n";
/// assert_eq!(kvgate_sidecar::load::engine_metrics::reports_by_engine(old)["0"].kv_usage, Some(0.25));
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
        let (name, labels, value) = match line.split_once('{') {
            Some((name, rest)) => match rest.split_once('}') {
                Some((labels, value)) => (name, labels, value),
                None => continue,
            },
            None => match line.split_once(' ') {
                Some((name, value)) => (name, "", value),
                None => continue,
            },
        };
        let Some(metric) = Metric::named(name) else { continue };
        let Ok(value) = value.trim().parse::<f64>() else { continue };
        let label = |key: &str| {
            labels.split(',').find_map(|kv| kv.trim().strip_prefix(key)?.strip_prefix("=\"")?.strip_suffix('"'))
        };
        let blocks = || label("num_gpu_blocks").and_then(|b| b.parse::<u64>().ok());
        let engine = label("engine").unwrap_or("0");
        if engine.is_empty() {
            if metric == Metric::CacheConfig {
                shared_blocks = blocks().or(shared_blocks);
            }
            continue;
        }
        let report = out.entry(engine.to_owned()).or_default();
        let count = value.max(0.0).round() as u64;
        match metric {
            Metric::Running => report.requests += count,
            Metric::Waiting => {
                report.requests += count;
                report.waiting += count;
            }
            Metric::KvUsage => report.kv_usage = Some(value),
            Metric::CacheConfig => report.kv_blocks = blocks().or(report.kv_blocks),
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

/// The vLLM metrics an [`EngineReport`] is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Metric {
    Running,
    Waiting,
    KvUsage,
    CacheConfig,
}

impl Metric {
    fn named(name: &str) -> Option<Metric> {
        match name {
            "vllm:num_requests_running" => Some(Metric::Running),
            "vllm:num_requests_waiting" => Some(Metric::Waiting),
            // `gpu_cache_usage_perc` is its name before vLLM 0.10.
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => Some(Metric::KvUsage),
            "vllm:cache_config_info" => Some(Metric::CacheConfig),
            _ => None,
        }
    }
}
