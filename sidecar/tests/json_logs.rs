//! `KVGATE_LOG_FORMAT=json`: the real binary writes one JSON object a line, and what it logs
//! about a request carries the request's id as a field of its own, and its trace id when the
//! call came with the request's `traceparent`.

use std::process::Command;
use std::time::Duration;

use kvgate_e2e::process::{free_port, wait_for, Proc};
use kvgate_shared::codec;
use kvgate_shared::hash::SequenceHash;
use kvgate_shared::wire::{
    LifecycleBatch, LifecycleEvent, LifecycleKind, RouteRequest, CONTENT_TYPE, WIRE_VERSION, WIRE_VERSION_HEADER,
};
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(20);
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn config(port: u16, metrics_port: u16) -> String {
    let tokenizer = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/qwen3-0.6b");
    format!(
        "listen = \"127.0.0.1:{port}\"\nmetrics_listen = \"127.0.0.1:{metrics_port}\"\n[[pools]]\nmodel = \"qwen3\"\n\
         tokenizer = {:?}\nblock_size = 16\n[[pools.replicas]]\nid = \"a\"\nendpoint = \"127.0.0.1:9001\"\n\
         kv_events = \"tcp://127.0.0.1:9001\"\n",
        tokenizer.display().to_string()
    )
}

/// The log's lines that are JSON objects whose `request_id` is `id`.
fn lines_about(log: &str, id: &str) -> Vec<Value> {
    log.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()).filter(|v| v["request_id"] == id).collect()
}

#[test]
fn json_logs_carry_the_request_id_as_a_field() {
    let dir = std::env::temp_dir().join(format!("kvgate-json-logs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("kvgate.toml");
    let (port, metrics_port) = (free_port().unwrap(), free_port().unwrap());
    std::fs::write(&path, config(port, metrics_port)).unwrap();
    let log_path = dir.join("sidecar.log");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvgate-sidecar"));
    cmd.arg("--config").arg(&path).env("KVGATE_LOG_FORMAT", "json").env("RUST_LOG", "info,kvgate_sidecar=debug");
    let _sidecar = Proc::spawn("sidecar", cmd, &log_path).unwrap();
    let client = reqwest::blocking::Client::builder().timeout(Duration::from_secs(5)).build().unwrap();
    let healthy = || {
        let reply = client.get(format!("http://127.0.0.1:{metrics_port}/healthz")).send().ok()?;
        (reply.status() == 200).then_some(())
    };
    wait_for("the sidecar running", WAIT, healthy).unwrap();
    // As the filter sends its calls: with the request's trace context.
    let post = |path: &str, body: Vec<u8>| {
        client
            .post(format!("http://127.0.0.1:{port}{path}"))
            .header("content-type", CONTENT_TYPE)
            .header(WIRE_VERSION_HEADER, WIRE_VERSION)
            .header("traceparent", TRACEPARENT)
            .body(body)
            .send()
            .unwrap()
            .status()
    };

    // A decision, and a report for a request nobody booked.
    let route = RouteRequest::exact("json-routed", "qwen3", 32, 16, vec![SequenceHash(1), SequenceHash(2)]);
    assert_eq!(post("/v1/route", codec::encode(&route).unwrap()), 200);
    let stray = LifecycleEvent { model: "qwen3".into(), request_id: "json-stray".into(), kind: LifecycleKind::Done };
    assert_eq!(post("/v1/lifecycle", codec::encode(&LifecycleBatch { events: vec![stray] }).unwrap()), 204);

    let read = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let routed = wait_for("the decision's line", WAIT, || lines_about(&read(), "json-routed").pop()).unwrap();
    assert_eq!((routed["level"].as_str(), routed["replica"].as_str()), (Some("DEBUG"), Some("a")), "{routed}");
    assert_eq!(routed["message"], "routed", "{routed}");
    assert_eq!(routed["span"]["trace_id"], TRACE_ID, "the line names the request's trace: {routed}");
    let stray = wait_for("the stray report's line", WAIT, || lines_about(&read(), "json-stray").pop()).unwrap();
    assert_eq!((stray["kind"].as_str(), stray["model"].as_str()), (Some("done"), Some("qwen3")), "{stray}");

    // Everything the process wrote, start-up included, is one JSON object a line.
    let log = read();
    assert!(log.lines().count() > 2, "{log}");
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        let parsed: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(parsed["timestamp"].is_string() && parsed["message"].is_string(), "{line}");
    }
}
