//! kvgate's sidecar as a library: the binary (`main.rs`) wires these modules together, and
//! tests and benchmarks use them directly.
//!
//! | module | responsibility |
//! |---|---|
//! | [`accuracy`] | each prediction checked against the engine's `usage`, and the alarm |
//! | [`config`] | the TOML file + `KVGATE_*` environment, validated |
//! | [`discovery`] | each pool's replicas at run time: file reload, DNS, the local Envoy |
//! | [`events`] | KV events: decoding, ingestion, the ZMQ transport, the pool's applier |
//! | [`index`] | which replica holds which prefix blocks |
//! | [`load`] | per-replica token load from route decisions and lifecycle reports |
//! | [`score`] | Dynamo's cost function and the argmin |
//! | [`pool`] | one model's replicas: index + load + the routing decision |
//! | [`api`] | the HTTP API for the filter and operators |
//! | [`metrics`] | Prometheus metrics |
//! | [`niceness`] | background threads give way to the API for the CPU |
//! | [`sync`] | bookings shared with the other gateways' sidecars |
//! | [`tools`] | operator CLI tools (`events decode`, `events tap`) |

// One call into libc (`niceness`) is the only unsafe code, allowed there alone.
#![deny(unsafe_code)]

pub mod accuracy;
pub mod admission;
pub mod api;
pub mod config;
pub mod discovery;
pub mod events;
pub mod index;
pub mod load;
pub mod metrics;
pub mod niceness;
pub mod poll;
pub mod pool;
pub mod score;
pub mod sync;
pub mod tools;
