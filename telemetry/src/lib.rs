//! Traces for kvgate's native processes: spans exported over OTLP, and a request's W3C trace
//! context (`traceparent`, `tracestate`) taken from its headers, so that what a process does
//! about a request is a span of the request's trace. The sidecar's spans are listed in its
//! `api` module; the simulator's `llm_request` span is the one vLLM exports.
//!
//! Off unless an endpoint is given (`--otlp-endpoint` / `--otlp-traces-endpoint`,
//! `OTEL_EXPORTER_OTLP_ENDPOINT`). Spans go out as OTLP/HTTP protobuf (`<endpoint>/v1/traces`)
//! from the batch processor's own thread, with a blocking client: exporting never runs on a
//! request's runtime, and a collector that is down loses spans, not requests. The batch
//! processor honours the standard `OTEL_BSP_*` variables (`OTEL_BSP_SCHEDULE_DELAY`: how long a
//! span may wait, 5 s by default); `OTEL_SERVICE_NAME` overrides the service name.

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use http::HeaderMap;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The instrumentation scope spans carry.
const SCOPE: &str = "kvgate";

/// How long one export may take before its spans are dropped.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Whether spans are exported: what only a trace reads (every candidate's cost) is worth
/// writing down only then.
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

/// Why traces cannot be exported.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    /// The endpoint is not an `http://` or `https://` URL.
    #[error("OTLP endpoint {0:?}: expected http://host:port (spans go to <endpoint>/v1/traces)")]
    Endpoint(String),
    /// The exporter could not be built.
    #[error("OTLP exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    /// The HTTP client could not be built.
    #[error("OTLP HTTP client: {0}")]
    Client(#[from] reqwest::Error),
}

/// The tracer provider exporting to `endpoint` (a base URL: spans are posted to
/// `<endpoint>/v1/traces`, as `OTEL_EXPORTER_OTLP_ENDPOINT` means; a URL ending in
/// `/v1/traces` is taken as it is) as `service`, unless
/// `OTEL_SERVICE_NAME` names it. Call outside any async runtime: its HTTP client is a blocking
/// one. Shut it down at exit to send what is waiting.
pub fn otlp_provider(endpoint: &str, service: &str) -> Result<SdkTracerProvider, TelemetryError> {
    let base = endpoint.trim_end_matches('/');
    if !(base.starts_with("http://") || base.starts_with("https://")) {
        return Err(TelemetryError::Endpoint(endpoint.to_owned()));
    }
    // A traces URL already (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`'s form) is taken as it is.
    let base = base.strip_suffix("/v1/traces").unwrap_or(base);
    let client = BlockingClient(reqwest::blocking::Client::builder().timeout(EXPORT_TIMEOUT).build()?);
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(format!("{base}/v1/traces"))
        .with_timeout(EXPORT_TIMEOUT)
        .with_http_client(client)
        .build()?;
    let name = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| service.to_owned());
    let resource = Resource::builder().with_service_name(name).build();
    let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build();
    EXPORTING.store(true, Ordering::Relaxed);
    Ok(provider)
}

/// [`otlp_provider`] when an endpoint is given; none (spans are not exported) when it is
/// absent or empty, as an unset `OTEL_EXPORTER_OTLP_ENDPOINT` in a manifest is.
pub fn configured(endpoint: Option<&str>, service: &str) -> Result<Option<SdkTracerProvider>, TelemetryError> {
    endpoint.filter(|e| !e.is_empty()).map(|e| otlp_provider(e, service)).transpose()
}

/// The `tracing` layer that turns a process's spans into `provider`'s.
pub fn layer<S>(provider: &SdkTracerProvider) -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
{
    // The span's own fields only: not the source location, target, thread or busy/idle time.
    tracing_opentelemetry::layer()
        .with_tracer(provider.tracer(SCOPE))
        .with_location(false)
        .with_target(false)
        .with_threads(false)
        .with_tracked_inactivity(false)
}

/// Makes `span` a child of the trace context in `headers` (`traceparent`, `tracestate`), when
/// they carry a valid one; otherwise the span starts a trace of its own.
pub fn adopt_parent(span: &tracing::Span, headers: &HeaderMap) {
    if !exporting() || !headers.contains_key("traceparent") {
        return;
    }
    let parent = TraceContextPropagator::new().extract(&Headers(headers));
    // Fails only for a span no layer records, which has no parent to set.
    let _ = span.set_parent(parent);
}

/// Request headers as the propagator reads them.
struct Headers<'a>(&'a HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// The exporter's HTTP client: reqwest's blocking one, which the batch processor's own thread
/// may block on (it is not a runtime thread).
#[derive(Debug)]
struct BlockingClient(reqwest::blocking::Client);

#[async_trait::async_trait]
impl HttpClient for BlockingClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let sent =
            self.0.request(parts.method, parts.uri.to_string()).headers(parts.headers).body(body.to_vec()).send()?;
        let mut response = Response::builder().status(sent.status());
        for (name, value) in sent.headers() {
            response = response.header(name, value);
        }
        Ok(response.body(sent.bytes()?)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_endpoint_or_an_empty_one_exports_nothing() {
        assert!(configured(None, "test").unwrap().is_none());
        assert!(configured(Some(""), "test").unwrap().is_none());
        assert!(!exporting());
    }

    #[test]
    fn an_endpoint_without_a_scheme_is_refused_by_name() {
        let err = otlp_provider("collector:4318", "test").unwrap_err();
        assert!(err.to_string().contains("\"collector:4318\""), "{err}");
        assert!(!exporting(), "nothing is exported after a refusal");
    }
}
