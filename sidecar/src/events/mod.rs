//! KV-cache events from the engines.
//!
//! - [`decode`]: one msgpack payload → an [`decode::EventBatch`], for every vLLM layout from
//!   0.9 (positional arrays) to 0.33 (tagged maps), and SGLang's.
//! - [`ingest`]: one replica's stream → index operations: sequence numbers, replay of gaps,
//!   restarts, degraded state, tiers, salts, KV-group filtering. Pure, unit-tested.
//! - [`transport`]: the ZMQ sockets and threads (SUB reader → bounded queue → applier; DEALER
//!   replay).

pub mod decode;
pub mod ingest;
pub mod transport;
