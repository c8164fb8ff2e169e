//! The root context (one per Envoy worker VM): loads tokenizers from the sidecar and sends
//! lifecycle reports in batches.
//!
//! - **Tokenizers.** On configure, on every tick until all are loaded, and every
//!   `models_refresh_ms` after that, it asks the sidecar for its models and LoRA adapters
//!   (`GET /v1/models`) and fetches each missing bundle (`GET /v1/models/{model}/tokenizer`).
//!   Until a model is loaded its requests are routed on load alone; they are never held back.
//!   An adapter shares its base model's tokenizer; adapters (and models) the sidecar no longer
//!   lists are dropped, so their requests pass through again.
//! - **Lifecycle.** HTTP contexts push reports onto a shared queue; the root drains it when
//!   Envoy signals the queue and on every tick, and POSTs one batch. (Calls made from a dying
//!   HTTP context are cancelled by Envoy, so they must not send them themselves.)

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::time::{Duration, SystemTime};

use kvgate_shared::codec;
use kvgate_shared::hash::Salt;
use kvgate_shared::prompt::tokenizer::ModelTokenizer;
use kvgate_shared::wire::{Adapter, LifecycleBatch, LifecycleEvent, ModelBundle, ModelList, CONTENT_TYPE};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, MapType};

use crate::config::FilterConfig;
use crate::http::RequestContext;
use crate::metrics::FilterMetrics;
use crate::plan::LoadedModel;

/// Name of the shared queue carrying encoded [`LifecycleEvent`]s.
pub const LIFECYCLE_QUEUE: &str = "kvgate_lifecycle";

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
}

enum Call {
    Models,
    Tokenizer(String),
    Lifecycle,
}

/// The root context.
pub struct Root {
    shared: Rc<RefCell<Shared>>,
    calls: HashMap<u32, Call>,
    fetching: HashSet<String>,
    /// When the model list was last applied (`None`: never, or a tokenizer failed and the
    /// list must be fetched again on the next tick).
    listed_at: Option<SystemTime>,
    adapters: Vec<Adapter>,
}

impl Root {
    /// A root with default settings until `on_configure`.
    pub fn new() -> Root {
        Root {
            shared: Rc::new(RefCell::new(Shared {
                config: FilterConfig::default(),
                models: HashMap::new(),
                listed: None,
                queue: None,
                metrics: None,
            })),
            calls: HashMap::new(),
            fetching: HashSet::new(),
            listed_at: None,
            adapters: Vec::new(),
        }
    }

    fn get(&mut self, path: &str, call: Call) {
        let (cluster, authority, timeout) = {
            let s = self.shared.borrow();
            (s.config.sidecar_cluster.clone(), s.config.sidecar_authority.clone(), s.config.fetch_timeout_ms)
        };
        let headers = vec![(":method", "GET"), (":path", path), (":authority", authority.as_str())];
        match hostcalls::dispatch_http_call(&cluster, headers, None, vec![], Duration::from_millis(timeout)) {
            Ok(token) => {
                self.calls.insert(token, call);
            }
            Err(status) => {
                log::warn!("kvgate: GET {path} to {cluster} failed to dispatch: {status:?}");
                if let Call::Tokenizer(model) = call {
                    self.fetching.remove(&model);
                }
            }
        }
    }

    fn refresh_models(&mut self) {
        let every = Duration::from_millis(self.shared.borrow().config.models_refresh_ms);
        let due = match self.listed_at {
            None => true,
            Some(at) => self.get_current_time().duration_since(at).is_ok_and(|age| age >= every),
        };
        if due && !self.calls.values().any(|c| matches!(c, Call::Models)) {
            self.get("/v1/models", Call::Models);
        }
    }

    fn flush_lifecycle(&mut self) {
        let (queue, cluster, authority, timeout) = {
            let s = self.shared.borrow();
            let Some(q) = s.queue else { return };
            (q, s.config.sidecar_cluster.clone(), s.config.sidecar_authority.clone(), s.config.fetch_timeout_ms)
        };
        let mut batch = LifecycleBatch::default();
        while let Ok(Some(item)) = hostcalls::dequeue_shared_queue(queue) {
            if let Ok(event) = codec::decode::<LifecycleEvent>(&item) {
                batch.events.push(event);
            }
        }
        if batch.events.is_empty() {
            return;
        }
        let Ok(body) = codec::encode(&batch) else { return };
        let headers = vec![
            (":method", "POST"),
            (":path", "/v1/lifecycle"),
            (":authority", authority.as_str()),
            ("content-type", CONTENT_TYPE),
        ];
        match hostcalls::dispatch_http_call(&cluster, headers, Some(&body), vec![], Duration::from_millis(timeout)) {
            Ok(token) => {
                self.calls.insert(token, Call::Lifecycle);
            }
            Err(status) => log::warn!("kvgate: dropped {} lifecycle reports: {status:?}", batch.events.len()),
        }
    }

    fn on_models(&mut self, body: &[u8]) {
        let Ok(list) = codec::decode::<ModelList>(body) else {
            log::warn!("kvgate: undecodable model list from the sidecar");
            return;
        };
        self.listed_at = Some(self.get_current_time());
        let names: HashSet<String> =
            list.models.iter().cloned().chain(list.adapters.iter().map(|a| a.name.clone())).collect();
        {
            let mut shared = self.shared.borrow_mut();
            shared.models.retain(|name, _| names.contains(name));
            shared.listed = Some(names);
        }
        self.adapters = list.adapters;
        self.link_adapters();
        for model in list.models {
            let loaded = self.shared.borrow().models.contains_key(&model);
            if !loaded && self.fetching.insert(model.clone()) {
                self.get(&format!("/v1/models/{model}/tokenizer"), Call::Tokenizer(model));
            }
        }
    }

    fn on_tokenizer(&mut self, model: String, body: &[u8]) {
        let budget = self.shared.borrow().config.segment_cache_bytes;
        let loaded = codec::decode::<ModelBundle>(body).map_err(|e| e.to_string()).and_then(|bundle| {
            let tokenizer = ModelTokenizer::from_bundle(&bundle).map_err(|e| e.to_string())?;
            Ok((bundle.block_size, tokenizer.with_segment_cache(budget)))
        });
        match loaded {
            Ok((block_size, tokenizer)) if block_size > 0 => {
                log::info!("kvgate: tokenizer for {model:?} loaded (block size {block_size})");
                let loaded = LoadedModel { tokenizer: Rc::new(tokenizer), block_size, salt: Salt::NONE };
                self.shared.borrow_mut().models.insert(model, loaded);
                self.link_adapters();
            }
            Ok(_) => log::warn!("kvgate: bundle for {model:?} has block size 0"),
            Err(e) => {
                log::warn!("kvgate: tokenizer for {model:?} unusable: {e}");
                // Retried on the next model listing.
                self.listed_at = None;
            }
        }
    }
}

impl Root {
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

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, _headers: usize, body_size: usize, _trailers: usize) {
        let Some(call) = self.calls.remove(&token) else { return };
        let status = hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status").ok().flatten();
        let body = match status.as_deref() {
            Some("200") => hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size).ok().flatten(),
            _ => None,
        };
        match (call, body) {
            (Call::Models, Some(body)) => self.on_models(&body),
            (Call::Tokenizer(model), Some(body)) => {
                self.fetching.remove(&model);
                self.on_tokenizer(model, &body);
            }
            (Call::Tokenizer(model), None) => {
                self.fetching.remove(&model);
                self.listed_at = None;
            }
            (Call::Lifecycle, _) if status.as_deref() != Some("204") => {
                log::warn!("kvgate: lifecycle batch answered {status:?}");
            }
            _ => {}
        }
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
        let retry = Duration::from_millis(config.retry_ms);
        {
            let mut s = self.shared.borrow_mut();
            s.config = config;
            s.queue = hostcalls::register_shared_queue(LIFECYCLE_QUEUE).ok();
            s.metrics = FilterMetrics::define();
        }
        if hostcalls::set_tick_period(retry).is_err() {
            log::warn!("kvgate: cannot set the tick period; tokenizers load on first configure only");
        }
        self.refresh_models();
        true
    }

    fn on_tick(&mut self) {
        self.refresh_models();
        self.flush_lifecycle();
    }

    fn on_queue_ready(&mut self, _queue_id: u32) {
        self.flush_lifecycle();
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(RequestContext::new(self.shared.clone(), context_id)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
