//! The filter's own metrics, in Envoy's stats as `wasmcustom.kvgate.*` (Prometheus:
//! `envoy_wasmcustom_kvgate_*`), per Envoy process.
//!
//! | metric | kind | meaning |
//! |---|---|---|
//! | `kvgate.requests.routed` | counter | the sidecar's choice was applied |
//! | `kvgate.requests.passthrough` | counter | not routable (bad body…): the engine answers |
//! | `kvgate.requests.fallback_timeout` | counter | the sidecar did not answer in time |
//! | `kvgate.requests.fallback_error` | counter | the sidecar failed or answered nonsense |
//! | `kvgate.requests.breaker_open` | counter | not asked about: the circuit breaker was open (or half-open, its probe out), so Envoy's balancer picked |
//! | `kvgate.requests.truncated` | counter | routed on the prompt's head (`max_tokenize_bytes`) |
//! | `kvgate.requests.offloaded` | counter | the body was tokenized by the sidecar (`offload_bytes`) |
//! | `kvgate.requests.tokens_forwarded` | counter | the prompt went upstream as token ids (`forward_tokens`) |
//! | `kvgate.requests.untokenizable` | counter | a request for a routed model whose prompt kvgate cannot read (content parts it does not render, a failing template): routed and booked on an estimate of its size |
//! | `kvgate.prefill_legs.<outcome>` | counter | disaggregated requests' prefill legs: `ok` (vLLM: its KV went to the decode worker; SGLang: it answered), `failed` (an error status, or no `kv_transfer_params` in its answer), `timeout`, `unsent` (no `prefill_cluster`, an endpoint or body a leg cannot carry, or the call could not be made); the request is then served whole on its decode worker |
//! | `kvgate.prefill_leg_us` | histogram | a prefill leg's round trip, µs |
//! | `kvgate.tokenize_us` | histogram | parse + template + tokenize + hash, µs |
//! | `kvgate.sidecar_us` | histogram | the sidecar round trip, µs |
//! | `kvgate.segment_cache.hits` / `.misses` | counter | prompt pieces served / tokenized |
//! | `kvgate.lifecycle.retried` / `.dropped` | counter | lifecycle batches that did not reach the sidecar: kept to send again / given up on |
//! | `kvgate.breaker_state` | gauge | the circuit breaker of the VM that last changed it: 0 closed, 1 open, 2 half-open ([`crate::breaker`]) |
//! | `kvgate.vm_memory_bytes` | gauge | the linear memory of the wasm VM that last answered a routed request (set at its response headers); it never shrinks (every worker's VM runs the same code, so they are alike) |
//! | `kvgate.tokenizer_missing.<model>` | gauge | 1 while the model's tokenizer cannot be loaded (its requests are routed on load alone); defined on the first failure. `<model>` is the name with every character but `[A-Za-z0-9_-]` replaced by `_` |

use proxy_wasm::hostcalls;

use crate::breaker::State;
use crate::host::{MetricSink, RootHost};
use proxy_wasm::types::MetricType;

/// Metric ids, defined once per VM.
#[derive(Debug, Clone, Copy)]
pub struct FilterMetrics {
    routed: u32,
    passthrough: u32,
    fallback_timeout: u32,
    fallback_error: u32,
    breaker_open: u32,
    breaker_state: u32,
    shed: u32,
    truncated: u32,
    offloaded: u32,
    forwarded: u32,
    untokenizable: u32,
    tokenize_us: u32,
    sidecar_us: u32,
    segment_hits: u32,
    segment_misses: u32,
    lifecycle_retried: u32,
    lifecycle_dropped: u32,
    vm_memory: u32,
    legs_ok: u32,
    legs_failed: u32,
    legs_timeout: u32,
    legs_unsent: u32,
    leg_us: u32,
}

/// How a prefill leg went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LegOutcome {
    /// Answered as the protocol expects.
    Ok,
    /// An error status, or an answer the decode request cannot use.
    Failed,
    /// No answer in `prefill_timeout_ms`.
    Timeout,
    /// Not sent.
    Unsent,
}

impl LegOutcome {
    /// The debug header's value.
    pub fn label(self) -> &'static str {
        match self {
            LegOutcome::Ok => "ok",
            LegOutcome::Failed => "failed",
            LegOutcome::Timeout => "timeout",
            LegOutcome::Unsent => "unsent",
        }
    }
}

/// How a request left the filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Routed where the sidecar said.
    Routed,
    /// Not routable; passed through untouched.
    Passthrough,
    /// The sidecar timed out: fallback LB.
    FallbackTimeout,
    /// The sidecar failed: fallback LB.
    FallbackError,
    /// Every replica was saturated and the wait ran out: answered 429 here.
    Shed,
    /// The circuit breaker was open: the sidecar was not asked, fallback LB.
    BreakerOpen,
}

impl FilterMetrics {
    /// Defines the metrics; `None` if the host refuses (metrics are then skipped).
    pub fn define() -> Option<FilterMetrics> {
        let counter = |name: &str| hostcalls::define_metric(MetricType::Counter, name).ok();
        let histogram = |name: &str| hostcalls::define_metric(MetricType::Histogram, name).ok();
        Some(FilterMetrics {
            routed: counter("kvgate.requests.routed")?,
            passthrough: counter("kvgate.requests.passthrough")?,
            fallback_timeout: counter("kvgate.requests.fallback_timeout")?,
            fallback_error: counter("kvgate.requests.fallback_error")?,
            breaker_open: counter("kvgate.requests.breaker_open")?,
            breaker_state: hostcalls::define_metric(MetricType::Gauge, "kvgate.breaker_state").ok()?,
            shed: counter("kvgate.requests.shed")?,
            truncated: counter("kvgate.requests.truncated")?,
            offloaded: counter("kvgate.requests.offloaded")?,
            forwarded: counter("kvgate.requests.tokens_forwarded")?,
            untokenizable: counter("kvgate.requests.untokenizable")?,
            tokenize_us: histogram("kvgate.tokenize_us")?,
            sidecar_us: histogram("kvgate.sidecar_us")?,
            segment_hits: counter("kvgate.segment_cache.hits")?,
            segment_misses: counter("kvgate.segment_cache.misses")?,
            lifecycle_retried: counter("kvgate.lifecycle.retried")?,
            lifecycle_dropped: counter("kvgate.lifecycle.dropped")?,
            vm_memory: hostcalls::define_metric(MetricType::Gauge, "kvgate.vm_memory_bytes").ok()?,
            legs_ok: counter("kvgate.prefill_legs.ok")?,
            legs_failed: counter("kvgate.prefill_legs.failed")?,
            legs_timeout: counter("kvgate.prefill_legs.timeout")?,
            legs_unsent: counter("kvgate.prefill_legs.unsent")?,
            leg_us: histogram("kvgate.prefill_leg_us")?,
        })
    }

    /// Counts a request's outcome.
    pub fn outcome(&self, sink: &impl MetricSink, outcome: Outcome) {
        let id = match outcome {
            Outcome::Routed => self.routed,
            Outcome::Passthrough => self.passthrough,
            Outcome::FallbackTimeout => self.fallback_timeout,
            Outcome::FallbackError => self.fallback_error,
            Outcome::Shed => self.shed,
            Outcome::BreakerOpen => self.breaker_open,
        };
        sink.increment(id, 1);
    }

    /// Sets the circuit breaker's gauge.
    pub fn breaker(&self, sink: &impl MetricSink, state: State) {
        sink.record(self.breaker_state, state.gauge());
    }

    /// Records the planning step.
    pub fn planned(&self, sink: &impl MetricSink, tokenize_us: u64, truncated: bool, hits: u64, misses: u64) {
        sink.record(self.tokenize_us, tokenize_us);
        if truncated {
            sink.increment(self.truncated, 1);
        }
        for (id, n) in [(self.segment_hits, hits), (self.segment_misses, misses)] {
            if n > 0 {
                sink.increment(id, n as i64);
            }
        }
    }

    /// Counts a request whose body was handed to the sidecar to tokenize.
    pub fn offloaded(&self, sink: &impl MetricSink) {
        sink.increment(self.offloaded, 1);
    }

    /// Counts a request routed on an estimate because its prompt could not be read.
    pub fn untokenizable(&self, sink: &impl MetricSink) {
        sink.increment(self.untokenizable, 1);
    }

    /// Counts a request whose prompt was forwarded as token ids.
    pub fn forwarded(&self, sink: &impl MetricSink) {
        sink.increment(self.forwarded, 1);
    }

    /// Counts a lifecycle batch that did not arrive: kept to send again, or dropped.
    pub fn lifecycle_failed(&self, sink: &impl MetricSink, dropped: bool) {
        sink.increment(if dropped { self.lifecycle_dropped } else { self.lifecycle_retried }, 1);
    }

    /// Defines the `kvgate.tokenizer_missing.<model>` gauge.
    pub fn define_tokenizer_missing(host: &impl RootHost, model: &str) -> Option<u32> {
        let name: String =
            model.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect();
        host.define_gauge(&format!("kvgate.tokenizer_missing.{name}"))
    }

    /// Sets a gauge.
    pub fn set_gauge(sink: &impl MetricSink, id: u32, value: u64) {
        sink.record(id, value);
    }

    /// Sets the gauge of this VM's linear memory (0 natively).
    pub fn vm_memory(&self, sink: &impl MetricSink) {
        #[cfg(target_arch = "wasm32")]
        let pages = core::arch::wasm32::memory_size::<0>() as u64;
        #[cfg(not(target_arch = "wasm32"))]
        let pages = 0;
        sink.record(self.vm_memory, pages * 65_536);
    }

    /// Counts a prefill leg's outcome, and its round trip if it was sent.
    pub fn leg(&self, sink: &impl MetricSink, outcome: LegOutcome, micros: Option<u64>) {
        let id = match outcome {
            LegOutcome::Ok => self.legs_ok,
            LegOutcome::Failed => self.legs_failed,
            LegOutcome::Timeout => self.legs_timeout,
            LegOutcome::Unsent => self.legs_unsent,
        };
        sink.increment(id, 1);
        if let Some(micros) = micros {
            sink.record(self.leg_us, micros);
        }
    }

    /// Records the sidecar round trip.
    pub fn sidecar(&self, sink: &impl MetricSink, micros: u64) {
        sink.record(self.sidecar_us, micros);
    }
}
