//! The filter's own metrics, in Envoy's stats. Their dimensions are tags in Istio's
//! convention: a stat is named `tag=.=value;.;…<name>`, and each tag is pulled out of the name
//! by a `stats_tags` regex `(tag=\.=(.*?);\.;)` (every deploy path configures `model`,
//! `outcome` and `vm`; on Istio they are `extraStatTags`). Envoy's `/stats/prometheus` drops
//! the `wasmcustom.` namespace it files them under and adds no `envoy_` prefix, so Prometheus
//! reads, for example, `kvgate_requests_total{model="m",outcome="routed"}` (a test scrapes
//! it with a real Prometheus: `tests/tests/metrics.rs`); without the tag regexes the
//! dimensions stay in the name.
//!
//! | metric (Prometheus) | kind | tags | meaning |
//! |---|---|---|---|
//! | `kvgate_requests_total` | counter | model, outcome | how a request left the filter: `routed` (the sidecar's choice applied), `passthrough` (not routable: bad body, unknown model…; the engine answers), `fallback_timeout` / `fallback_error` (the sidecar did not answer in time / failed or answered nonsense: Envoy's balancer picked), `shed` (every replica saturated, or none predicted to meet the request's TTFT SLO: answered 429 here), `breaker_open` (not asked: the circuit breaker was open, or half-open with its probe out), `refused` (a body that may carry `kv_transfer_params` or `bootstrap_*` and that kvgate cannot read to take them out: answered 400 here) |
//! | `kvgate_requests_truncated_total` | counter | model | routed on the prompt's head (`max_tokenize_bytes`) |
//! | `kvgate_requests_offloaded_total` | counter | model | the body was tokenized by the sidecar (above `offload_bytes`, or no tokenizer for its model in this worker) |
//! | `kvgate_requests_tokens_forwarded_total` | counter | model | the prompt went upstream as token ids (`forward_tokens`) |
//! | `kvgate_requests_untokenizable_total` | counter | model | a request for a routed model whose prompt kvgate cannot read (content parts it does not render, a failing template): routed and booked on an estimate of its size |
//! | `kvgate_prefill_legs_total` | counter | model, outcome | disaggregated requests' prefill legs: `ok` (vLLM: its KV went to the decode worker; SGLang: it answered), `failed` (an error status, or no `kv_transfer_params` in its answer), `timeout`, `unsent` (no `prefill_cluster`, an endpoint or body a leg cannot carry, or the call could not be made); the request is then served whole on its decode worker |
//! | `kvgate_prefill_leg_us` | histogram | | a prefill leg's round trip, microseconds |
//! | `kvgate_tokenize_us` | histogram | | parse + template + tokenize + hash, microseconds |
//! | `kvgate_sidecar_us` | histogram | | the sidecar round trip, microseconds |
//! | `kvgate_segment_cache_hits_total` | counter | | prompt pieces served from the segment cache |
//! | `kvgate_segment_cache_misses_total` | counter | | prompt pieces tokenized |
//! | `kvgate_lifecycle_batches_total` | counter | outcome | lifecycle batches that did not reach the sidecar: `retried` (kept to send again) / `dropped` (given up on) |
//! | `kvgate_breaker_state` | gauge | vm | each VM's circuit breaker: 0 closed, 1 open, 2 half-open ([`crate::breaker`]) |
//! | `kvgate_vm_memory_bytes` | gauge | vm | each VM's linear memory, set at its routed responses' headers; it never shrinks |
//! | `kvgate_tokenizer_missing` | gauge | model | 1 while the model's tokenizer cannot be loaded (the sidecar tokenizes its requests); defined on the first failure |
//!
//! `model` is the request's model if the sidecar lists it (so a client cannot mint series),
//! else `other`; each character but `[A-Za-z0-9_.:/-]` is replaced by `_`. `vm` tells apart the
//! VMs of one Envoy process (one per worker): a random tag each VM draws at its start (no
//! host call numbers workers); a VM shut down (a reload) sets its gauges to 0, so sums over
//! `vm` stay true.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use proxy_wasm::types::MetricType;

use crate::breaker::State;
use crate::host::MetricSink;

/// The `model` tag of a request whose model the sidecar does not list (or that has none).
pub const OTHER_MODEL: &str = "other";

/// The most models one VM keeps series for; later ones count as [`OTHER_MODEL`].
const MAX_MODELS: usize = 256;

/// `name` with `tags`, in the form the `stats_tags` regexes take apart.
///
/// ```
/// use kvgate_filter::metrics::tagged;
/// assert_eq!(tagged("kvgate.requests_total", &[("model", "m"), ("outcome", "routed")]),
///            "model=.=m;.;outcome=.=routed;.;kvgate.requests_total");
/// ```
pub fn tagged(name: &str, tags: &[(&str, &str)]) -> String {
    let mut out = String::new();
    for (tag, value) in tags {
        out.push_str(&format!("{tag}=.={value};.;"));
    }
    out.push_str(name);
    out
}

/// A model name as a tag value: every character but `[A-Za-z0-9_.:/-]` becomes `_` (a `;`
/// or `=` would end the tag early).
///
/// ```
/// assert_eq!(kvgate_filter::metrics::tag_value("Qwen/Qwen3-0.6B;x=y"), "Qwen/Qwen3-0.6B_x_y");
/// ```
pub fn tag_value(model: &str) -> String {
    let keep = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '/' | '-');
    model.chars().map(|c| if keep(c) { c } else { '_' }).collect()
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
    const ALL: [LegOutcome; 4] = [LegOutcome::Ok, LegOutcome::Failed, LegOutcome::Timeout, LegOutcome::Unsent];

    /// The debug header's value, and the metric's `outcome` tag.
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
    /// Shed by the sidecar (every replica saturated and the wait ran out, or none predicted
    /// to meet the request's TTFT SLO): answered 429 here.
    Shed,
    /// The circuit breaker was open: the sidecar was not asked, fallback LB.
    BreakerOpen,
    /// The body may carry fields only kvgate sets, and kvgate could not take them out:
    /// answered 400 here.
    Refused,
}

impl Outcome {
    const ALL: [Outcome; 7] = [
        Outcome::Routed,
        Outcome::Passthrough,
        Outcome::FallbackTimeout,
        Outcome::FallbackError,
        Outcome::Shed,
        Outcome::BreakerOpen,
        Outcome::Refused,
    ];

    /// The metric's `outcome` tag.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Routed => "routed",
            Outcome::Passthrough => "passthrough",
            Outcome::FallbackTimeout => "fallback_timeout",
            Outcome::FallbackError => "fallback_error",
            Outcome::Shed => "shed",
            Outcome::BreakerOpen => "breaker_open",
            Outcome::Refused => "refused",
        }
    }
}

/// Something counted per request on the side of its outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flag {
    /// Routed on the prompt's head.
    Truncated,
    /// Tokenized by the sidecar.
    Offloaded,
    /// The prompt went upstream as token ids.
    TokensForwarded,
    /// Routed on an estimate of its size.
    Untokenizable,
}

impl Flag {
    const ALL: [Flag; 4] = [Flag::Truncated, Flag::Offloaded, Flag::TokensForwarded, Flag::Untokenizable];

    fn name(self) -> &'static str {
        match self {
            Flag::Truncated => "kvgate.requests_truncated_total",
            Flag::Offloaded => "kvgate.requests_offloaded_total",
            Flag::TokensForwarded => "kvgate.requests_tokens_forwarded_total",
            Flag::Untokenizable => "kvgate.requests_untokenizable_total",
        }
    }
}

/// One model's series.
#[derive(Debug, Clone, Copy)]
struct ModelIds {
    outcomes: [u32; Outcome::ALL.len()],
    flags: [u32; Flag::ALL.len()],
    legs: [u32; LegOutcome::ALL.len()],
}

impl ModelIds {
    fn define(sink: &impl MetricSink, model: &str) -> Option<ModelIds> {
        let counter = |name: &str, outcome: Option<&str>| {
            let tags: Vec<(&str, &str)> =
                [("model", model)].into_iter().chain(outcome.map(|o| ("outcome", o))).collect();
            sink.define(MetricType::Counter, &tagged(name, &tags))
        };
        let mut ids = ModelIds {
            outcomes: [0; Outcome::ALL.len()],
            flags: [0; Flag::ALL.len()],
            legs: [0; LegOutcome::ALL.len()],
        };
        for (id, outcome) in ids.outcomes.iter_mut().zip(Outcome::ALL) {
            *id = counter("kvgate.requests_total", Some(outcome.label()))?;
        }
        for (id, flag) in ids.flags.iter_mut().zip(Flag::ALL) {
            *id = counter(flag.name(), None)?;
        }
        for (id, outcome) in ids.legs.iter_mut().zip(LegOutcome::ALL) {
            *id = counter("kvgate.prefill_legs_total", Some(outcome.label()))?;
        }
        Some(ids)
    }
}

/// The series of one VM: those without a model defined at once, each model's on its first
/// request. Cloned into every request's settings (it is one `Rc`).
#[derive(Debug, Clone)]
pub struct FilterMetrics(Rc<Inner>);

#[derive(Debug)]
struct Inner {
    vm: String,
    breaker_state: u32,
    vm_memory: u32,
    tokenize_us: u32,
    sidecar_us: u32,
    leg_us: u32,
    segment_hits: u32,
    segment_misses: u32,
    lifecycle_retried: u32,
    lifecycle_dropped: u32,
    /// By tag value; `None`: the host refused to define them.
    models: RefCell<HashMap<String, Option<ModelIds>>>,
}

impl FilterMetrics {
    /// Defines the series without a model for the VM tagged `vm`; `None` if the host refuses
    /// (metrics are then skipped).
    pub fn define(sink: &impl MetricSink, vm: &str) -> Option<FilterMetrics> {
        let vm = vm.to_owned();
        let counter = |name: &str| sink.define(MetricType::Counter, name);
        let histogram = |name: &str| sink.define(MetricType::Histogram, name);
        let per_vm = |name: &str| sink.define(MetricType::Gauge, &tagged(name, &[("vm", &vm)]));
        let lifecycle = |outcome: &str| {
            sink.define(MetricType::Counter, &tagged("kvgate.lifecycle_batches_total", &[("outcome", outcome)]))
        };
        Some(FilterMetrics(Rc::new(Inner {
            breaker_state: per_vm("kvgate.breaker_state")?,
            vm_memory: per_vm("kvgate.vm_memory_bytes")?,
            tokenize_us: histogram("kvgate.tokenize_us")?,
            sidecar_us: histogram("kvgate.sidecar_us")?,
            leg_us: histogram("kvgate.prefill_leg_us")?,
            segment_hits: counter("kvgate.segment_cache_hits_total")?,
            segment_misses: counter("kvgate.segment_cache_misses_total")?,
            lifecycle_retried: lifecycle("retried")?,
            lifecycle_dropped: lifecycle("dropped")?,
            models: RefCell::new(HashMap::new()),
            vm,
        })))
    }

    /// The series of `model` (`None`: [`OTHER_MODEL`]), defined on first use.
    fn model(&self, sink: &impl MetricSink, model: Option<&str>) -> Option<ModelIds> {
        let mut models = self.0.models.borrow_mut();
        let mut key = model.map_or_else(|| OTHER_MODEL.to_owned(), tag_value);
        if !models.contains_key(&key) && models.len() >= MAX_MODELS {
            key = OTHER_MODEL.to_owned();
        }
        *models.entry(key).or_insert_with_key(|key| ModelIds::define(sink, key))
    }

    /// Counts a request's outcome.
    pub fn outcome(&self, sink: &impl MetricSink, model: Option<&str>, outcome: Outcome) {
        if let Some(ids) = self.model(sink, model) {
            let at = Outcome::ALL.iter().position(|o| *o == outcome).unwrap_or_default();
            sink.increment(ids.outcomes[at], 1);
        }
    }

    /// Counts a request's `flag`.
    pub fn flag(&self, sink: &impl MetricSink, model: Option<&str>, flag: Flag) {
        if let Some(ids) = self.model(sink, model) {
            let at = Flag::ALL.iter().position(|f| *f == flag).unwrap_or_default();
            sink.increment(ids.flags[at], 1);
        }
    }

    /// Sets this VM's circuit breaker gauge.
    pub fn breaker(&self, sink: &impl MetricSink, state: State) {
        sink.record(self.0.breaker_state, state.gauge());
    }

    /// Records the planning step.
    pub fn planned(&self, sink: &impl MetricSink, tokenize_us: u64, hits: u64, misses: u64) {
        sink.record(self.0.tokenize_us, tokenize_us);
        for (id, n) in [(self.0.segment_hits, hits), (self.0.segment_misses, misses)] {
            if n > 0 {
                sink.increment(id, n as i64);
            }
        }
    }

    /// Counts a lifecycle batch that did not arrive: kept to send again, or dropped.
    pub fn lifecycle_failed(&self, sink: &impl MetricSink, dropped: bool) {
        sink.increment(if dropped { self.0.lifecycle_dropped } else { self.0.lifecycle_retried }, 1);
    }

    /// Defines the `tokenizer_missing` gauge of `model`.
    pub fn define_tokenizer_missing(sink: &impl MetricSink, model: &str) -> Option<u32> {
        sink.define(MetricType::Gauge, &tagged("kvgate.tokenizer_missing", &[("model", &tag_value(model))]))
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
        sink.record(self.0.vm_memory, pages * 65_536);
    }

    /// The VM is shutting down: its gauges go to 0, so that sums over VMs stay true.
    pub fn shut_down(&self, sink: &impl MetricSink) {
        sink.record(self.0.vm_memory, 0);
        sink.record(self.0.breaker_state, 0);
    }

    /// This VM's `vm` tag.
    pub fn vm(&self) -> &str {
        &self.0.vm
    }

    /// Counts a prefill leg's outcome, and its round trip if it was sent.
    pub fn leg(&self, sink: &impl MetricSink, model: Option<&str>, outcome: LegOutcome, micros: Option<u64>) {
        if let Some(ids) = self.model(sink, model) {
            let at = LegOutcome::ALL.iter().position(|o| *o == outcome).unwrap_or_default();
            sink.increment(ids.legs[at], 1);
        }
        if let Some(micros) = micros {
            sink.record(self.0.leg_us, micros);
        }
    }

    /// Records the sidecar round trip.
    pub fn sidecar(&self, sink: &impl MetricSink, micros: u64) {
        sink.record(self.0.sidecar_us, micros);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// A host that names each metric it defines, and sums what is counted.
    #[derive(Default)]
    struct Sink {
        names: RefCell<Vec<String>>,
        counts: RefCell<HashMap<u32, i64>>,
    }

    impl MetricSink for Sink {
        fn define(&self, _: MetricType, name: &str) -> Option<u32> {
            let mut names = self.names.borrow_mut();
            names.push(name.to_owned());
            Some(names.len() as u32 - 1)
        }
        fn increment(&self, id: u32, by: i64) {
            *self.counts.borrow_mut().entry(id).or_default() += by;
        }
        fn record(&self, _: u32, _: u64) {}
    }

    impl Sink {
        fn count(&self, name: &str) -> i64 {
            let names = self.names.borrow();
            let id = names.iter().position(|n| n == name).unwrap_or_else(|| panic!("{name} not defined: {names:?}"));
            self.counts.borrow().get(&(id as u32)).copied().unwrap_or(0)
        }
    }

    #[test]
    fn outcomes_are_counted_per_model_under_one_name() {
        let sink = Sink::default();
        let m = FilterMetrics::define(&sink, "3").unwrap();
        m.outcome(&sink, Some("org/m.1"), Outcome::Routed);
        m.outcome(&sink, Some("org/m.1"), Outcome::Routed);
        m.outcome(&sink, None, Outcome::Passthrough);
        m.leg(&sink, Some("org/m.1"), LegOutcome::Timeout, Some(10));
        assert_eq!(sink.count("model=.=org/m.1;.;outcome=.=routed;.;kvgate.requests_total"), 2);
        assert_eq!(sink.count("model=.=other;.;outcome=.=passthrough;.;kvgate.requests_total"), 1);
        assert_eq!(sink.count("model=.=org/m.1;.;outcome=.=timeout;.;kvgate.prefill_legs_total"), 1);
        assert!(sink.names.borrow().contains(&"vm=.=3;.;kvgate.vm_memory_bytes".to_owned()));
    }

    #[test]
    fn every_series_defined_is_in_the_modules_table() {
        let sink = Sink::default();
        let m = FilterMetrics::define(&sink, "0").unwrap();
        m.outcome(&sink, Some("m"), Outcome::Routed);
        FilterMetrics::define_tokenizer_missing(&sink, "m").unwrap();
        let table = include_str!("metrics.rs");
        for name in sink.names.borrow().iter() {
            let untagged = name.rsplit(";.;").next().unwrap();
            let prometheus = untagged.replace('.', "_");
            assert!(table.contains(&format!("//! | `{prometheus}` |")), "{name} ({prometheus}) is not in the table");
        }
    }

    #[test]
    fn a_model_is_defined_once_and_their_number_is_bounded() {
        let sink = Sink::default();
        let m = FilterMetrics::define(&sink, "0").unwrap();
        let fixed = sink.names.borrow().len();
        let per_model = Outcome::ALL.len() + Flag::ALL.len() + LegOutcome::ALL.len();
        m.outcome(&sink, Some("a"), Outcome::Routed);
        m.flag(&sink, Some("a"), Flag::Offloaded);
        assert_eq!(sink.names.borrow().len(), fixed + per_model, "one model's series, defined at its first use");
        for i in 0..MAX_MODELS + 10 {
            m.outcome(&sink, Some(&format!("m{i}")), Outcome::Routed);
        }
        assert_eq!(sink.names.borrow().len(), fixed + per_model * (MAX_MODELS + 1), "then `other`'s, and no more");
        assert_eq!(sink.count("model=.=other;.;outcome=.=routed;.;kvgate.requests_total"), 11);
    }
}
