//! The root context (one per Envoy worker VM): loads tokenizers from the sidecar and sends
//! lifecycle reports in batches.
//!
//! - **Tokenizers.** On configure, and every `models_refresh_ms` after that (every tick until
//!   the first list arrives), it asks the sidecar for its models and LoRA adapters
//!   (`GET /v1/models`) and, once the VM has had its first request (Envoy's main-thread VM,
//!   which never does, loads none: loading one peaks at several times what it keeps), fetches
//!   each missing bundle (`GET /v1/models/{model}/tokenizer`, the name percent-encoded) of the
//!   models `envoy_tokenizers` wants here. Until a model is loaded — and always, for a model
//!   not wanted here — its requests go whole to the sidecar, which tokenizes them; they are
//!   never held back. A fetch that fails is logged with the model and the cause,
//!   shows in the gauge `kvgate.tokenizer_missing` tagged with the model (1 while missing) and is retried
//!   with exponential backoff ([`crate::fetches`]).
//!   An adapter shares its base model's tokenizer; adapters (and models) the sidecar no longer
//!   lists are dropped, so their requests pass through again.
//! - **Lifecycle.** HTTP contexts push reports onto a shared queue; the root drains it when
//!   Envoy signals the queue and on every tick, and POSTs one batch. (Calls made from a dying
//!   HTTP context are cancelled by Envoy, so they must not send them themselves.) A batch
//!   that does not arrive is sent again with backoff ([`crate::redelivery`]).
//! - **The circuit breaker** ([`crate::breaker`]) is the request path's: while it is open,
//!   the model list, tokenizer fetches and lifecycle batches go on with their own backoff
//!   (they hold no request, and bookings made before it opened are still released), and they
//!   do not count toward it; but a model list answered while it is open ends its window, so
//!   the next request probes a sidecar that is back within one refresh.
//!
//! The logic runs against a [`RootHost`] (Envoy in production), so it is tested natively
//! (`filter/tests/root_context.rs`); only the proxy-wasm entry points at the bottom are
//! Envoy's alone.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::time::{Duration, SystemTime};

use kvgate_shared::codec;
use kvgate_shared::hash::Salt;
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::wire::{tokenizer_path, Adapter, LifecycleBatch, LifecycleEvent, ModelBundle, ModelList};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType};

use crate::breaker::Breaker;
use crate::config::{EnvoyTokenizers, FilterConfig};
use crate::fetches::Fetches;
use crate::host::{Envoy, RootHost};
use crate::http::RequestContext;
use crate::metrics::FilterMetrics;
use crate::plan::LoadedModel;
use crate::redelivery::Redelivery;
use crate::shared::{random_tag, Shared};

/// Name of the shared queue carrying encoded [`LifecycleEvent`]s.
pub const LIFECYCLE_QUEUE: &str = "kvgate_lifecycle";

enum Call {
    Models,
    Tokenizer(String),
    /// A lifecycle batch: its body and how many times it has been sent.
    Lifecycle(Vec<u8>, u32),
}

/// The root context.
pub struct Root<H: RootHost = Envoy> {
    host: H,
    shared: Rc<RefCell<Shared>>,
    calls: HashMap<u32, Call>,
    fetches: Fetches,
    /// Lifecycle batches to send again.
    redelivery: Redelivery,
    /// When the model list was last applied (`None`: never).
    listed_at: Option<SystemTime>,
    /// The base models of the last list, whose tokenizers the filter loads.
    base_models: Vec<String>,
    adapters: Vec<Adapter>,
    /// Each model's `kvgate.tokenizer_missing` gauge id, defined on its first failure.
    missing_gauges: HashMap<String, u32>,
    /// Whether tokenizers are fetched: from the first tick after this VM's first request.
    fetching: bool,
}

impl Root<Envoy> {
    /// A root in Envoy with default settings until `on_configure`.
    pub fn new() -> Root {
        Root::with_host(Envoy)
    }
}

impl<H: RootHost> Root<H> {
    /// A root on `host` with default settings until [`Root::configure`].
    pub fn with_host(host: H) -> Root<H> {
        Root {
            host,
            shared: Rc::new(RefCell::new(Shared {
                config: FilterConfig::default(),
                models: HashMap::new(),
                listed: None,
                queue: None,
                metrics: None,
                vm_tag: random_tag(),
                breaker: Breaker::new(FilterConfig::default().breaker_limits()),
                serving: false,
            })),
            calls: HashMap::new(),
            fetches: Fetches::default(),
            redelivery: Redelivery::default(),
            listed_at: None,
            base_models: Vec::new(),
            adapters: Vec::new(),
            missing_gauges: HashMap::new(),
            fetching: false,
        }
    }

    /// What the HTTP contexts of this VM share with the root.
    pub fn shared(&self) -> Rc<RefCell<Shared>> {
        self.shared.clone()
    }

    /// Applies a parsed configuration, with the lifecycle queue and metrics the host gave,
    /// and asks the sidecar for its models.
    pub fn configure(&mut self, config: FilterConfig, queue: Option<u32>, metrics: Option<FilterMetrics>) {
        {
            let mut s = self.shared.borrow_mut();
            s.breaker = Breaker::new(config.breaker_limits());
            s.config = config;
            s.queue = queue;
            s.metrics = metrics;
        }
        self.refresh_models();
    }

    /// A request reached this VM (an HTTP context is being made): on the first, the next tick
    /// comes at once and fetches the tokenizers. Returns whether it was the first.
    pub fn request_arrived(&self) -> bool {
        let first = !std::mem::replace(&mut self.shared.borrow_mut().serving, true);
        if first {
            self.host.set_tick_period(Duration::from_millis(1));
        }
        first
    }

    /// The periodic tick: the model list when due, tokenizers due a retry, lifecycle reports.
    pub fn tick(&mut self) {
        if !self.fetching && self.shared.borrow().serving {
            // The tick hurried by the first request: back to the configured period.
            self.fetching = true;
            self.host.set_tick_period(Duration::from_millis(self.shared.borrow().config.retry_ms));
        }
        self.refresh_models();
        self.fetch_tokenizers();
        self.flush_lifecycle();
    }

    /// Where the sidecar is: its cluster, its authority, and how long a call to it may take.
    fn sidecar(&self) -> (String, String, Duration) {
        let c = &self.shared.borrow().config;
        (c.sidecar_cluster.clone(), c.sidecar_authority.clone(), Duration::from_millis(c.fetch_timeout_ms))
    }

    fn get(&mut self, path: &str, call: Call) {
        let (cluster, authority, timeout) = self.sidecar();
        match self.host.get(&cluster, path, &authority, timeout) {
            Ok(token) => {
                self.calls.insert(token, call);
            }
            Err(status) => {
                log::warn!("kvgate: GET {path} to {cluster} failed to dispatch: {status:?}");
                if let Call::Tokenizer(model) = call {
                    self.tokenizer_failed(&model, format!("cannot reach cluster {cluster:?}: {status:?}"));
                }
            }
        }
    }

    /// Says, once, which models `envoy_tokenizers` names that the sidecar does not route as
    /// base models (a misspelt name, an adapter): their tokenizers are never loaded here.
    fn name_unknown_tokenizers(&self, base_models: &[String]) {
        let shared = self.shared.borrow();
        let EnvoyTokenizers::Only(named) = &shared.config.envoy_tokenizers else { return };
        let unknown: Vec<&String> = named.iter().filter(|m| !base_models.contains(m)).collect();
        if !unknown.is_empty() {
            log::warn!(
                "kvgate: envoy_tokenizers names {unknown:?}, which the sidecar does not route as base models \
                 (it routes {base_models:?}); requests for models not named are tokenized by the sidecar"
            );
        }
    }

    /// Fetches the tokenizers of listed models that are wanted in Envoy (`envoy_tokenizers`),
    /// not loaded and not backing off, once
    /// this VM serves requests: a tokenizer's load peaks at several times what it keeps, and
    /// a VM's memory never shrinks, so a VM that never routes (Envoy's main thread's) loads none.
    fn fetch_tokenizers(&mut self) {
        if !self.fetching {
            return;
        }
        let due = {
            let shared = self.shared.borrow();
            let here = &shared.config.envoy_tokenizers;
            let wanted = self
                .base_models
                .iter()
                .map(String::as_str)
                .filter(|m| here.wants(m) && !shared.models.contains_key(*m));
            self.fetches.due(wanted, self.host.now())
        };
        for model in due {
            self.get(&tokenizer_path(&model), Call::Tokenizer(model));
        }
    }

    /// A tokenizer fetch failed: says so (log line, gauge) and backs off.
    fn tokenizer_failed(&mut self, model: &str, cause: String) {
        let retry = Duration::from_millis(self.shared.borrow().config.retry_ms);
        let wait = self.fetches.failed(model, cause.clone(), retry, self.host.now());
        log::warn!(
            "kvgate: no tokenizer for model {model:?} ({cause}); the sidecar tokenizes its requests; retrying in {} ms",
            wait.as_millis()
        );
        self.set_missing_gauge(model, true);
    }

    fn set_missing_gauge(&mut self, model: &str, missing: bool) {
        if !self.missing_gauges.contains_key(model) {
            if !missing {
                return;
            }
            match FilterMetrics::define_tokenizer_missing(&self.host, model) {
                Some(id) => self.missing_gauges.insert(model.to_owned(), id),
                None => return,
            };
        }
        if let Some(id) = self.missing_gauges.get(model) {
            FilterMetrics::set_gauge(&self.host, *id, u64::from(missing));
        }
    }

    fn refresh_models(&mut self) {
        let every = Duration::from_millis(self.shared.borrow().config.models_refresh_ms);
        let due = match self.listed_at {
            None => true,
            Some(at) => self.host.now().duration_since(at).is_ok_and(|age| age >= every),
        };
        if due && !self.calls.values().any(|c| matches!(c, Call::Models)) {
            self.get("/v1/models", Call::Models);
        }
    }

    /// Sends the queued lifecycle reports as one batch, and the batches due to be sent again.
    pub fn flush_lifecycle(&mut self) {
        let Some(queue) = self.shared.borrow().queue else { return };
        let mut batch = LifecycleBatch::default();
        while let Some(item) = self.host.dequeue(queue) {
            if let Ok(event) = codec::decode::<LifecycleEvent>(&item) {
                batch.events.push(event);
            }
        }
        if !batch.events.is_empty() {
            if let Ok(body) = codec::encode(&batch) {
                self.post_lifecycle(body, 1);
            }
        }
        for again in self.redelivery.due(self.host.now()) {
            self.post_lifecycle(again.body, again.attempts + 1);
        }
    }

    /// POSTs one lifecycle batch (its `attempt`-th send); a failure keeps it for later.
    fn post_lifecycle(&mut self, body: Vec<u8>, attempt: u32) {
        let (cluster, authority, timeout) = self.sidecar();
        match self.host.dispatch(&cluster, "/v1/lifecycle", &authority, &[], &body, timeout) {
            Ok(token) => {
                self.calls.insert(token, Call::Lifecycle(body, attempt));
            }
            Err(status) => self.lifecycle_failed(body, attempt, &format!("not dispatched: {status:?}")),
        }
    }

    /// A lifecycle batch did not arrive: it is sent again later (see [`crate::redelivery`]).
    fn lifecycle_failed(&mut self, body: Vec<u8>, attempt: u32, cause: &str) {
        let retry = Duration::from_millis(self.shared.borrow().config.retry_ms);
        let kept = self.redelivery.failed(body, attempt, retry, self.host.now());
        if kept {
            log::debug!("kvgate: lifecycle batch {cause}; sending it again later (send {attempt})");
        } else {
            log::warn!(
                "kvgate: lifecycle batch {cause} after {attempt} sends; dropped (bookings expire on the sidecar)"
            );
        }
        if let Some(m) = &self.shared.borrow().metrics {
            m.lifecycle_failed(&self.host, !kept);
        }
    }

    fn on_models(&mut self, body: &[u8]) {
        let Ok(list) = codec::decode::<ModelList>(body) else {
            log::warn!("kvgate: undecodable model list from the sidecar");
            return;
        };
        let first = self.listed_at.replace(self.host.now()).is_none();
        // The sidecar is answering: an open breaker lets the next request probe it now.
        {
            let mut shared = self.shared.borrow_mut();
            let before = shared.breaker.state();
            shared.breaker.sidecar_answered();
            let after = shared.breaker.state();
            if after != before {
                log::info!("kvgate: the sidecar answers the model list; the next request probes it");
                if let Some(m) = &shared.metrics {
                    m.breaker(&self.host, after);
                }
            }
        }
        let names: HashSet<String> =
            list.models.iter().cloned().chain(list.adapters.iter().map(|a| a.name.clone())).collect();
        self.fetches.retain(|m| names.contains(m));
        // A model no longer listed is not missing any more.
        for (model, id) in &self.missing_gauges {
            if !names.contains(model) {
                FilterMetrics::set_gauge(&self.host, *id, 0);
            }
        }
        {
            let mut shared = self.shared.borrow_mut();
            shared.models.retain(|name, _| names.contains(name));
            shared.listed = Some(names);
        }
        if first {
            self.name_unknown_tokenizers(&list.models);
        }
        self.adapters = list.adapters;
        self.base_models = list.models;
        self.link_adapters();
        self.fetch_tokenizers();
    }

    fn on_tokenizer(&mut self, model: String, body: &[u8]) {
        let budget = self.shared.borrow().config.segment_cache_bytes;
        let started = std::time::Instant::now();
        let loaded = codec::decode::<ModelBundle>(body).map_err(|e| e.to_string()).and_then(|bundle| {
            let tokenizer = ModelTokenizer::from_bundle(&bundle).map_err(|e| e.to_string())?;
            Ok((bundle.block_size, tokenizer.with_segment_cache(budget)))
        });
        match loaded {
            Ok((block_size, tokenizer)) if block_size > 0 => {
                let ms = started.elapsed().as_millis();
                log::info!("kvgate: tokenizer for {model:?} loaded in {ms} ms (block size {block_size})");
                self.fetches.loaded(&model);
                self.set_missing_gauge(&model, false);
                let loaded = LoadedModel { tokenizer: Rc::new(tokenizer), block_size, salt: Salt::NONE };
                self.shared.borrow_mut().models.insert(model, loaded);
                self.link_adapters();
            }
            Ok(_) => self.tokenizer_failed(&model, "the bundle has block size 0".into()),
            Err(e) => self.tokenizer_failed(&model, format!("the bundle does not load: {e}")),
        }
    }
}

impl<H: RootHost> Root<H> {
    /// Makes every adapter whose base model is loaded routable: same tokenizer, salted hashes.
    fn link_adapters(&mut self) {
        let mut shared = self.shared.borrow_mut();
        for adapter in &self.adapters {
            if shared.models.contains_key(&adapter.name) {
                continue;
            }
            let Some(base) = shared.models.get(&adapter.base) else { continue };
            let loaded = LoadedModel {
                tokenizer: base.tokenizer.clone(),
                block_size: base.block_size,
                salt: Salt::for_lora(Some(&adapter.name)),
            };
            shared.models.insert(adapter.name.clone(), loaded);
        }
    }
}

impl Default for Root {
    fn default() -> Self {
        Root::new()
    }
}

impl<H: RootHost> Root<H> {
    /// The answer to call `token` (`body_size` bytes of body) has come.
    pub fn answered(&mut self, token: u32, body_size: usize) {
        let Some(call) = self.calls.remove(&token) else { return };
        let status = self.host.call_status();
        let body = match status.as_deref() {
            Some("200") => self.host.call_body(body_size),
            _ => None,
        };
        // Another release's sidecar: its answer says which versions. Logged once per model-list
        // refresh, so it is in the log while it lasts.
        if status.as_deref() == Some("409") && matches!(call, Call::Models) {
            let said = self.host.call_body(body_size.min(512));
            let said = said.map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
            log::error!("kvgate: the sidecar refuses this filter: {said}");
        }
        match (call, body) {
            (Call::Models, Some(body)) => self.on_models(&body),
            (Call::Tokenizer(model), Some(body)) => self.on_tokenizer(model, &body),
            (Call::Tokenizer(model), None) => {
                let cause = match status {
                    Some(status) => format!("the sidecar answered {status}"),
                    None => "the sidecar did not answer".to_owned(),
                };
                self.tokenizer_failed(&model, cause);
            }
            (Call::Lifecycle(body, attempt), _) if status.as_deref() != Some("204") => {
                let cause = match status {
                    Some(status) => format!("answered {status}"),
                    None => "was not answered".to_owned(),
                };
                self.lifecycle_failed(body, attempt, &cause);
            }
            _ => {}
        }
    }
}

// The proxy-wasm entry points: Envoy's alone, each a thin call into the logic above.

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        self.answered(token, body_size);
    }

    /// The VM is shutting down (a reload): its gauges go to 0.
    fn on_done(&mut self) -> bool {
        if let Some(m) = &self.shared.borrow().metrics {
            m.shut_down(&self.host);
        }
        true
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, size: usize) -> bool {
        let bytes = if size == 0 {
            Vec::new()
        } else {
            hostcalls::get_buffer(BufferType::PluginConfiguration, 0, size).ok().flatten().unwrap_or_default()
        };
        let config = match FilterConfig::parse(&bytes) {
            Ok(c) => c,
            Err(e) => {
                log::error!("{e}");
                return false;
            }
        };
        if hostcalls::set_tick_period(Duration::from_millis(config.retry_ms)).is_err() {
            log::warn!("kvgate: cannot set the tick period; tokenizers load on first configure only");
        }
        let queue = hostcalls::register_shared_queue(LIFECYCLE_QUEUE).ok();
        let (defined, vm_tag) = {
            let shared = self.shared.borrow();
            (shared.metrics.clone(), shared.vm_tag)
        };
        let metrics = defined.or_else(|| FilterMetrics::define(&self.host, &format!("{:08x}", vm_tag as u32)));
        self.configure(config, queue, metrics);
        true
    }

    fn on_tick(&mut self) {
        self.tick();
    }

    fn on_queue_ready(&mut self, _queue_id: u32) {
        self.flush_lifecycle();
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        self.request_arrived();
        Some(Box::new(RequestContext::new(self.shared.clone(), context_id)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
