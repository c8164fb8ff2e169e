//! vLLM's Prometheus metrics, in the text exposition format, one series per data-parallel
//! rank (`engine="<rank>"`, as vLLM labels them); with disaggregation on, the simulator's
//! KV-transfer counters too (and vLLM's NixlConnector ones, with its protocol).

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::engine::{EngineConfig, Rank};
use crate::histogram::TTFT_BUCKETS;
use crate::kv_transfer::Protocol;

/// Renders every rank's metrics.
pub fn render(model: &str, ranks: &[Rank], config: &EngineConfig, protocol: &Protocol) -> String {
    let mut out = String::new();
    // vLLM's info gauge of its cache config: every field a label, the value 1.
    let _ = writeln!(out, "# TYPE vllm:cache_config_info gauge");
    for i in 0..ranks.len() {
        let (block_size, blocks) = (config.block_size, config.num_gpu_blocks);
        let _ = writeln!(
            out,
            "vllm:cache_config_info{{block_size=\"{block_size}\",enable_prefix_caching=\"True\",num_gpu_blocks=\"{blocks}\",engine=\"{i}\"}} 1.0"
        );
    }
    let gauge = |out: &mut String, name: &str, kind: &str, value: &dyn Fn(&Rank) -> String| {
        let _ = writeln!(out, "# TYPE {name} {kind}");
        for (i, rank) in ranks.iter().enumerate() {
            let _ = writeln!(out, "{name}{{model_name=\"{model}\",engine=\"{i}\"}} {}", value(rank));
        }
    };
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed).to_string();
    gauge(&mut out, "vllm:num_requests_running", "gauge", &|r| load(&r.stats.running));
    gauge(&mut out, "vllm:num_requests_waiting", "gauge", &|r| load(&r.stats.waiting));
    gauge(&mut out, "vllm:kv_cache_usage_perc", "gauge", &|r| r.stats.usage().to_string());
    gauge(&mut out, "vllm:prefix_cache_queries_total", "counter", &|r| load(&r.stats.prefix_queries));
    gauge(&mut out, "vllm:prefix_cache_hits_total", "counter", &|r| load(&r.stats.prefix_hits));
    gauge(&mut out, "vllm:num_preemptions_total", "counter", &|r| load(&r.stats.preemptions));
    gauge(&mut out, "vllm:prompt_tokens_total", "counter", &|r| load(&r.stats.prompt_tokens));
    gauge(&mut out, "vllm:generation_tokens_total", "counter", &|r| load(&r.stats.generation_tokens));
    // vLLM 0.12+: prompt tokens by where their KV came from (`PromptTokenStats`).
    let name = "vllm:prompt_tokens_by_source_total";
    let _ = writeln!(out, "# TYPE {name} counter");
    for (i, rank) in ranks.iter().enumerate() {
        let s = &rank.stats;
        let sources = [
            ("local_compute", &s.prompt_computed),
            ("local_cache_hit", &s.prompt_local_hits),
            ("external_kv_transfer", &s.prompt_external),
        ];
        for (source, counter) in sources {
            let value = load(counter);
            let _ = writeln!(out, "{name}{{model_name=\"{model}\",engine=\"{i}\",source=\"{source}\"}} {value}");
        }
    }
    gauge(&mut out, "vllm:prompt_tokens_cached_total", "counter", &|r| load(&r.stats.prompt_cached));
    gauge(&mut out, "vllm:prompt_tokens_recomputed_total", "counter", &|r| load(&r.stats.prompt_recomputed));
    // Whether the host kept up with the simulated clock (a benchmark's engines must).
    let secs = |a: &AtomicU64| (a.load(Ordering::Relaxed) as f64 / 1e6).to_string();
    gauge(&mut out, "kvgate_sim:step_wall_seconds_total", "counter", &|r| secs(&r.stats.step_wall_us));
    gauge(&mut out, "kvgate_sim:clock_lost_seconds_total", "counter", &|r| secs(&r.stats.clock_lost_us));
    gauge(&mut out, "kvgate_sim:clock_resets_total", "counter", &|r| load(&r.stats.clock_resets));
    if protocol.is_on() {
        gauge(&mut out, "kvgate_sim:remote_prefill_requests_total", "counter", &|r| load(&r.stats.remote_prefills));
        gauge(&mut out, "kvgate_sim:remote_decode_requests_total", "counter", &|r| load(&r.stats.remote_decodes));
        gauge(&mut out, "kvgate_sim:kv_transfer_tokens_total", "counter", &|r| load(&r.stats.transferred_tokens));
        gauge(&mut out, "kvgate_sim:kv_transfer_failures_total", "counter", &|r| load(&r.stats.transfer_failures));
        gauge(&mut out, "kvgate_sim:kv_transfer_expired_total", "counter", &|r| load(&r.stats.expired_holds));
        gauge(&mut out, "kvgate_sim:kv_transfer_held_blocks", "gauge", &|r| load(&r.stats.held_blocks));
    }
    match protocol {
        Protocol::Nixl(_) => {
            // The NixlConnector's own counters of the same events.
            gauge(&mut out, "vllm:nixl_num_failed_transfers_total", "counter", &|r| load(&r.stats.transfer_failures));
            gauge(&mut out, "vllm:nixl_num_kv_expired_reqs_total", "counter", &|r| load(&r.stats.expired_holds));
        }
        Protocol::Bootstrap(_) => {
            gauge(&mut out, "kvgate_sim:bootstrap_failures_total", "counter", &|r| load(&r.stats.bootstrap_failures));
        }
        Protocol::Off => {}
    }
    let name = "vllm:time_to_first_token_seconds";
    let _ = writeln!(out, "# TYPE {name} histogram");
    for (i, rank) in ranks.iter().enumerate() {
        let h = rank.stats.ttft.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let labels = format!("model_name=\"{model}\",engine=\"{i}\"");
        for (bound, count) in TTFT_BUCKETS.iter().zip(h.counts) {
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound:?}\"}} {count}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", h.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", h.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", h.count);
    }
    out
}
