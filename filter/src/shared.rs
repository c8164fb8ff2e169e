//! The state one VM's root context and its HTTP contexts share (one thread, behind an
//! `Rc<RefCell<…>>`): the settings, the loaded models, the lifecycle queue, the metric ids,
//! the circuit breaker. The root context writes it; the HTTP contexts read it, but for the
//! breaker, which their calls to the sidecar feed.

use std::collections::{HashMap, HashSet};

use crate::breaker::Breaker;
use crate::config::FilterConfig;
use crate::metrics::FilterMetrics;
use crate::plan::LoadedModel;

/// State shared by the root and the HTTP contexts of one VM (one thread).
pub struct Shared {
    /// Settings.
    pub config: FilterConfig,
    /// Loaded models by name.
    pub models: HashMap<String, LoadedModel>,
    /// Every model and adapter the sidecar routes, once listed.
    pub listed: Option<HashSet<String>>,
    /// The lifecycle queue id, once registered.
    pub queue: Option<u32>,
    /// Metric ids, once defined.
    pub metrics: Option<FilterMetrics>,
    /// This VM's random tag, the first half of every booking key it generates
    /// ([`crate::plan::booking_id`]).
    pub vm_tag: u64,
    /// Whether requests ask the sidecar (set up from `config` by the root, fed by the
    /// requests' calls).
    pub breaker: Breaker,
    /// Whether this VM has had a request. Envoy runs one VM more than it has workers, on its
    /// main thread, which never gets one: it loads no tokenizer.
    pub serving: bool,
}

/// A random number from the host (WASI `random_get` in Envoy, the OS natively): std's
/// hash-map keys are seeded from it.
pub fn random_tag() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new().build_hasher().finish()
}
