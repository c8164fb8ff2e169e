//! Load the engines report themselves, from each engine's `/metrics` page, polled every
//! `engine_metrics_secs` (`crate::engine_poller`), so that traffic which bypasses kvgate (other
//! gateways without sync, batch jobs calling engines directly) still counts; and, for admission
//! control, how full each engine says it is (waiting requests, KV cache usage) and its KV
//! capacity.
//!
//! | figure | vLLM | SGLang |
//! |---|---|---|
//! | running | `vllm:num_requests_running` | `sglang:num_running_reqs` |
//! | waiting | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` |
//! | KV usage (0–1) | `vllm:kv_cache_usage_perc` (`gpu_cache_usage_perc` before 0.10) | `sglang:token_usage` |
//! | KV blocks | `num_gpu_blocks` label of `vllm:cache_config_info` | — |
//! | data-parallel rank | `engine` label | `dp_rank` label |
//!
//! The page is read with a Prometheus text-format parser (`nom-openmetrics`), so a label value
//! may hold anything the format can escape (a model named `org/m,"x"{y}`). A page it cannot
//! read — not the text format, or using what the parser does not support (sample timestamps,
//! comment lines that are not `# HELP`/`# TYPE`, neither of which vLLM or SGLang write) — gives
//! no report at all rather than part of one.

use std::collections::HashMap;

use super::EngineReport;

/// Each engine's report in a Prometheus text page, by data-parallel rank (vLLM's `engine`
/// label, SGLang's `dp_rank`; `"0"` for a series without one).
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
    let families = match nom_openmetrics::parser::prometheus(page) {
        Ok((_, families)) => families,
        Err(_) => {
            tracing::debug!(bytes = page.len(), "engine metrics page is not in the Prometheus text format");
            return HashMap::new();
        }
    };
    let mut ranks: HashMap<String, Reading> = HashMap::new();
    // Some vLLM versions label the cache config `engine=""`: it is every rank's.
    let mut shared_blocks = None;
    for sample in families.iter().flat_map(|family| &family.samples) {
        let Some((metric, rank_label)) = Metric::named(sample.name()) else { continue };
        let label = |key: &str| sample.labels().iter().find(|l| l.name == key).map(|l| l.value.as_str());
        let blocks = || label("num_gpu_blocks").and_then(|b| b.parse::<u64>().ok());
        let rank = label(rank_label).unwrap_or("0");
        if rank.is_empty() {
            if metric == Metric::CacheConfig {
                shared_blocks = blocks().or(shared_blocks);
            }
            continue;
        }
        let value = sample.number();
        if !value.is_finite() {
            continue;
        }
        let reading = ranks.entry(rank.to_owned()).or_default();
        let count = Some(value.max(0.0).round() as u64);
        match metric {
            Metric::Running => reading.running = reading.running.max(count),
            Metric::Waiting => reading.waiting = reading.waiting.max(count),
            Metric::KvUsage => reading.kv_usage = Some(reading.kv_usage.map_or(value, |u| u.max(value))),
            Metric::CacheConfig => reading.kv_blocks = blocks().or(reading.kv_blocks),
        }
    }
    if shared_blocks.is_some() && ranks.is_empty() {
        ranks.insert("0".into(), Reading::default());
    }
    ranks
        .into_iter()
        .map(|(rank, r)| {
            let waiting = r.waiting.unwrap_or(0);
            let report = EngineReport {
                requests: r.running.unwrap_or(0) + waiting,
                waiting,
                kv_usage: r.kv_usage,
                kv_blocks: r.kv_blocks.or(shared_blocks),
            };
            (rank, report)
        })
        .collect()
}

/// One rank's figures as read. A figure on several series of one rank (SGLang's schedulers of
/// each tensor- or pipeline-parallel rank, with metrics on for all of them) counts the same
/// requests, so the highest is kept rather than their sum.
#[derive(Debug, Default)]
struct Reading {
    running: Option<u64>,
    waiting: Option<u64>,
    kv_usage: Option<f64>,
    kv_blocks: Option<u64>,
}

/// The engine metrics an [`EngineReport`] is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Metric {
    Running,
    Waiting,
    KvUsage,
    CacheConfig,
}

impl Metric {
    /// The metric a series name is, and the label naming its data-parallel rank.
    fn named(name: &str) -> Option<(Metric, &'static str)> {
        match name {
            "vllm:num_requests_running" => Some((Metric::Running, "engine")),
            "vllm:num_requests_waiting" => Some((Metric::Waiting, "engine")),
            // `gpu_cache_usage_perc` is its name before vLLM 0.10.
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => Some((Metric::KvUsage, "engine")),
            "vllm:cache_config_info" => Some((Metric::CacheConfig, "engine")),
            // SGLang's names and labels: python/sglang/srt/metrics/collector.py.
            "sglang:num_running_reqs" => Some((Metric::Running, "dp_rank")),
            "sglang:num_queue_reqs" => Some((Metric::Waiting, "dp_rank")),
            "sglang:token_usage" => Some((Metric::KvUsage, "dp_rank")),
            _ => None,
        }
    }
}
