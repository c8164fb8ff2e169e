//! kvgate's proxy-wasm HTTP filter for Envoy (`wasm32-wasip1`).
//!
//! It buffers OpenAI request bodies, computes the prompt's token ids exactly as vLLM would
//! (chat template + the model's `tokenizer.json`), hashes the full blocks, asks the sidecar
//! which replica to use, and sets `x-gateway-destination-endpoint` for Envoy's
//! `override_host` load-balancing policy. It fails open: whatever goes wrong, the request
//! continues without the header and Envoy's fallback LB picks a host.
//!
//! | module | responsibility |
//! |---|---|
//! | [`config`] | the plugin configuration |
//! | [`breaker`] | the circuit breaker: whether requests ask the sidecar, after how many failures they stop, when one probes (pure) |
//! | [`plan`] | body → route request (pure, natively testable) |
//! | [`disagg`] | the bodies of a disaggregated request's prefill and decode legs (pure) |
//! | [`fetches`] | when to (re)fetch each model's tokenizer (pure) |
//! | [`redelivery`] | lifecycle batches to send again, with backoff (pure) |
//! | [`root`] | tokenizer loading, lifecycle batching (one per VM) |
//! | [`shared`] | what the root and the HTTP contexts of one VM share |
//! | [`request`] | the per-request state machine, a phase enum run natively against a [`host::Host`] |
//! | [`http`] | the proxy-wasm adapter: Envoy's HTTP context callbacks passed on to [`request::Request`] |
//! | [`host`] | the host behind traits (`Host` per request, `RootHost` per VM); hostcalls that return errors instead of panicking |
//! | [`metrics`] | the filter's counters and histograms in Envoy's stats |
//! | [`usage`] | asking the engine for `usage` on a streaming client's behalf, and taking it back out (pure) |

pub mod breaker;
pub mod config;
pub mod disagg;
pub mod fetches;
pub mod host;
pub mod http;
pub mod logger;
pub mod metrics;
pub mod plan;
pub mod redelivery;
pub mod request;
pub mod root;
pub mod shared;
pub mod usage;

proxy_wasm::main! {{
    logger::install();
    proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> { Box::new(root::Root::new()) });
}}
