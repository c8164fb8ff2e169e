//! An OTLP/HTTP trace receiver for tests: `POST /v1/traces` with an `ExportTraceServiceRequest`
//! in protobuf, decoded with the OpenTelemetry project's own message definitions
//! (`opentelemetry-proto`, generated from the official `.proto` files), as a collector's OTLP
//! receiver decodes it. Every span received is kept, flattened, for the test to look at.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use prost::Message;

/// One span as the collector received it; ids in lowercase hex.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedSpan {
    /// The resource's `service.name`.
    pub service: String,
    /// The span's name.
    pub name: String,
    /// Its trace id (32 hex digits).
    pub trace_id: String,
    /// Its span id (16 hex digits).
    pub span_id: String,
    /// Its parent's span id; empty for a root span.
    pub parent_span_id: String,
    /// Its attributes, values as text.
    pub attributes: HashMap<String, String>,
}

/// A receiver on a loopback port, serving until dropped.
pub struct Collector {
    /// Its address.
    pub addr: SocketAddr,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    _runtime: tokio::runtime::Runtime,
}

impl Collector {
    /// Starts a receiver on a free loopback port.
    pub fn start() -> anyhow::Result<Collector> {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let spans = Arc::new(Mutex::new(Vec::new()));
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
        let addr = listener.local_addr()?;
        let app = axum::Router::new().route("/v1/traces", post(export)).with_state(spans.clone());
        runtime.spawn(async move { axum::serve(listener, app).await });
        Ok(Collector { addr, spans, _runtime: runtime })
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The spans of `trace_id`, once `done` says they are all there; an error naming what did
    /// arrive after `timeout`.
    pub fn wait_for_trace(
        &self,
        trace_id: &str,
        timeout: Duration,
        done: impl Fn(&[ReceivedSpan]) -> bool,
    ) -> anyhow::Result<Vec<ReceivedSpan>> {
        let of_trace =
            || -> Vec<ReceivedSpan> { self.spans().into_iter().filter(|s| s.trace_id == trace_id).collect() };
        crate::process::wait_for("the trace's spans", timeout, || {
            let spans = of_trace();
            done(&spans).then_some(spans)
        })
        .map_err(|e| anyhow::anyhow!("{e}; received of trace {trace_id}: {:#?}", of_trace()))
    }
}

/// The trace, one line a span, children under their parent (for reports and failures).
pub fn render_tree(spans: &[ReceivedSpan]) -> String {
    fn walk(spans: &[ReceivedSpan], parent: &str, depth: usize, out: &mut String) {
        for span in spans.iter().filter(|s| s.parent_span_id == parent) {
            let mut attributes: Vec<String> = span.attributes.iter().map(|(k, v)| format!("{k}={v}")).collect();
            attributes.sort();
            out.push_str(&format!(
                "{}{} [{}] span {} {}\n",
                "  ".repeat(depth),
                span.name,
                span.service,
                span.span_id,
                attributes.join(" ")
            ));
            walk(spans, &span.span_id, depth + 1, out);
        }
    }
    let ids: std::collections::HashSet<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
    let mut out = String::new();
    // Roots: spans whose parent was not received (the client's span, or none).
    let mut parents: Vec<&str> = spans.iter().map(|s| s.parent_span_id.as_str()).filter(|p| !ids.contains(p)).collect();
    parents.sort();
    parents.dedup();
    for parent in parents {
        out.push_str(&format!("(parent {})\n", if parent.is_empty() { "none" } else { parent }));
        walk(spans, parent, 1, &mut out);
    }
    out
}

async fn export(State(spans): State<Arc<Mutex<Vec<ReceivedSpan>>>>, body: Bytes) -> Response {
    let request = match ExportTraceServiceRequest::decode(body) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    let mut received = Vec::new();
    for resource_spans in request.resource_spans {
        let service = resource_spans
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|a| a.key == "service.name")
            .map(text)
            .unwrap_or_default();
        for span in resource_spans.scope_spans.into_iter().flat_map(|s| s.spans) {
            received.push(ReceivedSpan {
                service: service.clone(),
                name: span.name,
                trace_id: hex(&span.trace_id),
                span_id: hex(&span.span_id),
                parent_span_id: hex(&span.parent_span_id),
                attributes: span.attributes.iter().map(|a| (a.key.clone(), text(a))).collect(),
            });
        }
    }
    spans.lock().unwrap_or_else(|e| e.into_inner()).extend(received);
    ([(header::CONTENT_TYPE, "application/x-protobuf")], ExportTraceServiceResponse::default().encode_to_vec())
        .into_response()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text(attribute: &KeyValue) -> String {
    match attribute.value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}
