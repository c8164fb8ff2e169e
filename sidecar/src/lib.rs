//! kvgate's sidecar as a library: the binary (`main.rs`) wires these modules together, and
//! tests and benchmarks use them directly.
//!
//! | module | responsibility |
//! |---|---|
//! | [`index`] | which replica holds which prefix blocks |
//! | [`score`] | Dynamo's cost function and the argmin |
//! | [`watch`] | a check's last verdicts and the alarm they drive |
//! | [`latency`] | each replica's time to first token, predicted from what it faces and learned online |
//! | [`accuracy`] | each prediction checked against the engine's `usage` (and each TTFT prediction against the gateway's measurement), and the alarms |
//! | [`msg`] | what the pool and its drivers pass each other (ingest outcomes, sync events, handover) |
//! | [`load`] | per-replica token load from route decisions, lifecycle reports and engines' own figures |
//! | [`admission`] | whether a replica is saturated, and the queue of requests waiting for capacity |
//! | [`pool`] | one model's replicas: index + load + the routing decision |
//! | [`events`] | driver: KV events — decoding, ingestion, the ZMQ transport, the pool's applier |
//! | [`sync`] | driver: bookings shared with the other gateways' sidecars, the handover, and the view saved for a restart |
//! | [`engine_poller`] | driver: each engine's `/metrics`, polled for the load it reports |
//! | [`discovery`] | driver: each pool's replicas at run time — file reload, DNS, the local Envoy |
//! | [`api`] | driver: the HTTP API for the filter and operators |
//! | [`poll`] | the background poller the drivers share |
//! | [`health`] | the background threads' heartbeats and the stop flag; what `/healthz` says |
//! | [`metrics`] | Prometheus metrics |
//! | [`niceness`] | background threads give way to the API for the CPU |
//! | [`heap`] | the heap's free pages given back after the tokenizers load |
//! | [`config`] | the TOML file + `KVGATE_*` environment, validated; each section owned by its module |
//! | [`tools`] | operator CLI tools (`events decode`, `events tap`) |
//!
//! Layers, bottom up: `health`, `heap`; `watch`; `index`, `latency`, `metrics`, `niceness`, `poll`; `score`, `accuracy`, `msg`;
//! `load`; `admission`; `pool`; the drivers `events`, `sync`, `engine_poller`, `api`;
//! `discovery`; `config` (the file as a whole, above every module whose section it reads)
//! and `tools`. Each module owns its config section (`config.rs` says which). A module imports only from layers below its own
//! (`tests/layers.rs` checks every `crate::` path).

// Two calls into libc (`niceness`, `heap`) are the only unsafe code, allowed there alone.
#![deny(unsafe_code)]

pub mod accuracy;
pub mod admission;
pub mod api;
pub mod config;
pub mod discovery;
pub mod engine_poller;
pub mod events;
pub mod health;
pub mod heap;
pub mod index;
pub mod latency;
pub mod load;
pub mod metrics;
pub mod msg;
pub mod niceness;
pub mod poll;
pub mod pool;
pub mod score;
pub mod sync;
pub mod tools;
pub mod watch;
