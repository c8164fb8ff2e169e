//! One request's trace as an OTLP collector receives it: Envoy's span, the sidecar's decision
//! span and the engine's `llm_request` span in the client's trace, each with the right parent.

use std::time::Duration;

use kvgate_e2e::client::{post, Reply};
use kvgate_e2e::otlp::{render_tree, Collector, ReceivedSpan};
use kvgate_e2e::stack::Disaggregation;
use kvgate_e2e::workload::document;
use kvgate_e2e::{Artifacts, Stack, StackOptions};
use serde_json::json;

const MODEL: &str = "Qwen/Qwen3-0.6B";
const TRACE: &str = "5b8efff798038103d269b633813fc60c";
/// The client's own span, the parent it sends in `traceparent`.
const CLIENT_SPAN: &str = "eee19b7ec3c1b174";

/// The span of `service` named `name` (any name for `None`).
fn of<'a>(spans: &'a [ReceivedSpan], service: &str, name: Option<&str>) -> Option<&'a ReceivedSpan> {
    spans.iter().find(|s| s.service == service && name.is_none_or(|n| s.name == n))
}

/// Starts a stack traced to its collector and sends one chat in the client's trace: its
/// answer must be 200.
fn traced_chat(opts: &StackOptions, seed: u32) -> (Stack, Reply) {
    let stack = Stack::start(opts, &Artifacts::locate("debug")).expect("stack starts");
    let body = json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": document(seed, 300)}]});
    let traceparent = format!("00-{TRACE}-{CLIENT_SPAN}-01");
    let reply =
        post(&stack.gateway("/v1/chat/completions"), body.to_string(), &[("traceparent", &traceparent)]).unwrap();
    assert_eq!(reply.status, 200);
    (stack, reply)
}

#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn a_routed_requests_trace_holds_envoy_the_sidecars_decision_and_the_engine() {
    let collector = Collector::start().unwrap();
    let opts = StackOptions {
        name: "tracing".into(),
        model: MODEL.into(),
        otlp_port: Some(collector.addr.port()),
        ..Default::default()
    };
    let (stack, reply) = traced_chat(&opts, 7);
    let served_by = reply.header("x-kvgate-replica").to_owned();

    let spans = collector
        .wait_for_trace(TRACE, Duration::from_secs(30), |spans| {
            of(spans, "kvgate-gateway", None).is_some()
                && of(spans, "kvgate-sidecar", Some("kvgate.route")).is_some()
                && of(spans, "vllm", Some("llm_request")).is_some()
        })
        .unwrap();
    println!("the request's trace {TRACE}, as the collector received it:\n{}", render_tree(&spans));

    // Envoy's span continues the client's; the engine's continues Envoy's (its router passed
    // the trace on); the decision is a child of the client's span, which the filter passed on.
    let envoy = of(&spans, "kvgate-gateway", None).unwrap();
    assert_eq!(envoy.parent_span_id, CLIENT_SPAN, "Envoy's span: {envoy:?}");
    let engine = of(&spans, "vllm", Some("llm_request")).unwrap();
    assert_eq!(engine.parent_span_id, envoy.span_id, "the engine's span: {engine:?}");
    assert!(engine.attributes["gen_ai.request.id"].starts_with("chatcmpl-"), "{engine:?}");
    let decision = of(&spans, "kvgate-sidecar", Some("kvgate.route")).unwrap();
    assert_eq!(decision.parent_span_id, CLIENT_SPAN, "the decision's span: {decision:?}");
    // It names the replica that served the request, and every candidate's cost.
    assert_eq!(decision.attributes.get("replica"), Some(&served_by), "{decision:?}");
    assert_eq!(decision.attributes.get("model").map(String::as_str), Some(MODEL), "{decision:?}");
    let candidates = &decision.attributes["candidates"];
    for sim in &stack.sims {
        assert!(candidates.contains(&format!("{}=", sim.id)), "{} missing from candidates {candidates:?}", sim.id);
    }
    // Only this request's spans are in its trace: the stack's own start-up requests and
    // health checks are in others.
    assert_eq!(spans.iter().filter(|s| s.service == "vllm").count(), 1, "{}", render_tree(&spans));
}

#[test]
#[ignore = "needs Envoy and the built filter: run `cargo xtask test`"]
fn a_disaggregated_requests_prefill_leg_is_in_its_trace() {
    let collector = Collector::start().unwrap();
    let disaggregation = Disaggregation {
        mode: "vllm".into(),
        roles: ["prefill", "decode"].map(String::from).to_vec(),
        keys: "min_remote_prefill_tokens = 64".into(),
    };
    let opts = StackOptions {
        name: "tracing-pd".into(),
        model: MODEL.into(),
        replicas: 2,
        disaggregation: Some(disaggregation),
        otlp_port: Some(collector.addr.port()),
        ..Default::default()
    };
    // The stack lives until its spans have arrived.
    let (_stack, _reply) = traced_chat(&opts, 8);

    // Two engine spans: the leg on the prefill worker (the filter's own call, under the
    // client's span) and the request on the decode worker (under Envoy's).
    let spans = collector
        .wait_for_trace(TRACE, Duration::from_secs(30), |spans| {
            of(spans, "kvgate-gateway", None).is_some() && spans.iter().filter(|s| s.name == "llm_request").count() == 2
        })
        .unwrap();
    println!("the disaggregated request's trace:\n{}", render_tree(&spans));
    let envoy = of(&spans, "kvgate-gateway", None).unwrap();
    let mut parents: Vec<&str> =
        spans.iter().filter(|s| s.name == "llm_request").map(|s| s.parent_span_id.as_str()).collect();
    parents.sort();
    let mut want = vec![CLIENT_SPAN, envoy.span_id.as_str()];
    want.sort();
    assert_eq!(parents, want, "{}", render_tree(&spans));
}
