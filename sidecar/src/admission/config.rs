//! `[pools.admission]`: admission control (`crate::admission`).

use std::borrow::Cow;

use anyhow::bail;
use serde::Deserialize;

/// When a replica counts as saturated, from kvgate's own books, and how long requests may
/// wait for one that is not ([`crate::admission`]).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Turns admission control on for the pool.
    #[serde(default)]
    pub enabled: bool,
    /// Each replica's KV cache capacity in blocks (vLLM logs it at start-up, "GPU KV cache
    /// size", and exports it as `num_gpu_blocks` in `vllm:cache_config_info`). 0: learned from
    /// that metric when `engine_metrics_secs` polls the engines, else not a criterion.
    #[serde(default)]
    pub kv_blocks: u64,
    /// A replica is saturated once the blocks booked on it reach this share of `kv_blocks`.
    #[serde(default = "default_kv_fraction")]
    pub kv_fraction: f64,
    /// A replica is saturated once the prefill tokens booked on it (uncached, not yet
    /// computed; with `engine_metrics_secs`, plus the mean booked prefill for each outside
    /// request its engine reports waiting) reach this. 0: not a criterion.
    #[serde(default)]
    pub max_prefill_tokens: u64,
    /// Also trust what the engines say (needs `engine_metrics_secs`): a replica is saturated
    /// while its engine reports `vllm:kv_cache_usage_perc` ≥ `kv_fraction`, or at least
    /// `max_engine_waiting` requests waiting. Those figures are as old as the last poll.
    #[serde(default)]
    pub engine_signals: bool,
    /// With `engine_signals`: waiting requests an engine may report before it counts as
    /// saturated (0: not a criterion).
    #[serde(default)]
    pub max_engine_waiting: u64,
    /// The longest a request waits for capacity before it is shed (the filter's
    /// `admission_wait_ms` bounds it too).
    #[serde(default = "default_max_queue_ms")]
    pub max_queue_ms: u64,
    /// The most requests of a class that wait at once (each class has its own count); one
    /// more is shed at once.
    #[serde(default = "default_max_queued")]
    pub max_queued: usize,
    /// The `Retry-After` a shed request is answered with, in seconds.
    #[serde(default = "default_retry_after")]
    pub retry_after_secs: u32,
    /// Priority classes. A request names its class in the filter's `priority_header` (a
    /// header the operator's own auth filter sets); waiters of a higher `priority` go first,
    /// and each class has its own bounds. None: one class with the bounds above.
    #[serde(default)]
    pub classes: Vec<ClassConfig>,
    /// The class of a request that names none, or an unknown one (default: the lowest).
    #[serde(default)]
    pub default_class: Option<String>,
    /// Fairness between tenants (requests that name one, with the filter's `tenant_header`):
    /// a tenant holding less than its fair share of its class's requests in flight (the
    /// class's requests split evenly over its tenants, at this gateway) goes past its class's
    /// limits by this share of what they leave: a KV fraction `f` becomes `f + h × (1 − f)`, a
    /// prefill backlog `p` becomes `p × (1 + h)`. So a quiet tenant is not held behind a
    /// bursting one's backlog. 0: tenants only take turns in the queue.
    #[serde(default = "default_fair_headroom")]
    pub fair_headroom: f64,
    /// Time to first token the pool's requests should get, in ms (0: none). Once every
    /// candidate's TTFT model predicts (`crate::latency`), a replica predicted to miss what is
    /// left of it (after the request's wait) is not chosen while another is predicted to meet
    /// it; if none is, the request is shed at once when its class is `sheddable`, and
    /// otherwise decided as without an SLO.
    #[serde(default)]
    pub ttft_slo_ms: u64,
    /// Inter-token latency the pool's requests should get — the mean time between their
    /// output tokens — in ms (0: none). A replica whose ITL model predicts more is not chosen
    /// while another is predicted to meet it (and the TTFT SLO, if any); if none is, as for
    /// the TTFT SLO.
    #[serde(default)]
    pub itl_slo_ms: u64,
    /// Whether a request that no replica is predicted to serve within its SLOs is shed at
    /// once (429 with `Retry-After`, outcome `slo`) rather than routed late.
    #[serde(default)]
    pub sheddable: bool,
}

/// One priority class of admission control.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassConfig {
    /// The name requests give in the priority header.
    pub name: String,
    /// Higher goes first.
    #[serde(default)]
    pub priority: i32,
    /// The longest a request of this class waits (default: the pool's `max_queue_ms`).
    #[serde(default)]
    pub max_queue_ms: Option<u64>,
    /// The most requests of this class that wait at once (default: the pool's `max_queued`).
    #[serde(default)]
    pub max_queued: Option<usize>,
    /// The share of a replica's KV cache this class may fill (default: the pool's
    /// `kv_fraction`). A lower share for lower classes keeps headroom for higher ones: a batch
    /// request waits at 70 % while an interactive one still routes until 90 %.
    #[serde(default)]
    pub kv_fraction: Option<f64>,
    /// The prefill backlog this class may add to (default: the pool's `max_prefill_tokens`).
    #[serde(default)]
    pub max_prefill_tokens: Option<u64>,
    /// The class's TTFT SLO in ms (default: the pool's `ttft_slo_ms`; 0: none).
    #[serde(default)]
    pub ttft_slo_ms: Option<u64>,
    /// The class's ITL SLO in ms (default: the pool's `itl_slo_ms`; 0: none).
    #[serde(default)]
    pub itl_slo_ms: Option<u64>,
    /// Whether the class's requests are shed at once when no replica is predicted to meet
    /// their SLO (default: the pool's `sheddable`). Batch traffic that can come back later
    /// is; interactive traffic that would rather be late usually is not.
    #[serde(default)]
    pub sheddable: Option<bool>,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            enabled: false,
            kv_blocks: 0,
            kv_fraction: default_kv_fraction(),
            max_prefill_tokens: 0,
            engine_signals: false,
            max_engine_waiting: 0,
            max_queue_ms: default_max_queue_ms(),
            max_queued: default_max_queued(),
            retry_after_secs: default_retry_after(),
            classes: Vec::new(),
            default_class: None,
            fair_headroom: default_fair_headroom(),
            ttft_slo_ms: 0,
            itl_slo_ms: 0,
            sheddable: false,
        }
    }
}

impl AdmissionConfig {
    /// The classes as configured, or, with none, the one implicit class (`default`), whose
    /// bounds are the pool's.
    pub(crate) fn classes_or_implicit(&self) -> Cow<'_, [ClassConfig]> {
        match self.classes.is_empty() {
            true => Cow::Owned(vec![ClassConfig { name: "default".into(), ..ClassConfig::default() }]),
            false => Cow::Borrowed(&self.classes),
        }
    }

    /// Whether admission control is on and holds some class to an SLO.
    pub(crate) fn has_slo(&self) -> bool {
        self.enabled && self.classes_or_implicit().iter().any(|c| c.has_slo_in(self))
    }

    pub(crate) fn validate(&self, model: &str, engine_metrics_secs: u64) -> anyhow::Result<()> {
        if !self.enabled {
            return Ok(());
        }
        let polled = engine_metrics_secs > 0;
        if self.engine_signals && !polled {
            bail!("pool {model:?}: admission.engine_signals needs engine_metrics_secs > 0 to read the engines");
        }
        let classes = self.classes_or_implicit();
        // Every class must have a criterion: an SLO of its own is one.
        let slo = classes.iter().all(|c| c.has_slo_in(self));
        if self.kv_blocks == 0 && self.max_prefill_tokens == 0 && !polled && !slo {
            bail!(
                "pool {model:?}: admission needs kv_blocks or max_prefill_tokens, or engine_metrics_secs to learn \
                 each engine's KV capacity, to tell when a replica is saturated, or a ttft_slo_ms or itl_slo_ms"
            );
        }
        if let Some(c) = classes.iter().find(|c| c.sheddable_in(self) && !c.has_slo_in(self)) {
            bail!(
                "pool {model:?}: admission class {:?} is sheddable (it sheds requests predicted to miss their SLOs) \
                 but has neither ttft_slo_ms nor itl_slo_ms",
                c.name
            );
        }
        if !(self.kv_fraction > 0.0 && self.kv_fraction <= 1.0) {
            bail!("pool {model:?}: admission.kv_fraction must be in (0, 1], got {}", self.kv_fraction);
        }
        if !(0.0..=1.0).contains(&self.fair_headroom) {
            bail!("pool {model:?}: admission.fair_headroom must be in [0, 1], got {}", self.fair_headroom);
        }
        if let Some(c) = self.classes.iter().find(|c| c.kv_fraction.is_some_and(|f| !(f > 0.0 && f <= 1.0))) {
            bail!("pool {model:?}: admission class {:?}: kv_fraction must be in (0, 1]", c.name);
        }
        if self.classes.iter().any(|c| c.name.is_empty()) {
            bail!("pool {model:?}: an admission class needs a name (requests name it; kvgate_admission is labelled by it)");
        }
        let mut names: Vec<&str> = self.classes.iter().map(|c| c.name.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            bail!("pool {model:?}: admission class {:?} is defined twice", w[0]);
        }
        if let Some(default) = &self.default_class {
            if !names.contains(&default.as_str()) {
                bail!("pool {model:?}: admission.default_class {default:?} is not one of the classes {names:?}");
            }
        }
        Ok(())
    }
}

impl ClassConfig {
    /// Its TTFT SLO in ms in a pool whose admission control is `pool` (0: none).
    pub(crate) fn ttft_slo_ms_in(&self, pool: &AdmissionConfig) -> u64 {
        self.ttft_slo_ms.unwrap_or(pool.ttft_slo_ms)
    }

    /// Its ITL SLO in ms in `pool` (0: none).
    pub(crate) fn itl_slo_ms_in(&self, pool: &AdmissionConfig) -> u64 {
        self.itl_slo_ms.unwrap_or(pool.itl_slo_ms)
    }

    /// Whether it holds its requests to an SLO of either kind in `pool`.
    fn has_slo_in(&self, pool: &AdmissionConfig) -> bool {
        self.ttft_slo_ms_in(pool) > 0 || self.itl_slo_ms_in(pool) > 0
    }

    /// Whether it sheds a request no replica is predicted to serve within its SLO, in `pool`.
    pub(crate) fn sheddable_in(&self, pool: &AdmissionConfig) -> bool {
        self.sheddable.unwrap_or(pool.sheddable)
    }
}

fn default_fair_headroom() -> f64 {
    0.5
}

fn default_kv_fraction() -> f64 {
    0.9
}

fn default_max_queue_ms() -> u64 {
    2000
}

fn default_max_queued() -> usize {
    256
}

fn default_retry_after() -> u32 {
    1
}
