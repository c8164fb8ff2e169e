//! Latency predictions against real vLLM: streamed chats with system prompts of 60 to 1 060
//! words and 4 tokens out, one after another through Envoy, so each engine's TTFT and ITL
//! models learn and then predict; every prediction the sidecar checked (`/debug/explain`: the
//! latency predicted at the decision against the one the filter measured) is read back, and
//! the errors' quantiles reported.

use serde_json::json;

use crate::bench::stats::percentile;
use crate::client::stream;
use crate::faults::Row;
use crate::workload::document;
use crate::Stack;

/// Requests sent.
const REQUESTS: u32 = 48;
/// The check fails above this p90 error (the target is 25 %): the predictions would not
/// follow the engines at all.
const FAIL_P90: f64 = 0.5;

/// The check's row.
pub fn check(stack: &Stack, model: &str) -> anyhow::Result<Row> {
    let url = stack.gateway("/v1/chat/completions");
    let checked_before = checked(stack)?;
    for i in 0..REQUESTS {
        let words = 60 + (i as usize * 97) % 1_000;
        let body = json!({"model": model, "max_tokens": 4, "ignore_eos": true, "messages": [
            {"role": "system", "content": document(7_000 + i, words)},
            {"role": "user", "content": "Summarise."}]});
        let reply = stream(&url, body)?;
        anyhow::ensure!(reply.status == 200, "request {i}: HTTP {}", reply.status);
    }
    // First tokens are reported in the filter's batches, with the ends: wait for the last.
    super::load::settled(stack)?;
    let checks = checked(stack)? - checked_before;
    let errors = stack.latency_errors("ttft", REQUESTS as usize)?;
    let itl = stack.latency_errors("itl", REQUESTS as usize)?;
    let (p50, p90) = (percentile(&errors, 50.0), percentile(&errors, 90.0));
    let percent = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.1} %", 100.0 * v));
    Ok(Row {
        scenario: "2h. TTFT and ITL predictions",
        expected: "each engine's TTFT and ITL models learn from the gateway's measurements and predict every \
                   streamed request's after 8; TTFT target p90 error ≤ 25 % (fails above 50 %); ITL measured \
                   and checked (fails with fewer than 20 checks)",
        measured: format!(
            "{REQUESTS} streamed requests, system prompts of 60–1 060 words: {checks} TTFT predictions checked, \
             p50 error {}, p90 {}; {} ITL predictions checked, p50 error {}, p90 {}",
            percent(p50),
            percent(p90),
            itl.len(),
            percent(percentile(&itl, 50.0)),
            percent(percentile(&itl, 90.0)),
        ),
        pass: errors.len() >= 20 && p90.is_some_and(|p| p <= FAIL_P90) && itl.len() >= 20,
    })
}

/// TTFT predictions the sidecar has checked so far.
fn checked(stack: &Stack) -> anyhow::Result<u64> {
    Ok(stack.sidecar_state()?["pools"][0]["prediction"]["ttft"]["checked"].as_u64().unwrap_or(0))
}
