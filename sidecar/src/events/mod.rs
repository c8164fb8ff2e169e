//! KV-cache events from the engines: the wire decoder and the per-replica ZMQ subscriber.
//!
//! - [`decode`] turns one msgpack payload into an [`decode::EventBatch`], accepting every vLLM
//!   layout from 0.9 (positional arrays) to 0.33 (tagged maps).
//! - [`subscriber`] owns one ZMQ SUB socket per replica, checks sequence numbers and applies
//!   decoded batches to the pool's index.

pub mod decode;
pub mod subscriber;
