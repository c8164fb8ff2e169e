//! The metrics as an operator queries them: a real Prometheus scrapes the gateway's Envoy
//! (the filter's series, whose dimensions Envoy's `stats_tags` turn into labels) and the
//! sidecar, and its queries aggregate them by model and outcome; Envoy's access log shows each
//! decision.

use std::collections::BTreeMap;
use std::time::Duration;

use kvgate_e2e::client::post;
use kvgate_e2e::process::wait_for;
use kvgate_e2e::prometheus::Prometheus;
use kvgate_e2e::workload::document;
use kvgate_e2e::{Artifacts, Stack, StackOptions};
use serde_json::json;

const MODEL: &str = "Qwen/Qwen3-0.6B";

/// `sum by (labels)` of `promql`, as label values joined by `|` → value.
fn by(prom: &Prometheus, promql: &str) -> BTreeMap<String, f64> {
    prom.query(promql)
        .unwrap()
        .into_iter()
        .map(|s| (s.labels.values().filter_map(|v| v.as_str()).collect::<Vec<_>>().join("|"), s.value))
        .collect()
}

#[test]
#[ignore = "needs Envoy, the built filter and Prometheus: run `cargo xtask test`"]
fn prometheus_sums_the_filters_requests_by_model_and_outcome_and_the_access_log_shows_decisions() {
    let opts = StackOptions { name: "prometheus".into(), model: MODEL.into(), ..Default::default() };
    let stack = Stack::start(&opts, &Artifacts::locate("debug")).expect("stack starts");
    let chat = |model: &str, seed: u32| {
        json!({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": document(seed, 200)}]})
            .to_string()
    };
    // The stack's own start routed requests already: count from here.
    let routed_before = stack.filter_stat("kvgate.requests_total", &[("model", MODEL), ("outcome", "routed")]).unwrap();
    let passed_before =
        stack.filter_stat("kvgate.requests_total", &[("model", "other"), ("outcome", "passthrough")]).unwrap();
    let mut served = Vec::new();
    for seed in 0..5 {
        let reply = post(&stack.gateway("/v1/chat/completions"), chat(MODEL, seed), &[]).unwrap();
        assert_eq!(reply.status, 200);
        served.push((reply.header("x-kvgate-booking-id").to_owned(), reply.header("x-kvgate-replica").to_owned()));
    }
    // A model no pool serves: not routed, and counted under `other`, not a series of its own.
    for seed in 0..2 {
        let reply = post(&stack.gateway("/v1/chat/completions"), chat("a-model-nobody-serves", seed), &[]).unwrap();
        assert!(reply.status < 500, "the engine answers it: {}", reply.status);
    }

    let (envoy, sidecar) = stack.scrape_targets();
    let prom = Prometheus::start(&stack.dir, &[("envoy", envoy, "/stats/prometheus"), ("kvgate", sidecar, "/metrics")])
        .unwrap();
    let requests = "sum by (model, outcome) (kvgate_requests_total)";
    let want = [(format!("{MODEL}|routed"), routed_before + 5), ("other|passthrough".to_owned(), passed_before + 2)];
    let seen = wait_for("the filter's requests by model and outcome", Duration::from_secs(60), || {
        let seen = by(&prom, requests);
        want.iter().all(|(k, v)| seen.get(k) == Some(&(*v as f64))).then_some(seen)
    });
    assert!(
        seen.is_ok(),
        "{requests}: want {want:?}, Prometheus has {:?} (scrapes: {:?})",
        by(&prom, requests),
        prom.scrape_errors()
    );

    let models: Vec<String> = by(&prom, "sum by (model) (kvgate_requests_total)").into_keys().collect();
    assert_eq!(models, ["Qwen/Qwen3-0.6B", "other"], "no series for a model nobody serves");
    // The filter's count of routed requests agrees with the sidecar's decisions (requests
    // before the filter's first model list count as `other`).
    // The two come from separate scrapes: wait until Prometheus holds both.
    let routed = || by(&prom, "sum(kvgate_requests_total{outcome=\"routed\"})");
    let decisions = || by(&prom, "sum(kvgate_decisions_total)");
    let agree = wait_for("the sidecar's decisions scraped", Duration::from_secs(30), || {
        let decided = decisions();
        (!decided.is_empty() && decided == routed()).then_some(())
    });
    assert!(
        agree.is_ok(),
        "the sidecar's decisions {:?} against the filter's routed requests {:?}",
        decisions(),
        routed()
    );
    // Each VM's gauges are a series of their own, labelled `vm` (Envoy runs a VM on its main
    // thread too): the one worker's VM, which served the requests, reports its memory.
    let memory = prom.query("kvgate_vm_memory_bytes").unwrap();
    let vms: std::collections::HashSet<&str> = memory.iter().map(|s| s.label("vm")).collect();
    assert_eq!(vms.len(), memory.len(), "a series per VM: {memory:?}");
    assert_eq!(memory.iter().filter(|s| s.value > 0.0).count(), 1, "one worker: {memory:?}");
    // The access log shows each decision: the replica the engine says served the request.
    // Envoy flushes its access log every few seconds.
    let logged = || {
        let log = std::fs::read_to_string(stack.dir.join("envoy.log")).ok()?;
        let lines: Vec<serde_json::Value> = log.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
        served.iter().all(|(b, _)| lines.iter().any(|l| l["kvgate_booking_id"] == b.as_str())).then_some(lines)
    };
    let lines = wait_for("the access log lines", Duration::from_secs(30), logged).unwrap_or_default();
    for (booking, replica) in &served {
        let line = lines.iter().find(|l| l["kvgate_booking_id"] == booking.as_str());
        let line = line.unwrap_or_else(|| panic!("no access log line for {booking} in {}", stack.dir.display()));
        assert_eq!(
            (line["kvgate_outcome"].as_str(), line["kvgate_replica"].as_str()),
            (Some("routed"), Some(replica.as_str()))
        );
        assert!(line["kvgate_prompt_tokens"].as_str().and_then(|n| n.parse::<u32>().ok()).is_some_and(|n| n > 100));
    }
    // Histograms are in microseconds, with buckets to match.
    let tokenize = by(&prom, "sum by (le) (kvgate_tokenize_us_bucket)");
    assert!(tokenize.contains_key("50") && tokenize.contains_key("10000000"), "buckets: {:?}", tokenize.keys());
}
