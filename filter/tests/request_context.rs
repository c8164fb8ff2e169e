//! The per-request state machine run natively against a fake host: what it asks the sidecar,
//! what it does with each kind of answer (routes, or fails open), and what it reports.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::rc::Rc;
use std::time::{Duration, Instant};

use kvgate_filter::breaker::{self, Breaker, Verdict};
use kvgate_filter::config::FilterConfig;
use kvgate_filter::host::{Host, HostStatus, MetricSink, SidecarCalls};
use kvgate_filter::plan::LoadedModel;
use kvgate_filter::request::{Action, Request};
use kvgate_filter::shared::Shared;
use kvgate_shared::codec;
use kvgate_shared::hash::Salt;
use kvgate_shared::prompt::openai::Endpoint;
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::wire::{
    LifecycleEvent, LifecycleKind, ModelBundle, PrefillLeg, PromptCount, RouteBodyRequest, RouteRequest, RouteResponse,
    Transfer, DESTINATION_HEADER, SHED_REASON_HEADER,
};
use proxy_wasm::types::MetricType;

const BLOCK: u32 = 16;
const QUEUE: u32 = 7;

/// What the fake Envoy holds and what the filter did to it.
#[derive(Default)]
struct State {
    request_headers: HashMap<String, String>,
    response_headers: HashMap<String, String>,
    request_body: Vec<u8>,
    response_chunk: Vec<u8>,
    /// (path, body) of each sidecar call.
    calls: Vec<(String, Vec<u8>)>,
    /// The headers each sidecar call carried beside its own.
    call_extra_headers: Vec<HashMap<String, String>>,
    dispatch_fails: bool,
    /// The sidecar's answer: status and body, and its other headers.
    answer: Option<(String, Vec<u8>)>,
    answer_headers: HashMap<String, String>,
    /// The reply the filter sent the client itself: status, headers, body.
    local_reply: Option<(u32, HashMap<String, String>, Vec<u8>)>,
    resumed: u32,
    upstream: Option<String>,
    queued: Vec<LifecycleEvent>,
    /// (cluster, headers, body) of each request the filter sent upstream itself.
    legs: Vec<(String, HashMap<String, String>, Vec<u8>)>,
    /// The request's properties (Envoy's filter state, for the access log).
    properties: HashMap<String, String>,
}

#[derive(Clone, Default)]
struct Fake(Rc<RefCell<State>>);

impl MetricSink for Fake {
    fn define(&self, _: MetricType, _: &str) -> Option<u32> {
        None
    }
    fn increment(&self, _: u32, _: i64) {}
    fn record(&self, _: u32, _: u64) {}
}

impl SidecarCalls for Fake {
    fn dispatch(
        &self,
        _: &str,
        path: &str,
        _: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        _: Duration,
    ) -> Result<u32, HostStatus> {
        let mut s = self.0.borrow_mut();
        if s.dispatch_fails {
            return Err(HostStatus(2));
        }
        s.call_extra_headers.push(headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
        s.calls.push((path.into(), body.to_vec()));
        Ok(s.calls.len() as u32)
    }
    fn call_status(&self) -> Option<String> {
        self.0.borrow().answer.as_ref().map(|a| a.0.clone())
    }
    fn call_header(&self, name: &str) -> Option<String> {
        self.0.borrow().answer_headers.get(name).cloned()
    }
    fn call_body(&self, size: usize) -> Option<Vec<u8>> {
        self.0.borrow().answer.as_ref().map(|a| a.1[..size].to_vec())
    }
}

impl Host for Fake {
    fn set_property(&self, name: &str, value: &str) -> Result<(), HostStatus> {
        self.0.borrow_mut().properties.insert(name.to_owned(), value.to_owned());
        Ok(())
    }
    fn request_header(&self, name: &str) -> Option<String> {
        self.0.borrow().request_headers.get(name).cloned()
    }
    fn set_request_header(&self, name: &str, value: &str) -> Result<(), HostStatus> {
        self.0.borrow_mut().request_headers.insert(name.into(), value.into());
        Ok(())
    }
    fn remove_request_header(&self, name: &str) -> Result<(), HostStatus> {
        self.0.borrow_mut().request_headers.remove(name);
        Ok(())
    }
    fn set_response_header(&self, name: &str, value: &str) -> Result<(), HostStatus> {
        self.0.borrow_mut().response_headers.insert(name.into(), value.into());
        Ok(())
    }
    fn response_header(&self, name: &str) -> Option<String> {
        self.0.borrow().response_headers.get(name).cloned()
    }
    fn remove_response_header(&self, name: &str) -> Result<(), HostStatus> {
        self.0.borrow_mut().response_headers.remove(name);
        Ok(())
    }
    fn request_body(&self, size: usize) -> Vec<u8> {
        self.0.borrow().request_body[..size].to_vec()
    }
    fn replace_request_body(&self, old_len: usize, body: &[u8]) -> Result<(), HostStatus> {
        self.0.borrow_mut().request_body.splice(..old_len, body.iter().copied());
        Ok(())
    }
    fn response_body(&self, start: usize, size: usize) -> Option<Vec<u8>> {
        Some(self.0.borrow().response_chunk[start..start + size].to_vec())
    }
    fn replace_response_body(&self, old_len: usize, body: &[u8]) -> Result<(), HostStatus> {
        self.0.borrow_mut().response_chunk.splice(..old_len, body.iter().copied());
        Ok(())
    }
    fn resume(&self) -> Result<(), HostStatus> {
        self.0.borrow_mut().resumed += 1;
        Ok(())
    }
    fn upstream_address(&self) -> Option<String> {
        self.0.borrow().upstream.clone()
    }
    fn enqueue(&self, queue: u32, item: &[u8]) -> Result<(), HostStatus> {
        assert_eq!(queue, QUEUE);
        self.0.borrow_mut().queued.push(codec::decode(item).unwrap());
        Ok(())
    }
    fn send_local_reply(&self, code: u32, headers: &[(&str, &str)], body: &[u8]) -> Result<(), HostStatus> {
        let headers = headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        self.0.borrow_mut().local_reply = Some((code, headers, body.to_vec()));
        Ok(())
    }
    fn call(&self, cluster: &str, headers: &[(&str, &str)], body: &[u8], _: Duration) -> Result<u32, HostStatus> {
        let headers = headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let mut s = self.0.borrow_mut();
        s.legs.push((cluster.into(), headers, body.to_vec()));
        Ok(100 + s.legs.len() as u32)
    }
}

fn shared(config: FilterConfig) -> Rc<RefCell<Shared>> {
    let breaker = Breaker::new(config.breaker_limits());
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3-0.6b");
    let bundle = ModelBundle::from_dir("Qwen/Qwen3-0.6B", &dir, BLOCK).unwrap();
    let tokenizer = Rc::new(ModelTokenizer::from_bundle(&bundle).unwrap());
    let model = LoadedModel { tokenizer, block_size: BLOCK, salt: Salt::NONE };
    Rc::new(RefCell::new(Shared {
        config,
        models: HashMap::from([("Qwen/Qwen3-0.6B".to_owned(), model)]),
        listed: Some(HashSet::from(["Qwen/Qwen3-0.6B".to_owned()])),
        queue: Some(QUEUE),
        metrics: None,
        vm_tag: 0xfeed,
        breaker,
        serving: true,
    }))
}

/// A context on a fake host with a POST of `body` and the client's headers.
fn request(body: &str, headers: &[(&str, &str)], config: FilterConfig) -> (Request<Fake>, Fake) {
    request_in(&shared(config), body, headers)
}

/// A context on a fake host of its own, in the VM whose state is `shared`.
fn request_in(shared: &Rc<RefCell<Shared>>, body: &str, headers: &[(&str, &str)]) -> (Request<Fake>, Fake) {
    let fake = Fake::default();
    {
        let mut s = fake.0.borrow_mut();
        s.request_headers.extend(
            [(":method", "POST"), (":path", "/v1/chat/completions"), ("content-type", "application/json")]
                .iter()
                .chain(headers)
                .map(|(k, v)| (k.to_string(), v.to_string())),
        );
        s.request_body = body.as_bytes().to_vec();
    }
    (Request::new(fake.clone(), shared.clone(), 42), fake)
}

fn chat(content: &str) -> String {
    serde_json::json!({"model": "Qwen/Qwen3-0.6B", "messages": [{"role": "user", "content": content}]}).to_string()
}

/// Runs the request path up to the sidecar's answer (if any is set).
fn send(ctx: &mut Request<Fake>, fake: &Fake) -> Action {
    assert_eq!(ctx.on_request_headers(false), Action::Pause, "a routable request is paused for its body");
    let size = fake.0.borrow().request_body.len();
    ctx.on_request_body(size, true)
}

fn answer(fake: &Fake, status: &str, response: &RouteResponse) -> usize {
    let body = codec::encode(response).unwrap();
    let size = body.len();
    fake.0.borrow_mut().answer = Some((status.into(), body));
    size
}

fn routed_to(endpoint: &str) -> RouteResponse {
    RouteResponse {
        endpoint: Some(endpoint.into()),
        replica: Some("b".into()),
        overlap_blocks: 3,
        dp_rank: None,
        prefill: None,
    }
}

/// Runs the response: headers, one body chunk, the end.
fn respond(ctx: &mut Request<Fake>, fake: &Fake, upstream: &str, chunk: &str) {
    fake.0.borrow_mut().upstream = Some(upstream.into());
    fake.0.borrow_mut().response_headers.entry(":status".into()).or_insert_with(|| "200".into());
    fake.0.borrow_mut().response_chunk = chunk.as_bytes().to_vec();
    ctx.on_response_headers();
    ctx.on_response_body(chunk.len(), true);
    ctx.on_log();
}

/// A chat of `text` sent and routed by the sidecar to 127.0.0.1:8001, its response not yet come.
fn routed_chat(text: &str) -> (Request<Fake>, Fake) {
    let (mut ctx, fake) = request(&chat(text), &[], FilterConfig::default());
    send(&mut ctx, &fake);
    let size = answer(&fake, "200", &routed_to("127.0.0.1:8001"));
    ctx.on_call_response(1, 2, size);
    (ctx, fake)
}

/// The kinds of the lifecycle reports queued, with a measured TTFT set to 0.
fn kinds(fake: &Fake) -> Vec<LifecycleKind> {
    let kind = |k: &LifecycleKind| match k {
        LifecycleKind::FirstToken { ttft_us } => LifecycleKind::FirstToken { ttft_us: ttft_us.map(|_| 0) },
        other => other.clone(),
    };
    fake.0.borrow().queued.iter().map(|e| kind(&e.kind)).collect()
}

/// The TTFT the first-token report measured, if it measured one.
fn measured_ttft(fake: &Fake) -> Option<Duration> {
    fake.0.borrow().queued.iter().find_map(|e| match e.kind {
        LifecycleKind::FirstToken { ttft_us } => ttft_us.map(Duration::from_micros),
        _ => None,
    })
}

#[test]
fn a_routed_request_is_booked_under_its_own_key_and_reports_its_life() {
    let (mut ctx, fake) = request(
        &chat("hello there, how are you today?"),
        &[("x-request-id", "client-id"), (DESTINATION_HEADER, "10.0.0.1:1")],
        FilterConfig::default(),
    );
    assert_eq!(send(&mut ctx, &fake), Action::Pause, "waits for the sidecar");
    assert!(!fake.0.borrow().request_headers.contains_key(DESTINATION_HEADER), "the client's header is stripped");
    let (path, body) = fake.0.borrow().calls[0].clone();
    assert_eq!(path, "/v1/route");
    let sent: RouteRequest = codec::decode(&body).unwrap();
    assert_eq!(sent.request_id, "000000000000feed-42", "keyed by the filter's own id");
    assert_eq!(sent.client_request_id.as_deref(), Some("client-id"));
    assert_eq!((sent.model.as_str(), sent.prompt_count), ("Qwen/Qwen3-0.6B", PromptCount::Exact));
    let size = answer(&fake, "200", &routed_to("127.0.0.1:8001"));
    let answered = Instant::now();
    ctx.on_call_response(1, 2, size);
    let s = fake.0.borrow();
    assert_eq!(s.request_headers.get(DESTINATION_HEADER).map(String::as_str), Some("127.0.0.1:8001"));
    assert_eq!(s.resumed, 1);
    drop(s);
    let usage = r#"{"choices":[],"usage":{"prompt_tokens":17,"prompt_tokens_details":{"cached_tokens":16}}}"#;
    // The engine takes a while: the measurement covers it, and nothing from before the answer.
    let engine = Duration::from_millis(5);
    std::thread::sleep(engine);
    respond(&mut ctx, &fake, "127.0.0.1:8001", usage);
    let ttft = measured_ttft(&fake).expect("a first token reported");
    assert!(engine <= ttft && ttft <= answered.elapsed(), "{ttft:?}: from the answer to the first byte");
    assert_eq!(
        kinds(&fake),
        [
            LifecycleKind::FirstToken { ttft_us: Some(0) },
            LifecycleKind::Usage { prompt_tokens: 17, cached_tokens: Some(16) },
            LifecycleKind::Done
        ],
        "ran where it was sent: no move"
    );
    assert!(fake.0.borrow().queued.iter().all(|e| e.model == "Qwen/Qwen3-0.6B" && e.request_id == sent.request_id));
    let property = |name: &str| fake.0.borrow().properties.get(name).cloned().unwrap_or_default();
    assert_eq!(property("kvgate_outcome"), "routed", "the access log reads the decision");
    assert_eq!((property("kvgate_replica").as_str(), property("kvgate_overlap_blocks").as_str()), ("b", "3"));
    assert_eq!(property("kvgate_booking_id"), sent.request_id.as_str());
}

/// An engine's error answers fast and says nothing of how fast it computes a prompt: its first
/// byte ends the prefill's booking but carries no TTFT for the replica's model to learn.
#[test]
fn an_error_response_reports_its_first_byte_without_a_ttft() {
    let (mut ctx, fake) = routed_chat("hello there");
    fake.0.borrow_mut().response_headers.insert(":status".into(), "503".into());
    respond(&mut ctx, &fake, "127.0.0.1:8001", r#"{"error":"overloaded"}"#);
    assert_eq!(kinds(&fake), [LifecycleKind::FirstToken { ttft_us: None }, LifecycleKind::Done]);
}

#[test]
fn the_sidecar_call_carries_the_requests_trace_context() {
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let (mut ctx, fake) =
        request(&chat("hello"), &[("traceparent", traceparent), ("tracestate", "k=v")], FilterConfig::default());
    send(&mut ctx, &fake);
    let sent = fake.0.borrow().call_extra_headers[0].clone();
    assert_eq!(sent.get("traceparent").map(String::as_str), Some(traceparent));
    assert_eq!(sent.get("tracestate").map(String::as_str), Some("k=v"));
    let (mut ctx, fake) = request(&chat("hello"), &[], FilterConfig::default());
    send(&mut ctx, &fake);
    assert!(fake.0.borrow().call_extra_headers[0].is_empty(), "none invented");
}

#[test]
fn a_body_ended_by_trailers_is_routed() {
    let (mut ctx, fake) = request(&chat("hello there, routed after its trailers"), &[], FilterConfig::default());
    assert_eq!(ctx.on_request_headers(false), Action::Pause);
    let size = fake.0.borrow().request_body.len();
    assert_eq!(ctx.on_request_body(size, false), Action::Pause, "no end of stream: trailers follow");
    assert!(fake.0.borrow().calls.is_empty());
    assert_eq!(ctx.on_request_trailers(), Action::Pause, "the trailers end the body: ask the sidecar");
    let sent: RouteRequest = codec::decode(&fake.0.borrow().calls[0].1).unwrap();
    assert_eq!(sent.model, "Qwen/Qwen3-0.6B", "the whole buffered body was read");
    let answer_size = answer(&fake, "200", &routed_to("127.0.0.1:8001"));
    ctx.on_call_response(1, 2, answer_size);
    let s = fake.0.borrow();
    assert_eq!(s.request_headers.get(DESTINATION_HEADER).map(String::as_str), Some("127.0.0.1:8001"));
    assert_eq!((s.resumed, s.calls.len()), (1, 1));
}

#[test]
fn priority_and_tenant_come_only_from_headers_the_operator_named() {
    let headers = [("x-kvgate-priority", "interactive"), ("x-tenant", "acme")];
    let (mut ctx, fake) = request(&chat("hi"), &headers, FilterConfig::default());
    send(&mut ctx, &fake);
    let sent: RouteRequest = codec::decode(&fake.0.borrow().calls[0].1).unwrap();
    assert_eq!((sent.priority, sent.tenant), (None, None), "unnamed headers are not read");
    let config = FilterConfig {
        priority_header: Some("x-kvgate-priority".into()),
        tenant_header: Some("x-tenant".into()),
        ..FilterConfig::default()
    };
    let long = "t".repeat(1000);
    let (mut ctx, fake) = request(&chat("hi"), &[("x-kvgate-priority", "interactive"), ("x-tenant", &long)], config);
    send(&mut ctx, &fake);
    let sent: RouteRequest = codec::decode(&fake.0.borrow().calls[0].1).unwrap();
    assert_eq!(sent.priority.as_deref(), Some("interactive"));
    assert_eq!(sent.tenant.map(|t| t.len()), Some(256), "bounded");
}

#[test]
fn a_ttft_slo_comes_only_from_the_header_the_operator_named_and_only_as_a_number() {
    let (mut ctx, fake) = request(&chat("hi"), &[("x-slo", "250")], FilterConfig::default());
    send(&mut ctx, &fake);
    let sent: RouteRequest = codec::decode(&fake.0.borrow().calls[0].1).unwrap();
    assert_eq!(sent.ttft_slo_ms, None, "an unnamed header is not read");
    let config = || FilterConfig { ttft_slo_header: Some("x-slo".into()), ..FilterConfig::default() };
    for (value, slo) in [(" 250 ", Some(250)), ("fast", None), ("-5", None), ("1e3", None)] {
        let (mut ctx, fake) = request(&chat("hi"), &[("x-slo", value)], config());
        send(&mut ctx, &fake);
        let sent: RouteRequest = codec::decode(&fake.0.borrow().calls[0].1).unwrap();
        assert_eq!(sent.ttft_slo_ms, slo, "{value:?}");
    }
}

#[test]
fn a_shed_request_is_answered_429_and_goes_no_further() {
    let config = FilterConfig { admission_wait_ms: 500, ..FilterConfig::default() };
    let (mut ctx, fake) = request(&chat("hello while the fleet is full"), &[], config);
    assert_eq!(send(&mut ctx, &fake), Action::Pause);
    let sent: RouteRequest = codec::decode(&fake.0.borrow().calls[0].1).unwrap();
    assert_eq!(sent.wait_ms, 500, "the sidecar is told how long the filter waits");
    fake.0.borrow_mut().answer = Some(("429".into(), b"saturated".to_vec()));
    fake.0.borrow_mut().answer_headers.insert("retry-after".into(), "3".into());
    ctx.on_call_response(1, 2, 9);
    let s = fake.0.borrow();
    let (code, headers, body) = s.local_reply.clone().expect("answered here");
    assert_eq!((code, headers.get("retry-after").map(String::as_str)), (429, Some("3")));
    let error: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(error["error"]["code"], "rate_limit_exceeded");
    assert!(error["error"]["message"].as_str().unwrap().contains("saturated"), "{error}");
    assert_eq!(s.resumed, 0, "the request is not sent upstream");
    assert!(!s.request_headers.contains_key(DESTINATION_HEADER));
    drop(s);
    ctx.on_log();
    assert!(kinds(&fake).is_empty(), "nothing was booked, nothing to release");
}

#[test]
fn a_request_shed_for_its_ttft_slo_is_told_so() {
    let config = FilterConfig { admission_wait_ms: 500, ..FilterConfig::default() };
    let (mut ctx, fake) = request(&chat("hello, in a hurry"), &[], config);
    assert_eq!(send(&mut ctx, &fake), Action::Pause);
    fake.0.borrow_mut().answer = Some(("429".into(), Vec::new()));
    fake.0.borrow_mut().answer_headers.insert(SHED_REASON_HEADER.into(), "slo".into());
    ctx.on_call_response(1, 2, 0);
    let (code, headers, body) = fake.0.borrow().local_reply.clone().expect("answered here");
    assert_eq!((code, headers.get("retry-after").map(String::as_str)), (429, Some("1")));
    let error: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("predicted to meet the request's latency objectives"), "{message}");
    assert_eq!(fake.0.borrow().resumed, 0, "the request is not sent upstream");
}

#[test]
fn a_request_that_ran_elsewhere_is_reported_where_it_ran() {
    let (mut ctx, fake) = routed_chat("hi");
    respond(&mut ctx, &fake, "127.0.0.1:8002", "data: [DONE]\n\n");
    assert_eq!(kinds(&fake)[0], LifecycleKind::RanOn("127.0.0.1:8002".into()));
    assert_eq!(kinds(&fake).last(), Some(&LifecycleKind::Done));
}

#[test]
fn every_sidecar_failure_fails_open_and_still_releases() {
    let bad_answers: [(&str, Option<Vec<u8>>, usize); 3] =
        [("200", Some(b"not bincode".to_vec()), 2), ("503", Some(Vec::new()), 2), ("200", None, 0)];
    for (status, body, headers) in bad_answers {
        let (mut ctx, fake) = request(&chat("hi"), &[], FilterConfig::default());
        send(&mut ctx, &fake);
        let size = body.as_ref().map_or(0, Vec::len);
        fake.0.borrow_mut().answer = body.map(|b| (status.to_owned(), b));
        // No headers at all: the call timed out.
        ctx.on_call_response(1, headers, size);
        let s = fake.0.borrow();
        assert!(!s.request_headers.contains_key(DESTINATION_HEADER), "{status}: Envoy's balancer routes");
        let outcome = s.properties.get("kvgate_outcome").map(String::as_str);
        assert!(matches!(outcome, Some("fallback_error" | "fallback_timeout")), "{status}: {outcome:?}");
        assert_eq!(s.resumed, 1, "{status}: the request goes on");
        drop(s);
        respond(&mut ctx, &fake, "127.0.0.1:8003", "{}");
        assert_eq!(
            kinds(&fake).last(),
            Some(&LifecycleKind::Done),
            "{status}: whatever the sidecar booked is released"
        );
    }
    // A sidecar answer without a replica routes nowhere either.
    let (mut ctx, fake) = request(&chat("hi"), &[], FilterConfig::default());
    send(&mut ctx, &fake);
    let nowhere = RouteResponse { endpoint: None, replica: None, overlap_blocks: 0, dp_rank: None, prefill: None };
    let size = answer(&fake, "200", &nowhere);
    ctx.on_call_response(1, 2, size);
    assert!(!fake.0.borrow().request_headers.contains_key(DESTINATION_HEADER));
}

#[test]
fn a_call_that_cannot_be_dispatched_continues_at_once_and_books_nothing() {
    let (mut ctx, fake) = request(&chat("hi"), &[], FilterConfig::default());
    fake.0.borrow_mut().dispatch_fails = true;
    assert_eq!(send(&mut ctx, &fake), Action::Continue);
    respond(&mut ctx, &fake, "127.0.0.1:8001", "{}");
    assert!(kinds(&fake).is_empty(), "nothing was booked, nothing to report");
}

#[test]
fn unroutable_requests_pass_through_untouched() {
    for body in ["{not json", r#"{"model":"someone-else","prompt":"hi"}"#] {
        let (mut ctx, fake) = request(body, &[], FilterConfig::default());
        assert_eq!(send(&mut ctx, &fake), Action::Continue, "{body}");
        assert!(fake.0.borrow().calls.is_empty(), "{body}: the sidecar is not asked");
        respond(&mut ctx, &fake, "127.0.0.1:8001", "{}");
        assert!(kinds(&fake).is_empty());
    }
    // Other methods and paths are not even buffered.
    let (mut ctx, fake) = request(&chat("hi"), &[(":method", "GET")], FilterConfig::default());
    assert_eq!(ctx.on_request_headers(false), Action::Continue);
    assert!(fake.0.borrow().calls.is_empty());
}

#[test]
fn transfer_fields_that_cannot_be_taken_out_are_refused_here() {
    // Python's `json` (the engine's) reads NaN, lone surrogates and a leading byte-order
    // mark; serde_json does not.
    let with_bom = format!("\u{feff}{}", r#"{"kv_transfer_params":{}}"#);
    let unreadable = [
        r#"{"model":"Qwen/Qwen3-0.6B","temperature":NaN,"kv_transfer_params":{"remote_host":"evil.example"}}"#,
        r#"{"model":"Qwen/Qwen3-0.6B","x":NaN,"kv\u005ftransfer_params":{"remote_host":"evil.example"}}"#,
        r#"{"model":"Qwen/Qwen3-0.6B","x":"\ud800","bootstrap_host":"evil.example"}"#,
        &with_bom,
    ];
    for body in unreadable {
        let (mut ctx, fake) = request(body, &[], FilterConfig::default());
        assert_eq!(send(&mut ctx, &fake), Action::Pause, "{body}");
        let s = fake.0.borrow();
        let (code, _, reply) = s.local_reply.clone().expect("answered here");
        assert_eq!(code, 400, "{body}");
        let error: serde_json::Value = serde_json::from_slice(&reply).unwrap();
        assert_eq!(error["error"]["code"], "unreadable_transfer_fields");
        assert!(s.calls.is_empty() && s.resumed == 0, "{body}: not asked about, not sent upstream");
        assert_eq!(s.properties.get("kvgate_outcome").map(String::as_str), Some("refused"));
    }
    // Trusted clients keep their fields, however they are written.
    let trusting = FilterConfig { client_transfer_fields: true, ..FilterConfig::default() };
    let (mut ctx, fake) = request(unreadable[0], &[], trusting);
    assert_eq!(send(&mut ctx, &fake), Action::Continue);
    assert!(fake.0.borrow().local_reply.is_none());
    // A body it cannot read that could not name one goes on to the engine, which answers it.
    let nan = r#"{"model":"Qwen/Qwen3-0.6B","messages":[{"role":"user","content":"a\nb"}],"temperature":NaN}"#;
    let (mut ctx, fake) = request(nan, &[], FilterConfig::default());
    assert_eq!(send(&mut ctx, &fake), Action::Continue);
    assert!(fake.0.borrow().local_reply.is_none());
}

#[test]
fn another_json_post_is_cleaned_but_not_routed() {
    // vLLM's `/invocations` and SGLang's `/generate` read the same fields as the routed paths.
    let body = r#"{"model":"Qwen/Qwen3-0.6B","text":"hi","bootstrap_host":"evil.example","kv_transfer_params":{}}"#;
    for path in ["/invocations", "/generate"] {
        let (mut ctx, fake) = request(body, &[(":path", path)], FilterConfig::default());
        assert_eq!(send(&mut ctx, &fake), Action::Continue, "{path}");
        let s = fake.0.borrow();
        let sent: serde_json::Value = serde_json::from_slice(&s.request_body).unwrap();
        assert_eq!(sent, serde_json::json!({"model": "Qwen/Qwen3-0.6B", "text": "hi"}), "{path}");
        assert!(s.calls.is_empty() && s.local_reply.is_none(), "{path}: not routed, not refused");
    }
    // One it cannot clean is refused; one with nothing to take out goes on as it came.
    let (mut ctx, fake) =
        request(r#"{"x":NaN,"kv_transfer_params":{}}"#, &[(":path", "/invocations")], FilterConfig::default());
    assert_eq!(send(&mut ctx, &fake), Action::Pause);
    assert_eq!(fake.0.borrow().local_reply.as_ref().map(|r| r.0), Some(400));
    let (mut ctx, fake) =
        request(r#"{"input":"kv_transfer_params"}"#, &[(":path", "/v1/embeddings")], FilterConfig::default());
    assert_eq!(send(&mut ctx, &fake), Action::Continue);
    assert_eq!(fake.0.borrow().request_body, br#"{"input":"kv_transfer_params"}"#);
    // Trusted clients' bodies are not even buffered.
    let trusting = FilterConfig { client_transfer_fields: true, ..FilterConfig::default() };
    let (mut ctx, _) = request(body, &[(":path", "/invocations")], trusting);
    assert_eq!(ctx.on_request_headers(false), Action::Continue);
}

#[test]
fn a_big_body_is_offloaded_with_the_filters_deadline() {
    let config = FilterConfig { offload_bytes: 64, offload_timeout_ms: 750, ..FilterConfig::default() };
    let (mut ctx, fake) = request(&chat(&"many words ".repeat(20)), &[], config);
    assert_eq!(send(&mut ctx, &fake), Action::Pause);
    let (path, body) = fake.0.borrow().calls[0].clone();
    assert_eq!(path, "/v1/route_body");
    let sent: RouteBodyRequest<'_> = codec::decode(&body).unwrap();
    assert_eq!(
        (sent.budget_ms, sent.endpoint, sent.body.len()),
        (750, Endpoint::ChatCompletions, fake.0.borrow().request_body.len())
    );
    let size = answer(&fake, "200", &routed_to("127.0.0.1:8001"));
    ctx.on_call_response(1, 2, size);
    assert!(fake.0.borrow().request_headers.contains_key(DESTINATION_HEADER));
}

/// A small request for a model the sidecar routes but this VM holds no tokenizer for (not
/// loaded yet, or `envoy_tokenizers` leaves it out) is tokenized by the sidecar, not routed on
/// an estimate; one for a model the sidecar does not route passes through.
#[test]
fn a_model_without_a_tokenizer_here_is_tokenized_by_the_sidecar() {
    let config = FilterConfig { route_timeout_ms: 30, offload_timeout_ms: 750, ..FilterConfig::default() };
    let vm = shared(config);
    vm.borrow_mut().models.clear();
    let (mut ctx, fake) = request_in(&vm, &chat("hi"), &[]);
    assert_eq!(send(&mut ctx, &fake), Action::Pause);
    let (path, body) = fake.0.borrow().calls[0].clone();
    assert_eq!(path, "/v1/route_body");
    let sent: RouteBodyRequest<'_> = codec::decode(&body).unwrap();
    assert_eq!(sent.body.as_ref(), chat("hi").as_bytes());
    assert_eq!(sent.budget_ms, 30, "a small body's deadline: the route's, not a big body's");
    let size = answer(&fake, "200", &routed_to("127.0.0.1:8001"));
    ctx.on_call_response(1, 2, size);
    assert_eq!(fake.0.borrow().request_headers[DESTINATION_HEADER], "127.0.0.1:8001");

    let other = serde_json::json!({"model": "other", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let (mut ctx, fake) = request_in(&vm, &other, &[]);
    send(&mut ctx, &fake);
    assert!(fake.0.borrow().calls.is_empty(), "not a model kvgate routes: no call");
}

/// A streamed chat whose client asked for no usage: the engine is asked for it, the usage
/// event is read for the closed loop and taken out of what the client receives.
#[test]
fn usage_is_asked_for_on_a_streaming_clients_behalf_and_taken_back_out() {
    let body = serde_json::json!({"model": "Qwen/Qwen3-0.6B", "stream": true,
        "messages": [{"role": "user", "content": "hello there, stream me something"}]})
    .to_string();
    let content_length = body.len().to_string();
    let (mut ctx, fake) = request(&body, &[("content-length", &content_length)], FilterConfig::default());
    assert_eq!(send(&mut ctx, &fake), Action::Pause);
    let upstream = fake.0.borrow().request_body.clone();
    let sent: serde_json::Value = serde_json::from_slice(&upstream).unwrap();
    assert_eq!(sent["stream_options"]["include_usage"], true, "the engine is asked for usage");
    assert_eq!(sent["messages"][0]["content"], "hello there, stream me something", "the rest is as sent");
    let length = fake.0.borrow().request_headers["content-length"].clone();
    assert_eq!(length, upstream.len().to_string());
    let size = answer(&fake, "200", &routed_to("127.0.0.1:8001"));
    ctx.on_call_response(1, 2, size);

    fake.0.borrow_mut().upstream = Some("127.0.0.1:8001".into());
    fake.0.borrow_mut().response_headers.extend(
        [(":status", "200"), ("content-type", "text/event-stream; charset=utf-8"), ("content-length", "999")]
            .map(|(k, v)| (k.to_owned(), v.to_owned())),
    );
    ctx.on_response_headers();
    assert!(!fake.0.borrow().response_headers.contains_key("content-length"), "the stream it shortens");
    let token = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
    let usage =
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":20,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\n";
    let mut received = Vec::new();
    for (chunk, end) in [(token, false), (&usage[..30], false), (&usage[30..], false), ("data: [DONE]\n\n", true)] {
        fake.0.borrow_mut().response_chunk = chunk.as_bytes().to_vec();
        ctx.on_response_body(chunk.len(), end);
        received.extend(fake.0.borrow().response_chunk.clone());
    }
    ctx.on_log();
    assert_eq!(String::from_utf8(received).unwrap(), format!("{token}data: [DONE]\n\n"), "the client's own stream");
    assert!(
        kinds(&fake).contains(&LifecycleKind::Usage { prompt_tokens: 20, cached_tokens: Some(16) }),
        "the closed loop has the engine's numbers"
    );
}

/// A stream's mean time between tokens is its span from first byte to last over the tokens
/// the engine says it produced, less one; a stream that is not a success, one that is not an
/// event stream, or one of a single token measures none.
#[test]
fn a_streamed_response_reports_its_mean_time_between_tokens() {
    let stream = |status: &str, content_type: &str, completion_tokens: u32| {
        let (mut ctx, fake) = routed_chat("hello there");
        fake.0.borrow_mut().upstream = Some("127.0.0.1:8001".into());
        fake.0
            .borrow_mut()
            .response_headers
            .extend([(":status", status), ("content-type", content_type)].map(|(k, v)| (k.to_owned(), v.to_owned())));
        ctx.on_response_headers();
        let token = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
        let usage = format!(
            "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":9,\"completion_tokens\":{completion_tokens}}}}}\n\n"
        );
        let start = Instant::now();
        let chunks = [token, token, token, &usage];
        for (i, chunk) in chunks.iter().enumerate() {
            if i > 0 {
                std::thread::sleep(Duration::from_millis(4));
            }
            fake.0.borrow_mut().response_chunk = chunk.as_bytes().to_vec();
            ctx.on_response_body(chunk.len(), i + 1 == chunks.len());
        }
        let span = start.elapsed();
        ctx.on_log();
        let itl = fake.0.borrow().queued.iter().find_map(|e| match e.kind {
            LifecycleKind::Decoded { itl_us } => Some(Duration::from_micros(itl_us)),
            _ => None,
        });
        (itl, span)
    };
    let (itl, span) = stream("200", "text/event-stream", 4);
    let itl = itl.expect("a streamed success of four tokens is timed");
    assert!(Duration::from_millis(4) <= itl && itl <= span / 3, "{itl:?}: three gaps in {span:?}");
    assert_eq!(stream("200", "text/event-stream", 1).0, None, "one token has no gap");
    assert_eq!(stream("500", "text/event-stream", 4).0, None, "an error times nothing");
    assert_eq!(stream("200", "application/json", 4).0, None, "a body that is not streamed comes at once");
}

#[test]
fn a_client_that_asked_for_usage_or_did_not_stream_is_left_as_it_is() {
    for body in [
        serde_json::json!({"model": "Qwen/Qwen3-0.6B", "stream": true, "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": "hi"}]}),
        serde_json::json!({"model": "Qwen/Qwen3-0.6B", "messages": [{"role": "user", "content": "hi"}]}),
    ] {
        let (mut ctx, fake) = request(&body.to_string(), &[], FilterConfig::default());
        send(&mut ctx, &fake);
        assert_eq!(fake.0.borrow().request_body, body.to_string().into_bytes(), "{body}");
        let usage = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5}}\n\n";
        respond(&mut ctx, &fake, "127.0.0.1:8001", usage);
        assert_eq!(fake.0.borrow().response_chunk, usage.as_bytes(), "what the client asked for, untouched");
    }
    // An engine's error answer to a stream that was asked for usage is passed on untouched.
    let body = serde_json::json!({"model": "Qwen/Qwen3-0.6B", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let (mut ctx, fake) = request(&body.to_string(), &[], FilterConfig::default());
    send(&mut ctx, &fake);
    assert_ne!(fake.0.borrow().request_body, body.to_string().into_bytes(), "usage asked for");
    let error = r#"{"object":"error","message":"\"choices\":[],\"usage\":{} is not a request","code":400}"#;
    fake.0
        .borrow_mut()
        .response_headers
        .extend([(":status", "400"), ("content-type", "application/json")].map(|(k, v)| (k.to_owned(), v.to_owned())));
    fake.0.borrow_mut().response_chunk = error.as_bytes()[..20].to_vec();
    ctx.on_response_headers();
    ctx.on_response_body(20, false);
    assert_eq!(fake.0.borrow().response_chunk, error.as_bytes()[..20], "not held: not a stream");
    let off = FilterConfig { request_usage: false, ..FilterConfig::default() };
    let body = serde_json::json!({"model": "Qwen/Qwen3-0.6B", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let (mut ctx, fake) = request(&body.to_string(), &[], off);
    send(&mut ctx, &fake);
    assert_eq!(fake.0.borrow().request_body, body.to_string().into_bytes(), "request_usage off");
}

/// Usage is asked for in an offloaded body too, without copying it: only its first brace
/// is replaced.
#[test]
fn an_offloaded_stream_asks_for_usage_too() {
    let body = format!(
        " {}",
        &serde_json::json!({"model": "Qwen/Qwen3-0.6B", "stream": true,
        "messages": [{"role": "user", "content": "many words ".repeat(20)}]})
    );
    let config = FilterConfig { offload_bytes: 64, ..FilterConfig::default() };
    let (mut ctx, fake) = request(&body, &[], config);
    assert_eq!(send(&mut ctx, &fake), Action::Pause);
    let call = fake.0.borrow().calls[0].1.clone();
    let sent: RouteBodyRequest<'_> = codec::decode(&call).unwrap();
    assert_eq!(sent.body.as_ref(), body.as_bytes(), "the sidecar tokenizes the client's body");
    let upstream: serde_json::Value = serde_json::from_slice(&fake.0.borrow().request_body).unwrap();
    assert_eq!(upstream["stream_options"]["include_usage"], true);
}

/// A request to `path` (an endpoint the engine builds a chat from) is routed on its rendered
/// prompt, which is `chat`'s, and its body goes upstream as sent: nothing is asked for. Returns
/// the request, answered by the sidecar and routed to `127.0.0.1:8001`.
fn routed_as_its_chat(body: &str, path: &str, chat: serde_json::Value) -> (Request<Fake>, Fake) {
    let (mut ctx, fake) = request(body, &[], FilterConfig::default());
    fake.0.borrow_mut().request_headers.insert(":path".into(), path.into());
    assert_eq!(send(&mut ctx, &fake), Action::Pause);
    let sent: RouteRequest = codec::decode(&fake.0.borrow().calls[0].1).unwrap();
    assert_eq!(sent.prompt_count, PromptCount::Exact, "rendered and tokenized in the filter");
    let (mut chat_ctx, chat_fake) = request(&chat.to_string(), &[], FilterConfig::default());
    send(&mut chat_ctx, &chat_fake);
    let as_chat: RouteRequest = codec::decode(&chat_fake.0.borrow().calls[0].1).unwrap();
    assert_eq!(
        (sent.prompt_tokens, &sent.block_hashes),
        (as_chat.prompt_tokens, &as_chat.block_hashes),
        "as vLLM renders it"
    );
    assert_eq!(fake.0.borrow().request_body, body.as_bytes(), "nothing asked for");
    let size = answer(&fake, "200", &routed_to("127.0.0.1:8001"));
    ctx.on_call_response(1, 2, size);
    (ctx, fake)
}

/// The chat vLLM renders for the requests below.
fn brief_chat() -> serde_json::Value {
    serde_json::json!({"model": "Qwen/Qwen3-0.6B",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]})
}

/// A Responses request is routed on its rendered prompt; its usage comes from
/// `response.completed`, so nothing is asked for.
#[test]
fn a_responses_request_is_routed_and_its_usage_read() {
    let body = serde_json::json!({"model": "Qwen/Qwen3-0.6B", "input": "hello there", "stream": true,
        "instructions": "Be brief."})
    .to_string();
    let (mut ctx, fake) = routed_as_its_chat(&body, "/v1/responses", brief_chat());
    let completed = "event: response.completed\ndata: {\"response\":{\"usage\":{\"input_tokens\":21,\"input_tokens_details\":{\"cached_tokens\":16}}},\"type\":\"response.completed\"}\n\n";
    respond(&mut ctx, &fake, "127.0.0.1:8001", completed);
    assert!(kinds(&fake).contains(&LifecycleKind::Usage { prompt_tokens: 21, cached_tokens: Some(16) }));
}

/// An Anthropic Messages request is routed on its rendered prompt (billing header dropped, as
/// vLLM drops it); its usage comes from `message_delta`, where `input_tokens` leave out the
/// cache's tokens, so nothing is asked for and the prompt is their sum.
#[test]
fn a_messages_request_is_routed_and_its_usage_read() {
    let body = serde_json::json!({"model": "Qwen/Qwen3-0.6B", "max_tokens": 4, "stream": true,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cch=9"}, {"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]})
    .to_string();
    let (mut ctx, fake) = routed_as_its_chat(&body, "/v1/messages", brief_chat());
    let delta = "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"max_tokens\"},\"usage\":{\"input_tokens\":5,\"output_tokens\":4,\"cache_read_input_tokens\":16}}\n\n";
    respond(&mut ctx, &fake, "127.0.0.1:8001", delta);
    assert!(kinds(&fake).contains(&LifecycleKind::Usage { prompt_tokens: 21, cached_tokens: Some(16) }));
}

/// The sidecar's answer for a disaggregated request: decode on `127.0.0.1:8003`, prefill on
/// `127.0.0.1:8001`.
fn disaggregated(transfer: Transfer) -> RouteResponse {
    let leg = PrefillLeg {
        endpoint: "127.0.0.1:8001".into(),
        replica: "p".into(),
        dp_rank: None,
        overlap_blocks: 2,
        booking_id: "000000000000feed-42/prefill".into(),
        transfer,
    };
    RouteResponse { prefill: Some(leg), ..routed_to("127.0.0.1:8003") }
}

fn pd_config() -> FilterConfig {
    FilterConfig { prefill_cluster: Some("engines".into()), debug_headers: true, ..FilterConfig::default() }
}

fn body_json(fake: &Fake) -> serde_json::Value {
    serde_json::from_slice(&fake.0.borrow().request_body).unwrap()
}

fn events_of(fake: &Fake, id: &str) -> Vec<LifecycleKind> {
    fake.0.borrow().queued.iter().filter(|e| e.request_id == id).map(|e| e.kind.clone()).collect()
}

#[test]
fn a_vllm_prefill_leg_runs_first_and_its_transfer_parameters_go_to_the_decode_worker() {
    let headers = [("x-request-id", "client-id"), (DESTINATION_HEADER, "6.6.6.6:1"), (":authority", "gw")];
    let body = serde_json::json!({"model": "Qwen/Qwen3-0.6B", "messages": [{"role": "user", "content": "a long question"}],
        "stream": true, "max_tokens": 40});
    let (mut ctx, fake) = request(&body.to_string(), &headers, pd_config());
    send(&mut ctx, &fake);
    let size = answer(&fake, "200", &disaggregated(Transfer::Vllm));
    ctx.on_call_response(1, 2, size);
    let (cluster, leg_headers, leg_body) = fake.0.borrow().legs[0].clone();
    assert_eq!(fake.0.borrow().resumed, 0, "the request waits for its prefill leg");
    assert_eq!(cluster, "engines");
    assert_eq!(
        leg_headers[DESTINATION_HEADER], "127.0.0.1:8001",
        "the leg goes to the prefill worker, whatever the client said"
    );
    assert_eq!(
        (leg_headers[":path"].as_str(), leg_headers["x-request-id"].as_str()),
        ("/v1/chat/completions", "client-id")
    );
    let leg: serde_json::Value = serde_json::from_slice(&leg_body).unwrap();
    assert_eq!(
        (&leg["kv_transfer_params"]["do_remote_decode"], &leg["max_tokens"], &leg["stream"]),
        (&serde_json::json!(true), &serde_json::json!(1), &serde_json::json!(false))
    );
    // The prefill worker answers with where its KV is.
    let reply = r#"{"choices":[{"text":"x"}],"usage":{"prompt_tokens":20,"prompt_tokens_details":{"cached_tokens":16}},
        "kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e1","remote_block_ids":[1,2],"remote_host":"127.0.0.1","remote_port":8001}}"#;
    fake.0.borrow_mut().answer = Some(("200".into(), reply.as_bytes().to_vec()));
    ctx.on_call_response(101, 3, reply.len());
    let s = fake.0.borrow();
    assert_eq!(s.resumed, 1, "then it goes on");
    assert_eq!(s.request_headers[DESTINATION_HEADER], "127.0.0.1:8003", "to the decode worker");
    assert_eq!(s.request_headers.get("content-length"), None, "no length was set, none is added");
    drop(s);
    let sent = body_json(&fake);
    assert_eq!(sent["kv_transfer_params"]["remote_engine_id"], "e1");
    assert_eq!((&sent["stream"], &sent["max_tokens"]), (&serde_json::json!(true), &serde_json::json!(40)));
    assert_eq!(
        events_of(&fake, "000000000000feed-42/prefill"),
        [LifecycleKind::Usage { prompt_tokens: 20, cached_tokens: Some(16) }, LifecycleKind::Done],
        "the leg's prediction is checked and its booking released"
    );
    respond(&mut ctx, &fake, "127.0.0.1:8003", "data: [DONE]\n\n");
    assert_eq!(fake.0.borrow().response_headers["x-kvgate-prefill-leg"], "ok");
    assert_eq!(fake.0.borrow().response_headers["x-kvgate-prefill-on"], "p");
    assert_eq!(events_of(&fake, "000000000000feed-42").last(), Some(&LifecycleKind::Done));
}

#[test]
fn a_failed_or_late_prefill_leg_leaves_the_request_whole_on_its_decode_worker() {
    for (status, headers, outcome) in [("503", 2, "failed"), ("200", 2, "failed"), ("", 0, "timeout")] {
        let (mut ctx, fake) = request(&chat("a long question"), &[], pd_config());
        send(&mut ctx, &fake);
        let size = answer(&fake, "200", &disaggregated(Transfer::Vllm));
        ctx.on_call_response(1, 2, size);
        let reply = br#"{"choices":[]}"#;
        fake.0.borrow_mut().answer = Some((status.into(), reply.to_vec()));
        ctx.on_call_response(101, headers, reply.len());
        assert_eq!(fake.0.borrow().resumed, 1, "{outcome}: the request goes on");
        assert_eq!(fake.0.borrow().request_headers[DESTINATION_HEADER], "127.0.0.1:8003");
        assert!(body_json(&fake).get("kv_transfer_params").is_none(), "{outcome}: served whole");
        assert_eq!(events_of(&fake, "000000000000feed-42/prefill"), [LifecycleKind::Done]);
        assert_eq!(
            events_of(&fake, "000000000000feed-42"),
            [LifecycleKind::ServedWhole],
            "its booking takes the prefill"
        );
        respond(&mut ctx, &fake, "127.0.0.1:8003", "{}");
        assert_eq!(fake.0.borrow().response_headers["x-kvgate-prefill-leg"], outcome);
    }
}

#[test]
fn without_a_prefill_cluster_the_request_is_served_whole_at_once() {
    let (mut ctx, fake) = request(&chat("a long question"), &[], FilterConfig::default());
    send(&mut ctx, &fake);
    let size = answer(&fake, "200", &disaggregated(Transfer::Vllm));
    ctx.on_call_response(1, 2, size);
    assert_eq!((fake.0.borrow().resumed, fake.0.borrow().legs.len()), (1, 0));
    assert_eq!(events_of(&fake, "000000000000feed-42/prefill"), [LifecycleKind::Done], "the leg's booking is released");
}

#[test]
fn sglang_legs_run_beside_the_request_with_one_bootstrap_room() {
    let body = serde_json::json!({"model": "Qwen/Qwen3-0.6B", "messages": [{"role": "user", "content": "a long question"}],
        "stream": true, "bootstrap_host": "6.6.6.6"});
    let (mut ctx, fake) = request(&body.to_string(), &[("content-length", "10")], pd_config());
    send(&mut ctx, &fake);
    let transfer = Transfer::Sglang { host: "127.0.0.1".into(), port: 8998, room: 77 };
    let size = answer(&fake, "200", &disaggregated(transfer));
    ctx.on_call_response(1, 2, size);
    assert_eq!(fake.0.borrow().resumed, 1, "the decode request goes at once");
    let sent = body_json(&fake);
    assert_eq!(
        (&sent["bootstrap_host"], &sent["bootstrap_port"], &sent["bootstrap_room"]),
        (&serde_json::json!("127.0.0.1"), &serde_json::json!(8998), &serde_json::json!(77))
    );
    let len = fake.0.borrow().request_body.len().to_string();
    assert_eq!(fake.0.borrow().request_headers["content-length"], len, "its length follows the body");
    let leg: serde_json::Value = serde_json::from_slice(&fake.0.borrow().legs[0].2).unwrap();
    assert_eq!((&leg["bootstrap_room"], &leg["stream"]), (&serde_json::json!(77), &serde_json::json!(false)));
    assert!(events_of(&fake, "000000000000feed-42/prefill").is_empty(), "the leg is still running");
    fake.0.borrow_mut().answer = Some(("200".into(), b"{}".to_vec()));
    ctx.on_call_response(101, 2, 2);
    assert_eq!(fake.0.borrow().resumed, 1, "nothing more to resume");
    assert_eq!(events_of(&fake, "000000000000feed-42/prefill"), [LifecycleKind::Done]);
}

#[test]
fn in_a_disaggregated_deployment_a_clients_transfer_fields_never_reach_an_engine() {
    let body = serde_json::json!({"model": "Qwen/Qwen3-0.6B", "messages": [{"role": "user", "content": "hi"}],
        "kv_transfer_params": {"do_remote_prefill": true, "remote_host": "6.6.6.6", "remote_port": 1},
        "bootstrap_host": "6.6.6.6", "bootstrap_room": 1});
    let (mut ctx, fake) = request(&body.to_string(), &[], pd_config());
    send(&mut ctx, &fake);
    let sent = body_json(&fake);
    assert!(sent.get("kv_transfer_params").is_none() && sent.get("bootstrap_host").is_none(), "{sent}");
    // Whatever happens next: here the sidecar is down and Envoy balances the request.
    ctx.on_call_response(1, 0, 0);
    assert_eq!(fake.0.borrow().resumed, 1);
    assert!(body_json(&fake).get("kv_transfer_params").is_none());
    // Trusted clients of a disaggregated deployment keep nothing but the prompt's token ids.
    let trusted = FilterConfig { client_transfer_fields: true, ..pd_config() };
    let (mut ctx, fake) = request(&body.to_string(), &[], trusted);
    send(&mut ctx, &fake);
    assert!(body_json(&fake).get("kv_transfer_params").is_none(), "no ids were sent, nothing is kept");
}

/// A client's `kv_transfer_params.prompt_token_ids` would make vLLM run those ids instead of
/// the `messages` (which a content filter inspected): by default they are taken out before
/// routing, so the request is routed, and run, on its messages.
#[test]
fn a_clients_token_ids_neither_steer_the_route_nor_reach_the_engine() {
    let body = serde_json::json!({"model": "Qwen/Qwen3-0.6B",
        "messages": [{"role": "user", "content": "a question a content filter read and allowed"}],
        "kv_transfer_params": {"prompt_token_ids": [1, 2, 3]}, "bootstrap_host": "6.6.6.6"});
    let prompt_tokens = |fake: &Fake| {
        let s = fake.0.borrow();
        let (_, call) = s.calls.iter().find(|(path, _)| path == "/v1/route").expect("a route call");
        codec::decode::<kvgate_shared::wire::RouteRequest>(call).unwrap().prompt_tokens
    };
    let (mut ctx, fake) = request(&body.to_string(), &[], FilterConfig::default());
    send(&mut ctx, &fake);
    let sent = body_json(&fake);
    assert!(sent.get("kv_transfer_params").is_none() && sent.get("bootstrap_host").is_none(), "{sent}");
    assert!(prompt_tokens(&fake) > 3, "routed on the messages, not the client's ids");
    // An operator who trusts its clients lets them through, and kvgate routes on the ids as
    // the engine will run them.
    let trusted = FilterConfig { client_transfer_fields: true, ..FilterConfig::default() };
    let (mut ctx, fake) = request(&body.to_string(), &[], trusted);
    send(&mut ctx, &fake);
    assert_eq!(body_json(&fake)["kv_transfer_params"]["prompt_token_ids"], serde_json::json!([1, 2, 3]));
    assert_eq!(prompt_tokens(&fake), 3);
}

/// Envoy may answer a paused request itself (a body over its buffer limit, a stream
/// timeout): the response passes, the debug headers say no route was applied, and whatever
/// the sidecar may have booked is released.
#[test]
fn a_request_envoy_answers_while_it_is_paused_still_releases_its_booking() {
    let debug = || FilterConfig { debug_headers: true, ..FilterConfig::default() };
    // While its body is buffering: nothing was asked, nothing is reported.
    let (mut ctx, fake) = request(&chat("hi"), &[], debug());
    assert_eq!(ctx.on_request_headers(false), Action::Pause);
    fake.0.borrow_mut().response_chunk = b"payload too large".to_vec();
    assert_eq!(ctx.on_response_headers(), Action::Continue);
    assert_eq!(ctx.on_response_body(17, true), Action::Continue);
    ctx.on_log();
    assert_eq!(fake.0.borrow().response_headers["x-kvgate-routed-to"], "fallback");
    assert!(fake.0.borrow().calls.is_empty() && kinds(&fake).is_empty());
    // While the sidecar is asked: its booking is released.
    let (mut ctx, fake) = request(&chat("hi"), &[], debug());
    assert_eq!(send(&mut ctx, &fake), Action::Pause);
    fake.0.borrow_mut().response_chunk = b"upstream request timeout".to_vec();
    ctx.on_response_headers();
    ctx.on_response_body(24, true);
    ctx.on_log();
    assert_eq!(fake.0.borrow().response_headers["x-kvgate-routed-to"], "fallback");
    assert_eq!(kinds(&fake).last(), Some(&LifecycleKind::Done));
    assert_eq!(fake.0.borrow().resumed, 0, "Envoy answered it: nothing to resume");
}

fn breaker_config() -> FilterConfig {
    FilterConfig { breaker_failures: 2, breaker_open_ms: 60_000, offload_bytes: 256, ..FilterConfig::default() }
}

fn breaker_state(shared: &Rc<RefCell<Shared>>) -> breaker::State {
    shared.borrow().breaker.state()
}

/// Sends a request in `shared`'s VM up to its call to the sidecar and answers it with
/// `status` (`None`: the call times out); checks that it went on to Envoy (or, shed, was
/// answered 429).
fn fail_or_answer(shared: &Rc<RefCell<Shared>>, body: &str, status: Option<&str>) -> Fake {
    let (mut ctx, fake) = request_in(shared, body, &[]);
    assert_eq!(send(&mut ctx, &fake), Action::Pause, "the sidecar is asked");
    assert_eq!(fake.0.borrow().calls.len(), 1);
    let headers = match status {
        Some(status) => {
            fake.0.borrow_mut().answer = Some((status.into(), b"no".to_vec()));
            2
        }
        None => 0,
    };
    ctx.on_call_response(1, headers, 2);
    let s = fake.0.borrow();
    match status {
        Some("429") => assert_eq!(s.local_reply.as_ref().map(|r| r.0), Some(429), "shed"),
        _ => assert_eq!(s.resumed, 1, "{status:?}: the request goes on"),
    }
    drop(s);
    fake
}

/// Sends a request that the breaker keeps from the sidecar: it goes on at once, unplanned,
/// with no destination header and nothing booked.
fn passed_by_the_breaker(shared: &Rc<RefCell<Shared>>) {
    let (mut ctx, fake) = request_in(shared, &chat("hello while the sidecar hangs"), &[]);
    assert_eq!(send(&mut ctx, &fake), Action::Continue, "not paused for the sidecar");
    assert!(fake.0.borrow().calls.is_empty(), "the sidecar is not asked");
    respond(&mut ctx, &fake, "127.0.0.1:8001", "{}");
    let s = fake.0.borrow();
    assert!(!s.request_headers.contains_key(DESTINATION_HEADER), "Envoy's balancer picks");
    assert!(s.queued.is_empty(), "nothing booked, nothing reported");
}

#[test]
fn once_the_sidecar_keeps_failing_requests_stop_asking_it() {
    // A timed-out route call, then an offloaded body answered 409 (another wire version).
    let shared = shared(breaker_config());
    fail_or_answer(&shared, &chat("hi"), None);
    assert_eq!(breaker_state(&shared), breaker::State::Closed, "one failure");
    let offloaded = fail_or_answer(&shared, &chat(&"many words ".repeat(40)), Some("409"));
    assert_eq!(offloaded.0.borrow().calls[0].0, "/v1/route_body");
    assert_eq!(breaker_state(&shared), breaker::State::Open, "two in a row");
    for _ in 0..3 {
        passed_by_the_breaker(&shared);
    }
    // A call that cannot even be dispatched counts too, and 5xx answers do.
    let shared = crate::shared(breaker_config());
    let (mut ctx, fake) = request_in(&shared, &chat("hi"), &[]);
    fake.0.borrow_mut().dispatch_fails = true;
    assert_eq!(send(&mut ctx, &fake), Action::Continue);
    fail_or_answer(&shared, &chat("hi"), Some("503"));
    assert_eq!(breaker_state(&shared), breaker::State::Open);
    passed_by_the_breaker(&shared);
}

#[test]
fn sheds_and_other_answers_never_open_the_breaker() {
    let shared = shared(breaker_config());
    for status in ["429", "429", "404", "429", "200"] {
        fail_or_answer(&shared, &chat("hi"), Some(status));
        fail_or_answer(&shared, &chat("hi"), None);
        assert_eq!(breaker_state(&shared), breaker::State::Closed, "{status} came between two failures");
    }
    // Unroutable requests are not the sidecar's: they never count, whatever the breaker does.
    for _ in 0..3 {
        let (mut ctx, fake) = request_in(&shared, "{not json", &[]);
        assert_eq!(send(&mut ctx, &fake), Action::Continue);
    }
    assert_eq!(breaker_state(&shared), breaker::State::Closed);
}

/// Opens `shared`'s breaker as if two calls had failed `ago`.
fn opened(shared: &Rc<RefCell<Shared>>, ago: Duration) {
    let then = Instant::now().checked_sub(ago).expect("the clock has run that long");
    let breaker = &mut shared.borrow_mut().breaker;
    for _ in 0..2 {
        let ticket = breaker.admit(then, Duration::from_millis(25)).unwrap();
        breaker.record(ticket, Verdict::Failed, then);
    }
    assert_eq!(breaker.state(), breaker::State::Open);
}

#[test]
fn after_the_window_one_request_probes_and_its_answer_decides() {
    let config = FilterConfig { breaker_open_ms: 1000, ..breaker_config() };
    // The probe is answered: routed, and the breaker closes.
    let shared = shared(config.clone());
    opened(&shared, Duration::from_secs(5));
    let (mut probe, probe_host) = request_in(&shared, &chat("are you back?"), &[]);
    assert_eq!(send(&mut probe, &probe_host), Action::Pause, "the first request after the window probes");
    assert_eq!(probe_host.0.borrow().calls.len(), 1);
    assert_eq!(breaker_state(&shared), breaker::State::HalfOpen);
    passed_by_the_breaker(&shared);
    let size = answer(&probe_host, "200", &routed_to("127.0.0.1:8002"));
    probe.on_call_response(1, 2, size);
    assert_eq!(probe_host.0.borrow().request_headers[DESTINATION_HEADER], "127.0.0.1:8002", "the probe is routed");
    assert_eq!(breaker_state(&shared), breaker::State::Closed);
    let after = fail_or_answer(&shared, &chat("hi"), Some("200"));
    assert_eq!(after.0.borrow().calls.len(), 1, "every request asks again");

    // The probe times out: open again, for twice as long — 1 s after the window it still is.
    let shared = crate::shared(config);
    opened(&shared, Duration::from_secs(2));
    fail_or_answer(&shared, &chat("are you back?"), None);
    assert_eq!(breaker_state(&shared), breaker::State::Open);
    passed_by_the_breaker(&shared);
}
